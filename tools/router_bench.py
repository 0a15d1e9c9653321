#!/usr/bin/env python3
"""`tine serve` behind sglang-router against `tine serve` alone: the router's overhead and its
prefix affinity.

1. Overhead: the same streamed chat workload (C concurrent clients, R requests each, greedy,
   N tokens) sent to one replica directly, through the router to one replica, and through the
   router to two; time to first token (median, p90) and tokens per second over the run.
2. Affinity: a multi-user chat trace (U users in G groups; each group shares a long system
   prompt; every user talks for T turns, the conversation growing) through the router to two
   replicas with `cache_aware` and with `round_robin`: the share of each prompt's tokens a
   replica found in its cache (`timings.cache_n / prompt tokens`), and how many requests
   reused their system prompt.

  python3 tools/router_bench.py --model M.gguf [--router-python PY] [--tine target/release/tine]
      [--clients 4] [--requests 6] [--tokens 32] [--json out.json]

Standard library only; the router comes as in tools/serve_cluster.py.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_cluster import router_python, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = ["What is this about?", "Give me a summary.", "Which part matters most?", "What should I do first?", "Is there a risk?", "Explain it simply."]
TOPICS = ["billing and invoices", "data retention and backups", "access control and audit logs"]


def system_prompt(topic):
    body = f"You are the support assistant for {topic}. " + " ".join(f"Rule {i}: answer questions on {topic} precisely, cite the policy section, and keep answers short." for i in range(40))
    return body


def stream_chat(port, messages, tokens):
    body = json.dumps({"messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, text, usage, timings = None, "", None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            for ch in c.get("choices", []):
                d = ch.get("delta", {})
                # The first token is the first generated piece of any kind.
                if first is None and (d.get("content") or d.get("reasoning_content") or d.get("tool_calls")):
                    first = time.perf_counter() - t0
                text += d.get("content") or ""
            usage = c.get("usage") or usage
            timings = c.get("timings") or timings
    return first, text, usage, timings


def start_replica(tine, model, port, extra=()):
    p = subprocess.Popen([tine, "serve", "-m", model, "--port", str(port), *extra], stderr=subprocess.DEVNULL)
    if not wait_healthy(f"http://127.0.0.1:{port}", None, 120, p):
        sys.exit(f"replica on {port} did not come up")
    return p


def start_router(py, port, workers, policy):
    cmd = [py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[f"http://127.0.0.1:{w}" for w in workers],
           "--policy", policy, "--health-check-interval-secs", "5", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 1000)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Ready when a request goes through (workers register in the background).
    t0 = time.time()
    while time.time() - t0 < 120:
        try:
            stream_chat(port, [{"role": "user", "content": "warm up"}], 1)
            return p
        except OSError:
            time.sleep(0.3)
    sys.exit("the router did not serve")


def stop(*procs):
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=20)


def overhead_run(port, clients, requests, tokens):
    stream_chat(port, [{"role": "user", "content": "warm up"}], 1)
    ttft, done_tokens = [], []
    lock = threading.Lock()

    def client(c):
        for r in range(requests):
            q = QUESTIONS[(c + r) % len(QUESTIONS)]
            first, _, usage, _ = stream_chat(port, [{"role": "user", "content": f"Client {c}, request {r}: {q}"}], tokens)
            with lock:
                if first is not None:  # a reply of no tokens has no first token
                    ttft.append(first)
                done_tokens.append((usage or {}).get("completion_tokens", 0))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft.sort()
    p90 = ttft[min(len(ttft) - 1, max(0, -(-9 * len(ttft) // 10) - 1))]  # nearest rank
    return {"ttft_median_ms": 1e3 * statistics.median(ttft), "ttft_p90_ms": 1e3 * p90, "tokens_per_s": sum(done_tokens) / wall, "requests": len(ttft), "wall_s": wall}


def affinity_run(port, users, turns, tokens):
    """Users in groups of a shared system prompt, each talking for `turns` turns, two at a time."""
    results = []
    lock = threading.Lock()

    def user(u):
        topic = TOPICS[u % len(TOPICS)]
        msgs = [{"role": "system", "content": system_prompt(topic)}]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"User {u}, turn {t}: {QUESTIONS[(u + t) % len(QUESTIONS)]}"})
            _, text, usage, timings = stream_chat(port, msgs, tokens)
            msgs.append({"role": "assistant", "content": text})
            with lock:
                results.append({"user": u, "turn": t, "topic": topic, "prompt": usage["prompt_tokens"], "cache_n": timings["cache_n"]})

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reused = sum(r["cache_n"] for r in results) / sum(r["prompt"] for r in results)
    # A request reused its system prompt when its cache hit covers at least most of it (the
    # system prompt is ~90% of a first turn's prompt here).
    first_turns = [r for r in results if r["turn"] == 0]
    sys_len = min(r["prompt"] for r in first_turns) * 0.8
    hits = sum(1 for r in results if r["cache_n"] >= sys_len)
    return {"cached_share": reused, "requests": len(results), "requests_reusing_system_prompt": hits, "turns_after_first": sum(1 for r in results if r["turn"] > 0), "detail": results}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tine", default=os.path.join(ROOT, "target", "release", "tine"))
    ap.add_argument("--router-python")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2, help="-np of every replica")
    ap.add_argument("--json")
    a = ap.parse_args()
    py = router_python(a.router_python)
    extra = ["-np", str(a.slots), "-c", str(8192 * a.slots)]
    out = {"command": " ".join(sys.argv), "overhead": {}, "affinity": {}}

    r0 = start_replica(a.tine, a.model, 19001, extra)
    out["overhead"]["direct, 1 replica"] = overhead_run(19001, a.clients, a.requests, a.tokens)
    router = start_router(py, 19000, [19001], "cache_aware")
    out["overhead"]["router, 1 replica"] = overhead_run(19000, a.clients, a.requests, a.tokens)
    stop(router)
    r1 = start_replica(a.tine, a.model, 19002, extra)
    router = start_router(py, 19000, [19001, 19002], "cache_aware")
    out["overhead"]["router, 2 replicas"] = overhead_run(19000, a.clients, a.requests, a.tokens)
    stop(router, r0, r1)
    for policy in ["cache_aware", "round_robin"]:
        # Fresh replicas, so no cache is left over from another run.
        r0, r1 = start_replica(a.tine, a.model, 19001, extra), start_replica(a.tine, a.model, 19002, extra)
        router = start_router(py, 19000, [19001, 19002], policy)
        out["affinity"][policy] = affinity_run(19000, a.users, a.turns, a.tokens)
        stop(router, r0, r1)

    for k, v in out["overhead"].items():
        print(f"{k:22s} TTFT median {v['ttft_median_ms']:7.1f} ms  p90 {v['ttft_p90_ms']:7.1f} ms  {v['tokens_per_s']:6.1f} tok/s  ({v['requests']} requests)")
    for k, v in out["affinity"].items():
        print(f"{k:12s} cached share of prompt tokens {v['cached_share']:.3f}; {v['requests_reusing_system_prompt']}/{v['requests']} requests reused their system prompt")
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
