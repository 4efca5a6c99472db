#!/bin/sh
# Runs inside the soft-RoCE VM (busybox sh): perftest's ib_send_lat, ib_write_lat and
# ib_read_lat on rxe0 (loopback, GID index 1 = the IPv4 RoCE v2 GID), a short sweep of the
# latency harness on provider verbs in the same boot (tarpc over the guest's loopback TCP too:
# the RPC / tarpc ratio on verbs), perftest once more, then the harness's
# ratios to perftest's medians of the two passes (the emulator's speed drifts over a boot:
# perftest before and after brackets our sweep instead of timing one phase of it).
#   vm-bench.sh LATENCY_BINARY [SIZES] [ITERS] [COMPLETION MODE of the RPC driver, default spin]
#       [ROUNDS, default 5: the sweep runs in rounds whose samples are merged per row, so that
#       every mode sees the same phases of the emulator's speed]
bin=$1 sizes=${2:-64,4096} iters=${3:-200} completion=${4:-spin} rounds=${5:-5}
mkdir -p /tmp/pt
perftest_pass() {
    for t in send write read; do
        for s in $(echo "$sizes" | tr ',' ' '); do
            ib_${t}_lat -d rxe0 -x 1 -F -s "$s" -n "$iters" >/dev/null 2>&1 &
            srv=$!
            sleep 1
            ib_${t}_lat -d rxe0 -x 1 -F -s "$s" -n "$iters" 10.10.0.1 >> /tmp/pt/$t.txt 2>&1
            wait $srv
        done
    done
}
perftest_pass
"./$bin" --provider verbs --ip 10.10.0.1 --sizes "$sizes" --modes rpc,rpc-body,send,write,read,tarpc --iters "$iters" --rounds "$rounds" \
    --raw-spin-us 1000000 --completion "${completion:-spin}" --json /tmp/ours.json || exit 1
perftest_pass
for t in send write read; do
    echo "=== perftest ib_${t}_lat, before and after the sweep (their rows)"
    grep -m1 '#bytes' /tmp/pt/$t.txt
    grep -E '^ *[0-9]+ +[0-9]+ ' /tmp/pt/$t.txt
done
"./$bin" --rows /tmp/ours.json --perftest send=/tmp/pt/send.txt,write=/tmp/pt/write.txt,read=/tmp/pt/read.txt
# Calls/s under load on verbs at small scale (a run, not a measurement: the NIC is emulated),
# beside perftest's ib_send_bw at 32 B in the same boot.
echo "=== perftest ib_send_bw, 32 B"
ib_send_bw -d rxe0 -x 1 -F -s 32 -n "$iters" >/dev/null 2>&1 &
srv=$!
sleep 1
ib_send_bw -d rxe0 -x 1 -F -s 32 -n "$iters" 10.10.0.1 2>&1 | grep -E '#bytes|^ *32 '
wait $srv
"./$bin" --provider verbs --ip 10.10.0.1 --sweep throughput --systems rpc --sizes 32 --in-flight 1,16 \
    --conns 4 --completion "${completion:-spin}" --seconds 6 || exit 1
