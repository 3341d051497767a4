//! What the stream tasks of the guards and of the expansion share: a channel body the client
//! reads, and a pump that feeds one upstream part to a pure rewriter and forwards what it gives
//! back. A part that fails (reset, or ended before its end) ends the answer with an error
//! event, and nothing the task would add (usage, comments, `[DONE]`) follows it; a part that
//! stalls is cut by the relay's deadline, the request's. A part ends at its `[DONE]`: the rest
//! of its body is not waited for.

use std::future::Future;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::sync::mpsc;

use crate::body::{EndedEarly, drain};
use crate::error::ProxyError;
use crate::guards::expand::{self, ExpandStream};
use crate::guards::responses_expand::ResponsesExpandStream;
use crate::guards::responses_stream::ResponsesStreamRewriter;
use crate::guards::stream::{self, Relay, StreamRewriter};
use crate::metrics::{Metrics, UpstreamError};
use crate::openai::sse::{Ending, StreamProgress};
use crate::upstream::{Upstream, interrupted};

pub type Events = mpsc::Sender<Result<Bytes, std::io::Error>>;

/// A pure rewriter of streamed parts.
pub trait PartRewriter {
    type End;
    fn push(&mut self, data: &[u8]) -> Relay;
    fn end_part(&mut self) -> Self::End;
    /// How the current part is ending (after [`PartRewriter::end_part`]: how it ended).
    fn progress(&self) -> &StreamProgress;
    /// The event that ends the client's stream with `error`: chat's, unless the rewriter
    /// relays another API's events.
    fn error_event(&self, error: &ProxyError) -> Bytes {
        error.sse_event()
    }
}

impl PartRewriter for StreamRewriter<'_> {
    type End = stream::PartEnd;

    fn push(&mut self, data: &[u8]) -> Relay {
        StreamRewriter::push(self, data)
    }

    fn end_part(&mut self) -> stream::PartEnd {
        StreamRewriter::end_part(self)
    }

    fn progress(&self) -> &StreamProgress {
        StreamRewriter::progress(self)
    }
}

impl PartRewriter for ExpandStream {
    type End = expand::PartEnd;

    fn push(&mut self, data: &[u8]) -> Relay {
        ExpandStream::push(self, data)
    }

    fn end_part(&mut self) -> expand::PartEnd {
        ExpandStream::end_part(self)
    }

    fn progress(&self) -> &StreamProgress {
        ExpandStream::progress(self)
    }
}

impl PartRewriter for ResponsesExpandStream {
    type End = expand::PartEnd;

    fn push(&mut self, data: &[u8]) -> Relay {
        ResponsesExpandStream::push(self, data)
    }

    fn end_part(&mut self) -> expand::PartEnd {
        ResponsesExpandStream::end_part(self)
    }

    fn progress(&self) -> &StreamProgress {
        ResponsesExpandStream::progress(self)
    }

    fn error_event(&self, error: &ProxyError) -> Bytes {
        error.responses_sse_event()
    }
}

impl PartRewriter for ResponsesStreamRewriter<'_> {
    type End = stream::PartEnd;

    fn push(&mut self, data: &[u8]) -> Relay {
        ResponsesStreamRewriter::push(self, data)
    }

    fn end_part(&mut self) -> stream::PartEnd {
        ResponsesStreamRewriter::end_part(self)
    }

    fn progress(&self) -> &StreamProgress {
        ResponsesStreamRewriter::progress(self)
    }

    fn error_event(&self, error: &ProxyError) -> Bytes {
        error.responses_sse_event()
    }
}

/// A body fed by the task `relay` runs with the channel's sender.
pub fn channel_body<F>(relay: impl FnOnce(Events) -> F) -> Body
where
    F: Future<Output = ()> + Send + 'static,
{
    let (events, receiver) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(relay(events));
    let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
        let event = receiver.recv().await?;
        Some((event, receiver))
    });
    Body::from_stream(stream)
}

/// Feeds one part's body to the rewriter and forwards what it gives back, until the part
/// ends (its body's end, or `[DONE]`); `None` when the answer stops here (the client is gone;
/// the upstream failed, ended the part early, sent an error event or an event too large: the
/// client was told). `usage_asked`: the request asked for usage, so a complete part carries it.
pub async fn pump<R: PartRewriter>(
    upstream: &Upstream,
    metrics: &Metrics,
    rewriter: &mut R,
    mut body: Body,
    events: &Events,
    usage_asked: bool,
) -> Option<R::End> {
    let failure = loop {
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
                        upstream.count_error(metrics, UpstreamError::EventTooLarge);
                        forward(events, error).await;
                        return None;
                    }
                }
                if rewriter.progress().done() {
                    drain(body);
                    break None;
                }
            }
            Some(Err(e)) => break Some(e),
            None => break None,
        }
    };
    let end = rewriter.end_part();
    match rewriter.progress().ending(usage_asked) {
        Ending::Complete => Some(end),
        // Its error event went out as it came.
        Ending::Failed(_) => None,
        // The upstream failed or stopped mid-answer: the client's stream says so, and ends.
        Ending::Early => {
            upstream.count_error(metrics, UpstreamError::Body);
            let name = &upstream.config.name;
            let error = match failure {
                Some(e) => interrupted(name, &e),
                None => interrupted(name, &EndedEarly),
            };
            forward(events, rewriter.error_event(&error)).await;
            None
        }
    }
}

pub async fn forward(events: &Events, bytes: Bytes) -> bool {
    events.send(Ok(bytes)).await.is_ok()
}

/// Forwards events in order; whether the client still listens.
pub async fn forward_all(events: &Events, all: Vec<Bytes>) -> bool {
    for bytes in all {
        if !forward(events, bytes).await {
            return false;
        }
    }
    true
}
