//! Tine's HTTP server: llama-server's API where it overlaps, and OpenAI's shapes.
//!
//! This crate is the only one that knows JSON and HTTP. Requests are parsed and validated at the
//! edge into `tine_engine::GenerateRequest`; the [`scheduler`] thread does the work. Every error
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

use std::net::SocketAddr;
use std::sync::atomic::AtomicI64;
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
use tine_api::{ChatBody, CompletionBody, DetokenizeBody, GenFields, Prompt, TokenizeBody};
use tine_engine::template::{parse_tool_calls, ChatTemplate, RenderInput, TemplateError};
use tine_engine::{GenerateRequest, StopType, Timings, TokenProb};
use tine_runtime::Model;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

pub use auth::ApiKeys;
pub use error::ApiError;
use scheduler::{Admission, EngineConfig, Event, Job, Scheduler, Summary};

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub parallel: usize,
    pub ctx_size: usize,
    /// Speculative decoding for every slot (each slot keeps its own drafter state).
    pub spec: Option<Arc<tine_spec::SpecFactory>>,
    /// `--api-key`: when not empty, every endpoint but `/health` needs one of these.
    pub api_keys: ApiKeys,
    /// Largest request body accepted (413 above it).
    pub max_body_bytes: usize,
    /// Time a client has to send its whole body (408 after it).
    pub body_timeout: Duration,
    /// Requests waiting for a slot beyond the busy ones; more are refused with 503.
    pub max_queue: usize,
    /// Prompt tokens evaluated per engine step (`--ubatch-size`).
    pub ubatch: usize,
    /// What a request gets for the fields it leaves out (`--temp`, `--n-predict`, ...).
    pub defaults: tine_api::Defaults,
    /// `--alias`: the model id in `/v1/models` and responses (default: the file name).
    pub alias: Option<String>,
    /// `/slots` answers (llama-server's default; `--no-slots` turns it off).
    pub slots_endpoint: bool,
    /// `/metrics` answers (`--metrics`, off by default as in llama-server).
    pub metrics: bool,
    /// `--chat-template`: overrides the GGUF's `tokenizer.chat_template`.
    pub chat_template: Option<ChatTemplate>,
    /// `--slot-save-path`: the directory slot files are saved to and restored from
    /// (`/slots/{id}?action=save|restore` answer 501 without it).
    pub slot_save_path: Option<std::path::PathBuf>,
    /// `--context-shift`: a generation that fills its context drops the oldest half of the
    /// tokens after `n_keep` and continues.
    pub context_shift: bool,
    /// `--cache-ram`: bytes of KV the prompt prefixes shared between slots may hold (`None`: no
    /// limit; `Some(0)`: every slot keeps its own copy).
    pub cache_ram: Option<usize>,
    /// Failure injection for tests (see [`scheduler::EngineConfig::fault`]).
    #[doc(hidden)]
    pub fault: Option<Arc<AtomicI64>>,
}

impl ServerConfig {
    pub fn new(parallel: usize, ctx_size: usize) -> ServerConfig {
        ServerConfig {
            parallel,
            ctx_size,
            spec: None,
            api_keys: ApiKeys::default(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            body_timeout: Duration::from_secs(60),
            max_queue: DEFAULT_MAX_QUEUE,
            ubatch: tine_runtime::PREFILL_CHUNK,
            defaults: tine_api::Defaults::default(),
            alias: None,
            slots_endpoint: true,
            metrics: false,
            chat_template: None,
            context_shift: false,
            slot_save_path: None,
            cache_ram: Some(DEFAULT_CACHE_RAM_MIB << 20),
            fault: None,
        }
    }
}

/// 16 MiB: a full 128k-token prompt as JSON text fits several times over.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;
/// `--cache-ram`'s default in MiB (llama-server's).
pub const DEFAULT_CACHE_RAM_MIB: usize = 8192;
/// Queued requests allowed beyond the slots.
pub const DEFAULT_MAX_QUEUE: usize = 256;

struct AppState {
    model: Arc<Model>,
    scheduler: Scheduler,
    admission: Admission,
    config: ServerConfig,
    model_id: String,
    metrics: metrics::Metrics,
    template: ChatTemplate,
    /// The vocabulary's token trie for constrained decoding, built on first use (about a
    /// second for a 262k vocabulary).
    grammars: std::sync::OnceLock<Result<Arc<tine_engine::grammar::Grammars>, String>>,
}

type Shared = Arc<AppState>;

/// Builds the router; the engine thread starts here.
pub fn router(model: Arc<Model>, config: ServerConfig) -> Router {
    let engine =
        EngineConfig { slots: config.parallel.max(1), ctx_size: config.ctx_size, spec: config.spec.clone(), ubatch: config.ubatch.max(1), fault: config.fault.clone(), cache_ram: config.cache_ram };
    let scheduler = Scheduler::start(model.clone(), engine);
    let admission = Admission::new(config.parallel.max(1) + config.max_queue);
    let model_id = config.alias.clone().unwrap_or_else(|| model.info.path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| model.info.name.clone()));
    let keys = config.api_keys.clone();
    let template = config.chat_template.clone().unwrap_or_else(|| {
        let t = ChatTemplate::from_gguf(model.info.chat_template.as_deref());
        match t.check() {
            Ok(()) => t,
            Err(e) => {
                eprintln!("warning: {}: {e}; chat requests use Gemma's turns instead", model.info.path.display());
                ChatTemplate::Gemma
            }
        }
    });
    let state = Arc::new(AppState { model, scheduler, admission, config, model_id, metrics: metrics::Metrics::default(), template, grammars: std::sync::OnceLock::new() });
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
        .route("/apply-template", post(apply_template))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(keys, auth::require_key))
        // Outermost: preflights need no key, and a 401 still carries the CORS headers.
        .layer(axum::middleware::from_fn(cors::cors))
}

/// Serves until the process ends.
pub async fn serve(model: Arc<Model>, config: ServerConfig, addr: SocketAddr) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, router(model, config)).await
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "this endpoint does not take that method")
}

/// Reads the whole body within the size and time limits.
async fn read_body(st: &AppState, body: Body) -> Result<Bytes, ApiError> {
    let limit = st.config.max_body_bytes;
    match tokio::time::timeout(st.config.body_timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(ApiError::new(StatusCode::REQUEST_TIMEOUT, format!("the request body did not arrive within {} s", st.config.body_timeout.as_secs()))),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let too_big = std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if too_big {
                Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is larger than the limit of {limit} bytes")))
            } else {
                Err(ApiError::bad(format!("cannot read the request body: {}", tine_engine::error_chain(&e))))
            }
        }
    }
}

async fn json_body<T: serde::de::DeserializeOwned>(st: &AppState, body: Body) -> Result<T, ApiError> {
    Ok(tine_api::decode(&read_body(st, body).await?)?)
}

// ---- simple endpoints ----

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

fn default_settings(st: &AppState) -> Value {
    let d = &st.config.defaults.sampling;
    // llama-server reports the default seed as 4294967295 (LLAMA_DEFAULT_SEED: a random one).
    let seed = d.seed.map_or(json!(u32::MAX), |s| json!(s));
    json!({
        "n_ctx": st.config.ctx_size,
        "seed": seed,
        "params": {
            "n_predict": st.config.defaults.n_predict, "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
            "repeat_penalty": d.repeat_penalty, "repeat_last_n": d.repeat_last_n, "presence_penalty": d.presence_penalty,
            "frequency_penalty": d.frequency_penalty, "seed": seed, "n_probs": 0, "ignore_eos": false, "stop": [], "cache_prompt": true, "n_keep": st.config.defaults.n_keep, "context_shift": st.config.context_shift
        }
    })
}

async fn props(State(st): State<Shared>) -> Json<Value> {
    Json(json!({
        "default_generation_settings": default_settings(&st),
        "total_slots": st.scheduler.slots,
        "model_alias": st.model_id,
        "endpoint_slots": st.config.slots_endpoint,
        "endpoint_metrics": st.config.metrics,
        "model_path": st.model.info.path.display().to_string(),
        "modalities": {"vision": false, "audio": false},
        "chat_template": st.template.source().unwrap_or(st.template.name()),
        "bos_token": st.model.tokenizer.bos_token().and_then(|b| st.model.tokenizer.token_text(b)).unwrap_or(""),
        "eos_token": st.model.tokenizer.eos_token().and_then(|b| st.model.tokenizer.token_text(b)).unwrap_or(""),
        "build_info": format!("tine {}", env!("CARGO_PKG_VERSION")),
        "speculative": st.config.spec.as_ref().map(|f| json!({
            "type": f.config.label(), "n_max": f.config.params.n_max, "n_min": f.config.params.n_min, "p_min": f.config.params.p_min,
        })),
    }))
}

async fn metrics_text(State(st): State<Shared>) -> Result<Response, ApiError> {
    if !st.config.metrics {
        return Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "This server does not support metrics endpoint. Start it with `--metrics`"));
    }
    let views = st.scheduler.slot_views();
    let busy = views.iter().filter(|v| v.is_processing).count();
    let load = metrics::Load { slots: views.len(), busy, queued: st.admission.in_flight().saturating_sub(busy), pool: st.scheduler.pool_stats() };
    Ok(([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.metrics.render(&load)).into_response())
}

async fn slots(State(st): State<Shared>) -> Result<Json<Value>, ApiError> {
    if !st.config.slots_endpoint {
        return Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "This server does not support slots endpoint. Start it without `--no-slots`"));
    }
    let spec = st.config.spec.is_some();
    Ok(Json(Value::Array(
        st.scheduler
            .slot_views()
            .into_iter()
            .map(|v| json!({"id": v.id, "id_task": v.id_task, "n_ctx": v.n_ctx, "speculative": spec, "is_processing": v.is_processing, "n_cached": v.n_cached, "n_shared": v.n_shared}))
            .collect(),
    )))
}

/// A slot file's name: one plain file name inside `--slot-save-path` (llama-server's rule).
fn slot_file_name(body: &Value) -> Result<String, ApiError> {
    let name = body.get("filename").and_then(|f| f.as_str()).ok_or_else(|| ApiError::bad("`filename` is required"))?;
    let ok = !name.is_empty() && name.len() <= 255 && name != "." && name != ".." && !name.starts_with('.') && !name.chars().any(|c| c == '/' || c == '\\' || c.is_control());
    if !ok {
        return Err(ApiError::bad(format!("filename {name:?} must be a plain file name (no path separators, no leading dot, at most 255 bytes)")));
    }
    Ok(name.to_owned())
}

/// llama-server's `POST /slots/{id}?action=save|restore|erase`.
async fn slot_action(State(st): State<Shared>, axum::extract::Path(id): axum::extract::Path<String>, uri: axum::http::Uri, body: Body) -> Result<Json<Value>, ApiError> {
    use scheduler::{SlotAction, SlotCommand, SlotOutcome};
    if !st.config.slots_endpoint {
        return Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "This server does not support slots endpoint. Start it without `--no-slots`"));
    }
    let id: usize = id.parse().map_err(|_| ApiError::bad(format!("slot id {id:?} is not a number")))?;
    let action = uri.query().unwrap_or("").split('&').find_map(|kv| kv.strip_prefix("action=")).unwrap_or("").to_owned();
    let raw = read_body(&st, body).await?;
    let body: Value = if raw.iter().all(u8::is_ascii_whitespace) { json!({}) } else { tine_api::decode(&raw)? };
    let dir = || st.config.slot_save_path.clone().ok_or_else(|| ApiError::new(StatusCode::NOT_IMPLEMENTED, "This server does not support slots action. Start it with `--slot-save-path`"));
    let t0 = std::time::Instant::now();
    let (cmd_action, file) = match action.as_str() {
        "save" => {
            let path = dir()?.join(slot_file_name(&body)?);
            (SlotAction::Save, Some(path))
        }
        "restore" => {
            let name = slot_file_name(&body)?;
            let path = dir()?.join(&name);
            let bytes = tokio::task::spawn_blocking({
                let path = path.clone();
                move || std::fs::read(&path)
            })
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    ApiError::new(StatusCode::NOT_FOUND, format!("no slot file {name:?}"))
                } else {
                    ApiError::internal(format!("reading {name:?}: {e}"))
                }
            })?;
            let img = tokio::task::spawn_blocking(move || tine_runtime::SlotImage::from_bytes(&bytes)).await.map_err(|e| ApiError::internal(e.to_string()))?;
            let img = img.map_err(|e| ApiError::bad(format!("{name:?}: {e}")))?;
            (SlotAction::Restore(Box::new(img)), Some(path))
        }
        "erase" => (SlotAction::Erase, None),
        other => return Err(ApiError::bad(format!("action must be save, restore or erase, got {other:?}"))),
    };
    let (reply, rx) = tokio::sync::oneshot::channel();
    st.scheduler.slot_action(SlotCommand { id, action: cmd_action, reply }).map_err(|_| ApiError::unavailable("the engine thread has stopped"))?;
    let outcome = rx.await.map_err(|_| ApiError::internal("the engine dropped the slot action"))?.map_err(|e| ApiError::from(&e))?;
    let filename = file.as_ref().and_then(|p| p.file_name()).map(|f| f.to_string_lossy().into_owned());
    Ok(Json(match outcome {
        SlotOutcome::Saved(img) => {
            let path = file.expect("save has a path");
            let n_saved = img.tokens.len();
            // Written beside the target and renamed: a crash leaves the old file or the new one.
            let n_written = tokio::task::spawn_blocking(move || -> std::io::Result<usize> {
                let bytes = img.to_bytes();
                let tmp = path.with_extension("tine-tmp");
                std::fs::write(&tmp, &bytes)?;
                std::fs::File::open(&tmp)?.sync_all()?;
                std::fs::rename(&tmp, &path)?;
                Ok(bytes.len())
            })
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| ApiError::internal(format!("writing the slot file: {e}")))?;
            json!({"id_slot": id, "filename": filename, "n_saved": n_saved, "n_written": n_written, "timings": {"save_ms": t0.elapsed().as_secs_f64() * 1e3}})
        }
        SlotOutcome::Restored { n_restored } => {
            json!({"id_slot": id, "filename": filename, "n_restored": n_restored, "n_read": n_restored, "timings": {"restore_ms": t0.elapsed().as_secs_f64() * 1e3}})
        }
        SlotOutcome::Erased { n_erased } => json!({"id_slot": id, "n_erased": n_erased}),
    }))
}

async fn models(State(st): State<Shared>) -> Json<Value> {
    let i = &st.model.info;
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.model_id, "object": "model", "created": 0, "owned_by": "tine",
            "meta": {"n_vocab": i.vocab_size, "n_ctx_train": i.context_length, "n_embd": i.embedding_length, "size": i.file_size, "architecture": i.architecture}
        }]
    }))
}

async fn tokenize(State(st): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let b: TokenizeBody = json_body(&st, body).await?;
    let ids = st.model.tokenizer.encode(&b.content, b.add_special, b.parse_special);
    if b.with_pieces {
        let pieces: Vec<Value> = ids.iter().map(|&id| json!({"id": id, "piece": String::from_utf8_lossy(&st.model.tokenizer.token_bytes(id, true))})).collect();
        return Ok(Json(json!({"tokens": pieces})));
    }
    Ok(Json(json!({"tokens": ids})))
}

async fn detokenize(State(st): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let b: DetokenizeBody = json_body(&st, body).await?;
    let ids = checked_ids(&st, &b.tokens)?;
    Ok(Json(json!({"content": st.model.tokenizer.decode(&ids, true)})))
}

fn checked_ids(st: &AppState, ids: &[i64]) -> Result<Vec<u32>, ApiError> {
    Ok(tine_api::check_ids(ids, st.model.info.vocab_size)?)
}

// ---- generation requests ----

/// Request fields after validation.
struct Validated {
    request: GenerateRequest,
    stream: bool,
    return_tokens: bool,
    n_probs: usize,
    /// OpenAI log-probabilities, with this many alternatives.
    logprobs: Option<usize>,
}

fn validate(st: &AppState, prompt: Vec<u32>, g: GenFields) -> Result<Validated, ApiError> {
    let l = g.limits_with(&st.config.defaults)?;
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty"));
    }
    if prompt.len() >= st.config.ctx_size {
        return Err(ApiError::exceeds_context(prompt.len(), st.config.ctx_size));
    }
    let speculative = match &st.config.spec {
        Some(f) if g.has_spec_override() => {
            let d = f.config.params;
            let p = tine_spec::DraftParams { n_max: g.spec_n_max.unwrap_or(d.n_max), n_min: g.spec_n_min.unwrap_or(d.n_min), p_min: g.spec_p_min.unwrap_or(d.p_min), adaptive: d.adaptive };
            p.check().map_err(|e| ApiError::bad(format!("speculative: {e}")))?;
            Some(p)
        }
        _ => None,
    };
    let logit_bias = resolve_bias(st, &l.logit_bias)?;
    let grammar = l.constraint.as_ref().map(|(field, c)| compile_constraint(st, field, c)).transpose()?;
    let request = GenerateRequest {
        speculative,
        prompt,
        n_predict: l.n_predict,
        sampling: l.sampling,
        stop: l.stop,
        ignore_eos: l.ignore_eos,
        n_probs: l.n_probs,
        cache_prompt: l.cache_prompt,
        logit_bias,
        grammar,
        context_shift: st.config.context_shift,
        n_keep: l.n_keep,
    };
    Ok(Validated { request, stream: l.stream, return_tokens: l.return_tokens, n_probs: l.n_probs, logprobs: l.logprobs })
}

/// A request's schema or grammar compiled against the vocabulary (400 naming the field when
/// it does not compile).
fn compile_constraint(st: &AppState, field: &str, c: &tine_api::Constraint) -> Result<tine_engine::grammar::Grammar, ApiError> {
    use tine_engine::grammar::{GrammarSpec, Grammars};
    let grammars = st.grammars.get_or_init(|| Grammars::new(&st.model).map(Arc::new).map_err(|e| e.to_string())).clone().map_err(ApiError::internal)?;
    let spec = match c {
        tine_api::Constraint::JsonSchema(v) => GrammarSpec::JsonSchema(v.clone()),
        tine_api::Constraint::Gbnf(g) => GrammarSpec::Gbnf(g.clone()),
        tine_api::Constraint::Lark(g) => GrammarSpec::Lark(g.clone()),
    };
    grammars.compile(&spec).map_err(|e| ApiError::new(error::grammar_status(&e), format!("{field}: {e}")))
}

/// `logit_bias` against the vocabulary: ids checked, a text biases each of its tokens (llama-server).
fn resolve_bias(st: &AppState, entries: &[(tine_api::BiasTarget, f32)]) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::new();
    for (target, bias) in entries {
        match target {
            tine_api::BiasTarget::Id(id) => out.extend(tine_api::check_ids(&[*id], st.model.info.vocab_size)?.into_iter().map(|t| (t, *bias))),
            tine_api::BiasTarget::Text(text) => out.extend(st.model.tokenizer.encode(text, false, false).into_iter().map(|t| (t, *bias))),
        }
    }
    Ok(out)
}

fn prompt_tokens(st: &AppState, b: &mut CompletionBody) -> Result<Vec<Vec<u32>>, ApiError> {
    b.prompts()?
        .into_iter()
        .map(|p| match p {
            Prompt::Text(t) => Ok(st.model.tokenizer.encode(&t, true, true)),
            Prompt::Tokens(ids) => checked_ids(st, &ids),
        })
        .collect()
}

/// Every result a request asks for: each prompt `n` times, choice `i` sampling with `seed + i`
/// (a request without a seed draws one per choice). Each is validated on its own (a grammar
/// gets its own parser state).
fn validate_many(st: &AppState, prompts: Vec<Vec<u32>>, g: GenFields) -> Result<Vec<Validated>, ApiError> {
    let n = g.choices()?;
    if prompts.len() * n > tine_api::MAX_CHOICES {
        return Err(ApiError::bad(format!("at most {} results per request (prompts x n), got {} x {n}", tine_api::MAX_CHOICES, prompts.len())));
    }
    let mut out = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        for i in 0..n {
            let mut v = validate(st, prompt.clone(), g.clone())?;
            if let Some(seed) = v.request.sampling.seed.as_mut() {
                *seed = seed.wrapping_add(i as u64);
            }
            out.push(v);
        }
    }
    Ok(out)
}

/// Submits every request; if one is refused, those already in are cancelled (their receivers drop).
fn submit_all(st: &AppState, vs: &[Validated]) -> Result<Vec<tokio::sync::mpsc::UnboundedReceiver<Event>>, ApiError> {
    vs.iter().map(|v| submit(st, v.request.clone())).collect()
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

fn timings_json(t: &Timings) -> Value {
    json!({
        "cache_n": t.cached_n,
        "prompt_n": t.prompt_n, "prompt_ms": t.prompt_ms, "prompt_per_token_ms": if t.prompt_n > 0 { t.prompt_ms / t.prompt_n as f64 } else { 0.0 }, "prompt_per_second": t.prompt_per_second(),
        "predicted_n": t.predicted_n, "predicted_ms": t.predicted_ms, "predicted_per_token_ms": if t.predicted_n > 1 { t.predicted_ms / (t.predicted_n - 1) as f64 } else { 0.0 }, "predicted_per_second": t.predicted_per_second(),
        "draft_n": t.draft.draft_n, "draft_n_accepted": t.draft.draft_n_accepted, "draft_verify_steps": t.draft.draft_verify_steps,
    })
}

fn prob_json(st: &AppState, p: &TokenProb) -> Value {
    let entry = |id: u32, lp: f32| {
        let bytes = st.model.tokenizer.token_bytes(id, true);
        json!({"id": id, "token": String::from_utf8_lossy(&bytes), "bytes": bytes, "logprob": lp})
    };
    let mut v = entry(p.id, p.logprob);
    v["top_logprobs"] = Value::Array(p.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
    v
}

/// Submits and returns the event stream.
fn submit(st: &AppState, request: GenerateRequest) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, ApiError> {
    let permit = st
        .admission
        .try_admit()
        .ok_or_else(|| ApiError::unavailable(format!("the server is busy: {} requests are in progress or queued (limit {}); retry later", st.admission.in_flight(), st.admission.limit())))?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    st.scheduler.submit(Job { request, events: tx, permit }).map_err(|_| ApiError::unavailable("the engine thread has stopped"))?;
    Ok(rx)
}

/// Waits for the whole generation.
async fn collect(st: &AppState, mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Result<(Summary, Vec<TokenProb>), ApiError> {
    let mut probs = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { prob, .. } => probs.extend(prob),
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
    if let Some(f) = &st.config.spec {
        let d = t.draft;
        eprintln!(
            "slot {} | draft {}: {} drafted, {} accepted ({:.1}%), {} verify steps, {:.2} tokens per step",
            s.slot,
            f.config.label(),
            d.draft_n,
            d.draft_n_accepted,
            d.accept_rate() * 100.0,
            d.draft_verify_steps,
            d.tau()
        );
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn sse_json(v: Value) -> Result<SseEvent, std::convert::Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

// ---- /completion (llama-server) ----

async fn completion(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let mut b: CompletionBody = json_body(&st, body).await?;
    let prompts = prompt_tokens(&st, &mut b)?;
    let vs = validate_many(&st, prompts, b.gen)?;
    let single = vs.len() == 1;
    let (stream, return_tokens, n_probs) = (vs[0].stream, vs[0].return_tokens, vs[0].n_probs);
    let prompt_texts: Vec<String> = vs.iter().map(|v| st.model.tokenizer.decode(&v.request.prompt, true)).collect();
    let rxs = submit_all(&st, &vs)?;
    if stream {
        let st2 = st.clone();
        // Several prompts: every chunk carries its result's `index`, as llama-server's do.
        let stream = merged(rxs).map(move |(i, ev)| {
            let mut j = match ev {
                Event::Token { id, text, prob } => {
                    let mut j = json!({"content": text, "stop": false, "tokens": [id]});
                    if let Some(p) = prob {
                        j["completion_probabilities"] = json!([prob_json(&st2, &p)]);
                    }
                    j
                }
                Event::Done(s) => {
                    log_request(&st2, &s);
                    final_completion_json(&st2, &s, "", &[], false, &prompt_texts[i])
                }
                Event::Error(e) => {
                    st2.metrics.failed();
                    ApiError::from(&e).body()
                }
            };
            if !single {
                j["index"] = json!(i);
            }
            sse_json(j)
        });
        return Ok(Sse::new(stream).into_response());
    }
    let results = collect_all(&st, rxs).await?;
    let mut out: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (s, probs))| {
            let mut j = final_completion_json(&st, s, &s.text, probs, return_tokens, &prompt_texts[i]);
            if n_probs == 0 {
                j.as_object_mut().expect("object").remove("completion_probabilities");
            }
            if !single {
                j["index"] = json!(i);
            }
            j
        })
        .collect();
    // One prompt gets one object; several get an array (llama-server).
    Ok(Json(if single { out.remove(0) } else { Value::Array(out) }).into_response())
}

fn final_completion_json(st: &AppState, s: &Summary, content: &str, probs: &[TokenProb], return_tokens: bool, prompt: &str) -> Value {
    json!({
        "content": content,
        "tokens": if return_tokens { json!(s.tokens) } else { json!([]) },
        "id_slot": s.slot,
        "stop": true,
        "model": st.model_id,
        "tokens_predicted": s.timings.predicted_n,
        "tokens_evaluated": s.prompt_tokens,
        "generation_settings": {"n_ctx": st.config.ctx_size, "seed": s.seed},
        "prompt": prompt,
        "has_new_line": content.contains('\n'),
        "truncated": s.truncated,
        "stop_type": s.stop_type.as_str(),
        "stopping_word": s.stopping_word,
        "tokens_cached": s.timings.cached_n + s.timings.prompt_n + s.timings.predicted_n,
        "timings": timings_json(&s.timings),
        "completion_probabilities": probs.iter().map(|p| prob_json(st, p)).collect::<Vec<_>>(),
    })
}

fn token_text(st: &AppState, id: u32) -> String {
    String::from_utf8_lossy(&st.model.tokenizer.token_bytes(id, true)).into_owned()
}

/// OpenAI completions' `logprobs` over `probs`, whose text starts `offset` characters into
/// the completion (streamed chunks carry on from the previous one).
fn completion_logprobs(st: &AppState, probs: &[TokenProb], top: usize, offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for p in probs {
        let text = token_text(st, p.id);
        offsets.push(*offset);
        *offset += text.chars().count();
        tokens.push(text);
        token_logprobs.push(p.logprob);
        let alts: serde_json::Map<String, Value> = p.top.iter().take(top).map(|&(id, lp)| (token_text(st, id), json!(lp))).collect();
        tops.push(Value::Object(alts));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets})
}

/// OpenAI chat's `logprobs` over `probs`.
fn chat_logprobs(st: &AppState, probs: &[TokenProb], top: usize) -> Value {
    let entry = |id: u32, lp: f32| {
        let bytes = st.model.tokenizer.token_bytes(id, true);
        json!({"token": String::from_utf8_lossy(&bytes), "logprob": lp, "bytes": bytes})
    };
    let content: Vec<Value> = probs
        .iter()
        .map(|p| {
            let mut e = entry(p.id, p.logprob);
            e["top_logprobs"] = Value::Array(p.top.iter().take(top).map(|&(id, lp)| entry(id, lp)).collect());
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The assistant message (`content`, or `tool_calls` when the output is a call) and its finish reason.
fn chat_message(s: &Summary, tool_syntax: Option<tine_engine::template::ToolSyntax>) -> (Value, &'static str) {
    match tool_syntax.and_then(|syntax| parse_tool_calls(syntax, &s.text)) {
        Some((content, calls)) => (json!({"content": if content.is_empty() { Value::Null } else { json!(content) }, "tool_calls": tool_calls_json(&calls)}), "tool_calls"),
        None => (json!({"content": s.text}), finish_reason(s.stop_type)),
    }
}

fn finish_reason(s: StopType) -> &'static str {
    match s {
        StopType::Limit => "length",
        StopType::Eos | StopType::Word => "stop",
    }
}

fn usage(s: &Summary) -> Value {
    usage_of(std::slice::from_ref(s))
}

/// Usage over every choice of a request.
fn usage_of<'a>(all: impl IntoIterator<Item = &'a Summary>) -> Value {
    let (mut prompt, mut completion, mut cached) = (0, 0, 0);
    for s in all {
        prompt += s.prompt_tokens;
        completion += s.timings.predicted_n;
        cached += s.timings.cached_n;
    }
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}})
}

/// OpenAI's `system_fingerprint`: the build that answered (llama-server sends its build too).
fn fingerprint() -> String {
    format!("tine-{}", env!("CARGO_PKG_VERSION"))
}

// ---- /v1/completions (OpenAI) ----

async fn oai_completions(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let mut b: CompletionBody = json_body(&st, body).await?;
    let prompts = prompt_tokens(&st, &mut b)?;
    let vs = validate_many(&st, prompts, b.gen)?;
    let (stream, logprobs) = (vs[0].stream, vs[0].logprobs);
    let rxs = submit_all(&st, &vs)?;
    let id = format!("cmpl-{}", now());
    let created = now();
    if stream {
        let (st2, id2) = (st.clone(), id.clone());
        let mut offsets = vec![0usize; rxs.len()];
        let stream = merged(rxs)
            .map(move |(i, ev)| match ev {
                Event::Token { text, prob, .. } => {
                    let lp = match (logprobs, prob) {
                        (Some(top), Some(p)) => completion_logprobs(&st2, &[p], top, &mut offsets[i]),
                        _ => Value::Null,
                    };
                    sse_json(json!({"id": id2, "object": "text_completion", "created": created, "model": st2.model_id, "system_fingerprint": fingerprint(), "choices": [{"text": text, "index": i, "logprobs": lp, "finish_reason": null}]}))
                }
                Event::Done(s) => {
                    log_request(&st2, &s);
                    sse_json(json!({"id": id2, "object": "text_completion", "created": created, "model": st2.model_id, "system_fingerprint": fingerprint(), "choices": [{"text": "", "index": i, "logprobs": null, "finish_reason": finish_reason(s.stop_type)}], "usage": usage(&s), "timings": timings_json(&s.timings)}))
                }
                Event::Error(e) => {
                    st2.metrics.failed();
                    sse_json(ApiError::from(&e).body())
                }
            })
            .chain(tokio_stream::once(Ok(SseEvent::default().data("[DONE]"))));
        return Ok(Sse::new(stream).into_response());
    }
    let results = collect_all(&st, rxs).await?;
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (s, probs))| {
            let lp = logprobs.map_or(Value::Null, |top| completion_logprobs(&st, probs, top, &mut 0));
            json!({"text": s.text, "index": i, "logprobs": lp, "finish_reason": finish_reason(s.stop_type)})
        })
        .collect();
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": st.model_id, "system_fingerprint": fingerprint(),
        "choices": choices,
        "usage": usage_of(results.iter().map(|r| &r.0)), "timings": timings_json(&results[0].0.timings),
    }))
    .into_response())
}

// ---- /v1/chat/completions (OpenAI) ----

/// The chat prompt as tokens: the template's text, with BOS in front if it left it out.
fn chat_prompt(st: &AppState, b: &ChatBody, tools: Option<&Value>) -> Result<(String, Vec<u32>), ApiError> {
    let messages: Vec<Value> = b.messages.iter().map(|m| m.to_template_value()).collect::<Result<_, _>>()?;
    let tok = &st.model.tokenizer;
    let bos = tok.bos_token().and_then(|b| tok.token_text(b)).unwrap_or("");
    let eos = tok.eos_token().and_then(|b| tok.token_text(b)).unwrap_or("");
    let input = RenderInput { messages: &messages, tools, add_generation_prompt: true, bos_token: bos, eos_token: eos };
    let text = st.template.render(&input).map_err(|e| match e {
        // The server's own template is broken: not the client's fault.
        TemplateError::Syntax(_) | TemplateError::Read { .. } => ApiError::internal(e.to_string()),
        _ => ApiError::bad(e.to_string()),
    })?;
    let mut ids = tok.encode(&text, false, true);
    if let Some(b) = tok.bos_token() {
        if ids.first() != Some(&b) {
            ids.insert(0, b);
        }
    }
    Ok((text, ids))
}

/// llama-server's `/apply-template`: the prompt a chat request would run.
async fn apply_template(State(st): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let b: ChatBody = json_body(&st, body).await?;
    let tools = b.tools()?;
    let (text, _) = chat_prompt(&st, &b, tools.as_ref())?;
    Ok(Json(json!({ "prompt": text })))
}

/// OpenAI's `tool_calls` for parsed calls.
fn tool_calls_json(calls: &[tine_engine::template::ToolCall]) -> Value {
    Value::Array(calls.iter().enumerate().map(|(i, c)| json!({"id": format!("call_{i}"), "type": "function", "function": {"name": c.name, "arguments": c.arguments}})).collect())
}

async fn chat_completions(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let b: ChatBody = json_body(&st, body).await?;
    let tools = b.tools()?;
    let (_, prompt) = chat_prompt(&st, &b, tools.as_ref())?;
    // With tools, the output is parsed for calls in the template family's syntax; a forced
    // call is constrained to a JSON object naming the tool, and read as one.
    let forced = b.forced_call()?;
    let mut gen = b.gen;
    let tool_syntax = match forced {
        Some(schema) => {
            if gen.constraint()?.is_some() {
                return Err(ApiError::bad("tool_choice: a forced call cannot be combined with response_format, json_schema or grammar"));
            }
            gen.json_schema = Some(schema);
            Some(tine_engine::template::ToolSyntax::JsonObject)
        }
        None => tools.as_ref().and_then(|_| st.template.tool_syntax()),
    };
    let vs = validate_many(&st, vec![prompt], gen)?;
    let (stream, logprobs) = (vs[0].stream, vs[0].logprobs);
    let rxs = submit_all(&st, &vs)?;
    let id = format!("chatcmpl-{}", now());
    let created = now();
    let chunk = |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": st.model_id, "system_fingerprint": fingerprint(), "choices": choices});
    if stream && tool_syntax.is_some() {
        // A call can only be told from text at the end: each answer comes as one chunk.
        let results = collect_all(&st, rxs).await?;
        let mut events = Vec::new();
        for (i, (s, probs)) in results.iter().enumerate() {
            let (mut delta, finish) = chat_message(s, tool_syntax);
            delta["role"] = json!("assistant");
            let lp = logprobs.map_or(Value::Null, |top| chat_logprobs(&st, probs, top));
            events.push(sse_json(chunk(json!([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": null}]))));
            let mut last = chunk(json!([{"index": i, "delta": {}, "finish_reason": finish}]));
            last["usage"] = usage(s);
            last["timings"] = timings_json(&s.timings);
            events.push(sse_json(last));
        }
        events.push(Ok(SseEvent::default().data("[DONE]")));
        return Ok(Sse::new(tokio_stream::iter(events)).into_response());
    }
    if stream {
        let (st2, id2) = (st.clone(), id.clone());
        // llama-server's first chunk: the role, and no content yet (`null`, never "").
        let firsts: Vec<_> = (0..rxs.len()).map(|i| sse_json(chunk(json!([{"index": i, "delta": {"role": "assistant", "content": null}, "finish_reason": null}])))).collect();
        let stream = tokio_stream::iter(firsts)
            .chain(merged(rxs).filter_map(move |(i, ev)| {
                let chunk = |choices: Value| json!({"id": id2, "object": "chat.completion.chunk", "created": created, "model": st2.model_id, "system_fingerprint": fingerprint(), "choices": choices});
                match ev {
                    Event::Token { text, prob, .. } => {
                        let lp = match (logprobs, prob) {
                            (Some(top), Some(p)) => chat_logprobs(&st2, &[p], top),
                            _ => Value::Null,
                        };
                        // Text held back while a stop string may be forming is not an empty delta.
                        if text.is_empty() && lp.is_null() {
                            return None;
                        }
                        let delta = if text.is_empty() { json!({}) } else { json!({"content": text}) };
                        Some(sse_json(chunk(json!([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": null}]))))
                    }
                    Event::Done(s) => {
                        log_request(&st2, &s);
                        let mut last = chunk(json!([{"index": i, "delta": {}, "finish_reason": finish_reason(s.stop_type)}]));
                        last["usage"] = usage(&s);
                        last["timings"] = timings_json(&s.timings);
                        Some(sse_json(last))
                    }
                    Event::Error(e) => {
                        st2.metrics.failed();
                        Some(sse_json(ApiError::from(&e).body()))
                    }
                }
            }))
            .chain(tokio_stream::once(Ok(SseEvent::default().data("[DONE]"))));
        return Ok(Sse::new(stream).into_response());
    }
    let results = collect_all(&st, rxs).await?;
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (s, probs))| {
            let lp = logprobs.map_or(Value::Null, |top| chat_logprobs(&st, probs, top));
            let (mut message, finish) = chat_message(s, tool_syntax);
            message["role"] = json!("assistant");
            json!({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        })
        .collect();
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": st.model_id, "system_fingerprint": fingerprint(),
        "choices": choices,
        "usage": usage_of(results.iter().map(|r| &r.0)), "timings": timings_json(&results[0].0.timings),
    }))
    .into_response())
}
