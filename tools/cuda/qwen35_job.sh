#!/usr/bin/env bash
# Qwen3.5 on the GPU engine, on the device machine, over what tools/cuda/qwen35_stage.sh staged
# into target/q35-engine (carried by the device call):
#
#   bash tools/cuda/qwen35_job.sh check   # the kernel table; random-weight qwen35 GGUFs written
#                                         # here (shapes `small` and `0.8b`, F16, quantized to
#                                         # Q4_K_M by the llama-quantize built here); tine-gpu-check
#                                         # --qwen35 on both (verify rows and rolled-back states
#                                         # against one-row steps, speed); `tine generate` on the
#                                         # engine against the CPU path and candle's CUDA path,
#                                         # and every spec type against plain decoding
#   bash tools/cuda/qwen35_job.sh bench   # llama-bench tg128/pp512 against tine on the engine
#                                         # and on candle's CUDA path, same GGUF (0.8b Q4_K_M)
#   bash tools/cuda/qwen35_job.sh slim    # no llama.cpp: the table, both families' random GGUFs
#                                         # quantized by tine-gpu-check --quantize, their checks
#                                         # (and A/B timings), ids against the CPU path
#   bash tools/cuda/qwen35_job.sh gemma4  # Gemma 4 on the engine: the kernel table, random-weight
#                                         # GGUFs (tools/gemma4_random_model.py: `small-e2b`,
#                                         # `small-dense` quantized by tine-gpu-check --quantize;
#                                         # `e2b` by llama-quantize Q4_K_M), tine-gpu-check --gemma4
#                                         # on each, ids of the engine against the CPU path, spec
#                                         # (the assistant on the engine included) against plain,
#                                         # tg128/pp512 against llama-bench on e2b
#   bash tools/cuda/qwen35_job.sh gemma4-small  # the same without llama.cpp and the E2B shape
#   bash tools/cuda/qwen35_job.sh gemma4-e2b    # the E2B shape alone: its check, ids against the
#                                         # CPU path, tg128/pp512 against llama-bench
#   bash tools/cuda/qwen35_job.sh gemma4-trace  # where the prompt path parts from one-row steps:
#                                         # the table, --gemma4-trace and a 700-token prompt's ids
#                                         # (cpu, 8-row steps, prompt path) on the small shapes and E2B
#   bash tools/cuda/qwen35_job.sh nextn   # Qwen3.5's NextN on the engine (checks, draft-mtp vs plain
#                                         # and its acceptance vs the CPU's), --gemma4 on the small
#                                         # shapes, E2B tg128/pp512 against llama-bench
#   bash tools/cuda/qwen35_job.sh moe-bench  # qwen35moe at the A3B MoE widths (4 layers) against
#                                         # llama-bench tg128/pp512, the engine's profile
#   bash tools/cuda/qwen35_job.sh kv      # KV cache types on the engine (-ctk/-ctv f16, bf16,
#                                         # q8_0, q4_0): the kernel table, the model checks with
#                                         # --kv on each family's small shape, spec against plain
#                                         # within a type, then decode after 8k and 30k prompt
#                                         # tokens per type against llama-bench -d (Gemma 3 270M
#                                         # shape); also moe-bench's A3B run where time is left
#   bash tools/cuda/qwen35_job.sh gemma4-moe  # Gemma 4's routed experts (26B-A4B): the kernel
#                                         # table, `small-a4b`'s model checks (f32 and q8_0 K/V),
#                                         # ids against the CPU path, the assistant against plain;
#                                         # `a4b-6l` (26B-A4B's MoE widths, 6 layers, Q4_K_M)
#                                         # against llama-bench, its check, ids against candle CUDA
#   bash tools/cuda/qwen35_job.sh quick-moe-batch  # gemma4-moe without llama.cpp and a4b-6l, plus
#                                         # Gemma 3's batched step (tine-gpu-check --batch)
#   bash tools/cuda/qwen35_job.sh mini    # small-a4b's check and ids, Gemma 3's batched step on
#                                         # `small`: the new paths in about a minute
#   bash tools/cuda/qwen35_job.sh serve-batch  # issue 50: the kernel table, the batched step
#                                         # (tine-gpu-check --batch on Gemma 3 `small` and `270m`,
#                                         # Gemma 4 `small-e2b` and `small-a4b`, Qwen3.5
#                                         # `small` and `small-moe`),
#                                         # then `tine serve --device cuda --parallel 64` batched and
#                                         # one slot a step (TINE_GPU_BATCH=0) against llama-server
#                                         # -np 64 -ngl 99 on the same random 270M-shape Q4_K_M
#                                         # (bench/serve_load.py clients 1,4,16,64 x 256 tokens;
#                                         # SERVE_SPEC=1: again with n-gram speculation;
#                                         # SKIP_TABLE=1: without the kernel table; SERVE_MIXED=1:
#                                         # serve_load.py mixed, 16 requests of mixed kinds each
#                                         # against its solo run, plain and n-gram)
#   bash tools/cuda/qwen35_job.sh turbo   # issue 53: the turbo KV types on the engine
#                                         # (TINE_GPU_TURBO=1): table, model checks with --kv
#                                         # turbo*, spec against plain, decode after 8k/30k
#   bash tools/cuda/qwen35_job.sh regress # every family's small shapes, one sequence: the model
#                                         # checks, ids against the CPU path, n-gram and a
#                                         # self-draft against plain, then the batched step
#   bash tools/cuda/qwen35_job.sh router  # the MoE router's two launches: the kernel table and
#                                         # --qwen35 on `small-moe` (no llama.cpp build)
#   bash tools/cuda/qwen35_job.sh gemma3  # Gemma 3 on the engine over random-weight GGUFs
#                                         # (tools/gemma3_random_model.py): tine-gpu-check
#                                         # --model, ids against the CPU path, tg128 against
#                                         # llama-bench
#
# Everything it makes stays in /tmp/q35 while the machine is warm (a second call reuses it).
# Writes $OUT/q35-log.txt; prints a summary.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
S="$root/target/q35-engine"
W=/tmp/q35
OUT="${OUT:-$W/out}"
mkdir -p "$W" "$OUT"
mode="${1:-check}"
log="$OUT/q35-log.txt"
say() { echo "== $*" | tee -a "$log"; }
run() { # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  say "$name: $*"
  timeout "$secs" "$@" >>"$log" 2>&1
  local rc=$?
  say "$name: rc=$rc"
  return $rc
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -n 2; nproc; } >>"$log" 2>&1
[ -x "$W/tine" ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$S/bin.tar.xz" "$W"
[ -d "$W/llama.cpp" ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$S/llama.tar.xz" "$W"
T="$W/tine"
C="$W/tine-gpu-check"
LB="$W/llama.cpp/build/bin"

# llama.cpp CUDA, built in the background while the checks run.
build_llama() {
  [ -x "$LB/llama-quantize" ] && [ -x "$LB/llama-bench" ] && { [ -z "${LLAMA_EXTRA_TARGETS:-}" ] || [ -x "$LB/llama-server" ]; } && return 0
  local t0
  t0=$(date +%s)
  cmake -S "$W/llama.cpp" -B "$W/llama.cpp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON >"$W/llama-build.log" 2>&1 &&
    cmake --build "$W/llama.cpp/build" -j"$(nproc)" --target llama-bench llama-quantize ${LLAMA_EXTRA_TARGETS:-} >>"$W/llama-build.log" 2>&1
  echo "llama.cpp CUDA build: rc=$? in $(($(date +%s) - t0)) s" >>"$W/llama-build.log"
}
# A random-weight GGUF of family PREFIX (g3, g4, q35) at SHAPE, written once and quantized by
# tine-gpu-check --quantize once (no llama.cpp): rgguf PREFIX SHAPE prints its path.
rgguf() {
  local pre=$1 shape=$2 tool
  case $pre in g3) tool=gemma3_random_model.py ;; g4) tool=gemma4_random_model.py ;; *) tool=qwen35_random_model.py ;; esac
  [ -s "$W/$pre-$shape-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/$tool" --shape "$shape" --out "$W/$pre-$shape-f16.gguf" >>"$W/models.log" 2>&1
  [ -s "$W/$pre-$shape-q.gguf" ] || "$C" --quantize "$W/$pre-$shape-f16.gguf" "$W/$pre-$shape-q.gguf" >>"$W/models.log" 2>&1
  echo "$W/$pre-$shape-q.gguf"
}
# A random-weight GGUF at `shape`, F16, then Q4_K_M (once llama-quantize exists).
model() {
  local shape=$1
  [ -s "$W/q35-$shape-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" \
    python3 "$root/tools/qwen35_random_model.py" --shape "$shape" --out "$W/q35-$shape-f16.gguf" >>"$W/models.log" 2>&1
}
quantize() {
  local shape=$1
  [ -s "$W/q35-$shape-q4_k_m.gguf" ] || "$LB/llama-quantize" "$W/q35-$shape-f16.gguf" "$W/q35-$shape-q4_k_m.gguf" Q4_K_M >>"$W/models.log" 2>&1
}

# tg128 and pp512 of the engine (tine generate, 3 runs each, the median) beside llama-bench's on
# the same GGUF: bench_vs_llama MODEL NAME (the runs' JSON as $W/NAME-tg128-R.json, ...).
bench_vs_llama() {
  local M=$1 name=$2
  say "llama-bench $name"
  timeout 150 "$LB/llama-bench" -m "$M" -ngl 99 -fa 1 -p 512 -n 128 -r 3 2>&1 | tee -a "$log" | grep -E '^\|'
  python3 - "$W/p512.json" <<'PY'
import json, random, sys
random.seed(5)
json.dump([random.randrange(300, 240000) for _ in range(512)], open(sys.argv[1], "w"))
PY
  for r in 1 2 3; do
    timeout 60 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 128 --temp 0 --ignore-eos --json "$W/$name-tg128-$r.json" >>"$log" 2>&1
    timeout 60 "$T" generate --device cuda -m "$M" --prompt-ids "$W/p512.json" -n 1 --temp 0 --json "$W/$name-pp512-$r.json" >>"$log" 2>&1
  done
  python3 - "$W" "$name" <<'PY' | tee -a "$log"
import json, statistics, sys
w, name = sys.argv[1], sys.argv[2]
def med(kind, key):
    v = []
    for r in (1, 2, 3):
        try: v.append(json.load(open(f"{w}/{name}-{kind}-{r}.json"))[key])
        except Exception: pass
    return f"{statistics.median(v):.1f} ({len(v)} runs)" if v else "no result"
print(f"tine {name} tg128 (engine): {med('tg128', 'predicted_per_second')} tok/s; pp512 (engine, prompt path): {med('pp512', 'prompt_per_second')} tok/s")
PY
}

if [ "$mode" = check ]; then
  build_llama &
  BP=$!
  model small &
  MP=$!
  model 0.8b &
  MP2=$!
  run kernels 300 "$C" || true
  grep -E "^(FAIL|kernels:)" "$log" | tail -n 20
  wait "$MP"
  wait "$BP"
  tail -n 1 "$W/llama-build.log" | tee -a "$log"
  quantize small
  say "small Q4_K_M: $(ls -la "$W/q35-small-q4_k_m.gguf" 2>&1)"
  run qwen35-small 240 "$C" --no-table --qwen35 "$W/q35-small-q4_k_m.gguf" || true
  # tine generate: the engine against the CPU path and candle's CUDA path; spec against plain.
  fails=0
  M="$W/q35-small-q4_k_m.gguf"
  for p in 'The history of the printing press begins' 'Once upon a time, in a small village by the sea,'; do
    base=(generate -m "$M" -p "$p" -n 48 --ignore-eos)
    cpu=$("$T" "${base[@]}" --temp 0 --device cpu 2>"$W/err-cpu")
    gpu=$("$T" "${base[@]}" --temp 0 --device cuda 2>"$W/err-gpu") || { say "FAIL cuda run: $(tail -n 3 "$W/err-gpu")"; fails=$((fails + 1)); continue; }
    candle=$(TINE_GPU_ENGINE=0 "$T" "${base[@]}" --temp 0 --device cuda 2>"$W/err-candle")
    grep -E "engine|loaded" "$W/err-gpu" | head -n 2 >>"$log"
    [ "$cpu" = "$gpu" ] && say "same  engine vs cpu: ${p:0:24}" || { say "DIFF  engine vs cpu: ${p:0:24}"; echo "  cpu:    ${cpu: -80}" >>"$log"; echo "  engine: ${gpu: -80}" >>"$log"; }
    [ "$candle" = "$gpu" ] && say "same  engine vs candle cuda: ${p:0:24}" || say "DIFF  engine vs candle cuda: ${p:0:24}"
    for temp in 0 0.8; do
      plain=$("$T" "${base[@]}" --device cuda --temp $temp --seed 7 2>"$W/err-plain") || { say "FAIL plain temp $temp: $(tail -n 2 "$W/err-plain")"; fails=$((fails + 1)); continue; }
      for spec in "--spec-type draft-mtp" "--spec-type ngram --spec-ngram-min 1" "--spec-type ngram,draft-mtp" "-md $M"; do
        got=$("$T" "${base[@]}" --device cuda --temp $temp --seed 7 $spec 2>"$W/err-spec") || { say "FAIL $spec: $(tail -n 2 "$W/err-spec")"; fails=$((fails + 1)); continue; }
        acc=$(grep -oE "drafted [0-9]+ accepted [0-9]+ \([0-9.]+%\)" "$W/err-spec" | head -n 1)
        if [ "$got" = "$plain" ]; then say "same  spec vs plain, temp $temp, $spec ($acc)"; else say "DIFF  spec vs plain, temp $temp, $spec"; fails=$((fails + 1)); fi
      done
    done
  done
  say "generate failures: $fails"
  wait "$MP2"
  quantize 0.8b
  say "0.8b Q4_K_M: $(ls -la "$W/q35-0.8b-q4_k_m.gguf" 2>&1)"
  run qwen35-0.8b 240 "$C" --no-table --qwen35 "$W/q35-0.8b-q4_k_m.gguf" || true
  grep -E "^(ok|FAIL|decode|verify|graph|qwen35)" "$log" | tail -n 40
  exit 0
fi

if [ "$mode" = bench ]; then
  build_llama
  model 0.8b
  quantize 0.8b
  M="$W/q35-0.8b-q4_k_m.gguf"
  say "llama-bench"
  timeout 240 "$LB/llama-bench" -m "$M" -ngl 99 -fa 1 -p 512 -n 128 -r 3 2>&1 | tee -a "$log" | grep -E '^\|'
  python3 - "$T" "$M" "$W/p512.json" <<'PY'
import json, random, sys
random.seed(5)
json.dump([random.randrange(300, 240000) for _ in range(512)], open(sys.argv[3], "w"))
PY
  for r in 1 2 3; do
    timeout 60 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 128 --temp 0 --ignore-eos --json "$OUT/tg128-$r.json" >>"$log" 2>&1
    timeout 60 "$T" generate --device cuda -m "$M" --prompt-ids "$W/p512.json" -n 1 --temp 0 --json "$OUT/pp512-$r.json" >>"$log" 2>&1
  done
  timeout 120 env TINE_GPU_ENGINE=0 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 128 --temp 0 --ignore-eos --json "$OUT/tg128-candle.json" >>"$log" 2>&1
  # Greedy ids at this shape: the engine (its prompt step included) against the CPU path.
  base=(generate -m "$M" -p "The history of the printing press begins" -n 32 --temp 0 --ignore-eos)
  cpu=$(timeout 120 "$T" "${base[@]}" --device cpu 2>/dev/null)
  gpu=$(timeout 60 "$T" "${base[@]}" --device cuda 2>/dev/null)
  [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  0.8b engine vs cpu, 32 greedy tokens" || { say "DIFF  0.8b engine vs cpu"; echo "  cpu:    ${cpu: -100}" >>"$log"; echo "  engine: ${gpu: -100}" >>"$log"; }
  python3 - "$OUT" <<'PY' | tee -a "$log"
import json, statistics, sys
o = sys.argv[1]
def med(name, key):
    v = []
    for r in (1, 2, 3):
        try: v.append(json.load(open(f"{o}/{name}-{r}.json"))[key])
        except Exception: pass
    return f"{statistics.median(v):.1f}" if v else "no result"
try: cand = f"{json.load(open(f'{o}/tg128-candle.json'))['predicted_per_second']:.1f}"
except Exception: cand = "no result"
print(f"tine tg128 (engine): {med('tg128', 'predicted_per_second')} tok/s; candle's CUDA path: {cand} tok/s; pp512 (engine): {med('pp512', 'prompt_per_second')} tok/s")
PY
  exit 0
fi
if [ "$mode" = gemma4-quick ]; then
  # The shortest Gemma 4 check: the small shapes' model checks, one prompt's ids against the CPU
  # path and the assistant against plain decoding, then the kernel table.
  for shape in small-e2b small-dense; do
    for f in "$shape" "$shape-assistant"; do
      [ -s "$W/g4-$f-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape "$f" --out "$W/g4-$f-f16.gguf" >>"$W/models.log" 2>&1
      [ -s "$W/g4-$f-q.gguf" ] || "$C" --quantize "$W/g4-$f-f16.gguf" "$W/g4-$f-q.gguf" >>"$W/models.log" 2>&1
    done
    M="$W/g4-$shape-q.gguf"
    run "gemma4-$shape" 60 "$C" --no-table --gemma4 "$M" || true
    base=(generate -m "$M" -p 'The history of the printing press begins' -n 32 --ignore-eos --temp 0)
    cpu=$(timeout 30 "$T" "${base[@]}" --device cpu 2>/dev/null)
    gpu=$(timeout 30 "$T" "${base[@]}" --device cuda 2>"$W/err-gpu")
    grep -E "loaded|engine" "$W/err-gpu" | head -n 2 >>"$log"
    [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  engine vs cpu: $shape" || { say "DIFF  engine vs cpu: $shape"; echo "  cpu:    ${cpu: -80}" >>"$log"; echo "  engine: ${gpu: -80}" >>"$log"; tail -n 3 "$W/err-gpu" >>"$log"; }
    got=$(timeout 30 "$T" "${base[@]}" --device cuda --spec-type draft-assistant --mtp-head "$W/g4-$shape-assistant-q.gguf" 2>"$W/err-spec")
    acc=$(grep -oE "drafted [0-9]+ accepted [0-9]+ \([0-9.]+%\)" "$W/err-spec" | head -n 1)
    [ -n "$got" ] && [ "$got" = "$gpu" ] && say "same  assistant vs plain: $shape ($acc)" || { say "DIFF  assistant vs plain: $shape"; tail -n 3 "$W/err-spec" >>"$log"; }
  done
  run kernels 300 "$C" || true
  exit 0
fi
if [ "$mode" = gemma4-trace ]; then
  # Where Gemma 4's prompt path parts from one-row steps: llama.cpp and the E2B shape start in the
  # background; the kernel table; on the small shapes `tine-gpu-check --gemma4-trace` (launch by
  # launch against 8-row steps) and a 700-token prompt's greedy ids on the CPU path, the engine
  # in 8-row steps (TINE_GPU_G4_PROMPT=0) and the engine's prompt path; then the same on E2B
  # (llama-quantize Q4_K_M). A second call of gemma4-e2b on the warm machine reuses it all.
  build_llama & BP=$!
  ( [ -s "$W/g4-e2b-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape e2b --out "$W/g4-e2b-f16.gguf" >>"$W/models.log" 2>&1 ) & EP=$!
  run kernels 200 "$C" || true
  grep -E "^(FAIL|kernels:)|turbo" "$log" | tail -n 12
  python3 - "$W/p700.json" <<'PY'
import json, random, sys
random.seed(11)
json.dump([random.randrange(300, 4000) for _ in range(700)], open(sys.argv[1], "w"))
PY
  ids3() { # ids3 MODEL LABEL CPU_SECS: a 700-token prompt's 16 greedy ids on three paths
    local M=$1 label=$2 secs=$3 cpu g8 gp
    base=(generate -m "$M" --prompt-ids "$W/p700.json" -n 16 --temp 0 --ignore-eos)
    cpu=$(timeout "$secs" "$T" "${base[@]}" --device cpu 2>/dev/null)
    g8=$(TINE_GPU_G4_PROMPT=0 timeout 60 "$T" "${base[@]}" --device cuda 2>/dev/null)
    gp=$(timeout 60 "$T" "${base[@]}" --device cuda 2>/dev/null)
    say "$label 700-token prompt: 8-row steps $([ -n "$g8" ] && [ "$g8" = "$cpu" ] && echo same || echo DIFF) as cpu; prompt path $([ -n "$gp" ] && [ "$gp" = "$cpu" ] && echo same || echo DIFF) as cpu; prompt path $([ -n "$gp" ] && [ "$gp" = "$g8" ] && echo same || echo DIFF) as 8-row steps"
    { echo "  cpu:    ${cpu: -60}"; echo "  8-row:  ${g8: -60}"; echo "  prompt: ${gp: -60}"; } >>"$log"
  }
  for shape in small-e2b small-dense mid-e2b; do
    [ -s "$W/g4-$shape-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape "$shape" --out "$W/g4-$shape-f16.gguf" >>"$W/models.log" 2>&1
    M="$W/g4-$shape-q.gguf"
    [ -s "$M" ] || "$C" --quantize "$W/g4-$shape-f16.gguf" "$M" >>"$W/models.log" 2>&1
    run "trace-$shape" 120 "$C" --no-table --gemma4-trace "$M" || true
    grep -E "^(PART|ok  ) trace|^FAIL" "$log" | tail -n 4
    ids3 "$M" "$shape" 120
  done
  wait "$EP"; wait "$BP"
  tail -n 1 "$W/llama-build.log" | tee -a "$log"
  M="$W/g4-e2b-q4_k_m.gguf"
  [ -s "$M" ] || "$LB/llama-quantize" "$W/g4-e2b-f16.gguf" "$M" Q4_K_M >>"$W/models.log" 2>&1
  say "gemma4 e2b Q4_K_M: $(ls -la "$M" 2>&1)"
  run trace-e2b 200 "$C" --no-table --gemma4-trace "$M" || true
  grep -E "^(PART|ok  ) trace|^FAIL" "$log" | tail -n 4
  base=(generate -m "$M" -p "The history of the printing press begins" -n 24 --temp 0 --ignore-eos)
  cpu=$(timeout 200 "$T" "${base[@]}" --device cpu 2>/dev/null)
  g8=$(timeout 120 "$T" "${base[@]}" --device cuda 2>/dev/null)
  say "e2b 9-token prompt, 24 greedy ids: engine (8-row steps) $([ -n "$g8" ] && [ "$g8" = "$cpu" ] && echo same || echo DIFF) as cpu"
  { echo "  cpu:    ${cpu: -80}"; echo "  engine: ${g8: -80}"; } >>"$log"
  exit 0
fi
if [ "$mode" = nextn ]; then
  # Qwen3.5's NextN head on the engine and Gemma 4's prompt path by default: the kernel table;
  # `--qwen35` on the small shape (its NextN checks), draft-mtp on the engine against plain
  # decoding and its acceptance against the CPU path's; `--gemma4` on the small shapes and
  # mid-e2b; then, with llama.cpp built meanwhile, E2B: `--gemma4`, llama-bench tg128/pp512
  # against tine generate (prompt path). Sections past TINE_JOB_SECS (520) are skipped.
  t0=$(date +%s)
  left() { [ $(($(date +%s) - t0)) -lt "${TINE_JOB_SECS:-520}" ]; }
  build_llama & BP=$!
  ( [ -s "$W/g4-e2b-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape e2b --out "$W/g4-e2b-f16.gguf" >>"$W/models.log" 2>&1 ) & EP=$!
  run kernels 200 "$C" || true
  grep -E "^(FAIL|kernels:)" "$log" | tail -n 12
  [ -s "$W/q35-small-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/qwen35_random_model.py" --shape small --out "$W/q35-small-f16.gguf" >>"$W/models.log" 2>&1
  M="$W/q35-small-q.gguf"
  [ -s "$M" ] || "$C" --quantize "$W/q35-small-f16.gguf" "$M" >>"$W/models.log" 2>&1
  run qwen35-small 120 "$C" --no-table --qwen35 "$M" || true
  grep -E "NextN|^FAIL" "$log" | tail -n 8
  fails=0
  for p in 'The history of the printing press begins' 'Once upon a time, in a small village by the sea,'; do
    base=(generate -m "$M" -p "$p" -n 48 --ignore-eos)
    for temp in 0 0.8; do
      plain=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 2>/dev/null)
      for spec in "--spec-type draft-mtp" "--spec-type draft-mtp --spec-draft-n-max 1" "--spec-type ngram,draft-mtp"; do
        got=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 $spec 2>"$W/err-spec")
        acc=$(grep -oE "drafted [0-9]+ accepted [0-9]+ \([0-9.]+%\)" "$W/err-spec" | head -n 1)
        on=$(grep -oE "NextN[^,;]*engine[^,;]*|head on the [A-Za-z ]*" "$W/err-spec" | head -n 1)
        cpu_acc=$(timeout 120 "$T" "${base[@]}" --device cpu --temp $temp --seed 7 $spec 2>&1 >/dev/null | grep -oE "drafted [0-9]+ accepted [0-9]+ \([0-9.]+%\)" | head -n 1)
        [ -n "$got" ] && [ "$got" = "$plain" ] && say "same  spec vs plain: q35-small temp $temp $spec (engine $acc; cpu $cpu_acc) $on" || { say "DIFF  spec vs plain: q35-small temp $temp $spec"; tail -n 3 "$W/err-spec" >>"$log"; fails=$((fails + 1)); }
      done
    done
  done
  say "draft-mtp failures: $fails"
  # qwen35moe on the engine (small-moe: 16 experts, 4 a token, a shared expert, NextN with its
  # own experts): the model checks, greedy ids against the CPU path, draft-mtp against plain.
  [ -s "$W/q35-small-moe-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/qwen35_random_model.py" --shape small-moe --out "$W/q35-small-moe-f16.gguf" >>"$W/models.log" 2>&1
  M="$W/q35-small-moe-q.gguf"
  [ -s "$M" ] || "$C" --quantize "$W/q35-small-moe-f16.gguf" "$M" >>"$W/models.log" 2>&1
  run qwen35-small-moe 120 "$C" --no-table --qwen35 "$M" || true
  grep -E "^(ok|FAIL)|NextN" "$log" | tail -n 14
  for p in 'The history of the printing press begins' 'Once upon a time, in a small village by the sea,'; do
    base=(generate -m "$M" -p "$p" -n 48 --ignore-eos)
    cpu=$(timeout 60 "$T" "${base[@]}" --temp 0 --device cpu 2>/dev/null)
    gpu=$(timeout 60 "$T" "${base[@]}" --temp 0 --device cuda 2>"$W/err-gpu")
    grep -E "loaded|engine" "$W/err-gpu" | head -n 2 >>"$log"
    [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  moe engine vs cpu: ${p:0:24}" || { say "DIFF  moe engine vs cpu: ${p:0:24}"; echo "  cpu:    ${cpu: -80}" >>"$log"; echo "  engine: ${gpu: -80}" >>"$log"; tail -n 3 "$W/err-gpu" >>"$log"; }
    for temp in 0 0.8; do
      plain=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 2>/dev/null)
      got=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 --spec-type draft-mtp 2>"$W/err-spec")
      acc=$(grep -oE "drafted [0-9]+ accepted [0-9]+ \([0-9.]+%\)" "$W/err-spec" | head -n 1)
      [ -n "$got" ] && [ "$got" = "$plain" ] && say "same  moe draft-mtp vs plain, temp $temp ($acc)" || { say "DIFF  moe draft-mtp vs plain, temp $temp"; tail -n 3 "$W/err-spec" >>"$log"; }
    done
  done
  for shape in small-e2b small-dense mid-e2b; do
    left || break
    [ -s "$W/g4-$shape-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape "$shape" --out "$W/g4-$shape-f16.gguf" >>"$W/models.log" 2>&1
    M="$W/g4-$shape-q.gguf"
    [ -s "$M" ] || "$C" --quantize "$W/g4-$shape-f16.gguf" "$M" >>"$W/models.log" 2>&1
    run "gemma4-$shape" 120 "$C" --no-table --gemma4 "$M" || true
    grep -E "prompt|^FAIL" "$log" | tail -n 4
  done
  left || exit 0
  wait "$EP"; wait "$BP"
  tail -n 1 "$W/llama-build.log" | tee -a "$log"
  M="$W/g4-e2b-q4_k_m.gguf"
  [ -s "$M" ] || "$LB/llama-quantize" "$W/g4-e2b-f16.gguf" "$M" Q4_K_M >>"$W/models.log" 2>&1
  left || exit 0
  bench_vs_llama "$M" gemma4-e2b
  left && { run gemma4-e2b 100 "$C" --no-table --gemma4 "$M" || true; }
  exit 0
fi
if [ "$mode" = turbo ]; then
  # Issue 53: the rotated low-bit KV types on the engine (TINE_GPU_TURBO=1 turns them on). The
  # kernel table (its turbo cases: the store against candle-nn's encoder, the attention over
  # turbo caches against float64), each family's model checks with --kv turbo4 and turbo3/turbo2,
  # greedy and seeded spec against plain within a type, then decode after 8k and 30k tokens
  # against q8_0/q4_0 (no llama.cpp).
  export TINE_GPU_TURBO=1
  run kernels 240 "$C" || true
  grep -E "^(FAIL|kernels:)|turbo" "$log" | tail -n 40
  G3=$(rgguf g3 small); Q35=$(rgguf q35 small); G4=$(rgguf g4 small-e2b)
  for kv in turbo4 turbo3/turbo2; do
    run "gemma3-small kv=$kv" 120 "$C" --no-table --kv "$kv" --model "$G3" || true
    run "qwen35-small kv=$kv" 120 "$C" --no-table --kv "$kv" --qwen35 "$Q35" || true
    run "gemma4-small-e2b kv=$kv" 120 "$C" --no-table --kv "$kv" --gemma4 "$G4" || true
    run "batch gemma3-small kv=$kv" 90 "$C" --no-table --kv "$kv" --batch "$G3" || true
  done
  grep -E "^(FAIL|== .* rc=)" "$log" | tail -n 16
  fails=0
  for kv in turbo4 turbo3; do
    ct=(-ctk "$kv" -ctv "$kv")
    for M in "$G3" "$Q35" "$G4"; do
      for temp in 0 0.8; do
        base=(generate -m "$M" -p "Once upon a time, in a small village by the sea," -n 48 --ignore-eos --device cuda --temp $temp --seed 7 "${ct[@]}")
        plain=$(timeout 60 "$T" "${base[@]}" 2>"$W/err-plain")
        grep -m1 -E "^loaded" "$W/err-plain" >>"$log"
        specs=("--spec-type ngram --spec-ngram-min 1" "-md $M")
        [ "$M" = "$Q35" ] && specs+=("--spec-type draft-mtp")
        for spec in "${specs[@]}"; do
          got=$(timeout 60 "$T" "${base[@]}" $spec 2>"$W/err-spec")
          [ -n "$got" ] && [ "$got" = "$plain" ] && say "same  kv=$kv spec vs plain: $(basename "$M") temp $temp $spec" || { say "DIFF  kv=$kv spec vs plain: $(basename "$M") temp $temp $spec"; tail -n 3 "$W/err-spec" >>"$log"; fails=$((fails + 1)); }
        done
      done
    done
  done
  say "turbo spec failures: $fails"
  M=$(rgguf g3 270m)
  for d in 8192 30000; do
    python3 -c "import json, random, sys; random.seed(9); json.dump([random.randrange(300, 240000) for _ in range($d)], open(sys.argv[1], 'w'))" "$W/p$d.json"
  done
  for kv in q8_0 q4_0 turbo4 turbo3; do
    for d in 8192 30000; do
      timeout 120 "$T" generate --device cuda -m "$M" -c 32768 -ctk $kv -ctv $kv --prompt-ids "$W/p$d.json" -n 64 --temp 0 --ignore-eos --json "$W/kv-$kv-$d.json" >>"$log" 2>&1
      python3 -c "import json, sys; j = json.load(open(sys.argv[1])); print(f'tine kv={sys.argv[2]} depth {sys.argv[3]}: decode {j[\"predicted_per_second\"]:.1f} tok/s, prompt {j[\"prompt_per_second\"]:.1f} tok/s')" "$W/kv-$kv-$d.json" $kv $d 2>&1 | tee -a "$log"
    done
  done
  exit 0
fi
if [ "$mode" = kv ]; then
  t0=$(date +%s)
  left() { [ $(($(date +%s) - t0)) -lt "${TINE_JOB_SECS:-520}" ]; }
  build_llama & BP=$!
  ( [ -s "$W/g3-270m-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma3_random_model.py" --shape 270m --out "$W/g3-270m-f16.gguf" >>"$W/models.log" 2>&1 ) & GP=$!
  run kernels 240 "$C" || true
  grep -E "^(FAIL|kernels:)" "$log" | tail -n 12
  grep -cE "kv=" "$log" | sed 's/^/typed kernel cases: /' | tee -a "$log"
  G3=$(rgguf g3 small); Q35=$(rgguf q35 small); G4=$(rgguf g4 small-e2b)
  for kv in f32 q8_0 q4_0 f16/bf16; do
    run "gemma3-small kv=$kv" 120 "$C" --no-table --kv "$kv" --model "$G3" || true
    run "qwen35-small kv=$kv" 120 "$C" --no-table --kv "$kv" --qwen35 "$Q35" || true
    run "gemma4-small-e2b kv=$kv" 120 "$C" --no-table --kv "$kv" --gemma4 "$G4" || true
  done
  grep -E "^(FAIL|== .* rc=)" "$log" | tail -n 12
  fails=0
  for kv in q8_0 q4_0; do
    ct=(-ctk "$kv" -ctv "$kv")
    for M in "$G3" "$Q35"; do
      for temp in 0 0.8; do
        base=(generate -m "$M" -p "Once upon a time, in a small village by the sea," -n 48 --ignore-eos --device cuda --temp $temp --seed 7 "${ct[@]}")
        plain=$(timeout 60 "$T" "${base[@]}" 2>"$W/err-plain")
        grep -m1 -E "^loaded" "$W/err-plain" >>"$log"
        specs=("--spec-type ngram --spec-ngram-min 1" "-md $M")
        [ "$M" = "$Q35" ] && specs+=("--spec-type draft-mtp")
        for spec in "${specs[@]}"; do
          got=$(timeout 60 "$T" "${base[@]}" $spec 2>"$W/err-spec")
          [ -n "$got" ] && [ "$got" = "$plain" ] && say "same  kv=$kv spec vs plain: $(basename "$M") temp $temp $spec" || { say "DIFF  kv=$kv spec vs plain: $(basename "$M") temp $temp $spec"; tail -n 3 "$W/err-spec" >>"$log"; fails=$((fails + 1)); }
        done
      done
    done
  done
  say "kv spec failures: $fails"
  left || exit 0
  wait "$GP"; wait "$BP"
  tail -n 1 "$W/llama-build.log" | tee -a "$log"
  M="$W/g3-270m-q4_k_m.gguf"
  [ -s "$M" ] || "$LB/llama-quantize" "$W/g3-270m-f16.gguf" "$M" Q4_K_M >>"$W/models.log" 2>&1
  # Decode after long prompts: llama-bench -d (its KV types; f16 is its default) against tine
  # generate over a prompt of as many random ids, 64 tokens.
  for d in 8192 30000; do
    python3 -c "import json, random, sys; random.seed(9); json.dump([random.randrange(300, 240000) for _ in range($d)], open(sys.argv[1], 'w'))" "$W/p$d.json"
  done
  for kv in f16 q8_0 q4_0; do
    left || break
    say "llama-bench kv=$kv"
    timeout 200 "$LB/llama-bench" -m "$M" -ngl 99 -fa 1 -ctk $kv -ctv $kv -p 0 -n 64 -d 8192,30000 -r 2 2>&1 | tee -a "$log" | grep -E '^\|'
  done
  for kv in f32 f16 q8_0 q4_0; do
    for d in 8192 30000; do
      left || break
      timeout 120 "$T" generate --device cuda -m "$M" -c 32768 -ctk $kv -ctv $kv --prompt-ids "$W/p$d.json" -n 64 --temp 0 --ignore-eos --json "$W/kv-$kv-$d.json" >>"$log" 2>&1
      python3 -c "import json, sys; j = json.load(open(sys.argv[1])); print(f'tine kv={sys.argv[2]} depth {sys.argv[3]}: decode {j[\"predicted_per_second\"]:.1f} tok/s, prompt {j[\"prompt_per_second\"]:.1f} tok/s')" "$W/kv-$kv-$d.json" $kv $d 2>&1 | tee -a "$log"
    done
  done
  exit 0
fi
if [ "$mode" = router ]; then
  # qwen35moe's router in two launches (moe_logits over every SM, then moe_router): the kernel
  # table (its moe_router cases time both launches), the model checks on `small-moe`.
  run kernels 240 "$C" || true
  grep -E "^(FAIL|kernels:)|moe_router" "$log" | tail -n 14
  [ -s "$W/q35-small-moe-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/qwen35_random_model.py" --shape small-moe --out "$W/q35-small-moe-f16.gguf" >>"$W/models.log" 2>&1
  M="$W/q35-small-moe-q.gguf"
  [ -s "$M" ] || "$C" --quantize "$W/q35-small-moe-f16.gguf" "$M" >>"$W/models.log" 2>&1
  run qwen35-small-moe 120 "$C" --no-table --qwen35 "$M" || true
  grep -E "^(ok|FAIL)|^profile, 1 rows|^decode" "$log" | tail -n 12
  exit 0
fi
if [ "$mode" = moe-bench ]; then
  # qwen35moe at the A3B class's MoE widths over 4 layers (`a3b-4l`, F16 about 9 GB, written here),
  # llama-quantize Q4_K_M: llama-bench tg128/pp512 against tine generate on the engine, the
  # engine's per-launch profile (tine-gpu-check --qwen35), greedy ids against candle's CUDA path.
  build_llama & BP=$!
  [ -s "$W/q35-a3b-4l-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/qwen35_random_model.py" --shape a3b-4l --out "$W/q35-a3b-4l-f16.gguf" >>"$W/models.log" 2>&1
  wait "$BP"
  tail -n 1 "$W/llama-build.log" | tee -a "$log"
  M="$W/q35-a3b-4l-q4_k_m.gguf"
  [ -s "$M" ] || "$LB/llama-quantize" "$W/q35-a3b-4l-f16.gguf" "$M" Q4_K_M >>"$W/models.log" 2>&1
  say "a3b-4l Q4_K_M: $(ls -la "$M" 2>&1)"
  bench_vs_llama "$M" a3b-4l
  run qwen35-a3b-4l 120 "$C" --no-table --qwen35 "$M" || true
  grep -E "^(profile|decode|verify|FAIL)" "$log" | tail -n 8
  base=(generate -m "$M" -p "The history of the printing press begins" -n 24 --temp 0 --ignore-eos --device cuda)
  gpu=$(timeout 60 "$T" "${base[@]}" 2>/dev/null)
  candle=$(TINE_GPU_ENGINE=0 timeout 200 "$T" "${base[@]}" 2>/dev/null)
  [ -n "$gpu" ] && [ "$gpu" = "$candle" ] && say "same  a3b-4l engine vs candle cuda" || say "DIFF  a3b-4l engine vs candle cuda (4 random layers: rounding may part them)"
  exit 0
fi
if [ "$mode" = serve-batch ]; then
  LLAMA_EXTRA_TARGETS=llama-server build_llama & BP=$!
  ( [ -s "$W/g3-270m-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma3_random_model.py" --shape 270m --out "$W/g3-270m-f16.gguf" >>"$W/models.log" 2>&1 ) & GP=$!
  [ -n "${SKIP_TABLE:-}" ] || run kernels 200 "$C" || true
  grep -E "^(FAIL|kernels:)|seq rows|per-row bans|argmax n=" "$log" | tail -n 12
  [ -s "$W/g3-small-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma3_random_model.py" --shape small --out "$W/g3-small-f16.gguf" >>"$W/models.log" 2>&1
  [ -s "$W/g3-small-q.gguf" ] || "$C" --quantize "$W/g3-small-f16.gguf" "$W/g3-small-q.gguf" >>"$W/models.log" 2>&1
  run batch-small 60 "$C" --no-table --batch "$W/g3-small-q.gguf" || true
  wait "$GP"
  [ -s "$W/g3-270m-q.gguf" ] || "$C" --quantize "$W/g3-270m-f16.gguf" "$W/g3-270m-q.gguf" >>"$W/models.log" 2>&1
  run batch-270m 90 "$C" --no-table --batch "$W/g3-270m-q.gguf" || true
  # Gemma 4's batched step: the E-series (per-layer inputs, shared K/V) and 26B-A4B's experts.
  for f in small-e2b small-a4b; do
    [ -s "$W/g4-$f-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape "$f" --out "$W/g4-$f-f16.gguf" >>"$W/models.log" 2>&1
    [ -s "$W/g4-$f-q.gguf" ] || "$C" --quantize "$W/g4-$f-f16.gguf" "$W/g4-$f-q.gguf" >>"$W/models.log" 2>&1
    run "batch-g4-$f" 90 "$C" --no-table --batch "$W/g4-$f-q.gguf" || true
  done
  # Qwen3.5's batched step (its delta-net over the batch's entry table), dense and MoE.
  for f in small small-moe; do
    model "$f"
    [ -s "$W/q35-$f-q.gguf" ] || "$C" --quantize "$W/q35-$f-f16.gguf" "$W/q35-$f-q.gguf" >>"$W/models.log" 2>&1
    run "batch-q35-$f" 90 "$C" --no-table --batch "$W/q35-$f-q.gguf" || true
  done
  grep -E "batched steps|^decode, " "$log" | tail -n 24
  wait "$BP"
  tail -n 1 "$W/llama-build.log" | tee -a "$log"
  M="$W/g3-270m-q4_k_m.gguf"
  [ -s "$M" ] || "$LB/llama-quantize" "$W/g3-270m-f16.gguf" "$M" Q4_K_M >>"$W/models.log" 2>&1
  say "serve: $(ls -la "$M" 2>&1)"
  mkdir -p "$W/serve-logs"
  SERVE_LOAD_LOGS="$W/serve-logs" timeout "${SERVE_SECS:-300}" python3 "$root/bench/serve_load.py" --tine "$T" --model "$M" clients --clients "${SERVE_CLIENTS:-1,4,16,64}" --parallel 64 --n-predict 256 --rounds "${SERVE_ROUNDS:-1}" \
    --tine-args "--device cuda" --llama-server "$LB/llama-server" --llama-args "-ngl 99" 2>>"$W/serve-err.log" | tee -a "$log"
  say "serve: rc=$?"
  if [ -n "${SERVE_SPEC:-}" ]; then
    # With speculation (n-gram): verify batches of every slot in one step.
    SERVE_LOAD_LOGS="$W/serve-logs" timeout "${SERVE_SECS:-300}" python3 "$root/bench/serve_load.py" --tine "$T" --model "$M" clients --clients "${SERVE_SPEC_CLIENTS:-1,16,64}" --parallel 64 --n-predict 256 --rounds 1 \
      --tine-args "--device cuda --spec-type ngram" --llama-server "$LB/llama-server" --llama-args "-ngl 99 --spec-type ngram-simple" 2>>"$W/serve-err.log" | tee -a "$log"
    say "serve spec: rc=$?"
  fi
  if [ -n "${SERVE_MIXED:-}" ]; then
    # The identity test: 16 concurrent requests of mixed kinds and a long prompt mid-way, each
    # against its solo run, plain and with n-gram speculation.
    for spec in "" "--spec-type ngram"; do
      SERVE_LOAD_LOGS="$W/serve-logs" timeout 200 python3 "$root/bench/serve_load.py" --tine "$T" --model "$M" mixed --requests 16 --parallel 16 \
        --tine-args "--device cuda $spec" 2>>"$W/serve-err.log" | tee -a "$log"
      say "serve mixed ${spec:-plain}: rc=$?"
    done
  fi
  tail -n 5 "$W/serve-err.log" >>"$log"
  grep -h "tine serve" "$W"/serve-logs/*.log | head -n 6 >>"$log"
  exit 0
fi
if [ "$mode" = mini ]; then
  # The shortest look at the new paths (no table, no llama.cpp): `small-a4b`'s model check and
  # greedy ids against the CPU path, Gemma 3's batched step on the small shape.
  for f in small-a4b; do
    [ -s "$W/g4-$f-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape "$f" --out "$W/g4-$f-f16.gguf" >>"$W/models.log" 2>&1
    [ -s "$W/g4-$f-q.gguf" ] || "$C" --quantize "$W/g4-$f-f16.gguf" "$W/g4-$f-q.gguf" >>"$W/models.log" 2>&1
  done
  run gemma4-small-a4b 60 "$C" --no-table --gemma4 "$W/g4-small-a4b-q.gguf" || true
  base=(generate -m "$W/g4-small-a4b-q.gguf" -p 'The history of the printing press begins' -n 32 --ignore-eos --temp 0)
  cpu=$(timeout 30 "$T" "${base[@]}" --device cpu 2>/dev/null)
  gpu=$(timeout 30 "$T" "${base[@]}" --device cuda 2>/dev/null)
  [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  small-a4b engine vs cpu" || say "DIFF  small-a4b engine vs cpu"
  [ -s "$W/g3-small-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma3_random_model.py" --shape small --out "$W/g3-small-f16.gguf" >>"$W/models.log" 2>&1
  [ -s "$W/g3-small-q.gguf" ] || "$C" --quantize "$W/g3-small-f16.gguf" "$W/g3-small-q.gguf" >>"$W/models.log" 2>&1
  run batch-small 60 "$C" --no-table --batch "$W/g3-small-q.gguf" || true
  grep -E "^(ok|FAIL)|batched steps|^decode" "$log" | tail -n 20
  exit 0
fi
if [ "$mode" = gemma4-moe ] || [ "$mode" = quick-moe-batch ]; then
  # Gemma 4's routed experts on the engine. llama.cpp and the 26B-A4B-width GGUF (`a4b-6l`, about
  # 11 GB of F16) start in the background while the table and the small checks run
  # (`quick-moe-batch`: the table, the small checks and Gemma 3's batched step alone).
  if [ "$mode" = gemma4-moe ]; then
    build_llama & BP=$!
    ( [ -s "$W/g4-a4b-6l-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape a4b-6l --out "$W/g4-a4b-6l-f16.gguf" >>"$W/models.log" 2>&1 ) & EP=$!
  fi
  run kernels 240 "$C" || true
  grep -E "^(FAIL|kernels:)|moe_|gemv_moe" "$log" | tail -n 30
  for f in small-a4b small-a4b-assistant; do
    [ -s "$W/g4-$f-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape "$f" --out "$W/g4-$f-f16.gguf" >>"$W/models.log" 2>&1
    [ -s "$W/g4-$f-q.gguf" ] || "$C" --quantize "$W/g4-$f-f16.gguf" "$W/g4-$f-q.gguf" >>"$W/models.log" 2>&1
  done
  M="$W/g4-small-a4b-q.gguf"
  run gemma4-small-a4b 90 "$C" --no-table --gemma4 "$M" || true
  run gemma4-small-a4b-q8_0 90 "$C" --no-table --kv q8_0 --gemma4 "$M" || true
  grep -E "^(ok|FAIL)|^profile, 1 rows|^decode|^graph nodes, 1" "$log" | tail -n 28
  for temp in 0 0.8; do
    base=(generate -m "$M" -p 'The history of the printing press begins' -n 32 --ignore-eos --temp "$temp" --seed 7)
    cpu=$(timeout 30 "$T" "${base[@]}" --device cpu 2>/dev/null)
    gpu=$(timeout 30 "$T" "${base[@]}" --device cuda 2>"$W/err-gpu")
    grep -E "loaded|engine" "$W/err-gpu" | head -n 2 >>"$log"
    # Seeded sampling draws from the engine's top-k on the GPU and the full softmax on the CPU:
    # only greedy ids are compared across devices.
    if [ "$temp" = 0 ]; then
      [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  small-a4b engine vs cpu" || { say "DIFF  small-a4b engine vs cpu"; echo "  cpu:    ${cpu: -80}" >>"$log"; echo "  engine: ${gpu: -80}" >>"$log"; tail -n 3 "$W/err-gpu" >>"$log"; }
    fi
    got=$(timeout 30 "$T" "${base[@]}" --device cuda --spec-type draft-assistant --mtp-head "$W/g4-small-a4b-assistant-q.gguf" 2>"$W/err-spec")
    acc=$(grep -oE "drafted [0-9]+ accepted [0-9]+ \([0-9.]+%\)" "$W/err-spec" | head -n 1)
    [ -n "$got" ] && [ "$got" = "$gpu" ] && say "same  small-a4b assistant vs plain, temp $temp ($acc)" || { say "DIFF  small-a4b assistant vs plain, temp $temp"; tail -n 3 "$W/err-spec" >>"$log"; }
    got=$(timeout 30 "$T" "${base[@]}" --device cuda --spec-type ngram 2>"$W/err-spec")
    [ -n "$got" ] && [ "$got" = "$gpu" ] && say "same  small-a4b ngram vs plain, temp $temp" || { say "DIFF  small-a4b ngram vs plain, temp $temp"; tail -n 3 "$W/err-spec" >>"$log"; }
  done
  # While the big GGUF is written: Gemma 3's batched step (issue 50) on the small and 270M shapes.
  for shape in small 270m; do
    [ -s "$W/g3-$shape-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma3_random_model.py" --shape "$shape" --out "$W/g3-$shape-f16.gguf" >>"$W/models.log" 2>&1
    [ -s "$W/g3-$shape-q.gguf" ] || "$C" --quantize "$W/g3-$shape-f16.gguf" "$W/g3-$shape-q.gguf" >>"$W/models.log" 2>&1
    run "batch-$shape" 120 "$C" --no-table --batch "$W/g3-$shape-q.gguf" || true
  done
  grep -E "batched steps|^decode, " "$log" | tail -n 12
  [ "$mode" = quick-moe-batch ] && exit 0
  wait "$EP"; wait "$BP"
  tail -n 1 "$W/llama-build.log" | tee -a "$log"
  M="$W/g4-a4b-6l-q4_k_m.gguf"
  [ -s "$M" ] || "$LB/llama-quantize" "$W/g4-a4b-6l-f16.gguf" "$M" Q4_K_M >>"$W/models.log" 2>&1
  say "a4b-6l Q4_K_M: $(ls -la "$M" 2>&1)"
  grep -E "ffn_(down|gate_up)_exps.*type|converting to" "$W/models.log" | tail -n 3 >>"$log"
  bench_vs_llama "$M" a4b-6l
  run gemma4-a4b-6l 150 "$C" --no-table --gemma4 "$M" || true
  grep -E "^(ok|FAIL)|^profile|^decode|^verify|^graph nodes, 1" "$log" | tail -n 14
  base=(generate -m "$M" -p "The history of the printing press begins" -n 24 --temp 0 --ignore-eos --device cuda)
  gpu=$(timeout 60 "$T" "${base[@]}" 2>/dev/null)
  candle=$(TINE_GPU_ENGINE=0 timeout 120 "$T" "${base[@]}" 2>/dev/null)
  [ -n "$gpu" ] && [ "$gpu" = "$candle" ] && say "same  a4b-6l engine vs candle cuda" || say "DIFF  a4b-6l engine vs candle cuda (6 random layers: rounding may part them)"
  exit 0
fi
if [ "$mode" = gemma4-bisect ]; then
  # Which E2B feature the prompt path's difference follows: E2B's widths over 10 layers
  # (`mid-e2b`), then without the double-wide MLP, with small heads, without KV-shared layers;
  # the prompt step against one-row steps on each, with the GGUF layout too, and greedy ids of the
  # engine against the CPU path with a prompt of 3 tokens (one-row graphs only) and of 9.
  for shape in ${BISECT_SHAPES:-mid-e2b mid-e2b-noshare mid-e2b-narrow mid-e2b-hd}; do
    rm -f "$W/g4-$shape-f16.gguf" "$W/g4-$shape-q.gguf"
    TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape "$shape" --out "$W/g4-$shape-f16.gguf" >>"$W/models.log" 2>&1
    M="$W/g4-$shape-q.gguf"
    "$C" --quantize "$W/g4-$shape-f16.gguf" "$M" >>"$W/models.log" 2>&1
    say "$shape: $(timeout 120 "$C" --no-table --gemma4 "$M" 2>&1 | grep -E 'prompt|verify 8|tine-gpu-check|rror' | tr '\n' ' ')"
    [ "$shape" = mid-e2b ] && say "$shape gguf layout: $(TINE_GPU_WIDE=0 timeout 120 "$C" --no-table --gemma4 "$M" 2>&1 | grep -E 'prompt' | tr '\n' ' ')"
    for p in 'Hi' 'The history of the printing press begins'; do
      base=(generate -m "$M" -p "$p" -n 16 --ignore-eos --temp 0)
      cpu=$(timeout 60 "$T" "${base[@]}" --device cpu 2>/dev/null)
      gpu=$(timeout 60 "$T" "${base[@]}" --device cuda 2>/dev/null)
      if [ -z "$cpu" ] && [ -z "$gpu" ]; then say "REFUSED by both paths: $shape"; elif [ "$cpu" = "$gpu" ]; then say "same  $shape engine vs cpu: ${p:0:12}"; else say "DIFF  $shape engine vs cpu: ${p:0:12}"; fi
    done
  done
  exit 0
fi
if [ "$mode" = gemma4 ] || [ "$mode" = gemma4-small ] || [ "$mode" = gemma4-e2b ]; then
  # gemma4-small: the table and the small shapes only (no llama.cpp build, no E2B shape).
  # gemma4-e2b: the E2B shape only (no table, no small shapes).
  full=1
  [ "$mode" = gemma4-small ] && full=0
  BP=
  [ $full = 1 ] && { build_llama & BP=$!; }
  g4() { # g4 SHAPE: the F16 GGUF of a random-weight shape
    [ -s "$W/g4-$1-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" python3 "$root/tools/gemma4_random_model.py" --shape "$1" --out "$W/g4-$1-f16.gguf" >>"$W/models.log" 2>&1
  }
  EP=
  [ $full = 1 ] && { g4 e2b & EP=$!; }
  fails=0
  smalls="small-e2b small-dense"
  if [ "$mode" = gemma4-e2b ]; then smalls=; else
    run kernels 300 "$C" || true
    grep -E "^(FAIL|kernels:)" "$log" | tail -n 20
  fi
  for shape in $smalls; do
    g4 $shape
    M="$W/g4-$shape-q.gguf"
    [ -s "$M" ] || "$C" --quantize "$W/g4-$shape-f16.gguf" "$M" >>"$W/models.log" 2>&1
    run "gemma4-$shape" 120 "$C" --no-table --gemma4 "$M" || true
    for p in 'The history of the printing press begins' 'Once upon a time, in a small village by the sea,'; do
      base=(generate -m "$M" -p "$p" -n 48 --ignore-eos)
      cpu=$(timeout 60 "$T" "${base[@]}" --temp 0 --device cpu 2>/dev/null)
      gpu=$(timeout 60 "$T" "${base[@]}" --temp 0 --device cuda 2>"$W/err-gpu")
      grep -E "loaded|engine" "$W/err-gpu" | head -n 2 >>"$log"
      [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  engine vs cpu: $shape ${p:0:24}" || { say "DIFF  engine vs cpu: $shape ${p:0:24}"; echo "  cpu:    ${cpu: -80}" >>"$log"; echo "  engine: ${gpu: -80}" >>"$log"; tail -n 2 "$W/err-gpu" >>"$log"; fails=$((fails + 1)); }
      for temp in 0 0.8; do
        plain=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 2>/dev/null)
        for spec in "--spec-type ngram --spec-ngram-min 1" "-md $M"; do
          got=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 $spec 2>"$W/err-spec")
          acc=$(grep -oE "drafted [0-9]+ accepted [0-9]+ \([0-9.]+%\)" "$W/err-spec" | head -n 1)
          [ -n "$got" ] && [ "$got" = "$plain" ] && say "same  spec vs plain: $shape temp $temp $spec ($acc)" || { say "DIFF  spec vs plain: $shape temp $temp $spec"; tail -n 2 "$W/err-spec" >>"$log"; fails=$((fails + 1)); }
        done
      done
    done
  done
  # The assistant on the engine: lossless against plain decoding, and its acceptance against the
  # CPU path's (the same drafts where the CPU scores every token too: small-dense-assistant has
  # no ordered embeddings, small-e2b-assistant has them and the engine does not use them).
  for shape in ${smalls:+small-dense small-e2b}; do
    A="$W/g4-$shape-assistant-q.gguf"
    g4 "$shape-assistant"
    [ -s "$A" ] || "$C" --quantize "$W/g4-$shape-assistant-f16.gguf" "$A" >>"$W/models.log" 2>&1
    M="$W/g4-$shape-q.gguf"
    base=(generate -m "$M" -p 'The history of the printing press begins' -n 48 --ignore-eos)
    for temp in 0 0.8; do
      plain=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 2>/dev/null)
      got=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 --spec-type draft-assistant --mtp-head "$A" 2>"$W/err-spec")
      acc=$(grep -oE "drafted [0-9]+ accepted [0-9]+ \([0-9.]+%\)" "$W/err-spec" | head -n 1)
      cpu_acc=$(timeout 120 "$T" "${base[@]}" --device cpu --temp $temp --seed 7 --spec-type draft-assistant --mtp-head "$A" 2>&1 >/dev/null | grep -oE "drafted [0-9]+ accepted [0-9]+ \([0-9.]+%\)" | head -n 1)
      [ -n "$got" ] && [ "$got" = "$plain" ] && say "same  assistant vs plain: $shape temp $temp (engine $acc; cpu $cpu_acc)" || { say "DIFF  assistant vs plain: $shape temp $temp"; tail -n 3 "$W/err-spec" >>"$log"; fails=$((fails + 1)); }
    done
  done
  say "gemma4 small failures: $fails"
  [ $full = 1 ] || exit 0
  wait "$EP"
  wait "$BP"
  tail -n 1 "$W/llama-build.log" | tee -a "$log"
  M="$W/g4-e2b-q4_k_m.gguf"
  [ -s "$M" ] || "$LB/llama-quantize" "$W/g4-e2b-f16.gguf" "$M" Q4_K_M >>"$W/models.log" 2>&1
  say "gemma4 e2b Q4_K_M: $(ls -la "$M" 2>&1)"
  run gemma4-e2b 240 "$C" --no-table --gemma4 "$M" || true
  bench_vs_llama "$M" gemma4-e2b
  timeout 200 env TINE_GPU_ENGINE=0 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 32 --temp 0 --ignore-eos --json "$W/g4-tg-candle.json" >>"$log" 2>&1
  base=(generate -m "$M" -p "The history of the printing press begins" -n 24 --temp 0 --ignore-eos)
  cpu=$(timeout 200 "$T" "${base[@]}" --device cpu 2>/dev/null)
  gpu=$(timeout 120 "$T" "${base[@]}" --device cuda 2>/dev/null)
  [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  e2b engine vs cpu, 24 greedy tokens" || { say "DIFF  e2b engine vs cpu"; echo "  cpu:    ${cpu: -100}" >>"$log"; echo "  engine: ${gpu: -100}" >>"$log"; }
  python3 -c "import json, sys; print(f\"tine gemma4 e2b, candle's CUDA path (32 tokens): {json.load(open(sys.argv[1]))['predicted_per_second']:.1f} tok/s\")" "$W/g4-tg-candle.json" 2>&1 | tee -a "$log"
  exit 0
fi
if [ "$mode" = regress ]; then
  # The one-sequence paths under every family's batched step (no llama.cpp, no table): each
  # family's small random GGUFs (quantized by tine-gpu-check --quantize), its model check (verify
  # rows against one-row steps), greedy ids of the engine against the CPU path, n-gram and a
  # self-draft against plain at temperature 0 and seeded at 0.8, then the batched step's check.
  for fs in "g3 small --model" "g4 small-e2b --gemma4" "g4 small-a4b --gemma4" "q35 small --qwen35" "q35 small-moe --qwen35"; do
    set -- $fs
    M=$(rgguf "$1" "$2")
    run "$1-$2" 120 "$C" --no-table "$3" "$M" || true
    for temp in 0 0.8; do
      base=(generate -m "$M" -p 'The history of the printing press begins' -n 40 --ignore-eos --temp "$temp" --seed 11)
      gpu=$(timeout 60 "$T" "${base[@]}" --device cuda 2>"$W/err-gpu")
      if [ "$temp" = 0 ]; then
        cpu=$(timeout 60 "$T" "${base[@]}" --device cpu 2>/dev/null)
        [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  $1-$2 engine vs cpu" || { say "DIFF  $1-$2 engine vs cpu"; echo "  cpu:    ${cpu: -80}" >>"$log"; echo "  engine: ${gpu: -80}" >>"$log"; tail -n 3 "$W/err-gpu" >>"$log"; }
      fi
      for spec in "--spec-type ngram" "--spec-type draft -md $M --draft-max 6"; do
        got=$(timeout 60 "$T" "${base[@]}" --device cuda $spec 2>"$W/err-spec")
        [ -n "$got" ] && [ "$got" = "$gpu" ] && say "same  $1-$2 ${spec:12:5} vs plain, temp $temp" || { say "DIFF  $1-$2 ${spec:12:5} vs plain, temp $temp"; tail -n 3 "$W/err-spec" >>"$log"; }
      done
    done
    run "batch-$1-$2" 90 "$C" --no-table --batch "$M" || true
  done
  grep -E "^(ok|FAIL)|^== (same|DIFF)|batched steps|rc=[1-9]" "$log" | tail -n 60
  exit 0
fi
if [ "$mode" = gemma3 ]; then
  # Gemma 3 on the engine over random-weight GGUFs (tools/gemma3_random_model.py, shapes `small`
  # and `270m`, quantized here to Q4_K_M): tine-gpu-check --model (graph nodes, speed, verify
  # rows against one-row steps), greedy ids of the engine against the CPU path, and tg128
  # against llama-bench on the same GGUF.
  build_llama
  for shape in small 270m; do
    [ -s "$W/g3-$shape-f16.gguf" ] || TINE_PEERS_DIR="$W/peers" PYTHONPATH="$W/llama.cpp/gguf-py" \
      python3 "$root/tools/gemma3_random_model.py" --shape "$shape" --out "$W/g3-$shape-f16.gguf" >>"$W/models.log" 2>&1
    [ -s "$W/g3-$shape-q4_k_m.gguf" ] || "$LB/llama-quantize" "$W/g3-$shape-f16.gguf" "$W/g3-$shape-q4_k_m.gguf" Q4_K_M >>"$W/models.log" 2>&1
    say "gemma3 $shape Q4_K_M: $(ls -la "$W/g3-$shape-q4_k_m.gguf" 2>&1)"
    M="$W/g3-$shape-q4_k_m.gguf"
    run "gemma3-$shape" 240 "$C" --no-table --model "$M" || true
    for p in 'The history of the printing press begins' 'Once upon a time, in a small village by the sea,'; do
      base=(generate -m "$M" -p "$p" -n 48 --ignore-eos --temp 0)
      cpu=$(timeout 120 "$T" "${base[@]}" --device cpu 2>/dev/null)
      gpu=$(timeout 60 "$T" "${base[@]}" --device cuda 2>"$W/err-gpu")
      [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  gemma3 $shape engine vs cpu: ${p:0:24}" || { say "DIFF  gemma3 $shape engine vs cpu: ${p:0:24}"; echo "  cpu:    ${cpu: -80}" >>"$log"; echo "  engine: ${gpu: -80}" >>"$log"; tail -n 3 "$W/err-gpu" >>"$log"; }
    done
  done
  M="$W/g3-270m-q4_k_m.gguf"
  say "llama-bench gemma3 270m"
  timeout 240 "$LB/llama-bench" -m "$M" -ngl 99 -fa 1 -p 512 -n 128 -r 3 2>&1 | tee -a "$log" | grep -E '^\|'
  for r in 1 2 3; do
    timeout 60 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 128 --temp 0 --ignore-eos --json "$OUT/g3-tg128-$r.json" >>"$log" 2>&1
  done
  python3 - "$OUT" <<'PY' | tee -a "$log"
import json, statistics, sys
v = []
for r in (1, 2, 3):
    try: v.append(json.load(open(f"{sys.argv[1]}/g3-tg128-{r}.json"))["predicted_per_second"])
    except Exception: pass
print(f"tine gemma3 270m tg128 (engine): {statistics.median(v):.1f} tok/s" if v else "tine gemma3 270m tg128: no result")
PY
  exit 0
fi
if [ "$mode" = slim ]; then
  # Correctness and the engine's own speed without llama.cpp (no build: a few minutes less of
  # device time): the kernel table; random-weight GGUFs of both families written here and
  # quantized by `tine-gpu-check --quantize` (candle's quantizers, llama-quantize's Q4_K_M mix);
  # the model checks, and each with the matrices as GGUF blocks (TINE_GPU_WIDE=0) and the delta-net
  # conv in its own launch (TINE_GPU_FUSED_CONV=0) for the timings; greedy ids of the engine
  # against the CPU path and spec against plain on the small shapes.
  run kernels 300 "$C" || true
  grep -E "^(FAIL|kernels:)" "$log" | tail -n 20
  for shape in small 0.8b; do
    M=$(rgguf q35 $shape)
    run "qwen35-$shape" 120 "$C" --no-table --qwen35 "$M" || true
  done
  M="$W/q35-0.8b-q.gguf"
  for v in TINE_GPU_WIDE=0 TINE_GPU_FUSED_CONV=0; do
    env $v timeout 60 "$C" --no-table --qwen35 "$M" 2>&1 | grep -E "^(decode|verify|profile|graph)" | sed "s/^/$v /" >>"$log"
  done
  for shape in small 270m; do
    M=$(rgguf g3 $shape)
    run "gemma3-$shape" 120 "$C" --no-table --model "$M" || true
  done
  TINE_GPU_WIDE=0 timeout 60 "$C" --no-table --model "$W/g3-270m-q.gguf" 2>&1 | grep -E "model: (greedy|1-row|4-row|8-row)" | sed "s/^/TINE_GPU_WIDE=0 /" >>"$log"
  fails=0
  for M in "$W/q35-small-q.gguf" "$W/g3-small-q.gguf"; do
    for p in 'The history of the printing press begins' 'Once upon a time, in a small village by the sea,'; do
      base=(generate -m "$M" -p "$p" -n 48 --ignore-eos)
      cpu=$(timeout 60 "$T" "${base[@]}" --temp 0 --device cpu 2>/dev/null)
      gpu=$(timeout 60 "$T" "${base[@]}" --temp 0 --device cuda 2>"$W/err-gpu")
      [ -n "$cpu" ] && [ "$cpu" = "$gpu" ] && say "same  engine vs cpu: $(basename "$M") ${p:0:24}" || { say "DIFF  engine vs cpu: $(basename "$M") ${p:0:24}"; tail -n 2 "$W/err-gpu" >>"$log"; fails=$((fails + 1)); }
      for temp in 0 0.8; do
        plain=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 2>/dev/null)
        for spec in "--spec-type ngram --spec-ngram-min 1" "-md $M"; do
          got=$(timeout 60 "$T" "${base[@]}" --device cuda --temp $temp --seed 7 $spec 2>/dev/null)
          [ -n "$got" ] && [ "$got" = "$plain" ] && say "same  spec vs plain: $(basename "$M") temp $temp $spec" || { say "DIFF  spec vs plain: $(basename "$M") temp $temp $spec"; fails=$((fails + 1)); }
        done
      done
    done
  done
  M="$W/q35-small-q.gguf"
  plain=$(timeout 60 "$T" generate -m "$M" -p "Once upon a time" -n 48 --ignore-eos --device cuda --temp 0 2>/dev/null)
  got=$(timeout 60 "$T" generate -m "$M" -p "Once upon a time" -n 48 --ignore-eos --device cuda --temp 0 --spec-type draft-mtp 2>/dev/null)
  [ -n "$got" ] && [ "$got" = "$plain" ] && say "same  spec vs plain: q35-small draft-mtp" || { say "DIFF  spec vs plain: q35-small draft-mtp"; fails=$((fails + 1)); }
  say "generate failures: $fails"
  exit 0
fi
echo "usage: qwen35_job.sh check|bench|gemma3|slim" >&2
exit 2
