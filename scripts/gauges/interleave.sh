#!/usr/bin/env bash
# Runs the gauges (gauges.c) and one latency row pair (send, rpc-body at 64 B) in turns, N
# times, and prints each run's figures and the correlation of each gauge with rpc-body's median:
# whether a phase of a shared machine that moves the RPC also moves the core or the caches.
#   scripts/gauges/interleave.sh LATENCY_BINARY [N]   (the binary: cargo bench --bench latency --no-run)
set -euo pipefail
bin=$1 n=${2:-12}
dir=$(mktemp -d)
gcc -O2 -o "$dir/gauges" "$(dirname "$0")/gauges.c"
echo "mul_ns chase32k_ns chase256k_ns pause_cycles lock_cycles | send_rtt/2_us rpc-body_us"
for _ in $(seq 1 "$n"); do
    g=$("$dir/gauges")
    r=$("$bin" --provider shm --modes send,rpc-body --sizes 64 --iters 30000 --rounds 1 2>&1 |
        awk '/ mode /{m=$2} /^ +64 +[0-9]+ /{v[m]=$5} END{print v["send"], v["rpc-body"]}')
    echo "$g | $r"
done | tee "$dir/runs"
python3 - "$dir/runs" <<'PY'
import statistics, sys
rows = [l.replace('|', ' ').split() for l in open(sys.argv[1])]
cols = ['mul', 'chase32k', 'chase256k', 'pause', 'lock', 'send']
rpc = [float(r[6]) for r in rows]
for i, name in enumerate(cols):
    x = [float(r[i]) for r in rows]
    if len(set(x)) > 1 and len(set(rpc)) > 1:
        print(f"correlation of {name} with rpc-body: {statistics.correlation(x, rpc):+.2f}")
PY
rm -r "$dir"
