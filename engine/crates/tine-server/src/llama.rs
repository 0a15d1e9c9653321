//! llama-server's own dialect: `/health`, `/props`, `/metrics`, `/tokenize`, `/detokenize`,
//! `/apply-template` and `/completion` with its JSON shapes.

use super::*;

pub(crate) async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub(crate) fn default_settings(st: &AppState) -> Value {
    let d = &st.config.defaults.sampling;
    // llama-server reports the default seed as 4294967295 (LLAMA_DEFAULT_SEED: a random one).
    let seed = d.seed.map_or(json!(u32::MAX), |s| json!(s));
    json!({
        "n_ctx": st.config.ctx_size,
        "seed": seed,
        "params": {
            "n_predict": st.config.defaults.n_predict, "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
            "repeat_penalty": d.repeat_penalty, "repeat_last_n": d.repeat_last_n, "presence_penalty": d.presence_penalty,
            "frequency_penalty": d.frequency_penalty, "seed": seed, "n_probs": 0, "ignore_eos": false, "stop": [], "cache_prompt": true, "n_keep": st.config.defaults.n_keep, "context_shift": st.config.context_shift
        }
    })
}

pub(crate) async fn props(State(st): State<Shared>) -> Json<Value> {
    let d = &st.scheduler.drafting;
    let p = d.factory.config.params;
    // `type`: every request's default; `types`: what a request may choose (`speculative.type`).
    let speculative = json!({"type": d.default.to_string(), "types": d.offers.iter().map(|c| c.to_string()).collect::<Vec<_>>(), "n_max": p.n_max, "n_min": p.n_min, "p_min": p.p_min});
    Json(json!({
        "default_generation_settings": default_settings(&st),
        "total_slots": st.scheduler.slots,
        "model_alias": st.model_id,
        "endpoint_slots": st.config.slots_endpoint,
        "endpoint_metrics": st.config.metrics,
        "model_path": st.model.info.path.display().to_string(),
        "modalities": {"vision": false, "audio": false},
        "chat_template": st.template.source().unwrap_or(st.template.name()),
        "bos_token": st.model.tokenizer.bos_token().and_then(|b| st.model.tokenizer.token_text(b)).unwrap_or(""),
        "eos_token": st.model.tokenizer.eos_token().and_then(|b| st.model.tokenizer.token_text(b)).unwrap_or(""),
        "build_info": env!("TINE_BUILD_INFO"),
        "speculative": speculative,
    }))
}

pub(crate) async fn metrics_text(State(st): State<Shared>) -> Result<Response, ApiError> {
    if !st.config.metrics {
        return Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "This server does not support metrics endpoint. Start it with `--metrics`"));
    }
    let views = st.scheduler.slot_views();
    let busy = views.iter().filter(|v| v.is_processing).count();
    let batches = st.scheduler.batch_sizes().snapshot();
    let load = metrics::Load { slots: views.len(), busy, queued: st.admission.in_flight().saturating_sub(busy), pool: st.scheduler.pool_stats(), batches };
    // llama-server's header: when this process started, so a scraper can tell a restart.
    let started = axum::http::HeaderValue::from(st.started);
    Ok((
        [(axum::http::header::CONTENT_TYPE, axum::http::HeaderValue::from_static("text/plain; version=0.0.4")), (axum::http::HeaderName::from_static("process-start-time-unix"), started)],
        st.metrics.render(&load),
    )
        .into_response())
}

pub(crate) async fn tokenize(State(st): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let raw = read_body(&st, body).await?;
    // vLLM's chat form (request routers ask it for a chat's tokens): the prompt a chat would run.
    if tine_api::decode::<Value>(&raw)?.get("messages").is_some() {
        let p = tine_api::check_chat_prompt(&raw, st.template.tool_syntax().is_some())?;
        let (_, ids) = prepare(&st, move |st| chat_prompt(st, &p)).await?;
        return Ok(Json(json!({"tokens": ids, "count": ids.len()})));
    }
    let b: TokenizeBody = tine_api::decode(&raw)?;
    b.text()?;
    let (ids, b) = prepare(&st, move |st| {
        let (text, special) = b.text()?;
        Ok((st.model.tokenizer.encode(text, special, b.parse_special), b))
    })
    .await?;
    if b.with_pieces {
        let pieces: Vec<Value> = ids.iter().map(|&id| json!({"id": id, "piece": String::from_utf8_lossy(&st.model.tokenizer.token_bytes(id, true))})).collect();
        return Ok(Json(json!({"tokens": pieces})));
    }
    Ok(Json(json!({"tokens": ids})))
}

pub(crate) async fn detokenize(State(st): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let b: DetokenizeBody = json_body(&st, body).await?;
    let ids = checked_ids(&st, &b.tokens)?;
    Ok(Json(json!({"content": st.model.tokenizer.decode(&ids, true)})))
}

pub(crate) fn timings_json(t: &Timings) -> Value {
    json!({
        "cache_n": t.cached_n,
        "prompt_n": t.prompt_n, "prompt_ms": t.prompt_ms, "prompt_per_token_ms": if t.prompt_n > 0 { t.prompt_ms / t.prompt_n as f64 } else { 0.0 }, "prompt_per_second": t.prompt_per_second(),
        "predicted_n": t.predicted_n, "predicted_ms": t.predicted_ms, "predicted_per_token_ms": if t.predicted_n > 1 { t.predicted_ms / (t.predicted_n - 1) as f64 } else { 0.0 }, "predicted_per_second": t.predicted_per_second(),
        "draft_n": t.draft.draft_n, "draft_n_accepted": t.draft.draft_n_accepted, "draft_verify_steps": t.draft.draft_verify_steps,
    })
}

/// llama-server's `prompt_progress` object.
pub(crate) fn progress_json(p: &scheduler::Progress) -> Value {
    // `processed` counts the cached tokens too, as llama-server counts them.
    let t = &p.timings;
    json!({"total": p.total, "cache": t.cached_n, "processed": t.cached_n + t.prompt_n, "time_ms": t.prompt_ms})
}

/// One token's `completion_probabilities` entry: log-probabilities (`logprob`,
/// `top_logprobs`), or with `post_sampling_probs` the probabilities after the sampler's
/// filters (`prob`, `top_probs`), as llama-server writes them.
pub(crate) fn prob_json(st: &AppState, p: &TokenProb, post_sampling: bool) -> Value {
    let entry = |id: u32, lp: f32| {
        let bytes = st.model.tokenizer.token_bytes(id, true);
        let mut e = json!({"id": id, "token": String::from_utf8_lossy(&bytes), "bytes": bytes});
        if post_sampling {
            e["prob"] = json!(lp.exp());
        } else {
            e["logprob"] = json!(lp);
        }
        e
    };
    let mut v = entry(p.id, p.logprob);
    v[if post_sampling { "top_probs" } else { "top_logprobs" }] = Value::Array(p.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
    v
}

/// llama-server's `response_fields`: only the listed fields, each under its path (`a/b` is
/// field `b` of object `a`); a path that names nothing is left out.
pub(crate) fn only_fields(v: Value, fields: &[String]) -> Value {
    if fields.is_empty() {
        return v;
    }
    let mut out = serde_json::Map::new();
    for f in fields {
        let found = f.split('/').try_fold(&v, |at, key| at.get(key));
        if let Some(x) = found {
            out.insert(f.clone(), x.clone());
        }
    }
    Value::Object(out)
}

pub(crate) async fn completion(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let req = completion_body(&st, body).await?;
    completion_run(st, req).await
}

/// `/completion` for a request whose body was read and checked.
pub(crate) async fn completion_run(st: Shared, req: tine_api::CompletionRequest) -> Result<Response, ApiError> {
    let (vs, prompt_texts) = prepare(&st, move |st| {
        let prompts = prompt_tokens(st, req.prompts)?;
        let vs = validate_many(st, prompts, &req.limits, req.n)?;
        let texts: Vec<String> = vs.iter().map(|v| st.model.tokenizer.decode(&v.request.prompt, true)).collect();
        Ok((vs, texts))
    })
    .await?;
    let settings: Vec<Value> = vs.iter().map(|v| generation_settings(&st, v)).collect();
    let single = vs.len() == 1;
    let (stream, return_tokens, n_probs, per_token) = (vs[0].stream, vs[0].return_tokens, vs[0].n_probs, vs[0].timings_per_token);
    let (post, fields) = (vs[0].request.post_sampling_probs, vs[0].response_fields.clone());
    let rxs = submit_all(&st, &vs)?;
    if stream {
        let st2 = st.clone();
        // Several prompts: every chunk carries its result's `index`, as llama-server's do.
        let stream = merged(rxs).map(move |(i, ev)| {
            let mut j = match ev {
                Event::Token { id, text, prob, timings } => {
                    let mut j = json!({"content": text, "stop": false, "tokens": [id]});
                    if let Some(p) = prob {
                        j["completion_probabilities"] = json!([prob_json(&st2, &p, post)]);
                    }
                    if per_token {
                        j["timings"] = timings_json(&timings);
                    }
                    j
                }
                Event::Progress(p) => {
                    let mut j = json!({"content": "", "tokens": [], "stop": false, "prompt_progress": progress_json(&p)});
                    if per_token {
                        j["timings"] = timings_json(&p.timings);
                    }
                    j
                }
                Event::Done(s) => {
                    log_request(&st2, &s);
                    only_fields(final_completion_json(&st2, &s, "", Vec::new(), false, &prompt_texts[i], &settings[i]), &fields)
                }
                Event::Error(e) => {
                    st2.metrics.failed();
                    ApiError::from(&e).body()
                }
            };
            if !single {
                j["index"] = json!(i);
            }
            sse_json(j)
        });
        return Ok(Sse::new(stream).into_response());
    }
    let results = collect_all(&st, rxs).await?;
    let mut out: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (s, probs))| {
            let mut j = final_completion_json(&st, s, &s.text, probs.iter().map(|p| prob_json(&st, p, post)).collect(), return_tokens, &prompt_texts[i], &settings[i]);
            if n_probs == 0 {
                j.as_object_mut().expect("object").remove("completion_probabilities");
            }
            let mut j = only_fields(j, &fields);
            if !single {
                j["index"] = json!(i);
            }
            j
        })
        .collect();
    // One prompt gets one object; several get an array (llama-server).
    Ok(Json(if single { out.remove(0) } else { Value::Array(out) }).into_response())
}

/// llama-server's `generation_settings`: every field its `task_params::to_json` writes, with
/// what this request ran with where Tine has the setting, and llama.cpp's value for "off" where
/// it has not (dynamic temperature, XTC, typical-p, DRY, mirostat, adaptive-p, top-n-sigma:
/// samplers Tine does not run). `logit_bias` as llama-server lists it, `{"bias", "token"}` with
/// `null` for -inf, the end-of-generation tokens banned by `ignore_eos` included. The seed is
/// filled in from the summary (a random one when none was given).
pub(crate) fn generation_settings(st: &AppState, req: &Validated) -> Value {
    let (r, stream): (&GenerateRequest, bool) = (&req.request, req.stream);
    let p = &r.sampling;
    let mut bias: Vec<Value> = r.logit_bias.iter().map(|&(t, b)| json!({"bias": if b.is_finite() { json!(b) } else { Value::Null }, "token": t})).collect();
    if r.ignore_eos {
        bias.extend(st.model.end_of_generation_tokens().iter().map(|&t| json!({"bias": null, "token": t})));
    }
    let mut v = json!({
        "n_ctx": st.config.ctx_size, "seed": p.seed, "temperature": p.temperature, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
        "repeat_last_n": p.repeat_last_n, "repeat_penalty": p.repeat_penalty, "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
        "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n", ":", "\"", "*"],
        "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9,
    });
    let rest = json!({
        "stop": r.stop, "max_tokens": r.n_predict, "n_predict": r.n_predict, "n_keep": r.n_keep, "n_discard": 0, "ignore_eos": r.ignore_eos, "stream": stream,
        "logit_bias": bias, "n_probs": r.n_probs, "min_keep": 0, "grammar": "", "grammar_lazy": false, "grammar_triggers": [], "preserved_tokens": [],
        "chat_format": "Content-only", "reasoning_format": st.config.reasoning_format.name(), "reasoning_in_content": false, "generation_prompt": "",
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
        "speculative.types": st.scheduler.drafting.choice(r.drafter).to_string(),
        "timings_per_token": req.timings_per_token, "post_sampling_probs": r.post_sampling_probs, "backend_sampling": false, "lora": [],
        "cache_prompt": r.cache_prompt, "context_shift": r.context_shift,
    });
    if let (Some(v), Value::Object(rest)) = (v.as_object_mut(), rest) {
        v.extend(rest);
    }
    if st.scheduler.drafting.choice(r.drafter) != tine_spec::SpecChoice::Off {
        let d = r.speculative.unwrap_or(st.scheduler.drafting.factory.config.params);
        v["speculative.n_max"] = json!(d.n_max);
        v["speculative.n_min"] = json!(d.n_min);
        v["speculative.p_min"] = json!(d.p_min);
    }
    v
}

/// `/completion`'s final object; `probs` is its `completion_probabilities` ([`prob_json`]'s).
pub(crate) fn final_completion_json(st: &AppState, s: &Summary, content: &str, probs: Vec<Value>, return_tokens: bool, prompt: &str, settings: &Value) -> Value {
    let mut settings = settings.clone();
    settings["seed"] = json!(s.seed);
    json!({
        "content": content,
        "tokens": if return_tokens { json!(s.tokens) } else { json!([]) },
        "id_slot": s.slot,
        "stop": true,
        "model": st.model_id,
        "tokens_predicted": s.timings.predicted_n,
        "tokens_evaluated": s.prompt_tokens,
        "generation_settings": settings,
        "prompt": prompt,
        "has_new_line": content.contains('\n'),
        "truncated": s.truncated,
        "stop_type": s.stop_type.as_str(),
        "stopping_word": s.stopping_word,
        "tokens_cached": s.timings.cached_n + s.timings.prompt_n + s.timings.predicted_n,
        "timings": timings_json(&s.timings),
        "completion_probabilities": probs,
    })
}

/// llama-server's `/apply-template`: the prompt a chat request would run.
pub(crate) async fn apply_template(State(st): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let p = tine_api::check_chat_prompt(&read_body(&st, body).await?, st.template.tool_syntax().is_some())?;
    let (text, _) = prepare(&st, move |st| chat_prompt(st, &p)).await?;
    Ok(Json(json!({ "prompt": text })))
}
