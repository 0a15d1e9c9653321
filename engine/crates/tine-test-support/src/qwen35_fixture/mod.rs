//! Test fixture for `quantized_qwen35`: tiny synthetic Qwen3.5 GGUFs and a float64 reference.
//!
//! [`TinyQwen35`] writes a small `qwen35` GGUF with random weights in llama.cpp's layout (the
//! names, shapes and metadata keys its converter writes: norms stored as `1 + w`, `ssm_a` as
//! `-exp(A_log)`, value heads in tiled order, `attn_q` holding `[q | gate]` per head).
//! [`Qwen35Reference`] is a float64 forward of the same weights written from the model's
//! description (`shared/reference/model-families.md`, section d), not from candle's code: gated
//! delta-net layers with their conv window and state, gated full-attention layers with partial
//! RoPE, the SwiGLU MLP.
//!
//! It lives in Tine's `tine-test-support` crate, not in a patch; the patch's test includes it by
//! `#[path]`, the crate re-exports it.

// Each test file uses a part of the fixture.
#![allow(dead_code)]

use std::io::{Seek, Write};
use std::path::Path;

use candle::quantized::{gguf_file, GgmlDType, QTensor};
use candle::{Device, Tensor};

/// The shape of a synthetic Qwen3.5. `Default`: four layers, the last one full attention (every
/// `full_attention_interval`-th layer, as the converter writes it), two key heads and four value
/// heads in the delta-net layers (tiled), GQA 4/2 in the attention layer, a quarter of each head
/// rotated.
#[derive(Debug, Clone)]
pub struct TinyQwen35 {
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub n_ff: usize,
    pub full_attention_interval: usize,
    pub conv_kernel: usize,
    /// d_k = d_v of the delta-net heads (`ssm.state_size`).
    pub d_state: usize,
    /// H_k (`ssm.group_count`).
    pub n_k_heads: usize,
    /// H_v (`ssm.time_step_rank`).
    pub n_v_heads: usize,
    pub vocab: usize,
    /// Write an untied `output.weight` (else the head is `token_embd`).
    pub untied: bool,
    /// Append a NextN head (`nextn_predict_layers = 1`: block `n_layer`, a full-attention block
    /// with `nextn.*` tensors). Its weights are drawn after the trunk's, so the trunk is the same
    /// with or without it.
    pub nextn: bool,
    /// Routed experts (`qwen35moe`); 0: the dense `qwen35` MLP.
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub expert_ff: usize,
    pub shared_ff: usize,
    /// `qwen35moe`: write the experts' gate and up as one `ffn_gate_up_exps` (the converter's
    /// `--fuse-gate-up-exps`: each expert's gate rows, then its up rows).
    pub fused_gate_up: bool,
    /// Write a byte-level BPE tokenizer (`gpt2` with the `qwen35` pre-tokenizer: the 256 byte
    /// symbols, one merge `Ġ t`, `<|endoftext|>`), as llama.cpp needs to load the file; then
    /// `vocab` must be [`TOKENIZER_VOCAB`].
    pub tokenizer: bool,
    pub seed: u64,
}

/// The vocabulary of the fixture's tokenizer: 256 byte symbols, `Ġt`, `<|endoftext|>`.
pub const TOKENIZER_VOCAB: usize = 258;

/// GPT-2's byte-to-symbol map: printable bytes stand for themselves, the rest map to
/// U+0100 onwards in byte order.
pub fn byte_symbols() -> Vec<String> {
    let keep = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0..256u32)
        .map(|b| {
            if keep(b) {
                char::from_u32(b).expect("a Latin-1 code point").to_string()
            } else {
                let c = char::from_u32(next).expect("a code point past Latin-1");
                next += 1;
                c.to_string()
            }
        })
        .collect()
}

impl Default for TinyQwen35 {
    fn default() -> Self {
        TinyQwen35 {
            n_embd: 32,
            n_layer: 4,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 16,
            rope_dim: 4,
            n_ff: 64,
            full_attention_interval: 4,
            conv_kernel: 4,
            d_state: 8,
            n_k_heads: 2,
            n_v_heads: 4,
            vocab: 96,
            untied: true,
            nextn: false,
            n_expert: 0,
            n_expert_used: 0,
            expert_ff: 0,
            shared_ff: 0,
            fused_gate_up: false,
            tokenizer: false,
            seed: 11,
        }
    }
}

/// The eps of every norm (and of the delta-net's L2 norm, as llama.cpp takes it).
pub const EPS: f64 = 1e-6;
pub const ROPE_BASE: f64 = 10_000_000.0;

/// Deterministic pseudo-random numbers (xorshift), so fixtures need no RNG crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.next() * scale) as f32).collect()
    }
}

/// A gated delta-net layer's weights, row-major `(out, in)`.
#[derive(Debug, Clone)]
pub struct GdnWeights {
    pub qkv: Vec<f64>,
    pub gate: Vec<f64>,
    /// `(conv_dim, K)`: tap `K - 1` multiplies the current row.
    pub conv: Vec<f64>,
    pub dt_bias: Vec<f64>,
    /// `-exp(A_log)`.
    pub a: Vec<f64>,
    pub beta: Vec<f64>,
    pub alpha: Vec<f64>,
    pub norm: Vec<f64>,
    pub out: Vec<f64>,
}

/// A gated full-attention layer's weights.
#[derive(Debug, Clone)]
pub struct AttnWeights {
    /// `(2 · n_head · hd, n_embd)`: per head `[q (hd) | gate (hd)]`.
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub o: Vec<f64>,
    pub q_norm: Vec<f64>,
    pub k_norm: Vec<f64>,
}

#[derive(Debug, Clone)]
pub enum Mixer {
    Gdn(GdnWeights),
    Attn(AttnWeights),
}

/// A block's feed-forward weights.
#[derive(Debug, Clone)]
pub enum Ffn {
    /// SwiGLU: `down(SiLU(gate x) · up x)`.
    Dense { gate: Vec<f64>, up: Vec<f64>, down: Vec<f64> },
    /// Routed experts (softmax over `router x`, the top `n_expert_used` renormalised, each a
    /// SwiGLU) plus the shared expert gated by `sigmoid(shared_gate · x)`.
    Moe {
        router: Vec<f64>,
        /// Per expert `(gate, up, down)`.
        experts: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)>,
        shared_gate: Vec<f64>,
        shared: (Vec<f64>, Vec<f64>, Vec<f64>),
    },
}

#[derive(Debug, Clone)]
pub struct Qwen35Layer {
    pub attn_norm: Vec<f64>,
    pub post_attn_norm: Vec<f64>,
    pub mixer: Mixer,
    pub ffn: Ffn,
}

/// A NextN head's weights: its full-attention block and the `nextn.*` tensors.
#[derive(Debug, Clone)]
pub struct NextNWeights {
    pub block: Qwen35Layer,
    /// `(n_embd, 2 · n_embd)`.
    pub eh_proj: Vec<f64>,
    pub enorm: Vec<f64>,
    pub hnorm: Vec<f64>,
    pub shared_head_norm: Vec<f64>,
}

/// The weights as written (after the quantization round trip), in f64.
#[derive(Debug, Clone)]
pub struct Qwen35Weights {
    pub cfg: TinyQwen35,
    pub embd: Vec<f64>,
    pub output_norm: Vec<f64>,
    /// `None`: tied to `embd`.
    pub output: Option<Vec<f64>>,
    pub layers: Vec<Qwen35Layer>,
    pub nextn: Option<NextNWeights>,
}

impl TinyQwen35 {
    /// The default shape as `qwen35moe`: four experts of which two are used, a shared expert.
    pub fn moe() -> TinyQwen35 {
        TinyQwen35 { n_expert: 4, n_expert_used: 2, expert_ff: 32, shared_ff: 32, ..TinyQwen35::default() }
    }

    /// The fixtures tools/qwen35_transformers_reference.py runs through transformers, by name:
    /// dense with a NextN head and H_k != H_v; tied output, H_v = 3 H_k and a full-attention layer
    /// every second layer; `qwen35moe` with a NextN head whose FFN is routed too.
    pub fn transformers_fixtures() -> Vec<(&'static str, TinyQwen35)> {
        vec![
            ("dense", TinyQwen35 { nextn: true, seed: 31, ..TinyQwen35::default() }),
            ("dense-tied", TinyQwen35 { untied: false, n_k_heads: 1, n_v_heads: 3, n_kv_head: 1, full_attention_interval: 2, nextn: true, seed: 32, ..TinyQwen35::default() }),
            ("moe", TinyQwen35 { nextn: true, seed: 33, ..TinyQwen35::moe() }),
        ]
    }

    pub fn arch(&self) -> &'static str {
        if self.n_expert > 0 {
            "qwen35moe"
        } else {
            "qwen35"
        }
    }

    /// Whether layer `l` is a full-attention layer.
    pub fn is_full(&self, l: usize) -> bool {
        (l + 1).is_multiple_of(self.full_attention_interval)
    }

    pub fn conv_dim(&self) -> usize {
        2 * self.n_k_heads * self.d_state + self.n_v_heads * self.d_state
    }

    pub fn write(&self, path: &Path) -> Qwen35Weights {
        let mut f = std::fs::File::create(path).expect("create fixture GGUF");
        self.write_to(&mut f)
    }

    /// Writes the GGUF to `w`; every tensor F32 except the matrices, stored as `dtype`.
    pub fn write_to<W: Write + Seek>(&self, w: &mut W) -> Qwen35Weights {
        self.write_with(w, GgmlDType::F32, &[])
    }

    /// [`TinyQwen35::write_to`] with the matrices in `dtype` and the tensors named in `skip`
    /// left out (for the loader's error tests).
    pub fn write_with<W: Write + Seek>(&self, w: &mut W, dtype: GgmlDType, skip: &[&str]) -> Qwen35Weights {
        let dev = Device::Cpu;
        let mut rng = Rng(self.seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
        let (d, hd, ds) = (self.n_embd, self.head_dim, self.d_state);
        let (hk, hv) = (self.n_k_heads, self.n_v_heads);
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut put = |name: String, data: Vec<f32>, shape: Vec<usize>, dtype: GgmlDType| -> Vec<f64> {
            let t = Tensor::from_vec(data, shape, &dev).expect("fixture tensor");
            let q = QTensor::quantize(&t, dtype).expect("fixture quantize");
            let back: Vec<f64> = q.dequantize(&dev).expect("dequantize").flatten_all().expect("flatten").to_vec1::<f32>().expect("f32").into_iter().map(f64::from).collect();
            if !skip.contains(&name.as_str()) {
                tensors.push((name, q));
            }
            back
        };
        // Norms as the converter stores them: `1 + w`.
        let norm = |rng: &mut Rng, n: usize| rng.vec(n, 0.3).into_iter().map(|x| 1.0 + x).collect::<Vec<f32>>();
        let f = GgmlDType::F32;
        let s = 1.0 / (d as f64).sqrt();
        let embd = put("token_embd.weight".into(), rng.vec(self.vocab * d, 1.0), vec![self.vocab, d], f);
        let output_norm = put("output_norm.weight".into(), norm(&mut rng, d), vec![d], f);
        let output = self.untied.then(|| put("output.weight".into(), rng.vec(self.vocab * d, s), vec![self.vocab, d], dtype));
        let mut layers = Vec::new();
        for l in 0..self.n_layer + usize::from(self.nextn) {
            let p = format!("blk.{l}");
            let attn_norm = put(format!("{p}.attn_norm.weight"), norm(&mut rng, d), vec![d], f);
            // The NextN block is a full-attention block.
            let mixer = if l == self.n_layer || self.is_full(l) {
                let qd = self.n_head * hd;
                Mixer::Attn(AttnWeights {
                    q: put(format!("{p}.attn_q.weight"), rng.vec(2 * qd * d, s), vec![2 * qd, d], dtype),
                    k: put(format!("{p}.attn_k.weight"), rng.vec(self.n_kv_head * hd * d, s), vec![self.n_kv_head * hd, d], dtype),
                    v: put(format!("{p}.attn_v.weight"), rng.vec(self.n_kv_head * hd * d, s), vec![self.n_kv_head * hd, d], dtype),
                    o: put(format!("{p}.attn_output.weight"), rng.vec(d * qd, 1.0 / (qd as f64).sqrt()), vec![d, qd], dtype),
                    q_norm: put(format!("{p}.attn_q_norm.weight"), norm(&mut rng, hd), vec![hd], f),
                    k_norm: put(format!("{p}.attn_k_norm.weight"), norm(&mut rng, hd), vec![hd], f),
                })
            } else {
                let (conv_dim, vd) = (self.conv_dim(), hv * ds);
                Mixer::Gdn(GdnWeights {
                    qkv: put(format!("{p}.attn_qkv.weight"), rng.vec(conv_dim * d, s), vec![conv_dim, d], dtype),
                    gate: put(format!("{p}.attn_gate.weight"), rng.vec(vd * d, s), vec![vd, d], dtype),
                    conv: put(format!("{p}.ssm_conv1d.weight"), rng.vec(conv_dim * self.conv_kernel, 0.5), vec![conv_dim, self.conv_kernel], f),
                    dt_bias: put(format!("{p}.ssm_dt.bias"), rng.vec(hv, 1.0), vec![hv], f),
                    a: put(format!("{p}.ssm_a"), rng.vec(hv, 1.0).into_iter().map(|x| -(x as f64).exp() as f32).collect(), vec![hv], f),
                    beta: put(format!("{p}.ssm_beta.weight"), rng.vec(hv * d, s), vec![hv, d], dtype),
                    alpha: put(format!("{p}.ssm_alpha.weight"), rng.vec(hv * d, s), vec![hv, d], dtype),
                    norm: put(format!("{p}.ssm_norm.weight"), norm(&mut rng, ds), vec![ds], f),
                    out: put(format!("{p}.ssm_out.weight"), rng.vec(d * vd, 1.0 / (vd as f64).sqrt()), vec![d, vd], dtype),
                })
            };
            let post_attn_norm = put(format!("{p}.post_attention_norm.weight"), norm(&mut rng, d), vec![d], f);
            let ffn = if self.n_expert == 0 {
                Ffn::Dense {
                    gate: put(format!("{p}.ffn_gate.weight"), rng.vec(self.n_ff * d, s), vec![self.n_ff, d], dtype),
                    up: put(format!("{p}.ffn_up.weight"), rng.vec(self.n_ff * d, s), vec![self.n_ff, d], dtype),
                    down: put(format!("{p}.ffn_down.weight"), rng.vec(d * self.n_ff, 1.0 / (self.n_ff as f64).sqrt()), vec![d, self.n_ff], dtype),
                }
            } else {
                let (e, fe, fs) = (self.n_expert, self.expert_ff, self.shared_ff);
                let router = put(format!("{p}.ffn_gate_inp.weight"), rng.vec(e * d, 2.0 * s), vec![e, d], f);
                let (gv, uv) = (rng.vec(e * fe * d, s), rng.vec(e * fe * d, s));
                let (g, u) = if self.fused_gate_up {
                    let both: Vec<f32> = (0..e).flat_map(|i| gv[i * fe * d..(i + 1) * fe * d].iter().chain(&uv[i * fe * d..(i + 1) * fe * d]).copied().collect::<Vec<_>>()).collect();
                    let b = put(format!("{p}.ffn_gate_up_exps.weight"), both, vec![e, 2 * fe, d], dtype);
                    let half = |i: usize, j: usize| b[(2 * i + j) * fe * d..(2 * i + j + 1) * fe * d].to_vec();
                    ((0..e).flat_map(|i| half(i, 0)).collect::<Vec<f64>>(), (0..e).flat_map(|i| half(i, 1)).collect::<Vec<f64>>())
                } else {
                    (put(format!("{p}.ffn_gate_exps.weight"), gv, vec![e, fe, d], dtype), put(format!("{p}.ffn_up_exps.weight"), uv, vec![e, fe, d], dtype))
                };
                let dn = put(format!("{p}.ffn_down_exps.weight"), rng.vec(e * d * fe, 1.0 / (fe as f64).sqrt()), vec![e, d, fe], dtype);
                let experts = (0..e).map(|i| (g[i * fe * d..(i + 1) * fe * d].to_vec(), u[i * fe * d..(i + 1) * fe * d].to_vec(), dn[i * d * fe..(i + 1) * d * fe].to_vec())).collect();
                Ffn::Moe {
                    router,
                    experts,
                    shared_gate: put(format!("{p}.ffn_gate_inp_shexp.weight"), rng.vec(d, s), vec![1, d], f),
                    shared: (
                        put(format!("{p}.ffn_gate_shexp.weight"), rng.vec(fs * d, s), vec![fs, d], dtype),
                        put(format!("{p}.ffn_up_shexp.weight"), rng.vec(fs * d, s), vec![fs, d], dtype),
                        put(format!("{p}.ffn_down_shexp.weight"), rng.vec(d * fs, 1.0 / (fs as f64).sqrt()), vec![d, fs], dtype),
                    ),
                }
            };
            layers.push(Qwen35Layer { attn_norm, post_attn_norm, mixer, ffn });
        }
        let nextn = match self.nextn {
            true => {
                let block = layers.pop().expect("the NextN block was written last");
                let p = format!("blk.{}.nextn", self.n_layer);
                Some(NextNWeights {
                    block,
                    eh_proj: put(format!("{p}.eh_proj.weight"), rng.vec(d * 2 * d, 1.0 / (2.0 * d as f64).sqrt()), vec![d, 2 * d], dtype),
                    enorm: put(format!("{p}.enorm.weight"), norm(&mut rng, d), vec![d], f),
                    hnorm: put(format!("{p}.hnorm.weight"), norm(&mut rng, d), vec![d], f),
                    shared_head_norm: put(format!("{p}.shared_head_norm.weight"), norm(&mut rng, d), vec![d], f),
                })
            }
            false => None,
        };
        use gguf_file::Value as V;
        let u = |x: usize| V::U32(x as u32);
        let a = self.arch();
        let key = |k: &str| format!("{a}.{k}");
        let md: Vec<(String, V)> = vec![
            ("general.architecture".into(), V::String(a.into())),
            ("general.name".into(), V::String("tiny-qwen35-test".into())),
            (key("block_count"), u(self.n_layer + usize::from(self.nextn))),
            (key("context_length"), u(4096)),
            (key("embedding_length"), u(d)),
            (key("feed_forward_length"), u(self.n_ff)),
            (key("attention.head_count"), u(self.n_head)),
            (key("attention.head_count_kv"), u(self.n_kv_head)),
            (key("attention.key_length"), u(hd)),
            (key("attention.value_length"), u(hd)),
            (key("attention.layer_norm_rms_epsilon"), V::F32(EPS as f32)),
            (key("rope.freq_base"), V::F32(ROPE_BASE as f32)),
            (key("rope.dimension_count"), u(self.rope_dim)),
            (key("rope.dimension_sections"), V::Array(vec![V::I32(1), V::I32(1), V::I32(0), V::I32(0)])),
            (key("ssm.conv_kernel"), u(self.conv_kernel)),
            (key("ssm.state_size"), u(ds)),
            (key("ssm.group_count"), u(hk)),
            (key("ssm.time_step_rank"), u(hv)),
            (key("ssm.inner_size"), u(hv * ds)),
            (key("full_attention_interval"), u(self.full_attention_interval)),
            (key("nextn_predict_layers"), u(usize::from(self.nextn))),
        ];
        let mut md = md;
        if self.tokenizer {
            assert_eq!(self.vocab, TOKENIZER_VOCAB, "the fixture's tokenizer has {TOKENIZER_VOCAB} tokens");
            let mut tokens = byte_symbols();
            tokens.push("Ġt".into());
            tokens.push("<|endoftext|>".into());
            let types: Vec<V> = (0..tokens.len()).map(|i| V::I32(if i == TOKENIZER_VOCAB - 1 { 3 } else { 1 })).collect();
            md.push(("tokenizer.ggml.model".into(), V::String("gpt2".into())));
            md.push(("tokenizer.ggml.pre".into(), V::String("qwen35".into())));
            md.push(("tokenizer.ggml.tokens".into(), V::Array(tokens.into_iter().map(V::String).collect())));
            md.push(("tokenizer.ggml.token_type".into(), V::Array(types)));
            md.push(("tokenizer.ggml.merges".into(), V::Array(vec![V::String("Ġ t".into())])));
            md.push(("tokenizer.ggml.eos_token_id".into(), u(TOKENIZER_VOCAB - 1)));
            md.push(("tokenizer.ggml.padding_token_id".into(), u(TOKENIZER_VOCAB - 1)));
            md.push(("tokenizer.ggml.add_bos_token".into(), V::Bool(false)));
        }
        if self.n_expert > 0 {
            md.retain(|(k, _)| k != &key("feed_forward_length"));
            md.push((key("expert_count"), u(self.n_expert)));
            md.push((key("expert_used_count"), u(self.n_expert_used)));
            md.push((key("expert_feed_forward_length"), u(self.expert_ff)));
            md.push((key("expert_shared_feed_forward_length"), u(self.shared_ff)));
        }
        let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(w, &md_refs, &t_refs).expect("write fixture GGUF");
        Qwen35Weights { cfg: self.clone(), embd, output_norm, output, layers, nextn }
    }
}

fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    let k = x.len();
    w.chunks(k).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms(x: &[f64], w: &[f64]) -> Vec<f64> {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + EPS).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One layer's sequence state in the reference.
#[derive(Debug, Clone)]
pub enum RefState {
    /// K and V rows of every position, `n_kv · hd` each.
    Attn { k: Vec<Vec<f64>>, v: Vec<Vec<f64>> },
    /// The last `K - 1` pre-conv QKV rows and the state `S` (`H_v · d_k · d_v`).
    Gdn { window: Vec<Vec<f64>>, s: Vec<f64> },
}

/// A float64 Qwen3.5 forward over one sequence, one token at a time. `Clone` is a snapshot.
#[derive(Debug, Clone)]
pub struct Qwen35Reference<'w> {
    w: &'w Qwen35Weights,
    pub state: Vec<RefState>,
    pub pos: usize,
    /// The last step's hidden state after the output norm (what the NextN head reads).
    pub hidden: Vec<f64>,
}

impl<'w> Qwen35Reference<'w> {
    pub fn new(w: &'w Qwen35Weights) -> Self {
        let c = &w.cfg;
        let state = (0..c.n_layer)
            .map(|l| {
                if c.is_full(l) {
                    RefState::Attn { k: Vec::new(), v: Vec::new() }
                } else {
                    RefState::Gdn { window: vec![vec![0.0; c.conv_dim()]; c.conv_kernel - 1], s: vec![0.0; c.n_v_heads * c.d_state * c.d_state] }
                }
            })
            .collect();
        Qwen35Reference { w, state, pos: 0, hidden: Vec::new() }
    }

    /// The logits after `token` at the next position.
    pub fn step(&mut self, token: u32) -> Vec<f64> {
        let (w, c) = (self.w, &self.w.cfg);
        let d = c.n_embd;
        let mut x: Vec<f64> = w.embd[token as usize * d..(token as usize + 1) * d].to_vec();
        for (l, layer) in w.layers.iter().enumerate() {
            let h = rms(&x, &layer.attn_norm);
            let mixed = match (&layer.mixer, &mut self.state[l]) {
                (Mixer::Attn(a), RefState::Attn { k, v }) => attention(c, a, &h, self.pos, k, v),
                (Mixer::Gdn(g), RefState::Gdn { window, s }) => gdn(c, g, &h, window, s),
                _ => unreachable!("the state follows the layer kinds"),
            };
            x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
            let down = ffn(c, &layer.ffn, &rms(&x, &layer.post_attn_norm));
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
        self.pos += 1;
        let n = rms(&x, &w.output_norm);
        self.hidden = n.clone();
        matvec(w.output.as_ref().unwrap_or(&w.embd), &n)
    }
}

/// The float64 NextN head over one sequence (model-families.md, "NextN (MTP) head"): entry `j`
/// reads the trunk's hidden state at `j` (after its output norm) and the token at `j + 1`, at
/// position `j + 1`: `u = eh_proj [enorm(E[x]); hnorm(h)]`, the full-attention block over its own
/// K/V, `h' = shared_head_norm(u)`, logits `output · h'`. Chained steps feed `h'` back as `h`.
#[derive(Debug, Clone)]
pub struct NextNReference<'w> {
    w: &'w Qwen35Weights,
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
}

impl<'w> NextNReference<'w> {
    pub fn new(w: &'w Qwen35Weights) -> Self {
        NextNReference { w, k: Vec::new(), v: Vec::new() }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.k.len()
    }

    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }

    /// The next entry: `hidden` and the token after it. Returns the logits and `h'`.
    pub fn step(&mut self, hidden: &[f64], token: u32) -> (Vec<f64>, Vec<f64>) {
        let (w, c) = (self.w, &self.w.cfg);
        let head = w.nextn.as_ref().expect("a NextN head");
        let d = c.n_embd;
        let mut cat = rms(&w.embd[token as usize * d..(token as usize + 1) * d], &head.enorm);
        cat.extend(rms(hidden, &head.hnorm));
        let mut x = matvec(&head.eh_proj, &cat);
        let b = &head.block;
        let Mixer::Attn(a) = &b.mixer else { unreachable!("the NextN block is full attention") };
        let pos = self.k.len() + 1;
        let mixed = attention(c, a, &rms(&x, &b.attn_norm), pos, &mut self.k, &mut self.v);
        x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
        let down = ffn(c, &b.ffn, &rms(&x, &b.post_attn_norm));
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        let hn = rms(&x, &head.shared_head_norm);
        (matvec(w.output.as_ref().unwrap_or(&w.embd), &hn), hn)
    }
}

fn swiglu(gate: &[f64], up: &[f64], down: &[f64], x: &[f64]) -> Vec<f64> {
    let (g, u) = (matvec(gate, x), matvec(up, x));
    let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
    matvec(down, &act)
}

/// The feed-forward of one token: SwiGLU, or the routed experts (softmax over the router's
/// logits, the top `n_expert_used` by probability, lower index first among equals, their weights
/// renormalised to sum to 1) plus the shared expert times `sigmoid(shared_gate · x)`.
fn ffn(c: &TinyQwen35, f: &Ffn, x: &[f64]) -> Vec<f64> {
    match f {
        Ffn::Dense { gate, up, down } => swiglu(gate, up, down, x),
        Ffn::Moe { router, experts, shared_gate, shared } => {
            let r = matvec(router, x);
            let mx = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = r.iter().map(|v| (v - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            let p: Vec<f64> = e.iter().map(|v| v / z).collect();
            let mut order: Vec<usize> = (0..p.len()).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let top = &order[..c.n_expert_used];
            let sum: f64 = top.iter().map(|&i| p[i]).sum();
            let mut y = vec![0f64; x.len()];
            for &i in top {
                let (g, u, d) = &experts[i];
                for (a, b) in y.iter_mut().zip(swiglu(g, u, d, x)) {
                    *a += p[i] / sum * b;
                }
            }
            let sg = sigmoid(shared_gate.iter().zip(x).map(|(a, b)| a * b).sum());
            for (a, b) in y.iter_mut().zip(swiglu(&shared.0, &shared.1, &shared.2, x)) {
                *a += sg * b;
            }
            y
        }
    }
}

/// Gated full attention at `pos`: q with its per-head gate, q/k norms, NeoX RoPE on the first
/// `rope_dim` dims, GQA (query head h on KV head h / (n_head / n_kv)), out times σ(gate).
fn attention(c: &TinyQwen35, a: &AttnWeights, x: &[f64], pos: usize, ks: &mut Vec<Vec<f64>>, vs: &mut Vec<Vec<f64>>) -> Vec<f64> {
    let hd = c.head_dim;
    let qg = matvec(&a.q, x);
    let (kr, vr) = (matvec(&a.k, x), matvec(&a.v, x));
    let rope = |v: &[f64]| -> Vec<f64> {
        let mut out = v.to_vec();
        let half = c.rope_dim / 2;
        for i in 0..half {
            let theta = pos as f64 * ROPE_BASE.powf(-2.0 * i as f64 / c.rope_dim as f64);
            let (s, co) = theta.sin_cos();
            out[i] = v[i] * co - v[i + half] * s;
            out[i + half] = v[i + half] * co + v[i] * s;
        }
        out
    };
    let k: Vec<f64> = (0..c.n_kv_head).flat_map(|h| rope(&rms(&kr[h * hd..(h + 1) * hd], &a.k_norm))).collect();
    ks.push(k);
    vs.push(vr);
    let group = c.n_head / c.n_kv_head;
    let mut out = Vec::with_capacity(c.n_head * hd);
    for h in 0..c.n_head {
        let q = rope(&rms(&qg[h * 2 * hd..h * 2 * hd + hd], &a.q_norm));
        let gate = &qg[h * 2 * hd + hd..(h + 1) * 2 * hd];
        let g = h / group;
        let scores: Vec<f64> = ks.iter().map(|k| q.iter().zip(&k[g * hd..(g + 1) * hd]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()).collect();
        let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
        let den: f64 = e.iter().sum();
        for j in 0..hd {
            let o: f64 = vs.iter().zip(&e).map(|(v, p)| p * v[g * hd + j]).sum::<f64>() / den;
            out.push(o * sigmoid(gate[j]));
        }
    }
    matvec(&a.o, &out)
}

/// The gated delta-net layer for one token (model-families.md, section d, GGUF semantics).
fn gdn(c: &TinyQwen35, g: &GdnWeights, x: &[f64], window: &mut Vec<Vec<f64>>, s: &mut [f64]) -> Vec<f64> {
    let (hk, hv, dk) = (c.n_k_heads, c.n_v_heads, c.d_state);
    let dv = dk;
    let kk = c.conv_kernel;
    let qkv = matvec(&g.qkv, x);
    let z = matvec(&g.gate, x);
    let beta: Vec<f64> = matvec(&g.beta, x).into_iter().map(sigmoid).collect();
    let alpha = matvec(&g.alpha, x);
    let gl: Vec<f64> = (0..hv).map(|h| g.a[h] * softplus(alpha[h] + g.dt_bias[h])).collect();
    window.push(qkv);
    let conv_dim = c.conv_dim();
    let conv: Vec<f64> = (0..conv_dim).map(|ch| silu((0..kk).map(|j| g.conv[ch * kk + j] * window[j][ch]).sum())).collect();
    window.remove(0);
    let l2 = |v: &[f64]| {
        let n = (v.iter().map(|a| a * a).sum::<f64>() + EPS).sqrt();
        v.iter().map(|a| a / n).collect::<Vec<f64>>()
    };
    let q: Vec<Vec<f64>> = (0..hk).map(|h| l2(&conv[h * dk..(h + 1) * dk]).into_iter().map(|v| v / (dk as f64).sqrt()).collect()).collect();
    let k: Vec<Vec<f64>> = (0..hk).map(|h| l2(&conv[hk * dk + h * dk..hk * dk + (h + 1) * dk])).collect();
    let v = &conv[2 * hk * dk..];
    let mut y = Vec::with_capacity(hv * dv);
    for h in 0..hv {
        let kh = h % hk;
        let sh = &mut s[h * dk * dv..(h + 1) * dk * dv];
        let decay = gl[h].exp();
        sh.iter_mut().for_each(|a| *a *= decay);
        let u: Vec<f64> = (0..dv).map(|j| beta[h] * (v[h * dv + j] - (0..dk).map(|i| sh[i * dv + j] * k[kh][i]).sum::<f64>())).collect();
        for i in 0..dk {
            for j in 0..dv {
                sh[i * dv + j] += k[kh][i] * u[j];
            }
        }
        let o: Vec<f64> = (0..dv).map(|j| (0..dk).map(|i| sh[i * dv + j] * q[kh][i]).sum()).collect();
        let on = rms(&o, &g.norm);
        y.extend(on.iter().zip(&z[h * dv..(h + 1) * dv]).map(|(a, z)| a * silu(*z)));
    }
    matvec(&g.out, &y)
}
