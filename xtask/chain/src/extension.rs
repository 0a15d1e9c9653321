//! What a project adds to the generic toolchain: its gate grammar, its patch areas, files
//! generated from the series, and checks of its own. The generic code calls these hooks and knows nothing else
//! about the project; [`NoExtension`] adds nothing.

use std::path::PathBuf;

use crate::patch::PatchSet;
use crate::project::Project;
pub use crate::registry::GateSpecError;
use crate::registry::{PatchEntry, Registry};

pub trait Extension {
    /// Checks one gate of `patch`'s suite against the project's gate grammar (`lint` reports the
    /// error as `patch NNNN: <error>`). The default accepts every name.
    fn check_gate(&self, reg: &Registry, patch: &PatchEntry, gate: &str) -> Result<(), GateSpecError> {
        let _ = (reg, patch, gate);
        Ok(())
    }

    /// Files generated from the applied series (absolute path, bytes): `bless` writes them, and
    /// `sync-check` reports one whose bytes differ as stale. The default generates none.
    fn generated_files(&self, p: &Project, reg: &Registry, series: &[&PatchSet]) -> Vec<(PathBuf, Vec<u8>)> {
        let _ = (p, reg, series);
        Vec::new()
    }

    /// The registry `area`s this project sorts its patches into: `sync-check` and `import --area`
    /// refuse any other. The default, empty, takes any lowercase word.
    fn areas(&self) -> &[&'static str] {
        &[]
    }

    /// Extra `sync-check` problems of `patch`, given the applied series up to and including it
    /// (reported after its file checks, before its trailer checks). The default finds none.
    fn patch_problems(&self, p: &Project, reg: &Registry, patch: &PatchEntry, series: &[&PatchSet]) -> Vec<String> {
        let _ = (p, reg, patch, series);
        Vec::new()
    }
}

/// The toolchain alone: every gate name accepted, nothing generated, no extra checks.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoExtension;

impl Extension for NoExtension {}
