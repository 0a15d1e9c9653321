#!/usr/bin/env bash
# The GPU engine's device job (tine-gpu): runs on the GPU machine over what
# tools/cuda/engine_stage.sh staged into target/gpu-engine (carried by the device call).
#
#   bash tools/cuda/engine_job.sh chunk    # move the model chunks that arrived to /tmp (warm machine)
#   bash tools/cuda/engine_job.sh kernels  # the kernel table (embedded cubin, then one nvcc compiled
#                                          # here from the checkout's decode.cu) and the step bench
#   bash tools/cuda/engine_job.sh model    # + the real model: nodes, speed, verify rows, CPU ids;
#                                          # then with the NextN head grafted on (needs tine.tar.xz)
#   bash tools/cuda/engine_job.sh profile  # the table, then the bench's per-launch profile for the
#                                          # embedded kernels and for each target/gpu-engine/*.cu
#                                          # (compiled here), and one step under ncu
#   bash tools/cuda/engine_job.sh ncu      # ncu's full sections for a few launches
#   bash tools/cuda/engine_job.sh llama    # side by side with llama.cpp CUDA, built here from
#                                          # target/gpu-engine/llama-slim.tar.xz (about 5 min):
#                                          # llama-bench pp512/tg128 against tine on the engine,
#                                          # then /completion on both servers (serve_check.py)
#   bash tools/cuda/engine_job.sh runtime  # `tine` (target/gpu-engine/tine.tar.xz) on the engine
#                                          # (its default; candle's path with TINE_GPU_ENGINE=0):
#                                          # greedy ids against the CPU's,
#                                          # decode speed against candle's CUDA path, spec on vs
#                                          # off at temperature 0 and seeded 0.8 (n-gram, draft
#                                          # model, NextN, assistant head), spec-bench
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
# The other inputs may arrive with any call (the carry limit is 64 MiB with the tree): kept in
# /tmp too, and read from wherever they are.
for f in bin.tar.xz tine.tar.xz llama-slim.tar.xz long-prompt.json cpu-ref.jsonl model.sha256; do [ -e "$S/$f" ] && cp "$S/$f" "$W/"; done
pick() { if [ -e "$S/$1" ]; then echo "$S/$1"; else echo "$W/$1"; fi; }
ls -la "$W" >>"$log"
[ "$mode" = chunk ] && { tail -n 20 "$log"; exit 0; }

say() { echo "== $*" | tee -a "$log"; }
bin="$W/tine-gpu-check"
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$(pick bin.tar.xz)" "$W" && chmod +x "$bin"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -n 2; } >>"$log" 2>&1

if [ "$mode" = runtime ]; then
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$(pick tine.tar.xz)" "$W" && chmod +x "$W/tine"
  M="$W/model.gguf"
  [ -s "$M" ] || cat $(ls "$W"/m.* | sort) >"$M"
  say "model sha256 $(sha256sum "$M" | cut -d' ' -f1) want $(cat "$(pick model.sha256)")"
  T="$W/tine"
  run() { # run NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    say "$name: $*"
    timeout "$secs" "$@" >>"$log" 2>&1
    say "$name: rc=$?"
  }
  # Greedy ids on the engine against the CPU path's (the prompts of cpu-ref.jsonl, by id).
  python3 - "$(pick cpu-ref.jsonl)" "$W" <<'PY'
import json, sys
for i, line in enumerate(open(sys.argv[1])):
    json.dump(json.loads(line)["prompt_ids"], open(f"{sys.argv[2]}/prompt-{i + 1}.json", "w"))
PY
  for i in 1 2 3 4 5 6; do
    run "greedy-$i" 60 "$T" generate --device cuda -m "$M" --prompt-ids "$W/prompt-$i.json" -n 64 --temp 0 --ignore-eos --json "$OUT/greedy-$i.json"
  done
  python3 - "$(pick cpu-ref.jsonl)" "$OUT" <<'PY' | tee -a "$log"
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
  # The engine's greedy ids against llama.cpp's (recorded from llama-server on the CPU, the same
  # GGUF: tine-runtime's test data), with the engine's top-2 gap where they part.
  python3 - "$root/engine/crates/tine-runtime/tests/data/llama_cpp_greedy.json" >"$W/llama-ref.jsonl" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["cases"]:
    print(json.dumps({"prompt_ids": c["prompt_ids"], "ids": c["ids"]}))
PY
  say "engine vs llama.cpp's recorded greedy ids ($(wc -l <"$W/llama-ref.jsonl") prompts)"
  timeout 200 "$bin" --no-table --model "$M" --ref "$W/llama-ref.jsonl" 2>&1 | grep "prompt [0-9]" | tee -a "$log"
  # Decode speed: the engine, then candle's CUDA path, 512 tokens after a short prompt.
  for r in 1 2; do
    run "speed-engine-$r" 60 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 512 --temp 0 --ignore-eos --json "$OUT/speed-engine-$r.json"
  done
  run speed-candle 120 env TINE_GPU_ENGINE=0 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 512 --temp 0 --ignore-eos --json "$OUT/speed-candle.json"
  # Spec on vs off on the engine: n-gram and the draft model (the target drafting itself).
  for temp in 0 0.8; do
    run "plain-t$temp" 60 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 256 --temp $temp --seed 7 --ignore-eos --json "$OUT/plain-t$temp.json"
    run "ngram-t$temp" 60 "$T" generate --device cuda -m "$M" --spec-type ngram -p "Once upon a time" -n 256 --temp $temp --seed 7 --ignore-eos --json "$OUT/ngram-t$temp.json"
    run "draft-t$temp" 60 "$T" generate --device cuda -m "$M" -md "$M" -p "Once upon a time" -n 256 --temp $temp --seed 7 --ignore-eos --json "$OUT/draft-t$temp.json"
  done
  # NextN self-speculation on the engine (the trunk's hidden states read back per verify step).
  G="$W/nextn.gguf"
  run graft 120 "$T" graft-nextn --target "$M" --head "$root/drafters/gemma3-270m-nextn.gguf" -o "$G"
  for temp in 0 0.8; do
    run "plain-mtp-t$temp" 60 "$T" generate --device cuda -m "$G" -p "Once upon a time" -n 256 --temp $temp --seed 7 --ignore-eos --json "$OUT/plain-mtp-t$temp.json"
    run "mtp-t$temp" 60 "$T" generate --device cuda -m "$G" --spec-type draft-mtp -p "Once upon a time" -n 256 --temp $temp --seed 7 --ignore-eos --json "$OUT/mtp-t$temp.json"
  done
  # The assistant head on the engine (drafting over the sequence's KV cache there).
  A="$root/drafters/gemma3-270m-assistant.gguf"
  for temp in 0 0.8; do
    run "assistant-t$temp" 60 "$T" generate --device cuda -m "$M" --spec-type draft-assistant --mtp-head "$A" -p "Once upon a time" -n 256 --temp $temp --seed 7 --ignore-eos --json "$OUT/assistant-t$temp.json"
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
    for s, plain in [("ngram", "plain"), ("draft", "plain"), ("mtp", "plain-mtp"), ("assistant", "plain")]:
        p = load(f"{plain}-t{t}")
        d = load(f"{s}-t{t}")
        if p is None or d is None: print(f"{s} temp {t}: no result"); continue
        same = d["ids"] == p["ids"]
        print(f"{s} temp {t}: spec {'IDENTICAL to' if same else 'DIFFERS from'} plain; accepted {d['draft_n_accepted']}/{d['draft_n']}; {d['predicted_per_second']:.1f} vs plain {p['predicted_per_second']:.1f} tok/s")
PY
  run spec-bench 300 "$T" spec-bench --device cuda -m "$G" -md "$M" --mtp-head "$A" --types ngram,draft-mtp,draft-assistant,draft,reject --depths 1,3 --rounds 1 --sets mtp9 -n 128 --out "$OUT/spec-bench.md"
  tail -n 30 "$OUT/spec-bench.md" 2>/dev/null | tee -a "$log"
  exit 0
fi
if [ "$mode" = llama ]; then
  M="$W/model.gguf"
  [ -s "$M" ] || cat $(ls "$W"/m.* | sort) >"$M"
  say "model sha256 $(sha256sum "$M" | cut -d' ' -f1) want $(cat "$(pick model.sha256)")"
  [ -x "$W/tine" ] || { python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$(pick tine.tar.xz)" "$W" && chmod +x "$W/tine"; }
  T="$W/tine"
  LB="$W/llama.cpp/build/bin"
  if [ ! -x "$LB/llama-server" ]; then
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$(pick llama-slim.tar.xz)" "$W"
    t0=$(date +%s)
    cmake -S "$W/llama.cpp" -B "$W/llama.cpp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON >>"$log" 2>&1 &&
      cmake --build "$W/llama.cpp/build" -j"$(nproc)" --target llama-bench llama-server >>"$log" 2>&1
    say "llama.cpp CUDA build: rc=$? in $(($(date +%s) - t0)) s"
  fi
  [ -x "$LB/llama-bench" ] || { tail -n 30 "$log"; exit 1; }
  python3 -c 'import json, sys; json.dump(json.load(open(sys.argv[1]))[:512], open(sys.argv[2], "w"))' "$(pick long-prompt.json)" "$W/p512.json"
  # Raw prefill and decode: llama-bench's pp512 and tg128, and tine's equivalents on the engine
  # (512 prompt ids and one token; 128 tokens after a short prompt), three runs each.
  say "llama-bench"
  timeout 180 "$LB/llama-bench" -m "$M" -ngl 99 -p 512 -n 128 -r 5 2>&1 | tee -a "$log" | grep -E '^\|'
  for r in 1 2 3; do
    timeout 60 "$T" generate --device cuda -m "$M" -p "Once upon a time" -n 128 --temp 0 --ignore-eos --json "$OUT/tg128-$r.json" >>"$log" 2>&1
    timeout 60 "$T" generate --device cuda -m "$M" --prompt-ids "$W/p512.json" -n 1 --temp 0 --json "$OUT/pp512-engine-$r.json" >>"$log" 2>&1
    timeout 60 env TINE_GPU_ENGINE=0 "$T" generate --device cuda -m "$M" --prompt-ids "$W/p512.json" -n 1 --temp 0 --json "$OUT/pp512-candle-$r.json" >>"$log" 2>&1
  done
  python3 - "$OUT" <<'PY' | tee -a "$log"
import json, statistics, sys
o = sys.argv[1]
def med(name, key):
    v = []
    for r in (1, 2, 3):
        try: v.append(json.load(open(f"{o}/{name}-{r}.json"))[key])
        except Exception: pass
    return f"{statistics.median(v):.1f}" if v else "no result"
print(f"tine tg128 (engine): {med('tg128', 'predicted_per_second')} tok/s; pp512: engine {med('pp512-engine', 'prompt_per_second')} tok/s, candle {med('pp512-candle', 'prompt_per_second')} tok/s")
PY
  # Behind /completion: the three-way bench's method on both servers.
  PORT=18090
  "$LB/llama-server" -m "$M" -ngl 99 -c 4096 --port $PORT >"$OUT/llama-server.log" 2>&1 &
  SP=$!
  say "llama-server /completion"
  timeout 240 python3 "$root/tools/cuda/serve_check.py" "http://127.0.0.1:$PORT" "$(pick long-prompt.json)" "$OUT/serve-llama.json" 2>&1 | tee -a "$log"
  kill "$SP" 2>/dev/null; wait "$SP" 2>/dev/null
  PORT=18091
  "$T" serve --device cuda -m "$M" --port $PORT -c 4096 >"$OUT/tine-serve.log" 2>&1 &
  SP=$!
  say "tine serve /completion (engine)"
  timeout 240 python3 "$root/tools/cuda/serve_check.py" "http://127.0.0.1:$PORT" "$(pick long-prompt.json)" "$OUT/serve-tine.json" 2>&1 | tee -a "$log"
  kill "$SP" 2>/dev/null; wait "$SP" 2>/dev/null
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
  say "model sha256 $(sha256sum "$M" | cut -d' ' -f1) want $(cat "$(pick model.sha256)")"
  timeout 400 "$bin" --model "$M" --ref "$(pick cpu-ref.jsonl)" --assistant "$root/drafters/gemma3-270m-assistant.gguf" 2>&1 | grep -v '^ok ' | tee -a "$log"
  say "rc=${PIPESTATUS[0]}"
  # The same trunk with the NextN head grafted on (tine graft-nextn, from tine.tar.xz): the trunk
  # must still give the CPU's ids, and the head on the engine is checked against itself in steps.
  if [ -e "$(pick tine.tar.xz)" ]; then
    [ -x "$W/tine" ] || { python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$(pick tine.tar.xz)" "$W" && chmod +x "$W/tine"; }
    G="$W/nextn.gguf"
    [ -s "$G" ] || "$W/tine" graft-nextn --target "$M" --head "$root/drafters/gemma3-270m-nextn.gguf" -o "$G" >>"$log" 2>&1
    say "grafted NextN model"
    timeout 400 "$bin" --no-table --model "$G" --ref "$(pick cpu-ref.jsonl)" 2>&1 | grep -v '^ok ' | tee -a "$log"
    say "rc=${PIPESTATUS[0]}"
  fi
fi
