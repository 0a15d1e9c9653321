//! Logit equivalence between plain and speculative decoding: the seeds' `real_frac` gate,
//! computed over the logit rows each emitted token was chosen from.

use tine_sampling::top_logprobs;

/// How many top log-probabilities each position compares.
pub const TOP_N: usize = 20;

/// The figures of one plain-vs-spec comparison. With a bit-exact verify, all are zero (and
/// `frac_full_agree` is one).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Equivalence {
    /// Positions compared: the shared prefix of the two token streams (plus the first
    /// differing position, whose row still had the same history).
    pub positions: usize,
    /// Positions where the argmax differs and plain decoding's top-2 margin is at least the
    /// tie margin (a near-tie flip is benign in engines that are not bit-exact).
    pub real_disagreements: usize,
    pub real_frac: f64,
    /// Positions whose top-20 token ids agree, in order.
    pub frac_full_agree: f64,
    /// Mean absolute difference of the top-1 log-probability.
    pub mean_top1_mae: f64,
    /// Largest absolute difference of any logit.
    pub max_abs_logit_diff: f64,
    /// The token streams are identical.
    pub tokens_identical: bool,
}

impl Equivalence {
    /// Every figure exactly at its lossless value.
    pub fn is_exact(&self) -> bool {
        self.tokens_identical && self.real_disagreements == 0 && self.frac_full_agree == 1.0 && self.mean_top1_mae == 0.0 && self.max_abs_logit_diff == 0.0
    }
}

/// Compares plain tokens/rows with speculative ones; `tie_margin` in nats.
pub fn compare(plain: (&[u32], &[Vec<f32>]), spec: (&[u32], &[Vec<f32>]), tie_margin: f32) -> Equivalence {
    let shared = plain.0.iter().zip(spec.0).take_while(|(a, b)| a == b).count();
    let positions = (shared + 1).min(plain.1.len()).min(spec.1.len());
    let (mut real, mut full, mut mae, mut max_diff) = (0usize, 0usize, 0f64, 0f64);
    for i in 0..positions {
        let (a, b) = (&plain.1[i], &spec.1[i]);
        let (ta, tb) = (top_logprobs(a, TOP_N), top_logprobs(b, TOP_N));
        if ta[0].0 != tb[0].0 && ta.len() > 1 && ta[0].1 - ta[1].1 >= tie_margin {
            real += 1;
        }
        if ta.iter().map(|t| t.0).eq(tb.iter().map(|t| t.0)) {
            full += 1;
        }
        mae += (ta[0].1 - tb[0].1).abs() as f64;
        let d = a.iter().zip(b).map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() as f64 }).fold(0f64, f64::max);
        max_diff = max_diff.max(d);
    }
    let frac = |n: usize| if positions == 0 { 0.0 } else { n as f64 / positions as f64 };
    Equivalence {
        positions,
        real_disagreements: real,
        real_frac: frac(real),
        frac_full_agree: frac(full),
        mean_top1_mae: if positions == 0 { 0.0 } else { mae / positions as f64 },
        max_abs_logit_diff: max_diff,
        tokens_identical: plain.0 == spec.0,
    }
}
