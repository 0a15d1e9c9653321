//! `tine spec-bench`: decode speed with speculative decoding on against plain decoding, on the
//! seeds' 9-prompt set and on copy-heavy prompts, all configurations interleaved in one run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use tine_spec::{DraftInput, DraftParams, Drafter, SpecConfig, SpecError, SpecFactory, SpecStats, SpecType, Speculator};

#[derive(Args)]
pub struct SpecBenchArgs {
    #[command(flatten)]
    pub model: crate::ModelArgs,
    /// Spec types to measure: ngram, draft (needs -md; drafting the target with itself if
    /// -md names the same file), draft-mtp, draft-assistant (needs --mtp-head), and `reject`
    /// (a drafter whose drafts are always rejected: the cost of a verify step that gains nothing),
    /// and chains `ngram+TYPE` (llama.cpp's `--spec-type ngram,TYPE`).
    #[arg(long, value_delimiter = ',', default_value = "ngram,reject")]
    pub types: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    pub depths: Vec<usize>,
    /// Tokens generated per prompt (EOS ignored).
    #[arg(short = 'n', long = "n-predict", default_value_t = 192)]
    pub n_predict: i32,
    /// Sampling temperatures (0: greedy); above 0 every run uses seed 42 + the prompt's index,
    /// so plain and speculative runs of a prompt must give the same tokens.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub temperatures: Vec<f32>,
    /// Depth policies per spec type: `fixed` (always n-max) and/or `adaptive`.
    #[arg(long, value_delimiter = ',', default_value = "fixed")]
    pub policies: Vec<String>,
    /// Interleaved rounds; the table reports medians.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Prompt sets: mtp9 (the seeds' nine prompts), copy (copy-heavy edits and quotes).
    #[arg(long, value_delimiter = ',', default_value = "copy,mtp9")]
    pub sets: Vec<String>,
    #[arg(long = "model-draft", value_name = "FILE")]
    pub model_draft: Option<PathBuf>,
    #[arg(long = "mtp-head", value_name = "FILE")]
    pub mtp_head: Option<PathBuf>,
    /// The draft model's KV cache type for keys (also `-ctkd`); the target's -ctk unless given.
    #[arg(long = "cache-type-k-draft", value_name = "TYPE")]
    pub cache_type_k_draft: Option<tine_runtime::KvType>,
    /// The draft model's KV cache type for values (also `-ctvd`); the target's -ctv unless given.
    #[arg(long = "cache-type-v-draft", value_name = "TYPE")]
    pub cache_type_v_draft: Option<tine_runtime::KvType>,
    /// Instead of decoding: the cost of one verify forward of each of these row counts (the
    /// median of 21, after a prompt of 64 tokens), against a one-row decode step.
    #[arg(long = "forward-rows", value_delimiter = ',', value_name = "ROWS")]
    pub forward_rows: Vec<usize>,
    /// Instead of decoding: continuous batching's cost, for each of these sequence counts N: one
    /// `forward_many` of N sequences one decode row each (after a prompt of 64 tokens each)
    /// against N decode steps one after another, medians of 21.
    #[arg(long = "batch-seqs", value_delimiter = ',', value_name = "N", conflicts_with = "forward_rows")]
    pub batch_seqs: Vec<usize>,
    /// Instead of decoding: the cost of one assistant draft step (`--mtp-head`) against one
    /// target decode step at the same position (medians of 21, after a prompt of 64 tokens);
    /// for a Gemma 4 assistant with ordered embeddings, with them on and off.
    #[arg(long = "draft-steps", requires = "mtp_head", conflicts_with = "forward_rows")]
    pub draft_steps: bool,
    /// Write the Markdown report here (and JSON beside it).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

const PYTHON_SNIPPET: &str = "def load_records(path, limit=None):\n    records = []\n    with open(path, encoding=\"utf-8\") as handle:\n        for number, line in enumerate(handle):\n            if limit is not None and number >= limit:\n                break\n            line = line.strip()\n            if not line or line.startswith(\"#\"):\n                continue\n            name, value = line.split(\"=\", 1)\n            records.append((name.strip(), float(value)))\n    return records\n\n\ndef total(records):\n    result = 0.0\n    for name, value in records:\n        result += value\n    return result\n";

const PASSAGE: &str = "The lighthouse at Bell Rock was built between 1807 and 1810. \"The rock is covered by the sea for twenty hours of every day,\" wrote its engineer, Robert Stevenson. Workers could only labour at low tide, and in the first season they managed just eighty hours on the rock itself. \"We were often obliged to leave the work with the water rising round our knees,\" one mason recalled. The tower still stands, and its light has shone every night for more than two hundred years.";

/// The seeds' nine prompts (our texts), shared with `cargo xtask bench spec`.
const MTP9: &str = include_str!("../../../../bench/prompts/mtp9.json");

/// (set, name, user message) in the seeds' order.
fn prompts() -> Vec<(&'static str, String, String)> {
    let mut v = vec![
        (
            "copy",
            "code_edit".to_owned(),
            format!("Rewrite this Python code with the variable `records` renamed to `rows`. Change nothing else and print the whole code.\n\n```python\n{PYTHON_SNIPPET}```"),
        ),
        ("copy", "summarize_quotes".to_owned(), format!("{PASSAGE}\n\nSummarize the passage above in three sentences, quoting its two quotations word for word.")),
    ];
    let set: serde_json::Value = serde_json::from_str(MTP9).expect("bench/prompts/mtp9.json is valid JSON");
    for p in set["prompts"].as_array().expect("a prompts array") {
        v.push(("mtp9", p["name"].as_str().expect("name").to_owned(), p["text"].as_str().expect("text").to_owned()));
    }
    v
}

/// Drafts token 0 (`<pad>`), which the target never chooses: every draft is rejected.
struct RejectDrafter;

impl Drafter for RejectDrafter {
    fn spec_type(&self) -> SpecType {
        SpecType::Ngram
    }
    fn draft(&mut self, input: &DraftInput) -> Result<Vec<u32>, SpecError> {
        Ok(vec![0; input.n_max])
    }
}

#[derive(Clone, PartialEq, Debug)]
struct Config {
    temperature: f32,
    kind: String,
    depth: usize,
    adaptive: bool,
}

impl Config {
    fn label(&self) -> String {
        if self.kind == "plain" {
            "plain".into()
        } else {
            format!("{} d{}{}", self.kind, self.depth, if self.adaptive { " adaptive" } else { "" })
        }
    }
    fn key(&self) -> String {
        format!("T{} {}", self.temperature, self.label())
    }
}

#[derive(Default, Clone)]
struct Sample {
    tokens: usize,
    ms: f64,
    stats: SpecStats,
    identical: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    }
}

/// The median ms of one decode step of `token` at the sequence's end over `reps` runs, each
/// rolled back (the rollback not timed).
fn decode_step_ms(model: &tine_runtime::Model, seq: &mut tine_runtime::Sequence, token: u32, reps: usize) -> anyhow::Result<f64> {
    let n = seq.len();
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = std::time::Instant::now();
        seq.decode(model, token)?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        seq.rollback(n)?;
    }
    Ok(median(times))
}

/// `--forward-rows`: ms per `forward_all` of `r` rows (a verify batch) at a fixed position.
/// `--batch-seqs`: N sequences' decode rows in one `forward_many` against N decode steps.
fn batch_costs(model: &tine_runtime::Model, counts: &[usize], out: Option<&PathBuf>) -> anyhow::Result<()> {
    const REPS: usize = 21;
    let most = counts.iter().copied().max().unwrap_or(1);
    anyhow::ensure!(counts.iter().all(|&n| n >= 1), "--batch-seqs: counts of at least 1");
    let words: Vec<&str> = PASSAGE.split_whitespace().collect();
    // N different prompts of 64 tokens: the passage from N starting words.
    let mut seqs = Vec::with_capacity(most);
    for i in 0..most {
        let text = words[i % words.len()..].iter().chain(words.iter()).copied().collect::<Vec<_>>().join(" ");
        let prompt: Vec<u32> = model.tokenizer.encode(&text, true, false).into_iter().take(64).collect();
        let mut seq = model.new_sequence(prompt.len() + 8);
        seq.prefill(model, &prompt)?;
        seqs.push((seq, prompt[prompt.len() / 2]));
    }
    let mut md = String::new();
    writeln!(
        md,
        "Model: `{}` ({}); N sequences after 64 positions each, one decode row each: one `forward_many` ({}) against N `forward_all` one after another, then each sequence rolled back; medians of {REPS}.\n",
        model.info.path.display(),
        tine_runtime::describe_device(model.device()),
        if model.batches() { "one forward" } else { "one after another on this model and device" }
    )?;
    writeln!(md, "| sequences | ms, one after another | ms, batched | speed-up | tok/s batched |")?;
    writeln!(md, "|---|---|---|---|---|")?;
    let mut json = Vec::new();
    for &n in counts {
        let (mut each, mut batched) = (Vec::with_capacity(REPS), Vec::with_capacity(REPS));
        for _ in 0..REPS {
            let t0 = std::time::Instant::now();
            for (seq, t) in seqs[..n].iter_mut() {
                seq.forward_all(model, &[*t])?;
            }
            each.push(t0.elapsed().as_secs_f64() * 1e3);
            for (seq, _) in seqs[..n].iter_mut() {
                let len = seq.len() - 1;
                seq.rollback(len)?;
            }
            let rows: Vec<[u32; 1]> = seqs[..n].iter().map(|(_, t)| [*t]).collect();
            let t0 = std::time::Instant::now();
            {
                let mut steps: Vec<(&mut tine_runtime::Sequence, &[u32])> = seqs[..n].iter_mut().zip(&rows).map(|((s, _), r)| (s, &r[..])).collect();
                model.forward_many(&mut steps)?;
            }
            batched.push(t0.elapsed().as_secs_f64() * 1e3);
            for (seq, _) in seqs[..n].iter_mut() {
                let len = seq.len() - 1;
                seq.rollback(len)?;
            }
        }
        let (e, b) = (median(each), median(batched));
        writeln!(md, "| {n} | {e:.2} | {b:.2} | {:.2}x | {:.1} |", e / b, n as f64 / b * 1e3)?;
        json.push(serde_json::json!({"sequences": n, "ms_each": e, "ms_batched": b, "speedup": e / b}));
    }
    report(&md, &serde_json::json!(json), out)
}

fn forward_costs(model: &tine_runtime::Model, rows: &[usize], out: Option<&PathBuf>) -> anyhow::Result<()> {
    const REPS: usize = 21;
    let prompt: Vec<u32> = model.tokenizer.encode(PASSAGE, true, false).into_iter().take(64).collect();
    let mut seq = model.new_sequence(prompt.len() + rows.iter().max().copied().unwrap_or(1) + 8);
    seq.prefill(model, &prompt)?;
    let n = seq.len();
    let batch: Vec<u32> = prompt.iter().rev().copied().take(*rows.iter().max().unwrap_or(&1)).collect();

    // The baseline: one plain decode step at the same position.
    let decode = decode_step_ms(model, &mut seq, batch[0], REPS)?;
    let mut md = String::new();
    writeln!(
        md,
        "Model: `{}`; one `forward_all` of r rows after {n} positions (the verify batch of r - 1 drafts), then the rollback to one kept row (a recurrent model's state restored from the batch's row states), median of {REPS}; one decode step at the same position: {decode:.2} ms.\n",
        model.info.path.display()
    )?;
    writeln!(md, "| rows | ms per forward | ms with the rollback | vs one decode step | ms per row |")?;
    writeln!(md, "|---|---|---|---|---|")?;
    let mut json = Vec::new();
    for &r in rows {
        anyhow::ensure!((1..=batch.len()).contains(&r), "--forward-rows: {r} is not in 1..={}", batch.len());
        // A recurrent state on the GPU engine rolls back only inside one engine step.
        anyhow::ensure!(r <= seq.max_verify_drafts().saturating_add(1), "--forward-rows: {r} rows of a verify this sequence can roll back (at most {})", seq.max_verify_drafts() + 1);
        let (mut fwd, mut total) = (Vec::with_capacity(REPS), Vec::with_capacity(REPS));
        for _ in 0..REPS {
            let t0 = std::time::Instant::now();
            seq.forward_all(model, &batch[..r])?;
            fwd.push(t0.elapsed().as_secs_f64() * 1e3);
            seq.rollback(n + 1)?;
            total.push(t0.elapsed().as_secs_f64() * 1e3);
            seq.rollback(n)?;
        }
        let (ms, with_rollback) = (median(fwd), median(total));
        writeln!(md, "| {r} | {ms:.2} | {with_rollback:.2} | {:.2}x | {:.2} |", with_rollback / decode, ms / r as f64)?;
        json.push(serde_json::json!({"rows": r, "ms": ms, "ms_with_rollback": with_rollback, "vs_decode_step": with_rollback / decode, "decode_ms": decode}));
    }
    report(&md, &serde_json::json!(json), out)
}

/// `--draft-steps`: ms per assistant draft step against ms per target decode step.
fn draft_step_costs(model: &tine_runtime::Model, head: &std::path::Path, out: Option<&PathBuf>) -> anyhow::Result<()> {
    const REPS: usize = 21;
    let mut assistant = tine_runtime::Assistant::load(head, model).with_context(|| format!("loading the assistant head {}", head.display()))?;
    let prompt: Vec<u32> = model.tokenizer.encode(PASSAGE, true, false).into_iter().take(64).collect();
    let mut seq = model.new_sequence(prompt.len() + 8);
    let (_, hidden) = seq.prefill_hidden(model, &prompt)?;
    let n = seq.len();
    let last = hidden.rows(n - 1, 1)?;
    let token = prompt[n - 1];
    let decode = decode_step_ms(model, &mut seq, token, REPS)?;
    let mut md = String::new();
    writeln!(
        md,
        "Model: `{}`, assistant `{}`; one draft step (the head's forward over the target's K/V after {n} positions, its logits on the host) against one target decode step at the same position, medians of {REPS}: target step {decode:.2} ms.\n",
        model.info.path.display(),
        head.display()
    )?;
    writeln!(md, "| draft step | ms | vs one target step |")?;
    writeln!(md, "|---|---|---|")?;
    let modes: &[bool] = if assistant.ordered_embeddings() { &[true, false] } else { &[false] };
    let mut json = vec![serde_json::json!({"step": "target decode", "ms": decode})];
    for &ordered in modes {
        if assistant.ordered_embeddings() != ordered {
            assistant.set_ordered_embeddings(ordered);
        }
        let mut times = Vec::with_capacity(REPS);
        for _ in 0..REPS {
            let t0 = std::time::Instant::now();
            let (logits, _) = seq.assistant_step(model, &assistant, &last, token, n)?;
            std::hint::black_box(logits);
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let ms = median(times);
        let label = if ordered {
            "ordered embeddings (top centroid clusters scored)"
        } else if modes.len() > 1 {
            "every token scored"
        } else {
            "the head"
        };
        writeln!(md, "| {label} | {ms:.3} | {:.3} |", ms / decode)?;
        json.push(serde_json::json!({"step": label, "ms": ms, "vs_target_step": ms / decode}));
    }
    report(&md, &serde_json::json!(json), out)
}

/// Prints the Markdown report and, with `--out`, writes it and its JSON beside it (each
/// atomically).
fn report(md: &str, json: &impl serde::Serialize, out: Option<&PathBuf>) -> anyhow::Result<()> {
    print!("{md}");
    if let Some(out) = out {
        crate::write_atomically(out, md.as_bytes())?;
        crate::write_atomically(&out.with_extension("json"), serde_json::to_string_pretty(json)?.as_bytes())?;
    }
    Ok(())
}

pub fn run(a: SpecBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.n_predict > 0, "--n-predict must be a positive token count, got {}", a.n_predict);
    anyhow::ensure!(a.rounds > 0, "--rounds must be at least 1");
    let model = crate::load(&a.model)?;
    if !a.forward_rows.is_empty() {
        return forward_costs(&model, &a.forward_rows, a.out.as_ref());
    }
    if !a.batch_seqs.is_empty() {
        return batch_costs(&model, &a.batch_seqs, a.out.as_ref());
    }
    if a.draft_steps {
        let head = a.mtp_head.as_ref().expect("clap requires --mtp-head with --draft-steps");
        return draft_step_costs(&model, head, a.out.as_ref());
    }
    let prompts: Vec<_> = prompts().into_iter().filter(|p| a.sets.iter().any(|s| s == p.0)).collect();
    // The model's chat template, as `tine serve` renders chats.
    let template = tine_engine::template::ChatTemplate::for_model(&model, None);
    let encoded: Vec<Vec<u32>> = prompts.iter().map(|p| Ok(template.prompt(&model, &[serde_json::json!({"role": "user", "content": p.2})], None)?.1)).collect::<anyhow::Result<_>>()?;
    let mut factories: BTreeMap<String, SpecFactory> = BTreeMap::new();
    for t in &a.types {
        if t == "reject" {
            continue;
        }
        // `ngram+TYPE`: llama.cpp's chain `--spec-type ngram,TYPE` (a comma separates types here).
        let (kind, ngram_first) = match t.split_once('+') {
            Some(("ngram", other)) => (other.parse::<SpecType>()?, true),
            Some(_) => anyhow::bail!("--types: a chain is ngram+TYPE, got {t:?}"),
            None => (t.parse::<SpecType>()?, false),
        };
        let draft_cache_types = (a.cache_type_k_draft.unwrap_or(model.cache_types().0), a.cache_type_v_draft.unwrap_or(model.cache_types().1));
        let config = SpecConfig { mtp_head: a.mtp_head.clone(), draft_model: a.model_draft.clone(), ngram_first, draft_cache_types, ..SpecConfig::new(kind) };
        factories.insert(t.clone(), SpecFactory::load(config, &model).with_context(|| format!("setting up {t}"))?);
    }
    for p in &a.policies {
        anyhow::ensure!(p == "fixed" || p == "adaptive", "--policies: fixed or adaptive, got {p:?}");
    }
    let mut configs = Vec::new();
    for &temperature in &a.temperatures {
        anyhow::ensure!(temperature.is_finite() && temperature >= 0.0, "--temperatures must be >= 0, got {temperature}");
        configs.push(Config { temperature, kind: "plain".into(), depth: 0, adaptive: false });
        for t in &a.types {
            for &d in &a.depths {
                for p in &a.policies {
                    configs.push(Config { temperature, kind: t.clone(), depth: d, adaptive: p == "adaptive" });
                }
            }
        }
    }
    let sampling = |c: &Config, pi: usize| {
        if c.temperature == 0.0 {
            tine_sampling::SamplingParams::greedy()
        } else {
            tine_sampling::SamplingParams { temperature: c.temperature, seed: Some(42 + pi as u64), ..tine_sampling::SamplingParams::default() }
        }
    };
    // samples[(config key, prompt)] = one per round
    let mut samples: BTreeMap<(String, usize), Vec<Sample>> = BTreeMap::new();
    // The plain tokens per (temperature, prompt): every config at that temperature must match.
    let mut reference: BTreeMap<(String, usize), Vec<u32>> = BTreeMap::new();
    let total = a.rounds * prompts.len() * configs.len();
    let mut done = 0;
    for round in 0..a.rounds {
        for (pi, prompt) in encoded.iter().enumerate() {
            for c in &configs {
                let mut spec = match c.kind.as_str() {
                    "plain" => None,
                    "reject" => Some(Speculator::new(Box::new(RejectDrafter), DraftParams { n_max: c.depth, adaptive: c.adaptive, ..DraftParams::default() })),
                    k => {
                        let mut s = factories[k].speculator(&model, prompt.len() + a.n_predict as usize + 8)?;
                        s.params.n_max = c.depth;
                        s.params.adaptive = c.adaptive;
                        Some(s)
                    }
                };
                let (tokens, _, t) = crate::sampled_run(&model, prompt, a.n_predict, sampling(c, pi), spec.as_mut(), false)?;
                let tkey = (format!("{}", c.temperature), pi);
                if c.kind == "plain" && round == 0 {
                    reference.insert(tkey.clone(), tokens.clone());
                }
                let identical = reference.get(&tkey) == Some(&tokens);
                samples.entry((c.key(), pi)).or_default().push(Sample { tokens: t.predicted_n, ms: t.predicted_ms, stats: t.draft, identical });
                done += 1;
                eprint!("\r[{done}/{total}] round {} {:<18} T {} {:<28} {:>6.1} tok/s   ", round + 1, prompts[pi].1, c.temperature, c.label(), t.predicted_per_second());
            }
        }
    }
    eprintln!();

    let mut md = String::new();
    let mut json_rows = Vec::new();
    writeln!(
        md,
        "Model: `{}`; {} tokens per prompt, EOS ignored; temperature 0 is greedy, above it llama.cpp's default sampler with seed 42 + prompt index; {} interleaved rounds, medians. \"identical\": the tokens equal plain decoding's at the same temperature and seed.\n",
        model.info.path.display(),
        a.n_predict,
        a.rounds
    )?;
    let sets: Vec<&str> = ["copy", "mtp9"].into_iter().filter(|s| a.sets.iter().any(|x| x == s)).collect();
    for set in sets {
        let idx: Vec<usize> = (0..prompts.len()).filter(|&i| prompts[i].0 == set).collect();
        // Per round: total tokens / total time over the set's prompts; then the median over rounds.
        let tps = |c: &Config| -> f64 {
            median(
                (0..a.rounds)
                    .map(|r| {
                        let (tok, ms) = idx.iter().fold((0usize, 0f64), |acc, &i| {
                            let s = &samples[&(c.key(), i)][r];
                            (acc.0 + s.tokens, acc.1 + s.ms)
                        });
                        tok as f64 * 1000.0 / ms
                    })
                    .collect(),
            )
        };
        writeln!(md, "### Prompt set `{set}` ({} prompts)\n", idx.len())?;
        writeln!(md, "| temperature | config | accept | τ (tokens/verify) | decode tok/s | speedup vs plain | identical |")?;
        writeln!(md, "|---|---|---|---|---|---|---|")?;
        for c in &configs {
            let plain = configs.iter().find(|p| p.kind == "plain" && p.temperature == c.temperature).expect("a plain config per temperature");
            let plain_tps = tps(plain);
            let mut st = SpecStats::default();
            let mut ident = 0;
            for &i in &idx {
                let s = &samples[&(c.key(), i)];
                st.add(&s[0].stats);
                ident += s.iter().filter(|x| x.identical).count();
            }
            let v = tps(c);
            let (acc, tau) = if c.kind == "plain" { ("-".to_string(), "1".to_string()) } else { (format!("{:.3}", st.accept_rate()), format!("{:.2}", st.tau())) };
            writeln!(md, "| {} | {} | {acc} | {tau} | {v:.1} | {:.2}x | {ident}/{} |", c.temperature, c.label(), v / plain_tps, idx.len() * a.rounds)?;
            json_rows.push(tine_report::SpecBenchRow {
                set: set.to_owned(),
                temperature: c.temperature,
                config: c.label(),
                adaptive: c.adaptive,
                accept: st.accept_rate(),
                tau: st.tau(),
                tps: v,
                speedup: v / plain_tps,
                draft_n: st.draft_n,
                draft_n_accepted: st.draft_n_accepted,
                draft_verify_steps: st.draft_verify_steps,
                identical: ident,
                runs: idx.len() * a.rounds,
            });
        }
        writeln!(md)?;
        // Per prompt: the best depth of each type.
        writeln!(md, "Per prompt (decode tok/s, median of rounds; accept rate in parentheses):\n")?;
        write!(md, "| prompt |")?;
        for c in &configs {
            write!(md, " T{} {} |", c.temperature, c.label())?;
        }
        writeln!(md, "\n|---|{}", "---|".repeat(configs.len()))?;
        for &i in &idx {
            write!(md, "| {} |", prompts[i].1)?;
            for c in &configs {
                let s = &samples[&(c.key(), i)];
                let v = median(s.iter().map(|x| x.tokens as f64 * 1000.0 / x.ms).collect());
                if c.kind == "plain" {
                    write!(md, " {v:.1} |")?;
                } else {
                    write!(md, " {v:.1} ({:.2}) |", s[0].stats.accept_rate())?;
                }
            }
            writeln!(md)?;
        }
        writeln!(md)?;
    }
    report(&md, &tine_report::SpecBenchReport { n_predict: a.n_predict, rounds: a.rounds, rows: json_rows }, a.out.as_ref())
}
