//! `cargo xtask import`: a patch made elsewhere (a `git format-patch` mail of an upstream PR, or
//! a plain git diff) joins the series after a given patch, in Tine's own format.
//!
//! The patch must apply strictly on the chain up to that patch, and every later patch must still
//! apply on top of it. It is then re-exported as `capture` would write it (the same trees give
//! the same bytes), with the mail's subject and body, `Tine-Hook:` trailers for the markers it
//! adds, `Upstream-Status:`, and `Imported-*` trailers naming the original commit and author.
//! Everything is checked in memory before anything is written; if a write or the final
//! sync-check fails, every file written is put back.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use crate::apply::{self, ApplyError};
use crate::chain::{self, Live, LoadedPatch};
use crate::export;
use crate::extension::Extension;
use crate::patch::{self, ParseError};
use crate::project::Project;
use crate::registry::{self, PatchEntry};
use crate::sync_check;
use crate::tree::{self, Tree};

pub struct ImportOptions<'a> {
    /// The patch to import.
    pub file: &'a Path,
    /// The patch it follows (`0000`: the pristine base).
    pub after: &'a str,
    /// Its id; default: the one after `after`'s.
    pub id: Option<&'a str>,
    /// Its file name's slug; default: made from the subject.
    pub slug: Option<&'a str>,
    pub area: &'a str,
    pub upstream_status: &'a str,
}

/// What an import did.
#[derive(Debug)]
pub struct Imported {
    pub file: String,
    pub id: String,
    pub hooks: Vec<String>,
    /// engine/upstream/ held patches after the new one's place, and was rebuilt to include it.
    pub rebuilt_live: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a patch this toolchain can parse")]
    Parse {
        path: PathBuf,
        #[source]
        source: ParseError,
    },
    #[error("{path} holds {count} mails; import them one at a time, in order")]
    SeveralMails { path: PathBuf, count: usize },
    #[error("{path} changes nothing")]
    Empty { path: PathBuf },
    #[error("{0}")]
    Usage(String),
    #[error("no id fits after {prev} and before {next} (ids increase in series order); renumber, or import after another patch")]
    NoFreeId { prev: String, next: String },
    #[error("{path} does not apply strictly on the chain up to {after}; nothing was written")]
    DoesNotApply {
        path: PathBuf,
        after: String,
        #[source]
        source: Box<ApplyError>,
    },
    #[error("with it, a later patch no longer applies; nothing was written{}", unchecked_note(.unchecked))]
    BreaksLater {
        #[source]
        source: Box<ApplyError>,
        unchecked: Vec<String>,
    },
    #[error("the imported patch marks hook {hook:?}, which patch {other} declares; nothing was written")]
    HookTaken { hook: String, other: String },
    #[error("{0}")]
    LiveEdits(String),
    #[error("internal error: {0}")]
    Internal(String),
    #[error("the import was written but sync-check then found problems, so every file was put back:\n  {}", .0.join("\n  "))]
    Unverified(Vec<String>),
    #[error("the chain up to {after} does not apply: {error} (run `cargo xtask verify`)")]
    ChainBroken { after: String, error: Box<ApplyError> },
    #[error(transparent)]
    Write(#[from] tree::WriteError),
    #[error(transparent)]
    Load(#[from] chain::LoadAllError),
    #[error(transparent)]
    Resolve(#[from] chain::ResolveError),
    #[error(transparent)]
    Live(#[from] chain::LiveError),
    #[error(transparent)]
    Bless(#[from] chain::BlessError),
}

fn unchecked_note(unchecked: &[String]) -> String {
    match unchecked.len() {
        0 => String::new(),
        n => format!(" (the {n} after it were not checked, since they build on it: {})", unchecked.join(", ")),
    }
}

/// The parts of a `git format-patch` mail we keep.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Mail {
    pub commit: Option<String>,
    pub author: Option<String>,
    pub date: Option<String>,
    /// Without the `[PATCH …]` prefix, unfolded and decoded.
    pub subject: Option<String>,
    /// The message body (between the headers and the `---` line), trimmed.
    pub body: String,
    /// How many mails the text holds (the `From <sha> …` lines).
    pub count: usize,
}

/// `From <40 hex> …`, the mbox line that starts each format-patch mail.
fn mbox_commit(line: &str) -> Option<&str> {
    let sha = line.strip_prefix("From ")?.split(' ').next()?;
    (sha.len() == 40 && sha.bytes().all(|b| b.is_ascii_hexdigit())).then_some(sha)
}

/// Decodes RFC 2047 `=?UTF-8?q?…?=` words (git writes non-ASCII names and subjects this way);
/// anything else is kept as written.
fn decode_words(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    let mut last_was_word = false;
    while let Some(start) = rest.find("=?") {
        let (before, word) = rest.split_at(start);
        let decoded = word[2..].split_once('?').and_then(|(charset, r)| {
            let (enc, r) = r.split_once('?')?;
            let (text, after) = r.split_once("?=")?;
            if !charset.eq_ignore_ascii_case("utf-8") || !enc.eq_ignore_ascii_case("q") {
                return None;
            }
            let mut bytes = Vec::new();
            let b = text.as_bytes();
            let mut i = 0;
            while i < b.len() {
                match b[i] {
                    b'_' => bytes.push(b' '),
                    b'=' => {
                        let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                        bytes.push(u8::from_str_radix(hex, 16).ok()?);
                        i += 2;
                    }
                    c => bytes.push(c),
                }
                i += 1;
            }
            Some((String::from_utf8(bytes).ok()?, after))
        });
        match decoded {
            Some((text, after)) => {
                // Whitespace between two encoded words is not part of the text.
                if !(last_was_word && before.trim().is_empty()) {
                    out.push_str(before);
                }
                out.push_str(&text);
                rest = after;
                last_was_word = true;
            }
            None => {
                out.push_str(before);
                out.push_str("=?");
                rest = &word[2..];
                last_was_word = false;
            }
        }
    }
    out.push_str(rest);
    out
}

/// `[PATCH v2 3/7] kv: x` -> `kv: x`.
fn strip_patch_prefix(s: &str) -> &str {
    let mut s = s.trim();
    while let Some(rest) = s.strip_prefix('[').and_then(|r| r.split_once(']')).map(|(_, r)| r.trim_start()) {
        s = rest;
    }
    s
}

impl Mail {
    /// Reads the text before the first `diff --git`. Text that is not a mail is all body.
    pub fn parse(header: &[u8]) -> Mail {
        let text = String::from_utf8_lossy(header);
        let lines: Vec<&str> = text.lines().collect();
        let mut m = Mail { count: lines.iter().filter(|l| mbox_commit(l).is_some()).count(), ..Mail::default() };
        let mut i = 0;
        if let Some(sha) = lines.first().and_then(|l| mbox_commit(l)) {
            m.commit = Some(sha.to_owned());
            i = 1;
        }
        let is_field = |l: &str| l.split_once(':').is_some_and(|(k, _)| !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
        let mut fields: Vec<(String, String)> = Vec::new();
        if lines.get(i).is_some_and(|l| is_field(l)) {
            while let Some(l) = lines.get(i).filter(|l| !l.is_empty()) {
                if l.starts_with([' ', '\t']) {
                    // A folded header line continues the previous field.
                    if let Some(last) = fields.last_mut() {
                        last.1.push(' ');
                        last.1.push_str(l.trim());
                    }
                } else if let Some((k, v)) = l.split_once(':') {
                    fields.push((k.to_owned(), v.trim().to_owned()));
                } else {
                    break;
                }
                i += 1;
            }
        }
        for (k, v) in fields {
            let v = decode_words(&v);
            match k.to_ascii_lowercase().as_str() {
                "from" => m.author = Some(v),
                "date" => m.date = Some(v),
                "subject" => m.subject = Some(strip_patch_prefix(&v).to_owned()).filter(|s| !s.is_empty()),
                _ => {}
            }
        }
        // The body ends at the `---` before the diffstat. Trailers that Tine writes itself are
        // dropped: the import writes its own.
        let body: Vec<&str> = lines[i.min(lines.len())..].iter().take_while(|l| **l != "---").filter(|l| !l.starts_with("Tine-Hook:") && !l.starts_with("Upstream-Status:")).copied().collect();
        m.body = body.join("\n").trim_matches('\n').trim_end().to_owned();
        m
    }
}

/// A lowercase slug of a subject: `kv: add Truncate()` -> `kv-add-truncate`.
pub fn slugify(subject: &str) -> String {
    let mut slug = String::new();
    for c in subject.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') && !slug.is_empty() {
            slug.push('-');
        }
    }
    let mut slug = slug.trim_end_matches('-').to_owned();
    // Long subjects are cut at a word boundary, so file names stay readable.
    if slug.len() > 48 {
        let cut = slug[..48].rfind('-').unwrap_or(48);
        slug.truncate(cut);
    }
    slug
}

fn valid_slug(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') && !s.starts_with('-') && !s.ends_with('-')
}

/// The id between `prev` and `next`: `wanted`, or the one right after `prev`.
fn choose_id(wanted: Option<&str>, prev: &str, next: Option<&str>, taken: &BTreeSet<&str>) -> Result<String, ImportError> {
    let fits = |id: &str| id > prev && next.is_none_or(|n| id < n) && !taken.contains(id);
    match wanted {
        Some(id) => {
            if id.len() != 4 || !id.bytes().all(|b| b.is_ascii_digit()) || id == "0000" {
                return Err(ImportError::Usage(format!("--id {id:?}: an id is four digits, 0001-9999")));
            }
            if !fits(id) {
                return Err(ImportError::Usage(format!("patch {id} would sit after {prev}{}; pick an id in between", next.map(|n| format!(" and before {n}")).unwrap_or_default())));
            }
            Ok(id.to_owned())
        }
        None => {
            let n: u32 = prev.parse().map_err(|_| ImportError::Internal(format!("patch id {prev:?} is not a number")))?;
            let id = format!("{:04}", n + 1);
            if n + 1 > 9999 || !fits(&id) {
                return Err(ImportError::NoFreeId { prev: prev.to_owned(), next: next.unwrap_or("9999").to_owned() });
            }
            Ok(id)
        }
    }
}

fn render_header(title: &str, mail: &Mail, hooks: &[String], upstream_status: &str) -> String {
    let mut h = format!("Subject: [PATCH] {title}\n\n");
    if !mail.body.is_empty() {
        h.push_str(&mail.body);
        h.push_str("\n\n");
    }
    for hook in hooks {
        h.push_str(&format!("Tine-Hook: {hook}\n"));
    }
    h.push_str(&format!("Upstream-Status: {upstream_status}\n"));
    for (k, v) in [("Imported-From", &mail.commit), ("Imported-Author", &mail.author), ("Imported-Date", &mail.date)] {
        if let Some(v) = v {
            h.push_str(&format!("{k}: {v}\n"));
        }
    }
    h.push_str("---\n");
    h
}

/// Files as they were before the import, put back if it fails half-way.
struct Undo(Vec<(PathBuf, Option<Vec<u8>>)>);

impl Undo {
    fn snapshot(paths: &[PathBuf]) -> Undo {
        Undo(paths.iter().map(|p| (p.clone(), fs::read(p).ok())).collect())
    }
    fn restore(self) {
        for (path, old) in self.0 {
            // Best effort: the first error is what the caller reports.
            match old {
                Some(bytes) => {
                    let _ = tree::write_file_atomically(&path, &bytes);
                }
                None => {
                    let _ = fs::remove_file(&path);
                }
            }
        }
    }
}

/// Imports `o.file` into the series after `o.after`.
pub fn import(p: &Project, ext: &dyn Extension, o: &ImportOptions<'_>, pb: &indicatif::ProgressBar) -> Result<Imported, ImportError> {
    let path = o.file.to_owned();
    let bytes = fs::read(&path).map_err(|source| ImportError::Read { path: path.clone(), source })?;
    let incoming = patch::parse(&bytes).map_err(|source| ImportError::Parse { path: path.clone(), source })?;
    if incoming.files.is_empty() {
        return Err(ImportError::Empty { path });
    }
    let mail = Mail::parse(&incoming.header);
    if mail.count > 1 {
        return Err(ImportError::SeveralMails { path, count: mail.count });
    }
    if mail.body.lines().any(|l| l.starts_with("diff --git ")) {
        return Err(ImportError::Usage(format!("{}: the message body holds a `diff --git` line, which would read as a diff; edit it out first", path.display())));
    }
    registry::check_area(o.area, ext.areas()).map_err(|e| ImportError::Usage(format!("--area: {e}")))?;
    let slug = match (o.slug, &mail.subject) {
        (Some(s), _) => s.to_owned(),
        (None, Some(subject)) => slugify(subject),
        (None, None) => return Err(ImportError::Usage(format!("{} has no `Subject:` line; pass --slug", path.display()))),
    };
    if !valid_slug(&slug) {
        return Err(ImportError::Usage(format!("slug {slug:?} must be lowercase letters, digits and inner dashes; pass --slug")));
    }
    let title = mail.subject.clone().unwrap_or_else(|| slug.replace('-', " "));

    let mut l = chain::load_all(p, pb)?;
    let k = chain::resolve_to(&l.patches, Some(o.after))?;
    let prev = if k == 0 { "0000".to_owned() } else { l.patches[k - 1].entry.id.clone() };
    // Right after `prev`'s registry entry (retired entries keep their places), as capture does.
    let pos = l.registry.patches.iter().position(|e| e.id == prev).map_or(0, |i| i + 1);
    let next = l.registry.patches.get(pos).map(|e| e.id.clone());
    let taken: BTreeSet<&str> = l.registry.patches.iter().map(|e| e.id.as_str()).collect();
    let id = choose_id(o.id, &prev, next.as_deref(), &taken)?;
    let file = format!("{id}-{slug}.patch");
    let patch_path = p.patches_dir().join(&file);
    if patch_path.exists() {
        return Err(ImportError::Usage(format!("{} already exists; pick another --slug or --id", p.rel(&patch_path))));
    }

    pb.set_message("applying the chain");
    let before = chain::build(&l.base, &l.patches[..k]).map_err(|e| ImportError::ChainBroken { after: prev.clone(), error: Box::new(e) })?;
    let mut after = before.clone();
    let shown = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string());
    apply::apply(&mut after, &incoming, &shown).map_err(|source| ImportError::DoesNotApply { path: path.clone(), after: prev.clone(), source: Box::new(source) })?;
    if tree::manifest_of(&after) == tree::manifest_of(&before) {
        return Err(ImportError::Empty { path });
    }
    let hooks = chain::hooks_added(&before, &after);
    for h in &hooks {
        if let Some(other) = l.registry.patches.iter().find(|e| e.hooks.contains(h)) {
            return Err(ImportError::HookTaken { hook: h.clone(), other: other.id.clone() });
        }
    }

    // Tine's format, proved: it parses and applies back to exactly the imported tree.
    let mut out = render_header(&title, &mail, &hooks, o.upstream_status).into_bytes();
    out.extend_from_slice(&export::diff_trees(&before, &after));
    let parsed = patch::parse(&out).map_err(|e| ImportError::Internal(format!("the re-exported {file} does not parse: {e}")))?;
    let mut check = before.clone();
    apply::apply(&mut check, &parsed, &file).map_err(|e| ImportError::Internal(format!("the re-exported {file} does not apply to its own base: {e}")))?;
    if check != after {
        return Err(ImportError::Internal(format!("the re-exported {file} does not reproduce the imported tree")));
    }

    let entry = PatchEntry::carried(&id, &file, &out, title, o.area, hooks.clone());
    let new_patch = LoadedPatch { entry: entry.clone(), bytes: out.clone(), parsed };
    let mut series: Vec<LoadedPatch> = l.patches[..k].to_vec();
    series.push(new_patch);
    series.extend_from_slice(&l.patches[k..]);

    // Every later patch still applies on top; and the whole new chain reverses to the base.
    pb.set_message("re-applying the later patches");
    let mut full = after.clone();
    for (i, lp) in l.patches[k..].iter().enumerate() {
        if let Err(source) = apply::apply(&mut full, &lp.parsed, lp.name()) {
            return Err(ImportError::BreaksLater { source: Box::new(source), unchecked: l.patches[k + i + 1..].iter().map(|lp| lp.name().to_owned()).collect() });
        }
    }
    let mut back = full.clone();
    for lp in series.iter().rev() {
        apply::unapply(&mut back, &lp.parsed, lp.name()).map_err(|e| ImportError::Internal(format!("the new chain does not reverse: {e}")))?;
    }
    if back != l.base {
        return Err(ImportError::Internal("the new chain does not reverse to the pristine base".into()));
    }

    // engine/upstream/: a prefix up to `prev` stays valid; a tree holding later patches is rebuilt
    // with the import (it has no edits, so nothing is lost); edits there would be stranded.
    let live = Live::read(p)?;
    let rebuild: Option<(Tree, usize)> = match live.as_ref().and_then(|lv| lv.state.as_ref().map(|s| (lv, s))) {
        Some((lv, state)) if state.applied.len() > k && state.applied.iter().zip(&l.patches).all(|(a, b)| *a == b.entry.id) => {
            let drift = lv.drift().expect("state is present");
            if !drift.is_empty() {
                return Err(ImportError::LiveEdits(format!(
                    "{} holds edits that no patch carries, on top of patches after {prev}; importing below them would strand them:\n{}\nkeep them first (`cargo xtask refresh {}`, `capture` or `backup`), or `cargo xtask apply-chain --to {prev}`",
                    p.live_name(),
                    drift.describe(20),
                    state.top()
                )));
            }
            let n = state.applied.len() + 1;
            let t = chain::build(&l.base, &series[..n]).map_err(|e| ImportError::Internal(format!("the new chain does not apply: {e}")))?;
            Some((t, n))
        }
        _ => None,
    };

    // Write, and put everything back if any step fails.
    let mut touched = vec![patch_path.clone(), p.registry_path(), p.sync_doc_path(), p.patched_manifest_path()];
    touched.extend(ext.generated_files(p, &l.registry, &series.iter().map(|lp| &lp.parsed).collect::<Vec<_>>()).into_iter().map(|(path, _)| path));
    let undo = Undo::snapshot(&touched);
    let problems_before: BTreeSet<String> = sync_check::sync_check(p, ext, &l.registry).into_iter().collect();
    let result = (|| -> Result<(), ImportError> {
        tree::write_file_atomically(&patch_path, &out)?;
        l.registry.patches.insert(pos, entry);
        if let Err(e) = chain::bless(p, ext, &mut l.registry, &l.base, false)? {
            return Err(ImportError::Internal(format!("the new chain does not apply: {e}")));
        }
        let new: Vec<String> = sync_check::sync_check(p, ext, &l.registry).into_iter().filter(|pr| !problems_before.contains(pr)).collect();
        if !new.is_empty() {
            return Err(ImportError::Unverified(new));
        }
        if let Some((t, n)) = &rebuild {
            pb.set_message(format!("writing {}", p.live_name()));
            chain::write_live(p, t, &series[..*n], pb)?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        undo.restore();
        return Err(e);
    }
    Ok(Imported { file, id, hooks, rebuilt_live: rebuild.is_some() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_format_patch_mail() {
        let m = Mail::parse(
            b"From 0045efdf3d40188bc9e0fe1301fc552b89b9ba63 Mon Sep 17 00:00:00 2001\nFrom: =?UTF-8?q?Zo=C3=AB=20=C3=9Cn?= =?UTF-8?q?=C3=AFcode?= <z@x>\nDate: Tue, 1 Dec 2026 09:53:34 +0000\nSubject: [PATCH v2 1/2] kv: a long subject\n that is folded\n\nBody line one.\n\nSigned-off-by: Z <z@x>\n---\n f.txt | 3 ++-\n\n",
        );
        assert_eq!(m.commit.as_deref(), Some("0045efdf3d40188bc9e0fe1301fc552b89b9ba63"));
        assert_eq!(m.author.as_deref(), Some("Zoë Ünïcode <z@x>"));
        assert_eq!(m.subject.as_deref(), Some("kv: a long subject that is folded"));
        assert_eq!(m.body, "Body line one.\n\nSigned-off-by: Z <z@x>");
        assert_eq!(m.count, 1);
        assert_eq!(slugify(m.subject.as_deref().unwrap_or_default()), "kv-a-long-subject-that-is-folded");
        assert_eq!(Mail::parse(b"").subject, None);
    }

    #[test]
    fn ids_fit_between_their_neighbours() {
        let taken = BTreeSet::from(["0010", "0020"]);
        assert_eq!(choose_id(None, "0010", Some("0020"), &taken).expect("fits"), "0011");
        assert!(matches!(choose_id(None, "0010", Some("0011"), &taken), Err(ImportError::NoFreeId { .. })));
        assert_eq!(choose_id(Some("0015"), "0010", Some("0020"), &taken).expect("fits"), "0015");
        assert!(matches!(choose_id(Some("0020"), "0010", Some("0020"), &taken), Err(ImportError::Usage(_))));
        assert!(matches!(choose_id(None, "9999", None, &taken), Err(ImportError::NoFreeId { .. })));
    }
}
