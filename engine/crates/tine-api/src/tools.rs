//! Tools on a chat template that has no tool syntax of its own (one that never mentions
//! `tools`, as Gemma 3's): the generic JSON format.
//!
//! The model is told about the tools in a system message and answers with one JSON object:
//! `{"tool_call": {"name": ..., "arguments": {...}}}` (or `{"tool_calls": [...]}` when the
//! request allows parallel calls), or `{"response": "..."}` for a plain answer. A grammar built
//! from the tools' schemas holds the output to those shapes, so a call is always well formed.
//! The conversation's earlier calls and tool results are rewritten into that format too
//! (an assistant turn holding the call's JSON; a user turn holding `{"tool_response": ...}`),
//! so a template that knows only user, assistant and system turns can render them. This is
//! llama.cpp's generic tool format (`common/chat.cpp` before its automatic parser), in our words.

use serde_json::{json, Map, Value};

use crate::RequestError;

/// How a chat request's tools reach the model and how its output is read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolMode {
    /// No tools (none sent, or `tool_choice: "none"`): the output is plain content.
    None,
    /// The template describes the tools and the output is read in its family's call syntax.
    Native,
    /// `tool_choice` forces a call on a template with a tool syntax: the output is held to a
    /// bare `{"name": ..., "arguments": ...}` object and read as that call.
    NativeForced,
    /// The template has no tool syntax: the generic JSON format of this module.
    Generic,
}

/// The tools' `function` objects, each with a `name`.
pub(crate) fn functions(tools: &[Value]) -> Result<Vec<&Map<String, Value>>, RequestError> {
    tools
        .iter()
        .map(|t| {
            let f = t.get("function").and_then(Value::as_object).ok_or_else(|| RequestError::on("tools", "tools: every tool is {\"type\": \"function\", \"function\": {\"name\": ...}}"))?;
            match f.get("name") {
                Some(Value::String(n)) if !n.is_empty() => Ok(f),
                _ => Err(RequestError::on("tools", "tools: every tool needs `function.name`")),
            }
        })
        .collect()
}

/// The JSON schema of one call to `f`: `{"name": <its name>, "arguments": <its parameters>}`.
/// Objects in the parameters that leave `additionalProperties` unset get none (as llama.cpp's
/// schema grammars read them, and OpenAI's strict mode): a call holds the keys its tool names.
pub(crate) fn call_schema(f: &Map<String, Value>) -> Value {
    let mut params = f.get("parameters").filter(|p| p.is_object()).cloned().unwrap_or_else(|| json!({"type": "object"}));
    close_objects(&mut params, 0);
    json!({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params}, "required": ["name", "arguments"], "additionalProperties": false})
}

/// Sets `additionalProperties: false` on the objects of a schema that list `properties` and
/// leave it unset (through `properties`, `items`, `anyOf`/`oneOf`/`allOf`, `$defs`; depth-bounded).
fn close_objects(schema: &mut Value, depth: usize) {
    let Some(o) = schema.as_object_mut().filter(|_| depth < 64) else { return };
    if o.contains_key("properties") && !o.contains_key("additionalProperties") {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ["properties", "$defs", "definitions"] {
        if let Some(Value::Object(m)) = o.get_mut(key) {
            m.values_mut().for_each(|v| close_objects(v, depth + 1));
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(Value::Array(a)) = o.get_mut(key) {
            a.iter_mut().for_each(|v| close_objects(v, depth + 1));
        }
    }
    if let Some(items) = o.get_mut("items") {
        close_objects(items, depth + 1);
    }
}

/// The system text that describes `tools` in the generic format.
fn instructions(tools: &[Value], required: bool, parallel: bool) -> Result<String, RequestError> {
    let mut text = String::from("You have access to the following tools:\n");
    for f in functions(tools)? {
        // Keys in this order whatever serde_json's map order is built with.
        let fields: Vec<String> = ["name", "description", "parameters"].iter().filter_map(|k| f.get(*k).map(|v| format!("\"{k}\":{v}"))).collect();
        text.push_str(&format!("{{{}}}\n", fields.join(",")));
    }
    text.push_str("\nRespond with one JSON object and nothing else. ");
    if parallel {
        text.push_str("To call tools: {\"tool_calls\":[{\"name\":\"<tool name>\",\"arguments\":{<arguments>}},...]}");
    } else {
        text.push_str("To call a tool: {\"tool_call\":{\"name\":\"<tool name>\",\"arguments\":{<arguments>}}}");
    }
    if required {
        text.push_str(". You must call a tool.");
    } else {
        text.push_str(". To answer the user directly: {\"response\":\"your answer\"}.");
    }
    Ok(text)
}

/// A schema of several tools' calls, with each tool's own definitions (`$defs`,
/// `definitions`) moved to the root under `tool{i}_` names and its `$ref`s rewritten to them:
/// a reference is resolved from the whole document's root, where a tool's parameters no
/// longer are.
pub(crate) fn calls_with_defs(tools: &[&Map<String, Value>]) -> (Vec<Value>, Map<String, Value>) {
    let mut defs = Map::new();
    let calls = tools
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let mut call = call_schema(f);
            let params = &mut call["properties"]["arguments"];
            let prefix = format!("tool{i}_");
            if let Some(p) = params.as_object_mut() {
                for key in ["$defs", "definitions"] {
                    if let Some(Value::Object(own)) = p.remove(key) {
                        for (name, mut d) in own {
                            rewrite_refs(&mut d, &prefix, 0);
                            defs.insert(format!("{prefix}{name}"), d);
                        }
                    }
                }
            }
            rewrite_refs(params, &prefix, 0);
            call
        })
        .collect();
    (calls, defs)
}

/// `#/$defs/X` and `#/definitions/X` become `#/$defs/{prefix}X` everywhere in `v` (depth-bounded).
fn rewrite_refs(v: &mut Value, prefix: &str, depth: usize) {
    if depth > 64 {
        return;
    }
    match v {
        Value::Object(o) => {
            if let Some(Value::String(r)) = o.get_mut("$ref") {
                if let Some(name) = r.strip_prefix("#/$defs/").or_else(|| r.strip_prefix("#/definitions/")) {
                    *r = format!("#/$defs/{prefix}{name}");
                }
            }
            o.values_mut().for_each(|x| rewrite_refs(x, prefix, depth + 1));
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rewrite_refs(x, prefix, depth + 1)),
        _ => {}
    }
}

/// The JSON schema the output follows in the generic format: a call to one of `allowed`
/// (several with `parallel`), or, unless a call is `required`, a plain response.
pub(crate) fn output_schema(allowed: &[Value], required: bool, parallel: bool) -> Result<Value, RequestError> {
    let (calls, defs) = calls_with_defs(&functions(allowed)?);
    let call = json!({"anyOf": calls});
    let mut forms = vec![if parallel {
        json!({"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}}, "required": ["tool_calls"], "additionalProperties": false})
    } else {
        json!({"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"], "additionalProperties": false})
    }];
    if !required {
        forms.push(json!({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"], "additionalProperties": false}));
    }
    let mut schema = json!({"anyOf": forms});
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    Ok(compact(schema))
}

/// A tool format's schema, held to compact JSON (no whitespace between tokens): the format is
/// ours, and a small model given the freedom can spend its whole budget on whitespace.
pub(crate) fn compact(mut schema: Value) -> Value {
    schema["x-guidance"] = json!({"whitespace_flexible": false});
    schema
}

/// A call's arguments as a JSON value (OpenAI sends them as a JSON text; a text that does not
/// parse is kept as a string).
fn arguments_value(call: &Value) -> Value {
    match call.get("function").and_then(|f| f.get("arguments")) {
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        Some(other) => other.clone(),
        None => json!({}),
    }
}

/// The conversation rewritten for a template without tool syntax: `tools` (unless `None`)
/// described in the first system message, assistant calls as the format's JSON, tool results
/// as user turns of `{"tool_response": {"tool": ..., "content": ...}}` (consecutive results and
/// a user message right after them joined into one user turn, so turns still alternate).
/// Messages are template values (`role`, `content` as text, the client's other fields).
pub fn rewrite_for_generic(messages: Vec<Value>, tools: Option<&[Value]>, required: bool, parallel: bool) -> Result<Vec<Value>, RequestError> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    // Call ids to tool names, for results that name only the id.
    let mut names: Vec<(String, String)> = Vec::new();
    // Whether the last message in `out` is a user turn made from a tool result.
    let mut after_result = false;
    for m in messages {
        let role = m["role"].as_str().unwrap_or_default().to_owned();
        let content = m["content"].as_str().unwrap_or_default().to_owned();
        match role.as_str() {
            "assistant" if m.get("tool_calls").and_then(Value::as_array).is_some_and(|c| !c.is_empty()) => {
                let calls = m["tool_calls"].as_array().expect("checked: an array");
                let mut list = Vec::new();
                for c in calls {
                    let name = c.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).ok_or_else(|| RequestError::on("messages", "messages: every tool call needs `function.name`"))?;
                    if let Some(id) = c.get("id").and_then(Value::as_str) {
                        names.push((id.to_owned(), name.to_owned()));
                    }
                    // Written as the model is asked to write a call, `name` first.
                    list.push(format!("{{\"name\":{},\"arguments\":{}}}", Value::from(name), arguments_value(c)));
                }
                let call = if list.len() == 1 && !parallel { format!("{{\"tool_call\":{}}}", list[0]) } else { format!("{{\"tool_calls\":[{}]}}", list.join(",")) };
                let text = if content.trim().is_empty() { call } else { format!("{content}\n{call}") };
                out.push(json!({"role": "assistant", "content": text}));
                after_result = false;
            }
            "tool" | "function" => {
                let id = m.get("tool_call_id").and_then(Value::as_str);
                let name = m.get("name").and_then(Value::as_str).map(str::to_owned).or_else(|| id.and_then(|id| names.iter().rev().find(|(i, _)| i == id).map(|(_, n)| n.clone())));
                let mut fields = Vec::new();
                if let Some(name) = name {
                    fields.push(format!("\"tool\":{}", Value::from(name)));
                }
                if let Some(id) = id {
                    fields.push(format!("\"tool_call_id\":{}", Value::from(id)));
                }
                fields.push(format!("\"content\":{}", Value::from(content)));
                let text = format!("{{\"tool_response\":{{{}}}}}", fields.join(","));
                push_user(&mut out, text, after_result);
                after_result = true;
            }
            "user" if after_result => {
                push_user(&mut out, content, true);
                after_result = false;
            }
            _ => {
                let mut m = m;
                if let Some(o) = m.as_object_mut() {
                    o.remove("tool_calls");
                }
                out.push(m);
                after_result = false;
            }
        }
    }
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        let text = instructions(tools, required, parallel)?;
        match out.first_mut() {
            Some(first) if first["role"] == "system" => {
                let own = first["content"].as_str().unwrap_or_default();
                first["content"] = Value::String(if own.trim().is_empty() { text } else { format!("{own}\n\n{text}") });
            }
            _ => out.insert(0, json!({"role": "system", "content": text})),
        }
    }
    Ok(out)
}

/// Appends a user turn, joined to the previous one when that was a tool result.
fn push_user(out: &mut Vec<Value>, text: String, join: bool) {
    if join {
        if let Some(last) = out.last_mut().filter(|l| l["role"] == "user") {
            let joined = format!("{}\n{text}", last["content"].as_str().unwrap_or_default());
            last["content"] = Value::String(joined);
            return;
        }
    }
    out.push(json!({"role": "user", "content": text}));
}
