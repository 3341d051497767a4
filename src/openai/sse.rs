//! Splits a server-sent-events byte stream into whole events, so the proxy can relay (and later
//! inspect) one event at a time whatever way the upstream cut its frames, and judges how a chat
//! completion stream ended from its events: complete, failed with an error event, or early.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde::de::IgnoredAny;

/// Accumulates bytes and hands out complete events, each with its terminating blank line, in
/// time linear in the bytes pushed (a long unterminated event is scanned once, not once per
/// push), holding at most `max_event` bytes of an event.
#[derive(Debug)]
pub struct SseSplitter {
    buffer: BytesMut,
    /// Bytes at the start of `buffer` already searched for a terminator.
    searched: usize,
    max_event: usize,
}

impl Default for SseSplitter {
    fn default() -> Self {
        SseSplitter::new()
    }
}

/// An event longer than the splitter's maximum: the stream cannot be relayed event by event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a stream event is larger than {max} bytes")]
pub struct EventTooLarge {
    pub max: usize,
}

impl SseSplitter {
    /// No bound on an event's size (for recorded streams already in memory).
    pub fn new() -> Self {
        SseSplitter::with_max_event(usize::MAX)
    }

    pub fn with_max_event(max_event: usize) -> Self {
        SseSplitter {
            buffer: BytesMut::new(),
            searched: 0,
            max_event,
        }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// Pushes `bytes` and takes every event they complete, in order; an error once the
    /// incomplete event held is larger than the maximum.
    pub fn push_events(&mut self, bytes: &[u8]) -> Result<Vec<Bytes>, EventTooLarge> {
        self.push(bytes);
        let mut events = Vec::new();
        while let Some(event) = self.next_event()? {
            events.push(event);
        }
        Ok(events)
    }

    /// The next complete event (including its `\n\n` or `\r\n\r\n` terminator), if any; an
    /// error once the incomplete event held is larger than the maximum.
    pub fn next_event(&mut self) -> Result<Option<Bytes>, EventTooLarge> {
        // A terminator may straddle what was searched and what was pushed since.
        let from = self.searched.saturating_sub(2);
        match event_end(&self.buffer, from) {
            Some(end) => {
                self.searched = 0;
                Ok(Some(self.buffer.split_to(end).freeze()))
            }
            None if self.buffer.len() > self.max_event => Err(EventTooLarge {
                max: self.max_event,
            }),
            None => {
                self.searched = self.buffer.len();
                Ok(None)
            }
        }
    }

    /// What is left after the stream ended. An unterminated last event is incomplete and is
    /// dropped, as the SSE spec says, so that nothing written after it merges with it; only one
    /// whose data is whole (`[DONE]` or a JSON object: an upstream that left out the last blank
    /// line) is given back, terminated.
    pub fn finish(&mut self) -> Option<Bytes> {
        self.searched = 0;
        let tail = self.buffer.split().freeze();
        let data = event_data(&tail)?;
        let whole = is_done(&data)
            || (data.trim_start().starts_with('{')
                && serde_json::from_str::<IgnoredAny>(&data).is_ok());
        whole.then(|| {
            let mut event = BytesMut::from(tail.trim_ascii_end());
            event.extend_from_slice(b"\n\n");
            event.freeze()
        })
    }
}

/// Index just past the first blank line (`\n\n`, `\r\n\r\n` or `\n\r\n`) at or after `from`.
fn event_end(buffer: &[u8], mut from: usize) -> Option<usize> {
    while let Some(offset) = memchr::memchr(b'\n', &buffer[from..]) {
        let i = from + offset;
        let rest = &buffer[i + 1..];
        if rest.first() == Some(&b'\n') {
            return Some(i + 2);
        }
        if rest.starts_with(b"\r\n") {
            return Some(i + 3);
        }
        from = i + 1;
    }
    None
}

/// The event that ends a stream the proxy had to cut because an upstream event was too large:
/// an OpenAI-format error, as the API sends mid-stream.
pub fn event_too_large_event(error: EventTooLarge) -> Bytes {
    error_event(
        &format!("The upstream stream was cut: {error} (upstream.max_event_bytes)"),
        "event_too_large",
    )
}

/// The same for a Responses API stream: its `error` event.
pub fn responses_event_too_large_event(error: EventTooLarge) -> Bytes {
    let event = serde_json::json!({
        "type": "error",
        "code": "event_too_large",
        "message": format!("The upstream stream was cut: {error} (upstream.max_event_bytes)"),
        "param": null,
    });
    Bytes::from(format!("event: error\ndata: {event}\n\n"))
}

/// An OpenAI-format error as an SSE event.
fn error_event(message: &str, code: &str) -> Bytes {
    let body = serde_json::json!({"error": {
        "message": message,
        "type": "server_error",
        "param": null,
        "code": code,
    }});
    Bytes::from(format!("data: {body}\n\n"))
}

/// Whether an event's data is `[DONE]`, the end of an OpenAI stream (whitespace around it
/// allowed).
pub fn is_done(data: &str) -> bool {
    data.trim() == "[DONE]"
}

/// Whether every choice of an answer finished: at least one choice, and a finish reason for
/// each (`finished`: one flag per choice). A stream whose choices did not all finish was cut.
pub fn all_finished(finished: impl IntoIterator<Item = bool>) -> bool {
    let mut any = false;
    for one in finished {
        if !one {
            return false;
        }
        any = true;
    }
    any
}

/// How a chat completion stream ended, judged from its events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// `data: [DONE]`; or, as some OpenAI-compatible servers end a complete answer without
    /// `[DONE]`, every choice seen finished and the usage chunk came when it was asked for.
    Complete,
    /// An error event said why it failed (its code and message).
    Failed(String),
    /// Neither: the stream stopped before its end.
    Early,
}

/// What of a chunk tells how the stream ends (the rest of it is skipped, not kept).
#[derive(Deserialize)]
struct ChunkEnd {
    choices: Option<Vec<ChoiceEnd>>,
    usage: Option<IgnoredAny>,
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct ChoiceEnd {
    #[serde(default)]
    index: u32,
    finish_reason: Option<IgnoredAny>,
}

/// Watches the events of a chat completion stream (or, [`StreamProgress::responses`], of a
/// Responses API stream), one at a time, for how it ends.
#[derive(Debug, Default)]
pub struct StreamProgress {
    /// A Responses API stream: `response.completed` or `response.incomplete` ends it,
    /// `response.failed` and `error` say it failed.
    responses: bool,
    done: bool,
    /// The choices seen, by index: whether each finished.
    choices: BTreeMap<u32, bool>,
    /// A chunk carried usage.
    usage: bool,
    failed: Option<String>,
}

impl StreamProgress {
    /// The progress of a Responses API stream.
    pub fn responses() -> StreamProgress {
        StreamProgress {
            responses: true,
            ..StreamProgress::default()
        }
    }

    pub fn see(&mut self, event: &[u8]) {
        let Some(data) = event_data(event) else {
            return;
        };
        if self.responses {
            self.see_responses_event(&data);
            return;
        }
        if is_done(&data) {
            self.done = true;
            return;
        }
        let Ok(chunk) = serde_json::from_str::<ChunkEnd>(&data) else {
            return;
        };
        if self.failed.is_none() {
            self.failed = error_in(&chunk);
        }
        self.usage |= chunk.usage.is_some();
        for choice in chunk.choices.into_iter().flatten() {
            *self.choices.entry(choice.index).or_default() |= choice.finish_reason.is_some();
        }
    }

    fn see_responses_event(&mut self, data: &str) {
        #[derive(Deserialize)]
        struct Event {
            #[serde(rename = "type")]
            kind: String,
            code: Option<serde_json::Value>,
            message: Option<serde_json::Value>,
            response: Option<serde_json::Value>,
        }
        let Ok(event) = serde_json::from_str::<Event>(data) else {
            return;
        };
        match event.kind.as_str() {
            "response.completed" | "response.incomplete" => self.done = true,
            "response.failed" => {
                let error = event.response.as_ref().and_then(|r| r.get("error"));
                let text = |key: &str| error.and_then(|e| e.get(key)).and_then(|v| v.as_str());
                self.failed.get_or_insert_with(|| {
                    format!(
                        "{}: {}",
                        text("code").unwrap_or("failed"),
                        text("message").unwrap_or("")
                    )
                });
            }
            "error" => {
                let text = |v: &Option<serde_json::Value>| {
                    v.as_ref().and_then(|v| v.as_str()).unwrap_or("").to_owned()
                };
                let code = Some(text(&event.code)).filter(|c| !c.is_empty());
                self.failed.get_or_insert_with(|| {
                    format!(
                        "{}: {}",
                        code.as_deref().unwrap_or("error"),
                        text(&event.message)
                    )
                });
            }
            _ => {}
        }
    }

    /// `data: [DONE]` was seen: the stream is over, whatever may follow.
    pub fn done(&self) -> bool {
        self.done
    }

    /// How the stream ended, if it ended after the events seen; `usage_asked`: the request
    /// asked for usage (`stream_options.include_usage`), so a complete stream carries it.
    pub fn ending(&self, usage_asked: bool) -> Ending {
        let finished = all_finished(self.choices.values().copied());
        match &self.failed {
            Some(error) => Ending::Failed(error.clone()),
            None if self.done || (finished && (self.usage || !usage_asked)) => Ending::Complete,
            None => Ending::Early,
        }
    }

    /// The stream carried an error event.
    pub fn failed(&self) -> bool {
        self.failed.is_some()
    }
}

/// The code and message of an OpenAI-format error event (an `error` object, no `choices`).
fn error_in(chunk: &ChunkEnd) -> Option<String> {
    let error = chunk
        .error
        .as_ref()
        .filter(|e| e.is_object() && chunk.choices.is_none())?;
    let text = |key: &str| error.get(key).and_then(serde_json::Value::as_str);
    let code = text("code").or_else(|| text("type")).unwrap_or("error");
    Some(format!("{code}: {}", text("message").unwrap_or("")))
}

/// The JSON object an event's data holds; `None` for a comment, a keep-alive, or data that is
/// not a JSON object.
pub fn event_object(event: &[u8]) -> Option<serde_json::Value> {
    event_data(event)
        .and_then(|data| serde_json::from_str::<serde_json::Value>(&data).ok())
        .filter(serde_json::Value::is_object)
}

/// The `data:` payload of one event, with multi-line data joined by `\n` (SSE rules).
/// `None` for events without data (comments, keep-alives).
pub fn event_data(event: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(event).ok()?;
    let mut data: Option<String> = None;
    for line in text.lines() {
        let Some(value) = line.strip_prefix("data:") else {
            continue;
        };
        let value = value.strip_prefix(' ').unwrap_or(value);
        match &mut data {
            Some(existing) => {
                existing.push('\n');
                existing.push_str(value);
            }
            None => data = Some(value.to_owned()),
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(chunks: &[&[u8]]) -> Vec<Bytes> {
        let mut splitter = SseSplitter::new();
        let mut events = Vec::new();
        for chunk in chunks {
            splitter.push(chunk);
            while let Some(event) = splitter.next_event().unwrap() {
                events.push(event);
            }
        }
        events.extend(splitter.finish());
        events
    }

    #[test]
    fn events_cut_anywhere_come_out_whole() {
        let stream: &[u8] = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let events = split_all(&[&stream[..cut], &stream[cut..]]);
            assert_eq!(events.len(), 3, "cut at {cut}");
            assert_eq!(events.concat(), stream);
        }
    }

    #[test]
    fn crlf_terminators_and_an_incomplete_tail_dropped() {
        let events = split_all(&[b": ping\r\n\r\ndata: x\r\n\r\ndata: tail"]);
        assert_eq!(
            events,
            vec![
                Bytes::from_static(b": ping\r\n\r\n"),
                Bytes::from_static(b"data: x\r\n\r\n"),
            ]
        );
    }

    #[test]
    fn terminators_split_across_pushes_are_found() {
        for stream in [
            &b"data: a\n\ndata: b\n\n"[..],
            b"data: a\r\n\r\ndata: b\r\n\r\n",
        ] {
            let chunks: Vec<&[u8]> = stream.chunks(1).collect();
            assert_eq!(split_all(&chunks).concat(), stream);
            assert_eq!(split_all(&chunks).len(), 2);
        }
    }

    #[test]
    fn an_event_over_the_maximum_is_an_error_not_a_buffer() {
        let mut splitter = SseSplitter::with_max_event(64);
        splitter.push(b"data: small\n\n");
        assert!(splitter.next_event().unwrap().is_some());
        for _ in 0..10 {
            splitter.push(b"data: x\n");
        }
        assert_eq!(splitter.next_event(), Err(EventTooLarge { max: 64 }));
    }

    fn ending_of(events: &[&[u8]], usage_asked: bool) -> Ending {
        let mut progress = StreamProgress::default();
        events.iter().for_each(|e| progress.see(e));
        progress.ending(usage_asked)
    }

    const TEXT: &[u8] = br#"data: {"choices":[{"index":0,"delta":{"content":"a \"finish_reason\": \"x"},"finish_reason":null}]}

"#;
    const FINISH: &[u8] = br#"data: {"choices":[{"index":0,"delta":{},"finish_reason": "stop"}]}

"#;
    const USAGE: &[u8] = b"data: {\"choices\":[],\"usage\":{\"total_tokens\":3}}\n\n";
    const DONE: &[u8] = b"data: [DONE]\n\n";

    #[test]
    fn a_stream_ends_complete_failed_or_early() {
        assert_eq!(ending_of(&[TEXT], false), Ending::Early);
        assert_eq!(ending_of(&[TEXT, FINISH], false), Ending::Complete);
        assert_eq!(ending_of(&[TEXT, DONE], false), Ending::Complete);
        let error =
            br#"data: {"error":{"message":"gone","type":"server_error","param":null,"code":"boom"}}

"#;
        assert_eq!(
            ending_of(&[TEXT, error, DONE], false),
            Ending::Failed("boom: gone".into())
        );
    }

    #[test]
    fn complete_is_every_choice_finished_and_the_usage_asked_for_or_done() {
        // Usage asked: the finish alone is not the end, the usage chunk (or `[DONE]`) is.
        assert_eq!(ending_of(&[TEXT, FINISH], true), Ending::Early);
        assert_eq!(ending_of(&[TEXT, FINISH, USAGE], true), Ending::Complete);
        assert_eq!(ending_of(&[TEXT, FINISH, DONE], true), Ending::Complete);
        // Two choices: both must finish.
        let second =
            br#"data: {"choices":[{"index":1,"delta":{"content":"b"},"finish_reason":null}]}

"#;
        let second_finish = br#"data: {"choices":[{"index":1,"delta":{},"finish_reason":"stop"}]}

"#;
        assert_eq!(ending_of(&[TEXT, second, FINISH], false), Ending::Early);
        assert_eq!(
            ending_of(&[TEXT, second, FINISH, second_finish], false),
            Ending::Complete
        );
        assert_eq!(ending_of(&[USAGE], false), Ending::Early);
        assert!(!all_finished([]));
        assert!(all_finished([true, true]));
        assert!(!all_finished([true, false]));
    }

    #[test]
    fn only_an_error_object_is_a_failure() {
        let keepalive = b"data: {\"error\": null, \"object\": \"keepalive\"}\n\n";
        assert_eq!(
            ending_of(&[keepalive, TEXT, FINISH], false),
            Ending::Complete
        );
        let text_error = b"data: {\"error\": \"a string\"}\n\n";
        assert_eq!(ending_of(&[text_error, TEXT], false), Ending::Early);
    }

    #[test]
    fn done_with_whitespace_around_it_is_done() {
        assert!(is_done("[DONE] "));
        assert!(is_done(" [DONE]\r"));
        assert!(!is_done("[DONE]x"));
        assert_eq!(
            ending_of(&[TEXT, b"data: [DONE] \n\n"], true),
            Ending::Complete
        );
    }

    #[test]
    fn an_unterminated_last_event_is_dropped_unless_its_data_is_whole() {
        let finish = |tail: &[u8]| {
            let mut splitter = SseSplitter::new();
            splitter.push(tail);
            assert_eq!(splitter.next_event(), Ok(None));
            splitter.finish()
        };
        assert_eq!(
            finish(b"data: {\"choices\":[{\"delta\":{\"content\":\"Wor"),
            None
        );
        assert_eq!(finish(b"data: [DON"), None);
        assert_eq!(finish(b": comment"), None);
        assert_eq!(finish(b""), None);
        assert_eq!(
            finish(b"data: [DONE]\n").as_deref(),
            Some(&b"data: [DONE]\n\n"[..])
        );
        assert_eq!(
            finish(b"data: {\"a\":1}").as_deref(),
            Some(&b"data: {\"a\":1}\n\n"[..])
        );
    }

    #[test]
    fn data_lines_are_joined() {
        assert_eq!(
            event_data(b"event: m\ndata: a\ndata:b\n\n").as_deref(),
            Some("a\nb")
        );
        assert_eq!(event_data(b": keep-alive\n\n"), None);
    }
}
