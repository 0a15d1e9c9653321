//! Tine's GPU decode engine, bottom layer: CUDA kernels for a decode step that is a fixed
//! sequence of launches over buffers allocated once (so that it can be captured as one CUDA
//! graph and replayed), with their float64 references.
//!
//! The kernels (`kernels/decode.cu`, compiled by nvcc to sm machine code when the `cuda` feature
//! is on) are:
//!
//! | kernel | does |
//! |---|---|
//! | `norm_quant` | optional post-norm + residual add, or pre-norm residual add, or the embedding row (any weight type the GEMV reads, in either layout), or `gelu(a) · b` (Gemma 4's per-layer input gate), RMSNorm, and the Q8 activation blocks the GEMVs read |
//! | `gemv_wide_m{1..8}` | quantized GEMV over M rows of weights in the wide layout ([`blocks::WeightType::to_wide`]: what the engine loads), 4 to 32 lanes a row from the launch's shape, up to four segments per launch (Q, K and V in one), optional GELU(tanh)·up or SiLU·up epilogue |
//! | `gemv_m{1..8}`, `gemv_staged_m{1..8}` | the same over GGUF blocks as the file has them (Q4_K, Q5_K, Q5_0, Q6_K, Q8_0; `TINE_GPU_WIDE=0`) |
//! | `qk_norm_rope_kv` | per-head q/k RMSNorm, RoPE (NeoX halves, over all or the first `n_rot` dims), the query scale, K/V written to the cache at the step's positions in its stored type ([`kv::KvStore`]: f32, f16, bf16, q8_0, q4_0; the quantized rows candle's CPU quantizer's bytes) (optionally V's weightless RMSNorm and V taken from K's projection: Gemma 4) |
//! | `attn_decode_hd{64,128,256,512}` | causal attention, GQA, sliding window, split over the keys by absolute position with the combine in the same launch, optional `sigmoid(gate)` on the output; `attn_decode_typed_hd*` read caches of any [`kv::KvStore`] (K and V apart) in place |
//! | `conv_silu` | the gated delta-net's causal conv with SiLU over a conv window kept in state planes |
//! | `gated_delta_rule` | the delta rule in its recurrent form over the step's rows in order, the state in planes ([`planes`]) |
//! | `conv_gated_delta_rule` | `conv_silu` and `gated_delta_rule` in one launch for decode and verify steps, the same bits |
//! | `gated_norm_quant` | `RMSNorm(o)·w·SiLU(z)` per value head, as Q8 rows |
//! | `argmax_rows` | greedy id per row (lowest id on ties), optionally fed back as the next step's token |
//! | `mmq` | a prompt step's GEMMs (more than 8 rows): the GEMV's segments and epilogue as int8 tensor-core tiles, over either layout |
//! | `attn_prompt_hd{64,128,256,512}` | a prompt step's attention: a block per 8 rows (4 at heads of 512) and query head, a running softmax per warp (`attn_prompt_typed_hd*`: any stored type) |
//! | `ple_inputs` | Gemma 4's per-layer inputs of a step's rows: the per-layer projection's RMSNorm per layer plus the per-layer token embedding gathered in place |
//! | `softcap` | logit softcapping, `tanh(x / c) · c` |
//! | `turbo_encode` | rows to the rotated low-bit KV rows of candle-nn's `kv_turbo` (turbo4/3/2), bit for bit (kernel table only so far) |
//! | `topk_rows` | the k best logits of each row (k <= 64) under the sampler's order, banned ids left out |
//! | `moe_logits` | the router's logits of a step's rows (f32 weights, and the shared expert's gate), a warp per expert over every SM |
//! | `moe_router` | from a row's logits: softmax, the top `used` experts (lower index first among equals) renormalised, and the shared expert's sigmoid gate |
//! | `gemv_moe` | the routed experts' GEMVs: each (row, expert) pair as `gemv_wide_m1` over that expert of the stacked weights, optional SiLU·up |
//! | `moe_combine` | the experts' rows weighted and summed in order, plus the gated shared expert |
//!
//! Every decode kernel computes a row (one token of a step) with the same operations in the same
//! order whatever the number of rows M of the step (1..=8), so a verify step reproduces one-token
//! decodes bit for bit. The prompt kernels sum in another order: a prompt's rows match one-token
//! steps to float rounding. Positions and tokens are read from a [`StepParams`](cuda::StepParams) block in device
//! memory, so a graph captured once serves every position.
//!
//! Without the `cuda` feature the crate is [`blocks`] (weight and activation formats),
//! [`kv`] (the KV caches' stored rows), [`config`] (a GGUF's shape as the engine reads it), [`planes`] (the recurrent state ring's
//! bookkeeping) and [`reference`] (the kernels in float64, and the GEMV's lane split on the
//! CPU), which CI tests.

pub mod blocks;
pub mod config;
pub mod kv;

/// The most experts `moe_router` routes over, and the most it picks for a row.
pub const MOE_MAX_EXPERTS: usize = 512;
pub const MOE_MAX_USED: usize = 16;

pub mod planes;
pub mod reference;
pub mod rows;

#[cfg(feature = "cuda")]
pub mod batch;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod gemma3;
#[cfg(feature = "cuda")]
pub mod gemma4;
#[cfg(feature = "cuda")]
pub mod qwen35;
#[cfg(feature = "cuda")]
mod readout;
