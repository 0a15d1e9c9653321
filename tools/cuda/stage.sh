#!/usr/bin/env bash
# Stages the CUDA device job (tools/cuda/device_job.sh) into DEST, an ignored folder of the
# checkout the device tool sends (default: target/gpu-stage of this checkout). Run here, after
# tools/cuda/build.sh --tests:
#
#   tools/cuda/stage.sh [DEST]
#
# DEST/kit/    the job's scripts and inputs: prompts, the 1760-token prompt, CPU reference ids
# DEST/bin.tar.xz  the CUDA `tine` and the runtime test binary (stripped; one archive, so the
#              candle code the two share compresses once)
# DEST/m.NN    the model in chunks of TINE_STAGE_CHUNK_MB (default 36) MiB (m.00 less kit/ and
#              bin.tar.xz, which travel with it): a device call carries at most 64 MiB with the
#              checkout's tree, so the model travels over several calls, one chunk each
#
# Environment: TINE_CUDA_BIN, TINE_CUDA_TESTS (default: what build.sh --tests wrote), TINE_CPU_BIN
# (a CPU build of this tree for the reference ids; default target/release/tine), MODEL.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-$root/target/gpu-stage}"
model="${MODEL:-${TINE_CACHE_DIR:-$HOME/.cache/tine}/models/gemma-3-270m-q4_k_m.gguf}"
cuda_bin="${TINE_CUDA_BIN:-$root/target/cuda/release/tine}"
# TINE_CUDA_TESTS=none stages the job without the test binary (its two steps then fail, logged).
tests_bin="${TINE_CUDA_TESTS:-$(cat "$root/target/cuda/runtime-tests.path")}"
cpu_bin="${TINE_CPU_BIN:-$root/target/release/tine}"
chunk_mb="${TINE_STAGE_CHUNK_MB:-36}"
nice_cmd=${TINE_NICE-nice -n 19}
cd "$root"

rm -rf "$dest"
mkdir -p "$dest/kit" "$dest/.bin"
cp "$root/tools/cuda/device_job.sh" "$root/tools/cuda/serve_check.py" "$root/tools/cuda/summary.py" "$dest/kit/"
sha256sum "$model" | cut -d' ' -f1 >"$dest/kit/model.sha256"

# The greedy prompts (one a line, \n escapes) and their CPU ids from this machine.
cat >"$dest/kit/prompts.txt" <<'EOF'
The history of the printing press begins
def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n
Q: What is the capital of France?\nA:
Once upon a time, in a small village by the sea,
Shopping list:\n1. eggs\n2. milk\n3.
Translate to French: Good morning, how are you?\nFrench:
EOF
i=0
: >"$dest/kit/cpu-ref.jsonl"
while IFS= read -r p; do
  i=$((i + 1))
  $nice_cmd "$cpu_bin" generate -m "$model" -p "$(printf '%b' "$p")" -n 128 --temp 0 --ignore-eos --json "$dest/ref.json" >/dev/null 2>&1
  python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); d["index"] = int(sys.argv[2]); print(json.dumps(d))' "$dest/ref.json" "$i" >>"$dest/kit/cpu-ref.jsonl"
done <"$dest/kit/prompts.txt"
rm -f "$dest/ref.json"

# bench/three_way.py's prompt: a 1760-token reference prefix plus its first question.
python3 - "$cpu_bin" "$model" "$dest/kit/long-prompt.json" <<'EOF'
import json, subprocess, sys
tine, model, out = sys.argv[1:4]
sys.path.insert(0, "bench")
from three_way import PARAGRAPH, QUESTIONS
ids = lambda text, bos: json.loads(subprocess.run([tine, "tokenize", "-m", model, "-p", text] + ([] if bos else ["--no-bos"]), capture_output=True, text=True, check=True).stdout)
json.dump(ids(PARAGRAPH * 60, True)[:1760] + ids(QUESTIONS[0], False), open(out, "w"))
EOF

# The binaries, stripped, in one archive.
cp "$cuda_bin" "$dest/.bin/tine"
[ "$tests_bin" = none ] || cp "$tests_bin" "$dest/.bin/runtime-tests"
strip "$dest/.bin/"*
(cd "$dest/.bin" && tar cf - *) | $nice_cmd xz -9e -T1 >"$dest/bin.tar.xz"
rm -rf "$dest/.bin"

# The first chunk travels with kit/ and bin.tar.xz, so it is smaller by their size.
chunk=$((chunk_mb * 1024 * 1024))
first=$((chunk - $(du -sb "$dest/kit" | cut -f1) - $(stat -c %s "$dest/bin.tar.xz")))
head -c "$first" "$model" >"$dest/m.00"
tail -c +"$((first + 1))" "$model" | split -b "$chunk" -d -a 2 --numeric-suffixes=1 - "$dest/m."
cat "$dest"/m.* | cmp - "$model"
ls -la "$dest" "$dest/kit" >&2
du -sh "$dest"/* >&2
