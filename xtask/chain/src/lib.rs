//! A fork kept as a pinned pristine base plus a numbered series of git-style patches: trees,
//! the byte-exact parser, the strict placer, the exporter, the registry, the live tree, the
//! proofs (`verify`, `sync_check`), and the commands over them (apply, unapply, refresh,
//! capture, import, backup, restore, status, bless, rebase).
//!
//! The crate knows nothing about the project it serves: base crate names come from the
//! registry, paths and the cache from [`Project`], and what a project adds (its gate grammar,
//! files generated from the series, checks of its own) through an [`Extension`]. What it keeps
//! from the project it was written for: its messages name the command line (`cargo xtask …`)
//! and the default live tree (`engine/upstream/`), and its on-disk format keeps its names
//! (`tine-hook:` markers, `Tine-Hook:` trailers, `.tine-chain-state.json`, `.tine-rebase/`,
//! `.tine-journal/`, `TINE_CRASH_AT` for the crash tests).
//!
//! Errors are typed, one enum per operation, with the paths, patch ids and hunks they concern
//! ([`error::Causes`] shows one with its sources). The commands ([`commands`], and
//! [`rebase::start`], [`rebase::continue_run`], [`rebase::abort`]) return `anyhow::Result`, as the
//! command line does.
//!
//! Modules depend one way. Each uses only modules listed before it, and exactly those in
//! parentheses (a test checks this list against the sources):
//!
//! 1. [`error`]: an error shown with its causes.
//! 2. [`crashpoint`]: test support, named points where `TINE_CRASH_AT` kills a command.
//! 3. [`tree`]: in-memory trees, manifests, hook markers, atomic writes (`crashpoint`).
//! 4. [`base85`]: git's base85 (binary literals and deltas).
//! 5. [`delta`]: git's binary delta format.
//! 6. [`patch`]: the parser (`base85`, `delta`).
//! 7. [`apply`]: the strict placer (`delta`, `patch`, `tree`).
//! 8. [`export`]: deterministic diffs of two trees (`apply`, `base85`, `patch`, `tree`).
//! 9. [`merge3`]: line-based three-way merge (`patch`).
//! 10. [`registry`]: the registry's data model, canonical rendering, lint (`tree`).
//! 11. [`base`]: obtains the pristine tree (`registry`, `tree`).
//! 12. [`project`]: a project's paths.
//! 13. [`journal`]: journaled writes of several files, finished after a kill (`crashpoint`, `project`, `tree`).
//! 14. [`extension`]: the hooks a project adds (`patch`, `project`, `registry`).
//! 15. [`rebase_state`]: the on-disk state of a running rebase (`project`, `registry`, `tree`).
//! 16. [`chain`]: the series, the live tree and its state, bless (`apply`, `base`, `extension`, `journal`, `patch`, `project`, `rebase_state`, `registry`, `tree`).
//! 17. [`verify`]: the seven proofs (`apply`, `base`, `chain`, `error`, `journal`, `project`, `registry`, `tree`).
//! 18. [`sync_check`]: registry, patch files and generated files agree (`extension`, `journal`, `patch`, `project`, `registry`, `tree`).
//! 19. [`import`]: a patch made elsewhere joins the series (`apply`, `chain`, `export`, `extension`, `patch`, `project`, `registry`, `sync_check`, `tree`).
//! 20. [`rebase`]: `rebase --onto` and its journaled run (`apply`, `base`, `chain`, `crashpoint`, `error`, `export`, `journal`, `merge3`, `patch`, `project`, `rebase_state`, `registry`, `tree`).
//! 21. [`commands`]: apply-chain, unapply, refresh, capture, backup, restore, status, bless, import, recover (`apply`, `base`, `chain`, `error`, `export`, `extension`, `import`, `journal`, `patch`, `project`, `registry`, `tree`).
pub mod apply;
pub mod base;
pub mod base85;
pub mod chain;
pub mod commands;
pub mod crashpoint;
pub mod delta;
pub mod error;
pub mod export;
pub mod extension;
pub mod import;
pub mod journal;
pub mod merge3;
pub mod patch;
pub mod project;
pub mod rebase;
pub mod rebase_state;
pub mod registry;
pub mod sync_check;
pub mod tree;
pub mod verify;

pub use extension::{Extension, NoExtension};
pub use project::Project;

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// This file's documentation is the dependency graph: the modules in an order where each uses
    /// only modules before it, each with exactly the `crate::<module>`s its source names.
    #[test]
    fn modules_depend_one_way_as_documented() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
        let mut order: Vec<(&str, BTreeSet<&str>)> = Vec::new();
        for line in lib.lines() {
            let Some((module, rest)) = line.strip_prefix("//! ").and_then(|l| l.split_once(". [`")).and_then(|(_, r)| r.split_once("`]")) else {
                continue;
            };
            let group = rest.strip_suffix(").").and_then(|r| r.rsplit_once(" (")).map(|(_, d)| d.split(", ").collect::<Vec<_>>()).unwrap_or_default();
            let deps = if group.iter().all(|d| d.len() > 2 && d.starts_with('`') && d.ends_with('`')) { group.iter().map(|d| d.trim_matches('`')).collect() } else { BTreeSet::new() };
            order.push((module, deps));
        }
        let mut on_disk: Vec<String> = std::fs::read_dir(&src).expect("src").filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".rs").map(str::to_owned)).filter(|m| m != "lib").collect();
        on_disk.sort();
        let mut listed: Vec<String> = order.iter().map(|(m, _)| m.to_string()).collect();
        listed.sort();
        assert_eq!(listed, on_disk, "every module is listed once");
        for (i, (m, documented)) in order.iter().enumerate() {
            let text = std::fs::read_to_string(src.join(format!("{m}.rs"))).expect("module source");
            let used: BTreeSet<String> =
                text.match_indices("crate::").map(|(at, _)| text[at + 7..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>()).filter(|u| u != m).collect();
            for u in &used {
                assert!(order[..i].iter().any(|(e, _)| e == u), "{m} uses crate::{u}, which is not listed before it");
            }
            let used: BTreeSet<&str> = used.iter().map(String::as_str).collect();
            assert_eq!(&used, documented, "{m}: the modules it uses, as documented");
        }
    }
}
