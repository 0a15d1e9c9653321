//! Constrained decoding through llguidance (the library llama.cpp integrates): JSON schemas,
//! GBNF grammars (translated to llguidance's Lark dialect), Lark and regexes.
//!
//! A [`Grammars`] is built once per model (the token trie over the whole vocabulary); a
//! [`Grammar`] is one request's parser state. Tokens are consumed as they are emitted; a
//! speculative round consumes its drafts tentatively and rolls them back ([`Grammar::mark`],
//! [`Grammar::rewind`]), so the committed state is always "the tokens handed out so far".

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use tine_runtime::Model;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON schema (`{}` or `{"type": "object"}` for any object).
    JsonSchema(serde_json::Value),
    /// llama.cpp's GBNF (root rule `root`).
    Gbnf(String),
    /// llguidance's Lark dialect (a grammar starting with `%llguidance`, as llama.cpp takes it).
    Lark(String),
    /// A regular expression the whole output must match.
    Regex(String),
}

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("cannot build the token trie for constrained decoding: {0}")]
    Setup(String),
    #[error("invalid GBNF grammar at line {line}: {message}")]
    Gbnf { line: usize, message: String },
    #[error("invalid grammar: {0}")]
    Compile(String),
    #[error("constrained decoding failed: {0}")]
    Runtime(String),
    #[error("the grammar allows no token at this point (its state: {0})")]
    Dead(String),
}

/// The vocabulary as llguidance sees it, shared by every request on one model.
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

struct SpmEnv {
    trie: TokTrie,
    tokenizer: tine_runtime::Tokenizer,
}

impl TokenizerEnv for SpmEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenizer.encode(&String::from_utf8_lossy(s), false, false)
    }
}

impl Grammars {
    /// Builds the token trie of `model`'s vocabulary (each token's bytes; control tokens carry
    /// llguidance's special-token marker so no text can spell them).
    pub fn new(model: &Model) -> Result<Grammars, GrammarError> {
        use tine_runtime::TokenType;
        let tok = &model.tokenizer;
        let n = tok.vocab_size() as u32;
        let words: Vec<Vec<u8>> = (0..n)
            .map(|id| match tok.token_type(id) {
                Some(TokenType::Control) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.token_text(id).unwrap_or_default().as_bytes());
                    w
                }
                _ => tok.token_bytes(id, false),
            })
            .collect();
        let eog = model.end_of_generation_tokens();
        let first = *eog.first().ok_or_else(|| GrammarError::Setup("the model has no end-of-generation token".into()))?;
        let info = TokRxInfo { vocab_size: n, tok_eos: first, tok_bos: tok.bos_token(), tok_pad: None, tok_unk: None, tok_end_of_turn: None };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eog);
        let env: TokEnv = Arc::new(SpmEnv { trie, tokenizer: tok.clone() });
        let caps = InferenceCapabilities { ff_tokens: false, backtrack: false, conditional_ff_tokens: false, fork: false };
        let mut factory = ParserFactory::new(&env, caps, &llguidance::earley::SlicedBiasComputer::general_slices()).map_err(|e| GrammarError::Setup(format!("{e:#}")))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// Compiles one request's grammar.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, GrammarError> {
        let top = match spec {
            GrammarSpec::JsonSchema(v) => TopLevelGrammar::from_json_schema(bounded_numbers(bounded_whitespace(v))),
            GrammarSpec::Lark(s) => TopLevelGrammar::from_lark(s.clone()),
            GrammarSpec::Regex(s) => TopLevelGrammar::from_regex(s),
            GrammarSpec::Gbnf(s) => TopLevelGrammar::from_lark(gbnf_to_lark(s)?),
        };
        let parser = self.factory.create_parser(top).map_err(|e| GrammarError::Compile(format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(Grammar { matcher, consumed: 0, tentative: 0 })
    }
}

/// llguidance lets any run of whitespace sit between JSON tokens; a small model can then
/// emit whitespace until the token limit. Unless the schema sets its own `x-guidance`
/// options, whitespace is bounded as llama.cpp's own schema grammars bound it
/// (`space ::= | " " | "\n" [ \t]{0,20}`).
fn bounded_whitespace(schema: &serde_json::Value) -> serde_json::Value {
    let mut v = schema.clone();
    if let Some(o) = v.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_pattern": "( |\\n[ \\t]{0,20})"}));
    }
    v
}

/// The most digits llama.cpp's schema grammars let an integer part have (`[1-9] [0-9]{0,15}`).
pub const JSON_INTEGER_DIGITS: i32 = 16;

/// The most digits a fraction gets here. llama.cpp allows 16 (`DECIMALS_MAX_DIGITS`). Through
/// llguidance a fraction is bounded by `multipleOf`, which it reads through an f64 (exact only
/// down to 1e-10), and whose emptiness check overflows (a panic in a debug build, wrapped
/// arithmetic in a release one) from 9 fraction digits on a 16-digit range: 8 is the most that
/// is checked soundly, and only over a range no wider than +-1e16.
pub const JSON_FRACTION_DIGITS: i32 = 8;

/// llguidance lets a JSON number have any count of digits; a small model can then write a
/// 40-digit "age" until the token limit cuts the JSON. Unless a schema bounds a number itself,
/// its integer part is bounded to [`JSON_INTEGER_DIGITS`] digits as llama.cpp's schema grammars
/// bound it (an absent `minimum` or `maximum` becomes an exclusive bound of ±1e16) and a
/// `number`'s fraction to [`JSON_FRACTION_DIGITS`] (an absent `multipleOf` becomes 1e-8).
/// Unlike llama.cpp's, such a number has no exponent (llguidance's bounded ranges and
/// `multipleOf` read plain decimals). Only subschemas in schema positions are touched, never
/// `enum`/`const`/`default` data.
pub fn bounded_numbers(mut schema: serde_json::Value) -> serde_json::Value {
    bound_numbers_in(&mut schema);
    schema
}

fn bound_numbers_in(schema: &mut serde_json::Value) {
    use serde_json::{json, Value};
    let Some(o) = schema.as_object_mut() else { return };
    let types: Vec<&str> = match o.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let (integer, number) = (types.contains(&"integer"), types.contains(&"number"));
    if integer || number {
        let limit = 10f64.powi(JSON_INTEGER_DIGITS);
        // A draft-4 boolean `exclusiveMinimum`/`exclusiveMaximum` modifies the schema's own bound.
        let num = |k: &str| o.get(k).and_then(Value::as_f64);
        let (low, high) = (num("minimum").or(num("exclusiveMinimum")), num("maximum").or(num("exclusiveMaximum")));
        let bounded_low = o.contains_key("minimum") || o.contains_key("exclusiveMinimum");
        let bounded_high = o.contains_key("maximum") || o.contains_key("exclusiveMaximum");
        if !bounded_low && high.is_none_or(|h| h > -limit) {
            o.insert("exclusiveMinimum".into(), json!(-limit));
        }
        if !bounded_high && low.is_none_or(|l| l < limit) {
            o.insert("exclusiveMaximum".into(), json!(limit));
        }
        // (Only over a range within +-1e16: see JSON_FRACTION_DIGITS.)
        let narrow = low.is_none_or(|l| l >= -limit) && high.is_none_or(|h| h <= limit);
        if number && narrow && !o.contains_key("multipleOf") {
            o.insert("multipleOf".into(), json!(10f64.powi(-JSON_FRACTION_DIGITS)));
        }
    }
    for (key, value) in o.iter_mut() {
        match key.as_str() {
            "items" | "additionalItems" | "additionalProperties" | "contains" | "not" | "if" | "then" | "else" | "propertyNames" | "unevaluatedItems" | "unevaluatedProperties" => match value {
                Value::Array(schemas) => schemas.iter_mut().for_each(bound_numbers_in),
                v => bound_numbers_in(v),
            },
            "allOf" | "anyOf" | "oneOf" | "prefixItems" => {
                if let Value::Array(schemas) = value {
                    schemas.iter_mut().for_each(bound_numbers_in);
                }
            }
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Value::Object(map) = value {
                    map.values_mut().for_each(bound_numbers_in);
                }
            }
            _ => {}
        }
    }
}

/// One request's parser state.
pub struct Grammar {
    matcher: Matcher,
    /// Tokens consumed in all (committed and tentative).
    consumed: usize,
    /// Of those, consumed since [`Grammar::mark`].
    tentative: usize,
}

/// A clone is independent, lexer cache included (a shallow one would share the cache's lock
/// between requests running on different threads).
impl Clone for Grammar {
    fn clone(&self) -> Self {
        Grammar { matcher: self.matcher.deep_clone(), consumed: self.consumed, tentative: self.tentative }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("consumed", &self.consumed).finish_non_exhaustive()
    }
}

impl Grammar {
    fn err(&self, e: impl std::fmt::Display) -> GrammarError {
        GrammarError::Runtime(self.matcher.get_error().unwrap_or_else(|| e.to_string()))
    }

    /// Whether the grammar can take no more tokens (only end of generation is left).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the tokens consumed so far form a complete output.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Consumes an emitted token.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher.consume_token(token).map_err(|e| self.err(e))?;
        self.consumed += 1;
        Ok(())
    }

    /// How many leading `tokens` the grammar accepts, without consuming them.
    pub fn admissible(&mut self, tokens: &[u32]) -> usize {
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    /// Starts tentative consumption (a speculative round's drafts).
    pub fn mark(&mut self) {
        self.tentative = 0;
    }

    /// Consumes a token tentatively.
    pub fn consume_tentative(&mut self, token: u32) -> Result<(), GrammarError> {
        self.consume(token)?;
        self.tentative += 1;
        Ok(())
    }

    /// Undoes the tentative tokens since [`Grammar::mark`].
    pub fn rewind(&mut self) -> Result<(), GrammarError> {
        if self.tentative > 0 {
            self.matcher.rollback(self.tentative).map_err(|e| self.err(e))?;
            self.consumed -= self.tentative;
            self.tentative = 0;
        }
        Ok(())
    }

    /// Sets every token the grammar does not allow next to `-inf`. End-of-generation tokens
    /// stay allowed when the grammar may end here, and are the only ones left once it must;
    /// `ban_eog` (`ignore_eos`) bans them while anything else is possible.
    pub fn mask(&mut self, row: &mut [f32], eog: &[u32], ban_eog: bool) -> Result<(), GrammarError> {
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| self.err(e))?;
        let stopped = self.matcher.is_stopped();
        let saved: Vec<(usize, f32)> = if stopped { eog.iter().filter_map(|&t| row.get(t as usize).map(|&l| (t as usize, l))).collect() } else { Vec::new() };
        mask.iter_unset_entries(|i| {
            if let Some(l) = row.get_mut(i) {
                *l = f32::NEG_INFINITY;
            }
        });
        if stopped {
            // Only the end is left: whatever ignore_eos said, the output is complete.
            for (i, l) in saved {
                row[i] = if l.is_finite() { l } else { 0.0 };
            }
        } else if ban_eog {
            for &t in eog {
                if let Some(l) = row.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if !row.iter().any(|l| l.is_finite()) {
            return Err(GrammarError::Dead(format!("{} tokens consumed", self.consumed)));
        }
        Ok(())
    }
}

/// Translates llama.cpp's GBNF into llguidance's Lark dialect: `root` becomes `start`, every
/// rule gets a lowercase name (Lark reads uppercase names as terminals), literals become JSON
/// strings, character classes and `.` become regexes of code points.
pub fn gbnf_to_lark(src: &str) -> Result<String, GrammarError> {
    Gbnf::new(src).translate()
}

struct Gbnf {
    chars: Vec<char>,
    pos: usize,
    names: std::collections::BTreeMap<String, usize>,
    defined: std::collections::BTreeSet<String>,
}

impl Gbnf {
    fn new(src: &str) -> Gbnf {
        Gbnf { chars: src.chars().collect(), pos: 0, names: Default::default(), defined: Default::default() }
    }

    fn line(&self) -> usize {
        1 + self.chars[..self.pos.min(self.chars.len())].iter().filter(|&&c| c == '\n').count()
    }

    fn fail<T>(&self, message: impl Into<String>) -> Result<T, GrammarError> {
        Err(GrammarError::Gbnf { line: self.line(), message: message.into() })
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    /// Skips spaces and comments; newlines too when `newlines`.
    fn skip(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            if c == '#' {
                while self.peek().is_some_and(|c| c != '\n') {
                    self.pos += 1;
                }
            } else if c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n') {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    fn is_name_char(c: char) -> bool {
        c.is_ascii_alphanumeric() || c == '-' || c == '_'
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while self.peek().is_some_and(Self::is_name_char) {
            self.pos += 1;
        }
        (self.pos > start).then(|| self.chars[start..self.pos].iter().collect())
    }

    fn rule_ref(&mut self, name: &str) -> String {
        let n = self.names.len();
        let id = *self.names.entry(name.to_owned()).or_insert(n);
        if name == "root" {
            "start".to_owned()
        } else {
            format!("r{id}_{}", name.to_ascii_lowercase().replace('-', "_"))
        }
    }

    /// Is the text at the cursor `name ::=` (the start of the next rule)?
    fn at_rule_start(&self) -> bool {
        let mut p = self.pos;
        while self.chars.get(p).is_some_and(|&c| Self::is_name_char(c)) {
            p += 1;
        }
        if p == self.pos {
            return false;
        }
        while self.chars.get(p).is_some_and(|&c| c == ' ' || c == '\t') {
            p += 1;
        }
        self.chars.get(p..p + 3).is_some_and(|s| s == [':', ':', '='])
    }

    fn translate(mut self) -> Result<String, GrammarError> {
        let mut out = String::new();
        loop {
            self.skip(true);
            if self.peek().is_none() {
                break;
            }
            let Some(name) = self.name() else { return self.fail(format!("expected a rule name, found {:?}", self.peek().unwrap_or(' '))) };
            self.skip(false);
            if self.chars.get(self.pos..self.pos + 3).is_none_or(|s| s != [':', ':', '=']) {
                return self.fail(format!("expected ::= after {name}"));
            }
            self.pos += 3;
            if !self.defined.insert(name.clone()) {
                return self.fail(format!("rule {name} is defined twice"));
            }
            let lhs = self.rule_ref(&name);
            let body = self.alternatives(0)?;
            out.push_str(&format!("{lhs}: {body}\n"));
        }
        if !self.defined.contains("root") {
            return Err(GrammarError::Gbnf { line: 1, message: "the grammar has no root rule".into() });
        }
        if let Some(missing) = self.names.keys().find(|n| !self.defined.contains(*n)) {
            return Err(GrammarError::Gbnf { line: 1, message: format!("rule {missing} is used but never defined") });
        }
        Ok(out)
    }

    /// Alternatives up to the end of the rule (or the closing parenthesis when `depth > 0`).
    fn alternatives(&mut self, depth: usize) -> Result<String, GrammarError> {
        let mut alts = vec![self.sequence(depth)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            alts.push(self.sequence(depth)?);
        }
        Ok(alts.join(" | "))
    }

    fn sequence(&mut self, depth: usize) -> Result<String, GrammarError> {
        let mut items: Vec<String> = Vec::new();
        loop {
            // Inside parentheses a rule may continue over lines; at the top level a newline
            // ends the rule unless the next line does not start a new one.
            self.skip(depth > 0);
            if depth == 0 && self.peek() == Some('\n') {
                self.skip(true);
                if self.peek().is_none() || self.at_rule_start() {
                    break;
                }
                continue;
            }
            let Some(c) = self.peek() else {
                if depth > 0 {
                    return self.fail("unclosed (");
                }
                break;
            };
            let item = match c {
                '|' => break,
                ')' if depth > 0 => break,
                ')' => return self.fail("unexpected )"),
                '"' => self.literal()?,
                '[' => self.class()?,
                '.' => {
                    self.pos += 1;
                    "/(?s:.)/".to_owned()
                }
                '(' => {
                    self.pos += 1;
                    let inner = self.alternatives(depth + 1)?;
                    if self.peek() != Some(')') {
                        return self.fail("expected )");
                    }
                    self.pos += 1;
                    format!("({inner})")
                }
                c if Self::is_name_char(c) => {
                    let n = self.name().expect("a name char is there");
                    self.rule_ref(&n)
                }
                c => return self.fail(format!("unexpected character {c:?}")),
            };
            let item = self.postfix(item)?;
            items.push(item);
        }
        if items.is_empty() {
            // An empty alternative matches nothing (GBNF allows `a ::= "x" | `).
            return Ok("\"\"".to_owned());
        }
        Ok(items.join(" "))
    }

    fn postfix(&mut self, mut item: String) -> Result<String, GrammarError> {
        loop {
            match self.peek() {
                Some(op @ ('*' | '+' | '?')) => {
                    self.pos += 1;
                    item = format!("({item}){op}");
                }
                Some('{') => {
                    let start = self.pos;
                    while self.peek().is_some_and(|c| c != '}') {
                        self.pos += 1;
                    }
                    if self.peek() != Some('}') {
                        return self.fail("unclosed {");
                    }
                    self.pos += 1;
                    let inner: String = self.chars[start + 1..self.pos - 1].iter().filter(|c| !c.is_whitespace()).collect();
                    let ok = !inner.is_empty() && inner.split(',').count() <= 2 && inner.split(',').all(|p| p.chars().all(|c| c.is_ascii_digit())) && !inner.starts_with(',');
                    if !ok {
                        return self.fail(format!("bad repetition {{{inner}}}"));
                    }
                    item = format!("({item}){{{inner}}}");
                }
                _ => return Ok(item),
            }
        }
    }

    /// One escaped character inside a literal or class (the backslash already consumed).
    fn escape(&mut self) -> Result<char, GrammarError> {
        let Some(c) = self.peek() else { return self.fail("dangling \\") };
        self.pos += 1;
        let hex = |s: &mut Self, n: usize| -> Result<char, GrammarError> {
            let digits: String = s.chars.get(s.pos..s.pos + n).map(|d| d.iter().collect()).unwrap_or_default();
            s.pos += n;
            u32::from_str_radix(&digits, 16).ok().and_then(char::from_u32).map_or_else(|| s.fail(format!("bad escape \\{c}{digits}")), Ok)
        };
        Ok(match c {
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            '0' => '\0',
            'x' => hex(self, 2)?,
            'u' => hex(self, 4)?,
            'U' => hex(self, 8)?,
            c => c,
        })
    }

    fn literal(&mut self) -> Result<String, GrammarError> {
        self.pos += 1;
        let mut s = String::new();
        loop {
            match self.peek() {
                None | Some('\n') => return self.fail("unterminated string"),
                Some('"') => {
                    self.pos += 1;
                    break;
                }
                Some('\\') => {
                    self.pos += 1;
                    s.push(self.escape()?);
                }
                Some(c) => {
                    self.pos += 1;
                    s.push(c);
                }
            }
        }
        Ok(serde_json::to_string(&s).expect("a string serialises"))
    }

    /// One character of a class, escaped or not (the cursor is on it).
    fn class_char(&mut self) -> Result<char, GrammarError> {
        let c = self.peek().expect("the caller checked a character is there");
        self.pos += 1;
        if c == '\\' {
            self.escape()
        } else {
            Ok(c)
        }
    }

    fn class(&mut self) -> Result<String, GrammarError> {
        self.pos += 1;
        let mut rx = String::from("/[");
        if self.peek() == Some('^') {
            self.pos += 1;
            rx.push('^');
        }
        let mut any = false;
        loop {
            let c = match self.peek() {
                None | Some('\n') => return self.fail("unterminated character class"),
                Some(']') => {
                    self.pos += 1;
                    break;
                }
                Some(_) => self.class_char()?,
            };
            any = true;
            rx.push_str(&format!("\\x{{{:x}}}", c as u32));
            if self.peek() == Some('-') && self.chars.get(self.pos + 1).is_some_and(|&n| n != ']') {
                self.pos += 1;
                if self.peek().is_none() {
                    return self.fail("unterminated range");
                }
                let hi = self.class_char()?;
                if hi < c {
                    return self.fail(format!("empty range {c:?}-{hi:?}"));
                }
                rx.push_str(&format!("-\\x{{{:x}}}", hi as u32));
            }
        }
        if !any {
            return self.fail("empty character class");
        }
        rx.push_str("]/");
        Ok(rx)
    }
}
