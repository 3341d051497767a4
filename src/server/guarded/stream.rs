//! A streamed answer guarded: a task pumps the upstream's parts through a pure rewriter
//! (`guards::stream::StreamRewriter` for chat, `guards::responses_stream` for the Responses
//! API), forwards what it gives back to the client, and asks the upstream for the next part when
//! it says so.

use axum::body::Body;
use axum::http::{Response, header};

use super::GuardCall;
use super::pump::{Events, PartRewriter, channel_body, forward, forward_all, pump};
use crate::guards::responses_stream::ResponsesStreamRewriter;
use crate::guards::stream::{Finish, Next, PartEnd, StreamRewriter};
use crate::metrics::{ClaimRepair, ContinuationOutcome};
use crate::openai::Api;
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

/// A rewriter the stream guards drive: one API's events, continued part after part.
trait GuardRewriter: PartRewriter<End = PartEnd> {
    fn continued(&mut self);
    fn give_up(&mut self, outcome: ContinuationOutcome) -> Finish;
}

impl GuardRewriter for StreamRewriter<'_> {
    fn continued(&mut self) {
        StreamRewriter::continued(self);
    }

    fn give_up(&mut self, outcome: ContinuationOutcome) -> Finish {
        StreamRewriter::give_up(self, outcome)
    }
}

impl GuardRewriter for ResponsesStreamRewriter<'_> {
    fn continued(&mut self) {
        ResponsesStreamRewriter::continued(self);
    }

    fn give_up(&mut self, outcome: ContinuationOutcome) -> Finish {
        ResponsesStreamRewriter::give_up(self, outcome)
    }
}

/// Relays every part of the answer as one, in its API's events.
async fn relay(call: &GuardCall, first: Body, events: &Events) {
    let (guards, max_event) = (call.guards(), call.upstream.config.max_event_bytes);
    match call.api {
        Api::Chat => {
            let rewriter = StreamRewriter::new(guards, call.tools_offered, &call.sent, max_event);
            relay_parts(call, rewriter, first, events).await;
        }
        Api::Responses => {
            let rewriter = ResponsesStreamRewriter::new(
                guards,
                call.tools_offered,
                call.stored,
                &call.sent,
                max_event,
            );
            relay_parts(call, rewriter, first, events).await;
        }
    }
}

/// Relays the parts through `rewriter`; returns early when the client is gone or the answer
/// was cut.
async fn relay_parts(
    call: &GuardCall,
    mut rewriter: impl GuardRewriter,
    first: Body,
    events: &Events,
) {
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
