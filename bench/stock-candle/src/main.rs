//! Stock candle's quantized Gemma 3 loop behind a minimal llama-server-style HTTP API, so the
//! three-way benchmark measures every engine through one method.
//!
//! Usage: stock-candle-bench MODEL.gguf [--port 8080]
//!
//! - `GET /health` answers `{"status": "ok"}`.
//! - `POST /completion` takes `{"prompt": [token ids], "n_predict": N}` (stock candle has no
//!   SentencePiece tokenizer, so text prompts are refused with a 400), prefills the prompt in one
//!   forward, decodes N greedy tokens (EOS ignored, as a benchmark wants) and answers
//!   `{"tokens": [...], "timings": {prompt_n, prompt_ms, prompt_per_second, predicted_n,
//!   predicted_ms, predicted_per_second}}`, the fields llama-server reports.
//!
//! One request at a time; errors are a status and a JSON body, and the server keeps serving.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_gemma3::ModelWeights;
use serde_json::{json, Value};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(model_path) = args.get(1) else {
        eprintln!("usage: stock-candle-bench MODEL.gguf [--port 8080]");
        std::process::exit(2);
    };
    let port = args.iter().position(|a| a == "--port").and_then(|i| args.get(i + 1)).map(|p| p.parse::<u16>().expect("--port takes a number")).unwrap_or(8080);
    let dev = Device::Cpu;
    let mut f = std::fs::File::open(model_path).unwrap_or_else(|e| panic!("cannot open {model_path}: {e}"));
    let ct = gguf_file::Content::read(&mut f).expect("a GGUF file");
    let mut model = ModelWeights::from_gguf(ct, &mut f, &dev).expect("stock quantized_gemma3 loads the model");
    let listener = TcpListener::bind(("127.0.0.1", port)).unwrap_or_else(|e| panic!("cannot listen on port {port}: {e}"));
    eprintln!("stock-candle-bench: listening on 127.0.0.1:{port}");
    for stream in listener.incoming().flatten() {
        if let Err(e) = serve(stream, &mut model, &dev) {
            eprintln!("request failed: {e}");
        }
    }
}

fn serve(mut stream: TcpStream, model: &mut ModelWeights, dev: &Device) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body)?;
    let (status, reply) = match (method, path) {
        ("GET", "/health") => (200, json!({"status": "ok"})),
        ("POST", "/completion") => match complete(&body, model, dev) {
            Ok(v) => (200, v),
            Err(msg) => (400, json!({"error": {"code": 400, "message": msg, "type": "invalid_request_error"}})),
        },
        _ => (404, json!({"error": {"code": 404, "message": format!("no route {method} {path}"), "type": "not_found_error"}})),
    };
    let text = reply.to_string();
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        _ => "Not Found",
    };
    write!(stream, "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}", text.len())
}

fn complete(body: &[u8], model: &mut ModelWeights, dev: &Device) -> Result<Value, String> {
    let req: Value = serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let ids: Vec<u32> = req["prompt"]
        .as_array()
        .ok_or("`prompt` must be an array of token ids (this harness has no tokenizer)")?
        .iter()
        .map(|v| v.as_u64().map(|x| x as u32).ok_or("`prompt` holds a non-integer"))
        .collect::<Result<_, _>>()?;
    if ids.is_empty() {
        return Err("`prompt` is empty".into());
    }
    let n = req["n_predict"].as_u64().ok_or("`n_predict` must be a non-negative integer")? as usize;
    let err = |e: candle_core::Error| e.to_string();
    let t0 = Instant::now();
    // index_pos 0 resets stock candle's KV cache.
    let logits = model.forward(&Tensor::new(ids.as_slice(), dev).and_then(|t| t.unsqueeze(0)).map_err(err)?, 0).map_err(err)?;
    let mut next = logits.squeeze(0).and_then(|l| l.argmax(0)).and_then(|t| t.to_scalar::<u32>()).map_err(err)?;
    let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut out = Vec::with_capacity(n);
    let t1 = Instant::now();
    for i in 0..n {
        out.push(next);
        if i + 1 == n {
            break;
        }
        let logits = model.forward(&Tensor::new(&[next], dev).and_then(|t| t.unsqueeze(0)).map_err(err)?, ids.len() + i).map_err(err)?;
        next = logits.squeeze(0).and_then(|l| l.argmax(0)).and_then(|t| t.to_scalar::<u32>()).map_err(err)?;
    }
    let predicted_ms = t1.elapsed().as_secs_f64() * 1e3;
    // llama-server counts the first generated token's forward in the prompt phase, as here.
    let decoded = n.saturating_sub(1);
    Ok(json!({
        "tokens": out,
        "timings": {
            "prompt_n": ids.len(), "prompt_ms": prompt_ms, "prompt_per_second": ids.len() as f64 / prompt_ms * 1e3,
            "predicted_n": n, "predicted_ms": predicted_ms, "predicted_per_second": if predicted_ms > 0.0 { decoded as f64 / predicted_ms * 1e3 } else { 0.0 },
        }
    }))
}
