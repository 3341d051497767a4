//! Sticky tool categories: the categories of a conversation's last
//! tool-using turn, kept in the store so that a follow-up like "both" or "yes, do it" gets the
//! same tools, on any replica. Saved after a response whose turn used tools (tool calls in
//! the response, streamed or not, or in the current turn of the request) and cleared after a
//! turn without tools: a TTL of one turn without tools.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;

use super::SharedState;
use crate::body::{BodyEnd, BodyObserver};
use crate::openai::ChatRequest;
use crate::openai::sse::event_data;
use crate::pipeline::tools::{Catalog, current_turn_calls};

/// The largest non-streaming answer read for tool calls.
const MAX_JSON_BYTES: usize = 8 * 1024 * 1024;

fn key(conversation: &str) -> String {
    format!("sticky:{conversation}")
}

/// The stored sticky categories of a conversation (empty on a miss or a store error).
pub async fn load(state: &SharedState, conversation: &str) -> Vec<String> {
    state
        .store
        .get(&key(conversation))
        .await
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default()
}

/// Watches an answer for tool calls and updates the conversation's sticky categories when it
/// ends complete.
pub struct StickyUpdate {
    state: SharedState,
    conversation: String,
    /// The categories of the tools the request offered (the memo's: a stream in flight holds
    /// a reference, not a copy).
    catalog: Arc<Catalog>,
    /// Tools called in the current turn of the request, then in the answer.
    used: Vec<String>,
    json: Vec<u8>,
    streamed: bool,
}

impl StickyUpdate {
    /// `streamed`: the answer is SSE (else one JSON body).
    pub fn new(
        state: SharedState,
        conversation: String,
        request: &ChatRequest,
        streamed: bool,
    ) -> StickyUpdate {
        let tools = request.tools.get().map_or(&[][..], Vec::as_slice);
        let catalog = Catalog::memoized(tools, &state.config.pipeline.tools, &state.memo);
        StickyUpdate {
            state,
            conversation,
            catalog,
            used: current_turn_calls(request),
            json: Vec::new(),
            streamed,
        }
    }

    fn note_calls(&mut self, message: &Value, field: &str) {
        let calls = message
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|choice| choice.get(field))
            .filter_map(|m| m.get("tool_calls").and_then(Value::as_array))
            .flatten()
            .filter_map(|call| call.pointer("/function/name").and_then(Value::as_str));
        let names: Vec<String> = calls.map(str::to_owned).collect();
        self.used.extend(names);
    }
}

impl BodyObserver for StickyUpdate {
    fn on_data(&mut self, data: &Bytes) {
        if self.streamed {
            // One SSE event per frame (see `SseEventBody`).
            if let Some(chunk) =
                event_data(data).and_then(|p| serde_json::from_str::<Value>(&p).ok())
            {
                self.note_calls(&chunk, "delta");
            }
        } else if self.json.len() + data.len() <= MAX_JSON_BYTES {
            self.json.extend_from_slice(data);
        }
    }

    fn on_end(mut self: Box<Self>, end: BodyEnd) {
        if end != BodyEnd::Complete {
            return;
        }
        if !self.streamed
            && let Ok(answer) = serde_json::from_slice::<Value>(&self.json)
        {
            self.note_calls(&answer, "message");
        }
        let used: HashSet<&str> = self.used.iter().map(String::as_str).collect();
        let mut categories: Vec<String> = (self.catalog.categories.iter())
            .filter(|category| {
                category
                    .tools
                    .iter()
                    .any(|tool| used.contains(tool.as_str()))
            })
            .map(|category| category.name.clone())
            .collect();
        categories.sort();
        categories.dedup();
        let ttl = Duration::from_secs(self.state.config.pipeline.tools.sticky_ttl_secs);
        tokio::spawn(async move {
            let key = key(&self.conversation);
            if categories.is_empty() {
                self.state.store.delete(&key).await;
            } else if let Ok(value) = serde_json::to_vec(&categories) {
                self.state.store.set(&key, &value, ttl).await;
            }
        });
    }
}
