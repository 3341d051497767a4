//! A process-wide memo of derived values keyed by a hash of their inputs: segment summaries,
//! ledgers and stubs, the identifiers of each message, and the tool catalogs built from a
//! request's tool definitions.
//!
//! Consecutive requests of a conversation share their older segments and their tools, and the
//! budget stage reruns the stages several times per request; the memo makes each summary and
//! each catalog cost once. Like the token-count cache it never changes a result: the key covers
//! every input.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::tools::catalog::Catalog;

/// Entries kept before the memo is cleared (a summary line is ~200 bytes).
const CAPACITY: usize = 50_000;
/// Tool catalogs kept (one per distinct tool list a deployment's clients send).
const CATALOG_CAPACITY: usize = 1_024;

#[derive(Default)]
pub struct Memo {
    entries: Mutex<HashMap<u64, Arc<str>>>,
    identifiers: Mutex<HashMap<u64, Arc<[String]>>>,
    skeletons: Mutex<HashMap<u64, Option<Arc<serde_json::Value>>>>,
    catalogs: Mutex<HashMap<u64, Arc<Catalog>>>,
}

impl Memo {
    /// The text for `key`, computed by `make` on a miss.
    pub fn text(&self, key: u64, make: impl FnOnce() -> String) -> Arc<str> {
        if let Some(hit) = self.entries.lock().ok().and_then(|e| e.get(&key).cloned()) {
            return hit;
        }
        let value: Arc<str> = make().into();
        if let Ok(mut entries) = self.entries.lock() {
            if entries.len() >= CAPACITY {
                entries.clear();
            }
            entries.insert(key, Arc::clone(&value));
        }
        value
    }

    /// The identifiers for `key` (one message's), found by `make` on a miss.
    pub fn identifiers(&self, key: u64, make: impl FnOnce() -> Vec<String>) -> Arc<[String]> {
        if let Some(hit) = self
            .identifiers
            .lock()
            .ok()
            .and_then(|e| e.get(&key).cloned())
        {
            return hit;
        }
        let value: Arc<[String]> = make().into();
        if let Ok(mut entries) = self.identifiers.lock() {
            if entries.len() >= CAPACITY {
                entries.clear();
            }
            entries.insert(key, Arc::clone(&value));
        }
        value
    }

    /// The identifier skeleton for `key` (one JSON text's; `None` when not JSON or empty).
    pub fn skeleton(
        &self,
        key: u64,
        make: impl FnOnce() -> Option<serde_json::Value>,
    ) -> Option<Arc<serde_json::Value>> {
        if let Some(hit) = self
            .skeletons
            .lock()
            .ok()
            .and_then(|e| e.get(&key).cloned())
        {
            return hit;
        }
        let value = make().map(Arc::new);
        if let Ok(mut entries) = self.skeletons.lock() {
            if entries.len() >= CAPACITY {
                entries.clear();
            }
            entries.insert(key, value.clone());
        }
        value
    }

    /// The catalog for `key`, built by `make` on a miss.
    pub fn catalog(&self, key: u64, make: impl FnOnce() -> Catalog) -> Arc<Catalog> {
        if let Some(hit) = self.catalogs.lock().ok().and_then(|c| c.get(&key).cloned()) {
            return hit;
        }
        let value = Arc::new(make());
        if let Ok(mut catalogs) = self.catalogs.lock() {
            if catalogs.len() >= CATALOG_CAPACITY {
                catalogs.clear();
            }
            catalogs.insert(key, Arc::clone(&value));
        }
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn computes_once_per_key() {
        let memo = Memo::default();
        let mut calls = 0;
        let a = memo.text(1, || {
            calls += 1;
            "one".into()
        });
        let b = memo.text(1, || unreachable!("cached"));
        assert_eq!((&*a, &*b, calls), ("one", "one", 1));
        assert_eq!(&*memo.text(2, || "two".into()), "two");
    }
}
