//! Gemma 4 (`gemma4`: the dense 31B-style and the E-series) on tine-gpu's kernels: the model read
//! from a GGUF (as llama.cpp writes it) into buffers allocated once, and a step of 1..=8 rows as a
//! fixed list of launches, captured once per row count as a CUDA graph and replayed (prompt steps
//! of more rows launch directly, as Gemma 3's do).
//!
//! The step program, per layer (`x` the residual stream), over Gemma 3's kernels with what
//! Gemma 4 adds:
//!
//! 1. `norm_quant`: `x = (x + post_norm(t)) · layer_output_scale` of the layer before (`t` its
//!    `down`, or its per-layer input's projection), then `attn_norm(x)` as Q8 (layer 0: the
//!    scaled embedding row)
//! 2. one GEMV of Q, K and V (a `k_eq_v` layer: Q and K, V being K's projection; a KV-shared
//!    layer: Q alone)
//! 3. `qk_norm_rope_kv`: q/k norms, V's weightless norm, RoPE over the layer kind's rotated dims
//!    (a global layer's frequencies divided by `rope_freqs`), attention scale 1, the K/V write
//!    (none on a KV-shared layer)
//! 4. attention over the layer's own K/V or its source layer's (heads of 256 on sliding layers,
//!    512 on global ones at the published shapes; a sliding window on sliding layers)
//! 5. the output projection, `norm_quant` (`x + post_attention_norm(o)`, `ffn_norm`), the GELU
//!    GLU, `norm_quant`, `down`; a 26B-A4B-style block then runs its routed experts on the same
//!    `xa` (10 more launches, qwen35moe's kernels): `norm_quant` of the router's input
//!    (`rmsnorm(xa) / sqrt(hidden) ⊙ ffn_gate_inp.scale`, kept as f32), `moe_logits`,
//!    `moe_router` (softmax, top-k, renormalised), `norm_quant` (`pre_ffw_norm_2(xa)`), the
//!    selected experts' GELU gate·up (`gemv_moe`), their rows as Q8, their `down`, `moe_combine`
//!    (each pick's weight times its expert's `ffn_down_exps.scale`), then two `norm_quant`s for
//!    `post_ffw_norm_1(dense) + post_ffw_norm_2(experts)`, what `post_ffw_norm` then adds
//! 6. on an E-series model, the per-layer input: `norm_quant` (`x + post_ffw_norm(down)` as Q8),
//!    `inp_gate`, `norm_quant` (`gelu(gate) · per_layer_input[l]` as Q8), `proj`
//!
//! then `norm_quant` (the last residual add, `output_norm`, the normed rows kept: the hidden
//! states), the LM head, the logit softcap and the greedy argmax. The per-layer inputs of a step's
//! rows are computed once before layer 0: `norm_quant` of the embedded rows, the
//! `per_layer_model_proj` GEMV and `ple_inputs` (its RMSNorm per layer, plus the per-layer token
//! embedding, which the engine keeps on the device and gathers in place: one row of
//! `layers × per_layer` values a token, read in the layout of every other table).
//!
//! Every kernel is batch-invariant, so a verify step of M rows gives each row the bits a one-row
//! step at its position gives. KV-shared layers read the K/V their source layer wrote earlier in
//! the same step; a sequence holds K/V for the owning layers only.
//!
//! Gemma 4's assistant drafts on the engine too, reading a sequence's K/V (the `assistant`
//! module, [`Gemma4AssistantGpu`]).

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file;
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::blocks::{WeightType, QK};
use crate::config::{Gemma4Config, Gemma4Moe};
use crate::cuda::{
    AttnArgs, DevPtr, GemvSeg, GpuError, Kernels, KvLayer, KvPtrs, KvTypes, MoeCombineArgs, MoeRouterArgs, NormQuantArgs, PleArgs, RopeArgs, SoftcapArgs, StepParams, MAX_BANNED, MAX_ROWS,
};
use crate::gemma3::{alloc, wide_layout, Gemma3GpuError as Error, Graph, Matrix, Reader, PROMPT_ROWS};
use crate::readout::{time_marks, LastStep, Readout};

mod assistant;
mod batch;
pub use assistant::Gemma4AssistantGpu;

/// The buffers [`Gemma4Gpu::trace`] reads after each launch (the step's last row of each).
pub const TRACE_PARTS: [&str; 5] = ["residual", "queries", "attention/PLE out", "MLP out", "per-layer inputs"];

type Result<T> = std::result::Result<T, Error>;

/// Called after each launch of a step with what the launch does.
type Mark<'a> = dyn FnMut(&'static str) -> std::result::Result<(), GpuError> + 'a;

type W = (CudaSlice<u8>, WeightType);

/// K and V projections of a layer that owns K/V; `v` none on a `k_eq_v` layer.
struct OwnKv {
    k: W,
    v: Option<W>,
    k_norm: CudaSlice<f32>,
}

/// An E-series layer's per-layer input.
struct PerLayerInput {
    inp_gate: W,
    proj: W,
    post_norm: CudaSlice<f32>,
}

/// A 26B-A4B-style block's routed experts, beside its dense MLP.
struct ExpertFfn {
    /// `ffn_gate_inp` as f32, `experts × hidden`.
    router: CudaSlice<f32>,
    /// `ffn_gate_inp.scale / sqrt(hidden)`: the router input's norm weights.
    router_w: CudaSlice<f32>,
    /// Every expert's gate, up and down, stacked in the wide layout.
    gate_exps: W,
    up_exps: W,
    down_exps: W,
    /// `ffn_down_exps.scale` (each expert's output scale), when the file has it.
    escale: Option<CudaSlice<f32>>,
    pre_norm: CudaSlice<f32>,
    post_norm_dense: CudaSlice<f32>,
    post_norm_experts: CudaSlice<f32>,
}

struct Layer {
    attn_norm: CudaSlice<f32>,
    q: W,
    q_norm: CudaSlice<f32>,
    kv: Option<OwnKv>,
    o: W,
    post_attn_norm: CudaSlice<f32>,
    ffn_norm: CudaSlice<f32>,
    gate: W,
    up: W,
    down: W,
    post_ffw_norm: CudaSlice<f32>,
    moe: Option<Box<ExpertFfn>>,
    ple: Option<PerLayerInput>,
    /// `layer_output_scale` (0: none).
    out_scale: f32,
}

/// The model-wide weights of the per-layer embeddings.
struct PerLayerEmbedding {
    /// `per_layer_token_embd`: `vocab` rows of `layers × per_layer` values.
    table: Matrix,
    /// `per_layer_model_proj`: `layers × per_layer` rows of `hidden`.
    model_proj: W,
    proj_norm: CudaSlice<f32>,
}

/// Activation buffers for [`PROMPT_ROWS`] rows (the logits and argmax scratch for
/// [`MAX_ROWS`]), allocated once.
struct Buffers {
    h: CudaSlice<f32>,
    /// The rows after the output norm.
    hid: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    /// The attention's output projection, then an E-series layer's per-layer projection.
    o: CudaSlice<f32>,
    ff: CudaSlice<f32>,
    down: CudaSlice<f32>,
    /// `inp_gate`'s rows.
    gate: CudaSlice<f32>,
    /// `per_layer_model_proj` of the embedded rows, and the per-layer inputs.
    ple_proj: CudaSlice<f32>,
    ple: CudaSlice<f32>,
    qs: CudaSlice<i8>,
    qd: CudaSlice<f32>,
    qsum: CudaSlice<i32>,
    partials: CudaSlice<f32>,
    attn_counters: CudaSlice<i32>,
    /// A step's K and V rows as f32 for `turbo_store` (caches of the turbo types).
    stage: CudaSlice<f32>,
    /// The routed experts (one value each without them): the router's input rows, its logits
    /// (`experts + 1` a row), each row's experts and weights, the experts' GELU rows and their
    /// `down` rows (`used` a row), their weighted sum, and `post_ffw_norm_1` of the dense MLP's.
    xn: CudaSlice<f32>,
    moe_logits: CudaSlice<f32>,
    moe_ids: CudaSlice<i32>,
    moe_wts: CudaSlice<f32>,
    /// A prompt step's pairs listed by expert (`experts × PROMPT_ROWS`) and their counts.
    moe_list: CudaSlice<i32>,
    moe_counts: CudaSlice<i32>,
    ffx: CudaSlice<f32>,
    ydn: CudaSlice<f32>,
    ymoe: CudaSlice<f32>,
    dense: CudaSlice<f32>,
    out: Readout,
}

struct StepBlock {
    params: CudaSlice<StepParams>,
    tokens: CudaSlice<i32>,
    /// An assistant step's input hidden state.
    hin: CudaSlice<f32>,
}

/// Gemma 4 on the GPU: weights and the step's buffers, shared by every sequence (steps run one at
/// a time on the model's stream). Each sequence holds a [`Gemma4Cache`].
pub struct Gemma4Gpu {
    cfg: Gemma4Config,
    max_ctx: usize,
    prompt_rows: usize,
    stream: Arc<CudaStream>,
    step: std::sync::Mutex<StepBlock>,
    kernels: Kernels,
    embd: Matrix,
    output: Option<Matrix>,
    output_norm: CudaSlice<f32>,
    /// RoPE's inverse frequencies on sliding and on global layers (the latter divided by
    /// `rope_freqs` when the file has it).
    inv_swa: CudaSlice<f32>,
    inv_global: CudaSlice<f32>,
    layers: Vec<Layer>,
    ple: Option<PerLayerEmbedding>,
    /// Per layer that owns K/V, its index among the sequence's caches.
    slot: Vec<Option<usize>>,
    b: Buffers,
    /// Floats of the attention's partials a row takes (the widest layer's).
    partials_row: usize,
    wide: bool,
    _ctx: Arc<CudaContext>,
}

/// Whose K/V a step's launches read and write: one sequence's caches, or a batched step's
/// entries' (through the batch's `kv_slots` tables).
#[derive(Clone, Copy)]
enum StepKv<'a> {
    One(&'a Gemma4Cache),
    Batch(&'a crate::batch::GpuBatch),
}

/// One sequence's state on the GPU: the K/V of each layer that owns some, and the step graphs
/// captured over them.
pub struct Gemma4Cache {
    /// Per layer that owns K/V, its K and V in the cache's stored types.
    pub(crate) kv: Vec<KvLayer>,
    ctx_len: usize,
    pos: usize,
    last: LastStep,
    graphs: Vec<Option<Graph>>,
}

/// One launch of a traced step ([`Gemma4Gpu::trace`]): what it does, and the last row of the
/// residual, the queries, the attention/PLE output, the MLP output and the per-layer inputs.
pub type TracePoint = (&'static str, [Vec<f32>; 5]);

impl Gemma4Cache {
    /// Positions the cache holds.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

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

    /// Keeps the first `len` positions (the rows past them are overwritten by later steps).
    pub fn truncate(&mut self, len: usize) {
        if len < self.pos {
            self.last = LastStep::default();
        }
        self.pos = self.pos.min(len);
    }
}

/// RoPE's inverse frequencies of `dim` rotated dims as candle's `quantized_gemma4` computes them
/// (f32 `powf`, then divided by the frequency factor), so the angles match the CPU path's.
fn inv_freq(dim: usize, base: f32, factors: Option<&[f32]>) -> Vec<f32> {
    (0..(dim / 2).max(1)).map(|i| base.powf(-2.0 * i as f32 / dim.max(2) as f32) / factors.map_or(1.0, |f| f[i])).collect()
}

impl Reader<'_> {
    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// `n` values on the host.
    fn values(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        let v = t.dequantize(&candle_core::Device::Cpu).and_then(|t| t.flatten_all()?.to_vec1::<f32>()).map_err(|source| Error::Read { path: self.path.to_string(), source })?;
        if v.len() != n {
            return Err(self.model_err(format!("{name} has {} values, expected {n}", v.len())));
        }
        Ok(v)
    }

    fn gemma4_layer(&mut self, cfg: &Gemma4Config, l: usize) -> Result<Layer> {
        let p = |s: &str| format!("blk.{l}.{s}");
        let lc = &cfg.layers[l];
        let (h, hd) = (cfg.hidden, lc.head_dim);
        let (qd, kvd) = (lc.n_head * hd, lc.n_kv * hd);
        let kv = if l < cfg.kv_layers {
            let v = if self.has(&p("attn_v.weight")) { Some(self.weight(&p("attn_v.weight"), kvd, h)?) } else { None };
            Some(OwnKv { k: self.weight(&p("attn_k.weight"), kvd, h)?, v, k_norm: self.norm(&p("attn_k_norm.weight"), hd)? })
        } else {
            None
        };
        let ple = if cfg.per_layer > 0 {
            Some(PerLayerInput {
                inp_gate: self.weight(&p("inp_gate.weight"), cfg.per_layer, h)?,
                proj: self.weight(&p("proj.weight"), h, cfg.per_layer)?,
                post_norm: self.norm(&p("post_norm.weight"), h)?,
            })
        } else {
            None
        };
        let moe = match &cfg.moe {
            Some(m) if self.has(&p("ffn_gate_inp.weight")) => Some(Box::new(self.gemma4_experts(m, l, h)?)),
            _ => None,
        };
        let out_scale = if self.has(&p("layer_output_scale.weight")) { self.values(&p("layer_output_scale.weight"), 1)?[0] } else { 0.0 };
        if out_scale == 0.0 && self.has(&p("layer_output_scale.weight")) {
            return Err(self.model_err(format!("blk.{l}.layer_output_scale is 0")));
        }
        let layer = Layer {
            attn_norm: self.norm(&p("attn_norm.weight"), h)?,
            q: self.weight(&p("attn_q.weight"), qd, h)?,
            q_norm: self.norm(&p("attn_q_norm.weight"), hd)?,
            kv,
            o: self.weight(&p("attn_output.weight"), h, qd)?,
            post_attn_norm: self.norm(&p("post_attention_norm.weight"), h)?,
            ffn_norm: self.norm(&p("ffn_norm.weight"), h)?,
            gate: self.weight(&p("ffn_gate.weight"), lc.ff, h)?,
            up: self.weight(&p("ffn_up.weight"), lc.ff, h)?,
            down: self.weight(&p("ffn_down.weight"), h, lc.ff)?,
            post_ffw_norm: self.norm(&p("post_ffw_norm.weight"), h)?,
            moe,
            ple,
            out_scale,
        };
        if layer.gate.1 != layer.up.1 {
            return Err(self.model_err(format!("blk.{l}: ffn_gate and ffn_up differ in type; the fused GLU reads one")));
        }
        Ok(layer)
    }

    /// Block `l`'s routed experts (as candle's `quantized_gemma4` reads them: a fused
    /// `ffn_gate_up_exps` or the gates and ups apart, `ffn_down_exps` and its optional scale).
    fn gemma4_experts(&mut self, m: &Gemma4Moe, l: usize, h: usize) -> Result<ExpertFfn> {
        let p = |s: &str| format!("blk.{l}.{s}");
        let (e, fe) = (m.experts, m.expert_ff);
        let fused = p("ffn_gate_up_exps.weight");
        let (gate_exps, up_exps) =
            if self.has(&fused) { self.experts_split(&fused, e, fe, h)? } else { (self.experts(&p("ffn_gate_exps.weight"), e, fe, h)?, self.experts(&p("ffn_up_exps.weight"), e, fe, h)?) };
        if gate_exps.1 != up_exps.1 {
            return Err(self.model_err(format!("blk.{l}: the experts' gate and up differ in type; the fused GLU reads one")));
        }
        // candle scales the normed row by 1/sqrt(hidden) (as f32), then by the scale; folded
        // into one weight here (a rounding apart, within the model checks' bounds).
        let c = (1.0 / (h as f64).sqrt()) as f32;
        let router_w: Vec<f32> = self.values(&p("ffn_gate_inp.scale"), h)?.iter().map(|s| c * s).collect();
        let scale = p("ffn_down_exps.scale");
        let escale = if self.has(&scale) { Some(self.stream.clone_htod(&self.values(&scale, e)?)?) } else { None };
        Ok(ExpertFfn {
            router: self.norm(&p("ffn_gate_inp.weight"), e * h)?,
            router_w: self.stream.clone_htod(&router_w)?,
            down_exps: self.experts(&p("ffn_down_exps.weight"), e, h, fe)?,
            gate_exps,
            up_exps,
            escale,
            pre_norm: self.norm(&p("pre_ffw_norm_2.weight"), h)?,
            post_norm_dense: self.norm(&p("post_ffw_norm_1.weight"), h)?,
            post_norm_experts: self.norm(&p("post_ffw_norm_2.weight"), h)?,
        })
    }
}

impl Gemma4Gpu {
    /// Loads a `gemma4` GGUF onto GPU `ordinal`, for caches of up to `max_ctx` positions.
    pub fn load(path: &Path, ordinal: usize, max_ctx: usize) -> Result<Gemma4Gpu> {
        let ctx_len = max_ctx.max(1);
        let shown = path.display().to_string();
        let read_err = |source| Error::Read { path: shown.clone(), source };
        let model_err = |what: String| Error::Model { path: shown.clone(), what };
        let mut file = File::open(path).map_err(|e| read_err(candle_core::Error::from(e)))?;
        let content = gguf_file::Content::read(&mut file).map_err(read_err)?;
        let embd_info = content.tensor_infos.get("token_embd.weight").ok_or_else(|| model_err("no token_embd.weight".into()))?;
        let cfg = Gemma4Config::from_metadata(&content.metadata, embd_info.shape.dims()[0]).map_err(model_err)?;
        if let Some(why) = cfg.unsupported() {
            return Err(model_err(format!("{why}: not a shape the GPU kernels take")));
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
        let output = if r.has("output.weight") { Some(r.matrix("output.weight", cfg.vocab, cfg.hidden)?) } else { None };
        let output_norm = r.norm("output_norm.weight", cfg.hidden)?;
        let n_layer = cfg.layers.len();
        let lp = n_layer * cfg.per_layer;
        let ple = if cfg.per_layer > 0 {
            Some(PerLayerEmbedding {
                table: r.matrix("per_layer_token_embd.weight", cfg.vocab, lp)?,
                model_proj: r.weight("per_layer_model_proj.weight", lp, cfg.hidden)?,
                proj_norm: r.norm("per_layer_proj_norm.weight", cfg.per_layer)?,
            })
        } else {
            None
        };
        let rope_freqs = if cfg.layers.iter().any(|l| !l.sliding) && r.has("rope_freqs.weight") { Some(r.values("rope_freqs.weight", cfg.rope_dim / 2)?) } else { None };
        let mut layers = Vec::with_capacity(n_layer);
        let mut slot = Vec::with_capacity(n_layer);
        for l in 0..n_layer {
            layers.push(r.gemma4_layer(&cfg, l)?);
            slot.push((l < cfg.kv_layers).then_some(l));
        }
        let max = |f: &dyn Fn(&crate::config::Gemma4Layer) -> usize| cfg.layers.iter().map(f).max().unwrap_or(0);
        let (qd, kvd, ff, heads, hd) = (max(&|l| l.n_head * l.head_dim), max(&|l| l.n_kv * l.head_dim), max(&|l| l.ff), max(&|l| l.n_head), max(&|l| l.head_dim));
        // The Q8 rows hold the widest row any GEMV reads (the experts' rows: `used` a token).
        let (experts, used, fe) = cfg.moe.map_or((0, 0, 0), |mc| (mc.experts, mc.used, mc.expert_ff));
        if used > 0 && !wide {
            return Err(model_err("the experts' GEMV reads the wide layout: TINE_GPU_WIDE=0 is for dense models".into()));
        }
        let kmax = cfg.hidden.max(ff).max(qd).max(cfg.per_layer).max(used * fe);
        // The attention's partials: each layer's rows of its heads and chunks (a sliding layer's
        // chunks_max counts one more than its window's span).
        let partials = cfg.layers.iter().map(|l| l.n_head * Kernels::attn_chunks_max(ctx_len, if l.sliding { cfg.window } else { 0 }) * (l.head_dim + 2)).max().unwrap_or(0);
        let m = PROMPT_ROWS;
        let b = Buffers {
            h: alloc(&stream, m * cfg.hidden)?,
            hid: alloc(&stream, m * cfg.hidden)?,
            q: alloc(&stream, m * qd)?,
            k: alloc(&stream, m * kvd)?,
            v: alloc(&stream, m * kvd)?,
            o: alloc(&stream, m * cfg.hidden)?,
            ff: alloc(&stream, m * ff)?,
            down: alloc(&stream, m * cfg.hidden)?,
            gate: alloc(&stream, m * cfg.per_layer)?,
            ple_proj: alloc(&stream, m * lp)?,
            ple: alloc(&stream, m * lp)?,
            qs: alloc(&stream, m * kmax)?,
            qd: alloc(&stream, m * kmax / QK)?,
            qsum: alloc(&stream, m * kmax / QK)?,
            partials: alloc(&stream, MAX_ROWS * partials)?,
            attn_counters: alloc(&stream, MAX_ROWS * heads)?,
            stage: alloc(&stream, m * 2 * kvd)?,
            xn: alloc(&stream, if used > 0 { m * cfg.hidden } else { 1 })?,
            moe_logits: alloc(&stream, if used > 0 { m * (experts + 1) } else { 1 })?,
            moe_ids: alloc(&stream, (m * used).max(1))?,
            moe_wts: alloc(&stream, (m * used).max(1))?,
            moe_list: alloc(&stream, (experts * m).max(1))?,
            moe_counts: alloc(&stream, experts.max(1))?,
            ffx: alloc(&stream, (m * used * fe).max(1))?,
            ydn: alloc(&stream, (m * used * cfg.hidden).max(1))?,
            ymoe: alloc(&stream, if used > 0 { m * cfg.hidden } else { 1 })?,
            dense: alloc(&stream, if used > 0 { m * cfg.hidden } else { 1 })?,
            out: Readout::new(&stream, cfg.vocab)?,
        };
        let step = std::sync::Mutex::new(StepBlock { params: alloc(&stream, 1)?, tokens: alloc(&stream, m)?, hin: alloc(&stream, cfg.hidden)? });
        let (hd_swa, hd_global) = (cfg.layers.iter().find(|l| l.sliding).map_or(hd, |l| l.head_dim), cfg.layers.iter().find(|l| !l.sliding).map_or(hd, |l| l.head_dim));
        let inv_swa = stream.clone_htod(&inv_freq(cfg.rope_dim_swa.min(hd_swa), cfg.rope_base_swa, None))?;
        let inv_global = stream.clone_htod(&inv_freq(cfg.rope_dim.min(hd_global), cfg.rope_base, rope_freqs.as_deref()))?;
        stream.synchronize()?;
        Ok(Gemma4Gpu { cfg, max_ctx: ctx_len, prompt_rows: m, stream, step, kernels, embd, output, output_norm, inv_swa, inv_global, layers, ple, slot, b, partials_row: partials, wide, _ctx: ctx })
    }

    pub fn config(&self) -> &Gemma4Config {
        &self.cfg
    }

    /// The GPU's free and total memory in bytes (the driver's `cuMemGetInfo`).
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok(self._ctx.mem_get_info()?)
    }

    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// The most rows of one prompt step (the prompt kernels past [`MAX_ROWS`]). `TINE_GPU_G4_PROMPT=0`
    /// keeps prompts in 8-row graph steps (one-row steps' bits), to compare one path with the
    /// other: a prompt step matches them to float rounding (the GEMMs and the prompt attention
    /// sum in another order, and a Q8 activation may round the other way), which a deep
    /// random-weight model grows layer by layer (`tine-gpu-check --gemma4-trace`,
    /// docs/evaluations/gpu-families.md).
    pub fn prompt_rows(&self) -> usize {
        if std::env::var("TINE_GPU_G4_PROMPT").is_ok_and(|v| v == "0") {
            MAX_ROWS.min(self.prompt_rows)
        } else {
            self.prompt_rows
        }
    }

    /// An empty sequence state of `ctx_len` positions (at most [`Gemma4Gpu::max_ctx`]).
    pub fn new_cache(&self, ctx_len: usize) -> Result<Gemma4Cache> {
        self.new_cache_typed(ctx_len, KvTypes::F32)
    }

    /// [`Gemma4Gpu::new_cache`] storing keys and values as `types`.
    pub fn new_cache_typed(&self, ctx_len: usize, types: KvTypes) -> Result<Gemma4Cache> {
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let kv = self.cfg.layers[..self.cfg.kv_layers].iter().map(|lc| KvLayer::new(&self.stream, types, lc.n_kv, ctx_len, lc.head_dim)).collect::<std::result::Result<_, _>>()?;
        Ok(Gemma4Cache { kv, ctx_len, pos: 0, last: LastStep::default(), graphs: (0..2 * MAX_ROWS).map(|_| None).collect() })
    }

    /// Bytes of K/V one position of a sequence takes at `types`.
    pub fn kv_bytes_per_position(&self, types: KvTypes) -> usize {
        self.cfg.layers[..self.cfg.kv_layers].iter().map(|l| l.n_kv * types.bytes_per_head(l.head_dim)).sum()
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> DevPtr {
        s.device_ptr(&self.stream).0
    }

    fn seg(&self, w: &W, out: &CudaSlice<f32>, n: usize) -> GemvSeg {
        GemvSeg { w: self.ptr(&w.0), out: self.ptr(out), n: n as i32, wtype: w.1.ggml_id(), out_stride: n as i32, wide: self.wide as i32, ..Default::default() }
    }

    fn act(&self, row: usize, k: usize) -> (DevPtr, DevPtr, DevPtr) {
        let (r, kb) = (row as u64, (k / QK) as u64);
        (self.ptr(&self.b.qs) + r * k as u64, self.ptr(&self.b.qd) + r * kb * 4, self.ptr(&self.b.qsum) + r * kb * 4)
    }

    /// The decode/prompt attention's arguments: the queries in `b.q`, `n_head` of them over the
    /// `n_kv` heads of `kv` (a layer's cache in `cache`), the output as the activations' Q8 rows.
    fn attn_args(&self, ctx_len: usize, kv: KvPtrs, window: usize, n_head: usize, n_kv: usize, step: DevPtr) -> AttnArgs {
        let (b, act) = (&self.b, self.act(0, 0));
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
            n_kv: n_kv as i32,
            chunks_max: Kernels::attn_chunks_max(ctx_len, window) as i32,
            gate: 0,
            k_type: kv.types.k.kernel_id(),
            v_type: kv.types.v.kernel_id(),
            kv_slots: 0,
            turbo: self.kernels.turbo_tab(&self.stream),
        }
    }

    /// `norm_quant` over the step's rows into the Q8 planes: `mode` 0 (plain, `a`), 1 (`h +
    /// rmsnorm(a) · w_a`, times `res_scale` when it is not 0), 2 (the embedding row times
    /// `sqrt(hidden)`) or 4 (`gelu(a) · w_a`), the residual stream `b.h` written back in modes 1
    /// and 2, normed by `w` when it is set.
    #[allow(clippy::too_many_arguments)]
    fn nq(&self, step: DevPtr, prompt: Option<DevPtr>, a: DevPtr, w_a: DevPtr, mode: i32, k: usize, w: DevPtr, res_scale: f32) -> NormQuantArgs {
        let b = &self.b;
        NormQuantArgs {
            a,
            res: self.ptr(&b.h),
            w_a,
            embd: self.ptr(&self.embd.buf),
            embd_scale: (self.cfg.hidden as f32).sqrt(),
            step,
            w,
            eps: self.cfg.eps,
            res_out: if mode == 1 || mode == 2 { self.ptr(&b.h) } else { 0 },
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
            res_scale,
            embd_type: self.embd.embd_type(),
            b_stride: 0,
        }
    }

    /// The launches of one step of `rows` rows over `cache` (what a graph captures); without
    /// `head`, the trunk alone. With `prompt` (the address of the step's token ids), a prompt
    /// step of up to [`PROMPT_ROWS`] rows, the head on its last row.
    /// `mark` is called after each launch with what it does (the profile's events).
    fn launch_step(&self, cache: &Gemma4Cache, step: DevPtr, rows: usize, head: bool, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<(), GpuError> {
        self.launch_rows(StepKv::One(cache), step, rows, head, prompt, mark)
    }

    /// [`Gemma4Gpu::launch_step`] over one sequence's caches, or a batched step's rows over
    /// their entries' caches (`StepKv::Batch`: the tokens from the batch's block, each layer's K/V
    /// through its `kv_slots` table, the GEMVs of more than 8 rows as groups of 8, the decode
    /// attention and the head on every row into the batch's readout).
    fn launch_rows(&self, kv_of: StepKv<'_>, step: DevPtr, rows: usize, head: bool, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<(), GpuError> {
        let c = &self.cfg;
        let b = &self.b;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let (s, k) = (&self.stream, &self.kernels);
        let act = self.act(0, 0);
        let h = c.hidden;
        let lp = c.layers.len() * c.per_layer;
        let batch = match kv_of {
            StepKv::Batch(bt) => Some(bt),
            StepKv::One(_) => None,
        };
        // The token ids of the rows, where they are not the step block's: a prompt's, a batch's.
        let tokens = prompt.or(batch.map(|bt| self.ptr(&bt.tokens)));
        // A batched step's GEMVs: each row as its one-row launch computes it, whatever the count.
        let gemv = |rows: usize, kk: usize, segs: &[GemvSeg], act: (DevPtr, DevPtr, DevPtr)| -> std::result::Result<(), GpuError> {
            // SAFETY: as the launches below (the buffers hold the step's rows, the batch's padded
            // rows a multiple of 8 past 8).
            unsafe {
                if batch.is_some() && rows > MAX_ROWS {
                    k.gemv_rows(s, rows, kk, segs, act)
                } else {
                    k.gemv(s, rows, kk, segs, act)
                }
            }
        };
        let ctx_len = match kv_of {
            StepKv::One(cache) => cache.ctx_len,
            StepKv::Batch(bt) => bt.capacity(),
        };
        // SAFETY: every buffer was allocated at load for PROMPT_ROWS rows of its widest layer
        // (the logits and argmax scratch for MAX_ROWS; `step` keeps rows <= MAX_ROWS unless
        // `prompt`, whose head runs on one row), the caches for ctx_len positions; `step` checks
        // that the step's positions are below ctx_len.
        unsafe {
            // The per-layer inputs of the step's rows, before layer 0.
            if let Some(pe) = &self.ple {
                k.norm_quant(s, rows, &self.nq(step, tokens, 0, 0, 2, h, 0, 0.0))?;
                mark("norm_quant")?;
                gemv(rows, h, &[self.seg(&pe.model_proj, &b.ple_proj, lp)], act)?;
                mark("gemv per_layer_model_proj")?;
                let pa = PleArgs {
                    proj: p(&b.ple_proj),
                    embd: self.ptr(&pe.table.buf),
                    w: p(&pe.proj_norm),
                    out: p(&b.ple),
                    step,
                    tokens: tokens.unwrap_or(0),
                    embd_type: pe.table.embd_type(),
                    n_layer: c.layers.len() as i32,
                    p: c.per_layer as i32,
                    eps: c.eps,
                    proj_scale: (1.0 / (h as f64).sqrt()) as f32,
                    tok_scale: (c.per_layer as f64).sqrt() as f32,
                };
                k.ple_inputs(s, rows, &pa)?;
                mark("ple_inputs")?;
            }
            // What the next norm_quant adds to the residual: (rows, post-norm, scale).
            let mut tail: Option<(DevPtr, DevPtr, f32)> = None;
            for (l, ly) in self.layers.iter().enumerate() {
                let lc = &c.layers[l];
                let first = match tail {
                    Some((a, w_a, scale)) => self.nq(step, tokens, a, w_a, 1, h, p(&ly.attn_norm), scale),
                    // The embedded rows are in `h` already when the per-layer inputs read them.
                    None if self.ple.is_some() => NormQuantArgs { res_out: 0, ..self.nq(step, tokens, p(&b.h), 0, 0, h, p(&ly.attn_norm), 0.0) },
                    None => self.nq(step, tokens, 0, 0, 2, h, p(&ly.attn_norm), 0.0),
                };
                k.norm_quant(s, rows, &first)?;
                mark("norm_quant")?;
                let (hd, qd) = (lc.head_dim, lc.n_head * lc.head_dim);
                let src = lc.kv_layer;
                let (n_kv, kvd) = (c.layers[src].n_kv, c.layers[src].n_kv * hd);
                let si = self.slot[src].expect("a KV-shared layer's source owns K/V (checked at load)");
                let (kv, kv_slots) = match kv_of {
                    StepKv::One(cache) => (cache.kv[si].ptrs(s), 0),
                    // The caches' pointers come from the table; the launch's own are never read.
                    StepKv::Batch(bt) => (KvPtrs { k: 0, v: 0, types: bt.types() }, bt.kv_slots(s, si, rows)),
                };
                let mut segs = vec![self.seg(&ly.q, &b.q, qd)];
                if let Some(own) = &ly.kv {
                    segs.push(self.seg(&own.k, &b.k, kvd));
                    if let Some(v) = &own.v {
                        segs.push(self.seg(v, &b.v, kvd));
                    }
                }
                gemv(rows, h, &segs, act)?;
                mark("gemv qkv")?;
                let rope = RopeArgs {
                    q: p(&b.q),
                    k: p(&b.k),
                    v: p(&b.v),
                    q_norm: p(&ly.q_norm),
                    k_norm: ly.kv.as_ref().map_or(0, |o| p(&o.k_norm)),
                    eps: c.eps,
                    inv_freq: if lc.sliding { p(&self.inv_swa) } else { p(&self.inv_global) },
                    q_scale: 1.0,
                    k_cache: kv.k,
                    v_cache: kv.v,
                    ctx: ctx_len as i32,
                    step,
                    n_head: lc.n_head as i32,
                    n_kv: if ly.kv.is_some() { n_kv as i32 } else { 0 },
                    hd: hd as i32,
                    n_rot: if lc.sliding { c.rope_dim_swa } else { c.rope_dim }.min(hd) as i32,
                    v_norm: 1,
                    v_from_k: ly.kv.as_ref().is_some_and(|o| o.v.is_none()) as i32,
                    k_type: kv.types.k.kernel_id(),
                    v_type: kv.types.v.kernel_id(),
                    kv_slots,
                    stage: p(&b.stage),
                    turbo: self.kernels.turbo_tab(&self.stream),
                };
                k.qk_norm_rope_kv(s, rows, &rope)?;
                mark("qk_norm_rope_kv")?;
                let window = if lc.sliding { c.window } else { 0 };
                let mut at = self.attn_args(ctx_len, kv, window, lc.n_head, n_kv, step);
                if let Some(bt) = batch {
                    at = AttnArgs { partials: self.ptr(&bt.partials), counters: self.ptr(&bt.counters), kv_slots, ..at };
                }
                match prompt {
                    Some(_) => k.attention_prompt(s, rows, hd, &at)?,
                    None => k.attention(s, rows, hd, &at)?,
                }
                mark(if lc.sliding { "attention sliding" } else { "attention global" })?;
                gemv(rows, qd, &[self.seg(&ly.o, &b.o, h)], act)?;
                mark("gemv o")?;
                k.norm_quant(s, rows, &self.nq(step, tokens, p(&b.o), p(&ly.post_attn_norm), 1, h, p(&ly.ffn_norm), 0.0))?;
                mark("norm_quant")?;
                let glu = GemvSeg {
                    w: self.ptr(&ly.gate.0),
                    w2: self.ptr(&ly.up.0),
                    out: p(&b.ff),
                    n: lc.ff as i32,
                    wtype: ly.gate.1.ggml_id(),
                    out_stride: lc.ff as i32,
                    glu: 1,
                    block_start: 0,
                    wide: self.wide as i32,
                };
                gemv(rows, h, &[glu], act)?;
                mark("gemv gate·up")?;
                k.norm_quant(s, rows, &self.nq(step, tokens, p(&b.ff), 0, 0, lc.ff, 0, 0.0))?;
                mark("norm_quant")?;
                gemv(rows, lc.ff, &[self.seg(&ly.down, &b.down, h)], act)?;
                mark("gemv down")?;
                if let Some(e) = &ly.moe {
                    self.launch_experts(e, step, rows, prompt, mark)?;
                }
                tail = Some(match &ly.ple {
                    None => (p(&b.down), p(&ly.post_ffw_norm), ly.out_scale),
                    Some(pl) => {
                        k.norm_quant(s, rows, &self.nq(step, tokens, p(&b.down), p(&ly.post_ffw_norm), 1, h, 0, 0.0))?;
                        mark("norm_quant")?;
                        gemv(rows, h, &[self.seg(&pl.inp_gate, &b.gate, c.per_layer)], act)?;
                        mark("gemv inp_gate")?;
                        let gate = NormQuantArgs { b_stride: lp as i32, ..self.nq(step, tokens, p(&b.gate), p(&b.ple) + (l * c.per_layer * 4) as u64, 4, c.per_layer, 0, 0.0) };
                        k.norm_quant(s, rows, &gate)?;
                        mark("norm_quant")?;
                        gemv(rows, c.per_layer, &[self.seg(&pl.proj, &b.o, h)], act)?;
                        mark("gemv proj")?;
                        (p(&b.o), p(&pl.post_norm), ly.out_scale)
                    }
                });
            }
            let (a, w_a, scale) = tail.expect("a model has layers");
            let last = NormQuantArgs { y_out: p(&b.hid), ..self.nq(step, tokens, a, w_a, 1, h, p(&self.output_norm), scale) };
            k.norm_quant(s, rows, &last)?;
            mark("norm_quant")?;
            if !head {
                return Ok(());
            }
            let out = self.output.as_ref().unwrap_or(&self.embd);
            let (head_rows, act) = match prompt {
                None => (rows, self.act(0, h)),
                Some(_) => (1, self.act(rows - 1, h)),
            };
            let readout = batch.map_or(&b.out, |bt| &bt.out);
            let seg =
                GemvSeg { w: self.ptr(&out.buf), out: self.ptr(&readout.logits), n: c.vocab as i32, wtype: out.wt.ggml_id(), out_stride: c.vocab as i32, wide: out.wide as i32, ..Default::default() };
            gemv(head_rows, h, &[seg], act)?;
            mark("lm head")?;
            if let Some(cap) = c.softcap {
                k.softcap(s, &SoftcapArgs { x: self.ptr(&readout.logits), n: (head_rows * c.vocab) as i32, cap, inv_cap: (1.0 / cap as f64) as f32, pad_: 0 })?;
                mark("softcap")?;
            }
            k.argmax(s, head_rows, &readout.argmax_args(s, step))?;
            mark("argmax")?;
        }
        Ok(())
    }

    /// A 26B-A4B-style block's routed experts over the step's rows (`b.h` holding `xa`, the dense
    /// MLP's `down` in `b.down`), leaving `post_ffw_norm_1(dense) + post_ffw_norm_2(experts)` in
    /// `b.down` (10 launches; 11 in a prompt step, which lists the pairs by expert first).
    ///
    /// # Safety
    /// As [`Gemma4Gpu::launch_step`]'s: the buffers hold [`PROMPT_ROWS`] rows, `used` pairs each.
    unsafe fn launch_experts(&self, e: &ExpertFfn, step: DevPtr, rows: usize, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<(), GpuError> {
        let (c, b, s, k) = (&self.cfg, &self.b, &self.stream, &self.kernels);
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let mc = c.moe.expect("a block with experts in a model with experts (checked at load)");
        let (h, used, fe) = (c.hidden, mc.used, mc.expert_ff);
        let pairs = rows * used;
        let act = self.act(0, 0);
        k.norm_quant(s, rows, &NormQuantArgs { y_out: p(&b.xn), ..self.nq(step, prompt, p(&b.h), 0, 0, h, p(&e.router_w), 0.0) })?;
        mark("norm_quant router")?;
        let ra = MoeRouterArgs {
            x: p(&b.xn),
            router: p(&e.router),
            shared_gate: 0,
            ids: self.ptr(&b.moe_ids),
            wts: p(&b.moe_wts),
            sgate: 0,
            logits: p(&b.moe_logits),
            k: h as i32,
            n_expert: mc.experts as i32,
            used: used as i32,
            pad_: 0,
        };
        k.moe_logits(s, rows, &ra)?;
        mark("moe_logits")?;
        k.moe_router(s, rows, &ra)?;
        mark("moe_router")?;
        k.norm_quant(s, rows, &self.nq(step, prompt, p(&b.h), 0, 0, h, p(&e.pre_norm), 0.0))?;
        mark("norm_quant")?;
        let bytes = |w: &W, n: usize, k: usize| n * w.1.wide_row_bytes(k);
        let glu = GemvSeg {
            w: self.ptr(&e.gate_exps.0),
            w2: self.ptr(&e.up_exps.0),
            out: p(&b.ffx),
            n: fe as i32,
            wtype: e.gate_exps.1.ggml_id(),
            out_stride: fe as i32,
            glu: 1,
            block_start: 0,
            wide: self.wide as i32,
        };
        // A prompt step runs a GEMM per expert, decode and verify steps a GEMV per pair
        // (Kernels::moe_gemv); both are marked with gemv_moe's names (a prompt step's moe_sort
        // time goes to gate·up's), so that a trace lines the two paths' launches up.
        let (grouped, ids, sorted) = (prompt.is_some(), self.ptr(&b.moe_ids), (self.ptr(&b.moe_list), self.ptr(&b.moe_counts)));
        k.moe_gemv(s, grouped, rows, mc.experts, used, h, glu, act, ids, sorted, bytes(&e.gate_exps, fe, h), false)?;
        mark("gemv_moe gate·up")?;
        k.norm_quant(s, pairs, &self.nq(step, prompt, p(&b.ffx), 0, 0, fe, 0, 0.0))?;
        mark("norm_quant")?;
        k.moe_gemv(s, grouped, rows, mc.experts, used, fe, self.seg(&e.down_exps, &b.ydn, h), act, ids, sorted, bytes(&e.down_exps, h, fe), true)?;
        mark("gemv_moe down")?;
        let ca = MoeCombineArgs {
            y: p(&b.ydn),
            wts: p(&b.moe_wts),
            shared: 0,
            sgate: 0,
            out: p(&b.ymoe),
            k: h as i32,
            used: used as i32,
            ids: self.ptr(&b.moe_ids),
            escale: e.escale.as_ref().map_or(0, &p),
        };
        k.moe_combine(s, rows, &ca)?;
        mark("moe_combine")?;
        // post_ffw_norm_1(dense) as f32, then that plus post_ffw_norm_2(experts) into b.down.
        k.norm_quant(s, rows, &NormQuantArgs { y_out: p(&b.dense), ..self.nq(step, prompt, p(&b.down), 0, 0, h, p(&e.post_norm_dense), 0.0) })?;
        mark("norm_quant")?;
        k.norm_quant(s, rows, &NormQuantArgs { res: p(&b.dense), res_out: p(&b.down), ..self.nq(step, prompt, p(&b.ymoe), p(&e.post_norm_experts), 1, h, 0, 0.0) })?;
        mark("norm_quant")?;
        Ok(())
    }

    /// Kernel launches (graph nodes) of a step of `rows` rows.
    pub fn graph_nodes(&self, cache: &mut Gemma4Cache, rows: usize) -> Result<usize> {
        if !(1..=MAX_ROWS).contains(&rows) {
            return Err(Error::Step { rows, pos: cache.pos, what: format!("a graph is captured for 1 to {MAX_ROWS} rows") });
        }
        let step = self.ptr(&self.step.lock().expect("a step panicked holding the step block").params);
        self.capture(cache, step, rows, true)?;
        let g = &cache.graphs[rows - 1].as_ref().expect("captured just above").0;
        let mut n = 0usize;
        // SAFETY: counting the nodes of a live graph (a null array asks for the count only).
        unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) }.result()?;
        Ok(n)
    }

    fn capture(&self, cache: &mut Gemma4Cache, step: DevPtr, rows: usize, head: bool) -> Result<()> {
        let at = if head { rows - 1 } else { MAX_ROWS + rows - 1 };
        if cache.graphs[at].is_none() {
            self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let launched = self.launch_step(cache, step, rows, head, None, &mut |_| Ok(()));
            let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            launched?;
            let graph = graph?.ok_or_else(|| Error::Step { rows, pos: cache.pos, what: "the capture made no graph".into() })?;
            graph.upload()?;
            cache.graphs[at] = Some(Graph(graph));
        }
        Ok(())
    }

    /// Runs `tokens` (1..=8) at `cache`'s next positions; their logits and greedy ids are ready
    /// for [`Gemma4Gpu::logits`] and [`Gemma4Gpu::argmax`] until the next step of any cache.
    pub fn forward(&self, cache: &mut Gemma4Cache, tokens: &[u32]) -> Result<()> {
        self.step(cache, tokens, &[], true)
    }

    /// [`Gemma4Gpu::forward`] with the greedy ids passing over `banned` (at most [`MAX_BANNED`]).
    pub fn forward_banning(&self, cache: &mut Gemma4Cache, tokens: &[u32], banned: &[u32]) -> Result<()> {
        self.step(cache, tokens, banned, true)
    }

    /// Runs `tokens` (1..=[`Gemma4Gpu::prompt_rows`]) through the trunk alone (no LM head).
    pub fn forward_trunk(&self, cache: &mut Gemma4Cache, tokens: &[u32]) -> Result<()> {
        self.step(cache, tokens, &[], false)
    }

    /// Runs a prompt's `tokens` (1..=[`Gemma4Gpu::prompt_rows`]): the last row's logits and id
    /// (every row's for steps of up to [`MAX_ROWS`]).
    pub fn forward_prompt(&self, cache: &mut Gemma4Cache, tokens: &[u32]) -> Result<()> {
        self.step(cache, tokens, &[], true)
    }

    fn step(&self, cache: &mut Gemma4Cache, tokens: &[u32], banned: &[u32], head: bool) -> Result<()> {
        self.step_marked(cache, tokens, banned, head, &mut |_| Ok(()), false)
    }

    /// Runs `tokens` as one step launched directly (no graph) with an event after each launch,
    /// and returns each kind of launch's device time in microseconds, summed over the step, in
    /// the order first launched.
    pub fn profile(&self, cache: &mut Gemma4Cache, tokens: &[u32]) -> Result<Vec<(&'static str, f64)>> {
        let event = |stream: &Arc<CudaStream>| stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|source| GpuError::Launch { kernel: "event", source });
        let mut marks = Vec::new();
        self.step_marked(
            cache,
            tokens,
            &[],
            true,
            &mut |what| {
                marks.push((what, event(&self.stream)?));
                Ok(())
            },
            true,
        )?;
        self.stream.synchronize()?;
        Ok(time_marks(&marks)?)
    }

    /// Runs `tokens` as one step launched directly (the prompt kernels for more than
    /// [`MAX_ROWS`] rows, the decode kernels otherwise) and returns, after each launch, what it
    /// did and the step's last row of the buffers the trunk writes: [`TRACE_PARTS`] in that order
    /// (the queries at the width of the launch's layer). Two ways of running the same positions
    /// (a prompt step, or one-row steps then a last step of up to 8 rows) give the same launches,
    /// so the first launch where they part names the kernel at fault.
    pub fn trace(&self, cache: &mut Gemma4Cache, tokens: &[u32]) -> Result<Vec<TracePoint>> {
        let rows = tokens.len();
        let (h, lp) = (self.cfg.hidden, self.cfg.layers.len() * self.cfg.per_layer);
        let mut out = Vec::new();
        let mut layer: Option<usize> = None;
        let stream = &self.stream;
        let b = &self.b;
        let row = |buf: &CudaSlice<f32>, width: usize| -> std::result::Result<Vec<f32>, GpuError> {
            let mut v = vec![0f32; width];
            if width > 0 {
                stream.memcpy_dtoh(&buf.slice((rows - 1) * width..rows * width), &mut v[..]).map_err(|source| GpuError::Launch { kernel: "trace", source })?;
            }
            Ok(v)
        };
        self.step_marked(
            cache,
            tokens,
            &[],
            true,
            &mut |what| {
                if what == "start" {
                    return Ok(());
                }
                if what == "gemv qkv" {
                    layer = Some(layer.map_or(0, |l| l + 1));
                }
                let qd = layer.map_or(0, |l| self.cfg.layers[l].n_head * self.cfg.layers[l].head_dim);
                out.push((what, [row(&b.h, h)?, row(&b.q, qd)?, row(&b.o, h)?, row(&b.down, h)?, row(&b.ple, lp)?]));
                Ok(())
            },
            true,
        )?;
        Ok(out)
    }

    /// One step; `eager` launches it directly (no graph, the prompt kernels for more than
    /// [`MAX_ROWS`] rows), calling `mark` once before the launches ("start") and after each.
    fn step_marked(&self, cache: &mut Gemma4Cache, tokens: &[u32], banned: &[u32], head: bool, mark: &mut Mark, eager: bool) -> Result<()> {
        let rows = tokens.len();
        let fail = |what: String| Error::Step { rows, pos: cache.pos, what };
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
        self.stream.memcpy_htod(&[params][..], &mut block.params)?;
        let step = self.ptr(&block.params);
        let launched = if rows <= MAX_ROWS && !eager {
            self.capture(cache, step, rows, head).and_then(|()| Ok(cache.graphs[if head { rows - 1 } else { MAX_ROWS + rows - 1 }].as_ref().expect("captured").0.launch()?))
        } else {
            let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
            self.stream.memcpy_htod(&ids[..], &mut block.tokens.slice_mut(..rows))?;
            // A short eager step reads its tokens from the step block, as its graph would.
            let prompt = (rows > MAX_ROWS).then(|| self.ptr(&block.tokens));
            mark("start")?;
            self.launch_step(cache, step, rows, head, prompt, mark).map_err(Error::from)
        };
        drop(block);
        // A failed step wrote K/V past the sequence's positions only: the cache stays as it was.
        launched?;
        cache.pos += rows;
        cache.last = LastStep::after(rows, head);
        Ok(())
    }

    /// Runs `tokens` as [`Gemma4Gpu::forward_banning`] and returns the `k` best `(id, logit)` of
    /// the last row (the sampler's order, `banned` left out).
    pub fn forward_top_k(&self, cache: &mut Gemma4Cache, tokens: &[u32], banned: &[u32], k: usize) -> Result<Vec<(u32, f32)>> {
        self.b.out.check_top_k(tokens.len(), cache.pos, k)?;
        self.step(cache, tokens, banned, true)?;
        Ok(self.top_k_rows(cache.last.last_row(), 1, k)?.pop().expect("one row asked for"))
    }

    /// Runs `tokens` (at most [`MAX_ROWS`]) and returns every row's `k` best `(id, logit)`.
    pub fn forward_top_k_all(&self, cache: &mut Gemma4Cache, tokens: &[u32], banned: &[u32], k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        self.b.out.check_top_k(tokens.len(), cache.pos, k)?;
        if tokens.len() > MAX_ROWS {
            return Err(Error::Step { rows: tokens.len(), pos: cache.pos, what: format!("every row's top {k} of a step of more than {MAX_ROWS} rows") });
        }
        self.step(cache, tokens, banned, true)?;
        self.top_k_rows(0, tokens.len(), k)
    }

    fn top_k_rows(&self, first: usize, rows: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        // The step block holds this step's banned ids.
        let block = self.step.lock().expect("a step panicked holding the step block");
        self.b.out.top_k(&self.kernels, &self.stream, self.ptr(&block.params), first, rows, k)
    }

    /// The greedy ids of `cache`'s last step (every row's, or a long prompt step's last row's).
    pub fn argmax(&self, cache: &Gemma4Cache) -> Result<Vec<u32>> {
        self.b.out.ids(&self.stream, &cache.last, cache.pos)
    }

    /// The logits of `cache`'s last step, `rows × vocab` (a long prompt step's last row's),
    /// softcapped.
    pub fn logits(&self, cache: &Gemma4Cache) -> Result<Vec<f32>> {
        self.b.out.rows(&self.stream, &cache.last, cache.pos)
    }

    /// The logits of row `row` of `cache`'s last step.
    pub fn logits_row(&self, cache: &Gemma4Cache, row: usize) -> Result<Vec<f32>> {
        self.b.out.row(&self.stream, &cache.last, cache.pos, row)
    }

    /// The hidden states of `cache`'s last step after the output norm (what candle's
    /// `quantized_gemma4` returns and its assistant reads), `rows × hidden`.
    pub fn hidden(&self, cache: &Gemma4Cache) -> Result<Vec<f32>> {
        let n = cache.last.rows * self.cfg.hidden;
        let mut v = vec![0f32; n];
        self.stream.memcpy_dtoh(&self.b.hid.slice(..n), &mut v[..])?;
        Ok(v)
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}
