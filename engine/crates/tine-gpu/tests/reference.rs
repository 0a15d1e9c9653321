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

#[test]
fn delta_net_reference_agrees_with_the_cpu_paths_gated_delta_net_over_a_sequence_of_rows() {
    use candle_core::{Device, Tensor};
    use candle_nn::gated_delta_net::{gated_delta_net, GdnParams, GdnShape};
    for (case, dims) in [reference::GdnDims { hk: 2, hv: 4, d: 16, kernel: 4 }, reference::GdnDims { hk: 1, hv: 3, d: 32, kernel: 3 }].into_iter().enumerate() {
        let (c, hv, d, t) = (dims.channels(), dims.hv, dims.d, 6);
        let seed = 200 + 10 * case as u64;
        let x = values(t * c, seed, 1.0);
        let z = values(t * hv * d, seed + 1, 2.0);
        let beta = values(t * hv, seed + 2, 2.0);
        let alpha = values(t * hv, seed + 3, 2.0);
        let conv = values(c * dims.kernel, seed + 4, 0.7);
        let dt_bias = values(hv, seed + 5, 1.0);
        let a: Vec<f32> = values(hv, seed + 6, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
        let norm: Vec<f32> = values(d, seed + 7, 0.5).iter().map(|v| 1.0 + v).collect();
        let eps = 1e-6;
        let cpu = Device::Cpu;
        let tensor = |v: &[f32], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape, &cpu).expect("tensor");
        let params = GdnParams { conv: conv.clone(), kernel: dims.kernel, dt_bias: dt_bias.clone(), a: a.clone(), norm: norm.clone() };
        let shape = GdnShape { n_k_heads: dims.hk, n_v_heads: hv, d_state: d, eps };
        let out = gated_delta_net(
            &tensor(&x, &[t, c]),
            &tensor(&z, &[t, hv * d]),
            &tensor(&beta, &[t, hv]),
            &tensor(&alpha, &[t, hv]),
            &Tensor::zeros((dims.kernel - 1, c), candle_core::DType::F32, &cpu).expect("window"),
            &Tensor::zeros((hv, d, d), candle_core::DType::F32, &cpu).expect("state"),
            &params,
            shape,
            false,
        )
        .expect("the CPU path's gated delta-net");
        let y = out.y.flatten_all().and_then(|v| v.to_vec1::<f32>()).expect("y");
        let state = out.state.flatten_all().and_then(|v| v.to_vec1::<f32>()).expect("state");
        let mut st = reference::GdnState { window: vec![0.0; (dims.kernel - 1) * c], s: vec![0.0; hv * d * d] };
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let mut want_y = Vec::new();
        for r in 0..t {
            let (_, yr) = reference::gdn_row(
                dims,
                &mut st,
                &conv,
                &f(&x[r * c..(r + 1) * c]),
                &f(&z[r * hv * d..(r + 1) * hv * d]),
                &f(&beta[r * hv..(r + 1) * hv]),
                &f(&alpha[r * hv..(r + 1) * hv]),
                &dt_bias,
                &a,
                &norm,
                eps,
            );
            want_y.extend(yr);
        }
        // f32 against float64 over 6 rows of a recurrence: within 1e-4 of the largest value.
        let ymax = want_y.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in y.iter().zip(&want_y).enumerate() {
            assert!((*g as f64 - w).abs() <= 1e-4 * ymax, "case {case} y[{i}]: CPU {g} vs float64 {w}");
        }
        let smax = st.s.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in state.iter().zip(&st.s).enumerate() {
            assert!((*g as f64 - w).abs() <= 1e-4 * smax, "case {case} state[{i}]: CPU {g} vs float64 {w}");
        }
        let window = out.window.flatten_all().and_then(|v| v.to_vec1::<f32>()).expect("window");
        assert_eq!(window.iter().map(|&v| v as f64).collect::<Vec<_>>(), st.window, "case {case}: the conv window after the rows");
    }
}

#[test]
fn embedding_gather_of_one_value_equals_ggmls_dequantized_row_for_every_type() {
    for t in WeightType::ALL {
        let k = 2 * t.block_values().max(64);
        let rows = 3;
        let w = t.quantize(&values(rows * k, 41, 1.3));
        let want = t.dequantize(&w);
        let rb = t.row_bytes(k);
        for r in 0..rows {
            for i in 0..k {
                let got = reference::embd_value(t, &w[r * rb..(r + 1) * rb], i);
                let x = want[r * k + i];
                assert!((got - x).abs() <= 1e-6 * x.abs().max(1.0), "{t:?} row {r} value {i}: gather {got} vs ggml {x}");
            }
        }
    }
}

#[test]
fn wide_layout_holds_ggmls_values_for_every_type_row_and_unit() {
    for t in WeightType::ALL {
        for k in [256usize, 512, 1024, 2560, 640, 96] {
            if !k.is_multiple_of(t.block_values()) {
                continue;
            }
            let rows = 3;
            let w = t.quantize(&values(rows * k, 43 + k as u64, 1.7));
            let want = t.dequantize(&w);
            let wide = t.to_wide(&w, k);
            let wb = t.wide_row_bytes(k);
            assert_eq!(wb % 16, 0, "{t:?} k={k}: rows of {wb} bytes are not 16-byte aligned");
            assert!(wb >= t.row_bytes(k) && wb < t.row_bytes(k) + 16, "{t:?} k={k}: {wb} bytes a row for {} of GGUF blocks", t.row_bytes(k));
            assert_eq!(wide.len(), rows * wb);
            for r in 0..rows {
                for i in 0..k {
                    let got = reference::wide_value(t, &wide[r * wb..(r + 1) * wb], k, i);
                    let x = want[r * k + i];
                    assert!((got - x).abs() <= 1e-6 * x.abs().max(1.0), "{t:?} k={k} row {r} value {i}: wide {got} vs ggml {x}");
                }
            }
        }
    }
}

#[test]
fn wide_units_give_the_lane_split_s_quants_and_factors() {
    // What the prompt GEMM's loader takes from a wide row (load_unit_wide) is what load_unit takes
    // from the GGUF block: the same quants and factors for every quarter of every unit.
    for t in WeightType::ALL {
        let k = 512;
        let w = t.quantize(&values(2 * k, 7, 1.1));
        let wide = t.to_wide(&w, k);
        let (rb, wb) = (t.row_bytes(k), t.wide_row_bytes(k));
        for r in 0..2 {
            for u in 0..k / 32 {
                let (q, fw, fmin) = reference::wide_unit(t, &wide[r * wb..(r + 1) * wb], k, u);
                for l4 in 0..4 {
                    let (lq, lfw, lfmin) = reference::lane_unit(t, &w[r * rb..(r + 1) * rb], u, l4);
                    assert_eq!(&q[8 * l4..8 * l4 + 8], &lq, "{t:?} row {r} unit {u} quarter {l4}: quants");
                    assert_eq!(fw[l4 / 2].to_bits(), lfw.to_bits(), "{t:?} row {r} unit {u} quarter {l4}: factor");
                    let want_min = if l4 == 0 { lfmin } else { fmin };
                    assert_eq!(fmin.to_bits(), want_min.to_bits(), "{t:?} row {r} unit {u}: min");
                }
            }
        }
    }
}
