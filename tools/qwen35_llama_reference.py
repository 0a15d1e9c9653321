#!/usr/bin/env python3
"""Record llama.cpp's outputs on the synthetic Qwen3.5 GGUF that tine-test-support's
qwen35_fixture writes, for quantized_qwen35's cross-check against llama.cpp.

Starts llama-server (tools/build_llama_cpp.sh builds it) on the GGUF with an f32 KV cache and
flash attention off, sends fixed prompts as token ids (greedy, n_probs 5) and writes, per prompt,
the generated ids and the top-5 log-probabilities at every generated position (`-` where
llama-server reports none: a token that leaves the text in an incomplete UTF-8 sequence), as
plain text.

  cargo test -p tine-patch-tests --test quantized_qwen35 -- --ignored write_the_llama_cpp_fixture
      (with TINE_QWEN35_GGUF=/tmp/qwen35-fixture.gguf)
  tools/qwen35_llama_reference.py --server "$(tools/build_llama_cpp.sh)/llama-server" \
      --model /tmp/qwen35-fixture.gguf --out engine/crates/tine-test-support/data/qwen35_llama_cpp.txt
"""
import argparse, hashlib, os, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_reference import post, start_server  # noqa: E402

PROMPTS = [[3, 17, 40, 2, 88, 5, 61, 9, 33], [256, 100, 101, 102], [7] * 12, [200, 12, 34, 56, 78, 90, 123, 145, 167, 189, 211, 233, 255, 1, 2, 3, 4, 5, 6, 7]]


def main(prompts=PROMPTS, description=None):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=18095)
    ap.add_argument("--n-predict", type=int, default=16)
    a = ap.parse_args()
    srv = start_server(a.server, a.model, a.port, 512, open(a.out + ".server.log", "w"))
    try:
        cases = []
        for p in prompts:
            # Every generated id (`tokens`); `completion_probabilities` leaves out the tokens after
            # which the text ends in an incomplete UTF-8 sequence (llama-server holds their text
            # back and never records their probabilities), so it cannot be zipped with the ids.
            r = post(a.port, "/completion", {"prompt": p, "n_predict": a.n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
            ids = r["tokens"]
            top = []
            # Each position's top five from a one-token request teacher-forced on the ids before
            # it; a lead byte alone is incomplete UTF-8 again, so those positions stay unknown.
            for i in range(len(ids)):
                s = post(a.port, "/completion", {"prompt": p + ids[:i], "n_predict": 1, "temperature": 0, "n_probs": 5, "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
                if s["tokens"] != [ids[i]]:
                    sys.exit(f"prompt {p} position {i}: teacher-forced pick {s['tokens']}, generated {ids[i]}")
                probs = s.get("completion_probabilities") or []
                top.append([[t["id"], round(t["logprob"], 6)] for t in probs[0]["top_logprobs"]] if probs else None)
            cases.append({"prompt_ids": p, "ids": ids, "top": top})
        sha = hashlib.sha256(open(a.model, "rb").read()).hexdigest()
        # A plain text format the Rust test reads without a JSON crate: per case a `prompt` line,
        # an `ids` line, then one `top` line per generated position (id:logprob pairs).
        with open(a.out, "w") as f:
            f.write(f"# llama.cpp llama-server (llama-cpp-python 0.3.36 sdist), f32 KV, flash attention off; model sha256 {sha}\n")
            for c in cases:
                f.write("prompt " + " ".join(map(str, c["prompt_ids"])) + "\n")
                f.write("ids " + " ".join(map(str, c["ids"])) + "\n")
                for top in c["top"]:
                    f.write("top " + (" ".join(f"{i}:{lp}" for i, lp in top) if top is not None else "-") + "\n")
    finally:
        srv.terminate()
        srv.wait()


if __name__ == "__main__":
    sys.exit(main())
