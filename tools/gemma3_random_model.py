#!/usr/bin/env python3
"""A random-weight `gemma3` GGUF at a real Gemma 3 shape, in llama.cpp's layout, for speed tables:
trained weights cannot be downloaded here, and speed does not depend on the values. Written with
llama.cpp's own gguf-py (the llama-cpp-python sdist's vendor/llama.cpp/gguf-py) with the tensor
names, shapes and metadata keys that llama.cpp's converter (`Gemma3Model`) writes and `gemma3.cpp`
reads (norms as 1 + w, tied output: no `output.weight`; the converter writes neither the local
rope base nor the sliding-window pattern, so readers take their defaults, 10000 and every 6th layer
global), matrices in F16; quantize it with llama.cpp's `llama-quantize` (Q4_K_M) for the table.

Shape `270m` is Gemma 3 270M as published (hidden 640, 18 layers of which every 6th is global and
the rest slide over 512 positions, 4 query heads and 1 KV head of 256, GeGLU 2048, rope base 1e6
global / 1e4 local, vocabulary 262144, context 32768, tied embeddings).
`small` is a few MB with rows of 256 (Q4_K-quantizable), for device checks: 4 layers, a window of
16 so short prompts run past it, and every 2nd layer global (written as
`gemma3.attention.sliding_window_pattern` for llama.cpp and `gemma3.attention.sliding_window_type`
for candle and Tine, as a shape with no global layer would not check the global path).
`test` is tiny, for checking the script itself.

The tokenizer is a stand-in with the real vocabulary size (SentencePiece-style, as the converter
writes Gemma 3's: the control tokens at Gemma's ids, the 256 byte tokens, a few scored pieces,
filler): prompts tokenize to bytes, which is all a speed table needs.

  python3 -m venv /tmp/np && /tmp/np/bin/pip install numpy pyyaml tqdm
  /tmp/np/bin/python tools/gemma3_random_model.py --shape 270m --out /tmp/gemma3-270m-f16.gguf
  llama-quantize /tmp/gemma3-270m-f16.gguf /tmp/gemma3-270m-q4_k_m.gguf Q4_K_M
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.environ.get("TINE_PEERS_DIR", os.path.expanduser("~/.cache/tine-peers")), "llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"))
import numpy as np  # noqa: E402
import gguf  # noqa: E402

SHAPES = {
    "270m": dict(hidden=640, layers=18, heads=4, kv_heads=1, head_dim=256, ff=2048, vocab=262144,
                 window=512, pattern=6, context=32768),
    # A small shape whose matrices quantize to Q4_K (rows of 256): a few MB, for device checks.
    "small": dict(hidden=256, layers=4, heads=4, kv_heads=1, head_dim=64, ff=512, vocab=1024,
                  window=16, pattern=2, context=32768),
    # A tiny shape for checking the script itself.
    "test": dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, ff=128, vocab=300,
                 window=8, pattern=2, context=4096),
}
ROPE_BASE, ROPE_BASE_LOCAL, EPS = 1_000_000.0, 10_000.0, 1e-6
# llama.cpp's default for gemma3 (`load_swa_pattern(ml, 6)`) and candle's
# (DEFAULT_SLIDING_WINDOW_TYPE): the converter writes no pattern key for it.
DEFAULT_PATTERN = 6


def tokenizer(w, vocab):
    """The stand-in: <pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn>, the byte tokens, a few
    scored pieces, filler. Gemma's ids for the first four (0 pad, 1 eos, 2 bos, 3 unk)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 2
    scores = [0.0] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    scores += [0.0] * 256
    pieces = ["\u2581", "\n", "t", "\u2581t"]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores += [-1.0 - i for i in range(len(pieces))]
    assert vocab > len(tokens), "the vocabulary must hold the stand-in's tokens"
    n_fill = vocab - len(tokens)
    tokens += [f"<filler_{i}>" for i in range(n_fill)]
    types += [gguf.TokenType.NORMAL] * n_fill
    scores += [-1000.0] * n_fill
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="270m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    c = SHAPES[a.shape]
    rng = np.random.default_rng(a.seed)
    d, hd = c["hidden"], c["head_dim"]
    arch = "gemma3"
    tmp = a.out + ".partial"  # renamed into place once complete
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name(f"gemma3-{a.shape}-random")
    w.add_block_count(c["layers"])
    w.add_context_length(c["context"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(c["ff"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_sliding_window(c["window"])
    if c["pattern"] != DEFAULT_PATTERN:
        # Every `pattern`-th layer global: llama.cpp's key, then candle's (and Tine's).
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", c["pattern"])
        w.add_uint32(f"{arch}.attention.sliding_window_type", c["pattern"])
    tokenizer(w, c["vocab"])

    def mat(name, rows, cols, scale=None):
        """An F16 matrix [rows, cols] (ggml's ne = [cols, rows]), filled in row chunks so the
        embedding table (168 M values for 270m) needs no f32 copy."""
        out = np.empty((rows, cols), dtype=np.float16)
        s = (1.0 / np.sqrt(cols)) if scale is None else scale
        step = max(1, (1 << 24) // cols)
        for r in range(0, rows, step):
            n = min(step, rows - r)
            out[r:r + n] = rng.standard_normal((n, cols), dtype=np.float32) * s
        w.add_tensor(name, out)

    def vec(name, n):
        # Stored as the converter stores Gemma's RMSNorm weights: 1 + w.
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32))

    # The embedding is scaled by sqrt(hidden) on the way in and is the tied output projection:
    # rows of std 1/sqrt(hidden) give the residual stream and the logits a scale of about 1.
    mat("token_embd.weight", c["vocab"], d, 1.0 / np.sqrt(d))
    vec("output_norm.weight", d)
    for l in range(c["layers"]):
        p = f"blk.{l}."
        vec(p + "attn_norm.weight", d)
        mat(p + "attn_q.weight", c["heads"] * hd, d)
        mat(p + "attn_k.weight", c["kv_heads"] * hd, d)
        mat(p + "attn_v.weight", c["kv_heads"] * hd, d)
        mat(p + "attn_output.weight", d, c["heads"] * hd)
        vec(p + "attn_q_norm.weight", hd)
        vec(p + "attn_k_norm.weight", hd)
        vec(p + "post_attention_norm.weight", d)
        vec(p + "ffn_norm.weight", d)
        mat(p + "ffn_gate.weight", c["ff"], d)
        mat(p + "ffn_up.weight", c["ff"], d)
        mat(p + "ffn_down.weight", d, c["ff"])
        vec(p + "post_ffw_norm.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    os.replace(tmp, a.out)
    print(a.out)


if __name__ == "__main__":
    main()
