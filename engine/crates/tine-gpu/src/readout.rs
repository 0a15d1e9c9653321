//! What a step leaves on the device for the host to read, shared by every family's step program:
//! the LM head's logits rows, their greedy ids and top-k candidates with their scratch, which rows
//! of a sequence's last step they are ([`LastStep`]), and the profile's per-launch times.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};

use crate::cuda::{ArgmaxArgs, DevPtr, Kernels, TopKArgs, ARGMAX_BLOCKS, MAX_ROWS, TOPK_MAX, TOPK_MAX_N};
use crate::gemma3::{alloc, Gemma3GpuError as Error};

type Result<T> = std::result::Result<T, Error>;

/// The logits of up to [`MAX_ROWS`] rows and what the argmax and top-k kernels need to read them.
pub(crate) struct Readout {
    vocab: usize,
    /// Rows its logits and ids hold.
    rows: usize,
    pub(crate) logits: CudaSlice<f32>,
    cand_v: CudaSlice<f32>,
    cand_i: CudaSlice<i32>,
    argmax_counters: CudaSlice<i32>,
    ids: CudaSlice<i32>,
    topk_cand: CudaSlice<u64>,
    topk_counters: CudaSlice<i32>,
    topk_ids: CudaSlice<i32>,
    topk_vals: CudaSlice<f32>,
}

/// Which rows of a sequence's last step the readout holds: a step of up to [`MAX_ROWS`] rows ran
/// the LM head on every row, a longer prompt step on its last row alone (`row0`), a trunk-only
/// step on none.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LastStep {
    pub(crate) rows: usize,
    head: bool,
    row0: usize,
}

impl LastStep {
    pub(crate) fn after(rows: usize, head: bool) -> LastStep {
        LastStep { rows, head, row0: if rows > MAX_ROWS { rows - 1 } else { 0 } }
    }

    /// The readout's row of the step's last row.
    pub(crate) fn last_row(&self) -> usize {
        self.rows - 1 - self.row0
    }

    fn headed(&self, pos: usize) -> Result<()> {
        if self.head {
            return Ok(());
        }
        Err(Error::Step { rows: self.rows, pos, what: "the last step ran the trunk alone: it has no logits or ids".into() })
    }
}

impl Readout {
    pub(crate) fn new(stream: &Arc<CudaStream>, vocab: usize) -> Result<Readout> {
        Readout::with_rows(stream, vocab, MAX_ROWS)
    }

    /// A readout whose logits and greedy ids hold `rows` rows (a batched step's); top-k reads
    /// [`MAX_ROWS`] of them at a time.
    pub(crate) fn with_rows(stream: &Arc<CudaStream>, vocab: usize, rows: usize) -> Result<Readout> {
        let rows = rows.max(MAX_ROWS);
        Ok(Readout {
            vocab,
            rows,
            logits: alloc(stream, rows * vocab)?,
            cand_v: alloc(stream, rows * ARGMAX_BLOCKS)?,
            cand_i: alloc(stream, rows * ARGMAX_BLOCKS)?,
            argmax_counters: alloc(stream, rows)?,
            ids: alloc(stream, rows)?,
            topk_cand: alloc(stream, MAX_ROWS * Kernels::topk_blocks(vocab) * TOPK_MAX)?,
            topk_counters: alloc(stream, MAX_ROWS)?,
            topk_ids: alloc(stream, MAX_ROWS * TOPK_MAX)?,
            topk_vals: alloc(stream, MAX_ROWS * TOPK_MAX)?,
        })
    }

    /// The greedy argmax over the logits rows, passing over the banned ids of the step block
    /// `step`.
    pub(crate) fn argmax_args(&self, stream: &Arc<CudaStream>, step: DevPtr) -> ArgmaxArgs {
        ArgmaxArgs {
            logits: self.logits.device_ptr(stream).0,
            n: self.vocab as i32,
            cand_v: self.cand_v.device_ptr(stream).0,
            cand_i: self.cand_i.device_ptr(stream).0,
            counters: self.argmax_counters.device_ptr(stream).0,
            ids: self.ids.device_ptr(stream).0,
            feed: 0,
            step,
        }
    }

    /// Whether `k` candidates of this vocabulary can be read (else the error, for a step of `rows`
    /// rows at `pos`).
    pub(crate) fn check_top_k(&self, rows: usize, pos: usize, k: usize) -> Result<()> {
        if !(1..=TOPK_MAX).contains(&k) || self.vocab > TOPK_MAX_N {
            return Err(Error::Step { rows, pos, what: format!("top {k} of a vocabulary of {} (1..={TOPK_MAX} of up to {TOPK_MAX_N})", self.vocab) });
        }
        Ok(())
    }

    /// The `k` best of the logits rows `first..first + rows` (at most [`MAX_ROWS`] at a time),
    /// one list per row, best first (the sampler's order; the step block `step`'s banned ids left
    /// out, on the rows its row table does not exempt).
    pub(crate) fn top_k(&self, kernels: &Kernels, stream: &Arc<CudaStream>, step: DevPtr, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        assert!(first + rows <= self.rows && (1..=MAX_ROWS).contains(&rows), "top-k of rows {first}..{} of a readout of {}", first + rows, self.rows);
        let vocab = self.vocab;
        let args = TopKArgs {
            logits: self.logits.device_ptr(stream).0 + (first * vocab * 4) as u64,
            n: vocab as i32,
            k: k as i32,
            cand: self.topk_cand.device_ptr(stream).0,
            counters: self.topk_counters.device_ptr(stream).0,
            ids: self.topk_ids.device_ptr(stream).0,
            vals: self.topk_vals.device_ptr(stream).0,
            step,
            row0: first as i32,
            pad: 0,
        };
        // SAFETY: the logits rows lie in the logits buffer (first + rows <= its rows), the scratch
        // holds MAX_ROWS * topk_blocks(vocab) * TOPK_MAX keys, the outputs MAX_ROWS * TOPK_MAX
        // values, the counters MAX_ROWS zeroed ints; the caller holds the step block `step`.
        unsafe { kernels.top_k(stream, rows, &args)? };
        let (mut ids, mut vals) = (vec![0i32; rows * k], vec![0f32; rows * k]);
        stream.memcpy_dtoh(&self.topk_ids.slice(..rows * k), &mut ids[..])?;
        stream.memcpy_dtoh(&self.topk_vals.slice(..rows * k), &mut vals[..])?;
        stream.synchronize()?;
        Ok(ids.chunks(k).zip(vals.chunks(k)).map(|(i, v)| i.iter().zip(v).filter(|&(&i, _)| i >= 0).map(|(&i, &v)| (i as u32, v)).collect()).collect())
    }

    /// Device bytes it holds.
    pub(crate) fn device_bytes(&self) -> usize {
        (self.logits.len() + self.cand_v.len() + self.topk_vals.len()) * 4
            + (self.cand_i.len() + self.argmax_counters.len() + self.ids.len() + self.topk_counters.len() + self.topk_ids.len()) * 4
            + self.topk_cand.len() * 8
    }

    /// The greedy ids of the first `rows` rows, whatever step wrote them (a batched step's).
    pub(crate) fn ids_raw(&self, stream: &Arc<CudaStream>, rows: usize) -> Result<Vec<u32>> {
        let mut ids = vec![0i32; rows];
        stream.memcpy_dtoh(&self.ids.slice(..rows), &mut ids[..])?;
        Ok(ids.into_iter().map(|i| i as u32).collect())
    }

    /// The logits of row `row`, whatever step wrote them (a batched step's).
    pub(crate) fn row_raw(&self, stream: &Arc<CudaStream>, row: usize) -> Result<Vec<f32>> {
        let vocab = self.vocab;
        let mut v = vec![0f32; vocab];
        stream.memcpy_dtoh(&self.logits.slice(row * vocab..(row + 1) * vocab), &mut v[..])?;
        Ok(v)
    }

    /// The greedy ids of the last step's headed rows.
    pub(crate) fn ids(&self, stream: &Arc<CudaStream>, last: &LastStep, pos: usize) -> Result<Vec<u32>> {
        last.headed(pos)?;
        let ids = stream.clone_dtoh(&self.ids)?;
        Ok(ids[..last.rows - last.row0].iter().map(|&i| i as u32).collect())
    }

    /// The logits of the last step's headed rows, `rows × vocab`.
    pub(crate) fn rows(&self, stream: &Arc<CudaStream>, last: &LastStep, pos: usize) -> Result<Vec<f32>> {
        last.headed(pos)?;
        let n = (last.rows - last.row0) * self.vocab;
        let mut v = vec![0f32; n];
        stream.memcpy_dtoh(&self.logits.slice(..n), &mut v[..])?;
        Ok(v)
    }

    /// The logits of row `row` of the last step.
    pub(crate) fn row(&self, stream: &Arc<CudaStream>, last: &LastStep, pos: usize, row: usize) -> Result<Vec<f32>> {
        last.headed(pos)?;
        if row >= last.rows || row < last.row0 {
            return Err(Error::Step { rows: last.rows, pos, what: format!("no logits for row {row}") });
        }
        let vocab = self.vocab;
        let mut v = vec![0f32; vocab];
        let at = row - last.row0;
        stream.memcpy_dtoh(&self.logits.slice(at * vocab..(at + 1) * vocab), &mut v[..])?;
        Ok(v)
    }
}

/// Each kind of launch's device time in microseconds from the events recorded after each launch
/// (the first event marks the start), summed per kind, in the order first launched.
pub(crate) fn time_marks(marks: &[(&'static str, CudaEvent)]) -> std::result::Result<Vec<(&'static str, f64)>, DriverError> {
    let mut out: Vec<(&'static str, f64)> = Vec::new();
    for w in marks.windows(2) {
        let us = w[0].1.elapsed_ms(&w[1].1)? as f64 * 1e3;
        match out.iter_mut().find(|(k, _)| *k == w[1].0) {
            Some(e) => e.1 += us,
            None => out.push((w[1].0, us)),
        }
    }
    Ok(out)
}
