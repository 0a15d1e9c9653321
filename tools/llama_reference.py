#!/usr/bin/env python3
"""Record llama.cpp's reference outputs for Tine's correctness tests.

Starts a llama-server (built outside the repository, see tools/build_llama_cpp.sh) with an f32 KV
cache and flash attention off (closest to Tine's f32 arithmetic), then writes:
  tokenizer.json  - a corpus of varied texts and llama.cpp's token ids for each;
  greedy.json     - for fixed prompts: prompt ids, 128 greedy token ids, and the top-5
                    log-probabilities at every generated position (teacher forcing on llama.cpp's
                    own tokens).
Usage: tools/llama_reference.py --server PATH --model GGUF --out DIR
"""
import argparse, json, os, subprocess, sys, time, urllib.request

CORPUS = [
    "Hello world",
    " leading space and trailing space ",
    "multiple   spaces\tand\ttabs\n\nand newlines\r\n",
    "    four-space indent\n        eight",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!(\"{v:?}\"); }",
    "<html><body><h1>Title</h1><p class=\"x\">Text &amp; more</p></body></html>",
    "Unicode: café, naïve, Straße, Ελληνικά, русский, עברית, العربية, हिन्दी",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨",
    "Numbers 1234567890 3.14159 -42 1e-10 0xDEADBEEF",
    "URL https://example.com/path?query=1&x=y#frag and email user@example.org",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos",
    "Mixed\u00a0non-breaking\u2009thin\u200bzero-width spaces",
    "Math: ∀x ∈ ℝ, x² ≥ 0; ∑_{i=1}^{n} i = n(n+1)/2",
    "ALL CAPS and MiXeD cAsE and snake_case_names and camelCaseNames",
    "Repeated!!!!!!!! ???? ...... ------ ====== ######",
    "\n",
    " ",
    "a",
]

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def quicksort(arr):\n",
    "The three primary colors are",
]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def start_server(server, model, port, ctx, log=subprocess.DEVNULL):
    """llama-server on `model` (2 threads, one slot, f32 KV cache, flash attention off), returned once
    /health answers; exits naming the log if the server dies first."""
    srv = subprocess.Popen([server, "-m", model, "--port", str(port), "-t", "2", "-c", str(ctx), "-np", "1", "--no-warmup", "-ctk", "f32", "-ctv", "f32", "-fa", "off"], stdout=log, stderr=log)
    for _ in range(600):
        if srv.poll() is not None:
            sys.exit(f"llama-server exited with {srv.returncode}" + (f"; see {log.name}" if hasattr(log, "name") else ""))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except Exception:
            time.sleep(0.2)
    return srv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=18089)
    ap.add_argument("--n-predict", type=int, default=128)
    a = ap.parse_args()
    srv = start_server(a.server, a.model, a.port, 4096)
    try:
        tok = [{"text": t, "ids": post(a.port, "/tokenize", {"content": t, "add_special": False, "parse_special": True})["tokens"]} for t in CORPUS]
        greedy = []
        for p in PROMPTS:
            prompt_ids = post(a.port, "/tokenize", {"content": p, "add_special": True, "parse_special": True})["tokens"]
            r = post(a.port, "/completion", {"prompt": prompt_ids, "n_predict": a.n_predict, "temperature": 0, "n_probs": 5, "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
            probs = r["completion_probabilities"]
            greedy.append({
                "prompt": p,
                "prompt_ids": prompt_ids,
                "ids": [x["id"] for x in probs],
                "top": [[[t["id"], round(t["logprob"], 5)] for t in x["top_logprobs"]] for x in probs],
            })
        os.makedirs(a.out, exist_ok=True)
        meta = {"source": "llama.cpp llama-server", "model_sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"}
        with open(os.path.join(a.out, "llama_cpp_tokenizer.json"), "w") as f:
            json.dump({"meta": meta, "cases": tok}, f, ensure_ascii=False, indent=1)
        with open(os.path.join(a.out, "llama_cpp_greedy.json"), "w") as f:
            json.dump({"meta": meta, "cases": greedy}, f, indent=None)
            f.write("\n")
    finally:
        srv.terminate()
        srv.wait()


if __name__ == "__main__":
    sys.exit(main())
