//! A chat's reply read for what it holds: reasoning (`<think>…</think>`, when the request's
//! `reasoning_format` returns it apart), the answer, and tool calls (in the syntax the request's
//! tools take). Every dialect (OpenAI chat, Anthropic, Responses) reads its replies here, whole
//! or as they stream, so a streamed reply and a whole one agree.

use tine_engine::reasoning::{ReasoningDelta, ReasoningStream};

use super::*;

/// How a chat's replies are read.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ReplyFormat {
    /// Reasoning returned apart; `true` when the prompt left the tag open (forced open).
    pub(crate) reasoning: Option<bool>,
    pub(crate) tools: Option<ToolSyntax>,
}

/// A piece of a reply.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Piece {
    Reasoning(String),
    Content(String),
    Call(ToolCall),
}

pub(crate) struct ReplyReader {
    reasoning: Option<ReasoningStream>,
    tools: Option<ToolStream>,
}

impl ReplyReader {
    pub(crate) fn new(f: ReplyFormat) -> ReplyReader {
        ReplyReader { reasoning: f.reasoning.map(ReasoningStream::new), tools: f.tools.map(ToolStream::new) }
    }

    pub(crate) fn feed(&mut self, text: &str) -> Vec<Piece> {
        let parts = match self.reasoning.as_mut() {
            Some(r) => r.feed(text),
            None => vec![ReasoningDelta::Content(text.to_owned())],
        };
        self.answer(parts)
    }

    pub(crate) fn finish(mut self) -> Vec<Piece> {
        let parts = self.reasoning.take().map(ReasoningStream::finish).unwrap_or_default();
        let mut out = self.answer(parts);
        if let Some(t) = self.tools.take() {
            out.extend(t.finish().into_iter().map(piece));
        }
        out
    }

    /// Reasoning as it is; the answer through the tool reader, if any.
    fn answer(&mut self, parts: Vec<ReasoningDelta>) -> Vec<Piece> {
        let mut out = Vec::new();
        for p in parts {
            match (p, self.tools.as_mut()) {
                (ReasoningDelta::Reasoning(t), _) => out.push(Piece::Reasoning(t)),
                (ReasoningDelta::Content(t), Some(tools)) => out.extend(tools.feed(&t).into_iter().map(piece)),
                (ReasoningDelta::Content(t), None) if !t.is_empty() => out.push(Piece::Content(t)),
                (ReasoningDelta::Content(_), None) => {}
            }
        }
        out
    }
}

fn piece(d: ToolDelta) -> Piece {
    match d {
        ToolDelta::Content(t) => Piece::Content(t),
        ToolDelta::Call(c) => Piece::Call(c),
    }
}

/// A whole reply read: (reasoning, answer, calls); the answer is trimmed when there are calls,
/// as [`split_tool_output`] trims it.
pub(crate) fn read_whole(f: ReplyFormat, text: &str) -> (String, String, Vec<ToolCall>) {
    let mut r = ReplyReader::new(f);
    let mut pieces = r.feed(text);
    pieces.extend(r.finish());
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    for p in pieces {
        match p {
            Piece::Reasoning(t) => reasoning.push_str(&t),
            Piece::Content(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    if !calls.is_empty() {
        content = content.trim().to_owned();
    }
    (reasoning, content, calls)
}
