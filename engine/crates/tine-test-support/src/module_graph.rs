//! Which modules of a crate read which (`crate::<module>` anywhere in a module's files), and
//! whether that graph has a circle: the check behind each crate's
//! `the_crates_modules_import_one_way_without_circles` test. Plain std, so xtask (which builds
//! before the engine) includes this file by `#[path]`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("src/ lists") {
        let p = e.expect("an entry").path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Module -> the modules it reads. A module is a file or directory directly under `src`
/// (`lib.rs` and `main.rs` are the crate root, not modules).
pub fn edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut all = Vec::new();
    files(src, &mut all);
    let module_of = |p: &Path| -> Option<String> {
        let first = p.strip_prefix(src).ok()?.components().next()?.as_os_str().to_string_lossy().into_owned();
        let name = first.trim_end_matches(".rs").to_string();
        (name != "lib" && name != "main").then_some(name)
    };
    let modules: BTreeSet<String> = all.iter().filter_map(|p| module_of(p)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for p in &all {
        let Some(m) = module_of(p) else { continue };
        let text = std::fs::read_to_string(p).expect("a source file reads");
        let reads = graph.entry(m.clone()).or_default();
        for (i, _) in text.match_indices("crate::") {
            let name: String = text[i + 7..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if name != m && modules.contains(&name) {
                reads.insert(name);
            }
        }
    }
    graph
}

/// A circle of modules (`a -> b -> a`), if there is one.
pub fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(m: &str, g: &BTreeMap<String, BTreeSet<String>>, path: &mut Vec<String>, done: &mut BTreeSet<String>) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|x| x == m) {
            let mut c = path[at..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in g.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, g, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

/// Panics naming the circle if the crate at `src` has one; also checks that the checker finds
/// a circle where there is one (two of its modules made to read each other).
pub fn assert_one_way(src: &Path) {
    let g = edges(src);
    assert!(g.len() > 2, "found the modules: {g:?}");
    if let Some(c) = cycle(&g) {
        panic!("an import circle: {}", c.join(" -> "));
    }
    let mut bad = g.clone();
    let (a, b) = (g.keys().next().expect("a module").clone(), g.keys().nth(1).expect("another").clone());
    bad.entry(a.clone()).or_default().insert(b.clone());
    bad.entry(b).or_default().insert(a);
    assert!(cycle(&bad).is_some(), "the checker misses a circle");
}
