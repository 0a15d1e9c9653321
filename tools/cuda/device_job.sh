#!/usr/bin/env bash
# The CUDA device job: runs on the GPU machine (no Rust there) over what tools/cuda/stage.sh
# staged: this script's folder (kit/) and, beside it, bin.tar.xz and the model's chunks m.NN.
# Writes everything under $OUT (log.txt, *.json) and prints a summary last.
#
#   bash STAGE/kit/device_job.sh chunk   # only move the model chunks that arrived to /tmp/tine-gpu
#   bash STAGE/kit/device_job.sh probe   # + libraries, GPU, the binary starts, synthetic CUDA tests
#   bash STAGE/kit/device_job.sh all     # + the real model: CUDA tests, greedy ids CUDA vs CPU,
#                                        #   JIT cold/warm first token, prefill/decode, spec, serve
#
# A warm device machine keeps /tmp between calls, so the chunks collect there one call at a time.
# `tine --device cuda` runs the default model on the GPU engine (tine-gpu); TINE_GPU_ENGINE=0 runs
# candle's CUDA path (the synthetic CUDA tests run candle's path: their F32 weights are not the
# engine's types).
set -uo pipefail
S="$(cd "$(dirname "$0")" && pwd)"
P="$(dirname "$S")"
W=/tmp/tine-gpu
OUT="${OUT:-$W/out}"
mkdir -p "$W" "$OUT"
mode="${1:-all}"
log="$OUT/log.txt"
say() { echo "== $*" | tee -a "$log"; }
step() { # step NAME SECONDS CMD...: run with a time limit, log everything, never abort the job
  local name=$1 secs=$2; shift 2
  say "$name: $*"
  local t0; t0=$(date +%s%N)
  timeout "$secs" "$@" >>"$log" 2>&1
  local rc=$?
  say "$name: rc=$rc in $((($(date +%s%N) - t0) / 1000000)) ms"
  return $rc
}

# Chunks: move whatever arrived into /tmp, which survives between calls on a warm machine.
for c in "$P"/m.*; do [ -e "$c" ] && mv "$c" "$W/"; done
ls -la "$W" | tee -a "$log"
[ "$mode" = chunk ] && exit 0

# The binaries (one xz tar; Python unpacks it, the image may have no xz).
if [ -e "$P/bin.tar.xz" ]; then
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$P/bin.tar.xz" "$W" && chmod +x "$W/tine"; [ -e "$W/runtime-tests" ] && chmod +x "$W/runtime-tests"
fi
# The first copy of each CUDA library found (PyTorch's wheels or the image's toolkit).
libdirs=$(find /usr /opt -name 'libcublasLt.so.13' -o -name 'libcublas.so.13' -o -name 'libcudart.so.13' -o -name 'libcurand.so.10' -o -name 'libnvrtc.so.13' 2>/dev/null |
  awk -F/ '{ n = $NF; if (!(n in seen)) { seen[n] = 1; sub("/" n "$", ""); print } }' | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; nvidia-smi | head -n 4
  grep -m1 'model name' /proc/cpuinfo; nproc; ldd "$W/tine" | grep -E 'cu|nvrtc|not found'; } >>"$log" 2>&1
export TINE_CACHE_DIR=$W/cache CUDA_CACHE_PATH=$W/jit-cache
mkdir -p "$TINE_CACHE_DIR/models"

step version 30 "$W/tine" --version
# Patch 0021: the binary links no CUDA library. Without the toolkit's libraries on the search
# path it still starts, and --device cuda names what it cannot load (rc 1, not a panic).
step no-libs-start 30 env LD_LIBRARY_PATH= "$W/tine" --version
step no-libs-cuda 60 env LD_LIBRARY_PATH= "$W/tine" generate --device cuda -p "Hello" -n 1 -m /nonexistent.gguf
# The synthetic CUDA tests (no model needed): CUDA vs float64, verify batches, rollback, heads.
if [ ! -e "$W/synthetic-tests.ok" ]; then
  step synthetic-tests 240 "$W/runtime-tests" cuda:: --skip real_model --nocapture --test-threads=1 && touch "$W/synthetic-tests.ok"
fi
[ "$mode" = probe ] && { tail -c 8000 "$log"; exit 0; }

# The model.
M=$TINE_CACHE_DIR/models/gemma-3-270m-q4_k_m.gguf
if [ ! -s "$M" ]; then cat $(ls "$W"/m.* | sort) > "$M"; fi
say "model sha256 $(sha256sum "$M" | cut -d' ' -f1) want $(cat "$S/model.sha256")"
T="$W/tine"

# 1. First token with a cold driver JIT cache, then warm: the same command again over the cache
#    the first run filled. With the cubins of patch 0020 the driver has nothing to compile.
rm -rf "$CUDA_CACHE_PATH"
for run in cold warm; do
  step "first-token-$run" 120 "$T" generate --device cuda -p "Hello" -n 4 --temp 0 --ignore-eos --json "$OUT/first-$run.json"
done
step first-token-nocache 120 env CUDA_CACHE_DISABLE=1 "$T" generate --device cuda -p "Hello" -n 4 --temp 0 --ignore-eos --json "$OUT/first-nocache.json"
# The same without the JIT cache, loading candle's PTX modules instead of the embedded cubins
# (patch 0020): what every first run cost before it.
step first-token-ptx-nocache 180 env CUDA_CACHE_DISABLE=1 CANDLE_CUDA_PTX_ONLY=1 "$T" generate --device cuda -p "Hello" -n 4 --temp 0 --ignore-eos --json "$OUT/first-ptx-nocache.json"

# 2. Greedy ids, CUDA vs CPU (this binary's CPU path; the CPU ids produced on the build machine
#    are in S/cpu-ref.jsonl), 128 tokens per prompt.
i=0
while IFS= read -r p; do
  i=$((i + 1))
  for dev in cuda cpu; do
    step "greedy-$i-$dev" 120 "$T" generate --device $dev -p "$(printf '%b' "$p")" -n 128 --temp 0 --ignore-eos --json "$OUT/greedy-$i-$dev.json"
  done
done <"$S/prompts.txt"

# 3. The real-model CUDA tests (CUDA vs CPU logits and ids, vs llama.cpp's recorded ids).
step real-model-tests 300 "$W/runtime-tests" cuda::cuda_real_model --nocapture --test-threads=1

# 4. Prefill and decode: a 1760-token prompt + 512 tokens, three runs (generate), then serve.
for r in 1 2 3; do
  step "speed-$r" 120 "$T" generate --device cuda --prompt-ids "$S/long-prompt.json" -n 512 --temp 0 --ignore-eos --json "$OUT/speed-$r.json"
done
step speed-short 120 "$T" generate --device cuda -p "Once upon a time" -n 512 --temp 0 --ignore-eos --json "$OUT/speed-short.json"
# Greedy decode picks the argmax on the GPU; the same with every logit row copied to the host.
for r in 1 2 3; do
  step "speed-host-argmax-$r" 120 env TINE_ARGMAX_ON_HOST=1 "$T" generate --device cuda --prompt-ids "$S/long-prompt.json" -n 512 --temp 0 --ignore-eos --json "$OUT/speed-host-argmax-$r.json"
  step "speed-short-host-argmax-$r" 120 env TINE_ARGMAX_ON_HOST=1 "$T" generate --device cuda -p "Once upon a time" -n 512 --temp 0 --ignore-eos --json "$OUT/speed-short-host-argmax-$r.json"
  step "speed-short-$r" 120 "$T" generate --device cuda -p "Once upon a time" -n 512 --temp 0 --ignore-eos --json "$OUT/speed-short-$r.json"
done

# 5. Speculative decoding on the GPU: every type, exactness and speed.
G=$W/nextn.gguf
step graft 120 "$T" graft-nextn --target "$M" --head drafters/gemma3-270m-nextn.gguf -o "$G"
# (the assistant head's attention is the CPU's batch-invariant kernel only, patch 0012: it fails
# on CUDA, so logit-equiv and spec-bench leave it out; its own generate below shows the error)
step logit-equiv 300 "$T" logit-equiv --device cuda -m "$G" --all -n 64 --depths 1,3 --json "$OUT/logit-equiv.json"
for t in draft-mtp ngram; do
  step "spec-$t" 120 "$T" generate --device cuda -m "$G" --spec-type $t -p "Once upon a time" -n 256 --temp 0 --ignore-eos --json "$OUT/spec-$t.json"
done
step spec-draft-assistant 120 "$T" generate --device cuda --spec-type draft-assistant --mtp-head drafters/gemma3-270m-assistant.gguf -p "Once upon a time" -n 256 --temp 0 --ignore-eos --json "$OUT/spec-draft-assistant.json"

# 6. tine serve --device cuda: /completion with the three-way method's prompt (token ids).
PORT=18081
"$T" serve --device cuda --port $PORT -c 4096 >"$OUT/serve.log" 2>&1 &
SP=$!
step serve 240 python3 "$S/serve_check.py" "http://127.0.0.1:$PORT" "$S/long-prompt.json" "$OUT/serve.json"
kill "$SP" 2>/dev/null; wait "$SP" 2>/dev/null
tail -n 5 "$OUT/serve.log" >>"$log"

step spec-bench 300 "$T" spec-bench --device cuda -m "$G" --types ngram,draft-mtp,reject --depths 1,3 --rounds 1 --sets mtp9 -n 128 --out "$OUT/spec-bench.md"

grep -E '^== .*rc=' "$log" | tail -n 40
python3 "$S/summary.py" "$OUT" "$S/cpu-ref.jsonl" | tee "$OUT/summary.txt"
