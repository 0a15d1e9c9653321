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
    fn rope_at_position_zero_is_the_identity() {
        let x = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(rope(&x, 0, &inv_freq(4, 10000.0)), x.to_vec());
    }
}
