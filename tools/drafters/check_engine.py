#!/usr/bin/env python3
"""Check a trained NextN head in the engine against the PyTorch forward (CPU).

For each prompt: run `tine generate --spec-type draft-mtp --temp 0` on the grafted GGUF, read its
acceptance line, re-tokenize the engine's text, and replay the engine's rounds offline with the
PyTorch head (full vocabulary, Q8_0 weights) along that same token sequence. If the head's forward
matches the engine's, the two acceptance counts agree up to the rare spots where the engine's
quantized trunk and the bf16/fp32 PyTorch trunk disagree.

    python3 tools/drafters/check_engine.py --model TARGET.gguf --grafted GRAFTED.gguf --head drafters/gemma3-270m-nextn.gguf \
        [--prompts-json OUT/prompts.json --which heldout --n 8] [-n 128]
"""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import export as X  # noqa: E402
from heads import rms  # noqa: E402
from heads import AssistantHead, NextNHead, shift_right  # noqa: E402
from pipeline import Target, head_inputs, make_batch  # noqa: E402
from spm import SpmTokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--grafted", required=True)
    ap.add_argument("--head", required=True, help="the head GGUF as shipped (NextN head-only, or assistant)")
    ap.add_argument("--kind", choices=["nextn", "assistant"], default="nextn")
    ap.add_argument("--engine-head", default=None, help="assistant: the GGUF the engine loads (e.g. a full-vocabulary copy "
                    "from export.full_vocab_assistant, for engines without draft_vocab support)")
    ap.add_argument("--tine", default=os.path.join(HERE, "..", "..", "target", "release", "tine"))
    ap.add_argument("--prompts-json", default=None)
    ap.add_argument("--which", default="heldout")
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--subset", action="store_true", help="score the draft vocabulary subset only (the engine needs draft_vocab support)")
    a = ap.parse_args()
    tok = SpmTokenizer.from_gguf(a.model)
    if a.prompts_json and a.which == "train-greedy":
        # prompts whose greedy continuation was in the training data (train_tokens.json beside prompts.json)
        pj = json.load(open(a.prompts_json))
        tt = json.load(open(os.path.join(os.path.dirname(a.prompts_json), "train_tokens.json")))
        by_ids = {tuple(x["ids"]): x["text"] for x in pj["train"]}
        prompts = [by_ids[tuple(s[:pl])] for s, pl, t in zip(tt["seqs"], tt["plens"], tt["temps"]) if t == 0][: a.n]
    elif a.prompts_json:
        items = json.load(open(a.prompts_json))[a.which][: a.n]
        prompts = [x["text"] for x in items]
    else:
        prompts = ["The history of the Roman Empire", "<start_of_turn>user\nWrite a Python function that checks whether a number is prime.<end_of_turn>\n<start_of_turn>model\n"]
    dev = torch.device("cpu")
    tgt = Target(a.model, dev, torch.float32)
    kw = dict(n_head=tgt.cfg.num_attention_heads, n_kv=tgt.cfg.num_key_value_heads, hd=tgt.hd, ff=tgt.cfg.intermediate_size)
    if a.kind == "nextn":
        nextn = NextNHead(tgt.d, window=tgt.window, rope_base=tgt.local_base, **kw)
        vocab_ids = X.load_nextn_gguf(nextn, a.head)
        W = tgt.E[torch.as_tensor(vocab_ids)] if a.subset else tgt.E
        spec = ["--spec-type", "draft-mtp"]
    else:
        import gguf

        k = int(gguf.GGUFReader(a.head).fields["gemma4-assistant.draft_vocab_size"].contents())
        asst = AssistantHead(tgt.d, tgt.d, k_vocab=k, window=tgt.window, rope_base=tgt.local_base, **kw)
        vocab_ids = X.load_assistant_gguf(asst, a.head)
        spec = ["--spec-type", "draft-assistant", "--mtp-head", a.engine_head or a.head]
    tot = {"eng_drafted": 0, "eng_accepted": 0, "sim_drafted": 0, "sim_accepted": 0}
    for p in prompts:
        r = subprocess.run([a.tine, "generate", "-m", a.grafted, *spec, "--spec-draft-n-max", str(a.draft_max),
                            "-p", p, "-n", str(a.n_predict), "--temp", "0"], capture_output=True, text=True)
        m = re.search(r"drafted (\d+) accepted (\d+)", r.stderr)
        if not m:
            print("engine output without stats:", r.stderr[-500:])
            continue
        ed, ea = int(m.group(1)), int(m.group(2))
        text = r.stdout
        if text.endswith("\n") and not text.endswith("\n\n"):
            text = text[:-1]  # tine prints a newline after the text
        pids = tok.encode(p)
        ids = tok.encode(text)
        if ids[: len(pids)] != pids:
            print("prompt re-tokenization differs; skipping")
            continue
        data = tgt.teacher_forced([ids], 1 << 20)
        batch = make_batch(data, np.array([0]))
        t = torch.tensor(ids)
        L, pl = len(ids), len(pids)
        # C[s][j]: the depth-s draft for the token at j+1 equals the sequence's token
        C = [torch.zeros(L, dtype=torch.bool) for _ in range(a.draft_max)]
        with torch.no_grad():
            emb, emb_next = head_inputs(tgt, batch)
            if a.kind == "nextn":
                outs = nextn.unroll(emb_next, batch["H"], a.draft_max)
                # NextN entry i (row i+1) predicts t_{i+2}
                D = [F.linear(o[0], W).argmax(-1) for o in outs]
                if a.subset:
                    D = [torch.as_tensor(vocab_ids)[d] for d in D]
                for s in range(a.draft_max):
                    C[s][1:L - 1] = D[s][: L - 2] == t[2:L]
            else:
                outs = asst.unroll(emb, shift_right(batch["H"]), batch["K"][:, None], batch["V"][:, None], a.draft_max)
                # assistant query q (row q) predicts t_{q+1}; a full-vocabulary engine copy scores other tokens 0
                D = []
                for o in outs:
                    lg = F.linear(o[0], asst.token_embd)
                    d = torch.as_tensor(vocab_ids)[lg.argmax(-1)]
                    D.append(d)
                for s in range(a.draft_max):
                    C[s][: L - 1] = D[s][: L - 1] == t[1:L]
        acc = dr = 0
        pos = pl  # pending position of the first round
        while pos <= L - 2:
            n = min(a.draft_max, L - 1 - pos)
            k = 0
            while k < n and C[k][pos + k]:
                k += 1
            acc += k
            dr += n
            pos += k + 1
        tot["eng_drafted"] += ed
        tot["eng_accepted"] += ea
        tot["sim_drafted"] += dr
        tot["sim_accepted"] += acc
        print(f"engine: drafted {ed} accepted {ea} ({ea / max(1, ed):.3f}) | pytorch replay: drafted {dr} accepted {acc} ({acc / max(1, dr):.3f}) | {p[:60]!r}")
    print("TOTAL", json.dumps(tot), f"engine {tot['eng_accepted'] / max(1, tot['eng_drafted']):.3f} replay {tot['sim_accepted'] / max(1, tot['sim_drafted']):.3f}")


if __name__ == "__main__":
    main()
