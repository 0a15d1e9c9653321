//! The request bodies of Tine's HTTP API, and every check that needs no model.
//!
//! `tine-server` decodes a body here ([`decode`]), then adds what needs the model (tokenizing
//! the prompt, its length against the context, the speculative overrides). Nothing here
//! panics on any input: the `http_request` fuzz target drives [`decode_any`] with arbitrary
//! bytes. Unknown fields are ignored, as OpenAI's API does.

use serde::Deserialize;
use tine_sampling::SamplingParams;

pub mod dialects;
pub mod tools;
pub use tools::ToolMode;

/// A request the client must change: the server answers 400 with this message, and with the
/// field at fault as OpenAI's `param` where there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// The request field at fault (`logit_bias`, `response_format.type`, ...), if one is.
    pub param: Option<String>,
    pub message: String,
}

impl RequestError {
    /// An error of the request as a whole (an empty body, malformed JSON).
    fn new(m: impl Into<String>) -> RequestError {
        RequestError { param: None, message: m.into() }
    }
    /// An error of the field `param`.
    fn on(param: impl Into<String>, m: impl Into<String>) -> RequestError {
        RequestError { param: Some(param.into()), message: m.into() }
    }
}

/// Decodes a JSON body; an empty body and JSON errors are [`RequestError`]s naming the field.
pub fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, RequestError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(RequestError::new("the request body is empty; send a JSON object"));
    }
    serde_json::from_slice(body).map_err(|e| RequestError::new(format!("invalid JSON body: {e}")))
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
#[serde(expecting = "`prompt` as a string, a list of token ids, a `{\"prompt_string\": ...}` object, or a list of prompts (strings, lists of token ids or such objects)")]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<i64>),
    /// llama-server's prompt object.
    Object(PromptObject),
    /// Several prompts in one request (OpenAI's list of strings, llama-server's list of token
    /// lists): one result each.
    Many(Vec<OnePrompt>),
    /// One prompt of token ids and texts (llama.cpp's `tokenize_mixed`).
    Mixed(Vec<PromptPart>),
}

/// A piece of a mixed prompt: a token id, or a text to tokenize.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum PromptPart {
    Id(i64),
    Text(String),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
#[serde(expecting = "a prompt as a string, a list of token ids (and strings) or a `{\"prompt_string\": ...}` object")]
pub enum OnePrompt {
    Text(String),
    Tokens(Vec<i64>),
    Object(PromptObject),
    Mixed(Vec<PromptPart>),
}

/// llama-server's JSON prompt object: `{"prompt_string": TEXT, "multimodal_data": [...]}`
/// (a JSON object only: serde would read a struct from a list too). Multimodal data is refused
/// (Tine's models read text only).
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct PromptObject(serde_json::Map<String, serde_json::Value>);

impl PromptObject {
    fn into_prompt(self) -> Result<Prompt, RequestError> {
        let text = match self.0.get("prompt_string") {
            Some(serde_json::Value::String(t)) => t.clone(),
            _ => return Err(RequestError::on("prompt", "a prompt object needs `prompt_string`, a string")),
        };
        let empty = match self.0.get("multimodal_data") {
            None | Some(serde_json::Value::Null) => true,
            Some(serde_json::Value::Array(a)) => a.is_empty(),
            Some(_) => false,
        };
        if !empty {
            return Err(RequestError::on("prompt", "`multimodal_data` is not supported: this server's models read text only"));
        }
        Ok(Prompt::Text(text))
    }
}

/// The prompt, before tokenization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<i64>),
    /// Token ids and texts in one prompt: the texts tokenized in place (BOS only where the
    /// first part is a text, as llama.cpp's `tokenize_mixed` adds it).
    Mixed(Vec<PromptPart>),
}

/// Most results one request may ask for (prompts times `n`).
pub const MAX_CHOICES: usize = 16;

impl PromptInput {
    /// Every prompt it holds (a prompt object's multimodal data refused).
    fn flatten(self) -> Result<Vec<Prompt>, RequestError> {
        match self {
            PromptInput::Text(t) => Ok(vec![Prompt::Text(t)]),
            PromptInput::Tokens(ids) => Ok(vec![Prompt::Tokens(ids)]),
            PromptInput::Object(o) => Ok(vec![o.into_prompt()?]),
            PromptInput::Mixed(parts) => Ok(vec![Prompt::Mixed(parts)]),
            PromptInput::Many(v) => v
                .into_iter()
                .map(|p| match p {
                    OnePrompt::Text(t) => Ok(Prompt::Text(t)),
                    OnePrompt::Tokens(ids) => Ok(Prompt::Tokens(ids)),
                    OnePrompt::Object(o) => o.into_prompt(),
                    OnePrompt::Mixed(parts) => Ok(Prompt::Mixed(parts)),
                })
                .collect(),
        }
    }

    pub fn into_prompts(self) -> Result<Vec<Prompt>, RequestError> {
        let v = self.flatten()?;
        if v.is_empty() {
            return Err(RequestError::on("prompt", "`prompt` is an empty list"));
        }
        if v.len() > MAX_CHOICES {
            return Err(RequestError::on("prompt", format!("at most {MAX_CHOICES} prompts per request, got {}", v.len())));
        }
        Ok(v)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
#[serde(expecting = "`stop` as a string or a list of strings")]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

/// The sampling and limit fields shared by every generation endpoint.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct GenFields {
    pub n_predict: Option<i64>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_k: Option<i32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    #[serde(default)]
    pub stream: bool,
    /// OpenAI's `stream_options` (`include_usage`).
    pub stream_options: Option<StreamOptions>,
    /// llama-server's `id_slot`: run in this slot (waiting for it), `-1` or absent for any.
    pub id_slot: Option<i64>,
    /// llama-server's `timings_per_token`: every streamed chunk carries the timings so far.
    #[serde(default)]
    pub timings_per_token: bool,
    /// llama-server's `return_progress`: a stream carries `prompt_progress` chunks while the
    /// prompt is evaluated.
    #[serde(default)]
    pub return_progress: bool,
    /// llama-server's `verbose`: a chat answer carries `__verbose`, the `/completion`-style
    /// result (the rendered prompt included).
    #[serde(default)]
    pub verbose: bool,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub n_probs: usize,
    /// llama-server's `post_sampling_probs`: `completion_probabilities` gives each token's
    /// probability after the sampler's filters (`prob`, `top_probs`) instead of log-probabilities.
    #[serde(default)]
    pub post_sampling_probs: bool,
    /// llama-server's `response_fields`: `/completion` answers only these fields (`a/b` reaches
    /// into objects), each under its path.
    pub response_fields: Option<Vec<String>>,
    pub cache_prompt: Option<bool>,
    #[serde(default)]
    pub return_tokens: bool,
    #[serde(rename = "speculative.n_max")]
    pub spec_n_max: Option<usize>,
    #[serde(rename = "speculative.n_min")]
    pub spec_n_min: Option<usize>,
    #[serde(rename = "speculative.p_min")]
    pub spec_p_min: Option<f32>,
    /// llama-server's `speculative.type`: `none`, a drafter type or `ngram,TYPE` (checked
    /// against what the server serves, at the server's edge).
    #[serde(rename = "speculative.type")]
    pub spec_type: Option<String>,
    /// OpenAI's choices per prompt; choice `i` samples with `seed + i`.
    pub n: Option<i64>,
    /// OpenAI's log-probabilities: a count of alternatives (completions) or `true` (chat, with
    /// `top_logprobs`).
    pub logprobs: Option<LogprobsInput>,
    pub top_logprobs: Option<i64>,
    /// OpenAI's `{"id": bias}` or llama-server's `[[id or text, bias or false], ...]`.
    pub logit_bias: Option<LogitBiasInput>,
    /// llama-server's tokens kept at the front by a context shift (`-1`: the whole prompt).
    pub n_keep: Option<i64>,
    /// OpenAI's `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<serde_json::Value>,
    /// llama-server's JSON schema field.
    pub json_schema: Option<serde_json::Value>,
    /// llama-server's GBNF grammar (llguidance's Lark when it starts with `%llguidance`).
    pub grammar: Option<String>,
}

/// What the output is constrained to.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    JsonSchema(serde_json::Value),
    Gbnf(String),
    Lark(String),
}

impl GenFields {
    /// The one constraint the request asks for, from whichever field carries it.
    pub fn constraint(&self) -> Result<Option<(&'static str, Constraint)>, RequestError> {
        let mut found: Vec<(&str, Constraint)> = Vec::new();
        if let Some(rf) = &self.response_format {
            let o = rf.as_object().ok_or_else(|| RequestError::on("response_format", "response_format must be an object with a `type`"))?;
            match o.get("type").and_then(|t| t.as_str()) {
                Some("text") => {}
                // llama-server takes a `schema` here too.
                Some("json_object") => found.push(("response_format", Constraint::JsonSchema(o.get("schema").cloned().unwrap_or_else(|| serde_json::json!({"type": "object"}))))),
                Some("json_schema") => {
                    let schema = o
                        .get("json_schema")
                        .and_then(|j| j.get("schema"))
                        .or_else(|| o.get("schema"))
                        .ok_or_else(|| RequestError::on("response_format", "response_format: `json_schema.schema` is required with type json_schema"))?;
                    found.push(("response_format", Constraint::JsonSchema(schema.clone())));
                }
                Some(other) => return Err(RequestError::on("response_format.type", format!("response_format.type must be text, json_object or json_schema, got {other:?}"))),
                None => return Err(RequestError::on("response_format.type", "response_format.type is required")),
            }
        }
        if let Some(schema) = &self.json_schema {
            found.push(("json_schema", Constraint::JsonSchema(schema.clone())));
        }
        if let Some(g) = self.grammar.as_deref().filter(|g| !g.trim().is_empty()) {
            let c = if g.trim_start().starts_with("%llguidance") { Constraint::Lark(g.to_owned()) } else { Constraint::Gbnf(g.to_owned()) };
            found.push(("grammar", c));
        }
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop()),
            _ => Err(RequestError::new(format!("only one of {} may constrain the output", found.iter().map(|f| f.0).collect::<Vec<_>>().join(" and ")))),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
#[serde(expecting = "`logit_bias` as an object of token ids to biases or a list of [token, bias] pairs")]
pub enum LogitBiasInput {
    Map(serde_json::Map<String, serde_json::Value>),
    Pairs(Vec<(serde_json::Value, serde_json::Value)>),
}

/// What a bias applies to: a token id, or every token of a text (llama-server's form).
#[derive(Debug, Clone, PartialEq)]
pub enum BiasTarget {
    Id(i64),
    Text(String),
}

/// Most a bias may move a logit (OpenAI's range); `false` in llama-server's form bans the token.
pub const MAX_LOGIT_BIAS: f64 = 100.0;

fn bias_value(v: &serde_json::Value) -> Result<f32, RequestError> {
    match v {
        serde_json::Value::Bool(false) => Ok(f32::NEG_INFINITY),
        serde_json::Value::Number(n) => match n.as_f64() {
            Some(b) if (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&b) => Ok(b as f32),
            _ => Err(RequestError::on("logit_bias", format!("logit_bias: a bias must lie in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {n}"))),
        },
        other => Err(RequestError::on("logit_bias", format!("logit_bias: a bias is a number or false, got {other}"))),
    }
}

impl LogitBiasInput {
    pub fn entries(&self) -> Result<Vec<(BiasTarget, f32)>, RequestError> {
        match self {
            LogitBiasInput::Map(m) => m
                .iter()
                .map(|(k, v)| {
                    // A key that is not a number is a text whose tokens are biased (llama-server).
                    let target = match k.trim().parse::<i64>() {
                        Ok(id) => BiasTarget::Id(id),
                        Err(_) => BiasTarget::Text(k.clone()),
                    };
                    Ok((target, bias_value(v)?))
                })
                .collect(),
            LogitBiasInput::Pairs(pairs) => pairs
                .iter()
                .map(|(t, v)| {
                    let target = match t {
                        serde_json::Value::Number(n) => BiasTarget::Id(n.as_i64().ok_or_else(|| RequestError::on("logit_bias", format!("logit_bias: token {n} is not a token id")))?),
                        serde_json::Value::String(s) => BiasTarget::Text(s.clone()),
                        other => return Err(RequestError::on("logit_bias", format!("logit_bias: a token is an id or a text, got {other}"))),
                    };
                    Ok((target, bias_value(v)?))
                })
                .collect(),
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
#[serde(expecting = "`logprobs` as a boolean or a count of alternatives")]
pub enum LogprobsInput {
    On(bool),
    Top(i64),
}

/// Most top log-probabilities a request may ask for per token.
pub const MAX_N_PROBS: usize = 100;

/// OpenAI's `stream_options`.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct StreamOptions {
    /// End a chat stream with a chunk of no choices that carries `usage` (OpenAI's and
    /// llama-server's last chunk).
    #[serde(default)]
    pub include_usage: bool,
}

/// [`GenFields`] checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// `-1`: until end of generation or the context is full.
    pub n_predict: i32,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub n_probs: usize,
    pub ignore_eos: bool,
    pub cache_prompt: bool,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `id_slot`: the slot to run in (`None`: any; the server checks it names one of its slots).
    pub id_slot: Option<usize>,
    /// `timings_per_token`.
    pub timings_per_token: bool,
    /// `return_progress`.
    pub return_progress: bool,
    /// `verbose`.
    pub verbose: bool,
    pub return_tokens: bool,
    /// `post_sampling_probs`.
    pub post_sampling_probs: bool,
    /// `response_fields` (empty: every field).
    pub response_fields: Vec<String>,
    /// OpenAI log-probabilities asked for, with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Biases still to be resolved against the vocabulary.
    pub logit_bias: Vec<(BiasTarget, f32)>,
    /// A grammar or schema still to be compiled against the vocabulary, with the field it
    /// came from.
    pub constraint: Option<(&'static str, Constraint)>,
    /// `-1`: the whole prompt.
    pub n_keep: i32,
    /// `speculative.n_max`, `.n_min`, `.p_min`: per-request draft settings (each `None` keeps
    /// the server's).
    pub draft: DraftOverride,
    /// `speculative.type`: the drafter (`None` keeps the server's).
    pub spec_type: Option<String>,
}

/// A request's own draft settings, each over the server's when given.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DraftOverride {
    pub n_max: Option<usize>,
    pub n_min: Option<usize>,
    pub p_min: Option<f32>,
}

impl DraftOverride {
    pub fn is_empty(&self) -> bool {
        *self == DraftOverride::default()
    }
}

/// What a request gets for a field it leaves out (the server's `--temp`, `--n-predict`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct Defaults {
    pub sampling: SamplingParams,
    /// `-1`: no limit.
    pub n_predict: i64,
    /// Tokens a context shift keeps at the front (`--keep`; `-1`: the whole prompt).
    pub n_keep: i64,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults { sampling: SamplingParams::default(), n_predict: -1, n_keep: 0 }
    }
}

impl GenFields {
    /// Every check of these fields that needs no model, with the built-in defaults.
    pub fn limits(&self) -> Result<Limits, RequestError> {
        self.limits_with(&Defaults::default())
    }

    /// Every check of these fields that needs no model; `defaults` fills what is left out.
    pub fn limits_with(&self, defaults: &Defaults) -> Result<Limits, RequestError> {
        self.choices()?;
        let n_predict = self.n_predict.or(self.max_completion_tokens).or(self.max_tokens).unwrap_or(defaults.n_predict);
        if n_predict < -1 {
            return Err(RequestError::on("n_predict", format!("n_predict must be -1 (no limit) or >= 0, got {n_predict}")));
        }
        let d = &defaults.sampling;
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repeat_penalty: self.repeat_penalty.unwrap_or(d.repeat_penalty),
            repeat_last_n: self.repeat_last_n.unwrap_or(d.repeat_last_n),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            // llama-server: a negative seed means a random one.
            seed: match self.seed {
                Some(s) if s >= 0 => Some(s as u64),
                Some(_) => None,
                None => d.seed,
            },
        };
        sampling.validate().map_err(|e| RequestError::on(e.param(), e.to_string()))?;
        if self.n_probs > MAX_N_PROBS {
            return Err(RequestError::on("n_probs", format!("n_probs must be at most {MAX_N_PROBS}, got {}", self.n_probs)));
        }
        let in_range = |name: &str, n: i64| -> Result<usize, RequestError> {
            if (0..=MAX_N_PROBS as i64).contains(&n) {
                Ok(n as usize)
            } else {
                Err(RequestError::on(name, format!("{name} must lie in 0..={MAX_N_PROBS}, got {n}")))
            }
        };
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (None | Some(LogprobsInput::On(false)), None) => None,
            (None | Some(LogprobsInput::On(false)), Some(_)) => return Err(RequestError::on("top_logprobs", "top_logprobs needs `logprobs: true`")),
            (Some(LogprobsInput::On(true)), top) => Some(in_range("top_logprobs", top.unwrap_or(0))?),
            (Some(LogprobsInput::Top(n)), top) => Some(in_range("top_logprobs", top.unwrap_or(0))?.max(in_range("logprobs", n)?)),
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        };
        Ok(Limits {
            n_predict: n_predict.min(i32::MAX as i64) as i32,
            sampling,
            stop,
            // The engine computes the sampled token's log-probability only with n_probs > 0.
            n_probs: self.n_probs.max(logprobs.map_or(0, |t| t.max(1))),
            ignore_eos: self.ignore_eos,
            cache_prompt: self.cache_prompt.unwrap_or(true),
            stream: self.stream,
            include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
            timings_per_token: self.timings_per_token,
            return_progress: self.return_progress,
            verbose: self.verbose,
            id_slot: match self.id_slot {
                None | Some(-1) => None,
                Some(n) if n >= 0 => Some(n as usize),
                Some(n) => return Err(RequestError::on("id_slot", format!("id_slot must be -1 (any slot) or a slot's index, got {n}"))),
            },
            return_tokens: self.return_tokens,
            post_sampling_probs: self.post_sampling_probs,
            response_fields: self.response_fields.clone().unwrap_or_default(),
            logprobs,
            logit_bias: self.logit_bias.as_ref().map(LogitBiasInput::entries).transpose()?.unwrap_or_default(),
            constraint: self.constraint()?,
            n_keep: match self.n_keep.unwrap_or(defaults.n_keep) {
                n @ -1..=0x7fff_ffff => n as i32,
                n => return Err(RequestError::on("n_keep", format!("n_keep must be -1 (the whole prompt) or >= 0, got {n}"))),
            },
            draft: DraftOverride { n_max: self.spec_n_max, n_min: self.spec_n_min, p_min: self.spec_p_min },
            spec_type: self.spec_type.clone(),
        })
    }

    /// Choices per prompt (`n`, 1 when absent).
    pub fn choices(&self) -> Result<usize, RequestError> {
        match self.n {
            None => Ok(1),
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => Ok(n as usize),
            Some(n) => Err(RequestError::on("n", format!("n must lie in 1..={MAX_CHOICES}, got n = {n}"))),
        }
    }
}

/// `/completion` (llama-server) and `/v1/completions` (OpenAI).
#[derive(Debug, Clone, Deserialize)]
#[serde(expecting = "a JSON object")]
pub struct CompletionBody {
    pub prompt: Option<PromptInput>,
    /// OpenAI fields Tine does not implement; sent with a non-default value they are refused.
    #[serde(default)]
    pub echo: bool,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub gen: GenFields,
}

impl CompletionBody {
    pub fn prompts(&mut self) -> Result<Vec<Prompt>, RequestError> {
        if self.echo {
            return Err(RequestError::on("echo", "echo: echoing the prompt back is not supported"));
        }
        if let Some(b) = self.best_of.filter(|&b| b != 1) {
            return Err(RequestError::on("best_of", format!("best_of: only 1 is supported, got {b}")));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(RequestError::on("suffix", "suffix: insertion after a suffix is not supported"));
        }
        self.prompt.take().ok_or_else(|| RequestError::on("prompt", "`prompt` is required"))?.into_prompts()
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
#[serde(expecting = "`content` as a string or a list of content parts")]
pub enum ContentInput {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<ContentInput>,
    /// Everything else the client sent (`tool_calls`, `tool_call_id`, `name`): the template sees it.
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// The message as a chat template sees it: OpenAI's fields, `content` as text.
    pub fn to_template_value(&self) -> Result<serde_json::Value, RequestError> {
        let mut m = self.rest.clone();
        m.insert("role".into(), self.role.clone().into());
        m.insert("content".into(), self.text()?.into());
        Ok(serde_json::Value::Object(m))
    }
}

impl ChatMessage {
    /// The message's text: a string, or its `text` parts joined by newlines (llama-server's
    /// join). Other parts (`image_url`,
    /// `input_audio`) are refused: no Tine model reads them, and dropping them would answer a
    /// question the client did not ask.
    pub fn text(&self) -> Result<String, RequestError> {
        match &self.content {
            None => Ok(String::new()),
            Some(ContentInput::Text(t)) => Ok(t.clone()),
            Some(ContentInput::Parts(parts)) => {
                if let Some(p) = parts.iter().find(|p| p.kind != "text") {
                    return Err(RequestError::on("messages", format!("content parts of type `{}` are not supported: this model reads text only", p.kind)));
                }
                Ok(parts.iter().map(|p| p.text.as_str()).collect::<Vec<_>>().join("\n"))
            }
        }
    }
}

/// `/v1/chat/completions` (and `/apply-template`).
#[derive(Debug, Clone, Deserialize)]
#[serde(expecting = "a JSON object with `messages`")]
pub struct ChatBody {
    pub messages: Vec<ChatMessage>,
    /// OpenAI tools, passed to the chat template.
    pub tools: Option<Vec<serde_json::Value>>,
    pub tool_choice: Option<serde_json::Value>,
    /// Open an assistant turn after the messages (true when absent).
    pub add_generation_prompt: Option<bool>,
    /// Continue the last (assistant) message instead of answering it: `true` or `"content"`.
    pub continue_final_message: Option<serde_json::Value>,
    /// Several calls in one answer (llama-server's default: off).
    pub parallel_tool_calls: Option<bool>,
    /// More variables for the chat template (`{"enable_thinking": false}`, ...), over the
    /// server's `--chat-template-kwargs`.
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// llama-server's `reasoning_format`: `deepseek` (or `auto`) returns `<think>` text as
    /// `reasoning_content`, `none` leaves it in the content.
    pub reasoning_format: Option<String>,
    #[serde(flatten)]
    pub gen: GenFields,
}

/// What `tool_choice` asks for.
enum ToolChoice<'a> {
    None,
    Auto,
    Required,
    Named(&'a str),
}

impl ChatBody {
    fn tool_choice(&self) -> Result<ToolChoice<'_>, RequestError> {
        use serde_json::Value;
        Ok(match &self.tool_choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
            Some(Value::String(s)) if s == "none" => ToolChoice::None,
            Some(Value::String(s)) if s == "required" => ToolChoice::Required,
            Some(v @ Value::Object(_)) => ToolChoice::Named(
                v.get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(|n| n.as_str())
                    .ok_or_else(|| RequestError::on("tool_choice", "tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}"))?,
            ),
            Some(other) => return Err(RequestError::on("tool_choice", format!("tool_choice must be \"auto\", \"none\", \"required\" or a named function, got {other}"))),
        })
    }

    /// The tools the model is offered (none with `tool_choice: "none"`), and the ones a
    /// forced call may name (none when no call is forced).
    fn offered_tools(&self) -> Result<(&[serde_json::Value], Option<Vec<serde_json::Value>>), RequestError> {
        let tools = self.tools.as_deref().unwrap_or_default();
        let name_of = |t: &serde_json::Value| t.get("function").and_then(|f| f.get("name")).and_then(|n| n.as_str()).map(str::to_owned);
        Ok(match self.tool_choice()? {
            ToolChoice::None => (&[], None),
            ToolChoice::Auto => (tools, None),
            ToolChoice::Required if tools.is_empty() => return Err(RequestError::on("tool_choice", "tool_choice: a call is required but `tools` is empty")),
            ToolChoice::Required => (tools, Some(tools.to_vec())),
            ToolChoice::Named(want) => {
                let found: Vec<serde_json::Value> = tools.iter().filter(|t| name_of(t).as_deref() == Some(want)).cloned().collect();
                if found.is_empty() {
                    return Err(RequestError::on("tool_choice", format!("tool_choice: no tool is named {want:?}")));
                }
                (tools, Some(found))
            }
        })
    }
}

/// `/embedding` (llama-server's: `content`, or `input`) and `/v1/embeddings` (OpenAI's: `input`).
#[derive(Debug, Clone, Deserialize)]
#[serde(expecting = "a JSON object with `input` (or `content`)")]
pub struct EmbeddingBody {
    pub input: Option<PromptInput>,
    pub content: Option<PromptInput>,
    /// `float` (the default) or `base64` (little-endian f32s).
    pub encoding_format: Option<String>,
    /// llama.cpp's normalization: -1 none, 0 max-abs (int16 range), 1 taxicab, 2 Euclidean
    /// (the default), p > 2 the p-norm.
    pub embd_normalize: Option<i32>,
    /// OpenAI's `dimensions`: only the model's own width can be given.
    pub dimensions: Option<usize>,
}

/// An embedding request after every check that needs no model.
#[derive(Debug, Clone)]
pub struct EmbeddingRequest {
    pub prompts: Vec<Prompt>,
    pub normalize: i32,
    pub base64: bool,
    pub dimensions: Option<usize>,
}

/// Decodes an embedding body: its inputs (a text, token ids, or a list of either; at most
/// [`MAX_EMBEDDING_INPUTS`]), the encoding and the normalization.
pub fn check_embeddings(body: &[u8]) -> Result<EmbeddingRequest, RequestError> {
    let b: EmbeddingBody = decode(body)?;
    let (field, input) = match (b.input, b.content) {
        (Some(i), _) => ("input", i),
        (None, Some(c)) => ("content", c),
        (None, None) => return Err(RequestError::on("input", "`input` is required")),
    };
    let prompts = input.flatten().map_err(|e| RequestError { param: Some(field.into()), ..e })?;
    if prompts.is_empty() {
        return Err(RequestError::on(field, format!("`{field}` is an empty list")));
    }
    if prompts.len() > MAX_EMBEDDING_INPUTS {
        return Err(RequestError::on(field, format!("at most {MAX_EMBEDDING_INPUTS} inputs per request, got {}", prompts.len())));
    }
    let base64 = match b.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(RequestError::on("encoding_format", format!("encoding_format must be \"float\" or \"base64\", got {other:?}"))),
    };
    let normalize = b.embd_normalize.unwrap_or(2);
    if !(-1..=64).contains(&normalize) {
        return Err(RequestError::on("embd_normalize", format!("embd_normalize must lie in -1..=64, got {normalize}")));
    }
    Ok(EmbeddingRequest { prompts, normalize, base64, dimensions: b.dimensions })
}

/// The most inputs one embedding request may carry.
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// `/tokenize`: llama-server's `content`, or vLLM's `prompt` (what request routers send to
/// learn a completion's tokens; special tokens added unless `add_special_tokens: false`).
/// vLLM's `messages` form is a chat body ([`check_chat_prompt`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(expecting = "a JSON object")]
pub struct TokenizeBody {
    pub content: Option<String>,
    pub prompt: Option<String>,
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub add_special: bool,
    #[serde(default = "yes")]
    pub parse_special: bool,
    #[serde(default)]
    pub with_pieces: bool,
}

impl TokenizeBody {
    /// The text and whether special tokens are added: `content` (llama-server's, `add_special`)
    /// or `prompt` (vLLM's, `add_special_tokens`, added by default).
    pub fn text(&self) -> Result<(&str, bool), RequestError> {
        match (&self.content, &self.prompt) {
            (Some(c), _) => Ok((c, self.add_special)),
            (None, Some(p)) => Ok((p, self.add_special_tokens.unwrap_or(true))),
            (None, None) => Err(RequestError::on("content", "`content` is required (or vLLM's `prompt` or `messages`)")),
        }
    }
}

fn yes() -> bool {
    true
}

/// `/detokenize`.
#[derive(Debug, Clone, Deserialize)]
#[serde(expecting = "a JSON object with `tokens`")]
pub struct DetokenizeBody {
    pub tokens: Vec<i64>,
}

/// Token ids from a client, checked against a vocabulary of `vocab` tokens.
pub fn check_ids(ids: &[i64], vocab: usize) -> Result<Vec<u32>, RequestError> {
    let v = vocab as i64;
    ids.iter().map(|&t| if (0..v).contains(&t) { Ok(t as u32) } else { Err(RequestError::new(format!("token id {t} is outside the vocabulary (0..{vocab})"))) }).collect()
}

/// The endpoints that take a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completion,
    Chat,
    /// Anthropic's `/v1/messages`: [`dialects::anthropic_to_chat`], then [`check_chat`].
    Messages,
    /// OpenAI's `/v1/responses`: [`dialects::responses_to_chat`], then [`check_chat`].
    Responses,
    /// `/embedding`, `/v1/embeddings`: [`check_embeddings`].
    Embeddings,
    Tokenize,
    Detokenize,
}

impl Endpoint {
    pub const ALL: [Endpoint; 7] = [Endpoint::Completion, Endpoint::Chat, Endpoint::Messages, Endpoint::Responses, Endpoint::Embeddings, Endpoint::Tokenize, Endpoint::Detokenize];
}

/// A completion request (`/completion`, `/v1/completions`) after every check that needs no
/// model: the server's edge calls [`check_completion`], then tokenizes the prompts and checks
/// what needs the model.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompts: Vec<Prompt>,
    pub limits: Limits,
    /// Results per prompt (`n`).
    pub n: usize,
}

/// Decodes a completion body and runs every model-free check, in the server's order.
pub fn check_completion(body: &[u8], defaults: &Defaults) -> Result<CompletionRequest, RequestError> {
    let mut b: CompletionBody = decode(body)?;
    let prompts = b.prompts()?;
    let n = b.gen.choices()?;
    if prompts.len() * n > MAX_CHOICES {
        return Err(RequestError::on("n", format!("at most {MAX_CHOICES} results per request (prompts x n), got {} x {n}", prompts.len())));
    }
    let limits = b.gen.limits_with(defaults)?;
    Ok(CompletionRequest { prompts, limits, n })
}

/// A chat's prompt before the template: the messages as a template sees them, and the tools.
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    pub messages: Vec<serde_json::Value>,
    pub tools: Option<serde_json::Value>,
    /// Render an open assistant turn after the messages.
    pub add_generation_prompt: bool,
    /// Assistant prefill (llama-server's): a trailing assistant message, or
    /// `continue_final_message`, is continued, not answered. Its text follows the messages
    /// before it rendered with an open assistant turn.
    pub prefill: Option<String>,
    /// The request's `chat_template_kwargs` (the server lays them over its own).
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// Where a reply's reasoning goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Left in the content as the model wrote it.
    None,
    /// `<think>…</think>` returned apart, as `reasoning_content` (llama-server's `deepseek`).
    Deepseek,
}

impl ReasoningFormat {
    /// llama-server's name of the format.
    pub fn name(self) -> &'static str {
        match self {
            ReasoningFormat::None => "none",
            ReasoningFormat::Deepseek => "deepseek",
        }
    }

    /// `none`, `deepseek`, or `auto` (which is `deepseek`, as in llama-server).
    pub fn from_name(name: &str) -> Option<ReasoningFormat> {
        match name {
            "none" => Some(ReasoningFormat::None),
            "deepseek" | "auto" => Some(ReasoningFormat::Deepseek),
            _ => None,
        }
    }
}

/// A chat request (`/v1/chat/completions`) after every check that needs no model.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub prompt: ChatPrompt,
    /// How the output is read for tool calls (a forced call's or the generic format's schema
    /// is in the limits).
    pub tools: ToolMode,
    /// `reasoning_format` (`None`: the server's).
    pub reasoning: Option<ReasoningFormat>,
    pub limits: Limits,
    pub n: usize,
}

/// Decodes a chat body for its prompt alone (`/apply-template`). `native_tools`: the chat
/// template has a tool syntax of its own (else tools take the generic format, [`tools`]).
pub fn check_chat_prompt(body: &[u8], native_tools: bool) -> Result<ChatPrompt, RequestError> {
    Ok(chat_prompt_of(&decode::<ChatBody>(body)?, native_tools)?.0)
}

/// The prompt, how the output is read for calls, and the schema the output must follow (a
/// forced call's, or the generic format's).
fn chat_prompt_of(b: &ChatBody, native_tools: bool) -> Result<(ChatPrompt, ToolMode, Option<serde_json::Value>), RequestError> {
    let (offered, forced) = b.offered_tools()?;
    let parallel = b.parallel_tool_calls.unwrap_or(false);
    let mut messages: Vec<serde_json::Value> = b.messages.iter().map(ChatMessage::to_template_value).collect::<Result<_, _>>()?;
    // llama-server's rules: `continue_final_message` true (or "content") continues the last
    // message; without it a trailing assistant message is continued too (assistant prefill),
    // unless another assistant message precedes it.
    let explicit = match &b.continue_final_message {
        None | Some(serde_json::Value::Bool(false)) | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Bool(true)) => true,
        Some(serde_json::Value::String(s)) if s == "content" => true,
        Some(other) => return Err(RequestError::on("continue_final_message", format!("continue_final_message must be true, false or \"content\", got {other}"))),
    };
    let role = |m: Option<&serde_json::Value>| m.and_then(|m| m["role"].as_str()).unwrap_or("").to_owned();
    let last_is_assistant = role(messages.last()) == "assistant";
    let mut add_generation_prompt = b.add_generation_prompt.unwrap_or(true);
    let continues = if explicit {
        if add_generation_prompt {
            return Err(RequestError::on("continue_final_message", "Cannot set both add_generation_prompt and continue_final_message to true."));
        }
        if messages.is_empty() {
            return Err(RequestError::on("continue_final_message", "continue_final_message: there is no message to continue"));
        }
        true
    } else if last_is_assistant {
        if role(messages.len().checked_sub(2).and_then(|i| messages.get(i))) == "assistant" {
            return Err(RequestError::on("messages", "Cannot have 2 or more assistant messages at the end of the list."));
        }
        true
    } else {
        false
    };
    let prefill = if continues {
        let last = messages.pop().expect("checked: there is a last message");
        if last.get("tool_calls").is_some_and(|c| !c.is_null() && c.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(RequestError::on("messages", "Cannot continue an assistant message that contains tool calls."));
        }
        add_generation_prompt = true;
        Some(last["content"].as_str().unwrap_or("").to_owned())
    } else {
        None
    };
    let (tools, mode, schema) = if native_tools {
        let tools = (!offered.is_empty()).then(|| serde_json::Value::Array(offered.to_vec()));
        match forced {
            Some(allowed) => {
                let (calls, defs) = tools::calls_with_defs(&tools::functions(&allowed)?);
                let mut schema = serde_json::json!({"anyOf": calls});
                if !defs.is_empty() {
                    schema["$defs"] = serde_json::Value::Object(defs);
                }
                (tools, ToolMode::NativeForced, Some(tools::compact(schema)))
            }
            None if tools.is_some() => (tools, ToolMode::Native, None),
            None => (None, ToolMode::None, None),
        }
    } else {
        let required = forced.is_some();
        messages = tools::rewrite_for_generic(messages, Some(offered), required, parallel)?;
        if offered.is_empty() {
            (None, ToolMode::None, None)
        } else {
            let allowed = forced.as_deref().unwrap_or(offered);
            (None, ToolMode::Generic, Some(tools::output_schema(allowed, required, parallel)?))
        }
    };
    let kwargs = b.chat_template_kwargs.clone().unwrap_or_default();
    Ok((ChatPrompt { messages, tools, add_generation_prompt, prefill, kwargs }, mode, schema))
}

/// Decodes a chat body and runs every model-free check, in the server's order.
/// `native_tools`: the chat template has a tool syntax of its own (else tools take the
/// generic format, [`tools`]).
pub fn check_chat(body: &[u8], defaults: &Defaults, native_tools: bool) -> Result<ChatRequest, RequestError> {
    check_chat_body(decode(body)?, defaults, native_tools)
}

/// [`check_chat`] of a chat body built as a JSON value (the [`dialects`]' rewrites), without
/// writing it out and reading it back.
pub fn check_chat_value(body: serde_json::Value, defaults: &Defaults, native_tools: bool) -> Result<ChatRequest, RequestError> {
    let b: ChatBody = serde_json::from_value(body).map_err(|e| RequestError::new(format!("invalid JSON body: {e}")))?;
    check_chat_body(b, defaults, native_tools)
}

fn check_chat_body(b: ChatBody, defaults: &Defaults, native_tools: bool) -> Result<ChatRequest, RequestError> {
    let (prompt, mode, schema) = chat_prompt_of(&b, native_tools)?;
    let mut gen = b.gen;
    if let Some(schema) = schema {
        if gen.constraint()?.is_some() {
            return Err(match mode {
                ToolMode::Generic => RequestError::on(
                    "tools",
                    "tools: this model's chat template has no tool syntax, so calls are answered in a JSON format of their own, which cannot be combined with response_format, json_schema or grammar",
                ),
                _ => RequestError::on("tool_choice", "tool_choice: a forced call cannot be combined with response_format, json_schema or grammar"),
            });
        }
        gen.json_schema = Some(schema);
    }
    let reasoning = b
        .reasoning_format
        .as_deref()
        .map(|f| ReasoningFormat::from_name(f).ok_or_else(|| RequestError::on("reasoning_format", format!("reasoning_format must be \"none\", \"deepseek\" or \"auto\", got {f:?}"))))
        .transpose()?;
    let n = gen.choices()?;
    let limits = gen.limits_with(defaults)?;
    Ok(ChatRequest { prompt, tools: mode, reasoning, limits, n })
}

/// Runs `endpoint`'s model-free checks on `body` through the functions the server's edge calls
/// ([`check_completion`], [`check_chat`], [`decode`], [`check_ids`]), with the built-in
/// defaults (what the fuzzer and tine-api's tests drive). Returns a short summary of what was
/// accepted.
pub fn decode_any(endpoint: Endpoint, body: &[u8], vocab: usize) -> Result<String, RequestError> {
    let defaults = Defaults::default();
    Ok(match endpoint {
        Endpoint::Completion => {
            let r = check_completion(body, &defaults)?;
            let mut sizes = Vec::new();
            for p in &r.prompts {
                sizes.push(match p {
                    Prompt::Text(t) => t.len(),
                    Prompt::Tokens(ids) => check_ids(ids, vocab)?.len(),
                    Prompt::Mixed(parts) => parts.len(),
                });
            }
            let sizes: Vec<String> = sizes.iter().map(|n| n.to_string()).collect();
            format!("completion prompt {} n_predict {} n {}", sizes.join("+"), r.limits.n_predict, r.n)
        }
        Endpoint::Chat => chat_summary(|native| check_chat(body, &defaults, native))?,
        Endpoint::Messages => {
            let v = dialects::anthropic_to_chat(body)?;
            chat_summary(|native| check_chat_value(v.clone(), &defaults, native))?
        }
        Endpoint::Responses => {
            let v = dialects::responses_to_chat(body)?;
            chat_summary(|native| check_chat_value(v.clone(), &defaults, native))?
        }
        Endpoint::Embeddings => {
            let r = check_embeddings(body)?;
            for p in &r.prompts {
                if let Prompt::Tokens(ids) = p {
                    check_ids(ids, vocab)?;
                }
            }
            format!("embeddings {} inputs normalize {}", r.prompts.len(), r.normalize)
        }
        Endpoint::Tokenize => format!("tokenize {} bytes", decode::<TokenizeBody>(body)?.text()?.0.len()),
        Endpoint::Detokenize => format!("detokenize {} ids", check_ids(&decode::<DetokenizeBody>(body)?.tokens, vocab)?.len()),
    })
}

/// [`decode_any`]'s chat summary, through both kinds of template: one with a tool syntax, and
/// one without (the generic format). `check` is the server's check for the endpoint.
fn chat_summary(check: impl Fn(bool) -> Result<ChatRequest, RequestError>) -> Result<String, RequestError> {
    check(true)?;
    let r = check(false)?;
    let chars: usize = r.prompt.messages.iter().map(|m| m["content"].as_str().map_or(0, str::len)).sum();
    Ok(format!("chat {} messages {chars} bytes n_predict {}", r.prompt.messages.len(), r.limits.n_predict))
}
