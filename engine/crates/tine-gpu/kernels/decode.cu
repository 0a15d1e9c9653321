// Tine's GPU decode kernels: the building blocks of a decode step that is a fixed sequence of
// launches over buffers allocated once (see ../src/lib.rs for the contract of each kernel).
//
// The one rule every kernel here keeps: the arithmetic for one row (one token of a step) is the
// same operations in the same order whatever the number of rows M of the step. A verify step of
// M rows then reproduces M one-token decodes bit for bit, which is what makes speculative decoding
// on the GPU lossless. Concretely: a row is never split across threads differently for another M,
// reductions use a fixed tree over a fixed partition (never atomics on floats), and attention
// partitions the keys by absolute position, not by how many rows share the launch.
//
// Activations enter quantized GEMVs as Q8 blocks of 32 values in three planes: int8 quants,
// a float scale per block and the int sum of the block's quants (for the weight types whose
// dequantization has an offset or a min).

#include <cstdint>
#include <cuda_fp16.h>

#define WARP 32
#define QK 32
#define MAX_ROWS 8

// ---------------------------------------------------------------------------------------------
// GGUF block layouts (as ggml writes them).

struct __align__(2) BlockQ8_0 { half d; int8_t qs[32]; };                          // 34 bytes
struct __align__(2) BlockQ5_0 { half d; uint8_t qh[4]; uint8_t qs[16]; };            // 22 bytes
struct __align__(2) BlockQ4_K { half d; half dmin; uint8_t scales[12]; uint8_t qs[128]; }; // 144
struct __align__(2) BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; half d; }; // 210

static_assert(sizeof(BlockQ8_0) == 34, "Q8_0");
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0");
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K");
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K");

// Weight type codes: ggml's own numbers.
enum WType : int { W_Q5_0 = 6, W_Q8_0 = 8, W_Q4_K = 12, W_Q6_K = 14 };

// Four bytes from a 2-byte aligned address (GGUF blocks of 22 and 34 bytes are only that aligned).
__device__ __forceinline__ int load_i32_a2(const uint8_t* p) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return (int)h[0] | ((int)h[1] << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of `v` over the block, the same fixed tree for every call with the same blockDim:
// each warp's xor tree, then warp 0 over the warps' sums in warp order. `red` holds 32 floats.
__device__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.0f;
    t = warp_sum(t);
    return t;  // valid in warp 0; broadcast below
}
__device__ float block_sum_all(float v, float* red) {
    float t = block_sum(v, red);
    __syncthreads();
    if (threadIdx.x == 0) red[0] = t;
    __syncthreads();
    float r = red[0];
    __syncthreads();
    return r;
}

// ---------------------------------------------------------------------------------------------
// Step parameters, read by the kernels from device memory so that one captured graph serves
// every position.

struct StepParams {
    int pos;              // position of row 0 of this step
    int rows;             // rows of this step (informative; kernels are specialised on M)
    int tokens[MAX_ROWS]; // the token ids of the rows
};

// ---------------------------------------------------------------------------------------------
// Norm + residual + quantize.
//
// One block per row m. Modes:
//   in_mode 0: t = a                                       (a: [M, k] f32)
//   in_mode 1: t = res + rmsnorm(a) * w_a                   (post-norm and residual add)
//   in_mode 2: t = dequant(embd[token_m]) * embd_scale      (layer 0: the Q8_0 embedding row)
// If res_out is set, t is stored there (the residual stream). Then
//   y = norm ? rmsnorm(t) * w : t
// is written as Q8 blocks (qs/d/sum) and, if y_out is set, as f32.

struct NormQuantArgs {
    const float* a; const float* res; const float* w_a;
    const uint8_t* embd; float embd_scale; const StepParams* step;
    const float* w; float eps;
    float* res_out; float* y_out;
    int8_t* qs; float* qd; int* qsum;
    int k; int in_mode; int norm;
};

__device__ __forceinline__ float embd_value(const uint8_t* embd, int k, int token, int i) {
    const BlockQ8_0* row = reinterpret_cast<const BlockQ8_0*>(embd) + (size_t)token * (k / QK);
    const BlockQ8_0& b = row[i / QK];
    return __half2float(b.d) * (float)b.qs[i % QK];
}

__device__ __forceinline__ float nq_input(const NormQuantArgs& p, int m, int i, float ra) {
    if (p.in_mode == 2) return embd_value(p.embd, p.k, p.step->tokens[m], i) * p.embd_scale;
    const float ai = p.a[(size_t)m * p.k + i];
    if (p.in_mode == 1) return p.res[(size_t)m * p.k + i] + ai * ra * p.w_a[i];
    return ai;
}

extern "C" __global__ void __launch_bounds__(256) norm_quant(NormQuantArgs p) {
    __shared__ float red[32];
    const int m = blockIdx.x, k = p.k, tid = threadIdx.x, nt = blockDim.x;
    float ra = 1.0f;
    if (p.in_mode == 1) {
        float s = 0.0f;
        for (int i = tid; i < k; i += nt) { float v = p.a[(size_t)m * k + i]; s += v * v; }
        s = block_sum_all(s, red);
        ra = rsqrtf(s / (float)k + p.eps);
    }
    float rt = 1.0f;
    if (p.norm || p.res_out) {
        float s = 0.0f;
        for (int i = tid; i < k; i += nt) {
            float t = nq_input(p, m, i, ra);
            if (p.res_out) p.res_out[(size_t)m * k + i] = t;
            s += t * t;
        }
        if (p.norm) {
            s = block_sum_all(s, red);
            rt = rsqrtf(s / (float)k + p.eps);
        }
    }
    __syncthreads();  // res_out (possibly the same memory as res) is complete
    // Quantize: each warp takes whole blocks of 32 values, one value per lane.
    const int lane = tid % WARP, warp = tid / WARP, nw = nt / WARP;
    for (int b = warp; b < k / QK; b += nw) {
        const int i = b * QK + lane;
        float y = p.res_out ? p.res_out[(size_t)m * k + i] : nq_input(p, m, i, ra);
        if (p.norm) y = y * rt * p.w[i];
        if (p.y_out) p.y_out[(size_t)m * k + i] = y;
        const float amax = warp_max(fabsf(y));
        const float d = amax / 127.0f;
        const int q = d == 0.0f ? 0 : (int)rintf(y / d);
        p.qs[(size_t)m * k + i] = (int8_t)q;
        const int sum = warp_sum_i(q);
        if (lane == 0) { p.qd[(size_t)m * (k / QK) + b] = d; p.qsum[(size_t)m * (k / QK) + b] = sum; }
    }
}

// ---------------------------------------------------------------------------------------------
// Quantized GEMV over M activation rows: out[m][r] = sum_i W[r][i] * y[m][i].
//
// One warp per output row. The row's k values are cut into units of 32 (a Q8_0/Q5_0 block, or a
// sub-block of a K-quant super-block); lane l takes 8 values of unit u = it*8 + l/4 at offset
// 8*(l%4), for it = 0, 1, ... Each lane keeps one float accumulator per activation row and adds
// its units' contributions in unit order; the warp then sums its lanes with a fixed xor tree.
// Nothing in that depends on M: row m's result is the same bits for any M.
//
// A launch covers up to 4 segments (for example Q, K and V, each its own weight type), each
// with its own output. With `glu`, a segment's warp computes a gate row and an up row of two
// weights and stores gelu_tanh(gate) * up.

struct GemvSeg {
    const uint8_t* w;   // weights, rows of k values as GGUF blocks
    const uint8_t* w2;  // the up weights when glu
    float* out;         // out[m * out_stride + r]
    int n;              // rows
    int type;           // WType
    int out_stride;
    int glu;
    int block_start;    // first block of the grid that works on this segment
};

struct GemvArgs {
    GemvSeg seg[4];
    int nseg;
    int k;
    const int8_t* qs; const float* qd; const int* qsum;
};

#define GEMV_WARPS 4

template <int T> struct WInfo;
template <> struct WInfo<W_Q8_0> { static constexpr int BV = 32, BB = 34; };
template <> struct WInfo<W_Q5_0> { static constexpr int BV = 32, BB = 22; };
template <> struct WInfo<W_Q4_K> { static constexpr int BV = 256, BB = 144; };
template <> struct WInfo<W_Q6_K> { static constexpr int BV = 256, BB = 210; };

// The 8 weight values of (row, unit u, lane quarter l4) as two int8x4, and the factors:
// the unit's contribution to a row m is  fw * d_m * dot(w, a_m) + fmin * d_m * sum_m
// (fmin only on the quarter l4 == 0, so that it is added once per unit).
template <int T>
__device__ __forceinline__ void load_unit(const uint8_t* row, int u, int l4, int& w0, int& w1, float& fw, float& fmin) {
    if constexpr (T == W_Q8_0) {
        const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row) + u;
        const uint8_t* q = reinterpret_cast<const uint8_t*>(b->qs) + 8 * l4;
        w0 = load_i32_a2(q);
        w1 = load_i32_a2(q + 4);
        fw = __half2float(b->d);
        fmin = 0.0f;
    } else if constexpr (T == W_Q5_0) {
        const BlockQ5_0* b = reinterpret_cast<const BlockQ5_0*>(row) + u;
        const uint32_t qh = (uint32_t)load_i32_a2(b->qh);
        const int j0 = 8 * (l4 & 1);        // first byte of qs
        const int hi = l4 >> 1;             // high nibbles (values 16..31)
        const int vbase = 8 * l4;           // first value index (bit of qh)
        int ws[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t qs4 = (uint32_t)load_i32_a2(b->qs + j0 + 4 * h);
            const uint32_t nib = hi ? (qs4 >> 4) & 0x0F0F0F0Fu : qs4 & 0x0F0F0F0Fu;
            uint32_t v = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int bit = (qh >> (vbase + 4 * h + e)) & 1;
                const int val = (int)((nib >> (8 * e)) & 0xF) | (bit << 4);
                v |= (uint32_t)((val - 16) & 0xFF) << (8 * e);
            }
            ws[h] = (int)v;
        }
        w0 = ws[0]; w1 = ws[1];
        fw = __half2float(b->d);
        fmin = 0.0f;
    } else if constexpr (T == W_Q4_K) {
        const BlockQ4_K* b = reinterpret_cast<const BlockQ4_K*>(row) + u / 8;
        const int j = u % 8;
        const uint8_t* q = b->qs + 32 * (j / 2) + 8 * l4;
        const uint32_t a0 = *reinterpret_cast<const uint32_t*>(q);  // qs is at offset 16: 4-aligned within the block, and 144 is a multiple of 4
        const uint32_t a1 = *reinterpret_cast<const uint32_t*>(q + 4);
        const int sh = 4 * (j & 1);
        w0 = (int)((a0 >> sh) & 0x0F0F0F0Fu);
        w1 = (int)((a1 >> sh) & 0x0F0F0F0Fu);
        const uint8_t* s = b->scales;
        int sc, mn;
        if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
        else { sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
        fw = __half2float(b->d) * (float)sc;
        fmin = l4 == 0 ? -__half2float(b->dmin) * (float)mn : 0.0f;
    } else {  // W_Q6_K
        const BlockQ6_K* b = reinterpret_cast<const BlockQ6_K*>(row) + u / 8;
        const int j = u % 8, n = j / 4, t = j % 4;
        const int l = 8 * l4;  // first of the 8 values within the 32
        const uint8_t* ql = b->ql + 64 * n + (t & 1) * 32 + l;
        const uint8_t* qh = b->qh + 32 * n + l;
        const int qsh = (t >> 1) * 4, hsh = 2 * t;
        int ws[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t lo4 = (uint32_t)load_i32_a2(ql + 4 * h);
            const uint32_t hi4 = (uint32_t)load_i32_a2(qh + 4 * h);
            const uint32_t v = ((lo4 >> qsh) & 0x0F0F0F0Fu) | (((hi4 >> hsh) & 0x03030303u) << 4);
            ws[h] = (int)__vsubss4(v, 0x20202020u);
        }
        w0 = ws[0]; w1 = ws[1];
        fw = __half2float(b->d) * (float)b->scales[8 * n + 2 * t + (l / 16)];
        fmin = 0.0f;
    }
}

template <int T, int M, bool GLU>
__device__ __forceinline__ void gemv_row(const GemvArgs& p, const GemvSeg& s, int r) {
    const int lane = threadIdx.x % WARP, l4 = lane % 4;
    const int k = p.k, units = k / QK, kb = k / QK;
    const size_t row_bytes = (size_t)(k / WInfo<T>::BV) * WInfo<T>::BB;
    const uint8_t* row = s.w + (size_t)r * row_bytes;
    const uint8_t* row2 = GLU ? s.w2 + (size_t)r * row_bytes : nullptr;
    float acc[M], acc2[GLU ? M : 1];
#pragma unroll
    for (int m = 0; m < M; ++m) { acc[m] = 0.0f; if (GLU) acc2[m] = 0.0f; }
    for (int u = lane / 4; u < units; u += WARP / 4) {
        int w0, w1, v0 = 0, v1 = 0; float fw, fmin, gw = 0.0f, gmin = 0.0f;
        load_unit<T>(row, u, l4, w0, w1, fw, fmin);
        if (GLU) load_unit<T>(row2, u, l4, v0, v1, gw, gmin);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const int2 a = *reinterpret_cast<const int2*>(p.qs + (size_t)m * k + 32 * u + 8 * l4);
            const float d = p.qd[(size_t)m * kb + u];
            const float sm = (float)p.qsum[(size_t)m * kb + u];
            const int dot = __dp4a(w1, a.y, __dp4a(w0, a.x, 0));
            acc[m] += d * (fw * (float)dot + fmin * sm);
            if (GLU) {
                const int dot2 = __dp4a(v1, a.y, __dp4a(v0, a.x, 0));
                acc2[m] += d * (gw * (float)dot2 + gmin * sm);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float v = warp_sum(acc[m]);
        if (GLU) {
            const float up = warp_sum(acc2[m]);
            const float g = v;
            v = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * up;
        }
        if (lane == 0) s.out[(size_t)m * s.out_stride + r] = v;
    }
}


template <int M>
__device__ __forceinline__ void gemv_body(const GemvArgs& p) {
    int si = 0;
#pragma unroll
    for (int i = 1; i < 4; ++i) if (i < p.nseg && (int)blockIdx.x >= p.seg[i].block_start) si = i;
    const GemvSeg& s = p.seg[si];
    const int r = ((int)blockIdx.x - s.block_start) * GEMV_WARPS + (int)threadIdx.x / WARP;
    if (r >= s.n) return;
    switch (s.type * 2 + (s.glu ? 1 : 0)) {
        case W_Q8_0 * 2: gemv_row<W_Q8_0, M, false>(p, s, r); break;
        case W_Q5_0 * 2: gemv_row<W_Q5_0, M, false>(p, s, r); break;
        case W_Q4_K * 2: gemv_row<W_Q4_K, M, false>(p, s, r); break;
        case W_Q6_K * 2: gemv_row<W_Q6_K, M, false>(p, s, r); break;
        case W_Q8_0 * 2 + 1: gemv_row<W_Q8_0, M, true>(p, s, r); break;
        case W_Q5_0 * 2 + 1: gemv_row<W_Q5_0, M, true>(p, s, r); break;
        case W_Q4_K * 2 + 1: gemv_row<W_Q4_K, M, true>(p, s, r); break;
        case W_Q6_K * 2 + 1: gemv_row<W_Q6_K, M, true>(p, s, r); break;
        default: break;
    }
}
#define GEMV_INST(M) extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP) gemv_m##M(const GemvArgs p) { gemv_body<M>(p); }
GEMV_INST(1) GEMV_INST(2) GEMV_INST(3) GEMV_INST(4) GEMV_INST(5) GEMV_INST(6) GEMV_INST(7) GEMV_INST(8)

// ---------------------------------------------------------------------------------------------
// Per-head RMSNorm of q and k, RoPE (NeoX halves: pair (i, i + hd/2)), the query scale, and the
// K/V rows written into the cache at positions pos + m.
//
// Grid: (n_head + n_kv, M); block: hd/2 threads, each owning the pair (i, i + hd/2).
// q, k, v: [M, heads * hd] f32 (the QKV GEMV's outputs). q is rewritten in place.
// Cache layout: [n_kv][ctx][hd] f32.

struct RopeArgs {
    float* q; const float* k; const float* v;
    const float* q_norm; const float* k_norm; float eps;
    const float* inv_freq;  // [hd/2]
    float q_scale;
    float* k_cache; float* v_cache; int ctx;
    const StepParams* step;
    int n_head; int n_kv; int hd;
};

extern "C" __global__ void __launch_bounds__(256) qk_norm_rope_kv(RopeArgs p) {
    __shared__ float red[32];
    const int h = blockIdx.x, m = blockIdx.y, i = threadIdx.x, half_hd = p.hd / 2;
    const bool is_q = h < p.n_head;
    const int kvh = is_q ? 0 : h - p.n_head;
    const int pos = p.step->pos + m;
    const float* src = is_q ? p.q + ((size_t)m * p.n_head + h) * p.hd : p.k + ((size_t)m * p.n_kv + kvh) * p.hd;
    const float x0 = src[i], x1 = src[i + half_hd];
    const float ss = block_sum_all(x0 * x0 + x1 * x1, red);
    const float r = rsqrtf(ss / (float)p.hd + p.eps);
    const float* w = is_q ? p.q_norm : p.k_norm;
    const float y0 = x0 * r * w[i], y1 = x1 * r * w[i + half_hd];
    const float ang = (float)pos * p.inv_freq[i];
    float sn, cs;
    sincosf(ang, &sn, &cs);
    const float o0 = y0 * cs - y1 * sn, o1 = y1 * cs + y0 * sn;
    if (is_q) {
        float* dst = p.q + ((size_t)m * p.n_head + h) * p.hd;
        dst[i] = o0 * p.q_scale;
        dst[i + half_hd] = o1 * p.q_scale;
    } else {
        float* kd = p.k_cache + ((size_t)kvh * p.ctx + pos) * p.hd;
        kd[i] = o0;
        kd[i + half_hd] = o1;
        const float* vs = p.v + ((size_t)m * p.n_kv + kvh) * p.hd;
        float* vd = p.v_cache + ((size_t)kvh * p.ctx + pos) * p.hd;
        vd[i] = vs[i];
        vd[i + half_hd] = vs[i + half_hd];
    }
}

// ---------------------------------------------------------------------------------------------
// Decode attention, split over the keys by absolute position.
//
// Row m (at position pos + m) sees keys [lo, hi] with hi = pos + m and lo = max(0, hi - window + 1)
// (window 0: no window). The keys are cut into chunks of ATTN_CHUNK by absolute index; block
// (c, kv head, m) takes chunk lo / ATTN_CHUNK + c for all the query heads of that KV head and
// writes a partial (max, sum of exponentials, weighted V). The last of a row's chunks to finish
// (a counter per (m, kv head)) combines the partials in chunk order. A chunk's arithmetic
// depends only on the absolute key range and the query, never on M.
//
// Grid: (max chunks a row can span, n_kv, M); block: 128 threads.
// q: [M, n_head, hd] f32 (scaled). out: [M, n_head * hd] f32.
// partials: [M][n_head][chunks_max] * (hd + 2) floats. counters: [M_MAX * n_kv] ints, zero at
// the start and left at zero.

#define ATTN_CHUNK 128
#define ATTN_THREADS 128
#define MAX_REP 8

struct AttnArgs {
    const float* q; const float* k_cache; const float* v_cache;
    float* out; float* partials; int* counters;
    const StepParams* step;
    int ctx; int window; int n_head; int n_kv; int chunks_max;
};

template <int HD>
__device__ void attn_body(const AttnArgs& p) {
    __shared__ float scores[MAX_REP][ATTN_CHUNK];
    __shared__ float qs[MAX_REP][HD];
    __shared__ float stat[MAX_REP][2];
    __shared__ int last;
    const int c = blockIdx.x, g = blockIdx.y, m = blockIdx.z;
    const int n_rep = p.n_head / p.n_kv;
    const int hi = p.step->pos + m;
    const int lo = p.window > 0 ? max(0, hi - p.window + 1) : 0;
    const int c0 = lo / ATTN_CHUNK, nchunks = hi / ATTN_CHUNK - c0 + 1;
    if (c >= nchunks) return;
    const int k0 = max(lo, (c0 + c) * ATTN_CHUNK), k1 = min(hi, (c0 + c + 1) * ATTN_CHUNK - 1);
    const int nk = k1 - k0 + 1;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    for (int h = 0; h < n_rep; ++h)
        for (int d = tid; d < HD; d += ATTN_THREADS) qs[h][d] = p.q[((size_t)m * p.n_head + g * n_rep + h) * HD + d];
    __syncthreads();
    const float* kc = p.k_cache + (size_t)g * p.ctx * HD;
    const float* vc = p.v_cache + (size_t)g * p.ctx * HD;
    // Scores: warp w takes keys k0 + w, k0 + w + 4, ...; lane l the dims l, l + 32, ...
    for (int j = warp; j < nk; j += ATTN_THREADS / WARP) {
        const float* kr = kc + (size_t)(k0 + j) * HD;
        float kv[HD / WARP];
#pragma unroll
        for (int e = 0; e < HD / WARP; ++e) kv[e] = kr[lane + WARP * e];
        for (int h = 0; h < n_rep; ++h) {
            float s = 0.0f;
#pragma unroll
            for (int e = 0; e < HD / WARP; ++e) s += qs[h][lane + WARP * e] * kv[e];
            s = warp_sum(s);
            if (lane == 0) scores[h][j] = s;
        }
    }
    __syncthreads();
    // Max and exponentials per head: warp h (h < n_rep, n_rep <= 4 per pass) over the chunk.
    for (int h = warp; h < n_rep; h += ATTN_THREADS / WARP) {
        float mx = -INFINITY;
        for (int j = lane; j < nk; j += WARP) mx = fmaxf(mx, scores[h][j]);
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int j = lane; j < nk; j += WARP) { const float e = expf(scores[h][j] - mx); scores[h][j] = e; sum += e; }
        sum = warp_sum(sum);
        if (lane == 0) { stat[h][0] = mx; stat[h][1] = sum; }
    }
    __syncthreads();
    // Weighted V: thread t owns dims t, t + 128, ...; keys in order.
    float* part = p.partials + ((size_t)m * p.n_head + g * n_rep) * p.chunks_max * (HD + 2);
    for (int h = 0; h < n_rep; ++h) {
        float* ph = part + ((size_t)h * p.chunks_max + c) * (HD + 2);
        for (int d = tid; d < HD; d += ATTN_THREADS) {
            float o = 0.0f;
            for (int j = 0; j < nk; ++j) o += scores[h][j] * vc[(size_t)(k0 + j) * HD + d];
            ph[2 + d] = o;
        }
        if (tid == 0) { ph[0] = stat[h][0]; ph[1] = stat[h][1]; }
    }
    // The last chunk of this (m, g) to finish combines.
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const int done = atomicAdd(&p.counters[m * p.n_kv + g], 1);
        last = done == nchunks - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int h = 0; h < n_rep; ++h) {
        const float* ph = part + (size_t)h * p.chunks_max * (HD + 2);
        float mx = -INFINITY;
        for (int cc = 0; cc < nchunks; ++cc) mx = fmaxf(mx, __ldcg(ph + (size_t)cc * (HD + 2)));
        float den = 0.0f;
        for (int cc = 0; cc < nchunks; ++cc) den += __ldcg(ph + (size_t)cc * (HD + 2) + 1) * expf(__ldcg(ph + (size_t)cc * (HD + 2)) - mx);
        for (int d = tid; d < HD; d += ATTN_THREADS) {
            float o = 0.0f;
            for (int cc = 0; cc < nchunks; ++cc) {
                const float* pc = ph + (size_t)cc * (HD + 2);
                o += __ldcg(pc + 2 + d) * expf(__ldcg(pc) - mx);
            }
            p.out[((size_t)m * p.n_head + g * n_rep + h) * HD + d] = o / den;
        }
    }
    if (tid == 0) p.counters[m * p.n_kv + g] = 0;
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_hd64(const AttnArgs p) { attn_body<64>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_hd128(const AttnArgs p) { attn_body<128>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_hd256(const AttnArgs p) { attn_body<256>(p); }

// ---------------------------------------------------------------------------------------------
// Greedy argmax over each row of logits [M, n]: the largest value, the lowest id on ties (as the
// sampler does). Grid: (ARGMAX_BLOCKS, M); each block scans a fixed slice, the last block of a row
// to finish reduces the blocks' candidates in block order. Writes ids[m] and, if feed is set,
// step->tokens[m] (the next step's input, without a trip through the host).

#define ARGMAX_BLOCKS 128
#define ARGMAX_THREADS 256

struct ArgmaxArgs {
    const float* logits; int n;
    float* cand_v; int* cand_i;  // [M][ARGMAX_BLOCKS]
    int* counters;               // [MAX_ROWS], zero at the start and left at zero
    int* ids;                    // [M]
    StepParams* feed;            // or null
};

__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}
__device__ void block_argmax(float& v, int& i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nw = blockDim.x / WARP;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        better(v, i, v2, i2);
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? sv[lane] : -INFINITY;
        i = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
            const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
            better(v, i, v2, i2);
        }
    }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows(const ArgmaxArgs p) {
    __shared__ int last;
    const int b = blockIdx.x, m = blockIdx.y, nb = gridDim.x;
    const int per = (p.n + nb - 1) / nb;
    const int i0 = b * per, i1 = min(p.n, i0 + per);
    float v = -INFINITY; int id = 0x7fffffff;
    for (int i = i0 + (int)threadIdx.x; i < i1; i += blockDim.x) better(v, id, p.logits[(size_t)m * p.n + i], i);
    block_argmax(v, id);
    if (threadIdx.x == 0) {
        p.cand_v[m * nb + b] = v;
        p.cand_i[m * nb + b] = id;
        __threadfence();
        last = atomicAdd(&p.counters[m], 1) == nb - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    v = -INFINITY; id = 0x7fffffff;
    for (int j = threadIdx.x; j < nb; j += blockDim.x) better(v, id, __ldcg(p.cand_v + m * nb + j), __ldcg(p.cand_i + m * nb + j));
    block_argmax(v, id);
    if (threadIdx.x == 0) {
        p.ids[m] = id;
        if (p.feed) p.feed->tokens[m] = id;
        p.counters[m] = 0;
    }
}

// The argument blocks' sizes, asserted on the Rust side too (src/cuda.rs).
static_assert(sizeof(StepParams) == 40, "StepParams");
static_assert(sizeof(NormQuantArgs) == 120, "NormQuantArgs");
static_assert(sizeof(GemvSeg) == 48, "GemvSeg");
static_assert(sizeof(GemvArgs) == 224, "GemvArgs");
static_assert(sizeof(RopeArgs) == 112, "RopeArgs");
static_assert(sizeof(AttnArgs) == 80, "AttnArgs");
static_assert(sizeof(ArgmaxArgs) == 56, "ArgmaxArgs");
