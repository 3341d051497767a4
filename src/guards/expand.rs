//! Transparent expansion, its pure parts: which stubs an answer calls, and a stream rewriter
//! that relays text as it comes, holds a tool call only until its name is known (a call of a
//! full tool goes on at once; from a stub call, or a call of a tool defined only in the
//! messages, on, the part is held: the latter's arguments are checked once whole, see
//! `guards::arguments`), and splices a re-asked answer into the same stream. The calls live in
//! `server::guarded::expand`.

use bytes::Bytes;
use serde_json::Value;

use super::arguments::{ArgumentCheck, Failed};
use super::chunk::{self, Event, event, has_delta, restamp, usage_chunk};
use super::continuation::sum_usage;
use super::stream::Relay;
use crate::openai::sse::{SseSplitter, StreamProgress, event_too_large_event};
use crate::openai::{FunctionCall, ToolCall};

/// The SSE comment that ends an expanded stream, before the names of the tools defined (headers
/// are gone by then).
pub const EXPANDED_COMMENT: &str = ": x-ctxproxy-tools-expanded: ";

/// The names of the tools in `stubs` that a JSON completion calls, in order, once each.
pub fn called_stubs(completion: &Value, stubs: &[String]) -> Vec<String> {
    let mut called = Vec::new();
    for choice in completion["choices"].as_array().into_iter().flatten() {
        let message = &choice["message"];
        let names = message["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|call| &call["function"]["name"])
            .chain([&message["function_call"]["name"]]);
        note_stubs(names, stubs, &mut called);
    }
    called
}

fn note_stubs<'a>(
    names: impl Iterator<Item = &'a Value>,
    stubs: &[String],
    called: &mut Vec<String>,
) {
    for name in names.filter_map(Value::as_str) {
        if stubs.iter().any(|s| s == name) && !called.iter().any(|c| c == name) {
            called.push(name.to_owned());
        }
    }
}

/// The final JSON answer of an expansion: `last`, with the usage of every answer asked.
pub fn with_usage_of(mut last: Value, earlier: &[Value]) -> Value {
    let mut usage = last.get("usage").cloned();
    for answer in earlier {
        if let Some(used) = answer.get("usage").filter(|u| u.is_object()) {
            usage = Some(match usage {
                Some(sum) => sum_usage(&sum, used),
                None => used.clone(),
            });
        }
    }
    if let (Some(usage), Some(object)) = (usage, last.as_object_mut()) {
        object.insert("usage".into(), usage);
    }
    last
}

/// A whole function call, as the re-ask reads a held one.
pub(crate) fn tool_call(id: &str, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: id.to_owned(),
        kind: Some("function".to_owned()),
        function: FunctionCall {
            name: name.to_owned(),
            arguments: arguments.to_owned(),
            extra: Default::default(),
        },
        extra: Default::default(),
    }
}

/// Whether a re-asked part's call of `name` (the part's calls started so far: `started`, to
/// which it is added) repeats one the client already has (`had`): a re-asked answer's first
/// calls of a tool, as many as the client got, are the calls it repeats.
pub(crate) fn repeats(had: &[String], started: &mut Vec<String>, name: &str) -> bool {
    let had = had.iter().filter(|n| *n == name).count();
    let again = started.iter().filter(|n| *n == name).count();
    started.push(name.to_owned());
    again < had
}

/// Adds a part's `usage` to the sum of every part's.
pub(crate) fn add_usage(sum: &mut Option<Value>, usage: &Value) {
    *sum = Some(match sum.take() {
        Some(sum) => sum_usage(&sum, usage),
        None => usage.clone(),
    });
}

/// How a part of a streamed answer ended.
#[derive(Debug, PartialEq, Eq)]
pub enum PartEnd {
    /// The answer called these stubs: ask again with them defined, then call
    /// [`ExpandStream::re_asked`]. Nothing of the part's tool calls was relayed.
    ReAsk(Vec<String>),
    /// The answer called no stub, but tools defined only in the messages with arguments that
    /// fail their schema: ask again with them in full in the block, then call
    /// [`ExpandStream::re_asked`]. Nothing of the part's held calls was relayed.
    Invalid(Failed),
    /// The answer is over: the held tool calls, the usage of every part and `[DONE]`.
    Done(Vec<Bytes>),
}

/// A held tool call, from its streamed deltas.
#[derive(Debug, Default)]
struct HeldCall {
    index: u64,
    id: String,
    name: String,
    arguments: String,
}

/// Where the deltas of one streamed tool call go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallRoute {
    /// To the client, under this index.
    Relay(u64),
    /// Held until the part ends (a stub's call, a checked one, or any call after it), then
    /// to the client under this index.
    Hold(u64),
    /// Nowhere: a re-asked answer's repeat of a call the client already has.
    Drop,
}

/// One streamed answer made of the upstream's first answer and its re-asks.
pub struct ExpandStream {
    /// The tools the request being answered offers as stubs.
    stubs: Vec<String>,
    /// The tools it defines only in its messages: their calls are held and checked.
    arguments: ArgumentCheck,
    max_event: usize,
    splitter: SseSplitter,
    /// 0 for the first answer, then one per re-ask.
    part: u32,
    /// `id`, `created`, `model` of the first chunk: later parts carry them.
    head: Option<Value>,
    /// The text that went to the client: a re-asked answer adds only what goes beyond it.
    said: String,
    /// The text of the re-asked part, held while the client may already have it.
    reasked: String,
    /// The client has had the answer's `role`; this part's chunks carry it.
    role_relayed: bool,
    role_in_part: bool,
    /// Events held until the part ends: from a stub call (or a call whose name does not come
    /// with its start) on, and, while `holding_whole`, every event of the part.
    held: Vec<Bytes>,
    holding: bool,
    /// A re-asked part whose text may repeat what the client has: held whole, its text is
    /// known only at its end.
    holding_whole: bool,
    called: Vec<String>,
    /// The calls of this part that are held, as assembled from their deltas.
    held_calls: Vec<HeldCall>,
    /// This part's tool calls by the upstream's index, and where each goes.
    calls: Vec<(u64, CallRoute)>,
    /// The names of the tool calls relayed or held so far over every part, by the client's
    /// index ("" for a call whose name did not come with its start).
    relayed: Vec<String>,
    /// How many of them the client had when this part started, and where this part's held
    /// calls start.
    relayed_before_part: usize,
    held_from: Option<usize>,
    /// The names of the calls this part started. A re-asked part's first calls of a tool,
    /// as many as the client already has, repeat those: they are dropped.
    started: Vec<String>,
    /// The first part's usage event as it came, and the usage of every part.
    usage_event: Option<Bytes>,
    usage: Option<Value>,
    done: bool,
    /// How the current part is ending, from its events.
    progress: StreamProgress,
}

impl ExpandStream {
    pub fn new(stubs: Vec<String>, max_event: usize) -> ExpandStream {
        ExpandStream {
            stubs,
            arguments: ArgumentCheck::default(),
            max_event,
            splitter: SseSplitter::with_max_event(max_event),
            part: 0,
            head: None,
            said: String::new(),
            reasked: String::new(),
            role_relayed: false,
            role_in_part: false,
            held: Vec::new(),
            holding: false,
            holding_whole: false,
            called: Vec::new(),
            held_calls: Vec::new(),
            calls: Vec::new(),
            relayed: Vec::new(),
            relayed_before_part: 0,
            held_from: None,
            started: Vec::new(),
            usage_event: None,
            usage: None,
            done: false,
            progress: StreamProgress::default(),
        }
    }

    /// The argument checks of the request being answered (empty: no call is checked); after
    /// a re-ask, what its request defines only in the messages.
    pub fn arguments(&mut self) -> &mut ArgumentCheck {
        &mut self.arguments
    }

    /// Takes bytes of the current part's body as they came.
    pub fn push(&mut self, data: &[u8]) -> Relay {
        self.splitter.push(data);
        let mut out = Vec::new();
        loop {
            match self.splitter.next_event() {
                Ok(Some(raw)) => self.relay_event(raw, &mut out),
                Ok(None) => return Relay::Events(out),
                Err(too_large) => return Relay::TooLarge(event_too_large_event(too_large)),
            }
        }
    }

    /// The current part's body ended.
    pub fn end_part(&mut self) -> PartEnd {
        let mut out = Vec::new();
        if let Some(raw) = self.splitter.finish() {
            self.relay_event(raw, &mut out);
        }
        if self.progress.failed() {
            // The client was told the answer failed: no call of it, stub or not, follows.
            self.held.clear();
        } else if !self.called.is_empty() {
            self.asking_again();
            return PartEnd::ReAsk(std::mem::take(&mut self.called));
        } else if let Some(failed) = self.failing_calls() {
            self.asking_again();
            return PartEnd::Invalid(failed);
        }
        if let Some(extra) = self.beyond_said() {
            out.push(extra);
        }
        self.role_relayed |= self.role_in_part;
        out.append(&mut self.held);
        if self.part == 0 {
            out.extend(self.usage_event.take());
        } else if let (Some(usage), Some(head)) = (self.usage.take(), &self.head) {
            out.push(event(&usage_chunk(head, usage)));
        }
        if self.done {
            out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        }
        PartEnd::Done(out)
    }

    /// The part is asked again: its held calls never went out (nor anything of it, held
    /// whole), and the re-asked part's calls take their indices.
    fn asking_again(&mut self) {
        let kept = if self.holding_whole {
            Some(self.relayed_before_part)
        } else {
            self.held_from
        };
        if let Some(kept) = kept {
            self.relayed.truncate(kept);
        }
    }

    /// The checked tools whose held calls fail their schema.
    fn failing_calls(&mut self) -> Option<Failed> {
        if self.arguments.is_empty() {
            return None;
        }
        let calls = self
            .held_calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()));
        self.arguments.failing(calls)
    }

    /// The re-asked answer is arriving; `stubs`: what its request still offers as stubs.
    pub fn re_asked(&mut self, stubs: Vec<String>) {
        self.stubs = stubs;
        self.splitter = SseSplitter::with_max_event(self.max_event);
        self.part += 1;
        self.held.clear();
        self.reasked.clear();
        self.role_in_part = false;
        self.calls.clear();
        self.held_calls.clear();
        self.relayed_before_part = self.relayed.len();
        self.held_from = None;
        self.started.clear();
        // Once text went out, a re-asked part is held whole: its text is known only at its end.
        self.holding_whole = !self.said.is_empty();
        self.holding = false;
        self.usage_event = None;
        self.done = false;
        self.progress = StreamProgress::default();
    }

    /// How the current part is ending, from its events (after [`ExpandStream::end_part`]: how
    /// it ended).
    pub fn progress(&self) -> &StreamProgress {
        &self.progress
    }

    fn relay_event(&mut self, raw: Bytes, out: &mut Vec<Bytes>) {
        // `[DONE]` ended the part: nothing after it is the answer's.
        if self.progress.done() {
            return;
        }
        self.progress.see(&raw);
        let mut chunk = match chunk::read(&raw) {
            Event::Done => {
                self.done = true;
                return;
            }
            Event::Chunk(chunk) => chunk,
            Event::Other => {
                // An error event ends the answer for the client: nothing is asked again.
                out.push(raw);
                return;
            }
        };
        if self.add_usage(&chunk, &raw) {
            return;
        }
        // Usage on a chunk with choices (some providers end so): summed like a usage chunk;
        // a re-asked part's goes out once, summed, at the part's end.
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.sum_usage(usage);
            if self.part > 0
                && let Some(object) = chunk.as_object_mut()
            {
                object.remove("usage");
            }
        }
        // The head comes from a chunk with a choice (a provider may open with an empty one).
        let has_choice = chunk["choices"].as_array().is_some_and(|c| !c.is_empty());
        if self.head.is_none() && has_choice {
            let mut head = chunk.clone();
            if let Some(head) = head.as_object_mut() {
                head.remove("choices");
                head.remove("usage");
            }
            self.head = Some(head);
        }
        let held_calls = self.route_calls(&mut chunk);
        let mut rewritten = !held_calls.is_empty();
        let relayed = if self.part == 0 && !self.calls_renumbered() && !rewritten {
            raw
        } else {
            if self.part > 0 {
                if let Some(head) = &self.head {
                    restamp(&mut chunk, head);
                }
                if !self.said.is_empty() {
                    self.reasked.push_str(&take_text(&mut chunk));
                }
                if !self.role_relayed && !self.role_in_part && has_choice {
                    set_role(&mut chunk);
                    self.role_in_part = true;
                }
                rewritten = true;
            }
            let finishes = !chunk["choices"][0]["finish_reason"].is_null();
            if rewritten && !has_delta(&chunk) && !finishes && held_calls.is_empty() {
                return;
            }
            event(&chunk)
        };
        if self.holding_whole {
            self.held.push(relayed);
            return;
        }
        if self.holding {
            // Calls already relayed go on; the rest waits for the part's end.
            let (now, rest) = split_calls(chunk, held_calls);
            if let Some(now) = now {
                self.role_relayed |= !now["choices"][0]["delta"]["role"].is_null();
                out.push(event(&now));
            }
            self.held.extend(rest.map(|rest| event(&rest)));
            return;
        }
        if let Some(text) = chunk["choices"][0]["delta"]["content"].as_str() {
            self.said.push_str(text);
        }
        self.role_relayed |= !chunk["choices"][0]["delta"]["role"].is_null();
        out.push(relayed);
    }

    /// Routes the tool-call deltas of a chunk's first choice: a call whose name says it is a
    /// full tool is relayed (under the client's index), one of a stub starts holding the part,
    /// one that repeats a call the client already has is dropped. The chunk keeps the deltas
    /// relayed; the others are returned, to hold, when the part is holding.
    fn route_calls(&mut self, chunk: &mut Value) -> Vec<Value> {
        // Legacy `function_call`: one call, its name in its first delta.
        if let Some(name) = chunk["choices"][0]["delta"]["function_call"]["name"].as_str() {
            let name = name.to_owned();
            self.hold_if_stub(&name);
            return Vec::new();
        }
        let Some(deltas) = chunk
            .pointer_mut("/choices/0/delta/tool_calls")
            .and_then(Value::as_array_mut)
            .map(std::mem::take)
        else {
            return Vec::new();
        };
        let (mut relay, mut hold) = (Vec::new(), Vec::new());
        for mut delta in deltas {
            let index = delta["index"].as_u64().unwrap_or(0);
            let known = self.calls.iter().find(|(i, _)| *i == index).map(|c| c.1);
            let route = known.unwrap_or_else(|| {
                let route = self.route_new_call(delta["function"]["name"].as_str());
                self.calls.push((index, route));
                route
            });
            match route {
                CallRoute::Relay(client_index) => {
                    delta["index"] = Value::from(client_index);
                    relay.push(delta);
                }
                CallRoute::Hold(client_index) => {
                    self.assemble(index, &delta);
                    delta["index"] = Value::from(client_index);
                    hold.push(delta);
                }
                CallRoute::Drop => {}
            }
        }
        if self.holding_whole {
            // The whole part goes out at its end, in order.
            relay.append(&mut hold);
        }
        let delta = &mut chunk["choices"][0]["delta"];
        if !relay.is_empty() {
            delta["tool_calls"] = Value::Array(relay);
        } else if let Some(delta) = delta.as_object_mut() {
            delta.remove("tool_calls");
        }
        hold
    }

    /// Adds a held call's delta to the call it builds.
    fn assemble(&mut self, index: u64, delta: &Value) {
        let at = match self.held_calls.iter().position(|c| c.index == index) {
            Some(at) => at,
            None => {
                self.held_calls.push(HeldCall {
                    index,
                    ..HeldCall::default()
                });
                self.held_calls.len() - 1
            }
        };
        let call = &mut self.held_calls[at];
        if let Some(id) = delta["id"].as_str() {
            call.id.push_str(id);
        }
        let function = &delta["function"];
        if let Some(name) = function["name"].as_str() {
            call.name.push_str(name);
        }
        if let Some(arguments) = function["arguments"].as_str() {
            call.arguments.push_str(arguments);
        }
    }

    /// The held calls of the tool `name` of the part that just ended, as whole calls.
    pub fn held_calls_of(&self, name: &str) -> Vec<ToolCall> {
        self.held_calls
            .iter()
            .filter(|c| c.name == name)
            .map(|c| tool_call(&c.id, &c.name, &c.arguments))
            .collect()
    }

    /// Where a call this part starts goes, by its name.
    fn route_new_call(&mut self, name: Option<&str>) -> CallRoute {
        let Some(name) = name else {
            // A call whose name does not come with its start: held, as everything after it.
            self.holding = true;
            return self.next_call(String::new());
        };
        if self.hold_if_stub(name) {
            return self.next_call(name.to_owned());
        }
        if self.part > 0
            && repeats(
                &self.relayed[..self.relayed_before_part],
                &mut self.started,
                name,
            )
        {
            return CallRoute::Drop;
        }
        if self.arguments.checks(name) {
            // Held until its arguments can be checked, as everything after it.
            self.holding = true;
        }
        self.next_call(name.to_owned())
    }

    /// The client's index of a call this part starts: relayed, or held while the part holds.
    fn next_call(&mut self, name: String) -> CallRoute {
        let client_index = self.relayed.len();
        self.relayed.push(name);
        let index = client_index as u64;
        if self.holding {
            self.held_from.get_or_insert(client_index);
            CallRoute::Hold(index)
        } else {
            CallRoute::Relay(index)
        }
    }

    /// A call of the stub `name` holds the part from here on; whether `name` is a stub.
    fn hold_if_stub(&mut self, name: &str) -> bool {
        let stub = self.stubs.iter().any(|s| s == name);
        if stub {
            if !self.called.iter().any(|c| c == name) {
                self.called.push(name.to_owned());
            }
            self.holding = true;
        }
        stub
    }

    /// Some call of this part goes to the client under another index than the upstream's.
    fn calls_renumbered(&self) -> bool {
        self.calls
            .iter()
            .any(|(index, route)| matches!(route, CallRoute::Relay(c) if c != index))
    }

    /// The re-asked part's text beyond what the client already has, as a chunk; a re-ask that
    /// says something else is relayed from where it parts from what was said.
    fn beyond_said(&mut self) -> Option<Bytes> {
        let shared = self
            .said
            .char_indices()
            .zip(self.reasked.chars())
            .find(|((_, a), b)| a != b)
            .map_or(self.said.len().min(self.reasked.len()), |((i, _), _)| i);
        let extra = self
            .reasked
            .get(shared..)
            .filter(|e| !e.is_empty())?
            .to_owned();
        self.said.push_str(&extra);
        let mut chunk = self.head.clone()?;
        chunk.as_object_mut()?.insert(
            "choices".into(),
            serde_json::json!([{"index": 0, "delta": {"content": extra}, "finish_reason": null}]),
        );
        Some(event(&chunk))
    }

    /// Sums a usage-only chunk into the usage sent at the end; whether it was one.
    fn add_usage(&mut self, chunk: &Value, raw: &Bytes) -> bool {
        let no_choices = chunk["choices"].as_array().is_some_and(Vec::is_empty);
        let Some(usage) = chunk.get("usage").filter(|u| no_choices && u.is_object()) else {
            return false;
        };
        self.sum_usage(usage);
        self.usage_event = Some(raw.clone());
        true
    }

    /// Adds `usage` to the usage of every part.
    fn sum_usage(&mut self, usage: &Value) {
        add_usage(&mut self.usage, usage);
    }
}

/// A chunk of a holding part, split: its relayed tool-call deltas, with the role if it has one
/// (to relay now), and the rest with the `held` deltas (to hold), each when it says anything.
fn split_calls(chunk: Value, held: Vec<Value>) -> (Option<Value>, Option<Value>) {
    let mut now = chunk.clone();
    if let Some(now) = now.as_object_mut() {
        now.remove("usage");
    }
    let mut rest = chunk;
    let calls = rest
        .pointer_mut("/choices/0/delta")
        .and_then(Value::as_object_mut)
        .map(|delta| (delta.remove("tool_calls"), delta.remove("role")));
    if let Some(choice) = now.pointer_mut("/choices/0").and_then(Value::as_object_mut) {
        let (calls, role) = calls.unwrap_or_default();
        let mut delta = serde_json::Map::new();
        delta.extend(role.map(|role| ("role".to_owned(), role)));
        delta.extend(calls.map(|calls| ("tool_calls".to_owned(), calls)));
        choice.insert("delta".into(), Value::Object(delta));
        choice.insert("finish_reason".into(), Value::Null);
    }
    if !held.is_empty()
        && let Some(delta) = rest
            .pointer_mut("/choices/0/delta")
            .and_then(Value::as_object_mut)
    {
        delta.insert("tool_calls".into(), Value::Array(held));
    }
    let now = has_delta(&now).then_some(now);
    let says = has_delta(&rest) || !rest["choices"][0]["finish_reason"].is_null();
    (now, says.then_some(rest))
}

/// A re-asked chunk's text, taken out of it (it goes out at the part's end, without what the
/// client already has).
fn take_text(chunk: &mut Value) -> String {
    chunk
        .pointer_mut("/choices/0/delta")
        .and_then(Value::as_object_mut)
        .and_then(|delta| delta.remove("content"))
        .and_then(|text| text.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The role on a re-asked chunk, when the client has had none (the first answer's role came
/// with the stub call it did not get).
fn set_role(chunk: &mut Value) {
    if let Some(delta) = chunk
        .pointer_mut("/choices/0/delta")
        .and_then(Value::as_object_mut)
    {
        delta.insert("role".into(), Value::from("assistant"));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chunk(id: &str, delta: Value, finish: Option<&str>) -> String {
        let chunk = json!({"id": id, "object": "chat.completion.chunk", "created": 1,
            "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {chunk}\n\n")
    }

    fn call(name: &str, arguments: &str) -> Value {
        json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
            "function": {"name": name, "arguments": arguments}}]})
    }

    fn usage(id: &str, prompt: u64, completion: u64) -> String {
        let chunk = json!({"id": id, "object": "chat.completion.chunk", "created": 1,
            "model": "m", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}});
        format!("data: {chunk}\n\n")
    }

    const DONE: &str = "data: [DONE]\n\n";

    fn text_of(events: &[Bytes]) -> String {
        events
            .iter()
            .map(|e| String::from_utf8_lossy(e).into_owned())
            .collect()
    }

    fn relayed(relay: Relay) -> Vec<Bytes> {
        match relay {
            Relay::Events(events) => events,
            Relay::TooLarge(error) => panic!("too large: {error:?}"),
        }
    }

    /// What the client gets of `first`, which calls the stub, then of its re-ask `second`.
    fn first_then_re_asked(first: &str, second: &str) -> Vec<Bytes> {
        let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
        let mut out = relayed(stream.push(first.as_bytes()));
        assert_eq!(stream.end_part(), PartEnd::ReAsk(vec!["stubbed".into()]));
        stream.re_asked(Vec::new());
        out.extend(relayed(stream.push(second.as_bytes())));
        let PartEnd::Done(rest) = stream.end_part() else {
            panic!("the re-asked answer calls no stub");
        };
        out.extend(rest);
        out
    }

    #[test]
    fn a_role_that_came_with_the_stub_call_comes_with_the_re_asked_one() {
        let first = [
            chunk(
                "a",
                json!({"role": "assistant", "content": null,
                "tool_calls": [{"index": 0, "id": "c1", "type": "function",
                    "function": {"name": "stubbed", "arguments": "{}"}}]}),
                None,
            ),
            chunk("a", json!({}), Some("tool_calls")),
            DONE.to_owned(),
        ]
        .concat();
        let second = [
            chunk(
                "b",
                json!({"role": "assistant", "content": null,
                "tool_calls": [{"index": 0, "id": "c2", "type": "function",
                    "function": {"name": "stubbed", "arguments": "{\"id\":\"7\"}"}}]}),
                None,
            ),
            chunk("b", json!({}), Some("tool_calls")),
            DONE.to_owned(),
        ]
        .concat();
        let out = text_of(&first_then_re_asked(&first, &second));
        let roles = out.matches("\"role\":\"assistant\"").count();
        assert_eq!(roles, 1, "{out}");
        assert!(out.contains("\"id\":\"c2\""), "the re-asked call: {out}");
    }

    #[test]
    fn a_re_ask_that_says_more_than_the_client_has_adds_the_rest() {
        let first = [
            chunk("a", json!({"role": "assistant", "content": ""}), None),
            chunk("a", json!({"content": "Let me check."}), None),
            chunk("a", call("stubbed", "{}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            DONE.to_owned(),
        ]
        .concat();
        let second = [
            chunk("b", json!({"role": "assistant", "content": ""}), None),
            chunk("b", json!({"content": "Let me check."}), None),
            chunk("b", json!({"content": " What is your order number?"}), None),
            chunk("b", json!({}), Some("stop")),
            DONE.to_owned(),
        ]
        .concat();
        let out = first_then_re_asked(&first, &second);
        let said: String = out
            .iter()
            .filter_map(|e| {
                let text = String::from_utf8_lossy(e);
                let payload = text.strip_prefix("data: ")?.trim().to_owned();
                let chunk: Value = serde_json::from_str(&payload).ok()?;
                chunk["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(said, "Let me check. What is your order number?");
        assert!(text_of(&out).contains("\"finish_reason\":\"stop\""));
    }

    #[test]
    fn a_part_ends_at_its_done_and_an_unterminated_last_event_is_not_relayed() {
        let first = [
            chunk("a", json!({"role": "assistant", "content": ""}), None),
            chunk("a", call("stubbed", "{}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            DONE.to_owned(),
        ]
        .concat();
        let answer = [
            chunk("b", json!({"content": "Sunny."}), None),
            chunk("b", json!({}), Some("stop")),
            usage("b", 5, 3),
        ]
        .concat();
        let whole = |out: &str| {
            out.split_terminator("\n\n").all(|event| {
                let data = event.strip_prefix("data: ").unwrap_or("{}");
                data == "[DONE]" || serde_json::from_str::<Value>(data).is_ok()
            })
        };
        // `[DONE]` with a space after it, then what an upstream should not send after it.
        let late = chunk("b", json!({"content": "late"}), None);
        let second = format!("{answer}data: [DONE] \n\n{late}");
        let out = text_of(&first_then_re_asked(&first, &second));
        assert!(out.ends_with(DONE), "{out}");
        assert!(!out.contains("late") && whole(&out), "{out}");
        // Cut in the middle of its last event: that half is not relayed.
        let out = text_of(&first_then_re_asked(&first, &format!("{answer}data: [DO")));
        assert!(!out.contains("[DO") && whole(&out), "{out}");
        assert!(out.contains("\"Sunny.\""), "{out}");
    }

    #[test]
    fn after_an_error_event_nothing_is_asked_again_nor_any_call_relayed() {
        let error = "data: {\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}\n\n";
        let part = [
            chunk("a", json!({"role": "assistant", "content": ""}), None),
            chunk("a", call("stubbed", "{}"), None),
            error.to_owned(),
        ]
        .concat();
        let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
        let out = relayed(stream.push(part.as_bytes()));
        assert!(text_of(&out).ends_with(error), "{}", text_of(&out));
        let PartEnd::Done(rest) = stream.end_part() else {
            panic!("asked again after an error");
        };
        assert!(text_of(&rest).is_empty(), "{}", text_of(&rest));
    }

    #[test]
    fn a_json_answer_names_the_stubs_it_calls() {
        let answer = json!({"choices": [{"message": {"tool_calls": [
            {"function": {"name": "full_one", "arguments": "{}"}},
            {"function": {"name": "stubbed", "arguments": "{}"}},
            {"function": {"name": "stubbed", "arguments": "{}"}}]}}]});
        let stubs = ["stubbed".to_owned(), "other".to_owned()];
        assert_eq!(called_stubs(&answer, &stubs), ["stubbed"]);
        assert!(
            called_stubs(
                &json!({"choices": [{"message": {"content": "hi"}}]}),
                &stubs
            )
            .is_empty()
        );
    }

    #[test]
    fn usage_is_summed_over_every_answer_asked() {
        let first =
            json!({"usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}});
        let last = json!({"id": "b", "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}});
        let merged = with_usage_of(last, &[first]);
        assert_eq!(merged["id"], "b");
        assert_eq!(
            merged["usage"],
            json!({"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26})
        );
    }

    #[test]
    fn an_answer_without_a_stub_call_goes_out_byte_for_byte() {
        let text = [
            chunk("a", json!({"role": "assistant", "content": ""}), None),
            chunk("a", json!({"content": "Hi"}), None),
        ]
        .concat();
        let calls = [
            chunk("a", call("full_one", "{\"x\":1}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            usage("a", 5, 3),
            DONE.to_owned(),
        ]
        .concat();
        let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
        // Text and a call of a full tool go at once; usage and [DONE] at the part's end.
        let out = relayed(stream.push([text.as_str(), &calls].concat().as_bytes()));
        assert_eq!(
            text_of(&out),
            [text.as_str(), &calls]
                .concat()
                .replace(&usage("a", 5, 3), "")
                .replace(DONE, "")
        );
        let PartEnd::Done(rest) = stream.end_part() else {
            panic!("no stub was called");
        };
        assert_eq!(text_of(&rest), [usage("a", 5, 3), DONE.to_owned()].concat());
    }

    /// A call's delta of the upstream's index `index`, with its start when `name` is given.
    fn call_delta(index: u64, name: Option<&str>, arguments: &str) -> Value {
        let mut call = json!({"index": index, "function": {"arguments": arguments}});
        if let Some(name) = name {
            call["id"] = json!(format!("call_{index}"));
            call["type"] = json!("function");
            call["function"]["name"] = json!(name);
        }
        json!({"tool_calls": [call]})
    }

    #[test]
    fn a_full_tools_call_goes_out_as_soon_as_its_name_is_known() {
        let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
        let start = chunk("a", call_delta(0, Some("full_one"), ""), None);
        assert_eq!(text_of(&relayed(stream.push(start.as_bytes()))), start);
        let more = chunk("a", call_delta(0, None, "{\"x\":"), None);
        assert_eq!(text_of(&relayed(stream.push(more.as_bytes()))), more);
        let end = [
            chunk("a", call_delta(0, None, "1}"), None),
            chunk("a", json!({}), Some("tool_calls")),
        ]
        .concat();
        assert_eq!(text_of(&relayed(stream.push(end.as_bytes()))), end);
        assert_eq!(stream.end_part(), PartEnd::Done(Vec::new()));
    }

    #[test]
    fn a_stub_called_beside_a_relayed_call_adds_only_the_re_asked_stub_call() {
        let first = [
            chunk("a", json!({"role": "assistant", "content": null}), None),
            chunk("a", call_delta(0, Some("full_one"), "{\"x\":1}"), None),
            chunk("a", call_delta(1, Some("stubbed"), ""), None),
            chunk("a", call_delta(1, None, "{}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            usage("a", 5, 3),
            DONE.to_owned(),
        ]
        .concat();
        let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
        let out = text_of(&relayed(stream.push(first.as_bytes())));
        // The full tool's call went out; nothing of the stub's.
        assert_eq!(
            out,
            [
                chunk("a", json!({"role": "assistant", "content": null}), None),
                chunk("a", call_delta(0, Some("full_one"), "{\"x\":1}"), None),
            ]
            .concat()
        );
        assert_eq!(stream.end_part(), PartEnd::ReAsk(vec!["stubbed".into()]));
        stream.re_asked(Vec::new());
        // The re-asked answer repeats the first call, with other arguments, and calls the tool
        // now defined.
        let second = [
            chunk("b", json!({"role": "assistant", "content": null}), None),
            chunk("b", call_delta(0, Some("full_one"), "{\"x\":2}"), None),
            chunk("b", call_delta(1, Some("stubbed"), "{\"id\":\"7\"}"), None),
            chunk("b", json!({}), Some("tool_calls")),
            usage("b", 9, 4),
            DONE.to_owned(),
        ]
        .concat();
        let mut out = relayed(stream.push(second.as_bytes()));
        let PartEnd::Done(rest) = stream.end_part() else {
            panic!("the re-asked answer calls no stub");
        };
        out.extend(rest);
        let expected = [
            // Under the first answer's id and at the next index; the repeat is dropped.
            chunk("a", call_delta(1, Some("stubbed"), "{\"id\":\"7\"}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            // One usage, summed over both answers.
            usage("a", 14, 7),
            DONE.to_owned(),
        ]
        .concat();
        assert_eq!(text_of(&out), expected);
    }

    #[test]
    fn a_stub_called_after_text_is_replaced_by_the_re_asked_call_in_the_same_stream() {
        let first = [
            chunk("a", json!({"role": "assistant", "content": ""}), None),
            chunk("a", json!({"content": "Let me check."}), None),
            chunk("a", call("stubbed", "{}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            usage("a", 5, 3),
            DONE.to_owned(),
        ]
        .concat();
        let second = [
            chunk("b", json!({"role": "assistant", "content": ""}), None),
            chunk("b", json!({"content": "Let me check."}), None),
            chunk("b", call("stubbed", "{\"id\":\"7\"}"), None),
            chunk("b", json!({}), Some("tool_calls")),
            usage("b", 9, 4),
            DONE.to_owned(),
        ]
        .concat();
        let out = first_then_re_asked(&first, &second);
        let expected = [
            chunk("a", json!({"role": "assistant", "content": ""}), None),
            chunk("a", json!({"content": "Let me check."}), None),
            // The re-asked call, under the first answer's id, its text left out.
            chunk("a", call("stubbed", "{\"id\":\"7\"}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            // One usage, summed over both answers.
            usage("a", 14, 7),
            DONE.to_owned(),
        ]
        .concat();
        assert_eq!(text_of(&out), expected);
    }

    #[test]
    fn usage_on_a_chunk_with_choices_is_summed_too() {
        let with_usage = |id: &str, prompt: u64, completion: u64| {
            let chunk = json!({"id": id, "object": "chat.completion.chunk", "created": 1,
                "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                    "total_tokens": prompt + completion}});
            format!("data: {chunk}\n\n")
        };
        let first = [
            chunk("a", call("stubbed", "{}"), None),
            with_usage("a", 5, 3),
            DONE.to_owned(),
        ]
        .concat();
        let second = [
            chunk("b", call("stubbed", "{\"id\":\"7\"}"), None),
            with_usage("b", 9, 4),
            DONE.to_owned(),
        ]
        .concat();
        let out = text_of(&first_then_re_asked(&first, &second));
        // One usage, summed, and it comes last.
        assert_eq!(out.matches("\"usage\"").count(), 1, "{out}");
        assert!(
            out.contains(r#""usage":{"prompt_tokens":14,"completion_tokens":7,"total_tokens":21}"#),
            "{out}"
        );
        assert!(out.contains("\"finish_reason\":\"tool_calls\""), "{out}");
    }

    #[test]
    fn a_stub_called_first_lets_the_re_asked_answer_speak() {
        let first = [
            chunk("a", json!({"role": "assistant"}), None),
            chunk("a", call("stubbed", "{}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            DONE.to_owned(),
        ]
        .concat();
        let second = [
            chunk("b", json!({"role": "assistant"}), None),
            chunk("b", json!({"content": "Which order?"}), None),
            chunk("b", json!({}), Some("stop")),
            DONE.to_owned(),
        ]
        .concat();
        let out = first_then_re_asked(&first, &second);
        let expected = [
            chunk("a", json!({"role": "assistant"}), None),
            chunk("a", json!({"content": "Which order?"}), None),
            chunk("a", json!({}), Some("stop")),
            DONE.to_owned(),
        ]
        .concat();
        assert_eq!(text_of(&out), expected);
    }

    /// A rewriter whose request defines `get_weather` only in its messages (checked against
    /// its schema) and offers `full_one` in full.
    fn checking() -> ExpandStream {
        let client: Vec<crate::openai::Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}},
            {"type": "function", "function": {"name": "full_one", "parameters": {
                "type": "object", "properties": {"x": {"type": "integer"}},
                "required": ["x"]}}}
        ]))
        .unwrap();
        let mut stream = ExpandStream::new(Vec::new(), 1 << 20);
        stream
            .arguments()
            .watch(&client, &["get_weather".to_owned()]);
        stream
    }

    #[test]
    fn a_call_of_a_tool_defined_in_the_messages_is_held_until_its_arguments_pass() {
        let mut stream = checking();
        let start = chunk("a", call_delta(0, Some("get_weather"), ""), None);
        assert!(relayed(stream.push(start.as_bytes())).is_empty());
        let rest = [
            chunk("a", call_delta(0, None, "{\"city\":"), None),
            chunk("a", call_delta(0, None, "\"Paris\"}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            DONE.to_owned(),
        ]
        .concat();
        assert!(relayed(stream.push(rest.as_bytes())).is_empty());
        let PartEnd::Done(out) = stream.end_part() else {
            panic!("the arguments pass");
        };
        let streamed = text_of(&out);
        assert!(streamed.contains("get_weather"), "{streamed}");
        assert!(
            streamed.contains("Paris") && streamed.ends_with(DONE),
            "{streamed}"
        );
    }

    #[test]
    fn a_call_that_fails_its_schema_is_asked_again_and_the_re_asked_call_spliced() {
        let mut stream = checking();
        let first = [
            chunk("a", json!({"role": "assistant", "content": null}), None),
            chunk("a", call_delta(0, Some("get_weather"), "{}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            usage("a", 5, 3),
            DONE.to_owned(),
        ]
        .concat();
        let out = text_of(&relayed(stream.push(first.as_bytes())));
        assert!(!out.contains("get_weather"), "{out}");
        assert_eq!(
            stream.end_part(),
            PartEnd::Invalid(Failed {
                tools: vec!["get_weather".into()],
                unread: true
            })
        );
        stream.re_asked(Vec::new());
        // Asked again with the tool in the block: nothing is checked any more.
        stream.arguments().watch(&[], &[]);
        let second = [
            chunk("b", json!({"role": "assistant", "content": null}), None),
            chunk(
                "b",
                call_delta(0, Some("get_weather"), "{\"city\":\"Paris\"}"),
                None,
            ),
            chunk("b", json!({}), Some("tool_calls")),
            usage("b", 9, 4),
            DONE.to_owned(),
        ]
        .concat();
        let mut out = relayed(stream.push(second.as_bytes()));
        let PartEnd::Done(rest) = stream.end_part() else {
            panic!("nothing left to check");
        };
        out.extend(rest);
        let out = text_of(&out);
        assert_eq!(out.matches("get_weather").count(), 1, "{out}");
        assert!(out.contains(r#"{\"city\":\"Paris\"}"#), "{out}");
        assert!(
            out.contains(r#""prompt_tokens":14"#),
            "usage of both: {out}"
        );
        // The role went out with the first part.
        assert!(!out.contains("\"role\""), "{out}");
    }

    #[test]
    fn a_full_tools_call_is_relayed_at_once_and_never_checked() {
        let mut stream = checking();
        // Its arguments fail its schema: the model's answer, the client's business.
        let part = [
            chunk("a", call_delta(0, Some("full_one"), "{}"), None),
            chunk("a", json!({}), Some("tool_calls")),
        ]
        .concat();
        assert_eq!(text_of(&relayed(stream.push(part.as_bytes()))), part);
        assert_eq!(stream.end_part(), PartEnd::Done(Vec::new()));
    }

    #[test]
    fn a_call_held_behind_a_failing_one_is_not_taken_for_a_repeat() {
        let mut stream = checking();
        let first = [
            chunk("a", call_delta(0, Some("full_one"), "{\"x\":1}"), None),
            chunk("a", call_delta(1, Some("get_weather"), "{}"), None),
            chunk("a", call_delta(2, Some("full_one"), "{\"x\":2}"), None),
            chunk("a", json!({}), Some("tool_calls")),
            DONE.to_owned(),
        ]
        .concat();
        let out = text_of(&relayed(stream.push(first.as_bytes())));
        // Only the call before the checked one went out.
        assert!(
            out.contains("{\\\"x\\\":1}") && !out.contains("{\\\"x\\\":2}"),
            "{out}"
        );
        assert!(matches!(stream.end_part(), PartEnd::Invalid(_)));
        stream.re_asked(Vec::new());
        stream.arguments().watch(&[], &[]);
        let second = [
            chunk("b", call_delta(0, Some("full_one"), "{\"x\":1}"), None),
            chunk(
                "b",
                call_delta(1, Some("get_weather"), "{\"city\":\"Paris\"}"),
                None,
            ),
            chunk("b", call_delta(2, Some("full_one"), "{\"x\":2}"), None),
            chunk("b", json!({}), Some("tool_calls")),
            DONE.to_owned(),
        ]
        .concat();
        let mut out = relayed(stream.push(second.as_bytes()));
        let PartEnd::Done(rest) = stream.end_part() else {
            panic!("nothing left to check");
        };
        out.extend(rest);
        let out = text_of(&out);
        // The repeat of the relayed call is dropped; the held one and the re-asked one come.
        assert!(!out.contains("{\\\"x\\\":1}"), "{out}");
        assert!(
            out.contains("{\\\"x\\\":2}") && out.contains("Paris"),
            "{out}"
        );
        assert!(
            out.contains(r#""index":1"#) && out.contains(r#""index":2"#),
            "{out}"
        );
    }
}
