//! One [`Drafter`] per [`SpecType`]. All of them draft greedily (argmax), so the driver's
//! acceptance rule can treat the draft distribution `q` as one-hot.

use std::sync::Arc;

use tine_runtime::{Assistant, Hidden, Model, NextNState, Sequence};
use tine_sampling::argmax;

use crate::{DraftInput, Drafter, NextNShare, SpecError, SpecType};

/// The probability of the most likely token, `1 / Σ exp(l - max)`.
fn top_probability(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    (1.0 / sum) as f32
}

/// The next draft from `logits`, or `None` when its probability is under `p_min`. A head with a
/// reduced draft vocabulary scores `vocab[i]` in row `i`.
fn pick(logits: &[f32], p_min: f32, vocab: Option<&[u32]>) -> Option<u32> {
    if p_min > 0.0 && top_probability(logits) < p_min {
        return None;
    }
    let i = argmax(logits);
    Some(vocab.map_or(i, |v| v[i as usize]))
}

fn draft_err(e: tine_runtime::StepError) -> SpecError {
    SpecError::Draft(e)
}

/// Prompt lookup: the longest n-gram (sizes `n_max` down to `n_min`) ending the context that
/// occurred before, most recent occurrence first; proposes the tokens that followed it.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    pub n_min: usize,
    pub n_max: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter { n_min: 2, n_max: 4 }
    }
}

impl NgramDrafter {
    /// The proposal for `ctx` (committed tokens and the pending one), at most `n` tokens.
    pub fn lookup(&self, ctx: &[u32], n: usize) -> Vec<u32> {
        let len = ctx.len();
        for size in (self.n_min.max(1)..=self.n_max).rev() {
            if size >= len {
                continue;
            }
            let suffix = &ctx[len - size..];
            // Most recent earlier occurrence that has at least one token after it.
            for start in (0..len - size).rev() {
                if &ctx[start..start + size] == suffix {
                    let from = start + size;
                    return ctx[from..(from + n).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }
}

impl Drafter for NgramDrafter {
    fn spec_type(&self) -> SpecType {
        SpecType::Ngram
    }

    fn draft(&mut self, input: &DraftInput) -> Result<Vec<u32>, SpecError> {
        Ok(self.lookup(&input.context(), input.n_max))
    }
}

/// A separate draft model with its own sequence, caught up on the target's tokens each round.
pub struct DraftModelDrafter {
    model: Arc<Model>,
    seq: Sequence,
}

impl DraftModelDrafter {
    pub fn new(model: Arc<Model>, target: &Model, context: usize) -> Result<Self, SpecError> {
        if model.info.vocab_size != target.info.vocab_size {
            return Err(SpecError::VocabMismatch { draft: model.info.vocab_size, target: target.info.vocab_size });
        }
        let seq = model.new_sequence(context);
        Ok(DraftModelDrafter { model, seq })
    }
}

impl Drafter for DraftModelDrafter {
    fn spec_type(&self) -> SpecType {
        SpecType::Draft
    }

    fn draft_sequence(&mut self) -> Option<&mut Sequence> {
        Some(&mut self.seq)
    }

    fn draft(&mut self, input: &DraftInput) -> Result<Vec<u32>, SpecError> {
        let ctx = input.context();
        if ctx.len() + input.n_max > self.seq.context() {
            return Ok(Vec::new());
        }
        let common = self.seq.tokens().iter().zip(&ctx).take_while(|(a, b)| a == b).count();
        let keep = self.seq.restorable(common.min(ctx.len() - 1));
        self.seq.rollback(keep).map_err(draft_err)?;
        let mut logits = self.seq.prefill(&self.model, &ctx[keep..]).map_err(draft_err)?;
        let mut drafts = Vec::with_capacity(input.n_max);
        while let Some(d) = pick(&logits, input.p_min, None) {
            drafts.push(d);
            if drafts.len() == input.n_max {
                break;
            }
            logits = self.seq.decode(&self.model, d).map_err(draft_err)?;
        }
        Ok(drafts)
    }
}

/// NextN self-speculation: the target's own MTP head, with its KV cache per sequence.
pub struct MtpDrafter {
    state: NextNState,
    /// Entries built from the target's own hidden states; those past it were built on drafts.
    trusted: usize,
}

impl MtpDrafter {
    pub fn new(target: &Model, context: usize) -> Result<Self, SpecError> {
        let state = target.new_nextn_state(context).ok_or(SpecError::NoNextN(SpecType::DraftMtp))?;
        Ok(MtpDrafter { state, trusted: 0 })
    }
}

impl NextNShare for MtpDrafter {
    fn share(&mut self, len: usize) -> Result<tine_runtime::NextNPrefix, SpecError> {
        self.state.share_prefix(len.min(self.trusted)).map_err(draft_err)
    }

    fn attach(&mut self, prefix: &tine_runtime::NextNPrefix) -> Result<(), SpecError> {
        self.trusted = 0;
        self.state.attach_prefix(prefix).map_err(draft_err)?;
        self.trusted = prefix.len();
        Ok(())
    }

    fn shared_len(&self) -> usize {
        self.state.shared_len()
    }
}

impl Drafter for MtpDrafter {
    fn spec_type(&self) -> SpecType {
        SpecType::DraftMtp
    }
    fn nextn_share(&mut self) -> Option<&mut dyn NextNShare> {
        if self.state.can_share() {
            Some(self)
        } else {
            None
        }
    }
    fn needs_hidden(&self) -> bool {
        true
    }
    fn reusable(&self, tokens: &[u32]) -> usize {
        self.state.reusable(tokens).min(self.trusted)
    }

    fn draft(&mut self, input: &DraftInput) -> Result<Vec<u32>, SpecError> {
        let tokens = input.target.tokens();
        let n = tokens.len();
        let start = input.hidden_start;
        let hidden = match input.hidden {
            Some(h) if self.state.len() >= start && start + h.positions() == n => h,
            _ => return Err(SpecError::OutOfSync(SpecType::DraftMtp, self.state.len().min(start))),
        };
        // Entries from `start` on were built on draft tokens or stale states: rebuild them from
        // the target's hidden states, ending with the pending token (the first draft step).
        self.state.truncate(start).map_err(draft_err)?;
        self.trusted = self.trusted.min(start);
        let mut next: Vec<u32> = tokens[start + 1..].to_vec();
        next.push(input.pending);
        let (mut logits, mut out) = self.state.forward(input.model, tokens[0], hidden, &next).map_err(draft_err)?;
        self.trusted = self.state.len();
        let mut drafts = Vec::with_capacity(input.n_max);
        while let Some(d) = pick(&logits, input.p_min, input.model.nextn_draft_vocab()) {
            drafts.push(d);
            if drafts.len() == input.n_max {
                break;
            }
            let last = out.rows(out.positions() - 1, 1).map_err(draft_err)?;
            (logits, out) = self.state.forward(input.model, tokens[0], &last, &[d]).map_err(draft_err)?;
        }
        Ok(drafts)
    }
}

/// An external assistant head reading the target's KV cache; stateless between rounds.
pub struct AssistantDrafter {
    head: Arc<Assistant>,
}

impl AssistantDrafter {
    pub fn new(head: Arc<Assistant>) -> Self {
        AssistantDrafter { head }
    }
}

impl Drafter for AssistantDrafter {
    fn spec_type(&self) -> SpecType {
        SpecType::DraftAssistant
    }
    fn needs_hidden(&self) -> bool {
        true
    }

    fn draft(&mut self, input: &DraftInput) -> Result<Vec<u32>, SpecError> {
        let n = input.target.len();
        let mut hidden: Hidden = match input.hidden {
            Some(h) if h.positions() > 0 && input.hidden_start + h.positions() == n => h.rows(h.positions() - 1, 1).map_err(draft_err)?,
            _ => return Err(SpecError::OutOfSync(SpecType::DraftAssistant, n.saturating_sub(1))),
        };
        let mut token = input.pending;
        // A chained query must still see a target key through its local layers' windows.
        let steps = input.n_max.min(self.head.max_draft_steps(input.model));
        let mut drafts = Vec::with_capacity(steps);
        for position in n..n + steps {
            let (logits, next) = input.target.assistant_step(input.model, &self.head, &hidden, token, position).map_err(draft_err)?;
            let Some(d) = pick(&logits, input.p_min, self.head.draft_vocab()) else { break };
            drafts.push(d);
            hidden = next;
            token = d;
        }
        Ok(drafts)
    }
}

/// llama.cpp's chained spec types (`--spec-type ngram,draft-mtp`): the n-gram proposal where the
/// context repeats itself, the model drafter elsewhere. A model drafter that reads the target's
/// hidden states must see every committed position, so while the n-gram drafts, the rows it did
/// not read are kept here and handed to it, all together, the next time it drafts.
pub struct ChainDrafter {
    ngram: NgramDrafter,
    then: Box<dyn Drafter>,
    /// Hidden states of committed positions `start..` the second drafter has not read yet.
    backlog: Option<(usize, Hidden)>,
}

impl ChainDrafter {
    pub fn new(ngram: NgramDrafter, then: Box<dyn Drafter>) -> Self {
        ChainDrafter { ngram, then, backlog: None }
    }
}

impl Drafter for ChainDrafter {
    fn spec_type(&self) -> SpecType {
        self.then.spec_type()
    }
    fn needs_hidden(&self) -> bool {
        self.then.needs_hidden()
    }
    fn reusable(&self, tokens: &[u32]) -> usize {
        let own = self.then.reusable(tokens);
        match &self.backlog {
            Some((start, _)) => own.min(*start),
            None => own,
        }
    }

    fn draft_sequence(&mut self) -> Option<&mut Sequence> {
        self.then.draft_sequence()
    }

    fn nextn_share(&mut self) -> Option<&mut dyn NextNShare> {
        // Rows kept back for the model drafter are not in its state yet.
        if self.backlog.is_some() {
            return None;
        }
        self.then.nextn_share()
    }

    fn draft(&mut self, input: &DraftInput) -> Result<Vec<u32>, SpecError> {
        // A backlog that does not end where the new rows begin belongs to an earlier request.
        if let (Some((start, h)), Some(_)) = (&self.backlog, input.hidden) {
            if start + h.positions() != input.hidden_start {
                self.backlog = None;
            }
        }
        let proposal = self.ngram.draft(input)?;
        if !proposal.is_empty() {
            if let Some(h) = input.hidden {
                self.backlog = Some(match self.backlog.take() {
                    Some((start, old)) => (start, old.concat(h).map_err(draft_err)?),
                    None => (input.hidden_start, h.clone()),
                });
            }
            return Ok(proposal);
        }
        match self.backlog.take() {
            Some((start, old)) => {
                let joined = match input.hidden {
                    Some(h) => old.concat(h).map_err(draft_err)?,
                    None => old,
                };
                let caught_up = DraftInput { hidden: Some(&joined), hidden_start: start, ..*input };
                self.then.draft(&caught_up)
            }
            None => self.then.draft(input),
        }
    }
}
