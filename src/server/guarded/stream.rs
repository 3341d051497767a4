//! A streamed answer guarded: a task pumps the upstream's parts through the pure
//! `guards::stream::StreamRewriter`, forwards what it gives back to the client, and asks the
//! upstream for the next part when it says so.

use axum::body::Body;
use axum::http::{Response, header};

use super::GuardCall;
use super::pump::{Events, channel_body, forward, forward_all, pump};
use crate::guards::stream::{Finish, Next, PartEnd, StreamRewriter};
use crate::metrics::{ClaimRepair, ContinuationOutcome};
use crate::upstream::{UpstreamResponse, is_event_stream};

/// The answer relayed by a task; its deadline stays the request's (the relay applies it to
/// every part: a stalled part ends the stream with an error event).
pub(super) fn guard_stream(call: GuardCall, answer: UpstreamResponse) -> UpstreamResponse {
    let (started, deadline) = (answer.started, answer.deadline);
    let (mut parts, body) = answer.response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let body = channel_body(|events| async move { relay(&call, body, &events).await });
    UpstreamResponse {
        response: Response::from_parts(parts, body),
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
        let pumped = pump(
            &call.upstream,
            &call.state.metrics,
            &mut rewriter,
            body,
            events,
            call.usage_asked,
        );
        let Some(PartEnd { events: last, next }) = pumped.await else {
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
