//! `tine-gpu-check`: every kernel of tine-gpu on the GPU against its float64 reference over a
//! table of shapes and types (llama.cpp's test-backend-ops, for Tine's kernels), each verify
//! row against a one-row launch bit for bit, and (`--bench`) the launch sequence of a Gemma 3
//! 270M decode step captured as one CUDA graph and timed.
//!
//!   tine-gpu-check [--no-table] [--bench | --profile] [--seed N] [--kv K[/V]] [--model GGUF [--ref CPU.jsonl] [--assistant GGUF]]
//!   tine-gpu-check --quantize IN.gguf OUT.gguf   # F16 matrices to a Q4_K_M-like mix (candle's quantizers)
//!
//! `--no-table` skips the kernel table. `--profile` also times each launch of the bench's step inside its graph (an event node after
//! each launch), summed per kind of launch.
//!
//! With `--model` (a gemma3 GGUF) it also runs the model on the engine: graph nodes per step,
//! greedy decode speed, verify steps of 2..=8 rows against one-row steps bit for bit, and the
//! greedy ids against the CPU path's (`--ref`: JSON lines of `tine generate --json`, each with
//! `prompt_ids` and `ids`; where they part, the engine's top-2 gap there is printed). A model
//! with a NextN head runs it too; `--assistant` runs an assistant head's draft steps against a
//! float64 step computed here from its weights and the trunk's K/V.
//!
//! `--batch GGUF` (a gemma3 GGUF) runs several sequences' rows in one engine step (issue 50's
//! batched step): each row's id and logits against the same sequence stepped alone, bit for
//! bit, then aggregate decode speed at 1 to 64 sequences a step.
//!
//! `--kv q8_0` (or `K/V`, each f32, f16, bf16, q8_0 or q4_0) runs the model checks (`--model`,
//! `--qwen35`, `--gemma4`) with their sequences' K/V stored in those types.
//!
//! Prints one line per case and a summary; exits 1 if any case fails. `TINE_GPU_CUBIN` loads a
//! cubin compiled beside it instead of the embedded one.

// Index loops over rows and columns read more plainly here than zipped iterators.
#![allow(clippy::needless_range_loop)]

use std::process::ExitCode;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use tine_gpu::blocks::{ActQ8, Layout, WeightType, EMBD_WIDE, QK};
use tine_gpu::cuda::{
    ArgmaxArgs, AttnArgs, ConvArgs, ConvGdnArgs, DevPtr, GatedNormArgs, GdnArgs, GemvSeg, Kernels, KvStore, KvTypes, MoeCombineArgs, MoeRouterArgs, NormQuantArgs, PleArgs, RopeArgs, SeqRow,
    SoftcapArgs, StepParams, TopKArgs, TurboArgs, ARGMAX_BLOCKS, MAX_ROWS, TOPK_MAX,
};
use tine_gpu::reference;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Dev {
    stream: Arc<CudaStream>,
    k: Kernels,
}

impl Dev {
    fn up<T: DeviceRepr>(&self, xs: &[T]) -> Res<CudaSlice<T>> {
        Ok(self.stream.clone_htod(xs)?)
    }
    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Res<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }
    fn down<T: DeviceRepr + Default + Clone>(&self, s: &CudaSlice<T>) -> Res<Vec<T>> {
        Ok(self.stream.clone_dtoh(s)?)
    }
    fn ptr<T>(&self, s: &CudaSlice<T>) -> DevPtr {
        s.device_ptr(&self.stream).0
    }
    fn set_step(&self, step: &mut CudaSlice<StepParams>, p: StepParams) -> Res<()> {
        self.stream.memcpy_htod(&[p][..], step)?;
        Ok(())
    }
}

/// splitmix64: reproducible inputs without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

/// One row of the report.
struct Case {
    name: String,
    /// Largest error over its tolerance (pass: <= 1).
    worst: f64,
    /// Rows of multi-row launches equal to one-row launches bit for bit (None: not checked).
    bits: Option<bool>,
    note: String,
}

impl Case {
    fn pass(&self) -> bool {
        self.worst <= 1.0 && self.bits != Some(false) && self.note.is_empty()
    }
}

fn act_planes(dev: &Dev, a: &ActQ8) -> Res<(CudaSlice<i8>, CudaSlice<f32>, CudaSlice<i32>)> {
    Ok((dev.up(&a.qs)?, dev.up(&a.d)?, dev.up(&a.sum)?))
}

/// Rows of `hd` values stored as `t` on the device (the CPU's encoder, [`KvStore::encode_row`]),
/// and the values the stored rows hold (what a reference reads).
fn typed_cache(dev: &Dev, vals: &[f32], t: KvStore, hd: usize) -> Res<(CudaSlice<u8>, Vec<f32>)> {
    let bytes: Vec<u8> = vals.chunks_exact(hd).flat_map(|r| t.encode_row(r)).collect();
    let mut held = vec![0f32; vals.len()];
    for (row, out) in bytes.chunks_exact(t.row_bytes(hd)).zip(held.chunks_exact_mut(hd)) {
        t.decode_row(row, out);
    }
    Ok((dev.up(&bytes)?, held))
}

/// The attention's tolerance a unit of the values' largest magnitude: 2e-6, and 8e-6 over a
/// turbo cache, read in its rotated basis (the query's and the output's 32-point rotations add
/// five roundings each against float64 of the decoded rows).
fn turbo_tol(t: KvTypes) -> f64 {
    if t.k.turbo_bits().is_some() || t.v.turbo_bits().is_some() {
        8e-6
    } else {
        2e-6
    }
}

/// A case name's suffix for cache types (none for f32).
fn types_label(t: KvTypes) -> String {
    if t.is_f32() {
        String::new()
    } else {
        format!(" kv={}/{}", t.k, t.v)
    }
}

/// A GEMV check's inputs: weights of one type and shape (and the up weights for GLU) over `rows`
/// random activation rows, on the device, with the float64 references.
struct GemvFixture {
    t: WeightType,
    n: usize,
    k: usize,
    glu: bool,
    layout: Layout,
    w: CudaSlice<u8>,
    w2: CudaSlice<u8>,
    act: (CudaSlice<i8>, CudaSlice<f32>, CudaSlice<i32>),
    out: CudaSlice<f32>,
    gate: (Vec<f64>, Vec<f64>),
    up: (Vec<f64>, Vec<f64>),
}

impl GemvFixture {
    /// The fixture with its weights on the device in `layout` (the reference reads the GGUF
    /// blocks they came from).
    #[allow(clippy::too_many_arguments)]
    fn with_layout(dev: &Dev, rng: &mut Rng, t: WeightType, n: usize, k: usize, glu: bool, rows: usize, layout: Layout) -> Res<GemvFixture> {
        let w = t.quantize(&rng.vec(n * k, 0.5));
        let w2 = t.quantize(&rng.vec(n * k, 0.5));
        let act = ActQ8::quantize(&rng.vec(rows * k, 2.0), rows, k);
        let (gate, up) = (reference::gemv(t, &w, n, k, &act), reference::gemv(t, &w2, n, k, &act));
        let on_device = |w: &[u8]| -> Res<CudaSlice<u8>> {
            match layout {
                Layout::Gguf => dev.up(w),
                Layout::Wide => dev.up(&t.to_wide(w, k)),
            }
        };
        Ok(GemvFixture { t, n, k, glu, layout, w: on_device(&w)?, w2: on_device(&w2)?, act: act_planes(dev, &act)?, out: dev.zeros::<f32>(rows * n)?, gate, up })
    }

    /// The launch over activation rows row0 .. row0 + rows (the output's first `rows` rows).
    fn run(&self, dev: &Dev, rows: usize, row0: usize) -> Res<Vec<f32>> {
        let (n, k, kb) = (self.n, self.k, self.k / QK);
        let seg = GemvSeg {
            w: dev.ptr(&self.w),
            w2: if self.glu { dev.ptr(&self.w2) } else { 0 },
            out: dev.ptr(&self.out),
            n: n as i32,
            wtype: self.t.ggml_id(),
            out_stride: n as i32,
            glu: self.glu as i32,
            block_start: 0,
            wide: (self.layout == Layout::Wide) as i32,
        };
        let planes = (dev.ptr(&self.act.0) + (row0 * k) as u64, dev.ptr(&self.act.1) + (row0 * kb * 4) as u64, dev.ptr(&self.act.2) + (row0 * kb * 4) as u64);
        // SAFETY: the weights hold n rows of k values of type t, the planes the fixture's rows of
        // k (the callers keep row0 + rows within them), out as many rows of n.
        unsafe { dev.k.gemv(&dev.stream, rows, k, &[seg], planes)? };
        let mut v = dev.down(&self.out)?;
        v.truncate(rows * n);
        Ok(v)
    }

    /// Output `i` (row-major over activation rows) in float64 and its tolerance (a GLU's gate
    /// through GELU(tanh)).
    fn want(&self, i: usize) -> (f64, f64) {
        self.want_with(i, reference::gelu_tanh)
    }

    /// [`GemvFixture::want`] with the GLU's gate through `act`.
    fn want_with(&self, i: usize, act: fn(f64) -> f64) -> (f64, f64) {
        let ((g, gmag), (u, umag)) = ((self.gate.0[i], self.gate.1[i]), (self.up.0[i], self.up.1[i]));
        if self.glu {
            let gl = act(g);
            (gl * u, 1e-5 * (gmag * u.abs() * 1.2 + umag * gl.abs()) + 1e-6)
        } else {
            (g, 1e-5 * gmag + 1e-6)
        }
    }

    fn label(&self) -> String {
        format!("{:?} n={} k={}{}{}", self.t, self.n, self.k, if self.glu { " glu" } else { "" }, if self.layout == Layout::Wide { " wide" } else { "" })
    }
}

/// The GEMV of one weight type and shape, M = 1..=8, against float64 and one-row launches.
fn check_gemv(dev: &Dev, rng: &mut Rng, t: WeightType, n: usize, k: usize, glu: bool) -> Res<Case> {
    check_gemv_layout(dev, rng, t, n, k, glu, Layout::Gguf)
}

/// As [`check_gemv`], the weights in `layout` (the wide one: `gemv_wide`, the LM head's GEMV).
fn check_gemv_layout(dev: &Dev, rng: &mut Rng, t: WeightType, n: usize, k: usize, glu: bool, layout: Layout) -> Res<Case> {
    let f = GemvFixture::with_layout(dev, rng, t, n, k, glu, MAX_ROWS, layout)?;
    let mut worst = 0f64;
    let mut bits = true;
    let singles: Vec<Vec<f32>> = (0..MAX_ROWS).map(|m| f.run(dev, 1, m)).collect::<Res<_>>()?;
    for rows in 1..=MAX_ROWS {
        let got = f.run(dev, rows, 0)?;
        for m in 0..rows {
            for r in 0..n {
                let i = m * n + r;
                let (want, tol) = f.want(i);
                worst = worst.max((got[i] as f64 - want).abs() / tol);
                bits &= got[i].to_bits() == singles[m][r].to_bits();
            }
        }
    }
    Ok(Case { name: format!("gemv {}", f.label()), worst, bits: Some(bits), note: String::new() })
}

/// A batched step's GEMV (`gemv_rows`, `rows` a multiple of 8) against float64, every row bit
/// for bit its one-row launch's (the batch invariance a batched step keeps at any row count).
fn check_gemv_rows(dev: &Dev, rng: &mut Rng, t: WeightType, n: usize, k: usize, glu: bool, rows: usize) -> Res<Case> {
    let f = GemvFixture::with_layout(dev, rng, t, n, k, glu, rows, Layout::Wide)?;
    let seg =
        GemvSeg { w: dev.ptr(&f.w), w2: if glu { dev.ptr(&f.w2) } else { 0 }, out: dev.ptr(&f.out), n: n as i32, wtype: t.ggml_id(), out_stride: n as i32, glu: glu as i32, block_start: 0, wide: 1 };
    // SAFETY: the fixture's weights (n rows of k, wide), its `rows` activation rows, out rows x n.
    unsafe { dev.k.gemv_rows(&dev.stream, rows, k, &[seg], (dev.ptr(&f.act.0), dev.ptr(&f.act.1), dev.ptr(&f.act.2)))? };
    let got = dev.down(&f.out)?;
    let mut worst = 0f64;
    let mut bits = true;
    for m in 0..rows {
        let single = f.run(dev, 1, m)?;
        for r in 0..n {
            let (want, tol) = f.want(m * n + r);
            worst = worst.max((got[m * n + r] as f64 - want).abs() / tol);
            bits &= got[m * n + r].to_bits() == single[r].to_bits();
        }
    }
    Ok(Case { name: format!("gemv_rows {} rows={rows}", f.label()), worst, bits: Some(bits), note: String::new() })
}

/// The GEMM over a prompt's `rows` rows (`mmq`, more than 8) against float64, and the first row
/// against a one-row launch (to the same tolerance: the sums are taken in another order).
#[allow(clippy::too_many_arguments)]
fn check_gemv_prompt(dev: &Dev, rng: &mut Rng, t: WeightType, n: usize, k: usize, glu: bool, rows: usize, layout: Layout) -> Res<Case> {
    let f = GemvFixture::with_layout(dev, rng, t, n, k, glu, rows, layout)?;
    let single = f.run(dev, 1, 0)?;
    let got = f.run(dev, rows, 0)?;
    let mut worst = 0f64;
    for i in 0..rows * n {
        let (want, tol) = f.want(i);
        worst = worst.max((got[i] as f64 - want).abs() / tol);
        if i < n {
            worst = worst.max((got[i] as f64 - single[i] as f64).abs() / tol);
        }
    }
    Ok(Case { name: format!("mmq {} rows={rows}", f.label()), worst, bits: None, note: String::new() })
}

/// The prompt attention (`attn_prompt`) for `rows` rows from `pos` against float64, and its Q8
/// output planes against its f32 output quantized on the CPU.
#[allow(clippy::too_many_arguments)]
fn check_attention_rows(dev: &Dev, rng: &mut Rng, n_head: usize, n_kv: usize, hd: usize, ctx: usize, window: usize, pos: usize, rows: usize, types: KvTypes) -> Res<Case> {
    let (kd, kc) = typed_cache(dev, &rng.vec(n_kv * ctx * hd, 1.0), types.k, hd)?;
    let (vd, vc) = typed_cache(dev, &rng.vec(n_kv * ctx * hd, 1.0), types.v, hd)?;
    let q = rng.vec(rows * n_head * hd, 3.0 / (hd as f32).sqrt());
    let qd = dev.up(&q)?;
    let width = n_head * hd;
    let out = dev.zeros::<f32>(rows * width)?;
    let mut step = dev.up(&[StepParams::default()])?;
    let (aqs, aqd, aqsum) = (dev.zeros::<i8>(rows * width)?, dev.zeros::<f32>(rows * width / QK)?, dev.zeros::<i32>(rows * width / QK)?);
    let mut run = |row0: usize, n_rows: usize| -> Res<(Vec<f32>, bool)> {
        dev.set_step(&mut step, StepParams { pos: (pos + row0) as i32, rows: n_rows as i32, ..Default::default() })?;
        let args = AttnArgs {
            q: dev.ptr(&qd) + (row0 * width * 4) as u64,
            k_cache: dev.ptr(&kd),
            v_cache: dev.ptr(&vd),
            out: dev.ptr(&out),
            partials: 0,
            counters: 0,
            step: dev.ptr(&step),
            qs: dev.ptr(&aqs),
            qd: dev.ptr(&aqd),
            qsum: dev.ptr(&aqsum),
            ctx: ctx as i32,
            window: window as i32,
            n_head: n_head as i32,
            n_kv: n_kv as i32,
            chunks_max: 0,
            gate: 0,
            k_type: types.k.kernel_id(),
            v_type: types.v.kernel_id(),
            kv_slots: 0,
            turbo: dev.k.turbo_tab(&dev.stream),
        };
        // SAFETY: q holds `rows` rows (row0 + n_rows <= rows), the caches ctx positions (pos +
        // rows <= ctx), the Q8 planes `rows` rows.
        unsafe { dev.k.attention_prompt(&dev.stream, n_rows, hd, &args)? };
        let mut v = dev.down(&out)?;
        v.truncate(n_rows * width);
        let want = ActQ8::quantize(&v, n_rows, width);
        let (gq, gd, gs) = (dev.down(&aqs)?, dev.down(&aqd)?, dev.down(&aqsum)?);
        let q8 = gq[..n_rows * width] == want.qs[..] && gd[..n_rows * width / QK].iter().zip(&want.d).all(|(a, b)| a.to_bits() == b.to_bits()) && gs[..n_rows * width / QK] == want.sum[..];
        Ok((v, q8))
    };
    let (got, q8) = run(0, rows)?;
    let vmax = vc.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
    let mut worst = 0f64;
    for m in 0..rows {
        let qm: Vec<f64> = q[m * width..(m + 1) * width].iter().map(|&x| x as f64).collect();
        let want = reference::attention(&qm, &kc, &vc, ctx, n_head, n_kv, hd, pos + m, window);
        for (i, w) in want.iter().enumerate() {
            worst = worst.max((got[m * width + i] as f64 - w).abs() / (turbo_tol(types) * vmax + 1e-7));
        }
    }
    let note = if q8 { String::new() } else { "Q8 output differs from the f32 output quantized".to_string() };
    Ok(Case { name: format!("attention prompt rows={rows} heads={n_head}/{n_kv} hd={hd} ctx={ctx} window={window} pos={pos}{}", types_label(types)), worst, bits: None, note })
}

/// Q, K and V in one `mmq` launch over a prompt's `rows` rows.
fn check_mmq_segments(dev: &Dev, rng: &mut Rng, k: usize, rows: usize, parts: &[(WeightType, usize)], layout: Layout) -> Res<Case> {
    let act = ActQ8::quantize(&rng.vec(rows * k, 1.0), rows, k);
    let (qs, qd, qsum) = act_planes(dev, &act)?;
    let mut keep = Vec::new();
    let mut segs = Vec::new();
    let mut refs = Vec::new();
    for &(t, n) in parts {
        let w = t.quantize(&rng.vec(n * k, 0.5));
        let wd = if layout == Layout::Wide { dev.up(&t.to_wide(&w, k))? } else { dev.up(&w)? };
        let out = dev.zeros::<f32>(rows * n)?;
        segs.push(GemvSeg { w: dev.ptr(&wd), out: dev.ptr(&out), n: n as i32, wtype: t.ggml_id(), out_stride: n as i32, wide: (layout == Layout::Wide) as i32, ..Default::default() });
        refs.push(reference::gemv(t, &w, n, k, &act));
        keep.push((wd, out));
    }
    // SAFETY: as in check_gemv, for each segment, with `rows` rows.
    unsafe { dev.k.gemv(&dev.stream, rows, k, &segs, (dev.ptr(&qs), dev.ptr(&qd), dev.ptr(&qsum)))? };
    let mut worst = 0f64;
    for ((_, out), (want, mag)) in keep.iter().zip(&refs) {
        for (i, g) in dev.down(out)?.iter().enumerate() {
            worst = worst.max((*g as f64 - want[i]).abs() / (1e-5 * mag[i] + 1e-6));
        }
    }
    let shape: Vec<String> = parts.iter().map(|(t, n)| format!("{t:?}x{n}")).collect();
    let how = if layout == Layout::Wide { " wide" } else { "" };
    Ok(Case { name: format!("mmq segments k={k} rows={rows} [{}]{how}", shape.join(", ")), worst, bits: None, note: String::new() })
}

/// Q, K and V in one launch of three segments of two types.
fn check_gemv_segments(dev: &Dev, rng: &mut Rng, k: usize, parts: &[(WeightType, usize)], layout: Layout) -> Res<Case> {
    let act = ActQ8::quantize(&rng.vec(4 * k, 1.0), 4, k);
    let (qs, qd, qsum) = act_planes(dev, &act)?;
    let mut keep = Vec::new();
    let mut segs = Vec::new();
    let mut refs = Vec::new();
    for &(t, n) in parts {
        let w = t.quantize(&rng.vec(n * k, 0.5));
        let wd = if layout == Layout::Wide { dev.up(&t.to_wide(&w, k))? } else { dev.up(&w)? };
        let out = dev.zeros::<f32>(4 * n)?;
        segs.push(GemvSeg { w: dev.ptr(&wd), out: dev.ptr(&out), n: n as i32, wtype: t.ggml_id(), out_stride: n as i32, wide: (layout == Layout::Wide) as i32, ..Default::default() });
        refs.push(reference::gemv(t, &w, n, k, &act));
        keep.push((wd, out));
    }
    // SAFETY: as in check_gemv, for each segment.
    unsafe { dev.k.gemv(&dev.stream, 4, k, &segs, (dev.ptr(&qs), dev.ptr(&qd), dev.ptr(&qsum)))? };
    let mut worst = 0f64;
    for ((_, out), (want, mag)) in keep.iter().zip(&refs) {
        let got = dev.down(out)?;
        for (i, g) in got.iter().enumerate() {
            worst = worst.max((*g as f64 - want[i]).abs() / (1e-5 * mag[i] + 1e-6));
        }
    }
    let shape: Vec<String> = parts.iter().map(|(t, n)| format!("{t:?}x{n}")).collect();
    let how = if layout == Layout::Wide { " wide" } else { "" };
    Ok(Case { name: format!("gemv segments k={k} [{}]{how}", shape.join(", ")), worst, bits: None, note: String::new() })
}

/// norm_quant in one mode, rows 1..=8.
/// `mode` 0..=2 as the kernel's in_mode with the norm and res_out; 3: the plain quantization
/// (in_mode 0, no norm, no res_out).
/// `norm_quant`'s mode 1 with `res_scale` (a block's `layer_output_scale`) in the table's mode 4.
const RES_SCALE: f32 = 0.7;

/// Modes 0-2 as decode.cu numbers them, 3 the plain quantize, 4 mode 1 scaled by [`RES_SCALE`],
/// 5 decode.cu's mode 3 (a pre-norm block's `res + a`); mode 2 reads an embedding table of type
/// `et`.
fn check_norm_quant(dev: &Dev, rng: &mut Rng, k: usize, mode: i32, et: WeightType) -> Res<Case> {
    check_norm_quant_layout(dev, rng, k, mode, et, Layout::Gguf)
}

/// As [`check_norm_quant`], the embedding table in `layout`.
fn check_norm_quant_layout(dev: &Dev, rng: &mut Rng, k: usize, mode: i32, et: WeightType, layout: Layout) -> Res<Case> {
    let rows = MAX_ROWS;
    let plain = mode == 3;
    let vocab = 64;
    let a = rng.vec(rows * k, 3.0);
    let res = rng.vec(rows * k, 10.0);
    let w_a: Vec<f32> = rng.vec(k, 0.5).iter().map(|x| 1.0 + x).collect();
    let w: Vec<f32> = rng.vec(k, 0.5).iter().map(|x| 1.0 + x).collect();
    let embd = et.quantize(&rng.vec(vocab * k, 1.0));
    let tokens: [i32; MAX_ROWS] = std::array::from_fn(|i| (rng.next() % vocab as u64) as i32 ^ (i as i32 & 1));
    let (eps, scale) = (1e-6f32, (k as f32).sqrt());
    let table = match layout {
        Layout::Gguf => embd.clone(),
        Layout::Wide => et.to_wide(&embd, k),
    };
    let (ad, resd, wad, wd, ed) = (dev.up(&a)?, dev.up(&res)?, dev.up(&w_a)?, dev.up(&w)?, dev.up(&table)?);
    let mut step = dev.up(&[StepParams::default()])?;
    let (res_out, y_out) = (dev.zeros::<f32>(rows * k)?, dev.zeros::<f32>(rows * k)?);
    let (qs, qd, qsum) = (dev.zeros::<i8>(rows * k)?, dev.zeros::<f32>(rows * k / QK)?, dev.zeros::<i32>(rows * k / QK)?);
    let embd_f = et.dequantize(&embd);
    // Reference rows.
    let want = |m: usize| -> (Vec<f64>, Vec<f64>) {
        let t: Vec<f64> = match mode {
            0 | 3 => a[m * k..(m + 1) * k].iter().map(|&x| x as f64).collect(),
            5 => a[m * k..(m + 1) * k].iter().zip(&res[m * k..]).map(|(&x, &r)| x as f64 + r as f64).collect(),
            1 | 4 => {
                let am: Vec<f64> = a[m * k..(m + 1) * k].iter().map(|&x| x as f64).collect();
                let n = reference::rms_norm(&am, &w_a, eps as f64);
                let scale = if mode == 4 { RES_SCALE as f64 } else { 1.0 };
                n.iter().zip(&res[m * k..]).map(|(x, r)| (x + *r as f64) * scale).collect()
            }
            _ => {
                let tok = tokens[m] as usize;
                embd_f[tok * k..(tok + 1) * k].iter().map(|&x| x as f64 * scale as f64).collect()
            }
        };
        let y = if plain { t.clone() } else { reference::rms_norm(&t, &w, eps as f64) };
        (t, y)
    };
    let mut worst = 0f64;
    let mut bits = true;
    let mut note = String::new();
    let mut singles: Vec<Vec<f32>> = Vec::new();
    for pass in 0..2 {
        // pass 0: each row alone (one-row launches), pass 1: all rows in one launch.
        let launches: Vec<(usize, usize)> = if pass == 0 { (0..rows).map(|m| (m, 1)).collect() } else { vec![(0, rows)] };
        for (row0, n_rows) in launches {
            let off = |p: DevPtr, size: usize| p + (row0 * k * size) as u64;
            let mut sp = StepParams::default();
            sp.tokens[..n_rows].copy_from_slice(&tokens[row0..row0 + n_rows]);
            dev.set_step(&mut step, sp)?;
            let args = NormQuantArgs {
                a: off(dev.ptr(&ad), 4),
                res: off(dev.ptr(&resd), 4),
                w_a: dev.ptr(&wad),
                embd: dev.ptr(&ed),
                embd_scale: scale,
                step: dev.ptr(&step),
                w: dev.ptr(&wd),
                eps,
                res_out: if plain { 0 } else { off(dev.ptr(&res_out), 4) },
                y_out: off(dev.ptr(&y_out), 4),
                qs: off(dev.ptr(&qs), 1),
                qd: dev.ptr(&qd) + (row0 * k / QK * 4) as u64,
                qsum: dev.ptr(&qsum) + (row0 * k / QK * 4) as u64,
                k: k as i32,
                in_mode: if plain {
                    0
                } else if mode == 4 {
                    1
                } else if mode == 5 {
                    3
                } else {
                    mode
                },
                norm: i32::from(!plain),
                tokens: 0,
                res_scale: if mode == 4 { RES_SCALE } else { 0.0 },
                embd_type: match (layout, et) {
                    (Layout::Wide, _) => et.ggml_id() | EMBD_WIDE,
                    (Layout::Gguf, WeightType::Q8_0) => 0,
                    _ => et.ggml_id(),
                },
                ..Default::default()
            };
            // SAFETY: every buffer holds `rows` rows of k (and k/32 per row for the scales), the
            // table `vocab` rows, and row0 + n_rows <= rows.
            unsafe { dev.k.norm_quant(&dev.stream, n_rows, &args)? };
        }
        let (t_got, y_got) = (dev.down(&res_out)?, dev.down(&y_out)?);
        let got_q = ActQ8 { k, rows, qs: dev.down(&qs)?, d: dev.down(&qd)?, sum: dev.down(&qsum)? };
        for m in 0..rows {
            let (t, y) = want(m);
            let tmax = t.iter().fold(0f64, |x, v| x.max(v.abs()));
            let ymax = y.iter().fold(0f64, |x, v| x.max(v.abs()));
            for i in 0..k {
                if !plain {
                    worst = worst.max((t_got[m * k + i] as f64 - t[i]).abs() / (2e-6 * tmax + 1e-7));
                }
                worst = worst.max((y_got[m * k + i] as f64 - y[i]).abs() / (1e-5 * ymax + 1e-7));
            }
        }
        if ActQ8::quantize(&y_got, rows, k) != got_q {
            note = "the Q8 planes differ from the CPU quantizer on the kernel's own y".into();
        }
        if pass == 0 {
            singles = vec![y_got, got_q.qs.iter().map(|&q| q as f32).collect()];
        } else {
            bits &= singles[0].iter().zip(&y_got).all(|(a, b)| a.to_bits() == b.to_bits());
            bits &= singles[1].iter().zip(&got_q.qs).all(|(a, b)| *a == *b as f32);
        }
    }
    let embedding = format!("{et:?}{} embedding", if layout == Layout::Wide { " wide" } else { "" });
    let what = ["plain + norm", "post-norm + residual", &embedding, "quantize only", "post-norm + residual, scaled", "residual + norm"][mode as usize];
    Ok(Case { name: format!("norm_quant k={k} {what}"), worst, bits: Some(bits), note })
}

/// Two norm_quant launches filling the halves of concatenated rows (`q_stride` 2k, `q_off` 0
/// and k: a NextN head's `[enorm(embedding); hnorm(hidden)]`) against each launch into rows of
/// its own: the Q8 planes and the f32 output, bit for bit.
fn check_norm_quant_concat(dev: &Dev, rng: &mut Rng, k: usize) -> Res<Case> {
    let (rows, vocab) = (MAX_ROWS, 64);
    let h = dev.up(&rng.vec(rows * k, 3.0))?;
    let w: Vec<f32> = rng.vec(k, 0.5).iter().map(|x| 1.0 + x).collect();
    let (wd, ed) = (dev.up(&w)?, dev.up(&WeightType::Q8_0.quantize(&rng.vec(vocab * k, 1.0)))?);
    let sp = StepParams { tokens: std::array::from_fn(|i| (rng.next() % vocab as u64) as i32 ^ (i as i32 & 1)), ..Default::default() };
    let step = dev.up(&[sp])?;
    let args = |mode: i32, kw: usize, q: &(CudaSlice<i8>, CudaSlice<f32>, CudaSlice<i32>), y: &CudaSlice<f32>, q_stride: usize, q_off: usize| NormQuantArgs {
        a: if mode == 0 { dev.ptr(&h) } else { 0 },
        embd: dev.ptr(&ed),
        embd_scale: (kw as f32).sqrt(),
        step: dev.ptr(&step),
        w: dev.ptr(&wd),
        eps: 1e-6,
        y_out: dev.ptr(y),
        qs: dev.ptr(&q.0),
        qd: dev.ptr(&q.1),
        qsum: dev.ptr(&q.2),
        k: kw as i32,
        in_mode: mode,
        norm: 1,
        q_stride: q_stride as i32,
        q_off: q_off as i32,
        ..Default::default()
    };
    let planes = |width: usize| -> Res<_> { Ok((dev.zeros::<i8>(rows * width)?, dev.zeros::<f32>(rows * width / QK)?, dev.zeros::<i32>(rows * width / QK)?)) };
    let (cat, cat_y) = (planes(2 * k)?, dev.zeros::<f32>(rows * 2 * k)?);
    let (e, e_y, hh, h_y) = (planes(k)?, dev.zeros::<f32>(rows * k)?, planes(k)?, dev.zeros::<f32>(rows * k)?);
    // SAFETY: each buffer holds `rows` rows of its width (k or 2k values, a 32nd of that in
    // scales), the table `vocab` rows of k, the step block the rows' tokens.
    unsafe {
        dev.k.norm_quant(&dev.stream, rows, &args(2, k, &cat, &cat_y, 2 * k, 0))?;
        dev.k.norm_quant(&dev.stream, rows, &args(0, k, &cat, &cat_y, 2 * k, k))?;
        dev.k.norm_quant(&dev.stream, rows, &args(2, k, &e, &e_y, 0, 0))?;
        dev.k.norm_quant(&dev.stream, rows, &args(0, k, &hh, &h_y, 0, 0))?;
    }
    let (cy, ey, hy) = (dev.down(&cat_y)?, dev.down(&e_y)?, dev.down(&h_y)?);
    let (cq, eq, hq) = (dev.down(&cat.0)?, dev.down(&e.0)?, dev.down(&hh.0)?);
    let (cd, ed2, hd) = (dev.down(&cat.1)?, dev.down(&e.1)?, dev.down(&hh.1)?);
    let mut same = true;
    for m in 0..rows {
        let (r, rb) = (m * 2 * k, m * 2 * k / QK);
        same &= cy[r..r + k].iter().chain(&cy[r + k..r + 2 * k]).zip(ey[m * k..(m + 1) * k].iter().chain(&hy[m * k..(m + 1) * k])).all(|(a, b)| a.to_bits() == b.to_bits());
        same &= cq[r..r + 2 * k] == [&eq[m * k..(m + 1) * k], &hq[m * k..(m + 1) * k]].concat()[..];
        same &= cd[rb..rb + 2 * k / QK].iter().zip(ed2[m * k / QK..(m + 1) * k / QK].iter().chain(&hd[m * k / QK..(m + 1) * k / QK])).all(|(a, b)| a.to_bits() == b.to_bits());
    }
    Ok(Case { name: format!("norm_quant k={k} into halves of rows of {}", 2 * k), worst: if same { 0.0 } else { f64::INFINITY }, bits: Some(same), note: String::new() })
}

/// `qk_norm_rope_kv` with `args` (q/k/v at row 0 of `rows` rows) over positions `pos..pos +
/// rows`: one launch of every row, or one launch a row (`one_by_one`).
fn rope_rows(dev: &Dev, step: &mut CudaSlice<StepParams>, args: &RopeArgs, pos: usize, rows: usize, one_by_one: bool) -> Res<()> {
    let (qw, kw) = ((args.n_head * args.hd * 4) as u64, (args.n_kv * args.hd * 4) as u64);
    let launches: Vec<(usize, usize)> = if one_by_one { (0..rows).map(|m| (m, 1)).collect() } else { vec![(0, rows)] };
    for (row0, n_rows) in launches {
        dev.set_step(step, StepParams { pos: (pos + row0) as i32, rows: n_rows as i32, ..Default::default() })?;
        let r = row0 as u64;
        let a = RopeArgs { q: args.q + r * qw, k: args.k + r * kw, v: args.v + r * kw, ..*args };
        // SAFETY: the caller's q/k/v hold `rows` rows, its caches more than pos + rows positions.
        unsafe { dev.k.qk_norm_rope_kv(&dev.stream, n_rows, &a)? };
    }
    Ok(())
}

/// q/k norm + RoPE + KV write for rows at pos..pos+M.
/// `qk_norm_rope_kv` with RoPE on the first `n_rot` dims of each head (0: all).
/// `v_norm`: V's RMSNorm without a weight; `v_from_k`: V is K's projection before its norm
/// (Gemma 4); `n_kv` 0: the queries alone (a layer reading another's K/V).
#[allow(clippy::too_many_arguments)]
fn check_rope(dev: &Dev, rng: &mut Rng, n_head: usize, n_kv: usize, hd: usize, pos: usize, n_rot: usize, v_norm: bool, v_from_k: bool) -> Res<Case> {
    let nr = if n_rot == 0 { hd } else { n_rot };
    let rows = MAX_ROWS;
    let ctx = pos + rows + 3;
    // (n_kv 0: one head's worth of K and V the kernel must not touch.)
    let (q, kx, v) = (rng.vec(rows * n_head * hd, 2.0), rng.vec(rows * n_kv.max(1) * hd, 2.0), rng.vec(rows * n_kv.max(1) * hd, 2.0));
    let qn: Vec<f32> = rng.vec(hd, 0.5).iter().map(|x| 1.0 + x).collect();
    let kn: Vec<f32> = rng.vec(hd, 0.5).iter().map(|x| 1.0 + x).collect();
    let inv = reference::inv_freq(nr, 1e6);
    let (eps, q_scale) = (1e-6f32, 1.0 / (hd as f32).sqrt());
    let (qnd, knd, invd, kd, vd) = (dev.up(&qn)?, dev.up(&kn)?, dev.up(&inv)?, dev.up(&kx)?, dev.up(&v)?);
    let mut step = dev.up(&[StepParams::default()])?;
    let mut worst = 0f64;
    let mut results: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = Vec::new();
    for pass in 0..2 {
        let qd = dev.up(&q)?;
        let (kc, vc) = (dev.zeros::<f32>(n_kv.max(1) * ctx * hd)?, dev.zeros::<f32>(n_kv.max(1) * ctx * hd)?);
        let args = RopeArgs {
            q: dev.ptr(&qd),
            k: dev.ptr(&kd),
            v: dev.ptr(&vd),
            q_norm: dev.ptr(&qnd),
            k_norm: dev.ptr(&knd),
            eps,
            inv_freq: dev.ptr(&invd),
            q_scale,
            k_cache: dev.ptr(&kc),
            v_cache: dev.ptr(&vc),
            ctx: ctx as i32,
            step: dev.ptr(&step),
            n_head: n_head as i32,
            n_kv: n_kv as i32,
            hd: hd as i32,
            n_rot: n_rot as i32,
            v_norm: v_norm as i32,
            v_from_k: v_from_k as i32,
            k_type: 0,
            v_type: 0,
            kv_slots: 0,
            stage: 0,
            turbo: dev.k.turbo_tab(&dev.stream),
        };
        rope_rows(dev, &mut step, &args, pos, rows, pass == 0)?;
        let (qg, kg, vg) = (dev.down(&qd)?, dev.down(&kc)?, dev.down(&vc)?);
        for m in 0..rows {
            for h in 0..n_head + n_kv {
                let (src, w) = if h < n_head { (&q[(m * n_head + h) * hd..][..hd], &qn) } else { (&kx[(m * n_kv + h - n_head) * hd..][..hd], &kn) };
                let x: Vec<f64> = src.iter().map(|&v| v as f64).collect();
                let want = reference::rope_partial(&reference::rms_norm(&x, w, eps as f64), pos + m, nr, &inv);
                let got: &[f32] = if h < n_head { &qg[(m * n_head + h) * hd..][..hd] } else { &kg[((h - n_head) * ctx + pos + m) * hd..][..hd] };
                let s = if h < n_head { q_scale as f64 } else { 1.0 };
                let mx = want.iter().fold(0f64, |a, v| a.max(v.abs())) * s;
                for d in 0..hd {
                    worst = worst.max((got[d] as f64 - want[d] * s).abs() / (4e-6 * mx + 1e-7));
                }
                if h >= n_head {
                    let g = h - n_head;
                    let vs = if v_from_k { &kx[(m * n_kv + g) * hd..][..hd] } else { &v[(m * n_kv + g) * hd..][..hd] };
                    let got_v = &vg[(g * ctx + pos + m) * hd..][..hd];
                    if v_norm {
                        let x: Vec<f64> = vs.iter().map(|&v| v as f64).collect();
                        let want = reference::rms_norm(&x, &vec![1.0; hd], eps as f64);
                        let mx = want.iter().fold(0f64, |a, v| a.max(v.abs()));
                        for d in 0..hd {
                            worst = worst.max((got_v[d] as f64 - want[d]).abs() / (4e-6 * mx + 1e-7));
                        }
                    } else if vs != got_v {
                        worst = f64::INFINITY;
                    }
                }
            }
        }
        results.push((qg, kg, vg));
    }
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let bits = same(&results[0].0, &results[1].0) && same(&results[0].1, &results[1].1) && same(&results[0].2, &results[1].2);
    let v_mode = match (v_norm, v_from_k) {
        (false, false) => "",
        (true, false) => " v_norm",
        (false, true) => " v=k",
        (true, true) => " v=k v_norm",
    };
    Ok(Case { name: format!("qk_norm_rope_kv heads={n_head}/{n_kv} hd={hd} rot={nr} pos={pos}{v_mode}"), worst, bits: Some(bits), note: String::new() })
}

/// `qk_norm_rope_kv` into caches of `types`: each stored row is the CPU's encoding
/// ([`KvStore::encode_row`], candle's quantizer) of the row the kernel writes into an f32 cache
/// from the same inputs, bit for bit; one-row launches store the same bytes as one launch of
/// every row. V's rows come from a small set of values (ties of magnitude with either sign, and
/// an all-zero block), where q4_0's choice of the first largest value shows.
fn check_kv_store(dev: &Dev, rng: &mut Rng, n_kv: usize, hd: usize, pos: usize, types: KvTypes, v_norm: bool) -> Res<Case> {
    let (n_head, rows) = (n_kv, MAX_ROWS);
    let ctx = pos + rows + 3;
    let q = rng.vec(rows * n_head * hd, 2.0);
    let kx = rng.vec(rows * n_kv * hd, 2.0);
    let levels = [-1.5f32, -0.5, 0.0, 0.5, 1.5];
    let mut v: Vec<f32> = (0..rows * n_kv * hd).map(|_| levels[(rng.next() % 5) as usize]).collect();
    v[..32].iter_mut().for_each(|x| *x = 0.0);
    let qn: Vec<f32> = rng.vec(hd, 0.5).iter().map(|x| 1.0 + x).collect();
    let inv = reference::inv_freq(hd, 1e4);
    let (qnd, invd, kd, vd) = (dev.up(&qn)?, dev.up(&inv)?, dev.up(&kx)?, dev.up(&v)?);
    let mut step = dev.up(&[StepParams::default()])?;
    // Where a cache is of a turbo type, the rows' K and V for turbo_store.
    let stage = dev.zeros::<f32>(rows * n_kv * 2 * hd)?;
    // Pass 0: f32 caches, one launch; 1: typed, one row a launch; 2: typed, one launch.
    let mut caches = Vec::new();
    for pass in 0..3 {
        let t = if pass == 0 { KvTypes::F32 } else { types };
        let qd = dev.up(&q)?;
        let (kc, vc) = (dev.zeros::<u8>(n_kv * ctx * t.k.row_bytes(hd))?, dev.zeros::<u8>(n_kv * ctx * t.v.row_bytes(hd))?);
        let args = RopeArgs {
            q: dev.ptr(&qd),
            k: dev.ptr(&kd),
            v: dev.ptr(&vd),
            q_norm: dev.ptr(&qnd),
            k_norm: dev.ptr(&qnd),
            eps: 1e-6,
            inv_freq: dev.ptr(&invd),
            q_scale: 1.0,
            k_cache: dev.ptr(&kc),
            v_cache: dev.ptr(&vc),
            ctx: ctx as i32,
            step: dev.ptr(&step),
            n_head: n_head as i32,
            n_kv: n_kv as i32,
            hd: hd as i32,
            n_rot: 0,
            v_norm: v_norm as i32,
            v_from_k: 0,
            k_type: t.k.kernel_id(),
            v_type: t.v.kernel_id(),
            kv_slots: 0,
            stage: dev.ptr(&stage),
            turbo: dev.k.turbo_tab(&dev.stream),
        };
        rope_rows(dev, &mut step, &args, pos, rows, pass == 1)?;
        caches.push((dev.down(&kc)?, dev.down(&vc)?));
    }
    let mut mismatched = 0usize;
    for (which, t) in [(0, types.k), (1, types.v)] {
        let (rf, rb) = (KvStore::F32.row_bytes(hd), t.row_bytes(hd));
        let plane = |c: &(Vec<u8>, Vec<u8>)| if which == 0 { c.0.clone() } else { c.1.clone() };
        let (f, one, all) = (plane(&caches[0]), plane(&caches[1]), plane(&caches[2]));
        for g in 0..n_kv {
            for m in 0..rows {
                let at = g * ctx + pos + m;
                let vals: Vec<f32> = f[at * rf..(at + 1) * rf].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                let want = t.encode_row(&vals);
                mismatched += usize::from(one[at * rb..(at + 1) * rb] != want[..]) + usize::from(all[at * rb..(at + 1) * rb] != want[..]);
            }
        }
    }
    let note = if mismatched == 0 { String::new() } else { format!("{mismatched} stored rows differ from the CPU's encoding") };
    Ok(Case { name: format!("qk_norm_rope_kv store heads={n_kv} hd={hd} pos={pos}{}{}", if v_norm { " v_norm" } else { "" }, types_label(types)), worst: 0.0, bits: Some(mismatched == 0), note })
}

/// `ple_inputs` over `rows` tokens against float64: the per-layer embeddings of a table of
/// `layers * p`-value rows of `et` in `layout` and a random projection.
fn check_ple(dev: &Dev, rng: &mut Rng, layers: usize, p: usize, et: WeightType, layout: Layout) -> Res<Case> {
    let (rows, vocab, k, hidden) = (MAX_ROWS, 97, layers * p, 1536);
    let table = et.quantize(&rng.vec(vocab * k, 1.0));
    let table_dev = match layout {
        Layout::Wide => dev.up(&et.to_wide(&table, k))?,
        Layout::Gguf => dev.up(&table)?,
    };
    let proj = rng.vec(rows * k, 20.0);
    let w: Vec<f32> = rng.vec(p, 0.5).iter().map(|x| 1.0 + x).collect();
    let tokens: Vec<i32> = (0..rows).map(|_| (rng.next() % vocab as u64) as i32).collect();
    let mut sp = StepParams::default();
    sp.tokens[..rows].copy_from_slice(&tokens);
    let step = dev.up(&[sp])?;
    let (pd, wd, out) = (dev.up(&proj)?, dev.up(&w)?, dev.zeros::<f32>(rows * k)?);
    let (eps, proj_scale, tok_scale) = (1e-6f32, 1.0 / (hidden as f32).sqrt(), (p as f32).sqrt());
    let embd_type = et.ggml_id() | if layout == Layout::Wide { EMBD_WIDE } else { 0 };
    let args = PleArgs {
        proj: dev.ptr(&pd),
        embd: dev.ptr(&table_dev),
        w: dev.ptr(&wd),
        out: dev.ptr(&out),
        step: dev.ptr(&step),
        tokens: 0,
        embd_type,
        n_layer: layers as i32,
        p: p as i32,
        eps,
        proj_scale,
        tok_scale,
    };
    // SAFETY: proj and out hold `rows` rows of layers * p values, the table `vocab` rows (every
    // token below vocab), w p values, the step block the rows' tokens.
    unsafe { dev.k.ple_inputs(&dev.stream, rows, &args)? };
    let got = dev.down(&out)?;
    let deq = et.dequantize(&table);
    let mut worst = 0f64;
    for m in 0..rows {
        for l in 0..layers {
            let x: Vec<f64> = proj[m * k + l * p..][..p].iter().map(|&v| v as f64 * proj_scale as f64).collect();
            let n = reference::rms_norm(&x, &w, eps as f64);
            for i in 0..p {
                let e = deq[tokens[m] as usize * k + l * p + i] as f64 * tok_scale as f64;
                let want = (n[i] + e) * std::f64::consts::FRAC_1_SQRT_2;
                worst = worst.max((got[m * k + l * p + i] as f64 - want).abs() / (4e-6 * (n[i].abs() + e.abs() + 1.0)));
            }
        }
    }
    Ok(Case { name: format!("ple_inputs layers={layers} p={p} table {et:?} {layout:?}"), worst, bits: None, note: String::new() })
}

/// `norm_quant` in_mode 4 (`gelu_tanh(a) · b`, b's rows `stride` apart) against float64, and its
/// Q8 rows against the CPU quantizer over its own f32 output.
fn check_gelu_gate(dev: &Dev, rng: &mut Rng, k: usize, stride: usize) -> Res<Case> {
    let rows = MAX_ROWS;
    let a = rng.vec(rows * k, 3.0);
    let b = rng.vec(rows * stride, 2.0);
    let (ad, bd, y) = (dev.up(&a)?, dev.up(&b)?, dev.zeros::<f32>(rows * k)?);
    let (qs, qd, qsum) = (dev.zeros::<i8>(rows * k)?, dev.zeros::<f32>(rows * k / QK)?, dev.zeros::<i32>(rows * k / QK)?);
    let args = NormQuantArgs {
        a: dev.ptr(&ad),
        w_a: dev.ptr(&bd),
        b_stride: stride as i32,
        y_out: dev.ptr(&y),
        qs: dev.ptr(&qs),
        qd: dev.ptr(&qd),
        qsum: dev.ptr(&qsum),
        k: k as i32,
        in_mode: 4,
        eps: 1e-6,
        ..Default::default()
    };
    // SAFETY: a, y and the planes hold `rows` rows of k values, b `rows` rows of `stride` >= k.
    unsafe { dev.k.norm_quant(&dev.stream, rows, &args)? };
    let got = dev.down(&y)?;
    let mut worst = 0f64;
    for m in 0..rows {
        for i in 0..k {
            let g = a[m * k + i] as f64;
            let gelu = 0.5 * g * (1.0 + (0.7978845608028654 * (g + 0.044715 * g * g * g)).tanh());
            let want = gelu * b[m * stride + i] as f64;
            worst = worst.max((got[m * k + i] as f64 - want).abs() / (4e-6 * (want.abs() + 1.0)));
        }
    }
    let want = ActQ8::quantize(&got, rows, k);
    let q8 = dev.down(&qs)? == want.qs && dev.down(&qd)?.iter().zip(&want.d).all(|(a, b)| a.to_bits() == b.to_bits()) && dev.down(&qsum)? == want.sum;
    Ok(Case { name: format!("norm_quant gelu gate k={k} b rows of {stride}"), worst, bits: None, note: if q8 { String::new() } else { "Q8 rows differ from the f32 rows quantized".into() } })
}

/// `softcap` over `n` values against float64.
fn check_softcap(dev: &Dev, rng: &mut Rng, n: usize, cap: f32) -> Res<Case> {
    let x = rng.vec(n, 4.0 * cap);
    let xd = dev.up(&x)?;
    let args = SoftcapArgs { x: dev.ptr(&xd), n: n as i32, cap, inv_cap: (1.0 / cap as f64) as f32, pad_: 0 };
    // SAFETY: x holds n floats.
    unsafe { dev.k.softcap(&dev.stream, &args)? };
    let got = dev.down(&xd)?;
    let worst = x.iter().zip(&got).fold(0f64, |w, (&v, &g)| w.max((g as f64 - (v as f64 / cap as f64).tanh() * cap as f64).abs() / (2e-6 * cap as f64)));
    Ok(Case { name: format!("softcap n={n} cap={cap}"), worst, bits: None, note: String::new() })
}

/// `turbo_encode` on `rows` random rows of `d` values (a few channels 20 times the rest, as keys
/// have, one row of zeros) against candle-nn's `kv_turbo::encode_row`: the bytes must be equal.
fn check_turbo(dev: &Dev, rng: &mut Rng, bits: u32, d: usize, rows: usize) -> Res<Case> {
    use candle_nn::attention::kv_turbo;
    let mut x = rng.vec(rows * d, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        if i % d % 37 == 5 {
            *v *= 20.0;
        }
        if i / d == rows - 1 && rows > 1 {
            *v = 0.0;
        }
    }
    let row_bytes = kv_turbo::row_bytes(bits, d);
    let mut want = vec![0u8; rows * row_bytes];
    for (r, o) in x.chunks_exact(d).zip(want.chunks_exact_mut(row_bytes)) {
        kv_turbo::encode_row(bits, r, o);
    }
    let mut levels = vec![0f32; 8 * 128];
    for w in 0..8u32 {
        let lv = kv_turbo::levels(w);
        levels[w as usize * 128..][..lv.len()].copy_from_slice(&lv);
    }
    let (xd, out) = (dev.up(&x)?, dev.zeros::<u8>(rows * row_bytes)?);
    let (steps, bounds, lv) = (dev.up(&kv_turbo::scale_steps()[..])?, dev.up(&kv_turbo::scale_bounds()[..])?, dev.up(&levels)?);
    let args = TurboArgs {
        x: dev.ptr(&xd),
        out: dev.ptr(&out),
        steps: dev.ptr(&steps),
        bounds: dev.ptr(&bounds),
        levels: dev.ptr(&lv),
        d: d as i32,
        bits: bits as i32,
        row_bytes: row_bytes as i32,
        sign_mask: (0..32).filter(|&i| kv_turbo::sign_negative(i)).fold(0u32, |m, i| m | 1 << i),
        inv_sqrt: 1.0 / (kv_turbo::GROUP as f32).sqrt(),
        search: kv_turbo::SCALE_SEARCH as i32,
    };
    // SAFETY: the buffers hold what TurboArgs describes.
    unsafe { dev.k.turbo_encode(&dev.stream, rows, &args)? };
    let got = dev.down(&out)?;
    let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    // Where: the first few differing bytes as row:byte got/want (bytes 0-1 the row scale, then a
    // byte per group, then the codes).
    let at: Vec<String> = got.iter().zip(&want).enumerate().filter(|(_, (a, b))| a != b).take(4).map(|(i, (a, b))| format!("{}:{} {a:#04x}/{b:#04x}", i / row_bytes, i % row_bytes)).collect();
    Ok(Case {
        name: format!("turbo_encode bits={bits} d={d} rows={rows}"),
        worst: if differ == 0 { 0.0 } else { 1.0 + differ as f64 },
        bits: Some(differ == 0),
        note: if differ == 0 { String::new() } else { format!("{differ} of {} bytes differ from the CPU's ({})", want.len(), at.join(", ")) },
    })
}

/// `moe_router` against float64: `rows` rows of `k` values routed over `experts` experts,
/// `used` of them a row, with the shared expert's gate (qwen35moe's) when `shared` (Gemma 4 has
/// none). Ids must match (unless the reference's probabilities tie within 1e-6 at the cut),
/// weights within 1e-5, the gate within 1e-6.
fn check_moe_router(dev: &Dev, rng: &mut Rng, rows: usize, k: usize, experts: usize, used: usize, shared: bool) -> Res<Case> {
    let x = rng.vec(rows * k, 1.0);
    let router = rng.vec(experts * k, 0.3);
    let sg = rng.vec(k, 0.3);
    let (xd, rd, sd) = (dev.up(&x)?, dev.up(&router)?, dev.up(&sg)?);
    let (ids, wts, sgate) = (dev.zeros::<i32>(rows * used)?, dev.zeros::<f32>(rows * used)?, dev.zeros::<f32>(rows)?);
    let logits = dev.zeros::<f32>(rows * (experts + 1))?;
    let args = MoeRouterArgs {
        x: dev.ptr(&xd),
        router: dev.ptr(&rd),
        shared_gate: if shared { dev.ptr(&sd) } else { 0 },
        ids: dev.ptr(&ids),
        wts: dev.ptr(&wts),
        sgate: dev.ptr(&sgate),
        logits: dev.ptr(&logits),
        k: k as i32,
        n_expert: experts as i32,
        used: used as i32,
        pad_: 0,
    };
    let route = |n: usize| -> Res<()> {
        // SAFETY: the buffers hold what MoeRouterArgs describes for `n` <= `rows` rows.
        unsafe {
            dev.k.moe_logits(&dev.stream, n, &args)?;
            dev.k.moe_router(&dev.stream, n, &args)?;
        }
        Ok(())
    };
    // Row 0 routed alone, then every row: row 0's result must not change.
    route(1)?;
    let (i1, w1, s1) = (dev.down(&ids)?, dev.down(&wts)?, dev.down(&sgate)?);
    route(rows)?;
    let (gi, gw, gs) = (dev.down(&ids)?, dev.down(&wts)?, dev.down(&sgate)?);
    let alone = i1[..used] == gi[..used] && w1[..used].iter().zip(&gw).all(|(a, b)| a.to_bits() == b.to_bits()) && s1[0].to_bits() == gs[0].to_bits();
    let reps = 50;
    let start = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    for _ in 0..reps {
        route(rows)?;
    }
    let end = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    let us = start.elapsed_ms(&end)? as f64 * 1e3 / reps as f64;
    let mut worst = 0f64;
    let mut note = String::new();
    for m in 0..rows {
        let xr = &x[m * k..(m + 1) * k];
        let logits: Vec<f64> = (0..experts).map(|e| xr.iter().zip(&router[e * k..(e + 1) * k]).map(|(a, b)| *a as f64 * *b as f64).sum()).collect();
        let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let ex: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
        let tot: f64 = ex.iter().sum();
        let p: Vec<f64> = ex.iter().map(|v| v / tot).collect();
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let tie = used < experts && (p[order[used - 1]] - p[order[used]]).abs() < 1e-6;
        let sum: f64 = order[..used].iter().map(|&e| p[e]).sum();
        for j in 0..used {
            let (e, got_e) = (order[j], gi[m * used + j] as usize);
            if got_e != e && !tie {
                worst = worst.max(1e3);
                note = format!("row {m} pick {j}: expert {got_e}, want {e}");
            }
            worst = worst.max((gw[m * used + j] as f64 - p[e] / sum).abs() / 1e-5);
        }
        if shared {
            let g = 1.0 / (1.0 + (-xr.iter().zip(&sg).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()).exp());
            worst = worst.max((gs[m] as f64 - g).abs() / 1e-6);
        } else if gs[m] != 0.0 {
            worst = worst.max(1e3);
            note = format!("row {m}: a shared gate of {} written without one", gs[m]);
        }
    }
    Ok(Case { name: format!("moe_router rows={rows} k={k} {used} of {experts} experts{} ({us:.1} us)", if shared { " shared gate" } else { "" }), worst, bits: Some(alone), note })
}

/// `gemv_moe` against float64: `pairs` (row, expert) pairs over `experts` stacked experts of `n`
/// rows of `k` values (type `t`, the wide layout), gate and up with SiLU (`glu` 2, qwen35moe's)
/// or GELU (`glu` 1, Gemma 4's) when `glu` is not 0; `act_pair`:
/// each pair its own activation row (the down projection), else row `q / used`. Also: a pair's
/// output equals the same expert's one-row `gemv_wide` bit for bit.
#[allow(clippy::too_many_arguments)]
fn check_gemv_moe(dev: &Dev, rng: &mut Rng, t: WeightType, experts: usize, n: usize, k: usize, glu_act: i32, used: usize, act_rows: usize, act_pair: bool) -> Res<Case> {
    let glu = glu_act != 0;
    let pairs = if act_pair { act_rows } else { act_rows * used };
    let f = GemvFixture::with_layout(dev, rng, t, experts * n, k, glu, act_rows, Layout::Wide)?;
    let ids: Vec<i32> = (0..pairs).map(|q| ((q * 7 + 3 + (rng.f().abs() * 1000.0) as usize) % experts) as i32).collect();
    let (idd, out) = (dev.up(&ids)?, dev.zeros::<f32>(pairs * n)?);
    let seg = GemvSeg { w: dev.ptr(&f.w), w2: if glu { dev.ptr(&f.w2) } else { 0 }, out: dev.ptr(&out), n: n as i32, wtype: t.ggml_id(), out_stride: n as i32, glu: glu_act, block_start: 0, wide: 1 };
    let act = (dev.ptr(&f.act.0), dev.ptr(&f.act.1), dev.ptr(&f.act.2));
    let act_fn: fn(f64) -> f64 = if glu_act == 1 { reference::gelu_tanh } else { reference::silu };
    // SAFETY: the weights stack `experts` matrices of n rows of k values, the ids are below
    // `experts`, the activations hold act_rows rows, out pairs rows of n.
    unsafe { dev.k.gemv_moe(&dev.stream, pairs, k, seg, act, dev.ptr(&idd), n * t.wide_row_bytes(k), used, act_pair)? };
    let got = dev.down(&out)?;
    let total = experts * n;
    let mut worst = 0f64;
    for q in 0..pairs {
        let (e, row) = (ids[q] as usize, if act_pair { q } else { q / used });
        for r in 0..n {
            let (want, tol) = f.want_with(row * total + e * n + r, act_fn);
            worst = worst.max((got[q * n + r] as f64 - want).abs() / tol);
        }
    }
    // The first pair (activation row 0) against gemv_wide at M = 1 over its expert's rows.
    let e0 = ids[0] as usize;
    let one = dev.zeros::<f32>(n)?;
    let eb = (n * t.wide_row_bytes(k)) as u64;
    let s1 = GemvSeg { w: dev.ptr(&f.w) + e0 as u64 * eb, w2: if glu { dev.ptr(&f.w2) + e0 as u64 * eb } else { 0 }, out: dev.ptr(&one), ..seg };
    // SAFETY: one expert's n rows, activation row 0, n outputs.
    unsafe { dev.k.gemv(&dev.stream, 1, k, &[s1], act)? };
    let single = dev.down(&one)?;
    let same = single.iter().zip(&got[..n]).all(|(a, b)| a.to_bits() == b.to_bits());
    Ok(Case {
        name: format!("gemv_moe {t:?} {experts} experts n={n} k={k}{} {pairs} pairs{}", ["", " gelu glu", " silu glu"][glu_act as usize], if act_pair { " (own rows)" } else { "" }),
        worst,
        bits: Some(same),
        note: String::new(),
    })
}

/// A prompt step's experts as one GEMM per expert (`moe_sort`, then `mmq_moe`) against float64
/// and against `gemv_moe` over the same pairs (to the same tolerance: the prompt GEMM sums in
/// another order): `rows` rows picking `used` distinct experts each of `experts` stacked experts
/// of `n` rows of `k` values; `act_pair` as for [`check_gemv_moe`] (the down projection: each
/// pair its own activation row).
#[allow(clippy::too_many_arguments)]
fn check_mmq_moe(dev: &Dev, rng: &mut Rng, t: WeightType, experts: usize, n: usize, k: usize, glu_act: i32, used: usize, rows: usize, act_pair: bool) -> Res<Case> {
    let glu = glu_act != 0;
    let pairs = rows * used;
    let act_rows = if act_pair { pairs } else { rows };
    let f = GemvFixture::with_layout(dev, rng, t, experts * n, k, glu, act_rows, Layout::Wide)?;
    // Each row's experts: `used` distinct ones, skewed toward the low ids so that some experts
    // get many pairs (more than one tile of 64) and some none.
    let mut ids = Vec::with_capacity(pairs);
    for _ in 0..rows {
        let mut picked: Vec<i32> = Vec::with_capacity(used);
        while picked.len() < used {
            let r = rng.f().abs();
            let e = ((r * r * experts as f32) as usize).min(experts - 1) as i32;
            if !picked.contains(&e) {
                picked.push(e);
            }
        }
        ids.extend(picked);
    }
    let (idd, out, ref_out) = (dev.up(&ids)?, dev.zeros::<f32>(pairs * n)?, dev.zeros::<f32>(pairs * n)?);
    let (list, counts) = (dev.zeros::<i32>(experts * rows)?, dev.zeros::<i32>(experts)?);
    let seg = GemvSeg { w: dev.ptr(&f.w), w2: if glu { dev.ptr(&f.w2) } else { 0 }, out: dev.ptr(&out), n: n as i32, wtype: t.ggml_id(), out_stride: n as i32, glu: glu_act, block_start: 0, wide: 1 };
    let act = (dev.ptr(&f.act.0), dev.ptr(&f.act.1), dev.ptr(&f.act.2));
    let eb = n * t.wide_row_bytes(k);
    // SAFETY: the weights stack `experts` matrices of n rows of k values, the ids are below
    // `experts` and distinct within a row (at most `rows` pairs an expert), the activations hold
    // act_rows rows, out and ref_out pairs rows of n, the lists experts x rows.
    unsafe {
        dev.k.moe_sort(&dev.stream, pairs, experts, rows, dev.ptr(&idd), dev.ptr(&list), dev.ptr(&counts))?;
        dev.k.mmq_moe(&dev.stream, experts, rows, k, seg, act, (dev.ptr(&list), dev.ptr(&counts)), eb, if act_pair { 1 } else { used })?;
        dev.k.gemv_moe(&dev.stream, pairs, k, GemvSeg { out: dev.ptr(&ref_out), ..seg }, act, dev.ptr(&idd), eb, used, act_pair)?;
    }
    let (got, per_pair) = (dev.down(&out)?, dev.down(&ref_out)?);
    let cnt = dev.down(&counts)?;
    let total = experts * n;
    let mut worst = 0f64;
    for q in 0..pairs {
        let (e, row) = (ids[q] as usize, if act_pair { q } else { q / used });
        for r in 0..n {
            let act_fn: fn(f64) -> f64 = if glu_act == 1 { reference::gelu_tanh } else { reference::silu };
            let (want, tol) = f.want_with(row * total + e * n + r, act_fn);
            worst = worst.max((got[q * n + r] as f64 - want).abs() / tol);
            worst = worst.max((got[q * n + r] as f64 - per_pair[q * n + r] as f64).abs() / tol);
        }
    }
    let most = cnt.iter().copied().max().unwrap_or(0);
    let listed: i32 = cnt.iter().sum();
    let note = if listed as usize != pairs { format!("the lists hold {listed} pairs of {pairs}") } else { String::new() };
    if !note.is_empty() {
        worst = worst.max(1e3);
    }
    Ok(Case {
        name: format!(
            "mmq_moe {t:?} {experts} experts n={n} k={k}{} {rows} rows x {used} (busiest expert {most} pairs){}",
            ["", " gelu glu", " silu glu"][glu_act as usize],
            if act_pair { " (own rows)" } else { "" }
        ),
        worst,
        bits: None,
        note,
    })
}

/// `moe_combine` against float64; `escale`: each pick's weight times its expert's output scale
/// (Gemma 4's), over 32 experts.
fn check_moe_combine(dev: &Dev, rng: &mut Rng, rows: usize, k: usize, used: usize, shared: bool, escale: bool) -> Res<Case> {
    let y = rng.vec(rows * used * k, 2.0);
    let mut w = rng.vec(rows * used, 1.0);
    let sh = rng.vec(rows * k, 2.0);
    let sg = rng.vec(rows, 1.0);
    let ids: Vec<i32> = (0..rows * used).map(|q| ((q * 13 + 5) % 32) as i32).collect();
    let sc = rng.vec(32, 2.0);
    let (yd, wd, shd, sgd, out) = (dev.up(&y)?, dev.up(&w)?, dev.up(&sh)?, dev.up(&sg)?, dev.zeros::<f32>(rows * k)?);
    let (idd, scd) = (dev.up(&ids)?, dev.up(&sc)?);
    let args = MoeCombineArgs {
        y: dev.ptr(&yd),
        wts: dev.ptr(&wd),
        shared: if shared { dev.ptr(&shd) } else { 0 },
        sgate: dev.ptr(&sgd),
        out: dev.ptr(&out),
        k: k as i32,
        used: used as i32,
        ids: dev.ptr(&idd),
        escale: if escale { dev.ptr(&scd) } else { 0 },
    };
    if escale {
        // The reference forms each pick's factor as the kernel (and candle) does: in f32.
        for (wq, &e) in w.iter_mut().zip(&ids) {
            *wq *= sc[e as usize];
        }
    }
    // SAFETY: the buffers hold what MoeCombineArgs describes for `rows` rows.
    unsafe { dev.k.moe_combine(&dev.stream, rows, &args)? };
    let got = dev.down(&out)?;
    let mut worst = 0f64;
    for m in 0..rows {
        for i in 0..k {
            let mut want = 0f64;
            let mut mag = 0f64;
            for j in 0..used {
                let v = w[m * used + j] as f64 * y[(m * used + j) * k + i] as f64;
                want += v;
                mag += v.abs();
            }
            if shared {
                let v = sg[m] as f64 * sh[m * k + i] as f64;
                want += v;
                mag += v.abs();
            }
            worst = worst.max((got[m * k + i] as f64 - want).abs() / (1e-6 * mag + 1e-7));
        }
    }
    Ok(Case { name: format!("moe_combine rows={rows} k={k} used={used}{}{}", if shared { " shared" } else { "" }, if escale { " scaled" } else { "" }), worst, bits: None, note: String::new() })
}

/// A batched step's rows from several sequences (issue 50): `qk_norm_rope_kv` and the decode
/// attention over a [`SeqRow`] table, the sequences' caches slots of one pool per layer. The rows
/// (several sequences, one to four rows each, in no order of slot or position) go through one
/// launch of each kernel; each sequence's rows then through their own launches on its slot's
/// caches, as the one-sequence step runs them. Bit for bit the same: the queries, the K/V rows
/// written into the pool, the attention's output.
#[allow(clippy::too_many_arguments)]
fn check_seq_rows(dev: &Dev, rng: &mut Rng, n_head: usize, n_kv: usize, hd: usize, ctx: usize, window: usize, types: KvTypes) -> Res<Case> {
    // (slot, first position, rows) of each sequence in the step, in the step's row order.
    let seqs = [(2usize, ctx - 9, 1usize), (0, 37, 3), (3, 5, 1), (1, 700.min(ctx - 20), 4), (4, 0, 2), (5, ctx / 2 + 3, 1)];
    let slots = 6usize;
    let rows: usize = seqs.iter().map(|s| s.2).sum();
    let mut table = Vec::with_capacity(rows);
    // The same rows naming entries of a kv_slots table (sequence e's entry e: its slot's caches
    // as if they were allocations of their own) instead of slots of the pool.
    let mut table_e = Vec::with_capacity(rows);
    for (e, &(slot, first, n)) in seqs.iter().enumerate() {
        for j in 0..n {
            table.push(SeqRow { pos: (first + j) as i32, slot: slot as i32, first: first as i32, ..Default::default() });
            table_e.push(SeqRow { pos: (first + j) as i32, slot: e as i32, first: first as i32, ..Default::default() });
        }
    }
    let width = n_head * hd;
    let q = rng.vec(rows * width, 2.0);
    let (kx, vx) = (rng.vec(rows * n_kv * hd, 2.0), rng.vec(rows * n_kv * hd, 2.0));
    let qn: Vec<f32> = rng.vec(hd, 0.5).iter().map(|x| 1.0 + x).collect();
    let kn: Vec<f32> = rng.vec(hd, 0.5).iter().map(|x| 1.0 + x).collect();
    let inv = reference::inv_freq(hd, 1e4);
    let (qnd, knd, invd, kd, vd) = (dev.up(&qn)?, dev.up(&kn)?, dev.up(&inv)?, dev.up(&kx)?, dev.up(&vx)?);
    // The pools start with the same random keys and values (earlier positions).
    let (kpool, _) = typed_cache(dev, &rng.vec(slots * n_kv * ctx * hd, 1.0), types.k, hd)?;
    let (vpool, _) = typed_cache(dev, &rng.vec(slots * n_kv * ctx * hd, 1.0), types.v, hd)?;
    let (kbytes, vbytes) = (dev.down(&kpool)?, dev.down(&vpool)?);
    let (kslot, vslot) = ((n_kv * ctx * types.k.row_bytes(hd)) as u64, (n_kv * ctx * types.v.row_bytes(hd)) as u64);
    let chunks_max = Kernels::attn_chunks_max(ctx, window);
    let (tab, tab_e) = (dev.up(&table)?, dev.up(&table_e)?);
    let mut step = dev.up(&[StepParams::default()])?;
    // Pass 0: the whole step in one launch of each kernel; 1: each sequence's rows on their own;
    // 2: the whole step through a kv_slots table.
    let mut results = Vec::new();
    for pass in 0..3 {
        let (kp, vp) = (dev.up(&kbytes)?, dev.up(&vbytes)?);
        let slot_ptrs: Vec<u64> = seqs.iter().flat_map(|&(slot, _, _)| [dev.ptr(&kp) + slot as u64 * kslot, dev.ptr(&vp) + slot as u64 * vslot]).collect();
        let slot_tab = dev.up(&slot_ptrs)?;
        let kv_slots = if pass == 2 { dev.ptr(&slot_tab) } else { 0 };
        let qd = dev.up(&q)?;
        let out = dev.zeros::<f32>(rows * width)?;
        let partials = dev.zeros::<f32>(rows * n_head * chunks_max * (hd + 2))?;
        let counters = dev.zeros::<i32>(rows * n_head)?;
        let (aqs, aqd, aqsum) = (dev.zeros::<i8>(rows * width)?, dev.zeros::<f32>(rows * width / QK)?, dev.zeros::<i32>(rows * width / QK)?);
        let stage = dev.zeros::<f32>(rows * n_kv * 2 * hd)?;
        let launch = |step: &mut CudaSlice<StepParams>, row0: usize, n: usize, sp: StepParams, slot: u64| -> Res<()> {
            dev.set_step(step, sp)?;
            let r = row0 as u64;
            let ra = RopeArgs {
                q: dev.ptr(&qd) + r * (width * 4) as u64,
                k: dev.ptr(&kd) + r * (n_kv * hd * 4) as u64,
                v: dev.ptr(&vd) + r * (n_kv * hd * 4) as u64,
                q_norm: dev.ptr(&qnd),
                k_norm: dev.ptr(&knd),
                eps: 1e-6,
                inv_freq: dev.ptr(&invd),
                q_scale: 1.0 / (hd as f32).sqrt(),
                k_cache: dev.ptr(&kp) + slot * kslot,
                v_cache: dev.ptr(&vp) + slot * vslot,
                ctx: ctx as i32,
                step: dev.ptr(step),
                n_head: n_head as i32,
                n_kv: n_kv as i32,
                hd: hd as i32,
                n_rot: 0,
                v_norm: 0,
                v_from_k: 0,
                k_type: types.k.kernel_id(),
                v_type: types.v.kernel_id(),
                kv_slots,
                stage: dev.ptr(&stage),
                turbo: dev.k.turbo_tab(&dev.stream),
            };
            let aa = AttnArgs {
                q: dev.ptr(&qd) + r * (width * 4) as u64,
                k_cache: dev.ptr(&kp) + slot * kslot,
                v_cache: dev.ptr(&vp) + slot * vslot,
                out: dev.ptr(&out) + r * (width * 4) as u64,
                partials: dev.ptr(&partials),
                counters: dev.ptr(&counters),
                step: dev.ptr(step),
                qs: dev.ptr(&aqs) + r * width as u64,
                qd: dev.ptr(&aqd) + r * (width / QK * 4) as u64,
                qsum: dev.ptr(&aqsum) + r * (width / QK * 4) as u64,
                ctx: ctx as i32,
                window: window as i32,
                n_head: n_head as i32,
                n_kv: n_kv as i32,
                chunks_max: chunks_max as i32,
                gate: 0,
                k_type: types.k.kernel_id(),
                v_type: types.v.kernel_id(),
                kv_slots,
                turbo: dev.k.turbo_tab(&dev.stream),
            };
            // SAFETY: q/k/v/out and the Q8 planes hold `rows` rows (row0 + n <= rows), the pools
            // `slots` slots of ctx positions (every row's position below ctx), the partials and
            // counters `rows` rows.
            unsafe {
                dev.k.qk_norm_rope_kv(&dev.stream, n, &ra)?;
                dev.k.attention(&dev.stream, n, hd, &aa)?;
            }
            Ok(())
        };
        if pass == 0 {
            launch(&mut step, 0, rows, StepParams { pos: 0, rows: rows as i32, seq_rows: dev.ptr(&tab), ..Default::default() }, 0)?;
        } else if pass == 2 {
            launch(&mut step, 0, rows, StepParams { pos: 0, rows: rows as i32, seq_rows: dev.ptr(&tab_e), ..Default::default() }, 0)?;
        } else {
            let mut row0 = 0;
            for &(slot, first, n) in &seqs {
                launch(&mut step, row0, n, StepParams { pos: first as i32, rows: n as i32, ..Default::default() }, slot as u64)?;
                row0 += n;
            }
        }
        results.push((dev.down(&qd)?, dev.down(&kp)?, dev.down(&vp)?, dev.down(&out)?, dev.down(&counters)?));
    }
    let (a, b, c) = (&results[0], &results[1], &results[2]);
    let same_f = |x: &[f32], y: &[f32]| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
    type Pass = (Vec<f32>, Vec<u8>, Vec<u8>, Vec<f32>, Vec<i32>);
    let same = |a: &Pass, b: &Pass| same_f(&a.0, &b.0) && a.1 == b.1 && a.2 == b.2 && same_f(&a.3, &b.3);
    let bits = same(a, b) && same(c, b);
    let mut note = String::new();
    if a.4.iter().chain(&b.4).chain(&c.4).any(|&c| c != 0) {
        note.push_str("counters not left at zero");
    }
    // The step wrote each row's K/V (the pool changed where the rows are).
    if a.1 == kbytes {
        note.push_str(" no K rows written");
    }
    Ok(Case {
        name: format!("seq rows: rope + attention (pool and kv_slots), {} sequences, {rows} rows, heads={n_head}/{n_kv} hd={hd} ctx={ctx} window={window}{}", seqs.len(), types_label(types)),
        worst: 0.0,
        bits: Some(bits),
        note,
    })
}

/// Attention for rows at pos..pos+M over a random cache; with `gated`, the output times
/// `sigmoid(gate)` (Qwen3.5's gated attention).
#[allow(clippy::too_many_arguments)]
fn check_attention(dev: &Dev, rng: &mut Rng, n_head: usize, n_kv: usize, hd: usize, ctx: usize, window: usize, pos: usize, gated: bool, types: KvTypes) -> Res<Case> {
    let rows = MAX_ROWS.min(ctx - pos);
    let (kd, kc) = typed_cache(dev, &rng.vec(n_kv * ctx * hd, 1.0), types.k, hd)?;
    let (vd, vc) = typed_cache(dev, &rng.vec(n_kv * ctx * hd, 1.0), types.v, hd)?;
    let q = rng.vec(rows * n_head * hd, 3.0 / (hd as f32).sqrt());
    let gate = rng.vec(rows * n_head * hd, 4.0);
    let gd = dev.up(&gate)?;
    let chunks_max = Kernels::attn_chunks_max(ctx, window);
    let qd = dev.up(&q)?;
    let out = dev.zeros::<f32>(rows * n_head * hd)?;
    let partials = dev.zeros::<f32>(rows * n_head * chunks_max * (hd + 2))?;
    let counters = dev.zeros::<i32>(MAX_ROWS * n_head)?;
    let mut step = dev.up(&[StepParams::default()])?;
    let width = n_head * hd;
    let (aqs, aqd, aqsum) = (dev.zeros::<i8>(rows * width)?, dev.zeros::<f32>(rows * width / QK)?, dev.zeros::<i32>(rows * width / QK)?);
    // The output of rows row0.., and whether its Q8 planes are the f32 output quantized as the
    // CPU quantizer does it, bit for bit.
    let mut run = |row0: usize, n_rows: usize| -> Res<(Vec<f32>, bool)> {
        dev.set_step(&mut step, StepParams { pos: (pos + row0) as i32, rows: n_rows as i32, ..Default::default() })?;
        let args = AttnArgs {
            q: dev.ptr(&qd) + (row0 * width * 4) as u64,
            k_cache: dev.ptr(&kd),
            v_cache: dev.ptr(&vd),
            out: dev.ptr(&out),
            partials: dev.ptr(&partials),
            counters: dev.ptr(&counters),
            step: dev.ptr(&step),
            qs: dev.ptr(&aqs),
            qd: dev.ptr(&aqd),
            qsum: dev.ptr(&aqsum),
            ctx: ctx as i32,
            window: window as i32,
            n_head: n_head as i32,
            n_kv: n_kv as i32,
            chunks_max: chunks_max as i32,
            gate: if gated { dev.ptr(&gd) + (row0 * width * 4) as u64 } else { 0 },
            k_type: types.k.kernel_id(),
            v_type: types.v.kernel_id(),
            kv_slots: 0,
            turbo: dev.k.turbo_tab(&dev.stream),
        };
        // SAFETY: q (and the gate) hold `rows` rows, the caches ctx positions (pos + rows <= ctx), the
        // partials `rows` rows of chunks_max chunks, the counters MAX_ROWS * n_head zeroed ints,
        // the Q8 planes `rows` rows of n_head * hd values.
        unsafe { dev.k.attention(&dev.stream, n_rows, hd, &args)? };
        let mut v = dev.down(&out)?;
        v.truncate(n_rows * width);
        let want = ActQ8::quantize(&v, n_rows, width);
        let (gq, gd, gs) = (dev.down(&aqs)?, dev.down(&aqd)?, dev.down(&aqsum)?);
        let q8 = gq[..n_rows * width] == want.qs[..] && gd[..n_rows * width / QK].iter().zip(&want.d).all(|(a, b)| a.to_bits() == b.to_bits()) && gs[..n_rows * width / QK] == want.sum[..];
        Ok((v, q8))
    };
    let singles: Vec<Vec<f32>> = (0..rows).map(|m| run(m, 1).map(|r| r.0)).collect::<Res<_>>()?;
    let mut worst = 0f64;
    let mut bits = true;
    let mut q8_all = true;
    let vmax = vc.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
    for n_rows in 1..=rows {
        let (got, q8) = run(0, n_rows)?;
        q8_all &= q8;
        for m in 0..n_rows {
            let qm: Vec<f64> = q[m * n_head * hd..(m + 1) * n_head * hd].iter().map(|&x| x as f64).collect();
            let want = reference::attention(&qm, &kc, &vc, ctx, n_head, n_kv, hd, pos + m, window);
            for (i, w) in want.iter().enumerate() {
                let w = if gated { w / (1.0 + (-(gate[m * n_head * hd + i] as f64)).exp()) } else { *w };
                let g = got[m * n_head * hd + i];
                worst = worst.max((g as f64 - w).abs() / (turbo_tol(types) * vmax + 1e-7));
                bits &= g.to_bits() == singles[m][i].to_bits();
            }
        }
    }
    let counters_left = dev.down(&counters)?;
    let mut note = if counters_left.iter().any(|&c| c != 0) { "counters not left at zero".to_string() } else { String::new() };
    if !q8_all {
        note.push_str(" Q8 output differs from the f32 output quantized");
    }
    Ok(Case { name: format!("attention heads={n_head}/{n_kv} hd={hd} ctx={ctx} window={window} pos={pos}{}{}", if gated { " gated" } else { "" }, types_label(types)), worst, bits: Some(bits), note })
}

/// One query at `pos` over the keys below `kv_end` (the step's `kv_end`; `pos >= kv_end`, the
/// window counted from `pos`) against float64: an assistant head's attention over the target's
/// cache.
#[allow(clippy::too_many_arguments)]
fn check_attention_kv_end(dev: &Dev, rng: &mut Rng, n_head: usize, n_kv: usize, hd: usize, ctx: usize, window: usize, kv_end: usize, pos: usize) -> Res<Case> {
    let kc = rng.vec(n_kv * ctx * hd, 1.0);
    let vc = rng.vec(n_kv * ctx * hd, 1.0);
    let q = rng.vec(n_head * hd, 3.0 / (hd as f32).sqrt());
    let chunks_max = Kernels::attn_chunks_max(ctx, window);
    let (kd, vd, qd) = (dev.up(&kc)?, dev.up(&vc)?, dev.up(&q)?);
    let out = dev.zeros::<f32>(n_head * hd)?;
    let partials = dev.zeros::<f32>(n_head * chunks_max * (hd + 2))?;
    let counters = dev.zeros::<i32>(MAX_ROWS * n_head)?;
    let step = dev.up(&[StepParams { pos: pos as i32, rows: 1, kv_end: kv_end as i32, ..Default::default() }])?;
    let args = AttnArgs {
        q: dev.ptr(&qd),
        k_cache: dev.ptr(&kd),
        v_cache: dev.ptr(&vd),
        out: dev.ptr(&out),
        partials: dev.ptr(&partials),
        counters: dev.ptr(&counters),
        step: dev.ptr(&step),
        ctx: ctx as i32,
        window: window as i32,
        n_head: n_head as i32,
        n_kv: n_kv as i32,
        chunks_max: chunks_max as i32,
        gate: 0,
        ..Default::default()
    };
    // SAFETY: q holds one row, the caches ctx positions (kv_end <= pos < ctx), the partials one
    // row of chunks_max chunks, the counters MAX_ROWS * n_head zeroed ints; no Q8 output.
    unsafe { dev.k.attention(&dev.stream, 1, hd, &args)? };
    let got = dev.down(&out)?;
    // Keys [max(0, pos + 1 - window), kv_end): the reference's window ending at kv_end - 1.
    let lo = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
    let w = if lo == 0 { 0 } else { kv_end - lo };
    let qf: Vec<f64> = q.iter().map(|&x| x as f64).collect();
    let want = reference::attention(&qf, &kc, &vc, ctx, n_head, n_kv, hd, kv_end - 1, w);
    let vmax = vc.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
    let worst = got.iter().zip(&want).fold(0f64, |x, (g, w)| x.max((*g as f64 - w).abs() / (2e-6 * vmax + 1e-7)));
    let note = if dev.down(&counters)?.iter().any(|&c| c != 0) { "counters not left at zero".to_string() } else { String::new() };
    Ok(Case { name: format!("attention past the cache: heads={n_head}/{n_kv} hd={hd} window={window} keys below {kv_end}, query at {pos}"), worst, bits: None, note })
}

/// The k best logits of each row against a full sort by the sampler's order (`total_cmp`
/// descending, ties to the lower id), the banned ids left out: the same ids and bits.
/// With `mixed`, the step has a row table whose odd rows opt out of the banned ids
/// ([`SeqRow::no_ban`]: a batch's requests without `ignore_eos`), and the launch reads rows
/// `1..` of it (`row0` 1).
fn check_topk(dev: &Dev, rng: &mut Rng, n: usize, k: usize, rows: usize, coarse: bool, mixed: bool) -> Res<Case> {
    // Coarse values make ties common (at the cut too); -0.0 and 0.0 are distinct in the order.
    let logits: Vec<f32> = (0..rows * n).map(|_| if coarse { ((rng.next() % 32) as f32 - 16.0) * 0.5 } else { rng.f() * 20.0 }).collect();
    let mut logits = logits;
    for m in 0..rows {
        logits[m * n + (rng.next() as usize) % n] = -0.0;
        logits[m * n + (rng.next() as usize) % n] = 0.0;
    }
    let banned: Vec<i32> = (0..3).map(|_| (rng.next() as usize % n) as i32).collect();
    // Row m of the launch is row m + 1 of the table; banned where (m + 1) is even.
    let table: Vec<SeqRow> = (0..rows + 1).map(|r| SeqRow { pos: r as i32, no_ban: (r % 2) as i32, ..Default::default() }).collect();
    let tab = dev.up(&table)?;
    let mut params = StepParams { n_banned: banned.len() as i32, seq_rows: if mixed { dev.ptr(&tab) } else { 0 }, ..Default::default() };
    params.banned[..banned.len()].copy_from_slice(&banned);
    let step = dev.up(&[params])?;
    let bans = |m: usize| !mixed || (m + 1).is_multiple_of(2);
    let ld = dev.up(&logits)?;
    let cand = dev.zeros::<u64>(rows * Kernels::topk_blocks(n) * TOPK_MAX)?;
    let counters = dev.zeros::<i32>(MAX_ROWS)?;
    let (ids, vals) = (dev.zeros::<i32>(rows * k)?, dev.zeros::<f32>(rows * k)?);
    let args = TopKArgs {
        logits: dev.ptr(&ld),
        n: n as i32,
        k: k as i32,
        cand: dev.ptr(&cand),
        counters: dev.ptr(&counters),
        ids: dev.ptr(&ids),
        vals: dev.ptr(&vals),
        step: dev.ptr(&step),
        row0: mixed as i32,
        pad: 0,
    };
    // SAFETY: the logits hold rows x n values, the scratch rows x blocks x TOPK_MAX keys, the
    // outputs rows x k, the counters MAX_ROWS zeroed ints.
    unsafe { dev.k.top_k(&dev.stream, rows, &args)? };
    let (gi, gv) = (dev.down(&ids)?, dev.down(&vals)?);
    let mut same = true;
    for m in 0..rows {
        let mut want: Vec<(i32, f32)> = (0..n).filter(|i| !bans(m) || !banned.contains(&(*i as i32))).map(|i| (i as i32, logits[m * n + i])).collect();
        want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        want.resize(k, (-1, 0.0));
        for (j, w) in want.iter().enumerate() {
            same &= gi[m * k + j] == w.0 && (w.0 < 0 || gv[m * k + j].to_bits() == w.1.to_bits());
        }
    }
    let note = if dev.down(&counters)?.iter().any(|&c| c != 0) { "counters not left at zero".to_string() } else { String::new() };
    Ok(Case {
        name: format!("top_k n={n} k={k} rows={rows}{}{}", if coarse { " ties" } else { "" }, if mixed { ", per-row bans" } else { "" }),
        worst: if same { 0.0 } else { f64::INFINITY },
        bits: Some(same),
        note,
    })
}

/// Greedy argmax with planted ties.
fn check_argmax(dev: &Dev, rng: &mut Rng, n: usize) -> Res<Case> {
    let rows = MAX_ROWS;
    let mut logits = rng.vec(rows * n, 10.0);
    for m in 0..rows {
        // A tie of the maximum at two places (the later one first in some rows), and NaN-free.
        let (i, j) = ((rng.next() as usize) % n, (rng.next() as usize) % n);
        logits[m * n + i] = 20.0;
        logits[m * n + j] = 20.0;
        if m == 0 {
            logits[..n].iter_mut().for_each(|x| *x = -1.0); // all equal: id 0
        }
    }
    let (cv, ci) = (dev.zeros::<f32>(rows * ARGMAX_BLOCKS)?, dev.zeros::<i32>(rows * ARGMAX_BLOCKS)?);
    let (counters, ids) = (dev.zeros::<i32>(MAX_ROWS)?, dev.zeros::<i32>(MAX_ROWS)?);
    let feed = dev.up(&[StepParams::default()])?;
    // Banned ids: row 0's winner (id 0, so the next id wins) and, where n allows, a planted
    // maximum of the last row.
    let planted = n - 1;
    if n > 2 {
        logits[(rows - 1) * n + planted] = 30.0;
    }
    let ld = dev.up(&logits)?;
    let mut ban = StepParams::default();
    let banned: Vec<usize> = if n > 2 { vec![0, planted] } else { vec![0] };
    ban.n_banned = banned.len() as i32;
    for (slot, &b) in ban.banned.iter_mut().zip(&banned) {
        *slot = b as i32;
    }
    let ban_d = dev.up(&[ban])?;
    // The same bans through a row table whose odd rows opt out ([`SeqRow::no_ban`]).
    let table: Vec<SeqRow> = (0..rows).map(|m| SeqRow { pos: m as i32, no_ban: (m % 2) as i32, ..Default::default() }).collect();
    let tab = dev.up(&table)?;
    let ban_mixed = dev.up(&[StepParams { seq_rows: dev.ptr(&tab), ..ban }])?;
    let mut note = String::new();
    for mode in 0..3 {
        let with_ban = mode > 0;
        let args = ArgmaxArgs {
            logits: dev.ptr(&ld),
            n: n as i32,
            cand_v: dev.ptr(&cv),
            cand_i: dev.ptr(&ci),
            counters: dev.ptr(&counters),
            ids: dev.ptr(&ids),
            feed: dev.ptr(&feed),
            step: match mode {
                0 => 0,
                1 => dev.ptr(&ban_d),
                _ => dev.ptr(&ban_mixed),
            },
        };
        // SAFETY: logits hold `rows` rows of n, the candidates rows * ARGMAX_BLOCKS, the rest MAX_ROWS.
        unsafe { dev.k.argmax(&dev.stream, rows, &args)? };
        let (got, fed) = (dev.down(&ids)?, dev.down(&feed)?[0]);
        for m in 0..rows {
            let mut row = logits[m * n..(m + 1) * n].to_vec();
            if with_ban && !(mode == 2 && m % 2 == 1) {
                for &b in &banned {
                    row[b] = f32::NEG_INFINITY;
                }
            }
            let want = reference::argmax(&row) as i32;
            if got[m] != want || fed.tokens[m] != want {
                note = format!("row {m}{}: got {} (fed {}), want {want}", ["", " with banned ids", " with per-row bans"][mode], got[m], fed.tokens[m]);
            }
        }
    }
    if dev.down(&counters)?.iter().any(|&c| c != 0) {
        note.push_str(" counters not left at zero");
    }
    Ok(Case { name: format!("argmax n={n}"), worst: 0.0, bits: None, note })
}

/// One delta-net layer's kernels (`conv_silu`, `gated_delta_rule`, `gated_norm_quant`) over
/// `steps` successive steps of the given row counts (the rows of one sequence, the state carried
/// in planes from step to step), against the float64 reference row by row; and the same rows as
/// one-row steps, bit for bit (outputs and the state planes).
/// The delta-net's launches over steps of the given sizes against float64, and against one-row
/// steps bit for bit (outputs and the states the planes hold). With `fused`, steps of up to
/// MAX_ROWS rows run `conv_gated_delta_rule` (the one-row steps still run the two kernels, so the
/// bits also say the fused launch is the two launches).
fn check_gdn(dev: &Dev, rng: &mut Rng, dims: reference::GdnDims, steps: &[usize], fused: bool) -> Res<Case> {
    let reference::GdnDims { hk, hv, d, kernel } = dims;
    let c = dims.channels();
    let total: usize = steps.iter().sum();
    let planes = MAX_ROWS + 1;
    let eps = 1e-6f32;
    let x = rng.vec(total * c, 1.0);
    let z = rng.vec(total * hv * d, 2.0);
    let beta = rng.vec(total * hv, 2.0);
    let alpha = rng.vec(total * hv, 2.0);
    let conv_w = rng.vec(c * kernel, 0.7);
    let dt_bias = rng.vec(hv, 1.0);
    let a: Vec<f32> = rng.vec(hv, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
    let norm: Vec<f32> = rng.vec(d, 0.5).iter().map(|v| 1.0 + v).collect();
    // float64, row by row
    let mut st = reference::GdnState { window: vec![0.0; (kernel - 1) * c], s: vec![0.0; hv * d * d] };
    let (mut want_o, mut want_y) = (Vec::new(), Vec::new());
    let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    for r in 0..total {
        let (o, y) = reference::gdn_row(
            dims,
            &mut st,
            &conv_w,
            &f(&x[r * c..(r + 1) * c]),
            &f(&z[r * hv * d..(r + 1) * hv * d]),
            &f(&beta[r * hv..(r + 1) * hv]),
            &f(&alpha[r * hv..(r + 1) * hv]),
            &dt_bias,
            &a,
            &norm,
            eps as f64,
        );
        want_o.extend(o);
        want_y.extend(y);
    }
    let (xd, zd, bd, ad) = (dev.up(&x)?, dev.up(&z)?, dev.up(&beta)?, dev.up(&alpha)?);
    let (cwd, dtd, a_d, nd) = (dev.up(&conv_w)?, dev.up(&dt_bias)?, dev.up(&a)?, dev.up(&norm)?);
    let mut step = dev.up(&[StepParams::default()])?;
    // Runs the rows in steps of the given sizes: o (f32), y's Q8 planes, the conv and delta
    // state planes, the plane holding the last row's state.
    type Run = (Vec<f32>, ActQ8, Vec<f32>, Vec<f32>, usize);
    let mut run = |sizes: &[usize], fused: bool| -> Res<Run> {
        let conv_planes = dev.zeros::<f32>(planes * (kernel - 1) * c)?;
        let ssm_planes = dev.zeros::<f32>(planes * hv * d * d)?;
        let (yc, o) = (dev.zeros::<f32>(total * c)?, dev.zeros::<f32>(total * hv * d)?);
        let (qs, qd, qsum) = (dev.zeros::<i8>(total * hv * d)?, dev.zeros::<f32>(total * hv * d / QK)?, dev.zeros::<i32>(total * hv * d / QK)?);
        let (mut row0, mut plane) = (0usize, 0usize);
        for &rows in sizes {
            dev.set_step(&mut step, StepParams { pos: row0 as i32, rows: rows as i32, plane: plane as i32, ..Default::default() })?;
            let ca = ConvArgs {
                x: dev.ptr(&xd) + (row0 * c * 4) as u64,
                w: dev.ptr(&cwd),
                planes: dev.ptr(&conv_planes),
                y: dev.ptr(&yc) + (row0 * c * 4) as u64,
                step: dev.ptr(&step),
                c: c as i32,
                k: kernel as i32,
                n_planes: planes as i32,
                rows: rows as i32,
            };
            let ga = GdnArgs {
                qkv: dev.ptr(&yc) + (row0 * c * 4) as u64,
                alpha: dev.ptr(&ad) + (row0 * hv * 4) as u64,
                beta: dev.ptr(&bd) + (row0 * hv * 4) as u64,
                dt_bias: dev.ptr(&dtd),
                a: dev.ptr(&a_d),
                planes: dev.ptr(&ssm_planes),
                out: dev.ptr(&o) + (row0 * hv * d * 4) as u64,
                step: dev.ptr(&step),
                hk: hk as i32,
                hv: hv as i32,
                d: d as i32,
                n_planes: planes as i32,
                rows: rows as i32,
                eps,
                q_scale: 1.0 / (d as f32).sqrt(),
                pad_: 0,
            };
            let na = GatedNormArgs {
                o: dev.ptr(&o) + (row0 * hv * d * 4) as u64,
                z: dev.ptr(&zd) + (row0 * hv * d * 4) as u64,
                w: dev.ptr(&nd),
                qs: dev.ptr(&qs) + (row0 * hv * d) as u64,
                qd: dev.ptr(&qd) + (row0 * hv * d / QK * 4) as u64,
                qsum: dev.ptr(&qsum) + (row0 * hv * d / QK * 4) as u64,
                hv: hv as i32,
                d: d as i32,
                eps,
                pad_: 0,
            };
            // SAFETY: every buffer holds `total` rows (row0 + rows <= total), the planes `planes`
            // planes, and the step block's plane is below `planes`.
            unsafe {
                if fused && rows <= MAX_ROWS {
                    dev.k.conv_gated_delta_rule(&dev.stream, &ConvGdnArgs { conv: ca, gdn: ga, ent_rows: 0, ent_planes: 0 })?;
                } else {
                    dev.k.conv_silu(&dev.stream, &ca)?;
                    dev.k.gated_delta_rule(&dev.stream, &ga)?;
                }
                dev.k.gated_norm_quant(&dev.stream, rows, &na)?;
            }
            row0 += rows;
            plane = (plane + rows) % planes;
        }
        let act = ActQ8 { k: hv * d, rows: total, qs: dev.down(&qs)?, d: dev.down(&qd)?, sum: dev.down(&qsum)? };
        Ok((dev.down(&o)?, act, dev.down(&conv_planes)?, dev.down(&ssm_planes)?, plane))
    };
    let (o, act, convp, ssmp, plane) = run(steps, fused)?;
    let (o1, act1, convp1, ssmp1, plane1) = run(&vec![1; total], false)?;
    let mut worst = 0f64;
    let omax = want_o.iter().fold(0f64, |m, v| m.max(v.abs()));
    for (g, w) in o.iter().zip(&want_o) {
        worst = worst.max((*g as f64 - w).abs() / (2e-4 * omax + 1e-6));
    }
    // y through its Q8 rows: within half a quantization step of float64 (plus f32 rounding).
    let yq = act.dequantize();
    for (i, (g, w)) in yq.iter().zip(&want_y).enumerate() {
        let step_size = act.d[i / QK] as f64;
        worst = worst.max((g - w).abs() / (0.5 * step_size + 2e-3 * w.abs() + 1e-5));
    }
    // The final state (plane `plane`) against float64; the device keeps S transposed.
    let sz = hv * d * d;
    let mut smax = 0f64;
    st.s.iter().for_each(|v| smax = smax.max(v.abs()));
    for h in 0..hv {
        for j in 0..d {
            for i in 0..d {
                let g = ssmp[plane * sz + (h * d + j) * d + i] as f64;
                worst = worst.max((g - st.s[(h * d + i) * d + j]).abs() / (2e-4 * smax + 1e-6));
            }
        }
    }
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let cz = (kernel - 1) * c;
    let bits = plane == plane1
        && same(&o, &o1)
        && act == act1
        && same(&convp[plane * cz..(plane + 1) * cz], &convp1[plane1 * cz..(plane1 + 1) * cz])
        && same(&ssmp[plane * sz..(plane + 1) * sz], &ssmp1[plane1 * sz..(plane1 + 1) * sz]);
    let how = if fused { ", conv fused" } else { "" };
    Ok(Case { name: format!("delta-net hk={hk} hv={hv} d={d} conv={kernel} steps {steps:?}{how}"), worst, bits: Some(bits), note: String::new() })
}

/// `conv_gated_delta_rule` over a batched step's entries (Qwen3.5's delta-net in a batched step):
/// several sequences' rows (`rows[i]` each, consecutive in the step), each from its own random
/// conv windows and states at its own start plane, in one launch through the entry table (with
/// one empty entry past them), against each sequence's own launch: the outputs and every plane
/// of every sequence, bit for bit.
fn check_gdn_entries(dev: &Dev, rng: &mut Rng, dims: reference::GdnDims, rows: &[usize]) -> Res<Case> {
    let reference::GdnDims { hk, hv, d, kernel } = dims;
    let c = dims.channels();
    let planes = MAX_ROWS + 1;
    let total: usize = rows.iter().sum();
    let x = rng.vec(total * c, 1.0);
    let beta = rng.vec(total * hv, 2.0);
    let alpha = rng.vec(total * hv, 2.0);
    let conv_w = rng.vec(c * kernel, 0.7);
    let dt_bias = rng.vec(hv, 1.0);
    let a: Vec<f32> = rng.vec(hv, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
    let (xd, bd, ad, cwd, dtd, a_d) = (dev.up(&x)?, dev.up(&beta)?, dev.up(&alpha)?, dev.up(&conv_w)?, dev.up(&dt_bias)?, dev.up(&a)?);
    // Each sequence's planes and start plane.
    let seqs: Vec<(Vec<f32>, Vec<f32>, usize)> = rows.iter().map(|_| (rng.vec(planes * (kernel - 1) * c, 1.0), rng.vec(planes * hv * d * d, 0.3), (rng.next() as usize) % planes)).collect();
    let mut step = dev.up(&[StepParams::default()])?;
    let args = |row0: usize, n: usize, conv_planes: u64, ssm_planes: u64, o: u64, step: u64| {
        let ca = ConvArgs { x: dev.ptr(&xd) + (row0 * c * 4) as u64, w: dev.ptr(&cwd), planes: conv_planes, y: 0, step, c: c as i32, k: kernel as i32, n_planes: planes as i32, rows: n as i32 };
        let ga = GdnArgs {
            qkv: 0,
            alpha: dev.ptr(&ad) + (row0 * hv * 4) as u64,
            beta: dev.ptr(&bd) + (row0 * hv * 4) as u64,
            dt_bias: dev.ptr(&dtd),
            a: dev.ptr(&a_d),
            planes: ssm_planes,
            out: o + (row0 * hv * d * 4) as u64,
            step,
            hk: hk as i32,
            hv: hv as i32,
            d: d as i32,
            n_planes: planes as i32,
            rows: n as i32,
            eps: 1e-6,
            q_scale: 1.0 / (d as f32).sqrt(),
            pad_: 0,
        };
        ConvGdnArgs { conv: ca, gdn: ga, ent_rows: 0, ent_planes: 0 }
    };
    // Pass 0: one launch over the entry table; 1: each sequence's own launch.
    let mut results = Vec::new();
    for pass in 0..2 {
        let o = dev.zeros::<f32>(total * hv * d)?;
        let bufs = seqs.iter().map(|(cp, sp, _)| Ok((dev.up(cp)?, dev.up(sp)?))).collect::<Res<Vec<_>>>()?;
        if pass == 0 {
            let mut ent = Vec::new();
            let mut ptrs = Vec::new();
            let mut row0 = 0;
            for ((n, (_, _, p0)), (cp, sp)) in rows.iter().zip(&seqs).zip(&bufs) {
                ent.extend([row0 as i32, *n as i32, *p0 as i32]);
                ptrs.extend([dev.ptr(cp), dev.ptr(sp)]);
                row0 += n;
            }
            // An empty entry past them (a step's spare blocks).
            ent.extend([0, 0, 0]);
            ptrs.extend([0u64, 0]);
            let (entd, ptrd) = (dev.up(&ent)?, dev.up(&ptrs)?);
            let longest = *rows.iter().max().expect("rows");
            let ga = ConvGdnArgs { ent_rows: dev.ptr(&entd), ent_planes: dev.ptr(&ptrd), ..args(0, longest, 0, 0, dev.ptr(&o), 0) };
            // SAFETY: each entry's rows lie in the step's `total` rows, its planes hold `planes`
            // planes and its start plane is below them; the empty entry's blocks return at once.
            unsafe { dev.k.conv_gated_delta_rule_entries(&dev.stream, &ga, rows.len() + 1)? };
            dev.stream.synchronize()?;
        } else {
            let mut row0 = 0;
            for ((n, (_, _, p0)), (cp, sp)) in rows.iter().zip(&seqs).zip(&bufs) {
                dev.set_step(&mut step, StepParams { rows: *n as i32, plane: *p0 as i32, ..Default::default() })?;
                // SAFETY: as above, one sequence at a time through the step block's plane.
                unsafe { dev.k.conv_gated_delta_rule(&dev.stream, &args(row0, *n, dev.ptr(cp), dev.ptr(sp), dev.ptr(&o), dev.ptr(&step)))? };
                row0 += n;
            }
        }
        let planes_after = bufs.iter().map(|(cp, sp)| Ok((dev.down(cp)?, dev.down(sp)?))).collect::<Res<Vec<_>>>()?;
        results.push((dev.down(&o)?, planes_after));
    }
    let same = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let (a0, a1) = (&results[0], &results[1]);
    let bits = same(&a0.0, &a1.0) && a0.1.iter().zip(&a1.1).all(|((c0, s0), (c1, s1))| same(c0, c1) && same(s0, s1));
    Ok(Case { name: format!("delta-net entries hk={hk} hv={hv} d={d} conv={kernel} rows {rows:?} (one launch vs each sequence's)"), worst: 0.0, bits: Some(bits), note: String::new() })
}

fn table(dev: &Dev, seed: u64) -> Res<Vec<Case>> {
    let mut rng = Rng(seed);
    let mut cases = Vec::new();
    // Gemma 3 270M's shapes first, then odd ones (rows not a multiple of the block's 4 warps,
    // a single unit, long rows).
    for (t, n, k) in [
        (WeightType::Q5_0, 1024, 640),
        (WeightType::Q8_0, 256, 640),
        (WeightType::Q4K, 640, 1024),
        (WeightType::Q6K, 640, 2048),
        (WeightType::Q8_0, 4099, 640),
        (WeightType::Q5_0, 7, 32),
        (WeightType::Q8_0, 5, 96),
        (WeightType::Q4K, 3, 256),
        (WeightType::Q6K, 9, 256),
        (WeightType::Q5_0, 130, 5120),
        (WeightType::Q4K, 66, 5120),
        // Many rows: the staged GEMV (16-byte copies; the tails 4- and 2-byte aligned).
        (WeightType::Q8_0, 9000, 640),
        (WeightType::Q8_0, 8195, 640),
        (WeightType::Q5_0, 8193, 32),
        (WeightType::Q4K, 8200, 256),
        (WeightType::Q6K, 8197, 512),
        // Qwen3.5's fused QKV rows (Q5_K in a Q4_K_M file).
        (WeightType::Q5K, 6144, 1024),
        (WeightType::Q5K, 5, 256),
        (WeightType::Q5K, 8200, 512),
    ] {
        cases.push(check_gemv(dev, &mut rng, t, n, k, false)?);
    }
    for t in WeightType::ALL {
        cases.push(check_gemv(dev, &mut rng, t, 2048 / 8, 640.max(t.block_values()) / t.block_values() * t.block_values(), true)?);
    }
    // The wide layout (every GEMV of the engine): the families' widths (4 lanes a row below
    // 4096, 8 from it), rows not a multiple of a block's, rows of fewer units than lanes, GLU.
    for (t, n, k, glu) in [
        (WeightType::Q6K, 4099, 1024, false),
        (WeightType::Q8_0, 4101, 640, false),
        (WeightType::Q6K, 1030, 4096, false),
        (WeightType::Q8_0, 517, 4096, false),
        (WeightType::Q6K, 77, 2560, false),
        (WeightType::Q8_0, 33, 128, false),
        (WeightType::Q6K, 9, 256, false),
        (WeightType::Q8_0, 7, 96, false),
        (WeightType::Q5_0, 1024, 640, false),
        (WeightType::Q5_0, 130, 5120, false),
        (WeightType::Q5_0, 5, 32, false),
        (WeightType::Q4K, 7168, 1024, false),
        (WeightType::Q4K, 66, 5120, false),
        (WeightType::Q4K, 1024, 3584, false),
        (WeightType::Q5K, 6144, 1024, false),
        (WeightType::Q5K, 5, 256, false),
        (WeightType::Q6K, 1024, 3584, false),
        (WeightType::Q4K, 3584, 1024, true),
        (WeightType::Q5_0, 2048, 640, true),
        (WeightType::Q8_0, 256, 640, true),
        (WeightType::Q5K, 300, 512, true),
        (WeightType::Q6K, 257, 768, true),
    ] {
        cases.push(check_gemv_layout(dev, &mut rng, t, n, k, glu, Layout::Wide)?);
    }
    for layout in [Layout::Gguf, Layout::Wide] {
        cases.push(check_gemv_segments(dev, &mut rng, 640, &[(WeightType::Q5_0, 1024), (WeightType::Q5_0, 256), (WeightType::Q8_0, 256)], layout)?);
        cases.push(check_gemv_segments(dev, &mut rng, 1024, &[(WeightType::Q4K, 33), (WeightType::Q6K, 70), (WeightType::Q8_0, 5), (WeightType::Q5_0, 64)], layout)?);
        cases.push(check_gemv_segments(dev, &mut rng, 1024, &[(WeightType::Q5K, 6144), (WeightType::Q4K, 2048), (WeightType::Q4K, 16), (WeightType::Q4K, 16)], layout)?);
    }
    for k in [640, 1024, 2048, 96, 8192] {
        for mode in 0..6 {
            cases.push(check_norm_quant(dev, &mut rng, k, mode, WeightType::Q8_0)?);
        }
    }
    cases.push(check_norm_quant(dev, &mut rng, 21504, 3, WeightType::Q8_0)?);
    // Embedding rows of the other types (Qwen3.5's Q6_K table in a Q4_K_M file).
    for et in [WeightType::Q4K, WeightType::Q5K, WeightType::Q6K, WeightType::Q5_0] {
        cases.push(check_norm_quant(dev, &mut rng, 1024, 2, et)?);
    }
    // The tables in the wide layout (what the engine loads): Qwen3.5's Q6_K, Gemma 3's Q8_0, the
    // other types.
    for (et, k) in [(WeightType::Q6K, 1024), (WeightType::Q8_0, 640), (WeightType::Q6K, 4096), (WeightType::Q4K, 1024), (WeightType::Q5K, 512), (WeightType::Q5_0, 640)] {
        cases.push(check_norm_quant_layout(dev, &mut rng, k, 2, et, Layout::Wide)?);
    }
    for k in [640, 2048] {
        cases.push(check_norm_quant_concat(dev, &mut rng, k)?);
    }
    // The gated delta-net: Qwen3.5's head shape in one-row and verify steps, a prompt-sized step
    // (more rows than planes), and the small shapes of the fixtures.
    for (dims, steps) in [
        (reference::GdnDims { hk: 2, hv: 4, d: 128, kernel: 4 }, vec![1, 3, 8, 2]),
        (reference::GdnDims { hk: 2, hv: 4, d: 128, kernel: 4 }, vec![12, 1, 5]),
        (reference::GdnDims { hk: 2, hv: 4, d: 64, kernel: 4 }, vec![2, 7, 1]),
        (reference::GdnDims { hk: 1, hv: 2, d: 256, kernel: 3 }, vec![4, 4]),
    ] {
        cases.push(check_gdn(dev, &mut rng, dims, &steps, false)?);
        cases.push(check_gdn(dev, &mut rng, dims, &steps, true)?);
    }
    // Value heads over fewer key heads (the 9B's 32 over 16): the q/k windows' one writer.
    cases.push(check_gdn(dev, &mut rng, reference::GdnDims { hk: 2, hv: 6, d: 128, kernel: 4 }, &[3, 1, 8, 8, 2], true)?);
    // A batched step's sequences through the entry table (issue 50: Qwen3.5's rows from several
    // sequences).
    for (dims, rows) in [
        (reference::GdnDims { hk: 2, hv: 4, d: 128, kernel: 4 }, vec![1, 3, 2, 8]),
        (reference::GdnDims { hk: 2, hv: 6, d: 128, kernel: 4 }, vec![2, 1]),
        (reference::GdnDims { hk: 1, hv: 2, d: 256, kernel: 3 }, vec![4, 1, 1]),
    ] {
        cases.push(check_gdn_entries(dev, &mut rng, dims, &rows)?);
    }
    for (h, kv, hd, pos, n_rot) in [(4, 1, 256, 0, 0), (4, 1, 256, 1000, 0), (8, 2, 128, 77, 0), (2, 2, 64, 31000, 0), (8, 2, 256, 1234, 64), (4, 2, 64, 9, 16)] {
        cases.push(check_rope(dev, &mut rng, h, kv, hd, pos, n_rot, false, false)?);
    }
    // Gemma 4: V's weightless norm, V from K's projection (k_eq_v), heads of 512 with a quarter
    // rotated, queries alone (a KV-shared layer).
    for (h, kv, hd, pos, n_rot, v_norm, v_from_k) in [
        (8, 1, 256, 300, 0, true, false),
        (8, 1, 512, 4000, 128, true, false),
        (4, 2, 512, 17, 128, true, true),
        (4, 1, 64, 5, 16, false, true),
        (8, 0, 512, 999, 128, false, false),
        (4, 0, 256, 3, 0, false, false),
    ] {
        cases.push(check_rope(dev, &mut rng, h, kv, hd, pos, n_rot, v_norm, v_from_k)?);
    }
    // Gemma 4's per-layer inputs, its per-layer input gate (norm_quant in_mode 4), and logit softcapping.
    for (layers, p, et, layout) in [(35, 256, WeightType::Q8_0, Layout::Wide), (4, 64, WeightType::Q4K, Layout::Wide), (8, 32, WeightType::Q6K, Layout::Gguf), (4, 128, WeightType::Q5K, Layout::Wide)]
    {
        cases.push(check_ple(dev, &mut rng, layers, p, et, layout)?);
    }
    for (k, stride) in [(256, 8960), (64, 192), (1536, 1536)] {
        cases.push(check_gelu_gate(dev, &mut rng, k, stride)?);
    }
    for (n, cap) in [(262144 * 3, 30.0), (4096, 30.0), (100, 0.5)] {
        cases.push(check_softcap(dev, &mut rng, n, cap)?);
    }
    // Mixture of experts (qwen35moe, Gemma 4's 26B-A4B): the router, the routed experts' GEMVs, the combination.
    for (rows, k, experts, used, shared) in
        [(1, 256, 8, 2, true), (3, 640, 64, 8, true), (1, 2048, 256, 8, true), (8, 2048, 256, 8, true), (2, 96, 512, 16, true), (1, 2816, 128, 8, false), (8, 2816, 128, 8, false)]
    {
        cases.push(check_moe_router(dev, &mut rng, rows, k, experts, used, shared)?);
    }
    for (t, experts, n, k, glu, used, act_rows, act_pair) in [
        (WeightType::Q4K, 8, 64, 256, 2, 2, 1, false),
        (WeightType::Q4K, 16, 512, 2048, 2, 8, 3, false),
        (WeightType::Q6K, 16, 2048, 512, 0, 8, 24, true),
        (WeightType::Q5K, 4, 96, 256, 2, 2, 8, false),
        (WeightType::Q8_0, 6, 256, 128, 0, 3, 9, true),
        (WeightType::Q5_0, 5, 33, 64, 2, 4, 2, false),
        // Gemma 4 26B-A4B's widths: GELU gate·up of 704 rows over 2816, down over 704 (Q5_0 and
        // Q8_0: llama-quantize's fallbacks for rows that are not whole 256-value blocks).
        (WeightType::Q4K, 16, 704, 2816, 1, 8, 2, false),
        (WeightType::Q5_0, 16, 2816, 704, 0, 8, 16, true),
        (WeightType::Q8_0, 16, 2816, 704, 0, 8, 8, true),
    ] {
        cases.push(check_gemv_moe(dev, &mut rng, t, experts, n, k, glu, used, act_rows, act_pair)?);
    }
    for (t, experts, n, k, glu, used, rows, act_pair) in [
        // (The float64 reference computes every expert's rows for every activation row: the
        // shapes stay small enough for the host.)
        (WeightType::Q4K, 16, 512, 2048, 2, 4, 40, false),
        (WeightType::Q6K, 16, 1024, 512, 0, 4, 24, true),
        (WeightType::Q4K, 16, 704, 2816, 1, 4, 40, false),
        (WeightType::Q5_0, 16, 1024, 704, 0, 4, 20, true),
        (WeightType::Q8_0, 128, 32, 128, 2, 8, 70, false),
        (WeightType::Q8_0, 8, 96, 128, 0, 2, 9, true),
        (WeightType::Q5K, 8, 256, 256, 2, 3, 200, false),
    ] {
        cases.push(check_mmq_moe(dev, &mut rng, t, experts, n, k, glu, used, rows, act_pair)?);
    }
    for (rows, k, used, shared, escale) in [(1, 2048, 8, true, false), (5, 640, 2, false, false), (8, 96, 16, true, false), (1, 2816, 8, false, true), (8, 2816, 8, false, true)] {
        cases.push(check_moe_combine(dev, &mut rng, rows, k, used, shared, escale)?);
    }
    // The rotated low-bit KV rows (issue 53): the device's bytes against candle-nn's encoder.
    for (bits, d, rows) in [(4, 256, 9), (3, 256, 9), (2, 256, 9), (3, 512, 5), (3, 128, 7), (4, 160, 3), (2, 512, 4)] {
        cases.push(check_turbo(dev, &mut rng, bits, d, rows)?);
    }
    // Rows from several sequences in one step (a batched step's row table, issue 50).
    for (h, kv, hd, ctx, window, types) in [
        (4, 1, 256, 2048, 0, KvTypes::F32),
        (8, 2, 128, 1024, 64, KvTypes::F32),
        (16, 8, 256, 1536, 512, KvTypes { k: KvStore::Q8_0, v: KvStore::Q8_0 }),
        (8, 1, 512, 1024, 0, KvTypes { k: KvStore::F16, v: KvStore::Q4_0 }),
        (8, 2, 256, 1536, 512, KvTypes { k: KvStore::Turbo4, v: KvStore::Turbo3 }),
    ] {
        cases.push(check_seq_rows(dev, &mut rng, h, kv, hd, ctx, window, types)?);
    }
    for (h, kv, hd, ctx, window, pos) in [
        (4, 1, 256, 2048, 0, 0),
        (4, 1, 256, 2048, 0, 125),
        (4, 1, 256, 2048, 512, 700),
        (4, 1, 256, 2048, 0, 1900),
        (8, 2, 128, 1024, 0, 300),
        (8, 2, 128, 1024, 100, 900),
        (2, 1, 64, 600, 7, 580),
        (4, 1, 256, 8192, 0, 8000),
        (8, 1, 128, 700, 0, 60),
        (6, 1, 256, 300, 0, 250),
        (3, 1, 64, 200, 33, 150),
        (16, 2, 256, 4096, 1024, 3000),
        (2, 2, 128, 100, 0, 3),
        // Gemma 4's global layers (heads of 512).
        (8, 1, 512, 2048, 0, 0),
        (8, 1, 512, 2048, 0, 1500),
        (4, 2, 512, 700, 0, 63),
        (8, 1, 512, 4096, 512, 3000),
    ] {
        cases.push(check_attention(dev, &mut rng, h, kv, hd, ctx, window, pos, false, KvTypes::F32)?);
    }
    // Qwen3.5's gated attention (8 heads over 2 KV heads of 256: the 0.8B shape).
    for (ctx, pos) in [(2048, 0), (2048, 777)] {
        cases.push(check_attention(dev, &mut rng, 8, 2, 256, ctx, 0, pos, true, KvTypes::F32)?);
    }
    // KV caches stored as f16, bf16, q8_0 and q4_0 (-ctk/-ctv), K and V apart: the rows the
    // kernel stores against the CPU's encoder, and the attention over them against float64 of
    // the values they hold (rows of multi-row launches bit-identical to one-row launches).
    let (f16, bf16, q8, q4) = (KvStore::F16, KvStore::Bf16, KvStore::Q8_0, KvStore::Q4_0);
    // The rotated low-bit types (issue 53): stored through turbo_store, read in their basis.
    let (t4, t3, t2) = (KvStore::Turbo4, KvStore::Turbo3, KvStore::Turbo2);
    let tt = |k, v| KvTypes { k, v };
    for (kv, hd, pos, types, v_norm) in [
        (1, 256, 0, tt(q8, q8), false),
        (2, 128, 37, tt(q4, q4), false),
        (1, 512, 5, tt(q8, q4), true),
        (2, 64, 100, tt(f16, bf16), false),
        (1, 256, 3, tt(bf16, q4), true),
        (4, 128, 9, tt(q4, f16), false),
        (1, 256, 0, tt(t4, t4), false),
        (2, 128, 37, tt(t3, t2), false),
        (1, 512, 5, tt(t4, t3), true),
        (4, 256, 9, tt(q8, t3), true),
        (2, 256, 3, tt(t2, f16), false),
    ] {
        cases.push(check_kv_store(dev, &mut rng, kv, hd, pos, types, v_norm)?);
    }
    for (h, kv, hd, ctx, window, pos, gated, types) in [
        (4, 1, 256, 2048, 0, 1900, false, tt(q8, q8)),
        (4, 1, 256, 2048, 512, 700, false, tt(q4, q4)),
        (8, 2, 128, 1024, 100, 900, false, tt(f16, f16)),
        (2, 1, 64, 600, 7, 580, false, tt(bf16, bf16)),
        (8, 2, 256, 2048, 0, 777, true, tt(q8, q4)),
        (8, 1, 512, 2048, 0, 1500, false, tt(q8, q8)),
        (8, 1, 512, 4096, 512, 3000, false, tt(q4, f16)),
        (3, 1, 64, 200, 33, 150, false, tt(q4, q8)),
        (4, 1, 256, 2048, 0, 1900, false, tt(t4, t4)),
        (4, 1, 256, 2048, 512, 700, false, tt(t3, t3)),
        (8, 2, 128, 1024, 100, 900, false, tt(t2, t2)),
        (8, 2, 256, 2048, 0, 777, true, tt(t4, t3)),
        (8, 1, 512, 2048, 0, 1500, false, tt(t3, t4)),
        (8, 1, 512, 4096, 512, 3000, false, tt(q8, t3)),
        (4, 1, 256, 300, 0, 250, false, tt(t4, f16)),
    ] {
        cases.push(check_attention(dev, &mut rng, h, kv, hd, ctx, window, pos, gated, types)?);
    }
    for (h, kv, hd, ctx, window, pos, rows, types) in [
        (4, 1, 256, 1024, 0, 0, 40, tt(q8, q8)),
        (8, 2, 128, 1024, 100, 300, 33, tt(q4, q4)),
        (8, 1, 512, 1024, 0, 200, 21, tt(q8, q4)),
        (2, 1, 64, 600, 7, 100, 17, tt(f16, bf16)),
        (4, 1, 256, 1024, 0, 100, 40, tt(t4, t3)),
        (8, 1, 512, 1024, 0, 200, 21, tt(t3, t2)),
    ] {
        cases.push(check_attention_rows(dev, &mut rng, h, kv, hd, ctx, window, pos, rows, types)?);
    }
    // An assistant head's query past the cache it reads (the step's kv_end).
    for (h, kv, hd, ctx, window, kv_end, pos) in
        [(4, 1, 256, 2048, 512, 700, 702), (4, 1, 256, 2048, 0, 1000, 1003), (8, 2, 128, 1024, 100, 150, 248), (4, 1, 256, 600, 512, 3, 4), (2, 1, 64, 300, 0, 1, 1)]
    {
        cases.push(check_attention_kv_end(dev, &mut rng, h, kv, hd, ctx, window, kv_end, pos)?);
    }
    for n in [262144, 1000, 5] {
        cases.push(check_argmax(dev, &mut rng, n)?);
    }
    for (n, k, rows, coarse, mixed) in [
        (262144, 40, 1, false, false),
        (262144, 64, 3, true, false),
        (151936, 40, 2, true, false),
        (5000, 1, 1, false, false),
        (10, 20, 1, true, false),
        (4096, 64, 8, true, false),
        (262144, 40, 8, false, true),
        (4096, 64, 5, true, true),
    ] {
        cases.push(check_topk(dev, &mut rng, n, k, rows, coarse, mixed)?);
    }
    // A batched step's rows in one launch (issue 50), each bit for bit its one-row launch's.
    for (t, n, k, glu, rows) in [
        (WeightType::Q4K, 1024, 640, true, 16),
        (WeightType::Q8_0, 640, 1024, false, 24),
        (WeightType::Q6K, 4096, 640, false, 64),
        (WeightType::Q5_0, 96, 256, true, 8),
        (WeightType::Q5K, 300, 512, false, 40),
    ] {
        cases.push(check_gemv_rows(dev, &mut rng, t, n, k, glu, rows)?);
    }
    // A prompt's rows in one launch.
    for (t, n, k, glu, rows) in [
        (WeightType::Q5_0, 1024, 640, false, 29),
        (WeightType::Q4K, 2048, 768, true, 16),
        (WeightType::Q6K, 640, 2048, false, 143),
        (WeightType::Q8_0, 256, 640, false, 9),
        (WeightType::Q8_0, 37, 96, true, 70),
        (WeightType::Q5_0, 45, 160, true, 200),
        (WeightType::Q6K, 33, 256, true, 65),
        (WeightType::Q4K, 100, 1280, false, 512),
    ] {
        cases.push(check_gemv_prompt(dev, &mut rng, t, n, k, glu, rows, Layout::Gguf)?);
        cases.push(check_gemv_prompt(dev, &mut rng, t, n, k, glu, rows, Layout::Wide)?);
    }
    for layout in [Layout::Gguf, Layout::Wide] {
        cases.push(check_mmq_segments(dev, &mut rng, 640, 77, &[(WeightType::Q5_0, 1024), (WeightType::Q5_0, 256), (WeightType::Q8_0, 256)], layout)?);
        cases.push(check_mmq_segments(dev, &mut rng, 1024, 100, &[(WeightType::Q5K, 640), (WeightType::Q4K, 256), (WeightType::Q6K, 64)], layout)?);
    }
    for (h, kv, hd, ctx, window, pos, rows) in [
        (4, 1, 256, 1024, 0, 0, 200),
        (4, 1, 256, 2048, 512, 300, 333),
        (4, 1, 256, 2048, 512, 1100, 64),
        (8, 2, 128, 1024, 100, 37, 90),
        (2, 1, 64, 600, 7, 500, 41),
        (16, 2, 256, 4096, 0, 3000, 19),
        (3, 1, 64, 300, 0, 0, 9),
        (8, 1, 512, 1024, 0, 0, 200),
        (4, 2, 512, 2048, 0, 900, 37),
        (8, 1, 512, 2048, 512, 700, 66),
    ] {
        cases.push(check_attention_rows(dev, &mut rng, h, kv, hd, ctx, window, pos, rows, KvTypes::F32)?);
    }
    Ok(cases)
}

/// Gemma 3 270M's decode step as tine-gpu's launches (random weights in the GGUF's types, 18
/// layers, every sixth global), captured as one graph per row count and replayed.
mod bench {
    use super::*;

    const HIDDEN: usize = 640;
    const HEADS: usize = 4;
    const KV: usize = 1;
    const HD: usize = 256;
    const FF: usize = 2048;
    const LAYERS: usize = 18;
    const VOCAB: usize = 262144;
    const CTX: usize = 4096;
    const WINDOW: usize = 512;

    struct Layer {
        q: CudaSlice<u8>,
        k: CudaSlice<u8>,
        v: CudaSlice<u8>,
        o: CudaSlice<u8>,
        gate: CudaSlice<u8>,
        up: CudaSlice<u8>,
        down: CudaSlice<u8>,
        kc: CudaSlice<f32>,
        vc: CudaSlice<f32>,
    }

    /// Random rows of type t, `n` of them, made from 64 distinct quantized rows (quantizing 167M
    /// values on the CPU would dominate the run), in the wide layout (what the engine loads).
    fn weights(dev: &Dev, rng: &mut Rng, t: WeightType, n: usize, k: usize) -> Res<CudaSlice<u8>> {
        let distinct = n.min(64);
        let base = t.to_wide(&t.quantize(&rng.vec(distinct * k, 0.1)), k);
        let rb = t.wide_row_bytes(k);
        let mut all = Vec::with_capacity(n * rb);
        for r in 0..n {
            all.extend_from_slice(&base[(r % distinct) * rb..][..rb]);
        }
        dev.up(&all)
    }

    pub fn run(dev: &Dev, profile: bool) -> Res<()> {
        let mut rng = Rng(7);
        let layers: Vec<Layer> = (0..LAYERS)
            .map(|_| -> Res<Layer> {
                Ok(Layer {
                    q: weights(dev, &mut rng, WeightType::Q5_0, HEADS * HD, HIDDEN)?,
                    k: weights(dev, &mut rng, WeightType::Q5_0, KV * HD, HIDDEN)?,
                    v: weights(dev, &mut rng, WeightType::Q8_0, KV * HD, HIDDEN)?,
                    o: weights(dev, &mut rng, WeightType::Q4K, HIDDEN, HEADS * HD)?,
                    gate: weights(dev, &mut rng, WeightType::Q5_0, FF, HIDDEN)?,
                    up: weights(dev, &mut rng, WeightType::Q5_0, FF, HIDDEN)?,
                    down: weights(dev, &mut rng, WeightType::Q6K, HIDDEN, FF)?,
                    kc: dev.up(&rng.vec(KV * CTX * HD, 1.0))?,
                    vc: dev.up(&rng.vec(KV * CTX * HD, 1.0))?,
                })
            })
            .collect::<Res<_>>()?;
        let embd = weights(dev, &mut rng, WeightType::Q8_0, VOCAB, HIDDEN)?;
        let norm = dev.up(&vec![1.0f32; FF.max(HEADS * HD)])?;
        let inv_local = dev.up(&reference::inv_freq(HD, 10000.0))?;
        let inv_global = dev.up(&reference::inv_freq(HD, 1e6))?;
        let m = MAX_ROWS;
        let h = dev.zeros::<f32>(m * HIDDEN)?;
        let (q, k, v) = (dev.zeros::<f32>(m * HEADS * HD)?, dev.zeros::<f32>(m * KV * HD)?, dev.zeros::<f32>(m * KV * HD)?);
        let o = dev.zeros::<f32>(m * HIDDEN)?;
        let ff = dev.zeros::<f32>(m * FF)?;
        let down = dev.zeros::<f32>(m * HIDDEN)?;
        let logits = dev.zeros::<f32>(m * VOCAB)?;
        let kmax = FF.max(HEADS * HD);
        let (qs, qd, qsum) = (dev.zeros::<i8>(m * kmax)?, dev.zeros::<f32>(m * kmax / QK)?, dev.zeros::<i32>(m * kmax / QK)?);
        let chunks_max = Kernels::attn_chunks_max(CTX, 0);
        let partials = dev.zeros::<f32>(m * HEADS * chunks_max * (HD + 2))?;
        let counters = dev.zeros::<i32>(MAX_ROWS * HEADS)?;
        let (cv, ci, acnt, ids) = (dev.zeros::<f32>(m * ARGMAX_BLOCKS)?, dev.zeros::<i32>(m * ARGMAX_BLOCKS)?, dev.zeros::<i32>(MAX_ROWS)?, dev.zeros::<i32>(MAX_ROWS)?);
        let mut step = dev.up(&[StepParams { pos: 1000, rows: 1, tokens: [17; MAX_ROWS], ..Default::default() }])?;
        let p = |s: &CudaSlice<f32>| dev.ptr(s);
        let act = (dev.ptr(&qs), dev.ptr(&qd), dev.ptr(&qsum));
        let step_p = dev.ptr(&step);
        let nq = |a: DevPtr, mode: i32, kk: usize, norm_on: bool| NormQuantArgs {
            a,
            res: p(&h),
            w_a: p(&norm),
            embd: dev.ptr(&embd),
            embd_scale: (HIDDEN as f32).sqrt(),
            step: step_p,
            w: p(&norm),
            eps: 1e-6,
            res_out: if mode == 0 { 0 } else { p(&h) },
            y_out: 0,
            qs: act.0,
            qd: act.1,
            qsum: act.2,
            k: kk as i32,
            in_mode: mode,
            norm: norm_on as i32,
            tokens: 0,
            embd_type: WeightType::Q8_0.ggml_id() | EMBD_WIDE,
            ..Default::default()
        };
        // One decode step of `rows` rows, as launches on the stream. With `marks`, an event is
        // recorded after each launch, labelled with what the launch does (the profile).
        let step_launches = |rows: usize, marks: &mut Option<Marks>, skip: Option<&str>| -> Res<usize> {
            let mut count = 0;
            let mut mark = |label: &'static str| -> Res<()> {
                if let Some(m) = marks.as_mut() {
                    m.push((label, record_node(dev)?));
                }
                Ok(())
            };
            // SAFETY: every buffer above is sized for MAX_ROWS rows of its width, the caches CTX
            // positions (the step's positions are 1000..1008).
            unsafe {
                for (l, ly) in layers.iter().enumerate() {
                    let global = l % 6 == 5;
                    let label = "norm_quant: residual + attn_norm";
                    if skip != Some(label) {
                        dev.k.norm_quant(&dev.stream, rows, &if l == 0 { nq(0, 2, HIDDEN, true) } else { nq(p(&down), 1, HIDDEN, true) })?;
                    }
                    mark(label)?;
                    let seg = |w: &CudaSlice<u8>, out: &CudaSlice<f32>, n: usize, t: WeightType| GemvSeg {
                        w: dev.ptr(w),
                        out: p(out),
                        n: n as i32,
                        wtype: t.ggml_id(),
                        out_stride: n as i32,
                        wide: 1,
                        ..Default::default()
                    };
                    let label = "gemv: q k v";
                    if skip != Some(label) {
                        dev.k.gemv(
                            &dev.stream,
                            rows,
                            HIDDEN,
                            &[seg(&ly.q, &q, HEADS * HD, WeightType::Q5_0), seg(&ly.k, &k, KV * HD, WeightType::Q5_0), seg(&ly.v, &v, KV * HD, WeightType::Q8_0)],
                            act,
                        )?;
                    }
                    mark(label)?;
                    let rope = RopeArgs {
                        q: p(&q),
                        k: p(&k),
                        v: p(&v),
                        q_norm: p(&norm),
                        k_norm: p(&norm),
                        eps: 1e-6,
                        inv_freq: if global { dev.ptr(&inv_global) } else { dev.ptr(&inv_local) },
                        q_scale: 1.0 / (HD as f32).sqrt(),
                        k_cache: p(&ly.kc),
                        v_cache: p(&ly.vc),
                        ctx: CTX as i32,
                        step: step_p,
                        n_head: HEADS as i32,
                        n_kv: KV as i32,
                        hd: HD as i32,
                        n_rot: 0,
                        v_norm: 0,
                        v_from_k: 0,
                        k_type: 0,
                        v_type: 0,
                        kv_slots: 0,
                        stage: 0,
                        turbo: dev.k.turbo_tab(&dev.stream),
                    };
                    let label = "qk_norm_rope_kv";
                    if skip != Some(label) {
                        dev.k.qk_norm_rope_kv(&dev.stream, rows, &rope)?;
                    }
                    mark(label)?;
                    let window = if global { 0 } else { WINDOW };
                    let at = AttnArgs {
                        q: p(&q),
                        k_cache: p(&ly.kc),
                        v_cache: p(&ly.vc),
                        out: 0,
                        partials: p(&partials),
                        counters: dev.ptr(&counters),
                        step: step_p,
                        qs: act.0,
                        qd: act.1,
                        qsum: act.2,
                        ctx: CTX as i32,
                        window: window as i32,
                        n_head: HEADS as i32,
                        n_kv: KV as i32,
                        chunks_max: Kernels::attn_chunks_max(CTX, window) as i32,
                        gate: 0,
                        k_type: 0,
                        v_type: 0,
                        kv_slots: 0,
                        turbo: dev.k.turbo_tab(&dev.stream),
                    };
                    let label = if global { "attention: global" } else { "attention: local (window)" };
                    if skip != Some(label) {
                        dev.k.attention(&dev.stream, rows, HD, &at)?;
                    }
                    mark(label)?;
                    let label = "gemv: o";
                    if skip != Some(label) {
                        dev.k.gemv(&dev.stream, rows, HEADS * HD, &[seg(&ly.o, &o, HIDDEN, WeightType::Q4K)], act)?;
                    }
                    mark(label)?;
                    let label = "norm_quant: residual + ffn_norm";
                    if skip != Some(label) {
                        dev.k.norm_quant(&dev.stream, rows, &nq(p(&o), 1, HIDDEN, true))?;
                    }
                    mark(label)?;
                    let glu =
                        GemvSeg { w: dev.ptr(&ly.gate), w2: dev.ptr(&ly.up), out: p(&ff), n: FF as i32, wtype: WeightType::Q5_0.ggml_id(), out_stride: FF as i32, glu: 1, block_start: 0, wide: 1 };
                    let label = "gemv: gate/up GLU";
                    if skip != Some(label) {
                        dev.k.gemv(&dev.stream, rows, HIDDEN, &[glu], act)?;
                    }
                    mark(label)?;
                    let label = "norm_quant: ffn hidden";
                    if skip != Some(label) {
                        dev.k.norm_quant(&dev.stream, rows, &nq(p(&ff), 0, FF, false))?;
                    }
                    mark(label)?;
                    let label = "gemv: down";
                    if skip != Some(label) {
                        dev.k.gemv(&dev.stream, rows, FF, &[seg(&ly.down, &down, HIDDEN, WeightType::Q6K)], act)?;
                    }
                    mark(label)?;
                    count += 9;
                }
                let label = "norm_quant: output_norm";
                if skip != Some(label) {
                    dev.k.norm_quant(&dev.stream, rows, &nq(p(&down), 1, HIDDEN, true))?;
                }
                mark(label)?;
                let lm = GemvSeg { w: dev.ptr(&embd), out: p(&logits), n: VOCAB as i32, wtype: WeightType::Q8_0.ggml_id(), out_stride: VOCAB as i32, wide: 1, ..Default::default() };
                let label = "gemv: LM head";
                if skip != Some(label) {
                    dev.k.gemv(&dev.stream, rows, HIDDEN, &[lm], act)?;
                }
                mark(label)?;
                let am = ArgmaxArgs { logits: p(&logits), n: VOCAB as i32, cand_v: p(&cv), cand_i: dev.ptr(&ci), counters: dev.ptr(&acnt), ids: dev.ptr(&ids), feed: 0, step: step_p };
                let label = "argmax";
                if skip != Some(label) {
                    dev.k.argmax(&dev.stream, rows, &am)?;
                }
                mark(label)?;
                count += 3;
            }
            Ok(count)
        };
        println!("bench: Gemma 3 270M shapes (hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}), position 1000, random weights in the GGUF's types");
        for rows in [1usize, 2, 4, 8] {
            dev.set_step(&mut step, StepParams { pos: 1000, rows: rows as i32, tokens: [17; MAX_ROWS], ..Default::default() })?;
            // Eager: launches issued one by one.
            let launches = step_launches(rows, &mut None, None)?;
            dev.stream.synchronize()?;
            let reps = 50;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                step_launches(rows, &mut None, None)?;
            }
            dev.stream.synchronize()?;
            let eager_ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
            // Captured once, replayed.
            dev.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            step_launches(rows, &mut None, None)?;
            let graph = dev.stream.end_capture(sys::CUgraphInstantiate_flags(0))?.ok_or("the capture made no graph")?;
            graph.upload()?;
            let mut nodes = 0usize;
            // SAFETY: counting the nodes of a live graph (null array: count only).
            unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes) }.result()?;
            for _ in 0..20 {
                graph.launch()?;
            }
            dev.stream.synchronize()?;
            let reps = 500;
            let start = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                graph.launch()?;
            }
            let end = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            let host_us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
            end.synchronize()?;
            let graph_ms = start.elapsed_ms(&end)? as f64 / reps as f64;
            println!(
                "bench rows={rows}: {launches} launches, graph nodes {nodes}; graph replay {graph_ms:.4} ms/step ({:.0} steps/s, {:.0} tok/s at {rows} tokens/step), host {host_us:.1} us/launch call; eager {eager_ms:.3} ms/step",
                1e3 / graph_ms,
                1e3 / graph_ms * rows as f64
            );
            drop(graph);
            if dev.k.pdl() {
                // The same step without programmatic dependent launch (each launch waits for the
                // previous one to finish before it starts).
                dev.k.set_pdl(false);
                dev.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
                let launched = step_launches(rows, &mut None, None);
                let g = dev.stream.end_capture(sys::CUgraphInstantiate_flags(0));
                dev.k.set_pdl(true);
                launched?;
                let g = g?.ok_or("the capture made no graph")?;
                g.upload()?;
                for _ in 0..20 {
                    g.launch()?;
                }
                let start = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
                for _ in 0..reps {
                    g.launch()?;
                }
                let end = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
                let ms = start.elapsed_ms(&end)? as f64 / reps as f64;
                println!("bench rows={rows}: without programmatic dependent launch {ms:.4} ms/step; with it {graph_ms:.4} ms/step");
            }
            if profile {
                profile_step(dev, rows, &step_launches)?;
            }
        }
        Ok(())
    }

    /// Timing events recorded after the launches of a step, each with what the launch does.
    type Marks = Vec<(&'static str, CudaEvent)>;

    /// The bench's step: rows, timing marks to record, a kind of launch to leave out.
    type StepLaunches<'a> = dyn Fn(usize, &mut Option<Marks>, Option<&str>) -> Res<usize> + 'a;

    /// A timing event recorded on the stream as a node of the graph being captured (a plain
    /// record would be taken as a dependency between streams, not a node).
    fn record_node(dev: &Dev) -> Res<CudaEvent> {
        let ev = dev.stream.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        // SAFETY: a live event and stream of one context; the event outlives the graph's use of it
        // (both are dropped after the profile).
        unsafe { sys::cuEventRecordWithFlags(ev.cu_event(), dev.stream.cu_stream(), sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32) }.result()?;
        Ok(ev)
    }

    /// The time of each launch of a step inside its graph: an event node after every launch,
    /// the graph replayed, the gaps between consecutive events summed per label.
    fn profile_step(dev: &Dev, rows: usize, step_launches: &StepLaunches) -> Res<()> {
        dev.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let mut marks = Some(vec![("start", record_node(dev)?)]);
        let launched = step_launches(rows, &mut marks, None);
        let graph = dev.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        launched?;
        let graph = graph?.ok_or("the capture made no graph")?;
        graph.upload()?;
        let marks = marks.expect("set above");
        let mut labels: Vec<&'static str> = Vec::new();
        for (l, _) in &marks[1..] {
            if !labels.contains(l) {
                labels.push(l);
            }
        }
        let mut total = vec![0f64; labels.len()];
        let mut count = vec![0usize; labels.len()];
        let reps = 30;
        for _ in 0..5 {
            graph.launch()?;
        }
        for _ in 0..reps {
            graph.launch()?;
            dev.stream.synchronize()?;
            for w in marks.windows(2) {
                let i = labels.iter().position(|l| *l == w[1].0).expect("collected above");
                total[i] += w[0].1.elapsed_ms(&w[1].1)? as f64 * 1e3;
                count[i] += 1;
            }
        }
        // Marginal cost of each kind: the plain graph's replay time with and without its launches
        // (the results are garbage without them; the time is what matters).
        let replay_us = |skip: Option<&str>| -> Res<f64> {
            dev.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let launched = step_launches(rows, &mut None, skip);
            let g = dev.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            launched?;
            let g = g?.ok_or("the capture made no graph")?;
            g.upload()?;
            for _ in 0..10 {
                g.launch()?;
            }
            let reps = 200;
            let start = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            for _ in 0..reps {
                g.launch()?;
            }
            let end = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            Ok(start.elapsed_ms(&end)? as f64 * 1e3 / reps as f64)
        };
        let full = replay_us(None)?;
        let mut marginal = Vec::new();
        for l in &labels {
            marginal.push(full - replay_us(Some(l))?);
        }
        let step_us: f64 = total.iter().sum::<f64>() / reps as f64;
        println!("profile rows={rows}: {:.1} us/step with an event after each launch; {full:.1} us/step without; 'without' = the step's time less that without the kind's launches", step_us);
        for (i, l) in labels.iter().enumerate() {
            let per_step = total[i] / reps as f64;
            println!(
                "profile rows={rows}: {:<34} {:>3} launches {:>8.1} us/step {:>7.2} us/launch {:>5.1}%   without: {:>7.1} us/step {:>6.2} us/launch",
                l,
                count[i] / reps,
                per_step,
                total[i] / count[i] as f64,
                100.0 * per_step / step_us,
                marginal[i],
                marginal[i] / (count[i] / reps) as f64
            );
        }
        Ok(())
    }
}

/// `--quantize IN OUT`: the F16/F32 matrices of a GGUF quantized with candle's port of ggml's
/// quantizers in the mix llama-quantize's Q4_K_M makes (`token_embd` Q6_K, or Q8_0 for rows not of
/// 256; `attn_qkv` Q5_K; `attn_v` and `ffn_down` Q6_K; the rest Q4_K, or Q5_0 for rows not of
/// 256), so that a device job checks every weight type the engine reads without building
/// llama.cpp. Norms and other vectors stay as they are. Writes OUT atomically.
fn quantize_gguf(src: &std::path::Path, dst: &std::path::Path) -> Res<()> {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let cpu = candle_core::Device::Cpu;
    let mut f = std::fs::File::open(src)?;
    let content = gguf_file::Content::read(&mut f)?;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort_by_key(|n| content.tensor_infos[*n].offset);
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let t = content.tensor(&mut f, name, &cpu)?;
        let dims = t.shape().dims().to_vec();
        let float = matches!(t.dtype(), GgmlDType::F16 | GgmlDType::F32 | GgmlDType::BF16);
        let q = match (dims.as_slice(), float) {
            // The router stays f32, as llama-quantize leaves it.
            _ if name.contains("ffn_gate_inp") => t,
            // Stacked experts (`[n, rows, cols]`): the down projections Q6_K, gate and up Q4_K.
            ([_, _, cols], true) if cols % 256 == 0 => QTensor::quantize(&t.dequantize(&cpu)?, if name.contains("ffn_down") { GgmlDType::Q6K } else { GgmlDType::Q4K })?,
            ([_, cols], true) if cols % 32 == 0 => {
                let k256 = cols % 256 == 0;
                let dt = if name.ends_with("token_embd.weight") {
                    if k256 {
                        GgmlDType::Q6K
                    } else {
                        GgmlDType::Q8_0
                    }
                } else if name.ends_with("attn_qkv.weight") && k256 {
                    GgmlDType::Q5K
                } else if (name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight")) && k256 {
                    GgmlDType::Q6K
                } else if k256 {
                    GgmlDType::Q4K
                } else {
                    GgmlDType::Q5_0
                };
                QTensor::quantize(&t.dequantize(&cpu)?, dt)?
            }
            _ => t,
        };
        tensors.push((name.clone(), q));
    }
    let md: Vec<(&str, &gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let tmp = dst.with_extension("partial");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
    gguf_file::write(&mut out, &md, &t_refs)?;
    std::io::Write::flush(&mut out)?;
    drop(out);
    std::fs::rename(&tmp, dst)?;
    println!("quantized {} -> {} ({} tensors)", src.display(), dst.display(), t_refs.len());
    Ok(())
}

/// `--kv K[/V]`: the cache types the model checks' sequences store keys and values in.
static KV_TYPES: std::sync::OnceLock<KvTypes> = std::sync::OnceLock::new();

fn kv_types() -> KvTypes {
    KV_TYPES.get().copied().unwrap_or_default()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--quantize") {
        return match (args.get(i + 1), args.get(i + 2)) {
            (Some(a), Some(b)) => match quantize_gguf(std::path::Path::new(a), std::path::Path::new(b)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("tine-gpu-check: --quantize: {e}");
                    ExitCode::FAILURE
                }
            },
            _ => {
                eprintln!("tine-gpu-check: --quantize IN OUT");
                ExitCode::FAILURE
            }
        };
    }
    let profile = args.iter().any(|a| a == "--profile");
    let bench = profile || args.iter().any(|a| a == "--bench");
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let seed = value("--seed").and_then(|s| s.parse().ok()).unwrap_or(1u64);
    let table = !args.iter().any(|a| a == "--no-table");
    let lm_head = args.iter().any(|a| a == "--lm-head-bench");
    if let Some(t) = value("--kv") {
        let (k, v) = t.split_once('/').unwrap_or((&t, &t));
        match (KvStore::from_name(k), KvStore::from_name(v)) {
            (Some(k), Some(v)) => KV_TYPES.set(KvTypes { k, v }).expect("set once"),
            _ => {
                eprintln!("tine-gpu-check: --kv {t}: K[/V] of f32, f16, bf16, q8_0, q4_0");
                return ExitCode::FAILURE;
            }
        }
    }
    let result = run(table, bench, profile, seed)
        .and_then(|ok| if lm_head { lm_head_bench().map(|()| ok) } else { Ok(ok) })
        .and_then(|ok| match value("--model") {
            Some(m) => Ok(model::run(std::path::Path::new(&m), value("--ref").as_deref(), value("--assistant").as_deref())? && ok),
            None => Ok(ok),
        })
        .and_then(|ok| match value("--qwen35") {
            Some(m) => Ok(qwen35::run(std::path::Path::new(&m))? && ok),
            None => Ok(ok),
        })
        .and_then(|ok| match value("--gemma4") {
            Some(m) => Ok(gemma4::run(std::path::Path::new(&m))? && ok),
            None => Ok(ok),
        })
        .and_then(|ok| match value("--gemma4-trace") {
            Some(m) => Ok(gemma4::trace(std::path::Path::new(&m))? && ok),
            None => Ok(ok),
        })
        .and_then(|ok| match value("--batch") {
            Some(m) => Ok(batch::run(std::path::Path::new(&m))? && ok),
            None => Ok(ok),
        });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("tine-gpu-check: {e}");
            let mut src = e.source();
            while let Some(s) = src {
                eprintln!("  caused by: {s}");
                src = s.source();
            }
            ExitCode::FAILURE
        }
    }
}

fn run(table_on: bool, bench: bool, profile: bool, seed: u64) -> Res<bool> {
    // SAFETY: dlopens the driver library and closes it again (cudarc would panic without it).
    if !unsafe { sys::is_culib_present() } {
        return Err("cannot load libcuda.so.1 (the NVIDIA driver): is this a machine with an NVIDIA GPU?".into());
    }
    let ctx = CudaContext::new(0)?;
    // One stream, and no events per buffer: the engine orders everything on its stream.
    // SAFETY: no buffer here is used on another stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let k = Kernels::load(&ctx)?;
    println!("device: {} (sm {:?}), kernels built for sm_{}", ctx.name()?, ctx.compute_capability()?, tine_gpu::cuda::BUILT_FOR);
    let dev = Dev { stream, k };
    let cases = if table_on { table(&dev, seed)? } else { Vec::new() };
    let mut ok = true;
    for c in &cases {
        let bits = match c.bits {
            Some(true) => "bit-identical",
            Some(false) => "ROWS DIFFER",
            None => "-",
        };
        println!("{:<4} {:<72} err/tol {:>8.4}  rows {:<13} {}", if c.pass() { "ok" } else { "FAIL" }, c.name, c.worst, bits, c.note);
        ok &= c.pass();
    }
    println!("kernels: {} of {} cases pass (seed {seed})", cases.iter().filter(|c| c.pass()).count(), cases.len());
    if bench {
        bench::run(&dev, profile)?;
    }
    Ok(ok)
}

/// The LM head's GEMV at the vocabularies of the families (one row, the output rows of one
/// weight type), timed over 200 launches: the staged path `gemv` picks for one segment of many
/// rows, and the plain path (the same rows as two segments). Prints GB/s of weights read.
fn lm_head_bench() -> Res<()> {
    let ctx = CudaContext::new(0)?;
    // SAFETY: no buffer here is used on another stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let dev = Dev { stream, k: Kernels::load(&ctx)? };
    let mut rng = Rng(7);
    for (t, n, k) in [(WeightType::Q6K, 248320, 1024), (WeightType::Q8_0, 262144, 640), (WeightType::Q6K, 248320, 2048), (WeightType::Q4K, 248320, 1024)] {
        // 4096 random rows repeated: the access pattern of a whole table, quantized quickly.
        let tile = t.quantize(&rng.vec(4096 * k, 0.5));
        let w: Vec<u8> = tile.iter().copied().cycle().take(n * t.row_bytes(k)).collect();
        let wd = dev.up(&w)?;
        let act = ActQ8::quantize(&rng.vec(k, 1.0), 1, k);
        let (qs, qd, qsum) = act_planes(&dev, &act)?;
        let out = dev.zeros::<f32>(n)?;
        let seg = |r0: usize, rows: usize| GemvSeg {
            w: dev.ptr(&wd) + (r0 * t.row_bytes(k)) as u64,
            out: dev.ptr(&out) + (r0 * 4) as u64,
            n: rows as i32,
            wtype: t.ggml_id(),
            out_stride: n as i32,
            ..Default::default()
        };
        let planes = (dev.ptr(&qs), dev.ptr(&qd), dev.ptr(&qsum));
        let wide = dev.up(&t.to_wide(&w, k))?;
        let mut line = format!("lm head {t:?} {n} x {k} ({:.0} MB):", w.len() as f64 / 1e6);
        let variants: [(&str, Vec<GemvSeg>); 3] =
            [("staged", vec![seg(0, n)]), ("plain", vec![seg(0, n / 2), seg(n / 2, n - n / 2)]), ("wide", vec![GemvSeg { w: dev.ptr(&wide), wide: 1, ..seg(0, n) }])];
        for (name, segs) in variants {
            let launch = || -> Res<()> {
                // SAFETY: the weights hold n rows of k values (the wide copy n wide rows), the
                // planes one row, out n values.
                unsafe { dev.k.gemv(&dev.stream, 1, k, &segs, planes)? };
                Ok(())
            };
            for _ in 0..10 {
                launch()?;
            }
            let reps = 200;
            let start = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            for _ in 0..reps {
                launch()?;
            }
            let end = dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            end.synchronize()?;
            let us = start.elapsed_ms(&end)? as f64 * 1e3 / reps as f64;
            line.push_str(&format!(" {name} {us:.1} us ({:.0} GB/s);", w.len() as f64 / us / 1e3));
        }
        println!("{line}");
    }
    Ok(())
}

/// A `qwen35` GGUF on the engine: graph nodes per step, decode speed, a verify step of 2..=8
/// rows against one-row steps bit for bit (logits and, after rolling back to each row, every
/// delta-net layer's conv window and state), and a prompt step against one-row steps.
/// What a NextN head's entries give run in steps of 1, of [`MAX_ROWS`] and all at once over the
/// same input states (`hidden`, rows of `width`) and next tokens.
struct NextNEntries {
    /// Steps of 8 give one at a time's bits (each step's last logits, every output state).
    steps_same: bool,
    /// One prompt step against one at a time: the last logits and the output states, the largest
    /// difference over the largest value; whether the draft ids agree.
    d_logits: f64,
    d_out: f64,
    id_same: bool,
    /// One at a time: the last entry's logits and every output state.
    last: Vec<f32>,
    out: Vec<f32>,
}

/// Runs [`NextNEntries`]' three ways with `forward(reset, hidden, tokens)`: `reset` empties the
/// head's cache before a way's first step.
fn nextn_entries(width: usize, hidden: &[f32], next: &[u32], mut forward: impl FnMut(bool, &[f32], &[u32]) -> Res<(Vec<f32>, Vec<f32>)>) -> Res<NextNEntries> {
    let mut entries = |step: usize| -> Res<(Vec<Vec<f32>>, Vec<f32>)> {
        let (mut logits, mut outs) = (Vec::new(), Vec::new());
        for (i, chunk) in next.chunks(step).enumerate() {
            let (l, o) = forward(i == 0, &hidden[i * step * width..(i * step + chunk.len()) * width], chunk)?;
            logits.push(l);
            outs.extend(o);
        }
        Ok((logits, outs))
    };
    let (one, one_out) = entries(1)?;
    let (eight, eight_out) = entries(MAX_ROWS)?;
    let (all, all_out) = entries(next.len())?;
    let bits = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let steps_same = bits(&eight_out, &one_out) && eight.iter().enumerate().all(|(i, l)| bits(l, &one[(i * MAX_ROWS + MAX_ROWS - 1).min(one.len() - 1)]));
    let rel = |got: &[f32], want: &[f32]| {
        let scale = want.iter().fold(1e-6f32, |a, v| a.max(v.abs())) as f64;
        got.iter().zip(want).fold(0f64, |a, (x, y)| a.max((*x as f64 - *y as f64).abs())) / scale
    };
    let last = one.last().expect("entries").clone();
    Ok(NextNEntries { steps_same, d_logits: rel(&all[0], &last), d_out: rel(&all_out, &one_out), id_same: reference::argmax(&all[0]) == reference::argmax(&last), last, out: one_out })
}

mod qwen35 {
    use super::*;
    use tine_gpu::qwen35::{Qwen35Cache, Qwen35Gpu};

    fn prompt(vocab: usize) -> Vec<u32> {
        (0..21u32).map(|i| (i * 7919 + 13) % vocab as u32).collect()
    }

    /// The prompt in one-row steps, then `n` greedy one-row steps: the ids, each step's logits
    /// and each step's recurrent state.
    #[allow(clippy::type_complexity)]
    fn one_rows(g: &Qwen35Gpu, c: &mut Qwen35Cache, prompt: &[u32], n: usize) -> Res<(Vec<u32>, Vec<Vec<f32>>, Vec<Vec<(Vec<f32>, Vec<f32>)>>)> {
        let mut next = 0;
        for &t in prompt {
            g.forward(c, &[t])?;
            next = g.argmax(c)?[0];
        }
        let (mut ids, mut rows, mut states) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..n {
            ids.push(next);
            g.forward(c, &[next])?;
            rows.push(g.logits(c)?);
            states.push(g.read_state(c)?);
            next = g.argmax(c)?[0];
        }
        Ok((ids, rows, states))
    }

    pub fn run(path: &std::path::Path) -> Res<bool> {
        let g = Qwen35Gpu::load(path, 0, 4096)?;
        let cfg = g.config().clone();
        println!(
            "qwen35 {}: {} layers ({} full attention), hidden {}, vocab {}, state planes {:.1} MiB a sequence",
            path.display(),
            cfg.layers,
            cfg.full_attention.iter().filter(|&&f| f).count(),
            cfg.hidden,
            cfg.vocab,
            g.state_bytes() as f64 / (1 << 20) as f64
        );
        let mut ok = true;
        let mut c = g.new_cache_typed(4096, kv_types())?;
        for rows in [1, 4, 8] {
            println!("graph nodes, {rows} rows: {}", g.graph_nodes(&mut c, rows)?);
        }
        let p = prompt(cfg.vocab);
        // One-row steps: the reference for every check below.
        let mut c1 = g.new_cache_typed(4096, kv_types())?;
        let (ids, rows, states) = one_rows(&g, &mut c1, &p, MAX_ROWS)?;
        // Verify steps of m rows after the prompt: each row's logits equal the one-row step's,
        // and rolling back to each row gives that step's state, bit for bit.
        for m in 2..=MAX_ROWS {
            let mut cv = g.new_cache_typed(4096, kv_types())?;
            for &t in &p {
                g.forward(&mut cv, &[t])?;
            }
            g.forward(&mut cv, &ids[..m])?;
            let logits = g.logits(&cv)?;
            let vocab = cfg.vocab;
            let mut same = (0..m).all(|r| logits[r * vocab..(r + 1) * vocab].iter().zip(&rows[r]).all(|(a, b)| a.to_bits() == b.to_bits()));
            for j in (1..=m).rev() {
                if !cv.truncate(p.len() + j) {
                    same = false;
                    println!("FAIL verify {m} rows: cannot roll back to row {j}");
                    continue;
                }
                let st = g.read_state(&cv)?;
                same &= st.iter().zip(&states[j - 1]).all(|((w, s), (w1, s1))| w.iter().zip(w1).chain(s.iter().zip(s1)).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
            // Decoding on from a rollback to row 1 gives the one-row path's next logits.
            cv.truncate(p.len() + 1);
            g.forward(&mut cv, &[ids[1]])?;
            same &= g.logits(&cv)?.iter().zip(&rows[1]).all(|(a, b)| a.to_bits() == b.to_bits());
            println!(
                "{} verify {m} rows vs one-row steps: logits, states after a rollback to each row, and the step after: {}",
                if same { "ok  " } else { "FAIL" },
                if same { "bit-identical" } else { "DIFFER" }
            );
            ok &= same;
        }
        // A prompt step (the prompt GEMM and the delta-net over all its rows) against one-row
        // steps: the next token's logits to float rounding.
        let mut cp = g.new_cache_typed(4096, kv_types())?;
        g.forward_prompt(&mut cp, &p)?;
        let last = g.logits_row(&cp, p.len() - 1)?;
        let mut c2 = g.new_cache_typed(4096, kv_types())?;
        for &t in &p {
            g.forward(&mut c2, &[t])?;
        }
        let want = g.logits(&c2)?;
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = last.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let pass = err <= 2e-2 * scale;
        println!(
            "{} prompt step of {} rows vs one-row steps: max |diff| {err:.3e} (logits up to {scale:.3e}), argmax {} vs {}",
            if pass { "ok  " } else { "FAIL" },
            p.len(),
            reference::argmax(&last),
            reference::argmax(&want)
        );
        ok &= pass;
        // Decode speed: 256 greedy one-row steps on graphs.
        let mut cs = g.new_cache_typed(4096, kv_types())?;
        g.forward_prompt(&mut cs, &p)?;
        let mut next = g.argmax(&cs)?[0];
        for _ in 0..8 {
            g.forward(&mut cs, &[next])?;
            next = g.argmax(&cs)?[0];
        }
        let n = 256;
        let t0 = std::time::Instant::now();
        for _ in 0..n {
            g.forward(&mut cs, &[next])?;
            next = g.argmax(&cs)?[0];
        }
        let dt = t0.elapsed().as_secs_f64();
        let step = dt / n as f64;
        println!("decode: {n} tokens in {:.1} ms: {:.3} ms a token, {:.1} tok/s", dt * 1e3, step * 1e3, n as f64 / dt);
        // Where a step's time goes: each kind of launch, summed over a one-row and a 4-row step
        // launched with an event after each launch (the median of 5).
        for m in [1, 4] {
            let mut runs = Vec::new();
            for _ in 0..5 {
                let at = cs.len();
                runs.push(g.profile(&mut cs, &ids[..m])?);
                cs.truncate(at + 1);
            }
            let kinds: Vec<&str> = runs[0].iter().map(|(k, _)| *k).collect();
            let mut total = 0.0;
            let mut line = String::new();
            for (i, k) in kinds.iter().enumerate() {
                let mut v: Vec<f64> = runs.iter().map(|r| r[i].1).collect();
                v.sort_by(f64::total_cmp);
                total += v[2];
                line.push_str(&format!(" {k} {:.1};", v[2]));
            }
            println!("profile, {m} rows (us, summed per kind):{line} total {total:.1}");
        }
        // A verify step of 4 and of 8 rows, timed against a one-row step.
        for m in [4, 8] {
            let reps = 50;
            let at = cs.len();
            g.forward(&mut cs, &ids[..m])?;
            cs.truncate(at + 1);
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                let at = cs.len();
                g.forward(&mut cs, &ids[..m])?;
                g.argmax(&cs)?;
                cs.truncate(at + 1);
            }
            let dt = t0.elapsed().as_secs_f64() / reps as f64;
            println!("verify {m} rows + rollback: {:.3} ms ({:.2}x a one-row step)", dt * 1e3, dt / step);
        }
        if g.has_nextn() {
            ok &= nextn(&g, &mut cs, step)?;
        }
        Ok(ok)
    }

    /// The NextN head on the engine: entries in steps of 8 against one at a time (bit for bit),
    /// all of a 40-token prompt's entries in one prompt step against one at a time (to float
    /// rounding), graph nodes, and a one-entry step's time against the trunk's one-row `step`.
    fn nextn(g: &Qwen35Gpu, c: &mut Qwen35Cache, step: f64) -> Res<bool> {
        let mut ok = true;
        let mut nc = g.new_nextn_cache_typed(4096, kv_types())?.ok_or("the NextN head is off the engine (TINE_GPU_NEXTN=0)")?;
        let width = g.config().hidden;
        let prompt: Vec<u32> = (0..40u32).map(|i| (100 + (i * 7919) % 20000) % g.config().vocab as u32).collect();
        c.truncate(0);
        let mut hidden = Vec::new();
        for chunk in prompt.chunks(MAX_ROWS) {
            g.forward(c, chunk)?;
            hidden.extend(g.hidden(c)?);
        }
        let next: Vec<u32> = prompt[1..].iter().copied().chain([prompt[0]]).collect();
        let e = nextn_entries(width, &hidden, &next, |reset, h, t| {
            if reset {
                nc.truncate(0);
            }
            Ok(g.nextn_forward(&mut nc, h, t)?)
        })?;
        println!(
            "{} NextN entries in steps of 8 against one at a time (logits of each step's last entry, every output state): {}",
            if e.steps_same { "ok  " } else { "FAIL" },
            if e.steps_same { "bit-identical" } else { "DIFFER" }
        );
        ok &= e.steps_same;
        let pass = e.d_logits < 0.1 && e.d_out < 0.1 && e.id_same;
        println!(
            "{} NextN's {} entries in one prompt step against one at a time: last logits {:.2e}, output states {:.2e} of the largest value, draft id {}",
            if pass { "ok  " } else { "FAIL" },
            next.len(),
            e.d_logits,
            e.d_out,
            if e.id_same { "agrees" } else { "DIFFERS" }
        );
        ok &= pass;
        for rows in [1, 4] {
            println!("NextN graph nodes, {rows} entries: {}", g.nextn_graph_nodes(&mut nc, rows)?);
        }
        // A draft step: one entry chained on the head's own output state.
        nc.truncate(0);
        let (_, mut h) = g.nextn_forward(&mut nc, &hidden[..width], &next[..1])?;
        let reps = 200;
        let t0 = std::time::Instant::now();
        for i in 0..reps {
            let (_, o) = g.nextn_forward(&mut nc, &h, &next[(i + 1) % next.len()..][..1])?;
            h = o;
        }
        let dt = t0.elapsed().as_secs_f64() / reps as f64;
        println!("NextN draft step (one entry, logits and output state read back): {:.3} ms ({:.2}x a one-row trunk step)", dt * 1e3, dt / step);
        Ok(ok)
    }
}

/// The real model on the engine.
mod model {
    use super::*;
    use tine_gpu::gemma3::{Gemma3Gpu, GpuCache};

    fn top2_gap(row: &[f32]) -> f32 {
        let best = reference::argmax(row);
        let second = row.iter().enumerate().filter(|(i, _)| *i != best).map(|(_, v)| *v).fold(f32::NEG_INFINITY, f32::max);
        row[best] - second
    }

    /// Greedy decoding: prompt in steps of up to 8 rows, then `n` one-row steps. Returns the ids,
    /// the logits row each id was chosen from and the row after the last, and the decode time.
    fn greedy(g: &Gemma3Gpu, c: &mut GpuCache, prompt: &[u32], n: usize) -> Res<(Vec<u32>, Vec<Vec<f32>>, f64)> {
        c.truncate(0);
        let mut next = 0;
        let vocab = g.config().vocab;
        let mut first = Vec::new();
        for chunk in prompt.chunks(MAX_ROWS) {
            g.forward(c, chunk)?;
            next = *g.argmax(c)?.last().expect("a step has rows");
            first = g.logits(c)?[(chunk.len() - 1) * vocab..].to_vec();
        }
        let mut ids = Vec::new();
        // rows[0]: the row `ids[0]` was chosen from; rows[i + 1]: the row after feeding ids[i].
        let mut rows = vec![first];
        let t0 = std::time::Instant::now();
        for _ in 0..n {
            ids.push(next);
            g.forward(c, &[next])?;
            rows.push(g.logits(c)?);
            next = g.argmax(c)?[0];
        }
        Ok((ids, rows, t0.elapsed().as_secs_f64()))
    }

    /// The NextN head on the engine: its graph's launches, entries in steps of 1, 8 and all at
    /// once (the prompt kernels) over the trunk's hidden states, and a chained step's time.
    fn nextn(g: &Gemma3Gpu, c: &mut GpuCache) -> Res<bool> {
        let mut ok = true;
        let mut nc = g.new_nextn_cache_typed(4096, kv_types())?.ok_or("the model has a NextN head")?;
        let nodes: Vec<usize> = [1, 4, 8].iter().map(|&m| g.nextn_graph_nodes(&mut nc, m)).collect::<Result<_, _>>()?;
        let pass = nodes.iter().all(|&n| n == 14);
        println!("model: NextN graph nodes per step (1, 4, 8 entries): {nodes:?}, expected 14: {}", if pass { "ok" } else { "FAIL" });
        ok &= pass;
        let width = g.config().hidden;
        let prompt: Vec<u32> = (0..40u32).map(|i| (100 + (i * 7919) % 20000) % g.config().vocab as u32).collect();
        c.truncate(0);
        let mut hidden = Vec::new();
        for chunk in prompt.chunks(MAX_ROWS) {
            g.forward(c, chunk)?;
            hidden.extend(g.hidden(c)?);
        }
        let next: Vec<u32> = prompt[1..].iter().copied().chain([236761]).collect();
        let e = nextn_entries(width, &hidden, &next, |reset, h, t| {
            if reset {
                nc.truncate(0);
            }
            Ok(g.nextn_forward(&mut nc, h, t)?)
        })?;
        println!("model: NextN entries in steps of 8 against one at a time (logits of each step's last entry, every output state): {}", if e.steps_same { "bit-identical" } else { "DIFFER" });
        ok &= e.steps_same;
        let pass = e.d_logits < 0.1 && e.d_out < 0.1 && e.id_same;
        println!(
            "model: NextN's {} entries in one prompt step against one at a time: last logits {:.2e}, output states {:.2e} of the largest value, draft id {}: {}",
            next.len(),
            e.d_logits,
            e.d_out,
            if e.id_same { "agrees" } else { "DIFFERS" },
            if pass { "ok" } else { "FAIL" }
        );
        ok &= pass;
        // A chained draft step: one entry on the head's own output, logits and state read back.
        let mut h = e.out[e.out.len() - width..].to_vec();
        let token = |row: usize| g.nextn_draft_vocab().map_or(row as u32, |v| v[row]);
        let mut t = token(reference::argmax(&e.last));
        nc.truncate(next.len());
        let reps = 200;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            if nc.len() + 1 > 4096 {
                nc.truncate(next.len());
            }
            let (l, o) = g.nextn_forward(&mut nc, &h, &[t])?;
            t = token(reference::argmax(&l));
            h = o;
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
        println!("model: NextN chained draft step (one entry, logits over {} tokens and the state read back): {us:.1} us", g.nextn_draft_vocab().map_or(g.config().vocab, <[u32]>::len));
        Ok(ok)
    }

    /// A GGUF's tensors read back on the host: dequantized (norms, projections) or one row of a
    /// quantized matrix dequantized (the target's embedding).
    struct HostGguf {
        content: candle_core::quantized::gguf_file::Content,
        file: std::fs::File,
    }

    impl HostGguf {
        fn open(path: &std::path::Path) -> Res<HostGguf> {
            let mut file = std::fs::File::open(path)?;
            let content = candle_core::quantized::gguf_file::Content::read(&mut file)?;
            Ok(HostGguf { content, file })
        }
        fn has(&self, name: &str) -> bool {
            self.content.tensor_infos.contains_key(name)
        }
        fn all(&mut self, name: &str) -> Res<Vec<f32>> {
            let t = self.content.tensor(&mut self.file, name, &candle_core::Device::Cpu)?;
            Ok(t.dequantize(&candle_core::Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
        }
        fn row(&mut self, name: &str, row: usize, k: usize) -> Res<Vec<f32>> {
            let t = self.content.tensor(&mut self.file, name, &candle_core::Device::Cpu)?;
            let wt = WeightType::from_ggml(t.dtype()).ok_or("a weight type the engine reads")?;
            let rb = wt.row_bytes(k);
            Ok(wt.dequantize(&t.data()?[row * rb..(row + 1) * rb]))
        }
    }

    /// `w` (`n` rows of `k`, row-major) times `x`, in float64.
    fn matvec(w: &[f32], n: usize, k: usize, x: &[f64]) -> Vec<f64> {
        (0..n).map(|i| w[i * k..(i + 1) * k].iter().zip(x).map(|(a, b)| *a as f64 * b).sum()).collect()
    }

    /// One assistant draft step in float64 from the head's dequantized weights, the trunk's K/V
    /// and embedding row: the math of candle's `quantized_gemma3_assistant` (and of
    /// `launch_assistant`), with none of the engine's Q8 activations. Returns the logits and the
    /// next hidden state.
    #[allow(clippy::too_many_arguments)]
    fn assistant_ref(g: &Gemma3Gpu, head: &mut HostGguf, target: &mut HostGguf, kv: &[(Vec<f32>, Vec<f32>)], len: usize, hidden: &[f32], token: u32, position: usize) -> Res<(Vec<f64>, Vec<f64>)> {
        let c = g.config();
        let arch = head.content.metadata.get("general.architecture").ok_or("an architecture")?.to_string()?.clone();
        let md = |k: &str| -> Res<usize> { Ok(head.content.metadata.get(&format!("{arch}.{k}")).ok_or(format!("{arch}.{k}"))?.to_u32()? as usize) };
        let (n, n_head, ff, blocks) = (md("embedding_length")?, md("attention.head_count")?, md("feed_forward_length")?, md("block_count")?);
        let pattern: Option<Vec<bool>> = match head.content.metadata.get(&format!("{arch}.attention.sliding_window_pattern")) {
            Some(candle_core::quantized::gguf_file::Value::Array(vs)) => Some(vs.iter().map(|v| v.to_bool()).collect::<Result<_, _>>()?),
            _ => None,
        };
        let (h, hd, eps) = (c.hidden, c.head_dim, c.eps as f64);
        let mut input: Vec<f64> = target.row("token_embd.weight", token as usize, h)?.iter().map(|&v| v as f64 * (h as f64).sqrt()).collect();
        input.extend(hidden.iter().map(|&v| v as f64));
        let pre = if head.has("nextn.pre_projection.weight") { "nextn.pre_projection.weight" } else { "mtp.pre_projection.weight" };
        let mut x = matvec(&head.all(pre)?, n, 2 * h, &input);
        let last_local = (0..c.layers).rev().find(|&l| c.is_local(l)).unwrap_or(c.layers - 1);
        let last_global = (0..c.layers).rev().find(|&l| !c.is_local(l)).unwrap_or(c.layers - 1);
        for i in 0..blocks {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let local = pattern.as_ref().map_or((i + 1) % 6 > 0, |pat| pat.get(i).copied().unwrap_or(false));
            let src = if local { last_local } else { last_global };
            let y = reference::rms_norm(&x, &head.all(&p("attn_norm"))?, eps);
            let q = matvec(&head.all(&p("attn_q"))?, n_head * hd, n, &y);
            let qn = head.all(&p("attn_q_norm"))?;
            let inv = reference::inv_freq(hd, if c.is_local(src) { c.rope_local } else { c.rope_global } as f64);
            let q: Vec<f64> = (0..n_head).flat_map(|hh| reference::rope(&reference::rms_norm(&q[hh * hd..(hh + 1) * hd], &qn, eps), position, &inv)).map(|v| v / (hd as f64).sqrt()).collect();
            // Keys [max(0, position + 1 - window), len): the reference's window ending at len - 1.
            let window = if c.is_local(src) { c.window } else { 0 };
            let lo = if window > 0 { (position + 1).saturating_sub(window) } else { 0 };
            let attn = reference::attention(&q, &kv[src].0, &kv[src].1, len, n_head, c.n_kv, hd, len - 1, if lo == 0 { 0 } else { len - lo });
            let o = matvec(&head.all(&p("attn_output"))?, n, n_head * hd, &attn);
            let on = reference::rms_norm(&o, &head.all(&p("post_attention_norm"))?, eps);
            let y2: Vec<f64> = x.iter().zip(&on).map(|(a, b)| a + b).collect();
            let f = reference::rms_norm(&y2, &head.all(&p("ffn_norm"))?, eps);
            let (gate, up) = (matvec(&head.all(&p("ffn_gate"))?, ff, n, &f), matvec(&head.all(&p("ffn_up"))?, ff, n, &f));
            let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| reference::gelu_tanh(*g) * u).collect();
            let z = reference::rms_norm(&matvec(&head.all(&p("ffn_down"))?, n, ff, &act), &head.all(&p("post_ffw_norm"))?, eps);
            let scale = if head.has(&p("layer_output_scale")) { head.all(&p("layer_output_scale"))?[0] as f64 } else { 1.0 };
            x = y2.iter().zip(&z).map(|(a, b)| (a + b) * scale).collect();
        }
        let rows = head.content.tensor_infos["token_embd.weight"].shape.dims()[0];
        let logits = matvec(&head.all("token_embd.weight")?, rows, n, &reference::rms_norm(&x, &head.all("output_norm.weight")?, eps));
        let post = if head.has("nextn.post_projection.weight") { "nextn.post_projection.weight" } else { "mtp.post_projection.weight" };
        Ok((logits, matvec(&head.all(post)?, h, n, &x)))
    }

    /// An assistant head on the engine: its graph's launches, three chained draft steps against
    /// float64 (each step from the engine's own previous output), the same steps again bit for
    /// bit, and a step's time.
    fn assistant(g: &Gemma3Gpu, c: &mut GpuCache, model: &std::path::Path, path: &std::path::Path) -> Res<bool> {
        let mut ok = true;
        let head = g.load_assistant(path)?;
        let prompt: Vec<u32> = (0..40u32).map(|i| (100 + (i * 7919) % 20000) % g.config().vocab as u32).collect();
        c.truncate(0);
        let mut hidden = Vec::new();
        for chunk in prompt.chunks(MAX_ROWS) {
            g.forward(c, chunk)?;
            hidden = g.hidden(c)?;
        }
        let mut pending = g.argmax(c)?.last().copied().ok_or("a step has rows")?;
        let width = g.config().hidden;
        let h0 = hidden[hidden.len() - width..].to_vec();
        let nodes = g.assistant_graph_nodes(&head, c)?;
        let pass = nodes == head.launches();
        println!("model: assistant graph nodes per draft step: {nodes}, expected {}: {}", head.launches(), if pass { "ok" } else { "FAIL" });
        ok &= pass;
        let n = c.len();
        let kv = g.read_kv(c)?;
        let (mut hg, mut tg) = (HostGguf::open(path)?, HostGguf::open(model)?);
        let token = |row: usize| head.draft_vocab().map_or(row as u32, |v| v[row]);
        let chain = |pending: u32| -> Res<Vec<(Vec<f32>, Vec<f32>)>> {
            let (mut h, mut t, mut out) = (h0.clone(), pending, Vec::new());
            for j in 0..3 {
                let (l, o) = g.assistant_step(&head, c, &h, t, n + j)?;
                t = token(reference::argmax(&l));
                h = o.clone();
                out.push((l, o));
            }
            Ok(out)
        };
        let first = chain(pending)?;
        let again = chain(pending)?;
        let bits = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let same = first.iter().zip(&again).all(|(a, b)| bits(&a.0, &b.0) && bits(&a.1, &b.1));
        println!("model: assistant draft steps repeated: {}", if same { "bit-identical" } else { "DIFFER" });
        ok &= same;
        let mut h = h0.clone();
        for (j, (l, o)) in first.iter().enumerate() {
            let (wl, wo) = assistant_ref(g, &mut hg, &mut tg, &kv, n, &h, pending, n + j)?;
            let rel = |got: &[f32], want: &[f64]| got.iter().zip(want).fold(0f64, |a, (x, y)| a.max((*x as f64 - y).abs())) / want.iter().fold(1e-9f64, |a, v| a.max(v.abs()));
            let (dl, dh) = (rel(l, &wl), rel(o, &wo));
            let (gi, wi) = (reference::argmax(l), (0..wl.len()).fold(0, |b, i| if wl[i] > wl[b] { i } else { b }));
            let mut sorted = wl.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let gap = (sorted[0] - sorted[1]) / sorted[0].abs().max(1e-9);
            // The bound tine-runtime's CUDA tests hold the engine to against the CPU path (a tenth
            // of the largest value): the head quantizes un-normed inputs (the trunk's hidden state,
            // the residual for post_projection) to Q8 where float64 keeps them exact. Step 0
            // measured 5.3e-2 on the default model (a first bound of 0.05 failed it) with the
            // draft id equal to float64's.
            let pass = dl < 0.1 && dh < 0.1 && (gi == wi || gap < 0.05);
            println!(
                "model: assistant draft step {j} (position {}) against float64: logits {dl:.2e}, next hidden {dh:.2e} of the largest value, draft {} (float64 {}, its top-2 gap {gap:.3}): {}",
                n + j,
                token(gi),
                token(wi),
                if pass { "ok" } else { "FAIL" }
            );
            ok &= pass;
            h = o.clone();
            pending = token(gi);
        }
        let reps = 200;
        let t0 = std::time::Instant::now();
        let (mut hh, mut t) = (h0.clone(), pending);
        for r in 0..reps {
            let (l, o) = g.assistant_step(&head, c, &hh, t, n + r % 3)?;
            t = token(reference::argmax(&l));
            hh = o;
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
        println!("model: assistant draft step (logits over {} tokens and the state read back): {us:.1} us", head.draft_vocab().map_or(g.config().vocab, <[u32]>::len));
        Ok(ok)
    }

    pub fn run(path: &std::path::Path, refs: Option<&str>, assistant_path: Option<&str>) -> Res<bool> {
        let t0 = std::time::Instant::now();
        let g = Gemma3Gpu::load(path, 0, 4096)?;
        let mut c = g.new_cache_typed(4096, kv_types())?;
        println!("model: {} loaded in {:.2} s: {:?}", path.display(), t0.elapsed().as_secs_f64(), g.config());
        let nodes: Vec<String> = [1, 2, 4, 8].iter().map(|&m| g.graph_nodes(&mut c, m).map(|n| format!("{m} rows: {n}"))).collect::<Result<_, _>>()?;
        println!("model: graph nodes per step: {}", nodes.join(", "));
        let mut ok = true;
        // Gemma 3 ids (wrapped into a smaller vocabulary: the random small shapes).
        let prompt: Vec<u32> = [2u32, 818, 3925, 529, 506, 19129, 3798, 13244].iter().map(|&t| t % g.config().vocab as u32).collect();
        let (ids, _, _) = greedy(&g, &mut c, &prompt, 8)?;
        let n = 256;
        let (_, _, secs) = greedy(&g, &mut c, &prompt, n)?;
        println!("model: greedy decode {n} tokens after an 8-token prompt, logits row copied each step: {:.1} tok/s ({:.3} ms/token)", n as f64 / secs, secs * 1e3 / n as f64);
        // The id only (what a greedy request needs), read back every step.
        c.truncate(prompt.len());
        let mut next = ids[0];
        let t0 = std::time::Instant::now();
        for _ in 0..n {
            g.forward(&mut c, &[next])?;
            next = g.argmax(&c)?[0];
        }
        let secs = t0.elapsed().as_secs_f64();
        println!("model: greedy decode, id read back each step: {:.1} tok/s ({:.3} ms/token)", n as f64 / secs, secs * 1e3 / n as f64);
        // Steps back to back without reading anything: the device's time per step.
        for rows in [1usize, 4, 8] {
            c.truncate(prompt.len());
            g.synchronize()?;
            let t0 = std::time::Instant::now();
            let reps = n / rows;
            for _ in 0..reps {
                g.forward(&mut c, &ids[..rows])?;
            }
            g.synchronize()?;
            let ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
            println!("model: {rows}-row steps back to back (no read-back): {ms:.3} ms/step, {:.0} tok/s", rows as f64 * 1e3 / ms);
        }
        // A sampled step's top-k on the device against the row's own sort, and its speed.
        c.truncate(prompt.len());
        g.forward(&mut c, &[ids[0]])?;
        let row = g.logits(&c)?;
        c.truncate(prompt.len());
        let top = g.forward_top_k(&mut c, &[ids[0]], &[], 40)?;
        let mut want: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        want.truncate(40);
        let same = top.len() == 40 && top.iter().zip(&want).all(|(a, b)| a.0 == b.0 && a.1.to_bits() == b.1.to_bits());
        println!("model: top-40 of a step on the device: {}", if same { "the row's own 40 best, bit for bit" } else { "DIFFERS from the row's sort" });
        ok &= same;
        c.truncate(prompt.len());
        let mut next = ids[0];
        let t0 = std::time::Instant::now();
        for _ in 0..n {
            let top = g.forward_top_k(&mut c, &[next], &[], 40)?;
            next = top[0].0;
        }
        let secs = t0.elapsed().as_secs_f64();
        println!("model: decode with the top-40 read back each step (a sampled request's step): {:.1} tok/s ({:.3} ms/token)", n as f64 / secs, secs * 1e3 / n as f64);
        // A sampled verify step: every row's top-40 against that row's own sort, banned ids left
        // out, then the time of an 8-row step with them read back.
        let top_of = |row: &[f32], banned: &[u32]| {
            let mut want: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &v)| (i as u32, v)).filter(|(i, _)| !banned.contains(i)).collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            want.truncate(40);
            want
        };
        let vocab = g.config().vocab;
        let mut same = true;
        for m in [1usize, 3, MAX_ROWS] {
            c.truncate(prompt.len());
            g.forward(&mut c, &ids[..m])?;
            let rows = g.logits(&c)?;
            let banned = [top_of(&rows[..vocab], &[])[0].0, 1];
            c.truncate(prompt.len());
            let got = g.forward_top_k_all(&mut c, &ids[..m], &banned, 40)?;
            same &= got.len() == m && got.iter().enumerate().all(|(j, top)| *top == top_of(&rows[j * vocab..(j + 1) * vocab], &banned));
        }
        println!("model: every row's top-40 of 1-, 3- and 8-row steps, banned ids out: {}", if same { "each row's own 40 best, bit for bit" } else { "DIFFER from the rows' sorts" });
        ok &= same;
        c.truncate(prompt.len());
        let reps = 64;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            c.truncate(prompt.len());
            g.forward_top_k_all(&mut c, &ids[..MAX_ROWS], &[], 40)?;
        }
        println!("model: 8-row step with every row's top-40 read back: {:.3} ms", t0.elapsed().as_secs_f64() * 1e3 / reps as f64);
        // Verify rows: steps of M rows against the one-row steps, bit for bit.
        let (ids, rows, _) = greedy(&g, &mut c, &prompt, 24)?;
        for m in 2..=MAX_ROWS {
            c.truncate(prompt.len());
            let mut same = true;
            for (k, chunk) in ids.chunks(m).enumerate() {
                g.forward(&mut c, chunk)?;
                let got = g.logits(&c)?;
                for j in 0..chunk.len() {
                    let want = &rows[k * m + j + 1];
                    same &= got[j * vocab..(j + 1) * vocab].iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                }
            }
            println!("model: verify steps of {m} rows over 24 tokens: {}", if same { "bit-identical to one-row steps" } else { "DIFFER from one-row steps" });
            ok &= same;
        }
        // A 512-token prompt: every step through the full program, then every step but the last
        // through the trunk alone (what prefill runs); the next step's logits must not change.
        let long: Vec<u32> = (0..512u32).map(|i| (100 + (i * 7919) % 20000) % vocab as u32).collect();
        let mut after = Vec::new();
        for trunk in [false, true] {
            c.truncate(0);
            g.synchronize()?;
            let t0 = std::time::Instant::now();
            let chunks = long.chunks(MAX_ROWS).count();
            for (i, chunk) in long.chunks(MAX_ROWS).enumerate() {
                if trunk && i + 1 < chunks {
                    g.forward_trunk(&mut c, chunk)?;
                } else {
                    g.forward(&mut c, chunk)?;
                }
            }
            g.synchronize()?;
            let secs = t0.elapsed().as_secs_f64();
            println!(
                "model: 512-token prompt in 8-row steps, {}: {:.1} ms, {:.0} tok/s",
                if trunk { "trunk alone before the last step" } else { "every step with the LM head" },
                secs * 1e3,
                512.0 / secs
            );
            g.forward(&mut c, &[ids[0]])?;
            after.push(g.logits(&c)?);
        }
        let same = after[0].iter().zip(&after[1]).all(|(a, b)| a.to_bits() == b.to_bits());
        println!("model: the step after a trunk-alone prompt: {}", if same { "bit-identical" } else { "DIFFERS" });
        ok &= same;
        let kv_steps = g.read_kv(&c)?;
        // The same prompt as prompt steps (up to prompt_rows rows each, no graph; the GEMMs on
        // the tensor cores, summed in another order): the last row's logits, the K/V and the next
        // step against the 8-row steps', to float rounding. `near` gives the largest difference
        // over the largest magnitude of the reference, and whether the greedy ids agree (or the
        // reference's top-2 gap is under 0.1, a near-tie rounding may turn).
        let pr = g.prompt_rows();
        let near = |got: &[f32], want: &[f32]| -> (f64, bool) {
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-6) as f64;
            let diff = got.iter().zip(want).fold(0f64, |a, (x, y)| a.max((*x as f64 - *y as f64).abs()));
            let same_id = reference::argmax(got) == reference::argmax(want) || top2_gap(want) < 0.1;
            (diff / scale, same_id)
        };
        c.truncate(0);
        let mut last_row = Vec::new();
        let chunks = long.chunks(pr).count();
        for (i, chunk) in long.chunks(pr).enumerate() {
            if i + 1 < chunks {
                g.forward_trunk(&mut c, chunk)?;
            } else {
                g.forward_prompt(&mut c, chunk)?;
                last_row = g.logits_row(&c, chunk.len() - 1)?;
            }
        }
        g.forward(&mut c, &[ids[0]])?;
        let next = g.logits(&c)?;
        let kv_prompt = g.read_kv(&c)?;
        c.truncate(0);
        for chunk in long.chunks(MAX_ROWS) {
            g.forward(&mut c, chunk)?;
        }
        let want_last = g.logits(&c)?[(long.len() - 1) % MAX_ROWS * vocab..][..vocab].to_vec();
        let (d_last, id_last) = near(&last_row, &want_last);
        let (d_next, id_next) = near(&next, &after[0]);
        let d_kv = kv_steps.iter().zip(&kv_prompt).map(|((k1, v1), (k2, v2))| near(k2, k1).0.max(near(v2, v1).0)).fold(0f64, f64::max);
        // Bounds: the Q8 activations, re-quantized at every layer, carry a rounding difference
        // on through 18 layers (measured: logits 4e-2, K/V 1.1e-1); tine-runtime's CUDA test
        // holds the engine's K/V to the CPU's at 0.2 the same way.
        let pass = id_last && id_next && d_last < 0.1 && d_next < 0.1 && d_kv < 0.2;
        println!(
            "model: 512-token prompt in prompt steps of up to {pr} rows against 8-row steps: last row's logits {d_last:.2e}, next step {d_next:.2e}, K/V {d_kv:.2e} (largest difference over largest value), greedy ids {}: {}",
            if id_last && id_next { "agree" } else { "DIFFER" },
            if pass { "ok" } else { "FAIL" }
        );
        ok &= pass;
        // A prompt step after 8 positions, across window and chunk edges.
        let tail: Vec<u32> = (0..700u32).map(|i| (50 + (i * 104729) % 30000) % vocab as u32).collect();
        let mut rows_after = Vec::new();
        for wide in [false, true] {
            c.truncate(0);
            g.forward(&mut c, &prompt)?;
            for chunk in tail.chunks(if wide { pr } else { MAX_ROWS }) {
                g.forward(&mut c, &chunk[..chunk.len().min(MAX_ROWS)])?;
                if chunk.len() > MAX_ROWS {
                    g.forward_prompt(&mut c, &chunk[MAX_ROWS..])?;
                }
            }
            g.forward(&mut c, &[ids[0]])?;
            rows_after.push(g.logits(&c)?);
        }
        let (d, id) = near(&rows_after[1], &rows_after[0]);
        let pass = id && d < 0.1;
        println!("model: 700 tokens after 16 in prompt steps against 8-row steps: the next step {d:.2e}, greedy id {}: {}", if id { "agrees" } else { "DIFFERS" }, if pass { "ok" } else { "FAIL" });
        ok &= pass;
        // Prefill speed: llama-bench's pp512 (a 512-token prompt into an empty cache) and longer.
        for n_tok in [512usize, 2048] {
            let toks: Vec<u32> = (0..n_tok as u32).map(|i| (100 + (i * 7919) % 20000) % g.config().vocab as u32).collect();
            let mut best = f64::MAX;
            for _ in 0..5 {
                c.truncate(0);
                g.synchronize()?;
                let t0 = std::time::Instant::now();
                let chunks = toks.chunks(pr).count();
                for (i, chunk) in toks.chunks(pr).enumerate() {
                    if i + 1 < chunks {
                        g.forward_trunk(&mut c, chunk)?;
                    } else {
                        g.forward_prompt(&mut c, chunk)?;
                    }
                }
                let _ = g.logits_row(&c, toks.chunks(pr).last().map_or(0, |l| l.len()) - 1)?;
                best = best.min(t0.elapsed().as_secs_f64());
            }
            println!("model: {n_tok}-token prompt in prompt steps (best of 5, last row's logits read): {:.2} ms, {:.0} tok/s", best * 1e3, n_tok as f64 / best);
        }
        // Where a 512-row prompt step's time goes (each launch followed by an event).
        c.truncate(0);
        let toks: Vec<u32> = (0..pr.min(512) as u32).map(|i| (100 + (i * 7919) % 20000) % g.config().vocab as u32).collect();
        let _ = g.profile_prompt(&mut c, &toks)?;
        c.truncate(0);
        let prof = g.profile_prompt(&mut c, &toks)?;
        let total: f64 = prof.iter().map(|(_, us)| us).sum();
        println!("model: profile of a {}-row prompt step, {total:.0} us in all:", toks.len());
        for (what, us) in &prof {
            println!("model:   {what:<18} {us:>9.1} us  {:>5.1}%", 100.0 * us / total);
        }
        if g.has_nextn() {
            ok &= nextn(&g, &mut c)?;
        }
        if let Some(a) = assistant_path {
            ok &= assistant(&g, &mut c, path, std::path::Path::new(a))?;
        }
        // Against the CPU path's greedy ids.
        if let Some(refs) = refs {
            for (i, line) in std::fs::read_to_string(refs)?.lines().enumerate() {
                let doc: serde_json::Value = serde_json::from_str(line)?;
                let list = |k: &str| -> Vec<u32> { doc[k].as_array().map(|a| a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect()).unwrap_or_default() };
                let (p, want) = (list("prompt_ids"), list("ids"));
                let (got, rows, _) = greedy(&g, &mut c, &p, want.len())?;
                match got.iter().zip(&want).position(|(a, b)| a != b) {
                    None => println!("model: prompt {}: {} greedy ids equal to the CPU path's", i + 1, want.len()),
                    Some(at) => println!(
                        "model: prompt {}: equal for {at} of {} tokens; at {at} the engine picks {} and the CPU {}; engine's top-2 gap there {:.4}",
                        i + 1,
                        want.len(),
                        got[at],
                        want[at],
                        top2_gap(&rows[at])
                    ),
                }
            }
        }
        Ok(ok)
    }
}

/// `--gemma4 FILE`: Gemma 4 on the engine over a real or random-weight GGUF: graph nodes, verify
/// steps of 2..=8 rows against one-row steps (logits bit for bit, and the step after a
/// truncation), a prompt step against one-row steps (to float rounding), decode speed, where a
/// step's time goes, and verify steps timed against a one-row step.
mod gemma4 {
    use super::*;
    use tine_gpu::gemma4::{Gemma4Cache, Gemma4Gpu};

    fn prompt(vocab: usize) -> Vec<u32> {
        (0..21u32).map(|i| (i * 7919 + 13) % vocab as u32).collect()
    }

    fn same(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// The prompt in one-row steps, then `n` greedy one-row steps: the ids and each step's logits.
    fn one_rows(g: &Gemma4Gpu, c: &mut Gemma4Cache, prompt: &[u32], n: usize) -> Res<(Vec<u32>, Vec<Vec<f32>>)> {
        let mut next = 0;
        for &t in prompt {
            g.forward(c, &[t])?;
            next = g.argmax(c)?[0];
        }
        let (mut ids, mut rows) = (Vec::new(), Vec::new());
        for _ in 0..n {
            ids.push(next);
            g.forward(c, &[next])?;
            rows.push(g.logits(c)?);
            next = g.argmax(c)?[0];
        }
        Ok((ids, rows))
    }

    /// `--gemma4-trace FILE`: where the prompt path parts from the decode path. Each case runs
    /// the same positions twice: `prefix` (in prompt steps of up to 512 rows when `prefix_prompt`,
    /// else in 8-row steps) then `tail` as one traced prompt step; and everything in 8-row steps
    /// with the last 8 rows traced. Per layer, the largest difference of each traced buffer over
    /// its largest value, and the first launch past 1e-2.
    pub fn trace(path: &std::path::Path) -> Res<bool> {
        let g = Gemma4Gpu::load(path, 0, 4096)?;
        let vocab = g.config().vocab as u32;
        let ids = |n: u32, salt: u32| -> Vec<u32> { (0..n).map(|i| (i.wrapping_mul(104729).wrapping_add(salt * 7919 + 13)) % vocab).collect() };
        let mut ok = true;
        for (what, prefix, tail, prefix_prompt) in [
            ("21 rows into an empty cache", Vec::new(), ids(21, 1), false),
            ("188 rows after 512 prompt rows", ids(512, 2), ids(188, 3), true),
            ("188 rows after 512 rows in 8-row steps", ids(512, 2), ids(188, 3), false),
            ("100 rows after 300 rows in 8-row steps", ids(300, 4), ids(100, 5), false),
        ] {
            let mut ca = g.new_cache_typed(4096, kv_types())?;
            if prefix_prompt {
                for chunk in prefix.chunks(512) {
                    g.forward_trunk(&mut ca, chunk)?;
                }
            } else {
                for chunk in prefix.chunks(MAX_ROWS) {
                    g.forward(&mut ca, chunk)?;
                }
            }
            let a = g.trace(&mut ca, &tail)?;
            let all: Vec<u32> = prefix.iter().chain(&tail).copied().collect();
            let (head, last) = all.split_at(all.len() - MAX_ROWS);
            let mut cb = g.new_cache_typed(4096, kv_types())?;
            for chunk in head.chunks(MAX_ROWS) {
                g.forward(&mut cb, chunk)?;
            }
            let b = g.trace(&mut cb, last)?;
            println!("trace {what}: {} launches (prompt path) vs {} (8-row steps)", a.len(), b.len());
            if a.len() != b.len() || a.iter().zip(&b).any(|(x, y)| x.0 != y.0) {
                println!("FAIL trace {what}: the two paths launch different kernels");
                ok = false;
                continue;
            }
            let rel = |x: &[f32], y: &[f32]| -> f64 {
                let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12) as f64;
                x.iter().zip(y).fold(0f64, |m, (p, q)| m.max((*p as f64 - *q as f64).abs())) / scale
            };
            let mut layer = 0usize;
            let mut per_layer = vec![[0f64; 5]; g.config().layers.len() + 2];
            let mut first: Option<String> = None;
            // A buffer is compared from the launch that first writes it in this step on (before
            // that it holds what the paths' earlier steps left).
            let writers: [&[&str]; 5] = [&["norm_quant"], &["gemv qkv"], &["gemv o", "gemv proj"], &["gemv down"], &["ple_inputs"]];
            let mut written = [false; 5];
            for (i, ((name, xa), (_, xb))) in a.iter().zip(&b).enumerate() {
                if *name == "gemv qkv" {
                    layer += 1;
                }
                for (j, part) in tine_gpu::gemma4::TRACE_PARTS.iter().enumerate() {
                    written[j] |= writers[j].contains(name);
                    if !written[j] {
                        continue;
                    }
                    let d = rel(&xa[j], &xb[j]);
                    per_layer[layer][j] = per_layer[layer][j].max(d);
                    if d > 1e-2 && first.is_none() {
                        first = Some(format!("launch {i} ({name}, layer {}): {part} {d:.2e}", layer as i64 - 1));
                    }
                }
            }
            for (l, d) in per_layer.iter().enumerate().take(layer + 1) {
                let at = if l == 0 { "before layer 0".to_string() } else { format!("layer {}", l - 1) };
                println!("  {at}: {}", tine_gpu::gemma4::TRACE_PARTS.iter().zip(d).map(|(p, v)| format!("{p} {v:.2e}")).collect::<Vec<_>>().join(", "));
            }
            println!("{} trace {what}: first launch past 1e-2: {}", if first.is_some() { "PART" } else { "ok  " }, first.as_deref().unwrap_or("none"));
            ok &= first.is_none();
        }
        Ok(ok)
    }

    pub fn run(path: &std::path::Path) -> Res<bool> {
        let g = Gemma4Gpu::load(path, 0, 4096)?;
        let cfg = g.config().clone();
        let global = cfg.layers.iter().filter(|l| !l.sliding).count();
        println!(
            "gemma4 {}: {} layers ({global} global, {} owning K/V), hidden {}, per-layer inputs {}, vocab {}, softcap {:?}, K/V {:.1} KiB a position",
            path.display(),
            cfg.layers.len(),
            cfg.kv_layers,
            cfg.hidden,
            cfg.per_layer,
            cfg.vocab,
            cfg.softcap,
            g.kv_bytes_per_position(kv_types()) as f64 / 1024.0
        );
        let mut ok = true;
        let mut c = g.new_cache_typed(4096, kv_types())?;
        for rows in [1, 4, 8] {
            println!("graph nodes, {rows} rows: {}", g.graph_nodes(&mut c, rows)?);
        }
        let p = prompt(cfg.vocab);
        let vocab = cfg.vocab;
        let mut c1 = g.new_cache_typed(4096, kv_types())?;
        let (ids, rows) = one_rows(&g, &mut c1, &p, MAX_ROWS)?;
        for m in 2..=MAX_ROWS {
            let mut cv = g.new_cache_typed(4096, kv_types())?;
            for &t in &p {
                g.forward(&mut cv, &[t])?;
            }
            g.forward(&mut cv, &ids[..m])?;
            let logits = g.logits(&cv)?;
            let mut ok_m = (0..m).all(|r| same(&logits[r * vocab..(r + 1) * vocab], &rows[r]));
            // Keeping one verify row and decoding on gives the one-row path's next logits.
            cv.truncate(p.len() + 1);
            g.forward(&mut cv, &[ids[1]])?;
            ok_m &= same(&g.logits(&cv)?, &rows[1]);
            println!("{} verify {m} rows vs one-row steps: logits and the step after a truncation: {}", if ok_m { "ok  " } else { "FAIL" }, if ok_m { "bit-identical" } else { "DIFFER" });
            ok &= ok_m;
        }
        let mut cp = g.new_cache_typed(4096, kv_types())?;
        g.forward_prompt(&mut cp, &p)?;
        let last = g.logits_row(&cp, p.len() - 1)?;
        let mut c2 = g.new_cache_typed(4096, kv_types())?;
        for &t in &p {
            g.forward(&mut c2, &[t])?;
        }
        let want = g.logits(&c2)?;
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = last.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let pass = err <= 2e-2 * scale;
        println!(
            "{} prompt step of {} rows vs one-row steps: max |diff| {err:.3e} (logits up to {scale:.3e}), argmax {} vs {}",
            if pass { "ok  " } else { "FAIL" },
            p.len(),
            reference::argmax(&last),
            reference::argmax(&want)
        );
        ok &= pass;
        // A long prompt (the prompt kernels over more than one attention chunk and past the
        // sliding window) then one-row steps: the greedy ids of both paths.
        let long: Vec<u32> = (0..700u32).map(|i| (i * 104729 + 7) % vocab as u32).collect();
        let mut cl = g.new_cache_typed(4096, kv_types())?;
        // In prompt steps of at most 512 rows, as the runtime feeds a prompt.
        for chunk in long.chunks(512) {
            g.forward_prompt(&mut cl, chunk)?;
        }
        // Each path's last step holds the prompt's last row as its own last row; the readout is
        // the model's (the next step of any cache overwrites it), so read it before the other.
        let last_prompt = long.len() - (long.len() - 1) / 512 * 512;
        let (a, la) = (g.argmax(&cl)?[0], g.logits_row(&cl, last_prompt - 1)?);
        let mut cr = g.new_cache_typed(4096, kv_types())?;
        for chunk in long.chunks(MAX_ROWS) {
            g.forward(&mut cr, chunk)?;
        }
        let (b, lb) = (*g.argmax(&cr)?.last().expect("rows"), g.logits_row(&cr, MAX_ROWS.min(long.len() - (long.len() - 1) / MAX_ROWS * MAX_ROWS) - 1)?);
        let err = la.iter().zip(&lb).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        let scale = lb.iter().fold(0f32, |m, v| m.max(v.abs()));
        // A q4_0 cache stores K/V in steps of an eighth of the block's largest value, where the
        // two paths' rounding differences flip codes (measured: 3.6e-2 of the logits' scale).
        let q4 = [kv_types().k, kv_types().v].contains(&KvStore::Q4_0);
        let pass = err <= if q4 { 8e-2 } else { 2e-2 } * scale;
        println!("{} prompt of {} rows vs verify steps of 8: max |diff| {err:.3e} (logits up to {scale:.3e}), argmax {a} vs {b}", if pass { "ok  " } else { "FAIL" }, long.len());
        ok &= pass;
        let mut cs = g.new_cache_typed(4096, kv_types())?;
        g.forward_prompt(&mut cs, &p)?;
        let mut next = g.argmax(&cs)?[0];
        for _ in 0..8 {
            g.forward(&mut cs, &[next])?;
            next = g.argmax(&cs)?[0];
        }
        let n = 256;
        let t0 = std::time::Instant::now();
        for _ in 0..n {
            g.forward(&mut cs, &[next])?;
            next = g.argmax(&cs)?[0];
        }
        let dt = t0.elapsed().as_secs_f64();
        let step = dt / n as f64;
        println!("decode: {n} tokens in {:.1} ms: {:.3} ms a token, {:.1} tok/s", dt * 1e3, step * 1e3, n as f64 / dt);
        for m in [1, 4] {
            let mut runs = Vec::new();
            for _ in 0..5 {
                let at = cs.len();
                runs.push(g.profile(&mut cs, &ids[..m])?);
                cs.truncate(at + 1);
            }
            let kinds: Vec<&str> = runs[0].iter().map(|(k, _)| *k).collect();
            let mut total = 0.0;
            let mut line = String::new();
            for (i, k) in kinds.iter().enumerate() {
                let mut v: Vec<f64> = runs.iter().map(|r| r[i].1).collect();
                v.sort_by(f64::total_cmp);
                total += v[2];
                line.push_str(&format!(" {k} {:.1};", v[2]));
            }
            println!("profile, {m} rows (us, summed per kind):{line} total {total:.1}");
        }
        for m in [4, 8] {
            let reps = 50;
            let at = cs.len();
            g.forward(&mut cs, &ids[..m])?;
            cs.truncate(at + 1);
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                let at = cs.len();
                g.forward(&mut cs, &ids[..m])?;
                g.argmax(&cs)?;
                cs.truncate(at + 1);
            }
            let dt = t0.elapsed().as_secs_f64() / reps as f64;
            println!("verify {m} rows: {:.3} ms ({:.2}x a one-row step)", dt * 1e3, dt / step);
        }
        Ok(ok)
    }
}

/// `--batch FILE`: the batched step of a Gemma 3 or Gemma 4 file (`forward_batch`): 12 sequences of prompts of
/// 5 to 38 tokens, fed a token a step (one of them its prompt in rows of 3, a verify step's
/// shape, another in rows of 11, a deep draft's), then 12 greedy tokens each, the sequences
/// finishing at different steps (so the steps run 1 to 24 rows, padded past 8), the odd ones banning two ids (`ignore_eos`), the even ones
/// not; every row's greedy id, logits and top 40 against the same sequence stepped alone
/// (one-row steps on a cache of its own, `forward_top_k`), bit for bit. Then aggregate decode
/// speed with 1, 4, 16 and 64 sequences a step against one sequence's one-row steps.
mod batch {
    use super::*;
    use tine_gpu::batch::{BatchEntry, GpuBatch};
    use tine_gpu::gemma3::{Gemma3Gpu, GpuCache};
    use tine_gpu::gemma4::{Gemma4Cache, Gemma4Gpu};
    use tine_gpu::qwen35::{Qwen35Cache, Qwen35Gpu};

    fn hash(v: &[f32]) -> u64 {
        v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| (h ^ x.to_bits() as u64).wrapping_mul(0x0100_0000_01b3))
    }

    fn hash_top(v: &[(u32, f32)]) -> u64 {
        v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, (i, x)| (h ^ ((*i as u64) << 32 | x.to_bits() as u64)).wrapping_mul(0x0100_0000_01b3))
    }

    // The same check for each family with a batched step (their engines' methods share names).
    macro_rules! family_check {
        // `$deep`: the rows one sequence feeds a step (a deep draft's verify), at most what the
        // family's batched step takes of one sequence.
        ($name:ident, $gpu:ty, $cache:ty, $deep:expr) => {
            pub fn $name(path: &std::path::Path) -> Res<bool> {
                let g = <$gpu>::load(path, 0, 4096)?;
                let vocab = g.config().vocab;
                let types = kv_types();
                let n_seq = 12;
                let gen = 12;
                let k = 40;
                let banned: Vec<u32> = vec![1, (vocab as u32 - 1).min(106)];
                let bans = |s: usize| s % 2 == 1;
                // Sequences whose rows' hidden states are read back (a NextN head's or an
                // assistant's rounds), the others not.
                let hiddens = |s: usize| s % 3 != 1;
                let prompts: Vec<Vec<u32>> = (0..n_seq).map(|s| (0..5 + 3 * s).map(|i| ((i * 7919 + s * 104_729 + 13) % vocab) as u32).collect()).collect();
                // Alone: each position's (greedy id, logits hash, top-k hash).
                let mut alone = Vec::new();
                for (s, p) in prompts.iter().enumerate() {
                    let ban: &[u32] = if bans(s) { &banned } else { &[] };
                    let mut c = g.new_cache_typed(4096, types)?;
                    let mut rows = Vec::new();
                    let mut next = 0;
                    for i in 0..p.len() + gen {
                        let t = if i < p.len() { p[i] } else { next };
                        let top = g.forward_top_k(&mut c, &[t], ban, k)?;
                        next = g.argmax(&c)?[0];
                        rows.push((next, hash(&g.logits(&c)?), hash_top(&top), hash(&g.hidden(&c)?)));
                    }
                    alone.push(rows);
                }
                let mut caches: Vec<$cache> = (0..n_seq).map(|_| g.new_cache_typed(4096, types)).collect::<std::result::Result<_, _>>()?;
                let mut b = g.new_batch(4096, types, 64)?;
                // The steps below replay the graphs the warm-up captured (one real row padded).
                let mut scratch = g.new_cache_typed(4096, types)?;
                let warm_graphs = g.warm_batch(&mut b, &mut scratch, 64)?;
                drop(scratch);
                let mut fed = vec![0usize; n_seq];
                let mut next = vec![0u32; n_seq];
                let (mut steps, mut most, mut mismatches) = (0, 0, 0);
                let mut first_bad = String::new();
                loop {
                    let mut inputs: Vec<(usize, Vec<u32>)> = Vec::new();
                    for s in 0..n_seq {
                        let p = &prompts[s];
                        if fed[s] >= p.len() + gen {
                            continue;
                        }
                        let take = if fed[s] < p.len() {
                            (match s {
                                1 => 3,
                                7 => $deep,
                                _ => 1,
                            })
                            .min(p.len() - fed[s])
                        } else {
                            1
                        };
                        let toks = if fed[s] < p.len() { p[fed[s]..fed[s] + take].to_vec() } else { vec![next[s]] };
                        inputs.push((s, toks));
                    }
                    if inputs.is_empty() {
                        break;
                    }
                    let ids = {
                        let mut entries: Vec<BatchEntry<$cache>> = Vec::new();
                        let mut it = inputs.iter().peekable();
                        for (s, cache) in caches.iter_mut().enumerate() {
                            if let Some((_, toks)) = it.next_if(|(i, _)| *i == s) {
                                entries.push(BatchEntry { cache, tokens: toks, ban: bans(s), hidden: hiddens(s) });
                            }
                        }
                        g.forward_batch(&mut b, &mut entries, &banned)?
                    };
                    let rows: usize = inputs.iter().map(|(_, t)| t.len()).sum();
                    let tops = g.batch_top_k(&b, 0, rows, k)?;
                    let mut row = 0;
                    for ((s, toks), got) in inputs.iter().zip(&ids) {
                        for (j, &id) in got.iter().enumerate() {
                            let at = fed[*s] + j;
                            let h = hash(&g.batch_logits_row(&b, row)?);
                            let t = hash_top(&tops[row]);
                            let want = alone[*s][at];
                            // A row whose entry did not ask has no hidden state to compare.
                            let hid = if hiddens(*s) { hash(&g.batch_hidden(&b, row, 1)?) } else { want.3 };
                            if (id, h, t, hid) != want {
                                mismatches += 1;
                                if first_bad.is_empty() {
                                    first_bad = format!(
                                        "step {steps}: sequence {s} position {at}: id {id} vs {} alone, logits {}, top {k} {}, hidden state {}",
                                        want.0,
                                        if h == want.1 { "equal" } else { "differ" },
                                        if t == want.2 { "equal" } else { "differ" },
                                        if hid == want.3 { "equal" } else { "differ" }
                                    );
                                }
                            }
                            row += 1;
                        }
                        fed[*s] += toks.len();
                        next[*s] = *got.last().expect("a row");
                    }
                    most = most.max(row);
                    steps += 1;
                }
                let total: usize = alone.iter().map(Vec::len).sum();
                let ok = mismatches == 0;
                println!(
                    "{} {} batched steps vs each sequence alone: {total} rows of {n_seq} sequences in {steps} steps (up to {most} rows a step, {} graphs, {warm_graphs} of them from the warm-up, per-row bans): {}",
                    if ok { "ok  " } else { "FAIL" },
                    stringify!($gpu),
                    b.graphs(),
                    if ok { format!("ids, logits, top {k} and hidden states bit-identical") } else { format!("{mismatches} rows differ; first: {first_bad}") }
                );
                // Speed: n sequences decoding together, one row each, after a 32-token prompt.
                let mut c = g.new_cache_typed(512, types)?;
                let warm: Vec<u32> = (0..32).map(|i| (i * 31 + 7) % vocab as u32).collect();
                for &t in &warm {
                    g.forward(&mut c, &[t])?;
                }
                let mut t1 = g.argmax(&c)?[0];
                let n = 128;
                let t0 = std::time::Instant::now();
                for _ in 0..n {
                    g.forward(&mut c, &[t1])?;
                    t1 = g.argmax(&c)?[0];
                }
                let one = n as f64 / t0.elapsed().as_secs_f64();
                println!("decode, one sequence (one-row steps): {one:.1} tok/s");
                for seqs in [1usize, 4, 16, 64] {
                    let t_alloc = std::time::Instant::now();
                    let mut b = g.new_batch(512, types, 64)?;
                    let mut caches: Vec<$cache> = (0..seqs).map(|_| g.new_cache_typed(512, types)).collect::<std::result::Result<_, _>>()?;
                    let mut cur: Vec<u32> = vec![0; seqs];
                    for (s, cache) in caches.iter_mut().enumerate() {
                        let p: Vec<u32> = warm.iter().map(|&t| (t + s as u32) % vocab as u32).collect();
                        g.forward(cache, &p)?;
                        cur[s] = *g.argmax(cache)?.last().expect("a row");
                    }
                    let step = |b: &mut GpuBatch, caches: &mut [$cache], cur: &mut Vec<u32>| -> Res<()> {
                        let toks: Vec<[u32; 1]> = cur.iter().map(|&t| [t]).collect();
                        let mut entries: Vec<BatchEntry<$cache>> = caches.iter_mut().zip(&toks).map(|(cache, t)| BatchEntry { cache, tokens: &t[..], ban: false, hidden: false }).collect();
                        let ids = g.forward_batch(b, &mut entries, &[])?;
                        for (c, i) in cur.iter_mut().zip(ids) {
                            *c = i[0];
                        }
                        Ok(())
                    };
                    step(&mut b, &mut caches, &mut cur)?;
                    let setup = t_alloc.elapsed().as_secs_f64();
                    let t0 = std::time::Instant::now();
                    for _ in 0..n {
                        step(&mut b, &mut caches, &mut cur)?;
                    }
                    let dt = t0.elapsed().as_secs_f64();
                    let agg = (n * seqs) as f64 / dt;
                    println!(
                        "decode, {seqs} sequences a step: {agg:.1} tok/s in all ({:.3} ms a step, {:.2}x one sequence; caches, prompts and the first step's capture {:.0} ms)",
                        dt * 1e3 / n as f64,
                        agg / one,
                        setup * 1e3
                    );
                }
                Ok(ok)
            }
        };
    }
    family_check!(run_gemma3, Gemma3Gpu, GpuCache, 11);
    family_check!(run_gemma4, Gemma4Gpu, Gemma4Cache, 11);
    // A sequence's rows in a Qwen3.5 step stay below its state planes (8).
    family_check!(run_qwen35, Qwen35Gpu, Qwen35Cache, 8);

    /// The check of the file's family (`gemma3`, `gemma4`, `qwen35`/`qwen35moe`).
    pub fn run(path: &std::path::Path) -> Res<bool> {
        let arch = tine_gpu::gemma3::architecture(path)?;
        if arch == "gemma4" {
            run_gemma4(path)
        } else if arch.starts_with("qwen35") {
            run_qwen35(path)
        } else {
            run_gemma3(path)
        }
    }
}
