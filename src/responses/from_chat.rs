//! A rewritten chat request written back as the Responses body it came from. Each message of
//! the rewrite is matched, in order, to the message of the client's it is: unchanged, it goes as
//! the client's own items, byte for byte (carried items and reasoning included); a compacted tool
//! result goes as its `function_call_output` item with the new `output`; a message the pipeline
//! wrote (summary, definitions, a recall) becomes a new item. Messages left out take their items
//! with them. Every field the pipeline does not own is the client's.

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use foldhash::quality::FixedState;
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Map, Value, json};

use super::ResponsesBody;
use super::to_chat::{ClientTool, Converted, Unit, responses_tool_choice};
use crate::openai::{ChatRequest, Message, Nullable, Role, Tool};
use crate::tokens::hash_message;

/// Which message of the client's a rewritten message is.
enum Origin {
    /// The client's, unchanged.
    Kept(usize),
    /// The client's tool result, compacted.
    Compacted(usize),
    /// Written by the pipeline (or changed past recognition).
    New,
}

/// The Responses body that sends `rewritten`, a rewrite of the chat request `converted` was read
/// as.
pub fn from_chat(converted: &Converted, rewritten: &ChatRequest) -> ResponsesBody {
    written(converted, rewritten)
        .into_iter()
        .map(|(key, field)| (key.to_owned(), field.into_owned()))
        .collect()
}

/// The same body, serialized without copying the client's items.
pub fn write(converted: &Converted, rewritten: &ChatRequest) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&Written(written(converted, rewritten)))
}

/// A field of the body written back: a value (the client's, borrowed, or new), or the items of
/// `input`.
enum Field<'a> {
    Value(Cow<'a, Value>),
    Items(Vec<Cow<'a, Value>>),
    Tools(Vec<ToolOut<'a>>),
}

/// A tool as sent: the client's, as it wrote it, or one the rewrite changed.
enum ToolOut<'a> {
    Client(&'a ClientTool),
    Flat(Value),
}

impl Serialize for ToolOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ToolOut::Client(tool) => tool.serialize(serializer),
            ToolOut::Flat(value) => value.serialize(serializer),
        }
    }
}

impl Field<'_> {
    fn into_owned(self) -> Value {
        match self {
            Field::Value(value) => value.into_owned(),
            Field::Items(items) => Value::Array(items.into_iter().map(Cow::into_owned).collect()),
            Field::Tools(tools) => Value::Array(
                tools
                    .into_iter()
                    .map(|tool| match tool {
                        ToolOut::Client(tool) => tool.to_json(),
                        ToolOut::Flat(value) => value,
                    })
                    .collect(),
            ),
        }
    }
}

impl Serialize for Field<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Field::Value(value) => value.serialize(serializer),
            Field::Items(items) => items.serialize(serializer),
            Field::Tools(tools) => tools.serialize(serializer),
        }
    }
}

/// The body's fields in order.
struct Written<'a>(Vec<(&'a str, Field<'a>)>);

impl Serialize for Written<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, field) in &self.0 {
            map.serialize_entry(key, field)?;
        }
        map.end()
    }
}

fn written<'a>(converted: &'a Converted, rewritten: &ChatRequest) -> Vec<(&'a str, Field<'a>)> {
    let mut messages = rewritten.messages.as_slice();
    let mut instructions = None;
    if converted.instructions
        && let Some((first, rest)) = messages.split_first()
        && matches!(first.role, Role::System | Role::Developer)
    {
        instructions = Some(if *first == converted.units[0].message {
            None
        } else {
            Some(Value::String(first.content_text()))
        });
        messages = rest;
    }

    let origins = origins(converted, messages);
    let mut input: Vec<Cow<'a, Value>> = Vec::new();
    // Units before this one are behind: what a folded system message carried goes out there.
    let mut passed = usize::from(converted.instructions);
    for (message, origin) in messages.iter().zip(origins) {
        if let Origin::Kept(unit) | Origin::Compacted(unit) = origin {
            carried_by_folded(converted, passed..unit, &mut input);
            passed = unit + 1;
        }
        match origin {
            Origin::Kept(unit) => {
                input.extend(converted.units[unit].items.iter().map(Cow::Borrowed))
            }
            Origin::Compacted(unit) => compacted(&converted.units[unit], message, &mut input),
            Origin::New => new_items(message, &mut input),
        }
    }
    carried_by_folded(converted, passed..converted.units.len(), &mut input);
    input.extend(converted.trailing.iter().map(Cow::Borrowed));

    let mut body = Vec::with_capacity(converted.body.len() + 1);
    let mut input = Some(input);
    for (key, value) in &converted.body {
        let field = match key.as_str() {
            "instructions" => match instructions.take().flatten() {
                Some(text) => Field::Value(Cow::Owned(text)),
                None => Field::Value(Cow::Borrowed(value)),
            },
            "input" => {
                let items = input.take().unwrap_or_default();
                input_field(converted, value, items)
            }
            "tools" => match tools_field(converted, rewritten) {
                Some(tools) => tools,
                None => continue,
            },
            "tool_choice" => match tool_choice_value(converted, rewritten) {
                Some(choice) => Field::Value(Cow::Owned(choice)),
                None => continue,
            },
            "model" | "stream" => Field::Value(Cow::Borrowed(value)),
            // A field the pipeline took out of the request (`parallel_tool_calls` once it
            // sends no tools) is not sent.
            _ if !rewritten.extra.contains_key(key) => continue,
            _ => Field::Value(Cow::Borrowed(value)),
        };
        body.push((key.as_str(), field));
    }
    // The client sent no `input`: none is added unless the rewrite has items to send.
    if let Some(items) = input.filter(|items| !items.is_empty()) {
        body.push(("input", Field::Items(items)));
    }
    if !converted.body.contains_key("tools")
        && let Some(tools) = tools_field(converted, rewritten)
    {
        body.push(("tools", tools));
    }
    body
}

/// The origin of each message, matched from the end: a message equal to one of the client's
/// (before the last matched) is the latest such; a tool message whose content changed is the
/// client's result for its call. Matching from the end makes a kept message the client's latest
/// equal one: the rewrite keeps the recent turns, and an earlier equal message ("yes") may have
/// been summarized.
fn origins(converted: &Converted, messages: &[Message]) -> Vec<Origin> {
    let start = usize::from(converted.instructions);
    let mut by_hash: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut by_call: HashMap<&str, Vec<usize>> = HashMap::new();
    for (k, unit) in converted.units.iter().enumerate().skip(start) {
        by_hash.entry(key(&unit.message)).or_default().push(k);
        if let Some(id) = unit.message.tool_call_id.get() {
            by_call.entry(id.as_str()).or_default().push(k);
        }
    }
    let mut upper = converted.units.len();
    let mut origins: Vec<Origin> = messages
        .iter()
        .rev()
        .map(|message| {
            let kept = by_hash.get(&key(message)).and_then(|units| {
                units
                    .iter()
                    .rev()
                    .copied()
                    .find(|&k| k < upper && converted.units[k].message == *message)
            });
            if let Some(unit) = kept {
                upper = unit;
                return Origin::Kept(unit);
            }
            let compacted = (message.role == Role::Tool)
                .then(|| message.tool_call_id.get())
                .flatten()
                .and_then(|id| by_call.get(id.as_str()))
                .and_then(|units| units.iter().rev().copied().find(|&k| k < upper));
            match compacted {
                Some(unit) => {
                    upper = unit;
                    Origin::Compacted(unit)
                }
                None => Origin::New,
            }
        })
        .collect();
    origins.reverse();
    origins
}

fn key(message: &Message) -> u64 {
    let mut hasher = FixedState::with_seed(0x5e5_0a5e).build_hasher();
    hash_message(message, &mut hasher);
    hasher.finish()
}

/// The items carried by the system and developer messages of `units` that the rewrite does not
/// send as they were: the system stage folds them into the first message (or drops a repeat),
/// which is not leaving their turn out, so what they carried (a `compaction` item, a hosted
/// call) still goes, where it was.
fn carried_by_folded<'a>(
    converted: &'a Converted,
    units: std::ops::Range<usize>,
    input: &mut Vec<Cow<'a, Value>>,
) {
    for unit in &converted.units[units] {
        if matches!(unit.message.role, Role::System | Role::Developer)
            && let Some((_own, carried)) = unit.items.split_last()
        {
            input.extend(carried.iter().map(Cow::Borrowed));
        }
    }
}

/// A compacted result: the items carried before it, then its `function_call_output` item with
/// the new output.
fn compacted<'a>(unit: &'a Unit, message: &Message, input: &mut Vec<Cow<'a, Value>>) {
    for item in &unit.items {
        let is_output = item.get("type").and_then(Value::as_str) == Some("function_call_output");
        if !is_output {
            input.push(Cow::Borrowed(item));
            continue;
        }
        let mut item = item.clone();
        if let Some(object) = item.as_object_mut() {
            object.insert("output".into(), Value::String(message.content_text()));
        }
        input.push(Cow::Owned(item));
    }
}

/// Items for a message the pipeline wrote.
fn new_items(message: &Message, input: &mut Vec<Cow<'_, Value>>) {
    let mut push = |item: Value| input.push(Cow::Owned(item));
    match message.role {
        Role::Tool => push(json!({
            "type": "function_call_output",
            "call_id": message.tool_call_id.get().cloned().unwrap_or_default(),
            "output": message.content_text(),
        })),
        Role::Assistant => {
            let text = message.content_text();
            if !text.is_empty() {
                push(json!({"role": "assistant", "content": text}));
            }
            for call in message.tool_calls() {
                push(json!({
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.function.name,
                    "arguments": call.function.arguments,
                }));
            }
        }
        _ => push(json!({"role": message.role.as_str(), "content": message.content_text()})),
    }
}

/// `input` as sent: the client's string when it is all that is left, unchanged.
fn input_field<'a>(
    converted: &Converted,
    original: &'a Value,
    input: Vec<Cow<'a, Value>>,
) -> Field<'a> {
    if let Value::String(_) = original
        && let [only] = input.as_slice()
        && converted
            .units
            .last()
            .is_some_and(|unit| unit.items.first() == Some(only.as_ref()))
    {
        return Field::Value(Cow::Borrowed(original));
    }
    Field::Items(input)
}

/// `tools` as sent: each tool the client's as it wrote it when unchanged, else in the flat
/// shape; `None` when the rewrite sends none.
fn tools_field<'a>(converted: &'a Converted, rewritten: &ChatRequest) -> Option<Field<'a>> {
    let tools = match &rewritten.tools {
        Nullable::Value(tools) if !tools.is_empty() => tools,
        // The client's own empty list stays; a list the rewrite emptied goes.
        Nullable::Value(_) => {
            return match &converted.tools {
                Some(client) if client.is_empty() => Some(Field::Tools(Vec::new())),
                _ => None,
            };
        }
        Nullable::Absent => return None,
        Nullable::Null => return Some(Field::Value(Cow::Owned(Value::Null))),
    };
    let client = converted.tools.as_deref().unwrap_or_default();
    let sent = tools
        .iter()
        .map(
            |tool| match client.iter().find(|client| client.tool == *tool) {
                Some(client) => ToolOut::Client(client),
                None => ToolOut::Flat(flat_tool(tool)),
            },
        )
        .collect();
    Some(Field::Tools(sent))
}

fn flat_tool(tool: &Tool) -> Value {
    let mut flat = Map::new();
    flat.insert("type".into(), Value::String(tool.kind.clone()));
    if let Some(function) = &tool.function {
        flat.insert("name".into(), Value::String(function.name.clone()));
        let mut put = |key: &str, value: Option<Value>| {
            if let Some(value) = value {
                flat.insert(key.into(), value);
            }
        };
        put(
            "description",
            nullable_value(&function.description, |d| Value::String(d.to_string())),
        );
        put(
            "parameters",
            nullable_value(&function.parameters, |p| p.value().clone()),
        );
        flat.extend(function.extra.clone());
    }
    flat.extend(tool.extra.clone());
    Value::Object(flat)
}

/// A field as written: absent, `null`, or its value.
fn nullable_value<T>(field: &Nullable<T>, value: impl Fn(&T) -> Value) -> Option<Value> {
    match field {
        Nullable::Absent => None,
        Nullable::Null => Some(Value::Null),
        Nullable::Value(v) => Some(value(v)),
    }
}

fn tool_choice_value(converted: &Converted, rewritten: &ChatRequest) -> Option<Value> {
    let choice = rewritten.tool_choice.get()?;
    Some(match &converted.tool_choice {
        Some((chat, original)) if chat == choice => original.clone(),
        _ => responses_tool_choice(choice),
    })
}

#[cfg(test)]
#[path = "from_chat_tests.rs"]
mod tests;
