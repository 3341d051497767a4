//! A Responses body read as a chat request: `instructions` as the first system message, message
//! items as messages, an assistant message and the `function_call` items after it as one
//! assistant message with tool calls, `function_call_output` items as tool messages, flat
//! function tools as chat tools. Every other item (reasoning, hosted tool calls, `compaction`,
//! `item_reference`, types ctxproxy does not know) is carried, unread, by the message after it,
//! so it is kept or left out with that message and always right before it.

use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::{ResponsesBody, invalid, is_chained};
use crate::error::ProxyError;
use crate::openai::{
    ChatRequest, Content, ContentPart, Extra, FunctionCall, FunctionDefinition, Message, Nullable,
    Role, Schema, SharedText, Tool, ToolCall,
};

/// Fields of a Responses body the conversion reads or writes; the others ride along in the chat
/// request's `extra` (the conversation id reads `user`, the caches `temperature`, …).
const OWNED_FIELDS: [&str; 6] = [
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "stream",
];

/// A Responses body as a chat request, and what writing a rewrite of it back needs.
#[derive(Debug, Clone)]
pub struct Converted {
    /// The client's body.
    pub(super) body: ResponsesBody,
    /// One per message of `chat`, in order.
    pub(super) units: Vec<Unit>,
    /// Items after the last message (a trailing reasoning or hosted item): sent last.
    pub(super) trailing: Vec<Value>,
    /// Whether `chat.messages[0]` is `instructions`.
    pub(super) instructions: bool,
    /// `tool_choice` as converted, with the client's JSON of it.
    pub(super) tool_choice: Option<(Value, Value)>,
    /// The client's tools, moved out of `body` (whose `tools` is left `null`, its place): `None`
    /// when it sent no list.
    pub(super) tools: Option<Vec<ClientTool>>,
    /// Items left out because a later `compaction` item stands for them.
    pub compacted_items: usize,
    /// No item was moved to keep a call with its answer: the units hold the items in the
    /// client's order.
    pub(super) in_client_order: bool,
}

/// A tool of the client's as chat reads it, and the order of its JSON's fields: written back in
/// that order, it is the client's JSON byte for byte.
#[derive(Debug, Clone)]
pub(super) struct ClientTool {
    pub tool: Tool,
    pub keys: Vec<String>,
}

impl ClientTool {
    /// The field `key` of the client's JSON, borrowed from what it was read as.
    fn field(&self, key: &str) -> Option<FieldRef<'_>> {
        fn nullable<T>(
            field: &Nullable<T>,
            read: impl Fn(&T) -> FieldRef<'_>,
        ) -> Option<FieldRef<'_>> {
            match field {
                Nullable::Absent => None,
                Nullable::Null => Some(FieldRef::Null),
                Nullable::Value(value) => Some(read(value)),
            }
        }
        let tool = &self.tool;
        match (key, &tool.function) {
            ("type", _) => Some(FieldRef::Str(&tool.kind)),
            ("name", Some(function)) => Some(FieldRef::Str(&function.name)),
            ("description", Some(function)) => {
                nullable(&function.description, |d| FieldRef::Str(d))
            }
            ("parameters", Some(function)) => {
                nullable(&function.parameters, |p| FieldRef::Schema(p))
            }
            (_, Some(function)) => function.extra.get(key).map(FieldRef::Value),
            (_, None) => tool.extra.get(key).map(FieldRef::Value),
        }
    }

    /// The client's JSON of the tool.
    pub fn to_json(&self) -> Value {
        let object = self
            .keys
            .iter()
            .filter_map(|key| {
                let value = match self.field(key)? {
                    FieldRef::Str(text) => Value::String(text.to_owned()),
                    FieldRef::Value(value) => value.clone(),
                    FieldRef::Schema(schema) => schema.value().clone(),
                    FieldRef::Null => Value::Null,
                };
                Some((key.clone(), value))
            })
            .collect();
        Value::Object(object)
    }
}

/// A field of a client's tool as it was read.
enum FieldRef<'a> {
    Str(&'a str),
    Value(&'a Value),
    /// Written from its JSON, kept with it.
    Schema(&'a Schema),
    Null,
}

impl serde::Serialize for FieldRef<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            FieldRef::Str(text) => serializer.serialize_str(text),
            FieldRef::Value(value) => value.serialize(serializer),
            FieldRef::Schema(schema) => schema.serialize(serializer),
            FieldRef::Null => serializer.serialize_unit(),
        }
    }
}

/// Written as the client wrote it: its fields in its order.
impl serde::Serialize for ClientTool {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.keys.len()))?;
        for key in &self.keys {
            if let Some(value) = self.field(key) {
                map.serialize_entry(key, &value)?;
            }
        }
        map.end()
    }
}

/// One chat message and the client's items it stands for.
#[derive(Debug, Clone)]
pub(super) struct Unit {
    pub message: Message,
    /// The client's items, in order: those carried (read by no stage) and the message's own.
    pub items: Vec<Value>,
}

impl Converted {
    /// The client's body, with the items read (those a `compaction` item stands for left out).
    pub fn client_body(&self) -> ResponsesBody {
        let mut body = self.body.clone();
        if let Some(input @ Value::Null) = body.get_mut("input") {
            let items = self.units.iter().flat_map(|u| u.items.iter());
            *input = Value::Array(items.chain(&self.trailing).cloned().collect());
        }
        if let (Some(tools), Some(field)) = (&self.tools, body.get_mut("tools")) {
            *field = Value::Array(tools.iter().map(ClientTool::to_json).collect());
        }
        body
    }

    /// The client's tools as it wrote them (hosted ones included), when it sent any.
    pub fn client_tools(&self) -> Option<Value> {
        let tools = self.tools.as_ref()?;
        Some(Value::Array(
            tools.iter().map(ClientTool::to_json).collect(),
        ))
    }

    /// Whether the upstream keeps the Response (`store` is true unless the client says false).
    pub fn stored(&self) -> bool {
        self.body.get("store") != Some(&Value::Bool(false))
    }

    /// Whether a stored Response may answer the body (`cache::responses::cacheable`).
    pub fn cacheable(&self) -> bool {
        crate::cache::responses::cacheable(&self.body)
    }

    /// Whether the history lives upstream (`previous_response_id`, `conversation`): only what
    /// the body sends is rewritten (`pipeline::seen`).
    pub fn chained(&self) -> bool {
        super::is_chained(&self.body)
    }

    /// Whether the Response runs in the background (`background: true`): its answer is a
    /// queued Response, read later by the client, so nothing in it can be asked again.
    pub fn background(&self) -> bool {
        self.body.get("background") == Some(&Value::Bool(true))
    }

    /// The Response the body chains on (`previous_response_id`), when it names one.
    pub fn previous_response_id(&self) -> Option<&str> {
        self.body
            .get("previous_response_id")
            .and_then(Value::as_str)
    }

    /// Whether the pipeline may rewrite the body: a history the client sent whole, in a shape
    /// it keeps valid ([`Converted::pairs_in_order`]), or a chained request whose items were
    /// read in the client's order with none left out (what `pipeline::seen` changes is only the
    /// bytes of an output, so nothing may move).
    pub fn rewritable(&self) -> bool {
        if self.chained() {
            self.in_client_order && self.compacted_items == 0
        } else {
            self.pairs_in_order()
        }
    }

    /// Whether every tool message answers a call of the assistant message before it, with only
    /// tool messages between: the chat shape the stages keep valid. An input that is not (an
    /// output far from its call, a chained request's outputs of calls made upstream) is sent as
    /// the client wrote it.
    pub fn pairs_in_order(&self) -> bool {
        let mut open: Vec<&str> = Vec::new();
        for message in self.units.iter().map(|u| &u.message) {
            match message.role {
                Role::Tool => {
                    let Some(id) = message.tool_call_id.get() else {
                        return false;
                    };
                    let Some(at) = open.iter().position(|open| *open == id.as_str()) else {
                        return false;
                    };
                    open.remove(at);
                }
                _ => {
                    open = message.tool_calls().iter().map(|c| c.id.as_str()).collect();
                }
            }
        }
        true
    }
}

/// What an input item is.
enum Kind {
    Message,
    FunctionCall,
    FunctionCallOutput,
    /// Carried unread.
    Carried,
}

fn kind_of(item: &Map<String, Value>) -> Kind {
    match item.get("type").and_then(Value::as_str) {
        Some("message") => Kind::Message,
        None if item.contains_key("role") => Kind::Message,
        Some("function_call") => Kind::FunctionCall,
        Some("function_call_output") => Kind::FunctionCallOutput,
        _ => Kind::Carried,
    }
}

/// Reads `body` as a chat request, and what writing its rewrite back needs. Malformed items are OpenAI-format 400s naming the item; so is
/// a `function_call_output` whose call is nowhere in a history the client sent whole (the
/// upstream refuses it the same way).
pub fn to_chat(mut body: ResponsesBody) -> Result<(ChatRequest, Converted), ProxyError> {
    let mut units = Vec::new();
    let instructions = match body.get("instructions") {
        Some(Value::String(text)) => {
            units.push(Unit {
                message: Message::text(Role::System, text.clone()),
                items: Vec::new(),
            });
            true
        }
        _ => false,
    };
    // The items move into the units; a list `input` is left `null` in the body (its place).
    let input: Vec<Value> = match body.get_mut("input") {
        Some(Value::String(text)) => vec![json!({"role": "user", "content": text.clone()})],
        Some(input @ Value::Array(_)) => match input.take() {
            Value::Array(items) => items,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    };
    // Which items are read, and the calls an item answers (see `held` below).
    let (start, answered) = {
        let items = objects(&input)?;
        // A call the input refers to (`item_reference`, or an item type ctxproxy does not know)
        // is not seen here: the upstream judges the outputs.
        let refers = items.iter().any(|item| !is_known(item));
        if !is_chained(&body) && !refers {
            no_orphan_outputs(&items)?;
        }
        (after_compaction(&items), answered_calls(&items))
    };
    let compacted_items = start.iter().filter(|&&kept| !kept).count();

    let mut trailing = Vec::new();
    // A call another item answers later waits for its answer (and the reasoning before it with
    // it), so the two are carried by the same message and kept or left out together.
    let mut held: Vec<Value> = Vec::new();
    let mut open_assistant: Option<usize> = None;
    let mut in_client_order = true;
    for (at, (raw, read)) in input.into_iter().zip(start).enumerate() {
        let Some(item) = raw.as_object().filter(|_| read) else {
            continue;
        };
        match kind_of(item) {
            Kind::Message => {
                let message = message_of(item, at)?;
                open_assistant = (message.role == Role::Assistant).then_some(units.len());
                let mut carried = std::mem::take(&mut trailing);
                carried.push(raw);
                units.push(Unit {
                    message,
                    items: carried,
                });
            }
            Kind::FunctionCall => {
                let call = call_of(item, at)?;
                let unit = match open_assistant {
                    Some(unit) => unit,
                    None => {
                        let mut message = Message::text(Role::Assistant, "");
                        message.content = Nullable::Null;
                        units.push(Unit {
                            message,
                            items: Vec::new(),
                        });
                        open_assistant = Some(units.len() - 1);
                        units.len() - 1
                    }
                };
                let unit = &mut units[unit];
                unit.items.append(&mut trailing);
                unit.items.push(raw);
                match &mut unit.message.tool_calls {
                    Nullable::Value(calls) => Arc::make_mut(calls).push(call),
                    other => *other = Nullable::Value(Arc::new(vec![call])),
                }
            }
            Kind::FunctionCallOutput => {
                let message = output_of(item, at)?;
                open_assistant = None;
                let mut carried = std::mem::take(&mut trailing);
                carried.push(raw);
                units.push(Unit {
                    message,
                    items: carried,
                });
            }
            Kind::Carried => match paired(item) {
                Some(Paired::Call(id)) if answered.contains(&id) => {
                    let reasoning = trailing
                        .iter()
                        .rev()
                        .take_while(|t: &&Value| {
                            t.get("type").and_then(Value::as_str) == Some("reasoning")
                        })
                        .count();
                    held.extend(trailing.drain(trailing.len() - reasoning..));
                    held.push(raw);
                    in_client_order = false;
                }
                Some(Paired::Answer(id)) => {
                    let call = held.iter().position(|h| {
                        h.as_object()
                            .and_then(paired)
                            .is_some_and(|p| matches!(p, Paired::Call(c) if c == id))
                    });
                    if let Some(call) = call {
                        // The call, the reasoning held before it, and the answer, in order.
                        let start = held[..call]
                            .iter()
                            .rev()
                            .take_while(|h| {
                                h.get("type").and_then(Value::as_str) == Some("reasoning")
                            })
                            .count();
                        trailing.extend(held.drain(call - start..=call));
                    }
                    trailing.push(raw);
                }
                _ => trailing.push(raw),
            },
        }
    }

    trailing.append(&mut held);

    let client_tools = tools_of(&mut body)?;
    let tools: Vec<Tool> = client_tools
        .iter()
        .flatten()
        .map(|client| client.tool.clone())
        .collect();
    let tool_choice = body
        .get("tool_choice")
        .map(|choice| (chat_tool_choice(choice), choice.clone()));
    let mut extra = Extra::new();
    for (key, value) in &body {
        if !OWNED_FIELDS.contains(&key.as_str()) {
            extra.insert(key.clone(), value.clone());
        }
    }
    let chat = ChatRequest {
        model: super::model_of(&body).to_owned(),
        messages: units.iter().map(|u| u.message.clone()).collect(),
        stream: match body.get("stream") {
            Some(Value::Bool(stream)) => Nullable::Value(*stream),
            Some(Value::Null) => Nullable::Null,
            _ => Nullable::Absent,
        },
        stream_options: Nullable::Absent,
        tools: if body.contains_key("tools") {
            Nullable::Value(tools)
        } else {
            Nullable::Absent
        },
        tool_choice: tool_choice
            .as_ref()
            .map_or(Nullable::Absent, |(chat, _)| Nullable::Value(chat.clone())),
        functions: Nullable::Absent,
        function_call: Nullable::Absent,
        response_format: Nullable::Absent,
        extra,
    };
    let converted = Converted {
        body,
        units,
        trailing,
        instructions,
        tool_choice,
        tools: client_tools,
        compacted_items,
        in_client_order,
    };
    Ok((chat, converted))
}

/// The items as objects; anything else is a 400 naming it.
fn objects(input: &[Value]) -> Result<Vec<&Map<String, Value>>, ProxyError> {
    input
        .iter()
        .enumerate()
        .map(|(at, item)| {
            item.as_object()
                .ok_or_else(|| invalid(format!("input[{at}]"), "expected an object"))
        })
        .collect()
}

/// What an item is in a call and its answer (any pair but `function_call`'s, which are chat's own
/// tool calls and results): a call the client runs (`custom_tool_call`, `computer_call`,
/// `local_shell_call`, …) or an MCP approval request, or the answer to one.
enum Paired {
    Call(String),
    Answer(String),
}

fn paired(item: &Map<String, Value>) -> Option<Paired> {
    let kind = item.get("type").and_then(Value::as_str)?;
    let text = |key: &str| item.get(key).and_then(Value::as_str).map(str::to_owned);
    match kind {
        "function_call" | "function_call_output" => None,
        "mcp_approval_request" => text("id").map(Paired::Call),
        "mcp_approval_response" => text("approval_request_id").map(Paired::Answer),
        _ if kind.ends_with("_output") => text("call_id").map(Paired::Answer),
        _ => text("call_id").map(Paired::Call),
    }
}

/// The ids of the calls (chat's and the others) that an item of `items` answers.
fn answered_calls(items: &[&Map<String, Value>]) -> Vec<String> {
    items
        .iter()
        .filter_map(|item| match (kind_of(item), paired(item)) {
            (Kind::FunctionCallOutput, _) => item
                .get("call_id")
                .and_then(Value::as_str)
                .map(str::to_owned),
            (_, Some(Paired::Answer(id))) => Some(id),
            _ => None,
        })
        .collect()
}

/// The id of the call an item makes, chat's or another.
fn call_made(item: &Map<String, Value>) -> Option<String> {
    match (kind_of(item), paired(item)) {
        (Kind::FunctionCall, _) => item
            .get("call_id")
            .and_then(Value::as_str)
            .map(str::to_owned),
        (_, Some(Paired::Call(id))) => Some(id),
        _ => None,
    }
}

/// Which items are read: with a `compaction` item, it stands for the items before it (OpenAI's
/// advice for stateless chains), except system and developer messages, which are kept; when an
/// answer after it (an output, an approval) answers a call before it, everything is kept.
fn after_compaction(items: &[&Map<String, Value>]) -> Vec<bool> {
    let Some(last) = items
        .iter()
        .rposition(|item| item.get("type").and_then(Value::as_str) == Some("compaction"))
    else {
        return vec![true; items.len()];
    };
    let answered_later = answered_calls(&items[last..]);
    let called_before = items[..last]
        .iter()
        .any(|item| call_made(item).is_some_and(|id| answered_later.contains(&id)));
    if called_before {
        return vec![true; items.len()];
    }
    items
        .iter()
        .enumerate()
        .map(|(at, item)| {
            at >= last
                || (matches!(kind_of(item), Kind::Message)
                    && matches!(
                        item.get("role").and_then(Value::as_str),
                        Some("system" | "developer")
                    ))
        })
        .collect()
}

/// Item types whose contents are all in the item (an `item_reference` is not).
const KNOWN_ITEMS: [&str; 24] = [
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "compaction",
    "web_search_call",
    "file_search_call",
    "code_interpreter_call",
    "image_generation_call",
    "computer_call",
    "computer_call_output",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "mcp_call",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "tool_search_call",
];

fn is_known(item: &Map<String, Value>) -> bool {
    match item.get("type").and_then(Value::as_str) {
        Some(kind) => KNOWN_ITEMS.contains(&kind),
        None => item.contains_key("role"),
    }
}

/// Every `function_call_output` answers a `function_call` before it.
fn no_orphan_outputs(items: &[&Map<String, Value>]) -> Result<(), ProxyError> {
    let mut called: Vec<&str> = Vec::new();
    for (at, item) in items.iter().enumerate() {
        let id = item.get("call_id").and_then(Value::as_str);
        match kind_of(item) {
            Kind::FunctionCall => called.extend(id),
            Kind::FunctionCallOutput => {
                let id = id.ok_or_else(|| ProxyError::MissingField {
                    field: format!("input[{at}].call_id"),
                })?;
                if !called.contains(&id) {
                    return Err(invalid(
                        format!("input[{at}].call_id"),
                        format!("no tool call found for function call output with call_id {id}"),
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn string_field<'a>(
    item: &'a Map<String, Value>,
    at: usize,
    field: &str,
) -> Result<&'a str, ProxyError> {
    match item.get(field) {
        Some(Value::String(text)) => Ok(text),
        Some(_) => Err(invalid(format!("input[{at}].{field}"), "expected a string")),
        None => Err(ProxyError::MissingField {
            field: format!("input[{at}].{field}"),
        }),
    }
}

fn message_of(item: &Map<String, Value>, at: usize) -> Result<Message, ProxyError> {
    let role = Role::from(string_field(item, at, "role")?);
    let content = content_of(item, at, "content")?;
    let mut message = Message::text(role, "");
    message.content = Nullable::Value(content);
    Ok(message)
}

/// An item's `field` (`content`, `output`): a string, or content parts.
fn content_of(item: &Map<String, Value>, at: usize, field: &str) -> Result<Content, ProxyError> {
    let name = format!("input[{at}].{field}");
    match item.get(field) {
        Some(Value::String(text)) => Ok(Content::Text(text.as_str().into())),
        Some(Value::Array(parts)) => Ok(Content::Parts(parts_of(parts, &name)?)),
        Some(_) => Err(invalid(
            name,
            "expected a string or an array of content parts",
        )),
        None => Err(ProxyError::MissingField { field: name }),
    }
}

/// Content parts as chat parts: text of every kind as `text`, an image as `image_url` (so its
/// tokens are counted as an image's), anything else kept whole.
fn parts_of(parts: &[Value], field: &str) -> Result<Vec<ContentPart>, ProxyError> {
    parts
        .iter()
        .enumerate()
        .map(|(k, part)| {
            let part = part
                .as_object()
                .ok_or_else(|| invalid(format!("{field}[{k}]"), "expected an object"))?;
            let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
            let text = match kind {
                "refusal" => part.get("refusal"),
                _ => part.get("text"),
            }
            .and_then(Value::as_str);
            Ok(match (kind, text) {
                (_, Some(text)) => ContentPart {
                    kind: "text".into(),
                    text: Nullable::Value(text.to_owned()),
                    extra: Extra::new(),
                },
                ("input_image", None) => {
                    let mut image = Map::new();
                    for (from, to) in [
                        ("image_url", "url"),
                        ("file_id", "url"),
                        ("detail", "detail"),
                    ] {
                        if let Some(value) = part.get(from) {
                            image.insert(to.into(), value.clone());
                        }
                    }
                    let mut extra = Extra::new();
                    extra.insert("image_url".into(), Value::Object(image));
                    ContentPart {
                        kind: "image_url".into(),
                        text: Nullable::Absent,
                        extra,
                    }
                }
                _ => {
                    let mut extra = part.clone();
                    extra.remove("type");
                    ContentPart {
                        kind: kind.to_owned(),
                        text: Nullable::Absent,
                        extra,
                    }
                }
            })
        })
        .collect()
}

fn call_of(item: &Map<String, Value>, at: usize) -> Result<ToolCall, ProxyError> {
    let arguments = match item.get("arguments") {
        Some(Value::String(arguments)) => arguments.clone(),
        None => "{}".into(),
        Some(_) => {
            return Err(invalid(
                format!("input[{at}].arguments"),
                "expected a string",
            ));
        }
    };
    Ok(ToolCall {
        id: string_field(item, at, "call_id")?.to_owned(),
        kind: Some("function".into()),
        function: FunctionCall {
            name: string_field(item, at, "name")?.to_owned(),
            arguments,
            extra: Extra::new(),
        },
        extra: Extra::new(),
    })
}

fn output_of(item: &Map<String, Value>, at: usize) -> Result<Message, ProxyError> {
    let content = content_of(item, at, "output")?;
    let mut message = Message::text(Role::Tool, "");
    message.content = Nullable::Value(content);
    message.tool_call_id = Nullable::Value(string_field(item, at, "call_id")?.into());
    Ok(message)
}

/// Flat function tools (`{"type":"function","name",…}`) as chat tools; every other tool (hosted,
/// custom, MCP) kept whole, which the tools stage never stubs or removes. The tools are moved out
/// of the body, not copied (schemas are the largest part of most bodies): `None` when it holds
/// no list.
fn tools_of(body: &mut ResponsesBody) -> Result<Option<Vec<ClientTool>>, ProxyError> {
    let tools = match body.get_mut("tools") {
        Some(Value::Array(tools)) => std::mem::take(tools),
        None | Some(Value::Null) => return Ok(None),
        Some(_) => return Err(invalid("tools", "expected an array of tools")),
    };
    let read = tools
        .into_iter()
        .enumerate()
        .map(|(k, tool)| {
            let Value::Object(mut rest) = tool else {
                return Err(invalid(format!("tools[{k}]"), "expected an object"));
            };
            let keys: Vec<String> = rest.keys().cloned().collect();
            let kind = match rest.remove("type") {
                Some(Value::String(kind)) => kind,
                _ => {
                    return Err(ProxyError::MissingField {
                        field: format!("tools[{k}].type"),
                    });
                }
            };
            let tool = if kind == "function" {
                let name = match rest.remove("name") {
                    Some(Value::String(name)) => name,
                    _ => {
                        return Err(ProxyError::MissingField {
                            field: format!("tools[{k}].name"),
                        });
                    }
                };
                let description = nullable(rest.remove("description"))
                    .map_err(|_| invalid(format!("tools[{k}].description"), "expected a string"))?;
                let parameters = match rest.remove("parameters") {
                    None => Nullable::Absent,
                    Some(Value::Null) => Nullable::Null,
                    Some(value) => Nullable::Value(std::sync::Arc::new(Schema::new(value))),
                };
                Tool {
                    kind,
                    function: Some(FunctionDefinition {
                        name,
                        description,
                        parameters,
                        extra: rest,
                    }),
                    extra: Extra::new(),
                }
            } else {
                Tool {
                    kind,
                    function: None,
                    extra: rest,
                }
            };
            Ok(ClientTool { tool, keys })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(field) = body.get_mut("tools") {
        *field = Value::Null;
    }
    Ok(Some(read))
}

fn nullable(value: Option<Value>) -> Result<Nullable<SharedText>, ()> {
    match value {
        None => Ok(Nullable::Absent),
        Some(Value::Null) => Ok(Nullable::Null),
        Some(Value::String(text)) => Ok(Nullable::Value(SharedText::from(text))),
        Some(_) => Err(()),
    }
}

/// `{"type":"function","name":N}` as chat's `{"type":"function","function":{"name":N}}`; every
/// other choice as it is.
fn chat_tool_choice(choice: &Value) -> Value {
    match choice {
        Value::Object(map) if map.get("type").and_then(Value::as_str) == Some("function") => {
            match map.get("name") {
                Some(name) => json!({"type": "function", "function": {"name": name}}),
                None => choice.clone(),
            }
        }
        _ => choice.clone(),
    }
}

/// A chat `tool_choice` as the Responses API writes it.
pub(super) fn responses_tool_choice(choice: &Value) -> Value {
    match choice {
        Value::Object(map) if map.get("type").and_then(Value::as_str) == Some("function") => {
            match map.get("function").and_then(|f| f.get("name")) {
                Some(name) => json!({"type": "function", "name": name}),
                None => choice.clone(),
            }
        }
        _ => choice.clone(),
    }
}
