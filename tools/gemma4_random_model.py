#!/usr/bin/env python3
"""A random-weight `gemma4` GGUF (and its `gemma4-assistant`) at a published Gemma 4 shape, in
llama.cpp's layout, for speed tables: trained weights cannot be downloaded here, and speed does not
depend on the values. Written with llama.cpp's own gguf-py (the llama-cpp-python sdist's
vendor/llama.cpp/gguf-py) with the tensor names, shapes and metadata keys that llama.cpp's converter
and `gemma4.cpp` use (the same keys as tine-test-support's gemma4_fixture); matrices in F16, to be
quantized with llama.cpp's `llama-quantize` (Q4_K_M) for the table.

Shape `e2b` is Gemma 4 E2B's text model as transformers' convert_gemma4_weights.py defines it:
hidden 1536, 35 layers (4 sliding + 1 global, seven times), 8 query heads and 1 KV head of 256
(sliding) / 512 (global, a quarter of its pairs rotated through rope_freqs), sliding window 512,
FFN 6144 (12288 on the 20 KV-shared layers: the double-wide MLP), per-layer embeddings of 256 per
layer, vocabulary 262144, tied output, final softcapping 30.
Shape `e2b-assistant` is its assistant (`gemma4-e2b-assistant`): hidden 256, 4 blocks (3 sliding +
1 global) of 4 query heads over the target's K/V, FFN 2048, the target's head sizes, ordered
embeddings (2048 centroids, 32 scored per draft) over the target's vocabulary.
`small-dense` (31B-like: k_eq_v, fewer global KV heads), `small-e2b` (E-series) and `small-a4b`
(26B-A4B-like MoE), with `small-e2b-assistant` / `small-dense-assistant` / `small-a4b-assistant`,
are a few MB each with
rows of 256 (Q4_K-quantizable), for checks on a device machine (tools/cuda/gemma4_job.sh).
`a4b-6l` is 26B-A4B's MoE widths over 6 layers (about 11 GB of F16) for the MoE speed table.
`test` and `test-assistant` are tiny, for checking the script itself.

The tokenizer is a stand-in with the real vocabulary size (the control tokens, the 256 byte
tokens, a few pieces, filler): prompts tokenize to bytes, which is all a speed table needs.

  python3 -m venv /tmp/np && /tmp/np/bin/pip install numpy pyyaml tqdm
  /tmp/np/bin/python tools/gemma4_random_model.py --shape e2b --out /tmp/g4-e2b-f16.gguf
  /tmp/np/bin/python tools/gemma4_random_model.py --shape e2b-assistant --out /tmp/g4-e2b-assistant-f16.gguf
  llama-quantize /tmp/g4-e2b-f16.gguf /tmp/g4-e2b-q4_k_m.gguf Q4_K_M
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.environ.get("TINE_PEERS_DIR", os.path.expanduser("~/.cache/tine-peers")), "llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"))
import numpy as np  # noqa: E402
import gguf  # noqa: E402

TARGETS = {
    "e2b": dict(hidden=1536, groups=7, pattern=[True] * 4 + [False], heads=8, kv_swa=1, kv_global=1,
                hd_swa=256, hd_global=512, rot_frac=0.25, ff=6144, ff_shared=12288, shared_kv=20,
                per_layer=256, window=512, vocab=262144, softcap=30.0),
    # Small shapes whose matrices quantize to Q4_K (rows of 256): a few MB each, for device checks.
    # `small-dense`: 31B-like (k_eq_v global layers with fewer KV heads, no PLE);
    # `small-e2b`: E-series (PLE, KV-shared layers, double-wide MLP); `small-a4b`: 26B-A4B-like MoE.
    "small-dense": dict(hidden=256, groups=2, pattern=[True, True, False], heads=4, kv_swa=2, kv_global=1,
                        hd_swa=64, hd_global=128, rot_frac=0.25, ff=512, ff_shared=512, shared_kv=0,
                        per_layer=0, window=16, vocab=4096, softcap=30.0, k_eq_v=True),
    "small-e2b": dict(hidden=256, groups=2, pattern=[True, True, False], heads=4, kv_swa=1, kv_global=1,
                      hd_swa=64, hd_global=128, rot_frac=0.25, ff=512, ff_shared=1024, shared_kv=3,
                      per_layer=64, window=16, vocab=4096, softcap=30.0),
    "small-a4b": dict(hidden=256, groups=2, pattern=[True, True, False], heads=4, kv_swa=2, kv_global=1,
                      hd_swa=64, hd_global=128, rot_frac=0.25, ff=256, ff_shared=256, shared_kv=0,
                      per_layer=0, window=16, vocab=4096, softcap=30.0, k_eq_v=True,
                      experts=8, experts_used=2, expert_ff=256),
    # 26B-A4B's MoE widths (hidden 2816, 128 experts of 704, 8 a token, a dense MLP of 2112 beside
    # them; k_eq_v global layers) over one group of 6 layers (5 sliding, 1 global), the full
    # vocabulary: about 11 GB of F16, for the MoE speed table. Attention heads as the 31B-style
    # layers have them at this width (16 query heads; 8 KV heads of 256 sliding, 2 of 512 global).
    "a4b-6l": dict(hidden=2816, groups=1, pattern=[True] * 5 + [False], heads=16, kv_swa=8, kv_global=2,
                   hd_swa=256, hd_global=512, rot_frac=0.25, ff=2112, ff_shared=2112, shared_kv=0,
                   per_layer=0, window=1024, vocab=262144, softcap=30.0, k_eq_v=True,
                   experts=128, experts_used=8, expert_ff=704),
    # E2B's widths over 10 layers (the KV-shared ones with a global owner before them) and a small vocabulary (a few hundred MB): `mid-e2b`, and the
    # same with one E2B feature taken out each, to find which one a difference follows.
    "mid-e2b": dict(hidden=1536, groups=2, pattern=[True] * 4 + [False], heads=8, kv_swa=1, kv_global=1,
                    hd_swa=256, hd_global=512, rot_frac=0.25, ff=6144, ff_shared=12288, shared_kv=5,
                    per_layer=256, window=512, vocab=4096, softcap=30.0),
    "mid-e2b-narrow": dict(hidden=1536, groups=2, pattern=[True] * 4 + [False], heads=8, kv_swa=1, kv_global=1,
                           hd_swa=256, hd_global=512, rot_frac=0.25, ff=6144, ff_shared=6144, shared_kv=5,
                           per_layer=256, window=512, vocab=4096, softcap=30.0),
    "mid-e2b-hd": dict(hidden=1536, groups=2, pattern=[True] * 4 + [False], heads=8, kv_swa=1, kv_global=1,
                       hd_swa=64, hd_global=128, rot_frac=0.25, ff=6144, ff_shared=12288, shared_kv=5,
                       per_layer=256, window=512, vocab=4096, softcap=30.0),
    "mid-e2b-noshare": dict(hidden=1536, groups=2, pattern=[True] * 4 + [False], heads=8, kv_swa=1, kv_global=1,
                            hd_swa=256, hd_global=512, rot_frac=0.25, ff=6144, ff_shared=12288, shared_kv=0,
                            per_layer=256, window=512, vocab=4096, softcap=30.0),
    "test": dict(hidden=64, groups=2, pattern=[True, True, False], heads=2, kv_swa=1, kv_global=1,
                 hd_swa=32, hd_global=64, rot_frac=0.25, ff=128, ff_shared=256, shared_kv=3,
                 per_layer=32, window=8, vocab=400, softcap=30.0),
}
ASSISTANTS = {
    "e2b-assistant": dict(target="e2b", hidden=256, pattern=[True, True, True, False], heads=4, ff=2048,
                          centroids=2048, centroid_top_k=32),
    "small-e2b-assistant": dict(target="small-e2b", hidden=256, pattern=[True, False], heads=4, ff=512,
                                centroids=32, centroid_top_k=4),
    "small-dense-assistant": dict(target="small-dense", hidden=256, pattern=[True, False], heads=4, ff=512,
                                  centroids=0, centroid_top_k=0),
    "small-a4b-assistant": dict(target="small-a4b", hidden=256, pattern=[True, False], heads=4, ff=512,
                                centroids=0, centroid_top_k=0),
    "test-assistant": dict(target="test", hidden=32, pattern=[True, False], heads=2, ff=64,
                           centroids=16, centroid_top_k=4),
}
ROPE_BASE, ROPE_BASE_SWA, EPS = 1_000_000.0, 10_000.0, 1e-6


def tokenizer(w, vocab):
    """The stand-in: <pad> <eos> <bos> <|turn> <turn|>, the byte tokens, a few pieces, filler."""
    tokens = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"]
    types = [gguf.TokenType.CONTROL] * 5
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += ["\u2581", "\n", "t", "\u2581t"]
    types += [gguf.TokenType.NORMAL] * 4
    assert vocab > len(tokens), "the vocabulary must hold the stand-in's tokens"
    tokens += [f"<filler_{i}>" for i in range(vocab - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("gemma4")
    w.add_tokenizer_pre("gemma4")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["\u2581 t"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)


class Writer:
    def __init__(self, path, arch, rng):
        self.tmp = path + ".partial"  # renamed into place once complete
        self.path, self.arch, self.rng = path, arch, rng
        self.w = gguf.GGUFWriter(self.tmp, arch)

    def key(self, k, v):
        k = f"{self.arch}.{k}"
        if isinstance(v, bool):
            self.w.add_bool(k, v)
        elif isinstance(v, float):
            self.w.add_float32(k, v)
        elif isinstance(v, int):
            self.w.add_uint32(k, v)
        elif isinstance(v, list) and all(isinstance(x, bool) for x in v):
            self.w.add_array(k, v)
        else:
            self.w.add_array(k, [int(x) for x in v])

    def mat(self, name, rows, cols, scale=None):
        """An F16 matrix [rows, cols] (ggml's ne = [cols, rows]), filled in row chunks so the
        largest (the per-layer embedding table, 2.3 G values for E2B) needs no f32 copy."""
        out = np.empty((rows, cols), dtype=np.float16)
        s = (1.0 / np.sqrt(cols)) if scale is None else scale
        step = max(1, (1 << 24) // cols)
        for r in range(0, rows, step):
            n = min(step, rows - r)
            out[r:r + n] = self.rng.standard_normal((n, cols), dtype=np.float32) * s
        self.w.add_tensor(name, out)

    def tensor3(self, name, n, rows, cols):
        """Stacked F16 matrices [n, rows, cols] (the experts of a MoE block)."""
        m = self.rng.standard_normal((n, rows, cols), dtype=np.float32) / np.sqrt(cols)
        self.w.add_tensor(name, m.astype(np.float16))

    def vec(self, name, n, values=None):
        v = values if values is not None else 1.0 + 0.1 * self.rng.standard_normal(n, dtype=np.float32)
        self.w.add_tensor(name, np.asarray(v, dtype=np.float32))

    def close(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file(progress=True)
        self.w.close()
        os.replace(self.tmp, self.path)
        print(self.path)


def rope_freqs(c):
    half = c["hd_global"] // 2
    rotated = int(round(c["rot_frac"] * half))
    return np.array([1.0 if i < rotated else 1e30 for i in range(half)], dtype=np.float32)


def write_target(c, name, out, seed):
    pattern = c["pattern"] * c["groups"]
    n_layer = len(pattern)
    kv_layers = n_layer - c["shared_kv"]
    d, p = c["hidden"], c["per_layer"]
    w = Writer(out, "gemma4", np.random.default_rng(seed))
    w.w.add_name(f"gemma4-{name}-random")
    ff = [c["ff_shared"] if l >= kv_layers else c["ff"] for l in range(n_layer)]
    for k, v in [
        ("block_count", n_layer), ("context_length", 131072), ("embedding_length", d),
        ("feed_forward_length", ff if len(set(ff)) > 1 else ff[0]),
        ("attention.head_count", c["heads"]),
        ("attention.head_count_kv", c["kv_swa"] if c["kv_swa"] == c["kv_global"] else [c["kv_swa"] if s else c["kv_global"] for s in pattern]),
        ("attention.key_length", c["hd_global"]), ("attention.value_length", c["hd_global"]),
        ("attention.key_length_swa", c["hd_swa"]), ("attention.value_length_swa", c["hd_swa"]),
        ("attention.layer_norm_rms_epsilon", EPS), ("attention.sliding_window", c["window"]),
        ("attention.sliding_window_pattern", pattern), ("attention.shared_kv_layers", c["shared_kv"]),
        ("rope.freq_base", ROPE_BASE), ("rope.freq_base_swa", ROPE_BASE_SWA),
        ("rope.dimension_count", c["hd_global"]), ("rope.dimension_count_swa", c["hd_swa"]),
        ("embedding_length_per_layer_input", p), ("final_logit_softcapping", c["softcap"]),
    ] + ([("expert_count", c["experts"]), ("expert_used_count", c["experts_used"]),
          ("expert_feed_forward_length", c["expert_ff"])] if c.get("experts") else []):
        w.key(k, v)
    tokenizer(w.w, c["vocab"])
    w.mat("token_embd.weight", c["vocab"], d, 1.0)
    w.vec("output_norm.weight", d)
    w.vec("rope_freqs.weight", None, rope_freqs(c))
    if p:
        w.mat("per_layer_token_embd.weight", c["vocab"], n_layer * p, 1.0)
        w.mat("per_layer_model_proj.weight", n_layer * p, d)
        w.vec("per_layer_proj_norm.weight", p)
    for l, sliding in enumerate(pattern):
        pre = f"blk.{l}."
        hd = c["hd_swa"] if sliding else c["hd_global"]
        nkv = c["kv_swa"] if sliding else c["kv_global"]
        w.vec(pre + "attn_norm.weight", d)
        w.mat(pre + "attn_q.weight", c["heads"] * hd, d)
        w.vec(pre + "attn_q_norm.weight", hd)
        if l < kv_layers:
            w.mat(pre + "attn_k.weight", nkv * hd, d)
            w.vec(pre + "attn_k_norm.weight", hd)
            if sliding or not c.get("k_eq_v"):
                w.mat(pre + "attn_v.weight", nkv * hd, d)
        w.mat(pre + "attn_output.weight", d, c["heads"] * hd)
        w.vec(pre + "post_attention_norm.weight", d)
        w.vec(pre + "ffn_norm.weight", d)
        w.mat(pre + "ffn_gate.weight", ff[l], d)
        w.mat(pre + "ffn_up.weight", ff[l], d)
        w.mat(pre + "ffn_down.weight", d, ff[l])
        w.vec(pre + "post_ffw_norm.weight", d)
        if c.get("experts"):
            e, fe = c["experts"], c["expert_ff"]
            w.mat(pre + "ffn_gate_inp.weight", e, d, 4.0 / np.sqrt(d))
            w.vec(pre + "ffn_gate_inp.scale", d)
            w.tensor3(pre + "ffn_gate_up_exps.weight", e, 2 * fe, d)
            w.tensor3(pre + "ffn_down_exps.weight", e, d, fe)
            w.vec(pre + "ffn_down_exps.scale", e)
            w.vec(pre + "pre_ffw_norm_2.weight", d)
            w.vec(pre + "post_ffw_norm_1.weight", d)
            w.vec(pre + "post_ffw_norm_2.weight", d)
        if p:
            w.mat(pre + "inp_gate.weight", p, d)
            w.mat(pre + "proj.weight", d, p)
            w.vec(pre + "post_norm.weight", d)
        w.vec(pre + "layer_output_scale.weight", 1, [0.8])
    w.close()


def write_assistant(a, name, out, seed):
    c = TARGETS[a["target"]]
    d, dt, vocab = a["hidden"], c["hidden"], c["vocab"]
    rng = np.random.default_rng(seed)
    w = Writer(out, "gemma4-assistant", rng)
    w.w.add_name(f"gemma4-{name}-random")
    n = len(a["pattern"])
    for k, v in [
        ("block_count", n), ("nextn_predict_layers", n), ("context_length", 131072), ("embedding_length", d),
        ("embedding_length_out", dt), ("feed_forward_length", a["ff"]),
        ("attention.head_count", a["heads"]), ("attention.head_count_kv", c["kv_swa"]),
        ("attention.key_length", c["hd_global"]), ("attention.value_length", c["hd_global"]),
        ("attention.key_length_swa", c["hd_swa"]), ("attention.value_length_swa", c["hd_swa"]),
        ("attention.layer_norm_rms_epsilon", EPS), ("attention.sliding_window", c["window"]),
        ("attention.sliding_window_pattern", a["pattern"]), ("attention.shared_kv_layers", n),
        ("rope.freq_base", ROPE_BASE), ("rope.freq_base_swa", ROPE_BASE_SWA),
        ("rope.dimension_count", c["hd_global"]), ("rope.dimension_count_swa", c["hd_swa"]),
        ("centroid_intermediate_top_k", a["centroid_top_k"]),
    ]:
        w.key(k, v)
    w.mat("token_embd.weight", vocab, d, 1.0)
    w.vec("output_norm.weight", d)
    w.mat("nextn.pre_projection.weight", d, 2 * dt)
    w.mat("nextn.post_projection.weight", dt, d)
    w.vec("rope_freqs.weight", None, rope_freqs(c))
    for i, sliding in enumerate(a["pattern"]):
        pre = f"blk.{i}."
        hd = c["hd_swa"] if sliding else c["hd_global"]
        w.vec(pre + "attn_norm.weight", d)
        w.mat(pre + "attn_q.weight", a["heads"] * hd, d)
        w.vec(pre + "attn_q_norm.weight", hd)
        w.mat(pre + "attn_output.weight", d, a["heads"] * hd)
        w.vec(pre + "post_attention_norm.weight", d)
        w.vec(pre + "ffn_norm.weight", d)
        w.mat(pre + "ffn_gate.weight", a["ff"], d)
        w.mat(pre + "ffn_up.weight", a["ff"], d)
        w.mat(pre + "ffn_down.weight", d, a["ff"])
        w.vec(pre + "post_ffw_norm.weight", d)
        w.vec(pre + "layer_output_scale.weight", 1, [0.8])
    if a["centroids"]:
        w.mat("masked_embd_centroids.weight", a["centroids"], d, 1.0)
        # A fixed shuffle of the vocabulary: cluster k holds ordering[k*per:(k+1)*per].
        w.vec("masked_embd_ordering", None, rng.permutation(vocab).astype(np.float32))
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(TARGETS) + sorted(ASSISTANTS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.shape in TARGETS:
        write_target(TARGETS[a.shape], a.shape, a.out, a.seed)
    else:
        write_assistant(ASSISTANTS[a.shape], a.shape, a.out, a.seed)


if __name__ == "__main__":
    main()
