//! Test fixtures for Tine's crates.
//!
//! The `quantized_gemma3` fixture (tiny synthetic GGUFs in the real tensor layouts, a NextN block,
//! an assistant head, and a float64 reference forward) lives here, in `src/gemma3_fixture/`, and is
//! one source for the engine's tests and the patches' own: their test files under
//! `candle-transformers/tests/` include it by `#[path]`. It lives in Tine's crate rather than in a
//! patch so that retiring a patch (a base bump) cannot take it. The `quantized_qwen35` fixture
//! ([`qwen35_fixture`]) and the `quantized_gemma4` one ([`gemma4_fixture`]) are built the same way.

// The fixture is written as a candle test module, where candle-core is called `candle`.
extern crate candle_core as candle;

mod gemma3_fixture;
/// The `quantized_gemma4` fixture: tiny synthetic Gemma 4 GGUFs and a float64 reference.
pub mod gemma4_fixture;
/// Which modules of a crate read which, and whether they form a circle.
pub mod module_graph;
/// The `quantized_qwen35` fixture: tiny synthetic Qwen3.5 GGUFs and a float64 reference.
pub mod qwen35_fixture;

pub use gemma3_fixture::*;
