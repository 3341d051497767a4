//! `POST /v1/responses`: the mock model behind OpenAI's Responses API, in JSON and in its event
//! stream, as deterministic as the chat mock because it is the chat mock: the Responses body is
//! read as the chat request a model would see ([`chat_view`]: `instructions` and
//! `system`/`developer` items as system messages, `function_call` items as an assistant's tool
//! calls, `function_call_output` as tool results, flat function tools as chat tools,
//! `max_output_tokens` as the output limit), answered by the chat mock's code with the same
//! `X-Mock-*` headers, and the answer is written as Response output items: an optional
//! `reasoning` item (for a request with `reasoning`, or a model named `o<digit>…`/`gpt-5…`), then
//! a `message` or `function_call` items. Only the prompt-cache estimate reads the body as sent
//! (tools, instructions, input, hosted tools and reasoning items included), since that is
//! what a provider caches.
//!
//! Like the real API it refuses (400, OpenAI's wording) a body without `model` or `input`, a
//! reasoning item not followed by the output item it came with, a mock reasoning item whose
//! `encrypted_content` was altered, and a call output without its call (unless the history is
//! upstream: `previous_response_id`, `conversation`, `item_reference`). It stores nothing:
//! `GET`/`DELETE /v1/responses/{id}`, `/input_items` and `/cancel` answer 404.

use std::collections::HashSet;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::{MockState, MockToolCall, Reply, header_str};
use crate::openai::ChatRequest;

/// What `include` names to get a reasoning item's `encrypted_content`.
const ENCRYPTED_CONTENT: &str = "reasoning.encrypted_content";

pub(super) async fn create(
    State(state): State<MockState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(response) = super::common_prelude(&state, &headers).await {
        return response;
    }
    state.stats.bump(&state.stats.responses_requests);
    let (request, view) = match parse(&body).and_then(|r| chat_view(&r).map(|v| (r, v))) {
        Ok(parsed) => parsed,
        Err(invalid) => return invalid.into_response(),
    };
    let (view, faults) = match super::admit(&state, &headers, view) {
        Ok(admitted) => admitted,
        Err(not_answered) => return not_answered.into_response(),
    };
    let mut reply = super::steered_reply(&view, &body, &headers);
    reply.cached_tokens = state.cached_tokens(
        super::conversation_of(&headers, &view),
        prompt(&request),
        reply.prompt_tokens,
    );
    let answer = Answer::new(&request, &body, &reply);
    if request.get("stream").and_then(Value::as_bool) == Some(true) {
        return super::stream_response(&state, answer.events(&request), faults.fault);
    }
    let mut response = answer.response(&request, Stage::Done);
    if header_str(&headers, "x-mock-echo") == Some("1") {
        response["mock_echo"] = super::echo(&body, &headers);
    }
    super::json_answer(response, faults.fault)
}

/// `GET`/`DELETE /v1/responses/{id}` and its `/input_items` and `/cancel`: the mock keeps no
/// response, so none is found.
pub(super) async fn not_found(
    State(state): State<MockState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(response) = super::common_prelude(&state, &headers).await {
        return response;
    }
    Invalid {
        status: StatusCode::NOT_FOUND,
        message: format!("Response with id '{id}' not found."),
        param: None,
        code: None,
    }
    .into_response()
}

/// A request the real API would refuse, with its status and OpenAI's error fields.
#[derive(Debug, Clone, PartialEq)]
struct Invalid {
    status: StatusCode,
    message: String,
    param: Option<String>,
    code: Option<&'static str>,
}

impl Invalid {
    fn bad_request(message: String, param: Option<&str>, code: Option<&'static str>) -> Invalid {
        Invalid {
            status: StatusCode::BAD_REQUEST,
            message,
            param: param.map(str::to_owned),
            code,
        }
    }
}

impl IntoResponse for Invalid {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message, "type": "invalid_request_error",
            "param": self.param, "code": self.code,
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

/// The body as a JSON object with a string `model` and an `input` (a string or a list of item
/// objects) that the real API would take.
fn parse(body: &[u8]) -> Result<Map<String, Value>, Invalid> {
    let request = match serde_json::from_slice(body) {
        Ok(Value::Object(request)) => request,
        Ok(_) => {
            let message = "The request body must be a JSON object.".to_owned();
            return Err(Invalid::bad_request(message, None, None));
        }
        Err(e) => {
            let message = format!("We could not parse the JSON body of your request. ({e})");
            return Err(Invalid::bad_request(message, None, None));
        }
    };
    let missing = |name: &str| {
        let message = format!("Missing required parameter: '{name}'.");
        Invalid::bad_request(message, Some(name), Some("missing_required_parameter"))
    };
    let wrong_type = |name: &str, expected: &str, got: &Value| {
        let message = format!(
            "Invalid type for '{name}': expected {expected}, but got {} instead.",
            kind_of(got)
        );
        Invalid::bad_request(message, Some(name), Some("invalid_type"))
    };
    match request.get("model") {
        Some(Value::String(_)) => {}
        None | Some(Value::Null) => return Err(missing("model")),
        Some(other) => return Err(wrong_type("model", "a string", other)),
    }
    match request.get("input") {
        Some(Value::String(_)) => {}
        Some(Value::Array(items)) => {
            if let Some((index, item)) = items.iter().enumerate().find(|(_, i)| !i.is_object()) {
                return Err(wrong_type(&format!("input[{index}]"), "an object", item));
            }
            check_reasoning(items)?;
            check_call_outputs(&request, items)?;
        }
        None | Some(Value::Null) => return Err(missing("input")),
        Some(other) => return Err(wrong_type("input", "a string or an array", other)),
    }
    Ok(request)
}

/// "a string", "an object", … as OpenAI's errors name a JSON value's type.
fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn item_type(item: &Value) -> Option<&str> {
    item.get("type").and_then(Value::as_str)
}

fn str_field<'a>(item: &'a Value, name: &str) -> &'a str {
    item.get(name).and_then(Value::as_str).unwrap_or_default()
}

/// Every reasoning item comes right before the item it was produced with (an assistant message,
/// a call; for the mock's own items, the very one), and the mock's own `encrypted_content` is
/// intact.
fn check_reasoning(items: &[Value]) -> Result<(), Invalid> {
    for (index, item) in items.iter().enumerate() {
        if item_type(item) != Some("reasoning") {
            continue;
        }
        let id = str_field(item, "id");
        if let (Some(_), Some(sent)) = (
            id.strip_prefix(REASONING_PREFIX),
            item.get("encrypted_content").and_then(Value::as_str),
        ) && sent != encrypted_content(id)
        {
            let message = format!("The encrypted content for item {id} could not be verified.");
            let code = Some("invalid_encrypted_content");
            return Err(Invalid::bad_request(message, None, code));
        }
        let followed = items
            .get(index + 1)
            .is_some_and(|next| is_output_item(next) && same_answer(id, next));
        if !followed {
            let message = format!(
                "Item '{id}' of type 'reasoning' was provided without its required following item."
            );
            return Err(Invalid::bad_request(message, Some("input"), None));
        }
    }
    Ok(())
}

/// An item a model produces after its reasoning: an assistant message, a call of any kind, a
/// reference to a stored item, or an item type the mock does not know.
fn is_output_item(item: &Value) -> bool {
    match item_type(item) {
        Some("reasoning") => false,
        Some(kind) if kind.ends_with("_output") => false,
        None | Some("message") => str_field(item, "role") == "assistant",
        Some(_) => true,
    }
}

/// Whether `next` can be the item the reasoning `reasoning_id` came with: the mock's items of
/// one answer share the hash in their ids; other ids cannot be checked.
fn same_answer(reasoning_id: &str, next: &Value) -> bool {
    let Some(answer) = reasoning_id.strip_prefix(REASONING_PREFIX) else {
        return true;
    };
    let next_id = str_field(next, "id");
    [MESSAGE_PREFIX, CALL_PREFIX]
        .iter()
        .find_map(|prefix| next_id.strip_prefix(prefix))
        .is_none_or(|rest| rest.split('_').next() == Some(answer))
}

/// Every `…_call_output` answers an earlier call with its `call_id`, unless the calls may be
/// upstream (`previous_response_id`, `conversation`, an `item_reference`).
fn check_call_outputs(request: &Map<String, Value>, items: &[Value]) -> Result<(), Invalid> {
    let upstream = ["previous_response_id", "conversation"]
        .iter()
        .any(|key| request.get(*key).is_some_and(|v| !v.is_null()))
        || items.iter().any(|i| item_type(i) == Some("item_reference"));
    if upstream {
        return Ok(());
    }
    let mut calls: HashSet<(&str, &str)> = HashSet::new();
    for item in items {
        let Some(kind) = item_type(item) else {
            continue;
        };
        let call_id = str_field(item, "call_id");
        match kind.strip_suffix("_output") {
            Some(call_kind) if call_kind.ends_with("_call") => {
                if !calls.contains(&(call_kind, call_id)) {
                    let message = format!(
                        "No tool call found for {} with call_id {call_id}.",
                        kind.replace('_', " ")
                    );
                    return Err(Invalid::bad_request(message, Some("input"), None));
                }
            }
            _ => {
                calls.insert((kind, call_id));
            }
        }
    }
    Ok(())
}

/// The chat request a model reads from a Responses body: `instructions` then the input's
/// messages (`system` and `developer` as system messages, content parts as their text), each
/// run of an assistant's message and `function_call` items as one assistant message with tool
/// calls, `function_call_output` as tool messages, function tools as chat tools (other tools
/// and other items are not the chat mock's to answer), `max_output_tokens` as
/// `max_completion_tokens`.
fn chat_view(request: &Map<String, Value>) -> Result<ChatRequest, Invalid> {
    let mut messages: Vec<Value> = Vec::new();
    if let Some(instructions) = request.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match request.get("input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for item in items {
                add_item(&mut messages, item);
            }
        }
        _ => {}
    }
    let tools: Vec<Value> = request
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|t| item_type(t) == Some("function") && t.get("name").is_some_and(Value::is_string))
        .map(|tool| {
            let mut function = tool.as_object().cloned().unwrap_or_default();
            function.remove("type");
            json!({"type": "function", "function": function})
        })
        .collect();
    let mut view = json!({"model": request.get("model"), "messages": messages});
    if !tools.is_empty() {
        view["tools"] = Value::Array(tools);
    }
    if let Some(limit) = request.get("max_output_tokens").filter(|v| v.is_u64()) {
        view["max_completion_tokens"] = limit.clone();
    }
    serde_json::from_value(view).map_err(|e| {
        let message = format!("The input could not be read as a conversation: {e}");
        Invalid::bad_request(message, Some("input"), None)
    })
}

/// One input item added to the chat view's messages.
fn add_item(messages: &mut Vec<Value>, item: &Value) {
    match item_type(item) {
        None | Some("message") => {
            let role = match str_field(item, "role") {
                "developer" | "system" => "system",
                "" => return,
                role => role,
            };
            let text = text_of(item.get("content"));
            messages.push(json!({"role": role, "content": text}));
        }
        Some("function_call") => {
            let call = json!({"id": str_field(item, "call_id"), "type": "function", "function": {
                "name": str_field(item, "name"), "arguments": str_field(item, "arguments")}});
            match messages.last_mut() {
                Some(last) if last["role"] == "assistant" => match last.get_mut("tool_calls") {
                    Some(Value::Array(calls)) => calls.push(call),
                    _ => last["tool_calls"] = json!([call]),
                },
                _ => messages
                    .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        Some("function_call_output") => messages.push(json!({
            "role": "tool", "tool_call_id": str_field(item, "call_id"),
            "content": text_of(item.get("output")),
        })),
        Some(_) => {}
    }
}

/// The text of a content: the string, or the `text` of every part joined by newlines.
fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// What a provider caches of a Responses request, in its order: tools, instructions, input.
fn prompt(request: &Map<String, Value>) -> Vec<u8> {
    let part = |key| request.get(key).unwrap_or(&Value::Null);
    serde_json::to_vec(&(part("tools"), part("instructions"), part("input"))).unwrap_or_default()
}

const RESPONSE_PREFIX: &str = "resp_mock_";
const REASONING_PREFIX: &str = "rs_mock_";
const MESSAGE_PREFIX: &str = "msg_mock_";
const CALL_PREFIX: &str = "fc_mock_";

/// The opaque reasoning a mock reasoning item carries: a Fernet-looking token derived from its
/// id, so that the mock can tell when it was altered.
fn encrypted_content(id: &str) -> String {
    let bytes: Vec<u8> = (0_u8..3)
        .flat_map(|block| {
            let mut hasher = Sha256::new();
            hasher.update(b"ctxproxy mock reasoning\0");
            hasher.update(id.as_bytes());
            hasher.update([block]);
            hasher.finalize().to_vec()
        })
        .collect();
    format!("gAAAAAB{}", super::embeddings::encode_base64(&bytes))
}

/// Whether the answer starts with a reasoning item: the request asks for reasoning (an effort
/// other than `none`), or names a reasoning model (`o1`, `o3-mini`, `gpt-5…`, after any
/// `provider/`).
fn reasons(request: &Map<String, Value>) -> bool {
    if let Some(Value::Object(reasoning)) = request.get("reasoning") {
        return reasoning.get("effort").and_then(Value::as_str) != Some("none");
    }
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let model = model.rsplit('/').next().unwrap_or(model);
    let mut chars = model.chars();
    let o_series = chars.next() == Some('o') && chars.next().is_some_and(|c| c.is_ascii_digit());
    o_series || model.starts_with("gpt-5")
}

/// One output item of the answer.
#[derive(Debug, Clone, PartialEq)]
enum Item {
    Reasoning {
        id: String,
        encrypted_content: Option<String>,
    },
    Message {
        id: String,
        pieces: Vec<String>,
        incomplete: bool,
    },
    FunctionCall {
        id: String,
        call: MockToolCall,
    },
}

impl Item {
    fn id(&self) -> &str {
        match self {
            Item::Reasoning { id, .. }
            | Item::Message { id, .. }
            | Item::FunctionCall { id, .. } => id,
        }
    }

    /// The item as `response.output_item.added` announces it.
    fn added(&self) -> Value {
        match self {
            Item::Reasoning { id, .. } => json!({"id": id, "type": "reasoning", "summary": []}),
            Item::Message { id, .. } => json!({"id": id, "type": "message",
                "status": "in_progress", "content": [], "role": "assistant"}),
            Item::FunctionCall { id, call } => json!({"id": id, "type": "function_call",
                "status": "in_progress", "arguments": "", "call_id": call.id, "name": call.name}),
        }
    }

    /// The finished item, as the response's `output` holds it.
    fn done(&self) -> Value {
        match self {
            Item::Reasoning {
                id,
                encrypted_content,
            } => {
                let mut item = json!({"id": id, "type": "reasoning", "summary": []});
                if let Some(content) = encrypted_content {
                    item["encrypted_content"] = json!(content);
                }
                item
            }
            Item::Message {
                id,
                pieces,
                incomplete,
            } => json!({"id": id, "type": "message",
                "status": if *incomplete { "incomplete" } else { "completed" },
                "content": [output_text(&pieces.concat())], "role": "assistant"}),
            Item::FunctionCall { id, call } => json!({"id": id, "type": "function_call",
                "status": "completed", "arguments": call.arguments, "call_id": call.id,
                "name": call.name}),
        }
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "annotations": [], "logprobs": [], "text": text})
}

/// How far along the response is when it is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// `response.created`, `response.in_progress`: no output, no usage yet.
    InProgress,
    Done,
}

/// The answer to one Responses request, before it is written as JSON or as events.
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    id: String,
    created_at: i64,
    items: Vec<Item>,
    /// Cut at `max_output_tokens`.
    incomplete: bool,
    usage: Value,
}

impl Answer {
    fn new(request: &Map<String, Value>, body: &[u8], reply: &Reply) -> Answer {
        let digest = Sha256::digest(body);
        let hash = hex::encode(&digest[..12]);
        let mut items = Vec::new();
        let reasoning_tokens = if reasons(request) {
            let id = format!("{REASONING_PREFIX}{hash}");
            let included = request
                .get("include")
                .and_then(Value::as_array)
                .is_some_and(|include| include.iter().any(|i| i == ENCRYPTED_CONTENT));
            items.push(Item::Reasoning {
                encrypted_content: included.then(|| encrypted_content(&id)),
                id,
            });
            // A small number that varies with the request, as a model's thinking does.
            16 + u64::from(digest[12] % 48)
        } else {
            0
        };
        if !reply.pieces.is_empty() || reply.tool_calls.is_empty() {
            items.push(Item::Message {
                id: format!("{MESSAGE_PREFIX}{hash}"),
                pieces: reply.pieces.clone(),
                incomplete: reply.truncated,
            });
        }
        for (index, call) in reply.tool_calls.iter().enumerate() {
            let id = match index {
                0 => format!("{CALL_PREFIX}{hash}"),
                _ => format!("{CALL_PREFIX}{hash}_{index}"),
            };
            items.push(Item::FunctionCall {
                id,
                call: call.clone(),
            });
        }
        let output_tokens = reply.completion_tokens() + reasoning_tokens;
        Answer {
            id: format!("{RESPONSE_PREFIX}{hash}"),
            created_at: reply.created,
            items,
            incomplete: reply.truncated,
            usage: json!({
                "input_tokens": reply.prompt_tokens,
                "input_tokens_details": {"cached_tokens": reply.cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": reply.prompt_tokens + output_tokens,
            }),
        }
    }

    /// The Response object, its settings echoed from the request as the API echoes them.
    fn response(&self, request: &Map<String, Value>, stage: Stage) -> Value {
        let given = |key: &str, default: Value| match request.get(key) {
            Some(value) if !value.is_null() => value.clone(),
            _ => default,
        };
        let done = stage == Stage::Done;
        let (status, incomplete_details) = match (done, self.incomplete) {
            (false, _) => ("in_progress", Value::Null),
            (true, true) => ("incomplete", json!({"reason": "max_output_tokens"})),
            (true, false) => ("completed", Value::Null),
        };
        let effort = if reasons(request) {
            json!("medium")
        } else {
            Value::Null
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": given("background", json!(false)),
            "error": null,
            "incomplete_details": incomplete_details,
            "instructions": given("instructions", Value::Null),
            "max_output_tokens": given("max_output_tokens", Value::Null),
            "max_tool_calls": given("max_tool_calls", Value::Null),
            "model": given("model", Value::Null),
            "output": if done { self.items.iter().map(Item::done).collect() } else { Vec::new() },
            "parallel_tool_calls": given("parallel_tool_calls", json!(true)),
            "previous_response_id": given("previous_response_id", Value::Null),
            "prompt_cache_key": given("prompt_cache_key", Value::Null),
            "reasoning": given("reasoning", json!({"effort": effort, "summary": null})),
            "safety_identifier": given("safety_identifier", Value::Null),
            "service_tier": "default",
            "store": given("store", json!(true)),
            "temperature": given("temperature", json!(1.0)),
            "text": given("text", json!({"format": {"type": "text"}, "verbosity": "medium"})),
            "tool_choice": given("tool_choice", json!("auto")),
            "tools": given("tools", json!([])),
            "top_logprobs": given("top_logprobs", json!(0)),
            "top_p": given("top_p", json!(1.0)),
            "truncation": given("truncation", json!("disabled")),
            "usage": if done { self.usage.clone() } else { Value::Null },
            "user": given("user", Value::Null),
            "metadata": given("metadata", json!({})),
        })
    }

    /// The answer as the API streams it: `event: <type>` frames whose data carry the `type` and
    /// a `sequence_number` counting from 0; no `[DONE]`.
    fn events(&self, request: &Map<String, Value>) -> Vec<String> {
        let mut events = Events::default();
        let in_progress = json!({"response": self.response(request, Stage::InProgress)});
        events.push("response.created", in_progress.clone());
        events.push("response.in_progress", in_progress);
        for (output_index, item) in self.items.iter().enumerate() {
            let item_id = item.id();
            events.push(
                "response.output_item.added",
                json!({"output_index": output_index, "item": item.added()}),
            );
            match item {
                Item::Reasoning { .. } => {}
                Item::Message { pieces, .. } => {
                    let at = json!({"item_id": item_id, "output_index": output_index,
                        "content_index": 0});
                    let text = pieces.concat();
                    let part = json!({"part": output_text("")});
                    events.push_with("response.content_part.added", &at, part);
                    for piece in pieces {
                        let delta = json!({"delta": piece, "logprobs": []});
                        events.push_with("response.output_text.delta", &at, delta);
                    }
                    let done = json!({"text": text, "logprobs": []});
                    events.push_with("response.output_text.done", &at, done);
                    let part = json!({"part": output_text(&text)});
                    events.push_with("response.content_part.done", &at, part);
                }
                Item::FunctionCall { call, .. } => {
                    let at = json!({"item_id": item_id, "output_index": output_index});
                    for chunk in super::argument_chunks(&call.arguments) {
                        let delta = json!({"delta": chunk});
                        events.push_with("response.function_call_arguments.delta", &at, delta);
                    }
                    let done = json!({"name": call.name, "arguments": call.arguments});
                    events.push_with("response.function_call_arguments.done", &at, done);
                }
            }
            events.push(
                "response.output_item.done",
                json!({"output_index": output_index, "item": item.done()}),
            );
        }
        let last = if self.incomplete {
            "response.incomplete"
        } else {
            "response.completed"
        };
        events.push(
            last,
            json!({"response": self.response(request, Stage::Done)}),
        );
        events.frames
    }
}

/// Stream frames being written, numbered in order.
#[derive(Debug, Default)]
struct Events {
    frames: Vec<String>,
}

impl Events {
    /// An event of type `kind` with `fields` (an object) after its `type` and `sequence_number`.
    fn push(&mut self, kind: &str, fields: Value) {
        let mut event = Map::new();
        event.insert("type".to_owned(), json!(kind));
        event.insert("sequence_number".to_owned(), json!(self.frames.len()));
        if let Value::Object(fields) = fields {
            event.extend(fields);
        }
        let data = Value::Object(event);
        self.frames.push(format!("event: {kind}\ndata: {data}\n\n"));
    }

    /// An event at the place `at` names (item, output and content index), with `fields`.
    fn push_with(&mut self, kind: &str, at: &Value, fields: Value) {
        let mut all = at.as_object().cloned().unwrap_or_default();
        if let Value::Object(fields) = fields {
            all.extend(fields);
        }
        self.push(kind, Value::Object(all));
    }
}

#[cfg(test)]
#[path = "responses_tests.rs"]
mod tests;
