#!/bin/bash
# Runs on the device machine, detached (setsid nohup), after the four chunks sit in /tmp/w.
# Reassembles and checks the target, installs the carried gguf wheel, runs the whole pipeline.
set -uo pipefail
W=/tmp/w
cd "$(dirname "$0")/../.."
cat $W/c0 $W/c1 $W/c2 $W/c3 > $W/model.gguf
echo "model sha256 $(sha256sum $W/model.gguf | cut -d' ' -f1) (want ${WANT_SHA:-?})"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
python3 -c "import torch, transformers, gguf; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 tools/drafters/pipeline.py all --model $W/model.gguf --out $W/out "$@"
echo "exit $?"
