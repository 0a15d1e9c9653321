//! Every error the server answers, and the one place that maps an error's type to a status.
//!
//! The body is llama-server's (and OpenAI's) shape: `{"error": {"code", "message", "type"}}`,
//! with OpenAI's `param` naming the field when a request field is at fault.
//! The message is the whole cause chain (`model step failed: tensor operation failed: ...`),
//! so a client sees why, not only that, something failed.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tine_engine::GenerateError;
use tine_runtime::StepError;

/// An error answered with a status and a JSON body.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// A more precise `type` than the status gives, and fields of its own (llama-server's
    /// `exceed_context_size_error` carries `n_prompt_tokens` and `n_ctx`).
    pub detail: Option<Box<(&'static str, serde_json::Map<String, Value>)>>,
    /// The request field at fault, sent as OpenAI's `param` (`logit_bias`, `top_p`, ...).
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), detail: None, param: None }
    }
    /// A prompt that does not fit the context, in llama-server's shape.
    pub fn exceeds_context(n_prompt: usize, n_ctx: usize) -> ApiError {
        let mut fields = serde_json::Map::new();
        fields.insert("n_prompt_tokens".into(), json!(n_prompt));
        fields.insert("n_ctx".into(), json!(n_ctx));
        ApiError {
            detail: Some(Box::new(("exceed_context_size_error", fields))),
            ..ApiError::bad(format!("the request exceeds the available context size: the prompt has {n_prompt} tokens, the context holds {n_ctx}"))
        }
    }
    /// The same error, naming the request field at fault.
    pub fn param(self, name: &str) -> ApiError {
        ApiError { param: Some(name.to_owned()), ..self }
    }
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// llama-server's `type` for a status.
    pub fn kind(&self) -> &'static str {
        if let Some((kind, _)) = self.detail.as_deref() {
            return kind;
        }
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::NOT_IMPLEMENTED => "not_supported_error",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The JSON body (also sent as an SSE event when a stream fails midway).
    pub fn body(&self) -> Value {
        let mut e = json!({"code": self.status.as_u16(), "message": self.message, "type": self.kind()});
        if let Some((_, fields)) = self.detail.as_deref() {
            e.as_object_mut().expect("an object").extend(fields.clone());
        }
        if let Some(param) = &self.param {
            e["param"] = json!(param);
        }
        json!({ "error": e })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

fn step_status(e: &StepError) -> StatusCode {
    match e {
        // What the request asked for does not fit: the client can change it.
        StepError::ContextFull { .. } | StepError::BadToken { .. } => StatusCode::BAD_REQUEST,
        StepError::Empty | StepError::RollbackPastEnd { .. } | StepError::RollbackRecurrent { .. } | StepError::Candle(_) | StepError::Gpu(_) | StepError::Injected => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
        // What this server's engine cannot do yet (a head's hidden states on the GPU engine, a
        // slot file of a recurrent model).
        StepError::NotOnGpuEngine(_) | StepError::NotForArchitecture(_) => StatusCode::NOT_IMPLEMENTED,
    }
}

/// The status of each engine error: the only mapping from error types to HTTP statuses.
pub fn status_of(e: &GenerateError) -> StatusCode {
    match e {
        GenerateError::EmptyPrompt | GenerateError::PromptTooLong { .. } | GenerateError::BadNPredict(_) | GenerateError::Sampling(_) => StatusCode::BAD_REQUEST,
        GenerateError::Step(s) => step_status(s),
        // A drafter or verify failure is the server's, whatever the step error says.
        GenerateError::Spec(_) | GenerateError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        GenerateError::Grammar(g) => grammar_status(g),
    }
}

/// A grammar the client sent that does not compile is theirs; a parser failure mid-way is ours.
pub fn grammar_status(e: &tine_engine::grammar::GrammarError) -> StatusCode {
    use tine_engine::grammar::GrammarError as G;
    match e {
        G::Gbnf { .. } | G::Compile(_) => StatusCode::BAD_REQUEST,
        G::Setup(_) | G::Runtime(_) | G::Dead(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl From<&GenerateError> for ApiError {
    fn from(e: &GenerateError) -> ApiError {
        match e {
            GenerateError::PromptTooLong { prompt, context } => ApiError::exceeds_context(*prompt, *context),
            GenerateError::Sampling(p) => ApiError { param: Some(p.param().to_owned()), ..ApiError::bad(p.to_string()) },
            GenerateError::BadNPredict(_) => ApiError { param: Some("n_predict".into()), ..ApiError::bad(e.to_string()) },
            _ => ApiError::new(status_of(e), tine_engine::error_chain(e)),
        }
    }
}

/// The one mapping of slot-action failures.
impl From<&crate::scheduler::SlotError> for ApiError {
    fn from(e: &crate::scheduler::SlotError) -> ApiError {
        use crate::scheduler::SlotError as S;
        let status = match e {
            S::NoSuchSlot { .. } => StatusCode::NOT_FOUND,
            S::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
            // The engine's failures keep their own status (501 for what this model cannot do).
            S::File(tine_runtime::SlotFileError::Step(s)) | S::Read(s) => step_status(s),
            S::File(_) => StatusCode::BAD_REQUEST,
        };
        ApiError::new(status, tine_engine::error_chain(e))
    }
}

/// A slot file `name` that could not be read from `--slot-save-path` (404 when there is none),
/// or that is not a slot file (400).
pub fn slot_file_read(name: &str, e: &std::io::Error) -> ApiError {
    if e.kind() == std::io::ErrorKind::NotFound {
        ApiError::new(StatusCode::NOT_FOUND, format!("no slot file {name:?}"))
    } else {
        ApiError::internal(format!("reading {name:?}: {e}"))
    }
}

/// A slot file's bytes that do not parse: the client named the wrong file.
pub fn slot_file_malformed(name: &str, e: &tine_runtime::SlotFileError) -> ApiError {
    ApiError::bad(format!("{name:?}: {e}"))
}

/// A request the client must change.
impl From<tine_api::RequestError> for ApiError {
    fn from(e: tine_api::RequestError) -> ApiError {
        ApiError { param: e.param, ..ApiError::bad(e.message) }
    }
}

impl From<GenerateError> for ApiError {
    fn from(e: GenerateError) -> ApiError {
        ApiError::from(&e)
    }
}
