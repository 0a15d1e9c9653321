//! Embeddings with `--embeddings`: `/embedding` in llama-server's shape and `/v1/embeddings` in
//! OpenAI's. Each input runs on a sequence of its own (BOS added, as llama-server tokenizes
//! them); its final hidden states after the output norm are pooled (`--pooling`) and, when
//! pooled, normalized (`embd_normalize`, Euclidean by default), as llama-server does.

use super::*;
use tine_engine::embeddings::{normalize, pool, Pooling};

/// The most tokens one embedding request may hold over all its inputs: it runs alone
/// (`embedding_turn`), and unpooled it answers a row of floats per token.
const MAX_EMBEDDING_TOKENS: usize = 65_536;

fn pooling(st: &AppState) -> Result<Pooling, ApiError> {
    st.config.embeddings.ok_or_else(|| ApiError::new(StatusCode::NOT_IMPLEMENTED, "This server does not support embeddings. Start it with `--embeddings`"))
}

/// One input's embedding rows (pooled, and normalized unless unpooled) and its token count.
type Embedded = (Vec<Vec<f32>>, usize);

/// Every input's [`Embedded`].
fn compute(st: &AppState, req: tine_api::EmbeddingRequest, pooling: Pooling) -> Result<Vec<Embedded>, ApiError> {
    let inputs = prompt_tokens(st, req.prompts)?;
    let _permit = st
        .admission
        .try_admit()
        .ok_or_else(|| ApiError::unavailable(format!("the server is busy: {} requests are in progress or queued (limit {}); retry later", st.admission.in_flight(), st.admission.limit())))?;
    let total: usize = inputs.iter().map(Vec::len).sum();
    if total > MAX_EMBEDDING_TOKENS {
        return Err(ApiError { param: Some("input".into()), ..ApiError::bad(format!("the inputs hold {total} tokens; one request may embed at most {MAX_EMBEDDING_TOKENS}")) });
    }
    for ids in &inputs {
        if ids.is_empty() {
            return Err(ApiError { param: Some("input".into()), ..ApiError::bad("an input has no tokens") });
        }
        if ids.len() > st.config.ctx_size {
            return Err(ApiError::exceeds_context(ids.len(), st.config.ctx_size));
        }
    }
    let _turn = st.embedding_turn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    inputs
        .iter()
        .map(|ids| {
            let mut seq = st.model.new_sequence(ids.len());
            let rows = seq.embeddings(&st.model, ids).map_err(|e| ApiError::internal(format!("embedding failed: {}", tine_engine::error_chain(&e))))?;
            let pooled = pool(&rows, pooling);
            let out = if pooling == Pooling::None { pooled } else { pooled.iter().map(|r| normalize(r, req.normalize)).collect() };
            Ok((out, ids.len()))
        })
        .collect()
}

/// llama-server's `/embedding`: `[{"index", "embedding": [[...], ...]}]`, a row per token
/// without pooling, else one.
pub(crate) async fn native(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let pooling = pooling(&st)?;
    let req = tine_api::check_embeddings(&read_body(&st, body).await?)?;
    let results = prepare(&st, move |st| compute(st, req, pooling)).await?;
    let out: Vec<Value> = results.into_iter().enumerate().map(|(i, (rows, _))| json!({"index": i, "embedding": rows})).collect();
    Ok(Json(Value::Array(out)).into_response())
}

/// OpenAI's `/v1/embeddings`: one pooled vector per input, as floats or base64.
pub(crate) async fn openai(State(st): State<Shared>, body: Body) -> Result<Response, ApiError> {
    let pooling = pooling(&st)?;
    if pooling == Pooling::None {
        return Err(ApiError::bad("Pooling type 'none' is not OAI compatible. Please use a different pooling type (--pooling mean, cls or last)"));
    }
    let req = tine_api::check_embeddings(&read_body(&st, body).await?)?;
    let width = st.model.info.embedding_length;
    if let Some(d) = req.dimensions.filter(|&d| d != width) {
        return Err(ApiError { param: Some("dimensions".into()), ..ApiError::bad(format!("dimensions: this model's embeddings have {width}, not {d}")) });
    }
    let base64 = req.base64;
    let results = prepare(&st, move |st| compute(st, req, pooling)).await?;
    let tokens: usize = results.iter().map(|r| r.1).sum();
    let data: Vec<Value> = results
        .into_iter()
        .enumerate()
        .map(|(i, (mut rows, _))| {
            let v = rows.pop().expect("pooled to one row");
            let embedding = if base64 { json!(base64_f32(&v)) } else { json!(v) };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({"object": "list", "model": st.model_id, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})).into_response())
}

/// `v` as little-endian f32 bytes in standard base64 (OpenAI's `encoding_format: "base64"`).
fn base64_f32(v: &[f32]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16) | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8) | u32::from(*chunk.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        // RFC 4648's test vectors, through bytes that happen to be f32s' (1.0 = 00 00 80 3f).
        assert_eq!(super::base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(super::base64_f32(&[1.0, -2.0, 0.5]), "AACAPwAAAMAAAAA/");
        assert_eq!(super::base64_f32(&[]), "");
    }
}
