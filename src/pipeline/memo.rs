//! A process-wide memo of derived values keyed by a hash of their inputs: segment summaries,
//! ledgers, ledger lines and stubs, the identifiers and facts of each message, the tool
//! catalogs built from a request's tool definitions, and the tool blocks requests were read
//! with (`ToolBlocks`: an application sends the same block on every request).
//!
//! Consecutive requests of a conversation share their older segments and their tools, and the
//! budget stage reruns the stages several times per request; the memo makes each summary and
//! each catalog cost once. It also keeps the rewrites that conversations append to between
//! recompactions (`prefix.rs`), in a map of their own. Both are bounded in bytes (`[memory]`:
//! the least recently used go first, and what no request used for `idle_secs` is swept). Like
//! the token-count cache it never changes a result: the key covers every input.

use std::any::Any;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Instant;

use foldhash::quality::FixedState;

use crate::bounded::{MemoryConfig, SharedLru, Weigh};
use crate::openai::{Tool, ToolBlocks};

pub struct Memo {
    derived: SharedLru<(Kind, u64), Entry>,
    rewrites: SharedLru<u64, Arc<super::Rewrite>>,
}

/// Which map a key belongs to: the same hash under two kinds is two entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Text,
    Identifiers,
    Skeleton,
    Catalog,
    Value,
}

/// A derived value, of the type its kind (and, for `Value`, its key's seed) says.
type Entry = Arc<dyn Any + Send + Sync>;

impl Default for Memo {
    fn default() -> Self {
        Memo::new(&MemoryConfig::default())
    }
}

impl Memo {
    pub fn new(config: &MemoryConfig) -> Memo {
        Memo {
            derived: SharedLru::new(config.memo_max_bytes, config.idle()),
            rewrites: SharedLru::new(config.rewrites_max_bytes, config.idle()),
        }
    }

    /// The text for `key`, computed by `make` on a miss.
    pub fn text(&self, key: u64, make: impl FnOnce() -> String) -> Arc<str> {
        let text = self.derive(Kind::Text, key, || Arc::<str>::from(make()), |t| t.len());
        Arc::clone(&text)
    }

    /// The identifiers for `key` (one message's or one text's), found by `make` on a miss.
    pub fn identifiers(&self, key: u64, make: impl FnOnce() -> Vec<String>) -> Arc<[String]> {
        let ids = self.derive(
            Kind::Identifiers,
            key,
            || Arc::<[String]>::from(make()),
            |ids| ids.heap_bytes(),
        );
        Arc::clone(&ids)
    }

    /// The identifier skeleton for `key` (one JSON text's; `None` when not JSON or empty).
    pub fn skeleton(
        &self,
        key: u64,
        make: impl FnOnce() -> Option<serde_json::Value>,
    ) -> Option<Arc<serde_json::Value>> {
        let tree = self.derive(
            Kind::Skeleton,
            key,
            || make().map(Arc::new),
            |tree| tree.as_deref().map_or(0, Weigh::heap_bytes),
        );
        Option::clone(&tree)
    }

    /// A derived value of any type for `key` (its seed names the type), made on a miss.
    pub fn value<T: Any + Send + Sync + Weigh>(
        &self,
        key: u64,
        make: impl FnOnce() -> T,
    ) -> Arc<T> {
        self.derive(Kind::Value, key, make, T::heap_bytes)
    }

    /// The value of type `T` for `key`, if it was made.
    pub fn peek<T: Any + Send + Sync>(&self, key: u64) -> Option<Arc<T>> {
        self.derived.get(&(Kind::Value, key))?.downcast::<T>().ok()
    }

    /// The whole rewrite for `key`, made on a miss.
    pub fn rewrite(&self, key: u64, make: impl FnOnce() -> super::Rewrite) -> Arc<super::Rewrite> {
        self.rewrites
            .get_or_make(key, || Arc::new(make()), rewrite_bytes)
    }

    /// The whole rewrite for `key`, if it was kept.
    pub fn peek_rewrite(&self, key: u64) -> Option<Arc<super::Rewrite>> {
        self.rewrites.get(&key)
    }

    /// The tool catalog for `key` (`tools::catalog::Catalog`), built by `make` on a miss. Kept
    /// apart from `value`'s keys; generic so that the memo, below every stage, names no stage.
    pub fn catalog<C: Any + Send + Sync + Weigh>(
        &self,
        key: u64,
        make: impl FnOnce() -> C,
    ) -> Arc<C> {
        self.derive(Kind::Catalog, key, make, C::heap_bytes)
    }

    /// Drops what no request used within `[memory] idle_secs`.
    pub fn sweep(&self, now: Instant) {
        self.derived.sweep(now);
        self.rewrites.sweep(now);
    }

    /// Bytes held by the derived values and by the rewrites.
    pub fn bytes(&self) -> (usize, usize) {
        (self.derived.bytes(), self.rewrites.bytes())
    }

    /// The value of type `T` for `key`, made on a miss (or when another type was kept under
    /// it) and counted as `weigh` says beside its own size.
    fn derive<T: Any + Send + Sync>(
        &self,
        kind: Kind,
        key: u64,
        make: impl FnOnce() -> T,
        weigh: impl FnOnce(&T) -> usize,
    ) -> Arc<T> {
        let hit = self
            .derived
            .get(&(kind, key))
            .and_then(|e| e.downcast::<T>().ok());
        if let Some(hit) = hit {
            return hit;
        }
        let value = Arc::new(make());
        let bytes = weigh(&value) + std::mem::size_of::<T>();
        self.derived.insert((kind, key), value.clone(), bytes);
        value
    }
}

/// Seed of the memo keys of tool blocks.
const TOOL_BLOCK_SEED: u64 = 0x746f_6f6c_626c_0001;

/// A tool block as read, and the JSON text it was read from.
struct ToolBlock {
    json: Box<str>,
    tools: Vec<Tool>,
}

impl Weigh for ToolBlock {
    fn heap_bytes(&self) -> usize {
        self.json.len() + self.tools.iter().map(tool_bytes).sum::<usize>()
    }
}

impl ToolBlocks for Memo {
    /// The block read before from the same text, or read now and kept. Its schemas are shared
    /// (`Arc`), so their hash and their JSON are computed once for every request that sends them.
    fn tools(&self, json: &str) -> Result<Vec<Tool>, serde_json::Error> {
        let key = FixedState::with_seed(TOOL_BLOCK_SEED).hash_one(json);
        let block = match self.peek::<ToolBlock>(key) {
            Some(block) if *block.json == *json => block,
            _ => {
                let tools = read_block(json)?;
                self.value(key, || ToolBlock {
                    json: json.into(),
                    tools,
                })
            }
        };
        if *block.json != *json {
            // Another text under the same key: read as it is.
            return read_block(json);
        }
        Ok(block.tools.clone())
    }
}

/// The tools of a block's text, read one level down as a request's `tools` is (in its object):
/// a block nested deeper than a request may hold is refused as the request would be.
fn read_block(json: &str) -> Result<Vec<Tool>, serde_json::Error> {
    let (tools,): (Vec<Tool>,) = serde_json::from_str(&format!("[{json}]"))?;
    Ok(tools)
}

/// About how many bytes a kept rewrite holds: its request, and its report's stages.
fn rewrite_bytes(rewrite: &Arc<super::Rewrite>) -> usize {
    size_of::<super::Rewrite>()
        + approximate_bytes(&rewrite.request)
        + size_of_val(rewrite.report.stages.as_slice())
}

/// About how many bytes a request holds: each message and tool call (their own size beside
/// their texts: a short conversation is mostly that), tool-call arguments and tool definitions.
fn approximate_bytes(request: &crate::openai::ChatRequest) -> usize {
    let message = |m: &crate::openai::Message| {
        m.content.get().map_or(0, |c| c.text().len())
            + m.tool_calls()
                .iter()
                .map(|c| c.function.arguments.len() + size_of::<crate::openai::ToolCall>())
                .sum::<usize>()
            + size_of::<crate::openai::Message>()
    };
    let tools = request
        .tools
        .get()
        .map_or(0, |tools| tools.iter().map(tool_bytes).sum());
    request.messages.iter().map(message).sum::<usize>() + tools
}

/// About how many bytes a tool definition holds, read without writing it out.
fn tool_bytes(tool: &crate::openai::Tool) -> usize {
    let extra = |extra: &crate::openai::Extra| {
        extra
            .iter()
            .map(|(k, v)| k.len() + value_bytes(v))
            .sum::<usize>()
    };
    let function = tool.function.as_ref().map_or(0, |f| {
        f.name.len()
            + f.description.get().map_or(0, |d| d.len())
            + f.parameters.get().map_or(0, |p| value_bytes(p.value()))
            + extra(&f.extra)
    });
    64 + tool.kind.len() + function + extra(&tool.extra)
}

/// About how many bytes a JSON value holds: its strings and keys, and a few per node.
fn value_bytes(value: &serde_json::Value) -> usize {
    use serde_json::Value;
    8 + match value {
        Value::String(text) => text.len(),
        Value::Array(items) => items.iter().map(value_bytes).sum(),
        Value::Object(map) => map.iter().map(|(k, v)| k.len() + value_bytes(v)).sum(),
        _ => 0,
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

    #[test]
    fn a_tool_block_is_read_once_and_requests_read_with_it_are_the_same() {
        use crate::error::ProxyError;
        use crate::openai::ChatRequest;
        let memo = Memo::default();
        let body = |tools: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"tools":{tools}}}"#
            )
        };
        let block =
            r#"[{"type":"function","function":{"name":"f","parameters":{"type":"object"}},"x":1}]"#;
        let first = ChatRequest::parse_with(body(block).as_bytes(), &memo).unwrap();
        let again = ChatRequest::parse_with(body(block).as_bytes(), &memo).unwrap();
        assert_eq!(first, ChatRequest::parse(body(block).as_bytes()).unwrap());
        assert_eq!(again, first);
        let schema = |chat: &ChatRequest| {
            let tools = chat.tools.get().unwrap();
            Arc::clone(
                tools[0]
                    .function
                    .as_ref()
                    .unwrap()
                    .parameters
                    .get()
                    .unwrap(),
            )
        };
        assert!(Arc::ptr_eq(&schema(&first), &schema(&again)), "read once");
        let spaced = block.replace(",\"x\"", ", \"x\"");
        let other = ChatRequest::parse_with(body(&spaced).as_bytes(), &memo).unwrap();
        assert_eq!(other, first, "another text, the same tools");
        assert!(!Arc::ptr_eq(&schema(&other), &schema(&first)));

        let null = ChatRequest::parse_with(body("null").as_bytes(), &memo).unwrap();
        assert_eq!(null.tools, crate::openai::Nullable::Null);
        // A block that does not read is the same error as without the memo, naming the field.
        let bad = body(r#"[{"type":"function","function":{"parameters":{}}}]"#);
        let error = |e: ProxyError| format!("{e:?}");
        assert_eq!(
            error(ChatRequest::parse_with(bad.as_bytes(), &memo).unwrap_err()),
            error(ChatRequest::parse(bad.as_bytes()).unwrap_err())
        );
        assert!(
            error(ChatRequest::parse(bad.as_bytes()).unwrap_err()).contains("tools[0].function")
        );
        // A block as deep as a request may hold reads; one level deeper is refused by both.
        for (depth, reads) in [(124, true), (125, false)] {
            let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            let deep = body(&format!(r#"[{{"type":"x","a":{nested}}}]"#));
            let with = ChatRequest::parse_with(deep.as_bytes(), &memo);
            let without = ChatRequest::parse(deep.as_bytes());
            assert_eq!(with.is_ok(), reads, "depth {depth}");
            assert_eq!(without.is_ok(), reads, "depth {depth}");
        }
    }

    #[test]
    fn a_kept_rewrite_weighs_its_messages_and_report_not_only_its_texts() {
        let memo = Memo::default();
        let request: crate::openai::ChatRequest = serde_json::from_value(serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ok?"}]
        }))
        .unwrap();
        let rewrite = memo.rewrite(1, || super::super::Rewrite {
            request,
            report: crate::pipeline::PipelineReport {
                tokens_before: 3,
                tokens_after: 3,
                stages: Vec::new(),
                budget: 4_000,
                fits: true,
                over_budget: None,
                prefix: None,
            },
            remember: None,
        });
        let (_, bytes) = memo.bytes();
        assert!(bytes >= rewrite_bytes(&rewrite));
        assert!(
            bytes >= size_of::<super::super::Rewrite>() + 3 * size_of::<crate::openai::Message>()
        );
    }

    #[test]
    fn values_are_typed() {
        let memo = Memo::default();
        assert_eq!(*memo.value(7, || 42u32), 42);
        assert_eq!(*memo.value(7, || -> u32 { unreachable!("cached") }), 42);
        // Another type under the same key is made, not mistaken for the first.
        assert_eq!(*memo.value(7, || String::from("x")), "x");
        // A text under the same hash is another entry.
        assert_eq!(&*memo.text(7, || "seven".into()), "seven");
        assert_eq!(*memo.value(7, || -> String { unreachable!("cached") }), "x");
    }

    #[test]
    fn stays_within_its_bytes_and_sweeps_idle_entries() {
        let config = MemoryConfig {
            memo_max_bytes: 64 * 1024,
            idle_secs: 30,
            ..MemoryConfig::default()
        };
        let memo = Memo::new(&config);
        for key in 0..1_000 {
            memo.text(key, || "x".repeat(1_000));
        }
        let (derived, rewrites) = memo.bytes();
        assert!(derived <= 64 * 1024, "{derived} bytes kept");
        assert!(
            derived > 32 * 1024,
            "{derived} bytes kept: it should be nearly full"
        );
        assert_eq!(rewrites, 0);
        // The most recent are the ones kept.
        assert_eq!(&*memo.text(999, || unreachable!("kept")), "x".repeat(1_000));
        memo.sweep(Instant::now() + std::time::Duration::from_secs(31));
        assert_eq!(memo.bytes(), (0, 0));
    }
}
