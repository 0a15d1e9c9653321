#!/usr/bin/env bash
# Stages the GPU engine's device job (tools/cuda/engine_job.sh) into target/gpu-engine, which the
# device call carries. Run here after building the check binary:
#
#   TINE_CUDA_TARGET_CPU=x86-64-v3 tools/cuda/build.sh --engine-check
#                                   # -> target/gpu-check/release/tine-gpu-check
#   TINE_CUDA_TARGET_CPU=x86-64-v3 tools/cuda/build.sh   # tine, for `engine_job.sh runtime`
#   tools/cuda/engine_stage.sh
#
# target/gpu-engine/bin.tar.xz   the check binary (stripped)
# target/gpu-engine/cpu-ref.jsonl  greedy ids of the CPU path for tools/cuda/stage.sh's prompts
#                                (TINE_CPU_BIN, default target/debug/tine, 64 tokens each)
# target/gpu-engine/tine.tar.xz   the CUDA build of tine (stripped), when target/cuda/release/tine
#                                exists (TINE_CUDA_BIN), for `engine_job.sh runtime`
# target/gpu-engine/long-prompt.json  bench/three_way.py's 1760-token prompt (+ its question) as ids
# target/gpu-engine/llama-slim.tar.xz  llama.cpp from the llama-cpp-python sdist (LLAMA_CPP_PYTHON_VERSION,
#                                default 0.3.36) without its models, docs and other backends, for
#                                `engine_job.sh llama` (about 7 MB)
# target/gpu-engine/m.NN          the model in chunks of 36 MiB, one per device call
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
dest="$root/target/gpu-engine"
bin="${TINE_GPU_CHECK:-$root/target/gpu-check/release/tine-gpu-check}"
cpu_bin="${TINE_CPU_BIN:-$root/target/debug/tine}"
model="${MODEL:-${TINE_CACHE_DIR:-$HOME/.cache/tine}/models/gemma-3-270m-q4_k_m.gguf}"
rm -rf "$dest"
mkdir -p "$dest/.bin"
cp "$bin" "$dest/.bin/tine-gpu-check"
strip "$dest/.bin/tine-gpu-check"
tar -C "$dest/.bin" -cJf "$dest/bin.tar.xz" tine-gpu-check
rm -rf "$dest/.bin"
tine_bin="${TINE_CUDA_BIN:-$root/target/cuda/release/tine}"
if [ -x "$tine_bin" ]; then
  mkdir -p "$dest/.tine"
  cp "$tine_bin" "$dest/.tine/tine"
  strip "$dest/.tine/tine"
  tar -C "$dest/.tine" -cJf "$dest/tine.tar.xz" tine
  rm -rf "$dest/.tine"
fi
sha256sum "$model" | cut -d' ' -f1 >"$dest/model.sha256"
: >"$dest/cpu-ref.jsonl"
for p in 'The history of the printing press begins' 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' 'Q: What is the capital of France?\nA:' 'Once upon a time, in a small village by the sea,' 'Shopping list:\n1. eggs\n2. milk\n3.' 'Translate to French: Good morning, how are you?\nFrench:'; do
  "$cpu_bin" generate -m "$model" -p "$(printf '%b' "$p")" -n 64 --temp 0 --ignore-eos --json "$dest/ref.json" >/dev/null 2>&1
  cat "$dest/ref.json" >>"$dest/cpu-ref.jsonl"
done
rm -f "$dest/ref.json"
python3 - "$cpu_bin" "$model" "$dest/long-prompt.json" <<'PY'
import json, subprocess, sys
tine, model, out = sys.argv[1:4]
sys.path.insert(0, "bench")
from three_way import PARAGRAPH, QUESTIONS
ids = lambda text, bos: json.loads(subprocess.run([tine, "tokenize", "-m", model, "-p", text] + ([] if bos else ["--no-bos"]), capture_output=True, text=True, check=True).stdout)
json.dump(ids(PARAGRAPH * 60, True)[:1760] + ids(QUESTIONS[0], False), open(out, "w"))
PY
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
sdist="$root/target/llama-sdist/llama_cpp_python-$version.tar.gz"
[ -s "$sdist" ] || python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$root/target/llama-sdist" >&2
rm -rf "$dest/.llama" && mkdir -p "$dest/.llama"
tar xzf "$sdist" -C "$dest/.llama"
l="$dest/.llama/llama_cpp_python-$version/vendor/llama.cpp"
rm -rf "$l/models" "$l/docs" "$l/media" "$l/benches" "$l/gguf-py" "$l/conversion"
for b in hexagon sycl vulkan opencl cann musa webgpu zdnn openvino; do rm -rf "$l/ggml/src/ggml-$b"; done
tar -C "$(dirname "$l")" -cJf "$dest/llama-slim.tar.xz" llama.cpp
rm -rf "$dest/.llama"
split -b 36M -d -a 2 "$model" "$dest/m."
ls -la "$dest"
