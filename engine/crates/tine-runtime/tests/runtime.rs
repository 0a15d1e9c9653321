//! Integration tests of tine-runtime (one test binary for the crate).

// The patches' own tests (the forward against a float64 reference on synthetic GGUFs, the
// tokenizer, the kernels) live in the candle crates and run in tine-patch-tests; these test
// tine-runtime's API over them.

use tine_runtime::{LoadError, Model};
use tine_test_support::{Reference, TinyGemma3, Weights};

// The CUDA path's tests: compiled only with `--features cuda` (run them on a GPU: `runtime cuda::`).
#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
mod cuda;

mod gemma4;
mod qwen35;
mod tokenizer;

/// Two f32 paths over the same positions (one-shot, token by token, chunks) may differ only by
/// reduction order.
const PATH_TOLERANCE: f32 = 1e-4;

struct Fixture {
    _dir: tempfile::TempDir,
    model: Model,
}

fn fixture(cfg: TinyGemma3) -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    cfg.write(&path);
    let model = Model::load(&path).expect("the fixture loads");
    Fixture { _dir: dir, model }
}

fn tokens(n: usize) -> Vec<u32> {
    // Spread over the vocabulary, starting with <bos>.
    std::iter::once(2).chain((1..n as u32).map(|i| 6 + (i * 37) % 280)).collect()
}

#[test]
fn one_shot_token_by_token_and_chunked_prefill_give_the_same_logits() {
    let fx = fixture(TinyGemma3::default());
    let toks = tokens(17);
    let one_shot = fx.model.new_sequence(64).forward_all(&fx.model, &toks).expect("one shot");
    let mut by_token = fx.model.new_sequence(64);
    let mut chunked = fx.model.new_sequence(64);
    let mut row = 0;
    for chunk in toks.chunks(5) {
        let c = chunked.forward_all(&fx.model, chunk).expect("chunk");
        for (j, &t) in chunk.iter().enumerate() {
            let single = by_token.decode(&fx.model, t).expect("decode");
            let a = one_shot.row(row);
            let worst = |b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(worst(&single) < PATH_TOLERANCE, "token-by-token differs at {row}: {}", worst(&single));
            assert!(worst(c.row(j)) < PATH_TOLERANCE, "chunked differs at {row}: {}", worst(c.row(j)));
            row += 1;
        }
    }
}

/// Decodes `toks[start..]` one token at a time, then re-runs them as verify batches of `batch`
/// tokens from the same warm cache; every row must be bit-identical to its one-token step.
fn assert_verify_batches_equal_decode(model: &Model, toks: &[u32], start: usize, batch: usize) {
    let mut seq = model.new_sequence(toks.len() + 8);
    seq.prefill(model, &toks[..start]).expect("prefill");
    let decoded: Vec<Vec<f32>> = toks[start..].iter().map(|&t| seq.decode(model, t).expect("decode")).collect();
    seq.rollback(start).expect("rollback");
    let mut row = 0;
    for chunk in toks[start..].chunks(batch) {
        let logits = seq.forward_all(model, chunk).expect("verify batch");
        for i in 0..chunk.len() {
            let (a, b) = (logits.row(i), &decoded[row]);
            let differing = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            assert_eq!(
                differing,
                0,
                "batch {batch}, position {}: {differing} logits differ from the one-token decode (max |diff| {})",
                start + row,
                a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
            );
            row += 1;
        }
    }
}

#[test]
fn the_context_limit_and_bad_tokens_are_errors_not_panics() {
    let fx = fixture(TinyGemma3::default());
    let mut seq = fx.model.new_sequence(4);
    assert!(matches!(seq.prefill(&fx.model, &tokens(5)), Err(tine_runtime::StepError::ContextFull { needed: 5, context: 4 })));
    assert!(matches!(seq.decode(&fx.model, 1_000_000), Err(tine_runtime::StepError::BadToken { .. })));
    assert!(seq.is_empty(), "a failed step changes nothing");
}

#[test]
fn a_corrupt_or_foreign_gguf_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("tiny.gguf");
    TinyGemma3::default().write(&good);
    let bytes = std::fs::read(&good).expect("read");
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 3]).expect("write");
    let err = Model::load(&cut).err().expect("truncated file must fail");
    assert!(matches!(err, LoadError::Gguf { .. } | LoadError::Weights { .. }), "{err}");
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf at all").expect("write");
    assert!(matches!(Model::load(&junk), Err(LoadError::Gguf { .. })));
    assert!(matches!(Model::load(&dir.path().join("missing.gguf")), Err(LoadError::Open { .. })));
}

// ---- Against llama.cpp, on the real default model ----
//
// tests/data/llama_cpp_*.json were recorded from llama.cpp's llama-server (same GGUF) by
// tools/llama_reference.py. The model is fetched by `cargo xtask fetch-model`, which
// `cargo xtask ci` runs first; without it these tests fail and say so (no silent skip).

use std::sync::OnceLock;

mod common;

fn real_model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = tine_runtime::default_model_path();
        assert!(path.exists(), "the default model is not cached at {}: run `cargo xtask fetch-model`", path.display());
        Model::load(&path).expect("the default model loads")
    })
}

fn data(name: &str) -> serde_json::Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).expect("reference data")).expect("valid JSON")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

#[test]
fn patch_0003_tokenizer_matches_llama_cpp_on_a_varied_corpus() {
    let model = real_model();
    let mut mismatches = Vec::new();
    let cases = data("llama_cpp_tokenizer.json");
    for case in cases["cases"].as_array().expect("cases") {
        let text = case["text"].as_str().expect("text");
        let want = ids(&case["ids"]);
        let got = model.tokenizer.encode(text, false, true);
        if got != want {
            mismatches.push(format!("{text:?}\n  llama.cpp: {want:?}\n  tine:      {got:?}"));
        }
        assert_eq!(model.tokenizer.decode(&got, true), text, "decode(encode(x)) == x");
    }
    assert!(mismatches.is_empty(), "{} of the corpus differ:\n{}", mismatches.len(), mismatches.join("\n"));
}

/// A divergence from llama.cpp's greedy path is accepted only at a near-tie: llama.cpp's top-2
/// log-probabilities closer than this. Gemma 3 270M is numerically touchy with quantized
/// activations: both engines sit about 0.1 (mean top-5 logprob) from a float64 reference
/// (`against_a_float64_reference_tine_is_as_close_as_llama_cpp`), and llama.cpp against itself
/// (f16 vs f32 KV cache) parts within 40 tokens on the code prompt; see
/// docs/evaluations/engine-correctness.md. A gap under 0.6 is within that noise.
const NEAR_TIE: f64 = 0.6;

#[test]
fn greedy_decoding_matches_llama_cpp_for_128_tokens() {
    let model = real_model();
    let cases = data("llama_cpp_greedy.json");
    let mut report = Vec::new();
    for case in cases["cases"].as_array().expect("cases") {
        let prompt = ids(&case["prompt_ids"]);
        assert_eq!(prompt, model.tokenizer.encode(case["prompt"].as_str().expect("prompt"), true, true), "prompt tokens differ");
        let want = ids(&case["ids"]);
        let top = case["top"].as_array().expect("top");
        let mut seq = model.new_sequence(1024);
        let mut logits = seq.prefill(model, &prompt).expect("prefill");
        for (i, &w) in want.iter().enumerate() {
            // llama.cpp's --ignore-eos equivalent: never pick an end-of-generation token.
            for &t in model.end_of_generation_tokens() {
                logits[t as usize] = f32::NEG_INFINITY;
            }
            let got = tine_sampling::argmax(&logits);
            if got != w {
                let lp = |k: usize| top[i][k][1].as_f64().expect("logprob");
                let gap = lp(0) - lp(1);
                assert!(gap < NEAR_TIE, "{:?}: position {i}: tine {got}, llama.cpp {w}, and llama.cpp's top-2 gap {gap:.4} is not a near-tie", case["prompt"]);
                report.push(format!("{:?} parts at {i} (near-tie, gap {gap:.4})", case["prompt"]));
                break;
            }
            logits = seq.decode(model, got).expect("decode");
        }
    }
    eprintln!("greedy vs llama.cpp: {}", if report.is_empty() { "identical on every prompt".into() } else { report.join("; ") });
}

/// Teacher-forced log-probabilities of llama.cpp's top-5 tokens, Tine vs llama.cpp (f32 KV cache):
/// allowed mean and largest absolute difference. Measured: mean 0.12, max 1.49 (on the code
/// prompt's low-probability alternatives); llama.cpp against itself, f16 vs f32 KV: mean 0.18.
const LOGPROB_MEAN_TOLERANCE: f64 = 0.2;
const LOGPROB_MAX_TOLERANCE: f64 = 2.0;

#[test]
fn teacher_forced_top5_logprobs_agree_with_llama_cpp() {
    let model = real_model();
    let cases = data("llama_cpp_greedy.json");
    let (mut worst, mut sum, mut n) = (0.0f64, 0.0f64, 0usize);
    for case in cases["cases"].as_array().expect("cases") {
        let prompt = ids(&case["prompt_ids"]);
        let gen = ids(&case["ids"]);
        let top = case["top"].as_array().expect("top");
        let mut all = prompt.clone();
        all.extend(&gen[..gen.len() - 1]);
        let mut seq = model.new_sequence(1024);
        let logits = seq.forward_all(model, &all).expect("teacher-forced forward");
        let mut per_pos = Vec::new();
        for (i, alts) in top.iter().enumerate() {
            let row = logits.row(prompt.len() - 1 + i);
            let mut pos_worst = 0.0f64;
            let lse = {
                let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                row.iter().map(|&l| (l as f64 - m).exp()).sum::<f64>().ln() + m
            };
            for alt in alts.as_array().expect("alts") {
                let id = alt[0].as_u64().expect("id") as usize;
                let theirs = alt[1].as_f64().expect("logprob");
                let ours = row[id] as f64 - lse;
                let d = (ours - theirs).abs();
                pos_worst = pos_worst.max(d);
                worst = worst.max(d);
                sum += d;
                n += 1;
            }
            per_pos.push(format!("{pos_worst:.2}"));
        }
        if std::env::var_os("TINE_DEBUG_LOGPROBS").is_some() {
            eprintln!("{:?}: {}", case["prompt"], per_pos.join(" "));
        }
    }
    eprintln!("teacher-forced top-5 logprobs vs llama.cpp: max |diff| {worst:.4}, mean {:.4} over {n}", sum / n as f64);
    let mean = sum / n as f64;
    assert!(mean < LOGPROB_MEAN_TOLERANCE, "mean |logprob diff| {mean} >= {LOGPROB_MEAN_TOLERANCE}");
    assert!(worst < LOGPROB_MAX_TOLERANCE, "max |logprob diff| {worst} >= {LOGPROB_MAX_TOLERANCE}");
}

/// Where Tine and llama.cpp disagree, which is closer to the truth? The float64 reference
/// (dequantized weights, exact GELU, f64 everywhere) decides, teacher-forced on llama.cpp's tokens.
#[test]
fn against_a_float64_reference_tine_is_as_close_as_llama_cpp() {
    let model = real_model();
    let weights = Weights::from_gguf(&model.info.path);
    let cases = data("llama_cpp_greedy.json");
    const POSITIONS: usize = 8;
    let (mut tine_err, mut llama_err, mut n) = (0.0f64, 0.0f64, 0usize);
    for case in cases["cases"].as_array().expect("cases") {
        let prompt = ids(&case["prompt_ids"]);
        let gen = ids(&case["ids"]);
        let top = case["top"].as_array().expect("top");
        let mut all = prompt.clone();
        all.extend(&gen[..POSITIONS - 1]);
        let logits = model.new_sequence(256).forward_all(model, &all).expect("forward");
        let mut reference = Reference::new(&weights);
        let mut ref_rows = Vec::new();
        for &t in &all {
            ref_rows.push(reference.step(t));
        }
        let lse64 = |row: &[f64]| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            row.iter().map(|l| (l - m).exp()).sum::<f64>().ln() + m
        };
        for (i, alts) in top.iter().enumerate().take(POSITIONS) {
            let p = prompt.len() - 1 + i;
            let r = &ref_rows[p];
            let r_lse = lse64(r);
            let ours: Vec<f64> = logits.row(p).iter().map(|&x| x as f64).collect();
            let o_lse = lse64(&ours);
            for alt in alts.as_array().expect("alts") {
                let id = alt[0].as_u64().expect("id") as usize;
                let truth = r[id] - r_lse;
                tine_err += (ours[id] - o_lse - truth).abs();
                llama_err += (alt[1].as_f64().expect("logprob") - truth).abs();
                n += 1;
            }
        }
    }
    let (t, l) = (tine_err / n as f64, llama_err / n as f64);
    eprintln!("mean |logprob - float64 reference| over {n}: tine {t:.4}, llama.cpp {l:.4}");
    assert!(t <= l * 1.25, "tine ({t:.4}) is further from the float64 reference than llama.cpp ({l:.4})");
}

#[test]
fn patch_0010_real_model_verify_batches_are_bit_identical_to_decode() {
    let model = real_model();
    let mut toks = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. Speculative decoding verifies", true, true);
    // Continue greedily so the batches hold likely tokens, past a 512-token window would be slow;
    // the window itself is covered by the synthetic test.
    let mut seq = model.new_sequence(256);
    let mut logits = seq.prefill(model, &toks).expect("prefill");
    for _ in 0..24 {
        let t = tine_sampling::argmax(&logits);
        toks.push(t);
        logits = seq.decode(model, t).expect("decode");
    }
    for batch in [2, 4] {
        assert_verify_batches_equal_decode(model, &toks, toks.len() - 24, batch);
    }
}

#[test]
fn grafting_a_nextn_head_gives_the_model_written_with_it_and_refuses_misfits() {
    use candle_core::quantized::gguf_file;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = TinyGemma3 { seed: 5, ..TinyGemma3::default() };
    let (with, target, head, out) = (dir.path().join("with.gguf"), dir.path().join("target.gguf"), dir.path().join("head.gguf"), dir.path().join("grafted.gguf"));
    TinyGemma3 { nextn: true, ..cfg.clone() }.write(&with);
    cfg.write(&target);
    // The head as shipped: only the NextN block of `with`, plus the width keys.
    let mut f = std::fs::File::open(&with).expect("open");
    let ct = gguf_file::Content::read(&mut f).expect("read");
    let prefix = format!("blk.{}.", cfg.n_layer);
    let names: Vec<String> = ct.tensor_infos.keys().filter(|n| n.starts_with(&prefix)).cloned().collect();
    let tensors: Vec<_> = names.iter().map(|n| ct.tensor(&mut f, n, &candle_core::Device::Cpu).expect("tensor")).collect();
    let md: Vec<(&str, &gguf_file::Value)> = ct.metadata.iter().filter(|(k, _)| k.starts_with("gemma3.embedding") || k.starts_with("general.arch")).map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(&head).expect("create"), &md, &names.iter().map(String::as_str).zip(tensors.iter()).collect::<Vec<_>>()).expect("write head");

    let g = tine_runtime::graft_nextn(&target, &head, &out).expect("graft");
    assert_eq!((g.block, g.head_tensors, g.draft_vocab), (cfg.n_layer, names.len(), None));
    let (a, b) = (Model::load(&with).expect("written with the head"), Model::load(&out).expect("grafted"));
    assert!(b.has_nextn());
    let p = tokens(9);
    let (mut sa, mut sb) = (a.new_sequence(64), b.new_sequence(64));
    let (la, ha) = sa.prefill_hidden(&a, &p).expect("prefill");
    let (lb, hb) = sb.prefill_hidden(&b, &p).expect("prefill");
    assert_eq!(la, lb, "the grafted trunk is the target's");
    let next: Vec<u32> = p[1..].iter().copied().chain([9]).collect();
    let (na, _) = a.new_nextn_state(64).expect("head").forward(&a, p[0], &ha, &next).expect("nextn");
    let (nb, _) = b.new_nextn_state(64).expect("head").forward(&b, p[0], &hb, &next).expect("nextn");
    assert_eq!(na, nb, "the grafted head drafts as the head it was cut from");

    let again = tine_runtime::graft_nextn(&out, &head, &dir.path().join("twice.gguf")).map(drop).expect_err("a second head is refused");
    assert!(again.to_string().contains("already has a NextN head"), "{again}");
    let short = dir.path().join("short.gguf");
    TinyGemma3 { n_layer: 5, ..cfg.clone() }.write(&short);
    let misfit = tine_runtime::graft_nextn(&short, &head, &dir.path().join("misfit.gguf")).map(drop).expect_err("a head for another depth is refused");
    assert!(misfit.to_string().contains("not in block 5"), "{misfit}");
    assert!(!dir.path().join("misfit.gguf").exists() && !dir.path().join("misfit.gguf.partial").exists(), "nothing is left behind");
}

/// What a failed step may not change.
fn state(seq: &tine_runtime::Sequence) -> (Vec<u32>, usize) {
    assert_eq!(seq.len(), seq.cache_len(), "tokens and KV cache disagree");
    (seq.tokens().to_vec(), seq.cache_len())
}

#[test]
fn a_failed_step_leaves_the_sequence_exactly_as_before() {
    // Failure injected after the forward wrote its KV rows (the worst moment), in each step of
    // the API, including the second chunk of a multi-chunk prefill; the sequence must be as
    // before, and stepping on from there must give the logits of a sequence that never failed.
    let fx = fixture(TinyGemma3 { context: 1400, ..TinyGemma3::default() });
    let m = &fx.model;
    let prompt = tokens(tine_runtime::PREFILL_CHUNK + 40);
    let mut clean = m.new_sequence(1400);
    let want_prefill = clean.prefill(m, &prompt).expect("clean prefill");
    let want_next = clean.forward_all(m, &[9, 10, 11]).expect("clean forward_all");

    type Step = fn(&mut tine_runtime::Sequence, &Model, &[u32]) -> Result<(), tine_runtime::StepError>;
    let steps: [(&str, Step, usize); 6] = [
        ("prefill", |s, m, t| s.prefill(m, t).map(drop), 1),
        ("prefill_hidden", |s, m, t| s.prefill_hidden(m, t).map(drop), 1),
        ("decode", |s, m, t| s.decode(m, t[0]).map(drop), 0),
        ("decode_argmax", |s, m, t| s.decode_argmax(m, t[0]).map(drop), 0),
        ("forward_all", |s, m, t| s.forward_all(m, &t[..3]).map(drop), 0),
        ("forward_all_hidden", |s, m, t| s.forward_all_hidden(m, &t[..3]).map(drop), 0),
    ];
    for (name, step, after) in steps {
        for start in [0usize, 5] {
            let mut seq = m.new_sequence(1400);
            seq.prefill(m, &prompt[..start.max(1)]).expect("warm prefix");
            seq.rollback(start).expect("rollback");
            let before = state(&seq);
            seq.inject_failure(Some(after));
            let err = step(&mut seq, m, &prompt[start..]).expect_err("the injected failure");
            assert!(matches!(err, tine_runtime::StepError::Injected), "{name}: {err}");
            assert_eq!(state(&seq), before, "{name} from {start}: a failed step changed the sequence");
        }
    }
    // After a failed multi-chunk prefill the same sequence gives the clean logits bit for bit.
    let mut seq = m.new_sequence(1400);
    seq.inject_failure(Some(1));
    seq.prefill(m, &prompt).expect_err("second chunk fails");
    assert!(seq.is_empty());
    assert_eq!(seq.prefill(m, &prompt).expect("retry"), want_prefill);
    seq.inject_failure(Some(0));
    seq.forward_all(m, &[9, 10, 11]).expect_err("verify batch fails");
    assert_eq!(seq.len(), prompt.len());
    assert_eq!(seq.forward_all(m, &[9, 10, 11]).expect("retry").data, want_next.data);
}

mod slot_file {
    use tine_runtime::{Model, SlotFileError, SlotImage};
    use tine_test_support::TinyGemma3;

    fn model(dir: &std::path::Path, seed: u64) -> Model {
        let path = dir.join(format!("tiny{seed}.gguf"));
        TinyGemma3 { seed, ..TinyGemma3::default() }.write(&path);
        Model::load(&path).expect("fixture loads")
    }

    #[test]
    fn a_saved_sequence_restored_elsewhere_continues_bit_for_bit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = model(dir.path(), 7);
        let mut a = m.new_sequence(64);
        a.prefill(&m, &m.tokenizer.encode("hello world hello", true, true)).expect("prefill");
        let bytes = a.image(&m).expect("image").to_bytes();
        let img = SlotImage::from_bytes(&bytes).expect("parses back");
        let mut b = m.new_sequence(64);
        b.prefill(&m, &[2, 5, 6]).expect("something to replace");
        b.restore_image(&m, &img).expect("restore");
        assert_eq!(b.tokens(), a.tokens());
        assert_eq!(b.cache_len(), a.len());
        for t in [40u32, 41, 42, 43, 44, 45] {
            let (x, y) = (a.decode(&m, t).expect("a"), b.decode(&m, t).expect("b"));
            assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()), "token {t}: the restored sequence's logits differ");
        }
        // An empty sequence round-trips too.
        let empty = m.new_sequence(64).image(&m).expect("image");
        let mut c = m.new_sequence(64);
        c.restore_image(&m, &SlotImage::from_bytes(&empty.to_bytes()).expect("parses")).expect("restore");
        assert!(c.is_empty());
    }

    /// Issue 29: a cache of other types than f32 saves its stored rows (version 3, the types
    /// named), restores bit for bit into a cache of the same types, and is refused by a model
    /// keeping other types; every truncation of the file is an error.
    #[test]
    fn a_typed_kv_cache_round_trips_and_a_cache_of_other_types_refuses_it() {
        use tine_runtime::KvType;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny32.gguf");
        TinyGemma3 { head_dim: 32, seed: 21, ..TinyGemma3::default() }.write(&path);
        for (k, v) in [(KvType::Q8_0, KvType::Q4_0), (KvType::F16, KvType::BF16)] {
            let mut m = Model::load(&path).expect("fixture loads");
            m.set_cache_types(k, v).expect("types fit");
            let mut a = m.new_sequence(64);
            a.prefill(&m, &m.tokenizer.encode("hello world hello", true, true)).expect("prefill");
            let img = a.image(&m).expect("image");
            assert_eq!(img.cache_types, (k, v));
            assert!(img.layers.is_empty() && !img.typed_layers.is_empty(), "the stored rows are saved, not f32 copies");
            let bytes = img.to_bytes();
            assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 3, "version 3 names the types");
            let back = SlotImage::from_bytes(&bytes).expect("parses back");
            assert_eq!(back, img);
            let mut b = m.new_sequence(64);
            b.restore_image(&m, &back).expect("restore");
            for t in [40u32, 41, 42] {
                let (x, y) = (a.decode(&m, t).expect("a"), b.decode(&m, t).expect("b"));
                assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()), "K {k} V {v}, token {t}: the restored sequence's logits differ");
            }
            for cut in (0..bytes.len()).step_by(7) {
                assert!(SlotImage::from_bytes(&bytes[..cut]).is_err(), "cut at {cut}");
            }
            let f32_model = Model::load(&path).expect("fixture loads");
            let mut c = f32_model.new_sequence(64);
            assert!(matches!(c.restore_image(&f32_model, &back), Err(SlotFileError::CacheTypes { .. })), "K {k} V {v} into an f32 cache");
            assert!(c.is_empty());
            // And an f32 slot into this typed model.
            let mut d = f32_model.new_sequence(64);
            d.prefill(&f32_model, &[2, 5, 6]).expect("prefill");
            let f32_img = d.image(&f32_model).expect("image");
            let mut e = m.new_sequence(64);
            assert!(matches!(e.restore_image(&m, &f32_img), Err(SlotFileError::CacheTypes { .. })));
        }
    }

    #[test]
    fn a_corrupt_truncated_or_foreign_slot_file_is_refused_and_changes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = model(dir.path(), 7);
        let other = model(dir.path(), 8);
        let mut a = m.new_sequence(64);
        a.prefill(&m, &m.tokenizer.encode("hello world", true, true)).expect("prefill");
        let bytes = a.image(&m).expect("image").to_bytes();
        assert!(matches!(SlotImage::from_bytes(b"GGUF...."), Err(SlotFileError::Magic)));
        assert!(matches!(SlotImage::from_bytes(&bytes[..bytes.len() - 3]), Err(SlotFileError::Checksum | SlotFileError::Length)));
        let mut flipped = bytes.clone();
        flipped[bytes.len() / 2] ^= 0x40;
        assert!(matches!(SlotImage::from_bytes(&flipped), Err(SlotFileError::Checksum)));
        // Every truncation and a flip at every byte: an error, never a panic or a huge allocation.
        for cut in 0..bytes.len() {
            assert!(SlotImage::from_bytes(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let img = SlotImage::from_bytes(&bytes).expect("parses");
        let mut b = other.new_sequence(64);
        b.prefill(&other, &[2, 5]).expect("prefill");
        assert!(matches!(b.restore_image(&other, &img), Err(SlotFileError::OtherModel { .. })), "a slot of another model");
        assert_eq!(b.tokens(), &[2, 5], "a refused restore leaves the sequence as it was");
        let mut small = m.new_sequence(a.len() - 1);
        assert!(matches!(small.restore_image(&m, &img), Err(SlotFileError::TooLong { .. })));
        let mut bad = img.clone();
        bad.layers[0].1.truncate(3);
        let mut c = m.new_sequence(64);
        assert!(c.restore_image(&m, &bad).is_err(), "K of the wrong size");
        assert!(c.is_empty());
    }
}

#[test]
fn decode_argmax_is_greedy_samplings_pick_of_decode_and_breaks_ties_to_the_lowest_id() {
    let fx = fixture(TinyGemma3::default());
    let m = &fx.model;
    let (mut a, mut b) = (m.new_sequence(64), m.new_sequence(64));
    let mut tok = 2u32;
    for _ in 0..24 {
        let want = tine_sampling::argmax(&a.decode(m, tok).expect("decode"));
        assert_eq!(b.decode_argmax(m, tok).expect("decode_argmax"), want);
        assert_eq!(b.tokens(), a.tokens());
        tok = want;
    }
    for row in [vec![1.0f32, 3.0, 3.0, 2.0], vec![0.5; 9], vec![f32::NEG_INFINITY, -1.0, -1.0], vec![7.0]] {
        assert_eq!(m.argmax_of(&row).expect("argmax"), tine_sampling::argmax(&row), "{row:?}");
    }
}

#[test]
fn decode_argmax_banning_is_greedy_samplings_pick_with_the_banned_ids_at_minus_infinity() {
    let fx = fixture(TinyGemma3::default());
    let m = &fx.model;
    let (mut a, mut b) = (m.new_sequence(64), m.new_sequence(64));
    let mut tok = 2u32;
    for step in 0..24 {
        let mut row = a.decode(m, tok).expect("decode");
        // Ban the row's own winner (so the ban decides), and an id past the vocabulary.
        let banned = [tine_sampling::argmax(&row) as u32, (step % 3) as u32, u32::MAX];
        for &t in &banned[..2] {
            row[t as usize] = f32::NEG_INFINITY;
        }
        let want = tine_sampling::argmax(&row);
        assert_eq!(b.decode_argmax_banning(m, tok, &banned).expect("decode_argmax_banning"), want);
        assert_eq!(b.tokens(), a.tokens());
        tok = want;
    }
}

#[test]
fn devices_parse_and_a_cuda_device_without_cuda_is_a_clear_error() {
    use tine_runtime::{DeviceError, DeviceSpec};
    for (text, want) in [("cpu", DeviceSpec::Cpu), ("CPU", DeviceSpec::Cpu), ("cuda", DeviceSpec::Cuda(0)), ("cuda:1", DeviceSpec::Cuda(1)), ("gpu:3", DeviceSpec::Cuda(3))] {
        assert_eq!(text.parse::<DeviceSpec>().expect(text), want, "{text}");
    }
    for bad in ["", "cuda:", "cuda:x", "metal", "cuda:-1"] {
        assert!(matches!(bad.parse::<DeviceSpec>(), Err(DeviceError::Parse(_))), "{bad:?} parsed");
    }
    assert_eq!(DeviceSpec::Cuda(2).to_string(), "cuda:2");
    assert!(DeviceSpec::Cpu.open().expect("the CPU opens").is_cpu());
    if !tine_runtime::CUDA_COMPILED {
        let err = DeviceSpec::Cuda(0).open().expect_err("no CUDA in this build");
        assert!(matches!(err, DeviceError::NotCompiled { .. }) && err.to_string().contains("tools/cuda/build.sh"), "{err}");
    }
}

#[test]
fn a_sequence_on_a_shared_prefix_steps_saves_and_rolls_back_as_one_holding_it() {
    let f = fixture(TinyGemma3 { context: 512, ..TinyGemma3::default() });
    let m = &f.model;
    let toks = tokens(200);
    let mut whole = m.new_sequence(512);
    let want = whole.prefill(m, &toks).expect("prefill");
    let mut donor = m.new_sequence(512);
    donor.prefill(m, &toks[..150]).expect("prefill");
    assert!(donor.can_share());
    let prefix = donor.share_prefix(140).expect("share");
    assert_eq!((prefix.len(), prefix.copied(), prefix.tokens()), (140, 140, &toks[..140]));
    assert_eq!(prefix.bytes(), 140 * m.kv_bytes_per_position().expect("a KV cache"));
    assert_eq!((donor.len(), donor.shared_len()), (150, 140));
    assert!(donor.share_prefix(151).is_err(), "more positions than held");
    let mut seq = m.new_sequence(512);
    seq.prefill(m, &toks[..3]).expect("an earlier request");
    seq.attach_prefix(&prefix).expect("attach");
    assert_eq!((seq.tokens(), seq.shared_len()), (&toks[..140], 140));
    let got = seq.prefill(m, &toks[140..]).expect("the rest");
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "logits on the shared prefix differ");
    // A slot image of it holds every position, and restores into a sequence of its own.
    let img = seq.image(m).expect("image");
    let mut back = m.new_sequence(512);
    back.restore_image(m, &img).expect("restore");
    assert_eq!((back.len(), back.shared_len()), (200, 0));
    let (a, b) = (back.decode(m, 9).expect("decode"), seq.decode(m, 9).expect("decode"));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "restored image differs");
    // A rollback into the prefix and a reset let go of it as far as they go.
    seq.rollback(100).expect("rollback");
    assert_eq!(seq.shared_len(), 100);
    seq.reset();
    assert_eq!(seq.shared_len(), 0);
    // A prefix longer than the context is refused, leaving the sequence as it was.
    let mut small = m.new_sequence(64);
    small.prefill(m, &toks[..5]).expect("prefill");
    assert!(small.attach_prefix(&prefix).is_err());
    assert_eq!(small.len(), 5);
}

/// Issue 30: the crate's modules read one another one way (no import circles).
#[test]
fn the_crates_modules_import_one_way_without_circles() {
    tine_test_support::module_graph::assert_one_way(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
}

// Continuous batching on the CPU: `Model::forward_many` over sequences of the default model
// (Q4_K, Q6_K and Q8_0 matrices: the quantized kernels' row paths) against each sequence alone.
#[test]
fn forward_many_gives_each_sequence_its_own_logits_bit_for_bit() {
    let model = real_model();
    assert!(model.batches(), "Gemma 3 on the CPU runs a batch as one forward");
    let prompts = ["The history of the printing press", "Once upon a time", "fn main() {", "Water boils at"];
    let mut batched: Vec<_> = prompts.iter().map(|_| model.new_sequence(256)).collect();
    let mut alone: Vec<_> = prompts.iter().map(|_| model.new_sequence(256)).collect();
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| model.tokenizer.encode(p, true, false)).collect();
    let mut next: Vec<u32> = Vec::new();
    for (i, p) in ids.iter().enumerate() {
        alone[i].prefill(model, p).expect("prefill");
        let last = batched[i].prefill(model, p).expect("prefill");
        next.push(last.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).expect("logits").0 as u32);
    }
    // Rounds of decode rows, one sequence verifying 3 rows, one sitting a round out, a rollback.
    for round in 0..6 {
        let rows: Vec<Vec<u32>> = (0..4).map(|i| if round == 2 && i == 1 { vec![next[i], 7, 9] } else { vec![next[i]] }).collect();
        let active: Vec<usize> = (0..4).filter(|&i| !(round == 3 && i == 2)).collect();
        if round == 4 {
            let len = batched[0].len() - 2;
            batched[0].rollback(len).expect("rollback");
            alone[0].rollback(len).expect("rollback");
        }
        let mut steps: Vec<(&mut tine_runtime::Sequence, &[u32])> = Vec::new();
        for (i, seq) in batched.iter_mut().enumerate() {
            if active.contains(&i) {
                steps.push((seq, &rows[i]));
            }
        }
        let got = model.forward_many(&mut steps).expect("forward_many");
        for (g, &i) in got.iter().zip(&active) {
            let want = alone[i].forward_all(model, &rows[i]).expect("alone");
            assert!(g.data.iter().zip(&want.data).all(|(a, b)| a.to_bits() == b.to_bits()) && g.data.len() == want.data.len(), "round {round}, sequence {i}");
            assert_eq!(batched[i].len(), alone[i].len());
            let last = &g.data[g.data.len() - g.vocab..];
            next[i] = last.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).expect("logits").0 as u32;
        }
    }
    // A step that cannot run (past the vocabulary) changes no sequence.
    let lens: Vec<usize> = batched.iter().map(|s| s.len()).collect();
    let (a, b) = batched.split_at_mut(1);
    let bad = [u32::MAX];
    assert!(model.forward_many(&mut [(&mut a[0], &next[..1]), (&mut b[0], &bad[..])]).is_err());
    assert_eq!(batched.iter().map(|s| s.len()).collect::<Vec<_>>(), lens);
}

// Issue 51: decode rows and verify batches (hidden states or not) of several sequences of the
// default model in one `Model::step_many`, each the bits of its own call.
#[test]
fn step_many_mixes_decode_and_verify_rows_bit_for_bit() {
    let model = real_model();
    let streams: [Vec<u32>; 3] =
        ["The history of the printing press begins in", "Once upon a time, in a small village", "fn main() { let x = 1; println!"].map(|p| model.tokenizer.encode(&p.repeat(3), true, false));
    common::step_many_matches_each_alone(model, &streams);
}
