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
//! step. A step of more than 8 rows is padded to a multiple of 8 with copies of its last row
//! (the same token at the same position of the same cache: they write the bytes that row writes,
//! and their results are never read). The caches can go on with one-sequence steps between
//! batched ones (a prompt through the prompt path, say): a batched step only writes their
//! positions' K/V and moves their length.

use super::*;
use crate::cuda::SeqRow;

/// The most rows of one batched step.
pub const BATCH_MAX_ROWS: usize = 256;

/// The buffers and graphs of batched steps over caches of one context and K/V types.
pub struct GpuBatch {
    ctx_len: usize,
    types: KvTypes,
    /// Padded rows a step can take.
    max_rows: usize,
    params: CudaSlice<StepParams>,
    table: CudaSlice<SeqRow>,
    tokens: CudaSlice<i32>,
    /// Per layer, per entry, its K and V cache pointers (`[layer][padded rows][2]`, the stride the
    /// step's padded row count).
    kv_slots: CudaSlice<u64>,
    partials: CudaSlice<f32>,
    counters: CudaSlice<i32>,
    out: Readout,
    /// Per padded row count, its step's graph.
    graphs: Vec<(usize, Graph)>,
    /// Rows of the last step (its readout rows).
    last_rows: usize,
}

/// One entry of a batched step: its tokens go to `cache`'s next positions; `ban`: its greedy id
/// (and top-k) pass over the step's banned ids (a request with `ignore_eos`).
pub struct BatchEntry<'a> {
    pub cache: &'a mut GpuCache,
    pub tokens: &'a [u32],
    pub ban: bool,
}

impl GpuBatch {
    /// The context of the caches it steps.
    pub fn capacity(&self) -> usize {
        self.ctx_len
    }

    /// The K/V types of the caches it steps.
    pub fn types(&self) -> KvTypes {
        self.types
    }

    /// Most rows of a step.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Graphs captured so far (one per padded row count used).
    pub fn graphs(&self) -> usize {
        self.graphs.len()
    }

    /// Device bytes it holds (its buffers; the graphs' own memory not counted).
    pub fn device_bytes(&self) -> usize {
        self.out.device_bytes() + self.partials.len() * 4 + self.counters.len() * 4 + self.kv_slots.len() * 8 + self.table.len() * std::mem::size_of::<SeqRow>() + self.tokens.len() * 4
    }
}

/// The padded row count of a step of `rows` rows: itself up to 8, else the next multiple of 8.
pub fn padded_rows(rows: usize) -> usize {
    if rows <= MAX_ROWS {
        rows
    } else {
        rows.div_ceil(8) * 8
    }
}

impl Gemma3Gpu {
    /// Whether batched steps run on this model (its matrices in the wide layout).
    pub fn batches(&self) -> bool {
        self.wide && self.output.as_ref().unwrap_or(&self.embd).wide
    }

    /// The buffers of batched steps of up to `max_rows` rows (at most [`BATCH_MAX_ROWS`]) over
    /// caches of `ctx_len` positions (clamped as [`Gemma3Gpu::new_cache_typed`] clamps it) with
    /// K/V stored as `types`.
    pub fn new_batch(&self, ctx_len: usize, types: KvTypes, max_rows: usize) -> Result<GpuBatch> {
        let fail = |what: String| Gemma3GpuError::Step { rows: max_rows, pos: 0, what };
        if !(1..=BATCH_MAX_ROWS).contains(&max_rows) {
            return Err(fail(format!("a batch of {max_rows} rows (1..={BATCH_MAX_ROWS})")));
        }
        if !self.batches() {
            return Err(fail("a batched step reads the wide layout (TINE_GPU_WIDE=0 is for one-sequence steps)".into()));
        }
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let c = &self.cfg;
        let rows = padded_rows(max_rows);
        let chunks_max = Kernels::attn_chunks_max(ctx_len, 0).max(Kernels::attn_chunks_max(ctx_len, c.window));
        Ok(GpuBatch {
            ctx_len,
            types,
            max_rows: rows,
            params: alloc(&self.stream, 1)?,
            table: alloc(&self.stream, rows)?,
            tokens: alloc(&self.stream, rows)?,
            kv_slots: alloc(&self.stream, c.layers * rows * 2)?,
            partials: alloc(&self.stream, rows * c.n_head * chunks_max * (c.head_dim + 2))?,
            counters: alloc(&self.stream, rows * c.n_head)?,
            out: Readout::with_rows(&self.stream, c.vocab, rows)?,
            graphs: Vec::new(),
            last_rows: 0,
        })
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
        let slots0 = batch.kv_slots.device_ptr(s).0;
        // The caches' pointers come from the table; the launch's own are never read.
        let kv = KvPtrs { k: 0, v: 0, types: batch.types };
        for (l, ly) in self.layers.iter().enumerate() {
            let kv_slots = slots0 + (l * rows * 2 * 8) as u64;
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
    pub fn forward_batch(&self, batch: &mut GpuBatch, entries: &mut [BatchEntry<'_>], banned: &[u32]) -> Result<Vec<Vec<u32>>> {
        let rows: usize = entries.iter().map(|e| e.tokens.len()).sum();
        let fail = |what: String| Gemma3GpuError::Step { rows, pos: 0, what };
        let padded = padded_rows(rows);
        if rows == 0 || padded > batch.max_rows {
            return Err(fail(format!("a batched step takes 1 to {} rows", batch.max_rows)));
        }
        if banned.len() > MAX_BANNED {
            return Err(fail(format!("{} banned ids (the argmax passes over at most {MAX_BANNED})", banned.len())));
        }
        let layers = self.cfg.layers;
        let mut table = Vec::with_capacity(padded);
        let mut ids = Vec::with_capacity(padded);
        let mut slots = vec![0u64; layers * padded * 2];
        for (e, entry) in entries.iter().enumerate() {
            let cache = &*entry.cache;
            if cache.ctx_len != batch.ctx_len || cache.types() != batch.types {
                return Err(fail(format!(
                    "entry {e}: a cache of {} positions of {}/{} in a batch of {} of {}/{}",
                    cache.ctx_len,
                    cache.types().k,
                    cache.types().v,
                    batch.ctx_len,
                    batch.types.k,
                    batch.types.v
                )));
            }
            let first = cache.pos;
            if entry.tokens.is_empty() || first + entry.tokens.len() > batch.ctx_len {
                return Err(fail(format!("entry {e}: {} tokens at position {first} (a cache holds {} positions)", entry.tokens.len(), batch.ctx_len)));
            }
            if let Some(t) = entry.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
                return Err(fail(format!("token {t} is outside the vocabulary of {}", self.cfg.vocab)));
            }
            for (j, &t) in entry.tokens.iter().enumerate() {
                table.push(SeqRow { pos: (first + j) as i32, slot: e as i32, first: first as i32, no_ban: (!entry.ban) as i32, ..Default::default() });
                ids.push(t as i32);
            }
            for (l, layer) in cache.kv.iter().enumerate() {
                let ptrs = layer.ptrs(&self.stream);
                slots[(l * padded + e) * 2] = ptrs.k;
                slots[(l * padded + e) * 2 + 1] = ptrs.v;
            }
        }
        // Padding: copies of the last row (they write what it writes).
        let (last_row, last_id) = (*table.last().expect("rows > 0"), *ids.last().expect("rows > 0"));
        table.resize(padded, last_row);
        ids.resize(padded, last_id);
        let mut params = StepParams { pos: 0, rows: padded as i32, n_banned: banned.len() as i32, seq_rows: self.ptr(&batch.table), ..Default::default() };
        for (slot, &t) in params.banned.iter_mut().zip(banned) {
            *slot = t as i32;
        }
        // Ordered on the stream after the previous step, which may still read these blocks.
        self.stream.memcpy_htod(&[params][..], &mut batch.params)?;
        self.stream.memcpy_htod(&table[..], &mut batch.table.slice_mut(..padded))?;
        self.stream.memcpy_htod(&ids[..], &mut batch.tokens.slice_mut(..padded))?;
        self.stream.memcpy_htod(&slots[..], &mut batch.kv_slots.slice_mut(..layers * padded * 2))?;
        if !batch.graphs.iter().any(|(r, _)| *r == padded) {
            self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            // SAFETY: the blocks were written above for `padded` rows, within the batch's rows
            // (and the model's buffers': BATCH_MAX_ROWS <= PROMPT_ROWS); every row's table entry
            // names an entry whose caches are in every layer's kv_slots, its position inside them.
            let launched = unsafe { self.launch_batch(batch, padded) };
            let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            launched?;
            let graph = graph?.ok_or_else(|| fail("the capture made no graph".into()))?;
            graph.upload()?;
            batch.graphs.push((padded, Graph(graph)));
        }
        batch.graphs.iter().find(|(r, _)| *r == padded).expect("captured above").1 .0.launch()?;
        batch.last_rows = 0;
        let all = batch.out.ids_raw(&self.stream, rows)?;
        batch.last_rows = rows;
        for entry in entries.iter_mut() {
            entry.cache.pos += entry.tokens.len();
            entry.cache.last = LastStep::default();
        }
        let mut at = 0;
        Ok(entries
            .iter()
            .map(|e| {
                at += e.tokens.len();
                all[at - e.tokens.len()..at].to_vec()
            })
            .collect())
    }

    /// Captures the graph of every padded row count a batch of up to `rows` rows runs (1 to 8,
    /// then multiples of 8), stepping `scratch` (a cache of the batch's context and types, left
    /// empty) through a step of each: a server does this at start-up, so no request waits for a
    /// capture. Returns the graphs the batch holds.
    pub fn warm_batch(&self, batch: &mut GpuBatch, scratch: &mut GpuCache, rows: usize) -> Result<usize> {
        let rows = padded_rows(rows.clamp(1, batch.max_rows)).min(batch.max_rows);
        let counts: Vec<usize> = (1..=rows.min(MAX_ROWS)).chain((2 * MAX_ROWS..=rows).step_by(MAX_ROWS)).collect();
        for r in counts {
            if batch.graphs.iter().any(|(n, _)| *n == r) || r > scratch.ctx_len {
                continue;
            }
            scratch.truncate(0);
            let tokens = vec![0u32; r];
            self.forward_batch(batch, &mut [BatchEntry { cache: &mut *scratch, tokens: &tokens, ban: false }], &[])?;
        }
        scratch.truncate(0);
        batch.last_rows = 0;
        Ok(batch.graphs.len())
    }

    /// The logits of row `row` of `batch`'s last step (rows in its entries' order).
    pub fn batch_logits_row(&self, batch: &GpuBatch, row: usize) -> Result<Vec<f32>> {
        if row >= batch.last_rows {
            return Err(Gemma3GpuError::Step { rows: batch.last_rows, pos: 0, what: format!("no logits for row {row}") });
        }
        batch.out.row_raw(&self.stream, row)
    }

    /// The `k` best `(id, logit)` of each row `first..first + rows` of `batch`'s last step (the
    /// sampler's order), passing over the step's banned ids where the row's entry asked: what
    /// [`Gemma3Gpu::top_k`] gives for the same row stepped alone.
    pub fn batch_top_k(&self, batch: &GpuBatch, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        if rows == 0 || first + rows > batch.last_rows {
            return Err(Gemma3GpuError::Step { rows: batch.last_rows, pos: 0, what: format!("no rows {first}..{} to read the top {k} of", first + rows) });
        }
        batch.out.check_top_k(rows, 0, k)?;
        let mut out = Vec::with_capacity(rows);
        for r0 in (first..first + rows).step_by(MAX_ROWS) {
            let n = MAX_ROWS.min(first + rows - r0);
            out.extend(batch.out.top_k(&self.kernels, &self.stream, self.ptr(&batch.params), r0, n, k)?);
        }
        Ok(out)
    }
}

const _: () = assert!(BATCH_MAX_ROWS <= PROMPT_ROWS);
