#!/usr/bin/env bash
# A bounded libFuzzer run of every target in rpc-core/fuzz (frame, hello, request, session),
# starting from the committed corpus. Needs the nightly toolchain (the machine image has one)
# and cargo-fuzz (installed here when missing). New inputs go to a temporary directory; to
# keep them, add them to rpc-core/fuzz/corpus/<target>/ (then `cargo +nightly fuzz cmin`).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      (default 20)
#
# Limits: -malloc_limit_mb=512 (no allocation sized by a length field), -rss_limit_mb=2048,
# -timeout=10 (no input may hang). A crash leaves its input in rpc-core/fuzz/artifacts/.
set -uo pipefail
cd "$(dirname "$0")/../rpc-core"
secs=${1:-20}
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: no nightly toolchain here; the corpus replay in tests/fuzz_corpus.rs still ran on stable"
    exit 0
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz" >&2
    cargo install --locked --quiet cargo-fuzz || exit 1
fi
cargo +nightly fuzz build >/dev/null 2>&1 || { cargo +nightly fuzz build; exit 1; }
fail=0
for t in frame hello request session; do
    new=$(mktemp -d "${TMPDIR:-/tmp}/fuzz-$t.XXXXXX")
    out=$(cargo +nightly fuzz run "$t" "$new" "fuzz/corpus/$t" -- \
        -max_total_time="$secs" -malloc_limit_mb=512 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 2>&1)
    rc=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' <<<"$out" | tail -1)
    if ((rc == 0)); then
        echo "fuzz $t: ${runs:-?} runs in ${secs}s, no crash, $(ls "$new" | wc -l) new inputs"
    else
        echo "fuzz $t: FAILED"; grep -E 'ERROR|panicked|SUMMARY|Test unit written' <<<"$out" | head -20; fail=1
    fi
    rm -rf "$new"
done
exit $fail
