//! The shape of streamed chunks, for the rewriters that relay one answer made of several
//! upstream answers (continuation, expansion): events, the usage chunk, re-stamping, deltas.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use crate::openai::sse::{event_data, is_done};

/// One SSE event of a streamed answer.
pub enum Event {
    /// `data: [DONE]`.
    Done,
    /// A chunk with `choices`.
    Chunk(Value),
    /// A comment, an error, or a shape no rewriter knows: relayed as it came.
    Other,
}

pub fn read(raw: &[u8]) -> Event {
    match event_data(raw).as_deref() {
        Some(payload) if is_done(payload) => Event::Done,
        Some(payload) => serde_json::from_str::<Value>(payload)
            .ok()
            .filter(|c| c.get("choices").is_some())
            .map_or(Event::Other, Event::Chunk),
        None => Event::Other,
    }
}

/// A chunk as an SSE event.
pub fn event(payload: &Value) -> Bytes {
    Bytes::from(format!("data: {payload}\n\n"))
}

/// The usage chunk that ends the answer: the head, no choices, the usage of every part.
pub fn usage_chunk(head: &Value, usage: Value) -> Value {
    let mut chunk = head.clone();
    if let Some(object) = chunk.as_object_mut() {
        object.insert("choices".into(), json!([]));
        object.insert("usage".into(), usage);
    }
    chunk
}

/// A later part's chunk with the first part's id, created and model (from `head`), and no
/// role delta.
pub fn restamp(chunk: &mut Value, head: &Value) {
    if let (Some(head), Some(chunk)) = (head.as_object(), chunk.as_object_mut()) {
        for (key, value) in head {
            if matches!(key.as_str(), "id" | "created" | "model") {
                chunk.insert(key.clone(), value.clone());
            }
        }
    }
    if let Some(delta) = first_choice(chunk)
        .and_then(|c| c.get_mut("delta"))
        .and_then(Value::as_object_mut)
    {
        delta.remove("role");
        if delta.get("content").and_then(Value::as_str) == Some("") {
            delta.remove("content");
        }
    }
}

/// The first choice of a chunk, when it has one (never panics on other shapes).
pub fn first_choice(chunk: &mut Value) -> Option<&mut Map<String, Value>> {
    chunk
        .get_mut("choices")?
        .as_array_mut()?
        .first_mut()?
        .as_object_mut()
}

pub fn set_delta(chunk: &mut Value, delta: Value) {
    if let Some(choice) = first_choice(chunk) {
        choice.insert("delta".into(), delta);
    }
}

pub fn set_finish(chunk: &mut Value, finish: Value) {
    if let Some(choice) = first_choice(chunk) {
        choice.insert("finish_reason".into(), finish);
    }
}

/// Whether the first choice's delta says anything.
pub fn has_delta(chunk: &Value) -> bool {
    chunk["choices"][0]["delta"]
        .as_object()
        .is_some_and(|d| d.values().any(|v| !v.is_null()))
}
