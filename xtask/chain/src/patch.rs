//! Git-style unified diffs: the data model and a byte-exact parser.
//!
//! The parser keeps every byte of every line (a CRLF line keeps its `\r`), understands the
//! extended headers git writes (modes, creation, deletion, renames, copies, full index lines),
//! C-quoted paths, `\ No newline at end of file`, and `GIT binary patch` literals.
//! It never guesses: anything it does not understand is a [`ParseError`] with a line number.

use crate::base85;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Line {
    Context(Vec<u8>),
    Remove(Vec<u8>),
    Add(Vec<u8>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hunk {
    pub old_start: usize,
    pub old_count: usize,
    pub new_start: usize,
    pub new_count: usize,
    pub lines: Vec<Line>,
    /// 1-based line of the `@@` header in the patch file.
    pub patch_line: usize,
}

impl Hunk {
    /// The lines the hunk expects before it applies (`reverse`: after).
    pub fn preimage(&self, reverse: bool) -> Vec<&[u8]> {
        self.lines
            .iter()
            .filter_map(|l| match (l, reverse) {
                (Line::Context(b), _) | (Line::Remove(b), false) | (Line::Add(b), true) => Some(b.as_slice()),
                _ => None,
            })
            .collect()
    }

    pub fn postimage(&self, reverse: bool) -> Vec<&[u8]> {
        self.preimage(!reverse)
    }

    /// Context lines before the first change.
    pub fn leading_context(&self) -> usize {
        self.lines.iter().take_while(|l| matches!(l, Line::Context(_))).count()
    }

    /// Context lines after the last change.
    pub fn trailing_context(&self) -> usize {
        self.lines.iter().rev().take_while(|l| matches!(l, Line::Context(_))).count()
    }

    /// Whether the hunk must end at the end of the file. A diff writes fewer trailing than leading
    /// context lines only when it runs into the end of the file, so such a hunk (and one with no
    /// trailing context at all) is anchored there, as git apply (`match_end`) and GNU patch do.
    /// The same holds in both directions: the context lines are shared.
    pub fn anchored_at_end(&self) -> bool {
        let trailing = self.trailing_context();
        trailing == 0 || trailing < self.leading_context()
    }

    /// (start, count) on the side the hunk is matched against.
    pub fn pre_range(&self, reverse: bool) -> (usize, usize) {
        if reverse {
            (self.new_start, self.new_count)
        } else {
            (self.old_start, self.old_count)
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BinaryHunk {
    Literal(Vec<u8>),
    /// A git delta against the preimage (inflated; see [`crate::delta`]).
    Delta(Vec<u8>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Content {
    /// No content change (pure rename, mode change, empty file creation).
    None,
    Text(Vec<Hunk>),
    Binary {
        forward: BinaryHunk,
        reverse: Option<BinaryHunk>,
    },
    /// `Binary files a/x and b/x differ`: git wrote no data, nothing can apply it.
    BinaryWithoutData,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Modify,
    Create,
    Delete,
    Rename,
    Copy,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FilePatch {
    pub op: Op,
    /// Path before (`None` for a created file).
    pub old_path: Option<String>,
    /// Path after (`None` for a deleted file).
    pub new_path: Option<String>,
    pub old_mode: Option<u32>,
    pub new_mode: Option<u32>,
    /// Full or abbreviated blob ids from the `index` line.
    pub old_id: Option<String>,
    pub new_id: Option<String>,
    pub content: Content,
    /// 1-based line of `diff --git` in the patch file.
    pub patch_line: usize,
}

impl FilePatch {
    /// The path this section is known by in messages.
    pub fn display_path(&self) -> &str {
        self.new_path.as_deref().or(self.old_path.as_deref()).expect("a file patch names at least one path")
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PatchSet {
    /// Everything before the first `diff --git` (subject, body, trailers), byte for byte.
    pub header: Vec<u8>,
    pub files: Vec<FilePatch>,
}

impl PatchSet {
    /// `Key: value` trailers from the header, in order.
    pub fn trailers(&self) -> Vec<(String, String)> {
        let text = String::from_utf8_lossy(&self.header);
        text.lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(": ")?;
                let ok = !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') && k.chars().next().is_some_and(|c| c.is_ascii_uppercase());
                ok.then(|| (k.to_owned(), v.trim().to_owned()))
            })
            .collect()
    }

    pub fn subject(&self) -> Option<String> {
        self.trailers().into_iter().find(|(k, _)| k == "Subject").map(|(_, v)| v)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("line {line}: {kind}")]
pub struct ParseError {
    pub line: usize,
    pub kind: ParseErrorKind,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseErrorKind {
    #[error("cannot parse the `diff --git` line: {0:?}")]
    BadDiffGitLine(String),
    #[error("malformed hunk header {0:?}")]
    BadHunkHeader(String),
    #[error("hunk header {0:?} names lines past the largest line number")]
    HunkOutOfRange(String),
    #[error("hunk body ends early: header promised {old} old and {new} new lines")]
    ShortHunk { old: usize, new: usize },
    #[error("unexpected line inside a hunk: {0:?}")]
    BadHunkLine(String),
    #[error("malformed mode {0:?}")]
    BadMode(String),
    #[error("bad quoted path {0:?}")]
    BadQuotedPath(String),
    #[error("path is not UTF-8: {0:?}")]
    NonUtf8Path(String),
    #[error("path {0:?} is absolute or leaves the tree")]
    UnsafePath(String),
    #[error("malformed binary patch: {0}")]
    BadBinary(String),
    #[error("`---`/`+++` lines disagree with the `diff --git` line ({0:?})")]
    PathMismatch(String),
    #[error("hunks of a file that is created, deleted or binary do not fit: {0}")]
    Inconsistent(String),
    #[error("the `index` line's object id {0:?} is not 4 to 64 hexadecimal digits")]
    BadObjectId(String),
}

/// git's object ids on an `index` line: abbreviated (at least 4) or full hex, SHA-1 or SHA-256.
fn object_id(id: &str, line: usize) -> Result<String, ParseError> {
    if (4..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(id.to_ascii_lowercase())
    } else {
        Err(perr(line, ParseErrorKind::BadObjectId(id.to_owned())))
    }
}

fn perr(line: usize, kind: ParseErrorKind) -> ParseError {
    ParseError { line, kind }
}

/// Splits into lines, each keeping its `\n` (the last one may lack it).
pub fn split_lines(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, b) in data.iter().enumerate() {
        if *b == b'\n' {
            out.push(&data[start..=i]);
            start = i + 1;
        }
    }
    if start < data.len() {
        out.push(&data[start..]);
    }
    out
}

fn strip_eol(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\n").unwrap_or(line)
}

pub fn parse(data: &[u8]) -> Result<PatchSet, ParseError> {
    let lines = split_lines(data);
    let mut i = 0;
    let mut header = Vec::new();
    while i < lines.len() && !lines[i].starts_with(b"diff --git ") {
        header.extend_from_slice(lines[i]);
        i += 1;
    }
    let mut files = Vec::new();
    while i < lines.len() {
        let (fp, next) = parse_file(&lines, i)?;
        files.push(fp);
        i = next;
    }
    Ok(PatchSet { header, files })
}

fn text(line: &[u8]) -> String {
    String::from_utf8_lossy(strip_eol(line)).into_owned()
}

fn parse_mode(s: &str, line: usize) -> Result<u32, ParseError> {
    let m = u32::from_str_radix(s.trim(), 8).map_err(|_| perr(line, ParseErrorKind::BadMode(s.to_owned())))?;
    match m {
        0o100644 | 0o100755 => Ok(m),
        0o100664 => Ok(0o100644),
        _ => Err(perr(line, ParseErrorKind::BadMode(s.to_owned()))),
    }
}

fn parse_file(lines: &[&[u8]], start: usize) -> Result<(FilePatch, usize), ParseError> {
    let lno = start + 1;
    let first = strip_eol(lines[start]);
    let (a, b) = parse_diff_git_names(&first[b"diff --git ".len()..]).map_err(|k| perr(lno, k))?;
    let mut fp =
        FilePatch { op: Op::Modify, old_path: Some(a.clone()), new_path: Some(b.clone()), old_mode: None, new_mode: None, old_id: None, new_id: None, content: Content::None, patch_line: lno };
    let mut i = start + 1;
    let mut minus: Option<Option<String>> = None;
    let mut plus: Option<Option<String>> = None;
    // Extended headers.
    while i < lines.len() {
        let l = strip_eol(lines[i]);
        let ln = i + 1;
        let s = String::from_utf8_lossy(l);
        if let Some(m) = s.strip_prefix("old mode ") {
            fp.old_mode = Some(parse_mode(m, ln)?);
        } else if let Some(m) = s.strip_prefix("new mode ") {
            fp.new_mode = Some(parse_mode(m, ln)?);
        } else if let Some(m) = s.strip_prefix("deleted file mode ") {
            fp.op = Op::Delete;
            fp.old_mode = Some(parse_mode(m, ln)?);
        } else if let Some(m) = s.strip_prefix("new file mode ") {
            fp.op = Op::Create;
            fp.new_mode = Some(parse_mode(m, ln)?);
        } else if l.starts_with(b"rename from ") {
            fp.op = Op::Rename;
            fp.old_path = Some(parse_path(&l[12..]).map_err(|k| perr(ln, k))?);
        } else if l.starts_with(b"rename to ") {
            fp.op = Op::Rename;
            fp.new_path = Some(parse_path(&l[10..]).map_err(|k| perr(ln, k))?);
        } else if l.starts_with(b"copy from ") {
            fp.op = Op::Copy;
            fp.old_path = Some(parse_path(&l[10..]).map_err(|k| perr(ln, k))?);
        } else if l.starts_with(b"copy to ") {
            fp.op = Op::Copy;
            fp.new_path = Some(parse_path(&l[8..]).map_err(|k| perr(ln, k))?);
        } else if s.starts_with("similarity index ") || s.starts_with("dissimilarity index ") {
        } else if let Some(rest) = s.strip_prefix("index ") {
            let ids = rest.split(' ').next().unwrap_or("");
            let (o, n) = ids.split_once("..").ok_or_else(|| perr(ln, ParseErrorKind::BadDiffGitLine(s.to_string())))?;
            fp.old_id = Some(object_id(o, ln)?);
            fp.new_id = Some(object_id(n, ln)?);
            if let Some(mode) = rest.split(' ').nth(1) {
                let m = parse_mode(mode, ln)?;
                fp.old_mode.get_or_insert(m);
                fp.new_mode.get_or_insert(m);
            }
        } else if l.starts_with(b"--- ") {
            minus = Some(parse_side(&l[4..], b"a/").map_err(|k| perr(ln, k))?);
        } else if l.starts_with(b"+++ ") {
            plus = Some(parse_side(&l[4..], b"b/").map_err(|k| perr(ln, k))?);
            i += 1;
            break;
        } else if l == b"GIT binary patch" || l.starts_with(b"Binary files ") || l.starts_with(b"diff --git ") || l.starts_with(b"@@ ") {
            break;
        } else {
            return Err(perr(ln, ParseErrorKind::BadDiffGitLine(s.to_string())));
        }
        i += 1;
    }
    // The side a creation or deletion does not have is git's null id (all zeros).
    let null = |id: &Option<String>| id.as_ref().is_none_or(|id| id.bytes().all(|b| b == b'0'));
    if (fp.op == Op::Create && !null(&fp.old_id)) || (fp.op == Op::Delete && !null(&fp.new_id)) {
        return Err(perr(lno, ParseErrorKind::Inconsistent("the `index` line of a created or deleted file must have the null id on its missing side".into())));
    }
    match fp.op {
        Op::Create => fp.old_path = None,
        Op::Delete => fp.new_path = None,
        // A mode change names both modes (git writes `old mode` and `new mode`): with one
        // alone, reverse-applying it could not restore the mode it replaced.
        _ if fp.old_mode.is_some() != fp.new_mode.is_some() => {
            return Err(perr(lno, ParseErrorKind::Inconsistent("a mode change needs both `old mode` and `new mode`".into())));
        }
        _ => {}
    }
    if let Some(m) = minus {
        if m != fp.old_path {
            return Err(perr(lno, ParseErrorKind::PathMismatch(format!("--- {m:?} vs {:?}", fp.old_path))));
        }
    }
    if let Some(p) = plus {
        if p != fp.new_path {
            return Err(perr(lno, ParseErrorKind::PathMismatch(format!("+++ {p:?} vs {:?}", fp.new_path))));
        }
    }
    // Content.
    if i < lines.len() && strip_eol(lines[i]) == b"GIT binary patch" {
        let (forward, next) = parse_binary_hunk(lines, i + 1)?;
        i = next;
        let mut reverse = None;
        if i < lines.len() && (lines[i].starts_with(b"literal ") || lines[i].starts_with(b"delta ")) {
            let (r, next) = parse_binary_hunk(lines, i)?;
            reverse = Some(r);
            i = next;
        }
        fp.content = Content::Binary { forward, reverse };
    } else if i < lines.len() && lines[i].starts_with(b"Binary files ") {
        fp.content = Content::BinaryWithoutData;
        i += 1;
    } else {
        let mut hunks = Vec::new();
        while i < lines.len() && lines[i].starts_with(b"@@ ") {
            let (h, next) = parse_hunk(lines, i)?;
            hunks.push(h);
            i = next;
        }
        if !hunks.is_empty() {
            fp.content = Content::Text(hunks);
        }
    }
    if i < lines.len() && !lines[i].starts_with(b"diff --git ") {
        // Trailing text after the last file (for example a `-- ` signature) is allowed only at the end.
        let rest_is_signature = lines[i..].iter().all(|l| !l.starts_with(b"diff --git "));
        if !rest_is_signature {
            return Err(perr(i + 1, ParseErrorKind::BadHunkLine(text(lines[i]))));
        }
        i = lines.len();
    }
    check_consistency(&fp)?;
    Ok((fp, i))
}

fn check_consistency(fp: &FilePatch) -> Result<(), ParseError> {
    let bad = |msg: &str| Err(perr(fp.patch_line, ParseErrorKind::Inconsistent(format!("{}: {msg}", fp.display_path()))));
    // git writes two names only with `rename`/`copy` headers (git apply refuses the rest: "lacks
    // filename information"); taken as a modification, it would create the second path and keep
    // the first, which does not reverse.
    if fp.op == Op::Modify && fp.old_path != fp.new_path {
        return bad("a modified file names two different paths without rename or copy headers");
    }
    if let Content::Text(hunks) = &fp.content {
        match fp.op {
            Op::Create if hunks.len() != 1 || hunks[0].old_count != 0 => return bad("a created file needs exactly one hunk from -0,0"),
            Op::Delete if hunks.len() != 1 || hunks[0].new_count != 0 => return bad("a deleted file needs exactly one hunk to +0,0"),
            _ => {}
        }
        let mut last_end = 0;
        // Lines added minus lines removed by the hunks before: each hunk's new position must be
        // its old one shifted by that, as every diff writes it. Forward placement reads the old
        // positions, reverse the new ones, so a patch whose headers disagree could apply and then
        // not reverse.
        let mut delta: i128 = 0;
        for h in hunks {
            if h.old_start < last_end {
                return bad("hunks overlap or are out of order");
            }
            // parse_hunk refuses ranges that overflow; hunks built in code may not have been through it.
            let Some(end) = h.old_start.checked_add(h.old_count) else { return bad("a hunk's range overflows") };
            last_end = end;
            let at = |start: usize, count: usize| if count == 0 { start as i128 } else { start as i128 - 1 };
            if at(h.new_start, h.new_count) != at(h.old_start, h.old_count) + delta {
                return bad("a hunk's new position disagrees with its old position and the hunks before it");
            }
            delta += h.new_count as i128 - h.old_count as i128;
        }
    }
    Ok(())
}

fn parse_hunk(lines: &[&[u8]], start: usize) -> Result<(Hunk, usize), ParseError> {
    let ln = start + 1;
    let head = text(lines[start]);
    let bad = || perr(ln, ParseErrorKind::BadHunkHeader(head.clone()));
    let inner = head.strip_prefix("@@ -").and_then(|r| r.split_once(" @@")).map(|(r, _)| r).ok_or_else(bad)?;
    let (old, new) = inner.split_once(" +").ok_or_else(bad)?;
    let range = |r: &str| -> Option<(usize, usize)> {
        match r.split_once(',') {
            Some((s, c)) => Some((s.parse().ok()?, c.parse().ok()?)),
            None => Some((r.parse().ok()?, 1)),
        }
    };
    let (old_start, old_count) = range(old).ok_or_else(bad)?;
    let (new_start, new_count) = range(new).ok_or_else(bad)?;
    // The placer computes the range's end; one that does not fit is refused here, by line.
    if old_start.checked_add(old_count).is_none() || new_start.checked_add(new_count).is_none() {
        return Err(perr(ln, ParseErrorKind::HunkOutOfRange(head.clone())));
    }
    let mut h = Hunk { old_start, old_count, new_start, new_count, lines: Vec::new(), patch_line: ln };
    let (mut o, mut n) = (0, 0);
    let mut i = start + 1;
    while o < old_count || n < new_count {
        let Some(l) = lines.get(i) else {
            return Err(perr(ln, ParseErrorKind::ShortHunk { old: old_count, new: new_count }));
        };
        match l.first() {
            Some(b' ') => {
                h.lines.push(Line::Context(l[1..].to_vec()));
                o += 1;
                n += 1;
            }
            // Some tools strip the space of an empty context line.
            Some(b'\n') => {
                h.lines.push(Line::Context(b"\n".to_vec()));
                o += 1;
                n += 1;
            }
            Some(b'-') => {
                h.lines.push(Line::Remove(l[1..].to_vec()));
                o += 1;
            }
            Some(b'+') => {
                h.lines.push(Line::Add(l[1..].to_vec()));
                n += 1;
            }
            Some(b'\\') => strip_last_newline(&mut h),
            _ => return Err(perr(i + 1, ParseErrorKind::BadHunkLine(text(l)))),
        }
        if o > old_count || n > new_count {
            return Err(perr(ln, ParseErrorKind::ShortHunk { old: old_count, new: new_count }));
        }
        i += 1;
    }
    if lines.get(i).is_some_and(|l| l.starts_with(b"\\")) {
        strip_last_newline(&mut h);
        i += 1;
    }
    // Only the last line of each side may lack its newline (`\ No newline at end of file` can
    // only end a file): anything else would glue two lines together in one direction.
    // An empty line without its newline is no line at all (a `+` at the very end of a file).
    if h.lines.iter().any(|l| matches!(l, Line::Context(b) | Line::Remove(b) | Line::Add(b) if b.is_empty())) {
        return Err(perr(ln, ParseErrorKind::BadHunkLine("a hunk line with neither content nor a newline".into())));
    }
    for reverse in [false, true] {
        let side = h.preimage(reverse);
        if side.iter().rev().skip(1).any(|l| l.last() != Some(&b'\n')) {
            return Err(perr(ln, ParseErrorKind::BadHunkLine("`\\ No newline at end of file` after a line that is not the last of its side".into())));
        }
    }
    Ok((h, i))
}

/// `\ No newline at end of file`: the line before it has no terminator in the file.
fn strip_last_newline(h: &mut Hunk) {
    if let Some(Line::Context(b) | Line::Remove(b) | Line::Add(b)) = h.lines.last_mut() {
        if b.last() == Some(&b'\n') {
            b.pop();
        }
    }
}

fn parse_binary_hunk(lines: &[&[u8]], start: usize) -> Result<(BinaryHunk, usize), ParseError> {
    let ln = start + 1;
    let head = lines.get(start).map(|l| text(l)).unwrap_or_default();
    let bad = |msg: String| perr(ln, ParseErrorKind::BadBinary(msg));
    let (kind, size) = head.split_once(' ').ok_or_else(|| bad(format!("expected `literal N` or `delta N`, found {head:?}")))?;
    let size: usize = size.parse().map_err(|_| bad(format!("bad size in {head:?}")))?;
    let mut i = start + 1;
    let mut compressed = Vec::new();
    while i < lines.len() && !strip_eol(lines[i]).is_empty() {
        let l = strip_eol(lines[i]);
        let decoded = base85::decode_line(l).map_err(|e| perr(i + 1, ParseErrorKind::BadBinary(e)))?;
        compressed.extend_from_slice(&decoded);
        i += 1;
    }
    if i < lines.len() {
        i += 1; // the blank line that ends the hunk
    }
    if kind != "literal" && kind != "delta" {
        return Err(bad(format!("unknown binary hunk kind {kind:?}")));
    }
    // Both kinds give the inflated size. Reading one byte past it catches a longer stream without
    // inflating all of it, and the stated size is never trusted for an allocation.
    use std::io::Read;
    let mut data = Vec::new();
    let limit = u64::try_from(size).unwrap_or(u64::MAX).saturating_add(1);
    flate2::read::ZlibDecoder::new(&compressed[..]).take(limit).read_to_end(&mut data).map_err(|e| bad(format!("zlib: {e}")))?;
    if data.len() != size {
        let got = if data.len() > size { "more".to_owned() } else { data.len().to_string() };
        return Err(bad(format!("{kind} says {size} bytes, inflates to {got}")));
    }
    let hunk = if kind == "literal" { BinaryHunk::Literal(data) } else { BinaryHunk::Delta(data) };
    Ok((hunk, i))
}

/// `a/x b/x`, possibly quoted, possibly with spaces (then both halves must be equal).
fn parse_diff_git_names(rest: &[u8]) -> Result<(String, String), ParseErrorKind> {
    let whole = String::from_utf8_lossy(rest).into_owned();
    let bad = || ParseErrorKind::BadDiffGitLine(whole.clone());
    let (a, remainder) = if rest.first() == Some(&b'"') {
        let (p, used) = unquote(rest)?;
        (p, &rest[used..])
    } else if rest.ends_with(b"\"") {
        let q = rest.iter().position(|&c| c == b'"').ok_or_else(bad)?;
        (rest[..q].strip_suffix(b" ").ok_or_else(bad)?.to_vec(), &rest[q - 1..])
    } else {
        // Unquoted names may hold spaces: prefer the split into two equal names (what git
        // writes unless the file is renamed), else the only ` b/` in the line.
        let mid = rest.len() / 2;
        if rest.len() % 2 == 1 && rest[mid] == b' ' && rest[..mid].get(2..) == rest[mid + 1..].get(2..) {
            (rest[..mid].to_vec(), &rest[mid..])
        } else {
            let splits: Vec<usize> = rest.windows(3).enumerate().filter(|(_, w)| *w == b" b/").map(|(i, _)| i).collect();
            match splits[..] {
                [at] => (rest[..at].to_vec(), &rest[at..]),
                _ => return Err(bad()),
            }
        }
    };
    let b_raw = remainder.strip_prefix(b" ").ok_or_else(bad)?;
    let b = if b_raw.first() == Some(&b'"') { unquote(b_raw)?.0 } else { b_raw.to_vec() };
    let a = a.strip_prefix(b"a/").ok_or_else(bad)?;
    let b = b.strip_prefix(b"b/").ok_or_else(bad)?;
    Ok((checked_path(a)?, checked_path(b)?))
}

fn parse_side(raw: &[u8], prefix: &[u8]) -> Result<Option<String>, ParseErrorKind> {
    // git appends a tab after names that contain spaces; GNU diff a tab and a timestamp.
    let raw = match raw.iter().position(|&c| c == b'\t') {
        Some(t) if raw.first() != Some(&b'"') => &raw[..t],
        _ => raw,
    };
    if raw == b"/dev/null" {
        return Ok(None);
    }
    let p = if raw.first() == Some(&b'"') { unquote(raw)?.0 } else { raw.to_vec() };
    let p = p.strip_prefix(prefix).ok_or_else(|| ParseErrorKind::PathMismatch(String::from_utf8_lossy(raw).into_owned()))?;
    Ok(Some(checked_path(p)?))
}

fn parse_path(raw: &[u8]) -> Result<String, ParseErrorKind> {
    let p = if raw.first() == Some(&b'"') { unquote(raw)?.0 } else { raw.to_vec() };
    checked_path(&p)
}

fn checked_path(p: &[u8]) -> Result<String, ParseErrorKind> {
    let s = String::from_utf8(p.to_vec()).map_err(|_| ParseErrorKind::NonUtf8Path(String::from_utf8_lossy(p).into_owned()))?;
    if s.is_empty() || s.starts_with('/') || s.split('/').any(|c| c == ".." || c == "." || c.is_empty()) {
        return Err(ParseErrorKind::UnsafePath(s));
    }
    Ok(s)
}

/// Parses a C-quoted string starting at `raw[0] == '"'`; returns the bytes and how many input bytes it used.
pub fn unquote(raw: &[u8]) -> Result<(Vec<u8>, usize), ParseErrorKind> {
    let bad = || ParseErrorKind::BadQuotedPath(String::from_utf8_lossy(raw).into_owned());
    let mut out = Vec::new();
    let mut i = 1;
    while i < raw.len() {
        match raw[i] {
            b'"' => return Ok((out, i + 1)),
            b'\\' => {
                let c = *raw.get(i + 1).ok_or_else(bad)?;
                i += 2;
                match c {
                    b'n' => out.push(b'\n'),
                    b't' => out.push(b'\t'),
                    b'r' => out.push(b'\r'),
                    b'a' => out.push(7),
                    b'b' => out.push(8),
                    b'f' => out.push(12),
                    b'v' => out.push(11),
                    b'"' | b'\\' => out.push(c),
                    b'0'..=b'3' => {
                        let oct = raw.get(i - 1..i + 2).ok_or_else(bad)?;
                        let v = std::str::from_utf8(oct).ok().and_then(|s| u8::from_str_radix(s, 8).ok()).ok_or_else(bad)?;
                        out.push(v);
                        i += 2;
                    }
                    _ => return Err(bad()),
                }
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Err(bad())
}

/// Quotes a path the way git does (`core.quotePath=true`): only when it needs to.
pub fn quote_path(prefix: &str, path: &str) -> String {
    let full = format!("{prefix}{path}");
    let needs = full.bytes().any(|b| !(0x20..0x7f).contains(&b) || b == b'"' || b == b'\\');
    if !needs {
        return full;
    }
    let mut out = String::from("\"");
    for b in full.bytes() {
        match b {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\t' => out.push_str("\\t"),
            b'\r' => out.push_str("\\r"),
            0x20..=0x7e => out.push(b as char),
            _ => out.push_str(&format!("\\{b:03o}")),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(patch: &str, expect: &str) {
        let got = match parse(patch.as_bytes()) {
            Ok(ps) => ps
                .files
                .iter()
                .map(|f| {
                    let content = match &f.content {
                        Content::None => "none".to_string(),
                        Content::Text(h) => format!("{} hunks, {} lines", h.len(), h.iter().map(|h| h.lines.len()).sum::<usize>()),
                        Content::Binary { .. } => "binary".into(),
                        Content::BinaryWithoutData => "binary-without-data".into(),
                    };
                    format!("{:?} {:?} -> {:?} modes {:?}/{:?}: {content}", f.op, f.old_path, f.new_path, f.old_mode.map(|m| format!("{m:o}")), f.new_mode.map(|m| format!("{m:o}")))
                })
                .collect::<Vec<_>>()
                .join("\n"),
            Err(e) => format!("error: {e}"),
        };
        assert_eq!(got.trim(), expect.trim(), "\n--- got ---\n{got}");
    }

    #[test]
    fn parses_a_modification() {
        check(
            "Subject: x\n\ndiff --git a/f.rs b/f.rs\nindex 1111111..2222222 100644\n--- a/f.rs\n+++ b/f.rs\n@@ -1,2 +1,3 @@\n a\n+b\n c\n",
            r#"Modify Some("f.rs") -> Some("f.rs") modes Some("100644")/Some("100644"): 1 hunks, 3 lines"#,
        );
    }

    #[test]
    fn parses_create_delete_rename_mode() {
        check(
            "diff --git a/n b/n\nnew file mode 100755\nindex 0000000..e69de29\n\
             diff --git a/old b/old\ndeleted file mode 100644\n--- a/old\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n\
             diff --git a/r1 b/r2\nsimilarity index 100%\nrename from r1\nrename to r2\n\
             diff --git a/m b/m\nold mode 100644\nnew mode 100755\n",
            r#"
Create None -> Some("n") modes None/Some("100755"): none
Delete Some("old") -> None modes Some("100644")/None: 1 hunks, 1 lines
Rename Some("r1") -> Some("r2") modes None/None: none
Modify Some("m") -> Some("m") modes Some("100644")/Some("100755"): none
"#,
        );
    }

    #[test]
    fn parses_quoted_non_ascii_paths_and_spaces() {
        check(
            "diff --git \"a/caf\\303\\251.txt\" \"b/caf\\303\\251.txt\"\nnew file mode 100644\n--- /dev/null\n+++ \"b/caf\\303\\251.txt\"\n@@ -0,0 +1 @@\n+x\n\
             diff --git a/with space b/with space\n--- a/with space\t\n+++ b/with space\t\n@@ -1 +1 @@\n-a\n+b\n",
            r#"
Create None -> Some("café.txt") modes None/Some("100644"): 1 hunks, 1 lines
Modify Some("with space") -> Some("with space") modes None/None: 1 hunks, 2 lines
"#,
        );
    }

    #[test]
    fn keeps_crlf_and_missing_final_newline() {
        let ps = parse(b"diff --git a/w b/w\n--- a/w\n+++ b/w\n@@ -1,2 +1,2 @@\n a\r\n-b\r\n\\ No newline at end of file\n+c\r\n\\ No newline at end of file\n").expect("valid");
        let Content::Text(h) = &ps.files[0].content else { panic!("text expected") };
        assert_eq!(h[0].lines, vec![Line::Context(b"a\r\n".to_vec()), Line::Remove(b"b\r".to_vec()), Line::Add(b"c\r".to_vec())]);
    }

    #[test]
    fn rejects_malformed_input_with_line_numbers() {
        check("diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n", "error: line 4: hunk body ends early: header promised 3 old and 3 new lines");
        check("diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -x +1 @@\n", r#"error: line 4: malformed hunk header "@@ -x +1 @@""#);
        check("diff --git a/../etc b/../etc\n", r#"error: line 1: path "../etc" is absolute or leaves the tree"#);
        check("diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n?x\n", r#"error: line 5: unexpected line inside a hunk: "?x""#);
        check("diff --git a/f b/f\nold mode 100777\n", r#"error: line 2: malformed mode "100777""#);
    }

    #[test]
    fn reads_trailers_from_the_header() {
        let ps = parse(b"Subject: [PATCH] kv: truncate\n\nBody.\n\nTine-Hook: kv-truncate\nUpstream-Status: Pending\n---\n").expect("valid");
        assert_eq!(ps.subject().as_deref(), Some("[PATCH] kv: truncate"));
        assert!(ps.trailers().contains(&("Tine-Hook".into(), "kv-truncate".into())));
    }
}
