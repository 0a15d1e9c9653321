//! Crash safety of every writing command, through the real `xtask` binary.
//!
//! 1. A table of (command, crash points): each command runs once with `TINE_CRASH_TRACE` to
//!    list the points it passes (the list must equal the table), then once per point and
//!    occurrence with `TINE_CRASH_AT=<point>:<n>` (the process aborts there, as kill -9 would).
//!    Afterwards the project is byte for byte the old state or the new one, or an interrupted
//!    change that `status`, `verify` and `sync-check` name and one command finishes; `status` and
//!    `verify` say exactly what they say for that state when nothing crashed; a maintainer's
//!    edits being recorded are in the tree or in the patch; running the command again completes.
//! 2. Random kill -9 (seeded) of `apply-chain` / `unapply` on a large tree: old or new, never mixed.
//! 3. Paths that escape the tree (`../`, absolute, through a symlink, in a backup, in the
//!    registry, in a capture name) are refused before anything is written.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use patchchain::commands::{self, CaptureOptions};
use patchchain::tree::{self, MODE_FILE};
use patchchain::Project;
use xtask::Tine;

mod support;
use support::*;

struct Fx {
    dir: tempfile::TempDir,
    p: Project,
}

/// Every file of a project with its mode, without the leftovers of killed runs.
type Snapshot = BTreeMap<String, (u32, Vec<u8>)>;

/// `.<name>.tmp-<pid>`, `.<name>.new-<pid>`, `.<name>.done-<pid>`, `.<name>.old-<pid>`: scratch
/// files and directories of a run, removed by the next one, never part of the project's state.
fn is_leftover(component: &str) -> bool {
    let Some((head, pid)) = component.rsplit_once('-') else { return false };
    component.starts_with('.') && !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()) && [".tmp", ".new", ".done", ".old"].iter().any(|s| head.ends_with(s))
}

fn walk(root: &Path, dir: &Path, out: &mut Snapshot, leftovers: &mut Vec<String>) {
    let mut entries: Vec<_> = fs::read_dir(dir).expect("ls").map(|e| e.expect("entry")).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let rel = path.strip_prefix(root).expect("under root").to_string_lossy().into_owned();
        if is_leftover(&e.file_name().to_string_lossy()) {
            leftovers.push(rel);
            continue;
        }
        let meta = fs::symlink_metadata(&path).expect("stat");
        if meta.file_type().is_symlink() {
            out.insert(rel, (0o120000, fs::read_link(&path).expect("link").to_string_lossy().into_owned().into_bytes()));
        } else if meta.is_dir() {
            walk(root, &path, out, leftovers);
        } else {
            out.insert(rel, (meta.permissions().mode() & 0o777, fs::read(&path).expect("read")));
        }
    }
}

impl Fx {
    /// A project whose `dir:` base holds `files`, with the empty chain applied.
    fn new(files: &[(&str, &[u8])]) -> Fx {
        let (dir, p) = support::dir_base_project(files);
        Fx { dir, p }
    }

    fn edit(&self, rel: &str, data: &[u8]) {
        write_file(&self.p.upstream_dir().join(rel), data, MODE_FILE);
    }

    fn capture(&self, name: &str) {
        commands::capture(&self.p, &Tine, &CaptureOptions { name, after: None, title: None, area: "other", upstream_status: "Pending" }, &pb()).expect("capture");
    }

    fn snapshot(&self) -> (Snapshot, Vec<String>) {
        let (mut s, mut l) = (Snapshot::new(), Vec::new());
        walk(&self.p.root, &self.p.root, &mut s, &mut l);
        (s, l)
    }

    fn state(&self) -> Snapshot {
        self.snapshot().0
    }

    fn xtask(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
        c.args(args).env("TINE_PROJECT_ROOT", &self.p.root).env("TINE_CACHE_DIR", self.dir.path().join(".cache-unused")).env_remove("TINE_CRASH_AT").env_remove("TINE_CRASH_TRACE");
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().expect("xtask runs")
    }

    fn pending(&self) -> bool {
        self.p.root.join(".tine-journal/plan.json").exists() || self.p.rebase_dir().join("state.json").exists()
    }
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// What `status` and `verify` say about a project: exit codes and output (verify's timing removed).
fn report(fx: &Fx) -> (Option<i32>, String, Option<i32>, String) {
    let s = fx.xtask(&["status"], &[]);
    let v = fx.xtask(&["verify"], &[]);
    let root = fx.p.root.display().to_string();
    let text = |o: &Output| text(o).replace(&root, "<root>");
    let vt: String = text(&v).lines().map(|l| if l.starts_with("verify: ok (") { "verify: ok\n".to_owned() } else { format!("{l}\n") }).collect();
    (s.status.code(), text(&s), v.status.code(), vt)
}

/// A three-file base and a series of two patches (0001 edits f.txt, 0002 edits g.txt).
fn two_patches() -> Fx {
    let f = numbered("f ", 30);
    let g = numbered("g ", 30);
    let fx = Fx::new(&[("f.txt", f.as_bytes()), ("g.txt", g.as_bytes()), ("sub/h.txt", b"h\n")]);
    fx.edit("f.txt", set_line(&f, 5, "F FIVE").as_bytes());
    fx.capture("0001-f");
    fx.edit("g.txt", set_line(&g, 20, "G TWENTY").as_bytes());
    fx.edit("sub/new.txt", b"new in 0002\n");
    fx.capture("0002-g");
    fx
}

/// The maintainer's uncommitted edit that `refresh` and `capture` record.
const EDIT: &str = "MAINTAINER EDIT, NOT YET RECORDED";

struct Case {
    command: &'static [&'static str],
    /// Builds the old state.
    setup: fn() -> Fx,
    /// What a second run says when the first one completed (`None`: it succeeds).
    rerun_refused: Option<&'static str>,
    /// Maintainer work that must survive every crash: (file, text), in the live tree.
    keeps: Option<(&'static str, &'static str)>,
    /// In the new state, the file that must record it.
    records_in: Option<&'static str>,
}

const SWAP: &[&str] = &["tree-scratch-partial", "tree-scratch-written", "tree-swapped"];
const FILE: [&str; 2] = ["file-tmp-written", "file-renamed"];

/// The points of a journaled change of `written.len()` files; `false`: the file already holds
/// those bytes, so it is not written again.
fn journal(written: &[bool]) -> Vec<&'static str> {
    let mut v = vec!["journal-staged", "journal-committed"];
    for w in written {
        if *w {
            v.extend(FILE);
        }
        v.push("journal-wrote");
    }
    v.push("journal-closed");
    v
}

fn cases() -> Vec<(Case, Vec<&'static str>)> {
    let refresh_setup: fn() -> Fx = || {
        let fx = two_patches();
        commands::apply_chain(&fx.p, Some("0001"), &pb()).expect("to 0001");
        let f = fs::read_to_string(fx.p.upstream_dir().join("f.txt")).expect("f");
        fx.edit("f.txt", set_line(&f, 12, EDIT).as_bytes());
        fx
    };
    let capture_setup: fn() -> Fx = || {
        let fx = two_patches();
        fx.edit("sub/h.txt", format!("h\n{EDIT}\n").as_bytes());
        fx
    };
    vec![
        (
            Case {
                command: &["apply-chain"],
                setup: || {
                    let fx = two_patches();
                    commands::apply_chain(&fx.p, Some("0001"), &pb()).expect("to 0001");
                    fx
                },
                rerun_refused: None,
                keeps: None,
                records_in: None,
            },
            SWAP.to_vec(),
        ),
        (Case { command: &["unapply"], setup: two_patches, rerun_refused: None, keeps: None, records_in: None }, SWAP.to_vec()),
        // refresh 0001: patches/0001-f.patch, the registry, the docs (same bytes), manifest.patched, the state file.
        (
            Case { command: &["refresh", "0001"], setup: refresh_setup, rerun_refused: None, keeps: Some(("f.txt", EDIT)), records_in: Some("patches/0001-f.patch") },
            journal(&[true, true, false, true, true]),
        ),
        (
            Case { command: &["capture", "0003-h"], setup: capture_setup, rerun_refused: Some("already in the registry"), keeps: Some(("sub/h.txt", EDIT)), records_in: Some("patches/0003-h.patch") },
            // capture 0003-h: the new patch, the registry, the docs, manifest.patched, the state file.
            journal(&[true; 5]),
        ),
        (
            Case {
                command: &["bless"],
                setup: || {
                    let fx = two_patches();
                    // A hand edit of the registry: the docs table is stale until bless.
                    let reg = fs::read_to_string(fx.p.registry_path()).expect("registry").replace("title = \"g\"", "title = \"g, retitled\"");
                    fs::write(fx.p.registry_path(), reg).expect("write");
                    fx
                },
                rerun_refused: None,
                keeps: None,
                records_in: None,
            },
            // bless: the registry (already canonical), the docs, manifest.patched (unchanged).
            journal(&[false, true, false]),
        ),
        (Case { command: &["backup", "snap"], setup: two_patches, rerun_refused: Some("already exists"), keeps: None, records_in: None }, journal(&[true, true])),
        (
            Case {
                command: &["restore", "snap"],
                setup: || {
                    let fx = two_patches();
                    commands::apply_chain(&fx.p, Some("0001"), &pb()).expect("to 0001");
                    commands::backup(&fx.p, Some("snap")).expect("backup");
                    commands::apply_chain(&fx.p, None, &pb()).expect("all");
                    fx
                },
                rerun_refused: None,
                keeps: None,
                records_in: None,
            },
            SWAP.to_vec(),
        ),
    ]
}

/// Runs `case` to completion once for the reference new state, then crashes it at every point.
fn crash_everywhere(case: &Case, expected_points: &[&str]) -> Vec<(String, &'static str)> {
    let name = case.command.join(" ");
    // The reference: old state, its report, then the new state and its report.
    let fx = (case.setup)();
    let old = fx.state();
    let old_report = report(&fx);
    let trace_dir = tempfile::tempdir().expect("tempdir");
    let trace = trace_dir.path().join("trace");
    let out = fx.xtask(case.command, &[("TINE_CRASH_TRACE", trace.to_str().expect("utf8"))]);
    assert!(out.status.success(), "{name}: the reference run: {}", text(&out));
    let new = fx.state();
    assert_ne!(old, new, "{name}: the command changes something");
    let new_report = report(&fx);
    let points: Vec<String> = fs::read_to_string(&trace).unwrap_or_default().lines().map(str::to_owned).collect();
    assert_eq!(points, expected_points, "{name}: the crash points it passes (update the table and docs/evaluations/reliability-crash.md)");
    if let (Some((file, edit)), Some(rec)) = (case.keeps, case.records_in) {
        assert!(String::from_utf8_lossy(&new[rec].1).contains(&format!("+{edit}")), "{name}: the edit is recorded in {rec}");
        let _ = file;
    }

    let mut occurrences: BTreeMap<&str, usize> = BTreeMap::new();
    let mut outcomes = Vec::new();
    for point in expected_points {
        let n = occurrences.entry(point).or_default();
        *n += 1;
        let at = format!("{point}:{n}");
        let fx = (case.setup)();
        assert_eq!(fx.state(), old, "{name}: the setup is deterministic");
        let out = fx.xtask(case.command, &[("TINE_CRASH_AT", &at)]);
        assert_eq!(out.status.code(), None, "{name} @ {at}: killed by the crash point (signal), got {}", text(&out));
        let (state, _leftovers) = fx.snapshot();
        if let Some((file, edit)) = case.keeps {
            let live = fs::read_to_string(fx.p.upstream_dir().join(file)).unwrap_or_default();
            assert!(live.contains(edit), "{name} @ {at}: the maintainer's edit is still in engine/upstream/{file}");
        }
        let outcome = if fx.pending() {
            // Committed, not yet written out: every check names it, nothing reads a mixed project.
            let (sc, st, vc, vt) = report(&fx);
            assert_eq!(sc, Some(1), "{name} @ {at}: status on an interrupted change: {st}");
            assert!(st.contains("interrupted") && st.contains("cargo xtask recover"), "{name} @ {at}: {st}");
            assert_eq!(vc, Some(1), "{name} @ {at}: verify on an interrupted change: {vt}");
            assert!(vt.contains("interrupted") && vt.contains("cargo xtask recover"), "{name} @ {at}: {vt}");
            let sync = fx.xtask(&["sync-check"], &[]);
            assert_eq!(sync.status.code(), Some(1), "{name} @ {at}: sync-check: {}", text(&sync));
            assert!(text(&sync).contains("interrupted"), "{name} @ {at}: {}", text(&sync));
            let r = fx.xtask(&["recover"], &[]);
            assert!(r.status.success(), "{name} @ {at}: recover: {}", text(&r));
            assert!(text(&r).contains(&format!("finished the interrupted `{name}`")), "{name} @ {at}: {}", text(&r));
            assert_eq!(fx.state(), new, "{name} @ {at}: recover completes the change");
            "interrupted, recovered to new"
        } else if state == old {
            assert_eq!(report(&fx), old_report, "{name} @ {at}: status and verify say what they say for the old state");
            "old"
        } else {
            assert!(state == new, "{name} @ {at}: neither the old nor the new state; differs from new in {:?}", diff_keys(&state, &new));
            assert_eq!(report(&fx), new_report, "{name} @ {at}: status and verify say what they say for the new state");
            "new"
        };
        // Running the command again completes (or, when it completed, says why not and changes nothing).
        let again = fx.xtask(case.command, &[]);
        match (outcome, case.rerun_refused) {
            ("old", _) | (_, None) => assert!(again.status.success(), "{name} @ {at}: the second run: {}", text(&again)),
            (_, Some(why)) => assert!(!again.status.success() && text(&again).contains(why), "{name} @ {at}: {}", text(&again)),
        }
        let (state, leftovers) = fx.snapshot();
        assert!(state == new, "{name} @ {at}: after the second run the new state; differs in {:?}", diff_keys(&state, &new));
        if case.rerun_refused.is_none() || outcome == "old" {
            assert_eq!(leftovers, Vec::<String>::new(), "{name} @ {at}: the second run removes what the killed one left");
        }
        assert_eq!(report(&fx), new_report, "{name} @ {at}: status and verify after the second run");
        outcomes.push((at, outcome));
    }
    outcomes
}

fn diff_keys(a: &Snapshot, b: &Snapshot) -> Vec<String> {
    let mut v: Vec<String> = a.iter().filter(|(k, x)| b.get(*k) != Some(x)).map(|(k, _)| k.clone()).collect();
    v.extend(b.keys().filter(|k| !a.contains_key(*k)).cloned());
    v
}

#[test]
fn kill_9_at_every_write_of_every_command_leaves_the_old_state_the_new_one_or_a_recoverable_one() {
    let start = Instant::now();
    let mut table = Vec::new();
    for (case, points) in cases() {
        for (at, outcome) in crash_everywhere(&case, &points) {
            table.push(format!("| `{}` | `{at}` | {outcome} |", case.command.join(" ")));
        }
    }
    eprintln!("| command | crash point | state after the kill |\n|---|---|---|\n{}\n{} crash runs in {:.1} s", table.join("\n"), table.len(), start.elapsed().as_secs_f64());
}

/// A deterministic generator (splitmix64), so a failing run can be repeated by its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn live_state(fx: &Fx) -> Snapshot {
    let mut s = fx.state();
    s.retain(|k, _| k.starts_with("engine/upstream/"));
    s
}

#[test]
fn random_kill_9_of_apply_chain_and_unapply_never_leaves_a_mixed_tree() {
    let runs: usize = std::env::var("TINE_CRASH_RANDOM_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
    let seed: u64 = std::env::var("TINE_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x7417e);
    // Enough files that writing the tree takes a while, so most kills land in the middle of it.
    let files: Vec<(String, Vec<u8>)> = (0..800).map(|i| (format!("d{}/f{i}.txt", i % 20), numbered(&format!("file {i} line "), 20).into_bytes())).collect();
    let fx = Fx::new(&files.iter().map(|(p, d)| (p.as_str(), &d[..])).collect::<Vec<_>>());
    let pristine = live_state(&fx);
    for i in [3usize, 400, 790] {
        let p = &files[i].0;
        fx.edit(p, set_line(&String::from_utf8_lossy(&files[i].1), 7, "PATCHED").as_bytes());
    }
    fx.edit("d0/added.txt", b"added by 0001\n");
    fx.capture("0001-many");
    let patched = live_state(&fx);
    assert_ne!(pristine, patched);

    // How long uninterrupted runs take: kills are spread over that and half as much again, so
    // some land after the swap or after the end.
    let mut span = Duration::from_millis(20);
    for args in [&["unapply"][..], &["apply-chain"], &["unapply"]] {
        let t0 = Instant::now();
        assert!(fx.xtask(args, &[]).status.success());
        span = span.max(t0.elapsed());
    }
    assert_eq!(live_state(&fx), pristine);

    let mut rng = Rng(seed);
    let mut at_new = 0; // currently pristine: the next command is apply-chain
    let (mut old, mut new, mut done, mut mid_write) = (0, 0, 0, 0);
    let start = Instant::now();
    for run in 0..runs {
        let (args, from, to): (&[&str], &Snapshot, &Snapshot) = if at_new == 0 { (&["apply-chain"], &pristine, &patched) } else { (&["unapply"], &patched, &pristine) };
        let delay = Duration::from_micros(rng.next() % (span.as_micros() as u64 * 3 / 2 + 1));
        let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
        c.args(args).env("TINE_PROJECT_ROOT", &fx.p.root).env_remove("TINE_CRASH_AT").stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
        let mut child = c.spawn().expect("spawn");
        std::thread::sleep(delay);
        let finished = child.try_wait().expect("wait").is_some();
        if !finished {
            child.kill().expect("SIGKILL");
        }
        child.wait().expect("reaped");
        let now = live_state(&fx);
        if !finished && !fx.snapshot().1.is_empty() {
            // A scratch tree was left: the kill landed while the tree was being written.
            mid_write += 1;
        }
        if finished {
            done += 1;
            assert!(now == *to, "run {run} (seed {seed}): completed {args:?} but the tree is not the new state");
            at_new ^= 1;
        } else if now == *from {
            old += 1;
        } else {
            assert!(now == *to, "run {run} (seed {seed}, {delay:?}): kill -9 of {args:?} left a mixed tree: {:?}", diff_keys(&now, to).iter().take(5).collect::<Vec<_>>());
            new += 1;
            at_new ^= 1;
        }
    }
    // Whatever the kills left behind, the next run cleans up and the checks pass.
    assert!(fx.xtask(&["apply-chain"], &[]).status.success());
    assert_eq!(live_state(&fx), patched);
    let (_, leftovers) = fx.snapshot();
    assert_eq!(leftovers, Vec::<String>::new(), "scratch trees of killed runs are removed by the next run");
    let v = fx.xtask(&["verify"], &[]);
    assert!(v.status.success(), "{}", text(&v));
    eprintln!(
        "random kill -9: {runs} runs (seed {seed}, delays 0..{:.0} ms, {} files): {old} killed before the swap (old tree; {mid_write} of all kills while a scratch tree was being written or removed), {new} killed after it (new tree), {done} completed; 0 mixed; {:.1} s",
        span.as_secs_f64() * 1.5e3,
        files.len() + 1,
        start.elapsed().as_secs_f64()
    );
}

// Paths that escape the tree.

/// A project at 0001 with `patch` registered as 0002 by hand (as a merge or an edit would).
fn with_patch(bytes: &[u8], file: &str) -> Fx {
    let fx = Fx::new(&[("a.txt", b"a\n")]);
    fx.edit("a.txt", b"a\nb\n");
    fx.capture("0001-a");
    let reg = fs::read_to_string(fx.p.registry_path()).expect("registry");
    let entry = format!("\n[[patch]]\nid = \"0002\"\nfile = {file:?}\nsha256 = \"{}\"\ntitle = \"escape\"\narea = \"other\"\nstatus = \"carried\"\nbump = \"reapply\"\n", tree::sha256_hex(bytes));
    fs::write(fx.p.registry_path(), reg + &entry).expect("registry");
    if !file.contains('/') {
        fs::write(fx.p.patches_dir().join(file), bytes).expect("patch");
    }
    fx
}

fn creating(path: &str) -> Vec<u8> {
    format!("Subject: [PATCH] escape\n\n---\ndiff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..1111111\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+escaped\n").into_bytes()
}

fn assert_refused(fx: &Fx, args: &[&str], code: i32, needles: &[&str], outside: &Path) {
    let before = fx.state();
    let out = fx.xtask(args, &[]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {t}");
    for n in needles {
        assert!(t.contains(n), "{args:?}: the refusal names {n:?}: {t}");
    }
    assert!(fx.state() == before, "{args:?}: nothing in the project was written: {:?}", diff_keys(&fx.state(), &before));
    assert_eq!(fs::read_dir(outside).map(|d| d.count()).unwrap_or(0), 0, "{args:?}: nothing was written outside");
}

#[test]
fn a_patch_whose_path_leaves_the_tree_is_refused_at_parse_time_naming_patch_and_path() {
    for path in ["../outside/x.txt", "sub/../../outside/x.txt", "/tmp/tine-abs/x.txt", "./x.txt"] {
        let fx = with_patch(&creating(path), "0002-escape.patch");
        let outside = fx.p.root.join("outside");
        fs::create_dir_all(&outside).expect("mkdir");
        for args in [&["apply-chain"][..], &["verify"], &["status"], &["refresh", "0001"], &["capture", "0003-x"]] {
            let needles: &[&str] = if args[0] == "verify" { &["0002", "is absolute or leaves the tree"] } else { &["patch 0002", "0002-escape.patch", "is absolute or leaves the tree"] };
            let named = format!("path {path:?}");
            assert_refused(&fx, args, 1, &[needles, &[named.as_str()]].concat(), &outside);
        }
        assert!(!Path::new("/tmp/tine-abs/x.txt").exists());
    }
    // Every header that names a path is checked, not only `diff --git`.
    for (header, path) in [("rename from a.txt\nrename to ../x", "../x"), ("copy from a.txt\ncopy to /etc/x", "/etc/x")] {
        let bytes = format!("diff --git a/a.txt b/a.txt\nsimilarity index 100%\n{header}\n");
        let err = patchchain::patch::parse(bytes.as_bytes()).expect_err("refused");
        assert!(err.to_string().contains(&format!("path {path:?} is absolute or leaves the tree")), "{err}");
    }
}

#[test]
fn a_path_through_a_symlink_in_the_live_tree_is_refused_before_anything_is_written() {
    let fx = with_patch(&creating("link/file.txt"), "0002-link.patch");
    let outside = tempfile::tempdir().expect("outside");
    std::os::unix::fs::symlink(outside.path(), fx.p.upstream_dir().join("link")).expect("symlink");
    for args in [&["apply-chain"][..], &["unapply"], &["refresh", "0001"], &["capture", "0003-x"]] {
        assert_refused(&fx, args, 3, &["patch 0002-link.patch", "link/file.txt", "engine/upstream/link is a symbolic link"], outside.path());
    }
    assert!(fs::symlink_metadata(fx.p.upstream_dir().join("link")).expect("still there").file_type().is_symlink());
}

#[test]
fn a_registry_file_or_capture_name_outside_patches_is_refused() {
    let fx = with_patch(&creating("b.txt"), "../evil.patch");
    fs::write(fx.p.root.join("evil.patch"), creating("b.txt")).expect("bait");
    let outside = fx.p.root.join("outside");
    for args in [&["apply-chain"][..], &["refresh", "0001"], &["bless"]] {
        assert_refused(&fx, args, 1, &["patch 0002", "\"../evil.patch\"", "not a plain file name"], &outside);
    }
    let fx = Fx::new(&[("a.txt", b"a\n")]);
    fx.edit("a.txt", b"a\nb\n");
    for name in ["0001-../../outside/x", "0001-a/b", "0001-A"] {
        assert_refused(&fx, &["capture", name], 1, &["capture takes NNNN-slug"], &outside);
    }
    for name in ["../outside/x", ".hidden"] {
        assert_refused(&fx, &["restore", name], 1, &["must be a plain file name"], &outside);
    }
}

/// One ustar entry, by hand (the tar crate refuses to write such names).
fn tar_entry(out: &mut Vec<u8>, name: &str, data: &[u8]) {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    h[100..108].copy_from_slice(b"0000644\0");
    h[108..116].copy_from_slice(b"0000000\0");
    h[116..124].copy_from_slice(b"0000000\0");
    h[124..136].copy_from_slice(format!("{:011o}\0", data.len()).as_bytes());
    h[136..148].copy_from_slice(b"00000000000\0");
    h[156] = b'0';
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| b as u32).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
}

#[test]
fn a_backup_whose_entries_leave_the_tree_is_refused_and_nothing_is_written() {
    for bad in ["../outside/x.txt", "/tmp/tine-abs-backup/x.txt"] {
        let fx = Fx::new(&[("a.txt", b"a\n")]);
        let outside = fx.p.root.join("outside");
        let mut tar = Vec::new();
        tar_entry(&mut tar, "a.txt", b"a\n");
        tar_entry(&mut tar, bad, b"escaped\n");
        tar.extend_from_slice(&[0u8; 1024]);
        let dir = fx.p.backups_dir();
        fs::create_dir_all(&dir).expect("mkdir");
        fs::write(dir.join("evil.tar"), &tar).expect("tar");
        // A manifest that matches, so only the path check stands between it and the disk.
        let manifest = format!("{} 100644 a.txt\n{} 100644 {bad}\n", tree::sha256_hex(b"a\n"), tree::sha256_hex(b"escaped\n"));
        fs::write(dir.join("evil.manifest"), manifest).expect("manifest");
        assert_refused(&fx, &["restore", "evil"], 1, &["backup evil", "is damaged", &format!("{bad:?} is absolute or leaves the tree")], &outside);
        assert!(!Path::new("/tmp/tine-abs-backup").exists());
    }
}
