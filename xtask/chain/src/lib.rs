//! A fork kept as a pinned pristine base plus a numbered series of git-style patches: trees,
//! the byte-exact parser, the strict placer, the exporter, the registry, the live tree, the
//! proofs (`verify`, `sync_check`), and the commands over them (apply, unapply, refresh,
//! capture, import, backup, restore, status, bless, rebase).
//!
//! The crate knows nothing about the project it serves: base crate names come from the
//! registry, paths from [`Project`], and what a project adds (its gate grammar, files generated
//! from the series, checks of its own) through an [`Extension`].
//!
//! Modules depend one way. Each uses only modules listed before it:
//!
//! 1. [`tree`]: in-memory trees, manifests, hook markers, atomic writes.
//! 2. [`base85`]: git's base85 (binary literals and deltas).
//! 3. [`delta`]: git's binary delta format.
//! 4. [`patch`]: the parser (`base85`).
//! 5. [`apply`]: the strict placer (`tree`, `patch`, `delta`).
//! 6. [`export`]: deterministic diffs of two trees (`tree`, `patch`, `base85`, `apply`).
//! 7. [`merge3`]: line-based three-way merge (`patch`).
//! 8. [`registry`]: the registry's data model, canonical rendering, lint.
//! 9. [`base`]: obtains the pristine tree (`tree`, `registry`).
//! 10. [`project`]: a project's paths.
//! 11. [`extension`]: the hooks a project adds (`patch`, `project`, `registry`).
//! 12. [`rebase_state`]: the on-disk state of a running rebase (`tree`, `project`, `registry`).
//! 13. [`chain`]: the series, the live tree and its state, bless (`apply`, `base`, `extension`, `patch`, `project`, `rebase_state`, `registry`, `tree`).
//! 14. [`verify`]: the seven proofs (`apply`, `base`, `chain`, `project`, `registry`, `tree`).
//! 15. [`sync_check`]: registry, patch files and generated files agree (`extension`, `patch`, `project`, `registry`, `tree`).
//! 16. [`import`]: a patch made elsewhere joins the series (`apply`, `chain`, `export`, `extension`, `patch`, `project`, `registry`, `sync_check`, `tree`).
//! 17. [`rebase`]: `rebase --onto` (`apply`, `base`, `chain`, `export`, `merge3`, `patch`, `project`, `rebase_state`, `registry`, `tree`).
//! 18. [`commands`]: apply-chain, unapply, refresh, capture, backup, restore, status, bless, import (`apply`, `base`, `chain`, `export`, `extension`, `import`, `patch`, `project`, `registry`, `tree`).

pub mod apply;
pub mod base;
pub mod base85;
pub mod chain;
pub mod commands;
pub mod delta;
pub mod export;
pub mod extension;
pub mod import;
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
    /// The order in this file's documentation is the dependency order: every `crate::<module>`
    /// a module's source names is listed before it.
    #[test]
    fn modules_depend_one_way_in_the_documented_order() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
        let order: Vec<&str> = lib.lines().filter_map(|l| l.strip_prefix("//! ")?.split_once(". [`")?.1.split_once("`]").map(|(m, _)| m)).collect();
        let mut on_disk: Vec<String> = std::fs::read_dir(&src).expect("src").filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".rs").map(str::to_owned)).filter(|m| m != "lib").collect();
        on_disk.sort();
        let mut listed: Vec<String> = order.iter().map(|m| m.to_string()).collect();
        listed.sort();
        assert_eq!(listed, on_disk, "every module is listed once");
        for (i, m) in order.iter().enumerate() {
            let text = std::fs::read_to_string(src.join(format!("{m}.rs"))).expect("module source");
            for (at, _) in text.match_indices("crate::") {
                let used: String = text[at + 7..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                if used != *m {
                    assert!(order[..i].contains(&used.as_str()), "{m} uses crate::{used}, which is not listed before it");
                }
            }
        }
    }
}
