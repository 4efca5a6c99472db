//! Where the calling thread runs, and moving it off a CPU: for a poller about to spin on a
//! peer that shares its core (`QueuePair::peer_shares_cpu`).

/// The CPU the calling thread runs on now (it may run elsewhere a moment later), if the
/// kernel tells.
pub(crate) fn current_cpu() -> Option<u32> {
    // glibc's, not rustix's: glibc reads the CPU from the thread's rseq area (or the vDSO),
    // rustix makes a getcpu syscall each time.
    // SAFETY: sched_getcpu takes no arguments and touches no memory of ours.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).ok()
}

/// Moves the calling thread off CPU `cpu` to another CPU it may run on, and gives it back its
/// affinity mask at once: the kernel migrates a thread when its mask leaves out the CPU it is
/// on, and leaves it where it is when the mask comes back. False, and nothing changed, when the
/// thread may run on `cpu` alone (pinned there: its owner's choice), may not run there (it
/// is not there), or the kernel refused.
pub(crate) fn leave_cpu(cpu: u32) -> bool {
    use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
    let cpu = cpu as usize;
    if cpu >= CpuSet::MAX_CPU {
        return false; // beyond what a mask can name here
    }
    let Ok(mask) = sched_getaffinity(None) else {
        return false;
    };
    if !mask.is_set(cpu) || mask.count() < 2 {
        return false;
    }
    let mut elsewhere = mask;
    elsewhere.unset(cpu);
    if sched_setaffinity(None, &elsewhere).is_err() {
        return false;
    }
    if let Err(e) = sched_setaffinity(None, &mask) {
        // Left on the narrower mask: still every CPU it had but one.
        tracing::warn!(%e, cpu, "could not give a thread back its CPU affinity");
    }
    true
}
