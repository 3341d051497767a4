//! `[upstream]` and `[[routes]]`: where requests go, as written (`RawUpstream`, `RawRoute`) and
//! as validated by `config.rs` (`UpstreamConfig`, `Route`). A leaf: the types only, no I/O.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::guards::config::{ActionCheckConfig, ContinuationConfig, Guards, ReinforcementConfig};
use crate::pipeline::config::{Definitions, PipelineConfig};
use crate::tokens::Encoding;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawUpstream {
    pub base_url: String,
    pub api_key_env: String,
    pub connect_timeout_ms: u64,
    pub first_byte_timeout_ms: u64,
    pub total_timeout_ms: u64,
    pub connect_retries: u32,
    pub pool_idle_timeout_secs: u64,
    pub pool_max_idle_per_host: usize,
    /// `auto` (by model name), `o200k_base` or `cl100k_base`.
    pub tokenizer: String,
    /// Largest server-sent event accepted from an upstream stream (every upstream).
    pub max_event_bytes: u64,
    /// Where a tool needed later gets its full definition: `auto`, `in_place`, `in_result`, `in_block`.
    pub tool_definitions: Definitions,
}

impl Default for RawUpstream {
    fn default() -> Self {
        RawUpstream {
            base_url: "https://api.openai.com/v1".into(),
            api_key_env: String::new(),
            connect_timeout_ms: 5_000,
            first_byte_timeout_ms: 120_000,
            total_timeout_ms: 600_000,
            connect_retries: 1,
            pool_idle_timeout_secs: 90,
            pool_max_idle_per_host: 256,
            tool_definitions: Definitions::Auto,
            tokenizer: "auto".into(),
            max_event_bytes: 16 * 1024 * 1024,
        }
    }
}

/// A route: models (names or `*` globs) sent to another upstream. Timeouts default to
/// `[upstream]`'s.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawRoute {
    pub name: String,
    pub models: Vec<String>,
    pub base_url: String,
    pub api_key_env: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connect_timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_byte_timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_timeout_ms: Option<u64>,
    /// `auto` (by model name), `o200k_base` or `cl100k_base`; default `[upstream]`'s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// The agent guards of this route, each replacing the global table whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continuation: Option<ContinuationConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reinforcement: Option<ReinforcementConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action_check: Option<ActionCheckConfig>,
    /// Where a tool needed later gets its definition; default `[upstream]`'s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_definitions: Option<Definitions>,
}

/// A value that must never be printed: `Debug` and `Display` show `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// `default` for `[upstream]`, else the route's name.
    pub name: String,
    /// Without a trailing slash, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    pub api_key: Option<Secret>,
    pub api_key_env: String,
    pub connect_timeout: Duration,
    pub first_byte_timeout: Duration,
    pub total_timeout: Duration,
    pub connect_retries: u32,
    pub pool_idle_timeout: Duration,
    pub pool_max_idle_per_host: usize,
    /// A stream event larger than this is not relayed: the stream is cut with an error event.
    pub max_event_bytes: usize,
    /// `None`: chosen by model name.
    pub tokenizer: Option<Encoding>,
    /// Continuation, reinforcement and the action check for requests to this upstream.
    pub guards: Guards,
    /// The pipeline's config for requests to this upstream: `[pipeline]` and `[tools]`, with
    /// the upstream's `tool_definitions` resolved.
    pub pipeline: Arc<PipelineConfig>,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub patterns: Vec<String>,
    pub upstream: usize,
}
