//! `cargo xtask sync-check`: [`patchchain::sync_check`] with Tine's extension.

use std::process::ExitCode;

use patchchain::{chain, sync_check, Project};

use crate::tine::Tine;

pub fn run(p: &Project) -> anyhow::Result<ExitCode> {
    let reg = chain::load_registry(p)?;
    let problems = sync_check::sync_check(p, &Tine, &reg);
    if !problems.is_empty() {
        eprintln!("sync-check: {} problem(s):", problems.len());
        for pr in problems {
            eprintln!("  {pr}");
        }
        return Ok(ExitCode::from(1));
    }
    println!("sync-check: registry, patches/ and docs/UPSTREAM_SYNC.md agree ({} patch(es))", reg.patches.len());
    Ok(ExitCode::SUCCESS)
}
