//! Gemma 4's assistant (`gemma4-assistant` GGUFs, as llama.cpp's converter writes the published
//! `*-assistant` checkpoints) on the engine, drafting for a [`Gemma4Gpu`] by reading the target's
//! K/V instead of keeping its own (candle's `quantized_gemma4::assistant` on the CPU path).
//!
//! A draft step at `pos0` (the target's cache holds exactly `0..pos0`; every step of a round
//! sits at `pos0`, as llama.cpp runs it) reads `h`, the target's hidden state after its output
//! norm at `pos0 - 1` (or the previous step's `h'`), and the token, as one captured graph per
//! target cache:
//!
//! 1. `norm_quant` twice into the halves of one row: the target's embedding of the token times
//!    `sqrt(H_t)`, and `h`; `pre_projection` into the head's residual stream
//! 2. per block: `attn_norm`, the queries alone (`attn_q`, `qk_norm_rope_kv` with no KV heads:
//!    q norm, RoPE at `pos0` with the block kind's dims, base and (global) `rope_freqs`, scale 1),
//!    the decode attention over the source layer's K/V with `kv_end = pos0` (a sliding block's
//!    window counted from `pos0`), `attn_output`, `post_attention_norm` + residual with
//!    `ffn_norm`, the GELU GLU, `down`; the next `norm_quant` adds `post_ffw_norm(down)` and
//!    scales by `layer_output_scale`
//! 3. `output_norm` as Q8, then from the same activations the head (`token_embd`, the whole
//!    vocabulary) and `post_projection` (the next step's `h'`)
//!
//! A sliding block reads the target's layer `L - 2`, a global one layer `L - 1`, through the
//! target's KV sharing (llama.cpp's rule). The E-series' ordered embeddings (centroids that
//! pick the vocabulary slice a draft scores) are not used on the engine: its head scores every
//! token, which changes which tokens are drafted, never what the target accepts.

use std::path::Path;

use super::*;

struct Block {
    attn_norm: CudaSlice<f32>,
    q: W,
    q_norm: CudaSlice<f32>,
    o: W,
    post_attn_norm: CudaSlice<f32>,
    ffn_norm: CudaSlice<f32>,
    gate: W,
    up: W,
    down: W,
    post_ffw_norm: CudaSlice<f32>,
    scale: f32,
    sliding: bool,
    n_head: usize,
    head_dim: usize,
    ff: usize,
    /// The target layer whose K/V the block reads (a layer that owns K/V).
    source: usize,
}

/// A Gemma 4 assistant loaded for one [`Gemma4Gpu`] ([`Gemma4Gpu::load_assistant`]).
pub struct Gemma4AssistantGpu {
    pre_projection: W,
    post_projection: W,
    output_norm: CudaSlice<f32>,
    head: Matrix,
    vocab: usize,
    blocks: Vec<Block>,
    n_embd: usize,
    window: usize,
    rope_dim: usize,
    rope_dim_swa: usize,
    inv_swa: CudaSlice<f32>,
    inv_global: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    /// The draft step's graph per target cache it was captured over, keyed by what it captured
    /// of the cache (the source layers' K/V addresses and the cache's length), the newest last.
    graphs: std::sync::Mutex<Vec<(Vec<u64>, Graph)>>,
}

/// The most graphs an assistant keeps (one per sequence cache it drafted over).
const MAX_GRAPHS: usize = 64;

const ARCHITECTURES: [&str; 2] = ["gemma4-assistant", "gemma4_assistant"];

impl Gemma4AssistantGpu {
    /// Launches (graph nodes) of one draft step.
    pub fn launches(&self) -> usize {
        3 + 9 * self.blocks.len() + 3
    }
}

impl Gemma4Gpu {
    /// Loads a `gemma4-assistant` GGUF for this target and checks it fits (candle's rules: the
    /// target's hidden width and vocabulary, each block's head size and kind against the target
    /// layer it reads), and that one row of its widths fits the engine's buffers.
    pub fn load_assistant(&self, path: &Path) -> Result<Gemma4AssistantGpu> {
        let shown = path.display().to_string();
        let model_err = |what: String| Error::Model { path: shown.clone(), what };
        let mut file = File::open(path).map_err(|e| Error::Read { path: shown.clone(), source: candle_core::Error::from(e) })?;
        let content = gguf_file::Content::read(&mut file).map_err(|source| Error::Read { path: shown.clone(), source })?;
        let arch = content.metadata.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
        if !ARCHITECTURES.contains(&arch.as_str()) {
            return Err(model_err(format!("architecture `{arch}` is not a Gemma 4 assistant (expected one of {ARCHITECTURES:?})")));
        }
        let md = |k: &str| content.metadata.get(&format!("{arch}.{k}"));
        let num = |k: &str| -> Result<usize> { md(k).and_then(|v| v.to_u32().ok()).map(|v| v as usize).ok_or_else(|| model_err(format!("missing or non-integer metadata {arch}.{k}"))) };
        let per_block = |k: &str, n: usize| -> Result<Vec<usize>> {
            match md(k) {
                Some(gguf_file::Value::Array(a)) if a.len() == n => a.iter().map(|x| x.to_u32().map(|x| x as usize).map_err(|e| model_err(format!("{arch}.{k}: {e}")))).collect(),
                Some(gguf_file::Value::Array(a)) => Err(model_err(format!("{arch}.{k} has {} values for {n} blocks", a.len()))),
                Some(v) => Ok(vec![v.to_u32().map_err(|e| model_err(format!("{arch}.{k}: {e}")))? as usize; n]),
                None => Err(model_err(format!("missing metadata {arch}.{k}"))),
            }
        };
        let c = &self.cfg;
        let n_embd = num("embedding_length")?;
        if num("embedding_length_out")? != c.hidden {
            return Err(model_err(format!("the assistant reads a target hidden width of {}, the target has {}", num("embedding_length_out")?, c.hidden)));
        }
        let n_block = num("block_count")?;
        let pattern: Vec<bool> = match md("attention.sliding_window_pattern") {
            Some(gguf_file::Value::Array(a)) if a.len() == n_block => {
                a.iter().map(|v| v.to_bool()).collect::<std::result::Result<_, _>>().map_err(|e| model_err(format!("{arch}.attention.sliding_window_pattern: {e}")))?
            }
            _ => return Err(model_err(format!("{arch}.attention.sliding_window_pattern is not a bool per block"))),
        };
        let (n_head, n_ff) = (per_block("attention.head_count", n_block)?, per_block("feed_forward_length", n_block)?);
        let (hd, hd_swa) = (num("attention.key_length")?, num("attention.key_length_swa")?);
        if let Some(eps) = md("attention.layer_norm_rms_epsilon").and_then(|v| v.to_f32().ok()) {
            if eps != c.eps {
                return Err(model_err(format!("the assistant's norms use eps {eps}, the target's {}; the engine's norms take the target's", c.eps)));
            }
        }
        let f = |k: &str| md(k).and_then(|v| v.to_f32().ok());
        let u_or = |k: &str, d: usize| md(k).and_then(|v| v.to_u32().ok()).map_or(d, |v| v as usize);
        let (rope_base, rope_base_swa) = (f("rope.freq_base").unwrap_or(c.rope_base), f("rope.freq_base_swa").unwrap_or(c.rope_base_swa));
        // As the file states them (rope_freqs holds rope_dim / 2 factors); a head turns at most its dims.
        let (rope_dim, rope_dim_swa) = (u_or("rope.dimension_count", hd), u_or("rope.dimension_count_swa", hd_swa));
        let window = u_or("attention.sliding_window", c.window);
        if rope_dim % 2 == 1 || rope_dim_swa % 2 == 1 || rope_dim == 0 || rope_dim_swa == 0 || unfit_width(n_embd).is_some() {
            return Err(model_err(format!("rotated dims {rope_dim}/{rope_dim_swa} or a width of {n_embd} the kernels do not take")));
        }
        let n_layer = c.layers.len();
        let m = self.prompt_rows;
        let mut r = Reader { content: &content, file: &mut file, path: &shown, stream: &self.stream, wide: self.wide };
        let head = r.matrix("token_embd.weight", c.vocab, n_embd)?;
        let pre_projection = r.weight("nextn.pre_projection.weight", n_embd, 2 * c.hidden)?;
        let post_projection = r.weight("nextn.post_projection.weight", c.hidden, n_embd)?;
        let output_norm = r.norm("output_norm.weight", n_embd)?;
        let rope_freqs = if pattern.iter().any(|s| !s) && r.has("rope_freqs.weight") { Some(r.values("rope_freqs.weight", rope_dim / 2)?) } else { None };
        let heads_max = c.layers.iter().map(|l| l.n_head).max().unwrap_or(0);
        let mut blocks = Vec::with_capacity(n_block);
        for (i, &sliding) in pattern.iter().enumerate() {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let head_dim = if sliding { hd_swa } else { hd };
            let want = n_layer.checked_sub(if sliding { 2 } else { 1 }).ok_or_else(|| model_err("the target has too few layers".into()))?;
            let source = c.kv_source(want);
            let src = &c.layers[source];
            if src.sliding != sliding || src.head_dim != head_dim || n_head[i] == 0 || !n_head[i].is_multiple_of(src.n_kv) || n_head[i] / src.n_kv > 8 {
                return Err(model_err(format!("block {i} ({} heads of {head_dim}) does not fit target layer {source} ({} KV heads of {})", n_head[i], src.n_kv, src.head_dim)));
            }
            // One row of the block's widths in the engine's buffers (sized for prompt_rows rows
            // of the target's), its heads in the attention's partials.
            let partials = n_head[i] * Kernels::attn_chunks_max(self.max_ctx, if sliding { window } else { 0 }) * (head_dim + 2);
            if n_head[i] * head_dim > m * c.layers.iter().map(|l| l.n_head * l.head_dim).max().unwrap_or(0)
                || n_ff[i] > m * c.layers.iter().map(|l| l.ff).max().unwrap_or(0)
                || n_head[i] > MAX_ROWS * heads_max
                || partials > MAX_ROWS * self.partials_row
                || !n_ff[i].is_multiple_of(32)
            {
                return Err(model_err(format!("block {i}'s widths ({} query values, {} feed-forward) are past the engine's buffers", n_head[i] * head_dim, n_ff[i])));
            }
            let scale = r.values(&p("layer_output_scale"), 1)?[0];
            if !scale.is_finite() || scale == 0.0 {
                return Err(model_err(format!("{} must hold one finite non-zero value, it holds {scale}", p("layer_output_scale"))));
            }
            let qd = n_head[i] * head_dim;
            let block = Block {
                attn_norm: r.norm(&p("attn_norm"), n_embd)?,
                q: r.weight(&p("attn_q"), qd, n_embd)?,
                q_norm: r.norm(&p("attn_q_norm"), head_dim)?,
                o: r.weight(&p("attn_output"), n_embd, qd)?,
                post_attn_norm: r.norm(&p("post_attention_norm"), n_embd)?,
                ffn_norm: r.norm(&p("ffn_norm"), n_embd)?,
                gate: r.weight(&p("ffn_gate"), n_ff[i], n_embd)?,
                up: r.weight(&p("ffn_up"), n_ff[i], n_embd)?,
                down: r.weight(&p("ffn_down"), n_embd, n_ff[i])?,
                post_ffw_norm: r.norm(&p("post_ffw_norm"), n_embd)?,
                scale,
                sliding,
                n_head: n_head[i],
                head_dim,
                ff: n_ff[i],
                source,
            };
            if block.gate.1 != block.up.1 {
                return Err(model_err(format!("blk.{i}: ffn_gate and ffn_up differ in type; the fused GLU reads one")));
            }
            blocks.push(block);
        }
        if blocks.is_empty() {
            return Err(model_err("an assistant of no blocks".into()));
        }
        let inv_swa = self.stream.clone_htod(&inv_freq(rope_dim_swa.min(hd_swa), rope_base_swa, None))?;
        let inv_global = self.stream.clone_htod(&inv_freq(rope_dim.min(hd), rope_base, rope_freqs.as_deref()))?;
        let logits = alloc(&self.stream, c.vocab)?;
        self.stream.synchronize()?;
        Ok(Gemma4AssistantGpu {
            pre_projection,
            post_projection,
            output_norm,
            head,
            vocab: c.vocab,
            blocks,
            n_embd,
            window,
            rope_dim,
            rope_dim_swa,
            inv_swa,
            inv_global,
            logits,
            graphs: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// The launches of one draft step over `cache` (what its graph captures): the input hidden
    /// state at `hin`, the token, position and `kv_end` in the step block.
    fn launch_assistant(&self, head: &Gemma4AssistantGpu, cache: &Gemma4Cache, step: DevPtr, hin: DevPtr) -> std::result::Result<(), GpuError> {
        let c = &self.cfg;
        let b = &self.b;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let (s, k) = (&self.stream, &self.kernels);
        let (h, n) = (c.hidden, head.n_embd);
        let act = self.act(0, 0);
        // SAFETY: one row; every buffer holds prompt_rows rows of the target's widths, more than
        // one row of the assistant's (checked at load); the source layers' caches hold ctx_len
        // positions and assistant_step keeps the keys read below the cache's length.
        unsafe {
            let e = NormQuantArgs { res_out: 0, q_stride: (2 * h) as i32, q_off: 0, ..self.nq(step, None, 0, 0, 2, h, 0, 0.0) };
            k.norm_quant(s, 1, &e)?;
            let hh = NormQuantArgs { q_stride: (2 * h) as i32, q_off: h as i32, ..self.nq(step, None, hin, 0, 0, h, 0, 0.0) };
            k.norm_quant(s, 1, &hh)?;
            k.gemv(s, 1, 2 * h, &[self.seg(&head.pre_projection, &b.o, n)], act)?;
            for (i, bl) in head.blocks.iter().enumerate() {
                let first = match i {
                    0 => NormQuantArgs { res_out: p(&b.h), ..self.nq(step, None, p(&b.o), 0, 0, n, p(&bl.attn_norm), 0.0) },
                    _ => {
                        let prev = &head.blocks[i - 1];
                        self.nq(step, None, p(&b.down), p(&prev.post_ffw_norm), 1, n, p(&bl.attn_norm), prev.scale)
                    }
                };
                k.norm_quant(s, 1, &first)?;
                let qd = bl.n_head * bl.head_dim;
                k.gemv(s, 1, n, &[self.seg(&bl.q, &b.q, qd)], act)?;
                let rope = RopeArgs {
                    q: p(&b.q),
                    q_norm: p(&bl.q_norm),
                    eps: c.eps,
                    inv_freq: if bl.sliding { p(&head.inv_swa) } else { p(&head.inv_global) },
                    q_scale: 1.0,
                    step,
                    n_head: bl.n_head as i32,
                    n_kv: 0,
                    hd: bl.head_dim as i32,
                    n_rot: if bl.sliding { head.rope_dim_swa } else { head.rope_dim }.min(bl.head_dim) as i32,
                    ..Default::default()
                };
                k.qk_norm_rope_kv(s, 1, &rope)?;
                let si = self.slot[bl.source].expect("a source layer owns K/V (checked at load)");
                let window = if bl.sliding { head.window } else { 0 };
                let at = self.attn_args(cache.ctx_len, cache.kv[si].ptrs(s), window, bl.n_head, c.layers[bl.source].n_kv, step);
                k.attention(s, 1, bl.head_dim, &at)?;
                k.gemv(s, 1, qd, &[self.seg(&bl.o, &b.o, n)], act)?;
                k.norm_quant(s, 1, &self.nq(step, None, p(&b.o), p(&bl.post_attn_norm), 1, n, p(&bl.ffn_norm), 0.0))?;
                let glu = GemvSeg {
                    w: self.ptr(&bl.gate.0),
                    w2: self.ptr(&bl.up.0),
                    out: p(&b.ff),
                    n: bl.ff as i32,
                    wtype: bl.gate.1.ggml_id(),
                    out_stride: bl.ff as i32,
                    glu: 1,
                    block_start: 0,
                    wide: self.wide as i32,
                };
                k.gemv(s, 1, n, &[glu], act)?;
                k.norm_quant(s, 1, &self.nq(step, None, p(&b.ff), 0, 0, bl.ff, 0, 0.0))?;
                k.gemv(s, 1, bl.ff, &[self.seg(&bl.down, &b.down, n)], act)?;
            }
            let last = head.blocks.last().expect("an assistant has blocks (checked at load)");
            k.norm_quant(s, 1, &self.nq(step, None, p(&b.down), p(&last.post_ffw_norm), 1, n, p(&head.output_norm), last.scale))?;
            let out = &head.head;
            let seg = GemvSeg {
                w: self.ptr(&out.buf),
                out: self.ptr(&head.logits),
                n: head.vocab as i32,
                wtype: out.wt.ggml_id(),
                out_stride: head.vocab as i32,
                wide: out.wide as i32,
                ..Default::default()
            };
            k.gemv(s, 1, n, &[seg], act)?;
            // The normed row is still the activations' Q8 row: the next step's h' from it.
            k.gemv(s, 1, n, &[self.seg(&head.post_projection, &b.o, h)], act)?;
        }
        Ok(())
    }

    /// One draft step of `head` for `token`, the round's draft number `position - cache.pos`
    /// (`position` at least the number of positions `cache` holds), reading `hidden` (the target's
    /// hidden state after its output norm at the cache's last position, or the previous step's
    /// output). Every step of a round sits at the cache's end, as on the CPU (candle's
    /// `quantized_gemma4` assistant). Returns the logits over the vocabulary and the next step's
    /// hidden state. The cache is not changed; the activation buffers all sequences share are
    /// (as by any step).
    pub fn assistant_step(&self, head: &Gemma4AssistantGpu, cache: &Gemma4Cache, hidden: &[f32], token: u32, position: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = &self.cfg;
        let fail = |what: String| Error::Step { rows: 1, pos: position, what };
        if cache.pos == 0 || position < cache.pos {
            return Err(fail(format!("a draft at position {position} reads a cache below it (it holds {} positions)", cache.pos)));
        }
        let position = cache.pos;
        if hidden.len() != c.hidden {
            return Err(fail(format!("{} hidden values, expected {}", hidden.len(), c.hidden)));
        }
        if token as usize >= c.vocab {
            return Err(fail(format!("token {token} is outside the vocabulary of {}", c.vocab)));
        }
        let mut params = StepParams { pos: position as i32, rows: 1, kv_end: cache.pos as i32, ..Default::default() };
        params.tokens[0] = token as i32;
        let mut block = self.step.lock().expect("a step panicked holding the step block");
        // Ordered on the stream after the previous step, which may still read the block and hin.
        self.stream.memcpy_htod(&[params][..], &mut block.params)?;
        self.stream.memcpy_htod(hidden, &mut block.hin)?;
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
        let mut logits = vec![0f32; head.vocab];
        self.stream.memcpy_dtoh(&head.logits, &mut logits[..])?;
        let mut out = vec![0f32; c.hidden];
        self.stream.memcpy_dtoh(&self.b.o.slice(..c.hidden), &mut out[..])?;
        self.stream.synchronize()?;
        Ok((logits, out))
    }

    /// What a draft step's graph captures of `cache`: the source layers' K/V addresses, the
    /// cache's length and its stored types.
    fn assistant_key(&self, head: &Gemma4AssistantGpu, cache: &Gemma4Cache) -> Vec<u64> {
        let t = cache.types();
        head.blocks
            .iter()
            .flat_map(|b| {
                let si = self.slot[b.source].expect("a source layer owns K/V");
                [self.ptr(&cache.kv[si].k), self.ptr(&cache.kv[si].v)]
            })
            .chain([cache.ctx_len as u64, t.k.kernel_id() as u64, t.v.kernel_id() as u64])
            .collect()
    }

    /// Kernel launches (graph nodes) of `head`'s draft step over `cache` (which must hold a
    /// position).
    pub fn assistant_graph_nodes(&self, head: &Gemma4AssistantGpu, cache: &Gemma4Cache) -> Result<usize> {
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

/// Why the engine's norms cannot take rows of `n` values, if they cannot.
fn unfit_width(n: usize) -> Option<String> {
    (n == 0 || !n.is_multiple_of(32) || n > crate::cuda::NQ_MAX_K).then(|| format!("a width of {n} (a multiple of 32 up to {})", crate::cuda::NQ_MAX_K))
}
