//! Typed configuration: `config.toml`, then `CTXPROXY_<SECTION>_<KEY>` environment overrides,
//! then CLI flags, validated once into a [`Config`] that the rest of the code never re-checks.
//!
//! Every error names the offending key, so `check-config` and `serve` can say what to fix.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::bounded::config::MemoryConfig;
use crate::cache::config::CacheConfig;
use crate::glob::glob_match;
use crate::guards::config::{ActionCheckConfig, ContinuationConfig, Guards, ReinforcementConfig};
use crate::pipeline::config::{PipelineConfig, ToolsConfig};
use crate::record::config::RecordConfig;
use crate::store::config::StoreConfig;
use crate::tokens::Encoding;
pub use crate::upstream::config::{RawRoute, RawUpstream, Route, Secret, UpstreamConfig};

const ENV_PREFIX: &str = "CTXPROXY_";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid TOML: {0}")]
    Syntax(String),
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
}

impl ConfigError {
    fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            message: message.into(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Raw config: exactly what the file says, with defaults. Serialized back by `check-config`.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    pub server: RawServer,
    pub log: RawLog,
    pub upstream: RawUpstream,
    pub routes: Vec<RawRoute>,
    pub auth: RawAuth,
    pub pipeline: PipelineConfig,
    pub tools: ToolsConfig,
    pub store: StoreConfig,
    pub memory: MemoryConfig,
    pub cache: CacheConfig,
    /// USD per million tokens, by model name or glob: what savings are worth.
    pub prices: BTreeMap<String, ModelPrice>,
    pub record: RecordConfig,
    pub continuation: ContinuationConfig,
    pub reinforcement: ReinforcementConfig,
    pub action_check: ActionCheckConfig,
}

/// A model's list price, in US dollars per million tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    pub input: f64,
    pub output: f64,
    /// Input tokens the provider served from its prompt cache; the full input price when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<f64>,
}

impl ModelPrice {
    /// The price of a cached input token.
    pub fn cached_input(&self) -> f64 {
        self.cached_input.unwrap_or(self.input)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawServer {
    pub listen: String,
    pub max_body_bytes: u64,
    pub max_passthrough_body_bytes: u64,
    pub concurrency_limit: usize,
    pub queue_timeout_ms: u64,
    pub shutdown_grace_secs: u64,
    pub header_read_timeout_ms: u64,
    pub body_read_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub max_connections: usize,
    pub metrics_listen: String,
    pub threads: usize,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            listen: "127.0.0.1:8080".into(),
            max_body_bytes: 10 * 1024 * 1024,
            max_passthrough_body_bytes: 512 * 1024 * 1024,
            concurrency_limit: 1024,
            queue_timeout_ms: 5_000,
            shutdown_grace_secs: 30,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            idle_timeout_ms: 60_000,
            max_connections: 10_000,
            metrics_listen: String::new(),
            threads: 0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawLog {
    pub format: String,
    pub level: String,
}

impl Default for RawLog {
    fn default() -> Self {
        RawLog {
            format: "pretty".into(),
            level: "info".into(),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawAuth {
    pub keys: Vec<RawAuthKey>,
    /// Hex SHA-256 of the key Prometheus sends for `/metrics` on the API listener when auth is
    /// on (tenant keys are not accepted there).
    pub metrics_key_sha256: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawAuthKey {
    /// Hex SHA-256 of the key clients send as `Authorization: Bearer <key>`.
    pub sha256: String,
    pub tenant: String,
}

// ---------------------------------------------------------------------------------------------
// Validated config.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub log: LogConfig,
    /// Index 0 is `[upstream]` (absent when its `base_url` is empty), then one per route.
    pub upstreams: Vec<UpstreamConfig>,
    pub default_upstream: Option<usize>,
    pub routes: Vec<Route>,
    /// SHA-256 of each accepted key → tenant. Empty: auth off, every request is tenant `default`.
    pub auth_keys: HashMap<[u8; 32], String>,
    /// SHA-256 of the key `/metrics` needs on the API listener when auth is on.
    pub metrics_key: Option<[u8; 32]>,
    pub pipeline: PipelineConfig,
    pub store: StoreConfig,
    pub memory: MemoryConfig,
    pub cache: CacheConfig,
    pub prices: BTreeMap<String, ModelPrice>,
    pub record: RecordConfig,
    /// The file as given plus defaults and overrides, for `check-config`.
    pub raw: RawConfig,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    pub max_passthrough_body_bytes: usize,
    pub concurrency_limit: usize,
    pub queue_timeout: Duration,
    pub shutdown_grace: Duration,
    /// From a connection's start (or its first byte after a response) to a request's last
    /// header byte.
    pub header_read_timeout: Duration,
    /// From a request's arrival to its body's last byte.
    pub body_read_timeout: Duration,
    /// A connection with no request in progress and no bytes for this long is closed.
    pub idle_timeout: Duration,
    /// Connections open at once; past it, new ones wait briefly, then are closed.
    pub max_connections: usize,
    /// A separate address that serves `/metrics` (and no API); `None`: the API listener does.
    pub metrics_listen: Option<SocketAddr>,
    /// Threads serving connections, each connection on one (`cores.rs`); from `threads = 0`,
    /// one per core.
    pub threads: usize,
}

/// `server.threads` at most: a thread each is not what more would get.
const MAX_THREADS: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Pretty,
    Json,
}

#[derive(Debug, Clone)]
pub struct LogConfig {
    pub format: LogFormat,
    pub level: String,
}

impl Config {
    /// The upstream for a model: the first route with a matching pattern, else `[upstream]`.
    pub fn upstream_for_model(&self, model: &str) -> Option<usize> {
        self.routes
            .iter()
            .find(|route| route.patterns.iter().any(|p| glob_match(p, model)))
            .map(|route| route.upstream)
            .or(self.default_upstream)
    }

    /// The model names and patterns the config names (its routes', then its prices'): the
    /// `model` labels a request may get.
    pub fn model_names(&self) -> impl Iterator<Item = &str> {
        self.routes
            .iter()
            .flat_map(|r| r.patterns.iter())
            .chain(self.prices.keys())
            .map(String::as_str)
    }

    /// The names of the upstreams, in order.
    pub fn upstream_names(&self) -> Vec<&str> {
        self.upstreams.iter().map(|u| u.name.as_str()).collect()
    }

    /// The encodings the configured routes count with: each upstream's forced one, else that
    /// of each route's model patterns, and o200k_base for the default upstream (any model):
    /// the vocabularies worth loading at start.
    pub fn encodings(&self) -> Vec<Encoding> {
        let mut encodings: Vec<Encoding> = Vec::new();
        let mut add = |encoding: Encoding| {
            if !encodings.contains(&encoding) {
                encodings.push(encoding);
            }
        };
        if let Some(default) = self.default_upstream.and_then(|i| self.upstreams.get(i)) {
            add(default.tokenizer.unwrap_or(Encoding::O200kBase));
        }
        for route in &self.routes {
            let forced = self.upstreams.get(route.upstream).and_then(|u| u.tokenizer);
            for pattern in &route.patterns {
                add(forced.unwrap_or_else(|| Encoding::for_model(pattern.trim_end_matches('*'))));
            }
        }
        encodings
    }

    /// The pipeline's config for a model: its upstream's (`tool_definitions` resolved), else
    /// the global one.
    pub fn pipeline_for_model(&self, model: &str) -> &PipelineConfig {
        self.upstream_for_model(model)
            .and_then(|i| self.upstreams.get(i))
            .map_or(&self.pipeline, |u| &u.pipeline)
    }

    /// The price of a model: an exact `[prices]` entry, else the first glob that matches.
    pub fn price_of(&self, model: &str) -> Option<ModelPrice> {
        self.prices.get(model).copied().or_else(|| {
            self.prices
                .iter()
                .find(|(pattern, _)| glob_match(pattern, model))
                .map(|(_, price)| *price)
        })
    }

    pub fn auth_enabled(&self) -> bool {
        !self.auth_keys.is_empty()
    }

    /// Reads a file, applies the process environment, validates.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::from_toml(&text, std::env::vars())
    }

    /// Parses TOML text, applies `CTXPROXY_*` overrides from `env`, validates. Upstream keys
    /// (`api_key_env`) are read from `env` too.
    pub fn from_toml(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let env: HashMap<String, String> = env.into_iter().collect();
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        apply_env_overrides(&mut table, &env)?;
        let raw: RawConfig = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| ConfigError::invalid(e.path().to_string(), e.inner().to_string()))?;
        raw.validate(&|name| env.get(name).cloned())
    }

    /// The effective config as TOML, with secrets reported as set/unset only.
    pub fn effective_toml(&self) -> String {
        // Passwords inside URLs (`redis://:PASS@host`, `http://user:PASS@host`) are never shown.
        let mut out = toml::Value::try_from(&self.raw)
            .map(|mut value| {
                redact_urls(&mut value);
                value
            })
            .and_then(|value| toml::to_string_pretty(&value))
            .unwrap_or_else(|e| format!("# cannot render config: {e}\n"));
        out.push_str("\n# Upstream keys (values redacted):\n");
        for upstream in &self.upstreams {
            let state = match (&upstream.api_key, upstream.api_key_env.is_empty()) {
                (_, true) => "none: the client's Authorization is forwarded".to_owned(),
                (Some(_), false) => format!("${} = ***", upstream.api_key_env),
                (None, false) => format!("${} is not set", upstream.api_key_env),
            };
            out.push_str(&format!("#   {}: {state}\n", upstream.name));
        }
        out
    }
}

/// Redacts the credentials of every URL string in `value`.
fn redact_urls(value: &mut toml::Value) {
    match value {
        toml::Value::String(text) => {
            if let Some(redacted) = redact_userinfo(text) {
                *text = redacted;
            }
        }
        toml::Value::Array(items) => items.iter_mut().for_each(redact_urls),
        toml::Value::Table(table) => table.iter_mut().for_each(|(_, v)| redact_urls(v)),
        _ => {}
    }
}

/// `url` with the password of its userinfo (or, without one, the whole userinfo: a token used
/// as user name) replaced by `***`; `None` when it has no userinfo.
pub fn redact_userinfo(url: &str) -> Option<String> {
    let start = url.find("://")? + 3;
    let authority_end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    let at = start + url[start..authority_end].rfind('@')?;
    let userinfo = &url[start..at];
    let kept = match userinfo.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_owned(),
    };
    Some(format!("{}{kept}{}", &url[..start], &url[at..]))
}

impl RawConfig {
    /// Turns raw values into a [`Config`]; `read_env` looks up the API key variables.
    pub fn validate(
        self,
        read_env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let server = &self.server;
        let listen = server.listen.parse::<SocketAddr>().map_err(|e| {
            ConfigError::invalid("server.listen", format!("{e} (expected IP:PORT)"))
        })?;
        positive("server.max_body_bytes", server.max_body_bytes)?;
        positive(
            "server.max_passthrough_body_bytes",
            server.max_passthrough_body_bytes,
        )?;
        positive("server.concurrency_limit", server.concurrency_limit as u64)?;
        positive("server.queue_timeout_ms", server.queue_timeout_ms)?;
        positive(
            "server.header_read_timeout_ms",
            server.header_read_timeout_ms,
        )?;
        positive("server.body_read_timeout_ms", server.body_read_timeout_ms)?;
        positive("server.idle_timeout_ms", server.idle_timeout_ms)?;
        positive("server.max_connections", server.max_connections as u64)?;
        let server_config = ServerConfig {
            listen,
            max_body_bytes: to_usize("server.max_body_bytes", server.max_body_bytes)?,
            max_passthrough_body_bytes: to_usize(
                "server.max_passthrough_body_bytes",
                server.max_passthrough_body_bytes,
            )?,
            concurrency_limit: server.concurrency_limit,
            queue_timeout: Duration::from_millis(server.queue_timeout_ms),
            shutdown_grace: Duration::from_secs(server.shutdown_grace_secs),
            header_read_timeout: Duration::from_millis(server.header_read_timeout_ms),
            body_read_timeout: Duration::from_millis(server.body_read_timeout_ms),
            idle_timeout: Duration::from_millis(server.idle_timeout_ms),
            max_connections: server.max_connections,
            threads: match server.threads {
                0 => std::thread::available_parallelism().map_or(1, usize::from),
                threads if threads > MAX_THREADS => {
                    return Err(ConfigError::invalid(
                        "server.threads",
                        format!("{threads} is more than {MAX_THREADS}"),
                    ));
                }
                threads => threads,
            },
            metrics_listen: match server.metrics_listen.trim() {
                "" => None,
                address => Some(address.parse::<SocketAddr>().map_err(|e| {
                    ConfigError::invalid("server.metrics_listen", format!("{e} (expected IP:PORT)"))
                })?),
            },
        };

        let format = match self.log.format.as_str() {
            "pretty" => LogFormat::Pretty,
            "json" => LogFormat::Json,
            other => {
                return Err(ConfigError::invalid(
                    "log.format",
                    format!("`{other}`: expected \"pretty\" or \"json\""),
                ));
            }
        };
        if !is_log_filter(&self.log.level) {
            return Err(ConfigError::invalid(
                "log.level",
                format!("`{}` is not a valid level or filter", self.log.level),
            ));
        }
        let log = LogConfig {
            format,
            level: self.log.level.clone(),
        };

        let defaults = &self.upstream;
        let mut upstreams = Vec::new();
        // Each upstream's `tool_definitions`, as configured (resolved below).
        let mut placements = Vec::new();
        let mut default_upstream = None;
        if !defaults.base_url.is_empty() {
            let timeouts = (
                defaults.connect_timeout_ms,
                defaults.first_byte_timeout_ms,
                defaults.total_timeout_ms,
            );
            placements.push(defaults.tool_definitions);
            upstreams.push(upstream_config(
                "upstream",
                "default",
                (
                    &defaults.base_url,
                    &defaults.api_key_env,
                    &defaults.tokenizer,
                ),
                timeouts,
                defaults,
                read_env,
            )?);
            default_upstream = Some(0);
        }
        let global_guards = Guards {
            continuation: self.continuation.clone(),
            reinforcement: self.reinforcement.clone(),
            action_check: self.action_check.clone(),
        };
        global_guards
            .validate("")
            .map_err(|(key, message)| ConfigError::invalid(key, message))?;
        if let Some(first) = upstreams.first_mut() {
            first.guards = global_guards.clone();
        }

        let mut routes = Vec::new();
        let mut names = std::collections::HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            let key = format!("routes[{i}]");
            if route.models.is_empty() || route.models.iter().any(|m| m.trim().is_empty()) {
                return Err(ConfigError::invalid(
                    format!("{key}.models"),
                    "list at least one model name or glob, none empty",
                ));
            }
            let name = if route.name.is_empty() {
                format!("route{i}")
            } else {
                route.name.clone()
            };
            if name == "default" || !names.insert(name.clone()) {
                return Err(ConfigError::invalid(
                    format!("{key}.name"),
                    format!("`{name}` is used twice (or is the reserved name `default`)"),
                ));
            }
            let timeouts = (
                route
                    .connect_timeout_ms
                    .unwrap_or(defaults.connect_timeout_ms),
                route
                    .first_byte_timeout_ms
                    .unwrap_or(defaults.first_byte_timeout_ms),
                route.total_timeout_ms.unwrap_or(defaults.total_timeout_ms),
            );
            let tokenizer = route.tokenizer.as_deref().unwrap_or(&defaults.tokenizer);
            placements.push(route.tool_definitions.unwrap_or(defaults.tool_definitions));
            upstreams.push(upstream_config(
                &key,
                &name,
                (&route.base_url, &route.api_key_env, tokenizer),
                timeouts,
                defaults,
                read_env,
            )?);
            let guards = Guards {
                continuation: route
                    .continuation
                    .clone()
                    .unwrap_or_else(|| global_guards.continuation.clone()),
                reinforcement: route
                    .reinforcement
                    .clone()
                    .unwrap_or_else(|| global_guards.reinforcement.clone()),
                action_check: route
                    .action_check
                    .clone()
                    .unwrap_or_else(|| global_guards.action_check.clone()),
            };
            guards
                .validate(&format!("{key}."))
                .map_err(|(key, message)| ConfigError::invalid(key, message))?;
            if let Some(upstream) = upstreams.last_mut() {
                upstream.guards = guards;
            }
            routes.push(Route {
                patterns: route.models.clone(),
                upstream: upstreams.len() - 1,
            });
        }

        let mut auth_keys = HashMap::new();
        for (i, key) in self.auth.keys.iter().enumerate() {
            let mut digest = [0u8; 32];
            hex::decode_to_slice(key.sha256.trim(), &mut digest).map_err(|_| {
                ConfigError::invalid(
                    format!("auth.keys[{i}].sha256"),
                    "expected 64 hex characters (printf %s \"$KEY\" | sha256sum)",
                )
            })?;
            if key.tenant.trim().is_empty() {
                return Err(ConfigError::invalid(
                    format!("auth.keys[{i}].tenant"),
                    "must not be empty",
                ));
            }
            auth_keys.insert(digest, key.tenant.clone());
        }

        let metrics_key = match self.auth.metrics_key_sha256.trim() {
            "" => None,
            hex_digest => {
                let mut digest = [0u8; 32];
                hex::decode_to_slice(hex_digest, &mut digest).map_err(|_| {
                    ConfigError::invalid(
                        "auth.metrics_key_sha256",
                        "expected 64 hex characters (printf %s \"$KEY\" | sha256sum)",
                    )
                })?;
                Some(digest)
            }
        };

        let mut pipeline = self.pipeline.clone();
        pipeline.tools = self.tools.clone();
        pipeline
            .validate()
            .map_err(|(key, message)| ConfigError::invalid(key, message))?;
        for (upstream, placement) in upstreams.iter_mut().zip(&placements) {
            let mut resolved = pipeline.clone();
            resolved.tools.definitions = placement.for_base_url(&upstream.base_url);
            upstream.pipeline = Arc::new(resolved);
        }
        // Unrouted uses (analyze) read the default upstream's.
        if let Some(default) = default_upstream.and_then(|i| upstreams.get(i)) {
            pipeline.tools.definitions = default.pipeline.tools.definitions;
        }
        self.store
            .validate()
            .map_err(|(key, message)| ConfigError::invalid(key, message))?;
        self.memory
            .validate()
            .map_err(|(key, message)| ConfigError::invalid(key, message))?;
        self.cache
            .validate()
            .map_err(|(key, message)| ConfigError::invalid(key, message))?;
        self.record
            .validate()
            .map_err(|(key, message)| ConfigError::invalid(key, message))?;
        for (model, price) in &self.prices {
            let valid = |x: f64| x.is_finite() && x >= 0.0;
            if !valid(price.input) || !valid(price.output) {
                return Err(ConfigError::invalid(
                    format!("prices.{model}"),
                    "input and output must be non-negative numbers (USD per million tokens)",
                ));
            }
        }
        Ok(Config {
            server: server_config,
            log,
            upstreams,
            default_upstream,
            routes,
            auth_keys,
            metrics_key,
            pipeline,
            store: self.store.clone(),
            memory: self.memory.clone(),
            cache: self.cache.clone(),
            prices: self.prices.clone(),
            record: self.record.clone(),
            raw: self,
        })
    }
}

fn upstream_config(
    key: &str,
    name: &str,
    (base_url, api_key_env, tokenizer): (&str, &str, &str),
    (connect_ms, first_byte_ms, total_ms): (u64, u64, u64),
    defaults: &RawUpstream,
    read_env: &dyn Fn(&str) -> Option<String>,
) -> Result<UpstreamConfig, ConfigError> {
    let uri = base_url
        .parse::<http::Uri>()
        .map_err(|e| ConfigError::invalid(format!("{key}.base_url"), e.to_string()))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return Err(ConfigError::invalid(
            format!("{key}.base_url"),
            format!("`{base_url}`: expected an absolute http:// or https:// URL"),
        ));
    }
    if uri.query().is_some() {
        return Err(ConfigError::invalid(
            format!("{key}.base_url"),
            "must not have a query string",
        ));
    }
    positive(&format!("{key}.connect_timeout_ms"), connect_ms)?;
    positive(&format!("{key}.first_byte_timeout_ms"), first_byte_ms)?;
    positive(&format!("{key}.total_timeout_ms"), total_ms)?;
    let api_key = if api_key_env.is_empty() {
        None
    } else {
        match read_env(api_key_env) {
            Some(value) if !value.is_empty() => Some(Secret::new(value)),
            _ => {
                return Err(ConfigError::invalid(
                    format!("{key}.api_key_env"),
                    format!("environment variable `{api_key_env}` is not set or empty"),
                ));
            }
        }
    };
    let tokenizer = match tokenizer {
        "auto" => None,
        "o200k_base" => Some(Encoding::O200kBase),
        "cl100k_base" => Some(Encoding::Cl100kBase),
        other => {
            return Err(ConfigError::invalid(
                format!("{key}.tokenizer"),
                format!("`{other}`: expected \"auto\", \"o200k_base\" or \"cl100k_base\""),
            ));
        }
    };
    Ok(UpstreamConfig {
        name: name.to_owned(),
        tokenizer,
        base_url: base_url.trim_end_matches('/').to_owned(),
        api_key,
        api_key_env: api_key_env.to_owned(),
        connect_timeout: Duration::from_millis(connect_ms),
        first_byte_timeout: Duration::from_millis(first_byte_ms),
        total_timeout: Duration::from_millis(total_ms),
        connect_retries: defaults.connect_retries,
        pool_idle_timeout: Duration::from_secs(defaults.pool_idle_timeout_secs),
        pool_max_idle_per_host: defaults.pool_max_idle_per_host,
        max_event_bytes: to_usize("upstream.max_event_bytes", defaults.max_event_bytes.max(1))?,
        guards: Guards::default(),
        pipeline: Arc::default(),
    })
}

fn positive(key: &str, value: u64) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(ConfigError::invalid(key, "must be greater than 0"));
    }
    Ok(())
}

fn to_usize(key: &str, value: u64) -> Result<usize, ConfigError> {
    usize::try_from(value).map_err(|_| ConfigError::invalid(key, "too large"))
}

/// `CTXPROXY_*` variables that are not config overrides: the config path (`CTXPROXY_CONFIG`),
/// the test suite's (`CTXPROXY_TEST_*`), and those Kubernetes injects for a Service named
/// `ctxproxy` (`CTXPROXY_SERVICE_HOST`, `CTXPROXY_PORT_8080_TCP`…).
fn not_an_override(name: &str) -> bool {
    name == "CONFIG"
        || name == "PORT"
        || ["TEST_", "SERVICE_", "PORT_"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
}

/// Applies `CTXPROXY_<SECTION>_<KEY>=value`, where SECTION may be nested
/// (`CTXPROXY_PIPELINE_BUDGET_MAX_TOKENS` sets `[pipeline.budget] max_tokens`). The value is
/// read as a TOML value when it is one (`100`, `true`, `["a","b"]`), else as a string.
fn apply_env_overrides(
    table: &mut toml::Table,
    env: &HashMap<String, String>,
) -> Result<(), ConfigError> {
    let schema = match toml::Value::try_from(RawConfig::default()) {
        Ok(toml::Value::Table(schema)) => schema,
        _ => toml::Table::new(),
    };
    let mut vars: Vec<(&String, &String)> = env.iter().collect();
    vars.sort_unstable();
    for (var, value) in vars {
        let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        if not_an_override(rest) {
            continue;
        }
        let mut rest = rest.to_ascii_lowercase();
        let mut path: Vec<String> = Vec::new();
        let mut node = &schema;
        while let Some((name, child)) = node.iter().find_map(|(name, child)| {
            let child = child.as_table()?;
            let after = rest.strip_prefix(name.as_str())?.strip_prefix('_')?;
            (!after.is_empty()).then_some((name.clone(), child))
        }) {
            rest = rest[name.len() + 1..].to_owned();
            path.push(name);
            node = child;
        }
        if path.is_empty() {
            let sections: Vec<String> = schema
                .iter()
                .filter(|(_, v)| v.is_table())
                .map(|(k, _)| k.to_uppercase())
                .collect();
            return Err(ConfigError::Env {
                var: var.clone(),
                message: format!(
                    "expected CTXPROXY_<SECTION>_<KEY> with SECTION one of {}",
                    sections.join(", ")
                ),
            });
        }
        let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.clone()));
        let mut target = &mut *table;
        for name in &path {
            let entry = target
                .entry(name.as_str())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let toml::Value::Table(inner) = entry else {
                return Err(ConfigError::Env {
                    var: var.clone(),
                    message: format!("[{}] is not a table in the config file", path.join(".")),
                });
            };
            target = inner;
        }
        target.insert(rest, parsed);
    }
    Ok(())
}

/// A level (`info`) or a tracing filter whose bare words are levels (`info,hyper=warn`):
/// a bare word that is not a level (`infoo`) is a typo, not a target to filter on.
fn is_log_filter(filter: &str) -> bool {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    tracing_subscriber::EnvFilter::try_new(filter).is_ok()
        && filter
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty() && !d.contains('='))
            .all(|d| LEVELS.contains(&d.to_ascii_lowercase().as_str()))
}

#[cfg(test)]
mod redaction_tests {
    use super::*;

    #[test]
    fn passwords_in_urls_are_redacted() {
        let cases = [
            (
                "redis://:s3cret@redis:6379/0",
                Some("redis://:***@redis:6379/0"),
            ),
            ("http://user:p@ss@host/v1", Some("http://user:***@host/v1")),
            ("https://TOKEN@host/v1", Some("https://***@host/v1")),
            ("https://api.openai.com/v1", None),
            ("https://host/v1?next=a@b", None),
        ];
        for (url, expected) in cases {
            assert_eq!(redact_userinfo(url).as_deref(), expected, "{url}");
        }
    }

    #[test]
    fn check_config_never_prints_a_password() {
        let text = "[upstream]\nbase_url = \"http://user:UPSTREAMPASS@127.0.0.1:9/v1\"\n\
                    [store]\nredis_url = \"redis://:REDISPASS@127.0.0.1:6379\"\n\
                    cluster_urls = [\"redis://:CLUSTERPASS@10.0.0.1:6379\"]\n";
        let shown = Config::from_toml(text, Vec::new())
            .unwrap()
            .effective_toml();
        for secret in ["UPSTREAMPASS", "REDISPASS", "CLUSTERPASS"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("redis://:***@127.0.0.1:6379"), "{shown}");
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
