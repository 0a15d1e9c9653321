//! Several sequences' rows in one Gemma 3 step (issue 50's batched step, at the engine's level):
//! a [`GpuBatch`] keeps the K/V of up to `slots` sequences in one pool per layer (slot `s` is KV
//! heads `s · n_kv ..` of the layer's cache: the `[slot][n_kv][ctx][row]` layout the kernels read
//! through a row table), and [`Gemma3Gpu::forward_batch`] runs every entry's rows (a decoding
//! sequence's next token, a speculating one's verify rows, a prompt chunk) as one step: one
//! launch of each kernel over all the rows, captured as a CUDA graph per padded row count.
//!
//! Each row reads its own sequence through [`SeqRow`] (`qk_norm_rope_kv` writes its K/V into its
//! slot at its position, the decode attention reads its slot's keys up to it), and every kernel
//! computes a row as a one-row step does: the GEMVs of more than 8 rows run as groups of 8
//! (`gemv_wide_rows`), so a row's logits are bit for bit those of the same row stepped alone,
//! whatever shares the step. A step of more than 8 rows is padded to a multiple of 8 with inert
//! rows (token 0 at positions 0.. of the pool's last slot, which no sequence owns); their results
//! are never read.

use super::*;
use crate::cuda::SeqRow;

/// The most rows of one batched step.
pub const BATCH_MAX_ROWS: usize = 256;

/// The K/V pool of a batched step's sequences and the step's own buffers.
pub struct GpuBatch {
    /// Per layer, `slots + 1` sequences' K and V (the last slot the padding rows').
    kv: Vec<KvLayer>,
    slots: usize,
    ctx_len: usize,
    /// Positions each slot holds.
    pos: Vec<usize>,
    max_rows: usize,
    params: CudaSlice<StepParams>,
    table: CudaSlice<SeqRow>,
    tokens: CudaSlice<i32>,
    partials: CudaSlice<f32>,
    counters: CudaSlice<i32>,
    out: Readout,
    /// Per padded row count, its step's graph.
    graphs: Vec<(usize, Graph)>,
    /// Rows of the last step (its readout rows).
    last_rows: usize,
}

impl GpuBatch {
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Positions slot `slot` holds.
    pub fn len(&self, slot: usize) -> usize {
        self.pos[slot]
    }

    /// Positions a slot can hold.
    pub fn capacity(&self) -> usize {
        self.ctx_len
    }

    /// Forgets slot `slot`'s positions from `len` on (its next rows overwrite them).
    pub fn truncate(&mut self, slot: usize, len: usize) {
        self.pos[slot] = self.pos[slot].min(len);
    }

    /// Device bytes of its K/V pool.
    pub fn kv_bytes(&self) -> usize {
        self.kv.iter().map(KvLayer::bytes).sum()
    }

    /// Graphs captured so far (one per padded row count used).
    pub fn graphs(&self) -> usize {
        self.graphs.len()
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
    /// A pool for `slots` sequences of `ctx_len` positions (at most [`Gemma3Gpu::max_ctx`]) with
    /// K/V stored as `types`, for batched steps of up to `max_rows` rows (at most
    /// [`BATCH_MAX_ROWS`]).
    pub fn new_batch(&self, slots: usize, ctx_len: usize, types: KvTypes, max_rows: usize) -> Result<GpuBatch> {
        let fail = |what: String| Gemma3GpuError::Step { rows: max_rows, pos: 0, what };
        if slots == 0 || !(1..=BATCH_MAX_ROWS).contains(&max_rows) {
            return Err(fail(format!("a batch of {slots} slots and {max_rows} rows (1..={BATCH_MAX_ROWS})")));
        }
        if !self.wide || !self.output.as_ref().unwrap_or(&self.embd).wide {
            return Err(fail("a batched step reads the wide layout (TINE_GPU_WIDE=0 is for one-sequence steps)".into()));
        }
        // (At least 8 positions: the padding slot's inert rows take positions 0..7.)
        let ctx_len = ctx_len.clamp(MAX_ROWS, self.max_ctx.max(MAX_ROWS));
        let c = &self.cfg;
        let kv = (0..c.layers).map(|_| KvLayer::new(&self.stream, types, c.n_kv * (slots + 1), ctx_len, c.head_dim)).collect::<std::result::Result<Vec<_>, _>>()?;
        let rows = padded_rows(max_rows);
        let chunks_max = Kernels::attn_chunks_max(ctx_len, 0).max(Kernels::attn_chunks_max(ctx_len, c.window));
        Ok(GpuBatch {
            kv,
            slots,
            ctx_len,
            pos: vec![0; slots],
            max_rows: rows,
            params: alloc(&self.stream, 1)?,
            table: alloc(&self.stream, rows)?,
            tokens: alloc(&self.stream, rows)?,
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
    /// step's program with the tokens and positions from the batch's own blocks, the attention
    /// over each row's slot, the LM head and argmax on every row.
    ///
    /// # Safety
    /// The batch's blocks hold `rows` rows (tokens below the vocabulary, each row's slot and
    /// position inside the pool), `rows` <= the batch's and the model's buffers' rows.
    unsafe fn launch_batch(&self, batch: &GpuBatch, rows: usize) -> std::result::Result<(), GpuError> {
        let c = &self.cfg;
        let b = &self.b;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let (s, k) = (&self.stream, &self.kernels);
        let step = self.ptr(&batch.params);
        let tokens = Some(self.ptr(&batch.tokens));
        let (qd, kvd) = (c.n_head * c.head_dim, c.n_kv * c.head_dim);
        for (l, ly) in self.layers.iter().enumerate() {
            let first = if l == 0 {
                self.nq(step, tokens, 0, 0, 2, c.hidden, p(&ly.attn_norm))
            } else {
                self.nq(step, tokens, p(&b.down), p(&self.layers[l - 1].post_ffn_norm), 1, c.hidden, p(&ly.attn_norm))
            };
            k.norm_quant(s, rows, &first)?;
            self.gemv_batch(rows, c.hidden, &[self.seg(&ly.q, &b.q, qd), self.seg(&ly.k, &b.k, kvd), self.seg(&ly.v, &b.v, kvd)])?;
            let kv = batch.kv[l].ptrs(s);
            let local = c.is_local(l);
            k.qk_norm_rope_kv(s, rows, &self.rope_args(ly, local, kv, batch.ctx_len, step))?;
            let at = AttnArgs { partials: self.ptr(&batch.partials), counters: self.ptr(&batch.counters), ..self.attn_args(kv, batch.ctx_len, local, c.n_head, step) };
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

    /// Runs every entry's tokens in one step: entry `(slot, tokens)` puts its tokens at its slot's
    /// next positions (a decoding sequence's one token, a verify step's rows, a prompt chunk), in
    /// at most the batch's rows in all, each slot at most once. Returns each entry's rows' greedy
    /// ids (passing over `banned`, at most [`MAX_BANNED`]); every row's logits are those of the
    /// same row stepped alone, bit for bit.
    pub fn forward_batch(&self, batch: &mut GpuBatch, entries: &[(usize, &[u32])], banned: &[u32]) -> Result<Vec<Vec<u32>>> {
        let rows: usize = entries.iter().map(|e| e.1.len()).sum();
        let fail = |what: String| Gemma3GpuError::Step { rows, pos: 0, what };
        let padded = padded_rows(rows);
        if rows == 0 || padded > batch.max_rows {
            return Err(fail(format!("a batched step takes 1 to {} rows", batch.max_rows)));
        }
        if banned.len() > MAX_BANNED {
            return Err(fail(format!("{} banned ids (the argmax passes over at most {MAX_BANNED})", banned.len())));
        }
        let mut seen = vec![false; batch.slots];
        let mut table = Vec::with_capacity(padded);
        let mut ids = Vec::with_capacity(padded);
        for &(slot, tokens) in entries {
            if slot >= batch.slots || std::mem::replace(&mut seen[slot], true) {
                return Err(fail(format!("slot {slot} (the batch has {}; each slot once a step)", batch.slots)));
            }
            let first = batch.pos[slot];
            if tokens.is_empty() || first + tokens.len() > batch.ctx_len {
                return Err(fail(format!("slot {slot}: {} tokens at position {first} (a slot holds {} positions)", tokens.len(), batch.ctx_len)));
            }
            if let Some(t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
                return Err(fail(format!("token {t} is outside the vocabulary of {}", self.cfg.vocab)));
            }
            for (j, &t) in tokens.iter().enumerate() {
                table.push(SeqRow { pos: (first + j) as i32, slot: slot as i32, first: first as i32, kv_end: 0 });
                ids.push(t as i32);
            }
        }
        // Inert rows: token 0 at positions 0.. of the pool's last slot.
        for j in 0..padded - rows {
            table.push(SeqRow { pos: j as i32, slot: batch.slots as i32, first: 0, kv_end: 0 });
            ids.push(0);
        }
        let mut params = StepParams { pos: 0, rows: padded as i32, n_banned: banned.len() as i32, seq_rows: self.ptr(&batch.table), ..Default::default() };
        for (slot, &t) in params.banned.iter_mut().zip(banned) {
            *slot = t as i32;
        }
        // Ordered on the stream after the previous step, which may still read these blocks.
        self.stream.memcpy_htod(&[params][..], &mut batch.params)?;
        self.stream.memcpy_htod(&table[..], &mut batch.table.slice_mut(..padded))?;
        self.stream.memcpy_htod(&ids[..], &mut batch.tokens.slice_mut(..padded))?;
        if !batch.graphs.iter().any(|(r, _)| *r == padded) {
            self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            // SAFETY: the blocks were written above for `padded` rows, within the batch's rows
            // (and the model's buffers': BATCH_MAX_ROWS <= PROMPT_ROWS), each row inside the pool.
            let launched = unsafe { self.launch_batch(batch, padded) };
            let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            launched?;
            let graph = graph?.ok_or_else(|| fail("the capture made no graph".into()))?;
            graph.upload()?;
            batch.graphs.push((padded, Graph(graph)));
        }
        batch.graphs.iter().find(|(r, _)| *r == padded).expect("captured above").1 .0.launch()?;
        for &(slot, tokens) in entries {
            batch.pos[slot] += tokens.len();
        }
        batch.last_rows = rows;
        let all = batch.out.ids_raw(&self.stream, rows)?;
        let mut at = 0;
        Ok(entries
            .iter()
            .map(|e| {
                at += e.1.len();
                all[at - e.1.len()..at].to_vec()
            })
            .collect())
    }

    /// The logits of row `row` of `batch`'s last step (rows in its entries' order).
    pub fn batch_logits_row(&self, batch: &GpuBatch, row: usize) -> Result<Vec<f32>> {
        if row >= batch.last_rows {
            return Err(Gemma3GpuError::Step { rows: batch.last_rows, pos: 0, what: format!("no logits for row {row}") });
        }
        batch.out.row_raw(&self.stream, row)
    }
}

const _: () = assert!(BATCH_MAX_ROWS <= PROMPT_ROWS);
