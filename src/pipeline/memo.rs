//! A process-wide memo of derived values keyed by a hash of their inputs: segment summaries,
//! ledgers, ledger lines and stubs, the identifiers and facts of each message, and the tool
//! catalogs built from a request's tool definitions.
//!
//! Consecutive requests of a conversation share their older segments and their tools, and the
//! budget stage reruns the stages several times per request; the memo makes each summary and
//! each catalog cost once. It also keeps the rewrites that conversations append to between
//! recompactions (`prefix.rs`), in a smaller map of their own. Like the token-count cache it never changes a result: the key covers
//! every input.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::tools::catalog::Catalog;

/// Entries kept before the memo is cleared (a summary line is ~200 bytes).
const CAPACITY: usize = 50_000;
/// Tool catalogs kept (one per distinct tool list a deployment's clients send).
const CATALOG_CAPACITY: usize = 1_024;
/// Whole rewrites kept (one per conversation between its recompactions), and their bytes at
/// most (the map is cleared past either).
const REWRITE_CAPACITY: usize = 1_024;
const REWRITE_BYTES: usize = 256 * 1024 * 1024;

#[derive(Default)]
pub struct Memo {
    entries: Mutex<HashMap<u64, Arc<str>>>,
    identifiers: Mutex<HashMap<u64, Arc<[String]>>>,
    skeletons: Mutex<HashMap<u64, Option<Arc<serde_json::Value>>>>,
    catalogs: Mutex<HashMap<u64, Arc<Catalog>>>,
    values: Mutex<HashMap<u64, Arc<dyn Any + Send + Sync>>>,
    rewrites: Mutex<Rewrites>,
}

/// The rewrites kept, and about how many bytes they hold.
#[derive(Default)]
struct Rewrites {
    map: HashMap<u64, Arc<super::Rewrite>>,
    bytes: usize,
}

impl Memo {
    /// The text for `key`, computed by `make` on a miss.
    pub fn text(&self, key: u64, make: impl FnOnce() -> String) -> Arc<str> {
        cached(&self.entries, CAPACITY, key, || make().into())
    }

    /// The identifiers for `key` (one message's or one text's), found by `make` on a miss.
    pub fn identifiers(&self, key: u64, make: impl FnOnce() -> Vec<String>) -> Arc<[String]> {
        cached(&self.identifiers, CAPACITY, key, || make().into())
    }

    /// The identifier skeleton for `key` (one JSON text's; `None` when not JSON or empty).
    pub fn skeleton(
        &self,
        key: u64,
        make: impl FnOnce() -> Option<serde_json::Value>,
    ) -> Option<Arc<serde_json::Value>> {
        cached(&self.skeletons, CAPACITY, key, || make().map(Arc::new))
    }

    /// A derived value of any type for `key` (its seed names the type), made on a miss.
    pub fn value<T: Any + Send + Sync>(&self, key: u64, make: impl FnOnce() -> T) -> Arc<T> {
        if let Some(hit) = self.peek(key) {
            return hit;
        }
        let value = Arc::new(make());
        if let Ok(mut entries) = self.values.lock() {
            if entries.len() >= CAPACITY {
                entries.clear();
            }
            entries.insert(key, value.clone());
        }
        value
    }

    /// The value of type `T` for `key`, if it was made.
    pub fn peek<T: Any + Send + Sync>(&self, key: u64) -> Option<Arc<T>> {
        self.values
            .lock()
            .ok()
            .and_then(|m| m.get(&key).cloned())
            .and_then(|v| v.downcast::<T>().ok())
    }

    /// The whole rewrite for `key`, made on a miss.
    pub fn rewrite(&self, key: u64, make: impl FnOnce() -> super::Rewrite) -> Arc<super::Rewrite> {
        if let Some(hit) = self.peek_rewrite(key) {
            return hit;
        }
        let rewrite = Arc::new(make());
        let bytes = approximate_bytes(&rewrite.request);
        if let Ok(mut kept) = self.rewrites.lock() {
            if kept.map.len() >= REWRITE_CAPACITY || kept.bytes + bytes > REWRITE_BYTES {
                kept.map.clear();
                kept.bytes = 0;
            }
            if bytes <= REWRITE_BYTES {
                kept.map.insert(key, rewrite.clone());
                kept.bytes += bytes;
            }
        }
        rewrite
    }

    /// The whole rewrite for `key`, if it was kept.
    pub fn peek_rewrite(&self, key: u64) -> Option<Arc<super::Rewrite>> {
        self.rewrites
            .lock()
            .ok()
            .and_then(|kept| kept.map.get(&key).cloned())
    }

    /// The catalog for `key`, built by `make` on a miss.
    pub fn catalog(&self, key: u64, make: impl FnOnce() -> Catalog) -> Arc<Catalog> {
        cached(&self.catalogs, CATALOG_CAPACITY, key, || Arc::new(make()))
    }
}

/// About how many bytes a request holds: its texts, tool-call arguments and tool definitions.
fn approximate_bytes(request: &crate::openai::ChatRequest) -> usize {
    let message = |m: &crate::openai::Message| {
        m.content.get().map_or(0, |c| c.text().len())
            + m.tool_calls()
                .iter()
                .map(|c| c.function.arguments.len() + 64)
                .sum::<usize>()
            + 64
    };
    let tools = request.tools.get().map_or(0, |tools| {
        serde_json::to_string(tools).map_or(0, |t| t.len())
    });
    request.messages.iter().map(message).sum::<usize>() + tools
}

/// The value for `key` in `map`, made on a miss; the map is cleared when it reaches `capacity`.
/// A poisoned lock only costs the caching.
fn cached<V: Clone>(
    map: &Mutex<HashMap<u64, V>>,
    capacity: usize,
    key: u64,
    make: impl FnOnce() -> V,
) -> V {
    if let Some(hit) = map.lock().ok().and_then(|m| m.get(&key).cloned()) {
        return hit;
    }
    let value = make();
    if let Ok(mut entries) = map.lock() {
        if entries.len() >= capacity {
            entries.clear();
        }
        entries.insert(key, value.clone());
    }
    value
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

    #[test]
    fn values_are_typed() {
        let memo = Memo::default();
        assert_eq!(*memo.value(7, || 42u32), 42);
        assert_eq!(*memo.value(7, || -> u32 { unreachable!("cached") }), 42);
        // Another type under the same key is made, not mistaken for the first.
        assert_eq!(*memo.value(7, || String::from("x")), "x");
    }
}
