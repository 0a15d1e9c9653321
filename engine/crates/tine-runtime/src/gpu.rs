//! The seam to tine-gpu's decode engine: with `--device cuda` (unless `TINE_GPU_ENGINE=0`), a
//! Gemma 3, a Gemma 4 (dense or E-series) or a Qwen3.5 (`qwen35`) whose weights the engine reads (Q4_K, Q5_K, Q5_0, Q6_K, Q8_0)
//! runs its steps there, one captured CUDA graph per row count, instead of through candle's CUDA
//! backend op by op. On Gemma 3 a NextN head baked into the GGUF and an assistant head
//! (`--mtp-head`, reading the sequence's KV cache there) run there too, as does Qwen3.5's NextN
//! head (its own K/V on the device, fed the engine's hidden states).
//!
//! Without the `cuda` feature [`GpuTrunk::open`] makes no engine, so `Option<GpuTrunk>` is
//! always `None` and the runtime's code needs no `cfg`.

use std::path::Path;

use candle_core::Device;

/// One layer's K and V values, `(kv_heads, len, head_dim)` each.
pub type LayerKv = (Vec<f32>, Vec<f32>);

/// One layer's K and V rows as stored, `(kv_heads, len, row)` bytes each.
pub type StoredKv = (Vec<u8>, Vec<u8>);

/// candle's cache types of the engine's stored types (the inverse of [`engine_kv_types`]).
pub fn candle_kv_types(t: tine_gpu::kv::KvTypes) -> (candle_nn::attention::kv_type::KvType, candle_nn::attention::kv_type::KvType) {
    use candle_nn::attention::kv_type::KvType as C;
    use tine_gpu::kv::KvStore as S;
    let one = |s: S| match s {
        S::F32 => C::F32,
        S::F16 => C::F16,
        S::Bf16 => C::BF16,
        S::Q8_0 => C::Q8_0,
        S::Q4_0 => C::Q4_0,
        S::Turbo4 => C::Turbo4,
        S::Turbo3 => C::Turbo3,
        S::Turbo2 => C::Turbo2,
    };
    (one(t.k), one(t.v))
}

/// The engine's stored types for candle's cache types `k` and `v`, where it keeps them: f32,
/// f16, bf16, q8_0 and q4_0; the rotated types (turbo4/3/2) with `TINE_GPU_TURBO=1` alone
/// until a device has run their checks (the kernels store and read them, every family's step
/// stages them).
pub fn engine_kv_types(k: candle_nn::attention::kv_type::KvType, v: candle_nn::attention::kv_type::KvType) -> Option<tine_gpu::kv::KvTypes> {
    use candle_nn::attention::kv_type::KvType as C;
    use tine_gpu::kv::KvStore as S;
    let turbo = std::env::var("TINE_GPU_TURBO").is_ok_and(|v| v == "1");
    let one = |t: C| match t {
        C::F32 => Some(S::F32),
        C::F16 => Some(S::F16),
        C::BF16 => Some(S::Bf16),
        C::Q8_0 => Some(S::Q8_0),
        C::Q4_0 => Some(S::Q4_0),
        C::Turbo4 => turbo.then_some(S::Turbo4),
        C::Turbo3 => turbo.then_some(S::Turbo3),
        C::Turbo2 => turbo.then_some(S::Turbo2),
    };
    Some(tine_gpu::kv::KvTypes { k: one(k)?, v: one(v)? })
}

/// Each row's `k` best `(id, logit)`, best first.
pub type RowsTopK = Vec<Vec<(u32, f32)>>;

/// What a row of a batched step reads back ([`GpuTrunk::step_batch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeWant {
    /// The greedy id (the step's banned ids passed over where the row asks).
    Argmax,
    /// The `k` best `(id, logit)` (at most [`TOP_K_MAX`]), for a draw with top-k.
    TopK(usize),
    /// The vocabulary-wide logits row (a draw that reads it all: bias, grammar, logprobs).
    Row,
}

/// What a batched step reads back of one sequence's rows ([`GpuTrunk::step_batch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsRead {
    /// Its greedy ids and top-k pass over the end-of-generation ids (`ignore_eos`).
    pub ban: bool,
    /// What each row's draw reads.
    pub want: DecodeWant,
    /// Its rows' hidden states too (a NextN head or an assistant drafts from them).
    pub hidden: bool,
}

/// One sequence's rows of a batched step, as its [`RowsRead`] asked: a [`DecodeOut`] a row, and
/// `rows × hidden` hidden states where it asked for them.
#[derive(Debug, Clone, PartialEq)]
pub struct RowsOut {
    pub outs: Vec<DecodeOut>,
    pub hidden: Option<Vec<f32>>,
}

/// A decode row's result, as its [`DecodeWant`] asked.
#[derive(Debug, Clone, PartialEq)]
pub enum DecodeOut {
    Id(u32),
    TopK(Vec<(u32, f32)>),
    Row(Vec<f32>),
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use tine_gpu::batch::{BatchEntry, GpuBatch, BATCH_MAX_ROWS};
    pub use tine_gpu::gemma3::Gemma3GpuError as GpuError;
    use tine_gpu::gemma3::{AssistantGpu, Gemma3Gpu, GpuCache, NextNCache};
    use tine_gpu::gemma4::{Gemma4AssistantGpu, Gemma4Cache, Gemma4Gpu};
    use tine_gpu::kv::KvTypes;
    use tine_gpu::qwen35::{Qwen35Cache, Qwen35Gpu, Qwen35NextNCache};

    /// The model's trunk on the engine.
    pub enum GpuTrunk {
        Gemma3(Box<Gemma3Gpu>),
        Gemma4(Box<Gemma4Gpu>),
        Qwen35(Box<Qwen35Gpu>),
    }
    /// One sequence's state on the engine.
    pub enum GpuSeq {
        Gemma3(GpuCache),
        Gemma4(Box<Gemma4Cache>),
        Qwen35(Box<Qwen35Cache>),
    }

    /// Calls the same method of either engine with the sequence's state of its kind.
    macro_rules! each {
        ($trunk:expr, $seq:expr, |$m:ident, $c:ident| $body:expr) => {
            match ($trunk, $seq) {
                (GpuTrunk::Gemma3($m), GpuSeq::Gemma3($c)) => $body,
                (GpuTrunk::Gemma4($m), GpuSeq::Gemma4($c)) => $body,
                (GpuTrunk::Qwen35($m), GpuSeq::Qwen35($c)) => $body,
                _ => unreachable!("a sequence's state is made by its model's engine"),
            }
        };
    }

    /// The error for what the engine does not do (yet) for `family`.
    fn not_on_engine(family: &str, what: &str) -> GpuError {
        GpuError::Step { rows: 0, pos: 0, what: format!("{what} is not on the GPU engine for {family}") }
    }
    /// One sequence's NextN cache on the engine.
    pub enum GpuNextN {
        Gemma3(NextNCache),
        Qwen35(Qwen35NextNCache),
    }
    /// An assistant head on the engine, reading the sequences' KV caches.
    pub enum GpuAssistant {
        Gemma3(Box<AssistantGpu>),
        Gemma4(Box<Gemma4AssistantGpu>),
    }

    /// The buffers and graphs of the engine's batched steps, made at the first batched step (and
    /// made again for caches of another context or types, or for more rows).
    #[derive(Default)]
    pub struct GpuBatchState(Option<GpuBatch>);

    impl GpuBatchState {
        /// Device bytes it holds.
        pub fn device_bytes(&self) -> usize {
            self.0.as_ref().map_or(0, GpuBatch::device_bytes)
        }
    }

    /// The most decode rows of one batched step.
    pub const BATCH_ROWS: usize = BATCH_MAX_ROWS;

    /// The most tokens one engine step takes (verify batches up to this; longer inputs go in
    /// steps of it).
    pub const STEP_ROWS: usize = tine_gpu::cuda::MAX_ROWS;
    /// The most ids the engine's greedy argmax passes over.
    pub const MAX_BANNED: usize = tine_gpu::cuda::MAX_BANNED;
    /// The most candidates [`GpuTrunk::forward_top_k`] gives.
    pub const TOP_K_MAX: usize = tine_gpu::cuda::TOPK_MAX;
    /// The largest vocabulary [`GpuTrunk::forward_top_k`] takes.
    pub const TOP_K_MAX_VOCAB: usize = tine_gpu::cuda::TOPK_MAX_N;

    /// A family whose step program runs batched steps (`forward_batch` over its caches).
    trait Batched {
        type Cache: BatchedCache;
        fn new_batch(&self, ctx_len: usize, types: KvTypes, max_rows: usize) -> Result<GpuBatch, GpuError>;
        fn forward_batch(&self, batch: &mut GpuBatch, entries: &mut [BatchEntry<'_, Self::Cache>], banned: &[u32]) -> Result<Vec<Vec<u32>>, GpuError>;
        fn batch_top_k(&self, batch: &GpuBatch, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>, GpuError>;
        fn batch_logits_row(&self, batch: &GpuBatch, row: usize) -> Result<Vec<f32>, GpuError>;
        fn batch_hidden(&self, batch: &GpuBatch, first: usize, rows: usize) -> Result<Vec<f32>, GpuError>;
        fn warm_batch(&self, batch: &mut GpuBatch, scratch: &mut Self::Cache, rows: usize) -> Result<usize, GpuError>;
    }
    trait BatchedCache {
        fn capacity(&self) -> usize;
        fn types(&self) -> KvTypes;
    }
    macro_rules! batched {
        ($m:ty, $c:ty) => {
            impl Batched for $m {
                type Cache = $c;
                fn new_batch(&self, ctx_len: usize, types: KvTypes, max_rows: usize) -> Result<GpuBatch, GpuError> {
                    <$m>::new_batch(self, ctx_len, types, max_rows)
                }
                fn forward_batch(&self, batch: &mut GpuBatch, entries: &mut [BatchEntry<'_, $c>], banned: &[u32]) -> Result<Vec<Vec<u32>>, GpuError> {
                    <$m>::forward_batch(self, batch, entries, banned)
                }
                fn batch_top_k(&self, batch: &GpuBatch, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>, GpuError> {
                    <$m>::batch_top_k(self, batch, first, rows, k)
                }
                fn batch_logits_row(&self, batch: &GpuBatch, row: usize) -> Result<Vec<f32>, GpuError> {
                    <$m>::batch_logits_row(self, batch, row)
                }
                fn batch_hidden(&self, batch: &GpuBatch, first: usize, rows: usize) -> Result<Vec<f32>, GpuError> {
                    <$m>::batch_hidden(self, batch, first, rows)
                }
                fn warm_batch(&self, batch: &mut GpuBatch, scratch: &mut $c, rows: usize) -> Result<usize, GpuError> {
                    <$m>::warm_batch(self, batch, scratch, rows)
                }
            }
            impl BatchedCache for $c {
                fn capacity(&self) -> usize {
                    <$c>::capacity(self)
                }
                fn types(&self) -> KvTypes {
                    <$c>::types(self)
                }
            }
        };
    }
    batched!(Gemma3Gpu, GpuCache);
    batched!(Gemma4Gpu, Gemma4Cache);
    batched!(Qwen35Gpu, Qwen35Cache);

    /// [`GpuTrunk::step_batch`] on a family's engine: the batch's buffers (made again for
    /// caches of another context or types, or for more rows), the step, each row's read-back.
    fn step_batch_on<M: Batched>(m: &M, state: &mut GpuBatchState, entries: Vec<(&mut M::Cache, &[u32], RowsRead)>, banned: &[u32]) -> Result<Vec<RowsOut>, GpuError> {
        let rows: usize = entries.iter().map(|e| e.1.len()).sum();
        let Some(c0) = entries.first().map(|e| &*e.0) else {
            return Err(GpuError::Step { rows, pos: 0, what: "a batched step of no rows".into() });
        };
        let (ctx, types) = (c0.capacity(), c0.types());
        let fits = state.0.as_ref().is_some_and(|b| b.capacity() == ctx && b.types() == types && b.max_rows() >= rows);
        if !fits {
            state.0 = None; // its memory back before the new one's
            state.0 = Some(m.new_batch(ctx, types, rows.max(8).next_power_of_two().min(BATCH_MAX_ROWS))?);
        }
        let batch = state.0.as_mut().expect("made above");
        let reads: Vec<(usize, RowsRead)> = entries.iter().map(|e| (e.1.len(), e.2)).collect();
        let mut list: Vec<BatchEntry<'_, M::Cache>> = entries.into_iter().map(|(cache, tokens, r)| BatchEntry { cache, tokens, ban: r.ban, hidden: r.hidden }).collect();
        let ids = m.forward_batch(batch, &mut list, banned)?;
        let k = reads.iter().filter_map(|r| if let DecodeWant::TopK(k) = r.1.want { Some(k) } else { None }).max();
        let tops = match k {
            Some(k) => Some(m.batch_top_k(batch, 0, rows, k)?),
            None => None,
        };
        let mut row = 0;
        let mut out = Vec::with_capacity(reads.len());
        for ((n, read), ids) in reads.into_iter().zip(ids) {
            let hidden = if read.hidden { Some(m.batch_hidden(batch, row, n)?) } else { None };
            let mut e = Vec::with_capacity(n);
            for id in ids {
                e.push(match read.want {
                    DecodeWant::Argmax => DecodeOut::Id(id),
                    DecodeWant::TopK(k) => DecodeOut::TopK(tops.as_ref().expect("read above")[row].iter().take(k).copied().collect()),
                    DecodeWant::Row => DecodeOut::Row(m.batch_logits_row(batch, row)?),
                });
                row += 1;
            }
            out.push(RowsOut { outs: e, hidden });
        }
        Ok(out)
    }

    /// [`GpuTrunk::warm_batch`] on a family's engine.
    fn warm_batch_on<M: Batched>(m: &M, state: &mut GpuBatchState, scratch: &mut M::Cache, rows: usize) -> Result<usize, GpuError> {
        let mut batch = m.new_batch(scratch.capacity(), scratch.types(), rows)?;
        let graphs = m.warm_batch(&mut batch, scratch, rows)?;
        state.0 = Some(batch);
        Ok(graphs)
    }

    impl GpuTrunk {
        /// The engine for a model on `device`, or why not: `Ok(None)` on the CPU or with
        /// `TINE_GPU_ENGINE=0`; `Err(reason)` where the engine cannot run this model (the
        /// caller falls back to candle when the reason is the model).
        pub fn open(path: &Path, device: &Device, max_ctx: usize) -> Result<Option<GpuTrunk>, GpuError> {
            let candle_core::DeviceLocation::Cuda { gpu_id } = device.location() else { return Ok(None) };
            if std::env::var("TINE_GPU_ENGINE").is_ok_and(|v| v == "0") {
                return Ok(None);
            }
            let arch = tine_gpu::gemma3::architecture(path)?;
            if arch.starts_with("qwen35") {
                return Ok(Some(GpuTrunk::Qwen35(Box::new(Qwen35Gpu::load(path, gpu_id, max_ctx)?))));
            }
            if arch == "gemma4" {
                return Ok(Some(GpuTrunk::Gemma4(Box::new(Gemma4Gpu::load(path, gpu_id, max_ctx)?))));
            }
            Ok(Some(GpuTrunk::Gemma3(Box::new(Gemma3Gpu::load(path, gpu_id, max_ctx)?))))
        }
        /// A sequence of `context` positions whose K/V are stored as `types`.
        pub fn new_seq(&self, context: usize, types: KvTypes) -> Result<GpuSeq, GpuError> {
            Ok(match self {
                GpuTrunk::Gemma3(m) => GpuSeq::Gemma3(m.new_cache_typed(context, types)?),
                GpuTrunk::Gemma4(m) => GpuSeq::Gemma4(Box::new(m.new_cache_typed(context, types)?)),
                GpuTrunk::Qwen35(m) => GpuSeq::Qwen35(Box::new(m.new_cache_typed(context, types)?)),
            })
        }
        /// Whether [`GpuTrunk::step_batch`] runs here (Gemma 3 and Gemma 4, their matrices in the
        /// wide layout; Qwen3.5 with `TINE_GPU_BATCH_QWEN35=1` until a device has checked it).
        pub fn batches(&self) -> bool {
            match self {
                GpuTrunk::Gemma3(m) => m.batches(),
                GpuTrunk::Gemma4(m) => m.batches(),
                // Until a device has run its checks (docs/evaluations/gpu-batching.md, step 5).
                GpuTrunk::Qwen35(m) => m.batches() && std::env::var("TINE_GPU_BATCH_QWEN35").is_ok_and(|v| v == "1"),
            }
        }
        /// One engine step for several sequences' rows, `(sequence, tokens, ban, want)` each (a
        /// decode's one token or a verify batch; every sequence's cache of one context and K/V
        /// types, at most [`BATCH_ROWS`] rows in all): each row gives what `want` asks, passing
        /// over `banned` where `ban` is set, bit for bit what [`GpuTrunk::forward_argmax_all`],
        /// [`GpuTrunk::forward_top_k_all`] or [`GpuTrunk::forward_logits`] give for the same
        /// sequence alone. On an error no sequence has moved.
        pub fn step_batch(&self, state: &mut GpuBatchState, entries: &mut [(&mut GpuSeq, &[u32], RowsRead)], banned: &[u32]) -> Result<Vec<RowsOut>, GpuError> {
            let rows: usize = entries.iter().map(|e| e.1.len()).sum();
            let other = || GpuError::Step { rows, pos: 0, what: "a batched step of no rows, or of another family's caches".into() };
            match self {
                GpuTrunk::Gemma3(m) => {
                    let mut list = Vec::with_capacity(entries.len());
                    for (seq, tokens, read) in entries.iter_mut() {
                        let GpuSeq::Gemma3(cache) = &mut **seq else { return Err(other()) };
                        list.push((cache, *tokens, *read));
                    }
                    step_batch_on(&**m, state, list, banned)
                }
                GpuTrunk::Gemma4(m) => {
                    let mut list = Vec::with_capacity(entries.len());
                    for (seq, tokens, read) in entries.iter_mut() {
                        let GpuSeq::Gemma4(cache) = &mut **seq else { return Err(other()) };
                        list.push((&mut **cache, *tokens, *read));
                    }
                    step_batch_on(&**m, state, list, banned)
                }
                GpuTrunk::Qwen35(m) => {
                    let mut list = Vec::with_capacity(entries.len());
                    for (seq, tokens, read) in entries.iter_mut() {
                        let GpuSeq::Qwen35(cache) = &mut **seq else { return Err(other()) };
                        list.push((&mut **cache, *tokens, *read));
                    }
                    step_batch_on(&**m, state, list, banned)
                }
            }
        }
        /// Makes the batched-step buffers for steps of up to `rows` rows over sequences like
        /// `scratch` (left empty) and captures every graph they would run: returns the graphs.
        pub fn warm_batch(&self, state: &mut GpuBatchState, scratch: &mut GpuSeq, rows: usize) -> Result<usize, GpuError> {
            let rows = rows.clamp(1, BATCH_MAX_ROWS);
            state.0 = None;
            match (self, scratch) {
                (GpuTrunk::Gemma3(m), GpuSeq::Gemma3(cache)) => warm_batch_on(&**m, state, cache, rows),
                (GpuTrunk::Gemma4(m), GpuSeq::Gemma4(cache)) => warm_batch_on(&**m, state, cache, rows),
                (GpuTrunk::Qwen35(m), GpuSeq::Qwen35(cache)) => warm_batch_on(&**m, state, cache, rows),
                _ => Err(not_on_engine(self.family(), "a batched step")),
            }
        }
        /// The Gemma 3 engine, for what only it does, or the error naming `what`.
        fn gemma3(&self, what: &str) -> Result<&Gemma3Gpu, GpuError> {
            match self {
                GpuTrunk::Gemma3(m) => Ok(m),
                _ => Err(not_on_engine(self.family(), what)),
            }
        }
        /// The model family's architecture name.
        fn family(&self) -> &'static str {
            match self {
                GpuTrunk::Gemma3(_) => "gemma3",
                GpuTrunk::Gemma4(_) => "gemma4",
                GpuTrunk::Qwen35(_) => "qwen35",
            }
        }
        /// Runs `tokens` (at most [`STEP_ROWS`]) and returns their logits, `rows × vocab`.
        pub fn forward_logits(&self, seq: &mut GpuSeq, tokens: &[u32]) -> Result<Vec<f32>, GpuError> {
            each!(self, seq, |m, c| {
                m.forward(c, tokens)?;
                m.logits(c)
            })
        }
        /// Runs `tokens` (at most [`GpuTrunk::prompt_rows`]) through the trunk alone (a prompt
        /// chunk before the last: no LM head runs) and returns their final hidden states when asked
        /// (`rows × hidden`, Gemma 3: before the output norm; Gemma 4 and Qwen3.5: after it, what an assistant or NextN head reads), else nothing.
        pub fn forward_trunk(&self, seq: &mut GpuSeq, tokens: &[u32], hidden: bool) -> Result<Vec<f32>, GpuError> {
            each!(self, seq, |m, c| {
                m.forward_trunk(c, tokens)?;
                if hidden {
                    m.hidden(c)
                } else {
                    Ok(Vec::new())
                }
            })
        }
        /// Runs `tokens` (at most [`GpuTrunk::prompt_rows`], a prompt's last chunk) and returns
        /// the last one's logits (only that row crosses to the host) and, when asked, every
        /// row's final hidden state.
        pub fn forward_last(&self, seq: &mut GpuSeq, tokens: &[u32], hidden: bool) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
            each!(self, seq, |m, c| {
                m.forward_prompt(c, tokens)?;
                let row = m.logits_row(c, tokens.len() - 1)?;
                Ok((row, if hidden { m.hidden(c)? } else { Vec::new() }))
            })
        }
        /// Runs `tokens` (at most [`STEP_ROWS`]) and returns the last one's greedy id, passing
        /// over `banned` (at most [`MAX_BANNED`]); only the id crosses to the host.
        pub fn forward_argmax(&self, seq: &mut GpuSeq, tokens: &[u32], banned: &[u32]) -> Result<u32, GpuError> {
            each!(self, seq, |m, c| {
                m.forward_banning(c, tokens, banned)?;
                Ok(*m.argmax(c)?.last().expect("a step has rows"))
            })
        }
        /// Runs `tokens` (at most [`STEP_ROWS`]) and returns the `k` best `(id, logit)` of the last
        /// one's logits (at most [`TOP_K_MAX`]; the sampler's order, `banned` left out): only
        /// those cross to the host.
        pub fn forward_top_k(&self, seq: &mut GpuSeq, tokens: &[u32], banned: &[u32], k: usize) -> Result<Vec<(u32, f32)>, GpuError> {
            each!(self, seq, |m, c| m.forward_top_k(c, tokens, banned, k))
        }
        /// Runs `tokens` (at most [`STEP_ROWS`]) and returns their logits (`rows × vocab`) and
        /// final hidden states (`rows × hidden`, before the output norm on Gemma 3, after it on Gemma 4 and Qwen3.5).
        pub fn forward_hidden(&self, seq: &mut GpuSeq, tokens: &[u32]) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
            each!(self, seq, |m, c| {
                m.forward(c, tokens)?;
                Ok((m.logits(c)?, m.hidden(c)?))
            })
        }
        /// Runs `tokens` (at most [`STEP_ROWS`]) and returns every row's greedy id, passing over
        /// `banned` (at most [`MAX_BANNED`]), and with `hidden` the rows' final hidden states
        /// (`rows × hidden`, before the output norm on Gemma 3, after it on Gemma 4 and Qwen3.5; a verify step for a drafter that reads
        /// them): the logits stay on the device.
        pub fn forward_argmax_all(&self, seq: &mut GpuSeq, tokens: &[u32], banned: &[u32], hidden: bool) -> Result<(Vec<u32>, Vec<f32>), GpuError> {
            each!(self, seq, |m, c| {
                m.forward_banning(c, tokens, banned)?;
                Ok((m.argmax(c)?, if hidden { m.hidden(c)? } else { Vec::new() }))
            })
        }
        /// Runs `tokens` (at most [`STEP_ROWS`]) and returns every row's `k` best `(id, logit)`
        /// ([`GpuTrunk::forward_top_k`]'s order, `banned` left out) and, when asked, the rows'
        /// final hidden states: a sampled verify step, the logits left on the device.
        pub fn forward_top_k_all(&self, seq: &mut GpuSeq, tokens: &[u32], banned: &[u32], k: usize, hidden: bool) -> Result<(RowsTopK, Vec<f32>), GpuError> {
            each!(self, seq, |m, c| {
                let top = m.forward_top_k_all(c, tokens, banned, k)?;
                Ok((top, if hidden { m.hidden(c)? } else { Vec::new() }))
            })
        }
        /// A NextN cache of `context` entries, if the model has a NextN head the engine runs.
        pub fn new_nextn(&self, context: usize, types: KvTypes) -> Result<Option<GpuNextN>, GpuError> {
            match self {
                GpuTrunk::Gemma3(m) => Ok(m.new_nextn_cache_typed(context, types)?.map(GpuNextN::Gemma3)),
                GpuTrunk::Qwen35(m) => Ok(m.new_nextn_cache_typed(context, types)?.map(GpuNextN::Qwen35)),
                GpuTrunk::Gemma4(_) => Ok(None),
            }
        }
        /// Runs the NextN head over entries `state.len()..`: `hidden` (`rows × hidden`) and the
        /// token after each, in steps of up to [`GpuTrunk::prompt_rows`]. Returns the last entry's
        /// logits and every entry's output hidden state. On an error the state keeps its
        /// entries before the call.
        pub fn nextn_forward(&self, state: &mut GpuNextN, hidden: &[f32], tokens: &[u32]) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
            let (width, rows) = match self {
                GpuTrunk::Gemma3(m) => (m.config().hidden, m.prompt_rows()),
                GpuTrunk::Qwen35(m) => (m.config().hidden, m.prompt_rows()),
                GpuTrunk::Gemma4(_) => return Err(not_on_engine(self.family(), "a NextN head")),
            };
            let len = state.len();
            let mut logits = Vec::new();
            let mut out = Vec::with_capacity(hidden.len());
            for (i, chunk) in tokens.chunks(rows).enumerate() {
                let h = hidden.get(i * rows * width..(i * rows + chunk.len()) * width).unwrap_or(&[]);
                let step = match (self, &mut *state) {
                    (GpuTrunk::Gemma3(m), GpuNextN::Gemma3(c)) => m.nextn_forward(c, h, chunk),
                    (GpuTrunk::Qwen35(m), GpuNextN::Qwen35(c)) => m.nextn_forward(c, h, chunk),
                    _ => unreachable!("a NextN state is made by its model's engine"),
                };
                match step {
                    Ok((l, o)) => {
                        logits = l;
                        out.extend(o);
                    }
                    Err(e) => {
                        state.truncate(len);
                        return Err(e);
                    }
                }
            }
            Ok((logits, out))
        }
        /// Every layer's K and V of `seq`'s positions, `(n_kv, len, head_dim)` each.
        pub fn read_kv(&self, seq: &GpuSeq) -> Result<Vec<LayerKv>, GpuError> {
            match (self, seq) {
                (GpuTrunk::Gemma3(m), GpuSeq::Gemma3(c)) => m.read_kv(c),
                _ => Err(not_on_engine(self.family(), "a slot file")),
            }
        }
        /// `seq` holds `len` positions with K and V `layers` (as [`GpuTrunk::read_kv`] gives).
        pub fn write_kv(&self, seq: &mut GpuSeq, len: usize, layers: &[(&[f32], &[f32])]) -> Result<(), GpuError> {
            match (self, seq) {
                (GpuTrunk::Gemma3(m), GpuSeq::Gemma3(c)) => m.write_kv(c, len, layers),
                _ => Err(not_on_engine(self.family(), "a slot file")),
            }
        }
        /// Every layer's K and V rows of `seq`'s positions as stored, `(n_kv, len, row)` bytes
        /// each (candle's `KvType::stored_bytes` of the same types).
        pub fn read_kv_stored(&self, seq: &GpuSeq) -> Result<Vec<StoredKv>, GpuError> {
            match (self, seq) {
                (GpuTrunk::Gemma3(m), GpuSeq::Gemma3(c)) => m.read_kv_stored(c),
                _ => Err(not_on_engine(self.family(), "a slot file")),
            }
        }
        /// `seq` holds `len` positions with the stored K and V rows `layers` (as
        /// [`GpuTrunk::read_kv_stored`] gives, in `seq`'s types).
        pub fn write_kv_stored(&self, seq: &mut GpuSeq, len: usize, layers: &[(&[u8], &[u8])]) -> Result<(), GpuError> {
            match (self, seq) {
                (GpuTrunk::Gemma3(m), GpuSeq::Gemma3(c)) => m.write_kv_stored(c, len, layers),
                _ => Err(not_on_engine(self.family(), "a slot file")),
            }
        }
        /// KV heads and head size (a layer's K is `(kv_heads, len, head_dim)`).
        pub fn kv_shape(&self) -> (usize, usize) {
            match self {
                GpuTrunk::Gemma3(m) => (m.config().n_kv, m.config().head_dim),
                GpuTrunk::Gemma4(m) => (m.config().layers[0].n_kv, m.config().layers[0].head_dim),
                GpuTrunk::Qwen35(m) => (m.config().n_kv, m.config().head_dim),
            }
        }
        /// The GPU's free and total memory in bytes.
        pub fn memory(&self) -> Result<(usize, usize), GpuError> {
            match self {
                GpuTrunk::Gemma3(m) => m.memory(),
                GpuTrunk::Gemma4(m) => m.memory(),
                GpuTrunk::Qwen35(m) => m.memory(),
            }
        }
        /// The most positions a sequence's cache on the engine holds.
        pub fn max_context(&self) -> usize {
            match self {
                GpuTrunk::Gemma3(m) => m.max_ctx(),
                GpuTrunk::Gemma4(m) => m.max_ctx(),
                GpuTrunk::Qwen35(m) => m.max_ctx(),
            }
        }
        /// The most tokens of one prompt step ([`GpuTrunk::forward_trunk`],
        /// [`GpuTrunk::forward_last`]).
        pub fn prompt_rows(&self) -> usize {
            match self {
                GpuTrunk::Gemma3(m) => m.prompt_rows(),
                GpuTrunk::Gemma4(m) => m.prompt_rows(),
                GpuTrunk::Qwen35(m) => m.prompt_rows(),
            }
        }
        /// Loads an assistant head (a `gemma4-assistant` GGUF) for this trunk.
        pub fn load_assistant(&self, path: &Path) -> Result<GpuAssistant, GpuError> {
            match self {
                GpuTrunk::Gemma4(m) => Ok(GpuAssistant::Gemma4(Box::new(m.load_assistant(path)?))),
                _ => Ok(GpuAssistant::Gemma3(Box::new(self.gemma3("an assistant head")?.load_assistant(path)?))),
            }
        }
        /// One draft step of `head` at `position` for `token`, reading `hidden` (`hidden` values)
        /// and `seq`'s cache (positions below `position`). Returns the logits (over the head's
        /// draft vocabulary when it has one) and the next step's hidden state.
        pub fn assistant_step(&self, head: &GpuAssistant, seq: &GpuSeq, hidden: &[f32], token: u32, position: usize) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
            match (self, seq) {
                (GpuTrunk::Gemma3(m), GpuSeq::Gemma3(c)) => match head {
                    GpuAssistant::Gemma3(a) => m.assistant_step(a, c, hidden, token, position),
                    GpuAssistant::Gemma4(_) => Err(not_on_engine("gemma3", "a Gemma 4 target's assistant")),
                },
                (GpuTrunk::Gemma4(m), GpuSeq::Gemma4(c)) => match head {
                    GpuAssistant::Gemma4(a) => m.assistant_step(a, c, hidden, token, position),
                    GpuAssistant::Gemma3(_) => Err(not_on_engine("gemma4", "a Gemma 3 target's assistant")),
                },
                _ => Err(not_on_engine(self.family(), "an assistant head")),
            }
        }
    }

    /// Whether `e` says the engine cannot run this model (a weight type or layout it does not
    /// read), as opposed to a failure of the GPU itself.
    /// (Also a GPU the embedded kernels were not built for: the module does not load there, and
    /// candle's CUDA path, which carries PTX for it, runs instead.)
    pub fn is_unsupported_model(e: &GpuError) -> bool {
        matches!(e, GpuError::Unsupported { .. } | GpuError::Model { .. } | GpuError::Kernel(tine_gpu::cuda::GpuError::Module { .. }))
    }

    impl GpuSeq {
        pub fn len(&self) -> usize {
            match self {
                GpuSeq::Gemma3(c) => c.len(),
                GpuSeq::Gemma4(c) => c.len(),
                GpuSeq::Qwen35(c) => c.len(),
            }
        }
        /// Device bytes it holds (its K/V, and a recurrent model's state planes).
        pub fn device_bytes(&self) -> usize {
            match self {
                GpuSeq::Gemma3(c) => c.kv_bytes(),
                GpuSeq::Gemma4(c) => c.kv_bytes(),
                GpuSeq::Qwen35(c) => c.device_bytes(),
            }
        }
        /// The types this sequence's K/V are stored in (chosen when it was made).
        pub fn kv_types(&self) -> KvTypes {
            match self {
                GpuSeq::Gemma3(c) => c.types(),
                GpuSeq::Gemma4(c) => c.types(),
                GpuSeq::Qwen35(c) => c.types(),
            }
        }
        /// The longest prefix of at most `len` positions [`GpuSeq::truncate`] keeps (a recurrent
        /// state: positions one of its planes holds, else 0).
        pub fn restorable(&self, len: usize) -> usize {
            match self {
                GpuSeq::Gemma3(c) => len.min(c.len()),
                GpuSeq::Gemma4(c) => len.min(c.len()),
                GpuSeq::Qwen35(c) => c.restorable(len),
            }
        }
        /// Keeps the first `len` positions and says whether it could (a recurrent state keeps
        /// only what [`GpuSeq::restorable`] names; otherwise nothing changes).
        pub fn truncate(&mut self, len: usize) -> bool {
            match self {
                GpuSeq::Gemma3(c) => {
                    c.truncate(len);
                    true
                }
                GpuSeq::Gemma4(c) => {
                    c.truncate(len);
                    true
                }
                GpuSeq::Qwen35(c) => c.truncate(len),
            }
        }
    }

    impl GpuNextN {
        pub fn len(&self) -> usize {
            match self {
                GpuNextN::Gemma3(c) => c.len(),
                GpuNextN::Qwen35(c) => c.len(),
            }
        }
        pub fn truncate(&mut self, len: usize) {
            match self {
                GpuNextN::Gemma3(c) => c.truncate(len),
                GpuNextN::Qwen35(c) => c.truncate(len),
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    /// No engine in a build without CUDA: [`GpuTrunk::open`] never makes one.
    pub struct GpuTrunk(());
    /// No engine in a build without CUDA (never made).
    pub struct GpuSeq(());
    /// No engine in a build without CUDA (never made).
    pub struct GpuNextN(());
    /// No engine in a build without CUDA (never made).
    pub struct GpuAssistant(());
    /// No engine in a build without CUDA: no batched steps.
    #[derive(Default)]
    pub struct GpuBatchState(());
    impl GpuBatchState {
        pub fn device_bytes(&self) -> usize {
            0
        }
    }
    pub const BATCH_ROWS: usize = 256;
    /// No engine in a build without CUDA (never made).
    #[derive(Debug, thiserror::Error)]
    #[error("this build has no GPU engine")]
    pub struct GpuError(());
    pub const STEP_ROWS: usize = 8;
    pub const MAX_BANNED: usize = 8;
    pub const TOP_K_MAX: usize = 64;
    // The engine's limits (tine-gpu's MAX_ROWS, MAX_BANNED, TOPK_MAX, TOPK_MAX_N), the same in a
    // build without CUDA, so the choices the runtime makes from them are the same everywhere.
    pub const TOP_K_MAX_VOCAB: usize = 262_144;

    pub fn is_unsupported_model(_e: &GpuError) -> bool {
        false
    }

    const NEVER: &str = "a build without CUDA makes no GPU engine";

    impl GpuTrunk {
        pub fn open(_path: &Path, _device: &Device, _max_ctx: usize) -> Result<Option<GpuTrunk>, GpuError> {
            Ok(None)
        }
        pub fn new_seq(&self, _context: usize, _types: tine_gpu::kv::KvTypes) -> Result<GpuSeq, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn batches(&self) -> bool {
            unreachable!("{NEVER}")
        }
        pub fn warm_batch(&self, _state: &mut GpuBatchState, _scratch: &mut GpuSeq, _rows: usize) -> Result<usize, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn step_batch(&self, _state: &mut GpuBatchState, _entries: &mut [(&mut GpuSeq, &[u32], RowsRead)], _banned: &[u32]) -> Result<Vec<RowsOut>, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn forward_logits(&self, _seq: &mut GpuSeq, _tokens: &[u32]) -> Result<Vec<f32>, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn forward_argmax(&self, _seq: &mut GpuSeq, _tokens: &[u32], _banned: &[u32]) -> Result<u32, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn forward_argmax_all(&self, _seq: &mut GpuSeq, _tokens: &[u32], _banned: &[u32], _hidden: bool) -> Result<(Vec<u32>, Vec<f32>), GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn forward_top_k_all(&self, _seq: &mut GpuSeq, _tokens: &[u32], _banned: &[u32], _k: usize, _hidden: bool) -> Result<(RowsTopK, Vec<f32>), GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn forward_top_k(&self, _seq: &mut GpuSeq, _tokens: &[u32], _banned: &[u32], _k: usize) -> Result<Vec<(u32, f32)>, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn forward_trunk(&self, _seq: &mut GpuSeq, _tokens: &[u32], _hidden: bool) -> Result<Vec<f32>, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn forward_last(&self, _seq: &mut GpuSeq, _tokens: &[u32], _hidden: bool) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn read_kv(&self, _seq: &GpuSeq) -> Result<Vec<LayerKv>, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn write_kv(&self, _seq: &mut GpuSeq, _len: usize, _layers: &[(&[f32], &[f32])]) -> Result<(), GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn read_kv_stored(&self, _seq: &GpuSeq) -> Result<Vec<StoredKv>, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn write_kv_stored(&self, _seq: &mut GpuSeq, _len: usize, _layers: &[(&[u8], &[u8])]) -> Result<(), GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn kv_shape(&self) -> (usize, usize) {
            unreachable!("{NEVER}")
        }
        pub fn memory(&self) -> Result<(usize, usize), GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn max_context(&self) -> usize {
            unreachable!("{NEVER}")
        }
        pub fn prompt_rows(&self) -> usize {
            unreachable!("{NEVER}")
        }
        pub fn forward_hidden(&self, _seq: &mut GpuSeq, _tokens: &[u32]) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn new_nextn(&self, _context: usize, _types: tine_gpu::kv::KvTypes) -> Result<Option<GpuNextN>, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn load_assistant(&self, _path: &Path) -> Result<GpuAssistant, GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn assistant_step(&self, _head: &GpuAssistant, _seq: &GpuSeq, _hidden: &[f32], _token: u32, _position: usize) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
            unreachable!("{NEVER}")
        }
        pub fn nextn_forward(&self, _state: &mut GpuNextN, _hidden: &[f32], _tokens: &[u32]) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
            unreachable!("{NEVER}")
        }
    }

    impl GpuNextN {
        pub fn len(&self) -> usize {
            unreachable!("{NEVER}")
        }
        pub fn truncate(&mut self, _len: usize) {
            unreachable!("{NEVER}")
        }
    }

    impl GpuSeq {
        pub fn len(&self) -> usize {
            unreachable!("{NEVER}")
        }
        pub fn device_bytes(&self) -> usize {
            unreachable!("{NEVER}")
        }
        pub fn kv_types(&self) -> tine_gpu::kv::KvTypes {
            unreachable!("{NEVER}")
        }
        pub fn restorable(&self, _len: usize) -> usize {
            unreachable!("{NEVER}")
        }
        pub fn truncate(&mut self, _len: usize) -> bool {
            unreachable!("{NEVER}")
        }
    }
}

pub use imp::{is_unsupported_model, GpuAssistant, GpuBatchState, GpuError, GpuNextN, GpuSeq, GpuTrunk, BATCH_ROWS, MAX_BANNED, STEP_ROWS, TOP_K_MAX, TOP_K_MAX_VOCAB};
