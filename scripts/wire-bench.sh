#!/bin/sh
# Runs in both VMs of scripts/rxe-wire.sh (busybox sh): perftest's ib_send_lat across the
# wire, the latency harness's RPC modes with their server on host A (`--serve`) and the client
# on host B (`--connect`), perftest once more, then (on B) the RPC's ratios to perftest's
# medians of the two passes: the same comparison as scripts/vm-bench.sh, across two hosts.
#   wire-bench.sh LATENCY_BINARY [SIZES] [ITERS] [ROUNDS, default 5]
bin=$1 sizes=${2:-64,4096} iters=${3:-500} rounds=${4:-5}
peer=$RDMA_RPC_PEER_IP
mkdir -p /tmp/pt
perftest_pass() {
    for s in $(echo "$sizes" | tr ',' ' '); do
        if [ "$RDMA_RPC_ROLE" = server ]; then
            ib_send_lat -d rxe0 -x 1 -F -s "$s" -n "$iters" >/dev/null 2>&1
        else
            sleep 2
            ib_send_lat -d rxe0 -x 1 -F -s "$s" -n "$iters" "$peer" >> /tmp/pt/send.txt 2>&1 || return 1
        fi
    done
}
perftest_pass || exit 1
if [ "$RDMA_RPC_ROLE" = server ]; then
    "./$bin" --provider verbs --serve "$RDMA_RPC_TEST_IP:7800" --completion spin || exit 1
else
    sleep 1
    "./$bin" --provider verbs --connect "$peer:7800" --sizes "$sizes" --modes rpc,rpc-body --iters "$iters" \
        --rounds "$rounds" --completion spin --json /tmp/ours.json --stop-server || exit 1
fi
perftest_pass || exit 1
if [ "$RDMA_RPC_ROLE" = client ]; then
    echo "=== perftest ib_send_lat across the wire, before and after the sweep (its rows)"
    grep -m1 '#bytes' /tmp/pt/send.txt
    grep -E '^ *[0-9]+ +[0-9]+ ' /tmp/pt/send.txt
    "./$bin" --rows /tmp/ours.json --perftest send=/tmp/pt/send.txt || exit 1
fi
