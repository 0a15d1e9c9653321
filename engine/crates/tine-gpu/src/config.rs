//! A Gemma 3 GGUF's shape as the GPU engine reads it: the hyperparameters of its step program,
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
