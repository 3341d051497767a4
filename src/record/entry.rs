//! One recorded exchange, gathered on the request path as cheap clones (bodies are `Bytes`),
//! and its JSON line, built on the writer thread: the request path never serializes.

use axum::http::HeaderMap;
use bytes::Bytes;
use serde::Serialize;
use serde::de::IgnoredAny;
use serde_json::{Map, Value};

use crate::body::BodyEnd;
use crate::cache::assemble::StreamAssembler;
use crate::openai::ChatCompletionChunk;
use crate::openai::sse::{SseSplitter, event_data};
use crate::pipeline::PipelineReport;

/// Request headers that are never written, whatever the configuration says.
const ALWAYS_REDACTED: [&str; 5] = [
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-api-key",
    "api-key",
];

/// What is known of one chat exchange; filled in as the request goes through the proxy.
#[derive(Debug, Default)]
pub struct Exchange {
    pub unix_ms: u64,
    pub request_id: String,
    pub tenant: String,
    pub headers: HeaderMap,
    /// The body the client sent, and whether it parsed as a chat request.
    pub request: Bytes,
    pub request_is_json: bool,
    pub model: Option<String>,
    pub conversation_id: Option<String>,
    pub mode: Option<&'static str>,
    /// The body sent upstream, when the pipeline changed it.
    pub rewritten: Option<Bytes>,
    pub report: Option<PipelineReport>,
    pub pipeline_ms: Option<f64>,
    pub upstream_ms: Option<f64>,
    pub status: u16,
    pub cache: Option<String>,
    pub streamed: bool,
    /// Every data frame of the response, as sent (streams: SSE events).
    pub response: Vec<Bytes>,
    pub response_truncated: bool,
    pub ttfb_ms: Option<f64>,
    pub total_ms: f64,
    pub end: Option<BodyEnd>,
}

impl Exchange {
    /// About the bytes the exchange holds: its bodies and headers.
    pub fn approximate_bytes(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 32)
            .sum();
        self.request.len()
            + self.rewritten.as_ref().map_or(0, Bytes::len)
            + self.response.iter().map(|b| b.len() + 32).sum::<usize>()
            + headers
            + std::mem::size_of::<Exchange>()
    }
}

#[derive(Serialize)]
struct Head<'a> {
    time: String,
    unix_ms: u64,
    request_id: &'a str,
    tenant: &'a str,
    conversation_id: Option<&'a str>,
    model: Option<&'a str>,
    mode: Option<&'a str>,
    status: u16,
    stream: bool,
    cache: Option<&'a str>,
    end: &'static str,
    tokens: Option<Tokens<'a>>,
    usage: Option<Value>,
    timings_ms: Timings,
    headers: Map<String, Value>,
}

#[derive(Serialize)]
struct Tokens<'a> {
    before: usize,
    after: usize,
    budget: usize,
    fits: bool,
    /// By how much, and which part of the floor is over (null when it fits).
    over_budget: Option<crate::pipeline::OverBudget>,
    saved_by_stage: Map<String, Value>,
    stages: &'a [crate::pipeline::StageReport],
}

#[derive(Serialize)]
struct Timings {
    pipeline: Option<f64>,
    upstream: Option<f64>,
    ttfb: Option<f64>,
    total: f64,
}

impl Exchange {
    /// The exchange as one JSON line (ending in `\n`): small fields first, then the request,
    /// the rewritten request and the response (a stream's events assembled into a completion).
    pub fn to_line(&self, redact: &[String]) -> Vec<u8> {
        let response = self.response_value();
        let usage = match &response {
            Embedded::Value(v) => v.get("usage").filter(|u| u.is_object()).cloned(),
            _ => None,
        };
        let head = Head {
            time: rfc3339(self.unix_ms),
            unix_ms: self.unix_ms,
            request_id: &self.request_id,
            tenant: &self.tenant,
            conversation_id: self.conversation_id.as_deref(),
            model: self.model.as_deref(),
            mode: self.mode,
            status: self.status,
            stream: self.streamed,
            cache: self.cache.as_deref(),
            end: self.end.unwrap_or(BodyEnd::Dropped).as_str(),
            tokens: self.report.as_ref().map(|r| Tokens {
                before: r.tokens_before,
                after: r.tokens_after,
                budget: r.budget,
                fits: r.fits,
                over_budget: r.over_budget,
                saved_by_stage: r
                    .savings_by_stage()
                    .into_iter()
                    .map(|(stage, saved)| (stage.as_str().to_owned(), Value::from(saved)))
                    .collect(),
                stages: &r.stages,
            }),
            usage,
            timings_ms: Timings {
                pipeline: self.pipeline_ms,
                upstream: self.upstream_ms,
                ttfb: self.ttfb_ms,
                total: self.total_ms,
            },
            headers: recorded_headers(&self.headers, redact),
        };
        let mut line = serde_json::to_vec(&head).unwrap_or_else(|_| b"{}".to_vec());
        line.pop(); // the closing brace; the bodies follow
        line.extend_from_slice(b",\"request\":");
        embed(&mut line, self.request_is_json, &self.request);
        line.extend_from_slice(b",\"rewritten\":");
        match &self.rewritten {
            Some(body) => embed(&mut line, true, body),
            None => line.extend_from_slice(b"null"),
        }
        line.extend_from_slice(b",\"response\":");
        match response {
            Embedded::Value(value) => {
                let _ = serde_json::to_writer(&mut line, &value);
            }
            Embedded::Raw(bytes) => embed(&mut line, true, &bytes),
            Embedded::Text(text) => {
                let _ = serde_json::to_writer(&mut line, &text);
            }
            Embedded::None => line.extend_from_slice(b"null"),
        }
        if self.response_truncated {
            line.extend_from_slice(b",\"response_truncated\":true");
        }
        line.extend_from_slice(b"}\n");
        line
    }

    fn response_value(&self) -> Embedded {
        if self.response_truncated || self.response.is_empty() {
            return Embedded::None;
        }
        let whole: Vec<u8> = self.response.concat();
        if self.streamed {
            return match assemble(&whole) {
                Some(completion) => Embedded::Value(completion),
                None => Embedded::Text(String::from_utf8_lossy(&whole).into_owned()),
            };
        }
        // Small answers are parsed (for `usage`); the rest are checked and embedded as sent.
        if whole.len() <= 64 * 1024
            && let Ok(value) = serde_json::from_slice::<Value>(&whole)
        {
            return Embedded::Value(value);
        }
        if serde_json::from_slice::<IgnoredAny>(&whole).is_ok() {
            Embedded::Raw(whole)
        } else {
            Embedded::Text(String::from_utf8_lossy(&whole).into_owned())
        }
    }
}

enum Embedded {
    Value(Value),
    /// Valid JSON, embedded without parsing.
    Raw(Vec<u8>),
    Text(String),
    None,
}

/// Appends a body: valid JSON as itself on one line (a raw newline can only be whitespace in
/// JSON), anything else as a JSON string.
fn embed(line: &mut Vec<u8>, is_json: bool, body: &[u8]) {
    if is_json {
        line.extend(body.iter().copied().filter(|b| !matches!(b, b'\n' | b'\r')));
    } else {
        let _ = serde_json::to_writer(&mut *line, &String::from_utf8_lossy(body));
    }
}

/// A stream's events assembled into one completion (with `usage` when the stream had it).
fn assemble(stream: &[u8]) -> Option<Value> {
    let mut splitter = SseSplitter::new();
    splitter.push(stream);
    let mut assembler = StreamAssembler::default();
    let mut events = Vec::new();
    while let Ok(Some(event)) = splitter.next_event() {
        events.push(event);
    }
    events.extend(splitter.finish());
    for event in events {
        match event_data(&event).as_deref() {
            Some("[DONE]") | None => {}
            Some(payload) => {
                assembler.push(serde_json::from_str::<ChatCompletionChunk>(payload).ok()?)
            }
        }
    }
    serde_json::to_value(assembler.finish()?).ok()
}

fn recorded_headers(headers: &HeaderMap, redact: &[String]) -> Map<String, Value> {
    let mut out = Map::new();
    for (name, value) in headers {
        let name = name.as_str();
        if ALWAYS_REDACTED.contains(&name) || redact.iter().any(|r| r.eq_ignore_ascii_case(name)) {
            continue;
        }
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        match out.get_mut(name) {
            Some(Value::String(existing)) => {
                existing.push_str(", ");
                existing.push_str(&value);
            }
            _ => {
                out.insert(name.to_owned(), Value::String(value));
            }
        }
    }
    out
}

/// `2026-11-22T10:15:30.123Z` for milliseconds since the Unix epoch (UTC).
pub fn rfc3339(unix_ms: u64) -> String {
    let (secs, ms) = (unix_ms / 1000, unix_ms % 1000);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm), over a 400-year era.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_346_130_123), "2026-11-22T11:15:30.123Z");
    }

    #[test]
    fn a_line_is_one_json_object_without_secrets() {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", "Bearer sk-secret".parse().unwrap());
        headers.insert("x-team-token", "team-secret".parse().unwrap());
        headers.insert("x-ctxproxy-mode", "optimize".parse().unwrap());
        let exchange = Exchange {
            unix_ms: 1_000,
            request_id: "r1".into(),
            tenant: "t".into(),
            headers,
            request: Bytes::from_static(b"{\n  \"model\": \"m\",\n  \"messages\": []\n}"),
            request_is_json: true,
            status: 200,
            streamed: true,
            response: vec![
                Bytes::from_static(b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hel\"},\"finish_reason\":null}]}\n\n"),
                Bytes::from_static(b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n"),
            ],
            end: Some(BodyEnd::Complete),
            ..Exchange::default()
        };
        let line = exchange.to_line(&["X-Team-Token".to_owned()]);
        assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
        let text = String::from_utf8(line).unwrap();
        assert!(!text.contains("secret"), "{text}");
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["request"]["model"], "m");
        assert_eq!(value["headers"]["x-ctxproxy-mode"], "optimize");
        assert_eq!(
            value["response"]["choices"][0]["message"]["content"],
            "Hello"
        );
        assert_eq!(value["end"], "complete");
        assert_eq!(value["rewritten"], Value::Null);
    }

    #[test]
    fn bodies_that_are_not_json_are_kept_as_text() {
        let exchange = Exchange {
            request: Bytes::from_static(b"not json\n"),
            response: vec![Bytes::from_static(b"oops")],
            ..Exchange::default()
        };
        let value: Value = serde_json::from_slice(&exchange.to_line(&[])).unwrap();
        assert_eq!(value["request"], "not json\n");
        assert_eq!(value["response"], "oops");
    }
}
