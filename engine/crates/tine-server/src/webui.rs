//! The chat page at `/` (llama-server's Web UI in spirit): `webui/index.html`, `webui/app.js` and
//! the vendored libraries of `webui/vendor/` compiled into the binary, so a browser needs
//! nothing but this server. `--no-webui` turns it off; `--path DIR` serves a directory's files
//! instead (`DIR/index.html` at `/`), as llama-server's flag does.

use std::path::{Component, Path, PathBuf};

use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

const INDEX: &[u8] = include_bytes!("../webui/index.html");
const APP: &[u8] = include_bytes!("../webui/app.js");
const MARKED: &[u8] = include_bytes!("../webui/vendor/marked.umd.js");
const PURIFY: &[u8] = include_bytes!("../webui/vendor/purify.min.js");

/// The page's own files by path: `(path, content type, bytes)`.
const FILES: [(&str, &str, &[u8]); 5] = [
    ("/", "text/html; charset=utf-8", INDEX),
    ("/index.html", "text/html; charset=utf-8", INDEX),
    ("/webui/app.js", "text/javascript; charset=utf-8", APP),
    ("/webui/vendor/marked.umd.js", "text/javascript; charset=utf-8", MARKED),
    ("/webui/vendor/purify.min.js", "text/javascript; charset=utf-8", PURIFY),
];

/// Where the page comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum WebUi {
    /// The page compiled into the binary (the default).
    #[default]
    Builtin,
    /// `--path DIR`: the files of a directory.
    Dir(PathBuf),
    /// `--no-webui`: no page; `/` answers 404 like any unknown path.
    Off,
}

impl WebUi {
    /// Whether a `GET`/`HEAD` of `path` is a file of the page (served without an API key: a
    /// browser opening the page cannot send one; the page then asks for it).
    pub fn serves(&self, path: &str) -> bool {
        match self {
            WebUi::Builtin => FILES.iter().any(|(p, _, _)| *p == path),
            WebUi::Dir(dir) => resolve(dir, path).is_some(),
            WebUi::Off => false,
        }
    }
}

/// `path` (a request's, percent-encoded as sent) inside `dir`: a file, or a directory's
/// `index.html`. `None` for anything that could leave `dir` (`..`, a percent sign, a
/// backslash, a link pointing out) or does not exist.
pub fn resolve(dir: &Path, path: &str) -> Option<PathBuf> {
    if path.contains(['%', '\\', '\0']) || !path.starts_with('/') {
        return None;
    }
    let rel = Path::new(&path[1..]);
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return None;
    }
    let root = dir.canonicalize().ok()?;
    let mut full = root.join(rel).canonicalize().ok()?;
    if full.is_dir() {
        full = full.join("index.html").canonicalize().ok()?;
    }
    (full.starts_with(&root) && full.is_file()).then_some(full)
}

/// A content type by file extension (what a page directory holds).
fn content_type(path: &Path) -> &'static str {
    match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("html" | "htm") => "text/html; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("json") => "application/json",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("gif") => "image/gif",
        Some("webp") => "image/webp",
        Some("ico") => "image/x-icon",
        Some("woff2") => "font/woff2",
        Some("txt" | "md") => "text/plain; charset=utf-8",
        Some("wasm") => "application/wasm",
        _ => "application/octet-stream",
    }
}

fn file_response(ty: &'static str, body: Vec<u8>, head: bool) -> Response {
    let mut res = if head { ().into_response() } else { body.into_response() };
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ty));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // The page runs its own scripts only and talks to this server only; model output is
    // sanitized before it reaches the DOM, and this keeps it so.
    if ty.starts_with("text/html") {
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'self'"),
        );
    }
    res
}

/// Serves a `GET`/`HEAD` of the page; `None` where `path` is not one of its files.
pub fn serve(ui: &WebUi, req: &Request) -> Option<Response> {
    let head = req.method() == Method::HEAD;
    if !(head || req.method() == Method::GET) {
        return None;
    }
    let path = req.uri().path();
    match ui {
        WebUi::Builtin => FILES.iter().find(|(p, _, _)| *p == path).map(|(_, ty, bytes)| file_response(ty, bytes.to_vec(), head)),
        WebUi::Dir(dir) => {
            let file = resolve(dir, path)?;
            Some(match std::fs::read(&file) {
                Ok(bytes) => file_response(content_type(&file), bytes, head),
                Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("could not read {}: {e}", file.display())).into_response(),
            })
        }
        WebUi::Off => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_stays_inside_the_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("index.html"), "<p>hi</p>").expect("write");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::fs::write(dir.path().join("sub/a.js"), "1").expect("write");
        let outside = tempfile::tempdir().expect("tempdir");
        std::fs::write(outside.path().join("secret"), "no").expect("write");
        #[cfg(unix)]
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("link")).expect("symlink");
        let d = dir.path();
        assert_eq!(resolve(d, "/"), Some(d.canonicalize().unwrap().join("index.html")));
        assert_eq!(resolve(d, "/sub/a.js"), Some(d.canonicalize().unwrap().join("sub/a.js")));
        for bad in ["/../secret", "/sub/../../secret", "/%2e%2e/secret", "/sub\\..\\x", "/missing", "/link", "sub/a.js", "//etc/passwd", "/sub/"] {
            assert_eq!(resolve(d, bad), None, "{bad}");
        }
    }
}
