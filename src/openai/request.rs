//! `POST /v1/chat/completions` request body.

use std::fmt;
use std::sync::Arc;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;
use serde_json::value::RawValue;

use super::with_extra::{self, deserialize_with_extra};
use super::{Extra, Nullable, Schema, SharedText};
use crate::error::ProxyError;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub stream: Nullable<bool>,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub stream_options: Nullable<StreamOptions>,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub tools: Nullable<Vec<Tool>>,
    /// `"none" | "auto" | "required" | {"type":"function","function":{"name":…}}`.
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub tool_choice: Nullable<Value>,
    /// Legacy function calling.
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub functions: Nullable<Vec<FunctionDefinition>>,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub function_call: Nullable<Value>,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub response_format: Nullable<Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl ChatRequest {
    /// Parses a request body; failures become a 400 naming the line and column (malformed JSON)
    /// or the field (wrong type, missing field).
    pub fn parse(bytes: &[u8]) -> Result<ChatRequest, ProxyError> {
        // Fast path without path tracking; on failure, parse again to name the field.
        if let Ok(chat) = serde_json::from_slice::<ChatRequest>(bytes) {
            return Ok(chat);
        }
        Self::parse_naming_the_field(bytes)
    }

    /// [`ChatRequest::parse`], with the tool block read through `blocks`: an application sends
    /// the same block, byte for byte, on every request, and reading its schemas is most of
    /// reading a request.
    pub fn parse_with(bytes: &[u8], blocks: &dyn ToolBlocks) -> Result<ChatRequest, ProxyError> {
        let mut deserializer = serde_json::Deserializer::from_slice(bytes);
        let fast = Fields {
            blocks: Some(blocks),
        }
        .deserialize(&mut deserializer)
        .and_then(|chat| deserializer.end().map(|()| chat));
        match fast {
            Ok(chat) => Ok(chat),
            Err(_) => Self::parse_naming_the_field(bytes),
        }
    }

    fn parse_naming_the_field(bytes: &[u8]) -> Result<ChatRequest, ProxyError> {
        let mut deserializer = serde_json::Deserializer::from_slice(bytes);
        let chat: ChatRequest =
            serde_path_to_error::deserialize(&mut deserializer).map_err(ProxyError::from_json)?;
        deserializer.end().map_err(|e| ProxyError::MalformedJson {
            message: "trailing characters after the JSON body".into(),
            line: e.line(),
            column: e.column(),
        })?;
        Ok(chat)
    }

    /// The names of the function tools offered, in order.
    pub fn tool_names(&self) -> Vec<&str> {
        self.tools
            .get()
            .into_iter()
            .flatten()
            .filter_map(|t| t.function.as_ref().map(|f| f.name.as_str()))
            .collect()
    }

    /// The text of the last user message ("" when there is none).
    pub fn last_user_text(&self) -> String {
        self.messages
            .iter()
            .rev()
            .find(|m| m.role == Role::User)
            .and_then(|m| m.content.get())
            .map(|c| c.text().into_owned())
            .unwrap_or_default()
    }

    pub fn is_stream(&self) -> bool {
        self.stream.get().copied().unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .get()
            .and_then(|o| o.include_usage.get().copied())
            .unwrap_or(false)
    }
}

/// Where a request's tool block is read from when it was read before: blocks kept by their JSON
/// text (the `tools` array exactly as the client wrote it).
pub trait ToolBlocks {
    /// The tools of `json`, a JSON array.
    fn tools(&self, json: &str) -> Result<Vec<Tool>, serde_json::Error>;
}

impl<'de> Deserialize<'de> for ChatRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Fields { blocks: None }.deserialize(deserializer)
    }
}

/// Reads a [`ChatRequest`] as `with_extra` reads the other types; with `blocks`, its `tools`
/// through them (the input must then be a `serde_json` slice: the block is borrowed raw).
struct Fields<'b> {
    blocks: Option<&'b dyn ToolBlocks>,
}

impl<'de> DeserializeSeed<'de> for Fields<'_> {
    type Value = ChatRequest;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<ChatRequest, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Fields<'_> {
    type Value = ChatRequest;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("struct ChatRequest")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ChatRequest, A::Error> {
        fn once<'de, A: MapAccess<'de>, T: Deserialize<'de>>(
            field: &mut Option<T>,
            key: &'static str,
            map: &mut A,
        ) -> Result<(), A::Error> {
            if field.is_some() {
                return Err(de::Error::duplicate_field(key));
            }
            *field = Some(map.next_value()?);
            Ok(())
        }
        let (mut model, mut messages, mut stream, mut stream_options) = (None, None, None, None);
        let (mut tools, mut tool_choice, mut functions) = (None, None, None);
        let (mut function_call, mut response_format) = (None, None);
        let mut extra = Extra::new();
        while let Some(key) = map.next_key_seed(with_extra::Key)? {
            match &*key {
                "model" => once(&mut model, "model", &mut map)?,
                "messages" => once(&mut messages, "messages", &mut map)?,
                "stream" => once(&mut stream, "stream", &mut map)?,
                "stream_options" => once(&mut stream_options, "stream_options", &mut map)?,
                "tools" => match self.blocks {
                    None => once(&mut tools, "tools", &mut map)?,
                    Some(blocks) => {
                        if tools.is_some() {
                            return Err(de::Error::duplicate_field("tools"));
                        }
                        let raw: &'de RawValue = map.next_value()?;
                        tools = Some(match raw.get() {
                            "null" => Nullable::Null,
                            json => Nullable::Value(blocks.tools(json).map_err(de::Error::custom)?),
                        });
                    }
                },
                "tool_choice" => once(&mut tool_choice, "tool_choice", &mut map)?,
                "functions" => once(&mut functions, "functions", &mut map)?,
                "function_call" => once(&mut function_call, "function_call", &mut map)?,
                "response_format" => once(&mut response_format, "response_format", &mut map)?,
                _ => {
                    let value = map.next_value()?;
                    extra.insert(key.into_owned(), value);
                }
            }
        }
        Ok(ChatRequest {
            model: model.ok_or_else(|| de::Error::missing_field("model"))?,
            messages: messages.ok_or_else(|| de::Error::missing_field("messages"))?,
            stream: stream.unwrap_or_default(),
            stream_options: stream_options.unwrap_or_default(),
            tools: tools.unwrap_or_default(),
            tool_choice: tool_choice.unwrap_or_default(),
            functions: functions.unwrap_or_default(),
            function_call: function_call.unwrap_or_default(),
            response_format: response_format.unwrap_or_default(),
            extra,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamOptions {
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub include_usage: Nullable<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, PartialEq, Serialize)]
pub struct Message {
    pub role: Role,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub content: Nullable<Content>,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub name: Nullable<String>,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    /// Shared: a copy of the message (every stage and point makes some) copies no call.
    pub tool_calls: Nullable<Arc<Vec<ToolCall>>>,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    /// Shared and digested once, as a text: a message is copied and keyed at every stage.
    pub tool_call_id: Nullable<SharedText>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Message {
    /// A message with only a role and text content.
    pub fn text(role: Role, text: impl Into<String>) -> Self {
        Message {
            role,
            content: Nullable::Value(Content::Text(SharedText::from(text.into()))),
            name: Nullable::Absent,
            tool_calls: Nullable::Absent,
            tool_call_id: Nullable::Absent,
            extra: Extra::new(),
        }
    }

    /// The text of the content: the string, or its text parts joined ("" without content).
    pub fn content_text(&self) -> String {
        self.content
            .get()
            .map(|c| c.text().into_owned())
            .unwrap_or_default()
    }

    /// The tool calls of an assistant message; empty for every other message.
    pub fn tool_calls(&self) -> &[ToolCall] {
        self.tool_calls.get().map_or(&[], |calls| calls.as_slice())
    }
}

/// A message role. Unknown roles are kept as they were written.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
    Function,
    Other(String),
}

impl Role {
    pub fn as_str(&self) -> &str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
            Role::Function => "function",
            Role::Other(other) => other,
        }
    }
}

impl From<&str> for Role {
    fn from(value: &str) -> Self {
        match value {
            "system" => Role::System,
            "developer" => Role::Developer,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            "function" => Role::Function,
            other => Role::Other(other.to_owned()),
        }
    }
}

impl Serialize for Role {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Role {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RoleVisitor;
        impl Visitor<'_> for RoleVisitor {
            type Value = Role;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a role string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Role, E> {
                Ok(Role::from(v))
            }
        }
        deserializer.deserialize_str(RoleVisitor)
    }
}

/// Message content: a plain string or an array of typed parts.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    Text(SharedText),
    Parts(Vec<ContentPart>),
}

impl Content {
    /// The text of the content: the string, or the `text` of every text part joined by newlines.
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Content::Text(text) => std::borrow::Cow::Borrowed(text.as_str()),
            Content::Parts(parts) => {
                let texts: Vec<&str> = parts
                    .iter()
                    .filter_map(|p| p.text.get())
                    .map(String::as_str)
                    .collect();
                std::borrow::Cow::Owned(texts.join("\n"))
            }
        }
    }
}

impl Serialize for Content {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Content::Text(text) => serializer.serialize_str(text),
            Content::Parts(parts) => parts.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor;
        impl<'de> Visitor<'de> for ContentVisitor {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Content, E> {
                Ok(Content::Text(v.into()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Content, E> {
                Ok(Content::Text(v.into()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
                let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(1));
                while let Some(part) = seq.next_element()? {
                    parts.push(part);
                }
                Ok(Content::Parts(parts))
            }
        }
        deserializer.deserialize_any(ContentVisitor)
    }
}

/// One part of an array content: `{"type":"text","text":…}`, `{"type":"image_url",…}`, ….
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub text: Nullable<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCall,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text, as the model wrote it (not necessarily valid JSON).
    pub arguments: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A tool definition. Non-function tool types keep their whole body in `extra`.
#[derive(Debug, PartialEq, Serialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<FunctionDefinition>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, PartialEq, Serialize)]
pub struct FunctionDefinition {
    pub name: String,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub description: Nullable<SharedText>,
    /// JSON Schema of the arguments, shared: a request's tools are copied per stage and per
    /// point of its history, and a schema is the deepest part of them.
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub parameters: Nullable<Arc<Schema>>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A copy of `extra`: an empty map made anew (copying one costs about a hundred instructions,
/// and a request's messages and tools, nearly always without unknown fields, are copied at every
/// stage and point).
fn copy_extra(extra: &Extra) -> Extra {
    if extra.is_empty() {
        Extra::new()
    } else {
        extra.clone()
    }
}

impl Clone for Message {
    fn clone(&self) -> Self {
        Message {
            role: self.role.clone(),
            content: self.content.clone(),
            name: self.name.clone(),
            tool_calls: self.tool_calls.clone(),
            tool_call_id: self.tool_call_id.clone(),
            extra: copy_extra(&self.extra),
        }
    }
}

impl Clone for Tool {
    fn clone(&self) -> Self {
        Tool {
            kind: self.kind.clone(),
            function: self.function.clone(),
            extra: copy_extra(&self.extra),
        }
    }
}

impl Clone for FunctionDefinition {
    fn clone(&self) -> Self {
        FunctionDefinition {
            name: self.name.clone(),
            description: self.description.clone(),
            parameters: self.parameters.clone(),
            extra: copy_extra(&self.extra),
        }
    }
}

deserialize_with_extra!(
    StreamOptions,
    required {},
    optional {
        include_usage: "include_usage"
    },
);
deserialize_with_extra!(
    Message,
    required { role: "role" },
    optional {
        content: "content",
        name: "name",
        tool_calls: "tool_calls",
        tool_call_id: "tool_call_id",
    },
);
deserialize_with_extra!(
    ContentPart,
    required { kind: "type" },
    optional { text: "text" },
);
deserialize_with_extra!(
    ToolCall,
    required {
        id: "id",
        function: "function"
    },
    optional { kind: "type" },
);
deserialize_with_extra!(
    FunctionCall,
    required {
        name: "name",
        arguments: "arguments"
    },
    optional {},
);
deserialize_with_extra!(
    Tool,
    required { kind: "type" },
    optional {
        function: "function"
    },
);
deserialize_with_extra!(
    FunctionDefinition,
    required { name: "name" },
    optional {
        description: "description",
        parameters: "parameters"
    },
);
