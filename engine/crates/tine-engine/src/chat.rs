//! Gemma chat turns: `<start_of_turn>user … <end_of_turn>`.

/// One chat message. Roles: `system`, `user`, `assistant` (written `model`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    #[error("unknown role {0:?} (expected system, user or assistant)")]
    UnknownRole(String),
    #[error("no messages")]
    Empty,
    /// Gemma 3's own template raises this.
    #[error("conversation roles must alternate user/assistant/user/assistant/... (message {0} breaks it)")]
    NotAlternating(usize),
}

/// Renders messages as Gemma 3's template does: the system prompt is prepended to the first
/// user turn, contents are trimmed, and an open `model` turn follows when `add_generation_prompt`.
/// The result starts with `<bos>`; tokenize it with special tokens parsed and without adding BOS again.
pub fn render_gemma(messages: &[Message], add_generation_prompt: bool) -> Result<String, ChatError> {
    if messages.is_empty() {
        return Err(ChatError::Empty);
    }
    let mut out = String::from("<bos>");
    let mut system: Option<String> = None;
    let mut first_user = true;
    // As Gemma 3's template: after the system prompt, turns alternate and the user starts.
    let mut turn = 0usize;
    for (i, m) in messages.iter().enumerate() {
        let content = m.content.trim();
        let is_user = match m.role.as_str() {
            "user" => Some(true),
            "assistant" | "model" => Some(false),
            _ => None,
        };
        if let Some(is_user) = is_user {
            if is_user != turn.is_multiple_of(2) {
                return Err(ChatError::NotAlternating(i));
            }
            turn += 1;
        }
        match m.role.as_str() {
            "system" => {
                system = Some(match system {
                    Some(s) => format!("{s}\n\n{content}"),
                    None => content.to_owned(),
                })
            }
            "user" => {
                out.push_str("<start_of_turn>user\n");
                if first_user {
                    if let Some(s) = system.take() {
                        out.push_str(&s);
                        out.push_str("\n\n");
                    }
                    first_user = false;
                }
                out.push_str(content);
                out.push_str("<end_of_turn>\n");
            }
            "assistant" | "model" => {
                out.push_str("<start_of_turn>model\n");
                out.push_str(content);
                out.push_str("<end_of_turn>\n");
            }
            other => return Err(ChatError::UnknownRole(other.to_owned())),
        }
    }
    if add_generation_prompt {
        out.push_str("<start_of_turn>model\n");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }

    #[test]
    fn renders_gemma_turns_with_system_folded_into_the_first_user_turn() {
        let got = render_gemma(&[m("system", "Be brief."), m("user", " Hi! "), m("assistant", "Hello."), m("user", "Bye")], true).expect("valid");
        assert_eq!(got, "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
        assert_eq!(render_gemma(&[m("tool", "x")], true), Err(ChatError::UnknownRole("tool".into())));
        assert_eq!(render_gemma(&[m("user", "a"), m("assistant", "b"), m("assistant", "c")], true), Err(ChatError::NotAlternating(2)));
        assert_eq!(render_gemma(&[m("system", "s"), m("assistant", "b")], true), Err(ChatError::NotAlternating(1)));
    }
}
