#!/bin/sh
# The figures of the examples that measure, on one provider, on this host: kv's GET and PUT
# latency and the server's CPU per PUT (RPC against one-sided and Write-with-immediate), the
# all-reduce beside TCP (3 ranks), and the doctor's peer run (ping-pong, Write bandwidth, CPU
# per byte beside TCP). POSIX sh, so that it runs in the soft-RoCE VM's busybox too.
#
#   scripts/bench-examples.sh shm > bench-results/shm-examples.txt
#   scripts/bench-examples.sh tcp > bench-results/tcp-examples.txt
#
# In the soft-RoCE VM (after `cargo build --release --examples --bins`):
#   scripts/rxe-vm.sh -e BIN=/ex -e IP=10.10.0.1 -f target/release/examples/kv:/ex/kv \
#     -f target/release/examples/allreduce:/ex/allreduce -f target/release/rdma-rpc-doctor:/ex/rdma-rpc-doctor \
#     scripts/bench-examples.sh verbs > bench-results/verbs-examples.txt
set -eu
p=${1:?usage: bench-examples.sh PROVIDER}
ip=${IP:-127.0.0.1}
if [ -z "${BIN:-}" ]; then
    cargo build --quiet --release --examples --bins
    BIN=target/release/examples
    DOCTOR=target/release/rdma-rpc-doctor
else
    DOCTOR=$BIN/rdma-rpc-doctor
fi
pids=""
tmp=$(mktemp -d)
trap 'kill $pids 2>/dev/null || true' EXIT
# The address of a server's "listening on ADDR" line in file $1, once it is there.
listening() {
    i=0
    while [ $i -lt 400 ]; do
        addr=$(sed -n 's/^listening on \([^ ]*\).*/\1/p' "$1" | head -1)
        if [ -n "$addr" ]; then echo "$addr"; return 0; fi
        sleep 0.05; i=$((i + 1))
    done
    echo "no listening line in $1" >&2
    exit 1
}
echo "provider $p, host $(uname -n), $(nproc) CPUs, $(date -u +%Y-%m-%dT%H:%MZ)"

echo; echo "=== kv: bench --keys 1000 --gets 5000 --puts 5000"
"$BIN/kv" --provider "$p" server --listen "$ip:0" > "$tmp/kv" 2>&1 & pids="$pids $!"
"$BIN/kv" --provider "$p" client --connect "$(listening "$tmp/kv")" bench --keys 1000 --gets 5000 --puts 5000

echo; echo "=== allreduce: 3 ranks, 2 lanes, every sum checked"
base=$((21000 + $$ % 4000 * 2))
peers="$ip:$base,$ip:$((base + 2)),$ip:$((base + 4))"
for r in 1 2; do
    "$BIN/allreduce" --provider "$p" --rank $r --peers "$peers" > "$tmp/ar$r" 2>&1 & pids="$pids $!"
done
"$BIN/allreduce" --provider "$p" --rank 0 --peers "$peers"

echo; echo "=== rdma-rpc-doctor --peer, against a --listen peer on this host"
"$DOCTOR" --provider "$p" --listen "$ip:0" > "$tmp/doc" 2>&1 & pids="$pids $!"
"$DOCTOR" --provider "$p" --peer "$(listening "$tmp/doc")" | grep -E 'ping-pong|RDMA Write|TCP|offload|CPU per byte'
