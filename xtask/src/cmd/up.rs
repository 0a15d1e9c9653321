//! `cargo xtask up`: the main job (chain, verify, model, build `tine`, graft the NextN drafter, generate).

use std::process::{Command, ExitCode};

use patchchain::Project;

use super::{setup, step};

pub fn run(p: &Project, prompt: &str) -> anyhow::Result<ExitCode> {
    let model = setup(p)?;
    let cargo = patchchain::base::cargo_bin();
    step("build tine (release)", Command::new(&cargo).args(["build", "--release", "-p", "tine-cli", "--manifest-path"]).arg(p.root.join("Cargo.toml")))?;
    let tine = p.root.join("target/release/tine");
    // The best shipped drafter for the default model: its NextN head, grafted into a copy.
    let head = p.root.join("drafters/gemma3-270m-nextn.gguf");
    let grafted = p.root.join("target/drafters/gemma-3-270m-q4_k_m-nextn.gguf");
    step("graft the NextN drafter", Command::new(&tine).args(["graft-nextn", "--target"]).arg(&model).arg("--head").arg(&head).arg("-o").arg(&grafted))?;
    step("tine generate (speculative: draft-mtp)", Command::new(&tine).args(["generate", "--temp", "0", "-n", "64", "--spec-type", "draft-mtp", "-m"]).arg(&grafted).args(["-p", prompt]))?;
    eprintln!("\nserve it:  {} serve --model {} --spec-type draft-mtp --host 127.0.0.1 --port 8080 --parallel 2", p.rel(&tine), p.rel(&grafted));
    Ok(ExitCode::SUCCESS)
}
