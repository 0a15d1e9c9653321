//! `cargo xtask sync-check`: the registry, `patches/` and `docs/UPSTREAM_SYNC.md` agree.

use std::collections::BTreeSet;
use std::fs;

use crate::extension::Extension;
use crate::journal;
use crate::patch;
use crate::project::Project;
use crate::registry::{self, Registry};
use crate::tree;

/// Every disagreement, one line each; empty means in sync. `ext` checks gate names, adds its
/// own checks of each patch, and names the generated files that must be up to date.
pub fn sync_check(p: &Project, ext: &dyn Extension, reg: &Registry) -> Vec<String> {
    if let Some(what) = journal::pending(p) {
        return vec![format!("an interrupted `{what}` is still pending in {} (its files are half written); run `cargo xtask recover`", p.rel(&journal::dir(p)))];
    }
    let mut problems = registry::lint(reg, &|r, e, g| ext.check_gate(r, e, g), ext.areas());
    let mut series = Vec::new();
    let listed: BTreeSet<&str> = reg.patches.iter().map(|e| e.file.as_str()).collect();
    if let Ok(dir) = fs::read_dir(p.patches_dir()) {
        let mut on_disk: Vec<String> = dir.filter_map(|e| e.ok()?.file_name().to_str().map(str::to_owned)).filter(|n| n.ends_with(".patch")).collect();
        on_disk.sort();
        for f in on_disk {
            if !listed.contains(f.as_str()) {
                problems.push(format!("patches/{f} has no registry entry (add a [[patch]] to upstream-sync/UPSTREAM_SYNC.toml or delete it)"));
            }
        }
    }
    for e in &reg.patches {
        let path = p.patches_dir().join(&e.file);
        let who = format!("patch {}", e.id);
        if !e.is_applied() {
            if path.exists() {
                problems.push(format!("{who} is retired but patches/{} still exists (delete it; git history keeps it)", e.file));
            }
            continue;
        }
        let Ok(bytes) = fs::read(&path) else {
            problems.push(format!("{who}: patches/{} is missing", e.file));
            continue;
        };
        let sha = tree::sha256_hex(&bytes);
        if sha != e.sha256 {
            problems.push(format!("{who}: patches/{} has sha256 {sha}, the registry records {} (run `cargo xtask bless` after reviewing the change)", e.file, e.sha256));
        }
        let parsed = match patch::parse(&bytes) {
            Ok(ps) => ps,
            Err(err) => {
                problems.push(format!("{who}: patches/{}: {err}", e.file));
                continue;
            }
        };
        if parsed.files.is_empty() {
            problems.push(format!("{who}: patches/{} holds no file changes", e.file));
        }
        series.push(parsed.clone());
        problems.extend(ext.patch_problems(p, reg, e, &series.iter().collect::<Vec<_>>()));
        let trailers = parsed.trailers();
        let trailer_hooks: BTreeSet<&str> = trailers.iter().filter(|(k, _)| k == "Tine-Hook").map(|(_, v)| v.as_str()).collect();
        let declared: BTreeSet<&str> = e.hooks.iter().map(|s| s.as_str()).collect();
        if trailer_hooks != declared {
            problems.push(format!("{who}: Tine-Hook trailers {trailer_hooks:?} differ from the registry's hooks {declared:?}"));
        }
        match trailers.iter().find(|(k, _)| k == "Upstream-Status").map(|(_, v)| v.as_str()) {
            None => problems.push(format!("{who}: no `Upstream-Status:` trailer")),
            Some(v) => {
                let word = v.split_whitespace().next().unwrap_or("");
                let ok = match word {
                    "Pending" => true,
                    "Submitted" | "Accepted" | "Inappropriate" => v.len() > word.len(),
                    _ => false,
                };
                if !ok {
                    problems.push(format!("{who}: Upstream-Status {v:?} must be `Pending`, `Submitted <ref>`, `Accepted <version>` or `Inappropriate <reason>`"));
                } else if (e.status == "submitted" && word != "Submitted") || (e.status == "upstreamed" && word != "Accepted") {
                    problems.push(format!("{who}: registry status {:?} disagrees with Upstream-Status {v:?}", e.status));
                }
            }
        }
    }
    for (path, want) in ext.generated_files(p, reg, &series.iter().collect::<Vec<_>>()) {
        if fs::read(&path).ok().as_deref() != Some(want.as_slice()) {
            problems.push(format!("{} is stale or missing: run `cargo xtask bless` and commit", p.rel(&path)));
        }
    }
    let doc = p.sync_doc_path();
    let want = registry::render_markdown(reg);
    match fs::read_to_string(&doc) {
        Ok(have) if have == want => {}
        Ok(_) => problems.push(format!("{} is stale: run `cargo xtask bless` and commit", p.rel(&doc))),
        Err(_) => problems.push(format!("{} is missing: run `cargo xtask bless` and commit", p.rel(&doc))),
    }
    problems
}
