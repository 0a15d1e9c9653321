//! What Tine adds to [`patchchain`]: where the project and its cache are, and the [`Extension`]
//! hooks (the gate grammar, the generated `tine-patch-tests` manifest, the test-gate check).

use std::path::PathBuf;

use patchchain::extension::{Extension, GateSpecError};
use patchchain::patch::PatchSet;
use patchchain::registry::{PatchEntry, Registry};
use patchchain::Project;

use crate::gate::{self, Gate};

/// Where Tine caches bases and models: `$TINE_CACHE_DIR`, else `$XDG_CACHE_HOME/tine`, else `~/.cache/tine`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TINE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("tine");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("tine")
}

/// The project at `root`, with Tine's cache.
pub fn project_at(root: impl Into<PathBuf>) -> Project {
    Project::new(root).with_cache_dir(cache_dir())
}

/// The project this xtask belongs to: the parent of the `xtask/` package (`TINE_PROJECT_ROOT`
/// overrides, for tests).
pub fn project() -> Project {
    if let Some(r) = std::env::var_os("TINE_PROJECT_ROOT") {
        return project_at(r);
    }
    let manifest_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    project_at(manifest_dir.parent().expect("xtask/ lies inside the project root"))
}

/// Tine's hooks into the generic toolchain.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tine;

impl Extension for Tine {
    /// The gate runner's grammar; engine gates only from `[engine] builds_from` on.
    fn check_gate(&self, reg: &Registry, patch: &PatchEntry, name: &str) -> Result<(), GateSpecError> {
        let g = Gate::parse(name).map_err(|e| GateSpecError::Malformed(Box::new(e)))?;
        gate::check_placement(reg, patch, name, &g).map_err(|e| GateSpecError::Misplaced(Box::new(e)))
    }

    /// `engine/crates/tine-patch-tests/Cargo.toml`, when the engine crates are there.
    fn generated_files(&self, p: &Project, reg: &Registry, series: &[&PatchSet]) -> Vec<(PathBuf, Vec<u8>)> {
        if !gate::engine_crates_dir(p).is_dir() {
            return Vec::new();
        }
        let tests = gate::patch_test_files_of_series(series, &gate::test_crates(reg));
        vec![(gate::harness_manifest_path(p), gate::harness_manifest(&tests).into_bytes())]
    }

    /// A `test:-p tine-patch-tests --test <file>` gate needs a patch up to this one that adds the file.
    fn patch_problems(&self, _: &Project, reg: &Registry, e: &PatchEntry, series: &[&PatchSet]) -> Vec<String> {
        let have = gate::patch_test_files_of_series(series, &gate::test_crates(reg));
        let mut problems = Vec::new();
        for g in &e.gates {
            if let Some(t) = Gate::parse(g).ok().as_ref().and_then(|g| g.patch_test().map(str::to_owned)) {
                if !have.contains_key(&t) {
                    problems.push(format!("patch {}: gate {g:?} runs test file {t}.rs, which no patch up to this one adds under <crate>/tests/", e.id));
                }
            }
        }
        problems
    }
}
