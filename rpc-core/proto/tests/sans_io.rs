//! The protocol core is sans-IO by construction: its manifest names no runtime, transport or
//! I/O crate, and its code reads no clock, opens no socket or file and starts no thread. The
//! session takes the time as an input (`now`), so the tests can drive it in virtual time.

use std::path::{Path, PathBuf};

const ALLOWED_DEPENDENCIES: &[&str] = &["thiserror", "foldhash"];

/// What the core must not call: each reads the world or acts on it.
const FORBIDDEN: &[&str] = &[
    "Instant::now",
    "SystemTime",
    "std::net",
    "std::fs",
    "std::thread",
    "std::process",
    "tokio",
    "rdma_rpc_transport",
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("the source folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn the_manifest_names_no_runtime_transport_or_io_crate() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).expect("the manifest");
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .expect("a [dependencies] table")
        .split("\n[")
        .next()
        .unwrap_or_default();
    let names: Vec<&str> = deps
        .lines()
        .filter_map(|l| l.split_once('=').map(|(name, _)| name.trim()))
        .filter(|n| !n.is_empty() && !n.starts_with('#'))
        .collect();
    assert!(!names.is_empty(), "no dependency parsed from:\n{deps}");
    for name in names {
        assert!(
            ALLOWED_DEPENDENCIES.contains(&name),
            "rdma-rpc-proto depends on `{name}`: the protocol core takes no runtime, transport or I/O crate (allowed: {ALLOWED_DEPENDENCIES:?})"
        );
    }
}

#[test]
fn the_code_reads_no_clock_and_does_no_io() {
    let mut files = Vec::new();
    sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files);
    assert!(files.len() > 5, "only {} source files found", files.len());
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a source file");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            for word in FORBIDDEN {
                assert!(
                    !code.contains(word),
                    "{}:{}: `{word}` in the protocol core; take what it gives as an input instead",
                    file.display(),
                    n + 1
                );
            }
        }
    }
}
