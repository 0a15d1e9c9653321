//! Integration tests of tine-server (one test binary for the crate): a real server on a local
//! port, over a synthetic Gemma 3 GGUF, spoken to with plain HTTP/1.1.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use serde_json::{json, Value};
use tine_runtime::Model;
use tine_server::ServerConfig;
use tine_test_support::TinyGemma3;

mod hostile;

struct Server {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    _rt: tokio::runtime::Runtime,
}

fn start(parallel: usize, ctx_size: usize) -> Server {
    start_with(parallel, ctx_size, None)
}

fn start_with(parallel: usize, ctx_size: usize, spec: Option<tine_spec::SpecType>) -> Server {
    start_cfg(spec, |c| *c = ServerConfig { spec: None, ..ServerConfig::new(parallel, ctx_size) })
}

/// A server over the fixture (context 8192), with `edit` setting its configuration.
fn start_cfg(spec: Option<tine_spec::SpecType>, edit: impl FnOnce(&mut ServerConfig)) -> Server {
    start_model(TinyGemma3 { nextn: spec.is_some(), context: 8192, ..TinyGemma3::default() }, spec, edit)
}

fn start_model(cfg: TinyGemma3, spec: Option<tine_spec::SpecType>, edit: impl FnOnce(&mut ServerConfig)) -> Server {
    start_file(
        |path| {
            cfg.write(path);
            // An assistant head and a draft model beside it, for the spec types that need them.
            let dir = path.parent().expect("in the test's directory");
            tine_test_support::TinyAssistant::default().write(&cfg, &dir.join("assistant.gguf"));
            TinyGemma3 { seed: 99, n_layer: 2, context: 8192, ..TinyGemma3::default() }.write(&dir.join("draft.gguf"));
        },
        spec,
        edit,
    )
}

/// A server over the GGUF `write` puts at the path it is given (an assistant head and a draft
/// model, where the spec type reads them, beside it as `assistant.gguf` and `draft.gguf`).
fn start_file(write: impl FnOnce(&std::path::Path), spec: Option<tine_spec::SpecType>, edit: impl FnOnce(&mut ServerConfig)) -> Server {
    start_file_as(write, spec, edit, |_| {})
}

/// [`start_file`] with `prepare` called on the model before it is served.
fn start_file_as(write: impl FnOnce(&std::path::Path), spec: Option<tine_spec::SpecType>, edit: impl FnOnce(&mut ServerConfig), prepare: impl FnOnce(&mut Model)) -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write(&path);
    let (head, draft) = (dir.path().join("assistant.gguf"), dir.path().join("draft.gguf"));
    let mut model = Model::load(&path).expect("fixture loads");
    prepare(&mut model);
    let model = Arc::new(model);
    let spec = spec.map(|kind| {
        let config = tine_spec::SpecConfig { ngram_min: 1, mtp_head: head.exists().then_some(head), draft_model: draft.exists().then_some(draft), ..tine_spec::SpecConfig::new(kind) };
        Arc::new(tine_spec::SpecFactory::load(config, &model).expect("speculative setup"))
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut config = ServerConfig::new(1, 256);
    edit(&mut config);
    config.spec = spec;
    let app = tine_server::router(model, config);
    rt.spawn(async move { tine_server::serve_on(listener, app).await.expect("serve") });
    Server { addr, _dir: dir, _rt: rt }
}

/// One request on a fresh connection; returns (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("HTTP response");
    let status: u16 = head.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("status");
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_owned() };
    (status, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn post(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, &body.to_string());
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} answered non-JSON ({e}): {text}")))
}

fn greedy(prompt: &str, n: i64) -> Value {
    json!({"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": true})
}

#[test]
fn info_endpoints_answer_with_llama_server_shapes() {
    let srv = start(2, 128);
    let (s, b) = http(srv.addr, "GET", "/health", "");
    assert_eq!((s, b.as_str()), (200, r#"{"status":"ok"}"#));
    let (s, b) = http(srv.addr, "GET", "/props", "");
    let props: Value = serde_json::from_str(&b).expect("json");
    assert_eq!(s, 200);
    assert_eq!(props["total_slots"], 2);
    assert_eq!(props["default_generation_settings"]["n_ctx"], 128);
    let (_, b) = http(srv.addr, "GET", "/v1/models", "");
    let models: Value = serde_json::from_str(&b).expect("json");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["object"], "model");
}

#[test]
fn predicted_per_second_does_not_count_the_token_the_prompt_pass_gave() {
    let srv = start(1, 128);
    let (_, v) = post(srv.addr, "/completion", greedy("hello world", 1));
    assert_eq!(v["timings"]["predicted_n"], 1, "{v}");
    assert_eq!(v["timings"]["predicted_per_second"], 0.0, "one token is no decode at all: {v}");
}

#[test]
fn completion_is_deterministic_and_reports_timings() {
    let srv = start(1, 128);
    let (s, a) = post(srv.addr, "/completion", greedy("hello world", 8));
    assert_eq!(s, 200, "{a}");
    let (_, b) = post(srv.addr, "/completion", greedy("hello world", 8));
    assert_eq!(a["content"], b["content"]);
    assert_eq!(a["tokens"], b["tokens"]);
    assert_eq!(a["tokens"].as_array().expect("tokens").len(), 8);
    assert_eq!(a["stop_type"], "limit");
    assert_eq!(a["stop"], true);
    for k in ["prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second"] {
        assert!(a["timings"][k].is_number(), "timings.{k} missing: {a}");
    }
    assert_eq!(a["timings"]["predicted_n"], 8);
    let t = &a["timings"];
    let want = 7.0 * 1000.0 / t["predicted_ms"].as_f64().expect("ms");
    assert!((t["predicted_per_second"].as_f64().expect("rate") - want).abs() < 1e-6 * want, "the first token is the prompt pass's: {t}");
    // The second request reused the cached prompt prefix of the slot.
    assert!(b["timings"]["cache_n"].as_u64().expect("cache_n") >= 2, "{b}");
}

#[test]
fn concurrent_clients_get_the_same_output_as_alone() {
    let srv = start(2, 128);
    let prompts = ["hello world", "the world", "an hello", "in the hell", "world world"];
    let alone: Vec<Value> = prompts.iter().map(|p| post(srv.addr, "/completion", greedy(p, 10)).1).collect();
    let addr = srv.addr;
    let handles: Vec<_> = (0..3)
        .flat_map(|_| prompts.iter())
        .map(|p| {
            let p = p.to_string();
            std::thread::spawn(move || (p.clone(), post(addr, "/completion", greedy(&p, 10)).1))
        })
        .collect();
    for h in handles {
        let (p, got) = h.join().expect("client thread");
        let want = &alone[prompts.iter().position(|x| *x == p).expect("known prompt")];
        assert_eq!(got["tokens"], want["tokens"], "{p:?} under concurrency");
        assert_eq!(got["content"], want["content"]);
    }
}

#[test]
fn bad_requests_get_a_400_with_an_error_body_and_the_server_keeps_serving() {
    let srv = start(1, 32);
    let cases: &[(&str, &str, &str)] = &[
        ("/completion", "{bad json", "invalid JSON body"),
        ("/completion", "", "the request body is empty"),
        ("/completion", r#"{"prompt": "hello", "n_predict": -2}"#, "n_predict must be -1"),
        ("/completion", r#"{"prompt": "hello", "temperature": "hot"}"#, "invalid type"),
        ("/completion", r#"{"prompt": "hello", "top_p": 3}"#, "top_p must lie in [0, 1]"),
        ("/completion", r#"{"n_predict": 3}"#, "`prompt` is required"),
        ("/completion", r#"{"prompt": [1, 99999999]}"#, "outside the vocabulary"),
        ("/completion", &json!({"prompt": "hello ".repeat(40)}).to_string(), "exceeds the available context size"),
        ("/v1/chat/completions", r#"{"messages": [{"role": "robot", "content": "x"}]}"#, "unknown role"),
        ("/v1/chat/completions", r#"{"messages": "nope"}"#, "invalid"),
        ("/detokenize", r#"{"tokens": [-1]}"#, "outside the vocabulary"),
        ("/tokenize", r#"{"content": 5}"#, "invalid type"),
    ];
    for (path, body, needle) in cases {
        let (status, text) = http(srv.addr, "POST", path, body);
        assert_eq!(status, 400, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).expect("error body is JSON");
        assert_eq!(v["error"]["code"], 400);
        // llama-server's own type (and numbers) for a prompt that does not fit.
        let want = if needle.contains("context size") { "exceed_context_size_error" } else { "invalid_request_error" };
        assert_eq!(v["error"]["type"], want, "{path} {body}: {text}");
        assert!(v["error"]["message"].as_str().expect("message").contains(needle), "{path} {body}: {text}");
        if want == "exceed_context_size_error" {
            assert!(v["error"]["n_prompt_tokens"].as_u64().expect("n_prompt_tokens") > 32 && v["error"]["n_ctx"] == 32, "{text}");
        }
    }
    // Issue 30: a field at fault is named as OpenAI's `param`, not only inside the message.
    for (path, body, param) in [
        ("/completion", r#"{"prompt": "hello", "top_p": 3}"#, Some("top_p")),
        ("/completion", r#"{"prompt": "hello", "n_predict": -2}"#, Some("n_predict")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": "high"}}"#, Some("logit_bias")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}"#, Some("response_format.type")),
        ("/v1/completions", r#"{"prompt": "x", "n": 0}"#, Some("n")),
        ("/completion", "{bad json", None),
    ] {
        let (status, text) = http(srv.addr, "POST", path, body);
        assert_eq!(status, 400, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).expect("error body is JSON");
        assert_eq!(v["error"]["param"].as_str(), param, "{path} {body}: {text}");
    }
    let (status, _) = http(srv.addr, "GET", "/nope", "");
    assert_eq!(status, 404);
    // Issue 32: llama-server's endpoints Tine does not serve answer 501 naming themselves.
    for path in ["/rerank", "/v1/embeddings", "/embedding"] {
        let (status, text) = http(srv.addr, "POST", path, "{}");
        assert_eq!(status, 501, "{path}: {text}");
        let v: Value = serde_json::from_str(&text).expect("error body is JSON");
        assert_eq!(v["error"]["type"], "not_supported_error", "{path}: {text}");
    }
    assert_eq!(http(srv.addr, "GET", "/health", "").0, 200);
    assert_eq!(post(srv.addr, "/completion", greedy("hello", 2)).0, 200);
}

fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_owned).collect()
}

/// Issue 32: llama-server's `timings_per_token`: every streamed chunk carries the timings so far
/// (`/completion` and chat); without it only the last one does.
#[test]
fn timings_per_token_puts_the_timings_on_every_streamed_chunk() {
    let srv = start(1, 128);
    for (path, body) in [
        ("/completion", json!({"prompt": "hello world", "n_predict": 4, "temperature": 0, "ignore_eos": true, "stream": true})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0, "ignore_eos": true, "stream": true})),
    ] {
        for per_token in [false, true] {
            let mut b = body.clone();
            b["timings_per_token"] = json!(per_token);
            let (_, text) = http(srv.addr, "POST", path, &b.to_string());
            let chunks: Vec<Value> = sse_data(&text).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("chunk")).collect();
            let tokens: Vec<&Value> = chunks.iter().filter(|c| c["content"].as_str().is_some_and(|t| !t.is_empty()) || c["choices"][0]["delta"]["content"].is_string()).collect();
            assert!(!tokens.is_empty(), "{path}: {text}");
            let with: Vec<u64> = tokens.iter().filter_map(|c| c["timings"]["predicted_n"].as_u64()).collect();
            if per_token {
                assert_eq!(with.len(), tokens.len(), "{path}: every token chunk has timings: {text}");
                assert!(with.windows(2).all(|w| w[0] <= w[1]), "{path}: {with:?}");
            } else {
                assert!(with.is_empty(), "{path}: no timings on token chunks unless asked: {text}");
            }
        }
    }
}

#[test]
fn streaming_gives_the_same_text_as_one_response() {
    let srv = start(1, 128);
    let (_, whole) = post(srv.addr, "/completion", greedy("hello world", 9));
    let mut req = greedy("hello world", 9);
    req["stream"] = json!(true);
    let (status, body) = http(srv.addr, "POST", "/completion", &req.to_string());
    assert_eq!(status, 200);
    let events: Vec<Value> = sse_data(&body).iter().map(|d| serde_json::from_str(d).expect("event JSON")).collect();
    let text: String = events.iter().map(|e| e["content"].as_str().unwrap_or("")).collect();
    assert_eq!(text, whole["content"].as_str().expect("content"));
    let last = events.last().expect("events");
    assert_eq!(last["stop"], true);
    assert!(last["timings"]["predicted_n"].is_number());

    let (_, body) = http(srv.addr, "POST", "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true, "temperature": 0}).to_string());
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let first: Value = serde_json::from_str(&data[0]).expect("chunk");
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    // Issue 32: no usage in a stream unless asked; with `stream_options.include_usage` the last
    // chunk has no choices and carries the usage (and the timings), as OpenAI and llama-server.
    let chunks = |data: &[String]| -> Vec<Value> { data.iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("chunk")).collect() };
    assert!(chunks(&data).iter().all(|c| c.get("usage").is_none()), "{data:?}");
    for n in [1, 2] {
        let req = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true, "temperature": 0, "ignore_eos": true, "n": n, "stream_options": {"include_usage": true}});
        let (_, body) = http(srv.addr, "POST", "/v1/chat/completions", &req.to_string());
        let data = sse_data(&body);
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
        let cs = chunks(&data);
        let last = cs.last().expect("chunks");
        assert_eq!(last["choices"], json!([]), "{last}");
        assert_eq!(last["usage"]["completion_tokens"].as_u64(), Some(4 * n), "{last}");
        assert!(last["timings"]["predicted_n"].is_number(), "{last}");
        assert_eq!(cs.iter().filter(|c| c.get("usage").is_some()).count(), 1, "{data:?}");
        assert_eq!(cs.iter().filter(|c| c["choices"][0]["finish_reason"].is_string()).count(), n as usize, "{data:?}");
    }
}

#[test]
fn stop_strings_cut_the_text_and_are_reported() {
    let srv = start(1, 128);
    let (_, free) = post(srv.addr, "/completion", greedy("hello world", 12));
    let content = free["content"].as_str().expect("content").to_owned();
    // Stop at a piece of the text the model produces anyway.
    let chars: Vec<char> = content.chars().collect();
    assert!(chars.len() >= 4, "the fixture produced too little text: {content:?}");
    let stop: String = chars[2..4].iter().collect();
    let mut req = greedy("hello world", 12);
    req["stop"] = json!([stop.clone()]);
    let (_, cut) = post(srv.addr, "/completion", req);
    assert_eq!(cut["stop_type"], "word", "{cut}");
    assert_eq!(cut["stopping_word"], stop);
    let expected = &content[..content.find(&stop).expect("stop occurs")];
    assert_eq!(cut["content"], expected);
}

#[test]
fn openai_shapes_and_tokenize_round_trip() {
    let srv = start(1, 128);
    let (s, v) = post(srv.addr, "/v1/completions", json!({"prompt": "hello", "max_tokens": 3, "temperature": 0}));
    assert_eq!(s, 200);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let (_, c) = post(
        srv.addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}], "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    let (_, t) = post(srv.addr, "/tokenize", json!({"content": "hello world", "add_special": true}));
    let ids = t["tokens"].clone();
    assert_eq!(ids[0], 2);
    let (_, d) = post(srv.addr, "/detokenize", json!({"tokens": ids}));
    assert_eq!(d["content"], "<bos>hello world");
}

#[test]
fn speculative_slots_answer_like_plain_ones_and_report_draft_timings() {
    let plain = start(1, 256);
    let body = json!({"prompt": "hello world hello world", "n_predict": 24, "temperature": 0, "ignore_eos": true});
    let (_, want) = post(plain.addr, "/completion", body.clone());
    for kind in tine_spec::SpecType::ALL {
        let server = start_with(2, 256, Some(kind));
        // Two concurrent requests, one per slot, each slot with its own drafter state.
        let (a, b) = std::thread::scope(|s| {
            let h = s.spawn(|| post(server.addr, "/completion", body.clone()));
            let b = post(server.addr, "/completion", body.clone());
            (h.join().expect("client thread"), b)
        });
        for (status, got) in [a, b] {
            assert_eq!(status, 200, "{got}");
            assert_eq!(got["content"], want["content"], "{kind}: greedy output differs from plain");
            let t = &got["timings"];
            let (n, acc, steps) = (t["draft_n"].as_u64().expect("draft_n"), t["draft_n_accepted"].as_u64().expect("draft_n_accepted"), t["draft_verify_steps"].as_u64().expect("draft_verify_steps"));
            assert!(steps > 0 && acc <= n, "{kind}: {t}");
        }
        // Per-request override: no drafting at all.
        let mut off = body.clone();
        off["speculative.n_max"] = json!(0);
        let (status, got) = post(server.addr, "/completion", off);
        assert_eq!(status, 200);
        assert_eq!(got["content"], want["content"]);
        assert_eq!(got["timings"]["draft_n"], json!(0));
        let (_, props) = http(server.addr, "GET", "/props", "");
        let props: Value = serde_json::from_str(&props).expect("json");
        assert_eq!(props["speculative"]["type"], json!(kind.as_str()));
    }
}

#[test]
fn a_request_chooses_its_drafter_and_every_choice_answers_like_plain_decoding() {
    let plain = start(1, 256);
    let body = json!({"prompt": "hello world hello world", "n_predict": 24, "temperature": 0, "ignore_eos": true});
    let (_, want) = post(plain.addr, "/completion", body.clone());
    let with = |t: &str| {
        let mut b = body.clone();
        b["speculative.type"] = json!(t);
        b
    };
    let check = |server: &Server, t: &str, (status, got): (u16, Value)| {
        assert_eq!(status, 200, "{t}: {got}");
        assert_eq!(got["content"], want["content"], "{t}: output differs from plain decoding");
        let steps = got["timings"]["draft_verify_steps"].as_u64().unwrap_or(0);
        assert_eq!(steps > 0, t != "none", "{t}: {}", got["timings"]);
        assert_eq!(got["generation_settings"]["speculative.types"], json!(t), "{t}");
        let _ = server;
    };
    // Started without --spec-type: n-grams, and NextN (this model carries a head), on request.
    let bare = start_model(TinyGemma3 { nextn: true, context: 8192, ..TinyGemma3::default() }, None, |c| *c = ServerConfig::new(2, 256));
    let (_, props) = http(bare.addr, "GET", "/props", "");
    let props: Value = serde_json::from_str(&props).expect("json");
    assert_eq!(props["speculative"]["type"], json!("none"));
    assert_eq!(props["speculative"]["types"], json!(["none", "ngram", "draft-mtp"]));
    let (_, got) = post(bare.addr, "/completion", body.clone());
    check(&bare, "none", (200, got));
    // One slot after another switches drafters; two slots at once run different ones.
    for t in ["ngram", "draft-mtp", "none", "draft-mtp", "ngram,draft-mtp"] {
        check(&bare, t, post(bare.addr, "/completion", with(t)));
    }
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| post(bare.addr, "/completion", with("ngram")));
        let b = post(bare.addr, "/completion", with("draft-mtp"));
        (h.join().expect("client thread"), b)
    });
    check(&bare, "ngram", a);
    check(&bare, "draft-mtp", b);
    // What needs weights loaded at start-up, and names that are no drafter, are 400s naming the
    // field and what the server offers; the server keeps serving.
    for bad in ["draft", "draft-assistant", "eagle", "draft-mtp,ngram"] {
        let (status, err) = post(bare.addr, "/completion", with(bad));
        assert_eq!(status, 400, "{bad}: {err}");
        let msg = err["error"]["message"].as_str().expect("message");
        assert!(msg.contains("speculative.type") && msg.contains("ngram, draft-mtp"), "{bad}: {msg}");
    }
    // Started with an assistant head (behind n-grams): its chain is the default, the head alone,
    // NextN, n-grams and none are choices; the draft model is not.
    let served = start_cfg(Some(tine_spec::SpecType::DraftAssistant), |c| *c = ServerConfig { spec: None, ..ServerConfig::new(2, 256) });
    let (_, props) = http(served.addr, "GET", "/props", "");
    let props: Value = serde_json::from_str(&props).expect("json");
    assert_eq!(props["speculative"]["type"], json!("draft-assistant"));
    assert_eq!(props["speculative"]["types"], json!(["none", "draft-assistant", "draft-mtp", "ngram"]));
    for t in ["draft-mtp", "none", "ngram", "draft-assistant", "ngram,draft-assistant"] {
        check(&served, t, post(served.addr, "/completion", with(t)));
    }
    let (status, _) = post(served.addr, "/completion", with("draft"));
    assert_eq!(status, 400);
}

#[test]
fn a_bad_speculative_override_is_a_400_with_a_json_error() {
    let server = start_with(1, 256, Some(tine_spec::SpecType::Ngram));
    for bad in [json!({"prompt": "hi", "speculative.p_min": 2.0}), json!({"prompt": "hi", "speculative.n_max": 99})] {
        let (status, body) = post(server.addr, "/completion", bad);
        assert_eq!(status, 400, "{body}");
        assert!(body["error"]["message"].as_str().expect("message").contains("speculative"), "{body}");
    }
    // The server keeps serving.
    let (status, _) = post(server.addr, "/completion", json!({"prompt": "hi", "n_predict": 2}));
    assert_eq!(status, 200);
}

#[test]
fn openai_logprobs_come_back_in_openai_shapes_streamed_and_not_and_match_n_probs() {
    let srv = start(1, 256);
    // The reference: llama-server's n_probs on /completion (softmax of the logits the sampler
    // saw, before temperature and top-k, as llama-server computes it by default).
    let (_, reference) = post(srv.addr, "/completion", json!({"prompt": "hello world", "n_predict": 5, "temperature": 0, "n_probs": 3}));
    let want: Vec<f64> = reference["completion_probabilities"].as_array().expect("probs").iter().map(|p| p["logprob"].as_f64().expect("logprob")).collect();
    assert_eq!(want.len(), 5);

    let (s, c) = post(srv.addr, "/v1/completions", json!({"prompt": "hello world", "max_tokens": 5, "temperature": 0, "logprobs": 2}));
    assert_eq!(s, 200, "{c}");
    let lp = &c["choices"][0]["logprobs"];
    let got: Vec<f64> = lp["token_logprobs"].as_array().expect("token_logprobs").iter().map(|x| x.as_f64().expect("f64")).collect();
    assert_eq!(got, want, "{lp}");
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(5));
    assert!(lp["top_logprobs"].as_array().expect("tops").iter().all(|t| t.as_object().is_some_and(|o| !o.is_empty() && o.len() <= 2)), "{lp}");
    let offsets: Vec<u64> = lp["text_offset"].as_array().expect("offsets").iter().map(|x| x.as_u64().expect("u64")).collect();
    assert!(offsets[0] == 0 && offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    assert!(c["choices"][0]["text"].as_str().expect("text").chars().count() as u64 >= *offsets.last().expect("last"));

    let (s, ch) =
        post(srv.addr, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0, "logprobs": true, "top_logprobs": 3, "ignore_eos": true}));
    assert_eq!(s, 200, "{ch}");
    let content = ch["choices"][0]["logprobs"]["content"].as_array().expect("content");
    assert_eq!(content.len(), 4, "{ch}");
    for e in content {
        assert!(e["token"].is_string() && e["logprob"].as_f64().expect("logprob") <= 0.0 && e["bytes"].is_array(), "{e}");
        assert_eq!(e["top_logprobs"].as_array().map(Vec::len), Some(3), "{e}");
    }
    // Issue 32: llama-server's `b<build number>-<commit>` form, and `/props`' build_info the same.
    let fp = ch["system_fingerprint"].as_str().expect("a fingerprint");
    let (number, commit) = fp.strip_prefix('b').and_then(|r| r.split_once('-')).expect("b<number>-<commit>");
    assert!(number.parse::<u64>().is_ok() && !commit.is_empty(), "{fp}");
    let props: Value = serde_json::from_str(&http(srv.addr, "GET", "/props", "").1).expect("props");
    assert_eq!(props["build_info"].as_str(), Some(fp));
    assert!(ch["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());

    // Streamed chat: the same log-probabilities, one token per chunk, and no empty deltas.
    let (s, text) = http(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0, "logprobs": true, "top_logprobs": 3, "ignore_eos": true, "stream": true}).to_string(),
    );
    assert_eq!(s, 200);
    let events: Vec<Value> = sse_data(&text).iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).expect("json")).collect();
    assert_eq!(events[0]["choices"][0]["delta"], json!({"role": "assistant", "content": null}), "first chunk: {}", events[0]);
    let streamed: Vec<&Value> = events.iter().filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array()).flatten().collect();
    assert_eq!(streamed.len(), 4);
    for (a, b) in streamed.iter().zip(content) {
        assert_eq!(a["logprob"], b["logprob"]);
    }
    for e in &events {
        assert_ne!(e["choices"][0]["delta"]["content"], json!(""), "an empty content delta: {e}");
    }
}

#[test]
fn generation_that_fills_the_context_is_reported_truncated() {
    let srv = start(1, 16);
    let (_, full) = post(srv.addr, "/completion", json!({"prompt": "hello world", "n_predict": -1, "temperature": 0, "ignore_eos": true}));
    assert_eq!((full["stop_type"].as_str(), full["truncated"].as_bool()), (Some("limit"), Some(true)), "{full}");
    let (_, limited) = post(srv.addr, "/completion", json!({"prompt": "hello world", "n_predict": 2, "temperature": 0, "ignore_eos": true}));
    assert_eq!((limited["stop_type"].as_str(), limited["truncated"].as_bool()), (Some("limit"), Some(false)), "{limited}");
}

/// Issue 32: a request's `id_slot` runs it in that slot (llama-server); a slot the server does
/// not have, or a negative index other than -1, is a 400 naming the field.
#[test]
fn id_slot_runs_the_request_in_that_slot() {
    let srv = start(2, 64);
    for want in [1u64, 0, 1] {
        let mut req = greedy("hello world", 2);
        req["id_slot"] = json!(want);
        let (s, v) = post(srv.addr, "/completion", req);
        assert_eq!((s, v["id_slot"].as_u64()), (200, Some(want)), "{v}");
    }
    let mut any = greedy("hello world", 2);
    any["id_slot"] = json!(-1);
    assert_eq!(post(srv.addr, "/completion", any).0, 200);
    for bad in [json!(2), json!(-2)] {
        let mut req = greedy("hello world", 2);
        req["id_slot"] = bad.clone();
        let (s, v) = post(srv.addr, "/completion", req);
        assert_eq!((s, v["error"]["param"].as_str()), (400, Some("id_slot")), "{bad}: {v}");
    }
}

/// Issue 32: a trailing assistant message is continued, not answered (llama-server's assistant
/// prefill), as is the last message with `continue_final_message`; `add_generation_prompt:
/// false` leaves the assistant turn closed; contradictions are a 400 naming the field.
#[test]
fn assistant_prefill_and_continue_final_message_continue_the_last_message() {
    let srv = start(1, 256);
    let prompt_of = |body: Value| -> String {
        let (s, v) = post(srv.addr, "/apply-template", body);
        assert_eq!(s, 200, "{v}");
        v["prompt"].as_str().expect("prompt").to_owned()
    };
    let user = json!({"role": "user", "content": "Name a colour."});
    let answered = prompt_of(json!({"messages": [user]}));
    let prefilled = prompt_of(json!({"messages": [user, {"role": "assistant", "content": "The colour is"}]}));
    assert_eq!(prefilled, format!("{answered}The colour is"), "the open assistant turn, then the prefill");
    let continued = prompt_of(json!({"messages": [user, {"role": "assistant", "content": "The colour is"}], "continue_final_message": true, "add_generation_prompt": false}));
    assert_eq!(continued, prefilled);
    let closed = prompt_of(json!({"messages": [user], "add_generation_prompt": false}));
    assert!(answered.starts_with(&closed) && answered.len() > closed.len(), "{closed:?} vs {answered:?}");
    let (s, v) = post(srv.addr, "/v1/chat/completions", json!({"messages": [user, {"role": "assistant", "content": "The colour is"}], "max_tokens": 3, "temperature": 0}));
    assert_eq!(s, 200, "{v}");
    for (body, param) in [
        (json!({"messages": [user, {"role": "assistant", "content": "x"}], "continue_final_message": true}), "continue_final_message"),
        (json!({"messages": [user, {"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]}), "messages"),
    ] {
        let (s, v) = post(srv.addr, "/v1/chat/completions", body);
        assert_eq!((s, v["error"]["param"].as_str()), (400, Some(param)), "{v}");
    }
}

/// Issue 32: text parts are joined by a newline, as llama-server joins them ("What is" +
/// "the best book" is not "What isthe best book").
#[test]
fn text_content_parts_are_joined_by_a_newline() {
    let srv = start(1, 64);
    let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]}]});
    let (s, v) = post(srv.addr, "/apply-template", parts);
    assert_eq!(s, 200, "{v}");
    let prompt = v["prompt"].as_str().expect("prompt");
    assert!(prompt.contains("What is\nthe best book") && !prompt.contains("What isthe"), "{prompt:?}");
}

#[test]
fn non_text_content_parts_are_refused_not_dropped() {
    let srv = start(1, 64);
    let (s, v) = post(
        srv.addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
    );
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"].as_str().expect("message").contains("image_url"), "{v}");
}

#[test]
fn metrics_are_prometheus_text_behind_the_flag_and_count_requests() {
    let off = start(1, 64);
    let (s, _) = http(off.addr, "GET", "/metrics", "");
    assert_eq!(s, 501, "off unless --metrics, as llama-server");
    let srv = start_cfg(None, |c| c.metrics = true);
    // Issue 32: llama-server's `Process-Start-Time-Unix` header: when the server started.
    let mut raw = TcpStream::connect(srv.addr).expect("connect");
    raw.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("send");
    let mut head = String::new();
    raw.read_to_string(&mut head).expect("read");
    let started: u64 = head.to_ascii_lowercase().lines().find_map(|l| l.strip_prefix("process-start-time-unix: ").map(|v| v.trim().parse().expect("seconds"))).expect("the header");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs();
    assert!(started <= now && now - started < 600, "started {started}, now {now}");
    post(srv.addr, "/completion", greedy("hello world", 4));
    post(srv.addr, "/completion", greedy("hello world", 4));
    // The slot is released just after its response is written: wait (at most 2 s) for it.
    let (mut s, mut text) = http(srv.addr, "GET", "/metrics", "");
    for _ in 0..100 {
        if text.lines().any(|l| l == "llamacpp:requests_processing 0") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        (s, text) = http(srv.addr, "GET", "/metrics", "");
    }
    assert_eq!(s, 200);
    let value =
        |name: &str| -> f64 { text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' '))).unwrap_or_else(|| panic!("{name} missing:\n{text}")).parse().expect("a number") };
    assert_eq!(value("llamacpp:tokens_predicted_total"), 8.0);
    assert_eq!(value("tine:requests_finished_total"), 2.0);
    assert!(value("llamacpp:prompt_tokens_total") >= 1.0 && value("tine:prompt_tokens_cached_total") >= 1.0);
    assert_eq!(value("llamacpp:requests_processing"), 0.0);
    // Issue 52: llama-server's names beside Tine's. Each request: a prompt chunk and 3 decodes
    // (the 4th token ends it), one slot a forward.
    assert_eq!(value("llamacpp:n_decode_total"), 8.0);
    assert_eq!(value("llamacpp:n_busy_slots_per_decode"), 1.0);
    assert_eq!(value("llamacpp:prompt_tokens_cached_total"), value("tine:prompt_tokens_cached_total"));
    assert!(value("llamacpp:n_tokens_max") >= 5.0);
    assert_eq!(value("llamacpp:spec_decode_num_draft_tokens_total"), 0.0);
    assert_prometheus(&text);
}

/// Every sample line of `text` is `name{labels} value` as Prometheus reads it.
fn assert_prometheus(text: &str) {
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let (name, v) = l.rsplit_once(' ').expect("name value");
        let name = match name.split_once('{') {
            Some((n, labels)) => {
                assert!(labels.ends_with('}') && labels.contains("=\""), "bad labels: {l}");
                n
            }
            None => name,
        };
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') && v.parse::<f64>().is_ok(), "not Prometheus text: {l}");
    }
}

#[test]
fn localhost_origins_get_cors_headers_and_preflights_an_answer() {
    let srv = start_cfg(None, |c| c.api_keys = tine_server::ApiKeys::new(["k".to_owned()]));
    let send = |req: String| {
        let mut s = TcpStream::connect(srv.addr).expect("connect");
        s.write_all(req.as_bytes()).expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out.to_ascii_lowercase()
    };
    let pre = send("OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: http://localhost:5173\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\nConnection: close\r\n\r\n".into());
    // Issue 32: llama-server answers a preflight 200 and allows DELETE.
    assert!(pre.starts_with("http/1.1 200"), "{pre}");
    assert!(pre.contains("access-control-allow-methods: get, post, delete, options"), "{pre}");
    assert!(pre.contains("access-control-allow-origin: http://localhost:5173") && pre.contains("access-control-allow-headers: authorization, content-type"), "{pre}");
    // A request without its key is still refused, and the browser can read why.
    let denied = send("GET /props HTTP/1.1\r\nHost: x\r\nOrigin: http://127.0.0.1:3000\r\nConnection: close\r\n\r\n".into());
    assert!(denied.starts_with("http/1.1 401") && denied.contains("access-control-allow-origin: http://127.0.0.1:3000"), "{denied}");
    let foreign = send("GET /props HTTP/1.1\r\nHost: x\r\nOrigin: http://evil.example\r\nAuthorization: Bearer k\r\nConnection: close\r\n\r\n".into());
    assert!(foreign.starts_with("http/1.1 200") && !foreign.contains("access-control-allow-origin"), "{foreign}");
}

/// Issue 32: `--cors-origins` as llama-server takes it: a list of origins, or `*`.
#[test]
fn cors_origins_allow_the_listed_origins_or_any() {
    let send = |addr: std::net::SocketAddr, origin: &str| {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(format!("GET /health HTTP/1.1\r\nHost: x\r\nOrigin: {origin}\r\nConnection: close\r\n\r\n").as_bytes()).expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out.to_ascii_lowercase()
    };
    let listed = start_cfg(None, |c| c.cors.origins = tine_server::cors::CorsOrigins::parse("https://app.example, https://other.example"));
    assert!(send(listed.addr, "https://app.example").contains("access-control-allow-origin: https://app.example"));
    let no = send(listed.addr, "http://localhost:3000");
    assert!(no.starts_with("http/1.1 200") && !no.contains("access-control-allow-origin"), "{no}");
    let any = start_cfg(None, |c| c.cors.origins = tine_server::cors::CorsOrigins::Any);
    assert!(send(any.addr, "https://anywhere.example").contains("access-control-allow-origin: https://anywhere.example"));
}

#[test]
fn server_defaults_alias_and_no_slots_follow_the_flags() {
    let mut defaults = tine_api::Defaults { n_predict: 3, ..tine_api::Defaults::default() };
    defaults.sampling.temperature = 0.0;
    defaults.sampling.seed = Some(42);
    let srv = start_cfg(None, move |c| {
        c.defaults = defaults;
        c.alias = Some("my-model".into());
        c.slots_endpoint = false;
    });
    let (_, a) = post(srv.addr, "/completion", json!({"prompt": "hello world"}));
    assert_eq!(a["tokens_predicted"], 3, "--n-predict is the default: {a}");
    assert_eq!(a["generation_settings"]["seed"], 42);
    // Issue 32: generation_settings echoes what the request ran with, as llama-server's does.
    let g = &a["generation_settings"];
    assert_eq!((g["n_predict"].as_i64(), g["temperature"].as_f64(), g["stream"].as_bool(), g["n_probs"].as_u64()), (Some(3), Some(0.0), Some(false), Some(0)), "{g}");
    assert!(g["top_k"].is_i64() && g["top_p"].is_f64() && g["min_p"].is_f64() && g["repeat_penalty"].is_f64() && g["stop"].is_array() && g["n_ctx"].is_u64(), "{g}");
    let (_, b) = post(srv.addr, "/completion", json!({"prompt": "hello world", "n_predict": 5}));
    assert_eq!(b["tokens_predicted"], 5, "a request's own value wins");
    let (_, m) = http(srv.addr, "GET", "/v1/models", "");
    assert_eq!(serde_json::from_str::<Value>(&m).expect("json")["data"][0]["id"], "my-model");
    let (_, p) = http(srv.addr, "GET", "/props", "");
    let p: Value = serde_json::from_str(&p).expect("json");
    assert_eq!((p["default_generation_settings"]["params"]["n_predict"].as_i64(), p["default_generation_settings"]["seed"].as_u64()), (Some(3), Some(42)));
    assert_eq!(http(srv.addr, "GET", "/slots", "").0, 501);
    // Issue 32: the slot actions follow --slot-save-path, not --no-slots (llama-server): an
    // erase answers, and a save without the path is 501 naming that flag.
    let (s, v) = post(srv.addr, "/slots/0?action=erase", json!({}));
    assert_eq!(s, 200, "{v}");
    let (s, v) = post(srv.addr, "/slots/0?action=save", json!({"filename": "a.bin"}));
    assert_eq!(s, 501, "{v}");
    assert!(v["error"]["message"].as_str().expect("message").contains("--slot-save-path"), "{v}");
}

/// A ChatML template with Hermes tool calls, as Qwen-style GGUFs carry.
const TOOL_TEMPLATE: &str = "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

#[test]
fn the_gguf_chat_template_renders_the_prompt_and_tools_reach_it() {
    let srv = start_model(TinyGemma3 { chat_template: Some(TOOL_TEMPLATE.into()), context: 8192, ..TinyGemma3::default() }, None, |c| c.ctx_size = 2048);
    let msgs = json!([{"role": "user", "content": "hello"}]);
    let (s, v) = post(srv.addr, "/apply-template", json!({"messages": msgs}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["prompt"], "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n");
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let (_, v) = post(srv.addr, "/apply-template", json!({"messages": msgs, "tools": tools}));
    assert!(v["prompt"].as_str().expect("prompt").starts_with("<|im_start|>system\nTools: [{\"type\": \"function\""), "{v}");
    let (_, v) = post(srv.addr, "/apply-template", json!({"messages": msgs, "tools": tools, "tool_choice": "none"}));
    assert!(v["prompt"].as_str().expect("prompt").starts_with("<|im_start|>user"), "{v}");
    // A forced call is constrained to a JSON object naming one of the allowed tools.
    let two = json!([
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}}
    ]);
    for (choice, names) in [(json!("required"), vec!["f", "g"]), (json!({"type": "function", "function": {"name": "g"}}), vec!["g"])] {
        for seed in 0..3 {
            let (s, v) = post(srv.addr, "/v1/chat/completions", json!({"messages": msgs, "tools": two, "tool_choice": choice, "max_tokens": 200, "temperature": 1.0, "seed": seed}));
            assert_eq!(s, 200, "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
            let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
            let name = call["name"].as_str().expect("name");
            assert!(names.contains(&name), "{choice}: {v}");
            let args: Value = serde_json::from_str(call["arguments"].as_str().expect("arguments are a JSON string")).expect("arguments parse");
            if name == "f" {
                assert!(args["x"] == 1 || args["x"] == 2, "{v}");
            } else {
                assert_eq!(args, json!({}), "{v}");
            }
        }
    }
    for (choice, needle) in [(json!({"type": "function", "function": {"name": "nope"}}), "no tool is named"), (json!("always"), "tool_choice must be")] {
        let (s, v) = post(srv.addr, "/v1/chat/completions", json!({"messages": msgs, "tools": two, "tool_choice": choice}));
        assert_eq!(s, 400, "{v}");
        assert!(v["error"]["message"].as_str().expect("message").contains(needle), "{v}");
    }
    // A chat request runs the rendered prompt (with <bos> in front: the template has none).
    let (s, chat) = post(srv.addr, "/v1/chat/completions", json!({"messages": msgs, "max_tokens": 4, "temperature": 0, "tools": tools}));
    assert_eq!(s, 200, "{chat}");
    let (_, ids) = post(srv.addr, "/tokenize", json!({"content": "<bos><|im_start|>system", "parse_special": true}));
    assert!(ids["tokens"].as_array().is_some_and(|t| !t.is_empty()));
    assert_eq!(
        chat["usage"]["prompt_tokens"].as_u64(),
        post(srv.addr, "/tokenize", json!({"content": format!("<bos>{}", v_prompt(&srv, &msgs, &tools)), "parse_special": true})).1["tokens"].as_array().map(|t| t.len() as u64)
    );
}

/// A chat stream's pieces: the content joined, the calls (name, arguments) joined by index,
/// the finish reason, and how many chunks carried content.
fn chat_stream(addr: SocketAddr, body: Value) -> (String, Vec<(String, String)>, String, usize) {
    let (s, text) = http(addr, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(s, 200, "{text}");
    let (mut content, mut calls, mut finish, mut pieces) = (String::new(), Vec::<(String, String)>::new(), String::new(), 0);
    for d in sse_data(&text).into_iter().filter(|d| d != "[DONE]") {
        let v: Value = serde_json::from_str(&d).expect("a JSON chunk");
        let c = &v["choices"][0];
        if let Some(t) = c["delta"]["content"].as_str() {
            content.push_str(t);
            pieces += 1;
        }
        for call in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = call["index"].as_u64().expect("index") as usize;
            if calls.len() <= i {
                calls.resize(i + 1, Default::default());
            }
            calls[i].0.push_str(call["function"]["name"].as_str().unwrap_or(""));
            calls[i].1.push_str(call["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_owned();
        }
    }
    (content, calls, finish, pieces)
}

/// The same pieces from a whole answer.
fn chat_whole(addr: SocketAddr, mut body: Value) -> (String, Vec<(String, String)>, String) {
    body["stream"] = json!(false);
    let (s, v) = post(addr, "/v1/chat/completions", body);
    assert_eq!(s, 200, "{v}");
    let m = &v["choices"][0]["message"];
    let calls = m["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| (c["function"]["name"].as_str().expect("name").to_owned(), c["function"]["arguments"].as_str().expect("arguments").to_owned()))
        .collect();
    (m["content"].as_str().unwrap_or("").to_owned(), calls, v["choices"][0]["finish_reason"].as_str().expect("finish").to_owned())
}

/// Issue 32: tools on a template that never mentions them (Gemma's turns here) are accepted,
/// as llama-server accepts them: the tools are described in the generic JSON format, the
/// output is held to it, and calls come back as `tool_calls` whatever `tool_choice` asks;
/// earlier calls and tool results render. With tools the answer streams as it is generated
/// (on this template and on one with a tool syntax), and the stream reads as the whole answer.
#[test]
fn tools_on_a_template_without_tool_syntax_are_described_and_read_back_and_stream() {
    let srv = start(1, 2048);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": false}}}]);
    let msgs = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let (s, v) = post(srv.addr, "/apply-template", json!({"messages": msgs, "tools": tools}));
    assert_eq!(s, 200, "{v}");
    let prompt = v["prompt"].as_str().expect("prompt");
    assert!(prompt.starts_with("<bos><start_of_turn>user\nYou have access to the following tools:\n{"), "{prompt}");
    assert!(prompt.ends_with("Weather in Paris?<end_of_turn>\n<start_of_turn>model\n"), "{prompt}");
    // A forced call comes back as a call to that tool, with arguments of its schema.
    for seed in 0..3 {
        let (content, calls, finish) = chat_whole(srv.addr, json!({"messages": msgs, "tools": tools, "tool_choice": "required", "max_tokens": 120, "temperature": 1.0, "seed": seed}));
        assert_eq!((content.as_str(), finish.as_str(), calls.len()), ("", "tool_calls", 1), "{calls:?}");
        assert_eq!(calls[0].0, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].1).expect("arguments parse");
        assert!(args["city"] == "Paris" || args["city"] == "Oslo", "{args}");
    }
    // `auto`: a call or a plain answer, never the format's raw JSON; streamed, the same.
    let mut answered = 0;
    for seed in 0..6 {
        let body = json!({"messages": msgs, "tools": tools, "max_tokens": 120, "temperature": 1.0, "seed": seed, "stream": true});
        let (content, calls, finish) = chat_whole(srv.addr, body.clone());
        if calls.is_empty() {
            answered += 1;
            assert!(!content.trim_start().starts_with("{\"response\""), "{content}");
        } else {
            assert_eq!(finish, "tool_calls");
        }
        let (s_content, s_calls, s_finish, _) = chat_stream(srv.addr, body);
        assert_eq!((s_content, s_calls, s_finish), (content, calls, finish), "seed {seed}: the stream reads as the whole answer");
    }
    println!("auto: {answered}/6 plain answers");
    // An agent's second request: the call and its result render on Gemma's turns.
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}
    ]);
    let (s, v) = post(srv.addr, "/apply-template", json!({"messages": history, "tools": tools}));
    assert_eq!(s, 200, "{v}");
    let prompt = v["prompt"].as_str().expect("prompt");
    assert!(prompt.contains("<start_of_turn>model\n{\"tool_call\":{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}}<end_of_turn>\n<start_of_turn>user\n{\"tool_response\":{\"tool\":\"get_weather\",\"tool_call_id\":\"c1\",\"content\":\"18 C\"}}<end_of_turn>\n<start_of_turn>model\n"), "{prompt}");
    let (s, v) = post(srv.addr, "/v1/chat/completions", json!({"messages": history, "tools": tools, "max_tokens": 8}));
    assert_eq!(s, 200, "{v}");
    // Tools and another constraint cannot both hold the output: 400 naming `tools`.
    let (s, v) = post(srv.addr, "/v1/chat/completions", json!({"messages": msgs, "tools": tools, "response_format": {"type": "json_object"}}));
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("tools")), "{v}");
    // A template with a tool syntax: a plain answer streams in many pieces, as without tools
    // (held to words by a grammar: this tiny model writes byte tokens, which wait for whole
    // characters).
    let hermes = start_model(TinyGemma3 { chat_template: Some(TOOL_TEMPLATE.into()), context: 8192, ..TinyGemma3::default() }, None, |c| c.ctx_size = 2048);
    let body = json!({"messages": msgs, "tools": tools, "max_tokens": 24, "temperature": 0, "grammar": "root ::= [a-z ]+", "stream": true});
    let (content, calls, finish, pieces) = chat_stream(hermes.addr, body.clone());
    assert_eq!((calls.is_empty(), finish.as_str()), (true, "length"), "{content}");
    assert!(pieces > 4, "the answer streamed in {pieces} piece(s): {content:?}");
    assert_eq!((content, calls, finish), chat_whole(hermes.addr, body));
}

fn v_prompt(srv: &Server, msgs: &Value, tools: &Value) -> String {
    post(srv.addr, "/apply-template", json!({"messages": msgs, "tools": tools})).1["prompt"].as_str().expect("prompt").to_owned()
}

#[test]
fn logit_bias_moves_and_bans_tokens_in_both_shapes_and_speculation_keeps_it() {
    let srv = start(1, 256);
    let base = json!({"prompt": "hello world", "n_predict": 6, "temperature": 0, "ignore_eos": true, "return_tokens": true});
    let (_, plain) = post(srv.addr, "/completion", base.clone());
    let first = plain["tokens"][0].as_u64().expect("a token");
    let with = |bias: Value| {
        let mut b = base.clone();
        b["logit_bias"] = bias;
        b
    };
    let (_, banned) = post(srv.addr, "/completion", with(json!([[first, false]])));
    assert!(banned["tokens"].as_array().expect("tokens").iter().all(|t| t.as_u64() != Some(first)), "{banned}");
    for bias in [json!([[7, 100]]), json!({"7": 100})] {
        let (s, forced) = post(srv.addr, "/completion", with(bias.clone()));
        assert_eq!(s, 200, "{forced}");
        assert!(forced["tokens"].as_array().expect("tokens").iter().all(|t| t.as_u64() == Some(7)), "{bias}: {forced}");
    }
    // Issue 32: an OpenAI map with a text key biases that text's tokens, as llama-server does
    // (the same as the pair form).
    let (s, by_map) = post(srv.addr, "/completion", with(json!({"hello": -5})));
    let (_, by_pair) = post(srv.addr, "/completion", with(json!([["hello", -5]])));
    assert_eq!((s, &by_map["tokens"]), (200, &by_pair["tokens"]), "{by_map}");
    for (bad, needle) in [(json!({"x": "high"}), "a bias is a number or false"), (json!({"7": 1000}), "must lie in"), (json!([[999999, 1]]), "outside the vocabulary"), (json!("nope"), "logit_bias")] {
        let (s, v) = post(srv.addr, "/completion", with(bad));
        assert_eq!(s, 400, "{v}");
        assert!(v["error"]["message"].as_str().expect("message").contains(needle), "{v}");
    }
    // A drafted token is judged on the biased logits, so speculation gives plain's biased output.
    let spec = start_with(1, 256, Some(tine_spec::SpecType::Ngram));
    let (_, a) = post(spec.addr, "/completion", with(json!([[first, false]])));
    assert_eq!(a["tokens"], banned["tokens"]);
}

#[test]
fn constrained_output_follows_each_field_and_spec_types_give_the_plain_text() {
    let schema = json!({"type": "object", "properties": {"c": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c", "n"], "additionalProperties": false});
    let check = |text: &str| {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
        assert!(["x", "y"].contains(&v["c"].as_str().expect("c")) && v["n"].as_u64().expect("n") <= 9 && v.as_object().expect("object").len() == 2, "{text:?}");
    };
    let plain = start(1, 256);
    let spec = start_with(1, 256, Some(tine_spec::SpecType::Ngram));
    let mtp = start_with(1, 256, Some(tine_spec::SpecType::DraftMtp));
    let bodies = [
        ("/completion", json!({"prompt": "hello", "n_predict": 120, "temperature": 0, "json_schema": schema})),
        (
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 120, "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": true}}}),
        ),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 120, "temperature": 0, "response_format": {"type": "json_object", "schema": schema}})),
    ];
    let text = |path: &str, v: &Value| -> String {
        match path {
            "/completion" => v["content"].as_str(),
            "/v1/completions" => v["choices"][0]["text"].as_str(),
            _ => v["choices"][0]["message"]["content"].as_str(),
        }
        .unwrap_or_else(|| panic!("{v}"))
        .to_owned()
    };
    for (path, body) in &bodies {
        let (s, want) = post(plain.addr, path, body.clone());
        assert_eq!(s, 200, "{path}: {want}");
        check(&text(path, &want));
        for srv in [&spec, &mtp] {
            let (s, got) = post(srv.addr, path, body.clone());
            assert_eq!(s, 200, "{got}");
            assert_eq!(text(path, &got), text(path, &want), "{path}");
        }
        // Sampled: still valid.
        for seed in 0..3 {
            let mut b = body.clone();
            b["temperature"] = json!(1.0);
            b["seed"] = json!(seed);
            let (_, v) = post(spec.addr, path, b);
            check(&text(path, &v));
        }
    }
    // json_object with no schema: any object.
    let (_, v) = post(plain.addr, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "temperature": 0, "response_format": {"type": "json_object"}}));
    let out = text("/v1/chat/completions", &v);
    assert!(out.trim_start().starts_with('{'), "{out:?}");
    // GBNF, and llguidance's Lark.
    let (_, v) = post(plain.addr, "/completion", json!({"prompt": "hello", "n_predict": 30, "temperature": 0, "grammar": "root ::= (\"yes\" | \"no\") \"!\""}));
    assert!(["yes!", "no!"].contains(&v["content"].as_str().expect("content")), "{v}");
    assert_eq!(v["stop_type"], "eos", "{v}");
    let (_, v) = post(plain.addr, "/completion", json!({"prompt": "hello", "n_predict": 30, "temperature": 0, "grammar": "%llguidance {}\nstart: \"a\" /[0-9]/"}));
    let c = v["content"].as_str().expect("content");
    assert!(c.len() == 2 && c.starts_with('a') && c.as_bytes()[1].is_ascii_digit(), "{v}");
    // Refusals name the field.
    for (body, needle) in [
        (json!({"prompt": "a", "grammar": "root ::= \"a"}), "grammar: invalid GBNF grammar at line 1"),
        (json!({"prompt": "a", "json_schema": {"type": "nope"}}), "json_schema: invalid grammar"),
        (json!({"prompt": "a", "response_format": {"type": "yaml"}}), "response_format.type"),
        (json!({"prompt": "a", "response_format": {"type": "json_schema"}}), "json_schema.schema"),
        (json!({"prompt": "a", "grammar": "root ::= \"a\"", "json_schema": {}}), "only one of"),
    ] {
        let (s, v) = post(plain.addr, "/v1/completions", body.clone());
        assert_eq!(s, 400, "{body}: {v}");
        assert!(v["error"]["message"].as_str().expect("message").contains(needle), "{body}: {v}");
    }
    // `response_format: text` is no constraint.
    let (s, _) = post(plain.addr, "/v1/completions", json!({"prompt": "a", "max_tokens": 2, "response_format": {"type": "text"}}));
    assert_eq!(s, 200);
}

#[test]
fn batch_prompts_and_n_choices_come_back_one_result_each_in_order() {
    let srv = start(4, 512);
    let alone = |p: &str| post(srv.addr, "/completion", greedy(p, 5)).1["content"].as_str().expect("content").to_owned();
    let (a, b) = (alone("hello"), alone("world"));
    // llama-server: several prompts give an array, each result with its index.
    let (s, v) = post(srv.addr, "/completion", json!({"prompt": ["hello", "world"], "n_predict": 5, "temperature": 0}));
    assert_eq!(s, 200, "{v}");
    let arr = v.as_array().expect("an array for several prompts");
    assert_eq!((arr[0]["content"].as_str(), arr[1]["content"].as_str()), (Some(a.as_str()), Some(b.as_str())), "{v}");
    assert_eq!((arr[0]["index"].as_u64(), arr[1]["index"].as_u64()), (Some(0), Some(1)));
    let ids = post(srv.addr, "/tokenize", json!({"content": "world"})).1["tokens"].clone();
    let (_, v) = post(srv.addr, "/completion", json!({"prompt": [[2], ids], "n_predict": 5, "temperature": 0}));
    assert_eq!(v[1]["content"].as_str(), alone_ids(&srv, &ids).as_deref(), "{v}");
    // OpenAI: choices in prompt order, usage summed.
    let (_, v) = post(srv.addr, "/v1/completions", json!({"prompt": ["hello", "world"], "max_tokens": 5, "temperature": 0}));
    assert_eq!(v["choices"][0]["text"].as_str(), Some(a.as_str()), "{v}");
    assert_eq!(v["choices"][1]["text"].as_str(), Some(b.as_str()), "{v}");
    assert_eq!(v["choices"][1]["index"], 1);
    assert_eq!(v["usage"]["completion_tokens"], 10, "{v}");
    // n choices: seed + i each, so choice i is what a request with that seed alone gives.
    let sampled = |seed: u64, n: u64| json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": seed, "n": n});
    let (s, v) = post(srv.addr, "/v1/chat/completions", sampled(7, 3));
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let (_, one) = post(srv.addr, "/v1/chat/completions", sampled(7 + i as u64, 1));
        assert_eq!(c["message"]["content"], one["choices"][0]["message"]["content"], "choice {i}");
    }
    assert_ne!(choices[0]["message"]["content"], choices[1]["message"]["content"], "distinct seeds give distinct samples here: {v}");
    // Streamed: every choice's chunks carry its index, and the text per index is the same.
    let (_, body) = http(srv.addr, "POST", "/v1/completions", &json!({"prompt": ["hello", "world"], "max_tokens": 5, "temperature": 0, "stream": true}).to_string());
    let mut texts = [String::new(), String::new()];
    for d in sse_data(&body) {
        if d == "[DONE]" {
            continue;
        }
        let c: Value = serde_json::from_str(&d).expect("chunk");
        let i = c["choices"][0]["index"].as_u64().expect("index") as usize;
        texts[i].push_str(c["choices"][0]["text"].as_str().unwrap_or(""));
    }
    assert_eq!(texts, [a.clone(), b.clone()]);
    let (s, v) = post(srv.addr, "/v1/completions", json!({"prompt": ["a", "b", "c", "d", "e"], "n": 4}));
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"].as_str().expect("message").contains("at most 16 results"), "{v}");
}

fn alone_ids(srv: &Server, ids: &Value) -> Option<String> {
    post(srv.addr, "/completion", json!({"prompt": ids, "n_predict": 5, "temperature": 0})).1["content"].as_str().map(str::to_owned)
}

#[test]
fn context_shift_goes_past_the_context_and_off_stops_there_truncated() {
    let body = json!({"prompt": "hello world", "n_predict": 100, "temperature": 0, "ignore_eos": true, "n_keep": -1});
    let off = start(1, 48);
    let (_, v) = post(off.addr, "/completion", body.clone());
    assert!(v["tokens_predicted"].as_u64().expect("n") < 48 && v["truncated"] == true && v["stop_type"] == "limit", "{v}");
    for spec in [None, Some(tine_spec::SpecType::Ngram)] {
        let on = start_cfg(spec, |c| {
            *c = ServerConfig { context_shift: true, ..ServerConfig::new(1, 48) };
        });
        let (_, w) = post(on.addr, "/completion", body.clone());
        assert_eq!(w["tokens_predicted"], 100, "{w}");
        assert_eq!(w["truncated"], true, "a shift dropped context: {w}");
        assert!(w["content"].as_str().expect("content").starts_with(v["content"].as_str().expect("content")), "the same text up to the first shift");
    }
    let (s, e) = post(off.addr, "/completion", json!({"prompt": "a", "n_keep": -2}));
    assert_eq!(s, 400, "{e}");
}

#[test]
fn a_slot_saved_erased_and_restored_continues_as_before_and_bad_actions_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let saves = dir.path().join("slots");
    std::fs::create_dir_all(&saves).expect("mkdir");
    let path = saves.clone();
    for spec in [None, Some(tine_spec::SpecType::DraftMtp)] {
        let path = path.clone();
        let srv = start_cfg(spec, move |c| *c = ServerConfig { slot_save_path: Some(path), ..ServerConfig::new(1, 256) });
        let body = json!({"prompt": "hello world hello world", "n_predict": 6, "temperature": 0, "ignore_eos": true});
        let (_, first) = post(srv.addr, "/completion", body.clone());
        let (s, saved) = post(srv.addr, "/slots/0?action=save", json!({"filename": "a.bin"}));
        assert_eq!(s, 200, "{saved}");
        let n = saved["n_saved"].as_u64().expect("n_saved");
        assert!(n > 0 && saved["n_written"].as_u64().expect("bytes") > 0, "{saved}");
        let (_, erased) = post(srv.addr, "/slots/0?action=erase", json!({}));
        assert_eq!(erased["n_erased"], n, "{erased}");
        let (_, slots) = post_get(&srv, "/slots");
        assert_eq!(slots[0]["n_cached"], 0, "{slots}");
        let (s, restored) = post(srv.addr, "/slots/0?action=restore", json!({"filename": "a.bin"}));
        assert_eq!((s, restored["n_restored"].as_u64()), (200, Some(n)), "{restored}");
        // Issue 32: `n_read` is the file's bytes, as llama-server counts it (`n_written` on save).
        assert_eq!(restored["n_read"], saved["n_written"], "{restored}");
        // The restored KV serves the prompt from the cache, with the same output.
        let (_, again) = post(srv.addr, "/completion", body.clone());
        assert_eq!(again["content"], first["content"]);
        if spec.is_none() {
            assert!(again["timings"]["cache_n"].as_u64().expect("cache_n") > 0, "the restored prefix was reused: {again}");
        }
        for (path, body, status, needle) in [
            ("/slots/0?action=save", json!({"filename": "../x"}), 400, "plain file name"),
            ("/slots/0?action=save", json!({"filename": ".hidden"}), 400, "plain file name"),
            ("/slots/0?action=save", json!({}), 400, "`filename` is required"),
            ("/slots/0?action=restore", json!({"filename": "missing.bin"}), 404, "no slot file"),
            ("/slots/0?action=fly", json!({}), 400, "action must be"),
            ("/slots/7?action=erase", json!({}), 404, "there is no slot 7"),
            ("/slots/x?action=erase", json!({}), 400, "not a number"),
        ] {
            let (s, v) = post(srv.addr, path, body.clone());
            assert_eq!(s, status, "{path} {body}: {v}");
            assert!(v["error"]["message"].as_str().expect("message").contains(needle), "{path}: {v}");
        }
        std::fs::write(saves.join("junk.bin"), b"TINESLOT not really").expect("write");
        let (s, v) = post(srv.addr, "/slots/0?action=restore", json!({"filename": "junk.bin"}));
        assert_eq!(s, 400, "{v}");
        let (_, still) = post(srv.addr, "/completion", body.clone());
        assert_eq!(still["content"], first["content"], "a refused restore changed nothing");
    }
    // Without --slot-save-path, save and restore are not supported (erase is).
    let srv = start(1, 64);
    let (s, v) = post(srv.addr, "/slots/0?action=save", json!({"filename": "a.bin"}));
    assert_eq!(s, 501, "{v}");
    let (s, _) = post(srv.addr, "/slots/0?action=erase", json!({}));
    assert_eq!(s, 200);
}

fn post_get(srv: &Server, path: &str) -> (u16, Value) {
    let (s, body) = http(srv.addr, "GET", path, "");
    (s, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// llama.cpp's `test_speculative.py::test_with_and_without_draft`: the same seed gives the same
/// text with speculation on or off (temperature 0.2, top_k 5, seed 4242), here for every spec type.
#[test]
fn seeded_sampling_gives_the_same_text_with_and_without_a_draft() {
    let body = json!({"prompt": "hello world hello", "n_predict": 40, "temperature": 0.2, "top_k": 5, "seed": 4242, "ignore_eos": true});
    let plain = start(1, 256);
    let (_, want) = post(plain.addr, "/completion", body.clone());
    let mut hot = body.clone();
    hot["temperature"] = json!(1.2);
    hot["top_k"] = json!(0);
    hot["min_p"] = json!(0.0);
    let (_, want_hot) = post(plain.addr, "/completion", hot.clone());
    for kind in tine_spec::SpecType::ALL {
        let srv = start_with(1, 256, Some(kind));
        let (_, got) = post(srv.addr, "/completion", body.clone());
        assert_eq!(got["content"], want["content"], "{kind}");
        let (_, got) = post(srv.addr, "/completion", hot.clone());
        assert_eq!(got["content"], want_hot["content"], "{kind} at temperature 1.2");
    }
}

/// Waits (at most 10 s) until `/slots` shows `count` busy slots holding at least `n` positions.
fn wait_for_busy_slots(srv: &Server, count: usize, n: u64) {
    for _ in 0..1000 {
        let (_, text) = http(srv.addr, "GET", "/slots", "");
        let slots: Value = serde_json::from_str(&text).expect("json");
        if slots.as_array().expect("slots").iter().filter(|s| s["is_processing"] == json!(true) && s["n_cached"].as_u64().unwrap_or(0) >= n).count() >= count {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("no {count} slots reached {n} positions");
}

#[test]
fn a_prompt_prefix_is_shared_across_slots_and_every_answer_stays_the_same() {
    // A "system prompt" of 300 tokens, then each request's own few.
    let system: Vec<u32> = (0..300u32).map(|i| 6 + (i * 53) % 250).collect();
    let body = |tail: &[u32], n: usize| json!({"prompt": system.iter().chain(tail).copied().collect::<Vec<u32>>(), "n_predict": n, "temperature": 0, "ignore_eos": true, "return_tokens": true});
    let requests = [body(&[7, 8, 9], 4000), body(&[20, 21], 3000), body(&[30, 31], 12)];
    let cfg = |kind: Option<tine_spec::SpecType>, sharing: bool| {
        start_cfg(kind, move |c| {
            *c = ServerConfig { metrics: true, cache_ram: if sharing { Some(64 << 20) } else { Some(0) }, ..ServerConfig::new(3, 3 * 2048) };
        })
    };
    // The answers without sharing (one request at a time).
    let alone = cfg(None, false);
    let want: Vec<Value> = requests.iter().map(|r| post(alone.addr, "/completion", r.clone()).1).collect();
    let mut kinds = vec![None];
    kinds.extend(tine_spec::SpecType::ALL.into_iter().map(Some));
    for kind in kinds {
        let tag = kind.map_or("plain".to_string(), |k| k.to_string());
        let srv = cfg(kind, true);
        let addr = srv.addr;
        // Two long requests hold the system prompt in two slots while a third arrives: the
        // second starts on the first's prefix (shared from its slot), the third on the pool's.
        let (ra, rb) = (requests[0].clone(), requests[1].clone());
        let ha = std::thread::spawn(move || post(addr, "/completion", ra).1);
        wait_for_busy_slots(&srv, 1, 303);
        let hb = std::thread::spawn(move || post(addr, "/completion", rb).1);
        wait_for_busy_slots(&srv, 2, 302);
        let (_, c) = post(srv.addr, "/completion", requests[2].clone());
        let (_, slots) = http(srv.addr, "GET", "/slots", "");
        let (a, b) = (ha.join().expect("client thread"), hb.join().expect("client thread"));
        for (i, got) in [&a, &b, &c].iter().enumerate() {
            assert_eq!(got["tokens"], want[i]["tokens"], "{tag}: request {i}'s answer with sharing");
        }
        // Each later request evaluates only its own tokens. A NextN head's entry j reads token
        // j + 1, so with one the shared prefix ends a position earlier (its entries are shared
        // too, and bound what the target keeps).
        let mtp = kind == Some(tine_spec::SpecType::DraftMtp);
        let shared_n: u64 = if mtp { 299 } else { 300 };
        for r in [&b, &c] {
            assert_eq!(r["timings"]["cache_n"], json!(shared_n), "{tag}: {r}");
            assert_eq!(r["timings"]["prompt_n"], json!(302 - shared_n), "{tag}: {r}");
        }
        let (_, text) = http(srv.addr, "GET", "/metrics", "");
        let value =
            |name: &str| -> f64 { text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' '))).unwrap_or_else(|| panic!("{name} missing:\n{text}")).parse().expect("a number") };
        assert_eq!(value("tine:prefix_pool_hits_total"), 2.0, "{tag}");
        assert_eq!(value("tine:prefix_pool_shared_tokens_total"), 2.0 * shared_n as f64, "{tag}");
        // A draft model's sequences and a NextN head's entries are shared too, in pools of their own.
        let entries = if matches!(kind, Some(tine_spec::SpecType::Draft | tine_spec::SpecType::DraftMtp)) { 2.0 } else { 1.0 };
        assert_eq!(value("tine:prefix_pool_entries"), entries, "{tag}");
        assert!(value("tine:prefix_pool_bytes") > 0.0, "{tag}");
        let slots: Value = serde_json::from_str(&slots).expect("json");
        let shared = slots.as_array().expect("slots").iter().filter(|s| s["n_shared"] == json!(shared_n)).count();
        assert_eq!(shared, 3, "{tag}: every slot reads the one copy: {slots}");
    }
    // Without sharing, nothing is pooled.
    let (_, text) = http(alone.addr, "GET", "/metrics", "");
    assert!(text.lines().any(|l| l == "tine:prefix_pool_hits_total 0"), "{text}");
}

#[test]
fn requests_arriving_together_evaluate_their_common_prefix_once() {
    let system: Vec<u32> = (0..300u32).map(|i| 6 + (i * 59) % 250).collect();
    let body = |tail: u32| json!({"prompt": system.iter().copied().chain([tail, tail + 1]).collect::<Vec<u32>>(), "n_predict": 300, "temperature": 0, "ignore_eos": true, "return_tokens": true});
    let cfg = |sharing: bool, kind| start_cfg(kind, move |c| *c = ServerConfig { ubatch: 32, cache_ram: if sharing { None } else { Some(0) }, ..ServerConfig::new(4, 4 * 1024) });
    let alone = cfg(false, None);
    let want: Vec<Value> = (0..4).map(|i| post(alone.addr, "/completion", body(20 + 10 * i)).1).collect();
    // With a NextN head the others also wait for the first slot's head to build its entries.
    for (kind, shared) in [(None, 300u64), (Some(tine_spec::SpecType::DraftMtp), 299)] {
        let srv = cfg(true, kind);
        let addr = srv.addr;
        let got: Vec<Value> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4).map(|i| s.spawn(move || post(addr, "/completion", body(20 + 10 * i)).1)).collect();
            hs.into_iter().map(|h| h.join().expect("client thread")).collect()
        });
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g["tokens"], w["tokens"], "{kind:?}: request {i}");
        }
        // The system prompt is evaluated once; the others wait for it and evaluate their own.
        let evaluated: u64 = got.iter().map(|g| g["timings"]["prompt_n"].as_u64().expect("prompt_n")).sum();
        assert_eq!(evaluated, 302 + 3 * (302 - shared), "{kind:?}: {:?}", got.iter().map(|g| &g["timings"]).collect::<Vec<_>>());
    }
}

/// Issue 32: Anthropic's Messages API and OpenAI's Responses API run as chats: on Gemma's turns
/// (no tool syntax) a forced tool comes back as a `tool_use` block / `function_call` item, the
/// streams carry the APIs' named events in order, and the streamed text is the whole answer's.
#[test]
fn the_messages_and_responses_apis_answer_in_their_own_shapes() {
    let srv = start(1, 2048);
    let schema = json!({"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]});
    let (s, v) = post(
        srv.addr,
        "/v1/messages",
        json!({"max_tokens": 100, "messages": [{"role": "user", "content": "weather?"}], "tools": [{"name": "w", "input_schema": schema}], "tool_choice": {"type": "any"}, "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["type"].as_str(), v["stop_reason"].as_str(), v["content"][0]["type"].as_str(), v["content"][0]["name"].as_str()),
        (Some("message"), Some("tool_use"), Some("tool_use"), Some("w")),
        "{v}"
    );
    assert!(v["content"][0]["input"]["city"].is_string(), "{v}");
    let (s, v) = post(
        srv.addr,
        "/v1/responses",
        json!({"max_output_tokens": 100, "input": "weather?", "tools": [{"type": "function", "name": "w", "parameters": schema}], "tool_choice": "required", "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["object"].as_str(), v["status"].as_str(), v["output"][0]["type"].as_str(), v["output"][0]["name"].as_str()),
        (Some("response"), Some("completed"), Some("function_call"), Some("w")),
        "{v}"
    );
    // Streams: named events, text deltas adding up to the whole answer.
    let ask = json!({"max_tokens": 12, "messages": [{"role": "user", "content": "hello"}], "temperature": 0});
    let (_, whole) = post(srv.addr, "/v1/messages", ask.clone());
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (s, text) = http(srv.addr, "POST", "/v1/messages", &streamed.to_string());
    assert_eq!(s, 200, "{text}");
    let names: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!((names.first(), names.last()), (Some(&"message_start"), Some(&"message_stop")), "{text}");
    let joined: String = sse_data(&text).iter().filter_map(|d| serde_json::from_str::<Value>(d).ok()).filter_map(|v| v["delta"]["text"].as_str().map(str::to_owned)).collect();
    let want: String = whole["content"].as_array().expect("blocks").iter().filter_map(|b| b["text"].as_str()).collect();
    assert_eq!(joined, want, "{text}");
    let ask = json!({"max_output_tokens": 12, "input": "hello", "temperature": 0});
    let (_, whole) = post(srv.addr, "/v1/responses", ask.clone());
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (_, text) = http(srv.addr, "POST", "/v1/responses", &streamed.to_string());
    let events: Vec<Value> = sse_data(&text).iter().map(|d| serde_json::from_str(d).expect("event JSON")).collect();
    assert_eq!(events.iter().map(|e| e["sequence_number"].as_u64().expect("sequence_number")).collect::<Vec<_>>(), (0..events.len() as u64).collect::<Vec<_>>());
    let last = events.last().expect("events");
    let content = |r: &Value| r["output"].as_array().expect("output").iter().map(|o| o["content"].clone()).collect::<Vec<_>>();
    assert_eq!(content(&last["response"]), content(&whole), "{text}");
    // Errors: Anthropic's shape on its endpoint, OpenAI's on the Responses API.
    let (s, v) = post(srv.addr, "/v1/messages", json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}));
    assert_eq!((s, v["type"].as_str(), v["error"]["type"].as_str()), (400, Some("error"), Some("invalid_request_error")), "{v}");
    let (s, v) = post(srv.addr, "/v1/responses", json!({"input": "x", "previous_response_id": "resp_1"}));
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("previous_response_id")), "{v}");
}

/// Issue 32: `--embeddings` as llama-server serves them. Unpooled, `/embedding` gives every
/// token's row (causal: a prefix's rows are the longer input's first rows); pooled, each input
/// is one unit vector (`mean` the normalized mean of those rows, `cls` the first, `last` the
/// last), the same alone as in a batch; `/v1/embeddings` refuses no pooling, takes token ids,
/// base64 and `dimensions`; without the flag both answer 501.
#[test]
fn embeddings_pool_the_final_hidden_states_as_llama_server_does() {
    use tine_engine::embeddings::Pooling;
    let with = |p: Option<Pooling>| start_cfg(None, |c| *c = ServerConfig { embeddings: p, ..ServerConfig::new(1, 256) });
    let off = with(None);
    for path in ["/embedding", "/v1/embeddings"] {
        let (s, v) = post(off.addr, path, json!({"input": "hello"}));
        assert_eq!(s, 501, "{v}");
        assert!(v["error"]["message"].as_str().expect("message").contains("--embeddings"), "{v}");
    }
    let none = with(Some(Pooling::None));
    let rows = |srv: &Server, input: Value| -> Vec<Vec<f64>> {
        let (s, v) = post(srv.addr, "/embedding", json!({"content": input}));
        assert_eq!(s, 200, "{v}");
        serde_json::from_value(v[0]["embedding"].clone()).expect("rows of floats")
    };
    let all = rows(&none, json!("hello world the world"));
    let prefix = rows(&none, json!("hello world"));
    assert!(all.len() > prefix.len() && prefix.len() >= 2, "{} vs {}", all.len(), prefix.len());
    assert_eq!(all[0].len(), TinyGemma3::default().n_embd, "the fixture's embedding width");
    for (i, r) in prefix.iter().enumerate() {
        let d = r.iter().zip(&all[i]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(d < 1e-4, "row {i} differs by {d}: a row depends on the positions before it only");
    }
    let (s, v) = post(none.addr, "/v1/embeddings", json!({"input": "hello"}));
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"].as_str().expect("message").contains("not OAI compatible"), "{v}");
    let unit = |v: &[f64]| -> Vec<f64> {
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.iter().map(|x| x / n).collect()
    };
    let close = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    let mean: Vec<f64> = (0..all[0].len()).map(|j| all.iter().map(|r| r[j]).sum::<f64>() / all.len() as f64).collect();
    for (pooling, want) in [(Pooling::Mean, unit(&mean)), (Pooling::Cls, unit(&all[0])), (Pooling::Last, unit(&all[all.len() - 1]))] {
        let srv = with(Some(pooling));
        let (s, v) = post(srv.addr, "/v1/embeddings", json!({"input": ["hello world the world", "hello"]}));
        assert_eq!(s, 200, "{v}");
        let got: Vec<f64> = serde_json::from_value(v["data"][0]["embedding"].clone()).expect("floats");
        assert!(close(&got, &want) < 1e-4, "{pooling:?}: {}", close(&got, &want));
        assert_eq!((v["object"].as_str(), v["data"][1]["index"].as_u64(), v["data"][0]["object"].as_str()), (Some("list"), Some(1), Some("embedding")), "{v}");
        let alone: Vec<f64> = serde_json::from_value(post(srv.addr, "/v1/embeddings", json!({"input": "hello"})).1["data"][0]["embedding"].clone()).expect("floats");
        let second: Vec<f64> = serde_json::from_value(v["data"][1]["embedding"].clone()).expect("floats");
        assert!(close(&alone, &second) < 1e-6, "{pooling:?}: batched and alone differ");
        if pooling == Pooling::Mean {
            // Token ids, base64, the normalization, `dimensions` and usage.
            let ids = post(srv.addr, "/tokenize", json!({"content": "hello world the world", "add_special": true})).1["tokens"].clone();
            let by_ids: Vec<f64> = serde_json::from_value(post(srv.addr, "/v1/embeddings", json!({"input": ids})).1["data"][0]["embedding"].clone()).expect("floats");
            assert!(close(&by_ids, &got) < 1e-6);
            let (_, b) = post(srv.addr, "/v1/embeddings", json!({"input": "hello world the world", "encoding_format": "base64"}));
            let text = b["data"][0]["embedding"].as_str().expect("a base64 string");
            let decoded = base64_floats(text);
            assert!(close(&decoded, &got) < 1e-6, "base64 holds the same floats");
            assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(all.len() as u64 + 2), "{v}");
            let (_, raw) = post(srv.addr, "/embedding", json!({"content": "hello world the world", "embd_normalize": -1}));
            let raw: Vec<f64> = serde_json::from_value(raw[0]["embedding"][0].clone()).expect("floats");
            assert!(close(&raw, &mean) < 1e-3, "embd_normalize -1 leaves the mean as it is");
            for (body, param) in [
                (json!({"input": "x", "dimensions": 3}), "dimensions"),
                (json!({"input": "x", "encoding_format": "hex"}), "encoding_format"),
                (json!({"input": []}), "input"),
                (json!({"input": "x", "embd_normalize": -2}), "embd_normalize"),
            ] {
                let (s, v) = post(srv.addr, "/v1/embeddings", body.clone());
                assert_eq!((s, v["error"]["param"].as_str()), (400, Some(param)), "{body}: {v}");
            }
        }
    }
}

/// Standard base64 of little-endian f32s, decoded.
fn base64_floats(text: &str) -> Vec<f64> {
    let val = |c: u8| "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".bytes().position(|x| x == c).expect("base64 character") as u32;
    let mut bytes = Vec::new();
    for chunk in text.as_bytes().chunks(4) {
        let data: Vec<u32> = chunk.iter().filter(|&&c| c != b'=').map(|&c| val(c)).collect();
        let n = data.iter().enumerate().fold(0u32, |n, (k, v)| n | (v << (18 - 6 * k)));
        bytes.extend((0..data.len() - 1).map(|k| (n >> (16 - 8 * k)) as u8));
    }
    bytes.chunks(4).map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect()
}

/// Issue 32: llama-server's `post_sampling_probs` gives the distribution each token was drawn
/// from (after top-k and the other filters: here the top 3 of the raw log-softmax renormalized)
/// as `prob`/`top_probs`; `response_fields` answers only the listed fields, under their paths.
#[test]
fn post_sampling_probs_and_response_fields_answer_as_llama_server() {
    let srv = start(1, 256);
    let base = json!({"prompt": "hello world", "n_predict": 4, "n_probs": 5, "temperature": 1.0, "top_k": 3, "top_p": 1.0, "min_p": 0.0, "seed": 7, "ignore_eos": true});
    let (_, raw) = post(srv.addr, "/completion", base.clone());
    let mut b = base.clone();
    b["post_sampling_probs"] = json!(true);
    let (s, v) = post(srv.addr, "/completion", b);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["content"], raw["content"], "the same draws");
    for (p, r) in v["completion_probabilities"].as_array().expect("probs").iter().zip(raw["completion_probabilities"].as_array().expect("probs")) {
        let top = p["top_probs"].as_array().expect("top_probs");
        assert_eq!(top.len(), 3, "top_k 3 leaves three: {p}");
        assert!(p.get("logprob").is_none() && p["prob"].is_f64(), "{p}");
        let lps: Vec<f64> = r["top_logprobs"].as_array().expect("top_logprobs")[..3].iter().map(|t| t["logprob"].as_f64().expect("logprob")).collect();
        let z: f64 = lps.iter().map(|l| l.exp()).sum();
        for (k, t) in top.iter().enumerate() {
            assert_eq!(t["id"], r["top_logprobs"][k]["id"], "same order: {p}");
            assert!((t["prob"].as_f64().expect("prob") - lps[k].exp() / z).abs() < 1e-4, "{p} vs {r}");
        }
        let sampled = top.iter().find(|t| t["id"] == p["id"]).expect("the drawn token is a candidate");
        assert_eq!(sampled["prob"], p["prob"]);
    }
    let (_, g) = post(srv.addr, "/completion", json!({"prompt": "hello world", "n_predict": 2, "n_probs": 3, "temperature": 0, "post_sampling_probs": true}));
    assert_eq!(
        (g["completion_probabilities"][0]["prob"].as_f64(), g["completion_probabilities"][0]["top_probs"].as_array().map(Vec::len)),
        (Some(1.0), Some(1)),
        "greedy draws the argmax with probability 1: {g}"
    );
    let (_, f) = post(srv.addr, "/completion", json!({"prompt": "hello world", "n_predict": 2, "response_fields": ["content", "generation_settings/n_predict", "no/such"]}));
    let keys: Vec<&String> = f.as_object().expect("object").keys().collect();
    assert_eq!(keys.len(), 2, "{f}");
    assert_eq!((f["generation_settings/n_predict"].as_i64(), f["content"].is_string()), (Some(2), true), "{f}");
}

/// A ChatML template that opens a `<think>` block unless `enable_thinking` is false, as Qwen3.5's
/// does, and prints `date_string` in its system turn.
const THINK_TEMPLATE: &str = "<|im_start|>system\nToday is {{ date_string }}.<|im_end|>\n{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- else %}<think>\n{%- endif %}{%- endif %}";

/// Issue 32: the template context (`chat_template_kwargs` over `--chat-template-kwargs`,
/// `date_string`) and the reasoning split (`reasoning_content` in chat, streamed or whole;
/// a thinking block in the Messages API, a reasoning item in the Responses API;
/// `reasoning_format: "none"` leaves it in the content).
#[test]
fn template_kwargs_reach_the_template_and_reasoning_comes_back_apart() {
    let kwargs: serde_json::Map<String, Value> = serde_json::from_value(json!({"enable_thinking": true})).expect("a map");
    let srv = start_model(TinyGemma3 { chat_template: Some(THINK_TEMPLATE.into()), context: 8192, ..TinyGemma3::default() }, None, move |c| {
        c.ctx_size = 1024;
        c.chat_template_kwargs = kwargs;
    });
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let (_, v) = post(srv.addr, "/apply-template", json!({"messages": msgs}));
    let prompt = v["prompt"].as_str().expect("prompt");
    assert!(prompt.ends_with("<|im_start|>assistant<think>"), "{prompt}");
    let date = prompt.split("Today is ").nth(1).and_then(|r| r.split('.').next()).expect("a date");
    let parts: Vec<&str> = date.split(' ').collect();
    assert!(parts.len() == 3 && parts[0].len() == 2 && parts[1].len() == 3 && parts[2].len() == 4, "llama.cpp's %d %b %Y: {date}");
    let (_, v) = post(srv.addr, "/apply-template", json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": false}}));
    assert!(v["prompt"].as_str().expect("prompt").ends_with("<think>\n\n</think>"), "the request's kwargs win: {v}");
    // The template opened the tag: the reply is reasoning up to `</think>`, then the answer.
    let ask = json!({"messages": msgs, "max_tokens": 40, "temperature": 0, "grammar": "root ::= \"plan it\" \"</think>\" \" the answer\""});
    let (s, v) = post(srv.addr, "/v1/chat/completions", ask.clone());
    assert_eq!(s, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!((m["reasoning_content"].as_str(), m["content"].as_str()), (Some("plan it"), Some("the answer")), "{v}");
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (_, text) = http(srv.addr, "POST", "/v1/chat/completions", &streamed.to_string());
    let (mut r, mut c) = (String::new(), String::new());
    for d in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(d).expect("chunk");
        r.push_str(v["choices"][0]["delta"]["reasoning_content"].as_str().unwrap_or(""));
        c.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!((r.as_str(), c.as_str()), ("plan it", "the answer"), "{text}");
    let mut raw = ask.clone();
    raw["reasoning_format"] = json!("none");
    let (_, v) = post(srv.addr, "/v1/chat/completions", raw);
    assert_eq!((v["choices"][0]["message"]["content"].as_str(), v["choices"][0]["message"].get("reasoning_content")), (Some("plan it</think> the answer"), None), "{v}");
    // The other dialects: a thinking block, a reasoning item.
    let (_, v) = post(srv.addr, "/v1/messages", json!({"max_tokens": 40, "messages": msgs, "temperature": 0, "grammar": "root ::= \"plan it\" \"</think>\" \" the answer\""}));
    assert_eq!((v["content"][0]["type"].as_str(), v["content"][0]["thinking"].as_str(), v["content"][1]["text"].as_str()), (Some("thinking"), Some("plan it"), Some("the answer")), "{v}");
    let (_, v) = post(srv.addr, "/v1/responses", json!({"max_output_tokens": 40, "input": "hi", "temperature": 0, "grammar": "root ::= \"plan it\" \"</think>\" \" the answer\""}));
    assert_eq!(
        (v["output"][0]["type"].as_str(), v["output"][0]["content"][0]["text"].as_str(), v["output"][1]["content"][0]["text"].as_str()),
        (Some("reasoning"), Some("plan it"), Some("the answer")),
        "{v}"
    );
    // Streamed, the same pieces: Anthropic's thinking block (closed with its signature) then text,
    // and the Responses API's reasoning item then message.
    let g = "root ::= \"plan it\" \"</think>\" \" the answer\"";
    let (_, text) = http(srv.addr, "POST", "/v1/messages", &json!({"max_tokens": 40, "messages": msgs, "temperature": 0, "grammar": g, "stream": true}).to_string());
    let events: Vec<Value> = sse_data(&text).iter().map(|d| serde_json::from_str(d).expect("event")).collect();
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["content_block"]["type"].as_str().or(e["delta"]["type"].as_str())).collect();
    assert_eq!(kinds.first(), Some(&"thinking"), "{text}");
    assert!(kinds.contains(&"signature_delta") && kinds.contains(&"text"), "{kinds:?}");
    let thought: String = events.iter().filter_map(|e| e["delta"]["thinking"].as_str()).collect();
    let said: String = events.iter().filter_map(|e| e["delta"]["text"].as_str()).collect();
    assert_eq!((thought.as_str(), said.as_str()), ("plan it", "the answer"), "{text}");
    let (_, text) = http(srv.addr, "POST", "/v1/responses", &json!({"max_output_tokens": 40, "input": "hi", "temperature": 0, "grammar": g, "stream": true}).to_string());
    let last: Value = serde_json::from_str(sse_data(&text).last().expect("events")).expect("event");
    let out = &last["response"]["output"];
    assert_eq!((out[0]["type"].as_str(), out[0]["content"][0]["text"].as_str(), out[1]["content"][0]["text"].as_str()), (Some("reasoning"), Some("plan it"), Some("the answer")), "{text}");
    let (s, v) = post(srv.addr, "/v1/chat/completions", json!({"messages": msgs, "reasoning_format": "maybe"}));
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("reasoning_format")), "{v}");
}

/// Issue 32: llama-server's `return_progress`: a stream carries `prompt_progress` chunks while
/// the prompt is evaluated (one at the start, one per prompt chunk), `processed` counting the
/// tokens reused from the cache too (issue 52, as llama-server counts them: `cache` at the start,
/// `total` at the end), before the first token; without it, none.
#[test]
fn return_progress_streams_the_prompts_evaluation() {
    let srv = start_cfg(None, |c| *c = ServerConfig { ubatch: 8, ..ServerConfig::new(1, 512) });
    let prompt = "hello world the world ".repeat(8);
    let chat = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "temperature": 0, "stream": true, "return_progress": true});
    let mut cached = 0;
    for (path, body) in [
        ("/completion", json!({"prompt": prompt, "n_predict": 3, "temperature": 0, "stream": true, "return_progress": true, "cache_prompt": false})),
        ("/v1/chat/completions", chat.clone()),
        // The same chat again: its prompt but the last token comes from the cache.
        ("/v1/chat/completions", chat),
    ] {
        let (s, text) = http(srv.addr, "POST", path, &body.to_string());
        assert_eq!(s, 200, "{text}");
        let chunks: Vec<Value> = sse_data(&text).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("chunk")).collect();
        let progress: Vec<&Value> = chunks.iter().filter_map(|c| c.get("prompt_progress")).collect();
        let fresh = progress.first().is_some_and(|p| p["cache"] == 0);
        assert!(progress.len() >= if fresh { 3 } else { 2 }, "{path}: a start and a report per chunk of 8: {text}");
        let processed: Vec<u64> = progress.iter().map(|p| p["processed"].as_u64().expect("processed")).collect();
        let cache = progress[0]["cache"].as_u64().expect("cache");
        assert_eq!(processed[0], cache, "{path}: {progress:?}");
        assert!(processed.windows(2).all(|w| w[0] < w[1]), "{path}: {processed:?}");
        let last = progress.last().expect("progress");
        assert_eq!(last["processed"], last["total"], "{path}: {last}");
        assert!(progress.iter().all(|p| p["cache"] == json!(cache) && p["time_ms"].is_number()), "{path}: {progress:?}");
        cached = cache;
        let first_token = chunks.iter().position(|c| c["content"].as_str().is_some_and(|t| !t.is_empty()) || c["choices"][0]["delta"]["content"].is_string());
        let last_progress = chunks.iter().rposition(|c| c.get("prompt_progress").is_some());
        assert!(last_progress < first_token || first_token.is_none(), "{path}: progress comes before the tokens");
        let mut quiet = body.clone();
        quiet["return_progress"] = json!(false);
        let (_, text) = http(srv.addr, "POST", path, &quiet.to_string());
        assert!(!text.contains("prompt_progress"), "{path}: {text}");
    }
    assert!(cached > 0, "the second chat reused nothing");
    // Issue 52: `-b` bounds the chunks as llama.cpp clamps `-ub` to it, and with
    // `timings_per_token` every progress chunk carries the timings so far.
    let srv = start_cfg(None, |c| *c = ServerConfig { batch: 8, ..ServerConfig::new(1, 512) });
    let body = json!({"prompt": prompt, "n_predict": 2, "stream": true, "return_progress": true, "timings_per_token": true, "cache_prompt": false});
    let (_, text) = http(srv.addr, "POST", "/completion", &body.to_string());
    let chunks: Vec<Value> = sse_data(&text).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("chunk")).collect();
    let progress: Vec<&Value> = chunks.iter().filter(|c| c.get("prompt_progress").is_some()).collect();
    assert!(progress.len() > 3, "chunks of 8 under -b 8: {text}");
    assert_eq!(progress[0]["timings"]["prompt_n"], 0, "{text}");
    let ns: Vec<u64> = progress.iter().map(|c| c["timings"]["prompt_n"].as_u64().expect("timings on every progress chunk")).collect();
    assert!(ns.windows(2).all(|w| w[0] < w[1]), "{ns:?}");
}

/// Issue 31: what request routers ask of a worker: `/server_info` and `/model_info` (and their
/// `/get_` names) give the model's id and path, `/get_load` the requests in flight, and vLLM's
/// `/tokenize` forms (`prompt`; `messages`, rendered as a chat would be) the tokens a request runs.
#[test]
fn routers_get_the_worker_endpoints_they_ask_for() {
    let srv = start_cfg(None, |c| *c = ServerConfig { alias: Some("tiny".into()), ..ServerConfig::new(2, 256) });
    for path in ["/server_info", "/get_server_info", "/model_info", "/get_model_info"] {
        let (s, body) = http(srv.addr, "GET", path, "");
        assert_eq!(s, 200, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(v["served_model_name"], "tiny", "{path}: {v}");
        assert!(v["model_path"].as_str().is_some_and(|p| p.ends_with(".gguf")), "{path}: {v}");
    }
    let (_, info) = http(srv.addr, "GET", "/server_info", "");
    let info: Value = serde_json::from_str(&info).expect("JSON");
    assert_eq!((info["dp_size"].as_u64(), info["tp_size"].as_u64(), info["total_slots"].as_u64()), (Some(1), Some(1), Some(2)), "{info}");
    let (_, load) = http(srv.addr, "GET", "/get_load", "");
    assert_eq!(serde_json::from_str::<Value>(&load).expect("JSON")["load"], 0, "{load}");
    let (_, llama) = post(srv.addr, "/tokenize", json!({"content": "hello world"}));
    let (_, vllm) = post(srv.addr, "/tokenize", json!({"prompt": "hello world"}));
    let (l, v) = (llama["tokens"].as_array().expect("ids").len(), vllm["tokens"].as_array().expect("ids").len());
    assert_eq!(v, l + 1, "vLLM's prompt form adds BOS: {llama} {vllm}");
    let msgs = json!([{"role": "user", "content": "hello"}]);
    let (_, chat) = post(srv.addr, "/tokenize", json!({"model": "tiny", "messages": msgs}));
    let (_, run) = post(srv.addr, "/v1/chat/completions", json!({"messages": msgs, "max_tokens": 1}));
    assert_eq!(chat["tokens"].as_array().map(|t| t.len() as u64), run["usage"]["prompt_tokens"].as_u64(), "the chat's own prompt: {chat}");
    let (s, v) = post(srv.addr, "/tokenize", json!({"add_special": true}));
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("content")), "{v}");
}

/// A tool whose parameters refer to their own definitions (`$ref` to `$defs`, as Pydantic
/// writes them) compiles and is followed, in the generic format and as a forced native call:
/// the definitions move to the schema's root, where references are resolved.
#[test]
fn tool_parameters_with_refs_to_their_own_definitions_are_followed() {
    let params = json!({"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"], "$defs": {"Item": {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}}});
    let tools = json!([{"type": "function", "function": {"name": "put", "parameters": params}}]);
    let generic = start(1, 1024);
    let native = start_model(TinyGemma3 { chat_template: Some(TOOL_TEMPLATE.into()), context: 8192, ..TinyGemma3::default() }, None, |c| c.ctx_size = 1024);
    for srv in [&generic, &native] {
        let (s, v) =
            post(srv.addr, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "put one"}], "tools": tools, "tool_choice": "required", "max_tokens": 60, "temperature": 0}));
        assert_eq!(s, 200, "{v}");
        let args: Value = serde_json::from_str(v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].as_str().expect("arguments")).expect("JSON arguments");
        assert!(args["item"]["n"] == 1 || args["item"]["n"] == 2, "{v}");
    }
}

// Issue 51: with several slots on the CPU the decode rows of every active slot run as one
// forward a step; each request's tokens stay those it gets alone (greedy, seeded, with
// probabilities), and /metrics counts the batched forwards.
#[test]
fn batched_slots_answer_each_request_as_alone_and_metrics_show_the_batches() {
    let srv = start_cfg(None, |c| {
        *c = ServerConfig { spec: None, ..ServerConfig::new(8, 8 * 256) };
        c.metrics = true;
    });
    let bodies: Vec<Value> = (0..8)
        .map(|i| {
            let prompt = ["hello world", "the world", "an hello", "in the hell", "world world", "hello", "the hell of the world", "an"][i];
            match i % 3 {
                0 => greedy(prompt, 12 + i as i64),
                1 => json!({"prompt": prompt, "n_predict": 16, "temperature": 0.8, "seed": 40 + i, "cache_prompt": false, "return_tokens": true}),
                _ => json!({"prompt": prompt, "n_predict": 9, "temperature": 0, "n_probs": 3, "cache_prompt": false, "return_tokens": true}),
            }
        })
        .collect();
    let alone: Vec<Value> = bodies.iter().map(|b| post(srv.addr, "/completion", b.clone()).1).collect();
    let addr = srv.addr;
    for round in 0..2 {
        let handles: Vec<_> = bodies.iter().cloned().map(|b| std::thread::spawn(move || post(addr, "/completion", b).1)).collect();
        for (i, h) in handles.into_iter().enumerate() {
            let got = h.join().expect("client thread");
            assert_eq!(got["tokens"], alone[i]["tokens"], "round {round}, request {i} under batching");
            assert_eq!(got["content"], alone[i]["content"]);
            assert_eq!(got["completion_probabilities"], alone[i]["completion_probabilities"], "request {i}'s probabilities");
        }
    }
    let (_, text) = http(srv.addr, "GET", "/metrics", "");
    let value =
        |name: &str| -> f64 { text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' '))).unwrap_or_else(|| panic!("{name} missing:\n{text}")).parse().expect("a number") };
    assert!(value("tine:batched_forwards_total") >= 1.0, "no batched forward:\n{text}");
    // Token rows count prompt chunks' rows too; at most 8 slots a forward.
    assert!(value("tine:batch_rows_max") >= 2.0);
    assert!(value("tine:batched_slots_total") <= 8.0 * value("tine:batched_forwards_total"));
    assert!(value("tine:batched_rows_total") > value("tine:batched_slots_total"), "no prompt chunk went through the batched forwards:\n{text}");
}

// Issue 51: on Qwen3.5/3.6 (a recurrent model) prompt chunks join the batched forward too, as the
// pieces its prefill runs them in (all but the last token, then the last token, the state kept
// between them): 6 concurrent requests with prompts of several chunks each get the tokens plain
// decoding on one slot gives, with speculation off, NextN drafts and n-gram drafts.
#[test]
fn qwen35_batched_prompt_pieces_answer_each_request_as_alone() {
    use tine_test_support::qwen35_fixture::{TinyQwen35, TOKENIZER_VOCAB};
    let cfg = TinyQwen35 { nextn: true, vocab: TOKENIZER_VOCAB, tokenizer: true, ..TinyQwen35::default() };
    let serve = |spec: Option<tine_spec::SpecType>, parallel: usize| {
        let cfg = cfg.clone();
        start_file(
            move |path| {
                cfg.write(path);
            },
            spec,
            |c| {
                *c = ServerConfig { spec: None, ..ServerConfig::new(parallel, parallel * 512) };
                c.ubatch = 24;
                c.metrics = true;
            },
        )
    };
    let bodies: Vec<Value> = (0..6)
        .map(|i| {
            let prompt = ["a b c d ", "the quick brown fox ", "x", "lorem ipsum dolor sit amet ", "0123456789", "hello there "][i].repeat([3, 4, 1, 5, 9, 2][i]);
            let mut b = match i % 3 {
                0 => greedy(&prompt, 10 + i as i64),
                1 => json!({"prompt": prompt, "n_predict": 12, "temperature": 0.8, "seed": 7 + i, "return_tokens": true}),
                _ => json!({"prompt": prompt, "n_predict": 9, "temperature": 0, "n_probs": 2, "return_tokens": true}),
            };
            b["cache_prompt"] = json!(false);
            b["ignore_eos"] = json!(true);
            b
        })
        .collect();
    let plain = serve(None, 1);
    let want: Vec<Value> = bodies.iter().map(|b| post(plain.addr, "/completion", b.clone()).1).collect();
    for spec in [None, Some(tine_spec::SpecType::DraftMtp), Some(tine_spec::SpecType::Ngram)] {
        let srv = serve(spec, 6);
        let addr = srv.addr;
        for round in 0..2 {
            let handles: Vec<_> = bodies.iter().cloned().map(|b| std::thread::spawn(move || post(addr, "/completion", b))).collect();
            for (i, h) in handles.into_iter().enumerate() {
                let (status, got) = h.join().expect("client thread");
                assert_eq!(status, 200, "{spec:?}, request {i}: {got}");
                assert_eq!(got["tokens"], want[i]["tokens"], "{spec:?}, round {round}, request {i} under batching");
                if spec.is_none() {
                    assert_eq!(got["completion_probabilities"], want[i]["completion_probabilities"], "request {i}'s probabilities");
                }
            }
        }
        let (_, text) = http(srv.addr, "GET", "/metrics", "");
        let value =
            |name: &str| -> f64 { text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' '))).unwrap_or_else(|| panic!("{name} missing:\n{text}")).parse().expect("a number") };
        assert!(value("tine:batched_forwards_total") >= 1.0, "{spec:?}: no batched forward:\n{text}");
        assert!(value("tine:batched_rows_total") > value("tine:batched_slots_total"), "{spec:?}: no prompt piece went through the batched forwards:\n{text}");
    }
}

// Issue 51: with speculation on, every slot's verify batch runs in the same forward as the other
// slots' rows; 8 concurrent mixed requests (greedy, seeded, with probabilities, a grammar, drafting
// off, different lengths, and a long prompt arriving mid-way) each get the tokens they get alone,
// for every spec type, and /metrics shows verify rows in the batched forwards.
#[test]
fn batched_speculative_slots_answer_each_request_as_alone_for_every_spec_type() {
    let prompts = ["hello world hello world", "the world the world", "an hello an hello", "in the hell", "world world world", "hello", "the hell of the world", "an an an"];
    let bodies: Vec<Value> = (0..8)
        .map(|i| {
            let prompt = prompts[i];
            let mut b = match i % 4 {
                0 => greedy(prompt, 12 + i as i64),
                1 => json!({"prompt": prompt, "n_predict": 16, "temperature": 0.8, "seed": 40 + i, "cache_prompt": false, "return_tokens": true}),
                2 => json!({"prompt": prompt, "n_predict": 9, "temperature": 0, "n_probs": 3, "cache_prompt": false, "return_tokens": true}),
                _ => json!({"prompt": prompt, "n_predict": 14, "temperature": 0.5, "top_k": 5, "seed": 3, "return_tokens": true}),
            };
            b["ignore_eos"] = json!(true);
            if i == 5 {
                b["speculative.n_max"] = json!(0);
            }
            if i == 6 {
                b["grammar"] = json!("root ::= (\"hello\" | \" world\" | \" the\")+");
            }
            b
        })
        .collect();
    let long = json!({"prompt": "hello world the hell ".repeat(160), "n_predict": 10, "temperature": 0, "ignore_eos": true, "return_tokens": true});
    // Plain decoding, one slot (no batching, no drafts): what every request's tokens must be.
    let plain = start_model(TinyGemma3 { nextn: true, context: 8192, ..TinyGemma3::default() }, None, |c| *c = ServerConfig { spec: None, ..ServerConfig::new(1, 1024) });
    let want: Vec<Value> = bodies.iter().chain([&long]).map(|b| post(plain.addr, "/completion", b.clone()).1["tokens"].clone()).collect();
    for kind in tine_spec::SpecType::ALL {
        let srv = start_cfg(Some(kind), |c| {
            *c = ServerConfig { spec: None, ..ServerConfig::new(9, 1024) };
            c.metrics = true;
        });
        let alone: Vec<Value> = bodies.iter().map(|b| post(srv.addr, "/completion", b.clone()).1).collect();
        let long_alone = post(srv.addr, "/completion", long.clone()).1;
        for (i, a) in alone.iter().chain([&long_alone]).enumerate() {
            assert_eq!(a["tokens"], want[i], "{kind}, request {i} alone against plain decoding");
        }
        let addr = srv.addr;
        let handles: Vec<_> = bodies.iter().cloned().map(|b| std::thread::spawn(move || post(addr, "/completion", b))).collect();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let late = {
            let long = long.clone();
            std::thread::spawn(move || post(addr, "/completion", long))
        };
        for (i, h) in handles.into_iter().enumerate() {
            let (status, got) = h.join().expect("client thread");
            assert_eq!(status, 200, "{kind}, request {i}: {got}");
            assert_eq!(got["tokens"], alone[i]["tokens"], "{kind}, request {i} under batching");
            assert_eq!(got["content"], alone[i]["content"], "{kind}, request {i}");
            assert_eq!(got["completion_probabilities"], alone[i]["completion_probabilities"], "{kind}, request {i}'s probabilities");
        }
        let (status, got) = late.join().expect("client thread");
        assert_eq!(status, 200, "{got}");
        assert_eq!(got["tokens"], long_alone["tokens"], "{kind}: the long prompt that arrived mid-way");
        let (_, text) = http(srv.addr, "GET", "/metrics", "");
        let value =
            |name: &str| -> f64 { text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' '))).unwrap_or_else(|| panic!("{name} missing:\n{text}")).parse().expect("a number") };
        assert!(value("tine:draft_tokens_total") > 0.0, "{kind}: nothing drafted:\n{text}");
        assert!(value("tine:batched_rows_total") > value("tine:batched_slots_total"), "{kind}: no verify batch went through the batched forwards:\n{text}");
        // llama-server's speculative counters, and more than one slot a forward.
        assert_eq!(value("llamacpp:spec_decode_num_draft_tokens_total"), value("tine:draft_tokens_total"));
        assert_eq!(value("llamacpp:spec_decode_num_accepted_tokens_total"), value("tine:draft_tokens_accepted_total"));
        // Per draft position: position 0 kept at most once a verify step, and the positions sum to
        // the accepted tokens.
        let per_pos: Vec<f64> = text
            .lines()
            .filter_map(|l| l.strip_prefix("llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position=\""))
            .map(|l| l.split_once("} ").expect("a sample").1.parse().expect("a number"))
            .collect();
        assert_eq!(per_pos.iter().sum::<f64>(), value("llamacpp:spec_decode_num_accepted_tokens_total"), "{kind}:\n{text}");
        assert!(per_pos.first().is_none_or(|&p| p <= value("llamacpp:spec_decode_num_drafts_total")), "{kind}:\n{text}");
        assert!(per_pos.windows(2).all(|w| w[0] >= w[1]), "{kind}: a later position kept more often:\n{text}");
        assert!(value("llamacpp:n_busy_slots_per_decode") > 1.0, "{kind}:\n{text}");
        assert_prometheus(&text);
    }
}

/// The full answer to a GET: (status, lower-cased head, body).
fn get_raw(addr: SocketAddr, path: &str, extra: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n").expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("HTTP response");
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("status");
    (status, head.to_ascii_lowercase(), body.to_owned())
}

// Issue 52: the chat page at `/` and its files, served without the API key (a browser opening
// the page cannot send one; the page asks for it) while the API still needs it; a CSP that lets
// the page run only its own scripts; `--no-webui` turns it off, `--path` serves a directory
// instead and never a file outside it.
#[test]
fn the_chat_page_is_served_at_the_root_without_the_key_and_the_api_still_needs_it() {
    let srv = start_cfg(None, |c| c.api_keys = tine_server::ApiKeys::new(["k".to_owned()]));
    let (s, head, body) = get_raw(srv.addr, "/", "");
    assert_eq!(s, 200, "{head}");
    assert!(head.contains("content-type: text/html; charset=utf-8") && head.contains("content-security-policy: default-src 'self'; script-src 'self'"), "{head}");
    assert!(body.contains("<title>Tine</title>") && body.contains("webui/app.js"), "{body}");
    for (path, marker) in [("/webui/app.js", "chat/completions"), ("/webui/vendor/marked.umd.js", "marked"), ("/webui/vendor/purify.min.js", "DOMPurify")] {
        let (s, head, body) = get_raw(srv.addr, path, "");
        assert_eq!(s, 200, "{path}: {head}");
        assert!(head.contains("content-type: text/javascript") && body.contains(marker), "{path}");
    }
    // The API behind the page still needs the key; a POST to `/` is not the page.
    assert_eq!(get_raw(srv.addr, "/v1/models", "").0, 401);
    assert_eq!(get_raw(srv.addr, "/v1/models", "Authorization: Bearer k\r\n").0, 200);
    assert_eq!(http(srv.addr, "POST", "/", "{}").0, 401);
    assert_eq!(get_raw(srv.addr, "/webui/missing.js", "Authorization: Bearer k\r\n").0, 404);

    let off = start_cfg(None, |c| c.webui = tine_server::webui::WebUi::Off);
    let (s, _, body) = get_raw(off.addr, "/", "");
    assert_eq!(s, 404);
    assert!(serde_json::from_str::<Value>(&body).expect("a JSON error")["error"]["message"].is_string(), "{body}");
    assert_eq!(get_raw(off.addr, "/webui/app.js", "").0, 404);

    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("index.html"), "<p>mine</p>").expect("write");
    std::fs::write(dir.path().join("style.css"), "p{}").expect("write");
    let outside = dir.path().parent().expect("a parent").join(format!("tine-secret-{}", std::process::id()));
    std::fs::write(&outside, "secret").expect("write");
    let dir_path = dir.path().to_owned();
    let own = start_cfg(None, move |c| {
        c.webui = tine_server::webui::WebUi::Dir(dir_path);
        c.api_keys = tine_server::ApiKeys::new(["k".to_owned()]);
    });
    let (s, _, body) = get_raw(own.addr, "/", "");
    assert_eq!((s, body.as_str()), (200, "<p>mine</p>"));
    let (s, head, _) = get_raw(own.addr, "/style.css", "");
    assert!(s == 200 && head.contains("content-type: text/css"), "{head}");
    let name = outside.file_name().expect("a name").to_str().expect("utf-8");
    for bad in [format!("/../{name}"), format!("/%2e%2e/{name}"), "/webui/app.js".to_owned()] {
        let (s, _, body) = get_raw(own.addr, &bad, "");
        assert!(s == 401 || s == 404 || s == 400, "{bad}: {s}");
        assert!(!body.contains("secret"), "{bad}");
    }
    let _ = std::fs::remove_file(outside);
}

// Issue 52: response header names in canonical case, as llama-server sends them (some clients
// read them case-sensitively): `Content-Type`, `Access-Control-Allow-Origin`, `Content-Length`.
#[test]
fn response_header_names_are_in_canonical_case() {
    let srv = start(1, 128);
    let mut s = TcpStream::connect(srv.addr).expect("connect");
    write!(s, "GET /health HTTP/1.1\r\nHost: x\r\nOrigin: http://localhost:3000\r\nConnection: close\r\n\r\n").expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw);
    let head = text.split_once("\r\n\r\n").expect("HTTP response").0;
    for name in ["Content-Type: application/json", "Content-Length: ", "Access-Control-Allow-Origin: http://localhost:3000"] {
        assert!(head.lines().any(|l| l.starts_with(name)), "no `{name}` header line in:\n{head}");
    }
    assert!(!head.lines().skip(1).any(|l| l.starts_with(|c: char| c.is_ascii_lowercase())), "a header name in lower case:\n{head}");
}

// Issue 52: with `--reasoning auto` (the default) templates render with `enable_thinking` true,
// as llama-server renders them, under the server's `--chat-template-kwargs` and the request's.
#[test]
fn templates_render_with_enable_thinking_true_unless_told_otherwise() {
    const OPEN_IF_THINKING: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n{%- if enable_thinking %}<think>{% endif %}";
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let prompt = |srv: &Server, body: Value| post(srv.addr, "/apply-template", body).1["prompt"].as_str().expect("prompt").to_owned();
    let auto = start_model(TinyGemma3 { chat_template: Some(OPEN_IF_THINKING.into()), context: 8192, ..TinyGemma3::default() }, None, |c| c.ctx_size = 1024);
    assert!(prompt(&auto, json!({"messages": msgs})).ends_with("assistant<think>"));
    assert!(prompt(&auto, json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": false}})).ends_with("assistant"));
    let off = start_model(TinyGemma3 { chat_template: Some(OPEN_IF_THINKING.into()), context: 8192, ..TinyGemma3::default() }, None, |c| {
        c.ctx_size = 1024;
        c.chat_template_kwargs = serde_json::from_value(json!({"enable_thinking": false})).expect("a map");
    });
    assert!(prompt(&off, json!({"messages": msgs})).ends_with("assistant"));
    assert!(prompt(&off, json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": true}})).ends_with("assistant<think>"));
}

// Issue 52: `/infill` builds llama-server's repo-level FIM prompt (`format_prompt_infill`: the
// extra files behind `<|file_sep|>`, BOS, the prefix's last 3/4 of `-b`, the prompt, the
// suffix's first `b/4 - 2 - prompt` tokens, the middle token) for a vocabulary with FIM tokens
// (found by metadata id, the file separator by its text), answers as `/completion` with that
// prompt would, refuses bad fields with a 400 naming them, and a model without FIM tokens gets
// llama-server's 501.
#[test]
fn infill_builds_llama_servers_fim_prompt_and_a_model_without_fim_tokens_gets_a_501() {
    let plain = start(1, 256);
    let (s, v) = post(plain.addr, "/infill", json!({"input_prefix": "hello", "input_suffix": "world"}));
    assert_eq!(s, 501, "{v}");
    assert_eq!(v["error"]["message"], "Infill is not supported by this model: prefix token is missing. suffix token is missing. middle token is missing.");
    assert_eq!(v["error"]["type"], "not_supported_error");

    let cfg = TinyGemma3 { fim: true, context: 8192, ..TinyGemma3::default() };
    let dir = tempfile::tempdir().expect("tempdir");
    cfg.write(&dir.path().join("fim.gguf"));
    let model = Model::load(&dir.path().join("fim.gguf")).expect("the FIM fixture loads");
    let tok = &model.tokenizer;
    let base = (tine_test_support::CONTROL.len() + 256 + tine_test_support::PIECES.len()) as u32;
    let (pre, suf, mid, sep) = (base, base + 1, base + 2, base + 3);
    assert_eq!(model.info.fim, tine_runtime::FimTokens { pre: Some(pre), suf: Some(suf), mid: Some(mid), pad: None, rep: None, sep: Some(sep) });
    let srv = start_model(cfg, None, |c| {
        c.ctx_size = 1024;
        c.batch = 16;
    });
    let (prefix, suffix) = ("hello hello hello hello world the world and in the hell an the world is here", " in the hell the hello");
    let body = json!({"input_prefix": prefix, "input_suffix": suffix, "input_extra": [{"filename": "a.txt", "text": "the world"}], "n_predict": 6, "temperature": 0, "return_tokens": true});
    let (s, got) = post(srv.addr, "/infill", body.clone());
    assert_eq!(s, 200, "{got}");
    // The prompt llama-server builds: extra context, BOS, prefix tail (3 * 16 / 4 = 12 tokens),
    // the suffix head (16 / 4 - 2 = 2 tokens), the middle token.
    let (p, q) = (tok.encode(prefix, false, false), tok.encode(suffix, false, false));
    assert!(p.len() > 12 && q.len() > 2, "the fixture's texts must be cut: {} and {} tokens", p.len(), q.len());
    let mut want = vec![sep];
    want.extend(tok.encode("a.txt\n", false, false));
    want.extend(tok.encode("the world", false, false));
    want.push(sep);
    want.extend(tok.encode("filename\n", false, false));
    want.extend([2, pre]);
    want.extend(&p[p.len() - 12..]);
    want.push(suf);
    want.extend(&q[..2]);
    want.push(mid);
    assert_eq!(got["prompt"], json!(tok.decode(&want, true)), "{got}");
    assert_eq!(got["tokens_evaluated"], json!(want.len()), "{got}");
    // The same tokens through /completion give the same answer.
    let (_, same) = post(srv.addr, "/completion", json!({"prompt": want, "n_predict": 6, "temperature": 0, "return_tokens": true}));
    assert_eq!((got["tokens"].clone(), got["content"].clone()), (same["tokens"].clone(), same["content"].clone()));
    assert_eq!(got["tokens"].as_array().map(Vec::len), Some(6), "{got}");
    // A `prompt` goes after the prefix and shortens the suffix (16 / 4 - 2 - its tokens).
    for extra in ["t", "the"] {
        let ids = tok.encode(extra, false, true);
        let keep = 2usize.saturating_sub(ids.len());
        let (_, with_prompt) = post(srv.addr, "/infill", json!({"input_prefix": prefix, "input_suffix": suffix, "prompt": extra, "n_predict": 1}));
        let text = with_prompt["prompt"].as_str().expect("prompt text");
        assert!(text.ends_with(&format!("{}{}<|fim_suffix|>{}<|fim_middle|>", tok.decode(&p[p.len() - 12..], true), tok.decode(&ids, true), tok.decode(&q[..keep], true))), "{extra}: {text}");
    }
    // Fields llama-server refuses, each a 400 naming the field.
    for (bad, field) in [
        (json!({"input_prefix": "a"}), "input_suffix"),
        (json!({"input_suffix": "a"}), "input_prefix"),
        (json!({"input_prefix": 3, "input_suffix": "a"}), "input_prefix"),
        (json!({"input_prefix": "a", "input_suffix": "b", "input_extra": {"text": "x"}}), "input_extra"),
        (json!({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "f"}]}), "input_extra"),
        (json!({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "x", "filename": 1}]}), "input_extra"),
        (json!({"input_prefix": "a", "input_suffix": "b", "prompt": ["x"]}), "prompt"),
        (json!({"input_prefix": ["a", 99999999], "input_suffix": "b"}), "input_prefix"),
    ] {
        let (s, v) = post(srv.addr, "/infill", bad.clone());
        assert_eq!((s, v["error"]["param"].as_str()), (400, Some(field)), "{bad}: {v}");
    }
}

// Issue 52: llama-server's remaining fields, as its own suite asks for them: `verbose` puts the
// `/completion`-style result (the rendered prompt) under `__verbose`; `/chat/completions/input_tokens`
// counts a chat's prompt; `--alias a,b,c` lists every alias and takes the first in alphabetical
// order as the id, with `--tags`; a `{"prompt_string": ...}` prompt object (multimodal data
// refused); `generation_settings` with llama-server's fields, `ignore_eos` listing the
// end-of-generation biases as `{"bias": null, "token"}`.
#[test]
fn llama_servers_verbose_input_tokens_aliases_prompt_objects_and_generation_settings() {
    let srv = start_cfg(None, |c| {
        c.alias = Some("tinyllama-2,fim,code".into());
        c.tags = vec!["chat".into(), "small".into()];
    });
    let msgs = json!([{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]);
    for verbose in [true, false] {
        let (s, v) = post(srv.addr, "/chat/completions", json!({"messages": msgs, "max_tokens": 2, "verbose": verbose}));
        assert_eq!(s, 200, "{v}");
        if verbose {
            let (_, applied) = post(srv.addr, "/apply-template", json!({"messages": msgs}));
            assert_eq!(v["__verbose"]["prompt"], applied["prompt"], "{v}");
            assert!(v["__verbose"]["prompt"].as_str().is_some_and(|p| p.contains("Book")), "{v}");
            assert_eq!(v["__verbose"]["content"], v["choices"][0]["message"]["content"], "{v}");
            assert_eq!(v["__verbose"]["tokens_predicted"], 2, "{v}");
        } else {
            assert!(v.get("__verbose").is_none(), "{v}");
        }
    }
    let loud = start_cfg(None, |c| c.verbose = true);
    let (_, v) = post(loud.addr, "/chat/completions", json!({"messages": msgs, "max_tokens": 2}));
    assert!(v["__verbose"]["prompt"].as_str().is_some_and(|p| p.contains("Book")), "--verbose: {v}");
    for path in ["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"] {
        let (s, v) = post(srv.addr, path, json!({"messages": msgs}));
        let (_, tok) = post(srv.addr, "/apply-template", json!({"messages": msgs}));
        let (_, ids) = post(srv.addr, "/tokenize", json!({"content": tok["prompt"], "add_special": false, "parse_special": true}));
        assert_eq!((s, v["input_tokens"].as_u64()), (200, Some(ids["tokens"].as_array().expect("tokens").len() as u64)), "{path}: {v}");
    }
    let (_, m) = http(srv.addr, "GET", "/v1/models", "");
    let m: Value = serde_json::from_str(&m).expect("json");
    assert_eq!((m["data"][0]["id"].as_str(), m["data"][0]["aliases"].clone(), m["data"][0]["tags"].clone()), (Some("code"), json!(["code", "fim", "tinyllama-2"]), json!(["chat", "small"])), "{m}");
    let (_, c) = post(srv.addr, "/completion", json!({"prompt": "hello", "n_predict": 1}));
    assert_eq!(c["model"], "code");
    // A prompt object is its text.
    let (_, a) = post(srv.addr, "/completion", greedy("hello world", 4));
    let mut obj = greedy("", 4);
    obj["prompt"] = json!({"prompt_string": "hello world"});
    let (s, b) = post(srv.addr, "/completion", obj);
    assert_eq!((s, b["tokens"].clone()), (200, a["tokens"].clone()), "{b}");
    // Ids and texts in one prompt (llama.cpp's `tokenize_mixed`): BOS then the text is the text.
    let mut mixed = greedy("", 4);
    mixed["prompt"] = json!([2, "hello world"]);
    let (s, b) = post(srv.addr, "/completion", mixed);
    assert_eq!((s, b["tokens"].clone(), b["tokens_evaluated"].clone()), (200, a["tokens"].clone(), a["tokens_evaluated"].clone()), "{b}");
    let (s, v) = post(srv.addr, "/completion", json!({"prompt": [{"prompt_string": "hi", "multimodal_data": ["aGk="]}], "n_predict": 1}));
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("prompt")), "{v}");
    // generation_settings: llama-server's fields, and ignore_eos's biases.
    let (_, g) = post(srv.addr, "/completion", json!({"prompt": "hello", "n_predict": 2, "ignore_eos": true, "logit_bias": [[7, 1.5]]}));
    let gs = &g["generation_settings"];
    for key in [
        "adaptive_target",
        "adaptive_decay",
        "dynatemp_range",
        "top_n_sigma",
        "xtc_probability",
        "typical_p",
        "dry_multiplier",
        "mirostat",
        "max_tokens",
        "n_discard",
        "min_keep",
        "samplers",
        "speculative.types",
        "reasoning_format",
        "lora",
    ] {
        assert!(gs.get(key).is_some(), "generation_settings lacks {key}: {gs}");
    }
    let bias = gs["logit_bias"].as_array().expect("logit_bias");
    assert!(bias.contains(&json!({"bias": 1.5, "token": 7})), "{gs}");
    assert!(bias.iter().any(|b| b["bias"].is_null() && b["token"] == 1), "ignore_eos bans <eos> (1): {gs}");
    let (_, g) = post(srv.addr, "/completion", json!({"prompt": "hello", "n_predict": 2}));
    assert_eq!(g["generation_settings"]["logit_bias"], json!([]), "{g}");
}

/// Issue 50: the scheduler's GPU path (decode rows and verify batches of every slot in one
/// batched step, `Model::step_many_gpu`), played on the CPU (`Model::stand_in_gpu_batches`):
/// concurrent requests of every kind (greedy, greedy with `ignore_eos`, seeded, with logprobs),
/// plain and with each spec type, get what each gets alone on a one-slot server, and the steps
/// carried several slots' rows.
#[test]
fn gpu_batched_steps_give_every_request_what_it_gets_alone() {
    let prompts = ["hello world the", "world hello", "the the hello world", "hello"];
    let body = |i: usize| {
        let p = prompts[i % prompts.len()];
        match i % 4 {
            0 => json!({"prompt": p, "n_predict": 40, "temperature": 0, "return_tokens": true}),
            1 => json!({"prompt": p, "n_predict": 40, "temperature": 0, "ignore_eos": true, "return_tokens": true}),
            // (A draft depth past 8: a verify batch longer than a one-sequence step's rows.)
            2 => json!({"prompt": p, "n_predict": 40, "temperature": 0.8, "seed": 11, "ignore_eos": true, "return_tokens": true, "speculative.n_max": 12, "speculative.n_min": 0}),
            _ => json!({"prompt": p, "n_predict": 24, "temperature": 0, "n_probs": 2, "ignore_eos": true, "return_tokens": true}),
        }
    };
    let model = |spec: Option<tine_spec::SpecType>| TinyGemma3 { nextn: spec.is_some(), context: 8192, ..TinyGemma3::default() };
    let extras = |path: &std::path::Path, cfg: &TinyGemma3| {
        let dir = path.parent().expect("in the test's directory");
        tine_test_support::TinyAssistant::default().write(cfg, &dir.join("assistant.gguf"));
        TinyGemma3 { seed: 99, n_layer: 2, context: 8192, ..TinyGemma3::default() }.write(&dir.join("draft.gguf"));
    };
    let mut kinds = vec![None];
    kinds.extend(tine_spec::SpecType::ALL.into_iter().map(Some));
    for kind in kinds {
        let tag = kind.map_or("plain".to_string(), |k| k.to_string());
        let cfg = model(kind);
        let alone = start_file(
            |p| {
                cfg.write(p);
                extras(p, &cfg)
            },
            kind,
            |c| *c = ServerConfig { metrics: true, ..ServerConfig::new(1, 1024) },
        );
        let want: Vec<Value> = (0..8).map(|i| post(alone.addr, "/completion", body(i)).1).collect();
        let srv = start_file_as(
            |p| {
                cfg.write(p);
                extras(p, &cfg)
            },
            kind,
            |c| *c = ServerConfig { metrics: true, ..ServerConfig::new(4, 4 * 1024) },
            Model::stand_in_gpu_batches,
        );
        let addr = srv.addr;
        let got: Vec<Value> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8).map(|i| s.spawn(move || post(addr, "/completion", body(i)).1)).collect();
            hs.into_iter().map(|h| h.join().expect("client thread")).collect()
        });
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g["tokens"], w["tokens"], "{tag}: request {i}");
            assert_eq!(g["content"], w["content"], "{tag}: request {i}");
            assert_eq!(g["completion_probabilities"], w["completion_probabilities"], "{tag}: request {i}");
        }
        let (_, text) = http(srv.addr, "GET", "/metrics", "");
        let value =
            |name: &str| -> f64 { text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' '))).unwrap_or_else(|| panic!("{name} missing:\n{text}")).parse().expect("a number") };
        // Every kind's rounds share steps: NextN and the assistant read their verify rows'
        // hidden states back from the batched step.
        assert!(value("tine:batched_slots_total") > value("tine:batched_forwards_total"), "{tag}: the batched steps carried several slots:\n{text}");
    }
}
