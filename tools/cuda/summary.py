#!/usr/bin/env python3
"""Summarises a device job's $OUT: greedy ids CUDA vs CPU (the device's CPU path and the build
machine's reference), first-token latency cold/warm, prefill/decode, spec. Usage: summary.py OUT CPU_REF.jsonl"""
import glob, json, os, statistics, sys

out, ref_file = sys.argv[1], sys.argv[2]
load = lambda p: json.load(open(p)) if os.path.exists(p) else None
ref = {}
if os.path.exists(ref_file):
    for line in open(ref_file):
        if line.strip():
            d = json.loads(line)
            ref[d["index"]] = d


def agree(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


print("greedy ids (128 tokens, temperature 0, ignore_eos):")
for i in range(1, 100):
    g, c = load(f"{out}/greedy-{i}-cuda.json"), load(f"{out}/greedy-{i}-cpu.json")
    if g is None and c is None:
        break
    if g is None or c is None:
        print(f"  prompt {i}: missing ({'cuda' if g is None else 'cpu'} run failed)")
        continue
    r = ref.get(i)
    rr = f", cuda = build-machine cpu for {agree(g['ids'], r['ids'])}/{len(r['ids'])}" if r else ""
    dc = f", device cpu = build-machine cpu for {agree(c['ids'], r['ids'])}" if r else ""
    print(f"  prompt {i}: cuda = device cpu for {agree(g['ids'], c['ids'])}/{len(c['ids'])}{rr}{dc}; cuda decode {g['predicted_per_second']:.1f} tok/s, cpu {c['predicted_per_second']:.1f} tok/s")
for run in ("cold", "warm", "nocache", "ptx-nocache"):
    f = load(f"{out}/first-{run}.json")
    if f:
        print(f"first token ({run} JIT cache): {f['first_token_ms']:.1f} ms (prompt {f['prompt_n']} tokens in {f['prompt_ms']:.1f} ms)")
sp = [load(p) for p in sorted(glob.glob(f"{out}/speed-[0-9].json"))]
sp = [s for s in sp if s]
if sp:
    print(f"generate, {sp[0]['prompt_n']}-token prompt + 512: prefill median {statistics.median(s['prompt_per_second'] for s in sp):.1f} tok/s, decode median {statistics.median(s['predicted_per_second'] for s in sp):.1f} tok/s, first token {statistics.median(s['first_token_ms'] for s in sp):.1f} ms ({len(sp)} runs)")
s = load(f"{out}/speed-short.json")
if s:
    print(f"generate, short prompt + 512: decode {s['predicted_per_second']:.1f} tok/s")
# Argmax on the GPU (the default for greedy) against every row copied to the host.
for label, dev, host in (("1760-token prompt", "speed-[0-9].json", "speed-host-argmax-[0-9].json"), ("short prompt", "speed-short-[0-9].json", "speed-short-host-argmax-[0-9].json")):
    a = [x for x in (load(p) for p in sorted(glob.glob(f"{out}/{dev}"))) if x]
    b = [x for x in (load(p) for p in sorted(glob.glob(f"{out}/{host}"))) if x]
    if a and b:
        ma, mb = (statistics.median(x["predicted_per_second"] for x in v) for v in (a, b))
        print(f"greedy decode, {label} + 512: argmax on the GPU {ma:.1f} tok/s, rows to the host {mb:.1f} tok/s ({ma / mb:.3f}x; medians of {len(a)}/{len(b)}); same ids: {all(x['ids'] == a[0]['ids'] for x in a + b)}")
for t in ("draft-mtp", "draft-assistant", "ngram"):
    s = load(f"{out}/spec-{t}.json")
    if s:
        tau = 1 + s["draft_n_accepted"] / max(1, s["draft_verify_steps"])
        print(f"spec {t}: decode {s['predicted_per_second']:.1f} tok/s, accepted {s['draft_n_accepted']}/{s['draft_n']}, tau {tau:.2f}")
e = load(f"{out}/logit-equiv.json")
if e:
    for r in e["results"]:
        print(f"logit-equiv {r['spec_type']:<16} depth {r['depth']}: real_frac {r['real_frac']:.4f}, max |dlogit| {r['max_abs_logit_diff']:.3e}, greedy identical {r['greedy_identical_prompts']}/{r['prompts']}, exact {r['exact']}")
s = load(f"{out}/serve.json")
if s:
    print(f"serve /completion: prefill median {s['prefill_tps_median']:.1f} tok/s, decode median {s['decode_tps_median']:.1f} tok/s; chat {s['chat']!r}")
