//! `rebase --onto`: carries the patch series from the pinned base to a new upstream base.
//!
//! Every patch is carried by a three-way merge whose ancestor is the *old* chain prefix (the
//! pinned pristine base plus the patches before it): ours is that prefix plus the patch, theirs
//! is the new base plus the already-carried patches before it. A hunk is therefore placed by
//! where its lines went in upstream's own change, never by searching for its context, and an
//! upstream edit next to a hunk merges instead of failing. Each hunk is classified
//! (`exact | offset | merged | upstream | conflict`), each patch gets a verdict
//! (`exact | rebased | upstream | partial-upstream | conflict`), and carried patches are
//! re-exported against the new base and applied back before anything is written.
//!
//! The real run is resumable: its state lives in `.tine-rebase/` (original files, the new base,
//! the maintainer's resolutions); the project itself is written only in a final, journaled
//! commit phase. The carried series is recomputed from the state on every `--continue`
//! (the merge is deterministic), so the state holds decisions, never half-done work.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::apply;
use crate::base::BaseError;
use crate::chain::{self, LoadedPatch, Refused};
use crate::error::Causes;
use crate::export;
use crate::merge3::{self, Side};
use crate::patch::{self, Content, FilePatch, Hunk, Op, PatchSet};
use crate::project::Project;
pub use crate::rebase_state::{describe_in_progress, in_progress, state_dir, BaseRecord, ConflictFile, Phase, RebaseState, Resolutions, Stopped};
use crate::rebase_state::{read_state, write_state};
use crate::registry::{self, Base, Registry};
use crate::tree::{self, Entry, Tree};

/// A new base named on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OntoSpec {
    /// Every pinned base crate at this version.
    Crates(String),
    Dir(String),
    Git {
        url: String,
        commit: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("bad base spec {0:?}: expected crates:VERSION, dir:PATH or git:URL@COMMIT")]
    Malformed(String),
    #[error("`crates:{0}` needs a crates base, but the registry's base is a {1}")]
    NotCrates(String, &'static str),
}

impl OntoSpec {
    pub fn parse(s: &str) -> Result<OntoSpec, SpecError> {
        let bad = || SpecError::Malformed(s.to_owned());
        let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
        match kind {
            "crates" if !rest.is_empty() && !rest.contains(['/', ' ']) => Ok(OntoSpec::Crates(rest.to_owned())),
            "dir" if !rest.is_empty() => Ok(OntoSpec::Dir(rest.to_owned())),
            "git" => {
                let (url, commit) = rest.rsplit_once('@').ok_or_else(bad)?;
                if url.is_empty() || commit.len() != 40 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(bad());
                }
                Ok(OntoSpec::Git { url: url.to_owned(), commit: commit.to_ascii_lowercase() })
            }
            _ => Err(bad()),
        }
    }
}

/// A short, file-name-safe label of a base: `0.11.1`, `dir-NAME`, `git-COMMIT12`.
pub fn base_label(b: &Base) -> String {
    match b {
        Base::Crates { crates } => {
            let versions: BTreeSet<&str> = crates.iter().map(|c| c.version.as_str()).collect();
            if versions.len() == 1 {
                versions.into_iter().next().expect("one").to_owned()
            } else {
                crates.iter().map(|c| format!("{}-{}", c.name, c.version)).collect::<Vec<_>>().join("+")
            }
        }
        Base::Dir { path } => {
            let name = Path::new(path).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "dir".into());
            format!("dir-{}", name.replace(|c: char| !c.is_ascii_alphanumeric() && c != '.' && c != '-' && c != '_', "_"))
        }
        Base::Git { commit, .. } => format!("git-{}", commit.chars().take(12).collect::<String>()),
    }
}

/// The spec string that names a base.
pub fn base_spec(b: &Base) -> String {
    match b {
        Base::Crates { .. } => format!("crates:{}", base_label(b)),
        Base::Dir { path } => format!("dir:{path}"),
        Base::Git { url, commit, .. } => format!("git:{url}@{commit}"),
    }
}

/// The registry base for `spec`, with crate sha256s learned from the package registry.
/// Why the new base cannot be named.
#[derive(Debug, thiserror::Error)]
pub enum OntoError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Base(#[from] BaseError),
}

pub fn resolve_onto(spec: &OntoSpec, current: &Base, cache: &Path, progress: &indicatif::ProgressBar) -> Result<Base, OntoError> {
    Ok(match spec {
        OntoSpec::Crates(version) => {
            let Base::Crates { crates } = current else {
                return Err(SpecError::NotCrates(version.clone(), if matches!(current, Base::Dir { .. }) { "directory" } else { "git commit" }).into());
            };
            let names: Vec<&str> = crates.iter().map(|c| c.name.as_str()).collect();
            Base::Crates { crates: crate::base::resolve_crates(&names, version, cache, progress)? }
        }
        OntoSpec::Dir(path) => Base::Dir { path: path.clone() },
        OntoSpec::Git { url, commit } => {
            let include = match current {
                Base::Git { include, .. } => include.clone(),
                _ => Vec::new(),
            };
            Base::Git { url: url.clone(), commit: commit.clone(), include }
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Classification

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// Same lines, same place.
    Exact,
    /// Same lines, moved by `offset`.
    Offset,
    /// Upstream changed its context (or part of it is upstream); the merge is clean.
    Merged,
    /// The new base already has this change.
    Upstream,
    Conflict,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Exact,
    Rebased,
    Upstream,
    PartialUpstream,
    Conflict,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Exact => "exact",
            Verdict::Rebased => "rebased",
            Verdict::Upstream => "upstream",
            Verdict::PartialUpstream => "partial-upstream",
            Verdict::Conflict => "conflict",
        }
    }
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Exact => "exact",
            Class::Offset => "offset",
            Class::Merged => "merged",
            Class::Upstream => "upstream",
            Class::Conflict => "conflict",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HunkReport {
    pub file: String,
    /// 1-based hunk number within the file's section; file-level changes (create, delete,
    /// mode, binary, pure rename) are reported as hunk 1.
    pub hunk: usize,
    pub class: Class,
    /// The hunk's first line on the old base (its `@@ -N`).
    pub old_line: usize,
    /// Where that line is on the new base, when the hunk was placed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_line: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<i64>,
    /// Why it merged or conflicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The file was renamed upstream; the hunk followed it to `file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renamed_from: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PatchReport {
    pub id: String,
    pub file: String,
    pub verdict: Verdict,
    pub hunks: Vec<HunkReport>,
    /// What the run does with it: `keep` (unchanged bytes), `re-export`, `retire`, `decide`, `stop`.
    pub action: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub from: String,
    pub onto: String,
    pub patches: Vec<PatchReport>,
}

impl Report {
    pub fn count(&self, v: Verdict) -> usize {
        self.patches.iter().filter(|p| p.verdict == v).count()
    }
    /// Every patch carries over without a maintainer (exact or rebased).
    pub fn clean(&self) -> bool {
        self.patches.iter().all(|p| matches!(p.verdict, Verdict::Exact | Verdict::Rebased))
    }
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).expect("reports serialise");
        v.push(b'\n');
        v
    }
}

/// Pending changes on top of a tree (`None` deletes).
pub type Overlay = BTreeMap<String, Option<Entry>>;

fn get<'a>(tree: &'a Tree, overlay: &'a Overlay, path: &str) -> Option<&'a Entry> {
    match overlay.get(path) {
        Some(e) => e.as_ref(),
        None => tree.get(path),
    }
}

/// A patch carried onto the new prefix.
pub struct Carried {
    pub report: PatchReport,
    /// The new prefix's changes for this patch (conflicts resolved as the caller asked).
    pub merged: Overlay,
    pub conflicts: Vec<ConflictFile>,
}

#[derive(Clone, Copy)]
pub enum Mode<'a> {
    /// Conflicts take the patch's side so the rest of the stack can still be classified.
    Classify,
    /// Conflicts are written with diff3 markers under these labels.
    Markers { ours: &'a str, base: &'a str, theirs: &'a str },
}

fn lines(data: &[u8]) -> Vec<&[u8]> {
    patch::split_lines(data)
}

fn is_binary(data: &[u8]) -> bool {
    data[..data.len().min(8000)].contains(&0)
}

/// Share of `a`'s lines that `b` keeps, as git's rename detection scores it (roughly).
fn similarity(a: &[u8], b: &[u8]) -> f64 {
    let (la, lb) = (lines(a), lines(b));
    if la.is_empty() || lb.is_empty() {
        return 0.0;
    }
    let same: usize = similar::capture_diff_slices(similar::Algorithm::Myers, &la, &lb)
        .iter()
        .map(|op| match op {
            similar::DiffOp::Equal { len, .. } => *len,
            _ => 0,
        })
        .sum();
    same as f64 / la.len().max(lb.len()) as f64
}

/// Where a file that upstream removed went: the one file upstream added that keeps at least
/// 80% of its lines, with no rival within 10 points (a shared licence header is not a rename).
fn follow_rename(path: &str, data: &[u8], old_prev: &Tree, new_prev: &Tree) -> Option<String> {
    let mut scored: Vec<(f64, &String)> = Vec::new();
    for (cand, e) in new_prev {
        if old_prev.contains_key(cand) || cand == path {
            continue;
        }
        let s = if e.data == data { 1.0 } else { similarity(data, &e.data) };
        if s >= 0.5 {
            scored.push((s, cand));
        }
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    match scored.as_slice() {
        [(best, p), rest @ ..] if *best >= 0.8 && rest.first().is_none_or(|(s, _)| best - s >= 0.1) => Some((*p).clone()),
        _ => None,
    }
}

fn file_level(file: &str, class: Class, reason: Option<String>) -> HunkReport {
    HunkReport { file: file.to_owned(), hunk: 1, class, old_line: 0, new_line: None, offset: None, reason, renamed_from: None }
}

/// The hunk's lines on the ancestor: [start, end), 0-based.
fn hunk_range(h: &Hunk) -> (usize, usize) {
    let start = if h.old_count == 0 { h.old_start } else { h.old_start.saturating_sub(1) };
    (start, start + h.old_count)
}

/// Where ancestor line `idx` is in theirs.
fn to_theirs(chunks: &[merge3::Chunk], idx: usize, insertion: bool) -> usize {
    for c in chunks {
        // An existing line sits after anything upstream inserted before it; an insertion point
        // sits before it.
        if c.base.is_empty() && !insertion {
            continue;
        }
        if idx < c.base.end || (idx == c.base.start && c.base.is_empty()) {
            if idx < c.base.start {
                continue;
            }
            return match c.change {
                // Theirs equals the ancestor here, line for line.
                None | Some(Side::Ours) => c.theirs.start + (idx - c.base.start),
                _ => c.theirs.start,
            };
        }
    }
    chunks.last().map(|c| c.theirs.end).unwrap_or(0)
}

/// Classifies the text hunks of one file from the merge chunks.
fn classify_hunks(file: &str, hunks: &[Hunk], chunks: &[merge3::Chunk], renamed_from: Option<&str>) -> Vec<HunkReport> {
    let mut out = Vec::new();
    for (k, h) in hunks.iter().enumerate() {
        let (hs, he) = hunk_range(h);
        // Ours-side changes inside the hunk (closed range: an insertion may sit at either edge).
        let ours: Vec<&merge3::Chunk> = chunks.iter().filter(|c| matches!(c.change, Some(Side::Ours | Side::Same | Side::Both | Side::Conflict)) && c.base.start <= he && c.base.end >= hs).collect();
        // Upstream changes strictly inside the hunk's lines (its context).
        let theirs: Vec<&merge3::Chunk> =
            chunks.iter().filter(|c| c.change == Some(Side::Theirs) && if c.base.is_empty() { c.base.start > hs && c.base.start < he } else { c.base.start < he && c.base.end > hs }).collect();
        let span = |c: &merge3::Chunk| {
            if c.base.is_empty() {
                format!("after line {}", c.base.start)
            } else {
                format!("lines {}-{}", c.base.start + 1, c.base.end)
            }
        };
        let mut r =
            HunkReport { file: file.to_owned(), hunk: k + 1, class: Class::Exact, old_line: h.old_start, new_line: None, offset: None, reason: None, renamed_from: renamed_from.map(str::to_owned) };
        if let Some(c) = ours.iter().find(|c| c.change == Some(Side::Conflict)) {
            r.class = Class::Conflict;
            r.reason = Some(format!("overlapping change: upstream changed the ancestor's {} differently", span(c)));
        } else if !ours.is_empty() && ours.iter().all(|c| c.change == Some(Side::Same)) {
            r.class = Class::Upstream;
        } else {
            let t = to_theirs(chunks, hs, h.old_count == 0);
            r.new_line = Some(if h.old_count == 0 { t } else { t + 1 });
            let offset = t as i64 - hs as i64;
            if let Some(c) = ours.iter().find(|c| c.change == Some(Side::Both)) {
                r.class = Class::Merged;
                r.reason = Some(format!("upstream changed the ancestor's {} next to the hunk's change", span(c)));
                r.offset = Some(offset);
            } else if let Some(c) = theirs.first() {
                r.class = Class::Merged;
                r.reason = Some(format!("upstream changed context {}", span(c)));
                r.offset = Some(offset);
            } else if ours.iter().any(|c| c.change == Some(Side::Same)) {
                r.class = Class::Merged;
                r.reason = Some("part of the hunk is already upstream".into());
                r.offset = Some(offset);
            } else if offset != 0 {
                r.class = Class::Offset;
                r.offset = Some(offset);
            }
        }
        out.push(r);
    }
    out
}

/// Both sides changed a file's mode, differently.
#[derive(Debug, thiserror::Error)]
#[error("mode: the patch sets {ours:o}, upstream set {theirs:o}")]
struct ModeConflict {
    ours: u32,
    theirs: u32,
}

fn mode_merge(a: u32, o: u32, t: u32) -> Result<u32, ModeConflict> {
    if o == a || t == o {
        Ok(t)
    } else if t == a {
        Ok(o)
    } else {
        Err(ModeConflict { ours: o, theirs: t })
    }
}

/// Carries one patch from `old_prev` (old chain before it) onto `new_prev` (new chain before it).
pub fn carry(lp: &LoadedPatch, old_prev: &Tree, new_prev: &Tree, mode: Mode<'_>) -> Result<Carried, Box<apply::ApplyError>> {
    let ours_overlay = apply::plan(old_prev, &lp.parsed, false).map_err(|e| Box::new(apply::ApplyError { patch: lp.name().to_owned(), ..e }))?;
    let mut merged = Overlay::new();
    let mut hunks = Vec::new();
    let mut conflicts = Vec::new();
    for fp in &lp.parsed.files {
        carry_file(fp, old_prev, new_prev, &ours_overlay, mode, &mut merged, &mut hunks, &mut conflicts);
    }
    // A conflict the merge found outside every hunk's lines (its own diff placed the change
    // elsewhere) still stops the patch: name it on the file's nearest hunk.
    for c in &conflicts {
        if !hunks.iter().any(|h| h.file == c.path && h.class == Class::Conflict) {
            if let Some(h) = hunks.iter_mut().find(|h| h.file == c.path) {
                h.class = Class::Conflict;
                h.reason = Some(format!("{}: the merge conflicts near this hunk", c.reason));
            }
        }
    }
    let verdict = if hunks.iter().any(|h| h.class == Class::Conflict) || !conflicts.is_empty() {
        Verdict::Conflict
    } else if hunks.iter().all(|h| h.class == Class::Upstream) {
        Verdict::Upstream
    } else if hunks.iter().any(|h| h.class == Class::Upstream) {
        Verdict::PartialUpstream
    } else if hunks.iter().all(|h| h.class == Class::Exact) {
        Verdict::Exact
    } else {
        Verdict::Rebased
    };
    // A hunk-level "upstream" can leave nothing to carry at all.
    let no_change = merged.iter().all(|(p, e)| new_prev.get(p) == e.as_ref());
    let verdict = match verdict {
        v if no_change && v != Verdict::Conflict => Verdict::Upstream,
        // Every hunk is upstream but a mode change or a rename is not.
        Verdict::Upstream if !no_change => Verdict::PartialUpstream,
        v => v,
    };
    // A patch's own new test files never land upstream byte for byte: when every other change
    // is upstream, the patch is upstream and its tests leave with it.
    let own_tests: BTreeSet<&str> = lp.parsed.files.iter().filter(|f| f.op == Op::Create).filter_map(|f| f.new_path.as_deref()).filter(|p| is_test_path(p)).collect();
    let mut notes = Vec::new();
    let rest_upstream = merged.iter().all(|(p, e)| own_tests.contains(p.as_str()) || new_prev.get(p) == e.as_ref());
    let verdict = if verdict == Verdict::PartialUpstream && !own_tests.is_empty() && rest_upstream && hunks.iter().all(|h| h.class == Class::Upstream || own_tests.contains(h.file.as_str())) {
        notes.push(format!("every change but its own test files is upstream; they leave with it: {}", own_tests.iter().cloned().collect::<Vec<_>>().join(", ")));
        merged.clear();
        Verdict::Upstream
    } else {
        verdict
    };
    let report = PatchReport { id: lp.entry.id.clone(), file: lp.entry.file.clone(), verdict, hunks, action: String::new(), notes };
    Ok(Carried { report, merged, conflicts })
}

/// A file under a `tests/` (or `test/`) directory.
fn is_test_path(path: &str) -> bool {
    path.split('/').rev().skip(1).any(|c| c == "tests" || c == "test")
}

#[allow(clippy::too_many_arguments)]
fn carry_file(fp: &FilePatch, old_prev: &Tree, new_prev: &Tree, ours_overlay: &Overlay, mode: Mode<'_>, merged: &mut Overlay, out: &mut Vec<HunkReport>, conflicts: &mut Vec<ConflictFile>) {
    let shown = fp.display_path().to_owned();
    let a = fp.old_path.as_deref().and_then(|p| old_prev.get(p));
    let o = fp.new_path.as_deref().and_then(|p| get(old_prev, ours_overlay, p));
    let mut conflict = |out: &mut Vec<HunkReport>, path: &str, reports: Vec<HunkReport>, reason: String| {
        conflicts.push(ConflictFile { path: path.to_owned(), hunks: reports.iter().filter(|h| h.class == Class::Conflict).map(|h| h.hunk).collect(), reason });
        out.extend(reports);
    };
    match (fp.op, a, o) {
        (Op::Create, _, Some(o)) => {
            let path = fp.new_path.as_deref().expect("a created file has a path");
            match new_prev.get(path) {
                None => {
                    merged.insert(path.to_owned(), Some(o.clone()));
                    out.push(file_level(path, Class::Exact, None));
                }
                Some(t) if t == o => out.push(file_level(path, Class::Upstream, Some("upstream added the same file".into()))),
                Some(t) => {
                    let reason = "add/add: upstream added this file with other content".to_owned();
                    let data = match mode {
                        Mode::Classify => o.data.clone(),
                        Mode::Markers { ours, base, theirs } => {
                            let (ol, tl) = (lines(&o.data), lines(&t.data));
                            let chunks = merge3::merge(&[], &ol, &tl);
                            merge3::render(&chunks, &[], &ol, &tl, merge3::Resolve::Markers { ours, base, theirs })
                        }
                    };
                    merged.insert(path.to_owned(), Some(Entry { mode: o.mode, data }));
                    conflict(out, path, vec![file_level(path, Class::Conflict, Some(reason.clone()))], reason);
                }
            }
        }
        (Op::Delete, Some(a), None) => {
            let path = fp.old_path.as_deref().expect("a deleted file has a path");
            match new_prev.get(path) {
                // Gone upstream: deleted too, or moved (then the move's target is what to delete).
                None => match follow_rename(path, &a.data, old_prev, new_prev) {
                    Some(moved) if new_prev.get(&moved) == Some(a) => {
                        merged.insert(moved.clone(), None);
                        out.push(HunkReport { renamed_from: Some(path.to_owned()), ..file_level(&moved, Class::Exact, None) });
                    }
                    Some(moved) => {
                        let reason = format!("modify/delete: the patch deletes this file, upstream moved it to {moved} and modified it");
                        if matches!(mode, Mode::Classify) {
                            merged.insert(moved.clone(), None);
                        }
                        conflict(out, &moved, vec![file_level(&moved, Class::Conflict, Some(reason.clone()))], reason);
                    }
                    None => out.push(file_level(path, Class::Upstream, Some("upstream deleted it too".into()))),
                },
                Some(t) if t == a => {
                    merged.insert(path.to_owned(), None);
                    out.push(file_level(path, Class::Exact, None));
                }
                Some(t) => {
                    let reason = "modify/delete: the patch deletes this file, upstream modified it".to_owned();
                    // The maintainer sees upstream's version and decides (delete it or keep it).
                    merged.insert(path.to_owned(), if matches!(mode, Mode::Classify) { None } else { Some(t.clone()) });
                    conflict(out, path, vec![file_level(path, Class::Conflict, Some(reason.clone()))], reason);
                }
            }
        }
        (_, Some(a), Some(o)) => {
            let src = fp.old_path.as_deref().expect("a modified file has a source");
            let dst = fp.new_path.as_deref().expect("a modified file has a destination");
            let (t_path, renamed_from) = match new_prev.get(src) {
                Some(_) => (src.to_owned(), None),
                None => match follow_rename(src, &a.data, old_prev, new_prev) {
                    Some(p) => (p, Some(src.to_owned())),
                    None => {
                        let reason = "modify/delete: the patch modifies this file, upstream deleted it".to_owned();
                        merged.insert(dst.to_owned(), Some(o.clone()));
                        let n = match &fp.content {
                            Content::Text(h) => h.len(),
                            _ => 1,
                        };
                        let reports = (1..=n).map(|k| HunkReport { hunk: k, ..file_level(&shown, Class::Conflict, Some(reason.clone())) }).collect();
                        conflict(out, dst, reports, reason);
                        return;
                    }
                },
            };
            let t = get(new_prev, merged, &t_path).expect("looked up above");
            // Where the result goes: the patch's own rename wins; else follow upstream's.
            let target = if src != dst { dst.to_owned() } else { t_path.clone() };
            let mut file_conflict: Option<String> = None;
            let mode_bits = match mode_merge(a.mode, o.mode, t.mode) {
                Ok(m) => m,
                Err(why) => {
                    file_conflict = Some(why.to_string());
                    o.mode
                }
            };
            let mut reports;
            let data = if a.data == t.data {
                // Upstream left the file alone: every hunk lands where it was.
                reports = match &fp.content {
                    Content::Text(hunks) => {
                        hunks.iter().enumerate().map(|(k, h)| HunkReport { hunk: k + 1, old_line: h.old_start, new_line: Some(h.old_start), ..file_level(&target, Class::Exact, None) }).collect()
                    }
                    _ => vec![file_level(&target, Class::Exact, None)],
                };
                o.data.clone()
            } else if o.data == a.data {
                // A rename or mode change only: upstream's content carries.
                reports = vec![file_level(&target, Class::Merged, Some("upstream changed the file; the patch only renames it or changes its mode".into()))];
                t.data.clone()
            } else if t.data == o.data {
                reports = match &fp.content {
                    Content::Text(hunks) => hunks.iter().enumerate().map(|(k, h)| HunkReport { hunk: k + 1, old_line: h.old_start, ..file_level(&target, Class::Upstream, None) }).collect(),
                    _ => vec![file_level(&target, Class::Upstream, None)],
                };
                t.data.clone()
            } else if is_binary(&a.data) || is_binary(&o.data) || is_binary(&t.data) || !matches!(fp.content, Content::Text(_)) {
                let reason = "binary: the patch and upstream both changed this file".to_owned();
                file_conflict = Some(reason.clone());
                reports = vec![file_level(&target, Class::Conflict, Some(reason))];
                o.data.clone()
            } else {
                let (al, ol, tl) = (lines(&a.data), lines(&o.data), lines(&t.data));
                let chunks = merge3::merge(&al, &ol, &tl);
                let Content::Text(hunks) = &fp.content else { unreachable!("checked above") };
                reports = classify_hunks(&target, hunks, &chunks, renamed_from.as_deref());
                let resolve = match mode {
                    Mode::Classify => merge3::Resolve::Ours,
                    Mode::Markers { ours, base, theirs } => merge3::Resolve::Markers { ours, base, theirs },
                };
                if chunks.iter().any(|c| c.change == Some(Side::Conflict)) {
                    file_conflict.get_or_insert_with(|| "overlapping change".to_owned());
                }
                merge3::render(&chunks, &al, &ol, &tl, resolve)
            };
            if let Some(why) = &file_conflict {
                if why.starts_with("mode") {
                    reports.push(HunkReport { hunk: reports.len() + 1, ..file_level(&target, Class::Conflict, Some(why.clone())) });
                }
            }
            if renamed_from.is_some() {
                for r in &mut reports {
                    r.renamed_from = renamed_from.clone();
                }
            }
            if src != dst && new_prev.get(dst).is_some() {
                let reason = format!("add/add: the patch renames {src} to {dst}, which upstream also added");
                file_conflict = Some(reason.clone());
                reports.push(HunkReport { hunk: reports.len() + 1, ..file_level(dst, Class::Conflict, Some(reason)) });
            }
            if fp.op == Op::Rename && t_path != target {
                merged.insert(t_path.clone(), None);
            }
            merged.insert(target.clone(), Some(Entry { mode: mode_bits, data }));
            match file_conflict {
                Some(why) => conflict(out, &target, reports, why),
                None => out.extend(reports),
            }
        }
        _ => out.push(file_level(&shown, Class::Conflict, Some("the patch section does not match its own base (internal)".into()))),
    }
}

/// Exports `merged` on top of `new_prev` under `header`, and proves it applies back.
pub fn export_carried(header: &[u8], new_prev: &Tree, merged: &Overlay, name: &str) -> Result<Vec<u8>, ExportError> {
    let old: Tree = merged.keys().filter_map(|p| new_prev.get(p).map(|e| (p.clone(), e.clone()))).collect();
    let mut new = old.clone();
    for (p, e) in merged {
        match e {
            Some(e) => new.insert(p.clone(), e.clone()),
            None => new.remove(p),
        };
    }
    let mut bytes = header.to_vec();
    bytes.extend_from_slice(&export::diff_trees(&old, &new));
    let parsed = patch::parse(&bytes).map_err(|e| ExportError::Unparsable(name.to_owned(), e))?;
    let overlay = apply::plan(new_prev, &parsed, false).map_err(|e| ExportError::DoesNotApply(name.to_owned(), Box::new(e)))?;
    let mut check = old.clone();
    for (p, e) in overlay {
        match e {
            Some(e) => check.insert(p, e),
            None => check.remove(&p),
        };
    }
    // A merge never hands conflict markers to a patch: they come only from a stop.
    for (path, e) in &new {
        let ours_marker = |d: &[u8]| patch::split_lines(d).iter().filter(|l| l.starts_with(b"<<<<<<< ours: patch ")).count();
        if ours_marker(&e.data) > old.get(path).map(|o| ours_marker(&o.data)).unwrap_or(0) {
            return Err(ExportError::Markers(name.to_owned(), path.clone()));
        }
    }
    if check != new {
        return Err(ExportError::NotReproduced(name.to_owned()));
    }
    Ok(bytes)
}

/// Why the series cannot be carried (a conflict is not an error: it is in the report).
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Apply(#[from] Box<apply::ApplyError>),
    #[error("reading the resolution of {id} ({}): {err}", .path.display())]
    ReadResolution { id: String, path: PathBuf, err: std::io::Error },
    #[error("the resolution of {id} does not parse: {err}")]
    ResolutionUnparsable { id: String, err: patch::ParseError },
    #[error("the resolution of {id} no longer applies: {err}")]
    ResolutionDoesNotApply { id: String, err: Box<apply::ApplyError> },
    #[error(transparent)]
    Export(#[from] ExportError),
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("internal error: the re-exported {0} does not parse: {1}")]
    Unparsable(String, patch::ParseError),
    #[error("internal error: the re-exported {0} does not apply to the new base: {1}")]
    DoesNotApply(String, Box<apply::ApplyError>),
    #[error("internal error: the re-exported {0} does not reproduce the merged tree")]
    NotReproduced(String),
    #[error("internal error: the re-exported {0} would carry conflict markers into {1}")]
    Markers(String, String),
}

fn apply_overlay(tree: &mut Tree, overlay: &Overlay) {
    for (p, e) in overlay {
        match e {
            Some(e) => tree.insert(p.clone(), e.clone()),
            None => tree.remove(p),
        };
    }
}

/// What the registry says about a patch before the content is looked at.
fn registry_notes(e: &registry::PatchEntry, verdict: Verdict, onto: &str) -> Vec<String> {
    let mut notes = Vec::new();
    let says_upstream = e.status == "upstreamed";
    match (says_upstream, verdict) {
        (true, Verdict::Upstream) => notes.push(format!("the registry marks it upstreamed ({}); the new base has all of it", e.upstream)),
        (true, v) => notes.push(format!("the registry marks it upstreamed ({}), but {onto} lacks part of it (verdict {})", e.upstream, v.as_str())),
        (false, Verdict::Upstream | Verdict::PartialUpstream) if !e.upstream.is_empty() => notes.push(format!("upstream reference: {}", e.upstream)),
        _ => {}
    }
    notes
}

/// The action for a verdict under the patch's bump policy and status.
fn action_for(e: &registry::PatchEntry, verdict: Verdict, decided_retire: bool) -> &'static str {
    match verdict {
        Verdict::Conflict => "stop",
        Verdict::Upstream if e.bump == "drop-if-upstream" || e.status == "submitted" || e.status == "upstreamed" || decided_retire => "retire",
        // A patch we meant to keep turned up upstream: a person decides.
        Verdict::Upstream => "decide",
        _ => "re-export",
    }
}

/// The carried series: every patch classified, the new trees and patch bytes.
pub struct Plan {
    pub report: Report,
    /// New bytes per patch id (absent: retired).
    pub new_bytes: BTreeMap<String, Vec<u8>>,
    /// The new full chain (conflicts as `Mode` asked).
    pub new_tree: Tree,
    /// Index of the first patch that stops a real run, with its conflicts and the trees around it.
    pub stop: Option<Stop>,
    /// Patches whose hook markers changed in the carry: id -> the hooks they now mark.
    pub hooks: BTreeMap<String, Vec<String>>,
}

pub struct Stop {
    pub index: usize,
    pub kind: StopKind,
    /// The new chain before the stopping patch, and the patch's merged changes (with markers).
    pub new_prev: Tree,
    pub merged: Overlay,
    pub conflicts: Vec<ConflictFile>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopKind {
    Conflict,
    Decide,
}

/// Carries the whole series. `markers`: write conflicts with diff3 markers (for a real run's
/// stop); otherwise conflicts take the patch's side so later patches are still classified.
#[allow(clippy::too_many_arguments)] // the series, its labels, and the run's knobs
pub fn plan(old_base: &Tree, new_base: &Tree, patches: &[LoadedPatch], from: &str, onto: &str, res: &Resolutions, resolved_dir: Option<&Path>, markers: bool) -> Result<Plan, PlanError> {
    let mut old = old_base.clone();
    let mut new = new_base.clone();
    let mut report = Report { from: from.to_owned(), onto: onto.to_owned(), patches: Vec::new() };
    let mut new_bytes = BTreeMap::new();
    let mut stop: Option<Stop> = None;
    let mut first_stop: Option<String> = None;
    let mut hooks: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut hook_index: BTreeMap<String, BTreeSet<String>> = new_base.iter().map(|(p, e)| (p.clone(), tree::hooks_in(&e.data))).filter(|(_, h)| !h.is_empty()).collect();
    let ours_label = |lp: &LoadedPatch| format!("ours: patch {} ({})", lp.entry.id, lp.entry.file);
    let anc_label = |i: usize| format!("ancestor: {from}{}", if i == 0 { String::new() } else { format!(" + patches up to {}", patches[i - 1].entry.id) });
    let theirs_label = |i: usize| format!("upstream: {onto}{}", if i == 0 { String::new() } else { format!(" + carried patches up to {}", patches[i - 1].entry.id) });
    for (i, lp) in patches.iter().enumerate() {
        let (lo, lb, lt) = (ours_label(lp), anc_label(i), theirs_label(i));
        let want_markers = markers && stop.is_none();
        let mode = if want_markers { Mode::Markers { ours: &lo, base: &lb, theirs: &lt } } else { Mode::Classify };
        let mut carried = carry(lp, &old, &new, mode)?;
        let id = &lp.entry.id;
        let old_overlay = apply::plan(&old, &lp.parsed, false).map_err(|e| Box::new(apply::ApplyError { patch: lp.name().to_owned(), ..e }))?;
        let decided_retire = res.retire.contains(id);
        let mut action = action_for(&lp.entry, carried.report.verdict, decided_retire).to_owned();
        carried.report.notes.extend(registry_notes(&lp.entry, carried.report.verdict, onto));
        if let Some(text) = res.resolved.get(id) {
            // The maintainer's resolution replaces the merge.
            let path = resolved_dir.map(|d| d.join(text)).expect("resolutions come with their directory");
            let bytes = fs::read(&path).map_err(|err| PlanError::ReadResolution { id: id.clone(), path: path.clone(), err })?;
            if bytes.is_empty() {
                action = "retire".into();
                carried.report.notes.push("resolved by the maintainer: retired (nothing left to carry)".into());
                carried.merged = Overlay::new();
            } else {
                let parsed = patch::parse(&bytes).map_err(|err| PlanError::ResolutionUnparsable { id: id.clone(), err })?;
                let overlay = apply::plan(&new, &parsed, false).map_err(|err| PlanError::ResolutionDoesNotApply { id: id.clone(), err: Box::new(err) })?;
                carried.merged = overlay;
                carried.report.notes.push("resolved by the maintainer".into());
                action = "re-export".into();
                new_bytes.insert(id.clone(), bytes);
            }
        } else if action == "stop" || action == "decide" {
            if stop.is_none() && markers {
                stop = Some(Stop {
                    index: i,
                    kind: if action == "stop" { StopKind::Conflict } else { StopKind::Decide },
                    new_prev: new.clone(),
                    merged: carried.merged.clone(),
                    conflicts: carried.conflicts.clone(),
                });
            }
            if action == "decide" {
                carried.report.notes.push(format!("bump = {:?}: the new base already has this change; retire it (`rebase --continue --retire`) or abort", lp.entry.bump));
            }
            if carried.report.verdict == Verdict::Conflict && want_markers {
                // The rest of the stack is classified against the patch's side of the conflict.
                carried.merged = carry(lp, &old, &new, Mode::Classify)?.merged;
            }
        } else if action == "re-export" {
            let bytes = export_carried(&lp.parsed.header, &new, &carried.merged, lp.name())?;
            if bytes == lp.bytes {
                action = "keep".into();
            }
            new_bytes.insert(id.clone(), bytes);
        }
        if action == "retire" {
            carried.merged = Overlay::new();
        }
        if let Some(first) = &first_stop {
            carried.report.notes.push(format!("classified after the stop at patch {first}, against that patch's side of its conflicts"));
        } else if action == "stop" || action == "decide" {
            first_stop = Some(id.clone());
        }
        // The hooks the carried patch marks: markers its files gain that the new chain lacked.
        let before_hooks: BTreeSet<String> = hook_index.values().flatten().cloned().collect();
        for (path, e) in &carried.merged {
            match e {
                Some(e) => hook_index.insert(path.clone(), tree::hooks_in(&e.data)),
                None => hook_index.remove(path),
            };
        }
        if let Some(bytes) = new_bytes.get_mut(id) {
            let after: BTreeSet<String> = carried.merged.keys().filter_map(|p| hook_index.get(p)).flatten().filter(|h| !before_hooks.contains(*h)).cloned().collect();
            let declared: BTreeSet<String> = lp.entry.hooks.iter().cloned().collect();
            if after != declared {
                carried.report.notes.push(format!("hooks: now {:?} (the registry declared {:?}); the registry entry and the Tine-Hook trailers follow", after, declared));
                *bytes = with_hook_trailers(bytes, &after);
                hooks.insert(id.clone(), after.into_iter().collect());
                if carried.report.action == "keep" || action == "keep" {
                    action = "re-export".into();
                }
            }
        }
        carried.report.action = action;
        apply_overlay(&mut old, &old_overlay);
        apply_overlay(&mut new, &carried.merged);
        report.patches.push(carried.report);
    }
    Ok(Plan { report, new_bytes, new_tree: new, stop, hooks })
}

/// `bytes` with its header's `Tine-Hook:` trailers replaced by `hooks` (placed where the old
/// ones were, else before `Upstream-Status:`, else at the end of the header).
pub fn with_hook_trailers(bytes: &[u8], hooks: &BTreeSet<String>) -> Vec<u8> {
    // The header ends where the parser says the first file section starts (a `diff --git` at
    // the start of a line), never at a mention of one in the message.
    let start = patch::parse(bytes).map(|ps| ps.header.len()).unwrap_or(bytes.len());
    let header = String::from_utf8_lossy(&bytes[..start]).into_owned();
    let mut out = String::new();
    let mut placed = false;
    let block: String = hooks.iter().map(|h| format!("Tine-Hook: {h}\n")).collect();
    for line in header.split_inclusive('\n') {
        if line.starts_with("Tine-Hook: ") {
            if !placed {
                out.push_str(&block);
                placed = true;
            }
            continue;
        }
        if line.starts_with("Upstream-Status: ") && !placed {
            out.push_str(&block);
            placed = true;
        }
        out.push_str(line);
    }
    if !placed {
        out.push_str(&block);
    }
    let mut v = out.into_bytes();
    v.extend_from_slice(&bytes[start..]);
    v
}

// ---------------------------------------------------------------------------------------------
// Rendering

pub fn render_table(r: &Report) -> String {
    let mut rows = vec![["patch".to_owned(), "verdict".into(), "action".into(), "file".into(), "hunk".into(), "class".into(), "detail".into()]];
    for p in &r.patches {
        for (k, h) in p.hunks.iter().enumerate() {
            let mut detail = Vec::new();
            if let Some(o) = h.offset.filter(|o| *o != 0) {
                detail.push(format!("offset {o:+}"));
            }
            if let (Some(n), true) = (h.new_line, h.old_line > 0) {
                if n != h.old_line {
                    detail.push(format!("line {} -> {n}", h.old_line));
                }
            }
            if let Some(f) = &h.renamed_from {
                detail.push(format!("renamed from {f}"));
            }
            if let Some(why) = &h.reason {
                detail.push(why.clone());
            }
            let first = k == 0;
            rows.push([
                if first { p.id.clone() } else { String::new() },
                if first { p.verdict.as_str().to_owned() } else { String::new() },
                if first { p.action.clone() } else { String::new() },
                h.file.clone(),
                h.hunk.to_string(),
                h.class.as_str().to_owned(),
                detail.join("; "),
            ]);
        }
    }
    let widths: Vec<usize> = (0..6).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in &rows {
        for (c, w) in widths.iter().enumerate() {
            out.push_str(&format!("{:w$}  ", r[c], w = *w));
        }
        out.push_str(&r[6]);
        out.push('\n');
    }
    for p in &r.patches {
        for n in &p.notes {
            out.push_str(&format!("note {}: {n}\n", p.id));
        }
    }
    out.push_str(&summary(r));
    out.push('\n');
    out
}

pub fn summary(r: &Report) -> String {
    let hunks: usize = r.patches.iter().map(|p| p.hunks.len()).sum();
    format!(
        "{} -> {}: {} patch(es), {hunks} hunk(s): {} exact, {} rebased, {} upstream, {} partial-upstream, {} conflict",
        r.from,
        r.onto,
        r.patches.len(),
        r.count(Verdict::Exact),
        r.count(Verdict::Rebased),
        r.count(Verdict::Upstream),
        r.count(Verdict::PartialUpstream),
        r.count(Verdict::Conflict)
    )
}

/// `docs/bumps/<from>-to-<onto>.md`.
pub fn render_markdown(r: &Report, hunk_stats: &HunkStats, onto_spec: &str) -> String {
    let mut s = format!("# Base bump: {} → {}\n\nWritten by `cargo xtask rebase --onto {onto_spec}`; the JSON beside this file is the same report.\n\n", r.from, r.onto);
    s.push_str(&format!("{}\n\n", summary(r)));
    s.push_str("| patch | verdict | action | file | hunk | class | detail |\n|---|---|---|---|---|---|---|\n");
    for p in &r.patches {
        for (k, h) in p.hunks.iter().enumerate() {
            let mut detail = Vec::new();
            if let Some(o) = h.offset.filter(|o| *o != 0) {
                detail.push(format!("offset {o:+}"));
            }
            if let Some(f) = &h.renamed_from {
                detail.push(format!("renamed from `{f}`"));
            }
            if let Some(why) = &h.reason {
                detail.push(why.clone());
            }
            let first = k == 0;
            s.push_str(&format!(
                "| {} | {} | {} | `{}` | {} | {} | {} |\n",
                if first { &p.id } else { "" },
                if first { p.verdict.as_str() } else { "" },
                if first { p.action.as_str() } else { "" },
                h.file,
                h.hunk,
                h.class.as_str(),
                detail.join("; ").replace('|', "\\|")
            ));
        }
    }
    let notes: Vec<String> = r.patches.iter().flat_map(|p| p.notes.iter().map(move |n| format!("- {}: {n}", p.id))).collect();
    if !notes.is_empty() {
        s.push_str(&format!("\n## Notes\n\n{}\n", notes.join("\n")));
    }
    s.push_str(&format!(
        "\n## Fork health\n\nUpstream files the series edits in place: {} before, {} after; hunks in upstream files: {} before, {} after; upstream lines those hunks remove or replace: {} before, {} after.\n",
        hunk_stats.before.files, hunk_stats.after.files, hunk_stats.before.hunks, hunk_stats.after.hunks, hunk_stats.before.lines, hunk_stats.after.lines
    ));
    s
}

/// How much of upstream's own code a series touches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Footprint {
    /// Upstream files modified (not created) by some patch.
    pub files: usize,
    /// Hunks in those files.
    pub hunks: usize,
    /// Upstream lines removed or replaced.
    pub lines: usize,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HunkStats {
    pub before: Footprint,
    pub after: Footprint,
}

pub fn footprint<'a>(series: impl IntoIterator<Item = &'a PatchSet>, base: &Tree) -> Footprint {
    let mut files = BTreeSet::new();
    let mut f = Footprint::default();
    for ps in series {
        for fp in &ps.files {
            let Some(path) = fp.old_path.as_deref() else {
                continue;
            };
            if !base.contains_key(path) {
                continue;
            }
            files.insert(path.to_owned());
            if let Content::Text(hunks) = &fp.content {
                f.hunks += hunks.len();
                f.lines += hunks.iter().map(|h| h.lines.iter().filter(|l| matches!(l, patch::Line::Remove(_))).count()).sum::<usize>();
            }
        }
    }
    f.files = files.len();
    f
}

// ---------------------------------------------------------------------------------------------
// The real run: state, stop, continue, abort, commit

/// Project files the bump rewrites beyond the chain's own (for Tine: the engine's version
/// requirements on the base crates, the patch-tests manifest), computed from the new registry.
pub type ExtraFiles<'a> = &'a dyn Fn(&Project, &Registry, &Registry, &[LoadedPatch]) -> ExtraFilesResult;

/// The extra files (project-relative path, bytes), or why the project cannot compute them.
pub type ExtraFilesResult = Result<Vec<(String, Vec<u8>)>, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Debug, thiserror::Error)]
pub enum RebaseError {
    #[error("a rebase is already in progress ({0}); finish it with `cargo xtask rebase --continue` or undo it with `cargo xtask rebase --abort`")]
    InProgress(String),
    #[error("patch {id}: conflicts without markers are still as the stop left them:\n  {}\nedit or delete each file to resolve it, or keep it as it is with `cargo xtask rebase --continue --accept PATH`", files.join("\n  "))]
    Unresolved { id: String, files: Vec<String> },
    #[error("patch {id}: conflict markers remain in {live}:\n  {}\nresolve them, then `cargo xtask rebase --continue`", lines.join("\n  "))]
    MarkersRemain { live: String, id: String, lines: Vec<String> },
    #[error("patch {id} is already upstream and its bump policy is {bump:?}: a person decides. Retire it with `cargo xtask rebase --continue --retire`, or `cargo xtask rebase --abort`")]
    Decide { id: String, bump: String },
    #[error("crash point {0} (test support)")]
    Crash(&'static str),
}

/// Test support: the journal points of a run ([`crate::crashpoint`], `TINE_CRASH_AT=<point>`).
fn crash_point(name: &'static str) {
    crate::crashpoint::crashpoint(name);
}

/// The name prefix of a scratch sibling of the state directory (`.tine-rebase.new-<pid>`, `.tine-rebase.done-<pid>`).
fn sibling(p: &Project, what: &str) -> String {
    format!("{}.{what}-", state_dir(p).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())
}

fn enc(path: &str) -> String {
    path.replace('%', "%25").replace('/', "%2F")
}

/// Everything a run needs, loaded.
pub struct Inputs {
    pub registry: Registry,
    pub old_base: Tree,
    pub new_base: Tree,
    pub onto_base: Base,
    pub patches: Vec<LoadedPatch>,
    pub from: String,
    pub onto: String,
}

/// Why a run's inputs cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum InputsError {
    #[error(transparent)]
    Journal(#[from] crate::journal::JournalError),
    #[error(transparent)]
    Registry(#[from] registry::LoadError),
    #[error(transparent)]
    Base(#[from] BaseError),
    #[error(transparent)]
    Pristine(#[from] chain::PristineError),
    #[error(transparent)]
    Patches(#[from] chain::PatchLoadError),
}

pub fn load_inputs(p: &Project, onto_base: Base, pb: &indicatif::ProgressBar) -> Result<Inputs, InputsError> {
    crate::journal::check_none_pending(p)?;
    let registry = chain::load_registry(p)?;
    pb.set_message("loading the old base");
    let old_base = crate::base::load(&registry.base, &p.root, &p.cache_dir, pb)?;
    chain::check_pristine(p, &old_base)?;
    pb.set_message("loading the new base");
    let new_base = crate::base::load(&onto_base, &p.root, &p.cache_dir, pb)?;
    let patches = chain::load_patches(p, &registry)?;
    let from = base_label(&registry.base);
    let onto = base_label(&onto_base);
    Ok(Inputs { registry, old_base, new_base, onto_base, patches, from, onto })
}

/// The dry run: classification only, nothing written.
pub fn dry_run(inputs: &Inputs) -> Result<Report, PlanError> {
    Ok(plan(&inputs.old_base, &inputs.new_base, &inputs.patches, &inputs.from, &inputs.onto, &Resolutions::default(), None, false)?.report)
}

/// Paths (project-relative) a bump may write.
fn write_set(p: &Project, inputs: &Inputs, extra: &[String]) -> Vec<String> {
    let rel = |pb: PathBuf| p.rel(&pb).into_owned();
    let mut v = vec![rel(p.registry_path()), rel(p.pristine_manifest_path()), rel(p.patched_manifest_path()), rel(p.sync_doc_path())];
    for lp in &inputs.patches {
        v.push(rel(p.patches_dir().join(&lp.entry.file)));
    }
    let label = format!("{}-to-{}", inputs.from, inputs.onto);
    v.push(rel(p.bumps_dir().join(format!("{label}.md"))));
    v.push(rel(p.bumps_dir().join(format!("{label}.json"))));
    v.extend(extra.iter().cloned());
    v
}

pub enum Outcome {
    Done(Report),
    Stopped(Report, String),
}

/// Starts a real run.
pub fn start(p: &Project, inputs: &Inputs, extra_paths: &[String], extra: ExtraFiles<'_>, pb: &indicatif::ProgressBar) -> anyhow::Result<Outcome> {
    if in_progress(p) {
        return Err(RebaseError::InProgress(p.rel(&state_dir(p)).into_owned()).into());
    }
    // The live tree must hold nothing a patch does not carry.
    let live = chain::live_state_without_edits(p, &inputs.old_base, &inputs.patches, "rebase").map_err(|e| Refused(Causes(&e).to_string()))?;
    let dir = state_dir(p);
    // Leftovers of interrupted starts and finishes are never a run.
    let (new_prefix, done_prefix) = (sibling(p, "new"), sibling(p, "done"));
    if let Ok(entries) = fs::read_dir(dir.parent().unwrap_or(&p.root)) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(&new_prefix) || n.starts_with(&done_prefix) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    let tmp = dir.with_file_name(format!("{new_prefix}{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(tmp.join("orig"))?;
    let mut ws = BTreeMap::new();
    for path in write_set(p, inputs, extra_paths) {
        let full = p.root.join(&path);
        let existed = match fs::read(&full) {
            Ok(b) => {
                fs::write(tmp.join("orig").join(enc(&path)), b)?;
                true
            }
            Err(_) => false,
        };
        ws.insert(path, existed);
    }
    let had_upstream = live.is_some();
    if let Some((live, _)) = &live {
        let raw = fs::read(p.upstream_dir().join(tree::STATE_FILE)).ok();
        fs::write(tmp.join("orig-upstream.tar"), tree::tar_tree(&live.tree, raw.as_deref())?)?;
    }
    let state = RebaseState {
        from: inputs.from.clone(),
        onto: inputs.onto.clone(),
        onto_base: BaseRecord::of(&inputs.onto_base),
        phase: Phase::Carrying,
        stopped: None,
        resolutions: Resolutions::default(),
        write_set: ws,
        had_upstream,
        commit: BTreeMap::new(),
    };
    let mut v = serde_json::to_vec_pretty(&state).expect("state serialises");
    v.push(b'\n');
    fs::write(tmp.join("state.json"), v)?;
    fs::create_dir_all(tmp.join("resolved"))?;
    // One rename makes the run exist: before it, nothing happened.
    fs::rename(&tmp, &dir)?;
    crash_point("after-start");
    proceed(p, inputs, state, extra, pb)
}

fn manifest_sha(t: &Tree) -> String {
    tree::sha256_hex(tree::render_manifest(&tree::manifest_of(t)).as_bytes())
}

/// Carries the series with the state's resolutions: stops at the first conflict or decision,
/// else stages and commits the result.
fn proceed(p: &Project, inputs: &Inputs, mut state: RebaseState, extra: ExtraFiles<'_>, pb: &indicatif::ProgressBar) -> anyhow::Result<Outcome> {
    pb.set_message("carrying the series");
    let plan = plan(&inputs.old_base, &inputs.new_base, &inputs.patches, &inputs.from, &inputs.onto, &state.resolutions, Some(&state_dir(p).join("resolved")), true)?;
    if let Some(stop) = &plan.stop {
        let lp = &inputs.patches[stop.index];
        let mut t = stop.new_prev.clone();
        apply_overlay(&mut t, &stop.merged);
        let kind = match stop.kind {
            StopKind::Conflict => "conflict",
            StopKind::Decide => "decide",
        };
        let unmarked = stop
            .conflicts
            .iter()
            .filter(|c| t.get(&c.path).is_none_or(|e| merge3::marker_lines(&e.data).is_empty()))
            .map(|c| (c.path.clone(), t.get(&c.path).map(|e| tree::sha256_hex(&e.data))))
            .collect();
        state.stopped = Some(Stopped { id: lp.entry.id.clone(), kind: kind.into(), files: stop.conflicts.clone(), tree_sha256: manifest_sha(&t), unmarked });
        write_state(p, &state)?;
        crash_point("after-stop-state");
        write_stop_tree(p, &t, &inputs.patches[..stop.index])?;
        crash_point("after-stop-tree");
        let msg = match stop.kind {
            StopKind::Conflict => {
                let mut m = format!("patch {} ({}) conflicts with {}:\n", lp.entry.id, lp.entry.file, inputs.onto);
                for c in &stop.conflicts {
                    m.push_str(&format!("  {}{}: hunk(s) {}: {}\n", p.live_name(), c.path, c.hunks.iter().map(|h| h.to_string()).collect::<Vec<_>>().join(", "), c.reason));
                }
                m.push_str(&p.live_name());
                m.push_str(" holds the new base + the carried patches before it + this patch merged, with diff3 markers\n(ours = the patch, ancestor = the old chain, upstream = the new chain).\nResolve them (edit the files; for modify/delete, delete or keep the file), then `cargo xtask rebase --continue`;\nor `cargo xtask rebase --abort` to put everything back.");
                m
            }
            StopKind::Decide => RebaseError::Decide { id: lp.entry.id.clone(), bump: lp.entry.bump.clone() }.to_string(),
        };
        return Ok(Outcome::Stopped(plan.report, msg));
    }
    commit(p, inputs, state, &plan, extra, pb)?;
    Ok(Outcome::Done(plan.report))
}

/// engine/upstream/ for the maintainer: the new chain before the stopping patch, plus the patch merged.
fn write_stop_tree(p: &Project, t: &Tree, before: &[LoadedPatch]) -> anyhow::Result<()> {
    // The chain state records the tree as written, so the run can tell it was written.
    let state = chain::State { applied: before.iter().map(|lp| lp.entry.id.clone()).collect(), patch_sha256: Vec::new(), manifest: tree::manifest_of(t) };
    tree::write_tree_atomically(&p.upstream_dir(), t, &[(tree::STATE_FILE, &state.to_bytes())], &indicatif::ProgressBar::hidden())?;
    Ok(())
}

pub struct ContinueOptions {
    /// Retire the patch the run stopped on (its change is already upstream).
    pub retire: bool,
    /// Conflicted files without markers to take as they are in engine/upstream/.
    pub accept: Vec<String>,
}

pub fn continue_run(p: &Project, opts: &ContinueOptions, extra: ExtraFiles<'_>, pb: &indicatif::ProgressBar) -> anyhow::Result<Outcome> {
    let mut state = read_state(p)?;
    if state.phase == Phase::Commit {
        // The project may be half written: only the new base is needed to finish.
        let new_base = crate::base::load(&state.onto_base.base(), &p.root, &p.cache_dir, pb)?;
        finish_commit(p, &new_base, &state, pb)?;
        let report: Report = serde_json::from_slice(&fs::read(state_dir(p).join("commit-report.json"))?)?;
        remove_state(p)?;
        return Ok(Outcome::Done(report));
    }
    let inputs = load_inputs(p, state.onto_base.base(), pb)?;
    if let Some(stopped) = state.stopped.clone() {
        let idx = inputs.patches.iter().position(|lp| lp.entry.id == stopped.id).ok_or_else(|| anyhow::anyhow!("the run stopped at patch {}, which the series no longer has", stopped.id))?;
        let live = chain::Live::read(p)?;
        let written = live.as_ref().and_then(|l| l.state.as_ref()).map(|s| tree::sha256_hex(tree::render_manifest(&s.manifest).as_bytes()));
        if written.as_deref() != Some(stopped.tree_sha256.as_str()) {
            // Interrupted before the tree was written: write it again and stop again.
            return proceed(p, &inputs, state, extra, pb);
        }
        let live = live.expect("checked above");
        if opts.retire {
            if stopped.kind != "decide" {
                anyhow::bail!("--retire answers a stop for a patch that is already upstream; patch {} stopped on a conflict", stopped.id);
            }
            state.resolutions.retire.insert(stopped.id.clone());
        } else if stopped.kind == "decide" {
            return Err(RebaseError::Decide { id: stopped.id.clone(), bump: inputs.patches[idx].entry.bump.clone() }.into());
        } else {
            let mut left = Vec::new();
            for f in &stopped.files {
                if let Some(e) = live.tree.get(&f.path) {
                    for l in merge3::marker_lines(&e.data) {
                        left.push(format!("{}{}:{l}", p.live_name(), f.path));
                    }
                }
            }
            if !left.is_empty() {
                return Err(RebaseError::MarkersRemain { live: p.live_name(), id: stopped.id.clone(), lines: left }.into());
            }
            // A conflict without markers is resolved by changing the file, or by saying it stays.
            let untouched: Vec<String> = stopped
                .unmarked
                .iter()
                .filter(|(path, sha)| {
                    live.tree.get(path.as_str()).map(|e| tree::sha256_hex(&e.data)) == **sha && !opts.accept.iter().any(|a| a == *path || a.strip_prefix(p.live_name().as_str()) == Some(path.as_str()))
                })
                .map(|(path, _)| format!("{}{path}: {}", p.live_name(), stopped.files.iter().find(|f| &f.path == path).map(|f| f.reason.as_str()).unwrap_or("conflict")))
                .collect();
            if !untouched.is_empty() {
                return Err(RebaseError::Unresolved { id: stopped.id.clone(), files: untouched }.into());
            }
            // The resolution: the tree as the maintainer left it, against the new chain before the patch.
            let before = plan(&inputs.old_base, &inputs.new_base, &inputs.patches[..idx], &inputs.from, &inputs.onto, &state.resolutions, Some(&state_dir(p).join("resolved")), false)?;
            let lp = &inputs.patches[idx];
            let bytes = if tree::manifest_of(&before.new_tree) == tree::manifest_of(&live.tree) {
                Vec::new()
            } else {
                let mut b = lp.parsed.header.clone();
                b.extend_from_slice(&export::diff_trees(&before.new_tree, &live.tree));
                let parsed = patch::parse(&b).map_err(|e| anyhow::anyhow!("internal error: the resolution does not parse: {e}"))?;
                let mut check = before.new_tree.clone();
                apply::apply(&mut check, &parsed, lp.name())?;
                if tree::manifest_of(&check) != tree::manifest_of(&live.tree) {
                    anyhow::bail!("internal error: the resolution does not reproduce {}", p.live_name());
                }
                b
            };
            let name = format!("{}.patch", stopped.id);
            tree::write_file_atomically(&state_dir(p).join("resolved").join(&name), &bytes)?;
            state.resolutions.resolved.insert(stopped.id.clone(), name);
        }
        state.stopped = None;
        write_state(p, &state)?;
        crash_point("after-resolution");
    }
    proceed(p, &inputs, state, extra, pb)
}

/// Stages every file of the result, then writes them out (journaled: a crash resumes here).
fn commit(p: &Project, inputs: &Inputs, mut state: RebaseState, plan: &Plan, extra: ExtraFiles<'_>, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    pb.set_message("staging the result");
    let mut reg = inputs.registry.clone();
    reg.base = inputs.onto_base.clone();
    let retired: BTreeSet<&str> = plan.report.patches.iter().filter(|r| r.action == "retire").map(|r| r.id.as_str()).collect();
    for e in &mut reg.patches {
        if retired.contains(e.id.as_str()) {
            e.status = "retired".into();
            e.upstream = if e.upstream.is_empty() { format!("in {}", base_spec(&inputs.onto_base)) } else { format!("in {} ({})", base_spec(&inputs.onto_base), e.upstream) };
        } else if let Some(b) = plan.new_bytes.get(&e.id) {
            e.sha256 = tree::sha256_hex(b);
        }
        if let Some(h) = plan.hooks.get(&e.id) {
            e.hooks = h.clone();
        }
    }
    // The engine requirement moves to the next patch still carried.
    if let Some(eng) = &mut reg.engine {
        if retired.contains(eng.builds_from.as_str()) {
            if let Some(next) = reg.patches.iter().find(|e| e.is_applied() && e.id > eng.builds_from) {
                eng.builds_from = next.id.clone();
            }
        }
    }
    let new_series: Vec<LoadedPatch> = inputs
        .patches
        .iter()
        .filter(|lp| !retired.contains(lp.entry.id.as_str()))
        .map(|lp| {
            let bytes = plan.new_bytes.get(&lp.entry.id).cloned().unwrap_or_else(|| lp.bytes.clone());
            let parsed = patch::parse(&bytes).expect("exported patches parse");
            let entry = reg.patches.iter().find(|e| e.id == lp.entry.id).expect("same registry").clone();
            LoadedPatch { entry, bytes, parsed }
        })
        .collect();
    let full = chain::build(&inputs.new_base, &new_series)?;
    let mut files: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
    let rel = |pb: PathBuf| p.rel(&pb).into_owned();
    files.insert(rel(p.registry_path()), Some(registry::render(&reg).into_bytes()));
    files.insert(rel(p.sync_doc_path()), Some(registry::render_markdown(&reg).into_bytes()));
    files.insert(rel(p.pristine_manifest_path()), Some(tree::render_manifest(&tree::manifest_of(&inputs.new_base)).into_bytes()));
    files.insert(rel(p.patched_manifest_path()), Some(tree::render_manifest(&tree::manifest_of(&full)).into_bytes()));
    for lp in &inputs.patches {
        let path = rel(p.patches_dir().join(&lp.entry.file));
        if retired.contains(lp.entry.id.as_str()) {
            files.insert(path, None);
        } else if let Some(b) = plan.new_bytes.get(&lp.entry.id) {
            files.insert(path, Some(b.clone()));
        }
    }
    let stats = HunkStats { before: footprint(inputs.patches.iter().map(|l| &l.parsed), &inputs.old_base), after: footprint(new_series.iter().map(|l| &l.parsed), &inputs.new_base) };
    let label = format!("{}-to-{}", inputs.from, inputs.onto);
    let mut json = serde_json::to_value(&plan.report).expect("serialises");
    json["hunk_stats"] = serde_json::to_value(stats).expect("serialises");
    let mut json_bytes = serde_json::to_vec_pretty(&json).expect("serialises");
    json_bytes.push(b'\n');
    files.insert(rel(p.bumps_dir().join(format!("{label}.json"))), Some(json_bytes));
    files.insert(rel(p.bumps_dir().join(format!("{label}.md"))), Some(render_markdown(&plan.report, &stats, &base_spec(&inputs.onto_base)).into_bytes()));
    for (path, bytes) in extra(p, &inputs.registry, &reg, &new_series).map_err(|e| anyhow::anyhow!(e))? {
        files.insert(path, Some(bytes));
    }
    let dir = state_dir(p).join("commit");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    for (path, data) in &files {
        if let Some(d) = data {
            fs::write(dir.join(enc(path)), d)?;
        }
    }
    // The new full tree and its series, for the last write.
    let live_state = chain::State::new(&new_series, &full);
    fs::write(state_dir(p).join("commit-state.json"), live_state.to_bytes())?;
    let mut rep = plan.report.to_json();
    rep.pop();
    fs::write(state_dir(p).join("commit-report.json"), rep)?;
    state.commit = files.iter().map(|(k, v)| (k.clone(), v.is_some())).collect();
    for k in state.commit.keys() {
        state.write_set.entry(k.clone()).or_insert_with(|| p.root.join(k).exists());
    }
    // Any path the commit writes must have its original saved for --abort.
    for (k, existed) in &state.write_set {
        let orig = state_dir(p).join("orig").join(enc(k));
        if *existed && !orig.exists() {
            if let Ok(b) = fs::read(p.root.join(k)) {
                fs::write(orig, b)?;
            }
        }
    }
    state.phase = Phase::Commit;
    state.stopped = None;
    write_state(p, &state)?;
    crash_point("after-commit-staged");
    finish_commit(p, &inputs.new_base, &state, pb)?;
    remove_state(p)
}

fn finish_commit(p: &Project, new_base: &Tree, state: &RebaseState, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    pb.set_message("writing the result");
    let dir = state_dir(p).join("commit");
    for (i, (path, write)) in state.commit.iter().enumerate() {
        let full = p.root.join(path);
        if *write {
            let data = fs::read(dir.join(enc(path)))?;
            if fs::read(&full).ok().as_deref() != Some(&data[..]) {
                tree::write_file_atomically(&full, &data)?;
            }
        } else if full.exists() {
            fs::remove_file(&full)?;
        }
        if i == 1 {
            crash_point("mid-commit");
        }
    }
    let st: chain::State = serde_json::from_slice(&fs::read(state_dir(p).join("commit-state.json"))?)?;
    let reg = chain::load_registry(p)?;
    let patches = chain::load_patches(p, &reg)?;
    let full = chain::build(new_base, &patches)?;
    if chain::State::new(&patches, &full) != st {
        anyhow::bail!("internal error: the committed series does not rebuild the staged tree");
    }
    chain::write_live(p, &full, &patches, pb)?;
    crash_point("after-commit-tree");
    Ok(())
}

fn remove_state(p: &Project) -> anyhow::Result<()> {
    // Rename first, so a crash never leaves a half-deleted state that looks like a run.
    let dead = state_dir(p).with_file_name(format!("{}{}", sibling(p, "done"), std::process::id()));
    fs::rename(state_dir(p), &dead)?;
    fs::remove_dir_all(&dead)?;
    Ok(())
}

/// Puts every file the run may have written back, byte for byte, and engine/upstream/ too.
pub fn abort(p: &Project, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    let state = read_state(p)?;
    let dir = state_dir(p);
    for (path, existed) in &state.write_set {
        let full = p.root.join(path);
        if *existed {
            let data = fs::read(dir.join("orig").join(enc(path)))?;
            if fs::read(&full).ok().as_deref() != Some(&data[..]) {
                tree::write_file_atomically(&full, &data)?;
            }
        } else if full.exists() {
            fs::remove_file(&full)?;
        }
    }
    crash_point("mid-abort");
    if state.had_upstream {
        let (t, st) = tree::untar_tree(&fs::read(dir.join("orig-upstream.tar"))?)?;
        let extra: Vec<(&str, &[u8])> = st.as_deref().map(|s| vec![(tree::STATE_FILE, s)]).unwrap_or_default();
        tree::write_tree_atomically(&p.upstream_dir(), &t, &extra, pb)?;
    } else if p.upstream_dir().exists() {
        fs::remove_dir_all(p.upstream_dir())?;
    }
    remove_state(p)
}
