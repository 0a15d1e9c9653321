//! What Tine adds to [`patchchain`]: the [`Extension`] hooks (the gate grammar, the generated
//! `tine-patch-tests` manifest, the test-gate check). The top of the crate: it reads
//! [`crate::gate`], and nothing below it reads this module.

use std::path::PathBuf;

use patchchain::extension::{Extension, GateSpecError};
use patchchain::patch::PatchSet;
use patchchain::registry::{PatchEntry, Registry};
use patchchain::Project;

use crate::gate::{self, Gate};

/// Tine's hooks into the generic toolchain.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tine;

/// The areas Tine sorts its patches into (the registry's `area`).
pub const AREAS: &[&str] = &["kernels", "kv", "mtp", "tokenizer", "model", "attention", "quant", "sampling", "build", "api", "other"];

impl Extension for Tine {
    fn areas(&self) -> &[&'static str] {
        AREAS
    }

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
