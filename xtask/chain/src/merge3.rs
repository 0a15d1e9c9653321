//! Line-based three-way merge (diff3) of byte lines.
//!
//! Both sides are aligned to the common ancestor with a Myers diff; a line that the alignment
//! matches in all three is stable, and the runs between stable lines are the changes. A change
//! made on one side only is taken from that side; the same change on both sides is taken once;
//! different changes to the same (or adjacent) ancestor lines conflict, as in GNU diff3 and git.
//! Lines keep their terminators, so CRLF and a missing final newline survive the merge.

use std::ops::Range;

/// Who changed a run of lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Only ours differs from the ancestor.
    Ours,
    /// Only theirs differs from the ancestor.
    Theirs,
    /// Both made the same change.
    Same,
    /// Both changed it, on different ancestor lines next to each other; `Chunk::both` holds the union.
    Both,
    /// Both changed it, differently.
    Conflict,
}

/// One run of the merge: line ranges in the ancestor, ours and theirs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub base: Range<usize>,
    pub ours: Range<usize>,
    pub theirs: Range<usize>,
    /// `None`: all three agree here.
    pub change: Option<Side>,
    /// For `Side::Both`: the merged lines.
    pub both: Vec<Vec<u8>>,
}

/// The edits that turn `base` into `other`: (ancestor range, replacement lines).
fn edits<'a>(base: &[&'a [u8]], other: &[&'a [u8]]) -> Vec<(Range<usize>, Range<usize>)> {
    similar::capture_diff_slices(similar::Algorithm::Myers, base, other).into_iter().filter(|op| !matches!(op, similar::DiffOp::Equal { .. })).map(|op| (op.old_range(), op.new_range())).collect()
}

/// Two changes to one run of the ancestor that touch different lines merge (git calls the
/// adjacent case a conflict; nothing is ambiguous when neither side inserts at the seam).
fn refine(base: &[&[u8]], ours: &[&[u8]], theirs: &[&[u8]]) -> Option<Vec<Vec<u8>>> {
    let (eo, et) = (edits(base, ours), edits(base, theirs));
    for (a, _) in &eo {
        for (b, _) in &et {
            let clash = if a.is_empty() || b.is_empty() {
                // An insertion touching the other side's edit has no agreed order.
                let (ins, other) = if a.is_empty() { (a, b) } else { (b, a) };
                other.start <= ins.start && ins.start <= other.end
            } else {
                a.start < b.end && b.start < a.end
            };
            if clash {
                return None;
            }
        }
    }
    // (ancestor range, the side's lines, the replacement's range in them)
    type Edit<'e, 'l> = (Range<usize>, &'e [&'l [u8]], Range<usize>);
    let mut all: Vec<Edit<'_, '_>> = eo.into_iter().map(|(r, n)| (r, ours, n)).chain(et.into_iter().map(|(r, n)| (r, theirs, n))).collect();
    all.sort_by_key(|(r, _, _)| (r.start, r.end));
    let mut out = Vec::new();
    let mut at = 0;
    for (r, side, n) in all {
        out.extend(base[at..r.start].iter().map(|l| l.to_vec()));
        out.extend(side[n].iter().map(|l| l.to_vec()));
        at = r.end;
    }
    out.extend(base[at..].iter().map(|l| l.to_vec()));
    Some(out)
}

/// For each ancestor line, the line of `other` it is aligned with.
fn alignment(base: &[&[u8]], other: &[&[u8]]) -> Vec<Option<usize>> {
    let mut m = vec![None; base.len()];
    for op in similar::capture_diff_slices(similar::Algorithm::Myers, base, other) {
        if let similar::DiffOp::Equal { old_index, new_index, len } = op {
            for k in 0..len {
                m[old_index + k] = Some(new_index + k);
            }
        }
    }
    m
}

/// The merge of `ours` and `theirs` against their ancestor `base`, as consecutive chunks that
/// cover all three inputs in order.
pub fn merge(base: &[&[u8]], ours: &[&[u8]], theirs: &[&[u8]]) -> Vec<Chunk> {
    let mo = alignment(base, ours);
    let mt = alignment(base, theirs);
    let (nb, no, nt) = (base.len(), ours.len(), theirs.len());
    let (mut b, mut o, mut t) = (0, 0, 0);
    let mut out = Vec::new();
    loop {
        let (sb, so, st) = (b, o, t);
        while b < nb && mo[b] == Some(o) && mt[b] == Some(t) {
            b += 1;
            o += 1;
            t += 1;
        }
        if b > sb {
            out.push(Chunk { base: sb..b, ours: so..o, theirs: st..t, change: None, both: Vec::new() });
        }
        if b == nb && o == no && t == nt {
            return out;
        }
        // The next ancestor line both sides kept; alignments are monotonic, so it lies ahead of o and t.
        let j = (b..nb).find(|&j| mo[j].is_some() && mt[j].is_some()).unwrap_or(nb);
        let (oe, te) = if j < nb { (mo[j].expect("found"), mt[j].expect("found")) } else { (no, nt) };
        let (bs, os, ts) = (&base[b..j], &ours[o..oe], &theirs[t..te]);
        let side = if os == bs {
            Side::Theirs
        } else if ts == bs {
            Side::Ours
        } else if os == ts {
            Side::Same
        } else {
            Side::Conflict
        };
        let both = if side == Side::Conflict && !bs.is_empty() { refine(bs, os, ts) } else { None };
        let side = if both.is_some() { Side::Both } else { side };
        out.push(Chunk { base: b..j, ours: o..oe, theirs: t..te, change: Some(side), both: both.unwrap_or_default() });
        b = j;
        o = oe;
        t = te;
    }
}

/// How conflicts are written out.
#[derive(Clone, Copy, Debug)]
pub enum Resolve<'a> {
    /// diff3-style markers with these labels: ours, ancestor, theirs.
    Markers { ours: &'a str, base: &'a str, theirs: &'a str },
    /// Take our side (used to keep classifying the rest of a stack past a conflict).
    Ours,
}

pub const MARKER_OURS: &[u8] = b"<<<<<<< ";
pub const MARKER_BASE: &[u8] = b"||||||| ";
pub const MARKER_SEP: &[u8] = b"=======";
pub const MARKER_THEIRS: &[u8] = b">>>>>>> ";

/// The merged bytes.
pub fn render(chunks: &[Chunk], base: &[&[u8]], ours: &[&[u8]], theirs: &[&[u8]], resolve: Resolve<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    let put = |out: &mut Vec<u8>, lines: &[&[u8]]| {
        for l in lines {
            out.extend_from_slice(l);
        }
    };
    // A marker must start its own line even after a last line without a newline.
    let marker = |out: &mut Vec<u8>, m: &[u8], label: &str| {
        if out.last().is_some_and(|b| *b != b'\n') {
            out.push(b'\n');
        }
        out.extend_from_slice(m);
        out.extend_from_slice(label.as_bytes());
        out.push(b'\n');
    };
    for c in chunks {
        match c.change {
            None | Some(Side::Ours) | Some(Side::Same) => put(&mut out, &ours[c.ours.clone()]),
            Some(Side::Theirs) => put(&mut out, &theirs[c.theirs.clone()]),
            Some(Side::Both) => {
                for l in &c.both {
                    out.extend_from_slice(l);
                }
            }
            Some(Side::Conflict) => match resolve {
                Resolve::Ours => put(&mut out, &ours[c.ours.clone()]),
                Resolve::Markers { ours: lo, base: lb, theirs: lt } => {
                    marker(&mut out, MARKER_OURS, lo);
                    put(&mut out, &ours[c.ours.clone()]);
                    marker(&mut out, MARKER_BASE, lb);
                    put(&mut out, &base[c.base.clone()]);
                    marker(&mut out, MARKER_SEP, "");
                    put(&mut out, &theirs[c.theirs.clone()]);
                    marker(&mut out, MARKER_THEIRS, lt);
                }
            },
        }
    }
    out
}

/// 1-based lines of `data` that are conflict markers (`<<<<<<< `, `||||||| `, `=======`, `>>>>>>> `).
/// A `=======` line counts only inside an open `<<<<<<< ` block, so a Markdown heading rule
/// is not mistaken for one.
pub fn marker_lines(data: &[u8]) -> Vec<usize> {
    let mut open = false;
    let mut out = Vec::new();
    for (i, l) in crate::patch::split_lines(data).iter().enumerate() {
        let l = l.strip_suffix(b"\n").unwrap_or(l);
        let l = l.strip_suffix(b"\r").unwrap_or(l);
        let hit = if l.starts_with(MARKER_OURS) {
            open = true;
            true
        } else if l.starts_with(MARKER_THEIRS) {
            open = false;
            true
        } else {
            l.starts_with(MARKER_BASE) || (open && l == MARKER_SEP)
        };
        if hit {
            out.push(i + 1);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::patch::split_lines;

    fn m(base: &str, ours: &str, theirs: &str) -> (String, usize) {
        let (b, o, t) = (split_lines(base.as_bytes()), split_lines(ours.as_bytes()), split_lines(theirs.as_bytes()));
        let chunks = merge(&b, &o, &t);
        let conflicts = chunks.iter().filter(|c| c.change == Some(Side::Conflict)).count();
        let out = render(&chunks, &b, &o, &t, Resolve::Markers { ours: "ours", base: "base", theirs: "theirs" });
        (String::from_utf8(out).expect("utf8"), conflicts)
    }

    #[test]
    fn changes_on_different_lines_merge() {
        assert_eq!(m("a\nb\nc\nd\ne\n", "a\nB\nc\nd\ne\n", "a\nb\nc\nd\nE\n"), ("a\nB\nc\nd\nE\n".into(), 0));
    }

    #[test]
    fn the_same_change_on_both_sides_is_taken_once() {
        assert_eq!(m("a\nb\nc\n", "a\nX\nc\n", "a\nX\nc\n"), ("a\nX\nc\n".into(), 0));
    }

    #[test]
    fn different_changes_to_one_line_conflict_with_diff3_markers() {
        assert_eq!(m("a\nb\nc\n", "a\nO\nc\n", "a\nT\nc\n"), ("a\n<<<<<<< ours\nO\n||||||| base\nb\n=======\nT\n>>>>>>> theirs\nc\n".into(), 1));
    }

    #[test]
    fn changes_to_adjacent_lines_merge_but_an_insertion_at_the_seam_conflicts() {
        assert_eq!(m("a\nb\nc\nd\n", "a\nB\nc\nd\n", "a\nb\nC\nd\n"), ("a\nB\nC\nd\n".into(), 0));
        assert_eq!(m("a\nb\nc\nd\n", "a\nb\nX\nc\nd\n", "a\nb\nC\nd\n").1, 1);
        assert_eq!(m("a\nb\nc\n", "a\nb\nX\nc\n", "a\nb\nY\nc\n").1, 1);
    }

    #[test]
    fn an_insertion_follows_moved_code() {
        // Theirs inserted lines above; ours' insertion lands after the same ancestor line.
        let (out, n) = m("x\ny\nz\n", "x\ny\nNEW\nz\n", "p\nq\nx\ny\nz\n");
        assert_eq!((out.as_str(), n), ("p\nq\nx\ny\nNEW\nz\n", 0));
    }

    #[test]
    fn a_missing_final_newline_survives() {
        assert_eq!(m("a\nb\nc", "A\nb\nc", "a\nb\nC").0, "A\nb\nC");
        let (out, _) = m("a", "b", "c");
        assert_eq!(out, "<<<<<<< ours\nb\n||||||| base\na\n=======\nc\n>>>>>>> theirs\n");
        assert_eq!(marker_lines(out.as_bytes()), vec![1, 3, 5, 7]);
        assert!(marker_lines(b"Title\n=======\ntext\n").is_empty(), "a heading rule is not a marker");
    }
}
