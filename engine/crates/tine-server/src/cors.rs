//! CORS for browser clients on this machine (a web UI on `http://localhost:PORT`), as
//! llama-server allows them: a localhost `Origin` is reflected, and `OPTIONS` preflights are
//! answered. Other origins get no CORS headers, so browsers keep them out.

use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

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

fn allow(headers: &mut HeaderMap, origin: &HeaderValue) {
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
    headers.insert(header::ACCESS_CONTROL_ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
}

pub async fn cors(req: Request, next: Next) -> Response {
    let origin = req.headers().get(header::ORIGIN).filter(|o| o.to_str().is_ok_and(is_local_origin)).cloned();
    if req.method() == Method::OPTIONS {
        let mut r = StatusCode::NO_CONTENT.into_response();
        if let Some(o) = &origin {
            let h = r.headers_mut();
            allow(h, o);
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
            let asked = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned().unwrap_or(HeaderValue::from_static("Content-Type, Authorization"));
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
            h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
        }
        return r;
    }
    let mut r = next.run(req).await;
    if let Some(o) = &origin {
        allow(r.headers_mut(), o);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::is_local_origin;

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
