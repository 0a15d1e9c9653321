//! `tine perplexity`: perplexity over a text, and how far a KV cache type moves the model's
//! next-token distributions from a reference type (llama.cpp's `llama-perplexity` method and
//! `--kl-divergence` figures: mean KL divergence and how often the top token agrees).
//!
//! The text is cut into chunks of `--ctx-size` tokens, each evaluated from an empty cache with
//! BOS as its first token; the second half of each chunk's positions is scored, as
//! llama-perplexity scores them. The reference runs in the same process on its own sequence.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use tine_runtime::{KvType, Model, Sequence};

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: crate::ModelArgs,
    /// The text to score (llama-perplexity's `-f`).
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Chunks of --ctx-size tokens to score (default: every whole chunk of the text).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// The KV cache types the KL divergence is measured against, `K/V` (llama.cpp's names).
    #[arg(long = "kl-base-cache-types", value_name = "K/V", default_value = "f32/f32", value_parser = parse_pair)]
    pub base_types: (KvType, KvType),
    /// Also write the figures as JSON here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

fn parse_pair(s: &str) -> Result<(KvType, KvType), String> {
    let (k, v) = s.split_once('/').unwrap_or((s, s));
    Ok((k.parse()?, v.parse()?))
}

/// Positions forwarded at once while scoring (the logits of a batch are held in memory).
const SCORE_BATCH: usize = 16;

/// Log-probabilities of a row of logits, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    let log_sum = sum.ln() + max;
    row.iter().map(|&x| x as f64 - log_sum).collect()
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |best, (i, &x)| if x > row[best] { i } else { best })
}

/// The figures of one run.
#[derive(Debug, serde::Serialize)]
pub struct Figures {
    pub cache_type_k: String,
    pub cache_type_v: String,
    pub base_cache_type_k: String,
    pub base_cache_type_v: String,
    pub ctx_size: usize,
    pub chunks: usize,
    pub scored: usize,
    pub ppl: f64,
    pub base_ppl: f64,
    pub mean_kld: f64,
    /// Standard error of the mean KL divergence.
    pub mean_kld_err: f64,
    pub max_kld: f64,
    /// Share of positions whose most likely token is the reference's.
    pub same_top1: f64,
}

/// The logits of positions `first..tokens.len() - 1` of a chunk, `SCORE_BATCH` rows at a time.
fn chunk_rows(model: &Model, seq: &mut Sequence, tokens: &[u32], first: usize, mut each: impl FnMut(usize, &[f32])) -> anyhow::Result<()> {
    seq.reset();
    seq.prefill(model, &tokens[..first])?;
    let mut at = first;
    while at < tokens.len() - 1 {
        let end = (at + SCORE_BATCH).min(tokens.len() - 1);
        let logits = seq.forward_all(model, &tokens[at..end])?;
        for i in 0..logits.positions() {
            each(at + i, logits.row(i));
        }
        at = end;
    }
    Ok(())
}

pub fn run(a: PerplexityArgs) -> anyhow::Result<()> {
    let model = crate::load(&a.model)?;
    let base = crate::load(&crate::ModelArgs { model: a.model.model.clone(), cache_type_k: a.base_types.0, cache_type_v: a.base_types.1, ..a.model }).context("the reference")?;
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let tokens = model.tokenizer.encode(&text, true, false);
    let n_ctx = a.model.ctx_size.min(model.info.context_length);
    if n_ctx < 8 {
        anyhow::bail!("--ctx-size {n_ctx} is too small to score");
    }
    let available = tokens.len() / n_ctx;
    let chunks = a.chunks.unwrap_or(available).min(available);
    if chunks == 0 {
        anyhow::bail!("{} holds {} tokens: not one chunk of {n_ctx}", a.file.display(), tokens.len());
    }
    let bos = tokens.first().copied().filter(|_| model.tokenizer.bos_token().is_some());
    let first = n_ctx / 2;
    let (mut nll, mut base_nll, mut kld_sum, mut kld_sq, mut max_kld, mut same, mut scored) = (0f64, 0f64, 0f64, 0f64, 0f64, 0usize, 0usize);
    let (mut seq, mut base_seq) = (model.new_sequence(n_ctx), base.new_sequence(n_ctx));
    let t0 = std::time::Instant::now();
    for c in 0..chunks {
        let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if let Some(bos) = bos {
            chunk[0] = bos;
        }
        let mut base_rows: Vec<(Vec<f64>, usize)> = Vec::with_capacity(n_ctx - first);
        chunk_rows(&base, &mut base_seq, &chunk, first, |_, row| base_rows.push((log_softmax(row), argmax(row))))?;
        let mut i = 0;
        chunk_rows(&model, &mut seq, &chunk, first, |pos, row| {
            let lp = log_softmax(row);
            let (blp, btop) = &base_rows[i];
            let next = chunk[pos + 1] as usize;
            nll -= lp[next];
            base_nll -= blp[next];
            let kld: f64 = blp.iter().zip(&lp).map(|(&b, &t)| if b > -700.0 { b.exp() * (b - t) } else { 0.0 }).sum();
            kld_sum += kld;
            kld_sq += kld * kld;
            max_kld = max_kld.max(kld);
            same += usize::from(argmax(row) == *btop);
            scored += 1;
            i += 1;
        })?;
        eprintln!("chunk {}/{chunks}: ppl {:.4} (reference {:.4}), mean KLD {:.6}", c + 1, (nll / scored as f64).exp(), (base_nll / scored as f64).exp(), kld_sum / scored as f64);
    }
    let n = scored as f64;
    let mean = kld_sum / n;
    let var = (kld_sq / n - mean * mean).max(0.0);
    let (k, v) = model.cache_types();
    let f = Figures {
        cache_type_k: k.to_string(),
        cache_type_v: v.to_string(),
        base_cache_type_k: a.base_types.0.to_string(),
        base_cache_type_v: a.base_types.1.to_string(),
        ctx_size: n_ctx,
        chunks,
        scored,
        ppl: (nll / n).exp(),
        base_ppl: (base_nll / n).exp(),
        mean_kld: mean,
        mean_kld_err: (var / (n - 1.0).max(1.0)).sqrt(),
        max_kld,
        same_top1: same as f64 / n,
    };
    println!(
        "K {k} V {v} against K {} V {}: {chunks} chunks of {n_ctx}, {scored} positions scored in {:.1} s\nppl {:.4} (reference {:.4})\nmean KLD {:.6} ± {:.6}, max {:.6}\nsame top token {:.3}%",
        a.base_types.0,
        a.base_types.1,
        t0.elapsed().as_secs_f64(),
        f.ppl,
        f.base_ppl,
        f.mean_kld,
        f.mean_kld_err,
        f.max_kld,
        100.0 * f.same_top1
    );
    if let Some(path) = &a.json {
        // Written beside and renamed over, as logit-equiv's --json is: never a half-written file.
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&f)?).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
