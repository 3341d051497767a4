//! A streamed answer guarded: a task pumps the upstream's parts through the pure
//! `guards::stream::StreamRewriter`, forwards what it gives back to the client, and asks the
//! upstream for the next part when it says so.

use axum::body::Body;
use axum::http::{Response, header};
use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::sync::mpsc;

use super::GuardCall;
use crate::guards::stream::{Finish, Next, PartEnd, Relay, StreamRewriter};
use crate::metrics::{ClaimRepair, ContinuationOutcome, UpstreamError};
use crate::upstream::{UpstreamResponse, is_event_stream};

type Events = mpsc::Sender<Result<Bytes, std::io::Error>>;

pub(super) fn guard_stream(call: GuardCall, answer: UpstreamResponse) -> UpstreamResponse {
    let (started, deadline) = (answer.started, answer.deadline);
    let (mut parts, body) = answer.response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    // Each continuation part has the whole total timeout of its own.
    let continuation = &call.guards().continuation;
    let parts_allowed = if continuation.enabled {
        1 + continuation.max_attempts
    } else {
        1
    };
    let deadline = started + (deadline - started) * parts_allowed;
    let (events, receiver) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        relay(&call, body, &events).await;
    });
    let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
        let event = receiver.recv().await?;
        Some((event, receiver))
    });
    UpstreamResponse {
        response: Response::from_parts(parts, Body::from_stream(stream)),
        started,
        deadline,
    }
}

/// Relays every part of the answer as one; returns early when the client is gone or the
/// answer was cut.
async fn relay(call: &GuardCall, first: Body, events: &Events) {
    let mut rewriter = StreamRewriter::new(
        call.guards(),
        call.tools_offered,
        &call.sent,
        call.upstream.config.max_event_bytes,
    );
    let mut body = first;
    let finish = loop {
        let Some(PartEnd { events: last, next }) = pump(call, &mut rewriter, body, events).await
        else {
            return;
        };
        if !forward_all(events, last).await {
            return;
        }
        match next {
            Next::Done(finish) => break finish,
            Next::Continue(request) => match next_part(call, request).await {
                Ok(next) => {
                    rewriter.continued();
                    body = next;
                }
                Err(outcome) => break rewriter.give_up(outcome),
            },
        }
    };
    end(call, finish, events).await;
}

/// Feeds one part's body to the rewriter and forwards what it gives back, until the part
/// ends; `None` when the answer stops here (the client is gone, the upstream failed or sent
/// an event too large: the client was told).
async fn pump(
    call: &GuardCall,
    rewriter: &mut StreamRewriter<'_>,
    mut body: Body,
    events: &Events,
) -> Option<PartEnd> {
    loop {
        let frame = tokio::select! {
            frame = body.frame() => frame,
            () = events.closed() => return None,
        };
        match frame {
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                match rewriter.push(&data) {
                    Relay::Events(out) => {
                        if !forward_all(events, out).await {
                            return None;
                        }
                    }
                    // Cut with an error event, counted like any upstream failure.
                    Relay::TooLarge(error) => {
                        call.state
                            .metrics
                            .upstream_errors
                            .with_label_values(&[
                                call.upstream.config.name.as_str(),
                                UpstreamError::EventTooLarge.as_str(),
                            ])
                            .inc();
                        forward(events, error).await;
                        return None;
                    }
                }
            }
            // The upstream failed mid-answer: the client's stream fails too.
            Some(Err(e)) => {
                let _ = events.send(Err(std::io::Error::other(e))).await;
                return None;
            }
            None => return Some(rewriter.end_part()),
        }
    }
}

/// The body of the next part, or the continuation outcome that stops asking.
async fn next_part(call: &GuardCall, request: Vec<u8>) -> Result<Body, ContinuationOutcome> {
    if !call.within_budget(&request) {
        return Err(ContinuationOutcome::Budget);
    }
    match call.send(request).await {
        Some(answer) if is_event_stream(answer.response.headers()) => {
            Ok(answer.response.into_body())
        }
        _ => Err(ContinuationOutcome::Error),
    }
}

/// Ends the answer as the rewriter says, counting what it did.
async fn end(call: &GuardCall, finish: Finish, events: &Events) {
    let Finish {
        cut,
        continuation,
        claim,
        tail,
    } = finish;
    if let Some(cut) = cut
        && !forward(events, cut).await
    {
        return;
    }
    if let Some(outcome) = continuation {
        call.count_continuation(outcome);
    }
    if let Some(claim) = claim {
        call.count_claim(ClaimRepair::Off);
        if !forward(events, claim).await {
            return;
        }
    }
    forward_all(events, tail).await;
}

async fn forward(events: &Events, bytes: Bytes) -> bool {
    events.send(Ok(bytes)).await.is_ok()
}

/// Forwards events in order; whether the client still listens.
async fn forward_all(events: &Events, all: Vec<Bytes>) -> bool {
    for bytes in all {
        if !forward(events, bytes).await {
            return false;
        }
    }
    true
}
