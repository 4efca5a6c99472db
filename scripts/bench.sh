#!/usr/bin/env bash
# The main job: the latency-by-size benchmark of an RPC service on the default provider
# (RDMA_RPC_PROVIDER, else shm: both ends run on this host), with raw provider operations,
# memcpy, TCP and tarpc baselines
# measured in the same run; prints perftest-style tables and a summary of ratios.
# Installs missing apt packages first. Extra arguments go to the harness, e.g.
#   scripts/bench.sh --sizes 64,4096 --modes rpc,tcp --json out.json --plot out.svg
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
exec cargo bench --bench latency -- "$@"
