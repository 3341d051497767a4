//! The stream guards on the Responses API's event stream, as a pure rewriter (chat's is
//! [`stream`](super::stream)): a Response cut at `max_output_tokens` whose output is one message
//! (reasoning before it at most) is continued in the same stream, and a finished text answer
//! that claims an action is flagged with an SSE comment.
//!
//! The first part's events go out as they come, except the three that end its message
//! (`output_text.done`, `content_part.done`, `output_item.done`) and the terminal event: they are
//! held while the answer may be continued. A later part's text goes out as `output_text.delta`
//! events of the client's message (its `item_id`, `output_index`, `content_index`), its start
//! held while it may repeat the end of what was said; its other events are dropped (its
//! reasoning items too: they would precede no item of theirs). At the end, the message's end
//! events carry the whole text, and one terminal event ends the stream: the first part's `id`
//! (the stream is one Response), the last part's status, the items the client got as `output`,
//! and the usage of every part. `sequence_number` counts the events the client got. No I/O:
//! `server::guarded` pumps the parts.

use bytes::Bytes;
use serde_json::{Value, json};

use super::Guards;
use super::claims::{ACTION_CLAIMED, X_CTXPROXY_WARNING, claimed_action};
use super::continuation::{may_overlap, overlap, sum_usage};
use super::responses_json::with_input_items;
use super::stream::{Finish, Next, PartEnd, Relay, part_event, relay_events};
use crate::metrics::ContinuationOutcome;
use crate::openai::sse::{SseSplitter, StreamProgress, responses_event_too_large_event};

const ADDED: &str = "response.output_item.added";
const DONE: &str = "response.output_item.done";
const TEXT_DELTA: &str = "response.output_text.delta";
const TEXT_DONE: &str = "response.output_text.done";
const PART_ADDED: &str = "response.content_part.added";
const PART_DONE: &str = "response.content_part.done";

/// Where the client's message is.
#[derive(Debug, Clone)]
struct MessageAt {
    output_index: u64,
    item_id: Value,
    content_index: u64,
}

/// Relays the parts of one streamed Response as one.
pub struct ResponsesStreamRewriter<'a> {
    guards: &'a Guards,
    /// The action check applies (it is on and the request offered tools).
    check_claims: bool,
    /// Cut answers may be continued (the guard is on, and the Response is not stored).
    continues: bool,
    /// The request sent, for continuation requests.
    sent: &'a [u8],
    max_event: usize,
    splitter: SseSplitter,
    progress: StreamProgress,
    /// 0 for the first part, then one per continuation.
    part: u32,
    /// The client's next `sequence_number`.
    sequence: u64,
    /// The text of the client's message, over every part.
    said: String,
    /// No item but reasoning and one message so far.
    text_only: bool,
    message: Option<MessageAt>,
    /// The message may be continued: it is the last item so far, with one content part, and
    /// its end events are held (released as soon as anything follows them).
    continuable: bool,
    /// The items the client got, as their `output_item.done` carried them.
    output: Vec<Value>,
    /// The first part's message end events, held while the answer may be continued.
    ends: Vec<(Value, Bytes)>,
    /// The current part's terminal event, held.
    terminal: Option<(Value, Bytes)>,
    /// The terminal event of the part cut last.
    cut: Option<(Value, Bytes)>,
    usage: Option<Value>,
    response_id: Option<Value>,
    /// A later part: the upstream `output_index` of its message, whether it gave anything but
    /// reasoning and that message, what was said before it, and its first text while it may
    /// repeat the end of that.
    part_message: Option<u64>,
    part_not_text: bool,
    said_before: String,
    start: String,
    start_decided: bool,
}

impl<'a> ResponsesStreamRewriter<'a> {
    /// A rewriter for the answer to `sent`; `tools_offered`: the request offered tools (the
    /// action check needs them); `stored`: the upstream keeps the Response (its id is the
    /// client's, so a continued Response could not be fetched as the client got it: not
    /// continued); events larger than `max_event` bytes cut the answer.
    pub fn new(
        guards: &'a Guards,
        tools_offered: bool,
        stored: bool,
        sent: &'a [u8],
        max_event: usize,
    ) -> ResponsesStreamRewriter<'a> {
        ResponsesStreamRewriter {
            guards,
            check_claims: guards.action_check.enabled && tools_offered,
            continues: guards.continuation.enabled && !stored,
            sent,
            max_event,
            splitter: SseSplitter::with_max_event(max_event),
            progress: StreamProgress::responses(),
            part: 0,
            sequence: 0,
            said: String::new(),
            text_only: true,
            message: None,
            continuable: false,
            output: Vec::new(),
            ends: Vec::new(),
            terminal: None,
            cut: None,
            usage: None,
            response_id: None,
            part_message: None,
            part_not_text: false,
            said_before: String::new(),
            start: String::new(),
            start_decided: true,
        }
    }

    /// Takes bytes of the current part's body as they came.
    pub fn push(&mut self, data: &[u8]) -> Relay {
        let pushed = self.splitter.push_events(data);
        relay_events(pushed, responses_event_too_large_event, |raw, out| {
            self.take(raw, out)
        })
    }

    /// The current part's body ended (with its terminal event: the pump gives up otherwise).
    pub fn end_part(&mut self) -> PartEnd {
        let mut events = Vec::new();
        if let Some(raw) = self.splitter.finish() {
            self.take(raw, &mut events);
        }
        if !self.start_decided {
            self.release_start(&mut events);
        }
        PartEnd {
            events,
            next: self.next(),
        }
    }

    /// How the current part is ending, from its events.
    pub fn progress(&self) -> &StreamProgress {
        &self.progress
    }

    /// The upstream is sending the next part (after [`Next::Continue`]).
    pub fn continued(&mut self) {
        self.part += 1;
        self.splitter = SseSplitter::with_max_event(self.max_event);
        self.progress = StreamProgress::responses();
        self.terminal = None;
        self.part_message = None;
        self.part_not_text = false;
        self.said_before = self.said.clone();
        self.start.clear();
        self.start_decided = false;
    }

    /// The next part could not be had (after [`Next::Continue`]): the answer ends cut, as said
    /// so far; `outcome` is counted.
    pub fn give_up(&mut self, outcome: ContinuationOutcome) -> Finish {
        let terminal = self.cut.take();
        self.finish(terminal, Some(outcome))
    }

    fn next(&mut self) -> Next {
        let Some(terminal) = self.terminal.take() else {
            // Not complete: the pump ends the stream with an error event.
            return Next::Done(Finish::default());
        };
        if self.part > 0 && self.part_not_text {
            // A continuation that did more than go on with the text: the answer ends cut.
            return Next::Done(self.give_up(ContinuationOutcome::Error));
        }
        let cut = is_cut(&terminal.0);
        let continuation = &self.guards.continuation;
        if cut && self.continuable && self.message.is_some() {
            if self.part >= continuation.max_attempts {
                return Next::Done(
                    self.finish(Some(terminal), Some(ContinuationOutcome::MaxAttempts)),
                );
            }
            let added = [
                json!({"role": "assistant", "content": self.said}),
                json!({"role": "user", "content": continuation.instruction}),
            ];
            return match with_input_items(self.sent, added) {
                Some(request) => {
                    self.cut = Some(terminal);
                    Next::Continue(request)
                }
                None => Next::Done(self.finish(Some(terminal), Some(ContinuationOutcome::Error))),
            };
        }
        let outcome = (self.part > 0).then_some(if cut {
            ContinuationOutcome::MaxAttempts
        } else {
            ContinuationOutcome::Completed
        });
        Next::Done(self.finish(Some(terminal), outcome))
    }

    /// The end of the answer: the message's end events with the whole text, the claim
    /// comment, then `terminal` (the last part's) as the client's one Response. When no
    /// continuation went out, they go as they came.
    fn finish(
        &mut self,
        terminal: Option<(Value, Bytes)>,
        outcome: Option<ContinuationOutcome>,
    ) -> Finish {
        let continued = self.part > 0;
        let complete = terminal
            .as_ref()
            .is_some_and(|(t, _)| t["type"] == "response.completed");
        let mut ends = Vec::new();
        for (mut event, raw) in std::mem::take(&mut self.ends) {
            if continued {
                self.with_whole_text(&mut event, complete);
                self.emit(event, None, &mut ends);
            } else {
                if event["type"] == DONE {
                    self.output.push(event["item"].clone());
                }
                self.emit(event, Some(raw), &mut ends);
            }
        }
        let claimed = self.check_claims
            && self.text_only
            && self.message.is_some()
            && claimed_action(&self.said, &self.guards.action_check.patterns).is_some();
        let mut tail = Vec::new();
        match terminal {
            Some((terminal, raw)) if !continued => self.emit(terminal, Some(raw), &mut tail),
            Some((terminal, _)) => self.emit_whole(terminal, &mut tail),
            None => {}
        }
        Finish {
            cut: (!ends.is_empty()).then(|| ends.concat().into()),
            continuation: outcome,
            // Headers are gone: the stream says it as an SSE comment, which clients ignore.
            claim: claimed
                .then(|| Bytes::from(format!(": {X_CTXPROXY_WARNING}: {ACTION_CLAIMED}\n\n"))),
            tail,
        }
    }

    /// The last part's terminal event as the client's one Response: the first part's `id`,
    /// the items the client got, the usage of every part.
    fn emit_whole(&mut self, mut terminal: Value, out: &mut Vec<Bytes>) {
        if let Some(response) = terminal.get_mut("response").and_then(Value::as_object_mut) {
            if let Some(id) = self.response_id.clone() {
                response.insert("id".into(), id);
            }
            response.insert("output".into(), Value::Array(self.output.clone()));
            if let Some(usage) = self.usage.clone() {
                response.insert("usage".into(), usage);
            }
        }
        self.emit(terminal, None, out);
    }

    /// A held end event of the message, carrying the whole text said.
    fn with_whole_text(&mut self, event: &mut Value, complete: bool) {
        let said = Value::from(self.said.as_str());
        let kind = event["type"].as_str().unwrap_or_default().to_owned();
        let Some(event) = event.as_object_mut() else {
            return;
        };
        match kind.as_str() {
            TEXT_DONE => {
                event.insert("text".into(), said);
            }
            PART_DONE => {
                if let Some(part) = event.get_mut("part").and_then(Value::as_object_mut) {
                    part.insert("text".into(), said);
                }
            }
            DONE => {
                let Some(item) = event.get_mut("item").and_then(Value::as_object_mut) else {
                    return;
                };
                // A continued message has one content part (`continuable`).
                let parts = item.get_mut("content").and_then(Value::as_array_mut);
                if let Some(part) = parts
                    .and_then(|parts| parts.last_mut())
                    .and_then(Value::as_object_mut)
                {
                    part.insert("text".into(), said);
                }
                let status = if complete { "completed" } else { "incomplete" };
                item.insert("status".into(), Value::from(status));
                self.output.push(Value::Object(item.clone()));
            }
            _ => {}
        }
    }

    fn take(&mut self, raw: Bytes, out: &mut Vec<Bytes>) {
        let Some(event) = part_event(&mut self.progress, &raw, out) else {
            return;
        };
        let kind = event["type"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "response.completed" | "response.incomplete" => {
                if let Some(usage) = event["response"].get("usage").filter(|u| u.is_object()) {
                    self.usage = Some(match &self.usage {
                        Some(sum) => sum_usage(sum, usage),
                        None => usage.clone(),
                    });
                }
                self.terminal = Some((event, raw));
            }
            // The answer failed: the client is told at once.
            // (A continuation's failure as the client's Response's.)
            "response.failed" if self.part > 0 => self.emit_whole(event, out),
            "response.failed" | "error" => self.emit(event, Some(raw), out),
            _ if self.part == 0 => self.first_part_event(&kind, event, raw, out),
            _ => self.later_part_event(&kind, event, out),
        }
    }

    fn first_part_event(&mut self, kind: &str, event: Value, raw: Bytes, out: &mut Vec<Bytes>) {
        let in_message = self
            .message
            .as_ref()
            .is_some_and(|m| event["output_index"].as_u64() == Some(m.output_index));
        let ends = in_message && matches!(kind, TEXT_DONE | PART_DONE | DONE);
        if !ends && !self.ends.is_empty() {
            // Something follows the message: it is not the answer's end, its end goes now.
            self.continuable = false;
            for (event, raw) in std::mem::take(&mut self.ends) {
                if event["type"] == DONE {
                    self.output.push(event["item"].clone());
                }
                self.emit(event, Some(raw), out);
            }
        }
        match kind {
            "response.created" => {
                if let Some(id) = event["response"].get("id") {
                    self.response_id.get_or_insert_with(|| id.clone());
                }
            }
            ADDED => self.note_item(&event),
            PART_ADDED if in_message => {
                if event["part"]["type"] != "output_text" {
                    self.text_only = false;
                }
                if event["content_index"].as_u64() != Some(0) {
                    // Text in several parts is not continued (its end would be one part's).
                    self.continuable = false;
                }
                if let (Some(at), Some(index)) =
                    (self.message.as_mut(), event["content_index"].as_u64())
                {
                    at.content_index = index;
                }
            }
            TEXT_DELTA if in_message => {
                self.said
                    .push_str(event["delta"].as_str().unwrap_or_default());
            }
            TEXT_DONE | PART_DONE | DONE if in_message && self.continuable && self.text_only => {
                self.ends.push((event, raw));
                return;
            }
            DONE => self.output.push(event["item"].clone()),
            _ => {}
        }
        self.emit(event, Some(raw), out);
    }

    /// A new item of the first part: the message, or what makes the answer more than text.
    fn note_item(&mut self, event: &Value) {
        let item = &event["item"];
        match item["type"].as_str() {
            Some("reasoning") => {}
            Some("message") if self.message.is_none() => {
                self.message = event["output_index"]
                    .as_u64()
                    .map(|output_index| MessageAt {
                        output_index,
                        item_id: item["id"].clone(),
                        content_index: 0,
                    });
                self.continuable = self.continues && self.message.is_some();
                return;
            }
            _ => self.text_only = false,
        }
        // An item after the message: the message is not the answer's end.
        self.continuable = false;
    }

    /// An event of a continuation: only its message's text goes on, as the client's message.
    fn later_part_event(&mut self, kind: &str, event: Value, out: &mut Vec<Bytes>) {
        let index = event["output_index"].as_u64();
        if kind == ADDED {
            match event["item"]["type"].as_str() {
                Some("message") if self.part_message.is_none() => self.part_message = index,
                Some("reasoning") => {}
                _ => self.part_not_text = true,
            }
        }
        if kind == PART_ADDED && index.is_some() && index == self.part_message {
            let text = event["part"]["type"] == "output_text";
            self.part_not_text |= !text || event["content_index"].as_u64() != Some(0);
        }
        if kind != TEXT_DELTA || index.is_none() || index != self.part_message {
            return;
        }
        let text = event["delta"].as_str().unwrap_or_default();
        if self.start_decided {
            self.delta(text.to_owned(), out);
            return;
        }
        self.start.push_str(text);
        if !may_overlap(&self.said_before, &self.start) {
            self.release_start(out);
        }
    }

    /// A later part's held start, without what repeats the end of what was said before it.
    fn release_start(&mut self, out: &mut Vec<Bytes>) {
        self.start_decided = true;
        let start = std::mem::take(&mut self.start);
        let repeat = overlap(&self.said_before, &start);
        self.delta(start[repeat..].to_owned(), out);
    }

    /// Text of a later part, as a delta of the client's message.
    fn delta(&mut self, text: String, out: &mut Vec<Bytes>) {
        let Some(at) = self.message.clone().filter(|_| !text.is_empty()) else {
            return;
        };
        self.said.push_str(&text);
        let event = json!({"type": TEXT_DELTA, "item_id": at.item_id,
            "output_index": at.output_index, "content_index": at.content_index,
            "delta": text, "logprobs": []});
        self.emit(event, None, out);
    }

    /// An event to the client, its `sequence_number` the client's next; as it came when it was.
    fn emit(&mut self, mut event: Value, raw: Option<Bytes>, out: &mut Vec<Bytes>) {
        let unchanged = raw.filter(|_| event["sequence_number"].as_u64() == Some(self.sequence));
        self.sequence += 1;
        out.push(match unchanged {
            Some(raw) => raw,
            None => {
                event["sequence_number"] = Value::from(self.sequence - 1);
                let kind = event["type"].as_str().unwrap_or_default().to_owned();
                Bytes::from(format!("event: {kind}\ndata: {event}\n\n"))
            }
        });
    }
}

/// Whether a terminal event says the Response stopped at its output limit.
fn is_cut(terminal: &Value) -> bool {
    terminal["type"] == "response.incomplete"
        && terminal["response"]["incomplete_details"]["reason"] == "max_output_tokens"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guards::ContinuationConfig;

    fn guards(continuation: bool, claims: bool) -> Guards {
        let mut guards = Guards {
            continuation: ContinuationConfig {
                enabled: continuation,
                max_attempts: 2,
                ..ContinuationConfig::default()
            },
            ..Guards::default()
        };
        guards.action_check.enabled = claims;
        guards
    }

    fn event(kind: &str, mut fields: Value, sequence: u64) -> String {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(sequence);
        format!("event: {kind}\ndata: {fields}\n\n")
    }

    /// The events of a Response: a reasoning item, then a message of `deltas`; cut at the
    /// output limit or completed.
    fn answer(id: &str, deltas: &[&str], cut: bool) -> String {
        let text: String = deltas.concat();
        let status = if cut { "incomplete" } else { "completed" };
        let message = json!({"type": "message", "id": format!("msg_{id}"), "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "annotations": [], "text": text}]});
        let reasoning = json!({"type": "reasoning", "id": format!("rs_{id}"), "summary": [],
            "encrypted_content": "opaque"});
        let mut events = vec![
            (
                "response.created",
                json!({"response": {"id": id, "status": "in_progress"}}),
            ),
            (
                "response.in_progress",
                json!({"response": {"id": id, "status": "in_progress"}}),
            ),
            (ADDED, json!({"output_index": 0, "item": reasoning})),
            (DONE, json!({"output_index": 0, "item": reasoning})),
            (
                ADDED,
                json!({"output_index": 1, "item": {"type": "message",
                "id": format!("msg_{id}"), "role": "assistant", "status": "in_progress",
                "content": []}}),
            ),
            (
                PART_ADDED,
                json!({"output_index": 1, "item_id": format!("msg_{id}"),
                "content_index": 0, "part": {"type": "output_text", "text": ""}}),
            ),
        ];
        for delta in deltas {
            events.push((
                TEXT_DELTA,
                json!({"output_index": 1,
                "item_id": format!("msg_{id}"), "content_index": 0, "delta": delta}),
            ));
        }
        events.extend([
            (
                TEXT_DONE,
                json!({"output_index": 1, "item_id": format!("msg_{id}"),
                "content_index": 0, "text": text}),
            ),
            (
                PART_DONE,
                json!({"output_index": 1, "item_id": format!("msg_{id}"),
                "content_index": 0, "part": {"type": "output_text", "text": text}}),
            ),
            (DONE, json!({"output_index": 1, "item": message})),
        ]);
        let details = if cut {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        let terminal = if cut {
            "response.incomplete"
        } else {
            "response.completed"
        };
        events.push((
            terminal,
            json!({"response": {"id": id, "status": status,
            "incomplete_details": details, "output": [reasoning, message],
            "usage": {"input_tokens": 10, "output_tokens": 4, "total_tokens": 14}}}),
        ));
        events
            .into_iter()
            .enumerate()
            .map(|(k, (kind, fields))| event(kind, fields, k as u64))
            .collect()
    }

    fn bytes(events: &[Bytes]) -> String {
        events
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect()
    }

    fn events(relay: Relay) -> Vec<Bytes> {
        match relay {
            Relay::Events(events) => events,
            Relay::TooLarge(_) => panic!("too large"),
        }
    }

    fn finished(finish: &Finish) -> String {
        let mut all: Vec<Bytes> = finish.cut.iter().cloned().collect();
        all.extend(finish.claim.iter().cloned());
        all.extend(finish.tail.iter().cloned());
        bytes(&all)
    }

    fn parsed(text: &str) -> Vec<Value> {
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    #[test]
    fn an_answer_that_is_not_cut_goes_out_as_it_came() {
        let guards = guards(true, false);
        let upstream = answer("r1", &["Hello ", "there."], false);
        let mut rewriter = ResponsesStreamRewriter::new(&guards, false, false, b"{}", 1 << 20);
        let mut out = bytes(&events(rewriter.push(upstream.as_bytes())));
        let end = rewriter.end_part();
        out.push_str(&bytes(&end.events));
        let Next::Done(finish) = end.next else {
            panic!("not continued")
        };
        assert_eq!(finish.continuation, None);
        out.push_str(&finished(&finish));
        assert_eq!(out, upstream);
    }

    #[test]
    fn a_cut_answer_is_continued_as_one_response_without_the_repeat() {
        let guards = guards(true, false);
        let sent = br#"{"model":"gpt-5","input":"Tell a story.","stream":true,"store":false}"#;
        let mut rewriter = ResponsesStreamRewriter::new(&guards, false, false, sent, 1 << 20);
        let mut out = bytes(&events(
            rewriter.push(answer("r1", &["The quick ", "brown"], true).as_bytes()),
        ));
        let end = rewriter.end_part();
        out.push_str(&bytes(&end.events));
        let Next::Continue(request) = end.next else {
            panic!("continued")
        };
        let request: Value = serde_json::from_slice(&request).unwrap();
        assert_eq!(
            request["input"][1],
            json!({"role": "assistant", "content": "The quick brown"})
        );
        assert!(!out.contains("output_text.done") && !out.contains("incomplete"));
        rewriter.continued();
        // The next part repeats "brown", split over two deltas.
        let next = answer("r2", &["br", "own fox", " jumps."], false);
        out.push_str(&bytes(&events(rewriter.push(next.as_bytes()))));
        let end = rewriter.end_part();
        out.push_str(&bytes(&end.events));
        let Next::Done(finish) = end.next else {
            panic!("done")
        };
        assert_eq!(finish.continuation, Some(ContinuationOutcome::Completed));
        out.push_str(&finished(&finish));

        let events = parsed(&out);
        let sequence: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(sequence, (0..events.len() as u64).collect::<Vec<_>>());
        let deltas: String = events
            .iter()
            .filter(|e| e["type"] == TEXT_DELTA)
            .inspect(|e| {
                assert_eq!(
                    (&e["item_id"], &e["output_index"]),
                    (&json!("msg_r1"), &json!(1))
                )
            })
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(deltas, "The quick brown fox jumps.");
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds.iter().filter(|k| **k == "response.created").count(),
            1
        );
        assert_eq!(
            kinds.iter().filter(|k| **k == ADDED).count(),
            2,
            "{kinds:?}"
        );
        let last = events.last().unwrap();
        assert_eq!(last["type"], "response.completed");
        assert_eq!(last["response"]["id"], "r1");
        let output = last["response"]["output"].as_array().unwrap();
        assert_eq!(output.len(), 2, "the first part's reasoning and message");
        assert_eq!(
            output[1]["content"][0]["text"],
            "The quick brown fox jumps."
        );
        assert_eq!(output[1]["status"], "completed");
        assert_eq!(last["response"]["usage"]["output_tokens"], 8);
    }

    #[test]
    fn a_failed_continuation_ends_the_answer_as_the_upstream_cut_it() {
        let guards = guards(true, false);
        let upstream = answer("r1", &["The quick"], true);
        let mut rewriter = ResponsesStreamRewriter::new(&guards, false, false, b"{}", 1 << 20);
        let mut out = bytes(&events(rewriter.push(upstream.as_bytes())));
        let end = rewriter.end_part();
        assert!(matches!(end.next, Next::Continue(_)));
        let finish = rewriter.give_up(ContinuationOutcome::Error);
        assert_eq!(finish.continuation, Some(ContinuationOutcome::Error));
        out.push_str(&finished(&finish));
        assert_eq!(out, upstream);
    }

    #[test]
    fn the_last_allowed_part_ends_cut_and_a_stored_response_is_not_continued() {
        let guards = guards(true, false);
        let mut rewriter = ResponsesStreamRewriter::new(&guards, false, false, b"{}", 1 << 20);
        for (part, text) in ["one ", "two ", "three "].into_iter().enumerate() {
            let id = format!("r{part}");
            events(rewriter.push(answer(&id, &[text], true).as_bytes()));
            match rewriter.end_part().next {
                Next::Continue(_) => rewriter.continued(),
                Next::Done(finish) => {
                    assert_eq!(part, 2, "max_attempts = 2 continuations");
                    assert_eq!(finish.continuation, Some(ContinuationOutcome::MaxAttempts));
                    let out = parsed(&finished(&finish));
                    let last = out.last().unwrap();
                    assert_eq!(last["type"], "response.incomplete");
                    assert_eq!(
                        last["response"]["output"][1]["content"][0]["text"],
                        "one two three "
                    );
                }
            }
        }
        let upstream = answer("r1", &["The quick"], true);
        let mut stored = ResponsesStreamRewriter::new(&guards, false, true, b"{}", 1 << 20);
        let mut out = bytes(&events(stored.push(upstream.as_bytes())));
        let Next::Done(finish) = stored.end_part().next else {
            panic!("a stored Response is not continued")
        };
        out.push_str(&finished(&finish));
        assert_eq!(out, upstream);
    }

    #[test]
    fn a_claimed_action_is_flagged_before_the_terminal_event() {
        let guards = guards(false, true);
        let upstream = answer("r1", &["Done! I've created ", "the ticket."], false);
        let mut rewriter = ResponsesStreamRewriter::new(&guards, true, false, b"{}", 1 << 20);
        let mut out = bytes(&events(rewriter.push(upstream.as_bytes())));
        let Next::Done(finish) = rewriter.end_part().next else {
            panic!("done")
        };
        assert!(finish.claim.is_some());
        out.push_str(&finished(&finish));
        let comment = out.find(": x-ctxproxy-warning").unwrap();
        assert!(comment < out.find("event: response.completed").unwrap());
        assert_eq!(
            out.replace(
                ": x-ctxproxy-warning: action-claimed-without-tool-call\n\n",
                ""
            ),
            upstream
        );
    }

    /// `answer`'s events with `extra` (kind, fields) put in before the terminal event.
    fn with_before_terminal(answer: &str, extra: &[(&str, Value)]) -> String {
        let mut events: Vec<Value> = parsed(answer);
        let terminal = events.pop().unwrap();
        for (kind, fields) in extra {
            let mut fields = fields.clone();
            fields["type"] = json!(kind);
            events.push(fields);
        }
        events.push(terminal);
        events
            .into_iter()
            .enumerate()
            .map(|(k, mut e)| {
                e["sequence_number"] = json!(k);
                format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap())
            })
            .collect()
    }

    fn run_one(rewriter: &mut ResponsesStreamRewriter<'_>, upstream: &str) -> (String, Next) {
        let mut out = bytes(&events(rewriter.push(upstream.as_bytes())));
        let end = rewriter.end_part();
        out.push_str(&bytes(&end.events));
        (out, end.next)
    }

    #[test]
    fn what_follows_the_message_keeps_its_order_and_the_answer_is_not_continued() {
        let guards = guards(true, false);
        let call = json!({"type": "function_call", "id": "fc_1", "call_id": "c1",
            "name": "book", "arguments": "{}", "status": "completed"});
        let upstream = with_before_terminal(
            &answer("r1", &["Let me book it."], true),
            &[
                (ADDED, json!({"output_index": 2, "item": call})),
                (DONE, json!({"output_index": 2, "item": call})),
            ],
        );
        let mut rewriter = ResponsesStreamRewriter::new(&guards, false, false, b"{}", 1 << 20);
        let (mut out, next) = run_one(&mut rewriter, &upstream);
        let Next::Done(finish) = next else {
            panic!("a message before a call is not continued")
        };
        assert_eq!(finish.continuation, None);
        out.push_str(&finished(&finish));
        assert_eq!(out, upstream, "as it came, in order");
    }

    #[test]
    fn a_continuation_that_calls_a_tool_ends_the_answer_cut() {
        let guards = guards(true, false);
        let mut rewriter = ResponsesStreamRewriter::new(&guards, false, false, b"{}", 1 << 20);
        let (mut out, next) = run_one(&mut rewriter, &answer("r1", &["The quick"], true));
        assert!(matches!(next, Next::Continue(_)));
        rewriter.continued();
        let call = json!({"type": "function_call", "id": "fc_1", "call_id": "c1",
            "name": "book", "arguments": "{}", "status": "completed"});
        let next_part = with_before_terminal(
            &answer("r2", &[" brown fox."], false),
            &[
                (ADDED, json!({"output_index": 2, "item": call})),
                (DONE, json!({"output_index": 2, "item": call})),
            ],
        );
        let (more, next) = run_one(&mut rewriter, &next_part);
        out.push_str(&more);
        let Next::Done(finish) = next else {
            panic!("done")
        };
        assert_eq!(finish.continuation, Some(ContinuationOutcome::Error));
        out.push_str(&finished(&finish));
        let events = parsed(&out);
        assert!(
            !out.contains("function_call"),
            "the continuation's call is not the client's"
        );
        let last = events.last().unwrap();
        assert_eq!(last["type"], "response.incomplete");
        assert_eq!(last["response"]["id"], "r1");
        let sequence: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(sequence, (0..events.len() as u64).collect::<Vec<_>>());
    }

    #[test]
    fn a_failed_continuation_fails_the_clients_response_and_odd_shapes_do_not_panic() {
        let guards = guards(true, false);
        let mut rewriter = ResponsesStreamRewriter::new(&guards, false, false, b"{}", 1 << 20);
        run_one(&mut rewriter, &answer("r1", &["The quick"], true));
        rewriter.continued();
        let failed = event(
            "response.failed",
            json!({"response": {"id": "r2", "status": "failed", "error": {"code": "server_error"}}}),
            0,
        );
        let out = bytes(&events(rewriter.push(failed.as_bytes())));
        let failure = parsed(&out);
        assert_eq!(failure[0]["response"]["id"], "r1");
        assert_eq!(failure[0]["response"]["status"], "failed");

        // A part that is not an object in the message's end events: relayed, no panic.
        let original = answer("r1", &["Hi"], true);
        let odd = original.replace(
            r#""part":{"type":"output_text","text":"Hi"}"#,
            r#""part":"odd""#,
        );
        assert_ne!(odd, original);
        let mut rewriter = ResponsesStreamRewriter::new(&guards, false, false, b"{}", 1 << 20);
        run_one(&mut rewriter, &odd);
        rewriter.continued();
        let (_, next) = run_one(&mut rewriter, &answer("r2", &[" there."], false));
        let Next::Done(finish) = next else {
            panic!("done")
        };
        assert!(finished(&finish).contains("Hi there."));
    }
}
