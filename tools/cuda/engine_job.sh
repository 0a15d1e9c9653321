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
#   bash tools/cuda/engine_job.sh runtime  # `tine` (target/gpu-engine/tine.tar.xz) on the engine
#                                          # (TINE_GPU_ENGINE=1): greedy ids against the CPU's,
#                                          # decode speed against candle's CUDA path, spec on vs
#                                          # off at temperature 0 and seeded 0.8, spec-bench
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

if [ "$mode" = runtime ]; then
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$S/tine.tar.xz" "$W" && chmod +x "$W/tine"
  M="$W/model.gguf"
  [ -s "$M" ] || cat $(ls "$W"/m.* | sort) >"$M"
  say "model sha256 $(sha256sum "$M" | cut -d' ' -f1) want $(cat "$S/model.sha256")"
  T="$W/tine"
  run() { # run NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    say "$name: $*"
    timeout "$secs" "$@" >>"$log" 2>&1
    say "$name: rc=$?"
  }
  # Greedy ids on the engine against the CPU path's (the prompts of cpu-ref.jsonl, by id).
  python3 - "$S/cpu-ref.jsonl" "$W" <<'PY'
import json, sys
for i, line in enumerate(open(sys.argv[1])):
    json.dump(json.loads(line)["prompt_ids"], open(f"{sys.argv[2]}/prompt-{i + 1}.json", "w"))
PY
  for i in 1 2 3 4 5 6; do
    run "greedy-$i" 60 env TINE_GPU_ENGINE=1 "$T" generate --device cuda -m "$M" --prompt-ids "$W/prompt-$i.json" -n 64 --temp 0 --ignore-eos --json "$OUT/greedy-$i.json"
  done
  python3 - "$S/cpu-ref.jsonl" "$OUT" <<'PY' | tee -a "$log"
import json, sys
for i, line in enumerate(open(sys.argv[1])):
    want = json.loads(line)["ids"]
    try:
        got = json.load(open(f"{sys.argv[2]}/greedy-{i + 1}.json"))
    except Exception as e:
        print(f"prompt {i + 1}: no result ({e})"); continue
    ids = got["ids"]
    at = next((j for j, (a, b) in enumerate(zip(ids, want)) if a != b), None)
    print(f"prompt {i + 1}: engine {got.get('engine', '?')}, " + (f"{len(want)} ids equal to the CPU path's" if at is None else f"equal for {at} of {len(want)}; engine {ids[at]}, CPU {want[at]}"))
PY
  # Decode speed: the engine, then candle's CUDA path, 512 tokens after a short prompt.
  for r in 1 2; do
    run "speed-engine-$r" 60 env TINE_GPU_ENGINE=1 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 512 --temp 0 --ignore-eos --json "$OUT/speed-engine-$r.json"
  done
  run speed-candle 120 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 512 --temp 0 --ignore-eos --json "$OUT/speed-candle.json"
  # Spec on vs off on the engine: n-gram and the draft model (the target drafting itself).
  for temp in 0 0.8; do
    run "plain-t$temp" 60 env TINE_GPU_ENGINE=1 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 256 --temp $temp --seed 7 --ignore-eos --json "$OUT/plain-t$temp.json"
    run "ngram-t$temp" 60 env TINE_GPU_ENGINE=1 "$T" generate --device cuda -m "$M" --spec-type ngram -p "Once upon a time" -n 256 --temp $temp --seed 7 --ignore-eos --json "$OUT/ngram-t$temp.json"
    run "draft-t$temp" 60 env TINE_GPU_ENGINE=1 "$T" generate --device cuda -m "$M" -md "$M" -p "Once upon a time" -n 256 --temp $temp --seed 7 --ignore-eos --json "$OUT/draft-t$temp.json"
  done
  python3 - "$OUT" <<'PY' | tee -a "$log"
import json, sys, os
o = sys.argv[1]
def load(n):
    try: return json.load(open(f"{o}/{n}.json"))
    except Exception: return None
for n in ["speed-engine-1", "speed-engine-2", "speed-candle"]:
    d = load(n)
    print(f"{n}: " + ("no result" if d is None else f"{d.get('engine', '?')}: decode {d['predicted_per_second']:.1f} tok/s, first token {d['first_token_ms']:.1f} ms"))
for t in ["0", "0.8"]:
    p = load(f"plain-t{t}")
    for s in ["ngram", "draft"]:
        d = load(f"{s}-t{t}")
        if p is None or d is None: print(f"{s} temp {t}: no result"); continue
        same = d["ids"] == p["ids"]
        print(f"{s} temp {t}: spec {'IDENTICAL to' if same else 'DIFFERS from'} plain; accepted {d['draft_n_accepted']}/{d['draft_n']}; {d['predicted_per_second']:.1f} vs plain {p['predicted_per_second']:.1f} tok/s")
PY
  run spec-bench 240 env TINE_GPU_ENGINE=1 "$T" spec-bench --device cuda -m "$M" -md "$M" --types ngram,draft,reject --depths 1,3 --rounds 1 --sets mtp9 -n 128 --out "$OUT/spec-bench.md"
  tail -n 30 "$OUT/spec-bench.md" 2>/dev/null | tee -a "$log"
  exit 0
fi
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
