//! The on-disk state of a running rebase (`.tine-rebase/state.json`), apart from the run itself,
//! so the chain commands can refuse to run while one is in progress without depending on
//! the rest of `rebase`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::project::Project;
use crate::registry::{self, Base};
use crate::tree;

/// One conflicted file, for the maintainer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConflictFile {
    pub path: String,
    pub hunks: Vec<usize>,
    pub reason: String,
}

/// Decisions and resolutions a real run has collected so far.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Resolutions {
    /// Patch id -> the maintainer's resolved patch bytes against the new chain before it.
    pub resolved: BTreeMap<String, String>,
    /// Patch ids the maintainer chose to retire.
    pub retire: BTreeSet<String>,
}

/// Where a running bump keeps its state (git-ignored).
pub fn state_dir(p: &Project) -> PathBuf {
    p.rebase_dir()
}

pub fn in_progress(p: &Project) -> bool {
    state_dir(p).join("state.json").exists()
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum Phase {
    /// Carrying patches; `stopped` says where a person is needed.
    Carrying,
    /// Every file of the result is staged in `commit/`; writing them out.
    Commit,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stopped {
    pub id: String,
    pub kind: String,
    pub files: Vec<ConflictFile>,
    /// The manifest of the tree written into engine/upstream/ for the maintainer.
    pub tree_sha256: String,
    /// Conflicted files written without markers (binary, mode, modify/delete, add/add of equal
    /// text): path -> sha256 of what was written (`None`: not written). `--continue` wants them
    /// changed, or named with `--accept`.
    #[serde(default)]
    pub unmarked: std::collections::BTreeMap<String, Option<String>>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RebaseState {
    pub from: String,
    pub onto: String,
    pub onto_base: BaseRecord,
    pub phase: Phase,
    #[serde(default)]
    pub stopped: Option<Stopped>,
    #[serde(default)]
    pub resolutions: Resolutions,
    /// Project-relative paths the run may write, and whether each existed at the start
    /// (the originals are under `orig/`).
    pub write_set: BTreeMap<String, bool>,
    /// engine/upstream/ existed at the start (its snapshot is `orig-upstream.tar`).
    pub had_upstream: bool,
    /// Files to write in the commit phase (staged under `commit/`; `false`: delete).
    #[serde(default)]
    pub commit: BTreeMap<String, bool>,
}

/// A base as stored in the state (the registry's own `Base` is not serialisable as JSON).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum BaseRecord {
    Crates(Vec<(String, String, String)>),
    Dir(String),
    Git(String, String, Vec<String>),
}

impl BaseRecord {
    pub fn of(b: &Base) -> BaseRecord {
        match b {
            Base::Crates { crates } => BaseRecord::Crates(crates.iter().map(|c| (c.name.clone(), c.version.clone(), c.sha256.clone())).collect()),
            Base::Dir { path } => BaseRecord::Dir(path.clone()),
            Base::Git { url, commit, include } => BaseRecord::Git(url.clone(), commit.clone(), include.clone()),
        }
    }
    pub fn base(&self) -> Base {
        match self {
            BaseRecord::Crates(c) => Base::Crates { crates: c.iter().map(|(n, v, s)| registry::CratePin { name: n.clone(), version: v.clone(), sha256: s.clone() }).collect() },
            BaseRecord::Dir(p) => Base::Dir { path: p.clone() },
            BaseRecord::Git(u, c, i) => Base::Git { url: u.clone(), commit: c.clone(), include: i.clone() },
        }
    }
}

/// Reading the state of a run.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("no rebase is in progress")]
    NotInProgress,
    #[error("{shown} is corrupt: {err}")]
    Corrupt { shown: String, err: serde_json::Error },
}

pub fn read_state(p: &Project) -> Result<RebaseState, StateError> {
    let path = state_dir(p).join("state.json");
    let bytes = fs::read(&path).map_err(|_| StateError::NotInProgress)?;
    serde_json::from_slice(&bytes).map_err(|err| StateError::Corrupt { shown: p.rel(&path).into_owned(), err })
}

pub fn write_state(p: &Project, s: &RebaseState) -> Result<(), tree::WriteError> {
    let mut v = serde_json::to_vec_pretty(s).expect("state serialises");
    v.push(b'\n');
    tree::write_file_atomically(&state_dir(p).join("state.json"), &v)
}

/// A short description of a run in progress, for `status`.
pub fn describe_in_progress(p: &Project) -> Option<String> {
    if !state_dir(p).join("state.json").exists() {
        return None;
    }
    let s = match read_state(p) {
        Ok(s) => s,
        // An unreadable state still means a run is under way: nothing else may touch the chain.
        Err(e) => return Some(format!("a rebase is in progress but its state is unreadable ({e:#}); `cargo xtask rebase --abort` puts the project back")),
    };
    Some(match (&s.phase, &s.stopped) {
        (Phase::Commit, _) => format!("rebase {} -> {}: interrupted while writing the result; `cargo xtask rebase --continue` finishes it", s.from, s.onto),
        (_, Some(st)) if st.kind == "decide" => {
            format!("rebase {} -> {}: stopped at patch {}, which the new base already has; `cargo xtask rebase --continue --retire`, or `--abort`", s.from, s.onto, st.id)
        }
        (_, Some(st)) => format!("rebase {} -> {}: stopped at patch {} ({}); resolve, then `cargo xtask rebase --continue`, or `--abort`", s.from, s.onto, st.id, st.kind),
        _ => format!("rebase {} -> {}: interrupted; `cargo xtask rebase --continue` resumes it", s.from, s.onto),
    })
}
