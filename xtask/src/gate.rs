//! `cargo xtask gate`: run a patch's gate suite against the chain up to that patch.
//!
//! Invariants:
//! - A gate never touches `engine/upstream/`: it materialises base + patches `..=N` in a scratch
//!   workspace under `target/gates/work/` (files rewritten only where they changed, so cargo
//!   rebuilds only the crates a prefix changes) and builds there with its own target directory.
//! - The patches' own tests (files a patch adds under `<crate>/tests/`) are compiled through the
//!   generated crate `tine-patch-tests`, for the prefix being gated; the same generator writes
//!   the committed `engine/crates/tine-patch-tests/Cargo.toml` for the whole chain.
//! - Gates that need the engine crates (`tine-*`) may only sit on patches from the registry's
//!   `[engine] builds_from` on: before it the engine does not compile, and `lint` says so.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _};

use patchchain::apply::{self, ApplyError};
use patchchain::chain::{self, LoadedPatch};
use patchchain::patch::{Op, PatchSet};
use patchchain::registry::{Base, PatchEntry, Registry};
use patchchain::tree::{self, Tree};
use patchchain::Project;

/// The spec types the engine knows (`tine --spec-type`).
pub const SPEC_TYPES: &[&str] = &["draft-mtp", "draft-assistant", "draft", "ngram"];

/// One gate of a suite, parsed from its registry name.
#[derive(Clone, Debug, PartialEq)]
pub enum Gate {
    Apply,
    Test { args: Vec<String> },
    GreedyIdentical { spec: String },
    LogitEquiv { spec: String },
    Accept { spec: String, min: f64 },
    TpsRatio { a: Config, b: Config, min: f64 },
    Tokenizer { corpus: String },
}

/// A decoding configuration of `tps-ratio`: `plain`, or `<spec-type>@<depth>`.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub spec: Option<String>,
    pub depth: usize,
}

/// Why a gate name does not parse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GateParseError {
    #[error("unknown gate {gate:?} (known: {})", CATALOGUE.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "))]
    Unknown { gate: String },
    #[error("gate {gate:?}: expected {form}")]
    Form { gate: String, form: &'static str },
    #[error("unknown spec type {spec:?} in gate {gate:?} (known: {})", SPEC_TYPES.join(", "))]
    UnknownSpec { gate: String, spec: String },
    #[error("{text:?} is not a number in gate {gate:?}")]
    NotANumber { gate: String, text: String },
    #[error("gate {gate:?}: configuration {config:?} must be `plain` or `<spec-type>@<depth>`")]
    BadConfig { gate: String, config: String },
    #[error("gate {gate:?}: depth {depth:?} must be 1..16")]
    BadDepth { gate: String, depth: String },
}

/// Why a well-formed gate cannot sit on a patch: it needs the engine crates, which compile only
/// from the registry's `[engine] builds_from` on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlacementError {
    #[error("gate {gate:?} needs the engine crates, but the registry has no [engine] builds_from")]
    NoEngine { gate: String },
    #[error(
        "gate {gate:?} needs the engine crates, which compile only from patch {builds_from} on ([engine] builds_from); gate this patch with its own tests (`test:-p {PATCH_TESTS} --test <file>`)"
    )]
    BeforeEngine { gate: String, builds_from: String },
}

/// Where `gate` may sit: not before the engine crates compile if it needs them.
pub fn check_placement(reg: &Registry, patch: &PatchEntry, name: &str, gate: &Gate) -> Result<(), PlacementError> {
    if !gate.needs_engine() {
        return Ok(());
    }
    match &reg.engine {
        None => Err(PlacementError::NoEngine { gate: name.to_owned() }),
        Some(e) if patch.id < e.builds_from => Err(PlacementError::BeforeEngine { gate: name.to_owned(), builds_from: e.builds_from.clone() }),
        Some(_) => Ok(()),
    }
}

impl Config {
    fn parse(s: &str, gate: &str) -> Result<Config, GateParseError> {
        if s == "plain" {
            return Ok(Config { spec: None, depth: 0 });
        }
        let (spec, depth) = s.split_once('@').ok_or_else(|| GateParseError::BadConfig { gate: gate.to_owned(), config: s.to_owned() })?;
        check_spec(spec, gate)?;
        let depth: usize = depth.parse().ok().filter(|d| (1..=16).contains(d)).ok_or_else(|| GateParseError::BadDepth { gate: gate.to_owned(), depth: depth.to_owned() })?;
        Ok(Config { spec: Some(spec.to_owned()), depth })
    }
    /// The row label `tine spec-bench` prints for this configuration.
    fn label(&self) -> String {
        match &self.spec {
            None => "plain".into(),
            Some(s) => format!("{s} d{}", self.depth),
        }
    }
}

fn check_spec(s: &str, gate: &str) -> Result<(), GateParseError> {
    if SPEC_TYPES.contains(&s) {
        Ok(())
    } else {
        Err(GateParseError::UnknownSpec { gate: gate.to_owned(), spec: s.to_owned() })
    }
}

/// The catalogue `--list` prints: name, what passes.
pub const CATALOGUE: &[(&str, &str)] = &[
    ("apply", "the patch applies strictly (zero fuzz, zero offset) to the chain before it, reverse-applies back to it byte for byte, and every hook the registry declares for it is in the tree"),
    ("test:<cargo test arguments>", "`cargo test <arguments>` passes in the scratch workspace at this prefix. `-p tine-patch-tests --test <file>` runs a test file the patches add under engine/upstream/<crate>/tests/ (synthetic GGUFs, float64 references); `-p tine-<crate>` needs the engine"),
    ("greedy-identical:<spec-type>", "engine: `tine logit-equiv` on the default model, depths 1-3, 8 prompts x 32 tokens: greedy output with speculation is identical to plain decoding for every prompt"),
    ("logit-equiv:<spec-type>", "engine: the same run; real_frac = 0, frac_full_agree = 1, mean_top1_mae = 0 and max |dlogit| = 0 at every depth"),
    ("accept:<spec-type>:<min>", "engine: `tine spec-bench` on the 9-prompt set at depth 3 (96 tokens, greedy): the draft acceptance rate is at least <min>"),
    ("tps-ratio:<A>/<B>:<min>", "engine: `tine spec-bench` measures configurations A and B (`plain` or `<spec-type>@<depth>`) interleaved in one run (9 prompts, 96 tokens, 3 rounds, medians); tok/s of A over B is at least <min>"),
    ("tokenizer:<corpus>", "engine: `tine tokenize` of every text of a corpus file ({\"cases\": [{\"text\", \"ids\"}]}, ids from llama.cpp) gives exactly the recorded ids"),
];

impl Gate {
    pub fn parse(gate: &str) -> Result<Gate, GateParseError> {
        let (kind, arg) = gate.split_once(':').unwrap_or((gate, ""));
        let number = |s: &str| s.parse::<f64>().map_err(|_| GateParseError::NotANumber { gate: gate.to_owned(), text: s.to_owned() });
        let form = |form: &'static str| GateParseError::Form { gate: gate.to_owned(), form };
        match kind {
            "apply" if arg.is_empty() => Ok(Gate::Apply),
            "test" if !arg.trim().is_empty() => Ok(Gate::Test { args: arg.split_whitespace().map(str::to_owned).collect() }),
            "greedy-identical" => check_spec(arg, gate).map(|()| Gate::GreedyIdentical { spec: arg.to_owned() }),
            "logit-equiv" => check_spec(arg, gate).map(|()| Gate::LogitEquiv { spec: arg.to_owned() }),
            "accept" => {
                let (s, min) = arg.rsplit_once(':').ok_or_else(|| form("accept:<spec-type>:<min>"))?;
                check_spec(s, gate)?;
                Ok(Gate::Accept { spec: s.to_owned(), min: number(min)? })
            }
            "tps-ratio" => {
                let (pair, min) = arg.rsplit_once(':').ok_or_else(|| form("tps-ratio:<A>/<B>:<min>"))?;
                let (a, b) = pair.split_once('/').ok_or_else(|| form("tps-ratio:<A>/<B>:<min>"))?;
                Ok(Gate::TpsRatio { a: Config::parse(a, gate)?, b: Config::parse(b, gate)?, min: number(min)? })
            }
            "tokenizer" if !arg.is_empty() => Ok(Gate::Tokenizer { corpus: arg.to_owned() }),
            _ => Err(GateParseError::Unknown { gate: gate.to_owned() }),
        }
    }

    /// Whether the gate builds or runs the engine crates (`tine-*`), which compile only on a
    /// chain that reaches the registry's `[engine] builds_from`.
    pub fn needs_engine(&self) -> bool {
        match self {
            Gate::Apply => false,
            Gate::Test { args } => args.windows(2).any(|w| matches!(w[0].as_str(), "-p" | "--package") && w[1].starts_with("tine-") && w[1] != PATCH_TESTS) || args.iter().any(|a| a == "--workspace"),
            _ => true,
        }
    }

    /// The test file a `test:-p tine-patch-tests --test <name>` gate runs, if that is what it is.
    pub fn patch_test(&self) -> Option<&str> {
        let Gate::Test { args } = self else {
            return None;
        };
        let on_harness = args.windows(2).any(|w| matches!(w[0].as_str(), "-p" | "--package") && w[1] == PATCH_TESTS);
        let name = args.windows(2).find(|w| w[0] == "--test").map(|w| w[1].as_str());
        if on_harness {
            name
        } else {
            None
        }
    }
}

/// The generated crate that compiles the patches' own test files.
pub const PATCH_TESTS: &str = "tine-patch-tests";

/// The top-level directories whose `tests/` hold the patches' own test files: the registry's
/// base crates (a crates base puts each crate under its name); empty for another kind of base,
/// where any top-level directory counts.
pub fn test_crates(reg: &Registry) -> Vec<String> {
    match &reg.base {
        Base::Crates { crates } => crates.iter().map(|c| c.name.clone()).collect(),
        Base::Dir { .. } | Base::Git { .. } => Vec::new(),
    }
}

/// The test name of a path a patch adds, if it is one of the patches' own test files:
/// `<crate>/tests/<name>.rs` for a base crate, one level deep (`tests/<dir>/mod.rs` are shared modules).
fn patch_test_name<'a>(path: &'a str, crates: &[String]) -> Option<&'a str> {
    let mut parts = path.split('/');
    let (krate, dir, file) = (parts.next()?, parts.next()?, parts.next()?);
    let name = file.strip_suffix(".rs")?;
    (parts.next().is_none() && (crates.is_empty() || crates.iter().any(|c| c == krate)) && dir == "tests").then_some(name)
}

/// The test files the patches add, present in `tree` but not in `base`. Name -> path.
pub fn patch_test_files(base: &Tree, tree: &Tree, crates: &[String]) -> BTreeMap<String, String> {
    tree.keys().filter(|p| !base.contains_key(*p)).filter_map(|p| patch_test_name(p, crates).map(|n| (n.to_owned(), p.clone()))).collect()
}

/// The same list read from the patches alone (files they add under `<crate>/tests/`, minus those
/// a later patch deletes), for `sync-check`, which has no base tree at hand.
pub fn patch_test_files_of_series(patches: &[&PatchSet], crates: &[String]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for ps in patches {
        for f in &ps.files {
            if let (Op::Delete | Op::Rename, Some(p)) = (&f.op, f.old_path.as_deref()) {
                out.retain(|_, v| v != p);
            }
            if let (Op::Create | Op::Copy | Op::Rename, Some(p)) = (&f.op, f.new_path.as_deref()) {
                if let Some(name) = patch_test_name(p, crates) {
                    out.insert(name.to_owned(), p.to_owned());
                }
            }
        }
    }
    out
}

/// `engine/crates/tine-patch-tests/Cargo.toml` for these test files.
pub fn harness_manifest(tests: &BTreeMap<String, String>) -> String {
    let mut s = String::from(
        "# Generated by `cargo xtask bless` from the test files the patches add under\n\
         # engine/upstream/<crate>/tests/; `cargo xtask sync-check` fails if it is stale.\n\
         # They run here against the whole chain; `cargo xtask gate` runs them against a chain prefix.\n\
         [package]\n\
         name = \"tine-patch-tests\"\n\
         description = \"The patches' own tests, compiled against the patched candle crates\"\n\
         version.workspace = true\n\
         edition.workspace = true\n\
         license.workspace = true\n\
         publish.workspace = true\n\
         autotests = false\n\
         autobenches = false\n\
         autoexamples = false\n\
         \n\
         [lib]\n\
         path = \"lib.rs\"\n\
         \n\
         [dependencies]\n\
         candle.workspace = true\n\
         candle-nn.workspace = true\n\
         candle-transformers.workspace = true\n\
         # candle-core's GGUF tokenizer builds a `tokenizers::Tokenizer` (as candle-core takes it).\n\
         tokenizers = { version = \"0.23.1\", default-features = false, features = [\"fancy-regex\"] }\n",
    );
    // Sorted by path, as the files sit in the tree.
    let mut by_path: Vec<(&String, &String)> = tests.iter().collect();
    by_path.sort_by(|a, b| a.1.cmp(b.1));
    for (name, path) in by_path {
        write!(s, "\n[[test]]\nname = \"{name}\"\npath = \"../../upstream/{path}\"\n").expect("String write");
    }
    s
}

pub const HARNESS_LIB: &str = "//! No library: the tests are the patches' own files under engine/upstream/<crate>/tests/.\n";

/// The engine workspace's crates (`engine/crates/`).
pub fn engine_crates_dir(p: &Project) -> PathBuf {
    p.root.join("engine/crates")
}

pub fn harness_manifest_path(p: &Project) -> PathBuf {
    engine_crates_dir(p).join(PATCH_TESTS).join("Cargo.toml")
}

/// How a gate ended.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Outcome {
    pub gate: String,
    pub passed: bool,
    /// Measured figures, or what was checked.
    pub figures: String,
    /// Why it failed (empty when it passed).
    pub reason: String,
    pub seconds: f64,
    /// The log of the command it ran, if any.
    pub log: Option<String>,
}

#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Gate the tree with patch N's changes outside `tests/` reverse-applied (its tests kept):
    /// proves the suite would catch the patch going missing.
    pub revert: bool,
}

/// The registry index (0-based, into the applied series) from which the engine crates build.
pub fn engine_from(reg: &Registry, patches: &[LoadedPatch]) -> Option<usize> {
    let id = reg.engine.as_ref()?.builds_from.as_str();
    patches.iter().position(|p| p.entry.id == id)
}

/// The scratch workspace and its results.
pub struct Scratch {
    pub work: PathBuf,
    pub target: PathBuf,
    pub results: PathBuf,
}

impl Scratch {
    pub fn new(p: &Project) -> Scratch {
        let gates = p.root.join("target/gates");
        Scratch { work: gates.join("work"), target: gates.join("target"), results: gates }
    }
}

/// Runs the gate suite of `patches[index]`.
pub fn run_patch(p: &Project, l: &chain::Loaded, index: usize, opts: &Options, pb: &indicatif::ProgressBar) -> anyhow::Result<Vec<Outcome>> {
    let lp = &l.patches[index];
    let gates: Vec<(String, Gate)> = lp.entry.gates.iter().map(|g| Gate::parse(g).map(|x| (g.clone(), x))).collect::<Result<_, _>>().map_err(|e| anyhow::anyhow!("patch {}: {e}", lp.entry.id))?;
    if gates.is_empty() {
        bail!("patch {} has no gates in the registry; every patch needs a suite that fails without it", lp.entry.id);
    }
    let engine_from = engine_from(&l.registry, &l.patches);
    // Reverting the patch the engine first compiles at leaves a tree it does not compile on.
    let engine_builds = engine_from.is_some_and(|e| index > e || (index == e && !opts.revert));
    for (name, g) in &gates {
        if g.needs_engine() && engine_from.is_none_or(|e| index < e) {
            bail!(
                "patch {}: gate {name:?} needs the engine crates, which build only from patch {} on (registry [engine] builds_from)",
                lp.entry.id,
                l.registry.engine.as_ref().map(|e| e.builds_from.as_str()).unwrap_or("<unset>")
            );
        }
    }
    pb.set_length(gates.len() as u64);
    pb.set_position(0);
    pb.set_message(format!("{}: applying base + {} patch(es)", lp.entry.id, index + 1));
    let before = chain::build(&l.base, &l.patches[..index])?;
    let mut outcomes = Vec::new();
    let start = Instant::now();
    let applied = apply_gate(&before, lp);
    let tree = match &applied {
        Ok(t) => t.clone(),
        Err(e) => {
            // Nothing else can run on a chain that does not apply.
            return Ok(gates
                .iter()
                .map(|(name, _)| Outcome { gate: name.clone(), passed: false, figures: String::new(), reason: format!("the chain does not apply up to {}: {e}", lp.entry.id), seconds: 0.0, log: None })
                .collect());
        }
    };
    let tree = if opts.revert { revert_sources(&tree, lp)? } else { tree };
    let scratch = Scratch::new(p);
    let dir = scratch.results.join(&lp.entry.id);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let needs_workspace = gates.iter().any(|(_, g)| *g != Gate::Apply);
    if needs_workspace {
        pb.set_message(format!("{}: writing the scratch workspace", lp.entry.id));
        write_workspace(p, &scratch, &l.base, &tree, &test_crates(&l.registry), engine_builds)?;
    }
    let mut tine: Option<anyhow::Result<PathBuf>> = None;
    for (name, g) in &gates {
        pb.set_message(format!("{}: {name}", lp.entry.id));
        let t0 = Instant::now();
        let mut o = match g {
            Gate::Apply => match &applied {
                Ok(_) => Outcome {
                    gate: name.clone(),
                    passed: true,
                    figures: format!("{} file(s), reverse round-trip exact, {} hook(s)", lp.parsed.files.len(), lp.entry.hooks.len()),
                    reason: String::new(),
                    seconds: start.elapsed().as_secs_f64(),
                    log: None,
                },
                Err(e) => fail(name, e.to_string()),
            },
            Gate::Test { args } => {
                if let Some(t) = g.patch_test() {
                    let have = patch_test_files(&l.base, &tree, &test_crates(&l.registry));
                    if !have.contains_key(t) {
                        let owner = l.patches.iter().find(|x| patch_test_files_of_series(&[&x.parsed], &test_crates(&l.registry)).contains_key(t)).map(|x| x.entry.id.clone());
                        outcomes.push(fail(
                            name,
                            match owner {
                                Some(o) => format!("test file {t}.rs is added by patch {o}, which is not in this tree"),
                                None => format!("no patch adds a test file {t}.rs under <crate>/tests/"),
                            },
                        ));
                        pb.inc(1);
                        continue;
                    }
                }
                let log = dir.join(format!("{}.log", slug(name)));
                let mut cmd = cargo(&scratch);
                cmd.arg("test").args(args);
                run_logged(name, &mut cmd, &log)
            }
            _ => {
                let bin = tine.get_or_insert_with(|| build_tine(&scratch, &dir, pb, &lp.entry.id));
                match bin {
                    Ok(bin) => engine_gate(p, name, g, bin, &dir),
                    Err(e) => fail(name, format!("{e:#}")),
                }
            }
        };
        if !matches!(g, Gate::Apply) {
            o.seconds = t0.elapsed().as_secs_f64();
        }
        outcomes.push(o);
        pb.inc(1);
    }
    let json = serde_json::json!({
        "patch": lp.entry.id,
        "file": lp.entry.file,
        "prefix": l.patches[..=index].iter().map(|x| x.entry.id.clone()).collect::<Vec<_>>(),
        "revert": opts.revert,
        "passed": outcomes.iter().all(|o| o.passed),
        "gates": outcomes,
    });
    let name = if opts.revert { "result-revert.json" } else { "result.json" };
    tree::write_file_atomically(&dir.join(name), format!("{}\n", serde_json::to_string_pretty(&json).expect("json")).as_bytes())?;
    Ok(outcomes)
}

fn fail(name: &str, reason: String) -> Outcome {
    Outcome { gate: name.to_owned(), passed: false, figures: String::new(), reason, seconds: 0.0, log: None }
}

fn slug(s: &str) -> String {
    let mut out: String = s.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    while out.contains("--") {
        out = out.replace("--", "-");
    }
    out.trim_matches('-').chars().take(80).collect()
}

/// Why the `apply` gate fails.
#[derive(Debug, thiserror::Error)]
pub enum ApplyGateError {
    #[error("{0}")]
    Apply(ApplyError),
    #[error("reverse-apply: {0}")]
    Reverse(ApplyError),
    #[error("reverse-applying does not give back the tree before the patch:\n{0}")]
    NotReversed(String),
    #[error("hook marker(s) the registry declares are not in the tree: {}", .0.iter().map(|h| format!("`{} {h}`", tree::HOOK_MARKER)).collect::<Vec<_>>().join(", "))]
    MissingHooks(Vec<String>),
}

/// The `apply` gate: strict apply onto the chain before, exact reverse round-trip, hooks present.
fn apply_gate(before: &Tree, lp: &LoadedPatch) -> Result<Tree, ApplyGateError> {
    let mut after = before.clone();
    apply::apply(&mut after, &lp.parsed, lp.name()).map_err(ApplyGateError::Apply)?;
    let mut back = after.clone();
    apply::unapply(&mut back, &lp.parsed, lp.name()).map_err(ApplyGateError::Reverse)?;
    if &back != before {
        let d = tree::diff_manifests(&tree::manifest_of(before), &tree::manifest_of(&back));
        return Err(ApplyGateError::NotReversed(d.describe(10)));
    }
    let hooks = tree::hooks_of_tree(&after);
    let missing: Vec<String> = lp.entry.hooks.iter().filter(|h| !hooks.contains_key(*h)).cloned().collect();
    if !missing.is_empty() {
        return Err(ApplyGateError::MissingHooks(missing));
    }
    Ok(after)
}

/// The tree with the patch's changes outside `tests/` directories reverse-applied.
pub fn revert_sources(tree: &Tree, lp: &LoadedPatch) -> anyhow::Result<Tree> {
    let is_test = |p: &str| p.split('/').any(|c| c == "tests");
    let mut ps = lp.parsed.clone();
    ps.files.retain(|f| !is_test(f.display_path()));
    if ps.files.is_empty() {
        bail!("patch {} changes only tests; there is nothing to revert", lp.entry.id);
    }
    let mut t = tree.clone();
    apply::unapply(&mut t, &ps, lp.name()).with_context(|| format!("reverting the sources of {}", lp.entry.id))?;
    Ok(t)
}

/// Writes the scratch workspace for `tree`, touching only files whose bytes changed.
fn write_workspace(p: &Project, s: &Scratch, base: &Tree, tree: &Tree, crates: &[String], engine: bool) -> anyhow::Result<()> {
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (path, e) in tree {
        files.insert(format!("{}/{path}", p.live.display()), e.data.clone());
    }
    let root_manifest = fs::read_to_string(p.root.join("Cargo.toml")).context("reading Cargo.toml")?;
    let members = if engine { "members = [\"engine/crates/*\"]" } else { "members = [\"engine/crates/tine-patch-tests\"]" };
    let manifest = root_manifest.lines().map(|l| if l.starts_with("members = ") { members } else { l }).collect::<Vec<_>>().join("\n") + "\n";
    files.insert("Cargo.toml".into(), manifest.into_bytes());
    for f in ["Cargo.lock", ".cargo/config.toml"] {
        if let Ok(b) = fs::read(p.root.join(f)) {
            files.insert(f.into(), b);
        }
    }
    if engine {
        // The engine crates and the data files they compile in (`include_str!`).
        for dir in ["engine/crates", "bench/prompts"] {
            let t = tree::read_tree(&p.root.join(dir)).with_context(|| format!("reading {dir}"))?;
            for (path, e) in t {
                files.insert(format!("{dir}/{path}"), e.data);
            }
        }
    }
    if !engine {
        // The patches' Gemma 3 tests include tine-test-support's fixture by `#[path]`.
        let dir = "engine/crates/tine-test-support";
        let t = tree::read_tree(&p.root.join(dir)).with_context(|| format!("reading {dir}"))?;
        for (path, e) in t {
            files.insert(format!("{dir}/{path}"), e.data);
        }
    }
    let harness = format!("engine/crates/{PATCH_TESTS}");
    files.insert(format!("{harness}/Cargo.toml"), harness_manifest(&patch_test_files(base, tree, crates)).into_bytes());
    files.insert(format!("{harness}/lib.rs"), HARNESS_LIB.as_bytes().to_vec());
    sync_dir(&s.work, &files)
}

/// Makes `dir` hold exactly `files`: writes those that differ, deletes the rest.
fn sync_dir(dir: &Path, files: &BTreeMap<String, Vec<u8>>) -> anyhow::Result<()> {
    fs::create_dir_all(dir)?;
    let existing = tree::read_tree(dir).with_context(|| format!("reading {}", dir.display()))?;
    for path in existing.keys() {
        if !files.contains_key(path) {
            fs::remove_file(dir.join(path)).with_context(|| format!("removing {path}"))?;
        }
    }
    for (path, data) in files {
        if existing.get(path).map(|e| &e.data) != Some(data) {
            tree::write_file_atomically(&dir.join(path), data)?;
        }
    }
    Ok(())
}

fn cargo(s: &Scratch) -> Command {
    let mut c = Command::new(patchchain::base::cargo_bin());
    c.current_dir(&s.work).env("CARGO_TARGET_DIR", &s.target);
    c
}

/// Runs `cmd` with its output in `log`; the outcome's reason is the first compiler error or
/// panic message found there.
fn run_logged(name: &str, cmd: &mut Command, log: &Path) -> Outcome {
    let out = match cmd.output() {
        Ok(o) => o,
        Err(e) => return fail(name, format!("cannot run {cmd:?}: {e}")),
    };
    let mut text = out.stdout.clone();
    text.extend_from_slice(&out.stderr);
    let _ = tree::write_file_atomically(log, &text);
    let text = String::from_utf8_lossy(&text);
    let passed = out.status.success();
    let summary: Vec<&str> = text.lines().filter(|l| l.starts_with("test result:")).collect();
    let passed_tests: usize = summary.iter().filter_map(|l| l.split_whitespace().nth(3)?.parse::<usize>().ok()).sum();
    Outcome {
        gate: name.to_owned(),
        passed,
        figures: if passed { format!("{passed_tests} test(s) passed") } else { String::new() },
        reason: if passed { String::new() } else { failure_reason(&text) },
        seconds: 0.0,
        log: Some(log.display().to_string()),
    }
}

/// The most telling lines of a failed cargo run.
pub fn failure_reason(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    if let Some(i) = lines.iter().position(|l| l.starts_with("error[") || l.starts_with("error: no test target") || l.starts_with("error: package")) {
        let mut r = lines[i].to_owned();
        if let Some(at) = lines[i + 1..].iter().take(3).find(|l| l.trim_start().starts_with("-->")) {
            write!(r, " ({})", at.trim_start().trim_start_matches("--> ")).expect("String write");
        }
        return format!("does not compile against this tree: {r}");
    }
    if let Some(i) = lines.iter().position(|l| l.contains("panicked at")) {
        let msg = lines.get(i + 1).copied().unwrap_or("");
        let test = lines[i].split('\'').nth(1).unwrap_or("a test");
        return format!("test `{test}` failed: {msg}");
    }
    lines.iter().rev().find(|l| l.starts_with("error")).map(|l| l.to_string()).unwrap_or_else(|| "cargo failed (see the log)".into())
}

fn build_tine(s: &Scratch, dir: &Path, pb: &indicatif::ProgressBar, id: &str) -> anyhow::Result<PathBuf> {
    pb.set_message(format!("{id}: building tine (release) at this prefix"));
    let log = dir.join("build-tine.log");
    let o = run_logged("build", cargo(s).args(["build", "--release", "-p", "tine-cli"]), &log);
    if !o.passed {
        bail!("building tine at this prefix failed: {} (log: {})", o.reason, log.display());
    }
    Ok(s.target.join("release/tine"))
}

/// Draft arguments for a spec type on the default model, or why there are none.
fn draft_args(p: &Project, tine: &Path, spec: &str, model: &Path) -> anyhow::Result<(PathBuf, Vec<String>)> {
    let drafters = p.root.join("drafters");
    match spec {
        "ngram" => Ok((model.to_owned(), vec![])),
        "draft" => Ok((model.to_owned(), vec!["--model-draft".into(), model.display().to_string()])),
        "draft-assistant" => {
            let head = drafters.join("gemma3-270m-assistant.gguf");
            if !head.exists() {
                bail!("needs an assistant head for the default model at {} (none is shipped)", p.rel(&head));
            }
            Ok((model.to_owned(), vec!["--mtp-head".into(), head.display().to_string()]))
        }
        "draft-mtp" => {
            let head = drafters.join("gemma3-270m-nextn.gguf");
            if !head.exists() {
                bail!("needs a NextN head for the default model at {} (none is shipped)", p.rel(&head));
            }
            let grafted = p.root.join("target/gates/gemma-3-270m-q4_k_m-nextn.gguf");
            let out = Command::new(tine).args(["graft-nextn", "--target"]).arg(model).arg("--head").arg(&head).arg("-o").arg(&grafted).output()?;
            if !out.status.success() {
                bail!("`tine graft-nextn` failed: {}", String::from_utf8_lossy(&out.stderr).trim());
            }
            Ok((grafted, vec![]))
        }
        other => bail!("unknown spec type {other}"),
    }
}

fn engine_gate(p: &Project, name: &str, g: &Gate, tine: &Path, dir: &Path) -> Outcome {
    let model = match crate::model::fetch(false) {
        Ok(m) => m,
        Err(e) => return fail(name, format!("needs the default model and cannot get it: {e:#}")),
    };
    let result = (|| -> anyhow::Result<Outcome> {
        match g {
            Gate::GreedyIdentical { spec } | Gate::LogitEquiv { spec } => {
                let (m, extra) = draft_args(p, tine, spec, &model)?;
                let json = dir.join(format!("{}.json", slug(name)));
                let mut cmd = Command::new(tine);
                cmd.args(["logit-equiv", "--spec-type", spec, "--depths", "1,2,3", "-n", "32", "-m"]).arg(&m).args(&extra).arg("--json").arg(&json);
                let o = run_logged(name, &mut cmd, &dir.join(format!("{}.log", slug(name))));
                let bytes = fs::read(&json).with_context(|| format!("`tine logit-equiv` wrote no JSON ({})", o.reason))?;
                let report: tine_report::LogitEquivReport = tine_report::from_slice(&bytes).with_context(|| format!("reading {}", json.display()))?;
                let rows = report.results;
                let greedy = matches!(g, Gate::GreedyIdentical { .. });
                let mut bad = Vec::new();
                let mut figs = Vec::new();
                for r in &rows {
                    let depth = r.depth;
                    if greedy {
                        let (same, n) = (r.greedy_identical_prompts, r.prompts);
                        figs.push(format!("d{depth} {same}/{n}"));
                        if same != n || n == 0 {
                            bad.push(format!("depth {depth}: {same} of {n} prompts identical"));
                        }
                    } else {
                        figs.push(format!("d{depth} real_frac {} max|dl| {}", r.real_frac, r.max_abs_logit_diff));
                        if !r.exact {
                            bad.push(format!(
                                "depth {depth}: real_frac {}, frac_full_agree {}, mean_top1_mae {}, max |dlogit| {}",
                                r.real_frac, r.frac_full_agree, r.mean_top1_mae, r.max_abs_logit_diff
                            ));
                        }
                    }
                }
                if rows.is_empty() {
                    bad.push("no results".into());
                }
                Ok(Outcome { gate: name.into(), passed: bad.is_empty(), figures: figs.join(", "), reason: bad.join("; "), seconds: 0.0, log: o.log })
            }
            Gate::Accept { spec, min } => {
                let rows = spec_bench(p, tine, &model, &[spec.as_str()], &[3], 1, dir, name)?;
                let label = format!("{spec} d3");
                let r = rows.row(&label).with_context(|| format!("spec-bench reported no row {label}"))?;
                let a = r.accept;
                Ok(Outcome {
                    gate: name.into(),
                    passed: a >= *min,
                    figures: format!("accept {a:.3} (tau {:.2})", r.tau),
                    reason: if a >= *min { String::new() } else { format!("acceptance {a:.3} < {min}") },
                    seconds: 0.0,
                    log: None,
                })
            }
            Gate::TpsRatio { a, b, min } => {
                let specs: BTreeSet<&str> = [a, b].iter().filter_map(|c| c.spec.as_deref()).collect();
                let depths: BTreeSet<usize> = [a, b].iter().filter(|c| c.spec.is_some()).map(|c| c.depth).collect();
                let specs: Vec<&str> = specs.into_iter().collect();
                let depths: Vec<usize> = if depths.is_empty() { vec![1] } else { depths.into_iter().collect() };
                let rows = spec_bench(p, tine, &model, &specs, &depths, 3, dir, name)?;
                let tps = |c: &Config| -> anyhow::Result<f64> {
                    let label = c.label();
                    rows.row(&label).map(|r| r.tps).with_context(|| format!("spec-bench reported no row {label}"))
                };
                let (ta, tb) = (tps(a)?, tps(b)?);
                let ratio = ta / tb;
                Ok(Outcome {
                    gate: name.into(),
                    passed: ratio >= *min,
                    figures: format!("{} {ta:.1} / {} {tb:.1} tok/s = {ratio:.2}x", a.label(), b.label()),
                    reason: if ratio >= *min { String::new() } else { format!("ratio {ratio:.2} < {min}") },
                    seconds: 0.0,
                    log: None,
                })
            }
            Gate::Tokenizer { corpus } => {
                let path = p.root.join(corpus);
                let v: serde_json::Value = serde_json::from_slice(&fs::read(&path).with_context(|| format!("reading the corpus {}", p.rel(&path)))?)?;
                let cases = v["cases"].as_array().with_context(|| format!("{}: expected {{\"cases\": [...]}}", p.rel(&path)))?;
                let mut bad = Vec::new();
                for c in cases {
                    let text = c["text"].as_str().context("a case without text")?;
                    let want: Vec<u64> = c["ids"].as_array().context("a case without ids")?.iter().filter_map(|x| x.as_u64()).collect();
                    let out = Command::new(tine).args(["tokenize", "--no-bos", "-m"]).arg(&model).args(["-p", text]).output()?;
                    // A failed or garbled `tine tokenize` is a failure of its own, not a
                    // difference from llama.cpp.
                    if !out.status.success() {
                        bail!("`tine tokenize` failed ({}) on {text:?}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
                    }
                    let got: Vec<u64> = serde_json::from_slice(&out.stdout).with_context(|| format!("`tine tokenize` printed no id list for {text:?}"))?;
                    if got != want {
                        bad.push(format!("{text:?}"));
                    }
                }
                Ok(Outcome {
                    gate: name.into(),
                    passed: bad.is_empty(),
                    figures: format!("{} of {} texts exact", cases.len() - bad.len(), cases.len()),
                    reason: if bad.is_empty() { String::new() } else { format!("differ from llama.cpp: {}", bad.into_iter().take(5).collect::<Vec<_>>().join(", ")) },
                    seconds: 0.0,
                    log: None,
                })
            }
            Gate::Apply | Gate::Test { .. } => unreachable!("not an engine gate"),
        }
    })();
    result.unwrap_or_else(|e| fail(name, format!("{e:#}")))
}

#[allow(clippy::too_many_arguments)]
fn spec_bench(p: &Project, tine: &Path, model: &Path, specs: &[&str], depths: &[usize], rounds: usize, dir: &Path, name: &str) -> anyhow::Result<tine_report::SpecBenchReport> {
    let mut models = None;
    let mut extra = Vec::new();
    for s in specs {
        let (m, e) = draft_args(p, tine, s, model)?;
        models.get_or_insert(m);
        extra.extend(e);
    }
    let m = models.unwrap_or_else(|| model.to_owned());
    let md = dir.join(format!("{}.md", slug(name)));
    let types = if specs.is_empty() { "ngram".to_owned() } else { specs.join(",") };
    let depths = depths.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
    let mut cmd = Command::new(tine);
    cmd.args(["spec-bench", "--sets", "mtp9", "-n", "96", "--types", &types, "--depths", &depths, "--rounds", &rounds.to_string(), "-m"]).arg(&m).args(&extra).arg("--out").arg(&md);
    let o = run_logged(name, &mut cmd, &dir.join(format!("{}.log", slug(name))));
    if !o.passed {
        bail!("`tine spec-bench` failed: {}", o.reason);
    }
    let json = md.with_extension("json");
    tine_report::from_slice(&fs::read(&json).context("spec-bench wrote no JSON")?).with_context(|| format!("reading {}", json.display()))
}

/// The terminal table of a suite's outcomes.
pub fn render_table(id: &str, outcomes: &[Outcome]) -> String {
    let w = outcomes.iter().map(|o| o.gate.len()).max().unwrap_or(4).max(4);
    let mut s = format!("{:<w$}  {:<7}  {:>7}  figures / reason\n", format!("gate ({id})"), "verdict", "time");
    for o in outcomes {
        let detail = if o.passed { o.figures.clone() } else { o.reason.clone() };
        writeln!(s, "{:<w$}  {:<7}  {:>6.1}s  {}", o.gate, if o.passed { "pass" } else { "FAIL" }, o.seconds, detail).expect("String write");
    }
    s
}

/// `--list`: the catalogue and every patch's suite.
pub fn render_list(reg: &Registry) -> String {
    let mut s = String::from("Gates (a patch's suite is its registry entry's `gates`):\n");
    for (n, d) in CATALOGUE {
        writeln!(s, "  {n}\n      {d}").expect("String write");
    }
    if let Some(e) = &reg.engine {
        writeln!(s, "\nEngine gates sit on patches from {} on (registry [engine] builds_from): before it the engine crates do not compile.", e.builds_from).expect("String write");
    }
    writeln!(s, "Engine figures use the default model (`cargo xtask fetch-model`); synthetic-model checks are the `test:` gates.\n\nSuites:").expect("String write");
    for p in &reg.patches {
        writeln!(s, "  {} {}\n      {}", p.id, p.file, p.gates.join("\n      ")).expect("String write");
    }
    s
}

#[cfg(test)]
mod tests {
    use patchchain::registry::{self, Registry};
    use patchchain::Extension as _;

    use crate::Tine;

    /// `lint` with Tine's gate grammar: the generic problems, then each gate's, in order.
    #[test]
    fn lint_names_every_problem() {
        let text = r#"
[base]
kind = "dir"
path = "base"
[engine]
builds_from = "0003"
[[patch]]
id = "0002"
file = "0002-a.patch"
sha256 = "00"
title = "a"
area = "kv"
hooks = ["h"]
status = "carried"
bump = "drop-if-upstream"
gates = ["tps-ratio:spec/plain", "bogus", "greedy-identical:ngram", "test:-p tine-patch-tests --test x"]
[[patch]]
id = "0001"
file = "0001-B.patch"
sha256 = "5ecb245093b0f791b89d3420c3df9c6d49c60ab63ba54db896bf8a3baf486706"
title = "b"
area = "nowhere"
hooks = ["h"]
status = "maybe"
bump = "reapply"
"#;
        let reg: Registry = toml::from_str(text).expect("valid toml");
        let got = registry::lint(&reg, &|r, e, g| Tine.check_gate(r, e, g), Tine.areas()).join("\n");
        let expect = r#"patch 0002: sha256 must be 64 lowercase hex digits
patch 0002: status "carried" / bump "drop-if-upstream" needs an upstream reference
patch 0002: gate "tps-ratio:spec/plain": expected tps-ratio:<A>/<B>:<min>
patch 0002: unknown gate "bogus" (known: apply, test:<cargo test arguments>, greedy-identical:<spec-type>, logit-equiv:<spec-type>, accept:<spec-type>:<min>, tps-ratio:<A>/<B>:<min>, tokenizer:<corpus>)
patch 0002: gate "greedy-identical:ngram" needs the engine crates, which compile only from patch 0003 on ([engine] builds_from); gate this patch with its own tests (`test:-p tine-patch-tests --test <file>`)
patch 0001: ids must increase in series order (follows 0002)
patch 0001: file "0001-B.patch" must be named 0001-<slug>.patch with a lowercase slug
patch 0001: area "nowhere" is not one of kernels, kv, mtp, tokenizer, model, attention, quant, sampling, build, api, other
patch 0001: status "maybe" is not one of carried, submitted, upstreamed, retired
patch 0001: hook "h" is also declared by patch 0002; hook names are unique
patch 0001: no gates; every patch needs a suite that would fail without it"#;
        assert_eq!(got, expect);
    }
}
