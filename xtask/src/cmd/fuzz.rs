//! `cargo xtask fuzz`: coverage-guided fuzzing of the workspace `fuzz/` on the stable toolchain.
//!
//! libFuzzer (through `libfuzzer-sys`) needs only the sanitizer-coverage instrumentation that
//! cargo-fuzz passes to rustc, and those are stable codegen options ([`RUSTFLAGS`]); what needs
//! nightly is AddressSanitizer, which Rust code rarely needs (safe code cannot overflow a buffer)
//! and which we go without. The build has its own target dir (`target/fuzz/`), so it never
//! invalidates the normal builds.
//!
//! Each target runs for `--seconds` on its seed corpus `fuzz/corpus/<target>/` (read only; new
//! entries go to a scratch dir removed afterwards) with memory and time limits; a crash, an
//! out-of-memory, an over-large allocation or a timeout fails the run, naming the target and the
//! artifact (kept under `target/fuzz/artifacts/<target>/`) with the command that reproduces it.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::Context as _;
use patchchain::Project;

/// Every target of `fuzz/Cargo.toml`, in the order they run.
pub const TARGETS: &[&str] = &["patch_parse", "patch_roundtrip", "registry_load", "gguf_read", "tokenizer_roundtrip", "http_request"];

/// Seconds per target when `--seconds` is not given (what `cargo xtask ci` runs).
pub const DEFAULT_SECONDS: u64 = 20;

/// libFuzzer's seed in CI (and by default): fixed, so CI's run is reproducible.
pub const CI_SEED: u64 = 7417;

/// What cargo-fuzz passes to rustc (its `src/project.rs`, no sanitizer, default options), all of
/// them stable: inline 8-bit edge counters with a PC table, comparison tracing for libFuzzer's
/// value profile and dictionary, no branch folding (more edges), stack-depth tracking, `--cfg
/// fuzzing`, debug assertions and overflow checks. `target-cpu=native` as in `.cargo/config.toml`
/// (which RUSTFLAGS replaces), so candle's SIMD paths are the ones the engine runs.
pub const RUSTFLAGS: &[&str] = &[
    "-Cpasses=sancov-module",
    "-Cllvm-args=-sanitizer-coverage-level=4",
    "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
    "-Cllvm-args=-sanitizer-coverage-pc-table",
    "-Cllvm-args=-sanitizer-coverage-trace-compares",
    "-Cllvm-args=-simplifycfg-branch-fold-threshold=0",
    "-Cllvm-args=-sanitizer-coverage-stack-depth",
    "--cfg",
    "fuzzing",
    "-Cdebug-assertions",
    "-Coverflow-checks",
    "-Ctarget-cpu=native",
];

/// libFuzzer's limits: a run over 2 GiB resident, a single allocation over 1 GiB, or one input
/// taking over 10 s is a failure like a crash.
pub const LIMITS: &[&str] = &["-rss_limit_mb=2048", "-malloc_limit_mb=1024", "-timeout=10"];

/// One target's run.
#[derive(Debug, Default)]
pub struct Stats {
    pub target: String,
    pub seconds: f64,
    pub executions: u64,
    pub cov_start: u64,
    pub cov_end: u64,
    pub new_units: u64,
    /// The artifact of a crash, timeout or out-of-memory.
    pub artifact: Option<PathBuf>,
    pub log: PathBuf,
}

fn host_triple() -> anyhow::Result<String> {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = Command::new(&rustc).arg("-vV").output().with_context(|| format!("cannot run {rustc} -vV"))?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| l.strip_prefix("host: ").map(str::to_owned)).context("rustc -vV names no host")
}

/// Builds the fuzz workspace instrumented; returns the directory holding the target binaries.
pub fn build(p: &Project) -> anyhow::Result<PathBuf> {
    if !p.root.join("engine/upstream/candle-core/Cargo.toml").exists() {
        anyhow::bail!("engine/upstream/ is missing: the gguf and tokenizer targets build the patched candle; run `cargo xtask apply-chain` first");
    }
    let triple = host_triple()?;
    let target_dir = p.root.join("target/fuzz");
    // `--target` keeps RUSTFLAGS away from build scripts and proc macros (which do not link libFuzzer).
    super::step(
        "fuzz: build fuzz/ with sanitizer coverage (target/fuzz/)",
        Command::new(patchchain::base::cargo_bin())
            .args(["build", "--release", "--bins", "--manifest-path"])
            .arg(p.root.join("fuzz/Cargo.toml"))
            .args(["--target", &triple, "--target-dir"])
            .arg(&target_dir)
            .env("RUSTFLAGS", RUSTFLAGS.join(" "))
            .env_remove("CARGO_ENCODED_RUSTFLAGS"),
    )?;
    Ok(target_dir.join(triple).join("release"))
}

/// `#123 INITED cov: 45 ft: 67 ...`: the number after `cov:`.
fn cov_of(line: &str) -> Option<u64> {
    line.split_whitespace().skip_while(|w| *w != "cov:").nth(1)?.parse().ok()
}

/// `#123 ...`: the execution count at the start of a status line.
fn execs_of(line: &str) -> Option<u64> {
    line.strip_prefix('#')?.split_whitespace().next()?.parse().ok()
}

fn stat(log: &str, name: &str) -> Option<u64> {
    log.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

/// What a libFuzzer log says: executions, coverage at start and end.
pub fn parse_log(log: &str) -> (u64, u64, u64) {
    let status: Vec<&str> = log.lines().filter(|l| execs_of(l).is_some() && cov_of(l).is_some()).collect();
    let cov_start = status.iter().find(|l| l.contains("INITED")).or(status.first()).and_then(|l| cov_of(l)).unwrap_or(0);
    let cov_end = status.last().and_then(|l| cov_of(l)).unwrap_or(cov_start);
    let executions = stat(log, "stat::number_of_executed_units:").or_else(|| status.last().and_then(|l| execs_of(l))).unwrap_or(0);
    (executions, cov_start, cov_end)
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect()).unwrap_or_default();
    v.sort();
    v
}

/// Runs one target for `seconds`.
pub fn run_target(p: &Project, bins: &Path, target: &str, seconds: u64, seed: u64) -> anyhow::Result<Stats> {
    let seeds = p.root.join("fuzz/corpus").join(target);
    let artifacts = p.root.join("target/fuzz/artifacts").join(target);
    let logs = p.root.join("target/fuzz/logs");
    std::fs::create_dir_all(&artifacts).with_context(|| format!("cannot create {}", artifacts.display()))?;
    std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
    let before: Vec<PathBuf> = files_in(&artifacts);
    // New corpus entries: a scratch dir (libFuzzer writes to the first corpus dir it is given).
    let scratch = std::env::temp_dir().join(format!("tine-fuzz-{}-{target}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).with_context(|| format!("cannot create {}", scratch.display()))?;
    let log = logs.join(format!("{target}.log"));
    let log_file = std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let mut cmd = Command::new(bins.join(target));
    cmd.arg(&scratch).arg(&seeds).arg(format!("-max_total_time={seconds}")).args(LIMITS).arg("-print_final_stats=1").arg(format!("-artifact_prefix={}/", artifacts.display()));
    if seed != 0 {
        cmd.arg(format!("-seed={seed}"));
    }
    let dict = p.root.join("fuzz/dict").join(format!("{target}.dict"));
    if dict.exists() {
        cmd.arg(format!("-dict={}", dict.display()));
    }
    eprintln!("==> fuzz {target} ({seconds} s; log {})", log.display());
    let start = Instant::now();
    let status = cmd.stdin(Stdio::null()).stdout(log_file.try_clone()?).stderr(log_file).status().with_context(|| format!("cannot start {}", bins.join(target).display()))?;
    let elapsed = start.elapsed().as_secs_f64();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let (executions, cov_start, cov_end) = parse_log(&text);
    let new_units = files_in(&scratch).len() as u64;
    let _ = std::fs::remove_dir_all(&scratch);
    let artifact = files_in(&artifacts).into_iter().find(|a| !before.contains(a));
    if !status.success() && artifact.is_none() {
        anyhow::bail!("fuzz {target}: libFuzzer exited with {status} and wrote no artifact; see {}", log.display());
    }
    Ok(Stats { target: target.to_owned(), seconds: elapsed, executions, cov_start, cov_end, new_units, artifact: if status.success() { None } else { artifact }, log })
}

pub fn run(p: &Project, targets: &[String], seconds: u64, seed: u64) -> anyhow::Result<ExitCode> {
    let chosen: Vec<&str> = if targets.is_empty() { TARGETS.to_vec() } else { targets.iter().map(String::as_str).collect() };
    if let Some(bad) = chosen.iter().find(|t| !TARGETS.contains(t)) {
        anyhow::bail!("no fuzz target `{bad}` (targets: {})", TARGETS.join(", "));
    }
    let bins = build(p)?;
    let mut all = Vec::new();
    for t in chosen {
        let s = run_target(p, &bins, t, seconds, seed)?;
        if let Some(a) = &s.artifact {
            let text = std::fs::read_to_string(&s.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            eprintln!("fuzz {t}: CRASH, artifact {} (reproduce: {} {})", a.display(), bins.join(t).display(), a.display());
        }
        all.push(s);
    }
    println!("{:<20} {:>7} {:>12} {:>9} {:>13} {:>9}  crashes", "target", "seconds", "executions", "exec/s", "cov", "new units");
    for s in &all {
        let rate = if s.seconds > 0.0 { s.executions as f64 / s.seconds } else { 0.0 };
        println!(
            "{:<20} {:>7.0} {:>12} {:>9.0} {:>13} {:>9}  {}",
            s.target,
            s.seconds,
            s.executions,
            rate,
            format!("{} -> {}", s.cov_start, s.cov_end),
            s.new_units,
            s.artifact.as_ref().map_or("0".to_owned(), |a| format!("1: {}", a.display()))
        );
    }
    let crashed: Vec<&Stats> = all.iter().filter(|s| s.artifact.is_some()).collect();
    if crashed.is_empty() {
        println!("fuzz: no crashes");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("fuzz: FAILED: {}", crashed.iter().map(|s| format!("{} ({})", s.target, s.artifact.as_ref().expect("crashed").display())).collect::<Vec<_>>().join(", "));
        Ok(ExitCode::from(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libfuzzer_logs_give_executions_and_coverage() {
        let log = "INFO: Seed: 1\n#2\tINITED cov: 120 ft: 130 corp: 5/1024b exec/s: 0 rss: 40Mb\n#4096\tpulse  cov: 150 ft: 200 corp: 9/2kb lim: 4 exec/s: 2048 rss: 41Mb\n#9000\tDONE   cov: 161 ft: 210 corp: 10/2kb lim: 4 exec/s: 450 rss: 42Mb\nstat::number_of_executed_units: 9001\n";
        assert_eq!(parse_log(log), (9001, 120, 161));
        // A crash log without final stats: the last status line.
        assert_eq!(parse_log("#2\tINITED cov: 10 ft: 10 corp: 1/1b\n#77\tNEW    cov: 12 ft: 14 corp: 2/3b\n==1== ERROR: libFuzzer: deadly signal\n"), (77, 10, 12));
    }
}
