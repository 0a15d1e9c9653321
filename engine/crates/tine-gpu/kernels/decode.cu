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
struct __align__(2) BlockQ5_K { half d; half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; }; // 176

static_assert(sizeof(BlockQ8_0) == 34, "Q8_0");
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0");
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K");
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K");
static_assert(sizeof(BlockQ5_K) == 176, "Q5_K");

// Weight type codes: ggml's own numbers.
enum WType : int { W_Q5_0 = 6, W_Q8_0 = 8, W_Q4_K = 12, W_Q5_K = 13, W_Q6_K = 14 };

// Bytes of a row of k values in the wide layout (see gemv_wide), and the embedding type bit that
// says a table is in it. The same bytes as the GGUF blocks, padded to 16.
#define EMBD_WIDE 0x100
__host__ __device__ __forceinline__ size_t wide_row_bytes(int type, int k) {
    size_t b;
    switch (type) {
        case W_Q8_0: b = (size_t)k / 32 * 34; break;
        case W_Q5_0: b = (size_t)k / 32 * 22; break;
        case W_Q4_K: b = (size_t)k / 256 * 144; break;
        case W_Q5_K: b = (size_t)k / 256 * 176; break;
        default: b = (size_t)k / 256 * 210; break;
    }
    return (b + 15) & ~(size_t)15;
}

// Four bytes from a 2-byte aligned address (GGUF blocks of 22 and 34 bytes are only that aligned).
// Weight loads: from global memory read-only for the whole kernel (through the non-coherent
// cache), or (SM) from a copy the block staged in shared memory.
template <bool SM> __device__ __forceinline__ unsigned short ld_u16(const void* p) {
    if constexpr (SM) return *reinterpret_cast<const unsigned short*>(p);
    else return __ldg(reinterpret_cast<const unsigned short*>(p));
}
template <bool SM> __device__ __forceinline__ uint32_t ld_u32(const void* p) {
    if constexpr (SM) return *reinterpret_cast<const unsigned int*>(p);
    else return __ldg(reinterpret_cast<const unsigned int*>(p));
}
template <bool SM> __device__ __forceinline__ int ld_u8(const void* p) {
    if constexpr (SM) return *reinterpret_cast<const uint8_t*>(p);
    else return __ldg(reinterpret_cast<const unsigned char*>(p));
}
// Four bytes from a 2-byte aligned address (GGUF blocks of 22 and 34 bytes are only that aligned).
template <bool SM> __device__ __forceinline__ int load_i32_a2(const uint8_t* p) {
    return (int)ld_u16<SM>(p) | ((int)ld_u16<SM>(p + 2) << 16);
}
template <bool SM> __device__ __forceinline__ uint32_t load_u32_a4(const uint8_t* p) { return ld_u32<SM>(p); }
template <bool SM> __device__ __forceinline__ float load_half(const half* p) { return __half2float(__ushort_as_half(ld_u16<SM>(p))); }

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

// Programmatic dependent launch (the host launches every kernel with programmatic stream
// serialization when it is on; without it both are no-ops). A kernel lets the next one start
// launching at once, does only what does not depend on earlier launches (weights, rows of the
// KV cache from earlier steps, the host-written step position), then waits for the previous
// kernel to finish before it reads anything a launch wrote.
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }

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

#define MAX_BANNED 8

struct StepParams {
    int pos;              // position of row 0 of this step
    int rows;             // rows of this step (informative; kernels are specialised on M)
    int tokens[MAX_ROWS]; // the token ids of the rows
    int n_banned;         // ids the greedy argmax passes over (ignore_eos: the end-of-generation ids)
    int banned[MAX_BANNED];
    int kv_end;           // decode attention: keys below kv_end only (0: up to the row's own
                          // position); an assistant head's query past the cache it reads
    int plane;            // recurrent layers: the state plane the step starts from (row m's
                          // state goes to plane (plane + 1 + m) % n_planes)
    int rope_shift;       // RoPE turns row m by the angle of position pos + m + rope_shift (its
                          // K/V still go to pos + m): Qwen3.5's NextN entry j sits at position j + 1
    const struct SeqRow* seq_rows;  // rows from several sequences (a batched step): row m's
                                    // sequence and position (null: every row is the one sequence's,
                                    // row m at pos + m)
};

// Row m of a batched step: its position, its sequence's slot (in the layers' pooled caches, a
// layer's pool being slots of [n_kv][ctx][row], one per sequence; or, where the launch names a
// kv_slots table, its entry there), the position of its sequence's first row in the step, the
// keys it reads (kv_end as StepParams', per row), no_ban: 1 where the step's banned ids do
// not apply to the row (a request without ignore_eos beside one with it), and inert: 1 for a
// padding row (a copy of another row that writes no K/V; nobody reads its results).
struct SeqRow {
    int pos; int slot; int first; int kv_end;
    int no_ban; int inert; int pad1; int pad2;
};

__device__ __forceinline__ SeqRow step_row(const StepParams* st, int m) {
    if (st->seq_rows) return st->seq_rows[m];
    return SeqRow{st->pos + m, 0, st->pos, st->kv_end, 0, 0, 0, 0};
}

// The banned ids that apply to row m of a step (0 where the step bans none or the row opts out).
__device__ __forceinline__ int row_banned(const StepParams* st, int m) {
    if (!st) return 0;
    if (st->seq_rows && st->seq_rows[m].no_ban) return 0;
    return min(st->n_banned, MAX_BANNED);
}

// The K (which 0) or V (which 1) cache of a row's sequence: its kv_slots entry where the launch
// has a table (sequences whose caches are separate allocations of one layout), else its slot of
// the pool at `base` (slots of `slot_bytes`).
__device__ __forceinline__ uint8_t* row_cache(uint8_t* base, uint8_t* const* kv_slots, int slot, int which, size_t slot_bytes) {
    return kv_slots ? kv_slots[2 * slot + which] : base + (size_t)slot * slot_bytes;
}

// ---------------------------------------------------------------------------------------------
// Norm + residual + quantize.
//
// Modes:
//   in_mode 0: t = a                                       (a: [M, k] f32)
//   in_mode 1: t = res + rmsnorm(a) * w_a                   (post-norm and residual add;
//              times res_scale when set: a block's layer_output_scale)
//   in_mode 2: t = dequant(embd[token_m]) * embd_scale      (layer 0: the embedding row, of type
//              embd_type (0: Q8_0); token_m from `tokens` when set, else from the step block)
//   in_mode 3: t = res + a                                  (a pre-norm block's residual add)
//   in_mode 4: t = gelu_tanh(a) * w_a[m * b_stride + i]     (Gemma 4's per-layer input gate)
// If res_out is set, t is stored there (the residual stream). Then
//   y = norm ? rmsnorm(t) * w : t
// is written as Q8 blocks (qs/d/sum) and, if y_out is set, as f32, into rows of q_stride values
// (0: k) from value q_off on (a multiple of 32): two launches can fill the halves of a
// concatenated row, [enorm(e); hnorm(h)] for a NextN head's eh_proj.

struct NormQuantArgs {
    const float* a; const float* res; const float* w_a;
    const uint8_t* embd; float embd_scale; const StepParams* step;
    const float* w; float eps;
    float* res_out; float* y_out;
    int8_t* qs; float* qd; int* qsum;
    int k; int in_mode; int norm;
    const int* tokens;  // in_mode 2: the rows' token ids (null: the step block's)
    int q_stride; int q_off;  // the Q8 (and y_out) rows: q_stride values each (0: k), written from q_off
    float res_scale;  // in_mode 1: t is scaled by res_scale (0: not scaled)
    int embd_type;    // in_mode 2: the embedding table's weight type (0: Q8_0)
    int b_stride;     // in_mode 4: values between rows of w_a
};

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block (ggml's
// get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
    if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
    else { sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

// Value i of a row in the wide layout (see gemv_wide), as ggml's dequantizer computes it.
__device__ __forceinline__ float wide_value(const uint8_t* row, int t, int k, int i) {
    const int u = i / 32, v = i % 32, top = v / 16, g = (v % 16) / 4, e = v % 4;
    auto half_at = [&](size_t off) { return __half2float(*reinterpret_cast<const half*>(row + off)); };
    if (t == W_Q8_0) return half_at((size_t)k + 2 * u) * (float)(int8_t)row[i];
    const int l = row[16 * u + 4 * g + e];
    const int lo = top ? l >> 4 : l & 0xF;
    if (t == W_Q6_K) {
        const int q = lo | (((row[k / 2 + 8 * u + 4 * top + e] >> (2 * g)) & 3) << 4);
        return half_at((size_t)k / 2 + k / 4 + k / 16 + 2 * (u / 8)) * (float)(int8_t)row[k / 2 + k / 4 + 2 * u + top] * (float)(q - 32);
    }
    const int hb = (t == W_Q5_0 || t == W_Q5_K) ? (row[k / 2 + 4 * u + e] >> (4 * top + g)) & 1 : 0;
    const int q = lo | (hb << 4);
    if (t == W_Q5_0) return half_at((size_t)k / 2 + k / 8 + 2 * u) * (float)(q - 16);
    const uint8_t* meta = row + (t == W_Q5_K ? k / 2 + k / 8 : k / 2) + 16 * (u / 8);
    int sc, mn;
    scale_min_k4(meta + 4, u % 8, sc, mn);
    return __half2float(*reinterpret_cast<const half*>(meta)) * (float)sc * (float)q - __half2float(*reinterpret_cast<const half*>(meta + 2)) * (float)mn;
}

// Value i of row `token` of an embedding table of k-value rows of weight type `type` (0: Q8_0;
// with EMBD_WIDE, a table of any of the types in the wide layout), as ggml's dequantizer computes
// it.
__device__ __forceinline__ float embd_value(const uint8_t* embd, int type, int k, int token, int i) {
    if (type & EMBD_WIDE) return wide_value(embd + (size_t)token * wide_row_bytes(type & 0xFF, k), type & 0xFF, k, i);
    switch (type) {
        case W_Q4_K: case W_Q5_K: {
            const bool five = type == W_Q5_K;
            const uint8_t* row = embd + (size_t)token * (size_t)(k / 256) * (five ? 176 : 144);
            const int iw = i % 256, j = iw / 32, l = iw % 32;
            if (five) {
                const BlockQ5_K& b = reinterpret_cast<const BlockQ5_K*>(row)[i / 256];
                int sc, mn;
                scale_min_k4(b.scales, j, sc, mn);
                const int byte = b.qs[32 * (j / 2) + l];
                const int q = ((j & 1) ? byte >> 4 : byte & 0xF) | (((b.qh[l] >> j) & 1) << 4);
                return __half2float(b.d) * (float)sc * (float)q - __half2float(b.dmin) * (float)mn;
            }
            const BlockQ4_K& b = reinterpret_cast<const BlockQ4_K*>(row)[i / 256];
            int sc, mn;
            scale_min_k4(b.scales, j, sc, mn);
            const int byte = b.qs[32 * (j / 2) + l];
            const int q = (j & 1) ? byte >> 4 : byte & 0xF;
            return __half2float(b.d) * (float)sc * (float)q - __half2float(b.dmin) * (float)mn;
        }
        case W_Q6_K: {
            const BlockQ6_K& b = reinterpret_cast<const BlockQ6_K*>(embd + (size_t)token * (size_t)(k / 256) * 210)[i / 256];
            const int iw = i % 256, n = iw / 128, r = iw % 128, qd = r / 32, l = r % 32;
            const int lo = (b.ql[64 * n + l + (qd & 1) * 32] >> ((qd >> 1) * 4)) & 0xF;
            const int hi = (b.qh[32 * n + l] >> (2 * qd)) & 3;
            return __half2float(b.d) * (float)b.scales[8 * n + l / 16 + 2 * qd] * (float)((lo | (hi << 4)) - 32);
        }
        case W_Q5_0: {
            const BlockQ5_0& b = reinterpret_cast<const BlockQ5_0*>(embd + (size_t)token * (size_t)(k / 32) * 22)[i / 32];
            const int l = i % 32;
            const uint32_t qh = (uint32_t)b.qh[0] | ((uint32_t)b.qh[1] << 8) | ((uint32_t)b.qh[2] << 16) | ((uint32_t)b.qh[3] << 24);
            const int nib = l < 16 ? b.qs[l] & 0xF : b.qs[l - 16] >> 4;
            // The high bit as a signed int: with qh unsigned, `nib | bit << 4` would be unsigned
            // and `- 16` would wrap.
            return __half2float(b.d) * (float)((nib | ((int)((qh >> l) & 1u) << 4)) - 16);
        }
        default: {
            const BlockQ8_0* row = reinterpret_cast<const BlockQ8_0*>(embd) + (size_t)token * (k / QK);
            const BlockQ8_0& b = row[i / QK];
            return __half2float(b.d) * (float)b.qs[i % QK];
        }
    }
}

// The GLU's activation of the gate: 1 GELU (tanh approximation, Gemma's), 2 SiLU (SwiGLU).
__device__ __forceinline__ float glu_act(int glu, float g) {
    if (glu == 2) return g / (1.0f + expf(-g));
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

#define NQ_THREADS 256
#define NQ_PER 32  // values per thread: k <= NQ_THREADS * NQ_PER for the norm modes
#define NQ_PER_SHORT 4  // norm_quant_short: rows of up to 1024 values (fewer registers, more blocks per SM)

// Quantizes y (one value per lane, the lanes a block of 32) into block b of row m.
__device__ __forceinline__ void quant_block(const NormQuantArgs& p, int m, int b, float y) {
    const int lane = threadIdx.x % WARP;
    const int ks = p.q_stride ? p.q_stride : p.k;
    const size_t i = (size_t)m * ks + p.q_off + (size_t)b * QK + lane;
    if (p.y_out) p.y_out[i] = y;
    const float amax = warp_max(fabsf(y));
    const float d = amax / 127.0f;
    const int q = d == 0.0f ? 0 : (int)rintf(y / d);
    p.qs[i] = (int8_t)q;
    const int sum = warp_sum_i(q);
    const size_t bi = (size_t)m * (ks / QK) + p.q_off / QK + b;
    if (lane == 0) { p.qd[bi] = d; p.qsum[bi] = sum; }
}

// Grid: (blocks, M). The plain mode (in_mode 0, no norm, no res_out) spreads a row over blocks
// of 8 warps, one warp per block of 32 values. The other modes take one block per row: thread t
// holds values t + 256 j (so warp w's values for one j are the 32-value block 8 j + w), loads
// all its inputs at once, and keeps them in registers through both norms and the quantization.
// The values a thread holds, PER, only bounds k (k <= 256 PER): the zeros past k add nothing,
// so norm_quant and norm_quant_short give the same bits for a row both take.
template <int PER>
__device__ __forceinline__ void norm_quant_body(const NormQuantArgs& p) {
    __shared__ float red[32];
    const int m = blockIdx.y, k = p.k, tid = threadIdx.x;
    const int lane = tid % WARP, warp = tid / WARP;
    constexpr int NW = NQ_THREADS / WARP;
    pdl_trigger();
    pdl_wait();
    if (p.in_mode == 0 && !p.norm && !p.res_out) {
        const int b = blockIdx.x * NW + warp;
        if (b >= k / QK) return;
        quant_block(p, m, b, __ldg(p.a + (size_t)m * k + (size_t)b * QK + lane));
        return;
    }
    float t[PER], w[PER];
    float ss = 0.0f;
    if (p.in_mode == 3) {
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = tid + NQ_THREADS * j;
            t[j] = w[j] = 0.0f;
            if (i < k) {
                t[j] = p.res[(size_t)m * k + i] + __ldg(p.a + (size_t)m * k + i);
                if (p.norm) w[j] = __ldg(p.w + i);
            }
        }
    } else if (p.in_mode == 1) {
        float a[PER], r[PER], wa[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = tid + NQ_THREADS * j;
            a[j] = r[j] = wa[j] = w[j] = 0.0f;
            if (i < k) {
                a[j] = __ldg(p.a + (size_t)m * k + i);
                r[j] = p.res[(size_t)m * k + i];
                wa[j] = __ldg(p.w_a + i);
                if (p.norm) w[j] = __ldg(p.w + i);
            }
        }
#pragma unroll
        for (int j = 0; j < PER; ++j) ss += a[j] * a[j];
        const float ra = rsqrtf(block_sum_all(ss, red) / (float)k + p.eps);
#pragma unroll
        for (int j = 0; j < PER; ++j) t[j] = r[j] + a[j] * ra * wa[j];
        if (p.res_scale != 0.0f) {
#pragma unroll
            for (int j = 0; j < PER; ++j) t[j] *= p.res_scale;
        }
    } else if (p.in_mode == 4) {
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = tid + NQ_THREADS * j;
            t[j] = w[j] = 0.0f;
            if (i < k) {
                t[j] = glu_act(1, __ldg(p.a + (size_t)m * k + i)) * __ldg(p.w_a + (size_t)m * p.b_stride + i);
                if (p.norm) w[j] = __ldg(p.w + i);
            }
        }
    } else {
        const int token = p.in_mode != 2 ? 0 : p.tokens ? p.tokens[m] : p.step->tokens[m];
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = tid + NQ_THREADS * j;
            t[j] = w[j] = 0.0f;
            if (i < k) {
                t[j] = p.in_mode == 2 ? embd_value(p.embd, p.embd_type, k, token, i) * p.embd_scale : __ldg(p.a + (size_t)m * k + i);
                if (p.norm) w[j] = __ldg(p.w + i);
            }
        }
    }
    float rt = 1.0f;
    if (p.norm) {
        float s2 = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; ++j) s2 += t[j] * t[j];
        rt = rsqrtf(block_sum_all(s2, red) / (float)k + p.eps);
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int b = NW * j + warp;
        if (b >= k / QK) break;
        if (p.res_out) p.res_out[(size_t)m * k + tid + NQ_THREADS * j] = t[j];
        quant_block(p, m, b, p.norm ? t[j] * rt * w[j] : t[j]);
    }
}
extern "C" __global__ void __launch_bounds__(NQ_THREADS) norm_quant(NormQuantArgs p) { norm_quant_body<NQ_PER>(p); }
extern "C" __global__ void __launch_bounds__(NQ_THREADS) norm_quant_short(NormQuantArgs p) { norm_quant_body<NQ_PER_SHORT>(p); }

// ---------------------------------------------------------------------------------------------
// Gemma 4's per-layer inputs (the E-series' per-layer embeddings), for every layer at once:
//   out[m, l P + i] = (rmsnorm(proj[m, l P ..] * proj_scale)_i * w_i + tok_scale * E[token_m, l P + i]) / sqrt(2)
// with proj the embedded rows through per_layer_model_proj, E the per-layer token embedding
// table (rows of n_layer * P values of type embd_type, either layout, read in place), w the
// per-layer projection norm. Grid: (n_layer, M); block: P threads (a multiple of 32 up to 1024).

struct PleArgs {
    const float* proj; const uint8_t* embd; const float* w; float* out;
    const StepParams* step; const int* tokens;  // the rows' ids (null: the step block's)
    int embd_type; int n_layer; int p; float eps;
    float proj_scale; float tok_scale;
};

extern "C" __global__ void __launch_bounds__(1024) ple_inputs(PleArgs a) {
    __shared__ float red[32];
    const int l = blockIdx.x, m = blockIdx.y, i = threadIdx.x;
    pdl_trigger();
    pdl_wait();
    const int k = a.n_layer * a.p;
    const size_t at = (size_t)m * k + (size_t)l * a.p + i;
    const float x = a.proj[at] * a.proj_scale;
    const float r = rsqrtf(block_sum_all(x * x, red) / (float)a.p + a.eps);
    const int token = a.tokens ? a.tokens[m] : a.step->tokens[m];
    const float e = embd_value(a.embd, a.embd_type, k, token, l * a.p + i) * a.tok_scale;
    a.out[at] = (x * r * a.w[i] + e) * 0.70710678118654752f;
}

// Logit softcapping in place: x = tanh(x * inv_cap) * cap over n values (a step's rows of logits).
struct SoftcapArgs { float* x; int n; float cap; float inv_cap; int pad_; };

extern "C" __global__ void __launch_bounds__(256) softcap(SoftcapArgs a) {
    pdl_trigger();
    pdl_wait();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += gridDim.x * blockDim.x) a.x[i] = tanhf(a.x[i] * a.inv_cap) * a.cap;
}

// ---------------------------------------------------------------------------------------------
// Quantized GEMV over M activation rows: out[m][r] = sum_i W[r][i] * y[m][i].
//
// A group of S warps (S = split: 1, 2 or 4, chosen from k alone) per GEMV_ROWS consecutive output
// rows, each row computed as if by a group of its own (the rows only share the passes, so more
// loads are in flight); the S warps' sums are added in warp order. A row's k values are cut into units of 32 (a Q8_0/Q5_0 block, or a
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
    int wide;           // the weights are in the wide layout (gemv_wide; mmq reads either)
};

struct GemvArgs {
    GemvSeg seg[4];
    int nseg;
    int k;
    int split;  // S: warps per row (1, 2 or 4), each over its slice of the units
    int rows;   // activation rows (read by mmq)
    const int8_t* qs; const float* qd; const int* qsum;
};

#define GEMV_WARPS 4
#define GEMV_ROWS 2
#define GEMV_UNROLL 4

template <int T> struct WInfo;
template <> struct WInfo<W_Q8_0> { static constexpr int BV = 32, BB = 34; };
template <> struct WInfo<W_Q5_0> { static constexpr int BV = 32, BB = 22; };
template <> struct WInfo<W_Q4_K> { static constexpr int BV = 256, BB = 144; };
template <> struct WInfo<W_Q6_K> { static constexpr int BV = 256, BB = 210; };
template <> struct WInfo<W_Q5_K> { static constexpr int BV = 256, BB = 176; };

__device__ __forceinline__ size_t w_row_bytes(int type, int k) {
    switch (type) {
        case W_Q8_0: return (size_t)(k / 32) * 34;
        case W_Q5_0: return (size_t)(k / 32) * 22;
        case W_Q4_K: return (size_t)(k / 256) * 144;
        case W_Q5_K: return (size_t)(k / 256) * 176;
        default: return (size_t)(k / 256) * 210;
    }
}

// The 8 weight values of (row, unit u, lane quarter l4) as two int8x4, and the factors:
// the unit's contribution to a row m is  fw * d_m * dot(w, a_m) + fmin * d_m * sum_m
// (fmin only on the quarter l4 == 0, so that it is added once per unit).
template <int T, bool SM>
__device__ __forceinline__ void load_unit(const uint8_t* row, int u, int l4, int& w0, int& w1, float& fw, float& fmin) {
    if constexpr (T == W_Q8_0) {
        const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row) + u;
        const uint8_t* q = reinterpret_cast<const uint8_t*>(b->qs) + 8 * l4;
        w0 = load_i32_a2<SM>(q);
        w1 = load_i32_a2<SM>(q + 4);
        fw = load_half<SM>(&b->d);
        fmin = 0.0f;
    } else if constexpr (T == W_Q5_0) {
        const BlockQ5_0* b = reinterpret_cast<const BlockQ5_0*>(row) + u;
        const uint32_t qh = (uint32_t)load_i32_a2<SM>(b->qh);
        const int j0 = 8 * (l4 & 1);        // first byte of qs
        const int hi = l4 >> 1;             // high nibbles (values 16..31)
        const int vbase = 8 * l4;           // first value index (bit of qh)
        int ws[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t qs4 = (uint32_t)load_i32_a2<SM>(b->qs + j0 + 4 * h);
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
        fw = load_half<SM>(&b->d);
        fmin = 0.0f;
    } else if constexpr (T == W_Q4_K) {
        const BlockQ4_K* b = reinterpret_cast<const BlockQ4_K*>(row) + u / 8;
        const int j = u % 8;
        const uint8_t* q = b->qs + 32 * (j / 2) + 8 * l4;
        const uint32_t a0 = load_u32_a4<SM>(q);  // qs is at offset 16: 4-aligned within the block, and 144 is a multiple of 4
        const uint32_t a1 = load_u32_a4<SM>(q + 4);
        const int sh = 4 * (j & 1);
        w0 = (int)((a0 >> sh) & 0x0F0F0F0Fu);
        w1 = (int)((a1 >> sh) & 0x0F0F0F0Fu);
        const uint8_t* s = b->scales;
        int sc, mn;
        if (j < 4) { sc = ld_u8<SM>(s + j) & 63; mn = ld_u8<SM>(s + j + 4) & 63; }
        else { sc = (ld_u8<SM>(s + j + 4) & 0xF) | ((ld_u8<SM>(s + j - 4) >> 6) << 4); mn = (ld_u8<SM>(s + j + 4) >> 4) | ((ld_u8<SM>(s + j) >> 6) << 4); }
        fw = load_half<SM>(&b->d) * (float)sc;
        fmin = l4 == 0 ? -load_half<SM>(&b->dmin) * (float)mn : 0.0f;
    } else if constexpr (T == W_Q5_K) {
        // Q4_K's nibbles and scales, and a fifth bit per value: bit j of qh[l] for value l of
        // sub-block j.
        const BlockQ5_K* b = reinterpret_cast<const BlockQ5_K*>(row) + u / 8;
        const int j = u % 8;
        const uint8_t* q = b->qs + 32 * (j / 2) + 8 * l4;
        const uint32_t a0 = load_u32_a4<SM>(q);  // qs at offset 48, qh at 16 of a 176-byte block: 4-aligned
        const uint32_t a1 = load_u32_a4<SM>(q + 4);
        const uint32_t h0 = load_u32_a4<SM>(b->qh + 8 * l4);
        const uint32_t h1 = load_u32_a4<SM>(b->qh + 8 * l4 + 4);
        const int sh = 4 * (j & 1);
        w0 = (int)(((a0 >> sh) & 0x0F0F0F0Fu) | (((h0 >> j) & 0x01010101u) << 4));
        w1 = (int)(((a1 >> sh) & 0x0F0F0F0Fu) | (((h1 >> j) & 0x01010101u) << 4));
        const uint8_t* s = b->scales;
        int sc, mn;
        if (j < 4) { sc = ld_u8<SM>(s + j) & 63; mn = ld_u8<SM>(s + j + 4) & 63; }
        else { sc = (ld_u8<SM>(s + j + 4) & 0xF) | ((ld_u8<SM>(s + j - 4) >> 6) << 4); mn = (ld_u8<SM>(s + j + 4) >> 4) | ((ld_u8<SM>(s + j) >> 6) << 4); }
        fw = load_half<SM>(&b->d) * (float)sc;
        fmin = l4 == 0 ? -load_half<SM>(&b->dmin) * (float)mn : 0.0f;
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
            const uint32_t lo4 = (uint32_t)load_i32_a2<SM>(ql + 4 * h);
            const uint32_t hi4 = (uint32_t)load_i32_a2<SM>(qh + 4 * h);
            const uint32_t v = ((lo4 >> qsh) & 0x0F0F0F0Fu) | (((hi4 >> hsh) & 0x03030303u) << 4);
            ws[h] = (int)__vsubss4(v, 0x20202020u);
        }
        w0 = ws[0]; w1 = ws[1];
        fw = load_half<SM>(&b->d) * (float)(int8_t)ld_u8<SM>(b->scales + 8 * n + 2 * t + (l / 16));
        fmin = 0.0f;
    }
}

// Rows r0 .. r0 + GEMV_ROWS - 1 (those below n) of a segment, the units of this warp's slice:
// both rows' loads are issued in the same pass, so a warp keeps more bytes in flight. With S
// slices, slice s takes the units of the groups of 8 numbered s, s + S, s + 2S, ... Returns each
// row's warp sum (in every lane) in v (and the up rows' in v2).
template <int T, int M, bool GLU, bool SM>
__device__ __forceinline__ void gemv_rows(const GemvArgs& p, const uint8_t* w, const uint8_t* w2, int n, int r0, int slice, int S, float (&v)[GEMV_ROWS][M], float (&v2)[GEMV_ROWS][M]) {
    const int lane = threadIdx.x % WARP, l4 = lane % 4;
    const int k = p.k, units = k / QK, kb = k / QK;
    const size_t row_bytes = (size_t)(k / WInfo<T>::BV) * WInfo<T>::BB;
    const int nr = min(GEMV_ROWS, n - r0);
    const uint8_t* row[GEMV_ROWS];
    const uint8_t* row2[GEMV_ROWS];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
        const int r = max(0, min(r0 + i, n - 1));
        row[i] = w + (size_t)r * row_bytes;
        row2[i] = GLU ? w2 + (size_t)r * row_bytes : nullptr;
    }
    float acc[GEMV_ROWS][M], acc2[GEMV_ROWS][M];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
        for (int m = 0; m < M; ++m) { acc[i][m] = 0.0f; acc2[i][m] = 0.0f; }
    // GEMV_UNROLL units per lane per pass, for each of the rows: their loads are issued together
    // (the weights come from memory, and a pass's latency is paid once); each row's units still
    // enter its accumulators in unit order.
    const int stride = 8 * S;
    for (int base = 8 * slice + lane / 4; base < units; base += stride * GEMV_UNROLL) {
        int w0[GEMV_ROWS][GEMV_UNROLL], w1[GEMV_ROWS][GEMV_UNROLL], x0[GEMV_ROWS][GEMV_UNROLL], x1[GEMV_ROWS][GEMV_UNROLL];
        float fw[GEMV_ROWS][GEMV_UNROLL], fmin[GEMV_ROWS][GEMV_UNROLL], gw[GEMV_ROWS][GEMV_UNROLL], gmin[GEMV_ROWS][GEMV_UNROLL];
#pragma unroll
        for (int j = 0; j < GEMV_UNROLL; ++j) {
            const int u = base + j * stride;
#pragma unroll
            for (int i = 0; i < GEMV_ROWS; ++i) {
                w0[i][j] = w1[i][j] = x0[i][j] = x1[i][j] = 0;
                fw[i][j] = fmin[i][j] = gw[i][j] = gmin[i][j] = 0.0f;
                if (u < units && i < nr) {
                    load_unit<T, SM>(row[i], u, l4, w0[i][j], w1[i][j], fw[i][j], fmin[i][j]);
                    if (GLU) load_unit<T, SM>(row2[i], u, l4, x0[i][j], x1[i][j], gw[i][j], gmin[i][j]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < GEMV_UNROLL; ++j) {
            const int u = base + j * stride;
            if (u >= units) break;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const int2 a = __ldg(reinterpret_cast<const int2*>(p.qs + (size_t)m * k + 32 * u + 8 * l4));
                const float d = __ldg(p.qd + (size_t)m * kb + u);
                const float sm = (float)__ldg(p.qsum + (size_t)m * kb + u);
#pragma unroll
                for (int i = 0; i < GEMV_ROWS; ++i) {
                    const int dot = __dp4a(w1[i][j], a.y, __dp4a(w0[i][j], a.x, 0));
                    acc[i][m] += d * (fw[i][j] * (float)dot + fmin[i][j] * sm);
                    if (GLU) {
                        const int dot2 = __dp4a(x1[i][j], a.y, __dp4a(x0[i][j], a.x, 0));
                        acc2[i][m] += d * (gw[i][j] * (float)dot2 + gmin[i][j] * sm);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            v[i][m] = warp_sum(acc[i][m]);
            v2[i][m] = GLU ? warp_sum(acc2[i][m]) : 0.0f;
        }
}

// A block's share of one segment: warp w works on the rows of group w / S, slice w % S; the
// slices' sums are added in slice order, then the GLU epilogue.
template <int T, int M, bool GLU>
__device__ __forceinline__ void gemv_seg(const GemvArgs& p, const GemvSeg& s, int r0, int slice, int S, float (*part)[GEMV_ROWS][MAX_ROWS][2]) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    float v[GEMV_ROWS][M], v2[GEMV_ROWS][M];
    const bool active = r0 < s.n;
    gemv_rows<T, M, GLU, false>(p, s.w, s.w2, s.n, r0, slice, S, v, v2);
    if (S > 1) {
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
                for (int m = 0; m < M; ++m) { part[warp][i][m][0] = v[i][m]; part[warp][i][m][1] = v2[i][m]; }
        }
        __syncthreads();
        if (slice != 0) return;
#pragma unroll
        for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float a = part[warp][i][m][0], b = part[warp][i][m][1];
                for (int t = 1; t < S; ++t) { a += part[warp + t][i][m][0]; b += part[warp + t][i][m][1]; }
                v[i][m] = a; v2[i][m] = b;
            }
    }
    if (!active || lane != 0) return;
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
        if (r0 + i >= s.n) break;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float y = v[i][m];
            if (GLU) y = glu_act(s.glu, y) * v2[i][m];
            s.out[(size_t)m * s.out_stride + r0 + i] = y;
        }
    }
}

template <int M>
__device__ __forceinline__ void gemv_body(const GemvArgs& p) {
    __shared__ float part[GEMV_WARPS][GEMV_ROWS][MAX_ROWS][2];
    int si = 0;
#pragma unroll
    for (int i = 1; i < 4; ++i) if (i < p.nseg && (int)blockIdx.x >= p.seg[i].block_start) si = i;
    const GemvSeg& s = p.seg[si];
    const int S = p.split, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int r0 = (((int)blockIdx.x - s.block_start) * (GEMV_WARPS / S) + warp / S) * GEMV_ROWS;
    const int slice = warp % S;
    pdl_trigger();
    // The weights do not depend on earlier launches: start them towards L2 before the wait.
    const size_t row_bytes = w_row_bytes(s.type, p.k);
    for (int i = 0; i < GEMV_ROWS; ++i) {
        if (r0 + i >= s.n) break;
        for (size_t off = (size_t)(slice * WARP + lane) * 128; off < row_bytes; off += (size_t)S * WARP * 128) {
            prefetch_l2(s.w + (size_t)(r0 + i) * row_bytes + off);
            if (s.glu) prefetch_l2(s.w2 + (size_t)(r0 + i) * row_bytes + off);
        }
    }
    pdl_wait();
    switch (s.type * 2 + (s.glu ? 1 : 0)) {
        case W_Q8_0 * 2: gemv_seg<W_Q8_0, M, false>(p, s, r0, slice, S, part); break;
        case W_Q5_0 * 2: gemv_seg<W_Q5_0, M, false>(p, s, r0, slice, S, part); break;
        case W_Q4_K * 2: gemv_seg<W_Q4_K, M, false>(p, s, r0, slice, S, part); break;
        case W_Q6_K * 2: gemv_seg<W_Q6_K, M, false>(p, s, r0, slice, S, part); break;
        case W_Q5_K * 2: gemv_seg<W_Q5_K, M, false>(p, s, r0, slice, S, part); break;
        case W_Q8_0 * 2 + 1: gemv_seg<W_Q8_0, M, true>(p, s, r0, slice, S, part); break;
        case W_Q5_0 * 2 + 1: gemv_seg<W_Q5_0, M, true>(p, s, r0, slice, S, part); break;
        case W_Q4_K * 2 + 1: gemv_seg<W_Q4_K, M, true>(p, s, r0, slice, S, part); break;
        case W_Q6_K * 2 + 1: gemv_seg<W_Q6_K, M, true>(p, s, r0, slice, S, part); break;
        case W_Q5_K * 2 + 1: gemv_seg<W_Q5_K, M, true>(p, s, r0, slice, S, part); break;
        default: break;
    }
}
#define GEMV_INST(M) extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP) gemv_m##M(const GemvArgs p) { gemv_body<M>(p); }
GEMV_INST(1) GEMV_INST(2) GEMV_INST(3) GEMV_INST(4) GEMV_INST(5) GEMV_INST(6) GEMV_INST(7) GEMV_INST(8)

// ---------------------------------------------------------------------------------------------
// The GEMV for matrices of many rows (the LM head): a block stages GEMV_STAGE_ROWS consecutive
// rows (one contiguous span of the weights) in shared memory with 16-byte loads, so that each
// SM keeps many bytes in flight with few instructions, then each warp computes its rows from the
// copy exactly as gemv_rows does from global memory (one segment, no GLU, S = 1). Dynamic shared
// memory: GEMV_STAGE_ROWS * row bytes.

#define GEMV_STAGE_ROWS 16

template <int T, int M>
__device__ __forceinline__ void gemv_staged_body(const GemvArgs& p, uint8_t* stage) {
    const GemvSeg& s = p.seg[0];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const size_t row_bytes = (size_t)(p.k / WInfo<T>::BV) * WInfo<T>::BB;
    const int r0 = blockIdx.x * GEMV_STAGE_ROWS;
    const int nr = min(GEMV_STAGE_ROWS, s.n - r0);
    const uint8_t* src = s.w + (size_t)r0 * row_bytes;
    const size_t bytes = (size_t)nr * row_bytes;
    pdl_trigger();
    // The copy reads only weights: it runs before the wait, beside the previous launch.
    if (((reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
        const uint4* a = reinterpret_cast<const uint4*>(src);
        uint4* b = reinterpret_cast<uint4*>(stage);
        for (size_t i = tid; i < bytes / 16; i += blockDim.x) b[i] = __ldcs(a + i);
    } else if (((reinterpret_cast<uintptr_t>(src) | bytes) & 3) == 0) {
        const unsigned int* a = reinterpret_cast<const unsigned int*>(src);
        unsigned int* b = reinterpret_cast<unsigned int*>(stage);
        for (size_t i = tid; i < bytes / 4; i += blockDim.x) b[i] = __ldcs(a + i);
    } else {
        const unsigned short* a = reinterpret_cast<const unsigned short*>(src);
        unsigned short* b = reinterpret_cast<unsigned short*>(stage);
        for (size_t i = tid; i < bytes / 2; i += blockDim.x) b[i] = __ldcs(a + i);
    }
    pdl_wait();
    __syncthreads();
    // Warp w: local rows 2w, 2w + 1, then 2w + 8, 2w + 9.
#pragma unroll
    for (int half = 0; half < GEMV_STAGE_ROWS / (2 * GEMV_WARPS); ++half) {
        const int lr = half * 2 * GEMV_WARPS + 2 * warp;
        float v[GEMV_ROWS][M], v2[GEMV_ROWS][M];
        gemv_rows<T, M, false, true>(p, stage, nullptr, nr, lr, 0, 1, v, v2);
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < GEMV_ROWS; ++i) {
                if (lr + i >= nr) break;
#pragma unroll
                for (int m = 0; m < M; ++m) s.out[(size_t)m * s.out_stride + r0 + lr + i] = v[i][m];
            }
        }
    }
}

template <int M>
__device__ __forceinline__ void gemv_staged(const GemvArgs& p) {
    extern __shared__ uint4 stage4[];
    uint8_t* stage = reinterpret_cast<uint8_t*>(stage4);
    switch (p.seg[0].type) {
        case W_Q8_0: gemv_staged_body<W_Q8_0, M>(p, stage); break;
        case W_Q5_0: gemv_staged_body<W_Q5_0, M>(p, stage); break;
        case W_Q4_K: gemv_staged_body<W_Q4_K, M>(p, stage); break;
        case W_Q6_K: gemv_staged_body<W_Q6_K, M>(p, stage); break;
        case W_Q5_K: gemv_staged_body<W_Q5_K, M>(p, stage); break;
        default: break;
    }
}
#define GEMV_STAGED_INST(M) extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP) gemv_staged_m##M(const GemvArgs p) { gemv_staged<M>(p); }
GEMV_STAGED_INST(1) GEMV_STAGED_INST(2) GEMV_STAGED_INST(3) GEMV_STAGED_INST(4) GEMV_STAGED_INST(5) GEMV_STAGED_INST(6) GEMV_STAGED_INST(7) GEMV_STAGED_INST(8)

// ---------------------------------------------------------------------------------------------
// The GEMV over the wide layout: the weights repacked at load (blocks.rs: to_wide) so that every
// load is aligned and wide. A GGUF block of 22, 34, 144, 176 or 210 bytes puts a 32-value unit's
// quants at 2-byte alignment or split between nibbles of a neighbour's bytes, which caps a GEMV
// over it at a fraction of the memory's bandwidth (docs/evaluations/gpu-families.md). The values
// and scales are ggml's, only moved. A row of k values (U = k/32 units, SB = k/256 super-blocks),
// padded to 16 bytes:
//
//   Q8_0: [qs: 32 per unit][d: a half per unit]
//   Q5_0: [lo: 16 per unit][qh: 4 per unit][d: a half per unit]
//   Q4_K: [lo: 16 per unit][meta: 16 per SB (d, dmin, the 12 scale bytes, as in the block)]
//   Q5_K: [lo: 16 per unit][qh: 4 per unit][meta: 16 per SB]
//   Q6_K: [lo: 16 per unit][hi: 8 per unit][sc: 2 per unit][d: a half per SB]
//
// In a unit (values 0..31): byte 4g + e of lo holds value 4g + e in its low nibble and 16 + 4g + e
// in its high one; bit 4t + g of qh's byte e is the fifth bit of value 16t + 4g + e; bits 2g, 2g+1
// of hi's byte 4t + e are value 16t + 4g + e's top two; sc holds the scales of values 0..15 and
// 16..31. So the unit unpacks to eight int8x4 words q[0..7] (q[g]: values 4g.., q[4+g]: 16+4g..)
// with shifts and masks alone.
//
// A row is worked by L lanes of a warp (L = p.split, 1..32, from the launch's rows and k, never
// from M: Kernels::wide_lanes), lane s taking units
// s, s + L, s + 2L, ... in order; a unit adds  d_m * (fd * (float)dot + fmin * sum_m)  (Q6_K: dot
// is sc0 * dot0 + sc1 * dot1, Q4_K/Q5_K: fd = d * sc, fmin = -dmin * mn); the L lanes' sums are
// added by a fixed xor tree. Nothing depends on M. The first units' weights are loaded before the
// wait for the previous launch. Up to four segments a launch, each with its own output and
// optional GLU, as gemv.

#define WIDE_WARPS GEMV_WARPS
#define WIDE_UNROLL 4

struct WideRaw { int4 lo; int4 ext; float fd; float fmin; };

// Q4_K/Q5_K: the scale and min of sub-block j from the 12 scale bytes held in words w1..w3 of meta.
__device__ __forceinline__ void wide_scale_min(const int4& meta, int j, int& sc, int& mn) {
    const uint32_t w1 = (uint32_t)meta.y, w2 = (uint32_t)meta.z, w3 = (uint32_t)meta.w;
    if (j < 4) {
        sc = (int)((w1 >> (8 * j)) & 63);
        mn = (int)((w2 >> (8 * j)) & 63);
    } else {
        const int jj = j - 4;
        sc = (int)(((w3 >> (8 * jj)) & 0xF) | (((w1 >> (8 * jj + 6)) & 3) << 4));
        mn = (int)(((w3 >> (8 * jj + 4)) & 0xF) | (((w2 >> (8 * jj + 6)) & 3) << 4));
    }
}

__device__ __forceinline__ float half_lo(int w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFF))); }
__device__ __forceinline__ float half_hi(int w) { return __half2float(__ushort_as_half((unsigned short)((uint32_t)w >> 16))); }

// Weight loads: evict-first (__ldcs) in the GEMV, which reads each weight once a step; through
// the read-only cache (__ldg) in the prompt GEMM, whose blocks over the same rows re-read them.
template <bool STREAM, typename V>
__device__ __forceinline__ V wld(const V* p) {
    if constexpr (STREAM) return __ldcs(p);
    else return __ldg(p);
}

template <int T, bool STREAM = true>
__device__ __forceinline__ WideRaw wide_load(const uint8_t* row, int k, int u) {
    WideRaw r;
    r.fmin = 0.0f;
    r.ext = make_int4(0, 0, 0, 0);
    if constexpr (T == W_Q8_0) {
        const int4* q = reinterpret_cast<const int4*>(row + 32 * (size_t)u);
        r.lo = wld<STREAM>(q);
        r.ext = wld<STREAM>(q + 1);
        r.fd = __half2float(__ushort_as_half(wld<STREAM>(reinterpret_cast<const unsigned short*>(row + k) + u)));
    } else {
        r.lo = wld<STREAM>(reinterpret_cast<const int4*>(row + 16 * (size_t)u));
        if constexpr (T == W_Q6_K) {
            const int2 h = wld<STREAM>(reinterpret_cast<const int2*>(row + k / 2 + 8 * (size_t)u));
            r.ext = make_int4(h.x, h.y, (int)wld<STREAM>(reinterpret_cast<const unsigned short*>(row + k / 2 + k / 4) + u), 0);
            r.fd = __half2float(__ushort_as_half(wld<STREAM>(reinterpret_cast<const unsigned short*>(row + k / 2 + k / 4 + k / 16) + u / 8)));
        } else if constexpr (T == W_Q5_0) {
            r.ext.x = wld<STREAM>(reinterpret_cast<const int*>(row + k / 2) + u);
            r.fd = __half2float(__ushort_as_half(wld<STREAM>(reinterpret_cast<const unsigned short*>(row + k / 2 + k / 8) + u)));
        } else {  // Q4_K, Q5_K
            if constexpr (T == W_Q5_K) r.ext.x = wld<STREAM>(reinterpret_cast<const int*>(row + k / 2) + u);
            const int4 meta = __ldg(reinterpret_cast<const int4*>(row + (T == W_Q5_K ? k / 2 + k / 8 : k / 2)) + u / 8);
            int sc, mn;
            wide_scale_min(meta, u % 8, sc, mn);
            r.fd = half_lo(meta.x) * (float)sc;
            r.fmin = -half_hi(meta.x) * (float)mn;
        }
    }
    return r;
}

// Word g (0..7) of the unit's quants as int8x4: values 4g.. (g < 4) or 16 + 4(g - 4).. .
template <int T>
__device__ __forceinline__ int wide_word(const WideRaw& w, int g) {
    if constexpr (T == W_Q8_0) {
        const int v[8] = {w.lo.x, w.lo.y, w.lo.z, w.lo.w, w.ext.x, w.ext.y, w.ext.z, w.ext.w};
        return v[g];
    } else {
        const int lo[4] = {w.lo.x, w.lo.y, w.lo.z, w.lo.w};
        const int t = g / 4, gg = g % 4;
        uint32_t q = ((uint32_t)lo[gg] >> (4 * t)) & 0x0F0F0F0Fu;
        if constexpr (T == W_Q6_K) {
            q |= ((((uint32_t)(t ? w.ext.y : w.ext.x)) >> (2 * gg)) & 0x03030303u) << 4;
            return (int)__vsubss4(q, 0x20202020u);
        } else if constexpr (T == W_Q5_0 || T == W_Q5_K) {
            q |= ((((uint32_t)w.ext.x) >> (4 * t + gg)) & 0x01010101u) << 4;
            return T == W_Q5_0 ? (int)__vsubss4(q, 0x10101010u) : (int)q;
        } else {
            return (int)q;
        }
    }
}

// The unit's contribution to one activation row (a: its 32 quants; d, sum: its scale and sum).
template <int T>
__device__ __forceinline__ float wide_unit(const WideRaw& w, const int4& a0, const int4& a1, float d, float sum) {
    const int av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    if constexpr (T == W_Q6_K) {
        int d0 = 0, d1 = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            d0 = __dp4a(wide_word<T>(w, g), av[g], d0);
            d1 = __dp4a(wide_word<T>(w, 4 + g), av[4 + g], d1);
        }
        return d * (w.fd * (float)((int)(int8_t)(w.ext.z & 0xFF) * d0 + (int)(int8_t)(w.ext.z >> 8) * d1));
    } else {
        int dot = 0;
#pragma unroll
        for (int g = 0; g < 8; ++g) dot = __dp4a(wide_word<T>(w, g), av[g], dot);
        if constexpr (T == W_Q4_K || T == W_Q5_K) return d * (w.fd * (float)dot + w.fmin * sum);
        else return d * (w.fd * (float)dot);
    }
}

// Rows m0 .. m0 + M - 1 of the activations and the output (m0 = 0 but in gemv_wide_rows).
template <int T, int M, bool GLU>
__device__ __forceinline__ void gemv_wide_seg(const GemvArgs& p, const GemvSeg& s, int r, int m0 = 0) {
    const int lane = threadIdx.x % WARP;
    const int L = p.split, sub = lane % L;
    const int k = p.k, U = k / QK;
    const size_t rb = wide_row_bytes(T, k), ro = (size_t)min(r, s.n - 1) * rb;
    const uint8_t* row = s.w + ro;
    const uint8_t* row2 = GLU ? s.w2 + ro : nullptr;
    float acc[M], acc2[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = acc2[m] = 0.0f;
    bool waited = false;
    for (int base = sub; base < U; base += L * WIDE_UNROLL) {
        WideRaw w[WIDE_UNROLL], w2[WIDE_UNROLL];
#pragma unroll
        for (int j = 0; j < WIDE_UNROLL; ++j) {
            const int u = base + j * L;
            if (u < U) {
                w[j] = wide_load<T>(row, k, u);
                if (GLU) w2[j] = wide_load<T>(row2, k, u);
            }
        }
        if (!waited) { pdl_wait(); waited = true; }
#pragma unroll
        for (int j = 0; j < WIDE_UNROLL; ++j) {
            const int u = base + j * L;
            if (u >= U) break;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const int4* a = reinterpret_cast<const int4*>(p.qs + (size_t)(m0 + m) * k + 32 * (size_t)u);
                const int4 a0 = __ldg(a), a1 = __ldg(a + 1);
                const float d = __ldg(p.qd + (size_t)(m0 + m) * U + u);
                const float sum = (T == W_Q4_K || T == W_Q5_K) ? (float)__ldg(p.qsum + (size_t)(m0 + m) * U + u) : 0.0f;
                acc[m] += wide_unit<T>(w[j], a0, a1, d, sum);
                if (GLU) acc2[m] += wide_unit<T>(w2[j], a0, a1, d, sum);
            }
        }
    }
    if (!waited) pdl_wait();
    for (int o = L / 2; o > 0; o /= 2)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
            if (GLU) acc2[m] += __shfl_xor_sync(0xffffffffu, acc2[m], o);
        }
    if (sub != 0 || r >= s.n) return;
#pragma unroll
    for (int m = 0; m < M; ++m) s.out[(size_t)(m0 + m) * s.out_stride + r] = GLU ? glu_act(s.glu, acc[m]) * acc2[m] : acc[m];
}

// Block `wb` of the segments' rows over activation rows m0 .. m0 + M - 1.
template <int M>
__device__ __forceinline__ void gemv_wide_block(const GemvArgs& p, int wb, int m0) {
    int si = 0;
#pragma unroll
    for (int i = 1; i < 4; ++i) if (i < p.nseg && wb >= p.seg[i].block_start) si = i;
    const GemvSeg& s = p.seg[si];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, L = p.split;
    const int r = ((wb - s.block_start) * WIDE_WARPS + warp) * (WARP / L) + lane / L;
    pdl_trigger();
    switch (s.type * 2 + (s.glu ? 1 : 0)) {
        case W_Q8_0 * 2: gemv_wide_seg<W_Q8_0, M, false>(p, s, r, m0); break;
        case W_Q5_0 * 2: gemv_wide_seg<W_Q5_0, M, false>(p, s, r, m0); break;
        case W_Q4_K * 2: gemv_wide_seg<W_Q4_K, M, false>(p, s, r, m0); break;
        case W_Q6_K * 2: gemv_wide_seg<W_Q6_K, M, false>(p, s, r, m0); break;
        case W_Q5_K * 2: gemv_wide_seg<W_Q5_K, M, false>(p, s, r, m0); break;
        case W_Q8_0 * 2 + 1: gemv_wide_seg<W_Q8_0, M, true>(p, s, r, m0); break;
        case W_Q5_0 * 2 + 1: gemv_wide_seg<W_Q5_0, M, true>(p, s, r, m0); break;
        case W_Q4_K * 2 + 1: gemv_wide_seg<W_Q4_K, M, true>(p, s, r, m0); break;
        case W_Q6_K * 2 + 1: gemv_wide_seg<W_Q6_K, M, true>(p, s, r, m0); break;
        case W_Q5_K * 2 + 1: gemv_wide_seg<W_Q5_K, M, true>(p, s, r, m0); break;
        default: pdl_wait(); break;
    }
}
#define GEMV_WIDE_INST(M) extern "C" __global__ void __launch_bounds__(WIDE_WARPS * WARP) gemv_wide_m##M(const GemvArgs p) { gemv_wide_block<M>(p, (int)blockIdx.x, 0); }
GEMV_WIDE_INST(1) GEMV_WIDE_INST(2) GEMV_WIDE_INST(3) GEMV_WIDE_INST(4) GEMV_WIDE_INST(5) GEMV_WIDE_INST(6) GEMV_WIDE_INST(7) GEMV_WIDE_INST(8)

// gemv_wide_rows: the GEMV of any number of rows (p.rows, a multiple of 8: the caller pads with
// inert rows) for a batched step, as groups of 8 rows, each group gemv_wide_m8's arithmetic: a
// row's result is bit for bit the one-row launch's, whatever the step's row count (the batch
// invariance a batched step keeps). The groups of one block of weight rows are consecutive blocks
// (block b: weight block b / G, group b % G), so a weight block is read from DRAM once and from L2
// by the other groups. Grid: (weight blocks x G).
extern "C" __global__ void __launch_bounds__(WIDE_WARPS * WARP) gemv_wide_rows(const GemvArgs p) {
    const int G = p.rows / 8;
    gemv_wide_block<8>(p, (int)blockIdx.x / G, ((int)blockIdx.x % G) * 8);
}

// ---------------------------------------------------------------------------------------------
// Mixture of experts (qwen35moe's routed experts and sigmoid-gated shared expert).
//
// moe_router: one block per activation row m over its router logits (moe_logits', below: the
// normed row x (f32, k values) times the router's f32 rows), softmax (the block's threads over
// the experts, the sum a fixed tree), the top `used` by
// probability (lower index first among equals; warp 0, a round per pick), renormalised to sum to
// 1 (summed in pick order), as candle's `quantized_qwen35` routes; with a shared gate, also
// sigmoid(shared_gate . x). Writes ids[m * used + j], wts[m * used + j] and sgate[m].
// Nothing depends on the step's other rows.

#define MOE_MAX_EXPERTS 512
#define MOE_MAX_USED 16

struct MoeRouterArgs {
    const float* x; const float* router; const float* shared_gate;  // shared_gate may be null
    int* ids; float* wts; float* sgate;
    float* logits;  // [rows][n_expert + 1]: moe_logits' output (the last: the shared gate's)
    int k; int n_expert; int used; int pad_;
};

// moe_logits: the router's logits of each row (and the shared gate's, as expert n_expert), a warp
// per expert, the lanes over k and a fixed xor tree, over every SM: grid (ceil((n_expert + 1) /
// 8), rows), 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_logits(MoeRouterArgs a) {
    const int m = blockIdx.y, lane = threadIdx.x % WARP, e = (int)blockIdx.x * (256 / WARP) + (int)threadIdx.x / WARP;
    pdl_trigger();
    pdl_wait();
    if (e > a.n_expert || (e == a.n_expert && !a.shared_gate)) return;
    const float* x = a.x + (size_t)m * a.k;
    const float* w = e < a.n_expert ? a.router + (size_t)e * a.k : a.shared_gate;
    float t = 0.0f;
    for (int i = lane; i < a.k; i += WARP) t += x[i] * w[i];
    t = warp_sum(t);
    if (lane == 0) a.logits[(size_t)m * (a.n_expert + 1) + e] = t;
}

extern "C" __global__ void __launch_bounds__(256) moe_router(MoeRouterArgs a) {
    __shared__ float prob[MOE_MAX_EXPERTS];
    const int m = blockIdx.x, tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, nw = blockDim.x / WARP;
    pdl_trigger();
    pdl_wait();
    const float* lg = a.logits + (size_t)m * (a.n_expert + 1);
    for (int e = tid; e < a.n_expert; e += blockDim.x) prob[e] = lg[e];
    const float g = a.shared_gate ? lg[a.n_expert] : 0.0f;
    __syncthreads();
    // Softmax: the max (any order gives the same), each expert's exp, their sum (block_sum's
    // fixed tree), the probabilities.
    __shared__ float red[32];
    __shared__ int taken[MOE_MAX_EXPERTS];
    float mx = -INFINITY;
    for (int e = tid; e < a.n_expert; e += blockDim.x) mx = fmaxf(mx, prob[e]);
    mx = warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = -INFINITY;
    for (int w = 0; w < nw; ++w) mx = fmaxf(mx, red[w]);
    float part = 0.0f;
    for (int e = tid; e < a.n_expert; e += blockDim.x) {
        prob[e] = expf(prob[e] - mx);
        part += prob[e];
        taken[e] = 0;
    }
    const float sum = block_sum_all(part, red);
    for (int e = tid; e < a.n_expert; e += blockDim.x) prob[e] = prob[e] / sum;
    __syncthreads();
    // Top `used` in warp 0: each round, every lane's best untaken expert (higher probability,
    // then lower index), the warp's best of those; renormalised in pick order.
    if (warp == 0) {
        float tot = 0.0f;
        // A NaN probability (a NaN or infinite logit) counts as -inf, and a lane's first untaken
        // expert is its candidate whatever its value, so every pick is a real, untaken expert.
        for (int j = 0; j < a.used; ++j) {
            float bv = -INFINITY;
            int bi = 0x7FFFFFFF;
            for (int e = lane; e < a.n_expert; e += WARP) {
                const float pv = isnan(prob[e]) ? -INFINITY : prob[e];
                if (!taken[e] && (bi == 0x7FFFFFFF || pv > bv || (pv == bv && e < bi))) { bv = pv; bi = e; }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float v2 = __shfl_xor_sync(0xFFFFFFFFu, bv, o);
                const int i2 = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
                if (i2 != 0x7FFFFFFF && (bi == 0x7FFFFFFF || v2 > bv || (v2 == bv && i2 < bi))) { bv = v2; bi = i2; }
            }
            if (lane == 0) {
                taken[bi] = 1;
                a.ids[m * a.used + j] = bi;
                tot += prob[bi];
            }
            __syncwarp();
        }
        if (lane == 0) {
            for (int j = 0; j < a.used; ++j) a.wts[m * a.used + j] = prob[a.ids[m * a.used + j]] / tot;
            if (a.shared_gate) a.sgate[m] = 1.0f / (1.0f + expf(-g));
        }
    }
}

// gemv_moe: the routed experts' GEMVs over the wide layout. Pair q (blockIdx.y, 0..M*used) is
// activation row q / used (act_pair 0: the layer's input, shared by its row's experts) or q
// (act_pair 1: each pair's own row, the down projection), through expert ids[q] of the stacked
// weights (expert_bytes apart), into out[q * out_stride + r]. A pair's rows are gemv_wide_seg's
// at M = 1, so a pair's result never depends on the step's rows or the other pairs.

struct MoeGemvArgs {
    GemvArgs g;
    const int* ids;
    long long expert_bytes;
    int used; int act_pair;
};

extern "C" __global__ void __launch_bounds__(WIDE_WARPS * WARP) gemv_moe(const MoeGemvArgs a) {
    const int q = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, L = a.g.split;
    const int r = ((int)blockIdx.x * WIDE_WARPS + warp) * (WARP / L) + lane / L;
    pdl_trigger();
    pdl_wait();
    const int e = a.ids[q];
    const int row = a.act_pair ? q : q / a.used;
    const int U = a.g.k / QK;
    GemvArgs p = a.g;
    p.qs = a.g.qs + (size_t)row * a.g.k;
    p.qd = a.g.qd + (size_t)row * U;
    p.qsum = a.g.qsum + (size_t)row * U;
    GemvSeg s = a.g.seg[0];
    s.w = a.g.seg[0].w + (size_t)e * a.expert_bytes;
    s.w2 = s.glu ? a.g.seg[0].w2 + (size_t)e * a.expert_bytes : nullptr;
    s.out = a.g.seg[0].out + (size_t)q * s.out_stride;
    switch (s.type * 2 + (s.glu ? 1 : 0)) {
        case W_Q8_0 * 2: gemv_wide_seg<W_Q8_0, 1, false>(p, s, r); break;
        case W_Q5_0 * 2: gemv_wide_seg<W_Q5_0, 1, false>(p, s, r); break;
        case W_Q4_K * 2: gemv_wide_seg<W_Q4_K, 1, false>(p, s, r); break;
        case W_Q6_K * 2: gemv_wide_seg<W_Q6_K, 1, false>(p, s, r); break;
        case W_Q5_K * 2: gemv_wide_seg<W_Q5_K, 1, false>(p, s, r); break;
        case W_Q8_0 * 2 + 1: gemv_wide_seg<W_Q8_0, 1, true>(p, s, r); break;
        case W_Q5_0 * 2 + 1: gemv_wide_seg<W_Q5_0, 1, true>(p, s, r); break;
        case W_Q4_K * 2 + 1: gemv_wide_seg<W_Q4_K, 1, true>(p, s, r); break;
        case W_Q6_K * 2 + 1: gemv_wide_seg<W_Q6_K, 1, true>(p, s, r); break;
        case W_Q5_K * 2 + 1: gemv_wide_seg<W_Q5_K, 1, true>(p, s, r); break;
        default: break;
    }
}

// moe_combine: out[m][i] = sum_j c_j * y[(m*used + j) * k + i] (j in order), c_j = wts[m*used + j]
// (times escale[ids[m*used + j]] when escale is set: Gemma 4's per-expert output scale, the
// product rounded to f32 first as candle's `quantized_gemma4` forms it), plus
// sgate[m] * shared[m * k + i] when shared is set. Grid: (ceil(k / 256), M).

struct MoeCombineArgs {
    const float* y; const float* wts; const float* shared; const float* sgate; float* out;
    int k; int used;
    const int* ids; const float* escale;  // escale may be null (ids then unread)
};

extern "C" __global__ void __launch_bounds__(256) moe_combine(MoeCombineArgs a) {
    const int m = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    pdl_trigger();
    pdl_wait();
    if (i >= a.k) return;
    float t = 0.0f;
    for (int j = 0; j < a.used; ++j) {
        const float c = a.escale ? __fmul_rn(a.wts[m * a.used + j], a.escale[a.ids[m * a.used + j]]) : a.wts[m * a.used + j];
        t += c * a.y[((size_t)m * a.used + j) * a.k + i];
    }
    if (a.shared) t += a.sgate[m] * a.shared[(size_t)m * a.k + i];
    a.out[(size_t)m * a.k + i] = t;
}

// The 8 values of quarter l4 of unit u of a wide row, with the factors, exactly as load_unit
// gives them from the GGUF block (the prompt GEMM's weight loader over the wide layout).
template <int T>
__device__ __forceinline__ void load_unit_wide(const uint8_t* row, int k, int u, int l4, int& w0, int& w1, float& fw, float& fmin) {
    const WideRaw r = wide_load<T, false>(row, k, u);
    w0 = wide_word<T>(r, 2 * l4);
    w1 = wide_word<T>(r, 2 * l4 + 1);
    if constexpr (T == W_Q6_K) {
        fw = r.fd * (float)(int8_t)((r.ext.z >> (8 * (l4 >> 1))) & 0xFF);
        fmin = 0.0f;
    } else {
        fw = r.fd;
        fmin = l4 == 0 ? r.fmin : 0.0f;
    }
}

// ---------------------------------------------------------------------------------------------
// The GEMM for a prompt's many rows: the same weights, Q8 activation planes, segments and GLU
// epilogue as gemv, with the integer dot products of each 32-value unit on the tensor cores
// (mma.sync s8). A block stages MMQ_KU units of MMQ_BR weight rows (unpacked to int8 with each
// unit's factors, by load_unit) and of MMQ_BM activation rows in shared memory; warp (wr, wm)
// computes weight rows wr*16.. and activation rows wm*32.. (four 16x8 tiles). Each unit's dot
// enters its output as  d_m * (fw0 * dot(first 16) + fw1 * dot(last 16) + fmin * sum_m)  (the
// factors load_unit gives for quarters 0 and 2; fw0 == fw1 except for Q6_K), added over the
// units in order. The sums are not gemv's (which splits a unit over four lanes): a prompt's
// rows match one-token steps to float rounding, not bit for bit.
//
// Grid: (blocks over the segments' rows, MMQ_BR each; activation rows / MMQ_BM). GemvArgs as for
// gemv (`rows`: the activation rows).

#define MMQ_BR 32
#define MMQ_BM 64
#define MMQ_KU 8
#define MMQ_THREADS 128
#define MMQ_STRIDE (MMQ_KU * 32 + 16)  // bytes per staged row: 16 bytes of padding keep the fragment loads off one bank

struct MmqSmem {
    int8_t w[2][MMQ_BR][MMQ_STRIDE];  // [gate or plain, up][row][value]
    float fw0[2][MMQ_BR][MMQ_KU], fw1[2][MMQ_BR][MMQ_KU], fmin[2][MMQ_BR][MMQ_KU];
    int8_t a[MMQ_BM][MMQ_STRIDE];
    float ad[MMQ_BM][MMQ_KU];
    float asum[MMQ_BM][MMQ_KU];
};

__device__ __forceinline__ void mma_k32(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_k16(int (&c)[4], int a0, int a1, int b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// Stages weight rows r0.. of `w` (n rows), units ku0 .. ku0 + MMQ_KU - 1, as int8 with factors.
template <int T, bool WIDE>
__device__ __forceinline__ void mmq_stage_w(MmqSmem& sm, int which, const uint8_t* w, int n, int r0, int ku0, int units, size_t row_bytes, int k) {
    const int t = threadIdx.x, l4 = t & 3, uu = (t >> 2) % MMQ_KU;
#pragma unroll
    for (int i = 0; i < MMQ_BR * MMQ_KU * 4 / MMQ_THREADS; ++i) {
        const int row = (t / (4 * MMQ_KU)) + i * (MMQ_THREADS / (4 * MMQ_KU));
        const int r = r0 + row, u = ku0 + uu;
        int w0 = 0, w1 = 0;
        float fw = 0.0f, fmin = 0.0f;
        if (r < n && u < units) {
            if constexpr (WIDE) load_unit_wide<T>(w + (size_t)r * row_bytes, k, u, l4, w0, w1, fw, fmin);
            else load_unit<T, false>(w + (size_t)r * row_bytes, u, l4, w0, w1, fw, fmin);
        }
        *reinterpret_cast<int2*>(&sm.w[which][row][uu * 32 + 8 * l4]) = make_int2(w0, w1);
        if (l4 == 0) { sm.fw0[which][row][uu] = fw; sm.fmin[which][row][uu] = fmin; }
        if (l4 == 2) sm.fw1[which][row][uu] = fw;
    }
}

// With MAP (mmq_moe), activation row m is map[m] / act_div and its output row map[m].
template <int T, bool GLU, bool WIDE, bool MAP = false>
__device__ void mmq_body(const GemvArgs& p, const GemvSeg& s, int r0, MmqSmem& sm, const int* map = nullptr, int act_div = 1) {
    constexpr bool TWO = T == W_Q6_K;  // two scales per unit: two k16 products
    const int t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    const int g = lane / 4, tig = lane % 4;
    const int wr = warp % 2, wm = warp / 2;
    const int k = p.k, units = k / QK, rows = p.rows;
    const int m0 = blockIdx.y * MMQ_BM;
    const size_t row_bytes = WIDE ? wide_row_bytes(T, k) : (size_t)(k / WInfo<T>::BV) * WInfo<T>::BB;
    float acc[4][4], acc2[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = acc2[j][e] = 0.0f;
    for (int ku0 = 0; ku0 < units; ku0 += MMQ_KU) {
        __syncthreads();  // the previous stage is consumed
        mmq_stage_w<T, WIDE>(sm, 0, s.w, s.n, r0, ku0, units, row_bytes, k);
        if (GLU) mmq_stage_w<T, WIDE>(sm, 1, s.w2, s.n, r0, ku0, units, row_bytes, k);
#pragma unroll
        for (int i = 0; i < MMQ_BM * MMQ_KU * 2 / MMQ_THREADS; ++i) {
            const int idx = t + i * MMQ_THREADS, tl = idx / (MMQ_KU * 2), piece = idx % (MMQ_KU * 2);
            const int u = ku0 + piece / 2, m = m0 + tl;
            int4 v = make_int4(0, 0, 0, 0);
            if (m < rows && u < units) {
                const int am = MAP ? map[m] / act_div : m;
                v = __ldg(reinterpret_cast<const int4*>(p.qs + (size_t)am * k + (size_t)ku0 * 32 + piece * 16));
            }
            *reinterpret_cast<int4*>(&sm.a[tl][piece * 16]) = v;
        }
#pragma unroll
        for (int i = 0; i < MMQ_BM * MMQ_KU / MMQ_THREADS; ++i) {
            const int idx = t + i * MMQ_THREADS, tl = idx / MMQ_KU, uu = idx % MMQ_KU;
            const int u = ku0 + uu, m = m0 + tl;
            const bool in = m < rows && u < units;
            const int am = in ? (MAP ? map[m] / act_div : m) : 0;
            sm.ad[tl][uu] = in ? __ldg(p.qd + (size_t)am * (k / QK) + u) : 0.0f;
            sm.asum[tl][uu] = in ? (float)__ldg(p.qsum + (size_t)am * (k / QK) + u) : 0.0f;
        }
        __syncthreads();
        const int nu = min(MMQ_KU, units - ku0);
        for (int uu = 0; uu < nu; ++uu) {
            const int ra = wr * 16 + g, kb = uu * 32 + tig * 4;
            // Row factors of this thread's two rows (g and g + 8 of the warp's 16).
            float f0[2][2], f1[2][2], fm[2][2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int q = 0; q < (GLU ? 2 : 1); ++q) {
                    f0[q][h] = sm.fw0[q][ra + 8 * h][uu];
                    f1[q][h] = sm.fw1[q][ra + 8 * h][uu];
                    fm[q][h] = sm.fmin[q][ra + 8 * h][uu];
                }
#pragma unroll
            for (int q = 0; q < (GLU ? 2 : 1); ++q) {
                const int a0 = *reinterpret_cast<const int*>(&sm.w[q][ra][kb]);
                const int a1 = *reinterpret_cast<const int*>(&sm.w[q][ra + 8][kb]);
                const int a2 = *reinterpret_cast<const int*>(&sm.w[q][ra][kb + 16]);
                const int a3 = *reinterpret_cast<const int*>(&sm.w[q][ra + 8][kb + 16]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int tb = wm * 32 + j * 8;
                    const int b0 = *reinterpret_cast<const int*>(&sm.a[tb + g][kb]);
                    const int b1 = *reinterpret_cast<const int*>(&sm.a[tb + g][kb + 16]);
                    int c[4] = {0, 0, 0, 0}, c2[4] = {0, 0, 0, 0};
                    if (TWO) {
                        mma_k16(c, a0, a1, b0);
                        mma_k16(c2, a2, a3, b1);
                    } else {
                        mma_k32(c, a0, a1, a2, a3, b0, b1);
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int h = e >> 1, tl = tb + tig * 2 + (e & 1);
                        const float d = sm.ad[tl][uu], su = sm.asum[tl][uu];
                        const float dot = TWO ? f0[q][h] * (float)c[e] + f1[q][h] * (float)c2[e] : f0[q][h] * (float)c[e];
                        const float y = d * (dot + fm[q][h] * su);
                        if (q == 0) acc[j][e] += y; else acc2[j][e] += y;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = r0 + wr * 16 + g + 8 * (e >> 1), m = m0 + wm * 32 + j * 8 + tig * 2 + (e & 1);
            if (r >= s.n || m >= rows) continue;
            float y = acc[j][e];
            if (GLU) y = glu_act(s.glu, y) * acc2[j][e];
            s.out[(size_t)(MAP ? map[m] : m) * s.out_stride + r] = y;
        }
}

extern "C" __global__ void __launch_bounds__(MMQ_THREADS) mmq(const GemvArgs p) {
    __shared__ MmqSmem sm;
    int si = 0;
#pragma unroll
    for (int i = 1; i < 4; ++i) if (i < p.nseg && (int)blockIdx.x >= p.seg[i].block_start) si = i;
    const GemvSeg& s = p.seg[si];
    const int r0 = ((int)blockIdx.x - s.block_start) * MMQ_BR;
    pdl_trigger();
    pdl_wait();
    const int wide = s.wide ? 1 : 0;
    switch ((s.type * 2 + (s.glu ? 1 : 0)) * 2 + wide) {
#define MMQ_CASE(T, G, W) case (T * 2 + G) * 2 + W: mmq_body<T, G, W>(p, s, r0, sm); break;
        MMQ_CASE(W_Q8_0, 0, 0) MMQ_CASE(W_Q5_0, 0, 0) MMQ_CASE(W_Q4_K, 0, 0) MMQ_CASE(W_Q6_K, 0, 0) MMQ_CASE(W_Q5_K, 0, 0)
        MMQ_CASE(W_Q8_0, 1, 0) MMQ_CASE(W_Q5_0, 1, 0) MMQ_CASE(W_Q4_K, 1, 0) MMQ_CASE(W_Q6_K, 1, 0) MMQ_CASE(W_Q5_K, 1, 0)
        MMQ_CASE(W_Q8_0, 0, 1) MMQ_CASE(W_Q5_0, 0, 1) MMQ_CASE(W_Q4_K, 0, 1) MMQ_CASE(W_Q6_K, 0, 1) MMQ_CASE(W_Q5_K, 0, 1)
        MMQ_CASE(W_Q8_0, 1, 1) MMQ_CASE(W_Q5_0, 1, 1) MMQ_CASE(W_Q4_K, 1, 1) MMQ_CASE(W_Q6_K, 1, 1) MMQ_CASE(W_Q5_K, 1, 1)
#undef MMQ_CASE
        default: break;
    }
}

// ---------------------------------------------------------------------------------------------
// A prompt step's routed experts as one GEMM per expert (llama.cpp's MUL_MAT_ID in spirit):
// moe_sort lists each expert's (row, expert) pairs, mmq_moe runs mmq over each expert's pairs, so
// an expert's weights are read once per MMQ_BM of its pairs instead of once per pair (gemv_moe,
// which the decode and verify steps keep: a pair's result there never depends on the step).
//
// moe_sort: block e (one per expert) lists, in pair order, the pairs q < pairs with ids[q] == e
// into list[e * cap ..] (cap: the most pairs one expert can have, the step's rows, as a row
// picks an expert at most once) and their count into counts[e]. Grid: (n_expert), 256 threads.

struct MoeSortArgs {
    const int* ids; int* list; int* counts;
    int pairs; int cap;
};

extern "C" __global__ void __launch_bounds__(256) moe_sort(MoeSortArgs a) {
    __shared__ int wc[8];
    const int e = blockIdx.x, t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    pdl_trigger();
    pdl_wait();
    int total = 0;
    for (int c = 0; c < a.pairs; c += 256) {
        const int q = c + t;
        const bool hit = q < a.pairs && a.ids[q] == e;
        const unsigned b = __ballot_sync(0xFFFFFFFFu, hit);
        if (lane == 0) wc[warp] = __popc(b);
        __syncthreads();
        int before = total, sum = 0;
        for (int w = 0; w < 8; ++w) {
            if (w < warp) before += wc[w];
            sum += wc[w];
        }
        if (hit && before + __popc(b & ((1u << lane) - 1u)) < a.cap) a.list[(size_t)e * a.cap + before + __popc(b & ((1u << lane) - 1u))] = q;
        total += sum;
        __syncthreads();
    }
    if (t == 0) a.counts[e] = min(total, a.cap);
}

// mmq_moe: expert blockIdx.z's pairs (moe_sort's list) through its weights (the wide layout,
// expert_bytes apart): pair q reads activation row q / act_div (act_div = used: the layer's
// input, shared by its row's experts; 1: each pair's own row, the down projection) and writes
// out row q. Grid: (blocks over seg.n, MMQ_BR each; cap / MMQ_BM; n_expert); blocks past an
// expert's pairs return at once.

struct MoeMmqArgs {
    GemvArgs g;
    const int* list; const int* counts;
    long long expert_bytes;
    int cap; int act_div;
};

extern "C" __global__ void __launch_bounds__(MMQ_THREADS) mmq_moe(const MoeMmqArgs a) {
    __shared__ MmqSmem sm;
    const int e = blockIdx.z;
    pdl_trigger();
    pdl_wait();
    const int cnt = a.counts[e];
    if ((int)blockIdx.y * MMQ_BM >= cnt) return;
    GemvArgs p = a.g;
    p.rows = cnt;
    GemvSeg s = a.g.seg[0];
    s.w = a.g.seg[0].w + (size_t)e * a.expert_bytes;
    s.w2 = s.glu ? a.g.seg[0].w2 + (size_t)e * a.expert_bytes : nullptr;
    const int r0 = (int)blockIdx.x * MMQ_BR;
    const int* map = a.list + (size_t)e * a.cap;
    switch (s.type * 2 + (s.glu ? 1 : 0)) {
#define MMQ_MOE_CASE(T, G) case T * 2 + G: mmq_body<T, G, true, true>(p, s, r0, sm, map, a.act_div); break;
        MMQ_MOE_CASE(W_Q8_0, 0) MMQ_MOE_CASE(W_Q5_0, 0) MMQ_MOE_CASE(W_Q4_K, 0) MMQ_MOE_CASE(W_Q6_K, 0) MMQ_MOE_CASE(W_Q5_K, 0)
        MMQ_MOE_CASE(W_Q8_0, 1) MMQ_MOE_CASE(W_Q5_0, 1) MMQ_MOE_CASE(W_Q4_K, 1) MMQ_MOE_CASE(W_Q6_K, 1) MMQ_MOE_CASE(W_Q5_K, 1)
#undef MMQ_MOE_CASE
        default: break;
    }
}

// ---------------------------------------------------------------------------------------------
// The KV cache's stored types (tine_gpu::kv::KvStore's kernel ids). A cache is [n_kv][ctx][row]
// with rows of kv_row_bytes(type, hd) bytes; the quantized rows are GGML's blocks of 32 values
// (the f16 scale, then the codes), the bytes candle's CPU cache stores (candle-nn's KvType), so
// a row's codes are the CPU quantizer's for the same values, bit for bit, and a slot file moves
// between the devices.

template <int E> struct VecF;
template <> struct VecF<2> { static __device__ __forceinline__ void load(const float* p, float* v) { const float2 t = __ldcg(reinterpret_cast<const float2*>(p)); v[0] = t.x; v[1] = t.y; } };
template <> struct VecF<4> { static __device__ __forceinline__ void load(const float* p, float* v) { const float4 t = __ldcg(reinterpret_cast<const float4*>(p)); v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w; } };
template <> struct VecF<8> { static __device__ __forceinline__ void load(const float* p, float* v) { VecF<4>::load(p, v); VecF<4>::load(p + 4, v + 4); } };
template <> struct VecF<16> { static __device__ __forceinline__ void load(const float* p, float* v) { VecF<8>::load(p, v); VecF<8>::load(p + 8, v + 8); } };

// The turbo types (candle-nn's attention::kv_turbo): a row of hd values (128 to 512) rotated by
// groups of 32, `bits` a value on average: the row's f16 scale, a byte per group (width << 5 |
// exponent), then the groups' level indices as one little-endian bit stream.
enum KvT : int { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3, KV_Q4_0 = 4, KV_TURBO4 = 5, KV_TURBO3 = 6, KV_TURBO2 = 7 };

__host__ __device__ __forceinline__ int kv_turbo_bits(int type) {
    return type == KV_TURBO4 ? 4 : type == KV_TURBO3 ? 3 : type == KV_TURBO2 ? 2 : 0;
}

__host__ __device__ __forceinline__ size_t kv_row_bytes(int type, int hd) {
    switch (type) {
        case KV_F16: case KV_BF16: return (size_t)hd * 2;
        case KV_Q8_0: return (size_t)hd / 32 * 34;
        case KV_Q4_0: return (size_t)hd / 32 * 18;
        case KV_TURBO4: case KV_TURBO3: case KV_TURBO2: return 2 + (size_t)hd / 32 + (size_t)kv_turbo_bits(type) * hd / 8;
        default: return (size_t)hd * 4;
    }
}

// The turbo types' tables (tine_gpu::kv::turbo_tab, from kv_turbo's): floats at these offsets.
#define TURBO_TAB_STEPS 0        // 32: 2^(-k/8)
#define TURBO_TAB_BOUNDS 32      // 32: 2^(-(k - 1/2)/8)
#define TURBO_TAB_LEVELS 64      // 8 widths x 128: width w's 2^w levels from w * 128
#define TURBO_TAB_SIGNS 1088     // 32: -1 or 1, the rotation's signs
#define TURBO_TAB_INV_SQRT 1120  // 1 / sqrt(32) as the CPU computes it
#define TURBO_TAB_SEARCH 1121    // kv_turbo::SCALE_SEARCH
#define TURBO_TAB_LEN 1122

// A group's rotation R = H·D / sqrt(32) applied to a row held E dims a lane (lane l: dims l*E ..
// l*E + E - 1; a group of 32 spans 32/E lanes): the signs, the butterflies (within the lane's
// registers below span E, across lanes from it), 1/sqrt(32). A query so rotated scores against
// the stored (rotated) keys as the plain query against the plain keys. Every lane of the warp
// calls it.
template <int E>
__device__ __forceinline__ void turbo_rotate_lanes(float* v, int lane, const float* tab) {
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = __fmul_rn(v[e], tab[TURBO_TAB_SIGNS + (lane * E + e) % 32]);
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
        if (h < E) {
#pragma unroll
            for (int e = 0; e < E; ++e) {
                if (!(e & h)) {
                    const float a = v[e], b = v[e + h];
                    v[e] = __fadd_rn(a, b);
                    v[e + h] = __fsub_rn(a, b);
                }
            }
        } else {
            const int ls = h / E;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const float o = __shfl_xor_sync(0xFFFFFFFFu, v[e], ls);
                v[e] = (lane & ls) ? __fsub_rn(o, v[e]) : __fadd_rn(v[e], o);
            }
        }
    }
    const float f = tab[TURBO_TAB_INV_SQRT];
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = __fmul_rn(v[e], f);
}

// R^T of a group held one dim a lane (lane t: dim t of the group): the butterflies, 1/sqrt(32),
// the signs (kv_turbo::unrotate). Every lane of the warp calls it.
__device__ __forceinline__ float turbo_unrotate_warp(float v, int lane, const float* tab) {
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
        const float o = __shfl_xor_sync(0xFFFFFFFFu, v, h);
        v = (lane & h) ? __fsub_rn(o, v) : __fadd_rn(v, o);
    }
    return __fmul_rn(__fmul_rn(v, tab[TURBO_TAB_INV_SQRT]), tab[TURBO_TAB_SIGNS + lane]);
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// f32 to bf16, rounding to nearest even (half's bf16::from_f32, which candle's to_dtype uses;
// a NaN stays a quiet NaN).
__device__ __forceinline__ unsigned short f32_to_bf16(float x) {
    const uint32_t u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Stores value x of dim `d` (lane d % 32 of its warp; the warp holds dims 32 (d / 32) .. + 31, one
// block) into `row` of `type`. Every lane of the warp calls it. The quantizers are candle's
// BlockQ8_0/BlockQ4_0::from_float (GGML's quantize_row_*_ref) in the same f32 operations, kept
// from contracting into FMAs.
__device__ __forceinline__ void kv_store(uint8_t* row, int type, int d, float x) {
    const int lane = d % WARP;
    switch (type) {
        case KV_F32: reinterpret_cast<float*>(row)[d] = x; return;
        case KV_F16: reinterpret_cast<half*>(row)[d] = __float2half_rn(x); return;
        case KV_BF16: reinterpret_cast<unsigned short*>(row)[d] = f32_to_bf16(x); return;
        case KV_Q8_0: {
            uint8_t* b = row + (size_t)(d / 32) * 34;
            const float amax = warp_max(fabsf(x));
            const float dd = amax / 127.0f;
            const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
            const int q = (int)roundf(__fmul_rn(x, id));
            if (lane == 0) *reinterpret_cast<half*>(b) = __float2half_rn(dd);
            b[2 + lane] = (uint8_t)(int8_t)max(-128, min(127, q));
            return;
        }
        case KV_Q4_0: {
            uint8_t* b = row + (size_t)(d / 32) * 18;
            // The value of the largest magnitude, the first such in dim order.
            float a = fabsf(x);
            int who = lane;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float a2 = __shfl_xor_sync(0xFFFFFFFFu, a, o);
                const int w2 = __shfl_xor_sync(0xFFFFFFFFu, who, o);
                if (a2 > a || (a2 == a && w2 < who)) { a = a2; who = w2; }
            }
            const float xm = __shfl_sync(0xFFFFFFFFu, x, who);
            const float mx = a > 0.0f ? xm : 0.0f;
            const float dd = mx / -8.0f;
            const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
            const float t = __fadd_rn(__fmul_rn(x, id), 8.5f);
            // Rust's `as u8`: NaN and negatives to 0, truncation toward zero.
            const int xi = min(15, t > 0.0f ? (int)t : 0);
            const int hi = __shfl_down_sync(0xFFFFFFFFu, xi, 16);
            if (lane == 0) *reinterpret_cast<half*>(b) = __float2half_rn(dd);
            if (lane < 16) b[2 + lane] = (uint8_t)(xi | (hi << 4));
            return;
        }
    }
}

// Lane `lane`'s E dims (lane * E ..) of a stored row of `type`, as f32: what the CPU's
// KvType::decode gives (q · d with d the f16 scale in f32; q4_0's codes less 8).
template <int E>
__device__ __forceinline__ void kv_load(const uint8_t* row, int type, int lane, float* v, const float* tab) {
    const int d0 = lane * E;
    if (kv_turbo_bits(type)) {
        // The rotated values of the lane's dims (kv_turbo::dequantize_row): E dims of group
        // d0 / 32, whose indices follow the earlier groups' 4w bytes each; a row has E groups.
        // (Through L2 alone, as every cache read: a row's bytes share lines with its neighbours'.)
        const int g = d0 / 32, j0 = d0 % 32;
        const int gb = __ldcg(row + 2 + g), w = gb >> 5;
        if (w == 0) {
#pragma unroll
            for (int e = 0; e < E; ++e) v[e] = 0.0f;
            return;
        }
        int off = 2 + E;
        for (int i = 0; i < g; ++i) off += 4 * (__ldcg(row + 2 + i) >> 5);
        const float s = __half2float(__ushort_as_half((unsigned short)(__ldcg(row) | (__ldcg(row + 1) << 8))));
        const float sigma = __fmul_rn(s, tab[TURBO_TAB_STEPS + (gb & 31)]);
        const float* lv = tab + TURBO_TAB_LEVELS + w * 128;
        const uint8_t* b = row + off;
        const int mask = (1 << w) - 1;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int bit = (j0 + e) * w, by = bit >> 3, sh = bit & 7;
            int x = __ldcg(b + by);
            if (sh + w > 8) x |= (int)__ldcg(b + by + 1) << 8;
            v[e] = __fmul_rn(sigma, lv[(x >> sh) & mask]);
        }
        return;
    }
    switch (type) {
        case KV_F32: VecF<E>::load(reinterpret_cast<const float*>(row) + d0, v); return;
        case KV_F16: {
            const uint32_t* w = reinterpret_cast<const uint32_t*>(row) + d0 / 2;
#pragma unroll
            for (int i = 0; i < E / 2; ++i) { const uint32_t x = __ldcg(w + i); v[2 * i] = half_lo((int)x); v[2 * i + 1] = half_hi((int)x); }
            return;
        }
        case KV_BF16: {
            const uint32_t* w = reinterpret_cast<const uint32_t*>(row) + d0 / 2;
#pragma unroll
            for (int i = 0; i < E / 2; ++i) { const uint32_t x = __ldcg(w + i); v[2 * i] = bf16_lo(x); v[2 * i + 1] = bf16_hi(x); }
            return;
        }
        case KV_Q8_0: {
            const uint8_t* b = row + (size_t)(d0 / 32) * 34;
            const float dd = __half2float(__ushort_as_half(__ldcg(reinterpret_cast<const unsigned short*>(b))));
            const unsigned short* c = reinterpret_cast<const unsigned short*>(b + 2 + d0 % 32);
#pragma unroll
            for (int i = 0; i < E / 2; ++i) {
                const unsigned short x = __ldcg(c + i);
                v[2 * i] = (float)(int8_t)(x & 0xFF) * dd;
                v[2 * i + 1] = (float)(int8_t)(x >> 8) * dd;
            }
            return;
        }
        default: {  // KV_Q4_0: byte j of the block holds dim j (low nibble) and dim j + 16 (high)
            const uint8_t* b = row + (size_t)(d0 / 32) * 18;
            const float dd = __half2float(__ushort_as_half(__ldcg(reinterpret_cast<const unsigned short*>(b))));
            const int j = d0 % 16, sh = (d0 % 32) >= 16 ? 4 : 0;
            const unsigned short* c = reinterpret_cast<const unsigned short*>(b + 2 + j);
#pragma unroll
            for (int i = 0; i < E / 2; ++i) {
                const unsigned short x = __ldcg(c + i);
                v[2 * i] = (float)((int)((x >> sh) & 0xF) - 8) * dd;
                v[2 * i + 1] = (float)((int)((x >> (8 + sh)) & 0xF) - 8) * dd;
            }
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Per-head RMSNorm of q and k, RoPE (NeoX halves over the first n_rot dims: pair (i, i + n_rot/2);
// the dims from n_rot on pass unrotated), the query scale, and the K/V rows written into the cache
// at positions pos + m.
//
// Grid: (n_head + n_kv, M); block: hd/2 threads, thread i holding dims i and i + hd/2 (the norm's
// values); the normed head goes through shared memory to the rotation's pairs. n_kv 0: the
// queries alone (a layer reading another layer's K/V writes none).
// q, k, v: [M, heads * hd] f32 (the QKV GEMV's outputs). q is rewritten in place.
// Cache layout: [n_kv][ctx][row], rows of kv_row_bytes(type, hd) bytes (f32: hd floats).

struct RopeArgs {
    float* q; const float* k; const float* v;
    const float* q_norm; const float* k_norm; float eps;
    const float* inv_freq;  // [hd/2]
    float q_scale;
    uint8_t* k_cache; uint8_t* v_cache; int ctx;
    const StepParams* step;
    int n_head; int n_kv; int hd;
    int n_rot;  // dims rotated (0: hd); inv_freq holds n_rot / 2 values
    int v_norm;    // V's RMSNorm without a weight (Gemma 4) before it is cached
    int v_from_k;  // V is K's projection before its norm (Gemma 4's k_eq_v layers; v unread)
    int k_type; int v_type;  // the caches' KvT
    uint8_t* const* kv_slots;  // or null: per slot, its K and V cache (row_cache)
    float* stage;  // [M][n_kv][2][hd]: K and V as f32 for turbo_store, where a cache is of a turbo type
    const float* turbo;  // the turbo tables, for turbo_store's launch (not read here)
};

extern "C" __global__ void __launch_bounds__(256) qk_norm_rope_kv(RopeArgs p) {
    __shared__ float red[32];
    __shared__ float ys[512];
    const int h = blockIdx.x, m = blockIdx.y, i = threadIdx.x, half_hd = p.hd / 2;
    pdl_trigger();
    pdl_wait();
    const bool is_q = h < p.n_head;
    const int kvh = is_q ? 0 : h - p.n_head;
    const SeqRow sr = step_row(p.step, m);
    const int pos = sr.pos;
    const float* src = is_q ? p.q + ((size_t)m * p.n_head + h) * p.hd : p.k + ((size_t)m * p.n_kv + kvh) * p.hd;
    const float x0 = src[i], x1 = src[i + half_hd];
    const float ss = block_sum_all(x0 * x0 + x1 * x1, red);
    const float r = rsqrtf(ss / (float)p.hd + p.eps);
    const float* w = is_q ? p.q_norm : p.k_norm;
    ys[i] = x0 * r * w[i];
    ys[i + half_hd] = x1 * r * w[i + half_hd];
    __syncthreads();
    const int nr = p.n_rot > 0 ? p.n_rot : p.hd, hr = nr / 2;
    // Dim j after the rotation: (y_j cos - y_{j+hr} sin) in the first half of the rotated dims,
    // (y_j cos + y_{j-hr} sin) in the second, y_j past them.
    auto rot = [&](int j) -> float {
        if (j >= nr) return ys[j];
        const int f = j < hr ? j : j - hr;
        float sn, cs;
        sincosf((float)(pos + p.step->rope_shift) * p.inv_freq[f], &sn, &cs);
        return j < hr ? ys[j] * cs - ys[j + hr] * sn : ys[j] * cs + ys[j - hr] * sn;
    };
    const float o0 = rot(i), o1 = rot(i + half_hd);
    if (!is_q && sr.inert) return;  // a padding row writes no K/V
    if (is_q) {
        float* dst = p.q + ((size_t)m * p.n_head + h) * p.hd;
        dst[i] = o0 * p.q_scale;
        dst[i + half_hd] = o1 * p.q_scale;
    } else {
        const size_t kb = kv_row_bytes(p.k_type, p.hd), vb = kv_row_bytes(p.v_type, p.hd);
        const size_t st = ((size_t)m * p.n_kv + kvh) * 2 * p.hd;  // the row's K then V in the stage
        if (kv_turbo_bits(p.k_type)) {
            float* stage = p.stage + st;
            stage[i] = o0;
            stage[i + half_hd] = o1;
        } else {
            uint8_t* kd = row_cache(p.k_cache, p.kv_slots, sr.slot, 0, (size_t)p.n_kv * p.ctx * kb) + ((size_t)kvh * p.ctx + pos) * kb;
            kv_store(kd, p.k_type, i, o0);
            kv_store(kd, p.k_type, i + half_hd, o1);
        }
        const float* vs = p.v_from_k ? src : p.v + ((size_t)m * p.n_kv + kvh) * p.hd;
        float v0 = vs[i], v1 = vs[i + half_hd];
        if (p.v_norm) {
            const float rv = rsqrtf(block_sum_all(v0 * v0 + v1 * v1, red) / (float)p.hd + p.eps);
            v0 *= rv;
            v1 *= rv;
        }
        if (kv_turbo_bits(p.v_type)) {
            float* stage = p.stage + st;
            stage[p.hd + i] = v0;
            stage[p.hd + i + half_hd] = v1;
        } else {
            uint8_t* vd = row_cache(p.v_cache, p.kv_slots, sr.slot, 1, (size_t)p.n_kv * p.ctx * vb) + ((size_t)kvh * p.ctx + pos) * vb;
            kv_store(vd, p.v_type, i, v0);
            kv_store(vd, p.v_type, i + half_hd, v1);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decode attention, split over the keys by absolute position.
//
// Row m (at position pos + m) sees keys [lo, hi] with hi = pos + m and lo = max(0, pos + m -
// window + 1) (window 0: no window); with the step's kv_end set, hi = min(pos + m, kv_end - 1)
// (an assistant head's query at a position past the target cache it reads; the host keeps
// lo <= hi). The keys are cut into chunks of ATTN_CHUNK by absolute index, and each
// chunk into ATTN_WARPS sub-chunks of ATTN_SUB keys, one per warp. Block (c, query head h, m)
// takes chunk lo / ATTN_CHUNK + c of KV head h / (n_head / n_kv). A warp loads its keys' K and V
// rows at once (lane l holds dims l*E .. l*E+E-1 of q, of each key and of the weighted sum), scores
// them, then weighs the V rows: a softmax over its sub-chunk with its own max. The block merges
// its warps in warp order, and a row whose keys lie in one chunk is finished there. Otherwise
// the chunk writes a partial (max, sum of exponentials, weighted V) and the last of the row's
// chunks to finish (a counter per (m, head)) merges the partials in chunk order. Every partition
// is by absolute key position and none depends on M.
//
// The output is written as f32 (if out) and as Q8 blocks (if qs): the next GEMV's input.
//
// Grid: (max chunks a row can span, n_head, M); block: ATTN_THREADS threads.
// q: [M, n_head, hd] f32 (scaled). out: [M, n_head * hd] f32; qs/qd/qsum: the Q8 planes of M rows
// of n_head * hd values. partials: [M][n_head][chunks_max] * (hd + 2) floats. counters:
// [M_MAX * n_head] ints, zero at the start and left at zero.

#define ATTN_CHUNK 64
#define ATTN_THREADS 256
#define ATTN_WARPS (ATTN_THREADS / WARP)
#define ATTN_SUB (ATTN_CHUNK / ATTN_WARPS)
#define ATTN_KB 4  // heads of 512: keys a warp loads at once

struct AttnArgs {
    const float* q; const uint8_t* k_cache; const uint8_t* v_cache;
    float* out; float* partials; int* counters;
    const StepParams* step;
    int8_t* qs; float* qd; int* qsum;
    int ctx; int window; int n_head; int n_kv; int chunks_max;
    const float* gate;  // [M, n_head * hd] or null: the output times sigmoid(gate) (Qwen3.5's gated attention)
    int k_type; int v_type;  // the caches' KvT (the f32 kernels read f32 caches alone)
    uint8_t* const* kv_slots;  // or null: per slot, its K and V cache (row_cache)
    const float* turbo;  // the turbo types' tables (TURBO_TAB_*), where a cache is of one
};

// Key `key`'s K (or V) values of lane `lane` from a layer's cache for KV head g: f32 rows through
// the vector loads (the untyped kernels), any KvT through kv_load (the typed ones).
template <int HD, bool TYPED>
__device__ __forceinline__ void kv_row(const uint8_t* cache, int type, int ctx, int g, int key, int lane, float* v, const float* tab) {
    constexpr int E = HD / WARP;
    if constexpr (!TYPED) {
        VecF<E>::load(reinterpret_cast<const float*>(cache) + ((size_t)g * ctx + key) * HD + lane * E, v);
    } else {
        kv_load<E>(cache + ((size_t)g * ctx + key) * kv_row_bytes(type, HD), type, lane, v, tab);
    }
}


// Writes dim t of row m, head h: y as f32 and as Q8 (a warp's 32 lanes hold a 32-value block of
// the head, t = 32 w + lane + ATTN_THREADS r; the same arithmetic as norm_quant's plain mode).
template <int HD>
__device__ __forceinline__ void attn_emit(const AttnArgs& p, int m, int h, int t, float y) {
    const int lane = t % WARP;
    const int k = p.n_head * HD;
    const size_t i = (size_t)m * k + (size_t)h * HD + t;
    if (p.gate) y *= 1.0f / (1.0f + expf(-p.gate[i]));
    if (p.out) p.out[i] = y;
    if (p.qs) {
        const float amax = warp_max(fabsf(y));
        const float dq = amax / 127.0f;
        const int q = dq == 0.0f ? 0 : (int)rintf(y / dq);
        p.qs[i] = (int8_t)q;
        const int sum = warp_sum_i(q);
        const size_t b = (size_t)m * (k / QK) + ((size_t)h * HD + t) / QK;
        if (lane == 0) { p.qd[b] = dq; p.qsum[b] = sum; }
    }
}

template <int HD, bool TYPED>
__device__ void attn_body(const AttnArgs& p) {
    constexpr int E = HD / WARP;
    __shared__ float wmax[ATTN_WARPS], wsum[ATTN_WARPS];
    __shared__ float wacc[ATTN_WARPS][HD];  // [warp][e * 32 + lane]: dim lane * E + e
    __shared__ float stat[2];
    __shared__ int last;
    const int c = blockIdx.x, h = blockIdx.y, m = blockIdx.z;
    const int g = h / (p.n_head / p.n_kv);
    const SeqRow sr = step_row(p.step, m);
    const int qpos = sr.pos;
    const int hi = sr.kv_end > 0 ? min(qpos, sr.kv_end - 1) : qpos;
    const int lo = p.window > 0 ? max(0, qpos - p.window + 1) : 0;
    const int c0 = lo / ATTN_CHUNK, nchunks = hi / ATTN_CHUNK - c0 + 1;
    if (c >= nchunks) return;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    // This warp's keys: its sub-chunk's absolute range, clipped to [lo, hi].
    const int base = (c0 + c) * ATTN_CHUNK + warp * ATTN_SUB;
    const int s0 = max(lo, base), nk = min(hi, base + ATTN_SUB - 1) - s0 + 1;
    const int kt = TYPED ? p.k_type : KV_F32, vt = TYPED ? p.v_type : KV_F32;
    // The row's sequence's caches (its slot of the layer's pool, or its kv_slots entry).
    const uint8_t* k_cache = row_cache(const_cast<uint8_t*>(p.k_cache), p.kv_slots, sr.slot, 0, (size_t)p.n_kv * p.ctx * kv_row_bytes(kt, HD));
    const uint8_t* v_cache = row_cache(const_cast<uint8_t*>(p.v_cache), p.kv_slots, sr.slot, 1, (size_t)p.n_kv * p.ctx * kv_row_bytes(vt, HD));
    pdl_trigger();
    // Keys before the step's first position were written by earlier steps: towards L2 before
    // the wait (the step's own rows come from the previous launch).
    {
        const size_t kb = kv_row_bytes(kt, HD), vb = kv_row_bytes(vt, HD);
        const int lines = (int)((max(kb, vb) + 127) / 128);  // 128-byte lines per key row
        const int pos0 = sr.first;
        for (int t = lane; t < ATTN_SUB * lines; t += WARP) {
            const int j = t / lines, key = s0 + j;
            const size_t off = (size_t)(t % lines) * 128;
            if (j < nk && key < pos0) {
                if (off < kb) prefetch_l2(k_cache + ((size_t)g * p.ctx + key) * kb + off);
                if (off < vb) prefetch_l2(v_cache + ((size_t)g * p.ctx + key) * vb + off);
            }
        }
    }
    pdl_wait();
    float qr[E];
    VecF<E>::load(p.q + ((size_t)m * p.n_head + h) * HD + lane * E, qr);
    // Keys stored rotated are scored in their basis: the query rotated the same way.
    if (TYPED && kv_turbo_bits(kt)) turbo_rotate_lanes<E>(qr, lane, p.turbo);
    // Values stored rotated are summed in their basis and rotated back as they are written.
    const bool v_rot = TYPED && kv_turbo_bits(vt);
    float sc[ATTN_SUB], mx = -INFINITY, acc[E], sum = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = 0.0f;
    if constexpr (HD <= 256) {
        // K and V rows of the warp's keys, all loads issued at once.
        float kv[ATTN_SUB][E], vv[ATTN_SUB][E];
#pragma unroll
        for (int j = 0; j < ATTN_SUB; ++j) {
#pragma unroll
            for (int e = 0; e < E; ++e) kv[j][e] = vv[j][e] = 0.0f;
            if (j < nk) {
                kv_row<HD, TYPED>(k_cache, kt, p.ctx, g, s0 + j, lane, kv[j], p.turbo);
                kv_row<HD, TYPED>(v_cache, vt, p.ctx, g, s0 + j, lane, vv[j], p.turbo);
            }
        }
#pragma unroll
        for (int j = 0; j < ATTN_SUB; ++j) {
            float t = 0.0f;
#pragma unroll
            for (int e = 0; e < E; ++e) t += qr[e] * kv[j][e];
            sc[j] = warp_sum(t);
        }
#pragma unroll
        for (int j = 0; j < ATTN_SUB; ++j) if (j < nk) mx = fmaxf(mx, sc[j]);
#pragma unroll
        for (int j = 0; j < ATTN_SUB; ++j) {
            if (j < nk) {
                const float w = expf(sc[j] - mx);
                sum += w;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[e] += w * vv[j][e];
            }
        }
    } else {
        // Heads of 512 (Gemma 4's global layers): the same sums over the same keys, the K rows
        // loaded ATTN_KB at a time for the scores, then the V rows for the weighted sum (a
        // warp's 8 keys' K and V at once would not fit the registers).
        constexpr int KB = ATTN_KB;
#pragma unroll
        for (int j0 = 0; j0 < ATTN_SUB; j0 += KB) {
            float kv[KB][E];
#pragma unroll
            for (int j = 0; j < KB; ++j) {
#pragma unroll
                for (int e = 0; e < E; ++e) kv[j][e] = 0.0f;
                if (j0 + j < nk) kv_row<HD, TYPED>(k_cache, kt, p.ctx, g, s0 + j0 + j, lane, kv[j], p.turbo);
            }
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                float t = 0.0f;
#pragma unroll
                for (int e = 0; e < E; ++e) t += qr[e] * kv[j][e];
                sc[j0 + j] = warp_sum(t);
            }
        }
#pragma unroll
        for (int j = 0; j < ATTN_SUB; ++j) if (j < nk) mx = fmaxf(mx, sc[j]);
#pragma unroll
        for (int j0 = 0; j0 < ATTN_SUB; j0 += KB) {
            float vv[KB][E];
#pragma unroll
            for (int j = 0; j < KB; ++j) {
#pragma unroll
                for (int e = 0; e < E; ++e) vv[j][e] = 0.0f;
                if (j0 + j < nk) kv_row<HD, TYPED>(v_cache, vt, p.ctx, g, s0 + j0 + j, lane, vv[j], p.turbo);
            }
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                if (j0 + j < nk) {
                    const float w = expf(sc[j0 + j] - mx);
                    sum += w;
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[e] += w * vv[j][e];
                }
            }
        }
    }
    if (lane == 0) { wmax[warp] = mx; wsum[warp] = sum; }
    __syncthreads();
    // The block's max and denominator (every thread, in warp order); a warp with no keys has
    // max -inf and adds nothing.
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) M = fmaxf(M, wmax[w]);
    float den = 0.0f;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) den += wmax[w] == -INFINITY ? 0.0f : wsum[w] * expf(wmax[w] - M);
    const float scale = mx == -INFINITY ? 0.0f : expf(mx - M);
#pragma unroll
    for (int e = 0; e < E; ++e) wacc[warp][e * WARP + lane] = acc[e] * scale;
    __syncthreads();
    // Thread t: dims t, t + ATTN_THREADS, ... below HD, the warps' sums added in warp order.
    constexpr int DPT = (HD + ATTN_THREADS - 1) / ATTN_THREADS;  // dims per thread
    float o[DPT];
#pragma unroll
    for (int r = 0; r < DPT; ++r) {
        const int d = tid + r * ATTN_THREADS;
        o[r] = 0.0f;
        if (d < HD) {
            const int idx = (d % E) * WARP + d / E;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) o[r] += wacc[w][idx];
        }
    }
    if (nchunks == 1) {
        // (A warp's 32 threads hold one group's 32 dims: HD is a multiple of 32.)
#pragma unroll
        for (int r = 0; r < DPT; ++r) {
            if (tid + r * ATTN_THREADS < HD) {
                const float y = o[r] / den;
                attn_emit<HD>(p, m, h, tid + r * ATTN_THREADS, v_rot ? turbo_unrotate_warp(y, lane, p.turbo) : y);
            }
        }
        return;
    }
    float* ph = p.partials + ((size_t)m * p.n_head + h) * p.chunks_max * (HD + 2);
#pragma unroll
    for (int r = 0; r < DPT; ++r) if (tid + r * ATTN_THREADS < HD) ph[(size_t)c * (HD + 2) + 2 + tid + r * ATTN_THREADS] = o[r];
    if (tid == 0) { ph[(size_t)c * (HD + 2)] = M; ph[(size_t)c * (HD + 2) + 1] = den; }
    // The last chunk of this (m, h) to finish merges the chunks in chunk order.
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const int done = atomicAdd(&p.counters[m * p.n_head + h], 1);
        last = done == nchunks - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (warp == 0) {
        // Max over the chunks, then the denominator, each a fixed tree over lanes in chunk order.
        float M2 = -INFINITY;
        for (int cc = lane; cc < nchunks; cc += WARP) M2 = fmaxf(M2, __ldcg(ph + (size_t)cc * (HD + 2)));
        M2 = warp_max(M2);
        float den2 = 0.0f;
        for (int cc = lane; cc < nchunks; cc += WARP) den2 += __ldcg(ph + (size_t)cc * (HD + 2) + 1) * expf(__ldcg(ph + (size_t)cc * (HD + 2)) - M2);
        den2 = warp_sum(den2);
        if (lane == 0) { stat[0] = M2; stat[1] = den2; }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < DPT; ++r) {
        const int d = tid + r * ATTN_THREADS;
        if (d >= HD) break;
        const float M2 = stat[0];
        float o2 = 0.0f;
        for (int cc = 0; cc < nchunks; ++cc) {
            const float* pc = ph + (size_t)cc * (HD + 2);
            o2 += __ldcg(pc + 2 + d) * expf(__ldcg(pc) - M2);
        }
        const float y = o2 / stat[1];
        attn_emit<HD>(p, m, h, d, v_rot ? turbo_unrotate_warp(y, lane, p.turbo) : y);
    }
    if (tid == 0) p.counters[m * p.n_head + h] = 0;
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_hd64(const AttnArgs p) { attn_body<64, false>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_hd128(const AttnArgs p) { attn_body<128, false>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_hd256(const AttnArgs p) { attn_body<256, false>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_hd512(const AttnArgs p) { attn_body<512, false>(p); }
// Caches of any KvT (K and V apart).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_typed_hd64(const AttnArgs p) { attn_body<64, true>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_typed_hd128(const AttnArgs p) { attn_body<128, true>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_typed_hd256(const AttnArgs p) { attn_body<256, true>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode_typed_hd512(const AttnArgs p) { attn_body<512, true>(p); }

// ---------------------------------------------------------------------------------------------
// Attention for a prompt's many rows. A block takes ATTN_PROWS consecutive rows of one query
// head; its warps take turns over the keys the rows see (warp w: sub-chunks of ATTN_PSUB keys
// numbered w, w + 8, ...), load each sub-chunk's K and V rows once into registers and score them
// against every row that sees them, each row with a running softmax per warp. The warps' states
// are merged per row at the end (in warp order). No partials and no merge across blocks; the
// sums are not attn_body's, so a prompt's rows match the decode attention to float rounding.
//
// Grid: (ceil(step->rows / ATTN_PROWS), n_head) (ATTN_PROWS_512 at heads of 512); block
// ATTN_THREADS. Output as attn_body's.

#define ATTN_PROWS 8
#define ATTN_PSUB 4
#define ATTN_PROWS_512 4  // rows a block at heads of 512

template <int HD, bool TYPED, int PR = ATTN_PROWS, int PS = ATTN_PSUB>
__device__ void attn_prompt_body(const AttnArgs& p) {
    constexpr int E = HD / WARP;
    __shared__ float qsm[PR][HD];
    __shared__ float st[ATTN_WARPS][HD + 2];
    const int h = blockIdx.y;
    const int g = h / (p.n_head / p.n_kv);
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    pdl_trigger();
    pdl_wait();
    const int pos0 = p.step->pos, rows = p.step->rows;
    const int m0 = (int)blockIdx.x * PR, nr = min(PR, rows - m0);
    if (nr <= 0) return;
    for (int i = tid; i < nr * HD; i += ATTN_THREADS) qsm[i / HD][i % HD] = p.q[((size_t)(m0 + i / HD) * p.n_head + h) * HD + i % HD];
    __syncthreads();
    const int lo_first = p.window > 0 ? max(0, pos0 + m0 - p.window + 1) : 0, hi_last = pos0 + m0 + nr - 1;
    const int kt = TYPED ? p.k_type : KV_F32, vt = TYPED ? p.v_type : KV_F32;
    // Keys stored rotated: the queries rotated the same way (a warp a row, E dims a lane).
    if (TYPED && kv_turbo_bits(kt)) {
        for (int r = warp; r < nr; r += ATTN_WARPS) {
            float v[E];
#pragma unroll
            for (int e = 0; e < E; ++e) v[e] = qsm[r][lane * E + e];
            turbo_rotate_lanes<E>(v, lane, p.turbo);
#pragma unroll
            for (int e = 0; e < E; ++e) qsm[r][lane * E + e] = v[e];
        }
        __syncthreads();
    }
    const bool v_rot = TYPED && kv_turbo_bits(vt);
    float rmax[PR], rsum[PR], acc[PR][E];
#pragma unroll
    for (int r = 0; r < PR; ++r) {
        rmax[r] = -INFINITY;
        rsum[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[r][e] = 0.0f;
    }
    for (int base = lo_first + warp * PS; base <= hi_last; base += ATTN_WARPS * PS) {
        const int nk = min(PS, hi_last - base + 1);
        float kv[PS][E], vv[PS][E];
#pragma unroll
        for (int j = 0; j < PS; ++j) {
#pragma unroll
            for (int e = 0; e < E; ++e) kv[j][e] = vv[j][e] = 0.0f;
            if (j < nk) {
                kv_row<HD, TYPED>(p.k_cache, kt, p.ctx, g, base + j, lane, kv[j], p.turbo);
                kv_row<HD, TYPED>(p.v_cache, vt, p.ctx, g, base + j, lane, vv[j], p.turbo);
            }
        }
#pragma unroll
        for (int r = 0; r < PR; ++r) {
            const int hi = pos0 + m0 + r;
            const int lo = p.window > 0 ? max(0, hi - p.window + 1) : 0;
            // Keys base + j with lo <= base + j <= hi (the same for the whole warp).
            const int j0 = max(0, lo - base), j1 = min(nk, hi - base + 1);
            if (r >= nr || j0 >= j1) continue;
            float qr[E];
#pragma unroll
            for (int e = 0; e < E; ++e) qr[e] = qsm[r][lane * E + e];
            float sc[PS], mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < PS; ++j) {
                float t = 0.0f;
#pragma unroll
                for (int e = 0; e < E; ++e) t += qr[e] * kv[j][e];
                sc[j] = warp_sum(t);
                if (j >= j0 && j < j1) mx = fmaxf(mx, sc[j]);
            }
            const float nm = fmaxf(rmax[r], mx);
            const float keep = rmax[r] == -INFINITY ? 0.0f : expf(rmax[r] - nm);
            rsum[r] *= keep;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[r][e] *= keep;
#pragma unroll
            for (int j = 0; j < PS; ++j) {
                if (j >= j0 && j < j1) {
                    const float w = expf(sc[j] - nm);
                    rsum[r] += w;
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[r][e] += w * vv[j][e];
                }
            }
            rmax[r] = nm;
        }
    }
    // Per row: the warps' states merged in warp order; thread t writes dims t, t + ATTN_THREADS, ...
#pragma unroll
    for (int r = 0; r < PR; ++r) {
        if (r >= nr) break;
        if (lane == 0) { st[warp][0] = rmax[r]; st[warp][1] = rsum[r]; }
#pragma unroll
        for (int e = 0; e < E; ++e) st[warp][2 + lane * E + e] = acc[r][e];
        __syncthreads();
        for (int d = tid; d < HD; d += ATTN_THREADS) {
            float M = -INFINITY;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) M = fmaxf(M, st[w][0]);
            float den = 0.0f, o = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) {
                if (st[w][0] == -INFINITY) continue;
                const float f = expf(st[w][0] - M);
                den += st[w][1] * f;
                o += st[w][2 + d] * f;
            }
            // (HD a multiple of 32: a warp's threads hold one group's dims.)
            attn_emit<HD>(p, m0 + r, h, d, v_rot ? turbo_unrotate_warp(o / den, lane, p.turbo) : o / den);
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prompt_hd64(const AttnArgs p) { attn_prompt_body<64, false>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prompt_hd128(const AttnArgs p) { attn_prompt_body<128, false>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prompt_hd256(const AttnArgs p) { attn_prompt_body<256, false>(p); }
// Heads of 512: 4 rows a block and 2 keys a load (the registers of 8 rows of 16 dims each).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prompt_hd512(const AttnArgs p) { attn_prompt_body<512, false, ATTN_PROWS_512, 2>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prompt_typed_hd64(const AttnArgs p) { attn_prompt_body<64, true>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prompt_typed_hd128(const AttnArgs p) { attn_prompt_body<128, true>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prompt_typed_hd256(const AttnArgs p) { attn_prompt_body<256, true>(p); }
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prompt_typed_hd512(const AttnArgs p) { attn_prompt_body<512, true, ATTN_PROWS_512, 2>(p); }

// ---------------------------------------------------------------------------------------------
// Greedy argmax over each row of logits [M, n]: the largest value, the lowest id on ties (as the
// sampler does), passing over the step's banned ids (the sampler's -inf for them). Grid: (ARGMAX_BLOCKS, M); each block scans a fixed slice, the last block of a row
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
    const StepParams* step;      // the banned ids (or null: none)
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
    pdl_trigger();
    pdl_wait();
    const int per = (p.n + nb - 1) / nb;
    const int i0 = b * per, i1 = min(p.n, i0 + per);
    const int nb_ban = row_banned(p.step, m);
    float v = -INFINITY; int id = 0x7fffffff;
    for (int i = i0 + (int)threadIdx.x; i < i1; i += blockDim.x) {
        bool banned = false;
        for (int j = 0; j < nb_ban; ++j) banned |= p.step->banned[j] == i;
        if (!banned) better(v, id, p.logits[(size_t)m * p.n + i], i);
    }
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

// ---------------------------------------------------------------------------------------------
// The k best logits of each row (k <= TOPK_MAX) under the sampler's order: the logit by total
// order (Rust's f32::total_cmp), descending, ties to the lower id; the step's banned ids left
// out. Exact: block b sorts its slice of TOPK_SLICE values by a 64-bit key (the logit's bits
// made order-preserving, then the inverted id) with a bitonic sort in shared memory and keeps its
// TOPK_MAX best; the last block of a row to finish sorts the blocks' candidates and writes the
// row's k best (a sampled request then reads k pairs instead of the row). Rows of up to
// TOPK_SLICE * TOPK_SLICE / TOPK_MAX values.
//
// Grid: (ceil(n / TOPK_SLICE), M); block TOPK_THREADS.

#define TOPK_MAX 64
#define TOPK_SLICE 4096
#define TOPK_THREADS 512

struct TopKArgs {
    const float* logits; int n; int k;
    unsigned long long* cand;  // [M][blocks][TOPK_MAX]
    int* counters;             // [MAX_ROWS], zero at the start and left at zero
    int* ids; float* vals;     // [M][k]; an id of -1 where the row has fewer than k values
    const StepParams* step;    // the banned ids (or null: none)
    int row0;                  // the step's row of row 0 here (its seq_rows entry says no_ban)
    int pad;
};

__device__ __forceinline__ unsigned long long topk_key(float v, int id) {
    int i = __float_as_int(v);
    i ^= (int)(((unsigned)(i >> 31)) >> 1);
    const unsigned u = (unsigned)i ^ 0x80000000u;
    return ((unsigned long long)u << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)id);
}
__device__ __forceinline__ float topk_value(unsigned long long key) {
    int i = (int)((unsigned)(key >> 32) ^ 0x80000000u);
    i ^= (int)(((unsigned)(i >> 31)) >> 1);
    return __int_as_float(i);
}
__device__ __forceinline__ int topk_id(unsigned long long key) { return key == 0 ? -1 : (int)(0xFFFFFFFFu - (unsigned)(key & 0xFFFFFFFFu)); }

// Sorts s[0..N) descending (N a power of two) with all threads of the block.
template <int N>
__device__ void bitonic_desc(unsigned long long* s) {
    for (int size = 2; size <= N; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int t = threadIdx.x; t < N / 2; t += blockDim.x) {
                const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
                const bool desc = (lo & size) == 0;
                const unsigned long long a = s[lo], b = s[hi];
                if ((a < b) == desc && a != b) { s[lo] = b; s[hi] = a; }
            }
        }
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_rows(const TopKArgs p) {
    __shared__ unsigned long long s[TOPK_SLICE];
    __shared__ int last;
    const int b = blockIdx.x, m = blockIdx.y, nb = gridDim.x;
    pdl_trigger();
    pdl_wait();
    const int nb_ban = row_banned(p.step, p.row0 + m);
    for (int t = threadIdx.x; t < TOPK_SLICE; t += blockDim.x) {
        const int i = b * TOPK_SLICE + t;
        unsigned long long key = 0;
        if (i < p.n) {
            bool banned = false;
            for (int j = 0; j < nb_ban; ++j) banned |= p.step->banned[j] == i;
            if (!banned) key = topk_key(p.logits[(size_t)m * p.n + i], i);
        }
        s[t] = key;
    }
    bitonic_desc<TOPK_SLICE>(s);
    unsigned long long* c = p.cand + ((size_t)m * nb + b) * TOPK_MAX;
    for (int t = threadIdx.x; t < TOPK_MAX; t += blockDim.x) c[t] = s[t];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&p.counters[m], 1) == nb - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = threadIdx.x; t < TOPK_SLICE; t += blockDim.x) s[t] = t < nb * TOPK_MAX ? __ldcg(p.cand + (size_t)m * nb * TOPK_MAX + t) : 0ull;
    bitonic_desc<TOPK_SLICE>(s);
    for (int t = threadIdx.x; t < p.k; t += blockDim.x) {
        p.ids[m * p.k + t] = topk_id(s[t]);
        p.vals[m * p.k + t] = topk_value(s[t]);
    }
    if (threadIdx.x == 0) p.counters[m] = 0;
}

// ---------------------------------------------------------------------------------------------
// The gated delta-net (Qwen3.5/3.6's linear-attention layers), token by token in the recurrent
// form, as candle's CPU path computes it (candle-nn gated_delta_net.rs): the causal conv with
// SiLU, q and k L2-normalised (q also scaled), beta = sigmoid(b), the decay exp(a softplus(alpha +
// dt_bias)), the delta rule, then RMSNorm(o) w SiLU(z).
//
// A layer's recurrent state (the conv window and the delta state) lives in n_planes planes: a
// step reads the plane the step block names (`plane`) and writes the state after its row m into
// plane (plane + 1 + m) % n_planes (only for the last n_planes - 1 rows: a prompt step's earlier
// rows are not kept). Rolling back to any of those rows is then choosing the next step's plane,
// with no copy; the rows of a step are computed one after the other with the same operations
// whatever the step's row count, so a verify row's state is a one-token step's bit for bit.

// The conv over the window of the K - 1 rows before each row, then SiLU: channel c of row m,
// y = SiLU(sum_j w[c][j] r[m + j][c]) over r = [window; x]. Grid: ceil(C / 256); a thread per
// channel walks the step's rows in order. planes: [n_planes][K - 1][C].
struct ConvArgs {
    const float* x;   // [rows][C]: the fused QKV projection
    const float* w;   // [C][K]
    float* planes;    // the windows
    float* y;         // [rows][C]
    const StepParams* step;
    int C; int K; int n_planes; int rows;
};

template <int K>
__device__ __forceinline__ void conv_silu_body(const ConvArgs& p, int c) {
    const int P = p.n_planes, p0 = p.step->plane, C = p.C;
    const size_t plane_sz = (size_t)(K - 1) * C;
    float wt[K], r[K];
#pragma unroll
    for (int j = 0; j < K; ++j) wt[j] = __ldg(p.w + (size_t)c * K + j);
#pragma unroll
    for (int j = 0; j < K - 1; ++j) r[j] = p.planes[(size_t)p0 * plane_sz + (size_t)j * C + c];
    for (int m = 0; m < p.rows; ++m) {
        r[K - 1] = p.x[(size_t)m * C + c];
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < K; ++j) s += wt[j] * r[j];
        p.y[(size_t)m * C + c] = s / (1.0f + expf(-s));
#pragma unroll
        for (int j = 0; j < K - 1; ++j) r[j] = r[j + 1];
        if (p.rows - 1 - m < P - 1) {
            float* dst = p.planes + (size_t)((p0 + 1 + m) % P) * plane_sz + c;
#pragma unroll
            for (int j = 0; j < K - 1; ++j) dst[(size_t)j * C] = r[j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) conv_silu(const ConvArgs p) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    pdl_trigger();
    pdl_wait();
    if (c >= p.C) return;
    switch (p.K) {
        case 2: conv_silu_body<2>(p, c); break;
        case 3: conv_silu_body<3>(p, c); break;
        case 4: conv_silu_body<4>(p, c); break;
        case 5: conv_silu_body<5>(p, c); break;
        default: break;
    }
}

// The delta rule over the step's rows: block (value head h, group of GDN_WARPS columns), warp w
// owns column col of h's state (stored transposed, [col][i], so a warp's loads are contiguous),
// lane l holding entries i = l + 32 e. Value head h reads key head h mod hk (llama.cpp's tiled
// order). Per row: q, k of that key head L2-normalised (q times q_scale), then
//   S <- exp(g) S;  u = beta (v_col - S^T k);  S <- S + k u;  o_col = S^T q.
// planes: [n_planes][hv][d][d]. qkv: [rows][(2 hk + hv) d] after the conv; alpha, beta:
// [rows][hv]; out: [rows][hv d].

#define GDN_WARPS 4

struct GdnArgs {
    const float* qkv; const float* alpha; const float* beta;
    const float* dt_bias; const float* a;  // [hv] each; a = -exp(A_log)
    float* planes; float* out;
    const StepParams* step;
    int hk; int hv; int d; int n_planes; int rows;
    float eps; float q_scale; int pad_;
};

// Row m of the delta rule for column col of value head h: q and k of its key head at qr and kr
// (lane l holding entries l + 32 e), v at vp; updates the column's state S, writes o and (for
// the last n_planes - 1 rows) the state into plane (p0 + 1 + m) % n_planes. gated_delta_rule
// and conv_gated_delta_rule both step through it, so their rows are the same operations.
template <int E>
__device__ __forceinline__ void gdn_row(const GdnArgs& p, int h, int col, int m, int p0, const float* qr, const float* kr, const float* vp, float a, float dtb, float (&S)[E]) {
    const int lane = threadIdx.x % WARP, d = 32 * E, P = p.n_planes;
    const size_t plane_sz = (size_t)p.hv * d * d, at = ((size_t)h * d + col) * d + lane;
    float q[E], k[E], sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        q[e] = qr[lane + 32 * e];
        k[e] = kr[lane + 32 * e];
        sq += q[e] * q[e];
        sk += k[e] * k[e];
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    const float fq = (1.0f / sqrtf(sq + p.eps)) * p.q_scale, fk = 1.0f / sqrtf(sk + p.eps);
    const float v = *vp;
    const float bt = 1.0f / (1.0f + expf(-p.beta[(size_t)m * p.hv + h]));
    const float x = p.alpha[(size_t)m * p.hv + h] + dtb;
    const float decay = expf(a * (x > 20.0f ? x : log1pf(expf(x))));
    float kv = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        q[e] *= fq;
        k[e] *= fk;
        S[e] *= decay;
        kv += S[e] * k[e];
    }
    kv = warp_sum(kv);
    const float u = bt * (v - kv);
    float o = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        S[e] += k[e] * u;
        o += S[e] * q[e];
    }
    o = warp_sum(o);
    if (lane == 0) p.out[(size_t)m * p.hv * d + (size_t)h * d + col] = o;
    if (p.rows - 1 - m < P - 1) {
        float* dst = p.planes + (size_t)((p0 + 1 + m) % P) * plane_sz + at;
#pragma unroll
        for (int e = 0; e < E; ++e) dst[32 * e] = S[e];
    }
}

template <int E>
__device__ __forceinline__ void gdn_body(const GdnArgs& p) {
    const int h = blockIdx.x, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int d = 32 * E, col = blockIdx.y * GDN_WARPS + warp;
    const int kh = h % p.hk, C = (2 * p.hk + p.hv) * d;
    const int p0 = p.step->plane;
    const size_t plane_sz = (size_t)p.hv * d * d, at = ((size_t)h * d + col) * d + lane;
    float S[E];
#pragma unroll
    for (int e = 0; e < E; ++e) S[e] = p.planes[(size_t)p0 * plane_sz + at + 32 * e];
    const float a = __ldg(p.a + h), dtb = __ldg(p.dt_bias + h);
    for (int m = 0; m < p.rows; ++m) {
        const float* row = p.qkv + (size_t)m * C;
        gdn_row<E>(p, h, col, m, p0, row + kh * d, row + (p.hk + kh) * d, row + (2 * p.hk + h) * d + col, a, dtb, S);
    }
}

// Grid: (hv, d / GDN_WARPS); block GDN_WARPS warps.
extern "C" __global__ void __launch_bounds__(GDN_WARPS * WARP) gated_delta_rule(const GdnArgs p) {
    pdl_trigger();
    pdl_wait();
    switch (p.d) {
        case 64: gdn_body<2>(p); break;
        case 128: gdn_body<4>(p); break;
        case 256: gdn_body<8>(p); break;
        default: break;
    }
}

// conv_silu and gated_delta_rule in one launch, for steps of up to MAX_ROWS rows (decode and
// verify; a prompt step runs the two kernels). Block (h, group of CGDN_WARPS columns) loads its
// columns' state, then runs the conv for the channels it reads: key head h mod hk's q and k, and its own value columns, into shared
// memory (the same operations as conv_silu, so the same bits), then the delta rule as
// gated_delta_rule over them. Several blocks convolve the same q/k channels; only block
// (h < hk, y = 0) writes their windows, each block its own value columns'. No block reads a
// window plane another writes: rows <= n_planes - 1, so the planes written are not the one read.

// A batched step (ent_rows set): block z runs entry z, a sequence's rows ent_rows[3z] ..
// + ent_rows[3z + 1] of the step (0 rows: no entry) from its state plane ent_rows[3z + 2], over
// its own conv windows and delta-rule states (ent_planes[2z], [2z + 1]): the same operations as
// that sequence's own launch, so the same bits.
struct ConvGdnArgs {
    ConvArgs conv; GdnArgs gdn;
    const int* ent_rows; const unsigned long long* ent_planes;
};

#define CGDN_WARPS 16

// The conv's outputs for the block: q and k of its key head, its value columns (declared once, in
// the kernel: a __shared__ array in a template body would be allocated once per instantiation).
struct CgdnSmem { float q[MAX_ROWS][256]; float k[MAX_ROWS][256]; float v[MAX_ROWS][CGDN_WARPS]; };

template <int E, int K>
__device__ __forceinline__ void conv_gdn_body(const ConvGdnArgs& a, CgdnSmem& sm, int plane) {
    float (&sq)[MAX_ROWS][256] = sm.q;
    float (&sk)[MAX_ROWS][256] = sm.k;
    float (&sv)[MAX_ROWS][CGDN_WARPS] = sm.v;
    const ConvArgs& cv = a.conv;
    const GdnArgs& p = a.gdn;
    const int h = blockIdx.x, d = 32 * E, kh = h % p.hk, C = cv.C;
    const int rows = p.rows;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int col = blockIdx.y * CGDN_WARPS + warp;
    // The state first: its loads are in flight while the conv runs.
    const int ps0 = plane;
    const size_t splane = (size_t)p.hv * d * d, at = ((size_t)h * d + col) * d + lane;
    float S[E];
#pragma unroll
    for (int e = 0; e < E; ++e) S[e] = p.planes[(size_t)ps0 * splane + at + 32 * e];
    const int P = cv.n_planes, p0 = plane;
    const size_t plane_sz = (size_t)(K - 1) * C;
    for (int j = threadIdx.x; j < 2 * d + CGDN_WARPS; j += blockDim.x) {
        const int c = j < d ? kh * d + j : j < 2 * d ? (p.hk + kh) * d + (j - d) : (2 * p.hk + h) * d + blockIdx.y * CGDN_WARPS + (j - 2 * d);
        const bool writer = j >= 2 * d || (h < p.hk && blockIdx.y == 0);
        float wt[K], r[K], xs[MAX_ROWS];
#pragma unroll
        for (int t = 0; t < K; ++t) wt[t] = __ldg(cv.w + (size_t)c * K + t);
#pragma unroll
        for (int t = 0; t < K - 1; ++t) r[t] = cv.planes[(size_t)p0 * plane_sz + (size_t)t * C + c];
#pragma unroll
        for (int m = 0; m < MAX_ROWS; ++m) xs[m] = m < rows ? cv.x[(size_t)m * C + c] : 0.0f;
#pragma unroll
        for (int m = 0; m < MAX_ROWS; ++m) {
            if (m >= rows) break;
            r[K - 1] = xs[m];
            float s = 0.0f;
#pragma unroll
            for (int t = 0; t < K; ++t) s += wt[t] * r[t];
            const float y = s / (1.0f + expf(-s));
            if (j < d) sq[m][j] = y;
            else if (j < 2 * d) sk[m][j - d] = y;
            else sv[m][j - 2 * d] = y;
#pragma unroll
            for (int t = 0; t < K - 1; ++t) r[t] = r[t + 1];
            if (writer && rows - 1 - m < P - 1) {
                float* dst = cv.planes + (size_t)((p0 + 1 + m) % P) * plane_sz + c;
#pragma unroll
                for (int t = 0; t < K - 1; ++t) dst[(size_t)t * C] = r[t];
            }
        }
    }
    __syncthreads();
    const float av = __ldg(p.a + h), dtb = __ldg(p.dt_bias + h);
    for (int m = 0; m < rows; ++m) gdn_row<E>(p, h, col, m, ps0, sq[m], sk[m], &sv[m][warp], av, dtb, S);
}

template <int E>
__device__ __forceinline__ void conv_gdn_k(const ConvGdnArgs& a, CgdnSmem& sm, int plane) {
    switch (a.conv.K) {
        case 2: conv_gdn_body<E, 2>(a, sm, plane); break;
        case 3: conv_gdn_body<E, 3>(a, sm, plane); break;
        case 4: conv_gdn_body<E, 4>(a, sm, plane); break;
        case 5: conv_gdn_body<E, 5>(a, sm, plane); break;
        default: break;
    }
}

// Grid: (hv, d / CGDN_WARPS, entries: 1 without ent_rows); block CGDN_WARPS warps; rows (an
// entry's) <= MAX_ROWS.
extern "C" __global__ void __launch_bounds__(CGDN_WARPS * WARP) conv_gated_delta_rule(const ConvGdnArgs a0) {
    __shared__ CgdnSmem sm;
    pdl_trigger();
    pdl_wait();
    ConvGdnArgs a = a0;
    int plane;
    if (a.ent_rows) {
        const int* er = a.ent_rows + 3 * blockIdx.z;
        const int row0 = er[0], rows = er[1];
        if (rows <= 0) return;
        plane = er[2];
        const int C = a.conv.C, hv = a.gdn.hv, d = a.gdn.d;
        a.conv.x += (size_t)row0 * C;
        a.conv.rows = rows;
        a.conv.planes = reinterpret_cast<float*>(a.ent_planes[2 * blockIdx.z]);
        a.gdn.alpha += (size_t)row0 * hv;
        a.gdn.beta += (size_t)row0 * hv;
        a.gdn.out += (size_t)row0 * hv * d;
        a.gdn.rows = rows;
        a.gdn.planes = reinterpret_cast<float*>(a.ent_planes[2 * blockIdx.z + 1]);
    } else {
        plane = a.gdn.step->plane;
    }
    switch (a.gdn.d) {
        case 64: conv_gdn_k<2>(a, sm, plane); break;
        case 128: conv_gdn_k<4>(a, sm, plane); break;
        case 256: conv_gdn_k<8>(a, sm, plane); break;
        default: break;
    }
}

// RMSNorm(o) w SiLU(z) per value head (d values), written as the Q8 rows of the output
// projection's input. Grid: (hv, rows); block d threads (a multiple of 32, at most 256).
struct GatedNormArgs {
    const float* o; const float* z; const float* w;  // o, z: [rows][hv d]; w: [d]
    int8_t* qs; float* qd; int* qsum;                // Q8 rows of hv d values
    int hv; int d; float eps; int pad_;
};

extern "C" __global__ void __launch_bounds__(256) gated_norm_quant(const GatedNormArgs p) {
    __shared__ float red[32];
    const int h = blockIdx.x, m = blockIdx.y, t = threadIdx.x, lane = t % WARP;
    pdl_trigger();
    pdl_wait();
    const size_t i = (size_t)m * p.hv * p.d + (size_t)h * p.d + t;
    const float o = p.o[i];
    const float ms = block_sum_all(o * o, red) / (float)p.d;
    const float inv = 1.0f / sqrtf(ms + p.eps);
    const float zv = p.z[i];
    const float y = o * inv * __ldg(p.w + t) * (zv / (1.0f + expf(-zv)));
    const float amax = warp_max(fabsf(y));
    const float dq = amax / 127.0f;
    const int q = dq == 0.0f ? 0 : (int)rintf(y / dq);
    p.qs[i] = (int8_t)q;
    const int sum = warp_sum_i(q);
    if (lane == 0) { p.qd[i / QK] = dq; p.qsum[i / QK] = sum; }
}

// The argument blocks' sizes, asserted on the Rust side too (src/cuda.rs).
static_assert(sizeof(StepParams) == 96, "StepParams");
static_assert(sizeof(SeqRow) == 32, "SeqRow");
static_assert(sizeof(NormQuantArgs) == 152, "NormQuantArgs");
static_assert(sizeof(GemvSeg) == 48, "GemvSeg");
static_assert(sizeof(GemvArgs) == 232, "GemvArgs");
static_assert(sizeof(MoeRouterArgs) == 72, "MoeRouterArgs");
static_assert(sizeof(MoeGemvArgs) == 256, "MoeGemvArgs");
static_assert(sizeof(MoeSortArgs) == 32, "MoeSortArgs");
static_assert(sizeof(MoeMmqArgs) == 264, "MoeMmqArgs");
static_assert(sizeof(MoeCombineArgs) == 64, "MoeCombineArgs");
static_assert(sizeof(RopeArgs) == 152, "RopeArgs");
static_assert(sizeof(AttnArgs) == 136, "AttnArgs");
static_assert(sizeof(ConvArgs) == 56, "ConvArgs");
static_assert(sizeof(GdnArgs) == 96, "GdnArgs");
static_assert(sizeof(GatedNormArgs) == 64, "GatedNormArgs");
static_assert(sizeof(ConvGdnArgs) == 168, "ConvGdnArgs");
static_assert(sizeof(ArgmaxArgs) == 64, "ArgmaxArgs");
static_assert(sizeof(TopKArgs) == 64, "TopKArgs");
static_assert(sizeof(PleArgs) == 72, "PleArgs");
static_assert(sizeof(SoftcapArgs) == 24, "SoftcapArgs");

// ---------------------------------------------------------------------------------------------
// Rotated low-bit KV rows (the `turbo4/3/2` cache types of candle-nn's attention::kv_turbo):
// rows of d values (a multiple of 32, 128 to 512) to their stored bytes. The same f32 operations
// in the same order as kv_turbo::encode_row, each product, quotient and sum rounded on its own
// (no contraction), so the bytes are the CPU's bit for bit. One block per row, a warp per group
// of 32: the group's rotation (signs, butterflies across lanes, 1/sqrt(32)), its RMS, the row's
// f16 scale, each group's first exponent, each width's least error over the exponents near it
// (lane w of the group's warp), the widths one bit at a time where the error falls most (thread
// 0), then the indices and their bytes.
struct TurboArgs {
    const float* x;       // rows x d
    uint8_t* out;         // rows x row_bytes
    const float* steps;   // 32: the scales 2^(-k/8), as the CPU's table holds them
    const float* bounds;  // 32: 2^(-(k - 1/2)/8)
    const float* levels;  // 8 widths x 128: width w's 2^w levels from w * 128
    int d; int bits; int row_bytes; unsigned sign_mask; float inv_sqrt; int search;
};
static_assert(sizeof(TurboArgs) == 64, "TurboArgs");
#define TURBO_MAX_GROUPS 16

__device__ __forceinline__ int turbo_nearest(const float* lv, int n, float t) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int k = (lo + hi) / 2;
        if (t > __fmul_rn(0.5f, __fadd_rn(lv[k], lv[k + 1]))) lo = k + 1;
        else hi = k;
    }
    return lo;
}

__device__ float turbo_group_error(const float* ys, int w, float sigma, const float* levels) {
    float acc = 0.0f;
    if (w == 0) {
        for (int i = 0; i < 32; ++i) acc = __fadd_rn(acc, __fmul_rn(ys[i], ys[i]));
        return acc;
    }
    const float* lv = levels + w * 128;
    for (int i = 0; i < 32; ++i) {
        const float q = __fmul_rn(sigma, lv[turbo_nearest(lv, 1 << w, __fdiv_rn(ys[i], sigma))]);
        const float e = __fsub_rn(ys[i], q);
        acc = __fadd_rn(acc, __fmul_rn(e, e));
    }
    return acc;
}

// One row of a.d values at `x` to its stored bytes at `out` (a block of a.d threads; a.x, a.out
// unread): turbo_encode's and turbo_store's body.
__device__ void turbo_encode_row(const TurboArgs& a, const float* x, uint8_t* out) {
    __shared__ float ys[TURBO_MAX_GROUPS][32];
    __shared__ float rms[TURBO_MAX_GROUPS];
    __shared__ float err[TURBO_MAX_GROUPS][8];
    __shared__ int ex[TURBO_MAX_GROUPS][8];
    __shared__ int wd[TURBO_MAX_GROUPS], e0[TURBO_MAX_GROUPS], ee[TURBO_MAX_GROUPS];
    __shared__ float s32;
    const int lane = threadIdx.x % 32, g = threadIdx.x / 32, ng = a.d / 32;
    float v = x[g * 32 + lane];
    if ((a.sign_mask >> lane) & 1u) v = -v;
    for (int h = 1; h < 32; h <<= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v, h);
        v = (lane & h) ? __fsub_rn(o, v) : __fadd_rn(v, o);
    }
    v = __fmul_rn(v, a.inv_sqrt);
    ys[g][lane] = v;
    __syncwarp();
    if (lane == 0) {
        float acc = 0.0f;
        for (int i = 0; i < 32; ++i) acc = __fadd_rn(acc, __fmul_rn(ys[g][i], ys[g][i]));
        rms[g] = __fsqrt_rn(__fdiv_rn(acc, 32.0f));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = 0.0f;
        for (int i = 0; i < ng; ++i) m = fmaxf(m, rms[i]);
        s32 = __half2float(__float2half_rn(m));
    }
    __syncthreads();
    const float s = s32;
    const bool live = s > 0.0f && isfinite(s);
    if (lane == 0) {
        int c = 0;
        for (int k = 1; k < 32; ++k) c += rms[g] < __fmul_rn(s, a.bounds[k]);
        e0[g] = c;
    }
    __syncwarp();
    if (live && lane < 8) {
        const int w = lane, e = e0[g];
        float best = INFINITY;
        int bk = e;
        const int lo = e - a.search < 0 ? 0 : e - a.search, hi = e + a.search > 31 ? 31 : e + a.search;
        for (int k = lo; k <= hi; ++k) {
            const float x = turbo_group_error(ys[g], w, __fmul_rn(s, a.steps[k]), a.levels);
            if (x < best) { best = x; bk = k; }
        }
        err[g][w] = best;
        ex[g][w] = bk;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 0; i < ng; ++i) wd[i] = 0;
        if (live) {
            for (int it = 0; it < a.bits * ng; ++it) {
                int pick = -1;
                float bg = 0.0f;
                for (int i = 0; i < ng; ++i) {
                    if (wd[i] >= 7) continue;
                    const float gain = __fsub_rn(err[i][wd[i]], err[i][wd[i] + 1]);
                    if (pick < 0 || gain > bg) { pick = i; bg = gain; }
                }
                if (pick < 0) break;
                wd[pick] += 1;
            }
        }
        for (int i = 0; i < ng; ++i) ee[i] = live ? ex[i][wd[i]] : e0[i];
    }
    __syncthreads();
    if (!live)
        for (int b = threadIdx.x; b < a.bits * a.d / 8; b += blockDim.x) out[2 + ng + b] = 0;
    const int w = wd[g], e = ee[g];
    int off = 2 + ng;
    for (int i = 0; i < g; ++i) off += 4 * wd[i];
    // Each group's indices fill 4w whole bytes: lane j writes bits j*w.. of them, a byte at a time
    // by the lanes that own its bits (their codes gathered first).
    int code = 0;
    if (w > 0) {
        const float* lv = a.levels + w * 128;
        code = turbo_nearest(lv, 1 << w, __fdiv_rn(ys[g][lane], __fmul_rn(s, a.steps[e])));
    }
    __shared__ int codes[TURBO_MAX_GROUPS][32];
    codes[g][lane] = code;
    __syncwarp();
    for (int byte = lane; byte < 4 * w; byte += 32) {
        unsigned b = 0;
        for (int bit = 0; bit < 8; ++bit) {
            const int pos = byte * 8 + bit, j = pos / w, q = pos % w;
            b |= (unsigned)((codes[g][j] >> q) & 1) << bit;
        }
        out[off + byte] = (uint8_t)b;
    }
    if (lane == 0) out[2 + g] = (uint8_t)((w << 5) | e);
    if (threadIdx.x == 0) {
        const unsigned short hs = __half_as_ushort(__float2half_rn(s));
        // The low byte through a byte permute: ptxas 13.0 (sm_90a) turns `(uint8_t)(hs & 0xFF)`
        // after the conversion into F2I.U8.F16 (the half's value truncated to an integer, not its
        // low byte); the PTX is right, the machine code is not. Keep the permute.
        out[0] = (uint8_t)__byte_perm((unsigned)hs, 0u, 0x4440);
        out[1] = (uint8_t)(hs >> 8);
    }
}

extern "C" __global__ void __launch_bounds__(32 * TURBO_MAX_GROUPS) turbo_encode(TurboArgs a) {
    const size_t row = blockIdx.x;
    pdl_trigger();
    pdl_wait();
    turbo_encode_row(a, a.x + row * a.d, a.out + row * a.row_bytes);
}

// A step's K and V rows into caches of the turbo types: qk_norm_rope_kv left each (row, KV head)'s
// K (normed, rotated by RoPE) and V (normed where the layer norms it) as f32 in `stage`
// ([rows][n_kv][2][hd]); block (g, m, z) encodes row m's head g of K (z 0) or V (z 1) where that
// cache's type is a turbo one, into the row's sequence's cache at its position (its slot of the
// pool or its kv_slots entry), as qk_norm_rope_kv stores the other types. Inert rows write
// nothing. Block: hd threads.
struct TurboStoreArgs {
    const float* stage;
    uint8_t* k_cache; uint8_t* v_cache;
    const StepParams* step;
    uint8_t* const* kv_slots;
    const float* tab;  // turbo_tab's layout (below)
    int ctx; int n_kv; int hd; int k_type; int v_type; int pad;
};
static_assert(sizeof(TurboStoreArgs) == 72, "TurboStoreArgs");

extern "C" __global__ void __launch_bounds__(32 * TURBO_MAX_GROUPS) turbo_store(TurboStoreArgs p) {
    const int g = blockIdx.x, m = blockIdx.y, z = blockIdx.z;
    pdl_trigger();
    pdl_wait();
    const int type = z == 0 ? p.k_type : p.v_type;
    const int bits = kv_turbo_bits(type);
    const SeqRow sr = step_row(p.step, m);
    if (bits == 0 || sr.inert) return;
    const size_t rb = kv_row_bytes(type, p.hd);
    uint8_t* dst = row_cache(z == 0 ? p.k_cache : p.v_cache, p.kv_slots, sr.slot, z, (size_t)p.n_kv * p.ctx * rb) + ((size_t)g * p.ctx + sr.pos) * rb;
    TurboArgs a;
    a.x = nullptr;
    a.out = nullptr;
    a.steps = p.tab + TURBO_TAB_STEPS;
    a.bounds = p.tab + TURBO_TAB_BOUNDS;
    a.levels = p.tab + TURBO_TAB_LEVELS;
    a.d = p.hd;
    a.bits = bits;
    a.row_bytes = (int)rb;
    unsigned mask = 0;
    for (int i = 0; i < 32; ++i) mask |= (p.tab[TURBO_TAB_SIGNS + i] < 0.0f ? 1u : 0u) << i;
    a.sign_mask = mask;
    a.inv_sqrt = p.tab[TURBO_TAB_INV_SQRT];
    a.search = (int)p.tab[TURBO_TAB_SEARCH];
    turbo_encode_row(a, p.stage + (((size_t)m * p.n_kv + g) * 2 + z) * p.hd, dst);
}
