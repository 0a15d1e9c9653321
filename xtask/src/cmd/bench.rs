//! `cargo xtask bench three-way` / `bench spec`: build what the benchmarks need and run the scripts in `bench/`.

use std::process::{Command, ExitCode};

use patchchain::Project;

use super::{setup, step};

/// Which benchmark, with its options (see `cargo xtask bench --help`).
pub enum Which {
    ThreeWay { rounds: usize },
    Spec { types: Vec<String>, llama_types: Vec<String>, depths: String, rounds: usize, server: Vec<String> },
}

pub fn run(p: &Project, which: Which) -> anyhow::Result<ExitCode> {
    let model = setup(p)?;
    let cargo = patchchain::base::cargo_bin();
    step("build tine (release)", Command::new(&cargo).args(["build", "--release", "-p", "tine-cli", "--manifest-path"]).arg(p.root.join("Cargo.toml")))?;
    let tine = p.root.join("target/release/tine");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = format!("cargo xtask {}", args.join(" "));
    let mut py = Command::new("python3");
    match which {
        Which::ThreeWay { rounds } => {
            step(
                "build the stock-candle harness (release, the pristine pinned base)",
                Command::new(&cargo).args(["build", "--release", "--manifest-path"]).arg(p.root.join("bench/stock-candle/Cargo.toml")).arg("--target-dir").arg(p.root.join("target/stock-candle")),
            )?;
            if std::env::var_os("LLAMA_SERVER").is_none() {
                eprintln!("note: LLAMA_SERVER is not set; llama.cpp is left out (build llama.cpp's llama-server and set LLAMA_SERVER=/path/to/llama-server)");
            }
            py.arg(p.root.join("bench/three_way.py")).arg("--model").arg(&model).args(["--rounds", &rounds.to_string(), "--command", &command]);
        }
        Which::Spec { types, llama_types, depths, rounds, server } => {
            let cpu = std::fs::read_to_string("/proc/cpuinfo")
                .ok()
                .and_then(|c| c.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_owned()))
                .unwrap_or_default();
            let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            py.arg(p.root.join("bench/spec_http.py")).args(["--depths", &depths, "--rounds", &rounds.to_string(), "--command", &command, "--machine", &format!("{cores} cores, {cpu}")]);
            let notes = p.root.join("docs/evaluations/mtp-notes.md");
            if notes.exists() {
                py.arg("--notes").arg(notes);
            }
            let serve = |m: &std::path::Path, extra: &str| format!("{} serve -m {} --host 127.0.0.1 --port {{port}} -c 4096 --parallel 1 {extra}", tine.display(), m.display());
            for t in &types {
                let line = match t.as_str() {
                    "ngram" => serve(&model, "--spec-type ngram"),
                    "draft" => serve(&model, &format!("--spec-type draft -md {}", model.display())),
                    "draft-assistant" => {
                        let head = p.root.join("drafters/gemma3-270m-assistant.gguf");
                        if !head.exists() {
                            eprintln!("note: draft-assistant left out: no {}", p.rel(&head));
                            continue;
                        }
                        serve(&model, &format!("--spec-type draft-assistant --mtp-head {}", head.display()))
                    }
                    "draft-mtp" => {
                        let head = p.root.join("drafters/gemma3-270m-nextn.gguf");
                        if !head.exists() {
                            eprintln!("note: draft-mtp left out: no {}", p.rel(&head));
                            continue;
                        }
                        let grafted = p.root.join("target/drafters/gemma-3-270m-q4_k_m-nextn.gguf");
                        step("graft the NextN head", Command::new(&tine).args(["graft-nextn", "--target"]).arg(&model).arg("--head").arg(&head).arg("-o").arg(&grafted))?;
                        serve(&grafted, "--spec-type draft-mtp")
                    }
                    other => anyhow::bail!("unknown spec type {other:?} (ngram, draft, draft-mtp, draft-assistant)"),
                };
                py.arg("--server").arg(format!("tine {t}={line}"));
            }
            match std::env::var("LLAMA_SERVER") {
                Ok(ls) => {
                    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
                    // llama.cpp's n-gram types ignore a request's `speculative.n_max`: each runs at
                    // its own setting, against a spec-off llama.cpp server in the same run.
                    let llama = |extra: &str| format!("{ls} -m {} --host 127.0.0.1 --port {{port}} -c 4096 -np 1 -t {threads} -tb {threads} --no-webui {extra}", model.display());
                    py.arg("--server").arg(format!("base:llama.cpp spec off={}", llama("")));
                    for t in &llama_types {
                        py.arg("--server").arg(format!("fixed:llama.cpp {t}={}", llama(&format!("--spec-type {t}"))));
                    }
                }
                Err(_) => eprintln!("note: LLAMA_SERVER is not set; llama.cpp is left out"),
            }
            for s in &server {
                py.arg("--server").arg(s);
            }
        }
    }
    step("benchmark", &mut py)?;
    Ok(ExitCode::SUCCESS)
}
