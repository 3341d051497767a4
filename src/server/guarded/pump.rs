//! What the stream tasks of the guards and of the expansion share: a channel body the client
//! reads, and a pump that feeds one upstream part to a pure rewriter and forwards what it gives
//! back.

use std::future::Future;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::sync::mpsc;

use crate::guards::expand::{self, ExpandStream};
use crate::guards::stream::{self, Relay, StreamRewriter};
use crate::metrics::{Metrics, UpstreamError};
use crate::upstream::Upstream;

pub type Events = mpsc::Sender<Result<Bytes, std::io::Error>>;

/// A pure rewriter of streamed parts.
pub trait PartRewriter {
    type End;
    fn push(&mut self, data: &[u8]) -> Relay;
    fn end_part(&mut self) -> Self::End;
}

impl PartRewriter for StreamRewriter<'_> {
    type End = stream::PartEnd;

    fn push(&mut self, data: &[u8]) -> Relay {
        StreamRewriter::push(self, data)
    }

    fn end_part(&mut self) -> stream::PartEnd {
        StreamRewriter::end_part(self)
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
/// ends; `None` when the answer stops here (the client is gone, the upstream failed or sent
/// an event too large: the client was told).
pub async fn pump<R: PartRewriter>(
    upstream: &Upstream,
    metrics: &Metrics,
    rewriter: &mut R,
    mut body: Body,
    events: &Events,
) -> Option<R::End> {
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
                        metrics
                            .upstream_errors
                            .with_label_values(&[
                                upstream.config.name.as_str(),
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
