//! What the mock model answers: a deterministic function of the request, so that tests and
//! caches can rely on the same request getting the same answer.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::openai::{ChatRequest, Content, Role};

/// The answer to one chat request, before it is shaped as JSON or as SSE chunks.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub id: String,
    pub created: i64,
    pub model: String,
    /// Text pieces ("tokens"), concatenated as the content. Empty for a tool-call answer.
    pub pieces: Vec<String>,
    pub tool_calls: Vec<MockToolCall>,
    pub prompt_tokens: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MockToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

impl Reply {
    pub fn content(&self) -> String {
        self.pieces.concat()
    }

    pub fn finish_reason(&self) -> &'static str {
        if self.tool_calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        }
    }

    pub fn completion_tokens(&self) -> u64 {
        let tool_tokens: usize = self
            .tool_calls
            .iter()
            .map(|c| 1 + c.arguments.len() / 4)
            .sum();
        (self.pieces.len() + tool_tokens) as u64
    }

    pub fn usage(&self) -> Value {
        let completion = self.completion_tokens();
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        })
    }
}

/// `tool_call`: `Some("auto")` calls the first declared tool, `Some(name)` calls that tool.
/// A last user message containing `[mock:tool_call]` acts like `Some("auto")`.
pub fn reply_for(request: &ChatRequest, body: &[u8], tool_call: Option<&str>) -> Reply {
    let digest = Sha256::digest(body);
    let id = format!("chatcmpl-mock-{}", hex::encode(&digest[..8]));
    let created = 1_700_000_000 + i64::from(u16::from_be_bytes([digest[8], digest[9]]));
    let prompt_tokens = request
        .messages
        .iter()
        .map(|m| 4 + m.content.get().map_or(0, |c| c.text().len() as u64 / 4))
        .sum::<u64>()
        + 3;

    let last = request.messages.last();
    let last_text = last
        .and_then(|m| m.content.get())
        .map(Content::text)
        .unwrap_or_default()
        .into_owned();
    let wants_tool = match tool_call {
        Some(name) => Some(name.to_owned()),
        None if last.is_some_and(|m| m.role == Role::User)
            && last_text.contains("[mock:tool_call]") =>
        {
            Some("auto".to_owned())
        }
        None => None,
    };
    let tools = request.tools.get().map(Vec::as_slice).unwrap_or(&[]);
    if let Some(wanted) = wants_tool {
        let declared = if wanted == "auto" {
            tools.iter().find_map(|t| t.function.as_ref())
        } else {
            tools
                .iter()
                .filter_map(|t| t.function.as_ref())
                .find(|f| f.name == wanted)
        };
        let name = declared.map_or(wanted.clone(), |f| f.name.clone());
        if name != "auto" {
            let arguments = declared
                .and_then(|f| f.parameters.get())
                .map_or_else(|| "{}".to_owned(), arguments_for_schema);
            return Reply {
                tool_calls: vec![MockToolCall {
                    id: format!("call_mock_{}", hex::encode(&digest[10..16])),
                    name,
                    arguments,
                }],
                pieces: Vec::new(),
                id,
                created,
                model: request.model.clone(),
                prompt_tokens,
            };
        }
    }

    let text = match last.map(|m| &m.role) {
        Some(Role::Tool) => format!(
            "Mock summary of the tool result: {}",
            snippet(&last_text, 80)
        ),
        _ => format!(
            "Mock answer to \"{}\" after {} messages.",
            snippet(&last_text, 80),
            request.messages.len()
        ),
    };
    Reply {
        pieces: split_pieces(&text),
        tool_calls: Vec::new(),
        id,
        created,
        model: request.model.clone(),
        prompt_tokens,
    }
}

/// Arguments that satisfy a JSON schema's required properties with placeholder values.
fn arguments_for_schema(schema: &Value) -> String {
    let mut arguments = serde_json::Map::new();
    let properties = schema.get("properties").and_then(Value::as_object);
    let required = schema.get("required").and_then(Value::as_array);
    if let (Some(properties), Some(required)) = (properties, required) {
        for name in required.iter().filter_map(Value::as_str) {
            let kind = properties
                .get(name)
                .and_then(|p| p.get("type"))
                .and_then(Value::as_str);
            let value = match kind {
                Some("integer" | "number") => json!(1),
                Some("boolean") => json!(true),
                Some("array") => json!([]),
                Some("object") => json!({}),
                _ => json!("mock"),
            };
            arguments.insert(name.to_owned(), value);
        }
    }
    Value::Object(arguments).to_string()
}

fn snippet(text: &str, max_chars: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(max_chars) {
        Some((i, _)) => format!("{}…", &flat[..i]),
        None => flat,
    }
}

/// Words with their leading space, like a tokenizer's pieces: "a b" → ["a", " b"].
fn split_pieces(text: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    for (i, word) in text.split(' ').enumerate() {
        pieces.push(if i == 0 {
            word.to_owned()
        } else {
            format!(" {word}")
        });
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: Value) -> (ChatRequest, Vec<u8>) {
        let body = serde_json::to_vec(&json).unwrap();
        (serde_json::from_slice(&body).unwrap(), body)
    }

    #[test]
    fn same_request_same_reply() {
        let (req, body) =
            request(json!({"model":"m","messages":[{"role":"user","content":"hello there"}]}));
        let a = reply_for(&req, &body, None);
        assert_eq!(a, reply_for(&req, &body, None));
        assert_eq!(
            a.content(),
            "Mock answer to \"hello there\" after 1 messages."
        );
        assert_eq!(a.finish_reason(), "stop");
    }

    #[test]
    fn tool_calls_on_demand_with_schema_arguments() {
        let (req, body) = request(json!({
            "model": "m",
            "messages": [{"role":"user","content":"weather? [mock:tool_call]"}],
            "tools": [{"type":"function","function":{"name":"get_weather","parameters":{
                "type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},
                "required":["city","days"]}}}]
        }));
        let reply = reply_for(&req, &body, None);
        assert_eq!(reply.tool_calls.len(), 1);
        assert_eq!(reply.tool_calls[0].name, "get_weather");
        assert_eq!(reply.tool_calls[0].arguments, r#"{"city":"mock","days":1}"#);
        assert_eq!(reply.finish_reason(), "tool_calls");
    }
}
