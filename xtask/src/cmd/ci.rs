//! `cargo xtask ci`: every test (what `.ci/run` calls).

use std::process::{Command, ExitCode};

use patchchain::{chain, sync_check, Project};

use super::{setup, step};
use crate::tine::Tine;

/// The Python packages the client tests pin: the official `openai` (what the users
/// ran) and `anthropic` clients, sglang-router (the router `tools/serve_cluster.py` puts
/// in front of replicas) and Playwright (the chat page's browser test), as (pip name, module,
/// version).
const CLIENTS: [(&str, &str, &str); 4] = [("openai", "openai", "3.57.0"), ("anthropic", "anthropic", "2.17.0"), ("sglang-router", "sglang_router", "0.3.2"), ("playwright", "playwright", PLAYWRIGHT)];

/// Playwright for Python, which drives Debian's chromium in the chat page's browser test (its
/// own browser downloads are never used).
const PLAYWRIGHT: &str = "1.65.3";

/// Debian's chromium for the chat page's browser test: found on `PATH`, else installed with
/// apt-get where this runs as root (CI); `None` (the test is skipped, and says so) elsewhere.
fn chromium() -> Option<std::path::PathBuf> {
    let find = || std::env::var_os("PATH").and_then(|paths| std::env::split_paths(&paths).flat_map(|d| ["chromium", "chromium-browser"].map(|n| d.join(n))).find(|p| p.is_file()));
    if let Some(p) = find() {
        return Some(p);
    }
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    if !root {
        return None;
    }
    eprintln!("==> apt-get install chromium (the chat page's browser test)");
    let quiet = |args: &[&str]| Command::new("apt-get").args(args).env("DEBIAN_FRONTEND", "noninteractive").status().is_ok_and(|s| s.success());
    if !(quiet(&["update", "-qq"]) && quiet(&["install", "-y", "-qq", "--no-install-recommends", "chromium", "fonts-dejavu-core"])) {
        eprintln!("    apt-get could not install chromium");
        return None;
    }
    find()
}

/// A venv under `target/` with the pinned client packages, made once and reused.
fn client_venv(p: &Project) -> anyhow::Result<std::path::PathBuf> {
    let venv = p.root.join("target/client-venv");
    let python = venv.join("bin/python");
    // The installed distribution's version (Playwright's module has no `__version__`), and the
    // module importable.
    let has = |pip: &str, module: &str, version: &str| {
        Command::new(&python).args(["-c", &format!("import importlib.metadata as m, sys; import {module}; sys.exit(m.version({pip:?}) != {version:?})")]).status().is_ok_and(|s| s.success())
    };
    if !venv.join("bin/python").exists() {
        step("python3 -m venv target/client-venv", Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    for (name, module, version) in CLIENTS {
        if !has(name, module, version) {
            step(&format!("pip install {name}=={version}"), Command::new(&python).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", &format!("{name}=={version}")]))?;
            anyhow::ensure!(has(name, module, version), "{name} {version} is not importable from {} after installing it", python.display());
        }
    }
    Ok(python)
}

pub fn run(p: &Project) -> anyhow::Result<ExitCode> {
    let cargo = patchchain::base::cargo_bin();
    let xtask_manifest = p.root.join("xtask/Cargo.toml");
    let engine_manifest = p.root.join("Cargo.toml");
    // Formatting first: it needs no build and fails in a second. (`cargo fmt` finds a
    // workspace's members from the working directory; `--manifest-path` alone misses them.)
    step("cargo fmt --check (xtask)", Command::new(&cargo).args(["fmt", "--check"]).current_dir(p.root.join("xtask")))?;
    // Set-up next, so the tests that need the live tree and the real model have them.
    eprintln!("==> set-up (apply-chain, verify, fetch-model)");
    setup(p)?;
    // The engine workspace's formatting covers the patches' test files (tine-patch-tests builds
    // them from engine/upstream/), so it needs the chain applied.
    step("cargo fmt --check (engine)", Command::new(&cargo).args(["fmt", "--check"]).current_dir(&p.root))?;
    step("cargo clippy (xtask)", Command::new(&cargo).args(["clippy", "--workspace", "--all-targets", "--manifest-path"]).arg(&xtask_manifest).args(["--", "-D", "warnings"]))?;
    step("xtask tests", Command::new(&cargo).args(["test", "--workspace", "--manifest-path"]).arg(&xtask_manifest))?;
    eprintln!("==> sync-check");
    let problems = sync_check::sync_check(p, &Tine, &chain::load_registry(p)?);
    if !problems.is_empty() {
        anyhow::bail!("sync-check: {}", problems.join("\n  "));
    }
    step("engine tests", Command::new(&cargo).args(["test", "--workspace", "--manifest-path"]).arg(&engine_manifest))?;
    // The official OpenAI and Anthropic Python clients against `tine serve`, from a venv of their own.
    let python = client_venv(p)?;
    step(
        "python clients (tine-cli's the_official_openai_and_anthropic_clients_get_what_they_ask_for)",
        Command::new(&cargo)
            .args(["test", "-p", "tine-cli", "--test", "cli", "--manifest-path"])
            .arg(&engine_manifest)
            .args(["--", "--ignored", "--exact", "the_official_openai_and_anthropic_clients_get_what_they_ask_for"])
            .env("TINE_CLIENT_PYTHON", &python),
    )?;
    step(
        "replicas behind sglang-router (tine-cli's router test)",
        Command::new(&cargo).args(["test", "-p", "tine-cli", "--test", "router", "--manifest-path"]).arg(&engine_manifest).args(["--", "--ignored"]).env("TINE_CLIENT_PYTHON", &python),
    )?;
    // The chat page in a real browser; its screenshot is the README's.
    match chromium() {
        Some(browser) => step(
            "the chat page in chromium (tine-cli's the_chat_page_works_in_a_real_browser)",
            Command::new(&cargo)
                .args(["test", "-p", "tine-cli", "--test", "cli", "--manifest-path"])
                .arg(&engine_manifest)
                .args(["--", "--ignored", "--exact", "the_chat_page_works_in_a_real_browser"])
                .env("TINE_BROWSER_PYTHON", &python)
                .env("TINE_CHROMIUM", browser),
        )?,
        None => eprintln!("==> skipped: the chat page's browser test (no chromium; apt-get install chromium)"),
    }
    // Our crates only (`--no-deps`): candle's own code is upstream's, linted by upstream.
    step("cargo clippy (engine)", Command::new(&cargo).args(["clippy", "--workspace", "--all-targets", "--no-deps", "--manifest-path"]).arg(&engine_manifest).args(["--", "-D", "warnings"]))?;
    // Last, as the longest step: an instrumented build of the fuzz workspace, then every target
    // for a bounded time; the gguf and tokenizer targets build the patched candle in engine/upstream/.
    if super::fuzz::run(p, &[], super::fuzz::DEFAULT_SECONDS, super::fuzz::CI_SEED)? != ExitCode::SUCCESS {
        anyhow::bail!("fuzz found a crash (artifact above)");
    }
    eprintln!("ci: all green");
    Ok(ExitCode::SUCCESS)
}
