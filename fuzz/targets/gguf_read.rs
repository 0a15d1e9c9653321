//! candle's GGUF reader (`gguf_file::Content::read`) on any bytes, then what the engine does with
//! a loaded file: every tensor's data (`Content::tensor`), dequantized when small, and the
//! tokenizer built from the metadata (`SpmTokenizer::from_gguf`, the engine's).
//!
//! Not driven: candle's `TokenizerFromGguf` for Hugging Face's `tokenizers::Tokenizer` (BPE
//! GGUFs). The fuzzer found a panic inside `tokenizers` 0.23.2 itself (`models/bpe/model.rs:267`,
//! a slice index out of range in `BpeBuilder::build` on crafted merges; input
//! `fuzz/corpus/gguf_read/bpe-merges-panic-in-tokenizers.gguf`). Tine never builds that tokenizer
//! (Gemma's vocabulary is SentencePiece), and the fix belongs to `tokenizers`, not to this chain.
//!
//! A truncated or hostile file must give an error: never a panic, an abort, or an allocation
//! beyond what the input's size can justify (libFuzzer's `-malloc_limit_mb` catches that).
#![no_main]

use std::io::Cursor;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::spm_tokenizer::SpmTokenizer;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use candle_core::Device;
use libfuzzer_sys::fuzz_target;

/// Tensors up to this many elements are dequantized too (bounded work per input).
const DEQUANTIZE_MAX_ELEMS: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let mut reader = Cursor::new(data);
    let Ok(content) = Content::read(&mut reader) else { return };
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        if let Ok(t) = content.tensor(&mut reader, name, &Device::Cpu) {
            if t.shape().elem_count() <= DEQUANTIZE_MAX_ELEMS {
                let _ = t.dequantize(&Device::Cpu);
            }
        }
    }
    if let Ok(tok) = SpmTokenizer::from_gguf(&content) {
        for text in ["Hello world", " <start_of_turn>user\nhi<end_of_turn>", "\u{e9}\u{2581}\0"] {
            let ids = tok.encode(text, true, true);
            let _ = tok.decode(&ids, true);
        }
        let _ = tok.decode(&[0, 1, 2, u32::MAX], true);
    }
});
