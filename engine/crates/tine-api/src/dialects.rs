//! Other APIs' chat requests, rewritten into an OpenAI chat body that [`crate::check_chat`]
//! then checks like any other: Anthropic's Messages API (`/v1/messages`) and OpenAI's
//! Responses API (`/v1/responses`), as llama-server maps them (tools/server/server-chat.cpp),
//! with every field that cannot be honoured refused by name instead of dropped.

use serde_json::{json, Map, Value};

use crate::{decode, RequestError};

/// A field's value, or `None` when absent or `null`.
fn field<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn object_body(body: &[u8]) -> Result<Map<String, Value>, RequestError> {
    match decode::<Value>(body)? {
        Value::Object(m) => Ok(m),
        other => Err(RequestError::new(format!("the body must be a JSON object, got {}", kind_of(&other)))),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// llama-server's own request fields, which its clients add to any dialect's body (as the
/// official clients' `extra_body`): passed through to the chat as they are.
const LLAMA_EXTRAS: &[&str] = &[
    "min_p",
    "seed",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "grammar",
    "json_schema",
    "n_probs",
    "post_sampling_probs",
    "id_slot",
    "cache_prompt",
    "n_keep",
    "ignore_eos",
    "logit_bias",
    "timings_per_token",
    "chat_template_kwargs",
    "reasoning_format",
    "speculative.n_max",
    "speculative.n_min",
    "speculative.p_min",
    "speculative.type",
];

/// Sets a chat template variable (`chat_template_kwargs`), unless the client set it itself.
fn template_kwarg(chat: &mut Map<String, Value>, key: &str, value: Value) {
    let kwargs = chat.entry("chat_template_kwargs").or_insert_with(|| json!({}));
    if let Some(k) = kwargs.as_object_mut() {
        k.entry(key).or_insert(value);
    }
}

/// Copies the sampling fields both APIs share with OpenAI's chat (same names, same meaning).
fn copy_fields(from: &Map<String, Value>, to: &mut Map<String, Value>, keys: &[&str]) {
    for k in keys {
        if let Some(v) = from.get(*k) {
            to.insert((*k).into(), v.clone());
        }
    }
}

/// An Anthropic text block list (or string) as text; other block types are refused.
fn anthropic_text(v: &Value, param: &str) -> Result<String, RequestError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(b.get("text").and_then(Value::as_str).unwrap_or_default().to_owned()),
                    other => return Err(RequestError::on(param, format!("{param}: blocks of type {} are not supported here (text only)", other.map_or("(none)".into(), |t| format!("`{t}`"))))),
                }
            }
            Ok(parts.join("\n"))
        }
        other => Err(RequestError::on(param, format!("{param} must be a string or a list of text blocks, got {}", kind_of(other)))),
    }
}

/// Anthropic's Messages API body as an OpenAI chat body.
///
/// `system` (text or text blocks) becomes the first message; `tool_use` blocks become the
/// assistant's `tool_calls` and `tool_result` blocks `tool` messages after it; `thinking`
/// blocks are dropped (the model did not write them for this template); `tools`'
/// `input_schema` becomes `parameters`; `tool_choice` `auto`/`any`/`tool`/`none` map to
/// OpenAI's; `stop_sequences` to `stop`; `max_tokens` (which Anthropic requires) defaults to
/// 4096 as llama-server's does; `output_config.format` (a JSON schema) becomes
/// `response_format`. Images and documents are refused: no Tine model reads them.
pub fn anthropic_to_chat(body: &[u8]) -> Result<Value, RequestError> {
    let b = object_body(body)?;
    let mut messages = Vec::new();
    if let Some(system) = field(&b, "system") {
        messages.push(json!({"role": "system", "content": anthropic_text(system, "system")?}));
    }
    let list = match field(&b, "messages") {
        Some(Value::Array(l)) => l,
        Some(other) => return Err(RequestError::on("messages", format!("messages must be a list, got {}", kind_of(other)))),
        None => return Err(RequestError::on("messages", "`messages` is required")),
    };
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| RequestError::on("messages", format!("messages[{i}]: `role` must be \"user\" or \"assistant\"")))?;
        if role != "user" && role != "assistant" {
            return Err(RequestError::on("messages", format!("messages[{i}]: role {role:?} is not one of \"user\", \"assistant\" (the system prompt is the `system` field)")));
        }
        let blocks = match m.get("content") {
            Some(Value::String(s)) => {
                messages.push(json!({"role": role, "content": s}));
                continue;
            }
            Some(Value::Array(blocks)) => blocks,
            _ => return Err(RequestError::on("messages", format!("messages[{i}]: `content` must be a string or a list of content blocks"))),
        };
        let (mut text, mut calls, mut results) = (Vec::new(), Vec::new(), Vec::new());
        for block in blocks {
            match block.get("type").and_then(Value::as_str).unwrap_or_default() {
                "text" => text.push(block.get("text").and_then(Value::as_str).unwrap_or_default().to_owned()),
                "thinking" | "redacted_thinking" => {}
                "tool_use" => {
                    let name = block.get("name").and_then(Value::as_str).ok_or_else(|| RequestError::on("messages", format!("messages[{i}]: a tool_use block needs `name`")))?;
                    let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                    calls.push(json!({"id": block.get("id").cloned().unwrap_or(Value::Null), "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
                }
                "tool_result" => {
                    let content = match block.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(c) => anthropic_text(c, "messages")?,
                    };
                    let content = if block.get("is_error").and_then(Value::as_bool) == Some(true) { format!("Error: {content}") } else { content };
                    results.push(json!({"role": "tool", "tool_call_id": block.get("tool_use_id").cloned().unwrap_or(Value::Null), "content": content}));
                }
                other => {
                    return Err(RequestError::on("messages", format!("messages[{i}]: content blocks of type `{other}` are not supported: this model reads text (and tool use) only")));
                }
            }
        }
        // Tool results answer the calls before them, ahead of the user's own words.
        messages.extend(results);
        if !text.is_empty() || !calls.is_empty() {
            let mut msg = json!({"role": role, "content": text.join("\n")});
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls);
            }
            messages.push(msg);
        }
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = field(&b, "tools") {
        let tools = tools.as_array().ok_or_else(|| RequestError::on("tools", "tools must be a list"))?;
        let converted: Vec<Value> = tools
            .iter()
            .map(|t| {
                // Anthropic's server tools (web search, code execution, ...) run on Anthropic's
                // side; a client tool has no type or `custom`.
                if let Some(kind) = t.get("type").and_then(Value::as_str).filter(|k| *k != "custom") {
                    return Err(RequestError::on("tools", format!("tools: `{kind}` is a server tool, which runs on Anthropic's side; only client tools (with `input_schema`) are served")));
                }
                let name = t.get("name").and_then(Value::as_str).ok_or_else(|| RequestError::on("tools", "tools: every tool needs `name`"))?;
                let mut f = json!({"name": name, "parameters": t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"}))});
                if let Some(d) = t.get("description") {
                    f["description"] = d.clone();
                }
                Ok(json!({"type": "function", "function": f}))
            })
            .collect::<Result<_, RequestError>>()?;
        chat.insert("tools".into(), Value::Array(converted));
    }
    if let Some(tc) = field(&b, "tool_choice") {
        let choice = match tc.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                json!({"type": "function", "function": {"name": tc.get("name").and_then(Value::as_str).ok_or_else(|| RequestError::on("tool_choice", "tool_choice: type `tool` needs `name`"))?}})
            }
            _ => return Err(RequestError::on("tool_choice", "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\"")),
        };
        chat.insert("tool_choice".into(), choice);
        if let Some(d) = tc.get("disable_parallel_tool_use").and_then(Value::as_bool) {
            chat.insert("parallel_tool_calls".into(), json!(!d));
        }
    }
    if let Some(stop) = field(&b, "stop_sequences") {
        chat.insert("stop".into(), stop.clone());
    }
    // Structured output: `output_config.format` `{"type": "json_schema", "schema": ...}`.
    if let Some(format) = field(&b, "output_config").and_then(|o| o.get("format")).filter(|f| !f.is_null()) {
        match (format.get("type").and_then(Value::as_str), format.get("schema")) {
            (Some("json_schema"), Some(schema)) => {
                chat.insert("response_format".into(), json!({"type": "json_schema", "json_schema": {"schema": schema}}));
            }
            _ => return Err(RequestError::on("output_config.format", "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")),
        }
    }
    chat.insert("max_tokens".into(), field(&b, "max_tokens").cloned().unwrap_or(json!(4096)));
    copy_fields(&b, &mut chat, &["temperature", "top_p", "top_k", "stream"]);
    copy_fields(&b, &mut chat, LLAMA_EXTRAS);
    // Extended thinking: `enabled` / `disabled` become the template's `enable_thinking` (a
    // budget is not enforced: the model thinks until it closes its reasoning).
    if let Some(t) = field(&b, "thinking") {
        let on = match t.get("type").and_then(Value::as_str) {
            Some("enabled") | Some("adaptive") => true,
            Some("disabled") => false,
            _ => return Err(RequestError::on("thinking", "thinking.type must be \"enabled\", \"adaptive\" or \"disabled\"")),
        };
        template_kwarg(&mut chat, "enable_thinking", json!(on));
    }
    Ok(Value::Object(chat))
}

/// Text parts of a Responses message (`input_text`, `output_text`, or a string) as text.
fn responses_text(item: &Value, i: usize) -> Result<String, RequestError> {
    match item.get("content") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = Vec::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str).unwrap_or_default() {
                    "input_text" | "output_text" | "text" => {
                        out.push(p.get("text").and_then(Value::as_str).ok_or_else(|| RequestError::on("input", format!("input[{i}]: a text part needs `text`")))?.to_owned())
                    }
                    "refusal" => out.push(p.get("refusal").and_then(Value::as_str).unwrap_or_default().to_owned()),
                    other => return Err(RequestError::on("input", format!("input[{i}]: content parts of type `{other}` are not supported: this model reads text only"))),
                }
            }
            Ok(out.join("\n"))
        }
        _ => Err(RequestError::on("input", format!("input[{i}]: `content` must be a string or a list of parts"))),
    }
}

/// OpenAI's Responses API body as an OpenAI chat body.
///
/// `instructions` becomes the system message; `input` (a string, or items: messages,
/// `function_call` and `function_call_output`, `reasoning` dropped) becomes the messages, a
/// call joining the assistant message before it; function `tools` are flattened back into
/// chat's shape (other tool types, which run on OpenAI's side, are refused);
/// `max_output_tokens` becomes `max_tokens` and `text.format` `response_format`. Responses
/// are not stored, so `previous_response_id` is refused (as llama-server does).
pub fn responses_to_chat(body: &[u8]) -> Result<Value, RequestError> {
    let b = object_body(body)?;
    if field(&b, "previous_response_id").is_some() {
        return Err(RequestError::on("previous_response_id", "previous_response_id: responses are not stored; send the whole conversation in `input`"));
    }
    if field(&b, "conversation").is_some() {
        return Err(RequestError::on("conversation", "conversation: conversations are not stored; send the whole conversation in `input`"));
    }
    if field(&b, "background").and_then(Value::as_bool) == Some(true) {
        return Err(RequestError::on("background", "background: responses run in the foreground only (they are not stored to fetch later)"));
    }
    let mut messages: Vec<Value> = Vec::new();
    if let Some(ins) = field(&b, "instructions") {
        let text = ins.as_str().ok_or_else(|| RequestError::on("instructions", "instructions must be a string"))?;
        messages.push(json!({"role": "system", "content": text}));
    }
    match field(&b, "input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
                let after_assistant = messages.last().is_some_and(|m| m["role"] == "assistant");
                match kind {
                    "message" => {
                        let role = item.get("role").and_then(Value::as_str).ok_or_else(|| RequestError::on("input", format!("input[{i}]: a message needs `role`")))?;
                        let role = match role {
                            "developer" => "system",
                            "user" | "system" | "assistant" => role,
                            other => return Err(RequestError::on("input", format!("input[{i}]: role {other:?} is not one of user, assistant, system, developer"))),
                        };
                        let text = responses_text(item, i)?;
                        if role == "assistant" && after_assistant && messages.last().is_some_and(|m| m.get("tool_calls").is_none()) {
                            let last = messages.last_mut().expect("checked: a last message");
                            let joined = [last["content"].as_str().unwrap_or_default(), &text].iter().filter(|t| !t.is_empty()).copied().collect::<Vec<_>>().join("\n");
                            last["content"] = json!(joined);
                        } else {
                            messages.push(json!({"role": role, "content": text}));
                        }
                    }
                    "function_call" => {
                        let get = |k: &str| item.get(k).and_then(Value::as_str).ok_or_else(|| RequestError::on("input", format!("input[{i}]: a function_call needs `{k}`")));
                        let call = json!({"id": get("call_id")?, "type": "function", "function": {"name": get("name")?, "arguments": get("arguments")?}});
                        if after_assistant {
                            let last = messages.last_mut().expect("checked: a last message");
                            match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                                Some(calls) => calls.push(call),
                                None => last["tool_calls"] = json!([call]),
                            }
                        } else {
                            messages.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}));
                        }
                    }
                    "function_call_output" => {
                        let id = item.get("call_id").and_then(Value::as_str).ok_or_else(|| RequestError::on("input", format!("input[{i}]: a function_call_output needs `call_id`")))?;
                        let output = match item.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(v @ Value::Array(_)) => responses_text(&json!({"content": v}), i)?,
                            _ => return Err(RequestError::on("input", format!("input[{i}]: a function_call_output needs `output`"))),
                        };
                        messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
                    }
                    "reasoning" => {}
                    other => return Err(RequestError::on("input", format!("input[{i}]: items of type `{other}` are not supported (message, function_call, function_call_output, reasoning)"))),
                }
            }
        }
        Some(other) => return Err(RequestError::on("input", format!("input must be a string or a list of items, got {}", kind_of(other)))),
        None => return Err(RequestError::on("input", "`input` is required")),
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = field(&b, "tools") {
        let tools = tools.as_array().ok_or_else(|| RequestError::on("tools", "tools must be a list"))?;
        let converted: Vec<Value> = tools
            .iter()
            .map(|t| match t.get("type").and_then(Value::as_str) {
                Some("function") => {
                    let mut f = t.as_object().cloned().unwrap_or_default();
                    f.remove("type");
                    Ok(json!({"type": "function", "function": f}))
                }
                other => Err(RequestError::on("tools", format!("tools: only function tools are served here, not {}", other.map_or("(no type)".into(), |t| format!("`{t}`"))))),
            })
            .collect::<Result<_, _>>()?;
        chat.insert("tools".into(), Value::Array(converted));
    }
    if let Some(tc) = field(&b, "tool_choice") {
        let choice = match tc {
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
                json!({"type": "function", "function": {"name": o.get("name").cloned().unwrap_or(Value::Null)}})
            }
            other => other.clone(),
        };
        chat.insert("tool_choice".into(), choice);
    }
    if let Some(max) = field(&b, "max_output_tokens") {
        chat.insert("max_tokens".into(), max.clone());
    }
    if let Some(format) = field(&b, "text").and_then(|t| t.get("format")).filter(|f| !f.is_null()) {
        let rf = match format.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(json!({"type": "json_object"})),
            Some("json_schema") => {
                let mut js = format.as_object().cloned().unwrap_or_default();
                js.remove("type");
                Some(json!({"type": "json_schema", "json_schema": js}))
            }
            _ => return Err(RequestError::on("text.format", "text.format.type must be \"text\", \"json_object\" or \"json_schema\"")),
        };
        if let Some(rf) = rf {
            chat.insert("response_format".into(), rf);
        }
    }
    copy_fields(&b, &mut chat, &["temperature", "top_p", "top_k", "stream", "parallel_tool_calls", "stop"]);
    copy_fields(&b, &mut chat, LLAMA_EXTRAS);
    // `reasoning.effort` reaches the template as `reasoning_effort` (llama-server's mapping).
    if let Some(effort) = field(&b, "reasoning").and_then(|r| r.get("effort")).filter(|e| !e.is_null()) {
        template_kwarg(&mut chat, "reasoning_effort", effort.clone());
    }
    Ok(Value::Object(chat))
}
