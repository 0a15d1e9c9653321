//! OpenAI's dialect: `/v1/models`, `/v1/completions` and `/v1/chat/completions` with their
//! JSON shapes (choices, usage, log-probabilities, tool calls, stream chunks).

use super::*;

pub(crate) async fn models(State(st): State<Shared>) -> Json<Value> {
    let i = &st.model.info;
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.model_id, "object": "model", "created": 0, "owned_by": "tine",
            "meta": {"n_vocab": i.vocab_size, "n_ctx_train": i.context_length, "n_embd": i.embedding_length, "size": i.file_size, "architecture": i.architecture}
        }]
    }))
}

pub(crate) fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub(crate) fn token_text(st: &AppState, id: u32) -> String {
    String::from_utf8_lossy(&st.model.tokenizer.token_bytes(id, true)).into_owned()
}

/// OpenAI completions' `logprobs` over `probs`, whose text starts `offset` characters into
/// the completion (streamed chunks carry on from the previous one).
pub(crate) fn completion_logprobs(st: &AppState, probs: &[TokenProb], top: usize, offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for p in probs {
        let text = token_text(st, p.id);
        offsets.push(*offset);
        *offset += text.chars().count();
        tokens.push(text);
        token_logprobs.push(p.logprob);
        let alts: serde_json::Map<String, Value> = p.top.iter().take(top).map(|&(id, lp)| (token_text(st, id), json!(lp))).collect();
        tops.push(Value::Object(alts));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets})
}

/// OpenAI chat's `logprobs` over `probs`.
pub(crate) fn chat_logprobs(st: &AppState, probs: &[TokenProb], top: usize) -> Value {
    let entry = |id: u32, lp: f32| {
        let bytes = st.model.tokenizer.token_bytes(id, true);
        json!({"token": String::from_utf8_lossy(&bytes), "logprob": lp, "bytes": bytes})
    };
    let content: Vec<Value> = probs
        .iter()
        .map(|p| {
            let mut e = entry(p.id, p.logprob);
            e["top_logprobs"] = Value::Array(p.top.iter().take(top).map(|&(id, lp)| entry(id, lp)).collect());
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The assistant message (`content`, or `tool_calls` when the output is a call) and its finish reason.
pub(crate) fn chat_message(s: &Summary, tool_syntax: Option<tine_engine::template::ToolSyntax>) -> (Value, &'static str) {
    match tool_syntax.and_then(|syntax| parse_tool_calls(syntax, &s.text)) {
        Some((content, calls)) => (json!({"content": if content.is_empty() { Value::Null } else { json!(content) }, "tool_calls": tool_calls_json(&calls)}), "tool_calls"),
        None => (json!({"content": s.text}), finish_reason(s.stop_type)),
    }
}

pub(crate) fn finish_reason(s: StopType) -> &'static str {
    match s {
        StopType::Limit => "length",
        StopType::Eos | StopType::Word => "stop",
    }
}

pub(crate) fn usage(s: &Summary) -> Value {
    usage_of(std::slice::from_ref(s))
}

/// A chat stream's last chunk with `stream_options.include_usage`: `chunk` (with no choices)
/// carrying the usage of every choice, and the first choice's timings.
pub(crate) fn usage_chunk(mut chunk: Value, summaries: &[Summary]) -> Value {
    chunk["usage"] = usage_of(summaries);
    if let Some(s) = summaries.first() {
        chunk["timings"] = timings_json(&s.timings);
    }
    chunk
}

/// Usage over every choice of a request.
pub(crate) fn usage_of<'a>(all: impl IntoIterator<Item = &'a Summary>) -> Value {
    let (mut prompt, mut completion, mut cached) = (0, 0, 0);
    for s in all {
        prompt += s.prompt_tokens;
        completion += s.timings.predicted_n;
        cached += s.timings.cached_n;
    }
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}})
}

/// OpenAI's `system_fingerprint`: the build that answered (llama-server sends its build too).
pub(crate) fn fingerprint() -> String {
    format!("tine-{}", env!("CARGO_PKG_VERSION"))
}

pub(crate) async fn oai_completions(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let req = completion_body(&st, body).await?;
    let vs = prepare(&st, move |st| {
        let prompts = prompt_tokens(st, req.prompts)?;
        validate_many(st, prompts, &req.limits, req.n)
    })
    .await?;
    let (stream, logprobs) = (vs[0].stream, vs[0].logprobs);
    let rxs = submit_all(&st, &vs)?;
    let id = format!("cmpl-{}", now());
    let created = now();
    if stream {
        let (st2, id2) = (st.clone(), id.clone());
        let mut offsets = vec![0usize; rxs.len()];
        let stream = merged(rxs)
            .map(move |(i, ev)| match ev {
                Event::Token { text, prob, .. } => {
                    let lp = match (logprobs, prob) {
                        (Some(top), Some(p)) => completion_logprobs(&st2, &[p], top, &mut offsets[i]),
                        _ => Value::Null,
                    };
                    sse_json(json!({"id": id2, "object": "text_completion", "created": created, "model": st2.model_id, "system_fingerprint": fingerprint(), "choices": [{"text": text, "index": i, "logprobs": lp, "finish_reason": null}]}))
                }
                Event::Done(s) => {
                    log_request(&st2, &s);
                    sse_json(json!({"id": id2, "object": "text_completion", "created": created, "model": st2.model_id, "system_fingerprint": fingerprint(), "choices": [{"text": "", "index": i, "logprobs": null, "finish_reason": finish_reason(s.stop_type)}], "usage": usage(&s), "timings": timings_json(&s.timings)}))
                }
                Event::Error(e) => {
                    st2.metrics.failed();
                    sse_json(ApiError::from(&e).body())
                }
            })
            .chain(tokio_stream::once(Ok(SseEvent::default().data("[DONE]"))));
        return Ok(Sse::new(stream).into_response());
    }
    let results = collect_all(&st, rxs).await?;
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (s, probs))| {
            let lp = logprobs.map_or(Value::Null, |top| completion_logprobs(&st, probs, top, &mut 0));
            json!({"text": s.text, "index": i, "logprobs": lp, "finish_reason": finish_reason(s.stop_type)})
        })
        .collect();
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": st.model_id, "system_fingerprint": fingerprint(),
        "choices": choices,
        "usage": usage_of(results.iter().map(|r| &r.0)), "timings": timings_json(&results[0].0.timings),
    }))
    .into_response())
}

/// OpenAI's `tool_calls` for parsed calls.
pub(crate) fn tool_calls_json(calls: &[tine_engine::template::ToolCall]) -> Value {
    Value::Array(calls.iter().enumerate().map(|(i, c)| json!({"id": format!("call_{i}"), "type": "function", "function": {"name": c.name, "arguments": c.arguments}})).collect())
}

pub(crate) async fn chat_completions(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let req = chat_body(&st, body).await?;
    // With tools, the output is parsed for calls in the template family's syntax; a forced
    // call is constrained to a JSON object naming the tool (tine-api put that schema in the
    // limits), and read as one.
    let tool_syntax = if req.forced_call { Some(tine_engine::template::ToolSyntax::JsonObject) } else { req.prompt.tools.as_ref().and_then(|_| st.template.tool_syntax()) };
    let vs = prepare(&st, move |st| {
        let (_, prompt) = chat_prompt(st, &req.prompt)?;
        validate_many(st, vec![prompt], &req.limits, req.n)
    })
    .await?;
    let (stream, logprobs, include_usage, per_token) = (vs[0].stream, vs[0].logprobs, vs[0].include_usage, vs[0].timings_per_token);
    let rxs = submit_all(&st, &vs)?;
    let id = format!("chatcmpl-{}", now());
    let created = now();
    let chunk = |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": st.model_id, "system_fingerprint": fingerprint(), "choices": choices});
    if stream && tool_syntax.is_some() {
        // A call can only be told from text at the end: each answer comes as one chunk.
        let results = collect_all(&st, rxs).await?;
        let mut events = Vec::new();
        for (i, (s, probs)) in results.iter().enumerate() {
            let (mut delta, finish) = chat_message(s, tool_syntax);
            delta["role"] = json!("assistant");
            let lp = logprobs.map_or(Value::Null, |top| chat_logprobs(&st, probs, top));
            events.push(sse_json(chunk(json!([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": null}]))));
            let mut last = chunk(json!([{"index": i, "delta": {}, "finish_reason": finish}]));
            if !include_usage {
                last["timings"] = timings_json(&s.timings);
            }
            events.push(sse_json(last));
        }
        if include_usage {
            let summaries: Vec<Summary> = results.iter().map(|r| r.0.clone()).collect();
            events.push(sse_json(usage_chunk(chunk(json!([])), &summaries)));
        }
        events.push(Ok(SseEvent::default().data("[DONE]")));
        return Ok(Sse::new(tokio_stream::iter(events)).into_response());
    }
    if stream {
        let (st2, id2) = (st.clone(), id.clone());
        // llama-server's first chunk: the role, and no content yet (`null`, never "").
        let firsts: Vec<_> = (0..rxs.len()).map(|i| sse_json(chunk(json!([{"index": i, "delta": {"role": "assistant", "content": null}, "finish_reason": null}])))).collect();
        // With `stream_options.include_usage`, one chunk of no choices carries the usage of every
        // choice once all have ended (OpenAI's and llama-server's last chunk); it comes through
        // this channel, whose sender is dropped when the last choice ends.
        let (usage_tx, usage_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut usage_tx = Some(usage_tx);
        let (total, mut ended, mut summaries) = (rxs.len(), 0, Vec::new());
        let stream = tokio_stream::iter(firsts)
            .chain(merged(rxs).filter_map(move |(i, ev)| {
                let chunk = |choices: Value| json!({"id": id2, "object": "chat.completion.chunk", "created": created, "model": st2.model_id, "system_fingerprint": fingerprint(), "choices": choices});
                match ev {
                    Event::Token { text, prob, timings, .. } => {
                        let lp = match (logprobs, prob) {
                            (Some(top), Some(p)) => chat_logprobs(&st2, &[p], top),
                            _ => Value::Null,
                        };
                        // Text held back while a stop string may be forming is not an empty delta.
                        if text.is_empty() && lp.is_null() {
                            return None;
                        }
                        let delta = if text.is_empty() { json!({}) } else { json!({"content": text}) };
                        let mut c = chunk(json!([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": null}]));
                        if per_token {
                            c["timings"] = timings_json(&timings);
                        }
                        Some(sse_json(c))
                    }
                    Event::Done(s) => {
                        log_request(&st2, &s);
                        let mut last = chunk(json!([{"index": i, "delta": {}, "finish_reason": finish_reason(s.stop_type)}]));
                        if !include_usage {
                            last["timings"] = timings_json(&s.timings);
                        }
                        summaries.push(*s);
                        ended += 1;
                        if ended == total {
                            if let Some(tx) = usage_tx.take().filter(|_| include_usage) {
                                let _ = tx.send(sse_json(usage_chunk(chunk(json!([])), &summaries)));
                            }
                        }
                        Some(sse_json(last))
                    }
                    Event::Error(e) => {
                        st2.metrics.failed();
                        ended += 1;
                        if ended == total {
                            usage_tx.take();
                        }
                        Some(sse_json(ApiError::from(&e).body()))
                    }
                }
            }))
            .chain(UnboundedReceiverStream::new(usage_rx))
            .chain(tokio_stream::once(Ok(SseEvent::default().data("[DONE]"))));
        return Ok(Sse::new(stream).into_response());
    }
    let results = collect_all(&st, rxs).await?;
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (s, probs))| {
            let lp = logprobs.map_or(Value::Null, |top| chat_logprobs(&st, probs, top));
            let (mut message, finish) = chat_message(s, tool_syntax);
            message["role"] = json!("assistant");
            json!({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        })
        .collect();
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": st.model_id, "system_fingerprint": fingerprint(),
        "choices": choices,
        "usage": usage_of(results.iter().map(|r| &r.0)), "timings": timings_json(&results[0].0.timings),
    }))
    .into_response())
}
