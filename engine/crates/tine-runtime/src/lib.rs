//! Tine's model runtime, built on the patched candle in `engine/upstream/`.
//!
//! [`Model`] loads a Gemma 3 GGUF (weights and tokenizer); a [`Sequence`] is one conversation's
//! state (its tokens and KV cache) with the step API the generation loop and the speculative
//! driver use: [`Sequence::prefill`], [`Sequence::decode`], [`Sequence::forward_all`],
//! [`Sequence::rollback`]. The runtime knows nothing about sampling, chat templates or HTTP.

pub mod kv;
mod model;

pub use model::{Logits, LoadError, Model, ModelInfo, Sequence, StepError};
pub use candle_core::quantized::spm_tokenizer::{SpmTokenizer, TokenType};
