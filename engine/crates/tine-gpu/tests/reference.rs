//! The kernels' CPU side, where there is no GPU: the GEMV's split of a row into lane work
//! (`reference::lane_unit`, the index arithmetic of decode.cu's `load_unit` written out) against
//! ggml's own dequantizer, for every weight type over a table of shapes.

use tine_gpu::blocks::{ActQ8, WeightType};
use tine_gpu::reference;

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
        })
        .collect()
}

#[test]
fn gemv_lane_split_equals_ggmls_dequantized_weights_for_every_type_and_shape() {
    for t in WeightType::ALL {
        let bv = t.block_values();
        for (case, (n, k, rows)) in [(5, bv, 1), (3, 2 * bv, 3), (4, 4 * bv.max(160), 8), (1, 20 * bv, 2)].into_iter().enumerate() {
            let k = k / bv * bv;
            let w = t.quantize(&values(n * k, 1 + case as u64, 0.7));
            let act = ActQ8::quantize(&values(rows * k, 100 + case as u64, 2.0), rows, k);
            let (want, mag) = reference::gemv(t, &w, n, k, &act);
            let got = reference::gemv_lanes(t, &w, n, k, &act);
            for i in 0..rows * n {
                // ggml's dequantizer rounds each weight to f32 (d·sc·q − dmin·m), the lane split
                // keeps the factors apart: they agree to f32 rounding of the weights.
                let tol = 1e-6 * mag[i] + 1e-9;
                assert!((got[i] - want[i]).abs() <= tol, "{t:?} n={n} k={k} rows={rows} [{i}]: lanes {} vs dequantized {} (tol {tol:e})", got[i], want[i]);
            }
        }
    }
}

#[test]
fn gemv_lane_split_covers_each_value_of_a_unit_once() {
    // A one-hot activation picks out one weight: each lane quarter must own exactly the 8 values
    // it claims, for every position of the unit and every type.
    for t in WeightType::ALL {
        let k = t.block_values();
        let w = t.quantize(&values(k, 9, 1.0));
        let wf = t.dequantize(&w);
        for j in 0..k {
            let mut y = vec![0f32; k];
            y[j] = 1.0;
            let act = ActQ8::quantize(&y, 1, k);
            let got = reference::gemv_lanes(t, &w, 1, k, &act)[0];
            assert!((got - wf[j] as f64).abs() <= 1e-6 * wf[j].abs() as f64 + 1e-7, "{t:?} value {j}: lanes {got} vs weight {}", wf[j]);
        }
    }
}

#[test]
fn activation_quantization_error_is_at_most_half_a_step() {
    let ys = values(4 * 640, 5, 3.0);
    let act = ActQ8::quantize(&ys, 4, 640);
    for (i, (y, q)) in ys.iter().zip(act.dequantize()).enumerate() {
        let step = act.d[i / 32] as f64;
        assert!((*y as f64 - q).abs() <= 0.5 * step * (1.0 + 1e-6), "value {i}: {y} -> {q} (step {step})");
    }
    assert!(act.sum.iter().enumerate().all(|(b, s)| *s == act.qs[b * 32..(b + 1) * 32].iter().map(|&q| q as i32).sum::<i32>()));
}

#[test]
fn attention_reference_is_a_softmax_weighted_average_of_the_visible_values() {
    // One head, keys all equal: the weights are uniform over the window, whatever q is.
    let (ctx, hd) = (10, 4);
    let k = vec![0.5f32; ctx * hd];
    let v: Vec<f32> = (0..ctx * hd).map(|i| (i / hd) as f32).collect();
    let q = vec![1.0f64; hd];
    let out = reference::attention(&q, &k, &v, ctx, 1, 1, hd, 7, 3);
    assert!(out.iter().all(|&x| (x - 6.0).abs() < 1e-12), "{out:?}"); // mean of positions 5, 6, 7
    let out = reference::attention(&q, &k, &v, ctx, 1, 1, hd, 7, 0);
    assert!(out.iter().all(|&x| (x - 3.5).abs() < 1e-12), "{out:?}"); // mean of 0..=7
}
