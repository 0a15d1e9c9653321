//! The request edge: a body read within its limits, decoded (400 naming the field), and
//! validated once into a [`Validated`] request, the one type the rest of the server submits.
//! The model-free checks are tine-api's; the ones that need the model (token ids, the context
//! size, the chat template, a grammar compiled against the vocabulary) are here. The heavy ones
//! (tokenizing, rendering, compiling a grammar: up to a second) run on tokio's blocking pool
//! ([`prepare`]), so the async workers keep answering.

use super::*;

/// Reads the whole body within the size and time limits.
pub(crate) async fn read_body(st: &AppState, body: Body) -> Result<Bytes, ApiError> {
    let limit = st.config.max_body_bytes;
    match tokio::time::timeout(st.config.body_timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(ApiError::new(StatusCode::REQUEST_TIMEOUT, format!("the request body did not arrive within {} s", st.config.body_timeout.as_secs()))),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let too_big = std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if too_big {
                Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is larger than the limit of {limit} bytes")))
            } else {
                Err(ApiError::bad(format!("cannot read the request body: {}", tine_engine::error_chain(&e))))
            }
        }
    }
}

pub(crate) async fn json_body<T: serde::de::DeserializeOwned>(st: &AppState, body: Body) -> Result<T, ApiError> {
    Ok(tine_api::decode(&read_body(st, body).await?)?)
}

/// A completion body read and through tine-api's model-free checks ([`tine_api::check_completion`],
/// the function the fuzzer drives).
pub(crate) async fn completion_body(st: &AppState, body: Body) -> Result<tine_api::CompletionRequest, ApiError> {
    Ok(tine_api::check_completion(&read_body(st, body).await?, &st.config.defaults)?)
}

/// A chat body read and through tine-api's model-free checks ([`tine_api::check_chat`]).
pub(crate) async fn chat_body(st: &AppState, body: Body) -> Result<tine_api::ChatRequest, ApiError> {
    Ok(tine_api::check_chat(&read_body(st, body).await?, &st.config.defaults, st.template.tool_syntax().is_some())?)
}

pub(crate) fn checked_ids(st: &AppState, ids: &[i64]) -> Result<Vec<u32>, ApiError> {
    Ok(tine_api::check_ids(ids, st.model.info.vocab_size)?)
}

/// Request fields after validation.
pub(crate) struct Validated {
    pub(crate) request: ValidRequest,
    pub(crate) stream: bool,
    /// `stream_options.include_usage`: a chat stream ends with a usage chunk of no choices.
    pub(crate) include_usage: bool,
    /// `id_slot`: the slot it must run in.
    pub(crate) slot: Option<usize>,
    /// `timings_per_token`: every streamed chunk carries the timings so far.
    pub(crate) timings_per_token: bool,
    /// `verbose`: a chat answer carries `__verbose`.
    pub(crate) verbose: bool,
    /// `return_progress`: a stream carries the prompt's evaluation progress.
    pub(crate) return_progress: bool,
    pub(crate) return_tokens: bool,
    pub(crate) n_probs: usize,
    /// `response_fields`: `/completion` answers only these (empty: all).
    pub(crate) response_fields: Vec<String>,
    /// OpenAI log-probabilities, with this many alternatives.
    pub(crate) logprobs: Option<usize>,
}

/// `speculative.type`, read against what this server serves (400 naming what it offers).
fn spec_choice(drafting: &crate::scheduler::Drafting, model: &tine_runtime::Model, text: &str) -> Result<tine_spec::SpecChoice, ApiError> {
    let offers = || drafting.offers.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ");
    let bad = |msg: String| ApiError { param: Some("speculative.type".into()), ..ApiError::bad(msg) };
    let choice: tine_spec::SpecChoice = text.parse().map_err(|e| bad(format!("speculative.type: {e}; this server offers {} (and ngram,TYPE chains)", offers())))?;
    if !drafting.factory.serves(choice, model) {
        let why = match choice.spec_type() {
            Some(tine_spec::SpecType::DraftMtp) => "this model has no NextN head",
            _ => "its weights are loaded at start-up (--spec-type with --mtp-head or -md)",
        };
        return Err(bad(format!("speculative.type `{choice}`: {why}; this server offers {}", offers())));
    }
    Ok(choice)
}

/// Validates one result's request: tine-api's model-free checks are done ([`tine_api::Limits`]);
/// here what needs the model (bias texts, a grammar compiled against the vocabulary), then the
/// engine's own [`GenerateRequest::validate`] against the context size, once. `choice` is the
/// result's index among the request's `n` (it samples with `seed + choice`).
pub(crate) fn validate(st: &AppState, prompt: Vec<u32>, l: &tine_api::Limits, choice: usize) -> Result<Validated, ApiError> {
    let mut l = l.clone();
    if let Some(i) = l.id_slot.filter(|&i| i >= st.scheduler.slots) {
        return Err(ApiError { param: Some("id_slot".into()), ..ApiError::bad(format!("id_slot {i}: this server has {} slot(s) (0..{})", st.scheduler.slots, st.scheduler.slots)) });
    }
    if let Some(seed) = l.sampling.seed.as_mut() {
        *seed = seed.wrapping_add(choice as u64);
    }
    let drafting = &st.scheduler.drafting;
    let drafter = l.spec_type.as_deref().map(|t| spec_choice(drafting, &st.model, t)).transpose()?;
    let speculative = match drafting.choice(drafter) {
        tine_spec::SpecChoice::On { .. } if !l.draft.is_empty() => {
            let (d, o) = (drafting.factory.config.params, l.draft);
            let p = tine_spec::DraftParams { n_max: o.n_max.unwrap_or(d.n_max), n_min: o.n_min.unwrap_or(d.n_min), p_min: o.p_min.unwrap_or(d.p_min), adaptive: d.adaptive };
            p.check().map_err(|e| ApiError::bad(format!("speculative: {e}")))?;
            Some(p)
        }
        _ => None,
    };
    let logit_bias = resolve_bias(st, &l.logit_bias)?;
    let grammar = l.constraint.as_ref().map(|(field, c)| compile_constraint(st, field, c)).transpose()?;
    let request = GenerateRequest {
        speculative,
        drafter,
        prompt,
        n_predict: l.n_predict,
        sampling: l.sampling,
        stop: l.stop,
        ignore_eos: l.ignore_eos,
        n_probs: l.n_probs,
        post_sampling_probs: l.post_sampling_probs,
        cache_prompt: l.cache_prompt,
        logit_bias,
        grammar,
        context_shift: st.config.context_shift,
        n_keep: l.n_keep,
    };
    let request = request.validate(st.config.ctx_size).map_err(|e| ApiError::from(&e))?;
    Ok(Validated {
        request,
        stream: l.stream,
        include_usage: l.include_usage,
        slot: l.id_slot,
        timings_per_token: l.timings_per_token,
        verbose: l.verbose,
        return_progress: l.return_progress,
        return_tokens: l.return_tokens,
        n_probs: l.n_probs,
        response_fields: l.response_fields.clone(),
        logprobs: l.logprobs,
    })
}

/// A request's schema or grammar compiled against the vocabulary (400 naming the field when
/// it does not compile).
pub(crate) fn compile_constraint(st: &AppState, field: &str, c: &tine_api::Constraint) -> Result<tine_engine::grammar::Grammar, ApiError> {
    use tine_engine::grammar::{GrammarSpec, Grammars};
    let grammars = st.grammars.get_or_init(|| Grammars::new(&st.model).map(Arc::new).map_err(|e| e.to_string())).clone().map_err(ApiError::internal)?;
    let spec = match c {
        tine_api::Constraint::JsonSchema(v) => GrammarSpec::JsonSchema(v.clone()),
        tine_api::Constraint::Gbnf(g) => GrammarSpec::Gbnf(g.clone()),
        tine_api::Constraint::Lark(g) => GrammarSpec::Lark(g.clone()),
    };
    grammars.compile(&spec).map_err(|e| ApiError::new(error::grammar_status(&e), format!("{field}: {e}")))
}

/// `logit_bias` against the vocabulary: ids checked, a text biases each of its tokens (llama-server).
pub(crate) fn resolve_bias(st: &AppState, entries: &[(tine_api::BiasTarget, f32)]) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::new();
    for (target, bias) in entries {
        match target {
            tine_api::BiasTarget::Id(id) => out.extend(tine_api::check_ids(&[*id], st.model.info.vocab_size)?.into_iter().map(|t| (t, *bias))),
            tine_api::BiasTarget::Text(text) => out.extend(st.model.tokenizer.encode(text, false, false).into_iter().map(|t| (t, *bias))),
        }
    }
    Ok(out)
}

/// The prompts as tokens: texts tokenized (BOS added, special tokens parsed), ids checked
/// against the vocabulary.
pub(crate) fn prompt_tokens(st: &AppState, prompts: Vec<Prompt>) -> Result<Vec<Vec<u32>>, ApiError> {
    prompts
        .into_iter()
        .map(|p| match p {
            Prompt::Text(t) => Ok(st.model.tokenizer.encode(&t, true, true)),
            Prompt::Tokens(ids) => checked_ids(st, &ids),
            // llama.cpp's `tokenize_mixed`: BOS only before a first part that is a text.
            Prompt::Mixed(parts) => {
                let mut out = Vec::new();
                for (i, part) in parts.into_iter().enumerate() {
                    match part {
                        tine_api::PromptPart::Id(id) => out.extend(checked_ids(st, &[id])?),
                        tine_api::PromptPart::Text(t) => out.extend(st.model.tokenizer.encode(&t, i == 0, true)),
                    }
                }
                Ok(out)
            }
        })
        .collect()
}

/// Every result a request asks for: each prompt `n` times, choice `i` sampling with `seed + i`
/// (a request without a seed draws one per choice). Each is validated on its own (a grammar
/// gets its own parser state); tine-api bounded `prompts x n`.
pub(crate) fn validate_many(st: &AppState, prompts: Vec<Vec<u32>>, l: &tine_api::Limits, n: usize) -> Result<Vec<Validated>, ApiError> {
    let mut out = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        for i in 0..n {
            out.push(validate(st, prompt.clone(), l, i)?);
        }
    }
    Ok(out)
}

/// The chat prompt as tokens: the template's text (`ChatTemplate::prompt`, as the CLI renders it).
/// The template's variables: `enable_thinking` true (llama-server's default, `--reasoning auto`),
/// under the server's `--chat-template-kwargs`, under the request's own.
pub(crate) fn chat_prompt(st: &AppState, p: &tine_api::ChatPrompt) -> Result<(String, Vec<u32>), ApiError> {
    let mut kwargs = serde_json::Map::from_iter([("enable_thinking".to_owned(), Value::Bool(true))]);
    kwargs.extend(st.config.chat_template_kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
    kwargs.extend(p.kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
    st.template.prompt_with(&st.model, &p.messages, p.tools.as_ref(), p.add_generation_prompt, p.prefill.as_deref(), Some(&kwargs)).map_err(|e| match e {
        // The server's own template is broken: not the client's fault.
        TemplateError::Syntax(_) | TemplateError::Read { .. } => ApiError::internal(e.to_string()),
        _ => ApiError::bad(e.to_string()),
    })
}

/// Runs a request's heavy preparation (tokenizing, rendering the chat template, compiling a
/// grammar) on tokio's blocking pool, so the async workers keep reading other requests meanwhile.
pub(crate) async fn prepare<T: Send + 'static>(st: &Shared, f: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    let st = st.clone();
    tokio::task::spawn_blocking(move || f(&st)).await.map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))?
}
