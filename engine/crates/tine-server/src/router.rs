//! What request routers ask of the servers behind them (sglang-router's and vllm-router's
//! worker API): `/server_info` and `/model_info` (also under their older `/get_` names), whose
//! `served_model_name` / `model_path` give the router the model's id, and `/get_load`. Health
//! is `/health`; vLLM's `/tokenize` forms (`prompt`, `messages`) are in `llama`.

use super::*;

/// `/server_info` (`/get_server_info`): the model, the parallelism (one process, one device:
/// data and tensor parallel sizes 1) and the serving settings.
pub(crate) async fn server_info(State(st): State<Shared>) -> Json<Value> {
    Json(json!({
        "model_path": st.model.info.path.display().to_string(),
        "tokenizer_path": st.model.info.path.display().to_string(),
        "served_model_name": st.model_id,
        "dp_size": 1,
        "tp_size": 1,
        "max_total_num_tokens": st.config.ctx_size * st.scheduler.slots,
        "context_length": st.config.ctx_size,
        "total_slots": st.scheduler.slots,
        "version": env!("TINE_BUILD_INFO"),
    }))
}

/// `/model_info` (`/get_model_info`).
pub(crate) async fn model_info(State(st): State<Shared>) -> Json<Value> {
    let i = &st.model.info;
    Json(json!({
        "model_path": i.path.display().to_string(),
        "tokenizer_path": i.path.display().to_string(),
        "served_model_name": st.model_id,
        "is_generation": true,
        "model_type": i.architecture,
        "architectures": [i.architecture],
    }))
}

/// `/get_load`: requests in slots and waiting for one.
pub(crate) async fn load(State(st): State<Shared>) -> Json<Value> {
    let busy = st.scheduler.slot_views().iter().filter(|v| v.is_processing).count();
    let in_flight = st.admission.in_flight();
    Json(json!({"load": in_flight, "num_reqs": busy, "num_waiting_reqs": in_flight.saturating_sub(busy), "total_slots": st.scheduler.slots}))
}
