//! The tokenizer seam: a `gpt2` (byte-level BPE) GGUF vocabulary with the `qwen35`
//! pre-tokenizer and a `gemma4` (SentencePiece-style BPE) one, built from metadata alone,
//! answering as llama.cpp does.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};
use tine_runtime::{TokenType, Tokenizer};

/// GPT-2's byte alphabet: the char byte `b` is written as in a byte-level vocabulary.
fn byte_char(b: u8) -> char {
    let mut n = 0u32;
    for x in 0..=255u8 {
        let printable = matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if !printable {
            n += 1;
        }
        if x == b {
            return if printable { char::from(x) } else { char::from_u32(255 + n).expect("a char") };
        }
    }
    unreachable!("every byte is in 0..=255")
}

/// 256 byte tokens, a few merged words, three control tokens (`<|im_end|>` the EOS).
fn vocab(extra: Vec<(&str, Value)>) -> (Content, HashMap<String, u32>) {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![1i32; tokens.len()];
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] {
        tokens.push(special.to_string());
        types.push(3);
    }
    // User-defined tokens (as converters mark `<think>`): split out of any text, parsed or not;
    // `xa` and `abc` overlap in `xabc`, where llama.cpp takes the longer first.
    for user in ["<think>", "xa", "abc"] {
        tokens.push(user.to_string());
        types.push(4);
    }
    let ids: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let s = |v: &str| Value::String(v.to_string());
    let mut metadata = HashMap::from([
        ("tokenizer.ggml.model".to_string(), s("gpt2")),
        ("tokenizer.ggml.pre".to_string(), s("qwen35")),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(tokens.iter().map(|t| s(t)).collect())),
        ("tokenizer.ggml.merges".to_string(), Value::Array(merges.iter().map(|m| s(m)).collect())),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(ids["<|im_end|>"])),
    ]);
    for (k, v) in extra {
        metadata.insert(k.to_string(), v);
    }
    (Content { magic: VersionedMagic::GgufV3, metadata, tensor_infos: HashMap::new(), tensor_data_offset: 0 }, ids)
}

#[test]
fn a_gpt2_vocabulary_encodes_with_its_merges_and_decodes_back() {
    let (ct, ids) = vocab(vec![]);
    let tok = Tokenizer::from_gguf(&ct).expect("a gpt2 vocabulary builds");
    assert!(matches!(tok, Tokenizer::Bpe(_)));
    assert_eq!(tok.vocab_size(), ids.len());
    let got = tok.encode("hello world", true, false);
    assert_eq!(got, [ids["hello"], ids["Ġworld"]], "merged words; no BOS unless the metadata asks");
    assert_eq!(tok.token_bytes(ids["Ġworld"], false), b" world");
    assert_eq!(tok.decode(&got, false), "hello world");
    // Bytes outside the merges go as byte tokens and come back as the same UTF-8.
    let text = "héllo\n\tworld — 東京 🦀";
    assert_eq!(tok.decode(&tok.encode(text, false, false), false), text);
    assert_eq!(tok.encode("é", false, false), [ids[&byte_char(0xC3).to_string()], ids[&byte_char(0xA9).to_string()]]);
}

#[test]
fn special_tokens_in_text_become_ids_only_when_parsed() {
    let (ct, ids) = vocab(vec![]);
    let tok = Tokenizer::from_gguf(&ct).expect("builds");
    let (start, end) = (ids["<|im_start|>"], ids["<|im_end|>"]);
    let text = "<|im_start|>hello<|im_end|> world";
    assert_eq!(tok.encode(text, false, true), [start, ids["hello"], end, ids["Ġworld"]]);
    let plain = tok.encode(text, false, false);
    assert!(!plain.contains(&start) && !plain.contains(&end), "unparsed, a special token's text is text: {plain:?}");
    assert_eq!(tok.decode(&plain, false), text, "and it reads back as the same text");
    // Control tokens stand for nothing unless asked for; they end generation.
    assert_eq!(tok.decode(&[start, ids["hello"], end], false), "hello");
    assert_eq!(tok.decode(&[start, ids["hello"], end], true), "<|im_start|>hello<|im_end|>");
    assert!(tok.is_control(end) && !tok.is_control(ids["hello"]));
    assert_eq!(tok.eos_token(), Some(end));
    assert_eq!(tok.token_type(start), Some(TokenType::Control));
    assert_eq!(tok.token_id("<|endoftext|>"), Some(ids["<|endoftext|>"]));
}

#[test]
fn user_defined_tokens_are_split_out_always_and_longest_first() {
    let (ct, ids) = vocab(vec![]);
    let tok = Tokenizer::from_gguf(&ct).expect("builds");
    for parse in [false, true] {
        assert_eq!(tok.encode("<think>hello", false, parse), [ids["<think>"], ids["hello"]], "parse_special {parse}");
    }
    // llama.cpp splits on each special token in turn, longest first: `abc` before `xa`.
    let got = tok.encode("xabc", false, true);
    assert_eq!(got.last(), Some(&ids["abc"]), "{got:?}");
    assert!(!got.contains(&ids["xa"]), "{got:?}");
}

#[test]
fn a_pre_tokenizer_not_checked_against_llama_cpp_is_refused() {
    let (ct, _) = vocab(vec![("tokenizer.ggml.pre", Value::String("gpt-2".into()))]);
    let err = Tokenizer::from_gguf(&ct).expect_err("gpt-2's pipeline is not llama.cpp's here");
    assert!(err.to_string().contains("qwen35"), "{err}");
}

#[test]
fn bos_and_eos_are_added_as_the_metadata_asks() {
    let (ct, ids) = vocab(vec![("tokenizer.ggml.bos_token_id", Value::U32(300)), ("tokenizer.ggml.add_bos_token", Value::Bool(true)), ("tokenizer.ggml.add_eos_token", Value::Bool(true))]);
    let tok = Tokenizer::from_gguf(&ct).expect("builds");
    let bos = 300;
    assert_eq!(tok.encode("hello", true, false), [bos, ids["hello"], ids["<|im_end|>"]]);
    assert_eq!(tok.encode("hello", false, false), [ids["hello"]]);
}

#[test]
fn a_vocabulary_whose_types_do_not_match_its_tokens_is_refused() {
    let (ct, _) = vocab(vec![("tokenizer.ggml.token_type", Value::Array(vec![Value::I32(1); 3]))]);
    let err = Tokenizer::from_gguf(&ct).expect_err("3 types for 271 tokens");
    assert!(err.to_string().contains("token_type"), "{err}");
}

/// llama.cpp's own test of a vocabulary (`models/<file>` with its `.inp` texts and `.out` ids,
/// from `TINE_LLAMA_CPP_MODELS`, llama.cpp's `models/`, also in the llama-cpp-python sdist),
/// through the runtime's tokenizer: every text's ids equal llama.cpp's (tokenized with
/// add_special and parse_special false, as its test does), and decode back to the text.
fn ids_equal_llama_cpp_on_its_vocabulary_test(file: &str) {
    let dir = std::path::PathBuf::from(std::env::var("TINE_LLAMA_CPP_MODELS").expect("TINE_LLAMA_CPP_MODELS names llama.cpp's models/ directory"));
    let mut f = std::fs::File::open(dir.join(file)).expect("the vocabulary GGUF");
    let ct = Content::read(&mut f).expect("a GGUF");
    let tok = Tokenizer::from_gguf(&ct).expect("a tokenizer");
    let inp = std::fs::read_to_string(dir.join(format!("{file}.inp"))).expect(".inp");
    let out = std::fs::read_to_string(dir.join(format!("{file}.out"))).expect(".out");
    // Some .inp files end with a separator, some do not.
    let texts: Vec<&str> = inp.strip_suffix("\n__ggml_vocab_test__\n").unwrap_or(&inp).split("\n__ggml_vocab_test__\n").collect();
    let want: Vec<Vec<u32>> = out.lines().map(|l| l.split_whitespace().map(|t| t.parse().expect("an id")).collect()).collect();
    assert_eq!(texts.len(), want.len(), "as many texts as id lines");
    let mut bad = Vec::new();
    for (text, ids) in texts.iter().zip(&want) {
        let got = tok.encode(text, false, false);
        if &got != ids {
            bad.push(format!("{text:?}: llama.cpp {ids:?}, here {got:?}"));
        }
        assert_eq!(tok.decode(&got, true), *text, "decodes back");
    }
    eprintln!("{file}: {} of {} texts equal to llama.cpp's ids", want.len() - bad.len(), want.len());
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The qwen35 vocabulary (`ggml-vocab-qwen35.gguf`).
#[test]
#[ignore = "needs llama.cpp's models/ directory in TINE_LLAMA_CPP_MODELS"]
fn qwen35_ids_through_the_runtime_equal_llama_cpp() {
    ids_equal_llama_cpp_on_its_vocabulary_test("ggml-vocab-qwen35.gguf");
}

/// The real Gemma 4 vocabulary (`ggml-vocab-gemma-4.gguf`, 262k tokens).
#[test]
#[ignore = "needs llama.cpp's models/ directory in TINE_LLAMA_CPP_MODELS"]
fn gemma4_ids_through_the_runtime_equal_llama_cpp() {
    ids_equal_llama_cpp_on_its_vocabulary_test("ggml-vocab-gemma-4.gguf");
}
