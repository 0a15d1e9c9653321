//! How `rebase --dry-run` and the strict apply scale with the length of the series.
//!
//! A synthetic project: a base of 200 files of 400 lines, a series of N patches (each edits three
//! lines in two files, every fifth also adds a file), and an upstream release that inserts lines
//! at the top of a third of the files and edits lines elsewhere. Prints a Markdown table of
//! medians over `--rounds` runs for each N.
//!
//! `cargo run --release --manifest-path xtask/Cargo.toml -p patchchain --example rebase_scale -- 128 512`

use std::time::Instant;

use patchchain::chain::LoadedPatch;
use patchchain::registry::PatchEntry;
use patchchain::tree::{Entry, Tree};
use patchchain::{apply, export, patch, rebase};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn file(i: usize) -> String {
    (0..400).map(|l| format!("fn f{i}_{l}() {{ body({i}, {l}); }}\n")).collect()
}

fn set_line(text: &str, n: usize, new: &str) -> String {
    text.lines().enumerate().map(|(i, l)| if i == n { format!("{new}\n") } else { format!("{l}\n") }).collect()
}

fn series(n: usize, base: &Tree, rng: &mut Rng) -> Vec<LoadedPatch> {
    let mut t = base.clone();
    let mut out = Vec::new();
    for k in 0..n {
        let before = t.clone();
        for _ in 0..2 {
            let path = format!("src/f{:03}.rs", rng.below(200));
            let mut text = String::from_utf8(t[&path].data.clone()).expect("utf8");
            for _ in 0..3 {
                let line = rng.below(400);
                text = set_line(&text, line, &format!("// patch {k} line {line}"));
            }
            t.insert(path, Entry::file(text));
        }
        if k % 5 == 0 {
            t.insert(format!("src/new_{k}.rs"), Entry::file(format!("// added by patch {k}\n")));
        }
        let bytes = [format!("Subject: [PATCH] patch {k}\n\nUpstream-Status: Pending\n---\n").into_bytes(), export::diff_trees(&before, &t)].concat();
        let parsed = patch::parse(&bytes).expect("exported patches parse");
        let id = format!("{:04}", k + 1);
        let entry = PatchEntry {
            id: id.clone(),
            file: format!("{id}-p.patch"),
            sha256: String::new(),
            title: format!("patch {k}"),
            area: "other".into(),
            hooks: Vec::new(),
            status: "carried".into(),
            upstream: String::new(),
            bump: "reapply".into(),
            gates: vec!["apply".into()],
        };
        out.push(LoadedPatch { entry, bytes, parsed });
    }
    out
}

fn upstream(base: &Tree, rng: &mut Rng) -> Tree {
    let mut t = base.clone();
    for i in 0..200 {
        let path = format!("src/f{i:03}.rs");
        let mut text = String::from_utf8(t[&path].data.clone()).expect("utf8");
        if i % 3 == 0 {
            text = format!("// upstream header\n// of two lines\n{text}");
        }
        if i % 4 == 0 {
            let line = rng.below(400);
            text = set_line(&text, line, "// upstream edit");
        }
        t.insert(path, Entry::file(text));
    }
    t
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let sizes = if args.is_empty() { vec![15, 128, 512] } else { args };
    let rounds = 5;
    let base: Tree = (0..200).map(|i| (format!("src/f{i:03}.rs"), Entry::file(file(i)))).collect();
    println!("| patches | hunks | strict apply of the series (ms) | dry run onto the new base (ms) | verdicts |");
    println!("|---|---|---|---|---|");
    for n in sizes {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ n as u64);
        let patches = series(n, &base, &mut rng);
        let new_base = upstream(&base, &mut rng);
        let hunks: usize = patches.iter().flat_map(|p| &p.parsed.files).map(|f| if let patch::Content::Text(h) = &f.content { h.len() } else { 1 }).sum();
        let (mut ta, mut td) = (Vec::new(), Vec::new());
        let mut report = None;
        for _ in 0..rounds {
            let s = Instant::now();
            let mut t = base.clone();
            for lp in &patches {
                apply::apply(&mut t, &lp.parsed, lp.name()).expect("the synthetic series applies");
            }
            ta.push(s.elapsed().as_secs_f64() * 1e3);
            let s = Instant::now();
            let plan = rebase::plan(&base, &new_base, &patches, "synthetic", "synthetic-next", &rebase::Resolutions::default(), None, false).expect("plan");
            td.push(s.elapsed().as_secs_f64() * 1e3);
            report = Some(plan.report);
        }
        let r = report.expect("ran");
        println!("| {n} | {hunks} | {:.0} | {:.0} | {} |", median(ta), median(td), rebase::summary(&r).split(": ").nth(2).unwrap_or(""));
    }
}
