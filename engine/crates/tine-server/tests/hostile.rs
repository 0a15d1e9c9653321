//! The server under hostile clients: bad input at the edge, clients that vanish, trickle or
//! never read, a thousand connections against four slots, API keys, engine failures. All on
//! loopback, bounded in count and time. Each test ends by checking the server still serves.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{greedy, http, post, start_cfg, Server};

/// Sends raw bytes as a request; returns (status, body).
fn raw(addr: SocketAddr, request: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    s.write_all(request).expect("send");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP response: {text:?}"));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("status");
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { super::dechunk(rest) } else { rest.to_owned() };
    (status, body)
}

fn post_bytes(addr: SocketAddr, path: &str, body: &[u8]) -> (u16, String) {
    let mut req = format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len()).into_bytes();
    req.extend_from_slice(body);
    raw(addr, &req)
}

fn error_of(text: &str) -> Value {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("error body is not JSON ({e}): {text}"));
    assert!(v["error"]["code"].is_u64() && v["error"]["message"].is_string() && v["error"]["type"].is_string(), "error shape: {text}");
    v["error"].clone()
}

fn still_serving(srv: &Server) {
    assert_eq!(http(srv.addr, "GET", "/health", "").0, 200);
    let (s, v) = post(srv.addr, "/completion", greedy("hello world", 3));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["tokens"].as_array().map(Vec::len), Some(3));
}

#[test]
fn hostile_inputs_get_their_status_and_a_json_error_body() {
    let srv = start_cfg(None, |c| {
        c.ctx_size = 64;
        c.max_body_bytes = 64 << 10;
    });
    let long_prompt = json!({"prompt": (0..80).map(|i| 6 + i % 200).collect::<Vec<u32>>()}).to_string();
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(100 << 10));
    // (endpoint, body, status, a word the message must hold)
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("/completion", b"{\"prompt\": ".to_vec(), 400, "invalid JSON"),
        ("/completion", b"[]".to_vec(), 400, "invalid"),
        ("/completion", b"null".to_vec(), 400, "invalid"),
        ("/completion", b"{\"prompt\": 5}".to_vec(), 400, "invalid JSON"),
        ("/completion", b"{\"prompt\": \"\xff\xfe\"}".to_vec(), 400, "invalid JSON"),
        ("/completion", b"{\"prompt\": \"hi\", \"n_predict\": \"ten\"}".to_vec(), 400, "invalid type"),
        ("/completion", b"{\"prompt\": \"hi\", \"n_predict\": -5}".to_vec(), 400, "n_predict"),
        ("/completion", b"{\"prompt\": \"hi\", \"n_probs\": 101}".to_vec(), 400, "n_probs"),
        ("/completion", b"{\"prompt\": \"hi\", \"n_probs\": -1}".to_vec(), 400, "invalid value"),
        ("/completion", b"{\"prompt\": \"hi\", \"top_k\": 1e12}".to_vec(), 400, "invalid"),
        ("/completion", b"{\"prompt\": \"hi\", \"top_k\": \"x\"}".to_vec(), 400, "invalid type"),
        ("/completion", b"{\"prompt\": \"hi\", \"temperature\": 1e39}".to_vec(), 400, "temperature"),
        ("/completion", b"{\"prompt\": \"hi\", \"top_p\": -0.5}".to_vec(), 400, "top_p"),
        ("/completion", b"{\"prompt\": \"hi\", \"n\": 99}".to_vec(), 400, "n = 99"),
        ("/completion", b"{\"prompt\": [0, 4294967296]}".to_vec(), 400, "outside the vocabulary"),
        ("/completion", long_prompt.into_bytes(), 400, "the prompt has 80 tokens, the context holds 64"),
        ("/v1/completions", b"{\"prompt\": \"hi\", \"max_tokens\": -3}".to_vec(), 400, "n_predict"),
        ("/v1/chat/completions", b"{\"messages\": [{\"role\": 7}]}".to_vec(), 400, "invalid type"),
        ("/v1/chat/completions", b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": \"x\"}".to_vec(), 400, "invalid type"),
        ("/completion", big.into_bytes(), 413, "larger than the limit of 65536 bytes"),
        ("/tokenize", vec![b'"'; 70 << 10], 413, "larger than the limit"),
    ];
    for (path, body, status, needle) in &cases {
        let (got, text) = post_bytes(srv.addr, path, body);
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).into_owned();
        assert_eq!(got, *status, "{path} {shown}: {text}");
        let e = error_of(&text);
        assert_eq!(e["code"], *status);
        assert!(e["message"].as_str().expect("message").contains(needle), "{path} {shown}: {text}");
    }
    // A body over the limit sent chunked (no Content-Length) is refused the same way.
    let mut req = b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    for _ in 0..10 {
        req.extend_from_slice(format!("{:x}\r\n{}\r\n", 10 << 10, "a".repeat(10 << 10)).as_bytes());
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let (got, text) = raw(srv.addr, &req);
    assert_eq!(got, 413, "{text}");
    // Unknown fields are tolerated, as OpenAI's API does; unknown endpoints and methods are JSON errors.
    let (s, v) = post(srv.addr, "/completion", json!({"prompt": "hi", "n_predict": 2, "frobnicate": {"deep": [1, 2]}, "logit_bias_x": 1}));
    assert_eq!(s, 200, "{v}");
    let (s, text) = http(srv.addr, "GET", "/no/such/thing", "");
    assert_eq!((s, error_of(&text)["type"].as_str()), (404, Some("not_found_error")));
    let (s, text) = http(srv.addr, "GET", "/completion", "");
    assert_eq!(s, 405, "{text}");
    error_of(&text);
    still_serving(&srv);
}

#[test]
fn a_client_that_stops_sending_its_body_gets_a_408_and_others_are_served() {
    let srv = start_cfg(None, |c| c.body_timeout = Duration::from_millis(500));
    let mut s = TcpStream::connect(srv.addr).expect("connect");
    s.write_all(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{\"prompt\"").expect("send");
    // While it trickles, another client is served.
    still_serving(&srv);
    let mut out = String::new();
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    error_of(out.split_once("\r\n\r\n").expect("body").1);
}

fn streaming_request(prompt: &str, n_predict: i64) -> Vec<u8> {
    let body = json!({"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": true, "stream": true}).to_string();
    format!("POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).into_bytes()
}

fn slots(srv: &Server) -> Vec<Value> {
    let (s, text) = http(srv.addr, "GET", "/slots", "");
    assert_eq!(s, 200, "{text}");
    serde_json::from_str::<Value>(&text).expect("json").as_array().expect("array").clone()
}

fn wait_idle(srv: &Server, within: Duration) {
    let t0 = Instant::now();
    while slots(srv).iter().any(|s| s["is_processing"] == true) {
        assert!(t0.elapsed() < within, "a slot stayed busy: {:?}", slots(srv));
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn clients_that_vanish_mid_stream_free_their_slot_for_the_next_request() {
    let srv = start_cfg(None, |c| {
        c.parallel = 1;
        c.ctx_size = 8192;
    });
    for round in 0..6 {
        let mut s = TcpStream::connect(srv.addr).expect("connect");
        // Thousands of tokens: far longer than the test waits for the slot.
        s.write_all(&streaming_request("hello world", 8000)).expect("send");
        let mut first = [0u8; 256];
        let n = s.read(&mut first).expect("first event");
        assert!(String::from_utf8_lossy(&first[..n]).contains("200 OK"), "round {round}");
        drop(s);
        wait_idle(&srv, Duration::from_secs(20));
        // Freed by the disconnect, not by running to the end.
        let held = slots(&srv)[0]["n_cached"].as_u64().expect("n_cached");
        assert!(held < 7000, "round {round}: the abandoned generation ran on to {held} positions");
        still_serving(&srv);
    }
}

#[test]
fn a_client_that_never_reads_its_stream_does_not_hold_up_the_others() {
    let srv = start_cfg(None, |c| {
        c.parallel = 2;
        c.ctx_size = 8192;
    });
    let mut lazy = TcpStream::connect(srv.addr).expect("connect");
    lazy.write_all(&streaming_request("the world", 6000)).expect("send");
    // Half-sent headers from another client, never finished.
    let mut trickle = TcpStream::connect(srv.addr).expect("connect");
    trickle.write_all(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Le").expect("send");
    for _ in 0..10 {
        still_serving(&srv);
    }
    drop((lazy, trickle));
    wait_idle(&srv, Duration::from_secs(30));
}

/// Peak resident memory of this process (the server runs in it), in KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap_or(0)
}

#[test]
fn a_thousand_connections_against_four_slots_are_served_or_refused_with_503() {
    let srv = start_cfg(None, |c| {
        c.parallel = 4;
        c.max_queue = 60;
    });
    still_serving(&srv);
    let rss_before = peak_rss_kib();
    let addr = srv.addr;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("client runtime");
    let t0 = Instant::now();
    let results: Vec<(u16, String)> = rt.block_on(async move {
        let tasks: Vec<_> = (0..1000)
            .map(|i| {
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let body = json!({"prompt": format!("hello {}", ["world", "the", "an"][i % 3]), "n_predict": 8, "temperature": 0, "stream": i % 2 == 0}).to_string();
                    let req = format!("POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
                    s.write_all(req.as_bytes()).await.expect("send");
                    let mut out = Vec::new();
                    tokio::time::timeout(Duration::from_secs(120), s.read_to_end(&mut out)).await.expect("answered in time").expect("read");
                    let text = String::from_utf8_lossy(&out).into_owned();
                    let (head, rest) = text.split_once("\r\n\r\n").expect("HTTP response");
                    (head.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("status"), rest.to_owned())
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("client task"));
        }
        out
    });
    let elapsed = t0.elapsed();
    let ok = results.iter().filter(|r| r.0 == 200).count();
    let busy: Vec<&(u16, String)> = results.iter().filter(|r| r.0 == 503).collect();
    assert_eq!(ok + busy.len(), 1000, "only 200 or 503: {:?}", results.iter().find(|r| r.0 != 200 && r.0 != 503));
    assert!(ok >= 64, "at least the slots and the queue were served: {ok}");
    for (_, body) in &busy {
        let e = error_of(body);
        assert_eq!(e["type"], "unavailable_error");
    }
    let grown_mib = peak_rss_kib().saturating_sub(rss_before) / 1024;
    eprintln!("load: 1000 connections, {ok} served, {} refused with 503, {:.1} s, peak RSS grew {grown_mib} MiB", busy.len(), elapsed.as_secs_f64());
    // Loose: the other tests of this binary run servers in the same process at the same time.
    // The report's figure comes from `tine serve` alone (docs/evaluations/reliability.md).
    assert!(grown_mib < 1024, "memory is bounded: peak RSS grew {grown_mib} MiB");
    wait_idle(&srv, Duration::from_secs(30));
    still_serving(&srv);
}

#[test]
fn an_api_key_is_required_on_every_endpoint_but_health() {
    let srv = start_cfg(None, |c| c.api_keys = tine_server::ApiKeys::new(["sekret-1".to_owned(), " other ".to_owned()]));
    let endpoints: &[(&str, &str, &str)] = &[
        ("GET", "/props", ""),
        ("GET", "/slots", ""),
        ("GET", "/v1/models", ""),
        ("GET", "/models", ""),
        ("GET", "/no/such/endpoint", ""),
        ("POST", "/completion", r#"{"prompt": "hi", "n_predict": 1}"#),
        ("POST", "/v1/completions", r#"{"prompt": "hi", "max_tokens": 1}"#),
        ("POST", "/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}"#),
        ("POST", "/tokenize", r#"{"content": "hi"}"#),
        ("POST", "/detokenize", r#"{"tokens": [5]}"#),
    ];
    let send = |method: &str, path: &str, body: &str, auth: &str| {
        raw(srv.addr, format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).as_bytes())
    };
    for (method, path, body) in endpoints {
        for auth in ["", "Authorization: Bearer wrong\r\n", "Authorization: Bearer sekret-\r\n", "Authorization: Basic c2VrcmV0LTE=\r\n", "Authorization: sekret-1\r\n"] {
            let (s, text) = send(method, path, body, auth);
            assert_eq!(s, 401, "{method} {path} with {auth:?}: {text}");
            assert_eq!(error_of(&text)["type"], "authentication_error");
        }
        for auth in ["Authorization: Bearer sekret-1\r\n", "authorization: bearer other\r\n", "X-Api-Key: sekret-1\r\n"] {
            let (s, text) = send(method, path, body, auth);
            assert_ne!(s, 401, "{method} {path} with {auth:?}: {text}");
        }
    }
    assert_eq!(send("GET", "/health", "", "").0, 200);
    assert_eq!(send("GET", "/v1/health", "", "").0, 200);
}

#[test]
fn an_engine_failure_reaches_the_client_with_its_cause_and_the_slot_keeps_its_prefix() {
    let fault = Arc::new(AtomicI64::new(-1));
    let f = fault.clone();
    let srv = start_cfg(None, move |c| {
        c.ubatch = 4;
        c.fault = Some(f);
    });
    let body = greedy("hello world the world an hello in the hell", 6);
    let (_, want) = post(srv.addr, "/completion", body.clone());
    // A different prompt so the slot holds nothing the failing request reuses.
    post(srv.addr, "/completion", greedy("world", 2));
    // The third forward fails: two prompt chunks are in the sequence by then.
    fault.store(2, Ordering::SeqCst);
    let (s, v) = post(srv.addr, "/completion", body.clone());
    assert_eq!(s, 500, "{v}");
    let msg = v["error"]["message"].as_str().expect("message");
    assert!(msg.starts_with("model step failed: ") && msg.contains("injected failure"), "the cause, not only that it failed: {msg}");
    assert_eq!(v["error"]["type"], "server_error");
    // The slot was not reset: the chunks evaluated before the failure are reused, and the
    // output is what it was before.
    let (s, got) = post(srv.addr, "/completion", body.clone());
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["tokens"], want["tokens"]);
    assert!(got["timings"]["cache_n"].as_u64().expect("cache_n") >= 8, "prefix kept after the failure: {}", got["timings"]);
    // Streamed, the error arrives as an event with the same body.
    fault.store(0, Ordering::SeqCst);
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    stream["cache_prompt"] = json!(false);
    let (s, text) = http(srv.addr, "POST", "/completion", &stream.to_string());
    assert_eq!(s, 200);
    let events = super::sse_data(&text);
    let last: Value = serde_json::from_str(events.last().expect("an event")).expect("json event");
    assert_eq!(last["error"]["code"], 500, "{text}");
    assert!(last["error"]["message"].as_str().expect("message").contains("injected failure"));
    still_serving(&srv);
}

#[test]
fn identical_greedy_requests_over_all_slots_match_the_single_slot_output() {
    let body = json!({"prompt": "hello world hello the world", "n_predict": 20, "temperature": 0, "ignore_eos": true, "return_tokens": true});
    let kinds = std::iter::once(None).chain(tine_spec::SpecType::ALL.into_iter().map(Some));
    for kind in kinds {
        let srv = start_cfg(kind, |c| {
            c.parallel = 3;
            c.ubatch = 3;
        });
        let (_, alone) = post(srv.addr, "/completion", body.clone());
        let alone_text = alone["content"].as_str().expect("content").to_owned();
        let addr = srv.addr;
        let results: Vec<(bool, String)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..6)
                .map(|i| {
                    let mut b = body.clone();
                    b["stream"] = json!(i % 2 == 1);
                    // Half of them must not reuse a slot's cache.
                    b["cache_prompt"] = json!(i % 3 != 0);
                    s.spawn(move || {
                        let (st, text) = http(addr, "POST", "/completion", &b.to_string());
                        assert_eq!(st, 200, "{text}");
                        if i % 2 == 1 {
                            let content: String = super::sse_data(&text).iter().map(|e| serde_json::from_str::<Value>(e).expect("event")["content"].as_str().unwrap_or("").to_owned()).collect();
                            (true, content)
                        } else {
                            (false, serde_json::from_str::<Value>(&text).expect("json")["content"].as_str().expect("content").to_owned())
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("client")).collect()
        });
        for (streamed, text) in results {
            assert_eq!(text, alone_text, "{kind:?} (streamed: {streamed}): differs from the single-slot output");
        }
    }
}
