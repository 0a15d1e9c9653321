//! `cargo xtask ci`: every test (what `.ci/run` calls).

use std::process::{Command, ExitCode};

use patchchain::{chain, sync_check, Project};

use super::{setup, step};
use crate::tine::Tine;

pub fn run(p: &Project) -> anyhow::Result<ExitCode> {
    let cargo = patchchain::base::cargo_bin();
    // Set-up first, so the tests that need the live tree and the real model have them.
    eprintln!("==> set-up (apply-chain, verify, fetch-model)");
    setup(p)?;
    step("xtask tests", Command::new(&cargo).args(["test", "--workspace", "--manifest-path"]).arg(p.root.join("xtask/Cargo.toml")))?;
    // After the set-up: the gguf and tokenizer targets build the patched candle in engine/upstream/.
    if super::fuzz::run(p, &[], super::fuzz::DEFAULT_SECONDS)? != ExitCode::SUCCESS {
        anyhow::bail!("fuzz found a crash (artifact above)");
    }
    eprintln!("==> sync-check");
    let problems = sync_check::sync_check(p, &Tine, &chain::load_registry(p)?);
    if !problems.is_empty() {
        anyhow::bail!("sync-check: {}", problems.join("\n  "));
    }
    step("engine tests", Command::new(&cargo).args(["test", "--workspace", "--manifest-path"]).arg(p.root.join("Cargo.toml")))?;
    eprintln!("ci: all green");
    Ok(ExitCode::SUCCESS)
}
