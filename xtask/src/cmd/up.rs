//! `cargo xtask up`: the main job (chain, verify, model, build `tine`, graft the NextN drafter, generate).

use std::process::{Command, ExitCode};

use anyhow::Context;

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
    // Plain and speculative decoding of the same prompt, side by side, at temperature 0 (where
    // the measured speedups are: docs/evaluations/spec-adaptive.md). Same seed and greedy, so
    // the two texts are identical; only the speed differs.
    let mut runs = Vec::new();
    for (label, spec) in [("plain", &[][..]), ("speculative (draft-mtp)", &["--spec-type", "draft-mtp"][..])] {
        eprintln!("==> tine generate, {label}");
        let json = grafted.with_extension(format!("{}.json", if spec.is_empty() { "plain" } else { "spec" }));
        let out = Command::new(&tine).args(["generate", "--temp", "0", "-n", "128", "-m"]).arg(&grafted).args(spec).args(["-p", prompt, "--json"]).arg(&json).output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(out.status.success(), "tine generate ({label}) failed:\n{stderr}");
        print!("{}", String::from_utf8_lossy(&out.stdout));
        eprintln!("{}", stderr.lines().rev().find(|l| l.contains("generated:")).unwrap_or_default());
        // The figures from the typed report `--json` writes, not from the human summary.
        let report: tine_report::GenerateReport =
            tine_report::from_slice(&std::fs::read(&json).with_context(|| format!("tine generate ({label}) wrote no {}", json.display()))?).with_context(|| format!("reading {}", json.display()))?;
        runs.push((label, report));
    }
    let (plain, spec) = (&runs[0].1, &runs[1].1);
    anyhow::ensure!(plain.ids == spec.ids, "speculative decoding changed the greedy tokens");
    eprintln!(
        "\ndecode: plain {:.1} tok/s, speculative {:.1} tok/s: {:.2}x, the same tokens",
        plain.predicted_per_second,
        spec.predicted_per_second,
        spec.predicted_per_second / plain.predicted_per_second
    );
    eprintln!("\nserve it:  {} serve --model {} --spec-type draft-mtp --host 127.0.0.1 --port 8080 --parallel 2", p.rel(&tine), p.rel(&grafted));
    Ok(ExitCode::SUCCESS)
}
