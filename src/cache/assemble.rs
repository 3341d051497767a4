//! Streams and stored answers: a streamed answer is assembled into one completion (what the
//! cache stores), and a stored completion is replayed as a stream with the chunk structure of
//! an upstream stream (role, content, tool calls, finish reason, usage when asked).

use crate::openai::sse::all_finished;

use crate::openai::{
    ChatCompletion, ChatCompletionChunk, Choice, ChunkChoice, Content, Delta, Extra, FunctionCall,
    FunctionCallDelta, Message, Nullable, Role, ToolCall, ToolCallDelta, Usage,
};

#[derive(Default)]
struct ChoiceParts {
    role: Option<Role>,
    content: Option<String>,
    /// index → (id, type, name, arguments)
    tool_calls: Indexed<(String, Option<String>, String, String)>,
    finish_reason: Option<String>,
}

/// Accumulates the chunks of one streamed answer.
#[derive(Default)]
pub struct StreamAssembler {
    head: Option<(String, i64, String, Extra)>,
    choices: Indexed<ChoiceParts>,
    usage: Option<Usage>,
}

/// Parts by their `index`, in the order first seen: a stream has one choice or a few, and a
/// vector of them is a fraction of a map's node, which every stream in flight holds.
struct Indexed<T>(Vec<(u32, T)>);

impl<T> Default for Indexed<T> {
    fn default() -> Self {
        Indexed(Vec::new())
    }
}

impl<T: Default> Indexed<T> {
    fn entry(&mut self, index: u32) -> &mut T {
        let at = match self.0.iter().position(|(i, _)| *i == index) {
            Some(at) => at,
            None => {
                self.0.push((index, T::default()));
                self.0.len() - 1
            }
        };
        &mut self.0[at].1
    }
}

impl<T> Indexed<T> {
    fn values(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|(_, value)| value)
    }

    /// By index, as a map would give them.
    fn into_sorted(mut self) -> impl Iterator<Item = (u32, T)> {
        self.0.sort_by_key(|(index, _)| *index);
        self.0.into_iter()
    }
}

impl StreamAssembler {
    pub fn push(&mut self, chunk: ChatCompletionChunk) {
        if self.head.is_none() {
            self.head = Some((chunk.id, chunk.created, chunk.model, chunk.extra));
        }
        if let Nullable::Value(usage) = chunk.usage {
            self.usage = Some(usage);
        }
        for choice in chunk.choices {
            let parts = self.choices.entry(choice.index);
            let delta = choice.delta;
            if let Some(role) = delta.role {
                parts.role = Some(role);
            }
            if let Nullable::Value(text) = delta.content {
                parts
                    .content
                    .get_or_insert_with(String::new)
                    .push_str(&text);
            }
            for call in delta.tool_calls.get().into_iter().flatten() {
                let entry = parts.tool_calls.entry(call.index);
                if let Some(id) = &call.id {
                    entry.0.clone_from(id);
                }
                if call.kind.is_some() {
                    entry.1.clone_from(&call.kind);
                }
                if let Some(function) = &call.function {
                    if let Some(name) = &function.name {
                        entry.2.push_str(name);
                    }
                    if let Some(arguments) = &function.arguments {
                        entry.3.push_str(arguments);
                    }
                }
            }
            if let Nullable::Value(reason) = choice.finish_reason {
                parts.finish_reason = Some(reason);
            }
        }
    }

    /// The completion, when every choice finished (a cut stream has no finish reason).
    pub fn finish(self) -> Option<ChatCompletion> {
        let (id, created, model, extra) = self.head?;
        if !all_finished(self.choices.values().map(|c| c.finish_reason.is_some())) {
            return None;
        }
        let choices = self
            .choices
            .into_sorted()
            .map(|(index, parts)| {
                let tool_calls: Vec<ToolCall> = parts
                    .tool_calls
                    .into_sorted()
                    .map(|(_, (id, kind, name, arguments))| ToolCall {
                        id,
                        kind,
                        function: FunctionCall {
                            name,
                            arguments,
                            extra: Extra::new(),
                        },
                        extra: Extra::new(),
                    })
                    .collect();
                let mut message = Message::text(parts.role.unwrap_or(Role::Assistant), "");
                message.content = match parts.content {
                    Some(text) => Nullable::Value(Content::Text(text.into())),
                    None => Nullable::Null,
                };
                if !tool_calls.is_empty() {
                    message.tool_calls = Nullable::Value(tool_calls.into());
                }
                Choice {
                    index,
                    message,
                    finish_reason: parts.finish_reason.map_or(Nullable::Null, Nullable::Value),
                    extra: Extra::new(),
                }
            })
            .collect();
        Some(ChatCompletion {
            id,
            object: "chat.completion".into(),
            created,
            model,
            choices,
            usage: self.usage.map_or(Nullable::Absent, Nullable::Value),
            extra,
        })
    }
}

fn chunk(completion: &ChatCompletion, choices: Vec<ChunkChoice>) -> ChatCompletionChunk {
    ChatCompletionChunk {
        id: completion.id.clone(),
        object: "chat.completion.chunk".into(),
        created: completion.created,
        model: completion.model.clone(),
        choices,
        usage: Nullable::Absent,
        extra: completion.extra.clone(),
    }
}

fn delta_choice(index: u32, delta: Delta, finish_reason: Nullable<String>) -> ChunkChoice {
    ChunkChoice {
        index,
        delta,
        finish_reason,
        extra: Extra::new(),
    }
}

/// The chunks of a stream that delivers `completion`: per choice, the role (with empty
/// content), the content, one chunk per tool call, then the finish reason; with
/// `include_usage`, a last chunk with no choices and the usage.
pub fn replay(completion: &ChatCompletion, include_usage: bool) -> Vec<ChatCompletionChunk> {
    let mut chunks = Vec::new();
    for choice in &completion.choices {
        let message = &choice.message;
        let text = message.content.get().map(|c| c.text().into_owned());
        chunks.push(chunk(
            completion,
            vec![delta_choice(
                choice.index,
                Delta {
                    role: Some(message.role.clone()),
                    content: Nullable::Value(String::new()),
                    ..Delta::default()
                },
                Nullable::Null,
            )],
        ));
        if let Some(text) = text.filter(|t| !t.is_empty()) {
            chunks.push(chunk(
                completion,
                vec![delta_choice(
                    choice.index,
                    Delta {
                        content: Nullable::Value(text),
                        ..Delta::default()
                    },
                    Nullable::Null,
                )],
            ));
        }
        for (i, call) in message.tool_calls().iter().enumerate() {
            let delta = ToolCallDelta {
                index: i as u32,
                id: Some(call.id.clone()),
                kind: Some(call.kind.clone().unwrap_or_else(|| "function".into())),
                function: Some(FunctionCallDelta {
                    name: Some(call.function.name.clone()),
                    arguments: Some(call.function.arguments.clone()),
                    extra: Extra::new(),
                }),
                extra: Extra::new(),
            };
            chunks.push(chunk(
                completion,
                vec![delta_choice(
                    choice.index,
                    Delta {
                        tool_calls: Nullable::Value(vec![delta]),
                        ..Delta::default()
                    },
                    Nullable::Null,
                )],
            ));
        }
        chunks.push(chunk(
            completion,
            vec![delta_choice(
                choice.index,
                Delta::default(),
                choice.finish_reason.clone(),
            )],
        ));
    }
    if include_usage && let Nullable::Value(usage) = &completion.usage {
        let mut last = chunk(completion, Vec::new());
        last.usage = Nullable::Value(usage.clone());
        chunks.push(last);
    }
    chunks
}

/// The SSE body of `chunks`, ending with `data: [DONE]`.
pub fn sse_body(chunks: &[ChatCompletionChunk]) -> Vec<u8> {
    let mut body = Vec::new();
    for chunk in chunks {
        body.extend_from_slice(b"data: ");
        if let Ok(json) = serde_json::to_vec(chunk) {
            body.extend_from_slice(&json);
        }
        body.extend_from_slice(b"\n\n");
    }
    body.extend_from_slice(b"data: [DONE]\n\n");
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn completion() -> ChatCompletion {
        serde_json::from_value(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "gpt-4o",
            "system_fingerprint": "fp_1",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "Checking both.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
                    {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Lima\"}"}}
                ]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        }))
        .unwrap()
    }

    #[test]
    fn replayed_streams_assemble_back_into_the_completion() {
        let original = completion();
        let chunks = replay(&original, true);
        assert!(chunks.last().unwrap().choices.is_empty());
        let mut assembler = StreamAssembler::default();
        for chunk in chunks {
            assembler.push(chunk);
        }
        assert_eq!(assembler.finish().unwrap(), original);
        let without_usage = replay(&original, false);
        assert!(without_usage.iter().all(|c| c.usage.is_absent()));
        let body = String::from_utf8(sse_body(&without_usage)).unwrap();
        assert!(body.ends_with("data: [DONE]\n\n") && body.starts_with("data: {"));
    }

    #[test]
    fn choices_and_calls_streamed_out_of_order_assemble_by_index() {
        let chunk = |value: serde_json::Value| -> ChatCompletionChunk {
            let mut base = json!({"id": "chatcmpl-2", "object": "chat.completion.chunk",
                "created": 8, "model": "gpt-4o"});
            base.as_object_mut()
                .unwrap()
                .extend(value.as_object().unwrap().clone());
            serde_json::from_value(base).unwrap()
        };
        let call = |index: u32, id: &str, arguments: &str| {
            json!({"index": index, "id": id, "type": "function",
                "function": {"name": "weather", "arguments": arguments}})
        };
        let mut assembler = StreamAssembler::default();
        for value in [
            json!({"choices": [{"index": 1, "delta": {"role": "assistant", "content": "B"}}]}),
            json!({"choices": [{"index": 0, "delta": {"role": "assistant",
                "tool_calls": [call(1, "c2", "{\"city\":"), call(0, "c1", "{}")]}}]}),
            json!({"choices": [{"index": 1, "delta": {"content": "b"}, "finish_reason": "stop"},
                {"index": 0, "delta": {"tool_calls": [{"index": 1,
                    "function": {"arguments": "\"Lima\"}"}}]},
                 "finish_reason": "tool_calls"}]}),
        ] {
            assembler.push(chunk(value));
        }
        let completion = serde_json::to_value(assembler.finish().unwrap()).unwrap();
        assert_eq!(completion["choices"][0]["index"], 0);
        let calls = &completion["choices"][0]["message"]["tool_calls"];
        assert_eq!(calls[0]["id"], "c1");
        assert_eq!(calls[1]["id"], "c2");
        assert_eq!(calls[1]["function"]["arguments"], "{\"city\":\"Lima\"}");
        assert_eq!(completion["choices"][1]["index"], 1);
        assert_eq!(completion["choices"][1]["message"]["content"], "Bb");
    }

    #[test]
    fn a_cut_stream_does_not_assemble() {
        let mut chunks = replay(&completion(), false);
        chunks.pop();
        let mut assembler = StreamAssembler::default();
        for chunk in chunks {
            assembler.push(chunk);
        }
        assert!(assembler.finish().is_none());
    }
}
