//! Several sequences' rows in one Gemma 3 step (issue 50's batched step, at the engine's level):
//! [`Gemma3Gpu::forward_batch`] runs every entry's rows (a decoding sequence's next token, a
//! speculating one's verify rows, a prompt chunk) as one step over the entries' own caches (each
//! a [`GpuCache`] of the batch's context and K/V types, as `new_cache_typed` makes them for
//! one-sequence steps): one launch of each kernel over all the rows, captured as a CUDA graph per
//! padded row count, held by a [`GpuBatch`] with the step's other buffers.
//!
//! Each row reads its own sequence through [`SeqRow`] and the layer's `kv_slots` table (entry
//! `e`'s K and V caches): `qk_norm_rope_kv` writes its K/V into its cache at its position, the
//! decode attention reads its cache's keys up to it. Every kernel computes a row as a one-row
//! step does: the GEMVs of more than 8 rows run as groups of 8 (`gemv_wide_rows`), so a row's
//! logits are bit for bit those of the same row stepped alone on its cache, whatever shares the
//! step. A step of more than 8 rows is padded to a multiple of 8 with inert copies of its last
//! row (they write no K/V, and their results are never read). The caches can go on with one-sequence steps between
//! batched ones (a prompt through the prompt path, say): a batched step only writes their
//! positions' K/V and moves their length.

use super::*;
use crate::batch::{BatchEntry, EntryCache, GpuBatch};

impl Gemma3Gpu {
    /// Whether batched steps run on this model (its matrices in the wide layout).
    pub fn batches(&self) -> bool {
        self.wide && self.output.as_ref().unwrap_or(&self.embd).wide
    }

    /// The buffers of batched steps of up to `max_rows` rows (at most
    /// [`crate::batch::BATCH_MAX_ROWS`]) over caches of `ctx_len` positions (clamped as
    /// [`Gemma3Gpu::new_cache_typed`] clamps it) with K/V stored as `types`.
    pub fn new_batch(&self, ctx_len: usize, types: KvTypes, max_rows: usize) -> Result<GpuBatch> {
        if !self.batches() {
            return Err(Gemma3GpuError::Step { rows: max_rows, pos: 0, what: "a batched step reads the wide layout (TINE_GPU_WIDE=0 is for one-sequence steps)".into() });
        }
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let c = &self.cfg;
        let chunks_max = Kernels::attn_chunks_max(ctx_len, 0).max(Kernels::attn_chunks_max(ctx_len, c.window));
        GpuBatch::new(&self.stream, ctx_len, types, max_rows, c.layers, c.n_head * chunks_max * (c.head_dim + 2), c.n_head, c.vocab)
    }

    /// The GEMV of a batched step's `rows` rows: `gemv` up to 8 rows, groups of 8 past them.
    ///
    /// # Safety
    /// As [`Kernels::gemv`]'s.
    unsafe fn gemv_batch(&self, rows: usize, k: usize, segs: &[GemvSeg]) -> std::result::Result<(), GpuError> {
        if rows <= MAX_ROWS {
            self.kernels.gemv(&self.stream, rows, k, segs, self.act(0, 0))
        } else {
            self.kernels.gemv_rows(&self.stream, rows, k, segs, self.act(0, 0))
        }
    }

    /// The launches of a batched step of `rows` (padded) rows over `batch`: the one-sequence
    /// step's program with the tokens and positions from the batch's own blocks, each row's K/V
    /// through the layer's `kv_slots` table, the LM head and argmax on every row.
    ///
    /// # Safety
    /// The batch's blocks hold `rows` rows (tokens below the vocabulary, each row's entry in the
    /// `kv_slots` table of every layer, its position inside that entry's cache), `rows` <= the
    /// batch's and the model's buffers' rows.
    unsafe fn launch_batch(&self, batch: &GpuBatch, rows: usize) -> std::result::Result<(), GpuError> {
        let c = &self.cfg;
        let b = &self.b;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let (s, k) = (&self.stream, &self.kernels);
        let step = self.ptr(&batch.params);
        let tokens = Some(self.ptr(&batch.tokens));
        let (qd, kvd) = (c.n_head * c.head_dim, c.n_kv * c.head_dim);
        // The caches' pointers come from the table; the launch's own are never read.
        let kv = KvPtrs { k: 0, v: 0, types: batch.types };
        for (l, ly) in self.layers.iter().enumerate() {
            let kv_slots = batch.kv_slots(s, l, rows);
            let first = if l == 0 {
                self.nq(step, tokens, 0, 0, 2, c.hidden, p(&ly.attn_norm))
            } else {
                self.nq(step, tokens, p(&b.down), p(&self.layers[l - 1].post_ffn_norm), 1, c.hidden, p(&ly.attn_norm))
            };
            k.norm_quant(s, rows, &first)?;
            self.gemv_batch(rows, c.hidden, &[self.seg(&ly.q, &b.q, qd), self.seg(&ly.k, &b.k, kvd), self.seg(&ly.v, &b.v, kvd)])?;
            let local = c.is_local(l);
            k.qk_norm_rope_kv(s, rows, &RopeArgs { kv_slots, ..self.rope_args(ly, local, kv, batch.ctx_len, step) })?;
            let at = AttnArgs { partials: self.ptr(&batch.partials), counters: self.ptr(&batch.counters), kv_slots, ..self.attn_args(kv, batch.ctx_len, local, c.n_head, step) };
            k.attention(s, rows, c.head_dim, &at)?;
            self.gemv_batch(rows, qd, &[self.seg(&ly.o, &b.o, c.hidden)])?;
            k.norm_quant(s, rows, &self.nq(step, tokens, p(&b.o), p(&ly.post_attn_norm), 1, c.hidden, p(&ly.ffn_norm)))?;
            self.gemv_batch(rows, c.hidden, &[self.glu_seg(&ly.gate, &ly.up, c.ff)])?;
            k.norm_quant(s, rows, &self.nq(step, tokens, p(&b.ff), 0, 0, c.ff, 0))?;
            self.gemv_batch(rows, c.ff, &[self.seg(&ly.down, &b.down, c.hidden)])?;
        }
        let last = self.layers.last().expect("a model has layers");
        k.norm_quant(s, rows, &self.nq(step, tokens, p(&b.down), p(&last.post_ffn_norm), 1, c.hidden, p(&self.output_norm)))?;
        let head = self.output.as_ref().unwrap_or(&self.embd);
        self.gemv_batch(rows, c.hidden, &[self.mseg(head, &batch.out.logits, c.vocab)])?;
        k.argmax(s, rows, &batch.out.argmax_args(s, step))?;
        Ok(())
    }

    /// Runs every entry's tokens in one step: an entry's tokens go to its cache's next positions
    /// (a decoding sequence's one token, a verify step's rows, a prompt chunk), at most the
    /// batch's rows in all; every cache of the batch's context and K/V types. Returns each
    /// entry's rows' greedy ids (passing over `banned`, at most [`MAX_BANNED`], where the entry
    /// asks); every row's logits are those of the same row stepped alone on its cache, bit for
    /// bit. On an error no cache has moved (K/V rows past a cache's length may have been written:
    /// they are not its positions). The caches' own last-step readouts are cleared: the rows'
    /// logits are the batch's ([`Gemma3Gpu::batch_logits_row`], [`Gemma3Gpu::batch_top_k`]).
    pub fn forward_batch(&self, batch: &mut GpuBatch, entries: &mut [BatchEntry<'_, GpuCache>], banned: &[u32]) -> Result<Vec<Vec<u32>>> {
        self.forward_batch_padded(batch, entries, banned, 0)
    }

    /// [`Self::forward_batch`] padded to at least `pad_to` rows (the warm-up's steps).
    fn forward_batch_padded(&self, batch: &mut GpuBatch, entries: &mut [BatchEntry<'_, GpuCache>], banned: &[u32], pad_to: usize) -> Result<Vec<Vec<u32>>> {
        let list: Vec<(EntryCache<'_>, &[u32], bool)> =
            entries.iter().map(|e| (EntryCache { kv: &e.cache.kv, pos: e.cache.pos, ctx_len: e.cache.ctx_len, types: e.cache.types(), states: Vec::new(), plane: 0 }, e.tokens, e.ban)).collect();
        // One step at a time on the stream and the model's buffers, one-sequence steps included.
        let _block = self.step.lock().expect("a step panicked holding the step block");
        let (rows, padded) = batch.prepare(&self.stream, self.cfg.vocab, &list, banned, pad_to)?;
        drop(list);
        // SAFETY: `prepare` wrote the blocks for `padded` rows, within the batch's rows (and the
        // model's buffers': BATCH_MAX_ROWS <= PROMPT_ROWS); every row's table entry names an entry
        // whose caches are in every layer's kv_slots, its position inside them.
        let ids = batch.run(&self.stream, rows, padded, |b| unsafe { self.launch_batch(b, padded) })?;
        batch.keep_hidden(&self.stream, &self.b.h, self.cfg.hidden, entries.iter().any(|e| e.hidden))?;
        for entry in entries.iter_mut() {
            entry.cache.pos += entry.tokens.len();
            entry.cache.last = LastStep::default();
        }
        Ok(GpuBatch::split_ids(&ids, entries.iter().map(|e| e.tokens.len())))
    }

    /// Captures the graph of every padded row count a batch of up to `rows` rows runs (1 to 8,
    /// then multiples of 8), stepping `scratch` (a cache of the batch's context and types, left
    /// empty) through a step of each: a server does this at start-up, so no request waits for a
    /// capture. Returns the graphs the batch holds.
    pub fn warm_batch(&self, batch: &mut GpuBatch, scratch: &mut GpuCache, rows: usize) -> Result<usize> {
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

    /// The hidden states of rows `first..first + rows` of `batch`'s last step (the residual stream before the output norm, as [`Gemma3Gpu::hidden`] reads it),
    /// `rows × hidden`: read back only where an entry of that step asked ([`BatchEntry::hidden`]).
    pub fn batch_hidden(&self, batch: &GpuBatch, first: usize, rows: usize) -> Result<Vec<f32>> {
        Ok(batch.hidden_rows(first, rows, self.cfg.hidden)?.to_vec())
    }

    /// The `k` best `(id, logit)` of each row `first..first + rows` of `batch`'s last step (the
    /// sampler's order), passing over the step's banned ids where the row's entry asked: what
    /// [`Gemma3Gpu::forward_top_k`] gives for the same row stepped alone.
    pub fn batch_top_k(&self, batch: &GpuBatch, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        batch.top_k(&self.kernels, &self.stream, first, rows, k)
    }
}

const _: () = assert!(crate::batch::BATCH_MAX_ROWS <= PROMPT_ROWS);
