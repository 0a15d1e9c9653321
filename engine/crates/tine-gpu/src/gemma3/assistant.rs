//! An assistant head on the engine: a `gemma4-assistant` GGUF (candle's
//! `quantized_gemma3_assistant` reads the same layout) drafting for a Gemma 3 trunk by reading
//! the trunk's KV cache instead of keeping its own.
//!
//! A draft step at position `p` (the target cache holds positions `0..n`, `p >= n`) reads a hidden
//! state `h` (the trunk's before its output norm, or the previous step's output) and the token
//! at `p`, as 16 launches for a one-block head, captured once per sequence cache as a graph
//! (the head keeps them):
//!
//! 1. `norm_quant` twice into the halves of one row of activations: the token's embedding
//!    (the trunk's Q8_0 table, times √n_embd_out) and `h`, both as they are (no norm)
//! 2. `gemv`: `pre_projection` into the head's residual stream
//! 3. per block: `attn_norm`, the queries alone (`gemv`, then `qk_norm_rope_kv` with no KV heads:
//!    q norm, RoPE at `p` with the source layer's base, the query scale), the decode attention
//!    over the source layer's cache with the step's `kv_end = n` (the window counted from `p`),
//!    the output projection, `post_attention_norm` + residual with `ffn_norm`, the GLU, `down`;
//!    the next `norm_quant` adds `post_ffw_norm(down)` and scales by `layer_output_scale`
//! 4. `output_norm` and the head (`token_embd`, over the draft vocabulary when it has one)
//! 5. the residual stream quantized as it is, and `post_projection`: the next step's `h`
//!
//! A local block reads the trunk's last local layer, a global block its last global layer.

use std::path::Path;

use super::*;

/// One block of an assistant head: a Gemma 3 block without K/V projections.
struct Block {
    attn_norm: CudaSlice<f32>,
    q: (CudaSlice<u8>, WeightType),
    q_norm: CudaSlice<f32>,
    o: (CudaSlice<u8>, WeightType),
    post_attn_norm: CudaSlice<f32>,
    ffn_norm: CudaSlice<f32>,
    gate: (CudaSlice<u8>, WeightType),
    up: (CudaSlice<u8>, WeightType),
    down: (CudaSlice<u8>, WeightType),
    post_ffn_norm: CudaSlice<f32>,
    /// `layer_output_scale` (1 without the tensor).
    scale: f32,
    /// The trunk layer whose cache the block reads.
    source: usize,
}

/// An assistant head loaded for one [`Gemma3Gpu`] ([`Gemma3Gpu::load_assistant`]).
pub struct AssistantGpu {
    pre_projection: (CudaSlice<u8>, WeightType),
    post_projection: (CudaSlice<u8>, WeightType),
    output_norm: CudaSlice<f32>,
    head: Matrix,
    /// Rows of the head: the draft vocabulary's size, else the vocabulary's.
    rows: usize,
    draft_vocab: Option<Vec<u32>>,
    blocks: Vec<Block>,
    n_embd: usize,
    n_head: usize,
    ff: usize,
    logits: CudaSlice<f32>,
    /// The draft step's graph per cache it was captured over, keyed by what it captured of the
    /// cache (the source layers' K/V addresses and the cache's length), the newest last.
    graphs: std::sync::Mutex<Vec<(Vec<u64>, Graph)>>,
}

/// The most graphs an assistant head keeps (one per sequence cache it drafted over; the oldest
/// is dropped, and captured again if its cache comes back).
const MAX_GRAPHS: usize = 64;

impl AssistantGpu {
    /// The token of each logit, when the head scores a subset of the vocabulary.
    pub fn draft_vocab(&self) -> Option<&[u32]> {
        self.draft_vocab.as_deref()
    }

    /// Launches (graph nodes) of one draft step.
    pub fn launches(&self) -> usize {
        3 + 9 * self.blocks.len() + 4
    }
}

const ARCHITECTURES: [&str; 3] = ["gemma4-assistant", "gemma4_assistant", "gemma4_mtp"];

impl Gemma3Gpu {
    /// Loads an assistant head for this trunk and checks it fits: the trunk's hidden width and
    /// head size, query heads a multiple of its KV heads, the vocabulary (or a draft vocabulary
    /// inside it).
    pub fn load_assistant(&self, path: &Path) -> Result<AssistantGpu> {
        let shown = path.display().to_string();
        let model_err = |what: String| Gemma3GpuError::Model { path: shown.clone(), what };
        let mut file = File::open(path).map_err(|e| Gemma3GpuError::Read { path: shown.clone(), source: candle_core::Error::from(e) })?;
        let content = gguf_file::Content::read(&mut file).map_err(|source| Gemma3GpuError::Read { path: shown.clone(), source })?;
        let arch = content.metadata.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
        if !ARCHITECTURES.contains(&arch.as_str()) {
            return Err(model_err(format!("architecture `{arch}` is not an assistant head (expected one of {ARCHITECTURES:?})")));
        }
        let md = |k: &str| content.metadata.get(&format!("{arch}.{k}"));
        let num = |k: &str| -> Result<usize> { md(k).and_then(|v| v.to_u32().ok()).map(|v| v as usize).ok_or_else(|| model_err(format!("missing or non-integer metadata {arch}.{k}"))) };
        let c = &self.cfg;
        let n_embd = num("embedding_length")?;
        let n_out = num("embedding_length_out").or_else(|_| num("n_embd_backbone"))?;
        let (block_count, n_head, head_dim, ff) = (num("block_count")?, num("attention.head_count")?, num("attention.key_length")?, num("feed_forward_length")?);
        if let Some(eps) = md("attention.layer_norm_rms_epsilon").and_then(|v| v.to_f32().ok()) {
            if eps != c.eps {
                return Err(model_err(format!("the head's norms use eps {eps}, the trunk's {}; the engine's norms take the trunk's", c.eps)));
            }
        }
        if n_out != c.hidden {
            return Err(model_err(format!("the head expects a target hidden width of {n_out}, the target has {}", c.hidden)));
        }
        if head_dim != c.head_dim {
            return Err(model_err(format!("the head's queries have {head_dim} dims per head, the target's keys {}", c.head_dim)));
        }
        if n_head == 0 || !n_head.is_multiple_of(c.n_kv) || n_head / c.n_kv > 8 || n_head > MAX_ROWS * c.n_head {
            return Err(model_err(format!("{n_head} query heads over the target's {} KV heads is not a layout the kernels take", c.n_kv)));
        }
        if block_count == 0 || !n_embd.is_multiple_of(32) || !ff.is_multiple_of(32) || n_embd > crate::cuda::NQ_MAX_K {
            return Err(model_err(format!("{block_count} blocks of width {n_embd} and {ff}: widths must be multiples of 32 up to {}", crate::cuda::NQ_MAX_K)));
        }
        // One row of the head's widths must fit the step's buffers (sized for prompt_rows rows
        // of the trunk's).
        let (m, qd_trunk) = (self.prompt_rows, c.n_head * c.head_dim);
        if n_embd > m * c.hidden || n_head * head_dim > m * qd_trunk || ff > m * c.ff {
            return Err(model_err(format!("widths {n_embd}, {} and {ff} are past the engine's buffers", n_head * head_dim)));
        }
        let pattern: Option<Vec<bool>> = match md("attention.sliding_window_pattern") {
            Some(gguf_file::Value::Array(vs)) => {
                Some(vs.iter().map(|v| v.to_bool()).collect::<std::result::Result<_, _>>().map_err(|e| model_err(format!("{arch}.attention.sliding_window_pattern: {e}")))?)
            }
            _ => None,
        };
        let last_local = (0..c.layers).rev().find(|&l| c.is_local(l));
        let last_global = (0..c.layers).rev().find(|&l| !c.is_local(l));
        let fallback = c.layers - 1;
        let key = format!("{arch}.draft_vocab");
        let draft_vocab = match md("draft_vocab") {
            None => None,
            Some(v) => Some(draft_ids(v, &key, c.vocab).map_err(model_err)?),
        };
        let rows = draft_vocab.as_ref().map_or(c.vocab, Vec::len);
        let mut r = Reader { content: &content, file: &mut file, path: &shown, stream: &self.stream, wide: self.wide };
        let pick = |names: &[String], rows: usize, k: usize, r: &mut Reader| -> Result<(CudaSlice<u8>, WeightType)> {
            match names.iter().find(|n| content.tensor_infos.contains_key(*n)) {
                Some(n) => r.weight(n, rows, k),
                None => Err(Gemma3GpuError::Model { path: shown.clone(), what: format!("missing tensor {}", names.join(" / ")) }),
            }
        };
        let projection = |which: &str| ["nextn", "mtp"].map(|p| format!("{p}.{which}_projection.weight")).into_iter().chain([format!("mtp_{which}_proj.weight")]).collect::<Vec<_>>();
        let pre_projection = pick(&projection("pre"), n_embd, 2 * c.hidden, &mut r)?;
        let post_projection = pick(&projection("post"), c.hidden, n_embd, &mut r)?;
        let output_norm = r.norm("output_norm.weight", n_embd)?;
        let head = r.matrix("token_embd.weight", rows, n_embd)?;
        let qd = n_head * head_dim;
        let mut blocks = Vec::with_capacity(block_count);
        for i in 0..block_count {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let local = match &pattern {
                Some(pat) => pat.get(i).copied().unwrap_or(false),
                None => (i + 1) % 6 > 0,
            };
            let scale = if content.tensor_infos.contains_key(&p("layer_output_scale")) {
                let v = r
                    .tensor(&p("layer_output_scale"))?
                    .dequantize(&candle_core::Device::Cpu)
                    .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
                    .map_err(|source| Gemma3GpuError::Read { path: shown.clone(), source })?;
                match v.as_slice() {
                    [s] if s.is_finite() && *s != 0.0 => *s,
                    _ => return Err(model_err(format!("{} must hold one finite non-zero value, it holds {v:?}", p("layer_output_scale")))),
                }
            } else {
                1.0
            };
            let block = Block {
                attn_norm: r.norm(&p("attn_norm"), n_embd)?,
                q: r.weight(&p("attn_q"), qd, n_embd)?,
                q_norm: r.norm(&p("attn_q_norm"), head_dim)?,
                o: r.weight(&p("attn_output"), n_embd, qd)?,
                post_attn_norm: r.norm(&p("post_attention_norm"), n_embd)?,
                ffn_norm: r.norm(&p("ffn_norm"), n_embd)?,
                gate: r.weight(&p("ffn_gate"), ff, n_embd)?,
                up: r.weight(&p("ffn_up"), ff, n_embd)?,
                down: r.weight(&p("ffn_down"), n_embd, ff)?,
                post_ffn_norm: r.norm(&p("post_ffw_norm"), n_embd)?,
                scale,
                source: if local { last_local } else { last_global }.unwrap_or(fallback),
            };
            if block.gate.1 != block.up.1 {
                return Err(model_err(format!("blk.{i}: ffn_gate and ffn_up differ in type; the fused GLU reads one")));
            }
            blocks.push(block);
        }
        let logits = alloc(&self.stream, rows)?;
        Ok(AssistantGpu { graphs: std::sync::Mutex::new(Vec::new()), pre_projection, post_projection, output_norm, head, rows, draft_vocab, blocks, n_embd, n_head, ff, logits })
    }

    /// Chained draft steps that still see a target key: a step `j` positions past the cache
    /// reads keys through each local source layer's window `w` only while `j <= w - 2`.
    pub fn assistant_max_steps(&self, head: &AssistantGpu) -> usize {
        head.blocks.iter().filter(|b| self.cfg.is_local(b.source)).map(|_| self.cfg.window.saturating_sub(1)).min().unwrap_or(usize::MAX)
    }

    /// The launches of one assistant draft step over `cache` (what its graph captures): the
    /// input hidden state at `hin`, the token, position and `kv_end` in the step block.
    fn launch_assistant(&self, head: &AssistantGpu, cache: &GpuCache, step: DevPtr, hin: DevPtr) -> std::result::Result<usize, GpuError> {
        let c = &self.cfg;
        let b = &self.b;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let (s, k) = (&self.stream, &self.kernels);
        let (h, n, qd) = (c.hidden, head.n_embd, head.n_head * c.head_dim);
        let act = self.act(0, 0);
        // SAFETY: one row; every buffer holds prompt_rows rows of the trunk's widths, more than
        // one row of the head's (checked at load: n_embd, 2 * hidden, ff and the query width fit
        // one row of the activation planes; n_head <= MAX_ROWS * the trunk's heads for the
        // attention's partials and counters); the source layers' caches ctx_len positions, and
        // assistant_step keeps the keys read below the cache's length.
        unsafe {
            let e = NormQuantArgs { res_out: 0, q_stride: (2 * h) as i32, q_off: 0, ..self.nq(step, None, 0, 0, 2, h, 0) };
            k.norm_quant(s, 1, &e)?;
            let hh = NormQuantArgs { q_stride: (2 * h) as i32, q_off: h as i32, ..self.nq(step, None, hin, 0, 0, h, 0) };
            k.norm_quant(s, 1, &hh)?;
            k.gemv(s, 1, 2 * h, &[self.seg(&head.pre_projection, &b.o, n)], act)?;
            for (i, bl) in head.blocks.iter().enumerate() {
                let first = match i {
                    0 => NormQuantArgs { res_out: p(&b.h), ..self.nq(step, None, p(&b.o), 0, 0, n, p(&bl.attn_norm)) },
                    _ => {
                        let prev = &head.blocks[i - 1];
                        NormQuantArgs { res_scale: prev.scale, ..self.nq(step, None, p(&b.down), p(&prev.post_ffn_norm), 1, n, p(&bl.attn_norm)) }
                    }
                };
                k.norm_quant(s, 1, &first)?;
                k.gemv(s, 1, n, &[self.seg(&bl.q, &b.q, qd)], act)?;
                let local = c.is_local(bl.source);
                let rope = RopeArgs {
                    q: p(&b.q),
                    q_norm: p(&bl.q_norm),
                    eps: c.eps,
                    inv_freq: if local { p(&self.inv_local) } else { p(&self.inv_global) },
                    q_scale: 1.0 / (c.head_dim as f32).sqrt(),
                    step,
                    n_head: head.n_head as i32,
                    n_kv: 0,
                    hd: c.head_dim as i32,
                    n_rot: 0,
                    ..Default::default()
                };
                k.qk_norm_rope_kv(s, 1, &rope)?;
                let at = self.attn_args(cache.kv[bl.source].ptrs(s), cache.ctx_len, local, head.n_head, step);
                k.attention(s, 1, c.head_dim, &at)?;
                let tail = BlockTail { o: &bl.o, post_attn_norm: &bl.post_attn_norm, ffn_norm: &bl.ffn_norm, gate: &bl.gate, up: &bl.up, down: &bl.down };
                self.launch_block_tail(&tail, n, qd, head.ff, step, 1, None, &mut |_| Ok(()))?;
            }
            let last = head.blocks.last().expect("a head has blocks (checked at load)");
            let out = NormQuantArgs { res_scale: last.scale, ..self.nq(step, None, p(&b.down), p(&last.post_ffn_norm), 1, n, p(&head.output_norm)) };
            k.norm_quant(s, 1, &out)?;
            k.gemv(s, 1, n, &[self.mseg(&head.head, &head.logits, head.rows)], act)?;
            k.norm_quant(s, 1, &self.nq(step, None, p(&b.h), 0, 0, n, 0))?;
            k.gemv(s, 1, n, &[self.seg(&head.post_projection, &b.o, h)], act)?;
        }
        Ok(head.launches())
    }

    /// One draft step of `head` at `position` for the token `token`, reading `hidden` (the
    /// trunk's hidden state before its output norm at `position - 1`, or the previous step's
    /// output) and `cache`, which must hold positions below `position` (at least one) and whose
    /// keys the step's local blocks must still see through their windows
    /// ([`Gemma3Gpu::assistant_max_steps`]). Returns the logits (over the head's draft
    /// vocabulary when it has one) and the next step's hidden state. The cache is not changed;
    /// the activation buffers all sequences share are (as by any step).
    pub fn assistant_step(&self, head: &AssistantGpu, cache: &GpuCache, hidden: &[f32], token: u32, position: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = &self.cfg;
        let fail = |what: String| Gemma3GpuError::Step { rows: 1, pos: position, what };
        let n = cache.pos;
        if n == 0 || position < n {
            return Err(fail(format!("an assistant step reads the cache below its position: the cache holds {n} positions")));
        }
        if head.blocks.iter().any(|b| c.is_local(b.source)) && position + 1 > n - 1 + c.window {
            return Err(fail(format!("position {position} is past the window of the {n} cached positions")));
        }
        if hidden.len() != c.hidden {
            return Err(fail(format!("{} hidden values, expected {}", hidden.len(), c.hidden)));
        }
        if token as usize >= c.vocab {
            return Err(fail(format!("token {token} is outside the vocabulary of {}", c.vocab)));
        }
        let mut params = StepParams { pos: position as i32, rows: 1, kv_end: n as i32, ..Default::default() };
        params.tokens[0] = token as i32;
        let mut block = self.step.lock().expect("a step panicked holding the step block");
        // Ordered on the stream after the previous step, which may still read the block and hin.
        self.stream.memcpy_htod(&[params][..], &mut block.params)?;
        self.stream.memcpy_htod(hidden, &mut block.hin.slice_mut(..hidden.len()))?;
        let (step, hin) = (self.ptr(&block.params), self.ptr(&block.hin));
        let key = self.assistant_key(head, cache);
        let mut graphs = head.graphs.lock().expect("a step panicked holding the assistant's graphs");
        let at = match graphs.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
                let launched = self.launch_assistant(head, cache, step, hin);
                let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
                launched?;
                let graph = graph?.ok_or_else(|| fail("the capture made no graph".into()))?;
                graph.upload()?;
                if graphs.len() == MAX_GRAPHS {
                    graphs.remove(0);
                }
                graphs.push((key, Graph(graph)));
                graphs.len() - 1
            }
        };
        graphs[at].1 .0.launch()?;
        drop(graphs);
        drop(block);
        let mut logits = vec![0f32; head.rows];
        self.stream.memcpy_dtoh(&head.logits, &mut logits[..])?;
        let mut out = vec![0f32; c.hidden];
        self.stream.memcpy_dtoh(&self.b.o.slice(..c.hidden), &mut out[..])?;
        self.stream.synchronize()?;
        Ok((logits, out))
    }

    /// What a draft step's graph captures of `cache`: the source layers' K/V addresses, the
    /// cache's length and its stored types.
    fn assistant_key(&self, head: &AssistantGpu, cache: &GpuCache) -> Vec<u64> {
        let t = cache.types();
        head.blocks.iter().flat_map(|b| [self.ptr(&cache.kv[b.source].k), self.ptr(&cache.kv[b.source].v)]).chain([cache.ctx_len as u64, t.k.kernel_id() as u64, t.v.kernel_id() as u64]).collect()
    }

    /// Kernel launches (graph nodes) of `head`'s draft step over `cache` (which must hold a
    /// position).
    pub fn assistant_graph_nodes(&self, head: &AssistantGpu, cache: &GpuCache) -> Result<usize> {
        self.assistant_step(head, cache, &vec![0f32; self.cfg.hidden], 0, cache.pos)?;
        let graphs = head.graphs.lock().expect("a step panicked holding the assistant's graphs");
        let key = self.assistant_key(head, cache);
        let (_, g) = graphs.iter().find(|(k, _)| *k == key).expect("captured by the step");
        let mut n = 0usize;
        // SAFETY: counting the nodes of a live graph (a null array asks for the count only).
        unsafe { sys::cuGraphGetNodes(g.0.cu_graph(), std::ptr::null_mut(), &mut n) }.result()?;
        Ok(n)
    }
}
