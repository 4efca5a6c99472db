//! `shm` connects processes of one user: a process of another user is refused at the
//! handshake, before any memory changes hands, whichever side it is on, unless both sides
//! opened the device as `shm:any-user`. The other user is `nobody` (65534): the helper process
//! is this test binary, copied where that user may run it and started under its uid, so the
//! test needs root. Without root it fails when `RDMA_RPC_REQUIRE_NETNS` is set (as in
//! `scripts/test.sh`), and says it did not run otherwise.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use rdma_rpc_transport::{connect, Device, Error, Listener, QpOptions};

const ROLE_ENV: &str = "RDMA_RPC_SHM_USERS_ROLE";
const NOBODY: u32 = 65534;
const WAIT: Duration = Duration::from_secs(20);

/// Not a test: the process of the other user. `connect <spec> <addr>` connects and prints
/// `CONNECTED` or `REFUSED <error>`; `listen <spec>` listens, prints `LISTEN <addr>`, takes one
/// request and prints `ACCEPTED` or `REFUSED <error>`.
#[test]
#[ignore = "helper process for the shm user tests"]
fn other_user() {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    let words: Vec<&str> = role.split(' ').collect();
    let dev = Device::open(words[1]).expect("device");
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
    let opts = QpOptions::new(&pd, &cq);
    match words[0] {
        "connect" => match connect(words[2], &opts, b"", WAIT) {
            Ok(_) => println!("CONNECTED"),
            Err(e) => println!("REFUSED {e}"),
        },
        "listen" => {
            let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
            println!("LISTEN {}", listener.local_addr().expect("addr"));
            match listener.accept(Some(WAIT)).map(|r| r.accept(&opts, b"")) {
                Ok(Ok(_qp)) => println!("ACCEPTED"),
                Ok(Err(e)) | Err(e) => println!("REFUSED {e}"),
            }
        }
        other => panic!("unknown role {other}"),
    }
}

/// Whether this process may start one of another user; `false` means the test did not run.
fn may_switch_users() -> bool {
    // SAFETY: geteuid touches no memory.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var_os("RDMA_RPC_REQUIRE_NETNS").is_none(),
        "the shm user tests need root to start a process of another user"
    );
    eprintln!("shm user tests: not run (they need root to start a process of another user)");
    false
}

/// This test binary, copied once where `nobody` may run it.
fn helper_exe() -> &'static PathBuf {
    static EXE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        use std::os::unix::fs::PermissionsExt;
        let src = std::env::current_exe().expect("exe");
        let name = src.file_name().expect("a file name").to_string_lossy().into_owned();
        let dst = std::env::temp_dir().join(format!("rdma-rpc-{name}"));
        std::fs::copy(&src, &dst).expect("copy the test binary");
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        dst
    })
}

/// Starts the helper as `nobody` in `role`; returns the child and its stdout's lines.
fn as_nobody(
    role: &str,
) -> (
    std::process::Child,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
) {
    let mut child = Command::new(helper_exe())
        .args(["--ignored", "--exact", "other_user", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .uid(NOBODY)
        .gid(NOBODY)
        .current_dir(std::env::temp_dir())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the helper as nobody");
    let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    (child, lines)
}

/// The helper's first line that holds one of `words`, from that word on (libtest may print
/// the test's name in front of it).
fn line_with(lines: &mut impl Iterator<Item = std::io::Result<String>>, words: &[&str]) -> String {
    lines
        .map(|l| l.expect("the helper's output"))
        .find_map(|l| words.iter().find_map(|w| l.find(w)).map(|at| l[at..].trim().to_owned()))
        .unwrap_or_else(|| panic!("the helper printed none of {words:?}"))
}

#[test]
fn a_client_of_another_user_is_refused_before_any_memory_changes_hands() {
    if !may_switch_users() {
        return;
    }
    let dev = Device::open("shm").expect("shm");
    let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (mut child, mut lines) = as_nobody(&format!("connect shm {addr}"));
    let said = line_with(&mut lines, &["CONNECTED", "REFUSED"]);
    // The refused request never reached `accept`: the listener refused it at the handshake.
    let got = listener.accept(Some(Duration::from_millis(200)));
    assert!(got.is_err(), "a request of another user reached the application");
    assert!(
        said.starts_with("REFUSED") && said.contains(&format!("uid {NOBODY}")) && said.contains("shm:any-user"),
        "the other user's client: {said}"
    );
    assert!(child.wait().expect("the helper").success());
}

#[test]
fn a_server_of_another_user_gets_no_memory_of_ours() {
    if !may_switch_users() {
        return;
    }
    let (mut child, mut lines) = as_nobody("listen shm");
    let said = line_with(&mut lines, &["LISTEN"]);
    let addr: SocketAddr = said["LISTEN ".len()..].trim().parse().expect("addr");
    let dev = Device::open("shm").expect("shm");
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
    match connect(addr, &QpOptions::new(&pd, &cq), b"", WAIT) {
        Err(Error::PeerUser { peer, .. }) => assert_eq!(peer, NOBODY),
        Err(e) => panic!("refused, but as {e}"),
        Ok(_) => panic!("connected to a server of another user"),
    }
    // The server side never saw a handshake (we sent nothing): its accept times out.
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn any_user_on_both_sides_connects_users() {
    if !may_switch_users() {
        return;
    }
    let dev = Device::open("shm:any-user").expect("shm:any-user");
    assert_eq!(dev.provider(), "shm");
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
    let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (mut child, mut lines) = as_nobody(&format!("connect shm:any-user {addr}"));
    let _qp = listener
        .accept(Some(WAIT))
        .expect("the other user's request")
        .accept(&QpOptions::new(&pd, &cq), b"")
        .expect("accepted");
    assert_eq!(line_with(&mut lines, &["CONNECTED", "REFUSED"]), "CONNECTED");
    assert!(child.wait().expect("the helper").success());
}
