#!/usr/bin/env bash
# Qwen3.5 on `--device cuda` (candle's CUDA path: the GPU engine runs Gemma 3 only), on the
# device machine: greedy output of `tine generate` on the CPU and on the GPU for random-weight
# qwen35 GGUFs (tools/qwen35_random_model.py --shape small, F16 and Q4_K_M), and every spec type
# against plain decoding on the GPU. Staged here by:
#
#   TINE_CUDA_TARGET_CPU=x86-64-v3 tools/cuda/build.sh          # target/cuda/release/tine
#   mkdir -p target/q35-dev && cp target/cuda/release/tine /tmp/tine && strip /tmp/tine \
#     && tar -C /tmp -cJf target/q35-dev/tine.tar.xz tine
#   cp /tmp/q35small-f16.gguf /tmp/q35small-q4_k_m.gguf target/q35-dev/
#
# and run with the device call's carry of target/q35-dev: `bash tools/cuda/qwen35_job.sh`.
set -uo pipefail
S=target/q35-dev
W="${OUT:-/tmp}/q35"
mkdir -p "$W"
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$S/tine.tar.xz" "$W" && chmod +x "$W/tine"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
fails=0
for m in q35small-f16.gguf q35small-q4_k_m.gguf; do
  for p in 'The history of the printing press begins' 'Once upon a time, in a small village by the sea,'; do
    base=(generate -m "$S/$m" -p "$p" -n 48 --temp 0 --ignore-eos)
    cpu=$("$W/tine" "${base[@]}" --device cpu 2>"$W/err")
    gpu=$("$W/tine" "${base[@]}" --device cuda 2>"$W/err-gpu") || { echo "FAIL $m: cuda run failed"; tail -5 "$W/err-gpu"; fails=$((fails + 1)); continue; }
    grep -E "engine|candle|loaded" "$W/err-gpu" | head -2
    if [ "$cpu" = "$gpu" ]; then echo "same  $m cpu/cuda: ${p:0:24}"; else echo "DIFF  $m cpu/cuda: ${p:0:24}"; echo "  cpu: ${cpu: -60}"; echo "  gpu: ${gpu: -60}"; fi
    for spec in "--spec-type draft-mtp" "--spec-type ngram --spec-ngram-min 1" "--spec-type ngram,draft-mtp"; do
      got=$("$W/tine" "${base[@]}" --device cuda $spec 2>"$W/err-spec") || { echo "FAIL $m $spec"; tail -5 "$W/err-spec"; fails=$((fails + 1)); continue; }
      if [ "$got" = "$gpu" ]; then echo "same  $m cuda $spec vs plain"; else echo "DIFF  $m cuda $spec vs plain"; fi
      grep -E "verify steps" "$W/err-spec" | head -1
    done
  done
done
echo "failures: $fails"
