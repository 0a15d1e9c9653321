//! Loading a GGUF (Gemma 3, or the Qwen3.5/3.6 hybrid `qwen35`/`qwen35moe`) and stepping
//! sequences through it.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
pub use candle_nn::attention::kv_type::KvType;
use candle_transformers::models::quantized_gemma3::{AssistantHead, Cache, ModelWeights, NextNCache, SharedPrefix as Gemma3Prefix};
use candle_transformers::models::quantized_gemma4 as gemma4;
use candle_transformers::models::quantized_qwen35 as qwen35;

pub use crate::gpu::{DecodeOut, DecodeWant, RowsRead};
use crate::gpu::{GpuAssistant, GpuBatchState, GpuError, GpuNextN, GpuSeq, GpuTrunk, RowsTopK, BATCH_ROWS, MAX_BANNED, STEP_ROWS, TOP_K_MAX, TOP_K_MAX_VOCAB};
use crate::tokenizer::Tokenizer;

/// Slot files: a sequence's state out to bytes and back (a child module: it reads the model's
/// and the sequence's private state, and nothing else does).
pub(crate) mod slot_file;

/// Errors of [`Model::load`].
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a readable GGUF file (truncated or corrupt?)")]
    Gguf {
        path: PathBuf,
        #[source]
        source: candle_core::Error,
    },
    #[error("{path}: architecture `{found}` is not supported (Tine runs gemma3, gemma4, qwen35 and qwen35moe)")]
    Architecture { path: PathBuf, found: String },
    #[error("{path}: cannot load the weights (missing or malformed tensor)")]
    Weights {
        path: PathBuf,
        #[source]
        source: candle_core::Error,
    },
    #[error("{path}: cannot build the tokenizer from the GGUF metadata")]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: candle_core::Error,
    },
    #[error("{path}: the GPU engine cannot start (with TINE_GPU_ENGINE=0 candle's CUDA path runs instead)")]
    Gpu {
        path: PathBuf,
        #[source]
        source: Box<GpuError>,
    },
    #[error("{path}: an assistant head is for a gemma3 or gemma4 target; this one is {target}")]
    AssistantTarget { path: PathBuf, target: String },
    #[error("{path}: the GPU engine cannot run this head for its target")]
    GpuHead {
        path: PathBuf,
        #[source]
        source: Box<GpuError>,
    },
    #[error("{path}: the warm-up forward at load failed")]
    WarmUp {
        path: PathBuf,
        #[source]
        source: StepError,
    },
}

/// Errors of a forward step.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("the sequence would hold {needed} positions, the context holds {context}")]
    ContextFull { needed: usize, context: usize },
    #[error("no tokens to forward")]
    Empty,
    #[error("token id {id} is outside the vocabulary ({vocab})")]
    BadToken { id: u32, vocab: usize },
    #[error("cannot roll back to {to}: the sequence holds {len} positions")]
    RollbackPastEnd { to: usize, len: usize },
    /// A recurrent model's state has no record of position `to` (see [`Sequence::restorable`]).
    #[error("cannot roll the recurrent state back to {to} of {len} positions (the nearest position it can return to is {nearest})")]
    RollbackRecurrent { to: usize, len: usize, nearest: usize },
    #[error("{0} is not available for this model's architecture")]
    NotForArchitecture(&'static str),
    #[error("tensor operation failed")]
    Candle(#[from] candle_core::Error),
    #[error("GPU engine step failed")]
    Gpu(#[source] Box<GpuError>),
    #[error("{0} is not on the GPU engine yet")]
    NotOnGpuEngine(&'static str),
    /// A failure injected by [`Sequence::inject_failure`] (failure-injection tests).
    #[error("injected failure after the forward's KV writes (failure-injection test)")]
    Injected,
}

impl From<GpuError> for StepError {
    fn from(e: GpuError) -> StepError {
        StepError::Gpu(Box::new(e))
    }
}

/// Errors of [`Model::set_cache_types`]: a KV cache type this model cannot keep.
#[derive(Debug, thiserror::Error)]
pub enum CacheTypeError {
    #[error("KV cache types {k}/{v}: this model runs on {engine}, which keeps f32 only (the GPU engine keeps f32, f16, bf16, q8_0 and q4_0; the CPU every type)")]
    Device { engine: String, k: KvType, v: KvType },
    #[error("KV cache types {k}/{v} do not fit this model's rows")]
    Shape {
        k: KvType,
        v: KvType,
        #[source]
        source: candle_core::Error,
    },
}

/// What the GGUF says about the model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub name: String,
    pub architecture: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub embedding_length: usize,
    pub block_count: usize,
    pub file_size: u64,
    /// FNV-1a of the file's last 4 MiB (tensor data): tells apart same-shaped models, for the
    /// slot files' model check.
    pub tail_hash: u64,
    /// `tokenizer.chat_template`, when the GGUF carries one.
    pub chat_template: Option<String>,
    /// `<arch>.pooling_type` (llama.cpp's numbering: 0 none, 1 mean, 2 cls, 3 last, 4 rank),
    /// when the GGUF sets it: an embedding model's own pooling.
    pub pooling_type: Option<u32>,
    /// The vocabulary's fill-in-the-middle tokens (`/infill`).
    pub fim: crate::tokenizer::FimTokens,
}

/// A model's weights, by architecture.
pub(crate) enum Weights {
    Gemma3(Box<ModelWeights>),
    /// The hybrid of gated delta-net and gated attention layers (`qwen35`, `qwen35moe`).
    Qwen35(Box<qwen35::ModelWeights>),
    /// Gemma 4 (dense, the E-series, the MoE).
    Gemma4(Box<gemma4::ModelWeights>),
}

/// One sequence's state in candle, by architecture.
pub(crate) enum SeqCache {
    /// K/V per layer: truncated in O(1).
    Gemma3(Cache),
    /// K/V of the attention layers and the delta-net layers' recurrent states: truncated exactly
    /// inside the last verify batch (its row states), else back to a checkpoint.
    Qwen35(Recurrent),
    /// K/V of the layers that own some: truncated in O(1).
    Gemma4(gemma4::Cache),
}

/// A recurrent sequence's state and its checkpoints: snapshots taken at the end of prompts
/// (llama-server's context checkpoints), so a next request sharing the prompt, or a context
/// shift keeping it, starts from there instead of from nothing.
pub(crate) struct Recurrent {
    pub(crate) cache: qwen35::Cache,
    /// Oldest first, at increasing positions, all at most `cache.len()`.
    checkpoints: Vec<qwen35::Cache>,
}

/// Checkpoints a recurrent sequence keeps (the oldest goes first). Each holds the recurrent
/// state and the attention K/V of its position (K/V tensors shared with the live cache until it
/// grows past them).
pub const RECURRENT_CHECKPOINTS: usize = 4;

impl Recurrent {
    pub(crate) fn new(cache: qwen35::Cache) -> Recurrent {
        Recurrent { cache, checkpoints: Vec::new() }
    }

    fn restorable(&self, len: usize) -> usize {
        let at = self.cache.restorable(len);
        self.checkpoints.iter().map(|c| c.len()).filter(|&p| p <= len).fold(at, usize::max)
    }

    fn truncate(&mut self, len: usize) -> Result<(), StepError> {
        let have = self.cache.len();
        if self.cache.restorable(len) == len {
            self.cache.truncate(len)?;
        } else if let Some(c) = self.checkpoints.iter().find(|c| c.len() == len) {
            self.cache = c.clone();
        } else {
            return Err(StepError::RollbackRecurrent { to: len, len: have, nearest: self.restorable(len) });
        }
        // Past `len` the tokens will differ: those checkpoints are no longer this sequence's.
        self.checkpoints.retain(|c| c.len() <= len);
        Ok(())
    }

    /// Keeps the state at the current position as a checkpoint.
    fn checkpoint(&mut self) {
        let pos = self.cache.len();
        if pos == 0 || self.checkpoints.last().is_some_and(|c| c.len() >= pos) {
            return;
        }
        if self.checkpoints.len() == RECURRENT_CHECKPOINTS {
            self.checkpoints.remove(0);
        }
        self.checkpoints.push(self.cache.snapshot());
    }
}

impl SeqCache {
    fn len(&self) -> usize {
        match self {
            SeqCache::Gemma3(c) => c.len(),
            SeqCache::Qwen35(c) => c.cache.len(),
            SeqCache::Gemma4(c) => c.len(),
        }
    }

    fn restorable(&self, len: usize) -> usize {
        match self {
            SeqCache::Gemma3(c) => len.min(c.len()),
            SeqCache::Gemma4(c) => len.min(c.len()),
            SeqCache::Qwen35(c) => c.restorable(len),
        }
    }

    /// A checkpoint at the current position (recurrent states; a KV cache needs none).
    fn checkpoint(&mut self) {
        if let SeqCache::Qwen35(c) = self {
            c.checkpoint();
        }
    }

    fn truncate(&mut self, len: usize) -> Result<(), StepError> {
        match self {
            SeqCache::Gemma3(c) => c.truncate(len)?,
            SeqCache::Qwen35(c) => c.truncate(len)?,
            SeqCache::Gemma4(c) => c.truncate(len)?,
        }
        Ok(())
    }

    fn reset(&mut self) {
        match self {
            SeqCache::Gemma3(c) => c.reset(),
            // Zeroing fresh tensors of the cache's own shapes cannot fail but for memory.
            SeqCache::Qwen35(c) => {
                c.cache.reset().expect("memory for a fresh recurrent state");
                c.checkpoints.clear();
            }
            SeqCache::Gemma4(c) => c.truncate(0).expect("keeping no positions cannot fail"),
        }
    }
}

/// A loaded model: weights and tokenizer. Shared read-only by all sequences.
pub struct Model {
    pub(crate) weights: Weights,
    pub tokenizer: Tokenizer,
    pub info: ModelInfo,
    /// End-of-generation tokens: EOS and `<end_of_turn>`-like control tokens.
    eog: Vec<u32>,
    pub(crate) device: Device,
    /// `n - i` for `i` in `0..n` (u32, on `device`), made on the first device-side argmax.
    argmax_rank: std::sync::OnceLock<Tensor>,
    /// The GPU decode engine, where it runs this model (`--device cuda`).
    pub(crate) gpu: Option<GpuTrunk>,
    /// Why a CUDA model runs on candle's path instead of the engine.
    engine_note: Option<String>,
    /// The engine's batched-step buffers ([`Model::step_many_gpu`]), made at the first one.
    gpu_batch: std::sync::Mutex<GpuBatchState>,
    /// [`Model::stand_in_gpu_batches`]: the GPU's batched steps played on the CPU (tests).
    gpu_stand_in: bool,
    /// The types new sequences' KV caches store keys and values in ([`Model::set_cache_types`]).
    cache_types: (KvType, KvType),
}

fn md_u32(ct: &gguf_file::Content, key: &str) -> Option<usize> {
    ct.metadata.get(key).and_then(|v| v.to_u32().ok()).map(|v| v as usize)
}

/// FNV-1a 64: the model's tail hash and the slot file's checksum.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

fn tail_hash(mut file: &File, size: u64) -> std::io::Result<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let n = size.min(4 << 20);
    file.seek(SeekFrom::Start(size - n))?;
    let mut buf = vec![0u8; n as usize];
    file.read_exact(&mut buf)?;
    file.seek(SeekFrom::Start(0))?;
    Ok(fnv1a(&buf))
}

impl Model {
    /// The index of the largest value of a 1-D f32 row, ties to the lowest index (NaN is never
    /// larger), as greedy sampling picks. On the CPU the row is read in place; elsewhere the
    /// reduction runs on the device through ops whose result does not depend on their thread
    /// order (candle's own argmax keeps whichever of two equal values its reduction tree meets
    /// first, not the lowest index), and only the id crosses to the host.
    fn argmax(&self, row: &Tensor) -> Result<u32, StepError> {
        if row.device().is_cpu() {
            return Ok(banned_argmax(&row.to_vec1::<f32>()?, &[]));
        }
        let n = row.dim(0)?;
        // Rows are vocabulary-wide, so the ranks are made once; another width gets its own.
        let rank = match self.argmax_rank.get() {
            Some(rank) if rank.dim(0)? == n => rank.clone(),
            _ => {
                let rank = Tensor::new((1..=n as u32).rev().collect::<Vec<u32>>(), row.device())?;
                let _ = self.argmax_rank.set(rank.clone());
                rank
            }
        };
        // hit[i] * (n - i) is largest at the lowest i holding the maximum.
        let max = row.max_keepdim(0)?;
        let hit = row.broadcast_eq(&max)?.to_dtype(candle_core::DType::U32)?;
        let best = hit.mul(&rank)?.max(0)?.to_scalar::<u32>()?;
        Ok(n as u32 - best.max(1))
    }

    /// [`Sequence::decode_argmax`]'s choice over `row`, computed where the model runs (the row
    /// is copied there first): what the CUDA tests compare with the host's greedy pick.
    pub fn argmax_of(&self, row: &[f32]) -> Result<u32, StepError> {
        self.argmax(&Tensor::new(row, &self.device)?)
    }

    /// Loads a GGUF onto the CPU.
    pub fn load(path: &Path) -> Result<Model, LoadError> {
        Self::load_on(path, &Device::Cpu)
    }

    /// The tokenizer of a GGUF alone (its metadata; no weights are read), for any model whose
    /// tokenizer Tine reads (SentencePiece-style `llama` or byte-level BPE `gpt2` vocabularies),
    /// whether or not Tine runs its architecture.
    pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, LoadError> {
        let p = || path.to_owned();
        let file = File::open(path).map_err(|source| LoadError::Open { path: p(), source })?;
        let ct = gguf_file::Content::read(&mut BufReader::new(file)).map_err(|source| LoadError::Gguf { path: p(), source })?;
        Tokenizer::from_gguf(&ct).map_err(|source| LoadError::Tokenizer { path: p(), source })
    }

    /// A GGUF's `general.architecture` (its metadata alone; no weights are read): tells a
    /// drafter file's kind (`gemma4-assistant`, a model) before loading it.
    pub fn architecture_of(path: &Path) -> Result<String, LoadError> {
        let p = || path.to_owned();
        let file = File::open(path).map_err(|source| LoadError::Open { path: p(), source })?;
        let ct = gguf_file::Content::read(&mut BufReader::new(file)).map_err(|source| LoadError::Gguf { path: p(), source })?;
        Ok(ct.metadata.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default())
    }

    /// Loads a GGUF with its weights (and every sequence's KV cache) on `device`
    /// ([`DeviceSpec::open`] makes one from `--device`).
    pub fn load_on(path: &Path, device: &Device) -> Result<Model, LoadError> {
        let p = || path.to_owned();
        let file = File::open(path).map_err(|source| LoadError::Open { path: p(), source })?;
        let file_size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let tail_hash = tail_hash(&file, file_size).map_err(|source| LoadError::Open { path: p(), source })?;
        let mut reader = BufReader::new(file);
        let ct = gguf_file::Content::read(&mut reader).map_err(|source| LoadError::Gguf { path: p(), source })?;
        let arch = ct.metadata.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
        if !matches!(arch.as_str(), "gemma3" | "gemma4" | "qwen35" | "qwen35moe") {
            return Err(LoadError::Architecture { path: p(), found: arch });
        }
        let tokenizer = Tokenizer::from_gguf(&ct).map_err(|source| LoadError::Tokenizer { path: p(), source })?;
        let info = ModelInfo {
            path: p(),
            name: ct.metadata.get("general.name").and_then(|v| v.to_string().ok()).cloned().unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()),
            architecture: arch.clone(),
            context_length: md_u32(&ct, &format!("{arch}.context_length")).unwrap_or(8192),
            vocab_size: tokenizer.vocab_size(),
            embedding_length: md_u32(&ct, &format!("{arch}.embedding_length")).unwrap_or(0),
            block_count: md_u32(&ct, &format!("{arch}.block_count")).unwrap_or(0),
            file_size,
            tail_hash,
            chat_template: ct.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()).cloned(),
            pooling_type: md_u32(&ct, &format!("{arch}.pooling_type")).map(|v| v as u32),
            fim: crate::tokenizer::FimTokens::from_gguf(&ct, &tokenizer),
        };
        let device = device.clone();
        let weights = match arch.as_str() {
            "gemma3" => ModelWeights::from_gguf(ct, &mut reader, &device).map(|w| Weights::Gemma3(Box::new(w))),
            "gemma4" => gemma4::ModelWeights::from_gguf(ct, &mut reader, &device).map(|w| Weights::Gemma4(Box::new(w))),
            _ => qwen35::ModelWeights::from_gguf(ct, &mut reader, &device).map(|w| Weights::Qwen35(Box::new(w))),
        }
        .map_err(|source| LoadError::Weights { path: p(), source })?;
        let mut eog: Vec<u32> = tokenizer.eos_token().into_iter().collect();
        // llama.cpp's end-of-generation texts (Gemma 4 ends a turn with `<turn|>` and hands over
        // to a tool with `<|tool_response>`).
        for text in ["<end_of_turn>", "<eos>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<turn|>", "<|tool_response>"] {
            if let Some(id) = tokenizer.token_id(text).filter(|&id| tokenizer.is_control(id)) {
                if !eog.contains(&id) {
                    eog.push(id);
                }
            }
        }
        // The weights were copied on this thread's stream; a server steps the model on another
        // thread (candle uses per-thread streams), so the copies must be complete first.
        device.synchronize().map_err(|source| LoadError::Weights { path: p(), source })?;
        // The engine reads the GGUF itself; where it cannot run this model, candle's CUDA path
        // does, and `engine_note` says why.
        let (gpu, engine_note) = match GpuTrunk::open(path, &device, info.context_length.min(MAX_GPU_CONTEXT)) {
            Ok(gpu) => (gpu, None),
            Err(e) if crate::gpu::is_unsupported_model(&e) => (None, Some(crate::error_chain(&e))),
            Err(source) => return Err(LoadError::Gpu { path: p(), source: Box::new(source) }),
        };
        let model = Model {
            weights,
            tokenizer,
            info,
            eog,
            device,
            argmax_rank: std::sync::OnceLock::new(),
            gpu,
            engine_note,
            gpu_batch: Default::default(),
            gpu_stand_in: false,
            cache_types: (KvType::F32, KvType::F32),
        };
        if model.device.is_cpu() {
            // One forward now builds the CPU matmul's interleaved weight tiles (patch 0022: about
            // 0.2 s for the default model), so the first request does not pay for them.
            model.new_sequence(1).decode_argmax(&model, 0).map_err(|source| LoadError::WarmUp { path: p(), source })?;
        }
        Ok(model)
    }

    /// Appends `steps[i].1` to sequence `steps[i].0` for every `i` and returns each one's logits
    /// rows, bit for bit what [`Sequence::forward_all`] gives each alone (continuous batching).
    /// On the CPU every family runs them as one forward (every matrix read once for the rows of
    /// all; [`Model::batches`]); otherwise they run one after another. Atomic as a whole: on an
    /// error every sequence is as it was before the call.
    pub fn forward_many(&self, steps: &mut [(&mut Sequence, &[u32])]) -> Result<Vec<Logits>, StepError> {
        let mut rows: Vec<(&mut Sequence, &[u32], Rows)> = steps.iter_mut().map(|(s, t)| (&mut **s, *t, Rows::Verify { hidden: false })).collect();
        Ok(self.step_many(&mut rows)?.into_iter().map(|(l, _)| l).collect())
    }

    /// [`Sequence::decode`] for several sequences, one token each: each one's logits row, bit for
    /// bit what its own `decode` gives, in one forward on the CPU ([`Model::step_many`]). Atomic
    /// as a whole.
    pub fn decode_many(&self, steps: &mut [(&mut Sequence, u32)]) -> Result<Vec<Vec<f32>>, StepError> {
        let tokens: Vec<[u32; 1]> = steps.iter().map(|(_, t)| [*t]).collect();
        let mut rows: Vec<(&mut Sequence, &[u32], Rows)> = steps.iter_mut().zip(&tokens).map(|((s, _), t)| (&mut **s, &t[..], Rows::Decode)).collect();
        Ok(self.step_many(&mut rows)?.into_iter().map(|(l, _)| l.data).collect())
    }

    /// One step of continuous batching: appends `steps[i].1` to sequence `steps[i].0` for every
    /// `i`, each as its [`Rows`] kind says, and returns each one's logits (and hidden states where
    /// asked), bit for bit what that sequence's own call gives alone: [`Sequence::decode`] for
    /// [`Rows::Decode`], [`Sequence::forward_all`] or [`Sequence::forward_all_hidden`] for
    /// [`Rows::Verify`], [`Sequence::prefill_piece`] for [`Rows::Prefill`] (at most
    /// [`PREFILL_CHUNK`] tokens). On the CPU every family runs them as one forward (every matrix read once
    /// for the rows of all; [`Model::batches`]); otherwise one after another. Atomic as a whole:
    /// on an error every sequence is as it was before the call.
    pub fn step_many(&self, steps: &mut [(&mut Sequence, &[u32], Rows)]) -> Result<Vec<(Logits, Option<Hidden>)>, StepError> {
        for (seq, tokens, kind) in steps.iter() {
            seq.check(self, tokens)?;
            if *kind == Rows::Decode && tokens.len() != 1 {
                return Err(StepError::Candle(candle_core::Error::Msg(format!("a decode step of {} tokens (one is fed at a time)", tokens.len()))));
            }
        }
        if let Some((_, t, _)) = steps.iter().find(|(_, t, k)| matches!(k, Rows::Prefill { .. }) && t.len() > PREFILL_CHUNK) {
            return Err(StepError::Candle(candle_core::Error::Msg(format!("a prompt piece of {} tokens (at most {PREFILL_CHUNK})", t.len()))));
        }
        if !self.batches() || steps.len() < 2 || steps.iter().any(|(seq, _, _)| seq.gpu.is_some()) {
            return self.step_each(steps);
        }
        let hidden: Vec<bool> = steps.iter().map(|(_, _, k)| matches!(k, Rows::Verify { hidden: true } | Rows::Prefill { hidden: true, .. })).collect();
        // A prompt chunk's head runs on its last row alone, as its prefill's does.
        let last: Vec<bool> = steps.iter().map(|(_, _, k)| matches!(k, Rows::Prefill { .. })).collect();
        if let Weights::Gemma4(w) = &self.weights {
            if steps.iter().any(|(seq, _, _)| !matches!(seq.cache, SeqCache::Gemma4(_))) {
                return self.step_each(steps);
            }
            return self.forward_many_rows(steps, &hidden, |ids, caches| {
                let mut batch: Vec<(&Tensor, &mut gemma4::Cache)> = ids.iter().zip(caches).map(|(x, c)| (x, if let SeqCache::Gemma4(c) = c { c } else { unreachable!("checked above") })).collect();
                Ok(w.forward_batch(&mut batch, &last)?.into_iter().map(|o| (o.logits, Some(o.hidden))).collect())
            });
        }
        if let Weights::Qwen35(w) = &self.weights {
            if steps.iter().any(|(seq, _, _)| !matches!(seq.cache, SeqCache::Qwen35(_))) {
                return self.step_each(steps);
            }
            // A verify batch keeps its row states (as `Sequence::forward_all` runs it: a rollback
            // to any row is exact), a decode row none (as `Sequence::decode`).
            let record: Vec<bool> = steps.iter().map(|(_, _, k)| matches!(k, Rows::Verify { .. })).collect();
            return self.forward_many_rows(steps, &hidden, |ids, caches| {
                let mut batch: Vec<(&Tensor, &mut qwen35::Cache)> =
                    ids.iter().zip(caches).map(|(x, c)| (x, if let SeqCache::Qwen35(r) = c { &mut r.cache } else { unreachable!("checked above") })).collect();
                Ok(w.forward_batch(&mut batch, &record, &last)?.into_iter().map(|o| (o.logits, Some(o.hidden))).collect())
            });
        }
        let Weights::Gemma3(w) = &self.weights else { return self.step_each(steps) };
        if steps.iter().any(|(seq, _, _)| !matches!(seq.cache, SeqCache::Gemma3(_))) {
            return self.step_each(steps);
        }
        let with_hidden = hidden.iter().any(|&h| h);
        self.forward_many_rows(steps, &hidden, |ids, caches| {
            // Gemma 3's forward takes `(1, T)` ids and gives `(1, T, vocab)` logits.
            let ids = ids.iter().map(|x| x.unsqueeze(0)).collect::<candle_core::Result<Vec<_>>>()?;
            let mut batch: Vec<(&Tensor, &mut candle_transformers::models::quantized_gemma3::Cache)> =
                ids.iter().zip(caches).map(|(x, c)| (x, if let SeqCache::Gemma3(c) = c { c } else { unreachable!("checked above") })).collect();
            w.forward_batch(&mut batch, with_hidden, &last)?.into_iter().map(|o| Ok((o.logits.squeeze(0)?, o.hidden.map(|h| h.squeeze(0)).transpose()?))).collect()
        })
    }

    /// [`Model::step_many`] over a family's `forward_batch` (`run`: the ids `(T_i,)` and the
    /// caches to each sequence's logits `(T_i, vocab)` and hidden states `(T_i, embedding)`; it
    /// changes no cache on an error). `hidden[i]`: sequence `i`'s hidden states are returned.
    fn forward_many_rows(
        &self,
        steps: &mut [(&mut Sequence, &[u32], Rows)],
        hidden: &[bool],
        run: impl FnOnce(&[Tensor], Vec<&mut SeqCache>) -> candle_core::Result<Vec<(Tensor, Option<Tensor>)>>,
    ) -> Result<Vec<(Logits, Option<Hidden>)>, StepError> {
        let ids = steps.iter().map(|(_, t, _)| Tensor::new(*t, &self.device)).collect::<candle_core::Result<Vec<_>>>()?;
        let outs = run(&ids, steps.iter_mut().map(|(seq, _, _)| &mut seq.cache).collect())?;
        let mut rows = Vec::with_capacity(outs.len());
        let mut failed = None;
        for (((seq, _, kind), (logits, h)), &keep) in steps.iter_mut().zip(outs).zip(hidden) {
            let row = seq.injected().and_then(|()| {
                let data = match kind {
                    // A decode and a prompt chunk give the last row alone (the only one computed).
                    Rows::Decode | Rows::Prefill { .. } => logits.narrow(0, logits.dim(0)? - 1, 1)?,
                    Rows::Verify { .. } => logits,
                };
                let h = match (keep, h) {
                    (true, Some(h)) => Some(Hidden(h)),
                    (true, None) => return Err(StepError::Candle(candle_core::Error::Msg("the batch's forward gave no hidden states".into()))),
                    (false, _) => None,
                };
                Ok((Logits { vocab: data.dim(1)?, data: data.flatten_all()?.to_vec1::<f32>()? }, h))
            });
            match row {
                Ok(r) => rows.push(r),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failed {
            // Every cache holds its new rows, no sequence's tokens do yet: cut the caches back
            // (a recurrent state to the batch's first row state).
            for (seq, _, _) in steps.iter_mut() {
                let len = seq.tokens.len();
                if seq.cache.truncate(len).is_err() {
                    seq.reset();
                }
            }
            return Err(e);
        }
        for (seq, tokens, kind) in steps.iter_mut() {
            seq.tokens.extend_from_slice(tokens);
            if matches!(kind, Rows::Prefill { checkpoint: true, .. }) {
                seq.cache.checkpoint();
            }
        }
        Ok(rows)
    }

    /// [`Model::step_many`] one sequence after another.
    fn step_each(&self, steps: &mut [(&mut Sequence, &[u32], Rows)]) -> Result<Vec<(Logits, Option<Hidden>)>, StepError> {
        let mut out = Vec::with_capacity(steps.len());
        for i in 0..steps.len() {
            let (seq, tokens, kind) = &mut steps[i];
            let row = match *kind {
                Rows::Decode => seq.decode(self, tokens[0]).map(|data| (Logits { vocab: data.len(), data }, None)),
                Rows::Verify { hidden } => seq.forward_batch(self, tokens, hidden),
                Rows::Prefill { hidden, checkpoint } => seq.prefill_piece(self, tokens, hidden, checkpoint),
            };
            match row {
                Ok(r) => out.push(r),
                Err(e) => {
                    for (seq, tokens, _) in steps[..i].iter_mut() {
                        seq.undo_append(tokens.len());
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// The forwards a prefill of `n` tokens runs as on this model ([`prompt_pieces`]).
    pub fn prompt_pieces(&self, n: usize) -> Vec<PromptPiece> {
        prompt_pieces(n, self.is_recurrent())
    }

    /// Whether [`Model::step_many_gpu`] runs several sequences' decode and verify rows as one step of
    /// the GPU engine (Gemma 3 and Gemma 4; `TINE_GPU_BATCH=0` turns it off, to compare).
    pub fn gpu_batches(&self) -> bool {
        (self.gpu_stand_in || self.gpu.as_ref().is_some_and(GpuTrunk::batches)) && std::env::var("TINE_GPU_BATCH").map_or(true, |v| v != "0")
    }

    /// For tests of what drives the GPU's batched steps where no GPU is: a model on the CPU
    /// then says it batches on the GPU ([`Model::gpu_batches`]), and [`Model::step_many_gpu`]
    /// runs the rows as one CPU forward ([`Model::step_many`]) and reads each row back on the
    /// host as the engine's step reads it on the device (the greedy id passing over the end ids
    /// where asked, the top-k in the sampler's order, or the row).
    pub fn stand_in_gpu_batches(&mut self) {
        self.gpu_stand_in = self.gpu.is_none();
    }

    /// [`Model::step_many_gpu`] played on the CPU ([`Model::stand_in_gpu_batches`]).
    fn step_many_stand_in(&self, steps: &mut [(&mut Sequence, &[u32], RowsRead)]) -> Result<Vec<StepRows>, StepError> {
        let reads: Vec<RowsRead> = steps.iter().map(|(_, _, read)| *read).collect();
        let mut rows: Vec<(&mut Sequence, &[u32], Rows)> = steps.iter_mut().map(|(seq, tokens, read)| (&mut **seq, *tokens, Rows::Verify { hidden: read.hidden })).collect();
        let outs = self.step_many(&mut rows)?;
        Ok(outs
            .into_iter()
            .zip(reads)
            .map(|((logits, hidden), read)| {
                let banned: &[u32] = if read.ban { &self.eog } else { &[] };
                let outs = (0..logits.positions())
                    .map(|i| {
                        let row = logits.row(i);
                        match read.want {
                            DecodeWant::Argmax => DecodeOut::Id(banned_argmax(row, banned)),
                            DecodeWant::TopK(k) => {
                                let mut c: Vec<(u32, f32)> = row.iter().enumerate().filter(|(i, _)| !banned.contains(&(*i as u32))).map(|(i, &v)| (i as u32, v)).collect();
                                c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                                c.truncate(k);
                                DecodeOut::TopK(c)
                            }
                            DecodeWant::Row => DecodeOut::Row(row.to_vec()),
                        }
                    })
                    .collect();
                StepRows { outs, hidden: if read.hidden { hidden } else { None } }
            })
            .collect())
    }

    /// Whether the GPU engine reads a row's `k` best logits for this model (1..=[`TOP_K_MAX`]
    /// of a vocabulary it takes), what every top-k read on the engine asks first.
    fn engine_top_k(&self, k: usize) -> bool {
        (1..=TOP_K_MAX).contains(&k) && self.info.vocab_size <= TOP_K_MAX_VOCAB
    }

    /// What a row of [`Model::step_many_gpu`] reads back for a draw that takes the greedy
    /// id (`argmax`) or reads the `top_k` best logits alone, passing over the end-of-generation
    /// ids where `ban`: what the one-sequence steps read (`Sequence::decode_argmax_banning`,
    /// `Sequence::decode_top_k`), the row where those would read it.
    pub fn gpu_decode_want(&self, argmax: bool, top_k: Option<usize>, ban: bool) -> DecodeWant {
        let bans_fit = !ban || self.eog.len() <= MAX_BANNED;
        match (argmax, top_k) {
            (true, _) if bans_fit => DecodeWant::Argmax,
            (false, Some(k)) if bans_fit && self.engine_top_k(k) => DecodeWant::TopK(k),
            _ => DecodeWant::Row,
        }
    }

    /// Readies [`Model::step_many_gpu`] for up to `rows` rows a step over sequences of
    /// `context` positions (a server's `--parallel` and `-c`): its buffers and the CUDA graph of
    /// every row count it would run, captured now over a scratch sequence rather than at a
    /// request's first step. Returns the graphs and the device bytes the buffers hold.
    pub fn warm_gpu_batch(&self, rows: usize, context: usize) -> Result<(usize, usize), StepError> {
        let Some(gpu) = self.gpu.as_ref().filter(|g| g.batches()) else { return Ok((0, 0)) };
        let mut scratch = self.try_new_sequence(context)?;
        let mut state = self.gpu_batch.lock().unwrap_or_else(|e| e.into_inner());
        let g = scratch.gpu.as_mut().expect("a sequence of a model on the engine is on it");
        let graphs = gpu.warm_batch(&mut state, g, rows.min(BATCH_ROWS))?;
        Ok((graphs, state.device_bytes()))
    }

    /// Device bytes the engine's batched-step buffers hold (0 before the first batched step).
    pub fn gpu_batch_bytes(&self) -> usize {
        self.gpu_batch.lock().map_or(0, |b| b.device_bytes())
    }

    /// Appends tokens `steps[i].1` (a decode's one token, or a speculative verify batch) to
    /// sequence `steps[i].0` for every `i`, in steps of the GPU engine that
    /// run every sequence's rows at once ([`Model::gpu_batches`]; up to 256 rows a step), and
    /// returns what each sequence's [`RowsRead`] asks: each row's greedy id (passing over the
    /// end-of-generation ids where `ban`, `ignore_eos`), top-k or logits row, and the rows'
    /// hidden states where `hidden`, bit for bit what the sequence's own steps give
    /// ([`Sequence::decode_argmax_banning`], [`Sequence::decode_top_k`], [`Sequence::decode`];
    /// [`Sequence::forward_all_argmax`], [`Sequence::forward_all_top_k`],
    /// [`Sequence::forward_all`]; with hidden states, [`Sequence::forward_all_argmax_hidden`] and
    /// the like). Atomic as a whole: on an error every sequence is as it was.
    pub fn step_many_gpu(&self, steps: &mut [(&mut Sequence, &[u32], RowsRead)]) -> Result<Vec<StepRows>, StepError> {
        if self.gpu_stand_in {
            return self.step_many_stand_in(steps);
        }
        let Some(gpu) = self.gpu.as_ref().filter(|g| g.batches()) else {
            return Err(StepError::Candle(candle_core::Error::Msg(
                "batched GPU steps need a model whose family the GPU engine batches (Gemma 3, Gemma 4; Qwen3.5 with TINE_GPU_BATCH_QWEN35=1)".into(),
            )));
        };
        for (seq, tokens, RowsRead { want, .. }) in steps.iter() {
            seq.check(self, tokens)?;
            if seq.gpu.is_none() {
                return Err(StepError::Candle(candle_core::Error::Msg("a sequence of a batched GPU step is not on the engine".into())));
            }
            if tokens.len() > BATCH_ROWS {
                return Err(StepError::Candle(candle_core::Error::Msg(format!("{} rows of one sequence in a batched GPU step (at most {BATCH_ROWS})", tokens.len()))));
            }
            if let DecodeWant::TopK(k) = want {
                if !self.engine_top_k(*k) {
                    return Err(StepError::Candle(candle_core::Error::Msg(format!("a top-{k} draw in a batched GPU step (1..={TOP_K_MAX})"))));
                }
            }
        }
        // The engine's argmax and top-k pass over up to MAX_BANNED ids; past them a banning row
        // reads its logits row ([`Model::gpu_decode_want`] asks for it).
        let eog: &[u32] = if self.eog.len() <= MAX_BANNED { &self.eog } else { &[] };
        if steps.iter().any(|(_, _, r)| r.ban && self.eog.len() > MAX_BANNED && r.want != DecodeWant::Row) {
            return Err(StepError::Candle(candle_core::Error::Msg(format!("{} end-of-generation ids to pass over on the GPU (at most {MAX_BANNED}): read the row", self.eog.len()))));
        }
        let starts: Vec<usize> = steps.iter().map(|(seq, ..)| seq.tokens.len()).collect();
        let mut out = Vec::with_capacity(steps.len());
        let mut state = self.gpu_batch.lock().unwrap_or_else(|e| e.into_inner());
        let mut failed = None;
        let mut rest = &mut steps[..];
        while !rest.is_empty() && failed.is_none() {
            // As many entries as fit one step's rows.
            let mut take = 0;
            let mut rows = 0;
            while take < rest.len() && rows + rest[take].1.len() <= BATCH_ROWS {
                rows += rest[take].1.len();
                take += 1;
            }
            let (chunk, after) = std::mem::take(&mut rest).split_at_mut(take.max(1));
            rest = after;
            let mut entries: Vec<(&mut GpuSeq, &[u32], RowsRead)> = chunk.iter_mut().map(|(seq, tokens, read)| (seq.gpu.as_mut().expect("checked above"), *tokens, *read)).collect();
            match gpu.step_batch(&mut state, &mut entries, eog) {
                Ok(o) => {
                    drop(entries);
                    for (seq, tokens, ..) in chunk.iter_mut() {
                        seq.tokens.extend_from_slice(tokens);
                        if let Err(e) = seq.injected() {
                            failed.get_or_insert(e);
                        }
                    }
                    let width = self.info.embedding_length;
                    for r in o {
                        let hidden = match r.hidden {
                            Some(h) => {
                                let n = h.len() / width;
                                match Tensor::from_vec(h, (n, width), &Device::Cpu) {
                                    Ok(t) => Some(Hidden(t)),
                                    Err(e) => {
                                        failed.get_or_insert(e.into());
                                        None
                                    }
                                }
                            }
                            None => None,
                        };
                        out.push(StepRows { outs: r.outs, hidden });
                    }
                }
                Err(e) => failed = Some(e.into()),
            }
        }
        if let Some(e) = failed {
            // Every sequence back to where it was (a step only appends).
            for ((seq, ..), &start) in steps.iter_mut().zip(&starts) {
                seq.tokens.truncate(start);
                if let Some(g) = seq.gpu.as_mut() {
                    if !g.truncate(start) {
                        g.truncate(0);
                        seq.tokens.clear();
                    }
                }
            }
            return Err(e);
        }
        Ok(out)
    }

    /// Whether [`Model::forward_many`] runs its sequences as one forward (every family on the
    /// CPU).
    pub fn batches(&self) -> bool {
        self.device.is_cpu() && self.gpu.is_none()
    }

    /// What runs the steps: `"tine-gpu"` (the GPU decode engine) or `"candle"`.
    pub fn engine(&self) -> &'static str {
        if self.gpu.is_some() {
            "tine-gpu"
        } else {
            "candle"
        }
    }

    /// Why a model on a GPU runs on candle's path rather than the engine (a weight type the
    /// engine does not read, say), for the user to see.
    pub fn engine_note(&self) -> Option<&str> {
        self.engine_note.as_deref()
    }

    /// Stores the keys and the values of sequences made from now on as `k` and `v` (llama.cpp's
    /// `--cache-type-k/-v`; f32 by default). Sequences differ between types, but within one type
    /// a speculative verify batch reproduces one-token decoding bit for bit. On the CPU every
    /// model keeps every type (Qwen3.5/3.6 in its attention layers and NextN head; its delta-net
    /// states stay f32); the GPU engine keeps f32, f16, bf16, q8_0 and q4_0 (its quantized rows
    /// the CPU's bytes); candle's GPU path keeps f32 only, and refuses others.
    pub fn set_cache_types(&mut self, k: KvType, v: KvType) -> Result<(), CacheTypeError> {
        if (k, v) == (KvType::F32, KvType::F32) {
            self.cache_types = (k, v);
            return Ok(());
        }
        if !self.device.is_cpu() && (self.gpu.is_none() || crate::gpu::engine_kv_types(k, v).is_none()) {
            return Err(CacheTypeError::Device { engine: format!("{} ({})", crate::describe_device(&self.device), self.engine()), k, v });
        }
        match &self.weights {
            Weights::Gemma3(w) => w.new_cache_typed(1, k, v).map(drop),
            Weights::Gemma4(w) => w.new_cache_typed(1, k, v).map(drop),
            Weights::Qwen35(w) => w.new_cache_typed(1, k, v).map(drop),
        }
        .map_err(|source| CacheTypeError::Shape { k, v, source })?;
        self.cache_types = (k, v);
        Ok(())
    }

    /// The types sequences' KV caches store keys and values in.
    pub fn cache_types(&self) -> (KvType, KvType) {
        self.cache_types
    }

    /// Bytes of KV cache one position takes in a Gemma 3 or Gemma 4 model's layers at the cache
    /// types (Qwen3.5/3.6, whose state is also recurrent: `None`).
    pub fn kv_bytes_per_position(&self) -> Option<usize> {
        let (k, v) = self.cache_types;
        match &self.weights {
            Weights::Gemma3(w) => {
                let (layers, kv_heads, head_dim) = w.kv_shape();
                Some(layers * kv_heads * (k.row_bytes(head_dim).ok()? + v.row_bytes(head_dim).ok()?))
            }
            Weights::Gemma4(w) => {
                let c = w.config();
                c.layers[..c.kv_layers].iter().map(|l| Some(l.n_kv_head * (k.row_bytes(l.head_dim).ok()? + v.row_bytes(l.head_dim).ok()?))).sum()
            }
            Weights::Qwen35(_) => None,
        }
    }

    /// Bytes one entry of a Gemma 3 NextN head's cache takes at the cache types (one block of
    /// the trunk's shape); `None` without such a head.
    pub fn nextn_kv_bytes_per_position(&self) -> Option<usize> {
        let (k, v) = self.cache_types;
        match &self.weights {
            Weights::Gemma3(w) if w.has_nextn() => {
                let (_, kv_heads, head_dim) = w.kv_shape();
                Some(kv_heads * (k.row_bytes(head_dim).ok()? + v.row_bytes(head_dim).ok()?))
            }
            _ => None,
        }
    }

    /// Where the weights and the sequences' KV caches live.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The token of each NextN logit row, when the head scores a subset of the vocabulary.
    pub fn nextn_draft_vocab(&self) -> Option<&[u32]> {
        match &self.weights {
            Weights::Gemma3(w) => w.nextn_draft_vocab(),
            Weights::Qwen35(_) | Weights::Gemma4(_) => None,
        }
    }

    /// Whether the GGUF carries a NextN head (`--spec-type draft-mtp`).
    pub fn has_nextn(&self) -> bool {
        match &self.weights {
            Weights::Gemma3(w) => w.has_nextn(),
            Weights::Qwen35(w) => w.has_nextn(),
            Weights::Gemma4(_) => false,
        }
    }

    /// Whether a sequence's state is recurrent (Qwen3.5's delta-net layers): it rolls back only
    /// to positions [`Sequence::restorable`] names, not to any position as a KV cache does.
    pub fn is_recurrent(&self) -> bool {
        matches!(self.weights, Weights::Qwen35(_))
    }

    /// A fresh NextN drafting state for `context` positions, if the model has a NextN head.
    /// On the GPU engine the head runs there (falling back to candle's head if its cache
    /// cannot be allocated).
    pub fn new_nextn_state(&self, context: usize) -> Option<NextNState> {
        let context = context.min(self.info.context_length).max(1);
        if let Some(gpu) = &self.gpu {
            let types = crate::gpu::engine_kv_types(self.cache_types.0, self.cache_types.1).expect("cache types checked by set_cache_types");
            if let Ok(Some(state)) = gpu.new_nextn(context.min(gpu.max_context()), types) {
                return Some(NextNState { cache: NextNCacheOn::Gpu(state), tokens: Vec::new(), on_cpu: false });
            }
        }
        match &self.weights {
            Weights::Gemma3(w) => w.new_nextn_cache_typed(context.min(4096), self.cache_types.0, self.cache_types.1).map(|cache| NextNState {
                cache: NextNCacheOn::Candle(cache),
                tokens: Vec::new(),
                on_cpu: self.device.is_cpu(),
            }),
            Weights::Qwen35(w) => {
                w.new_nextn_cache_typed(self.cache_types.0, self.cache_types.1).map(|cache| NextNState { cache: NextNCacheOn::Qwen35(cache), tokens: Vec::new(), on_cpu: self.device.is_cpu() })
            }
            Weights::Gemma4(_) => None,
        }
    }

    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    pub fn end_of_generation_tokens(&self) -> &[u32] {
        &self.eog
    }

    /// A new, empty sequence able to hold `context` positions (capped at the model's context,
    /// and on the GPU engine at its caches' size, [`MAX_GPU_CONTEXT`]). Panics where the GPU
    /// engine cannot allocate its state; [`Model::try_new_sequence`] returns that error.
    pub fn new_sequence(&self, context: usize) -> Sequence {
        self.try_new_sequence(context).expect("GPU memory for a sequence's KV cache")
    }

    /// [`Model::new_sequence`], the GPU engine's allocation failure (out of memory) as an error.
    pub fn try_new_sequence(&self, context: usize) -> Result<Sequence, GpuError> {
        let context = context.min(self.info.context_length).max(1);
        Ok(match &self.gpu {
            Some(gpu) => {
                let context = context.min(gpu.max_context());
                let types = crate::gpu::engine_kv_types(self.cache_types.0, self.cache_types.1).expect("cache types checked by set_cache_types");
                let seq = gpu.new_seq(context, types)?;
                // candle's cache stays empty: the engine's holds the positions.
                Sequence {
                    cache: self.new_cache_for(1),
                    tokens: Vec::new(),
                    context,
                    #[cfg(feature = "failure-injection")]
                    fail_after: None,
                    gpu: Some(seq),
                    on_cpu: false,
                }
            }
            None => Sequence {
                cache: self.new_cache_for(context),
                tokens: Vec::new(),
                context,
                #[cfg(feature = "failure-injection")]
                fail_after: None,
                gpu: None,
                on_cpu: self.device.is_cpu(),
            },
        })
    }

    /// The GPU's free and total memory in bytes, when the model runs on the GPU engine.
    pub fn gpu_memory(&self) -> Option<Result<(usize, usize), GpuError>> {
        self.gpu.as_ref().map(|g| g.memory())
    }

    /// An empty KV cache for a sequence of `context` positions.
    pub(crate) fn new_cache_for(&self, context: usize) -> SeqCache {
        match &self.weights {
            // Preallocate up to 4096 positions; the cache grows past that only for long contexts.
            Weights::Gemma3(w) => SeqCache::Gemma3(w.new_cache_typed(context.min(4096), self.cache_types.0, self.cache_types.1).expect("cache types checked by set_cache_types")),
            Weights::Qwen35(w) => SeqCache::Qwen35(Recurrent::new(w.new_cache_typed(context.min(4096), self.cache_types.0, self.cache_types.1).expect("cache types checked by set_cache_types"))),
            Weights::Gemma4(w) => SeqCache::Gemma4(w.new_cache_typed(context.min(4096), self.cache_types.0, self.cache_types.1).expect("cache types checked by set_cache_types")),
        }
    }
}

/// The largest value of `row` with the ids in `banned` passed over, the lowest id on ties: greedy
/// sampling's pick from the row with `banned` at -inf.
pub fn banned_argmax(row: &[f32], banned: &[u32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &v) in row.iter().enumerate() {
        if banned.contains(&(i as u32)) {
            continue;
        }
        if best.is_none_or(|b| v > row[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

/// Logits of one or more positions, row-major `(positions, vocab)`.
#[derive(Debug, Clone)]
pub struct Logits {
    pub data: Vec<f32>,
    pub vocab: usize,
}

impl Logits {
    pub fn positions(&self) -> usize {
        self.data.len() / self.vocab
    }
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
    pub fn last(&self) -> &[f32] {
        self.row(self.positions() - 1)
    }
}

/// One sequence's state: the tokens it has seen and their KV cache.
///
/// Invariant: `tokens.len()` equals the positions the cache holds.
/// Invariant: every step is atomic: a step that returns an error leaves the tokens and the
/// cache's length exactly as they were (the KV rows it wrote past the old end are dead, as
/// after a rollback), so a caller may keep using the sequence and its cached prefix.
pub struct Sequence {
    cache: SeqCache,
    tokens: Vec<u32>,
    context: usize,
    /// Forwards left before an injected failure ([`Sequence::inject_failure`]).
    #[cfg(feature = "failure-injection")]
    fail_after: Option<usize>,
    /// The engine's KV cache, when the model runs on the GPU engine (then `cache` is unused).
    gpu: Option<GpuSeq>,
    /// Whether `cache` lives in host memory (shared prefixes are read there).
    on_cpu: bool,
}

/// One forward of a prompt as [`Sequence::prefill`] runs it: `len` tokens from `start` (of the
/// prefilled tokens), and whether a recurrent state keeps a checkpoint after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptPiece {
    pub start: usize,
    pub len: usize,
    pub checkpoint: bool,
}

/// The forwards a prefill of `n` tokens runs as (on a model that is `recurrent` or not):
/// chunks of at most [`PREFILL_CHUNK`]; on a recurrent model the last token alone, and a
/// checkpoint of the state after each of the last two positions (a next request sharing the
/// prompt keeps at most all of it but its last token, and a NextN drafter one position less).
/// Feeding these pieces one by one ([`Rows::Prefill`]) leaves a sequence exactly as
/// [`Sequence::prefill`] of the `n` tokens does.
pub fn prompt_pieces(n: usize, recurrent: bool) -> Vec<PromptPiece> {
    let split = if recurrent && n > 1 { n - 1 } else { n };
    let mut out = Vec::with_capacity(n.div_ceil(PREFILL_CHUNK) + 1);
    let mut start = 0;
    for (from, to) in [(0, split), (split, n)] {
        while start < to {
            let len = (to - start).min(PREFILL_CHUNK);
            let end = start + len;
            debug_assert!(start >= from);
            out.push(PromptPiece { start, len, checkpoint: recurrent && n > 1 && end + 1 >= n });
            start = end;
        }
    }
    out
}

/// The longest context a sequence on the GPU engine holds (the engine sizes its attention
/// scratch for it).
pub const MAX_GPU_CONTEXT: usize = 32768;

/// Prompt tokens per forward during prefill: bounds the attention scratch memory.
pub const PREFILL_CHUNK: usize = 512;

impl Sequence {
    /// GPU memory the engine holds for this sequence (its K/V, and a recurrent model's state
    /// planes); 0 off the engine.
    pub fn device_bytes(&self) -> usize {
        self.gpu.as_ref().map_or(0, GpuSeq::device_bytes)
    }
}

impl Sequence {
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    pub fn context(&self) -> usize {
        self.context
    }
    /// Positions the KV cache holds (equal to `len()`: the invariant tests check).
    pub fn cache_len(&self) -> usize {
        match &self.gpu {
            Some(g) => g.len(),
            None => self.cache.len(),
        }
    }

    /// The longest prefix of at most `len` positions [`Sequence::rollback`] can keep: `len` (up
    /// to `len()`) for a KV cache; for a recurrent model, `len` inside the last verify batch,
    /// else 0 (its state has no history). Callers that reuse a cached prefix keep this many
    /// positions and evaluate the rest.
    pub fn restorable(&self, len: usize) -> usize {
        match &self.gpu {
            Some(g) => g.restorable(len.min(self.tokens.len())),
            None => self.cache.restorable(len.min(self.tokens.len())),
        }
    }

    /// The most drafts one verify round may hold so that a rollback to any of its rows is
    /// exact: a recurrent state on the GPU engine keeps the state after each row of one engine
    /// step ([`STEP_ROWS`] rows: the pending token and `STEP_ROWS - 1` drafts); anything else has
    /// no such bound.
    pub fn max_verify_drafts(&self) -> usize {
        match (&self.gpu, &self.cache) {
            (Some(_), SeqCache::Qwen35(_)) => STEP_ROWS - 1,
            _ => usize::MAX,
        }
    }

    /// Whether this sequence steps on the GPU engine.
    pub fn on_gpu_engine(&self) -> bool {
        self.gpu.is_some()
    }

    fn check(&self, model: &Model, tokens: &[u32]) -> Result<(), StepError> {
        if tokens.is_empty() {
            return Err(StepError::Empty);
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= model.info.vocab_size) {
            return Err(StepError::BadToken { id, vocab: model.info.vocab_size });
        }
        let needed = self.tokens.len() + tokens.len();
        if needed > self.context {
            return Err(StepError::ContextFull { needed, context: self.context });
        }
        Ok(())
    }

    /// Failure injection: the forward after `forwards` more succeed fails with
    /// [`StepError::Injected`] once its KV rows are written (the worst moment), to prove that
    /// steps are atomic. `None` turns it off. Only in builds with the `failure-injection`
    /// feature (the tests'), never in a release binary.
    #[cfg(feature = "failure-injection")]
    pub fn inject_failure(&mut self, forwards: Option<usize>) {
        self.fail_after = forwards;
    }

    /// Called after each forward has written its KV rows.
    fn injected(&mut self) -> Result<(), StepError> {
        #[cfg(feature = "failure-injection")]
        match self.fail_after {
            Some(0) => {
                self.fail_after = None;
                return Err(StepError::Injected);
            }
            Some(n) => self.fail_after = Some(n - 1),
            None => {}
        }
        Ok(())
    }

    /// Runs a step; on error, puts the sequence back to its `len()` before the step.
    fn atomic<T>(&mut self, step: impl FnOnce(&mut Self) -> Result<T, StepError>) -> Result<T, StepError> {
        let start = self.tokens.len();
        // A recurrent state cannot be cut back to where it was; a clone (tensors shared, not
        // copied) can be put back.
        let before = match &self.cache {
            SeqCache::Qwen35(c) => Some(c.cache.clone()),
            SeqCache::Gemma3(_) | SeqCache::Gemma4(_) => None,
        };
        let out = step(self);
        if out.is_err() {
            self.tokens.truncate(start);
            if let Some(g) = &mut self.gpu {
                // A recurrent state on the engine that cannot return to `start` starts over.
                if !g.truncate(start) {
                    g.truncate(0);
                    self.tokens.clear();
                }
                return out;
            }
            if let (Some(c), SeqCache::Qwen35(r)) = (before, &mut self.cache) {
                r.cache = c;
                return out;
            }
            // Every layer holds at least `start` positions (a step only appends), so this only
            // fails on a broken cache; then forget everything rather than keep a mixed state.
            if self.cache.truncate(start).is_err() {
                self.reset();
            }
        }
        out
    }

    /// Appends `tokens` (in chunks of [`PREFILL_CHUNK`]) and returns the last position's logits.
    /// Atomic: on error nothing was appended.
    pub fn prefill(&mut self, model: &Model, tokens: &[u32]) -> Result<Vec<f32>, StepError> {
        self.check(model, tokens)?;
        self.atomic(|seq| {
            let mut last = Vec::new();
            if model.gpu.is_some() && seq.gpu.is_some() {
                return Ok(seq.gpu_prefill(model, tokens, false)?.0);
            }
            for piece in prompt_pieces(tokens.len(), model.is_recurrent()) {
                last = seq.forward_piece(model, &tokens[piece.start..piece.start + piece.len], piece.checkpoint)?;
            }
            Ok(last)
        })
    }

    /// A prompt on the GPU engine, inside an atomic step: in prompt steps of up to
    /// [`GpuTrunk::prompt_rows`], the trunk alone for every step but the last (no LM head,
    /// nothing copied back), then the last token's logits and, with `hidden`, every token's
    /// final hidden state (the engine's prompt GEMM: to float rounding of one-token steps).
    fn gpu_prefill(&mut self, model: &Model, tokens: &[u32], hidden: bool) -> Result<(Vec<f32>, Vec<f32>), StepError> {
        let gpu = model.gpu.as_ref().expect("a sequence on the engine has a model on it");
        let rows = gpu.prompt_rows();
        let chunks = tokens.chunks(rows).count();
        let (mut last, mut states) = (Vec::new(), Vec::with_capacity(if hidden { tokens.len() * model.info.embedding_length } else { 0 }));
        for (i, chunk) in tokens.chunks(rows).enumerate() {
            let g = self.gpu.as_mut().expect("on the engine");
            if i + 1 == chunks {
                let (row, h) = gpu.forward_last(g, chunk, hidden)?;
                last = row;
                states.extend(h);
            } else {
                states.extend(gpu.forward_trunk(g, chunk, hidden)?);
            }
            self.injected()?;
            self.tokens.extend_from_slice(chunk);
        }
        Ok((last, states))
    }

    /// Appends one token and returns its logits.
    pub fn decode(&mut self, model: &Model, token: u32) -> Result<Vec<f32>, StepError> {
        self.prefill(model, &[token])
    }

    /// Appends one token and returns the id of its largest logit (ties to the lowest id, as
    /// greedy sampling picks), without the logits: on a GPU only the id crosses to the host,
    /// not the vocabulary-wide row. Atomic like [`Sequence::decode`].
    pub fn decode_argmax(&mut self, model: &Model, token: u32) -> Result<u32, StepError> {
        self.decode_argmax_banning(model, token, &[])
    }

    /// [`Sequence::decode_argmax`], passing over the ids in `banned` (greedy decoding with
    /// `ignore_eos`: the sampler's -inf for the end-of-generation ids, without the row). On the
    /// GPU engine the id alone crosses to the host (up to [`MAX_BANNED`] banned ids); elsewhere a
    /// non-empty `banned` reads the row on the host.
    pub fn decode_argmax_banning(&mut self, model: &Model, token: u32, banned: &[u32]) -> Result<u32, StepError> {
        if !banned.is_empty() && (banned.len() > MAX_BANNED || !self.on_gpu_engine()) {
            let row = self.decode(model, token)?;
            return Ok(banned_argmax(&row, banned));
        }
        self.check(model, &[token])?;
        self.atomic(|seq| {
            if let (Some(gpu), Some(g)) = (&model.gpu, &mut seq.gpu) {
                let id = gpu.forward_argmax(g, &[token], banned)?;
                seq.injected()?;
                seq.tokens.push(token);
                return Ok(id);
            }
            model.argmax(&seq.forward_chunk(model, &[token])?.flatten_all()?)
        })
    }

    /// Appends one token and returns the `k` best `(id, logit)` of its logits, best first (the
    /// sampler's order: logit by `total_cmp`, ties to the lower id), passing over `banned`: what
    /// a draw with top-k reads (`tine_sampling::Sampler::sample_top_k`). Only on the GPU engine,
    /// where only those pairs cross to the host; `None` elsewhere, or for `k` above
    /// [`TOP_K_MAX`] or more than [`MAX_BANNED`] banned ids, with nothing appended (the caller
    /// decodes the row). Atomic like [`Sequence::decode`].
    pub fn decode_top_k(&mut self, model: &Model, token: u32, k: usize, banned: &[u32]) -> Result<Option<Vec<(u32, f32)>>, StepError> {
        if !self.on_gpu_engine() || !model.engine_top_k(k) || banned.len() > MAX_BANNED {
            return Ok(None);
        }
        self.check(model, &[token])?;
        self.atomic(|seq| {
            let gpu = model.gpu.as_ref().expect("a sequence on the engine has a model on it");
            let top = gpu.forward_top_k(seq.gpu.as_mut().expect("on the engine"), &[token], banned, k)?;
            seq.injected()?;
            seq.tokens.push(token);
            Ok(Some(top))
        })
    }

    /// Appends `tokens` in one forward (a verify batch) and returns every position's `k` best
    /// `(id, logit)` as [`Sequence::decode_top_k`] does for one, and with `hidden` every
    /// position's hidden state: a sampled verify whose draws read only those. Only on the GPU
    /// engine, where the logits stay on the device; `None` where `decode_top_k` gives `None`, with
    /// nothing appended (the caller verifies with the rows). Atomic.
    pub fn forward_all_top_k(&mut self, model: &Model, tokens: &[u32], banned: &[u32], k: usize, hidden: bool) -> Result<Option<(RowsTopK, Option<Hidden>)>, StepError> {
        if !self.on_gpu_engine() || !model.engine_top_k(k) || banned.len() > MAX_BANNED {
            return Ok(None);
        }
        self.check(model, tokens)?;
        self.atomic(|seq| {
            let gpu = model.gpu.as_ref().expect("a sequence on the engine has a model on it");
            let mut top = Vec::with_capacity(tokens.len());
            let mut states = Vec::with_capacity(if hidden { tokens.len() * model.info.embedding_length } else { 0 });
            for chunk in tokens.chunks(STEP_ROWS) {
                let (t, h) = gpu.forward_top_k_all(seq.gpu.as_mut().expect("on the engine"), chunk, banned, k, hidden)?;
                top.extend(t);
                states.extend(h);
                seq.injected()?;
                seq.tokens.extend_from_slice(chunk);
            }
            let hidden = hidden.then(|| Tensor::from_vec(states, (tokens.len(), model.info.embedding_length), &Device::Cpu)).transpose()?.map(Hidden);
            Ok(Some((top, hidden)))
        })
    }

    /// One forward over `chunk`, inside an atomic step: appends it and returns the logits of its
    /// last position, `(1, vocab)`.
    /// One piece of a prompt ([`prompt_pieces`]) on the CPU or candle's path: its last row's
    /// logits; with `checkpoint` a recurrent state keeps a checkpoint after it. Not atomic.
    fn forward_piece(&mut self, model: &Model, tokens: &[u32], checkpoint: bool) -> Result<Vec<f32>, StepError> {
        let last = self.forward_chunk(model, tokens)?.squeeze(0)?.to_vec1::<f32>()?;
        if checkpoint {
            self.cache.checkpoint();
        }
        Ok(last)
    }

    /// [`Sequence::forward_piece`] that also returns every row's hidden state.
    fn forward_piece_hidden(&mut self, model: &Model, tokens: &[u32], checkpoint: bool) -> Result<Tensor, StepError> {
        let hidden = match (&model.weights, &mut self.cache) {
            (Weights::Gemma3(w), SeqCache::Gemma3(cache)) => w.forward_hidden(&Tensor::new(tokens, &model.device)?.unsqueeze(0)?, cache)?.squeeze(0)?,
            (Weights::Qwen35(w), SeqCache::Qwen35(r)) => w.forward_hidden(&Tensor::new(tokens, &model.device)?, &mut r.cache)?,
            (Weights::Gemma4(w), SeqCache::Gemma4(cache)) => w.forward_hidden(&Tensor::new(tokens, &model.device)?, cache)?,
            _ => unreachable!("a sequence's cache is made by its model"),
        };
        self.injected()?;
        self.tokens.extend_from_slice(tokens);
        if checkpoint {
            self.cache.checkpoint();
        }
        Ok(hidden)
    }

    /// The logits of the last of `hidden`'s rows.
    fn project_last(model: &Model, hidden: &Tensor) -> Result<Vec<f32>, StepError> {
        let last = hidden.narrow(0, hidden.dim(0)? - 1, 1)?;
        let logits = match &model.weights {
            Weights::Gemma3(w) => w.project(&last)?,
            Weights::Qwen35(w) => w.project(&last)?,
            Weights::Gemma4(w) => w.project(&last)?,
        };
        Ok(logits.squeeze(0)?.to_vec1::<f32>()?)
    }

    /// Appends one piece of a prompt ([`prompt_pieces`]) in one forward and returns its last
    /// row's logits (and with `hidden` every row's hidden state): [`Rows::Prefill`] alone.
    /// Atomic.
    pub fn prefill_piece(&mut self, model: &Model, tokens: &[u32], hidden: bool, checkpoint: bool) -> Result<(Logits, Option<Hidden>), StepError> {
        self.check(model, tokens)?;
        if tokens.len() > PREFILL_CHUNK {
            return Err(StepError::Candle(candle_core::Error::Msg(format!("a prompt piece of {} tokens (at most {PREFILL_CHUNK})", tokens.len()))));
        }
        if self.on_gpu_engine() {
            return Err(StepError::NotOnGpuEngine("prompt pieces"));
        }
        self.atomic(|seq| {
            if hidden {
                let h = seq.forward_piece_hidden(model, tokens, checkpoint)?;
                let data = Self::project_last(model, &h)?;
                Ok((Logits { vocab: data.len(), data }, Some(Hidden(h))))
            } else {
                let data = seq.forward_piece(model, tokens, checkpoint)?;
                Ok((Logits { vocab: data.len(), data }, None))
            }
        })
    }

    fn forward_chunk(&mut self, model: &Model, chunk: &[u32]) -> Result<Tensor, StepError> {
        let logits = match (&model.weights, &mut self.cache) {
            (Weights::Gemma3(w), SeqCache::Gemma3(cache)) => w.forward_with_cache(&Tensor::new(chunk, &model.device)?.unsqueeze(0)?, cache)?,
            (Weights::Qwen35(w), SeqCache::Qwen35(r)) => w.forward(&Tensor::new(chunk, &model.device)?, &mut r.cache)?.unsqueeze(0)?,
            (Weights::Gemma4(w), SeqCache::Gemma4(cache)) => w.forward(&Tensor::new(chunk, &model.device)?, cache)?.unsqueeze(0)?,
            _ => unreachable!("a sequence's cache is made by its model"),
        };
        self.injected()?;
        self.tokens.extend_from_slice(chunk);
        Ok(logits)
    }

    /// Undoes a step that appended `n` tokens (it succeeded, a step batched with it did not).
    fn undo_append(&mut self, n: usize) {
        let start = self.tokens.len() - n;
        self.tokens.truncate(start);
        if self.cache.truncate(start).is_err() {
            self.reset();
        }
    }

    /// Appends `tokens` in one forward and returns the logits of every one of them (a verify batch).
    /// Atomic: on error nothing was appended.
    pub fn forward_all(&mut self, model: &Model, tokens: &[u32]) -> Result<Logits, StepError> {
        Ok(self.forward_batch(model, tokens, false)?.0)
    }

    /// Appends `tokens` in one forward (a verify batch) and returns each position's greedy id,
    /// passing over `banned`: the ids greedy sampling picks from [`Sequence::forward_all`]'s rows
    /// with `banned` at -inf. On the GPU engine only the ids cross to the host. Atomic.
    pub fn forward_all_argmax(&mut self, model: &Model, tokens: &[u32], banned: &[u32]) -> Result<Vec<u32>, StepError> {
        Ok(self.argmax_batch(model, tokens, banned, false)?.0)
    }

    /// [`Sequence::forward_all_argmax`] that also returns every position's hidden state: a
    /// greedy verify batch for a drafter that reads them (NextN). On the GPU engine the ids and
    /// the hidden states cross to the host, not the `rows × vocab` logits. Atomic.
    pub fn forward_all_argmax_hidden(&mut self, model: &Model, tokens: &[u32], banned: &[u32]) -> Result<(Vec<u32>, Hidden), StepError> {
        let (ids, hidden) = self.argmax_batch(model, tokens, banned, true)?;
        Ok((ids, hidden.expect("asked for hidden states")))
    }

    /// Greedy ids of a verify batch (and, when asked, its hidden states): on the engine the ids
    /// come from the device, elsewhere from the rows.
    fn argmax_batch(&mut self, model: &Model, tokens: &[u32], banned: &[u32], hidden: bool) -> Result<(Vec<u32>, Option<Hidden>), StepError> {
        if !self.on_gpu_engine() || banned.len() > MAX_BANNED {
            let (logits, h) = self.forward_batch(model, tokens, hidden)?;
            return Ok(((0..logits.positions()).map(|i| banned_argmax(logits.row(i), banned)).collect(), h));
        }
        self.check(model, tokens)?;
        self.atomic(|seq| {
            let gpu = model.gpu.as_ref().expect("a sequence on the engine has a model on it");
            let mut ids = Vec::with_capacity(tokens.len());
            let mut states = Vec::with_capacity(if hidden { tokens.len() * model.info.embedding_length } else { 0 });
            for chunk in tokens.chunks(STEP_ROWS) {
                let (i, h) = gpu.forward_argmax_all(seq.gpu.as_mut().expect("on the engine"), chunk, banned, hidden)?;
                ids.extend(i);
                states.extend(h);
                seq.injected()?;
                seq.tokens.extend_from_slice(chunk);
            }
            let hidden = hidden.then(|| Tensor::from_vec(states, (tokens.len(), model.info.embedding_length), &Device::Cpu)).transpose()?.map(Hidden);
            Ok((ids, hidden))
        })
    }

    /// One forward over `tokens`, every position's logits and (when asked) hidden states.
    fn forward_batch(&mut self, model: &Model, tokens: &[u32], hidden: bool) -> Result<(Logits, Option<Hidden>), StepError> {
        self.check(model, tokens)?;
        self.atomic(|seq| {
            if let (Some(gpu), Some(_)) = (&model.gpu, &seq.gpu) {
                let mut data = Vec::with_capacity(tokens.len() * model.info.vocab_size);
                let mut states = Vec::new();
                for chunk in tokens.chunks(STEP_ROWS) {
                    let g = seq.gpu.as_mut().expect("matched above");
                    if hidden {
                        let (l, h) = gpu.forward_hidden(g, chunk)?;
                        data.extend(l);
                        states.extend(h);
                    } else {
                        data.extend(gpu.forward_logits(g, chunk)?);
                    }
                    seq.injected()?;
                    seq.tokens.extend_from_slice(chunk);
                }
                let vocab = data.len() / tokens.len();
                let hidden = hidden.then(|| Tensor::from_vec(states, (tokens.len(), model.info.embedding_length), &Device::Cpu)).transpose()?.map(Hidden);
                return Ok((Logits { data, vocab }, hidden));
            }
            let (logits, hidden) = match (&model.weights, &mut seq.cache) {
                (Weights::Gemma3(w), SeqCache::Gemma3(cache)) => {
                    let out = w.forward_all(&Tensor::new(tokens, &model.device)?.unsqueeze(0)?, cache, hidden)?;
                    (out.logits.squeeze(0)?, out.hidden.map(|h| h.squeeze(0)).transpose()?)
                }
                // A verify batch: the row states are kept, so a rollback to any row is exact.
                (Weights::Qwen35(w), SeqCache::Qwen35(r)) => {
                    let out = w.forward_verify(&Tensor::new(tokens, &model.device)?, &mut r.cache)?;
                    (out.logits, hidden.then_some(out.hidden))
                }
                (Weights::Gemma4(w), SeqCache::Gemma4(cache)) => {
                    let out = w.forward_all(&Tensor::new(tokens, &model.device)?, cache)?;
                    (out.logits, hidden.then_some(out.hidden))
                }
                _ => unreachable!("a sequence's cache is made by its model"),
            };
            seq.injected()?;
            seq.tokens.extend_from_slice(tokens);
            let vocab = logits.dim(1)?;
            let hidden = hidden.map(Hidden);
            Ok((Logits { data: logits.flatten_all()?.to_vec1::<f32>()?, vocab }, hidden))
        })
    }

    /// Keeps the first `len` positions (O(1): the cache is truncated, nothing is copied). A
    /// recurrent model keeps only positions [`Sequence::restorable`] names; others are a
    /// [`StepError::RollbackRecurrent`] and change nothing.
    pub fn rollback(&mut self, len: usize) -> Result<(), StepError> {
        if len > self.tokens.len() {
            return Err(StepError::RollbackPastEnd { to: len, len: self.tokens.len() });
        }
        match &mut self.gpu {
            Some(g) => {
                if !g.truncate(len) {
                    return Err(StepError::RollbackRecurrent { to: len, len: self.tokens.len(), nearest: g.restorable(len) });
                }
            }
            None => self.cache.truncate(len)?,
        }
        self.tokens.truncate(len);
        Ok(())
    }

    pub fn reset(&mut self) {
        match &mut self.gpu {
            Some(g) => {
                g.truncate(0);
            }
            None => self.cache.reset(),
        }
        self.tokens.clear();
    }

    /// Whether this sequence can share positions with others ([`Sequence::share_prefix`]): a
    /// Gemma 3 or Gemma 4 sequence on the CPU (the attention that reads shared rows in place is
    /// the CPU's; a recurrent state cannot be shared by prefix).
    pub fn can_share(&self) -> bool {
        self.on_cpu && self.gpu.is_none() && matches!(self.cache, SeqCache::Gemma3(_) | SeqCache::Gemma4(_))
    }

    /// The first `len` positions as a [`SharedPrefix`] other sequences of this model can start
    /// on ([`Sequence::attach_prefix`]); this sequence reads them from there too, so their K/V
    /// exist once. Its tokens and every later result stay exactly as they were.
    pub fn share_prefix(&mut self, len: usize) -> Result<SharedPrefix, StepError> {
        if len > self.tokens.len() {
            return Err(StepError::RollbackPastEnd { to: len, len: self.tokens.len() });
        }
        if !self.can_share() {
            return Err(StepError::NotForArchitecture("a KV prefix shared between sequences"));
        }
        let (kv, before) = match &mut self.cache {
            SeqCache::Gemma3(c) => {
                let before = c.shared_len().min(len);
                (PrefixKv::Gemma3(c.share_prefix(len)?), before)
            }
            SeqCache::Gemma4(c) => {
                let before = c.shared_len().min(len);
                (PrefixKv::Gemma4(c.share_prefix(len)?), before)
            }
            SeqCache::Qwen35(_) => unreachable!("can_share checked the cache"),
        };
        Ok(SharedPrefix { tokens: self.tokens[..len].to_vec(), kv, copied: len - before })
    }

    /// Empties the sequence and starts it on `prefix` (from a sequence of the same model and
    /// cache types): it then holds the prefix's tokens, reading their K/V where the prefix keeps
    /// them, and evaluates only what follows. On error the sequence is left empty.
    pub fn attach_prefix(&mut self, prefix: &SharedPrefix) -> Result<(), StepError> {
        if prefix.len() > self.context {
            return Err(StepError::ContextFull { needed: prefix.len(), context: self.context });
        }
        if !self.can_share() {
            return Err(StepError::NotForArchitecture("a KV prefix shared between sequences"));
        }
        self.tokens.clear();
        match (&mut self.cache, &prefix.kv) {
            (SeqCache::Gemma3(c), PrefixKv::Gemma3(p)) => c.attach_prefix(p)?,
            (SeqCache::Gemma4(c), PrefixKv::Gemma4(p)) => c.attach_prefix(p)?,
            (SeqCache::Gemma3(c), _) => {
                c.reset();
                return Err(StepError::NotForArchitecture("a shared prefix of another architecture"));
            }
            (SeqCache::Gemma4(c), _) => {
                c.truncate(0)?;
                return Err(StepError::NotForArchitecture("a shared prefix of another architecture"));
            }
            (SeqCache::Qwen35(_), _) => unreachable!("can_share checked the cache"),
        }
        self.tokens = prefix.tokens.clone();
        Ok(())
    }

    /// Positions this sequence reads from a prefix shared with others (the first ones).
    pub fn shared_len(&self) -> usize {
        match (&self.gpu, &self.cache) {
            (None, SeqCache::Gemma3(c)) => c.shared_len(),
            (None, SeqCache::Gemma4(c)) => c.shared_len(),
            _ => 0,
        }
    }
}

/// The first positions of a sequence, tokens and K/V, held once for every sequence started on
/// it ([`Sequence::share_prefix`], [`Sequence::attach_prefix`]). Cloning it clones handles.
#[derive(Debug, Clone)]
pub struct SharedPrefix {
    tokens: Vec<u32>,
    kv: PrefixKv,
    /// Positions whose rows were copied when it was made (the rest were already shared).
    copied: usize,
}

/// A shared prefix's K/V, by architecture.
#[derive(Debug, Clone)]
enum PrefixKv {
    Gemma3(Gemma3Prefix),
    Gemma4(gemma4::SharedPrefix),
}

impl SharedPrefix {
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Bytes of K/V its positions take.
    pub fn bytes(&self) -> usize {
        match &self.kv {
            PrefixKv::Gemma3(p) => p.bytes(),
            PrefixKv::Gemma4(p) => p.bytes(),
        }
    }

    /// Positions whose rows it holds of its own: those before were already in a prefix it
    /// extends (and whose rows it reads in place).
    pub fn copied(&self) -> usize {
        self.copied
    }
}

/// What a sequence's rows in [`Model::step_many`] are, and so what they give back and keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// One token, as [`Sequence::decode`] feeds it: its logits row; a recurrent model keeps no
    /// row states.
    Decode,
    /// A verify batch, as [`Sequence::forward_all`] feeds it (with `hidden`, as
    /// [`Sequence::forward_all_hidden`]): every row's logits (and hidden state), a recurrent
    /// model's row states kept so that a rollback to any row is exact.
    Verify { hidden: bool },
    /// One piece of a prompt ([`prompt_pieces`]: at most [`PREFILL_CHUNK`] tokens), as
    /// [`Sequence::prefill_piece`] feeds it: the last row's logits (and with `hidden` every row's
    /// hidden state); with `checkpoint` a recurrent state keeps a checkpoint after it. The pieces
    /// of a prompt fed in order leave the sequence as [`Sequence::prefill`] (or
    /// [`Sequence::prefill_hidden`]) of the whole does, bit for bit.
    Prefill { hidden: bool, checkpoint: bool },
}

/// Hidden states of consecutive positions, `(positions, embedding_length)`: what the model's
/// multi-token-prediction heads read (Gemma 3's before the output norm, Qwen3.5's after it). On the model's device, or in host memory when
/// the GPU engine made them (its NextN head uploads the rows it reads).
#[derive(Debug, Clone)]
pub struct Hidden(Tensor);

/// One sequence's rows of [`Model::step_many_gpu`], as its [`RowsRead`] asked: a [`DecodeOut`]
/// a row, and the rows' hidden states where it asked for them.
#[derive(Debug)]
pub struct StepRows {
    pub outs: Vec<DecodeOut>,
    pub hidden: Option<Hidden>,
}

impl Hidden {
    pub fn positions(&self) -> usize {
        self.0.dim(0).expect("hidden states are 2-D")
    }

    /// Rows `start..start + len`.
    pub fn rows(&self, start: usize, len: usize) -> Result<Hidden, StepError> {
        Ok(Hidden(self.0.narrow(0, start, len)?))
    }

    /// `self` followed by `other`.
    pub fn concat(&self, other: &Hidden) -> Result<Hidden, StepError> {
        Ok(Hidden(Tensor::cat(&[&self.0, &other.0], 0)?))
    }

    pub fn to_vec(&self) -> Result<Vec<Vec<f32>>, StepError> {
        Ok(self.0.to_vec2::<f32>()?)
    }
}

impl Sequence {
    /// [`Sequence::prefill`] that also returns the hidden states of every position it adds.
    pub fn prefill_hidden(&mut self, model: &Model, tokens: &[u32]) -> Result<(Vec<f32>, Hidden), StepError> {
        self.check(model, tokens)?;
        self.atomic(|seq| {
            if model.gpu.is_some() && seq.gpu.is_some() {
                let (row, states) = seq.gpu_prefill(model, tokens, true)?;
                return Ok((row, Hidden(Tensor::from_vec(states, (tokens.len(), model.info.embedding_length), &Device::Cpu)?)));
            }
            let mut hidden = Vec::new();
            for piece in prompt_pieces(tokens.len(), model.is_recurrent()) {
                hidden.push(seq.forward_piece_hidden(model, &tokens[piece.start..piece.start + piece.len], piece.checkpoint)?);
            }
            let hidden = Tensor::cat(&hidden, 0)?;
            let logits = Self::project_last(model, &hidden)?;
            Ok((logits, Hidden(hidden)))
        })
    }

    /// Appends `tokens` and returns each one's final hidden state after the output norm, the
    /// rows embeddings pool (llama.cpp's `result_norm`), `(tokens.len(), embedding_length)` as
    /// rows. No vocabulary projection is computed. Not on the GPU engine. Atomic.
    pub fn embeddings(&mut self, model: &Model, tokens: &[u32]) -> Result<Vec<Vec<f32>>, StepError> {
        if self.on_gpu_engine() {
            return Err(StepError::NotOnGpuEngine("embeddings"));
        }
        self.check(model, tokens)?;
        self.atomic(|seq| {
            let mut rows = Vec::with_capacity(tokens.len());
            for piece in prompt_pieces(tokens.len(), model.is_recurrent()) {
                let chunk = &tokens[piece.start..piece.start + piece.len];
                let states = match (&model.weights, &mut seq.cache) {
                    (Weights::Gemma3(w), SeqCache::Gemma3(cache)) => w.forward_embeddings(&Tensor::new(chunk, &model.device)?.unsqueeze(0)?, cache)?.squeeze(0)?,
                    // These two return their hidden states after the output norm already.
                    (Weights::Qwen35(w), SeqCache::Qwen35(r)) => w.forward_hidden(&Tensor::new(chunk, &model.device)?, &mut r.cache)?,
                    (Weights::Gemma4(w), SeqCache::Gemma4(cache)) => w.forward_hidden(&Tensor::new(chunk, &model.device)?, cache)?,
                    _ => unreachable!("a sequence's cache is made by its model"),
                };
                rows.extend(states.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?);
                seq.injected()?;
                seq.tokens.extend_from_slice(chunk);
            }
            Ok(rows)
        })
    }

    /// [`Sequence::forward_all`] that also returns the hidden states of every position.
    pub fn forward_all_hidden(&mut self, model: &Model, tokens: &[u32]) -> Result<(Logits, Hidden), StepError> {
        let (logits, hidden) = self.forward_batch(model, tokens, true)?;
        Ok((logits, hidden.expect("asked for hidden states")))
    }

    /// The target side of an assistant head's draft step (it reads this sequence's KV cache).
    /// The logits cover the head's draft vocabulary ([`Assistant::draft_vocab`]) when it has one.
    pub fn assistant_step(&self, model: &Model, head: &Assistant, hidden: &Hidden, token: u32, position: usize) -> Result<(Vec<f32>, Hidden), StepError> {
        if let (Some(gpu), Some(seq)) = (&model.gpu, &self.gpu) {
            let on = head.gpu.as_ref().ok_or(StepError::NotOnGpuEngine("an assistant head loaded for another model"))?;
            let h = hidden.0.flatten_all()?.to_vec1::<f32>()?;
            let (logits, next) = gpu.assistant_step(on, seq, &h, token, position)?;
            let width = next.len();
            return Ok((logits, Hidden(Tensor::from_vec(next, (1, width), &Device::Cpu)?)));
        }
        match (&model.weights, &self.cache, &head.head) {
            (Weights::Gemma3(w), SeqCache::Gemma3(cache), AssistantOn::Gemma3(h)) => {
                let x = Tensor::new(&[[token]], &model.device)?;
                let (logits, next) = h.forward(w, cache, &hidden.0.unsqueeze(0)?, &x, position)?;
                Ok((logits.squeeze(0)?.to_vec1::<f32>()?, Hidden(next.squeeze(0)?)))
            }
            // Every step of a round at the position of the token drafted from: the sequence's end.
            (Weights::Gemma4(w), SeqCache::Gemma4(cache), AssistantOn::Gemma4(h)) => {
                let (logits, next) = h.forward(w, cache, &hidden.0.to_device(&model.device)?, token, cache.len())?;
                Ok((logits.squeeze(0)?.to_vec1::<f32>()?, Hidden(next)))
            }
            _ => Err(StepError::NotForArchitecture("an assistant head")),
        }
    }
}

/// A NextN head's per-sequence state: its KV cache and the tokens it was computed against.
///
/// Entry `j` reads the target's hidden state at `j` and the token at `j + 1`, so it stays valid
/// as long as the target's tokens `0..=j + 1` do.
pub struct NextNState {
    cache: NextNCacheOn,
    /// `tokens[j + 1]` is the token entry `j` read (`tokens[0]` the first target token).
    tokens: Vec<u32>,
    /// Whether a candle cache lives in host memory (shared prefixes are read there).
    on_cpu: bool,
}

/// The first entries of a NextN head's state, held once for every state started on it
/// ([`NextNState::share_prefix`], [`NextNState::attach_prefix`]).
#[derive(Debug, Clone)]
pub struct NextNPrefix {
    /// The tokens its entries read: `len() + 1` of them.
    tokens: Vec<u32>,
    kv: candle_nn::attention::kv_rows::KvRows,
    copied: usize,
}

impl NextNPrefix {
    /// The tokens a sequence must start with to use it (one more than its entries).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Entries it holds.
    pub fn len(&self) -> usize {
        self.tokens.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries whose rows it holds of its own (those before were in a prefix it extends).
    pub fn copied(&self) -> usize {
        self.copied
    }
}

/// Where a NextN head keeps its KV cache: candle's head, or the GPU engine's.
enum NextNCacheOn {
    Candle(NextNCache),
    /// Qwen3.5's head (candle).
    Qwen35(qwen35::NextNCache),
    Gpu(GpuNextN),
}

impl NextNCacheOn {
    fn len(&self) -> usize {
        match self {
            NextNCacheOn::Candle(c) => c.len(),
            NextNCacheOn::Qwen35(c) => c.len(),
            NextNCacheOn::Gpu(g) => g.len(),
        }
    }

    fn truncate(&mut self, len: usize) -> Result<(), StepError> {
        match self {
            NextNCacheOn::Candle(c) => c.truncate(len)?,
            NextNCacheOn::Qwen35(c) => c.truncate(len)?,
            NextNCacheOn::Gpu(g) => g.truncate(len),
        }
        Ok(())
    }

    fn reset(&mut self) {
        match self {
            NextNCacheOn::Candle(c) => c.reset(),
            // Truncating a head's K/V to nothing cannot fail.
            NextNCacheOn::Qwen35(c) => c.truncate(0).expect("an empty head cache"),
            NextNCacheOn::Gpu(g) => g.truncate(0),
        }
    }
}

impl NextNState {
    /// Entries held.
    pub fn len(&self) -> usize {
        self.cache.len()
    }
    pub fn is_empty(&self) -> bool {
        self.cache.len() == 0
    }

    /// Whether the head runs on the GPU engine.
    pub fn on_gpu_engine(&self) -> bool {
        matches!(self.cache, NextNCacheOn::Gpu(_))
    }

    /// Entries still valid for a sequence starting with `tokens`.
    pub fn reusable(&self, tokens: &[u32]) -> usize {
        let common = self.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        common.saturating_sub(1).min(self.len())
    }

    /// Keeps the first `len` entries (O(1)).
    pub fn truncate(&mut self, len: usize) -> Result<(), StepError> {
        let len = len.min(self.len());
        self.cache.truncate(len)?;
        self.tokens.truncate(len + 1);
        Ok(())
    }

    /// Whether this state's entries can be shared with other sequences' (a Gemma 3 head on the
    /// CPU; [`NextNState::share_prefix`]).
    pub fn can_share(&self) -> bool {
        matches!(&self.cache, NextNCacheOn::Candle(_)) && self.on_cpu
    }

    /// The first `len` entries as a [`NextNPrefix`] another sequence's state can start on; this
    /// state reads them from there too, so they exist once. Entry `j` read the token at `j + 1`,
    /// so the prefix is valid for sequences whose first `len + 1` tokens are this one's.
    pub fn share_prefix(&mut self, len: usize) -> Result<NextNPrefix, StepError> {
        if len > self.len() || self.tokens.len() < len + 1 {
            return Err(StepError::RollbackPastEnd { to: len, len: self.len() });
        }
        let NextNCacheOn::Candle(cache) = &mut self.cache else {
            return Err(StepError::NotForArchitecture("a NextN prefix shared between sequences"));
        };
        if !self.on_cpu {
            return Err(StepError::NotForArchitecture("a NextN prefix shared between sequences off the CPU"));
        }
        let before = cache.shared_len().min(len);
        let kv = cache.share_prefix(len)?;
        Ok(NextNPrefix { tokens: self.tokens[..len + 1].to_vec(), kv, copied: len - before })
    }

    /// Empties the state and starts it on `prefix` (from a state of the same head and cache
    /// types). On error the state is left empty.
    pub fn attach_prefix(&mut self, prefix: &NextNPrefix) -> Result<(), StepError> {
        let NextNCacheOn::Candle(cache) = &mut self.cache else {
            return Err(StepError::NotForArchitecture("a NextN prefix shared between sequences"));
        };
        self.tokens.clear();
        if let Err(e) = cache.attach_prefix(&prefix.kv) {
            cache.reset();
            return Err(e.into());
        }
        self.tokens = prefix.tokens.clone();
        Ok(())
    }

    /// Entries this state reads from a prefix shared with other sequences' states.
    pub fn shared_len(&self) -> usize {
        match &self.cache {
            NextNCacheOn::Candle(c) => c.shared_len().min(self.len()),
            _ => 0,
        }
    }

    /// Appends entries for positions `len()..`: `hidden` row `i` and the token after it,
    /// `next_tokens[i]`; `first_token` is the sequence's token 0 when the state is empty.
    /// Returns the last entry's logits (over [`Model::nextn_draft_vocab`] when the head has a
    /// reduced vocabulary) and every entry's output hidden state.
    pub fn forward(&mut self, model: &Model, first_token: u32, hidden: &Hidden, next_tokens: &[u32]) -> Result<(Vec<f32>, Hidden), StepError> {
        if next_tokens.is_empty() || hidden.positions() != next_tokens.len() {
            return Err(StepError::Empty);
        }
        let (len, n_tokens) = (self.cache.len(), self.tokens.len());
        let out = match &mut self.cache {
            NextNCacheOn::Candle(cache) => (|| {
                let Weights::Gemma3(w) = &model.weights else { unreachable!("a gemma3 head state from a gemma3 model") };
                let x = Tensor::new(next_tokens, &model.device)?.unsqueeze(0)?;
                let h = hidden.0.to_device(&model.device)?.unsqueeze(0)?;
                let out = w.nextn_forward(&h, &x, cache)?;
                Ok::<_, StepError>((out.logits.squeeze(0)?.to_vec1::<f32>()?, Hidden(out.hidden.squeeze(0)?)))
            })(),
            NextNCacheOn::Qwen35(cache) => (|| {
                let Weights::Qwen35(w) = &model.weights else { unreachable!("a qwen35 head state from a qwen35 model") };
                let x = Tensor::new(next_tokens, &model.device)?;
                let (logits, out) = w.nextn_forward(&hidden.0.to_device(&model.device)?, &x, cache)?;
                let t = logits.dim(0)?;
                Ok::<_, StepError>((logits.get(t - 1)?.to_vec1::<f32>()?, Hidden(out)))
            })(),
            NextNCacheOn::Gpu(state) => (|| {
                let gpu = model.gpu.as_ref().expect("a NextN state on the engine has a model on it");
                let h = hidden.0.flatten_all()?.to_vec1::<f32>()?;
                let (logits, out) = gpu.nextn_forward(state, &h, next_tokens)?;
                Ok((logits, Hidden(Tensor::from_vec(out, (next_tokens.len(), model.info.embedding_length), &Device::Cpu)?)))
            })(),
        };
        match out {
            Ok(out) => {
                if self.tokens.is_empty() {
                    self.tokens.push(first_token);
                }
                self.tokens.truncate(len + 1);
                self.tokens.extend_from_slice(next_tokens);
                Ok(out)
            }
            Err(e) => {
                // Atomic like the target's steps: the state is as before.
                self.tokens.truncate(n_tokens);
                if self.cache.truncate(len).is_err() {
                    self.cache.reset();
                    self.tokens.clear();
                }
                Err(e)
            }
        }
    }
}

/// An external assistant head (`--spec-type draft-assistant --mtp-head FILE`), checked against
/// the target it was loaded for.
pub struct Assistant {
    head: AssistantOn,
    /// The head on the GPU engine, when the target runs there.
    gpu: Option<GpuAssistant>,
    pub path: PathBuf,
}

/// An assistant by the target it drafts for.
enum AssistantOn {
    /// Tine's head for Gemma 3 targets (steps at rising positions).
    Gemma3(Box<AssistantHead>),
    /// Gemma 4's published assistant (every step of a round at the position of the token being
    /// drafted from, as llama.cpp runs it).
    Gemma4(Box<gemma4::assistant::Assistant>),
}

impl Assistant {
    /// Chained draft steps one round can take. Gemma 3's head: a step at `n + j` reads target
    /// keys up to `n - 1`, which a local block with window `w` sees only while `j <= w - 2`.
    /// Gemma 4's: every step sits at `n`, so any number.
    pub fn max_draft_steps(&self, target: &Model) -> usize {
        match (&self.head, &target.weights) {
            (AssistantOn::Gemma3(h), Weights::Gemma3(w)) => h.max_draft_steps(w),
            (AssistantOn::Gemma4(_), Weights::Gemma4(_)) => usize::MAX,
            _ => 0,
        }
    }

    /// The token of each logit row, when the head scores a subset of the vocabulary.
    pub fn draft_vocab(&self) -> Option<&[u32]> {
        match &self.head {
            AssistantOn::Gemma3(h) => h.draft_vocab(),
            AssistantOn::Gemma4(_) => None,
        }
    }

    /// Whether drafts score only the tokens of the top centroid clusters (a Gemma 4 E-series
    /// assistant with ordered embeddings, on candle's path: the GPU engine's head scores every
    /// token).
    pub fn ordered_embeddings(&self) -> bool {
        self.gpu.is_none() && matches!(&self.head, AssistantOn::Gemma4(h) if h.has_ordered_embeddings())
    }

    /// Turns a Gemma 4 assistant's ordered embeddings off (every token scored) or back on;
    /// returns whether they are in use.
    pub fn set_ordered_embeddings(&mut self, on: bool) -> bool {
        match &mut self.head {
            AssistantOn::Gemma4(h) => h.set_ordered_embeddings(on) && self.gpu.is_none(),
            AssistantOn::Gemma3(_) => false,
        }
    }

    pub fn load(path: &Path, target: &Model) -> Result<Assistant, LoadError> {
        let p = || path.to_owned();
        let file = File::open(path).map_err(|source| LoadError::Open { path: p(), source })?;
        let mut reader = BufReader::new(file);
        let ct = gguf_file::Content::read(&mut reader).map_err(|source| LoadError::Gguf { path: p(), source })?;
        let head = match &target.weights {
            Weights::Gemma3(weights) => AssistantOn::Gemma3(Box::new(AssistantHead::from_gguf(&ct, &mut reader, &target.device, weights).map_err(|source| LoadError::Weights { path: p(), source })?)),
            Weights::Gemma4(weights) => {
                AssistantOn::Gemma4(Box::new(gemma4::assistant::Assistant::from_gguf(&ct, &mut reader, &target.device, weights).map_err(|source| LoadError::Weights { path: p(), source })?))
            }
            Weights::Qwen35(_) => return Err(LoadError::AssistantTarget { path: p(), target: target.info.architecture.clone() }),
        };
        target.device.synchronize().map_err(|source| LoadError::Weights { path: p(), source })?;
        let gpu = match &target.gpu {
            Some(trunk) => Some(trunk.load_assistant(path).map_err(|e| LoadError::GpuHead { path: p(), source: Box::new(e) })?),
            None => None,
        };
        Ok(Assistant { head, gpu, path: p() })
    }
}
