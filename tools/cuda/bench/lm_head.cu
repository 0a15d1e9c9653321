// The LM head's GEMV, measured on the device: the engine's kernels (decode.cu, included as is)
// over the GGUF layout (gemv_staged, and gemv as two segments) against gemv_wide over the wide
// layout at each lanes-per-row, plus a plain read of the same bytes (the roof). Checks that every
// variant gives the same logits as gemv_staged to float rounding.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/lm_head tools/cuda/bench/lm_head.cu && /tmp/lm_head
#include "../../../engine/crates/tine-gpu/kernels/decode.cu"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cmath>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

static uint64_t rs = 88172645463325252ull;
static uint32_t rnd() { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (uint32_t)rs; }
static uint16_t f2h(float f) { return __half_as_ushort(__float2half(f)); }

extern "C" __global__ void read_roof(const int4* w, size_t n16, int* out) {
    int acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        const int4 v = __ldcs(w + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678) out[0] = acc;
}

// One original row (GGUF blocks) to the wide layout.
static void to_wide(int type, int k, const uint8_t* src, uint8_t* dst) {
    const size_t rb = wide_row_bytes(type, k);
    memset(dst, 0, rb);
    const int U = k / 32;
    if (type == W_Q8_0) {
        for (int u = 0; u < U; ++u) {
            memcpy(dst + 32 * u, src + 34 * u + 2, 32);
            memcpy(dst + k + 2 * u, src + 34 * u, 2);
        }
        return;
    }
    for (int u = 0; u < U; ++u) {
        const uint8_t* b = src + 210 * (u / 8);
        const int j = u % 8, n = j / 4, t = j % 4;
        int vals[32];
        for (int l = 0; l < 32; ++l) {
            const int lo = (b[64 * n + (t & 1) * 32 + l] >> ((t >> 1) * 4)) & 0xF;
            const int hi = (b[128 + 32 * n + l] >> (2 * t)) & 3;
            vals[l] = lo | (hi << 4);
        }
        uint8_t* lo = dst + 16 * u;
        uint8_t* hi = dst + k / 2 + 8 * u;
        for (int g = 0; g < 4; ++g)
            for (int e = 0; e < 4; ++e) {
                const int v0 = vals[4 * g + e], v1 = vals[16 + 4 * g + e];
                lo[4 * g + e] = (uint8_t)((v0 & 0xF) | ((v1 & 0xF) << 4));
                hi[e] |= (uint8_t)(((v0 >> 4) & 3) << (2 * g));
                hi[4 + e] |= (uint8_t)(((v1 >> 4) & 3) << (2 * g));
            }
        uint8_t* sc = dst + k / 2 + k / 4 + 2 * u;
        sc[0] = b[192 + 8 * n + 2 * t];
        sc[1] = b[192 + 8 * n + 2 * t + 1];
        if (j == 0) memcpy(dst + k / 2 + k / 4 + k / 16 + 2 * (u / 8), b + 208, 2);
    }
}

template <typename F>
static float time_us(F launch, int reps) {
    for (int i = 0; i < 10; ++i) launch();
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a));
    for (int i = 0; i < reps; ++i) launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGetLastError());
    return ms * 1e3f / reps;
}

static int split_of(int k) { int u = k / 32; return u >= 64 ? 4 : u >= 32 ? 2 : 1; }

typedef void (*Kern)(GemvArgs);
static Kern staged_k[8] = {gemv_staged_m1, gemv_staged_m2, gemv_staged_m3, gemv_staged_m4, gemv_staged_m5, gemv_staged_m6, gemv_staged_m7, gemv_staged_m8};
static Kern plain_k[8] = {gemv_m1, gemv_m2, gemv_m3, gemv_m4, gemv_m5, gemv_m6, gemv_m7, gemv_m8};
static Kern wide_k[8] = {gemv_wide_m1, gemv_wide_m2, gemv_wide_m3, gemv_wide_m4, gemv_wide_m5, gemv_wide_m6, gemv_wide_m7, gemv_wide_m8};

int main() {
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    struct Shape { int type; int n; int k; const char* name; };
    const Shape shapes[] = {{W_Q6_K, 248320, 1024, "Q6_K 248320x1024 (Qwen3.5 0.8B)"}, {W_Q8_0, 262144, 640, "Q8_0 262144x640 (Gemma 3 270M)"},
                            {W_Q6_K, 248320, 2048, "Q6_K 248320x2048 (Qwen3.5 2B)"}, {W_Q6_K, 248320, 4096, "Q6_K 248320x4096 (Qwen3.5 9B)"},
                            {W_Q6_K, 262144, 2560, "Q6_K 262144x2560 (Gemma 4 E4B)"}, {W_Q8_0, 262144, 1152, "Q8_0 262144x1152 (Gemma 3 1B)"}};
    int* dummy; CK(cudaMalloc(&dummy, 4));
    for (const Shape& sh : shapes) {
        const int n = sh.n, k = sh.k, U = k / 32;
        const size_t bb = sh.type == W_Q8_0 ? 34 : 210, bv = sh.type == W_Q8_0 ? 32 : 256;
        const size_t rb = k / bv * bb, wrb = wide_row_bytes(sh.type, k);
        // 4096 distinct rows, repeated.
        const int T = 4096;
        std::vector<uint8_t> tile(T * rb), wtile(T * wrb);
        for (auto& x : tile) x = (uint8_t)rnd();
        for (int r = 0; r < T; ++r)
            for (size_t b = 0; b < k / bv; ++b) {
                uint8_t* blk = tile.data() + r * rb + b * bb;
                const uint16_t d = f2h(0.001f + (rnd() % 1000) * 1e-5f);
                memcpy(sh.type == W_Q8_0 ? blk : blk + 208, &d, 2);
            }
        for (int r = 0; r < T; ++r) to_wide(sh.type, k, tile.data() + r * rb, wtile.data() + r * wrb);
        uint8_t *w, *ww;
        CK(cudaMalloc(&w, (size_t)n * rb)); CK(cudaMalloc(&ww, (size_t)n * wrb));
        for (int r0 = 0; r0 < n; r0 += T) {
            const int c = std::min(T, n - r0);
            CK(cudaMemcpy(w + (size_t)r0 * rb, tile.data(), c * rb, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(ww + (size_t)r0 * wrb, wtile.data(), c * wrb, cudaMemcpyHostToDevice));
        }
        const int MM = 8;
        std::vector<int8_t> qs(MM * k); std::vector<float> qd(MM * U); std::vector<int> qsum(MM * U);
        for (int m = 0; m < MM; ++m)
            for (int u = 0; u < U; ++u) {
                int s = 0;
                for (int i = 0; i < 32; ++i) { const int v = (int)(rnd() % 255) - 127; qs[m * k + 32 * u + i] = (int8_t)v; s += v; }
                qd[m * U + u] = 0.005f + (rnd() % 1000) * 1e-5f; qsum[m * U + u] = s;
            }
        int8_t* dqs; float* dqd; int* dqsum; float *o1, *o2;
        CK(cudaMalloc(&dqs, qs.size())); CK(cudaMalloc(&dqd, qd.size() * 4)); CK(cudaMalloc(&dqsum, qsum.size() * 4));
        CK(cudaMemcpy(dqs, qs.data(), qs.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dqd, qd.data(), qd.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dqsum, qsum.data(), qsum.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&o1, (size_t)MM * n * 4)); CK(cudaMalloc(&o2, (size_t)MM * n * 4));
        printf("%s: GGUF %.1f MB, wide %.1f MB\n", sh.name, n * rb / 1e6, n * wrb / 1e6);
        const float roof = time_us([&] { read_roof<<<prop.multiProcessorCount * 8, 512>>>(reinterpret_cast<const int4*>(ww), n * wrb / 16, dummy); }, 100);
        printf("  roof (read the wide bytes)   %7.1f us  %6.0f GB/s\n", roof, n * wrb / roof / 1e3);
        for (int M : {1, 2, 4, 8}) {
            GemvArgs a{}; a.nseg = 1; a.k = k; a.rows = M; a.qs = dqs; a.qd = dqd; a.qsum = dqsum;
            a.seg[0].w = w; a.seg[0].out = o1; a.seg[0].n = n; a.seg[0].type = sh.type; a.seg[0].out_stride = n;
            // The engine's choice today: staged (16 rows a block) where 16 rows fit 48 KiB and split is 1.
            const int split = split_of(k);
            float t_old; const char* old_name;
            if (split == 1 && 16 * rb <= 48 * 1024) {
                a.split = 1;
                t_old = time_us([&] { staged_k[M - 1]<<<(n + 15) / 16, 128, 16 * rb>>>(a); }, 100);
                old_name = "staged";
            } else {
                a.split = split;
                const int per = 4 / split * 2;
                t_old = time_us([&] { plain_k[M - 1]<<<(n + per - 1) / per, 128>>>(a); }, 100);
                old_name = "plain";
            }
            CK(cudaDeviceSynchronize());
            std::vector<float> ref((size_t)M * n);
            CK(cudaMemcpy(ref.data(), o1, ref.size() * 4, cudaMemcpyDeviceToHost));
            printf("  M=%d %-6s (GGUF)          %7.1f us  %6.0f GB/s\n", M, old_name, t_old, n * rb / t_old / 1e3);
            for (int L : {4, 8, 16, 32}) {
                if (L > U) continue;
                GemvArgs b = a; b.split = L; b.seg[0].w = ww; b.seg[0].out = o2;
                const int rows_per_block = WIDE_WARPS * (32 / L);
                CK(cudaMemset(o2, 0, (size_t)M * n * 4));
                const float t = time_us([&] { wide_k[M - 1]<<<(n + rows_per_block - 1) / rows_per_block, WIDE_WARPS * 32>>>(b); }, 100);
                std::vector<float> got((size_t)M * n);
                CK(cudaMemcpy(got.data(), o2, got.size() * 4, cudaMemcpyDeviceToHost));
                double worst = 0, scale = 0;
                for (size_t i = 0; i < got.size(); ++i) { worst = std::max(worst, (double)fabsf(got[i] - ref[i])); scale = std::max(scale, (double)fabsf(ref[i])); }
                printf("  M=%d wide L=%-2d                %7.1f us  %6.0f GB/s  x%.2f  max|diff|/max|ref| %.2e %s\n", M, L, t, n * wrb / t / 1e3, t_old / t, worst / scale,
                       worst / scale < 1e-5 ? "ok" : "MISMATCH");
            }
        }
        CK(cudaFree(w)); CK(cudaFree(ww)); CK(cudaFree(dqs)); CK(cudaFree(dqd)); CK(cudaFree(dqsum)); CK(cudaFree(o1)); CK(cudaFree(o2));
    }
    return 0;
}
