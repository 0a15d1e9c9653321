//! A Gemma 3, Gemma 4 or Qwen3.5 GGUF's shape as the GPU engine reads it: the hyperparameters of its step program,
//! and which blocks belong to the trunk and which to a NextN head. Host code only (no CUDA), so
//! CI tests it.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

/// The hyperparameters the step program needs, read from the GGUF's metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Config {
    pub hidden: usize,
    /// Blocks of the trunk (`block_count` less the NextN head's block, when there is one).
    pub layers: usize,
    pub n_head: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub ff: usize,
    pub vocab: usize,
    pub eps: f32,
    pub rope_global: f32,
    pub rope_local: f32,
    pub window: usize,
    /// Every `sliding_pattern`-th layer is global, the rest local.
    pub sliding_pattern: usize,
    /// Whether block `layers` (the last of `block_count`) is a NextN head
    /// (`gemma3.nextn_predict_layers = 1`): `blk.{layers}.*` with `blk.{layers}.nextn.*`.
    pub nextn: bool,
}

impl Gemma3Config {
    /// Reads the metadata of a `gemma3` GGUF whose token table has `vocab` rows. A NextN head
    /// takes the last block out of the trunk, as llama.cpp and candle read such a file; more than
    /// one NextN layer is refused.
    pub fn from_metadata(md: &HashMap<String, Value>, vocab: usize) -> Result<Gemma3Config, String> {
        let get = |key: &str| md.get(&format!("gemma3.{key}"));
        let u = |key: &str| -> Result<usize, String> { get(key).and_then(|v| v.to_u32().ok()).map(|v| v as usize).ok_or_else(|| format!("metadata gemma3.{key} missing")) };
        let f = |key: &str, default: f32| get(key).and_then(|v| v.to_f32().ok()).unwrap_or(default);
        let blocks = u("block_count")?;
        let nextn = match get("nextn_predict_layers").map(|v| v.to_u32()) {
            None | Some(Ok(0)) => false,
            Some(Ok(1)) => true,
            Some(Ok(n)) => return Err(format!("gemma3.nextn_predict_layers = {n}: one NextN layer is supported")),
            Some(Err(e)) => return Err(format!("gemma3.nextn_predict_layers: {e}")),
        };
        let layers = blocks - usize::from(nextn);
        if layers == 0 {
            return Err(format!("gemma3.block_count = {blocks} leaves no trunk block"));
        }
        Ok(Gemma3Config {
            hidden: u("embedding_length")?,
            layers,
            n_head: u("attention.head_count")?,
            n_kv: u("attention.head_count_kv")?,
            head_dim: u("attention.key_length")?,
            ff: u("feed_forward_length")?,
            vocab,
            eps: f("attention.layer_norm_rms_epsilon", 1e-6),
            rope_global: f("rope.freq_base", 1_000_000.0),
            rope_local: f("rope.local_freq_base", 10_000.0),
            window: u("attention.sliding_window")?,
            sliding_pattern: u("attention.sliding_window_type").unwrap_or(6).max(1),
            nextn,
        })
    }

    /// Whether block `l` attends over a sliding window (candle's and llama.cpp's rule). Block
    /// `layers`, a NextN head's, follows the same rule by its index.
    pub fn is_local(&self, l: usize) -> bool {
        !(l + 1).is_multiple_of(self.sliding_pattern)
    }
}

/// The hyperparameters of a `qwen35` GGUF's step program (llama.cpp's converter's layout: norms
/// stored as `1 + w`, `ssm_a` as `-exp(A_log)`, value heads in tiled order, `attn_q` as
/// `[q | gate]` per head), and `qwen35moe`'s experts ([`Qwen35Moe`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen35Config {
    pub hidden: usize,
    /// Trunk layers (`block_count - nextn_predict_layers`).
    pub layers: usize,
    pub n_head: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    /// Dims rotated at the front of each attention head.
    pub rope_dim: usize,
    pub rope_base: f32,
    pub ff: usize,
    pub vocab: usize,
    pub eps: f32,
    /// Conv taps of the delta-net layers.
    pub conv_kernel: usize,
    /// d_k = d_v of the delta-net heads.
    pub d_state: usize,
    /// Key heads H_k and value heads H_v of the delta-net layers.
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    /// Per trunk layer: full attention (else a delta-net layer).
    pub full_attention: Vec<bool>,
    /// NextN layers after the trunk (`nextn_predict_layers`).
    pub nextn_layers: usize,
    /// `qwen35moe`: every block's feed-forward is routed experts plus a shared expert.
    pub moe: Option<Qwen35Moe>,
}

/// A `qwen35moe` GGUF's experts (`{arch}.expert_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Qwen35Moe {
    pub experts: usize,
    pub used: usize,
    /// Rows of each routed expert's gate and up (`expert_feed_forward_length`).
    pub expert_ff: usize,
    /// Rows of the shared expert's gate and up (`expert_shared_feed_forward_length`).
    pub shared_ff: usize,
}

impl Qwen35Config {
    /// Reads the metadata of a `qwen35` GGUF whose token table has `vocab` rows (the rules of
    /// candle's `quantized_qwen35::Config`).
    pub fn from_metadata(md: &HashMap<String, Value>, vocab: usize) -> Result<Qwen35Config, String> {
        let arch = md.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
        if arch != "qwen35" && arch != "qwen35moe" {
            return Err(format!("architecture `{arch}` is not qwen35 or qwen35moe"));
        }
        let get = |key: &str| md.get(&format!("{arch}.{key}"));
        let u = |key: &str| -> Result<usize, String> { get(key).and_then(|v| v.to_u32().ok()).map(|v| v as usize).ok_or_else(|| format!("metadata {arch}.{key} missing")) };
        let moe = if arch == "qwen35moe" {
            let m = Qwen35Moe { experts: u("expert_count")?, used: u("expert_used_count")?, expert_ff: u("expert_feed_forward_length")?, shared_ff: u("expert_shared_feed_forward_length")? };
            if m.used == 0 || m.used > m.experts {
                return Err(format!("qwen35moe: {} experts used of {}", m.used, m.experts));
            }
            Some(m)
        } else {
            None
        };
        let f = |key: &str, default: f32| get(key).and_then(|v| v.to_f32().ok()).unwrap_or(default);
        let blocks = u("block_count")?;
        let nextn_layers = if get("nextn_predict_layers").is_some() { u("nextn_predict_layers")? } else { 0 };
        if nextn_layers >= blocks {
            return Err(format!("qwen35.nextn_predict_layers = {nextn_layers} of {blocks} blocks leaves no trunk"));
        }
        let layers = blocks - nextn_layers;
        let full_attention = match get("attention.recurrent_layers") {
            Some(Value::Array(vs)) => {
                let rec = vs.iter().map(|v| v.to_bool().map_err(|e| format!("qwen35.attention.recurrent_layers: {e}"))).collect::<Result<Vec<bool>, String>>()?;
                if rec.len() < layers {
                    return Err(format!("qwen35.attention.recurrent_layers has {} entries for {layers} layers", rec.len()));
                }
                rec[..layers].iter().map(|r| !r).collect()
            }
            Some(_) => return Err("qwen35.attention.recurrent_layers is not an array".into()),
            None => {
                let interval = if get("full_attention_interval").is_some() { u("full_attention_interval")? } else { 4 };
                if interval == 0 {
                    return Err("qwen35.full_attention_interval is 0".into());
                }
                (0..layers).map(|l| (l + 1) % interval == 0).collect()
            }
        };
        let head_dim = u("attention.key_length")?;
        let cfg = Qwen35Config {
            hidden: u("embedding_length")?,
            layers,
            n_head: u("attention.head_count")?,
            n_kv: u("attention.head_count_kv")?,
            head_dim,
            rope_dim: if get("rope.dimension_count").is_some() { u("rope.dimension_count")? } else { head_dim / 4 },
            rope_base: f("rope.freq_base", 10_000_000.0),
            // A MoE file may leave the dense width out: no block reads it.
            ff: if moe.is_some() && get("feed_forward_length").is_none() { 0 } else { u("feed_forward_length")? },
            vocab,
            eps: f("attention.layer_norm_rms_epsilon", 1e-6),
            conv_kernel: u("ssm.conv_kernel")?,
            d_state: u("ssm.state_size")?,
            n_k_heads: u("ssm.group_count")?,
            n_v_heads: u("ssm.time_step_rank")?,
            full_attention,
            nextn_layers,
            moe,
        };
        if get("attention.value_length").is_some() && u("attention.value_length")? != head_dim {
            return Err(format!("{arch}.attention.value_length differs from key_length ({head_dim})"));
        }
        if cfg.n_kv == 0 || !cfg.n_head.is_multiple_of(cfg.n_kv) {
            return Err(format!("qwen35: {} query heads over {} KV heads", cfg.n_head, cfg.n_kv));
        }
        if cfg.n_k_heads == 0 || !cfg.n_v_heads.is_multiple_of(cfg.n_k_heads) {
            return Err(format!("qwen35: {} value heads over {} key heads", cfg.n_v_heads, cfg.n_k_heads));
        }
        if !cfg.rope_dim.is_multiple_of(2) || cfg.rope_dim > head_dim {
            return Err(format!("{arch}.rope.dimension_count {} of a head of {head_dim}", cfg.rope_dim));
        }
        Ok(cfg)
    }

    /// Channels of the delta-net's fused QKV rows: `2 · H_k · d + H_v · d`.
    pub fn conv_dim(&self) -> usize {
        (2 * self.n_k_heads + self.n_v_heads) * self.d_state
    }

    /// Why the engine's kernels cannot run this shape, if they cannot.
    pub fn unsupported(&self) -> Option<String> {
        if !matches!(self.head_dim, 64 | 128 | 256) || self.n_head / self.n_kv > 8 {
            return Some(format!("attention heads {} / {} KV heads of {} dims", self.n_head, self.n_kv, self.head_dim));
        }
        if !matches!(self.d_state, 64 | 128 | 256) {
            return Some(format!("delta-net state size {} (64, 128 or 256)", self.d_state));
        }
        if self.rope_dim == 0 {
            return Some("no rotated dims (rope.dimension_count = 0)".into());
        }
        if !(2..=5).contains(&self.conv_kernel) {
            return Some(format!("a conv of {} taps (2..=5)", self.conv_kernel));
        }
        if !self.hidden.is_multiple_of(32) || !self.ff.is_multiple_of(32) || self.hidden > 8192 {
            return Some(format!("widths {} and {} (multiples of 32, the hidden width at most 8192)", self.hidden, self.ff));
        }
        if let Some(m) = &self.moe {
            if m.experts > crate::MOE_MAX_EXPERTS || m.used > crate::MOE_MAX_USED {
                return Some(format!("{} of {} experts a token (at most {} of {})", m.used, m.experts, crate::MOE_MAX_USED, crate::MOE_MAX_EXPERTS));
            }
            if !m.expert_ff.is_multiple_of(32) || !m.shared_ff.is_multiple_of(32) || m.expert_ff > 8192 || m.shared_ff > 8192 {
                return Some(format!("expert widths {} and {} (multiples of 32 up to 8192)", m.expert_ff, m.shared_ff));
            }
        }
        None
    }
}

/// One Gemma 4 layer's attention shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Layer {
    /// Sliding-window attention (else global).
    pub sliding: bool,
    pub n_head: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub ff: usize,
    /// The layer whose K/V this layer reads: itself, or for a KV-shared layer the last layer of
    /// its kind that owns K/V (`kv_layers - 2` sliding, `kv_layers - 1` global).
    pub kv_layer: usize,
}

/// The hyperparameters of a `gemma4` GGUF's step program (the rules of candle's
/// `quantized_gemma4::Config`, which the CPU path reads: per-layer head counts and head dims,
/// KV-shared layers, per-layer embeddings, logit softcapping, a 26B-A4B-style file's routed
/// experts beside each block's dense MLP).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Config {
    pub hidden: usize,
    pub layers: Vec<Gemma4Layer>,
    pub vocab: usize,
    pub eps: f32,
    pub window: usize,
    pub rope_base: f32,
    pub rope_base_swa: f32,
    /// Dims RoPE turns on global and on sliding layers (as the file states them: a layer turns at
    /// most its head's; `rope_freqs` holds `rope_dim / 2` factors).
    pub rope_dim: usize,
    pub rope_dim_swa: usize,
    pub softcap: Option<f32>,
    /// Layers that own K/V (the first `kv_layers`).
    pub kv_layers: usize,
    /// Values per layer of the per-layer embeddings (0: none).
    pub per_layer: usize,
    /// A 26B-A4B-style file's routed experts (`expert_count` > 0).
    pub moe: Option<Gemma4Moe>,
}

/// A `gemma4` GGUF's routed experts (`gemma4.expert_*`); a block has them where it has
/// `ffn_gate_inp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemma4Moe {
    pub experts: usize,
    pub used: usize,
    /// Rows of each expert's gate and up (`expert_feed_forward_length`).
    pub expert_ff: usize,
}

impl Gemma4Config {
    /// Reads the metadata of a `gemma4` GGUF whose token table has `vocab` rows.
    pub fn from_metadata(md: &HashMap<String, Value>, vocab: usize) -> Result<Gemma4Config, String> {
        let arch = md.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
        if arch != "gemma4" {
            return Err(format!("architecture `{arch}` is not gemma4"));
        }
        let get = |key: &str| md.get(&format!("gemma4.{key}"));
        let u = |key: &str| -> Result<usize, String> { get(key).and_then(|v| v.to_u32().ok()).map(|v| v as usize).ok_or_else(|| format!("metadata gemma4.{key} missing")) };
        let opt_u = |key: &str| -> Result<Option<usize>, String> { get(key).map(|v| v.to_u32().map(|v| v as usize).map_err(|e| format!("gemma4.{key}: {e}"))).transpose() };
        let f = |key: &str| -> Result<Option<f32>, String> { get(key).map(|v| v.to_f32().map_err(|e| format!("gemma4.{key}: {e}"))).transpose() };
        let n = u("block_count")?;
        if n == 0 {
            return Err("gemma4.block_count is 0".into());
        }
        let per_layer = |key: &str| -> Result<Vec<usize>, String> {
            match get(key) {
                Some(Value::Array(a)) if a.len() == n => {
                    a.iter().map(|x| x.to_u32().map(|x| x as usize).or_else(|_| x.to_i32().map(|x| x as usize)).map_err(|e| format!("gemma4.{key}: {e}"))).collect()
                }
                Some(Value::Array(a)) => Err(format!("gemma4.{key} has {} values for {n} layers", a.len())),
                Some(v) => Ok(vec![v.to_u32().map_err(|e| format!("gemma4.{key}: {e}"))? as usize; n]),
                None => Err(format!("metadata gemma4.{key} missing")),
            }
        };
        let sliding: Vec<bool> = match get("attention.sliding_window_pattern") {
            Some(Value::Array(a)) if a.len() == n => a.iter().map(|v| v.to_bool().map_err(|e| format!("gemma4.attention.sliding_window_pattern: {e}"))).collect::<Result<_, _>>()?,
            Some(Value::Array(a)) => return Err(format!("gemma4.attention.sliding_window_pattern has {} values for {n} layers", a.len())),
            Some(_) => return Err("gemma4.attention.sliding_window_pattern is not a bool per layer".into()),
            None => return Err("metadata gemma4.attention.sliding_window_pattern missing".into()),
        };
        let (n_head, n_kv, ff) = (per_layer("attention.head_count")?, per_layer("attention.head_count_kv")?, per_layer("feed_forward_length")?);
        let (hd, hd_swa) = (u("attention.key_length")?, u("attention.key_length_swa")?);
        if opt_u("attention.value_length")?.unwrap_or(hd) != hd || opt_u("attention.value_length_swa")?.unwrap_or(hd_swa) != hd_swa {
            return Err("gemma4: value_length differs from key_length".into());
        }
        let shared = opt_u("attention.shared_kv_layers")?.unwrap_or(0);
        if shared >= n {
            return Err(format!("gemma4: {shared} KV-shared layers of {n}"));
        }
        let kv_layers = n - shared;
        if shared > 0 && kv_layers < 2 {
            return Err(format!("gemma4: KV-shared layers need two layers with K/V before them, there are {kv_layers}"));
        }
        let mut layers = Vec::with_capacity(n);
        for l in 0..n {
            if n_head[l] == 0 || n_kv[l] == 0 || !n_head[l].is_multiple_of(n_kv[l]) {
                return Err(format!("gemma4: layer {l} has {} query heads over {} KV heads", n_head[l], n_kv[l]));
            }
            let kv_layer = if l < kv_layers { l } else { kv_layers - if sliding[l] { 2 } else { 1 } };
            layers.push(Gemma4Layer { sliding: sliding[l], n_head: n_head[l], n_kv: n_kv[l], head_dim: if sliding[l] { hd_swa } else { hd }, ff: ff[l], kv_layer });
        }
        for l in kv_layers..n {
            let (me, src) = (&layers[l], &layers[layers[l].kv_layer]);
            if src.sliding != me.sliding || src.head_dim != me.head_dim || !me.n_head.is_multiple_of(src.n_kv) {
                return Err(format!("gemma4: layer {l} shares layer {}'s K/V, which is of another kind or shape", me.kv_layer));
            }
        }
        let moe = match opt_u("expert_count")?.unwrap_or(0) {
            0 => None,
            experts => {
                let m = Gemma4Moe { experts, used: u("expert_used_count")?, expert_ff: u("expert_feed_forward_length")? };
                if m.used == 0 || m.used > m.experts {
                    return Err(format!("gemma4: {} experts used of {}", m.used, m.experts));
                }
                Some(m)
            }
        };
        let rope_base = f("rope.freq_base")?.unwrap_or(1_000_000.0);
        Ok(Gemma4Config {
            hidden: u("embedding_length")?,
            vocab,
            eps: f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
            window: u("attention.sliding_window")?,
            rope_base,
            rope_base_swa: f("rope.freq_base_swa")?.unwrap_or(rope_base),
            rope_dim: opt_u("rope.dimension_count")?.unwrap_or(hd),
            rope_dim_swa: opt_u("rope.dimension_count_swa")?.unwrap_or(hd_swa),
            softcap: f("final_logit_softcapping")?.filter(|&c| c > 0.0),
            kv_layers,
            per_layer: opt_u("embedding_length_per_layer_input")?.unwrap_or(0),
            moe,
            layers,
        })
    }

    /// The layer whose K/V layer `l` reads (itself where it owns K/V).
    pub fn kv_source(&self, l: usize) -> usize {
        self.layers[l].kv_layer
    }

    /// Why the engine's kernels cannot run this shape, if they cannot.
    pub fn unsupported(&self) -> Option<String> {
        if let Some(m) = &self.moe {
            if m.experts > crate::MOE_MAX_EXPERTS || m.used > crate::MOE_MAX_USED {
                return Some(format!("{} of {} experts a token (at most {} of {})", m.used, m.experts, crate::MOE_MAX_USED, crate::MOE_MAX_EXPERTS));
            }
            if !m.expert_ff.is_multiple_of(32) || m.expert_ff > 8192 {
                return Some(format!("an expert width of {} (a multiple of 32 up to 8192)", m.expert_ff));
            }
        }
        for (l, ly) in self.layers.iter().enumerate() {
            let src = &self.layers[ly.kv_layer];
            if !matches!(ly.head_dim, 64 | 128 | 256 | 512) || ly.n_head / src.n_kv > 8 {
                return Some(format!("layer {l}: attention heads {} / {} KV heads of {} dims", ly.n_head, src.n_kv, ly.head_dim));
            }
            if !ly.ff.is_multiple_of(32) {
                return Some(format!("layer {l}: a feed-forward width of {} (a multiple of 32)", ly.ff));
            }
        }
        if !self.hidden.is_multiple_of(32) || self.hidden > 8192 {
            return Some(format!("a hidden width of {} (a multiple of 32, at most 8192)", self.hidden));
        }
        if self.per_layer > 0 && (!self.per_layer.is_multiple_of(32) || self.per_layer > 1024) {
            return Some(format!("per-layer inputs of {} values (a multiple of 32 up to 1024)", self.per_layer));
        }
        if self.rope_dim % 2 == 1 || self.rope_dim_swa % 2 == 1 || self.rope_dim == 0 || self.rope_dim_swa == 0 {
            return Some(format!("rotated dims {} and {} (even, not 0)", self.rope_dim, self.rope_dim_swa));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(blocks: u32, nextn: Option<u32>) -> HashMap<String, Value> {
        let mut md: HashMap<String, Value> =
            [("embedding_length", 640), ("attention.head_count", 4), ("attention.head_count_kv", 1), ("attention.key_length", 256), ("feed_forward_length", 2048), ("attention.sliding_window", 512)]
                .into_iter()
                .map(|(k, v)| (format!("gemma3.{k}"), Value::U32(v)))
                .collect();
        md.insert("gemma3.block_count".into(), Value::U32(blocks));
        if let Some(n) = nextn {
            md.insert("gemma3.nextn_predict_layers".into(), Value::U32(n));
        }
        md
    }

    #[test]
    fn a_nextn_heads_block_is_not_a_trunk_layer() {
        let plain = Gemma3Config::from_metadata(&metadata(18, None), 100).expect("plain");
        assert_eq!((plain.layers, plain.nextn), (18, false));
        let zero = Gemma3Config::from_metadata(&metadata(18, Some(0)), 100).expect("zero NextN layers");
        assert_eq!((zero.layers, zero.nextn), (18, false));
        let grafted = Gemma3Config::from_metadata(&metadata(19, Some(1)), 100).expect("grafted");
        assert_eq!((grafted.layers, grafted.nextn), (18, true));
        // The head's block 18 is local by its index, as candle builds it.
        assert!(grafted.is_local(18) && !grafted.is_local(17));
    }

    fn qwen35_metadata() -> HashMap<String, Value> {
        let mut md: HashMap<String, Value> = [
            ("block_count", 5),
            ("nextn_predict_layers", 1),
            ("embedding_length", 256),
            ("feed_forward_length", 512),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
            ("attention.key_length", 64),
            ("rope.dimension_count", 16),
            ("ssm.conv_kernel", 4),
            ("ssm.state_size", 64),
            ("ssm.group_count", 2),
            ("ssm.time_step_rank", 4),
        ]
        .into_iter()
        .map(|(k, v)| (format!("qwen35.{k}"), Value::U32(v)))
        .collect();
        md.insert("general.architecture".into(), Value::String("qwen35".into()));
        md
    }

    fn gemma4_metadata(shared: u32) -> HashMap<String, Value> {
        let mut md: HashMap<String, Value> = [
            ("block_count", 6),
            ("embedding_length", 256),
            ("attention.key_length", 512),
            ("attention.key_length_swa", 256),
            ("attention.sliding_window", 512),
            ("rope.dimension_count", 128),
            ("attention.shared_kv_layers", shared),
            ("embedding_length_per_layer_input", 64),
        ]
        .into_iter()
        .map(|(k, v)| (format!("gemma4.{k}"), Value::U32(v)))
        .collect();
        let arr = |v: &[u32]| Value::Array(v.iter().map(|&x| Value::U32(x)).collect());
        md.insert("gemma4.attention.head_count".into(), Value::U32(8));
        md.insert("gemma4.attention.head_count_kv".into(), arr(&[2, 2, 1, 2, 2, 1]));
        md.insert("gemma4.feed_forward_length".into(), arr(&[512, 512, 512, 1024, 1024, 1024]));
        md.insert("gemma4.attention.sliding_window_pattern".into(), Value::Array([true, true, false, true, true, false].into_iter().map(Value::Bool).collect()));
        md.insert("gemma4.final_logit_softcapping".into(), Value::F32(30.0));
        md.insert("general.architecture".into(), Value::String("gemma4".into()));
        md
    }

    #[test]
    fn gemma4_kv_shared_layers_read_the_last_owner_of_their_kind() {
        let c = Gemma4Config::from_metadata(&gemma4_metadata(3), 1000).expect("gemma4");
        assert_eq!(c.kv_layers, 3);
        // Layers 3, 4 (sliding) read layer 1; layer 5 (global) reads layer 2.
        assert_eq!((0..6).map(|l| c.kv_source(l)).collect::<Vec<_>>(), vec![0, 1, 2, 1, 1, 2]);
        assert_eq!((c.layers[2].head_dim, c.layers[1].head_dim, c.layers[4].ff), (512, 256, 1024));
        assert_eq!((c.rope_dim, c.rope_dim_swa, c.softcap, c.per_layer), (128, 256, Some(30.0), 64));
        assert_eq!(c.unsupported(), None);
        let own = Gemma4Config::from_metadata(&gemma4_metadata(0), 1000).expect("no sharing");
        assert_eq!((own.kv_layers, own.kv_source(5)), (6, 5));
        // One layer with K/V before shared ones is refused, as candle refuses it.
        assert!(Gemma4Config::from_metadata(&gemma4_metadata(5), 1000).is_err());
        let mut moe = gemma4_metadata(0);
        moe.insert("gemma4.expert_count".into(), Value::U32(8));
        assert!(Gemma4Config::from_metadata(&moe, 1000).expect_err("no expert_used_count").contains("gemma4.expert_used_count"));
        moe.insert("gemma4.expert_used_count".into(), Value::U32(2));
        moe.insert("gemma4.expert_feed_forward_length".into(), Value::U32(704));
        let c = Gemma4Config::from_metadata(&moe, 1000).expect("reads");
        assert_eq!((c.moe, c.unsupported()), (Some(Gemma4Moe { experts: 8, used: 2, expert_ff: 704 }), None));
        moe.insert("gemma4.expert_used_count".into(), Value::U32(9));
        assert!(Gemma4Config::from_metadata(&moe, 1000).expect_err("9 of 8").contains("9 experts used of 8"));
        moe.insert("gemma4.expert_count".into(), Value::U32(1024));
        assert!(Gemma4Config::from_metadata(&moe, 1000).expect("reads").unsupported().expect("refused").contains("9 of 1024 experts"));
        moe.insert("gemma4.expert_count".into(), Value::U32(16));
        moe.insert("gemma4.expert_feed_forward_length".into(), Value::U32(700));
        assert!(Gemma4Config::from_metadata(&moe, 1000).expect("reads").unsupported().expect("refused").contains("expert width of 700"));
        let mut bad = gemma4_metadata(0);
        bad.insert("gemma4.feed_forward_length".into(), Value::Array(vec![Value::U32(512); 5]));
        assert!(Gemma4Config::from_metadata(&bad, 1000).expect_err("5 values for 6 layers").contains("5 values"));
    }

    #[test]
    fn qwen35_layers_are_full_attention_every_fourth_unless_listed() {
        let c = Qwen35Config::from_metadata(&qwen35_metadata(), 1000).expect("qwen35");
        assert_eq!((c.layers, c.nextn_layers, c.conv_dim()), (4, 1, 2 * 2 * 64 + 4 * 64));
        assert_eq!(c.full_attention, vec![false, false, false, true]);
        assert_eq!(c.unsupported(), None);
        let mut md = qwen35_metadata();
        md.insert("qwen35.attention.recurrent_layers".into(), Value::Array([true, false, true, true, true].into_iter().map(Value::Bool).collect()));
        assert_eq!(Qwen35Config::from_metadata(&md, 1000).expect("listed").full_attention, vec![false, true, false, false]);
    }

    /// `qwen35`'s keys under `qwen35moe.` with the experts' keys.
    fn qwen35moe_metadata(experts: u32, used: u32) -> HashMap<String, Value> {
        let mut md: HashMap<String, Value> = qwen35_metadata().into_iter().map(|(k, v)| (k.replacen("qwen35.", "qwen35moe.", 1), v)).collect();
        md.insert("general.architecture".into(), Value::String("qwen35moe".into()));
        md.remove("qwen35moe.feed_forward_length");
        for (k, v) in [("expert_count", experts), ("expert_used_count", used), ("expert_feed_forward_length", 128), ("expert_shared_feed_forward_length", 256)] {
            md.insert(format!("qwen35moe.{k}"), Value::U32(v));
        }
        md
    }

    #[test]
    fn qwen35moe_reads_its_experts_and_refuses_what_the_router_cannot_take() {
        let c = Qwen35Config::from_metadata(&qwen35moe_metadata(64, 8), 1000).expect("qwen35moe");
        assert_eq!(c.moe, Some(Qwen35Moe { experts: 64, used: 8, expert_ff: 128, shared_ff: 256 }));
        assert_eq!((c.ff, c.unsupported()), (0, None));
        let e = Qwen35Config::from_metadata(&qwen35moe_metadata(8, 9), 1000).expect_err("9 of 8");
        assert!(e.contains("9 experts used of 8"), "{e}");
        let c = Qwen35Config::from_metadata(&qwen35moe_metadata(1024, 8), 1000).expect("parses");
        assert!(c.unsupported().expect("refused").contains("8 of 1024 experts"));
        let mut md = qwen35moe_metadata(64, 8);
        md.remove("qwen35moe.expert_shared_feed_forward_length");
        let e = Qwen35Config::from_metadata(&md, 1000).expect_err("missing key");
        assert!(e.contains("qwen35moe.expert_shared_feed_forward_length"), "{e}");
    }

    #[test]
    fn qwen35_unfit_shapes_are_refused_by_name() {
        let mut md = qwen35_metadata();
        md.insert("qwen35.ssm.time_step_rank".into(), Value::U32(3));
        let e = Qwen35Config::from_metadata(&md, 1000).expect_err("heads");
        assert!(e.contains("value heads"), "{e}");
        let mut md = qwen35_metadata();
        md.insert("qwen35.ssm.state_size".into(), Value::U32(96));
        let c = Qwen35Config::from_metadata(&md, 1000).expect("parses");
        assert!(c.unsupported().expect("refused").contains("state size 96"));
    }

    #[test]
    fn more_than_one_nextn_layer_or_no_trunk_is_refused() {
        let e = Gemma3Config::from_metadata(&metadata(19, Some(2)), 100).expect_err("two NextN layers");
        assert!(e.contains("nextn_predict_layers = 2"), "{e}");
        let e = Gemma3Config::from_metadata(&metadata(1, Some(1)), 100).expect_err("no trunk");
        assert!(e.contains("no trunk block"), "{e}");
        let mut md = metadata(18, None);
        md.remove("gemma3.feed_forward_length");
        let e = Gemma3Config::from_metadata(&md, 100).expect_err("missing key");
        assert!(e.contains("gemma3.feed_forward_length"), "{e}");
    }
}
