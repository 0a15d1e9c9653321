"""PyTorch forwards of Tine's two draft heads for Gemma 3, written to compute exactly what the
engine computes (engine/upstream/candle-transformers/src/models/quantized_gemma3_{nextn,assistant}.rs):

- RMSNorm: `x / sqrt(mean(x^2) + eps) * w` in float32, where `w` is the *effective* weight (the GGUF
  stores Gemma norms as `1 + w_hf`; transformers subtracts the 1 when it loads a GGUF, we add it back).
- RoPE: NEOX (pairs i, i + d/2), inv_freq = base^(-2i/d) in float32; the NextN block is block
  `L = 18` of an 18-layer target: local (`(L+1) % 6 > 0`), base 10000, window 512.
- Attention scale 1/sqrt(head_dim); GELU (tanh) gated MLP; no soft-capping; q_norm/k_norm per head.
- NextN entry j: `x = eh_proj([enorm(E(t_{j+1})*sqrt(640)); hnorm(H_j)])`, one Gemma block over the
  head's own causal KV, `shared_head_norm`, the (subset of the) target's tied LM head; predicts t_{j+2}.
  A chained step feeds the head's output hidden (before `shared_head_norm`) in place of H and its
  K/V joins the head's cache after the entries built on the trunk's hidden states.
- Assistant step at position p: `x = pre_projection([E(t_p)*sqrt(640); h])` with h = H_{p-1} or the
  previous step's `post_projection(x)`; blocks whose queries (RoPE at p, q_norm) attend over the
  target's layer-16 K/V at positions < p of the current round (window 512); x *= layer_output_scale;
  `logits = token_embd . output_norm(x)`; predicts t_{p+1}.

Training unrolls S chained steps at every position at once; the attention masks reproduce the
engine's KV visibility at each chain depth exactly.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-6


def _f(x):
    """float32 at least (float64 stays, for the checks)."""
    return x if x.dtype == torch.float64 else x.float()


def rms(x, w, eps=EPS):
    xf = _f(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * _f(w)


def rope_tables(T, dim, base, device):
    inv = 1.0 / (torch.tensor(base, dtype=torch.float32) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    idx = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
    return idx.cos().to(device), idx.sin().to(device)


def rope(x, cos, sin):
    """x [..., T, D]; cos/sin [T, D/2] (or broadcastable)."""
    d = x.shape[-1] // 2
    x1, x2 = _f(x[..., :d]), _f(x[..., d:])
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def lin(x, w):
    return F.linear(x, w)


class GemmaBlock(nn.Module):
    """One Gemma 3 block; `with_kv=False` gives the assistant's Q-only block."""

    def __init__(self, d=640, n_head=4, n_kv=1, hd=256, ff=2048, with_kv=True):
        super().__init__()
        self.d, self.n_head, self.n_kv, self.hd, self.with_kv = d, n_head, n_kv, hd, with_kv
        P = lambda *s: nn.Parameter(torch.zeros(*s))
        self.attn_norm, self.post_attention_norm, self.ffn_norm, self.post_ffw_norm = P(d), P(d), P(d), P(d)
        self.wq, self.wo, self.q_norm = P(n_head * hd, d), P(d, n_head * hd), P(hd)
        if with_kv:
            self.wk, self.wv, self.k_norm = P(n_kv * hd, d), P(n_kv * hd, d), P(hd)
        self.gate, self.up, self.down = P(ff, d), P(ff, d), P(d, ff)

    def load_from_hf(self, layer, zero_residual=True):
        a = layer.self_attn
        with torch.no_grad():
            self.attn_norm.copy_(1 + layer.input_layernorm.weight.float())
            self.post_attention_norm.copy_(1 + layer.post_attention_layernorm.weight.float())
            self.ffn_norm.copy_(1 + layer.pre_feedforward_layernorm.weight.float())
            self.post_ffw_norm.copy_(1 + layer.post_feedforward_layernorm.weight.float())
            self.wq.copy_(a.q_proj.weight.float())
            self.wo.copy_(a.o_proj.weight.float())
            self.q_norm.copy_(1 + a.q_norm.weight.float())
            if self.with_kv:
                self.wk.copy_(a.k_proj.weight.float())
                self.wv.copy_(a.v_proj.weight.float())
                self.k_norm.copy_(1 + a.k_norm.weight.float())
            self.gate.copy_(layer.mlp.gate_proj.weight.float())
            self.up.copy_(layer.mlp.up_proj.weight.float())
            self.down.copy_(layer.mlp.down_proj.weight.float())
            if zero_residual:
                self.post_attention_norm.zero_()
                self.post_ffw_norm.zero_()

    def q(self, y, cos, sin):
        B, T, _ = y.shape
        q = lin(y, self.wq).view(B, T, self.n_head, self.hd).transpose(1, 2)
        return rope(rms(q, self.q_norm), cos, sin)

    def kv(self, y, cos, sin):
        B, T, _ = y.shape
        k = lin(y, self.wk).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = lin(y, self.wv).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        return rope(rms(k, self.k_norm), cos, sin), v

    def finish(self, x, attn):
        B, T, _ = x.shape
        a = lin(attn.transpose(1, 2).reshape(B, T, self.n_head * self.hd), self.wo)
        x = x + rms(a, self.post_attention_norm)
        y = rms(x, self.ffn_norm)
        z = lin(F.gelu(lin(y, self.gate), approximate="tanh") * lin(y, self.up), self.down)
        return x + rms(z, self.post_ffw_norm)


def attend(q, k, v, mask, hd):
    """q [B,H,T,D], k/v [B,1,S,D] (one KV head, broadcast over the query heads), mask bool [T,S]
    (True = visible). Plain matmul-softmax-matmul (float32 scores): one fixed code path."""
    dt = torch.bfloat16 if q.is_cuda else (torch.float64 if q.dtype == torch.float64 else torch.float32)
    s = _f(torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2))) * (1.0 / math.sqrt(hd))
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p.to(dt), v.to(dt))


_MASKS = {}


def nextn_mask(T, s, window, device):
    """Step s (1-based) of a NextN chain, query entry i; keys: step-1 entries m <= i-s+1 (causal,
    window), and step-r entry i-(s-r) for r = 2..s. Layout of the key axis: [K_1 | K_2 | ... | K_s]."""
    key = ("n", T, s, window, str(device))
    if key not in _MASKS:
        i = torch.arange(T)[:, None]
        m = torch.arange(T)[None, :]
        parts = [(m <= i - s + 1) & (i - m < window)]
        for r in range(2, s + 1):
            parts.append(m == i - (s - r))
        M = torch.cat(parts, dim=1)
        M[:, 0] |= ~M.any(1)  # rows with no key (i < s-1, masked out of the loss) see key 0
        _MASKS[key] = M.to(device)
    return _MASKS[key]


def assistant_mask(T, s, window, device):
    """Step s of an assistant chain at query position q = p + s - 1: the target keys at positions
    m <= q - s (those cached before the round) with q - m < window."""
    key = ("a", T, s, window, str(device))
    if key not in _MASKS:
        q = torch.arange(T)[:, None]
        m = torch.arange(T)[None, :]
        M = (m <= q - s) & (q - m < window)
        M[:, 0] |= ~M.any(1)
        _MASKS[key] = M.to(device)
    return _MASKS[key]


def shift_right(x):
    """x[:, i] <- x[:, i-1]; row 0 zero."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


class NextNHead(nn.Module):
    def __init__(self, d=640, window=512, rope_base=10000.0, **kw):
        super().__init__()
        self.d, self.window, self.rope_base = d, window, rope_base
        self.eh_proj = nn.Parameter(torch.zeros(d, 2 * d))
        self.enorm = nn.Parameter(torch.ones(d))
        self.hnorm = nn.Parameter(torch.ones(d))
        self.shared_head_norm = nn.Parameter(torch.ones(d))
        self.block = GemmaBlock(d, with_kv=True, **kw)

    def init_from_target(self, hf_model, src_layer):
        self.block.load_from_hf(hf_model.model.layers[src_layer], zero_residual=True)
        with torch.no_grad():
            self.eh_proj.zero_()
            self.eh_proj[:, self.d:] = torch.eye(self.d)
            self.enorm.fill_(1.0)
            self.hnorm.fill_(1.0)
            self.shared_head_norm.copy_(1 + hf_model.model.norm.weight.float())

    def unroll(self, emb_next, H, S):
        """emb_next [B,T,d]: E(t_{i+1})*sqrt(d) (float); H [B,T,d] trunk hidden states.
        Returns per step s the normed output (before the LM head) [B,T,d]: entry i of step s
        predicts t_{i+2} with the chain started at entry i-s+1."""
        B, T, _ = H.shape
        cos, sin = rope_tables(T, self.block.hd, self.rope_base, H.device)
        e = rms(emb_next, self.enorm)
        Ks, Vs, outs = [], [], []
        h = H
        for s in range(1, S + 1):
            x = lin(torch.cat([e, rms(h, self.hnorm)], -1), self.eh_proj)
            y = rms(x, self.block.attn_norm)
            q = self.block.q(y, cos, sin)
            k, v = self.block.kv(y, cos, sin)
            Ks.append(k)
            Vs.append(v)
            a = attend(q, torch.cat(Ks, 2), torch.cat(Vs, 2), nextn_mask(T, s, self.window, H.device), self.block.hd)
            out = self.block.finish(x, _f(a))
            outs.append(rms(out, self.shared_head_norm))
            h = shift_right(out)
        return outs


class AssistantHead(nn.Module):
    def __init__(self, d=640, d_out=640, k_vocab=16384, window=512, rope_base=10000.0, **kw):
        super().__init__()
        self.d, self.window, self.rope_base = d, window, rope_base
        self.pre_projection = nn.Parameter(torch.zeros(d, 2 * d_out))
        self.post_projection = nn.Parameter(torch.zeros(d_out, d))
        self.output_norm = nn.Parameter(torch.ones(d))
        self.token_embd = nn.Parameter(torch.zeros(k_vocab, d))
        self.block = GemmaBlock(d, with_kv=False, **kw)
        self.register_buffer("layer_output_scale", torch.ones(1))

    def init_from_target(self, hf_model, src_layer, vocab_ids):
        self.block.load_from_hf(hf_model.model.layers[src_layer], zero_residual=True)
        d = self.d
        with torch.no_grad():
            self.pre_projection.zero_()
            self.pre_projection[:, d:] = torch.eye(d)
            self.post_projection.copy_(torch.eye(d))
            self.output_norm.copy_(1 + hf_model.model.norm.weight.float())
            E = hf_model.model.embed_tokens.weight
            self.token_embd.copy_(E[vocab_ids.to(E.device)].float().to(self.token_embd.device))

    def unroll(self, emb, H_prev, K16, V16, S):
        """emb [B,T,d]: E(t_q)*sqrt(d); H_prev [B,T,d]: H_{q-1} (row 0 unused); K16/V16 [B,1,T,hd]
        the target's last local layer keys (after norm and RoPE) and values. Returns per step s the
        normed output [B,T,d]: query q of step s predicts t_{q+1}, chain started at p = q-s+1."""
        B, T, _ = emb.shape
        cos, sin = rope_tables(T, self.block.hd, self.rope_base, emb.device)
        outs = []
        h = H_prev
        for s in range(1, S + 1):
            x = lin(torch.cat([emb, _f(h)], -1), self.pre_projection)
            y = rms(x, self.block.attn_norm)
            q = self.block.q(y, cos, sin)
            a = attend(q, K16, V16, assistant_mask(T, s, self.window, emb.device), self.block.hd)
            x = self.block.finish(x, _f(a)) * self.layer_output_scale
            outs.append(rms(x, self.output_norm))
            h = shift_right(lin(x, self.post_projection))
        return outs
