#!/bin/sh
# Runs inside the soft-RoCE VM (busybox sh): each test binary given, one after the other, on
# provider verbs against rxe0. Exits non-zero if any failed.
rc=0
for b in "$@"; do
    echo "=== running $b on verbs (rxe0)"
    start=$(date +%s)
    "./$b" --test-threads=1 || rc=1
    echo "=== $b took $(($(date +%s) - start)) s"
done
exit $rc
