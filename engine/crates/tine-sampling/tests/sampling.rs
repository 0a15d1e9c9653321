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

/// The distribution as the sampler computed it before its one-pass top-k: every candidate
/// sorted by (logit desc by `total_cmp`, id asc), cut at top_k, then top-p, min-p, temperature.
fn reference_distribution(p: &SamplingParams, logits: &[f32]) -> Vec<(u32, f32)> {
    let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        cand.truncate(p.top_k as usize);
    }
    if p.top_p < 1.0 {
        let probs = tine_sampling::softmax(&cand.iter().map(|c| c.1).collect::<Vec<_>>());
        let mut cum = 0.0f32;
        let mut keep = cand.len();
        for (i, pr) in probs.iter().enumerate() {
            cum += pr;
            if cum >= p.top_p {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep.max(1));
    }
    if p.min_p > 0.0 && !cand.is_empty() {
        let threshold = cand[0].1 + p.min_p.ln();
        let keep = cand.iter().take_while(|c| c.1 >= threshold).count().max(1);
        cand.truncate(keep);
    }
    let probs = tine_sampling::softmax(&cand.iter().map(|c| c.1 / p.temperature).collect::<Vec<_>>());
    cand.iter().zip(probs).map(|(c, pr)| (c.0, pr)).collect()
}

/// A reproducible stream of u64 (xorshift64).
fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

#[test]
fn the_one_pass_top_k_gives_the_full_sorts_distribution_bit_for_bit_with_ties() {
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    for case in 0..200 {
        let n = [5usize, 64, 1000, 4099][case % 4];
        // Few distinct values, so ties are everywhere; some -inf (banned ids, a grammar's mask).
        let logits: Vec<f32> = match case % 5 {
            // Rising logits: every value improves on the kept set (the pass gives up for a
            // selection over the row).
            4 => (0..n).map(|i| i as f32 * 1e-3).collect(),
            _ => (0..n)
                .map(|_| match next() % 11 {
                    0 => f32::NEG_INFINITY,
                    r => (r as f32) * 0.5 - (next() % 3) as f32,
                })
                .collect(),
        };
        for top_k in [1, 2, 40, n as i32 - 1, n as i32, 0] {
            for (top_p, min_p, temperature) in [(1.0, 0.0, 0.8), (0.95, 0.05, 0.8), (0.5, 0.0, 1.3)] {
                let params = SamplingParams { temperature, top_k, top_p, min_p, ..Default::default() };
                let got = Sampler::new(params.clone()).distribution(&logits, &[]);
                let want = reference_distribution(&params, &logits);
                assert_eq!(got.len(), want.len(), "case {case}: top_k {top_k}");
                for (g, w) in got.iter().zip(&want) {
                    assert!(g.0 == w.0 && g.1.to_bits() == w.1.to_bits(), "case {case}, top_k {top_k}: {g:?} against {w:?}");
                }
            }
        }
    }
}

/// A draw from a row's `top_k` best logits (found elsewhere: on the GPU) is the draw from the row,
/// bit for bit and on the same random stream, with ties at the cut and in any order.
#[test]
fn sampling_from_the_top_k_candidates_draws_what_sampling_the_row_draws() {
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    for case in 0..40 {
        let n = 1000 + case * 37;
        // Coarse values, so ties (at the cut too) are common.
        let row: Vec<f32> = (0..n).map(|_| (next() % 64) as f32 * 0.25 - 8.0).collect();
        for top_k in [1, 2, 40, 64] {
            let params = SamplingParams { top_k, seed: Some(case as u64), ..Default::default() };
            assert_eq!(params.top_k_only(64), Some(top_k as usize));
            let mut cand: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            cand.truncate(top_k as usize);
            cand.reverse(); // any order
            let (mut a, mut b) = (Sampler::new(params.clone()), Sampler::new(params.clone()));
            let full = a.distribution(&row, &[]);
            let from_top = b.distribution_top_k(cand.clone());
            assert_eq!(full.len(), from_top.len());
            assert!(full.iter().zip(&from_top).all(|(x, y)| x.0 == y.0 && x.1.to_bits() == y.1.to_bits()), "case {case}, top_k {top_k}");
            for _ in 0..5 {
                assert_eq!(a.sample(&row, &[]), b.sample_top_k(cand.clone()));
            }
        }
    }
    // Where the row alone can decide: not greedy, no penalty, top_k within the bound.
    assert_eq!(SamplingParams::greedy().top_k_only(64), None);
    assert_eq!(SamplingParams { top_k: 0, ..Default::default() }.top_k_only(64), None);
    assert_eq!(SamplingParams { top_k: 65, ..Default::default() }.top_k_only(64), None);
    assert_eq!(SamplingParams { repeat_penalty: 1.1, ..Default::default() }.top_k_only(64), None);
}
