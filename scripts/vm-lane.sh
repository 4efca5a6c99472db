#!/bin/sh
# Runs inside the soft-RoCE VM (busybox sh): each test binary given, one after the other, on
# provider verbs against rxe0. Exits non-zero if any failed. Each binary's line gives the least
# memory the guest had available while it ran (sampled every second), and a binary ended by a
# signal gets the guest kernel's word on it: an out-of-memory kill names itself there.
low=/tmp/vm-lane-low
sample() {
    min=
    while :; do
        a=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
        if [ -z "$min" ] || [ "$a" -lt "$min" ]; then min=$a; echo "$min" > "$low"; fi
        sleep 1
    done
}
rc=0
for b in "$@"; do
    echo "=== running $b on verbs (rxe0)"
    start=$(date +%s)
    rm -f "$low"
    sample &
    watcher=$!
    "./$b" --test-threads=1
    s=$?
    kill "$watcher" 2>/dev/null
    wait "$watcher" 2>/dev/null
    [ $s -eq 0 ] || rc=1
    least=$(awk '{printf "%d MiB", $1 / 1024}' "$low" 2>/dev/null)
    echo "=== $b took $(($(date +%s) - start)) s (exit status $s; least guest memory available: ${least:-?})"
    if [ $s -gt 128 ]; then
        echo "=== $b was ended by signal $((s - 128)); the guest kernel's last words on it:"
        dmesg | grep -iE 'out of memory|oom-kill|oom_reaper|killed process|segfault|general protection' | tail -n 8
    fi
done
exit $rc
