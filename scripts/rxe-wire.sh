#!/usr/bin/env bash
# rxe-wire.sh - run one host-built binary in two qemu VMs joined by a virtual Ethernet wire,
# each with soft-RoCE (rxe0) on its own virtio-net NIC: two hosts, as users run client and
# server. Both VMs come from scripts/rxe-vm.sh; the wire is a qemu stream socket (reliable,
# no Nagle delay), so only what the guests do to their links (tc netem, ip link) loses packets.
#
#   rxe-wire.sh [-e VAR=VAL]... [-f HOSTPATH[:GUESTPATH]]... [--] BINARY [ARGS...]
#
# Host A (10.10.0.1) runs BINARY with RDMA_RPC_ROLE=server, host B (10.10.0.2) with
# RDMA_RPC_ROLE=client; both get RDMA_RPC_PROVIDER=verbs, RDMA_RPC_TEST_IP (their own
# address) and RDMA_RPC_PEER_IP (the other's). Their outputs appear prefixed "A|" and "B|".
# Exit status: 0 when both programs exit 0; else the client's status if it failed, else the
# server's. RXE_VM_TIMEOUT (default 600) bounds each VM.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ARGS=()
while (($#)); do
    case $1 in
        -e|-f) ARGS+=("$1" "$2"); shift 2 ;;
        --) shift; break ;;
        *) break ;;
    esac
done
(($#)) || { echo "usage: $0 [-e VAR=VAL]... [-f HOST[:GUEST]]... [--] BINARY [ARGS...]" >&2; exit 2; }
"$HERE/rxe-vm.sh" --setup-if-needed

WORK=$(mktemp -d "${TMPDIR:-/tmp}/rxe-wire.XXXXXX")
APID= BPID=
cleanup() {
    [[ -z $APID ]] || kill "$APID" 2>/dev/null || true
    [[ -z $BPID ]] || kill "$BPID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
SOCK=$WORK/wire.sock
export RXE_VM_NETDEV=wire RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-600}

side() { # NAME ROLE IP PEER MAC WIRE BINARY [ARGS...]
    local name=$1 role=$2 ip=$3 peer=$4 mac=$5 wire=$6; shift 6
    RXE_VM_IP=$ip RXE_VM_MAC=$mac RXE_VM_WIRE=$wire "$HERE/rxe-vm.sh" \
        -e RDMA_RPC_PROVIDER=verbs -e RDMA_RPC_ROLE="$role" -e RDMA_RPC_TEST_IP="$ip" -e RDMA_RPC_PEER_IP="$peer" \
        "${ARGS[@]}" "$@" 2>&1 | sed -u "s/^/$name|/"
    return "${PIPESTATUS[0]}"
}

side A server 10.10.0.1 10.10.0.2 52:54:00:00:00:0a "listen:$SOCK" "$@" &
APID=$!
# The connecting side's qemu needs the listening one's socket at start.
n=0
until [[ -S $SOCK ]]; do
    n=$((n + 1))
    ((n < 600)) || { echo "rxe-wire: host A's wire never came up" >&2; exit 255; }
    kill -0 "$APID" 2>/dev/null || { wait "$APID" || true; echo "rxe-wire: host A's VM ended before its wire came up" >&2; exit 255; }
    sleep 0.1
done
side B client 10.10.0.2 10.10.0.1 52:54:00:00:00:0b "connect:$SOCK" "$@" &
BPID=$!
set +e
wait "$BPID"; BRC=$?
BPID=
wait "$APID"; ARC=$?
APID=
set -e
echo "rxe-wire: host A (server) exited $ARC, host B (client) exited $BRC" >&2
((BRC == 0)) || exit "$BRC"
exit "$ARC"
