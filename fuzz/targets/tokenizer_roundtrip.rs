//! The SentencePiece tokenizer (`candle_core::quantized::spm_tokenizer`, patch 0003) on any text,
//! built once from a synthetic vocabulary in the real GGUF layout (Gemma 3's, as the engine's test
//! fixture writes it: control tokens, `<0xXX>` byte-fallback tokens, scored pieces), written with
//! `gguf_file::write` and read back with `Content::read` and `SpmTokenizer::from_gguf`.
//!
//! `encode` never panics, on any bytes (as lossy UTF-8), with or without special tokens. The
//! round trip that holds, for valid UTF-8 `x` (see fuzz/README.md):
//!
//! - `add_space_prefix = false` (Gemma 3): `decode(encode(x, false, false), false) == x'`, where
//!   `x'` is `x` with every `▁` (U+2581) replaced by a space: SentencePiece writes spaces as `▁`
//!   and decodes `▁` as a space, so a literal `▁` cannot survive;
//! - `add_space_prefix = true` (Llama 2), `x` non-empty and free of user-defined tokens:
//!   the same, with one leading space: `" " + x'`.
//!
//! It holds because every byte has a byte-fallback token and no merge of the vocabulary's pieces
//! spells a control, unknown or byte token's text (none of them holds `<`): a vocabulary where one
//! does (`<0x41>` merged into the byte token decodes as `A`) breaks it, as in llama.cpp.
#![no_main]

use std::io::Cursor;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::spm_tokenizer::SpmTokenizer;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use libfuzzer_sys::fuzz_target;

/// As `tine_test_support::gemma3_fixture::CONTROL` (types: `<unk>` unknown, the others control).
const CONTROL: [&str; 6] = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"];
/// As the fixture's `PIECES`, plus a few multi-byte ones.
const PIECES: &[&str] = &[
    "▁",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "t",
    "a",
    "n",
    "s",
    "i",
    "\n",
    "he",
    "ll",
    "hell",
    "hello",
    "▁w",
    "or",
    "▁wor",
    "▁world",
    "▁the",
    "th",
    "▁t",
    "an",
    "▁an",
    "in",
    "▁in",
    "é",
    "▁▁",
    "user",
    "model",
    "ld",
    "日本",
    "日",
    "本",
    "▁日本",
    "😀",
    "ß",
];
/// A user-defined token: split out of the text even without `parse_special`, decoded as itself.
const USER_DEFINED: &str = "[@@]";

fn gguf(add_space_prefix: bool) -> Vec<u8> {
    let mut tokens: Vec<String> = CONTROL.iter().map(|s| s.to_string()).collect();
    tokens.extend((0..256).map(|b| format!("<0x{b:02X}>")));
    tokens.extend(PIECES.iter().map(|s| s.to_string()));
    tokens.push(USER_DEFINED.to_string());
    let mut types = vec![1i32; tokens.len()];
    let mut scores = vec![0f32; tokens.len()];
    for (i, t) in types.iter_mut().enumerate().take(CONTROL.len()) {
        *t = if i == 3 { 2 } else { 3 };
    }
    for t in types.iter_mut().skip(CONTROL.len()).take(256) {
        *t = 6;
    }
    for (i, piece) in PIECES.iter().enumerate() {
        scores[CONTROL.len() + 256 + i] = piece.chars().count() as f32 * 10.0 - i as f32 * 0.01;
    }
    *types.last_mut().expect("non-empty") = 4;
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("gemma3".into())),
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.scores", Value::Array(scores.into_iter().map(Value::F32).collect())),
        ("tokenizer.ggml.token_type", Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.bos_token_id", Value::U32(2)),
        ("tokenizer.ggml.eos_token_id", Value::U32(1)),
        ("tokenizer.ggml.unknown_token_id", Value::U32(3)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        ("tokenizer.ggml.add_eos_token", Value::Bool(false)),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(add_space_prefix)),
    ];
    let refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &refs, &[]).expect("write the vocabulary GGUF");
    out.into_inner()
}

fn tokenizer(add_space_prefix: bool) -> SpmTokenizer {
    let bytes = gguf(add_space_prefix);
    let content = Content::read(&mut Cursor::new(&bytes)).expect("read the vocabulary GGUF back");
    SpmTokenizer::from_gguf(&content).expect("an SPM tokenizer from the GGUF")
}

fn tokenizers() -> &'static [SpmTokenizer; 2] {
    static T: OnceLock<[SpmTokenizer; 2]> = OnceLock::new();
    T.get_or_init(|| [tokenizer(false), tokenizer(true)])
}

fuzz_target!(|data: &[u8]| {
    let [plain, prefixed] = tokenizers();
    let lossy = String::from_utf8_lossy(data);
    for tok in [plain, prefixed] {
        for (add, parse) in [(true, true), (false, true), (true, false)] {
            let ids = tok.encode(&lossy, add, parse);
            let _ = tok.decode(&ids, true);
            let _ = tok.decode(&ids, false);
        }
    }
    // Arbitrary ids decode without a panic, in range or not.
    let ids: Vec<u32> = data.chunks(2).map(|c| u32::from(c[0]) | u32::from(*c.get(1).unwrap_or(&0)) << 8).collect();
    let _ = plain.decode(&ids, true);
    let Ok(x) = std::str::from_utf8(data) else { return };
    let expected = x.replace('\u{2581}', " ");
    let got = plain.decode(&plain.encode(x, false, false), false);
    assert_eq!(got, expected, "decode(encode(x)) != x (add_space_prefix = false)");
    if !x.is_empty() && !x.contains(USER_DEFINED) {
        let got = prefixed.decode(&prefixed.encode(x, false, false), false);
        assert_eq!(got, format!(" {expected}"), "decode(encode(x)) != \" \" + x (add_space_prefix = true)");
    }
});
