//! The patch parser must never panic, and what it accepts the placer must handle without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use patchchain::tree::{Entry, Tree};

fuzz_target!(|data: &[u8]| {
    let Ok(ps) = patchchain::patch::parse(data) else { return };
    // Place it on a small tree holding every path it names, in both directions.
    let mut tree = Tree::new();
    for f in &ps.files {
        if let Some(p) = &f.old_path {
            tree.insert(p.clone(), Entry::file(&b"a\nb\nc\n"[..]));
        }
    }
    let _ = patchchain::apply::plan(&tree, &ps, false);
    let _ = patchchain::apply::plan(&tree, &ps, true);
});
