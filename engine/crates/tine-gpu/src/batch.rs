//! The family-independent half of a batched step (issue 50): several sequences' rows in one
//! step of a family's program, each row over its own sequence's caches. [`GpuBatch`] holds the
//! step's blocks (the step params, the row table, the token ids, each layer's `kv_slots` table of
//! the entries' K/V cache pointers), its attention scratch, its readout (logits, greedy ids,
//! top-k) and a CUDA graph per padded row count; [`GpuBatch::prepare`] writes the blocks for a
//! step's entries and [`GpuBatch::run`] replays (or first captures) the graph a family's launch
//! list makes. The families' `forward_batch` (Gemma 3's `gemma3/batch.rs`, Gemma 4's
//! `gemma4/batch.rs`) are these two around their launches.
//!
//! A step of more than 8 rows is padded to a multiple of 8 with copies of its last row, marked
//! inert (`SeqRow::inert`: they write no K/V and belong to no entry of a recurrent layer's
//! table); their results are never read.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};

use crate::cuda::{DevPtr, GpuError, KvLayer, KvTypes, SeqRow, StepParams, MAX_BANNED, MAX_ROWS};
use crate::gemma3::{alloc, Gemma3GpuError as Error, Graph};
use crate::readout::Readout;

type Result<T> = std::result::Result<T, Error>;

/// The most rows of one batched step.
pub const BATCH_MAX_ROWS: usize = 256;

pub use crate::rows::padded_rows;
use crate::rows::{slot_index, step_tables, EntryRows};

/// The buffers and graphs of batched steps over caches of one context and K/V types.
pub struct GpuBatch {
    pub(crate) ctx_len: usize,
    pub(crate) types: KvTypes,
    /// Padded rows a step can take.
    pub(crate) max_rows: usize,
    /// K/V layers of a sequence's caches (the `kv_slots` tables' count).
    kv_layers: usize,
    /// Recurrent layers of a sequence's state (the `ent_planes` tables' count; 0 without).
    state_layers: usize,
    /// A recurrent layer's entry table: per entry (as many as the step's padded rows) its first
    /// row, rows and start plane (`[padded][3]`; 0 rows past the step's entries).
    ent_rows: CudaSlice<i32>,
    /// Per recurrent layer, per entry, its conv windows and delta-rule states
    /// (`[layer][padded][2]`).
    ent_planes: CudaSlice<u64>,
    pub(crate) params: CudaSlice<StepParams>,
    table: CudaSlice<SeqRow>,
    pub(crate) tokens: CudaSlice<i32>,
    /// Per K/V layer, per entry, its K and V cache pointers (`[layer][padded rows][2]`, the
    /// stride the step's padded row count).
    kv_slots: CudaSlice<u64>,
    pub(crate) partials: CudaSlice<f32>,
    pub(crate) counters: CudaSlice<i32>,
    pub(crate) out: Readout,
    /// Per padded row count, its step's graph.
    graphs: Vec<(usize, Graph)>,
    /// Rows of the last step (its readout rows).
    pub(crate) last_rows: usize,
    /// The last step's hidden states (`last_rows × width`, the family's `hidden()` rows), read
    /// back when one of its entries asked ([`BatchEntry::hidden`]); empty otherwise.
    hidden: Vec<f32>,
}

/// One entry of a batched step: its tokens go to `cache`'s next positions; `ban`: its greedy id
/// (and top-k) pass over the step's banned ids (a request with `ignore_eos`); `hidden`: its
/// rows' hidden states are read back ([`GpuBatch::hidden_rows`]: a NextN head or an assistant
/// drafts from them).
pub struct BatchEntry<'a, C> {
    pub cache: &'a mut C,
    pub tokens: &'a [u32],
    pub ban: bool,
    pub hidden: bool,
}

/// Ends a stream's capture when dropped (a panic between its begin and its end).
struct Capturing<'a>(&'a Arc<CudaStream>);

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        let _ = self.0.end_capture(sys::CUgraphInstantiate_flags(0));
    }
}

/// What [`GpuBatch::prepare`] reads of an entry's cache.
pub(crate) struct EntryCache<'a> {
    pub(crate) kv: &'a [KvLayer],
    pub(crate) pos: usize,
    pub(crate) ctx_len: usize,
    pub(crate) types: KvTypes,
    /// Per recurrent layer, its conv windows' and delta-rule states' planes (empty without).
    pub(crate) states: Vec<(DevPtr, DevPtr)>,
    /// The plane the sequence's recurrent state starts from.
    pub(crate) plane: usize,
}

impl GpuBatch {
    /// Buffers for steps of up to `max_rows` rows (at most [`BATCH_MAX_ROWS`]) over caches of
    /// `ctx_len` positions and `kv_layers` K/V layers stored as `types`: `partials_row` floats of
    /// attention partials and `heads` counters a row, a readout of `vocab` logits a row.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(stream: &Arc<CudaStream>, ctx_len: usize, types: KvTypes, max_rows: usize, kv_layers: usize, partials_row: usize, heads: usize, vocab: usize) -> Result<GpuBatch> {
        Self::with_states(stream, ctx_len, types, max_rows, kv_layers, 0, partials_row, heads, vocab)
    }

    /// [`GpuBatch::new`] for a family with `state_layers` recurrent layers (their planes in the
    /// entry tables).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn with_states(
        stream: &Arc<CudaStream>,
        ctx_len: usize,
        types: KvTypes,
        max_rows: usize,
        kv_layers: usize,
        state_layers: usize,
        partials_row: usize,
        heads: usize,
        vocab: usize,
    ) -> Result<GpuBatch> {
        if !(1..=BATCH_MAX_ROWS).contains(&max_rows) {
            return Err(Error::Step { rows: max_rows, pos: 0, what: format!("a batch of {max_rows} rows (1..={BATCH_MAX_ROWS})") });
        }
        let rows = padded_rows(max_rows);
        Ok(GpuBatch {
            ctx_len,
            types,
            max_rows: rows,
            kv_layers,
            state_layers,
            ent_rows: alloc(stream, rows * 3)?,
            ent_planes: alloc(stream, state_layers * rows * 2)?,
            params: alloc(stream, 1)?,
            table: alloc(stream, rows)?,
            tokens: alloc(stream, rows)?,
            kv_slots: alloc(stream, kv_layers * rows * 2)?,
            partials: alloc(stream, rows * partials_row)?,
            counters: alloc(stream, rows * heads)?,
            out: Readout::with_rows(stream, vocab, rows)?,
            graphs: Vec::new(),
            last_rows: 0,
            hidden: Vec::new(),
        })
    }

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

    /// Captures the graph of every padded row count a step of up to `rows` rows runs (1 to 8,
    /// then multiples of 8) not captured yet: `step(batch, r)` runs one step padded to `r` rows
    /// (a family's one-token step of a scratch sequence; the padding rows are inert, so the
    /// graph is the same whatever rows it runs). Returns the graphs the batch holds.
    pub(crate) fn warm(&mut self, rows: usize, mut step: impl FnMut(&mut GpuBatch, usize) -> Result<()>) -> Result<usize> {
        let rows = padded_rows(rows.clamp(1, self.max_rows)).min(self.max_rows);
        for r in (1..=rows.min(MAX_ROWS)).chain((2 * MAX_ROWS..=rows).step_by(MAX_ROWS)) {
            if !self.has_graph(r) {
                step(self, r)?;
            }
        }
        Ok(self.graphs())
    }

    /// Whether the graph of `padded` rows is captured.
    pub(crate) fn has_graph(&self, padded: usize) -> bool {
        self.graphs.iter().any(|(r, _)| *r == padded)
    }

    /// Device bytes it holds (its buffers; the graphs' own memory not counted).
    pub fn device_bytes(&self) -> usize {
        self.out.device_bytes()
            + self.partials.len() * 4
            + self.counters.len() * 4
            + (self.kv_slots.len() + self.ent_planes.len()) * 8
            + self.ent_rows.len() * 4
            + self.table.len() * std::mem::size_of::<SeqRow>()
            + self.tokens.len() * 4
    }

    /// The entry table of a step (recurrent layers).
    pub(crate) fn ent_rows(&self, stream: &Arc<CudaStream>) -> DevPtr {
        self.ent_rows.device_ptr(stream).0
    }

    /// The planes table of recurrent layer `layer` in a step of `padded` rows.
    pub(crate) fn ent_planes(&self, stream: &Arc<CudaStream>, layer: usize, padded: usize) -> DevPtr {
        self.ent_planes.device_ptr(stream).0 + (layer * padded * 2 * 8) as u64
    }

    /// The `kv_slots` table of K/V layer `layer` in a step of `padded` rows.
    pub(crate) fn kv_slots(&self, stream: &Arc<CudaStream>, layer: usize, padded: usize) -> DevPtr {
        self.kv_slots.device_ptr(stream).0 + (layer * padded * 2 * 8) as u64
    }

    /// Writes the blocks of a step over `entries` (each: its cache, tokens and `ban`), every
    /// token below `vocab`, padded to at least `pad_to` rows (a warm-up's graph of that many);
    /// returns the step's rows and padded rows. Changes no cache.
    pub(crate) fn prepare(&mut self, stream: &Arc<CudaStream>, vocab: usize, entries: &[(EntryCache<'_>, &[u32], bool)], banned: &[u32], pad_to: usize) -> Result<(usize, usize)> {
        let rows: usize = entries.iter().map(|e| e.1.len()).sum();
        let fail = |what: String| Error::Step { rows, pos: 0, what };
        let padded = padded_rows(rows.max(pad_to));
        if rows == 0 || padded > self.max_rows {
            return Err(fail(format!("a batched step takes 1 to {} rows", self.max_rows)));
        }
        if banned.len() > MAX_BANNED {
            return Err(fail(format!("{} banned ids (the argmax passes over at most {MAX_BANNED})", banned.len())));
        }
        let mut slots = vec![0u64; self.kv_layers * padded * 2];
        let mut ent_planes = vec![0u64; self.state_layers * padded * 2];
        for (e, (cache, tokens, _)) in entries.iter().enumerate() {
            if cache.states.len() != self.state_layers {
                return Err(fail(format!("entry {e}: {} recurrent layers in a batch of {}", cache.states.len(), self.state_layers)));
            }
            if cache.ctx_len != self.ctx_len || cache.types != self.types || cache.kv.len() != self.kv_layers {
                return Err(fail(format!(
                    "entry {e}: a cache of {} positions of {}/{} ({} K/V layers) in a batch of {} of {}/{} ({})",
                    cache.ctx_len,
                    cache.types.k,
                    cache.types.v,
                    cache.kv.len(),
                    self.ctx_len,
                    self.types.k,
                    self.types.v,
                    self.kv_layers
                )));
            }
            if tokens.is_empty() || cache.pos + tokens.len() > self.ctx_len {
                return Err(fail(format!("entry {e}: {} tokens at position {} (a cache holds {} positions)", tokens.len(), cache.pos, self.ctx_len)));
            }
            if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(fail(format!("token {t} is outside the vocabulary of {vocab}")));
            }
            for (l, layer) in cache.kv.iter().enumerate() {
                let ptrs = layer.ptrs(stream);
                slots[slot_index(l, padded, e, 0)] = ptrs.k;
                slots[slot_index(l, padded, e, 1)] = ptrs.v;
            }
            for (l, &(conv, ssm)) in cache.states.iter().enumerate() {
                ent_planes[slot_index(l, padded, e, 0)] = conv;
                ent_planes[slot_index(l, padded, e, 1)] = ssm;
            }
        }
        let rows_of: Vec<EntryRows<'_>> = entries.iter().map(|(cache, tokens, ban)| EntryRows { pos: cache.pos, tokens, ban: *ban, plane: cache.plane }).collect();
        let t = step_tables(&rows_of, pad_to);
        debug_assert_eq!((t.rows, t.padded), (rows, padded));
        let (table, ids, ent) = (t.table, t.ids, t.ent);
        let mut params = StepParams { pos: 0, rows: padded as i32, n_banned: banned.len() as i32, seq_rows: self.table.device_ptr(stream).0, ..Default::default() };
        for (slot, &t) in params.banned.iter_mut().zip(banned) {
            *slot = t as i32;
        }
        // Ordered on the stream after the previous step, which may still read these blocks.
        stream.memcpy_htod(&[params][..], &mut self.params)?;
        stream.memcpy_htod(&table[..], &mut self.table.slice_mut(..padded))?;
        stream.memcpy_htod(&ids[..], &mut self.tokens.slice_mut(..padded))?;
        stream.memcpy_htod(&slots[..], &mut self.kv_slots.slice_mut(..self.kv_layers * padded * 2))?;
        if self.state_layers > 0 {
            stream.memcpy_htod(&ent[..], &mut self.ent_rows.slice_mut(..padded * 3))?;
            stream.memcpy_htod(&ent_planes[..], &mut self.ent_planes.slice_mut(..self.state_layers * padded * 2))?;
        }
        self.last_rows = 0;
        Ok((rows, padded))
    }

    /// Runs the step [`GpuBatch::prepare`] wrote for `padded` rows: its graph, captured from
    /// `launch` the first time, then the `rows` rows' greedy ids.
    pub(crate) fn run(&mut self, stream: &Arc<CudaStream>, rows: usize, padded: usize, launch: impl FnOnce(&GpuBatch) -> std::result::Result<(), GpuError>) -> Result<Vec<u32>> {
        if !self.has_graph(padded) {
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            // A panic inside `launch` ends the capture on its way out, so the stream is usable
            // again for whoever catches it (the server resets the slots and serves on).
            let capturing = Capturing(stream);
            let launched = launch(self);
            std::mem::forget(capturing);
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            launched?;
            let graph = graph?.ok_or_else(|| Error::Step { rows, pos: 0, what: "the capture made no graph".into() })?;
            graph.upload()?;
            self.graphs.push((padded, Graph(graph)));
        }
        self.graphs.iter().find(|(r, _)| *r == padded).expect("captured above").1 .0.launch()?;
        let ids = self.out.ids_raw(stream, rows)?;
        self.last_rows = rows;
        Ok(ids)
    }

    /// After [`GpuBatch::run`], with the step lock still held: the step's `rows × width` hidden
    /// states from the family's buffer `hid` when `wanted` (an entry asked), else none.
    pub(crate) fn keep_hidden(&mut self, stream: &Arc<CudaStream>, hid: &CudaSlice<f32>, width: usize, wanted: bool) -> Result<()> {
        self.hidden.clear();
        if wanted {
            let n = self.last_rows * width;
            self.hidden.resize(n, 0.0);
            stream.memcpy_dtoh(&hid.slice(..n), &mut self.hidden[..])?;
        }
        Ok(())
    }

    /// The hidden states of rows `first..first + rows` of the last step (`width` values a row),
    /// where one of its entries asked for them ([`BatchEntry::hidden`]).
    pub fn hidden_rows(&self, first: usize, rows: usize, width: usize) -> Result<&[f32]> {
        self.hidden.get(first * width..(first + rows) * width).ok_or_else(|| Error::Step {
            rows: self.last_rows,
            pos: 0,
            what: format!("no hidden states for rows {first}..{} (read back only where an entry asks)", first + rows),
        })
    }

    /// Splits `ids` (a step's rows in its entries' order) into each entry's.
    pub(crate) fn split_ids(ids: &[u32], lens: impl Iterator<Item = usize>) -> Vec<Vec<u32>> {
        let mut at = 0;
        lens.map(|n| {
            at += n;
            ids[at - n..at].to_vec()
        })
        .collect()
    }

    /// The logits of row `row` of the last step (rows in its entries' order).
    pub(crate) fn logits_row(&self, stream: &Arc<CudaStream>, row: usize) -> Result<Vec<f32>> {
        if row >= self.last_rows {
            return Err(Error::Step { rows: self.last_rows, pos: 0, what: format!("no logits for row {row}") });
        }
        self.out.row_raw(stream, row)
    }

    /// The `k` best `(id, logit)` of each row `first..first + rows` of the last step (the
    /// sampler's order), passing over the step's banned ids where the row's entry asked.
    pub(crate) fn top_k(&self, kernels: &crate::cuda::Kernels, stream: &Arc<CudaStream>, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        if rows == 0 || first + rows > self.last_rows {
            return Err(Error::Step { rows: self.last_rows, pos: 0, what: format!("no rows {first}..{} to read the top {k} of", first + rows) });
        }
        self.out.check_top_k(rows, 0, k)?;
        let mut out = Vec::with_capacity(rows);
        for r0 in (first..first + rows).step_by(MAX_ROWS) {
            let n = MAX_ROWS.min(first + rows - r0);
            out.extend(self.out.top_k(kernels, stream, self.params.device_ptr(stream).0, r0, n, k)?);
        }
        Ok(out)
    }
}
