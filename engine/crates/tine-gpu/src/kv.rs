//! The types the engine's KV caches store keys and values in (llama.cpp's `-ctk/-ctv`), and
//! their rows on the CPU: what `qk_norm_rope_kv` writes and the attention kernels read.
//!
//! A layer's cache is `[n_kv][ctx][row]`. A row of `hd` values is `hd` f32, f16 or bf16 values,
//! or GGML's blocks of 32 values (`q8_0`: the f16 scale then 32 int8 codes; `q4_0`: the f16
//! scale then 16 bytes, byte `j` holding value `j` in its low nibble and `j + 16` in its high):
//! the bytes candle's CPU cache stores for the same type (candle-nn's `KvType`), so a row the
//! GPU quantized equals the CPU's quantization of the same values bit for bit, and a slot file
//! moves between the devices. [`KvStore::encode_row`] is candle's quantizer itself; the kernel
//! table checks the GPU's rows against it.
//!
//! The turbo types (`turbo4`, `turbo3`, `turbo2`: candle-nn's `attention::kv_turbo`) store a row
//! rotated by groups of 32 at 4, 3 or 2 bits a value; the attention reads them in their rotated
//! basis (the query rotated the same way, the weighted values rotated back), so a decoded row
//! ([`KvStore::decode_row`]: back in the plain basis) is what it attends to, to float rounding.

use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ8_0, GgmlType};
use candle_nn::attention::kv_turbo;
use half::{bf16, f16};

/// A stored type of a KV cache row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvStore {
    #[default]
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Turbo4,
    Turbo3,
    Turbo2,
}

/// Values per block of the quantized types.
pub const KV_BLOCK: usize = 32;

/// The longest row of a turbo type the engine stores (decode.cu's `TURBO_MAX_GROUPS` groups).
pub const TURBO_MAX_ROW: usize = 512;

/// The turbo types' tables as the kernels read them (decode.cu's `TURBO_TAB_*` offsets): the
/// group scales' steps and bounds, each width's levels (from `w * 128`), the rotation's signs
/// (-1 or 1), `1 / sqrt(32)` as the CPU computes it, and the scale search's reach.
pub fn turbo_tab() -> Vec<f32> {
    let mut t = Vec::with_capacity(TURBO_TAB_LEN);
    t.extend_from_slice(&kv_turbo::scale_steps()[..]);
    t.extend_from_slice(&kv_turbo::scale_bounds()[..]);
    for w in 0..8u32 {
        let lv = kv_turbo::levels(w);
        t.extend((0..128).map(|i| lv.get(i).copied().unwrap_or(0.0)));
    }
    t.extend((0..kv_turbo::GROUP).map(|i| if kv_turbo::sign_negative(i) { -1.0 } else { 1.0 }));
    t.push(1.0 / (kv_turbo::GROUP as f32).sqrt());
    t.push(kv_turbo::SCALE_SEARCH as f32);
    debug_assert_eq!(t.len(), TURBO_TAB_LEN);
    t
}

/// Floats of [`turbo_tab`].
pub const TURBO_TAB_LEN: usize = 32 + 32 + 8 * 128 + 32 + 2;

impl KvStore {
    pub const ALL: [KvStore; 8] = [KvStore::F32, KvStore::F16, KvStore::Bf16, KvStore::Q8_0, KvStore::Q4_0, KvStore::Turbo4, KvStore::Turbo3, KvStore::Turbo2];

    /// llama.cpp's name for the type.
    pub fn name(self) -> &'static str {
        match self {
            KvStore::F32 => "f32",
            KvStore::F16 => "f16",
            KvStore::Bf16 => "bf16",
            KvStore::Q8_0 => "q8_0",
            KvStore::Q4_0 => "q4_0",
            KvStore::Turbo4 => "turbo4",
            KvStore::Turbo3 => "turbo3",
            KvStore::Turbo2 => "turbo2",
        }
    }

    /// The type named `name` ([`KvStore::name`]).
    pub fn from_name(name: &str) -> Option<KvStore> {
        KvStore::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The number the kernels switch on (decode.cu's `KvT`).
    pub fn kernel_id(self) -> i32 {
        match self {
            KvStore::F32 => 0,
            KvStore::F16 => 1,
            KvStore::Bf16 => 2,
            KvStore::Q8_0 => 3,
            KvStore::Q4_0 => 4,
            KvStore::Turbo4 => 5,
            KvStore::Turbo3 => 6,
            KvStore::Turbo2 => 7,
        }
    }

    /// Bits a value of a turbo type (`None` for the others).
    pub fn turbo_bits(self) -> Option<u32> {
        match self {
            KvStore::Turbo4 => Some(4),
            KvStore::Turbo3 => Some(3),
            KvStore::Turbo2 => Some(2),
            _ => None,
        }
    }

    /// Whether rows of `hd` values can be stored (the engine's heads are multiples of 64; a
    /// turbo row has 128 to 512 values, the encoder's block of a thread a value).
    pub fn supports(self, hd: usize) -> bool {
        match self.turbo_bits() {
            Some(_) => kv_turbo::supports(hd) && hd <= TURBO_MAX_ROW,
            None => hd > 0 && hd.is_multiple_of(KV_BLOCK),
        }
    }

    /// Bytes of a row of `hd` values (decode.cu's `kv_row_bytes`).
    pub fn row_bytes(self, hd: usize) -> usize {
        match self {
            KvStore::F32 => hd * 4,
            KvStore::F16 | KvStore::Bf16 => hd * 2,
            KvStore::Q8_0 => hd / KV_BLOCK * (2 + KV_BLOCK),
            KvStore::Q4_0 => hd / KV_BLOCK * (2 + KV_BLOCK / 2),
            KvStore::Turbo4 | KvStore::Turbo3 | KvStore::Turbo2 => kv_turbo::row_bytes(self.turbo_bits().expect("a turbo type"), hd),
        }
    }

    /// A row of values in this type: little-endian floats, or candle's (GGML's) blocks.
    pub fn encode_row(self, x: &[f32]) -> Vec<u8> {
        match self {
            KvStore::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            KvStore::F16 => x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
            KvStore::Bf16 => x.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect(),
            KvStore::Q8_0 => {
                let mut blocks = vec![BlockQ8_0::zeros(); x.len() / KV_BLOCK];
                BlockQ8_0::from_float(&x[..blocks.len() * KV_BLOCK], &mut blocks);
                block_bytes(&blocks)
            }
            KvStore::Q4_0 => {
                let mut blocks = vec![BlockQ4_0::zeros(); x.len() / KV_BLOCK];
                BlockQ4_0::from_float(&x[..blocks.len() * KV_BLOCK], &mut blocks);
                block_bytes(&blocks)
            }
            KvStore::Turbo4 | KvStore::Turbo3 | KvStore::Turbo2 => {
                let bits = self.turbo_bits().expect("a turbo type");
                let mut out = vec![0u8; kv_turbo::row_bytes(bits, x.len())];
                kv_turbo::encode_row(bits, x, &mut out);
                out
            }
        }
    }

    /// A stored row back to its values, as the attention reads them (the codes times the f16
    /// scale in f32; `q4_0`'s codes less 8).
    pub fn decode_row(self, row: &[u8], out: &mut [f32]) {
        let half_at = |b: &[u8], i: usize| u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
        match self {
            KvStore::F32 => out.iter_mut().zip(row.chunks_exact(4)).for_each(|(o, c)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            KvStore::F16 => out.iter_mut().enumerate().for_each(|(i, o)| *o = f16::from_bits(half_at(row, i)).to_f32()),
            KvStore::Bf16 => out.iter_mut().enumerate().for_each(|(i, o)| *o = bf16::from_bits(half_at(row, i)).to_f32()),
            KvStore::Q8_0 => {
                for (b, o) in row.chunks_exact(2 + KV_BLOCK).zip(out.chunks_exact_mut(KV_BLOCK)) {
                    let d = f16::from_bits(half_at(b, 0)).to_f32();
                    o.iter_mut().zip(&b[2..]).for_each(|(o, &q)| *o = (q as i8) as f32 * d);
                }
            }
            KvStore::Q4_0 => {
                for (b, o) in row.chunks_exact(2 + KV_BLOCK / 2).zip(out.chunks_exact_mut(KV_BLOCK)) {
                    let d = f16::from_bits(half_at(b, 0)).to_f32();
                    let (lo, hi) = o.split_at_mut(KV_BLOCK / 2);
                    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..]) {
                        *l = ((q & 0x0F) as i32 - 8) as f32 * d;
                        *h = ((q >> 4) as i32 - 8) as f32 * d;
                    }
                }
            }
            KvStore::Turbo4 | KvStore::Turbo3 | KvStore::Turbo2 => kv_turbo::decode_row(row, out),
        }
    }
}

impl std::fmt::Display for KvStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The stored types of a cache's keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct KvTypes {
    pub k: KvStore,
    pub v: KvStore,
}

impl KvTypes {
    pub const F32: KvTypes = KvTypes { k: KvStore::F32, v: KvStore::F32 };

    /// Whether both are f32 (the attention's untyped kernels).
    pub fn is_f32(self) -> bool {
        self == KvTypes::F32
    }

    /// Bytes of a position's K row plus its V row, for one KV head of `hd` values.
    pub fn bytes_per_head(self, hd: usize) -> usize {
        self.k.row_bytes(hd) + self.v.row_bytes(hd)
    }
}

// candle's blocks are GGML's: `#[repr(C)]`, the f16 scale then the codes, no padding.
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 2 + KV_BLOCK && std::mem::size_of::<BlockQ4_0>() == 2 + KV_BLOCK / 2);

/// The bytes of quantized blocks as GGML lays them out (little-endian scales).
fn block_bytes<B: GgmlType>(blocks: &[B]) -> Vec<u8> {
    // SAFETY: the blocks are `#[repr(C)]` plain data without padding (sizes checked above).
    let bytes = unsafe { std::slice::from_raw_parts(blocks.as_ptr() as *const u8, std::mem::size_of_val(blocks)) };
    let mut out = bytes.to_vec();
    if cfg!(target_endian = "big") {
        let size = std::mem::size_of::<B>();
        out.chunks_exact_mut(size).for_each(|b| b.swap(0, 1));
    }
    out
}
