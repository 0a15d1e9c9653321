//! OpenAI's dialect: `/v1/models`, `/v1/completions` and `/v1/chat/completions` with their
//! JSON shapes (choices, usage, log-probabilities, tool calls, stream chunks).

use super::*;

pub(crate) async fn models(State(st): State<Shared>) -> Json<Value> {
    let i = &st.model.info;
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.model_id, "object": "model", "created": 0, "owned_by": "tine", "aliases": st.aliases, "tags": st.config.tags,
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

/// The assistant message (`content`, `reasoning_content` when the reply's reasoning is
/// returned apart, and `tool_calls` when it holds calls) and its finish reason; read as
/// [`ReplyReader`] reads a stream, so both answers agree.
pub(crate) fn chat_message(s: &Summary, f: ReplyFormat) -> (Value, &'static str) {
    let (reasoning, content, calls) = read_whole(f, &s.text);
    let mut m =
        if calls.is_empty() { json!({"content": content}) } else { json!({"content": if content.is_empty() { Value::Null } else { json!(content) }, "tool_calls": tool_calls_json(&calls, 0)}) };
    if !reasoning.is_empty() {
        m["reasoning_content"] = json!(reasoning);
    }
    (m, if calls.is_empty() { finish_reason(s.stop_type) } else { "tool_calls" })
}

/// A stream chunk's `delta` for what a [`ReplyReader`] gave out (`None` when nothing):
/// reasoning, content, and calls numbered on from `calls` (each call comes whole, in one delta).
pub(crate) fn piece_delta(pieces: Vec<Piece>, calls: &mut usize) -> Option<Value> {
    let (mut reasoning, mut content, mut found) = (String::new(), String::new(), Vec::new());
    for p in pieces {
        match p {
            Piece::Reasoning(t) => reasoning.push_str(&t),
            Piece::Content(t) => content.push_str(&t),
            Piece::Call(c) => found.push(c),
        }
    }
    let mut delta = serde_json::Map::new();
    if !reasoning.is_empty() {
        delta.insert("reasoning_content".into(), json!(reasoning));
    }
    if !content.is_empty() {
        delta.insert("content".into(), json!(content));
    }
    if !found.is_empty() {
        delta.insert("tool_calls".into(), tool_calls_json(&found, *calls));
        *calls += found.len();
    }
    (!delta.is_empty()).then_some(Value::Object(delta))
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
/// llama-server's `system_fingerprint`: `b<build number>-<commit>` (see build.rs).
pub(crate) fn fingerprint() -> String {
    env!("TINE_BUILD_INFO").to_owned()
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
                Event::Progress(p) => sse_json(json!({"id": id2, "object": "text_completion", "created": created, "model": st2.model_id, "system_fingerprint": fingerprint(), "choices": [{"text": "", "index": i, "logprobs": null, "finish_reason": null}], "prompt_progress": progress_json(&p)})),
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

/// OpenAI's `tool_calls` for parsed calls, numbered from `first` (a stream's `index`), each
/// with an id no other call of this server has had (a conversation's history holds many).
pub(crate) fn tool_calls_json(calls: &[ToolCall], first: usize) -> Value {
    Value::Array(calls.iter().enumerate().map(|(k, c)| json!({"index": first + k, "id": fresh_id("call_"), "type": "function", "function": {"name": c.name, "arguments": c.arguments}})).collect())
}

/// A chat request started on the engine: how its replies are read, the validated requests,
/// and their event streams.
pub(crate) struct ChatRun {
    pub(crate) format: ReplyFormat,
    pub(crate) vs: Vec<Validated>,
    pub(crate) rxs: Vec<tokio::sync::mpsc::UnboundedReceiver<Event>>,
}

/// Renders, validates and submits a checked chat request (every chat dialect's way in).
pub(crate) async fn start_chat(st: &Shared, req: tine_api::ChatRequest) -> Result<ChatRun, ApiError> {
    // With tools, the output is read for calls: in the template family's syntax, as a bare
    // `{"name", "arguments"}` object when a call was forced (tine-api put its schema in the
    // limits), or in the generic format on a template without a tool syntax.
    let tool_syntax = match req.tools {
        ToolMode::None => None,
        ToolMode::Native => st.template.tool_syntax(),
        ToolMode::NativeForced => Some(ToolSyntax::JsonObject),
        ToolMode::Generic => Some(ToolSyntax::Generic),
    };
    // Reasoning is looked for where the template writes the tag (as llama.cpp's parser is
    // generated from the template): elsewhere the reply streams untouched.
    // Not when a JSON schema holds the output from its first token (a forced call, tools in the
    // generic format, `response_format`): there is no reasoning to find, even where the
    // template left the tag open, and reading the JSON as reasoning would lose it.
    let schema_bound = matches!(req.limits.constraint, Some((_, tine_api::Constraint::JsonSchema(_))));
    let returns_reasoning = req.reasoning.unwrap_or(st.config.reasoning_format) == tine_api::ReasoningFormat::Deepseek
        && !schema_bound
        && st.template.source().is_some_and(|s| s.contains(tine_engine::reasoning::THINK_OPEN));
    let (vs, forced_open) = prepare(st, move |st| {
        let (text, prompt) = chat_prompt(st, &req.prompt)?;
        Ok((validate_many(st, vec![prompt], &req.limits, req.n)?, tine_engine::reasoning::forced_open(&text)))
    })
    .await?;
    let rxs = submit_all(st, &vs)?;
    Ok(ChatRun { format: ReplyFormat { reasoning: returns_reasoning.then_some(forced_open), tools: tool_syntax }, vs, rxs })
}

/// llama-server's `/chat/completions/input_tokens`: the tokens a chat body's prompt renders to.
pub(crate) async fn chat_input_tokens(State(st): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let req = chat_body(&st, body).await?;
    let (_, ids) = prepare(&st, move |st| chat_prompt(st, &req.prompt)).await?;
    Ok(Json(json!({"input_tokens": ids.len()})))
}

pub(crate) async fn chat_completions(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let req = chat_body(&st, body).await?;
    let ChatRun { format, vs, rxs } = start_chat(&st, req).await?;
    let (stream, logprobs, include_usage, per_token) = (vs[0].stream, vs[0].logprobs, vs[0].include_usage, vs[0].timings_per_token);
    let verbose = (vs[0].verbose || st.config.verbose).then(|| generation_settings(&st, &vs[0]));
    let id = format!("chatcmpl-{}", now());
    let created = now();
    let chunk = |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": st.model_id, "system_fingerprint": fingerprint(), "choices": choices});
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
        // Each choice's text goes through a reader that gives reasoning and content out as soon
        // as they cannot begin a tag or a call, and each call once it is whole.
        let mut readers: Vec<Option<ReplyReader>> = (0..total).map(|_| Some(ReplyReader::new(format))).collect();
        let mut calls = vec![0usize; total];
        let events = merged(rxs).map(move |(i, ev)| -> Vec<Result<SseEvent, std::convert::Infallible>> {
            let chunk = |choices: Value| json!({"id": id2, "object": "chat.completion.chunk", "created": created, "model": st2.model_id, "system_fingerprint": fingerprint(), "choices": choices});
            match ev {
                Event::Token { text, prob, timings, .. } => {
                    let lp = match (logprobs, prob) {
                        (Some(top), Some(p)) => chat_logprobs(&st2, &[p], top),
                        _ => Value::Null,
                    };
                    let delta = readers[i].as_mut().and_then(|r| piece_delta(r.feed(&text), &mut calls[i]));
                    // Text held back (a stop string or a call may be forming) is not an empty delta.
                    if delta.is_none() && lp.is_null() {
                        return Vec::new();
                    }
                    let mut c = chunk(json!([{"index": i, "delta": delta.unwrap_or_else(|| json!({})), "logprobs": lp, "finish_reason": null}]));
                    if per_token {
                        c["timings"] = timings_json(&timings);
                    }
                    vec![sse_json(c)]
                }
                Event::Progress(p) => {
                    let mut c = chunk(json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": null}]));
                    c["prompt_progress"] = progress_json(&p);
                    if per_token {
                        c["timings"] = timings_json(&p.timings);
                    }
                    vec![sse_json(c)]
                }
                Event::Done(s) => {
                    log_request(&st2, &s);
                    let mut out = Vec::new();
                    if let Some(delta) = readers[i].take().and_then(|r| piece_delta(r.finish(), &mut calls[i])) {
                        out.push(sse_json(chunk(json!([{"index": i, "delta": delta, "logprobs": null, "finish_reason": null}]))));
                    }
                    let finish = if calls[i] > 0 { "tool_calls" } else { finish_reason(s.stop_type) };
                    let mut last = chunk(json!([{"index": i, "delta": {}, "finish_reason": finish}]));
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
                    out.push(sse_json(last));
                    out
                }
                Event::Error(e) => {
                    st2.metrics.failed();
                    ended += 1;
                    if ended == total {
                        usage_tx.take();
                    }
                    vec![sse_json(ApiError::from(&e).body())]
                }
            }
        });
        let stream = tokio_stream::iter(firsts)
            .chain(futures_util::StreamExt::flat_map(events, tokio_stream::iter))
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
            let (mut message, finish) = chat_message(s, format);
            message["role"] = json!("assistant");
            json!({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        })
        .collect();
    let mut answer = json!({
        "id": id, "object": "chat.completion", "created": created, "model": st.model_id, "system_fingerprint": fingerprint(),
        "choices": choices,
        "usage": usage_of(results.iter().map(|r| &r.0)), "timings": timings_json(&results[0].0.timings),
    });
    // llama-server's `verbose`: the first result as `/completion` gives it.
    if let Some(settings) = verbose {
        let s = &results[0].0;
        // The prompt as `/completion` reports it: its tokens detokenized (BOS included).
        let prompt = st.model.tokenizer.decode(&vs[0].request.prompt, true);
        answer["__verbose"] = final_completion_json(&st, s, &s.text, Vec::new(), true, &prompt, &settings);
    }
    Ok(Json(answer).into_response())
}
