//! One request's generation, step by step.

use std::time::Instant;

use std::collections::VecDeque;

use tine_runtime::{DecodeOut, DecodeWant, Hidden, Logits, Model, Rows, RowsRead, Sequence, StepError, StepRows, PREFILL_CHUNK};
use tine_sampling::{top_logprobs, ParamsError, Sampler, SamplingParams};
use tine_spec::{SpecError, SpecStats, Speculator};

use crate::grammar::{Grammar, GrammarError};
use crate::stop::StopMatcher;

/// A generation request over token ids, as a caller builds it; [`GenerateRequest::validate`]
/// turns it into the [`ValidRequest`] a generation runs.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// Tokens to generate; `-1` means until end of generation or the context is full.
    pub n_predict: i32,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Never sample an end-of-generation token.
    pub ignore_eos: bool,
    /// Report this many top log-probabilities per generated token.
    pub n_probs: usize,
    /// With `n_probs`: the probabilities after the sampler's penalties and filters (the
    /// distribution the token was drawn from) instead of the raw log-softmax (llama-server's
    /// `post_sampling_probs`). [`TokenProb`] then holds their logarithms.
    pub post_sampling_probs: bool,
    /// Reuse the prefix the sequence already holds.
    pub cache_prompt: bool,
    /// Per-request draft settings (the speculator's own when `None`).
    pub speculative: Option<tine_spec::DraftParams>,
    /// The drafter this request speculates with (the server's when `None`); the caller that
    /// owns the speculators reads it.
    pub drafter: Option<tine_spec::SpecChoice>,
    /// Added to a token's logit before every decision (`-inf` bans it), as llama.cpp's
    /// `logit_bias` sampler does.
    pub logit_bias: Vec<(u32, f32)>,
    /// A compiled constraint: every token is masked by it before the decision, drafts included.
    pub grammar: Option<Grammar>,
    /// When the context is full, drop the oldest half of the tokens after the first `n_keep`
    /// and continue (llama-server's `--context-shift`); otherwise generation stops there.
    pub context_shift: bool,
    /// Leading tokens a shift keeps (`-1`: the whole prompt); the first token is always kept.
    pub n_keep: i32,
}

impl GenerateRequest {
    pub fn new(prompt: Vec<u32>) -> GenerateRequest {
        GenerateRequest {
            prompt,
            n_predict: -1,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            n_probs: 0,
            post_sampling_probs: false,
            cache_prompt: true,
            speculative: None,
            drafter: None,
            logit_bias: Vec::new(),
            grammar: None,
            context_shift: false,
            n_keep: 0,
        }
    }

    /// Every check of the request against a sequence of `context` positions, done once: the
    /// prompt is not empty and leaves room to generate, `n_predict` is -1 or a count, the
    /// sampling parameters are in range. A server runs it at its edge; [`Generation`] takes only
    /// what it returns.
    pub fn validate(self, context: usize) -> Result<ValidRequest, GenerateError> {
        if self.prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        if self.prompt.len() >= context {
            return Err(GenerateError::PromptTooLong { prompt: self.prompt.len(), context });
        }
        if self.n_predict < -1 {
            return Err(GenerateError::BadNPredict(self.n_predict));
        }
        self.sampling.validate()?;
        Ok(ValidRequest { request: self, context })
    }
}

/// A [`GenerateRequest`] that passed [`GenerateRequest::validate`] for a context size: the only
/// way to make one, and read-only after (it dereferences to the request).
#[derive(Debug, Clone)]
pub struct ValidRequest {
    request: GenerateRequest,
    context: usize,
}

impl ValidRequest {
    /// The context size it was validated for.
    pub fn context(&self) -> usize {
        self.context
    }
}

impl std::ops::Deref for ValidRequest {
    type Target = GenerateRequest;
    fn deref(&self) -> &GenerateRequest {
        &self.request
    }
}

/// Why generation ended (llama-server's `stop_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopType {
    /// An end-of-generation token.
    Eos,
    /// `n_predict` or the context size.
    Limit,
    /// A stop string.
    Word,
}

impl StopType {
    pub fn as_str(self) -> &'static str {
        match self {
            StopType::Eos => "eos",
            StopType::Limit => "limit",
            StopType::Word => "word",
        }
    }
}

/// The sampled token's log-probability and the top alternatives, under plain softmax.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenProb {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// llama-server's timing figures.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Prompt tokens evaluated (not reused from the cache).
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    /// Prompt tokens reused from the cache.
    pub cached_n: usize,
    /// Speculative decoding figures (zero when it is off).
    pub draft: SpecStats,
    /// Context shifts done (each dropped the oldest half of the shiftable tokens).
    pub shifts: usize,
}

impl Timings {
    pub fn prompt_per_second(&self) -> f64 {
        per_second(self.prompt_n, self.prompt_ms)
    }
    /// Decode speed. The first token was sampled from the prompt pass's logits, so
    /// `predicted_ms` covers the forwards of the other `predicted_n - 1` (counting it made
    /// `n_predict: 1` report thousands of tokens per second).
    pub fn predicted_per_second(&self) -> f64 {
        per_second(self.predicted_n.saturating_sub(1), self.predicted_ms)
    }
}

fn per_second(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the request exceeds the available context size: the prompt has {prompt} tokens, the context holds {context}")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("n_predict must be -1 (no limit) or a count >= 0, got {0}")]
    BadNPredict(i32),
    #[error(transparent)]
    Sampling(#[from] ParamsError),
    #[error("model step failed")]
    Step(#[from] StepError),
    #[error("speculative decoding failed")]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    /// A broken invariant (a bug) caught where the request ran; its slot starts afresh.
    #[error("internal error: {0}")]
    Internal(String),
}

/// What one step produced.
#[derive(Debug, Clone, Default)]
pub struct StepEvent {
    /// The sampled token (none once generation has ended).
    pub token: Option<u32>,
    /// New text that is safe to hand out (may be empty while a stop string might be forming).
    pub text: String,
    pub prob: Option<TokenProb>,
    /// Set on the last step.
    pub stop: Option<StopType>,
}

/// A request being generated on one sequence.
pub struct Generation {
    req: GenerateRequest,
    sampler: Sampler,
    stops: StopMatcher,
    logits: Vec<f32>,
    /// The next prompt position to evaluate, while the prompt is not all in.
    prefill_at: Option<usize>,
    /// The prompt chunk `start..end` that batched steps are feeding piece by piece
    /// (`tine_runtime::prompt_pieces`), while some of its pieces remain.
    split: Option<(usize, usize)>,
    /// Prompt tokens per prefill step.
    chunk: usize,
    generated: Vec<u32>,
    bytes: Vec<u8>,
    /// `bytes[..decoded]`, the longest valid UTF-8 prefix, as text (extended token by token, so
    /// the output is decoded once, not once per token).
    text: String,
    decoded: usize,
    sent: usize,
    finished: Option<StopType>,
    stopping_word: String,
    timings: Timings,
    /// Tokens a speculative round already decided (and fed, except the last), with the logit
    /// row each was decided from.
    decided: VecDeque<(u32, Vec<f32>)>,
    /// Keep the logit row of every emitted token (logit-equivalence checks).
    record_logits: bool,
    recorded: Vec<Vec<f32>>,
    /// The next token when the last decode computed only its argmax (see `argmax_only`).
    next: Option<u32>,
    /// The best `(id, logit)` of the next row when the last decode read only those (see
    /// `top_k_only`).
    top: Option<Vec<(u32, f32)>>,
    /// The rows [`Generation::step_deferring`] left to feed: their logits come through
    /// [`Generation::feed_rows`] (a forward batched with other sequences').
    pending: Option<Pending>,
    /// Whether the last step ran a forward of the target itself (not one left pending).
    forwarded: bool,
}

/// What a batched GPU step reads back for a verify batch read as `read` says: `(ban, want)`,
/// or `None` where the engine's step cannot (a banned list other than the end-of-generation
/// ids, more of them than its argmax passes over, a top-k it does not read).
fn gpu_read(model: &Model, read: &tine_spec::QuickRead) -> Option<(bool, DecodeWant)> {
    let (banned, argmax, top_k) = match read {
        tine_spec::QuickRead::Ids { banned } => (banned, true, None),
        tine_spec::QuickRead::TopK { banned, k } => (banned, false, Some(*k)),
    };
    let ban = !banned.is_empty();
    if ban && banned[..] != *model.end_of_generation_tokens() {
        return None;
    }
    match model.gpu_decode_want(argmax, top_k, ban) {
        DecodeWant::Row => None,
        want => Some((ban, want)),
    }
}

/// Which forwards a step leaves to its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Defer {
    No,
    /// Decodes, verify batches and (where the model batches) prompt pieces.
    All,
    /// Plain decodes alone.
    Decode,
}

/// What a deferred step left for the caller's forward.
#[derive(Debug)]
enum Pending {
    /// The emitted token, fed as a decode.
    Decode([u32; 1]),
    /// A speculative round's verify batch (drafted, not yet fed).
    Verify(tine_spec::Planned),
    /// A speculative round's verify batch left to the GPU engine's batched step, read back as
    /// `want` says for every row (`ban`: passing over the end-of-generation ids).
    VerifyGpu { plan: tine_spec::Planned, ban: bool, want: DecodeWant },
    /// The piece `at..end` of the prompt chunk `chunk`, to be fed at position `start` (with
    /// hidden states for the drafter where `hidden`; a recurrent state checkpointed after it
    /// where `checkpoint`).
    Prefill { at: usize, end: usize, start: usize, hidden: bool, checkpoint: bool, chunk: (usize, usize) },
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Generation {
    /// Validates the request and evaluates the prompt (reusing what `seq` already holds).
    pub fn start(model: &Model, seq: &mut Sequence, req: GenerateRequest) -> Result<Generation, GenerateError> {
        Self::start_with(model, seq, req, None)
    }

    /// [`Generation::start`] with an optional speculator for this sequence (then pass it to
    /// [`Generation::step_with`] on every step).
    pub fn start_with(model: &Model, seq: &mut Sequence, req: GenerateRequest, spec: Option<&mut Speculator>) -> Result<Generation, GenerateError> {
        let mut spec = spec;
        let req = req.validate(seq.context())?;
        let mut g = Self::begin_with(seq, req, spec.as_deref_mut(), PREFILL_CHUNK)?;
        while g.is_prefilling() {
            g.prefill_step(model, seq, spec.as_deref_mut())?;
        }
        Ok(g)
    }

    /// Rolls `seq` back to the prefix the validated request can reuse, without evaluating
    /// anything: the prompt is then evaluated `chunk` tokens per [`Generation::step_with`] call
    /// (each returns an empty event until it is done), so a scheduler can interleave a long
    /// prompt with other sequences' decode steps. `req` was validated for `seq`'s context size.
    pub fn begin_with(seq: &mut Sequence, req: ValidRequest, spec: Option<&mut Speculator>, chunk: usize) -> Result<Generation, GenerateError> {
        if req.context != seq.context() {
            return Err(GenerateError::Internal(format!("a request validated for a context of {} run in a sequence of {}", req.context, seq.context())));
        }
        let req = req.request;
        let common = if req.cache_prompt { common_prefix(seq.tokens(), &req.prompt) } else { 0 };
        // The last prompt token is always evaluated: its logits start the generation.
        let mut keep = common.min(req.prompt.len() - 1);
        if let Some(spec) = spec {
            if let Some(params) = req.speculative {
                spec.params = params;
            }
            // A drafter with per-position state only covers part of what the target holds.
            keep = keep.min(spec.reusable(&req.prompt));
        }
        // A recurrent model's state returns only to some positions; the rest is evaluated again.
        let keep = seq.restorable(keep);
        seq.rollback(keep)?;
        let timings = Timings { cached_n: keep, ..Timings::default() };
        let sampler = Sampler::new(req.sampling.clone());
        let stops = StopMatcher::new(req.stop.clone());
        Ok(Generation {
            req,
            sampler,
            stops,
            logits: Vec::new(),
            prefill_at: Some(keep),
            split: None,
            chunk: chunk.max(1),
            generated: Vec::new(),
            bytes: Vec::new(),
            text: String::new(),
            decoded: 0,
            sent: 0,
            finished: None,
            stopping_word: String::new(),
            timings,
            decided: VecDeque::new(),
            record_logits: false,
            recorded: Vec::new(),
            next: None,
            top: None,
            pending: None,
            forwarded: false,
        })
    }

    /// Whether prompt tokens remain to be evaluated.
    pub fn is_prefilling(&self) -> bool {
        self.prefill_at.is_some()
    }

    /// The prompt tokens the next step evaluates (`None` once the prompt is in): where `model`
    /// batches, the next piece of the chunk ([`Generation::step_deferring`] feeds one piece a
    /// step), else the chunk.
    pub fn next_chunk_len(&self, model: &Model) -> Option<usize> {
        let at = self.prefill_at?;
        if model.batches() {
            let (_, end, _) = self.next_piece(model, at);
            return Some(end - at);
        }
        Some(self.chunk_at(at).1 - at)
    }

    /// The prompt chunk position `at` is in: the one batched steps are feeding, else the next
    /// `chunk` tokens.
    fn chunk_at(&self, at: usize) -> (usize, usize) {
        match self.split {
            Some(c) => c,
            None => (at, (at + self.chunk).min(self.req.prompt.len())),
        }
    }

    /// The piece of the prompt from `at` as `model`'s prefill of its chunk runs it: the chunk,
    /// the piece's end, and whether a recurrent state keeps a checkpoint after it.
    fn next_piece(&self, model: &Model, at: usize) -> ((usize, usize), usize, bool) {
        let chunk = self.chunk_at(at);
        let piece = model.prompt_pieces(chunk.1 - chunk.0).into_iter().find(|p| chunk.0 + p.start == at);
        // `at` starts a piece: the chunk started there, or an earlier piece ended there.
        let p = piece.expect("a prompt chunk is fed piece by piece from its start");
        (chunk, at + p.len, p.checkpoint)
    }

    /// Leaves the next piece of the prompt at `at` pending for the caller's forward.
    fn defer_piece(&mut self, model: &Model, seq: &Sequence, spec: Option<&mut Speculator>, at: usize) {
        let (chunk, end, checkpoint) = self.next_piece(model, at);
        let first = at == self.timings.cached_n;
        let hidden = spec.as_deref().is_some_and(Speculator::prefill_wants_hidden);
        if let Some(spec) = spec {
            spec.begin_prefill_chunk(seq, first);
        }
        self.pending = Some(Pending::Prefill { at, end, start: seq.len(), hidden, checkpoint, chunk });
    }

    /// Evaluates the next chunk of the prompt (a no-op once the prompt is in). Atomic: on
    /// error the sequence holds what it held before this chunk.
    pub fn prefill_step(&mut self, model: &Model, seq: &mut Sequence, mut spec: Option<&mut Speculator>) -> Result<(), GenerateError> {
        let Some(at) = self.prefill_at else { return Ok(()) };
        if self.split.is_some() {
            // The rest of a chunk that batched steps fed in part: its next piece, alone.
            self.defer_piece(model, seq, spec.as_deref_mut(), at);
            return self.feed_alone(model, seq, spec);
        }
        let keep = self.timings.cached_n;
        let end = (at + self.chunk).min(self.req.prompt.len());
        let tokens = &self.req.prompt[at..end];
        let t0 = Instant::now();
        let logits = match spec {
            Some(spec) => spec.prefill_chunk(model, seq, tokens, at == keep)?,
            None => seq.prefill(model, tokens)?,
        };
        self.timings.prompt_ms += t0.elapsed().as_secs_f64() * 1e3;
        self.timings.prompt_n += tokens.len();
        if end == self.req.prompt.len() {
            self.logits = logits;
            self.prefill_at = None;
        } else {
            self.prefill_at = Some(end);
        }
        Ok(())
    }

    pub fn is_finished(&self) -> bool {
        self.finished.is_some()
    }
    pub fn stop_type(&self) -> Option<StopType> {
        self.finished
    }
    pub fn stopping_word(&self) -> &str {
        &self.stopping_word
    }
    pub fn tokens(&self) -> &[u32] {
        &self.generated
    }
    pub fn timings(&self) -> Timings {
        self.timings
    }
    pub fn seed(&self) -> u64 {
        self.sampler.seed
    }
    pub fn request(&self) -> &GenerateRequest {
        &self.req
    }
    /// All text generated so far, minus a matched stop string.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Keep the logit row each emitted token was chosen from ([`Generation::recorded_logits`]).
    pub fn record_logits(&mut self, on: bool) {
        self.record_logits = on;
    }

    /// The logit rows of the emitted tokens, when recording.
    pub fn recorded_logits(&self) -> &[Vec<f32>] {
        &self.recorded
    }

    /// Samples one token and advances the sequence.
    pub fn step(&mut self, model: &Model, seq: &mut Sequence) -> Result<StepEvent, GenerateError> {
        self.step_with(model, seq, None)
    }

    /// [`Generation::step`] with the speculator given to [`Generation::start_with`]: where plain
    /// decoding feeds one token, a round drafts, verifies and decides several; they are then
    /// handed out one per step.
    pub fn step_with(&mut self, model: &Model, seq: &mut Sequence, spec: Option<&mut Speculator>) -> Result<StepEvent, GenerateError> {
        self.step_inner(model, seq, spec, Defer::No)
    }

    /// [`Generation::step_with`] that leaves the GPU engine's batched step what it runs: a plain
    /// decode of the emitted token (no decided tokens left, not a prompt chunk), or a speculative
    /// round's verify batch whose rows are read as ids or top-k alone (the drafter reads no
    /// hidden states). [`Generation::pending_gpu`] names the rows and what each draw reads of
    /// them; the caller runs them (`Model::step_many_gpu`, with other sequences' rows) and hands
    /// the results to [`Generation::feed_gpu`]. The tokens drawn are the same as with `step_with`.
    pub fn step_deferring_decode(&mut self, model: &Model, seq: &mut Sequence, spec: Option<&mut Speculator>) -> Result<StepEvent, GenerateError> {
        self.step_inner(model, seq, spec, Defer::Decode)
    }

    /// The rows [`Generation::step_deferring_decode`] left pending: the tokens (a decode's one,
    /// or a speculative round's verify batch) and what to read back ([`RowsRead`]): whether the
    /// end-of-generation ids are passed over (`ignore_eos`), what each row's draw reads of it
    /// (what `step_with` would have asked of `Sequence::decode_argmax_banning`,
    /// `Sequence::decode_top_k` or `Sequence::decode`; for a verify batch, of
    /// `Sequence::forward_all_argmax` or `Sequence::forward_all_top_k`) and whether the drafter
    /// reads the rows' hidden states.
    pub fn pending_gpu(&self, model: &Model) -> Option<(&[u32], RowsRead)> {
        match self.pending.as_ref()? {
            Pending::Decode(token) => {
                let ban = self.req.ignore_eos;
                let want = if self.argmax_only() { model.gpu_decode_want(true, None, ban) } else { model.gpu_decode_want(false, self.top_k_only(), ban) };
                Some((&token[..], RowsRead { ban, want, hidden: false }))
            }
            // A NextN head's or an assistant's round reads its rows' hidden states back too.
            Pending::VerifyGpu { plan, ban, want } => Some((plan.tokens(), RowsRead { ban: *ban, want: *want, hidden: plan.wants_hidden() })),
            Pending::Verify(_) | Pending::Prefill { .. } => None,
        }
    }

    /// What the batched step gave for the rows [`Generation::pending_gpu`] named (one
    /// [`DecodeOut`] a row, and their hidden states, as it asked), which the caller appended to
    /// `seq`, the milliseconds
    /// the step took (counted as generation time) and what its rows cost (`cost_ms`, the
    /// adaptive depth's measurement of a verify, as [`Generation::feed_rows`] takes it). A verify
    /// batch's round is decided here.
    #[allow(clippy::too_many_arguments)]
    pub fn feed_gpu(&mut self, model: &Model, seq: &mut Sequence, spec: Option<&mut Speculator>, rows: StepRows, ms: f64, cost_ms: f64) -> Result<(), GenerateError> {
        let bad = |what: String| Err(GenerateError::Internal(what));
        let StepRows { outs, hidden } = rows;
        match self.pending.take() {
            Some(Pending::Decode(_)) => {
                let Ok([out]) = <[DecodeOut; 1]>::try_from(outs) else { return bad("a decode fed other than one row".into()) };
                self.timings.predicted_ms += ms;
                match out {
                    DecodeOut::Id(id) => self.next = Some(id),
                    DecodeOut::TopK(top) => self.top = Some(top),
                    // The draw reads the row (through the filter, as after `Sequence::decode`);
                    // greedy with ignore_eos over more end ids than the engine's argmax passes
                    // over included.
                    DecodeOut::Row(row) => {
                        if model.info.vocab_size != row.len() {
                            return bad(format!("a logits row of {} for a vocabulary of {}", row.len(), model.info.vocab_size));
                        }
                        self.logits = row
                    }
                }
                Ok(())
            }
            Some(Pending::VerifyGpu { plan, .. }) => {
                self.timings.predicted_ms += ms;
                let Some(spec) = spec else { return bad("a verify batch fed without its speculator".into()) };
                let read = if outs.iter().all(|o| matches!(o, DecodeOut::Id(_))) {
                    tine_spec::ReadRows::Ids(outs.into_iter().filter_map(|o| if let DecodeOut::Id(i) = o { Some(i) } else { None }).collect())
                } else if outs.iter().all(|o| matches!(o, DecodeOut::TopK(_))) {
                    tine_spec::ReadRows::TopK(outs.into_iter().filter_map(|o| if let DecodeOut::TopK(t) = o { Some(t) } else { None }).collect())
                } else {
                    return bad("a verify batch read back as rows".into());
                };
                let t0 = Instant::now();
                let round = spec.decide_read(plan, seq, &mut self.sampler, read, hidden, cost_ms);
                self.keep_round(round, t0)
            }
            other => {
                self.pending = other;
                bad("rows fed to a batched GPU step with none of its kind pending".into())
            }
        }
    }

    /// [`Generation::step_with`] that leaves the forward the step ends with to the caller, where
    /// it is a plain decode of the emitted token (no speculator, no decided tokens left) or a
    /// speculative round's verify batch: [`Generation::pending_rows`] names the rows, the caller
    /// appends them to `seq` with the forward of its choice (`Model::step_many`, with other
    /// sequences' rows) and hands their logits to [`Generation::feed_rows`]. The tokens drawn are
    /// the same as with `step_with`.
    pub fn step_deferring(&mut self, model: &Model, seq: &mut Sequence, spec: Option<&mut Speculator>) -> Result<StepEvent, GenerateError> {
        self.step_inner(model, seq, spec, Defer::All)
    }

    /// The rows the last [`Generation::step_deferring`] left for the caller to feed, and how
    /// (`tine_runtime::Rows`: a decode, or a verify batch wanting hidden states or not).
    pub fn pending_rows(&self) -> Option<(&[u32], Rows)> {
        match self.pending.as_ref()? {
            Pending::Decode(token) => Some((&token[..], Rows::Decode)),
            Pending::Verify(plan) | Pending::VerifyGpu { plan, .. } => Some((plan.tokens(), plan.rows())),
            Pending::Prefill { at, end, hidden, checkpoint, .. } => Some((&self.req.prompt[*at..*end], Rows::Prefill { hidden: *hidden, checkpoint: *checkpoint })),
        }
    }

    /// The logits (and hidden states, where [`Generation::pending_rows`] asked for them) of the
    /// rows that `pending_rows` named, which the caller fed to `seq`, the milliseconds that
    /// forward took (counted as generation time) and what its rows cost (`cost_ms`: `ms` when it
    /// ran alone; in a batch, what the caller attributes to them). A verify batch's round is
    /// decided here (the accepted drafts kept, the rest rolled back); the adaptive depth reads
    /// `cost_ms` as its verify's cost.
    #[allow(clippy::too_many_arguments)]
    pub fn feed_rows(&mut self, model: &Model, seq: &mut Sequence, spec: Option<&mut Speculator>, logits: Logits, hidden: Option<Hidden>, ms: f64, cost_ms: f64) -> Result<(), GenerateError> {
        let Some(pending) = self.pending.take() else {
            return Err(GenerateError::Internal("rows fed with nothing pending".into()));
        };
        match pending {
            Pending::Decode(_) => {
                self.timings.predicted_ms += ms;
                self.logits = logits.data;
                Ok(())
            }
            Pending::Prefill { at, end, start, chunk, .. } => {
                if let (Some(spec), Some(h)) = (spec, hidden) {
                    spec.keep_prefill_hidden(seq, start, h)?;
                }
                self.timings.prompt_ms += ms;
                self.timings.prompt_n += end - at;
                self.split = (end < chunk.1).then_some(chunk);
                if end == self.req.prompt.len() {
                    self.logits = logits.data;
                    self.prefill_at = None;
                } else {
                    self.prefill_at = Some(end);
                }
                Ok(())
            }
            Pending::Verify(plan) | Pending::VerifyGpu { plan, .. } => {
                self.timings.predicted_ms += ms;
                let Some(spec) = spec else {
                    return Err(GenerateError::Internal("a verify batch fed without its speculator".into()));
                };
                let t0 = Instant::now();
                let eog = model.end_of_generation_tokens();
                let ids_only = self.rows_unread();
                let mut filter = Filter { bias: &self.req.logit_bias, ignore_eos: self.req.ignore_eos, ids_only, eog, grammar: self.req.grammar.as_mut(), fed: 0 };
                let round = spec.decide(plan, seq, &mut self.sampler, &mut filter, logits, hidden, cost_ms);
                self.keep_round(round, t0)
            }
        }
    }

    /// A round decided from rows the caller fed: the grammar back to the mark made when the round
    /// was planned, the round's counts and its tokens kept, the time since `t0` counted.
    fn keep_round(&mut self, round: Result<tine_spec::Round, SpecError>, t0: Instant) -> Result<(), GenerateError> {
        if let Some(g) = self.req.grammar.as_mut() {
            g.rewind()?;
        }
        let round = round?;
        self.timings.draft.add(&round.stats());
        self.decided.extend(round.tokens.into_iter().zip(round.rows));
        self.timings.predicted_ms += t0.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// Runs the forward [`Generation::step_deferring`] left pending on `seq` alone (the batch it
    /// was meant for failed, or there was none) and feeds its rows.
    pub fn feed_alone(&mut self, model: &Model, seq: &mut Sequence, spec: Option<&mut Speculator>) -> Result<(), GenerateError> {
        let Some((tokens, rows)) = self.pending_rows() else { return Ok(()) };
        let tokens = tokens.to_vec();
        let t0 = Instant::now();
        let (logits, hidden) = model.step_many(&mut [(&mut *seq, &tokens[..], rows)])?.pop().expect("one sequence's rows");
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        self.feed_rows(model, seq, spec, logits, hidden, ms, ms)
    }

    /// Whether the last step ran a forward of the target itself (a prompt chunk, a decode, a
    /// speculative round's verify; not a token a round had already decided, nor the rows
    /// [`Generation::step_deferring`] left to the caller).
    pub fn forwarded(&self) -> bool {
        self.forwarded
    }

    fn step_inner(&mut self, model: &Model, seq: &mut Sequence, mut spec: Option<&mut Speculator>, defer: Defer) -> Result<StepEvent, GenerateError> {
        self.forwarded = false;
        if self.pending.is_some() {
            return Err(GenerateError::Internal("a step before the pending rows' logits were fed".into()));
        }
        if let Some(stop) = self.finished {
            return Ok(StepEvent { stop: Some(stop), ..StepEvent::default() });
        }
        if let Some(at) = self.prefill_at {
            if defer == Defer::All && model.batches() {
                // The caller feeds the chunk's next piece (the whole chunk, unless it is longer
                // than a prefill's forward or the model is recurrent) with other sequences' rows;
                // `feed_rows` takes it in.
                self.defer_piece(model, seq, spec, at);
                return Ok(StepEvent::default());
            }
            self.forwarded = true;
            self.prefill_step(model, seq, spec)?;
            return Ok(StepEvent::default());
        }
        let t0 = Instant::now();
        if self.req.n_predict >= 0 && self.generated.len() >= self.req.n_predict as usize {
            return Ok(self.finish(StopType::Limit, None, None));
        }
        let (keep, shiftable) = (self.keep_len(seq), self.can_shift(seq));
        let eog = model.end_of_generation_tokens();
        // A verify then returns each row's greedy id, or its top-k for a sampled draw, instead of
        // the rows (the spec driver picks which from the sampler).
        let ids_only = self.rows_unread();
        let mut filter = Filter { bias: &self.req.logit_bias, ignore_eos: self.req.ignore_eos, ids_only, eog, grammar: self.req.grammar.as_mut(), fed: 0 };
        let (token, row) = match self.decided.pop_front() {
            Some(decided) => decided,
            None => match (self.next.take(), self.top.take()) {
                (Some(token), _) => (token, Vec::new()),
                (None, Some(top)) => (self.sampler.sample_top_k(top), Vec::new()),
                (None, None) => {
                    filter.apply(&mut self.logits)?;
                    let token = self.sampler.sample(&self.logits, seq.tokens());
                    (token, std::mem::take(&mut self.logits))
                }
            },
        };
        if !model.is_end_of_generation(token) {
            if let Some(g) = filter.grammar.as_deref_mut() {
                g.consume(token)?;
            }
        }
        let prob = (self.req.n_probs > 0).then(|| {
            if self.req.post_sampling_probs && !row.is_empty() {
                // The distribution the token was drawn from, best first (ties to the lower id).
                let mut dist = self.sampler.distribution(&row, seq.tokens());
                dist.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                let p = dist.iter().find(|d| d.0 == token).map_or(0.0, |d| d.1);
                let top = dist.iter().take(self.req.n_probs).map(|&(id, p)| (id, p.ln())).collect();
                return TokenProb { id: token, logprob: p.ln(), top };
            }
            let top = top_logprobs(&row, self.req.n_probs);
            let logprob = top.iter().find(|t| t.0 == token).map(|t| t.1).unwrap_or_else(|| top_logprobs_of(&row, token));
            TokenProb { id: token, logprob, top }
        });
        if self.record_logits {
            self.recorded.push(row);
        }
        self.generated.push(token);
        self.timings.predicted_n += 1;
        let event = if model.is_end_of_generation(token) {
            self.finish(StopType::Eos, Some(token), prob)
        } else {
            self.bytes.extend(model.tokenizer.token_bytes(token, false));
            let tail = &self.bytes[self.decoded..];
            let valid = match std::str::from_utf8(tail) {
                Ok(s) => s.len(),
                Err(e) => e.valid_up_to(),
            };
            let before = self.text.len();
            self.text.push_str(std::str::from_utf8(&tail[..valid]).expect("valid_up_to bounds valid UTF-8"));
            self.decoded += valid;
            if let Some((pos, word)) = self.stops.find(&self.text, before) {
                self.stopping_word = word.to_owned();
                self.text.truncate(pos);
                self.finish(StopType::Word, Some(token), prob)
            } else if (self.req.n_predict >= 0 && self.generated.len() >= self.req.n_predict as usize) || (self.decided.is_empty() && seq.len() + 1 >= seq.context() && !shiftable) {
                self.finish(StopType::Limit, Some(token), prob)
            } else {
                if self.decided.is_empty() && seq.len() + 1 >= seq.context() {
                    self.forwarded = true;
                    shift(model, seq, spec.as_deref_mut(), keep, self.chunk)?;
                    self.timings.shifts += 1;
                }
                if !self.decided.is_empty() {
                    // Decided by the last round and already in the sequence.
                } else if let Some(spec) = spec {
                    let max_new = match self.req.n_predict {
                        -1 => usize::MAX,
                        n => (n as usize).saturating_sub(self.generated.len()),
                    };
                    if let Some(g) = filter.grammar.as_deref_mut() {
                        g.mark();
                    }
                    if defer == Defer::Decode {
                        // A round whose rows nobody reads goes to the caller's batched step (its
                        // rows read as ids or top-k); another runs here.
                        let plan = match spec.plan(model, seq, token, max_new, &mut filter) {
                            Ok(p) => p,
                            Err(e) => {
                                if let Some(g) = filter.grammar.as_deref_mut() {
                                    g.rewind()?;
                                }
                                return Err(e.into());
                            }
                        };
                        match Speculator::quick_read(&self.sampler, &filter).and_then(|r| gpu_read(model, &r)) {
                            Some((ban, want)) => self.pending = Some(Pending::VerifyGpu { plan, ban, want }),
                            None => {
                                self.forwarded = true;
                                let round = spec.finish_round(model, seq, plan, &mut self.sampler, &mut filter);
                                if let Some(g) = filter.grammar.as_deref_mut() {
                                    g.rewind()?;
                                }
                                let round = round?;
                                self.timings.draft.add(&round.stats());
                                self.decided.extend(round.tokens.into_iter().zip(round.rows));
                            }
                        }
                    } else if defer == Defer::All {
                        // The caller runs the verify batch; `feed_rows` decides the round (and
                        // rewinds the grammar to the mark).
                        let plan = spec.plan(model, seq, token, max_new, &mut filter);
                        if plan.is_err() {
                            if let Some(g) = filter.grammar.as_deref_mut() {
                                g.rewind()?;
                            }
                        }
                        self.pending = Some(Pending::Verify(plan?));
                    } else {
                        self.forwarded = true;
                        let round = spec.round(model, seq, token, &mut self.sampler, max_new, &mut filter);
                        if let Some(g) = filter.grammar.as_deref_mut() {
                            g.rewind()?;
                        }
                        let round = round?;
                        self.timings.draft.add(&round.stats());
                        self.decided.extend(round.tokens.into_iter().zip(round.rows));
                    }
                } else if defer != Defer::No {
                    // The caller feeds the token; the full row comes back (the draw reads it as
                    // the argmax and top-k paths would: the same token).
                    self.pending = Some(Pending::Decode([token]));
                } else if self.argmax_only() {
                    self.forwarded = true;
                    let banned = if self.req.ignore_eos { eog } else { &[][..] };
                    self.next = Some(seq.decode_argmax_banning(model, token, banned)?);
                } else {
                    self.forwarded = true;
                    let banned = if self.req.ignore_eos { eog } else { &[][..] };
                    // A draw with top-k reads only the k best logits: on the GPU engine only
                    // those cross to the host (None elsewhere: the row).
                    self.top = match self.top_k_only() {
                        Some(k) => seq.decode_top_k(model, token, k, banned)?,
                        None => None,
                    };
                    if self.top.is_none() {
                        self.logits = seq.decode(model, token)?;
                    }
                }
                let safe = self.stops.safe_len(&self.text);
                let text = if safe > self.sent { self.text[self.sent..safe].to_owned() } else { String::new() };
                self.sent = self.sent.max(safe);
                StepEvent { token: Some(token), text, prob, stop: None }
            }
        };
        self.timings.predicted_ms += t0.elapsed().as_secs_f64() * 1e3;
        Ok(event)
    }

    /// Whether the next token is the argmax of the raw logits (less the end-of-generation ids
    /// with `ignore_eos`) and nothing else reads them (no bias, grammar, penalty, logprobs or
    /// recording): then a decode returns only the id (`Sequence::decode_argmax_banning`), which
    /// on a GPU keeps the vocabulary-wide row there.
    /// Greedy sampling draws nothing from the random stream, so the seed's path is unchanged.
    fn argmax_only(&self) -> bool {
        self.rows_unread() && self.sampler.params().is_plain_argmax()
    }

    /// Whether nothing but the draw reads the next logits rows: no bias, grammar, logprobs or
    /// recording. `TINE_ARGMAX_ON_HOST=1` copies every row to the host anyway (to measure the
    /// difference).
    fn rows_unread(&self) -> bool {
        static ON_HOST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        !*ON_HOST.get_or_init(|| std::env::var_os("TINE_ARGMAX_ON_HOST").is_some_and(|v| v == "1"))
            && self.req.logit_bias.is_empty()
            && self.req.grammar.is_none()
            && self.req.n_probs == 0
            && !self.record_logits
    }

    /// Whether the next draw reads only the `k` best raw logits (less the end-of-generation ids
    /// with `ignore_eos`) and nothing else reads the row (no bias, grammar, penalty, logprobs or
    /// recording): then a decode on the GPU engine returns only those (`Sequence::decode_top_k`)
    /// and `Sampler::sample_top_k` draws what `Sampler::sample` would from the row.
    fn top_k_only(&self) -> Option<usize> {
        self.rows_unread().then(|| self.sampler.params().top_k_only(usize::MAX)).flatten()
    }

    /// The tokens a shift keeps at the front: `n_keep` (the prompt for `-1`), at least the first.
    fn keep_len(&self, seq: &Sequence) -> usize {
        let n = if self.req.n_keep < 0 { self.req.prompt.len() } else { self.req.n_keep as usize };
        n.max(1).min(seq.len())
    }

    fn can_shift(&self, seq: &Sequence) -> bool {
        // Something must be left to drop: at least two tokens after the kept ones.
        self.req.context_shift && seq.len() >= self.keep_len(seq) + 2
    }

    fn finish(&mut self, stop: StopType, token: Option<u32>, prob: Option<TokenProb>) -> StepEvent {
        self.finished = Some(stop);
        // Flush: incomplete UTF-8 at the very end is shown lossily; a stop string is cut off.
        if stop != StopType::Word {
            self.text = String::from_utf8_lossy(&self.bytes).into_owned();
        }
        let text = if self.text.len() > self.sent { self.text[self.sent..].to_owned() } else { String::new() };
        self.sent = self.text.len();
        StepEvent { token, text, prob, stop: Some(stop) }
    }
}

/// A context shift: drops the oldest half of the tokens after the first `keep` and evaluates
/// what is left afresh (positions renumbered from 0, the sliding window as the model defines
/// it), so the continuation is exactly what a new request holding those tokens computes.
fn shift(model: &Model, seq: &mut Sequence, spec: Option<&mut Speculator>, keep: usize, chunk: usize) -> Result<(), GenerateError> {
    let old = seq.tokens().to_vec();
    let discard = (old.len() - keep) / 2;
    let new: Vec<u32> = old[..keep].iter().chain(&old[keep + discard..]).copied().collect();
    let mut spec = spec;
    let reuse = match spec.as_deref() {
        Some(spec) => keep.min(spec.reusable(&new)),
        None => keep,
    };
    let reuse = seq.restorable(reuse);
    seq.rollback(reuse)?;
    let mut at = reuse;
    while at < new.len() {
        let end = (at + chunk).min(new.len());
        match spec.as_deref_mut() {
            Some(spec) => {
                spec.prefill_chunk(model, seq, &new[at..end], at == reuse)?;
            }
            None => {
                seq.prefill(model, &new[at..end])?;
            }
        }
        at = end;
    }
    Ok(())
}

/// What plain decoding and every verify row do to the logits before a decision.
struct Filter<'a> {
    bias: &'a [(u32, f32)],
    ignore_eos: bool,
    /// Whether nobody but the draw reads the rows ([`Generation::rows_unread`]).
    ids_only: bool,
    eog: &'a [u32],
    grammar: Option<&'a mut Grammar>,
    /// Drafts consumed tentatively by the grammar in this round.
    fed: usize,
}

impl Filter<'_> {
    fn apply(&mut self, row: &mut [f32]) -> Result<(), GrammarError> {
        for &(t, b) in self.bias {
            if let Some(l) = row.get_mut(t as usize) {
                *l += b;
            }
        }
        match self.grammar.as_deref_mut() {
            Some(g) => g.mask(row, self.eog, self.ignore_eos)?,
            None if self.ignore_eos => {
                for &t in self.eog {
                    if let Some(l) = row.get_mut(t as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            None => {}
        }
        Ok(())
    }
}

impl tine_spec::RowFilter for Filter<'_> {
    fn ids_only(&self) -> Option<Vec<u32>> {
        (self.ids_only && self.bias.is_empty() && self.grammar.is_none()).then(|| if self.ignore_eos { self.eog.to_vec() } else { Vec::new() })
    }

    fn admit(&mut self, drafts: &[u32]) -> usize {
        // An end-of-generation draft is left to the target's own decision.
        let upto = drafts.iter().position(|t| self.eog.contains(t)).unwrap_or(drafts.len());
        match self.grammar.as_deref_mut() {
            Some(g) => g.admissible(&drafts[..upto]),
            None => upto,
        }
    }

    fn prepare(&mut self, i: usize, drafts: &[u32], row: &mut [f32]) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        if let Some(g) = self.grammar.as_deref_mut() {
            while self.fed < i {
                g.consume_tentative(drafts[self.fed])?;
                self.fed += 1;
            }
        }
        self.apply(row)?;
        Ok(())
    }
}

fn top_logprobs_of(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = (logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>()).ln() as f32 + max;
    logits.get(token as usize).map(|l| l - log_sum).unwrap_or(f32::NEG_INFINITY)
}
