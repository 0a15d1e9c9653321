//! The reports `tine` writes as JSON and other programs read (`cargo xtask up`, the gate
//! runner, the device comparisons): one type per report, written by the command that makes it
//! and read back with serde, so a renamed or missing field is a compile error on the writer's
//! side and a named error on the reader's, never a silent 0.
//!
//! Plain data with serde only: xtask, which builds before the engine's candle exists, depends
//! on this crate by path.

use serde::{Deserialize, Serialize};

/// Reads a report from `bytes`, naming what is wrong.
pub fn from_slice<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    serde_json::from_slice(bytes)
}

/// `tine generate --json FILE`: one generation's ids, timings and drafting figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateReport {
    pub model: String,
    pub device: String,
    pub engine: String,
    pub prompt_ids: Vec<u32>,
    pub ids: Vec<u32>,
    /// `eos`, `limit` or `word`; none when generation did not end.
    pub stop: Option<String>,
    /// From the start of the prompt's evaluation to the first token's text.
    pub first_token_ms: Option<f64>,
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub prompt_per_second: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    /// Decode speed (the first token, sampled from the prompt pass, not counted).
    pub predicted_per_second: f64,
    pub draft_n: usize,
    pub draft_n_accepted: usize,
    pub draft_verify_steps: usize,
}

/// `tine logit-equiv --json FILE`: speculative decoding against plain decoding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogitEquivReport {
    pub model: String,
    pub n_predict: i32,
    pub tie_margin: f32,
    pub results: Vec<LogitEquivRow>,
    /// Every row exact.
    pub exact: bool,
}

/// One spec type at one draft depth, over every prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogitEquivRow {
    pub spec_type: String,
    pub depth: usize,
    pub positions: usize,
    pub real_disagreements: usize,
    /// Argmax disagreements past the tie margin, per position.
    pub real_frac: f64,
    pub frac_full_agree: f64,
    pub mean_top1_mae: f64,
    pub max_abs_logit_diff: f64,
    pub greedy_identical_prompts: usize,
    pub prompts: usize,
    pub draft_n: usize,
    pub draft_n_accepted: usize,
    pub draft_verify_steps: usize,
    /// Every figure zero and greedy output identical.
    pub exact: bool,
}

/// `tine spec-bench --out FILE.md` (the JSON beside it): speed and acceptance per config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpecBenchReport {
    pub n_predict: i32,
    pub rounds: usize,
    pub rows: Vec<SpecBenchRow>,
}

/// One prompt set, temperature and config, medians over the rounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpecBenchRow {
    pub set: String,
    pub temperature: f32,
    /// `plain`, or `<spec type> d<depth>` (and ` adaptive`).
    pub config: String,
    pub adaptive: bool,
    pub accept: f64,
    /// Tokens per verify forward.
    pub tau: f64,
    /// Decode tokens per second.
    pub tps: f64,
    pub speedup: f64,
    pub draft_n: usize,
    pub draft_n_accepted: usize,
    pub draft_verify_steps: usize,
    /// Runs whose tokens equal plain decoding's.
    pub identical: usize,
    pub runs: usize,
}

impl SpecBenchReport {
    /// The row of `config` (the first prompt set's, at any temperature), if any.
    pub fn row(&self, config: &str) -> Option<&SpecBenchRow> {
        self.rows.iter().find(|r| r.config == config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_missing_a_field_is_refused_by_name_not_read_as_zero() {
        let json = r#"{"n_predict": 96, "rounds": 1, "rows": [{"set": "mtp9", "temperature": 0.0, "config": "ngram d3", "adaptive": false, "tau": 3.9, "tps": 150.0, "speedup": 2.0, "draft_n": 10, "draft_n_accepted": 9, "draft_verify_steps": 3, "identical": 9, "runs": 9}]}"#;
        let err = from_slice::<SpecBenchReport>(json.as_bytes()).expect_err("accept is missing");
        assert!(err.to_string().contains("accept"), "{err}");
        let ok = json.replace("\"tau\"", "\"accept\": 0.9, \"tau\"");
        let r: SpecBenchReport = from_slice(ok.as_bytes()).expect("complete");
        assert_eq!(r.row("ngram d3").map(|r| r.accept), Some(0.9));
        assert!(r.row("plain").is_none());
    }
}
