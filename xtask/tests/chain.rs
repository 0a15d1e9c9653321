//! Integration tests of the chain toolchain (one test binary for xtask).
//!
//! Each test builds a synthetic project in a temporary directory, with a `dir` base (or a `git`
//! base), makes patches the way a maintainer does (apply-chain, edit engine/upstream/, capture),
//! and checks the result with the same functions the CLI calls. Every patch we export is also
//! applied by libgit2 as an independent checker.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use patchchain::apply::ApplyErrorKind;
use patchchain::commands::{self, CaptureOptions, Refused};
use patchchain::tree::{self, Entry, Tree, MODE_EXEC, MODE_FILE};
use patchchain::verify::{self, Outcome};
use patchchain::{chain, Project};
use xtask::Tine;

mod support;
use support::*;

struct Fx {
    _dir: tempfile::TempDir,
    p: Project,
}

impl Fx {
    /// A project whose base is the directory `base/` holding `files`.
    fn new(files: &[(&str, &[u8], u32)]) -> Fx {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = Project::new(dir.path());
        for (path, data, mode) in files {
            write_file(&dir.path().join("base").join(path), data, *mode);
        }
        fs::create_dir_all(p.patches_dir()).expect("mkdir patches");
        write_file(&p.registry_path(), b"[base]\nkind = \"dir\"\npath = \"base\"\n", MODE_FILE);
        commands::bless(&p, &Tine, true, &pb()).expect("bless the new base");
        Fx { _dir: dir, p }
    }

    fn live(&self, path: &str) -> PathBuf {
        self.p.upstream_dir().join(path)
    }

    fn edit(&self, path: &str, data: &[u8]) {
        let mode = fs::metadata(self.live(path)).map(|m| if m.permissions().mode() & 0o111 != 0 { MODE_EXEC } else { MODE_FILE }).unwrap_or(MODE_FILE);
        write_file(&self.live(path), data, mode);
    }

    fn apply(&self, to: Option<&str>) -> anyhow::Result<()> {
        commands::apply_chain(&self.p, to, &pb())
    }

    fn capture(&self, name: &str) -> anyhow::Result<()> {
        commands::capture(&self.p, &Tine, &CaptureOptions { name, after: None, title: None, area: "other", upstream_status: "Pending" }, &pb())
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

/// The shapes a patch series must carry, each made by editing the live tree and capturing.
#[test]
fn every_patch_format_round_trips_through_capture_apply_unapply_and_libgit2() {
    let fx = Fx::new(&[
        ("src/lib.rs", b"fn a() {}\nfn b() {}\nfn c() {}\n", MODE_FILE),
        ("gone.txt", b"delete me\n", MODE_FILE),
        ("old/name.rs", b"pub const X: u8 = 1;\n", MODE_FILE),
        ("run.sh", b"#!/bin/sh\necho hi\n", MODE_FILE),
        ("blob.bin", &[0u8, 1, 2, 3, 255, 0, 7], MODE_FILE),
        ("win.txt", b"line one\r\nline two\r\nline three\r\n", MODE_FILE),
        ("tail.txt", b"no newline at the end", MODE_FILE),
        ("café/naïve file.txt", b"unicode\n", MODE_FILE),
    ]);
    fx.apply(None).expect("empty series applies");
    fx.assert_verified();

    // 0001: creation, deletion, rename, mode change, binary, CRLF, no final newline, non-ASCII path.
    fx.edit("src/new.rs", b"pub fn new() {}\n");
    fs::remove_file(fx.live("gone.txt")).expect("rm");
    fs::create_dir_all(fx.live("new")).expect("mkdir");
    fs::rename(fx.live("old/name.rs"), fx.live("new/name.rs")).expect("mv");
    fs::set_permissions(fx.live("run.sh"), fs::Permissions::from_mode(0o755)).expect("chmod");
    fx.edit("blob.bin", &[0u8, 1, 2, 3, 254, 0, 7, 9]);
    fx.edit("win.txt", b"line one\r\nline 2\r\nline three\r\n");
    fx.edit("tail.txt", b"still no newline, changed");
    fx.edit("café/naïve file.txt", b"unicode\n// tine-hook: cafe-hook\n");
    let before = fx.base_tree();
    fx.capture("0001-every-shape").expect("capture 0001");
    let after1 = fx.live_tree();
    let p1 = fx.patch_bytes("0001-every-shape.patch");
    let text = String::from_utf8_lossy(&p1);
    for needle in [
        "new file mode 100644",
        "deleted file mode 100644",
        "rename from old/name.rs",
        "old mode 100644\nnew mode 100755",
        "GIT binary patch",
        "line 2\r\n",
        "\\ No newline at end of file",
        "\"a/caf\\303\\251/na\\303\\257ve file.txt\"",
        "Tine-Hook: cafe-hook",
    ] {
        assert!(text.contains(needle), "patch lacks {needle:?}:\n{text}");
    }
    assert_eq!(git2_apply(&before, &p1), after1, "libgit2 disagrees with our placer on 0001");

    // 0002 and 0003 touch the same file and the same region as 0001 and each other.
    fx.edit("src/lib.rs", b"fn a() {}\nfn b() { /* 2 */ }\nfn c() {}\n");
    fx.capture("0002-same-region").expect("capture 0002");
    fx.edit("src/lib.rs", b"fn a() {}\nfn b() { /* 3 */ }\nfn c() {}\n");
    fx.edit("win.txt", b"line one\r\nline 3\r\nline three\r\n");
    fx.capture("0003-same-region-again").expect("capture 0003");
    let full = fx.live_tree();
    fx.assert_verified();

    // Reverse all the way, then forward again: both byte-exact.
    commands::unapply(&fx.p, Some("0000"), &pb()).expect("unapply to pristine");
    assert_eq!(tree::manifest_of(&fx.live_tree()), tree::manifest_of(&before));
    fx.apply(None).expect("reapply");
    assert_eq!(fx.live_tree(), full);
    assert_eq!(fx.live_tree()["run.sh"].mode, MODE_EXEC);
    assert_eq!(fx.live_tree()["tail.txt"].data, b"still no newline, changed");

    // Unapply to a middle patch, then apply --to the same point: same tree.
    commands::unapply(&fx.p, Some("0001"), &pb()).expect("unapply to 0001");
    assert_eq!(fx.live_tree(), after1);
}

#[test]
fn an_empty_series_verifies_and_applies_to_the_pristine_tree() {
    let fx = Fx::new(&[("a.txt", b"a\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.assert_verified();
    assert_eq!(tree::manifest_of(&fx.live_tree()), tree::manifest_of(&fx.base_tree()));
}

#[test]
fn export_is_deterministic() {
    let fx = Fx::new(&[("a.txt", b"1\n2\n3\n", MODE_FILE), ("b.bin", &[0, 1, 2], MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"1\ntwo\n3\n");
    fx.edit("b.bin", &[0, 9, 2]);
    fx.capture("0001-x").expect("capture");
    let first = fx.patch_bytes("0001-x.patch");
    commands::refresh(&fx.p, &Tine, "0001", &pb()).expect("refresh without edits");
    assert_eq!(fx.patch_bytes("0001-x.patch"), first, "refresh of an unchanged tree must give the same bytes");
}

#[test]
fn an_already_applied_patch_is_detected_and_named() {
    // The inserted line's whole context (`}` lines) repeats, so forward-first tools apply it twice.
    let braces = "}\n".repeat(12);
    let fx = Fx::new(&[("f.rs", braces.as_bytes(), MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("f.rs", format!("{}x\n{}", "}\n".repeat(4), "}\n".repeat(8)).as_bytes());
    fx.capture("0001-insert").expect("capture");
    let once = fx.live_tree();
    // A second copy of the same patch in the series: applying it on top must be refused by name.
    let bytes = fx.patch_bytes("0001-insert.patch");
    let mut t = once.clone();
    let parsed = patchchain::patch::parse(&bytes).expect("parses");
    let err = patchchain::apply::apply(&mut t, &parsed, "0002-insert-again.patch").expect_err("must be refused");
    assert_eq!(err.kind, ApplyErrorKind::AlreadyApplied);
    assert!(err.to_string().contains("patch 0002-insert-again.patch: f.rs: the patch is already applied"), "{err}");
    assert_eq!(t, once, "a refused patch changes nothing");
    // `git apply`, forward-first, does apply it a second time: the bug this check prevents.
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("f.rs"), &once["f.rs"].data).expect("write");
    fs::write(dir.path().join("p.patch"), &bytes).expect("write");
    let status = std::process::Command::new("git").args(["apply", "p.patch"]).current_dir(dir.path()).status().expect("git runs");
    assert!(status.success());
    let twice = fs::read_to_string(dir.path().join("f.rs")).expect("read");
    assert_eq!(twice.matches('x').count(), 2, "git apply duplicated the insertion:\n{twice}");
}

#[test]
fn offsets_and_fuzz_are_refused_naming_patch_file_and_hunk() {
    let fx = Fx::new(&[("f.txt", b"a\nb\nc\nd\ne\nf\ng\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("f.txt", b"a\nb\nc\nD\ne\nf\ng\n");
    fx.capture("0001-upper-d").expect("capture");
    let patch = fx.patch_bytes("0001-upper-d.patch");
    let parsed = patchchain::patch::parse(&patch).expect("parses");

    // The base gains a line at the top: the hunk would apply at offset +1.
    let mut shifted: Tree = [("f.txt".to_owned(), Entry::file(&b"0\na\nb\nc\nd\ne\nf\ng\n"[..]))].into();
    let err = patchchain::apply::apply(&mut shifted, &parsed, "0001-upper-d.patch").expect_err("offset refused");
    assert_eq!(err.to_string(), "patch 0001-upper-d.patch: f.txt, hunk #1 (patch line 9): the hunk would only apply at offset +1 (line 2, stated 1); offsets are refused on a pinned base");

    // A context line changed: it would apply only with fuzz.
    let mut fuzzy: Tree = [("f.txt".to_owned(), Entry::file(&b"a\nb\nc\nd\ne\nf\nG\n"[..]))].into();
    let err = patchchain::apply::apply(&mut fuzzy, &parsed, "0001-upper-d.patch").expect_err("fuzz refused");
    assert_eq!(err.to_string(), "patch 0001-upper-d.patch: f.txt, hunk #1 (patch line 9): the hunk would only apply with fuzz 1 (ignoring 1 context line(s)) at line 1; fuzz is refused");

    // Through verify, on a changed base: step 2 names the same thing.
    write_file(&fx.p.root.join("base/f.txt"), b"0\na\nb\nc\nd\ne\nf\ng\n", MODE_FILE);
    commands::bless(&fx.p, &Tine, true, &pb()).expect_err("bless reports that the chain no longer applies");
    let r = fx.verify();
    assert!(fail_text(&r, 2).contains("0001-upper-d.patch: f.txt, hunk #1"), "{}", r.render());
}

#[test]
fn verify_catches_a_corrupted_base_file() {
    let fx = Fx::new(&[("a.txt", b"a\n", MODE_FILE), ("b.txt", b"b\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    write_file(&fx.p.root.join("base/b.txt"), b"tampered\n", MODE_FILE);
    let r = fx.verify();
    let t = fail_text(&r, 1);
    assert!(t.contains("does not match upstream-sync/manifest.pristine") && t.contains("modified: b.txt"), "{t}");
}

#[test]
fn verify_catches_a_corrupted_patch() {
    let fx = Fx::new(&[("a.txt", b"1\n2\n3\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"1\nTWO\n3\n");
    fx.capture("0001-two").expect("capture");
    let path = fx.p.patches_dir().join("0001-two.patch");
    let text = String::from_utf8(fs::read(&path).expect("read")).expect("utf8");
    // A hunk header whose counts no longer match its body.
    fs::write(&path, text.replace("@@ -1,3 +1,3 @@", "@@ -1,4 +1,3 @@")).expect("write");
    let r = fx.verify();
    let t = fail_text(&r, 2);
    assert!(t.contains("patch 0001: patches/0001-two.patch is malformed") && t.contains("hunk body ends early"), "{t}");
    // sync-check sees the changed bytes too.
    let problems = patchchain::sync_check::sync_check(&fx.p, &Tine, &chain::load_registry(&fx.p).expect("registry")).join("\n");
    assert!(problems.contains("patches/0001-two.patch has sha256"), "{problems}");
}

#[test]
fn verify_catches_a_missing_patch_file() {
    let fx = Fx::new(&[("a.txt", b"1\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"2\n");
    fx.capture("0001-two").expect("capture");
    fs::remove_file(fx.p.patches_dir().join("0001-two.patch")).expect("rm");
    let t = fail_text(&fx.verify(), 2);
    assert!(t.contains("patch 0001: cannot read patches/0001-two.patch"), "{t}");
    let problems = patchchain::sync_check::sync_check(&fx.p, &Tine, &chain::load_registry(&fx.p).expect("registry")).join("\n");
    assert!(problems.contains("patch 0001: patches/0001-two.patch is missing"), "{problems}");
}

#[test]
fn verify_catches_a_drifted_tree_and_apply_refuses_to_lose_it() {
    let fx = Fx::new(&[("a.txt", b"1\n", MODE_FILE), ("b.txt", b"b\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"my uncommitted work\n");
    let t = fail_text(&fx.verify(), 5);
    assert!(t.contains("modified: a.txt") && t.contains("cargo xtask capture NNNN-slug"), "{t}");

    let err = fx.apply(None).expect_err("apply must refuse over edits");
    assert!(err.downcast_ref::<Refused>().is_some(), "{err:#}");
    let msg = format!("{err:#}");
    assert!(msg.contains("holds edits that no patch carries") && msg.contains("cargo xtask backup"), "{msg}");
    let err = commands::unapply(&fx.p, None, &pb()).expect_err("unapply must refuse over edits");
    assert!(err.downcast_ref::<Refused>().is_some());
    assert_eq!(fs::read(fx.live("a.txt")).expect("still there"), b"my uncommitted work\n");

    // backup keeps the work; restore brings it back after a clean re-apply.
    commands::backup(&fx.p, Some("wip")).expect("backup");
    let err = commands::restore(&fx.p, Some("wip"), &pb());
    assert!(err.is_ok(), "restoring the same tree over itself loses nothing: {err:?}");
    fs::remove_dir_all(fx.p.upstream_dir()).expect("rm");
    fx.apply(None).expect("fresh apply");
    commands::restore(&fx.p, Some("wip"), &pb()).expect("restore");
    assert_eq!(fs::read(fx.live("a.txt")).expect("restored"), b"my uncommitted work\n");
}

#[test]
fn apply_proceeds_over_edits_a_backup_holds_and_refuses_once_they_move_on() {
    let fx = Fx::new(&[("a.txt", b"1\n", MODE_FILE), ("b.txt", b"b\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"my uncommitted work\n");
    commands::backup(&fx.p, Some("wip")).expect("backup");
    // Edited again after the backup: the backup no longer holds the tree, so nothing may replace it.
    fx.edit("b.txt", b"more work\n");
    let err = fx.apply(None).expect_err("the second edit is in no backup");
    assert!(err.downcast_ref::<Refused>().is_some(), "{err:#}");
    assert_eq!(fs::read(fx.live("b.txt")).expect("still there"), b"more work\n");
    // Backed up as it stands: apply-chain may replace the tree (the message's advice works).
    commands::backup(&fx.p, Some("wip2")).expect("backup");
    fx.apply(None).expect("the edits are in backup wip2");
    assert_eq!(fs::read(fx.live("a.txt")).expect("re-applied"), b"1\n");
    commands::restore(&fx.p, Some("wip2"), &pb()).expect("restore");
    assert_eq!(fs::read(fx.live("a.txt")).expect("restored"), b"my uncommitted work\n");
    assert_eq!(fs::read(fx.live("b.txt")).expect("restored"), b"more work\n");
    // unapply too: the backed-up edits are not reversed through the patches, the prefix is rebuilt.
    commands::unapply(&fx.p, None, &pb()).expect("the edits are in backup wip2");
    assert_eq!(fs::read(fx.live("a.txt")).expect("pristine"), b"1\n");
}

#[test]
fn an_interrupted_apply_leaves_the_old_tree_intact() {
    let fx = Fx::new(&[("a.txt", b"1\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"2\n");
    fx.capture("0001-two").expect("capture");
    commands::unapply(&fx.p, None, &pb()).expect("back to pristine");
    let before = fx.live_tree();
    let state_before = fs::read(fx.live(tree::STATE_FILE)).expect("state");

    tree::interrupt_next_write_before_swap();
    let err = fx.apply(None).expect_err("interrupted");
    assert!(format!("{err:#}").contains("simulated interruption"), "{err:#}");
    assert_eq!(fx.live_tree(), before);
    assert_eq!(fs::read(fx.live(tree::STATE_FILE)).expect("state"), state_before);
    let leftovers: Vec<_> = fs::read_dir(fx.p.root.join("engine")).expect("ls").flatten().map(|e| e.file_name()).filter(|n| n != "upstream").collect();
    assert!(leftovers.is_empty(), "scratch left behind: {leftovers:?}");

    // A chain that fails half-way also leaves the old tree: 0002 does not apply.
    fx.apply(None).expect("applies");
    fs::write(fx.p.patches_dir().join("0002-bad.patch"), b"Subject: bad\nUpstream-Status: Pending\n---\ndiff --git a/a.txt b/a.txt\n--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-not there\n+x\n")
        .expect("write");
    let mut reg = chain::load_registry(&fx.p).expect("registry");
    let mut e = reg.patches[0].clone();
    e.id = "0002".into();
    e.file = "0002-bad.patch".into();
    e.hooks.clear();
    reg.patches.push(e);
    fs::write(fx.p.registry_path(), patchchain::registry::render(&reg)).expect("write registry");
    let full = fx.live_tree();
    let err = fx.apply(None).expect_err("0002 does not apply");
    assert!(err.to_string().contains("patch 0002-bad.patch: a.txt, hunk #1"), "{err}");
    assert_eq!(fx.live_tree(), full);
}

#[test]
fn refresh_regenerates_a_patch_and_names_later_patches_that_break() {
    let fx = Fx::new(&[("a.txt", b"1\n2\n3\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"1\ntwo\n3\n");
    fx.capture("0001-two").expect("capture 0001");
    fx.edit("a.txt", b"1\ntwo\nthree\n");
    fx.capture("0002-three").expect("capture 0002");
    fx.assert_verified();

    // refresh needs the tree applied up to exactly that patch.
    let err = commands::refresh(&fx.p, &Tine, "0001", &pb()).expect_err("the tree holds 0002");
    assert!(format!("{err:#}").contains("needs it applied up to 0001 exactly"), "{err:#}");

    // Refresh 0001 so that 0002's context (`two`) changes: 0002 must be named as broken.
    fx.apply(Some("0001")).expect("a clean tree can move to any prefix");
    fx.edit(
        "a.txt",
        b"1
TWO
3
",
    );
    let err = commands::refresh(&fx.p, &Tine, "0001", &pb()).expect_err("0002 no longer applies");
    let msg = format!("{err:#}");
    assert!(msg.contains("later patches no longer apply") && msg.contains("patch 0002-three.patch: a.txt, hunk #1"), "{msg}");
    let p1 = String::from_utf8(fx.patch_bytes("0001-two.patch")).expect("utf8");
    assert!(p1.contains("+TWO\n"), "0001 was refreshed:\n{p1}");
    assert!(p1.starts_with("Subject: [PATCH] two\n"), "the header is kept:\n{p1}");
    // The live tree is in step with the refreshed patch: no drift, and apply to 0001 is a no-op.
    fx.apply(Some("0001")).expect("no drift after refresh");
}

#[test]
fn capture_after_a_middle_patch_inserts_into_the_series() {
    let fx = Fx::new(&[("a.txt", b"1\n2\n3\n4\n5\n6\n7\n8\n9\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"one\n2\n3\n4\n5\n6\n7\n8\n9\n");
    fx.capture("0010-one").expect("capture 0010");
    fx.edit("a.txt", b"one\n2\n3\n4\n5\n6\n7\n8\nnine\n");
    fx.capture("0020-nine").expect("capture 0020");
    fx.apply(Some("0010")).expect("down to 0010");
    fx.edit("a.txt", b"one\n2\n3\n4\nfive\n6\n7\n8\n9\n");
    let opts = CaptureOptions { name: "0030-five", after: Some("0010"), title: None, area: "other", upstream_status: "Pending" };
    let err = commands::capture(&fx.p, &Tine, &opts, &pb()).expect_err("0030 cannot sit between 0010 and 0020");
    assert!(format!("{err:#}").contains("pick an id in between"), "{err:#}");
    let opts = CaptureOptions { name: "0015-five", after: Some("0010"), title: Some("five"), area: "other", upstream_status: "Pending" };
    commands::capture(&fx.p, &Tine, &opts, &pb()).expect("capture 0015 after 0010");
    let reg = chain::load_registry(&fx.p).expect("registry");
    let ids: Vec<&str> = reg.patches.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["0010", "0015", "0020"]);
    fx.apply(None).expect("the whole chain applies");
    assert_eq!(fs::read(fx.live("a.txt")).expect("read"), b"one\n2\n3\n4\nfive\n6\n7\n8\nnine\n");
    fx.assert_verified();
}

#[test]
fn hooks_must_appear_with_their_patch_and_not_before() {
    let fx = Fx::new(&[("a.rs", b"fn a() {}\n// tine-hook: early\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.rs", b"fn a() {}\n// tine-hook: early\n// tine-hook: mine\n");
    fx.capture("0001-mine").expect("capture");
    let r = fx.verify();
    // `early` is in the base but declared by no patch.
    assert!(fail_text(&r, 6).contains("marker `tine-hook: early` in a.rs is declared by no patch"), "{}", r.render());
    // Declare `early` on 0001 as well: now it is present before its patch.
    let mut reg = chain::load_registry(&fx.p).expect("registry");
    reg.patches[0].hooks.push("early".into());
    fs::write(fx.p.registry_path(), patchchain::registry::render(&reg)).expect("write");
    let t = fail_text(&fx.verify(), 6);
    assert!(t.contains("patch 0001: hook \"early\" is already marked before the patch applies"), "{t}");
    // Declare a hook whose marker is nowhere.
    reg.patches[0].hooks = vec!["mine".into(), "absent".into()];
    fs::write(fx.p.registry_path(), patchchain::registry::render(&reg)).expect("write");
    let t = fail_text(&fx.verify(), 6);
    assert!(t.contains("patch 0001: hook \"absent\" is declared but no `tine-hook: absent` marker"), "{t}");
}

#[test]
fn sync_check_catches_an_unlisted_patch_bad_trailers_and_stale_docs() {
    let fx = Fx::new(&[("a.txt", b"1\n", MODE_FILE)]);
    fx.apply(None).expect("applies");
    fx.edit("a.txt", b"2\n// tine-hook: h1\n");
    fx.capture("0001-two").expect("capture");
    let check = || patchchain::sync_check::sync_check(&fx.p, &Tine, &chain::load_registry(&fx.p).expect("registry")).join("\n");
    assert_eq!(check(), "");
    fs::write(fx.p.patches_dir().join("0002-stray.patch"), b"").expect("write");
    fs::write(fx.p.sync_doc_path(), b"stale").expect("write");
    let mut reg = chain::load_registry(&fx.p).expect("registry");
    reg.patches[0].hooks = vec!["h2".into()];
    reg.patches[0].gates = vec!["accept:draft-mtp:0.5".into(), "logit-equiv:warp".into()];
    fs::write(fx.p.registry_path(), patchchain::registry::render(&reg)).expect("write");
    let got = check();
    let expect = [
        "patch 0001: gate \"accept:draft-mtp:0.5\" needs the engine crates, but the registry has no [engine] builds_from",
        "patch 0001: unknown spec type \"warp\" in gate \"logit-equiv:warp\" (known: draft-mtp, draft-assistant, draft, ngram)",
        "patches/0002-stray.patch has no registry entry (add a [[patch]] to upstream-sync/UPSTREAM_SYNC.toml or delete it)",
        "patch 0001: Tine-Hook trailers {\"h1\"} differ from the registry's hooks {\"h2\"}",
        "docs/UPSTREAM_SYNC.md is stale: run `cargo xtask bless` and commit",
    ]
    .join("\n");
    assert_eq!(got, expect);
}

#[test]
fn a_git_base_at_a_pinned_commit_works_like_the_others() {
    let src = tempfile::tempdir().expect("tempdir");
    let repo = git2::Repository::init(src.path()).expect("init");
    write_file(&src.path().join("keep/a.txt"), b"1\n2\n", MODE_FILE);
    write_file(&src.path().join("keep/tool.sh"), b"#!/bin/sh\n", MODE_EXEC);
    write_file(&src.path().join("skip/b.txt"), b"not in the base\n", MODE_FILE);
    let mut index = repo.index().expect("index");
    index.add_all(["*"], git2::IndexAddOption::DEFAULT, None).expect("add");
    index.write().expect("write index");
    let tree_id = index.write_tree().expect("tree");
    let sig = git2::Signature::new("t", "t@example.invalid", &git2::Time::new(0, 0)).expect("sig");
    let commit = repo.commit(Some("HEAD"), &sig, &sig, "base", &repo.find_tree(tree_id).expect("tree"), &[]).expect("commit");

    let dir = tempfile::tempdir().expect("tempdir");
    let p = Project::new(dir.path());
    fs::create_dir_all(p.patches_dir()).expect("mkdir");
    let reg = format!("[base]\nkind = \"git\"\nurl = {:?}\ncommit = \"{commit}\"\ninclude = [\"keep\"]\n", src.path().to_str().expect("utf8"));
    write_file(&p.registry_path(), reg.as_bytes(), MODE_FILE);
    commands::bless(&p, &Tine, true, &pb()).expect("bless");
    commands::apply_chain(&p, None, &pb()).expect("apply");
    let live = tree::read_tree(&p.upstream_dir()).expect("live");
    assert_eq!(live.keys().cloned().collect::<Vec<_>>(), ["keep/a.txt", "keep/tool.sh"]);
    assert_eq!(live["keep/tool.sh"].mode, MODE_EXEC);
    write_file(&p.upstream_dir().join("keep/a.txt"), b"1\ntwo\n", MODE_FILE);
    commands::capture(&p, &Tine, &CaptureOptions { name: "0001-two", after: None, title: None, area: "other", upstream_status: "Pending" }, &pb()).expect("capture");
    let r = verify::verify(&p, &pb()).expect("verify");
    assert!(r.passed(), "{}", r.render());
    // Later commits in the source repository do not move the base.
    write_file(&src.path().join("keep/a.txt"), b"moved on\n", MODE_FILE);
    assert!(verify::verify(&p, &pb()).expect("verify").passed());
}

/// The real thing: the pinned candle base with Tine's whole chain.
#[test]
fn full_verify_on_the_real_pinned_base() {
    let p = xtask::project();
    let r = verify::verify(&p, &pb()).expect("verify runs on the real base");
    for n in [1, 2, 3, 4, 6] {
        assert!(matches!(step(&r, n), Outcome::Pass(_)), "step {n}:\n{}", r.render());
    }
    if p.upstream_dir().exists() {
        assert!(r.passed(), "{}", r.render());
    } else {
        assert!(fail_text(&r, 7).contains("run `cargo xtask apply-chain`"));
    }
}

// ---- Gates: the catalogue, and the real chain's suites catching a reverted patch ----

#[test]
fn gate_names_parse_into_the_catalogue_or_say_what_is_wrong() {
    use xtask::gate::Gate;
    let cases: &[(&str, &str)] = &[
        ("apply", "Apply"),
        ("test:-p tine-patch-tests --test kv_cache_truncate", "Test { args: [\"-p\", \"tine-patch-tests\", \"--test\", \"kv_cache_truncate\"] }"),
        ("accept:ngram:0.6", "Accept { spec: \"ngram\", min: 0.6 }"),
        ("tps-ratio:ngram@3/plain:1.3", "TpsRatio { a: Config { spec: Some(\"ngram\"), depth: 3 }, b: Config { spec: None, depth: 0 }, min: 1.3 }"),
        ("tps-ratio:ngram/plain:1.3", "error: gate \"tps-ratio:ngram/plain:1.3\": configuration \"ngram\" must be `plain` or `<spec-type>@<depth>`"),
        ("greedy-identical:eagle", "error: unknown spec type \"eagle\" in gate \"greedy-identical:eagle\" (known: draft-mtp, draft-assistant, draft, ngram)"),
        ("accept:ngram", "error: gate \"accept:ngram\": expected accept:<spec-type>:<min>"),
        ("test:", "error: unknown gate \"test:\" (known: apply, test:<cargo test arguments>, greedy-identical:<spec-type>, logit-equiv:<spec-type>, accept:<spec-type>:<min>, tps-ratio:<A>/<B>:<min>, tokenizer:<corpus>)"),
    ];
    for (name, want) in cases {
        let got = match Gate::parse(name) {
            Ok(g) => format!("{g:?}"),
            Err(e) => format!("error: {e}"),
        };
        assert_eq!(&got, want, "{name}");
    }
    let engine = |s: &str| Gate::parse(s).expect("valid").needs_engine();
    assert!(!engine("test:-p tine-patch-tests --test x") && engine("test:-p tine-runtime --test runtime") && engine("logit-equiv:draft") && !engine("apply"));
}

#[test]
fn a_failed_cargo_run_is_reduced_to_its_first_error_or_panic() {
    use xtask::gate::failure_reason;
    let compile =
        "   Compiling candle-nn\nerror[E0599]: no method named `truncate` found for struct `KvCache` in the current scope\n  --> ../../upstream/candle-nn/tests/kv_cache_truncate.rs:12:8\n   |\n";
    assert_eq!(
        failure_reason(compile),
        "does not compile against this tree: error[E0599]: no method named `truncate` found for struct `KvCache` in the current scope (../../upstream/candle-nn/tests/kv_cache_truncate.rs:12:8)"
    );
    let panic = "running 1 test\n\nthread 'decoding_matches' (77) panicked at tests/x.rs:15:9:\nposition 0: max |logit diff| 0.4 >= 0.002\nnote: run with `RUST_BACKTRACE=1`\n";
    assert_eq!(failure_reason(panic), "test `decoding_matches` failed: position 0: max |logit diff| 0.4 >= 0.002");
}

/// Gates the real chain's patch `id` (needs the base in the cache: `cargo xtask ci` fetches it).
fn gate_real(id: &str, revert: bool) -> Vec<xtask::gate::Outcome> {
    let p = xtask::project();
    let l = chain::load_all(&p, &pb()).expect("the real base and series load");
    let i = l.patches.iter().position(|x| x.entry.id == id).expect("patch in the series");
    xtask::gate::run_patch(&p, &l, i, &xtask::gate::Options { revert }, &pb()).expect("the gate runs")
}

#[test]
fn the_real_gates_pass_and_catch_reverted_patches_0001_and_0002() {
    // One test, in series: the gates share target/gates/ (one scratch workspace).
    let passed = gate_real("0002", false);
    assert!(passed.iter().all(|o| o.passed), "{passed:#?}");
    // 0001 without its source changes: its test calls an API that is gone.
    let reverted = gate_real("0001", true);
    let test = reverted.iter().find(|o| o.gate.starts_with("test:")).expect("a test gate");
    assert!(!test.passed && test.reason.contains("does not compile against this tree") && test.reason.contains("truncate"), "{test:#?}");
    // 0002 without its fix: the forward no longer matches the float64 reference.
    let reverted = gate_real("0002", true);
    let test = reverted.iter().find(|o| o.gate.starts_with("test:")).expect("a test gate");
    assert!(!test.passed && test.reason.contains("max |logit diff|"), "{test:#?}");
}

/// Issue 30: the crate's modules read one another one way (no import circles). The checker is
/// tine-test-support's, shared with tine-runtime's test (xtask builds before the engine, so it
/// includes the file rather than depending on the crate).
#[path = "../../engine/crates/tine-test-support/src/module_graph.rs"]
mod module_graph;

#[test]
fn the_crates_modules_import_one_way_without_circles() {
    module_graph::assert_one_way(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
}

/// Issue 30: ARCHITECTURE.md's code map names paths that exist: every backticked path from the
/// project root (`engine/crates/...`, `xtask/src/...`) must be there.
#[test]
fn architecture_md_names_only_paths_that_exist() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask/ lies in the project root");
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md reads");
    let mut checked = 0;
    let mut missing = Vec::new();
    for (i, token) in text.split('`').enumerate() {
        // Odd pieces are inside backticks.
        if i % 2 == 0 || token.contains(char::is_whitespace) || token.contains("://") || token.starts_with("--") {
            continue;
        }
        // A path from the root: its first component is one of the root's directories (`K/V`
        // or `-ctk/-ctv` are not paths). engine/upstream/ is generated: only it is named.
        let Some((first, _)) = token.split_once('/') else { continue };
        if first.is_empty() || !root.join(first).is_dir() || (token.starts_with("engine/upstream/") && token != "engine/upstream/") {
            continue;
        }
        checked += 1;
        if !root.join(token.trim_end_matches('/')).exists() {
            missing.push(token.to_string());
        }
    }
    assert!(checked >= 10, "only {checked} paths found in ARCHITECTURE.md: the check reads nothing");
    assert!(missing.is_empty(), "ARCHITECTURE.md names paths that do not exist: {missing:?}");
}
