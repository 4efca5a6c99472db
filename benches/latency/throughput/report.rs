//! The throughput sweep's summary (the ratios its targets are stated in) and its SVG.

use super::Row;

/// calls/s of the row that matches, if it ran without error.
fn rate(rows: &[Row], f: impl Fn(&Row) -> bool) -> Option<f64> {
    rows.iter().find(|r| r.error.is_none() && f(r)).map(|r| r.calls_per_s)
}

/// The ratios: no collapse as calls in flight grow, depth 64 against 1 and against the
/// baselines, the provider against the TCP echo, many connections against 16.
pub fn summary(rows: &[Row]) {
    println!();
    println!("summary (ratios of calls/s within this run):");
    let mut keys: Vec<(String, String, bool, usize)> = rows
        .iter()
        .filter(|r| r.conns == 1 && r.system != "raw-send")
        .map(|r| (r.system.clone(), r.completion.clone(), r.busy, r.bytes))
        .collect();
    keys.dedup();
    for (system, completion, busy, bytes) in &keys {
        let mut series: Vec<(usize, f64)> = rows
            .iter()
            .filter(|r| {
                r.error.is_none()
                    && r.conns == 1
                    && &r.system == system
                    && &r.completion == completion
                    && r.busy == *busy
                    && r.bytes == *bytes
            })
            .map(|r| (r.in_flight, r.calls_per_s))
            .collect();
        series.sort_by_key(|p| p.0);
        // The worst depth against the best at any smaller depth.
        let mut best = 0.0f64;
        let mut worst: Option<(usize, f64)> = None;
        for &(d, c) in &series {
            if best > 0.0 {
                let ratio = c / best;
                if worst.is_none_or(|w| ratio < w.1) {
                    worst = Some((d, ratio));
                }
            }
            best = best.max(c);
        }
        if let Some((d, ratio)) = worst {
            println!(
                "  {system} {completion} {bytes} B{}: worst depth {d} at {ratio:.2}x the best of smaller depths{}",
                if *busy { " (busy)" } else { "" },
                if ratio < 0.9 { "  <- collapse" } else { "" }
            );
        }
    }
    let bytes = rows.iter().map(|r| r.bytes).min().unwrap_or(32);
    for busy in [false, true] {
        let at = |system: &str, completion: &str, d: usize| {
            rate(rows, |r| {
                r.busy == busy
                    && r.conns == 1
                    && r.bytes == bytes
                    && r.system == system
                    && r.completion == completion
                    && r.in_flight == d
            })
        };
        let tag = if busy { " (busy)" } else { "" };
        if let (Some(one), Some(deep)) = (at("rpc", "adaptive", 1), at("rpc", "adaptive", 64)) {
            println!(
                "  rpc adaptive {bytes} B{tag}: 64 in flight {:.1}x the calls/s of 1",
                deep / one
            );
            if let Some(t) = at("tcp", "-", 64) {
                println!(
                    "  rpc adaptive {bytes} B{tag}: 64 in flight {:.1}x the tokio TCP echo",
                    deep / t
                );
            }
            if let Some(t) = at("tarpc", "-", 64) {
                println!("  rpc adaptive {bytes} B{tag}: 64 in flight {:.1}x tarpc", deep / t);
            }
        }
        let depths: Vec<usize> = {
            let mut d: Vec<usize> = rows.iter().filter(|r| r.conns == 1).map(|r| r.in_flight).collect();
            d.sort_unstable();
            d.dedup();
            d
        };
        let vs_tcp: Vec<String> = depths
            .iter()
            .filter_map(|&d| Some(format!("{d}: {:.2}x", at("rpc", "adaptive", d)? / at("tcp", "-", d)?)))
            .collect();
        if !vs_tcp.is_empty() {
            println!(
                "  rpc adaptive {bytes} B{tag} against the tokio TCP echo, by depth: {}",
                vs_tcp.join(", ")
            );
        }
        let conn = |n: usize| {
            rate(rows, |r| {
                r.busy == busy && r.conns == n && r.system == "rpc" && r.completion == "adaptive"
            })
        };
        if let (Some(sixteen), Some(most)) = (
            conn(16),
            rows.iter()
                .filter(|r| r.system == "rpc" && r.busy == busy && r.error.is_none())
                .map(|r| r.conns)
                .max(),
        ) {
            if most > 16 {
                if let Some(m) = conn(most) {
                    println!(
                        "  rpc adaptive{tag}: {most} connections {:.2}x the calls/s of 16",
                        m / sixteen
                    );
                }
            }
        }
    }
}

/// calls/s against calls in flight (one connection), log-log, one line per system, mode,
/// size and load.
pub fn draw(path: &str, rows: &[Row], title: &str) -> Result<(), Box<dyn std::error::Error>> {
    let pts: Vec<&Row> = rows
        .iter()
        .filter(|r| r.conns == 1 && r.error.is_none() && r.calls_per_s > 0.0)
        .collect();
    let mut lines: Vec<(String, bool, usize)> = pts.iter().map(|r| (super::label(r), r.busy, r.bytes)).collect();
    lines.sort();
    lines.dedup();
    let series = lines
        .into_iter()
        .map(|(name, busy, bytes)| {
            let points = pts
                .iter()
                .filter(|r| super::label(r) == name && r.busy == busy && r.bytes == bytes)
                .map(|r| (r.in_flight as f64, r.calls_per_s))
                .collect();
            (format!("{name} {bytes} B{}", if busy { " busy" } else { "" }), points)
        })
        .collect();
    crate::plot::lines(path, title, ("calls in flight (one connection)", "calls/s"), series)
}
