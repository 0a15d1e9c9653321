//! `tine serve` replicas behind sglang-router (issue 31), over loopback: the router from PyPI,
//! pinned in `cargo xtask ci`'s client venv (`TINE_CLIENT_PYTHON`).

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tine_test_support::TinyGemma3;

const KEY: &str = "sk-router-test";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port()
}

/// One HTTP request with a JSON body and the key; `None` when the connection fails or no
/// answer comes within `timeout`.
fn call(port: u16, method: &str, path: &str, body: &Value, key: Option<&str>, timeout: Duration) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    let body = if body.is_null() { String::new() } else { body.to_string() };
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    // A chunked body (the router streams what it forwards): the chunks joined.
    let chunked = text.split("\r\n\r\n").next().is_some_and(|h| h.to_ascii_lowercase().contains("transfer-encoding: chunked"));
    Some((status, if chunked { unchunk(&body) } else { body }))
}

fn unchunk(mut b: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = b.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        b = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// POST with the key; every body names the model (the router requires OpenAI's `model`).
fn post(port: u16, path: &str, mut body: Value) -> (u16, Value) {
    body["model"] = json!("tiny");
    let (s, text) = call(port, "POST", path, &body, Some(KEY), Duration::from_secs(60)).unwrap_or_else(|| panic!("no answer from :{port}{path}"));
    (s, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} answered non-JSON ({e}): {text}")))
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn replica(model: &str, port: u16) -> Proc {
    let child = Command::new(env!("CARGO_BIN_EXE_tine"))
        .args(["serve", "-m", model, "--port", &port.to_string(), "--api-key", KEY, "-c", "2048", "--metrics", "--alias", "tiny"])
        .stderr(Stdio::null())
        .spawn()
        .expect("start tine serve");
    wait_for(port, "/health", 60);
    Proc(child)
}

fn wait_for(port: u16, path: &str, seconds: u64) {
    let t0 = Instant::now();
    while call(port, "GET", path, &Value::Null, Some(KEY), Duration::from_secs(2)).is_none_or(|(s, _)| s != 200) {
        assert!(t0.elapsed().as_secs() < seconds, ":{port}{path} did not answer 200 within {seconds} s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Tokens a replica has generated, from its `/metrics`.
fn predicted(port: u16) -> u64 {
    let (_, text) = call(port, "GET", "/metrics", &Value::Null, Some(KEY), Duration::from_secs(5)).expect("metrics");
    text.lines().find_map(|l| l.strip_prefix("llamacpp:tokens_predicted_total ")).and_then(|v| v.trim().parse::<f64>().ok()).map_or(0, |v| v as u64)
}

fn completion(port: u16, prompt: &str, n: u32) -> Value {
    let (s, v) = post(port, "/v1/completions", json!({"prompt": prompt, "max_tokens": n, "temperature": 0}));
    assert_eq!(s, 200, "{v}");
    v
}

/// Two replicas and the router: answers through the router are the replicas' own; requests
/// sharing a long prefix land on the replica that holds it (`timings.cache_n`); a replica
/// killed mid-request fails that request cleanly (no hang), requests fail cleanly until the
/// router's health checks take it out and then go to the other replica, and a restarted
/// replica is healthy at the router again; the router asks clients for the key and passes its
/// own to the replicas.
#[test]
#[ignore = "needs TINE_CLIENT_PYTHON, a python with sglang_router (cargo xtask ci sets it up)"]
fn replicas_behind_sglang_router_answer_route_by_prefix_and_fail_over() {
    let python = std::env::var("TINE_CLIENT_PYTHON").expect("TINE_CLIENT_PYTHON must name a python with sglang_router");
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny.gguf");
    TinyGemma3 { context: 8192, ..TinyGemma3::default() }.write(&model);
    let model = model.to_str().expect("utf-8").to_owned();
    let ports = [free_port(), free_port()];
    let mut replicas = vec![replica(&model, ports[0]), replica(&model, ports[1])];
    let (router_port, metrics_port) = (free_port(), free_port());
    let urls: Vec<String> = ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
    let _router = Proc(
        Command::new(&python)
            .args(["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", &router_port.to_string(), "--worker-urls"])
            .args(&urls)
            .args([
                "--policy",
                "cache_aware",
                "--health-check-interval-secs",
                "1",
                "--cb-timeout-duration-secs",
                "3",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                &metrics_port.to_string(),
                "--api-key",
                KEY,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sglang-router"),
    );
    // The router answers at once and registers the replicas in the background.
    let t0 = Instant::now();
    while call(router_port, "POST", "/v1/completions", &json!({"model": "tiny", "prompt": "hello", "max_tokens": 1}), Some(KEY), Duration::from_secs(10)).is_none_or(|(s, _)| s != 200) {
        assert!(t0.elapsed().as_secs() < 60, "the router did not serve within 60 s");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The model's id reaches the router from /server_info.
    let (_, models) = call(router_port, "GET", "/v1/models", &Value::Null, Some(KEY), Duration::from_secs(10)).expect("models");
    assert!(models.contains("\"tiny\""), "{models}");
    // The key: none, or a wrong one, is refused at the router.
    assert_eq!(call(router_port, "POST", "/v1/completions", &json!({"model": "tiny", "prompt": "x", "max_tokens": 1}), None, Duration::from_secs(10)).map(|r| r.0), Some(401));
    assert_eq!(call(router_port, "POST", "/v1/completions", &json!({"model": "tiny", "prompt": "x", "max_tokens": 1}), Some("wrong"), Duration::from_secs(10)).map(|r| r.0), Some(401));
    // The same answers as a replica's own.
    for p in ["hello world", "the world of hello", "an hello in the world"] {
        let via = completion(router_port, p, 12);
        let direct = completion(ports[1], p, 12);
        assert_eq!(via["choices"][0]["text"], direct["choices"][0]["text"], "{p}");
        let (_, chat) = post(router_port, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": p}], "max_tokens": 8, "temperature": 0}));
        let (_, own) = post(ports[0], "/v1/chat/completions", json!({"messages": [{"role": "user", "content": p}], "max_tokens": 8, "temperature": 0}));
        assert_eq!(chat["choices"][0]["message"]["content"], own["choices"][0]["message"]["content"], "{p}");
    }
    // A long common prefix: the second request is routed to the replica holding it and reuses it.
    let prefix = "the world said hello to the world and the world said hello again ".repeat(12);
    let before = [predicted(ports[0]), predicted(ports[1])];
    completion(router_port, &format!("{prefix}first"), 4);
    let second = completion(router_port, &format!("{prefix}second"), 4);
    let after = [predicted(ports[0]), predicted(ports[1])];
    let served: Vec<bool> = (0..2).map(|i| after[i] > before[i]).collect();
    assert_eq!(served.iter().filter(|s| **s).count(), 1, "both prefix requests on one replica: {before:?} -> {after:?}");
    assert!(second["timings"]["cache_n"].as_u64().expect("cache_n") > 100, "the prefix was reused: {second}");
    // A replica killed while it generates: that request ends (an error or a retried answer),
    // it does not hang; then requests keep being answered by the other replica.
    let victim = if served[0] { 0 } else { 1 };
    let third = format!("{prefix}third");
    let long = std::thread::spawn(move || {
        call(router_port, "POST", "/v1/completions", &json!({"model": "tiny", "prompt": third, "max_tokens": 4000, "ignore_eos": true}), Some(KEY), Duration::from_secs(120))
    });
    std::thread::sleep(Duration::from_millis(1500));
    drop(replicas.remove(victim));
    let t0 = Instant::now();
    let ended = long.join().expect("the client thread");
    assert!(ended.is_some() && t0.elapsed().as_secs() < 120, "the request on the killed replica hung");
    // Until the router's health checks take the replica out (3 failed checks, 1 s apart), a
    // request it still sends there fails cleanly (a 5xx with a JSON body, at once); then every
    // request is answered by the other replica.
    let (t0, mut streak, mut failed) = (Instant::now(), 0, 0);
    while streak < 6 {
        assert!(t0.elapsed().as_secs() < 30, "no run of 6 answers within 30 s of the kill ({failed} failed)");
        let sent = Instant::now();
        let (s, v) = post(router_port, "/v1/completions", json!({"prompt": format!("after the failure {}", streak + failed), "max_tokens": 3, "temperature": 0}));
        assert!(sent.elapsed().as_secs() < 20, "a request after the kill took {:?}", sent.elapsed());
        if s == 200 {
            streak += 1;
        } else {
            assert!(s >= 500 && v.get("error").is_some(), "a failure is a 5xx with an error body: {s} {v}");
            (streak, failed) = (0, failed + 1);
        }
    }
    println!("after the kill: {failed} request(s) failed before the router took the replica out ({:?})", t0.elapsed());
    // The killed replica comes back on its port: the router's health checks mark it healthy
    // again (`--cb-timeout-duration-secs` bounds how long its circuit breaker stays open).
    replicas.insert(victim, replica(&model, ports[victim]));
    let url = format!("http://127.0.0.1:{}", ports[victim]);
    let t0 = Instant::now();
    loop {
        let (_, workers) = call(router_port, "GET", "/workers", &Value::Null, Some(KEY), Duration::from_secs(10)).expect("workers");
        let workers: Value = serde_json::from_str(&workers).expect("workers JSON");
        let back = workers["workers"].as_array().expect("a list").iter().any(|w| w["url"] == url.as_str() && w["is_healthy"] == true);
        if back {
            break;
        }
        assert!(t0.elapsed().as_secs() < 60, "the restarted replica is not healthy at the router within 60 s: {workers}");
        std::thread::sleep(Duration::from_millis(500));
    }
    // And it answers directly again (which replica the router then picks for a given text is
    // its policy's business: the prefix tree learned the other replica meanwhile).
    completion(ports[victim], &format!("{prefix}fourth"), 4);
    completion(router_port, &format!("{prefix}fifth"), 4);
}
