//! Tine's generation loop on top of `tine-runtime`: one [`Generation`] per request.
//!
//! It reuses the longest prefix a sequence already holds, samples with `tine-sampling`,
//! stops on end-of-generation tokens, `n_predict`, the context size or a stop string, and
//! hands out text only once it is valid UTF-8 and cannot be the start of a stop string.
//! It knows nothing about HTTP; the server and the CLI both drive it.

pub mod chat;
mod generate;
pub mod grammar;
mod stop;
pub mod template;

pub use generate::{GenerateError, GenerateRequest, Generation, StepEvent, StopType, Timings, TokenProb};
pub use stop::StopMatcher;

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
