//! Tine's subcommands beyond the generic chain commands ([`patchchain::commands`]), one file each;
//! `main.rs` parses the command line and dispatches here.

use std::process::{Command, ExitCode};
use std::time::Duration;

use patchchain::{commands, Project};

pub mod bench;
pub mod ci;
pub mod fuzz;
pub mod gate;
pub mod sync_check;
pub mod up;
pub mod verify;

/// The spinner every command reports progress on.
pub fn progress() -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_style(indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}] {wide_bar} {pos}/{len}").expect("valid template").progress_chars("=> "));
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// Chain, verify, model: everything a fresh clone needs before `tine` runs.
pub fn setup(p: &Project) -> anyhow::Result<std::path::PathBuf> {
    commands::apply_chain(p, None, &progress())?;
    if verify::run(p, &progress())? != ExitCode::SUCCESS {
        anyhow::bail!("verify failed");
    }
    crate::model::fetch(false)
}

/// Runs one step of a job, its output on the terminal.
pub fn step(name: &str, cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("==> {name}");
    let status = cmd.status().map_err(|e| anyhow::anyhow!("{name}: cannot start: {e}"))?;
    if !status.success() {
        anyhow::bail!("{name} failed ({status})");
    }
    Ok(())
}
