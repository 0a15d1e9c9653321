//! Integration tests of the `tine` binary: every spec type through `tine generate`, and the
//! `tine logit-equiv` gate, on synthetic GGUFs.

use std::path::Path;
use std::process::Command;

use tine_test_support::{TinyAssistant, TinyGemma3};

fn tine(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tine")).args(args).output().expect("run tine");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn fixtures(dir: &Path) -> (String, String, String) {
    let cfg = TinyGemma3 { nextn: true, seed: 8, ..TinyGemma3::default() };
    let (t, a, d) = (dir.join("target.gguf"), dir.join("assistant.gguf"), dir.join("draft.gguf"));
    cfg.write(&t);
    TinyAssistant::default().write(&cfg, &a);
    TinyGemma3 { seed: 3, n_layer: 2, ..TinyGemma3::default() }.write(&d);
    let s = |p: &Path| p.to_str().expect("utf-8 temp path").to_owned();
    (s(&t), s(&a), s(&d))
}

#[test]
fn every_spec_type_runs_through_tine_generate_with_plain_output() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (target, head, draft) = fixtures(dir.path());
    let base = ["generate", "-m", &target, "-p", "hello world hello", "-n", "24", "--temp", "0", "--ignore-eos"];
    let (ok, want, err) = tine(&base);
    assert!(ok, "{err}");
    for extra in
        [vec!["--spec-type", "draft-mtp"], vec!["--spec-type", "draft-assistant", "--mtp-head", &head], vec!["-md", &draft, "-ngld", "99"], vec!["--spec-type", "ngram", "--spec-ngram-min", "1"]]
    {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (ok, got, err) = tine(&args);
        assert!(ok, "{extra:?}: {err}");
        assert_eq!(got, want, "{extra:?}");
        assert!(err.contains("verify steps"), "{extra:?}: no draft statistics in\n{err}");
    }
    // A missing head is a clear error, not a panic.
    let args: Vec<&str> = base.iter().copied().chain(["--spec-type", "draft-assistant"]).collect();
    let (ok, _, err) = tine(&args);
    assert!(!ok && err.contains("--mtp-head"), "{err}");
}

#[test]
fn logit_equiv_reports_exact_equivalence_for_all_spec_types() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (target, head, draft) = fixtures(dir.path());
    let json = dir.path().join("equiv.json");
    let (ok, out, err) = tine(&["logit-equiv", "-m", &target, "--all", "--mtp-head", &head, "-md", &draft, "-n", "16", "--depths", "1,3", "--json", json.to_str().expect("utf-8")]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("logit-equiv: exact"), "{out}");
    let doc = std::fs::read_to_string(&json).expect("json written");
    for kind in ["draft-mtp", "draft-assistant", "\"draft\"", "ngram"] {
        assert!(doc.contains(kind), "{kind} missing from {doc}");
    }
}
