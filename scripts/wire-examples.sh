#!/bin/sh
# Runs in both VMs of scripts/rxe-wire.sh (busybox sh): the examples with their servers on
# host A and their clients on host B, each result checked as tests/examples.rs checks it on one
# host: echo byte for byte from 1 B to 1 MiB, kv's check (torn copies caught), lock's counter
# and tickets exact with three clients, logsync's logs identical on both hosts. The example
# binaries are in /examples (rxe-wire.sh -f target/vm/examples/NAME:/examples/NAME).
ex=/examples me=$RDMA_RPC_TEST_IP peer=$RDMA_RPC_PEER_IP
fail() { echo "wire-examples: FAILED: $*"; exit 1; }
if [ "$RDMA_RPC_ROLE" = server ]; then
    "$ex/echo" --provider verbs --listen "$me:7471" > /tmp/echo.log 2>&1 & echo_pid=$!
    "$ex/logsync" --provider verbs backup --listen "$me:7472" --out /tmp/backup.log > /tmp/logsync.log 2>&1 & log_pid=$!
    "$ex/kv" --provider verbs server --listen "$me:7473" --torn-window-us 100 > /tmp/kv.log 2>&1 & kv_pid=$!
    "$ex/lock" --provider verbs server --listen "$me:7474" > /tmp/lock.log 2>&1 & lock_pid=$!
    # Host B sends the primary's log digest when its clients are done.
    digest=$(nc -l -p 7999) || fail "no word from host B"
    wait $log_pid || { cat /tmp/logsync.log; fail "the logsync backup"; }
    mine=$(grep 'log digest' /tmp/logsync.log | awk '{print $NF}')
    [ -n "$mine" ] && [ "$mine" = "$digest" ] || fail "logsync: the backup's log digest $mine, the primary's $digest"
    echo "logsync: the backup's log on host A has the primary's digest $mine"
    kill -TERM $echo_pid
    wait $echo_pid || { cat /tmp/echo.log; fail "the echo server did not shut down cleanly on SIGTERM"; }
    kill $kv_pid $lock_pid
    echo "wire-examples: server: ok"
    exit 0
fi
sleep 3
out=$("$ex/echo" --provider verbs --connect "$peer:7471" --sizes 1,64,70000,1048576 --iters 20 2>&1) || { echo "$out"; fail echo; }
echo "$out" | grep 'echoes verified' || { echo "$out"; fail "echo: no verified echoes"; }
out=$("$ex/kv" --provider verbs client --connect "$peer:7473" check --seconds 2 --deletes --min-torn 3 2>&1) || { echo "$out"; fail kv; }
echo "$out" | grep 'check passed' || { echo "$out"; fail "kv: no check passed"; }
for i in 1 2 3; do
    "$ex/lock" --provider verbs client --connect "$peer:7474" --id $i --increments 200 --tickets-out /tmp/tickets-$i > /tmp/lock-$i.log 2>&1 &
done
for i in 1 2 3; do wait %$i 2>/dev/null; done
wait
report=$("$ex/lock" --provider verbs report --connect "$peer:7474" 2>&1) || { echo "$report"; fail "lock report"; }
[ "$report" = "lock 0 counter 600 sequencer 600" ] || { cat /tmp/lock-*.log; fail "lock: $report, not 600 and 600"; }
tickets=$(cat /tmp/tickets-1 /tmp/tickets-2 /tmp/tickets-3 | sort -n | uniq | wc -l)
[ "$tickets" = 600 ] || fail "lock: $tickets distinct tickets of 600"
echo "lock: three clients on host B, $report, 600 distinct tickets"
out=$("$ex/logsync" --provider verbs primary --connect "$peer:7472" --out /tmp/primary.log --mib 4 --rpc-appends 100 2>&1) || { echo "$out"; fail logsync; }
digest=$(echo "$out" | grep 'log digest' | awk '{print $NF}')
[ -n "$digest" ] || { echo "$out"; fail "logsync: no digest"; }
echo "$digest" | nc "$peer" 7999 || fail "telling host A the digest"
echo "wire-examples: client: ok"
