#!/usr/bin/env python3
"""Record llama.cpp's outputs on the synthetic Gemma 4 GGUFs that tine-test-support's
gemma4_fixture writes (with its tokenizer), for quantized_gemma4's cross-check against llama.cpp:
the same recording as tools/qwen35_llama_reference.py (llama-server, f32 KV, flash attention
off, greedy ids and teacher-forced top-5 log-probabilities), one output file per GGUF.

  (cd engine && TINE_GEMMA4_GGUF_DIR=/tmp/g4 cargo test --release -p tine-patch-tests \\
      --test quantized_gemma4 -- --ignored write_the_llama_cpp_fixtures)
  for v in dense e2b a4b; do
    tools/gemma4_llama_reference.py --server "$(tools/build_llama_cpp.sh)/llama-server" \\
        --model /tmp/g4/$v.gguf --out engine/crates/tine-test-support/data/gemma4_llama_cpp_$v.txt
  done
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen35_llama_reference import main  # noqa: E402

# Token ids below the fixture's 265; 5.. are the byte tokens (0..4 are <pad>, <eos>, <bos>,
# <|turn>, <turn|>). The last prompt is longer than the fixture's sliding window.
PROMPTS = [[2, 40, 17, 88, 5, 61, 9, 33], [2, 256, 100, 101, 102], [2] + [7] * 12, [2, 200, 12, 34, 56, 78, 90, 123, 145, 167, 189, 211, 233, 255, 11, 12, 13, 14, 15, 16, 17]]

if __name__ == "__main__":
    sys.exit(main(PROMPTS, __doc__))
