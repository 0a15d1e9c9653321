//! Anthropic's Messages API: `/v1/messages` and `/v1/messages/count_tokens`, as llama-server
//! serves them. The body is rewritten into an OpenAI chat body (tine-api's
//! `anthropic_to_chat`) and runs as a chat; the answer goes back as Anthropic's content blocks
//! (`text`, `tool_use`), its stream as Anthropic's named events, its errors in Anthropic's shape.

use super::*;

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
fn error_body(e: &ApiError) -> Value {
    let kind = match e.status {
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_client_error() => "invalid_request_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

fn answer(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| (e.status, Json(error_body(&e))).into_response())
}

/// The chat request an Anthropic body stands for.
async fn chat_request(st: &AppState, body: Body) -> Result<tine_api::ChatRequest, ApiError> {
    let chat = tine_api::dialects::anthropic_to_chat(&read_body(st, body).await?)?;
    Ok(tine_api::check_chat_value(chat, &st.config.defaults, st.template.tool_syntax().is_some())?)
}

pub(crate) async fn count_tokens(State(st): State<Shared>, body: Body) -> Response {
    answer(
        async {
            let req = chat_request(&st, body).await?;
            let (_, ids) = prepare(&st, move |st| chat_prompt(st, &req.prompt)).await?;
            Ok(Json(json!({"input_tokens": ids.len()})).into_response())
        }
        .await,
    )
}

pub(crate) async fn messages(State(st): State<Shared>, body: Body) -> Response {
    answer(run(st, body).await)
}

/// Anthropic's `stop_reason`.
fn stop_reason(s: &Summary, calls: bool) -> &'static str {
    match s.stop_type {
        _ if calls => "tool_use",
        StopType::Limit => "max_tokens",
        StopType::Word => "stop_sequence",
        StopType::Eos => "end_turn",
    }
}

fn usage(t: &Timings) -> Value {
    json!({"input_tokens": t.prompt_n, "cache_read_input_tokens": t.cached_n, "cache_creation_input_tokens": 0, "output_tokens": t.predicted_n})
}

fn tool_use(c: &ToolCall, id: String) -> Value {
    // Arguments are a JSON text; a call whose text is not an object (the template's syntax let
    // it through) is given an empty input rather than a broken block.
    let input = serde_json::from_str::<Value>(&c.arguments).ok().filter(Value::is_object).unwrap_or_else(|| json!({}));
    json!({"type": "tool_use", "id": id, "name": c.name, "input": input})
}

async fn run(st: Shared, body: Body) -> Result<Response, ApiError> {
    let req = chat_request(&st, body).await?;
    let ChatRun { format, vs, mut rxs } = start_chat(&st, req).await?;
    let id = fresh_id("msg_");
    let rx = rxs.pop().expect("an Anthropic request has one answer");
    if !vs[0].stream {
        let (s, _) = collect(&st, rx).await?;
        let (reasoning, text, calls) = read_whole(format, &s.text);
        let mut content = Vec::new();
        if !reasoning.is_empty() {
            // Anthropic's thinking block; a local model signs nothing (llama-server sends "").
            content.push(json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
        }
        if !text.is_empty() {
            content.push(json!({"type": "text", "text": text}));
        }
        content.extend(calls.iter().enumerate().map(|(k, c)| tool_use(c, format!("toolu_{}_{k}", &id[4..]))));
        return Ok(Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": st.model_id, "content": content,
            "stop_reason": stop_reason(&s, !calls.is_empty()),
            "stop_sequence": if s.stop_type == StopType::Word { json!(s.stopping_word) } else { Value::Null },
            "usage": usage(&s.timings),
        }))
        .into_response());
    }
    let mut w = Blocks { id: id.clone(), model: st.model_id.clone(), reader: Some(ReplyReader::new(format)), started: false, open: None, index: 0, calls: 0 };
    let st2 = st.clone();
    let events = UnboundedReceiverStream::new(rx).map(move |ev| -> Vec<Result<SseEvent, std::convert::Infallible>> {
        let mut out = Vec::new();
        match ev {
            Event::Token { text, timings, .. } => {
                w.start(&mut out, &timings);
                let pieces = w.reader.as_mut().map(|r| r.feed(&text)).unwrap_or_default();
                w.write(&mut out, pieces);
            }
            Event::Done(s) => {
                log_request(&st2, &s);
                w.start(&mut out, &s.timings);
                if let Some(r) = w.reader.take() {
                    w.write(&mut out, r.finish());
                }
                w.close(&mut out);
                out.push(event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(&s, w.calls > 0), "stop_sequence": if s.stop_type == StopType::Word { json!(s.stopping_word) } else { Value::Null }}, "usage": {"output_tokens": s.timings.predicted_n}})));
                out.push(event("message_stop", json!({"type": "message_stop"})));
            }
            // Anthropic's stream has no place for prompt progress.
            Event::Progress(_) => {}
            Event::Error(e) => {
                st2.metrics.failed();
                out.push(event("error", error_body(&ApiError::from(&e))));
            }
        }
        out
    });
    Ok(Sse::new(futures_util::StreamExt::flat_map(events, tokio_stream::iter)).into_response())
}

fn event(name: &str, data: Value) -> Result<SseEvent, std::convert::Infallible> {
    Ok(SseEvent::default().event(name).data(data.to_string()))
}

/// A streamed answer written as Anthropic's content blocks: a thinking block while reasoning
/// comes, a text block while text comes (each closed when the other kind starts), and each
/// tool_use block whole (start, its input, stop).
struct Blocks {
    id: String,
    model: String,
    reader: Option<ReplyReader>,
    started: bool,
    /// The open block's kind: `"thinking"` or `"text"`.
    open: Option<&'static str>,
    /// The next block's index.
    index: usize,
    calls: usize,
}

type Out = Vec<Result<SseEvent, std::convert::Infallible>>;

impl Blocks {
    fn start(&mut self, out: &mut Out, t: &Timings) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let mut u = usage(t);
        u["output_tokens"] = json!(0);
        out.push(event(
            "message_start",
            json!({"type": "message_start", "message": {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [], "stop_reason": null, "stop_sequence": null, "usage": u}}),
        ));
    }

    fn close(&mut self, out: &mut Out) {
        if let Some(kind) = self.open.take() {
            if kind == "thinking" {
                out.push(event("content_block_delta", json!({"type": "content_block_delta", "index": self.index, "delta": {"type": "signature_delta", "signature": ""}})));
            }
            out.push(event("content_block_stop", json!({"type": "content_block_stop", "index": self.index})));
            self.index += 1;
        }
    }

    /// Opens a block of `kind` unless one is open; returns its index.
    fn open(&mut self, out: &mut Out, kind: &'static str) -> usize {
        if self.open != Some(kind) {
            self.close(out);
            out.push(event("content_block_start", json!({"type": "content_block_start", "index": self.index, "content_block": {"type": kind, kind: ""}})));
            self.open = Some(kind);
        }
        self.index
    }

    fn write(&mut self, out: &mut Out, pieces: Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Reasoning(t) => {
                    let index = self.open(out, "thinking");
                    out.push(event("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": t}})));
                }
                Piece::Content(t) => {
                    let index = self.open(out, "text");
                    out.push(event("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}})));
                }
                Piece::Call(c) => {
                    self.close(out);
                    let mut block = tool_use(&c, format!("toolu_{}_{}", &self.id[4..], self.calls));
                    let input = std::mem::replace(&mut block["input"], json!({}));
                    out.push(event("content_block_start", json!({"type": "content_block_start", "index": self.index, "content_block": block})));
                    out.push(event("content_block_delta", json!({"type": "content_block_delta", "index": self.index, "delta": {"type": "input_json_delta", "partial_json": input.to_string()}})));
                    out.push(event("content_block_stop", json!({"type": "content_block_stop", "index": self.index})));
                    self.index += 1;
                    self.calls += 1;
                }
            }
        }
    }
}
