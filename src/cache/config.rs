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
    /// Words and phrases that make a question time-dependent (never cached), folded.
    pub time_words: Vec<String>,
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

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            deterministic: DeterministicConfig::default(),
            time_words: super::time_words::DEFAULT
                .iter()
                .map(|w| (*w).to_owned())
                .collect(),
        }
    }
}
