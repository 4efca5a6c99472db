#!/bin/sh
# Runs in both VMs of scripts/rxe-wire.sh (busybox sh): test suites split across the two hosts
# (rpc-core/tests/common/split.rs). Host A runs the agent, which starts each test's server half
# when host B's copy of the test asks for it; host B runs each test binary given, its clients
# there and its servers on host A. Arguments: the agent's file name, then the test binaries'
# (all in /job: rxe-wire.sh -f target/vm/deps/NAME), each with a test filter after a colon if
# only some of its tests are to run.
#
#   wire-suites.sh split_agent-HASH e2e-HASH service-HASH conformance-HASH:across:: ...
agent=$1; shift
if [ "$RDMA_RPC_ROLE" = server ]; then
    "./$agent" || { echo "wire-suites: server: FAILED: the agent exited $?"; exit 1; }
    echo "wire-suites: server: ok"
    exit 0
fi
rc=0
for arg in "$@"; do
    b=${arg%%:*} filter=
    [ "$b" = "$arg" ] || filter=${arg#*:}
    echo "=== running $b ${filter:+(tests $filter) }with its servers on host A"
    start=$(date +%s)
    "./$b" --test-threads=1 $filter
    s=$?
    [ $s -eq 0 ] || rc=1
    echo "=== $b took $(($(date +%s) - start)) s (exit status $s)"
done
# The agent ends when told to.
echo quit | nc "$RDMA_RPC_PEER_IP" 7900 || { echo "wire-suites: client: FAILED: telling host A's agent to quit"; exit 1; }
if [ $rc -eq 0 ]; then echo "wire-suites: client: ok"; else echo "wire-suites: client: FAILED"; fi
exit $rc
