//! `[record]`: where and how much of the traffic is written to disk for later replay.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecordConfig {
    /// The JSONL file exchanges are appended to; recording is off while it is empty.
    pub path: String,
    /// Fraction of chat requests recorded, 0.0–1.0 (every `1/rate`-th request, evenly spread).
    pub sample_rate: f64,
    /// Size at which the file is rotated to `<path>.1` (and `.1` to `.2`, …).
    pub max_bytes: u64,
    /// Files kept, the current one included; the oldest is deleted at rotation.
    pub max_files: u32,
    /// Records waiting for the writer; when full, new records are dropped and counted.
    pub queue_capacity: usize,
    /// Bytes those exchanges may hold (requests, rewrites and responses); past it, as full.
    pub queue_max_bytes: usize,
    /// Request headers never written, besides those always left out (`Authorization`,
    /// `Proxy-Authorization`, `Cookie`, `X-Api-Key`, `Api-Key`). Case-insensitive.
    pub redact_headers: Vec<String>,
}

impl Default for RecordConfig {
    fn default() -> Self {
        RecordConfig {
            path: String::new(),
            sample_rate: 1.0,
            max_bytes: 100 * 1024 * 1024,
            max_files: 5,
            queue_capacity: 1024,
            queue_max_bytes: 64 * 1024 * 1024,
            redact_headers: Vec::new(),
        }
    }
}

impl RecordConfig {
    pub fn enabled(&self) -> bool {
        !self.path.trim().is_empty()
    }

    pub fn validate(&self) -> Result<(), (String, String)> {
        let err = |key: &str, message: &str| Err((format!("record.{key}"), message.to_owned()));
        if !(0.0..=1.0).contains(&self.sample_rate) {
            return err("sample_rate", "must be between 0.0 and 1.0");
        }
        if self.max_bytes < 4096 {
            return err("max_bytes", "must be at least 4096");
        }
        if self.max_files == 0 {
            return err("max_files", "must be at least 1");
        }
        if self.queue_max_bytes == 0 {
            return err("queue_max_bytes", "must be at least 1");
        }
        if self.queue_capacity == 0 {
            return err("queue_capacity", "must be at least 1");
        }
        if self.enabled() {
            let path = std::path::Path::new(self.path.trim());
            let parent = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(std::path::Path::new("."));
            if !parent.is_dir() {
                return err(
                    "path",
                    &format!("directory `{}` does not exist", parent.display()),
                );
            }
        }
        Ok(())
    }
}
