//! Integration tests of tine-spec (one test binary for the crate): losslessness of every spec
//! type at every depth on synthetic GGUFs in the real layouts, rollback at every accept length,
//! the sampling rule's distribution, and the MTP heads' patches (0011, 0012).

use std::sync::Arc;

use tine_runtime::{Assistant, Model, Sequence};
use tine_sampling::{Sampler, SamplingParams};
use tine_spec::{AssistantDrafter, DraftInput, DraftModelDrafter, DraftParams, Drafter, MtpDrafter, NgramDrafter, SpecError, SpecStats, SpecType, Speculator};
use tine_test_support::qwen35_fixture::{TinyQwen35, TOKENIZER_VOCAB};
use tine_test_support::{TinyAssistant, TinyGemma3};

struct Fixture {
    _dir: tempfile::TempDir,
    target: Arc<Model>,
    cfg: TinyGemma3,
    assistant: Arc<Assistant>,
    draft: Arc<Model>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = TinyGemma3 { nextn: true, seed: 21, ..TinyGemma3::default() };
    let target_path = dir.path().join("target.gguf");
    cfg.write(&target_path);
    let head_path = dir.path().join("assistant.gguf");
    TinyAssistant::default().write(&cfg, &head_path);
    let draft_path = dir.path().join("draft.gguf");
    TinyGemma3 { seed: 99, n_layer: 2, ..TinyGemma3::default() }.write(&draft_path);
    let target = Arc::new(Model::load(&target_path).expect("target loads"));
    let assistant = Arc::new(Assistant::load(&head_path, &target).expect("assistant head loads"));
    let draft = Arc::new(Model::load(&draft_path).expect("draft model loads"));
    Fixture { _dir: dir, target, cfg, assistant, draft }
}

fn prompt() -> Vec<u32> {
    std::iter::once(2).chain((1..12u32).map(|i| 6 + (i * 53) % 280)).collect()
}

fn drafter(fx: &Fixture, kind: SpecType, self_draft: bool) -> Box<dyn Drafter> {
    match kind {
        SpecType::DraftMtp => Box::new(MtpDrafter::new(&fx.target, 256).expect("target has a NextN head")),
        SpecType::DraftAssistant => Box::new(AssistantDrafter::new(fx.assistant.clone())),
        SpecType::Draft => {
            let m = if self_draft { fx.target.clone() } else { fx.draft.clone() };
            Box::new(DraftModelDrafter::new(m, &fx.target, 256).expect("same vocabulary"))
        }
        SpecType::Ngram => Box::new(NgramDrafter { n_min: 1, n_max: 3 }),
    }
}

/// Plain decoding: `n` tokens and the logit row each was chosen from.
fn plain(model: &Model, prompt: &[u32], n: usize, params: SamplingParams) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut seq = model.new_sequence(256);
    let mut sampler = Sampler::new(params);
    let mut logits = seq.prefill(model, prompt).expect("prefill");
    let (mut out, mut rows) = (Vec::new(), Vec::new());
    while out.len() < n {
        let t = sampler.sample(&logits, seq.tokens());
        out.push(t);
        rows.push(logits.clone());
        if out.len() < n {
            logits = seq.decode(model, t).expect("decode");
        }
    }
    (out, rows)
}

/// Speculative decoding of `n` tokens on `seq` (which may hold a prefix), with the rows.
fn speculate_on(model: &Model, seq: &mut Sequence, spec: &mut Speculator, prompt: &[u32], n: usize, params: SamplingParams) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut sampler = Sampler::new(params);
    let keep = seq.tokens().iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len() - 1).min(spec.reusable(prompt));
    // As the generation does: a recurrent state returns only to the positions it recorded.
    let keep = seq.restorable(keep);
    seq.rollback(keep).expect("rollback");
    let logits = spec.prefill(model, seq, &prompt[keep..]).expect("prefill");
    let first = sampler.sample(&logits, seq.tokens());
    let (mut out, mut rows) = (vec![first], vec![logits]);
    while out.len() < n {
        let pending = *out.last().expect("at least one token");
        let round = spec.round(model, seq, pending, &mut sampler, n - out.len(), &mut |_: &mut [f32]| {}).expect("round");
        assert!(round.tokens.len() <= n - out.len(), "a round decided more tokens than asked for");
        out.extend(round.tokens);
        rows.extend(round.rows);
    }
    (out, rows)
}

fn speculate(model: &Model, spec: &mut Speculator, prompt: &[u32], n: usize, params: SamplingParams) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut seq = model.new_sequence(256);
    speculate_on(model, &mut seq, spec, prompt, n, params)
}

fn assert_bit_identical(kind: &str, want: &(Vec<u32>, Vec<Vec<f32>>), got: &(Vec<u32>, Vec<Vec<f32>>)) {
    assert_eq!(got.0, want.0, "{kind}: tokens differ from plain greedy decoding");
    for (i, (a, b)) in want.1.iter().zip(&got.1).enumerate() {
        let differing = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differing, 0, "{kind}: position {i}: {differing} logits differ from plain decoding");
    }
}

#[test]
fn greedy_output_and_logits_are_bit_identical_to_plain_for_every_spec_type_and_depth() {
    let fx = fixture();
    let n = 40;
    let want = plain(&fx.target, &prompt(), n, SamplingParams::greedy());
    for kind in SpecType::ALL {
        for depth in [1, 2, 3, 5] {
            let mut spec = Speculator::new(drafter(&fx, kind, false), DraftParams { n_max: depth, ..DraftParams::default() });
            let got = speculate(&fx.target, &mut spec, &prompt(), n, SamplingParams::greedy());
            assert_bit_identical(&format!("{kind} depth {depth}"), &want, &got);
            assert!(spec.stats.draft_verify_steps > 0, "{kind} depth {depth}: the drafter never drafted");
        }
    }
}

#[test]
fn seeded_sampling_with_speculation_is_plain_sampling_token_for_token_at_every_temperature() {
    // llama.cpp's server test (test_speculative.py::test_with_and_without_draft: temperature
    // 0.2, top_k 5, seed 4242) and hotter settings; every spec type and depth, fixed and
    // adaptive depth.
    let fx = fixture();
    let n = 40;
    let settings = [
        SamplingParams { temperature: 0.2, top_k: 5, seed: Some(4242), ..SamplingParams::default() },
        SamplingParams { temperature: 0.8, seed: Some(7), ..SamplingParams::default() },
        SamplingParams { temperature: 1.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(11), ..SamplingParams::default() },
    ];
    for params in settings {
        let want = plain(&fx.target, &prompt(), n, params.clone());
        let mut kept = 0;
        for (kind, self_draft) in SpecType::ALL.into_iter().map(|k| (k, false)).chain([(SpecType::Draft, true)]) {
            for depth in [1, 2, 4] {
                for adaptive in [false, true] {
                    let mut spec = Speculator::new(drafter(&fx, kind, self_draft), DraftParams { n_max: depth, adaptive, ..DraftParams::default() });
                    let got = speculate(&fx.target, &mut spec, &prompt(), n, params.clone());
                    assert_bit_identical(&format!("{kind} (self {self_draft}) depth {depth} adaptive {adaptive} at T {}", params.temperature), &want, &got);
                    kept += spec.stats.draft_n_accepted;
                }
            }
        }
        assert!(kept > 0, "T {}: no draft was ever kept, so nothing was tested", params.temperature);
    }
}

#[test]
fn a_chain_of_ngram_and_a_model_drafter_gives_plain_decodings_tokens() {
    // A prompt that repeats itself, so the n-gram proposes at times and the model drafter the
    // rest; the model drafter then has to catch up on the hidden states it did not read.
    let fx = fixture();
    let p: Vec<u32> = prompt().into_iter().chain(prompt().into_iter().skip(1)).collect();
    for params in [SamplingParams::greedy(), SamplingParams { temperature: 0.8, seed: Some(3), ..SamplingParams::default() }] {
        let want = plain(&fx.target, &p, 48, params.clone());
        for inner in [SpecType::DraftMtp, SpecType::DraftAssistant, SpecType::Draft] {
            for depth in [1, 3] {
                let chain = tine_spec::ChainDrafter::new(NgramDrafter { n_min: 1, n_max: 3 }, drafter(&fx, inner, false));
                let mut spec = Speculator::new(Box::new(chain), DraftParams { n_max: depth, ..DraftParams::default() });
                let got = speculate(&fx.target, &mut spec, &p, 48, params.clone());
                assert_bit_identical(&format!("ngram,{inner} depth {depth} T {}", params.temperature), &want, &got);
                assert!(spec.stats.draft_n > 0, "ngram,{inner}: nothing drafted");
            }
        }
    }
    // Longer, with single-token n-grams: the n-gram proposes often, so the NextN head must
    // catch up on long backlogs (it fails with OutOfSync if a row is missing).
    let mut chain_spec = Speculator::new(Box::new(tine_spec::ChainDrafter::new(NgramDrafter { n_min: 1, n_max: 1 }, drafter(&fx, SpecType::DraftMtp, false))), DraftParams::default());
    let a = speculate(&fx.target, &mut chain_spec, &p, 64, SamplingParams::greedy());
    assert_bit_identical("ngram,draft-mtp over 64 tokens", &plain(&fx.target, &p, 64, SamplingParams::greedy()), &a);
}

#[test]
fn the_adaptive_depth_drafts_where_it_pays_and_stops_where_it_does_not() {
    use tine_spec::Policy;
    // A verify row costs a fifth of a decode: deep drafts pay when most are kept.
    let mut cheap = Policy::default();
    for _ in 0..8 {
        cheap.record(1, 10.0, 0, 0.0, 0);
        cheap.record(5, 18.0, 4, 0.4, 4);
    }
    assert_eq!(cheap.depth(4), 4, "accept rate {}", cheap.accept_rate());
    // Each row costs a full decode and drafts are mostly rejected: draft nothing...
    let mut dear = Policy::default();
    for _ in 0..8 {
        dear.record(1, 10.0, 0, 0.0, 0);
        dear.record(4, 40.0, 3, 6.0, 0);
    }
    let depths: Vec<usize> = (0..Policy::PROBE_EVERY).map(|_| dear.depth(3)).collect();
    assert!(depths[..depths.len() - 1].iter().all(|&d| d == 0), "{depths:?}");
    // ...but probe now and then, so a turn to predictable text is noticed.
    assert_eq!(depths.last(), Some(&1), "{depths:?}");
    // Before anything is measured, draft the full depth; once drafts were judged but plain
    // decoding's cost never measured (a drafter that always drafts), one round measures it.
    assert_eq!(Policy::default().depth(3), 3);
    let mut unmeasured = Policy::default();
    for _ in 0..8 {
        unmeasured.record(4, 40.0, 3, 6.0, 0);
    }
    assert_eq!(unmeasured.depth(3), 0);
    unmeasured.record(1, 10.0, 0, 0.0, 0);
    assert_eq!(unmeasured.depth(3), 0, "and then it knows drafting does not pay here");
    assert_eq!(Policy::default().depth(0), 0);
}

/// Issue 51: in a batched step the caller's cost model replaces the sequence's own timings. They
/// say a verify row is nearly free (what it cost alone, bound by weight reads); in a batch bound
/// by arithmetic each row costs what a decode row adds, and drafts with a middling acceptance
/// stop; back alone (the model cleared) they pay again.
#[test]
fn the_adaptive_depth_follows_the_batched_steps_cost_model_over_stale_timings() {
    use tine_spec::Policy;
    let mut p = Policy::default();
    for _ in 0..8 {
        p.record(1, 10.0, 0, 0.0, 0);
        p.record(4, 11.0, 3, 0.6, 2);
    }
    assert_eq!(p.depth(3), 3, "alone: rows nearly free, accept rate {}", p.accept_rate());
    // Eight slots: a step costs 11 ms fixed plus 2.4 ms a row, this slot's share of the fixed part
    // an eighth.
    p.set_step_cost(Some((11.0 / 8.0, 2.4)));
    let depths: Vec<usize> = (0..Policy::PROBE_EVERY - 1).map(|_| p.depth(3)).collect();
    assert!(depths.iter().all(|&d| d == 0), "batched: {depths:?}");
    // A fixed part large against the rows (a step still bound by weight reads): drafting pays.
    p.set_step_cost(Some((10.0, 0.3)));
    assert_eq!(p.depth(3), 3);
    p.set_step_cost(None);
    assert_eq!(p.depth(3), 3, "alone again: its own timings");
}

#[test]
fn drafting_with_the_target_itself_accepts_every_token() {
    let fx = fixture();
    for depth in 1..=3 {
        let mut spec = Speculator::new(drafter(&fx, SpecType::Draft, true), DraftParams { n_max: depth, ..DraftParams::default() });
        let got = speculate(&fx.target, &mut spec, &prompt(), 30, SamplingParams::greedy());
        assert_eq!(got.0, plain(&fx.target, &prompt(), 30, SamplingParams::greedy()).0);
        let s = spec.stats;
        assert_eq!(s.draft_n_accepted, s.draft_n, "depth {depth}: {s:?}");
        assert!((s.tau() - (depth + 1) as f64).abs() < 0.5, "depth {depth}: tau {} with every draft accepted", s.tau());
    }
}

/// Replays a script: the first `correct` drafts of every round are the plain continuation,
/// the rest are wrong on purpose.
struct Scripted {
    truth: Vec<u32>,
    prompt_len: usize,
    correct: usize,
    vocab: u32,
}

impl Drafter for Scripted {
    fn spec_type(&self) -> SpecType {
        SpecType::Ngram
    }
    fn draft(&mut self, input: &DraftInput) -> Result<Vec<u32>, SpecError> {
        // The pending token is generated token `g`; drafts are tokens g+1...
        let g = input.target.len() - self.prompt_len;
        Ok((0..input.n_max)
            .map(|i| {
                let t = self.truth.get(g + 1 + i).copied().unwrap_or(0);
                if i < self.correct {
                    t
                } else {
                    (t + 1) % self.vocab
                }
            })
            .collect())
    }
}

#[test]
fn rollback_at_every_partial_accept_length_leaves_the_cache_as_plain_decoding_would() {
    let fx = fixture();
    let n = 24;
    let want = plain(&fx.target, &prompt(), n + 8, SamplingParams::greedy());
    let k = 4;
    for correct in 0..=k {
        let script = Scripted { truth: want.0.clone(), prompt_len: prompt().len(), correct, vocab: fx.target.info.vocab_size as u32 };
        let mut spec = Speculator::new(Box::new(script), DraftParams { n_max: k, ..DraftParams::default() });
        let mut seq = fx.target.new_sequence(256);
        let got = speculate_on(&fx.target, &mut seq, &mut spec, &prompt(), n, SamplingParams::greedy());
        assert_bit_identical(&format!("{correct} of {k} drafts right"), &(want.0[..n].to_vec(), want.1[..n].to_vec()), &got);
        let s = spec.stats;
        // Every round accepts exactly the right drafts (the last round may draft fewer).
        assert!(s.draft_n_accepted <= s.draft_verify_steps * correct && s.draft_n_accepted + correct >= s.draft_verify_steps * correct, "{correct} right per round: {s:?}");
        // The sequence holds exactly the committed tokens; decoding on from it is plain decoding.
        let mut tokens = prompt();
        tokens.extend_from_slice(&got.0[..seq.len() - prompt().len()]);
        assert_eq!(seq.tokens(), tokens.as_slice());
        let next = seq.decode(&fx.target, got.0[seq.len() - prompt().len()]).expect("decode after rounds");
        let at = seq.len() - prompt().len() - 1;
        let differing = next.iter().zip(&want.1[at + 1]).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differing, 0, "{correct} right: the cache after rollback is not plain decoding's");
    }
}

#[test]
fn concurrent_sequences_with_different_spec_types_stay_independent() {
    let fx = fixture();
    let n = 30;
    let prompts = [prompt(), vec![2, 40, 41, 42, 43, 40, 41, 42], vec![2, 7, 7, 9]];
    let want: Vec<_> = prompts.iter().map(|p| plain(&fx.target, p, n, SamplingParams::greedy())).collect();
    // One speculator and one sequence per slot, stepped round-robin, as the server does.
    let mut slots: Vec<(Speculator, Sequence, Sampler, Vec<u32>)> = Vec::new();
    for (i, kind) in [SpecType::DraftMtp, SpecType::DraftAssistant, SpecType::Ngram].into_iter().enumerate() {
        let mut spec = Speculator::new(drafter(&fx, kind, false), DraftParams::default());
        let mut seq = fx.target.new_sequence(256);
        let mut sampler = Sampler::new(SamplingParams::greedy());
        let logits = spec.prefill(&fx.target, &mut seq, &prompts[i]).expect("prefill");
        let first = sampler.sample(&logits, seq.tokens());
        slots.push((spec, seq, sampler, vec![first]));
    }
    while slots.iter().any(|s| s.3.len() < n) {
        for (spec, seq, sampler, out) in slots.iter_mut().filter(|s| s.3.len() < n) {
            let pending = *out.last().expect("token");
            let round = spec.round(&fx.target, seq, pending, sampler, n - out.len(), &mut |_: &mut [f32]| {}).expect("round");
            out.extend(round.tokens);
        }
    }
    for (i, slot) in slots.iter().enumerate() {
        assert_eq!(slot.3, want[i].0, "slot {i} ({})", slot.0.spec_type());
    }
}

#[test]
fn a_new_request_reusing_a_prefix_keeps_the_mtp_state_in_step() {
    let fx = fixture();
    let mut spec = Speculator::new(drafter(&fx, SpecType::DraftMtp, false), DraftParams::default());
    let mut seq = fx.target.new_sequence(256);
    let first = speculate_on(&fx.target, &mut seq, &mut spec, &prompt(), 20, SamplingParams::greedy());
    // The next request continues the conversation, then one that shares only part of the prompt.
    let mut longer = prompt();
    longer.extend_from_slice(&first.0[..10]);
    longer.extend_from_slice(&[50, 51]);
    for p in [longer, prompt()[..6].iter().copied().chain([9, 9, 9]).collect()] {
        let got = speculate_on(&fx.target, &mut seq, &mut spec, &p, 20, SamplingParams::greedy());
        assert_eq!(got.0, plain(&fx.target, &p, 20, SamplingParams::greedy()).0);
    }
}

/// Pearson's chi-square of observed counts against expected probabilities.
fn chi_square(counts: &[usize], probs: &[f64], n: usize) -> f64 {
    counts.iter().zip(probs).map(|(&c, &p)| (c as f64 - n as f64 * p).powi(2) / (n as f64 * p)).sum()
}

#[test]
fn sampling_with_speculation_keeps_the_exact_next_token_distribution() {
    // Temperature 1 over the top 4 tokens: the joint law of the first two sampled tokens is
    // computed exactly from the target, then compared with what speculative sampling produced
    // over 3000 seeds. df = 15; the 0.1% critical value is 37.7. The drafts come from the target
    // itself (its argmax: accepted with probability p) and from n-gram lookup.
    let fx = fixture();
    let params = |seed| SamplingParams { temperature: 1.0, top_k: 4, top_p: 1.0, min_p: 0.0, seed: Some(seed), ..SamplingParams::default() };
    let p = prompt();
    let sampler = Sampler::new(params(0));
    let mut seq = fx.target.new_sequence(64);
    let logits = seq.prefill(&fx.target, &p).expect("prefill");
    let first = sampler.distribution(&logits, seq.tokens());
    let mut cells: Vec<((u32, u32), f64)> = Vec::new();
    for &(t1, p1) in &first {
        seq.rollback(p.len()).expect("rollback");
        let l2 = seq.decode(&fx.target, t1).expect("decode");
        for (t2, p2) in sampler.distribution(&l2, seq.tokens()) {
            cells.push(((t1, t2), p1 as f64 * p2 as f64));
        }
    }
    assert_eq!(cells.len(), 16);
    let n = 3000;
    for (kind, self_draft) in [(SpecType::Draft, true), (SpecType::Draft, false), (SpecType::Ngram, false)] {
        let mut counts = vec![0usize; cells.len()];
        let mut stats = SpecStats::default();
        for seed in 0..n {
            let mut spec = Speculator::new(drafter(&fx, kind, self_draft), DraftParams { n_max: 2, ..DraftParams::default() });
            // Three tokens: the second is decided on a draft in the first round.
            let (out, _) = speculate(&fx.target, &mut spec, &p, 3, params(seed as u64));
            let cell = cells.iter().position(|c| c.0 == (out[0], out[1])).expect("a sampled pair outside the support");
            counts[cell] += 1;
            stats.add(&spec.stats);
        }
        let probs: Vec<f64> = cells.iter().map(|c| c.1).collect();
        let x2 = chi_square(&counts, &probs, n);
        assert!(x2 < 37.7, "{kind} (self draft {self_draft}): chi-square {x2:.1} over 15 df: the distribution changed");
        if self_draft {
            assert!(stats.draft_n_accepted > 0 && stats.draft_n_accepted < stats.draft_n, "both branches exercised: {stats:?}");
        }
    }
}

#[test]
fn nextn_state_leaves_the_trunk_unchanged_chains_like_a_batch_and_reports_reuse() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (with, without) = (dir.path().join("with.gguf"), dir.path().join("without.gguf"));
    let cfg = TinyGemma3 { seed: 5, ..TinyGemma3::default() };
    TinyGemma3 { nextn: true, ..cfg.clone() }.write(&with);
    cfg.write(&without);
    let (a, b) = (Model::load(&with).expect("nextn model"), Model::load(&without).expect("plain model"));
    assert!(a.has_nextn() && !b.has_nextn());
    let p = prompt();
    let (mut sa, mut sb) = (a.new_sequence(64), b.new_sequence(64));
    let (la, hidden) = sa.prefill_hidden(&a, &p).expect("prefill with hidden");
    assert_eq!(la, sb.prefill(&b, &p).expect("prefill"), "the head must not change the trunk's logits");
    // Entries 0..n-1 in one batch equal the same entries fed one at a time.
    let next: Vec<u32> = p[1..].iter().copied().chain([9]).collect();
    let mut batch = a.new_nextn_state(64).expect("state");
    let (lb, hb) = batch.forward(&a, p[0], &hidden, &next).expect("batch");
    let mut single = a.new_nextn_state(64).expect("state");
    let mut last = (Vec::new(), None);
    for i in 0..next.len() {
        let (l, h) = single.forward(&a, p[0], &hidden.rows(i, 1).expect("row"), &next[i..=i]).expect("step");
        last = (l, Some(h));
    }
    let max = lb.iter().zip(&last.0).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(max < 1e-4, "batched vs stepped NextN logits differ by {max}");
    assert_eq!(hb.positions(), next.len());
    assert!(single.reusable(&p) == p.len() - 1 && single.reusable(&[2, 1]) == 0);
}

#[test]
fn assistant_drafting_is_lossless_in_both_namings_and_mismatches_are_clear_errors() {
    let fx = fixture();
    let dir = tempfile::tempdir().expect("tempdir");
    let variant = dir.path().join("variant.gguf");
    TinyAssistant { variant_names: true, ..TinyAssistant::default() }.write(&fx.cfg, &variant);
    let head = Arc::new(Assistant::load(&variant, &fx.target).expect("gemma4_assistant / mtp.* naming loads"));
    let mut spec = Speculator::new(Box::new(AssistantDrafter::new(head)), DraftParams::default());
    let got = speculate(&fx.target, &mut spec, &prompt(), 20, SamplingParams::greedy());
    assert_eq!(got.0, plain(&fx.target, &prompt(), 20, SamplingParams::greedy()).0);
    // A head for a wider target is refused with the dimensions named.
    let wide = dir.path().join("wide.gguf");
    TinyAssistant::default().write(&TinyGemma3 { n_embd: 48, ..fx.cfg.clone() }, &wide);
    let err = Assistant::load(&wide, &fx.target).err().expect("a mismatched head must not load");
    let chain = format!("{err}: {}", std::error::Error::source(&err).map(|s| s.to_string()).unwrap_or_default());
    assert!(chain.contains("48") && chain.contains("32"), "{chain}");
    // draft-mtp on a target without a head is a clear error.
    assert!(matches!(MtpDrafter::new(&fx.draft, 64), Err(SpecError::NoNextN(_))));
}

#[test]
fn a_request_chooses_among_the_drafters_its_server_can_serve_and_each_is_lossless() {
    use tine_spec::{SpecChoice, SpecConfig, SpecFactory};
    // Names: Tine's and llama.cpp's, chains as `--spec-type` spells them, and the off switch.
    for (text, want) in [
        ("none", SpecChoice::Off),
        ("off", SpecChoice::Off),
        ("ngram", SpecChoice::of(SpecType::Ngram)),
        ("ngram-simple", SpecChoice::of(SpecType::Ngram)),
        ("draft-mtp", SpecChoice::of(SpecType::DraftMtp)),
        ("ngram,draft-mtp", SpecChoice::On { spec_type: SpecType::DraftMtp, ngram_first: true }),
        ("ngram,ngram", SpecChoice::of(SpecType::Ngram)),
    ] {
        assert_eq!(text.parse::<SpecChoice>(), Ok(want), "{text}");
    }
    for bad in ["", "eagle", "draft-mtp,ngram", "ngram,", "ngram,nope"] {
        assert!(bad.parse::<SpecChoice>().is_err(), "{bad:?} must be refused");
    }
    assert_eq!(SpecChoice::On { spec_type: SpecType::Draft, ngram_first: true }.to_string(), "ngram,draft");

    let fx = fixture();
    // A server started with n-grams serves NextN too (the target carries the head), but neither
    // the assistant nor a draft model: those are loaded at start-up.
    let ngram = SpecFactory::load(SpecConfig::new(SpecType::Ngram), &fx.target).expect("n-grams load nothing");
    assert_eq!(ngram.offers(&fx.target), vec![SpecChoice::Off, SpecChoice::of(SpecType::Ngram), SpecChoice::of(SpecType::DraftMtp)]);
    for t in [SpecType::DraftAssistant, SpecType::Draft] {
        assert!(!ngram.serves(SpecChoice::of(t), &fx.target), "{t}");
        assert!(matches!(ngram.speculator_for(SpecChoice::of(t), &fx.target, 256), Err(SpecError::NotLoaded(_))), "{t}");
    }
    // A target without a NextN head offers no draft-mtp.
    let on_draft = SpecFactory::load(SpecConfig::new(SpecType::Ngram), &fx.draft).expect("loads");
    assert!(!on_draft.serves(SpecChoice::of(SpecType::DraftMtp), &fx.draft));
    // A server with an assistant head: its default (a chain) first, then the rest.
    let dir = tempfile::tempdir().expect("tempdir");
    let head = dir.path().join("assistant.gguf");
    TinyAssistant::default().write(&fx.cfg, &head);
    let config = SpecConfig { mtp_head: Some(head), ngram_first: true, ..SpecConfig::new(SpecType::DraftAssistant) };
    let factory = SpecFactory::load(config, &fx.target).expect("the head loads");
    let chain = SpecChoice::On { spec_type: SpecType::DraftAssistant, ngram_first: true };
    assert_eq!(factory.default_choice(), chain);
    let offers = factory.offers(&fx.target);
    assert_eq!(&offers[..2], &[SpecChoice::Off, chain]);
    assert!(offers.contains(&SpecChoice::of(SpecType::DraftAssistant)) && offers.contains(&SpecChoice::of(SpecType::Ngram)) && !offers.contains(&SpecChoice::of(SpecType::Draft)), "{offers:?}");
    // Each choice's speculator gives plain decoding's tokens and logits; off gives none.
    assert!(factory.speculator_for(SpecChoice::Off, &fx.target, 256).expect("off").is_none());
    let want = plain(&fx.target, &prompt(), 24, SamplingParams::greedy());
    for choice in offers.into_iter().skip(1) {
        let mut spec = factory.speculator_for(choice, &fx.target, 256).expect("served").expect("drafts");
        assert_bit_identical(&choice.to_string(), &want, &speculate(&fx.target, &mut spec, &prompt(), 24, SamplingParams::greedy()));
    }
}

#[test]
fn ngram_lookup_proposes_the_continuation_of_the_longest_recent_match() {
    let d = NgramDrafter { n_min: 1, n_max: 3 };
    // "a b c d x a b c" -> the 3-gram "a b c" occurred before, followed by "d x a".
    assert_eq!(d.lookup(&[1, 2, 3, 4, 9, 1, 2, 3], 3), vec![4, 9, 1]);
    // The most recent occurrence wins; no match, no draft.
    assert_eq!(d.lookup(&[5, 6, 1, 5, 7, 5], 2), vec![7, 5]);
    assert_eq!(d.lookup(&[1, 2, 3], 3), Vec::<u32>::new());
}

#[test]
fn equivalence_figures_are_zero_for_identical_rows_and_count_only_real_flips() {
    use tine_spec::equivalence::compare;
    let rows = vec![vec![3.0, 1.0, 0.0], vec![0.0, 2.0, 1.9]];
    let e = compare((&[0, 1], &rows), (&[0, 1], &rows), 0.7);
    assert!(e.is_exact() && e.positions == 2, "{e:?}");
    // Position 1 is a near-tie (margin 0.1): flipping it is benign; flipping position 0 is real.
    let flipped_tie = vec![rows[0].clone(), vec![0.0, 1.9, 2.0]];
    let e = compare((&[0, 1], &rows), (&[0, 2], &flipped_tie), 0.7);
    assert_eq!((e.real_disagreements, e.tokens_identical), (0, false), "{e:?}");
    let flipped_real = vec![vec![1.0, 3.0, 0.0], rows[1].clone()];
    let e = compare((&[0, 1], &rows), (&[1, 1], &flipped_real), 0.7);
    assert_eq!((e.positions, e.real_disagreements, e.real_frac), (1, 1, 1.0), "{e:?}");
    assert!((e.max_abs_logit_diff - 2.0).abs() < 1e-9);
}

// ---- The default model (fetched by `cargo xtask fetch-model`, which `cargo xtask ci` runs) ----

fn real_model() -> &'static Arc<Model> {
    static MODEL: std::sync::OnceLock<Arc<Model>> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| {
        let path = tine_runtime::default_model_path();
        assert!(path.exists(), "the default model is not cached at {}: run `cargo xtask fetch-model`", path.display());
        Arc::new(Model::load(&path).expect("the default model loads"))
    })
}

#[test]
fn real_model_drafting_with_itself_accepts_every_token_and_ngram_accepts_most_of_a_copy() {
    let model = real_model();
    let prompt =
        model.tokenizer.encode("Copy this line exactly, three times:\nThe quick brown fox jumps over the lazy dog.\nThe quick brown fox jumps over the lazy dog.\nThe quick brown fox", true, true);
    let n = 32;
    let mut seq = model.new_sequence(256);
    let want = {
        let mut sampler = Sampler::new(SamplingParams::greedy());
        let mut logits = seq.prefill(model, &prompt).expect("prefill");
        let mut out = Vec::new();
        while out.len() < n {
            let t = sampler.sample(&logits, seq.tokens());
            out.push(t);
            logits = seq.decode(model, t).expect("decode");
        }
        out
    };
    let self_draft = DraftModelDrafter::new(model.clone(), model, 256).expect("same vocabulary");
    let mut spec = Speculator::new(Box::new(self_draft), DraftParams::default());
    let got = speculate(model, &mut spec, &prompt, n, SamplingParams::greedy());
    assert_eq!(got.0, want);
    assert_eq!(spec.stats.draft_n_accepted, spec.stats.draft_n, "{:?}", spec.stats);
    let mut spec = Speculator::new(Box::new(NgramDrafter::default()), DraftParams::default());
    let got = speculate(model, &mut spec, &prompt, n, SamplingParams::greedy());
    assert_eq!(got.0, want);
    assert!(spec.stats.accept_rate() > 0.6, "ngram on a copy: {:?}", spec.stats);
}

/// `src` with extra metadata, rewritten tensor by tensor to `dst`.
fn with_metadata(src: &std::path::Path, dst: &std::path::Path, extra: Vec<(&str, candle_core::quantized::gguf_file::Value)>) {
    use candle_core::quantized::gguf_file;
    let mut f = std::fs::File::open(src).expect("open");
    let ct = gguf_file::Content::read(&mut f).expect("read");
    let names: Vec<String> = ct.tensor_infos.keys().cloned().collect();
    let tensors: Vec<_> = names.iter().map(|n| ct.tensor(&mut f, n, &candle_core::Device::Cpu).expect("tensor")).collect();
    let mut md: Vec<(&str, &gguf_file::Value)> = ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    md.extend(extra.iter().map(|(k, v)| (*k, v)));
    gguf_file::write(&mut std::fs::File::create(dst).expect("create"), &md, &names.iter().map(String::as_str).zip(tensors.iter()).collect::<Vec<_>>()).expect("write");
}

#[test]
fn a_nextn_head_with_a_permuted_draft_vocabulary_drafts_exactly_the_same_tokens() {
    // Row i of the reduced head scores token vocab[i]; with every token present in another order
    // the drafts must equal the full head's.
    use candle_core::quantized::gguf_file::Value;
    let fx = fixture();
    let path = fx._dir.path().join("permuted.gguf");
    let n_vocab = tine_test_support::vocab().len() as u32;
    let vocab: Vec<u32> = (0..n_vocab).rev().collect();
    with_metadata(&fx._dir.path().join("target.gguf"), &path, vec![("gemma3.nextn.draft_vocab", Value::Array(vocab.iter().map(|&i| Value::U32(i)).collect()))]);
    let permuted = Arc::new(Model::load(&path).expect("loads"));
    assert_eq!(permuted.nextn_draft_vocab(), Some(vocab.as_slice()));
    let drafts = |m: &Arc<Model>| {
        let mut seq = m.new_sequence(256);
        let p = prompt();
        let (logits, hidden) = seq.prefill_hidden(m, &p).expect("prefill");
        let pending = tine_sampling::argmax(&logits);
        let input = DraftInput { model: m, target: &seq, pending, hidden: Some(&hidden), hidden_start: 0, n_max: 5, p_min: 0.0 };
        MtpDrafter::new(m, 256).expect("head").draft(&input).expect("draft")
    };
    let (full, reduced) = (drafts(&fx.target), drafts(&permuted));
    assert_eq!(full.len(), 5);
    assert_eq!(full, reduced, "the reduced head must draft the full head's tokens");
}

/// A Qwen3.5 target with its NextN head (dense, or MoE with 1 key / 3 value heads) and a
/// smaller qwen35 draft model of the same vocabulary.
struct Qwen35Fixture {
    _dir: tempfile::TempDir,
    target: Arc<Model>,
    draft: Arc<Model>,
}

fn qwen35_fixture(moe: bool) -> Qwen35Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = TinyQwen35 { vocab: TOKENIZER_VOCAB, tokenizer: true, ..TinyQwen35::default() };
    let cfg = if moe { TinyQwen35 { n_k_heads: 1, n_v_heads: 3, full_attention_interval: 2, ..TinyQwen35 { vocab: TOKENIZER_VOCAB, tokenizer: true, ..TinyQwen35::moe() } } } else { base.clone() };
    let target_path = dir.path().join("target.gguf");
    TinyQwen35 { nextn: true, seed: 31, ..cfg }.write(&target_path);
    let draft_path = dir.path().join("draft.gguf");
    TinyQwen35 { n_layer: 2, full_attention_interval: 2, seed: 77, ..base }.write(&draft_path);
    Qwen35Fixture { _dir: dir, target: Arc::new(Model::load(&target_path).expect("target loads")), draft: Arc::new(Model::load(&draft_path).expect("draft loads")) }
}

fn qwen35_drafter(fx: &Qwen35Fixture, kind: SpecType) -> Option<Box<dyn Drafter>> {
    Some(match kind {
        SpecType::DraftMtp => Box::new(MtpDrafter::new(&fx.target, 256).expect("target has a NextN head")),
        SpecType::Draft => Box::new(DraftModelDrafter::new(fx.draft.clone(), &fx.target, 256).expect("same vocabulary")),
        SpecType::Ngram => Box::new(NgramDrafter { n_min: 1, n_max: 3 }),
        // Assistant heads are Gemma 3's (refused at load: tine-runtime's tests).
        SpecType::DraftAssistant => return None,
    })
}

fn qwen35_prompt() -> Vec<u32> {
    // Repeats itself, so the n-gram drafter proposes too.
    let head: Vec<u32> = (0..10u32).map(|i| (i * 41 + 7) % 256).collect();
    head.iter().chain(&head).copied().collect()
}

#[test]
fn qwen35_greedy_and_seeded_speculation_is_plain_decoding_bit_for_bit_with_recurrent_rollback() {
    for moe in [false, true] {
        let fx = qwen35_fixture(moe);
        let n = 32;
        for params in [SamplingParams::greedy(), SamplingParams { temperature: 0.8, seed: Some(7), ..SamplingParams::default() }] {
            let want = plain(&fx.target, &qwen35_prompt(), n, params.clone());
            let mut drafted = 0;
            for kind in SpecType::ALL {
                for (depth, adaptive) in [(1, false), (3, false), (5, false), (3, true)] {
                    let Some(d) = qwen35_drafter(&fx, kind) else { continue };
                    let mut spec = Speculator::new(d, DraftParams { n_max: depth, adaptive, ..DraftParams::default() });
                    let got = speculate(&fx.target, &mut spec, &qwen35_prompt(), n, params.clone());
                    assert_bit_identical(&format!("qwen35 (moe {moe}) {kind} depth {depth} adaptive {adaptive} T {}", params.temperature), &want, &got);
                    drafted += spec.stats.draft_n;
                }
            }
            assert!(drafted > 0, "nothing was drafted, so nothing was tested");
        }
    }
}

/// Issue 29: Qwen3.5 with its attention layers and NextN head in other cache types (heads of 32
/// values: whole q8_0/q4_0 blocks), the draft model in its own types. Within a type every spec
/// type is plain decoding bit for bit, greedy and seeded; and the type is in effect.
#[test]
fn qwen35_speculation_is_lossless_within_each_kv_cache_type() {
    use tine_runtime::KvType;
    // Heads of 32 values for the block types; of 128 for the rotated ones (issue 53).
    qwen35_lossless_within(32, &[(KvType::F16, KvType::F16), (KvType::Q8_0, KvType::Q8_0), (KvType::Q4_0, KvType::Q4_0), (KvType::Q8_0, KvType::Q4_0)]);
    qwen35_lossless_within(128, &[(KvType::Turbo3, KvType::Turbo3), (KvType::Turbo4, KvType::Turbo2)]);
}

fn qwen35_lossless_within(head_dim: usize, types: &[(tine_runtime::KvType, tine_runtime::KvType)]) {
    use tine_runtime::KvType;
    let dir = tempfile::tempdir().expect("tempdir");
    let base = TinyQwen35 { vocab: TOKENIZER_VOCAB, tokenizer: true, head_dim, ..TinyQwen35::default() };
    let (target_path, draft_path) = (dir.path().join("target.gguf"), dir.path().join("draft.gguf"));
    TinyQwen35 { nextn: true, full_attention_interval: 2, seed: 31, ..base.clone() }.write(&target_path);
    TinyQwen35 { n_layer: 2, full_attention_interval: 2, seed: 77, ..base }.write(&draft_path);
    let f32_logits = plain(&Model::load(&target_path).expect("target loads"), &qwen35_prompt(), 16, SamplingParams::greedy()).1;
    for &(k, v) in types {
        let mut target = Model::load(&target_path).expect("target loads");
        target.set_cache_types(k, v).expect("Qwen3.5 on the CPU keeps every type");
        let mut draft = Model::load(&draft_path).expect("draft loads");
        draft.set_cache_types(KvType::Q4_0, KvType::F16).expect("the draft model's own types");
        let fx = Qwen35Fixture { _dir: tempfile::tempdir().expect("tempdir"), target: Arc::new(target), draft: Arc::new(draft) };
        let greedy = plain(&fx.target, &qwen35_prompt(), 16, SamplingParams::greedy());
        assert!(greedy.1.iter().zip(&f32_logits).any(|(a, b)| a != b), "K {k} V {v}: logits equal the f32 cache's, so the type is not in effect");
        let mut drafted = 0;
        for params in [SamplingParams::greedy(), SamplingParams { temperature: 0.8, seed: Some(7), ..SamplingParams::default() }] {
            let want = plain(&fx.target, &qwen35_prompt(), 16, params.clone());
            for kind in [SpecType::DraftMtp, SpecType::Draft, SpecType::Ngram] {
                let d = qwen35_drafter(&fx, kind).expect("a drafter");
                let mut spec = Speculator::new(d, DraftParams { n_max: 3, ..DraftParams::default() });
                let got = speculate(&fx.target, &mut spec, &qwen35_prompt(), 16, params.clone());
                assert_bit_identical(&format!("qwen35 K {k} V {v}, {kind}, T {}", params.temperature), &want, &got);
                drafted += spec.stats.draft_n;
            }
        }
        assert!(drafted > 0, "K {k} V {v}: nothing was drafted, so nothing was tested");
    }
}

#[test]
fn qwen35_rollback_at_every_partial_accept_length_leaves_the_state_as_plain_decoding_would() {
    let fx = qwen35_fixture(false);
    let (n, k) = (20, 4);
    let prompt = qwen35_prompt();
    let want = plain(&fx.target, &prompt, n + 8, SamplingParams::greedy());
    for correct in 0..=k {
        let script = Scripted { truth: want.0.clone(), prompt_len: prompt.len(), correct, vocab: fx.target.info.vocab_size as u32 };
        let mut spec = Speculator::new(Box::new(script), DraftParams { n_max: k, ..DraftParams::default() });
        let mut seq = fx.target.new_sequence(256);
        let got = speculate_on(&fx.target, &mut seq, &mut spec, &prompt, n, SamplingParams::greedy());
        assert_bit_identical(&format!("qwen35: {correct} of {k} drafts right"), &(want.0[..n].to_vec(), want.1[..n].to_vec()), &got);
        let next = seq.decode(&fx.target, got.0[seq.len() - prompt.len()]).expect("decode after rounds");
        let at = seq.len() - prompt.len() - 1;
        assert!(next.iter().zip(&want.1[at + 1]).all(|(x, y)| x.to_bits() == y.to_bits()), "qwen35, {correct} right: the recurrent state after the rollbacks is not plain decoding's");
    }
}

#[test]
fn qwen35_a_new_request_sharing_the_prompt_restarts_from_its_checkpoint_with_the_mtp_state_in_step() {
    let fx = qwen35_fixture(false);
    let mut spec = Speculator::new(qwen35_drafter(&fx, SpecType::DraftMtp).expect("mtp"), DraftParams::default());
    let mut seq = fx.target.new_sequence(256);
    let first = speculate_on(&fx.target, &mut seq, &mut spec, &qwen35_prompt(), 16, SamplingParams::greedy());
    let mut longer = qwen35_prompt();
    longer.extend_from_slice(&first.0[..6]);
    longer.extend_from_slice(&[50, 51]);
    for p in [longer, qwen35_prompt()[..6].iter().copied().chain([9, 9, 9]).collect()] {
        let got = speculate_on(&fx.target, &mut seq, &mut spec, &p, 16, SamplingParams::greedy());
        assert_eq!(got.0, plain(&fx.target, &p, 16, SamplingParams::greedy()).0);
    }
}
