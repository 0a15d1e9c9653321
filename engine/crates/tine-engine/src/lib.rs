//! Tine's generation loop on top of `tine-runtime`: one [`Generation`] per request.
//!
//! It reuses the longest prefix a sequence already holds, samples with `tine-sampling`,
//! stops on end-of-generation tokens, `n_predict`, the context size or a stop string, and
//! hands out text only once it is valid UTF-8 and cannot be the start of a stop string.
//! It knows nothing about HTTP; the server and the CLI both drive it.

pub mod chat;
pub mod embeddings;
mod generate;
pub mod grammar;
pub mod reasoning;
mod stop;
pub mod template;
pub mod tool_calls;

pub use generate::{GenerateError, GenerateRequest, Generation, StepEvent, StopType, Timings, TokenProb, ValidRequest};
pub use stop::StopMatcher;

/// `e` and its sources on one line (it lives in tine-runtime, which also needs it).
pub use tine_runtime::error_chain;
