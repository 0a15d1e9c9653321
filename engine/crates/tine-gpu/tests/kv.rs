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
