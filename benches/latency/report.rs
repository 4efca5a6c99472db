//! Printing: one perftest-style table per mode, the crossover, and the summary ratios.

use crate::stats::Row;

pub fn table(mode: &str, rows: &[&Row]) {
    let Some(first) = rows.first() else { return };
    println!();
    println!("---------------------------------------------------------------------------------------");
    println!(" mode {mode}   latency convention: {}", first.convention.label());
    println!("---------------------------------------------------------------------------------------");
    println!(
        " {:>9} {:>11} {:>11} {:>11} {:>15} {:>11} {:>13} {:>18} {:>20} {:>10} {:>11}",
        "#bytes",
        "#iterations",
        "t_min[usec]",
        "t_max[usec]",
        "t_typical[usec]",
        "t_avg[usec]",
        "t_stdev[usec]",
        "99% percentile[usec]",
        "99.9% percentile[usec]",
        "MB/s",
        "CPU[usec/op]"
    );
    for r in rows {
        println!(
            " {:>9} {:>11} {:>11.2} {:>11.2} {:>15.2} {:>11.2} {:>13.2} {:>18.2} {:>20.2} {:>10.1} {:>11.2}",
            r.bytes,
            r.iterations,
            r.t_min,
            r.t_max,
            r.t_typical,
            r.t_avg,
            r.t_stdev,
            r.p99,
            r.p999,
            r.mb_per_s,
            r.cpu_us_per_op
        );
    }
}

fn find<'a>(rows: &'a [Row], mode: &str, bytes: usize) -> Option<&'a Row> {
    rows.iter().find(|r| r.mode == mode && r.bytes == bytes)
}

/// The measured crossover: the smallest size from which rendezvous beats eager at every larger
/// size measured, the threshold that follows (the largest size where eager still wins), and the
/// sizes below that crossover where rendezvous won all the same (a band one threshold cannot
/// give to rendezvous without giving it the sizes above, where eager won).
pub struct Crossover {
    pub from: Option<usize>,
    pub threshold: usize,
    pub band: Vec<usize>,
}

/// The crossover of the `rpc-eager` and `rpc-rendezvous` rows, if both were measured.
pub fn crossover(rows: &[Row]) -> Option<Crossover> {
    let mut sizes: Vec<usize> = rows.iter().filter(|r| r.mode == "rpc-eager").map(|r| r.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let pairs: Vec<(usize, f64, f64)> = sizes
        .iter()
        .filter_map(|&b| {
            Some((
                b,
                find(rows, "rpc-eager", b)?.t_typical,
                find(rows, "rpc-rendezvous", b)?.t_typical,
            ))
        })
        .collect();
    if pairs.is_empty() {
        return None;
    }
    let cross = (0..pairs.len()).find(|&i| pairs[i..].iter().all(|&(_, e, r)| r < e));
    let threshold = match cross {
        Some(0) => 0,
        Some(i) => pairs[i - 1].0,
        None => pairs[pairs.len() - 1].0,
    };
    let below = cross.unwrap_or(pairs.len());
    let band = pairs[..below]
        .iter()
        .filter(|&&(_, e, r)| r < e)
        .map(|&(b, _, _)| b)
        .collect();
    Some(Crossover {
        from: cross.map(|i| pairs[i].0),
        threshold,
        band,
    })
}

/// The crossover lines of the summary (nothing without `rpc-eager` and `rpc-rendezvous` rows).
pub fn print_crossover(rows: &[Row]) {
    if let Some(Crossover { from, threshold, band }) = crossover(rows) {
        match (from, band.is_empty()) {
            (Some(c), _) => {
                println!("rendezvous beats eager from {c} bytes on; recommended eager_threshold: {threshold} bytes")
            }
            (None, true) => {
                println!("eager won at every size measured; recommended eager_threshold: {threshold} bytes or more")
            }
            (None, false) => {
                println!(
                    "eager won at the largest size measured; recommended eager_threshold: {threshold} bytes or more"
                )
            }
        }
        if !band.is_empty() {
            let sizes: Vec<String> = band.iter().map(ToString::to_string).collect();
            println!(
                "  rendezvous was faster below that at {} B, where one threshold cannot switch to it without the larger sizes that eager won",
                sizes.join(", ")
            );
        }
    }
}

/// The summary of ratios; `raw_ring` is the receive ring of the raw ping-pongs and of `rpc-body`.
/// It reports; it does not judge: what a ratio should be is the reader's question.
pub fn summary(rows: &[Row], provider: &str, raw_ring: u32) {
    println!();
    println!("=== summary (ratios of medians measured in this run; provider {provider})");
    print_crossover(rows);
    if let (Some(rpc), Some(tcp)) = (find(rows, "rpc", 64), find(rows, "tcp", 64)) {
        println!(
            "RPC 64 B p50 {:.2} us / tokio TCP echo p50 {:.2} us = {:.2}x",
            rpc.t_typical,
            tcp.t_typical,
            rpc.t_typical / tcp.t_typical,
        );
    }
    if let Some((b, w)) = worst(rows, "rpc", "send", 2.0, 4096) {
        println!(
            "RPC p50 / raw send-recv round trip p50 (2 x RTT/2), sizes <= 4 KiB: worst {w:.2}x at {b} B{}{}",
            median_of_sizes(rows, "rpc", "send", 2.0),
            by_round(rows, "rpc", "send", 2.0)
        );
    }
    if let Some((b, w)) = worst(rows, "rpc-body", "send", 2.0, 4096) {
        println!(
            "  the RPC with bodies from registered buffers that neither the handler nor the caller reads, left in their receive slots from 512 B, and {raw_ring} receives posted on each side, as in the raw ping-pong (rpc-body: call_buf_body, handler_sync to a RegisteredBuf) / the same: worst {w:.2}x at {b} B{}{}",
            median_of_sizes(rows, "rpc-body", "send", 2.0),
            by_round(rows, "rpc-body", "send", 2.0)
        );
        rpc_layer_time(rows);
    }
    if let Some((b, w)) = worst(rows, "send-head", "send", 1.0, 4096) {
        println!(
            "  a ping-pong whose receivers read the first 8 bytes of each message, as any protocol reads its header (send-head) / send, sizes <= 4 KiB: worst {w:.2}x at {b} B"
        );
        if let Some((b, w)) = worst(rows, "rpc-body", "send-head", 2.0, 4096) {
            println!("  rpc-body / send-head, sizes <= 4 KiB: worst {w:.2}x at {b} B");
        }
    }
    if let Some((b, w)) = worst(rows, "rpc", "send-copy", 2.0, 4096) {
        println!(
            "  the RPC / a ping-pong that copies what it receives into a Vec, as the RPC's Vec API does (send-copy): worst {w:.2}x at {b} B"
        );
    }
    if let Some((b, w)) = worst(rows, "send-copy", "send", 1.0, 4096) {
        println!("  that copy alone, with no RPC work (send-copy / send), sizes <= 4 KiB: worst {w:.2}x at {b} B");
    }
    spin_word(rows);
    if let Some((b, w)) = worst(rows, "rpc", "tarpc", 1.0, usize::MAX) {
        println!("RPC p50 / tarpc p50, every size: worst {w:.2}x at {b} B");
    }
    if let Some((b, w)) = worst(rows, "service", "tarpc", 1.0, usize::MAX) {
        println!(
            "  the typed path (#[service], payload a Bulk; tarpc's a serde_bytes buffer) / tarpc, every size: worst {w:.2}x at {b} B"
        );
    }
    if let Some((b, w)) = worst(rows, "service", "rpc-body", 1.0, usize::MAX) {
        println!(
            "  the typed path (a registered Bulk each way) / the raw one from registered buffers (rpc-body), every size: worst {w:.2}x at {b} B"
        );
    }
    spin_event_goodput(rows);
    behind(rows);
    one_thread(rows);
    steal(rows);
    cross_core(rows);
}

/// A short call behind long ones (`rpc-behind`, `rpc-behind-fifo`), at the largest size
/// measured, beside the short call alone (`rpc` at its size).
fn behind(rows: &[Row]) {
    let Some(big) = rows.iter().filter(|r| r.mode == "rpc-behind").map(|r| r.bytes).max() else {
        return;
    };
    let Some(b) = find(rows, "rpc-behind", big) else { return };
    let short = crate::rpc::SHORT;
    let fifo = find(rows, "rpc-behind-fifo", big)
        .map(|f| {
            format!(
                "; in send order (rpc-behind-fifo, Config::interleave off) {:.2} us",
                f.t_typical
            )
        })
        .unwrap_or_default();
    let alone = find(rows, "rpc", short)
        .map(|a| format!("; alone (rpc at {short} B) {:.2} us", a.t_typical))
        .unwrap_or_default();
    println!(
        "a {short} B call while calls of {big} B stream on its connection (rpc-behind): p50 {:.2} us{fifo}{alone}",
        b.t_typical
    );
}

/// The RPC with its server on the caller's thread (`rpc-one-thread`) beside the RPC with its
/// server on a thread of its own (`rpc`), at the sizes both have.
fn one_thread(rows: &[Row]) {
    let pairs: Vec<String> = rows
        .iter()
        .filter(|r| r.mode == "rpc-one-thread")
        .filter_map(|r| {
            find(rows, "rpc", r.bytes).map(|a| format!("{} B {:.2} us ({:.2} us)", r.bytes, r.t_typical, a.t_typical))
        })
        .collect();
    if !pairs.is_empty() {
        println!(
            "the RPC with its server on the caller's thread, one current-thread runtime (rpc-one-thread), p50 (rpc, the server on a thread of its own): {}",
            pairs.join(", ")
        );
    }
}

/// How much of the guest's CPU time the hypervisor took while the rows were timed: on a shared
/// host whole rows can run several times slower than
/// their neighbours, and the ratios above move with them.
pub fn steal(rows: &[Row]) {
    let mut by_row: Vec<(&Row, f64)> = rows.iter().filter_map(|r| r.steal_pct.map(|p| (r, p))).collect();
    if by_row.is_empty() {
        return;
    }
    // Most first: the median is the middle row (the upper one of an even count's two).
    by_row.sort_by(|a, b| b.1.total_cmp(&a.1));
    let median = by_row[(by_row.len() - 1) / 2].1;
    let most: Vec<String> = by_row
        .iter()
        .take(5)
        .filter(|x| x.1 >= 1.0)
        .map(|(r, p)| format!("{} {} B {p:.0}%", r.mode, r.bytes))
        .collect();
    println!(
        "the hypervisor's steal while rows were timed (/proc/stat: CPU time this guest wanted and another got), over {} rows: median {median:.0}%{}",
        by_row.len(),
        if most.is_empty() {
            ", below 1% in every row".to_owned()
        } else {
            format!("; most in {}", most.join(", "))
        }
    );
}

/// The two threads' cross-core round trip measured after each round of each row: its median
/// over them, and the rounds at twice that or more (the host had moved the vCPUs apart), the
/// five slowest listed.
pub fn cross_core(rows: &[Row]) {
    let mut all: Vec<(&Row, usize, f64)> = rows
        .iter()
        .flat_map(|r| r.round_xcore_ns.iter().enumerate().map(move |(i, &ns)| (r, i, ns)))
        .collect();
    if all.is_empty() {
        return;
    }
    // Slowest first: the median is the middle one (the upper of an even count's two).
    all.sort_by(|a, b| b.2.total_cmp(&a.2));
    let median = all[(all.len() - 1) / 2].2;
    let fastest = all[all.len() - 1].2;
    let far: Vec<&(&Row, usize, f64)> = all.iter().filter(|x| x.2 >= 2.0 * median).collect();
    let listed: Vec<String> = far
        .iter()
        .take(5)
        .map(|(r, i, ns)| format!("{} {} B round {} {ns:.0} ns", r.mode, r.bytes, i + 1))
        .collect();
    println!(
        "the two threads' cross-core round trip right after each row (spin-word, 2000 round trips), over {} rounds of rows: median {median:.0} ns, fastest {fastest:.0} ns; {}",
        all.len(),
        if far.is_empty() {
            "none at 2x that or more".to_owned()
        } else {
            format!("{} at 2x that or more: {}", far.len(), listed.join(", "))
        }
    );
}

/// The RPC layer's own time per round trip in µs, `rpc-body` p50 minus the raw Send round trip
/// p50 at each size up to 4 KiB: the cost of the RPC layer itself, in absolute terms that compare
/// across machines whose raw round trips differ.
fn rpc_layer_time(rows: &[Row]) {
    let extra: Vec<(usize, f64)> = rows
        .iter()
        .filter(|r| r.mode == "rpc-body" && r.bytes <= 4096)
        .filter_map(|r| find(rows, "send", r.bytes).map(|s| (r.bytes, r.t_typical - 2.0 * s.t_typical)))
        .collect();
    let (Some(lo), Some(hi)) = (
        extra.iter().map(|e| e.1).reduce(f64::min),
        extra.iter().map(|e| e.1).reduce(f64::max),
    ) else {
        return;
    };
    let at64 = extra
        .iter()
        .find(|e| e.0 == 64)
        .map(|e| format!(", {:.2} us at 64 B", e.1))
        .unwrap_or_default();
    println!(
        "  the RPC layer's own time per round trip (rpc-body p50 - 2 x send p50), sizes <= 4 KiB: {lo:.2} to {hi:.2} us{at64}"
    );
}

/// The machine's cross-core round trip (`spin-word`), and the 64 B round trips of the Send
/// ping-pongs and the RPCs counted in it: what a run on a noisy VM means, whatever that round
/// trip cost on the day (it moves 2x between boots here, and everything on shm with it).
fn spin_word(rows: &[Row]) {
    let Some(w) = rows
        .iter()
        .find(|r| r.mode == "spin-word")
        .filter(|w| w.t_typical > 0.0)
    else {
        return;
    };
    let counts: Vec<String> = [("send", 2.0), ("send-head", 2.0), ("rpc-body", 1.0), ("rpc", 1.0)]
        .into_iter()
        .filter_map(|(mode, k)| find(rows, mode, 64).map(|r| format!("{mode} {:.1}", k * r.t_typical / w.t_typical)))
        .collect();
    println!(
        "the two threads' round trip through one atomic word, both spinning on it (spin-word; between their two cores unless --cpus put them on one): p50 {:.0} ns{}",
        w.t_typical * 1000.0,
        if counts.is_empty() {
            String::new()
        } else {
            format!("; 64 B round trips in such round trips: {}", counts.join(", "))
        }
    );
}

/// The median over the sizes up to 4 KiB of `mode / (k × other)`, when more than one size was
/// measured: the worst size alone moves most from run to run.
fn median_of_sizes(rows: &[Row], mode: &str, other: &str, k: f64) -> String {
    let mut all: Vec<f64> = rows
        .iter()
        .filter(|r| r.mode == mode && r.bytes <= 4096)
        .filter_map(|r| ratio_at(rows, mode, other, k, r.bytes))
        .collect();
    if all.len() < 2 {
        return String::new();
    }
    all.sort_by(f64::total_cmp);
    format!(", median of the sizes {:.2}x", all[(all.len() - 1) / 2])
}

/// With more than one round: the worst ratio up to 4 KiB that each round's medians give alone
/// (each round measures every row on connections of its own, so this shows how far the ratio
/// moves with them on a noisy machine).
fn by_round(rows: &[Row], mode: &str, other: &str, k: f64) -> String {
    let rounds = rows
        .iter()
        .filter(|r| r.mode == mode)
        .map(|r| r.round_p50.len())
        .min()
        .unwrap_or(0);
    if rounds < 2 {
        return String::new();
    }
    // Each round's worst ratio, with the steal while its two rows were timed in that round
    // (the larger of the two; `None` for rounds too short for the ticks to say).
    let worst: Vec<(f64, Option<f64>)> = (0..rounds)
        .filter_map(|i| {
            rows.iter()
                .filter(|r| r.mode == mode && r.bytes <= 4096)
                .filter_map(|r| {
                    let o = find(rows, other, r.bytes)?;
                    let ratio = r.round_p50.get(i)? / (k * o.round_p50.get(i)?);
                    let steal = [r, o]
                        .iter()
                        .filter_map(|x| x.round_steal_pct.get(i).copied().flatten())
                        .reduce(f64::max);
                    Some((ratio, steal))
                })
                .reduce(|a, b| if b.0 > a.0 { b } else { a })
        })
        .collect();
    // Each round's cross-core round trip: the median over the rows of both modes it compares.
    let gauge: Vec<String> = (0..rounds)
        .filter_map(|i| {
            let mut ns: Vec<f64> = rows
                .iter()
                .filter(|r| (r.mode == mode || r.mode == other) && r.bytes <= 4096)
                .filter_map(|r| r.round_xcore_ns.get(i).copied())
                .collect();
            ns.sort_by(f64::total_cmp);
            ns.get(ns.len() / 2).map(|m| format!("{m:.0}"))
        })
        .collect();
    let mut notes = Vec::new();
    if gauge.len() == worst.len() {
        notes.push(format!(
            "cross-core round trip in those rounds: {} ns",
            gauge.join(", ")
        ));
    }
    // Only when some round lost 1% or more: calm rounds (the usual case) add nothing to read.
    if worst.iter().any(|w| w.1.is_some_and(|p| p >= 1.0)) {
        let steal: Vec<String> = worst
            .iter()
            .map(|w| w.1.map_or_else(|| "-".to_owned(), |p| format!("{p:.0}%")))
            .collect();
        notes.push(format!(
            "the hypervisor's steal while those rows were timed: {}",
            steal.join(", ")
        ));
    }
    let notes = if notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", notes.join("; "))
    };
    let worst: Vec<String> = worst.iter().map(|w| format!("{:.2}x", w.0)).collect();
    format!(
        "; round by round, each on connections of its own: worst {}{notes}",
        worst.join(", ")
    )
}

/// `mode / (k × other)` of the medians at `bytes`, when both were measured there.
fn ratio_at(rows: &[Row], mode: &str, other: &str, k: f64, bytes: usize) -> Option<f64> {
    Some(find(rows, mode, bytes)?.t_typical / (k * find(rows, other, bytes)?.t_typical))
}

/// The largest `mode / (k × other)` ratio of medians over the sizes up to `max_bytes` that both
/// modes measured, with its size.
fn worst(rows: &[Row], mode: &str, other: &str, k: f64, max_bytes: usize) -> Option<(usize, f64)> {
    rows.iter()
        .filter(|r| r.mode == mode && r.bytes <= max_bytes)
        .filter_map(|r| ratio_at(rows, mode, other, k, r.bytes).map(|x| (r.bytes, x)))
        .fold(None, |acc, (b, x)| match acc {
            Some((_, w)) if w >= x => acc,
            _ => Some((b, x)),
        })
}

/// The spin- and event-mode RPC at 64 B beside what bounds them on this machine, and the
/// goodput of a large request from registered memory beside a memcpy.
fn spin_event_goodput(rows: &[Row]) {
    if let Some(spin) = find(rows, "rpc-spin", 64) {
        let tarpc = find(rows, "tarpc", 64)
            .map(|t| {
                format!(
                    "; tarpc 64 B p50 {:.2} us, {:.1}x that",
                    t.t_typical,
                    t.t_typical / spin.t_typical
                )
            })
            .unwrap_or_default();
        println!("RPC 64 B round trip, spin mode: p50 {:.2} us{tarpc}", spin.t_typical);
    }
    if let Some(ev) = find(rows, "rpc-event", 64) {
        event(rows, ev);
    }
    // The largest size that both an upload and a memcpy measured.
    let big = rows
        .iter()
        .filter(|r| r.mode == "rpc-upload" && find(rows, "memcpy", r.bytes).is_some())
        .map(|r| r.bytes)
        .max();
    if let Some(big) = big {
        if let (Some(up), Some(mc)) = (find(rows, "rpc-upload", big), find(rows, "memcpy", big)) {
            println!(
                "{} KiB request RPC goodput (registered buffers: call_buf, a handler of a Body) {:.0} MB/s / memcpy {:.0} MB/s = {:.0}%",
                big >> 10,
                up.mb_per_s,
                mc.mb_per_s,
                up.mb_per_s / mc.mb_per_s * 100.0,
            );
            if let Some(v) = find(rows, "rpc-upload-vec", big) {
                println!(
                    "  the same from a Vec to a Vec handler (a copy on each side): {:.0} MB/s = {:.0}% of memcpy",
                    v.mb_per_s,
                    v.mb_per_s / mc.mb_per_s * 100.0
                );
            }
        }
    }
    typed_bulk(rows);
}

/// The typed path's `Bulk` beside the raw one: uploads against `call_buf` at every size both
/// measured from 64 KiB up, and the echo against memcpy at the largest.
fn typed_bulk(rows: &[Row]) {
    let sizes = rows
        .iter()
        .filter(|r| r.mode == "service-upload" && r.bytes >= 64 << 10 && find(rows, "rpc-upload", r.bytes).is_some());
    for r in sizes {
        let Some(raw) = find(rows, "rpc-upload", r.bytes) else {
            continue;
        };
        let vec = find(rows, "service-upload-vec", r.bytes)
            .map(|v| {
                format!(
                    "; from a Vec {:.0} MB/s = {:.2}x",
                    v.mb_per_s,
                    v.mb_per_s / raw.mb_per_s
                )
            })
            .unwrap_or_default();
        println!(
            "{} KiB typed Bulk upload (registered, service-upload) {:.0} MB/s / call_buf {:.0} MB/s = {:.2}x{vec}",
            r.bytes >> 10,
            r.mb_per_s,
            raw.mb_per_s,
            r.mb_per_s / raw.mb_per_s
        );
    }
    let big = rows
        .iter()
        .filter(|r| r.mode == "service" && find(rows, "memcpy", r.bytes).is_some())
        .map(|r| r.bytes)
        .max();
    if let Some(big) = big.filter(|&b| b >= 64 << 10) {
        if let (Some(e), Some(mc)) = (find(rows, "service", big), find(rows, "memcpy", big)) {
            // The echo's figure counts both directions; memcpy's one copy of the same bytes.
            let echo = e.mb_per_s / 2.0;
            println!(
                "{} KiB typed Bulk echo (registered, service) {:.0} MB/s of payload each way / memcpy {:.0} MB/s = {:.2}x",
                big >> 10,
                echo,
                mc.mb_per_s,
                echo / mc.mb_per_s
            );
        }
    }
}

/// The event-mode RPC, with what bounds it on this machine: the provider's own sleep and
/// wake-up without the RPC layer (`send-event`), and a futex round trip (`wake`).
fn event(rows: &[Row], ev: &Row) {
    println!(
        "RPC 64 B round trip, event mode (no spinning): p50 {:.2} us",
        ev.t_typical
    );
    if let Some(raw) = find(rows, "send-event", 64) {
        let rtt = 2.0 * raw.t_typical;
        println!(
            "  the raw Send ping-pong whose sides sleep on their completion channels as event mode does (send-event), 64 B round trip p50 {rtt:.2} us: the RPC / that = {:.2}x",
            ev.t_typical / rtt
        );
    }
    if let Some(w) = rows.iter().find(|r| r.mode == "wake") {
        println!(
            "  a futex round trip between the same two threads, both sleeping (wake): p50 {:.2} us, 99% {:.2} us",
            w.t_typical, w.p99
        );
        if let Some(ns) = guest_halt_poll_ns() {
            println!(
                "  this guest's cpuidle-haltpoll polls {ns} ns before it halts an idle vCPU (/sys/module/haltpoll/parameters/guest_halt_poll_ns; Linux's default is 200000): a wake-up that finds its vCPU halted goes through the hypervisor, tens of us"
            );
        }
    }
}

/// The guest's halt-polling window when it runs the cpuidle-haltpoll driver (a KVM guest).
fn guest_halt_poll_ns() -> Option<u64> {
    let driver = std::fs::read_to_string("/sys/devices/system/cpu/cpuidle/current_driver").ok()?;
    if driver.trim() != "haltpoll" {
        return None;
    }
    std::fs::read_to_string("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
        .ok()?
        .trim()
        .parse()
        .ok()
}
