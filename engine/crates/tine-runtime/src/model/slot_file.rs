//! A sequence saved to bytes and loaded back (llama-server's slot save/restore): its tokens
//! and every layer's K and V, so a restored sequence continues exactly where it stopped.
//!
//! Layout (little endian): `TINESLOT`, version u32, the model fingerprint (u32 length + UTF-8),
//! token count u32, the tokens (u32 each), layer count u32, then per layer the four dims of K
//! (u32 each, V has the same) and K's then V's values (f32); version 2 then holds the recurrent
//! states (a hybrid model's delta-net layers: conv windows and states): their count u32, and per
//! tensor its rank u32, its dims (u32 each) and its values (f32). Version 3 is written for a KV
//! cache of other types than f32 (`--cache-type-k/-v`): after the fingerprint, the key and the
//! value type's names (u32 length + UTF-8 each), and per layer K's dims then V's (u32 each) and
//! their stored bytes (little endian: f16/bf16 values, q8_0/q4_0 blocks), then the states as in
//! version 2. Last, an FNV-1a 64 checksum of everything before it. Version 1 (no recurrent
//! states) is written whenever there are none and the cache is f32.
//! Anything that does not parse, or belongs to another model, is refused.

use candle_core::{DType, Tensor};

use super::{fnv1a, KvType, Model, Sequence, StepError};

const MAGIC: &[u8; 8] = b"TINESLOT";
/// The newest version: written for caches of other types than f32 (2 for recurrent states, 1 for
/// neither; this build reads all three).
const VERSION: u32 = 3;

/// A sequence's state outside the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotImage {
    /// Which model's KV this is ([`fingerprint`]).
    pub model: String,
    pub tokens: Vec<u32>,
    /// The types the KV cache stored keys and values in (f32 in every file before version 3);
    /// a restore needs a cache of the same types.
    pub cache_types: (KvType, KvType),
    /// Per attention layer of an f32 cache: dims `(batch, kv_heads, len, head_dim)`, K values,
    /// V values.
    pub layers: Vec<([usize; 4], Vec<f32>, Vec<f32>)>,
    /// Per attention layer of a cache of other types: K and V as stored.
    pub typed_layers: Vec<TypedLayer>,
    /// A recurrent model's other state (qwen35: each delta-net layer's conv window, then its
    /// state), as dims and values; empty for a KV-only model.
    pub states: Vec<(Vec<usize>, Vec<f32>)>,
}

/// One layer's K and V in their stored types: dims `(batch, kv_heads, len, width)` and the
/// stored rows as little-endian bytes ([`KvType::stored_bytes`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TypedLayer {
    pub k_dims: [usize; 4],
    pub k: Vec<u8>,
    pub v_dims: [usize; 4],
    pub v: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum SlotFileError {
    #[error("not a Tine slot file (bad magic)")]
    Magic,
    #[error("slot file version {0} is not supported (this build reads {VERSION})")]
    Version(u32),
    #[error("the slot file is truncated or has trailing bytes")]
    Length,
    #[error("the slot file's checksum does not match: it is corrupt")]
    Checksum,
    #[error("the slot file is malformed: {0}")]
    Malformed(String),
    #[error("the slot was saved from another model ({saved}), this server runs {running}")]
    OtherModel { saved: String, running: String },
    #[error("the slot was saved with a KV cache of {saved}, this server keeps {running} (--cache-type-k/-v)")]
    CacheTypes { saved: String, running: String },
    #[error("the slot holds {tokens} tokens, the slot's context is {context}")]
    TooLong { tokens: usize, context: usize },
    #[error("restoring the KV cache failed")]
    Step(#[from] StepError),
}

/// What identifies a model's KV layout and values.
pub fn fingerprint(model: &Model) -> String {
    let i = &model.info;
    format!("{} {:?} vocab {} embd {} blocks {} bytes {} tail {:016x}", i.architecture, i.name, i.vocab_size, i.embedding_length, i.block_count, i.file_size, i.tail_hash)
}

impl SlotImage {
    pub fn to_bytes(&self) -> Vec<u8> {
        let floats: usize = self.layers.iter().map(|l| l.1.len() + l.2.len()).sum();
        let mut out = Vec::with_capacity(64 + self.model.len() + 4 * self.tokens.len() + 4 * floats);
        let u32le = |out: &mut Vec<u8>, v: usize| out.extend_from_slice(&(v as u32).to_le_bytes());
        out.extend_from_slice(MAGIC);
        let typed = self.cache_types != (KvType::F32, KvType::F32);
        u32le(
            &mut out,
            if typed {
                VERSION as usize
            } else if self.states.is_empty() {
                1
            } else {
                2
            },
        );
        u32le(&mut out, self.model.len());
        out.extend_from_slice(self.model.as_bytes());
        if typed {
            for t in [self.cache_types.0, self.cache_types.1] {
                u32le(&mut out, t.name().len());
                out.extend_from_slice(t.name().as_bytes());
            }
        }
        u32le(&mut out, self.tokens.len());
        for &t in &self.tokens {
            u32le(&mut out, t as usize);
        }
        if typed {
            u32le(&mut out, self.typed_layers.len());
            for l in &self.typed_layers {
                for &d in l.k_dims.iter().chain(&l.v_dims) {
                    u32le(&mut out, d);
                }
                out.extend_from_slice(&l.k);
                out.extend_from_slice(&l.v);
            }
        } else {
            u32le(&mut out, self.layers.len());
        }
        for (dims, k, v) in self.layers.iter().filter(|_| !typed) {
            for &d in dims {
                u32le(&mut out, d);
            }
            for x in k.iter().chain(v) {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        if typed || !self.states.is_empty() {
            u32le(&mut out, self.states.len());
            for (dims, values) in &self.states {
                u32le(&mut out, dims.len());
                for &d in dims {
                    u32le(&mut out, d);
                }
                for x in values {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
        let sum = fnv1a(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<SlotImage, SlotFileError> {
        if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
            return Err(SlotFileError::Magic);
        }
        if bytes.len() < MAGIC.len() + 4 + 8 {
            return Err(SlotFileError::Length);
        }
        let (body, sum) = bytes.split_at(bytes.len() - 8);
        let version = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes"));
        if !(1..=VERSION).contains(&version) {
            return Err(SlotFileError::Version(version));
        }
        if fnv1a(body) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
            return Err(SlotFileError::Checksum);
        }
        let mut r = Reader { b: body, at: 12 };
        let n = r.u32()?;
        let model = String::from_utf8(r.take(n)?.to_vec()).map_err(|_| SlotFileError::Malformed("the model fingerprint is not UTF-8".into()))?;
        let mut cache_types = (KvType::F32, KvType::F32);
        if version >= 3 {
            let mut name = || -> Result<KvType, SlotFileError> {
                let n = r.u32()?;
                let text = std::str::from_utf8(r.take(n)?).map_err(|_| SlotFileError::Malformed("a cache type name is not UTF-8".into()))?;
                KvType::from_name(text).ok_or_else(|| SlotFileError::Malformed(format!("unknown KV cache type {text:?}")))
            };
            cache_types = (name()?, name()?);
        }
        let n_tokens = r.u32()?;
        // Bounded by the bytes present before anything is allocated.
        let tokens = (0..n_tokens).map(|_| r.u32().map(|t| t as u32)).collect::<Result<Vec<_>, _>>()?;
        let n_layers = r.u32()?;
        if n_layers > 4096 {
            return Err(SlotFileError::Malformed(format!("{n_layers} layers")));
        }
        let mut layers = Vec::with_capacity(n_layers);
        let mut typed_layers = Vec::new();
        let count = |dims: &[usize; 4]| dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| SlotFileError::Malformed(format!("dims {dims:?} overflow")));
        for _ in (0..n_layers).filter(|_| version >= 3) {
            let k_dims = [r.u32()?, r.u32()?, r.u32()?, r.u32()?];
            let v_dims = [r.u32()?, r.u32()?, r.u32()?, r.u32()?];
            if k_dims[2] != tokens.len() || v_dims[2] != tokens.len() || k_dims[..2] != v_dims[..2] {
                return Err(SlotFileError::Malformed(format!("a layer's K {k_dims:?} and V {v_dims:?} do not hold {} positions alike", tokens.len())));
            }
            let bytes = |dims: &[usize; 4], t: KvType| count(dims)?.checked_mul(t.storage_dtype().size_in_bytes()).ok_or(SlotFileError::Length);
            let (nk, nv) = (bytes(&k_dims, cache_types.0)?, bytes(&v_dims, cache_types.1)?);
            let k = r.take(nk)?.to_vec();
            let v = r.take(nv)?.to_vec();
            typed_layers.push(TypedLayer { k_dims, k, v_dims, v });
        }
        for _ in (0..n_layers).filter(|_| version < 3) {
            let dims = [r.u32()?, r.u32()?, r.u32()?, r.u32()?];
            let n = count(&dims)?;
            if dims[2] != tokens.len() {
                return Err(SlotFileError::Malformed(format!("a layer holds {} positions for {} tokens", dims[2], tokens.len())));
            }
            let k = r.f32s(n)?;
            let v = r.f32s(n)?;
            layers.push((dims, k, v));
        }
        let mut states = Vec::new();
        if version >= 2 {
            let n_states = r.u32()?;
            if n_states > 8192 {
                return Err(SlotFileError::Malformed(format!("{n_states} recurrent tensors")));
            }
            for _ in 0..n_states {
                let rank = r.u32()?;
                if !(1..=4).contains(&rank) {
                    return Err(SlotFileError::Malformed(format!("a recurrent tensor of rank {rank}")));
                }
                let dims = (0..rank).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
                let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| SlotFileError::Malformed(format!("dims {dims:?} overflow")))?;
                states.push((dims, r.f32s(n)?));
            }
        }
        if r.at != body.len() {
            return Err(SlotFileError::Length);
        }
        Ok(SlotImage { model, tokens, cache_types, layers, typed_layers, states })
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], SlotFileError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or(SlotFileError::Length)?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<usize, SlotFileError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as usize)
    }
    fn f32s(&mut self, n: usize) -> Result<Vec<f32>, SlotFileError> {
        let bytes = self.take(n.checked_mul(4).ok_or(SlotFileError::Length)?)?;
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
    }
}

impl Sequence {
    /// This sequence's tokens and KV, to save.
    pub fn image(&self, model: &Model) -> Result<SlotImage, StepError> {
        let mut layers = Vec::new();
        if model.is_recurrent() && self.gpu.is_some() {
            return Err(StepError::NotOnGpuEngine("a slot file of a recurrent model's state"));
        }
        if let (Some(gpu), Some(g)) = (model.gpu.as_ref(), self.gpu.as_ref()) {
            // The engine's K/V in candle's layout and stored bytes: a slot saved here restores on
            // either path and either device. The types are the sequence's own (a sequence keeps
            // those of when it was made).
            let (kt, vt) = crate::gpu::candle_kv_types(g.kv_types());
            let mut typed_layers = Vec::new();
            if g.len() > 0 {
                let (n_kv, hd) = gpu.kv_shape();
                if (kt, vt) == (KvType::F32, KvType::F32) {
                    for (k, v) in gpu.read_kv(g)? {
                        layers.push(([1, n_kv, g.len(), hd], k, v));
                    }
                } else {
                    let width = |t: KvType| t.stored_width(hd).map_err(StepError::from);
                    let (kw, vw) = (width(kt)?, width(vt)?);
                    for (k, v) in gpu.read_kv_stored(g)? {
                        typed_layers.push(TypedLayer { k_dims: [1, n_kv, g.len(), kw], k, v_dims: [1, n_kv, g.len(), vw], v });
                    }
                }
            }
            return Ok(SlotImage { model: fingerprint(model), tokens: self.tokens.clone(), cache_types: (kt, vt), layers, typed_layers, states: Vec::new() });
        }
        let flat = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        let cache = match &self.cache {
            super::SeqCache::Gemma3(cache) => cache,
            super::SeqCache::Qwen35(r) => {
                let img = r.cache.image()?;
                let (kt, vt) = r.cache.types();
                let mut states = Vec::with_capacity(2 * img.recurrent.len());
                let mut typed_layers = Vec::new();
                let dims = |t: &Tensor| -> Result<[usize; 4], StepError> { t.dims().try_into().map_err(|_| candle_core::Error::Msg(format!("a KV layer of rank {}", t.rank())).into()) };
                for (k, v) in &img.kv {
                    if (kt, vt) == (KvType::F32, KvType::F32) {
                        layers.push((dims(k)?, flat(k)?, flat(v)?));
                    } else {
                        typed_layers.push(TypedLayer { k_dims: dims(k)?, k: kt.stored_bytes(k)?, v_dims: dims(v)?, v: vt.stored_bytes(v)? });
                    }
                }
                for (window, state) in &img.recurrent {
                    states.push((window.dims().to_vec(), flat(window)?));
                    states.push((state.dims().to_vec(), flat(state)?));
                }
                return Ok(SlotImage { model: fingerprint(model), tokens: self.tokens.clone(), cache_types: (kt, vt), layers, typed_layers, states });
            }
            super::SeqCache::Gemma4(c) => {
                // The K/V of the layers that own some (KV-shared layers store none), as stored.
                let (kt, vt) = c.types();
                let mut typed_layers = Vec::new();
                for (k, v) in &c.image()?.kv {
                    let d = k.dims();
                    let dims = |t: &Tensor| -> Result<[usize; 4], StepError> { t.dims().try_into().map_err(|_| candle_core::Error::Msg(format!("a KV layer of rank {}", t.rank())).into()) };
                    if (kt, vt) == (KvType::F32, KvType::F32) {
                        layers.push(([d[0], d[1], d[2], d[3]], flat(k)?, flat(v)?));
                    } else {
                        typed_layers.push(TypedLayer { k_dims: dims(k)?, k: kt.stored_bytes(k)?, v_dims: dims(v)?, v: vt.stored_bytes(v)? });
                    }
                }
                return Ok(SlotImage { model: fingerprint(model), tokens: self.tokens.clone(), cache_types: (kt, vt), layers, typed_layers, states: Vec::new() });
            }
        };
        let (kt, vt) = cache.types();
        let mut typed_layers = Vec::new();
        let dims = |t: &Tensor| -> Result<[usize; 4], StepError> { t.dims().try_into().map_err(|_| candle_core::Error::Msg(format!("a KV layer of rank {}", t.rank())).into()) };
        for (k, v) in cache.snapshot()?.unwrap_or_default() {
            if (kt, vt) == (KvType::F32, KvType::F32) {
                layers.push((dims(&k)?, flat(&k)?, flat(&v)?));
            } else {
                typed_layers.push(TypedLayer { k_dims: dims(&k)?, k: kt.stored_bytes(&k)?, v_dims: dims(&v)?, v: vt.stored_bytes(&v)? });
            }
        }
        Ok(SlotImage { model: fingerprint(model), tokens: self.tokens.clone(), cache_types: (kt, vt), layers, typed_layers, states: Vec::new() })
    }

    /// Replaces this sequence's state with `img`. On error the sequence is unchanged, but for a
    /// GPU failure while the KV is copied onto the GPU engine, which leaves it empty.
    pub fn restore_image(&mut self, model: &Model, img: &SlotImage) -> Result<(), SlotFileError> {
        let running = fingerprint(model);
        if img.model != running {
            return Err(SlotFileError::OtherModel { saved: img.model.clone(), running });
        }
        if img.tokens.len() > self.context {
            return Err(SlotFileError::TooLong { tokens: img.tokens.len(), context: self.context });
        }
        // The sequence's own types on the engine (fixed when it was made), else the model's.
        let running_types = self.gpu.as_ref().map_or(model.cache_types(), |g| crate::gpu::candle_kv_types(g.kv_types()));
        if img.cache_types != running_types {
            let name = |(k, v): (KvType, KvType)| format!("K {k}, V {v}");
            return Err(SlotFileError::CacheTypes { saved: name(img.cache_types), running: name(running_types) });
        }
        if let Some(&t) = img.tokens.iter().find(|&&t| t as usize >= model.info.vocab_size) {
            return Err(SlotFileError::Malformed(format!("token id {t} is outside the vocabulary")));
        }
        if model.is_recurrent() && self.gpu.is_some() {
            return Err(StepError::NotOnGpuEngine("a slot file of a recurrent model's state").into());
        }
        if let (Some(gpu), Some(g)) = (model.gpu.as_ref(), self.gpu.as_mut()) {
            let len = img.tokens.len();
            let (n_kv, hd) = gpu.kv_shape();
            let (kt, vt) = img.cache_types;
            let f32_types = (kt, vt) == (KvType::F32, KvType::F32);
            let held = if f32_types { img.layers.len() } else { img.typed_layers.len() };
            if len > 0 && (held != model.info.block_count || img.layers.len() + img.typed_layers.len() != held) {
                return Err(SlotFileError::Malformed(format!("KV of {held} layers for a model of {}", model.info.block_count)));
            }
            if let Some((dims, _, _)) = img.layers.iter().find(|(d, k, v)| *d != [1, n_kv, len, hd] || k.len() != n_kv * len * hd || v.len() != k.len()) {
                return Err(SlotFileError::Malformed(format!("a layer's KV is {dims:?}, this model's for {len} tokens is {:?}", [1, n_kv, len, hd])));
            }
            let width = |t: KvType| t.stored_width(hd).map_err(|e| SlotFileError::Malformed(format!("{} rows of {hd} values: {e}", t.name())));
            let (kw, vw) = (width(kt)?, width(vt)?);
            // The dims, and the bytes they take (an image made in memory may disagree with its
            // dims; a file's are checked when it is read), before anything is written.
            let row_bytes = |t: KvType| t.row_bytes(hd).map_err(|e| SlotFileError::Malformed(format!("{} rows of {hd} values: {e}", t.name())));
            let (kb, vb) = (row_bytes(kt)?, row_bytes(vt)?);
            if let Some(l) = img.typed_layers.iter().find(|l| l.k_dims != [1, n_kv, len, kw] || l.v_dims != [1, n_kv, len, vw] || l.k.len() != n_kv * len * kb || l.v.len() != n_kv * len * vb) {
                return Err(SlotFileError::Malformed(format!(
                    "a layer's stored KV is {:?} and {:?}, this model's for {len} tokens is {:?} and {:?}",
                    l.k_dims,
                    l.v_dims,
                    [1, n_kv, len, kw],
                    [1, n_kv, len, vw]
                )));
            }
            if len > 0 {
                // The shapes and sizes are checked above, so this fails only on the GPU, part way
                // through the copy: the cache is then empty, and so is the sequence.
                let written = if f32_types {
                    let layers: Vec<(&[f32], &[f32])> = img.layers.iter().map(|(_, k, v)| (&k[..], &v[..])).collect();
                    gpu.write_kv(g, len, &layers)
                } else {
                    let layers: Vec<(&[u8], &[u8])> = img.typed_layers.iter().map(|l| (&l.k[..], &l.v[..])).collect();
                    gpu.write_kv_stored(g, len, &layers)
                };
                if let Err(e) = written {
                    self.tokens.clear();
                    g.truncate(0);
                    return Err(StepError::from(e).into());
                }
            } else if !img.layers.is_empty() || !img.typed_layers.is_empty() {
                return Err(SlotFileError::Malformed("KV layers for no tokens".into()));
            } else {
                g.truncate(0);
            }
            self.tokens = img.tokens.clone();
            return Ok(());
        }
        let dev = &model.device;
        let mut kv = Vec::with_capacity(img.layers.len());
        for (dims, k, v) in &img.layers {
            let t = |x: &Vec<f32>| Tensor::from_vec(x.clone(), dims.as_slice(), dev);
            kv.push((t(k).map_err(StepError::from)?, t(v).map_err(StepError::from)?));
        }
        let (kt, vt) = img.cache_types;
        for l in &img.typed_layers {
            let k = kt.stored_from_bytes(&l.k, &l.k_dims, dev).map_err(|e| SlotFileError::Malformed(format!("a layer's keys: {e}")))?;
            let v = vt.stored_from_bytes(&l.v, &l.v_dims, dev).map_err(|e| SlotFileError::Malformed(format!("a layer's values: {e}")))?;
            kv.push((k, v));
        }
        // Into a fresh cache first: a refused image leaves this sequence as it was.
        let mut cache = match (&model.weights, model.new_cache_for(self.context)) {
            (super::Weights::Qwen35(w), super::SeqCache::Qwen35(_)) => {
                if !img.states.len().is_multiple_of(2) {
                    return Err(SlotFileError::Malformed(format!("{} recurrent tensors: windows and states come in pairs", img.states.len())));
                }
                let recurrent = img
                    .states
                    .chunks(2)
                    .map(|p| Ok((Tensor::from_vec(p[0].1.clone(), p[0].0.as_slice(), dev)?, Tensor::from_vec(p[1].1.clone(), p[1].0.as_slice(), dev)?)))
                    .collect::<Result<Vec<_>, candle_core::Error>>()
                    .map_err(|e| SlotFileError::Malformed(format!("a recurrent tensor's dims do not fit its values: {e}")))?;
                let image = candle_transformers::models::quantized_qwen35::CacheImage { len: img.tokens.len(), kv, recurrent };
                let (kt, vt) = img.cache_types;
                let cache = w.cache_from_image_typed(&image, self.context.min(4096), kt, vt).map_err(|e| SlotFileError::Malformed(format!("the state does not fit this model: {e}")))?;
                self.cache = super::SeqCache::Qwen35(super::Recurrent::new(cache));
                self.tokens = img.tokens.clone();
                return Ok(());
            }
            (super::Weights::Gemma4(w), super::SeqCache::Gemma4(_)) => {
                if !img.states.is_empty() {
                    return Err(SlotFileError::Malformed("recurrent states for a model without any".into()));
                }
                let image = candle_transformers::models::quantized_gemma4::CacheImage { len: img.tokens.len(), kv };
                let (kt, vt) = img.cache_types;
                let cache = w.cache_from_image_typed(&image, self.context.min(4096), kt, vt).map_err(|e| SlotFileError::Malformed(format!("the KV does not fit this model: {e}")))?;
                self.cache = super::SeqCache::Gemma4(cache);
                self.tokens = img.tokens.clone();
                return Ok(());
            }
            (_, super::SeqCache::Gemma3(cache)) => cache,
            _ => unreachable!("a model makes its own kind of cache"),
        };
        if !img.states.is_empty() {
            return Err(SlotFileError::Malformed("recurrent states for a model without any".into()));
        }
        if !kv.is_empty() {
            cache.restore(&kv).map_err(|e| SlotFileError::Malformed(format!("the KV does not fit this model: {e}")))?;
        }
        if cache.len() != img.tokens.len() {
            return Err(SlotFileError::Malformed(format!("the KV holds {} positions for {} tokens", cache.len(), img.tokens.len())));
        }
        self.cache = super::SeqCache::Gemma3(cache);
        self.tokens = img.tokens.clone();
        Ok(())
    }
}
