#!/usr/bin/env bash
# Installs what building and testing rdma-rpc needs on Debian 12 (bookworm): the verbs provider
# links libibverbs and librdmacm through rdma-sys, whose bindgen step needs libclang; the fault
# tests need iproute2 and nftables.
# Idempotent: installs only what is missing. Needs root (or sudo) for apt-get.
set -euo pipefail
need=()
command -v pkg-config >/dev/null || need+=(pkg-config)
pkg-config --exists libibverbs 2>/dev/null || need+=(libibverbs-dev)
pkg-config --exists librdmacm 2>/dev/null || need+=(librdmacm-dev)
compgen -G "/usr/lib/x86_64-linux-gnu/libibverbs/*-rdmav*.so" >/dev/null || need+=(ibverbs-providers)
# (libclang-cpp, which other packages bring, is not libclang: match libclang.so / libclang-<N>.so only)
compgen -G "/usr/lib/llvm-14/lib/libclang.so*" >/dev/null || compgen -G "/usr/lib/x86_64-linux-gnu/libclang-[0-9]*.so*" >/dev/null || need+=(libclang1-14)
[[ -d /usr/lib/llvm-14/lib/clang ]] || need+=(libclang-common-14-dev)
# The fault tests (tests/faults.rs) build network namespaces and drop packets with nftables.
command -v ip >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)
if ((${#need[@]})); then
    echo "deps: installing ${need[*]}" >&2
    SUDO=; [[ $(id -u) == 0 ]] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
