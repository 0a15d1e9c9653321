//! Regression tests: one per toolchain bug, each named after what it guards.
//!
//! Patches made by the git command line (and, for our own exports, libgit2) are the independent
//! checkers: for every shape we accept, git must give the same tree, both ways.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use patchchain::apply::{self, ApplyErrorKind};
use patchchain::commands::{self, CaptureOptions};
use patchchain::import::{ImportError, ImportOptions};
use patchchain::patch::{self, ParseErrorKind};
use patchchain::registry::{self, PatchEntry};
use patchchain::tree::{self, Entry, Tree, MODE_EXEC, MODE_FILE};
use patchchain::verify::{self, Outcome};
use patchchain::NoExtension;
use patchchain::{chain, Project};

// ---- Fixture helpers (as in tests/chain.rs) ----

struct Fx {
    _dir: tempfile::TempDir,
    p: Project,
}

fn pb() -> indicatif::ProgressBar {
    indicatif::ProgressBar::hidden()
}

fn write_file(path: &Path, data: &[u8], mode: u32) {
    fs::create_dir_all(path.parent().expect("has parent")).expect("mkdir");
    fs::write(path, data).expect("write");
    fs::set_permissions(path, fs::Permissions::from_mode(if mode == MODE_EXEC { 0o755 } else { 0o644 })).expect("chmod");
}

impl Fx {
    /// A project whose base is the directory `base/` holding `files`.
    fn new(files: &[(&str, &[u8])]) -> Fx {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = Project::new(dir.path());
        for (path, data) in files {
            write_file(&dir.path().join("base").join(path), data, MODE_FILE);
        }
        fs::create_dir_all(p.patches_dir()).expect("mkdir patches");
        write_file(&p.registry_path(), b"[base]\nkind = \"dir\"\npath = \"base\"\n", MODE_FILE);
        commands::bless(&p, &NoExtension, true, &pb()).expect("bless the new base");
        Fx { _dir: dir, p }
    }

    fn live(&self, path: &str) -> PathBuf {
        self.p.upstream_dir().join(path)
    }

    fn edit(&self, path: &str, data: &[u8]) {
        write_file(&self.live(path), data, MODE_FILE);
    }

    fn apply(&self, to: Option<&str>) -> anyhow::Result<()> {
        commands::apply_chain(&self.p, to, &pb())
    }

    fn capture(&self, name: &str) -> anyhow::Result<()> {
        commands::capture(&self.p, &NoExtension, &CaptureOptions { name, after: None, title: None, area: "other", upstream_status: "Pending" }, &pb())
    }

    fn verify(&self) -> verify::Report {
        verify::verify(&self.p, &pb()).expect("verify runs")
    }

    fn live_tree(&self) -> Tree {
        tree::read_tree(&self.p.upstream_dir()).expect("live tree")
    }

    fn base_tree(&self) -> Tree {
        tree::read_tree(&self.p.root.join("base")).expect("base tree")
    }

    fn patch_bytes(&self, file: &str) -> Vec<u8> {
        fs::read(self.p.patches_dir().join(file)).expect("patch file")
    }

    fn assert_verified(&self) {
        let r = self.verify();
        assert!(r.passed(), "verify failed:\n{}", r.render());
    }

    /// Adds a patch made elsewhere to the end of the series by hand (file + registry entry), then blesses.
    fn add_patch(&self, id: &str, slug: &str, bytes: &[u8]) -> anyhow::Result<()> {
        let file = format!("{id}-{slug}.patch");
        fs::write(self.p.patches_dir().join(&file), bytes).expect("write patch");
        let mut reg = chain::load_registry(&self.p).expect("registry");
        reg.patches.push(PatchEntry {
            id: id.into(),
            file,
            sha256: String::new(),
            title: slug.into(),
            area: "other".into(),
            hooks: Vec::new(),
            status: "carried".into(),
            upstream: String::new(),
            bump: "reapply".into(),
            gates: vec!["apply".into()],
        });
        fs::write(self.p.registry_path(), registry::render(&reg)).expect("write registry");
        commands::bless(&self.p, &NoExtension, false, &pb())
    }

    /// Every file of the project, engine/upstream/ and its state file included.
    fn snapshot(&self) -> Tree {
        tree::read_tree(&self.p.root).expect("project tree")
    }
}

/// libgit2 applies `patch` to `base`: an independent second opinion on every exported patch.
fn git2_apply(base: &Tree, patch: &[u8]) -> Tree {
    let dir = tempfile::tempdir().expect("tempdir");
    for (path, e) in base {
        write_file(&dir.path().join(path), &e.data, e.mode);
    }
    let repo = git2::Repository::init(dir.path()).expect("git init");
    let start = tree::find(patch, b"diff --git ").expect("a patch has a diff");
    let diff = git2::Diff::from_buffer(&patch[start..]).expect("libgit2 parses our patch");
    repo.apply(&diff, git2::ApplyLocation::WorkDir, None).expect("libgit2 applies our patch");
    tree::read_tree(dir.path()).expect("read back")
}

fn step(r: &verify::Report, n: u8) -> &Outcome {
    &r.steps.iter().find(|s| s.number == n).expect("step exists").outcome
}

fn fail_text(r: &verify::Report, n: u8) -> String {
    match step(r, n) {
        Outcome::Fail(t) => t.clone(),
        other => panic!("step {n} should fail, got {other:?}\n{}", r.render()),
    }
}

fn one_file(path: &str, data: &[u8]) -> Tree {
    [(path.to_owned(), Entry::file(data))].into()
}

// ---- The git command line, isolated from any user configuration ----

fn git_cmd(dir: &Path) -> Command {
    let mut c = Command::new("git");
    c.current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_AUTHOR_NAME", "A U Thor")
        .env("GIT_AUTHOR_EMAIL", "author@example.invalid")
        .env("GIT_AUTHOR_DATE", "1700000000 +0000")
        .env("GIT_COMMITTER_NAME", "C O Mitter")
        .env("GIT_COMMITTER_EMAIL", "committer@example.invalid")
        .env("GIT_COMMITTER_DATE", "1700000000 +0000")
        .args(["-c", "core.autocrlf=false", "-c", "init.defaultBranch=main"]);
    c
}

fn git(dir: &Path, args: &[&str]) -> Vec<u8> {
    let out = git_cmd(dir).args(args).output().expect("git runs");
    assert!(out.status.success(), "git {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

fn write_tree(dir: &Path, t: &Tree) {
    for (path, e) in t {
        write_file(&dir.join(path), &e.data, e.mode);
    }
}

/// A git repository holding `t`, committed.
fn git_repo(t: &Tree) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    git(dir.path(), &["init", "-q"]);
    write_tree(dir.path(), t);
    git(dir.path(), &["add", "-A"]);
    git(dir.path(), &["commit", "-q", "--allow-empty", "-m", "base"]);
    dir
}

/// `git diff --binary` from `old` to `new` (one file each).
fn git_diff(path: &str, old: &[u8], new: &[u8]) -> Vec<u8> {
    let repo = git_repo(&one_file(path, old));
    fs::write(repo.path().join(path), new).expect("write");
    git(repo.path(), &["diff", "--binary"])
}

/// `git apply [-R]` of `patch` on `t`, outside any repository: the tree, or None when git refuses.
fn git_apply(t: &Tree, patch: &[u8], reverse: bool) -> Option<Tree> {
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("w");
    fs::create_dir_all(&work).expect("mkdir");
    write_tree(&work, t);
    let patch_path = dir.path().join("p.patch");
    fs::write(&patch_path, patch).expect("write");
    let mut c = git_cmd(&work);
    c.arg("apply");
    if reverse {
        c.arg("-R");
    }
    let ok = c.arg(&patch_path).output().expect("git runs").status.success();
    ok.then(|| tree::read_tree(&work).expect("read back"))
}

/// Our placer on `t`: the tree, or the error kind.
fn ours(t: &Tree, patch: &[u8], reverse: bool) -> Result<Tree, ApplyErrorKind> {
    let ps = patch::parse(patch).expect("git's patch parses");
    let mut t = t.clone();
    let r = if reverse { apply::unapply(&mut t, &ps, "p.patch") } else { apply::apply(&mut t, &ps, "p.patch") };
    r.map(|()| t).map_err(|e| e.kind)
}

// ---- 1. End-of-file hunks are anchored ----

/// (name, before, after): the shapes whose hunk runs into the end of the file.
const EOF_SHAPES: &[(&str, &str, &str)] = &[
    ("append", "a\nb\nc\nd\n", "a\nb\nc\nd\ne\n"),
    ("delete-last", "a\nb\nc\nd\n", "a\nb\nc\n"),
    ("replace-last", "a\nb\nc\nd\n", "a\nb\nc\nD\n"),
    ("append-no-newline", "a\nb\nc\nd", "a\nb\nc\nd\ne"),
    ("delete-last-no-newline", "a\nb\nc\nd", "a\nb\nc"),
    ("replace-last-no-newline", "a\nb\nc\nd", "a\nb\nc\nD"),
    ("drop-final-newline", "a\nb\nc\nd\n", "a\nb\nc\nd"),
    ("add-final-newline", "a\nb\nc\nd", "a\nb\nc\nd\n"),
    ("append-repeated-brace", "fn f() {\n    x();\n}\n}\n", "fn f() {\n    x();\n}\n}\n}\n"),
    ("delete-repeated-brace", "fn f() {\n    x();\n}\n}\n}\n", "fn f() {\n    x();\n}\n}\n"),
    ("two-braces-to-one", "}\n}\n", "}\n"),
    ("one-brace-to-two", "}\n", "}\n}\n"),
    ("one-line-append", "a\n", "a\nb\n"),
    ("delete-second-of-two", "a\nb\n", "a\n"),
    ("long-replace-last", "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n", "1\n2\n3\n4\n5\n6\n7\n8\n9\nten\n"),
    // One trailing context line, fewer than the three leading: anchored too (GNU patch's rule).
    ("delete-next-to-last", "1\n2\n3\n4\n5\n6\n7\n8\n", "1\n2\n3\n4\n5\n6\n8\n"),
];

#[test]
fn end_of_file_hunks_apply_and_reverse_exactly_like_git_apply() {
    for (name, old, new) in EOF_SHAPES {
        let patch = git_diff("f", old.as_bytes(), new.as_bytes());
        let (old_t, new_t) = (one_file("f", old.as_bytes()), one_file("f", new.as_bytes()));
        let forward = ours(&old_t, &patch, false).unwrap_or_else(|k| panic!("{name}: forward refused: {k}"));
        assert_eq!(forward, new_t, "{name}: forward");
        assert_eq!(git_apply(&old_t, &patch, false).as_ref(), Some(&forward), "{name}: git apply disagrees");
        let back = ours(&new_t, &patch, true).unwrap_or_else(|k| panic!("{name}: reverse refused: {k}"));
        assert_eq!(back, old_t, "{name}: reverse");
        assert_eq!(git_apply(&new_t, &patch, true).as_ref(), Some(&back), "{name}: git apply -R disagrees");
        // The already-applied check plans the other direction first: it must not see ambiguity.
        assert_eq!(ours(&new_t, &patch, false).expect_err("applied twice"), ApplyErrorKind::AlreadyApplied, "{name}");
        assert_eq!(ours(&old_t, &patch, true).expect_err("reversed twice"), ApplyErrorKind::NotApplied, "{name}");
    }
}

#[test]
fn a_hunk_without_trailing_context_does_not_apply_in_the_middle_of_a_file() {
    // git's own patches, on a file that goes on after where they end: git refuses (match_end), so must we.
    for (name, old, new) in EOF_SHAPES.iter().filter(|(_, old, _)| old.ends_with('\n')) {
        let patch = git_diff("f", old.as_bytes(), new.as_bytes());
        let longer = one_file("f", format!("{old}more\n").as_bytes());
        let got = ours(&longer, &patch, false);
        assert!(matches!(got, Err(ApplyErrorKind::NotAtEnd { .. })), "{name}: {got:?}");
        let ps = patch::parse(&patch).expect("parses");
        let patchchain::patch::Content::Text(h) = &ps.files[0].content else { panic!("text") };
        if h[0].trailing_context() == 0 {
            assert_eq!(git_apply(&longer, &patch, false), None, "{name}: git apply accepted it mid-file");
        }
    }
    let err = apply::apply(&mut one_file("f", b"a\nb\nc\nd\nmore\n"), &patch::parse(&git_diff("f", b"a\nb\nc\nd\n", b"a\nb\nc\n")).expect("parses"), "0001-x.patch").expect_err("refused");
    assert_eq!(err.to_string(), "patch 0001-x.patch: f, hunk #1 (patch line 5): the hunk ends the file (fewer trailing than leading context lines), so it must match at the end; it matches at line 1 but 1 more line(s) follow");
}

#[test]
fn an_insertion_at_the_end_of_a_file_applied_twice_is_already_applied_not_ambiguous() {
    let patch = git_diff("f", b"x\n}\n}\n", b"x\n}\n}\n}\n");
    let ps = patch::parse(&patch).expect("parses");
    let mut t = one_file("f", b"x\n}\n}\n");
    apply::apply(&mut t, &ps, "p").expect("applies once");
    let err = apply::apply(&mut t, &ps, "p").expect_err("refused the second time");
    assert_eq!(err.kind, ApplyErrorKind::AlreadyApplied, "{err}");
    apply::unapply(&mut t, &ps, "p").expect("reverses");
    assert_eq!(t["f"].data, b"x\n}\n}\n");
}

#[test]
fn capture_records_end_of_file_edits_that_verify_unapply_and_match_libgit2() {
    // One patch per shape: in a patch of several files, one that fails the opposite direction
    // would hide another file's ambiguity.
    for (name, old, new) in EOF_SHAPES {
        let fx = Fx::new(&[("f.txt", old.as_bytes())]);
        fx.apply(None).expect("applies");
        fx.edit("f.txt", new.as_bytes());
        fx.capture("0001-eof").unwrap_or_else(|e| panic!("{name}: capture: {e:#}"));
        let want = fx.live_tree();
        let r = fx.verify();
        assert!(r.passed(), "{name}: verify failed:\n{}", r.render());
        let bytes = fx.patch_bytes("0001-eof.patch");
        assert_eq!(git2_apply(&fx.base_tree(), &bytes), want, "{name}: libgit2 disagrees with our placer");
        assert_eq!(git_apply(&want, &bytes, true).as_ref(), Some(&fx.base_tree()), "{name}: git apply -R disagrees with our placer");
        commands::unapply(&fx.p, Some("0000"), &pb()).unwrap_or_else(|e| panic!("{name}: unapply: {e:#}"));
        assert_eq!(fx.live_tree(), fx.base_tree(), "{name}");
        fx.apply(None).expect("reapply");
        assert_eq!(fx.live_tree(), want, "{name}");
    }
}

// ---- 2. Binary delta hunks ----

/// 20 KB of pseudo-random bytes (NULs included, so git treats it as binary).
fn blob() -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..20_000)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

fn changed_blob() -> Vec<u8> {
    let mut b = blob();
    for i in [100, 5_000, 12_345, 19_999] {
        b[i] ^= 0x5a;
    }
    b.extend_from_slice(b"tail");
    b
}

#[test]
fn binary_delta_hunks_apply_both_ways_like_git_apply() {
    let (old, new) = (blob(), changed_blob());
    let patch = git_diff("blob.bin", &old, &new);
    let text = String::from_utf8_lossy(&patch);
    assert_eq!(text.matches("\ndelta ").count(), 2, "git should write a forward and a reverse delta:\n{text}");
    let (old_t, new_t) = (one_file("blob.bin", &old), one_file("blob.bin", &new));
    let forward = ours(&old_t, &patch, false).expect("the delta applies");
    assert_eq!(forward, new_t);
    assert_eq!(git_apply(&old_t, &patch, false).as_ref(), Some(&forward));
    let back = ours(&new_t, &patch, true).expect("the reverse delta applies");
    assert_eq!(back, old_t);
    assert_eq!(ours(&new_t, &patch, false).expect_err("twice"), ApplyErrorKind::AlreadyApplied);
    // Another file of the same size: the index line's blob id refuses it before the delta runs.
    let mut other = old.clone();
    other[7] ^= 1;
    assert_eq!(ours(&one_file("blob.bin", &other), &patch, false).expect_err("wrong preimage"), ApplyErrorKind::BinaryPreimage);
    // Without the blob ids, the delta's own source-size check still refuses a different file.
    let no_ids = text.lines().filter(|l| !l.starts_with("index ")).collect::<Vec<_>>().join("\n") + "\n";
    let got = ours(&one_file("blob.bin", &old[..100]), no_ids.as_bytes(), false).expect_err("wrong size");
    assert!(matches!(&got, ApplyErrorKind::BinaryDelta(patchchain::delta::DeltaError::SourceSize { expected: 20_000, found: 100 })), "{got:?}");
}

#[test]
fn binary_delta_patches_work_through_apply_chain_verify_and_unapply() {
    let fx = Fx::new(&[("blob.bin", &blob())]);
    let mut bytes = b"Subject: [PATCH] blob: a few bytes\n\nUpstream-Status: Pending\n---\n".to_vec();
    bytes.extend_from_slice(&git_diff("blob.bin", &blob(), &changed_blob()));
    fx.add_patch("0001", "blob", &bytes).expect("bless: the chain applies");
    fx.apply(None).expect("apply-chain applies the delta");
    assert_eq!(fx.live_tree()["blob.bin"].data, changed_blob());
    fx.assert_verified();
    commands::unapply(&fx.p, Some("0000"), &pb()).expect("unapply reverses the delta");
    assert_eq!(fx.live_tree(), fx.base_tree());
}

// ---- 3. Arithmetic on hunk ranges; paths that collide with files or directories ----

#[test]
fn a_hunk_start_near_u64_max_is_an_error_not_a_panic() {
    let hdr = "diff --git a/f b/f\n--- a/f\n+++ b/f\n";
    let body = " a\n b\n c\n d\n e\n";
    for header in ["@@ -18446744073709551615,5 +1,5 @@", "@@ -1,5 +18446744073709551615,5 @@", "@@ -1,18446744073709551615 +1,5 @@"] {
        let err = patch::parse(format!("{hdr}{header}\n{body}").as_bytes()).expect_err("refused");
        assert_eq!((err.line, &err.kind), (4, &ParseErrorKind::HunkOutOfRange(header.into())), "{header}");
    }
    // A range that just fits parses, and the placer refuses it cleanly in both directions.
    let ps = patch::parse(format!("{hdr}@@ -18446744073709551610,5 +18446744073709551610,5 @@\n{body}").as_bytes()).expect("fits");
    let t = one_file("f", b"a\nb\nc\nd\ne\n");
    for reverse in [false, true] {
        let got = apply::plan(&t, &ps, reverse).expect_err("refused");
        assert!(matches!(got.kind, ApplyErrorKind::AtOffset { .. }), "{got}");
    }
    let ps = patch::parse(format!("{hdr}@@ -18446744073709551610,0 +18446744073709551611,1 @@\n+x\n").as_bytes()).expect("fits");
    for reverse in [false, true] {
        let got = apply::plan(&t, &ps, reverse).expect_err("refused");
        assert!(matches!(got.kind, ApplyErrorKind::AtOffset { .. } | ApplyErrorKind::PastEnd { .. }), "{got}");
    }
    // Sizes in binary hunk headers are not trusted for allocations either.
    for kind in ["literal", "delta"] {
        let err = patch::parse(format!("diff --git a/b b/b\nGIT binary patch\n{kind} 18446744073709551615\nHcmV?d00001\n\n").as_bytes()).expect_err("refused");
        assert!(matches!(err.kind, ParseErrorKind::BadBinary(_)), "{err}");
    }
}

const CREATE_F_X: &str =
    "diff --git a/f/x b/f/x\nnew file mode 100644\nindex 0000000000000000000000000000000000000000..587be6b4c3f93f93c489c0111bba5596147a26cb\n--- /dev/null\n+++ b/f/x\n@@ -0,0 +1 @@\n+x\n";
const CREATE_D: &str =
    "diff --git a/d b/d\nnew file mode 100644\nindex 0000000000000000000000000000000000000000..587be6b4c3f93f93c489c0111bba5596147a26cb\n--- /dev/null\n+++ b/d\n@@ -0,0 +1 @@\n+x\n";
const DELETE_D_Y: &str =
    "diff --git a/d/y b/d/y\ndeleted file mode 100644\nindex 975fbec8256d3e8a3797e7a3611380f27c49f4ac..0000000000000000000000000000000000000000\n--- a/d/y\n+++ /dev/null\n@@ -1 +0,0 @@\n-y\n";

#[test]
fn creating_a_file_under_a_file_or_over_a_directory_is_refused_by_the_placer() {
    let base: Tree = [("f".to_owned(), Entry::file(&b"f\n"[..])), ("d/y".to_owned(), Entry::file(&b"y\n"[..]))].into();
    let err = apply::apply(&mut base.clone(), &patch::parse(CREATE_F_X.as_bytes()).expect("parses"), "0001-f-x.patch").expect_err("refused");
    assert_eq!(err.to_string(), "patch 0001-f-x.patch: f/x: cannot create it: f is a file, not a directory");
    let err = apply::apply(&mut base.clone(), &patch::parse(CREATE_D.as_bytes()).expect("parses"), "0001-d.patch").expect_err("refused");
    assert_eq!(err.to_string(), "patch 0001-d.patch: d: cannot create it: it is a directory holding d/y");
    // One patch that empties the directory and puts a file in its place fits, both ways (and git agrees).
    let both = format!("{CREATE_D}{DELETE_D_Y}");
    let done = ours(&base, both.as_bytes(), false).expect("fits");
    assert_eq!(done.keys().collect::<Vec<_>>(), ["d", "f"]);
    assert_eq!(git_apply(&base, both.as_bytes(), false).as_ref(), Some(&done));
    assert_eq!(ours(&done, both.as_bytes(), true).expect("reverses"), base);

    // verify's step 2 names the patch, instead of a write failing later without a name.
    let fx = Fx::new(&[("f", b"f\n")]);
    fx.add_patch("0001", "f-x", format!("Subject: [PATCH] f/x\n\nUpstream-Status: Pending\n---\n{CREATE_F_X}").as_bytes()).expect_err("bless: the chain does not apply");
    let t = fail_text(&fx.verify(), 2);
    assert!(t.contains("patch 0001-f-x.patch: f/x: cannot create it: f is a file"), "{t}");
    let err = fx.apply(None).expect_err("apply-chain refuses by name");
    assert!(err.to_string().contains("patch 0001-f-x.patch: f/x"), "{err:#}");
}

// ---- 4. refresh reports the first later patch that breaks, not every one after it ----

#[test]
fn refresh_that_breaks_the_next_patch_reports_only_the_first_broken_patch() {
    let fx = Fx::new(&[("a.txt", b"1\n2\n3\n")]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"1\ntwo\n3\n");
    fx.capture("0001-two").expect("capture 0001");
    fx.edit("a.txt", b"1\ntwo\nthree\n");
    fx.capture("0002-three").expect("capture 0002");
    fx.edit("a.txt", b"1\ntwo\nthree\nfour\n");
    fx.capture("0003-four").expect("capture 0003");
    fx.apply(Some("0001")).expect("down to 0001");
    fx.edit("a.txt", b"1\nTWO\n3\n");
    let msg = format!("{:#}", commands::refresh(&fx.p, &NoExtension, "0001", &pb()).expect_err("0002 breaks"));
    assert!(msg.contains("patch 0002-three.patch: a.txt, hunk #1"), "{msg}");
    assert!(msg.contains("the 1 patch(es) after it were not checked, since they build on it: 0003-four.patch"), "{msg}");
    assert!(!msg.contains("patch 0003-four.patch:"), "0003 was applied without 0002 and reported:\n{msg}");
}

// ---- 5. verify never modifies the project ----

/// A tiny engine workspace whose "base crate" is a path crate in engine/upstream/.
fn cargo_project(base_version: &str) -> (tempfile::TempDir, Project) {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    write_file(&root.join("Cargo.toml"), b"[workspace]\nmembers = [\"engine/crates/user\"]\nresolver = \"2\"\n", MODE_FILE);
    write_file(
        &root.join("engine/crates/user/Cargo.toml"),
        b"[package]\nname = \"user\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\ntiny-base = { path = \"../../upstream/tiny-base\" }\n",
        MODE_FILE,
    );
    write_file(&root.join("engine/crates/user/src/lib.rs"), b"", MODE_FILE);
    write_file(&root.join("engine/upstream/tiny-base/Cargo.toml"), format!("[package]\nname = \"tiny-base\"\nversion = \"{base_version}\"\nedition = \"2021\"\n").as_bytes(), MODE_FILE);
    write_file(&root.join("engine/upstream/tiny-base/src/lib.rs"), b"", MODE_FILE);
    let p = Project::new(root);
    (dir, p)
}

#[test]
fn verify_step_7_never_rewrites_cargo_lock() {
    let reg = registry::Registry {
        base: registry::Base::Crates { crates: vec![registry::CratePin { name: "tiny-base".into(), version: "0.1.0".into(), sha256: "0".repeat(64) }] },
        engine: None,
        patches: Vec::new(),
    };
    let (_dir, p) = cargo_project("0.1.0");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(&cargo).args(["generate-lockfile", "--offline", "--manifest-path"]).arg(p.root.join("Cargo.toml")).status().expect("cargo runs");
    assert!(status.success());
    let lock = fs::read(p.root.join("Cargo.lock")).expect("lock");
    match verify::check_cargo(&p, &reg) {
        Outcome::Pass(_) => {}
        other => panic!("an up-to-date lock passes: {other:?}"),
    }
    assert_eq!(fs::read(p.root.join("Cargo.lock")).expect("lock"), lock);

    // The base crate's version moves: cargo would rewrite Cargo.lock. verify must fail and say what to run.
    write_file(&p.root.join("engine/upstream/tiny-base/Cargo.toml"), b"[package]\nname = \"tiny-base\"\nversion = \"0.1.1\"\nedition = \"2021\"\n", MODE_FILE);
    match verify::check_cargo(&p, &reg) {
        Outcome::Fail(t) => assert!(t.contains("Cargo.lock is out of date") && t.contains("cargo update --workspace"), "{t}"),
        other => panic!("a stale lock fails: {other:?}"),
    }
    assert_eq!(fs::read(p.root.join("Cargo.lock")).expect("lock"), lock, "verify rewrote Cargo.lock");
    assert!(!p.root.join("target").exists());

    // No lock at all: cargo would write one; verify says so and writes nothing.
    fs::remove_file(p.root.join("Cargo.lock")).expect("rm");
    match verify::check_cargo(&p, &reg) {
        Outcome::Fail(t) => assert!(t.contains("cargo generate-lockfile"), "{t}"),
        other => panic!("a missing lock fails: {other:?}"),
    }
    assert!(!p.root.join("Cargo.lock").exists());
}

// ---- 6. import ----

/// Series 0010 (a.rs), 0020 (b.rs), 0030 (c.rs) on a base of three files.
fn three_patch_fixture() -> Fx {
    let lines = |tag: &str| (1..=9).map(|i| format!("{tag}{i}\n")).collect::<String>();
    let fx = Fx::new(&[("a.rs", lines("a").as_bytes()), ("b.rs", lines("b").as_bytes()), ("c.rs", lines("c").as_bytes())]);
    fx.apply(None).expect("applies");
    let edit = |f: &str, from: &str, to: &str| {
        let cur = fs::read_to_string(fx.live(f)).expect("read");
        fx.edit(f, cur.replace(from, to).as_bytes());
    };
    edit("a.rs", "a2\n", "A2\n");
    fx.capture("0010-a").expect("0010");
    edit("b.rs", "b2\n", "B2\n");
    fx.capture("0020-b").expect("0020");
    edit("c.rs", "c8\n", "C8\n");
    fx.capture("0030-c").expect("0030");
    fx
}

/// `git format-patch` of `edit` made on the fixture's chain up to `at`.
fn format_patch(fx: &Fx, at: &str, edit: &dyn Fn(&Path)) -> (tempfile::TempDir, PathBuf) {
    let patches = chain::load_patches(&fx.p, &chain::load_registry(&fx.p).expect("registry")).expect("patches");
    let n = chain::resolve_to(&patches, Some(at)).expect("id");
    let t = chain::build(&fx.base_tree(), &patches[..n]).expect("builds");
    let repo = git_repo(&t);
    edit(repo.path());
    git(repo.path(), &["add", "-A"]);
    git(repo.path(), &["commit", "-q", "-m", "b: change b8 and add a hook\n\nUpstream PR #42, as merged.\n\nSigned-off-by: A U Thor <author@example.invalid>"]);
    let mail = git(repo.path(), &["format-patch", "-1", "--stdout"]);
    let path = repo.path().join("0001-upstream.patch");
    fs::write(&path, mail).expect("write");
    (repo, path)
}

fn edit_b8(dir: &Path) {
    let b = fs::read_to_string(dir.join("b.rs")).expect("read");
    fs::write(dir.join("b.rs"), b.replace("b8\n", "B8\n")).expect("write");
    fs::write(dir.join("hook.rs"), "// tine-hook: imported-hook\n").expect("write");
}

fn import(fx: &Fx, file: &Path, after: &str) -> Result<patchchain::import::Imported, ImportError> {
    patchchain::import::import(&fx.p, &NoExtension, &ImportOptions { file, after, id: None, slug: None, area: "kv", upstream_status: "Pending" }, &pb())
}

#[test]
fn import_adds_a_git_format_patch_after_a_middle_patch() {
    let fx = three_patch_fixture();
    let (_repo, mail) = format_patch(&fx, "0020", &edit_b8);
    let text = fs::read_to_string(&mail).expect("read");
    assert!(text.starts_with("From ") && text.contains("\nSubject: [PATCH] b: change b8") && text.contains("\n-- \n"), "{text}");
    let commit = text[5..45].to_owned();

    let done = import(&fx, &mail, "0020").expect("imports");
    assert_eq!((done.id.as_str(), done.file.as_str(), done.rebuilt_live), ("0021", "0021-b-change-b8-and-add-a-hook.patch", true));
    let reg = chain::load_registry(&fx.p).expect("registry");
    assert_eq!(reg.patches.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), ["0010", "0020", "0021", "0030"]);
    let e = &reg.patches[2];
    assert_eq!((e.title.as_str(), e.area.as_str(), e.status.as_str(), e.bump.as_str()), ("b: change b8 and add a hook", "kv", "carried", "reapply"));
    assert_eq!((e.hooks.clone(), e.gates.clone()), (vec!["imported-hook".to_owned()], vec!["apply".to_owned()]));

    let bytes = fx.patch_bytes(&done.file);
    let got = String::from_utf8(bytes.clone()).expect("utf8");
    let header = format!(
        "Subject: [PATCH] b: change b8 and add a hook\n\nUpstream PR #42, as merged.\n\nSigned-off-by: A U Thor <author@example.invalid>\n\nTine-Hook: imported-hook\nUpstream-Status: Pending\nImported-From: {commit}\nImported-Author: A U Thor <author@example.invalid>\nImported-Date: Tue, 14 Nov 2023 22:13:20 +0000\n---\ndiff --git a/b.rs b/b.rs\n"
    );
    assert!(got.starts_with(&header), "{got}");
    assert!(!got.contains("\n-- \n") && !got.contains("files changed"), "the mail's signature and diffstat are gone:\n{got}");
    assert!(patchchain::sync_check::sync_check(&fx.p, &NoExtension, &reg).is_empty(), "{:?}", patchchain::sync_check::sync_check(&fx.p, &NoExtension, &reg));
    assert!(fs::read_to_string(fx.p.sync_doc_path()).expect("docs").contains("| 0021 | b: change b8 and add a hook | kv |"));
    // engine/upstream/ held 0030, so it was rebuilt with the import; everything verifies.
    assert_eq!(fs::read_to_string(fx.live("hook.rs")).expect("read"), "// tine-hook: imported-hook\n");
    fx.assert_verified();
    fx.apply(None).expect("apply-chain: nothing to do");

    // Deterministic and in capture's format: the same edit captured by hand gives the same diff.
    let other = three_patch_fixture();
    other.apply(Some("0020")).expect("down to 0020");
    edit_b8(&other.p.upstream_dir());
    commands::capture(&other.p, &NoExtension, &CaptureOptions { name: "0021-b-change-b8-and-add-a-hook", after: Some("0020"), title: None, area: "kv", upstream_status: "Pending" }, &pb())
        .expect("capture");
    let captured = other.patch_bytes("0021-b-change-b8-and-add-a-hook.patch");
    let diff = |b: &[u8]| b[tree::find(b, b"diff --git ").expect("diff")..].to_vec();
    assert_eq!(diff(&bytes), diff(&captured));
    let before = chain::build(&fx.base_tree(), &chain::load_patches(&fx.p, &reg).expect("patches")[..2]).expect("builds");
    let mut after = before.clone();
    apply::apply(&mut after, &patch::parse(&bytes).expect("parses"), "x").expect("applies");
    assert_eq!(git2_apply(&before, &bytes), after, "libgit2 disagrees");
}

#[test]
fn import_refuses_a_patch_that_does_not_apply_or_breaks_a_later_one_and_writes_nothing() {
    let fx = three_patch_fixture();
    let untouched = fx.snapshot();
    // Made on top of 0030 (its context holds C8): it does not apply after 0020.
    let (_r1, on_top) = format_patch(&fx, "0030", &|d: &Path| {
        let c = fs::read_to_string(d.join("c.rs")).expect("read");
        fs::write(d.join("c.rs"), c.replace("c9\n", "C9\n")).expect("write");
    });
    let msg = format!("{:#}", anyhow::Error::from(import(&fx, &on_top, "0020").expect_err("refused")));
    assert!(msg.contains("does not apply strictly on the chain up to 0020; nothing was written") && msg.contains("patch 0001-upstream.patch: c.rs, hunk #1"), "{msg}");
    assert_eq!(fx.snapshot(), untouched);
    // Made after 0020, but it changes the line 0030 changes: 0030 would no longer apply.
    let (_r2, clash) = format_patch(&fx, "0020", &|d: &Path| {
        let c = fs::read_to_string(d.join("c.rs")).expect("read");
        fs::write(d.join("c.rs"), c.replace("c8\n", "c-eight\n")).expect("write");
    });
    let msg = format!("{:#}", anyhow::Error::from(import(&fx, &clash, "0020").expect_err("refused")));
    assert!(msg.contains("a later patch no longer applies; nothing was written") && msg.contains("patch 0030-c.patch: c.rs, hunk #1"), "{msg}");
    assert_eq!(fx.snapshot(), untouched);
    // No id between 0020 and 0021.
    let (_r3, fine) = format_patch(&fx, "0020", &edit_b8);
    import(&fx, &fine, "0020").expect("imports as 0021");
    let after_one = fx.snapshot();
    let (_r4, again) = format_patch(&fx, "0021", &|d: &Path| fs::write(d.join("new.txt"), "n\n").expect("write"));
    let err = patchchain::import::import(&fx.p, &NoExtension, &ImportOptions { file: &again, after: "0020", id: None, slug: Some("new"), area: "other", upstream_status: "Pending" }, &pb())
        .expect_err("no id fits");
    assert!(matches!(err, ImportError::NoFreeId { .. }), "{err}");
    assert_eq!(fx.snapshot(), after_one);
}

// Found by `cargo xtask fuzz --target registry_load` (fuzz/corpus/registry_load/del-in-title.toml):
// a title holding DEL (U+007F, written `\u007f`) loaded, but `render` wrote it raw, as JSON does,
// and TOML forbids a raw DEL in a basic string, so the next tool to read the registry failed.
#[test]
fn a_registry_string_holding_del_renders_escaped_and_loads_back() {
    let text = "[base]\nkind = \"dir\"\npath = \"up\\u007fstream\"\n\n[[patch]]\nid = \"0001\"\nfile = \"0001-x.patch\"\nsha256 = \"\"\ntitle = \"a\\u007ftitle\"\narea = \"other\"\nhooks = [\"h\\u007f\"]\nstatus = \"carried\"\nupstream = \"\"\nbump = \"reapply\"\ngates = [\"apply\"]\n";
    let reg = registry::parse(text).expect("the registry loads");
    assert_eq!(reg.patches[0].title, "a\u{7f}title");
    let rendered = registry::render(&reg);
    assert!(!rendered.contains('\u{7f}'), "DEL written raw:\n{rendered}");
    let again = registry::parse(&rendered).expect("the canonical rendering loads");
    assert_eq!(again, reg);
    assert_eq!(registry::render(&again), rendered);
}

// Found by `cargo xtask fuzz --target patch_parse` (fuzz/corpus/patch_parse/two-names-modify.patch):
// `diff --git a/run.sh b/other` with only mode lines parsed as a modification of two paths; the
// placer then created `other` and kept `run.sh`, which does not reverse-apply. git apply refuses it.
#[test]
fn a_modification_naming_two_paths_without_rename_headers_is_a_parse_error() {
    let p = b"diff --git a/run.sh b/other\nold mode 100644\nnew mode 100755\n";
    let err = patch::parse(p).expect_err("refused");
    assert!(matches!(err.kind, ParseErrorKind::Inconsistent(_)), "{err}");
    // With its rename headers it is a rename (and reverses).
    let renamed = b"diff --git a/run.sh b/other\nold mode 100644\nnew mode 100755\nrename from run.sh\nrename to other\n";
    let ps = patch::parse(renamed).expect("a rename parses");
    let base = one_file("run.sh", b"x\n");
    let mut t = base.clone();
    apply::apply(&mut t, &ps, "p").expect("applies");
    assert!(t.contains_key("other") && !t.contains_key("run.sh"));
    apply::unapply(&mut t, &ps, "p").expect("reverses");
    assert_eq!(t, base);
}

// Found by `cargo xtask fuzz --target patch_roundtrip`: the exporter took a hunk's header from
// the first and last diff ops, and similar's empty side of a Delete can point past the group's
// start, so `b a` -> `a a a` exported `@@ -1 +2,2 @@` over a body of -1,2 +1,3, which does not
// parse. Every pair of small files of two lines' kinds must export, parse and apply both ways.
#[test]
fn exported_hunk_headers_count_the_lines_of_their_bodies() {
    let mk = |len: u32, bits: u32| (0..len).map(|i| if bits >> i & 1 == 1 { "b\n" } else { "a\n" }).collect::<String>();
    for lo in 0..6u32 {
        for ln in 0..7u32 {
            for mo in 0..(1u32 << lo) {
                for mn in 0..(1u32 << ln) {
                    let (old, new) = (one_file("f", mk(lo, mo).as_bytes()), one_file("f", mk(ln, mn).as_bytes()));
                    if old == new {
                        continue;
                    }
                    let bytes = patchchain::export::diff_trees(&old, &new);
                    let ps = patch::parse(&bytes).unwrap_or_else(|e| panic!("{e}\n{}", String::from_utf8_lossy(&bytes)));
                    let mut t = old.clone();
                    apply::apply(&mut t, &ps, "p").unwrap_or_else(|e| panic!("{e}\n{}", String::from_utf8_lossy(&bytes)));
                    assert_eq!(t, new, "{}", String::from_utf8_lossy(&bytes));
                    apply::unapply(&mut t, &ps, "p").expect("reverses");
                    assert_eq!(t, old);
                }
            }
        }
    }
    // The case the fuzzer found, against git's own diff.
    let bytes = patchchain::export::diff_trees(&one_file("f", b"b\na\n"), &one_file("f", b"a\na\na\n"));
    assert!(String::from_utf8_lossy(&bytes).contains("@@ -1,2 +1,3 @@"), "{}", String::from_utf8_lossy(&bytes));
}

// Found by `cargo xtask fuzz --target patch_parse` (fuzz/corpus/patch_parse/hunk-new-start-off-by-one.patch):
// patch 0005 with one hunk's new start changed (`+140` -> `+139`) applied forward (placed by the old
// positions) but not in reverse (placed by the new ones). Headers that disagree are a parse error.
#[test]
fn a_hunk_whose_new_start_disagrees_with_the_hunks_before_it_is_a_parse_error() {
    let good = b"diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1,2 +1 @@\n-a\n b\n@@ -5,0 +5,1 @@\n+x\n";
    patch::parse(good).expect("consistent headers parse");
    for bad in [&b"diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1,2 +1 @@\n-a\n b\n@@ -5,0 +6,1 @@\n+x\n"[..], b"diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -3,2 +2,2 @@\n-a\n+b\n c\n"] {
        let err = patch::parse(bad).expect_err("refused");
        assert!(matches!(err.kind, ParseErrorKind::Inconsistent(_)), "{err}");
    }
}

// Found by `cargo xtask fuzz --target patch_parse` (in CI's first run on main): an `index` line
// whose old id was 40 characters but held a control byte was taken as an id; the new file applied
// forward, and reverse-applying it then compared the removed content against that "id" and failed.
// An object id is now 4 to 64 hex digits, or the patch does not parse.
#[test]
fn an_index_line_with_a_non_hex_object_id_is_a_parse_error() {
    let with = |ids: &str| format!("diff --git a/f b/f\nnew file mode 100644\nindex {ids}\n--- /dev/null\n+++ b/f\n@@ -0,0 +1 @@\n+x\n").into_bytes();
    patch::parse(&with("0000000..587be6b")).expect("abbreviated ids parse");
    patch::parse(&with("0000000000000000000000000000000000000000..587be6b6d4e4c8a0b5c9f1b0d2c4a6e8f0a1b2c3")).expect("full ids parse");
    for bad in ["00000000000\u{10}0000000000000000000000000000..587be6b", "0000000..58", "xyz0000..587be6b", "..587be6b"] {
        let err = patch::parse(&with(bad)).expect_err(bad);
        assert!(matches!(err.kind, ParseErrorKind::BadObjectId(_)), "{bad:?}: {err}");
    }
}

// Found by `cargo xtask fuzz --target patch_parse`: `new mode 100755` without an `old mode`
// line applied forward (the mode set) but reverse-applying kept 100755, so forward then reverse
// did not give back the tree. git always writes both lines; one alone is a parse error.
#[test]
fn a_mode_change_without_its_old_mode_is_a_parse_error() {
    let both = b"diff --git a/f b/f\nold mode 100644\nnew mode 100755\n";
    patch::parse(both).expect("a mode change parses");
    for bad in [&b"diff --git a/f b/f\nnew mode 100755\n"[..], b"diff --git a/f b/f\nold mode 100644\n", b"diff --git a/f b/f\nindex 1234567..89abcde\nnew mode 100755\n"] {
        let err = patch::parse(bad).expect_err("refused");
        assert!(matches!(err.kind, ParseErrorKind::Inconsistent(_)), "{err}");
    }
}

// Found by `cargo xtask fuzz --target patch_parse`: a created binary file whose `index` line gave
// a non-null old id (`0000…04000000`) applied forward, but deleting it again checked the removed
// content against that id and failed. The missing side of a creation or deletion must be null.
#[test]
fn a_created_or_deleted_file_with_a_non_null_missing_id_is_a_parse_error() {
    let create = |old: &str| format!("diff --git a/f b/f\nnew file mode 100644\nindex {old}..587be6b\n--- /dev/null\n+++ b/f\n@@ -0,0 +1 @@\n+x\n").into_bytes();
    let delete = |new: &str| format!("diff --git a/f b/f\ndeleted file mode 100644\nindex 587be6b..{new}\n--- a/f\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n").into_bytes();
    patch::parse(&create("0000000")).expect("null old id");
    patch::parse(&delete("0000000000000000000000000000000000000000")).expect("null new id");
    for bad in [create("0000000000000000000000000000000004000000"), delete("1234567")] {
        let err = patch::parse(&bad).expect_err("refused");
        assert!(matches!(err.kind, ParseErrorKind::Inconsistent(_)), "{err}");
    }
}

// Found by `cargo xtask fuzz --target patch_parse`: a binary modification whose preimage literal
// (empty) disagreed with the `index` line's old id applied forward (only the literal was
// compared) and failed in reverse (where the id was). Both directions now check the literal and
// the id (full or abbreviated, as git writes them).
#[test]
fn a_binary_patch_whose_literal_and_index_id_disagree_is_refused_both_ways() {
    // `git diff --binary --full-index` of an empty file becoming "\0x".
    let body = "GIT binary patch\nliteral 2\nJcmZRm0001b0C@la\n\nliteral 0\nHcmV?d00001\n\n";
    let good = format!("diff --git a/f b/f\nindex e69de29bb2d1d6434b8b29ae775ad8c2e48c5391..718882ce3e4b770a94fed2050e5fb06aac7af37d 100644\n{body}");
    let ps = patch::parse(good.as_bytes()).expect("parses");
    let t = one_file("f", b"");
    let mut t2 = t.clone();
    apply::apply(&mut t2, &ps, "p").expect("forward");
    assert_eq!(t2, one_file("f", b"\0x"));
    apply::unapply(&mut t2, &ps, "p").expect("reverse");
    assert_eq!(t2, t);
    // The same literals, but the old id names another blob ("x"), abbreviated as git may write it.
    let bad = format!("diff --git a/f b/f\nindex c1b0730..718882c 100644\n{body}");
    let ps = patch::parse(bad.as_bytes()).expect("parses");
    assert!(apply::plan(&t, &ps, false).is_err(), "forward refuses: the preimage is not the old id's blob");
    assert!(apply::plan(&one_file("f", b"\0x"), &ps, true).is_err(), "reverse refuses too");
}

// Found by `cargo xtask fuzz --target patch_parse`: `\ No newline at end of file` after a context
// line that an added line follows. Forward, the added line was glued onto the unterminated one
// ("tno newlineno newline either"), so the result no longer reverse-applied. Only the last line
// of each side may lack its newline.
#[test]
fn no_newline_at_end_of_file_on_a_line_that_is_not_last_is_a_parse_error() {
    let ok = b"diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n";
    patch::parse(ok).expect("the usual last-line change parses");
    let bad = b"diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1,2 +1,3 @@\n a\n b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n";
    let err = patch::parse(bad).expect_err("refused");
    assert!(matches!(err.kind, ParseErrorKind::BadHunkLine(_)), "{err}");
}

// Found by `cargo xtask fuzz --target patch_parse`: a patch ending in a bare `+` (no newline)
// "added" a line of zero bytes, so the created file was empty yet the hunk claimed one line, and
// deleting it again failed. A hunk line must hold content or its newline.
#[test]
fn a_hunk_line_with_neither_content_nor_newline_is_a_parse_error() {
    patch::parse(b"diff --git a/f b/f\nnew file mode 100644\n--- /dev/null\n+++ b/f\n@@ -0,0 +1 @@\n+\n").expect("an empty line with its newline parses");
    let err = patch::parse(b"diff --git a/f b/f\nnew file mode 100644\n--- /dev/null\n+++ b/f\n@@ -0,0 +1 @@\n+").expect_err("refused");
    assert!(matches!(err.kind, ParseErrorKind::BadHunkLine(_)), "{err}");
}

// Found by `cargo xtask fuzz --target patch_parse`: `copy from copy.txt` / `copy to copy.txt`
// applied forward as a no-op, but reversing a copy deletes its destination, so forward then
// reverse lost the file. git refuses it ("already exists in working directory"); so do we. A
// rename onto itself stays a no-op both ways, as in git.
#[test]
fn a_copy_onto_its_own_source_is_refused_as_git_refuses_it() {
    let t = one_file("copy.txt", b"a\nb\n");
    let copy = b"diff --git a/copy.txt b/copy.txt\nsimilarity index 100%\ncopy from copy.txt\ncopy to copy.txt\n";
    assert!(git_apply(&t, copy, false).is_none(), "git refuses the copy");
    assert_eq!(ours(&t, copy, false), Err(ApplyErrorKind::FileExists));
    let rename = b"diff --git a/copy.txt b/copy.txt\nsimilarity index 100%\nrename from copy.txt\nrename to copy.txt\n";
    assert_eq!(git_apply(&t, rename, false).as_ref(), Some(&t), "git takes the rename as a no-op");
    // A no-op both ways (so `apply` calls it ambiguous: applicable and already applied).
    let ps = patch::parse(rename).expect("parses");
    for reverse in [false, true] {
        let out = apply::plan(&t, &ps, reverse).expect("places");
        assert!(out.values().all(|e| e.as_ref().is_some_and(|e| e.data == b"a\nb\n")), "{out:?}");
    }
}

// Found by `cargo xtask fuzz --target patch_parse` (fuzz/corpus/patch_parse/binary-reverse-delta-disagrees.patch):
// a binary patch whose forward hunk is a literal and whose reverse hunk is a delta made for
// another file applied forward (only a literal opposite hunk was compared with the file) and then
// could not be reverse-applied. The opposite delta must now take the result back to the file, in
// either direction, or the patch is refused.
#[test]
fn a_binary_patch_whose_reverse_delta_does_not_undo_it_is_refused() {
    // "" -> "\0x" forward; the reverse hunk is a delta for a 302-byte source.
    let body = "GIT binary patch\nliteral 2\nJcmZRm0001b0C@la\n\ndelta 9\nQcmZ3-w1#Oy%EYu201}=A5&!@I\n\n";
    let text = format!("diff --git a/f b/f\nindex e69de29bb2d1d6434b8b29ae775ad8c2e48c5391..718882ce3e4b770a94fed2050e5fb06aac7af37d 100644\n{body}");
    let ps = patch::parse(text.as_bytes()).expect("parses");
    let err = apply::plan(&one_file("f", b""), &ps, false).expect_err("forward refuses");
    assert!(matches!(err.kind, ApplyErrorKind::BinaryInconsistent), "{err}");
}
