//! `/metrics` (with `--metrics`): Prometheus text, llama-server's metric names where they
//! overlap (dashboards built for it keep working), Tine's own for the rest.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::scheduler::Summary;

/// Counters since the server started; updated once per finished or failed request.
#[derive(Debug, Default)]
pub struct Metrics {
    requests_ok: AtomicU64,
    requests_failed: AtomicU64,
    requests_refused: AtomicU64,
    prompt_tokens: AtomicU64,
    prompt_us: AtomicU64,
    predicted_tokens: AtomicU64,
    predicted_us: AtomicU64,
    cached_tokens: AtomicU64,
    draft_tokens: AtomicU64,
    draft_accepted: AtomicU64,
    draft_verify_steps: AtomicU64,
    /// Rounds that kept draft position `i` (llama-server's per-position acceptance).
    accepted_per_pos: [AtomicU64; tine_spec::MAX_DRAFT],
    /// The longest sequence a request ended with (prompt and generated tokens).
    n_tokens_max: AtomicU64,
}

/// What the scheduler holds right now.
pub struct Load {
    pub slots: usize,
    pub busy: usize,
    pub queued: usize,
    /// The prompt prefixes shared between slots.
    pub pool: crate::prefix_pool::PoolStats,
    /// The batched forwards over the slots' pending rows.
    pub batches: crate::scheduler::BatchCounts,
}

impl Metrics {
    pub fn finished(&self, s: &Summary) {
        let t = &s.timings;
        self.requests_ok.fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens.fetch_add(t.prompt_n as u64, Ordering::Relaxed);
        self.prompt_us.fetch_add((t.prompt_ms * 1e3) as u64, Ordering::Relaxed);
        self.predicted_tokens.fetch_add(t.predicted_n as u64, Ordering::Relaxed);
        self.predicted_us.fetch_add((t.predicted_ms * 1e3) as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(t.cached_n as u64, Ordering::Relaxed);
        self.draft_tokens.fetch_add(t.draft.draft_n as u64, Ordering::Relaxed);
        self.draft_accepted.fetch_add(t.draft.draft_n_accepted as u64, Ordering::Relaxed);
        self.draft_verify_steps.fetch_add(t.draft.draft_verify_steps as u64, Ordering::Relaxed);
        for (a, &n) in self.accepted_per_pos.iter().zip(&t.draft.accepted_per_pos) {
            a.fetch_add(n as u64, Ordering::Relaxed);
        }
        self.n_tokens_max.fetch_max((s.prompt_tokens + s.tokens.len()) as u64, Ordering::Relaxed);
    }

    pub fn failed(&self) {
        self.requests_failed.fetch_add(1, Ordering::Relaxed);
    }

    /// A request turned away at admission (503).
    pub fn refused(&self) {
        self.requests_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self, load: &Load) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let rate = |n: u64, us: u64| if us > 0 { n as f64 * 1e6 / us as f64 } else { 0.0 };
        let accept = if g(&self.draft_tokens) > 0 { g(&self.draft_accepted) as f64 / g(&self.draft_tokens) as f64 } else { 0.0 };
        let p = &load.pool;
        let b = load.batches;
        let per_decode = if b.forwards > 0 { b.forward_slots as f64 / b.forwards as f64 } else { 0.0 };
        let rows: [(&str, &str, &str, String); 34] = [
            ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens evaluated (not reused from a slot's cache).", g(&self.prompt_tokens).to_string()),
            ("llamacpp:prompt_seconds_total", "counter", "Time spent evaluating prompts.", (g(&self.prompt_us) as f64 / 1e6).to_string()),
            ("llamacpp:tokens_predicted_total", "counter", "Tokens generated.", g(&self.predicted_tokens).to_string()),
            ("llamacpp:tokens_predicted_seconds_total", "counter", "Time spent generating.", (g(&self.predicted_us) as f64 / 1e6).to_string()),
            ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", rate(g(&self.prompt_tokens), g(&self.prompt_us)).to_string()),
            ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.", rate(g(&self.predicted_tokens), g(&self.predicted_us)).to_string()),
            ("llamacpp:prompt_tokens_cached_total", "counter", "Prompt tokens reused from the cache.", g(&self.cached_tokens).to_string()),
            ("llamacpp:n_decode_total", "counter", "Forwards of the target model (a batched step is one), excluding the drafters'.", b.forwards.to_string()),
            ("llamacpp:n_tokens_max", "counter", "Largest sequence a request ended with (prompt + generation).", g(&self.n_tokens_max).to_string()),
            ("llamacpp:spec_decode_num_draft_tokens_total", "counter", "Speculative: draft tokens generated.", g(&self.draft_tokens).to_string()),
            ("llamacpp:spec_decode_num_accepted_tokens_total", "counter", "Speculative: draft tokens the target kept.", g(&self.draft_accepted).to_string()),
            ("llamacpp:spec_decode_num_drafts_total", "counter", "Speculative: verify steps that carried drafts.", g(&self.draft_verify_steps).to_string()),
            ("llamacpp:n_busy_slots_per_decode", "gauge", "Average slots per forward of the target model.", per_decode.to_string()),
            ("llamacpp:requests_processing", "gauge", "Requests in a slot.", load.busy.to_string()),
            ("llamacpp:requests_deferred", "gauge", "Requests waiting for a slot.", load.queued.to_string()),
            ("tine:slots", "gauge", "Slots.", load.slots.to_string()),
            ("tine:requests_finished_total", "counter", "Requests answered in full.", g(&self.requests_ok).to_string()),
            ("tine:requests_failed_total", "counter", "Requests that ended with an engine error.", g(&self.requests_failed).to_string()),
            ("tine:requests_refused_total", "counter", "Requests refused because the queue was full (503).", g(&self.requests_refused).to_string()),
            ("tine:prompt_tokens_cached_total", "counter", "Prompt tokens reused from a slot's cache.", g(&self.cached_tokens).to_string()),
            ("tine:prefix_pool_entries", "gauge", "Prompt prefixes held for sharing between slots.", p.entries.to_string()),
            ("tine:prefix_pool_bytes", "gauge", "KV bytes those prefixes hold, each row once.", p.bytes.to_string()),
            ("tine:prefix_pool_hits_total", "counter", "Requests started on a prefix shared with other slots.", p.hits.to_string()),
            ("tine:prefix_pool_shared_tokens_total", "counter", "Prompt tokens read from a shared prefix instead of evaluated.", p.shared_tokens.to_string()),
            ("tine:prefix_pool_evictions_total", "counter", "Shared prefixes freed to stay within --cache-ram.", p.evictions.to_string()),
            ("tine:draft_tokens_total", "counter", "Tokens drafted by speculative decoding.", g(&self.draft_tokens).to_string()),
            ("tine:draft_tokens_accepted_total", "counter", "Drafted tokens the target kept.", g(&self.draft_accepted).to_string()),
            ("tine:draft_acceptance_ratio", "gauge", "Accepted over drafted tokens, since start.", accept.to_string()),
            ("tine:batched_forwards_total", "counter", "Forwards run over the pending rows of the slots, all at once (continuous batching).", b.steps.to_string()),
            ("tine:batched_slots_total", "counter", "Slots those forwards carried.", b.slots.to_string()),
            ("tine:batched_rows_total", "counter", "Token rows those forwards carried (a decode is one; a verify batch its pending token and drafts).", b.rows.to_string()),
            ("tine:batch_rows_max", "gauge", "Token rows of the largest batched forward.", b.max.to_string()),
            ("tine:batch_rows_last", "gauge", "Token rows of the last batched forward.", b.last.to_string()),
            ("tine:batch_slots_last", "gauge", "Slots of the last batched forward.", b.last_slots.to_string()),
        ];
        let mut out = String::new();
        for (name, kind, help, value) in rows {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        }
        // One series per draft position, up to the last one ever kept (as llama-server labels them).
        let per_pos: Vec<u64> = self.accepted_per_pos.iter().map(g).collect();
        if let Some(last) = per_pos.iter().rposition(|&n| n > 0) {
            let name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total";
            let _ = writeln!(out, "# HELP {name} Accepted tokens per draft position.\n# TYPE {name} counter");
            for (i, n) in per_pos[..=last].iter().enumerate() {
                let _ = writeln!(out, "{name}{{position=\"{i}\"}} {n}");
            }
        }
        let _ = writeln!(
            out,
            "# HELP tine:draft_verify_steps_total Verify forwards that carried drafts.\n# TYPE tine:draft_verify_steps_total counter\ntine:draft_verify_steps_total {}",
            g(&self.draft_verify_steps)
        );
        out
    }
}
