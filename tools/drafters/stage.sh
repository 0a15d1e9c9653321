#!/bin/bash
# Prepare what the device calls carry (run here, in the repo root):
#   .stage/c0..c3  the target GGUF in four ~60 MiB chunks (a call carries at most 64 MiB with the tree)
#   .whl/          the pure-Python `gguf` wheel (not in the device image)
# Both folders must be ignored (.git/info/exclude), never committed.
set -euo pipefail
MODEL=${1:-/root/.cache/tine/models/gemma-3-270m-q4_k_m.gguf}
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.stage/' .git/info/exclude 2>/dev/null || echo '/.stage/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .stage .whl
rm -f .stage/c?
split -n 4 -d -a 1 "$MODEL" .stage/c
sha256sum "$MODEL" | cut -d' ' -f1 > .stage/model.sha256
ls .whl/gguf-0.19.0-py3-none-any.whl >/dev/null 2>&1 || python3 -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl gguf==0.19.0
ls -la .stage .whl
