//! OpenAI wire types: lossless, so that every field a client or an upstream sends survives
//! parse → serialize, including fields this proxy does not know (DESIGN principle 2).
//!
//! Only the fields ctxproxy reads or rewrites are typed; everything else lives in `extra`.

mod error;
mod nullable;
mod request;
mod response;
pub mod sse;
mod stream;

pub use error::{ErrorBody, ErrorObject};
pub use nullable::Nullable;
pub use request::{
    ChatRequest, Content, ContentPart, FunctionCall, FunctionDefinition, Message, Role,
    StreamOptions, Tool, ToolCall,
};
pub use response::{ChatCompletion, Choice, Usage};
pub use stream::{ChatCompletionChunk, ChunkChoice, Delta, FunctionCallDelta, ToolCallDelta};

/// Unknown fields, kept in the order the sender wrote them.
pub type Extra = serde_json::Map<String, serde_json::Value>;
