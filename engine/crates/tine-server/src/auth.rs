//! `--api-key`: llama-server's bearer-token check, in front of every endpoint but `/health` and
//! the chat page's files (the page asks for the key and sends it with its requests).

use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The accepted keys (none: no check).
#[derive(Clone, Default)]
pub struct ApiKeys(Vec<Vec<u8>>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print a key.
        write!(f, "ApiKeys({} key(s))", self.0.len())
    }
}

impl ApiKeys {
    pub fn new<I: IntoIterator<Item = String>>(keys: I) -> ApiKeys {
        ApiKeys(keys.into_iter().map(|k| k.trim().to_owned()).filter(|k| !k.is_empty()).map(String::into_bytes).collect())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `given` is one of the keys. Every key is compared in full, in time that does
    /// not depend on where the bytes differ.
    pub fn accepts(&self, given: &[u8]) -> bool {
        let mut ok = false;
        for k in &self.0 {
            ok |= constant_time_eq(k, given);
        }
        ok
    }
}

/// Equal length and equal bytes, without an early exit on the first difference.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Endpoints answered without a key (load balancers probe them).
const PUBLIC: [&str; 2] = ["/health", "/v1/health"];

/// The key a request carries: `Authorization: Bearer KEY` (or llama-server's `X-Api-Key`).
fn presented(req: &Request) -> Option<&[u8]> {
    let h = req.headers();
    if let Some(v) = h.get(header::AUTHORIZATION) {
        let v = v.as_bytes();
        let (scheme, rest) = v.split_at(v.iter().position(|&b| b == b' ').unwrap_or(v.len()));
        if scheme.eq_ignore_ascii_case(b"bearer") {
            return Some(rest.trim_ascii());
        }
        return None;
    }
    h.get("x-api-key").map(|v| v.as_bytes().trim_ascii())
}

/// What [`require_key`] checks: the keys, and the chat page whose files are public.
#[derive(Clone, Debug)]
pub struct Gate {
    pub keys: ApiKeys,
    pub ui: crate::webui::WebUi,
}

pub async fn require_key(State(Gate { keys, ui }): State<Gate>, req: Request, next: Next) -> Response {
    let page = matches!(*req.method(), Method::GET | Method::HEAD) && ui.serves(req.uri().path());
    if keys.is_empty() || PUBLIC.contains(&req.uri().path()) || req.method() == Method::OPTIONS || page {
        return next.run(req).await;
    }
    match presented(&req) {
        Some(k) if keys.accepts(k) => next.run(req).await,
        Some(_) => ApiError::new(axum::http::StatusCode::UNAUTHORIZED, "Invalid API Key").into_response(),
        None => ApiError::new(axum::http::StatusCode::UNAUTHORIZED, "Missing API key: send `Authorization: Bearer KEY`").into_response(),
    }
}
