//! `tine`: a thin CLI over tine-engine (generation) and tine-server (HTTP).

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use tine_engine::chat::{render_gemma, Message};
use tine_engine::{GenerateRequest, Generation};
use tine_runtime::Model;
use tine_sampling::SamplingParams;

#[derive(Parser)]
#[command(name = "tine", version, about = "Tine: Gemma 3 GGUF inference on a patched candle")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text for one prompt; prints the text, then a timing line on stderr.
    Generate(GenerateArgs),
    /// Serve a llama-server-compatible HTTP API (/completion, /v1/completions, /v1/chat/completions, ...).
    Serve(ServeArgs),
    /// Print the token ids of a text (special tokens parsed), one JSON array.
    Tokenize(TokenizeArgs),
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Slots: requests served concurrently, each with its own KV cache (and reused prompt prefix).
    #[arg(short = 'n', long = "parallel", alias = "np", default_value_t = 1)]
    parallel: usize,
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
struct ModelArgs {
    /// A Gemma 3 GGUF (default: the cached Gemma 3 270M Q4_K_M; `cargo xtask fetch-model` fetches it).
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Context size in tokens (default: 4096, capped at the model's).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    ctx_size: usize,
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
    /// Wrap the prompt in a Gemma chat turn (`<start_of_turn>user …`).
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
}

fn load(args: &ModelArgs) -> anyhow::Result<Model> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => {
            let p = tine_runtime::default_model_path();
            if !p.exists() {
                anyhow::bail!("no --model given and the default model is not cached at {}; run `cargo xtask fetch-model`", p.display());
            }
            p
        }
    };
    let t0 = Instant::now();
    let model = Model::load(&path)?;
    eprintln!("loaded {} ({}, {} layers, vocab {}) in {:.0} ms", model.info.name, path.display(), model.info.block_count, model.info.vocab_size, t0.elapsed().as_secs_f64() * 1e3);
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
        let text = render_gemma(&[Message { role: "user".into(), content: a.prompt.clone() }], true)?;
        model.tokenizer.encode(&text, false, true)
    } else {
        model.tokenizer.encode(&a.prompt, true, true)
    };
    let mut seq = model.new_sequence(a.model.ctx_size);
    let sampling = SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, min_p: a.min_p, repeat_penalty: a.repeat_penalty, seed: a.seed, ..SamplingParams::default() };
    let req = GenerateRequest { n_predict: a.n_predict, sampling, ignore_eos: a.ignore_eos, ..GenerateRequest::new(prompt_ids) };
    let mut g = Generation::start(&model, &mut seq, req)?;
    let mut out = std::io::stdout().lock();
    if !a.chat && a.prompt_ids.is_none() {
        write!(out, "{}", a.prompt)?;
    }
    while !g.is_finished() {
        let ev = g.step(&model, &mut seq)?;
        write!(out, "{}", ev.text)?;
        out.flush()?;
    }
    writeln!(out)?;
    let t = g.timings();
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
    Ok(())
}

fn tokenize(a: TokenizeArgs) -> anyhow::Result<()> {
    let model = load(&a.model)?;
    let ids = model.tokenizer.encode(&a.prompt, !a.no_bos, true);
    if a.pieces {
        for id in &ids {
            println!("{id}\t{:?}", model.tokenizer.token_text(*id).unwrap_or(""));
        }
    } else {
        println!("{ids:?}");
    }
    Ok(())
}

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let model = std::sync::Arc::new(load(&a.model)?);
    let ctx = a.model.ctx_size.min(model.info.context_length);
    let addr: std::net::SocketAddr = format!("{}:{}", a.host, a.port).parse().with_context(|| format!("bad --host/--port {}:{}", a.host, a.port))?;
    let config = tine_server::ServerConfig { parallel: a.parallel.max(1), ctx_size: ctx };
    eprintln!("tine serve: http://{addr} ({} slot(s), context {ctx} tokens each)", config.parallel);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(tine_server::serve(model, config, addr)).with_context(|| format!("serving on {addr}"))?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Serve(a) => serve(a).context("tine serve"),
        Cmd::Generate(a) => generate(a).context("tine generate"),
        Cmd::Tokenize(a) => tokenize(a).context("tine tokenize"),
    }
}
