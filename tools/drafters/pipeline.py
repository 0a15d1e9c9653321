#!/usr/bin/env python3
"""Self-distilled draft heads for Gemma 3 270M: data, training, evaluation, GGUF export.

    python3 tools/drafters/pipeline.py all --model gemma-3-270m-q4_k_m.gguf --out OUT

One process, fixed seeds (see README.md): tokenize the prompt set (prompts.py), sample continuations
from the target (transformers, loaded from the GGUF) at temperatures {0.6, 0.8, 1.0} plus a greedy
slice, teacher-force them to keep the target's final pre-norm hidden states and its last local
layer's K/V, pick the k most frequent generated tokens as the draft vocabulary, train a NextN head
and an assistant head together (soft KL to the target's distribution on the subset, S-step unroll),
export both GGUFs (Q8_0), and evaluate them (with their Q8_0 weights) on held-out prompts.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import export as X  # noqa: E402
import prompts as PR  # noqa: E402
from heads import AssistantHead, NextNHead, rms, rope, rope_tables, shift_right  # noqa: E402
from spm import SpmTokenizer  # noqa: E402

T0 = time.time()
EOS_IDS = (1, 106)  # <eos>, <end_of_turn>
TEMP_CYCLE = [0.8, 0.0, 1.0, 0.6, 0.8, 1.0]  # batch b samples at TEMP_CYCLE[b % 6]; 0.0 = greedy


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')} {time.time() - T0:7.1f}s]", *a, flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# prompts


_TOK = None


def _enc(text):
    return _TOK.encode(text)


def tokenize_prompts(model_path, seed, n_train, n_heldout, procs):
    global _TOK
    train, held = PR.build(seed, n_train, n_heldout)
    _TOK = SpmTokenizer.from_gguf(model_path)
    texts = [x["text"] for x in train + held]
    if procs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(procs) as pool:
            ids = pool.map(_enc, texts, chunksize=64)
    else:
        ids = [_enc(t) for t in texts]
    for x, i in zip(train + held, ids):
        x["ids"] = i
    return train, held, _TOK


# ----------------------------------------------------------------------------------------------
# the target


class Target:
    def __init__(self, path, dev, dtype):
        from transformers import AutoModelForCausalLM

        d, f = os.path.split(os.path.abspath(path))
        self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).to(dev).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = self.model.config
        self.cfg = cfg
        lt = cfg.layer_types
        self.last_local = max(i for i, t in enumerate(lt) if t == "sliding_attention")
        self.last_global = max(i for i, t in enumerate(lt) if t == "full_attention")
        self.n_layers = cfg.num_hidden_layers
        self.d = cfg.hidden_size
        self.hd = cfg.head_dim
        self.window = cfg.sliding_window
        rp = getattr(cfg, "rope_parameters", None) or {}
        self.local_base = float(rp.get("sliding_attention", {}).get("rope_theta", getattr(cfg, "rope_local_base_freq", 10000.0)))
        self.E = self.model.model.embed_tokens.weight  # [V, d], unscaled (the tied LM head)
        self.norm_w = 1 + self.model.model.norm.weight.float()
        self.dev = dev
        assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None
        assert int(cfg.query_pre_attn_scalar) == self.hd, "the engine scales attention by 1/sqrt(head_dim)"

    @torch.no_grad()
    def generate(self, prompt_ids, temp, max_new, seed):
        B = len(prompt_ids)
        P = max(len(p) for p in prompt_ids)
        ids = torch.zeros((B, P), dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for r, p in enumerate(prompt_ids):
            ids[r, P - len(p):] = torch.tensor(p)
            mask[r, P - len(p):] = 1
        torch.manual_seed(seed)
        kw = dict(max_new_tokens=max_new, pad_token_id=0, eos_token_id=list(EOS_IDS))
        if temp > 0:
            kw.update(do_sample=True, temperature=temp, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False)
        out = self.model.generate(input_ids=ids.to(self.dev), attention_mask=mask.to(self.dev), **kw)
        gen = out[:, P:].cpu().numpy()
        seqs = []
        for r, p in enumerate(prompt_ids):
            g = gen[r].tolist()
            cut = len(g)
            for k, t in enumerate(g):
                if t in EOS_IDS:
                    cut = k + 1
                    break
            seqs.append((list(p), g[:cut]))
        return seqs

    @torch.no_grad()
    def teacher_forced(self, seqs, tokens_per_batch):
        """seqs: list of token lists. Returns flat tensors on the device: tokens [N] long, H [N, d]
        (final pre-norm hidden), K [N, hd] (last local layer, after k_norm and RoPE), V [N, hd],
        and starts/lengths (int64 numpy)."""
        lens = np.array([len(s) for s in seqs], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        N = int(lens.sum())
        dev, dt = self.dev, self.E.dtype
        tok = torch.tensor(np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]), device=dev)
        H = torch.empty((N, self.d), dtype=torch.bfloat16, device=dev)
        K = torch.empty((N, self.hd), dtype=torch.bfloat16, device=dev)
        V = torch.empty((N, self.hd), dtype=torch.bfloat16, device=dev)
        caps = {}
        attn = self.model.model.layers[self.last_local].self_attn
        hooks = [
            self.model.model.norm.register_forward_hook(lambda m, i, o: caps.__setitem__("H", i[0])),
            attn.k_norm.register_forward_hook(lambda m, i, o: caps.__setitem__("K", o)),
            attn.v_proj.register_forward_hook(lambda m, i, o: caps.__setitem__("V", o)),
        ]
        order = np.argsort(lens, kind="stable")
        i = 0
        try:
            while i < len(order):
                T = int(lens[order[i]])
                j = i
                while j < len(order) and (j - i + 1) * int(lens[order[j]]) <= tokens_per_batch:
                    j += 1
                j = max(j, i + 1)
                rows = order[i:j]
                T = int(lens[rows].max())
                ids = torch.zeros((len(rows), T), dtype=torch.long)
                for r, s in enumerate(rows):
                    ids[r, : lens[s]] = torch.tensor(seqs[s])
                self.model.model(input_ids=ids.to(dev), use_cache=False)
                B = len(rows)
                Hb = caps["H"]
                Kb = caps["K"].transpose(1, 2).reshape(B, T, self.hd)  # [B,1,T,hd] -> [B,T,hd] (one KV head)
                Vb = caps["V"].reshape(B, T, self.hd)
                cos, sin = rope_tables(T, self.hd, self.local_base, dev)
                Kb = rope(Kb, cos, sin)
                for r, s in enumerate(rows):
                    a, n = int(starts[s]), int(lens[s])
                    H[a:a + n] = Hb[r, :n]
                    K[a:a + n] = Kb[r, :n]
                    V[a:a + n] = Vb[r, :n]
                i = j
        finally:
            for h in hooks:
                h.remove()
        return dict(tok=tok, H=H, K=K, V=V, starts=starts, lens=lens)


# ----------------------------------------------------------------------------------------------
# data


def gen_train_data(tgt, train, args):
    rng = random.Random(args.seed)
    stream, pos = [], 0
    seqs, temps, plens = [], [], []
    stats = {}
    t_start = time.time()
    for b in range(args.gen_batches):
        if args.gen_seconds and time.time() - t_start > args.gen_seconds:
            log(f"gen: time budget reached after {b} batches")
            break
        rows = []
        while len(rows) < args.gen_rows:
            if pos >= len(stream):
                stream = list(range(len(train)))
                rng.shuffle(stream)
                pos = 0
            rows.append(stream[pos])
            pos += 1
        temp = TEMP_CYCLE[b % len(TEMP_CYCLE)]
        t = time.time()
        out = tgt.generate([train[r]["ids"] for r in rows], temp, args.gen_new, args.seed * 1000 + b)
        sync(tgt.dev)
        ng = sum(len(g) for _, g in out)
        st = stats.setdefault(str(temp), {"rows": 0, "generated_tokens": 0, "batches": 0})
        st["rows"] += len(out)
        st["generated_tokens"] += ng
        st["batches"] += 1
        for p, g in out:
            seqs.append(p + g)
            plens.append(len(p))
            temps.append(temp)
        log(f"gen batch {b}: T={temp} rows={len(out)} generated={ng} ({ng / (time.time() - t):.0f} tok/s)")
    return seqs, plens, temps, stats


def choose_vocab(data, plens, k, V):
    tok = data["tok"].cpu().numpy()
    keep = np.ones(len(tok), dtype=bool)
    keep[data["starts"]] = False  # the BOS of each sequence is never predicted
    counts = np.bincount(tok[keep], minlength=V)
    for e in EOS_IDS:
        counts[e] = max(counts[e], counts.max() + 1)
    order = np.argsort(-counts, kind="stable")[:k]
    cov = counts[order].sum() / max(1, counts.sum())
    return order.astype(np.int64), float(cov), int((counts > 0).sum())


def make_batch(data, seq_idx, T=None):
    """Sequences seq_idx padded (by repeating their last token) to T positions (default: the longest)."""
    starts = torch.as_tensor(data["starts"][seq_idx], device=data["tok"].device)
    lens = torch.as_tensor(data["lens"][seq_idx], device=data["tok"].device)
    T = int(data["lens"][seq_idx].max()) if T is None else T
    t = torch.arange(T, device=lens.device)[None, :]
    idx = starts[:, None] + torch.minimum(t, lens[:, None] - 1)
    return dict(tok=data["tok"][idx], H=data["H"][idx], K=data["K"][idx], V=data["V"][idx], lens=lens, T=T)


# ----------------------------------------------------------------------------------------------
# heads, loss


def head_inputs(tgt, batch):
    sd = math.sqrt(tgt.d)
    tok = batch["tok"]
    emb = tgt.E[tok].float() * sd  # E(t_q)*sqrt(d)
    emb_next = torch.cat([emb[:, 1:], emb[:, -1:]], dim=1)  # E(t_{i+1})*sqrt(d)
    return emb, emb_next


def valid_masks(batch, S):
    T = batch["T"]
    i = torch.arange(T, device=batch["lens"].device)[None, :]
    L = batch["lens"][:, None]
    # NextN entry i at step s: i >= s-1, and t_{i+2} exists (i <= L-3); its target row is i+1.
    vn = [(i >= s - 1) & (i <= L - 3) for s in range(1, S + 1)]
    # Assistant query q at step s: a cached key exists (q >= s), and t_{q+1} exists; target row q.
    va = [(i >= s) & (i <= L - 2) for s in range(1, S + 1)]
    return vn, va


def soft_ce(out, W, P, m):
    """Mean over the positions with m = 1 of -sum_v P log q; out [B,T,d], P [B,T,k], m [B,T] float.
    Every position is computed (fixed shapes, no host syncs); masked ones weigh 0."""
    logq = F.log_softmax(F.linear(out, W).float(), dim=-1)
    ce = -(P * logq).sum(-1)
    return (ce * m).sum() / m.sum().clamp(min=1), logq


def build_heads(tgt, vocab_ids, args):
    kw = dict(n_head=tgt.cfg.num_attention_heads, n_kv=tgt.cfg.num_key_value_heads, hd=tgt.hd, ff=tgt.cfg.intermediate_size)
    nextn = NextNHead(tgt.d, window=tgt.window, rope_base=tgt.local_base, **kw).to(tgt.dev)
    asst = AssistantHead(tgt.d, tgt.d, k_vocab=len(vocab_ids), window=tgt.window, rope_base=tgt.local_base, **kw).to(tgt.dev)
    # The NextN block is block L = n_layers: local iff (L+1) % 6 > 0 (the engine's rule).
    assert (tgt.n_layers + 1) % 6 > 0, "this recipe assumes the NextN block is a local (sliding) block"
    nextn.init_from_target(tgt.model, tgt.last_global)
    asst.init_from_target(tgt.model, tgt.last_local, torch.as_tensor(vocab_ids))
    return nextn, asst


def train(tgt, data, vocab_ids, args):
    dev = tgt.dev
    torch.manual_seed(args.seed)
    nextn, asst = build_heads(tgt, vocab_ids, args)
    vid = torch.as_tensor(vocab_ids, device=dev)
    E_sub = tgt.E[vid].detach()
    S = args.unroll
    w = [float(x) for x in args.step_weights.split(",")][:S]
    emb_params = [asst.token_embd]
    other = [p for p in list(nextn.parameters()) + list(asst.parameters()) if p is not asst.token_embd]
    opt = torch.optim.AdamW([{"params": other, "lr": args.lr}, {"params": emb_params, "lr": args.lr * args.emb_lr_scale}],
                            betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
    base_lrs = [args.lr, args.lr * args.emb_lr_scale]
    total = {"n": args.steps if args.steps > 0 else 10 ** 9}

    def lr_factor(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        prog = min(1.0, (step - args.warmup) / max(1, total["n"] - args.warmup))
        return args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog))

    g = torch.Generator().manual_seed(args.seed + 1)
    nseq = len(data["lens"])
    T_fix = int(-(-int(data["lens"].max()) // 16) * 16)  # one shape for every batch
    log(f"train: batches of {args.batch_seqs} sequences x {T_fix} positions")
    use_amp = dev.type == "cuda"
    t_train = time.time()
    calib_at = 30
    step = 0
    hist = []
    while step < total["n"]:
        if step == calib_at and args.steps <= 0:
            sync(dev)
            per = (time.time() - t_calib) / (calib_at - 10)
            total["n"] = max(calib_at + 1, int((args.train_seconds - (time.time() - t_train)) / per) + calib_at)
            log(f"train: {per * 1000:.0f} ms/step -> {total['n']} steps for {args.train_seconds}s")
        if step == 10:
            sync(dev)
            t_calib = time.time()
        f = lr_factor(step)
        for grp, b in zip(opt.param_groups, base_lrs):
            grp["lr"] = b * f
        seq_idx = torch.randint(nseq, (args.batch_seqs,), generator=g).numpy()
        timing = step < 6 or step % args.log_every == 0
        if timing:
            sync(dev)
            tt = [time.time()]
        batch = make_batch(data, seq_idx, T_fix)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=use_amp):
            with torch.no_grad():
                tl = F.log_softmax(F.linear(rms(batch["H"], tgt.norm_w), E_sub).float(), dim=-1)
                P = tl.exp()
                tl_next = torch.cat([tl[:, 1:], tl[:, -1:]], dim=1)
                P_next = torch.cat([P[:, 1:], P[:, -1:]], dim=1)
            emb, emb_next = head_inputs(tgt, batch)
            vn, va = valid_masks(batch, S)
            vn = [m.float() for m in vn]
            va = [m.float() for m in va]
            outs_n = nextn.unroll(emb_next, batch["H"], S)
            outs_a = asst.unroll(emb, shift_right(batch["H"]), batch["K"][:, None], batch["V"][:, None], S)
            loss = 0.0
            rec = {}
            for s in range(S):
                ce_n, lq_n = soft_ce(outs_n[s], E_sub, P_next, vn[s])
                ce_a, lq_a = soft_ce(outs_a[s], asst.token_embd, P, va[s])
                loss = loss + w[s] * (ce_n + ce_a)
                if step % args.log_every == 0:
                    with torch.no_grad():
                        mean = lambda x, m: float((x * m).sum() / m.sum().clamp(min=1))
                        ent_n = mean(-(P_next * tl_next).sum(-1), vn[s])
                        ent_a = mean(-(P * tl).sum(-1), va[s])
                        acc_n = mean((lq_n.argmax(-1) == P_next.argmax(-1)).float(), vn[s])
                        acc_a = mean((lq_a.argmax(-1) == P.argmax(-1)).float(), va[s])
                        rec[f"s{s + 1}"] = dict(kl_n=float(ce_n) - ent_n, acc_n=acc_n, kl_a=float(ce_a) - ent_a, acc_a=acc_a)
        if timing:
            sync(dev)
            tt.append(time.time())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if timing:
            sync(dev)
            tt.append(time.time())
        gn = torch.nn.utils.clip_grad_norm_(list(nextn.parameters()), 1.0)
        ga = torch.nn.utils.clip_grad_norm_(list(asst.parameters()), 1.0)
        opt.step()
        if timing:
            sync(dev)
            tt.append(time.time())
            log(f"step {step}: forward {1000 * (tt[1] - tt[0]):.0f} ms, backward {1000 * (tt[2] - tt[1]):.0f} ms, "
                f"clip+adam {1000 * (tt[3] - tt[2]):.0f} ms")
        if step % args.log_every == 0:
            r = {"step": step, "loss": float(loss.detach()), "lr": opt.param_groups[0]["lr"], "gn": float(gn), "ga": float(ga),
                 "positions": int(vn[0].sum()), **rec}
            hist.append(r)
            log("train", json.dumps(r))
        step += 1
    sync(dev)
    log(f"train: {step} steps in {time.time() - t_train:.0f}s")
    return nextn, asst, {"steps": step, "seconds": round(time.time() - t_train, 1), "history": hist}


# ----------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(tgt, data, plens, vocab_ids, nextn, asst, temp, args):
    """Offline acceptance on one held-out set. Draft arrays are aligned by target row j: the draft
    for the token at j+1 whose target logits come from H_j. A round starting at pending position p
    drafts rows p, p+1, p+2 at depths 1, 2, 3."""
    dev = tgt.dev
    S = 3
    vid = torch.as_tensor(vocab_ids, device=dev)
    E_sub = tgt.E[vid]
    N = len(data["tok"])
    D = {k: torch.full((S, N), -1, dtype=torch.long, device=dev) for k in ("nextn", "nextn_full", "asst")}
    use_amp = dev.type == "cuda"
    nseq = len(data["lens"])
    bs = args.eval_batch_seqs
    for a in range(0, nseq, bs):
        idx = np.arange(a, min(nseq, a + bs))
        batch = make_batch(data, idx)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=use_amp):
            emb, emb_next = head_inputs(tgt, batch)
            outs_n = nextn.unroll(emb_next, batch["H"], S)
            outs_a = asst.unroll(emb, shift_right(batch["H"]), batch["K"][:, None], batch["V"][:, None], S)
            vn, va = valid_masks(batch, S)
            starts = torch.as_tensor(data["starts"][idx], device=dev)[:, None]
            ii = torch.arange(batch["T"], device=dev)[None, :]
            for s in range(S):
                rows_n = (starts + ii + 1)[vn[s]]  # NextN entry i -> target row i+1
                o = outs_n[s][vn[s]]
                D["nextn"][s, rows_n] = vid[F.linear(o, E_sub).argmax(-1)]
                full = torch.cat([F.linear(o[c:c + 2048], tgt.E).argmax(-1) for c in range(0, len(o), 2048)]) if len(o) else rows_n
                D["nextn_full"][s, rows_n] = full
                rows_a = (starts + ii)[va[s]]
                D["asst"][s, rows_a] = vid[F.linear(outs_a[s][va[s]], asst.token_embd).argmax(-1)]
    # the target's greedy choice at every row (full vocabulary), and p_T of each head's first draft
    A = torch.empty(N, dtype=torch.long, device=dev)
    pacc = {k: torch.zeros(N, device=dev) for k in D}
    Hn = data["H"]
    for c in range(0, N, 4096):
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=use_amp):
            lg = F.linear(rms(Hn[c:c + 4096], tgt.norm_w), tgt.E).float()
        A[c:c + 4096] = lg.argmax(-1)
        if temp > 0:
            lp = F.log_softmax(lg / temp, dim=-1)
            for k in D:
                d1 = D[k][0, c:c + 4096].clamp(min=0)
                pacc[k][c:c + 4096] = lp.gather(1, d1[:, None])[:, 0].exp()
    A = A.cpu().numpy()
    in_sub = np.isin(A, vocab_ids)
    res = {}
    for k in D:
        Dk = D[k].cpu().numpy()
        C = Dk == A[None, :]
        pk = pacc[k].cpu().numpy()
        a1, a1n, c2, c2n, c3, c3n, cov, covn, pa = 0, 0, 0, 0, 0, 0, 0, 0, 0.0
        Lsum = np.zeros(3)
        nrounds_all = 0
        sim_acc, sim_draft, sim_rounds = 0, 0, 0
        for si in range(nseq):
            st, L, pl = int(data["starts"][si]), int(data["lens"][si]), int(plens[si])
            p1 = np.arange(pl, L - 1)  # rounds with a first draft (row p <= L-2)
            if len(p1) == 0:
                continue
            a1 += C[0, st + p1].sum()
            a1n += len(p1)
            pa += pk[st + p1].sum()
            cov += in_sub[st + p1].sum()
            covn += len(p1)
            p3 = np.arange(pl, L - 3)  # rounds with three drafts
            if len(p3):
                x1, x2, x3 = C[0, st + p3], C[1, st + p3 + 1], C[2, st + p3 + 2]
                c2 += (x1 & x2).sum()
                c2n += x1.sum()
                c3 += (x1 & x2 & x3).sum()
                c3n += (x1 & x2).sum()
                Lsum += [x1.sum(), x1.sum() + (x1 & x2).sum(), x1.sum() + (x1 & x2).sum() + (x1 & x2 & x3).sum()]
                nrounds_all += len(p3)
            # the engine's rounds at --spec-draft-n-max 3 (greedy): accept the leading right drafts
            p = pl
            while p <= L - 4:
                n_ok = 0
                for s in range(3):
                    if C[s, st + p + s]:
                        n_ok += 1
                    else:
                        break
                sim_acc += n_ok
                sim_draft += 3
                sim_rounds += 1
                p += n_ok + 1
        r = {
            "alpha1": a1 / max(1, a1n),
            "alpha2_given_1": c2 / max(1, c2n),
            "alpha3_given_12": c3 / max(1, c3n),
            "tokens_per_verify_k1_k2_k3": [float(1 + Lsum[i] / max(1, nrounds_all)) for i in range(3)],
            "positions": int(a1n),
            "subset_coverage_of_target_greedy": cov / max(1, covn),
            "sim_rounds_k3": {"accept_rate": sim_acc / max(1, sim_draft), "tau": 1 + sim_acc / max(1, sim_rounds), "rounds": sim_rounds},
        }
        if temp > 0:
            r[f"p_accept_at_T{temp}"] = pa / max(1, a1n)
        res[k] = {a: (float(b) if isinstance(b, (np.floating, float)) else b) for a, b in r.items()}
    return res


# ----------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["all", "prompts"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--n-train-prompts", type=int, default=12000)
    ap.add_argument("--n-heldout", type=int, default=384)
    ap.add_argument("--procs", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--k-vocab", type=int, default=16384)
    ap.add_argument("--gen-rows", type=int, default=4096)
    ap.add_argument("--gen-new", type=int, default=256)
    ap.add_argument("--gen-batches", type=int, default=12)
    ap.add_argument("--gen-seconds", type=float, default=0, help="stop starting generation batches after this long (0: no limit)")
    ap.add_argument("--eval-new", type=int, default=256)
    ap.add_argument("--tf-tokens", type=int, default=131072, help="tokens per teacher-forced forward")
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--step-weights", default="1.0,0.6,0.4")
    ap.add_argument("--batch-seqs", type=int, default=64)
    ap.add_argument("--eval-batch-seqs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--emb-lr-scale", type=float, default=0.1, help="lr factor of the assistant's trained LM head rows")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: as many as --train-seconds allows)")
    ap.add_argument("--train-seconds", type=float, default=420)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--heads", default=None, help="skip training: load heads.pt from this path")
    ap.add_argument("--train-tokens", default=None, help="reuse a train_tokens.json instead of generating")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    log("tokenizing prompts")
    train_p, held_p, tok = tokenize_prompts(args.model, args.seed, args.n_train_prompts, args.n_heldout, args.procs)
    with open(os.path.join(args.out, "prompts.json"), "w") as f:
        json.dump({"train": train_p, "heldout": held_p}, f)
    log(f"prompts: {len(train_p)} train, {len(held_p)} held out; mean prompt tokens "
        f"{np.mean([len(x['ids']) for x in train_p]):.1f}")
    if args.stage == "prompts":
        return

    log(f"loading target on {dev}")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tgt = Target(args.model, dev, dtype)
    log(f"target: {tgt.n_layers} layers, last local {tgt.last_local}, last global {tgt.last_global}, window {tgt.window}, "
        f"local rope base {tgt.local_base}")
    summary = {"args": vars(args)}

    # held-out sets first (small), so a failed training still leaves them
    held_ids = [x["ids"] for x in held_p]
    eval_sets = {}
    for name, temp in (("greedy", 0.0), ("T0.8", 0.8), ("T1.0", 1.0)):
        t = time.time()
        out = tgt.generate(held_ids, temp, args.eval_new, args.seed * 1000 + 999 + int(temp * 10))
        eval_sets[name] = (temp, out)
        log(f"eval set {name}: {sum(len(g) for _, g in out)} generated tokens in {time.time() - t:.1f}s")

    if args.heads is None:
        if args.train_tokens:
            tt = json.load(open(args.train_tokens))
            seqs, plens, temps = tt["seqs"], tt["plens"], tt["temps"]
            gstats = {}
            for s_, p_, t_ in zip(seqs, plens, temps):
                st = gstats.setdefault(str(t_), {"rows": 0, "generated_tokens": 0})
                st["rows"] += 1
                st["generated_tokens"] += len(s_) - p_
        else:
            seqs, plens, temps, gstats = gen_train_data(tgt, train_p, args)
        with open(os.path.join(args.out, "train_tokens.json"), "w") as f:
            json.dump({"seqs": seqs, "plens": plens, "temps": temps}, f)
        t = time.time()
        data = tgt.teacher_forced(seqs, args.tf_tokens)
        sync(dev)
        log(f"teacher-forced {len(data['tok'])} positions in {time.time() - t:.1f}s")
        vocab_ids, vcov, n_distinct = choose_vocab(data, plens, args.k_vocab, tgt.E.shape[0])
        log(f"vocab: k={len(vocab_ids)} covers {vcov:.4f} of training tokens ({n_distinct} distinct seen)")
        summary["data"] = {"sequences": len(seqs), "positions": int(len(data["tok"])),
                           "generated_tokens": int(sum(len(s) - p for s, p in zip(seqs, plens))),
                           "prompt_tokens": int(sum(plens)), "by_temperature": gstats,
                           "vocab_k": len(vocab_ids), "vocab_token_coverage_train": vcov, "distinct_tokens_seen": n_distinct}
        nextn, asst, tstats = train(tgt, data, vocab_ids, args)
        summary["train"] = tstats
        del data
        torch.save({"nextn": nextn.state_dict(), "asst": asst.state_dict(), "vocab_ids": vocab_ids}, os.path.join(args.out, "heads.pt"))
    else:
        ck = torch.load(args.heads, map_location=dev, weights_only=False)
        vocab_ids = ck["vocab_ids"]
        nextn, asst = build_heads(tgt, vocab_ids, args)
        nextn.load_state_dict(ck["nextn"])
        asst.load_state_dict(ck["asst"])
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    cfg = dict(d=tgt.d, ff=tgt.cfg.intermediate_size, n_head=tgt.cfg.num_attention_heads, n_kv=tgt.cfg.num_key_value_heads,
               hd=tgt.hd, window=tgt.window)
    prov = {"seed": args.seed, "recipe": "tools/drafters/pipeline.py", "vocab_k": len(vocab_ids), "unroll": args.unroll,
            "steps": summary.get("train", {}).get("steps", "?")}
    L = tgt.n_layers
    pn = os.path.join(args.out, "gemma3-270m-nextn.gguf")
    pa = os.path.join(args.out, "gemma3-270m-assistant.gguf")
    X.write_nextn(pn, nextn, L, vocab_ids, cfg, prov)
    X.write_assistant(pa, asst, vocab_ids, cfg, prov)
    # Tine reads the draft vocabulary from metadata: candle's GGUF reader has no I32 tensors.
    import vocab_metadata
    for path in (pn, pa):
        vocab_metadata.convert(path, path)
    log(f"exported {pn} ({os.path.getsize(pn)} B), {pa} ({os.path.getsize(pa)} B)")

    # evaluate what ships: Q8_0 round trip of the stored matrices
    X.quantize_module_(nextn, {n for n, p in nextn.named_parameters() if p.ndim == 2})
    X.quantize_module_(asst, {n for n, p in asst.named_parameters() if p.ndim == 2})
    summary["eval"] = {}
    for name, (temp, out) in eval_sets.items():
        seqs = [p + g for p, g in out]
        plens = [len(p) for p, _ in out]
        data = tgt.teacher_forced(seqs, args.tf_tokens)
        r = evaluate(tgt, data, plens, vocab_ids, nextn, asst, temp, args)
        summary["eval"][name] = r
        log(f"eval {name}: " + json.dumps(r))
        del data
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=float)
    log("ALL DONE")


if __name__ == "__main__":
    main()
