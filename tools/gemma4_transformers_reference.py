#!/usr/bin/env python3
"""transformers' reference for candle's gemma4: the same weights through `Gemma4ForCausalLM`
and, for the assistant, `Gemma4AssistantForCausalLM` driven as transformers' own
`SinglePositionMultiTokenCandidateGenerator` drives it (first draft round after a prompt).

Reads each `gemma4` GGUF (F32 tensors, llama.cpp's layout) with llama.cpp's gguf-py and maps it
back to the checkpoint's layout (Gemma 4 norms are stored as multipliers by the converter, so
no shift; `ffn_norm` -> pre_feedforward_layernorm, `post_ffw_norm` -> post_feedforward_layernorm,
`layer_output_scale` -> layer_scalar, `rope_freqs`' rotated pairs -> the proportional RoPE's
partial_rotary_factor, per-layer embeddings, the MoE router's scale and per-expert scale). For a
`gemma4-assistant` GGUF (`NAME-assistant*.gguf` beside its target `NAME.gguf`): token_embd ->
lm_head and embed_tokens, nextn.pre/post_projection, the q-only blocks, and the ordered
embeddings (`masked_embd_centroids`, `masked_embd_ordering`) when present.

Runs in f32 (transformers' precision): the trunk's logits over a 9-token prompt and over one of
70 (past the fixtures' window), cached one-token decode steps; the assistant's first round: the
target over a 9-token prompt (shorter than the assistant fixtures' window, where transformers'
bidirectional window and llama.cpp's agree), then four draft steps at the constant position 9
from a fixed token, each feeding its argmax and h' to the next.
Writes the text file `quantized_gemma4`'s `the_forward_and_assistant_match_transformers` reads.

  (cd engine && TINE_GEMMA4_HF_DIR=/tmp/g4hf cargo test --release -p tine-patch-tests \\
      --test quantized_gemma4_assistant write_the_transformers_fixtures -- --ignored)
  /tmp/hfvenv/bin/python tools/gemma4_transformers_reference.py /tmp/g4hf \\
      engine/crates/tine-test-support/data/gemma4_transformers.txt
  (venv: pip install torch transformers==5.25.0 numpy pyyaml; 5.23 cannot build the assistant)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
# The GGUF reader (llama.cpp's gguf-py, F32 tensors shaped [out, in]) is the qwen35 script's.
from qwen35_transformers_reference import read  # noqa: E402

SHORT = [3, 17, 40, 2, 88, 5, 61, 9, 33]
LONG = [(7 * i * i + 3 * i + 1) % 90 for i in range(70)]
DECODE_STEPS = {"short": 4, "long": 3}
LONG_TAIL = 3
DRAFT_TOKEN = 5
DRAFT_STEPS = 4


def per_layer(v, n):
    return [int(x) for x in v] if isinstance(v, list) else [int(v)] * n


def text_config(kv, T, arch, n_layer, vocab, assistant=False):
    k = lambda name, d=None: kv(f"{arch}.{name}", d)  # noqa: E731
    pattern = [bool(x) for x in k("attention.sliding_window_pattern")]
    n_kv = per_layer(k("attention.head_count_kv"), n_layer)
    n_ff = per_layer(k("feed_forward_length"), n_layer)
    hd_g = int(k("attention.key_length"))
    swa = [i for i in range(n_layer) if pattern[i]]
    glob = [i for i in range(n_layer) if not pattern[i]]
    rot = int((T["rope_freqs.weight"] < 1e29).sum())
    shared = int(k("attention.shared_kv_layers", 0))
    cfg = dict(
        vocab_size=vocab, hidden_size=int(k("embedding_length")), num_hidden_layers=n_layer,
        num_attention_heads=int(per_layer(k("attention.head_count"), n_layer)[0]),
        num_key_value_heads=n_kv[swa[0]] if swa else n_kv[0], head_dim=int(k("attention.key_length_swa")),
        global_head_dim=hd_g, rms_norm_eps=float(k("attention.layer_norm_rms_epsilon")),
        sliding_window=int(k("attention.sliding_window")),
        layer_types=["sliding_attention" if p else "full_attention" for p in pattern],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": float(k("rope.freq_base_swa"))},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": rot / (hd_g // 2), "rope_theta": float(k("rope.freq_base"))},
        },
        final_logit_softcapping=float(k("final_logit_softcapping")) if k("final_logit_softcapping") is not None else None,
        hidden_size_per_layer_input=int(k("embedding_length_per_layer_input", 0)), vocab_size_per_layer_input=vocab,
        num_kv_shared_layers=shared, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    if assistant:
        return cfg
    kv_layers = n_layer - shared
    cfg["intermediate_size"] = n_ff[0]
    cfg["use_double_wide_mlp"] = shared > 0 and n_ff[-1] == 2 * n_ff[0]
    cfg["attention_k_eq_v"] = any(f"blk.{i}.attn_v.weight" not in T for i in glob if i < kv_layers)
    if glob:
        cfg["num_global_key_value_heads"] = n_kv[glob[0]]
    cfg["tie_word_embeddings"] = "output.weight" not in T
    if k("expert_count"):
        cfg.update(enable_moe_block=True, num_experts=int(k("expert_count")), top_k_experts=int(k("expert_used_count")), moe_intermediate_size=int(k("expert_feed_forward_length")))
    return cfg


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def target_model(path):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    kv, T = read(path)
    if kv("general.architecture") != "gemma4":
        sys.exit(f"{path}: not a gemma4 GGUF")
    n_layer = int(kv("gemma4.block_count"))
    vocab = T["token_embd.weight"].shape[0]
    cd = text_config(kv, T, "gemma4", n_layer, vocab)
    cfg = Gemma4TextConfig(**cd)
    cfg._attn_implementation = "eager"
    sd = {"model.embed_tokens.weight": T["token_embd.weight"], "model.norm.weight": T["output_norm.weight"], "lm_head.weight": T.get("output.weight", T["token_embd.weight"])}
    if "per_layer_token_embd.weight" in T:
        sd["model.embed_tokens_per_layer.weight"] = T["per_layer_token_embd.weight"]
        sd["model.per_layer_model_projection.weight"] = T["per_layer_model_proj.weight"]
        sd["model.per_layer_projection_norm.weight"] = T["per_layer_proj_norm.weight"]
    for i in range(n_layer):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
                 "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1", "post_ffw_norm_2": "post_feedforward_layernorm_2", "ffn_gate_inp": "router.proj"}
        for g, h in names.items():
            if p + g + ".weight" in T:
                sd[q + h + ".weight"] = T[p + g + ".weight"]
        if p + "ffn_gate_inp.scale" in T:
            sd[q + "router.scale"] = T[p + "ffn_gate_inp.scale"]
            sd[q + "router.per_expert_scale"] = T[p + "ffn_down_exps.scale"]
            sd[q + "experts.gate_up_proj"] = T[p + "ffn_gate_up_exps.weight"]
            sd[q + "experts.down_proj"] = T[p + "ffn_down_exps.weight"]
        sd[q + "layer_scalar"] = T[p + "layer_output_scale.weight"].reshape(1)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict({n: t(v) for n, v in sd.items()}, strict=False)
    if missing or unexpected:
        sys.exit(f"{path}: the mapped weights do not fit Gemma4ForCausalLM: missing {missing}, unexpected {unexpected}")
    model.tine_config = cd
    return model


def assistant_model(path, target):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig
    kv, T = read(path)
    arch = kv("general.architecture")
    n = int(kv(f"{arch}.block_count"))
    vocab = T["token_embd.weight"].shape[0]
    tc = text_config(kv, T, arch, n, vocab, assistant=True)
    tc.update(intermediate_size=int(per_layer(kv(f"{arch}.feed_forward_length"), n)[0]), num_kv_shared_layers=n, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, tie_word_embeddings=True,
              num_key_value_heads=target.tine_config["num_key_value_heads"], attention_k_eq_v=target.tine_config["attention_k_eq_v"])
    if "num_global_key_value_heads" in target.tine_config:
        tc["num_global_key_value_heads"] = target.tine_config["num_global_key_value_heads"]
    ordered = "masked_embd_centroids.weight" in T
    cfg = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**tc), backbone_hidden_size=int(kv(f"{arch}.embedding_length_out")), use_ordered_embeddings=ordered,
                                num_centroids=T["masked_embd_centroids.weight"].shape[0] if ordered else 2048, centroid_intermediate_top_k=int(kv(f"{arch}.centroid_intermediate_top_k", 32)), tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    cfg.get_text_config()._attn_implementation = "eager"
    sd = {"model.embed_tokens.weight": T["token_embd.weight"], "lm_head.weight": T["token_embd.weight"], "model.norm.weight": T["output_norm.weight"],
          "pre_projection.weight": T["nextn.pre_projection.weight"], "post_projection.weight": T["nextn.post_projection.weight"]}
    for i in range(n):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        for g, h in {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                     "attn_q": "self_attn.q_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}.items():
            sd[q + h + ".weight"] = T[p + g + ".weight"]
        sd[q + "layer_scalar"] = T[p + "layer_output_scale.weight"].reshape(1)
    if ordered:
        sd["masked_embedding.centroids.weight"] = T["masked_embd_centroids.weight"]
        sd["masked_embedding.token_ordering"] = T["masked_embd_ordering"].astype(np.int64)
    torch.manual_seed(0)
    model = Gemma4AssistantForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict({k: t(v) for k, v in sd.items()}, strict=False)
    if missing or unexpected:
        sys.exit(f"{path}: the mapped weights do not fit Gemma4AssistantForCausalLM: missing {missing}, unexpected {unexpected}")
    return model


@torch.no_grad()
def trunk(model, tokens, steps, tail):
    ids = torch.tensor([tokens])
    n = len(tokens)
    out = model(input_ids=ids, use_cache=True)
    logits = out.logits[0]
    rec = {"logits": [(p, logits[p]) for p in range(n - tail if tail else 0, n)]}
    cache, nxt, dec = out.past_key_values, int(logits[-1].argmax()), []
    for i in range(steps):
        step = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True, position_ids=torch.tensor([[n + i]]))
        cache = step.past_key_values
        dec.append((nxt, step.logits[0, -1]))
        nxt = int(step.logits[0, -1].argmax())
    rec["decode"] = dec
    return rec


@torch.no_grad()
def draft_round(target, assistant, tokens):
    """transformers' SinglePositionMultiTokenCandidateGenerator.get_candidates, after the target
    processed `tokens` and DRAFT_TOKEN was sampled: every step at position len(tokens)."""
    out = target(input_ids=torch.tensor([tokens]), use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    h = out.hidden_states[-1][:, -1:]
    kv = {k: (v[0], v[1]) for k, v in out.shared_kv_states.items()}
    pos = torch.tensor([[len(tokens)]])
    token = torch.tensor([[DRAFT_TOKEN]])
    steps = []
    for _ in range(DRAFT_STEPS):
        emb = target.get_input_embeddings()(token)
        o = assistant(inputs_embeds=torch.cat([emb, h], dim=-1), position_ids=pos, shared_kv_states=kv, use_cache=False)
        steps.append((int(token[0, 0]), o.logits[0, -1], o.last_hidden_state[0, -1]))
        token = o.logits.argmax(dim=-1)
        h = o.last_hidden_state
    return steps


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    files = sorted(f[:-5] for f in os.listdir(src) if f.endswith(".gguf"))
    targets = [f for f in files if "-assistant" not in f]
    if not targets:
        sys.exit(f"no target .gguf in {src}")
    fmt = lambda v: " ".join(f"{float(x):.7g}" for x in v)  # noqa: E731
    lines = [f"# tools/gemma4_transformers_reference.py: transformers {transformers.__version__}, torch {torch.__version__}, f32"]
    for name in targets:
        model = target_model(os.path.join(src, f"{name}.gguf"))
        lines.append(f"fixture {name}")
        for label, tokens in [("short", SHORT), ("long", LONG)]:
            rec = trunk(model, tokens, DECODE_STEPS[label], LONG_TAIL if label == "long" else 0)
            lines.append("tokens " + " ".join(map(str, tokens)))
            lines += [f"logits {p} {fmt(v)}" for p, v in rec["logits"]]
            lines += [f"decode {tok} {fmt(v)}" for tok, v in rec["decode"]]
        for a in [f for f in files if f.startswith(name + "-assistant")]:
            head = assistant_model(os.path.join(src, f"{a}.gguf"), model)
            lines.append(f"assistant {a}")
            lines.append("tokens " + " ".join(map(str, SHORT)))
            for tok, logits, hn in draft_round(model, head, SHORT):
                lines.append(f"draft {tok} {fmt(logits)}")
                lines.append(f"hnext 0 {fmt(hn)}")
    tmp = dst + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, dst)
    print(f"wrote {dst}: {len(targets)} targets, {len(lines)} lines")


if __name__ == "__main__":
    main()
