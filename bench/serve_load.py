#!/usr/bin/env python3
"""Two measurements of `tine serve` on the real model, on loopback.

stall: one client streams a greedy generation while a second client sends a long prompt; the
       first client's inter-token latency (p50, p99, max) before and during that prefill, for
       each --ubatch-size given (a size >= the prompt is the old one-step prefill).
load:  N concurrent connections against --parallel P (--max-queue Q): answers by status, errors,
       wall time, and the server's peak RSS (VmHWM) before and after.
clients: aggregate generated tokens per second of C concurrent clients (each a /completion of
       --n-predict greedy tokens with ignore_eos, its own prompt) against --parallel P, for each
       C given, with the slots' rows (decode rows, verify batches) batched and (TINE_CPU_BATCH=0,
       TINE_GPU_BATCH=0)
       stepped one slot at a time (--tine-args for both, e.g. a spec type), and llama-server with
       --llama-server, interleaved over --rounds rounds; the requests stream: each request's
       wall time (p50, p90, max), first-token time and inter-token gaps (p50, p99), and the draft
       counts; every answer checked against the same request alone.
mixed: the issue's identity test: --requests concurrent streamed /completion requests of mixed
       kinds (greedy, seeded at temperature 0.8, top-k 40 / top-p 0.9, lengths 32..256) and one
       long prompt arriving mid-way, against --parallel P (--tine-args, e.g. a spec type); each
       answer's token ids checked against the same request run alone, the longest gap between a
       request's streamed tokens (no slot starves), and the long prompt's first-token time.

    python3 bench/serve_load.py --tine target/release/tine --model M.gguf stall --ubatch 4096,512,128
    python3 bench/serve_load.py --tine target/release/tine --model M.gguf load --connections 1000
    python3 bench/serve_load.py --tine target/release/tine --model M.gguf clients --clients 1,2,4,8
    python3 bench/serve_load.py --tine target/release/tine --model M.gguf mixed --requests 16
"""
import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Server:
    def __init__(self, tine, model, args, env=None, cmd=None):
        self.port = free_port()
        cmd = (cmd or [tine, "serve"]) + ["-m", model, "--host", "127.0.0.1", "--port", str(self.port)] + args
        # SERVE_LOAD_LOGS=DIR keeps each server's stderr (DIR/server-PORT.log: its start-up lines).
        logs = os.environ.get("SERVE_LOAD_LOGS")
        err = open(os.path.join(logs, f"server-{self.port}.log"), "w") if logs else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL, env=env)
        t0 = time.time()
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.time() - t0 > 120 or self.proc.poll() is not None:
                raise SystemExit("the server did not start: " + " ".join(cmd))
            time.sleep(0.2)

    def rss_kib(self, key="VmHWM"):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        return 0

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def post(port, path, body, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def stream_post(port, body, timeout=600):
    """A streamed /completion: (token ids, seconds from the request to each event that carried
    tokens, the final event)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.time()
    c.request("POST", "/completion", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    tokens, times, final = [], [], {}
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        ev = json.loads(line[6:])
        got = ev.get("tokens") or []
        if got:
            tokens.extend(got)
            times.append(time.time() - t0)
        if ev.get("stop"):
            final = ev
            break
    c.close()
    return tokens, times, final


def stall(a):
    long_prompt = ("The quick brown fox jumps over the lazy dog while the band plays on. " * 200)
    rows = []
    for ub in [int(x) for x in a.ubatch.split(",")]:
        srv = Server(a.tine, a.model, ["--parallel", "2", "--ctx-size", "4096", "--ubatch-size", str(ub)])
        try:
            # Warm up both slots.
            post(srv.port, "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0})
            n_tok = len(json.loads(post(srv.port, "/tokenize", {"content": long_prompt[:a.prompt_chars]})[1])["tokens"])
            arrivals = []
            window = {}

            def streamer():
                c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
                body = {"prompt": "Once upon a time", "n_predict": a.tokens, "temperature": 0, "ignore_eos": True, "stream": True}
                c.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
                r = c.getresponse()
                while True:
                    line = r.fp.readline()
                    if not line:
                        break
                    if line.startswith(b"data: "):
                        ev = json.loads(line[6:])
                        arrivals.append(time.perf_counter())
                        if ev.get("stop"):
                            break

            def long_client():
                while len(arrivals) < a.tokens // 4:
                    time.sleep(0.005)
                window["start"] = time.perf_counter()
                post(srv.port, "/completion", {"prompt": long_prompt[:a.prompt_chars], "n_predict": 1, "temperature": 0, "cache_prompt": False})
                window["end"] = time.perf_counter()

            t1, t2 = threading.Thread(target=streamer), threading.Thread(target=long_client)
            t1.start(), t2.start()
            t1.join(), t2.join()
            gaps = [(arrivals[i], arrivals[i] - arrivals[i - 1]) for i in range(1, len(arrivals))]
            before = [g * 1e3 for t, g in gaps if t < window["start"]]
            during = [g * 1e3 for t, g in gaps if window["start"] <= t <= window["end"] + 0.001]
            # The gap that straddles the end of the prefill belongs to it too.
            after_end = [g * 1e3 for t, g in gaps if t > window["end"] + 0.001]
            if after_end:
                during.append(after_end[0])
            rows.append((ub, n_tok, before, during, (window["end"] - window["start"]) * 1e3))
        finally:
            srv.stop()
    print(f"stall: a streamed greedy generation of {a.tokens} tokens on slot A; a {rows[0][1]}-token prompt arrives on slot B after {a.tokens // 4} tokens")
    print("| --ubatch-size | ITL before p50 / p99 (ms) | ITL during B's prefill p50 / p99 / max (ms) | B's prefill + 1 token (ms) |")
    print("|---:|---:|---:|---:|")
    for ub, n, before, during, b_ms in rows:
        print(f"| {ub} | {statistics.median(before):.1f} / {pct(before, 0.99):.1f} | {statistics.median(during):.1f} / {pct(during, 0.99):.1f} / {max(during):.1f} | {b_ms:.0f} |")


def load(a):
    srv = Server(a.tine, a.model, ["--parallel", str(a.parallel), "--max-queue", str(a.max_queue), "--ctx-size", "1024"])
    try:
        post(srv.port, "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0})
        rss0 = srv.rss_kib()
        results = []
        lock = threading.Lock()
        barrier = threading.Barrier(a.connections)

        def client(i):
            body = {"prompt": f"Question {i}: what is {i} + {i}?", "n_predict": a.n_predict, "temperature": 0, "stream": i % 2 == 0}
            try:
                barrier.wait()
                s, raw = post(srv.port, "/completion", body, timeout=900)
                ok_json = True
                if s != 200:
                    ok_json = json.loads(raw).get("error", {}).get("code") == s
                out = (s, ok_json)
            except Exception as e:  # noqa: BLE001 - a failed connection is a result here
                out = (type(e).__name__, False)
            with lock:
                results.append(out)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        rss1 = srv.rss_kib()
        by = {}
        for s, _ in results:
            by[s] = by.get(s, 0) + 1
        bad_bodies = sum(1 for s, ok in results if not ok)
        st, _ = post(srv.port, "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0})
        print(f"load: {a.connections} concurrent connections, --parallel {a.parallel} --max-queue {a.max_queue}, n_predict {a.n_predict}")
        print(f"answers by status: {json.dumps(by, sort_keys=True)}; error answers without a JSON error body: {bad_bodies}")
        print(f"wall {wall:.1f} s; server peak RSS {rss0 / 1024:.0f} MiB before, {rss1 / 1024:.0f} MiB after; still serving: {srv.alive() and st == 200}")
    finally:
        srv.stop()


PROMPTS = ["The history of the printing press", "Once upon a time", "The best way to learn a language", "Water boils at",
           "In the beginning", "A recipe for bread:", "The capital cities of Europe", "Dear hiring manager,"]


def clients(a):
    counts = [int(c) for c in a.clients.split(",")]
    args = ["--parallel", str(a.parallel), "-c", str(a.parallel * 512)]
    targs = args + a.tine_args.split()
    servers = {"tine batched": Server(a.tine, a.model, targs), "tine one slot a step": Server(a.tine, a.model, targs, env=dict(os.environ, TINE_CPU_BATCH="0", TINE_GPU_BATCH="0"))}
    if a.llama_server:
        servers["llama-server"] = Server(None, a.llama_model or a.model, args + ["-t", str(a.threads)] + a.llama_args.split(), cmd=[a.llama_server])
    try:
        body = lambda i: {"prompt": PROMPTS[i % len(PROMPTS)], "n_predict": a.n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
        # Each request alone, once, for the identity check.
        alone = {i: json.loads(post(servers["tine batched"].port, "/completion", body(i))[1])["tokens"] for i in range(max(counts))}
        rates = {(name, c): [] for name in servers for c in counts}
        # Each request's wall time (admission to answer), first-token time and the gaps between
        # the events that carried tokens, over every round (the requests stream).
        waits = {(name, c): [] for name in servers for c in counts}
        firsts = {(name, c): [] for name in servers for c in counts}
        gaps = {(name, c): [] for name in servers for c in counts}
        drafted = {name: [0, 0] for name in servers}
        same = True
        for r in range(a.rounds):
            for c in counts:
                # The servers' order turns each round, and each starts after a pause: a server
                # whose threads still spin after its run (llama.cpp's pool polls for a while) takes
                # no cores from the next one's first requests.
                names_now = list(servers)[r % len(servers):] + list(servers)[:r % len(servers)]
                for name in names_now:
                    srv = servers[name]
                    time.sleep(1.0)
                    out = [None] * c
                    took = [0.0] * c
                    def client(i):
                        t = time.time()
                        tokens, times, final = stream_post(srv.port, body(i))
                        took[i] = time.time() - t
                        out[i] = dict(final, tokens=tokens, times=times)
                    ts = [threading.Thread(target=client, args=(i,)) for i in range(c)]
                    t0 = time.time()
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                    wall = time.time() - t0
                    rates[(name, c)].append(sum(len(o["tokens"]) for o in out) / wall)
                    waits[(name, c)].extend(took)
                    for o in out:
                        ts = o["times"]
                        if ts:
                            firsts[(name, c)].append(ts[0])
                            gaps[(name, c)].extend(b - a for a, b in zip(ts, ts[1:]))
                    for o in out:
                        t = o.get("timings") or {}
                        drafted[name][0] += t.get("draft_n") or 0
                        drafted[name][1] += t.get("draft_n_accepted") or 0
                    if name.startswith("tine"):
                        same &= all(o["tokens"] == alone[i] for i, o in enumerate(out))
        extra = f" {a.tine_args}" if a.tine_args else ""
        lextra = f" {a.llama_args}" if a.llama_args else ""
        print(f"model {a.model}; tine serve --parallel {a.parallel}{extra}; clients each /completion of {a.n_predict} greedy tokens (ignore_eos); median of {a.rounds} interleaved rounds")
        if a.llama_server:
            print(f"llama-server -np {a.parallel} -t {a.threads}{lextra} on {a.llama_model or a.model}")
        names = list(servers)
        ratios = [f"batched / {n}" for n in names[1:]]
        print("| clients | " + " | ".join(f"{n} (tok/s)" for n in names) + " | " + " | ".join(ratios) + " |")
        print("|---|" + "---|" * (len(names) + len(ratios)))
        for c in counts:
            med = [statistics.median(rates[(n, c)]) for n in names]
            print(f"| {c} | " + " | ".join(f"{m:.1f}" for m in med) + " | " + " | ".join(f"{med[0] / m:.2f}x" for m in med[1:]) + " |")
        # Latency over every round: each request's wall time (p50 / p90 / max), its first token
        # (p50 / p99), the gaps between streamed tokens (p50 / p99; speculation streams a
        # round's tokens together, so its gaps are 0 or a round).
        print("\n| clients | " + " | ".join(f"{n} request s (p50 / p90 / max)" for n in names) + " |")
        print("|---|" + "---|" * len(names))
        for c in counts:
            print(f"| {c} | " + " | ".join(f"{pct(waits[(n, c)], 0.5):.2f} / {pct(waits[(n, c)], 0.9):.2f} / {max(waits[(n, c)]):.2f}" for n in names) + " |")
        print("\n| clients | " + " | ".join(f"{n} first token ms (p50 / p99)" for n in names) + " | " + " | ".join(f"{n} inter-token ms (p50 / p99)" for n in names) + " |")
        print("|---|" + "---|" * (2 * len(names)))
        for c in counts:
            ft = [f"{1e3 * pct(firsts[(n, c)], 0.5):.0f} / {1e3 * pct(firsts[(n, c)], 0.99):.0f}" if firsts[(n, c)] else "-" for n in names]
            it = [f"{1e3 * pct(gaps[(n, c)], 0.5):.1f} / {1e3 * pct(gaps[(n, c)], 0.99):.1f}" if gaps[(n, c)] else "-" for n in names]
            print(f"| {c} | " + " | ".join(ft + it) + " |")
        for n in names:
            if drafted[n][0]:
                print(f"{n}: drafted {drafted[n][0]}, accepted {drafted[n][1]} ({100 * drafted[n][1] / drafted[n][0]:.1f}%)")
        print(f"every Tine answer equal to the request alone: {same}")
    finally:
        for srv in servers.values():
            srv.stop()


def mixed(a):
    srv = Server(a.tine, a.model, ["--parallel", str(a.parallel), "-c", str(a.parallel * 4096)] + a.tine_args.split())
    long_prompt = ("The quick brown fox jumps over the lazy dog while the band plays on. " * 120)
    try:
        def body(i):
            b = {"prompt": PROMPTS[i % len(PROMPTS)] + f" (request {i})", "n_predict": (32, 96, 256, 160)[i % 4],
                 "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
            kind = i % 3
            if kind == 0:
                b.update(temperature=0)
            elif kind == 1:
                b.update(temperature=0.8, seed=1000 + i)
            else:
                b.update(temperature=0.8, seed=2000 + i, top_k=40, top_p=0.9)
            return b
        long_body = {"prompt": long_prompt, "n_predict": 64, "temperature": 0, "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
        n = a.requests
        alone = {i: stream_post(srv.port, body(i))[0] for i in range(n)}
        alone["long"] = stream_post(srv.port, long_body)[0]
        out, times = {}, {}

        def client(key, b, delay):
            time.sleep(delay)
            t, ts, _ = stream_post(srv.port, b)
            out[key], times[key] = t, ts
        ts = [threading.Thread(target=client, args=(i, body(i), 0.0)) for i in range(n)]
        # The long prompt arrives while the others decode.
        ts.append(threading.Thread(target=client, args=("long", long_body, a.long_after)))
        t0 = time.time()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        wall = time.time() - t0
        bad = [k for k in alone if out.get(k) != alone[k]]
        gaps = [b - x for k in times for x, b in zip(times[k], times[k][1:])]
        worst = max((max((b - x for x, b in zip(times[k], times[k][1:])), default=0.0), k) for k in times)
        print(f"mixed: {n} concurrent requests (greedy / seeded 0.8 / seeded top-k 40 top-p 0.9; 32..256 tokens) and a {len(long_prompt) // 4}-odd-token prompt after {a.long_after:.1f} s; tine serve --parallel {a.parallel} {a.tine_args}")
        print(f"generated {sum(len(v) for v in out.values())} tokens in {wall:.2f} s; inter-token ms p50 {1e3 * pct(gaps, 0.5):.1f} p99 {1e3 * pct(gaps, 0.99):.1f}; longest gap {1e3 * worst[0]:.0f} ms (request {worst[1]}); long prompt's first token {1e3 * times['long'][0]:.0f} ms" if times.get("long") else "no answer to the long prompt")
        print(f"every answer equal to the request alone: {not bad}" + (f" (differ: {bad})" if bad else ""))
    finally:
        srv.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tine", default="target/release/tine")
    p.add_argument("--model", default=os.path.expanduser("~/.cache/tine/models/gemma-3-270m-q4_k_m.gguf"))
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stall")
    s.add_argument("--ubatch", default="4096,512,128")
    s.add_argument("--tokens", type=int, default=160)
    s.add_argument("--prompt-chars", type=int, default=8000)
    l = sub.add_parser("load")
    l.add_argument("--connections", type=int, default=1000)
    l.add_argument("--parallel", type=int, default=4)
    l.add_argument("--max-queue", type=int, default=256)
    l.add_argument("--n-predict", type=int, default=8)
    c = sub.add_parser("clients")
    c.add_argument("--clients", default="1,2,4,8")
    c.add_argument("--parallel", type=int, default=8)
    c.add_argument("--n-predict", type=int, default=96)
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""), help="also llama.cpp's llama-server (-np P -t THREADS)")
    c.add_argument("--threads", type=int, default=os.cpu_count())
    c.add_argument("--tine-args", default="", help="more flags for both tine servers, e.g. '--spec-type draft-mtp'")
    c.add_argument("--llama-args", default="", help="more flags for llama-server, e.g. '--spec-type ngram-simple'")
    c.add_argument("--llama-model", default="", help="llama-server's GGUF, when not --model")
    m = sub.add_parser("mixed")
    m.add_argument("--requests", type=int, default=16)
    m.add_argument("--parallel", type=int, default=16)
    m.add_argument("--long-after", type=float, default=0.5, help="seconds before the long prompt arrives")
    m.add_argument("--tine-args", default="", help="more flags for tine serve, e.g. '--device cuda --spec-type ngram'")
    a = p.parse_args()
    {"stall": stall, "load": load, "clients": clients, "mixed": mixed}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
