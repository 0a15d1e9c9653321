//! Tine's porcelain over [`patchchain::rebase`]: `rebase` and `canary`, plus the project files a base
//! bump must move besides the chain's own (the engine's `=VERSION` requirements on the base
//! crates and the generated patch-tests manifest).

use std::path::Path;
use std::process::{Command, ExitCode};

use anyhow::Context as _;

use patchchain::chain::{self, LoadedPatch};
use patchchain::rebase::{self, OntoSpec, Outcome, Report};
use patchchain::registry::{Base, Registry};
use patchchain::{tree, Extension as _, Project};

use crate::gate;
use crate::tine::Tine;

/// Manifests whose `=VERSION` requirements on base crates follow the base.
const VERSION_MANIFESTS: &[&str] = &["Cargo.toml", "bench/stock-candle/Cargo.toml"];

pub fn extra_paths(p: &Project) -> Vec<String> {
    let mut v: Vec<String> = VERSION_MANIFESTS.iter().filter(|m| p.root.join(m).exists()).map(|m| (*m).to_owned()).collect();
    if gate::engine_crates_dir(p).is_dir() {
        v.push(p.rel(&gate::harness_manifest_path(p)).into_owned());
    }
    v
}

/// `line` with `"=OLD"` replaced by `"=NEW"` when it requires one of the base crates.
fn bump_line(line: &str, pins: &[(String, String, String)]) -> String {
    for (name, old, new) in pins {
        let key = line.trim_start().starts_with(&format!("{name} ")) || line.trim_start().starts_with(&format!("{name}=")) || line.contains(&format!("package = \"{name}\""));
        if key && line.contains(&format!("\"={old}\"")) {
            return line.replace(&format!("\"={old}\""), &format!("\"={new}\""));
        }
    }
    line.to_owned()
}

pub fn bump_manifest(text: &str, from: &Base, onto: &Base) -> String {
    let (Base::Crates { crates: a }, Base::Crates { crates: b }) = (from, onto) else {
        return text.to_owned();
    };
    let pins: Vec<(String, String, String)> = a.iter().filter_map(|c| b.iter().find(|n| n.name == c.name).map(|n| (c.name.clone(), c.version.clone(), n.version.clone()))).collect();
    let mut out: String = text
        .split_inclusive('\n')
        .map(|l| {
            let (body, nl) = l.strip_suffix('\n').map(|b| (b, "\n")).unwrap_or((l, ""));
            format!("{}{nl}", bump_line(body, &pins))
        })
        .collect();
    if out.is_empty() {
        out = text.to_owned();
    }
    out
}

/// The extra files of a bump, from the old and new registries.
pub fn extra_files(p: &Project, old: &Registry, new: &Registry, series: &[LoadedPatch]) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for m in VERSION_MANIFESTS {
        let path = p.root.join(m);
        if let Ok(text) = std::fs::read_to_string(&path) {
            let bumped = bump_manifest(&text, &old.base, &new.base);
            if bumped != text {
                out.push(((*m).to_owned(), bumped.into_bytes()));
            }
        }
    }
    for (path, bytes) in Tine.generated_files(p, new, &series.iter().map(|l| &l.parsed).collect::<Vec<_>>()) {
        out.push((p.rel(&path).into_owned(), bytes));
    }
    Ok(out)
}

fn write_json(p: &Project, path: Option<&Path>, r: &Report) -> anyhow::Result<()> {
    if let Some(path) = path {
        let full = if path.is_absolute() { path.to_owned() } else { std::env::current_dir()?.join(path) };
        tree::write_file_atomically(&full, &r.to_json())?;
        eprintln!("report: {}", p.rel(&full));
    }
    Ok(())
}

/// After a completed bump the lock file follows the new versions (cargo resolves offline first).
fn refresh_lock(p: &Project) {
    if !p.root.join("Cargo.lock").exists() || !gate::engine_crates_dir(p).is_dir() {
        return;
    }
    let cargo = patchchain::base::cargo_bin();
    for offline in [true, false] {
        let mut c = Command::new(&cargo);
        c.args(["metadata", "--format-version", "1", "--manifest-path"]).arg(p.root.join("Cargo.toml"));
        if offline {
            c.arg("--offline");
        }
        if c.output().map(|o| o.status.success()).unwrap_or(false) {
            eprintln!("Cargo.lock: updated to the new base");
            return;
        }
    }
    eprintln!("note: Cargo.lock could not be updated here; run `cargo update --workspace` before building");
}

pub struct RebaseArgs<'a> {
    pub onto: Option<&'a str>,
    pub dry_run: bool,
    pub json: Option<&'a Path>,
    pub cont: bool,
    pub retire: bool,
    pub accept: Vec<String>,
    pub abort: bool,
}

pub fn rebase(p: &Project, a: &RebaseArgs<'_>, pb: &indicatif::ProgressBar) -> anyhow::Result<ExitCode> {
    let extra = |p: &Project, old: &Registry, new: &Registry, s: &[LoadedPatch]| extra_files(p, old, new, s).map_err(Into::into);
    if a.abort {
        rebase::abort(p, pb)?;
        pb.finish_and_clear();
        println!("rebase aborted: the registry, patches, manifests, docs and engine/upstream/ are as they were");
        return Ok(ExitCode::SUCCESS);
    }
    let outcome = if a.cont {
        rebase::continue_run(p, &rebase::ContinueOptions { retire: a.retire, accept: a.accept.clone() }, &extra, pb)?
    } else {
        let spec = OntoSpec::parse(a.onto.context("--onto SPEC is required")?)?;
        let reg = chain::load_registry(p)?;
        let onto = rebase::resolve_onto(&spec, &reg.base, &p.cache_dir, pb)?;
        let inputs = rebase::load_inputs(p, onto, pb)?;
        if a.dry_run {
            let start = std::time::Instant::now();
            let r = rebase::dry_run(&inputs)?;
            pb.finish_and_clear();
            print!("{}", rebase::render_table(&r));
            eprintln!("dry run: nothing written ({:.0} ms)", start.elapsed().as_secs_f64() * 1e3);
            write_json(p, a.json, &r)?;
            let stops = r.patches.iter().any(|x| x.action == "stop" || x.action == "decide");
            return Ok(if stops { ExitCode::from(1) } else { ExitCode::SUCCESS });
        }
        rebase::start(p, &inputs, &extra_paths(p), &extra, pb)?
    };
    pb.finish_and_clear();
    match outcome {
        Outcome::Done(r) => {
            print!("{}", rebase::render_table(&r));
            write_json(p, a.json, &r)?;
            refresh_lock(p);
            println!("rebase: done; the series now sits on {} (report in docs/bumps/{}-to-{}.md)", r.onto, r.from, r.onto);
            Ok(ExitCode::SUCCESS)
        }
        Outcome::Stopped(r, msg) => {
            print!("{}", rebase::render_table(&r));
            write_json(p, a.json, &r)?;
            eprintln!("{msg}");
            Ok(ExitCode::from(1))
        }
    }
}

/// The dry run onto the newest published base (or `spec`); exit 0 only if every patch is exact or rebased.
pub fn canary(p: &Project, spec: Option<&str>, json: Option<&Path>, pb: &indicatif::ProgressBar) -> anyhow::Result<ExitCode> {
    let reg = chain::load_registry(p)?;
    let spec = match spec {
        Some(s) => OntoSpec::parse(s)?,
        None => match &reg.base {
            Base::Crates { crates } => {
                let first = crates.first().context("the base lists no crates")?;
                pb.set_message(format!("looking up the newest {}", first.name));
                OntoSpec::Crates(patchchain::base::newest_version(&first.name, &p.cache_dir)?)
            }
            _ => anyhow::bail!("the base is not registry crates, so there is no newest version to look up; name one: `cargo xtask canary dir:PATH` or `git:URL@COMMIT`"),
        },
    };
    let onto = rebase::resolve_onto(&spec, &reg.base, &p.cache_dir, pb)?;
    let inputs = rebase::load_inputs(p, onto, pb)?;
    let r = rebase::dry_run(&inputs)?;
    pb.finish_and_clear();
    print!("{}", rebase::render_table(&r));
    write_json(p, json, &r)?;
    if r.clean() {
        println!("canary: every patch carries onto {} (exact or rebased)", r.onto);
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "canary: {} needs a maintainer: {}",
            r.onto,
            r.patches.iter().filter(|x| !matches!(x.verdict, rebase::Verdict::Exact | rebase::Verdict::Rebased)).map(|x| format!("{} {}", x.id, x.verdict.as_str())).collect::<Vec<_>>().join(", ")
        );
        Ok(ExitCode::from(1))
    }
}
