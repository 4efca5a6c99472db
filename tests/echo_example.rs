//! Runs `examples/echo` as two processes, server and client, on the provider named by
//! `RDMA_RPC_PROVIDER` (default `tcp`), and checks what the client reports.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// The example binary next to this test's (cargo builds examples for `cargo test`); built on
/// demand when this test runs alone.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir.join("examples").join(name);
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let ok = Command::new(cargo)
            .args(["build", "--example", name])
            .status()
            .expect("run cargo build")
            .success();
        assert!(ok, "cargo build --example {name}");
    }
    path
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn echo_server_and_client_run_as_two_processes() {
    let bin = example("echo");
    let ip = std::env::var("RDMA_RPC_TEST_IP").unwrap_or_else(|_| "127.0.0.1".into());
    let mut server = Kill(
        Command::new(&bin)
            .args(["--listen", &format!("{ip}:0")])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the server"),
    );
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the server's first line");
    let addr = line
        .strip_prefix("listening on ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected server output: {line:?}"))
        .to_string();
    let out = Command::new(&bin)
        .args(["--connect", &addr, "--sizes", "1,64,70000,1048576", "--iters", "20"])
        .output()
        .expect("run the client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("hello, echo client; 80 echoes verified byte for byte"),
        "{stdout}"
    );
    for size in ["1", "64", "70000", "1048576"] {
        assert!(
            stdout.lines().any(|l| l.split_whitespace().next() == Some(size)),
            "no row for {size}: {stdout}"
        );
    }
}
