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
    /// Prompt tokens a provider's prompt cache would serve (`prompt_tokens_details`).
    pub cached_tokens: u64,
    /// Cut at the request's `max_tokens` (`finish_reason: "length"`).
    pub truncated: bool,
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
        if !self.tool_calls.is_empty() {
            "tool_calls"
        } else if self.truncated {
            "length"
        } else {
            "stop"
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
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// `tool_call`: `Some("auto")` calls the first declared tool, `Some(name)` calls that tool.
/// A last user message containing `[mock:tool_call]` acts like `Some("auto")`.
pub fn reply_for(request: &ChatRequest, body: &[u8], tool_call: Option<&str>) -> Reply {
    let digest = Sha256::digest(body);
    let id = format!("chatcmpl-mock-{}", hex::encode(&digest[..8]));
    let created = 1_700_000_000 + i64::from(u16::from_be_bytes([digest[8], digest[9]]));
    // About 4 bytes a token, as a provider bills: each message's text and each tool definition.
    let tool_tokens = request.tools.get().map_or(0, |tools| {
        tools
            .iter()
            .map(|t| serde_json::to_vec(t).map_or(0, |json| json.len() as u64 / 4))
            .sum::<u64>()
    });
    let prompt_tokens = request
        .messages
        .iter()
        .map(|m| 4 + m.content.get().map_or(0, |c| c.text().len() as u64 / 4))
        .sum::<u64>()
        + tool_tokens
        + 3;

    let last = request.messages.last();
    let last_text = last
        .and_then(|m| m.content.get())
        .map(Content::text)
        .unwrap_or_default()
        .into_owned();
    let wants_tool = match tool_call {
        Some(name) => Some(name.to_owned()),
        None if last.is_some_and(|m| matches!(m.role, Role::User | Role::System))
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
            // A full definition in the messages (what ctxproxy places there for a tool it
            // sends as a stub) is what a model reads the parameters from.
            let defined = crate::pipeline::tools::inline::definitions_in(&request.messages)
                .into_iter()
                .find(|f| f["name"] == name.as_str())
                .map(|f| f["parameters"].clone());
            let arguments = defined
                .as_ref()
                .or_else(|| declared.and_then(|f| f.parameters.get().map(|p| p.value())))
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
                cached_tokens: 0,
                truncated: false,
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
        cached_tokens: 0,
        truncated: false,
    }
}

/// A text answer replaced by `text` (`X-Mock-Reply`). When the request continues a cut answer
/// (an assistant message that starts `text`, then a user or system message), the answer is the
/// rest of `text`, repeating the last `overlap` characters said (`X-Mock-Overlap`).
/// `X-Mock-Recall: first|<handle>`: a call of `ctxproxy_recall` with that handle (`first`: the
/// first `rc-…` the messages name), when the request offers the tool and its last message is
/// not a tool result (the recalled original is answered as any tool result is).
pub fn recalling(reply: Reply, request: &ChatRequest, wanted: &str) -> Reply {
    use crate::pipeline::recall;
    let offered = request
        .tools
        .get()
        .is_some_and(|tools| recall::offered(tools));
    let answered = request
        .messages
        .last()
        .is_some_and(|m| matches!(m.role, Role::Tool));
    if !offered || answered {
        return reply;
    }
    let handle = if wanted == "first" {
        let Some(handle) = request
            .messages
            .iter()
            .filter_map(|m| m.content.get().map(Content::text))
            .find_map(|text| recall::handles_in(&text).next().map(str::to_owned))
        else {
            return reply;
        };
        handle
    } else {
        wanted.to_owned()
    };
    let id = format!(
        "call_recall_{}",
        &reply.id[reply.id.len().saturating_sub(8)..]
    );
    Reply {
        pieces: Vec::new(),
        tool_calls: vec![MockToolCall {
            id,
            name: recall::TOOL_NAME.to_owned(),
            arguments: json!({ "handle": handle }).to_string(),
        }],
        ..reply
    }
}

/// A tool-call reply that says `text` before its calls (a text answer is left as it is).
pub fn with_preamble(mut reply: Reply, text: &str) -> Reply {
    if !reply.tool_calls.is_empty() {
        reply.pieces = split_pieces(text);
    }
    reply
}

pub fn scripted(mut reply: Reply, request: &ChatRequest, text: &str, overlap: usize) -> Reply {
    if !reply.tool_calls.is_empty() {
        return reply;
    }
    let said = match request.messages.as_slice() {
        [.., assistant, next]
            if assistant.role == Role::Assistant
                && matches!(next.role, Role::User | Role::System) =>
        {
            assistant.content.get().map(|c| c.text().into_owned())
        }
        _ => None,
    };
    let rest = match said.filter(|s| !s.is_empty() && text.starts_with(s.as_str())) {
        Some(said) => {
            let start = said
                .char_indices()
                .rev()
                .nth(overlap.saturating_sub(1))
                .map_or(0, |(i, _)| i);
            let repeated = if overlap == 0 { "" } else { &said[start..] };
            format!("{repeated}{}", &text[said.len()..])
        }
        None => text.to_owned(),
    };
    reply.pieces = split_pieces(&rest)
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect();
    reply
}

/// The reply cut to the request's `max_completion_tokens` / `max_tokens` (one piece, one token).
pub fn limited(mut reply: Reply, request: &ChatRequest) -> Reply {
    let limit = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|key| request.extra.get(*key).and_then(Value::as_u64));
    if let Some(limit) = limit
        && reply.tool_calls.is_empty()
        && reply.pieces.len() as u64 > limit
    {
        reply.pieces.truncate(limit as usize);
        reply.truncated = true;
    }
    reply
}

/// Arguments that satisfy a JSON schema's required properties with placeholder values (the
/// first value of an `enum`).
fn arguments_for_schema(schema: &Value) -> String {
    let mut arguments = serde_json::Map::new();
    let properties = schema.get("properties").and_then(Value::as_object);
    let required = schema.get("required").and_then(Value::as_array);
    if let (Some(properties), Some(required)) = (properties, required) {
        for name in required.iter().filter_map(Value::as_str) {
            let property = properties.get(name);
            // A value the schema names (`enum`, `const`), as a model that read it picks.
            let named = property.and_then(|p| p.get("const").or_else(|| p.get("enum")?.get(0)));
            if let Some(value) = named {
                arguments.insert(name.to_owned(), value.clone());
                continue;
            }
            let kind = property.and_then(|p| p.get("type")).and_then(Value::as_str);
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
/// The largest `X-Mock-Reply-Repeat`.
const MAX_REPEAT: usize = 1_000_000;

/// `reply`'s text said `times` times (at most a million), one piece each.
pub fn repeated(mut reply: Reply, times: usize) -> Reply {
    let text = reply.pieces.concat();
    reply.pieces = vec![text; times.clamp(1, MAX_REPEAT)];
    reply
}

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

    #[test]
    fn a_repeated_reply_says_its_text_n_times() {
        let reply = Reply {
            pieces: split_pieces("two words"),
            tool_calls: Vec::new(),
            id: "id".into(),
            created: 0,
            model: "m".into(),
            prompt_tokens: 1,
            cached_tokens: 0,
            truncated: false,
        };
        assert_eq!(repeated(reply, 3).pieces, vec!["two words"; 3]);
    }

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
                "type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"},
                "unit":{"type":"string","enum":["c","f"]}},
                "required":["city","days","unit"]}}}]
        }));
        let reply = reply_for(&req, &body, None);
        assert_eq!(reply.tool_calls.len(), 1);
        assert_eq!(reply.tool_calls[0].name, "get_weather");
        assert_eq!(
            reply.tool_calls[0].arguments,
            r#"{"city":"mock","days":1,"unit":"c"}"#
        );
        assert_eq!(reply.finish_reason(), "tool_calls");
    }

    #[test]
    fn scripted_answers_are_cut_at_max_tokens_and_continued() {
        let text = "one two three four five six seven";
        let (req, body) = request(json!({"model":"m","max_tokens":3,
            "messages":[{"role":"user","content":"count"}]}));
        let first = limited(scripted(reply_for(&req, &body, None), &req, text, 0), &req);
        assert_eq!(
            (first.content().as_str(), first.finish_reason()),
            ("one two three", "length")
        );
        let (req, body) = request(json!({"model":"m","max_tokens":3, "messages":[
            {"role":"user","content":"count"},
            {"role":"assistant","content":"one two three"},
            {"role":"user","content":"continue"}]}));
        let next = limited(scripted(reply_for(&req, &body, None), &req, text, 5), &req);
        // The last 5 characters said are repeated, then the rest, cut again.
        assert_eq!(
            (next.content().as_str(), next.finish_reason()),
            ("three four five", "length")
        );
        let (req, body) = request(json!({"model":"m", "messages":[
            {"role":"user","content":"count"},
            {"role":"assistant","content":"one two three four five"},
            {"role":"user","content":"continue"}]}));
        let last = scripted(reply_for(&req, &body, None), &req, text, 0);
        assert_eq!(
            (last.content().as_str(), last.finish_reason()),
            (" six seven", "stop")
        );
    }
}
