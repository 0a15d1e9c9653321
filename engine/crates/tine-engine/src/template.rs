//! Chat templates: the GGUF's `tokenizer.chat_template` rendered with a Jinja engine built for
//! it (minijinja, with Python string methods), or Gemma's turns when a model has none.
//!
//! A template comes from a file a user was handed, so rendering is bounded (minijinja's fuel)
//! and every failure is an error, never a panic. Tool calls: the template gets `tools`; the
//! output is read back (`tool_calls`) for the families whose templates define a tool-call
//! syntax; templates without one get tine-api's generic format.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::{json, Value};

use crate::chat::{render_gemma, ChatError, Message};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TemplateError {
    #[error("the chat template does not parse: {0}")]
    Syntax(String),
    #[error("the chat template failed: {0}")]
    Render(String),
    #[error(transparent)]
    Chat(#[from] ChatError),
    #[error("cannot read the chat template {path}: {message}")]
    Read { path: String, message: String },
    #[error("this model's chat template does not take tools (it never mentions `tools`)")]
    NoTools,
}

pub use crate::tool_calls::{parse_tool_calls, split_tool_output, ToolCall, ToolDelta, ToolStream, ToolSyntax};

/// A chat template.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatTemplate {
    /// Gemma 3's turns, in Rust (the fallback for a GGUF without a template).
    Gemma,
    Jinja {
        name: String,
        source: String,
    },
}

/// llama.cpp's built-in templates Tine knows by name (`--chat-template NAME`), as Jinja that
/// renders what llama.cpp's C++ renders for them (`src/llama-chat.cpp`): `gemma` is Tine's own
/// Rust renderer.
pub const NAMED: &[(&str, &str)] = &[
    ("chatml", CHATML),
    ("llama3", "{%- for m in messages -%}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + (m['content'] | trim) + '<|eot_id|>' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"),
    ("phi3", "{%- for m in messages -%}{{- '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"),
    ("zephyr", "{%- for m in messages -%}{{- '<|' + m['role'] + '|>\n' + m['content'] + '<|endoftext|>\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"),
    ("mistral-v7", "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- '[SYSTEM_PROMPT] ' + m['content'] + '[/SYSTEM_PROMPT]' -}}{%- elif m['role'] == 'user' -%}{{- '[INST] ' + m['content'] + '[/INST]' -}}{%- else -%}{{- ' ' + m['content'] + '</s>' -}}{%- endif -%}{%- endfor -%}"),
    ("mistral-v7-tekken", "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' + m['content'] + '[/SYSTEM_PROMPT]' -}}{%- elif m['role'] == 'user' -%}{{- '[INST]' + m['content'] + '[/INST]' -}}{%- else -%}{{- m['content'] + '</s>' -}}{%- endif -%}{%- endfor -%}"),
    ("llama2", "{%- set ns = namespace(inside=true) -%}{{- '[INST] ' -}}{%- for m in messages -%}{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- '[INST] ' -}}{%- endif -%}{%- if m['role'] == 'system' -%}{{- m['content'] + '\n' -}}{%- elif m['role'] == 'user' -%}{{- m['content'] + ' [/INST]' -}}{%- else -%}{{- m['content'] + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}"),
    ("llama2-sys", "{%- set ns = namespace(inside=true) -%}{{- '[INST] ' -}}{%- for m in messages -%}{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- '[INST] ' -}}{%- endif -%}{%- if m['role'] == 'system' -%}{{- '<<SYS>>\n' + m['content'] + '\n<</SYS>>\n\n' -}}{%- elif m['role'] == 'user' -%}{{- m['content'] + ' [/INST]' -}}{%- else -%}{{- m['content'] + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}"),
    ("llama2-sys-bos", "{%- set ns = namespace(inside=true) -%}{{- '[INST] ' -}}{%- for m in messages -%}{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- '<s>[INST] ' -}}{%- endif -%}{%- if m['role'] == 'system' -%}{{- '<<SYS>>\n' + m['content'] + '\n<</SYS>>\n\n' -}}{%- elif m['role'] == 'user' -%}{{- m['content'] + ' [/INST]' -}}{%- else -%}{{- m['content'] + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}"),
    ("llama2-sys-strip", "{%- set ns = namespace(inside=true) -%}{{- '[INST] ' -}}{%- for m in messages -%}{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- '[INST] ' -}}{%- endif -%}{%- if m['role'] == 'system' -%}{{- '<<SYS>>\n' + (m['content'] | trim) + '\n<</SYS>>\n\n' -}}{%- elif m['role'] == 'user' -%}{{- (m['content'] | trim) + ' [/INST]' -}}{%- else -%}{{- (m['content'] | trim) + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}"),
    ("mistral-v1", "{%- set ns = namespace(inside=false) -%}{%- for m in messages -%}{%- if not ns.inside -%}{{- ' [INST] ' -}}{%- set ns.inside = true -%}{%- endif -%}{%- if m['role'] == 'system' -%}{{- m['content'] + '\n\n' -}}{%- elif m['role'] == 'user' -%}{{- m['content'] + ' [/INST]' -}}{%- else -%}{{- ' ' + m['content'] + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}"),
    ("mistral-v3", "{%- set ns = namespace(inside=false) -%}{%- for m in messages -%}{%- if not ns.inside -%}{{- '[INST] ' -}}{%- set ns.inside = true -%}{%- endif -%}{%- if m['role'] == 'system' -%}{{- m['content'] + '\n\n' -}}{%- elif m['role'] == 'user' -%}{{- m['content'] + '[/INST]' -}}{%- else -%}{{- ' ' + (m['content'] | trim) + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}"),
    ("mistral-v3-tekken", "{%- set ns = namespace(inside=false) -%}{%- for m in messages -%}{%- if not ns.inside -%}{{- '[INST]' -}}{%- set ns.inside = true -%}{%- endif -%}{%- if m['role'] == 'system' -%}{{- m['content'] + '\n\n' -}}{%- elif m['role'] == 'user' -%}{{- m['content'] + '[/INST]' -}}{%- else -%}{{- '' + m['content'] + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}"),
    ("phi4", "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '<|im_sep|>' + m['content'] + '<|im_end|>' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant<|im_sep|>' -}}{%- endif -%}"),
    ("falcon3", "{%- for m in messages -%}{{- '<|' + m['role'] + '|>\n' + m['content'] + '\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"),
    ("openchat", "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- m['content'] + '<|end_of_turn|>' -}}{%- else -%}{{- 'GPT4 Correct ' + (m['role'][:1] | upper) + m['role'][1:] + ': ' + m['content'] + '<|end_of_turn|>' -}}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- 'GPT4 Correct Assistant:' -}}{%- endif -%}"),
    ("vicuna", "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- m['content'] + '\n\n' -}}{%- elif m['role'] == 'user' -%}{{- 'USER: ' + m['content'] + '\n' -}}{%- elif m['role'] == 'assistant' -%}{{- 'ASSISTANT: ' + m['content'] + '</s>\n' -}}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"),
    ("vicuna-orca", "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- 'SYSTEM: ' + m['content'] + '\n' -}}{%- elif m['role'] == 'user' -%}{{- 'USER: ' + m['content'] + '\n' -}}{%- elif m['role'] == 'assistant' -%}{{- 'ASSISTANT: ' + m['content'] + '</s>\n' -}}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"),
    ("deepseek", "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- m['content'] -}}{%- elif m['role'] == 'user' -%}{{- '### Instruction:\n' + m['content'] + '\n' -}}{%- elif m['role'] == 'assistant' -%}{{- '### Response:\n' + m['content'] + '\n<|EOT|>\n' -}}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- '### Response:\n' -}}{%- endif -%}"),
    ("deepseek2", "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- m['content'] + '\n\n' -}}{%- elif m['role'] == 'user' -%}{{- 'User: ' + m['content'] + '\n\n' -}}{%- elif m['role'] == 'assistant' -%}{{- 'Assistant: ' + m['content'] + '<｜end▁of▁sentence｜>' -}}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"),
    ("deepseek3", "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- m['content'] + '\n\n' -}}{%- elif m['role'] == 'user' -%}{{- '<｜User｜>' + m['content'] -}}{%- elif m['role'] == 'assistant' -%}{{- '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' -}}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"),
    ("command-r", "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + (m['content'] | trim) + '<|END_OF_TURN_TOKEN|>' -}}{%- elif m['role'] == 'user' -%}{{- '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + (m['content'] | trim) + '<|END_OF_TURN_TOKEN|>' -}}{%- elif m['role'] == 'assistant' -%}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + (m['content'] | trim) + '<|END_OF_TURN_TOKEN|>' -}}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}{%- endif -%}"),
];

/// ChatML, for `--chat-template chatml`.
pub const CHATML: &str = "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}";

/// Template instructions a render may execute: far beyond any real template, and a bound on a
/// hostile one.
const FUEL: u64 = 5_000_000;

/// What a template is rendered with.
pub struct RenderInput<'a> {
    /// OpenAI messages (`role`, `content` as text, and whatever else the client sent:
    /// `tool_calls`, `tool_call_id`, `name`).
    pub messages: &'a [Value],
    pub tools: Option<&'a Value>,
    pub add_generation_prompt: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
    /// More variables for the template (`chat_template_kwargs`: `enable_thinking`, ...); they
    /// cannot replace the ones above.
    pub extra: Option<&'a serde_json::Map<String, Value>>,
}

impl ChatTemplate {
    /// The model's own template, else Gemma's turns.
    pub fn from_gguf(source: Option<&str>) -> ChatTemplate {
        match source {
            Some(s) if !s.trim().is_empty() => ChatTemplate::Jinja { name: "the model's (tokenizer.chat_template)".into(), source: s.to_owned() },
            _ => ChatTemplate::Gemma,
        }
    }

    /// The template `model`'s chats use, the same for `tine generate --chat`, `spec-bench` and
    /// the server: `overriding` (`--chat-template`) if given, else the GGUF's
    /// `tokenizer.chat_template` when it parses, else Gemma's turns (with a warning on stderr
    /// naming why).
    pub fn for_model(model: &tine_runtime::Model, overriding: Option<ChatTemplate>) -> ChatTemplate {
        overriding.unwrap_or_else(|| {
            let t = ChatTemplate::from_gguf(model.info.chat_template.as_deref());
            match t.check() {
                Ok(()) => t,
                Err(e) => {
                    eprintln!("warning: {}: {e}; chat requests use Gemma's turns instead", model.info.path.display());
                    ChatTemplate::Gemma
                }
            }
        })
    }

    /// A chat's prompt for `model`: `messages` (OpenAI messages as JSON) rendered with an open
    /// assistant turn, then tokenized with special tokens parsed and BOS in front if the
    /// template left it out. Returns the text and the ids.
    pub fn prompt(&self, model: &tine_runtime::Model, messages: &[Value], tools: Option<&Value>) -> Result<(String, Vec<u32>), TemplateError> {
        self.prompt_with(model, messages, tools, true, None, None)
    }

    /// [`ChatTemplate::prompt`] with or without the open assistant turn, with `prefill` (an
    /// assistant turn's beginning, continued by the model) after it, and with `extra`
    /// variables for the template (`chat_template_kwargs`).
    pub fn prompt_with(
        &self,
        model: &tine_runtime::Model,
        messages: &[Value],
        tools: Option<&Value>,
        add_generation_prompt: bool,
        prefill: Option<&str>,
        extra: Option<&serde_json::Map<String, Value>>,
    ) -> Result<(String, Vec<u32>), TemplateError> {
        let tok = &model.tokenizer;
        let bos = tok.bos_token().and_then(|b| tok.token_text(b)).unwrap_or("");
        let eos = tok.eos_token().and_then(|b| tok.token_text(b)).unwrap_or("");
        let mut text = self.render(&RenderInput { messages, tools, add_generation_prompt, bos_token: bos, eos_token: eos, extra })?;
        text.push_str(prefill.unwrap_or(""));
        let mut ids = tok.encode(&text, false, true);
        if let Some(b) = tok.bos_token() {
            if ids.first() != Some(&b) {
                ids.insert(0, b);
            }
        }
        Ok((text, ids))
    }

    /// `--chat-template NAME|FILE|TEMPLATE`: `gemma`, one of llama.cpp's names in [`NAMED`], a
    /// Jinja file, or the Jinja template itself (llama-server takes it inline too): Jinja
    /// syntax (`{{`, `{%`), or text that is neither a file nor a name or path (it holds
    /// whitespace or other characters than `A-Za-z0-9._/-`), such as a template of constant text.
    pub fn named(spec: &str) -> Result<ChatTemplate, TemplateError> {
        let name_like = !spec.is_empty() && spec.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '/' | '-'));
        let t = match spec {
            "gemma" | "gemma3" => ChatTemplate::Gemma,
            name if NAMED.iter().any(|(n, _)| *n == name) => {
                let source = NAMED.iter().find(|(n, _)| *n == name).map(|(_, s)| *s).expect("found above");
                ChatTemplate::Jinja { name: name.into(), source: source.into() }
            }
            inline if inline.contains("{%") || inline.contains("{{") => ChatTemplate::Jinja { name: "inline (--chat-template)".into(), source: inline.into() },
            inline if !name_like && !std::path::Path::new(inline).is_file() => ChatTemplate::Jinja { name: "inline (--chat-template)".into(), source: inline.into() },
            path => {
                let source = std::fs::read_to_string(path).map_err(|e| {
                    let names: Vec<&str> = std::iter::once("gemma").chain(NAMED.iter().map(|(n, _)| *n)).collect();
                    TemplateError::Read { path: path.into(), message: format!("{e} (not a file; the built-in names are {}, or pass the Jinja template itself)", names.join(", ")) }
                })?;
                ChatTemplate::Jinja { name: path.into(), source }
            }
        };
        t.check()?;
        Ok(t)
    }

    /// Parses the template (a broken one is refused at start-up, not per request).
    pub fn check(&self) -> Result<(), TemplateError> {
        if let ChatTemplate::Jinja { source, .. } = self {
            environment().template_from_str(source).map_err(|e| TemplateError::Syntax(crate::error_chain(&e)))?;
        }
        Ok(())
    }

    pub fn name(&self) -> &str {
        match self {
            ChatTemplate::Gemma => "gemma",
            ChatTemplate::Jinja { name, .. } => name,
        }
    }

    pub fn source(&self) -> Option<&str> {
        match self {
            ChatTemplate::Gemma => None,
            ChatTemplate::Jinja { source, .. } => Some(source),
        }
    }

    /// The tool-call syntax of this template's family, if it takes tools.
    pub fn tool_syntax(&self) -> Option<ToolSyntax> {
        let src = self.source()?;
        if !src.contains("tools") {
            return None;
        }
        Some(if src.contains("<tool_call>") {
            ToolSyntax::Hermes
        } else if src.contains("[TOOL_CALLS]") {
            ToolSyntax::Mistral
        } else {
            ToolSyntax::JsonObject
        })
    }

    pub fn render(&self, input: &RenderInput) -> Result<String, TemplateError> {
        match self {
            ChatTemplate::Gemma => {
                if input.tools.is_some() {
                    return Err(TemplateError::NoTools);
                }
                let messages: Vec<Message> =
                    input.messages.iter().map(|m| Message { role: m["role"].as_str().unwrap_or_default().to_owned(), content: m["content"].as_str().unwrap_or_default().to_owned() }).collect();
                Ok(render_gemma(&messages, input.add_generation_prompt)?)
            }
            ChatTemplate::Jinja { source, .. } => {
                if input.tools.is_some() && self.tool_syntax().is_none() {
                    return Err(TemplateError::NoTools);
                }
                let env = environment();
                let t = env.template_from_str(source).map_err(|e| TemplateError::Syntax(crate::error_chain(&e)))?;
                // llama.cpp's extra context: today's date in two forms, the tools as the JSON text
                // `functions` (what llama.cpp gave FireFunction-style templates: its `dump(2)`, or
                // "" without tools), then the caller's variables.
                let functions = match input.tools {
                    Some(t) if t.as_array().is_none_or(|a| !a.is_empty()) => serde_json::to_string_pretty(t).unwrap_or_default(),
                    _ => String::new(),
                };
                let mut ctx = json!({"date_string": strftime_now("%d %b %Y"), "datetime": strftime_now("%b %d %Y"), "functions": functions});
                if let (Some(extra), Some(c)) = (input.extra, ctx.as_object_mut()) {
                    c.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
                let fixed = json!({
                    "messages": input.messages,
                    "tools": input.tools,
                    "add_generation_prompt": input.add_generation_prompt,
                    "bos_token": input.bos_token,
                    "eos_token": input.eos_token,
                });
                if let (Some(c), Value::Object(f)) = (ctx.as_object_mut(), fixed) {
                    c.extend(f);
                }
                t.render(minijinja::Value::from(minijinja::value::Serde(&ctx))).map_err(|e| TemplateError::Render(crate::error_chain(&e)))
            }
        }
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // As Hugging Face renders chat templates.
    env.set_syntax(minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().expect("the default delimiters are valid"));
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, JinjaError> { Err(JinjaError::new(ErrorKind::InvalidOperation, msg)) });
    env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
    env
}

/// `strftime_now(fmt)` (Llama 3 templates print today's date) for the codes templates use.
fn strftime_now(fmt: &str) -> String {
    let days = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() / 86_400).unwrap_or(0) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}
