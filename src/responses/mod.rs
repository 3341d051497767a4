//! The Responses API (`POST /v1/responses`) at the edge: a body is read as the pipeline's chat
//! model ([`to_chat`]), rewritten by the same stages as a chat request, and written back in its
//! own format ([`from_chat`]). Every item and field the pipeline does not own goes back byte for
//! byte: a message the rewrite kept is its original item(s), reasoning items stay right before the
//! item that followed them, and items ctxproxy does not know (hosted tool calls, `compaction`,
//! `item_reference`, …) travel with the message after them.

mod from_chat;
mod to_chat;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Map, Value};

pub use from_chat::{from_chat, write};
pub use to_chat::{Converted, to_chat};

use crate::error::ProxyError;

/// A Responses API body as the client sent it: an object, every field in its order.
pub type ResponsesBody = Map<String, Value>;

/// Whether a JSON body is a Responses API body (`input`, and no chat `messages`), as
/// `/v1/ctxproxy/explain` tells the two apart.
pub fn is_responses_body(bytes: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Shape {
        messages: Option<IgnoredAny>,
        input: Option<IgnoredAny>,
    }
    serde_json::from_slice::<Shape>(bytes)
        .is_ok_and(|shape| shape.input.is_some() && shape.messages.is_none())
}

/// Parses a Responses body: an object with a string `model` and an `input` (a string or a list
/// of items). Failures are OpenAI-format 400s naming the field.
pub fn parse(bytes: &[u8]) -> Result<ResponsesBody, ProxyError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| ProxyError::MalformedJson {
        message: e.to_string(),
        line: e.line(),
        column: e.column(),
    })?;
    let Value::Object(body) = value else {
        return Err(ProxyError::InvalidBody(
            "expected a JSON object with `model` and `input`".into(),
        ));
    };
    match body.get("model") {
        Some(Value::String(_)) => {}
        Some(_) => return Err(invalid("model", "expected a string")),
        None => {
            return Err(ProxyError::MissingField {
                field: "model".into(),
            });
        }
    }
    match body.get("input") {
        Some(Value::String(_) | Value::Array(_)) | None => {}
        Some(_) => return Err(invalid("input", "expected a string or an array of items")),
    }
    Ok(body)
}

/// The `model` of a parsed body.
pub fn model_of(body: &ResponsesBody) -> &str {
    body.get("model").and_then(Value::as_str).unwrap_or("")
}

/// Whether the history lives upstream (`previous_response_id` or `conversation`): only the new
/// input is seen.
pub fn is_chained(body: &ResponsesBody) -> bool {
    ["previous_response_id", "conversation"]
        .iter()
        .any(|key| body.get(*key).is_some_and(|v| !v.is_null()))
}

/// A Responses answer (a Response object) as a chat completion with the same function calls:
/// what the expansion of stub calls reads. `{"choices":[{"index":0,"message":{"role":
/// "assistant","tool_calls":[…]}}]}`, each `function_call` output item as a tool call.
pub fn answer_as_chat(response: &Value) -> Value {
    let calls: Vec<Value> = response
        .get("output")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|item| item.get("type").and_then(Value::as_str) == Some("function_call"))
        .map(|item| {
            serde_json::json!({
                "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {
                    "name": item.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": item.get("arguments").cloned().unwrap_or(Value::Null),
                },
            })
        })
        .collect();
    serde_json::json!({"choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": calls}}]})
}

/// Whether every reasoning item of `sent` is one of `client`'s, byte for byte, still followed
/// by the item that followed it there (the upstream refuses a reasoning item without it).
pub fn reasoning_in_place(client: &ResponsesBody, sent: &ResponsesBody) -> bool {
    let items = |body: &ResponsesBody| match body.get("input") {
        Some(Value::Array(items)) => items.clone(),
        _ => Vec::new(),
    };
    let (client, sent) = (items(client), items(sent));
    let is_reasoning = |item: &Value| item.get("type").and_then(Value::as_str) == Some("reasoning");
    let followers: Vec<(&Value, Option<&Value>)> = client
        .iter()
        .enumerate()
        .filter(|(_, item)| is_reasoning(item))
        .map(|(k, item)| (item, client.get(k + 1)))
        .collect();
    sent.iter()
        .enumerate()
        .filter(|(_, item)| is_reasoning(item))
        .all(|(k, item)| {
            followers
                .iter()
                .any(|(reasoning, after)| *reasoning == item && *after == sent.get(k + 1))
        })
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ProxyError {
    ProxyError::InvalidField {
        field: field.into(),
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_responses_body_is_told_from_a_chat_body() {
        assert!(is_responses_body(br#"{"model":"m","input":"hi"}"#));
        assert!(!is_responses_body(br#"{"model":"m","messages":[]}"#));
        assert!(!is_responses_body(
            br#"{"model":"m","messages":[],"input":"x"}"#
        ));
        assert!(!is_responses_body(b"not json"));
    }

    #[test]
    fn bad_bodies_get_errors_naming_the_field() {
        let error = |body: &str| parse(body.as_bytes()).err().map(|e| e.to_string());
        assert!(error(r#"{"input":"x"}"#).is_some_and(|e| e.contains("'model'")));
        assert!(error(r#"{"model":1,"input":"x"}"#).is_some_and(|e| e.contains("'model'")));
        assert!(error(r#"{"model":"m","input":3}"#).is_some_and(|e| e.contains("'input'")));
        assert!(error("[1]").is_some_and(|e| e.contains("JSON object")));
        assert!(error("{").is_some_and(|e| e.contains("parse")));
        assert!(parse(br#"{"model":"m","input":[]}"#).is_ok());
    }
}
