//! `cargo xtask verify`: [`patchchain::verify`]'s report on the terminal.

use std::process::ExitCode;

use patchchain::{verify, Project};

pub fn run(p: &Project, pb: &indicatif::ProgressBar) -> anyhow::Result<ExitCode> {
    let start = std::time::Instant::now();
    let report = verify::verify(p, pb)?;
    pb.finish_and_clear();
    print!("{}", report.render());
    if report.passed() {
        println!("verify: ok ({:.0} ms)", start.elapsed().as_secs_f64() * 1e3);
        Ok(ExitCode::SUCCESS)
    } else {
        println!("verify: FAILED at step(s) {}", report.failures().iter().map(|s| s.number.to_string()).collect::<Vec<_>>().join(", "));
        Ok(ExitCode::from(1))
    }
}
