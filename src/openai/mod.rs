//! OpenAI wire types: lossless, so that every field a client or an upstream sends survives
//! parse → serialize, including fields this proxy does not know (ARCHITECTURE.md, principle 2).
//!
//! Only the fields ctxproxy reads or rewrites are typed; everything else lives in `extra`.

mod error;
mod nullable;
mod request;
mod response;
mod schema;
mod shared_text;
pub mod sse;
mod stream;
mod with_extra;

pub use error::{ErrorBody, ErrorObject};
pub use nullable::Nullable;
pub use request::{
    ChatRequest, Content, ContentPart, FunctionCall, FunctionDefinition, Message, Role,
    StreamOptions, Tool, ToolBlocks, ToolCall,
};
pub use response::{ChatCompletion, Choice, Usage};
pub use schema::{Schema, hash_json};
pub use shared_text::SharedText;
pub use stream::{ChatCompletionChunk, ChunkChoice, Delta, FunctionCallDelta, ToolCallDelta};

/// Which OpenAI API a request or an answer speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    #[default]
    Chat,
    /// `/v1/responses`.
    Responses,
}

/// Unknown fields, kept in the order the sender wrote them.
pub type Extra = serde_json::Map<String, serde_json::Value>;

/// A serialized JSON object with `field` (`"key":value`) added as its first member, without
/// parsing it again; `None` when `body` is not an object. The caller knows `key` is absent.
pub fn with_first_field(body: &[u8], field: &[u8]) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let empty = body[open + 1..]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'}');
    let mut out = Vec::with_capacity(body.len() + field.len() + 1);
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(field);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(&body[open + 1..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_first_field_is_inserted_into_any_object() {
        let with = |body: &str| {
            super::with_first_field(body.as_bytes(), br#""k":1"#)
                .map(|b| String::from_utf8(b).unwrap())
        };
        assert_eq!(with(r#" {"a":2}"#).as_deref(), Some(r#" {"k":1,"a":2}"#));
        assert_eq!(with("{ }").as_deref(), Some(r#"{"k":1 }"#));
        assert_eq!(with("[1]"), None);
        assert_eq!(with(""), None);
    }
}
