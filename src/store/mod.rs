//! The store every stateful feature uses (sticky tool categories, caches): get, set with TTL,
//! delete, and capped lists, behind one small trait with a Redis and an in-memory backend.
//!
//! `Store` is what callers use. It prefixes keys, bounds every operation in time, counts errors
//! and treats them as misses (a request never fails because of the store), and while Redis is
//! down (circuit breaker open) serves from memory without waiting.

mod breaker;
pub mod config;
mod memory;
mod redis;

use std::future::Future;
use std::time::Duration;

use prometheus::{IntCounterVec, IntGauge};

use self::breaker::Breaker;
pub use self::config::StoreConfig;
pub use self::memory::MemoryBackend;
pub use self::redis::RedisBackend;
use crate::metrics::labels::StoreOp;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error("the operation exceeded its time budget")]
    Timeout,
    #[error("the in-memory store's lock was poisoned")]
    Poisoned,
}

/// What a key-value backend offers. Keys arrive prefixed; values are opaque bytes.
pub trait Backend: Send + Sync {
    fn get(&self, key: &str) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send;
    fn set(
        &self,
        key: &str,
        value: &[u8],
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    fn delete(&self, key: &str) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Puts `value` first in the list at `key`, keeps the newest `max_len` items and refreshes
    /// the list's TTL.
    fn push_capped(
        &self,
        key: &str,
        value: &[u8],
        max_len: usize,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// The list at `key`, newest first (empty when absent).
    fn list(&self, key: &str) -> impl Future<Output = Result<Vec<Vec<u8>>, StoreError>> + Send;
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The store's two metrics, defined in `metrics.rs`.
#[derive(Clone)]
pub struct StoreMetrics {
    pub errors: IntCounterVec,
    pub up: IntGauge,
}

pub struct Store {
    prefix: String,
    redis: Option<RedisBackend>,
    memory: MemoryBackend,
    breaker: Breaker,
    timeout: Duration,
    metrics: StoreMetrics,
}

/// Where a call was served.
enum Target<'a> {
    Redis(&'a RedisBackend, breaker::Call<'a>),
    Memory(&'a MemoryBackend),
}

impl Store {
    pub fn new(config: &StoreConfig, metrics: StoreMetrics) -> Result<Store, StoreError> {
        let redis = match config.backend {
            config::Backend::Redis => Some(RedisBackend::new(config)?),
            config::Backend::Memory => None,
        };
        metrics.up.set(1);
        Ok(Store {
            prefix: config.key_prefix.clone(),
            redis,
            memory: MemoryBackend::new(config.memory_max_entries, config.memory_max_bytes),
            breaker: Breaker::new(
                config.breaker_failures,
                Duration::from_millis(config.breaker_probe_ms),
            ),
            timeout: Duration::from_millis(config.op_timeout_ms),
            metrics,
        })
    }

    /// Bytes the in-memory backend holds (the embedded store, or what it kept while Redis was
    /// down).
    pub fn memory_bytes(&self) -> usize {
        self.memory.bytes()
    }

    /// Drops the in-memory backend's expired entries.
    pub fn sweep(&self, now: std::time::Instant) {
        self.memory.sweep(now);
    }

    /// `redis` or `memory`: the backend serving calls right now.
    pub fn serving(&self) -> &'static str {
        match (&self.redis, self.breaker.is_closed()) {
            (Some(_), true) => "redis",
            _ => "memory",
        }
    }

    /// False while the configured Redis is unreachable (calls are served from memory).
    pub fn is_up(&self) -> bool {
        self.redis.is_none() || self.breaker.is_closed()
    }

    pub fn backend(&self) -> &'static str {
        if self.redis.is_some() {
            "redis"
        } else {
            "memory"
        }
    }

    fn target(&self) -> Target<'_> {
        match &self.redis {
            Some(redis) => match self.breaker.allow() {
                Some(call) => Target::Redis(redis, call),
                None => Target::Memory(&self.memory),
            },
            None => Target::Memory(&self.memory),
        }
    }

    /// Runs one operation on the current target, within the time budget; failures are
    /// counted under `op` and returned as `None`.
    async fn run<T, R, M>(&self, op: StoreOp, on_redis: R, on_memory: M) -> Option<T>
    where
        R: AsyncFnOnce(&RedisBackend) -> Result<T, StoreError>,
        M: AsyncFnOnce(&MemoryBackend) -> Result<T, StoreError>,
    {
        let result = match self.target() {
            Target::Redis(redis, call) => {
                // Dropping this future (the client left) drops `call`, which gives a probe back.
                let result = tokio::time::timeout(self.timeout, on_redis(redis))
                    .await
                    .unwrap_or(Err(StoreError::Timeout));
                match &result {
                    Ok(_) => call.success(),
                    Err(e) => call.failure(&e.to_string()),
                }
                self.metrics.up.set(i64::from(self.breaker.is_closed()));
                result
            }
            Target::Memory(memory) => on_memory(memory).await,
        };
        match result {
            Ok(value) => Some(value),
            Err(e) => {
                self.metrics.errors.with_label_values(&[op.as_str()]).inc();
                tracing::debug!(op = op.as_str(), error = %e, "store operation failed; treated as a miss");
                None
            }
        }
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    pub async fn get(&self, key: &str) -> Option<Vec<u8>> {
        let key = self.key(key);
        self.run(
            StoreOp::Get,
            async |r| r.get(&key).await,
            async |m| m.get(&key).await,
        )
        .await
        .flatten()
    }

    /// Stores `value` under `key` for `ttl`; whether it was stored (a store error is not).
    pub async fn set(&self, key: &str, value: &[u8], ttl: Duration) -> bool {
        let key = self.key(key);
        self.run(
            StoreOp::Set,
            async |r| r.set(&key, value, ttl).await,
            async |m| m.set(&key, value, ttl).await,
        )
        .await
        .is_some()
    }

    pub async fn delete(&self, key: &str) {
        let key = self.key(key);
        self.run(
            StoreOp::Delete,
            async |r| r.delete(&key).await,
            async |m| m.delete(&key).await,
        )
        .await;
    }

    pub async fn push_capped(&self, key: &str, value: &[u8], max_len: usize, ttl: Duration) {
        let key = self.key(key);
        self.run(
            StoreOp::Push,
            async |r| r.push_capped(&key, value, max_len, ttl).await,
            async |m| m.push_capped(&key, value, max_len, ttl).await,
        )
        .await;
    }

    pub async fn list(&self, key: &str) -> Vec<Vec<u8>> {
        let key = self.key(key);
        self.run(
            StoreOp::List,
            async |r| r.list(&key).await,
            async |m| m.list(&key).await,
        )
        .await
        .unwrap_or_default()
    }

    /// At startup: when Redis does not answer, serve from memory from the first request on
    /// (logged once) instead of making the first requests wait for it.
    pub async fn check_at_start(&self) {
        let Some(redis) = &self.redis else {
            return;
        };
        let result =
            tokio::time::timeout(self.timeout.max(Duration::from_millis(500)), redis.ping())
                .await
                .unwrap_or(Err(StoreError::Timeout));
        match result {
            Ok(()) => self.breaker.success(),
            Err(e) => {
                self.breaker.trip(&e.to_string());
                self.metrics.up.set(0);
            }
        }
    }

    /// Checks Redis now (for startup and `/readyz`): a success closes the breaker.
    pub async fn ping(&self) -> bool {
        self.run(
            StoreOp::Ping,
            async |r| r.ping().await,
            async |m| m.ping().await,
        )
        .await
        .is_some()
            && self.is_up()
    }
}

#[cfg(test)]
mod tests {
    //! The behavioural suite shared by both backends is in `tests/store.rs`.
    use super::*;

    #[tokio::test]
    async fn memory_backend_stays_bounded() {
        let memory = MemoryBackend::new(10, 1 << 20);
        for i in 0..50 {
            memory
                .set(&format!("k{i}"), b"v", Duration::from_secs(60 + i))
                .await
                .unwrap();
        }
        assert!(memory.entry_count() <= 10, "{}", memory.entry_count());
        assert_eq!(memory.get("k49").await.unwrap(), Some(b"v".to_vec()));
    }

    #[tokio::test]
    async fn memory_backend_stays_within_its_bytes_evicting_the_least_recently_used() {
        let memory = MemoryBackend::new(1_000, 64 * 1024);
        let value = vec![b'x'; 4 * 1024];
        let ttl = Duration::from_secs(60);
        memory.set("first", &value, ttl).await.unwrap();
        for i in 0..100 {
            memory.set(&format!("k{i}"), &value, ttl).await.unwrap();
            // Read at every step: the first key stays the most recently used.
            assert!(
                memory.get("first").await.unwrap().is_some(),
                "evicted at {i}"
            );
            memory.push_capped("list", &value, 3, ttl).await.unwrap();
        }
        assert!(memory.bytes() <= 64 * 1024, "{} bytes", memory.bytes());
        assert_eq!(memory.get("k0").await.unwrap(), None);
        assert_eq!(memory.get("k99").await.unwrap(), Some(value.clone()));
        assert_eq!(memory.list("list").await.unwrap().len(), 3);
        // Expired entries are swept, whatever reads them.
        memory
            .set("short", &value, Duration::from_millis(1))
            .await
            .unwrap();
        let before = memory.bytes();
        memory.sweep(std::time::Instant::now() + Duration::from_millis(5));
        assert!(memory.bytes() < before);
    }
}
