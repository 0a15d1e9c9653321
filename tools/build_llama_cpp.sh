#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-bench, llama-tokenize and llama-perplexity as a benchmark and reference peer,
# from the llama.cpp sources vendored in the `llama-cpp-python` sdist on PyPI, into a cache outside
# the repository. Nothing built here is committed. About 7 minutes on 2 cores.
# Prints the bin directory on stdout.
set -euo pipefail
cache="${TINE_PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tine-peers}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
mkdir -p "$cache"
src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
bin="$src/build/bin"
if [ -x "$bin/llama-server" ] && [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-perplexity" ]; then echo "$bin"; exit 0; fi
if [ ! -d "$src" ]; then
  python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$cache" >&2
  tar xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
fi
if [ ! -x "$cache/venv/bin/cmake" ]; then
  python3 -m venv "$cache/venv" >&2
  "$cache/venv/bin/pip" install --quiet cmake ninja >&2
fi
"$cache/venv/bin/cmake" -S "$src" -B "$src/build" -G Ninja -DCMAKE_MAKE_PROGRAM="$cache/venv/bin/ninja" \
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON >&2
"$cache/venv/bin/cmake" --build "$src/build" -j"$(nproc)" --target llama-server llama-tokenize llama-bench llama-perplexity >&2
echo "$bin"
