//! Test fixture for `quantized_gemma3`: tiny synthetic GGUFs and a float64 reference.
//!
//! [`TinyGemma3`] writes a small Gemma 3 GGUF with random weights, the real tensor names and
//! metadata keys, and a SentencePiece vocabulary (control tokens, byte tokens, scored pieces).
//! [`Reference`] is a straightforward float64 forward of the same weights, written from the
//! Gemma 3 description (not from candle's code), for tests to compare against.
//!
//! It lives in Tine's `tine-test-support` crate, not in a patch, so that retiring a patch cannot
//! take it; the patches' test files include it with `#[path]`, the crate re-exports it.

// Each test file uses a part of the fixture.
#![allow(dead_code)]

use std::io::{Seek, Write};
use std::path::Path;

use candle::quantized::{gguf_file, GgmlDType, QTensor};
use candle::{Device, Tensor};

/// The shape of a synthetic model. `Default` has six layers (five local, one global) and a
/// window of 4 so short sequences already run past it.
#[derive(Debug, Clone)]
pub struct TinyGemma3 {
    pub n_embd: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_layer: usize,
    pub window: usize,
    pub context: usize,
    pub seed: u64,
    /// Store the embedding table as Q8_0 (as real GGUFs do); otherwise F32.
    pub q8_embedding: bool,
    /// Append a NextN head (`nextn_predict_layers = 1`, one more block with `blk.L.nextn.*`).
    /// Its weights are drawn after the trunk's, so the trunk is the same with or without it.
    pub nextn: bool,
    /// `tokenizer.chat_template`, if any.
    pub chat_template: Option<String>,
    /// Append the control tokens of [`FIM`] to the vocabulary (fill-in-the-middle, `/infill`):
    /// prefix, suffix and middle named by `tokenizer.ggml.fim_{pre,suf,mid}_token_id`, the file
    /// separator by its text alone (as llama.cpp also finds them).
    pub fim: bool,
}

/// The fill-in-the-middle tokens a `fim` fixture appends, in this order.
pub const FIM: [&str; 4] = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"];

impl Default for TinyGemma3 {
    fn default() -> Self {
        TinyGemma3 { n_embd: 32, n_head: 4, n_kv_head: 1, head_dim: 16, n_ff: 64, n_layer: 6, window: 4, context: 256, seed: 7, q8_embedding: false, nextn: false, chat_template: None, fim: false }
    }
}

/// Control tokens first (ids as in Gemma: 0 pad, 1 eos, 2 bos, 3 unk), then byte tokens, then pieces.
pub const CONTROL: [&str; 6] = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"];
/// Scored pieces (higher score merges first).
pub const PIECES: &[&str] = &[
    "▁", "h", "e", "l", "o", "w", "r", "d", "t", "a", "n", "s", "i", "\n", "he", "ll", "hell", "hello", "▁w", "or", "▁wor", "▁world", "▁the", "th", "▁t", "an", "▁an", "in", "▁in", "é", "▁▁", "user",
    "model", "ld",
];

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

/// The weights as written (after any quantization round trip), in f64, row-major `(out, in)`.
#[derive(Debug, Clone)]
pub struct Weights {
    pub cfg: TinyGemma3,
    pub vocab: usize,
    pub embd: Vec<f64>,
    pub output_norm: Vec<f64>,
    pub layers: Vec<LayerWeights>,
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f64>,
    pub wq: Vec<f64>,
    pub wk: Vec<f64>,
    pub wv: Vec<f64>,
    pub wo: Vec<f64>,
    pub q_norm: Vec<f64>,
    pub k_norm: Vec<f64>,
    pub post_attn_norm: Vec<f64>,
    pub ffn_norm: Vec<f64>,
    pub gate: Vec<f64>,
    pub up: Vec<f64>,
    pub down: Vec<f64>,
    pub post_ffn_norm: Vec<f64>,
}

pub fn vocab() -> Vec<String> {
    let mut v: Vec<String> = CONTROL.iter().map(|s| s.to_string()).collect();
    v.extend((0..256).map(|b| format!("<0x{b:02X}>")));
    v.extend(PIECES.iter().map(|s| s.to_string()));
    v
}

impl TinyGemma3 {
    /// Writes the GGUF to `path`; returns the weights for a reference forward.
    pub fn write(&self, path: &Path) -> Weights {
        let mut f = std::fs::File::create(path).expect("create fixture GGUF");
        self.write_to(&mut f)
    }

    /// Writes the GGUF to `w` (a file, or a `Cursor` for tests that stay in memory).
    pub fn write_to<W: Write + Seek>(&self, w: &mut W) -> Weights {
        let dev = Device::Cpu;
        let mut rng = Rng(self.seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
        let mut tokens = vocab();
        if self.fim {
            tokens.extend(FIM.iter().map(|t| t.to_string()));
        }
        let n_vocab = tokens.len();
        let (d, hd) = (self.n_embd, self.head_dim);
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut put = |name: String, data: Vec<f32>, shape: Vec<usize>, dtype: GgmlDType| -> Vec<f64> {
            let t = Tensor::from_vec(data, shape, &dev).expect("fixture tensor");
            let q = QTensor::quantize(&t, dtype).expect("fixture quantize");
            let back: Vec<f64> = q.dequantize(&dev).expect("dequantize").flatten_all().expect("flatten").to_vec1::<f32>().expect("f32").into_iter().map(f64::from).collect();
            tensors.push((name, q));
            back
        };
        // Norm weights are stored as GGUF stores Gemma's: already `1 + w`.
        let norm = |rng: &mut Rng, n: usize| rng.vec(n, 0.3).into_iter().map(|x| 1.0 + x).collect::<Vec<f32>>();
        let embd_type = if self.q8_embedding { GgmlDType::Q8_0 } else { GgmlDType::F32 };
        let embd = put("token_embd.weight".into(), rng.vec(n_vocab * d, 1.0), vec![n_vocab, d], embd_type);
        let output_norm = put("output_norm.weight".into(), norm(&mut rng, d), vec![d], GgmlDType::F32);
        let mut layers = Vec::new();
        for l in 0..self.n_layer + usize::from(self.nextn) {
            let p = format!("blk.{l}");
            let f = GgmlDType::F32;
            let s = 1.0 / (d as f64).sqrt();
            layers.push(LayerWeights {
                attn_norm: put(format!("{p}.attn_norm.weight"), norm(&mut rng, d), vec![d], f),
                wq: put(format!("{p}.attn_q.weight"), rng.vec(self.n_head * hd * d, s), vec![self.n_head * hd, d], f),
                wk: put(format!("{p}.attn_k.weight"), rng.vec(self.n_kv_head * hd * d, s), vec![self.n_kv_head * hd, d], f),
                wv: put(format!("{p}.attn_v.weight"), rng.vec(self.n_kv_head * hd * d, s), vec![self.n_kv_head * hd, d], f),
                wo: put(format!("{p}.attn_output.weight"), rng.vec(d * self.n_head * hd, 1.0 / ((self.n_head * hd) as f64).sqrt()), vec![d, self.n_head * hd], f),
                q_norm: put(format!("{p}.attn_q_norm.weight"), norm(&mut rng, hd), vec![hd], f),
                k_norm: put(format!("{p}.attn_k_norm.weight"), norm(&mut rng, hd), vec![hd], f),
                post_attn_norm: put(format!("{p}.post_attention_norm.weight"), norm(&mut rng, d), vec![d], f),
                ffn_norm: put(format!("{p}.ffn_norm.weight"), norm(&mut rng, d), vec![d], f),
                gate: put(format!("{p}.ffn_gate.weight"), rng.vec(self.n_ff * d, s), vec![self.n_ff, d], f),
                up: put(format!("{p}.ffn_up.weight"), rng.vec(self.n_ff * d, s), vec![self.n_ff, d], f),
                down: put(format!("{p}.ffn_down.weight"), rng.vec(d * self.n_ff, 1.0 / (self.n_ff as f64).sqrt()), vec![d, self.n_ff], f),
                post_ffn_norm: put(format!("{p}.post_ffw_norm.weight"), norm(&mut rng, d), vec![d], f),
            });
        }
        if self.nextn {
            // The head's block is not part of the trunk the reference runs.
            layers.pop();
            let p = format!("blk.{}.nextn", self.n_layer);
            let f = GgmlDType::F32;
            put(format!("{p}.eh_proj.weight"), rng.vec(d * 2 * d, 1.0 / (2.0 * d as f64).sqrt()), vec![d, 2 * d], f);
            put(format!("{p}.enorm.weight"), norm(&mut rng, d), vec![d], f);
            put(format!("{p}.hnorm.weight"), norm(&mut rng, d), vec![d], f);
            put(format!("{p}.shared_head_norm.weight"), norm(&mut rng, d), vec![d], f);
        }
        use gguf_file::Value as V;
        let u = |x: usize| V::U32(x as u32);
        let mut scores = vec![0f32; n_vocab];
        let mut types = vec![1i32; n_vocab];
        for (i, t) in types.iter_mut().enumerate().take(CONTROL.len()) {
            *t = if i == 3 { 2 } else { 3 };
        }
        for t in types.iter_mut().skip(CONTROL.len()).take(256) {
            *t = 6;
        }
        let fim_base = CONTROL.len() + 256 + PIECES.len();
        for t in types.iter_mut().skip(fim_base) {
            *t = 3;
        }
        for (i, piece) in PIECES.iter().enumerate() {
            // Longer pieces score higher, so merges build them; ties broken by position.
            scores[CONTROL.len() + 256 + i] = piece.chars().count() as f32 * 10.0 - i as f32 * 0.01;
        }
        let md: Vec<(&str, V)> = vec![
            ("general.architecture", V::String("gemma3".into())),
            ("general.name", V::String("tiny-gemma3-test".into())),
            ("gemma3.context_length", u(self.context)),
            ("gemma3.embedding_length", u(d)),
            ("gemma3.block_count", u(self.n_layer + usize::from(self.nextn))),
            ("gemma3.nextn_predict_layers", u(usize::from(self.nextn))),
            ("gemma3.feed_forward_length", u(self.n_ff)),
            ("gemma3.attention.head_count", u(self.n_head)),
            ("gemma3.attention.head_count_kv", u(self.n_kv_head)),
            ("gemma3.attention.key_length", u(hd)),
            ("gemma3.attention.value_length", u(hd)),
            ("gemma3.attention.layer_norm_rms_epsilon", V::F32(1e-6)),
            ("gemma3.attention.sliding_window", u(self.window)),
            ("gemma3.rope.freq_base", V::F32(1_000_000.0)),
            ("tokenizer.ggml.model", V::String("llama".into())),
            ("tokenizer.ggml.tokens", V::Array(tokens.iter().map(|t| V::String(t.clone())).collect())),
            ("tokenizer.ggml.scores", V::Array(scores.iter().map(|&s| V::F32(s)).collect())),
            ("tokenizer.ggml.token_type", V::Array(types.iter().map(|&t| V::I32(t)).collect())),
            ("tokenizer.ggml.bos_token_id", V::U32(2)),
            ("tokenizer.ggml.eos_token_id", V::U32(1)),
            ("tokenizer.ggml.unknown_token_id", V::U32(3)),
            ("tokenizer.ggml.add_bos_token", V::Bool(true)),
            ("tokenizer.ggml.add_eos_token", V::Bool(false)),
            ("tokenizer.ggml.add_space_prefix", V::Bool(false)),
        ];
        let mut md = md;
        if self.fim {
            md.push(("tokenizer.ggml.fim_pre_token_id", u(fim_base)));
            md.push(("tokenizer.ggml.fim_suf_token_id", u(fim_base + 1)));
            md.push(("tokenizer.ggml.fim_mid_token_id", u(fim_base + 2)));
        }
        if let Some(t) = &self.chat_template {
            md.push(("tokenizer.chat_template", V::String(t.clone())));
        }
        let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (*k, v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(w, &md_refs, &t_refs).expect("write fixture GGUF");
        Weights { cfg: self.clone(), vocab: n_vocab, embd, output_norm, layers }
    }
}

/// A synthetic assistant head (llama.cpp's `gemma4-assistant` layout) for a [`TinyGemma3`] target.
#[derive(Debug, Clone)]
pub struct TinyAssistant {
    pub n_embd: usize,
    pub n_head: usize,
    pub n_ff: usize,
    /// Blocks; their attention type alternates local, global, local, ...
    pub n_layer: usize,
    pub seed: u64,
    /// Write the AtomicChat variant: `gemma4_assistant`, `n_embd_backbone`, `mtp.*` projections.
    pub variant_names: bool,
}

impl Default for TinyAssistant {
    fn default() -> Self {
        TinyAssistant { n_embd: 24, n_head: 2, n_ff: 48, n_layer: 2, seed: 17, variant_names: false }
    }
}

impl TinyAssistant {
    /// Writes a head whose dimensions fit `target` to `path`.
    pub fn write(&self, target: &TinyGemma3, path: &Path) {
        let mut f = std::fs::File::create(path).expect("create fixture GGUF");
        self.write_to(target, &mut f)
    }

    /// Writes the head to `w`.
    pub fn write_to<W: Write + Seek>(&self, target: &TinyGemma3, w: &mut W) {
        let dev = Device::Cpu;
        let mut rng = Rng(self.seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
        let n_vocab = vocab().len();
        let (d, d_out, hd) = (self.n_embd, target.n_embd, target.head_dim);
        let f = GgmlDType::F32;
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut put = |name: String, data: Vec<f32>, shape: Vec<usize>| {
            let t = Tensor::from_vec(data, shape, &dev).expect("fixture tensor");
            tensors.push((name, QTensor::quantize(&t, f).expect("fixture quantize")));
        };
        let norm = |rng: &mut Rng, n: usize| rng.vec(n, 0.3).into_iter().map(|x| 1.0 + x).collect::<Vec<f32>>();
        let s = 1.0 / (d as f64).sqrt();
        let proj = if self.variant_names { "mtp" } else { "nextn" };
        put("token_embd.weight".into(), rng.vec(n_vocab * d, 1.0), vec![n_vocab, d]);
        put("output_norm.weight".into(), norm(&mut rng, d), vec![d]);
        put(format!("{proj}.pre_projection.weight"), rng.vec(d * 2 * d_out, 1.0 / (2.0 * d_out as f64).sqrt()), vec![d, 2 * d_out]);
        put(format!("{proj}.post_projection.weight"), rng.vec(d_out * d, s), vec![d_out, d]);
        for l in 0..self.n_layer {
            let p = format!("blk.{l}");
            put(format!("{p}.attn_norm.weight"), norm(&mut rng, d), vec![d]);
            put(format!("{p}.attn_q.weight"), rng.vec(self.n_head * hd * d, s), vec![self.n_head * hd, d]);
            put(format!("{p}.attn_q_norm.weight"), norm(&mut rng, hd), vec![hd]);
            put(format!("{p}.attn_output.weight"), rng.vec(d * self.n_head * hd, 1.0 / ((self.n_head * hd) as f64).sqrt()), vec![d, self.n_head * hd]);
            put(format!("{p}.post_attention_norm.weight"), norm(&mut rng, d), vec![d]);
            put(format!("{p}.ffn_norm.weight"), norm(&mut rng, d), vec![d]);
            put(format!("{p}.ffn_gate.weight"), rng.vec(self.n_ff * d, s), vec![self.n_ff, d]);
            put(format!("{p}.ffn_up.weight"), rng.vec(self.n_ff * d, s), vec![self.n_ff, d]);
            put(format!("{p}.ffn_down.weight"), rng.vec(d * self.n_ff, 1.0 / (self.n_ff as f64).sqrt()), vec![d, self.n_ff]);
            put(format!("{p}.post_ffw_norm.weight"), norm(&mut rng, d), vec![d]);
            put(format!("{p}.layer_output_scale.weight"), vec![0.5 + 0.25 * l as f32], vec![1]);
        }
        use gguf_file::Value as V;
        let u = |x: usize| V::U32(x as u32);
        let arch = if self.variant_names { "gemma4_assistant" } else { "gemma4-assistant" };
        let out_key = if self.variant_names { "n_embd_backbone" } else { "embedding_length_out" };
        let md: Vec<(String, V)> = vec![
            ("general.architecture".into(), V::String(arch.into())),
            ("general.name".into(), V::String("tiny-assistant-test".into())),
            (format!("{arch}.embedding_length"), u(d)),
            (format!("{arch}.{out_key}"), u(d_out)),
            (format!("{arch}.block_count"), u(self.n_layer)),
            (format!("{arch}.nextn_predict_layers"), u(self.n_layer)),
            (format!("{arch}.feed_forward_length"), u(self.n_ff)),
            (format!("{arch}.attention.head_count"), u(self.n_head)),
            (format!("{arch}.attention.key_length"), u(hd)),
            (format!("{arch}.attention.layer_norm_rms_epsilon"), V::F32(1e-6)),
            (format!("{arch}.attention.sliding_window"), u(target.window)),
            (format!("{arch}.attention.sliding_window_pattern"), V::Array((0..self.n_layer).map(|l| V::Bool(l % 2 == 0)).collect())),
        ];
        let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(w, &md_refs, &t_refs).expect("write fixture GGUF");
    }
}

fn rms_norm(x: &[f64], w: &[f64]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + 1e-6).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

fn matvec(w: &[f64], x: &[f64], out: usize) -> Vec<f64> {
    let n = x.len();
    (0..out).map(|o| w[o * n..(o + 1) * n].iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// NEOX rotary embedding: pairs `(i, i + d/2)`.
fn rope(x: &mut [f64], pos: usize, base: f64) {
    let d = x.len();
    for i in 0..d / 2 {
        let theta = pos as f64 / base.powf(2.0 * i as f64 / d as f64);
        let (s, c) = theta.sin_cos();
        let (a, b) = (x[i], x[i + d / 2]);
        x[i] = a * c - b * s;
        x[i + d / 2] = a * s + b * c;
    }
}

/// Gemma 3 in float64: the reference the tests compare with.
pub struct Reference<'w> {
    w: &'w Weights,
    /// Per layer: keys and values of every position so far (after norm and rope).
    keys: Vec<Vec<Vec<f64>>>,
    values: Vec<Vec<Vec<f64>>>,
    /// The last step's final hidden state after the output norm (what embeddings pool).
    pub embedding: Vec<f64>,
}

impl<'w> Reference<'w> {
    pub fn new(w: &'w Weights) -> Self {
        Reference { w, keys: vec![Vec::new(); w.cfg.n_layer], values: vec![Vec::new(); w.cfg.n_layer], embedding: Vec::new() }
    }

    /// Logits after feeding `token` at the next position.
    pub fn step(&mut self, token: u32) -> Vec<f64> {
        let c = &self.w.cfg;
        let (d, hd) = (c.n_embd, c.head_dim);
        let pos = self.keys[0].len();
        let t = token as usize;
        let mut x: Vec<f64> = self.w.embd[t * d..(t + 1) * d].iter().map(|v| v * (d as f64).sqrt()).collect();
        for (l, lw) in self.w.layers.iter().enumerate() {
            // Layers 6k+5 are global, the rest local (Gemma 3's pattern of 6).
            let local = (l + 1) % 6 != 0;
            let base = if local { 10_000.0 } else { 1_000_000.0 };
            let h = rms_norm(&x, &lw.attn_norm);
            let q = matvec(&lw.wq, &h, c.n_head * hd);
            let k = matvec(&lw.wk, &h, c.n_kv_head * hd);
            let v = matvec(&lw.wv, &h, c.n_kv_head * hd);
            let mut kk = Vec::new();
            for head in 0..c.n_kv_head {
                let mut kh = rms_norm(&k[head * hd..(head + 1) * hd], &lw.k_norm);
                rope(&mut kh, pos, base);
                kk.extend(kh);
            }
            self.keys[l].push(kk);
            self.values[l].push(v);
            let mut attn = vec![0.0; c.n_head * hd];
            for head in 0..c.n_head {
                let kvh = head / (c.n_head / c.n_kv_head);
                let mut qh = rms_norm(&q[head * hd..(head + 1) * hd], &lw.q_norm);
                rope(&mut qh, pos, base);
                let first = if local { (pos + 1).saturating_sub(c.window) } else { 0 };
                let scores: Vec<f64> = (first..=pos).map(|j| qh.iter().zip(&self.keys[l][j][kvh * hd..(kvh + 1) * hd]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()).collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in (first..=pos).zip(&e) {
                    for i in 0..hd {
                        attn[head * hd + i] += ej / z * self.values[l][j][kvh * hd + i];
                    }
                }
            }
            let o = rms_norm(&matvec(&lw.wo, &attn, d), &lw.post_attn_norm);
            x = x.iter().zip(&o).map(|(a, b)| a + b).collect();
            let h = rms_norm(&x, &lw.ffn_norm);
            let g = matvec(&lw.gate, &h, c.n_ff);
            let u = matvec(&lw.up, &h, c.n_ff);
            let gu: Vec<f64> = g.iter().zip(&u).map(|(g, u)| gelu_tanh(*g) * u).collect();
            let f = rms_norm(&matvec(&lw.down, &gu, d), &lw.post_ffn_norm);
            x = x.iter().zip(&f).map(|(a, b)| a + b).collect();
        }
        let h = rms_norm(&x, &self.w.output_norm);
        let logits = matvec(&self.w.embd, &h, self.w.vocab);
        self.embedding = h;
        logits
    }
}

impl Weights {
    /// Every tensor of a real Gemma 3 GGUF, dequantized to f64 (about 8 bytes per parameter).
    pub fn from_gguf(path: &Path) -> Weights {
        let mut f = std::fs::File::open(path).expect("open GGUF");
        let ct = gguf_file::Content::read(&mut f).expect("read GGUF");
        let dev = Device::Cpu;
        let md = |k: &str| ct.metadata.get(&format!("gemma3.{k}")).and_then(|v| v.to_u32().ok()).map(|v| v as usize).expect("metadata");
        let mut get = |name: &str| -> Vec<f64> {
            let q = ct.tensor(&mut f, name, &dev).unwrap_or_else(|e| panic!("{name}: {e}"));
            q.dequantize(&dev).expect("dequantize").flatten_all().expect("flatten").to_vec1::<f32>().expect("f32").into_iter().map(f64::from).collect()
        };
        let cfg = TinyGemma3 {
            n_embd: md("embedding_length"),
            n_head: md("attention.head_count"),
            n_kv_head: md("attention.head_count_kv"),
            head_dim: md("attention.key_length"),
            n_ff: md("feed_forward_length"),
            n_layer: md("block_count"),
            window: md("attention.sliding_window"),
            context: md("context_length"),
            seed: 0,
            q8_embedding: true,
            nextn: false,
            chat_template: None,
            fim: false,
        };
        let embd = get("token_embd.weight");
        let vocab = embd.len() / cfg.n_embd;
        let output_norm = get("output_norm.weight");
        let layers = (0..cfg.n_layer)
            .map(|l| {
                let mut g = |s: &str| get(&format!("blk.{l}.{s}.weight"));
                LayerWeights {
                    attn_norm: g("attn_norm"),
                    wq: g("attn_q"),
                    wk: g("attn_k"),
                    wv: g("attn_v"),
                    wo: g("attn_output"),
                    q_norm: g("attn_q_norm"),
                    k_norm: g("attn_k_norm"),
                    post_attn_norm: g("post_attention_norm"),
                    ffn_norm: g("ffn_norm"),
                    gate: g("ffn_gate"),
                    up: g("ffn_up"),
                    down: g("ffn_down"),
                    post_ffn_norm: g("post_ffw_norm"),
                }
            })
            .collect();
        Weights { cfg, vocab, embd, output_norm, layers }
    }
}

/// Writes `cfg` to memory and loads it with `quantized_gemma3`; returns the model and the
/// weights for a [`Reference`].
pub fn load(cfg: &TinyGemma3) -> (candle_transformers::models::quantized_gemma3::ModelWeights, Weights) {
    let mut bytes = std::io::Cursor::new(Vec::new());
    let weights = cfg.write_to(&mut bytes);
    bytes.set_position(0);
    let ct = gguf_file::Content::read(&mut bytes).expect("the fixture parses");
    let model = candle_transformers::models::quantized_gemma3::ModelWeights::from_gguf(ct, &mut bytes, &Device::Cpu).expect("the fixture loads");
    (model, weights)
}

/// Token ids spread over the fixture's vocabulary, starting with `<bos>`.
pub fn tokens(n: usize) -> Vec<u32> {
    std::iter::once(2).chain((1..n as u32).map(|i| 6 + (i * 37) % 280)).collect()
}

/// `(1, n)` token ids.
pub fn ids(tokens: &[u32]) -> Tensor {
    Tensor::new(tokens, &Device::Cpu).and_then(|t| t.unsqueeze(0)).expect("token tensor")
}

/// The largest absolute difference between f32 logits (any shape) and a float64 reference row.
pub fn max_diff(logits: &Tensor, want: &[f64]) -> f64 {
    let got = logits.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("f32 logits");
    assert_eq!(got.len(), want.len(), "logit count");
    got.iter().zip(want).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}

/// f32 forward vs the f64 reference: the largest absolute logit difference allowed. Logits of the
/// fixture are O(1)-O(10); f32 accumulation error over six layers stays near 1e-5.
pub const REF_TOLERANCE: f64 = 2e-3;
