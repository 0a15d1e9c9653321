//! Grafting a NextN head into a copy of its target GGUF (`tine graft-nextn`).
//!
//! A NextN head ships as a small GGUF holding only its block, `blk.L.*` with `L` the target's
//! `block_count`, plus `blk.L.nextn.*` and optional `gemma3.nextn.*` metadata (the draft
//! vocabulary). The grafted file is the target with those tensors appended, `block_count` raised
//! by one and `nextn_predict_layers = 1`: the layout `--spec-type draft-mtp` reads.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::Device;

#[derive(Debug, thiserror::Error)]
pub enum GraftError {
    #[error("cannot open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a readable GGUF file")]
    Gguf {
        path: PathBuf,
        #[source]
        source: candle_core::Error,
    },
    #[error("{path}: {what}")]
    Mismatch { path: PathBuf, what: String },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
    WriteGguf {
        path: PathBuf,
        #[source]
        source: candle_core::Error,
    },
}

/// What a graft did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grafted {
    /// The head's block index (the target's old `block_count`).
    pub block: usize,
    pub head_tensors: usize,
    /// Tokens of the head's draft vocabulary, if it has one.
    pub draft_vocab: Option<usize>,
}

fn open(path: &Path) -> Result<(gguf_file::Content, BufReader<File>), GraftError> {
    let file = File::open(path).map_err(|source| GraftError::Open { path: path.to_owned(), source })?;
    let mut r = BufReader::new(file);
    let ct = gguf_file::Content::read(&mut r).map_err(|source| GraftError::Gguf { path: path.to_owned(), source })?;
    Ok((ct, r))
}

fn u32_of(ct: &gguf_file::Content, key: &str) -> Option<usize> {
    ct.metadata.get(key).and_then(|v| v.to_u32().ok()).map(|v| v as usize)
}

/// Writes `out` = `target` + the NextN head in `head`, atomically (a temporary file renamed).
pub fn graft_nextn(target: &Path, head: &Path, out: &Path) -> Result<Grafted, GraftError> {
    let (tct, mut tr) = open(target)?;
    let (hct, mut hr) = open(head)?;
    let mismatch = |path: &Path, what: String| GraftError::Mismatch { path: path.to_owned(), what };
    let arch = tct.metadata.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
    if arch != "gemma3" {
        return Err(mismatch(target, format!("architecture `{arch}`: grafting supports gemma3 targets")));
    }
    let blocks = u32_of(&tct, "gemma3.block_count").ok_or_else(|| mismatch(target, "no gemma3.block_count".into()))?;
    if u32_of(&tct, "gemma3.nextn_predict_layers").unwrap_or(0) > 0 {
        return Err(mismatch(target, "already has a NextN head (gemma3.nextn_predict_layers > 0)".into()));
    }
    let prefix = format!("blk.{blocks}.");
    if let Some(stray) = hct.tensor_infos.keys().find(|n| !n.starts_with(&prefix)) {
        return Err(mismatch(head, format!("tensor {stray} is not in block {blocks}: a head for this target holds only `{prefix}*` (its block index is the target's block_count)")));
    }
    if !hct.tensor_infos.contains_key(&format!("{prefix}nextn.eh_proj.weight")) {
        return Err(mismatch(head, format!("no {prefix}nextn.eh_proj.weight: not a NextN head for a {blocks}-block target")));
    }
    for key in ["embedding_length", "attention.key_length", "attention.head_count_kv"] {
        let (t, h) = (u32_of(&tct, &format!("gemma3.{key}")), u32_of(&hct, &format!("gemma3.{key}")));
        if h.is_some() && h != t {
            return Err(mismatch(head, format!("gemma3.{key} is {}, the target's is {}", h.unwrap_or(0), t.unwrap_or(0))));
        }
    }
    let dev = Device::Cpu;
    let read_all = |ct: &gguf_file::Content, r: &mut BufReader<File>, path: &Path| -> Result<Vec<(String, QTensor)>, GraftError> {
        let mut names: Vec<(&String, u64)> = ct.tensor_infos.iter().map(|(n, i)| (n, i.offset)).collect();
        names.sort_by_key(|(_, off)| *off);
        names.into_iter().map(|(n, _)| ct.tensor(r, n, &dev).map(|t| (n.clone(), t)).map_err(|source| GraftError::Gguf { path: path.to_owned(), source })).collect()
    };
    let mut tensors = read_all(&tct, &mut tr, target)?;
    let head_tensors = read_all(&hct, &mut hr, head)?;
    let n_head = head_tensors.len();
    tensors.extend(head_tensors);
    use gguf_file::Value;
    let mut md: Vec<(String, Value)> = tct.metadata.iter().filter(|(k, _)| *k != "gemma3.block_count" && *k != "gemma3.nextn_predict_layers").map(|(k, v)| (k.clone(), v.clone())).collect();
    md.push(("gemma3.block_count".into(), Value::U32(blocks as u32 + 1)));
    md.push(("gemma3.nextn_predict_layers".into(), Value::U32(1)));
    let mut draft_vocab = None;
    for (k, v) in &hct.metadata {
        if k.starts_with("gemma3.nextn.") {
            if k == "gemma3.nextn.draft_vocab" {
                draft_vocab = v.to_vec().ok().map(|a| a.len());
            }
            md.push((k.clone(), v.clone()));
        }
    }
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let tmp = out.with_extension("gguf.partial");
    let write = || -> Result<(), GraftError> {
        let mut f = File::create(&tmp).map_err(|source| GraftError::Write { path: tmp.clone(), source })?;
        let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut f, &md_refs, &t_refs).map_err(|source| GraftError::WriteGguf { path: tmp.clone(), source })?;
        f.sync_all().map_err(|source| GraftError::Write { path: tmp.clone(), source })?;
        std::fs::rename(&tmp, out).map_err(|source| GraftError::Write { path: out.to_owned(), source })
    };
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| GraftError::Write { path: dir.to_owned(), source })?;
    }
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    Ok(Grafted { block: blocks, head_tensors: n_head, draft_vocab })
}
