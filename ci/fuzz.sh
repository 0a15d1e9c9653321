#!/usr/bin/env bash
# Optional: fuzz the patch parser for a while (needs a nightly toolchain and `cargo install cargo-fuzz`).
# Not part of `cargo xtask ci`; run it by hand before changing xtask/chain/src/patch.rs.
set -euo pipefail
cd "$(dirname "$0")/../xtask/fuzz"
exec cargo +nightly fuzz run parse_patch -- -max_total_time="${FUZZ_SECONDS:-60}"
