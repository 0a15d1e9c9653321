//! The HTTP API's request checks (`tine-api`'s `check_completion`, `check_chat` (also behind the
//! Anthropic and Responses rewrites), `decode` and
//! `check_ids`: the functions `tine serve`'s edge runs on every body before it touches the
//! model) on any bytes, for every endpoint: an error or a checked request, never a panic. A body that decodes must decode the same way again (no hidden state), and a refusal
//! must carry a message (the server's 400 names what was wrong).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tine_api::{decode_any, Endpoint};

/// Gemma 3's vocabulary size: token ids are checked against it.
const VOCAB: usize = 262_144;

fuzz_target!(|data: &[u8]| {
    for ep in Endpoint::ALL {
        let first = decode_any(ep, data, VOCAB);
        assert_eq!(first, decode_any(ep, data, VOCAB), "{ep:?}: decoding is not deterministic");
        if let Err(e) = first {
            assert!(!e.message.is_empty(), "{ep:?}: a refusal without a message");
        }
    }
});
