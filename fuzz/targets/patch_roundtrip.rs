//! Structure-aware: two small trees from `arbitrary`, the exporter's diff between them, parsed
//! back and applied. The export must parse, apply forward to exactly the second tree and
//! reverse-apply to exactly the first (the guarantee `refresh` and `capture` rely on).
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use patchchain::tree::{Entry, Tree, MODE_EXEC, MODE_FILE};
use patchchain::{apply, export, patch};

/// Paths that never collide as file and directory, some needing C quoting.
const PATHS: [&str; 6] = ["a.rs", "src/b.rs", "src/c d.rs", "q\"uote\tx", "dir/\u{e9}t\u{e9}", "dir/sub/e"];
/// Lines to build files from: CRLF, a NUL (binary), trailing whitespace, a lone `\r`.
const LINES: [&[u8]; 8] = [b"a\n", b"b\n", b"fn main() {}\n", b"x\r\n", b"  \n", b"\0bin\n", b"\\ not a marker\n", b"\r"];

#[derive(Arbitrary, Debug)]
struct File {
    path: u8,
    exec: bool,
    lines: Vec<u8>,
    /// Drop the final newline.
    chop: bool,
    /// Raw bytes appended (binary data, invalid UTF-8).
    raw: Vec<u8>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    old: Vec<File>,
    new: Vec<File>,
}

fn tree(files: &[File]) -> Tree {
    let mut t = Tree::new();
    for f in files.iter().take(8) {
        let mut data: Vec<u8> = f.lines.iter().take(64).flat_map(|&l| LINES[l as usize % LINES.len()].iter().copied()).collect();
        if f.chop && data.last() == Some(&b'\n') {
            data.pop();
        }
        data.extend(f.raw.iter().take(64));
        let mode = if f.exec { MODE_EXEC } else { MODE_FILE };
        t.insert(PATHS[f.path as usize % PATHS.len()].to_owned(), Entry { mode, data });
    }
    t
}

fn applied(base: &Tree, ps: &patch::PatchSet, reverse: bool) -> Tree {
    let overlay = apply::plan(base, ps, reverse).unwrap_or_else(|e| panic!("the export does not apply (reverse: {reverse}): {e}"));
    let mut t = base.clone();
    for (path, e) in overlay {
        match e {
            Some(e) => t.insert(path, e),
            None => t.remove(&path),
        };
    }
    t
}

fuzz_target!(|input: Input| {
    let (old, new) = (tree(&input.old), tree(&input.new));
    let bytes = export::diff_trees(&old, &new);
    if old == new {
        assert!(bytes.is_empty(), "equal trees export a non-empty diff");
        return;
    }
    let ps = patch::parse(&bytes).unwrap_or_else(|e| panic!("the export does not parse: {e}\n{}", String::from_utf8_lossy(&bytes)));
    assert!(applied(&old, &ps, false) == new, "the export applied forward is not the new tree");
    assert!(applied(&new, &ps, true) == old, "the export reverse-applied is not the old tree");
    assert_eq!(export::diff_trees(&old, &new), bytes, "the export is not deterministic");
});
