//! Failures after a 200, steered by request headers: `X-Mock-Stream-Fault` makes an answer fail
//! midway (`reset-after=N`: the connection is aborted after N stream events; `stall-after=N`:
//! nothing more is sent, the connection stays open; `early-end-after=N`: the body ends cleanly
//! there, without a finish reason or `[DONE]`; `cut-mid-event-after=N`: the body ends cleanly in
//! the middle of the event after the N first), `X-Mock-Invalid-Json: 1` answers 200 with a
//! body that is not JSON, and `X-Mock-Fault-On: first|reask|all` says which requests they
//! apply to (a re-ask: an expansion's, with ctxproxy's definitions message last, or a follow-up
//! as `X-Mock-Follow-Up-Status` means it).

use std::convert::Infallible;
use std::pin::Pin;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};

use super::{header_str, is_follow_up};
use crate::openai::ChatRequest;
use crate::pipeline::tools::inline;

/// How an answer fails after its head: after `after` stream events, as `kind` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub kind: FaultKind,
    pub after: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The connection is aborted.
    Reset,
    /// Nothing more is sent; the connection stays open.
    Stall,
    /// The body ends cleanly.
    EarlyEnd,
    /// The body ends cleanly after the first half of the next event.
    CutMidEvent,
}

/// The faults a request's headers ask for, when they apply to it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Faults {
    pub fault: Option<Fault>,
    pub invalid_json: bool,
}

impl Faults {
    pub fn of(headers: &HeaderMap, request: &ChatRequest) -> Faults {
        let applies = match header_str(headers, "x-mock-fault-on") {
            Some("first") => !is_reask(request),
            Some("reask") => is_reask(request),
            _ => true,
        };
        if !applies {
            return Faults::default();
        }
        Faults {
            fault: header_str(headers, "x-mock-stream-fault").and_then(parse),
            invalid_json: header_str(headers, "x-mock-invalid-json") == Some("1"),
        }
    }
}

/// `reset-after=N`, `stall-after=N`, `early-end-after=N` or `cut-mid-event-after=N`.
fn parse(value: &str) -> Option<Fault> {
    let (kind, after) = value.trim().split_once('=')?;
    let kind = match kind.trim() {
        "reset-after" => FaultKind::Reset,
        "stall-after" => FaultKind::Stall,
        "early-end-after" => FaultKind::EarlyEnd,
        "cut-mid-event-after" => FaultKind::CutMidEvent,
        _ => return None,
    };
    let after = after.trim().parse().ok()?;
    Some(Fault { kind, after })
}

/// A request that asks again: an expansion's re-ask (ctxproxy's definitions message or call
/// result last), or
/// a follow-up (a continuation, a retry).
fn is_reask(request: &ChatRequest) -> bool {
    let defines_last = request.messages.last().is_some_and(|last| {
        inline::definition_messages(std::slice::from_ref(last))
            .next()
            .is_some()
    });
    defines_last || is_follow_up(request)
}

/// A 200 whose body is not JSON.
pub fn invalid_json() -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        "{\"id\": \"chatcmpl-mock-broken\", \"choices\": [ this is not JSON",
    )
        .into_response()
}

/// How long a reset waits for what went before it to leave.
const FLUSH: std::time::Duration = std::time::Duration::from_millis(20);

type Events = Pin<Box<dyn Stream<Item = Result<Bytes, Infallible>> + Send>>;

/// `events` as a body that fails as `fault` says.
pub fn failing(events: Events, fault: Fault) -> Body {
    // A cut mid-event sends the first half of one more event.
    let cut = usize::from(fault.kind == FaultKind::CutMidEvent);
    let sent = events
        .take(fault.after + cut)
        .enumerate()
        .map(move |(i, event)| match event {
            Ok(event) if i == fault.after => Ok(event.slice(..event.len() / 2)),
            other => other.map_err(std::io::Error::other),
        });
    // An error from the body makes the server abort the connection mid-body (after a pause in
    // which what was sent before it is flushed).
    let end = futures_util::stream::once(async move {
        match fault.kind {
            FaultKind::Reset => {
                tokio::time::sleep(FLUSH).await;
                Some(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "mock reset (X-Mock-Stream-Fault)",
                )))
            }
            FaultKind::Stall => std::future::pending().await,
            FaultKind::EarlyEnd | FaultKind::CutMidEvent => None,
        }
    })
    .filter_map(std::future::ready);
    Body::from_stream(sent.chain(end))
}

/// A JSON answer's body in two halves, failing after the first as `fault` says.
pub fn failing_json(body: Vec<u8>, fault: Fault) -> Response {
    let half = body.len() / 2;
    let body = Bytes::from(body);
    let halves = [body.slice(..half), body.slice(half..)];
    let events: Events = Box::pin(futures_util::stream::iter(halves.map(Ok)));
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(failing(events, Fault { after: 1, ..fault }))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn events(n: usize) -> Events {
        Box::pin(futures_util::stream::iter(
            (0..n).map(|i| Ok(Bytes::from(format!("data: {i}\n\n")))),
        ))
    }

    #[test]
    fn headers_name_the_fault() {
        let fault = |kind, after| Some(Fault { kind, after });
        assert_eq!(parse("reset-after=3"), fault(FaultKind::Reset, 3));
        assert_eq!(parse("stall-after=0"), fault(FaultKind::Stall, 0));
        assert_eq!(parse("early-end-after=2"), fault(FaultKind::EarlyEnd, 2));
        assert_eq!(
            parse("cut-mid-event-after=1"),
            fault(FaultKind::CutMidEvent, 1)
        );
        assert_eq!(parse("explode"), None);
    }

    #[tokio::test]
    async fn a_reset_fails_the_body_after_n_events_and_an_early_end_or_a_cut_ends_it() {
        let reset = Fault {
            kind: FaultKind::Reset,
            after: 2,
        };
        let mut body = failing(events(5), reset);
        assert!(body.frame().await.unwrap().is_ok());
        assert!(body.frame().await.unwrap().is_ok());
        assert!(body.frame().await.unwrap().is_err());
        let body_of = |kind| async move {
            let body = failing(events(5), Fault { kind, after: 2 });
            body.collect().await.unwrap().to_bytes()
        };
        let two = "data: 0\n\ndata: 1\n\n";
        assert_eq!(body_of(FaultKind::EarlyEnd).await, two);
        // Then half of the third event.
        let cut = body_of(FaultKind::CutMidEvent).await;
        assert_eq!(cut, format!("{two}data"));
    }

    #[test]
    fn a_reask_is_an_expansion_or_a_follow_up() {
        let request = |messages: serde_json::Value| -> ChatRequest {
            serde_json::from_value(serde_json::json!({"model": "m", "messages": messages})).unwrap()
        };
        let first = request(serde_json::json!([{"role": "user", "content": "hi"}]));
        assert!(!is_reask(&first));
        let defined = format!("{}\n{{\"name\":\"x\"}}", inline::HEADER);
        let expansion = request(serde_json::json!([{"role": "user", "content": "hi"},
            {"role": "system", "content": defined}]));
        assert!(is_reask(&expansion));
        let continuation = request(serde_json::json!([{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hel"}, {"role": "user", "content": "Go on"}]));
        assert!(is_reask(&continuation));
    }
}
