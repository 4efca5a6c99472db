//! Comparison with perftest's own report (ib_send_lat, ib_write_lat, ib_read_lat) from the same
//! machine and boot: the ratio of our medians to its t_typical, row by row.

use std::collections::HashMap;

use crate::stats::Row;

/// Parses perftest's latency tables: rows of numbers under the `#bytes` header; returns
/// t_typical (the 5th column) by size, one value per report in the text (in its order).
pub fn parse(text: &str) -> HashMap<usize, Vec<f64>> {
    let mut out: HashMap<usize, Vec<f64>> = HashMap::new();
    for line in text.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() < 5 {
            continue;
        }
        let (Ok(bytes), Ok(typical)) = (cols[0].parse::<usize>(), cols[4].parse::<f64>()) else {
            continue;
        };
        if cols[1].parse::<usize>().is_ok() {
            out.entry(bytes).or_default().push(typical);
        }
    }
    out
}

/// The median of the usable times (`None` when there is none), and how the runs went.
fn median(times: &[f64]) -> (Option<f64>, String) {
    let mut ok: Vec<f64> = times.iter().copied().filter(|&t| usable(t)).collect();
    ok.sort_by(f64::total_cmp);
    let m = match ok.len() {
        0 => None,
        n if n % 2 == 1 => Some(ok[n / 2]),
        n => Some((ok[n / 2 - 1] + ok[n / 2]) / 2.0),
    };
    let runs = if times.len() > 1 {
        let each: Vec<String> = times.iter().map(|t| format!("{t:.2}")).collect();
        format!(" (median of {} runs: {})", times.len(), each.join(", "))
    } else {
        String::new()
    };
    (m, runs)
}

/// Prints ratios: our raw op / perftest's same op (both in perftest's convention), and our RPC
/// round trip / perftest's send round trip (2 × RTT/2).
pub fn compare(rows: &[Row], files: &[(String, String)]) {
    println!();
    println!("=== comparison with perftest in the same boot (ratios of medians)");
    let mut send = HashMap::new();
    for (op, path) in files {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                println!("{op}: cannot read {path}: {e}");
                continue;
            }
        };
        let pt = parse(&text);
        let mut sizes: Vec<_> = pt.keys().copied().collect();
        sizes.sort_unstable();
        for b in sizes {
            let (theirs, runs) = median(&pt[&b]);
            if op == "send" {
                if let Some(t) = theirs {
                    send.insert(b, t);
                }
            }
            let Some(theirs) = theirs else {
                println!(
                    "{op:>5} {b:>8} B: ib_{op}_lat printed t_typical {:?} us, not a time: no ratio",
                    pt[&b]
                );
                continue;
            };
            match rows.iter().find(|r| r.mode == *op && r.bytes == b) {
                Some(r) => println!(
                    "{op:>5} {b:>8} B: ours {:.2} us / ib_{op}_lat {theirs:.2} us = {:.2}x{runs}",
                    r.t_typical,
                    r.t_typical / theirs
                ),
                None => println!("{op:>5} {b:>8} B: ib_{op}_lat {theirs:.2} us (no row of ours){runs}"),
            }
        }
    }
    for r in rows.iter().filter(|r| r.mode == "rpc") {
        if let Some(t) = send.get(&r.bytes) {
            println!(
                "  rpc {:>8} B: RPC round trip {:.2} us / ib_send_lat round trip {:.2} us = {:.2}x",
                r.bytes,
                r.t_typical,
                2.0 * t,
                r.t_typical / (2.0 * t)
            );
        }
    }
}

/// A perftest time we can divide by: perftest prints `inf` (or 0) when its cycle count or its
/// CPU clock estimate went wrong, as seen once in the soft-RoCE VM.
fn usable(t: f64) -> bool {
    t.is_finite() && t > 0.0
}
