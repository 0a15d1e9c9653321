//! The strict placer: every hunk applies exactly at its stated line, or not at all.
//!
//! No fuzz, no offset, whitespace and line endings significant. Before a patch applies forward
//! we check whether it is already applied (an exact reverse match): forward-first tools apply an
//! insertion twice when its context repeats. A hunk with fewer trailing than leading context
//! lines (or none) ends the file and must match at its end, as git apply and GNU patch require;
//! without that anchor the two directions of an end-of-file hunk both match (one image is a
//! prefix of the other). When a hunk fails we say why: where it would have matched at an offset,
//! whether it would only match with fuzz, or the first line that differs.

use std::collections::BTreeMap;
use std::fmt;

use crate::patch::{split_lines, BinaryHunk, Content, FilePatch, Hunk, Op, PatchSet};
use crate::tree::{Entry, Tree, MODE_FILE};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub struct ApplyError {
    /// The patch, by its file name.
    pub patch: String,
    /// The file of the tree.
    pub file: String,
    /// 1-based hunk number within the file section, with the patch line of its `@@`.
    pub hunk: Option<(usize, usize)>,
    pub kind: ApplyErrorKind,
}

impl fmt::Display for ApplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "patch {}: {}", self.patch, self.file)?;
        if let Some((n, line)) = self.hunk {
            write!(f, ", hunk #{n} (patch line {line})")?;
        }
        write!(f, ": {}", self.kind)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApplyErrorKind {
    #[error("the patch is already applied (every hunk matches in reverse, exactly); it must not be applied twice")]
    AlreadyApplied,
    #[error("the patch is not applied, so it cannot be reverse-applied (it matches forward, exactly)")]
    NotApplied,
    #[error("ambiguous: the tree matches both the patch's before- and after-image; refusing to guess whether it is applied")]
    Ambiguous,
    #[error("the patch holds no file changes")]
    Empty,
    #[error("file does not exist")]
    MissingFile,
    #[error("file already exists")]
    FileExists,
    #[error("mode is {found:o}, the patch expects {expected:o}")]
    ModeMismatch { expected: u32, found: u32 },
    #[error("the hunk's before-image does not match at line {line}: expected {expected:?}, found {found:?}")]
    Mismatch { line: usize, expected: Box<str>, found: Box<str> },
    #[error("the hunk starts at line {line}, past the end of the file ({len} lines)")]
    PastEnd { line: usize, len: usize },
    #[error("the hunk ends the file (fewer trailing than leading context lines), so it must match at the end; it matches at line {line} but {after} more line(s) follow")]
    NotAtEnd { line: usize, after: usize },
    #[error("the hunk would only apply at offset {offset:+} (line {line}, stated {stated}); offsets are refused on a pinned base")]
    AtOffset { stated: usize, line: usize, offset: isize },
    #[error("the hunk would only apply with fuzz {fuzz} (ignoring {fuzz} context line(s)) at line {line}; fuzz is refused")]
    WithFuzz { fuzz: usize, line: usize },
    #[error("the hunks overlap or are out of order")]
    Overlap,
    #[error("a deleted file still has content after its hunk: the patch does not describe the whole file")]
    DeleteLeavesContent,
    #[error("binary preimage does not match (the file is not the one the patch was made from)")]
    BinaryPreimage,
    #[error("binary delta does not apply: {0}")]
    BinaryDelta(#[from] crate::delta::DeltaError),
    #[error("binary patch gives a file whose blob id is {found}, the index line says {expected}")]
    BinaryPostimage { expected: Box<str>, found: Box<str> },
    #[error("cannot create it: {file} is a file, not a directory")]
    UnderAFile { file: String },
    #[error("cannot create it: it is a directory holding {holds}")]
    IsADirectory { holds: String },
    #[error("binary change without data (`Binary files … differ`); export with `git diff --binary --full-index`")]
    BinaryWithoutData,
    #[error("binary patch has no reverse hunk, so it cannot be reverse-applied")]
    BinaryNotReversible,
    #[error("binary patch's two hunks disagree: the opposite hunk does not give back the file this one starts from")]
    BinaryInconsistent,
}

/// Pending changes of one patch on top of a tree: `None` deletes.
type Overlay = BTreeMap<String, Option<Entry>>;

struct Staged<'t> {
    tree: &'t Tree,
    overlay: Overlay,
}

impl Staged<'_> {
    fn get(&self, path: &str) -> Option<&Entry> {
        match self.overlay.get(path) {
            Some(e) => e.as_ref(),
            None => self.tree.get(path),
        }
    }
    fn put(&mut self, path: &str, e: Option<Entry>) {
        self.overlay.insert(path.to_owned(), e);
    }
    /// The nearest ancestor of `path` that is a file.
    fn file_above(&self, path: &str) -> Option<String> {
        path.match_indices('/').map(|(i, _)| &path[..i]).find(|a| self.get(a).is_some()).map(str::to_owned)
    }
    /// A file under `path/`, when `path` is a directory.
    fn file_below(&self, path: &str) -> Option<String> {
        let dir = format!("{path}/");
        let under = |m: &Overlay| m.range(dir.clone()..).take_while(|(k, _)| k.starts_with(&dir)).find(|(_, e)| e.is_some()).map(|(k, _)| k.clone());
        under(&self.overlay).or_else(|| self.tree.range(dir.clone()..).take_while(|(k, _)| k.starts_with(&dir)).map(|(k, _)| k).find(|k| self.get(k).is_some()).cloned())
    }
}

type FileResult<T> = Result<T, (Option<(usize, usize)>, ApplyErrorKind)>;

/// Applies `patch` forward, refusing an already-applied patch by name.
pub fn apply(tree: &mut Tree, patch: &PatchSet, name: &str) -> Result<(), ApplyError> {
    apply_checked(tree, patch, name, false)
}

/// Reverse-applies `patch`, refusing a patch that is not applied.
pub fn unapply(tree: &mut Tree, patch: &PatchSet, name: &str) -> Result<(), ApplyError> {
    apply_checked(tree, patch, name, true)
}

fn apply_checked(tree: &mut Tree, patch: &PatchSet, name: &str, reverse: bool) -> Result<(), ApplyError> {
    if patch.files.is_empty() {
        return Err(ApplyError { patch: name.into(), file: "(none)".into(), hunk: None, kind: ApplyErrorKind::Empty });
    }
    // The opposite direction first: an exact match there means the work is already done.
    let opposite = plan(tree, patch, !reverse);
    let wanted = plan(tree, patch, reverse);
    match (wanted, opposite) {
        (Ok(overlay), Err(_)) => {
            for (path, e) in overlay {
                match e {
                    Some(e) => tree.insert(path, e),
                    None => tree.remove(&path),
                };
            }
            Ok(())
        }
        (Ok(_), Ok(_)) => Err(ApplyError { patch: name.into(), file: patch.files[0].display_path().into(), hunk: None, kind: ApplyErrorKind::Ambiguous }),
        (Err(_), Ok(_)) => {
            Err(ApplyError { patch: name.into(), file: patch.files[0].display_path().into(), hunk: None, kind: if reverse { ApplyErrorKind::NotApplied } else { ApplyErrorKind::AlreadyApplied } })
        }
        (Err(e), Err(_)) => Err(ApplyError { patch: name.into(), ..e }),
    }
}

/// Whether `patch` applies in the given direction, without the already-applied check.
pub fn plan(tree: &Tree, patch: &PatchSet, reverse: bool) -> Result<BTreeMap<String, Option<Entry>>, ApplyError> {
    let mut staged = Staged { tree, overlay: Overlay::new() };
    let order: Vec<&FilePatch> = if reverse { patch.files.iter().rev().collect() } else { patch.files.iter().collect() };
    for fp in order {
        apply_file(&mut staged, fp, reverse).map_err(|(hunk, kind)| ApplyError { patch: String::new(), file: fp.display_path().to_owned(), hunk, kind })?;
    }
    // Paths the patch creates must fit the tree it leaves: not under a file, not over a directory.
    // Checked on the final state, so a patch may replace a directory by a file (or back) in one go.
    let created: Vec<&String> = staged.overlay.iter().filter(|(p, e)| e.is_some() && tree.get(*p).is_none()).map(|(p, _)| p).collect();
    for path in created {
        let kind = match (staged.file_above(path), staged.file_below(path)) {
            (Some(file), _) => ApplyErrorKind::UnderAFile { file },
            (None, Some(holds)) => ApplyErrorKind::IsADirectory { holds },
            (None, None) => continue,
        };
        return Err(ApplyError { patch: String::new(), file: path.clone(), hunk: None, kind });
    }
    Ok(staged.overlay)
}

fn apply_file(st: &mut Staged<'_>, fp: &FilePatch, reverse: bool) -> FileResult<()> {
    let nohunk = |k| (None, k);
    // The operation as seen in this direction.
    let (op, src, dst, src_mode, dst_mode) = if reverse {
        let op = match fp.op {
            Op::Create => Op::Delete,
            Op::Delete => Op::Create,
            o => o,
        };
        (op, fp.new_path.as_deref(), fp.old_path.as_deref(), fp.new_mode, fp.old_mode)
    } else {
        (fp.op, fp.old_path.as_deref(), fp.new_path.as_deref(), fp.old_mode, fp.new_mode)
    };
    if fp.op == Op::Copy && reverse {
        // Undo a copy: the copy must hold exactly what the patch made from its source.
        let copy = src.expect("a copy names its destination");
        let orig = dst.expect("a copy names its source");
        if copy == orig {
            // Never applied forward (its destination existed): nothing to undo.
            return Err(nohunk(ApplyErrorKind::FileExists));
        }
        let made = st.get(copy).cloned().ok_or_else(|| nohunk(ApplyErrorKind::MissingFile))?;
        let source = st.get(orig).cloned().ok_or_else(|| nohunk(ApplyErrorKind::MissingFile))?;
        let back = transform(&made.data, fp, true)?;
        if back != source.data {
            return Err(nohunk(ApplyErrorKind::Mismatch { line: 1, expected: "the copy's source".into(), found: "different content".into() }));
        }
        st.put(copy, None);
        return Ok(());
    }
    match op {
        Op::Create => {
            let dst = dst.expect("a created file has a path");
            if st.get(dst).is_some() {
                return Err(nohunk(ApplyErrorKind::FileExists));
            }
            let data = transform(&[], fp, reverse)?;
            st.put(dst, Some(Entry { mode: dst_mode.unwrap_or(MODE_FILE), data }));
        }
        Op::Delete => {
            let src = src.expect("a deleted file has a path");
            let cur = st.get(src).cloned().ok_or_else(|| nohunk(ApplyErrorKind::MissingFile))?;
            check_mode(src_mode, cur.mode)?;
            // The deletion's hunk ends the file; if it matches but more follows, say so plainly.
            let rest = transform(&cur.data, fp, reverse).map_err(|(h, k)| (h, if matches!(k, ApplyErrorKind::NotAtEnd { .. }) { ApplyErrorKind::DeleteLeavesContent } else { k }))?;
            if !rest.is_empty() {
                return Err(nohunk(ApplyErrorKind::DeleteLeavesContent));
            }
            st.put(src, None);
        }
        Op::Modify | Op::Rename | Op::Copy => {
            let src = src.expect("a modified file has a path");
            let dst = dst.expect("a modified file has a path");
            let cur = st.get(src).cloned().ok_or_else(|| nohunk(ApplyErrorKind::MissingFile))?;
            check_mode(src_mode, cur.mode)?;
            // A copy never writes over an existing file, not even its own source (git refuses
            // "already exists"; reversing it would delete the source).
            if (src != dst || op == Op::Copy) && st.get(dst).is_some() {
                return Err(nohunk(ApplyErrorKind::FileExists));
            }
            let data = transform(&cur.data, fp, reverse)?;
            if op == Op::Rename {
                st.put(src, None);
            }
            st.put(dst, Some(Entry { mode: dst_mode.unwrap_or(cur.mode), data }));
        }
    }
    Ok(())
}

fn check_mode(expected: Option<u32>, found: u32) -> FileResult<()> {
    match expected {
        Some(expected) if expected != found => Err((None, ApplyErrorKind::ModeMismatch { expected, found })),
        _ => Ok(()),
    }
}

/// The file's content after this section's content change.
fn transform(data: &[u8], fp: &FilePatch, reverse: bool) -> FileResult<Vec<u8>> {
    match &fp.content {
        Content::None => Ok(data.to_vec()),
        Content::Text(hunks) => place(data, hunks, reverse),
        Content::BinaryWithoutData => Err((None, ApplyErrorKind::BinaryWithoutData)),
        Content::Binary { forward, reverse: back } => {
            let (new, old) = if reverse { (back.as_ref().ok_or((None, ApplyErrorKind::BinaryNotReversible))?, Some(forward)) } else { (forward, back.as_ref()) };
            // The preimage: the opposite literal when present, and the index line's id (full or
            // abbreviated) always, so that a patch whose literal and id disagree is refused in
            // both directions, not only in the one that checks the id.
            let expected_id = if reverse { &fp.new_id } else { &fp.old_id };
            if let Some(BinaryHunk::Literal(d)) = old {
                if d != data {
                    return Err((None, ApplyErrorKind::BinaryPreimage));
                }
            }
            if let Some(id) = expected_id {
                if !blob_matches(data, id) {
                    return Err((None, ApplyErrorKind::BinaryPreimage));
                }
            }
            let result = match new {
                BinaryHunk::Literal(d) => d.clone(),
                BinaryHunk::Delta(d) => crate::delta::apply(data, d).map_err(|e| (None, e.into()))?,
            };
            // The result must be the blob the index line names (git checks this too).
            let result_id = if reverse { &fp.old_id } else { &fp.new_id };
            if let Some(id) = result_id {
                if !blob_matches(&result, id) {
                    return Err((None, ApplyErrorKind::BinaryPostimage { expected: id.as_str().into(), found: git_blob_id(&result).into() }));
                }
            }
            // The opposite hunk, a delta, must take the result back to this file (a literal one was
            // compared above): otherwise a patch applied one way would not reverse-apply.
            if let Some(BinaryHunk::Delta(d)) = old {
                if crate::delta::apply(&result, d).ok().as_deref() != Some(data) {
                    return Err((None, ApplyErrorKind::BinaryInconsistent));
                }
            }
            Ok(result)
        }
    }
}

/// Whether `data` is the blob `id` names: its blob id starts with `id` (git abbreviates), or
/// `id` is the null id (all zeros) and there is no content.
fn blob_matches(data: &[u8], id: &str) -> bool {
    if id.bytes().all(|b| b == b'0') {
        return data.is_empty();
    }
    // A SHA-256 repository's ids (64 digits) cannot be checked with SHA-1 blob ids.
    id.len() > 40 || git_blob_id(data).starts_with(id)
}

/// git's blob id: sha1 of `blob <len>\0<data>`.
pub fn git_blob_id(data: &[u8]) -> String {
    use sha1::{Digest, Sha1};
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", data.len()).as_bytes());
    h.update(data);
    crate::tree::hex(&h.finalize())
}

/// Places `hunks` on `data` at exactly their stated lines.
pub fn place(data: &[u8], hunks: &[Hunk], reverse: bool) -> FileResult<Vec<u8>> {
    let lines = split_lines(data);
    let mut out = Vec::with_capacity(data.len() + 256);
    let mut cursor = 0;
    for (k, h) in hunks.iter().enumerate() {
        let at = Some((k + 1, h.patch_line));
        let pre = h.preimage(reverse);
        let (start, count) = h.pre_range(reverse);
        // A range of zero lines names the line after which the hunk inserts. The position is exact,
        // so a hunk from line 1 is anchored at the beginning (git's match_beginning) already.
        let idx = if count == 0 { start } else { start.saturating_sub(1) };
        if idx < cursor {
            return Err((at, ApplyErrorKind::Overlap));
        }
        let end = idx.checked_add(pre.len());
        let here = end.and_then(|e| lines.get(idx..e)) == Some(&pre[..]);
        if !here || (h.anchored_at_end() && end != Some(lines.len())) {
            return Err((at, diagnose(&lines, h, reverse, idx)));
        }
        for l in &lines[cursor..idx] {
            out.extend_from_slice(l);
        }
        for l in h.postimage(reverse) {
            out.extend_from_slice(l);
        }
        cursor = idx + pre.len();
    }
    for l in &lines[cursor..] {
        out.extend_from_slice(l);
    }
    Ok(out)
}

fn positions(lines: &[&[u8]], pre: &[&[u8]]) -> Vec<usize> {
    if pre.is_empty() || pre.len() > lines.len() {
        return Vec::new();
    }
    (0..=lines.len() - pre.len()).filter(|&p| lines[p..p + pre.len()] == *pre).collect()
}

/// `p - idx` as a signed offset, saturating (both may be any usize).
fn offset(p: usize, idx: usize) -> isize {
    if p >= idx {
        isize::try_from(p - idx).unwrap_or(isize::MAX)
    } else {
        isize::try_from(idx - p).map(|d| -d).unwrap_or(isize::MIN)
    }
}

fn diagnose(lines: &[&[u8]], h: &Hunk, reverse: bool, idx: usize) -> ApplyErrorKind {
    let pre = h.preimage(reverse);
    let stated = idx.saturating_add(1);
    if h.anchored_at_end() {
        // Only a match that ends the file counts for an anchored hunk.
        let at_end = lines.len().checked_sub(pre.len()).filter(|&p| lines[p..] == pre[..]);
        match at_end {
            Some(p) if p != idx => return ApplyErrorKind::AtOffset { stated, line: p + 1, offset: offset(p, idx) },
            _ => {}
        }
        if let Some(after) = idx.checked_add(pre.len()).filter(|&e| lines.get(idx..e) == Some(&pre[..])).map(|e| lines.len() - e) {
            return ApplyErrorKind::NotAtEnd { line: stated, after };
        }
    } else if let Some(&p) = positions(lines, &pre).iter().min_by_key(|&&p| p.abs_diff(idx)) {
        return ApplyErrorKind::AtOffset { stated, line: p + 1, offset: offset(p, idx) };
    }
    let (lead, trail) = (h.leading_context(), h.trailing_context());
    for fuzz in 1..=2usize {
        let (a, b) = (fuzz.min(lead), fuzz.min(trail));
        if a + b == 0 || a + b >= pre.len() {
            continue;
        }
        if let Some(&p) = positions(lines, &pre[a..pre.len() - b]).iter().min_by_key(|&&p| p.abs_diff(idx.saturating_add(a))) {
            return ApplyErrorKind::WithFuzz { fuzz, line: (p + 1).saturating_sub(a).max(1) };
        }
    }
    if idx > lines.len() || (idx == lines.len() && !pre.is_empty()) {
        return ApplyErrorKind::PastEnd { line: stated, len: lines.len() };
    }
    let j = (0..pre.len()).find(|&j| lines.get(idx + j) != Some(&pre[j])).unwrap_or(0);
    let show = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    ApplyErrorKind::Mismatch { line: idx + j + 1, expected: show(pre[j]).into(), found: lines.get(idx + j).map(|l| show(l)).unwrap_or_else(|| "end of file".into()).into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::patch::parse;

    fn tree(files: &[(&str, &str)]) -> Tree {
        files.iter().map(|(p, d)| (p.to_string(), Entry::file(d.as_bytes()))).collect()
    }

    /// Applies `patch` to a one-file tree `f` holding `before`; renders the outcome.
    fn check(before: &str, patch: &str, expect: &str) {
        let mut t = tree(&[("f", before)]);
        let ps = parse(patch.as_bytes()).expect("test patches parse");
        let got = match apply(&mut t, &ps, "0001-test.patch") {
            Ok(()) => String::from_utf8(t["f"].data.clone()).expect("utf8"),
            Err(e) => format!("error: {e}"),
        };
        assert_eq!(got, expect);
    }

    const HDR: &str = "diff --git a/f b/f\n--- a/f\n+++ b/f\n";

    #[test]
    fn applies_exactly() {
        check("a\nb\nc\n", &format!("{HDR}@@ -1,3 +1,4 @@\n a\n b\n+x\n c\n"), "a\nb\nx\nc\n");
    }

    #[test]
    fn refuses_an_offset() {
        check(
            "z\na\nb\nc\n",
            &format!("{HDR}@@ -1,3 +1,4 @@\n a\n b\n+x\n c\n"),
            "error: patch 0001-test.patch: f, hunk #1 (patch line 4): the hunk would only apply at offset +1 (line 2, stated 1); offsets are refused on a pinned base",
        );
    }

    #[test]
    fn refuses_fuzz() {
        check(
            "a\nb\nQ\n",
            &format!("{HDR}@@ -1,3 +1,4 @@\n a\n b\n+x\n c\n"),
            "error: patch 0001-test.patch: f, hunk #1 (patch line 4): the hunk would only apply with fuzz 1 (ignoring 1 context line(s)) at line 1; fuzz is refused",
        );
    }

    #[test]
    fn whitespace_is_significant() {
        check(
            "a\nb \nc\n",
            &format!("{HDR}@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"),
            "error: patch 0001-test.patch: f, hunk #1 (patch line 4): the hunk's before-image does not match at line 2: expected \"b\\n\", found \"b \\n\"",
        );
    }

    #[test]
    fn detects_already_applied_insertion_with_repeated_context() {
        // Forward-first tools apply this a second time at an offset: the context `}\n}\n` repeats.
        let patch = format!("{HDR}@@ -3,2 +3,3 @@\n }}\n+x\n }}\n");
        let once = "fn a() {\n{\n}\n}\n}\n}\n";
        let mut t = tree(&[("f", once)]);
        let ps = parse(patch.as_bytes()).expect("parses");
        apply(&mut t, &ps, "p").expect("first application succeeds");
        let err = apply(&mut t, &ps, "p").expect_err("second application must be refused");
        assert_eq!(err.kind, ApplyErrorKind::AlreadyApplied);
    }

    #[test]
    fn crlf_is_preserved_and_must_match() {
        check("a\r\nb\r\n", &format!("{HDR}@@ -1,2 +1,2 @@\n a\r\n-b\r\n+c\r\n"), "a\r\nc\r\n");
        check(
            "a\nb\n",
            &format!("{HDR}@@ -1,2 +1,2 @@\n a\r\n-b\r\n+c\r\n"),
            "error: patch 0001-test.patch: f, hunk #1 (patch line 4): the hunk's before-image does not match at line 1: expected \"a\\r\\n\", found \"a\\n\"",
        );
    }

    #[test]
    fn reverse_restores_the_original() {
        let mut t = tree(&[("f", "a\nb\nc")]);
        let ps = parse(format!("{HDR}@@ -2,2 +2,2 @@\n b\n-c\n\\ No newline at end of file\n+C\n").as_bytes()).expect("parses");
        apply(&mut t, &ps, "p").expect("applies");
        assert_eq!(t["f"].data, b"a\nb\nC\n");
        unapply(&mut t, &ps, "p").expect("reverses");
        assert_eq!(t["f"].data, b"a\nb\nc");
        assert_eq!(unapply(&mut t, &ps, "p").expect_err("not applied").kind, ApplyErrorKind::NotApplied);
    }
}
