#!/usr/bin/env python3
"""transformers' reference for candle's qwen35: the same weights through `Qwen3_5ForCausalLM` /
`Qwen3_5MoeForCausalLM` and the NextN head through transformers' generic `MtpLayer`.

Reads each `qwen35`/`qwen35moe` GGUF (F32 tensors, llama.cpp's layout) with llama.cpp's own
gguf-py, maps it back to the Hugging Face checkpoint's layout (the inverse of llama.cpp's
converter, shared/reference/model-families.md section b):
  - every `*norm` but the delta-net's gated norm is stored as 1 + w: subtract 1;
  - `ssm_a` holds -exp(A_log): A_log = log(-ssm_a);
  - value heads are stored tiled (GGUF head j*H_k + k reads key head k), transformers groups
    them (head k*r + j, r = H_v / H_k): reorder the V rows of in_proj_qkv and conv1d, the rows of
    in_proj_z / in_proj_a / in_proj_b, A_log, dt_bias and the columns of out_proj;
  - the NextN block `blk.{n_layer}` becomes an `MtpLayer`: nextn.eh_proj -> eh_proj,
    enorm, hnorm, shared_head_norm -> post_norm, the block's tensors -> mtp_block.
Then runs, in f32 (transformers' own precision: its norms, gates and delta rule cast to f32):
  - the trunk over each prompt in one call (its chunked delta rule, chunk 64), logits at the
    recorded positions;
  - cached one-token decode steps after it (its recurrent delta rule), greedy;
  - the head over teacher-forced entries: entry j reads the trunk's hidden state j (after the
    output norm) and token j + 1, at position j + 1, causal over the entries.
Writes the text file the test `the_forward_and_nextn_head_match_transformers_on_the_same_weights`
(patch 0025) reads: `fixture NAME`, `tokens ...`, `logits POS ...`, `decode TOKEN ...`,
`nextn ENTRY ...`.

  # the GGUFs, from the fixture definitions in tine-test-support (qwen35_fixture):
  (cd engine && TINE_QWEN35_HF_DIR=/tmp/q35hf cargo test --release -p tine-patch-tests \
      --test quantized_qwen35 write_the_transformers_fixtures -- --ignored)
  # torch (the CUDA wheel runs on the CPU) and transformers >= 5.23:
  python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers==5.25.0 numpy pyyaml
  /tmp/hfvenv/bin/python tools/qwen35_transformers_reference.py /tmp/q35hf \
      engine/crates/tine-test-support/data/qwen35_transformers.txt
"""
import os
import sys

sys.path.insert(0, os.path.join(os.environ.get("TINE_PEERS_DIR", os.path.expanduser("~/.cache/tine-peers")), "llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from transformers.modeling_layers import MtpLayer, MtpModel  # noqa: E402

# Fixed prompts (ids below every fixture's vocabulary): one short, one past HF's 64-token chunk.
SHORT = [3, 17, 40, 2, 88, 5, 61, 9, 33]
LONG = [(7 * i * i + 3 * i + 1) % 90 for i in range(70)]
DECODE_STEPS = {"short": 4, "long": 3}
LONG_TAIL = 3  # positions (and head entries) recorded at the end of the long prompt


def read(path):
    r = GGUFReader(path)

    def kv(k, default=None):
        if k not in r.fields:
            return default
        f = r.fields[k]
        v = f.parts[f.data[0]] if len(f.data) == 1 else [f.parts[i][0] for i in f.data]
        if isinstance(v, np.ndarray):
            v = bytes(v).decode() if v.dtype == np.uint8 else v[0]
        return v

    tensors = {}
    for t in r.tensors:
        if t.tensor_type.name != "F32":
            sys.exit(f"{path}: {t.name} is {t.tensor_type.name}; this reference reads F32 fixtures only")
        a = np.array(t.data, dtype=np.float32)
        tensors[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else a.reshape(-1)
    return kv, tensors


def hf_model(path):
    kv, T = read(path)
    arch = kv("general.architecture")
    if arch not in ("qwen35", "qwen35moe"):
        sys.exit(f"{path}: architecture {arch!r} is not qwen35 or qwen35moe")
    k = lambda name, d=None: kv(f"{arch}.{name}", d)  # noqa: E731
    n_nextn = int(k("nextn_predict_layers", 0))
    n_layer = int(k("block_count")) - n_nextn
    d, hd, nrot = int(k("embedding_length")), int(k("attention.key_length")), int(k("rope.dimension_count"))
    hk, hv, ds = int(k("ssm.group_count")), int(k("ssm.time_step_rank")), int(k("ssm.state_size"))
    interval = int(k("full_attention_interval"))
    vocab = T["token_embd.weight"].shape[0]
    tied = "output.weight" not in T
    common = dict(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=n_layer,
        num_attention_heads=int(k("attention.head_count")), num_key_value_heads=int(k("attention.head_count_kv")),
        head_dim=hd, rms_norm_eps=float(k("attention.layer_norm_rms_epsilon")), hidden_act="silu",
        max_position_embeddings=int(k("context_length")), tie_word_embeddings=tied, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(k("rope.freq_base")), "partial_rotary_factor": nrot / hd,
                         "mrope_section": [int(x) for x in k("rope.dimension_sections")][:3], "mrope_interleaved": True},
        linear_conv_kernel_dim=int(k("ssm.conv_kernel")), linear_key_head_dim=ds, linear_value_head_dim=ds,
        linear_num_key_heads=hk, linear_num_value_heads=hv,
        layer_types=["full_attention" if (l + 1) % interval == 0 else "linear_attention" for l in range(n_layer)],
    )
    if arch == "qwen35":
        from transformers import Qwen3_5ForCausalLM as Model, Qwen3_5TextConfig as Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer, Qwen3_5RMSNorm as Norm
        cfg = Config(intermediate_size=int(k("feed_forward_length")), **common)
    else:
        from transformers import Qwen3_5MoeForCausalLM as Model, Qwen3_5MoeTextConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as Layer, Qwen3_5MoeRMSNorm as Norm
        cfg = Config(num_experts=int(k("expert_count")), num_experts_per_tok=int(k("expert_used_count")),
                     moe_intermediate_size=int(k("expert_feed_forward_length")),
                     shared_expert_intermediate_size=int(k("expert_shared_feed_forward_length")), **common)
    cfg._attn_implementation = "eager"

    # GGUF value head g = j*H_k + kh  <->  HF value head h = kh*r + j.
    r = hv // hk
    perm = np.array([(h % r) * hk + h // r for h in range(hv)])

    def heads(a, axis=0):
        """Reorder value-head blocks (tiled -> grouped) along `axis`."""
        a = np.moveaxis(a, axis, 0)
        blk = a.reshape(hv, a.shape[0] // hv, *a.shape[1:])[perm].reshape(a.shape)
        return np.moveaxis(blk, 0, axis)

    sd = {}
    one = lambda name: T[name] - np.float32(1.0)  # noqa: E731  (norms stored as 1 + w)

    def block(p, q):
        """GGUF block `p` into HF decoder-layer prefix `q` (names ending in '.')."""
        sd[q + "input_layernorm.weight"] = one(f"{p}.attn_norm.weight")
        sd[q + "post_attention_layernorm.weight"] = one(f"{p}.post_attention_norm.weight")
        if f"{p}.attn_q.weight" in T:
            for g, h in [("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")]:
                sd[q + f"self_attn.{h}.weight"] = T[f"{p}.{g}.weight"]
            sd[q + "self_attn.q_norm.weight"] = one(f"{p}.attn_q_norm.weight")
            sd[q + "self_attn.k_norm.weight"] = one(f"{p}.attn_k_norm.weight")
        else:
            kd = hk * ds
            qkv = T[f"{p}.attn_qkv.weight"]
            sd[q + "linear_attn.in_proj_qkv.weight"] = np.concatenate([qkv[: 2 * kd], heads(qkv[2 * kd:])])
            conv = T[f"{p}.ssm_conv1d.weight"]
            sd[q + "linear_attn.conv1d.weight"] = np.concatenate([conv[: 2 * kd], heads(conv[2 * kd:])])[:, None, :]
            sd[q + "linear_attn.in_proj_z.weight"] = heads(T[f"{p}.attn_gate.weight"])
            sd[q + "linear_attn.in_proj_b.weight"] = heads(T[f"{p}.ssm_beta.weight"])
            sd[q + "linear_attn.in_proj_a.weight"] = heads(T[f"{p}.ssm_alpha.weight"])
            sd[q + "linear_attn.A_log"] = heads(np.log(-T[f"{p}.ssm_a"].astype(np.float64)).astype(np.float32))
            sd[q + "linear_attn.dt_bias"] = heads(T[f"{p}.ssm_dt.bias"])
            sd[q + "linear_attn.norm.weight"] = T[f"{p}.ssm_norm.weight"]
            sd[q + "linear_attn.out_proj.weight"] = heads(T[f"{p}.ssm_out.weight"], axis=1)
        if arch == "qwen35":
            for g, h in [("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")]:
                sd[q + f"mlp.{h}.weight"] = T[f"{p}.{g}.weight"]
        else:
            sd[q + "mlp.gate.weight"] = T[f"{p}.ffn_gate_inp.weight"]
            fused = T.get(f"{p}.ffn_gate_up_exps.weight")
            if fused is None:
                fused = np.concatenate([T[f"{p}.ffn_gate_exps.weight"], T[f"{p}.ffn_up_exps.weight"]], axis=1)
            sd[q + "mlp.experts.gate_up_proj"] = fused
            sd[q + "mlp.experts.down_proj"] = T[f"{p}.ffn_down_exps.weight"]
            sd[q + "mlp.shared_expert_gate.weight"] = T[f"{p}.ffn_gate_inp_shexp.weight"].reshape(1, d)
            for g, h in [("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"), ("ffn_down_shexp", "down_proj")]:
                sd[q + f"mlp.shared_expert.{h}.weight"] = T[f"{p}.{g}.weight"]

    sd["model.embed_tokens.weight"] = T["token_embd.weight"]
    sd["model.norm.weight"] = one("output_norm.weight")
    sd["lm_head.weight"] = T["token_embd.weight"] if tied else T["output.weight"]
    for l in range(n_layer):
        block(f"blk.{l}", f"model.layers.{l}.")
    trunk_keys = set(sd)
    torch.manual_seed(0)
    model = Model(cfg).eval()
    trunk = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in sd.items()}
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        sys.exit(f"{path}: the mapped weights do not fit {Model.__name__}: missing {missing}, unexpected {unexpected}")

    head = None
    if n_nextn:
        p = f"blk.{n_layer}"
        # transformers' generic MTP stack builds exactly this head from the trunk's classes
        # (model-families.md: num_mtp_layers = 1, one full-attention layer).
        cfg.num_mtp_layers, cfg.mtp_layer_types = 1, ["full_attention"]
        mtp = MtpModel(model, 1).eval()
        head = mtp.layers[0]
        assert isinstance(head, MtpLayer) and isinstance(head.mtp_block, Layer) and isinstance(head.enorm, Norm)
        sd.clear()
        block(p, "mtp_block.")
        sd["eh_proj.weight"] = T[f"{p}.nextn.eh_proj.weight"]
        sd["enorm.weight"] = one(f"{p}.nextn.enorm.weight")
        sd["hnorm.weight"] = one(f"{p}.nextn.hnorm.weight")
        sd["post_norm.weight"] = one(f"{p}.nextn.shared_head_norm.weight")
        head.load_state_dict({n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in sd.items()}, strict=True)
        assert not (set(sd) & trunk_keys)
        # MtpModel shares the trunk's embedding and lm_head and initialises what it builds:
        # load the trunk again so nothing it touched stays.
        model.load_state_dict(trunk, strict=False)
    return model, head


def causal(n):
    m = torch.full((n, n), float("-inf")).triu(1)
    return m[None, None]


@torch.no_grad()
def run(model, head, tokens, steps, tail):
    ids = torch.tensor([tokens])
    n = len(tokens)
    out = model.model(input_ids=ids, use_cache=True)
    hidden = out.last_hidden_state  # after the output norm
    logits = model.lm_head(hidden)[0]
    rec = {"logits": [(p, logits[p]) for p in range(n - tail if tail else 0, n)]}
    cache, nxt, dec = out.past_key_values, int(logits[-1].argmax()), []
    for i in range(steps):
        step = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True, position_ids=torch.tensor([[n + i]]))
        cache = step.past_key_values
        dec.append((nxt, step.logits[0, -1]))
        nxt = int(step.logits[0, -1].argmax())
    rec["decode"] = dec
    if head is not None:
        e = n - 1
        pos = torch.arange(1, n)[None]
        emb = model.model.embed_tokens(ids[:, 1:])
        pe = model.model.rotary_emb(emb, pos)
        h = head(emb, hidden[:, :e], pe, causal(e), pos, None)
        hl = model.lm_head(h)[0]
        rec["nextn"] = [(j, hl[j]) for j in range(e - tail if tail else 0, e)]
    return rec


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    names = sorted(f[:-5] for f in os.listdir(src) if f.endswith(".gguf"))
    if not names:
        sys.exit(f"no .gguf in {src}")
    fmt = lambda v: " ".join(f"{float(x):.7g}" for x in v)  # noqa: E731
    lines = [f"# tools/qwen35_transformers_reference.py: transformers {transformers.__version__}, torch {torch.__version__}, f32"]
    for name in names:
        model, head = hf_model(os.path.join(src, f"{name}.gguf"))
        lines.append(f"fixture {name}")
        for label, tokens in [("short", SHORT), ("long", LONG)]:
            rec = run(model, head, tokens, DECODE_STEPS[label], LONG_TAIL if label == "long" else 0)
            lines.append("tokens " + " ".join(map(str, tokens)))
            lines += [f"logits {p} {fmt(v)}" for p, v in rec["logits"]]
            lines += [f"decode {t} {fmt(v)}" for t, v in rec["decode"]]
            lines += [f"nextn {j} {fmt(v)}" for j, v in rec.get("nextn", [])]
    tmp = dst + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, dst)
    print(f"wrote {dst}: {len(names)} fixtures, {len(lines)} lines")


if __name__ == "__main__":
    main()
