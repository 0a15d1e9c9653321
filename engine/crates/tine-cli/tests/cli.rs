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
    for extra in [
        vec!["--spec-type", "draft-mtp"],
        vec!["--spec-type", "draft-mtp", "--spec-adaptive", "off"],
        vec!["--spec-type", "draft-assistant", "--mtp-head", &head],
        vec!["-md", &draft, "-ngld", "99", "--spec-adaptive", "on"],
        vec!["--spec-type", "ngram", "--spec-ngram-min", "1"],
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (ok, got, err) = tine(&args);
        assert!(ok, "{extra:?}: {err}");
        assert_eq!(got, want, "{extra:?}");
        assert!(err.contains("verify steps"), "{extra:?}: no draft statistics in\n{err}");
    }
    let args: Vec<&str> = base.iter().copied().chain(["--spec-type", "draft-mtp,draft"]).collect();
    let (ok, _, err) = tine(&args);
    assert!(!ok && err.contains("a chain is ngram plus one other type"), "{err}");
    let args: Vec<&str> = base.iter().copied().chain(["--spec-type", "ngram", "--spec-adaptive", "maybe"]).collect();
    let (ok, _, err) = tine(&args);
    assert!(!ok && err.contains("expected on or off"), "{err}");
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

/// `logit-equiv --all` runs each type with the flags as given: a draft model that is the target
/// itself, in the target's cache types (-ctkd/-ctvd), drafts exactly what the target decodes,
/// so every draft is accepted. The draft model once ran in f32 caches under --all; on this
/// fixture (seed 25) an f32 draft of a q4_0 target accepts about half, which the test checks too.
#[test]
fn logit_equiv_all_keeps_the_draft_models_cache_types() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny32.gguf");
    TinyGemma3 { head_dim: 32, seed: 25, ..TinyGemma3::default() }.write(&path);
    let m = path.to_str().expect("utf-8 temp path");
    let json = dir.path().join("equiv.json");
    let accepted = |draft_type: &str| {
        let types = ["-ctk", "q4_0", "-ctv", "q4_0", "-ctkd", draft_type, "-ctvd", draft_type];
        let args: Vec<&str> =
            ["logit-equiv", "-m", m, "--all", "-md", m, "-n", "32", "--depths", "3", "--spec-adaptive", "off", "--json", json.to_str().expect("utf-8")].into_iter().chain(types).collect();
        let (ok, out, err) = tine(&args);
        assert!(ok, "{out}\n{err}");
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).expect("json");
        let draft = doc["results"].as_array().expect("results").iter().find(|r| r["spec_type"] == "draft").expect("a draft row").clone();
        (draft["draft_n_accepted"].as_u64().expect("accepted"), draft["draft_n"].as_u64().expect("draft_n"))
    };
    let (same, n) = accepted("q4_0");
    assert!(n > 0 && same == n, "the target as its own draft model in its own types accepted {same} of {n}");
    let (other, m) = accepted("f32");
    assert!(other < m, "an f32 draft of a q4_0 target accepted all {m}: the fixture no longer tells the types apart");
}

/// `tine serve -m MODEL --port P ARGS...` on a free port, once it answers; killed when dropped.
struct Served {
    child: std::process::Child,
    port: u16,
}

impl Served {
    fn start(model: &str, args: &[&str]) -> Served {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port();
        let child =
            Command::new(env!("CARGO_BIN_EXE_tine")).args(["serve", "-m", model, "--port", &port.to_string()]).args(args).stderr(std::process::Stdio::null()).spawn().expect("start tine serve");
        let served = Served { child, port };
        let t0 = std::time::Instant::now();
        while served.request("GET", "/health", "").is_none() {
            assert!(t0.elapsed().as_secs() < 60, "tine serve did not come up");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        served
    }

    /// The whole HTTP response, or none if the connection failed.
    fn request(&self, method: &str, path: &str, body: &str) -> Option<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Qwen3.5 target with its NextN head and a qwen35 draft model, with the fixture's tokenizer.
fn qwen35_fixtures(dir: &Path) -> (String, String) {
    use tine_test_support::qwen35_fixture::{TinyQwen35, TOKENIZER_VOCAB};
    let base = TinyQwen35 { vocab: TOKENIZER_VOCAB, tokenizer: true, ..TinyQwen35::default() };
    let (t, d) = (dir.join("qwen35.gguf"), dir.join("qwen35-draft.gguf"));
    TinyQwen35 { nextn: true, seed: 31, ..base.clone() }.write(&t);
    TinyQwen35 { n_layer: 2, full_attention_interval: 2, seed: 77, ..base }.write(&d);
    let s = |p: &Path| p.to_str().expect("utf-8 temp path").to_owned();
    (s(&t), s(&d))
}

#[test]
fn qwen35_generates_with_every_spec_type_it_runs_and_logit_equiv_is_exact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (target, draft) = qwen35_fixtures(dir.path());
    let base = ["generate", "-m", &target, "-p", "the cat the cat the", "-n", "24", "--temp", "0", "--ignore-eos"];
    let (ok, want, err) = tine(&base);
    assert!(ok, "{err}");
    assert!(!want.is_empty());
    for extra in [
        vec!["--spec-type", "draft-mtp"],
        vec!["--spec-type", "draft-mtp", "--spec-draft-n-max", "5"],
        vec!["-md", &draft],
        vec!["--spec-type", "ngram", "--spec-ngram-min", "1"],
        vec!["--spec-type", "ngram,draft-mtp"],
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (ok, got, err) = tine(&args);
        assert!(ok, "{extra:?}: {err}");
        assert_eq!(got, want, "qwen35 {extra:?}");
        assert!(err.contains("verify steps"), "{extra:?}: no draft statistics in\n{err}");
    }
    // An assistant head is for Gemma 3 targets: a clear error.
    let head = dir.path().join("head.gguf");
    tine_test_support::TinyAssistant::default().write(&TinyGemma3::default(), &head);
    let args: Vec<&str> = base.iter().copied().chain(["--spec-type", "draft-assistant", "--mtp-head", head.to_str().expect("utf-8")]).collect();
    let (ok, _, err) = tine(&args);
    assert!(!ok && err.contains("an assistant head is for a gemma3 or gemma4 target"), "{err}");
    let json = dir.path().join("equiv.json");
    let (ok, out, err) = tine(&["logit-equiv", "-m", &target, "--spec-type", "draft-mtp", "-n", "16", "--depths", "1,3", "--json", json.to_str().expect("utf-8")]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("logit-equiv: exact"), "{out}");
    // Served with draft-mtp: a second request extending the first restarts from the first
    // prompt's checkpoint (timings.cache_n), and answers as plain decoding does.
    let served = Served::start(&target, &["-c", "256", "-np", "1", "--spec-type", "draft-mtp"]);
    let first = served.request("POST", "/completion", r#"{"prompt": "the cat the cat the", "n_predict": 24, "temperature": 0, "ignore_eos": true}"#).expect("completion");
    let second = served.request("POST", "/completion", r#"{"prompt": "the cat the cat the dog", "n_predict": 8, "temperature": 0, "ignore_eos": true}"#).expect("completion");
    drop(served);
    let body = |r: &str| serde_json::from_str::<serde_json::Value>(r.split("\r\n\r\n").nth(1).expect("a body")).expect("JSON");
    let (first, second) = (body(&first), body(&second));
    // `tine generate` prints the prompt, then the continuation.
    let continuation = want.trim_end_matches('\n').strip_prefix("the cat the cat the").expect("the prompt first");
    assert_eq!(first["content"].as_str(), Some(continuation), "served with draft-mtp: {first}");
    assert!(first["timings"]["draft_n"].as_u64().unwrap_or(0) > 0, "no drafts: {first}");
    let prompt_n = first["tokens_evaluated"].as_u64().expect("tokens_evaluated");
    // The NextN head's entries reach one position less than the target's (its entry j reads
    // token j + 1), so the reuse stops at the checkpoint before the prompt's last token.
    assert_eq!(second["timings"]["cache_n"].as_u64(), Some(prompt_n - 1), "the second request restarts from the first prompt's checkpoint: {second}");
}

/// Gemma 4 targets (31B-like, E-series, MoE), a smaller gemma4 draft model and each target's
/// gemma4-assistant (the E-series one with ordered embeddings), with the fixture's tokenizer:
/// plain and speculative output equal for draft models, n-gram and the assistant (under
/// `--spec-type draft-assistant --mtp-head` and llama.cpp's `--spec-type draft-mtp -md`),
/// greedy and seeded, `logit-equiv` exact, and served answers equal to `generate`'s.
#[test]
fn gemma4_generates_with_draft_models_ngram_and_its_assistant_losslessly_and_serves() {
    use tine_test_support::gemma4_fixture::{TinyGemma4, TinyGemma4Assistant, TOKENIZER_VOCAB};
    let dir = tempfile::tempdir().expect("tempdir");
    let s = |p: &Path| p.to_str().expect("utf-8 temp path").to_owned();
    let draft = dir.path().join("gemma4-draft.gguf");
    TinyGemma4 { vocab: TOKENIZER_VOCAB, tokenizer: true, pattern: vec![true, false], seed: 70, ..TinyGemma4::dense() }.write(&draft);
    let draft = s(&draft);
    let prompt = "the cat the cat the";
    for (name, cfg) in [("dense", TinyGemma4::dense()), ("e2b", TinyGemma4::e2b()), ("a4b", TinyGemma4::a4b())] {
        let target = dir.path().join(format!("{name}.gguf"));
        let cfg = TinyGemma4 { vocab: TOKENIZER_VOCAB, tokenizer: true, ..cfg };
        cfg.write(&target);
        let target = s(&target);
        // Its assistant (the E-series one with ordered embeddings), under both spellings.
        let head = dir.path().join(format!("{name}-assistant.gguf"));
        let centroids = if name == "e2b" { 5 } else { 0 };
        TinyGemma4Assistant { centroids, centroid_top_k: 2, ..TinyGemma4Assistant::default() }.write(&cfg, &head);
        let head = s(&head);
        let base = ["generate", "-m", &target, "-p", prompt, "-n", "24", "--temp", "0", "--ignore-eos"];
        let (ok, want, err) = tine(&base);
        assert!(ok, "{name}: {err}");
        assert!(want.starts_with(prompt), "{name}: {want}");
        for extra in [
            vec!["-md", &draft],
            vec!["-md", &draft, "--spec-draft-n-max", "6"],
            vec!["--spec-type", "ngram", "--spec-ngram-min", "1"],
            vec!["--spec-type", "draft-assistant", "--mtp-head", &head],
            vec!["--spec-type", "draft-mtp", "-md", &head, "--spec-draft-n-max", "5"],
            vec!["--spec-type", "ngram,draft-assistant", "--mtp-head", &head],
        ] {
            let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
            let (ok, got, err) = tine(&args);
            assert!(ok, "{name} {extra:?}: {err}");
            assert_eq!(got, want, "{name} {extra:?}");
            assert!(err.contains("verify steps"), "{name} {extra:?}: no draft statistics in\n{err}");
        }
        // Seeded sampling is lossless too.
        let sampled = ["generate", "-m", &target, "-p", prompt, "-n", "24", "--temp", "0.8", "--seed", "5", "--ignore-eos"];
        let (ok, plain, err) = tine(&sampled);
        assert!(ok, "{err}");
        for extra in [["-md", &draft], ["--mtp-head", &head]] {
            let mut args: Vec<&str> = sampled.iter().copied().chain(extra).collect();
            if extra[0] == "--mtp-head" {
                args.extend(["--spec-type", "draft-assistant"]);
            }
            let (ok, spec, err) = tine(&args);
            assert!(ok, "{err}");
            assert_eq!(spec, plain, "{name} {extra:?}: seeded speculative output differs from plain");
        }
        // No NextN head: a clear error rather than a silent plain run.
        let args: Vec<&str> = base.iter().copied().chain(["--spec-type", "draft-mtp"]).collect();
        let (ok, _, err) = tine(&args);
        assert!(!ok && err.to_lowercase().contains("nextn"), "{name}: {err}");
        let json = dir.path().join("equiv.json");
        let (ok, out, err) = tine(&["logit-equiv", "-m", &target, "-md", &draft, "--mtp-head", &head, "--spec-type", "ngram", "-n", "16", "--depths", "1,3", "--json", json.to_str().expect("utf-8")]);
        assert!(ok, "{name}: {out}\n{err}");
        assert!(out.contains("logit-equiv: exact"), "{name}: {out}");
        let (ok, out, err) = tine(&["logit-equiv", "-m", &target, "--mtp-head", &head, "--spec-type", "draft-assistant", "-n", "16", "--depths", "1,3"]);
        assert!(ok, "{name}: {out}\n{err}");
        assert!(out.contains("logit-equiv: exact"), "{name}: {out}");
        // The draft step's cost against a target step; with ordered embeddings, on and off.
        let (ok, out, err) = tine(&["spec-bench", "-m", &target, "--mtp-head", &head, "--draft-steps"]);
        assert!(ok, "{name}: {out}\n{err}");
        let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| draft step")).collect();
        let labels: &[&str] = if name == "e2b" { &["ordered embeddings", "every token scored"] } else { &["the head"] };
        assert_eq!(rows.len(), labels.len(), "{name}: {out}");
        for (row, label) in rows.iter().zip(labels) {
            assert!(row.contains(label), "{name}: {row} is not the {label} row in\n{out}");
        }
        if name != "e2b" {
            continue;
        }
        let served = Served::start(&target, &["-c", "256", "-np", "2", "--spec-type", "draft-mtp", "-md", &head]);
        let first = served.request("POST", "/completion", r#"{"prompt": "the cat the cat the", "n_predict": 24, "temperature": 0, "ignore_eos": true}"#).expect("completion");
        drop(served);
        let body: serde_json::Value = serde_json::from_str(first.split("\r\n\r\n").nth(1).expect("a body")).expect("JSON");
        let continuation = want.trim_end_matches('\n').strip_prefix(prompt).expect("the prompt first");
        assert_eq!(body["content"].as_str(), Some(continuation), "served with the assistant: {body}");
        assert!(body["timings"]["draft_n"].as_u64().unwrap_or(0) > 0, "no drafts: {body}");
    }
}

/// `tine serve` with llama-server's flags on a free port: the flags must reach the server
/// (regression: `--chat-template` was parsed and then dropped).
#[test]
fn serve_flags_reach_the_server_and_bad_ones_fail_before_the_model_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (target, _, _) = fixtures(dir.path());
    for (flag, value, needle) in
        [("--temp", "nan", "temperature must be a finite number"), ("--chat-template", "/no/such/template.jinja", "--chat-template"), ("--host", "no-such-host.invalid", "--host no-such-host.invalid")]
    {
        let (ok, _, err) = tine(&["serve", "-m", "/no/such/model.gguf", flag, value]);
        assert!(!ok && err.contains(needle), "{flag} {value}: {err}");
    }
    // Issue 52: several --host addresses, each served by the same server.
    let served =
        Served::start(&target, &["-c", "512", "-np", "2", "-n", "3", "--alias", "tiny", "--chat-template", "chatml", "--metrics", "--context-shift", "--keep", "-1", "--host", "127.0.0.1,127.0.0.2"]);
    let get = |method: &str, path: &str, body: &str| served.request(method, path, body);
    let other = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.2", served.port)).expect("the second --host address is served");
        write!(s, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out
    };
    assert!(other.starts_with("HTTP/1.1 200"), "{other}");
    let props = get("GET", "/props", "").expect("props");
    let applied = get("POST", "/apply-template", r#"{"messages": [{"role": "user", "content": "hi"}]}"#).expect("apply-template");
    let done = get("POST", "/completion", r#"{"prompt": "hello"}"#).expect("completion");
    let metrics = get("GET", "/metrics", "").expect("metrics");
    drop(served);
    assert!(props.contains(r#""context_shift":true"#) && props.contains(r#""n_keep":-1"#), "--context-shift --keep -1: {props}");
    assert!(props.contains(r#""model_alias":"tiny""#) && props.contains(r#""total_slots":2"#) && props.contains(r#""n_ctx":256"#), "{props}");
    assert!(applied.contains(r#"<|im_start|>user\nhi<|im_end|>"#), "--chat-template chatml: {applied}");
    assert!(done.contains(r#""tokens_predicted":3"#), "-n 3: {done}");
    assert!(metrics.contains("llamacpp:tokens_predicted_total 3"), "{metrics}");
}

/// The official `openai` and `anthropic` Python clients against `tine serve`
/// (`tests/openai_client.py`, `tests/anthropic_client.py`). `cargo xtask ci` installs the
/// pinned clients from PyPI into a venv and runs this with `TINE_CLIENT_PYTHON` pointing at
/// that venv's python.
#[test]
#[ignore = "needs TINE_CLIENT_PYTHON, a python with the openai and anthropic packages (cargo xtask ci sets it up)"]
fn the_official_openai_and_anthropic_clients_get_what_they_ask_for() {
    let python = std::env::var("TINE_CLIENT_PYTHON").expect("TINE_CLIENT_PYTHON must name a python with the openai and anthropic packages");
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny.gguf");
    TinyGemma3 { nextn: true, seed: 8, context: 8192, ..TinyGemma3::default() }.write(&model);
    // A ChatML template with Hermes tool calls, as Qwen-style GGUFs carry.
    let template = dir.path().join("tools.jinja");
    std::fs::write(
        &template,
        "{%- if tools %}<|im_start|>system\nCall a tool as <tool_call>{...}</tool_call>: {{ tools | tojson }}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    .expect("write template");
    let template = template.to_str().expect("utf-8");
    let served = Served::start(
        model.to_str().expect("utf-8"),
        &["-c", "4096", "-np", "2", "--alias", "tiny", "--api-key", "sk-test", "--chat-template", template, "--spec-type", "ngram", "--embeddings", "--pooling", "mean"],
    );
    let port = served.port;
    let mut failed = Vec::new();
    for script in ["openai_client.py", "anthropic_client.py"] {
        let path = format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR"));
        let out = Command::new(&python).args([&path, &format!("http://127.0.0.1:{port}")]).output().expect("run a client script");
        println!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if !out.status.success() {
            failed.push(script);
        }
    }
    drop(served);
    assert!(failed.is_empty(), "client checks failed in {failed:?} (report above)");
}

/// Issue 52: the chat page at `/` in a real headless Chromium (`tests/webui_page.py`, Playwright
/// for Python driving Debian's `chromium`), over the real default model with an API key and
/// n-gram drafts: the key asked for (a wrong one refused in words), a streamed reply with its
/// rate, draft counts and marked drafts, a stopped reply, the conversation after a reload, a
/// server error in words. `cargo xtask ci` runs it where chromium is installed, with
/// `TINE_BROWSER_PYTHON` naming a python that has Playwright; it writes the README's screenshot
/// to `TINE_WEBUI_SCREENSHOT` (else a temporary file).
#[test]
#[ignore = "needs TINE_BROWSER_PYTHON (a python with playwright), chromium and the default model (cargo xtask ci sets them up)"]
fn the_chat_page_works_in_a_real_browser() {
    let python = std::env::var("TINE_BROWSER_PYTHON").expect("TINE_BROWSER_PYTHON must name a python with playwright");
    let model = tine_runtime::default_model_path();
    assert!(model.exists(), "the default model is not at {} (cargo xtask fetch-model)", model.display());
    let dir = tempfile::tempdir().expect("tempdir");
    let shot = std::env::var("TINE_WEBUI_SCREENSHOT").map(std::path::PathBuf::from).unwrap_or_else(|_| dir.path().join("webui.png"));
    let served = Served::start(model.to_str().expect("utf-8"), &["-c", "2048", "--api-key", "sk-page", "--spec-type", "ngram"]);
    let port = served.port;
    let script = format!("{}/tests/webui_page.py", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(&python).args([&script, &format!("http://127.0.0.1:{port}"), "sk-page", shot.to_str().expect("utf-8")]).output().expect("run the browser test");
    drop(served);
    println!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the chat page failed in the browser (report above)");
    assert!(shot.metadata().is_ok_and(|m| m.len() > 10_000), "no screenshot at {}", shot.display());
}

#[test]
fn device_flag_runs_on_the_cpu_and_names_a_missing_cuda_build() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (target, _, _) = fixtures(dir.path());
    let base = ["generate", "-m", &target, "-p", "hello world", "-n", "8", "--temp", "0", "--ignore-eos"];
    let (ok, want, err) = tine(&base);
    assert!(ok, "{err}");
    let with = |extra: &[&'static str]| tine(&base.iter().copied().chain(extra.iter().copied()).collect::<Vec<_>>());
    let (ok, got, err) = with(&["--device", "cpu"]);
    assert!(ok && got == want, "{err}");
    let (ok, _, err) = with(&["--device", "tpu"]);
    assert!(!ok && err.contains("unknown device `tpu`"), "{err}");
    if !tine_runtime::CUDA_COMPILED {
        let (ok, _, err) = with(&["--device", "cuda:0"]);
        assert!(!ok && err.contains("built without CUDA"), "{err}");
    }
}

/// Issue 52: docs/server.md names every flag `tine serve --help` lists, and carries the help text
/// itself as the binary prints it (so the page cannot drift from the code).
#[test]
fn every_serve_flag_is_on_the_server_page() {
    let out = Command::new(env!("CARGO_BIN_EXE_tine")).args(["serve", "--help"]).output().expect("tine serve --help");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).expect("utf-8 help");
    let page_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../docs/server.md");
    let page = std::fs::read_to_string(&page_path).expect("docs/server.md");
    // The option lines (`  -m, --model <MODEL>`, `      --metrics`), not their descriptions.
    let flags: Vec<&str> = help.lines().map(str::trim_start).filter(|l| l.starts_with('-')).filter_map(|l| l.split([' ', ',', '<']).find(|w| w.starts_with("--"))).filter(|f| *f != "--help").collect();
    assert!(flags.len() > 40 && flags.contains(&"--parallel") && flags.contains(&"--no-webui"), "{flags:?}");
    // Named as a whole word: `--keep` is not found inside `--keep-alive`.
    let named = |f: &str| page.match_indices(f).any(|(i, _)| !page[i + f.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_'));
    let missing: Vec<&&str> = flags.iter().filter(|f| !named(f)).collect();
    assert!(missing.is_empty(), "docs/server.md does not name {missing:?}");
    assert!(page.contains(help.trim_end()), "docs/server.md's copy of `tine serve --help` differs from the binary's: paste it again (the block under \"Every flag\")");
}
