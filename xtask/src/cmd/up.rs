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
    // Plain and speculative decoding of the same prompt, side by side, at temperature 0 (where
    // the measured speedups are: docs/evaluations/spec-adaptive.md). Same seed and greedy, so
    // the two texts are identical; only the speed differs.
    let mut rates = Vec::new();
    for (label, spec) in [("plain", &[][..]), ("speculative (draft-mtp)", &["--spec-type", "draft-mtp"][..])] {
        eprintln!("==> tine generate, {label}");
        let out = Command::new(&tine).args(["generate", "--temp", "0", "-n", "128", "-m"]).arg(&grafted).args(spec).args(["-p", prompt]).output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(out.status.success(), "tine generate ({label}) failed:\n{stderr}");
        print!("{}", String::from_utf8_lossy(&out.stdout));
        let summary = stderr.lines().rev().find(|l| l.contains("generated:")).unwrap_or_default().to_owned();
        eprintln!("{summary}");
        rates.push((label, decode_rate(&summary).ok_or_else(|| anyhow::anyhow!("no decode rate in tine generate's summary: {summary:?}"))?, out.stdout));
    }
    anyhow::ensure!(rates[0].2 == rates[1].2, "speculative decoding changed the greedy text");
    eprintln!("\ndecode: plain {:.1} tok/s, speculative {:.1} tok/s: {:.2}x, the same text", rates[0].1, rates[1].1, rates[1].1 / rates[0].1);
    eprintln!("\nserve it:  {} serve --model {} --spec-type draft-mtp --host 127.0.0.1 --port 8080 --parallel 2", p.rel(&tine), p.rel(&grafted));
    Ok(ExitCode::SUCCESS)
}

/// The `(Y tok/s)` after `generated:` in `tine generate`'s summary line.
fn decode_rate(summary: &str) -> Option<f64> {
    let after = summary.split("generated:").nth(1)?;
    let open = after.find('(')?;
    after[open + 1..].split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_decode_rate_is_read_from_tine_generates_summary() {
        let line = "prompt: 5 tokens in 439.7 ms (11.4 tok/s) | generated: 16 tokens in 1855.5 ms (8.1 tok/s) | stop: limit";
        assert_eq!(super::decode_rate(line), Some(8.1));
        assert_eq!(super::decode_rate("nothing here"), None);
    }
}
