//! The deterministic cache on the Responses API: which requests a stored Response may answer
//! (those whose answer the client cannot tell from a fresh one), what of an answer is stored
//! (the Response, from a JSON answer or from the `response.completed` event of a stream), and a
//! stored Response replayed as the event stream a client that streams expects. Pure.

use serde_json::{Value, json};

/// Whether a stored Response may answer this body: nothing kept upstream (`store: false`, as a
/// stateless client sends it: a stored one has an id the client may chain on or fetch), no
/// history kept upstream (`previous_response_id`, `conversation`), not run in the background.
pub fn cacheable(body: &serde_json::Map<String, Value>) -> bool {
    let set = |key: &str| body.get(key).is_some_and(|v| !v.is_null());
    body.get("store") == Some(&Value::Bool(false))
        && !set("previous_response_id")
        && !set("conversation")
        && body.get("background") != Some(&Value::Bool(true))
}

/// What of a JSON answer is stored: the Response, when it completed.
pub fn storable(answer: &[u8]) -> Option<Value> {
    let response: Value = serde_json::from_slice(answer).ok()?;
    completed(response)
}

/// A stored Response as this request's: its `user` echoed as this request sent it (the cache
/// key leaves `user` out, as on chat).
pub fn echo_user(response: &mut Value, user: Option<&Value>) {
    if let Some(object) = response.as_object_mut()
        && object.contains_key("user")
    {
        object.insert("user".into(), user.cloned().unwrap_or(Value::Null));
    }
}

/// What a stream event says of the answer: the Response its `response.completed` carries
/// (stored), an event that ends it otherwise (not stored), or nothing yet.
pub enum Seen {
    Completed(Value),
    Unstorable,
    Going,
}

pub fn seen(payload: &str) -> Seen {
    #[derive(serde::Deserialize)]
    struct Event {
        #[serde(rename = "type")]
        kind: String,
        response: Option<Value>,
    }
    let Ok(event) = serde_json::from_str::<Event>(payload) else {
        return Seen::Unstorable;
    };
    match event.kind.as_str() {
        "response.completed" => event
            .response
            .and_then(completed)
            .map_or(Seen::Unstorable, Seen::Completed),
        "error" | "response.failed" | "response.incomplete" => Seen::Unstorable,
        _ => Seen::Going,
    }
}

fn completed(response: Value) -> Option<Value> {
    (response.get("object").and_then(Value::as_str) == Some("response")
        && response.get("status").and_then(Value::as_str) == Some("completed"))
    .then_some(response)
}

/// A stored Response as a Responses event stream: `response.created`, `response.in_progress`,
/// each output item added, its content (a message's text in one delta, a call's arguments in
/// one delta) and done, then `response.completed` with the Response; `sequence_number` from 0.
pub fn replay(response: &Value) -> Vec<u8> {
    let mut events = Events::default();
    let mut opening = response.clone();
    if let Some(object) = opening.as_object_mut() {
        object.insert("status".into(), json!("in_progress"));
        object.insert("output".into(), json!([]));
        object.insert("usage".into(), Value::Null);
    }
    events.push("response.created", json!({"response": opening}));
    events.push("response.in_progress", json!({"response": opening}));
    let output = response.get("output").and_then(Value::as_array);
    for (index, item) in output.into_iter().flatten().enumerate() {
        item_events(&mut events, index, item);
    }
    events.push("response.completed", json!({"response": response}));
    events.body
}

fn item_events(events: &mut Events, index: usize, item: &Value) {
    let id = item.get("id").cloned().unwrap_or(Value::Null);
    let mut added = item.clone();
    if let Some(object) = added.as_object_mut() {
        match object.get("type").and_then(Value::as_str) {
            Some("message") => {
                object.insert("content".into(), json!([]));
                object.insert("status".into(), json!("in_progress"));
            }
            Some("function_call") => {
                object.insert("arguments".into(), json!(""));
                object.insert("status".into(), json!("in_progress"));
            }
            _ => {}
        }
    }
    events.push(
        "response.output_item.added",
        json!({"output_index": index, "item": added}),
    );
    match item.get("type").and_then(Value::as_str) {
        Some("message") => {
            let parts = item.get("content").and_then(Value::as_array);
            for (content_index, part) in parts.into_iter().flatten().enumerate() {
                let at =
                    json!({"item_id": id, "output_index": index, "content_index": content_index});
                let mut empty = part.clone();
                if let Some(text) = empty.get_mut("text") {
                    *text = json!("");
                }
                events.push("response.content_part.added", with(&at, "part", empty));
                if let Some(text) = part.get("text") {
                    events.push(
                        "response.output_text.delta",
                        with(&at, "delta", text.clone()),
                    );
                    events.push("response.output_text.done", with(&at, "text", text.clone()));
                }
                events.push(
                    "response.content_part.done",
                    with(&at, "part", part.clone()),
                );
            }
        }
        Some("function_call") => {
            let arguments = item.get("arguments").cloned().unwrap_or(json!(""));
            let at = json!({"item_id": id, "output_index": index});
            events.push(
                "response.function_call_arguments.delta",
                with(&at, "delta", arguments.clone()),
            );
            events.push(
                "response.function_call_arguments.done",
                with(&at, "arguments", arguments),
            );
        }
        _ => {}
    }
    events.push(
        "response.output_item.done",
        json!({"output_index": index, "item": item}),
    );
}

/// `fields` with `key` set to `value`.
fn with(fields: &Value, key: &str, value: Value) -> Value {
    let mut out = fields.clone();
    if let Some(object) = out.as_object_mut() {
        object.insert(key.into(), value);
    }
    out
}

/// Events written as `event: <type>\ndata: <json>\n\n`, numbered in order.
#[derive(Default)]
struct Events {
    body: Vec<u8>,
    sequence: u64,
}

impl Events {
    fn push(&mut self, kind: &str, fields: Value) {
        let mut data = serde_json::Map::new();
        data.insert("type".into(), json!(kind));
        data.insert("sequence_number".into(), json!(self.sequence));
        if let Value::Object(fields) = fields {
            data.extend(fields);
        }
        self.sequence += 1;
        self.body.extend_from_slice(b"event: ");
        self.body.extend_from_slice(kind.as_bytes());
        self.body.extend_from_slice(b"\ndata: ");
        self.body
            .extend_from_slice(Value::Object(data).to_string().as_bytes());
        self.body.extend_from_slice(b"\n\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response() -> Value {
        json!({"id": "resp_1", "object": "response", "status": "completed", "model": "m",
            "output": [
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "Hello there.", "annotations": []}]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
                 "arguments": "{\"a\":1}", "status": "completed"}
            ],
            "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}})
    }

    #[test]
    fn only_stateless_requests_are_answered_from_the_cache() {
        let body = |v: Value| v.as_object().cloned().unwrap_or_default();
        assert!(cacheable(&body(json!({"store": false, "input": "x"}))));
        assert!(
            !cacheable(&body(json!({"input": "x"}))),
            "store defaults to true"
        );
        assert!(!cacheable(&body(
            json!({"store": false, "previous_response_id": "resp_1"})
        )));
        assert!(!cacheable(&body(
            json!({"store": false, "background": true})
        )));
        assert!(!cacheable(&body(
            json!({"store": false, "conversation": "conv_1"})
        )));
    }

    #[test]
    fn a_stored_response_echoes_the_user_of_the_request_it_answers() {
        let mut stored = response();
        stored["user"] = json!("first");
        echo_user(&mut stored, Some(&json!("second")));
        assert_eq!(stored["user"], "second");
        echo_user(&mut stored, None);
        assert_eq!(stored["user"], Value::Null);
        let mut without = response();
        echo_user(&mut without, Some(&json!("x")));
        assert!(without.get("user").is_none());
    }

    #[test]
    fn only_completed_responses_are_stored() {
        assert!(storable(response().to_string().as_bytes()).is_some());
        let mut cut = response();
        cut["status"] = json!("incomplete");
        assert!(storable(cut.to_string().as_bytes()).is_none());
        let completed = json!({"type": "response.completed", "response": response()}).to_string();
        assert!(matches!(seen(&completed), Seen::Completed(_)));
        assert!(matches!(
            seen(r#"{"type":"response.output_text.delta","delta":"x"}"#),
            Seen::Going
        ));
        assert!(matches!(
            seen(r#"{"type":"error","message":"x"}"#),
            Seen::Unstorable
        ));
    }

    #[test]
    fn a_stored_response_replays_as_numbered_events_that_rebuild_it() {
        let body = String::from_utf8(replay(&response())).unwrap_or_default();
        let events: Vec<Value> = body
            .split("\n\n")
            .filter_map(|e| e.split_once("data: "))
            .filter_map(|(_, data)| serde_json::from_str(data).ok())
            .collect();
        let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(kinds.first(), Some(&"response.created"));
        assert_eq!(kinds.last(), Some(&"response.completed"));
        for (n, event) in events.iter().enumerate() {
            assert_eq!(event["sequence_number"], json!(n));
        }
        let text: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .filter_map(|e| e["delta"].as_str())
            .collect();
        assert_eq!(text, "Hello there.");
        let arguments = events
            .iter()
            .find(|e| e["type"] == "response.function_call_arguments.done")
            .map(|e| e["arguments"].clone());
        assert_eq!(arguments, Some(json!("{\"a\":1}")));
        assert_eq!(
            events.last().map(|e| e["response"].clone()),
            Some(response())
        );
        let indexes: Vec<u64> = events
            .iter()
            .filter(|e| e["type"] == "response.output_item.done")
            .filter_map(|e| e["output_index"].as_u64())
            .collect();
        assert_eq!(indexes, [0, 1, 2]);
    }
}
