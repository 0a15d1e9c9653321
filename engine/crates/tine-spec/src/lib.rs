//! Speculative decoding: drafters propose tokens, the target verifies them in one forward, and
//! the driver keeps exactly what plain decoding would have produced.
//!
//! - [`Drafter`] is one proposal strategy; [`drafters`] has one per [`SpecType`]: NextN
//!   self-speculation, an external assistant head, a separate draft model, n-gram lookup.
//! - [`Speculator`] runs a round: draft, verify (`Sequence::forward_all`, batch-invariant on the
//!   CPU, so each row equals a one-token decode bit for bit), accept, roll the KV cache back
//!   (O(1) truncate), and counts statistics.
//! - At every temperature, each verify row draws the target's token exactly as plain decoding
//!   would (same sampler, same history, same position in the random stream) and a draft is
//!   kept when it equals that token. The output is plain decoding's token for token, for any
//!   seed; since the drafters are argmax drafters (`q` one-hot), a draft `x` is kept with
//!   probability `p(x)`, what `min(1, p/q)` gives.
//! - With [`DraftParams::adaptive`], a [`Policy`] picks each round's depth from the sequence's
//!   measured acceptance and forward costs, and turns drafting off where it does not pay.
//!
//! This crate knows nothing about HTTP, chat templates or stop strings.

pub mod drafters;
pub mod equivalence;

use std::str::FromStr;

use tine_runtime::{Hidden, Logits, Model, Sequence, StepError};
use tine_sampling::Sampler;

pub use drafters::{AssistantDrafter, ChainDrafter, DraftModelDrafter, MtpDrafter, NgramDrafter};

/// The speculative decoding flavours (`--spec-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpecType {
    /// NextN self-speculation: the head is baked into the target GGUF.
    DraftMtp,
    /// An external assistant head (`--mtp-head FILE`) reading the target's KV cache.
    DraftAssistant,
    /// A separate draft model with the same vocabulary (`-md FILE`).
    Draft,
    /// Prompt lookup: continue the longest recent n-gram match.
    Ngram,
}

impl SpecType {
    pub const ALL: [SpecType; 4] = [SpecType::DraftMtp, SpecType::DraftAssistant, SpecType::Draft, SpecType::Ngram];

    pub fn as_str(self) -> &'static str {
        match self {
            SpecType::DraftMtp => "draft-mtp",
            SpecType::DraftAssistant => "draft-assistant",
            SpecType::Draft => "draft",
            SpecType::Ngram => "ngram",
        }
    }
}

impl std::fmt::Display for SpecType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown spec type `{0}` (expected draft-mtp, draft-assistant, draft or ngram)")]
pub struct UnknownSpecType(pub String);

impl FromStr for SpecType {
    type Err = UnknownSpecType;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // llama.cpp's names for the same strategies are accepted too.
        match s {
            "draft-mtp" | "mtp" => Ok(SpecType::DraftMtp),
            "draft-assistant" => Ok(SpecType::DraftAssistant),
            "draft" | "draft-simple" => Ok(SpecType::Draft),
            "ngram" | "ngram-simple" => Ok(SpecType::Ngram),
            other => Err(UnknownSpecType(other.to_owned())),
        }
    }
}

/// What one request drafts with (`speculative.type`, llama-server's field for it): nothing, or
/// a [`SpecType`], optionally behind n-gram proposals (`ngram,TYPE`, as `--spec-type` spells a
/// chain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecChoice {
    Off,
    On { spec_type: SpecType, ngram_first: bool },
}

impl SpecChoice {
    /// Plain `spec_type`.
    pub fn of(spec_type: SpecType) -> SpecChoice {
        SpecChoice::On { spec_type, ngram_first: false }
    }

    /// The drafter type, `None` when off.
    pub fn spec_type(self) -> Option<SpecType> {
        match self {
            SpecChoice::Off => None,
            SpecChoice::On { spec_type, .. } => Some(spec_type),
        }
    }
}

impl std::fmt::Display for SpecChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpecChoice::Off => f.write_str("none"),
            SpecChoice::On { spec_type, ngram_first: true } => write!(f, "ngram,{spec_type}"),
            SpecChoice::On { spec_type, ngram_first: false } => write!(f, "{spec_type}"),
        }
    }
}

impl FromStr for SpecChoice {
    type Err = UnknownSpecType;
    /// `none` (or `off`), a type, or `ngram,TYPE`; llama.cpp's names for the types too.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s == "none" || s == "off" {
            return Ok(SpecChoice::Off);
        }
        match s.split_once(',') {
            Some((first, rest)) => match (first.trim().parse()?, rest.trim().parse()?) {
                (SpecType::Ngram, SpecType::Ngram) => Ok(SpecChoice::of(SpecType::Ngram)),
                (SpecType::Ngram, spec_type) => Ok(SpecChoice::On { spec_type, ngram_first: true }),
                _ => Err(UnknownSpecType(s.to_owned())),
            },
            None => Ok(SpecChoice::of(s.parse()?)),
        }
    }
}

/// How much to draft (`--spec-draft-n-max`, `--spec-draft-n-min`, `--spec-draft-p-min`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftParams {
    /// Most tokens drafted per verify step; 0 turns speculation off.
    pub n_max: usize,
    /// Fewer drafted tokens than this are not verified (the step decodes plainly).
    pub n_min: usize,
    /// A model drafter stops when its top probability falls below this.
    pub p_min: f32,
    /// Choose each round's depth (up to `n_max`) from this sequence's measured acceptance and
    /// forward costs, drafting nothing where no depth beats plain decoding ([`Policy`]).
    pub adaptive: bool,
}

impl Default for DraftParams {
    fn default() -> Self {
        DraftParams { n_max: 3, n_min: 0, p_min: 0.0, adaptive: false }
    }
}

/// The adaptive depth: per sequence, what a verify forward of `r` rows costs (moving averages
/// of measured times), what a drafted token costs, and how often a draft position is kept
/// (discounted counts, a geometric model: position `i` is judged only if `i - 1` was kept).
/// Depth `k` is worth `(1 + E[kept | k]) / (T(k + 1) + k * D)` tokens per ms against plain
/// decoding's `1 / T(1)`; the best wins, and 0 (no drafting) when none beats plain decoding
/// by [`Policy::MARGIN`]. While off, a short draft is tried every [`Policy::PROBE_EVERY`]
/// rounds so a sequence whose text turns predictable is noticed.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// Moving average of ms per verify forward, indexed by rows.
    verify_ms: Vec<Option<f64>>,
    /// Moving average of drafting ms per drafted token.
    draft_ms: Option<f64>,
    judged: f64,
    kept: f64,
    rounds: u64,
    idle: u32,
    /// What a verify of `r` rows costs this sequence, `fixed + per_row * r` ms, where the caller
    /// knows it better than this sequence's own timings (a step shared with other sequences:
    /// [`Policy::set_step_cost`]).
    step_cost: Option<(f64, f64)>,
}

impl Policy {
    /// Weight of a new timing in its moving average.
    const EMA: f64 = 0.25;
    /// Per-round discount of the acceptance history (recent text counts more).
    const DECAY: f64 = 0.95;
    /// Rounds at full depth before the figures are trusted.
    const WARMUP: u64 = 4;
    /// A depth must beat plain decoding by this factor (timing noise is a few percent).
    pub const MARGIN: f64 = 1.03;
    pub const PROBE_EVERY: u32 = 8;

    /// The estimated probability that a draft position is kept (a Beta(1, 1) prior).
    pub fn accept_rate(&self) -> f64 {
        (self.kept + 1.0) / (self.judged + 2.0)
    }

    /// Sets (or with `None` clears) the cost of a verify of `r` rows as `fixed + per_row * r` ms,
    /// in place of this sequence's own timings per row count. For a batched step, whose cost
    /// the caller fits over every sequence's rows: the timings of one sequence would keep what
    /// its row counts cost when it ran alone long after the batch grew (a depth it no longer
    /// tries is never timed again).
    pub fn set_step_cost(&mut self, cost: Option<(f64, f64)>) {
        self.step_cost = cost;
    }

    fn cost(&self, rows: usize) -> Option<f64> {
        if let Some((fixed, per_row)) = self.step_cost {
            return Some(fixed + per_row * rows as f64);
        }
        if let Some(Some(t)) = self.verify_ms.get(rows) {
            return Some(*t);
        }
        // Unmeasured: linear between the nearest measured row counts (or from one of them
        // with the slope of the others, else a quarter of a decode per extra row).
        let measured = || self.verify_ms.iter().enumerate().filter_map(|(r, t)| t.map(|t| (r, t)));
        let t1 = self.verify_ms.get(1).copied().flatten()?;
        let below = measured().rev().find(|m| m.0 < rows);
        let above = measured().find(|m| m.0 > rows);
        Some(match (below, above) {
            (Some((r0, t0)), Some((r1, tt))) => t0 + (tt - t0) * (rows - r0) as f64 / (r1 - r0) as f64,
            (Some((r0, t0)), None) if r0 > 1 => t0 + (t0 - t1) / (r0 - 1) as f64 * (rows - r0) as f64,
            _ => t1 * (1.0 + 0.25 * (rows - 1) as f64),
        })
    }

    /// The depth for the next round, at most `k_max`.
    pub fn depth(&mut self, k_max: usize) -> usize {
        if k_max == 0 {
            return 0;
        }
        if self.rounds < Self::WARMUP {
            return k_max;
        }
        // Plain decoding's cost is the yardstick: a drafter that always drafts never shows
        // it, so one round without drafts measures it.
        let Some(t1) = self.cost(1) else { return 0 };
        let a = self.accept_rate();
        let d = self.draft_ms.unwrap_or(0.0);
        let (mut best, mut best_k) = (Self::MARGIN / t1, 0);
        for k in 1..=k_max {
            let kept = if (1.0 - a).abs() < 1e-9 { k as f64 } else { a * (1.0 - a.powi(k as i32)) / (1.0 - a) };
            let Some(t) = self.cost(k + 1) else { continue };
            let rate = (1.0 + kept) / (t + d * k as f64);
            if rate > best {
                (best, best_k) = (rate, k);
            }
        }
        if best_k == 0 {
            self.idle += 1;
            if self.idle >= Self::PROBE_EVERY {
                self.idle = 0;
                return 1;
            }
        } else {
            self.idle = 0;
        }
        best_k
    }

    /// What one round measured: a verify forward of `rows` rows in `verify_ms`, `drafted`
    /// tokens drafted in `draft_ms`, `kept` of them accepted.
    pub fn record(&mut self, rows: usize, verify_ms: f64, drafted: usize, draft_ms: f64, kept: usize) {
        if self.verify_ms.len() <= rows {
            self.verify_ms.resize(rows + 1, None);
        }
        let ema = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + Self::EMA * (new - o)));
        self.verify_ms[rows] = ema(self.verify_ms[rows], verify_ms);
        if drafted > 0 {
            self.draft_ms = ema(self.draft_ms, draft_ms / drafted as f64);
            self.judged = self.judged * Self::DECAY + (kept + usize::from(kept < drafted)) as f64;
            self.kept = self.kept * Self::DECAY + kept as f64;
            self.rounds += 1;
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("drafting failed")]
    Draft(#[source] StepError),
    #[error("the verify step failed")]
    Verify(#[source] StepError),
    #[error("the {0} drafter lost track of the target's hidden states (positions {1}.. missing)")]
    OutOfSync(SpecType, usize),
    #[error("the draft model's vocabulary ({draft} tokens) differs from the target's ({target})")]
    VocabMismatch { draft: usize, target: usize },
    #[error("{0} needs a target with a NextN head (`nextn_predict_layers` in its GGUF); this one has none")]
    NoNextN(SpecType),
    #[error("{0} needs what this server did not load at start-up (start it with --spec-type {0})")]
    NotLoaded(SpecType),
    #[error("preparing a verify row failed")]
    Filter(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("a verify of {planned} rows planned at length {at} was decided over {rows} rows at length {len}")]
    Unplanned { planned: usize, at: usize, rows: usize, len: usize },
}

/// Edits the target's logit rows before each decision of a round, exactly as plain decoding
/// edits its logits (logit bias, banned end-of-generation tokens, a grammar's mask).
pub trait RowFilter {
    /// How many leading `drafts` may be verified. A constraint cuts the draft where it leaves
    /// the grammar, before the verify forward: such a token could never be kept.
    fn admit(&mut self, drafts: &[u32]) -> usize {
        drafts.len()
    }
    /// Edits row `i`, the decision made after `drafts[..i]` were kept.
    fn prepare(&mut self, i: usize, drafts: &[u32], row: &mut [f32]) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
    /// `Some(banned)` when [`RowFilter::prepare`] only sets the ids in `banned` to -inf and
    /// nobody reads the rows after the decision: then a greedy round asks the target for each
    /// row's id alone ([`Sequence::forward_all_argmax`]) and a sampled round with top-k for each
    /// row's k best ([`Sequence::forward_all_top_k`], on the GPU engine), which keeps the rows
    /// on the GPU, and [`Round::rows`] holds empty rows.
    fn ids_only(&self) -> Option<Vec<u32>> {
        None
    }
}

impl<F: FnMut(&mut [f32])> RowFilter for F {
    fn prepare(&mut self, _i: usize, _drafts: &[u32], row: &mut [f32]) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self(row);
        Ok(())
    }
}

/// What a drafter sees: the target after its last verify step.
pub struct DraftInput<'a> {
    pub model: &'a Model,
    /// The target sequence, holding the committed tokens `0..n`.
    pub target: &'a Sequence,
    /// The token at position `n`: decided, not yet fed to the target.
    pub pending: u32,
    /// The target's hidden states of positions `hidden_start..n` that this drafter has not seen
    /// (only for drafters that ask for them).
    pub hidden: Option<&'a Hidden>,
    pub hidden_start: usize,
    /// Draft at most this many tokens.
    pub n_max: usize,
    pub p_min: f32,
}

impl DraftInput<'_> {
    /// The committed tokens followed by the pending one.
    pub fn context(&self) -> Vec<u32> {
        let mut ctx = Vec::with_capacity(self.target.len() + 1);
        ctx.extend_from_slice(self.target.tokens());
        ctx.push(self.pending);
        ctx
    }
}

/// One drafting strategy, with its per-sequence state.
pub trait Drafter: Send {
    fn spec_type(&self) -> SpecType;

    /// Whether [`DraftInput::hidden`] must be filled (MTP heads read the target's hidden states).
    fn needs_hidden(&self) -> bool {
        false
    }

    /// How many leading positions of a target holding `tokens` this drafter's state still
    /// covers; the target keeps no more than this when a new request reuses a prefix.
    fn reusable(&self, _tokens: &[u32]) -> usize {
        usize::MAX
    }

    /// Proposes up to `input.n_max` tokens for positions `n + 1..`.
    fn draft(&mut self, input: &DraftInput) -> Result<Vec<u32>, SpecError>;

    /// The drafter's own sequence, when it runs a draft model (its positions can be shared
    /// between slots as the target's are).
    fn draft_sequence(&mut self) -> Option<&mut Sequence> {
        None
    }

    /// The drafter's per-position state, when it is a NextN head's that can be shared between
    /// slots: see [`NextNShare`].
    fn nextn_share(&mut self) -> Option<&mut dyn NextNShare> {
        None
    }
}

/// A NextN drafter's state as other slots may share it: entries built from the target's own
/// hidden states (never from drafts), held once.
pub trait NextNShare {
    /// The first `len` entries (at most the trusted ones) as a prefix another drafter can start
    /// on; this one reads them from there too.
    fn share(&mut self, len: usize) -> Result<tine_runtime::NextNPrefix, SpecError>;
    /// Empties the state and starts it on `prefix`, whose entries are trusted.
    fn attach(&mut self, prefix: &tine_runtime::NextNPrefix) -> Result<(), SpecError>;
    /// Entries read from a shared prefix.
    fn shared_len(&self) -> usize;
}

/// Draft statistics (llama-server's `draft_n`, `draft_n_accepted`, plus verify steps).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Tokens drafted.
    pub draft_n: usize,
    /// Drafted tokens the target kept.
    pub draft_n_accepted: usize,
    /// Verify forwards that carried at least one draft.
    pub draft_verify_steps: usize,
    /// `accepted_per_pos[i]`: rounds whose draft position `i` was kept (llama-server's
    /// `spec_decode_num_accepted_tokens_per_pos_total`).
    pub accepted_per_pos: [usize; MAX_DRAFT],
}

impl SpecStats {
    pub fn accept_rate(&self) -> f64 {
        if self.draft_n == 0 {
            0.0
        } else {
            self.draft_n_accepted as f64 / self.draft_n as f64
        }
    }
    /// Mean tokens decided per verify step: `1 + accepted / steps`.
    pub fn tau(&self) -> f64 {
        if self.draft_verify_steps == 0 {
            1.0
        } else {
            1.0 + self.draft_n_accepted as f64 / self.draft_verify_steps as f64
        }
    }
    pub fn add(&mut self, o: &SpecStats) {
        self.draft_n += o.draft_n;
        self.draft_n_accepted += o.draft_n_accepted;
        self.draft_verify_steps += o.draft_verify_steps;
        for (a, b) in self.accepted_per_pos.iter_mut().zip(&o.accepted_per_pos) {
            *a += b;
        }
    }
}

/// The tokens one round decided: accepted drafts, then the target's own next token.
#[derive(Debug, Clone)]
pub struct Round {
    pub tokens: Vec<u32>,
    /// The target logits each token was decided from (after `prepare`), one row per token.
    pub rows: Vec<Vec<f32>>,
    pub drafted: usize,
    pub accepted: usize,
}

impl Round {
    /// This round's share of the draft statistics.
    pub fn stats(&self) -> SpecStats {
        let mut accepted_per_pos = [0; MAX_DRAFT];
        accepted_per_pos.iter_mut().take(self.accepted).for_each(|a| *a = 1);
        SpecStats { draft_n: self.drafted, draft_n_accepted: self.accepted, draft_verify_steps: usize::from(self.drafted > 0), accepted_per_pos }
    }
}

/// A round drafted by [`Speculator::plan`], waiting for its verify forward.
#[derive(Debug)]
pub struct Planned {
    /// The target's length when the round began.
    n: usize,
    /// The pending token, then the drafts.
    batch: Vec<u32>,
    drafts: Vec<u32>,
    /// Whether the drafter was asked for drafts (its hidden states then restart at `n`).
    consulted: bool,
    draft_ms: f64,
    wants_hidden: bool,
}

impl Planned {
    /// The verify batch to feed: the pending token, then the drafts.
    pub fn tokens(&self) -> &[u32] {
        &self.batch
    }
    /// Whether the drafter reads the verify rows' hidden states (a NextN head, an assistant).
    pub fn wants_hidden(&self) -> bool {
        self.wants_hidden
    }
    /// How to feed it (the drafter reads the hidden states of a verify, or not).
    pub fn rows(&self) -> tine_runtime::Rows {
        tine_runtime::Rows::Verify { hidden: self.wants_hidden }
    }
    /// Tokens drafted.
    pub fn drafted(&self) -> usize {
        self.drafts.len()
    }
}

/// A drafter plus the driver state of one sequence.
pub struct Speculator {
    drafter: Box<dyn Drafter>,
    pub params: DraftParams,
    pub stats: SpecStats,
    /// Target hidden states the drafter has not consumed yet, for positions `hidden_start..`.
    hidden: Option<Hidden>,
    hidden_start: usize,
    /// This sequence's figures for the adaptive depth (kept across requests: the costs are
    /// the machine's, the acceptance decays).
    pub policy: Policy,
}

impl Speculator {
    pub fn new(drafter: Box<dyn Drafter>, params: DraftParams) -> Speculator {
        Speculator { drafter, params, stats: SpecStats::default(), hidden: None, hidden_start: 0, policy: Policy::default() }
    }

    pub fn spec_type(&self) -> SpecType {
        self.drafter.spec_type()
    }

    pub fn needs_hidden(&self) -> bool {
        self.drafter.needs_hidden()
    }

    /// See [`Drafter::reusable`].
    pub fn reusable(&self, tokens: &[u32]) -> usize {
        self.drafter.reusable(tokens)
    }

    /// The draft model's sequence, for a drafter that runs one (it catches up on the target's
    /// tokens at its first draft, so a caller may start it on a shared prefix before that).
    pub fn draft_sequence(&mut self) -> Option<&mut Sequence> {
        self.drafter.draft_sequence()
    }

    /// The NextN head's shareable state, for a `draft-mtp` drafter on the CPU.
    pub fn nextn_share(&mut self) -> Option<&mut dyn NextNShare> {
        self.drafter.nextn_share()
    }

    /// Prefills `tokens` after what `seq` holds (a new request) and returns the last logits,
    /// keeping the target's hidden states of those positions when the drafter reads them.
    pub fn prefill(&mut self, model: &Model, seq: &mut Sequence, tokens: &[u32]) -> Result<Vec<f32>, StepError> {
        self.prefill_chunk(model, seq, tokens, true)
    }

    /// One chunk of a prefill: `first` starts a new request's prompt; later chunks continue
    /// it (the hidden states of all chunks are kept together). Atomic like the target's steps.
    pub fn prefill_chunk(&mut self, model: &Model, seq: &mut Sequence, tokens: &[u32], first: bool) -> Result<Vec<f32>, StepError> {
        self.begin_prefill_chunk(seq, first);
        if self.drafter.needs_hidden() {
            let start = seq.len();
            let (logits, hidden) = seq.prefill_hidden(model, tokens)?;
            self.keep_prefill_hidden(seq, start, hidden)?;
            Ok(logits)
        } else {
            seq.prefill(model, tokens)
        }
    }

    /// [`Speculator::prefill_chunk`] in halves around the caller's forward (a prompt chunk in a
    /// batched step): this first, then the chunk fed (its pieces, `tine_runtime::Rows::Prefill`,
    /// with hidden states where [`Speculator::prefill_wants_hidden`] says so), then
    /// [`Speculator::keep_prefill_hidden`] with its hidden states where it gave them.
    pub fn begin_prefill_chunk(&mut self, seq: &Sequence, first: bool) {
        if first {
            self.hidden_start = seq.len();
            self.hidden = None;
        }
    }

    /// Whether a prompt chunk is fed with its hidden states (the drafter reads them).
    pub fn prefill_wants_hidden(&self) -> bool {
        self.drafter.needs_hidden()
    }

    /// Keeps the hidden states of a prompt chunk fed at position `start` of `seq` after the
    /// earlier chunks'. If they cannot join (a gap), `seq` goes back to `start`, or starts over
    /// where it cannot, so that its tokens stay what its drafter saw.
    pub fn keep_prefill_hidden(&mut self, seq: &mut Sequence, start: usize, hidden: Hidden) -> Result<(), StepError> {
        let joined = match &self.hidden {
            Some(old) => old.concat(&hidden).inspect_err(|_| {
                // A recurrent state on the GPU engine may not return to `start` after a long
                // chunk: then the sequence starts over, so that its tokens stay its state's.
                if seq.rollback(start).is_err() {
                    seq.reset();
                }
            })?,
            None => hidden,
        };
        self.hidden = Some(joined);
        Ok(())
    }

    /// One round at the point where plain decoding would feed `pending`: draft up to
    /// `min(n_max, max_new - 1)` tokens, verify them with `pending` in one forward, keep the
    /// accepted prefix and decide the next token. The target ends holding `pending` and the
    /// accepted drafts; the returned tokens (accepted drafts, then the decided next token) are
    /// not all fed yet: the last one is the next round's `pending`.
    ///
    /// `filter` edits each logit row before a decision (for example to ban end-of-generation
    /// tokens), exactly as plain decoding edits its logits, and may cut the draft first.
    ///
    /// The same round in two halves, the verify forward run by the caller in between (with other
    /// sequences' rows: continuous batching): [`Speculator::plan`], then [`Speculator::decide`].
    pub fn round(&mut self, model: &Model, seq: &mut Sequence, pending: u32, sampler: &mut Sampler, max_new: usize, filter: &mut dyn RowFilter) -> Result<Round, SpecError> {
        let plan = self.plan(model, seq, pending, max_new, filter)?;
        self.finish_round(model, seq, plan, sampler, filter)
    }

    /// How the verify batch of a round is read where nobody reads its rows
    /// ([`RowFilter::ids_only`]): each row's greedy id for a greedy draw, its `k` best for a
    /// sampled draw with top-k, passing over `banned`; `None` where the draw reads the rows.
    /// A round read this way is decided by [`Speculator::decide_read`], with the batch's hidden
    /// states where the drafter reads them ([`Planned::wants_hidden`]).
    pub fn quick_read(sampler: &Sampler, filter: &dyn RowFilter) -> Option<QuickRead> {
        let banned = filter.ids_only()?;
        if sampler.params().is_plain_argmax() {
            return Some(QuickRead::Ids { banned });
        }
        sampler.params().top_k_only(usize::MAX).map(|k| QuickRead::TopK { banned, k })
    }

    /// The second half of [`Speculator::round`] where the caller read the verify batch's rows
    /// as [`Speculator::quick_read`] said (`read`: each row's id, or each row's k best) and with
    /// their hidden states where the plan wants them ([`Planned::wants_hidden`]: a NextN head's
    /// or an assistant's round), having fed the batch to `seq` (with other sequences' rows: the
    /// GPU engine's batched step).
    pub fn decide_read(&mut self, plan: Planned, seq: &mut Sequence, sampler: &mut Sampler, read: ReadRows, hidden: Option<Hidden>, verify_ms: f64) -> Result<Round, SpecError> {
        let rows = match &read {
            ReadRows::Ids(ids) => ids.len(),
            ReadRows::TopK(top) => top.len(),
        };
        let hidden_rows = hidden.as_ref().map(Hidden::positions);
        let hidden_fits = if plan.wants_hidden { hidden_rows == Some(plan.batch.len()) } else { hidden_rows.is_none() };
        if seq.len() != plan.n + plan.batch.len() || rows != plan.batch.len() || !hidden_fits {
            return Err(SpecError::Unplanned { planned: plan.batch.len(), at: plan.n, rows, len: seq.len() });
        }
        let decisions = match read {
            ReadRows::Ids(ids) => Decisions::Ids(ids),
            ReadRows::TopK(top) => Decisions::TopK(top),
        };
        self.conclude(plan, seq, sampler, decisions, hidden, verify_ms)
    }

    /// [`Speculator::round`] from a plan made by [`Speculator::plan`]: the verify forward on
    /// `seq` alone, then the decisions.
    pub fn finish_round(&mut self, model: &Model, seq: &mut Sequence, plan: Planned, sampler: &mut Sampler, filter: &mut dyn RowFilter) -> Result<Round, SpecError> {
        let t_verify = std::time::Instant::now();
        // Decisions over rows nobody reads: greedy ones from the target's ids alone; sampled ones
        // with top-k from each row's k best (on the GPU engine, where the rows stay).
        let batch = &plan.batch;
        let quick = match filter.ids_only() {
            Some(banned) if sampler.params().is_plain_argmax() => Some(if plan.wants_hidden {
                let (ids, h) = seq.forward_all_argmax_hidden(model, batch, &banned).map_err(SpecError::Verify)?;
                (Decisions::Ids(ids), Some(h))
            } else {
                (Decisions::Ids(seq.forward_all_argmax(model, batch, &banned).map_err(SpecError::Verify)?), None)
            }),
            Some(banned) => match sampler.params().top_k_only(usize::MAX) {
                Some(k) => seq.forward_all_top_k(model, batch, &banned, k, plan.wants_hidden).map_err(SpecError::Verify)?.map(|(top, h)| (Decisions::TopK(top), h)),
                None => None,
            },
            None => None,
        };
        if let Some((decisions, hidden)) = quick {
            let verify_ms = t_verify.elapsed().as_secs_f64() * 1e3;
            return self.conclude(plan, seq, sampler, decisions, hidden, verify_ms);
        }
        let (logits, hidden) = if plan.wants_hidden {
            let (l, h) = seq.forward_all_hidden(model, batch).map_err(SpecError::Verify)?;
            (l, Some(h))
        } else {
            (seq.forward_all(model, batch).map_err(SpecError::Verify)?, None)
        };
        let verify_ms = t_verify.elapsed().as_secs_f64() * 1e3;
        self.decide(plan, seq, sampler, filter, logits, hidden, verify_ms)
    }

    /// The first half of [`Speculator::round`]: drafts, and returns the verify batch the caller
    /// feeds to `seq` ([`Planned::tokens`], as [`Planned::rows`] says: `Model::step_many`),
    /// before [`Speculator::decide`] reads its rows. Changes nothing in `seq`.
    pub fn plan(&mut self, model: &Model, seq: &Sequence, pending: u32, max_new: usize, filter: &mut dyn RowFilter) -> Result<Planned, SpecError> {
        let n = seq.len();
        // Plain decoding stops once the sequence is one short of the context, so the last row
        // it ever computes is at position `context - 2`: a round must not decide past it.
        let room = seq.context().saturating_sub(n + 2);
        let mut k_max = self.params.n_max.min(max_new.saturating_sub(1)).min(room).min(seq.max_verify_drafts());
        if self.params.adaptive {
            k_max = self.policy.depth(k_max);
        }
        let consulted = k_max > 0;
        let t_draft = std::time::Instant::now();
        let mut drafts = if consulted {
            let input = DraftInput { model, target: seq, pending, hidden: self.hidden.as_ref(), hidden_start: self.hidden_start, n_max: k_max, p_min: self.params.p_min };
            let mut d = self.drafter.draft(&input)?;
            d.truncate(k_max);
            d
        } else {
            Vec::new()
        };
        let draft_ms = t_draft.elapsed().as_secs_f64() * 1e3;
        let admitted = filter.admit(&drafts);
        drafts.truncate(admitted);
        if drafts.len() < self.params.n_min.max(1) {
            drafts.clear();
        }
        let mut batch = Vec::with_capacity(drafts.len() + 1);
        batch.push(pending);
        batch.extend_from_slice(&drafts);
        // Speculation off for this request: no hidden states to keep (a drafter with per-position
        // state falls behind and is caught up from the next request's prefill).
        if self.params.n_max == 0 {
            self.hidden = None;
        }
        let wants_hidden = self.drafter.needs_hidden() && self.params.n_max > 0;
        Ok(Planned { n, batch, drafts, consulted, draft_ms, wants_hidden })
    }

    /// The second half of [`Speculator::round`]: `seq` holds the planned batch (fed by the
    /// caller, [`Planned::rows`]'s way) and `logits` (and `hidden`, when the plan wanted them)
    /// are its rows; keeps the accepted prefix and decides the next token, as `round` does.
    /// `verify_ms`: what the forward cost (the adaptive depth's measurement).
    #[allow(clippy::too_many_arguments)]
    pub fn decide(&mut self, plan: Planned, seq: &mut Sequence, sampler: &mut Sampler, filter: &mut dyn RowFilter, logits: Logits, hidden: Option<Hidden>, verify_ms: f64) -> Result<Round, SpecError> {
        let n = plan.n;
        if seq.len() != n + plan.batch.len() || logits.positions() != plan.batch.len() || plan.wants_hidden != hidden.is_some() {
            return Err(SpecError::Unplanned { planned: plan.batch.len(), at: n, rows: logits.positions(), len: seq.len() });
        }
        // Where nobody reads the rows a greedy round decides from each row's id as the verify
        // forward's argmax would give it (what `round` asks the target for).
        if let Some(banned) = filter.ids_only().filter(|_| sampler.params().is_plain_argmax()) {
            let ids = (0..logits.positions()).map(|i| tine_runtime::banned_argmax(logits.row(i), &banned)).collect();
            return self.conclude(plan, seq, sampler, Decisions::Ids(ids), hidden, verify_ms);
        }
        let drafts = &plan.drafts;
        let mut tokens = Vec::with_capacity(drafts.len() + 1);
        let mut rows = Vec::with_capacity(drafts.len() + 1);
        let mut accepted = 0;
        for i in 0..=drafts.len() {
            let mut row = logits.row(i).to_vec();
            filter.prepare(i, drafts, &mut row).map_err(SpecError::Filter)?;
            // The history a plain decode would have at this position.
            let history = &seq.tokens()[..n + 1 + i];
            // The target's token, drawn exactly as plain decoding draws it at this position
            // (same sampler, same history, the same place in the random stream): a draft is
            // kept when it equals that token. For a one-hot draft this keeps it with
            // probability p(draft), as min(1, p/q) would, and the output is plain decoding's
            // token for token, for any seed and temperature.
            let t = sampler.sample(&row, history);
            let decided = if drafts.get(i) == Some(&t) { None } else { Some(t) };
            rows.push(row);
            match decided {
                None => {
                    tokens.push(drafts[i]);
                    accepted += 1;
                }
                Some(t) => {
                    tokens.push(t);
                    break;
                }
            }
        }
        self.commit(&plan, seq, Round { tokens, rows, drafted: drafts.len(), accepted }, hidden, verify_ms)
    }

    /// A round decided from each row's id or top-k alone ([`Round::rows`] empty).
    fn conclude(&mut self, plan: Planned, seq: &mut Sequence, sampler: &mut Sampler, decisions: Decisions, hidden: Option<Hidden>, verify_ms: f64) -> Result<Round, SpecError> {
        let drafts = &plan.drafts;
        let mut tokens = Vec::with_capacity(drafts.len() + 1);
        let mut accepted = 0;
        // Drafts are kept while they equal the target's token, drawn as plain decoding draws
        // it (`decide`); the first other token is decided.
        for i in 0..plan.batch.len() {
            let t = match &decisions {
                Decisions::Ids(ids) => ids[i],
                Decisions::TopK(top) => sampler.sample_top_k(top[i].clone()),
            };
            tokens.push(t);
            if drafts.get(i) != Some(&t) {
                break;
            }
            accepted += 1;
        }
        let rows = vec![Vec::new(); tokens.len()];
        self.commit(&plan, seq, Round { tokens, rows, drafted: drafts.len(), accepted }, hidden, verify_ms)
    }

    /// The end of every round: the target keeps the pending token and the accepted drafts, the
    /// drafter the hidden states of those positions, the policy and the statistics the round.
    fn commit(&mut self, plan: &Planned, seq: &mut Sequence, round: Round, hidden: Option<Hidden>, verify_ms: f64) -> Result<Round, SpecError> {
        let (n, accepted) = (plan.n, round.accepted);
        seq.rollback(n + 1 + accepted).map_err(SpecError::Verify)?;
        self.keep_hidden(hidden, plan.consulted, n, accepted)?;
        self.policy.record(plan.batch.len(), verify_ms, round.drafted, plan.draft_ms, accepted);
        self.stats.add(&round.stats());
        Ok(round)
    }

    /// After a verify of the batch that started at position `n`: the drafter next sees the hidden
    /// states of the positions just committed (`accepted + 1` of them). A drafter that was not
    /// consulted this round still needs the rows it missed, so those are appended to its own.
    fn keep_hidden(&mut self, hidden: Option<Hidden>, consulted: bool, n: usize, accepted: usize) -> Result<(), SpecError> {
        self.hidden = match (hidden, self.hidden.take()) {
            (Some(h), Some(old)) if !consulted => Some(old.concat(&h.rows(0, accepted + 1).map_err(SpecError::Verify)?).map_err(SpecError::Verify)?),
            (Some(h), _) => {
                self.hidden_start = n;
                Some(h.rows(0, accepted + 1).map_err(SpecError::Verify)?)
            }
            (None, _) => None,
        };
        Ok(())
    }
}

/// A verify batch's target tokens where nobody reads its rows: each row's greedy id, or each
/// row's top-k candidates for a sampled draw ([`Sampler::sample_top_k`]).
enum Decisions {
    Ids(Vec<u32>),
    TopK(Vec<Vec<(u32, f32)>>),
}

/// How a verify batch's rows are read where nobody reads the rows themselves
/// ([`Speculator::quick_read`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuickRead {
    /// Each row's greedy id, passing over `banned`.
    Ids { banned: Vec<u32> },
    /// Each row's `k` best `(id, logit)` in the sampler's order, `banned` left out.
    TopK { banned: Vec<u32>, k: usize },
}

/// A verify batch's rows as [`QuickRead`] asked for them, row by row.
#[derive(Debug, Clone, PartialEq)]
pub enum ReadRows {
    Ids(Vec<u32>),
    TopK(Vec<Vec<(u32, f32)>>),
}

/// Everything that selects and sizes speculative decoding (the CLI's and server's flags).
#[derive(Debug, Clone, PartialEq)]
pub struct SpecConfig {
    pub spec_type: SpecType,
    pub params: DraftParams,
    /// `--mtp-head FILE` for [`SpecType::DraftAssistant`].
    pub mtp_head: Option<std::path::PathBuf>,
    /// `-md FILE` for [`SpecType::Draft`].
    pub draft_model: Option<std::path::PathBuf>,
    /// N-gram sizes tried, longest first (`--spec-ngram-min`, `--spec-ngram-max`).
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// llama.cpp's `--spec-type ngram,TYPE`: the n-gram proposal first, `spec_type` where it
    /// has none ([`ChainDrafter`]).
    pub ngram_first: bool,
    /// The draft model's KV cache types (`-ctkd`/`-ctvd`; f32 by default).
    pub draft_cache_types: (tine_runtime::KvType, tine_runtime::KvType),
}

impl SpecConfig {
    pub fn new(spec_type: SpecType) -> SpecConfig {
        SpecConfig { spec_type, params: DraftParams::default(), mtp_head: None, draft_model: None, ngram_min: 2, ngram_max: 4, ngram_first: false, draft_cache_types: Default::default() }
    }

    /// The name llama.cpp's `--spec-type` gives this configuration.
    pub fn label(&self) -> String {
        if self.ngram_first && self.spec_type != SpecType::Ngram {
            format!("ngram,{}", self.spec_type)
        } else {
            self.spec_type.to_string()
        }
    }
}

/// Why speculative decoding cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("--spec-type draft-assistant needs --mtp-head FILE")]
    MissingHead,
    #[error("--spec-type draft-assistant runs on the CPU and on the GPU engine, not on candle's CUDA path (TINE_GPU_ENGINE=0, or a model the engine does not read): the head's attention over the target's KV cache there is a CPU kernel")]
    AssistantOnCpuOnly,
    #[error("--spec-type draft needs a draft model (-md FILE)")]
    MissingDraftModel,
    #[error("n-gram sizes must satisfy 1 <= min <= max, got {0}..={1}")]
    NgramSizes(usize, usize),
    #[error("cannot load {what}")]
    Load {
        what: &'static str,
        #[source]
        source: Box<tine_runtime::LoadError>,
    },
    #[error("the draft model's KV cache (-ctkd/-ctvd)")]
    DraftCacheTypes(#[source] tine_runtime::CacheTypeError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Params(#[from] ParamsError),
}

/// Out-of-range [`DraftParams`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamsError {
    #[error("the draft depth n_max must be at most {MAX_DRAFT}, got {0}")]
    NMax(usize),
    #[error("p_min must lie in [0, 1], got {0}")]
    PMin(f32),
}

impl DraftParams {
    pub fn check(&self) -> Result<(), ParamsError> {
        if self.n_max > MAX_DRAFT {
            return Err(ParamsError::NMax(self.n_max));
        }
        if !(0.0..=1.0).contains(&self.p_min) {
            return Err(ParamsError::PMin(self.p_min));
        }
        Ok(())
    }
}

/// The `general.architecture` of assistant drafter GGUFs (`-md` with `--spec-type draft-mtp`
/// loads one as `draft-assistant`, as llama.cpp does for Gemma 4).
pub const ASSISTANT_ARCHITECTURES: [&str; 2] = ["gemma4-assistant", "gemma4_assistant"];

/// Most tokens one verify step may draft (a verify batch stays small enough to be batch-invariant).
pub const MAX_DRAFT: usize = 16;

/// Loaded drafting resources, shared by all slots; makes one [`Speculator`] per sequence.
pub struct SpecFactory {
    pub config: SpecConfig,
    assistant: Option<std::sync::Arc<tine_runtime::Assistant>>,
    draft: Option<std::sync::Arc<Model>>,
}

impl std::fmt::Debug for SpecFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpecFactory").field("config", &self.config).finish_non_exhaustive()
    }
}

impl SpecFactory {
    /// Loads what `config` needs and checks it fits `target`.
    pub fn load(config: SpecConfig, target: &Model) -> Result<SpecFactory, SetupError> {
        config.params.check()?;
        // Every server offers n-gram drafting per request (`speculative.type`).
        if config.ngram_min == 0 || config.ngram_min > config.ngram_max {
            return Err(SetupError::NgramSizes(config.ngram_min, config.ngram_max));
        }
        let (mut assistant, mut draft) = (None, None);
        let mut config = config;
        // llama.cpp's spelling for Gemma 4's assistants: `--spec-type draft-mtp -md ASSISTANT`.
        if config.spec_type == SpecType::DraftMtp {
            if let Some(path) = config.draft_model.clone() {
                let arch = Model::architecture_of(&path).map_err(|source| SetupError::Load { what: "the draft file", source: Box::new(source) })?;
                if ASSISTANT_ARCHITECTURES.contains(&arch.as_str()) {
                    config.spec_type = SpecType::DraftAssistant;
                    config.mtp_head = Some(path);
                    config.draft_model = None;
                }
            }
        }
        match config.spec_type {
            SpecType::DraftMtp if !target.has_nextn() => return Err(SpecError::NoNextN(SpecType::DraftMtp).into()),
            SpecType::DraftMtp => {}
            SpecType::DraftAssistant => {
                let path = config.mtp_head.as_ref().ok_or(SetupError::MissingHead)?;
                // Gemma 3's head attends with a CPU kernel off the engine; Gemma 4's runs
                // wherever its target does.
                if !target.device().is_cpu() && target.engine() != "tine-gpu" && target.info.architecture == "gemma3" {
                    return Err(SetupError::AssistantOnCpuOnly);
                }
                let head = tine_runtime::Assistant::load(path, target).map_err(|source| SetupError::Load { what: "the assistant head", source: Box::new(source) })?;
                assistant = Some(std::sync::Arc::new(head));
            }
            SpecType::Draft => {
                let path = config.draft_model.as_ref().ok_or(SetupError::MissingDraftModel)?;
                let mut model = Model::load_on(path, target.device()).map_err(|source| SetupError::Load { what: "the draft model", source: Box::new(source) })?;
                model.set_cache_types(config.draft_cache_types.0, config.draft_cache_types.1).map_err(SetupError::DraftCacheTypes)?;
                if model.info.vocab_size != target.info.vocab_size {
                    return Err(SpecError::VocabMismatch { draft: model.info.vocab_size, target: target.info.vocab_size }.into());
                }
                draft = Some(std::sync::Arc::new(model));
            }
            SpecType::Ngram if config.ngram_min == 0 || config.ngram_min > config.ngram_max => {
                return Err(SetupError::NgramSizes(config.ngram_min, config.ngram_max));
            }
            SpecType::Ngram => {}
        }
        Ok(SpecFactory { config, assistant, draft })
    }

    /// What this server's requests draft with when they do not choose (`--spec-type`).
    pub fn default_choice(&self) -> SpecChoice {
        SpecChoice::On { spec_type: self.config.spec_type, ngram_first: self.config.ngram_first && self.config.spec_type != SpecType::Ngram }
    }

    /// Whether a request may draft with `choice` here: what was loaded at start-up (an assistant
    /// head, a draft model), and what needs nothing loaded (n-grams; NextN where the target
    /// carries its head).
    pub fn serves(&self, choice: SpecChoice, target: &Model) -> bool {
        match choice.spec_type() {
            None | Some(SpecType::Ngram) => true,
            Some(SpecType::DraftMtp) => target.has_nextn(),
            Some(SpecType::DraftAssistant) => self.assistant.is_some(),
            Some(SpecType::Draft) => self.draft.is_some(),
        }
    }

    /// Every choice [`SpecFactory::serves`] (chains aside), the default first after `none`.
    pub fn offers(&self, target: &Model) -> Vec<SpecChoice> {
        let mut all = vec![SpecChoice::Off, self.default_choice()];
        for t in SpecType::ALL {
            let c = SpecChoice::of(t);
            if self.serves(c, target) && !all.contains(&c) {
                all.push(c);
            }
        }
        all
    }

    /// A fresh speculator for `choice` ([`SpecFactory::serves`] must hold), `None` when off.
    pub fn speculator_for(&self, choice: SpecChoice, target: &Model, context: usize) -> Result<Option<Speculator>, SpecError> {
        let SpecChoice::On { spec_type, ngram_first } = choice else { return Ok(None) };
        let ngram = NgramDrafter { n_min: self.config.ngram_min, n_max: self.config.ngram_max };
        let drafter: Box<dyn Drafter> = match spec_type {
            SpecType::DraftMtp => Box::new(MtpDrafter::new(target, context)?),
            SpecType::DraftAssistant => Box::new(AssistantDrafter::new(self.assistant.clone().ok_or(SpecError::NotLoaded(spec_type))?)),
            SpecType::Draft => Box::new(DraftModelDrafter::new(self.draft.clone().ok_or(SpecError::NotLoaded(spec_type))?, target, context)?),
            SpecType::Ngram => Box::new(ngram.clone()),
        };
        let drafter = if ngram_first && spec_type != SpecType::Ngram { Box::new(ChainDrafter::new(ngram, drafter)) } else { drafter };
        Ok(Some(Speculator::new(drafter, self.config.params)))
    }

    /// The draft model, for `--spec-type draft`.
    pub fn draft_model(&self) -> Option<&Model> {
        self.draft.as_deref()
    }

    /// A fresh speculator (drafter state included) for one sequence of `context` positions, of
    /// the server's own choice.
    pub fn speculator(&self, target: &Model, context: usize) -> Result<Speculator, SpecError> {
        Ok(self.speculator_for(self.default_choice(), target, context)?.expect("the default choice drafts"))
    }
}
