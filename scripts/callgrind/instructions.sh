#!/usr/bin/env bash
# Instructions per round trip of one latency-harness row, counted by callgrind: the difference
# between runs of 10,000 and 20,000 iterations, divided by 10,000, with the polling loops'
# functions set aside (they spin for as long as the other side takes, so their counts are
# noise). Unlike wall time on a shared machine, the rest repeats to within about 1%.
#   scripts/callgrind/instructions.sh LATENCY_BINARY MODE SIZE   e.g. ... rpc-body 64
# The binary: `cargo bench --bench latency --no-run` prints it (a release build without debug
# info, so that callgrind names functions, not lines). Needs valgrind (apt-get install valgrind).
# TOP=N lists the N costliest functions outside the loops (25 by default).
# Takes about a minute per mode. The two threads are pinned to CPUs 0 and 1: valgrind runs one
# thread at a time, and unpinned they may report one CPU, which sends the adaptive RPC to sleep
# between messages (a tokio wake-up path of some 12,000 instructions more per round trip).
set -euo pipefail
bin=$1 mode=$2 size=$3
out=$(mktemp -d)
for n in 10000 20000; do
    valgrind --tool=callgrind --fair-sched=yes --callgrind-out-file="$out/cg.$n" \
        "$bin" --modes "$mode" --sizes "$size" --iters "$n" --rounds 1 --cpus 0,1 > /dev/null 2>&1
    callgrind_annotate --threshold=100 "$out/cg.$n" 2>/dev/null | grep -E '^ *[0-9,]+ ' |
        sed 's/([^)]*)//' > "$out/fn.$n"
done
python3 - "$out" "$mode" "$size" <<'PY'
import os, re, sys
out, mode, size = sys.argv[1:]
def load(f):
    d = {}
    for line in open(f):
        m = re.match(r'\s*([\d,]+)\s+(?:\(\s*[\d.]+%\)\s+)?(.*)', line)
        if m:
            k = m.group(2).strip().split(' [')[0].replace('???:', '')
            d[k] = d.get(k, 0) + int(m.group(1).replace(',', ''))
    return d
a, b = load(f'{out}/fn.10000'), load(f'{out}/fn.20000')
per = {k: (b.get(k, 0) - a.get(k, 0)) / 10000 for k in set(a) | set(b)}
# The polling loops: these run for as long as the other side takes.
spin = ['cq::CompletionQueue::poll', 'tcp::Cq::poll', 'CompletionQueue::reap', 'Conn::poll_cq',
        'Pending as core::future::future::Future>::poll', 'engine::Qp::start::{{closure}}',
        'raw::next', 'driver::run', 'Instant>::elapsed', 'Timespec>::now', 'sub_timespec',
        'clock_gettime', 'Conn::send_pending', 'Conn::flush', 'Conn::collect_slots', 'spin_loop',
        'MutexGuard', 'RawMutex', 'raw::landed']
total = per.pop('PROGRAM TOTALS', 0)
polling = sum(v for k, v in per.items() if any(x in k for x in spin))
print(f"{mode} {size} B: {total:.0f} instructions per round trip, {polling:.0f} in the polling "
      f"loops, {total - polling:.0f} outside them")
rest = sorted(((v, k) for k, v in per.items() if not any(x in k for x in spin)), reverse=True)
for v, k in rest[:int(os.environ.get("TOP", "25"))]:
    print(f"  {v:7.0f} {k[:110]}")
PY
rm -r "$out"
