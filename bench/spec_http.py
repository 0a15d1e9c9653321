#!/usr/bin/env python3
"""The 9-prompt speculative-decoding bench against any server that speaks llama-server's API.

Each server runs the seeds' nine prompts (bench/prompts/mtp9.json, wrapped in Gemma's chat turn),
`n_predict` 192, temperature 0, seed 42. For every prompt and round it asks for the same completion
at every depth, interleaved: depth 0 (`"speculative.n_max": 0`, spec off) and each depth d
(`"speculative.n_max": d`). It reads `timings.predicted_per_second`, `timings.draft_n` and
`timings.draft_n_accepted` the same way for every engine:
  accept = sum(draft_n_accepted) / sum(draft_n)
  tau    = tokens per target forward = predicted_n / (predicted_n - draft_n_accepted)
  speedup = median tok/s at depth d / median tok/s at depth 0, same server, same run.
Greedy identity: the text at depth d equals the text at depth 0 for the same prompt.

A server is `label=command` (started here, `{port}` substituted, stopped after) or `label=URL`.
Writes a Markdown report and an SVG chart.
"""
import argparse, json, os, statistics, subprocess, sys, time, urllib.error, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from svg import bar_chart  # noqa: E402

TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class ServerDied(Exception):
    pass


def wait_healthy(url, proc, seconds=180):
    t0 = time.time()
    while time.time() - t0 < seconds:
        if proc is not None and proc.poll() is not None:
            raise ServerDied(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    raise ServerDied(f"{url} not healthy after {seconds}s")


def bench_server(label, target, prompts, depths, rounds, n_predict, port, log_dir, fixed=False):
    """`fixed`: the server's own speculative setting, asked for once per prompt (no
    `speculative.n_max`); llama.cpp's n-gram types ignore the per-request depth."""
    proc = None
    if target.startswith("http"):
        url = target.rstrip("/")
    else:
        url = f"http://127.0.0.1:{port}"
        log = open(os.path.join(log_dir, f"server-{label}.log"), "w")
        proc = subprocess.Popen(target.format(port=port), shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rows = []
    try:
        wait_healthy(url, proc)
        # One warm-up request (page cache, thread pools).
        post(url + "/completion", {"prompt": TURN.format("Hello"), "n_predict": 8, "temperature": 0, "seed": 42})
        for r in range(rounds):
            for name, text in prompts:
                for d in ([0] if fixed else [0] + depths):
                    body = {"prompt": TURN.format(text), "n_predict": n_predict, "temperature": 0, "seed": 42, "cache_prompt": False}
                    if not fixed:
                        body["speculative.n_max"] = d
                    j = post(url + "/completion", body)
                    t = j.get("timings", {})
                    rows.append({"server": label, "round": r, "prompt": name, "depth": d, "tps": t.get("predicted_per_second"), "predicted_n": t.get("predicted_n", 0),
                                 "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0), "content": j.get("content", "")})
                    print(f"  {label} round {r + 1}/{rounds} {name} d{d}: {t.get('predicted_per_second', 0):.1f} tok/s, drafts {t.get('draft_n', 0)}/{t.get('draft_n_accepted', 0)}", file=sys.stderr)
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, 15)
            except ProcessLookupError:
                pass
            proc.wait()
    return rows


def summarize(rows, label, depths, prompts, base_text=None):
    out = {}
    if base_text is None:
        base_text = {(r["prompt"]): r["content"] for r in rows if r["server"] == label and r["depth"] == 0 and r["round"] == 0}
    for d in [0] + depths:
        rs = [r for r in rows if r["server"] == label and r["depth"] == d]
        dn = sum(r["draft_n"] for r in rs)
        da = sum(r["draft_n_accepted"] for r in rs)
        pn = sum(r["predicted_n"] for r in rs)
        per_prompt = {}
        for name, _ in prompts:
            pr = [r for r in rs if r["prompt"] == name]
            p_dn, p_da, p_pn = sum(r["draft_n"] for r in pr), sum(r["draft_n_accepted"] for r in pr), sum(r["predicted_n"] for r in pr)
            per_prompt[name] = {"tps": statistics.median([r["tps"] for r in pr]), "accept": p_da / p_dn if p_dn else 0.0, "tau": p_pn / max(p_pn - p_da, 1),
                                "identical": all(r["content"] == base_text.get(name) for r in pr)}
        # Aggregate decode speed: the median over rounds of each round's total tokens / total time.
        per_round = []
        for r_i in sorted({r["round"] for r in rs}):
            rr = [r for r in rs if r["round"] == r_i]
            secs = sum(r["predicted_n"] / r["tps"] for r in rr if r["tps"])
            per_round.append(sum(r["predicted_n"] for r in rr) / secs if secs else 0.0)
        out[d] = {"tps": statistics.median(per_round), "accept": da / dn if dn else 0.0, "tau": pn / max(pn - da, 1), "draft_n": dn, "draft_n_accepted": da,
                  "identical": sum(p["identical"] for p in per_prompt.values()), "per_prompt": per_prompt}
    for d in [0] + depths:
        out[d]["speedup"] = out[d]["tps"] / out[0]["tps"] if out[0]["tps"] else 0.0
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, help="label=command-with-{port} or label=URL (repeatable)")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-predict", type=int, default=192)
    ap.add_argument("--port", type=int, default=18181)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/evaluations/mtp.md"))
    ap.add_argument("--command", default="", help="the command line to record in the report")
    ap.add_argument("--machine", default="", help="machine description to record")
    ap.add_argument("--notes", default="", help="a Markdown file appended to the report (what the tables do not say)")
    a = ap.parse_args()
    depths = [int(x) for x in a.depths.split(",") if x]
    prompts = [(p["name"], p["text"]) for p in json.load(open(os.path.join(ROOT, "bench/prompts/mtp9.json")))["prompts"]]
    log_dir = os.path.join(ROOT, "target/bench-spec")
    os.makedirs(log_dir, exist_ok=True)
    # `base:LABEL=...` is a spec-off server and `fixed:LABEL=...` one with its own setting that
    # ignores `speculative.n_max` (llama.cpp's n-gram types); a fixed server's speedup is over the
    # base server's tok/s, measured in the same run.
    servers, kinds = [], {}
    for spec in a.server:
        label, target = spec.split("=", 1)
        kind = ""
        for k in ("base:", "fixed:"):
            if label.startswith(k):
                kind, label = k[:-1], label[len(k):]
        servers.append((label, target))
        kinds[label] = kind
    rows, failed = [], []
    for i, (label, target) in enumerate(servers):
        # A port per server: a stopped server's socket may linger.
        try:
            rows += bench_server(label, target, prompts, depths, a.rounds, a.n_predict, a.port + i, log_dir, fixed=bool(kinds[label]))
        except (ServerDied, urllib.error.URLError, OSError) as e:
            print(f"{label}: left out: {e} (log: {log_dir})", file=sys.stderr)
            failed.append((label, str(e)))
        with open(os.path.join(log_dir, "rows.json"), "w") as f:
            json.dump(rows, f)
    servers = [(l, t) for l, t in servers if l not in {f for f, _ in failed}]
    base = next((l for l, _ in servers if kinds[l] == "base"), None)
    base_text = {r["prompt"]: r["content"] for r in rows if r["server"] == base and r["round"] == 0} if base else None
    summary = {}
    for label, _ in servers:
        if kinds[label]:
            s0 = summarize(rows, label, [], prompts, base_text)
            if base and kinds[label] == "fixed":
                b = summarize(rows, base, [], prompts)
                s0[0]["speedup"] = s0[0]["tps"] / b[0]["tps"]
                for name, pp in s0[0]["per_prompt"].items():
                    pp["base_tps"] = b[0]["per_prompt"][name]["tps"]
            summary[label] = s0
        else:
            summary[label] = summarize(rows, label, depths, prompts)
    plain = [l for l, _ in servers if not kinds[l]]
    fixed = [l for l, _ in servers if kinds[l] == "fixed"]

    md = [f"# Speculative decoding: the 9-prompt bench\n",
          f"Generated by `{a.command or 'bench/spec_http.py'}`.\n",
          f"Machine: {a.machine or 'not recorded'}. Each server runs alone; within a server every depth of a prompt is asked for back to back (interleaved), "
          f"{a.rounds} round(s), `n_predict` {a.n_predict}, temperature 0, seed 42, the prompt wrapped in Gemma's chat turn. "
          "Depth 0 is the same server with `speculative.n_max` 0 (spec off). accept = draft_n_accepted / draft_n; "
          "tau = tokens per target forward = predicted_n / (predicted_n - draft_n_accepted); tok/s = the median over rounds of all nine prompts' tokens / time; "
          "speedup = tok/s at the depth over tok/s at depth 0 of the same server in the same run; identical = prompts whose text equals depth 0's.\n",
          *[f"- {l} was left out: {why}\n" for l, why in failed],
          "## Aggregate\n", "| server | depth | accept | tau | decode tok/s | speedup | identical |", "|---|---|---|---|---|---|---|"]
    for label, _ in servers:
        for d in ([0] if kinds[label] else [0] + depths):
            s = summary[label][d]
            dl = {"base": "spec off", "fixed": "its own"}.get(kinds[label], str(d))
            md.append(f"| {label} | {dl} | {s['accept']:.3f} | {s['tau']:.2f} | {s['tps']:.1f} | {s['speedup']:.2f}x | {s['identical']}/{len(prompts)} |")
    if fixed:
        md.append(f"\nServers marked *its own* ignore `speculative.n_max` (llama.cpp's n-gram types draft as their own parameters say); their speedup is over `{base}` (spec off), measured in this run, and *identical* compares their text with it.\n")
    for label in plain:
        best = max(depths, key=lambda d: summary[label][d]["speedup"]) if depths else 0
        md += [f"\n## {label}, per prompt (depth {best}, its best)\n", "| prompt | accept | tau | tok/s | spec-off tok/s | speedup | identical |", "|---|---|---|---|---|---|---|"]
        for name, _ in prompts:
            p, p0 = summary[label][best]["per_prompt"][name], summary[label][0]["per_prompt"][name]
            md.append(f"| {name} | {p['accept']:.3f} | {p['tau']:.2f} | {p['tps']:.1f} | {p0['tps']:.1f} | {p['tps'] / p0['tps']:.2f}x | {'yes' if p['identical'] else 'NO'} |")
    for label in fixed:
        md += [f"\n## {label}, per prompt\n", "| prompt | accept | tau | tok/s | spec-off tok/s | speedup | identical |", "|---|---|---|---|---|---|---|"]
        for name, _ in prompts:
            pp = summary[label][0]["per_prompt"][name]
            md.append(f"| {name} | {pp['accept']:.3f} | {pp['tau']:.2f} | {pp['tps']:.1f} | {pp['base_tps']:.1f} | {pp['tps'] / pp['base_tps']:.2f}x | {'yes' if pp['identical'] else 'NO'} |")
    svg_path = os.path.splitext(a.out)[0] + ".svg"
    md.append(f"\n![speedup by depth]({os.path.basename(svg_path)})\n")
    if a.notes:
        with open(a.notes) as f:
            md.append(f.read())
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(md) + "\n")
    with open(svg_path, "w") as f:
        groups = plain + fixed
        series = [f"depth {d}" for d in depths] + (["its own setting"] if fixed else [])
        values = [[summary[l][d]["speedup"] if l in plain else None for l in groups] for d in depths]
        if fixed:
            values.append([summary[l][0]["speedup"] if l in fixed else None for l in groups])
        f.write(bar_chart("Decode speedup over spec off (9 prompts, greedy)", groups, series, values, unit="x spec-off tok/s", baseline=1.0))
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump({"summary": {l: {str(d): {k: v for k, v in s.items() if k != "per_prompt"} for d, s in summary[l].items()} for l, _ in servers}, "rows": [{k: v for k, v in r.items() if k != "content"} for r in rows]}, f, indent=1)
    print("\n".join(md))


if __name__ == "__main__":
    main()
