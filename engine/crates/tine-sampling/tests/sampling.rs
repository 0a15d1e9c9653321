//! Integration tests of tine-sampling (one test binary for the crate).

use tine_sampling::{argmax, top_logprobs, Sampler, SamplingParams};

#[test]
fn greedy_takes_the_argmax_and_the_lowest_id_on_ties() {
    assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
    let mut s = Sampler::new(SamplingParams::greedy());
    assert_eq!(s.sample(&[0.0, 1.0, 5.0, 5.0], &[]), 2);
}

#[test]
fn a_fixed_seed_repeats_the_stream() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let params = SamplingParams { seed: Some(42), top_k: 0, top_p: 1.0, min_p: 0.0, temperature: 1.0, ..Default::default() };
    let a: Vec<u32> = {
        let mut s = Sampler::new(params.clone());
        (0..20).map(|_| s.sample(&logits, &[])).collect()
    };
    let b: Vec<u32> = {
        let mut s = Sampler::new(params);
        (0..20).map(|_| s.sample(&logits, &[])).collect()
    };
    assert_eq!(a, b);
}

#[test]
fn filters_match_llama_cpp_semantics() {
    // logits ln(p) for p = 0.5, 0.25, 0.15, 0.1
    let logits: Vec<f32> = [0.5f32, 0.25, 0.15, 0.1].iter().map(|p| p.ln()).collect();
    let dist = |params: SamplingParams| Sampler::new(params).distribution(&logits, &[]).iter().map(|d| d.0).collect::<Vec<_>>();
    let base = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, ..Default::default() };
    assert_eq!(dist(SamplingParams { top_k: 2, ..base.clone() }), [0, 1]);
    // top-p keeps the smallest prefix reaching p: 0.5 + 0.25 >= 0.7.
    assert_eq!(dist(SamplingParams { top_p: 0.7, ..base.clone() }), [0, 1]);
    // min-p keeps p >= min_p * p_max: 0.1 < 0.25 * 0.5.
    assert_eq!(dist(SamplingParams { min_p: 0.25, ..base.clone() }), [0, 1, 2]);
    let probs = Sampler::new(base).distribution(&logits, &[]);
    assert!((probs[0].1 - 0.5).abs() < 1e-6 && (probs[3].1 - 0.1).abs() < 1e-6, "{probs:?}");
}

#[test]
fn penalties_follow_llama_cpp() {
    let params = SamplingParams { temperature: 0.0, repeat_penalty: 2.0, presence_penalty: 0.5, frequency_penalty: 0.25, repeat_last_n: 64, ..Default::default() };
    // Token 0 (logit 4, seen twice): 4 / 2 - 2 * 0.25 - 0.5 = 1.0 < token 1's 1.5.
    let mut s = Sampler::new(params);
    assert_eq!(s.sample(&[4.0, 1.5, -3.0], &[0, 0]), 1);
    // A negative logit is multiplied: -3 * 2 - 0.25 - 0.5.
    let d = s.distribution(&[4.0, 1.5, -3.0], &[2]);
    assert_eq!(d, vec![(0, 1.0)]);
}

#[test]
fn top_logprobs_are_normalised_and_sorted() {
    let lp = top_logprobs(&[0.0, 2.0, 1.0], 2);
    assert_eq!(lp.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 2]);
    let total: f32 = [0.0f32, 2.0, 1.0].iter().map(|l| (l - 2.0).exp()).sum();
    assert!((lp[0].1 - (1.0 / total).ln()).abs() < 1e-6);
}

#[test]
fn bad_params_are_named() {
    let p = SamplingParams { top_p: 1.5, ..Default::default() };
    assert_eq!(p.validate().expect_err("invalid").to_string(), "top_p must lie in [0, 1], got 1.5");
}
