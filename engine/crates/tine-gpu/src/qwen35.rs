//! Qwen3.5/3.6 (`qwen35`, dense) on tine-gpu's kernels: the hybrid of gated delta-net layers and
//! gated full-attention layers read from a GGUF (as llama.cpp writes it) into buffers allocated
//! once, and a step of 1..=8 rows as a fixed list of launches, captured once per row count as a
//! CUDA graph and replayed (prompt steps of more rows launch directly, as Gemma 3's do).
//!
//! The step program, per layer (`x` the residual stream):
//!
//! 1. `norm_quant`: `x += down` of the layer before (layer 0: the embedding row, any weight type
//!    the GEMV reads), then `attn_norm(x)` as Q8
//! 2. the mixer:
//!    - a delta-net layer (4 launches): one GEMV of four segments (the fused QKV rows, the gate
//!      `z`, `beta`, `alpha`), `conv_gated_delta_rule` (the causal conv over the layer's conv
//!      window, then the delta rule over its state; a prompt step runs them as `conv_silu` and
//!      `gated_delta_rule`), `gated_norm_quant` (`RMSNorm(o) · w · SiLU(z)` as Q8), `ssm_out`;
//!    - a full-attention layer (4 launches): one GEMV of four segments (q, its gate, k, v: the GGUF's
//!      `[q | gate]` rows are split per head at load), `qk_norm_rope_kv` (RoPE on the first
//!      `rope.dimension_count` dims), the attention with the `sigmoid(gate)` epilogue, `attn_output`;
//! 3. `norm_quant`: `x += mixer`, then `post_attention_norm(x)` as Q8
//! 4. the SwiGLU GEMV (gate and up, SiLU epilogue), `norm_quant` of its rows, `down`
//!
//! then `norm_quant` (`x += down`, `output_norm`, the normed rows kept as f32: the hidden states
//! Qwen3.5's NextN head reads), the LM head and the greedy argmax. Every matrix is in the wide
//! layout (`gemv_wide`).
//!
//! **Recurrent state and rollback.** Each delta-net layer keeps [`PLANES`] planes of its state (conv
//! window and delta state) per sequence: a step reads the plane its sequence is at and writes the
//! state after each of its last `PLANES - 1` rows into the next planes of the ring. A verify step of
//! up to 8 rows therefore leaves the state after every row, and keeping `j` of its rows is choosing
//! the plane of row `j - 1` for the next step: no copy and no re-run (llama.cpp's per-token
//! snapshots, as an index move). The kernels compute a row with the same operations whatever the
//! row count, so the state after a verify row is a one-token step's bit for bit. A sequence can
//! return to any position one of its planes holds ([`Qwen35Cache::restorable`]), or to 0.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file;
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::blocks::{WeightType, QK};
use crate::config::Qwen35Config;
use crate::cuda::{
    AttnArgs, ConvArgs, ConvGdnArgs, DevPtr, GatedNormArgs, GdnArgs, GemvSeg, GpuError, Kernels, KvLayer, KvPtrs, KvTypes, MoeCombineArgs, MoeRouterArgs, NormQuantArgs, RopeArgs, StepParams,
    MAX_BANNED, MAX_ROWS,
};
mod batch;

use crate::batch::GpuBatch;
use crate::gemma3::{alloc, inv_freq, nextn_params, wide_layout, Gemma3GpuError as Error, Graph, Matrix, Reader, PROMPT_ROWS};

type Result<T> = std::result::Result<T, Error>;

/// Called after each launch of a step with what the launch does.
type Mark<'a> = dyn FnMut(&'static str) -> std::result::Result<(), GpuError> + 'a;

use crate::planes::Ring;
pub use crate::planes::PLANES;
use crate::readout::{time_marks, LastStep, Readout};

const _: () = assert!(PLANES == MAX_ROWS + 1, "a verify step's rows and its start state fit the ring");

type W = (CudaSlice<u8>, WeightType);

enum Mixer {
    Attention { q: W, gate: W, k: W, v: W, o: W, q_norm: CudaSlice<f32>, k_norm: CudaSlice<f32> },
    DeltaNet { qkv: W, z: W, beta: W, alpha: W, conv: CudaSlice<f32>, dt_bias: CudaSlice<f32>, a: CudaSlice<f32>, norm: CudaSlice<f32>, out: W },
}

struct Layer {
    attn_norm: CudaSlice<f32>,
    post_norm: CudaSlice<f32>,
    mixer: Mixer,
    ffn: Ffn,
}

/// A block's feed-forward: SwiGLU, or `qwen35moe`'s experts.
enum Ffn {
    Dense { gate: W, up: W, down: W },
    Moe(Box<MoeFfn>),
}

/// `qwen35moe`'s feed-forward: the router (f32), every expert's gate, up and down stacked (expert
/// `e`'s rows `e · rows` on, in the wide layout), the shared expert and its gate's row.
struct MoeFfn {
    router: CudaSlice<f32>,
    shared_gate: CudaSlice<f32>,
    gate_exps: W,
    up_exps: W,
    down_exps: W,
    shared: (W, W, W),
}

/// Activation buffers for [`PROMPT_ROWS`] rows (the logits and argmax scratch for
/// [`MAX_ROWS`]), allocated once.
struct Buffers {
    h: CudaSlice<f32>,
    /// The rows after the output norm.
    hid: CudaSlice<f32>,
    /// A delta-net layer's QKV rows before the conv, or an attention layer's q.
    x1: CudaSlice<f32>,
    /// `z`, or the attention's gate.
    x2: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    conv: CudaSlice<f32>,
    alpha: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    o: CudaSlice<f32>,
    mix: CudaSlice<f32>,
    ff: CudaSlice<f32>,
    down: CudaSlice<f32>,
    qs: CudaSlice<i8>,
    qd: CudaSlice<f32>,
    qsum: CudaSlice<i32>,
    partials: CudaSlice<f32>,
    attn_counters: CudaSlice<i32>,
    /// A step's K and V rows as f32 for `turbo_store` (caches of the turbo types).
    stage: CudaSlice<f32>,
    /// `qwen35moe` (one value each without experts): the normed rows the router reads, each
    /// row's experts and weights, the shared expert's gates, the experts' SwiGLU rows and their
    /// down projections (`rows × used` of each).
    xn: CudaSlice<f32>,
    moe_ids: CudaSlice<i32>,
    moe_wts: CudaSlice<f32>,
    /// A prompt step's pairs listed by expert (`experts × PROMPT_ROWS`) and their counts.
    moe_list: CudaSlice<i32>,
    moe_counts: CudaSlice<i32>,
    /// The router's logits, `n_expert + 1` a row.
    moe_logits: CudaSlice<f32>,
    sgate: CudaSlice<f32>,
    ffx: CudaSlice<f32>,
    ydn: CudaSlice<f32>,
    /// The LM head's rows and what reads them.
    out: Readout,
}

struct StepBlock {
    params: CudaSlice<StepParams>,
    tokens: CudaSlice<i32>,
    /// A NextN step's input hidden states ([`PROMPT_ROWS`] rows with a head, else one value).
    hin: CudaSlice<f32>,
}

/// A NextN head (block `layers` of a `qwen35` GGUF with `nextn_predict_layers = 1`): entry `j`
/// reads the trunk's hidden state at `j` (after the output norm) and the token at `j + 1`, at
/// position `j + 1` (RoPE's `rope_shift`; its K/V in slot `j` of its own cache):
/// `u = eh_proj [enorm(E[x]); hnorm(h)]`, one full-attention block over the head's cache, then
/// `shared_head_norm(u)` (the output state, which chains into the next draft step in place of
/// `h`) and the logits of the last entry from `shared_head_head` (else the trunk's head).
struct NextNHead {
    eh_proj: W,
    enorm: CudaSlice<f32>,
    hnorm: CudaSlice<f32>,
    shared_head_norm: CudaSlice<f32>,
    /// `nextn.embed_tokens`, else the trunk's table.
    embed: Option<Matrix>,
    /// `nextn.shared_head_head`, else the trunk's head.
    head: Option<Matrix>,
    block: Layer,
    /// The last entry's logits.
    logits: CudaSlice<f32>,
    /// The entries' output states, [`PROMPT_ROWS`] rows.
    out: CudaSlice<f32>,
}

/// One sequence's NextN cache on the GPU (the head block's K and V), with the head's step graphs
/// captured over it.
pub struct Qwen35NextNCache {
    kv: KvLayer,
    ctx_len: usize,
    /// Entries the cache holds.
    pos: usize,
    /// Per entry count (index `rows - 1`), the head's step graph.
    graphs: Vec<Option<Graph>>,
}

impl Qwen35NextNCache {
    /// Entries held.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

    /// Forgets every entry from `len` on (O(1): a KV cache, no recurrent state).
    pub fn truncate(&mut self, len: usize) {
        self.pos = self.pos.min(len);
    }
}

/// Qwen3.5 on the GPU: weights and the step's buffers, shared by every sequence (steps run one at
/// a time on the model's stream). Each sequence holds a [`Qwen35Cache`].
pub struct Qwen35Gpu {
    cfg: Qwen35Config,
    max_ctx: usize,
    prompt_rows: usize,
    stream: Arc<CudaStream>,
    step: std::sync::Mutex<StepBlock>,
    kernels: Kernels,
    embd: Matrix,
    output: Option<Matrix>,
    output_norm: CudaSlice<f32>,
    inv_freq: CudaSlice<f32>,
    layers: Vec<Layer>,
    nextn: Option<NextNHead>,
    /// Per layer, its index among the attention layers' caches or the delta-net layers' states.
    slot: Vec<usize>,
    b: Buffers,
    /// Decode and verify steps run the conv and the delta rule as one launch
    /// (`conv_gated_delta_rule`); `TINE_GPU_FUSED_CONV=0` runs them as two (the same bits), to
    /// time one against the other.
    fused_conv: bool,
    /// The matrices are in the wide layout (`TINE_GPU_WIDE=0`: GGUF blocks).
    wide: bool,
    _ctx: Arc<CudaContext>,
}

/// Whose state a step's launches read and write: one sequence's, or a batched step's entries'
/// (through the batch's `kv_slots` and entry tables).
#[derive(Clone, Copy)]
enum StepKv<'a> {
    One(&'a Qwen35Cache),
    Batch(&'a GpuBatch),
}

impl<'a> StepKv<'a> {
    fn one(self) -> Option<&'a Qwen35Cache> {
        match self {
            StepKv::One(c) => Some(c),
            StepKv::Batch(_) => None,
        }
    }
}

/// One sequence's state on the GPU: the attention layers' K/V, the delta-net layers' state
/// planes, and the step graphs captured over them.
pub struct Qwen35Cache {
    /// Per attention layer, its K and V in the cache's stored types.
    kv: Vec<KvLayer>,
    /// Per delta-net layer: `[PLANES][kernel - 1][conv channels]`.
    conv: Vec<CudaSlice<f32>>,
    /// Per delta-net layer: `[PLANES][H_v][d][d]`.
    ssm: Vec<CudaSlice<f32>>,
    ctx_len: usize,
    /// The positions and which plane holds which position's state.
    ring: Ring,
    /// Which rows of this cache's last step the readout holds.
    last: LastStep,
    graphs: Vec<Option<Graph>>,
}

impl Qwen35Cache {
    /// Positions the sequence holds.
    pub fn len(&self) -> usize {
        self.ring.pos()
    }

    /// The types its attention layers' keys and values are stored in.
    pub fn types(&self) -> KvTypes {
        self.kv.first().map_or(KvTypes::F32, |l| l.types)
    }

    /// Positions it can hold.
    pub fn capacity(&self) -> usize {
        self.ctx_len
    }

    /// Device bytes its K and V take (the state planes apart).
    pub fn kv_bytes(&self) -> usize {
        self.kv.iter().map(KvLayer::bytes).sum()
    }

    /// Device bytes it holds: its K/V and its recurrent state planes.
    pub fn device_bytes(&self) -> usize {
        self.kv_bytes() + self.conv.iter().chain(&self.ssm).map(|p| p.len() * 4).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.pos() == 0
    }

    /// The longest prefix of at most `len` positions [`Qwen35Cache::truncate`] keeps: all of
    /// them at the end, `len` where a plane holds its state (the last step's rows, the last rows
    /// of a prompt), else 0.
    pub fn restorable(&self, len: usize) -> usize {
        self.ring.restorable(len)
    }

    /// Keeps the first `len` positions where [`Qwen35Cache::restorable`] allows it (O(1): the
    /// next step starts from the plane holding that state) and returns whether it did; otherwise
    /// nothing changes.
    pub fn truncate(&mut self, len: usize) -> bool {
        if len >= self.ring.pos() && !self.ring.broken() {
            return true;
        }
        if !self.ring.truncate(len) {
            return false;
        }
        self.last = LastStep::default();
        true
    }
}

impl Reader<'_> {
    /// Rows `[q | gate]` of each of `heads` heads of `hd` rows, split into the q rows and the
    /// gate rows (each head's in order), still quantized.
    fn split_q_gate(&mut self, name: &str, heads: usize, hd: usize, k: usize) -> Result<(W, W)> {
        let t = self.tensor(name)?;
        let wt = WeightType::from_ggml(t.dtype()).ok_or_else(|| Error::Unsupported { name: name.to_string(), dtype: t.dtype() })?;
        if t.shape().dims() != [2 * heads * hd, k] || !k.is_multiple_of(wt.block_values()) {
            return Err(self.model_err(format!("{name} has shape {:?} of {wt:?}, expected [{}, {k}]", t.shape().dims(), 2 * heads * hd)));
        }
        let data = t.data().map_err(|source| Error::Read { path: self.path.to_string(), source })?;
        let rb = wt.row_bytes(k);
        let (mut q, mut g) = (Vec::with_capacity(data.len() / 2), Vec::with_capacity(data.len() / 2));
        for h in 0..heads {
            q.extend_from_slice(&data[(2 * h * hd) * rb..(2 * h + 1) * hd * rb]);
            g.extend_from_slice(&data[(2 * h + 1) * hd * rb..(2 * h + 2) * hd * rb]);
        }
        Ok(((self.upload(&q, wt, k)?, wt), (self.upload(&g, wt, k)?, wt)))
    }

    /// Block `l`: a full-attention block when `full`, else a delta-net block.
    fn qwen35_layer(&mut self, cfg: &Qwen35Config, l: usize, full: bool) -> Result<Layer> {
        let p = |s: &str| format!("blk.{l}.{s}");
        let h = cfg.hidden;
        let mixer = if full {
            let (qd, kvd, hd) = (cfg.n_head * cfg.head_dim, cfg.n_kv * cfg.head_dim, cfg.head_dim);
            let (q, gate) = self.split_q_gate(&p("attn_q.weight"), cfg.n_head, hd, h)?;
            Mixer::Attention {
                q,
                gate,
                k: self.weight(&p("attn_k.weight"), kvd, h)?,
                v: self.weight(&p("attn_v.weight"), kvd, h)?,
                o: self.weight(&p("attn_output.weight"), h, qd)?,
                q_norm: self.norm(&p("attn_q_norm.weight"), hd)?,
                k_norm: self.norm(&p("attn_k_norm.weight"), hd)?,
            }
        } else {
            let (hv, d) = (cfg.n_v_heads, cfg.d_state);
            Mixer::DeltaNet {
                qkv: self.weight(&p("attn_qkv.weight"), cfg.conv_dim(), h)?,
                z: self.weight(&p("attn_gate.weight"), hv * d, h)?,
                beta: self.weight(&p("ssm_beta.weight"), hv, h)?,
                alpha: self.weight(&p("ssm_alpha.weight"), hv, h)?,
                conv: self.norm(&p("ssm_conv1d.weight"), cfg.conv_dim() * cfg.conv_kernel)?,
                dt_bias: self.norm(&p("ssm_dt.bias"), hv)?,
                a: self.norm(&p("ssm_a"), hv)?,
                norm: self.norm(&p("ssm_norm.weight"), d)?,
                out: self.weight(&p("ssm_out.weight"), h, hv * d)?,
            }
        };
        let ffn = match &cfg.moe {
            None => {
                let (gate, up) = (self.weight(&p("ffn_gate.weight"), cfg.ff, h)?, self.weight(&p("ffn_up.weight"), cfg.ff, h)?);
                if gate.1 != up.1 {
                    return Err(self.model_err(format!("blk.{l}: ffn_gate and ffn_up differ in type; the fused GLU reads one")));
                }
                Ffn::Dense { gate, up, down: self.weight(&p("ffn_down.weight"), h, cfg.ff)? }
            }
            Some(m) => {
                let fused = p("ffn_gate_up_exps.weight");
                let (gate_exps, up_exps) = if self.content.tensor_infos.contains_key(&fused) {
                    self.experts_split(&fused, m.experts, m.expert_ff, h)?
                } else {
                    (self.experts(&p("ffn_gate_exps.weight"), m.experts, m.expert_ff, h)?, self.experts(&p("ffn_up_exps.weight"), m.experts, m.expert_ff, h)?)
                };
                if gate_exps.1 != up_exps.1 {
                    return Err(self.model_err(format!("blk.{l}: the experts' gate and up differ in type; the fused GLU reads one")));
                }
                let shared =
                    (self.weight(&p("ffn_gate_shexp.weight"), m.shared_ff, h)?, self.weight(&p("ffn_up_shexp.weight"), m.shared_ff, h)?, self.weight(&p("ffn_down_shexp.weight"), h, m.shared_ff)?);
                if shared.0 .1 != shared.1 .1 {
                    return Err(self.model_err(format!("blk.{l}: ffn_gate_shexp and ffn_up_shexp differ in type; the fused GLU reads one")));
                }
                Ffn::Moe(Box::new(MoeFfn {
                    router: self.norm(&p("ffn_gate_inp.weight"), m.experts * h)?,
                    shared_gate: self.norm(&p("ffn_gate_inp_shexp.weight"), h)?,
                    down_exps: self.experts(&p("ffn_down_exps.weight"), m.experts, h, m.expert_ff)?,
                    gate_exps,
                    up_exps,
                    shared,
                }))
            }
        };
        Ok(Layer { attn_norm: self.norm(&p("attn_norm.weight"), h)?, post_norm: self.norm(&p("post_attention_norm.weight"), h)?, mixer, ffn })
    }

    /// The `n` matrices of `rows × cols` stacked in `name` (`[n, rows, cols]`), still quantized,
    /// in the engine's layout (a matrix of `n · rows` rows).
    pub(crate) fn experts(&mut self, name: &str, n: usize, rows: usize, cols: usize) -> Result<W> {
        let t = self.tensor(name)?;
        let wt = WeightType::from_ggml(t.dtype()).ok_or_else(|| Error::Unsupported { name: name.to_string(), dtype: t.dtype() })?;
        if t.shape().dims() != [n, rows, cols] || !cols.is_multiple_of(wt.block_values()) {
            return Err(self.model_err(format!("{name} has shape {:?} of {wt:?}, expected [{n}, {rows}, {cols}]", t.shape().dims())));
        }
        let data = t.data().map_err(|source| Error::Read { path: self.path.to_string(), source })?;
        Ok((self.upload(&data, wt, cols)?, wt))
    }

    /// The converter's fused `[n, 2 · rows, cols]` experts (each expert's gate rows, then its up
    /// rows) as the stacked gates and the stacked ups.
    pub(crate) fn experts_split(&mut self, name: &str, n: usize, rows: usize, cols: usize) -> Result<(W, W)> {
        let t = self.tensor(name)?;
        let wt = WeightType::from_ggml(t.dtype()).ok_or_else(|| Error::Unsupported { name: name.to_string(), dtype: t.dtype() })?;
        if t.shape().dims() != [n, 2 * rows, cols] || !cols.is_multiple_of(wt.block_values()) {
            return Err(self.model_err(format!("{name} has shape {:?} of {wt:?}, expected [{n}, {}, {cols}]", t.shape().dims(), 2 * rows)));
        }
        let data = t.data().map_err(|source| Error::Read { path: self.path.to_string(), source })?;
        let half = rows * wt.row_bytes(cols);
        let (mut g, mut u) = (Vec::with_capacity(data.len() / 2), Vec::with_capacity(data.len() / 2));
        for e in 0..n {
            g.extend_from_slice(&data[2 * e * half..(2 * e + 1) * half]);
            u.extend_from_slice(&data[(2 * e + 1) * half..(2 * e + 2) * half]);
        }
        Ok(((self.upload(&g, wt, cols)?, wt), (self.upload(&u, wt, cols)?, wt)))
    }
}

/// Whether `qwen35moe`'s experts run on the engine (`TINE_GPU_MOE=0`: such a file is refused
/// and runs on candle's CUDA path, to compare one with the other).
fn moe_on_engine() -> bool {
    std::env::var("TINE_GPU_MOE").map_or(true, |v| v != "0")
}

/// Whether the NextN head runs on the engine (`TINE_GPU_NEXTN=0`: [`Qwen35Gpu::new_nextn_cache`]
/// makes none and the runtime runs candle's head over the engine's hidden states).
fn nextn_on_engine() -> bool {
    std::env::var("TINE_GPU_NEXTN").map_or(true, |v| v != "0")
}

impl Qwen35Gpu {
    /// Loads a `qwen35` GGUF onto GPU `ordinal`, for caches of up to `max_ctx` positions.
    pub fn load(path: &Path, ordinal: usize, max_ctx: usize) -> Result<Qwen35Gpu> {
        let ctx_len = max_ctx.max(1);
        let shown = path.display().to_string();
        let read_err = |source| Error::Read { path: shown.clone(), source };
        let model_err = |what: String| Error::Model { path: shown.clone(), what };
        let mut file = File::open(path).map_err(|e| read_err(candle_core::Error::from(e)))?;
        let content = gguf_file::Content::read(&mut file).map_err(read_err)?;
        let embd_info = content.tensor_infos.get("token_embd.weight").ok_or_else(|| model_err("no token_embd.weight".into()))?;
        let cfg = Qwen35Config::from_metadata(&content.metadata, embd_info.shape.dims()[0]).map_err(model_err)?;
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
        let output = if content.tensor_infos.contains_key("output.weight") { Some(r.matrix("output.weight", cfg.vocab, cfg.hidden)?) } else { None };
        let output_norm = r.norm("output_norm.weight", cfg.hidden)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        let (mut n_attn, mut n_gdn, mut slot) = (0, 0, Vec::with_capacity(cfg.layers));
        for l in 0..cfg.layers {
            layers.push(r.qwen35_layer(&cfg, l, cfg.full_attention[l])?);
            let counter = if cfg.full_attention[l] { &mut n_attn } else { &mut n_gdn };
            slot.push(*counter);
            *counter += 1;
        }
        let nextn = match cfg.nextn_layers {
            0 => None,
            1 => {
                let l = cfg.layers;
                let h = cfg.hidden;
                let p = |s: &str| format!("blk.{l}.{s}");
                let opt = |r: &mut Reader, name: String| -> Result<Option<Matrix>> {
                    if content.tensor_infos.contains_key(&name) {
                        Ok(Some(r.matrix(&name, cfg.vocab, h)?))
                    } else {
                        Ok(None)
                    }
                };
                Some(NextNHead {
                    eh_proj: r.weight(&p("nextn.eh_proj.weight"), h, 2 * h)?,
                    enorm: r.norm(&p("nextn.enorm.weight"), h)?,
                    hnorm: r.norm(&p("nextn.hnorm.weight"), h)?,
                    shared_head_norm: r.norm(&p("nextn.shared_head_norm.weight"), h)?,
                    embed: opt(&mut r, p("nextn.embed_tokens.weight"))?,
                    head: opt(&mut r, p("nextn.shared_head_head.weight"))?,
                    block: r.qwen35_layer(&cfg, l, true)?,
                    logits: alloc(&stream, cfg.vocab)?,
                    out: alloc(&stream, PROMPT_ROWS * h)?,
                })
            }
            n => return Err(model_err(format!("qwen35.nextn_predict_layers = {n}: the engine runs one NextN head"))),
        };
        let (qd, kvd, c, vd) = (cfg.n_head * cfg.head_dim, cfg.n_kv * cfg.head_dim, cfg.conv_dim(), cfg.n_v_heads * cfg.d_state);
        // A NextN step's rows are [enorm(e); hnorm(h)]: 2 * hidden values.
        let (used, fe, fs) = cfg.moe.map_or((0, 0, 0), |m| (m.used, m.expert_ff, m.shared_ff));
        // The Q8 rows hold the widest row any GEMV reads (the experts' rows: `used` a token).
        let kmax = cfg.hidden.max(cfg.ff).max(qd).max(vd).max(if nextn.is_some() { 2 * cfg.hidden } else { 0 }).max(used * fe).max(fs);
        if cfg.moe.is_some() && !moe_on_engine() {
            return Err(model_err("qwen35moe's experts are off the engine (TINE_GPU_MOE=0)".into()));
        }
        if cfg.moe.is_some() && !wide {
            return Err(model_err("the experts' GEMV reads the wide layout: TINE_GPU_WIDE=0 is for dense models".into()));
        }
        let chunks_max = Kernels::attn_chunks_max(ctx_len, 0);
        let m = PROMPT_ROWS;
        let b = Buffers {
            h: alloc(&stream, m * cfg.hidden)?,
            hid: alloc(&stream, m * cfg.hidden)?,
            x1: alloc(&stream, m * c.max(qd))?,
            x2: alloc(&stream, m * vd.max(qd))?,
            k: alloc(&stream, m * kvd)?,
            v: alloc(&stream, m * kvd)?,
            conv: alloc(&stream, m * c)?,
            alpha: alloc(&stream, m * cfg.n_v_heads)?,
            beta: alloc(&stream, m * cfg.n_v_heads)?,
            o: alloc(&stream, m * vd)?,
            mix: alloc(&stream, m * cfg.hidden)?,
            ff: alloc(&stream, m * cfg.ff.max(fs))?,
            down: alloc(&stream, m * cfg.hidden)?,
            qs: alloc(&stream, m * kmax)?,
            qd: alloc(&stream, m * kmax / QK)?,
            qsum: alloc(&stream, m * kmax / QK)?,
            partials: alloc(&stream, MAX_ROWS * cfg.n_head * chunks_max * (cfg.head_dim + 2))?,
            attn_counters: alloc(&stream, MAX_ROWS * cfg.n_head)?,
            stage: alloc(&stream, m * 2 * kvd)?,
            xn: alloc(&stream, if used > 0 { m * cfg.hidden } else { 1 })?,
            moe_ids: alloc(&stream, (m * used).max(1))?,
            moe_wts: alloc(&stream, (m * used).max(1))?,
            moe_list: alloc(&stream, (cfg.moe.as_ref().map_or(0, |mc| mc.experts) * m).max(1))?,
            moe_counts: alloc(&stream, cfg.moe.as_ref().map_or(1, |mc| mc.experts))?,
            moe_logits: alloc(&stream, if used > 0 { m * (cfg.moe.as_ref().map_or(0, |mc| mc.experts) + 1) } else { 1 })?,
            sgate: alloc(&stream, m.max(1))?,
            ffx: alloc(&stream, (m * used * fe).max(1))?,
            ydn: alloc(&stream, (m * used * cfg.hidden).max(1))?,
            out: Readout::new(&stream, cfg.vocab)?,
        };
        let hin = alloc(&stream, if nextn.is_some() { m * cfg.hidden } else { 1 })?;
        let step = std::sync::Mutex::new(StepBlock { params: alloc(&stream, 1)?, tokens: alloc(&stream, m)?, hin });
        let inv_freq = stream.clone_htod(&inv_freq(cfg.rope_dim.max(2), cfg.rope_base))?;
        stream.synchronize()?;
        Ok(Qwen35Gpu {
            cfg,
            max_ctx: ctx_len,
            prompt_rows: m,
            stream,
            step,
            kernels,
            embd,
            output,
            output_norm,
            inv_freq,
            layers,
            nextn,
            slot,
            b,
            fused_conv: std::env::var("TINE_GPU_FUSED_CONV").map_or(true, |v| v != "0"),
            wide,
            _ctx: ctx,
        })
    }

    pub fn config(&self) -> &Qwen35Config {
        &self.cfg
    }

    /// The GPU's free and total memory in bytes (the driver's `cuMemGetInfo`).
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok(self._ctx.mem_get_info()?)
    }

    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    pub fn prompt_rows(&self) -> usize {
        self.prompt_rows
    }

    /// An empty sequence state of `ctx_len` positions (at most [`Qwen35Gpu::max_ctx`]): no K/V,
    /// zero conv windows and delta states.
    pub fn new_cache(&self, ctx_len: usize) -> Result<Qwen35Cache> {
        self.new_cache_typed(ctx_len, KvTypes::F32)
    }

    /// [`Qwen35Gpu::new_cache`] storing the attention layers' keys and values as `types` (the
    /// delta-net states stay f32).
    pub fn new_cache_typed(&self, ctx_len: usize, types: KvTypes) -> Result<Qwen35Cache> {
        let c = &self.cfg;
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let (mut kv, mut conv, mut ssm) = (Vec::new(), Vec::new(), Vec::new());
        for &full in &c.full_attention {
            if full {
                kv.push(KvLayer::new(&self.stream, types, c.n_kv, ctx_len, c.head_dim)?);
            } else {
                conv.push(alloc(&self.stream, PLANES * (c.conv_kernel - 1) * c.conv_dim())?);
                ssm.push(alloc(&self.stream, PLANES * c.n_v_heads * c.d_state * c.d_state)?);
            }
        }
        Ok(Qwen35Cache { kv, conv, ssm, ctx_len, ring: Ring::new(), last: LastStep::default(), graphs: (0..2 * MAX_ROWS).map(|_| None).collect() })
    }

    /// Bytes of one sequence's recurrent state planes (every delta-net layer's [`PLANES`]).
    pub fn state_bytes(&self) -> usize {
        let c = &self.cfg;
        let gdn = c.full_attention.iter().filter(|&&f| !f).count();
        gdn * PLANES * ((c.conv_kernel - 1) * c.conv_dim() + c.n_v_heads * c.d_state * c.d_state) * 4
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

    /// `norm_quant` over the step's rows into the Q8 planes: `mode` 0 (plain, `a`), 2 (the
    /// embedding row) or 3 (`h += a`, the residual stream `b.h` written back), normed by `w`
    /// when it is set.
    fn nq(&self, step: DevPtr, prompt: Option<DevPtr>, a: DevPtr, mode: i32, k: usize, w: DevPtr) -> NormQuantArgs {
        let b = &self.b;
        NormQuantArgs {
            a,
            res: self.ptr(&b.h),
            w_a: 0,
            embd: self.ptr(&self.embd.buf),
            embd_scale: 1.0,
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

    /// The launches of one step of `rows` rows over `cache` (what a graph captures); without
    /// `head`, the trunk alone. With `prompt` (the address of the step's token ids), a prompt
    /// step of up to [`PROMPT_ROWS`] rows, the head on its last row.
    /// `mark` is called after each launch with what it does (the profile's events).
    fn launch_step(&self, cache: &Qwen35Cache, step: DevPtr, rows: usize, head: bool, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<(), GpuError> {
        self.launch_rows(StepKv::One(cache), step, rows, head, prompt, mark)
    }

    /// A GEMV of `rows` rows: with `batched` (a batched step's) past 8 rows as groups of 8, each
    /// row as its one-row launch computes it; otherwise [`Kernels::gemv`] (the prompt GEMM past
    /// 8 rows).
    ///
    /// # Safety
    /// As [`Kernels::gemv`]'s.
    unsafe fn gemv_any(&self, batched: bool, rows: usize, k: usize, segs: &[GemvSeg], act: (DevPtr, DevPtr, DevPtr)) -> std::result::Result<(), GpuError> {
        if batched && rows > MAX_ROWS {
            self.kernels.gemv_rows(&self.stream, rows, k, segs, act)
        } else {
            self.kernels.gemv(&self.stream, rows, k, segs, act)
        }
    }

    /// [`Qwen35Gpu::launch_step`] over one sequence's state, or a batched step's rows over their
    /// entries' (`StepKv::Batch`: the tokens from the batch's block, each attention layer's K/V
    /// through its `kv_slots` table, each delta-net layer's state through the entry table, one
    /// block row per entry, the GEMVs of more than 8 rows as groups of 8, the head on every row
    /// into the batch's readout).
    fn launch_rows(&self, kv_of: StepKv<'_>, step: DevPtr, rows: usize, head: bool, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<(), GpuError> {
        let c = &self.cfg;
        let b = &self.b;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let (s, k) = (&self.stream, &self.kernels);
        let act = self.act(0, 0);
        let (vd, conv_dim) = (c.n_v_heads * c.d_state, c.conv_dim());
        let batch = match kv_of {
            StepKv::Batch(bt) => Some(bt),
            StepKv::One(_) => None,
        };
        let batched = batch.is_some();
        // The token ids of the rows, where they are not the step block's: a prompt's, a batch's.
        let tokens = prompt.or(batch.map(|bt| self.ptr(&bt.tokens)));
        // SAFETY: every buffer was allocated at load for PROMPT_ROWS rows of its width (the logits
        // and argmax scratch for MAX_ROWS; `step` keeps rows <= MAX_ROWS unless `prompt`, whose
        // head runs on one row), the caches for ctx_len positions and PLANES planes; `step`
        // checks that the step's positions are below ctx_len and its plane below PLANES.
        unsafe {
            for (l, ly) in self.layers.iter().enumerate() {
                let first = if l == 0 { self.nq(step, tokens, 0, 2, c.hidden, p(&ly.attn_norm)) } else { self.nq(step, tokens, p(&b.down), 3, c.hidden, p(&ly.attn_norm)) };
                k.norm_quant(s, rows, &first)?;
                mark("norm_quant")?;
                let i = self.slot[l];
                match &ly.mixer {
                    Mixer::DeltaNet { qkv, z, beta, alpha, conv, dt_bias, a, norm, out } => {
                        let segs = [self.seg(qkv, &b.x1, conv_dim), self.seg(z, &b.x2, vd), self.seg(beta, &b.beta, c.n_v_heads), self.seg(alpha, &b.alpha, c.n_v_heads)];
                        self.gemv_any(batched, rows, c.hidden, &segs, act)?;
                        mark("gemv qkv·z·beta·alpha")?;
                        let ca = ConvArgs {
                            x: p(&b.x1),
                            w: p(conv),
                            planes: kv_of.one().map_or(0, |cache| p(&cache.conv[i])),
                            y: p(&b.conv),
                            step,
                            c: conv_dim as i32,
                            k: c.conv_kernel as i32,
                            n_planes: PLANES as i32,
                            rows: rows as i32,
                        };
                        let ga = GdnArgs {
                            qkv: p(&b.conv),
                            alpha: p(&b.alpha),
                            beta: p(&b.beta),
                            dt_bias: p(dt_bias),
                            a: p(a),
                            planes: kv_of.one().map_or(0, |cache| p(&cache.ssm[i])),
                            out: p(&b.o),
                            step,
                            hk: c.n_k_heads as i32,
                            hv: c.n_v_heads as i32,
                            d: c.d_state as i32,
                            n_planes: PLANES as i32,
                            rows: rows as i32,
                            eps: c.eps,
                            q_scale: 1.0 / (c.d_state as f32).sqrt(),
                            pad_: 0,
                        };
                        // A decode or verify step: one launch; a prompt step: two (the fused
                        // kernel takes fewer rows than the planes).
                        if let Some(bt) = batch {
                            // Each entry's rows over its own state (block z: entry z; the
                            // step's padded row count bounds the entries, rows 1 the check's).
                            let one = |mut x: ConvGdnArgs| {
                                x.conv.rows = 1;
                                x.gdn.rows = 1;
                                x
                            };
                            let args = one(ConvGdnArgs { conv: ca, gdn: ga, ent_rows: bt.ent_rows(s), ent_planes: bt.ent_planes(s, i, rows) });
                            k.conv_gated_delta_rule_entries(s, &args, rows)?;
                            mark("conv_gated_delta_rule")?;
                        } else if prompt.is_none() && self.fused_conv {
                            k.conv_gated_delta_rule(s, &ConvGdnArgs { conv: ca, gdn: ga, ent_rows: 0, ent_planes: 0 })?;
                            mark("conv_gated_delta_rule")?;
                        } else {
                            k.conv_silu(s, &ca)?;
                            mark("conv_silu")?;
                            k.gated_delta_rule(s, &ga)?;
                            mark("gated_delta_rule")?;
                        }
                        let na = GatedNormArgs { o: p(&b.o), z: p(&b.x2), w: p(norm), qs: act.0, qd: act.1, qsum: act.2, hv: c.n_v_heads as i32, d: c.d_state as i32, eps: c.eps, pad_: 0 };
                        k.gated_norm_quant(s, rows, &na)?;
                        mark("gated_norm_quant")?;
                        self.gemv_any(batched, rows, vd, &[self.seg(out, &b.mix, c.hidden)], act)?;
                        mark("gemv ssm_out")?;
                    }
                    Mixer::Attention { .. } => match kv_of {
                        StepKv::One(cache) => self.launch_attention(&ly.mixer, cache.kv[i].ptrs(&self.stream), cache.ctx_len, step, rows, prompt, None, mark)?,
                        // The caches' pointers come from the table; the launch's own are never read.
                        StepKv::Batch(bt) => {
                            let kv = KvPtrs { k: 0, v: 0, types: bt.types() };
                            self.launch_attention(&ly.mixer, kv, bt.capacity(), step, rows, None, Some((bt, bt.kv_slots(s, i, rows))), mark)?
                        }
                    },
                }
                self.launch_mlp(ly, step, rows, prompt, batched, mark)?;
            }
            let last = NormQuantArgs { y_out: p(&b.hid), ..self.nq(step, tokens, p(&b.down), 3, c.hidden, p(&self.output_norm)) };
            k.norm_quant(s, rows, &last)?;
            mark("norm_quant")?;
            if !head {
                return Ok(());
            }
            let out = self.output.as_ref().unwrap_or(&self.embd);
            let (head_rows, act) = match prompt {
                None => (rows, self.act(0, c.hidden)),
                Some(_) => (1, self.act(rows - 1, c.hidden)),
            };
            let readout = batch.map_or(&b.out, |bt| &bt.out);
            let seg =
                GemvSeg { w: self.ptr(&out.buf), out: self.ptr(&readout.logits), n: c.vocab as i32, wtype: out.wt.ggml_id(), out_stride: c.vocab as i32, wide: out.wide as i32, ..Default::default() };
            self.gemv_any(batched, head_rows, c.hidden, &[seg], act)?;
            mark("lm head")?;
            k.argmax(s, head_rows, &readout.argmax_args(s, step))?;
            mark("argmax")?;
        }
        Ok(())
    }

    /// A full-attention mixer over the K/V at `kv` (a cache of `ctx_len` positions), its input the
    /// step's Q8 rows: the GEMV of q, its gate, k and v; `qk_norm_rope_kv`; the attention with the
    /// `sigmoid(gate)` epilogue; `attn_output` into `b.mix`. 4 launches.
    ///
    /// # Safety
    /// As [`Qwen35Gpu::launch_step`]'s: the buffers hold the step's rows, the cache its positions.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_attention(
        &self,
        mixer: &Mixer,
        kv: KvPtrs,
        ctx_len: usize,
        step: DevPtr,
        rows: usize,
        prompt: Option<DevPtr>,
        batch: Option<(&GpuBatch, DevPtr)>,
        mark: &mut Mark,
    ) -> std::result::Result<(), GpuError> {
        let batched = batch.is_some();
        let kv_slots = batch.map_or(0, |b| b.1);
        let Mixer::Attention { q, gate, k: wk, v: wv, o, q_norm, k_norm } = mixer else { unreachable!("called on attention blocks only") };
        let (c, b, s, k) = (&self.cfg, &self.b, &self.stream, &self.kernels);
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let act = self.act(0, 0);
        let (qd, kvd) = (c.n_head * c.head_dim, c.n_kv * c.head_dim);
        let segs = [self.seg(q, &b.x1, qd), self.seg(gate, &b.x2, qd), self.seg(wk, &b.k, kvd), self.seg(wv, &b.v, kvd)];
        self.gemv_any(batched, rows, c.hidden, &segs, act)?;
        mark("gemv q·gate·k·v")?;
        let rope = RopeArgs {
            q: p(&b.x1),
            k: p(&b.k),
            v: p(&b.v),
            q_norm: p(q_norm),
            k_norm: p(k_norm),
            eps: c.eps,
            inv_freq: p(&self.inv_freq),
            q_scale: 1.0 / (c.head_dim as f32).sqrt(),
            k_cache: kv.k,
            v_cache: kv.v,
            ctx: ctx_len as i32,
            step,
            n_head: c.n_head as i32,
            n_kv: c.n_kv as i32,
            hd: c.head_dim as i32,
            n_rot: c.rope_dim as i32,
            v_norm: 0,
            v_from_k: 0,
            k_type: kv.types.k.kernel_id(),
            v_type: kv.types.v.kernel_id(),
            kv_slots,
            stage: p(&b.stage),
            turbo: self.kernels.turbo_tab(&self.stream),
        };
        k.qk_norm_rope_kv(s, rows, &rope)?;
        mark("qk_norm_rope_kv")?;
        let at = AttnArgs {
            q: p(&b.x1),
            k_cache: kv.k,
            v_cache: kv.v,
            out: 0,
            partials: batch.map_or(p(&b.partials), |b| self.ptr(&b.0.partials)),
            counters: batch.map_or(self.ptr(&b.attn_counters), |b| self.ptr(&b.0.counters)),
            step,
            qs: act.0,
            qd: act.1,
            qsum: act.2,
            ctx: ctx_len as i32,
            window: 0,
            n_head: c.n_head as i32,
            n_kv: c.n_kv as i32,
            chunks_max: Kernels::attn_chunks_max(ctx_len, 0) as i32,
            gate: p(&b.x2),
            k_type: kv.types.k.kernel_id(),
            v_type: kv.types.v.kernel_id(),
            kv_slots,
            turbo: self.kernels.turbo_tab(&self.stream),
        };
        match prompt {
            Some(_) => k.attention_prompt(s, rows, c.head_dim, &at)?,
            None => k.attention(s, rows, c.head_dim, &at)?,
        }
        mark("attention")?;
        self.gemv_any(batched, rows, qd, &[self.seg(o, &b.mix, c.hidden)], act)?;
        mark("gemv attn_output")?;
        Ok(())
    }

    /// A block's second half: `x += mix` with `post_attention_norm(x)` as Q8, then the
    /// feed-forward into `b.down`: the SwiGLU GEMV, its rows as Q8, `down` (4 launches); or
    /// `qwen35moe`'s experts (10 launches; 11 in a prompt step, which lists the pairs by expert and
    /// runs a GEMM per expert): the router's logits over the normed rows and the
    /// routing from them, the shared expert's
    /// and the routed experts' gate·up, each as Q8 rows in turn and its down projection, and
    /// their weighted sum.
    ///
    /// # Safety
    /// As [`Qwen35Gpu::launch_step`]'s.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_mlp(&self, ly: &Layer, step: DevPtr, rows: usize, prompt: Option<DevPtr>, batched: bool, mark: &mut Mark) -> std::result::Result<(), GpuError> {
        let (c, b, s, k) = (&self.cfg, &self.b, &self.stream, &self.kernels);
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let act = self.act(0, 0);
        let glu = |g: &W, u: &W, out: &CudaSlice<f32>, n: usize| GemvSeg {
            w: self.ptr(&g.0),
            w2: self.ptr(&u.0),
            out: p(out),
            n: n as i32,
            wtype: g.1.ggml_id(),
            out_stride: n as i32,
            glu: 2,
            block_start: 0,
            wide: self.wide as i32,
        };
        match &ly.ffn {
            Ffn::Dense { gate, up, down } => {
                k.norm_quant(s, rows, &self.nq(step, prompt, p(&b.mix), 3, c.hidden, p(&ly.post_norm)))?;
                mark("norm_quant")?;
                self.gemv_any(batched, rows, c.hidden, &[glu(gate, up, &b.ff, c.ff)], act)?;
                mark("gemv gate·up")?;
                k.norm_quant(s, rows, &self.nq(step, prompt, p(&b.ff), 0, c.ff, 0))?;
                mark("norm_quant")?;
                self.gemv_any(batched, rows, c.ff, &[self.seg(down, &b.down, c.hidden)], act)?;
                mark("gemv down")?;
            }
            Ffn::Moe(e) => {
                let mc = c.moe.expect("a MoE block in a qwen35moe model");
                let (h, used, fe, fs) = (c.hidden, mc.used, mc.expert_ff, mc.shared_ff);
                let pairs = rows * used;
                k.norm_quant(s, rows, &NormQuantArgs { y_out: p(&b.xn), ..self.nq(step, prompt, p(&b.mix), 3, h, p(&ly.post_norm)) })?;
                mark("norm_quant")?;
                let ra = MoeRouterArgs {
                    x: p(&b.xn),
                    router: p(&e.router),
                    shared_gate: p(&e.shared_gate),
                    ids: self.ptr(&b.moe_ids),
                    wts: p(&b.moe_wts),
                    sgate: p(&b.sgate),
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
                self.gemv_any(batched, rows, h, &[glu(&e.shared.0, &e.shared.1, &b.ff, fs)], act)?;
                mark("gemv shared gate·up")?;
                let bytes = |w: &W, n: usize, k: usize| n * w.1.wide_row_bytes(k);
                // A prompt step runs a GEMM per expert, decode and verify steps a GEMV per pair
                // (Kernels::moe_gemv); both are marked with gemv_moe's names.
                let (grouped, ids, sorted) = (prompt.is_some(), self.ptr(&b.moe_ids), (self.ptr(&b.moe_list), self.ptr(&b.moe_counts)));
                k.moe_gemv(s, grouped, rows, mc.experts, used, h, glu(&e.gate_exps, &e.up_exps, &b.ffx, fe), act, ids, sorted, bytes(&e.gate_exps, fe, h), false)?;
                mark("gemv_moe gate·up")?;
                k.norm_quant(s, rows, &self.nq(step, prompt, p(&b.ff), 0, fs, 0))?;
                mark("norm_quant")?;
                self.gemv_any(batched, rows, fs, &[self.seg(&e.shared.2, &b.mix, h)], act)?;
                mark("gemv shared down")?;
                k.norm_quant(s, pairs, &self.nq(step, prompt, p(&b.ffx), 0, fe, 0))?;
                mark("norm_quant")?;
                k.moe_gemv(s, grouped, rows, mc.experts, used, fe, self.seg(&e.down_exps, &b.ydn, h), act, ids, sorted, bytes(&e.down_exps, h, fe), true)?;
                mark("gemv_moe down")?;
                let ca = MoeCombineArgs { y: p(&b.ydn), wts: p(&b.moe_wts), shared: p(&b.mix), sgate: p(&b.sgate), out: p(&b.down), k: h as i32, used: used as i32, ids: 0, escale: 0 };
                k.moe_combine(s, rows, &ca)?;
                mark("moe_combine")?;
            }
        }
        Ok(())
    }

    /// The launches of a NextN step of `rows` entries over `cache` (what its graph captures):
    /// the entries' input hidden states at `hin`, their next tokens in the step block (or, with
    /// `prompt`, at that address). `[enorm(E[x]); hnorm(h)]` as the two halves of each row's Q8
    /// activations, `eh_proj`, `attn_norm` with the residual, the block (the attention mixer and
    /// the MLP), `shared_head_norm` of `x + down` (the output states, kept as f32), and the head's
    /// projection of the last entry. 14 launches.
    #[allow(clippy::too_many_arguments)]
    fn launch_nextn(&self, head: &NextNHead, cache: &Qwen35NextNCache, step: DevPtr, hin: DevPtr, rows: usize, prompt: Option<DevPtr>, mark: &mut Mark) -> std::result::Result<(), GpuError> {
        let (c, b, s, k) = (&self.cfg, &self.b, &self.stream, &self.kernels);
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let h = c.hidden;
        let embd = head.embed.as_ref().unwrap_or(&self.embd);
        // SAFETY: as launch_step's: the buffers hold prompt_rows rows (the activation planes
        // 2 * hidden values a row, kmax at load), the head's cache ctx_len positions past the
        // step's (checked by nextn_forward), its logits `vocab` values and its output states
        // prompt_rows rows.
        unsafe {
            let e = NormQuantArgs { embd: self.ptr(&embd.buf), embd_type: embd.embd_type(), res_out: 0, q_stride: (2 * h) as i32, q_off: 0, ..self.nq(step, prompt, 0, 2, h, p(&head.enorm)) };
            k.norm_quant(s, rows, &e)?;
            mark("norm_quant enorm")?;
            let hh = NormQuantArgs { q_stride: (2 * h) as i32, q_off: h as i32, ..self.nq(step, prompt, hin, 0, h, p(&head.hnorm)) };
            k.norm_quant(s, rows, &hh)?;
            mark("norm_quant hnorm")?;
            k.gemv(s, rows, 2 * h, &[self.seg(&head.eh_proj, &b.mix, h)], self.act(0, 0))?;
            mark("gemv eh_proj")?;
            let x = NormQuantArgs { res_out: p(&b.h), ..self.nq(step, prompt, p(&b.mix), 0, h, p(&head.block.attn_norm)) };
            k.norm_quant(s, rows, &x)?;
            mark("norm_quant")?;
            self.launch_attention(&head.block.mixer, cache.kv.ptrs(&self.stream), cache.ctx_len, step, rows, prompt, None, mark)?;
            self.launch_mlp(&head.block, step, rows, prompt, false, mark)?;
            let last = NormQuantArgs { y_out: p(&head.out), ..self.nq(step, prompt, p(&b.down), 3, h, p(&head.shared_head_norm)) };
            k.norm_quant(s, rows, &last)?;
            mark("norm_quant shared_head_norm")?;
            let out = head.head.as_ref().or(self.output.as_ref()).unwrap_or(&self.embd);
            let seg = GemvSeg { w: self.ptr(&out.buf), out: p(&head.logits), n: c.vocab as i32, wtype: out.wt.ggml_id(), out_stride: c.vocab as i32, wide: out.wide as i32, ..Default::default() };
            k.gemv(s, 1, h, &[seg], self.act(rows - 1, h))?;
            mark("nextn head")?;
        }
        Ok(())
    }

    /// Whether the model carries a NextN head (`qwen35.nextn_predict_layers = 1`).
    pub fn has_nextn(&self) -> bool {
        self.nextn.is_some()
    }

    /// An empty NextN cache of `ctx_len` entries (at most [`Qwen35Gpu::max_ctx`]), if the model
    /// has a NextN head.
    pub fn new_nextn_cache(&self, ctx_len: usize) -> Result<Option<Qwen35NextNCache>> {
        self.new_nextn_cache_typed(ctx_len, KvTypes::F32)
    }

    /// [`Qwen35Gpu::new_nextn_cache`] storing the head's keys and values as `types`.
    pub fn new_nextn_cache_typed(&self, ctx_len: usize, types: KvTypes) -> Result<Option<Qwen35NextNCache>> {
        if self.nextn.is_none() || !nextn_on_engine() {
            return Ok(None);
        }
        let ctx_len = ctx_len.clamp(1, self.max_ctx);
        let kv = KvLayer::new(&self.stream, types, self.cfg.n_kv, ctx_len, self.cfg.head_dim)?;
        Ok(Some(Qwen35NextNCache { kv, ctx_len, pos: 0, graphs: (0..MAX_ROWS).map(|_| None).collect() }))
    }

    /// Runs the NextN head over entries `cache.len()..` (1..=[`Qwen35Gpu::prompt_rows`] of
    /// them): `hidden` holds their input hidden states (`rows × hidden`: the trunk's after the
    /// output norm, or the head's own output states when chaining) and `tokens` the token after
    /// each. Returns the last entry's logits and every entry's output state (`rows × hidden`,
    /// after `shared_head_norm`). Steps of up to [`MAX_ROWS`] entries replay a graph captured per
    /// entry count; longer ones launch directly with the prompt kernels.
    pub fn nextn_forward(&self, cache: &mut Qwen35NextNCache, hidden: &[f32], tokens: &[u32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let rows = tokens.len();
        let fail = |what: String| Error::Step { rows, pos: cache.pos, what };
        let Some(head) = self.nextn.as_ref() else { return Err(fail("this model has no NextN head".into())) };
        // Entry j sits at position j + 1 (its K/V in slot j): RoPE one position further.
        let params = nextn_params(cache.pos, cache.ctx_len, self.prompt_rows, self.cfg.hidden, self.cfg.vocab, hidden, tokens, 1).map_err(fail)?;
        let mut block = self.step.lock().expect("a step panicked holding the step block");
        // Ordered on the stream after the previous step, which may still read the block and hin.
        self.stream.memcpy_htod(&[params][..], &mut block.params)?;
        // hin holds prompt_rows rows when the model has a head; rows <= prompt_rows (checked above).
        self.stream.memcpy_htod(hidden, &mut block.hin.slice_mut(..hidden.len()))?;
        let (step, hin) = (self.ptr(&block.params), self.ptr(&block.hin));
        if rows <= MAX_ROWS {
            let mut slot = cache.graphs[rows - 1].take();
            let replayed = Graph::replay(&self.stream, &mut slot, || self.launch_nextn(head, cache, step, hin, rows, None, &mut |_| Ok(())), || fail("the capture made no graph".into()));
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
        let mut logits = vec![0f32; self.cfg.vocab];
        self.stream.memcpy_dtoh(&head.logits, &mut logits[..])?;
        let mut out = vec![0f32; hidden.len()];
        self.stream.memcpy_dtoh(&head.out.slice(..hidden.len()), &mut out[..])?;
        self.stream.synchronize()?;
        Ok((logits, out))
    }

    /// Kernel launches (graph nodes) of a NextN step of `rows` entries.
    pub fn nextn_graph_nodes(&self, cache: &mut Qwen35NextNCache, rows: usize) -> Result<usize> {
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
    pub fn graph_nodes(&self, cache: &mut Qwen35Cache, rows: usize) -> Result<usize> {
        if !(1..=MAX_ROWS).contains(&rows) {
            return Err(Error::Step { rows, pos: cache.ring.pos(), what: format!("a graph is captured for 1 to {MAX_ROWS} rows") });
        }
        let step = self.ptr(&self.step.lock().expect("a step panicked holding the step block").params);
        self.capture(cache, step, rows, true)?;
        let g = &cache.graphs[rows - 1].as_ref().expect("captured just above").0;
        let mut n = 0usize;
        // SAFETY: counting the nodes of a live graph (a null array asks for the count only).
        unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) }.result()?;
        Ok(n)
    }

    fn capture(&self, cache: &mut Qwen35Cache, step: DevPtr, rows: usize, head: bool) -> Result<()> {
        let at = if head { rows - 1 } else { MAX_ROWS + rows - 1 };
        if cache.graphs[at].is_none() {
            self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let launched = self.launch_step(cache, step, rows, head, None, &mut |_| Ok(()));
            let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            launched?;
            let graph = graph?.ok_or_else(|| Error::Step { rows, pos: cache.ring.pos(), what: "the capture made no graph".into() })?;
            graph.upload()?;
            cache.graphs[at] = Some(Graph(graph));
        }
        Ok(())
    }

    /// Runs `tokens` (1..=8) at `cache`'s next positions; their logits and greedy ids are ready
    /// for [`Qwen35Gpu::logits`] and [`Qwen35Gpu::argmax`] until the next step of any cache.
    pub fn forward(&self, cache: &mut Qwen35Cache, tokens: &[u32]) -> Result<()> {
        self.step(cache, tokens, &[], true)
    }

    /// [`Qwen35Gpu::forward`] with the greedy ids passing over `banned` (at most [`MAX_BANNED`]).
    pub fn forward_banning(&self, cache: &mut Qwen35Cache, tokens: &[u32], banned: &[u32]) -> Result<()> {
        self.step(cache, tokens, banned, true)
    }

    /// Runs `tokens` (1..=[`Qwen35Gpu::prompt_rows`]) through the trunk alone (no LM head).
    pub fn forward_trunk(&self, cache: &mut Qwen35Cache, tokens: &[u32]) -> Result<()> {
        self.step(cache, tokens, &[], false)
    }

    /// Runs a prompt's `tokens` (1..=[`Qwen35Gpu::prompt_rows`]): the last row's logits and id
    /// (every row's for steps of up to [`MAX_ROWS`]).
    pub fn forward_prompt(&self, cache: &mut Qwen35Cache, tokens: &[u32]) -> Result<()> {
        self.step(cache, tokens, &[], true)
    }

    fn step(&self, cache: &mut Qwen35Cache, tokens: &[u32], banned: &[u32], head: bool) -> Result<()> {
        self.step_marked(cache, tokens, banned, head, &mut |_| Ok(()), false)
    }

    /// Runs `tokens` as one step launched directly (no graph) with an event after each launch,
    /// and returns each kind of launch's device time in microseconds, summed over the step, in
    /// the order first launched (the events keep launches apart, so the sum is somewhat above a
    /// graph step's time).
    pub fn profile(&self, cache: &mut Qwen35Cache, tokens: &[u32]) -> Result<Vec<(&'static str, f64)>> {
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

    /// One step; `eager` launches it directly (no graph, the prompt kernels for more than
    /// [`MAX_ROWS`] rows), calling `mark` once before the launches ("start") and after each.
    fn step_marked(&self, cache: &mut Qwen35Cache, tokens: &[u32], banned: &[u32], head: bool, mark: &mut Mark, eager: bool) -> Result<()> {
        let rows = tokens.len();
        let fail = |what: String| Error::Step { rows, pos: cache.ring.pos(), what };
        if !(1..=self.prompt_rows).contains(&rows) {
            return Err(fail(format!("a step takes 1 to {} tokens", self.prompt_rows)));
        }
        if cache.ring.pos() + rows > cache.ctx_len {
            return Err(fail(format!("the cache holds {} positions", cache.ctx_len)));
        }
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(fail(format!("token {t} is outside the vocabulary of {}", self.cfg.vocab)));
        }
        if banned.len() > MAX_BANNED {
            return Err(fail(format!("{} banned ids (the argmax passes over at most {MAX_BANNED})", banned.len())));
        }
        if cache.ring.broken() {
            return Err(fail("a step failed part way and the recurrent state is lost: truncate to 0 first".into()));
        }
        self.zero_fresh_state(cache)?;
        let mut params = StepParams { pos: cache.ring.pos() as i32, rows: rows as i32, n_banned: banned.len() as i32, plane: cache.ring.plane() as i32, ..Default::default() };
        for (slot, &t) in params.tokens.iter_mut().zip(tokens) {
            *slot = t as i32;
        }
        for (slot, &t) in params.banned.iter_mut().zip(banned) {
            *slot = t as i32;
        }
        let mut block = self.step.lock().expect("a step panicked holding the step block");
        self.stream.memcpy_htod(&[params][..], &mut block.params)?;
        let step = self.ptr(&block.params);
        // A failure past this point may have overwritten planes: only position 0 stays reachable.
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
        if let Err(e) = launched {
            // A step that failed part way may have written planes: only position 0 is exact now.
            cache.ring.failed();
            return Err(e);
        }
        cache.ring.stepped(rows);
        cache.last = LastStep::after(rows, head);
        Ok(())
    }

    /// A sequence that starts over (at position 0) starts from a zero state: its first plane
    /// zeroed before its first step (on the stream, in order with that step).
    fn zero_fresh_state(&self, cache: &mut Qwen35Cache) -> Result<()> {
        if cache.ring.zero_pending() {
            for (conv, ssm) in cache.conv.iter_mut().zip(cache.ssm.iter_mut()) {
                let (cn, sn) = (conv.len() / PLANES, ssm.len() / PLANES);
                self.stream.memset_zeros(&mut conv.slice_mut(..cn))?;
                self.stream.memset_zeros(&mut ssm.slice_mut(..sn))?;
            }
            cache.ring.zeroed();
        }
        Ok(())
    }

    /// Runs `tokens` as [`Qwen35Gpu::forward_banning`] and returns the `k` best `(id, logit)` of
    /// the last row (the sampler's order, `banned` left out).
    pub fn forward_top_k(&self, cache: &mut Qwen35Cache, tokens: &[u32], banned: &[u32], k: usize) -> Result<Vec<(u32, f32)>> {
        self.b.out.check_top_k(tokens.len(), cache.ring.pos(), k)?;
        self.step(cache, tokens, banned, true)?;
        Ok(self.top_k_rows(cache.last.last_row(), 1, k)?.pop().expect("one row asked for"))
    }

    /// Runs `tokens` (at most [`MAX_ROWS`]) and returns every row's `k` best `(id, logit)`.
    pub fn forward_top_k_all(&self, cache: &mut Qwen35Cache, tokens: &[u32], banned: &[u32], k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        self.b.out.check_top_k(tokens.len(), cache.ring.pos(), k)?;
        if tokens.len() > MAX_ROWS {
            return Err(Error::Step { rows: tokens.len(), pos: cache.ring.pos(), what: format!("every row's top {k} of a step of more than {MAX_ROWS} rows") });
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
    pub fn argmax(&self, cache: &Qwen35Cache) -> Result<Vec<u32>> {
        self.b.out.ids(&self.stream, &cache.last, cache.ring.pos())
    }

    /// The logits of `cache`'s last step, `rows × vocab` (a long prompt step's last row's).
    pub fn logits(&self, cache: &Qwen35Cache) -> Result<Vec<f32>> {
        self.b.out.rows(&self.stream, &cache.last, cache.ring.pos())
    }

    /// The logits of row `row` of `cache`'s last step.
    pub fn logits_row(&self, cache: &Qwen35Cache, row: usize) -> Result<Vec<f32>> {
        self.b.out.row(&self.stream, &cache.last, cache.ring.pos(), row)
    }

    /// The hidden states of `cache`'s last step after the output norm (what candle's
    /// `quantized_qwen35` returns and its NextN head reads), `rows × hidden`.
    pub fn hidden(&self, cache: &Qwen35Cache) -> Result<Vec<f32>> {
        let n = cache.last.rows * self.cfg.hidden;
        let mut v = vec![0f32; n];
        self.stream.memcpy_dtoh(&self.b.hid.slice(..n), &mut v[..])?;
        Ok(v)
    }

    /// Each delta-net layer's conv window (`(kernel - 1) × channels`) and state (`H_v × d × d`,
    /// key dim then value dim, candle's layout) at `cache`'s position: for checks against the
    /// CPU path and for slot files.
    pub fn read_state(&self, cache: &Qwen35Cache) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        let c = &self.cfg;
        let (cn, d) = ((c.conv_kernel - 1) * c.conv_dim(), c.d_state);
        let sn = c.n_v_heads * d * d;
        let mut out = Vec::with_capacity(cache.conv.len());
        for (conv, ssm) in cache.conv.iter().zip(&cache.ssm) {
            let mut w = vec![0f32; cn];
            let mut t = vec![0f32; sn];
            let plane = cache.ring.plane();
            if !cache.ring.zero_pending() {
                self.stream.memcpy_dtoh(&conv.slice(plane * cn..(plane + 1) * cn), &mut w[..])?;
                self.stream.memcpy_dtoh(&ssm.slice(plane * sn..(plane + 1) * sn), &mut t[..])?;
            }
            self.stream.synchronize()?;
            // The device keeps each head's state transposed ([col][i]).
            let mut s = vec![0f32; sn];
            for h in 0..c.n_v_heads {
                for j in 0..d {
                    for i in 0..d {
                        s[(h * d + i) * d + j] = t[(h * d + j) * d + i];
                    }
                }
            }
            out.push((w, s));
        }
        Ok(out)
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}
