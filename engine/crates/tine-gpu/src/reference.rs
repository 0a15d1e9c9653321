//! Float64 references of every kernel, and the GEMV's split of a row into lane work written out
//! on the CPU (so that its index arithmetic is tested where there is no GPU).
//!
//! The device check (`tine-gpu-check`) runs each kernel on random inputs and compares it with
//! these; CI tests these against candle's CPU code. Tolerances are stated where they are used:
//! a kernel computes in f32, so it is held to a bound proportional to the magnitude of what it
//! summed (`Σ|w·a|` for a dot product), not to a flat epsilon.

use crate::blocks::{ActQ8, WeightType, QK};

/// `out[m][r] = Σ_i W[r][i] · a[m][i]` in float64, with W dequantized by ggml's dequantizer and
/// `a` the values the Q8 activations stand for. Also returns `Σ_i |W[r][i] · a[m][i]|`, the scale
/// of the f32 rounding a kernel may add.
pub fn gemv(t: WeightType, w: &[u8], n: usize, k: usize, act: &ActQ8) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(w.len(), n * t.row_bytes(k), "weights of {n} rows of {k} {t:?}");
    let wf = t.dequantize(w);
    let a = act.dequantize();
    let mut out = vec![0f64; act.rows * n];
    let mut mag = vec![0f64; act.rows * n];
    for m in 0..act.rows {
        let am = &a[m * k..(m + 1) * k];
        for r in 0..n {
            let wr = &wf[r * k..(r + 1) * k];
            let (mut s, mut s_abs) = (0f64, 0f64);
            for (x, y) in wr.iter().zip(am) {
                s += *x as f64 * y;
                s_abs += (*x as f64 * y).abs();
            }
            out[m * n + r] = s;
            mag[m * n + r] = s_abs;
        }
    }
    (out, mag)
}

/// GELU with the tanh approximation (what Gemma's MLP uses, as llama.cpp computes it).
pub fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// The 8 weight values a GEMV lane takes from unit `u` (32 values) of a row at quarter `l4`
/// (values `8*l4..8*l4+8` of the unit), with the unit's factors: the lane adds
/// `d_a · (fw · Σ w·q_a + fmin · Σ_unit q_a)`. This is `load_unit` of kernels/decode.cu.
pub fn lane_unit(t: WeightType, row: &[u8], u: usize, l4: usize) -> ([i8; 8], f32, f32) {
    let h = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let mut w = [0i8; 8];
    match t {
        WeightType::Q8_0 => {
            let b = &row[u * 34..(u + 1) * 34];
            for (e, x) in w.iter_mut().enumerate() {
                *x = b[2 + 8 * l4 + e] as i8;
            }
            (w, h(b, 0), 0.0)
        }
        WeightType::Q5_0 => {
            let b = &row[u * 22..(u + 1) * 22];
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let (j0, hi) = (8 * (l4 & 1), l4 >> 1);
            for (e, x) in w.iter_mut().enumerate() {
                let byte = b[6 + j0 + e];
                let nib = (if hi == 1 { byte >> 4 } else { byte & 0xF }) as i32;
                let bit = ((qh >> (8 * l4 + e)) & 1) as i32;
                *x = ((nib | (bit << 4)) - 16) as i8;
            }
            (w, h(b, 0), 0.0)
        }
        WeightType::Q4K => {
            let b = &row[(u / 8) * 144..(u / 8 + 1) * 144];
            let j = u % 8;
            let (s, qs) = (&b[4..16], &b[16..144]);
            for (e, x) in w.iter_mut().enumerate() {
                let byte = qs[32 * (j / 2) + 8 * l4 + e];
                *x = (if j & 1 == 1 { byte >> 4 } else { byte & 0xF }) as i8;
            }
            let (sc, mn) = if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) };
            let fmin = if l4 == 0 { -h(b, 2) * mn as f32 } else { 0.0 };
            (w, h(b, 0) * sc as f32, fmin)
        }
        WeightType::Q5K => {
            let b = &row[(u / 8) * 176..(u / 8 + 1) * 176];
            let j = u % 8;
            let (s, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
            for (e, x) in w.iter_mut().enumerate() {
                let byte = qs[32 * (j / 2) + 8 * l4 + e];
                let nib = if j & 1 == 1 { byte >> 4 } else { byte & 0xF };
                *x = (nib | (((qh[8 * l4 + e] >> j) & 1) << 4)) as i8;
            }
            let (sc, mn) = if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) };
            let fmin = if l4 == 0 { -h(b, 2) * mn as f32 } else { 0.0 };
            (w, h(b, 0) * sc as f32, fmin)
        }
        WeightType::Q6K => {
            let b = &row[(u / 8) * 210..(u / 8 + 1) * 210];
            let j = u % 8;
            let (n, t4) = (j / 4, j % 4);
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let l = 8 * l4;
            for (e, x) in w.iter_mut().enumerate() {
                let lo = (ql[64 * n + (t4 & 1) * 32 + l + e] >> ((t4 >> 1) * 4)) & 0xF;
                let hi = (qh[32 * n + l + e] >> (2 * t4)) & 3;
                *x = ((lo | (hi << 4)) as i32 - 32) as i8;
            }
            (w, h(b, 208) * sc[8 * n + 2 * t4 + l / 16] as i8 as f32, 0.0)
        }
    }
}

/// Value `i` of a row of weight type `t` as the embedding gather computes it (`embd_value` of
/// kernels/decode.cu, its index arithmetic written out): one value at a time, not a block.
pub fn embd_value(t: WeightType, row: &[u8], i: usize) -> f32 {
    let h = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let scale_min = |s: &[u8], j: usize| if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) };
    match t {
        WeightType::Q8_0 => {
            let b = &row[(i / 32) * 34..];
            h(b, 0) * b[2 + i % 32] as i8 as f32
        }
        WeightType::Q5_0 => {
            let b = &row[(i / 32) * 22..];
            let l = i % 32;
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let nib = if l < 16 { b[6 + l] & 0xF } else { b[6 + l - 16] >> 4 } as i32;
            h(b, 0) * ((nib | (((qh >> l) & 1) << 4) as i32) - 16) as f32
        }
        WeightType::Q4K | WeightType::Q5K => {
            let five = t == WeightType::Q5K;
            let b = &row[(i / 256) * t.block_bytes()..];
            let (iw, qs0) = (i % 256, if five { 48 } else { 16 });
            let (j, l) = (iw / 32, iw % 32);
            let (sc, mn) = scale_min(&b[4..16], j);
            let byte = b[qs0 + 32 * (j / 2) + l];
            let mut q = if j & 1 == 1 { byte >> 4 } else { byte & 0xF } as i32;
            if five {
                q |= (((b[16 + l] >> j) & 1) as i32) << 4;
            }
            h(b, 0) * sc as f32 * q as f32 - h(b, 2) * mn as f32
        }
        WeightType::Q6K => {
            let b = &row[(i / 256) * 210..];
            let iw = i % 256;
            let (n, r) = (iw / 128, iw % 128);
            let (qd, l) = (r / 32, r % 32);
            let lo = (b[64 * n + l + (qd & 1) * 32] >> ((qd >> 1) * 4)) & 0xF;
            let hi = (b[128 + 32 * n + l] >> (2 * qd)) & 3;
            h(b, 208) * b[192 + 8 * n + l / 16 + 2 * qd] as i8 as f32 * ((lo | (hi << 4)) as i32 - 32) as f32
        }
    }
}

/// Unit `u` (values `32u..32u+32`) of a row in the wide layout ([`WeightType::to_wide`]) as
/// `gemv_wide` unpacks it: the 32 quants (after the type's offset), and the factors: value `i` is
/// `fw[i / 16] · q[i] + fmin` (`fw` per half-unit: Q6_K's two sub-block scales times `d`; the
/// other types' one factor twice). ggml's dequantizer computes the same products.
pub fn wide_unit(t: WeightType, row: &[u8], k: usize, u: usize) -> ([i8; 32], [f32; 2], f32) {
    let h = |at: usize| half::f16::from_le_bytes([row[at], row[at + 1]]).to_f32();
    let mut q = [0i8; 32];
    if t == WeightType::Q8_0 {
        for (i, x) in q.iter_mut().enumerate() {
            *x = row[32 * u + i] as i8;
        }
        let d = h(k + 2 * u);
        return (q, [d, d], 0.0);
    }
    for g in 0..4 {
        for e in 0..4 {
            let l = row[16 * u + 4 * g + e];
            for (top, nib) in [(0, l & 0xF), (1, l >> 4)] {
                let v = 16 * top + 4 * g + e;
                let hi = match t {
                    WeightType::Q6K => ((row[k / 2 + 8 * u + 4 * top + e] >> (2 * g)) & 3) << 4,
                    WeightType::Q5_0 | WeightType::Q5K => ((row[k / 2 + 4 * u + e] >> (4 * top + g)) & 1) << 4,
                    _ => 0,
                };
                let off = match t {
                    WeightType::Q6K => 32,
                    WeightType::Q5_0 => 16,
                    _ => 0,
                };
                q[v] = ((nib | hi) as i32 - off) as i8;
            }
        }
    }
    match t {
        WeightType::Q6K => {
            let d = h(k / 2 + k / 4 + k / 16 + 2 * (u / 8));
            let sc = &row[k / 2 + k / 4 + 2 * u..];
            (q, [d * sc[0] as i8 as f32, d * sc[1] as i8 as f32], 0.0)
        }
        WeightType::Q5_0 => {
            let d = h(k / 2 + k / 8 + 2 * u);
            (q, [d, d], 0.0)
        }
        _ => {
            let meta = (if t == WeightType::Q5K { k / 2 + k / 8 } else { k / 2 }) + 16 * (u / 8);
            let s = &row[meta + 4..meta + 16];
            let j = u % 8;
            let (sc, mn) = if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) };
            let fw = h(meta) * sc as f32;
            (q, [fw, fw], -(h(meta + 2) * mn as f32))
        }
    }
}

/// Value `i` of a row in the wide layout as the embedding gather computes it (`wide_value` of
/// kernels/decode.cu): ggml's dequantizer's products.
pub fn wide_value(t: WeightType, row: &[u8], k: usize, i: usize) -> f32 {
    let (q, fw, fmin) = wide_unit(t, row, k, i / QK);
    fw[(i % QK) / 16] * q[i % QK] as f32 + fmin
}

/// The GEMV as the kernel splits it (units of 32 values, four lanes of 8 per unit, the factors
/// of [`lane_unit`]), summed in float64. Equal to [`gemv`] up to the rounding of ggml's own
/// dequantizer, which is what the CI test checks.
pub fn gemv_lanes(t: WeightType, w: &[u8], n: usize, k: usize, act: &ActQ8) -> Vec<f64> {
    let rb = t.row_bytes(k);
    let mut out = vec![0f64; act.rows * n];
    for r in 0..n {
        let row = &w[r * rb..(r + 1) * rb];
        for u in 0..k / QK {
            for l4 in 0..4 {
                let (wq, fw, fmin) = lane_unit(t, row, u, l4);
                for m in 0..act.rows {
                    let a = &act.qs[m * k + 32 * u + 8 * l4..][..8];
                    let dot: i32 = wq.iter().zip(a).map(|(&x, &y)| x as i32 * y as i32).sum();
                    let (d, sum) = (act.d[m * k / QK + u] as f64, act.sum[m * k / QK + u] as f64);
                    out[m * n + r] += d * (fw as f64 * dot as f64 + fmin as f64 * sum);
                }
            }
        }
    }
    out
}

/// RMSNorm of one row in float64: `x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * *w as f64).collect()
}

/// RoPE, NeoX halves (pair `(i, i + hd/2)`), at position `pos` with the given inverse frequencies.
pub fn rope(x: &[f64], pos: usize, inv_freq: &[f32]) -> Vec<f64> {
    let half = x.len() / 2;
    let mut out = vec![0f64; x.len()];
    for i in 0..half {
        // The angle is the f32 product, as the kernel and candle's CPU path form it: at position
        // 31000 a float64 angle differs from it by up to 2e-3 rad, which no f32 kernel can match.
        let ang = (pos as f32 * inv_freq[i]) as f64;
        let (s, c) = ang.sin_cos();
        out[i] = x[i] * c - x[i + half] * s;
        out[i + half] = x[i + half] * c + x[i] * s;
    }
    out
}

/// The inverse frequencies of RoPE with base `theta` over `hd` dims, in f32 as the kernels read
/// them (`theta^(-2i/hd)`, computed in float64 and rounded once).
pub fn inv_freq(hd: usize, theta: f64) -> Vec<f32> {
    (0..hd / 2).map(|i| theta.powf(-2.0 * i as f64 / hd as f64) as f32).collect()
}

/// Causal attention of one query row at position `pos` over a cache of `[n_kv][ctx][hd]`,
/// grouped heads (`n_head / n_kv` queries per KV head), keys `max(0, pos - window + 1)..=pos`
/// (`window` 0: all). `q` is `[n_head][hd]`, already scaled. Returns `[n_head][hd]`.
#[allow(clippy::too_many_arguments)]
pub fn attention(q: &[f64], k_cache: &[f32], v_cache: &[f32], ctx: usize, n_head: usize, n_kv: usize, hd: usize, pos: usize, window: usize) -> Vec<f64> {
    let lo = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
    let n_rep = n_head / n_kv;
    let mut out = vec![0f64; n_head * hd];
    for h in 0..n_head {
        let g = h / n_rep;
        let qh = &q[h * hd..(h + 1) * hd];
        let scores: Vec<f64> = (lo..=pos).map(|j| (0..hd).map(|d| qh[d] * k_cache[(g * ctx + j) * hd + d] as f64).sum()).collect();
        let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
        let den: f64 = e.iter().sum();
        for d in 0..hd {
            out[h * hd + d] = (lo..=pos).zip(&e).map(|(j, p)| p * v_cache[(g * ctx + j) * hd + d] as f64).sum::<f64>() / den;
        }
    }
    out
}

/// SiLU in float64.
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// RoPE, NeoX halves over the first `n_rot` dims (pair `(i, i + n_rot/2)`; the rest unrotated),
/// at position `pos`; `inv_freq` holds `n_rot / 2` values.
pub fn rope_partial(x: &[f64], pos: usize, n_rot: usize, inv_freq: &[f32]) -> Vec<f64> {
    let mut out = x.to_vec();
    out[..n_rot].copy_from_slice(&rope(&x[..n_rot], pos, inv_freq));
    out
}

/// The shape of a gated delta-net layer as the kernels take it.
#[derive(Debug, Clone, Copy)]
pub struct GdnDims {
    /// Key heads.
    pub hk: usize,
    /// Value heads (a multiple of `hk`; head `h` reads key head `h % hk`).
    pub hv: usize,
    /// State size (d_k = d_v).
    pub d: usize,
    /// Conv taps.
    pub kernel: usize,
}

impl GdnDims {
    /// Channels of the fused QKV rows.
    pub fn channels(&self) -> usize {
        (2 * self.hk + self.hv) * self.d
    }
}

/// One sequence's delta-net layer state in float64: the conv window (`(kernel - 1) × channels`,
/// oldest row first) and the state `S[h][i][j]` (`hv × d × d`, key dim `i`, value dim `j`).
#[derive(Debug, Clone)]
pub struct GdnState {
    pub window: Vec<f64>,
    pub s: Vec<f64>,
}

/// One row of a gated delta-net layer in float64, from its projections: `qkv` (channels, before
/// the conv), `z` (`hv × d`), `beta` and `alpha` (`hv`): the conv over the window with SiLU, q and
/// k L2-normalised (`x / sqrt(Σx² + eps)`, q times `1/sqrt(d)`), `β = sigmoid(beta)`, the decay
/// `exp(a · softplus(alpha + dt_bias))`, the delta rule, then `RMSNorm(o) · norm · SiLU(z)` per
/// value head. Advances `st` and returns the `(o, y)` pair: the delta rule's output and the gated,
/// normalised one (`hv × d` each).
#[allow(clippy::too_many_arguments)]
pub fn gdn_row(dims: GdnDims, st: &mut GdnState, conv_w: &[f32], qkv: &[f64], z: &[f64], beta: &[f64], alpha: &[f64], dt_bias: &[f32], a: &[f32], norm: &[f32], eps: f64) -> (Vec<f64>, Vec<f64>) {
    let GdnDims { hk, hv, d, kernel } = dims;
    let c = dims.channels();
    // The conv: rows [window; qkv].
    let mut conv = vec![0f64; c];
    for ch in 0..c {
        let mut s = 0f64;
        for j in 0..kernel {
            let x = if j + 1 < kernel { st.window[j * c + ch] } else { qkv[ch] };
            s += conv_w[ch * kernel + j] as f64 * x;
        }
        conv[ch] = silu(s);
    }
    if kernel > 1 {
        st.window.drain(..c);
        st.window.extend_from_slice(qkv);
    }
    let l2 = |x: &[f64], f: f64| -> Vec<f64> {
        let ss: f64 = x.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss + eps).sqrt() * f;
        x.iter().map(|v| v * inv).collect()
    };
    let mut o = vec![0f64; hv * d];
    let mut y = vec![0f64; hv * d];
    for h in 0..hv {
        let kh = h % hk;
        let q = l2(&conv[kh * d..(kh + 1) * d], 1.0 / (d as f64).sqrt());
        let k = l2(&conv[(hk + kh) * d..(hk + kh + 1) * d], 1.0);
        let v = &conv[(2 * hk + h) * d..(2 * hk + h + 1) * d];
        let b = 1.0 / (1.0 + (-beta[h]).exp());
        let x = alpha[h] + dt_bias[h] as f64;
        let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
        let decay = (a[h] as f64 * sp).exp();
        let sh = &mut st.s[h * d * d..(h + 1) * d * d];
        sh.iter_mut().for_each(|x| *x *= decay);
        for j in 0..d {
            let kv: f64 = (0..d).map(|i| sh[i * d + j] * k[i]).sum();
            let u = b * (v[j] - kv);
            for i in 0..d {
                sh[i * d + j] += k[i] * u;
            }
        }
        for j in 0..d {
            o[h * d + j] = (0..d).map(|i| sh[i * d + j] * q[i]).sum();
        }
        let oh = &o[h * d..(h + 1) * d];
        let ms = oh.iter().map(|v| v * v).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for j in 0..d {
            y[h * d + j] = oh[j] * inv * norm[j] as f64 * silu(z[h * d + j]);
        }
    }
    (o, y)
}

/// The greedy choice: the largest value, the lowest index among equals (as the sampler does).
pub fn argmax(xs: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] || (xs[best].is_nan() && !x.is_nan()) {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_lowest_index_of_a_tie() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 4]), 0);
    }

    #[test]
    fn partial_rope_leaves_the_dims_past_n_rot_alone() {
        let x: Vec<f64> = (0..8).map(|i| i as f64 + 1.0).collect();
        let out = rope_partial(&x, 5, 4, &inv_freq(4, 10000.0));
        assert_eq!(&out[4..], &x[4..]);
        assert_eq!(&out[..4], &rope(&x[..4], 5, &inv_freq(4, 10000.0))[..]);
    }

    #[test]
    fn a_delta_net_row_with_unit_decay_and_beta_one_writes_v_along_k() {
        // With decay 1 (a = 0) and beta -> 1, one step from S = 0 stores S = k vᵀ: o = (q·k) v.
        let dims = GdnDims { hk: 1, hv: 1, d: 4, kernel: 2 };
        let mut st = GdnState { window: vec![0.0; dims.channels()], s: vec![0.0; 16] };
        // The conv: tap 1 (the current row) 1, tap 0 0, so conv = SiLU(qkv).
        let conv_w: Vec<f32> = (0..dims.channels()).flat_map(|_| [0.0, 1.0]).collect();
        let qkv = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0, -1.0, 0.5, 3.0];
        let (o, _) = gdn_row(dims, &mut st, &conv_w, &qkv, &[0.0; 4], &[40.0], &[0.0], &[0.0], &[0.0], &[1.0; 4], 0.0);
        let (qn, kn) = (silu(1.0) / silu(1.0), silu(1.0) / silu(1.0));
        for (j, v) in [2.0, -1.0, 0.5, 3.0].iter().enumerate() {
            let want = qn * kn * silu(*v) / 2.0;
            assert!((o[j] - want).abs() < 1e-12, "o[{j}] = {} vs {want}", o[j]);
        }
        assert_eq!(&st.window[..], &qkv[..]);
    }

    #[test]
    fn rope_at_position_zero_is_the_identity() {
        let x = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(rope(&x, 0, &inv_freq(4, 10000.0)), x.to_vec());
    }
}
