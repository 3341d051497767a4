//! `[cache]`: what is cached, for how long, and which request fields never change an answer.

use serde::{Deserialize, Serialize};

/// Which requests the deterministic cache accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Accept {
    /// `temperature: 0` only.
    TemperatureZero,
    /// `temperature: 0`, or any request that sends a `seed`.
    Seeded,
    /// Every request (an answer may then differ from what the model would say now).
    All,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    pub deterministic: DeterministicConfig,
    pub dedup: DedupConfig,
    /// Words and phrases that make a question time-dependent (never cached), folded.
    pub time_words: Vec<String>,
    /// Request headers that change who may share an answer, besides `OpenAI-Organization` and
    /// `OpenAI-Project` (always): their values are part of every cache's scope.
    pub key_headers: Vec<String>,
    /// Answers larger than this (JSON, or a stream's events) are relayed but never stored.
    pub max_entry_bytes: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeterministicConfig {
    pub enabled: bool,
    pub accept: Accept,
    pub ttl_secs: u64,
    /// Request fields left out of the key besides `stream`, `stream_options` and `user`.
    pub ignore_fields: Vec<String>,
}

impl Default for DeterministicConfig {
    fn default() -> Self {
        DeterministicConfig {
            enabled: true,
            accept: Accept::TemperatureZero,
            ttl_secs: 24 * 3600,
            ignore_fields: Vec::new(),
        }
    }
}

/// What turns a question into a vector for the dedup cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Embedder {
    /// Built in: hashed word and character n-grams, no model, no call.
    Lexical,
    /// The route's upstream `POST /embeddings` with `embedding_model`.
    Upstream,
}

/// Who may share a dedup answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DedupScope {
    /// The caller, the request's contract and its turns before the question
    /// (`cache::dedup_scope`).
    System,
    /// The same, and the request's `user` field.
    User,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DedupConfig {
    pub enabled: bool,
    pub scope: DedupScope,
    /// Similarity a hit needs, besides every guard.
    pub threshold: f32,
    /// Questions kept per scope (oldest evicted).
    pub max_entries: usize,
    pub ttl_secs: u64,
    /// Put by the proxy at the start of a reused answer.
    pub disclaimer: String,
    pub embedder: Embedder,
    /// The model asked for vectors when `embedder = "upstream"`.
    pub embedding_model: String,
    /// How long a question waits for its vector before it goes to the model uncached.
    pub embedding_timeout_ms: u64,
}

impl Default for DedupConfig {
    fn default() -> Self {
        DedupConfig {
            // Opt-in: reusing an answer across a scope's users is a product decision.
            enabled: false,
            scope: DedupScope::System,
            threshold: 0.85,
            max_entries: 500,
            ttl_secs: 24 * 3600,
            disclaimer: "[Answer retrieved from an earlier conversation]".into(),
            embedder: Embedder::Lexical,
            embedding_model: "text-embedding-3-small".into(),
            embedding_timeout_ms: 2000,
        }
    }
}

impl CacheConfig {
    pub fn validate(&self) -> Result<(), (String, String)> {
        let err = |key: &str, message: &str| Err((format!("cache.{key}"), message.to_owned()));
        if let Some(bad) = self
            .key_headers
            .iter()
            .find(|h| axum::http::HeaderName::try_from(h.as_str()).is_err())
        {
            return err("key_headers", &format!("{bad:?} is not a header name"));
        }
        if self.max_entry_bytes == 0 {
            return err("max_entry_bytes", "must be greater than 0");
        }
        let dedup = &self.dedup;
        if !(0.0..=1.0).contains(&dedup.threshold) {
            return err("dedup.threshold", "must be between 0 and 1");
        }
        if dedup.max_entries == 0 {
            return err("dedup.max_entries", "must be greater than 0");
        }
        if dedup.embedder == Embedder::Upstream && dedup.embedding_model.trim().is_empty() {
            return err(
                "dedup.embedding_model",
                "must name a model when embedder = \"upstream\"",
            );
        }
        if dedup.embedding_timeout_ms == 0 {
            return err("dedup.embedding_timeout_ms", "must be greater than 0");
        }
        Ok(())
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            deterministic: DeterministicConfig::default(),
            dedup: DedupConfig::default(),
            time_words: super::time_words::DEFAULT
                .iter()
                .map(|w| (*w).to_owned())
                .collect(),
            key_headers: Vec::new(),
            max_entry_bytes: 1024 * 1024,
        }
    }
}
