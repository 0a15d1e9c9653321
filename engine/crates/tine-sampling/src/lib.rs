//! Token sampling over a logit vector, with llama.cpp's server semantics and defaults.
//!
//! The chain runs in llama.cpp's default order: penalties, top-k, top-p, min-p, temperature,
//! then a draw. Temperature `<= 0` is greedy (argmax, ties to the lowest id). A fixed seed
//! gives a reproducible stream. This crate knows nothing about models or tokenizers.

use rand::{Rng, SeedableRng};

/// Sampling settings; `Default` is llama.cpp's server default.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// `<= 0` keeps every token.
    pub top_k: i32,
    /// `>= 1` keeps every token.
    pub top_p: f32,
    /// `<= 0` keeps every token.
    pub min_p: f32,
    /// `1` disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at; `-1` means all, `0` disables.
    pub repeat_last_n: i32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// `None` draws a fresh seed.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, repeat_penalty: 1.0, repeat_last_n: 64, presence_penalty: 0.0, frequency_penalty: 0.0, seed: None }
    }
}

/// Problems with [`SamplingParams`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamsError {
    #[error("{name} must be a finite number, got {value}")]
    NotFinite { name: &'static str, value: f32 },
    #[error("top_p must lie in [0, 1], got {0}")]
    TopP(f32),
    #[error("min_p must lie in [0, 1], got {0}")]
    MinP(f32),
    #[error("repeat_penalty must be > 0, got {0}")]
    RepeatPenalty(f32),
    #[error("repeat_last_n must be >= -1, got {0}")]
    RepeatLastN(i32),
}

impl ParamsError {
    /// The request field at fault (llama-server's name).
    pub fn param(&self) -> &'static str {
        match self {
            ParamsError::NotFinite { name, .. } => name,
            ParamsError::TopP(_) => "top_p",
            ParamsError::MinP(_) => "min_p",
            ParamsError::RepeatPenalty(_) => "repeat_penalty",
            ParamsError::RepeatLastN(_) => "repeat_last_n",
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Greedy with no penalty in effect: the choice is the argmax of the raw logits, so a
    /// caller may compute it where the logits are (on the GPU) and skip the row.
    pub fn is_plain_argmax(&self) -> bool {
        self.is_greedy() && !self.has_penalties()
    }

    /// The `k` of a draw that reads only the `k` best logits of a row (the raw logits: no
    /// penalty), so a caller may find them where the logits are (on the GPU) and pass them to
    /// [`Sampler::sample_top_k`] instead of the row: temperature above 0, `1 <= top_k <= max`.
    pub fn top_k_only(&self, max: usize) -> Option<usize> {
        (!self.is_greedy() && !self.has_penalties() && self.top_k >= 1 && self.top_k as usize <= max).then_some(self.top_k as usize)
    }

    /// Whether a repeat, presence or frequency penalty changes the logits.
    fn has_penalties(&self) -> bool {
        self.repeat_last_n != 0 && (self.repeat_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0)
    }

    pub fn validate(&self) -> Result<(), ParamsError> {
        for (name, value) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("repeat_penalty", self.repeat_penalty),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !value.is_finite() {
                return Err(ParamsError::NotFinite { name, value });
            }
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(ParamsError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(ParamsError::MinP(self.min_p));
        }
        if self.repeat_penalty <= 0.0 {
            return Err(ParamsError::RepeatPenalty(self.repeat_penalty));
        }
        if self.repeat_last_n < -1 {
            return Err(ParamsError::RepeatLastN(self.repeat_last_n));
        }
        Ok(())
    }
}

/// Index of the largest logit; ties go to the lowest index.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Softmax in f64 for stable probabilities.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f64> = logits.iter().map(|&l| ((l - max) as f64).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| (e / sum) as f32).collect()
}

/// The `n` most likely tokens with their log-probabilities under plain softmax, best first.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = (logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>()).ln() as f32 + max;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(idx.len());
    if n == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(n - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    idx.truncate(n);
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    idx.into_iter().map(|i| (i, logits[i as usize] - log_sum)).collect()
}

/// A sampler with its own random stream.
pub struct Sampler {
    params: SamplingParams,
    rng: rand::rngs::StdRng,
    /// The seed in use (drawn when the params had none), so a run can be repeated.
    pub seed: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = params.seed.unwrap_or_else(|| rand::rngs::StdRng::from_os_rng().random());
        Sampler { rng: rand::rngs::StdRng::seed_from_u64(seed), params, seed }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The candidates after penalties and filters, as `(token, probability)` summing to 1.
    /// Greedy sampling gives the argmax with probability 1.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        // The row is copied only when a penalty changes it.
        let penalized;
        let logits = if p.has_penalties() {
            let mut l = logits.to_vec();
            apply_penalties(&mut l, history, p);
            penalized = l;
            &penalized[..]
        } else {
            logits
        };
        if p.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        let k = if p.top_k <= 0 { logits.len() } else { (p.top_k as usize).min(logits.len()) };
        let cand = if k < logits.len() { top_k(logits, k) } else { logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect() };
        self.filter(cand)
    }

    /// [`Sampler::distribution`] from the `top_k` best `(id, logit)` of a row (in any order)
    /// instead of the row, where [`SamplingParams::top_k_only`] allows it: the same distribution
    /// bit for bit, since the draw reads nothing else.
    pub fn distribution_top_k(&self, cand: Vec<(u32, f32)>) -> Vec<(u32, f32)> {
        debug_assert!(self.params.top_k_only(usize::MAX).is_some_and(|k| cand.len() <= k), "distribution_top_k: {} candidates for {:?}", cand.len(), self.params);
        self.filter(cand)
    }

    /// Draws the next token from the `top_k` best `(id, logit)` of a row
    /// ([`Sampler::distribution_top_k`]): what [`Sampler::sample`] draws from the row.
    pub fn sample_top_k(&mut self, cand: Vec<(u32, f32)>) -> u32 {
        let dist = self.distribution_top_k(cand);
        self.draw(&dist)
    }

    /// Top-p, min-p and temperature over the candidates the penalties and top-k left.
    fn filter(&self, mut cand: Vec<(u32, f32)>) -> Vec<(u32, f32)> {
        let p = &self.params;
        // Candidates sorted by logit, best first (ties: lower id).
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        // top-p over the softmax of the remaining candidates.
        if p.top_p < 1.0 {
            let probs = softmax(&cand.iter().map(|c| c.1).collect::<Vec<_>>());
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
        // min-p relative to the best candidate.
        if p.min_p > 0.0 && !cand.is_empty() {
            let threshold = cand[0].1 + p.min_p.ln();
            let keep = cand.iter().take_while(|c| c.1 >= threshold).count().max(1);
            cand.truncate(keep);
        }
        let scaled: Vec<f32> = cand.iter().map(|c| c.1 / p.temperature).collect();
        let probs = softmax(&scaled);
        cand.iter().zip(probs).map(|(c, pr)| (c.0, pr)).collect()
    }

    /// Draws the next token.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let dist = self.distribution(logits, history);
        self.draw(&dist)
    }

    /// A uniform draw from `[0, 1)` on this sampler's stream (speculative acceptance tests).
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }

    /// Draws from an explicit distribution (used by speculative verification too).
    pub fn draw(&mut self, dist: &[(u32, f32)]) -> u32 {
        if dist.len() == 1 {
            return dist[0].0;
        }
        let total: f32 = dist.iter().map(|d| d.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for &(tok, pr) in dist {
            if r < pr {
                return tok;
            }
            r -= pr;
        }
        dist.last().expect("a distribution is never empty").0
    }
}

/// A kept candidate in [`top_k`]'s heap, ordered worst first: a lower logit (`total_cmp`), then
/// on equal logits a higher id, is "greater", so the heap's top is the candidate to drop.
#[derive(Debug, Clone, Copy)]
struct Kept(u32, f32);

impl Ord for Kept {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.1.total_cmp(&self.1).then(self.0.cmp(&other.0))
    }
}
impl PartialOrd for Kept {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Kept {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for Kept {}

/// The `k` best `(id, logit)` of `logits` (`1 <= k < len`) under the sampler's order (logit by
/// `total_cmp`, descending; ties to the lower id), unsorted: one pass with a heap of `k`, where
/// a row of a vocabulary's size is mostly one comparison a value. The order is total, so the set
/// is the one a full sort would keep.
fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    // A row that keeps improving on the kept set (rising logits) would pay a heap update a value:
    // past this many the pass gives up for a selection over the whole row, the same set.
    let budget = k + logits.len() / 16;
    let mut updates = 0usize;
    let mut heap = std::collections::BinaryHeap::with_capacity(k + 1);
    // The worst kept logit, once k are kept: a value below it (a plain float comparison, false
    // for NaN and for -0.0 against 0.0, which take the full comparison) is below it in
    // `total_cmp` too, and is dropped without touching the heap.
    let mut floor = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l < floor {
            continue;
        }
        let c = Kept(i as u32, l);
        if heap.len() < k {
            heap.push(c);
            if heap.len() == k {
                floor = heap.peek().expect("k >= 1 kept").1;
            }
        } else if c < *heap.peek().expect("k >= 1 kept") {
            *heap.peek_mut().expect("k >= 1 kept") = c;
            floor = heap.peek().expect("k >= 1 kept").1;
            updates += 1;
            if updates > budget {
                let mut all: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
                all.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                all.truncate(k);
                return all;
            }
        }
    }
    heap.into_iter().map(|c| (c.0, c.1)).collect()
}

fn apply_penalties(logits: &mut [f32], history: &[u32], p: &SamplingParams) {
    if !p.has_penalties() {
        return;
    }
    let window = if p.repeat_last_n < 0 { history.len() } else { (p.repeat_last_n as usize).min(history.len()) };
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in &history[history.len() - window..] {
        *counts.entry(t).or_default() += 1;
    }
    for (&t, &c) in &counts {
        let Some(l) = logits.get_mut(t as usize) else { continue };
        if *l <= 0.0 {
            *l *= p.repeat_penalty;
        } else {
            *l /= p.repeat_penalty;
        }
        *l -= c as f32 * p.frequency_penalty + p.presence_penalty;
    }
}
