//! `[store]`: where conversation state and caches live (Redis, or memory in-process).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    Redis,
    Memory,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// `redis` (shared by every replica; memory is the fallback while Redis is down) or
    /// `memory` (this process only).
    pub backend: Backend,
    pub redis_url: String,
    /// Redis Cluster: the seed node URLs. When set, `redis_url` is not used.
    pub cluster_urls: Vec<String>,
    /// Prepended to every key, so several deployments (or tests) can share one Redis.
    pub key_prefix: String,
    /// Budget of one store operation; past it the operation counts as failed (a miss).
    pub op_timeout_ms: u64,
    /// Consecutive failures that open the circuit breaker (Redis treated as down).
    pub breaker_failures: u32,
    /// While open, the breaker lets one probe through this often.
    pub breaker_probe_ms: u64,
    /// Entries the in-memory store keeps, and bytes (the least recently used evicted first).
    pub memory_max_entries: usize,
    pub memory_max_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            backend: Backend::Redis,
            redis_url: "redis://127.0.0.1:6379".into(),
            cluster_urls: Vec::new(),
            key_prefix: "ctxproxy:".into(),
            op_timeout_ms: 50,
            breaker_failures: 3,
            breaker_probe_ms: 1_000,
            memory_max_entries: 100_000,
            memory_max_bytes: 64 * 1024 * 1024,
        }
    }
}

impl StoreConfig {
    pub fn validate(&self) -> Result<(), (String, String)> {
        let err = |key: &str, message: &str| Err((format!("store.{key}"), message.to_owned()));
        if self.backend == Backend::Redis {
            let urls: Vec<&String> = if self.cluster_urls.is_empty() {
                vec![&self.redis_url]
            } else {
                self.cluster_urls.iter().collect()
            };
            for url in urls {
                if redis::parse_redis_url(url).is_none() {
                    return err("redis_url", &format!("`{url}` is not a redis:// URL"));
                }
            }
        }
        if self.op_timeout_ms == 0 {
            return err("op_timeout_ms", "must be greater than 0");
        }
        if self.breaker_failures == 0 {
            return err("breaker_failures", "must be greater than 0");
        }
        if self.memory_max_entries == 0 {
            return err("memory_max_entries", "must be greater than 0");
        }
        if self.memory_max_bytes == 0 {
            return err("memory_max_bytes", "must be greater than 0");
        }
        Ok(())
    }
}
