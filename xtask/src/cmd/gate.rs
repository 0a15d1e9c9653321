//! `cargo xtask gate`: run patches' gate suites ([`crate::gate`]) and report.

use std::process::ExitCode;

use patchchain::{chain, registry, Extension as _, Project};

use crate::gate;
use crate::tine::Tine;

pub fn run(p: &Project, patch: Option<&str>, all: bool, list: bool, revert: bool, pb: &indicatif::ProgressBar) -> anyhow::Result<ExitCode> {
    if list {
        pb.finish_and_clear();
        print!("{}", gate::render_list(&chain::load_registry(p)?));
        return Ok(ExitCode::SUCCESS);
    }
    let problems = registry::lint(&chain::load_registry(p)?, &|r, e, g| Tine.check_gate(r, e, g), Tine.areas());
    if !problems.is_empty() {
        pb.finish_and_clear();
        anyhow::bail!("the registry has problems; fix them first:\n  {}", problems.join("\n  "));
    }
    let l = chain::load_all(p, pb)?;
    let indices: Vec<usize> = if all {
        (0..l.patches.len()).collect()
    } else {
        let n = chain::resolve_to(&l.patches, patch)?;
        if n == 0 {
            anyhow::bail!("0000 is the pristine base; it has no gates");
        }
        vec![n - 1]
    };
    let mut failed = Vec::new();
    let mut summary = Vec::new();
    for i in indices {
        let id = l.patches[i].entry.id.clone();
        let outcomes = gate::run_patch(p, &l, i, &gate::Options { revert }, pb)?;
        pb.suspend(|| println!("{}", gate::render_table(&id, &outcomes)));
        let ok = outcomes.iter().all(|o| o.passed);
        summary.push(format!("{id} {}", if ok { "pass" } else { "FAIL" }));
        if !ok {
            failed.push(id);
        }
    }
    pb.finish_and_clear();
    if all {
        println!("gates: {}", summary.join(", "));
    }
    let what = if revert { " (sources reverted)" } else { "" };
    if failed.is_empty() {
        println!("gate{what}: every gate passed; JSON under target/gates/");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("gate{what}: FAILED for {}; JSON and logs under target/gates/", failed.join(", "));
        Ok(ExitCode::from(1))
    }
}
