//! llama-server's `/infill` (fill-in-the-middle): `input_prefix`, `input_suffix`, `input_extra`
//! (files of context, `{"filename", "text"}`) and an optional `prompt` become one prompt in the
//! repo-level FIM pattern llama-server builds, for a model whose vocabulary has FIM tokens
//! (`tine_runtime::FimTokens`); the rest of the body is a `/completion` body, and the answer is
//! `/completion`'s. A model without them gets llama-server's 501.
//!
//! ```text
//! [FIM_REP]myproject\n [FIM_SEP]filename0\n extra 0 ... [FIM_SEP]filename\n
//! [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]
//! ```
//!
//! The prefix keeps its last `3 * batch / 4` tokens, the suffix its first
//! `batch / 4 - 2 - prompt` tokens (`-b/--batch-size`, llama-server's 3:1 split), and the extra
//! context its last `ctx - batch - 2 * n_predict` tokens (the server's `--n-predict`), as
//! llama-server takes them.

use super::*;
use tine_api::Prompt;

/// llama.cpp's separator between extra chunks where the vocabulary has no file separator.
const CHUNK_SEPARATOR: &str = "\n\n--- snippet ---\n\n";

/// The infill fields of a body, checked as llama-server checks them.
struct InfillInput {
    prefix: Value,
    suffix: Value,
    extra: Vec<(String, String)>,
    prompt: String,
}

fn take_input(obj: &mut serde_json::Map<String, Value>) -> Result<InfillInput, ApiError> {
    let field = |obj: &mut serde_json::Map<String, Value>, name: &str| -> Result<Value, ApiError> {
        let v = obj.remove(name).ok_or_else(|| ApiError::bad(format!("\"{name}\" is required")).param(name))?;
        let ok = v.is_string() || v.as_array().is_some_and(|a| a.iter().all(|x| x.is_string() || x.is_i64() || x.is_u64()));
        if !ok {
            return Err(ApiError::bad(format!("\"{name}\" must be a string, or an array of strings and token ids")).param(name));
        }
        Ok(v)
    };
    let prefix = field(obj, "input_prefix")?;
    let suffix = field(obj, "input_suffix")?;
    let prompt = match obj.remove("prompt") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(_) => return Err(ApiError::bad("\"prompt\" must be a string").param("prompt")),
    };
    let extra = match obj.remove("input_extra") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(chunks)) => chunks
            .into_iter()
            .map(|c| {
                let text = c.get("text").and_then(Value::as_str).ok_or_else(|| ApiError::bad("extra_context chunk must contain a \"text\" field with a string value").param("input_extra"))?;
                let filename = match c.get("filename") {
                    None | Some(Value::Null) => "tmp",
                    Some(Value::String(f)) => f.as_str(),
                    Some(_) => return Err(ApiError::bad("extra_context chunk's \"filename\" field must be a string").param("input_extra")),
                };
                Ok((filename.to_owned(), text.to_owned()))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::bad("\"input_extra\" must be an array of {\"filename\": string, \"text\": string}").param("input_extra")),
    };
    Ok(InfillInput { prefix, suffix, extra, prompt })
}

/// llama.cpp's `tokenize_mixed`: a string, or an array of strings (tokenized, no specials) and
/// token ids.
fn tokenize_mixed(st: &AppState, v: &Value, name: &str) -> Result<Vec<u32>, ApiError> {
    let tok = &st.model.tokenizer;
    match v {
        Value::String(s) => Ok(tok.encode(s, false, false)),
        Value::Array(items) => {
            let mut out = Vec::new();
            for x in items {
                match x {
                    Value::String(s) => out.extend(tok.encode(s, false, false)),
                    _ => {
                        let id = x.as_i64().ok_or_else(|| ApiError::bad(format!("\"{name}\": a token id out of range")).param(name))?;
                        out.extend(checked_ids(st, &[id]).map_err(|e| e.param(name))?);
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::bad(format!("\"{name}\" must be a string or an array")).param(name)),
    }
}

/// The prompt llama-server's `format_prompt_infill` builds (see the module's comment).
fn infill_tokens(st: &AppState, input: &InfillInput, fim: &tine_runtime::FimTokens) -> Result<Vec<u32>, ApiError> {
    let tok = &st.model.tokenizer;
    let (pre, suf, mid) = match (fim.pre, fim.suf, fim.mid) {
        (Some(p), Some(s), Some(m)) => (p, s, m),
        _ => return Err(ApiError::internal("infill without FIM tokens")),
    };
    let mut prefix = tokenize_mixed(st, &input.prefix, "input_prefix")?;
    let mut suffix = tokenize_mixed(st, &input.suffix, "input_suffix")?;
    let prompt = tok.encode(&input.prompt, false, true);
    let mut extra = Vec::new();
    if let Some(rep) = fim.rep {
        extra.push(rep);
        extra.extend(tok.encode("myproject\n", false, false));
    }
    for (filename, text) in &input.extra {
        match fim.sep {
            Some(sep) => {
                extra.push(sep);
                extra.extend(tok.encode(&format!("{filename}\n"), false, false));
            }
            None => extra.extend(tok.encode(CHUNK_SEPARATOR, false, false)),
        }
        extra.extend(tok.encode(text, false, false));
    }
    if let Some(sep) = fim.sep {
        extra.push(sep);
        extra.extend(tok.encode("filename\n", false, false));
    }
    let batch = st.config.batch as i64;
    let n_prefix = (prefix.len() as i64).min(3 * (batch / 4)).max(0) as usize;
    let n_suffix = (suffix.len() as i64).min(0.max(batch / 4 - (2 + prompt.len() as i64))).max(0) as usize;
    let n_extra = (extra.len() as i64).min(0.max(st.config.ctx_size as i64 - batch - 2 * st.config.defaults.n_predict)).max(0) as usize;
    prefix.drain(..prefix.len() - n_prefix);
    suffix.truncate(n_suffix);
    let mut out = Vec::with_capacity(n_extra + prefix.len() + suffix.len() + prompt.len() + 4);
    out.extend_from_slice(&extra[extra.len() - n_extra..]);
    if tok.adds_bos() {
        out.extend(tok.bos_token());
    }
    out.push(pre);
    out.extend(prefix);
    out.extend(prompt);
    out.push(suf);
    out.extend(suffix);
    out.push(mid);
    Ok(out)
}

pub(crate) async fn infill(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let fim = st.model.info.fim;
    let missing = fim.missing();
    if !missing.is_empty() {
        return Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, format!("Infill is not supported by this model: {}", missing.trim_end())));
    }
    let bytes = read_body(&st, body).await?;
    let mut v: Value = tine_api::decode(&bytes)?;
    let Some(obj) = v.as_object_mut() else { return Err(ApiError::bad("the body must be a JSON object")) };
    let input = take_input(obj)?;
    // The rest is a `/completion` body; its prompt is built here.
    obj.insert("prompt".into(), json!(""));
    let body = serde_json::to_vec(&v).map_err(|e| ApiError::internal(e.to_string()))?;
    let mut req = tine_api::check_completion(&body, &st.config.defaults)?;
    let tokens = prepare(&st, move |st| infill_tokens(st, &input, &fim)).await?;
    req.prompts = vec![Prompt::Tokens(tokens.into_iter().map(i64::from).collect())];
    llama::completion_run(st, req).await
}
