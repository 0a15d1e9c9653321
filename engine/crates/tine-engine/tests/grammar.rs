//! Constrained decoding: GBNF translation, JSON schemas, and every spec type giving exactly
//! the output of plain constrained decoding.

use tine_engine::grammar::{gbnf_to_lark, Grammar, GrammarError, GrammarSpec, Grammars};
use tine_engine::{GenerateRequest, StopType};
use tine_runtime::Model;
use tine_sampling::SamplingParams;
use tine_spec::{SpecConfig, SpecFactory, SpecType};
use tine_test_support::{TinyAssistant, TinyGemma3};

use super::run;

struct Fixture {
    _dir: tempfile::TempDir,
    model: Model,
    factories: Vec<SpecFactory>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = TinyGemma3 { nextn: true, seed: 4, ..TinyGemma3::default() };
    let path = dir.path().join("tiny.gguf");
    cfg.write(&path);
    let draft = dir.path().join("draft.gguf");
    TinyGemma3 { seed: 9, ..TinyGemma3::default() }.write(&draft);
    let head = dir.path().join("head.gguf");
    TinyAssistant::default().write(&cfg, &head);
    let model = Model::load(&path).expect("fixture loads");
    let factories = [SpecType::DraftMtp, SpecType::DraftAssistant, SpecType::Draft, SpecType::Ngram]
        .into_iter()
        .map(|kind| {
            let config = SpecConfig { ngram_min: 1, mtp_head: Some(head.clone()), draft_model: Some(draft.clone()), ..SpecConfig::new(kind) };
            SpecFactory::load(config, &model).expect("spec setup")
        })
        .collect();
    Fixture { _dir: dir, model, factories }
}

fn accepts(g: &Grammars, model: &Model, spec: &GrammarSpec, text: &str) -> bool {
    let mut grammar: Grammar = g.compile(spec).expect("compiles");
    let ids = model.tokenizer.encode(text, false, false);
    grammar.admissible(&ids) == ids.len() && {
        for &t in &ids {
            grammar.consume(t).expect("admissible tokens consume");
        }
        grammar.is_accepting()
    }
}

/// GBNF in llama.cpp's syntax, and strings each grammar must accept or refuse.
const GBNF_CASES: &[(&str, &[&str], &[&str])] = &[
    ("root ::= \"yes\" | \"no\"", &["yes", "no"], &["maybe", "yesno", ""]),
    ("root ::= [a-c]+ \"!\"", &["abc!", "a!", "cccc!"], &["!", "abd!", "ab"]),
    ("root ::= [^x]{2,3}", &["ab", "abc"], &["a", "abcd", "xa"]),
    ("root ::= num (\",\" num)*\nnum ::= [0-9]+ # comment\n", &["1", "12,3,456"], &["1,", ",1", "a"]),
    ("root ::= greeting\n  | farewell\ngreeting ::= \"hi\" ws name\nfarewell ::= \"bye\"\nws ::= [ \\t]+\nname ::= [A-Z] [a-z]*", &["hi Bob", "bye", "hi\tA"], &["hi", "hibob", "bye Bob"]),
    ("root ::= \"\\x41\\u00e9\\n\" .", &["Aé\nz", "Aé\n\n"], &["Aé\n", "Ae\nz"]),
    ("root ::= (\"a\" | \"b\")? \"c\"", &["c", "ac", "bc"], &["abc", "a"]),
    ("Root-Name ::= \"x\"\nroot ::= Root-Name Root-Name", &["xx"], &["x", "xxx"]),
];

#[test]
fn gbnf_grammars_accept_exactly_their_language() {
    let f = fixture();
    let g = Grammars::new(&f.model).expect("trie");
    for (gbnf, yes, no) in GBNF_CASES {
        let spec = GrammarSpec::Gbnf(gbnf.to_string());
        for s in *yes {
            assert!(accepts(&g, &f.model, &spec, s), "{gbnf:?} must accept {s:?} (lark: {:?})", gbnf_to_lark(gbnf));
        }
        for s in *no {
            assert!(!accepts(&g, &f.model, &spec, s), "{gbnf:?} must refuse {s:?} (lark: {:?})", gbnf_to_lark(gbnf));
        }
    }
}

#[test]
fn malformed_gbnf_is_refused_with_its_line() {
    for (gbnf, line, needle) in [
        ("root ::= \"a", 1, "unterminated string"),
        ("root ::= a", 1, "never defined"),
        ("start ::= \"a\"", 1, "no root"),
        ("root ::= \"a\"\nroot ::= \"b\"", 2, "defined twice"),
        ("root ::= (\"a\"", 1, "unclosed"),
        ("root ::= [z-a]", 1, "empty range"),
        ("root ::= \"a\"{x}", 1, "bad repetition"),
        ("root = \"a\"", 1, "expected ::="),
    ] {
        match gbnf_to_lark(gbnf) {
            Err(GrammarError::Gbnf { line: l, message }) => {
                assert_eq!(l, line, "{gbnf:?}: {message}");
                assert!(message.contains(needle), "{gbnf:?}: {message}");
            }
            other => panic!("{gbnf:?} must be refused, got {other:?}"),
        }
    }
    let f = fixture();
    let g = Grammars::new(&f.model).expect("trie");
    assert!(matches!(g.compile(&GrammarSpec::JsonSchema(serde_json::json!({"type": "no-such-type"}))), Err(GrammarError::Compile(_))));
    assert!(matches!(g.compile(&GrammarSpec::Lark("start: undefined_rule".into())), Err(GrammarError::Compile(_))));
}

/// Issue 30: a 270M model wrote a 40-digit "age" under `{"type": "integer"}` until max_tokens
/// cut the JSON. Numbers are bounded wherever the schema leaves them unbounded (16 digits in the
/// integer part, as llama.cpp's schema grammars; 8 in a fraction, see `JSON_FRACTION_DIGITS`),
/// nested schemas and `$defs` included; a schema's own bounds stand.
#[test]
fn json_schema_numbers_are_bounded_to_llama_cpps_digits_unless_the_schema_bounds_them() {
    use serde_json::json;
    let f = fixture();
    let g = Grammars::new(&f.model).expect("trie");
    let d16 = "9".repeat(16);
    let d17 = "9".repeat(17);
    let frac16 = format!("0.{}", "3".repeat(8));
    let frac17 = format!("0.{}", "3".repeat(9));
    let cases: Vec<(serde_json::Value, Vec<String>, Vec<String>)> = vec![
        (json!({"type": "integer"}), vec!["0".into(), "-7".into(), d16.clone(), format!("-{d16}")], vec![d17.clone(), format!("-{d17}"), "1.5".into()]),
        (json!({"type": "number"}), vec!["0".into(), "42".into(), "-3.25".into(), d16.clone(), frac16.clone()], vec![d17.clone(), frac17.clone()]),
        (json!({"type": ["integer", "null"]}), vec![d16.clone(), "null".into()], vec![d17.clone()]),
        // The schema's own bounds stand, on either side.
        (json!({"type": "integer", "maximum": 1e18}), vec![format!("{d17}9")], vec![format!("-{d17}"), format!("{d17}99")]),
        (json!({"type": "integer", "minimum": 0}), vec![d16.clone()], vec![d17.clone(), "-1".into()]),
        (json!({"type": "number", "multipleOf": 0.5}), vec!["2.5".into()], vec!["2.25".into(), d17.clone()]),
        // A range wider than +-1e16 keeps its own bounds and gets no fraction bound (which
        // llguidance cannot check soundly over it); it compiles, in debug builds too.
        (json!({"type": "number", "maximum": 1e17}), vec![format!("{d17}.5"), frac17.clone()], vec!["1e40".into(), format!("{d17}99")]),
        // Nested: properties, items, anyOf and $defs.
        (
            json!({"type": "object", "properties": {"age": {"type": "integer"}, "xs": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "required": ["age", "xs"], "additionalProperties": false, "$defs": {"n": {"anyOf": [{"type": "number"}, {"type": "string"}]}}}),
            vec![format!("{{\"age\": {d16}, \"xs\": [{frac16}, \"a\"]}}")],
            vec![format!("{{\"age\": {d17}, \"xs\": []}}"), format!("{{\"age\": 1, \"xs\": [{frac17}]}}")],
        ),
    ];
    for (schema, yes, no) in cases {
        let spec = GrammarSpec::JsonSchema(schema.clone());
        for s in &yes {
            assert!(accepts(&g, &f.model, &spec, s), "{schema} must accept {s}");
        }
        for s in &no {
            assert!(!accepts(&g, &f.model, &spec, s), "{schema} must refuse {s}");
        }
    }
    // Data is not a schema: an enum of objects keeps its objects as they are.
    let e = json!({"enum": [{"type": "integer"}]});
    assert_eq!(tine_engine::grammar::bounded_numbers(e.clone()), e);
}

/// A schema whose every instance is short, so generation from random weights ends.
fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"}
        },
        "required": ["color", "n", "ok"],
        "additionalProperties": false
    })
}

fn valid(text: &str) -> Result<(), String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let o = v.as_object().ok_or("not an object")?;
    if o.len() != 3 {
        return Err(format!("{} keys", o.len()));
    }
    if !["red", "green", "blue"].contains(&o.get("color").and_then(|c| c.as_str()).ok_or("color")?) {
        return Err("color".into());
    }
    let n = o.get("n").and_then(|n| n.as_u64()).ok_or("n")?;
    if n > 99 {
        return Err("n range".into());
    }
    o.get("ok").and_then(|b| b.as_bool()).ok_or("ok")?;
    Ok(())
}

#[test]
fn every_sample_under_a_json_schema_is_valid_and_every_spec_type_gives_the_plain_output() {
    let f = fixture();
    let g = Grammars::new(&f.model).expect("trie");
    let compiled = g.compile(&GrammarSpec::JsonSchema(schema())).expect("schema compiles");
    let prompt = f.model.tokenizer.encode("hello world hello", true, true);
    let mut verified = [0usize; 4];
    let mut configs = vec![SamplingParams::greedy()];
    for seed in 0..6 {
        configs.push(SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(seed), ..SamplingParams::default() });
    }
    for (ci, sampling) in configs.iter().enumerate() {
        for ignore_eos in [false, true] {
            let req = GenerateRequest { n_predict: 200, sampling: sampling.clone(), ignore_eos, grammar: Some(compiled.clone()), ..GenerateRequest::new(prompt.clone()) };
            let plain = run(&f.model, req.clone(), None);
            assert_eq!(plain.2, Some(StopType::Eos), "config {ci}: the grammar completes the object: {:?}", plain.1);
            valid(&plain.1).unwrap_or_else(|e| panic!("config {ci}: {:?} is not valid: {e}", plain.1));
            if !sampling.is_greedy() {
                continue;
            }
            for factory in &f.factories {
                let kind = factory.config.spec_type;
                let got = run(&f.model, req.clone(), Some(factory));
                assert_eq!((&got.0, &got.1, got.2), (&plain.0, &plain.1, plain.2), "{kind}: spec output equals plain constrained output");
                assert!(got.3.iter().zip(&plain.3).all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())), "{kind}: masked rows differ");
                verified[f.factories.iter().position(|x| std::ptr::eq(x, factory)).expect("listed")] += got.4.draft.draft_n_accepted;
            }
        }
    }
    // The identity above is not vacuous: drafts were kept under the mask. (The random
    // assistant head's drafts all leave the grammar at their first token, so it only shows
    // that a cut draft changes nothing.)
    assert!(verified[0] > 0 && verified[2] > 0 && verified[3] > 0, "accepted drafts per spec type: {verified:?}");
    // Sampled with speculation: every sample is still valid.
    for factory in &f.factories {
        for seed in 0..4 {
            let sampling = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(seed), ..SamplingParams::default() };
            let req = GenerateRequest { n_predict: 200, sampling, grammar: Some(compiled.clone()), ..GenerateRequest::new(prompt.clone()) };
            let got = run(&f.model, req, Some(factory));
            valid(&got.1).unwrap_or_else(|e| panic!("{} seed {seed}: {:?} is not valid: {e}", factory.config.spec_type, got.1));
        }
    }
}

#[test]
fn a_draft_that_leaves_the_grammar_is_cut_before_verify() {
    let f = fixture();
    let g = Grammars::new(&f.model).expect("trie");
    // The n-gram drafter copies the prompt's "abab..." continuation; the grammar allows only
    // digits, so no draft token survives and nothing is verified.
    let compiled = g.compile(&GrammarSpec::Regex("[0-9]{1,40}".into())).expect("regex");
    let prompt = f.model.tokenizer.encode("ab ab ab ab ab ab ab ab", true, true);
    let req = GenerateRequest { n_predict: 30, sampling: SamplingParams::greedy(), grammar: Some(compiled), ..GenerateRequest::new(prompt) };
    let ngram = f.factories.iter().find(|f| f.config.spec_type == SpecType::Ngram).expect("ngram");
    let plain = run(&f.model, req.clone(), None);
    let got = run(&f.model, req, Some(ngram));
    assert!(plain.1.chars().all(|c| c.is_ascii_digit()) && !plain.1.is_empty(), "{:?}", plain.1);
    assert_eq!(got.1, plain.1);
    assert_eq!(got.4.draft.draft_n_accepted, got.4.draft.draft_n, "only admissible drafts were verified, and those the target kept: {:?}", got.4.draft);
}
