//! The system calls the shm provider needs, each wrapped once: memfds with seals, shared
//! mappings, futexes on shared words, and descriptor passing over a Unix socket.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU32;
#[cfg(test)]
use std::time::Duration;

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A new memfd of `len` bytes (sparse), sealed so that nobody can shrink or grow it: a peer
/// that maps it can never get SIGBUS from a truncation.
pub(crate) fn sealed_memfd(name: &str, len: u64) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `cname` is a valid NUL-terminated string for the duration of the call.
    let fd = check(unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) })?;
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: a plain syscall on a descriptor we own.
    check(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: a plain syscall on a descriptor we own.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
    Ok(fd)
}

/// Checks that a descriptor a peer sent is a plain memfd sealed against shrinking, and gives
/// its size. Anything else could hurt the process that maps it: a file the peer can truncate,
/// or a hugetlbfs memfd with no huge pages behind it, raises SIGBUS at the first touch; a file
/// of another file system is not memory the peer handed over. The caller checks the size.
pub(crate) fn peer_memfd(fd: &OwnedFd) -> io::Result<u64> {
    let refuse = |why: &str| Err(io::Error::new(io::ErrorKind::InvalidData, why.to_owned()));
    // SAFETY: `st` is a plain C struct fstat fills in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is valid for writes; a plain syscall on a descriptor we own.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return refuse("the peer's memory is not a regular file (a memfd)");
    }
    // SAFETY: `fs` is a plain C struct fstatfs fills in.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fs` is valid for writes; a plain syscall on a descriptor we own.
    check(unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) })?;
    if fs.f_type != libc::TMPFS_MAGIC {
        return refuse(if fs.f_type == libc::HUGETLBFS_MAGIC {
            "the peer's memory is a hugetlbfs memfd, which can raise SIGBUS when touched: only plain memfds are mapped"
        } else {
            "the peer's memory is not a memfd (another file system)"
        });
    }
    // SAFETY: a plain syscall on a descriptor we own.
    let seals = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })?;
    if seals & libc::F_SEAL_SHRINK == 0 {
        return refuse("the peer's memory is not sealed against shrinking");
    }
    u64::try_from(st.st_size).or_else(|_| refuse("the peer's memory has a negative size"))
}

/// Checks that a descriptor a peer sent as a doorbell is an eventfd: anything else (a pipe
/// it never drains, a socket) could block or fail the writes that ring it.
pub(crate) fn peer_eventfd(fd: &OwnedFd) -> io::Result<()> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    if link.as_os_str() != "anon_inode:[eventfd]" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the peer's doorbell is not an eventfd ({})", link.display()),
        ));
    }
    Ok(())
}

/// The credentials of the peer at the other end of `sock`, as the kernel saw it connect.
fn peer_cred(sock: &UnixStream) -> io::Result<libc::ucred> {
    // SAFETY: `cred` is a plain C struct getsockopt fills in.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and describe each other.
    check(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    Ok(cred)
}

/// The user id of the peer at the other end of `sock`.
pub(crate) fn peer_uid(sock: &UnixStream) -> io::Result<u32> {
    peer_cred(sock).map(|c| c.uid)
}

/// The process id of the peer at the other end of `sock`.
pub(crate) fn peer_pid(sock: &UnixStream) -> io::Result<i32> {
    peer_cred(sock).map(|c| c.pid)
}

/// This process's effective user id.
pub(crate) fn own_uid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// A shared read-write mapping of a whole memfd, unmapped on drop.
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access through it goes through raw
// pointers or atomics, whose synchronisation the users provide.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn map(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
        Self::map_as(fd, len, true)
    }

    /// A read-only shared mapping (the kernel refuses a writable one of a descriptor opened
    /// read-only, and refuses making this one writable later).
    pub(crate) fn map_read_only(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
        Self::map_as(fd, len, false)
    }

    fn map_as(fd: &OwnedFd, len: usize, writable: bool) -> io::Result<Mapping> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: mapping a descriptor we own; the kernel picks the address; the result is
        // checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: ptr.cast(), len })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; nothing uses the mapping after
        // its owner dropped it.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A new descriptor of the same memfd, opened read-only: what a peer is given where it may only
/// read. Nothing it does with it (mmap, mprotect, write) can write the memory.
pub(crate) fn reopen_read_only(fd: &OwnedFd) -> io::Result<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `path` is a valid NUL-terminated string for the duration of the call.
    let r = check(unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) })?;
    // SAFETY: open returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// Sleeps while `*word == seen`, at most `timeout` (a shared futex: works across processes).
#[cfg(test)]
pub(crate) fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the call; the kernel only reads it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        )
    };
}

/// Wakes every sleeper on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE does not touch memory.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

/// Sends `bytes` with `fds` attached (SCM_RIGHTS).
pub(crate) fn send_with_fds(sock: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    send_with(sock, bytes, fds, libc::MSG_NOSIGNAL)
}

/// As [`send_with_fds`], but `WouldBlock` where the socket's buffer is full.
pub(crate) fn send_with_fds_nowait(sock: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    send_with(sock, bytes, fds, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
}

fn send_with(sock: &UnixStream, bytes: &[u8], fds: &[RawFd], flags: libc::c_int) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: a zeroed msghdr is valid; the fields are filled below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer is `space` bytes, room for one header and `fds`.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
    }
    // SAFETY: `msg` points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short sendmsg"));
    }
    Ok(())
}

/// Receives one message of at most `max` bytes and the descriptors attached to it.
pub(crate) fn recv_with_fds(sock: &UnixStream, max: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    recv_with_fds_flags(sock, max, 0)
}

/// As [`recv_with_fds`], without waiting: `None` when nothing is there.
pub(crate) fn recv_with_fds_now(sock: &UnixStream, max: usize) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    match recv_with_fds_flags(sock, max, libc::MSG_DONTWAIT) {
        Ok(got) => Ok(Some(got)),
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(None),
        Err(e) => Err(e),
    }
}

fn recv_with_fds_flags(sock: &UnixStream, max: usize, flags: i32) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; max];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = vec![0u64; 64];
    // SAFETY: a zeroed msghdr is valid; the fields are filled below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = cbuf.len() * 8;
    // SAFETY: `msg` points at live buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC | flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the peer closed the socket",
        ));
    }
    buf.truncate(n as usize);
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`, within its length.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the descriptors that came with it were cut short: this process is likely at its limit of open files \
             (RLIMIT_NOFILE: raise it with `ulimit -n`, or hold fewer connections)",
        ));
    }
    Ok((buf, fds))
}

/// Lines a prefetch or a demotion covers at most in a message longer than `WHOLE`: its first
/// lines, where its header is, which the receiving core reads first.
const HEAD_LINES: usize = 4;

/// Messages up to this long are covered whole: a receiver most often copies a short message out
/// whole (rdma-rpc copies bodies under 512 bytes with their header out of the slot), and a
/// line left uncovered crosses cores on demand, on the receiver's path (docs/decisions.md).
const WHOLE: usize = 512;

/// How many lines from the one holding `addr` reach the one holding byte `addr + len - 1`:
/// all of them for a message of at most `WHOLE` bytes, else at most `HEAD_LINES`.
fn head_lines(addr: usize, len: usize) -> usize {
    let n = (addr % 64).saturating_add(len).div_ceil(64);
    if len <= WHOLE {
        n
    } else {
        n.min(HEAD_LINES)
    }
}

/// Asks the CPU to start fetching the cache lines of `len` bytes at `p` (all of a short
/// message, the first `HEAD_LINES` of a longer one: see `head_lines`), for writing when
/// `write`: a hint, which never faults or changes memory.
pub(crate) fn prefetch(p: *const u8, len: usize, write: bool) {
    for i in 0..head_lines(p as usize, len) {
        let at = p.wrapping_add(i * 64);
        // A prefetch is a hint: it never faults, whatever the address, and changes no memory.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: _mm_prefetch only hints the cache; no address makes it fault or write.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
            if write {
                _mm_prefetch::<_MM_HINT_ET0>(at.cast());
            } else {
                _mm_prefetch::<_MM_HINT_T0>(at.cast());
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (at, write);
    }
}

/// Asks the CPU to move the cache lines this core just wrote for another core (all of a
/// short message, the first `HEAD_LINES` of a longer one, which that core reads first: see
/// `head_lines`) from this core's own caches to the shared last-level cache (`cldemote`), where
/// the reader finds them without snooping this core: where a NIC's DMA write lands, with DDIO.
/// Only the head of a long one: demoting a whole 4 KiB buffer made the writer fetch it back for
/// its next write (raw 4 KiB Sends took twice as long on shm), for readers that mostly never
/// read past the header.
///
/// # Safety
/// `[p, p + len)` must lie in memory mapped into this process for as long as the call runs.
pub(crate) unsafe fn demote(p: *const u8, len: usize) {
    // SAFETY: this function's contract.
    unsafe { demote_lines(p, head_lines(p as usize, len)) }
}

/// Demotes `lines` lines from the one holding `p` on.
///
/// # Safety
/// As [`demote`], for those lines.
unsafe fn demote_lines(p: *const u8, lines: usize) {
    let p = (p as usize & !63) as *const u8;
    for i in 0..lines {
        let at = p.wrapping_add(i * 64);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `at` is inside mapped memory (this function's contract); CLDEMOTE
        // (NP 0F 1C /0) is a hint that changes no architectural state (Intel SDM), and runs
        // as a NOP on processors without it, whose decoders reserve that encoding as one.
        unsafe {
            std::arch::asm!("cldemote [{0}]", in(reg) at, options(nostack, preserves_flags, readonly));
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = at;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_covers_the_lines_of_the_bytes_and_no_more_than_its_cap() {
        assert_eq!(head_lines(4096, 0), 0);
        assert_eq!(head_lines(4096, 1), 1);
        assert_eq!(head_lines(4096, 64), 1);
        assert_eq!(head_lines(4096, 65), 2);
        // Unaligned: 2 bytes across a line boundary are two lines.
        assert_eq!(head_lines(4096 + 63, 2), 2);
        assert_eq!(head_lines(4096 + 8, 120), 2);
        assert_eq!(head_lines(4096 + 8, 1 << 20), HEAD_LINES);
        // Short messages are covered whole, longer ones by their head.
        assert_eq!(head_lines(4096, 280), 5);
        assert_eq!(head_lines(4096, WHOLE), WHOLE / 64);
        assert_eq!(head_lines(4096 + 63, WHOLE), WHOLE / 64 + 1);
        assert_eq!(head_lines(4096, WHOLE + 1), HEAD_LINES);
        assert_eq!(head_lines(usize::MAX - 3, usize::MAX), HEAD_LINES);
        // Prefetching never faults, even where nothing is mapped.
        prefetch(std::ptr::null(), 256, false);
        prefetch(std::ptr::null(), 256, true);
    }

    #[test]
    fn demoting_lines_leaves_their_bytes_as_they_are() {
        let mut v: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let before = v.clone();
        // SAFETY: every range below lies inside `v`.
        unsafe {
            // Unaligned start, and lengths past the cap and inside one line.
            demote(v.as_ptr().wrapping_add(3), 900);
            demote(v.as_ptr(), 1);
            demote(v.as_ptr(), 0);
        }
        assert_eq!(v, before);
        v[0] = 7;
        // SAFETY: the first 64 bytes of `v`.
        unsafe { demote(v.as_ptr(), 64) };
        assert_eq!(v[0], 7);
        assert_eq!(v[1..], before[1..]);
    }
}
