//! `cargo xtask ci`: every test (what `.ci/run` calls).

use std::process::{Command, ExitCode};

use patchchain::{chain, sync_check, Project};

use super::{setup, step};
use crate::tine::Tine;

/// The Python packages the client tests pin: the official `openai` (what the users
/// ran) and `anthropic` clients, and sglang-router (the router `tools/serve_cluster.py` puts
/// in front of replicas), as (pip name, module, version).
const CLIENTS: [(&str, &str, &str); 3] = [("openai", "openai", "3.57.0"), ("anthropic", "anthropic", "2.17.0"), ("sglang-router", "sglang_router", "0.3.2")];

/// A venv under `target/` with the pinned client packages, made once and reused.
fn client_venv(p: &Project) -> anyhow::Result<std::path::PathBuf> {
    let venv = p.root.join("target/client-venv");
    let python = venv.join("bin/python");
    let has = |name: &str, version: &str| Command::new(&python).args(["-c", &format!("import {name}, sys; sys.exit({name}.__version__ != {version:?})")]).status().is_ok_and(|s| s.success());
    if !venv.join("bin/python").exists() {
        step("python3 -m venv target/client-venv", Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    for (name, module, version) in CLIENTS {
        if !has(module, version) {
            step(&format!("pip install {name}=={version}"), Command::new(&python).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", &format!("{name}=={version}")]))?;
            anyhow::ensure!(has(module, version), "{name} {version} is not importable from {} after installing it", python.display());
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
