//! The data the kernels read: GGUF weight blocks (as ggml writes them) and the engine's own
//! quantized activations (Q8 blocks of 32 values in three planes).
//!
//! The activation quantizer here is the kernel's, bit for bit: the same f32 operations in the
//! same order (`amax / 127`, `round_ties_even(y / d)`), so a test can quantize on the CPU what a
//! kernel quantized on the GPU and demand equality.

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ5K, BlockQ5_0, BlockQ6K, BlockQ8_0, GgmlType};

/// Values per activation block (and per GEMV unit).
pub const QK: usize = 32;

/// The weight types the kernels read, with ggml's type numbers (what the kernels switch on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightType {
    Q5_0,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl WeightType {
    pub const ALL: [WeightType; 5] = [WeightType::Q5_0, WeightType::Q8_0, WeightType::Q4K, WeightType::Q5K, WeightType::Q6K];

    /// ggml's number for the type (`GGML_TYPE_*`), which the kernels take.
    pub fn ggml_id(self) -> i32 {
        match self {
            WeightType::Q5_0 => 6,
            WeightType::Q8_0 => 8,
            WeightType::Q4K => 12,
            WeightType::Q5K => 13,
            WeightType::Q6K => 14,
        }
    }

    /// The type of ggml's number for it ([`WeightType::ggml_id`]), where the kernels read it.
    pub fn from_ggml_id(id: i32) -> Option<WeightType> {
        WeightType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// The type of a candle GGML dtype, where the kernels read it.
    pub fn from_ggml(dtype: candle_core::quantized::GgmlDType) -> Option<WeightType> {
        use candle_core::quantized::GgmlDType as D;
        match dtype {
            D::Q5_0 => Some(WeightType::Q5_0),
            D::Q8_0 => Some(WeightType::Q8_0),
            D::Q4K => Some(WeightType::Q4K),
            D::Q5K => Some(WeightType::Q5K),
            D::Q6K => Some(WeightType::Q6K),
            _ => None,
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            WeightType::Q5_0 | WeightType::Q8_0 => 32,
            WeightType::Q4K | WeightType::Q5K | WeightType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightType::Q5_0 => 22,
            WeightType::Q8_0 => 34,
            WeightType::Q4K => 144,
            WeightType::Q5K => 176,
            WeightType::Q6K => 210,
        }
    }

    /// Bytes of one row of `k` values.
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_values() * self.block_bytes()
    }

    /// Quantizes `xs` (a whole number of blocks) with ggml's quantizer (candle's port of it).
    pub fn quantize(self, xs: &[f32]) -> Vec<u8> {
        fn go<B: GgmlType>(xs: &[f32]) -> Vec<u8> {
            let mut blocks = vec![B::zeros(); xs.len() / B::BLCK_SIZE];
            B::from_float(xs, &mut blocks);
            let n = std::mem::size_of_val(blocks.as_slice());
            // SAFETY: the blocks are plain repr(C) data with no padding (their sizes are ggml's).
            unsafe { std::slice::from_raw_parts(blocks.as_ptr() as *const u8, n) }.to_vec()
        }
        assert_eq!(xs.len() % self.block_values(), 0, "{} values are not whole {:?} blocks", xs.len(), self);
        match self {
            WeightType::Q5_0 => go::<BlockQ5_0>(xs),
            WeightType::Q8_0 => go::<BlockQ8_0>(xs),
            WeightType::Q4K => go::<BlockQ4K>(xs),
            WeightType::Q5K => go::<BlockQ5K>(xs),
            WeightType::Q6K => go::<BlockQ6K>(xs),
        }
    }

    /// Dequantizes whole blocks with ggml's dequantizer (candle's port of it).
    pub fn dequantize(self, bytes: &[u8]) -> Vec<f32> {
        fn go<B: GgmlType>(bytes: &[u8]) -> Vec<f32> {
            let size = std::mem::size_of::<B>();
            let mut blocks = vec![B::zeros(); bytes.len() / size];
            // SAFETY: `blocks` holds exactly bytes.len() bytes of plain repr(C) data, any bit
            // pattern of which is a valid block (integers and f16s); copying also aligns them.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), blocks.as_mut_ptr() as *mut u8, blocks.len() * size) };
            let mut ys = vec![0f32; blocks.len() * B::BLCK_SIZE];
            B::to_float(&blocks, &mut ys);
            ys
        }
        assert_eq!(bytes.len() % self.block_bytes(), 0, "{} bytes are not whole {:?} blocks", bytes.len(), self);
        match self {
            WeightType::Q5_0 => go::<BlockQ5_0>(bytes),
            WeightType::Q8_0 => go::<BlockQ8_0>(bytes),
            WeightType::Q4K => go::<BlockQ4K>(bytes),
            WeightType::Q5K => go::<BlockQ5K>(bytes),
            WeightType::Q6K => go::<BlockQ6K>(bytes),
        }
    }
}

/// How a matrix's rows lie in device memory: GGUF blocks as the file has them, or the wide layout
/// ([`WeightType::to_wide`]) the engine's GEMVs read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Gguf,
    Wide,
}

/// The `embd_type` bit that says an embedding table is in the wide layout ([`WeightType::to_wide`]).
pub const EMBD_WIDE: i32 = 0x100;

impl WeightType {
    /// Bytes of one row of `k` values in the wide layout: the GGUF blocks' bytes, padded to a
    /// multiple of 16.
    pub fn wide_row_bytes(self, k: usize) -> usize {
        self.row_bytes(k).div_ceil(16) * 16
    }

    /// Rows of `k` values in GGUF blocks to the wide layout (kernels/decode.cu, `gemv_wide`): the
    /// same values and scales, moved so that each 32-value unit's quants are 16-byte aligned and
    /// unpack with shifts and masks, its scales in planes after them. A row (`U = k/32` units,
    /// `SB = k/256` super-blocks), padded to 16 bytes:
    ///
    /// * Q8_0: `[qs: 32 a unit][d: a half a unit]`
    /// * Q5_0: `[lo: 16 a unit][qh: 4 a unit][d: a half a unit]`
    /// * Q4_K: `[lo: 16 a unit][meta: 16 a super-block: d, dmin and the 12 scale bytes]`
    /// * Q5_K: `[lo: 16 a unit][qh: 4 a unit][meta: 16 a super-block]`
    /// * Q6_K: `[lo: 16 a unit][hi: 8 a unit][sc: 2 a unit][d: a half a super-block]`
    ///
    /// In a unit (values `0..32`): byte `4g + e` of lo holds value `4g + e`'s low four bits in
    /// its low nibble and value `16 + 4g + e`'s in its high one; bit `4t + g` of qh's byte `e` is
    /// value `16t + 4g + e`'s fifth bit; bits `2g, 2g + 1` of hi's byte `4t + e` are value
    /// `16t + 4g + e`'s top two; sc's two bytes are the scales of values `0..16` and `16..32`.
    pub fn to_wide(self, bytes: &[u8], k: usize) -> Vec<u8> {
        let (rb, wb) = (self.row_bytes(k), self.wide_row_bytes(k));
        assert!(k.is_multiple_of(self.block_values()) && bytes.len().is_multiple_of(rb), "{} bytes are not whole rows of {k} {self:?}", bytes.len());
        let units = k / QK;
        let mut out = vec![0u8; bytes.len() / rb * wb];
        for (src, dst) in bytes.chunks_exact(rb).zip(out.chunks_exact_mut(wb)) {
            if self == WeightType::Q8_0 {
                for (u, b) in src.chunks_exact(34).enumerate() {
                    dst[32 * u..32 * u + 32].copy_from_slice(&b[2..34]);
                    dst[k + 2 * u..k + 2 * u + 2].copy_from_slice(&b[0..2]);
                }
                continue;
            }
            for u in 0..units {
                let v = self.unit_quants(src, u);
                for g in 0..4 {
                    for e in 0..4 {
                        let (v0, v1) = (v[4 * g + e], v[16 + 4 * g + e]);
                        dst[16 * u + 4 * g + e] = (v0 & 0xF) | ((v1 & 0xF) << 4);
                        match self {
                            WeightType::Q6K => {
                                dst[k / 2 + 8 * u + e] |= (v0 >> 4) << (2 * g);
                                dst[k / 2 + 8 * u + 4 + e] |= (v1 >> 4) << (2 * g);
                            }
                            WeightType::Q5_0 | WeightType::Q5K => dst[k / 2 + 4 * u + e] |= ((v0 >> 4) << g) | ((v1 >> 4) << (4 + g)),
                            _ => {}
                        }
                    }
                }
                match self {
                    WeightType::Q5_0 => dst[k / 2 + k / 8 + 2 * u..][..2].copy_from_slice(&src[22 * u..22 * u + 2]),
                    WeightType::Q6K => {
                        let b = &src[210 * (u / 8)..];
                        let (n, t) = ((u % 8) / 4, u % 4);
                        dst[k / 2 + k / 4 + 2 * u] = b[192 + 8 * n + 2 * t];
                        dst[k / 2 + k / 4 + 2 * u + 1] = b[192 + 8 * n + 2 * t + 1];
                        if u % 8 == 0 {
                            dst[k / 2 + k / 4 + k / 16 + 2 * (u / 8)..][..2].copy_from_slice(&b[208..210]);
                        }
                    }
                    _ => {}
                }
            }
            if matches!(self, WeightType::Q4K | WeightType::Q5K) {
                let (bb, meta) = (self.block_bytes(), if self == WeightType::Q5K { k / 2 + k / 8 } else { k / 2 });
                for (sb, b) in src.chunks_exact(bb).enumerate() {
                    dst[meta + 16 * sb..meta + 16 * sb + 16].copy_from_slice(&b[0..16]);
                }
            }
        }
        out
    }

    /// The 32 unsigned quants of unit `u` of a GGUF row (Q5_0: 0..32, Q4_K: 0..16, Q5_K: 0..32,
    /// Q6_K: 0..64), before any offset.
    fn unit_quants(self, row: &[u8], u: usize) -> [u8; 32] {
        let mut v = [0u8; 32];
        match self {
            WeightType::Q5_0 => {
                let b = &row[22 * u..22 * u + 22];
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (l, x) in v.iter_mut().enumerate() {
                    let nib = if l < 16 { b[6 + l] & 0xF } else { b[6 + l - 16] >> 4 };
                    *x = nib | ((((qh >> l) & 1) as u8) << 4);
                }
            }
            WeightType::Q4K | WeightType::Q5K => {
                let five = self == WeightType::Q5K;
                let b = &row[self.block_bytes() * (u / 8)..];
                let j = u % 8;
                let qs0 = if five { 48 } else { 16 };
                for (l, x) in v.iter_mut().enumerate() {
                    let byte = b[qs0 + 32 * (j / 2) + l];
                    *x = if j & 1 == 1 { byte >> 4 } else { byte & 0xF };
                    if five {
                        *x |= ((b[16 + l] >> j) & 1) << 4;
                    }
                }
            }
            WeightType::Q6K => {
                let b = &row[210 * (u / 8)..];
                let (n, t) = ((u % 8) / 4, u % 4);
                for (l, x) in v.iter_mut().enumerate() {
                    let lo = (b[64 * n + (t & 1) * 32 + l] >> ((t >> 1) * 4)) & 0xF;
                    let hi = (b[128 + 32 * n + l] >> (2 * t)) & 3;
                    *x = lo | (hi << 4);
                }
            }
            WeightType::Q8_0 => unreachable!("Q8_0 quants are moved whole"),
        }
        v
    }
}

/// Quantized activations: `rows` rows of `k` values as Q8 blocks of 32, in three planes.
#[derive(Debug, Clone, PartialEq)]
pub struct ActQ8 {
    pub k: usize,
    pub rows: usize,
    /// `rows * k` quants.
    pub qs: Vec<i8>,
    /// `rows * k / 32` scales.
    pub d: Vec<f32>,
    /// `rows * k / 32` sums of each block's quants.
    pub sum: Vec<i32>,
}

impl ActQ8 {
    /// Quantizes `rows` rows of `k` values exactly as the kernels do.
    pub fn quantize(ys: &[f32], rows: usize, k: usize) -> ActQ8 {
        assert_eq!(k % QK, 0, "k = {k} is not a multiple of {QK}");
        assert_eq!(ys.len(), rows * k, "{} values for {rows} rows of {k}", ys.len());
        let mut act = ActQ8 { k, rows, qs: vec![0; rows * k], d: vec![0.0; rows * k / QK], sum: vec![0; rows * k / QK] };
        for (b, block) in ys.chunks_exact(QK).enumerate() {
            let amax = block.iter().fold(0f32, |m, y| m.max(y.abs()));
            let d = amax / 127.0;
            let mut sum = 0;
            for (i, y) in block.iter().enumerate() {
                let q = if d == 0.0 { 0 } else { (y / d).round_ties_even() as i32 };
                act.qs[b * QK + i] = q as i8;
                sum += q;
            }
            act.d[b] = d;
            act.sum[b] = sum;
        }
        act
    }

    /// The values the quants stand for (`d * q`), in float64.
    pub fn dequantize(&self) -> Vec<f64> {
        self.qs.iter().enumerate().map(|(i, &q)| self.d[i / QK] as f64 * q as f64).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_are_ggmls() {
        for t in WeightType::ALL {
            let xs: Vec<f32> = (0..t.block_values() * 3).map(|i| (i as f32 * 0.37).sin()).collect();
            assert_eq!(t.quantize(&xs).len(), 3 * t.block_bytes(), "{t:?}");
        }
    }

    #[test]
    fn activation_quantization_rounds_half_to_even_and_keeps_zero_blocks_zero() {
        let mut ys = vec![0f32; 64];
        ys[0] = 127.0;
        ys[1] = 2.5; // exactly 2.5 quanta: ties to even
        ys[2] = -3.5;
        let a = ActQ8::quantize(&ys, 1, 64);
        assert_eq!(a.d, vec![1.0, 0.0]);
        assert_eq!(&a.qs[..3], &[127, 2, -4]);
        assert_eq!(a.sum, vec![125, 0]);
        assert!(a.qs[32..].iter().all(|&q| q == 0));
    }
}
