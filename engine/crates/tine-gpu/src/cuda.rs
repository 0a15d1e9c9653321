//! The kernels on the device: the module (embedded sm machine code, or a cubin file named by
//! `TINE_GPU_CUBIN` for development), their argument blocks, and their launches.
//!
//! The argument blocks are `#[repr(C)]` mirrors of the structs in `kernels/decode.cu`, passed by
//! value; both sides assert their sizes. They hold raw device addresses, so the launches are
//! `unsafe`: the caller guarantees that every address is live and large enough for the extents the
//! kernel's documentation gives. The engine above keeps its buffers for its whole life, which is
//! what makes that easy to keep, and what lets a captured graph replay the same launches.

use std::sync::Arc;

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError, LaunchConfig, ValidAsZeroBits};

use crate::blocks::WeightType;
pub use crate::kv::{KvStore, KvTypes};

/// The most rows (tokens) one step can have: the decode step is 1, verify steps 2..=8.
pub const MAX_ROWS: usize = 8;
/// The widest row `norm_quant`'s norm modes take (256 threads of 32 values in registers).
pub const NQ_MAX_K: usize = 8192;
/// The widest row of `norm_quant_short` (256 threads of 4 values).
pub const NQ_SHORT_K: usize = 1024;
/// Warps per GEMV block.
pub const GEMV_WARPS: usize = 4;
/// Output rows per GEMV warp.
pub const GEMV_ROWS: usize = 2;
/// Weight rows per block of the prompt GEMM (`mmq`).
pub const MMQ_ROWS: usize = 32;
/// Activation rows (tokens) per block of the prompt GEMM.
pub const MMQ_TOKENS: usize = 64;
/// Threads per block of the prompt GEMM.
pub const MMQ_THREADS: usize = 128;
/// Rows per block of the staged GEMV.
pub const GEMV_STAGE_ROWS: usize = 16;
/// The fewest rows for which a single-segment GEMV is staged through shared memory.
pub const GEMV_STAGE_MIN_ROWS: usize = 8192;
/// Keys per attention chunk.
pub const ATTN_CHUNK: usize = 64;
/// Threads per attention block (a warp per sub-chunk of `ATTN_CHUNK / 8` keys).
pub const ATTN_THREADS: usize = 256;
/// Rows per block of the prompt attention (`attn_prompt_hd*`).
pub const ATTN_PROMPT_ROWS: usize = 8;
/// Rows per block of the prompt attention at heads of 512.
pub const ATTN_PROMPT_ROWS_512: usize = 4;

/// Blocks per row of the argmax.
pub const ARGMAX_BLOCKS: usize = 128;
/// The most candidates `topk_rows` gives a row.
pub const TOPK_MAX: usize = 64;
/// Values of a row each `topk_rows` block sorts.
pub const TOPK_SLICE: usize = 4096;
/// The longest row `topk_rows` takes (its blocks' candidates fit one sort).
pub const TOPK_MAX_N: usize = TOPK_SLICE * TOPK_SLICE / TOPK_MAX;

/// The module built from `kernels/decode.cu` by build.rs (sm machine code for the build's
/// `CUDA_COMPUTE_CAP`).
static EMBEDDED_CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/decode.cubin"));

/// Why the kernels could not be loaded or launched.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("reading the kernels' cubin {path} (TINE_GPU_CUBIN)")]
    Cubin {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("loading the kernels' module (is it built for this GPU's compute capability? this build's: sm_{built})")]
    Module {
        built: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("kernel {name}: not in the module")]
    Function {
        name: String,
        #[source]
        source: DriverError,
    },
    #[error("launching {kernel}")]
    Launch {
        kernel: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("{0}")]
    Shape(String),
    #[error("CUDA driver: {what}")]
    Driver {
        what: &'static str,
        #[source]
        source: DriverError,
    },
}

/// The step's parameters, in device memory: the kernels read the position and the tokens from
/// here, so that a captured graph serves every step.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepParams {
    /// Position of row 0.
    pub pos: i32,
    /// Rows of the step.
    pub rows: i32,
    /// Token ids of the rows.
    pub tokens: [i32; MAX_ROWS],
    /// How many of `banned` the greedy argmax passes over.
    pub n_banned: i32,
    /// Ids the greedy argmax passes over (`ignore_eos`: the end-of-generation ids).
    pub banned: [i32; MAX_BANNED],
    /// The decode attention reads keys below `kv_end` only (0: up to each row's own position):
    /// an assistant head's query at a position past the target cache it reads.
    pub kv_end: i32,
    /// Recurrent layers: the state plane the step starts from; row `m`'s state goes to plane
    /// `(plane + 1 + m) % n_planes`.
    pub plane: i32,
    /// `qk_norm_rope_kv` turns row `m` by the angle of position `pos + m + rope_shift` (its K/V
    /// still go to `pos + m`): Qwen3.5's NextN entry `j` reads the token at `j + 1` at position
    /// `j + 1`, in slot `j` of its cache.
    pub rope_shift: i32,
    /// A batched step's rows from several sequences: a device array of one [`SeqRow`] a row
    /// (0: every row is the one sequence's, row `m` at `pos + m`). `qk_norm_rope_kv` and the
    /// decode attention read it.
    pub seq_rows: DevPtr,
}

pub use crate::rows::SeqRow;
// SAFETY: plain repr(C) integers, the layout of `SeqRow` in decode.cu.
unsafe impl DeviceRepr for SeqRow {}
unsafe impl ValidAsZeroBits for SeqRow {}
// SAFETY: plain repr(C) integers, the layout of `StepParams` in decode.cu; all zeros is a valid value.
unsafe impl DeviceRepr for StepParams {}
unsafe impl ValidAsZeroBits for StepParams {}

/// The most ids a step's greedy argmax can pass over.
pub const MAX_BANNED: usize = 8;

/// A device address (`CUdeviceptr`), or 0 for "none".
pub type DevPtr = u64;

/// `norm_quant`'s arguments (see decode.cu for the modes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NormQuantArgs {
    pub a: DevPtr,
    pub res: DevPtr,
    pub w_a: DevPtr,
    pub embd: DevPtr,
    pub embd_scale: f32,
    pub step: DevPtr,
    pub w: DevPtr,
    pub eps: f32,
    pub res_out: DevPtr,
    pub y_out: DevPtr,
    pub qs: DevPtr,
    pub qd: DevPtr,
    pub qsum: DevPtr,
    pub k: i32,
    pub in_mode: i32,
    pub norm: i32,
    /// `in_mode` 2: the rows' token ids, one i32 each (0: the step block's `tokens`).
    pub tokens: DevPtr,
    /// Values per row of the Q8 output (and `y_out`); 0: `k`.
    pub q_stride: i32,
    /// Where in its row the output starts (a multiple of 32): two launches fill the halves of a
    /// concatenated row.
    pub q_off: i32,
    /// `in_mode` 1: the residual sum is scaled by this (0: not scaled), a block's
    /// `layer_output_scale`.
    pub res_scale: f32,
    /// `in_mode` 2: the embedding table's weight type, ggml's number (0: Q8_0).
    pub embd_type: i32,
    /// `in_mode` 4 (`gelu_tanh(a) · w_a`, Gemma 4's per-layer input gate): values between the
    /// rows of `w_a`.
    pub b_stride: i32,
}

/// One segment of a GEMV launch.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GemvSeg {
    pub w: DevPtr,
    pub w2: DevPtr,
    pub out: DevPtr,
    pub n: i32,
    pub wtype: i32,
    pub out_stride: i32,
    pub glu: i32,
    pub block_start: i32,
    /// 1: the weights are in the wide layout ([`WeightType::to_wide`]), which `gemv_wide` and
    /// `mmq` read; 0: GGUF blocks (`gemv`, `gemv_staged`, `mmq`). One layout a launch.
    pub wide: i32,
}

/// `gemv_m{M}`'s arguments.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GemvArgs {
    pub seg: [GemvSeg; 4],
    pub nseg: i32,
    pub k: i32,
    /// Warps per output row (1, 2 or 4): [`Kernels::gemv_split`].
    pub split: i32,
    /// Activation rows (read by `mmq`, the prompt GEMM).
    pub rows: i32,
    pub qs: DevPtr,
    pub qd: DevPtr,
    pub qsum: DevPtr,
}

/// `qk_norm_rope_kv`'s arguments.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RopeArgs {
    pub q: DevPtr,
    pub k: DevPtr,
    pub v: DevPtr,
    pub q_norm: DevPtr,
    pub k_norm: DevPtr,
    pub eps: f32,
    pub inv_freq: DevPtr,
    pub q_scale: f32,
    pub k_cache: DevPtr,
    pub v_cache: DevPtr,
    pub ctx: i32,
    pub step: DevPtr,
    pub n_head: i32,
    pub n_kv: i32,
    pub hd: i32,
    /// Dims rotated at the front of each head (0: all of them); `inv_freq` holds `n_rot / 2`.
    pub n_rot: i32,
    /// 1: V's RMSNorm without a weight before it is cached (Gemma 4).
    pub v_norm: i32,
    /// 1: V is K's projection before its norm (Gemma 4's `k_eq_v` layers; `v` is not read).
    pub v_from_k: i32,
    /// The caches' stored types ([`KvStore::kernel_id`]).
    pub k_type: i32,
    pub v_type: i32,
    /// 0, or a device array of K and V cache pointers per slot (`[slot][2]`): each row's K/V go
    /// to its [`SeqRow::slot`]'s entry (sequences whose caches are separate allocations of one
    /// layout) instead of its slot of the pool at `k_cache`/`v_cache`.
    pub kv_slots: DevPtr,
    /// Where a cache is of a turbo type: `[rows][n_kv][2][hd]` floats the launch leaves K and V
    /// in for `turbo_store` (which [`Kernels::qk_norm_rope_kv`] launches next), 0 otherwise.
    pub stage: DevPtr,
    /// Where a cache is of a turbo type: [`Kernels::turbo_tab`], 0 otherwise (the kernel does
    /// not read it; `turbo_store` does).
    pub turbo: DevPtr,
}

/// `turbo_store`'s arguments: a step's K and V rows, left as f32 by `qk_norm_rope_kv` in
/// `stage`, encoded into caches of the turbo types at each row's position.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TurboStoreArgs {
    pub stage: DevPtr,
    pub k_cache: DevPtr,
    pub v_cache: DevPtr,
    pub step: DevPtr,
    pub kv_slots: DevPtr,
    pub tab: DevPtr,
    pub ctx: i32,
    pub n_kv: i32,
    pub hd: i32,
    pub k_type: i32,
    pub v_type: i32,
    pub pad: i32,
}

/// `ple_inputs`'s arguments: Gemma 4's per-layer inputs of a step's rows (see decode.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PleArgs {
    /// `[rows, n_layer * p]`: the embedded rows through `per_layer_model_proj`.
    pub proj: DevPtr,
    /// `per_layer_token_embd`: rows of `n_layer * p` values of `embd_type`, either layout.
    pub embd: DevPtr,
    /// `per_layer_proj_norm`, `p` values.
    pub w: DevPtr,
    /// `[rows, n_layer * p]`.
    pub out: DevPtr,
    pub step: DevPtr,
    /// The rows' token ids (0: the step block's).
    pub tokens: DevPtr,
    pub embd_type: i32,
    pub n_layer: i32,
    pub p: i32,
    pub eps: f32,
    /// `1 / sqrt(hidden)`.
    pub proj_scale: f32,
    /// `sqrt(p)`.
    pub tok_scale: f32,
}

/// `softcap`'s arguments: `x = tanh(x · inv_cap) · cap` over `n` values in place.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SoftcapArgs {
    pub x: DevPtr,
    pub n: i32,
    pub cap: f32,
    pub inv_cap: f32,
    pub pad_: i32,
}

/// `turbo_encode`'s arguments: rows of `d` values to the rotated low-bit KV rows of candle-nn's
/// `attention::kv_turbo` (`bits` a value on average, `row_bytes` each), bit for bit.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TurboArgs {
    pub x: DevPtr,
    pub out: DevPtr,
    /// 32 floats: `kv_turbo::scale_steps()`.
    pub steps: DevPtr,
    /// 32 floats: `kv_turbo::scale_bounds()`.
    pub bounds: DevPtr,
    /// 8 x 128 floats: width `w`'s `kv_turbo::levels(w)` from `w * 128`.
    pub levels: DevPtr,
    pub d: i32,
    pub bits: i32,
    pub row_bytes: i32,
    /// Bit `i`: `kv_turbo::sign_negative(i)`.
    pub sign_mask: u32,
    /// `1 / sqrt(32)` as f32 (the CPU's expression).
    pub inv_sqrt: f32,
    /// `kv_turbo::SCALE_SEARCH`.
    pub search: i32,
}

/// `moe_logits`' and `moe_router`'s arguments: per activation row, the router's logits over
/// `n_expert` experts (f32 weights, `k` values a row; `moe_logits`, into `logits`), then softmax,
/// the top `used` (lower index first among equals) renormalised, and `sigmoid(shared_gate · x)`
/// when `shared_gate` is set (`moe_router`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MoeRouterArgs {
    /// The normed rows, `rows × k` f32.
    pub x: DevPtr,
    /// `n_expert × k` f32.
    pub router: DevPtr,
    /// `k` f32, or 0.
    pub shared_gate: DevPtr,
    /// Out: `rows × used` expert ids (i32), their weights (f32), and `rows` shared gates.
    pub ids: DevPtr,
    pub wts: DevPtr,
    pub sgate: DevPtr,
    /// Scratch: `rows × (n_expert + 1)` f32, the logits (the last of a row the shared gate's).
    pub logits: DevPtr,
    pub k: i32,
    pub n_expert: i32,
    pub used: i32,
    pub pad_: i32,
}

/// `gemv_moe`'s arguments: `g.seg[0]` the stacked experts (expert 0's rows, `expert_bytes` to the
/// next, in the wide layout), `ids` the `pairs` expert ids; pair `q`'s activation row is
/// `q / used` (`act_pair` 0) or `q` (1), its output row `q`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MoeGemvArgs {
    pub g: GemvArgs,
    pub ids: DevPtr,
    pub expert_bytes: i64,
    pub used: i32,
    pub act_pair: i32,
}

/// `moe_sort`'s arguments: expert `e`'s pairs (`q` with `ids[q] == e`, in order) into
/// `list[e · cap ..]`, their count into `counts[e]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MoeSortArgs {
    pub ids: DevPtr,
    pub list: DevPtr,
    pub counts: DevPtr,
    pub pairs: i32,
    pub cap: i32,
}

/// `mmq_moe`'s arguments: `g.seg[0]` the stacked experts (as [`MoeGemvArgs`]'s), `moe_sort`'s
/// lists; pair `q`'s activation row is `q / act_div`, its output row `q`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MoeMmqArgs {
    pub g: GemvArgs,
    pub list: DevPtr,
    pub counts: DevPtr,
    pub expert_bytes: i64,
    pub cap: i32,
    pub act_div: i32,
}

/// `moe_combine`'s arguments: `out[m] = Σ_j c_j · y[m·used + j] (+ sgate[m] · shared[m])`,
/// rows of `k` values, `c_j = wts[m·used + j]` (times `escale[ids[m·used + j]]` when `escale`
/// is set: Gemma 4's per-expert output scale).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MoeCombineArgs {
    pub y: DevPtr,
    pub wts: DevPtr,
    /// The shared expert's rows, or 0.
    pub shared: DevPtr,
    pub sgate: DevPtr,
    pub out: DevPtr,
    pub k: i32,
    pub used: i32,
    /// The rows' expert ids (read with `escale` only).
    pub ids: DevPtr,
    /// Each expert's output scale, or 0 (none).
    pub escale: DevPtr,
}

pub use crate::{MOE_MAX_EXPERTS, MOE_MAX_USED};

/// `attn_decode_hd{HD}`'s arguments.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnArgs {
    pub q: DevPtr,
    pub k_cache: DevPtr,
    pub v_cache: DevPtr,
    pub out: DevPtr,
    pub partials: DevPtr,
    pub counters: DevPtr,
    pub step: DevPtr,
    /// The output's Q8 planes (0: none): the next GEMV's input, without a quantizing launch.
    pub qs: DevPtr,
    pub qd: DevPtr,
    pub qsum: DevPtr,
    pub ctx: i32,
    pub window: i32,
    pub n_head: i32,
    pub n_kv: i32,
    pub chunks_max: i32,
    /// `[rows, n_head * hd]` or 0: the output is multiplied by `sigmoid(gate)` (Qwen3.5's gated
    /// attention) before it is written.
    pub gate: DevPtr,
    /// The caches' stored types ([`KvStore::kernel_id`]); both f32 runs the untyped kernels.
    pub k_type: i32,
    pub v_type: i32,
    /// 0, or each slot's K and V caches ([`RopeArgs::kv_slots`]).
    pub kv_slots: DevPtr,
    /// Where a cache is of a turbo type: [`Kernels::turbo_tab`] (the query is rotated as the
    /// keys were, the weighted values rotated back), 0 otherwise.
    pub turbo: DevPtr,
}

/// `conv_silu`'s arguments: the gated delta-net's causal conv with SiLU over a step's rows.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ConvArgs {
    /// `[rows, c]`: the fused QKV projection.
    pub x: DevPtr,
    /// `[c, k]`: the kernel (tap `k - 1` on the current row).
    pub w: DevPtr,
    /// `[n_planes, k - 1, c]`: the windows.
    pub planes: DevPtr,
    /// `[rows, c]`.
    pub y: DevPtr,
    pub step: DevPtr,
    pub c: i32,
    pub k: i32,
    pub n_planes: i32,
    pub rows: i32,
}

/// `conv_gated_delta_rule`'s arguments: the conv's (its `y` unused) and the delta rule's (its
/// `qkv` unused), over the same rows and planes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ConvGdnArgs {
    pub conv: ConvArgs,
    pub gdn: GdnArgs,
    /// 0, or a batched step's entries (`[entry][3]` i32: first row, rows, start plane; 0 rows:
    /// no entry): block z runs entry z over its own planes (`ent_planes`), `conv.planes`,
    /// `gdn.planes` and the step's plane unread.
    pub ent_rows: DevPtr,
    /// `[entry][2]`: each entry's conv windows and delta-rule states (device pointers).
    pub ent_planes: DevPtr,
}

/// `gated_delta_rule`'s arguments (see decode.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GdnArgs {
    /// `[rows, (2 hk + hv) d]` after the conv.
    pub qkv: DevPtr,
    /// `[rows, hv]` each, before the softplus and the sigmoid.
    pub alpha: DevPtr,
    pub beta: DevPtr,
    /// `[hv]` each.
    pub dt_bias: DevPtr,
    pub a: DevPtr,
    /// `[n_planes, hv, d, d]`, each head's state stored `[col][i]`.
    pub planes: DevPtr,
    /// `[rows, hv d]`.
    pub out: DevPtr,
    pub step: DevPtr,
    pub hk: i32,
    pub hv: i32,
    pub d: i32,
    pub n_planes: i32,
    pub rows: i32,
    pub eps: f32,
    pub q_scale: f32,
    pub pad_: i32,
}

/// `gated_norm_quant`'s arguments: `RMSNorm(o) · w · SiLU(z)` per value head, as Q8 rows.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GatedNormArgs {
    pub o: DevPtr,
    pub z: DevPtr,
    pub w: DevPtr,
    pub qs: DevPtr,
    pub qd: DevPtr,
    pub qsum: DevPtr,
    pub hv: i32,
    pub d: i32,
    pub eps: f32,
    pub pad_: i32,
}

/// `argmax_rows`'s arguments.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ArgmaxArgs {
    pub logits: DevPtr,
    pub n: i32,
    pub cand_v: DevPtr,
    pub cand_i: DevPtr,
    pub counters: DevPtr,
    pub ids: DevPtr,
    pub feed: DevPtr,
    /// The step block whose banned ids the argmax passes over (0: none).
    pub step: DevPtr,
}

/// `topk_rows`'s arguments.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TopKArgs {
    pub logits: DevPtr,
    pub n: i32,
    pub k: i32,
    /// `rows * blocks * TOPK_MAX` u64 of scratch.
    pub cand: DevPtr,
    /// `MAX_ROWS` zeroed ints.
    pub counters: DevPtr,
    /// `rows * k` i32 ids and f32 logits (-1 where a row has fewer than k values).
    pub ids: DevPtr,
    pub vals: DevPtr,
    /// The step block whose banned ids are left out (0: none).
    pub step: DevPtr,
    /// The step's row of this launch's row 0 (where the step has a row table, its rows'
    /// [`SeqRow::no_ban`] say whose banned ids apply).
    pub row0: i32,
    pub pad: i32,
}

// The sizes decode.cu asserts for the same structs.
const _: () = assert!(std::mem::size_of::<StepParams>() == 96);
const _: () = assert!(std::mem::size_of::<SeqRow>() == 32);
const _: () = assert!(std::mem::size_of::<NormQuantArgs>() == 152);
const _: () = assert!(std::mem::size_of::<GemvSeg>() == 48);
const _: () = assert!(std::mem::size_of::<MoeRouterArgs>() == 72);
const _: () = assert!(std::mem::size_of::<MoeGemvArgs>() == 256);
const _: () = assert!(std::mem::size_of::<MoeSortArgs>() == 32);
const _: () = assert!(std::mem::size_of::<MoeMmqArgs>() == 264);
const _: () = assert!(std::mem::size_of::<MoeCombineArgs>() == 64);
const _: () = assert!(std::mem::size_of::<GemvArgs>() == 232);
const _: () = assert!(std::mem::size_of::<RopeArgs>() == 152);
const _: () = assert!(std::mem::size_of::<AttnArgs>() == 136);
const _: () = assert!(std::mem::size_of::<TurboStoreArgs>() == 72);
const _: () = assert!(std::mem::size_of::<ConvArgs>() == 56);
const _: () = assert!(std::mem::size_of::<GdnArgs>() == 96);
const _: () = assert!(std::mem::size_of::<GatedNormArgs>() == 64);
const _: () = assert!(std::mem::size_of::<ConvGdnArgs>() == 168);
const _: () = assert!(std::mem::size_of::<ArgmaxArgs>() == 64);
const _: () = assert!(std::mem::size_of::<TopKArgs>() == 64);
const _: () = assert!(std::mem::size_of::<PleArgs>() == 72);
const _: () = assert!(std::mem::size_of::<SoftcapArgs>() == 24);
const _: () = assert!(std::mem::size_of::<TurboArgs>() == 64);

// SAFETY: each is a repr(C) struct of integers and floats, the layout of its namesake in decode.cu
// (sizes asserted on both sides), passed by value as a kernel parameter.
unsafe impl DeviceRepr for NormQuantArgs {}
unsafe impl DeviceRepr for GemvArgs {}
unsafe impl DeviceRepr for RopeArgs {}
unsafe impl DeviceRepr for AttnArgs {}
unsafe impl DeviceRepr for ArgmaxArgs {}
unsafe impl DeviceRepr for TopKArgs {}
unsafe impl DeviceRepr for ConvArgs {}
unsafe impl DeviceRepr for GdnArgs {}
unsafe impl DeviceRepr for GatedNormArgs {}
unsafe impl DeviceRepr for ConvGdnArgs {}
unsafe impl DeviceRepr for PleArgs {}
unsafe impl DeviceRepr for SoftcapArgs {}
unsafe impl DeviceRepr for TurboArgs {}
unsafe impl DeviceRepr for TurboStoreArgs {}
unsafe impl DeviceRepr for MoeRouterArgs {}
unsafe impl DeviceRepr for MoeGemvArgs {}
unsafe impl DeviceRepr for MoeCombineArgs {}
unsafe impl DeviceRepr for MoeSortArgs {}
unsafe impl DeviceRepr for MoeMmqArgs {}

/// The loaded kernels.
pub struct Kernels {
    _module: Arc<CudaModule>,
    norm_quant: CudaFunction,
    /// `norm_quant` for rows of up to [`NQ_SHORT_K`] values (fewer registers: more rows at once).
    norm_quant_short: CudaFunction,
    gemv: Vec<CudaFunction>,
    gemv_staged: Vec<CudaFunction>,
    gemv_wide: Vec<CudaFunction>,
    gemv_wide_rows: CudaFunction,
    mmq: CudaFunction,
    moe_sort: CudaFunction,
    mmq_moe: CudaFunction,
    rope: CudaFunction,
    attn: [(usize, CudaFunction); 4],
    attn_prompt: [(usize, CudaFunction); 4],
    attn_typed: [(usize, CudaFunction); 4],
    attn_prompt_typed: [(usize, CudaFunction); 4],
    ple: CudaFunction,
    softcap: CudaFunction,
    turbo: CudaFunction,
    turbo_store: CudaFunction,
    /// The turbo types' tables ([`crate::kv::turbo_tab`]).
    turbo_tab: CudaSlice<f32>,
    moe_logits: CudaFunction,
    moe_router: CudaFunction,
    gemv_moe: CudaFunction,
    moe_combine: CudaFunction,
    argmax: CudaFunction,
    topk: CudaFunction,
    conv: CudaFunction,
    gdn: CudaFunction,
    conv_gdn: CudaFunction,
    gated_norm: CudaFunction,
    /// Launch with programmatic dependent launch (each kernel may start while the previous one
    /// runs, up to its `griddepcontrol.wait`): `TINE_GPU_PDL=0` turns it off.
    pdl: AtomicBool,
}

/// The compute capability the embedded cubin was built for.
pub const BUILT_FOR: &str = env!("TINE_GPU_SM");

impl Kernels {
    /// Loads the module into `ctx`: the cubin file `TINE_GPU_CUBIN` names if set (a development
    /// build compiled on the GPU machine), the embedded one otherwise.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, GpuError> {
        let image = match std::env::var("TINE_GPU_CUBIN") {
            Ok(path) => std::fs::read(&path).map_err(|source| GpuError::Cubin { path, source })?,
            Err(_) => EMBEDDED_CUBIN.to_vec(),
        };
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(image)).map_err(|source| GpuError::Module { built: BUILT_FOR, source })?;
        let f = |name: &str| module.load_function(name).map_err(|source| GpuError::Function { name: name.to_string(), source });
        Ok(Kernels {
            norm_quant: f("norm_quant")?,
            norm_quant_short: f("norm_quant_short")?,
            gemv: (1..=MAX_ROWS).map(|m| f(&format!("gemv_m{m}"))).collect::<Result<_, _>>()?,
            gemv_staged: (1..=MAX_ROWS).map(|m| f(&format!("gemv_staged_m{m}"))).collect::<Result<_, _>>()?,
            gemv_wide: (1..=MAX_ROWS).map(|m| f(&format!("gemv_wide_m{m}"))).collect::<Result<_, _>>()?,
            gemv_wide_rows: f("gemv_wide_rows")?,
            mmq: f("mmq")?,
            rope: f("qk_norm_rope_kv")?,
            attn: [(64, f("attn_decode_hd64")?), (128, f("attn_decode_hd128")?), (256, f("attn_decode_hd256")?), (512, f("attn_decode_hd512")?)],
            attn_prompt: [(64, f("attn_prompt_hd64")?), (128, f("attn_prompt_hd128")?), (256, f("attn_prompt_hd256")?), (512, f("attn_prompt_hd512")?)],
            attn_typed: [(64, f("attn_decode_typed_hd64")?), (128, f("attn_decode_typed_hd128")?), (256, f("attn_decode_typed_hd256")?), (512, f("attn_decode_typed_hd512")?)],
            attn_prompt_typed: [(64, f("attn_prompt_typed_hd64")?), (128, f("attn_prompt_typed_hd128")?), (256, f("attn_prompt_typed_hd256")?), (512, f("attn_prompt_typed_hd512")?)],
            ple: f("ple_inputs")?,
            softcap: f("softcap")?,
            turbo: f("turbo_encode")?,
            turbo_store: f("turbo_store")?,
            turbo_tab: {
                let stream = ctx.default_stream();
                let what = "uploading the turbo KV types' tables";
                let tab = stream.clone_htod(&crate::kv::turbo_tab()).map_err(|source| GpuError::Driver { what, source })?;
                stream.synchronize().map_err(|source| GpuError::Driver { what, source })?;
                tab
            },
            moe_logits: f("moe_logits")?,
            moe_router: f("moe_router")?,
            gemv_moe: f("gemv_moe")?,
            moe_sort: f("moe_sort")?,
            mmq_moe: f("mmq_moe")?,
            moe_combine: f("moe_combine")?,
            argmax: f("argmax_rows")?,
            topk: f("topk_rows")?,
            conv: f("conv_silu")?,
            gdn: f("gated_delta_rule")?,
            conv_gdn: f("conv_gated_delta_rule")?,
            gated_norm: f("gated_norm_quant")?,
            pdl: AtomicBool::new(std::env::var("TINE_GPU_PDL").map_or(true, |v| v != "0")),
            _module: module,
        })
    }

    /// Whether launches use programmatic dependent launch.
    pub fn pdl(&self) -> bool {
        self.pdl.load(Ordering::Relaxed)
    }

    /// Turns programmatic dependent launch on or off for the launches that follow (a graph
    /// captured before keeps what it was captured with).
    pub fn set_pdl(&self, on: bool) {
        self.pdl.store(on, Ordering::Relaxed);
    }

    /// Launches `f` with its one by-value argument block, through `cuLaunchKernelEx`: with the
    /// programmatic stream serialization attribute when PDL is on (every kernel of decode.cu waits
    /// with `griddepcontrol.wait` before it reads what an earlier launch wrote).
    ///
    /// # Safety
    /// `args` is the argument block `f` takes, every address in it valid as the kernel needs.
    unsafe fn launch<A: DeviceRepr>(&self, stream: &Arc<CudaStream>, f: &CudaFunction, cfg: LaunchConfig, args: &A, kernel: &'static str) -> Result<(), GpuError> {
        let err = |source| GpuError::Launch { kernel, source };
        // SAFETY: an all-zero launch attribute is a valid value of the C struct (id 0: ignore).
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let pdl = self.pdl();
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
            numAttrs: u32::from(pdl),
        };
        let mut params = [args as *const A as *mut std::ffi::c_void];
        stream.context().bind_to_thread().map_err(err)?;
        // SAFETY: the caller's contract: `args` is what `f` takes; params points at it for the
        // duration of the call, which copies it.
        unsafe { sys::cuLaunchKernelEx(&lc, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result().map_err(err)
    }

    /// `norm_quant` over `rows` rows: in the plain mode (`in_mode` 0, no norm, no `res_out`)
    /// a block of 8 warps per 256 values of a row, else one block per row.
    ///
    /// # Safety
    /// Every non-zero address in `args` is live device memory of at least the extent decode.cu
    /// gives it for `rows` rows of `args.k` values.
    pub unsafe fn norm_quant(&self, stream: &Arc<CudaStream>, rows: usize, args: &NormQuantArgs) -> Result<(), GpuError> {
        check(args.k > 0 && args.k % 32 == 0, || format!("norm_quant: k = {} is not a multiple of 32", args.k))?;
        let plain = args.in_mode == 0 && args.norm == 0 && args.res_out == 0;
        check(plain || args.k as usize <= NQ_MAX_K, || format!("norm_quant: k = {} is over {NQ_MAX_K}, the most a norm mode keeps in one block", args.k))?;
        check(args.q_off >= 0 && args.q_off % 32 == 0 && (args.q_stride == 0 && args.q_off == 0 || args.q_stride % 32 == 0 && args.q_stride >= args.q_off + args.k), || {
            format!("norm_quant: output at {} of rows of {} values does not hold {} values in whole blocks", args.q_off, args.q_stride, args.k)
        })?;
        let blocks = if plain { (args.k as usize).div_ceil(256) } else { 1 };
        let cfg = LaunchConfig { grid_dim: (blocks as u32, rows as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // The same bits either way (the short variant holds fewer zeros past k).
        let f = if args.k as usize <= NQ_SHORT_K { &self.norm_quant_short } else { &self.norm_quant };
        self.launch(stream, f, cfg, args, "norm_quant")
    }

    /// Warps per output row for rows of `k` values: a row of many 32-value units is cut into up
    /// to 4 slices (each warp then has about 16 units), so that short GEMVs of long rows still
    /// spread over many warps. A function of `k` alone, so a row's sum is the same for any M.
    pub fn gemv_split(k: usize) -> usize {
        match k / 32 {
            u if u >= 64 => 4,
            u if u >= 32 => 2,
            _ => 1,
        }
    }

    /// The shared memory of the staged GEMV for `seg` (a matrix of many rows: the LM head), or
    /// None where the plain GEMV takes it. A function of the weights alone, so a row's sum is the
    /// same for any M.
    pub fn gemv_stage_bytes(seg: &GemvSeg, k: usize, split: usize) -> Option<usize> {
        let bytes = GEMV_STAGE_ROWS * WeightType::from_ggml_id(seg.wtype)?.row_bytes(k);
        (seg.glu == 0 && split == 1 && seg.n as usize >= GEMV_STAGE_MIN_ROWS && bytes <= 48 * 1024).then_some(bytes)
    }

    /// The GEMV over `rows` activation rows for the segments `segs` (filled in: each segment's
    /// `block_start`), all in one layout: for up to [`MAX_ROWS`] rows `gemv_wide_m{rows}` over
    /// wide rows, `gemv_m{rows}` (or `gemv_staged_m{rows}`) over GGUF blocks (each row's bits the
    /// same for any count); the tensor-core `mmq` for more (a prompt; its rows match to float
    /// rounding).
    ///
    /// # Safety
    /// As for [`Kernels::norm_quant`]: the weights hold `n` rows of `k` values of their type in
    /// the segment's layout, the activation planes `rows` rows of `k`, each output `rows` rows of
    /// `out_stride`.
    pub unsafe fn gemv(&self, stream: &Arc<CudaStream>, rows: usize, k: usize, segs: &[GemvSeg], act: (DevPtr, DevPtr, DevPtr)) -> Result<(), GpuError> {
        check(rows >= 1, || "gemv: no rows".to_string())?;
        check((1..=4).contains(&segs.len()), || format!("gemv: {} segments (1..=4)", segs.len()))?;
        let many = rows > MAX_ROWS;
        let wide = segs[0].wide != 0;
        check(segs.iter().all(|s| (s.wide != 0) == wide), || "gemv: segments in both layouts".to_string())?;
        let split = if wide { Self::wide_lanes(segs.iter().map(|s| s.n.max(0) as usize).sum(), k) } else { Self::gemv_split(k) };
        let mut args = GemvArgs { nseg: segs.len() as i32, k: k as i32, split: split as i32, rows: rows as i32, qs: act.0, qd: act.1, qsum: act.2, ..Default::default() };
        let mut blocks = 0usize;
        for (slot, s) in args.seg.iter_mut().zip(segs) {
            let bv = WeightType::from_ggml_id(s.wtype).ok_or_else(|| GpuError::Shape(format!("gemv: weight type {} is not one the kernels read", s.wtype)))?.block_values();
            check(k.is_multiple_of(bv), || format!("gemv: k = {k} is not a multiple of the weight type's {bv}"))?;
            *slot = GemvSeg { block_start: blocks as i32, ..*s };
            blocks += (s.n as usize).div_ceil(match (many, wide) {
                (true, _) => MMQ_ROWS,
                (false, true) => GEMV_WARPS * (32 / split),
                (false, false) => GEMV_WARPS / split * GEMV_ROWS,
            });
        }
        if many {
            let cfg = LaunchConfig { grid_dim: (blocks as u32, rows.div_ceil(MMQ_TOKENS) as u32, 1), block_dim: (MMQ_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
            return self.launch(stream, &self.mmq, cfg, &args, "mmq");
        }
        if wide {
            let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: ((GEMV_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
            return self.launch(stream, &self.gemv_wide[rows - 1], cfg, &args, "gemv_wide");
        }
        if let [one] = segs {
            if let Some(stage_bytes) = Self::gemv_stage_bytes(one, k, split) {
                args.split = 1;
                let cfg = LaunchConfig { grid_dim: ((one.n as usize).div_ceil(GEMV_STAGE_ROWS) as u32, 1, 1), block_dim: ((GEMV_WARPS * 32) as u32, 1, 1), shared_mem_bytes: stage_bytes as u32 };
                return self.launch(stream, &self.gemv_staged[rows - 1], cfg, &args, "gemv_staged");
            }
        }
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: ((GEMV_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.gemv[rows - 1], cfg, &args, "gemv")
    }

    /// The GEMV of a batched step's `rows` rows (a multiple of 8: the step pads with inert rows),
    /// over the wide layout: groups of 8 rows, each with `gemv_wide`'s 8-row arithmetic, so a
    /// row's result is bit for bit its one-row launch's at any row count (which [`Kernels::gemv`]
    /// keeps up to [`MAX_ROWS`] and its prompt GEMM does not).
    ///
    /// # Safety
    /// As [`Kernels::gemv`]'s, for `rows` rows.
    pub unsafe fn gemv_rows(&self, stream: &Arc<CudaStream>, rows: usize, k: usize, segs: &[GemvSeg], act: (DevPtr, DevPtr, DevPtr)) -> Result<(), GpuError> {
        check(rows >= 8 && rows.is_multiple_of(8) && rows / 8 <= 1024, || format!("gemv_rows: {rows} rows (a multiple of 8, at most 8192)"))?;
        check((1..=4).contains(&segs.len()), || format!("gemv_rows: {} segments (1..=4)", segs.len()))?;
        check(segs.iter().all(|s| s.wide != 0), || "gemv_rows: the weights in GGUF blocks (it reads the wide layout)".to_string())?;
        let split = Self::wide_lanes(segs.iter().map(|s| s.n.max(0) as usize).sum(), k);
        let mut args = GemvArgs { nseg: segs.len() as i32, k: k as i32, split: split as i32, rows: rows as i32, qs: act.0, qd: act.1, qsum: act.2, ..Default::default() };
        let mut blocks = 0usize;
        for (slot, s) in args.seg.iter_mut().zip(segs) {
            let bv = WeightType::from_ggml_id(s.wtype).ok_or_else(|| GpuError::Shape(format!("gemv_rows: weight type {} is not one the kernels read", s.wtype)))?.block_values();
            check(k.is_multiple_of(bv), || format!("gemv_rows: k = {k} is not a multiple of the weight type's {bv}"))?;
            *slot = GemvSeg { block_start: blocks as i32, ..*s };
            blocks += (s.n as usize).div_ceil(GEMV_WARPS * (32 / split));
        }
        let cfg = LaunchConfig { grid_dim: ((blocks * rows / 8) as u32, 1, 1), block_dim: ((GEMV_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.gemv_wide_rows, cfg, &args, "gemv_wide_rows")
    }

    /// Lanes per row of `gemv_wide` for a launch of `n` rows in all (its segments') of `k` values:
    /// enough lanes that the launch has about 1536 warps (a matrix of few rows still spreads over
    /// every SM), at least 4 (8 from k = 4096: the LM heads, measured on an H200 over M = 1..8,
    /// docs/evaluations/gpu-families.md), at most 32 and at most the row's units. A function of the
    /// launch's shape alone, never of M, so a row's sum is the same for any M.
    pub fn wide_lanes(n: usize, k: usize) -> usize {
        let floor = if k >= 4096 { 8 } else { 4 };
        let want = (32 * 1536usize).div_ceil(n.max(1)).next_power_of_two().clamp(floor, 32);
        let units = (k / 32).max(1);
        let most = 1usize << (usize::BITS - 1 - units.leading_zeros());
        want.min(most)
    }

    /// `qk_norm_rope_kv` for `rows` rows, then `turbo_store` where a cache is of a turbo type.
    ///
    /// # Safety
    /// As for [`Kernels::norm_quant`], and the step's positions `pos..pos + rows` are below `ctx`;
    /// with a turbo cache, `stage` holds `rows * n_kv * 2 * hd` floats and `turbo` is
    /// [`Kernels::turbo_tab`].
    pub unsafe fn qk_norm_rope_kv(&self, stream: &Arc<CudaStream>, rows: usize, args: &RopeArgs) -> Result<(), GpuError> {
        check(args.hd > 0 && args.hd % 64 == 0 && args.hd <= 512, || format!("qk_norm_rope_kv: head dim {} (a multiple of 64 up to 512)", args.hd))?;
        check(args.n_rot >= 0 && args.n_rot % 2 == 0 && args.n_rot <= args.hd, || format!("qk_norm_rope_kv: {} rotated dims of a head of {}", args.n_rot, args.hd))?;
        check(args.n_head > 0 && args.n_kv >= 0, || format!("qk_norm_rope_kv: {} query heads and {} KV heads", args.n_head, args.n_kv))?;
        check_kv_types(args.k_type, args.v_type)?;
        let turbo = [args.k_type, args.v_type].iter().any(|&t| is_turbo(t)) && args.n_kv > 0;
        if turbo {
            let (k, v) = (kv_store_of(args.k_type), kv_store_of(args.v_type));
            check(k.supports(args.hd as usize) && v.supports(args.hd as usize), || format!("qk_norm_rope_kv: heads of {} in caches of {k} and {v}", args.hd))?;
            check(args.stage != 0 && args.turbo != 0, || "qk_norm_rope_kv: a turbo cache without its staging rows or tables".into())?;
        }
        let cfg = LaunchConfig { grid_dim: ((args.n_head + args.n_kv) as u32, rows as u32, 1), block_dim: ((args.hd / 2) as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.rope, cfg, args, "qk_norm_rope_kv")?;
        if turbo {
            // The turbo rows: a block per (KV head, row, K or V), the encoder's thread a value.
            let store = TurboStoreArgs {
                stage: args.stage,
                k_cache: args.k_cache,
                v_cache: args.v_cache,
                step: args.step,
                kv_slots: args.kv_slots,
                tab: args.turbo,
                ctx: args.ctx,
                n_kv: args.n_kv,
                hd: args.hd,
                k_type: args.k_type,
                v_type: args.v_type,
                pad: 0,
            };
            let cfg = LaunchConfig { grid_dim: (args.n_kv as u32, rows as u32, 2), block_dim: (args.hd as u32, 1, 1), shared_mem_bytes: 0 };
            self.launch(stream, &self.turbo_store, cfg, &store, "turbo_store")?;
        }
        Ok(())
    }

    /// The turbo types' tables on the device ([`crate::kv::turbo_tab`]), for
    /// [`RopeArgs::turbo`] and [`AttnArgs::turbo`].
    pub fn turbo_tab(&self, stream: &Arc<CudaStream>) -> DevPtr {
        self.turbo_tab.device_ptr(stream).0
    }

    /// Bytes of the K and the V cache of one layer: `n_kv` heads of `ctx` rows of `hd` values.
    pub fn kv_cache_bytes(types: KvTypes, n_kv: usize, ctx: usize, hd: usize) -> (usize, usize) {
        (n_kv * ctx * types.k.row_bytes(hd), n_kv * ctx * types.v.row_bytes(hd))
    }

    /// How many chunks one row's keys can span: the attention grid's width and the partials'
    /// `chunks_max`.
    pub fn attn_chunks_max(ctx: usize, window: usize) -> usize {
        let span = if window > 0 { window.min(ctx) } else { ctx };
        span.div_ceil(ATTN_CHUNK) + usize::from(window > 0)
    }

    /// Causal attention for `rows` rows, head dim `hd`.
    ///
    /// # Safety
    /// As for [`Kernels::norm_quant`]; `partials` holds `rows * n_head * chunks_max * (hd + 2)`
    /// floats and `counters` `MAX_ROWS * n_head` zeroed ints.
    pub unsafe fn attention(&self, stream: &Arc<CudaStream>, rows: usize, hd: usize, args: &AttnArgs) -> Result<(), GpuError> {
        let table = if (args.k_type, args.v_type) == (0, 0) { &self.attn } else { &self.attn_typed };
        let f = table.iter().find(|(d, _)| *d == hd).map(|(_, f)| f).ok_or_else(|| GpuError::Shape(format!("attention: head dim {hd} (64, 128, 256 or 512)")))?;
        check_kv_types(args.k_type, args.v_type)?;
        check_turbo_attention(args, hd)?;
        check(args.n_kv > 0 && args.n_head % args.n_kv == 0, || format!("attention: {} heads over {} KV heads", args.n_head, args.n_kv))?;
        let cfg = LaunchConfig { grid_dim: (args.chunks_max as u32, args.n_head as u32, rows as u32), block_dim: (ATTN_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, f, cfg, args, "attention")
    }

    /// Causal attention for a prompt's `rows` rows (the step block's `rows`): a block per 8 rows
    /// (4 at heads of 512) and query head, its warps over the rows' keys, each key's K/V loaded once for the block's rows
    /// (to float rounding of [`Kernels::attention`]'s rows). No partials or counters.
    ///
    /// # Safety
    /// As for [`Kernels::attention`], for `rows` rows.
    pub unsafe fn attention_prompt(&self, stream: &Arc<CudaStream>, rows: usize, hd: usize, args: &AttnArgs) -> Result<(), GpuError> {
        let table = if (args.k_type, args.v_type) == (0, 0) { &self.attn_prompt } else { &self.attn_prompt_typed };
        let f = table.iter().find(|(d, _)| *d == hd).map(|(_, f)| f).ok_or_else(|| GpuError::Shape(format!("attention: head dim {hd} (64, 128, 256 or 512)")))?;
        check_kv_types(args.k_type, args.v_type)?;
        check_turbo_attention(args, hd)?;
        check(args.n_kv > 0 && args.n_head % args.n_kv == 0, || format!("attention: {} heads over {} KV heads", args.n_head, args.n_kv))?;
        let per_block = if hd == 512 { ATTN_PROMPT_ROWS_512 } else { ATTN_PROMPT_ROWS };
        let cfg = LaunchConfig { grid_dim: (rows.div_ceil(per_block) as u32, args.n_head as u32, 1), block_dim: (ATTN_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, f, cfg, args, "attention_prompt")
    }

    /// The greedy id of each of `rows` rows of logits.
    ///
    /// # Safety
    /// As for [`Kernels::norm_quant`]; `cand_v`/`cand_i` hold `rows * ARGMAX_BLOCKS` values,
    /// `counters` `MAX_ROWS` zeroed ints.
    pub unsafe fn argmax(&self, stream: &Arc<CudaStream>, rows: usize, args: &ArgmaxArgs) -> Result<(), GpuError> {
        let cfg = LaunchConfig { grid_dim: (ARGMAX_BLOCKS as u32, rows as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.argmax, cfg, args, "argmax_rows")
    }
}

/// Warps (state columns) per block of `gated_delta_rule`.
pub const GDN_WARPS: usize = 4;
/// Warps (state columns) per block of `conv_gated_delta_rule`.
pub const CGDN_WARPS: usize = 16;
/// The widest conv kernel `conv_silu` takes (taps).
pub const CONV_MAX_K: usize = 5;

impl Kernels {
    /// The causal conv with SiLU over `args.rows` rows.
    ///
    /// # Safety
    /// As for [`Kernels::norm_quant`]: `x` and `y` hold `rows × c` floats, `w` `c × k`, `planes`
    /// `n_planes × (k - 1) × c`, and the step block's `plane` is below `n_planes`.
    pub unsafe fn conv_silu(&self, stream: &Arc<CudaStream>, args: &ConvArgs) -> Result<(), GpuError> {
        check((2..=CONV_MAX_K as i32).contains(&args.k), || format!("conv_silu: a kernel of {} taps (2..={CONV_MAX_K})", args.k))?;
        check(args.c > 0 && args.rows > 0 && args.n_planes >= 2, || format!("conv_silu: {} channels, {} rows, {} planes", args.c, args.rows, args.n_planes))?;
        let cfg = LaunchConfig { grid_dim: ((args.c as u32).div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.conv, cfg, args, "conv_silu")
    }

    /// The gated delta rule over `args.rows` rows.
    ///
    /// # Safety
    /// As for [`Kernels::norm_quant`]: the extents [`GdnArgs`] gives, the step block's `plane`
    /// below `n_planes`.
    pub unsafe fn gated_delta_rule(&self, stream: &Arc<CudaStream>, args: &GdnArgs) -> Result<(), GpuError> {
        check(matches!(args.d, 64 | 128 | 256), || format!("gated_delta_rule: state size {} (64, 128 or 256)", args.d))?;
        check(args.hk > 0 && args.hv % args.hk == 0 && args.rows > 0 && args.n_planes >= 2, || {
            format!("gated_delta_rule: {} value heads over {} key heads, {} rows, {} planes", args.hv, args.hk, args.rows, args.n_planes)
        })?;
        let cfg = LaunchConfig { grid_dim: (args.hv as u32, (args.d as usize / GDN_WARPS) as u32, 1), block_dim: ((GDN_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.gdn, cfg, args, "gated_delta_rule")
    }

    /// `conv_silu` then `gated_delta_rule` in one launch, for a step of up to [`MAX_ROWS`] rows
    /// (fewer than the planes): the same bits as the two launches.
    ///
    /// # Safety
    /// As for [`Kernels::conv_silu`] and [`Kernels::gated_delta_rule`] (the conv's `y` and the
    /// rule's `qkv` are not read).
    pub unsafe fn conv_gated_delta_rule(&self, stream: &Arc<CudaStream>, args: &ConvGdnArgs) -> Result<(), GpuError> {
        self.conv_gated_delta_rule_entries(stream, args, 1)
    }

    /// [`Kernels::conv_gated_delta_rule`] over a batched step's `entries` (`args.ent_rows` and
    /// `args.ent_planes` set, `entries` of them, each of at most [`MAX_ROWS`] rows fewer than
    /// the planes: the caller checks them, the kernel reads them from the device;
    /// `conv.rows`/`gdn.rows` any value the one-sequence check takes).
    ///
    /// # Safety
    /// As [`Kernels::conv_gated_delta_rule`]'s, for every entry's rows and planes.
    pub unsafe fn conv_gated_delta_rule_entries(&self, stream: &Arc<CudaStream>, args: &ConvGdnArgs, entries: usize) -> Result<(), GpuError> {
        check(entries >= 1 && (entries == 1 || args.ent_rows != 0), || format!("conv_gated_delta_rule: {entries} entries without an entry table"))?;
        let (c, g) = (&args.conv, &args.gdn);
        check((2..=CONV_MAX_K as i32).contains(&c.k), || format!("conv_gated_delta_rule: a kernel of {} taps (2..={CONV_MAX_K})", c.k))?;
        check(matches!(g.d, 64 | 128 | 256) && g.hk > 0 && g.hv % g.hk == 0, || format!("conv_gated_delta_rule: {} value heads over {} key heads of {}", g.hv, g.hk, g.d))?;
        check(c.c == (2 * g.hk + g.hv) * g.d, || format!("conv_gated_delta_rule: {} channels for {} key and {} value heads of {}", c.c, g.hk, g.hv, g.d))?;
        check(c.rows == g.rows && c.n_planes == g.n_planes && g.rows >= 1 && g.rows as usize <= MAX_ROWS && g.rows < g.n_planes, || {
            format!("conv_gated_delta_rule: {} and {} rows (1..={MAX_ROWS}), {} and {} planes (more than the rows)", c.rows, g.rows, c.n_planes, g.n_planes)
        })?;
        let cfg = LaunchConfig { grid_dim: (g.hv as u32, (g.d as usize / CGDN_WARPS) as u32, entries as u32), block_dim: ((CGDN_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.conv_gdn, cfg, args, "conv_gated_delta_rule")
    }

    /// `RMSNorm(o) · w · SiLU(z)` per value head for `rows` rows, as Q8 rows.
    ///
    /// # Safety
    /// As for [`Kernels::norm_quant`]: `o`, `z` and the Q8 planes hold `rows` rows of `hv × d`.
    pub unsafe fn gated_norm_quant(&self, stream: &Arc<CudaStream>, rows: usize, args: &GatedNormArgs) -> Result<(), GpuError> {
        check(args.d > 0 && args.d % 32 == 0 && args.d <= 256, || format!("gated_norm_quant: heads of {} values (a multiple of 32 up to 256)", args.d))?;
        let cfg = LaunchConfig { grid_dim: (args.hv as u32, rows as u32, 1), block_dim: (args.d as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.gated_norm, cfg, args, "gated_norm_quant")
    }

    /// Gemma 4's per-layer inputs of `rows` rows ([`PleArgs`]).
    ///
    /// # Safety
    /// As for [`Kernels::norm_quant`]: `proj` and `out` hold `rows` rows of `n_layer * p`
    /// values, `embd` a table of such rows for every token id of the step, `w` `p` values.
    pub unsafe fn ple_inputs(&self, stream: &Arc<CudaStream>, rows: usize, args: &PleArgs) -> Result<(), GpuError> {
        check(args.p > 0 && args.p % 32 == 0 && args.p <= 1024 && args.n_layer > 0, || format!("ple_inputs: {} layers of {} values (a multiple of 32 up to 1024)", args.n_layer, args.p))?;
        let cfg = LaunchConfig { grid_dim: (args.n_layer as u32, rows as u32, 1), block_dim: (args.p as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.ple, cfg, args, "ple_inputs")
    }

    /// Logit softcapping in place over `args.n` values.
    ///
    /// # Safety
    /// `args.x` holds `args.n` floats.
    pub unsafe fn softcap(&self, stream: &Arc<CudaStream>, args: &SoftcapArgs) -> Result<(), GpuError> {
        check(args.n > 0 && args.cap > 0.0, || format!("softcap: {} values, cap {}", args.n, args.cap))?;
        let blocks = (args.n as usize).div_ceil(256 * 8).min(1024);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.softcap, cfg, args, "softcap")
    }

    /// `rows` rows of `args.d` values to rotated low-bit KV rows (a block per row, a warp per
    /// group of 32).
    ///
    /// # Safety
    /// `args.x` holds `rows * d` floats, `args.out` `rows * row_bytes` bytes, the tables their
    /// floats.
    pub unsafe fn turbo_encode(&self, stream: &Arc<CudaStream>, rows: usize, args: &TurboArgs) -> Result<(), GpuError> {
        check(args.d % 32 == 0 && (128..=512).contains(&args.d) && (2..=4).contains(&args.bits) && rows > 0, || format!("turbo_encode: {rows} rows of {} values at {} bits", args.d, args.bits))?;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (args.d as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.turbo, cfg, args, "turbo_encode")
    }

    /// `moe_logits` over `rows` rows: the router's logits (and the shared gate's) into
    /// `args.logits`, a warp per expert over every SM.
    ///
    /// # Safety
    /// The buffers hold what [`MoeRouterArgs`] describes for `rows` rows.
    pub unsafe fn moe_logits(&self, stream: &Arc<CudaStream>, rows: usize, args: &MoeRouterArgs) -> Result<(), GpuError> {
        let n = args.n_expert as usize;
        check((1..=MOE_MAX_EXPERTS).contains(&n) && rows > 0 && args.logits != 0, || format!("moe_logits: {n} experts over {rows} rows"))?;
        let cfg = LaunchConfig { grid_dim: ((n + 1).div_ceil(8) as u32, rows as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.moe_logits, cfg, args, "moe_logits")
    }

    /// `moe_router` over `rows` rows, from the logits [`Kernels::moe_logits`] left.
    ///
    /// # Safety
    /// The buffers hold what [`MoeRouterArgs`] describes for `rows` rows.
    pub unsafe fn moe_router(&self, stream: &Arc<CudaStream>, rows: usize, args: &MoeRouterArgs) -> Result<(), GpuError> {
        let (n, used) = (args.n_expert as usize, args.used as usize);
        check((1..=MOE_MAX_EXPERTS).contains(&n) && (1..=MOE_MAX_USED.min(n)).contains(&used) && rows > 0 && args.logits != 0, || format!("moe_router: {used} of {n} experts over {rows} rows"))?;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.moe_router, cfg, args, "moe_router")
    }

    /// The routed experts' GEMVs: `pairs` (row, expert) pairs over `seg` (the stacked experts in
    /// the wide layout, `expert_bytes` apart; with `glu`, gate and up) of `k` values a row.
    ///
    /// # Safety
    /// `ids` holds `pairs` ids below the experts `seg.w` stacks; the activations hold the rows
    /// the pairs read, `seg.out` `pairs * out_stride` floats.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_moe(
        &self,
        stream: &Arc<CudaStream>,
        pairs: usize,
        k: usize,
        seg: GemvSeg,
        act: (DevPtr, DevPtr, DevPtr),
        ids: DevPtr,
        expert_bytes: usize,
        used: usize,
        act_pair: bool,
    ) -> Result<(), GpuError> {
        check(seg.wide != 0, || "gemv_moe: the experts in GGUF blocks (it reads the wide layout)".to_string())?;
        check(pairs > 0 && used > 0, || format!("gemv_moe: {pairs} pairs of {used} experts a row"))?;
        let bv = WeightType::from_ggml_id(seg.wtype).ok_or_else(|| GpuError::Shape(format!("gemv_moe: weight type {} is not one the kernels read", seg.wtype)))?.block_values();
        check(k.is_multiple_of(bv), || format!("gemv_moe: k = {k} is not a multiple of the weight type's {bv}"))?;
        let split = Self::wide_lanes(seg.n.max(0) as usize, k);
        let mut g = GemvArgs { nseg: 1, k: k as i32, split: split as i32, rows: 1, qs: act.0, qd: act.1, qsum: act.2, ..Default::default() };
        g.seg[0] = seg;
        let args = MoeGemvArgs { g, ids, expert_bytes: expert_bytes as i64, used: used as i32, act_pair: act_pair as i32 };
        let blocks = (seg.n as usize).div_ceil(GEMV_WARPS * (32 / split));
        let cfg = LaunchConfig { grid_dim: (blocks as u32, pairs as u32, 1), block_dim: ((GEMV_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.gemv_moe, cfg, &args, "gemv_moe")
    }

    /// `moe_sort`: the `pairs` pairs' expert ids at `ids` listed by expert (`n_expert` lists of
    /// up to `cap` at `list`, their counts at `counts`), for [`Kernels::mmq_moe`].
    ///
    /// # Safety
    /// `ids` holds `pairs` ids; `list` `n_expert · cap` i32, `counts` `n_expert`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn moe_sort(&self, stream: &Arc<CudaStream>, pairs: usize, n_expert: usize, cap: usize, ids: DevPtr, list: DevPtr, counts: DevPtr) -> Result<(), GpuError> {
        check(pairs > 0 && cap > 0 && (1..=MOE_MAX_EXPERTS).contains(&n_expert), || format!("moe_sort: {pairs} pairs over {n_expert} experts, {cap} a list"))?;
        let args = MoeSortArgs { ids, list, counts, pairs: pairs as i32, cap: cap as i32 };
        let cfg = LaunchConfig { grid_dim: (n_expert as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.moe_sort, cfg, &args, "moe_sort")
    }

    /// `mmq_moe`: a prompt step's routed experts as one tensor-core GEMM per expert over the
    /// pairs [`Kernels::moe_sort`] listed (`cap` the most an expert can have: the step's rows).
    /// Its rows match [`Kernels::gemv_moe`]'s to float rounding (the prompt GEMM's sums), not
    /// bit for bit; decode and verify steps keep `gemv_moe`.
    ///
    /// # Safety
    /// As [`Kernels::gemv_moe`]'s, over `moe_sort`'s lists of the same ids, `n_expert` of them.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn mmq_moe(
        &self,
        stream: &Arc<CudaStream>,
        n_expert: usize,
        cap: usize,
        k: usize,
        seg: GemvSeg,
        act: (DevPtr, DevPtr, DevPtr),
        sorted: (DevPtr, DevPtr),
        expert_bytes: usize,
        act_div: usize,
    ) -> Result<(), GpuError> {
        check(seg.wide != 0, || "mmq_moe: the experts in GGUF blocks (it reads the wide layout)".to_string())?;
        check(cap > 0 && act_div > 0 && (1..=MOE_MAX_EXPERTS).contains(&n_expert), || format!("mmq_moe: {n_expert} experts, {cap} pairs a list"))?;
        let bv = WeightType::from_ggml_id(seg.wtype).ok_or_else(|| GpuError::Shape(format!("mmq_moe: weight type {} is not one the kernels read", seg.wtype)))?.block_values();
        check(k.is_multiple_of(bv), || format!("mmq_moe: k = {k} is not a multiple of the weight type's {bv}"))?;
        let mut g = GemvArgs { nseg: 1, k: k as i32, split: 1, rows: 0, qs: act.0, qd: act.1, qsum: act.2, ..Default::default() };
        g.seg[0] = seg;
        let args = MoeMmqArgs { g, list: sorted.0, counts: sorted.1, expert_bytes: expert_bytes as i64, cap: cap as i32, act_div: act_div as i32 };
        let cfg = LaunchConfig { grid_dim: ((seg.n as usize).div_ceil(MMQ_ROWS) as u32, cap.div_ceil(MMQ_TOKENS) as u32, n_expert as u32), block_dim: (MMQ_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.mmq_moe, cfg, &args, "mmq_moe")
    }

    /// The routed experts' GEMV of a step's `rows` rows, `used` (row, expert) pairs each, the
    /// experts stacked `expert_bytes` apart: a prompt step (`grouped`) runs one GEMM per expert
    /// over its pairs ([`Kernels::mmq_moe`]; the gate·up call, `act_pair` false, first lists the
    /// pairs by expert into `sorted`, which the down call reads again), a decode or verify step a
    /// GEMV per pair ([`Kernels::gemv_moe`], batch-invariant). `act_pair`: each pair reads its
    /// own activation row (the down projection), else its row's.
    ///
    /// # Safety
    /// As [`Kernels::gemv_moe`]'s; `sorted` holds `n_expert · rows` and `n_expert` i32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn moe_gemv(
        &self,
        stream: &Arc<CudaStream>,
        grouped: bool,
        rows: usize,
        n_expert: usize,
        used: usize,
        k: usize,
        seg: GemvSeg,
        act: (DevPtr, DevPtr, DevPtr),
        ids: DevPtr,
        sorted: (DevPtr, DevPtr),
        expert_bytes: usize,
        act_pair: bool,
    ) -> Result<(), GpuError> {
        if !grouped {
            return self.gemv_moe(stream, rows * used, k, seg, act, ids, expert_bytes, used, act_pair);
        }
        if !act_pair {
            self.moe_sort(stream, rows * used, n_expert, rows, ids, sorted.0, sorted.1)?;
        }
        self.mmq_moe(stream, n_expert, rows, k, seg, act, sorted, expert_bytes, if act_pair { 1 } else { used })
    }

    /// `moe_combine` over `rows` rows.    /// `moe_combine` over `rows` rows.
    ///
    /// # Safety
    /// The buffers hold what [`MoeCombineArgs`] describes for `rows` rows.
    pub unsafe fn moe_combine(&self, stream: &Arc<CudaStream>, rows: usize, args: &MoeCombineArgs) -> Result<(), GpuError> {
        check(rows > 0 && args.k > 0 && args.used > 0, || format!("moe_combine: {rows} rows of {} values, {} experts", args.k, args.used))?;
        let cfg = LaunchConfig { grid_dim: ((args.k as u32).div_ceil(256), rows as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.moe_combine, cfg, args, "moe_combine")
    }

    /// The blocks per row of `topk_rows` for rows of `n` values (its scratch is `rows * blocks *
    /// TOPK_MAX` u64).
    pub fn topk_blocks(n: usize) -> usize {
        n.div_ceil(TOPK_SLICE)
    }

    /// The `k` best logits of each of `rows` rows of `n` (the sampler's order; banned ids left
    /// out).
    ///
    /// # Safety
    /// As for [`Kernels::norm_quant`]; the scratch and outputs as [`TopKArgs`] gives them.
    pub unsafe fn top_k(&self, stream: &Arc<CudaStream>, rows: usize, args: &TopKArgs) -> Result<(), GpuError> {
        let n = args.n as usize;
        check((1..=TOPK_MAX_N).contains(&n), || format!("top_k: rows of {n} values (1..={TOPK_MAX_N})"))?;
        check((1..=TOPK_MAX as i32).contains(&args.k), || format!("top_k: k = {} (1..={TOPK_MAX})", args.k))?;
        let cfg = LaunchConfig { grid_dim: (Self::topk_blocks(n) as u32, rows as u32, 1), block_dim: (512, 1, 1), shared_mem_bytes: 0 };
        self.launch(stream, &self.topk, cfg, args, "topk_rows")
    }
}

/// A layer's K and V caches as launches see them: device addresses and stored types.
#[derive(Debug, Clone, Copy, Default)]
pub struct KvPtrs {
    pub k: DevPtr,
    pub v: DevPtr,
    pub types: KvTypes,
}

/// One layer's K and V caches: `n_kv` heads of `ctx` rows of `hd` values each, `[n_kv][ctx][row]`
/// in their stored types ([`crate::kv`]).
pub struct KvLayer {
    pub k: cudarc::driver::CudaSlice<u8>,
    pub v: cudarc::driver::CudaSlice<u8>,
    pub types: KvTypes,
    pub n_kv: usize,
    pub ctx: usize,
    pub hd: usize,
}

impl KvLayer {
    /// Zeroed caches.
    pub fn new(stream: &Arc<CudaStream>, types: KvTypes, n_kv: usize, ctx: usize, hd: usize) -> Result<KvLayer, GpuError> {
        check(types.k.supports(hd) && types.v.supports(hd), || format!("a {}/{} KV cache of heads of {hd}", types.k, types.v))?;
        let (kb, vb) = Kernels::kv_cache_bytes(types, n_kv, ctx, hd);
        let drv = |source| GpuError::Driver { what: "allocating a KV cache", source };
        Ok(KvLayer { k: stream.alloc_zeros::<u8>(kb.max(1)).map_err(drv)?, v: stream.alloc_zeros::<u8>(vb.max(1)).map_err(drv)?, types, n_kv, ctx, hd })
    }

    pub fn ptrs(&self, stream: &Arc<CudaStream>) -> KvPtrs {
        use cudarc::driver::DevicePtr;
        KvPtrs { k: self.k.device_ptr(stream).0, v: self.v.device_ptr(stream).0, types: self.types }
    }

    /// The stored rows of positions `0..len`, `[n_kv][len][row]` bytes each for K and V (the
    /// layout of candle's cache: `KvType::stored_bytes` of a `(1, n_kv, len, row)` tensor).
    pub fn read(&self, stream: &Arc<CudaStream>, len: usize) -> Result<(Vec<u8>, Vec<u8>), GpuError> {
        check(len <= self.ctx, || format!("{len} positions of a cache of {}", self.ctx))?;
        let (kr, vr) = (self.types.k.row_bytes(self.hd), self.types.v.row_bytes(self.hd));
        let (mut k, mut v) = (vec![0u8; self.n_kv * len * kr], vec![0u8; self.n_kv * len * vr]);
        let drv = |source| GpuError::Driver { what: "reading a KV cache", source };
        for h in 0..self.n_kv {
            stream.memcpy_dtoh(&self.k.slice(h * self.ctx * kr..(h * self.ctx + len) * kr), &mut k[h * len * kr..(h + 1) * len * kr]).map_err(drv)?;
            stream.memcpy_dtoh(&self.v.slice(h * self.ctx * vr..(h * self.ctx + len) * vr), &mut v[h * len * vr..(h + 1) * len * vr]).map_err(drv)?;
        }
        Ok((k, v))
    }

    /// Sets positions `0..len` to the stored rows `k` and `v` ([`KvLayer::read`]'s layout);
    /// the sizes are checked first.
    pub fn write(&mut self, stream: &Arc<CudaStream>, len: usize, k: &[u8], v: &[u8]) -> Result<(), GpuError> {
        let (kr, vr) = (self.types.k.row_bytes(self.hd), self.types.v.row_bytes(self.hd));
        check(len <= self.ctx, || format!("{len} positions for a cache of {}", self.ctx))?;
        check(k.len() == self.n_kv * len * kr && v.len() == self.n_kv * len * vr, || {
            format!("K/V of {} and {} bytes, expected {} x {len} rows of {kr} and {vr} ({}/{})", k.len(), v.len(), self.n_kv, self.types.k, self.types.v)
        })?;
        let drv = |source| GpuError::Driver { what: "writing a KV cache", source };
        for h in 0..self.n_kv {
            stream.memcpy_htod(&k[h * len * kr..(h + 1) * len * kr], &mut self.k.slice_mut(h * self.ctx * kr..(h * self.ctx + len) * kr)).map_err(drv)?;
            stream.memcpy_htod(&v[h * len * vr..(h + 1) * len * vr], &mut self.v.slice_mut(h * self.ctx * vr..(h * self.ctx + len) * vr)).map_err(drv)?;
        }
        Ok(())
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.k.len() + self.v.len()
    }
}

/// The cache types a launch names are kernel ids of [`KvStore`].
fn check_kv_types(k: i32, v: i32) -> Result<(), GpuError> {
    let known = |t: i32| KvStore::ALL.iter().any(|s| s.kernel_id() == t);
    check(known(k) && known(v), || format!("KV cache types {k} and {v} (kernel ids of KvStore)"))
}

/// The type of kernel id `t` (a known one: [`check_kv_types`] first).
fn kv_store_of(t: i32) -> KvStore {
    KvStore::ALL.into_iter().find(|s| s.kernel_id() == t).unwrap_or_default()
}

fn is_turbo(t: i32) -> bool {
    kv_store_of(t).turbo_bits().is_some()
}

/// The attention's checks of a turbo cache: heads it stores, and the tables passed.
fn check_turbo_attention(args: &AttnArgs, hd: usize) -> Result<(), GpuError> {
    let (k, v) = (kv_store_of(args.k_type), kv_store_of(args.v_type));
    if k.turbo_bits().is_none() && v.turbo_bits().is_none() {
        return Ok(());
    }
    check(k.supports(hd) && v.supports(hd), || format!("attention: heads of {hd} in caches of {k} and {v}"))?;
    check(args.turbo != 0, || "attention: a turbo cache without its tables".into())
}

fn check(ok: bool, msg: impl FnOnce() -> String) -> Result<(), GpuError> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::Shape(msg()))
    }
}
