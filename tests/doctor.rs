//! `rdma-rpc-doctor`: every line it prints is `ok`, `warn` or `FAIL`, and each that is not `ok`
//! says what to do; on a host without a device it says how to get one or what to use instead;
//! with `RDMA_RPC_PROVIDER=verbs` (the VM lane, rxe0) it finds the device, its active port and
//! the GID of the test address; and against a `--listen` peer it measures a ping-pong, RDMA
//! Write bandwidth and CPU per byte beside TCP.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// The doctor binary: next to the tests' directory (cargo's layout, and the VM lane's).
fn doctor() -> PathBuf {
    if let Some(p) = option_env!("CARGO_BIN_EXE_rdma-rpc-doctor")
        .map(PathBuf::from)
        .filter(|p| p.exists())
    {
        return p;
    }
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let p = dir.join("rdma-rpc-doctor");
    assert!(p.exists(), "{} is missing: build the binary", p.display());
    p
}

fn ip() -> String {
    std::env::var("RDMA_RPC_TEST_IP").unwrap_or_else(|_| "127.0.0.1".into())
}

fn provider() -> String {
    std::env::var("RDMA_RPC_PROVIDER").unwrap_or_else(|_| "tcp".into())
}

/// Checks the form of a report: each finding starts with its level; each that is not `ok`
/// is followed by what to do.
fn well_formed(out: &str) {
    let lines: Vec<&str> = out.lines().filter(|l| !l.starts_with("listening on")).collect();
    assert!(!lines.is_empty(), "no output");
    for (i, l) in lines.iter().enumerate() {
        if l.starts_with("       -> ") {
            continue;
        }
        assert!(
            l.starts_with("ok   ") || l.starts_with("warn ") || l.starts_with("FAIL "),
            "a line without its level: {l:?} in\n{out}"
        );
        if !l.starts_with("ok") {
            let next = lines.get(i + 1).copied().unwrap_or("");
            assert!(
                next.starts_with("       -> "),
                "{l:?} says nothing of what to do:\n{out}"
            );
        }
    }
}

#[test]
fn every_line_is_a_finding_and_each_not_ok_says_what_to_do() {
    let out = Command::new(doctor())
        .args(["--ip", &ip()])
        .output()
        .expect("run the doctor");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    well_formed(&text);
    assert!(
        text.contains("ok   provider tcp: available") && text.contains("ok   provider shm: available"),
        "{text}"
    );
    assert!(text.contains("memlock limit"), "{text}");
    if provider() == "verbs" {
        // The VM lane: rxe0 on the test address.
        assert!(text.contains("ok   provider verbs: device"), "{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("ok   device") && l.contains("ACTIVE")),
            "{text}"
        );
        assert!(text.contains(&format!("ok   {} is GID", ip())), "{text}");
        assert!(text.contains("soft-RoCE: no PFC/ECN"), "{text}");
    } else if !std::path::Path::new("/sys/class/infiniband").exists() {
        // No device: it says so, and what to use instead.
        assert!(text.contains("warn no RDMA device"), "{text}");
        assert!(
            text.contains("provider tcp") && text.contains("shm (one host)"),
            "{text}"
        );
        assert!(text.contains(&format!("FAIL {} is no GID", ip())), "{text}");
        assert_eq!(out.status.code(), Some(1), "a failed check exits 1");
    }
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn against_a_listening_peer_it_measures_latency_bandwidth_and_cpu_per_byte() {
    let p = provider();
    let mut server = Kill(
        Command::new(doctor())
            .args(["--provider", &p, "--listen", &format!("{}:0", ip())])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the listening doctor"),
    );
    let mut out = BufReader::new(server.0.stdout.take().expect("stdout"));
    let addr = loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).expect("read") > 0,
            "the listening doctor ended"
        );
        if let Some(rest) = line.strip_prefix("listening on ") {
            break rest.split_whitespace().next().expect("an address").to_string();
        }
    };
    let run = Command::new(doctor())
        .args(["--provider", &p, "--peer", &addr])
        .output()
        .expect("run the doctor");
    let text = String::from_utf8_lossy(&run.stdout).into_owned();
    well_formed(&text);
    for want in [
        "ok   Send ping-pong 64 B",
        "ok   RDMA Write 128 MiB",
        "ok   TCP 128 MiB",
    ] {
        assert!(text.contains(want), "no {want:?} in\n{text}");
    }
    assert!(
        text.lines()
            .any(|l| l.contains("CPU per byte") || l.contains("offload works")),
        "{text}"
    );
    assert!(!text.contains(&format!("FAIL peer {addr}")), "{text}");
}
