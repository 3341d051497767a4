//! Response body adapters: one that reports when a body ends (completed, failed, dropped by the
//! client, or cut at a deadline), one that re-frames an SSE stream one event per frame, and the
//! two that make a chat stream end either complete or with an error event: one fails a stream
//! that stopped before its end (so the observers after it see a failure), the other turns a
//! failure into the OpenAI-format error event that ends the body.
//!
//! They stream: they never hold more than the event being assembled.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::openai::sse::{Ending, SseSplitter, StreamProgress};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How a body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyEnd {
    Complete,
    Failed,
    /// Dropped before its end: the client went away (or the proxy is stopping).
    Dropped,
    DeadlineExceeded,
}

impl BodyEnd {
    /// As logs and recordings say it.
    pub fn as_str(self) -> &'static str {
        match self {
            BodyEnd::Complete => "complete",
            BodyEnd::Failed => "failed",
            BodyEnd::Dropped => "dropped",
            BodyEnd::DeadlineExceeded => "deadline_exceeded",
        }
    }
}

type OnEnd = Box<dyn FnOnce(BodyEnd) + Send>;

/// How a body ended, judged from one polled frame, if it did.
fn end_of<T, E>(polled: &Option<Result<T, E>>, end_stream: bool) -> Option<BodyEnd> {
    match polled {
        None => Some(BodyEnd::Complete),
        Some(Err(_)) => Some(BodyEnd::Failed),
        Some(Ok(_)) if end_stream => Some(BodyEnd::Complete),
        Some(Ok(_)) => None,
    }
}

pin_project! {
    /// Calls `on_end` exactly once when the body ends, fails, hits `deadline`, or is dropped.
    pub struct ObservedBody<B>
    where
        B: Body,
    {
        #[pin]
        inner: B,
        #[pin]
        deadline: Option<Sleep>,
        on_end: Option<OnEnd>,
    }

    impl<B> PinnedDrop for ObservedBody<B>
    where
        B: Body,
    {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(on_end) = this.on_end.take() {
                // A sized body is not polled past its last byte: that is a completion.
                let end = if this.inner.is_end_stream() { BodyEnd::Complete } else { BodyEnd::Dropped };
                on_end(end);
            }
        }
    }
}

impl<B: Body> ObservedBody<B> {
    pub fn new(
        inner: B,
        deadline: Option<Instant>,
        on_end: impl FnOnce(BodyEnd) + Send + 'static,
    ) -> Self {
        ObservedBody {
            inner,
            deadline: deadline.map(tokio::time::sleep_until),
            on_end: Some(Box::new(on_end)),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the response exceeded its total time limit")]
pub struct DeadlineExceeded;

impl<B> Body for ObservedBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if let Some(deadline) = this.deadline.as_mut().as_pin_mut()
            && deadline.poll(cx).is_ready()
        {
            if let Some(on_end) = this.on_end.take() {
                on_end(BodyEnd::DeadlineExceeded);
            }
            return Poll::Ready(Some(Err(Box::new(DeadlineExceeded))));
        }
        let polled = ready!(this.inner.as_mut().poll_frame(cx));
        let end = end_of(&polled, this.inner.is_end_stream());
        if let Some(end) = end
            && let Some(on_end) = this.on_end.take()
        {
            on_end(end);
        }
        Poll::Ready(polled.map(|r| r.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Sees every data frame of a body as it passes, and how the body ended (response-side
/// features: sticky tool categories, caches).
pub trait BodyObserver: Send + 'static {
    fn on_data(&mut self, data: &Bytes);
    fn on_end(self: Box<Self>, end: BodyEnd);
}

/// Several observers of one body, in order.
pub struct Observers(pub Vec<Box<dyn BodyObserver>>);

impl BodyObserver for Observers {
    fn on_data(&mut self, data: &Bytes) {
        self.0.iter_mut().for_each(|o| o.on_data(data));
    }

    fn on_end(self: Box<Self>, end: BodyEnd) {
        self.0.into_iter().for_each(|o| o.on_end(end));
    }
}

pin_project! {
    /// Passes a body through unchanged, showing it to an observer.
    pub struct TapBody<B>
    where
        B: Body,
    {
        #[pin]
        inner: B,
        observer: Option<Box<dyn BodyObserver>>,
    }

    impl<B> PinnedDrop for TapBody<B>
    where
        B: Body,
    {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(observer) = this.observer.take() {
                let end = if this.inner.is_end_stream() { BodyEnd::Complete } else { BodyEnd::Dropped };
                observer.on_end(end);
            }
        }
    }
}

impl<B: Body> TapBody<B> {
    pub fn new(inner: B, observer: Box<dyn BodyObserver>) -> Self {
        TapBody {
            inner,
            observer: Some(observer),
        }
    }
}

impl<B> Body for TapBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let polled = ready!(this.inner.as_mut().poll_frame(cx));
        if let (Some(Ok(frame)), Some(observer)) = (&polled, this.observer.as_mut())
            && let Some(data) = frame.data_ref()
        {
            observer.on_data(data);
        }
        let end = end_of(&polled, this.inner.is_end_stream());
        if let Some(end) = end
            && let Some(observer) = this.observer.take()
        {
            observer.on_end(end);
        }
        Poll::Ready(polled.map(|r| r.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// Re-frames an SSE body so that each frame is one whole event (one flush per event). An
    /// event over the splitter's maximum ends the body with an error event (`on_too_large` is
    /// called) instead of being held.
    pub struct SseEventBody<B> {
        #[pin]
        inner: B,
        splitter: SseSplitter,
        inner_done: bool,
        on_too_large: Option<Box<dyn FnOnce() + Send>>,
    }
}

impl<B> SseEventBody<B> {
    pub fn new(inner: B, max_event: usize, on_too_large: impl FnOnce() + Send + 'static) -> Self {
        SseEventBody {
            inner,
            splitter: SseSplitter::with_max_event(max_event),
            inner_done: false,
            on_too_large: Some(Box::new(on_too_large)),
        }
    }
}

impl<B> Body for SseEventBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        loop {
            match this.splitter.next_event() {
                Ok(Some(event)) => return Poll::Ready(Some(Ok(Frame::data(event)))),
                Ok(None) => {}
                Err(too_large) => {
                    // Cut here: what was held is let go, the rest of the upstream is not read.
                    *this.inner_done = true;
                    *this.splitter = SseSplitter::default();
                    if let Some(count) = this.on_too_large.take() {
                        count();
                        return Poll::Ready(Some(Ok(Frame::data(
                            crate::openai::sse::event_too_large_event(too_large),
                        ))));
                    }
                    return Poll::Ready(None);
                }
            }
            if *this.inner_done {
                return Poll::Ready(this.splitter.finish().map(|rest| Ok(Frame::data(rest))));
            }
            match ready!(this.inner.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.splitter.push(&data),
                    // Trailers: pass them on after what was buffered (SSE has none in practice).
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => *this.inner_done = true,
            }
        }
    }
}

pin_project! {
    /// Leaves out the frames `drop` picks (over an `SseEventBody`, each frame is one event).
    pub struct DropFrames<B> {
        #[pin]
        inner: B,
        drop: fn(&[u8]) -> bool,
    }
}

impl<B> DropFrames<B> {
    pub fn new(inner: B, drop: fn(&[u8]) -> bool) -> Self {
        DropFrames { inner, drop }
    }
}

impl<B> Body for DropFrames<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        loop {
            match ready!(this.inner.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) if frame.data_ref().is_some_and(|d| (this.drop)(d)) => continue,
                other => return Poll::Ready(other),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

/// A chat stream that stopped without a finish reason or `[DONE]`.
#[derive(Debug, thiserror::Error)]
#[error(
    "the stream ended before its end (no finish reason and no [DONE]; on the Responses API, no response.completed)"
)]
pub struct EndedEarly;

/// A chat stream that carried an error event: the client was told (the event's code and
/// message).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ToldError(pub String);

/// Fails a chat stream (one event per frame) that did not end complete: one that stopped early
/// ends with [`EndedEarly`], one that carried an error event with [`ToldError`] (also when it
/// then failed). The observers after it see the failure. `data: [DONE]` ends it: what the
/// upstream's body holds after it (an error, or nothing for a long time) is not the client's,
/// and is [drained](drain) in the background.
pub struct CheckedEnd<B> {
    /// `None` once the stream ended.
    inner: Option<Pin<Box<B>>>,
    progress: StreamProgress,
    usage_asked: bool,
}

impl<B> CheckedEnd<B> {
    /// `usage_asked`: the request asked for usage, so a complete stream carries it.
    pub fn new(inner: B, usage_asked: bool) -> Self {
        CheckedEnd {
            inner: Some(Box::pin(inner)),
            progress: StreamProgress::default(),
            usage_asked,
        }
    }

    /// The same for a Responses API stream: `response.completed` or `response.incomplete` ends
    /// it complete.
    pub fn responses(inner: B) -> Self {
        CheckedEnd {
            inner: Some(Box::pin(inner)),
            progress: StreamProgress::responses(),
            usage_asked: false,
        }
    }
}

impl<B> Body for CheckedEnd<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if this.progress.done() {
            if let Some(rest) = this.inner.take() {
                drain(rest);
            }
            return Poll::Ready(None);
        }
        let polled = ready!(inner.as_mut().poll_frame(cx));
        if let Some(Ok(frame)) = polled {
            if let Some(data) = frame.data_ref() {
                this.progress.see(data);
            }
            return Poll::Ready(Some(Ok(frame)));
        }
        this.inner = None;
        // The body ended or failed: a complete answer ends as it is, even when its transport
        // failed after it.
        let failure: BoxError = match (this.progress.ending(this.usage_asked), polled) {
            (Ending::Complete, _) => return Poll::Ready(None),
            (Ending::Failed(told), _) => Box::new(ToldError(told)),
            (Ending::Early, Some(Err(e))) => e.into(),
            (Ending::Early, _) => Box::new(EndedEarly),
        };
        Poll::Ready(Some(Err(failure)))
    }
}

/// How long the rest of an upstream body is read after `[DONE]`.
const DRAIN_AFTER_DONE: std::time::Duration = std::time::Duration::from_secs(1);

/// Reads the rest of an upstream body after its answer ended (`[DONE]`), in the background, for
/// at most [`DRAIN_AFTER_DONE`], then drops it: the client is not held, an upstream that ends
/// its body keeps its pooled connection, and one that fails or stalls costs nothing more.
pub fn drain<B>(mut body: B)
where
    B: Body + Unpin + Send + 'static,
    B::Data: Send,
{
    tokio::spawn(async move {
        let rest = async { while let Some(Ok(_)) = body.frame().await {} };
        let _ = tokio::time::timeout(DRAIN_AFTER_DONE, rest).await;
    });
}

/// Why a stream ended in an error after its headers went: set once by the body that ended it,
/// read by the access log (through the response's extensions).
#[derive(Debug, Clone, Default)]
pub struct StreamFault(Arc<OnceLock<String>>);

impl StreamFault {
    pub fn set(&self, cause: String) {
        let _ = self.0.set(cause);
    }

    pub fn get(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }
}

type OnFailure = Box<dyn FnOnce(BoxError) -> Option<Bytes> + Send>;

pin_project! {
    /// Ends a body that fails with the event `on_failure` makes of the failure (`None`: the
    /// client was told already), then the end of the body: the client reads a whole body
    /// whose last event says what went wrong, never an aborted one.
    pub struct ErrorEventEnd<B> {
        #[pin]
        inner: B,
        on_failure: Option<OnFailure>,
    }
}

impl<B> ErrorEventEnd<B> {
    pub fn new(
        inner: B,
        on_failure: impl FnOnce(BoxError) -> Option<Bytes> + Send + 'static,
    ) -> Self {
        ErrorEventEnd {
            inner,
            on_failure: Some(Box::new(on_failure)),
        }
    }
}

impl<B> Body for ErrorEventEnd<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        // After the failure: the body has ended.
        if this.on_failure.is_none() {
            return Poll::Ready(None);
        }
        match ready!(this.inner.poll_frame(cx)) {
            Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
            None => Poll::Ready(None),
            Some(Err(e)) => {
                let event = this
                    .on_failure
                    .take()
                    .and_then(|on_failure| on_failure(e.into()));
                Poll::Ready(event.map(|event| Ok(Frame::data(event))))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use http_body_util::{BodyExt, StreamBody};
    use std::sync::{Arc, Mutex};

    fn stream_of(chunks: &[&'static [u8]]) -> impl Body<Data = Bytes, Error = std::io::Error> {
        let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn sse_body_emits_one_frame_per_event() {
        let body = SseEventBody::new(
            stream_of(&[b"data: a\n\ndata: ", b"b\n", b"\ndata: [DONE]\n\n"]),
            1024,
            || {},
        );
        let mut frames = Vec::new();
        let mut body = std::pin::pin!(body);
        while let Some(frame) = body.frame().await {
            frames.push(frame.unwrap().into_data().unwrap());
        }
        assert_eq!(
            frames,
            vec!["data: a\n\n", "data: b\n\n", "data: [DONE]\n\n"]
        );
    }

    #[tokio::test]
    async fn an_event_over_the_maximum_ends_the_stream_with_an_error_event() {
        let cut = Arc::new(Mutex::new(0));
        let counted = cut.clone();
        let body = SseEventBody::new(
            stream_of(&[b"data: ok\n\n", b"data: x\n", b"data: x\n", b"data: x\n"]),
            16,
            move || *counted.lock().unwrap() += 1,
        );
        let mut frames = Vec::new();
        let mut body = std::pin::pin!(body);
        while let Some(frame) = body.frame().await {
            frames.push(frame.unwrap().into_data().unwrap());
        }
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert_eq!(frames[0], "data: ok\n\n");
        let error = crate::openai::sse::event_data(&frames[1]).unwrap();
        assert!(error.contains("\"code\":\"event_too_large\""), "{error}");
        assert_eq!(*cut.lock().unwrap(), 1);
    }

    #[tokio::test]
    async fn observed_body_reports_completion_and_drop() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let body = ObservedBody::new(stream_of(&[b"x"]), None, move |end| {
            log.lock().unwrap().push(end)
        });
        let collected = body.collect().await.unwrap().to_bytes();
        assert_eq!(collected, "x");

        let log = seen.clone();
        drop(ObservedBody::new(stream_of(&[b"x"]), None, move |end| {
            log.lock().unwrap().push(end)
        }));
        assert_eq!(
            *seen.lock().unwrap(),
            vec![BodyEnd::Complete, BodyEnd::Dropped]
        );
    }

    /// What a body gives until its end: its data, and the error that ended it, if any.
    async fn read_to_end<B>(body: B) -> (String, Option<BoxError>)
    where
        B: Body<Data = Bytes, Error = BoxError>,
    {
        let mut body = std::pin::pin!(body);
        let mut data = String::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => data.push_str(std::str::from_utf8(frame.data_ref().unwrap()).unwrap()),
                Err(e) => return (data, Some(e)),
            }
        }
        (data, None)
    }

    const ROLE: &[u8] =
        b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"},\"finish_reason\":null}]}\n\n";
    const FINISH: &[u8] = b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
    const ERROR: &[u8] = b"data: {\"error\":{\"message\":\"no\",\"code\":\"x\"}}\n\n";

    #[tokio::test]
    async fn a_chat_stream_fails_unless_it_ends_complete() {
        for complete in [&[ROLE, FINISH][..], &[ROLE, b"data: [DONE]\n\n"]] {
            let (_, failure) = read_to_end(CheckedEnd::new(stream_of(complete), false)).await;
            assert!(failure.is_none());
        }
        let (data, failure) = read_to_end(CheckedEnd::new(stream_of(&[ROLE]), false)).await;
        assert_eq!(data.as_bytes(), ROLE);
        assert!(failure.unwrap().is::<EndedEarly>());
        let (_, failure) = read_to_end(CheckedEnd::new(stream_of(&[ROLE, ERROR]), false)).await;
        assert_eq!(failure.unwrap().to_string(), "x: no");
    }

    #[tokio::test]
    async fn a_failed_body_ends_with_the_event_made_of_its_failure() {
        let failing = CheckedEnd::new(stream_of(&[ROLE]), false);
        let body = ErrorEventEnd::new(failing, |e| Some(Bytes::from(format!("data: {e}\n\n"))));
        let (data, failure) = read_to_end(body).await;
        assert!(failure.is_none());
        let expected = format!(
            "{}data: {EndedEarly}\n\n",
            std::str::from_utf8(ROLE).unwrap()
        );
        assert_eq!(data, expected);
        // Told already: nothing is added.
        let told = ErrorEventEnd::new(CheckedEnd::new(stream_of(&[ROLE, ERROR]), false), |_| None);
        let (data, failure) = read_to_end(told).await;
        assert!(failure.is_none());
        assert!(data.ends_with(std::str::from_utf8(ERROR).unwrap()));
    }

    const DONE: &[u8] = b"data: [DONE]\n\n";
    const USAGE: &[u8] = b"data: {\"choices\":[],\"usage\":{\"total_tokens\":1}}\n\n";

    #[tokio::test]
    async fn with_usage_asked_a_finish_without_usage_or_done_is_early() {
        let (_, failure) = read_to_end(CheckedEnd::new(stream_of(&[ROLE, FINISH]), true)).await;
        assert!(failure.unwrap().is::<EndedEarly>());
        let (_, failure) =
            read_to_end(CheckedEnd::new(stream_of(&[ROLE, FINISH, USAGE]), true)).await;
        assert!(failure.is_none());
    }

    #[tokio::test]
    async fn done_ends_the_stream_whatever_the_upstream_does_after_it() {
        let events = || {
            [ROLE, FINISH, DONE]
                .map(|e| Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(e))))
        };
        let failing =
            futures_util::stream::iter(events()).chain(futures_util::stream::iter([Err(
                std::io::Error::other("reset"),
            )]));
        let (data, failure) = read_to_end(CheckedEnd::new(StreamBody::new(failing), true)).await;
        assert!(failure.is_none(), "{failure:?}");
        assert!(data.ends_with("data: [DONE]\n\n"));
        let stalled = futures_util::stream::iter(events()).chain(futures_util::stream::pending());
        let read = read_to_end(CheckedEnd::new(StreamBody::new(stalled), true));
        let (_, failure) = tokio::time::timeout(std::time::Duration::from_secs(5), read)
            .await
            .expect("not held after [DONE]");
        assert!(failure.is_none());
    }

    #[tokio::test]
    async fn an_event_cut_midway_is_dropped_before_the_error_event() {
        let cut = stream_of(&[ROLE, b"data: {\"choices\":[{\"delta\":{\"content\":\"Wor"]);
        let checked = CheckedEnd::new(SseEventBody::new(cut, 1024, || {}), false);
        let body = ErrorEventEnd::new(checked, |e| Some(Bytes::from(format!("data: {e}\n\n"))));
        let (data, _) = read_to_end(body).await;
        let expected = format!(
            "{}data: {EndedEarly}\n\n",
            std::str::from_utf8(ROLE).unwrap()
        );
        assert_eq!(data, expected);
    }

    #[tokio::test(start_paused = true)]
    async fn observed_body_cuts_at_the_deadline() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let pending = StreamBody::new(futures_util::stream::pending::<
            Result<Frame<Bytes>, std::io::Error>,
        >());
        let deadline = Instant::now() + std::time::Duration::from_secs(1);
        let body = ObservedBody::new(pending, Some(deadline), move |end| {
            log.lock().unwrap().push(end)
        });
        assert!(body.collect().await.is_err());
        assert_eq!(*seen.lock().unwrap(), vec![BodyEnd::DeadlineExceeded]);
    }
}
