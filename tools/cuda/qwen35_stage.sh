#!/usr/bin/env bash
# Stages the Qwen3.5 GPU-engine device job (tools/cuda/qwen35_job.sh) into target/q35-engine,
# which the device call carries (`carry: ["target/q35-engine"]`). Run here after building:
#
#   TINE_CUDA_TARGET_CPU=x86-64-v3 tools/cuda/build.sh --engine-check   # tine-gpu-check
#   TINE_CUDA_TARGET_CPU=x86-64-v3 tools/cuda/build.sh                  # tine (CUDA build)
#   tools/cuda/qwen35_stage.sh
#
# target/q35-engine/bin.tar.xz     tine-gpu-check and tine, stripped
# target/q35-engine/llama.tar.xz   llama.cpp (with gguf-py, for the random GGUFs) from the
#                                  llama-cpp-python sdist (LLAMA_CPP_PYTHON_VERSION, default
#                                  0.3.36), without its models, docs and other backends
# The random-weight models are written on the GPU machine (tools/qwen35_random_model.py, numpy
# there) and quantized there by the llama-quantize built in the same job.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
dest="$root/target/q35-engine"
rm -rf "$dest"
mkdir -p "$dest/.bin"
cp "${TINE_GPU_CHECK:-$root/target/gpu-check/release/tine-gpu-check}" "$dest/.bin/tine-gpu-check"
cp "${TINE_CUDA_BIN:-$root/target/cuda/release/tine}" "$dest/.bin/tine"
strip "$dest/.bin/tine-gpu-check" "$dest/.bin/tine"
tar -C "$dest/.bin" -cJf "$dest/bin.tar.xz" tine-gpu-check tine
rm -rf "$dest/.bin"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
sdist="$root/target/llama-sdist/llama_cpp_python-$version.tar.gz"
[ -s "$sdist" ] || python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$root/target/llama-sdist" >&2
rm -rf "$dest/.llama" && mkdir -p "$dest/.llama"
tar xzf "$sdist" -C "$dest/.llama"
l="$dest/.llama/llama_cpp_python-$version/vendor/llama.cpp"
rm -rf "$l/models" "$l/docs" "$l/media" "$l/benches" "$l/conversion" "$l/gguf-py/tests"
for b in hexagon sycl vulkan opencl cann musa webgpu zdnn openvino; do rm -rf "$l/ggml/src/ggml-$b"; done
tar -C "$(dirname "$l")" -cJf "$dest/llama.tar.xz" llama.cpp
rm -rf "$dest/.llama"
ls -la "$dest"
