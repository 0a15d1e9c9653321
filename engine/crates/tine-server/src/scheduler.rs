//! The engine thread: N slots, one [`Sequence`] each, stepped together (continuous batching).
//!
//! Invariant: only this thread touches the model and the sequences. Requests arrive over a
//! channel; each step's output goes back over the request's own channel. A client that goes
//! away frees its slot at the next step; an error in one request ends only that request.
//! Invariant: one step of one slot is one prefill chunk (`ubatch` prompt tokens) or one decode
//! step, and the chunks of all slots in one step of the engine total at most `ubatch` prompt
//! tokens (at least one chunk; the prefilling slots take turns, [`prompt_turns`]), so prompts
//! never stall the decoding slots for more than one chunk.
//! Invariant: a failed step leaves the slot's sequence as it was (the runtime's steps are
//! atomic), so the slot keeps its cached prefix; only the drafter state is rebuilt.
//! Invariant: at most `slots + max_queue` requests are admitted at once ([`Admission`]); each
//! holds a [`Permit`] until the engine drops it, and the rest are refused at the edge.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use tine_engine::{GenerateError, Generation, StopType, Timings, TokenProb, ValidRequest};
use tine_runtime::{Model, Rows, RowsRead, Sequence, SlotFileError, SlotImage, StepError};
use tine_spec::{SpecChoice, SpecConfig, SpecFactory, SpecType, Speculator};
use tokio::sync::mpsc::UnboundedSender;

use crate::prefix_pool::{Node, PoolStats, PrefixPool, Shared, MIN_NEW_PREFIX};

/// What the engine sends back for a request.
#[derive(Debug)]
pub enum Event {
    /// A generated token and the text it made safe to show.
    Token {
        id: u32,
        text: String,
        prob: Option<TokenProb>,
        /// The request's timings so far (sent to clients that ask for `timings_per_token`).
        timings: Timings,
    },
    Done(Box<Summary>),
    /// Prompt evaluation so far (llama-server's `prompt_progress`), sent when the job asked:
    /// once when it starts, then after every prompt chunk.
    Progress(Progress),
    /// The request failed; the error keeps its type up to the HTTP edge.
    Error(GenerateError),
}

/// llama-server's `prompt_progress`: the prompt's tokens and the request's timings so far (the
/// tokens reused from the cache, those evaluated, the time spent on them; a stream with
/// `timings_per_token` carries them whole).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    pub total: usize,
    pub timings: Timings,
}

impl Progress {
    fn of(g: &Generation) -> Progress {
        Progress { total: g.request().prompt.len(), timings: g.timings() }
    }
}

/// The end of a request.
#[derive(Debug, Clone)]
pub struct Summary {
    pub slot: usize,
    pub text: String,
    pub tokens: Vec<u32>,
    pub stop_type: StopType,
    pub stopping_word: String,
    pub timings: Timings,
    pub prompt_tokens: usize,
    pub seed: u64,
    /// Generation stopped because the context was full (not at `n_predict`).
    pub truncated: bool,
    /// What it drafted with.
    pub drafter: SpecChoice,
}

/// What a slot action does (llama-server's `/slots/{id}?action=`).
pub enum SlotAction {
    /// Hand back the slot's tokens and KV.
    Save,
    /// Replace the slot's state with this image.
    Restore(Box<SlotImage>),
    /// Forget the slot's tokens and KV.
    Erase,
}

#[derive(Debug)]
pub enum SlotOutcome {
    Saved(Box<SlotImage>),
    Restored { n_restored: usize },
    Erased { n_erased: usize },
}

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("there is no slot {id} (the server has {slots})")]
    NoSuchSlot { id: usize, slots: usize },
    #[error("slot {0} is processing a request; retry when it is idle")]
    Busy(usize),
    #[error("reading the slot's KV failed")]
    Read(#[source] StepError),
    #[error("the slot file cannot be restored")]
    File(#[source] SlotFileError),
}

pub struct SlotCommand {
    pub id: usize,
    pub action: SlotAction,
    pub reply: tokio::sync::oneshot::Sender<Result<SlotOutcome, SlotError>>,
}

/// What reaches the engine thread.
enum Msg {
    Job(Box<Job>),
    Slot(SlotCommand),
}

pub struct Job {
    /// Validated at the edge for the server's context size.
    pub request: ValidRequest,
    /// `id_slot`: the slot it must run in (it waits for that one); `None`: any free slot.
    pub slot: Option<usize>,
    pub events: UnboundedSender<Event>,
    /// Held until the engine is done with the request.
    pub permit: Permit,
    /// Send [`Event::Progress`] while the prompt is evaluated (`return_progress`).
    pub progress: bool,
}

/// Counts admitted requests (queued or in a slot) against a limit.
#[derive(Clone, Debug)]
pub struct Admission {
    in_flight: Arc<AtomicUsize>,
    limit: usize,
}

/// One admitted request; dropping it frees its place.
#[derive(Debug)]
pub struct Permit(Arc<AtomicUsize>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(limit: usize) -> Admission {
        Admission { in_flight: Arc::new(AtomicUsize::new(0)), limit }
    }
    /// A permit, or `None` when `limit` requests are already admitted.
    pub fn try_admit(&self) -> Option<Permit> {
        self.in_flight.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.limit).then_some(n + 1)).ok().map(|_| Permit(self.in_flight.clone()))
    }
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
    pub fn limit(&self) -> usize {
        self.limit
    }
}

struct Active {
    gen: Generation,
    events: UnboundedSender<Event>,
    _permit: Permit,
    /// A draft model that has not yet looked for a shared prefix (at its first round).
    draft_unshared: bool,
    progress: bool,
}

struct Slot {
    seq: Sequence,
    /// The shared prefix its sequence reads its first positions from, if any.
    prefix: Option<Arc<Node>>,
    /// The same for its draft model's sequence.
    draft_prefix: Option<Arc<Node>>,
    /// The same for its NextN head's entries.
    nextn_prefix: Option<Arc<Node>>,
    /// This slot's drafter state (speculative decoding on).
    spec: Option<Speculator>,
    /// What `spec` drafts with (a request choosing another gets a fresh one).
    choice: SpecChoice,
    active: Option<Active>,
    last_used: u64,
}

/// How the engine thread runs.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub slots: usize,
    pub ctx_size: usize,
    pub spec: Option<Arc<SpecFactory>>,
    /// Prompt tokens evaluated per step of a slot.
    pub ubatch: usize,
    /// Failure injection for tests: when set to `n >= 0`, the next admitted request's sequence
    /// fails its forward after `n` successful ones (then it is reset to -1).
    #[cfg(feature = "failure-injection")]
    pub fault: Option<Arc<std::sync::atomic::AtomicI64>>,
    /// Bytes of KV the shared prefixes may hold (`--cache-ram`; `None`: no limit, `Some(0)`: no
    /// sharing between slots).
    pub cache_ram: Option<usize>,
}

/// What `/slots` shows of one slot; the engine thread updates it on every admission and step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotView {
    pub id: usize,
    pub n_ctx: usize,
    pub is_processing: bool,
    /// The request running there (-1: none yet), numbered in admission order.
    pub id_task: i64,
    /// Positions its KV cache holds (the prefix a new request may reuse).
    pub n_cached: usize,
    /// Of those, the first ones read from a prefix shared with other slots.
    pub n_shared: usize,
}

/// The engine thread has stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the engine thread has stopped")]
pub struct EngineGone;

/// The batched forwards since start ([`Model::step_many`] over the slots' pending rows: decode
/// rows and verify batches).
#[derive(Debug, Default)]
pub struct BatchSizes {
    /// Batched forwards, the slots they carried in all, and the token rows (a verify batch
    /// counts its pending token and its drafts).
    pub steps: std::sync::atomic::AtomicU64,
    pub slots: std::sync::atomic::AtomicU64,
    pub rows: std::sync::atomic::AtomicU64,
    /// The token rows of the largest one.
    pub max: AtomicUsize,
    /// The token rows and the slots of the last one.
    pub last: AtomicUsize,
    pub last_slots: AtomicUsize,
    /// Every forward of the target model, batched or not (prompt chunks, decodes, verifies; not
    /// the drafters'), and the slots they carried: llama-server's `n_decode_total` and busy slots
    /// per decode.
    pub forwards: std::sync::atomic::AtomicU64,
    pub forward_slots: std::sync::atomic::AtomicU64,
}

impl BatchSizes {
    fn record(&self, slots: usize, rows: usize) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.slots.fetch_add(slots as u64, Ordering::Relaxed);
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
        self.max.fetch_max(rows, Ordering::Relaxed);
        self.last.store(rows, Ordering::Relaxed);
        self.last_slots.store(slots, Ordering::Relaxed);
    }

    /// A forward of the target over `slots` slots' rows.
    fn forward(&self, slots: usize) {
        self.forwards.fetch_add(1, Ordering::Relaxed);
        self.forward_slots.fetch_add(slots as u64, Ordering::Relaxed);
    }

    /// The counters now (each read on its own: a scrape may straddle a step).
    pub fn snapshot(&self) -> BatchCounts {
        BatchCounts {
            steps: self.steps.load(Ordering::Relaxed),
            slots: self.slots.load(Ordering::Relaxed),
            rows: self.rows.load(Ordering::Relaxed),
            max: self.max.load(Ordering::Relaxed),
            last: self.last.load(Ordering::Relaxed),
            last_slots: self.last_slots.load(Ordering::Relaxed),
            forwards: self.forwards.load(Ordering::Relaxed),
            forward_slots: self.forward_slots.load(Ordering::Relaxed),
        }
    }
}

/// [`BatchSizes`] read at one moment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchCounts {
    pub steps: u64,
    pub slots: u64,
    pub rows: u64,
    pub max: usize,
    pub last: usize,
    pub last_slots: usize,
    pub forwards: u64,
    pub forward_slots: u64,
}

/// The drafters a server's requests choose among (`speculative.type`): the one `--spec-type`
/// loaded at start-up, every request's default, and those that need nothing loaded (n-grams,
/// and NextN where the target carries its head) on any server.
#[derive(Clone, Debug)]
pub struct Drafting {
    pub factory: Arc<SpecFactory>,
    /// `none` on a server started without `--spec-type`.
    pub default: SpecChoice,
    /// Every choice a request may make, `none` and the default first.
    pub offers: Vec<SpecChoice>,
}

impl Drafting {
    pub fn new(spec: Option<Arc<SpecFactory>>, model: &Model) -> Drafting {
        let (factory, default) = match spec {
            Some(f) => {
                let d = f.default_choice();
                (f, d)
            }
            None => (Arc::new(SpecFactory::load(SpecConfig::new(SpecType::Ngram), model).expect("n-grams of the default sizes load nothing")), SpecChoice::Off),
        };
        let offers = factory.offers(model);
        Drafting { factory, default, offers }
    }

    /// The choice a request makes (its own or the server's).
    pub fn choice(&self, asked: Option<SpecChoice>) -> SpecChoice {
        asked.unwrap_or(self.default)
    }
}

/// A handle to the engine thread.
#[derive(Clone)]
pub struct Scheduler {
    jobs: mpsc::Sender<Msg>,
    pub slots: usize,
    /// What requests draft with (`speculative.type`).
    pub drafting: Arc<Drafting>,
    views: Arc<Mutex<Vec<SlotView>>>,
    pool: Arc<Mutex<PoolStats>>,
    batches: Arc<BatchSizes>,
}

impl Scheduler {
    pub fn start(model: Arc<Model>, config: EngineConfig) -> Scheduler {
        let (tx, rx) = mpsc::channel::<Msg>();
        let slots = config.slots.max(1);
        let n_ctx = config.ctx_size.min(model.info.context_length).max(1);
        let views = Arc::new(Mutex::new((0..slots).map(|id| SlotView { id, n_ctx, id_task: -1, ..SlotView::default() }).collect()));
        let pool = Arc::new(Mutex::new(PoolStats::default()));
        let batches = Arc::new(BatchSizes::default());
        let drafting = Arc::new(Drafting::new(config.spec.clone(), &model));
        let (v, p, b, d) = (views.clone(), pool.clone(), batches.clone(), drafting.clone());
        std::thread::Builder::new().name("tine-engine".into()).spawn(move || run(model, config, d, rx, v, p, b)).expect("spawning the engine thread");
        Scheduler { jobs: tx, slots, drafting, views, pool, batches }
    }

    /// The batched decode forwards' figures since start.
    pub fn batch_sizes(&self) -> &BatchSizes {
        &self.batches
    }

    /// The shared prefixes' figures, as of the last admission.
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.lock().map(|p| *p).unwrap_or_default()
    }

    /// A snapshot of every slot.
    pub fn slot_views(&self) -> Vec<SlotView> {
        self.views.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Queues a request; events arrive on `events`. Fails only if the engine thread is gone.
    pub fn submit(&self, job: Job) -> Result<(), EngineGone> {
        self.jobs.send(Msg::Job(Box::new(job))).map_err(|_| EngineGone)
    }

    /// Runs a slot action between two engine steps; the outcome arrives on `cmd.reply`.
    pub fn slot_action(&self, cmd: SlotCommand) -> Result<(), EngineGone> {
        self.jobs.send(Msg::Slot(cmd)).map_err(|_| EngineGone)
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A slot's drafter for `choice` (the edge checked the factory serves it). The factory was
/// checked against this model when the server started, so this fails only when a drafter's
/// state cannot be made (memory, a device); the slot then decodes without speculation (the same
/// output, since speculation is lossless) and says so.
fn new_speculator(model: &Model, drafting: &Drafting, choice: SpecChoice, seq: &Sequence) -> Option<Speculator> {
    match drafting.factory.speculator_for(choice, model, seq.context()) {
        Ok(spec) => spec,
        Err(e) => {
            eprintln!("warning: a slot's drafter could not be made ({}); the slot decodes without speculation", tine_engine::error_chain(&e));
            None
        }
    }
}

/// Runs one request's part of an engine step, a panic (a broken invariant: a bug) turned into
/// [`GenerateError::Internal`]. The engine thread, and every other slot, go on: the caller
/// fails the request with a 500 and starts the slot afresh ([`reset_slot`]).
fn guarded<T>(f: impl FnOnce() -> Result<T, GenerateError>) -> Result<T, (GenerateError, bool)> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| (e, false)),
        Err(payload) => {
            let what = payload.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| payload.downcast_ref::<String>().cloned()).unwrap_or_else(|| "a panic".into());
            Err((GenerateError::Internal(what), true))
        }
    }
}

/// Clears a failure a test injected that its request left unused.
fn clear_injected(seq: &mut Sequence) {
    #[cfg(feature = "failure-injection")]
    seq.inject_failure(None);
    #[cfg(not(feature = "failure-injection"))]
    let _ = seq;
}

/// A slot after a panic: its state may be anything, so it forgets every position and its
/// prefix, and gets a new drafter.
fn reset_slot(model: &Model, drafting: &Drafting, slot: &mut Slot) {
    slot.active = None;
    slot.prefix = None;
    slot.draft_prefix = None;
    slot.nextn_prefix = None;
    slot.seq.reset();
    clear_injected(&mut slot.seq);
    slot.spec = new_speculator(model, drafting, slot.choice, &slot.seq);
}

fn publish(views: &Mutex<Vec<SlotView>>, i: usize, slot: &Slot, task: Option<i64>) {
    if let Ok(mut v) = views.lock() {
        let view = &mut v[i];
        view.is_processing = slot.active.is_some();
        view.n_cached = slot.seq.len();
        view.n_shared = slot.seq.shared_len();
        if let Some(t) = task {
            view.id_task = t;
        }
    }
}

/// A slot action, on an idle slot only (a request's tokens are not a consistent state to save).
fn slot_action(model: &Model, drafting: &Drafting, slots: &mut [Slot], id: usize, action: SlotAction) -> Result<SlotOutcome, SlotError> {
    let n = slots.len();
    let slot = slots.get_mut(id).ok_or(SlotError::NoSuchSlot { id, slots: n })?;
    if slot.active.is_some() {
        return Err(SlotError::Busy(id));
    }
    match action {
        SlotAction::Save => Ok(SlotOutcome::Saved(Box::new(slot.seq.image(model).map_err(SlotError::Read)?))),
        SlotAction::Restore(img) => {
            let restored = slot.seq.restore_image(model, &img);
            // The drafter's per-position state described the old tokens (a failed restore on the
            // GPU engine may have emptied the sequence).
            if restored.is_ok() || slot.seq.is_empty() {
                slot.spec = new_speculator(model, drafting, slot.choice, &slot.seq);
            }
            restored.map_err(SlotError::File)?;
            Ok(SlotOutcome::Restored { n_restored: slot.seq.len() })
        }
        SlotAction::Erase => {
            let n_erased = slot.seq.len();
            slot.seq.reset();
            slot.spec = new_speculator(model, drafting, slot.choice, &slot.seq);
            Ok(SlotOutcome::Erased { n_erased })
        }
    }
}

/// The states of a slot that can start on a shared prefix: the target's sequence, a draft
/// model's, and a NextN head's entries (each has a pool of its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Which {
    Target,
    Draft,
    NextN,
}

impl Slot {
    fn sequence(&mut self, which: Which) -> Option<&mut Sequence> {
        match which {
            Which::Target => Some(&mut self.seq),
            Which::Draft => self.spec.as_mut()?.draft_sequence(),
            Which::NextN => None,
        }
    }

    fn held(&mut self, which: Which) -> &mut Option<Arc<Node>> {
        match which {
            Which::Target => &mut self.prefix,
            Which::Draft => &mut self.draft_prefix,
            Which::NextN => &mut self.nextn_prefix,
        }
    }

    fn can_share(&mut self, which: Which) -> bool {
        match which {
            Which::NextN => self.spec.as_mut().is_some_and(|s| s.nextn_share().is_some()),
            _ => self.sequence(which).is_some_and(|q| q.can_share()),
        }
    }

    /// What its `which` state holds for a request starting with `prompt`: positions of a
    /// sequence, or trusted entries of a NextN head.
    fn available(&mut self, which: Which, prompt: &[u32]) -> usize {
        match which {
            Which::NextN => self.spec.as_ref().map_or(0, |s| s.reusable(prompt)),
            _ => self.sequence(which).map_or(0, |q| common_prefix(q.tokens(), prompt)),
        }
    }

    fn share(&mut self, which: Which, n: usize) -> Option<Shared> {
        match which {
            Which::NextN => self.spec.as_mut()?.nextn_share()?.share(n).ok().map(Shared::NextN),
            _ => self.sequence(which)?.share_prefix(n).ok().map(Shared::Sequence),
        }
    }

    /// Starts its `which` state on `prefix`; on failure the state is empty.
    fn attach(&mut self, which: Which, prefix: &Shared) -> bool {
        match (which, prefix) {
            (Which::NextN, Shared::NextN(p)) => self.spec.as_mut().and_then(|s| s.nextn_share()).is_some_and(|n| n.attach(p).is_ok()),
            (Which::Target | Which::Draft, Shared::Sequence(p)) => self.sequence(which).is_some_and(|q| q.attach_prefix(p).is_ok()),
            _ => false,
        }
    }

    fn shared_len(&mut self, which: Which) -> usize {
        match which {
            Which::NextN => self.spec.as_mut().and_then(|s| s.nextn_share()).map_or(0, |n| n.shared_len()),
            _ => self.sequence(which).map_or(0, |q| q.shared_len()),
        }
    }
}

/// Starts slot `i`'s `which` state on a shared prefix of `prompt` when that reuses more than
/// its own would: the longest pool entry the prompt starts with, or, at least
/// [`MIN_NEW_PREFIX`] positions longer, what another slot holds of it (shared from there and
/// added to the pool). Returns the positions it reads from the prefix.
fn share_for(slots: &mut [Slot], i: usize, which: Which, prompt: &[u32], pool: &mut PrefixPool, clock: u64) -> usize {
    if prompt.len() < 2 || !slots[i].can_share(which) {
        return 0;
    }
    // The last prompt token is always evaluated (its logits start the generation), and a drafter
    // with per-position state reuses only what it covers itself (share its state first).
    let mut limit = prompt.len() - 1;
    if which == Which::Target {
        limit = limit.min(slots[i].spec.as_ref().map_or(usize::MAX, |s| s.reusable(prompt)));
    }
    let own = slots[i].available(which, prompt).min(limit);
    let pooled = pool.lookup(prompt, limit);
    let pooled_len = pooled.as_ref().map_or(0, |n| n.prefix.len());
    let donor = slots
        .iter_mut()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .filter_map(|(j, s)| s.can_share(which).then(|| (j, s.available(which, prompt).min(limit))))
        .max_by_key(|&(_, n)| n)
        .filter(|&(_, n)| n >= own.max(pooled_len) + MIN_NEW_PREFIX);
    let node = match (donor, pooled) {
        (Some((j, n)), _) => {
            let Some(prefix) = slots[j].share(which, n) else { return 0 };
            let node = Arc::new(Node { prefix, parent: slots[j].held(which).take() });
            *slots[j].held(which) = Some(node.clone());
            pool.insert(node.clone(), clock);
            node
        }
        (None, Some(node)) if node.prefix.len() > own => node,
        _ => return 0,
    };
    let slot = &mut slots[i];
    if slot.attach(which, &node.prefix) {
        pool.touch(&node, clock, node.prefix.len());
        *slot.held(which) = Some(node);
        slot.shared_len(which)
    } else {
        // The state is empty now; it evaluates the whole prompt.
        *slot.held(which) = None;
        0
    }
}

/// Whether a request for `prompt` should wait for a slot that is evaluating the same prefix: it
/// will read at least [`MIN_NEW_PREFIX`] more positions from a shared copy once that slot has
/// them than any other slot or pool entry offers now. With a NextN drafter, a slot has them once
/// its head's entries are built too (at its first round).
fn awaits_prefix(slots: &mut [Slot], pool: &PrefixPool, nextn_pool: &PrefixPool, prompt: &[u32], nextn: bool) -> bool {
    if prompt.len() < 2 {
        return false;
    }
    let limit = prompt.len() - 1;
    // What a slot offers the prompt now: its positions, and with a NextN drafter no more than
    // its head's entries.
    let offers = |s: &mut Slot| {
        let held = if s.seq.can_share() { common_prefix(s.seq.tokens(), prompt) } else { 0 };
        if nextn {
            held.min(if s.can_share(Which::NextN) { s.available(Which::NextN, prompt) } else { 0 })
        } else {
            held
        }
    };
    let pooled = pool.lookup(prompt, limit).map_or(0, |n| n.prefix.len());
    let pooled = if nextn { pooled.min(nextn_pool.lookup(prompt, limit).map_or(0, |n| n.prefix.len())) } else { pooled };
    let mut now = pooled;
    let mut coming = 0;
    for s in slots.iter_mut() {
        let offer = offers(s).min(limit);
        // Still evaluating its prompt, or (a NextN head) about to build its entries at its first
        // round: it will offer what its prompt shares with this one, so what it offers now does
        // not count against waiting for it.
        let soon = s.active.as_ref().is_some_and(|a| a.gen.is_prefilling() || (nextn && a.gen.tokens().len() <= 1));
        if !soon {
            now = now.max(offer);
        }
        if let Some(a) = &s.active {
            if soon && s.seq.can_share() {
                let target = common_prefix(&a.gen.request().prompt, prompt).min(limit);
                // Entry j reads token j + 1: a head offers one entry less than the tokens shared.
                let target = if nextn { target.saturating_sub(1) } else { target };
                if target > offer {
                    coming = coming.max(target);
                }
            }
        }
    }
    coming >= now + MIN_NEW_PREFIX
}

/// Publishes the pools' figures for `/metrics` (hits count the first pool's, the target's).
fn publish_pool(to: &Mutex<PoolStats>, pools: &[&PrefixPool]) {
    if let Ok(mut p) = to.lock() {
        let all: Vec<PoolStats> = pools.iter().map(|q| q.stats()).collect();
        *p = PoolStats {
            entries: all.iter().map(|s| s.entries).sum(),
            bytes: all.iter().map(|s| s.bytes).sum(),
            evictions: all.iter().map(|s| s.evictions).sum(),
            ..all.first().copied().unwrap_or_default()
        };
    }
}

/// Lets go of a slot's shared prefixes once its sequences no longer read from them.
fn release_prefix(slot: &mut Slot) {
    for which in [Which::Target, Which::Draft, Which::NextN] {
        if slot.held(which).is_some() && slot.shared_len(which) == 0 {
            *slot.held(which) = None;
        }
    }
}

fn run(model: Arc<Model>, config: EngineConfig, drafting: Arc<Drafting>, rx: mpsc::Receiver<Msg>, views: Arc<Mutex<Vec<SlotView>>>, pool_stats: Arc<Mutex<PoolStats>>, batch_sizes: Arc<BatchSizes>) {
    // On the CPU the active slots' decode rows and verify batches run as one forward each step,
    // every family (`TINE_CPU_BATCH=0` steps them one at a time, to time one against the other).
    // On the GPU engine (Gemma 3 and 4) the decoding slots' next rows and the speculating slots'
    // verify batches (those read as ids or top-k, with their hidden states for NextN and
    // assistant rounds) run as one engine step (`Model::step_many_gpu`); prompt chunks, drafts
    // and rounds that read whole rows run slot by slot (`TINE_GPU_BATCH=0` steps every slot
    // alone).
    let gpu_batching = model.gpu_batches() && config.slots > 1;
    let batching = !gpu_batching && model.batches() && config.slots > 1 && std::env::var("TINE_CPU_BATCH").map_or(true, |v| v != "0");
    let mut step_cost = StepCost::default();
    // The slot whose prompt chunk goes first in the next step (`prompt_turns`).
    let mut prompt_next = 0usize;
    let mut slots: Vec<Slot> = (0..config.slots.max(1))
        .map(|_| {
            let seq = model.new_sequence(config.ctx_size);
            Slot { spec: new_speculator(&model, &drafting, drafting.default, &seq), choice: drafting.default, seq, prefix: None, draft_prefix: None, nextn_prefix: None, active: None, last_used: 0 }
        })
        .collect();
    let sharing = config.cache_ram != Some(0) && slots.len() > 1;
    // A NextN drafter's entries bound what a slot can reuse of the target's positions (whether
    // this model's NextN drafter shares them: asked of a drafter of one position).
    let nextn = drafting.offers.contains(&SpecChoice::of(SpecType::DraftMtp))
        && drafting.factory.speculator_for(SpecChoice::of(SpecType::DraftMtp), &model, 1).ok().flatten().is_some_and(|mut p| p.nextn_share().is_some());
    // One budget for the pools, the target's, a draft model's and a NextN head's, split in
    // proportion to what a position takes in each (a prefix is usually in all of them).
    let bpp = model.kv_bytes_per_position().unwrap_or(0);
    let draft_bpp = drafting.factory.draft_model().and_then(|m| m.kv_bytes_per_position()).unwrap_or(0);
    let nextn_bpp = if nextn { model.nextn_kv_bytes_per_position().unwrap_or(0) } else { 0 };
    let total = bpp + draft_bpp + nextn_bpp;
    let share = |of: usize| config.cache_ram.map(|b| if of == 0 { 0 } else { (b as u128 * of as u128 / total as u128) as usize });
    let mut pool = PrefixPool::new(share(bpp), bpp);
    let mut draft_pool = PrefixPool::new(share(draft_bpp), draft_bpp);
    let mut nextn_pool = PrefixPool::new(share(nextn_bpp), nextn_bpp);
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut clock = 0u64;
    loop {
        let busy = slots.iter().any(|s| s.active.is_some());
        // Block only when there is nothing to do.
        let mut commands = Vec::new();
        if !busy && queue.is_empty() {
            match rx.recv() {
                Ok(Msg::Job(job)) => queue.push_back(*job),
                Ok(Msg::Slot(cmd)) => commands.push(cmd),
                Err(_) => return,
            }
        }
        while let Ok(msg) = rx.try_recv() {
            match msg {
                Msg::Job(job) => queue.push_back(*job),
                Msg::Slot(cmd) => commands.push(cmd),
            }
        }
        // Slot actions before admissions: they see the slots as the last step left them.
        for cmd in commands {
            let out = slot_action(&model, &drafting, &mut slots, cmd.id, cmd.action);
            if let Some(slot) = slots.get_mut(cmd.id) {
                release_prefix(slot);
                publish(&views, cmd.id, slot, None);
            }
            let _ = cmd.reply.send(out);
        }
        // Clients that went away while queued give their place back now.
        queue.retain(|job| !job.events.is_closed());
        // Admit queued jobs into free slots: the free slot sharing the longest prompt prefix wins.
        // A job whose prompt starts like the one a slot is evaluating waits for it (without a
        // slot), then reads that prefix from it instead of evaluating it again.
        let mut k = 0;
        while k < queue.len() && slots.iter().any(|s| s.active.is_none()) {
            let job = &queue[k];
            if sharing
                && job.request.cache_prompt
                && awaits_prefix(&mut slots, &pool, &nextn_pool, &job.request.prompt, nextn && drafting.choice(job.request.drafter).spec_type() == Some(SpecType::DraftMtp))
            {
                k += 1;
                continue;
            }
            // A job for one slot waits for that slot; the others take any free one.
            let free = slots.iter().enumerate().filter(|(i, s)| s.active.is_none() && job.slot.is_none_or(|want| want == *i));
            let best = free
                .max_by_key(|(_, s)| {
                    let shared = if job.request.cache_prompt { common_prefix(s.seq.tokens(), &job.request.prompt) } else { 0 };
                    (shared, std::cmp::Reverse(s.last_used))
                })
                .map(|(i, _)| i);
            let Some(i) = best else {
                if job.slot.is_some() {
                    // Its slot is busy: it waits there, and the jobs behind it may go on.
                    k += 1;
                    continue;
                }
                break;
            };
            let job = queue.remove(k).expect("a queued job at k");
            clock += 1;
            let slot = &mut slots[i];
            slot.last_used = clock;
            let choice = drafting.choice(job.request.drafter);
            if slot.choice != choice {
                // Another drafter: its state starts empty (and shares no prefix yet).
                slot.choice = choice;
                slot.draft_prefix = None;
                slot.nextn_prefix = None;
                slot.spec = new_speculator(&model, &drafting, choice, &slot.seq);
            }
            if let Some(spec) = slot.spec.as_mut() {
                // The server's draft settings unless the request brings its own.
                spec.params = drafting.factory.config.params;
            }
            if sharing && job.request.cache_prompt {
                // A NextN head's entries first: the target keeps no more than they cover.
                share_for(&mut slots, i, Which::NextN, &job.request.prompt, &mut nextn_pool, clock);
                share_for(&mut slots, i, Which::Target, &job.request.prompt, &mut pool, clock);
                share_for(&mut slots, i, Which::Draft, &job.request.prompt, &mut draft_pool, clock);
                publish_pool(&pool_stats, &[&pool, &draft_pool, &nextn_pool]);
            }
            let slot = &mut slots[i];
            #[cfg(feature = "failure-injection")]
            if let Some(n) = config.fault.as_ref().map(|f| f.swap(-1, Ordering::AcqRel)).filter(|&n| n >= 0) {
                slot.seq.inject_failure(Some(n as usize));
            }
            match guarded(|| Generation::begin_with(&mut slot.seq, job.request, slot.spec.as_mut(), config.ubatch)) {
                Ok(gen) => {
                    let draft_unshared = slot.spec.as_mut().is_some_and(|s| s.draft_sequence().is_some());
                    if job.progress {
                        let _ = job.events.send(Event::Progress(Progress::of(&gen)));
                    }
                    slot.active = Some(Active { gen, events: job.events, _permit: job.permit, draft_unshared, progress: job.progress })
                }
                Err((e, panicked)) => {
                    let _ = job.events.send(Event::Error(e));
                    if panicked {
                        reset_slot(&model, &drafting, slot);
                    }
                }
            }
            release_prefix(slot);
            publish(&views, i, slot, Some(clock as i64 - 1));
        }
        // One step for every active slot. In a batched step a speculating slot's draft depth
        // weighs what its rows add to the step (`StepCost`), not what they cost alone.
        let stepping = slots.iter().filter(|s| s.active.is_some()).count();
        // The prompt chunks of this step: at most `ubatch` tokens in all, the slots taking turns.
        let chunks: Vec<Option<usize>> = slots.iter().map(|s| s.active.as_ref().and_then(|a| a.gen.next_chunk_len(&model))).collect();
        let (may_prefill, next) = prompt_turns(&chunks, prompt_next, config.ubatch);
        prompt_next = next;
        let fitted = if batching || gpu_batching { step_cost.fit() } else { None };
        for slot in slots.iter_mut() {
            if let Some(spec) = slot.spec.as_mut() {
                spec.policy.set_step_cost(fitted.map(|(a, b)| (a / stepping.max(1) as f64, b)));
            }
        }
        for i in 0..slots.len() {
            // A draft model catches up on the prompt at its first round: start it on a prefix
            // another slot's draft model holds (that one's first round came before this one's).
            if sharing && slots[i].active.as_ref().is_some_and(|a| a.draft_unshared && !a.gen.is_prefilling()) {
                let tokens = slots[i].seq.tokens().to_vec();
                share_for(&mut slots, i, Which::Draft, &tokens, &mut draft_pool, clock);
                if let Some(a) = slots[i].active.as_mut() {
                    a.draft_unshared = false;
                }
                publish_pool(&pool_stats, &[&pool, &draft_pool, &nextn_pool]);
            }
            let slot = &mut slots[i];
            let Some(a) = slot.active.as_mut() else { continue };
            if a.events.is_closed() {
                slot.active = None; // the client went away
                publish(&views, i, slot, None);
                continue;
            }
            let was_prefilling = a.gen.is_prefilling();
            if was_prefilling && !may_prefill[i] {
                continue; // its chunk waits for a step with room
            }
            // Where the model batches and another slot steps too, the step's forward is left
            // pending and run below with the other slots' (continuous batching); a slot alone
            // steps as without batching (its decode reads only the argmax, not the row).
            let stepped = if batching && stepping > 1 {
                guarded(|| a.gen.step_deferring(&model, &mut slot.seq, slot.spec.as_mut()))
            } else if gpu_batching && stepping > 1 {
                guarded(|| a.gen.step_deferring_decode(&model, &mut slot.seq, slot.spec.as_mut()))
            } else {
                guarded(|| a.gen.step_with(&model, &mut slot.seq, slot.spec.as_mut()))
            };
            if a.gen.forwarded() {
                batch_sizes.forward(1);
            }
            // A prompt chunk left to the batched forward reports its progress once fed.
            if was_prefilling && a.progress && stepped.is_ok() && a.gen.pending_rows().is_none() {
                let _ = a.events.send(Event::Progress(Progress::of(&a.gen)));
            }
            if let Err((e, true)) = stepped {
                let _ = a.events.send(Event::Error(e));
                reset_slot(&model, &drafting, slot);
                publish(&views, i, slot, None);
                continue;
            }
            let stepped = stepped.map_err(|(e, _)| e);
            if slot.prefix.is_some() {
                release_prefix(slot); // a context shift starts over from position 0
            }
            publish(&views, i, slot, None);
            let Some(a) = slot.active.as_mut() else { continue };
            match stepped {
                Ok(ev) => {
                    if let Some(id) = ev.token {
                        if !(ev.stop == Some(StopType::Eos)) || !ev.text.is_empty() {
                            let _ = a.events.send(Event::Token { id, text: ev.text, prob: ev.prob, timings: a.gen.timings() });
                        }
                    }
                    if let Some(stop) = ev.stop {
                        let g = &a.gen;
                        let summary = Summary {
                            drafter: slot.choice,
                            slot: i,
                            text: g.text().to_owned(),
                            tokens: g.tokens().to_vec(),
                            stop_type: stop,
                            stopping_word: g.stopping_word().to_owned(),
                            timings: g.timings(),
                            prompt_tokens: g.request().prompt.len(),
                            seed: g.seed(),
                            // Stopped by the context, or went on after dropping part of it.
                            truncated: (stop == StopType::Limit && !(g.request().n_predict >= 0 && g.tokens().len() >= g.request().n_predict as usize)) || g.timings().shifts > 0,
                        };
                        let _ = a.events.send(Event::Done(Box::new(summary)));
                        slot.active = None;
                        release_prefix(slot);
                        clear_injected(&mut slot.seq);
                        publish(&views, i, slot, None);
                    }
                }
                Err(e) => {
                    let _ = a.events.send(Event::Error(e));
                    slot.active = None;
                    // The sequence is as before the failed step (steps are atomic) and keeps
                    // its prefix; the drafter's own state may be mid-round, so it starts over.
                    clear_injected(&mut slot.seq);
                    slot.spec = new_speculator(&model, &drafting, slot.choice, &slot.seq);
                    publish(&views, i, slot, None);
                }
            }
        }
        if batching {
            feed_pending(&model, &drafting, &mut slots, &views, &batch_sizes, &mut step_cost);
        }
        if gpu_batching {
            feed_pending_gpu(&model, &drafting, &mut slots, &views, &batch_sizes, &mut step_cost);
        }
    }
}

/// Runs the forwards the slots' steps left pending ([`Generation::step_deferring`]: decode rows
/// and speculative verify batches) as one `Model::step_many` and hands each slot its rows: each
/// slot's rows are the bits its own forward gives, so a request's tokens do not depend on what
/// shares its steps. If the batch fails, each slot runs its forward alone, so that an error stays
/// with the slot it belongs to.
fn feed_pending(model: &Model, drafting: &Drafting, slots: &mut [Slot], views: &Mutex<Vec<SlotView>>, batch_sizes: &BatchSizes, cost: &mut StepCost) {
    let pending: Vec<usize> = (0..slots.len()).filter(|&i| slots[i].active.as_ref().is_some_and(|a| a.gen.pending_rows().is_some())).collect();
    if pending.is_empty() {
        return;
    }
    let t0 = std::time::Instant::now();
    let (rows, share, outs) = {
        let mut steps: Vec<(&mut Sequence, &[u32], Rows)> = slots_at(slots, &pending)
            .into_iter()
            .map(|Slot { seq, active, .. }| {
                let (tokens, kind) = active.as_ref().and_then(|a| a.gen.pending_rows()).expect("pending");
                (seq, tokens, kind)
            })
            .collect();
        let rows: usize = steps.iter().map(|(_, t, _)| t.len()).sum();
        let share: Vec<usize> = steps.iter().map(|(_, t, _)| t.len()).collect();
        (rows, share, std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.step_many(&mut steps))))
    };
    batch_sizes.record(pending.len(), rows);
    batch_sizes.forward(pending.len());
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    cost.record(rows, ms);
    match outs {
        Err(_) => reset_panicked(model, drafting, slots, views, &pending),
        Ok(Ok(outs)) => {
            for ((&i, (logits, hidden)), r) in pending.iter().zip(outs).zip(share) {
                let slot = &mut slots[i];
                let Some(a) = slot.active.as_mut() else { continue };
                let c = cost.of(r, rows, pending.len(), ms);
                let prefilling = a.gen.is_prefilling();
                let fed = guarded(|| a.gen.feed_rows(model, &mut slot.seq, slot.spec.as_mut(), logits, hidden, ms, c));
                settle(model, drafting, slots, views, i, prefilling, fed);
            }
        }
        Ok(Err(_)) => feed_each_alone(model, drafting, slots, views, batch_sizes, &pending),
    }
}

/// The slots at `at` (ascending indices), each borrowed on its own.
fn slots_at<'a>(slots: &'a mut [Slot], at: &[usize]) -> Vec<&'a mut Slot> {
    let mut at = at.iter().peekable();
    slots.iter_mut().enumerate().filter_map(|(i, s)| at.next_if(|&&j| j == i).map(|_| s)).collect()
}

/// A batched step panicked (a bug): the caches may hold part of it, so every slot in it starts
/// afresh and its request gets the error.
fn reset_panicked(model: &Model, drafting: &Drafting, slots: &mut [Slot], views: &Mutex<Vec<SlotView>>, pending: &[usize]) {
    for &i in pending {
        let slot = &mut slots[i];
        if let Some(a) = slot.active.as_ref() {
            let _ = a.events.send(Event::Error(GenerateError::Internal("a batched step panicked".into())));
        }
        reset_slot(model, drafting, slot);
        publish(views, i, slot, None);
    }
}

/// A batched step failed with every sequence as it was (the step is atomic): each slot runs its
/// rows alone, so that an error stays with the slot it belongs to.
fn feed_each_alone(model: &Model, drafting: &Drafting, slots: &mut [Slot], views: &Mutex<Vec<SlotView>>, batch_sizes: &BatchSizes, pending: &[usize]) {
    for &i in pending {
        let slot = &mut slots[i];
        let Some(a) = slot.active.as_mut() else { continue };
        batch_sizes.forward(1);
        let prefilling = a.gen.is_prefilling();
        let fed = guarded(|| a.gen.feed_alone(model, &mut slot.seq, slot.spec.as_mut()));
        settle(model, drafting, slots, views, i, prefilling, fed);
    }
}

/// Runs the rows the slots' steps left pending ([`Generation::step_deferring_decode`]: decode
/// rows, and verify batches read as ids or top-k) as GPU engine steps of every slot's rows
/// ([`Model::step_many_gpu`]) and hands each slot its results: each row's bits are those of its
/// own one-sequence step, so a request's tokens do not depend on what shares its steps. If the
/// batch fails, each slot runs its rows alone, so that an error stays with the slot it belongs to.
fn feed_pending_gpu(model: &Model, drafting: &Drafting, slots: &mut [Slot], views: &Mutex<Vec<SlotView>>, batch_sizes: &BatchSizes, cost: &mut StepCost) {
    // Per slot with rows pending: its rows and what they read back (ids or top-k passing over
    // the end ids or not, hidden states for a NextN head or an assistant).
    let pending: Vec<(usize, (Vec<u32>, RowsRead))> = (0..slots.len()).filter_map(|i| slots[i].active.as_ref()?.gen.pending_gpu(model).map(|(t, read)| (i, (t.to_vec(), read)))).collect();
    if pending.is_empty() {
        return;
    }
    let rows: usize = pending.iter().map(|(_, (t, ..))| t.len()).sum();
    let t0 = std::time::Instant::now();
    let at: Vec<usize> = pending.iter().map(|p| p.0).collect();
    let outs = {
        let mut steps: Vec<(&mut Sequence, &[u32], RowsRead)> = slots_at(slots, &at).into_iter().zip(&pending).map(|(slot, (_, (tokens, read)))| (&mut slot.seq, &tokens[..], *read)).collect();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.step_many_gpu(&mut steps)))
    };
    batch_sizes.record(pending.len(), rows);
    batch_sizes.forward(pending.len());
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    cost.record(rows, ms);
    match outs {
        Err(_) => reset_panicked(model, drafting, slots, views, &at),
        Ok(Ok(outs)) => {
            for ((i, (tokens, ..)), out) in pending.iter().zip(outs) {
                let (i, r) = (*i, tokens.len());
                let slot = &mut slots[i];
                let Some(a) = slot.active.as_mut() else { continue };
                // A slot's rows are charged their share of the step (`StepCost::of`).
                let c = cost.of(r, rows, pending.len(), ms);
                let fed = guarded(|| a.gen.feed_gpu(model, &mut slot.seq, slot.spec.as_mut(), out, ms, c));
                settle(model, drafting, slots, views, i, false, fed);
            }
        }
        Ok(Err(_)) => feed_each_alone(model, drafting, slots, views, batch_sizes, &at),
    }
}

/// Which slots evaluate a prompt chunk in this step: `chunks[i]` is slot `i`'s next chunk (its
/// length), `None` where it is not prefilling. The slots take turns from `start` on (round
/// robin, so a short prompt is not stuck behind a long one), as many as fit `budget` prompt
/// tokens, the first always (a chunk larger than the budget still runs, alone). Returns the
/// flags and where the next step starts: after the last slot that had its turn.
fn prompt_turns(chunks: &[Option<usize>], start: usize, budget: usize) -> (Vec<bool>, usize) {
    let n = chunks.len();
    let mut may = vec![false; n];
    let mut used = 0usize;
    let mut next = start;
    for k in 0..n {
        let i = (start + k) % n;
        let Some(len) = chunks[i] else { continue };
        if used > 0 && used + len > budget {
            continue;
        }
        may[i] = true;
        used += len;
        next = (i + 1) % n;
    }
    (may, next)
}

/// What a batched step costs as a function of its rows, `T(R) = a + b R`, fitted by least
/// squares over the recent steps (weights decaying by [`StepCost::DECAY`] a step): `a` is the
/// part every step pays (the weight reads), `b` what each row adds (its arithmetic). A slot's
/// rows are charged `a / S + b r` (S slots in the step, r rows of its own), which is what the
/// adaptive draft depth reads as its verify's cost: while the step is bound by weight reads a
/// draft row is nearly free, once it is bound by arithmetic a draft row costs a decode row.
#[derive(Debug, Default)]
struct StepCost {
    // Decayed sums: weight, R, T, R², R·T.
    w: f64,
    r: f64,
    t: f64,
    rr: f64,
    rt: f64,
}

impl StepCost {
    const DECAY: f64 = 0.98;

    fn record(&mut self, rows: usize, ms: f64) {
        let r = rows as f64;
        let d = Self::DECAY;
        self.w = self.w * d + 1.0;
        self.r = self.r * d + r;
        self.t = self.t * d + ms;
        self.rr = self.rr * d + r * r;
        self.rt = self.rt * d + r * ms;
    }

    /// `(a, b)`, or `None` while the steps seen had (nearly) one row count.
    fn fit(&self) -> Option<(f64, f64)> {
        let var = self.w * self.rr - self.r * self.r;
        if self.w < 2.0 || var <= 1e-6 * self.w * self.w {
            return None;
        }
        let b = ((self.w * self.rt - self.r * self.t) / var).max(0.0);
        let a = ((self.t - b * self.r) / self.w).max(0.0);
        Some((a, b))
    }

    /// The cost charged to `r` of a step's `rows` rows over `slots` slots, which took `ms`
    /// (its rows' share of `ms` until the fit has seen the row count vary).
    fn of(&self, r: usize, rows: usize, slots: usize, ms: f64) -> f64 {
        match self.fit() {
            Some((a, b)) => a / slots.max(1) as f64 + b * r as f64,
            None => ms * r as f64 / rows.max(1) as f64,
        }
    }
}

/// After slot `i`'s pending rows were fed: a prompt chunk (`prefilling`) reports its progress to
/// a client that asked; an error ends its request (a panic resets the slot; otherwise the
/// sequence is as before the step, and the drafter starts over).
#[allow(clippy::too_many_arguments)]
fn settle(model: &Model, drafting: &Drafting, slots: &mut [Slot], views: &Mutex<Vec<SlotView>>, i: usize, prefilling: bool, fed: Result<(), (GenerateError, bool)>) {
    let slot = &mut slots[i];
    let Err((e, panicked)) = fed else {
        if let Some(a) = slot.active.as_ref().filter(|a| prefilling && a.progress) {
            let _ = a.events.send(Event::Progress(Progress::of(&a.gen)));
        }
        return;
    };
    if let Some(a) = slot.active.as_ref() {
        let _ = a.events.send(Event::Error(e));
    }
    if panicked {
        reset_slot(model, drafting, slot);
    } else {
        slot.active = None;
        clear_injected(&mut slot.seq);
        slot.spec = new_speculator(model, drafting, slot.choice, &slot.seq);
    }
    publish(views, i, slot, None);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt chunks of a step total at most the budget (the first always runs), and the
    /// prefilling slots take turns: a short prompt is not stuck behind a long one.
    #[test]
    fn prompt_chunks_share_a_step_budget_and_take_turns() {
        // Slot 0 a long prompt (512-token chunks), slot 2 a short one, slot 1 decoding.
        let chunks = [Some(512), None, Some(10), None];
        let (may, next) = prompt_turns(&chunks, 0, 512);
        assert_eq!((may, next), (vec![true, false, false, false], 1));
        let (may, next) = prompt_turns(&chunks, next, 512);
        assert_eq!((may, next), (vec![false, false, true, false], 3), "the short prompt's turn");
        // Small chunks share one step; the turn wraps around.
        let (may, next) = prompt_turns(&[Some(100), Some(200), None, Some(300)], 3, 512);
        assert_eq!((may, next), (vec![true, false, false, true], 1));
        // A chunk over the budget runs alone; nothing prefilling, nothing runs.
        assert_eq!(prompt_turns(&[Some(900), Some(5)], 0, 512), (vec![true, false], 1));
        assert_eq!(prompt_turns(&[None, None], 1, 512), (vec![false, false], 1));
    }

    /// The step-cost fit recovers `a + b R` from steps of several row counts and charges a slot
    /// its share of `a` plus its own rows' `b`; before the row count varies it splits the step.
    #[test]
    fn step_cost_fits_fixed_and_per_row_parts_and_charges_a_slot_its_rows() {
        let mut c = StepCost::default();
        c.record(4, 40.0);
        assert_eq!(c.of(1, 4, 4, 40.0), 10.0, "one row count seen: the rows' share");
        for (i, rows) in [4usize, 8, 12, 5, 16, 9, 4, 20].iter().cycle().take(60).enumerate() {
            let noise = if i % 2 == 0 { 0.01 } else { -0.01 };
            c.record(*rows, 30.0 + 2.5 * *rows as f64 + noise);
        }
        let (a, b) = c.fit().expect("row counts varied");
        assert!((a - 30.0).abs() < 0.5 && (b - 2.5).abs() < 0.05, "a {a}, b {b}");
        // A slot verifying 4 rows in a step of 8 slots: an eighth of the fixed part plus 4 rows.
        let got = c.of(4, 11, 8, 57.5);
        assert!((got - (a / 8.0 + 4.0 * b)).abs() < 1e-9 && (got - 13.75).abs() < 0.2, "{got}");
        // A step bound by weight reads (no per-row cost) charges only the shared part.
        let mut flat = StepCost::default();
        for rows in [2usize, 6, 3, 9, 2, 6] {
            flat.record(rows, 25.0);
        }
        let (a, b) = flat.fit().expect("varied");
        assert!((a - 25.0).abs() < 1e-6 && b.abs() < 1e-9, "a {a}, b {b}");
    }

    /// Issue 30: a panic inside a request's step (a broken invariant) becomes that request's
    /// internal error; the engine thread does not unwind.
    #[test]
    fn a_panic_in_a_step_becomes_an_internal_error_and_errors_pass_through() {
        let caught = guarded::<()>(|| panic!("a broken invariant"));
        match caught {
            Err((GenerateError::Internal(what), true)) => assert!(what.contains("a broken invariant"), "{what}"),
            other => panic!("expected an internal error from the panic, got {other:?}"),
        }
        let formatted = guarded::<()>(|| panic!("slot {} of {}", 3, 4));
        assert!(matches!(formatted, Err((GenerateError::Internal(ref w), true)) if w == "slot 3 of 4"), "{formatted:?}");
        assert!(matches!(guarded(|| Err::<(), _>(GenerateError::EmptyPrompt)), Err((GenerateError::EmptyPrompt, false))));
        assert_eq!(guarded(|| Ok(7)).ok(), Some(7));
    }
}
