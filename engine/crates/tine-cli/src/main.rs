//! `tine`: a thin CLI over tine-engine (generation) and tine-server (HTTP).

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

mod perplexity;
mod spec_bench;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use tine_engine::{GenerateRequest, Generation};
use tine_runtime::Model;
use tine_sampling::SamplingParams;
use tine_spec::{DraftParams, SpecConfig, SpecFactory, SpecType};

#[derive(Parser)]
#[command(name = "tine", version, about = "Tine: GGUF inference (Gemma 3, Qwen3.5/3.6) on a patched candle")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text for one prompt; prints the text, then a timing line on stderr.
    Generate(GenerateArgs),
    /// Serve a llama-server-compatible HTTP API (/completion, /v1/completions, /v1/chat/completions, ...).
    Serve(Box<ServeArgs>),
    /// Print the token ids of a text (special tokens parsed), one JSON array. Reads only the
    /// GGUF's tokenizer (SentencePiece `llama` or byte-level BPE `gpt2` vocabularies, any
    /// architecture); --device and --ctx-size are accepted and unused.
    Tokenize(TokenizeArgs),
    /// Check that speculative decoding is lossless: greedy output identical to plain decoding,
    /// and the logit-equivalence figures (real_frac, frac_full_agree, mean_top1_mae, max |Δlogit|)
    /// over a prompt set, for every depth. Exits 1 unless every figure is exact.
    LogitEquiv(LogitEquivArgs),
    /// Benchmark decode speed with speculative decoding against plain decoding (greedy), on the
    /// seeds' 9-prompt set and copy-heavy prompts, every configuration interleaved in one run.
    SpecBench(spec_bench::SpecBenchArgs),
    /// Perplexity over a text, and the KL divergence and top-token agreement of the next-token
    /// distributions against a reference KV cache type (llama-perplexity's method: chunks of
    /// --ctx-size from an empty cache, the second half of each scored). Set the cache types
    /// under test with -ctk/-ctv, the reference's with --kl-base-cache-types.
    Perplexity(perplexity::PerplexityArgs),
    /// Graft a NextN head (a small GGUF holding only its block) into a copy of its target GGUF,
    /// for `--spec-type draft-mtp`. The output is written atomically.
    GraftNextn(GraftArgs),
}

#[derive(Args)]
struct GraftArgs {
    /// The target GGUF (default: the cached Gemma 3 270M Q4_K_M).
    #[arg(long)]
    target: Option<PathBuf>,
    /// The NextN head GGUF (for the default model: drafters/gemma3-270m-nextn.gguf).
    #[arg(long)]
    head: PathBuf,
    /// Where to write the grafted model.
    #[arg(short, long)]
    out: PathBuf,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Addresses to listen on at --port: IPv4 or IPv6 addresses or host names, comma-separated or
    /// repeated (each is served)
    #[arg(long, default_value = "127.0.0.1", value_delimiter = ',')]
    host: Vec<String>,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Slots: requests served concurrently, each with its own KV cache (and reused prompt prefix);
    /// --ctx-size is split between them, as llama-server does (also `-np`).
    #[arg(long = "parallel", alias = "np", default_value_t = 1)]
    parallel: usize,
    /// The model's id in /v1/models and in responses (default: the GGUF's file name); a
    /// comma-separated list gives several names, the id being the first in alphabetical order
    #[arg(short = 'a', long = "alias")]
    alias: Option<String>,
    /// Every chat answer carries `__verbose` (the result as /completion gives it, with the
    /// rendered prompt), as a request's `verbose` asks (llama-server's debug output)
    #[arg(long = "verbose")]
    verbose: bool,
    /// Comma-separated labels /v1/models lists for the model (llama-server's flag)
    #[arg(long = "tags", value_name = "TAGS", value_delimiter = ',')]
    tags: Vec<String>,
    /// Turn /slots off (it answers 501).
    #[arg(long = "no-slots")]
    no_slots: bool,
    /// Serve embeddings at /embedding and /v1/embeddings (the model's final hidden states after
    /// the output norm, pooled by --pooling; not on the GPU engine yet).
    #[arg(long = "embeddings", alias = "embedding")]
    embeddings: bool,
    /// Variables every chat template render gets, a JSON object (`{"enable_thinking": false}`);
    /// a request's `chat_template_kwargs` go over them.
    #[arg(long = "chat-template-kwargs", value_name = "JSON")]
    chat_template_kwargs: Option<String>,
    /// Thinking in chats: `on` or `off` set the template's `enable_thinking`; `auto` (the
    /// default) renders it true unless --chat-template-kwargs or the request says otherwise, as
    /// llama-server does.
    #[arg(long = "reasoning", alias = "rea", value_name = "on|off|auto", default_value = "auto")]
    reasoning: String,
    /// Where a reply's `<think>` text goes: `deepseek` (or `auto`, the default) returns it as
    /// `reasoning_content`, `none` leaves it in the content.
    #[arg(long = "reasoning-format", value_name = "none|deepseek|auto", default_value = "auto")]
    reasoning_format: String,
    /// How an input's rows become one embedding: none (every token's row; /embedding only),
    /// mean, cls (the first token's), last (default: the GGUF's pooling_type, else none).
    #[arg(long = "pooling", value_name = "none|mean|cls|last", requires = "embeddings")]
    pooling: Option<String>,
    /// Serve Prometheus metrics at /metrics.
    #[arg(long = "metrics")]
    metrics: bool,
    /// When a generation fills its slot's context, drop the oldest half of the tokens after
    /// --keep and continue (off: it stops there, reported `truncated`).
    #[arg(long = "context-shift", overrides_with = "no_context_shift")]
    context_shift: bool,
    /// Stop at the end of the context (the default).
    #[arg(long = "no-context-shift")]
    no_context_shift: bool,
    /// Directory for slot files: POST /slots/{id}?action=save|restore with {"filename": ...}
    /// (created if missing; without it those actions answer 501).
    #[arg(long = "slot-save-path", value_name = "DIR")]
    slot_save_path: Option<std::path::PathBuf>,
    /// The chat template: `gemma`, one of llama.cpp's names (`chatml`, `llama2`, `llama2-sys`,
    /// `llama2-sys-bos`, `llama2-sys-strip`, `llama3`, `mistral-v1`, `mistral-v3`,
    /// `mistral-v3-tekken`, `mistral-v7`, `mistral-v7-tekken`, `phi3`, `phi4`, `falcon3`, `zephyr`,
    /// `openchat`, `vicuna`, `vicuna-orca`, `deepseek`, `deepseek2`, `deepseek3`, `command-r`), a
    /// Jinja file, or the Jinja template itself (default: the GGUF's tokenizer.chat_template, else
    /// gemma).
    #[arg(long = "chat-template", value_name = "NAME|FILE", alias = "chat-template-file")]
    chat_template: Option<String>,
    /// Accepted for llama-server compatibility: Tine always renders the GGUF's Jinja template.
    #[arg(long = "jinja")]
    _jinja: bool,
    #[command(flatten)]
    defaults: ServeSampling,
    /// Serve no chat page at `/` (llama-server's flag; the API is unchanged).
    #[arg(long = "no-webui", conflicts_with = "path")]
    no_webui: bool,
    /// Serve the files of this directory as the web page instead of the built-in chat page
    /// (`DIR/index.html` at `/`; llama-server's flag).
    #[arg(long = "path", value_name = "DIR")]
    path: Option<std::path::PathBuf>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health and the chat page's files (comma-separated keys; repeatable).
    #[arg(long = "api-key", value_name = "KEY", value_delimiter = ',')]
    api_key: Vec<String>,
    /// Read API keys from a file, one per line (added to --api-key).
    #[arg(long = "api-key-file", value_name = "FILE")]
    api_key_file: Option<std::path::PathBuf>,
    /// Origins allowed by CORS: `localhost` (pages served from this machine), `*` (any page: use
    /// with --api-key), or a comma-separated list of origins (llama-server's flag; its default is
    /// `*`, Tine's is `localhost`).
    #[arg(long = "cors-origins", value_name = "ORIGINS", default_value = "localhost")]
    cors_origins: String,
    /// Methods a CORS preflight allows.
    #[arg(long = "cors-methods", value_name = "METHODS", default_value = "GET, POST, DELETE, OPTIONS")]
    cors_methods: String,
    /// Headers a CORS preflight allows (default: those the browser asks for).
    #[arg(long = "cors-headers", value_name = "HEADERS")]
    cors_headers: Option<String>,
    /// Do not allow credentials (cookies, Authorization) in CORS requests.
    #[arg(long = "no-cors-credentials")]
    no_cors_credentials: bool,
    /// Logical batch size (llama-server's `-b`): how many tokens of the prefix and suffix around
    /// the cursor /infill keeps (3:1). Prompts are evaluated in --ubatch-size chunks
    #[arg(long = "batch-size", short = 'b', value_name = "N", default_value_t = tine_server::DEFAULT_BATCH)]
    batch: usize,
    /// Prompt tokens evaluated per engine step, over all slots (one chunk at least; the prefilling slots take turns): prompts stall the decoding slots for one such chunk at most. At most --batch-size, as llama.cpp clamps it.
    #[arg(long = "ubatch-size", default_value_t = tine_runtime::PREFILL_CHUNK)]
    ubatch: usize,
    /// MiB of KV the prompt prefixes shared between slots may hold (llama-server's flag; -1: no
    /// limit, 0: no sharing). A request whose prompt starts like another slot's tokens (a system
    /// prompt, a few-shot block) reads that prefix's KV from one copy and evaluates only the rest;
    /// unused prefixes are freed least recently used first. Gemma 3 and Gemma 4 on the CPU.
    #[arg(long = "cache-ram", value_name = "MIB", default_value_t = tine_server::DEFAULT_CACHE_RAM_MIB as i64, allow_negative_numbers = true)]
    cache_ram: i64,
    /// Requests allowed to wait for a slot; beyond this the server answers 503 (with Retry-After).
    #[arg(long = "max-queue", default_value_t = tine_server::DEFAULT_MAX_QUEUE)]
    max_queue: usize,
    /// Largest request body in bytes (413 above it).
    #[arg(long = "max-body-bytes", default_value_t = tine_server::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    #[command(flatten)]
    spec: SpecArgs,
}

/// Server-wide defaults for the fields a request leaves out (llama-server's flags).
#[derive(Args, Clone)]
struct ServeSampling {
    /// Tokens to generate when a request does not say (-1: until end of generation or the context is full).
    #[arg(short = 'n', long = "n-predict", alias = "predict", default_value_t = -1, allow_negative_numbers = true)]
    n_predict: i64,
    /// Sampling temperature (<= 0: greedy).
    #[arg(long = "temp", alias = "temperature", allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Keep the k most likely tokens (<= 0: all).
    #[arg(long = "top-k", allow_negative_numbers = true)]
    top_k: Option<i32>,
    /// Nucleus sampling: keep the smallest set with this total probability (1: all).
    #[arg(long = "top-p")]
    top_p: Option<f32>,
    /// Drop tokens below this fraction of the top probability (0: none).
    #[arg(long = "min-p")]
    min_p: Option<f32>,
    /// Penalty on recently seen tokens (1: off).
    #[arg(long = "repeat-penalty")]
    repeat_penalty: Option<f32>,
    /// Recent tokens the penalties look at (-1: all, 0: off).
    #[arg(long = "repeat-last-n", allow_negative_numbers = true)]
    repeat_last_n: Option<i32>,
    /// Subtracted from a seen token's logit (0: off).
    #[arg(long = "presence-penalty")]
    presence_penalty: Option<f32>,
    /// Subtracted per occurrence of a seen token (0: off).
    #[arg(long = "frequency-penalty")]
    frequency_penalty: Option<f32>,
    /// Seed for requests that bring none (-1: a random one per request).
    #[arg(short = 's', long = "seed", allow_negative_numbers = true)]
    seed: Option<i64>,
    /// Tokens a context shift keeps at the front (-1: the whole prompt; the first token is always kept).
    #[arg(long = "keep", allow_negative_numbers = true, default_value_t = 0)]
    keep: i64,
}

impl ServeSampling {
    fn defaults(&self) -> anyhow::Result<tine_api::Defaults> {
        // The flags are checked exactly as a request's own fields are.
        let fields = tine_api::GenFields {
            n_predict: Some(self.n_predict),
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            n_keep: Some(self.keep),
            ..tine_api::GenFields::default()
        };
        let l = fields.limits().map_err(|e| anyhow::anyhow!("the sampling flags: {e}"))?;
        Ok(tine_api::Defaults { sampling: l.sampling, n_predict: i64::from(l.n_predict), n_keep: self.keep })
    }
}

/// Speculative decoding (llama.cpp's flags where they overlap).
#[derive(Args, Clone)]
struct SpecArgs {
    /// draft-mtp (the model's own NextN head), draft-assistant (needs --mtp-head), draft (needs
    /// -md), ngram (prompt lookup); llama.cpp's draft-simple and ngram-simple are accepted too.
    /// Off by default; --mtp-head or -md alone imply their type.
    #[arg(long = "spec-type", value_name = "TYPE[,TYPE]", value_parser = parse_spec_types)]
    spec_type: Option<(SpecType, bool)>,
    /// Most tokens drafted per verify step (at most 16).
    #[arg(long = "spec-draft-n-max", alias = "draft-max", default_value_t = 3)]
    draft_n_max: usize,
    /// Verify only when at least this many tokens were drafted.
    #[arg(long = "spec-draft-n-min", alias = "draft-min", default_value_t = 0)]
    draft_n_min: usize,
    /// A model drafter stops when its top probability falls below this (0 to 1).
    #[arg(long = "spec-draft-p-min", alias = "draft-p-min", default_value_t = 0.0)]
    draft_p_min: f32,
    /// Choose each round's depth (up to --spec-draft-n-max) from the measured acceptance and
    /// forward costs, and draft nothing where it does not pay (off: always draft n-max).
    #[arg(long = "spec-adaptive", value_name = "on|off", default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    adaptive: bool,
    /// An assistant head GGUF (gemma4-assistant layout) for --spec-type draft-assistant.
    #[arg(long = "mtp-head", value_name = "FILE")]
    mtp_head: Option<PathBuf>,
    /// A draft model GGUF with the target's vocabulary for --spec-type draft (also `-md`).
    #[arg(long = "model-draft", value_name = "FILE")]
    model_draft: Option<PathBuf>,
    /// Accepted for llama.cpp compatibility (also `-ngld`); Tine runs the draft on the target's --device.
    #[arg(long = "n-gpu-layers-draft", alias = "gpu-layers-draft", value_name = "N", allow_negative_numbers = true)]
    _n_gpu_layers_draft: Option<String>,
    /// Shortest n-gram the ngram drafter matches.
    #[arg(long = "spec-ngram-min", default_value_t = 2)]
    ngram_min: usize,
    /// Longest n-gram the ngram drafter matches (tried first).
    #[arg(long = "spec-ngram-max", default_value_t = 4)]
    ngram_max: usize,
    /// The draft model's KV cache type for keys, as --cache-type-k (also `-ctkd`).
    #[arg(long = "cache-type-k-draft", value_name = "TYPE", default_value = "f32")]
    cache_type_k_draft: tine_runtime::KvType,
    /// The draft model's KV cache type for values (also `-ctvd`).
    #[arg(long = "cache-type-v-draft", value_name = "TYPE", default_value = "f32")]
    cache_type_v_draft: tine_runtime::KvType,
}

/// `TYPE` or llama.cpp's chain `ngram,TYPE` (either order): the type and whether n-gram goes first.
fn parse_spec_types(s: &str) -> Result<(SpecType, bool), String> {
    let types: Vec<SpecType> = s.split(',').map(|t| t.trim().parse::<SpecType>().map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
    match types.as_slice() {
        [t] => Ok((*t, false)),
        [SpecType::Ngram, SpecType::Ngram] => Ok((SpecType::Ngram, false)),
        [SpecType::Ngram, t] | [t, SpecType::Ngram] => Ok((*t, true)),
        _ => Err(format!("a chain is ngram plus one other type (ngram,draft-mtp), got {s:?}")),
    }
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" | "1" => Ok(true),
        "off" | "false" | "0" => Ok(false),
        _ => Err(format!("expected on or off, got {s:?}")),
    }
}

impl SpecArgs {
    fn config(&self) -> Option<SpecConfig> {
        let (spec_type, ngram_first) = self.spec_type.or(if self.mtp_head.is_some() {
            Some((SpecType::DraftAssistant, false))
        } else if self.model_draft.is_some() {
            Some((SpecType::Draft, false))
        } else {
            None
        })?;
        Some(self.config_as(spec_type, ngram_first))
    }

    /// `spec_type` with every other flag as given (depth, p-min, heads, n-gram sizes, the draft
    /// model's cache types): `logit-equiv --all` runs each type this way.
    fn config_as(&self, spec_type: SpecType, ngram_first: bool) -> SpecConfig {
        SpecConfig {
            spec_type,
            ngram_first,
            params: DraftParams { n_max: self.draft_n_max, n_min: self.draft_n_min, p_min: self.draft_p_min, adaptive: self.adaptive },
            mtp_head: self.mtp_head.clone(),
            draft_model: self.model_draft.clone(),
            ngram_min: self.ngram_min,
            ngram_max: self.ngram_max,
            draft_cache_types: (self.cache_type_k_draft, self.cache_type_v_draft),
        }
    }

    fn load(&self, model: &Model) -> anyhow::Result<Option<SpecFactory>> {
        let Some(config) = self.config() else { return Ok(None) };
        let what = format!("speculative decoding ({})", config.label());
        Ok(Some(SpecFactory::load(config, model).context(what)?))
    }
}

#[derive(Args)]
struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text.
    #[arg(short = 'p', long)]
    prompt: String,
    /// Do not add BOS.
    #[arg(long)]
    no_bos: bool,
    /// Print each token's text too.
    #[arg(long)]
    pieces: bool,
}

#[derive(Args)]
pub(crate) struct ModelArgs {
    /// A GGUF: Gemma 3 (`gemma3`), Gemma 4 (`gemma4`) or Qwen3.5/3.6 (`qwen35`, `qwen35moe`) as llama.cpp writes them (default: the cached Gemma 3 270M Q4_K_M; `cargo xtask fetch-model` fetches it).
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Context size in tokens (default: 4096, capped at the model's).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    ctx_size: usize,
    /// Where the model runs: cpu, or cuda / cuda:N (needs a build with the `cuda` feature:
    /// tools/cuda/build.sh; the GPU engine runs the model where it reads its weights,
    /// TINE_GPU_ENGINE=0 candle's CUDA path). Draft models and the NextN head run on the same
    /// device; the assistant head (draft-assistant) on the CPU only.
    #[arg(long, value_name = "cpu|cuda[:N]", default_value = "cpu")]
    device: tine_runtime::DeviceSpec,
    /// KV cache type for keys: f32, f16, bf16, q8_0, q4_0, or the rotated turbo4, turbo3 and
    /// turbo2 (4, 3 and 2 bits a value on average; heads of a multiple of 32 values, at least
    /// 128) (also `-ctk`). The CPU keeps every type, the GPU engine f32, f16, bf16, q8_0 and
    /// q4_0, candle's CUDA path f32 only (Qwen3.5/3.6 in its attention layers; its delta-net
    /// states stay f32); speculative decoding stays lossless within a type.
    #[arg(long = "cache-type-k", value_name = "TYPE", default_value = "f32")]
    cache_type_k: tine_runtime::KvType,
    /// KV cache type for values, as --cache-type-k (also `-ctv`).
    #[arg(long = "cache-type-v", value_name = "TYPE", default_value = "f32")]
    cache_type_v: tine_runtime::KvType,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(short = 'p', long, required_unless_present = "prompt_ids", default_value = "")]
    prompt: String,
    /// Read the prompt as token ids from a JSON array file instead (benchmarks use this).
    #[arg(long, value_name = "FILE", conflicts_with = "chat")]
    prompt_ids: Option<PathBuf>,
    /// Wrap the prompt in a user turn of the model's chat template (the GGUF's
    /// `tokenizer.chat_template`, else Gemma's turns), as `tine serve` renders chats.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate (-1: until end of generation).
    #[arg(short = 'n', long = "n-predict", default_value_t = 128, allow_negative_numbers = true)]
    n_predict: i32,
    /// Sampling temperature (0: greedy).
    #[arg(long = "temp", default_value_t = 0.8)]
    temperature: f32,
    #[arg(long = "top-k", default_value_t = 40)]
    top_k: i32,
    #[arg(long = "top-p", default_value_t = 0.95)]
    top_p: f32,
    #[arg(long = "min-p", default_value_t = 0.05)]
    min_p: f32,
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Random seed (default: random).
    #[arg(short = 's', long)]
    seed: Option<u64>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Also write the prompt's and the generated token ids, the timings and the first-token
    /// latency as JSON here (the device comparisons read it).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    #[command(flatten)]
    spec: SpecArgs,
}

#[derive(Args)]
struct LogitEquivArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    spec: SpecArgs,
    /// Check every spec type this model supports (draft-mtp if it has a NextN head,
    /// draft-assistant with --mtp-head, draft with -md, and ngram), instead of --spec-type.
    #[arg(long)]
    all: bool,
    /// Draft depths (--spec-draft-n-max values) to check, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    depths: Vec<usize>,
    /// A file with one prompt per line (default: a built-in set of eight).
    #[arg(long, value_name = "FILE")]
    prompts: Option<PathBuf>,
    /// Tokens generated per prompt.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    n_predict: i32,
    /// Argmax flips where plain decoding's top-2 margin is below this (nats) are benign ties.
    #[arg(long, default_value_t = 0.7)]
    tie_margin: f32,
    /// Also write the results as JSON here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// Writes `bytes` to `path` through a temporary file beside it and a rename, so a reader
/// never sees half a report.
pub(crate) fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// `--model`, or the cached default model.
fn model_path(args: &ModelArgs) -> anyhow::Result<PathBuf> {
    match &args.model {
        Some(p) => Ok(p.clone()),
        None => {
            let p = tine_runtime::default_model_path();
            if !p.exists() {
                anyhow::bail!("no --model given and the default model is not cached at {}; run `cargo xtask fetch-model`", p.display());
            }
            Ok(p)
        }
    }
}

pub(crate) fn load(args: &ModelArgs) -> anyhow::Result<Model> {
    let path = model_path(args)?;
    let t0 = Instant::now();
    let device = args.device.open()?;
    let opened_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut model = Model::load_on(&path, &device)?;
    model.set_cache_types(args.cache_type_k, args.cache_type_v)?;
    let on = if args.device.is_cpu() { String::new() } else { format!(" on {} with {} (device opened in {opened_ms:.0} ms)", tine_runtime::describe_device(model.device()), model.engine()) };
    if let Some(note) = model.engine_note() {
        eprintln!("tine: the GPU engine does not run this model, candle's CUDA path does: {note}");
    }
    let (k, v) = model.cache_types();
    let kv = match model.kv_bytes_per_position() {
        Some(bytes) if (k, v) != (tine_runtime::KvType::F32, tine_runtime::KvType::F32) => format!(", KV cache K {k} V {v}: {bytes} bytes a position"),
        _ => String::new(),
    };
    eprintln!("loaded {} ({}, {} layers, vocab {}) in {:.0} ms{on}{kv}", model.info.name, path.display(), model.info.block_count, model.info.vocab_size, t0.elapsed().as_secs_f64() * 1e3);
    Ok(model)
}

fn parse_ids(text: &str) -> anyhow::Result<Vec<u32>> {
    let inner = text.trim().strip_prefix('[').and_then(|t| t.strip_suffix(']')).context("expected [id, id, ...]")?;
    inner.split(',').filter(|s| !s.trim().is_empty()).map(|s| Ok(s.trim().parse::<u32>()?)).collect()
}

fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    let model = load(&a.model)?;
    let prompt_ids = if let Some(file) = &a.prompt_ids {
        let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        parse_ids(&text).with_context(|| format!("{} is not a JSON array of token ids", file.display()))?
    } else if a.chat {
        // The model's chat template, as the server renders it.
        let template = tine_engine::template::ChatTemplate::for_model(&model, None);
        template.prompt(&model, &[serde_json::json!({"role": "user", "content": a.prompt})], None)?.1
    } else {
        model.tokenizer.encode(&a.prompt, true, true)
    };
    let mut seq = model.try_new_sequence(a.model.ctx_size).with_context(|| {
        let per = model.kv_bytes_per_position().map(|b| format!(" ({:.1} KiB of K/V a position)", b as f64 / 1024.0)).unwrap_or_default();
        let free = match model.gpu_memory() {
            Some(Ok((free, total))) => format!("; {} MiB of the GPU's {} MiB are free", free >> 20, total >> 20),
            _ => String::new(),
        };
        format!("the GPU cannot hold a sequence of --ctx-size {}{per}{free}: try a smaller -c or lower-bit -ctk/-ctv", a.model.ctx_size)
    })?;
    let factory = a.spec.load(&model)?;
    let mut spec = match &factory {
        Some(f) => Some(f.speculator(&model, seq.context())?),
        None => None,
    };
    let sampling = SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, min_p: a.min_p, repeat_penalty: a.repeat_penalty, seed: a.seed, ..SamplingParams::default() };
    let req = GenerateRequest { n_predict: a.n_predict, sampling, ignore_eos: a.ignore_eos, ..GenerateRequest::new(prompt_ids.clone()) };
    let t0 = Instant::now();
    let mut first_token_ms = None;
    let mut g = Generation::start_with(&model, &mut seq, req, spec.as_mut())?;
    let mut out = std::io::stdout().lock();
    if !a.chat && a.prompt_ids.is_none() {
        write!(out, "{}", a.prompt)?;
    }
    while !g.is_finished() {
        let ev = g.step_with(&model, &mut seq, spec.as_mut())?;
        first_token_ms.get_or_insert_with(|| t0.elapsed().as_secs_f64() * 1e3);
        write!(out, "{}", ev.text)?;
        out.flush()?;
    }
    writeln!(out)?;
    let t = g.timings();
    if let Some(path) = &a.json {
        let doc = tine_report::GenerateReport {
            model: model.info.path.display().to_string(),
            device: tine_runtime::describe_device(model.device()),
            engine: model.engine().to_string(),
            prompt_ids: prompt_ids.clone(),
            ids: g.tokens().to_vec(),
            stop: g.stop_type().map(|s| s.as_str().to_owned()),
            first_token_ms,
            prompt_n: t.prompt_n,
            prompt_ms: t.prompt_ms,
            prompt_per_second: t.prompt_per_second(),
            predicted_n: t.predicted_n,
            predicted_ms: t.predicted_ms,
            predicted_per_second: t.predicted_per_second(),
            draft_n: t.draft.draft_n,
            draft_n_accepted: t.draft.draft_n_accepted,
            draft_verify_steps: t.draft.draft_verify_steps,
        };
        write_atomically(path, (serde_json::to_string(&doc)? + "\n").as_bytes())?;
    }
    eprintln!(
        "prompt: {} tokens in {:.1} ms ({:.1} tok/s) | generated: {} tokens in {:.1} ms ({:.1} tok/s) | stop: {}",
        t.prompt_n,
        t.prompt_ms,
        t.prompt_per_second(),
        t.predicted_n,
        t.predicted_ms,
        t.predicted_per_second(),
        g.stop_type().map(|s| s.as_str()).unwrap_or("none")
    );
    if let Some(spec) = &spec {
        let d = t.draft;
        eprintln!(
            "draft ({}, n_max {}): drafted {} accepted {} ({:.1}%) in {} verify steps, {:.2} tokens per step",
            spec.spec_type(),
            spec.params.n_max,
            d.draft_n,
            d.draft_n_accepted,
            d.accept_rate() * 100.0,
            d.draft_verify_steps,
            d.tau()
        );
    }
    Ok(())
}

/// The built-in prompt set of `tine logit-equiv`: code, prose, lists, repetition, Q&A.
const EQUIV_PROMPTS: [&str; 8] = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The history of the printing press begins",
    "Shopping list:\n1. eggs\n2. milk\n3.",
    "Q: What is the capital of France?\nA:",
    "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat",
    "Translate to French: Good morning, how are you?\nFrench:",
    "#include <stdio.h>\nint main(void) {\n",
    "Once upon a time, in a small village by the sea,",
];

/// A greedy run of `n_predict` tokens (EOS ignored) on a fresh sequence sized for it: the tokens,
/// their logit rows when `record`, and the timings.
pub(crate) fn greedy_run(model: &Model, prompt: &[u32], n_predict: i32, spec: Option<&mut tine_spec::Speculator>, record: bool) -> anyhow::Result<(Vec<u32>, Vec<Vec<f32>>, tine_engine::Timings)> {
    sampled_run(model, prompt, n_predict, SamplingParams::greedy(), spec, record)
}

/// [`greedy_run`] with any sampling settings (a fixed seed makes it repeatable).
pub(crate) fn sampled_run(
    model: &Model,
    prompt: &[u32],
    n_predict: i32,
    sampling: SamplingParams,
    mut spec: Option<&mut tine_spec::Speculator>,
    record: bool,
) -> anyhow::Result<(Vec<u32>, Vec<Vec<f32>>, tine_engine::Timings)> {
    let mut seq = model.new_sequence(prompt.len() + n_predict.max(0) as usize + 8);
    let req = GenerateRequest { n_predict, sampling, ignore_eos: true, ..GenerateRequest::new(prompt.to_vec()) };
    let mut g = Generation::start_with(model, &mut seq, req, spec.as_deref_mut())?;
    g.record_logits(record);
    while !g.is_finished() {
        g.step_with(model, &mut seq, spec.as_deref_mut())?;
    }
    Ok((g.tokens().to_vec(), g.recorded_logits().to_vec(), g.timings()))
}

fn logit_equiv(a: LogitEquivArgs) -> anyhow::Result<bool> {
    let model = load(&a.model)?;
    let prompts: Vec<String> = match &a.prompts {
        Some(f) => std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?.lines().filter(|l| !l.trim().is_empty()).map(|l| l.replace("\\n", "\n")).collect(),
        None => EQUIV_PROMPTS.iter().map(|s| s.to_string()).collect(),
    };
    let base = a.spec.config();
    let configs: Vec<SpecConfig> = if a.all {
        // Each type with the flags as given (a draft model keeps -ctkd/-ctvd, -md's p-min, ...).
        let mut v = Vec::new();
        if model.has_nextn() {
            v.push(a.spec.config_as(SpecType::DraftMtp, false));
        }
        if a.spec.mtp_head.is_some() {
            v.push(a.spec.config_as(SpecType::DraftAssistant, false));
        }
        if a.spec.model_draft.is_some() {
            v.push(a.spec.config_as(SpecType::Draft, false));
        }
        v.push(a.spec.config_as(SpecType::Ngram, false));
        v
    } else {
        vec![base.context("give --spec-type (or --all)")?]
    };
    let encoded: Vec<Vec<u32>> = prompts.iter().map(|p| model.tokenizer.encode(p, true, true)).collect();
    eprintln!("plain greedy decoding of {} prompts x {} tokens ...", encoded.len(), a.n_predict);
    let plain: Vec<_> = encoded.iter().map(|p| greedy_run(&model, p, a.n_predict, None, true)).collect::<anyhow::Result<_>>()?;
    println!(
        "{:<16} {:>5} {:>9} {:>10} {:>9} {:>15} {:>13} {:>15} {:>6} {:>6}",
        "spec type", "depth", "positions", "real_frac", "frac_full", "mean_top1_mae", "max |Δlogit|", "greedy ident.", "accept", "tau"
    );
    let mut all_exact = true;
    let mut results = Vec::new();
    for cfg in configs {
        let factory = SpecFactory::load(cfg.clone(), &model).with_context(|| format!("setting up {}", cfg.spec_type))?;
        for &depth in &a.depths {
            let mut total = tine_spec::equivalence::Equivalence { frac_full_agree: 0.0, tokens_identical: true, ..Default::default() };
            let (mut full, mut mae, mut identical, mut stats) = (0.0, 0.0, 0, tine_spec::SpecStats::default());
            for (p, want) in encoded.iter().zip(&plain) {
                let mut spec = factory.speculator(&model, model.info.context_length)?;
                spec.params.n_max = depth;
                let got = greedy_run(&model, p, a.n_predict, Some(&mut spec), true)?;
                stats.add(&got.2.draft);
                let e = tine_spec::equivalence::compare((&want.0, &want.1), (&got.0, &got.1), a.tie_margin);
                total.positions += e.positions;
                total.real_disagreements += e.real_disagreements;
                full += e.frac_full_agree * e.positions as f64;
                mae += e.mean_top1_mae * e.positions as f64;
                total.max_abs_logit_diff = total.max_abs_logit_diff.max(e.max_abs_logit_diff);
                identical += usize::from(e.tokens_identical);
            }
            let n = total.positions.max(1) as f64;
            total.real_frac = total.real_disagreements as f64 / n;
            total.frac_full_agree = full / n;
            total.mean_top1_mae = mae / n;
            total.tokens_identical = identical == encoded.len();
            all_exact &= total.is_exact();
            println!(
                "{:<16} {:>5} {:>9} {:>10.4} {:>9.4} {:>15.6} {:>13.3e} {:>9}/{:<5} {:>6.3} {:>6.2}",
                cfg.spec_type.as_str(),
                depth,
                total.positions,
                total.real_frac,
                total.frac_full_agree,
                total.mean_top1_mae,
                total.max_abs_logit_diff,
                identical,
                encoded.len(),
                stats.accept_rate(),
                stats.tau()
            );
            results.push(tine_report::LogitEquivRow {
                spec_type: cfg.spec_type.as_str().to_owned(),
                depth,
                positions: total.positions,
                real_disagreements: total.real_disagreements,
                real_frac: total.real_frac,
                frac_full_agree: total.frac_full_agree,
                mean_top1_mae: total.mean_top1_mae,
                max_abs_logit_diff: total.max_abs_logit_diff,
                greedy_identical_prompts: identical,
                prompts: encoded.len(),
                draft_n: stats.draft_n,
                draft_n_accepted: stats.draft_n_accepted,
                draft_verify_steps: stats.draft_verify_steps,
                exact: total.is_exact(),
            });
        }
    }
    if let Some(path) = &a.json {
        let doc = tine_report::LogitEquivReport { model: model.info.path.display().to_string(), n_predict: a.n_predict, tie_margin: a.tie_margin, results, exact: all_exact };
        write_atomically(path, serde_json::to_string_pretty(&doc)?.as_bytes())?;
    }
    println!("{}", if all_exact { "logit-equiv: exact (every figure zero, greedy output identical)" } else { "logit-equiv: NOT exact" });
    Ok(all_exact)
}

fn graft(a: GraftArgs) -> anyhow::Result<()> {
    let target = a.target.unwrap_or_else(tine_runtime::default_model_path);
    let g = tine_runtime::graft_nextn(&target, &a.head, &a.out)?;
    let vocab = g.draft_vocab.map(|k| format!(", draft vocabulary of {k} tokens")).unwrap_or_default();
    eprintln!("grafted {} tensor(s) as block {} into {}{vocab}; run it with --spec-type draft-mtp", g.head_tensors, g.block, a.out.display());
    Ok(())
}

fn tokenize(a: TokenizeArgs) -> anyhow::Result<()> {
    // The tokenizer alone: any GGUF whose vocabulary Tine reads, whatever its architecture.
    let tokenizer = Model::load_tokenizer(&model_path(&a.model)?)?;
    let ids = tokenizer.encode(&a.prompt, !a.no_bos, true);
    if a.pieces {
        for id in &ids {
            println!("{id}\t{:?}", tokenizer.token_text(*id).unwrap_or(""));
        }
    } else {
        println!("{ids:?}");
    }
    Ok(())
}

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    // Flags first: a bad one should not wait for the model to load.
    let addrs = listen_addrs(&a.host, a.port)?;
    let defaults = a.defaults.defaults()?;
    let chat_template = a.chat_template.as_deref().map(tine_engine::template::ChatTemplate::named).transpose().context("--chat-template")?;
    let cache_ram = match a.cache_ram {
        -1 => None,
        n if n >= 0 => Some((n as usize).saturating_mul(1 << 20)),
        n => anyhow::bail!("--cache-ram {n}: MiB, -1 for no limit or 0 for no sharing"),
    };
    if let Some(d) = &a.slot_save_path {
        std::fs::create_dir_all(d).with_context(|| format!("--slot-save-path {}", d.display()))?;
    }
    let mut chat_template_kwargs = match a.chat_template_kwargs.as_deref() {
        None => serde_json::Map::new(),
        Some(text) => match serde_json::from_str(text) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => anyhow::bail!("--chat-template-kwargs {text}: a JSON object, such as '{{\"enable_thinking\": false}}'"),
        },
    };
    match a.reasoning.as_str() {
        "on" | "true" | "1" => drop(chat_template_kwargs.insert("enable_thinking".into(), true.into())),
        "off" | "false" | "0" => drop(chat_template_kwargs.insert("enable_thinking".into(), false.into())),
        "auto" => {}
        other => anyhow::bail!("--reasoning {other}: one of on, off, auto"),
    }
    let reasoning_format = tine_api::ReasoningFormat::from_name(&a.reasoning_format).ok_or_else(|| anyhow::anyhow!("--reasoning-format {}: one of none, deepseek, auto", a.reasoning_format))?;
    use tine_engine::embeddings::Pooling;
    let pooling = a.pooling.as_deref().map(|p| Pooling::from_name(p).ok_or_else(|| anyhow::anyhow!("--pooling {p}: one of none, mean, cls, last (rank is a reranker's, not served)"))).transpose()?;
    let model = std::sync::Arc::new(load(&a.model)?);
    let embeddings = if a.embeddings {
        if model.engine() == "tine-gpu" {
            anyhow::bail!("--embeddings: the GPU engine computes no embeddings yet; serve them with --device cpu");
        }
        Some(pooling.or_else(|| model.info.pooling_type.and_then(Pooling::from_gguf)).unwrap_or(Pooling::None))
    } else {
        None
    };
    let parallel = a.parallel.max(1);
    // llama-server's rule: --ctx-size is the total, each slot gets an equal share.
    let total = a.model.ctx_size.min(model.info.context_length * parallel);
    let ctx = (total / parallel).min(model.info.context_length);
    if ctx < 2 {
        anyhow::bail!("--ctx-size {} split over {parallel} slots leaves {ctx} tokens per slot", a.model.ctx_size);
    }
    let spec = a.spec.load(&model)?.map(std::sync::Arc::new);
    let mut keys = a.api_key.clone();
    if let Some(f) = &a.api_key_file {
        let text = std::fs::read_to_string(f).with_context(|| format!("reading --api-key-file {}", f.display()))?;
        keys.extend(text.lines().map(str::to_owned));
    }
    let api_keys = tine_server::ApiKeys::new(keys);
    if a.api_key_file.is_some() && api_keys.is_empty() {
        anyhow::bail!("--api-key-file holds no key");
    }
    let webui = match (&a.path, a.no_webui) {
        (Some(dir), _) => {
            if !dir.is_dir() {
                anyhow::bail!("--path {}: not a directory", dir.display());
            }
            tine_server::webui::WebUi::Dir(dir.clone())
        }
        (None, true) => tine_server::webui::WebUi::Off,
        (None, false) => tine_server::webui::WebUi::Builtin,
    };
    let config = tine_server::ServerConfig {
        spec,
        api_keys,
        webui,
        ubatch: a.ubatch.max(1),
        batch: a.batch.max(4),
        max_queue: a.max_queue,
        max_body_bytes: a.max_body_bytes,
        defaults,
        alias: a.alias.clone(),
        verbose: a.verbose,
        tags: a.tags.iter().map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()).collect(),
        slots_endpoint: !a.no_slots,
        metrics: a.metrics,
        context_shift: a.context_shift && !a.no_context_shift,
        slot_save_path: a.slot_save_path.clone(),
        cache_ram,
        chat_template,
        embeddings,
        chat_template_kwargs,
        reasoning_format,
        cors: tine_server::cors::CorsConfig {
            origins: tine_server::cors::CorsOrigins::parse(&a.cors_origins),
            methods: a.cors_methods.clone(),
            headers: a.cors_headers.clone(),
            credentials: !a.no_cors_credentials,
        },
        ..tine_server::ServerConfig::new(parallel, ctx)
    };
    let spec_note = match &config.spec {
        Some(f) => format!(", speculative {} n_max {}", f.config.label(), f.config.params.n_max),
        None => String::new(),
    };
    let auth_note = if config.api_keys.is_empty() { "" } else { ", API key required" };
    let page_note = if config.webui == tine_server::webui::WebUi::Off { "" } else { "; chat page at /" };
    let urls: Vec<String> = addrs.iter().map(|a| format!("http://{a}")).collect();
    // What a position of K/V takes at the cache types (issue 53: sizing -c and -ctk/-ctv).
    let (kt, vt) = model.cache_types();
    let kv_note = match model.kv_bytes_per_position() {
        Some(b) => format!(", K/V {kt}/{vt} {:.1} KiB a token", b as f64 / 1024.0),
        None => format!(", K/V {kt}/{vt}"),
    };
    eprintln!("tine serve: {} ({} slot(s), context {ctx} tokens each{kv_note}{spec_note}{auth_note}){page_note}", urls.join(", "), config.parallel);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(tine_server::serve_all(model, config, &addrs)).with_context(|| format!("serving on {}", urls.join(", ")))?;
    Ok(())
}

/// `--host`'s addresses at `port`: an IP address (IPv6 with or without brackets) or a name,
/// resolved to its first address.
fn listen_addrs(hosts: &[String], port: u16) -> anyhow::Result<Vec<std::net::SocketAddr>> {
    use std::net::ToSocketAddrs;
    let mut out = Vec::with_capacity(hosts.len());
    for h in hosts.iter().map(|h| h.trim()).filter(|h| !h.is_empty()) {
        let bare = h.strip_prefix('[').and_then(|x| x.strip_suffix(']')).unwrap_or(h);
        let addr = match bare.parse::<std::net::IpAddr>() {
            Ok(ip) => std::net::SocketAddr::new(ip, port),
            Err(_) => {
                (bare, port).to_socket_addrs().with_context(|| format!("--host {h}: not an address, and it does not resolve"))?.next().with_context(|| format!("--host {h}: resolves to no address"))?
            }
        };
        if !out.contains(&addr) {
            out.push(addr);
        }
    }
    anyhow::ensure!(!out.is_empty(), "--host names no address");
    Ok(out)
}

/// llama.cpp spells some long options with one dash (`-md`, `-ngld`, `-ctk`); clap takes them as long.
fn llama_style_args() -> Vec<std::ffi::OsString> {
    std::env::args_os()
        .map(|a| match a.to_str() {
            Some("-md") => "--model-draft".into(),
            Some("-ngld") => "--n-gpu-layers-draft".into(),
            Some("-ub") => "--ubatch-size".into(),
            Some("-np") => "--parallel".into(),
            Some("-ctk") => "--cache-type-k".into(),
            Some("-ctv") => "--cache-type-v".into(),
            Some("-ctkd") => "--cache-type-k-draft".into(),
            Some("-ctvd") => "--cache-type-v-draft".into(),
            _ => a,
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    match Cli::parse_from(llama_style_args()).command {
        Cmd::Serve(a) => serve(*a).context("tine serve"),
        Cmd::Generate(a) => generate(a).context("tine generate"),
        Cmd::Tokenize(a) => tokenize(a).context("tine tokenize"),
        Cmd::SpecBench(a) => spec_bench::run(a).context("tine spec-bench"),
        Cmd::Perplexity(a) => perplexity::run(a).context("tine perplexity"),
        Cmd::GraftNextn(a) => graft(a).context("tine graft-nextn"),
        Cmd::LogitEquiv(a) => {
            if !logit_equiv(a).context("tine logit-equiv")? {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}
