//! Gemma 3 on tine-gpu's kernels: the model read from a GGUF (as llama.cpp writes it) into
//! buffers allocated once, and a step of 1..=8 rows as a fixed list of launches, captured once
//! per row count as a CUDA graph and replayed.
//!
//! The step program (per layer, 9 launches; after the last layer, 3):
//!
//! 1. `norm_quant`: the residual stream (layer 0: the scaled embedding row; else
//!    `h + post_ffw_norm(down)`), then `attn_norm`, as Q8 activations
//! 2. `gemv`: Q, K and V in one launch (three segments, each its own weight type)
//! 3. `qk_norm_rope_kv`: q/k norms, RoPE (local or global base), the query scale, K/V at the step's positions
//! 4. attention (sliding window on local layers), its output written as Q8
//! 5. `gemv`: the output projection
//! 6. `norm_quant`: `h + post_attention_norm(o)`, then `ffn_norm`, as Q8
//! 7. `gemv`: gate and up with the GELU(tanh)·up epilogue
//! 8. `norm_quant`: the MLP's hidden row as Q8
//! 9. `gemv`: down
//!
//! then `norm_quant` (`h + post_ffw_norm(down)`, `output_norm`), the LM head `gemv` and the
//! greedy argmax (a prompt's chunks before its last run a second graph without these two: the
//! trunk alone, whose logits nobody reads). Every kernel is batch-invariant, so a step of M rows gives each row the bits a
//! one-row step at its position gives.
//!
//! A prompt step of more than 8 rows (up to [`Gemma3Gpu::prompt_rows`]) runs the same program
//! launched directly instead of through a graph: the GEMVs as `mmq` (int8 tensor-core products
//! over the same quantized weights and activations), the attention as `attn_prompt` (a warp per
//! row and head over all its keys with a running softmax), the LM head and argmax on the last row
//! only. A prompt's rows match one-row steps to float rounding (the GEMM sums each
//! row in another order), not bit for bit; verify steps (up to 8 rows) stay bit-identical.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file;
use candle_core::quantized::GgmlDType;
use cudarc::driver::{sys, CudaContext, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};

use crate::blocks::{WeightType, QK};
use crate::cuda::{ArgmaxArgs, AttnArgs, DevPtr, GemvSeg, GpuError, Kernels, NormQuantArgs, RopeArgs, StepParams, TopKArgs, ARGMAX_BLOCKS, MAX_BANNED, MAX_ROWS, TOPK_MAX, TOPK_MAX_N};

/// Why a model could not be loaded or stepped on the GPU.
#[derive(Debug, thiserror::Error)]
pub enum Gemma3GpuError {
    #[error("reading {path}")]
    Read {
        path: String,
        #[source]
        source: candle_core::Error,
    },
    #[error("{path}: {what}")]
    Model { path: String, what: String },
    #[error("tensor {name} is {dtype:?}, which the GPU engine does not read (it reads Q4_K, Q5_0, Q6_K and Q8_0 weights)")]
    Unsupported { name: String, dtype: GgmlDType },
    #[error("CUDA driver")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error(transparent)]
    Kernel(#[from] GpuError),
    #[error("step of {rows} rows at position {pos}: {what}")]
    Step { rows: usize, pos: usize, what: String },
}

type Result<T> = std::result::Result<T, Gemma3GpuError>;

/// The most rows of one prompt step.
pub const PROMPT_ROWS: usize = 512;

/// One layer's K and V values, `(n_kv, len, head_dim)` each ([`Gemma3Gpu::read_kv`]).
pub type LayerKv = (Vec<f32>, Vec<f32>);

/// The hyperparameters the step program needs, read from the GGUF's metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Config {
    pub hidden: usize,
    pub layers: usize,
    pub n_head: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub ff: usize,
    pub vocab: usize,
    pub eps: f32,
    pub rope_global: f32,
    pub rope_local: f32,
    pub window: usize,
    /// Every `sliding_pattern`-th layer is global, the rest local.
    pub sliding_pattern: usize,
}

impl Gemma3Config {
    /// Whether layer `l` attends over a sliding window (candle's and llama.cpp's rule).
    pub fn is_local(&self, l: usize) -> bool {
        !(l + 1).is_multiple_of(self.sliding_pattern)
    }
}

struct Layer {
    attn_norm: CudaSlice<f32>,
    q: (CudaSlice<u8>, WeightType),
    k: (CudaSlice<u8>, WeightType),
    v: (CudaSlice<u8>, WeightType),
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    o: (CudaSlice<u8>, WeightType),
    post_attn_norm: CudaSlice<f32>,
    ffn_norm: CudaSlice<f32>,
    gate: (CudaSlice<u8>, WeightType),
    up: (CudaSlice<u8>, WeightType),
    down: (CudaSlice<u8>, WeightType),
    post_ffn_norm: CudaSlice<f32>,
}

/// Activation buffers, each sized for [`Gemma3Gpu::prompt_rows`] rows (the logits, the argmax
/// scratch and the decode attention's partials for [`MAX_ROWS`]), allocated once.
struct Buffers {
    h: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    o: CudaSlice<f32>,
    ff: CudaSlice<f32>,
    down: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    qs: CudaSlice<i8>,
    qd: CudaSlice<f32>,
    qsum: CudaSlice<i32>,
    partials: CudaSlice<f32>,
    attn_counters: CudaSlice<i32>,
    cand_v: CudaSlice<f32>,
    cand_i: CudaSlice<i32>,
    argmax_counters: CudaSlice<i32>,
    ids: CudaSlice<i32>,
    topk_cand: CudaSlice<u64>,
    topk_counters: CudaSlice<i32>,
    topk_ids: CudaSlice<i32>,
    topk_vals: CudaSlice<f32>,
}

/// The step's inputs in device memory, written by the host before each step's launches.
struct StepBlock {
    params: CudaSlice<StepParams>,
    /// A prompt step's token ids ([`Gemma3Gpu::prompt_rows`] of them).
    tokens: CudaSlice<i32>,
}

/// Called after each launch of a step with what the launch does.
type Mark<'a> = dyn FnMut(&'static str) -> std::result::Result<(), GpuError> + 'a;

/// Gemma 3 on the GPU: weights and the step's buffers, shared by every sequence (steps run one
/// at a time on the model's stream). Each sequence holds a [`GpuCache`].
pub struct Gemma3Gpu {
    cfg: Gemma3Config,
    /// The longest cache [`Gemma3Gpu::new_cache`] makes (the attention partials are sized for it).
    max_ctx: usize,
    /// The most rows of one prompt step.
    prompt_rows: usize,
    stream: Arc<CudaStream>,
    /// The step's parameter block and prompt tokens; locked for the upload and launch of a step.
    step: std::sync::Mutex<StepBlock>,
    kernels: Kernels,
    embd: (CudaSlice<u8>, WeightType),
    output: Option<(CudaSlice<u8>, WeightType)>,
    output_norm: CudaSlice<f32>,
    inv_local: CudaSlice<f32>,
    inv_global: CudaSlice<f32>,
    layers: Vec<Layer>,
    b: Buffers,
    _ctx: Arc<CudaContext>,
}

/// A captured step. The graph is launched from whichever thread steps its sequence, one launch
/// at a time (the sequence is borrowed mutably for it), with the context bound by cudarc.
struct Graph(CudaGraph);
// SAFETY: a CUDA graph exec may be launched from any thread once the context is current there
// (cudarc binds it in `launch`); the owner launches it from one thread at a time.
unsafe impl Send for Graph {}

/// One sequence's KV cache on the GPU, with the step graphs captured over it.
pub struct GpuCache {
    k: Vec<CudaSlice<f32>>,
    v: Vec<CudaSlice<f32>>,
    ctx_len: usize,
    /// Positions the cache holds.
    pos: usize,
    /// Rows of this cache's last step.
    last_rows: usize,
    /// Whether the last step ran the LM head (its logits and ids are this cache's).
    last_head: bool,
    /// The first row of the last step that ran the LM head (a prompt step runs it on its last
    /// row alone); the logits and ids buffers hold rows `head_row0..last_rows`.
    head_row0: usize,
    /// Per row count, the full step's graph (index `rows - 1`) and the trunk's alone (index
    /// `MAX_ROWS + rows - 1`: no LM head or argmax, for prompt chunks whose logits nobody reads).
    graphs: Vec<Option<Graph>>,
}

impl GpuCache {
    /// Positions the cache holds.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

    /// Positions it can hold.
    pub fn capacity(&self) -> usize {
        self.ctx_len
    }

    /// Forgets every position from `len` on (O(1): the next step overwrites them), and the last
    /// step's logits and ids with them.
    pub fn truncate(&mut self, len: usize) {
        self.pos = self.pos.min(len);
        self.last_rows = 0;
        self.last_head = false;
        self.head_row0 = 0;
    }
}

/// Reads tensors of one GGUF onto the device.
struct Reader<'a> {
    content: &'a gguf_file::Content,
    file: &'a mut File,
    path: &'a str,
    stream: &'a Arc<CudaStream>,
}

impl Reader<'_> {
    fn tensor(&mut self, name: &str) -> Result<candle_core::quantized::QTensor> {
        self.content.tensor(self.file, name, &candle_core::Device::Cpu).map_err(|source| Gemma3GpuError::Read { path: format!("{} ({name})", self.path), source })
    }

    /// A quantized matrix of `rows` rows of `k` values, its GGUF blocks uploaded as they are.
    fn weight(&mut self, name: &str, rows: usize, k: usize) -> Result<(CudaSlice<u8>, WeightType)> {
        let t = self.tensor(name)?;
        let wt = WeightType::from_ggml(t.dtype()).ok_or_else(|| Gemma3GpuError::Unsupported { name: name.to_string(), dtype: t.dtype() })?;
        if t.shape().dims() != [rows, k] || !k.is_multiple_of(wt.block_values()) {
            return Err(Gemma3GpuError::Model { path: self.path.to_string(), what: format!("{name} has shape {:?} of {wt:?}, expected [{rows}, {k}]", t.shape().dims()) });
        }
        let data = t.data().map_err(|source| Gemma3GpuError::Read { path: self.path.to_string(), source })?;
        Ok((self.stream.clone_htod(&data[..])?, wt))
    }

    /// A vector of `n` values (a norm's weights), as f32.
    fn norm(&mut self, name: &str, n: usize) -> Result<CudaSlice<f32>> {
        let t = self.tensor(name)?;
        let v = t.dequantize(&candle_core::Device::Cpu).and_then(|t| t.flatten_all()?.to_vec1::<f32>()).map_err(|source| Gemma3GpuError::Read { path: self.path.to_string(), source })?;
        if v.len() != n {
            return Err(Gemma3GpuError::Model { path: self.path.to_string(), what: format!("{name} has {} values, expected {n}", v.len()) });
        }
        Ok(self.stream.clone_htod(&v)?)
    }
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>> {
    Ok(stream.alloc_zeros::<T>(n.max(1))?)
}

/// RoPE's inverse frequencies as candle's quantized_gemma3 computes them (f32 `powf`), so the
/// angles match the CPU path's.
fn inv_freq(hd: usize, base: f32) -> Vec<f32> {
    (0..hd).step_by(2).map(|i| 1f32 / base.powf(i as f32 / hd as f32)).collect()
}

impl Gemma3Gpu {
    /// Loads a `gemma3` GGUF onto GPU `ordinal`, for caches of up to `max_ctx` positions.
    pub fn load(path: &Path, ordinal: usize, max_ctx: usize) -> Result<Gemma3Gpu> {
        let ctx_len = max_ctx.max(1);
        let shown = path.display().to_string();
        let read_err = |source| Gemma3GpuError::Read { path: shown.clone(), source };
        let model_err = |what: String| Gemma3GpuError::Model { path: shown.clone(), what };
        let mut file = File::open(path).map_err(|e| read_err(candle_core::Error::from(e)))?;
        let content = gguf_file::Content::read(&mut file).map_err(read_err)?;
        let arch = content.metadata.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
        if arch != "gemma3" {
            return Err(model_err(format!("architecture `{arch}`: the GPU engine runs gemma3")));
        }
        let md = |key: &str| content.metadata.get(&format!("gemma3.{key}"));
        let md_u = |key: &str| -> Result<usize> { md(key).and_then(|v| v.to_u32().ok()).map(|v| v as usize).ok_or_else(|| model_err(format!("metadata gemma3.{key} missing"))) };
        let md_f = |key: &str, default: f32| md(key).and_then(|v| v.to_f32().ok()).unwrap_or(default);
        let embd_info = content.tensor_infos.get("token_embd.weight").ok_or_else(|| model_err("no token_embd.weight".into()))?;
        let vocab = embd_info.shape.dims()[0];
        let cfg = Gemma3Config {
            hidden: md_u("embedding_length")?,
            layers: md_u("block_count")?,
            n_head: md_u("attention.head_count")?,
            n_kv: md_u("attention.head_count_kv")?,
            head_dim: md_u("attention.key_length")?,
            ff: md_u("feed_forward_length")?,
            vocab,
            eps: md_f("attention.layer_norm_rms_epsilon", 1e-6),
            rope_global: md_f("rope.freq_base", 1_000_000.0),
            rope_local: md_f("rope.local_freq_base", 10_000.0),
            window: md_u("attention.sliding_window")?,
            sliding_pattern: md_u("attention.sliding_window_type").unwrap_or(6),
        };
        if !matches!(cfg.head_dim, 64 | 128 | 256) || !cfg.n_head.is_multiple_of(cfg.n_kv) || cfg.n_head / cfg.n_kv > 8 {
            return Err(model_err(format!("head layout {} heads / {} KV heads of {} dims is not one the GPU kernels take", cfg.n_head, cfg.n_kv, cfg.head_dim)));
        }
        if !cfg.hidden.is_multiple_of(32) || !cfg.ff.is_multiple_of(32) {
            return Err(model_err(format!("widths {} and {} must be multiples of 32", cfg.hidden, cfg.ff)));
        }
        if cfg.hidden > crate::cuda::NQ_MAX_K {
            return Err(model_err(format!("hidden width {} is over {}, the widest row the fused norms take", cfg.hidden, crate::cuda::NQ_MAX_K)));
        }
        // SAFETY: dlopens the driver library and closes it again (cudarc would panic without it).
        if !unsafe { sys::is_culib_present() } {
            return Err(model_err("cannot load libcuda.so.1 (the NVIDIA driver)".into()));
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: the engine works on one stream; nothing of it is used on another.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let kernels = Kernels::load(&ctx)?;
        let mut r = Reader { content: &content, file: &mut file, path: &shown, stream: &stream };
        let embd = r.weight("token_embd.weight", cfg.vocab, cfg.hidden)?;
        if embd.1 != WeightType::Q8_0 {
            return Err(model_err(format!("token_embd.weight is {:?}: the embedding gather reads Q8_0", embd.1)));
        }
        let output = if content.tensor_infos.contains_key("output.weight") { Some(r.weight("output.weight", cfg.vocab, cfg.hidden)?) } else { None };
        let output_norm = r.norm("output_norm.weight", cfg.hidden)?;
        let (qd, kvd) = (cfg.n_head * cfg.head_dim, cfg.n_kv * cfg.head_dim);
        let mut layers = Vec::new();
        for l in 0..cfg.layers {
            let p = format!("blk.{l}");
            let layer = Layer {
                attn_norm: r.norm(&format!("{p}.attn_norm.weight"), cfg.hidden)?,
                q: r.weight(&format!("{p}.attn_q.weight"), qd, cfg.hidden)?,
                k: r.weight(&format!("{p}.attn_k.weight"), kvd, cfg.hidden)?,
                v: r.weight(&format!("{p}.attn_v.weight"), kvd, cfg.hidden)?,
                q_norm: r.norm(&format!("{p}.attn_q_norm.weight"), cfg.head_dim)?,
                k_norm: r.norm(&format!("{p}.attn_k_norm.weight"), cfg.head_dim)?,
                o: r.weight(&format!("{p}.attn_output.weight"), cfg.hidden, qd)?,
                post_attn_norm: r.norm(&format!("{p}.post_attention_norm.weight"), cfg.hidden)?,
                ffn_norm: r.norm(&format!("{p}.ffn_norm.weight"), cfg.hidden)?,
                gate: r.weight(&format!("{p}.ffn_gate.weight"), cfg.ff, cfg.hidden)?,
                up: r.weight(&format!("{p}.ffn_up.weight"), cfg.ff, cfg.hidden)?,
                down: r.weight(&format!("{p}.ffn_down.weight"), cfg.hidden, cfg.ff)?,
                post_ffn_norm: r.norm(&format!("{p}.post_ffw_norm.weight"), cfg.hidden)?,
            };
            if layer.gate.1 != layer.up.1 {
                return Err(model_err(format!("{p}: ffn_gate and ffn_up differ in type; the fused GLU reads one")));
            }
            layers.push(layer);
        }
        let kmax = cfg.ff.max(qd).max(cfg.hidden);
        let chunks_max = Kernels::attn_chunks_max(ctx_len, 0);
        let prompt_rows = PROMPT_ROWS;
        let m = prompt_rows;
        let b = Buffers {
            h: alloc(&stream, m * cfg.hidden)?,
            q: alloc(&stream, m * qd)?,
            k: alloc(&stream, m * kvd)?,
            v: alloc(&stream, m * kvd)?,
            o: alloc(&stream, m * cfg.hidden)?,
            ff: alloc(&stream, m * cfg.ff)?,
            down: alloc(&stream, m * cfg.hidden)?,
            logits: alloc(&stream, MAX_ROWS * cfg.vocab)?,
            qs: alloc(&stream, m * kmax)?,
            qd: alloc(&stream, m * kmax / QK)?,
            qsum: alloc(&stream, m * kmax / QK)?,
            partials: alloc(&stream, MAX_ROWS * cfg.n_head * chunks_max * (cfg.head_dim + 2))?,
            attn_counters: alloc(&stream, MAX_ROWS * cfg.n_head)?,
            cand_v: alloc(&stream, MAX_ROWS * ARGMAX_BLOCKS)?,
            cand_i: alloc(&stream, MAX_ROWS * ARGMAX_BLOCKS)?,
            argmax_counters: alloc(&stream, MAX_ROWS)?,
            ids: alloc(&stream, MAX_ROWS)?,
            topk_cand: alloc(&stream, Kernels::topk_blocks(cfg.vocab) * TOPK_MAX)?,
            topk_counters: alloc(&stream, MAX_ROWS)?,
            topk_ids: alloc(&stream, TOPK_MAX)?,
            topk_vals: alloc(&stream, TOPK_MAX)?,
        };
        let step = std::sync::Mutex::new(StepBlock { params: alloc(&stream, 1)?, tokens: alloc(&stream, m)? });
        let inv_local = stream.clone_htod(&inv_freq(cfg.head_dim, cfg.rope_local))?;
        let inv_global = stream.clone_htod(&inv_freq(cfg.head_dim, cfg.rope_global))?;
        stream.synchronize()?;
        Ok(Gemma3Gpu { cfg, max_ctx: ctx_len, prompt_rows, stream, step, kernels, embd, output, output_norm, inv_local, inv_global, layers, b, _ctx: ctx })
    }

    pub fn config(&self) -> &Gemma3Config {
        &self.cfg
    }

    /// The longest cache the model makes.
    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// The most rows (tokens) of one step: a prompt step of more than [`MAX_ROWS`] rows runs
    /// without a graph.
    pub fn prompt_rows(&self) -> usize {
        self.prompt_rows
    }

    /// An empty KV cache of `ctx_len` positions (at most [`Gemma3Gpu::max_ctx`]).
    pub fn new_cache(&self, ctx_len: usize) -> Result<GpuCache> {
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let kvd = self.cfg.n_kv * self.cfg.head_dim;
        let mut k = Vec::with_capacity(self.cfg.layers);
        let mut v = Vec::with_capacity(self.cfg.layers);
        for _ in 0..self.cfg.layers {
            k.push(alloc(&self.stream, kvd * ctx_len)?);
            v.push(alloc(&self.stream, kvd * ctx_len)?);
        }
        Ok(GpuCache { k, v, ctx_len, pos: 0, last_rows: 0, last_head: false, head_row0: 0, graphs: (0..2 * MAX_ROWS).map(|_| None).collect() })
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> DevPtr {
        s.device_ptr(&self.stream).0
    }

    /// The launches of one step of `rows` rows over `cache` (what a graph captures); without
    /// `head`, the trunk alone (the residual stream after the last layer, no logits or ids).
    /// With `prompt` (the address of the step's token ids), a prompt step of up to [`Gemma3Gpu::prompt_rows`]
    /// rows: the tokens from the tokens buffer, the rows' attention, the head on the last row.
    /// `mark` is called after each launch with what it does (the profile's events).
    fn launch_step(&self, cache: &GpuCache, step: DevPtr, rows: usize, head: bool, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<usize, GpuError> {
        let c = &self.cfg;
        let b = &self.b;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let act = (self.ptr(&b.qs), self.ptr(&b.qd), self.ptr(&b.qsum));
        let ctx_len = cache.ctx_len;
        let (qd, kvd) = (c.n_head * c.head_dim, c.n_kv * c.head_dim);
        let nq = |a: DevPtr, w_a: DevPtr, mode: i32, k: usize, w: DevPtr| NormQuantArgs {
            a,
            res: p(&b.h),
            w_a,
            embd: self.ptr(&self.embd.0),
            embd_scale: (c.hidden as f64).sqrt() as f32,
            step,
            w,
            eps: c.eps,
            res_out: if mode == 0 { 0 } else { p(&b.h) },
            y_out: 0,
            qs: act.0,
            qd: act.1,
            qsum: act.2,
            k: k as i32,
            in_mode: mode,
            norm: (w != 0) as i32,
            tokens: prompt.unwrap_or(0),
        };
        let seg =
            |w: &(CudaSlice<u8>, WeightType), out: &CudaSlice<f32>, n: usize| GemvSeg { w: self.ptr(&w.0), out: p(out), n: n as i32, wtype: w.1.ggml_id(), out_stride: n as i32, ..Default::default() };
        let s = &self.stream;
        let k = &self.kernels;
        let mut count = 0;
        // SAFETY: every buffer was allocated at load for prompt_rows rows of its width (the
        // logits and argmax scratch for MAX_ROWS; `step` keeps rows <= MAX_ROWS unless `prompt`,
        // whose head runs on one row), the caches for ctx_len positions, and `step` checks that
        // the step's positions are below ctx_len before it launches.
        unsafe {
            for (l, ly) in self.layers.iter().enumerate() {
                let local = c.is_local(l);
                let first = if l == 0 { nq(0, 0, 2, c.hidden, p(&ly.attn_norm)) } else { nq(p(&b.down), p(&self.layers[l - 1].post_ffn_norm), 1, c.hidden, p(&ly.attn_norm)) };
                k.norm_quant(s, rows, &first)?;
                mark("norm_quant")?;
                k.gemv(s, rows, c.hidden, &[seg(&ly.q, &b.q, qd), seg(&ly.k, &b.k, kvd), seg(&ly.v, &b.v, kvd)], act)?;
                mark("gemv qkv")?;
                let rope = RopeArgs {
                    q: p(&b.q),
                    k: p(&b.k),
                    v: p(&b.v),
                    q_norm: p(&ly.q_norm),
                    k_norm: p(&ly.k_norm),
                    eps: c.eps,
                    inv_freq: if local { p(&self.inv_local) } else { p(&self.inv_global) },
                    q_scale: 1.0 / (c.head_dim as f32).sqrt(),
                    k_cache: p(&cache.k[l]),
                    v_cache: p(&cache.v[l]),
                    ctx: ctx_len as i32,
                    step,
                    n_head: c.n_head as i32,
                    n_kv: c.n_kv as i32,
                    hd: c.head_dim as i32,
                };
                k.qk_norm_rope_kv(s, rows, &rope)?;
                mark("qk_norm_rope_kv")?;
                let window = if local { c.window } else { 0 };
                let at = AttnArgs {
                    q: p(&b.q),
                    k_cache: p(&cache.k[l]),
                    v_cache: p(&cache.v[l]),
                    out: 0,
                    partials: p(&b.partials),
                    counters: self.ptr(&b.attn_counters),
                    step,
                    qs: act.0,
                    qd: act.1,
                    qsum: act.2,
                    ctx: ctx_len as i32,
                    window: window as i32,
                    n_head: c.n_head as i32,
                    n_kv: c.n_kv as i32,
                    chunks_max: Kernels::attn_chunks_max(ctx_len, window) as i32,
                };
                match prompt {
                    Some(_) => k.attention_prompt(s, rows, c.head_dim, &at)?,
                    None => k.attention(s, rows, c.head_dim, &at)?,
                }
                mark(if local { "attention local" } else { "attention global" })?;
                k.gemv(s, rows, qd, &[seg(&ly.o, &b.o, c.hidden)], act)?;
                mark("gemv o")?;
                k.norm_quant(s, rows, &nq(p(&b.o), p(&ly.post_attn_norm), 1, c.hidden, p(&ly.ffn_norm)))?;
                mark("norm_quant")?;
                let glu = GemvSeg { w: self.ptr(&ly.gate.0), w2: self.ptr(&ly.up.0), out: p(&b.ff), n: c.ff as i32, wtype: ly.gate.1.ggml_id(), out_stride: c.ff as i32, glu: 1, block_start: 0 };
                k.gemv(s, rows, c.hidden, &[glu], act)?;
                mark("gemv gate·up")?;
                k.norm_quant(s, rows, &nq(p(&b.ff), 0, 0, c.ff, 0))?;
                mark("norm_quant")?;
                k.gemv(s, rows, c.ff, &[seg(&ly.down, &b.down, c.hidden)], act)?;
                mark("gemv down")?;
                count += 9;
            }
            let last = self.layers.last().expect("a model has layers");
            k.norm_quant(s, rows, &nq(p(&b.down), p(&last.post_ffn_norm), 1, c.hidden, p(&self.output_norm)))?;
            mark("norm_quant")?;
            count += 1;
            if !head {
                return Ok(count);
            }
            let head = self.output.as_ref().unwrap_or(&self.embd);
            // A prompt step: the last row's Q8 activations alone.
            let (head_rows, act) = match prompt {
                None => (rows, act),
                Some(_) => {
                    let r = (rows - 1) as u64;
                    let kb = (c.hidden / QK) as u64;
                    (1, (act.0 + r * c.hidden as u64, act.1 + r * kb * 4, act.2 + r * kb * 4))
                }
            };
            k.gemv(s, head_rows, c.hidden, &[seg(head, &b.logits, c.vocab)], act)?;
            mark("lm head")?;
            let am =
                ArgmaxArgs { logits: p(&b.logits), n: c.vocab as i32, cand_v: p(&b.cand_v), cand_i: self.ptr(&b.cand_i), counters: self.ptr(&b.argmax_counters), ids: self.ptr(&b.ids), feed: 0, step };
            k.argmax(s, head_rows, &am)?;
            mark("argmax")?;
            count += 2;
        }
        Ok(count)
    }

    /// The step of `rows` rows over `cache` (without `head`, the trunk's), captured as a graph
    /// the first time.
    fn graph<'c>(&self, cache: &'c mut GpuCache, step: DevPtr, rows: usize, head: bool) -> Result<&'c CudaGraph> {
        let at = if head { rows - 1 } else { MAX_ROWS + rows - 1 };
        if cache.graphs[at].is_none() {
            self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let launched = self.launch_step(cache, step, rows, head, None, &mut |_| Ok(()));
            // End the capture whatever happened, so the stream is usable again.
            let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            launched?;
            let graph = graph?.ok_or_else(|| Gemma3GpuError::Step { rows, pos: cache.pos, what: "the capture made no graph".into() })?;
            graph.upload()?;
            cache.graphs[at] = Some(Graph(graph));
        }
        Ok(&cache.graphs[at].as_ref().expect("captured just above").0)
    }

    /// Kernel launches (graph nodes) of a step of `rows` rows.
    pub fn graph_nodes(&self, cache: &mut GpuCache, rows: usize) -> Result<usize> {
        let step = self.ptr(&self.step.lock().expect("a step panicked holding the step block").params);
        let g = self.graph(cache, step, rows, true)?;
        let mut n = 0usize;
        // SAFETY: counting the nodes of a live graph (a null array asks for the count only).
        unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) }.result()?;
        Ok(n)
    }

    /// Runs `tokens` (1..=8) at `cache`'s next positions: their K/V enter the cache, their
    /// logits and greedy ids are ready for [`Gemma3Gpu::logits`] and [`Gemma3Gpu::argmax`]
    /// until the next step of any cache.
    pub fn forward(&self, cache: &mut GpuCache, tokens: &[u32]) -> Result<()> {
        self.forward_banning(cache, tokens, &[])
    }

    /// [`Gemma3Gpu::forward`], with the greedy ids of this step ([`Gemma3Gpu::argmax`]) passing
    /// over `banned` (at most [`MAX_BANNED`] ids: `ignore_eos`'s end-of-generation ids). The
    /// logits are not changed.
    pub fn forward_banning(&self, cache: &mut GpuCache, tokens: &[u32], banned: &[u32]) -> Result<()> {
        self.step(cache, tokens, banned, true, &mut |_| Ok(()))
    }

    /// Runs `tokens` (1..=[`Gemma3Gpu::prompt_rows`]) through the trunk alone: their K/V enter
    /// the cache and their final hidden states are ready for [`Gemma3Gpu::hidden`]; no LM head
    /// runs, so there are no logits or ids (a prompt chunk whose logits nobody reads).
    pub fn forward_trunk(&self, cache: &mut GpuCache, tokens: &[u32]) -> Result<()> {
        self.step(cache, tokens, &[], false, &mut |_| Ok(()))
    }

    /// Runs a prompt's `tokens` (1..=[`Gemma3Gpu::prompt_rows`]): their K/V enter the cache,
    /// their final hidden states are ready for [`Gemma3Gpu::hidden`], and the last row's logits
    /// and greedy id for [`Gemma3Gpu::logits_row`] and [`Gemma3Gpu::argmax`] (steps of up to
    /// [`MAX_ROWS`] rows give every row's, as [`Gemma3Gpu::forward`] does).
    pub fn forward_prompt(&self, cache: &mut GpuCache, tokens: &[u32]) -> Result<()> {
        self.step(cache, tokens, &[], true, &mut |_| Ok(()))
    }

    /// Runs a prompt step of `tokens` (more than [`MAX_ROWS`], up to
    /// [`Gemma3Gpu::prompt_rows`]) as [`Gemma3Gpu::forward_prompt`] does, with an event after
    /// each launch, and returns each kind of launch's device time in microseconds, summed over
    /// the step, in the order first launched (the events keep launches from overlapping, so the
    /// sum is somewhat above the step's time).
    pub fn profile_prompt(&self, cache: &mut GpuCache, tokens: &[u32]) -> Result<Vec<(&'static str, f64)>> {
        if tokens.len() <= MAX_ROWS {
            return Err(Gemma3GpuError::Step { rows: tokens.len(), pos: cache.pos, what: format!("a profiled prompt step takes more than {MAX_ROWS} tokens") });
        }
        let event = |stream: &Arc<CudaStream>| stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|source| GpuError::Launch { kernel: "event", source });
        let mut marks = Vec::new();
        self.step(cache, tokens, &[], true, &mut |what| {
            marks.push((what, event(&self.stream)?));
            Ok(())
        })?;
        self.stream.synchronize()?;
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

    /// One step of `tokens`; a prompt step (more than [`MAX_ROWS`] rows) calls `mark` once before
    /// its launches ("start") and after each ([`Gemma3Gpu::profile_prompt`]).
    fn step(&self, cache: &mut GpuCache, tokens: &[u32], banned: &[u32], head: bool, mark: &mut Mark) -> Result<()> {
        let rows = tokens.len();
        let fail = |what: String| Gemma3GpuError::Step { rows, pos: cache.pos, what };
        if !(1..=self.prompt_rows).contains(&rows) {
            return Err(fail(format!("a step takes 1 to {} tokens", self.prompt_rows)));
        }
        if cache.pos + rows > cache.ctx_len {
            return Err(fail(format!("the cache holds {} positions", cache.ctx_len)));
        }
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(fail(format!("token {t} is outside the vocabulary of {}", self.cfg.vocab)));
        }
        if banned.len() > MAX_BANNED {
            return Err(fail(format!("{} banned ids (the argmax passes over at most {MAX_BANNED})", banned.len())));
        }
        let mut params = StepParams { pos: cache.pos as i32, rows: rows as i32, n_banned: banned.len() as i32, ..Default::default() };
        for (slot, &t) in params.tokens.iter_mut().zip(tokens) {
            *slot = t as i32;
        }
        for (slot, &t) in params.banned.iter_mut().zip(banned) {
            *slot = t as i32;
        }
        let mut block = self.step.lock().expect("a step panicked holding the step block");
        // Ordered on the stream after the previous step, which may still be reading the block.
        self.stream.memcpy_htod(&[params][..], &mut block.params)?;
        let step = self.ptr(&block.params);
        if rows <= MAX_ROWS {
            self.graph(cache, step, rows, head)?.launch()?;
        } else {
            let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
            // Ordered like the parameters; rows <= prompt_rows, the buffer's length (checked above).
            self.stream.memcpy_htod(&ids[..], &mut block.tokens.slice_mut(..rows))?;
            let prompt = self.ptr(&block.tokens);
            mark("start")?;
            self.launch_step(cache, step, rows, head, Some(prompt), mark)?;
        }
        drop(block);
        cache.pos += rows;
        cache.last_rows = rows;
        cache.last_head = head;
        cache.head_row0 = if rows > MAX_ROWS { rows - 1 } else { 0 };
        Ok(())
    }

    /// Runs `tokens` as [`Gemma3Gpu::forward_banning`] does and returns the `k` best `(id, logit)`
    /// of the last row's logits (1 <= k <= [`TOPK_MAX`]; the sampler's order: logit by total
    /// order, ties to the lower id; `banned` left out), best first: what a sampled step with
    /// top-k reads, instead of the vocabulary-wide row.
    pub fn forward_top_k(&self, cache: &mut GpuCache, tokens: &[u32], banned: &[u32], k: usize) -> Result<Vec<(u32, f32)>> {
        if !(1..=TOPK_MAX).contains(&k) || self.cfg.vocab > TOPK_MAX_N {
            return Err(Gemma3GpuError::Step { rows: tokens.len(), pos: cache.pos, what: format!("top {k} of a vocabulary of {} (1..={TOPK_MAX} of up to {TOPK_MAX_N})", self.cfg.vocab) });
        }
        self.step(cache, tokens, banned, true, &mut |_| Ok(()))?;
        let row = cache.last_rows - 1 - cache.head_row0;
        let vocab = self.cfg.vocab;
        let block = self.step.lock().expect("a step panicked holding the step block");
        let args = TopKArgs {
            logits: self.ptr(&self.b.logits) + (row * vocab * 4) as u64,
            n: vocab as i32,
            k: k as i32,
            cand: self.ptr(&self.b.topk_cand),
            counters: self.ptr(&self.b.topk_counters),
            ids: self.ptr(&self.b.topk_ids),
            vals: self.ptr(&self.b.topk_vals),
            step: self.ptr(&block.params),
        };
        // SAFETY: the logits row lies in the logits buffer (row < MAX_ROWS), the scratch holds
        // topk_blocks(vocab) * TOPK_MAX keys, the outputs TOPK_MAX values, the counters MAX_ROWS
        // zeroed ints; the step block is the one this step's banned ids were written to.
        unsafe { self.kernels.top_k(&self.stream, 1, &args)? };
        drop(block);
        let (mut ids, mut vals) = (vec![0i32; k], vec![0f32; k]);
        self.stream.memcpy_dtoh(&self.b.topk_ids.slice(..k), &mut ids[..])?;
        self.stream.memcpy_dtoh(&self.b.topk_vals.slice(..k), &mut vals[..])?;
        self.stream.synchronize()?;
        Ok(ids.into_iter().zip(vals).filter(|&(i, _)| i >= 0).map(|(i, v)| (i as u32, v)).collect())
    }

    fn headed(&self, cache: &GpuCache) -> Result<()> {
        if cache.last_head {
            return Ok(());
        }
        Err(Gemma3GpuError::Step { rows: cache.last_rows, pos: cache.pos, what: "the last step ran the trunk alone: it has no logits or ids".into() })
    }

    /// The greedy ids of `cache`'s last step (lowest id among equal maxima): every row's, or
    /// after a prompt step of more than [`MAX_ROWS`] rows the last row's alone.
    pub fn argmax(&self, cache: &GpuCache) -> Result<Vec<u32>> {
        self.headed(cache)?;
        let ids = self.stream.clone_dtoh(&self.b.ids)?;
        Ok(ids[..cache.last_rows - cache.head_row0].iter().map(|&i| i as u32).collect())
    }

    /// The logits of `cache`'s last step, `rows × vocab` (after a prompt step of more than
    /// [`MAX_ROWS`] rows, the last row's alone).
    pub fn logits(&self, cache: &GpuCache) -> Result<Vec<f32>> {
        self.headed(cache)?;
        let n = (cache.last_rows - cache.head_row0) * self.cfg.vocab;
        let mut v = vec![0f32; n];
        self.stream.memcpy_dtoh(&self.b.logits.slice(..n), &mut v[..])?;
        Ok(v)
    }

    /// The logits of row `row` of `cache`'s last step (`vocab` values; a prompt's last row).
    pub fn logits_row(&self, cache: &GpuCache, row: usize) -> Result<Vec<f32>> {
        self.headed(cache)?;
        if row >= cache.last_rows || row < cache.head_row0 {
            return Err(Gemma3GpuError::Step { rows: cache.last_rows, pos: cache.pos, what: format!("no logits for row {row}") });
        }
        let vocab = self.cfg.vocab;
        let mut v = vec![0f32; vocab];
        let at = row - cache.head_row0;
        self.stream.memcpy_dtoh(&self.b.logits.slice(at * vocab..(at + 1) * vocab), &mut v[..])?;
        Ok(v)
    }

    /// The final hidden states (the residual stream before the output norm, what candle's
    /// `forward_all` returns as `hidden`) of `cache`'s last step, `rows × hidden`.
    pub fn hidden(&self, cache: &GpuCache) -> Result<Vec<f32>> {
        let n = cache.last_rows * self.cfg.hidden;
        let mut v = vec![0f32; n];
        self.stream.memcpy_dtoh(&self.b.h.slice(..n), &mut v[..])?;
        Ok(v)
    }

    /// Every layer's K and V for `cache`'s positions, `(n_kv, len, head_dim)` f32 each, in
    /// order (candle's cache layout, so a slot file moves between the engine and candle's path).
    pub fn read_kv(&self, cache: &GpuCache) -> Result<Vec<LayerKv>> {
        let (n_kv, hd, len, ctx) = (self.cfg.n_kv, self.cfg.head_dim, cache.pos, cache.ctx_len);
        let mut out = Vec::with_capacity(self.cfg.layers);
        for l in 0..self.cfg.layers {
            let (mut k, mut v) = (vec![0f32; n_kv * len * hd], vec![0f32; n_kv * len * hd]);
            for h in 0..n_kv {
                let (src, dst) = (h * ctx * hd..h * ctx * hd + len * hd, h * len * hd..(h + 1) * len * hd);
                self.stream.memcpy_dtoh(&cache.k[l].slice(src.clone()), &mut k[dst.clone()])?;
                self.stream.memcpy_dtoh(&cache.v[l].slice(src), &mut v[dst])?;
            }
            out.push((k, v));
        }
        Ok(out)
    }

    /// Sets `cache` to `len` positions whose K and V are `layers` ([`Gemma3Gpu::read_kv`]'s
    /// layout). Checked first: on a shape error the cache is unchanged; a copy that fails
    /// part way leaves it empty.
    pub fn write_kv(&self, cache: &mut GpuCache, len: usize, layers: &[(&[f32], &[f32])]) -> Result<()> {
        let (n_kv, hd, ctx) = (self.cfg.n_kv, self.cfg.head_dim, cache.ctx_len);
        let fail = |what: String| Gemma3GpuError::Step { rows: 0, pos: cache.pos, what };
        if len > ctx {
            return Err(fail(format!("{len} positions for a cache of {ctx}")));
        }
        if layers.len() != self.cfg.layers {
            return Err(fail(format!("K/V of {} layers for a model of {}", layers.len(), self.cfg.layers)));
        }
        if let Some((k, v)) = layers.iter().find(|(k, v)| k.len() != n_kv * len * hd || v.len() != k.len()) {
            return Err(fail(format!("a layer's K/V hold {} and {} values, expected {n_kv} x {len} x {hd}", k.len(), v.len())));
        }
        cache.truncate(0);
        for (l, (k, v)) in layers.iter().enumerate() {
            for h in 0..n_kv {
                let (dst, src) = (h * ctx * hd..h * ctx * hd + len * hd, h * len * hd..(h + 1) * len * hd);
                self.stream.memcpy_htod(&k[src.clone()], &mut cache.k[l].slice_mut(dst.clone()))?;
                self.stream.memcpy_htod(&v[src], &mut cache.v[l].slice_mut(dst))?;
            }
        }
        self.stream.synchronize()?;
        cache.pos = len;
        Ok(())
    }

    /// Waits for the stream.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}
