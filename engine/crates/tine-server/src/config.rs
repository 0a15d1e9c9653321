//! `ServerConfig`: what `tine serve`'s flags set, and their defaults.

use super::*;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub parallel: usize,
    pub ctx_size: usize,
    /// Speculative decoding for every slot (each slot keeps its own drafter state).
    pub spec: Option<Arc<tine_spec::SpecFactory>>,
    /// `--api-key`: when not empty, every endpoint but `/health` needs one of these.
    pub api_keys: ApiKeys,
    /// Largest request body accepted (413 above it).
    pub max_body_bytes: usize,
    /// Time a client has to send its whole body (408 after it).
    pub body_timeout: Duration,
    /// Requests waiting for a slot beyond the busy ones; more are refused with 503.
    pub max_queue: usize,
    /// Prompt tokens evaluated per engine step, over all slots (`--ubatch-size`).
    pub ubatch: usize,
    /// `-b/--batch-size`, llama-server's logical batch: how much of the prefix and suffix
    /// `/infill` keeps around the cursor (3:1).
    pub batch: usize,
    /// What a request gets for the fields it leaves out (`--temp`, `--n-predict`, ...).
    pub defaults: tine_api::Defaults,
    /// `--alias`: the model id in `/v1/models` and responses (default: the file name); a
    /// comma-separated list names several, the id the first in alphabetical order.
    pub alias: Option<String>,
    /// `--tags`: labels `/v1/models` lists for the model.
    pub tags: Vec<String>,
    /// `--verbose`: every chat answer carries `__verbose`, as a request's `verbose` asks.
    pub verbose: bool,
    /// `/slots` answers (llama-server's default; `--no-slots` turns it off).
    pub slots_endpoint: bool,
    /// `/metrics` answers (`--metrics`, off by default as in llama-server).
    pub metrics: bool,
    /// `--chat-template`: overrides the GGUF's `tokenizer.chat_template`.
    pub chat_template: Option<ChatTemplate>,
    /// `--slot-save-path`: the directory slot files are saved to and restored from
    /// (`/slots/{id}?action=save|restore` answer 501 without it).
    pub slot_save_path: Option<std::path::PathBuf>,
    /// `--context-shift`: a generation that fills its context drops the oldest half of the
    /// tokens after `n_keep` and continues.
    pub context_shift: bool,
    /// `--cors-origins`, `--cors-methods`, `--cors-headers`, `--cors-credentials`.
    pub cors: crate::cors::CorsConfig,
    /// `--cache-ram`: bytes of KV the prompt prefixes shared between slots may hold (`None`: no
    /// limit; `Some(0)`: every slot keeps its own copy).
    pub cache_ram: Option<usize>,
    /// `--embeddings`: `/embedding` and `/v1/embeddings` answer, pooling each input's final
    /// hidden states this way (`--pooling`, else the GGUF's `pooling_type`, else none).
    pub embeddings: Option<tine_engine::embeddings::Pooling>,
    /// `--chat-template-kwargs` (and `--reasoning on|off`'s `enable_thinking`): variables every
    /// chat template render gets, under a request's own `chat_template_kwargs`.
    pub chat_template_kwargs: serde_json::Map<String, Value>,
    /// `--reasoning-format`: where a reply's `<think>` text goes unless a request says.
    pub reasoning_format: tine_api::ReasoningFormat,
    /// The chat page at `/`: built in (the default), a directory's files (`--path`), or none
    /// (`--no-webui`).
    pub webui: crate::webui::WebUi,
    /// Failure injection for tests (see [`scheduler::EngineConfig::fault`]); only with the
    /// `failure-injection` feature.
    #[cfg(feature = "failure-injection")]
    pub fault: Option<Arc<std::sync::atomic::AtomicI64>>,
}

impl ServerConfig {
    pub fn new(parallel: usize, ctx_size: usize) -> ServerConfig {
        ServerConfig {
            parallel,
            ctx_size,
            spec: None,
            api_keys: ApiKeys::default(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            body_timeout: Duration::from_secs(60),
            max_queue: DEFAULT_MAX_QUEUE,
            ubatch: tine_runtime::PREFILL_CHUNK,
            batch: DEFAULT_BATCH,
            defaults: tine_api::Defaults::default(),
            alias: None,
            tags: Vec::new(),
            verbose: false,
            slots_endpoint: true,
            metrics: false,
            chat_template: None,
            context_shift: false,
            slot_save_path: None,
            cache_ram: Some(DEFAULT_CACHE_RAM_MIB << 20),
            cors: crate::cors::CorsConfig::default(),
            embeddings: None,
            chat_template_kwargs: serde_json::Map::new(),
            reasoning_format: tine_api::ReasoningFormat::Deepseek,
            webui: crate::webui::WebUi::Builtin,
            #[cfg(feature = "failure-injection")]
            fault: None,
        }
    }
}

/// `-b/--batch-size`'s default (llama-server's).
pub const DEFAULT_BATCH: usize = 2048;

/// 16 MiB: a full 128k-token prompt as JSON text fits several times over.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// `--cache-ram`'s default in MiB (llama-server's).
pub const DEFAULT_CACHE_RAM_MIB: usize = 8192;

/// Queued requests allowed beyond the slots.
pub const DEFAULT_MAX_QUEUE: usize = 256;
