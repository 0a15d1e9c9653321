//! OpenAI's Responses API: `/v1/responses` (and `/responses`) and `/v1/responses/input_tokens`,
//! as llama-server serves them. The body is rewritten into a chat body (tine-api's
//! `responses_to_chat`) and runs as a chat; the answer goes back as output items (a `message`
//! with `output_text`, then `function_call`s), its stream as the API's typed events, each with
//! its `sequence_number`. Responses are not stored: `previous_response_id` is refused.

use super::*;

/// The chat request a Responses body stands for, and the body itself (some fields are echoed).
async fn chat_request(st: &AppState, body: Body) -> Result<(tine_api::ChatRequest, Value), ApiError> {
    let raw = read_body(st, body).await?;
    let chat = tine_api::dialects::responses_to_chat(&raw)?;
    let req = tine_api::check_chat_value(chat, &st.config.defaults, st.template.tool_syntax().is_some())?;
    if req.n != 1 {
        return Err(ApiError { param: Some("n".into()), ..ApiError::bad("n: the Responses API answers one output") });
    }
    Ok((req, serde_json::from_slice(&raw).expect("decoded above")))
}

pub(crate) async fn input_tokens(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let (req, _) = chat_request(&st, body).await?;
    let (_, ids) = prepare(&st, move |st| chat_prompt(st, &req.prompt)).await?;
    Ok(Json(json!({"object": "response.input_tokens", "input_tokens": ids.len()})).into_response())
}

fn usage(t: &Timings) -> Value {
    let input = t.prompt_n + t.cached_n;
    json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": t.cached_n}, "output_tokens": t.predicted_n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input + t.predicted_n})
}

/// The response object around `output`: `status` and the request's settings echoed.
fn response_object(id: &str, created: u64, model: &str, req: &Value, status: &str, output: Vec<Value>, s: Option<&Summary>) -> Value {
    let echo = |k: &str, default: Value| req.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(default);
    let incomplete = s.filter(|s| s.stop_type == StopType::Limit).map(|_| json!({"reason": "max_output_tokens"}));
    json!({
        "id": id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": null, "incomplete_details": incomplete,
        "instructions": echo("instructions", Value::Null), "max_output_tokens": echo("max_output_tokens", Value::Null),
        "metadata": echo("metadata", json!({})), "parallel_tool_calls": echo("parallel_tool_calls", json!(false)),
        "previous_response_id": null, "reasoning": null, "store": false,
        "temperature": echo("temperature", Value::Null), "top_p": echo("top_p", Value::Null),
        "text": echo("text", json!({"format": {"type": "text"}})), "tool_choice": echo("tool_choice", json!("auto")), "tools": echo("tools", json!([])),
        "truncation": "disabled", "usage": s.map_or(Value::Null, |s| usage(&s.timings)),
    })
}

fn message_item(id: &str, status: &str, text: Option<&str>) -> Value {
    let content = match text {
        Some(t) => json!([{"type": "output_text", "text": t, "annotations": [], "logprobs": []}]),
        None => json!([]),
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

/// A reasoning item (OpenAI's shape: the text as `reasoning_text` content, no summary).
fn reasoning_item(id: &str, status: &str, text: &str) -> Value {
    let content = if text.is_empty() { json!([]) } else { json!([{"type": "reasoning_text", "text": text}]) };
    json!({"type": "reasoning", "id": id, "status": status, "summary": [], "content": content})
}

fn call_item(id: &str, call_id: &str, c: &ToolCall, status: &str, arguments: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": c.name, "arguments": arguments, "status": status})
}

pub(crate) async fn create(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let (req, echo) = chat_request(&st, body).await?;
    let ChatRun { format, vs, mut rxs } = start_chat(&st, req).await?;
    let (id, created) = (fresh_id("resp_"), now());
    let rx = rxs.pop().expect("a Responses request has one answer");
    if !vs[0].stream {
        let (s, _) = collect(&st, rx).await?;
        let (reasoning, text, calls) = read_whole(format, &s.text);
        let mut output = Vec::new();
        if !reasoning.is_empty() {
            output.push(reasoning_item(&format!("rs_{}_0", &id[5..]), "completed", &reasoning));
        }
        if !text.is_empty() || calls.is_empty() {
            output.push(message_item(&format!("msg_{}_{}", &id[5..], output.len()), "completed", Some(&text)));
        }
        for (k, c) in calls.iter().enumerate() {
            output.push(call_item(&format!("fc_{}_{k}", &id[5..]), &format!("call_{}_{k}", &id[5..]), c, "completed", &c.arguments));
        }
        let status = if s.stop_type == StopType::Limit { "incomplete" } else { "completed" };
        return Ok(Json(response_object(&id, created, &st.model_id, &echo, status, output, Some(&s))).into_response());
    }
    let mut w = Items { id: id.clone(), created, model: st.model_id.clone(), echo, reader: Some(ReplyReader::new(format)), seq: 0, output: Vec::new(), text: None, thinking: None, calls: 0 };
    let mut first = Vec::new();
    let base = w.object("in_progress", None);
    w.push(&mut first, "response.created", json!({"response": base}));
    let base = w.object("in_progress", None);
    w.push(&mut first, "response.in_progress", json!({"response": base}));
    let st2 = st.clone();
    let events = UnboundedReceiverStream::new(rx).map(move |ev| -> Vec<Result<SseEvent, std::convert::Infallible>> {
        let mut out = Vec::new();
        match ev {
            Event::Token { text, .. } => {
                let pieces = w.reader.as_mut().map(|r| r.feed(&text)).unwrap_or_default();
                w.write(&mut out, pieces);
            }
            Event::Done(s) => {
                log_request(&st2, &s);
                if let Some(r) = w.reader.take() {
                    w.write(&mut out, r.finish());
                }
                w.close_thinking(&mut out);
                if w.calls == 0 && w.text.is_none() && !w.output.iter().any(|o| o["type"] == "message") {
                    // An answer of no text is still one (empty) message, as the whole answer has.
                    w.open_message(&mut out);
                }
                w.close_text(&mut out);
                let (status, name) = if s.stop_type == StopType::Limit { ("incomplete", "response.incomplete") } else { ("completed", "response.completed") };
                let done = w.object(status, Some(&s));
                w.push(&mut out, name, json!({"response": done}));
            }
            // The Responses stream has no place for prompt progress.
            Event::Progress(_) => {}
            Event::Error(e) => {
                st2.metrics.failed();
                let e = ApiError::from(&e);
                w.push(&mut out, "error", json!({"code": e.kind(), "message": e.message, "param": null}));
                // The stream's end: the response, failed (clients wait for a terminal event).
                w.close_thinking(&mut out);
                w.close_text(&mut out);
                let mut failed = w.object("failed", None);
                failed["error"] = json!({"code": e.kind(), "message": e.message});
                w.push(&mut out, "response.failed", json!({"response": failed}));
            }
        }
        out
    });
    let stream = tokio_stream::iter(first).chain(futures_util::StreamExt::flat_map(events, tokio_stream::iter));
    Ok(Sse::new(stream).into_response())
}

/// A streamed answer written as output items: a message while text comes, closed before each
/// function call (which comes whole: added, its arguments, done).
struct Items {
    id: String,
    created: u64,
    model: String,
    echo: Value,
    reader: Option<ReplyReader>,
    seq: u64,
    /// The items so far, as they stand.
    output: Vec<Value>,
    /// The open message's text.
    text: Option<String>,
    /// The open reasoning item's text.
    thinking: Option<String>,
    calls: usize,
}

impl Items {
    fn object(&self, status: &str, s: Option<&Summary>) -> Value {
        response_object(&self.id, self.created, &self.model, &self.echo, status, self.output.clone(), s)
    }

    fn push(&mut self, out: &mut Vec<Result<SseEvent, std::convert::Infallible>>, name: &str, mut data: Value) {
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.push(Ok(SseEvent::default().event(name).data(data.to_string())));
    }

    fn message_id(&self) -> String {
        format!("msg_{}_{}", &self.id[5..], self.output.len())
    }

    fn close_text(&mut self, out: &mut Vec<Result<SseEvent, std::convert::Infallible>>) {
        let Some(text) = self.text.take() else { return };
        let (index, item_id) = (self.output.len() - 1, self.output.last().map(|i| i["id"].clone()).expect("the open message is the last item"));
        let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
        self.push(out, "response.output_text.done", json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}));
        self.push(out, "response.content_part.done", json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": part}));
        let item = message_item(item_id.as_str().unwrap_or_default(), "completed", Some(&text));
        self.output[index] = item.clone();
        self.push(out, "response.output_item.done", json!({"output_index": index, "item": item}));
    }

    fn close_thinking(&mut self, out: &mut Vec<Result<SseEvent, std::convert::Infallible>>) {
        let Some(text) = self.thinking.take() else { return };
        let (index, item_id) = (self.output.len() - 1, self.output.last().map(|i| i["id"].clone()).expect("the open reasoning item is the last"));
        self.push(out, "response.reasoning_text.done", json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text}));
        let item = reasoning_item(item_id.as_str().unwrap_or_default(), "completed", &text);
        self.output[index] = item.clone();
        self.push(out, "response.output_item.done", json!({"output_index": index, "item": item}));
    }

    fn open_message(&mut self, out: &mut Vec<Result<SseEvent, std::convert::Infallible>>) {
        let item_id = self.message_id();
        let item = message_item(&item_id, "in_progress", None);
        self.output.push(item.clone());
        let index = self.output.len() - 1;
        self.push(out, "response.output_item.added", json!({"output_index": index, "item": item}));
        self.push(
            out,
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
        );
        self.text = Some(String::new());
    }

    fn write(&mut self, out: &mut Vec<Result<SseEvent, std::convert::Infallible>>, pieces: Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Reasoning(text) => {
                    self.close_text(out);
                    if self.thinking.is_none() {
                        let item_id = format!("rs_{}_{}", &self.id[5..], self.output.len());
                        let item = reasoning_item(&item_id, "in_progress", "");
                        self.output.push(item.clone());
                        self.push(out, "response.output_item.added", json!({"output_index": self.output.len() - 1, "item": item}));
                        self.thinking = Some(String::new());
                    }
                    self.thinking.as_mut().expect("opened above").push_str(&text);
                    let (index, item_id) = (self.output.len() - 1, self.output[self.output.len() - 1]["id"].clone());
                    self.push(out, "response.reasoning_text.delta", json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": text}));
                }
                Piece::Content(text) => {
                    self.close_thinking(out);
                    if self.text.is_none() {
                        self.open_message(out);
                    }
                    self.text.as_mut().expect("opened above").push_str(&text);
                    let (index, item_id) = (self.output.len() - 1, self.output[self.output.len() - 1]["id"].clone());
                    self.push(out, "response.output_text.delta", json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []}));
                }
                Piece::Call(c) => {
                    self.close_thinking(out);
                    self.close_text(out);
                    let index = self.output.len();
                    let (item_id, call_id) = (format!("fc_{}_{}", &self.id[5..], self.calls), format!("call_{}_{}", &self.id[5..], self.calls));
                    self.calls += 1;
                    self.output.push(call_item(&item_id, &call_id, &c, "in_progress", ""));
                    self.push(out, "response.output_item.added", json!({"output_index": index, "item": self.output[index].clone()}));
                    self.push(out, "response.function_call_arguments.delta", json!({"item_id": item_id, "output_index": index, "delta": c.arguments}));
                    self.push(out, "response.function_call_arguments.done", json!({"item_id": item_id, "output_index": index, "name": c.name, "arguments": c.arguments}));
                    self.output[index] = call_item(&item_id, &call_id, &c, "completed", &c.arguments);
                    self.push(out, "response.output_item.done", json!({"output_index": index, "item": self.output[index].clone()}));
                }
            }
        }
    }
}
