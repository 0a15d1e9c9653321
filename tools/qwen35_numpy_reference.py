#!/usr/bin/env python3
"""A third Qwen3.5 forward, for triangulating candle against llama.cpp: float64 numpy over a
`qwen35` GGUF read with llama.cpp's own gguf-py (the sdist's vendor/llama.cpp/gguf-py), written
from the numpy sketch in shared/reference/model-families.md (dense trunk only). Prints the top
three log-probabilities after each prompt (comma-separated token ids).

  python3 -m venv /tmp/np && /tmp/np/bin/pip install numpy pyyaml
  /tmp/np/bin/python tools/qwen35_numpy_reference.py MODEL.gguf 3 95 3,17,40,2
"""
import sys
import os
sys.path.insert(0, os.path.join(os.environ.get("TINE_PEERS_DIR", os.path.expanduser("~/.cache/tine-peers")), "llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"))
import numpy as np
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
T = {}
for t in r.tensors:
    a = np.array(t.data, dtype=np.float64)
    T[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else a.reshape(-1)
def kv(k):
    f = r.fields[k]
    return f.parts[f.data[0]][0] if len(f.data) == 1 else [f.parts[i][0] for i in f.data]
A = "qwen35."
n_layer = int(kv(A + "block_count")); H = int(kv(A + "embedding_length")); nh = int(kv(A + "attention.head_count")); nkv = int(kv(A + "attention.head_count_kv"))
hd = int(kv(A + "attention.key_length")); nrot = int(kv(A + "rope.dimension_count")); base = float(kv(A + "rope.freq_base")); eps = float(kv(A + "attention.layer_norm_rms_epsilon"))
K = int(kv(A + "ssm.conv_kernel")); ds = int(kv(A + "ssm.state_size")); Hk = int(kv(A + "ssm.group_count")); Hv = int(kv(A + "ssm.time_step_rank")); interval = int(kv(A + "full_attention_interval"))
C = 2 * Hk * ds + Hv * ds
rms = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w
silu = lambda x: x / (1 + np.exp(-x)); sigm = lambda x: 1 / (1 + np.exp(-x)); softplus = lambda x: np.log1p(np.exp(x))
def run(tokens):
    conv = {l: np.zeros((K - 1, C)) for l in range(n_layer)}; S = {l: np.zeros((Hv, ds, ds)) for l in range(n_layer)}; KC = {l: [] for l in range(n_layer)}; VC = {l: [] for l in range(n_layer)}
    for pos, tok in enumerate(tokens):
        x = T["token_embd.weight"][tok].copy()
        for l in range(n_layer):
            p = f"blk.{l}."
            h = rms(x, T[p + "attn_norm.weight"])
            if (l + 1) % interval == 0:
                qg = (T[p + "attn_q.weight"] @ h).reshape(nh, 2 * hd); q = rms(qg[:, :hd], T[p + "attn_q_norm.weight"]); g = qg[:, hd:]
                k = rms((T[p + "attn_k.weight"] @ h).reshape(nkv, hd), T[p + "attn_k_norm.weight"]); v = (T[p + "attn_v.weight"] @ h).reshape(nkv, hd)
                def rope(u):
                    u = u.copy(); half = nrot // 2
                    for i in range(half):
                        th = pos * base ** (-2 * i / nrot); c, s = np.cos(th), np.sin(th)
                        a, b = u[:, i].copy(), u[:, i + half].copy(); u[:, i] = a * c - b * s; u[:, i + half] = b * c + a * s
                    return u
                q, k = rope(q), rope(k); KC[l].append(k); VC[l].append(v)
                Ks, Vs = np.stack(KC[l]), np.stack(VC[l]); out = np.zeros((nh, hd))
                for hh in range(nh):
                    gi = hh // (nh // nkv); sc = Ks[:, gi] @ q[hh] / np.sqrt(hd); e = np.exp(sc - sc.max()); out[hh] = (e / e.sum()) @ Vs[:, gi]
                y = T[p + "attn_output.weight"] @ (out * sigm(g)).reshape(-1)
            else:
                qkv = T[p + "attn_qkv.weight"] @ h; z = T[p + "attn_gate.weight"] @ h
                beta = sigm(T[p + "ssm_beta.weight"] @ h); gg = T[p + "ssm_a"] * softplus(T[p + "ssm_alpha.weight"] @ h + T[p + "ssm_dt.bias"])
                win = np.vstack([conv[l], qkv[None]]); conv[l] = win[1:]
                c = silu((T[p + "ssm_conv1d.weight"].T * win).sum(0))
                q = c[:Hk * ds].reshape(Hk, ds); k = c[Hk * ds:2 * Hk * ds].reshape(Hk, ds); v = c[2 * Hk * ds:].reshape(Hv, ds)
                l2 = lambda u: u / np.sqrt((u * u).sum(-1, keepdims=True) + eps)
                q, k = l2(q) / np.sqrt(ds), l2(k); o = np.zeros((Hv, ds))
                for hh in range(Hv):
                    kk = hh % Hk; St = S[l][hh] * np.exp(gg[hh]); St = St + np.outer(k[kk], beta[hh] * (v[hh] - St.T @ k[kk])); S[l][hh] = St; o[hh] = St.T @ q[kk]
                y = T[p + "ssm_out.weight"] @ (rms(o, T[p + "ssm_norm.weight"]) * silu(z.reshape(Hv, ds))).reshape(-1)
            x = x + y
            hh_ = rms(x, T[p + "post_attention_norm.weight"])
            x = x + T[p + "ffn_down.weight"] @ (silu(T[p + "ffn_gate.weight"] @ hh_) * (T[p + "ffn_up.weight"] @ hh_))
    n = rms(x, T["output_norm.weight"]); lg = T.get("output.weight", T["token_embd.weight"]) @ n
    lp = lg - (lg.max() + np.log(np.exp(lg - lg.max()).sum())); top = np.argsort(-lp)[:3]
    return [(int(i), round(float(lp[i]), 4)) for i in top]
for p in sys.argv[2:]:
    print(p, run([int(t) for t in p.split(",")]))
