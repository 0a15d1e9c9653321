//! The engine's stored KV rows (`tine_gpu::kv`) are candle's CPU cache rows: the same bytes for
//! the same values (so a GPU row equals the CPU's quantization, and slot files move between the
//! devices), decoded to the same values the CPU's attention reads.

use candle_core::{Device, Tensor};
use candle_nn::attention::kv_type::KvType;
use tine_gpu::kv::{KvStore, KvTypes};

fn candle_type(t: KvStore) -> KvType {
    match t {
        KvStore::F32 => KvType::F32,
        KvStore::F16 => KvType::F16,
        KvStore::Bf16 => KvType::BF16,
        KvStore::Q8_0 => KvType::Q8_0,
        KvStore::Q4_0 => KvType::Q4_0,
        KvStore::Turbo4 => KvType::Turbo4,
        KvStore::Turbo3 => KvType::Turbo3,
        KvStore::Turbo2 => KvType::Turbo2,
    }
}

/// Rows of `hd` values: random magnitudes over a wide range, plus the cases quantizers trip on
/// (an all-zero block, ties of magnitude with opposite signs, a single spike, tiny values).
fn rows(hd: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let mut out: Vec<Vec<f32>> = (0..6i32).map(|r| (0..hd).map(|_| next() * 10f32.powi(r - 3)).collect()).collect();
    let mut special = vec![0f32; hd];
    for (i, x) in special.iter_mut().enumerate().skip(32) {
        *x = match i % 4 {
            0 => 1.5,
            1 => -1.5,
            2 => 0.5,
            _ => -0.25,
        };
    }
    if hd >= 96 {
        special[64] = 1e4;
        special[65] = -1e4;
    }
    out.push(special);
    out.push((0..hd).map(|i| if i % 2 == 0 { -3.0 } else { 3.0 }).collect());
    out.push((0..hd).map(|i| (i as f32 - hd as f32 / 2.0) * 1e-7).collect());
    out
}

#[test]
fn stored_rows_are_candles_cpu_cache_rows_bit_for_bit_for_every_type_and_head_size() {
    for t in KvStore::ALL {
        let c = candle_type(t);
        for hd in [64, 128, 256, 512] {
            // (The turbo types store rows of 128 values and more.)
            if !t.supports(hd) {
                assert!(t.turbo_bits().is_some() && hd < 128, "{t} hd={hd}");
                continue;
            }
            assert_eq!(t.row_bytes(hd), c.row_bytes(hd).expect("a row size"), "{t} hd={hd}");
            for (i, row) in rows(hd, hd as u64 * 7 + i_seed(t)).into_iter().enumerate() {
                let x = Tensor::from_vec(row.clone(), (1, 1, 1, hd), &Device::Cpu).expect("a tensor");
                let stored = c.encode(&x).expect("encoded");
                let want = c.stored_bytes(&stored).expect("stored bytes");
                let got = t.encode_row(&row);
                assert_eq!(got, want, "{t} hd={hd} row {i}");
                let want_values = c.decode(&stored, hd).expect("decoded").flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
                let mut values = vec![0f32; hd];
                t.decode_row(&got, &mut values);
                assert!(values.iter().zip(&want_values).all(|(a, b)| a.to_bits() == b.to_bits()), "{t} hd={hd} row {i}: decoded values differ");
            }
        }
    }
}

fn i_seed(t: KvStore) -> u64 {
    t.kernel_id() as u64 * 1000
}

#[test]
fn type_names_and_kernel_ids_round_trip_and_stay_distinct() {
    for t in KvStore::ALL {
        assert_eq!(KvStore::from_name(t.name()), Some(t));
        assert_eq!(t.name(), candle_type(t).name());
    }
    let mut ids: Vec<i32> = KvStore::ALL.iter().map(|t| t.kernel_id()).collect();
    ids.dedup();
    assert_eq!(ids, vec![0, 1, 2, 3, 4, 5, 6, 7], "decode.cu's KvT numbers");
    assert!(KvTypes::F32.is_f32() && !KvTypes { k: KvStore::F32, v: KvStore::Q8_0 }.is_f32());
    assert_eq!(KvTypes { k: KvStore::Q8_0, v: KvStore::Q4_0 }.bytes_per_head(256), 272 + 144);
}

/// The turbo tables the kernels read (decode.cu's `TURBO_TAB_*` offsets) hold kv_turbo's own
/// values where the kernels look for them.
#[test]
fn turbo_tables_sit_at_the_kernels_offsets() {
    use candle_nn::attention::kv_turbo;
    let t = tine_gpu::kv::turbo_tab();
    assert_eq!(t.len(), tine_gpu::kv::TURBO_TAB_LEN);
    assert_eq!(&t[0..32], &kv_turbo::scale_steps()[..]);
    assert_eq!(&t[32..64], &kv_turbo::scale_bounds()[..]);
    for w in 0..8u32 {
        let lv = kv_turbo::levels(w);
        assert_eq!(&t[64 + w as usize * 128..][..lv.len()], &lv[..], "width {w}");
    }
    for i in 0..32 {
        assert_eq!(t[1088 + i] < 0.0, kv_turbo::sign_negative(i), "sign {i}");
    }
    assert_eq!(t[1120], 1.0 / 32f32.sqrt());
    assert_eq!(t[1121] as usize, kv_turbo::SCALE_SEARCH);
}

/// A host model of the attention's turbo arithmetic in the kernel's lane layout (decode.cu's
/// `turbo_rotate_lanes`, `kv_load`'s turbo case, `turbo_unrotate_warp`: lane `l` of a warp holds
/// dims `l*E .. l*E + E - 1` of a head of `32*E`), step for step, against kv_turbo's own
/// `rotate`, `dequantize_row` and `unrotate`, bit for bit: the pairing of dims across lanes and
/// the bit stream's offsets, which no CPU test of the kernels' callers would catch.
#[test]
fn the_kernels_lane_layout_rotates_and_reads_turbo_rows_as_kv_turbo_does() {
    use candle_nn::attention::kv_turbo;
    let tab = tine_gpu::kv::turbo_tab();
    let (signs, f) = (&tab[1088..1120], tab[1120]);
    for e_per in [4usize, 8, 16] {
        let hd = 32 * e_per;
        for (i, row) in rows(hd, 77 + e_per as u64).into_iter().enumerate() {
            // turbo_rotate_lanes: signs, butterflies (in a lane's registers below span E, across
            // lanes l ^ (h / E) from it), 1/sqrt(32).
            let mut v: Vec<Vec<f32>> = (0..32).map(|l| (0..e_per).map(|e| row[l * e_per + e] * signs[(l * e_per + e) % 32]).collect()).collect();
            let mut h = 1;
            while h < 32 {
                if h < e_per {
                    for lane in v.iter_mut() {
                        for e in 0..e_per {
                            if e & h == 0 {
                                let (a, b) = (lane[e], lane[e + h]);
                                lane[e] = a + b;
                                lane[e + h] = a - b;
                            }
                        }
                    }
                } else {
                    let ls = h / e_per;
                    let old = v.clone();
                    for (l, lane) in v.iter_mut().enumerate() {
                        for (e, x) in lane.iter_mut().enumerate() {
                            let o = old[l ^ ls][e];
                            *x = if l & ls != 0 { o - *x } else { *x + o };
                        }
                    }
                }
                h *= 2;
            }
            let got: Vec<f32> = v.iter().flat_map(|lane| lane.iter().map(|x| x * f)).collect();
            let mut want = row.clone();
            want.chunks_exact_mut(kv_turbo::GROUP).for_each(kv_turbo::rotate);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "E={e_per} row {i}: the lanes' rotation");
            // kv_load's turbo case: each lane's E values of the stored row, rotated basis.
            for bits in [4u32, 3, 2] {
                let mut stored = vec![0u8; kv_turbo::row_bytes(bits, hd)];
                kv_turbo::encode_row(bits, &row, &mut stored);
                let mut want = vec![0f32; hd];
                kv_turbo::dequantize_row(&stored, &mut want);
                let s = half::f16::from_le_bytes([stored[0], stored[1]]).to_f32();
                for l in 0..32 {
                    let (d0, g) = (l * e_per, l * e_per / 32);
                    let (gb, j0) = (stored[2 + g] as usize, d0 % 32);
                    let w = gb >> 5;
                    let off = 2 + e_per + (0..g).map(|i| 4 * (stored[2 + i] as usize >> 5)).sum::<usize>();
                    for e in 0..e_per {
                        let got = if w == 0 {
                            0.0
                        } else {
                            let (bit, mask) = ((j0 + e) * w, (1usize << w) - 1);
                            let (by, sh) = (bit >> 3, bit & 7);
                            let mut x = stored[off + by] as usize;
                            if sh + w > 8 {
                                x |= (stored[off + by + 1] as usize) << 8;
                            }
                            (s * tab[gb & 31]) * tab[64 + w * 128 + ((x >> sh) & mask)]
                        };
                        assert_eq!(got.to_bits(), want[d0 + e].to_bits(), "E={e_per} row {i} turbo{bits}: lane {l} dim {e}");
                    }
                }
            }
            // turbo_unrotate_warp: a warp holds one group, a dim a lane.
            for grp in want.chunks_exact(32) {
                let mut v = grp.to_vec();
                let mut h = 1;
                while h < 32 {
                    let old = v.clone();
                    for (l, x) in v.iter_mut().enumerate() {
                        let o = old[l ^ h];
                        *x = if l & h != 0 { o - *x } else { *x + o };
                    }
                    h *= 2;
                }
                let got: Vec<f32> = v.iter().enumerate().map(|(l, x)| x * f * signs[l]).collect();
                let mut back = grp.to_vec();
                kv_turbo::unrotate(&mut back);
                assert!(got.iter().zip(&back).all(|(a, b)| a.to_bits() == b.to_bits()), "E={e_per} row {i}: the warp's inverse rotation");
            }
        }
    }
}
