//! Splits a server-sent-events byte stream into whole events, so the proxy can relay (and later
//! inspect) one event at a time whatever way the upstream cut its frames.

use bytes::{Bytes, BytesMut};

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

    /// What is left after the stream ended: an unterminated last event, if any.
    pub fn finish(&mut self) -> Option<Bytes> {
        self.searched = 0;
        (!self.buffer.is_empty()).then(|| self.buffer.split().freeze())
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

/// An OpenAI-format error as an SSE event: how a stream says it failed after its headers.
pub fn error_event(message: &str, code: &str) -> Bytes {
    let body = serde_json::json!({"error": {
        "message": message,
        "type": "server_error",
        "param": null,
        "code": code,
    }});
    Bytes::from(format!("data: {body}\n\n"))
}

/// How a chat completion stream ended, judged from its events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// `data: [DONE]`, or a finish reason: some OpenAI-compatible servers end a complete answer
    /// without `[DONE]`.
    Complete,
    /// An error event said why it failed (its code and message).
    Failed(String),
    /// Neither: the stream stopped before its end.
    Early,
}

/// Watches the events of a chat completion stream, one at a time, for how it ends. Each event
/// is scanned for a few byte patterns; only a likely error event is parsed.
#[derive(Debug, Default)]
pub struct StreamProgress {
    done: bool,
    finished: bool,
    failed: Option<String>,
}

impl StreamProgress {
    pub fn see(&mut self, event: &[u8]) {
        if self.failed.is_none() {
            self.failed = error_in(event);
        }
        self.finished |= has_finish_reason(event);
        self.done |= memchr::memmem::find(event, b"[DONE]").is_some()
            && event_data(event).as_deref() == Some("[DONE]");
    }

    /// How the stream ended, if it ended after the events seen.
    pub fn ending(&self) -> Ending {
        match &self.failed {
            Some(error) => Ending::Failed(error.clone()),
            None if self.done || self.finished => Ending::Complete,
            None => Ending::Early,
        }
    }
}

/// Whether an event carries a finish reason that is a string (not `null`).
fn has_finish_reason(event: &[u8]) -> bool {
    const KEY: &[u8] = b"\"finish_reason\"";
    memchr::memmem::find_iter(event, KEY).any(|at| {
        let rest = &event[at + KEY.len()..];
        let rest = rest.trim_ascii_start();
        rest.strip_prefix(b":")
            .is_some_and(|value| value.trim_ascii_start().starts_with(b"\""))
    })
}

/// The code and message of an OpenAI-format error event (`{"error": {...}}`, no `choices`).
pub fn error_in(event: &[u8]) -> Option<String> {
    memchr::memmem::find(event, b"\"error\"")?;
    let payload: serde_json::Value = serde_json::from_str(&event_data(event)?).ok()?;
    let error = payload
        .get("error")
        .filter(|_| payload.get("choices").is_none())?;
    let text = |key: &str| error.get(key).and_then(serde_json::Value::as_str);
    let code = text("code").or_else(|| text("type")).unwrap_or("error");
    Some(format!("{code}: {}", text("message").unwrap_or("")))
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
    fn crlf_terminators_and_unterminated_tail() {
        let events = split_all(&[b": ping\r\n\r\ndata: x\r\n\r\ndata: tail"]);
        assert_eq!(
            events,
            vec![
                Bytes::from_static(b": ping\r\n\r\n"),
                Bytes::from_static(b"data: x\r\n\r\n"),
                Bytes::from_static(b"data: tail"),
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

    fn ending_of(events: &[&[u8]]) -> Ending {
        let mut progress = StreamProgress::default();
        events.iter().for_each(|e| progress.see(e));
        progress.ending()
    }

    #[test]
    fn a_stream_ends_complete_failed_or_early() {
        let text = br#"data: {"choices":[{"index":0,"delta":{"content":"a \"finish_reason\": \"x"},"finish_reason":null}]}

"#;
        let finish = br#"data: {"choices":[{"index":0,"delta":{},"finish_reason": "stop"}]}

"#;
        assert_eq!(ending_of(&[text]), Ending::Early);
        assert_eq!(ending_of(&[text, finish]), Ending::Complete);
        assert_eq!(ending_of(&[text, b"data: [DONE]\n\n"]), Ending::Complete);
        let error =
            br#"data: {"error":{"message":"gone","type":"server_error","param":null,"code":"boom"}}

"#;
        assert_eq!(
            ending_of(&[text, error, b"data: [DONE]\n\n"]),
            Ending::Failed("boom: gone".into())
        );
        assert_eq!(error_in(text), None);
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
