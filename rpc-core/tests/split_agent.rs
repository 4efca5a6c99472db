//! The server host's agent for suites split across two hosts (`common/split.rs`): it listens
//! on `RDMA_RPC_TEST_IP`, port 7900, and for each connection that says
//! `serve<TAB>K<TAB>BINARY<TAB>TEST` runs that test binary's test `TEST` as the server half of
//! its `K`th server, sends back the process's standard output line by line, and kills the
//! process when the connection's far end closes. A connection that says `quit` ends the agent.
//! Run by `scripts/wire-suites.sh` on host A of the two-host lane; `cargo test` leaves it out
//! (`test = false`).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::thread;

#[path = "common/split.rs"]
#[allow(dead_code)]
mod split;

fn main() -> ExitCode {
    let Some(me) = std::env::var("RDMA_RPC_TEST_IP")
        .ok()
        .and_then(|s| s.parse::<IpAddr>().ok())
    else {
        eprintln!("split_agent: set RDMA_RPC_TEST_IP to this host's address");
        return ExitCode::from(2);
    };
    let listener = match TcpListener::bind(SocketAddr::new(me, split::AGENT_PORT)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("split_agent: listening on {me}:{}: {e}", split::AGENT_PORT);
            return ExitCode::FAILURE;
        }
    };
    println!("split_agent: listening on {me}:{}", split::AGENT_PORT);
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let mut line = String::new();
        let Ok(reader) = conn.try_clone() else { continue };
        let mut reader = BufReader::new(reader);
        if reader.read_line(&mut line).is_err() {
            continue;
        }
        let words: Vec<&str> = line.trim_end().split('\t').collect();
        match words.as_slice() {
            ["quit"] => {
                println!("split_agent: quit");
                return ExitCode::SUCCESS;
            }
            ["serve", k, exe, name] => {
                let Ok(k) = k.parse::<usize>() else {
                    let _ = writeln!(&conn, "split_agent: a bad server number {k:?}");
                    continue;
                };
                let (exe, name) = (exe.to_string(), name.to_string());
                thread::spawn(move || run(conn, reader, &exe, &name, k));
            }
            _ => {
                let _ = writeln!(&conn, "split_agent: not understood: {line:?}");
            }
        }
    }
    ExitCode::FAILURE
}

/// Runs one server half, its output to `conn`, until it ends or `conn`'s far end closes.
fn run(conn: TcpStream, mut reader: BufReader<TcpStream>, exe: &str, name: &str, k: usize) {
    let mut child = match split::half_command(exe, name, k).spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(&conn, "split_agent: running {exe}: {e}");
            return;
        }
    };
    let pid = child.id();
    println!("split_agent: {name} server {k}: process {pid}");
    let out = child.stdout.take();
    let mut to_peer = match conn.try_clone() {
        Ok(c) => c,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
    };
    let copier = thread::spawn(move || {
        if let Some(out) = out {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if writeln!(to_peer, "{line}").is_err() {
                    break;
                }
            }
        }
    });
    // The far end closing (EOF or an error) is the word to stop.
    let mut sink = Vec::new();
    let _ = std::io::copy(&mut reader, &mut sink);
    let _ = child.kill();
    let status = child.wait();
    let _ = copier.join();
    println!("split_agent: {name} server {k}: process {pid} ended ({status:?})");
    let _ = conn.shutdown(std::net::Shutdown::Both);
}
