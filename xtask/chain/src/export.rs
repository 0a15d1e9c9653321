//! Deterministic export: two trees in, git-style diff bytes out.
//!
//! The same pair of trees always gives the same bytes: paths sorted, Myers line diff with three
//! lines of context, full 40-hex `index` lines (git needs them for binary patches), exact renames
//! detected by content, binary files as zlib literals in both directions (so they reverse).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::Write as _;

use crate::apply::git_blob_id;
use crate::base85;
use crate::patch::{quote_path, split_lines};
use crate::tree::{Entry, Tree};

const ZERO_ID: &str = "0000000000000000000000000000000000000000";

fn is_binary(data: &[u8]) -> bool {
    data[..data.len().min(8000)].contains(&0)
}

fn id(e: Option<&Entry>) -> String {
    e.map(|e| git_blob_id(&e.data)).unwrap_or_else(|| ZERO_ID.to_owned())
}

/// The diff that turns `old` into `new`.
pub fn diff_trees(old: &Tree, new: &Tree) -> Vec<u8> {
    let removed: Vec<&String> = old.keys().filter(|p| !new.contains_key(*p)).collect();
    let added: BTreeSet<&String> = new.keys().filter(|p| !old.contains_key(*p)).collect();
    // Exact renames: a removed file whose bytes reappear under one added name.
    let mut renames: Vec<(&String, &String)> = Vec::new();
    let mut used: BTreeSet<&String> = BTreeSet::new();
    for r in &removed {
        if old[*r].data.is_empty() {
            continue;
        }
        if let Some(a) = added.iter().find(|a| !used.contains(*a) && new[**a].data == old[*r].data) {
            used.insert(a);
            renames.push((r, a));
        }
    }
    let renamed_from: BTreeSet<&String> = renames.iter().map(|(r, _)| *r).collect();

    // Sections keyed by their display path, so the output is sorted like git's.
    let mut sections: Vec<(String, Vec<u8>)> = Vec::new();
    for (path, e) in old {
        if let Some(n) = new.get(path) {
            if n != e {
                sections.push((path.clone(), section(Some(path), Some(path), Some(e), Some(n))));
            }
        } else if !renamed_from.contains(path) {
            sections.push((path.clone(), section(Some(path), None, Some(e), None)));
        }
    }
    for a in &added {
        if !used.contains(a) {
            sections.push(((*a).clone(), section(None, Some(a), None, Some(&new[*a]))));
        }
    }
    for (r, a) in &renames {
        sections.push(((*a).clone(), section(Some(r), Some(a), Some(&old[*r]), Some(&new[*a]))));
    }
    sections.sort_by(|x, y| x.0.cmp(&y.0));
    sections.into_iter().flat_map(|(_, s)| s).collect()
}

fn section(old_path: Option<&String>, new_path: Option<&String>, old: Option<&Entry>, new: Option<&Entry>) -> Vec<u8> {
    let a = old_path.or(new_path).expect("a section names a path");
    let b = new_path.or(old_path).expect("a section names a path");
    let mut out = String::new();
    writeln!(out, "diff --git {} {}", quote_path("a/", a), quote_path("b/", b)).expect("String write");
    let rename = old_path.is_some() && new_path.is_some() && a != b;
    match (old, new) {
        (None, Some(n)) => writeln!(out, "new file mode {:o}", n.mode),
        (Some(o), None) => writeln!(out, "deleted file mode {:o}", o.mode),
        (Some(o), Some(n)) if o.mode != n.mode => {
            writeln!(out, "old mode {:o}\nnew mode {:o}", o.mode, n.mode)
        }
        _ => Ok(()),
    }
    .expect("String write");
    if rename {
        let same = old.map(|e| &e.data) == new.map(|e| &e.data);
        writeln!(out, "similarity index {}%\nrename from {}\nrename to {}", if same { 100 } else { 50 }, quote_path("", a), quote_path("", b)).expect("String write");
        if same {
            return out.into_bytes();
        }
    }
    let old_data = old.map(|e| e.data.as_slice()).unwrap_or(&[]);
    let new_data = new.map(|e| e.data.as_slice()).unwrap_or(&[]);
    if old.is_some() && new.is_some() && old_data == new_data {
        return out.into_bytes(); // mode change only
    }
    let mode_suffix = match (old, new) {
        (Some(o), Some(n)) if o.mode == n.mode => format!(" {:o}", o.mode),
        _ => String::new(),
    };
    writeln!(out, "index {}..{}{mode_suffix}", id(old), id(new)).expect("String write");
    let mut bytes = out.into_bytes();
    if is_binary(old_data) || is_binary(new_data) {
        bytes.extend_from_slice(b"GIT binary patch\n");
        bytes.extend_from_slice(literal(new_data).as_bytes());
        bytes.extend_from_slice(literal(old_data).as_bytes());
        return bytes;
    }
    if old_data.is_empty() && new_data.is_empty() {
        return bytes;
    }
    let minus = if old.is_some() { quote_path("a/", a) } else { "/dev/null".into() };
    let plus = if new.is_some() { quote_path("b/", b) } else { "/dev/null".into() };
    bytes.extend_from_slice(format!("--- {minus}\n+++ {plus}\n").as_bytes());
    bytes.extend_from_slice(&hunks(old_data, new_data));
    bytes
}

fn literal(data: &[u8]) -> String {
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(9));
    z.write_all(data).expect("writing to a Vec cannot fail");
    let compressed = z.finish().expect("finishing a Vec encoder cannot fail");
    format!("literal {}\n{}\n", data.len(), base85::encode_lines(&compressed))
}

/// Unified hunks with three lines of context.
pub fn hunks(old: &[u8], new: &[u8]) -> Vec<u8> {
    let a = split_lines(old);
    let b = split_lines(new);
    let ops = similar::capture_diff_slices(similar::Algorithm::Myers, &a, &b);
    let mut out = Vec::new();
    // Lines added minus lines removed by the groups so far: before a group, old line `i` is new
    // line `i + delta`. The header is computed from the ranges that hold lines only: similar's
    // empty side of a `Delete` (its `new_index`) or `Insert` (its `old_index`) can point past the
    // group's start (`b a` -> `a a a` gave `@@ -1 +2,2 @@` for a hunk of -1,2 +1,3).
    let mut delta: isize = 0;
    for group in similar::group_diff_ops(ops, 3) {
        let old_len: usize = group.iter().map(|op| op.old_range().len()).sum();
        let new_len: usize = group.iter().map(|op| op.new_range().len()).sum();
        let old_start = group.iter().map(|op| op.old_range()).filter(|r| !r.is_empty()).map(|r| r.start).min();
        let new_start = group.iter().map(|op| op.new_range()).filter(|r| !r.is_empty()).map(|r| r.start).min();
        let (os, ns) = match (old_start, new_start) {
            (Some(o), _) => (o, o.checked_add_signed(delta).expect("the new side is aligned")),
            (None, Some(n)) => (n.checked_add_signed(-delta).expect("the old side is aligned"), n),
            (None, None) => continue,
        };
        delta += new_len as isize - old_len as isize;
        out.extend_from_slice(format!("@@ -{} +{} @@\n", range(os, old_len), range(ns, new_len)).as_bytes());
        for op in &group {
            for change in op.iter_changes(&a, &b) {
                let sign = match change.tag() {
                    similar::ChangeTag::Equal => b' ',
                    similar::ChangeTag::Delete => b'-',
                    similar::ChangeTag::Insert => b'+',
                };
                out.push(sign);
                let line: &[u8] = change.value();
                out.extend_from_slice(line);
                if line.last() != Some(&b'\n') {
                    out.extend_from_slice(b"\n\\ No newline at end of file\n");
                }
            }
        }
    }
    out
}

fn range(start: usize, count: usize) -> String {
    match count {
        0 => format!("{start},0"),
        1 => format!("{}", start + 1),
        n => format!("{},{n}", start + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hunk_headers_follow_git() {
        let out = String::from_utf8(hunks(b"a\nb\nc\n", b"a\nB\nc\n")).expect("utf8");
        assert_eq!(out, "@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n");
        let out = String::from_utf8(hunks(b"", b"x\n")).expect("utf8");
        assert_eq!(out, "@@ -0,0 +1 @@\n+x\n");
        let out = String::from_utf8(hunks(b"x", b"y")).expect("utf8");
        assert_eq!(out, "@@ -1 +1 @@\n-x\n\\ No newline at end of file\n+y\n\\ No newline at end of file\n");
    }
}
