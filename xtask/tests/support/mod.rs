//! Helpers shared by xtask's integration test binaries (`chain`, `crash`, `rebase`); each uses
//! a part, so unused ones are not an error there.
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use patchchain::commands;
use patchchain::tree::{MODE_EXEC, MODE_FILE};
use patchchain::Project;
use xtask::Tine;

pub fn pb() -> indicatif::ProgressBar {
    indicatif::ProgressBar::hidden()
}

pub fn write_file(path: &Path, data: &[u8], mode: u32) {
    fs::create_dir_all(path.parent().expect("has parent")).expect("mkdir");
    fs::write(path, data).expect("write");
    fs::set_permissions(path, fs::Permissions::from_mode(if mode == MODE_EXEC { 0o755 } else { 0o644 })).expect("chmod");
}

/// Numbered lines `prefix1\n..prefixN\n`.
pub fn numbered(prefix: &str, n: usize) -> String {
    (1..=n).map(|i| format!("{prefix}{i}\n")).collect()
}

/// `text` with line `n` (1-based) replaced.
pub fn set_line(text: &str, n: usize, new: &str) -> String {
    text.lines().enumerate().map(|(i, l)| if i + 1 == n { format!("{new}\n") } else { format!("{l}\n") }).collect()
}

/// A project in a temporary directory whose `dir:` base `base/` holds `files`, blessed, with
/// the empty chain applied.
pub fn dir_base_project(files: &[(&str, &[u8])]) -> (tempfile::TempDir, Project) {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = Project::new(dir.path());
    for (path, data) in files {
        write_file(&dir.path().join("base").join(path), data, MODE_FILE);
    }
    fs::create_dir_all(p.patches_dir()).expect("mkdir patches");
    write_file(&p.registry_path(), b"[base]\nkind = \"dir\"\npath = \"base\"\n", MODE_FILE);
    commands::bless(&p, &Tine, true, &pb()).expect("bless the new base");
    commands::apply_chain(&p, None, &pb()).expect("apply the empty chain");
    (dir, p)
}
