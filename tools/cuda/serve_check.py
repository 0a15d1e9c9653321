#!/usr/bin/env python3
"""tine serve --device cuda, checked and timed the three-way way: POST /completion with a
~1760-token prompt as token ids, n_predict 512, ignore_eos, temperature 0, no prompt cache; three
rounds; then one /v1/chat/completions request. Usage: serve_check.py URL PROMPT_IDS.json OUT.json"""
import json, statistics, sys, time, urllib.error, urllib.request


def post(url, body, timeout=300):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main():
    url, ids_file, out = sys.argv[1:4]
    t0 = time.time()
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.time() - t0 > 120:
            sys.exit("server not healthy after 120 s")
        time.sleep(0.3)
    ids = json.load(open(ids_file))
    rounds = []
    for r in range(3):
        j = post(url + "/completion", {"prompt": ids, "n_predict": 512, "ignore_eos": True, "temperature": 0, "cache_prompt": False, "seed": 42})
        t = j["timings"]
        tg = (t["predicted_n"] - 1) / t["predicted_ms"] * 1e3
        rounds.append({"prompt_n": t["prompt_n"], "prefill_tps": t["prompt_per_second"], "decode_tps": tg, "predicted_n": t["predicted_n"], "tokens": j.get("tokens")})
        print(f"serve round {r + 1}: prompt {t['prompt_n']} tokens, prefill {t['prompt_per_second']:.1f} tok/s, decode {tg:.1f} tok/s", flush=True)
    chat = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0})
    text = chat["choices"][0]["message"]["content"]
    print(f"chat: {text!r}")
    doc = {"rounds": rounds, "prefill_tps_median": statistics.median(r["prefill_tps"] for r in rounds),
           "decode_tps_median": statistics.median(r["decode_tps"] for r in rounds), "chat": text}
    json.dump(doc, open(out, "w"))
    print(f"serve medians: prefill {doc['prefill_tps_median']:.1f} tok/s, decode {doc['decode_tps_median']:.1f} tok/s")


if __name__ == "__main__":
    main()
