#!/usr/bin/env python3
"""Three-way throughput: Tine vs stock candle vs llama.cpp, each behind the same HTTP API.

Every engine serves llama-server's `POST /completion` and reports llama-server's `timings`:
  tine   target/release/tine serve (spec off)
  stock  target/stock-candle/release/stock-candle-bench: the pristine pinned candle's quantized_gemma3
         loop behind a minimal /completion (bench/stock-candle)
  llama  $LLAMA_SERVER (llama.cpp's llama-server, built by the user), -t <cores>; left out with a
         note when LLAMA_SERVER is unset
All three start once and stay up; each round asks every engine for both prompts in turn
(interleaved), so machine noise hits all of them alike. A prompt is a ~1760-token reference
prefix plus a question, sent as token ids (Tine's tokenizer equals llama.cpp's; stock candle has
none); `n_predict` 512 with `ignore_eos`, temperature 0, no prompt cache. Reports medians of
prompt_per_second (prefill) and (predicted_n - 1) / predicted_ms (decode) and ratios within this run.
Writes a Markdown report and an SVG chart.
"""
import argparse, json, os, statistics, subprocess, sys, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from svg import bar_chart  # noqa: E402
from spec_http import ServerDied, post, wait_healthy  # noqa: E402

PARAGRAPH = ("The history of the lighthouse is a story of engineering, commerce and solitude. "
             "Early beacons were open fires on hilltops; later, towers of stone carried oil lamps, "
             "then mirrors and Fresnel lenses that threw a beam for miles across the water. ")
QUESTIONS = ["\n\nQuestion: how did lighthouse technology change over time? Answer in detail.\nAnswer:",
             "\n\nWrite a short story about a keeper who tends one of these lights through a winter storm.\n"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tine", default=os.path.join(ROOT, "target/release/tine"))
    ap.add_argument("--stock", default=os.path.join(ROOT, "target/stock-candle/release/stock-candle-bench"))
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=1760)
    ap.add_argument("--n-predict", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/evaluations/three-way-tps.md"))
    ap.add_argument("--command", default="bench/three_way.py")
    ap.add_argument("--no-stock", action="store_true", help="leave stock candle out (a model its pinned base does not run, e.g. qwen35)")
    ap.add_argument("--model-name", default="Gemma 3 270M Q4_K_M", help="the model's name in the report")
    ap.add_argument("--also", action="append", default=[], metavar="LABEL=KIND:PATH",
                    help="another engine in the same run: KIND is tine or stock, PATH its binary (e.g. builds on the previous base)")
    a = ap.parse_args()
    threads = str(os.cpu_count())
    ids = lambda text, bos: json.loads(subprocess.run([a.tine, "tokenize", "-m", a.model, "-p", text] + ([] if bos else ["--no-bos"]), capture_output=True, text=True, check=True).stdout)
    prefix = ids(PARAGRAPH * 60, True)[: a.prefix_tokens]
    prompts = [prefix + ids(q, False) for q in QUESTIONS]
    engines = {
        "tine": [a.tine, "serve", "-m", a.model, "--host", "127.0.0.1", "--port", "{port}", "-c", "4096", "--parallel", "1"],
        "stock": [a.stock, a.model, "--port", "{port}"],
    }
    notes = []
    if a.no_stock:
        del engines["stock"]
        notes.append("stock candle was left out (--no-stock): its pinned base does not run this model.")
    if a.llama_server:
        engines["llama"] = [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port", "{port}", "-c", "4096", "-t", threads, "-tb", threads, "-np", "1", "--no-webui"]
    else:
        notes.append("llama.cpp was left out: LLAMA_SERVER is not set (build llama.cpp's llama-server and set LLAMA_SERVER=/path/to/llama-server).")
    names = {"tine": "Tine (full chain)", "stock": "stock candle (pinned base)", "llama": "llama.cpp llama-server"}
    for i, spec in enumerate(a.also):
        label, _, rest = spec.partition("=")
        kind, _, path = rest.partition(":")
        if kind not in engines or kind not in ("tine", "stock") or not label or not path:
            sys.exit(f"--also {spec!r}: expected LABEL=tine:PATH or LABEL=stock:PATH")
        key = f"also{i}"
        engines[key] = [path if j == 0 else c for j, c in enumerate(engines[kind])]
        names[key] = label
    log_dir = os.path.join(ROOT, "target/bench-three-way")
    os.makedirs(log_dir, exist_ok=True)
    procs, urls = {}, {}
    try:
        for i, (k, cmd) in enumerate(engines.items()):
            port = 18300 + i
            cmd = [c.replace("{port}", str(port)) for c in cmd]
            if not os.path.exists(cmd[0]):
                sys.exit(f"missing {cmd[0]}")
            procs[k] = subprocess.Popen(cmd, stdout=open(os.path.join(log_dir, f"{k}.log"), "w"), stderr=subprocess.STDOUT, start_new_session=True)
            urls[k] = f"http://127.0.0.1:{port}"
        for k in engines:
            try:
                wait_healthy(urls[k], procs[k])
            except ServerDied as e:
                sys.exit(f"{k}: {e} (log: {log_dir}/{k}.log)")
        res = {k: {"pp": [], "tg": []} for k in engines}
        for r in range(a.rounds):
            for k in engines:
                for p_i, p in enumerate(prompts):
                    j = post(urls[k] + "/completion", {"prompt": p, "n_predict": a.n_predict, "ignore_eos": True, "temperature": 0, "cache_prompt": False, "seed": 42})
                    t = j["timings"]
                    if t["predicted_n"] != a.n_predict:
                        sys.exit(f"{k} generated {t['predicted_n']} tokens, not {a.n_predict}")
                    res[k]["pp"].append(t["prompt_per_second"])
                    # One formula for every engine: the first token comes from the prompt pass, so
                    # the decode time covers the other predicted_n - 1 (servers differ on this).
                    tg = (t["predicted_n"] - 1) * 1000.0 / t["predicted_ms"]
                    res[k]["tg"].append(tg)
                    print(f"round {r + 1}/{a.rounds} {k:5} prompt {p_i + 1} ({t['prompt_n']} tokens): prefill {t['prompt_per_second']:.1f} tok/s, decode {tg:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
            p.wait()
    med = {k: {m: statistics.median(v) for m, v in res[k].items()} for k in res}
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
    lines = ["# Three-way throughput: Tine, stock candle, llama.cpp\n",
             f"Generated by `{a.command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {os.cpu_count()} cores ({cpu}).\n",
             f"Model: {a.model_name} (`{os.path.basename(a.model)}`). Each engine behind `POST /completion`; prompts of {len(prompts[0])} and {len(prompts[1])} tokens "
             f"(a {len(prefix)}-token reference prefix plus a question), `n_predict` {a.n_predict} with `ignore_eos`, temperature 0, no prompt cache; "
             f"{a.rounds} interleaved rounds x 2 prompts, medians of the servers' own `timings.prompt_per_second` and of `(predicted_n - 1) / predicted_ms` (the first token comes from the prompt pass).\n",
             "| engine | prefill tok/s | decode tok/s |", "|---|---|---|"]
    for k in med:
        lines.append(f"| {names[k]} | {med[k]['pp']:.1f} | {med[k]['tg']:.1f} |")
    lines.append("")
    for other in ["stock", "llama"] + [k for k in med if k.startswith("also")]:
        if other in med:
            lines.append(f"- Tine / {names[other]}: prefill {med['tine']['pp'] / med[other]['pp']:.2f}x, decode {med['tine']['tg'] / med[other]['tg']:.2f}x.")
    lines += [f"- {n}" for n in notes]
    lines += ["", "Every measurement (prefill; decode), in order:", ""]
    for k in res:
        lines.append(f"- {names[k]}: {', '.join(f'{p:.1f}; {t:.1f}' for p, t in zip(res[k]['pp'], res[k]['tg']))}")
    svg = os.path.splitext(a.out)[0] + ".svg"
    lines += ["", f"![prefill and decode tok/s]({os.path.basename(svg)})", ""]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines))
    keys = list(med)
    with open(svg, "w") as f:
        f.write(bar_chart(f"{a.model_name}: throughput (medians, one run)", ["prefill", "decode"], [names[k] for k in keys],
                          [[med[k]["pp"], med[k]["tg"]] for k in keys], unit="tokens/s"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
