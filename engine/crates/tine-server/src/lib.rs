//! Tine's HTTP server: llama-server's API where it overlaps, and OpenAI's shapes.
//!
//! This crate is the only one that knows HTTP. Requests are parsed and validated at the edge
//! (`edge`) into one validated request; the [`scheduler`] thread does the work; the dialects
//! (`llama`: llama-server's, `openai`: OpenAI's, `slots`: the slot endpoints) shape the JSON. Every error
//! is a status code with an OpenAI-style JSON body ([`error`] maps error types to statuses in
//! one place), and the server keeps serving.
//!
//! The edge, in order: `--api-key` ([`auth`]), the body read (a size limit answered 413 and a
//! time limit answered 408), JSON decoding (400 naming the field), validation (400), admission
//! (503 once `slots + max_queue` requests are in), then the engine.

pub mod auth;
pub mod cors;
pub mod error;
pub mod metrics;
pub mod prefix_pool;
pub mod scheduler;
pub mod step_plan;
pub mod webui;

mod anthropic;
mod config;
mod edge;
mod embeddings;
mod infill;
mod llama;
mod openai;
mod reply;
mod responses;
mod router;
mod slots;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tine_api::ToolMode;
use tine_api::{DetokenizeBody, Prompt, TokenizeBody};
use tine_engine::template::{ChatTemplate, TemplateError, ToolCall, ToolDelta, ToolStream, ToolSyntax};
use tine_engine::{GenerateRequest, StopType, Timings, TokenProb, ValidRequest};
use tine_runtime::Model;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

pub use auth::ApiKeys;
pub use config::{ServerConfig, DEFAULT_BATCH, DEFAULT_CACHE_RAM_MIB, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE};
use edge::*;
pub use error::ApiError;
use llama::*;
use openai::*;
use reply::{read_whole, Piece, ReplyFormat, ReplyReader};
use scheduler::{Admission, EngineConfig, Event, Job, Scheduler, Summary};
use slots::*;

struct AppState {
    model: Arc<Model>,
    scheduler: Scheduler,
    admission: Admission,
    config: ServerConfig,
    model_id: String,
    /// `--alias`'s names, in alphabetical order (`model_id` is the first, when there are any).
    aliases: Vec<String>,
    metrics: metrics::Metrics,
    template: ChatTemplate,
    /// The vocabulary's token trie for constrained decoding, built on first use (about a
    /// second for a 262k vocabulary).
    grammars: std::sync::OnceLock<Result<Arc<tine_engine::grammar::Grammars>, String>>,
    /// When the server started, in Unix seconds (`/metrics`' `Process-Start-Time-Unix` header).
    started: u64,
    /// Embedding requests run one at a time (each uses every core, as a prompt pass does).
    embedding_turn: std::sync::Mutex<()>,
}

type Shared = Arc<AppState>;

/// Builds the router; the engine thread starts here.
pub fn router(model: Arc<Model>, config: ServerConfig) -> Router {
    let engine = EngineConfig {
        slots: config.parallel.max(1),
        ctx_size: config.ctx_size,
        spec: config.spec.clone(),
        // llama.cpp clamps the physical batch to the logical one (`-ub` <= `-b`).
        ubatch: config.ubatch.min(config.batch).max(1),
        #[cfg(feature = "failure-injection")]
        fault: config.fault.clone(),
        cache_ram: config.cache_ram,
    };
    let scheduler = Scheduler::start(model.clone(), engine);
    let admission = Admission::new(config.parallel.max(1) + config.max_queue);
    // `--alias a,b,c`: every alias listed, the id the first in alphabetical order (llama-server's).
    let aliases: Vec<String> =
        config.alias.iter().flat_map(|a| a.split(',')).map(str::trim).filter(|a| !a.is_empty()).map(str::to_owned).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    let model_id = aliases.first().cloned().unwrap_or_else(|| model.info.path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| model.info.name.clone()));
    let gate = auth::Gate { keys: config.api_keys.clone(), ui: config.webui.clone() };
    let cors = Arc::new(config.cors.clone());
    if cors.origins == cors::CorsOrigins::Any && gate.keys.is_empty() {
        eprintln!("warning: --cors-origins '*' without --api-key: any web page a browser here opens can use this server");
    }
    let template = ChatTemplate::for_model(&model, config.chat_template.clone());
    let state = Arc::new(AppState {
        model,
        scheduler,
        admission,
        config,
        model_id,
        aliases,
        metrics: metrics::Metrics::default(),
        template,
        grammars: std::sync::OnceLock::new(),
        started: now(),
        embedding_turn: std::sync::Mutex::new(()),
    });
    Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .route("/slots/{id}", post(slot_action))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/completion", post(completion))
        .route("/completions", post(completion))
        .route("/v1/completions", post(oai_completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/chat/completions/input_tokens", post(openai::chat_input_tokens))
        .route("/v1/chat/completions/input_tokens", post(openai::chat_input_tokens))
        .route("/apply-template", post(apply_template))
        .route("/server_info", get(router::server_info))
        .route("/get_server_info", get(router::server_info))
        .route("/model_info", get(router::model_info))
        .route("/get_model_info", get(router::model_info))
        .route("/get_load", get(router::load))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/responses", post(responses::create))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route("/responses/input_tokens", post(responses::input_tokens))
        // llama-server's endpoints Tine does not serve: 501 naming what is missing, not 404.
        .route("/infill", post(infill::infill))
        .route("/rerank", post(|| not_served("/rerank (a reranking model's scores)")))
        .route("/reranking", post(|| not_served("/rerank (a reranking model's scores)")))
        .route("/v1/rerank", post(|| not_served("/rerank (a reranking model's scores)")))
        .route("/embedding", post(embeddings::native))
        .route("/embeddings", post(embeddings::native))
        .route("/v1/embeddings", post(embeddings::openai))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(gate, auth::require_key))
        // Outermost: preflights need no key, and a 401 still carries the CORS headers.
        .layer(axum::middleware::from_fn_with_state(cors, cors::cors))
}

/// Serves until the process ends.
pub async fn serve(model: Arc<Model>, config: ServerConfig, addr: SocketAddr) -> std::io::Result<()> {
    serve_all(model, config, &[addr]).await
}

/// Serves one server (one set of slots) on every address of `addrs` until the process ends.
/// Every address is bound before anything is served: one that cannot be is the error.
pub async fn serve_all(model: Arc<Model>, config: ServerConfig, addrs: &[SocketAddr]) -> std::io::Result<()> {
    warm_gpu_batch(&model, &config).map_err(std::io::Error::other)?;
    check_gpu_slots(&model, &config).map_err(std::io::Error::other)?;
    let mut listeners = Vec::with_capacity(addrs.len());
    for addr in addrs {
        let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| std::io::Error::new(e.kind(), format!("binding {addr}: {e}")))?;
        listeners.push(l);
    }
    let app = router(model, config);
    let mut served = tokio::task::JoinSet::new();
    for l in listeners {
        served.spawn(serve_on(l, app.clone()));
    }
    while let Some(done) = served.join_next().await {
        done.map_err(std::io::Error::other)??;
    }
    Ok(())
}

/// On the GPU engine where it batches (Gemma 3, Gemma 4), with more than one slot: the batched steps'
/// buffers and every graph they run, made before anything is served (and before the slots'
/// memory is checked, so that check sees what they take).
fn warm_gpu_batch(model: &Model, config: &ServerConfig) -> Result<(), String> {
    if !model.gpu_batches() || config.parallel < 2 {
        return Ok(());
    }
    let t0 = std::time::Instant::now();
    // A step holds every slot's decode row, or its verify batch (the pending token and at most
    // `--draft-max` drafts; a request asking for more makes the buffers again, at its first
    // such step).
    let per_slot = config.spec.as_ref().map_or(1, |f| f.config.params.n_max + 1);
    let rows = (config.parallel * per_slot).min(tine_runtime::BATCH_ROWS);
    let (graphs, bytes) = model.warm_gpu_batch(rows, config.ctx_size).map_err(|e| format!("readying the GPU's batched steps for --parallel {}: {e}", config.parallel))?;
    eprintln!(
        "tine serve: the GPU steps every slot's rows at once: {graphs} graphs (up to {rows} rows) captured in {:.0} ms, {:.1} MiB of step buffers",
        t0.elapsed().as_secs_f64() * 1e3,
        bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}

/// On the GPU engine, whether `--parallel` slots of `-c` positions fit the GPU's memory, checked
/// before anything is served: one slot's sequence is allocated to measure what a slot takes (its
/// K/V, a recurrent model's state planes), against the free memory, so a server that cannot hold
/// its slots is refused at start-up with what would fit instead of failing a request later.
pub fn check_gpu_slots(model: &Model, config: &ServerConfig) -> Result<(), String> {
    let Some(memory) = model.gpu_memory() else { return Ok(()) };
    let slots = config.parallel.max(1);
    let seq = model.try_new_sequence(config.ctx_size).map_err(|e| format!("--ctx-size {}: the GPU cannot hold even one slot's sequence ({e})", config.ctx_size))?;
    let (per, context) = (seq.device_bytes(), seq.context());
    let (free, total) = memory.map_err(|e| format!("reading the GPU's free memory: {e}"))?;
    // `free` was read with the one sequence allocated.
    slots_fit(per, slots, context, free + per, total)
}

/// Whether `slots` sequences of `per` bytes (`context` positions each) fit in `free` bytes of a
/// GPU of `total`, keeping 5% of it (at least 512 MiB) for graphs and drafters; if not, what
/// would.
fn slots_fit(per: usize, slots: usize, context: usize, free: usize, total: usize) -> Result<(), String> {
    const MIB: usize = 1 << 20;
    let room = free.saturating_sub((total / 20).max(512 * MIB));
    if per == 0 || per.saturating_mul(slots) <= room {
        return Ok(());
    }
    let most = room / per;
    // Positions a slot could hold with `slots` of them (a slot's bytes grow with its positions).
    let each = (context as u128 * (room / slots) as u128 / per as u128) as usize;
    Err(format!(
        "--parallel {slots} slots of {context} positions need {} MiB of GPU memory ({} MiB a slot); {} MiB are free of {} MiB, {} MiB of it kept for graphs and drafters: \
         at most {most} slot{} of {context} positions fit, or {slots} slots of about {each} positions (--ctx-size {each})",
        per * slots / MIB,
        per.div_ceil(MIB),
        free / MIB,
        total / MIB,
        (total / 20).max(512 * MIB) / MIB,
        if most == 1 { "" } else { "s" },
    ))
}

/// Serves `app` on `listener` until the process ends, over HTTP/1.1 with response header names
/// in canonical case (`Content-Type`, `Access-Control-Allow-Origin`), as llama-server sends them:
/// some clients read headers case-sensitively. A connection that fails ends alone; a failed
/// accept (out of file descriptors, say) is retried after a pause.
pub async fn serve_on(listener: tokio::net::TcpListener, app: Router) -> std::io::Result<()> {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // A connection reset before it was accepted concerns that client alone.
                if !matches!(e.kind(), std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionRefused) {
                    eprintln!("tine serve: accept failed ({e}); retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new().title_case_headers(true).serve_connection(hyper_util::rt::TokioIo::new(stream), service).with_upgrades();
            let _ = conn.await;
        });
    }
}

async fn not_served(what: &'static str) -> ApiError {
    ApiError::new(StatusCode::NOT_IMPLEMENTED, format!("this server does not serve {what} yet"))
}

/// The chat page's files (`webui`), else a 404.
async fn not_found(State(st): State<Shared>, req: axum::extract::Request) -> Response {
    match webui::serve(&st.config.webui, &req) {
        Some(page) => page,
        None => ApiError::new(StatusCode::NOT_FOUND, "no such endpoint").into_response(),
    }
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "this endpoint does not take that method")
}

/// Submits every request; if one is refused, those already in are cancelled (their receivers drop).
fn submit_all(st: &AppState, vs: &[Validated]) -> Result<Vec<tokio::sync::mpsc::UnboundedReceiver<Event>>, ApiError> {
    // Progress only for a stream that asked (a whole answer has nowhere to put it).
    vs.iter().map(|v| submit(st, v.request.clone(), v.slot, v.stream && v.return_progress)).collect()
}

/// Waits for every generation, in order.
async fn collect_all(st: &AppState, rxs: Vec<tokio::sync::mpsc::UnboundedReceiver<Event>>) -> Result<Vec<(Summary, Vec<TokenProb>)>, ApiError> {
    let mut out = Vec::with_capacity(rxs.len());
    for rx in rxs {
        out.push(collect(st, rx).await?);
    }
    Ok(out)
}

/// The events of several generations as one stream of `(index, event)`.
fn merged(rxs: Vec<tokio::sync::mpsc::UnboundedReceiver<Event>>) -> tokio_stream::StreamMap<usize, UnboundedReceiverStream<Event>> {
    let mut map = tokio_stream::StreamMap::new();
    for (i, rx) in rxs.into_iter().enumerate() {
        map.insert(i, UnboundedReceiverStream::new(rx));
    }
    map
}

/// Submits and returns the event stream.
fn submit(st: &AppState, request: ValidRequest, slot: Option<usize>, progress: bool) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, ApiError> {
    let permit = st
        .admission
        .try_admit()
        .ok_or_else(|| ApiError::unavailable(format!("the server is busy: {} requests are in progress or queued (limit {}); retry later", st.admission.in_flight(), st.admission.limit())))?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    st.scheduler.submit(Job { request, slot, events: tx, permit, progress }).map_err(|_| ApiError::unavailable("the engine thread has stopped"))?;
    Ok(rx)
}

/// Waits for the whole generation.
async fn collect(st: &AppState, mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Result<(Summary, Vec<TokenProb>), ApiError> {
    let mut probs = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { prob, .. } => probs.extend(prob),
            Event::Progress(_) => {}
            Event::Done(s) => {
                log_request(st, &s);
                return Ok((*s, probs));
            }
            Event::Error(e) => {
                st.metrics.failed();
                return Err(ApiError::from(&e));
            }
        }
    }
    Err(ApiError::internal("the engine dropped the request"))
}

fn log_request(st: &AppState, s: &Summary) {
    st.metrics.finished(s);
    let t = &s.timings;
    eprintln!(
        "slot {} | {}: prompt {} tok ({} cached) {:.1} ms, {:.1} tok/s | gen {} tok {:.1} ms, {:.1} tok/s | stop {}",
        s.slot,
        st.model_id,
        t.prompt_n,
        t.cached_n,
        t.prompt_ms,
        t.prompt_per_second(),
        t.predicted_n,
        t.predicted_ms,
        t.predicted_per_second(),
        s.stop_type.as_str()
    );
    if s.drafter != tine_spec::SpecChoice::Off {
        let d = t.draft;
        eprintln!(
            "slot {} | draft {}: {} drafted, {} accepted ({:.1}%), {} verify steps, {:.2} tokens per step",
            s.slot,
            s.drafter,
            d.draft_n,
            d.draft_n_accepted,
            d.accept_rate() * 100.0,
            d.draft_verify_steps,
            d.tau()
        );
    }
}

/// An id no other answer of this server has had: `prefix`, the start time's nanoseconds and a
/// counter, in hex (Anthropic's and the Responses API's ids, and the tool calls within them).
fn fresh_id(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    static START: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    let start = START.get_or_init(|| SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    format!("{prefix}{:x}{:06x}", start & 0xffff_ffff_ffff, NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

fn sse_json(v: Value) -> Result<SseEvent, std::convert::Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

#[cfg(test)]
mod gpu_slots_tests {
    use super::slots_fit;

    const MIB: usize = 1 << 20;
    const GIB: usize = 1 << 30;

    #[test]
    fn slots_that_fit_the_gpu_start() {
        assert_eq!(slots_fit(100 * MIB, 4, 4096, 10 * GIB, 80 * GIB), Ok(()));
        // Off the engine a sequence holds no GPU memory.
        assert_eq!(slots_fit(0, 64, 4096, 0, 0), Ok(()));
    }

    #[test]
    fn slots_that_do_not_fit_are_refused_with_what_would() {
        // 64 slots of 1 GiB in 40 GiB free of 80 (4 GiB kept): 36 fit, or 64 of 18432 positions.
        let e = slots_fit(GIB, 64, 32768, 40 * GIB, 80 * GIB).expect_err("64 GiB in 36");
        assert!(e.contains("--parallel 64 slots of 32768 positions need 65536 MiB"), "{e}");
        assert!(e.contains("at most 36 slots of 32768 positions fit"), "{e}");
        assert!(e.contains("64 slots of about 18432 positions (--ctx-size 18432)"), "{e}");
        // The headroom is at least 512 MiB on a small GPU.
        let e = slots_fit(GIB, 2, 8192, 2 * GIB, 8 * GIB).expect_err("2 GiB in 1.5");
        assert!(e.contains("at most 1 slot of 8192 positions fit"), "{e}");
    }
}
