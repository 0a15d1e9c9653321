//! The model's tokenizer, whichever kind its GGUF declares (`tokenizer.ggml.model`):
//!
//! - `llama`: SentencePiece-style (Gemma 3), candle's [`SpmTokenizer`] (patch 0003);
//! - `gpt2`: byte-level BPE (Qwen3.5/3.6), the `tokenizers` crate built from the GGUF's
//!   vocabulary, merges and pre-tokenizer by candle's `TokenizerFromGguf` (the `qwen35`
//!   pre-tokenizer is patch 0023). Only pre-tokenizers whose ids were checked against
//!   llama.cpp's are taken (`qwen35`); others are refused with an error, not tokenized
//!   differently.
//! - `gemma4`: BPE in SentencePiece's style (Gemma 4), as llama.cpp reads it: spaces written
//!   `▁`, the text split only into runs of newlines and runs of the rest (a run of newlines that
//!   is a token is taken whole), the merges of the `tokenizers` crate's BPE over raw UTF-8,
//!   `<0xXX>` byte tokens for what no token covers, and BOS always added with the special tokens
//!   (llama.cpp overrides `add_bos_token` for this vocabulary).
//!
//! Both answer the same calls with llama.cpp's semantics: `encode(text, add_special,
//! parse_special)` adds BOS/EOS as the metadata asks and, with `parse_special`, turns special
//! tokens written in the text (`<|im_start|>`) into their ids, longest first; otherwise their text
//! is tokenized as plain text. `token_bytes(id, special)` gives the bytes a token stands for
//! (control and unknown tokens only when `special`).

use std::collections::HashMap;

use candle_core::quantized::gguf_file;
use candle_core::quantized::spm_tokenizer::{SpmTokenizer, TokenType};
use candle_core::quantized::tokenizer::TokenizerFromGguf;

/// A GGUF's tokenizer.
#[derive(Debug, Clone)]
pub enum Tokenizer {
    /// SentencePiece-style (`tokenizer.ggml.model = llama`).
    Spm(SpmTokenizer),
    /// BPE (`tokenizer.ggml.model = gpt2`, byte-level; `gemma4`, SentencePiece-style).
    Bpe(Box<BpeTokenizer>),
}

/// How a BPE vocabulary writes text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BpeStyle {
    /// GPT-2's byte-level alphabet (`gpt2`).
    ByteLevel,
    /// Raw UTF-8 with spaces as `▁` and `<0xXX>` byte tokens (`gemma4`).
    Spm,
}

/// BPE as llama.cpp reads a `gpt2` or `gemma4` GGUF vocabulary.
#[derive(Debug, Clone)]
pub struct BpeTokenizer {
    style: BpeStyle,
    /// Built from the vocabulary, merges and pre-tokenizer alone: no special tokens and no
    /// post-processor, so that this type decides what is special and where BOS goes.
    inner: tokenizers::Tokenizer,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    token_to_id: HashMap<String, u32>,
    /// Control, unknown and user-defined tokens, longest text first (ties: lower id): what a
    /// text is split on before BPE (user-defined always, the others with `parse_special`).
    specials: Vec<u32>,
    /// GPT-2's byte-level alphabet, char -> byte.
    byte_of: HashMap<char, u8>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
}

impl Tokenizer {
    /// The tokenizer a GGUF's metadata describes.
    pub fn from_gguf(ct: &gguf_file::Content) -> candle_core::Result<Tokenizer> {
        let kind = ct.metadata.get("tokenizer.ggml.model").and_then(|v| v.to_string().ok()).map(|s| s.to_lowercase()).unwrap_or_default();
        match kind.as_str() {
            "gpt2" => Ok(Tokenizer::Bpe(Box::new(BpeTokenizer::from_gguf(ct)?))),
            "gemma4" => Ok(Tokenizer::Bpe(Box::new(BpeTokenizer::spm_from_gguf(ct)?))),
            _ => Ok(Tokenizer::Spm(SpmTokenizer::from_gguf(ct)?)),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Spm(t) => t.vocab_size(),
            Tokenizer::Bpe(t) => t.tokens.len(),
        }
    }
    pub fn bos_token(&self) -> Option<u32> {
        match self {
            Tokenizer::Spm(t) => t.bos_token(),
            Tokenizer::Bpe(t) => t.bos,
        }
    }
    pub fn eos_token(&self) -> Option<u32> {
        match self {
            Tokenizer::Spm(t) => t.eos_token(),
            Tokenizer::Bpe(t) => t.eos,
        }
    }
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        match self {
            Tokenizer::Spm(t) => t.token_type(id),
            Tokenizer::Bpe(t) => t.types.get(id as usize).copied(),
        }
    }
    /// The token's text as the vocabulary writes it (a BPE token in GPT-2's byte alphabet).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        match self {
            Tokenizer::Spm(t) => t.token_text(id),
            Tokenizer::Bpe(t) => t.tokens.get(id as usize).map(|s| s.as_str()),
        }
    }
    /// The id of a token written as the vocabulary writes it.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match self {
            Tokenizer::Spm(t) => t.token_id(text),
            Tokenizer::Bpe(t) => t.token_to_id.get(text).copied(),
        }
    }
    /// Whether generation should stop at this token (end-of-generation control tokens).
    pub fn is_control(&self, id: u32) -> bool {
        matches!(self.token_type(id), Some(TokenType::Control))
    }

    /// Whether `encode` with `add_special` puts BOS first (llama.cpp's `add_bos`).
    pub fn adds_bos(&self) -> bool {
        self.bos_token().is_some() && self.encode("", true, false).first() == self.bos_token().as_ref()
    }

    /// Token ids of `text`. `add_special` adds BOS/EOS as the metadata asks; `parse_special`
    /// lets special tokens written in the text become their ids.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        match self {
            Tokenizer::Spm(t) => t.encode(text, add_special, parse_special),
            Tokenizer::Bpe(t) => t.encode(text, add_special, parse_special),
        }
    }

    /// The bytes a token stands for. Control and unknown tokens give nothing unless `special`.
    pub fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        match self {
            Tokenizer::Spm(t) => t.token_bytes(id, special),
            Tokenizer::Bpe(t) => t.token_bytes(id, special),
        }
    }

    /// Text of `ids` (invalid UTF-8 replaced); control tokens shown only when `special`.
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.token_bytes(id, special)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// GPT-2's map from bytes to printable chars (the alphabet byte-level BPE vocabularies are
/// written in): printable Latin-1 bytes stand for themselves, the others for 256 + n.
fn gpt2_byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("256..=323 are chars")
        };
    }
    out
}

/// `tokenizer.ggml.pre` values whose ids equal llama.cpp's on its own vocabulary tests.
const CHECKED_PRE: &[&str] = &["qwen35"];

/// A piece of a text being tokenized: text still to split, or a special token found in it.
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

fn token_type(n: u32) -> TokenType {
    // llama.cpp's llama_token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    match n {
        2 => TokenType::Unknown,
        3 => TokenType::Control,
        4 => TokenType::UserDefined,
        5 => TokenType::Unused,
        6 => TokenType::Byte,
        _ => TokenType::Normal,
    }
}

/// The fill-in-the-middle tokens of a vocabulary, as llama.cpp finds them: the GGUF's
/// `tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id` (and the older
/// `prefix`/`suffix`/`middle_token_id`), else a token written as one of the texts llama.cpp
/// looks for (`<|fim_prefix|>` for Qwen, `<fim_prefix>` for Granite, `▁<PRE>` for CodeLlama, ...).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FimTokens {
    pub pre: Option<u32>,
    pub suf: Option<u32>,
    pub mid: Option<u32>,
    pub pad: Option<u32>,
    pub rep: Option<u32>,
    pub sep: Option<u32>,
}

impl FimTokens {
    /// The FIM tokens of the vocabulary `tok` read from `ct`. An id past the vocabulary is
    /// ignored (llama.cpp disables it).
    pub fn from_gguf(ct: &gguf_file::Content, tok: &Tokenizer) -> FimTokens {
        let n = tok.vocab_size() as u32;
        let id = |keys: &[&str]| keys.iter().find_map(|k| ct.metadata.get(*k).and_then(|v| v.to_u32().ok().or_else(|| v.to_i32().ok().and_then(|i| u32::try_from(i).ok())))).filter(|&i| i < n);
        let text = |texts: &[&str]| texts.iter().find_map(|t| tok.token_id(t));
        let k = |name: &str| format!("tokenizer.ggml.{name}_token_id");
        FimTokens {
            pre: id(&[&k("fim_pre"), &k("prefix")]).or_else(|| text(&["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>"])),
            suf: id(&[&k("fim_suf"), &k("suffix")]).or_else(|| text(&["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>"])),
            mid: id(&[&k("fim_mid"), &k("middle")]).or_else(|| text(&["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"])),
            pad: id(&[&k("fim_pad")]).or_else(|| text(&["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"])),
            rep: id(&[&k("fim_rep")]).or_else(|| text(&["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"])),
            sep: id(&[&k("fim_sep")]).or_else(|| text(&["<|file_sep|>"])),
        }
    }

    /// What a model lacks for `/infill`, in llama-server's words (empty: it can fill in).
    pub fn missing(&self) -> String {
        let mut err = String::new();
        for (t, what) in [(self.pre, "prefix"), (self.suf, "suffix"), (self.mid, "middle")] {
            if t.is_none() {
                err.push_str(&format!("{what} token is missing. "));
            }
        }
        err
    }
}

/// What every BPE vocabulary's metadata says, read once for either style.
struct Vocabulary {
    tokens: Vec<String>,
    types: Vec<TokenType>,
    token_to_id: HashMap<String, u32>,
    specials: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: Option<bool>,
    add_eos: bool,
}

/// A metadata key's array of strings.
fn strings(ct: &gguf_file::Content, key: &str) -> candle_core::Result<Vec<String>> {
    let v = ct.metadata.get(key).ok_or_else(|| candle_core::Error::msg(format!("missing GGUF metadata key `{key}`")))?;
    v.to_vec()?.iter().map(|s| s.to_string().cloned()).collect()
}

impl Vocabulary {
    fn from_gguf(ct: &gguf_file::Content) -> candle_core::Result<Vocabulary> {
        let id = |key: &str| ct.metadata.get(key).and_then(|v| v.to_u32().ok().or_else(|| v.to_i32().ok().map(|i| i as u32)));
        let flag = |key: &str| ct.metadata.get(key).and_then(|v| v.to_bool().ok());
        let tokens = strings(ct, "tokenizer.ggml.tokens")?;
        let types: Vec<TokenType> = match ct.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v.to_vec()?.iter().map(|t| t.to_i32().map(|n| token_type(n as u32)).or_else(|_| t.to_u32().map(token_type))).collect::<candle_core::Result<_>>()?,
            None => vec![TokenType::Normal; tokens.len()],
        };
        if types.len() != tokens.len() {
            candle_core::bail!("tokenizer.ggml.token_type has {} entries for {} tokens", types.len(), tokens.len());
        }
        let mut token_to_id = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            // llama.cpp keeps the last id for a duplicated text.
            token_to_id.insert(t.clone(), i as u32);
        }
        let mut specials: Vec<u32> =
            (0..tokens.len() as u32).filter(|&i| matches!(types[i as usize], TokenType::Control | TokenType::Unknown | TokenType::UserDefined) && !tokens[i as usize].is_empty()).collect();
        specials.sort_by(|a, b| tokens[*b as usize].len().cmp(&tokens[*a as usize].len()).then(a.cmp(b)));
        Ok(Vocabulary {
            tokens,
            types,
            token_to_id,
            specials,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos: flag("tokenizer.ggml.add_bos_token"),
            add_eos: flag("tokenizer.ggml.add_eos_token").unwrap_or(false),
        })
    }

    fn into_tokenizer(self, style: BpeStyle, inner: tokenizers::Tokenizer, add_bos: bool) -> BpeTokenizer {
        let byte_of = match style {
            BpeStyle::ByteLevel => gpt2_byte_chars().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect(),
            BpeStyle::Spm => HashMap::new(),
        };
        BpeTokenizer {
            style,
            inner,
            tokens: self.tokens,
            types: self.types,
            token_to_id: self.token_to_id,
            specials: self.specials,
            byte_of,
            bos: self.bos,
            eos: self.eos,
            add_bos,
            add_eos: self.add_eos,
        }
    }
}

impl BpeTokenizer {
    fn from_gguf(ct: &gguf_file::Content) -> candle_core::Result<BpeTokenizer> {
        // The pre-tokenizers whose ids are checked against llama.cpp's (its own vocabulary tests):
        // candle's pipelines for the others differ from llama.cpp's (a prefix space, a
        // normalizer), so they are refused rather than tokenized differently.
        let pre = ct.metadata.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
        if !CHECKED_PRE.contains(&pre.as_str()) {
            candle_core::bail!("tokenizer.ggml.pre = {pre:?}: the BPE pre-tokenizers checked against llama.cpp are {CHECKED_PRE:?}");
        }
        let vocab = Vocabulary::from_gguf(ct)?;
        // The BPE alone: candle's builder with the keys that add special tokens and BOS/EOS
        // templates taken out (this type handles both, as llama.cpp does).
        let mut plain = gguf_file::Content { magic: ct.magic, metadata: HashMap::new(), tensor_infos: HashMap::new(), tensor_data_offset: 0 };
        for key in ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.byte_fallback", "tokenizer.ggml.ignore_merges"] {
            if let Some(v) = ct.metadata.get(key) {
                plain.metadata.insert(key.to_string(), v.clone());
            }
        }
        let inner = tokenizers::Tokenizer::from_gguf(&plain)?;
        // llama.cpp's default for BPE vocabularies: no BOS unless the metadata asks.
        let add_bos = vocab.add_bos.unwrap_or(false);
        Ok(vocab.into_tokenizer(BpeStyle::ByteLevel, inner, add_bos))
    }

    /// A `gemma4` vocabulary: the `tokenizers` crate's BPE over the GGUF's tokens and merges
    /// (with byte fallback), no normalizer or pre-tokenizer (this type escapes spaces and splits
    /// newlines as llama.cpp does).
    fn spm_from_gguf(ct: &gguf_file::Content) -> candle_core::Result<BpeTokenizer> {
        let vocab = Vocabulary::from_gguf(ct)?;
        // llama.cpp needs the merges for this vocabulary ("cannot find tokenizer merges").
        let merges: Vec<(String, String)> = strings(ct, "tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                // llama.cpp splits at the first space after the first byte.
                match m.as_bytes().iter().skip(1).position(|&b| b == b' ').map(|p| p + 1) {
                    Some(p) => Ok((m[..p].to_string(), m[p + 1..].to_string())),
                    None => Err(candle_core::Error::msg(format!("tokenizer.ggml.merges: {m:?} is not two tokens"))),
                }
            })
            .collect::<candle_core::Result<_>>()?;
        let bpe_vocab: tokenizers::models::bpe::Vocab = vocab.token_to_id.iter().map(|(t, &i)| (t.clone(), i)).collect();
        let bpe = tokenizers::models::bpe::BPE::builder().vocab_and_merges(bpe_vocab, merges).byte_fallback(true).build().map_err(|e| candle_core::Error::msg(format!("gemma4 tokenizer: {e}")))?;
        // llama.cpp forces BOS on for this vocabulary whatever the metadata says.
        Ok(vocab.into_tokenizer(BpeStyle::Spm, tokenizers::Tokenizer::new(bpe), true))
    }

    /// The BPE ids of a plain text fragment.
    fn encode_text(&self, t: &str, out: &mut Vec<u32>) {
        match self.style {
            BpeStyle::ByteLevel => {
                let enc = self.inner.encode_fast(t, false).expect("a BPE without added tokens encodes any text");
                out.extend_from_slice(enc.get_ids());
            }
            BpeStyle::Spm => {
                let escaped = t.replace(' ', "\u{2581}");
                // Runs of newlines and runs of the rest (llama.cpp's `[^\n]+|[\n]+`); a run of
                // newlines that is a token is taken whole (llama.cpp's fix for Gemma 4).
                let mut rest = escaped.as_str();
                while !rest.is_empty() {
                    let nl = rest.starts_with('\n');
                    let end = rest.find(|c: char| (c == '\n') != nl).unwrap_or(rest.len());
                    let (word, tail) = rest.split_at(end);
                    rest = tail;
                    if nl {
                        if let Some(&id) = self.token_to_id.get(word) {
                            out.push(id);
                            continue;
                        }
                    }
                    match self.inner.encode_fast(word, false) {
                        Ok(enc) => out.extend_from_slice(enc.get_ids()),
                        // A char with neither a token nor byte tokens: llama.cpp drops it too.
                        Err(_) => {
                            for c in word.chars() {
                                if let Ok(enc) = self.inner.encode_fast(&*c.encode_utf8(&mut [0u8; 4]), false) {
                                    out.extend_from_slice(enc.get_ids());
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        for frag in self.partition(text, parse_special) {
            match frag {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(t) => self.encode_text(t, &mut out),
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// llama.cpp's `tokenizer_st_partition`: the text split on each special token in turn,
    /// longest first, every occurrence in every text fragment left; control and unknown tokens
    /// only with `parse_special`, user-defined tokens always.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut frags = vec![Fragment::Text(text)];
        for &id in &self.specials {
            if !parse_special && matches!(self.types[id as usize], TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            if !frags.iter().any(|f| matches!(f, Fragment::Text(t) if t.contains(needle))) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Text(mut t) => {
                        while let Some(pos) = t.find(needle) {
                            if pos > 0 {
                                next.push(Fragment::Text(&t[..pos]));
                            }
                            next.push(Fragment::Token(id));
                            t = &t[pos + needle.len()..];
                        }
                        if !t.is_empty() {
                            next.push(Fragment::Text(t));
                        }
                    }
                    tok => next.push(tok),
                }
            }
            frags = next;
        }
        frags
    }

    fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        let Some(&ty) = self.types.get(id as usize) else { return Vec::new() };
        let text = &self.tokens[id as usize];
        match ty {
            TokenType::Control | TokenType::Unknown if !special => Vec::new(),
            TokenType::Control | TokenType::Unknown | TokenType::UserDefined => text.as_bytes().to_vec(),
            TokenType::Unused => Vec::new(),
            TokenType::Normal if self.style == BpeStyle::Spm => text.replace('\u{2581}', " ").into_bytes(),
            TokenType::Byte if self.style == BpeStyle::Spm => match text.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                Some(b) => vec![b],
                None => text.as_bytes().to_vec(),
            },
            // Normal and byte tokens are written in GPT-2's byte alphabet; a char outside it
            // (a vocabulary that writes raw text) stands for its own UTF-8.
            TokenType::Normal | TokenType::Byte => {
                let mut out = Vec::with_capacity(text.len());
                for c in text.chars() {
                    match self.byte_of.get(&c) {
                        Some(&b) => out.push(b),
                        None => out.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes()),
                    }
                }
                out
            }
        }
    }
}
