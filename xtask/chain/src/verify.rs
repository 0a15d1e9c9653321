//! `cargo xtask verify`: seven checks that together prove the chain is what the repository says.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;
use std::process::Command;

use crate::apply;
use crate::base::BaseError;
use crate::chain::{self, Live};
use crate::error::Causes;
use crate::journal::{self, JournalError};
use crate::project::Project;
use crate::registry::{Base, LoadError, Registry};
use crate::tree::{self, Tree};

/// What keeps `verify` from running its checks at all (a failed check is a step of the report).
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Registry(#[from] LoadError),
    #[error(transparent)]
    Base(#[from] BaseError),
}

/// Why step 7 could not ask cargo.
#[derive(Debug, thiserror::Error)]
pub enum CargoCheckError {
    #[error("there is no Cargo.lock, so cargo would write one: run `cargo generate-lockfile` at the project root and commit it")]
    NoLock,
    #[error("running `cargo metadata`: {0}")]
    Run(std::io::Error),
    #[error("Cargo.lock is out of date with the workspace's manifests (cargo would rewrite it; verify leaves it alone): run `cargo update --workspace` at the project root, review the Cargo.lock diff and commit it\ncargo said: {stderr}")]
    StaleLock { stderr: String },
    #[error("`cargo metadata` failed:\n{stderr}")]
    Failed { stderr: String },
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Pass(String),
    Fail(String),
    Skipped(String),
}

#[derive(Debug, Clone)]
pub struct Step {
    pub number: u8,
    pub title: &'static str,
    pub outcome: Outcome,
}

#[derive(Debug, Default)]
pub struct Report {
    pub steps: Vec<Step>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.steps.iter().all(|s| !matches!(s.outcome, Outcome::Fail(_)))
    }
    pub fn failures(&self) -> Vec<&Step> {
        self.steps.iter().filter(|s| matches!(s.outcome, Outcome::Fail(_))).collect()
    }
    fn push(&mut self, number: u8, title: &'static str, outcome: Outcome) {
        self.steps.push(Step { number, title, outcome });
    }
    pub fn render(&self) -> String {
        let mut out = String::new();
        for s in &self.steps {
            let (mark, text) = match &s.outcome {
                Outcome::Pass(t) => ("ok  ", t),
                Outcome::Fail(t) => ("FAIL", t),
                Outcome::Skipped(t) => ("skip", t),
            };
            out.push_str(&format!("{mark} {}. {}: {}\n", s.number, s.title, text.replace('\n', "\n       ")));
        }
        out
    }
}

const T1: &str = "pristine base matches its manifest";
const T2: &str = "the whole chain applies strictly";
const T3: &str = "result matches manifest.patched";
const T4: &str = "reverse-applying the chain gives back the pristine tree";
const T5: &str = "the live tree equals the expected tree";
const T6: &str = "each declared hook appears with its patch, not before";
const T7: &str = "cargo resolves every base crate to the live tree";

/// Runs every check it can; a failed step skips only the steps that depend on it.
pub fn verify(p: &Project, pb: &indicatif::ProgressBar) -> Result<Report, VerifyError> {
    let mut r = Report::default();
    // A change half written by a killed run is neither the old project nor the new one.
    journal::check_none_pending(p)?;
    let reg = chain::load_registry(p)?;
    pb.set_message("loading the base");
    let base = crate::base::load(&reg.base, &p.root, &p.cache_dir, pb)?;
    match chain::check_pristine(p, &base) {
        Ok(()) => r.push(1, T1, Outcome::Pass(format!("{} files", base.len()))),
        Err(e) => r.push(1, T1, Outcome::Fail(Causes(&e).to_string())),
    }
    pb.set_message("applying the chain");
    let patches = match chain::load_patches(p, &reg) {
        Ok(ps) => Some(ps),
        Err(e) => {
            r.push(2, T2, Outcome::Fail(Causes(&e).to_string()));
            None
        }
    };
    // Step 2 and 6 together: apply one patch at a time, tracking hook markers per file.
    let mut expected: Option<Tree> = None;
    let mut hook_problems = Vec::new();
    if let Some(patches) = &patches {
        let mut t = base.clone();
        let mut hooks_by_file: BTreeMap<String, BTreeSet<String>> = t.iter().map(|(p, e)| (p.clone(), tree::hooks_in(&e.data))).collect();
        let present = |m: &BTreeMap<String, BTreeSet<String>>| -> BTreeSet<String> { m.values().flatten().cloned().collect() };
        let mut failed = None;
        for lp in patches {
            let before = present(&hooks_by_file);
            if let Err(e) = apply::apply(&mut t, &lp.parsed, lp.name()) {
                failed = Some(e);
                break;
            }
            for fp in &lp.parsed.files {
                for path in fp.old_path.iter().chain(fp.new_path.iter()) {
                    match t.get(path) {
                        Some(e) => hooks_by_file.insert(path.clone(), tree::hooks_in(&e.data)),
                        None => hooks_by_file.remove(path),
                    };
                }
            }
            let after = present(&hooks_by_file);
            for h in &lp.entry.hooks {
                if before.contains(h) {
                    hook_problems.push(format!("patch {}: hook {h:?} is already marked before the patch applies", lp.entry.id));
                } else if !after.contains(h) {
                    hook_problems.push(format!("patch {}: hook {h:?} is declared but no `tine-hook: {h}` marker is in the tree after it applies", lp.entry.id));
                }
            }
        }
        match failed {
            Some(e) => r.push(2, T2, Outcome::Fail(e.to_string())),
            None => {
                r.push(2, T2, Outcome::Pass(format!("{} patch(es), zero fuzz, zero offset", patches.len())));
                let declared: BTreeSet<&String> = reg.patches.iter().filter(|e| e.is_applied()).flat_map(|e| &e.hooks).collect();
                for (h, files) in hooks_by_file.iter().flat_map(|(f, hs)| hs.iter().map(move |h| (h, f))).fold(BTreeMap::<&String, Vec<&String>>::new(), |mut m, (h, f)| {
                    m.entry(h).or_default().push(f);
                    m
                }) {
                    if !declared.contains(h) {
                        hook_problems.push(format!("marker `tine-hook: {h}` in {} is declared by no patch", files.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")));
                    }
                }
                expected = Some(t);
            }
        }
    }
    match &expected {
        Some(t) => {
            let path = p.patched_manifest_path();
            let recorded = match fs::read_to_string(&path) {
                Ok(s) => tree::parse_manifest(&s, &path).map_err(|e| Causes(&e).to_string()),
                Err(e) => Err(Causes(&e).to_string()),
            };
            match recorded {
                Ok(recorded) => {
                    let d = tree::diff_manifests(&recorded, &tree::manifest_of(t));
                    if d.is_empty() {
                        r.push(3, T3, Outcome::Pass(format!("{} files, byte for byte", t.len())));
                    } else {
                        r.push(3, T3, Outcome::Fail(format!("the chain's result differs from {} (a patch changed without `cargo xtask bless`?):\n{}", p.rel(&path), d.describe(20))));
                    }
                }
                Err(e) => r.push(3, T3, Outcome::Fail(format!("cannot read {}: {e} (record it with `cargo xtask bless`)", p.rel(&path)))),
            }
            pb.set_message("reverse-applying the chain");
            let patches = patches.as_ref().expect("expected implies patches");
            let mut back = t.clone();
            let mut failed = None;
            for lp in patches.iter().rev() {
                if let Err(e) = apply::unapply(&mut back, &lp.parsed, lp.name()) {
                    failed = Some(e);
                    break;
                }
            }
            match failed {
                Some(e) => r.push(4, T4, Outcome::Fail(e.to_string())),
                None if back == base => r.push(4, T4, Outcome::Pass("byte for byte, modes included".into())),
                None => {
                    let d = tree::diff_manifests(&tree::manifest_of(&base), &tree::manifest_of(&back));
                    r.push(4, T4, Outcome::Fail(format!("the reversed tree differs from the pristine base:\n{}", d.describe(20))));
                }
            }
            r.push(
                6,
                T6,
                if hook_problems.is_empty() {
                    Outcome::Pass(format!("{} hook(s)", reg.patches.iter().filter(|e| e.is_applied()).map(|e| e.hooks.len()).sum::<usize>()))
                } else {
                    Outcome::Fail(hook_problems.join("\n"))
                },
            );
        }
        None => {
            r.push(3, T3, Outcome::Skipped("the chain did not apply".into()));
            r.push(4, T4, Outcome::Skipped("the chain did not apply".into()));
            r.push(6, T6, Outcome::Skipped("the chain did not apply".into()));
        }
    }
    pb.set_message(format!("checking {}", p.live_name()));
    r.push(5, T5, check_live(p, expected.as_ref(), patches.as_deref()));
    pb.set_message("cargo metadata");
    r.push(7, T7, check_cargo(p, &reg));
    r.steps.sort_by_key(|s| s.number);
    Ok(r)
}

fn check_live(p: &Project, expected: Option<&Tree>, patches: Option<&[chain::LoadedPatch]>) -> Outcome {
    let live = match Live::read(p) {
        Ok(Some(l)) => l,
        Ok(None) => return Outcome::Skipped(format!("{} is absent (`cargo xtask apply-chain` creates it)", p.live_name())),
        Err(e) => return Outcome::Fail(Causes(&e).to_string()),
    };
    let Some(state) = &live.state else {
        return Outcome::Fail(format!("{} has no chain state; it was not written by `cargo xtask apply-chain` (back it up, remove it, apply again)", p.live_name()));
    };
    let drift = live.drift().expect("state present");
    if !drift.is_empty() {
        return Outcome::Fail(format!(
            "{} holds edits that no patch carries:\n{}\ncapture them: `cargo xtask refresh {}` (into the top applied patch) or `cargo xtask capture NNNN-slug` (a new patch)",
            p.live_name(),
            drift.describe(20),
            state.top()
        ));
    }
    let (Some(expected), Some(patches)) = (expected, patches) else {
        return Outcome::Skipped("no expected tree (the chain did not apply)".into());
    };
    if state.applied.len() != patches.len() {
        return Outcome::Fail(format!("{} holds the chain up to {}, not the whole chain ({} patches): run `cargo xtask apply-chain`", p.live_name(), state.top(), patches.len()));
    }
    let d = tree::diff_manifests(&tree::manifest_of(expected), &tree::manifest_of(&live.tree));
    if d.is_empty() {
        Outcome::Pass(format!("base + {} patch(es), no drift", patches.len()))
    } else {
        Outcome::Fail(format!("{} is stale (patch files changed since it was applied):\n{}\nrun `cargo xtask apply-chain`", p.live_name(), d.describe(20)))
    }
}

/// Step 7: `[patch.crates-io]` is really used. Cargo only warns about an unused patch and then
/// builds the registry crate, so this is checked from `cargo metadata`, not assumed.
pub fn check_cargo(p: &Project, reg: &Registry) -> Outcome {
    let Base::Crates { crates } = &reg.base else {
        return Outcome::Skipped("the base is not a set of crates".into());
    };
    let manifest = p.root.join("Cargo.toml");
    if !manifest.exists() {
        return Outcome::Skipped("no engine workspace (Cargo.toml) at the project root".into());
    }
    if !p.upstream_dir().exists() {
        return Outcome::Fail(format!("{} is absent, so the engine workspace cannot resolve: run `cargo xtask apply-chain`", p.live_name()));
    }
    match metadata_problems(&p.root, &p.upstream_dir(), &manifest, crates.iter().map(|c| c.name.as_str())) {
        Ok(problems) if problems.is_empty() => Outcome::Pass(format!("{} crate(s) from {}", crates.len(), p.live_name())),
        Ok(problems) => Outcome::Fail(problems.join("\n")),
        Err(e) => Outcome::Fail(Causes(&e).to_string()),
    }
}

/// cargo's words when `--locked` stops it from rewriting the lock file.
fn lock_is_stale(stderr: &str) -> bool {
    stderr.contains("--locked was passed")
}

fn metadata_problems<'a>(root: &Path, upstream: &Path, manifest: &Path, names: impl Iterator<Item = &'a str>) -> Result<Vec<String>, CargoCheckError> {
    let lock = root.join("Cargo.lock");
    if !lock.exists() {
        return Err(CargoCheckError::NoLock);
    }
    // A check must not modify the project: `--locked` makes cargo fail instead of rewriting
    // Cargo.lock. `--offline` first, so the check does not reach the network; only when cargo's
    // cache lacks a crate is it run again online (downloads go to cargo's cache, not the project).
    let run = |offline: bool| {
        Command::new(crate::base::cargo_bin())
            .args(["metadata", "--format-version", "1", "--all-features", "--locked"])
            .args(offline.then_some("--offline"))
            .arg("--manifest-path")
            .arg(manifest)
            .current_dir(root)
            .output()
            .map_err(CargoCheckError::Run)
    };
    let mut out = run(true)?;
    if !out.status.success() && !lock_is_stale(&String::from_utf8_lossy(&out.stderr)) {
        out = run(false)?;
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if lock_is_stale(&stderr) {
            return Err(CargoCheckError::StaleLock { stderr: stderr.trim().to_owned() });
        }
        return Err(CargoCheckError::Failed { stderr: stderr.trim().to_owned() });
    }
    let mut problems: Vec<String> = stderr.lines().filter(|l| l.contains("was not used in the crate graph")).map(|l| format!("cargo: {}", l.trim())).collect();
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let packages = meta["packages"].as_array().cloned().unwrap_or_default();
    for name in names {
        let want = upstream.join(name).join("Cargo.toml");
        let found: Vec<&serde_json::Value> = packages.iter().filter(|p| p["name"] == name).collect();
        if found.is_empty() {
            problems.push(format!("{name}: not in the engine workspace's crate graph; a [patch] entry nothing uses is ignored (depend on it from an engine crate)"));
        }
        for pkg in found {
            let path = pkg["manifest_path"].as_str().unwrap_or("");
            if !pkg["source"].is_null() || Path::new(path) != want {
                problems.push(format!(
                    "{name} {} resolves to {} ({path}), not {}: cargo ignored the [patch.crates-io] entry",
                    pkg["version"].as_str().unwrap_or("?"),
                    pkg["source"].as_str().unwrap_or("a path"),
                    want.display()
                ));
            }
        }
    }
    if let Ok(text) = fs::read_to_string(&lock) {
        if let Ok(v) = toml::from_str::<toml::Value>(&text) {
            if let Some(unused) = v.get("patch").and_then(|p| p.get("unused")).and_then(|u| u.as_array()) {
                for u in unused {
                    problems.push(format!("Cargo.lock lists an unused patch: {} {}", u.get("name").and_then(|n| n.as_str()).unwrap_or("?"), u.get("version").and_then(|n| n.as_str()).unwrap_or("?")));
                }
            }
        }
    }
    Ok(problems)
}
