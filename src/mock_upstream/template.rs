//! How the mock's "chat template" treats a system message after the first one, as open models
//! served by vLLM, SGLang or llama.cpp do: read it in place (Llama 3.x, Hermes, Qwen3-Coder,
//! ChatML: the default), refuse the request with vLLM's 400 (Mistral, InternLM2), or drop it
//! silently (Phi-4-mini, OLMo 3, MiniMax-M1). Steered by `X-Mock-System-Messages` or
//! `mock-upstream --system-messages`. And how a provider in thinking mode treats an assistant
//! tool call that does not carry its reasoning back (`X-Mock-Thinking: 1`): refused, as
//! DeepSeek's and Kimi's APIs do.

use clap::ValueEnum;

use crate::openai::{ChatRequest, Role};

/// The error text vLLM answers when a template refuses a system message that is not first.
pub const REFUSAL: &str = "Only user and assistant roles are supported, with the exception of an initial optional system message!";

/// The error text a provider in thinking mode answers for an assistant tool call without its
/// reasoning (Kimi's words).
pub const REASONING_MISSING: &str =
    "thinking is enabled but reasoning_content is missing in assistant tool call message";

/// Whether an assistant message of `request` calls a tool without its `reasoning_content`.
pub fn lacks_reasoning(request: &ChatRequest) -> bool {
    request.messages.iter().any(|m| {
        m.role == Role::Assistant
            && !m.tool_calls().is_empty()
            && !m.extra.contains_key("reasoning_content")
    })
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum SystemMessages {
    #[default]
    InPlace,
    Reject,
    Drop,
}

impl SystemMessages {
    /// The mode a header names (`in_place`, `reject`, `drop`), else `default`.
    pub fn from_header(value: Option<&str>, default: SystemMessages) -> SystemMessages {
        match value.map(str::trim) {
            Some("in_place") => SystemMessages::InPlace,
            Some("reject") => SystemMessages::Reject,
            Some("drop") => SystemMessages::Drop,
            _ => default,
        }
    }

    /// The request as the model sees it: `Err` with the refusal when the template refuses it.
    pub fn render(self, mut request: ChatRequest) -> Result<ChatRequest, &'static str> {
        let later_system = |i: usize, role: &Role| i > 0 && *role == Role::System;
        let any_later = request
            .messages
            .iter()
            .enumerate()
            .any(|(i, m)| later_system(i, &m.role));
        match self {
            SystemMessages::InPlace => Ok(request),
            SystemMessages::Reject if any_later => Err(REFUSAL),
            SystemMessages::Reject => Ok(request),
            SystemMessages::Drop => {
                let mut index = 0;
                request.messages.retain(|m| {
                    let keep = !later_system(index, &m.role);
                    index += 1;
                    keep
                });
                Ok(request)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn request() -> ChatRequest {
        serde_json::from_value(json!({"model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Full definitions of tools …"},
        ]}))
        .unwrap()
    }

    #[test]
    fn templates_read_refuse_or_drop_a_later_system_message() {
        assert_eq!(
            SystemMessages::InPlace
                .render(request())
                .unwrap()
                .messages
                .len(),
            3
        );
        assert_eq!(
            SystemMessages::Reject.render(request()).unwrap_err(),
            REFUSAL
        );
        let dropped = SystemMessages::Drop.render(request()).unwrap();
        assert_eq!(dropped.messages.len(), 2);
        assert_eq!(dropped.messages[0].role, Role::System);
        // Only a first system message: every template takes it.
        let mut first_only = request();
        first_only.messages.pop();
        assert!(SystemMessages::Reject.render(first_only).is_ok());
    }

    #[test]
    fn a_tool_call_without_its_reasoning_is_told_apart() {
        let with = |call: serde_json::Value| -> ChatRequest {
            serde_json::from_value(json!({"model": "m", "messages": [
                {"role": "user", "content": "Hi"}, call,
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}))
            .unwrap()
        };
        let calls = json!([{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]);
        assert!(lacks_reasoning(&with(
            json!({"role": "assistant", "content": null, "tool_calls": calls})
        )));
        assert!(!lacks_reasoning(&with(
            json!({"role": "assistant", "content": null,
            "reasoning_content": "I should call f.", "tool_calls": calls})
        )));
        assert!(!lacks_reasoning(&request()));
    }
}
