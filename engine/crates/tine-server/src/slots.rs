//! llama-server's slot endpoints: `GET /slots` and `POST /slots/{id}?action=save|restore|erase`
//! (slot files under `--slot-save-path`, written atomically).

use super::*;

pub(crate) async fn slots(State(st): State<Shared>) -> Result<Json<Value>, ApiError> {
    if !st.config.slots_endpoint {
        return Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "This server does not support slots endpoint. Start it without `--no-slots`"));
    }
    let spec = st.scheduler.drafting.default != tine_spec::SpecChoice::Off;
    Ok(Json(Value::Array(
        st.scheduler
            .slot_views()
            .into_iter()
            .map(|v| json!({"id": v.id, "id_task": v.id_task, "n_ctx": v.n_ctx, "speculative": spec, "is_processing": v.is_processing, "n_cached": v.n_cached, "n_shared": v.n_shared}))
            .collect(),
    )))
}

/// A slot file's name: one plain file name inside `--slot-save-path` (llama-server's rule).
pub(crate) fn slot_file_name(body: &Value) -> Result<String, ApiError> {
    let name = body.get("filename").and_then(|f| f.as_str()).ok_or_else(|| ApiError::bad("`filename` is required"))?;
    let ok = !name.is_empty() && name.len() <= 255 && name != "." && name != ".." && !name.starts_with('.') && !name.chars().any(|c| c == '/' || c == '\\' || c.is_control());
    if !ok {
        return Err(ApiError::bad(format!("filename {name:?} must be a plain file name (no path separators, no leading dot, at most 255 bytes)")));
    }
    Ok(name.to_owned())
}

/// llama-server's `POST /slots/{id}?action=save|restore|erase`.
pub(crate) async fn slot_action(State(st): State<Shared>, axum::extract::Path(id): axum::extract::Path<String>, uri: axum::http::Uri, body: Body) -> Result<Json<Value>, ApiError> {
    use scheduler::{SlotAction, SlotCommand, SlotOutcome};
    // As llama-server: the actions need `--slot-save-path` (save and restore), not `/slots`
    // (which `--no-slots` turns off).
    let id: usize = id.parse().map_err(|_| ApiError::bad(format!("slot id {id:?} is not a number")))?;
    let action = uri.query().unwrap_or("").split('&').find_map(|kv| kv.strip_prefix("action=")).unwrap_or("").to_owned();
    let raw = read_body(&st, body).await?;
    let body: Value = if raw.iter().all(u8::is_ascii_whitespace) { json!({}) } else { tine_api::decode(&raw)? };
    let dir = || st.config.slot_save_path.clone().ok_or_else(|| ApiError::new(StatusCode::NOT_IMPLEMENTED, "This server does not support slots action. Start it with `--slot-save-path`"));
    let t0 = std::time::Instant::now();
    // Bytes of the slot file a restore read (llama-server's `n_read`).
    let mut n_read = 0;
    let (cmd_action, file) = match action.as_str() {
        "save" => {
            let path = dir()?.join(slot_file_name(&body)?);
            (SlotAction::Save, Some(path))
        }
        "restore" => {
            let name = slot_file_name(&body)?;
            let path = dir()?.join(&name);
            let bytes = tokio::task::spawn_blocking({
                let path = path.clone();
                move || std::fs::read(&path)
            })
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| error::slot_file_read(&name, &e))?;
            n_read = bytes.len();
            let img = tokio::task::spawn_blocking(move || tine_runtime::SlotImage::from_bytes(&bytes)).await.map_err(|e| ApiError::internal(e.to_string()))?;
            let img = img.map_err(|e| error::slot_file_malformed(&name, &e))?;
            (SlotAction::Restore(Box::new(img)), Some(path))
        }
        "erase" => (SlotAction::Erase, None),
        other => return Err(ApiError::bad(format!("action must be save, restore or erase, got {other:?}"))),
    };
    let (reply, rx) = tokio::sync::oneshot::channel();
    st.scheduler.slot_action(SlotCommand { id, action: cmd_action, reply }).map_err(|_| ApiError::unavailable("the engine thread has stopped"))?;
    let outcome = rx.await.map_err(|_| ApiError::internal("the engine dropped the slot action"))?.map_err(|e| ApiError::from(&e))?;
    let filename = file.as_ref().and_then(|p| p.file_name()).map(|f| f.to_string_lossy().into_owned());
    Ok(Json(match outcome {
        SlotOutcome::Saved(img) => {
            let path = file.expect("save has a path");
            let n_saved = img.tokens.len();
            // Written beside the target and renamed: a crash leaves the old file or the new one.
            let n_written = tokio::task::spawn_blocking(move || -> std::io::Result<usize> {
                let bytes = img.to_bytes();
                let tmp = path.with_extension("tine-tmp");
                std::fs::write(&tmp, &bytes)?;
                std::fs::File::open(&tmp)?.sync_all()?;
                std::fs::rename(&tmp, &path)?;
                Ok(bytes.len())
            })
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| ApiError::internal(format!("writing the slot file: {e}")))?;
            json!({"id_slot": id, "filename": filename, "n_saved": n_saved, "n_written": n_written, "timings": {"save_ms": t0.elapsed().as_secs_f64() * 1e3}})
        }
        SlotOutcome::Restored { n_restored } => {
            json!({"id_slot": id, "filename": filename, "n_restored": n_restored, "n_read": n_read, "timings": {"restore_ms": t0.elapsed().as_secs_f64() * 1e3}})
        }
        SlotOutcome::Erased { n_erased } => json!({"id_slot": id, "n_erased": n_erased}),
    }))
}
