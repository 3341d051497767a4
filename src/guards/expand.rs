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
use super::stream::{Relay, relay_events};
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
        let pushed = self.splitter.push_events(data);
        relay_events(pushed, event_too_large_event, |raw, out| {
            self.relay_event(raw, out)
        })
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
#[path = "expand_tests.rs"]
mod tests;
