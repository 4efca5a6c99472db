//! `rdma-rpc-doctor`: says whether RDMA works on this host, and what to do where it does not.
//!
//! ```text
//! cargo run --bin rdma-rpc-doctor                          # providers, devices, limits
//! cargo run --bin rdma-rpc-doctor -- --ip 10.0.0.1         # which GID that address maps to
//! cargo run --bin rdma-rpc-doctor -- --listen 0.0.0.0:7479 # a peer for --peer (on the other host)
//! cargo run --bin rdma-rpc-doctor -- --peer 10.0.0.1:7479  # ping-pong, Write bandwidth, CPU per byte beside TCP
//! ```
//! Each line starts with `ok`, `warn` or `FAIL`; every line that is not `ok` says what to do.
//! `--provider` picks the provider for `--listen`/`--peer` (default: `RDMA_RPC_PROVIDER`, else
//! `verbs` when a device is there, else `tcp`). It exits with 1 when a check failed.

mod host;
mod peer;

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;

/// One finding: its level, what was found, what to do about it.
pub(crate) struct Finding {
    level: Level,
    what: String,
    todo: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    Ok,
    Warn,
    Fail,
}

impl Finding {
    pub(crate) fn ok(what: impl Into<String>) -> Self {
        Self {
            level: Level::Ok,
            what: what.into(),
            todo: None,
        }
    }
    pub(crate) fn warn(what: impl Into<String>, todo: impl Into<String>) -> Self {
        Self {
            level: Level::Warn,
            what: what.into(),
            todo: Some(todo.into()),
        }
    }
    pub(crate) fn fail(what: impl Into<String>, todo: impl Into<String>) -> Self {
        Self {
            level: Level::Fail,
            what: what.into(),
            todo: Some(todo.into()),
        }
    }
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let level = match self.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        write!(f, "{level} {}", self.what)?;
        if let Some(t) = &self.todo {
            write!(f, "\n       -> {t}")?;
        }
        Ok(())
    }
}

struct Args {
    ip: Option<IpAddr>,
    listen: Option<SocketAddr>,
    peer: Option<SocketAddr>,
    provider: Option<String>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        ip: None,
        listen: None,
        peer: None,
        provider: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--ip" => a.ip = Some(value()?.parse().map_err(|e| format!("--ip: {e}"))?),
            "--listen" => a.listen = Some(value()?.parse().map_err(|e| format!("--listen: {e}"))?),
            "--peer" => a.peer = Some(value()?.parse().map_err(|e| format!("--peer: {e}"))?),
            "--provider" => a.provider = Some(value()?),
            "-h" | "--help" => {
                println!("rdma-rpc-doctor [--ip ADDR] [--provider P] [--listen ADDR | --peer ADDR]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut findings = host::check(args.ip);
    let provider = args
        .provider
        .clone()
        .unwrap_or_else(|| host::default_provider(&findings));
    if let Some(addr) = args.listen {
        for f in &findings {
            println!("{f}");
        }
        return match peer::serve(&provider, addr) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(addr) = args.peer {
        findings.extend(peer::measure(&provider, addr));
    }
    for f in &findings {
        println!("{f}");
    }
    if findings.iter().any(|f| f.level == Level::Fail) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
