#!/usr/bin/env python3
"""Concurrent clients with a common system prompt, against `tine serve` with and without shared
prefixes (and optionally llama-server): time to first token, prompt tokens evaluated, memory.

Each client sends one chat turn (the same system prompt, its own question) rendered by the
server's `/apply-template`, then streams `/completion` (greedy, `n_predict` tokens). All clients
start together. Standard library only.

  python3 tools/shared_prefix_bench.py --tine target/release/tine --model M.gguf \
      [--llama-server PATH] [--clients 8] [--system-tokens 1500] [--tine-args '--spec-type ngram'] [--json out.json]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

QUESTIONS = [
    "Which plan should a team of five choose?",
    "How do I reset my password?",
    "Can I move my data to another region?",
    "What happens when an invoice is late?",
    "Is there a discount for schools?",
    "How long are backups kept?",
    "Who can see the audit log?",
    "How do I close my account?",
    "What is the uptime promise?",
    "Can two people edit the same file?",
    "Where are the servers located?",
    "How do I add a new user?",
    "Which browsers are supported?",
    "How do refunds work?",
    "Can I export my reports?",
    "What does the free tier include?",
]

TOPICS = ["billing", "accounts", "storage", "security", "support", "backups", "teams", "reports", "exports", "privacy", "uptime", "regions"]


def system_text(sentences):
    out = ["You are the support assistant of Quillstone, a document service. Follow the policy below exactly."]
    for i in range(sentences):
        t = TOPICS[i % len(TOPICS)]
        out.append(f"Rule {i + 1} ({t}): when a customer asks about {t}, check clause {i * 7 % 97 + 1} of the {t} policy, "
                   f"quote its number, and answer in at most {i % 5 + 2} sentences without guessing.")
    return " ".join(out)


def http(port, path, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def wait_up(port, proc, limit=300):
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            if json.loads(http(port, "/health", timeout=2)).get("status") == "ok":
                return
        except Exception:
            pass
        time.sleep(0.2)
    sys.exit("server did not come up")


def rss_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def stream(port, prompt, n_predict, out):
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "stream": True, "cache_prompt": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.time()
    first, text, timings = None, [], None
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev.get("content") and first is None:
                first = time.time() - t0
            text.append(ev.get("content", ""))
            if ev.get("stop"):
                timings = ev.get("timings")
    out.update(ttft=first, total=time.time() - t0, text="".join(text), timings=timings)


def run(label, cmd, port, clients, system, n_predict):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_up(port, proc)
        base = rss_kib(proc.pid, "VmRSS")
        prompts = []
        for q in QUESTIONS[:clients]:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            prompts.append(json.loads(http(port, "/apply-template", {"messages": msgs}))["prompt"])
        n_prompt = len(json.loads(http(port, "/tokenize", {"content": prompts[0]}))["tokens"])
        results = [dict() for _ in prompts]
        threads = [threading.Thread(target=stream, args=(port, p, n_predict, r)) for p, r in zip(prompts, results)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        peak = rss_kib(proc.pid, "VmHWM")
        metrics = {}
        try:
            for line in http(port, "/metrics").splitlines():
                if line and not line.startswith("#"):
                    k, v = line.split(" ", 1)
                    metrics[k] = float(v)
        except Exception:
            pass
        ttft = sorted(r["ttft"] for r in results)
        row = {
            "label": label,
            "clients": clients,
            "prompt_tokens_each": n_prompt,
            "ttft_mean_s": sum(ttft) / len(ttft),
            "ttft_median_s": ttft[len(ttft) // 2],
            "ttft_max_s": ttft[-1],
            "wall_s": wall,
            "prompt_tokens_evaluated": sum((r["timings"] or {}).get("prompt_n", 0) for r in results),
            "rss_growth_mib": (peak - base) / 1024,
            "pool_bytes_mib": metrics.get("tine:prefix_pool_bytes", 0) / 2**20,
            "texts": [r["text"] for r in results],
        }
        return row
    finally:
        proc.terminate()
        proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tine", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-server")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--tine-args", default="", help="more `tine serve` flags, e.g. '--spec-type ngram'")
    ap.add_argument("--json")
    a = ap.parse_args()
    ctx = a.ctx_per_slot * a.clients
    # Grow the system prompt to about the asked length, measured with the model's tokenizer.
    probe = subprocess.run([a.tine, "tokenize", "--model", a.model, "-p", system_text(10)], capture_output=True, text=True)
    per = max(1, len(json.loads(probe.stdout)) if probe.returncode == 0 and probe.stdout.strip().startswith("[") else 400) / 10
    system = system_text(max(1, int(a.system_tokens / per)))
    common = [a.tine, "serve", "--model", a.model, "--port", str(a.port), "--parallel", str(a.clients), "--ctx-size", str(ctx), "--metrics"] + a.tine_args.split()
    rows = [
        run("tine, shared prefixes (--cache-ram 8192)", common + ["--cache-ram", "8192"], a.port, a.clients, system, a.n_predict),
        run("tine, no sharing (--cache-ram 0)", common + ["--cache-ram", "0"], a.port, a.clients, system, a.n_predict),
    ]
    if a.llama_server:
        cmd = [a.llama_server, "-m", a.model, "--port", str(a.port), "-np", str(a.clients), "-c", str(ctx), "-t", str(a.threads), "--metrics", "-fa", "on"]
        rows.append(run("llama-server -np N", cmd, a.port, a.clients, system, a.n_predict))
    same = rows[0]["texts"] == rows[1]["texts"]
    for r in rows:
        print(f"{r['label']}: prompt {r['prompt_tokens_each']} tokens x {r['clients']}; TTFT mean {r['ttft_mean_s']:.2f} s, median {r['ttft_median_s']:.2f} s, "
              f"max {r['ttft_max_s']:.2f} s; all done {r['wall_s']:.2f} s; prompt tokens evaluated {r['prompt_tokens_evaluated']}; "
              f"RSS growth {r['rss_growth_mib']:.0f} MiB; pool {r['pool_bytes_mib']:.0f} MiB")
    print(f"tine answers identical with and without sharing: {same}")
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rows": rows, "identical_with_and_without_sharing": same}, f, indent=1)
        os.replace(tmp, a.json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
