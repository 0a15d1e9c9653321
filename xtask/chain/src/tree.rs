//! In-memory file trees, their manifests, and atomic materialisation on disk.
//!
//! Every command works on a [`Tree`] first and touches the disk only at the end, through
//! [`write_tree_atomically`], so a failure never leaves a half-written `engine/upstream/`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::crashpoint::crashpoint;

/// Regular file, not executable.
pub const MODE_FILE: u32 = 0o100644;
/// Regular file, executable.
pub const MODE_EXEC: u32 = 0o100755;

/// The name of the state file that `apply-chain` keeps inside `engine/upstream/`.
/// It is not part of the tree: readers skip it.
pub const STATE_FILE: &str = ".tine-chain-state.json";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub mode: u32,
    pub data: Vec<u8>,
}

impl Entry {
    pub fn file(data: impl Into<Vec<u8>>) -> Entry {
        Entry { mode: MODE_FILE, data: data.into() }
    }
}

/// Path (relative, `/`-separated, UTF-8) to file.
pub type Tree = BTreeMap<String, Entry>;

pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        write!(s, "{b:02x}").expect("writing to a String cannot fail");
    }
    s
}

/// `path -> (sha256, mode)`, the comparable summary of a tree.
pub type Manifest = BTreeMap<String, (String, u32)>;

pub fn manifest_of(tree: &Tree) -> Manifest {
    tree.iter().map(|(p, e)| (p.clone(), (sha256_hex(&e.data), e.mode))).collect()
}

/// Manifest text: one `sha256 mode path` line per file, sorted by path. Deterministic.
pub fn render_manifest(m: &Manifest) -> String {
    let mut out = String::new();
    for (path, (sha, mode)) in m {
        writeln!(out, "{sha} {mode:o} {path}").expect("writing to a String cannot fail");
    }
    out
}

#[derive(Debug, thiserror::Error)]
#[error("{path}:{line}: malformed manifest line (expected `<sha256> <mode> <path>`): {text:?}")]
pub struct ManifestParseError {
    pub path: PathBuf,
    pub line: usize,
    pub text: String,
}

pub fn parse_manifest(text: &str, origin: &Path) -> Result<Manifest, ManifestParseError> {
    let mut m = Manifest::new();
    for (i, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let err = || ManifestParseError { path: origin.to_owned(), line: i + 1, text: line.to_owned() };
        let mut parts = line.splitn(3, ' ');
        let sha = parts.next().filter(|s| s.len() == 64).ok_or_else(err)?;
        let mode = parts.next().and_then(|m| u32::from_str_radix(m, 8).ok()).ok_or_else(err)?;
        let path = parts.next().filter(|p| !p.is_empty()).ok_or_else(err)?;
        m.insert(path.to_owned(), (sha.to_owned(), mode));
    }
    Ok(m)
}

/// How two manifests differ, path by path.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ManifestDiff {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub modified: Vec<String>,
    pub mode_changed: Vec<String>,
}

impl ManifestDiff {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.modified.is_empty() && self.mode_changed.is_empty()
    }

    pub fn paths(&self) -> BTreeSet<&str> {
        self.added.iter().chain(&self.removed).chain(&self.modified).chain(&self.mode_changed).map(|s| s.as_str()).collect()
    }

    /// A short human listing, at most `limit` lines.
    pub fn describe(&self, limit: usize) -> String {
        let mut lines = Vec::new();
        for p in &self.modified {
            lines.push(format!("  modified: {p}"));
        }
        for p in &self.added {
            lines.push(format!("  added:    {p}"));
        }
        for p in &self.removed {
            lines.push(format!("  removed:  {p}"));
        }
        for p in &self.mode_changed {
            lines.push(format!("  mode:     {p}"));
        }
        let total = lines.len();
        lines.truncate(limit);
        if total > limit {
            lines.push(format!("  … and {} more", total - limit));
        }
        lines.join("\n")
    }
}

/// `actual` compared with `expected`: `added` are paths only in `actual`.
pub fn diff_manifests(expected: &Manifest, actual: &Manifest) -> ManifestDiff {
    let mut d = ManifestDiff::default();
    for (p, (sha, mode)) in expected {
        match actual.get(p) {
            None => d.removed.push(p.clone()),
            Some((s2, m2)) => {
                if s2 != sha {
                    d.modified.push(p.clone());
                } else if m2 != mode {
                    d.mode_changed.push(p.clone());
                }
            }
        }
    }
    for p in actual.keys() {
        if !expected.contains_key(p) {
            d.added.push(p.clone());
        }
    }
    d
}

#[derive(Debug, thiserror::Error)]
pub enum ReadTreeError {
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: file name is not UTF-8; Tine's trees hold UTF-8 paths only")]
    NonUtf8Path { path: PathBuf },
    #[error("{path}: symbolic links and special files are not supported in a base tree")]
    Unsupported { path: PathBuf },
}

/// Reads every regular file under `root` (skipping `.git/` and the chain state file).
pub fn read_tree(root: &Path) -> Result<Tree, ReadTreeError> {
    let mut tree = Tree::new();
    read_dir_into(root, root, &mut tree)?;
    Ok(tree)
}

fn read_dir_into(root: &Path, dir: &Path, tree: &mut Tree) -> Result<(), ReadTreeError> {
    let io_err = |path: &Path| {
        let path = path.to_owned();
        move |source| ReadTreeError::Io { path, source }
    };
    let mut entries: Vec<_> = fs::read_dir(dir).map_err(io_err(dir))?.collect::<Result<_, _>>().map_err(io_err(dir))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name();
        if dir == root && (name == ".git" || name == STATE_FILE || name.to_str().is_some_and(|n| n.starts_with(&format!(".{STATE_FILE}.tmp-")))) {
            // The state file is not part of the tree, nor is the temporary of an interrupted write of it.
            continue;
        }
        let meta = fs::symlink_metadata(&path).map_err(io_err(&path))?;
        if meta.is_dir() {
            read_dir_into(root, &path, tree)?;
        } else if meta.is_file() {
            let rel = path.strip_prefix(root).expect("walked paths lie under the root");
            let rel = rel.to_str().ok_or_else(|| ReadTreeError::NonUtf8Path { path: path.clone() })?;
            let data = fs::read(&path).map_err(io_err(&path))?;
            let mode = if meta.permissions().mode() & 0o111 != 0 { MODE_EXEC } else { MODE_FILE };
            tree.insert(rel.replace(std::path::MAIN_SEPARATOR, "/"), Entry { mode, data });
        } else {
            return Err(ReadTreeError::Unsupported { path });
        }
    }
    Ok(())
}

/// Hook markers: `tine-hook: <name>` anywhere in a file (any comment syntax).
pub const HOOK_MARKER: &str = "tine-hook:";

/// The hook names marked in `data`.
pub fn hooks_in(data: &[u8]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let marker = HOOK_MARKER.as_bytes();
    let mut i = 0;
    while let Some(pos) = find(&data[i..], marker) {
        let mut j = i + pos + marker.len();
        while j < data.len() && data[j] == b' ' {
            j += 1;
        }
        let start = j;
        while j < data.len() && (data[j].is_ascii_alphanumeric() || data[j] == b'-' || data[j] == b'_' || data[j] == b'.') {
            j += 1;
        }
        if j > start {
            out.insert(String::from_utf8_lossy(&data[start..j]).into_owned());
        }
        i = j.max(i + pos + 1);
    }
    out
}

pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Hook name -> files that mark it.
pub fn hooks_of_tree(tree: &Tree) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (path, e) in tree {
        for h in hooks_in(&e.data) {
            out.entry(h).or_default().insert(path.clone());
        }
    }
    out
}

thread_local! {
    static FAIL_BEFORE_SWAP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Test support: the next [`write_tree_atomically`] on this thread fails after writing the
/// scratch tree and before swapping it in, as an interrupted run would.
#[doc(hidden)]
pub fn interrupt_next_write_before_swap() {
    FAIL_BEFORE_SWAP.with(|f| f.set(true));
}

#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}")]
pub struct WriteError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

fn werr(path: &Path) -> impl FnOnce(io::Error) -> WriteError + '_ {
    move |source| WriteError { path: path.to_owned(), source }
}

/// Writes `data` to `path` atomically: a temporary sibling, fsync, rename. Temporaries that
/// interrupted writes of the same file left behind (their process is gone) are removed first.
pub fn write_file_atomically(path: &Path, data: &[u8]) -> Result<(), WriteError> {
    let dir = path.parent().expect("a file path has a parent directory");
    fs::create_dir_all(dir).map_err(werr(dir))?;
    let name = path.file_name().expect("a file path has a name").to_string_lossy().into_owned();
    remove_stale(dir, &format!(".{name}.tmp-"));
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    {
        use std::io::Write;
        let mut f = fs::File::create(&tmp).map_err(werr(&tmp))?;
        f.write_all(data).map_err(werr(&tmp))?;
        f.sync_all().map_err(werr(&tmp))?;
    }
    crashpoint("file-tmp-written");
    fs::rename(&tmp, path).map_err(werr(path))?;
    crashpoint("file-renamed");
    Ok(())
}

/// A path a tree may hold: relative, `/`-separated, without empty, `.` or `..` components.
pub fn is_safe_path(path: &str) -> bool {
    !path.is_empty() && !path.starts_with('/') && !path.contains('\0') && path.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

/// Materialises `tree` at `dest` atomically: the tree (plus `extra` files such as the state
/// file) is written into a scratch sibling directory, then swapped into place with one
/// `renameat2(RENAME_EXCHANGE)` (or, where that is unavailable, two renames).
/// Files whose bytes and mode equal those already at `dest` keep their modification time,
/// so cargo does not rebuild crates that did not change.
pub fn write_tree_atomically(dest: &Path, tree: &Tree, extra: &[(&str, &[u8])], progress: &indicatif::ProgressBar) -> Result<(), WriteError> {
    let parent = dest.parent().expect("destination has a parent directory");
    fs::create_dir_all(parent).map_err(werr(parent))?;
    let name = dest.file_name().expect("destination has a name").to_string_lossy().into_owned();
    let scratch = parent.join(format!(".{name}.new-{}", std::process::id()));
    // Nothing is written outside `dest`, whatever the tree holds (a damaged backup, say).
    if let Some(bad) = tree.keys().map(String::as_str).chain(extra.iter().map(|(r, _)| *r)).find(|r| !is_safe_path(r)) {
        return Err(WriteError { path: dest.join(bad), source: io::Error::new(io::ErrorKind::InvalidInput, format!("path {bad:?} is absolute or leaves the tree")) });
    }
    remove_stale(parent, &format!(".{name}.new-"));
    let result = (|| {
        fs::create_dir_all(&scratch).map_err(werr(&scratch))?;
        progress.set_length(tree.len() as u64);
        let half = tree.len() / 2;
        for (i, (rel, entry)) in tree.iter().enumerate() {
            let path = scratch.join(rel);
            fs::create_dir_all(path.parent().expect("joined path has a parent")).map_err(werr(&path))?;
            fs::write(&path, &entry.data).map_err(werr(&path))?;
            let perm = fs::Permissions::from_mode(if entry.mode == MODE_EXEC { 0o755 } else { 0o644 });
            fs::set_permissions(&path, perm).map_err(werr(&path))?;
            let old = dest.join(rel);
            if let Ok(meta) = fs::symlink_metadata(&old) {
                let same_mode = (meta.permissions().mode() & 0o111 != 0) == (entry.mode == MODE_EXEC);
                if meta.is_file() && same_mode && meta.len() == entry.data.len() as u64 && fs::read(&old).map(|d| d == entry.data).unwrap_or(false) {
                    if let Ok(mtime) = meta.modified() {
                        let f = fs::File::options().write(true).open(&path).map_err(werr(&path))?;
                        f.set_modified(mtime).map_err(werr(&path))?;
                    }
                }
            }
            progress.inc(1);
            if i == half {
                crashpoint("tree-scratch-partial");
            }
        }
        for (rel, data) in extra {
            fs::write(scratch.join(rel), data).map_err(werr(&scratch.join(rel)))?;
        }
        crashpoint("tree-scratch-written");
        if FAIL_BEFORE_SWAP.with(|f| f.replace(false)) {
            return Err(WriteError { path: scratch.clone(), source: io::Error::other("simulated interruption before the swap") });
        }
        swap_into_place(&scratch, dest)
    })();
    if scratch.exists() {
        let _ = fs::remove_dir_all(&scratch);
    }
    result
}

/// Removes the scratch trees that killed writes of `dest` left beside it (their process is
/// gone): a write that has nothing to do still cleans up after the one before it.
pub fn remove_stale_scratch(dest: &Path) {
    if let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) {
        remove_stale(parent, &format!(".{}.new-", name.to_string_lossy()));
    }
}

/// Scratch trees and temporaries (`<prefix><pid>`) left by interrupted runs (their process is
/// gone) are removed; a live run's are kept.
fn remove_stale(parent: &Path, prefix: &str) {
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let file_name = e.file_name();
        let Some(pid) = file_name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let mine = pid == std::process::id().to_string();
        if mine || !Path::new("/proc").join(pid).exists() {
            let path = e.path();
            let _ = if path.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
        }
    }
}

fn swap_into_place(new: &Path, dest: &Path) -> Result<(), WriteError> {
    if dest.exists() {
        if exchange(new, dest).is_ok() {
            // `new` now holds the old tree (removed as a stale scratch if we die here).
            crashpoint("tree-swapped");
            return fs::remove_dir_all(new).map_err(werr(new));
        }
        let old = dest.with_file_name(format!(".{}.old-{}", dest.file_name().expect("named").to_string_lossy(), std::process::id()));
        fs::rename(dest, &old).map_err(werr(dest))?;
        if let Err(e) = fs::rename(new, dest) {
            let _ = fs::rename(&old, dest);
            return Err(werr(dest)(e));
        }
        fs::remove_dir_all(&old).map_err(werr(&old))
    } else {
        fs::rename(new, dest).map_err(werr(dest))
    }
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let ca = CString::new(a.as_os_str().as_bytes())?;
    let cb = CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: both pointers are valid NUL-terminated strings for the duration of the call.
    let rc = unsafe { libc::syscall(libc::SYS_renameat2, libc::AT_FDCWD, ca.as_ptr(), libc::AT_FDCWD, cb.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> io::Result<()> {
    Err(io::Error::other("no atomic exchange on this platform"))
}

/// A tree and its chain state file as an uncompressed tar (modes kept, mtimes zeroed): the
/// format of `backup` and of the snapshot a rebase keeps of the live tree.
pub fn tar_tree(tree: &Tree, state: Option<&[u8]>) -> io::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut add = |path: &str, data: &[u8], mode: u32| -> io::Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(mode & 0o777);
        h.set_mtime(0);
        h.set_cksum();
        builder.append_data(&mut h, path, data)
    };
    for (path, e) in tree {
        add(path, &e.data, e.mode)?;
    }
    if let Some(s) = state {
        add(STATE_FILE, s, 0o644)?;
    }
    builder.into_inner()
}

/// The inverse of [`tar_tree`]: the tree and the state file's bytes, if it was archived.
pub fn untar_tree(bytes: &[u8]) -> io::Result<(Tree, Option<Vec<u8>>)> {
    use std::io::Read as _;
    let mut t = Tree::new();
    let mut state = None;
    for entry in tar::Archive::new(bytes).entries()? {
        let mut entry = entry?;
        let path = entry.path()?.to_string_lossy().into_owned();
        if !entry.header().entry_type().is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("entry {path:?} is not a regular file")));
        }
        if !is_safe_path(&path) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("entry {path:?} is absolute or leaves the tree")));
        }
        let mode = if entry.header().mode()? & 0o111 != 0 { MODE_EXEC } else { MODE_FILE };
        let mut data = Vec::new();
        entry.read_to_end(&mut data)?;
        if path == STATE_FILE {
            state = Some(data);
        } else {
            t.insert(path, Entry { mode, data });
        }
    }
    Ok((t, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_are_found_in_any_comment_style() {
        let text = b"// tine-hook: kv-truncate\n# tine-hook:  toml_hook\n/* tine-hook: a.b */ tine-hook:\n";
        let got: Vec<_> = hooks_in(text).into_iter().collect();
        assert_eq!(got, ["a.b", "kv-truncate", "toml_hook"]);
    }

    #[test]
    fn manifest_round_trips() {
        let mut t = Tree::new();
        t.insert("a/b.rs".into(), Entry::file("x"));
        t.insert("run.sh".into(), Entry { mode: MODE_EXEC, data: b"#!/bin/sh\n".to_vec() });
        let m = manifest_of(&t);
        let text = render_manifest(&m);
        assert_eq!(parse_manifest(&text, Path::new("m")).expect("valid"), m);
        assert!(text.contains(" 100755 run.sh\n"));
    }
}
