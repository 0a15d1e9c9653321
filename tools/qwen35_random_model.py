#!/usr/bin/env python3
"""A random-weight `qwen35` GGUF at a real Qwen3.5 shape, in llama.cpp's layout, for speed tables:
trained weights cannot be downloaded here, and speed does not depend on the values. Written with
llama.cpp's own gguf-py (the llama-cpp-python sdist's vendor/llama.cpp/gguf-py) with the tensor
names, shapes and metadata llama.cpp's converter writes (norms as 1 + w, `ssm_a` = -exp(A_log),
`attn_q` as [q | gate] per head, the NextN block as `blk.{n_layer}` with `nextn.*`), matrices in
F16; quantize it with llama.cpp's `llama-quantize` (Q4_K_M) for the table.

Shape `0.8b` is Qwen3.5-0.8B's text model as published (hidden 1024, 24 layers with full
attention every 4th, 8 query / 2 KV heads of 256 with a quarter rotated, SwiGLU 3584, delta-net
16 key and 16 value heads of 128, vocabulary 248320, tied embeddings, one MTP layer).
The tokenizer is a stand-in with the real vocabulary size (the 256 byte symbols, one merge,
filler tokens, the chat control tokens): prompts tokenize to bytes, which is all a speed table
needs.

  python3 -m venv /tmp/np && /tmp/np/bin/pip install numpy pyyaml tqdm
  /tmp/np/bin/python tools/qwen35_random_model.py --shape 0.8b --out /tmp/qwen35-0.8b-f16.gguf
  llama-quantize /tmp/qwen35-0.8b-f16.gguf /tmp/qwen35-0.8b-q4_k_m.gguf Q4_K_M
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.environ.get("TINE_PEERS_DIR", os.path.expanduser("~/.cache/tine-peers")), "llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"))
import numpy as np  # noqa: E402
import gguf  # noqa: E402

SHAPES = {
    "0.8b": dict(hidden=1024, layers=24, interval=4, heads=8, kv_heads=2, head_dim=256, ff=3584,
                 hk=16, hv=16, d_state=128, conv=4, vocab=248320, rope_base=1e7, nextn=1),
    # A small shape whose matrices quantize to Q4_K (rows of 256): a few MB, for device checks.
    "small": dict(hidden=256, layers=8, interval=4, heads=4, kv_heads=2, head_dim=64, ff=512,
                  hk=2, hv=4, d_state=64, conv=4, vocab=1024, rope_base=1e7, nextn=1),
    # `qwen35moe`: a small one for device checks, and the A3B class's MoE widths (hidden 2048,
    # 256 experts of 512 rows, 8 a token, a shared expert of 512, 16 / 2 attention heads of 256,
    # 16 key and 32 value delta-net heads of 128) over 4 layers, for per-layer timings.
    "small-moe": dict(hidden=256, layers=8, interval=4, heads=4, kv_heads=2, head_dim=64, ff=512,
                      hk=2, hv=4, d_state=64, conv=4, vocab=1024, rope_base=1e7, nextn=1,
                      experts=16, used=4, expert_ff=256, shared_ff=256),
    "a3b-4l": dict(hidden=2048, layers=4, interval=4, heads=16, kv_heads=2, head_dim=256, ff=512,
                   hk=16, hv=32, d_state=128, conv=4, vocab=248320, rope_base=1e7, nextn=1,
                   experts=256, used=8, expert_ff=512, shared_ff=512),
    # A tiny shape for checking the script itself.
    "test": dict(hidden=64, layers=4, interval=4, heads=2, kv_heads=1, head_dim=32, ff=128,
                 hk=2, hv=4, d_state=16, conv=4, vocab=300, rope_base=1e7, nextn=1),
}


def byte_symbols():
    keep = lambda b: 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255
    out, nxt = [], 256
    for b in range(256):
        if keep(b):
            out.append(chr(b))
        else:
            out.append(chr(nxt))
            nxt += 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    c = SHAPES[a.shape]
    rng = np.random.default_rng(a.seed)
    d, hd, ds, hk, hv = c["hidden"], c["head_dim"], c["d_state"], c["hk"], c["hv"]
    conv_dim = 2 * hk * ds + hv * ds
    moe = "experts" in c
    arch = "qwen35moe" if moe else "qwen35"
    tmp = a.out + ".partial"  # renamed into place once complete
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name(f"{arch}-{a.shape}-random")
    n_blocks = c["layers"] + c["nextn"]
    w.add_block_count(n_blocks)
    w.add_context_length(262144)
    w.add_embedding_length(d)
    w.add_feed_forward_length(c["ff"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(c["rope_base"])
    rope_dim = hd // 4
    w.add_rope_dimension_count(rope_dim)
    half = rope_dim // 2
    w.add_rope_dimension_sections([half - 2 * (half // 3), half // 3, half // 3, 0])
    w.add_ssm_conv_kernel(c["conv"])
    w.add_ssm_state_size(ds)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(hv * ds)
    w.add_full_attention_interval(c["interval"])
    w.add_uint32(f"{arch}.nextn_predict_layers", c["nextn"])
    if moe:
        for key in ("expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length"):
            w.add_uint32(f"{arch}.{key}", c[{"expert_count": "experts", "expert_used_count": "used", "expert_feed_forward_length": "expert_ff", "expert_shared_feed_forward_length": "shared_ff"}[key]])
    # The stand-in tokenizer.
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = byte_symbols() + ["\u0120t"]
    tokens += [f"<filler_{i}>" for i in range(c["vocab"] - len(tokens) - len(specials))] + specials
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(specials)) + [gguf.TokenType.CONTROL] * len(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 t"])
    w.add_eos_token_id(len(tokens) - 1)
    w.add_pad_token_id(len(tokens) - 3)
    w.add_add_bos_token(False)

    def mat(name, rows, cols):
        w.add_tensor(name, (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16))

    def vec(name, n, values=None):
        v = values if values is not None else 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
        w.add_tensor(name, np.asarray(v, dtype=np.float32))

    w.add_tensor("token_embd.weight", rng.standard_normal((c["vocab"], d), dtype=np.float32).astype(np.float16))
    vec("output_norm.weight", d)
    for l in range(n_blocks):
        p = f"blk.{l}."
        vec(p + "attn_norm.weight", d)
        vec(p + "post_attention_norm.weight", d)
        if l == c["layers"] or (l + 1) % c["interval"] == 0:
            mat(p + "attn_q.weight", 2 * c["heads"] * hd, d)
            mat(p + "attn_k.weight", c["kv_heads"] * hd, d)
            mat(p + "attn_v.weight", c["kv_heads"] * hd, d)
            mat(p + "attn_output.weight", d, c["heads"] * hd)
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
        else:
            mat(p + "attn_qkv.weight", conv_dim, d)
            mat(p + "attn_gate.weight", hv * ds, d)
            vec(p + "ssm_conv1d.weight", None, (0.5 * rng.standard_normal((conv_dim, c["conv"]), dtype=np.float32)))
            vec(p + "ssm_dt.bias", hv, rng.standard_normal(hv, dtype=np.float32))
            vec(p + "ssm_a", hv, -np.exp(rng.uniform(-1, 1, hv)).astype(np.float32))
            mat(p + "ssm_beta.weight", hv, d)
            mat(p + "ssm_alpha.weight", hv, d)
            vec(p + "ssm_norm.weight", ds)
            mat(p + "ssm_out.weight", d, hv * ds)
        if moe:
            e, fe, fs = c["experts"], c["expert_ff"], c["shared_ff"]
            w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((e, d), dtype=np.float32) / np.sqrt(d)).astype(np.float32))
            for name, rows, cols in (("ffn_gate_exps", fe, d), ("ffn_up_exps", fe, d), ("ffn_down_exps", d, fe)):
                w.add_tensor(p + name + ".weight", (rng.standard_normal((e, rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16))
            vec(p + "ffn_gate_inp_shexp.weight", d, rng.standard_normal(d, dtype=np.float32) / np.sqrt(d))
            mat(p + "ffn_gate_shexp.weight", fs, d)
            mat(p + "ffn_up_shexp.weight", fs, d)
            mat(p + "ffn_down_shexp.weight", d, fs)
        else:
            mat(p + "ffn_gate.weight", c["ff"], d)
            mat(p + "ffn_up.weight", c["ff"], d)
            mat(p + "ffn_down.weight", d, c["ff"])
        if l == c["layers"]:
            mat(p + "nextn.eh_proj.weight", d, 2 * d)
            vec(p + "nextn.enorm.weight", d)
            vec(p + "nextn.hnorm.weight", d)
            vec(p + "nextn.shared_head_norm.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    os.replace(tmp, a.out)
    print(a.out)


if __name__ == "__main__":
    main()
