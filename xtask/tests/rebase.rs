//! `rebase --onto`: synthetic projects for every verdict and hunk class, the real run's stop,
//! `--continue` and `--abort`, kill -9 at every journal point, and a cross-check against
//! git's own three-way rebase on a repository that has every blob.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use patchchain::commands::{self, CaptureOptions};
use patchchain::rebase::{self, Class, ContinueOptions, Outcome, Report, Verdict};
use patchchain::registry::{self, Base};
use patchchain::tree::{self, Tree, MODE_EXEC, MODE_FILE};
use patchchain::Project;
use patchchain::{sync_check, verify};
use xtask::Tine;

mod support;
use support::*;

fn no_extra(_: &Project, _: &registry::Registry, _: &registry::Registry, _: &[patchchain::chain::LoadedPatch]) -> rebase::ExtraFilesResult {
    Ok(Vec::new())
}

struct Fx {
    _dir: tempfile::TempDir,
    p: Project,
}

/// A file change: `None` deletes.
type Edit<'a> = (&'a str, Option<&'a [u8]>);

impl Fx {
    fn new(files: &[(&str, &[u8])]) -> Fx {
        let (dir, p) = support::dir_base_project(files);
        Fx { _dir: dir, p }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.p.root.join(rel)
    }

    /// Edits the live tree on top of the chain and captures the edits as patch `name`.
    fn patch(&self, name: &str, edits: &[Edit<'_>]) {
        commands::apply_chain(&self.p, None, &pb()).expect("apply the chain");
        for (path, data) in edits {
            let full = self.p.upstream_dir().join(path);
            match data {
                Some(d) => {
                    let mode = fs::metadata(&full).map(|m| if m.permissions().mode() & 0o111 != 0 { MODE_EXEC } else { MODE_FILE }).unwrap_or(MODE_FILE);
                    write_file(&full, d, mode);
                }
                None => fs::remove_file(&full).expect("rm"),
            }
        }
        commands::capture(&self.p, &Tine, &CaptureOptions { name, after: None, title: None, area: "other", upstream_status: "Pending" }, &pb()).expect("capture");
    }

    fn chmod(&self, rel: &str, mode: u32) {
        fs::set_permissions(self.path(rel), fs::Permissions::from_mode(mode)).expect("chmod");
    }

    /// `base2/` = `base/` with `edits`: the new upstream release.
    fn onto(&self, edits: &[Edit<'_>]) -> Base {
        let base = tree::read_tree(&self.path("base")).expect("base");
        let dir = self.path("base2");
        let _ = fs::remove_dir_all(&dir);
        for (p, e) in &base {
            write_file(&dir.join(p), &e.data, e.mode);
        }
        for (path, data) in edits {
            match data {
                Some(d) => write_file(&dir.join(path), d, MODE_FILE),
                None => fs::remove_file(dir.join(path)).expect("rm"),
            }
        }
        Base::Dir { path: "base2".into() }
    }

    fn inputs(&self, onto: &Base) -> rebase::Inputs {
        rebase::load_inputs(&self.p, onto.clone(), &pb()).expect("inputs load")
    }

    fn dry(&self, onto: &Base) -> Report {
        rebase::dry_run(&self.inputs(onto)).expect("dry run")
    }

    fn run(&self, onto: &Base) -> Outcome {
        rebase::start(&self.p, &self.inputs(onto), &[], &no_extra, &pb()).expect("rebase starts")
    }

    fn cont(&self, retire: bool) -> anyhow::Result<Outcome> {
        rebase::continue_run(&self.p, &ContinueOptions { retire, accept: Vec::new() }, &no_extra, &pb())
    }

    fn set_entry(&self, id: &str, f: impl Fn(&mut registry::PatchEntry)) {
        let mut reg = registry::load(&self.p.registry_path()).expect("registry");
        f(reg.patches.iter_mut().find(|e| e.id == id).expect("entry"));
        fs::write(self.p.registry_path(), registry::render(&reg)).expect("write registry");
        commands::bless(&self.p, &Tine, false, &pb()).expect("bless");
    }

    fn live(&self) -> Tree {
        tree::read_tree(&self.p.upstream_dir()).expect("live")
    }

    fn live_file(&self, rel: &str) -> String {
        String::from_utf8(fs::read(self.p.upstream_dir().join(rel)).expect("live file")).expect("utf8")
    }

    /// Every file of the project (engine/upstream/ and its state file included), for byte comparisons.
    fn snapshot(&self) -> BTreeMap<String, Vec<u8>> {
        let mut out = BTreeMap::new();
        for (p, e) in tree::read_tree(&self.p.root).expect("project") {
            out.insert(p, e.data);
        }
        if let Ok(s) = fs::read(self.p.upstream_dir().join(tree::STATE_FILE)) {
            out.insert(format!("engine/upstream/{}", tree::STATE_FILE), s);
        }
        out
    }

    fn assert_sound(&self) {
        let r = verify::verify(&self.p, &pb()).expect("verify runs");
        assert!(r.passed(), "verify after the bump:\n{}", r.render());
        let problems = sync_check::sync_check(&self.p, &Tine, &registry::load(&self.p.registry_path()).expect("registry"));
        assert!(problems.is_empty(), "sync-check after the bump: {problems:?}");
    }
}

fn hunk<'a>(r: &'a Report, id: &str, file: &str, n: usize) -> &'a rebase::HunkReport {
    let p = r.patches.iter().find(|p| p.id == id).unwrap_or_else(|| panic!("no patch {id} in\n{}", rebase::render_table(r)));
    p.hunks.iter().find(|h| h.file == file && h.hunk == n).unwrap_or_else(|| panic!("no hunk {file}#{n} of {id} in\n{}", rebase::render_table(r)))
}

fn verdict(r: &Report, id: &str) -> Verdict {
    r.patches.iter().find(|p| p.id == id).expect("patch").verdict
}

fn done(o: Outcome) -> Report {
    match o {
        Outcome::Done(r) => r,
        Outcome::Stopped(r, msg) => panic!("the run stopped: {msg}\n{}", rebase::render_table(&r)),
    }
}

fn stopped(o: Outcome) -> (Report, String) {
    match o {
        Outcome::Stopped(r, msg) => (r, msg),
        Outcome::Done(r) => panic!("the run should have stopped:\n{}", rebase::render_table(&r)),
    }
}

#[test]
fn an_upstream_insertion_above_gives_an_offset_and_the_carried_patch_applies_strictly() {
    let f = numbered("line ", 20);
    let fx = Fx::new(&[("f.txt", f.as_bytes())]);
    fx.patch("0001-change", &[("f.txt", Some(set_line(&f, 10, "LINE TEN").as_bytes()))]);
    let up = format!("{}{f}", numbered("new ", 5));
    let onto = fx.onto(&[("f.txt", Some(up.as_bytes()))]);
    let r = fx.dry(&onto);
    let h = hunk(&r, "0001", "f.txt", 1);
    assert_eq!((h.class, h.offset, h.old_line, h.new_line), (Class::Offset, Some(5), 7, Some(12)));
    assert_eq!(verdict(&r, "0001"), Verdict::Rebased);
    done(fx.run(&onto));
    assert_eq!(fx.live_file("f.txt"), set_line(&up, 15, "LINE TEN"));
    fx.assert_sound();
}

#[test]
fn an_unchanged_file_is_exact_and_the_patch_bytes_are_kept() {
    let fx = Fx::new(&[("a.txt", b"a\nb\nc\n"), ("other.txt", b"x\n")]);
    fx.patch("0001-a", &[("a.txt", Some(b"a\nB\nc\n"))]);
    let before = fs::read(fx.p.patches_dir().join("0001-a.patch")).expect("patch");
    let onto = fx.onto(&[("other.txt", Some(b"y\n"))]);
    let r = fx.dry(&onto);
    assert_eq!((verdict(&r, "0001"), r.patches[0].action.as_str()), (Verdict::Exact, "keep"));
    done(fx.run(&onto));
    assert_eq!(fs::read(fx.p.patches_dir().join("0001-a.patch")).expect("patch"), before);
    fx.assert_sound();
}

#[test]
fn a_changed_context_line_merges_instead_of_failing() {
    let f = numbered("line ", 20);
    let fx = Fx::new(&[("f.txt", f.as_bytes())]);
    fx.patch("0001-change", &[("f.txt", Some(set_line(&f, 10, "LINE TEN").as_bytes()))]);
    let onto = fx.onto(&[("f.txt", Some(set_line(&f, 9, "upstream nine").as_bytes()))]);
    let r = fx.dry(&onto);
    assert_eq!(hunk(&r, "0001", "f.txt", 1).class, Class::Merged);
    assert_eq!(verdict(&r, "0001"), Verdict::Rebased);
    done(fx.run(&onto));
    assert_eq!(fx.live_file("f.txt"), set_line(&set_line(&f, 9, "upstream nine"), 10, "LINE TEN"));
    fx.assert_sound();
}

#[test]
fn an_overlapping_change_is_a_conflict_with_its_reason() {
    let f = numbered("line ", 20);
    let fx = Fx::new(&[("f.txt", f.as_bytes())]);
    fx.patch("0001-change", &[("f.txt", Some(set_line(&f, 10, "ours").as_bytes()))]);
    let onto = fx.onto(&[("f.txt", Some(set_line(&f, 10, "theirs").as_bytes()))]);
    let r = fx.dry(&onto);
    let h = hunk(&r, "0001", "f.txt", 1);
    assert_eq!(h.class, Class::Conflict);
    assert!(h.reason.as_deref().unwrap_or("").contains("overlapping change"), "{h:?}");
    assert_eq!(verdict(&r, "0001"), Verdict::Conflict);
}

#[test]
fn modify_delete_conflicts_either_way() {
    let fx = Fx::new(&[("mod.txt", b"1\n2\n3\n"), ("del.txt", b"x\ny\n")]);
    fx.patch("0001-both", &[("mod.txt", Some(b"1\nTWO\n3\n")), ("del.txt", None)]);
    let onto = fx.onto(&[("mod.txt", None), ("del.txt", Some(b"x\nY upstream\n"))]);
    let r = fx.dry(&onto);
    for file in ["mod.txt", "del.txt"] {
        let h = hunk(&r, "0001", file, 1);
        assert_eq!(h.class, Class::Conflict, "{file}");
        assert!(h.reason.as_deref().unwrap_or("").starts_with("modify/delete"), "{h:?}");
    }
}

#[test]
fn add_add_conflicts_unless_upstream_added_the_same_file() {
    let fx = Fx::new(&[("keep.txt", b"k\n")]);
    fx.patch("0001-new", &[("new.rs", Some(b"pub fn ours() {}\n"))]);
    let r = fx.dry(&fx.onto(&[("new.rs", Some(b"pub fn theirs() {}\n"))]));
    let h = hunk(&r, "0001", "new.rs", 1);
    assert_eq!(h.class, Class::Conflict);
    assert!(h.reason.as_deref().unwrap_or("").starts_with("add/add"), "{h:?}");
    let r = fx.dry(&fx.onto(&[("new.rs", Some(b"pub fn ours() {}\n"))]));
    assert_eq!(verdict(&r, "0001"), Verdict::Upstream);
}

#[test]
fn a_file_renamed_upstream_carries_the_hunk_to_its_new_name() {
    let src = numbered("fn f", 30);
    let fx = Fx::new(&[("src/old_name.rs", src.as_bytes())]);
    fx.patch("0001-edit", &[("src/old_name.rs", Some(set_line(&src, 15, "fn patched()").as_bytes()))]);
    let moved = set_line(&src, 2, "fn upstream_edit()");
    let onto = fx.onto(&[("src/old_name.rs", None), ("src/new_name.rs", Some(moved.as_bytes()))]);
    let r = fx.dry(&onto);
    let h = hunk(&r, "0001", "src/new_name.rs", 1);
    assert_eq!((h.class, h.renamed_from.as_deref()), (Class::Exact, Some("src/old_name.rs")));
    done(fx.run(&onto));
    assert!(!fx.live().contains_key("src/old_name.rs"));
    assert_eq!(fx.live_file("src/new_name.rs"), set_line(&moved, 15, "fn patched()"));
    let text = String::from_utf8(fs::read(fx.p.patches_dir().join("0001-edit.patch")).expect("patch")).expect("utf8");
    assert!(text.contains("--- a/src/new_name.rs"), "{text}");
    fx.assert_sound();
}

#[test]
fn crlf_lines_and_a_missing_final_newline_survive_the_merge() {
    let win = "one\r\ntwo\r\nthree\r\nfour\r\nfive\r\nsix\r\nseven\r\neight\r\n";
    let tail = "a\nb\nc\nd\ne\nf\ng\nlast line without newline";
    let fx = Fx::new(&[("win.txt", win.as_bytes()), ("tail.txt", tail.as_bytes())]);
    fx.patch("0001-eol", &[("win.txt", Some(win.replace("seven\r\n", "SEVEN\r\n").as_bytes())), ("tail.txt", Some(tail.replace("without", "still without").as_bytes()))]);
    let win_up = win.replace("one\r\n", "ONE upstream\r\n");
    let tail_up = tail.replace("a\n", "upstream a\n");
    let onto = fx.onto(&[("win.txt", Some(win_up.as_bytes())), ("tail.txt", Some(tail_up.as_bytes()))]);
    let r = fx.dry(&onto);
    assert_eq!(verdict(&r, "0001"), Verdict::Exact, "{}", rebase::render_table(&r));
    done(fx.run(&onto));
    assert_eq!(fx.live_file("win.txt"), win_up.replace("seven\r\n", "SEVEN\r\n"));
    assert_eq!(fx.live_file("tail.txt"), tail_up.replace("without", "still without"));
    fx.assert_sound();
}

#[test]
fn binary_files_carry_when_upstream_left_them_and_conflict_when_both_changed() {
    let blob: &[u8] = &[0, 1, 2, 3, 4, 0, 255];
    let fx = Fx::new(&[("blob.bin", blob), ("t.txt", b"t\n")]);
    fx.patch("0001-bin", &[("blob.bin", Some(&[0, 1, 2, 3, 5, 0, 255]))]);
    assert_eq!(verdict(&fx.dry(&fx.onto(&[("t.txt", Some(b"u\n"))])), "0001"), Verdict::Exact);
    assert_eq!(verdict(&fx.dry(&fx.onto(&[("blob.bin", Some(&[0, 1, 2, 3, 5, 0, 255]))])), "0001"), Verdict::Upstream);
    let r = fx.dry(&fx.onto(&[("blob.bin", Some(&[9, 0, 9]))]));
    let h = hunk(&r, "0001", "blob.bin", 1);
    assert_eq!(h.class, Class::Conflict);
    assert!(h.reason.as_deref().unwrap_or("").starts_with("binary"), "{h:?}");
}

#[test]
fn a_mode_change_survives_an_upstream_content_change() {
    let fx = Fx::new(&[("run.sh", b"#!/bin/sh\necho 1\n")]);
    commands::apply_chain(&fx.p, None, &pb()).expect("apply");
    fx.chmod("engine/upstream/run.sh", 0o755);
    commands::capture(&fx.p, &Tine, &CaptureOptions { name: "0001-exec", after: None, title: None, area: "other", upstream_status: "Pending" }, &pb()).expect("capture");
    let onto = fx.onto(&[("run.sh", Some(b"#!/bin/sh\necho 2\n"))]);
    let r = fx.dry(&onto);
    assert_eq!(verdict(&r, "0001"), Verdict::Rebased, "{}", rebase::render_table(&r));
    done(fx.run(&onto));
    assert_eq!(fx.live()["run.sh"].mode, MODE_EXEC);
    assert_eq!(fx.live_file("run.sh"), "#!/bin/sh\necho 2\n");
    fx.assert_sound();
}

#[test]
fn a_later_patch_that_edits_lines_an_earlier_one_added_follows_it() {
    let f = numbered("line ", 12);
    let fx = Fx::new(&[("f.txt", f.as_bytes())]);
    let with_added = f.replace("line 6\n", "line 6\nadded a\nadded b\n");
    fx.patch("0001-add", &[("f.txt", Some(with_added.as_bytes()))]);
    fx.patch("0002-edit-added", &[("f.txt", Some(with_added.replace("added b\n", "added B (by 0002)\n").as_bytes()))]);
    let up = format!("header 1\nheader 2\n{f}");
    let onto = fx.onto(&[("f.txt", Some(up.as_bytes()))]);
    let r = fx.dry(&onto);
    assert_eq!((hunk(&r, "0001", "f.txt", 1).offset, hunk(&r, "0002", "f.txt", 1).offset), (Some(2), Some(2)));
    done(fx.run(&onto));
    assert_eq!(fx.live_file("f.txt"), up.replace("line 6\n", "line 6\nadded a\nadded B (by 0002)\n"));
    fx.assert_sound();
}

#[test]
fn a_context_that_repeats_after_the_bump_does_not_pull_the_hunk_into_the_copy() {
    let f = numbered("line ", 60);
    let fx = Fx::new(&[("f.txt", f.as_bytes())]);
    fx.patch("0001-change", &[("f.txt", Some(set_line(&f, 50, "PATCHED 50").as_bytes()))]);
    // Upstream pastes a copy of the hunk's whole before-image (lines 47-53) three lines above it.
    let lines: Vec<&str> = f.lines().collect();
    let copy: String = lines[46..53].iter().map(|l| format!("{l}\n")).collect();
    let up: String = lines[..43].iter().map(|l| format!("{l}\n")).collect::<String>() + &copy + &lines[43..].iter().map(|l| format!("{l}\n")).collect::<String>();
    // A context-searching placer (quilt, `patch -F`) would pick the nearer copy.
    let ps = patchchain::patch::parse(&fs::read(fx.p.patches_dir().join("0001-change.patch")).expect("patch")).expect("parses");
    let patchchain::patch::Content::Text(hunks) = &ps.files[0].content else { panic!("text patch") };
    match patchchain::apply::place(up.as_bytes(), hunks, false) {
        Err((_, patchchain::apply::ApplyErrorKind::AtOffset { line, .. })) => {
            assert_eq!(line, 44, "the nearest match is the copy")
        }
        other => panic!("expected the context search to find the copy first: {other:?}"),
    }
    let onto = fx.onto(&[("f.txt", Some(up.as_bytes()))]);
    let r = fx.dry(&onto);
    assert_eq!(hunk(&r, "0001", "f.txt", 1).offset, Some(7));
    done(fx.run(&onto));
    let got = fx.live_file("f.txt");
    assert_eq!(got.matches("PATCHED 50").count(), 1);
    assert_eq!(got.lines().position(|l| l == "PATCHED 50"), Some(56), "the change lands on the original, not the copy");
    fx.assert_sound();
}

#[test]
fn a_fully_upstreamed_patch_is_retired_and_a_partly_upstreamed_one_keeps_the_rest() {
    let f = numbered("line ", 40);
    let fx = Fx::new(&[("f.txt", f.as_bytes()), ("g.txt", b"g\n")]);
    fx.patch("0001-fix", &[("g.txt", Some(b"g fixed\n"))]);
    fx.set_entry("0001", |e| {
        e.status = "submitted".into();
        e.bump = "drop-if-upstream".into();
        e.upstream = "example/upstream#1".into();
        e.hooks.clear();
    });
    let two = set_line(&set_line(&f, 5, "five ours"), 30, "thirty ours");
    fx.patch("0002-two-hunks", &[("f.txt", Some(two.as_bytes()))]);
    let up = set_line(&f, 5, "five ours");
    let onto = fx.onto(&[("g.txt", Some(b"g fixed\n")), ("f.txt", Some(up.as_bytes()))]);
    let r = fx.dry(&onto);
    assert_eq!((verdict(&r, "0001"), r.patches[0].action.as_str()), (Verdict::Upstream, "retire"));
    assert_eq!((verdict(&r, "0002"), hunk(&r, "0002", "f.txt", 1).class, hunk(&r, "0002", "f.txt", 2).class), (Verdict::PartialUpstream, Class::Upstream, Class::Exact));
    done(fx.run(&onto));
    let reg = registry::load(&fx.p.registry_path()).expect("registry");
    assert_eq!(reg.patches[0].status, "retired");
    assert!(reg.patches[0].upstream.contains("dir:base2") && reg.patches[0].upstream.contains("example/upstream#1"), "{}", reg.patches[0].upstream);
    assert!(!fx.p.patches_dir().join("0001-fix.patch").exists(), "a retired patch's file leaves the tree");
    let text = String::from_utf8(fs::read(fx.p.patches_dir().join("0002-two-hunks.patch")).expect("patch")).expect("utf8");
    assert_eq!(text.matches("@@ ").count(), 1, "only the hunk upstream lacks is carried:\n{text}");
    assert!(fx.path("docs/bumps/dir-base-to-dir-base2.md").exists() && fx.path("docs/bumps/dir-base-to-dir-base2.json").exists());
    fx.assert_sound();
}

#[test]
fn a_reapply_patch_found_upstream_waits_for_a_decision() {
    let fx = Fx::new(&[("g.txt", b"g\n")]);
    fx.patch("0001-keep", &[("g.txt", Some(b"g2\n"))]);
    let onto = fx.onto(&[("g.txt", Some(b"g2\n"))]);
    let r = fx.dry(&onto);
    assert_eq!((verdict(&r, "0001"), r.patches[0].action.as_str()), (Verdict::Upstream, "decide"));
    let (_, msg) = stopped(fx.run(&onto));
    assert!(msg.contains("--retire"), "{msg}");
    let err = fx.cont(false).err().expect("refused without a decision");
    assert!(format!("{err:#}").contains("a person decides"), "{err:#}");
    done(fx.cont(true).expect("continue --retire"));
    assert_eq!(registry::load(&fx.p.registry_path()).expect("registry").patches[0].status, "retired");
    fx.assert_sound();
}

/// Three patches; upstream conflicts with the middle one.
fn middle_conflict() -> (Fx, Base, String) {
    let f = numbered("line ", 30);
    let fx = Fx::new(&[("f.txt", f.as_bytes()), ("h.txt", b"h1\nh2\nh3\n")]);
    fx.patch("0001-first", &[("f.txt", Some(set_line(&f, 3, "first").as_bytes()))]);
    let f1 = set_line(&f, 3, "first");
    fx.patch("0002-middle", &[("f.txt", Some(set_line(&f1, 15, "middle ours").as_bytes()))]);
    let f2 = set_line(&f1, 15, "middle ours");
    fx.patch("0003-last", &[("f.txt", Some(set_line(&f2, 27, "last").as_bytes())), ("h.txt", Some(b"h1\nH2\nh3\n"))]);
    let up = set_line(&f, 15, "middle upstream");
    let onto = fx.onto(&[("f.txt", Some(up.as_bytes()))]);
    (fx, onto, up)
}

#[test]
fn a_conflict_in_the_middle_of_the_stack_still_classifies_the_later_patches() {
    let (fx, onto, _) = middle_conflict();
    let r = fx.dry(&onto);
    assert_eq!([verdict(&r, "0001"), verdict(&r, "0002"), verdict(&r, "0003")], [Verdict::Exact, Verdict::Conflict, Verdict::Exact]);
    assert!(r.patches[2].notes.iter().any(|n| n.contains("after the stop at patch 0002")), "{:?}", r.patches[2].notes);
}

#[test]
fn the_dry_run_writes_nothing() {
    let (fx, onto, _) = middle_conflict();
    let before = fx.snapshot();
    fx.dry(&onto);
    assert_eq!(fx.snapshot(), before);
}

#[test]
fn a_real_run_stops_with_diff3_markers_refuses_to_continue_over_them_and_continues_after_resolution() {
    let (fx, onto, up) = middle_conflict();
    let (_, msg) = stopped(fx.run(&onto));
    assert!(msg.contains("patch 0002") && msg.contains("f.txt"), "{msg}");
    let text = fx.live_file("f.txt");
    assert!(text.contains("<<<<<<< ours: patch 0002") && text.contains("||||||| ancestor") && text.contains(">>>>>>> upstream"), "{text}");
    assert!(text.contains("first"), "the carried 0001 is in the tree: {text}");
    // Other chain commands wait for the rebase.
    assert!(commands::apply_chain(&fx.p, None, &pb()).is_err());
    let err = fx.cont(false).err().expect("markers remain");
    assert!(format!("{err:#}").contains("engine/upstream/f.txt:15"), "{err:#}");
    // The maintainer keeps both.
    let resolved = set_line(&set_line(&up, 3, "first"), 15, "middle upstream and ours");
    write_file(&fx.p.upstream_dir().join("f.txt"), resolved.as_bytes(), MODE_FILE);
    let r = done(fx.cont(false).expect("continue"));
    assert_eq!(r.patches[1].notes.iter().filter(|n| n.contains("resolved by the maintainer")).count(), 1);
    assert_eq!(fx.live_file("f.txt"), set_line(&resolved, 27, "last"));
    assert_eq!(fx.live_file("h.txt"), "h1\nH2\nh3\n");
    assert!(!rebase::in_progress(&fx.p));
    fx.assert_sound();
}

#[test]
fn abort_restores_the_registry_patches_manifests_and_engine_upstream_byte_for_byte() {
    let (fx, onto, _) = middle_conflict();
    let before = fx.snapshot();
    stopped(fx.run(&onto));
    assert_ne!(fx.snapshot(), before);
    rebase::abort(&fx.p, &pb()).expect("abort");
    assert_eq!(fx.snapshot(), before);
    fx.assert_sound();
}

#[test]
fn a_second_rebase_is_refused_while_one_is_in_progress() {
    let (fx, onto, _) = middle_conflict();
    stopped(fx.run(&onto));
    let err = rebase::start(&fx.p, &fx.inputs(&onto), &[], &no_extra, &pb()).err().expect("refused");
    assert!(format!("{err}").contains("already in progress"), "{err}");
}

#[test]
fn a_rebase_refuses_to_start_over_unsaved_edits() {
    let (fx, onto, _) = middle_conflict();
    write_file(&fx.p.upstream_dir().join("h.txt"), b"my edit\n", MODE_FILE);
    let err = rebase::start(&fx.p, &fx.inputs(&onto), &[], &no_extra, &pb()).err().expect("refused");
    assert!(err.downcast_ref::<commands::Refused>().is_some(), "{err:#}");
    assert!(!rebase::in_progress(&fx.p));
}

/// Runs the xtask binary on the project; `crash` makes it abort at that journal point.
fn xtask(fx: &Fx, args: &[&str], crash: Option<&str>) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
    c.args(args).env("TINE_PROJECT_ROOT", &fx.p.root);
    if let Some(point) = crash {
        c.env("TINE_CRASH_AT", point);
    } else {
        c.env_remove("TINE_CRASH_AT");
    }
    c.output().expect("xtask runs")
}

fn resolve_middle(fx: &Fx, up: &str) {
    let resolved = set_line(&set_line(up, 3, "first"), 15, "middle both");
    write_file(&fx.p.upstream_dir().join("f.txt"), resolved.as_bytes(), MODE_FILE);
}

#[test]
fn kill_9_at_every_journal_point_leaves_the_old_state_or_a_resumable_one() {
    // The reference: the same bump without interruptions.
    let (reference, onto, up) = middle_conflict();
    let Base::Dir { path } = &onto else { unreachable!() };
    let spec = format!("dir:{path}");
    assert_eq!(xtask(&reference, &["rebase", "--onto", &spec], None).status.code(), Some(1));
    resolve_middle(&reference, &up);
    let out = xtask(&reference, &["rebase", "--continue"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = reference.snapshot();
    let strip = |mut s: BTreeMap<String, Vec<u8>>| {
        s.retain(|k, _| !k.starts_with("base") && !k.starts_with(".tine-rebase"));
        s
    };
    let want = strip(want);

    for point in ["after-start", "after-stop-state", "after-stop-tree"] {
        let (fx, onto, up) = middle_conflict();
        let original = fx.snapshot();
        let out = xtask(&fx, &["rebase", "--onto", &spec], Some(point));
        assert!(!out.status.success(), "{point}: the crash point was reached");
        let _ = onto;
        // Either nothing happened, or the run resumes.
        if !rebase::in_progress(&fx.p) {
            assert_eq!(fx.snapshot(), original, "{point}: no run, so nothing may have changed");
            continue;
        }
        let out = xtask(&fx, &["rebase", "--continue"], None);
        assert_eq!(out.status.code(), Some(1), "{point}: continue stops at the conflict again: {}", String::from_utf8_lossy(&out.stderr));
        assert!(fx.live_file("f.txt").contains("<<<<<<<"), "{point}: the conflict tree is written");
        resolve_middle(&fx, &up);
        let out = xtask(&fx, &["rebase", "--continue"], None);
        assert!(out.status.success(), "{point}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(strip(fx.snapshot()), want, "{point}: the resumed run gives the reference result");
    }
    for point in ["after-resolution", "after-commit-staged", "mid-commit", "after-commit-tree"] {
        let (fx, _, up) = middle_conflict();
        assert_eq!(xtask(&fx, &["rebase", "--onto", &spec], None).status.code(), Some(1));
        resolve_middle(&fx, &up);
        let out = xtask(&fx, &["rebase", "--continue"], Some(point));
        assert!(!out.status.success(), "{point}: the crash point was reached");
        assert!(rebase::in_progress(&fx.p), "{point}: the run is resumable");
        if point == "after-resolution" {
            // The resolution is recorded; continuing again needs nothing more.
        }
        let out = xtask(&fx, &["rebase", "--continue"], None);
        assert!(out.status.success(), "{point}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(strip(fx.snapshot()), want, "{point}: the resumed run gives the reference result");
        fx.assert_sound();
    }
    // Abort, interrupted and repeated, still puts everything back.
    for point in ["mid-commit", "mid-abort"] {
        let (fx, _, up) = middle_conflict();
        let original = strip(fx.snapshot());
        assert_eq!(xtask(&fx, &["rebase", "--onto", &spec], None).status.code(), Some(1));
        if point == "mid-commit" {
            resolve_middle(&fx, &up);
            assert!(!xtask(&fx, &["rebase", "--continue"], Some(point)).status.success());
            let out = xtask(&fx, &["rebase", "--abort"], None);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        } else {
            assert!(!xtask(&fx, &["rebase", "--abort"], Some(point)).status.success());
            assert!(rebase::in_progress(&fx.p));
            let out = xtask(&fx, &["rebase", "--abort"], None);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        }
        assert_eq!(strip(fx.snapshot()), original, "{point}: abort restores everything");
    }
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@example.invalid")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@example.invalid")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn commit_tree(repo: &Path, t: &Tree, msg: &str) {
    for e in fs::read_dir(repo).expect("ls") {
        let e = e.expect("entry");
        if e.file_name() != ".git" {
            let p = e.path();
            if p.is_dir() {
                fs::remove_dir_all(p).expect("rm");
            } else {
                fs::remove_file(p).expect("rm");
            }
        }
    }
    for (p, e) in t {
        write_file(&repo.join(p), &e.data, e.mode);
    }
    git(repo, &["add", "-A"]);
    git(repo, &["commit", "-q", "--allow-empty", "-m", msg]);
}

#[test]
fn the_carried_series_matches_git_rebase_with_every_blob_present() {
    let f = numbered("line ", 80);
    let g = numbered("g ", 40);
    let fx = Fx::new(&[("src/f.txt", f.as_bytes()), ("src/g.txt", g.as_bytes()), ("old.txt", b"1\n2\n3\n4\n5\n")]);
    let f1 = set_line(&f, 10, "p1 ten");
    fx.patch("0001-a", &[("src/f.txt", Some(f1.as_bytes())), ("new.txt", Some(b"added by 0001\n"))]);
    let f2 = set_line(&set_line(&f1, 40, "p2 forty"), 70, "p2 seventy");
    fx.patch("0002-b", &[("src/f.txt", Some(f2.as_bytes())), ("src/g.txt", Some(set_line(&g, 20, "p2 g").as_bytes()))]);
    let f3 = set_line(&f2, 41, "p3 forty-one");
    fx.patch("0003-c", &[("src/f.txt", Some(f3.as_bytes())), ("old.txt", Some(b"1\n2\nthree\n4\n5\n"))]);
    // Upstream: lines inserted above, a changed neighbour, lines removed below, another file edited.
    let up_f = format!("{}{}", numbered("up ", 4), set_line(&f, 38, "upstream thirty-eight")).replace("line 60\nline 61\n", "");
    let up_g = set_line(&g, 1, "upstream g");
    let onto = fx.onto(&[("src/f.txt", Some(up_f.as_bytes())), ("src/g.txt", Some(up_g.as_bytes()))]);
    let r = fx.dry(&onto);
    assert!(r.clean(), "{}", rebase::render_table(&r));

    // git: the old base, upstream's release on one branch, one commit per old chain prefix on the other.
    let repo = tempfile::tempdir().expect("tempdir");
    git(repo.path(), &["init", "-q", "-b", "fork"]);
    let base = tree::read_tree(&fx.path("base")).expect("base");
    commit_tree(repo.path(), &base, "base");
    git(repo.path(), &["branch", "up"]);
    let inputs = fx.inputs(&onto);
    let mut t = base.clone();
    for lp in &inputs.patches {
        patchchain::apply::apply(&mut t, &lp.parsed, lp.name()).expect("old chain applies");
        commit_tree(repo.path(), &t, &lp.entry.id);
    }
    git(repo.path(), &["checkout", "-q", "up"]);
    commit_tree(repo.path(), &tree::read_tree(&fx.path("base2")).expect("base2"), "upstream release");
    git(repo.path(), &["checkout", "-q", "fork"]);
    git(repo.path(), &["rebase", "-q", "up"]);

    done(fx.run(&onto));
    // Every carried prefix equals git's rebased commit at the same place.
    let reg = registry::load(&fx.p.registry_path()).expect("registry");
    let patches = patchchain::chain::load_patches(&fx.p, &reg).expect("patches");
    let mut ours = tree::read_tree(&fx.path("base2")).expect("base2");
    for (i, lp) in patches.iter().enumerate() {
        patchchain::apply::apply(&mut ours, &lp.parsed, lp.name()).expect("new chain applies");
        let rev = format!("HEAD~{}", patches.len() - 1 - i);
        let listing = git(repo.path(), &["ls-tree", "-r", "--name-only", &rev]);
        let mut theirs = Tree::new();
        for path in listing.lines() {
            let data = Command::new("git").args(["show", &format!("{rev}:{path}")]).current_dir(repo.path()).output().expect("git show").stdout;
            theirs.insert(path.to_owned(), tree::Entry::file(data));
        }
        let strip_modes = |t: &Tree| t.iter().map(|(p, e)| (p.clone(), e.data.clone())).collect::<BTreeMap<_, _>>();
        assert_eq!(strip_modes(&ours), strip_modes(&theirs), "prefix {} differs from git's rebase", lp.entry.id);
    }
    fx.assert_sound();
}

#[test]
fn a_fix_that_landed_upstream_retires_its_patch_and_its_own_test_files_leave_with_it() {
    let fx = Fx::new(&[("src/gelu.rs", b"fn act() { silu() }\n"), ("keep.txt", b"k\n")]);
    fx.patch("0001-fix", &[("src/gelu.rs", Some(b"fn act() { gelu() }\n")), ("tests/gelu.rs", Some(b"#[test] fn t() {}\n"))]);
    fx.set_entry("0001", |e| {
        e.bump = "drop-if-upstream".into();
        e.upstream = "example/upstream#2".into();
    });
    let onto = fx.onto(&[("src/gelu.rs", Some(b"fn act() { gelu() }\n"))]);
    let r = fx.dry(&onto);
    assert_eq!((verdict(&r, "0001"), r.patches[0].action.as_str()), (Verdict::Upstream, "retire"), "{}", rebase::render_table(&r));
    assert!(r.patches[0].notes.iter().any(|n| n.contains("tests/gelu.rs")), "{:?}", r.patches[0].notes);
    done(fx.run(&onto));
    assert!(!fx.live().contains_key("tests/gelu.rs"));
    fx.assert_sound();
}

#[test]
fn hook_markers_that_move_in_a_resolution_follow_into_the_registry_and_the_trailers() {
    let f = numbered("line ", 20);
    let fx = Fx::new(&[("f.txt", f.as_bytes())]);
    fx.patch("0001-hooked", &[("f.txt", Some(set_line(&f, 10, "// tine-hook: old-spot").as_bytes()))]);
    let onto = fx.onto(&[("f.txt", Some(set_line(&f, 10, "upstream ten").as_bytes()))]);
    stopped(fx.run(&onto));
    write_file(&fx.p.upstream_dir().join("f.txt"), set_line(&set_line(&f, 10, "upstream ten"), 11, "// tine-hook: new-spot").as_bytes(), MODE_FILE);
    let r = done(fx.cont(false).expect("continue"));
    assert!(r.patches[0].notes.iter().any(|n| n.starts_with("hooks: now")), "{:?}", r.patches[0].notes);
    let reg = registry::load(&fx.p.registry_path()).expect("registry");
    assert_eq!(reg.patches[0].hooks, ["new-spot"]);
    let text = String::from_utf8(fs::read(fx.p.patches_dir().join("0001-hooked.patch")).expect("patch")).expect("utf8");
    assert!(text.contains("Tine-Hook: new-spot\n") && !text.contains("Tine-Hook: old-spot"), "{text}");
    fx.assert_sound();
}

/// The real bump's committed report agrees with the registry it produced.
#[test]
fn the_committed_report_of_the_real_bump_to_0_11_1_matches_the_registry() {
    let p = xtask::project();
    let text = fs::read(p.root.join("docs/bumps/0.11.0-to-0.11.1.json")).expect("the bump report is committed");
    let r: Report = serde_json::from_slice(&text).expect("the report parses as a rebase report");
    assert_eq!((r.from.as_str(), r.onto.as_str()), ("0.11.0", "0.11.1"));
    let reg = registry::load(&p.registry_path()).expect("registry");
    let Base::Crates { crates } = &reg.base else { panic!("the base is registry crates") };
    assert!(crates.iter().all(|c| c.version == "0.11.1"), "the pin moved to 0.11.1");
    for pr in &r.patches {
        let e = reg.patches.iter().find(|e| e.id == pr.id).unwrap_or_else(|| panic!("patch {} of the report is in the registry", pr.id));
        assert_eq!(pr.action == "retire", e.status == "retired", "patch {}: the report's action {} and the registry's status {}", pr.id, pr.action, e.status);
        assert!(!pr.hunks.is_empty(), "patch {} lists its hunks", pr.id);
        assert!(!matches!(pr.action.as_str(), "stop" | "decide"), "patch {}: a completed bump has no open stops", pr.id);
    }
    // Patches captured after the bump (0016 and later) are not in its report; every patch the
    // bump carried still is, in series order.
    let reported: Vec<&str> = r.patches.iter().filter(|p| p.action != "retire").map(|p| p.id.as_str()).collect();
    let carried: Vec<&str> = reg.patches.iter().filter(|e| e.is_applied() && reported.contains(&e.id.as_str())).map(|e| e.id.as_str()).collect();
    assert_eq!(carried, reported, "every patch the bump carried is still carried, in series order");
}

#[test]
fn canary_exits_zero_only_when_every_patch_is_exact_or_rebased_and_writes_nothing() {
    let (fx, _, _) = middle_conflict();
    let before = fx.snapshot();
    fx.onto(&[("h.txt", Some(b"h0\nh1\nh2\nh3\n"))]);
    let json = fx.path("canary.json");
    let out = xtask(&fx, &["canary", "dir:base2", "--json", json.to_str().expect("utf8")], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    let r: Report = serde_json::from_slice(&fs::read(&json).expect("the JSON report")).expect("parses");
    assert!(r.clean());
    let f = numbered("line ", 30);
    fx.onto(&[("f.txt", Some(set_line(&f, 15, "middle upstream").as_bytes()))]);
    let out = xtask(&fx, &["canary", "dir:base2"], None);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stdout).contains("0002 conflict"));
    let mut after = fx.snapshot();
    after.retain(|k, _| !k.starts_with("base2/") && k != "canary.json");
    let mut before = before;
    before.retain(|k, _| !k.starts_with("base2/"));
    assert_eq!(after, before);
}

/// The modules a test file pulls in (`#[path = "…"] mod x;` or `mod x;`), as paths relative to the tree.
fn test_modules(path: &str, text: &str) -> Vec<String> {
    let dir = Path::new(path).parent().expect("test files sit in a directory");
    let mut out = Vec::new();
    let mut pending_path: Option<String> = None;
    for line in text.lines().map(str::trim) {
        if let Some(p) = line.strip_prefix("#[path = \"").and_then(|r| r.strip_suffix("\"]")) {
            pending_path = Some(p.to_owned());
        } else if let Some(name) = line.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            let rel = match pending_path.take() {
                Some(p) => dir.join(p),
                None => dir.join(name).join("mod.rs"),
            };
            // Normalise `..` so the path can be looked up in the tree or on disk.
            let mut parts: Vec<&str> = Vec::new();
            for c in rel.to_str().expect("utf8").split('/') {
                match c {
                    ".." if parts.last().is_some_and(|l| *l != "..") => {
                        parts.pop();
                    }
                    "." | "" => {}
                    c => parts.push(c),
                }
            }
            out.push(parts.join("/"));
        } else if !line.starts_with("//") && !line.is_empty() {
            pending_path = None;
        }
    }
    out
}

/// Upstream merges the GELU fix (huggingface/candle#3747): a `dir` base = the pinned base plus
/// 0002's source change. The bump retires 0002 and every other patch's tests still find what
/// they include, because the shared Gemma 3 fixture lives in tine-test-support, not in 0002.
#[test]
fn a_base_with_upstreams_gelu_fix_retires_0002_and_leaves_every_other_patchs_tests_whole() {
    let p = xtask::project();
    let reg = registry::load(&p.registry_path()).expect("registry");
    let base = patchchain::base::load(&reg.base, &p.root, &p.cache_dir, &pb()).expect("the pinned base (cargo xtask apply-chain fetches it)");
    let patches = patchchain::chain::load_patches(&p, &reg).expect("patches");
    let gelu = patches.iter().find(|l| l.entry.id == "0002").expect("patch 0002");
    let src = "candle-transformers/src/models/quantized_gemma3.rs";
    let mut fixed = base.clone();
    patchchain::apply::apply(&mut fixed, &gelu.parsed, gelu.name()).expect("0002 applies to the base");
    let dir = tempfile::tempdir().expect("tempdir");
    for (path, e) in &base {
        let data = if path == src { &fixed[src].data } else { &e.data };
        write_file(&dir.path().join(path), data, e.mode);
    }
    let onto = Base::Dir { path: dir.path().to_str().expect("utf8").to_owned() };
    let inputs = rebase::load_inputs(&p, onto, &pb()).expect("inputs");
    let plan = rebase::plan(&inputs.old_base, &inputs.new_base, &inputs.patches, &inputs.from, &inputs.onto, &rebase::Resolutions::default(), None, false).expect("plan");
    let r = &plan.report;
    for pr in &r.patches {
        if pr.id == "0002" {
            assert_eq!((pr.verdict, pr.action.as_str()), (Verdict::Upstream, "retire"), "{}", rebase::render_table(r));
        } else {
            assert!(matches!(pr.verdict, Verdict::Exact | Verdict::Rebased), "patch {} must carry: {}", pr.id, rebase::render_table(r));
        }
    }
    assert!(!plan.new_tree.contains_key("candle-transformers/tests/quantized_gemma3_gelu.rs"), "0002's own test leaves with it");
    let mut checked = 0;
    for lp in inputs.patches.iter().filter(|l| l.entry.id != "0002") {
        for f in lp.parsed.files.iter().filter(|f| f.op == patchchain::patch::Op::Create) {
            let path = f.new_path.as_deref().expect("created");
            if !path.contains("/tests/") || !path.ends_with(".rs") {
                continue;
            }
            let text = String::from_utf8_lossy(&plan.new_tree[path].data).into_owned();
            for m in test_modules(path, &text) {
                let found = plan.new_tree.contains_key(&m) || p.upstream_dir().join(&m).exists() || m.strip_prefix("../").is_some_and(|rest| p.root.join("engine").join(rest).exists());
                assert!(found, "patch {}: {path} includes {m}, which the carried tree and the project lack", lp.entry.id);
                checked += 1;
            }
        }
    }
    assert!(checked >= 9, "the patches' tests include the shared fixture ({checked} includes checked)");
}

#[test]
fn a_merely_similar_new_upstream_file_is_not_taken_for_a_rename() {
    let header = "// Licensed under the same terms.\n// See LICENSE.\nuse std::io;\nuse std::fmt;\n";
    let gone = format!("{header}fn old_a() {{}}\nfn old_b() {{}}\nfn old_c() {{}}\n");
    let fx = Fx::new(&[("src/gone.rs", gone.as_bytes())]);
    fx.patch("0001-io", &[("src/gone.rs", Some(gone.replace("use std::io;", "use std::io::Write;").as_bytes()))]);
    let fresh = format!("{header}fn new_x() {{}}\nfn new_y() {{}}\n");
    let r = fx.dry(&fx.onto(&[("src/gone.rs", None), ("src/brand_new.rs", Some(fresh.as_bytes()))]));
    let h = hunk(&r, "0001", "src/gone.rs", 1);
    assert_eq!(h.class, Class::Conflict, "{}", rebase::render_table(&r));
    assert!(h.reason.as_deref().unwrap_or("").starts_with("modify/delete"), "{h:?}");
}

#[test]
fn lines_upstream_inserts_right_before_a_hunk_give_its_offset() {
    let f = numbered("line ", 20);
    let fx = Fx::new(&[("f.txt", f.as_bytes())]);
    fx.patch("0001-change", &[("f.txt", Some(set_line(&f, 10, "LINE TEN").as_bytes()))]);
    // The hunk's first context line is line 7; upstream inserts five lines just before it.
    let up = f.replace("line 7\n", &format!("{}line 7\n", numbered("new ", 5)));
    let r = fx.dry(&fx.onto(&[("f.txt", Some(up.as_bytes()))]));
    let h = hunk(&r, "0001", "f.txt", 1);
    assert_eq!((h.class, h.offset, h.new_line), (Class::Offset, Some(5), Some(12)), "{h:?}");
}

#[test]
fn an_upstreamed_change_keeps_its_patch_when_upstream_lacks_the_mode_change() {
    let fx = Fx::new(&[("run.sh", b"#!/bin/sh\necho 1\n")]);
    commands::apply_chain(&fx.p, None, &pb()).expect("apply");
    write_file(&fx.p.upstream_dir().join("run.sh"), b"#!/bin/sh\necho 2\n", MODE_EXEC);
    commands::capture(&fx.p, &Tine, &CaptureOptions { name: "0001-exec", after: None, title: None, area: "other", upstream_status: "Pending" }, &pb()).expect("capture");
    let onto = fx.onto(&[("run.sh", Some(b"#!/bin/sh\necho 2\n"))]);
    let r = fx.dry(&onto);
    assert_eq!(verdict(&r, "0001"), Verdict::PartialUpstream, "{}", rebase::render_table(&r));
    done(fx.run(&onto));
    assert_eq!(fx.live()["run.sh"].mode, MODE_EXEC);
    fx.assert_sound();
}

#[test]
fn hook_trailers_are_rewritten_in_the_header_even_when_the_message_mentions_diff_git() {
    let bytes = b"Subject: [PATCH] x\n\nThe message quotes `diff --git a/x b/x`.\n\nTine-Hook: old\nUpstream-Status: Pending\n---\ndiff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n";
    let out = rebase::with_hook_trailers(bytes, &["new".to_owned()].into_iter().collect());
    let text = String::from_utf8(out.clone()).expect("utf8");
    assert!(text.contains("quotes `diff --git a/x b/x`.\n\nTine-Hook: new\nUpstream-Status"), "{text}");
    assert!(!text.contains("Tine-Hook: old"));
    patchchain::patch::parse(&out).expect("still a patch");
}

#[test]
fn deleting_a_file_that_upstream_moved_deletes_it_at_its_new_place() {
    let body = numbered("fn f", 20);
    let fx = Fx::new(&[("old/a.rs", body.as_bytes()), ("keep.txt", b"k\n")]);
    fx.patch("0001-drop", &[("old/a.rs", None)]);
    let onto = fx.onto(&[("old/a.rs", None), ("new/a.rs", Some(body.as_bytes()))]);
    let r = fx.dry(&onto);
    let h = hunk(&r, "0001", "new/a.rs", 1);
    assert_eq!((h.class, h.renamed_from.as_deref()), (Class::Exact, Some("old/a.rs")), "{}", rebase::render_table(&r));
    done(fx.run(&onto));
    assert!(!fx.live().contains_key("new/a.rs"));
    fx.assert_sound();
}

#[test]
fn a_conflict_without_markers_needs_a_change_or_an_explicit_accept_before_continue() {
    let fx = Fx::new(&[("blob.bin", &[0u8, 1, 2, 0, 3]), ("t.txt", b"t\n")]);
    fx.patch("0001-bin", &[("blob.bin", Some(&[0, 1, 2, 0, 4]))]);
    let onto = fx.onto(&[("blob.bin", Some(&[9, 0, 9]))]);
    stopped(fx.run(&onto));
    let err = fx.cont(false).err().expect("a binary conflict left as it was is not a resolution");
    assert!(format!("{err:#}").contains("engine/upstream/blob.bin: binary"), "{err:#}");
    let r = rebase::continue_run(&fx.p, &ContinueOptions { retire: false, accept: vec!["blob.bin".into()] }, &no_extra, &pb()).expect("accepted as it is");
    done(r);
    assert_eq!(fx.live()["blob.bin"].data, [0, 1, 2, 0, 4], "the patch's side, as the stop wrote it");
    fx.assert_sound();
}

/// Issue 51: Tine's Gemma 3 is a file of its own (0004 creates `quantized_gemma3_tine.rs`, which
/// models/mod.rs compiles under candle's module name); candle's `quantized_gemma3.rs` carries
/// 0002's upstream fix alone, so a base bump meets no other hunk of ours there.
#[test]
fn only_0002_edits_candles_gemma3_file_and_0004_gives_tines_gemma3_its_own() {
    let p = xtask::project();
    let reg = registry::load(&p.registry_path()).expect("registry");
    let patches = patchchain::chain::load_patches(&p, &reg).expect("patches");
    let candle = "candle-transformers/src/models/quantized_gemma3.rs";
    let tine = "candle-transformers/src/models/quantized_gemma3_tine.rs";
    let mut created_by = Vec::new();
    for lp in &patches {
        for f in &lp.parsed.files {
            let edits_candles = f.old_path.as_deref() == Some(candle) || f.new_path.as_deref() == Some(candle);
            assert!(!edits_candles || lp.entry.id == "0002", "patch {} edits candle's {candle}: Tine's Gemma 3 is {tine}", lp.entry.id);
            if f.op == patchchain::patch::Op::Create && f.new_path.as_deref() == Some(tine) {
                created_by.push(lp.entry.id.clone());
            }
        }
    }
    assert_eq!(created_by, ["0004"], "{tine} is created once, by 0004");
}
