//! Several sequences' rows in one Gemma 4 step (issue 50's batched step): the one-sequence
//! step's launches (`launch_rows` with `StepKv::Batch`) over every entry's rows, each layer's
//! K/V through the batch's `kv_slots` table of the entries' caches (a KV-shared layer reads its
//! source layer's table), the GEMVs of more than 8 rows as groups of 8 (`gemv_wide_rows`), the
//! per-layer inputs and the routed experts per row (each (row, expert) pair alone, as in decode
//! steps), the decode attention and the LM head (with softcapping) on every row. So every row is
//! bit for bit the same row stepped alone on its cache, whatever shares the step. See
//! [`crate::batch`] for the blocks, the padding and the graphs.

use super::*;
use crate::batch::{BatchEntry, EntryCache, GpuBatch};

impl Gemma4Gpu {
    /// Whether batched steps run on this model (its matrices in the wide layout).
    pub fn batches(&self) -> bool {
        self.wide && self.output.as_ref().unwrap_or(&self.embd).wide
    }

    /// The buffers of batched steps of up to `max_rows` rows (at most
    /// [`crate::batch::BATCH_MAX_ROWS`]) over caches of `ctx_len` positions (clamped as
    /// [`Gemma4Gpu::new_cache_typed`] clamps it) with K/V stored as `types`.
    pub fn new_batch(&self, ctx_len: usize, types: KvTypes, max_rows: usize) -> Result<GpuBatch> {
        if !self.batches() {
            return Err(Error::Step { rows: max_rows, pos: 0, what: "a batched step reads the wide layout (TINE_GPU_WIDE=0 is for one-sequence steps)".into() });
        }
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let c = &self.cfg;
        let heads = c.layers.iter().map(|l| l.n_head).max().unwrap_or(0);
        let partials = c.layers.iter().map(|l| l.n_head * Kernels::attn_chunks_max(ctx_len, if l.sliding { c.window } else { 0 }) * (l.head_dim + 2)).max().unwrap_or(0);
        let kv_layers = self.slot.iter().flatten().count();
        GpuBatch::new(&self.stream, ctx_len, types, max_rows, kv_layers, partials, heads, c.vocab)
    }

    /// Runs every entry's tokens in one step (see [`crate::gemma3::Gemma3Gpu::forward_batch`]:
    /// the same contract): returns each entry's rows' greedy ids (passing over `banned` where the
    /// entry asks); every row's logits are those of the same row stepped alone on its cache, bit
    /// for bit. On an error no cache has moved.
    pub fn forward_batch(&self, batch: &mut GpuBatch, entries: &mut [BatchEntry<'_, Gemma4Cache>], banned: &[u32]) -> Result<Vec<Vec<u32>>> {
        self.forward_batch_padded(batch, entries, banned, 0)
    }

    /// [`Self::forward_batch`] padded to at least `pad_to` rows (the warm-up's steps).
    fn forward_batch_padded(&self, batch: &mut GpuBatch, entries: &mut [BatchEntry<'_, Gemma4Cache>], banned: &[u32], pad_to: usize) -> Result<Vec<Vec<u32>>> {
        let list: Vec<(EntryCache<'_>, &[u32], bool)> =
            entries.iter().map(|e| (EntryCache { kv: &e.cache.kv, pos: e.cache.pos, ctx_len: e.cache.ctx_len, types: e.cache.types(), states: Vec::new(), plane: 0 }, e.tokens, e.ban)).collect();
        // One step at a time on the stream and the model's buffers, one-sequence steps included.
        let _block = self.step.lock().expect("a step panicked holding the step block");
        let (rows, padded) = batch.prepare(&self.stream, self.cfg.vocab, &list, banned, pad_to)?;
        drop(list);
        let step = self.ptr(&batch.params);
        // The buffers were allocated at load for PROMPT_ROWS rows (the batch's own for its rows:
        // attention scratch and readout), every row's table entry names an entry whose caches
        // are in every K/V layer's kv_slots, its position inside them (`prepare` checked).
        let ids = batch.run(&self.stream, rows, padded, |b| self.launch_rows(StepKv::Batch(b), step, padded, true, None, &mut |_| Ok(())))?;
        batch.keep_hidden(&self.stream, &self.b.hid, self.cfg.hidden, entries.iter().any(|e| e.hidden))?;
        for entry in entries.iter_mut() {
            entry.cache.pos += entry.tokens.len();
            entry.cache.last = LastStep::default();
        }
        Ok(GpuBatch::split_ids(&ids, entries.iter().map(|e| e.tokens.len())))
    }

    /// Captures the graph of every padded row count a batch of up to `rows` rows runs, stepping
    /// `scratch` (left empty); returns the graphs the batch holds.
    pub fn warm_batch(&self, batch: &mut GpuBatch, scratch: &mut Gemma4Cache, rows: usize) -> Result<usize> {
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

    /// The hidden states of rows `first..first + rows` of `batch`'s last step (after the output norm, as [`Gemma4Gpu::hidden`] reads it),
    /// `rows × hidden`: read back only where an entry of that step asked ([`BatchEntry::hidden`]).
    pub fn batch_hidden(&self, batch: &GpuBatch, first: usize, rows: usize) -> Result<Vec<f32>> {
        Ok(batch.hidden_rows(first, rows, self.cfg.hidden)?.to_vec())
    }

    /// The `k` best `(id, logit)` of each row `first..first + rows` of `batch`'s last step.
    pub fn batch_top_k(&self, batch: &GpuBatch, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        batch.top_k(&self.kernels, &self.stream, first, rows, k)
    }
}

const _: () = assert!(crate::batch::BATCH_MAX_ROWS <= PROMPT_ROWS);
