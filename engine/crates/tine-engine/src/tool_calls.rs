//! Tool calls read back from a model's output, whole or as it streams.
//!
//! [`ToolStream`] takes the output piece by piece and gives back content as soon as it cannot
//! be the start of a call, and each call once it is complete; [`split_tool_output`] is the
//! same reader over a whole text, so a streamed answer and a whole one agree. Text that looks
//! like a call but does not parse is content, never dropped.

use serde_json::{json, Value};

/// How a template family writes a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// `<tool_call>{"name": …, "arguments": …}</tool_call>` (Hermes, Qwen).
    Hermes,
    /// `[TOOL_CALLS][{"name": …, "arguments": …}]` (Mistral).
    Mistral,
    /// A bare JSON object `{"name": …, "parameters": …}`, maybe after `<|python_tag|>` (Llama 3.x).
    JsonObject,
    /// The generic format of templates without a tool syntax: one JSON object,
    /// `{"tool_call": {…}}`, `{"tool_calls": […]}` or `{"response": "…"}` (tine-api's `tools`).
    Generic,
}

/// A tool call parsed from the model's output, in OpenAI's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON text (OpenAI sends a string).
    pub arguments: String,
}

/// A piece of a reply read for tool calls.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolDelta {
    Content(String),
    Call(ToolCall),
}

fn call_from(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_owned();
    let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or(json!({}));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// Calls from a JSON text: one call object, or a list of them.
fn calls_from(text: &str) -> Option<Vec<ToolCall>> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    let calls: Vec<ToolCall> = match &v {
        Value::Array(items) => items.iter().map(call_from).collect::<Option<_>>()?,
        obj => vec![call_from(obj)?],
    };
    (!calls.is_empty()).then_some(calls)
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_MARK: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Content that may hold a call marker (Hermes, Mistral).
    Content,
    /// Content that can hold no call (the output did not start as one).
    Plain,
    /// The start, before it is known whether the output is a call (JSON object, generic).
    Undecided,
    /// Inside `<tool_call>`, waiting for its end.
    InCall,
    /// A call that runs to the end of the output, read at the end.
    Tail,
    /// The generic format's `response` string, decoded as it comes.
    Response,
    /// After the generic format's response string: the closing brace.
    Closed,
}

/// Reads a reply for tool calls as it is generated.
#[derive(Debug, Clone)]
pub struct ToolStream {
    syntax: ToolSyntax,
    state: State,
    /// Text taken in and not yet given out.
    pending: String,
    /// Content's trailing whitespace, held back: it is dropped if a call follows.
    held: String,
    calls: usize,
    /// Whether any content was given out yet (the reply's leading whitespace is dropped).
    started: bool,
}

impl ToolStream {
    pub fn new(syntax: ToolSyntax) -> ToolStream {
        let state = match syntax {
            ToolSyntax::Hermes | ToolSyntax::Mistral => State::Content,
            ToolSyntax::JsonObject | ToolSyntax::Generic => State::Undecided,
        };
        ToolStream { syntax, state, pending: String::new(), held: String::new(), calls: 0, started: false }
    }

    /// Takes the next piece of the reply; returns what can be given out now.
    pub fn feed(&mut self, text: &str) -> Vec<ToolDelta> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        self.step(&mut out, false);
        out
    }

    /// The reply has ended: returns the rest.
    pub fn finish(mut self) -> Vec<ToolDelta> {
        let mut out = Vec::new();
        self.step(&mut out, true);
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::Content | State::Plain | State::Undecided => self.content(&mut out, &rest),
            State::InCall => match calls_from(&rest) {
                Some(calls) => self.emit_calls(&mut out, calls),
                None => self.content(&mut out, &format!("{HERMES_OPEN}{rest}")),
            },
            State::Tail => self.read_tail(&mut out, &rest),
            State::Response | State::Closed => {}
        }
        if self.calls == 0 && !self.held.is_empty() {
            out.push(ToolDelta::Content(std::mem::take(&mut self.held)));
        }
        out
    }

    fn step(&mut self, out: &mut Vec<ToolDelta>, at_end: bool) {
        loop {
            match self.state {
                State::Plain => {
                    let all = std::mem::take(&mut self.pending);
                    self.content(out, &all);
                    return;
                }
                State::Content => {
                    let marker = if self.syntax == ToolSyntax::Hermes { HERMES_OPEN } else { MISTRAL_MARK };
                    if let Some(i) = self.pending.find(marker) {
                        let before = self.pending[..i].to_owned();
                        self.content(out, &before);
                        self.pending.drain(..i + marker.len());
                        self.state = if self.syntax == ToolSyntax::Hermes { State::InCall } else { State::Tail };
                        continue;
                    }
                    if at_end {
                        return;
                    }
                    // Give out all but a tail that may be the marker's beginning.
                    let now: String = self.pending.drain(..safe_len(&self.pending, marker)).collect();
                    self.content(out, &now);
                    return;
                }
                State::InCall => {
                    let Some(i) = self.pending.find(HERMES_CLOSE) else { return };
                    let body = self.pending[..i].to_owned();
                    self.pending.drain(..i + HERMES_CLOSE.len());
                    match calls_from(&body) {
                        Some(calls) => self.emit_calls(out, calls),
                        None => self.content(out, &format!("{HERMES_OPEN}{body}{HERMES_CLOSE}")),
                    }
                    self.state = State::Content;
                }
                State::Undecided => {
                    let start = self.pending.trim_start();
                    if start.is_empty() {
                        return;
                    }
                    let decided = match self.syntax {
                        ToolSyntax::Generic => match response_prefix(&self.pending) {
                            Prefix::Yes(n) => {
                                self.pending.drain(..n);
                                Some(State::Response)
                            }
                            Prefix::Maybe if !at_end => None,
                            Prefix::Maybe | Prefix::No => Some(State::Tail),
                        },
                        _ => {
                            if start.starts_with('{') || start.starts_with(PYTHON_TAG) {
                                Some(State::Tail)
                            } else if PYTHON_TAG.starts_with(start) && !at_end {
                                None
                            } else {
                                Some(State::Plain)
                            }
                        }
                    };
                    match decided {
                        Some(s) => self.state = s,
                        None => return,
                    }
                }
                State::Tail => return,
                State::Response => {
                    let (text, used, closed) = decode_json_string(&self.pending);
                    self.pending.drain(..used);
                    if !text.is_empty() {
                        // The answer itself, exactly: no whitespace held back.
                        let held = std::mem::take(&mut self.held);
                        out.push(ToolDelta::Content(held + &text));
                    }
                    if !closed {
                        return;
                    }
                    self.state = State::Closed;
                }
                State::Closed => {
                    self.pending.clear();
                    return;
                }
            }
        }
    }

    /// Reads a call that ran to the end of the reply; text that is no call is content.
    fn read_tail(&mut self, out: &mut Vec<ToolDelta>, rest: &str) {
        let calls = match self.syntax {
            ToolSyntax::Generic => match serde_json::from_str::<Value>(rest.trim()) {
                Ok(v) => {
                    if let Some(c) = v.get("tool_call").and_then(call_from) {
                        Some(vec![c])
                    } else if let Some(list) = v.get("tool_calls").and_then(Value::as_array) {
                        list.iter().map(call_from).collect::<Option<Vec<_>>>().filter(|c| !c.is_empty())
                    } else if let Some(Value::String(r)) = v.get("response") {
                        self.content(out, r);
                        return;
                    } else {
                        None
                    }
                }
                Err(_) => None,
            },
            ToolSyntax::JsonObject => {
                let body = rest.trim();
                calls_from(body.strip_prefix(PYTHON_TAG).unwrap_or(body)).filter(|c| c.len() == 1)
            }
            ToolSyntax::Mistral | ToolSyntax::Hermes => calls_from(rest),
        };
        match calls {
            Some(calls) => self.emit_calls(out, calls),
            None => {
                let raw = if self.syntax == ToolSyntax::Mistral { format!("{MISTRAL_MARK}{rest}") } else { rest.to_owned() };
                self.content(out, &raw)
            }
        }
    }

    fn emit_calls(&mut self, out: &mut Vec<ToolDelta>, calls: Vec<ToolCall>) {
        self.held.clear();
        self.calls += calls.len();
        out.extend(calls.into_iter().map(ToolDelta::Call));
    }

    /// Gives out content, holding back its trailing whitespace (a call may follow it); the
    /// reply's leading whitespace is dropped, so a streamed reply reads as the whole one.
    fn content(&mut self, out: &mut Vec<ToolDelta>, text: &str) {
        let text = if self.started { text } else { text.trim_start() };
        if text.is_empty() {
            return;
        }
        self.started = true;
        let body = text.trim_end();
        if body.is_empty() {
            self.held.push_str(text);
            return;
        }
        let held = std::mem::take(&mut self.held);
        out.push(ToolDelta::Content(held + body));
        self.held.push_str(&text[body.len()..]);
    }
}

/// How much of `pending` can be given out: all but its longest tail that is a proper
/// beginning of `marker` (the marker itself was looked for first).
pub(crate) fn safe_len(pending: &str, marker: &str) -> usize {
    let keep = (1..marker.len().min(pending.len() + 1)).rev().find(|&k| pending.is_char_boundary(pending.len() - k) && marker.starts_with(&pending[pending.len() - k..])).unwrap_or(0);
    pending.len() - keep
}

enum Prefix {
    /// The text starts `{"response": "`, this many bytes long.
    Yes(usize),
    Maybe,
    No,
}

/// Whether `text` starts with `{ "response" : "` (JSON whitespace anywhere between).
fn response_prefix(text: &str) -> Prefix {
    let mut rest = text;
    for token in ["{", "\"response\"", ":", "\""] {
        rest = rest.trim_start_matches([' ', '\t', '\n', '\r']);
        if rest.is_empty() {
            return Prefix::Maybe;
        }
        if let Some(r) = rest.strip_prefix(token) {
            rest = r;
        } else if token.starts_with(rest) {
            return Prefix::Maybe;
        } else {
            return Prefix::No;
        }
    }
    Prefix::Yes(text.len() - rest.len())
}

/// Decodes the inside of a JSON string from its start: returns the text, the bytes used, and
/// whether the closing quote was reached. An escape cut off at the end is left unused.
fn decode_json_string(s: &str) -> (String, usize, bool) {
    let mut out = String::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => return (out, i + 1, true),
            b'\\' => {
                let Some(&e) = b.get(i + 1) else { break };
                let simple = match e {
                    b'"' => Some('"'),
                    b'\\' => Some('\\'),
                    b'/' => Some('/'),
                    b'b' => Some('\u{8}'),
                    b'f' => Some('\u{c}'),
                    b'n' => Some('\n'),
                    b'r' => Some('\r'),
                    b't' => Some('\t'),
                    _ => None,
                };
                if let Some(c) = simple {
                    out.push(c);
                    i += 2;
                    continue;
                }
                if e != b'u' {
                    // Not JSON: kept as written.
                    out.push('\\');
                    i += 1;
                    continue;
                }
                let Some(hi) = s.get(i + 2..i + 6).and_then(|h| u32::from_str_radix(h, 16).ok()) else {
                    if s.len() < i + 6 {
                        break;
                    }
                    out.push('\\');
                    i += 1;
                    continue;
                };
                if (0xD800..0xDC00).contains(&hi) {
                    // A surrogate pair: the low half follows as another `\uXXXX`.
                    if s.len() < i + 12 {
                        break;
                    }
                    let lo = s.get(i + 6..i + 8).filter(|p| *p == "\\u").and_then(|_| s.get(i + 8..i + 12)).and_then(|h| u32::from_str_radix(h, 16).ok());
                    match lo.filter(|lo| (0xDC00..0xE000).contains(lo)) {
                        Some(lo) => {
                            out.push(char::from_u32(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)).unwrap_or('\u{fffd}'));
                            i += 12;
                        }
                        None => {
                            out.push('\u{fffd}');
                            i += 6;
                        }
                    }
                } else {
                    out.push(char::from_u32(hi).unwrap_or('\u{fffd}'));
                    i += 6;
                }
            }
            _ => {
                // Up to the next quote or backslash, whole characters.
                let end = s[i..].find(['"', '\\']).map_or(s.len(), |k| i + k);
                out.push_str(&s[i..end]);
                i = end;
            }
        }
    }
    (out, i, false)
}

/// A whole reply read for tool calls: its content (trimmed when there are calls) and the
/// calls, as [`ToolStream`] gives them out piece by piece.
pub fn split_tool_output(syntax: ToolSyntax, text: &str) -> (String, Vec<ToolCall>) {
    let mut s = ToolStream::new(syntax);
    let mut deltas = s.feed(text);
    deltas.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for d in deltas {
        match d {
            ToolDelta::Content(c) => content.push_str(&c),
            ToolDelta::Call(c) => calls.push(c),
        }
    }
    if !calls.is_empty() {
        content = content.trim().to_owned();
    }
    (content, calls)
}

/// Splits generated text into its content and the tool calls `syntax` writes. `None` when the
/// text holds no well-formed call (it is then plain content; in the generic format, the
/// response's text is in [`split_tool_output`]).
pub fn parse_tool_calls(syntax: ToolSyntax, text: &str) -> Option<(String, Vec<ToolCall>)> {
    let (content, calls) = split_tool_output(syntax, text);
    (!calls.is_empty()).then_some((content, calls))
}
