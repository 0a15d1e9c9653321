#!/usr/bin/env bash
# The GPU engine's device job (tine-gpu): runs on the GPU machine over what
# tools/cuda/engine_stage.sh staged into target/gpu-engine (carried by the device call).
#
#   bash tools/cuda/engine_job.sh chunk    # move the model chunks that arrived to /tmp (warm machine)
#   bash tools/cuda/engine_job.sh kernels  # the kernel table (embedded cubin, then one nvcc compiled
#                                          # here from the checkout's decode.cu) and the step bench
#   bash tools/cuda/engine_job.sh model    # + the real model: nodes, speed, verify rows, CPU ids
#   bash tools/cuda/engine_job.sh profile  # the table, then the bench's per-launch profile for the
#                                          # embedded kernels and for each target/gpu-engine/*.cu
#                                          # (compiled here), and one step under ncu
#   bash tools/cuda/engine_job.sh ncu      # ncu's full sections for a few launches
#
# Writes $OUT/engine-log.txt; prints the tail.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
S="$root/target/gpu-engine"
W=/tmp/tine-gpu-engine
OUT="${OUT:-$W/out}"
mkdir -p "$W" "$OUT"
mode="${1:-kernels}"
log="$OUT/engine-log.txt"
for c in "$S"/m.*; do [ -e "$c" ] && mv "$c" "$W/"; done
ls -la "$W" >>"$log"
[ "$mode" = chunk ] && { tail -n 20 "$log"; exit 0; }

say() { echo "== $*" | tee -a "$log"; }
bin="$W/tine-gpu-check"
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$S/bin.tar.xz" "$W" && chmod +x "$bin"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -n 2; } >>"$log" 2>&1

if [ "$mode" = ncu ]; then mode=profile; only_ncu=1; fi
say "kernel table, embedded cubin"
if [ "$mode" = profile ] && [ -z "${only_ncu:-}" ]; then
  timeout 300 "$bin" --profile 2>&1 | tee -a "$log"
  say "rc=${PIPESTATUS[0]}"
  for cu in "$S"/*.cu; do
    [ -e "$cu" ] || continue
    say "variant $(basename "$cu"): table and profile"
    nvcc -cubin -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$W/variant.cubin" "$cu" >>"$log" 2>&1 || { say "nvcc failed"; continue; }
    TINE_GPU_CUBIN="$W/variant.cubin" timeout 300 "$bin" --profile 2>&1 | grep -v '^ok ' | tee -a "$log"
  done
  say "one step under ncu (eager rows=1 warm-up launches)"
  timeout 240 ncu --clock-control none --launch-count 174 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size \
    "$bin" --no-table --bench >"$OUT/ncu-step.txt" 2>&1
  say "ncu rc=$? ($(wc -l <"$OUT/ncu-step.txt") lines in ncu-step.txt)"
  tail -n 5 "$OUT/ncu-step.txt" | tee -a "$log"
  exit 0
fi
if [ -n "${only_ncu:-}" ]; then
  # Full sections (stall reasons, source hot spots) for one launch of each kind: the first
  # attention, norm_quant and GEMV launches of a layer (TINE_NCU_KERNELS: kernel:skip pairs).
  for ks in ${TINE_NCU_KERNELS:-attn_decode:0 norm_quant:0 gemv_m1:0 gemv_m1:3 gemv_m1:72}; do
    say "ncu full: ${ks%%:*} (launch skip ${ks##*:})"
    timeout 120 ncu --clock-control none --set full --import-source no -k "regex:${ks%%:*}" --launch-skip "${ks##*:}" --launch-count 1 \
      "$bin" --no-table --bench >"$OUT/ncu-${ks%%:*}-${ks##*:}.txt" 2>&1
    grep -E "Duration|Registers Per|Achieved Occupancy|Memory Throughput|DRAM Throughput|Warp Cycles Per Issued|Stall|stall|One or More Eligible" "$OUT/ncu-${ks%%:*}-${ks##*:}.txt" | head -n 30 | tee -a "$log"
  done
  exit 0
fi
timeout 300 "$bin" --bench 2>&1 | tee -a "$log"
say "rc=${PIPESTATUS[0]}"

# The development loop: decode.cu compiled here, loaded from the file (no Rust build needed).
say "kernel table, cubin compiled on this machine"
t0=$(date +%s%N)
nvcc -cubin -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$W/decode.cubin" "$root/engine/crates/tine-gpu/kernels/decode.cu" >>"$log" 2>&1
say "nvcc: rc=$? in $((($(date +%s%N) - t0) / 1000000)) ms"
TINE_GPU_CUBIN="$W/decode.cubin" timeout 300 "$bin" --seed 2 2>&1 | tail -n 3 | tee -a "$log"

if [ "$mode" = model ]; then
  M="$W/model.gguf"
  [ -s "$M" ] || cat $(ls "$W"/m.* | sort) >"$M"
  say "model sha256 $(sha256sum "$M" | cut -d' ' -f1) want $(cat "$S/model.sha256")"
  timeout 400 "$bin" --model "$M" --ref "$S/cpu-ref.jsonl" 2>&1 | grep -v '^ok ' | tee -a "$log"
  say "rc=${PIPESTATUS[0]}"
fi
