//! Several sequences' rows in one Qwen3.5 step (issue 50's batched step): the one-sequence
//! step's launches (`launch_rows` with `StepKv::Batch`) over every entry's rows: the attention
//! layers' K/V through the batch's `kv_slots` tables, the delta-net layers' conv and delta rule
//! as one `conv_gated_delta_rule` launch whose block row z runs entry z's rows over that
//! sequence's own state planes from its own start plane (the batch's entry table), the GEMVs of
//! more than 8 rows as groups of 8, the routed experts per (row, expert) pair, the head on every
//! row. So every row is bit for bit the same row stepped alone, and each sequence's planes end
//! as its own step leaves them (a verify batch's row states kept for a rollback). Padding rows
//! belong to no entry and write no K/V. See [`crate::batch`].

use super::*;
use crate::batch::{BatchEntry, EntryCache, GpuBatch};

impl Qwen35Gpu {
    /// Whether batched steps run on this model (its matrices in the wide layout, the conv and
    /// the delta rule fused).
    pub fn batches(&self) -> bool {
        self.wide && self.fused_conv && self.output.as_ref().unwrap_or(&self.embd).wide
    }

    /// The buffers of batched steps of up to `max_rows` rows (at most
    /// [`crate::batch::BATCH_MAX_ROWS`]) over caches of `ctx_len` positions (clamped as
    /// [`Qwen35Gpu::new_cache_typed`] clamps it) with K/V stored as `types`.
    pub fn new_batch(&self, ctx_len: usize, types: KvTypes, max_rows: usize) -> Result<GpuBatch> {
        if !self.batches() {
            return Err(Error::Step {
                rows: max_rows,
                pos: 0,
                what: "a batched step reads the wide layout and the fused delta-net (TINE_GPU_WIDE=0 and TINE_GPU_FUSED_CONV=0 are for one-sequence steps)".into(),
            });
        }
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let c = &self.cfg;
        let full = c.full_attention.iter().filter(|&&f| f).count();
        let partials = c.n_head * Kernels::attn_chunks_max(ctx_len, 0) * (c.head_dim + 2);
        GpuBatch::with_states(&self.stream, ctx_len, types, max_rows, full, c.full_attention.len() - full, partials, c.n_head, c.vocab)
    }

    /// Runs every entry's tokens in one step (see [`crate::gemma3::Gemma3Gpu::forward_batch`]:
    /// the same contract; an entry takes at most 8 rows, fewer than the state planes): returns
    /// each entry's rows' greedy ids. On an error before the launch no cache has moved; a launch
    /// that failed part way may have written planes, and its entries' caches then keep only
    /// position 0 (as a failed one-sequence step leaves them).
    pub fn forward_batch(&self, batch: &mut GpuBatch, entries: &mut [BatchEntry<'_, Qwen35Cache>], banned: &[u32]) -> Result<Vec<Vec<u32>>> {
        self.forward_batch_padded(batch, entries, banned, 0)
    }

    /// [`Self::forward_batch`] padded to at least `pad_to` rows (the warm-up's steps).
    fn forward_batch_padded(&self, batch: &mut GpuBatch, entries: &mut [BatchEntry<'_, Qwen35Cache>], banned: &[u32], pad_to: usize) -> Result<Vec<Vec<u32>>> {
        let rows: usize = entries.iter().map(|e| e.tokens.len()).sum();
        // One step at a time on the stream and the model's buffers, one-sequence steps included
        // (the zeroing below goes onto the stream too).
        let _block = self.step.lock().expect("a step panicked holding the step block");
        for (e, entry) in entries.iter_mut().enumerate() {
            let cache = &mut *entry.cache;
            let fail = |what: String| Error::Step { rows, pos: cache.ring.pos(), what: format!("entry {e}: {what}") };
            if entry.tokens.len() > MAX_ROWS || entry.tokens.len() >= PLANES {
                return Err(fail(format!("{} rows (a batched step takes at most {} a sequence)", entry.tokens.len(), MAX_ROWS.min(PLANES - 1))));
            }
            if cache.ring.broken() {
                return Err(fail("a step failed part way and the recurrent state is lost: truncate to 0 first".into()));
            }
            self.zero_fresh_state(cache)?;
        }
        let list: Vec<(EntryCache<'_>, &[u32], bool)> = entries
            .iter()
            .map(|e| {
                let c = &*e.cache;
                let states = c.conv.iter().zip(&c.ssm).map(|(cv, ss)| (self.ptr(cv), self.ptr(ss))).collect();
                (EntryCache { kv: &c.kv, pos: c.ring.pos(), ctx_len: c.ctx_len, types: c.types(), states, plane: c.ring.plane() }, e.tokens, e.ban)
            })
            .collect();
        let (rows, padded) = batch.prepare(&self.stream, self.cfg.vocab, &list, banned, pad_to)?;
        drop(list);
        let step = self.ptr(&batch.params);
        // The buffers were allocated at load for PROMPT_ROWS rows (the batch's own for its rows),
        // every row's table entry names an entry whose caches are in every layer's tables, its
        // position inside them (`prepare` checked), every entry's rows fewer than its planes.
        let captured = batch.has_graph(padded);
        let ran = batch.run(&self.stream, rows, padded, |b| self.launch_rows(StepKv::Batch(b), step, padded, true, None, &mut |_| Ok(())));
        let ids = match ran {
            Ok(ids) => ids,
            Err(e) => {
                // A capture that failed ran nothing; a graph that was launched may have written
                // planes part way: only position 0 is exact then.
                if captured || batch.has_graph(padded) {
                    for entry in entries.iter_mut() {
                        entry.cache.ring.failed();
                    }
                }
                return Err(e);
            }
        };
        batch.keep_hidden(&self.stream, &self.b.hid, self.cfg.hidden, entries.iter().any(|e| e.hidden))?;
        for entry in entries.iter_mut() {
            entry.cache.ring.stepped(entry.tokens.len());
            entry.cache.last = LastStep::default();
        }
        Ok(GpuBatch::split_ids(&ids, entries.iter().map(|e| e.tokens.len())))
    }

    /// Captures the graph of every padded row count a batch of up to `rows` rows runs, stepping
    /// `scratch` (left empty); returns the graphs the batch holds.
    pub fn warm_batch(&self, batch: &mut GpuBatch, scratch: &mut Qwen35Cache, rows: usize) -> Result<usize> {
        let graphs = batch.warm(rows, |b, r| {
            scratch.truncate(0);
            self.forward_batch_padded(b, &mut [BatchEntry { cache: &mut *scratch, tokens: &[0], ban: false, hidden: false }], &[], r).map(drop)
        });
        scratch.truncate(0);
        graphs
    }

    /// The logits of row `row` of `batch`'s last step (rows in its entries' order).
    pub fn batch_logits_row(&self, batch: &GpuBatch, row: usize) -> Result<Vec<f32>> {
        batch.logits_row(&self.stream, row)
    }

    /// The hidden states of rows `first..first + rows` of `batch`'s last step (after the output norm, as [`Qwen35Gpu::hidden`] reads it),
    /// `rows × hidden`: read back only where an entry of that step asked ([`BatchEntry::hidden`]).
    pub fn batch_hidden(&self, batch: &GpuBatch, first: usize, rows: usize) -> Result<Vec<f32>> {
        Ok(batch.hidden_rows(first, rows, self.cfg.hidden)?.to_vec())
    }

    /// The `k` best `(id, logit)` of each row `first..first + rows` of `batch`'s last step.
    pub fn batch_top_k(&self, batch: &GpuBatch, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        batch.top_k(&self.kernels, &self.stream, first, rows, k)
    }
}
