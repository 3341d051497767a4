//! Splits a server-sent-events byte stream into whole events, so the proxy can relay (and later
//! inspect) one event at a time whatever way the upstream cut its frames.

use bytes::{Bytes, BytesMut};

/// Accumulates bytes and hands out complete events, each with its terminating blank line.
#[derive(Debug, Default)]
pub struct SseSplitter {
    buffer: BytesMut,
}

impl SseSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// The next complete event (including its `\n\n` or `\r\n\r\n` terminator), if any.
    pub fn next_event(&mut self) -> Option<Bytes> {
        let end = event_end(&self.buffer)?;
        Some(self.buffer.split_to(end).freeze())
    }

    /// What is left after the stream ended: an unterminated last event, if any.
    pub fn finish(&mut self) -> Option<Bytes> {
        (!self.buffer.is_empty()).then(|| self.buffer.split().freeze())
    }
}

/// Index just past the first blank line (`\n\n`, `\r\n\r\n` or `\n\r\n`), if there is one.
fn event_end(buffer: &[u8]) -> Option<usize> {
    let mut from = 0;
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
            while let Some(event) = splitter.next_event() {
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
    fn data_lines_are_joined() {
        assert_eq!(
            event_data(b"event: m\ndata: a\ndata:b\n\n").as_deref(),
            Some("a\nb")
        );
        assert_eq!(event_data(b": keep-alive\n\n"), None);
    }
}
