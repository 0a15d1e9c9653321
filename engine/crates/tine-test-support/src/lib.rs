//! Test fixtures for Tine's crates.
//!
//! One source with the patches' own tests: the `quantized_gemma3` fixture that patch 0002 adds
//! under `candle-transformers/tests/gemma3_fixture/` (tiny synthetic GGUFs in the real tensor
//! layouts, a NextN block, an assistant head, and a float64 reference forward).

// The fixture is written as a candle test module, where candle-core is called `candle`.
extern crate candle_core as candle;

#[path = "../../../upstream/candle-transformers/tests/gemma3_fixture/mod.rs"]
mod fixture;

pub use fixture::*;
