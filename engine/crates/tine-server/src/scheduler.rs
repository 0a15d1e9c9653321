//! The engine thread: N slots, one [`Sequence`] each, stepped round-robin.
//!
//! Invariant: only this thread touches the model and the sequences. Requests arrive over a
//! channel; each step's output goes back over the request's own channel. A client that goes
//! away frees its slot at the next step; an error in one request ends only that request.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;

use tine_engine::{GenerateRequest, Generation, StopType, Timings, TokenProb};
use tine_runtime::{Model, Sequence};
use tine_spec::{SpecFactory, Speculator};
use tokio::sync::mpsc::UnboundedSender;

/// What the engine sends back for a request.
#[derive(Debug, Clone)]
pub enum Event {
    /// A generated token and the text it made safe to show.
    Token {
        id: u32,
        text: String,
        prob: Option<TokenProb>,
    },
    Done(Box<Summary>),
    Error(String),
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
}

pub struct Job {
    pub request: GenerateRequest,
    pub events: UnboundedSender<Event>,
}

struct Slot {
    seq: Sequence,
    /// This slot's drafter state (speculative decoding on).
    spec: Option<Speculator>,
    active: Option<(Generation, UnboundedSender<Event>)>,
    last_used: u64,
}

/// A handle to the engine thread.
#[derive(Clone)]
pub struct Scheduler {
    jobs: mpsc::Sender<Job>,
    pub slots: usize,
}

impl Scheduler {
    pub fn start(model: Arc<Model>, slots: usize, ctx_size: usize, spec: Option<Arc<SpecFactory>>) -> Scheduler {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new().name("tine-engine".into()).spawn(move || run(model, slots, ctx_size, spec, rx)).expect("spawning the engine thread");
        Scheduler { jobs: tx, slots }
    }

    /// Queues a request; events arrive on `events`. Fails only if the engine thread is gone.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        self.jobs.send(job).map_err(|e| e.0)
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn new_speculator(model: &Model, factory: Option<&Arc<SpecFactory>>, seq: &Sequence) -> Option<Speculator> {
    // The factory was checked against this model when the server started.
    factory.map(|f| f.speculator(model, seq.context()).expect("the speculative setup was validated at startup"))
}

fn run(model: Arc<Model>, n_slots: usize, ctx_size: usize, factory: Option<Arc<SpecFactory>>, rx: mpsc::Receiver<Job>) {
    let mut slots: Vec<Slot> = (0..n_slots)
        .map(|_| {
            let seq = model.new_sequence(ctx_size);
            Slot { spec: new_speculator(&model, factory.as_ref(), &seq), seq, active: None, last_used: 0 }
        })
        .collect();
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut clock = 0u64;
    loop {
        let busy = slots.iter().any(|s| s.active.is_some());
        // Block only when there is nothing to do.
        if !busy && queue.is_empty() {
            match rx.recv() {
                Ok(job) => queue.push_back(job),
                Err(_) => return,
            }
        }
        while let Ok(job) = rx.try_recv() {
            queue.push_back(job);
        }
        // Admit queued jobs into free slots: the free slot sharing the longest prompt prefix wins.
        while let Some(job) = queue.front() {
            if job.events.is_closed() {
                queue.pop_front();
                continue;
            }
            let free = slots.iter().enumerate().filter(|(_, s)| s.active.is_none());
            let best = free
                .max_by_key(|(_, s)| {
                    let shared = if job.request.cache_prompt { common_prefix(s.seq.tokens(), &job.request.prompt) } else { 0 };
                    (shared, std::cmp::Reverse(s.last_used))
                })
                .map(|(i, _)| i);
            let Some(i) = best else { break };
            let job = queue.pop_front().expect("front exists");
            clock += 1;
            let slot = &mut slots[i];
            slot.last_used = clock;
            if let (Some(spec), Some(f)) = (slot.spec.as_mut(), factory.as_ref()) {
                // The server's draft settings unless the request brings its own.
                spec.params = f.config.params;
            }
            match Generation::start_with(&model, &mut slot.seq, job.request, slot.spec.as_mut()) {
                Ok(g) => slot.active = Some((g, job.events)),
                Err(e) => {
                    let _ = job.events.send(Event::Error(e.to_string()));
                }
            }
        }
        // One step for every active slot.
        for (i, slot) in slots.iter_mut().enumerate() {
            let Some((g, events)) = slot.active.as_mut() else { continue };
            if events.is_closed() {
                slot.active = None; // the client went away
                continue;
            }
            match g.step_with(&model, &mut slot.seq, slot.spec.as_mut()) {
                Ok(ev) => {
                    if let Some(id) = ev.token {
                        if !(ev.stop == Some(StopType::Eos)) || !ev.text.is_empty() {
                            let _ = events.send(Event::Token { id, text: ev.text, prob: ev.prob });
                        }
                    }
                    if let Some(stop) = ev.stop {
                        let summary = Summary {
                            slot: i,
                            text: g.text().to_owned(),
                            tokens: g.tokens().to_vec(),
                            stop_type: stop,
                            stopping_word: g.stopping_word().to_owned(),
                            timings: g.timings(),
                            prompt_tokens: g.request().prompt.len(),
                            seed: g.seed(),
                        };
                        let _ = events.send(Event::Done(Box::new(summary)));
                        slot.active = None;
                    }
                }
                Err(e) => {
                    let _ = events.send(Event::Error(e.to_string()));
                    // The sequence may be mid-step: forget it rather than trust it.
                    slot.seq.reset();
                    slot.spec = new_speculator(&model, factory.as_ref(), &slot.seq);
                    slot.active = None;
                }
            }
        }
    }
}
