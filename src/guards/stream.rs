//! The stream guard as a pure rewriter: fed the SSE bytes of each part of a streamed answer
//! (the first, then each continuation), it gives back the events the client gets, as one
//! answer, and says what to do when a part ends. It does no I/O: the task around it
//! (`server::guarded`) reads the upstream, forwards the events and asks for the next part.

use bytes::Bytes;
use serde_json::{Value, json};

use super::Guards;
use super::chunk::{self, Event, event, has_delta, restamp, set_delta, set_finish, usage_chunk};
use super::claims::{ACTION_CLAIMED, X_CTXPROXY_WARNING, claimed_action};
use super::continuation::{continuation_body, may_overlap, overlap, sum_usage};
use crate::metrics::ContinuationOutcome;
use crate::openai::sse::{
    EventTooLarge, SseSplitter, StreamProgress, event_object, event_too_large_event,
};

/// What to do with a piece of a part's body.
#[derive(Debug, PartialEq, Eq)]
pub enum Relay {
    /// Forward these events, in order, and read on.
    Events(Vec<Bytes>),
    /// An event is larger than allowed: forward this error event and stop (the answer is cut).
    TooLarge(Bytes),
}

/// The JSON object of an event a Responses part's rewriter reads: `None` once the part's
/// terminal event was seen (nothing after it is the answer's) and for a comment or keep-alive,
/// which goes to `out` as it came.
pub(crate) fn part_event(
    progress: &mut StreamProgress,
    raw: &Bytes,
    out: &mut Vec<Bytes>,
) -> Option<serde_json::Value> {
    if progress.done() {
        return None;
    }
    progress.see(raw);
    let event = event_object(raw);
    if event.is_none() {
        out.push(raw.clone());
    }
    event
}

/// The events `pushed` completed, each taken by `take` (which adds what goes to the client), or
/// the error event (`too_large` writes it in the stream's API) when one is too large.
pub(crate) fn relay_events(
    pushed: Result<Vec<Bytes>, EventTooLarge>,
    too_large: fn(EventTooLarge) -> Bytes,
    mut take: impl FnMut(Bytes, &mut Vec<Bytes>),
) -> Relay {
    match pushed {
        Ok(events) => {
            let mut out = Vec::new();
            for raw in events {
                take(raw, &mut out);
            }
            Relay::Events(out)
        }
        Err(error) => Relay::TooLarge(too_large(error)),
    }
}

/// The end of a part: the events it still had, then what comes next.
#[derive(Debug, PartialEq, Eq)]
pub struct PartEnd {
    pub events: Vec<Bytes>,
    pub next: Next,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// The part was cut at the length limit: ask the upstream for the rest with this request
    /// body, then call [`StreamRewriter::continued`] or [`StreamRewriter::give_up`].
    Continue(Vec<u8>),
    /// The answer is over.
    Done(Finish),
}

/// How the answer ends, in this order: the finish chunk of a cut answer that was not
/// continued, the continuation outcome to count, the claim comment (counted, then sent), and
/// the last events (merged usage, `[DONE]`).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Finish {
    pub cut: Option<Bytes>,
    pub continuation: Option<ContinuationOutcome>,
    pub claim: Option<Bytes>,
    pub tail: Vec<Bytes>,
}

/// Relays the events of one or more streamed parts as one answer.
pub struct StreamRewriter<'a> {
    guards: &'a Guards,
    /// The action check applies (it is on and the request offered tools).
    check_claims: bool,
    /// The request sent, for continuation requests.
    sent: &'a [u8],
    max_event: usize,
    /// The text said so far, over every part.
    said: String,
    /// `id`, `created`, `model`… of the first chunk: every chunk the client sees carries them.
    head: Option<Value>,
    tool_calls: bool,
    /// More than one choice: relayed as is.
    several_choices: bool,
    usage: Option<Value>,
    /// The current part ended with `[DONE]`.
    done: bool,
    part: Part,
    /// The finish chunk of the part cut last, sent if what follows does not finish.
    last_cut: Option<Value>,
    /// The finish chunk of the part just cut, while its continuation is asked for.
    cut: Option<Value>,
}

/// The part being relayed.
struct Part {
    index: u32,
    splitter: SseSplitter,
    /// What was said before this part.
    said_before: String,
    /// A later part's first text, held while it may repeat the end of `said_before`.
    start: String,
    start_chunk: Option<Value>,
    /// Whether the start is known (the first part has none to hold).
    decided: bool,
    /// The finish chunk of a part cut at the length limit, held back.
    held: Option<Value>,
    /// The part gave a finish reason.
    finished: bool,
    /// How the part is ending, from its events.
    progress: StreamProgress,
}

impl Part {
    fn new(index: u32, said_before: String, max_event: usize) -> Part {
        Part {
            index,
            splitter: SseSplitter::with_max_event(max_event),
            said_before,
            start: String::new(),
            start_chunk: None,
            decided: index == 0,
            held: None,
            finished: false,
            progress: StreamProgress::default(),
        }
    }
}

impl<'a> StreamRewriter<'a> {
    /// A rewriter for the answer to `sent`; `tools_offered`: the request offered tools (the
    /// action check needs them); events larger than `max_event` bytes cut the answer.
    pub fn new(
        guards: &'a Guards,
        tools_offered: bool,
        sent: &'a [u8],
        max_event: usize,
    ) -> StreamRewriter<'a> {
        StreamRewriter {
            guards,
            check_claims: guards.action_check.enabled && tools_offered,
            sent,
            max_event,
            said: String::new(),
            head: None,
            tool_calls: false,
            several_choices: false,
            usage: None,
            done: false,
            part: Part::new(0, String::new(), max_event),
            last_cut: None,
            cut: None,
        }
    }

    /// Takes bytes of the current part's body as they came.
    pub fn push(&mut self, data: &[u8]) -> Relay {
        let pushed = self.part.splitter.push_events(data);
        relay_events(pushed, event_too_large_event, |raw, out| {
            self.relay_event(raw, out);
        })
    }

    /// The current part's body ended.
    pub fn end_part(&mut self) -> PartEnd {
        let mut events = Vec::new();
        if let Some(raw) = self.part.splitter.finish() {
            self.relay_event(raw, &mut events);
        }
        if !self.part.decided && !self.part.start.is_empty() {
            self.release_start(&mut events);
        }
        PartEnd {
            events,
            next: self.next(),
        }
    }

    /// How the current part is ending, from its events (after [`StreamRewriter::end_part`]:
    /// how it ended).
    pub fn progress(&self) -> &StreamProgress {
        &self.part.progress
    }

    /// The upstream is sending the next part (after [`Next::Continue`]).
    pub fn continued(&mut self) {
        self.last_cut = self.cut.take();
        self.done = false;
        self.part = Part::new(self.part.index + 1, self.said.clone(), self.max_event);
    }

    /// The next part could not be had (after [`Next::Continue`]): the cut answer ends as the
    /// upstream ended it; `outcome` is counted.
    pub fn give_up(&mut self, outcome: ContinuationOutcome) -> Finish {
        let cut = self.cut.take();
        self.finish(cut, Some(outcome))
    }

    fn next(&mut self) -> Next {
        let continuation = &self.guards.continuation;
        match self.part.held.take() {
            Some(held) if self.part.index >= continuation.max_attempts => {
                Next::Done(self.finish(Some(held), Some(ContinuationOutcome::MaxAttempts)))
            }
            Some(held) => {
                match continuation_body(self.sent, &self.said, &continuation.instruction) {
                    Some(request) => {
                        self.cut = Some(held);
                        Next::Continue(request)
                    }
                    None => Next::Done(self.finish(Some(held), Some(ContinuationOutcome::Error))),
                }
            }
            None if self.part.finished => {
                let outcome = (self.part.index > 0).then_some(ContinuationOutcome::Completed);
                Next::Done(self.finish(None, outcome))
            }
            // A continuation that ended without a finish: the cut answer stands.
            None => match self.last_cut.take() {
                Some(held) => Next::Done(self.finish(Some(held), Some(ContinuationOutcome::Error))),
                None => Next::Done(self.finish(None, None)),
            },
        }
    }

    fn finish(&mut self, cut: Option<Value>, continuation: Option<ContinuationOutcome>) -> Finish {
        let patterns = &self.guards.action_check.patterns;
        let claimed = self.check_claims
            && !self.tool_calls
            && !self.several_choices
            && claimed_action(&self.said, patterns).is_some();
        // Headers are gone: the stream says it as an SSE comment, which clients ignore.
        let claim =
            claimed.then(|| Bytes::from(format!(": {X_CTXPROXY_WARNING}: {ACTION_CLAIMED}\n\n")));
        let mut tail = Vec::new();
        if let (Some(usage), Some(head)) = (self.usage.take(), &self.head) {
            tail.push(event(&usage_chunk(head, usage)));
        }
        if self.done {
            tail.push(Bytes::from_static(b"data: [DONE]\n\n"));
        }
        Finish {
            cut: cut.as_ref().map(event),
            continuation,
            claim,
            tail,
        }
    }

    /// One event of the current part: what of it goes to the client is added to `out`.
    fn relay_event(&mut self, raw: Bytes, out: &mut Vec<Bytes>) {
        // `[DONE]` ended the part: nothing after it is the answer's.
        if self.part.progress.done() {
            return;
        }
        self.part.progress.see(&raw);
        // Comments, errors and shapes it does not know go out untouched.
        let mut chunk = match chunk::read(&raw) {
            Event::Done => {
                self.done = true;
                return;
            }
            Event::Chunk(chunk) => chunk,
            Event::Other => {
                out.push(raw);
                return;
            }
        };
        if self.add_usage(&chunk) {
            return;
        }
        self.note(&chunk);
        let text = chunk["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        let finish = chunk["choices"][0]["finish_reason"]
            .as_str()
            .map(str::to_owned);
        if self.part.index > 0
            && let Some(head) = &self.head
        {
            restamp(&mut chunk, head);
        }
        if !self.part.decided {
            if text.is_empty() && finish.is_none() {
                // The role chunk goes; anything else (a tool call delta…) is relayed.
                if has_delta(&chunk) {
                    out.push(event(&chunk));
                }
                return;
            }
            if !self.hold_start(&text, &chunk, finish.is_some()) {
                return;
            }
            self.release_start(out);
            set_delta(&mut chunk, json!({}));
        } else {
            self.said.push_str(&text);
        }
        if let Some(finish) = &finish {
            self.part.finished = true;
            if finish == "length"
                && self.guards.continuation.enabled
                && !self.tool_calls
                && !self.several_choices
            {
                self.hold_cut(chunk, out);
                return;
            }
        }
        if self.part.index > 0 && finish.is_none() && !has_delta(&chunk) {
            return;
        }
        // The first part's chunks go out as the upstream sent them; later ones re-serialized.
        out.push(if self.part.index == 0 {
            raw
        } else {
            event(&chunk)
        });
    }

    /// Sums a usage-only chunk into the usage sent at the end; whether it was one.
    fn add_usage(&mut self, chunk: &Value) -> bool {
        let no_choices = chunk
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty);
        let Some(usage) = chunk.get("usage").filter(|u| no_choices && u.is_object()) else {
            return false;
        };
        self.usage = Some(match &self.usage {
            Some(sum) => sum_usage(sum, usage),
            None => usage.clone(),
        });
        true
    }

    /// What a chunk tells of the whole answer: its head, several choices, tool calls.
    fn note(&mut self, chunk: &Value) {
        let choices = chunk.get("choices").and_then(Value::as_array);
        if choices.is_some_and(|c| c.len() > 1)
            || chunk["choices"][0]["index"].as_u64().unwrap_or(0) > 0
        {
            self.several_choices = true;
        }
        if self.head.is_none() {
            let mut head = chunk.clone();
            if let Some(head) = head.as_object_mut() {
                head.remove("choices");
                head.remove("usage");
            }
            self.head = Some(head);
        }
        if chunk["choices"][0]["delta"]
            .get("tool_calls")
            .is_some_and(|t| !t.is_null())
        {
            self.tool_calls = true;
        }
    }

    /// Adds a later part's text to its held start; whether the start is now known (it can no
    /// longer grow into a repeat, or the part finishes).
    fn hold_start(&mut self, text: &str, chunk: &Value, finishes: bool) -> bool {
        let part = &mut self.part;
        part.start.push_str(text);
        part.start_chunk.get_or_insert_with(|| chunk.clone());
        if !finishes && may_overlap(&part.said_before, &part.start) {
            return false;
        }
        part.decided = true;
        true
    }

    /// Sends the held start of a later part without what repeats the end of what was said.
    fn release_start(&mut self, out: &mut Vec<Bytes>) {
        let part = &mut self.part;
        let kept = &part.start[overlap(&part.said_before, &part.start)..];
        self.said.push_str(kept);
        if let Some(mut chunk) = part.start_chunk.take()
            && !kept.is_empty()
        {
            set_delta(&mut chunk, json!({"content": kept}));
            set_finish(&mut chunk, Value::Null);
            out.push(event(&chunk));
        }
    }

    /// Holds back the finish chunk of a part cut at the length limit; what it carries besides
    /// the reason goes now.
    fn hold_cut(&mut self, mut chunk: Value, out: &mut Vec<Bytes>) {
        let mut rest = chunk.clone();
        set_finish(&mut rest, Value::Null);
        if has_delta(&rest) {
            out.push(event(&rest));
        }
        set_delta(&mut chunk, json!({}));
        self.part.held = Some(chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guards::{ActionCheckConfig, ContinuationConfig};

    const SENT: &[u8] = br#"{"model":"gpt-4o","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"Go"}]}"#;

    fn continuing(max_attempts: u32) -> Guards {
        Guards {
            continuation: ContinuationConfig {
                enabled: true,
                max_attempts,
                instruction: "Go on".into(),
            },
            ..Guards::default()
        }
    }

    /// A chunk of the part `id` (each part has its own id, created and model).
    fn chunk(id: u64, delta: Value, finish: Option<&str>) -> String {
        let chunk = json!({"id": format!("c{id}"), "object": "chat.completion.chunk",
            "created": id, "model": format!("gpt-4o-{id}"),
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {chunk}\n\n")
    }

    fn text(id: u64, text: &str) -> String {
        chunk(id, json!({"content": text}), None)
    }

    fn role(id: u64) -> String {
        chunk(id, json!({"role": "assistant", "content": ""}), None)
    }

    fn usage(id: u64, prompt: u64, completion: u64) -> String {
        let chunk = json!({"id": format!("c{id}"), "object": "chat.completion.chunk",
            "created": id, "model": format!("gpt-4o-{id}"), "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}});
        format!("data: {chunk}\n\n")
    }

    const DONE: &str = "data: [DONE]\n\n";

    /// What a chunk the client gets looks like: always the first part's head.
    /// A whole first part: role, one text chunk, the finish chunk, usage and `[DONE]`.
    fn one_part(words: &str, finish: &str) -> String {
        [
            role(1),
            text(1, words),
            chunk(1, json!({}), Some(finish)),
            usage(1, 5, 3),
            DONE.to_owned(),
        ]
        .concat()
    }

    fn out(delta: &str, finish: &str) -> String {
        format!(
            "data: {{\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\
             \"model\":\"gpt-4o-1\",\"choices\":[{{\"index\":0,\"delta\":{delta},\
             \"finish_reason\":{finish}}}]}}\n\n"
        )
    }

    fn out_usage(prompt: u64, completion: u64) -> String {
        format!(
            "data: {{\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\
             \"model\":\"gpt-4o-1\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\
             \"completion_tokens\":{completion},\"total_tokens\":{}}}}}\n\n",
            prompt + completion
        )
    }

    /// What the task does, without a server.
    struct Run {
        /// Every event the client gets, in order.
        client: String,
        /// The continuation requests asked for.
        requests: Vec<Value>,
        continuation: Option<ContinuationOutcome>,
    }

    /// Relays `parts` as the upstream's answer and its continuations (each part pushed in
    /// small pieces); a continuation asked for after the last part fails with `refused`.
    fn run(
        guards: &Guards,
        tools_offered: bool,
        parts: &[String],
        refused: ContinuationOutcome,
    ) -> Run {
        let mut rewriter = StreamRewriter::new(guards, tools_offered, SENT, 1 << 20);
        let mut client = Vec::new();
        let mut requests = Vec::new();
        let mut finish = None;
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                rewriter.continued();
            }
            for piece in part.as_bytes().chunks(7) {
                match rewriter.push(piece) {
                    Relay::Events(events) => client.extend(events),
                    Relay::TooLarge(error) => panic!("{error:?}"),
                }
            }
            let end = rewriter.end_part();
            client.extend(end.events);
            match end.next {
                Next::Done(done) => {
                    finish = Some(done);
                    break;
                }
                Next::Continue(request) => {
                    requests.push(serde_json::from_slice(&request).unwrap());
                }
            }
        }
        let finish = finish.unwrap_or_else(|| rewriter.give_up(refused));
        client.extend(finish.cut);
        client.extend(finish.claim);
        client.extend(finish.tail);
        let client = client
            .iter()
            .map(|b| std::str::from_utf8(b).unwrap())
            .collect();
        Run {
            client,
            requests,
            continuation: finish.continuation,
        }
    }

    #[test]
    fn an_answer_that_is_not_cut_goes_out_as_it_came() {
        let part = one_part("Hello there.", "stop");
        let run = run(
            &continuing(3),
            false,
            std::slice::from_ref(&part),
            ContinuationOutcome::Error,
        );
        // The usage chunk is rebuilt from the head: here the same bytes.
        assert_eq!(run.client, part);
        assert!(run.requests.is_empty());
        assert_eq!(run.continuation, None);
    }

    #[test]
    fn a_cut_answer_is_continued_as_one_answer_without_the_repeat() {
        let parts = [
            one_part("The quick brown", "length"),
            [
                role(2),
                text(2, " brown fox"),
                text(2, " jumps."),
                chunk(2, json!({}), Some("stop")),
                usage(2, 9, 4),
                DONE.to_owned(),
            ]
            .concat(),
        ];
        let run = run(&continuing(3), false, &parts, ContinuationOutcome::Error);
        let expected = [
            role(1),
            text(1, "The quick brown"),
            // The second part: re-stamped, no role chunk, its repeat of " brown" dropped.
            out(r#"{"content":" fox"}"#, "null"),
            out(r#"{"content":" jumps."}"#, "null"),
            out("{}", r#""stop""#),
            out_usage(14, 7),
            DONE.to_owned(),
        ]
        .concat();
        assert_eq!(run.client, expected);
        assert_eq!(run.continuation, Some(ContinuationOutcome::Completed));
        let [request] = run.requests.as_slice() else {
            panic!("{:?}", run.requests);
        };
        assert_eq!(
            request["messages"],
            json!([{"role": "user", "content": "Go"},
                {"role": "assistant", "content": "The quick brown"},
                {"role": "user", "content": "Go on"}])
        );
    }

    #[test]
    fn a_repeat_spread_over_chunks_is_held_back_then_dropped() {
        let parts = [
            [
                text(1, "and watched the ships"),
                chunk(1, json!({}), Some("length")),
            ]
            .concat(),
            // " the" may grow into a repeat: held until " ships" says it is one.
            [
                text(2, " the"),
                text(2, " ships"),
                text(2, " sail"),
                chunk(2, json!({}), Some("length")),
            ]
            .concat(),
            [
                text(3, "ships sail away."),
                chunk(3, json!({}), Some("stop")),
            ]
            .concat(),
        ];
        let run = run(&continuing(3), false, &parts, ContinuationOutcome::Error);
        let expected = [
            text(1, "and watched the ships"),
            out(r#"{"content":" sail"}"#, "null"),
            out(r#"{"content":" away."}"#, "null"),
            out("{}", r#""stop""#),
        ]
        .concat();
        assert_eq!(run.client, expected);
        assert_eq!(run.continuation, Some(ContinuationOutcome::Completed));
        let said: Vec<&Value> = run
            .requests
            .iter()
            .map(|r| &r["messages"][1]["content"])
            .collect();
        assert_eq!(
            said,
            [
                &json!("and watched the ships"),
                &json!("and watched the ships sail")
            ]
        );
    }

    #[test]
    fn a_failed_continuation_ends_the_answer_as_the_upstream_cut_it() {
        let part = one_part("The quick brown", "length");
        let run = run(
            &continuing(3),
            false,
            std::slice::from_ref(&part),
            ContinuationOutcome::Budget,
        );
        let expected = [
            role(1),
            text(1, "The quick brown"),
            // The held finish chunk, re-serialized.
            out("{}", r#""length""#),
            out_usage(5, 3),
            DONE.to_owned(),
        ]
        .concat();
        assert_eq!(run.client, expected);
        assert_eq!(run.continuation, Some(ContinuationOutcome::Budget));
        assert_eq!(run.requests.len(), 1);
    }

    #[test]
    fn the_last_allowed_part_ends_cut() {
        let parts = [
            [text(1, "One two"), chunk(1, json!({}), Some("length"))].concat(),
            [text(2, " three four"), chunk(2, json!({}), Some("length"))].concat(),
        ];
        let run = run(&continuing(1), false, &parts, ContinuationOutcome::Error);
        let expected = [
            text(1, "One two"),
            out(r#"{"content":" three four"}"#, "null"),
            out("{}", r#""length""#),
        ]
        .concat();
        assert_eq!(run.client, expected);
        assert_eq!(run.continuation, Some(ContinuationOutcome::MaxAttempts));
        assert_eq!(run.requests.len(), 1);
    }

    #[test]
    fn an_upstream_error_in_a_continuation_is_relayed_and_the_cut_answer_stands() {
        let error = "data: {\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}\n\n";
        let parts = [
            [
                text(1, "The quick brown"),
                chunk(1, json!({}), Some("length")),
                usage(1, 5, 3),
                DONE.to_owned(),
            ]
            .concat(),
            [text(2, " fox"), error.to_owned()].concat(),
        ];
        let run = run(&continuing(3), false, &parts, ContinuationOutcome::Error);
        let expected = [
            text(1, "The quick brown"),
            out(r#"{"content":" fox"}"#, "null"),
            error.to_owned(),
            // The first part's finish; no `[DONE]`: the last part did not send one.
            out("{}", r#""length""#),
            out_usage(5, 3),
        ]
        .concat();
        assert_eq!(run.client, expected);
        assert_eq!(run.continuation, Some(ContinuationOutcome::Error));
    }

    #[test]
    fn an_event_too_large_cuts_the_answer_with_an_error_event() {
        let guards = continuing(3);
        let mut rewriter = StreamRewriter::new(&guards, false, SENT, 120);
        let first = text(1, "Hello");
        assert_eq!(
            rewriter.push(first.as_bytes()),
            Relay::Events(vec![Bytes::from(first)])
        );
        let large = format!("data: {}", "x".repeat(200));
        let Relay::TooLarge(error) = rewriter.push(large.as_bytes()) else {
            panic!("relayed");
        };
        assert_eq!(
            error,
            "data: {\"error\":{\"message\":\"The upstream stream was cut: a stream event is \
             larger than 120 bytes (upstream.max_event_bytes)\",\"type\":\"server_error\",\
             \"param\":null,\"code\":\"event_too_large\"}}\n\n"
        );
    }

    #[test]
    fn a_claimed_action_without_a_tool_call_is_flagged_after_the_answer() {
        let guards = Guards {
            action_check: ActionCheckConfig {
                enabled: true,
                ..ActionCheckConfig::default()
            },
            ..Guards::default()
        };
        let claim = [
            text(1, "Done! The meeting is booked."),
            chunk(1, json!({}), Some("stop")),
            DONE.to_owned(),
        ]
        .concat();
        let flagged = [
            text(1, "Done! The meeting is booked."),
            chunk(1, json!({}), Some("stop")),
            ": x-ctxproxy-warning: action-claimed-without-tool-call\n\n".to_owned(),
            DONE.to_owned(),
        ]
        .concat();
        let claimed = run(
            &guards,
            true,
            std::slice::from_ref(&claim),
            ContinuationOutcome::Error,
        );
        assert_eq!(claimed.client, flagged);
        // Without tools offered, or with a tool call, nothing is said.
        let no_tools = run(
            &guards,
            false,
            std::slice::from_ref(&claim),
            ContinuationOutcome::Error,
        );
        assert_eq!(no_tools.client, claim);
        let called = [
            text(1, "Done!"),
            chunk(1, json!({"tool_calls": [{"index": 0, "id": "t"}]}), None),
            chunk(1, json!({}), Some("tool_calls")),
        ]
        .concat();
        let with_call = run(
            &guards,
            true,
            std::slice::from_ref(&called),
            ContinuationOutcome::Error,
        );
        assert_eq!(with_call.client, called);
    }

    #[test]
    fn chunk_shapes_it_does_not_know_are_left_alone() {
        let mut chunk = json!({"id": "x", "choices": "none"});
        set_delta(&mut chunk, json!({"content": "a"}));
        set_finish(&mut chunk, json!("stop"));
        assert_eq!(chunk, json!({"id": "x", "choices": "none"}));
        assert!(!has_delta(&chunk));
        assert!(!has_delta(
            &json!({"choices": [{"delta": {"content": null}}]})
        ));
        let mut later = json!({"id": "b", "created": 2, "model": "m2", "system_fingerprint": "f",
            "choices": [{"delta": {"role": "assistant", "content": ""}}]});
        restamp(
            &mut later,
            &json!({"id": "a", "created": 1, "model": "m1", "object": "o"}),
        );
        assert_eq!(
            later,
            json!({"id": "a", "created": 1, "model": "m1", "system_fingerprint": "f",
                "choices": [{"delta": {}}]})
        );
    }
}
