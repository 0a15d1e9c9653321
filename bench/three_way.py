#!/usr/bin/env python3
"""Three-way throughput benchmark: Tine vs stock candle vs llama.cpp, on the same machine, in one run.

For each round, each engine runs once (interleaved, so machine noise hits all of them alike):
  - prefill of a ~1800-token prompt, then 512 greedy decode tokens with EOS ignored;
  - peak RSS of the process (wait4's ru_maxrss).
Reports medians over the rounds and ratios taken within this run, and writes a Markdown table.

Engines:
  tine   target/release/tine generate (built by `cargo build --release -p tine-cli`)
  stock  target/stock-candle/release/stock-candle-bench: pristine candle 0.11.0's quantized_gemma3
         loop (bench/stock-candle, built with the same rustflags)
  llama  llama.cpp's llama-bench (tools/build_llama_cpp.sh), -t 2, pp N / tg 512

Usage: bench/three_way.py [--rounds 3] [--out docs/evaluations/engine-speed-run.md]
"""
import argparse, json, os, re, statistics, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(os.environ.get("TINE_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tine"), "models", "gemma-3-270m-q4_k_m.gguf")
PARAGRAPH = ("The history of the lighthouse is a story of engineering, commerce and solitude. "
             "Early beacons were open fires on hilltops; later, towers of stone carried oil lamps, "
             "then mirrors and Fresnel lenses that threw a beam for miles across the water. ")


def run(cmd):
    """Runs cmd; returns (stdout+stderr text, peak RSS in MiB, wall seconds)."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.read().decode(errors="replace")
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        sys.exit(f"{cmd[0]} failed ({status}):\n{out[-2000:]}")
    return out, ru.ru_maxrss / 1024.0, time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--decode", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/evaluations/engine-speed-run.md"))
    ap.add_argument("--skip", default="", help="comma-separated engines to leave out")
    a = ap.parse_args()
    tine = os.path.join(ROOT, "target/release/tine")
    stock = os.path.join(ROOT, "target/stock-candle/release/stock-candle-bench")
    llama_bin = subprocess.run([os.path.join(ROOT, "tools/build_llama_cpp.sh")], capture_output=True, text=True, check=True).stdout.strip()
    llama_bench = os.path.join(llama_bin, "llama-bench")
    for path in (tine, stock, llama_bench, MODEL):
        if not os.path.exists(path):
            sys.exit(f"missing {path}")

    # A prompt of exactly --prompt-tokens tokens (Tine's tokenizer equals llama.cpp's on it).
    text = PARAGRAPH * 60
    ids = json.loads(subprocess.run([tine, "tokenize", "-m", MODEL, "-p", text], capture_output=True, text=True, check=True).stdout)
    ids = ids[: a.prompt_tokens]
    ids_path = os.path.join(ROOT, "target/bench-prompt-ids.json")
    with open(ids_path, "w") as f:
        json.dump(ids, f)
    skip = set(filter(None, a.skip.split(",")))
    results = {k: {"pp": [], "tg": [], "rss": []} for k in ("tine", "stock", "llama") if k not in skip}
    n = len(ids)
    for r in range(a.rounds):
        for engine in list(results):
            if engine == "tine":
                out, rss, _ = run([tine, "generate", "-m", MODEL, "--prompt-ids", ids_path, "-n", str(a.decode), "--temp", "0", "--ignore-eos", "-c", "4096"])
                m = re.search(r"prompt: (\d+) tokens in ([\d.]+) ms .*generated: (\d+) tokens in ([\d.]+) ms", out)
                pp, tg = int(m.group(1)) / float(m.group(2)) * 1e3, int(m.group(3)) / float(m.group(4)) * 1e3
            elif engine == "stock":
                out, rss, _ = run([stock, MODEL, ids_path, str(a.decode)])
                j = json.loads(out.strip().splitlines()[-1])
                pp, tg = j["prompt_n"] / j["prompt_ms"] * 1e3, j["predicted_n"] / j["predicted_ms"] * 1e3
            else:
                out, rss, _ = run([llama_bench, "-m", MODEL, "-t", "2", "-p", str(n), "-n", str(a.decode), "-r", "1", "-o", "json"])
                rows = json.loads(out[out.index("["):])
                pp = next(x["avg_ts"] for x in rows if x["n_prompt"] > 0)
                tg = next(x["avg_ts"] for x in rows if x["n_gen"] > 0)
            results[engine]["pp"].append(pp)
            results[engine]["tg"].append(tg)
            results[engine]["rss"].append(rss)
            print(f"round {r + 1}: {engine:5} prefill {pp:8.1f} tok/s  decode {tg:7.1f} tok/s  peak RSS {rss:7.0f} MiB", flush=True)

    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in results.items()}
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
    lines = [
        f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {os.cpu_count()} cores ({cpu}).",
        f"Model: Gemma 3 270M Q4_K_M; prompt {n} tokens, {a.decode} greedy decode tokens (EOS ignored); {a.rounds} interleaved rounds, medians.",
        "",
        "| engine | prefill tok/s | decode tok/s | peak RSS MiB |",
        "|---|---|---|---|",
    ]
    names = {"tine": "Tine", "stock": "stock candle 0.11.0", "llama": "llama.cpp (llama-bench, -t 2)"}
    for k, v in med.items():
        lines.append(f"| {names[k]} | {v['pp']:.1f} | {v['tg']:.1f} | {v['rss']:.0f} |")
    lines.append("")
    for other in ("stock", "llama"):
        if "tine" in med and other in med:
            lines.append(f"Tine / {names[other]}: prefill {med['tine']['pp'] / med[other]['pp']:.2f}x, decode {med['tine']['tg'] / med[other]['tg']:.2f}x, peak RSS {med['tine']['rss'] / med[other]['rss']:.2f}x.")
    lines.append("")
    lines.append("Per-round figures:")
    lines.append("")
    for k, v in results.items():
        lines.append(f"- {names[k]}: prefill {', '.join(f'{x:.1f}' for x in v['pp'])}; decode {', '.join(f'{x:.1f}' for x in v['tg'])}; RSS {', '.join(f'{x:.0f}' for x in v['rss'])}")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
