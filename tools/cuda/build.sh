#!/usr/bin/env bash
# Builds `tine` with candle's CUDA backend (`--features cuda`), on a machine without a GPU or a
# system CUDA toolkit: the toolkit comes from NVIDIA's PyPI wheels into a venv under target/cuda/.
#
#   tools/cuda/build.sh            # -> target/cuda/release/tine (prints the path on stdout)
#   tools/cuda/build.sh --tests    # also tine-runtime's test binary with the CUDA tests
#                                  #   (its path goes to target/cuda/runtime-tests.path)
#   tools/cuda/build.sh --clippy   # clippy -D warnings on the CUDA build of tine-gpu (its check binary too), tine-runtime and tine-cli
#   tools/cuda/build.sh --engine-check  # only the GPU engine's check binary, tine-gpu-check
#                                  #   (target/gpu-check/release/tine-gpu-check; no candle kernels)
#
# Environment (all optional):
#   TINE_CUDA_TOOLKIT   cuda-toolkit wheel version (default 13.0.2: nvcc 13.0, whose PTX ISA 9.0 a
#                       CUDA 13.0 driver (580.x) loads; a newer nvcc writes PTX such a driver refuses)
#   CUDA_COMPUTE_CAP    GPU compute capability to build for (default 90: H100/H200; 89 Ada, 80 A100)
#   TINE_CUDA_TARGET_CPU  rustc -C target-cpu (default native; x86-64-v3 for a binary that runs on
#                       another machine's CPU, as the device job does)
#   CARGO_TARGET_DIR    default target/cuda
#   TINE_NICE           prefix for the build commands (default "nice -n 19")
#
# What it does: pip-installs cuda-toolkit[nvcc,cudart,cublas,curand,nvrtc,cccl,crt,nvvm] into
# target/cuda/venv; writes unversioned .so links into the toolkit's lib/stubs (for a build with
# CANDLE_CUDART_DYNAMIC, which links -lcudart); points CUDA_ROOT/CUDA_PATH/CUDA_HOME/PATH at it;
# builds; checks that the binary starts on this machine (no GPU here).
# The binary links no CUDA library (patch 0021: cudarc opens them at run time, the CUDA runtime
# is linked statically), so it starts and runs `--device cpu` anywhere. `--device cuda` opens
# libcuda.so.1 (the driver), libcublas.so.13, libcublasLt.so.13 and libcurand.so.10: next to the
# binary ($ORIGIN), in this venv (rpath), then in LD_LIBRARY_PATH and the system paths; tine
# names any it cannot load.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
nice_cmd=${TINE_NICE-nice -n 19}
toolkit_version="${TINE_CUDA_TOOLKIT:-13.0.2}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
target_cpu="${TINE_CUDA_TARGET_CPU:-native}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target/cuda}"
venv="$root/target/cuda/venv"

log() { echo "tools/cuda/build.sh: $*" >&2; }

# 1. The toolkit, from PyPI.
stamp="$venv/.cuda-toolkit-$toolkit_version"
if [ ! -e "$stamp" ]; then
  log "installing cuda-toolkit==$toolkit_version wheels into $venv"
  python3 -m venv "$venv" >&2
  $nice_cmd "$venv/bin/pip" install --quiet --upgrade \
    "cuda-toolkit[nvcc,cudart,cublas,curand,nvrtc,cccl,crt,nvvm]==$toolkit_version" >&2
  touch "$stamp"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cuda="$site/nvidia/cu13"
[ -x "$cuda/bin/nvcc" ] || { log "no nvcc at $cuda/bin/nvcc"; exit 1; }

# 2. Unversioned links, for -lcudart when CANDLE_CUDART_DYNAMIC is set.
stubs="$cuda/lib/stubs"
mkdir -p "$stubs"
for lib in cudart cublas cublasLt curand nvrtc; do
  real=$(cd "$cuda/lib" && ls "lib$lib.so."* 2>/dev/null | grep -v alt | sort | head -n1 || true)
  [ -n "$real" ] || { log "no lib$lib.so.* in $cuda/lib"; exit 1; }
  ln -sf "../$real" "$stubs/lib$lib.so"
done

# 3. The build.
export CUDA_ROOT="$cuda" CUDA_PATH="$cuda" CUDA_HOME="$cuda" CUDA_TOOLKIT_ROOT_DIR="$cuda"
export PATH="$cuda/bin:$PATH"
export NVCC="$cuda/bin/nvcc"
# RUSTFLAGS replaces .cargo/config.toml's rustflags, so target-cpu is restated here.
export RUSTFLAGS="-C target-cpu=$target_cpu -C link-arg=-Wl,-rpath,\$ORIGIN:$cuda/lib ${TINE_CUDA_RUSTFLAGS:-}"
log "nvcc: $(nvcc --version | tail -n2 | head -n1); CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP; target-cpu=$target_cpu; CARGO_TARGET_DIR=$CARGO_TARGET_DIR"
if [ "${1:-}" = --clippy ]; then
  exec $nice_cmd cargo clippy --release --locked -p tine-gpu -p tine-runtime -p tine-cli --features tine-gpu/cuda,tine-runtime/cuda,tine-cli/cuda --all-targets --no-deps -- -D warnings
fi
if [ "${1:-}" = --engine-check ]; then
  # Its own target dir: the check binary needs none of candle's CUDA kernels.
  export CARGO_TARGET_DIR="${TINE_GPU_CHECK_TARGET:-$root/target/gpu-check}"
  $nice_cmd cargo build --release --locked -p tine-gpu --features cuda --bin tine-gpu-check >&2
  check="$CARGO_TARGET_DIR/release/tine-gpu-check"
  log "built $check ($(du -h "$check" | cut -f1))"
  echo "$check"
  exit 0
fi
if [ "${1:-}" = --tests ]; then
  # One cargo invocation for the binary and the test binary, so that candle-kernels (every CUDA
  # kernel) is built once for one feature set, not once per invocation.
  $nice_cmd cargo test --release --locked -p tine-runtime -p tine-cli --features tine-runtime/cuda,tine-cli/cuda --no-run --message-format=json-render-diagnostics \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "runtime":
        print(m["executable"])' >"$root/target/cuda/runtime-tests.path"
  log "runtime tests: $(cat "$root/target/cuda/runtime-tests.path")"
else
  $nice_cmd cargo build --release --locked -p tine-cli --features cuda >&2
fi
bin="$CARGO_TARGET_DIR/release/tine"
log "built $bin ($(du -h "$bin" | cut -f1)); needs: $(readelf -d "$bin" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
# It must start here, where there is no GPU and no driver.
"$bin" --help >/dev/null || { log "$bin does not start on this machine"; exit 1; }
echo "$bin"
