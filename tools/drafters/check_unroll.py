#!/usr/bin/env python3
"""Checks that the batched S-step unroll of heads.py computes, at every position, what the engine
computes one step at a time (KV cache per round, chained hidden states, sliding window): small
random heads, float64, a sequential reference written from the engine's code. CPU, seconds.

    python3 tools/drafters/check_unroll.py
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import heads as Hm  # noqa: E402
from heads import rms, rope, rope_tables  # noqa: E402


def attn_one(q, K, V, hd):
    """q [H, D]; K, V [n, D] (one KV head)."""
    s = (q @ K.T) / math.sqrt(hd)
    return torch.softmax(s, -1) @ V


def block_step(blk, x, pos, cos, sin, keys, vals):
    """One position through a Gemma block; keys/vals: visible K/V (already roped) incl. this one if any."""
    y = rms(x[None, None], blk.attn_norm)
    q = blk.q(y, cos[pos:pos + 1], sin[pos:pos + 1])[0, :, 0]  # [H, D]
    a = attn_one(q, keys, vals, blk.hd)  # [H, D]
    return blk.finish(x[None, None], a[None, :, None, :])[0, 0]


def kv_step(blk, x, pos, cos, sin):
    y = rms(x[None, None], blk.attn_norm)
    k, v = blk.kv(y, cos[pos:pos + 1], sin[pos:pos + 1])
    return k[0, 0, 0], v[0, 0, 0]


def randomize(m, g):
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[1]))


def main():
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    d, H, hd, ff, T, W, S = 32, 4, 16, 48, 14, 5, 3
    kw = dict(n_head=H, n_kv=1, hd=hd, ff=ff)
    nextn = Hm.NextNHead(d, window=W, rope_base=10000.0, **kw)
    asst = Hm.AssistantHead(d, d, k_vocab=10, window=W, rope_base=10000.0, **kw)
    randomize(nextn, g)
    randomize(asst, g)
    B = 2
    emb = torch.randn(B, T, d, generator=g)
    Hs = 3 * torch.randn(B, T, d, generator=g)
    K16 = torch.randn(B, 1, T, hd, generator=g)
    V16 = torch.randn(B, 1, T, hd, generator=g)
    emb_next = torch.cat([emb[:, 1:], emb[:, -1:]], 1)
    cos, sin = rope_tables(T, hd, 10000.0, "cpu")
    cos, sin = cos.double(), sin.double()
    with torch.no_grad():
        un = nextn.unroll(emb_next, Hs, S)
        ua = asst.unroll(emb, Hm.shift_right(Hs), K16, V16, S)
        err_n = err_a = 0.0
        checked_n = checked_a = 0
        for b in range(B):
            # NextN: round whose first draft is entry i0 (entries 0..i0 from the trunk's H)
            blk = nextn.block
            for i0 in range(T - S):
                Ks, Vs = [], []
                xs = []
                for j in range(i0 + 1):
                    x = (torch.cat([rms(emb_next[b, j], nextn.enorm), rms(Hs[b, j], nextn.hnorm)]) @ nextn.eh_proj.T)
                    k, v = kv_step(blk, x, j, cos, sin)
                    Ks.append(k)
                    Vs.append(v)
                    xs.append(x)
                j = i0
                lo = max(0, j + 1 - W)
                out = block_step(blk, xs[j], j, cos, sin, torch.stack(Ks[lo:j + 1]), torch.stack(Vs[lo:j + 1]))
                ref = [rms(out, nextn.shared_head_norm)]
                for s in range(2, S + 1):
                    j = i0 + s - 1
                    x = torch.cat([rms(emb_next[b, j], nextn.enorm), rms(out, nextn.hnorm)]) @ nextn.eh_proj.T
                    k, v = kv_step(blk, x, j, cos, sin)
                    Ks.append(k)
                    Vs.append(v)
                    lo = max(0, j + 1 - W)
                    out = block_step(blk, x, j, cos, sin, torch.stack(Ks[lo:j + 1]), torch.stack(Vs[lo:j + 1]))
                    ref.append(rms(out, nextn.shared_head_norm))
                for s in range(S):
                    e = (un[s][b, i0 + s] - ref[s]).abs().max().item()
                    err_n = max(err_n, e)
                    checked_n += 1
            # Assistant: round with pending position p (target cache holds 0..p-1)
            blk = asst.block
            for p in range(1, T - S + 1):
                h = Hs[b, p - 1]
                for s in range(1, S + 1):
                    q = p + s - 1
                    x = torch.cat([emb[b, q], h]) @ asst.pre_projection.T
                    lo = max(0, q + 1 - W)
                    if lo > p - 1:
                        break  # the engine stops chaining here (max_draft_steps)
                    x = block_step(blk, x, q, cos, sin, K16[b, 0, lo:p], V16[b, 0, lo:p]) * asst.layer_output_scale
                    e = (ua[s - 1][b, q] - rms(x, asst.output_norm)).abs().max().item()
                    err_a = max(err_a, e)
                    checked_a += 1
                    h = x @ asst.post_projection.T
    print(f"NextN unroll vs sequential: max |diff| {err_n:.2e} over {checked_n} (position, depth) pairs")
    print(f"Assistant unroll vs sequential: max |diff| {err_a:.2e} over {checked_a} pairs")
    ok = err_n < 1e-9 and err_a < 1e-9
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
