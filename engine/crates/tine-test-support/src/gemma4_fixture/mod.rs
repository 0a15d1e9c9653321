//! Test fixture for `quantized_gemma4`: tiny synthetic Gemma 4 GGUFs and a float64 reference.
//!
//! [`TinyGemma4`] writes a small `gemma4` GGUF with random weights in llama.cpp's layout (the
//! names, shapes and metadata keys of its converter and `gemma4.cpp`): an explicit sliding-window
//! pattern, per-layer head dims, KV-head counts and feed-forward lengths (arrays), `rope_freqs`
//! (1 for the rotated pairs, 1e30 for the rest), norms stored as multipliers, optionally
//! `k_eq_v` global layers, KV shared by the last layers, per-layer embeddings, and routed
//! experts beside the dense MLP. [`Gemma4Reference`] is a float64 forward of the same weights
//! written from the model's description (`shared/reference/model-families.md`, section e, and
//! llama.cpp's graph), not from candle's code.
//!
//! It lives in Tine's `tine-test-support` crate, not in a patch; the patch's test includes it by
//! `#[path]`, the crate re-exports it.

// Each test file uses a part of the fixture.
#![allow(dead_code)]

use std::io::{Seek, Write};
use std::path::Path;

use candle::quantized::{gguf_file, GgmlDType, QTensor};
use candle::{Device, Tensor};

/// The shape of a synthetic Gemma 4. The presets: [`TinyGemma4::dense`] (31B-like),
/// [`TinyGemma4::e2b`] (E-series), [`TinyGemma4::a4b`] (MoE).
#[derive(Debug, Clone)]
pub struct TinyGemma4 {
    pub n_embd: usize,
    /// Per layer: sliding-window (else global).
    pub pattern: Vec<bool>,
    pub n_head: usize,
    pub n_kv_head_swa: usize,
    pub n_kv_head_global: usize,
    pub head_dim_swa: usize,
    pub head_dim_global: usize,
    /// Rotated frequency pairs of a global head (the rest get factor 1e30).
    pub global_rot_pairs: usize,
    pub n_ff: usize,
    /// The KV-shared layers' feed-forward length (double-wide MLP), when they have one.
    pub n_ff_shared: usize,
    pub window: usize,
    /// Global layers have no `attn_v`: V is the raw K projection.
    pub k_eq_v: bool,
    pub shared_kv_layers: usize,
    /// `embedding_length_per_layer_input` (0: none).
    pub per_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub expert_ff: usize,
    pub softcap: Option<f64>,
    pub untied: bool,
    pub vocab: usize,
    /// Write a `gemma4` tokenizer (SentencePiece-style BPE: `<pad>`, `<eos>`, `<bos>`, `<|turn>`,
    /// `<turn|>`, the 256 `<0xXX>` byte tokens, `▁`, `\n`, `t`, `▁t` with the merge `▁ t`);
    /// then `vocab` must be [`TOKENIZER_VOCAB`].
    pub tokenizer: bool,
    pub seed: u64,
}

/// The vocabulary of the fixture's tokenizer.
pub const TOKENIZER_VOCAB: usize = 5 + 256 + 4;

/// Targets by name.
pub type NamedTargets = Vec<(&'static str, TinyGemma4)>;
/// Assistants by name, with their target's name.
pub type NamedAssistants = Vec<(&'static str, &'static str, TinyGemma4Assistant)>;

/// The eps of every norm.
pub const EPS: f64 = 1e-6;
pub const ROPE_BASE: f64 = 1_000_000.0;
pub const ROPE_BASE_SWA: f64 = 10_000.0;

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

impl TinyGemma4 {
    /// 31B-like: six layers (sliding, sliding, global, ×2), window 4, local heads of 16 with two
    /// KV heads, global heads of 32 with one KV head and `k_eq_v`, a quarter of the global pairs
    /// rotated, softcapping 30, tied output.
    pub fn dense() -> TinyGemma4 {
        TinyGemma4 {
            n_embd: 32,
            pattern: vec![true, true, false, true, true, false],
            n_head: 4,
            n_kv_head_swa: 2,
            n_kv_head_global: 1,
            head_dim_swa: 16,
            head_dim_global: 32,
            global_rot_pairs: 4,
            n_ff: 64,
            n_ff_shared: 64,
            window: 4,
            k_eq_v: true,
            shared_kv_layers: 0,
            per_layer: 0,
            n_expert: 0,
            n_expert_used: 0,
            expert_ff: 0,
            softcap: Some(30.0),
            untied: false,
            vocab: 96,
            tokenizer: false,
            seed: 7,
        }
    }

    /// E2B-like: per-layer embeddings of 8, the last two layers share K/V (layer 4, sliding,
    /// reads layer 2; layer 5, global, reads layer 3) and have a double-wide MLP; V projections
    /// everywhere; no softcap; an untied head.
    pub fn e2b() -> TinyGemma4 {
        TinyGemma4 {
            pattern: vec![true, true, true, false, true, false],
            n_kv_head_global: 2,
            k_eq_v: false,
            shared_kv_layers: 2,
            per_layer: 8,
            n_ff_shared: 128,
            softcap: None,
            untied: true,
            seed: 8,
            ..TinyGemma4::dense()
        }
    }

    /// A4B-like: the dense MLP and 4 routed experts (2 used) side by side in every block,
    /// `k_eq_v` global layers.
    pub fn a4b() -> TinyGemma4 {
        TinyGemma4 { n_expert: 4, n_expert_used: 2, expert_ff: 24, seed: 9, ..TinyGemma4::dense() }
    }

    /// The fixtures tools/gemma4_transformers_reference.py runs through transformers, by name:
    /// the three variants (window 4, so the 70-token prompt crosses it), two targets with a
    /// window of 16 (a 9-token prompt inside it, where transformers' bidirectional assistant
    /// window and llama.cpp's agree) and their assistants, `(name, target name, assistant)`.
    pub fn transformers_fixtures() -> (NamedTargets, NamedAssistants) {
        let targets = vec![
            ("dense", TinyGemma4::dense()),
            ("e2b", TinyGemma4::e2b()),
            ("a4b", TinyGemma4::a4b()),
            ("dense-w16", TinyGemma4 { window: 16, seed: 17, ..TinyGemma4::dense() }),
            ("e2b-w16", TinyGemma4 { window: 16, seed: 18, ..TinyGemma4::e2b() }),
        ];
        let assistants = vec![
            ("dense-w16-assistant", "dense-w16", TinyGemma4Assistant::default()),
            ("e2b-w16-assistant", "e2b-w16", TinyGemma4Assistant { seed: 22, ..TinyGemma4Assistant::default() }),
            ("e2b-w16-assistant-ordered", "e2b-w16", TinyGemma4Assistant { centroids: 8, centroid_top_k: 2, seed: 23, ..TinyGemma4Assistant::default() }),
        ];
        (targets, assistants)
    }

    pub fn n_layer(&self) -> usize {
        self.pattern.len()
    }

    pub fn kv_layers(&self) -> usize {
        self.n_layer() - self.shared_kv_layers
    }

    /// The layer whose K/V layer `l` reads.
    pub fn kv_layer(&self, l: usize) -> usize {
        if l < self.kv_layers() {
            l
        } else {
            self.kv_layers() - if self.pattern[l] { 2 } else { 1 }
        }
    }

    pub fn head_dim(&self, l: usize) -> usize {
        if self.pattern[l] {
            self.head_dim_swa
        } else {
            self.head_dim_global
        }
    }

    pub fn n_kv_head(&self, l: usize) -> usize {
        if self.pattern[l] {
            self.n_kv_head_swa
        } else {
            self.n_kv_head_global
        }
    }

    pub fn n_ff(&self, l: usize) -> usize {
        if l >= self.kv_layers() {
            self.n_ff_shared
        } else {
            self.n_ff
        }
    }

    pub fn write(&self, path: &Path) -> Gemma4Weights {
        let mut f = std::fs::File::create(path).expect("create the fixture file");
        self.write_to(&mut f)
    }

    pub fn write_to<W: Write + Seek>(&self, w: &mut W) -> Gemma4Weights {
        self.write_with(w, GgmlDType::F32, &[])
    }

    /// Writes the GGUF with its matrices in `dtype` (norms, scales and the router stay F32),
    /// leaving out the tensors named in `skip`; returns the weights as stored (dequantized).
    pub fn write_with<W: Write + Seek>(&self, w: &mut W, dtype: GgmlDType, skip: &[&str]) -> Gemma4Weights {
        let dev = Device::Cpu;
        let mut rng = Rng(self.seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
        let (d, n_layer, p) = (self.n_embd, self.n_layer(), self.per_layer);
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
        let norm = |rng: &mut Rng, n: usize| rng.vec(n, 0.3).into_iter().map(|x| 1.0 + x).collect::<Vec<f32>>();
        let f = GgmlDType::F32;
        // Matrices whose rows do not fill whole quantization blocks stay F32.
        let qt = |cols: usize| if cols.is_multiple_of(32) { dtype } else { f };
        let s = 1.0 / (d as f64).sqrt();
        let embd = put("token_embd.weight".into(), rng.vec(self.vocab * d, 1.0), vec![self.vocab, d], f);
        let output_norm = put("output_norm.weight".into(), norm(&mut rng, d), vec![d], f);
        let output = self.untied.then(|| put("output.weight".into(), rng.vec(self.vocab * d, s), vec![self.vocab, d], dtype));
        let half = self.head_dim_global / 2;
        let rope_freqs = put("rope_freqs.weight".into(), (0..half).map(|i| if i < self.global_rot_pairs { 1.0 } else { 1e30 }).collect(), vec![half], f);
        let ple = (p > 0).then(|| PleWeights {
            token_embd: put("per_layer_token_embd.weight".into(), rng.vec(self.vocab * n_layer * p, 1.0), vec![self.vocab, n_layer * p], qt(n_layer * p)),
            model_proj: put("per_layer_model_proj.weight".into(), rng.vec(n_layer * p * d, s), vec![n_layer * p, d], dtype),
            proj_norm: put("per_layer_proj_norm.weight".into(), norm(&mut rng, p), vec![p], f),
        });
        let mut layers = Vec::new();
        for l in 0..n_layer {
            let pre = format!("blk.{l}");
            let (hd, nkv, ff) = (self.head_dim(l), self.n_kv_head(l), self.n_ff(l));
            let qd = self.n_head * hd;
            let owns = l < self.kv_layers();
            let attn_norm = put(format!("{pre}.attn_norm.weight"), norm(&mut rng, d), vec![d], f);
            let q = put(format!("{pre}.attn_q.weight"), rng.vec(qd * d, s), vec![qd, d], dtype);
            let q_norm = put(format!("{pre}.attn_q_norm.weight"), norm(&mut rng, hd), vec![hd], f);
            let (k, k_norm, v) = if owns {
                let k = put(format!("{pre}.attn_k.weight"), rng.vec(nkv * hd * d, s), vec![nkv * hd, d], dtype);
                let k_norm = put(format!("{pre}.attn_k_norm.weight"), norm(&mut rng, hd), vec![hd], f);
                let v = (self.pattern[l] || !self.k_eq_v).then(|| put(format!("{pre}.attn_v.weight"), rng.vec(nkv * hd * d, s), vec![nkv * hd, d], dtype));
                (Some(k), Some(k_norm), v)
            } else {
                (None, None, None)
            };
            let o = put(format!("{pre}.attn_output.weight"), rng.vec(d * qd, 1.0 / (qd as f64).sqrt()), vec![d, qd], dtype);
            let post_attention_norm = put(format!("{pre}.post_attention_norm.weight"), norm(&mut rng, d), vec![d], f);
            let ffn_norm = put(format!("{pre}.ffn_norm.weight"), norm(&mut rng, d), vec![d], f);
            let gate = put(format!("{pre}.ffn_gate.weight"), rng.vec(ff * d, s), vec![ff, d], dtype);
            let up = put(format!("{pre}.ffn_up.weight"), rng.vec(ff * d, s), vec![ff, d], dtype);
            let down = put(format!("{pre}.ffn_down.weight"), rng.vec(d * ff, 1.0 / (ff as f64).sqrt()), vec![d, ff], dtype);
            let post_ffw_norm = put(format!("{pre}.post_ffw_norm.weight"), norm(&mut rng, d), vec![d], f);
            let moe = (self.n_expert > 0).then(|| {
                let (e, fe) = (self.n_expert, self.expert_ff);
                let router = put(format!("{pre}.ffn_gate_inp.weight"), rng.vec(e * d, 4.0 * s), vec![e, d], f);
                let router_scale = put(format!("{pre}.ffn_gate_inp.scale"), norm(&mut rng, d), vec![d], f);
                let gate_up = put(format!("{pre}.ffn_gate_up_exps.weight"), rng.vec(e * 2 * fe * d, s), vec![e, 2 * fe, d], dtype);
                let downs = put(format!("{pre}.ffn_down_exps.weight"), rng.vec(e * d * fe, 1.0 / (fe as f64).sqrt()), vec![e, d, fe], qt(fe));
                let scale = put(format!("{pre}.ffn_down_exps.scale"), norm(&mut rng, e), vec![e], f);
                let experts = (0..e)
                    .map(|i| {
                        let b = &gate_up[i * 2 * fe * d..(i + 1) * 2 * fe * d];
                        (b[..fe * d].to_vec(), b[fe * d..].to_vec(), downs[i * d * fe..(i + 1) * d * fe].to_vec())
                    })
                    .collect();
                MoeWeights {
                    router,
                    router_scale,
                    experts,
                    scale,
                    pre_norm: put(format!("{pre}.pre_ffw_norm_2.weight"), norm(&mut rng, d), vec![d], f),
                    post_norm_1: put(format!("{pre}.post_ffw_norm_1.weight"), norm(&mut rng, d), vec![d], f),
                    post_norm_2: put(format!("{pre}.post_ffw_norm_2.weight"), norm(&mut rng, d), vec![d], f),
                }
            });
            let ple = (p > 0).then(|| LayerPle {
                inp_gate: put(format!("{pre}.inp_gate.weight"), rng.vec(p * d, s), vec![p, d], dtype),
                proj: put(format!("{pre}.proj.weight"), rng.vec(d * p, 1.0 / (p as f64).sqrt()), vec![d, p], qt(p)),
                post_norm: put(format!("{pre}.post_norm.weight"), norm(&mut rng, d), vec![d], f),
            });
            let out_scale = put(format!("{pre}.layer_output_scale.weight"), vec![(0.6 + 0.4 * rng.next().abs()) as f32], vec![1], f)[0];
            layers.push(Gemma4Layer { attn_norm, q, q_norm, k, k_norm, v, o, post_attention_norm, ffn_norm, gate, up, down, post_ffw_norm, moe, ple, out_scale });
        }
        use gguf_file::Value as V;
        let u = |x: usize| V::U32(x as u32);
        let key = |k: &str| format!("gemma4.{k}");
        let arr = |f: &dyn Fn(usize) -> usize| V::Array((0..n_layer).map(|l| V::I32(f(l) as i32)).collect());
        let mut md: Vec<(String, V)> = vec![
            ("general.architecture".into(), V::String("gemma4".into())),
            ("general.name".into(), V::String("tiny-gemma4-test".into())),
            (key("block_count"), u(n_layer)),
            (key("context_length"), u(4096)),
            (key("embedding_length"), u(d)),
            (key("feed_forward_length"), if self.n_ff_shared != self.n_ff && self.shared_kv_layers > 0 { arr(&|l| self.n_ff(l)) } else { u(self.n_ff) }),
            (key("attention.head_count"), u(self.n_head)),
            (key("attention.head_count_kv"), if self.n_kv_head_swa != self.n_kv_head_global { arr(&|l| self.n_kv_head(l)) } else { u(self.n_kv_head_swa) }),
            (key("attention.key_length"), u(self.head_dim_global)),
            (key("attention.value_length"), u(self.head_dim_global)),
            (key("attention.key_length_swa"), u(self.head_dim_swa)),
            (key("attention.value_length_swa"), u(self.head_dim_swa)),
            (key("attention.layer_norm_rms_epsilon"), V::F32(EPS as f32)),
            (key("attention.sliding_window"), u(self.window)),
            (key("attention.sliding_window_pattern"), V::Array(self.pattern.iter().map(|&b| V::Bool(b)).collect())),
            (key("rope.freq_base"), V::F32(ROPE_BASE as f32)),
            (key("rope.freq_base_swa"), V::F32(ROPE_BASE_SWA as f32)),
            (key("rope.dimension_count"), u(self.head_dim_global)),
            (key("rope.dimension_count_swa"), u(self.head_dim_swa)),
            (key("embedding_length_per_layer_input"), u(p)),
        ];
        if self.tokenizer {
            assert_eq!(self.vocab, TOKENIZER_VOCAB, "the fixture's tokenizer has {TOKENIZER_VOCAB} tokens");
            let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"].map(String::from).to_vec();
            let mut types = vec![V::I32(3); 5];
            for b in 0..=255u8 {
                tokens.push(format!("<0x{b:02X}>"));
                types.push(V::I32(6));
            }
            for t in ["\u{2581}", "\n", "t", "\u{2581}t"] {
                tokens.push(t.to_string());
                types.push(V::I32(1));
            }
            md.push(("tokenizer.ggml.model".into(), V::String("gemma4".into())));
            md.push(("tokenizer.ggml.pre".into(), V::String("gemma4".into())));
            md.push(("tokenizer.ggml.tokens".into(), V::Array(tokens.into_iter().map(V::String).collect())));
            md.push(("tokenizer.ggml.token_type".into(), V::Array(types)));
            md.push(("tokenizer.ggml.merges".into(), V::Array(vec![V::String("\u{2581} t".into())])));
            md.push(("tokenizer.ggml.bos_token_id".into(), u(2)));
            md.push(("tokenizer.ggml.eos_token_id".into(), u(1)));
            md.push(("tokenizer.ggml.padding_token_id".into(), u(0)));
            md.push(("tokenizer.ggml.add_bos_token".into(), V::Bool(true)));
        }
        if self.shared_kv_layers > 0 {
            md.push((key("attention.shared_kv_layers"), u(self.shared_kv_layers)));
        }
        if let Some(c) = self.softcap {
            md.push((key("final_logit_softcapping"), V::F32(c as f32)));
        }
        if self.n_expert > 0 {
            md.push((key("expert_count"), u(self.n_expert)));
            md.push((key("expert_used_count"), u(self.n_expert_used)));
            md.push((key("expert_feed_forward_length"), u(self.expert_ff)));
        }
        let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(w, &md_refs, &t_refs).expect("write fixture GGUF");
        Gemma4Weights { cfg: self.clone(), embd, output_norm, output, rope_freqs, ple, layers }
    }
}

/// The per-layer embeddings' model-wide weights.
#[derive(Debug, Clone)]
pub struct PleWeights {
    pub token_embd: Vec<f64>,
    pub model_proj: Vec<f64>,
    pub proj_norm: Vec<f64>,
}

#[derive(Debug, Clone)]
pub struct LayerPle {
    pub inp_gate: Vec<f64>,
    pub proj: Vec<f64>,
    pub post_norm: Vec<f64>,
}

#[derive(Debug, Clone)]
pub struct MoeWeights {
    pub router: Vec<f64>,
    pub router_scale: Vec<f64>,
    /// (gate, up, down) per expert.
    pub experts: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)>,
    pub scale: Vec<f64>,
    pub pre_norm: Vec<f64>,
    pub post_norm_1: Vec<f64>,
    pub post_norm_2: Vec<f64>,
}

/// A layer's weights, row-major `(out, in)`.
#[derive(Debug, Clone)]
pub struct Gemma4Layer {
    pub attn_norm: Vec<f64>,
    pub q: Vec<f64>,
    pub q_norm: Vec<f64>,
    pub k: Option<Vec<f64>>,
    pub k_norm: Option<Vec<f64>>,
    pub v: Option<Vec<f64>>,
    pub o: Vec<f64>,
    pub post_attention_norm: Vec<f64>,
    pub ffn_norm: Vec<f64>,
    pub gate: Vec<f64>,
    pub up: Vec<f64>,
    pub down: Vec<f64>,
    pub post_ffw_norm: Vec<f64>,
    pub moe: Option<MoeWeights>,
    pub ple: Option<LayerPle>,
    pub out_scale: f64,
}

/// The weights as stored.
#[derive(Debug, Clone)]
pub struct Gemma4Weights {
    pub cfg: TinyGemma4,
    pub embd: Vec<f64>,
    pub output_norm: Vec<f64>,
    pub output: Option<Vec<f64>>,
    pub rope_freqs: Vec<f64>,
    pub ple: Option<PleWeights>,
    pub layers: Vec<Gemma4Layer>,
}

fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    let k = x.len();
    w.chunks(k).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms(x: &[f64], w: Option<&[f64]>) -> Vec<f64> {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + EPS).sqrt();
    x.iter().enumerate().map(|(i, v)| v * r * w.map_or(1.0, |w| w[i])).collect()
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// `x` rounded to the nearest f16 (ties to even), as a float.
fn round_f16(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let q = 2f64.powf(x.abs().log2().floor().max(-14.0) - 10.0);
    (x / q).round_ties_even() * q
}

/// llama.cpp's CPU GELU (`GGML_GELU_FP16`): a table over f16 inputs holding f16 outputs, 0 at
/// or below -10 and the input at or above 10.
fn gelu_llama(x: f64) -> f64 {
    let x = x as f32 as f64;
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        round_f16(gelu(round_f16(x)) as f32 as f64)
    }
}

fn geglu_with(gate: &[f64], up: &[f64], down: &[f64], x: &[f64], act: fn(f64) -> f64) -> Vec<f64> {
    let (g, u) = (matvec(gate, x), matvec(up, x));
    matvec(down, &g.iter().zip(&u).map(|(g, u)| act(*g) * u).collect::<Vec<_>>())
}

fn geglu(gate: &[f64], up: &[f64], down: &[f64], x: &[f64]) -> Vec<f64> {
    geglu_with(gate, up, down, x, gelu)
}

fn add(a: &mut [f64], b: &[f64]) {
    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
}

/// Scale-1 softmax attention of one query head over KV head `kvh` (of `hd` dims) of the rows
/// `ks`, `vs` it sees.
fn attend_head(q: &[f64], ks: &[Vec<f64>], vs: &[Vec<f64>], kvh: usize, hd: usize) -> Vec<f64> {
    let at = kvh * hd..(kvh + 1) * hd;
    let scores: Vec<f64> = ks.iter().map(|k| q.iter().zip(&k[at.clone()]).map(|(a, b)| a * b).sum()).collect();
    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
    let z: f64 = e.iter().sum();
    let mut o = vec![0.0; hd];
    for (v, ej) in vs.iter().zip(&e) {
        for (oi, vi) in o.iter_mut().zip(&v[at.clone()]) {
            *oi += ej / z * vi;
        }
    }
    o
}

/// NeoX RoPE of one head `x` at `pos`: pairs `(i, i + n/2)` over all `n` dims, frequency
/// `base^(-2i/n) / factor_i`.
fn rope(x: &mut [f64], pos: usize, base: f64, factors: Option<&[f64]>) {
    let n = x.len();
    let half = n / 2;
    for i in 0..half {
        let theta = pos as f64 * base.powf(-2.0 * i as f64 / n as f64) / factors.map_or(1.0, |f| f[i]);
        let (c, s) = (theta.cos(), theta.sin());
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}

/// A float64 Gemma 4 forward over one sequence, one token at a time (llama.cpp's semantics:
/// a sliding layer's query at `p` sees keys at `p - window < k <= p`). `Clone` is a snapshot.
#[derive(Debug, Clone)]
pub struct Gemma4Reference<'w> {
    w: &'w Gemma4Weights,
    /// Per layer that owns K/V: K and V rows of every position, `n_kv · hd` each.
    pub k: Vec<Vec<Vec<f64>>>,
    pub v: Vec<Vec<Vec<f64>>>,
    pub pos: usize,
    /// The last step's hidden state after the output norm.
    pub hidden: Vec<f64>,
    /// Compute GELU as llama.cpp's CPU backend does (an f16 table: inputs and outputs rounded to
    /// f16), to tell that rounding apart from other differences against llama.cpp.
    pub llama_gelu: bool,
}

impl<'w> Gemma4Reference<'w> {
    pub fn new(w: &'w Gemma4Weights) -> Self {
        let n = w.cfg.n_layer();
        Gemma4Reference { w, k: vec![Vec::new(); n], v: vec![Vec::new(); n], pos: 0, hidden: Vec::new(), llama_gelu: false }
    }

    /// The logits after `token` at the next position.
    pub fn step(&mut self, token: u32) -> Vec<f64> {
        let (w, c) = (self.w, &self.w.cfg);
        let (d, n_layer, p) = (c.n_embd, c.n_layer(), c.per_layer);
        let act: fn(f64) -> f64 = if self.llama_gelu { gelu_llama } else { gelu };
        let t = token as usize;
        let mut x: Vec<f64> = w.embd[t * d..(t + 1) * d].iter().map(|v| v * (d as f64).sqrt()).collect();
        let ple: Vec<Vec<f64>> = match &w.ple {
            Some(pw) => {
                let tok = &pw.token_embd[t * n_layer * p..(t + 1) * n_layer * p];
                let proj = matvec(&pw.model_proj, &x);
                (0..n_layer)
                    .map(|l| {
                        let pr: Vec<f64> = proj[l * p..(l + 1) * p].iter().map(|v| v / (d as f64).sqrt()).collect();
                        let pr = rms(&pr, Some(&pw.proj_norm));
                        pr.iter().zip(&tok[l * p..(l + 1) * p]).map(|(a, b)| (a + b * (p as f64).sqrt()) / 2f64.sqrt()).collect()
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        for (l, lw) in w.layers.iter().enumerate() {
            let (hd, sliding) = (c.head_dim(l), c.pattern[l]);
            let (base, factors) = if sliding { (ROPE_BASE_SWA, None) } else { (ROPE_BASE, Some(w.rope_freqs.as_slice())) };
            let h = rms(&x, Some(&lw.attn_norm));
            if let (Some(kw), Some(kn)) = (&lw.k, &lw.k_norm) {
                let kr = matvec(kw, &h);
                let vr = lw.v.as_ref().map_or(kr.clone(), |vw| matvec(vw, &h));
                let mut k = Vec::new();
                let mut v = Vec::new();
                for (kh, vh) in kr.chunks(hd).zip(vr.chunks(hd)) {
                    let mut kh = rms(kh, Some(kn));
                    rope(&mut kh, self.pos, base, factors);
                    k.extend(kh);
                    v.extend(rms(vh, None));
                }
                self.k[l].push(k);
                self.v[l].push(v);
            }
            let src = c.kv_layer(l);
            let nkv = c.n_kv_head(src);
            let group = c.n_head / nkv;
            let q = matvec(&lw.q, &h);
            let first = if sliding { (self.pos + 1).saturating_sub(c.window) } else { 0 };
            let mut out = Vec::with_capacity(c.n_head * hd);
            for (hi, qh) in q.chunks(hd).enumerate() {
                let mut qh = rms(qh, Some(&lw.q_norm));
                rope(&mut qh, self.pos, base, factors);
                out.extend(attend_head(&qh, &self.k[src][first..=self.pos], &self.v[src][first..=self.pos], hi / group, hd));
            }
            let a = rms(&matvec(&lw.o, &out), Some(&lw.post_attention_norm));
            add(&mut x, &a);
            let f_in = rms(&x, Some(&lw.ffn_norm));
            let mut f = geglu_with(&lw.gate, &lw.up, &lw.down, &f_in, act);
            if let Some(m) = &lw.moe {
                f = rms(&f, Some(&m.post_norm_1));
                let r_in: Vec<f64> = rms(&x, None).iter().zip(&m.router_scale).map(|(a, s)| a / (d as f64).sqrt() * s).collect();
                let r = matvec(&m.router, &r_in);
                let mx = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = r.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                let pr: Vec<f64> = e.iter().map(|v| v / z).collect();
                let mut order: Vec<usize> = (0..pr.len()).collect();
                order.sort_by(|&a, &b| pr[b].total_cmp(&pr[a]).then(a.cmp(&b)));
                let top = &order[..c.n_expert_used];
                let sum: f64 = top.iter().map(|&i| pr[i]).sum();
                let xe = rms(&x, Some(&m.pre_norm));
                let mut y = vec![0.0; d];
                for &i in top {
                    let (g, u, dn) = &m.experts[i];
                    for (a, b) in y.iter_mut().zip(geglu_with(g, u, dn, &xe, act)) {
                        *a += pr[i] / sum * m.scale[i] * b;
                    }
                }
                add(&mut f, &rms(&y, Some(&m.post_norm_2)));
            }
            add(&mut x, &rms(&f, Some(&lw.post_ffw_norm)));
            if let Some(pl) = &lw.ple {
                let g: Vec<f64> = matvec(&pl.inp_gate, &x).iter().zip(&ple[l]).map(|(g, e)| act(*g) * e).collect();
                add(&mut x, &rms(&matvec(&pl.proj, &g), Some(&pl.post_norm)));
            }
            x.iter_mut().for_each(|v| *v *= lw.out_scale);
        }
        self.pos += 1;
        self.hidden = rms(&x, Some(&w.output_norm));
        let logits = matvec(w.output.as_ref().unwrap_or(&w.embd), &self.hidden);
        match c.softcap {
            Some(cap) => logits.iter().map(|l| (l / cap).tanh() * cap).collect(),
            None => logits,
        }
    }
}

/// A synthetic `gemma4-assistant` for a [`TinyGemma4`] target: blocks of the given kinds (their
/// head sizes the target's), optionally with ordered embeddings (`masked_embd_*`).
#[derive(Debug, Clone)]
pub struct TinyGemma4Assistant {
    pub n_embd: usize,
    /// Per block: sliding-window (else global).
    pub pattern: Vec<bool>,
    pub n_head: usize,
    pub n_ff: usize,
    /// Centroid clusters (0: no ordered embeddings) and how many a draft scores.
    pub centroids: usize,
    pub centroid_top_k: usize,
    pub seed: u64,
}

impl Default for TinyGemma4Assistant {
    fn default() -> Self {
        TinyGemma4Assistant { n_embd: 32, pattern: vec![true, false], n_head: 2, n_ff: 64, centroids: 0, centroid_top_k: 0, seed: 21 }
    }
}

/// An assistant's weights as stored.
#[derive(Debug, Clone)]
pub struct AssistantWeights {
    pub cfg: TinyGemma4Assistant,
    pub embd: Vec<f64>,
    pub output_norm: Vec<f64>,
    pub pre: Vec<f64>,
    pub post: Vec<f64>,
    /// (attn_norm, q, q_norm, o, post_attention_norm, ffn_norm, gate, up, down, post_ffw_norm, out_scale)
    pub blocks: Vec<AssistantBlockWeights>,
    pub centroids: Option<(Vec<f64>, Vec<u32>)>,
}

#[derive(Debug, Clone)]
pub struct AssistantBlockWeights {
    pub attn_norm: Vec<f64>,
    pub q: Vec<f64>,
    pub q_norm: Vec<f64>,
    pub o: Vec<f64>,
    pub post_attention_norm: Vec<f64>,
    pub ffn_norm: Vec<f64>,
    pub gate: Vec<f64>,
    pub up: Vec<f64>,
    pub down: Vec<f64>,
    pub post_ffw_norm: Vec<f64>,
    pub out_scale: f64,
}

impl TinyGemma4Assistant {
    /// Writes the assistant for `target` (F32) to `path`.
    pub fn write(&self, target: &TinyGemma4, path: &Path) -> AssistantWeights {
        let mut f = std::fs::File::create(path).expect("create the assistant file");
        self.write_to(target, &mut f)
    }

    pub fn write_to<W: Write + Seek>(&self, target: &TinyGemma4, w: &mut W) -> AssistantWeights {
        let dev = Device::Cpu;
        let mut rng = Rng(self.seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
        let (d, dt, vocab) = (self.n_embd, target.n_embd, target.vocab);
        let f = GgmlDType::F32;
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut put = |name: String, data: Vec<f32>, shape: Vec<usize>| -> Vec<f64> {
            let t = Tensor::from_vec(data, shape, &dev).expect("fixture tensor");
            let back = t.flatten_all().expect("flatten").to_vec1::<f32>().expect("f32").into_iter().map(f64::from).collect();
            tensors.push((name, QTensor::quantize(&t, f).expect("f32 tensor")));
            back
        };
        let norm = |rng: &mut Rng, n: usize| rng.vec(n, 0.3).into_iter().map(|x| 1.0 + x).collect::<Vec<f32>>();
        let s = 1.0 / (d as f64).sqrt();
        let embd = put("token_embd.weight".into(), rng.vec(vocab * d, 1.0), vec![vocab, d]);
        let output_norm = put("output_norm.weight".into(), norm(&mut rng, d), vec![d]);
        let pre = put("nextn.pre_projection.weight".into(), rng.vec(d * 2 * dt, 1.0 / (2.0 * dt as f64).sqrt()), vec![d, 2 * dt]);
        let post = put("nextn.post_projection.weight".into(), rng.vec(dt * d, s), vec![dt, d]);
        let half = target.head_dim_global / 2;
        put("rope_freqs.weight".into(), (0..half).map(|i| if i < target.global_rot_pairs { 1.0 } else { 1e30 }).collect(), vec![half]);
        let mut blocks = Vec::new();
        for (i, &sliding) in self.pattern.iter().enumerate() {
            let p = format!("blk.{i}");
            let hd = if sliding { target.head_dim_swa } else { target.head_dim_global };
            let qd = self.n_head * hd;
            blocks.push(AssistantBlockWeights {
                attn_norm: put(format!("{p}.attn_norm.weight"), norm(&mut rng, d), vec![d]),
                q: put(format!("{p}.attn_q.weight"), rng.vec(qd * d, s), vec![qd, d]),
                q_norm: put(format!("{p}.attn_q_norm.weight"), norm(&mut rng, hd), vec![hd]),
                o: put(format!("{p}.attn_output.weight"), rng.vec(d * qd, 1.0 / (qd as f64).sqrt()), vec![d, qd]),
                post_attention_norm: put(format!("{p}.post_attention_norm.weight"), norm(&mut rng, d), vec![d]),
                ffn_norm: put(format!("{p}.ffn_norm.weight"), norm(&mut rng, d), vec![d]),
                gate: put(format!("{p}.ffn_gate.weight"), rng.vec(self.n_ff * d, s), vec![self.n_ff, d]),
                up: put(format!("{p}.ffn_up.weight"), rng.vec(self.n_ff * d, s), vec![self.n_ff, d]),
                down: put(format!("{p}.ffn_down.weight"), rng.vec(d * self.n_ff, 1.0 / (self.n_ff as f64).sqrt()), vec![d, self.n_ff]),
                post_ffw_norm: put(format!("{p}.post_ffw_norm.weight"), norm(&mut rng, d), vec![d]),
                out_scale: put(format!("{p}.layer_output_scale.weight"), vec![(0.6 + 0.4 * rng.next().abs()) as f32], vec![1])[0],
            });
        }
        let centroids = (self.centroids > 0).then(|| {
            let c = put("masked_embd_centroids.weight".into(), rng.vec(self.centroids * d, 1.0), vec![self.centroids, d]);
            // A fixed shuffle of the vocabulary: cluster k holds ordering[k·per..(k+1)·per].
            let mut ordering: Vec<u32> = (0..vocab as u32).collect();
            for i in (1..vocab).rev() {
                let j = ((rng.next() + 1.0) / 2.0 * (i + 1) as f64) as usize % (i + 1);
                ordering.swap(i, j);
            }
            put("masked_embd_ordering".into(), ordering.iter().map(|&x| x as f32).collect(), vec![vocab]);
            (c, ordering)
        });
        use gguf_file::Value as V;
        let u = |x: usize| V::U32(x as u32);
        let key = |k: &str| format!("gemma4-assistant.{k}");
        let mut md: Vec<(String, V)> = vec![
            ("general.architecture".into(), V::String("gemma4-assistant".into())),
            (key("block_count"), u(self.pattern.len())),
            (key("nextn_predict_layers"), u(self.pattern.len())),
            (key("embedding_length"), u(d)),
            (key("embedding_length_out"), u(dt)),
            (key("feed_forward_length"), u(self.n_ff)),
            (key("attention.head_count"), u(self.n_head)),
            (key("attention.head_count_kv"), u(target.n_kv_head_swa)),
            (key("attention.key_length"), u(target.head_dim_global)),
            (key("attention.value_length"), u(target.head_dim_global)),
            (key("attention.key_length_swa"), u(target.head_dim_swa)),
            (key("attention.value_length_swa"), u(target.head_dim_swa)),
            (key("attention.layer_norm_rms_epsilon"), V::F32(EPS as f32)),
            (key("attention.sliding_window"), u(target.window)),
            (key("attention.sliding_window_pattern"), V::Array(self.pattern.iter().map(|&b| V::Bool(b)).collect())),
            (key("attention.shared_kv_layers"), u(self.pattern.len())),
            (key("rope.freq_base"), V::F32(ROPE_BASE as f32)),
            (key("rope.freq_base_swa"), V::F32(ROPE_BASE_SWA as f32)),
            (key("rope.dimension_count"), u(target.head_dim_global)),
            (key("rope.dimension_count_swa"), u(target.head_dim_swa)),
        ];
        if self.centroids > 0 {
            md.push((key("centroid_intermediate_top_k"), u(self.centroid_top_k)));
        }
        let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(w, &md_refs, &t_refs).expect("write the assistant GGUF");
        AssistantWeights { cfg: self.clone(), embd, output_norm, pre, post, blocks, centroids }
    }
}

/// One float64 assistant draft step (llama.cpp's semantics) for `token` at `pos0 =
/// target.pos` over the target reference's K/V, reading `hidden`. Returns the logits (the
/// ordered embeddings' masking when the assistant has them and `ordered`) and `h'`.
pub fn assistant_step(target: &Gemma4Reference, a: &AssistantWeights, hidden: &[f64], token: u32, ordered: bool) -> (Vec<f64>, Vec<f64>) {
    let (tw, tc) = (target.w, &target.w.cfg);
    let dt = tc.n_embd;
    let pos0 = target.pos;
    let t = token as usize;
    let mut cat: Vec<f64> = tw.embd[t * dt..(t + 1) * dt].iter().map(|v| v * (dt as f64).sqrt()).collect();
    cat.extend_from_slice(hidden);
    let mut x = matvec(&a.pre, &cat);
    let n_layer = tc.n_layer();
    for (bw, &sliding) in a.blocks.iter().zip(&a.cfg.pattern) {
        let src = tc.kv_layer(n_layer - if sliding { 2 } else { 1 });
        let hd = tc.head_dim(src);
        let group = a.cfg.n_head / tc.n_kv_head(src);
        let (base, factors) = if sliding { (ROPE_BASE_SWA, None) } else { (ROPE_BASE, Some(tw.rope_freqs.as_slice())) };
        let h = rms(&x, Some(&bw.attn_norm));
        let q = matvec(&bw.q, &h);
        let first = if sliding { (pos0 + 1).saturating_sub(tc.window) } else { 0 };
        let mut out = Vec::new();
        for (hi, qh) in q.chunks(hd).enumerate() {
            let mut qh = rms(qh, Some(&bw.q_norm));
            rope(&mut qh, pos0, base, factors);
            out.extend(attend_head(&qh, &target.k[src][first..pos0], &target.v[src][first..pos0], hi / group, hd));
        }
        add(&mut x, &rms(&matvec(&bw.o, &out), Some(&bw.post_attention_norm)));
        let f = geglu(&bw.gate, &bw.up, &bw.down, &rms(&x, Some(&bw.ffn_norm)));
        add(&mut x, &rms(&f, Some(&bw.post_ffw_norm)));
        x.iter_mut().for_each(|v| *v *= bw.out_scale);
    }
    let n = rms(&x, Some(&a.output_norm));
    let mut logits = matvec(&a.embd, &n);
    if let (true, Some((c, ordering))) = (ordered, &a.centroids) {
        let scores = matvec(c, &n);
        let mut order: Vec<usize> = (0..scores.len()).collect();
        order.sort_by(|&x, &y| scores[y].total_cmp(&scores[x]).then(x.cmp(&y)));
        let per = tc.vocab / a.cfg.centroids;
        let keep: Vec<usize> = order[..a.cfg.centroid_top_k].iter().flat_map(|&k| ordering[k * per..(k + 1) * per].iter().map(|&i| i as usize)).collect();
        let floor = keep.iter().map(|&i| logits[i]).fold(f64::INFINITY, f64::min) - 1.0;
        let mut masked = vec![floor; logits.len()];
        for i in keep {
            masked[i] = logits[i];
        }
        logits = masked;
    }
    (logits, matvec(&a.post, &n))
}
