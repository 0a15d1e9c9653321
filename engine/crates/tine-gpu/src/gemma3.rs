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
//! A NextN head baked into the GGUF (`gemma3.nextn_predict_layers = 1`: the last block is the
//! head's, not the trunk's) runs as 14 launches over the same kernels and buffers, its own KV
//! cache per sequence ([`NextNCache`]) and a graph per entry count: `norm_quant` twice into the
//! halves of each row's activations (`enorm` of the next token's scaled embedding, `hnorm` of
//! the input hidden state), `eh_proj`, the block (8 launches after its first `norm_quant`),
//! `shared_head_norm` with the residual, and the head's projection of the last entry (over its
//! draft vocabulary when it has one). Entries past 8 run the prompt kernels.
//!
//! An assistant head (a separate `gemma4-assistant` GGUF, [`AssistantGpu`]) drafts over a
//! sequence's [`GpuCache`] itself: its queries attend over the trunk's last local (or global)
//! layer with the step's `kv_end`, 16 launches for a one-block head (the `assistant` module).
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

use crate::blocks::{WeightType, EMBD_WIDE, QK};
mod assistant;
mod batch;
pub use crate::batch::{padded_rows, GpuBatch, BATCH_MAX_ROWS};
pub use assistant::AssistantGpu;
/// An entry of Gemma 3's batched step ([`Gemma3Gpu::forward_batch`]).
pub type BatchEntry<'a> = crate::batch::BatchEntry<'a, GpuCache>;

use crate::cuda::{AttnArgs, DevPtr, GemvSeg, GpuError, Kernels, KvLayer, KvPtrs, KvTypes, NormQuantArgs, RopeArgs, StepParams, MAX_BANNED, MAX_ROWS};
use crate::readout::{time_marks, LastStep, Readout};

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
    #[error("tensor {name} is {dtype:?}, which the GPU engine does not read (it reads Q4_K, Q5_K, Q5_0, Q6_K and Q8_0 weights, and float matrices of rows of a multiple of 32 as Q8_0)")]
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

pub use crate::config::Gemma3Config;

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

/// The weights of a block after its attention ([`Gemma3Gpu::launch_block_tail`]): the trunk's
/// layers, a NextN head's block and an assistant head's blocks share them.
struct BlockTail<'a> {
    o: &'a (CudaSlice<u8>, WeightType),
    post_attn_norm: &'a CudaSlice<f32>,
    ffn_norm: &'a CudaSlice<f32>,
    gate: &'a (CudaSlice<u8>, WeightType),
    up: &'a (CudaSlice<u8>, WeightType),
    down: &'a (CudaSlice<u8>, WeightType),
}

/// A NextN head (block `layers` of a `gemma3` GGUF with `nextn_predict_layers = 1`): at entry `j`
/// it reads the trunk's hidden state `H_j` (before the output norm) and the token at `j + 1`:
/// `x = eh_proj([enorm(E·√n); hnorm(H)])`, one Gemma 3 block over its own KV cache (position `j`),
/// then `shared_head_norm` and its output projection on the last row. Its output hidden state
/// (before `shared_head_norm`) chains into the next draft step in place of `H`.
struct NextNHead {
    eh_proj: (CudaSlice<u8>, WeightType),
    enorm: CudaSlice<f32>,
    hnorm: CudaSlice<f32>,
    shared_head_norm: CudaSlice<f32>,
    /// `None`: the trunk's output projection.
    head: Option<Matrix>,
    /// Rows of its logits: the draft vocabulary's size, else the vocabulary's.
    rows: usize,
    /// `None`: the trunk's embedding table.
    embed: Option<Matrix>,
    draft_vocab: Option<Vec<u32>>,
    block: Layer,
    local: bool,
    /// The last entry's logits.
    logits: CudaSlice<f32>,
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
    qs: CudaSlice<i8>,
    qd: CudaSlice<f32>,
    qsum: CudaSlice<i32>,
    partials: CudaSlice<f32>,
    attn_counters: CudaSlice<i32>,
    /// A step's K and V rows as f32 for `turbo_store` (caches of the turbo types).
    stage: CudaSlice<f32>,
    /// The LM head's rows and what reads them.
    out: Readout,
}

/// The step's inputs in device memory, written by the host before each step's launches.
struct StepBlock {
    params: CudaSlice<StepParams>,
    /// A prompt step's token ids ([`Gemma3Gpu::prompt_rows`] of them).
    tokens: CudaSlice<i32>,
    /// A NextN step's input hidden states ([`Gemma3Gpu::prompt_rows`] rows; none without a head).
    hin: CudaSlice<f32>,
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
    embd: Matrix,
    output: Option<Matrix>,
    output_norm: CudaSlice<f32>,
    inv_local: CudaSlice<f32>,
    inv_global: CudaSlice<f32>,
    layers: Vec<Layer>,
    nextn: Option<NextNHead>,
    b: Buffers,
    /// The matrices are in the wide layout ([`wide_layout`]).
    wide: bool,
    _ctx: Arc<CudaContext>,
}

/// A captured step. The graph is launched from whichever thread steps its sequence, one launch
/// at a time (the sequence is borrowed mutably for it), with the context bound by cudarc.
pub(crate) struct Graph(pub(crate) CudaGraph);
// SAFETY: a CUDA graph exec may be launched from any thread once the context is current there
// (cudarc binds it in `launch`); the owner launches it from one thread at a time.
unsafe impl Send for Graph {}

/// A NextN step's parameters (entries at `pos..`, RoPE turned `rope_shift` positions further),
/// or why the step cannot run: 1 to `prompt_rows` entries, `hidden` of `width` values each, the
/// cache's `ctx_len` entries, tokens below `vocab`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nextn_params(pos: usize, ctx_len: usize, prompt_rows: usize, width: usize, vocab: usize, hidden: &[f32], tokens: &[u32], rope_shift: i32) -> std::result::Result<StepParams, String> {
    let rows = tokens.len();
    if !(1..=prompt_rows).contains(&rows) {
        return Err(format!("a NextN step takes 1 to {prompt_rows} entries"));
    }
    if hidden.len() != rows * width {
        return Err(format!("{} hidden values for {rows} entries of {width}", hidden.len()));
    }
    if pos + rows > ctx_len {
        return Err(format!("the NextN cache holds {ctx_len} entries"));
    }
    if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(format!("token {t} is outside the vocabulary of {vocab}"));
    }
    let mut params = StepParams { pos: pos as i32, rows: rows as i32, rope_shift, ..Default::default() };
    for (slot, &t) in params.tokens.iter_mut().zip(tokens) {
        *slot = t as i32;
    }
    Ok(params)
}

impl Graph {
    /// Replays `slot`'s graph, first capturing `launch` (a step's launches, reading their
    /// positions from device memory) into it when it has none. A failed capture leaves `slot`
    /// empty, so the next step captures again.
    pub(crate) fn replay(stream: &Arc<CudaStream>, slot: &mut Option<Graph>, launch: impl FnOnce() -> std::result::Result<(), GpuError>, none: impl FnOnce() -> Gemma3GpuError) -> Result<()> {
        if slot.is_none() {
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let launched = launch();
            // End the capture whatever happened, so the stream is usable again.
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            launched?;
            let graph = graph?.ok_or_else(none)?;
            graph.upload()?;
            *slot = Some(Graph(graph));
        }
        slot.as_ref().expect("captured just above").0.launch()?;
        Ok(())
    }
}

/// One sequence's KV cache on the GPU, with the step graphs captured over it.
pub struct GpuCache {
    /// Per layer, its K and V in the cache's stored types.
    pub(crate) kv: Vec<KvLayer>,
    ctx_len: usize,
    /// Positions the cache holds.
    pos: usize,
    /// Which rows of this cache's last step the readout holds.
    last: LastStep,
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

    /// The types its keys and values are stored in.
    pub fn types(&self) -> KvTypes {
        self.kv.first().map_or(KvTypes::F32, |l| l.types)
    }

    /// Device bytes its K and V take.
    pub fn kv_bytes(&self) -> usize {
        self.kv.iter().map(KvLayer::bytes).sum()
    }

    /// Forgets every position from `len` on (O(1): the next step overwrites them), and the last
    /// step's logits and ids with them.
    pub fn truncate(&mut self, len: usize) {
        self.pos = self.pos.min(len);
        self.last = LastStep::default();
    }
}

/// One sequence's NextN cache on the GPU (the head block's K and V), with the head's step graphs
/// captured over it.
pub struct NextNCache {
    kv: KvLayer,
    ctx_len: usize,
    /// Entries the cache holds.
    pos: usize,
    /// Per entry count (index `rows - 1`), the head's step graph.
    graphs: Vec<Option<Graph>>,
}

impl NextNCache {
    /// Entries held.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

    /// Forgets every entry from `len` on (O(1)).
    pub fn truncate(&mut self, len: usize) {
        self.pos = self.pos.min(len);
    }
}

/// A matrix an LM head or an embedding gather reads, in the engine's layout.
pub(crate) struct Matrix {
    pub(crate) buf: CudaSlice<u8>,
    pub(crate) wt: WeightType,
    pub(crate) wide: bool,
}

impl Matrix {
    /// `norm_quant`'s `embd_type` for a gather over this table.
    pub(crate) fn embd_type(&self) -> i32 {
        self.wt.ggml_id() | if self.wide { EMBD_WIDE } else { 0 }
    }
}

/// Whether the engine loads its matrices in the wide layout ([`WeightType::to_wide`]): yes,
/// unless `TINE_GPU_WIDE=0` (GGUF blocks as the file has them, for timing one against the other).
pub(crate) fn wide_layout() -> bool {
    std::env::var("TINE_GPU_WIDE").map_or(true, |v| v != "0")
}

/// Reads tensors of one GGUF onto the device.
pub(crate) struct Reader<'a> {
    pub(crate) content: &'a gguf_file::Content,
    pub(crate) file: &'a mut File,
    pub(crate) path: &'a str,
    pub(crate) stream: &'a Arc<CudaStream>,
    /// Upload matrices in the wide layout ([`wide_layout`]).
    pub(crate) wide: bool,
}

impl Reader<'_> {
    pub(crate) fn tensor(&mut self, name: &str) -> Result<candle_core::quantized::QTensor> {
        self.content.tensor(self.file, name, &candle_core::Device::Cpu).map_err(|source| Gemma3GpuError::Read { path: format!("{} ({name})", self.path), source })
    }

    /// A quantized matrix of `rows` rows of `k` values, its GGUF blocks uploaded in the wide
    /// layout ([`WeightType::to_wide`]) that the engine's GEMVs read (as they are without
    /// `wide`).
    ///
    /// A float matrix (F16, BF16, F32: llama-quantize keeps Gemma 4's `per_layer_model_proj` in
    /// F16 in a Q4_K_M file) is quantized to Q8_0 here, GGML's reference rounding: the engine's
    /// GEMVs read quantized blocks.
    pub(crate) fn weight(&mut self, name: &str, rows: usize, k: usize) -> Result<(CudaSlice<u8>, WeightType)> {
        let t = self.tensor(name)?;
        if matches!(t.dtype(), GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::F32) && t.shape().dims() == [rows, k] && k.is_multiple_of(QK) {
            let values = t.dequantize(&candle_core::Device::Cpu).and_then(|v| v.flatten_all()?.to_vec1::<f32>()).map_err(|source| Gemma3GpuError::Read { path: self.path.to_string(), source })?;
            let wt = WeightType::Q8_0;
            return Ok((self.upload(&wt.quantize(&values), wt, k)?, wt));
        }
        let wt = WeightType::from_ggml(t.dtype()).ok_or_else(|| Gemma3GpuError::Unsupported { name: name.to_string(), dtype: t.dtype() })?;
        if t.shape().dims() != [rows, k] || !k.is_multiple_of(wt.block_values()) {
            return Err(Gemma3GpuError::Model { path: self.path.to_string(), what: format!("{name} has shape {:?} of {wt:?}, expected [{rows}, {k}]", t.shape().dims()) });
        }
        let data = t.data().map_err(|source| Gemma3GpuError::Read { path: self.path.to_string(), source })?;
        Ok((self.upload(&data, wt, k)?, wt))
    }

    /// Rows of GGUF blocks onto the device in the reader's layout.
    pub(crate) fn upload(&self, data: &[u8], wt: WeightType, k: usize) -> Result<CudaSlice<u8>> {
        Ok(if self.wide { self.stream.clone_htod(&wt.to_wide(data, k))? } else { self.stream.clone_htod(data)? })
    }

    /// A matrix of `rows` rows of `k` values that an LM head or an embedding gather reads
    /// ([`Reader::weight`], kept with its layout).
    pub(crate) fn matrix(&mut self, name: &str, rows: usize, k: usize) -> Result<Matrix> {
        let (buf, wt) = self.weight(name, rows, k)?;
        Ok(Matrix { buf, wt, wide: self.wide })
    }

    /// A vector of `n` values (a norm's weights), as f32.
    pub(crate) fn norm(&mut self, name: &str, n: usize) -> Result<CudaSlice<f32>> {
        let t = self.tensor(name)?;
        let v = t.dequantize(&candle_core::Device::Cpu).and_then(|t| t.flatten_all()?.to_vec1::<f32>()).map_err(|source| Gemma3GpuError::Read { path: self.path.to_string(), source })?;
        if v.len() != n {
            return Err(Gemma3GpuError::Model { path: self.path.to_string(), what: format!("{name} has {} values, expected {n}", v.len()) });
        }
        Ok(self.stream.clone_htod(&v)?)
    }
}

impl Reader<'_> {
    pub(crate) fn model_err(&self, what: String) -> Gemma3GpuError {
        Gemma3GpuError::Model { path: self.path.to_string(), what }
    }

    /// Block `l`'s attention and MLP weights.
    fn layer(&mut self, cfg: &Gemma3Config, l: usize) -> Result<Layer> {
        let (qd, kvd) = (cfg.n_head * cfg.head_dim, cfg.n_kv * cfg.head_dim);
        let p = format!("blk.{l}");
        let layer = Layer {
            attn_norm: self.norm(&format!("{p}.attn_norm.weight"), cfg.hidden)?,
            q: self.weight(&format!("{p}.attn_q.weight"), qd, cfg.hidden)?,
            k: self.weight(&format!("{p}.attn_k.weight"), kvd, cfg.hidden)?,
            v: self.weight(&format!("{p}.attn_v.weight"), kvd, cfg.hidden)?,
            q_norm: self.norm(&format!("{p}.attn_q_norm.weight"), cfg.head_dim)?,
            k_norm: self.norm(&format!("{p}.attn_k_norm.weight"), cfg.head_dim)?,
            o: self.weight(&format!("{p}.attn_output.weight"), cfg.hidden, qd)?,
            post_attn_norm: self.norm(&format!("{p}.post_attention_norm.weight"), cfg.hidden)?,
            ffn_norm: self.norm(&format!("{p}.ffn_norm.weight"), cfg.hidden)?,
            gate: self.weight(&format!("{p}.ffn_gate.weight"), cfg.ff, cfg.hidden)?,
            up: self.weight(&format!("{p}.ffn_up.weight"), cfg.ff, cfg.hidden)?,
            down: self.weight(&format!("{p}.ffn_down.weight"), cfg.hidden, cfg.ff)?,
            post_ffn_norm: self.norm(&format!("{p}.post_ffw_norm.weight"), cfg.hidden)?,
        };
        if layer.gate.1 != layer.up.1 {
            return Err(self.model_err(format!("{p}: ffn_gate and ffn_up differ in type; the fused GLU reads one")));
        }
        Ok(layer)
    }

    /// The NextN head in block `cfg.layers` (candle's patch 0011 reads the same layout): its
    /// block, `eh_proj`, the three norms, and its output projection: `shared_head_head`, else
    /// the trunk's tied embedding rows at `gemma3.nextn.draft_vocab` when the head scores a
    /// subset of the vocabulary, else the trunk's own.
    fn nextn(&mut self, cfg: &Gemma3Config, md: &std::collections::HashMap<String, gguf_file::Value>) -> Result<NextNHead> {
        let l = cfg.layers;
        let name = |s: &str| format!("blk.{l}.nextn.{s}");
        let key = "gemma3.nextn.draft_vocab";
        let draft_vocab = match md.get(key) {
            None => None,
            Some(v) => Some(draft_ids(v, key, cfg.vocab).map_err(|what| self.model_err(what))?),
        };
        let rows = draft_vocab.as_ref().map_or(cfg.vocab, Vec::len);
        let head = if self.content.tensor_infos.contains_key(&name("shared_head_head.weight")) {
            Some(self.matrix(&name("shared_head_head.weight"), rows, cfg.hidden)?)
        } else if let Some(ids) = &draft_vocab {
            Some(self.rows_of("token_embd.weight", ids, cfg.vocab, cfg.hidden)?)
        } else {
            None
        };
        let embed = if self.content.tensor_infos.contains_key(&name("embed_tokens.weight")) { Some(self.matrix(&name("embed_tokens.weight"), cfg.vocab, cfg.hidden)?) } else { None };
        Ok(NextNHead {
            eh_proj: self.weight(&name("eh_proj.weight"), cfg.hidden, 2 * cfg.hidden)?,
            enorm: self.norm(&name("enorm.weight"), cfg.hidden)?,
            hnorm: self.norm(&name("hnorm.weight"), cfg.hidden)?,
            shared_head_norm: self.norm(&name("shared_head_norm.weight"), cfg.hidden)?,
            head,
            rows,
            embed,
            draft_vocab,
            block: self.layer(cfg, l)?,
            local: cfg.is_local(l),
            logits: alloc(self.stream, rows)?,
        })
    }

    /// Rows `ids` of the `(rows, k)` quantized matrix `name`, still quantized.
    fn rows_of(&mut self, name: &str, ids: &[u32], rows: usize, k: usize) -> Result<Matrix> {
        let t = self.tensor(name)?;
        let wt = WeightType::from_ggml(t.dtype()).ok_or_else(|| Gemma3GpuError::Unsupported { name: name.to_string(), dtype: t.dtype() })?;
        if t.shape().dims() != [rows, k] || !k.is_multiple_of(wt.block_values()) {
            return Err(self.model_err(format!("{name} has shape {:?} of {wt:?}, expected [{rows}, {k}]", t.shape().dims())));
        }
        let data = t.data().map_err(|source| Gemma3GpuError::Read { path: self.path.to_string(), source })?;
        let rb = wt.row_bytes(k);
        let mut out = Vec::with_capacity(ids.len() * rb);
        for &id in ids {
            out.extend_from_slice(&data[id as usize * rb..][..rb]);
        }
        Ok(Matrix { buf: self.upload(&out, wt, k)?, wt, wide: self.wide })
    }
}

/// The `general.architecture` of the GGUF at `path` (the engine to load it on).
pub fn architecture(path: &Path) -> Result<String> {
    let read_err = |source| Gemma3GpuError::Read { path: path.display().to_string(), source };
    let mut file = File::open(path).map_err(|e| read_err(candle_core::Error::from(e)))?;
    let content = gguf_file::Content::read(&mut file).map_err(read_err)?;
    Ok(content.metadata.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default())
}

/// Distinct token ids below `vocab` from a GGUF array (a NextN head's draft vocabulary).
fn draft_ids(v: &gguf_file::Value, key: &str, vocab: usize) -> std::result::Result<Vec<u32>, String> {
    let items = v.to_vec().map_err(|e| format!("{key}: {e}"))?;
    let ids = items.iter().map(|x| x.to_u32().or_else(|_| x.to_i32().map(|i| i as u32))).collect::<std::result::Result<Vec<u32>, _>>().map_err(|e| format!("{key}: {e}"))?;
    let mut seen = std::collections::HashSet::new();
    if ids.is_empty() || !ids.iter().all(|id| seen.insert(*id)) {
        return Err(format!("{key} must list distinct token ids ({} given, {} distinct)", ids.len(), seen.len()));
    }
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(format!("{key}: token {bad} is past the vocabulary of {vocab}"));
    }
    Ok(ids)
}

pub(crate) fn alloc<T: DeviceRepr + ValidAsZeroBits>(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>> {
    Ok(stream.alloc_zeros::<T>(n.max(1))?)
}

/// RoPE's inverse frequencies as candle's quantized_gemma3 computes them (f32 `powf`), so the
/// angles match the CPU path's.
pub(crate) fn inv_freq(hd: usize, base: f32) -> Vec<f32> {
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
        let embd_info = content.tensor_infos.get("token_embd.weight").ok_or_else(|| model_err("no token_embd.weight".into()))?;
        let cfg = Gemma3Config::from_metadata(&content.metadata, embd_info.shape.dims()[0]).map_err(model_err)?;
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
        let wide = wide_layout();
        let mut r = Reader { content: &content, file: &mut file, path: &shown, stream: &stream, wide };
        let embd = r.matrix("token_embd.weight", cfg.vocab, cfg.hidden)?;
        let output = if content.tensor_infos.contains_key("output.weight") { Some(r.matrix("output.weight", cfg.vocab, cfg.hidden)?) } else { None };
        let output_norm = r.norm("output_norm.weight", cfg.hidden)?;
        let (qd, kvd) = (cfg.n_head * cfg.head_dim, cfg.n_kv * cfg.head_dim);
        let mut layers = Vec::new();
        for l in 0..cfg.layers {
            layers.push(r.layer(&cfg, l)?);
        }
        let nextn = if cfg.nextn { Some(r.nextn(&cfg, &content.metadata)?) } else { None };
        // A NextN head's eh_proj reads rows of twice the hidden width.
        let kmax = cfg.ff.max(qd).max(2 * cfg.hidden);
        // Local layers' chunks_max counts one more than their window's span.
        let chunks_max = Kernels::attn_chunks_max(ctx_len, 0).max(Kernels::attn_chunks_max(ctx_len, cfg.window));
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
            qs: alloc(&stream, m * kmax)?,
            qd: alloc(&stream, m * kmax / QK)?,
            qsum: alloc(&stream, m * kmax / QK)?,
            partials: alloc(&stream, MAX_ROWS * cfg.n_head * chunks_max * (cfg.head_dim + 2))?,
            attn_counters: alloc(&stream, MAX_ROWS * cfg.n_head)?,
            stage: alloc(&stream, m * 2 * kvd)?,
            out: Readout::new(&stream, cfg.vocab)?,
        };
        // A NextN step's rows, or an assistant step's one row.
        let hin = alloc(&stream, if nextn.is_some() { m * cfg.hidden } else { cfg.hidden })?;
        let step = std::sync::Mutex::new(StepBlock { params: alloc(&stream, 1)?, tokens: alloc(&stream, m)?, hin });
        let inv_local = stream.clone_htod(&inv_freq(cfg.head_dim, cfg.rope_local))?;
        let inv_global = stream.clone_htod(&inv_freq(cfg.head_dim, cfg.rope_global))?;
        stream.synchronize()?;
        Ok(Gemma3Gpu { cfg, max_ctx: ctx_len, prompt_rows, stream, step, kernels, embd, output, output_norm, inv_local, inv_global, layers, nextn, b, wide, _ctx: ctx })
    }

    pub fn config(&self) -> &Gemma3Config {
        &self.cfg
    }

    /// The GPU's free and total memory in bytes (the driver's `cuMemGetInfo`).
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok(self._ctx.mem_get_info()?)
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

    /// An empty f32 KV cache of `ctx_len` positions (at most [`Gemma3Gpu::max_ctx`]).
    pub fn new_cache(&self, ctx_len: usize) -> Result<GpuCache> {
        self.new_cache_typed(ctx_len, KvTypes::F32)
    }

    /// An empty KV cache of `ctx_len` positions (at most [`Gemma3Gpu::max_ctx`]) storing keys
    /// and values as `types`.
    pub fn new_cache_typed(&self, ctx_len: usize, types: KvTypes) -> Result<GpuCache> {
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let kv = (0..self.cfg.layers).map(|_| KvLayer::new(&self.stream, types, self.cfg.n_kv, ctx_len, self.cfg.head_dim)).collect::<std::result::Result<_, _>>()?;
        Ok(GpuCache { kv, ctx_len, pos: 0, last: LastStep::default(), graphs: (0..2 * MAX_ROWS).map(|_| None).collect() })
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> DevPtr {
        s.device_ptr(&self.stream).0
    }

    /// `norm_quant`'s arguments over the step's buffers: the residual stream is `b.h` (written
    /// back in mode 1 and 2), the output the Q8 activation planes.
    #[allow(clippy::too_many_arguments)]
    fn nq(&self, step: DevPtr, prompt: Option<DevPtr>, a: DevPtr, w_a: DevPtr, mode: i32, k: usize, w: DevPtr) -> NormQuantArgs {
        let b = &self.b;
        NormQuantArgs {
            a,
            res: self.ptr(&b.h),
            w_a,
            embd: self.ptr(&self.embd.buf),
            embd_scale: (self.cfg.hidden as f64).sqrt() as f32,
            step,
            w,
            eps: self.cfg.eps,
            res_out: if mode == 0 { 0 } else { self.ptr(&b.h) },
            y_out: 0,
            qs: self.ptr(&b.qs),
            qd: self.ptr(&b.qd),
            qsum: self.ptr(&b.qsum),
            k: k as i32,
            in_mode: mode,
            norm: (w != 0) as i32,
            tokens: prompt.unwrap_or(0),
            q_stride: 0,
            q_off: 0,
            res_scale: 0.0,
            embd_type: self.embd.embd_type(),
            b_stride: 0,
        }
    }

    /// The GEMV segment of a head's matrix `m` into `out` (rows of `n`).
    pub(crate) fn mseg(&self, m: &Matrix, out: &CudaSlice<f32>, n: usize) -> GemvSeg {
        GemvSeg { w: self.ptr(&m.buf), out: self.ptr(out), n: n as i32, wtype: m.wt.ggml_id(), out_stride: n as i32, wide: m.wide as i32, ..Default::default() }
    }

    /// One GEMV segment: `w` times the activation rows into `out` (rows of `n`).
    fn seg(&self, w: &(CudaSlice<u8>, WeightType), out: &CudaSlice<f32>, n: usize) -> GemvSeg {
        GemvSeg { w: self.ptr(&w.0), out: self.ptr(out), n: n as i32, wtype: w.1.ggml_id(), out_stride: n as i32, wide: self.wide as i32, ..Default::default() }
    }

    /// The activation planes (`qs`, `qd`, `qsum`) from row `row` on, for rows of `k` values.
    fn act(&self, row: usize, k: usize) -> (DevPtr, DevPtr, DevPtr) {
        let (r, kb) = (row as u64, (k / QK) as u64);
        (self.ptr(&self.b.qs) + r * k as u64, self.ptr(&self.b.qd) + r * kb * 4, self.ptr(&self.b.qsum) + r * kb * 4)
    }

    /// A block's launches after its first `norm_quant` (which leaves `attn_norm(h)` as Q8
    /// activations, `h` the residual stream in `b.h`): Q/K/V, q/k norms with RoPE and the K/V
    /// write into `kv` (the block's cache of `ctx_len` positions), the attention, the output
    /// projection, `h + post_attention_norm(o)` with `ffn_norm`, the GLU and `down` into `b.down`
    /// (the caller adds `post_ffw_norm(down)` to `h` in the next `norm_quant`). 8 launches.
    ///
    /// # Safety
    /// As [`Gemma3Gpu::launch_step`]: the buffers hold the step's rows, the caches `ctx_len`
    /// positions past the step's.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_block(&self, ly: &Layer, local: bool, kv: KvPtrs, ctx_len: usize, step: DevPtr, rows: usize, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<(), GpuError> {
        let c = &self.cfg;
        let b = &self.b;
        let act = self.act(0, 0);
        let (qd, kvd) = (c.n_head * c.head_dim, c.n_kv * c.head_dim);
        let (s, k) = (&self.stream, &self.kernels);
        k.gemv(s, rows, c.hidden, &[self.seg(&ly.q, &b.q, qd), self.seg(&ly.k, &b.k, kvd), self.seg(&ly.v, &b.v, kvd)], act)?;
        mark("gemv qkv")?;
        k.qk_norm_rope_kv(s, rows, &self.rope_args(ly, local, kv, ctx_len, step))?;
        mark("qk_norm_rope_kv")?;
        let at = self.attn_args(kv, ctx_len, local, c.n_head, step);
        match prompt {
            Some(_) => k.attention_prompt(s, rows, c.head_dim, &at)?,
            None => k.attention(s, rows, c.head_dim, &at)?,
        }
        mark(if local { "attention local" } else { "attention global" })?;
        let tail = BlockTail { o: &ly.o, post_attn_norm: &ly.post_attn_norm, ffn_norm: &ly.ffn_norm, gate: &ly.gate, up: &ly.up, down: &ly.down };
        self.launch_block_tail(&tail, c.hidden, qd, c.ff, step, rows, prompt, mark)
    }

    /// `qk_norm_rope_kv`'s arguments for block `ly` (a local layer's RoPE base when `local`) over
    /// its cache `kv` of `ctx_len` positions.
    fn rope_args(&self, ly: &Layer, local: bool, kv: KvPtrs, ctx_len: usize, step: DevPtr) -> RopeArgs {
        let (c, b) = (&self.cfg, &self.b);
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        RopeArgs {
            q: p(&b.q),
            k: p(&b.k),
            v: p(&b.v),
            q_norm: p(&ly.q_norm),
            k_norm: p(&ly.k_norm),
            eps: c.eps,
            inv_freq: if local { p(&self.inv_local) } else { p(&self.inv_global) },
            q_scale: 1.0 / (c.head_dim as f32).sqrt(),
            k_cache: kv.k,
            v_cache: kv.v,
            ctx: ctx_len as i32,
            step,
            n_head: c.n_head as i32,
            n_kv: c.n_kv as i32,
            hd: c.head_dim as i32,
            n_rot: 0,
            v_norm: 0,
            v_from_k: 0,
            k_type: kv.types.k.kernel_id(),
            v_type: kv.types.v.kernel_id(),
            kv_slots: 0,
            stage: p(&b.stage),
            turbo: self.kernels.turbo_tab(&self.stream),
        }
    }

    /// The gate·up GEMV segment with the GELU(tanh)·up epilogue into `b.ff` (rows of `ff`).
    fn glu_seg(&self, gate: &(CudaSlice<u8>, WeightType), up: &(CudaSlice<u8>, WeightType), ff: usize) -> GemvSeg {
        GemvSeg { w: self.ptr(&gate.0), w2: self.ptr(&up.0), out: self.ptr(&self.b.ff), n: ff as i32, wtype: gate.1.ggml_id(), out_stride: ff as i32, glu: 1, block_start: 0, wide: self.wide as i32 }
    }

    /// The decode attention's arguments for `n_head` query heads over a layer's cache `kv` of
    /// `ctx_len` positions (its output written as the activation planes' Q8 rows).
    fn attn_args(&self, kv: KvPtrs, ctx_len: usize, local: bool, n_head: usize, step: DevPtr) -> AttnArgs {
        let (b, act) = (&self.b, self.act(0, 0));
        let window = if local { self.cfg.window } else { 0 };
        AttnArgs {
            q: self.ptr(&b.q),
            k_cache: kv.k,
            v_cache: kv.v,
            out: 0,
            partials: self.ptr(&b.partials),
            counters: self.ptr(&b.attn_counters),
            step,
            qs: act.0,
            qd: act.1,
            qsum: act.2,
            ctx: ctx_len as i32,
            window: window as i32,
            n_head: n_head as i32,
            n_kv: self.cfg.n_kv as i32,
            chunks_max: Kernels::attn_chunks_max(ctx_len, window) as i32,
            gate: 0,
            k_type: kv.types.k.kernel_id(),
            v_type: kv.types.v.kernel_id(),
            kv_slots: 0,
            turbo: self.kernels.turbo_tab(&self.stream),
        }
    }

    /// A block's launches after its attention (whose Q8 output is in the activation planes):
    /// the output projection (`qd` values a row), `h + post_attention_norm(o)` with `ffn_norm`,
    /// the GLU (`ff` wide) and `down` into `b.down`, for rows of `width` values. 6 launches.
    ///
    /// # Safety
    /// As [`Gemma3Gpu::launch_block`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_block_tail(&self, w: &BlockTail, width: usize, qd: usize, ff: usize, step: DevPtr, rows: usize, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<(), GpuError> {
        let b = &self.b;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let (s, k, act) = (&self.stream, &self.kernels, self.act(0, 0));
        k.gemv(s, rows, qd, &[self.seg(w.o, &b.o, width)], act)?;
        mark("gemv o")?;
        k.norm_quant(s, rows, &self.nq(step, prompt, p(&b.o), p(w.post_attn_norm), 1, width, p(w.ffn_norm)))?;
        mark("norm_quant")?;
        k.gemv(s, rows, width, &[self.glu_seg(w.gate, w.up, ff)], act)?;
        mark("gemv gate·up")?;
        k.norm_quant(s, rows, &self.nq(step, prompt, p(&b.ff), 0, 0, ff, 0))?;
        mark("norm_quant")?;
        k.gemv(s, rows, ff, &[self.seg(w.down, &b.down, width)], act)?;
        mark("gemv down")?;
        Ok(())
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
        let (s, k) = (&self.stream, &self.kernels);
        let mut count = 0;
        // SAFETY: every buffer was allocated at load for prompt_rows rows of its width (the
        // logits and argmax scratch for MAX_ROWS; `step` keeps rows <= MAX_ROWS unless `prompt`,
        // whose head runs on one row), the caches for ctx_len positions, and `step` checks that
        // the step's positions are below ctx_len before it launches.
        unsafe {
            for (l, ly) in self.layers.iter().enumerate() {
                let first = if l == 0 {
                    self.nq(step, prompt, 0, 0, 2, c.hidden, p(&ly.attn_norm))
                } else {
                    self.nq(step, prompt, p(&b.down), p(&self.layers[l - 1].post_ffn_norm), 1, c.hidden, p(&ly.attn_norm))
                };
                k.norm_quant(s, rows, &first)?;
                mark("norm_quant")?;
                self.launch_block(ly, c.is_local(l), cache.kv[l].ptrs(s), cache.ctx_len, step, rows, prompt, mark)?;
                count += 9;
            }
            let last = self.layers.last().expect("a model has layers");
            k.norm_quant(s, rows, &self.nq(step, prompt, p(&b.down), p(&last.post_ffn_norm), 1, c.hidden, p(&self.output_norm)))?;
            mark("norm_quant")?;
            count += 1;
            if !head {
                return Ok(count);
            }
            let head = self.output.as_ref().unwrap_or(&self.embd);
            // A prompt step: the last row's Q8 activations alone.
            let (head_rows, act) = match prompt {
                None => (rows, self.act(0, c.hidden)),
                Some(_) => (1, self.act(rows - 1, c.hidden)),
            };
            k.gemv(s, head_rows, c.hidden, &[self.mseg(head, &b.out.logits, c.vocab)], act)?;
            mark("lm head")?;
            k.argmax(s, head_rows, &b.out.argmax_args(s, step))?;
            mark("argmax")?;
            count += 2;
        }
        Ok(count)
    }

    /// The launches of a NextN step of `rows` entries over `cache` (what its graph captures):
    /// the entries' input hidden states are at `hin`, their next tokens in the step block (or,
    /// with `prompt`, at that address). `[enorm(E·√n); hnorm(H)]` as the two halves of each
    /// row's Q8 activations, `eh_proj`, the head's block over its own cache, `h +
    /// post_ffw_norm(down)` (the output hidden states, left in `b.h`) with `shared_head_norm`,
    /// and the output projection of the last row into the head's logits. 14 launches.
    #[allow(clippy::too_many_arguments)]
    fn launch_nextn(&self, head: &NextNHead, cache: &NextNCache, step: DevPtr, hin: DevPtr, rows: usize, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<usize, GpuError> {
        let c = &self.cfg;
        let b = &self.b;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let (s, k) = (&self.stream, &self.kernels);
        let h = c.hidden;
        let embd = head.embed.as_ref().unwrap_or(&self.embd);
        // SAFETY: as launch_step's: the buffers hold prompt_rows rows (the activation planes of
        // 2 * hidden values a row, kmax at load), the head's cache ctx_len positions past the
        // step's (checked by nextn_forward), its logits buffer `head.rows` values.
        unsafe {
            let e = NormQuantArgs { embd: self.ptr(&embd.buf), embd_type: embd.embd_type(), res_out: 0, q_stride: (2 * h) as i32, q_off: 0, ..self.nq(step, prompt, 0, 0, 2, h, p(&head.enorm)) };
            k.norm_quant(s, rows, &e)?;
            mark("norm_quant enorm")?;
            let hh = NormQuantArgs { q_stride: (2 * h) as i32, q_off: h as i32, ..self.nq(step, prompt, hin, 0, 0, h, p(&head.hnorm)) };
            k.norm_quant(s, rows, &hh)?;
            mark("norm_quant hnorm")?;
            k.gemv(s, rows, 2 * h, &[self.seg(&head.eh_proj, &b.o, h)], self.act(0, 0))?;
            mark("gemv eh_proj")?;
            let x = NormQuantArgs { res_out: p(&b.h), ..self.nq(step, prompt, p(&b.o), 0, 0, h, p(&head.block.attn_norm)) };
            k.norm_quant(s, rows, &x)?;
            mark("norm_quant")?;
            self.launch_block(&head.block, head.local, cache.kv.ptrs(s), cache.ctx_len, step, rows, prompt, mark)?;
            k.norm_quant(s, rows, &self.nq(step, prompt, p(&b.down), p(&head.block.post_ffn_norm), 1, h, p(&head.shared_head_norm)))?;
            mark("norm_quant")?;
            let out = head.head.as_ref().or(self.output.as_ref()).unwrap_or(&self.embd);
            k.gemv(s, 1, h, &[self.mseg(out, &head.logits, head.rows)], self.act(rows - 1, h))?;
            mark("nextn head")?;
        }
        Ok(14)
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

    /// Whether the model carries a NextN head (`gemma3.nextn_predict_layers = 1`).
    pub fn has_nextn(&self) -> bool {
        self.nextn.is_some()
    }

    /// The token of each NextN logit, when the head scores a subset of the vocabulary
    /// (`gemma3.nextn.draft_vocab`).
    pub fn nextn_draft_vocab(&self) -> Option<&[u32]> {
        self.nextn.as_ref().and_then(|h| h.draft_vocab.as_deref())
    }

    /// An empty NextN cache of `ctx_len` entries (at most [`Gemma3Gpu::max_ctx`]), if the model
    /// has a NextN head.
    pub fn new_nextn_cache(&self, ctx_len: usize) -> Result<Option<NextNCache>> {
        self.new_nextn_cache_typed(ctx_len, KvTypes::F32)
    }

    /// [`Gemma3Gpu::new_nextn_cache`] storing the head's keys and values as `types`.
    pub fn new_nextn_cache_typed(&self, ctx_len: usize, types: KvTypes) -> Result<Option<NextNCache>> {
        if self.nextn.is_none() {
            return Ok(None);
        }
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let kv = KvLayer::new(&self.stream, types, self.cfg.n_kv, ctx_len, self.cfg.head_dim)?;
        Ok(Some(NextNCache { kv, ctx_len, pos: 0, graphs: (0..MAX_ROWS).map(|_| None).collect() }))
    }

    /// Runs the NextN head over entries `cache.len()..` (1..=[`Gemma3Gpu::prompt_rows`] of
    /// them): `hidden` holds their input hidden states (`rows × hidden`: the trunk's, before the
    /// output norm, or the head's own when chaining) and `tokens` the token after each. Returns
    /// the last entry's logits (over [`Gemma3Gpu::nextn_draft_vocab`] when the head has one) and
    /// every entry's output hidden state (`rows × hidden`, before `shared_head_norm`). Steps of up
    /// to [`MAX_ROWS`] entries replay a graph captured per row count; longer ones launch
    /// directly with the prompt kernels.
    pub fn nextn_forward(&self, cache: &mut NextNCache, hidden: &[f32], tokens: &[u32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let rows = tokens.len();
        let fail = |what: String| Gemma3GpuError::Step { rows, pos: cache.pos, what };
        let Some(head) = self.nextn.as_ref() else { return Err(fail("this model has no NextN head".into())) };
        let params = nextn_params(cache.pos, cache.ctx_len, self.prompt_rows, self.cfg.hidden, self.cfg.vocab, hidden, tokens, 0).map_err(fail)?;
        let mut block = self.step.lock().expect("a step panicked holding the step block");
        // Ordered on the stream after the previous step, which may still read the block and hin.
        self.stream.memcpy_htod(&[params][..], &mut block.params)?;
        // hin holds prompt_rows rows (allocated with the head); rows <= prompt_rows (checked above).
        self.stream.memcpy_htod(hidden, &mut block.hin.slice_mut(..hidden.len()))?;
        let (step, hin) = (self.ptr(&block.params), self.ptr(&block.hin));
        if rows <= MAX_ROWS {
            let mut slot = cache.graphs[rows - 1].take();
            let replayed = Graph::replay(&self.stream, &mut slot, || self.launch_nextn(head, cache, step, hin, rows, None, &mut |_| Ok(())).map(|_| ()), || fail("the capture made no graph".into()));
            cache.graphs[rows - 1] = slot;
            replayed?;
        } else {
            let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
            self.stream.memcpy_htod(&ids[..], &mut block.tokens.slice_mut(..rows))?;
            let prompt = self.ptr(&block.tokens);
            self.launch_nextn(head, cache, step, hin, rows, Some(prompt), &mut |_| Ok(()))?;
        }
        drop(block);
        cache.pos += rows;
        let mut logits = vec![0f32; head.rows];
        self.stream.memcpy_dtoh(&head.logits, &mut logits[..])?;
        let mut out = vec![0f32; hidden.len()];
        self.stream.memcpy_dtoh(&self.b.h.slice(..hidden.len()), &mut out[..])?;
        self.stream.synchronize()?;
        Ok((logits, out))
    }

    /// Kernel launches (graph nodes) of a NextN step of `rows` entries.
    pub fn nextn_graph_nodes(&self, cache: &mut NextNCache, rows: usize) -> Result<usize> {
        let pos = cache.pos;
        let hidden = vec![0f32; rows * self.cfg.hidden];
        self.nextn_forward(cache, &hidden, &vec![0; rows])?;
        cache.truncate(pos);
        let g = &cache.graphs[rows - 1].as_ref().expect("captured by the step").0;
        let mut n = 0usize;
        // SAFETY: counting the nodes of a live graph (a null array asks for the count only).
        unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) }.result()?;
        Ok(n)
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
        Ok(time_marks(&marks)?)
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
        cache.last = LastStep::after(rows, head);
        Ok(())
    }

    /// Runs `tokens` as [`Gemma3Gpu::forward_banning`] does and returns the `k` best `(id, logit)`
    /// of the last row's logits (1 <= k <= [`crate::cuda::TOPK_MAX`]; the sampler's order: logit by total
    /// order, ties to the lower id; `banned` left out), best first: what a sampled step with
    /// top-k reads, instead of the vocabulary-wide row.
    pub fn forward_top_k(&self, cache: &mut GpuCache, tokens: &[u32], banned: &[u32], k: usize) -> Result<Vec<(u32, f32)>> {
        self.b.out.check_top_k(tokens.len(), cache.pos, k)?;
        self.step(cache, tokens, banned, true, &mut |_| Ok(()))?;
        Ok(self.top_k_rows(cache.last.last_row(), 1, k)?.pop().expect("one row asked for"))
    }

    /// Runs `tokens` (at most [`MAX_ROWS`]) as [`Gemma3Gpu::forward_banning`] does and returns the
    /// `k` best `(id, logit)` of every row, in [`Gemma3Gpu::forward_top_k`]'s order: a sampled
    /// verify step, which reads `rows × k` pairs instead of `rows × vocab` logits.
    pub fn forward_top_k_all(&self, cache: &mut GpuCache, tokens: &[u32], banned: &[u32], k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        self.b.out.check_top_k(tokens.len(), cache.pos, k)?;
        if tokens.len() > MAX_ROWS {
            return Err(Gemma3GpuError::Step { rows: tokens.len(), pos: cache.pos, what: format!("every row's top {k} of a step of more than {MAX_ROWS} rows") });
        }
        self.step(cache, tokens, banned, true, &mut |_| Ok(()))?;
        self.top_k_rows(0, tokens.len(), k)
    }

    /// The `k` best of the last step's logits rows `first..first + rows` (rows of the logits
    /// buffer; at most [`MAX_ROWS`]), one list per row, best first.
    fn top_k_rows(&self, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        // The step block holds this step's banned ids.
        let block = self.step.lock().expect("a step panicked holding the step block");
        self.b.out.top_k(&self.kernels, &self.stream, self.ptr(&block.params), first, rows, k)
    }

    /// The greedy ids of `cache`'s last step (lowest id among equal maxima): every row's, or
    /// after a prompt step of more than [`MAX_ROWS`] rows the last row's alone.
    pub fn argmax(&self, cache: &GpuCache) -> Result<Vec<u32>> {
        self.b.out.ids(&self.stream, &cache.last, cache.pos)
    }

    /// The logits of `cache`'s last step, `rows × vocab` (after a prompt step of more than
    /// [`MAX_ROWS`] rows, the last row's alone).
    pub fn logits(&self, cache: &GpuCache) -> Result<Vec<f32>> {
        self.b.out.rows(&self.stream, &cache.last, cache.pos)
    }

    /// The logits of row `row` of `cache`'s last step (`vocab` values; a prompt's last row).
    pub fn logits_row(&self, cache: &GpuCache, row: usize) -> Result<Vec<f32>> {
        self.b.out.row(&self.stream, &cache.last, cache.pos, row)
    }

    /// The final hidden states (the residual stream before the output norm, what candle's
    /// `forward_all` returns as `hidden`) of `cache`'s last step, `rows × hidden`.
    pub fn hidden(&self, cache: &GpuCache) -> Result<Vec<f32>> {
        let n = cache.last.rows * self.cfg.hidden;
        let mut v = vec![0f32; n];
        self.stream.memcpy_dtoh(&self.b.h.slice(..n), &mut v[..])?;
        Ok(v)
    }

    /// Every layer's K and V for `cache`'s positions, `(n_kv, len, head_dim)` f32 each, in
    /// order (candle's cache layout, so a slot file moves between the engine and candle's path):
    /// the values the attention reads (a typed cache's rows decoded).
    pub fn read_kv(&self, cache: &GpuCache) -> Result<Vec<LayerKv>> {
        let (t, hd) = (cache.types(), self.cfg.head_dim);
        let values = |b: Vec<u8>, s: crate::kv::KvStore| {
            let mut out = vec![0f32; b.len() / s.row_bytes(hd) * hd];
            for (row, o) in b.chunks_exact(s.row_bytes(hd)).zip(out.chunks_exact_mut(hd)) {
                s.decode_row(row, o);
            }
            out
        };
        Ok(self.read_kv_stored(cache)?.into_iter().map(|(k, v)| (values(k, t.k), values(v, t.v))).collect())
    }

    /// Every layer's K and V rows for `cache`'s positions as stored (`(n_kv, len, row)` bytes
    /// each, [`crate::kv`]'s rows: candle's `KvType::stored_bytes` of the same type).
    pub fn read_kv_stored(&self, cache: &GpuCache) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        Ok(cache.kv.iter().map(|l| l.read(&self.stream, cache.pos)).collect::<std::result::Result<_, _>>()?)
    }

    /// Sets `cache` to `len` positions whose K and V are `layers` ([`Gemma3Gpu::read_kv`]'s
    /// layout; an f32 cache). Checked first: on a shape error the cache is unchanged; a copy
    /// that fails part way leaves it empty.
    pub fn write_kv(&self, cache: &mut GpuCache, len: usize, layers: &[(&[f32], &[f32])]) -> Result<()> {
        let bytes = |x: &[f32]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        if !cache.types().is_f32() {
            return Err(Gemma3GpuError::Step { rows: 0, pos: cache.pos, what: format!("f32 K/V into a {}/{} cache", cache.types().k, cache.types().v) });
        }
        let stored: Vec<(Vec<u8>, Vec<u8>)> = layers.iter().map(|(k, v)| (bytes(k), bytes(v))).collect();
        let refs: Vec<(&[u8], &[u8])> = stored.iter().map(|(k, v)| (&k[..], &v[..])).collect();
        self.write_kv_stored(cache, len, &refs)
    }

    /// Sets `cache` to `len` positions whose stored K and V rows are `layers`
    /// ([`Gemma3Gpu::read_kv_stored`]'s layout, the cache's types). Checked first: on a shape
    /// error the cache is unchanged; a copy that fails part way leaves it empty.
    pub fn write_kv_stored(&self, cache: &mut GpuCache, len: usize, layers: &[(&[u8], &[u8])]) -> Result<()> {
        let (n_kv, hd, ctx, t) = (self.cfg.n_kv, self.cfg.head_dim, cache.ctx_len, cache.types());
        let fail = |what: String| Gemma3GpuError::Step { rows: 0, pos: cache.pos, what };
        if len > ctx {
            return Err(fail(format!("{len} positions for a cache of {ctx}")));
        }
        if layers.len() != self.cfg.layers {
            return Err(fail(format!("K/V of {} layers for a model of {}", layers.len(), self.cfg.layers)));
        }
        let (kr, vr) = (t.k.row_bytes(hd), t.v.row_bytes(hd));
        if let Some((k, v)) = layers.iter().find(|(k, v)| k.len() != n_kv * len * kr || v.len() != n_kv * len * vr) {
            return Err(fail(format!("a layer's K/V hold {} and {} bytes, expected {n_kv} x {len} rows of {kr} and {vr} bytes ({}/{})", k.len(), v.len(), t.k, t.v)));
        }
        cache.truncate(0);
        for (l, (k, v)) in cache.kv.iter_mut().zip(layers) {
            l.write(&self.stream, len, k, v)?;
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
