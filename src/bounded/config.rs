//! `[memory]`: how many bytes the process's own caches may hold, and how long an unused entry
//! stays. The in-memory store has its bound in `[store]`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

const MIB: usize = 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// The pipeline's derived values: summaries, ledger lines, stubs, each message's
    /// identifiers and facts, tool catalogs.
    pub memo_max_bytes: usize,
    /// The whole rewrites that conversations append to between recompactions.
    pub rewrites_max_bytes: usize,
    /// Token counts of messages and long texts (both vocabularies together).
    pub token_counts_max_bytes: usize,
    /// Entries of those caches unused this long are dropped, so an idle proxy gives its memory
    /// back (0: kept until evicted).
    pub idle_secs: u64,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            memo_max_bytes: 112 * MIB,
            rewrites_max_bytes: 64 * MIB,
            token_counts_max_bytes: 16 * MIB,
            idle_secs: 30,
        }
    }
}

impl MemoryConfig {
    pub fn idle(&self) -> Option<Duration> {
        (self.idle_secs > 0).then(|| Duration::from_secs(self.idle_secs))
    }

    pub fn validate(&self) -> Result<(), (String, String)> {
        let err = |key: &str| Err((format!("memory.{key}"), "must be greater than 0".to_owned()));
        if self.memo_max_bytes == 0 {
            return err("memo_max_bytes");
        }
        if self.rewrites_max_bytes == 0 {
            return err("rewrites_max_bytes");
        }
        if self.token_counts_max_bytes == 0 {
            return err("token_counts_max_bytes");
        }
        Ok(())
    }
}
