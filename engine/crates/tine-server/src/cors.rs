//! CORS for browser clients, with llama-server's flags (`--cors-origins`, `--cors-methods`,
//! `--cors-headers`, `--cors-credentials`): an allowed `Origin` is reflected, and `OPTIONS`
//! preflights are answered 200 with an empty body, as llama-server answers them. Other origins
//! get no CORS headers, so browsers keep them out.
//!
//! Tine's default is llama.cpp's `localhost` value (pages served from this machine only), not
//! llama-server's `*`: `*` with credentials lets any web page a user visits drive the server
//! (llama-server warns about it), so it is opt-in here, and warned about without `--api-key`.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Which origins get CORS headers (`--cors-origins`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CorsOrigins {
    /// `localhost`: pages served from this machine ([`is_local_origin`]).
    Localhost,
    /// `*`: every origin (reflected, so credentials still work).
    Any,
    /// A comma-separated list of exact origins (`https://app.example.com`).
    List(Vec<String>),
}

impl CorsOrigins {
    /// llama.cpp's syntax: `localhost`, `*`, or a comma-separated list of origins.
    pub fn parse(s: &str) -> CorsOrigins {
        match s.trim() {
            "localhost" => CorsOrigins::Localhost,
            "*" => CorsOrigins::Any,
            list => CorsOrigins::List(list.split(',').map(|o| o.trim().trim_end_matches('/').to_owned()).filter(|o| !o.is_empty()).collect()),
        }
    }

    pub fn allows(&self, origin: &str) -> bool {
        match self {
            CorsOrigins::Localhost => is_local_origin(origin),
            CorsOrigins::Any => !origin.is_empty(),
            CorsOrigins::List(l) => l.iter().any(|o| o == origin),
        }
    }
}

/// What the CORS headers say (llama-server's flags and defaults, but `localhost` origins).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorsConfig {
    pub origins: CorsOrigins,
    /// `Access-Control-Allow-Methods` of a preflight.
    pub methods: String,
    /// `Access-Control-Allow-Headers` of a preflight; `None` reflects the headers the browser
    /// asks for (llama-server's `*` is not honoured by browsers with credentials).
    pub headers: Option<String>,
    pub credentials: bool,
}

impl Default for CorsConfig {
    fn default() -> Self {
        CorsConfig { origins: CorsOrigins::Localhost, methods: "GET, POST, DELETE, OPTIONS".into(), headers: None, credentials: true }
    }
}

/// Whether `origin` is a page served from this machine.
pub fn is_local_origin(origin: &str) -> bool {
    let Some(rest) = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://")) else { return false };
    let host = if let Some(v6) = rest.strip_prefix('[') {
        match v6.split_once(']') {
            Some((h, tail)) if tail.is_empty() || tail.starts_with(':') => return h == "::1" && port_ok(tail),
            _ => return false,
        }
    } else {
        rest
    };
    let (name, tail) = match host.find(':') {
        Some(i) => (&host[..i], &host[i..]),
        None => (host, ""),
    };
    matches!(name, "localhost" | "127.0.0.1") && port_ok(tail)
}

fn port_ok(tail: &str) -> bool {
    tail.is_empty() || tail.strip_prefix(':').is_some_and(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()))
}

fn allow(headers: &mut HeaderMap, origin: &HeaderValue, credentials: bool) {
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
    if credentials {
        headers.insert(header::ACCESS_CONTROL_ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
    }
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
}

pub async fn cors(State(cfg): State<std::sync::Arc<CorsConfig>>, req: Request, next: Next) -> Response {
    let origin = req.headers().get(header::ORIGIN).filter(|o| o.to_str().is_ok_and(|o| cfg.origins.allows(o))).cloned();
    if req.method() == Method::OPTIONS {
        // llama-server answers a preflight 200 with an empty body.
        let mut r = (StatusCode::OK, "").into_response();
        if let Some(o) = &origin {
            let h = r.headers_mut();
            allow(h, o, cfg.credentials);
            if let Ok(m) = HeaderValue::from_str(&cfg.methods) {
                h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, m);
            }
            let asked = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned().unwrap_or(HeaderValue::from_static("Content-Type, Authorization"));
            let headers = cfg.headers.as_deref().and_then(|h| HeaderValue::from_str(h).ok()).unwrap_or(asked);
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, headers);
            h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
        }
        return r;
    }
    let mut r = next.run(req).await;
    if let Some(o) = &origin {
        allow(r.headers_mut(), o, cfg.credentials);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::{is_local_origin, CorsOrigins};

    #[test]
    fn cors_origins_take_llama_cpps_values() {
        assert_eq!(CorsOrigins::parse("localhost"), CorsOrigins::Localhost);
        assert_eq!(CorsOrigins::parse("*"), CorsOrigins::Any);
        let list = CorsOrigins::parse("https://a.example, https://b.example/");
        assert!(list.allows("https://a.example") && list.allows("https://b.example"));
        assert!(!list.allows("https://c.example") && !list.allows("http://localhost:3000"));
        assert!(CorsOrigins::Any.allows("https://anything.example") && !CorsOrigins::Any.allows(""));
    }

    #[test]
    fn only_origins_on_this_machine_are_local() {
        for ok in ["http://localhost", "http://localhost:8080", "https://127.0.0.1:3000", "http://[::1]:5173", "http://[::1]"] {
            assert!(is_local_origin(ok), "{ok}");
        }
        for bad in [
            "http://localhost.evil.com",
            "http://evil.com",
            "http://127.0.0.1.evil:80",
            "file://localhost",
            "http://localhost:",
            "http://localhost:80/x",
            "http://[::2]:80",
            "null",
            "http://localhost@evil.com",
        ] {
            assert!(!is_local_origin(bad), "{bad}");
        }
    }
}
