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

    #[test]
    fn data_lines_are_joined() {
        assert_eq!(
            event_data(b"event: m\ndata: a\ndata:b\n\n").as_deref(),
            Some("a\nb")
        );
        assert_eq!(event_data(b": keep-alive\n\n"), None);
    }
}
