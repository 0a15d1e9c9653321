//! A reply's reasoning (`<think>…</think>`, as DeepSeek-R1 and Qwen3/3.5 templates write it)
//! told apart from its answer, whole or as it streams: llama-server's `reasoning_format:
//! deepseek`, which returns the thoughts as `reasoning_content`.
//!
//! The reasoning is the text inside the tags at the start of the reply, or, when the template
//! opened the tag itself (the prompt ends with `<think>`: "thinking forced open"), the text up
//! to `</think>`. Whitespace around the reasoning and at the start of the answer is dropped, as
//! llama.cpp trims them. A reply that does not start with the tag is all answer.

/// The opening and closing tags.
pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// A piece of a reply: reasoning or answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningDelta {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the reply shows whether it opens with the tag.
    Start,
    Reasoning,
    /// Right after the closing tag: leading whitespace is dropped.
    AfterClose,
    Content,
}

/// Splits a reply into reasoning and answer as it is generated.
#[derive(Debug, Clone)]
pub struct ReasoningStream {
    state: State,
    pending: String,
    /// Reasoning's trailing whitespace, held back: dropped if the closing tag follows.
    held: String,
    /// Whether any reasoning was given out yet (its leading whitespace is dropped).
    started: bool,
}

impl ReasoningStream {
    /// `forced_open`: the prompt ends with the opening tag, so the reply starts inside it.
    pub fn new(forced_open: bool) -> ReasoningStream {
        ReasoningStream { state: if forced_open { State::Reasoning } else { State::Start }, pending: String::new(), held: String::new(), started: false }
    }

    pub fn feed(&mut self, text: &str) -> Vec<ReasoningDelta> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        self.step(&mut out, false);
        out
    }

    pub fn finish(mut self) -> Vec<ReasoningDelta> {
        let mut out = Vec::new();
        self.step(&mut out, true);
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::Start | State::Content => push(&mut out, ReasoningDelta::Content(rest)),
            State::AfterClose => push(&mut out, ReasoningDelta::Content(rest.trim_start().to_owned())),
            // An unclosed reasoning (cut by the token limit) is reasoning still.
            State::Reasoning => self.reason(&mut out, &rest),
        }
        out
    }

    fn step(&mut self, out: &mut Vec<ReasoningDelta>, at_end: bool) {
        loop {
            match self.state {
                State::Start => {
                    let t = self.pending.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                        self.pending = rest.to_owned();
                        self.state = State::Reasoning;
                    } else if !at_end && (t.is_empty() || THINK_OPEN.starts_with(t)) {
                        return;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => {
                    if let Some(i) = self.pending.find(THINK_CLOSE) {
                        let inside = self.pending[..i].to_owned();
                        self.pending.drain(..i + THINK_CLOSE.len());
                        self.reason(out, &inside);
                        self.held.clear();
                        self.state = State::AfterClose;
                        continue;
                    }
                    if at_end {
                        return;
                    }
                    let now: String = self.pending.drain(..crate::tool_calls::safe_len(&self.pending, THINK_CLOSE)).collect();
                    self.reason(out, &now);
                    return;
                }
                State::AfterClose => {
                    let t = self.pending.trim_start();
                    if t.is_empty() {
                        self.pending.clear();
                        return;
                    }
                    self.pending = t.to_owned();
                    self.state = State::Content;
                }
                State::Content => {
                    let all = std::mem::take(&mut self.pending);
                    push(out, ReasoningDelta::Content(all));
                    return;
                }
            }
        }
    }

    /// Gives out reasoning: leading whitespace of the whole dropped, trailing held back.
    fn reason(&mut self, out: &mut Vec<ReasoningDelta>, text: &str) {
        let text = if self.started { text } else { text.trim_start() };
        if text.is_empty() {
            return;
        }
        let body = text.trim_end();
        if body.is_empty() {
            self.held.push_str(text);
            return;
        }
        self.started = true;
        let held = std::mem::take(&mut self.held);
        push(out, ReasoningDelta::Reasoning(held + body));
        self.held.push_str(&text[body.len()..]);
    }
}

fn push(out: &mut Vec<ReasoningDelta>, d: ReasoningDelta) {
    match &d {
        ReasoningDelta::Reasoning(t) | ReasoningDelta::Content(t) if t.is_empty() => {}
        _ => out.push(d),
    }
}

/// A whole reply split into (reasoning, answer), as [`ReasoningStream`] splits it streamed.
pub fn split_reasoning(text: &str, forced_open: bool) -> (String, String) {
    let mut s = ReasoningStream::new(forced_open);
    let mut deltas = s.feed(text);
    deltas.extend(s.finish());
    let (mut reasoning, mut content) = (String::new(), String::new());
    for d in deltas {
        match d {
            ReasoningDelta::Reasoning(t) => reasoning.push_str(&t),
            ReasoningDelta::Content(t) => content.push_str(&t),
        }
    }
    (reasoning, content)
}

/// Whether a rendered prompt leaves the reasoning tag open for the reply (Qwen3.5's template
/// ends its generation prompt with `<think>\n` unless thinking is turned off).
pub fn forced_open(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_OPEN)
}
