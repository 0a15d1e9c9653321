//! Tine's model runtime, built on the patched candle in `engine/upstream/`.
//!
//! [`Model`] loads a Gemma 3 GGUF (weights and tokenizer); a [`Sequence`] is one conversation's
//! state (its tokens and KV cache) with the step API the generation loop and the speculative
//! driver use: [`Sequence::prefill`], [`Sequence::decode`], [`Sequence::forward_all`],
//! [`Sequence::rollback`]. The runtime knows nothing about sampling, chat templates or HTTP.

mod device;
mod gpu;
mod graft;
mod model;
mod tokenizer;

pub use gpu::{BATCH_ROWS, STEP_ROWS};

pub use device::{describe as describe_device, DeviceError, DeviceSpec, CUDA_COMPILED};

pub use graft::{graft_nextn, GraftError, Grafted};
pub use model::prompt_pieces;
pub use model::slot_file::{fingerprint, SlotFileError, SlotImage, TypedLayer};
pub use model::{
    banned_argmax, Assistant, CacheTypeError, DecodeOut, DecodeWant, Hidden, KvType, LoadError, Logits, Model, ModelInfo, NextNPrefix, NextNState, PromptPiece, Rows, RowsRead, Sequence, SharedPrefix,
    StepError, StepRows, MAX_GPU_CONTEXT, PREFILL_CHUNK,
};

/// `e` and its sources, joined the way anyhow's `{:#}` does: what a client or a log needs to
/// see the cause, not only that something failed.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// The default model's file name in Tine's model cache (`cargo xtask fetch-model` puts it there).
pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// Tine's cache directory: `$TINE_CACHE_DIR`, else `$XDG_CACHE_HOME/tine`, else `~/.cache/tine`
/// (the same rule as xtask's, which cannot depend on this crate).
pub fn cache_root() -> std::path::PathBuf {
    use std::path::PathBuf;
    if let Some(d) = std::env::var_os("TINE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("tine");
    }
    PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| ".".into())).join(".cache").join("tine")
}

/// Where the default model is cached.
pub fn default_model_path() -> std::path::PathBuf {
    cache_root().join("models").join(DEFAULT_MODEL_FILE)
}
pub use candle_core::quantized::spm_tokenizer::TokenType;
/// candle's device type, so callers need not depend on candle to hold one.
pub use candle_core::Device;
pub use tokenizer::{BpeTokenizer, FimTokens, Tokenizer};
