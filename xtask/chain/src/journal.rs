//! Journaled writes of several project files at once (the registry, a patch, the docs, the
//! manifests, the live tree's state file): all or nothing, even under kill -9.
//!
//! Every file of the change is staged in a scratch directory beside the journal first; one
//! rename of it to `.tine-journal/` commits the change. Before that rename the project is
//! untouched (the scratch is removed as stale by the next commit). After it, the files are
//! written one by one, each atomically, and the journal is removed last, so a run that dies
//! in between leaves a journal that [`recover`] finishes (rolling forward, idempotently).
//! While a journal is pending the project is mid-change: the chain commands that only read
//! ([`pending`]) refuse and say so; the writing ones finish it first.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::crashpoint::crashpoint;
use crate::project::Project;
use crate::tree::{self, WriteError};

/// The journal directory of a project (git-ignored).
pub fn dir(p: &Project) -> PathBuf {
    p.root.join(".tine-journal")
}

#[derive(Debug, Serialize, Deserialize)]
struct Plan {
    /// The command whose change this is, for messages.
    what: String,
    /// Project-relative paths in writing order: `true` writes `files/<index>`, `false` removes.
    files: Vec<(String, bool)>,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error("{shown} is damaged ({why}); it holds an interrupted change whose files may be half written: compare them with `git status`, then remove {shown}")]
    Damaged { shown: String, why: String },
    #[error("{shown}: path {path:?} lies outside the project")]
    Outside { shown: String, path: String },
    #[error("an interrupted `{what}` is still pending in {shown}; run `cargo xtask recover` to finish it")]
    Pending { what: String, shown: String },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> JournalError {
    let context = context.into();
    move |source| JournalError::Io { context, source }
}

/// The command of a pending (committed, not yet fully written) journal.
pub fn pending(p: &Project) -> Option<String> {
    let plan = dir(p).join("plan.json");
    if !plan.exists() {
        return None;
    }
    let what = fs::read(&plan).ok().and_then(|b| serde_json::from_slice::<Plan>(&b).ok()).map(|pl| pl.what).unwrap_or_else(|| "unknown command".into());
    Some(what)
}

/// Refuses while a journal is pending: the project is mid-change.
pub fn check_none_pending(p: &Project) -> Result<(), JournalError> {
    match pending(p) {
        Some(what) => Err(JournalError::Pending { what, shown: p.rel(&dir(p)).into_owned() }),
        None => Ok(()),
    }
}

/// Writes `files` (absolute paths under the project root; `None` removes) as one change.
pub fn commit(p: &Project, what: &str, files: &[(PathBuf, Option<Vec<u8>>)]) -> Result<(), JournalError> {
    check_none_pending(p)?;
    let jdir = dir(p);
    let name = jdir.file_name().expect("named").to_string_lossy().into_owned();
    remove_dead(&p.root, &format!("{name}.new-"));
    remove_dead(&p.root, &format!("{name}.done-"));
    let stage = p.root.join(format!("{name}.new-{}", std::process::id()));
    let _ = fs::remove_dir_all(&stage);
    fs::create_dir_all(stage.join("files")).map_err(io(format!("creating {}", stage.display())))?;
    let mut plan = Plan { what: what.to_owned(), files: Vec::new() };
    for (i, (path, data)) in files.iter().enumerate() {
        let rel = path
            .strip_prefix(&p.root)
            .ok()
            .and_then(|r| r.to_str())
            .filter(|r| tree::is_safe_path(r))
            .ok_or_else(|| JournalError::Outside { shown: p.rel(&jdir).into_owned(), path: path.display().to_string() })?;
        if let Some(d) = data {
            write_synced(&stage.join("files").join(i.to_string()), d)?;
        }
        plan.files.push((rel.to_owned(), data.is_some()));
    }
    write_synced(&stage.join("plan.json"), &serde_json::to_vec_pretty(&plan).expect("plan serialises"))?;
    crashpoint("journal-staged");
    // The commit point: before this rename nothing in the project changed.
    fs::rename(&stage, &jdir).map_err(io(format!("committing {}", jdir.display())))?;
    crashpoint("journal-committed");
    finish(p)?;
    Ok(())
}

/// Finishes a pending journal, if there is one; returns the command it belonged to.
pub fn recover(p: &Project) -> Result<Option<String>, JournalError> {
    if !dir(p).join("plan.json").exists() {
        return Ok(None);
    }
    finish(p).map(Some)
}

fn finish(p: &Project) -> Result<String, JournalError> {
    let jdir = dir(p);
    let shown = p.rel(&jdir).into_owned();
    let damaged = |why: String| JournalError::Damaged { shown: shown.clone(), why };
    let bytes = fs::read(jdir.join("plan.json")).map_err(|e| damaged(format!("plan.json: {e}")))?;
    let plan: Plan = serde_json::from_slice(&bytes).map_err(|e| damaged(format!("plan.json: {e}")))?;
    for (i, (rel, write)) in plan.files.iter().enumerate() {
        if !tree::is_safe_path(rel) {
            return Err(JournalError::Outside { shown, path: rel.clone() });
        }
        let full = p.root.join(rel);
        if *write {
            let data = fs::read(jdir.join("files").join(i.to_string())).map_err(|e| damaged(format!("files/{i} ({rel}): {e}")))?;
            // Idempotent: a file already written (by the run that died) is left alone.
            if fs::read(&full).ok().as_deref() != Some(&data[..]) {
                tree::write_file_atomically(&full, &data)?;
            }
        } else if full.exists() {
            fs::remove_file(&full).map_err(io(format!("removing {}", full.display())))?;
        }
        crashpoint("journal-wrote");
    }
    // Rename first, so a half-deleted journal never looks pending.
    let name = jdir.file_name().expect("named").to_string_lossy().into_owned();
    let done = p.root.join(format!("{name}.done-{}", std::process::id()));
    fs::rename(&jdir, &done).map_err(io(format!("closing {}", jdir.display())))?;
    crashpoint("journal-closed");
    let _ = fs::remove_dir_all(&done);
    Ok(plan.what)
}

fn write_synced(path: &Path, data: &[u8]) -> Result<(), JournalError> {
    use std::io::Write as _;
    let mut f = fs::File::create(path).map_err(io(format!("writing {}", path.display())))?;
    f.write_all(data).map_err(io(format!("writing {}", path.display())))?;
    f.sync_all().map_err(io(format!("writing {}", path.display())))
}

/// Staging and closed journals of processes that are gone.
fn remove_dead(parent: &Path, prefix: &str) {
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let n = e.file_name();
        let Some(pid) = n.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        if pid == std::process::id().to_string() || !Path::new("/proc").join(pid).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}
