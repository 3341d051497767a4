//! Transparent expansion in the Responses API's event stream, its pure part: the events of an
//! output item go to the client as they come, except those of a `function_call` item whose name
//! is watched (a stub without definition, `ctxproxy_recall`) or whose arguments are checked (a
//! tool defined only in the messages, `guards::arguments`): from it on, the part's items are
//! held until it ends. A call of a full tool streams as soon as its `output_item.added` (which
//! names it) comes. The terminal event (`response.completed`, `response.incomplete`) is held:
//! when the part called watched tools the re-asked answer's events are spliced into the same
//! stream (its `response.created`/`in_progress` dropped, `sequence_number` continuing the
//! client's, `output_index` counting the items the client got), and one terminal event ends it:
//! the first answer's `id` (the stream is one Response), the last one's other fields, its
//! `output` the items the client received and its `usage` the sum of every part's.
//!
//! A reasoning item waits for the item after it and shares its fate (relayed, held or dropped
//! with it): a reasoning item is never parted from the item that followed it. A re-asked part's
//! repeat of what the client has (a call of a tool, as many as it already got; a message with
//! the same text) is dropped. The decisions are [`ExpandStream`](super::expand::ExpandStream)'s
//! ([`PartEnd`]); the calls live in `server::guarded::expand`. No I/O.

use bytes::Bytes;
use serde_json::Value;

use super::arguments::{ArgumentCheck, Failed};
use super::expand::{PartEnd, add_usage, repeats, tool_call};
use super::stream::{Relay, part_event, relay_events};
use crate::openai::ToolCall;
use crate::openai::sse::{SseSplitter, StreamProgress, responses_event_too_large_event};

/// Where the events of one output item go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// To the client as they come.
    Relay,
    /// Held until the part ends (a watched or checked call, or any item after it).
    Hold,
    /// Held until its fate is known: a reasoning item's, when the next item starts; a re-asked
    /// message's, when it is done (a repeat of a message the client has is dropped).
    Wait,
    /// Nowhere: a re-asked part's repeat of what the client has.
    Drop,
}

/// An output item of the current part.
#[derive(Debug)]
struct Item {
    /// The upstream's `output_index`.
    upstream: u64,
    route: Route,
    kind: String,
    /// A function call's name.
    name: String,
    /// The client's `output_index`, once its `output_item.added` went out.
    client: Option<u64>,
    /// The events of a waiting item.
    waiting: Vec<(Value, Bytes)>,
    /// The finished item (`output_item.done`).
    done: Option<Value>,
}

/// One Responses event stream made of the upstream's first answer and its re-asks.
pub struct ResponsesExpandStream {
    /// The function names whose calls are answered by the proxy: stubs and the recall tool.
    watched: Vec<String>,
    arguments: ArgumentCheck,
    max_event: usize,
    splitter: SseSplitter,
    /// 0 for the first answer, then one per re-ask.
    part: u32,
    progress: StreamProgress,
    /// The next `sequence_number` the client gets.
    sequence: u64,
    /// The items the client got (as `output_item.done` carried them), in order.
    output: Vec<Value>,
    /// The client's `output_index` of its next item.
    next_index: u64,
    /// The names of the function calls the client got, and how many of them before this part.
    relayed_calls: Vec<String>,
    relayed_before_part: usize,
    /// The names of the calls this part started (a repeat is dropped).
    started: Vec<String>,
    /// The texts of the messages the client got.
    said: Vec<String>,
    items: Vec<Item>,
    /// The part's events held until it ends (item events of held items, and what followed).
    held: Vec<(Value, Bytes)>,
    holding: bool,
    called: Vec<String>,
    /// The part's terminal event, held.
    terminal: Option<(Value, Bytes)>,
    /// The usage of every part.
    usage: Option<Value>,
    /// The first answer's `response.id`: the client's stream is one Response (a client such
    /// as the SDK refuses a stream whose lifecycle events change it).
    response_id: Option<Value>,
}

const ADDED: &str = "response.output_item.added";
const DONE: &str = "response.output_item.done";

impl ResponsesExpandStream {
    pub fn new(watched: Vec<String>, max_event: usize) -> ResponsesExpandStream {
        ResponsesExpandStream {
            watched,
            arguments: ArgumentCheck::default(),
            max_event,
            splitter: SseSplitter::with_max_event(max_event),
            part: 0,
            progress: StreamProgress::responses(),
            sequence: 0,
            output: Vec::new(),
            next_index: 0,
            relayed_calls: Vec::new(),
            relayed_before_part: 0,
            started: Vec::new(),
            said: Vec::new(),
            items: Vec::new(),
            held: Vec::new(),
            holding: false,
            called: Vec::new(),
            terminal: None,
            usage: None,
            response_id: None,
        }
    }

    /// The argument checks of the request being answered (empty: no call is checked).
    pub fn arguments(&mut self) -> &mut ArgumentCheck {
        &mut self.arguments
    }

    /// How the current part is ending, from its events.
    pub fn progress(&self) -> &StreamProgress {
        &self.progress
    }

    /// Takes bytes of the current part's body as they came.
    pub fn push(&mut self, data: &[u8]) -> Relay {
        let pushed = self.splitter.push_events(data);
        relay_events(pushed, responses_event_too_large_event, |raw, out| {
            self.take(raw, out)
        })
    }

    /// The current part's body ended.
    pub fn end_part(&mut self) -> PartEnd {
        let mut out = self.unterminated();
        if self.progress.failed() {
            // The client was told the answer failed: nothing held follows.
            return PartEnd::Done(out);
        }
        if !self.called.is_empty() {
            return PartEnd::ReAsk(std::mem::take(&mut self.called));
        }
        if let Some(failed) = self.failing_calls() {
            return PartEnd::Invalid(failed);
        }
        // A reasoning item nothing followed, then what was held, in order.
        let waiting: Vec<(Value, Bytes)> = self
            .items
            .iter_mut()
            .filter(|item| item.route == Route::Wait)
            .flat_map(|item| std::mem::take(&mut item.waiting))
            .collect();
        for (event, raw) in waiting.into_iter().chain(std::mem::take(&mut self.held)) {
            self.emit(event, Some(raw), &mut out);
        }
        if let Some((mut event, raw)) = self.terminal.take() {
            if self.part == 0 {
                self.emit(event, Some(raw), &mut out);
            } else {
                if let Some(response) = event.get_mut("response").and_then(Value::as_object_mut) {
                    if let Some(id) = self.response_id.clone() {
                        response.insert("id".into(), id);
                    }
                    response.insert("output".into(), Value::Array(self.output.clone()));
                    if let Some(usage) = self.usage.clone() {
                        response.insert("usage".into(), usage);
                    }
                }
                self.emit(event, None, &mut out);
            }
        }
        PartEnd::Done(out)
    }

    /// What a last event without its blank line gives.
    fn unterminated(&mut self) -> Vec<Bytes> {
        let raw = self.splitter.finish();
        let mut out = Vec::new();
        raw.into_iter().for_each(|raw| self.take(raw, &mut out));
        out
    }

    /// The re-asked answer is arriving; `watched`: what its request answers itself.
    pub fn re_asked(&mut self, watched: Vec<String>) {
        self.watched = watched;
        self.splitter = SseSplitter::with_max_event(self.max_event);
        self.part += 1;
        self.progress = StreamProgress::responses();
        self.relayed_before_part = self.relayed_calls.len();
        self.started.clear();
        self.items.clear();
        self.held.clear();
        self.holding = false;
        self.terminal = None;
    }

    /// The held calls of the tool `name` of the part that just ended, as whole calls.
    pub fn held_calls_of(&self, name: &str) -> Vec<ToolCall> {
        self.held_calls()
            .filter(|(n, _, _)| *n == name)
            .map(|(name, id, arguments)| tool_call(id, name, arguments))
            .collect()
    }

    /// Where the SSE comment naming the tools expanded goes in the last events: before the
    /// terminal event, so that it stays last.
    pub fn comment_at(last: &[Bytes]) -> usize {
        last.len().saturating_sub(1)
    }

    /// The held function calls of the part: name, `call_id`, arguments.
    fn held_calls(&self) -> impl Iterator<Item = (&str, &str, &str)> {
        self.items
            .iter()
            .filter(|item| item.route == Route::Hold && item.kind == "function_call")
            .map(|item| {
                let done = item.done.as_ref();
                let field = |key| done.and_then(|d| d[key].as_str()).unwrap_or("");
                (item.name.as_str(), field("call_id"), field("arguments"))
            })
    }

    /// The checked tools whose held calls fail their schema.
    fn failing_calls(&mut self) -> Option<Failed> {
        if self.arguments.is_empty() {
            return None;
        }
        let calls: Vec<(String, String)> = self
            .held_calls()
            .map(|(name, _, arguments)| (name.to_owned(), arguments.to_owned()))
            .collect();
        self.arguments
            .failing(calls.iter().map(|(n, a)| (n.as_str(), a.as_str())))
    }

    fn take(&mut self, raw: Bytes, out: &mut Vec<Bytes>) {
        let Some(event) = part_event(&mut self.progress, &raw, out) else {
            return;
        };
        let kind = event["type"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "response.created" | "response.in_progress" | "response.queued" => {
                // The client has the first answer's.
                if self.part == 0 {
                    if let Some(id) = event["response"].get("id") {
                        self.response_id.get_or_insert_with(|| id.clone());
                    }
                    self.pass(event, raw, out);
                }
            }
            "response.completed" | "response.incomplete" => {
                if let Some(usage) = event["response"].get("usage").filter(|u| u.is_object()) {
                    add_usage(&mut self.usage, usage);
                }
                self.terminal = Some((event, raw));
            }
            // The answer failed: the client is told at once.
            "response.failed" | "error" => self.emit(event, Some(raw), out),
            _ => match event["output_index"].as_u64() {
                Some(upstream) => self.item_event(&kind, upstream, event, raw, out),
                None => self.pass(event, raw, out),
            },
        }
    }

    /// An event of no item: after the held ones, or now.
    fn pass(&mut self, event: Value, raw: Bytes, out: &mut Vec<Bytes>) {
        if self.holding {
            self.held.push((event, raw));
        } else {
            self.emit(event, Some(raw), out);
        }
    }

    fn item_event(
        &mut self,
        kind: &str,
        upstream: u64,
        event: Value,
        raw: Bytes,
        out: &mut Vec<Bytes>,
    ) {
        if kind == ADDED {
            self.start_item(upstream, &event["item"], out);
        }
        let Some(at) = self.items.iter().position(|i| i.upstream == upstream) else {
            // An item whose start was not seen: as it came.
            return self.pass(event, raw, out);
        };
        if kind == DONE {
            self.items[at].done = Some(event["item"].clone());
        }
        match self.items[at].route {
            Route::Relay => self.emit(event, Some(raw), out),
            Route::Hold => self.held.push((event, raw)),
            Route::Drop => {}
            Route::Wait => {
                self.items[at].waiting.push((event, raw));
                if kind == DONE && self.items[at].kind == "message" {
                    let repeat = self.said.contains(&text_of(&self.items[at].done));
                    let route = if repeat { Route::Drop } else { Route::Relay };
                    self.settle(at, route, out);
                }
            }
        }
    }

    /// A new output item: where its events go, and the waiting reasoning before it with them.
    fn start_item(&mut self, upstream: u64, item: &Value, out: &mut Vec<Bytes>) {
        let kind = item["type"].as_str().unwrap_or_default().to_owned();
        let name = item["name"].as_str().unwrap_or_default().to_owned();
        let route = self.route_of(&kind, &name);
        let before: Vec<usize> = (0..self.items.len())
            .filter(|&k| self.items[k].route == Route::Wait && self.items[k].kind == "reasoning")
            .collect();
        self.items.push(Item {
            upstream,
            route,
            kind,
            name,
            client: None,
            waiting: Vec::new(),
            done: None,
        });
        for k in before {
            if route == Route::Wait {
                // Decided with the message after it: its events go first.
                let mut events = std::mem::take(&mut self.items[k].waiting);
                let last = self.items.len() - 1;
                events.append(&mut self.items[last].waiting);
                self.items[last].waiting = events;
                self.items[k].route = Route::Drop;
            } else {
                self.settle(k, route, out);
            }
        }
    }

    /// Where a new item of `kind` (`name`: a call's) goes.
    fn route_of(&mut self, kind: &str, name: &str) -> Route {
        if kind == "function_call" && self.watched.iter().any(|w| w == name) {
            if !self.called.iter().any(|c| c == name) {
                self.called.push(name.to_owned());
            }
            self.holding = true;
            return Route::Hold;
        }
        if self.holding {
            return Route::Hold;
        }
        match kind {
            "reasoning" => Route::Wait,
            "function_call" => {
                let had = &self.relayed_calls[..self.relayed_before_part];
                if self.part > 0 && repeats(had, &mut self.started, name) {
                    return Route::Drop;
                }
                if self.arguments.checks(name) {
                    self.holding = true;
                    return Route::Hold;
                }
                Route::Relay
            }
            "message" if self.part > 0 && !self.said.is_empty() => Route::Wait,
            _ => Route::Relay,
        }
    }

    /// A waiting item's fate: its events go out, are held, or are dropped.
    fn settle(&mut self, at: usize, route: Route, out: &mut Vec<Bytes>) {
        self.items[at].route = route;
        let events = std::mem::take(&mut self.items[at].waiting);
        match route {
            Route::Relay => {
                for (event, raw) in events {
                    self.emit(event, Some(raw), out);
                }
            }
            Route::Hold => self.held.extend(events),
            Route::Drop | Route::Wait => {}
        }
    }

    /// An event to the client: its `sequence_number` the client's next, its `output_index`
    /// the client's; as it came when both are.
    fn emit(&mut self, mut event: Value, raw: Option<Bytes>, out: &mut Vec<Bytes>) {
        let kind = event["type"].as_str().unwrap_or_default().to_owned();
        let mut unchanged = raw.is_some();
        if let Some(upstream) = event["output_index"].as_u64() {
            let item = self.items.iter_mut().find(|i| i.upstream == upstream);
            let client = match item {
                Some(item) => *item.client.get_or_insert_with(|| {
                    self.next_index += 1;
                    self.next_index - 1
                }),
                None => upstream,
            };
            if client != upstream {
                event["output_index"] = Value::from(client);
                unchanged = false;
            }
            self.note_relayed(&kind, &event);
        }
        if event["sequence_number"].as_u64() != Some(self.sequence) {
            event["sequence_number"] = Value::from(self.sequence);
            unchanged = false;
        }
        self.sequence += 1;
        out.push(match raw.filter(|_| unchanged) {
            Some(raw) => raw,
            None => Bytes::from(format!("event: {kind}\ndata: {event}\n\n")),
        });
    }

    /// What the client got of an item: the names of its calls, its messages' texts, its items.
    fn note_relayed(&mut self, kind: &str, event: &Value) {
        let item = &event["item"];
        match kind {
            ADDED if item["type"] == "function_call" => {
                let name = item["name"].as_str().unwrap_or_default();
                self.relayed_calls.push(name.to_owned());
            }
            DONE => {
                if item["type"] == "message" {
                    self.said.push(text_of(&Some(item.clone())));
                }
                self.output.push(item.clone());
            }
            _ => {}
        }
    }
}

/// The text of a finished message item: its `output_text` parts, joined.
fn text_of(item: &Option<Value>) -> String {
    let parts = item.as_ref().and_then(|i| i["content"].as_array());
    parts
        .into_iter()
        .flatten()
        .filter_map(|part| part["text"].as_str())
        .collect()
}

#[cfg(test)]
#[path = "responses_expand_tests.rs"]
mod tests;
