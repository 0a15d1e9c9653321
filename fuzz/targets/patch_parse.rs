//! `patchchain::patch::parse` on any bytes, then the strict placer both ways.
//!
//! Never a panic; and the placer's round trip: a patch that applies forward to a tree must
//! reverse-apply on the result and give back the tree it started from, byte for byte and mode for
//! mode (the guarantee `unapply` and `verify`'s step 4 rest on). The exception is what the format
//! itself cannot reverse: a binary hunk without its reverse literal.
#![no_main]

use libfuzzer_sys::fuzz_target;
use patchchain::apply;
use patchchain::patch::{self, Content, PatchSet};
use patchchain::tree::{Entry, Tree, MODE_FILE};

/// The most filler lines a synthesized preimage may need (a hunk at line 10^9 is not worth it).
const MAX_FILLER: usize = 4096;

/// Every path the patch reads, holding `a\nb\nc\n`.
fn constant_tree(ps: &PatchSet) -> Tree {
    let mut tree = Tree::new();
    for f in &ps.files {
        if let Some(p) = &f.old_path {
            tree.insert(p.clone(), Entry { mode: f.old_mode.unwrap_or(MODE_FILE), data: b"a\nb\nc\n".to_vec() });
        }
    }
    tree
}

/// Every path the patch reads, holding the file its hunks expect: filler lines up to each hunk's
/// stated position, then its preimage. So the forward placement usually succeeds, and the
/// interesting part (the reverse) runs.
fn preimage_tree(ps: &PatchSet) -> Option<Tree> {
    let mut tree = Tree::new();
    for f in &ps.files {
        let Some(p) = &f.old_path else { continue };
        if tree.contains_key(p) {
            continue;
        }
        let mut data = Vec::new();
        if let Content::Text(hunks) = &f.content {
            let mut at = 0usize;
            for h in hunks {
                let idx = if h.old_count == 0 { h.old_start } else { h.old_start.saturating_sub(1) };
                if idx < at || idx - at > MAX_FILLER {
                    return None;
                }
                for n in at..idx {
                    data.extend_from_slice(format!("filler {n}\n").as_bytes());
                }
                let pre = h.preimage(false);
                for l in &pre {
                    data.extend_from_slice(l);
                }
                at = idx + pre.len();
            }
        }
        tree.insert(p.clone(), Entry { mode: f.old_mode.unwrap_or(MODE_FILE), data });
    }
    Some(tree)
}

fn reversible(ps: &PatchSet) -> bool {
    ps.files.iter().all(|f| !matches!(f.content, Content::Binary { reverse: None, .. }))
}

/// Whether `tree` could exist on disk: no path is also a directory of another (`p` and `p/q`).
fn is_real_tree(tree: &Tree) -> bool {
    let keys: Vec<&String> = tree.keys().collect();
    keys.windows(2).all(|w| !w[1].starts_with(&format!("{}/", w[0]))) && keys.iter().all(|k| !keys.iter().any(|o| o.starts_with(&format!("{k}/"))))
}

fn check(tree: &Tree, ps: &PatchSet) {
    let _ = apply::plan(tree, ps, true);
    if !is_real_tree(tree) {
        // A tree no filesystem holds: placing must not panic, the round trip is not defined.
        let _ = apply::plan(tree, ps, false);
        return;
    }
    let Ok(overlay) = apply::plan(tree, ps, false) else { return };
    let mut after = tree.clone();
    for (path, e) in overlay {
        match e {
            Some(e) => after.insert(path, e),
            None => after.remove(&path),
        };
    }
    if !reversible(ps) {
        let _ = apply::plan(&after, ps, true);
        return;
    }
    let back = apply::plan(&after, ps, true).unwrap_or_else(|e| panic!("applied forward but does not reverse-apply on the result: {e}"));
    let mut restored = after;
    for (path, e) in back {
        match e {
            Some(e) => restored.insert(path, e),
            None => restored.remove(&path),
        };
    }
    assert!(restored == *tree, "forward then reverse does not give back the original tree");
}

fuzz_target!(|data: &[u8]| {
    let Ok(ps) = patch::parse(data) else { return };
    let _ = ps.subject();
    let _ = ps.trailers();
    check(&constant_tree(&ps), &ps);
    if let Some(t) = preimage_tree(&ps) {
        check(&t, &ps);
    }
});
