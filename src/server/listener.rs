//! Accepting connections, so that slow, idle or hostile clients can't take the proxy down: at
//! most `max_connections` at once (more wait up to a second for a place, then are closed), the
//! first request's headers within `header_read_timeout` of the connection's start, and a
//! connection with nothing in progress closed `idle_timeout` after its last request ended
//! (bytes alone, an HTTP/2 ping or a slow header, never keep it). Graceful shutdown lives here
//! too. Each connection is served by hyper's HTTP/1 or HTTP/2 server, told apart by peeking at
//! its first bytes: nothing is read and replayed, so no buffer is held for it.

use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::body::ObservedBody;
use crate::config::ServerConfig;
use crate::cores::{self, Cores};
use crate::metrics::Metrics;

/// How long a connection past `max_connections` waits for a free place before it is closed.
const CONNECTION_WAIT: Duration = Duration::from_secs(1);
/// Pause after an accept error (out of file descriptors, say) before accepting again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// What an HTTP/2 client's preface starts with (RFC 9113, 3.4: `PRI * HTTP/2.0…`): no HTTP/1
/// method does, and hyper's HTTP/2 server checks the rest.
const H2_START: &[u8] = b"PRI";
/// The first pause before peeking again at a connection whose first bytes (`P`, `PR`) do not
/// tell yet; each pause doubles, up to `PEEK_AGAIN_AT_MOST`.
const PEEK_AGAIN: Duration = Duration::from_millis(5);
const PEEK_AGAIN_AT_MOST: Duration = Duration::from_millis(200);

/// The timeouts one connection lives by.
#[derive(Debug, Clone, Copy)]
pub struct ClientLimits {
    pub header_read: Duration,
    pub idle: Duration,
}

impl ClientLimits {
    pub fn of(config: &ServerConfig) -> Self {
        ClientLimits {
            header_read: config.header_read_timeout,
            idle: config.idle_timeout,
        }
    }
}

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting and waits for
/// open connections to finish for up to `grace`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    config: &ServerConfig,
    metrics: &Metrics,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    cores: &Cores,
) -> io::Result<()> {
    let limits = ClientLimits::of(config);
    let places = Arc::new(Semaphore::new(config.max_connections));
    let graceful = GracefulShutdown::new();
    let builders = Arc::new(Builders::new(limits));
    // Tells connections whose protocol is not known yet to close: they hold no request.
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let places = places.clone();
        let open = OpenConnection::new(metrics);
        let refused = metrics.connections_refused.clone();
        let builders = builders.clone();
        let router = router.clone();
        let watcher = graceful.watcher();
        let mut stopping = stopping.clone();
        cores.spawn(tcp, move |tcp| async move {
            // Past `max_connections`, a connection waits briefly for a place, then is closed.
            let place = match places.clone().try_acquire_owned() {
                Ok(place) => place,
                Err(_) => match tokio::time::timeout(CONNECTION_WAIT, places.acquire_owned()).await
                {
                    Ok(Ok(place)) => place,
                    _ => {
                        refused.inc();
                        return;
                    }
                },
            };
            let activity = Arc::new(Activity::new());
            // The first request's headers are due `header_read` after the connection's start,
            // the peek included.
            let first_headers_due = Instant::now() + limits.header_read;
            let told = tokio::select! {
                told = protocol(&tcp, first_headers_due) => told,
                _ = stopping.wait_for(|stop| *stop) => Err(io::Error::other("shutting down")),
            };
            let served = match told {
                Ok(protocol) => {
                    let io = TokioIo::new(Watched::new(tcp, activity.clone(), limits));
                    let service = tracked(router, activity);
                    match protocol {
                        Protocol::Http1 => {
                            watcher
                                .watch(builders.http1.serve_connection(io, service))
                                .await
                        }
                        Protocol::Http2 => {
                            watcher
                                .watch(builders.http2.serve_connection(io, service))
                                .await
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "connection closed before its protocol was known");
                    Ok(())
                }
            };
            if let Err(e) = served {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop((open, place));
        });
    }
    drop(listener);
    let _ = stop.send(true);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(grace) => {
            tracing::warn!("shutdown grace period elapsed; closing the remaining connections");
        }
    }
    Ok(())
}

/// hyper's servers, one per protocol, shared by every connection.
struct Builders {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
}

impl Builders {
    fn new(limits: ClientLimits) -> Self {
        let mut http1 = http1::Builder::new();
        // hyper's header timer runs from the end of each response, so it bounds a kept-alive
        // connection's wait for its next request: the idle timeout. The first request's headers
        // are bounded by `Watched`, from the connection's start.
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(limits.idle.max(limits.header_read))
            .keep_alive(true);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2.timer(TokioTimer::new());
        Builders { http1, http2 }
    }
}

/// The protocol a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

impl Protocol {
    /// What `first_bytes` of a connection tell: HTTP/2 once they start as its preface does,
    /// HTTP/1 as soon as they differ from that, and nothing yet before (`P`, `PR`).
    fn of(first_bytes: &[u8]) -> Option<Protocol> {
        let seen = first_bytes.len().min(H2_START.len());
        if first_bytes[..seen] != H2_START[..seen] {
            Some(Protocol::Http1)
        } else if seen == H2_START.len() {
            Some(Protocol::Http2)
        } else {
            None
        }
    }
}

/// The protocol `tcp` speaks, from its first bytes, peeked at and left to be read; an error
/// when the client closes or `due` passes before they tell. Peeking waits for bytes to read;
/// once some are there and do not tell yet, it is tried again after growing pauses.
async fn protocol(tcp: &TcpStream, due: Instant) -> io::Result<Protocol> {
    let late = || io::Error::new(io::ErrorKind::TimedOut, "no request line in time");
    let mut first_bytes = [0u8; H2_START.len()];
    let mut pause = PEEK_AGAIN;
    loop {
        let peeked = tokio::time::timeout_at(due, tcp.peek(&mut first_bytes))
            .await
            .map_err(|_| late())??;
        if peeked == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if let Some(protocol) = Protocol::of(&first_bytes[..peeked]) {
            return Ok(protocol);
        }
        if Instant::now() + pause >= due {
            return Err(late());
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(PEEK_AGAIN_AT_MOST);
    }
}

/// The open-connections gauge, decremented however the connection's task ends.
struct OpenConnection(prometheus::IntGauge);

impl OpenConnection {
    fn new(metrics: &Metrics) -> Self {
        metrics.open_connections.inc();
        OpenConnection(metrics.open_connections.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// What one connection is doing: requests in progress (from a request's arrival to its
/// response body's end, or the request's cancellation), when the last one ended, and the
/// reader to wake when none is left (its idle timer starts then).
#[derive(Debug)]
struct Activity {
    in_progress: AtomicUsize,
    /// Requests begun on this connection.
    begun: AtomicUsize,
    /// When the connection started, then when its last request in progress ended.
    idle_since: std::sync::Mutex<Instant>,
    reader: std::sync::Mutex<Option<std::task::Waker>>,
}

impl Activity {
    fn new() -> Self {
        Activity {
            in_progress: AtomicUsize::new(0),
            begun: AtomicUsize::new(0),
            idle_since: std::sync::Mutex::new(Instant::now()),
            reader: std::sync::Mutex::new(None),
        }
    }

    fn begin(self: &Arc<Self>) -> InProgress {
        self.in_progress.fetch_add(1, Ordering::SeqCst);
        self.begun.fetch_add(1, Ordering::SeqCst);
        InProgress(self.clone())
    }
}

/// One request in progress; dropped with its response body, or with the request's future when
/// the request is cancelled (an HTTP/2 reset, say).
struct InProgress(Arc<Activity>);

impl Drop for InProgress {
    fn drop(&mut self) {
        let activity = &self.0;
        if let Ok(mut since) = activity.idle_since.lock() {
            *since = Instant::now();
        }
        if activity.in_progress.fetch_sub(1, Ordering::SeqCst) == 1
            && let Some(reader) = activity.reader.lock().ok().and_then(|mut r| r.take())
        {
            reader.wake();
        }
    }
}

/// `router` as a hyper service that keeps `activity` up to date.
fn tracked(
    router: Router,
    activity: Arc<Activity>,
) -> impl hyper::service::Service<
    hyper::Request<Incoming>,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<axum::response::Response, std::convert::Infallible>> + Send,
> + Clone {
    hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let in_progress = (activity.begin(), cores::begin_request());
        let mut router = router.clone();
        async move {
            let response = router.call(request.map(Body::new)).await?;
            Ok(response
                .map(|body| Body::new(ObservedBody::new(body, None, move |_| drop(in_progress)))))
        }
    })
}

/// A client connection that is closed when it has nothing in progress for too long: its first
/// request's headers must be complete within `header_read` of the connection's start, and a
/// later request must begin within `idle` of the end of the last one. Bytes alone (an HTTP/2
/// ping, a slow header) never extend it.
struct Watched {
    io: TcpStream,
    activity: Arc<Activity>,
    limits: ClientLimits,
    timer: Option<Pin<Box<Sleep>>>,
}

impl Watched {
    fn new(io: TcpStream, activity: Arc<Activity>, limits: ClientLimits) -> Self {
        Watched {
            io,
            activity,
            limits,
            timer: None,
        }
    }

    /// When the connection counts as abandoned (nothing is in progress).
    fn deadline(&self) -> Option<Instant> {
        let wait = if self.activity.begun.load(Ordering::SeqCst) == 0 {
            self.limits.header_read
        } else {
            self.limits.idle
        };
        let since = self.activity.idle_since.lock().map(|s| *s).ok()?;
        Some(since + wait)
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Poll::Ready(result) = Pin::new(&mut this.io).poll_read(cx, buf) {
            return Poll::Ready(result);
        }
        if this.activity.in_progress.load(Ordering::SeqCst) > 0 {
            // Woken when the last request in progress ends, to start the idle timer.
            if let Ok(mut reader) = this.activity.reader.lock() {
                *reader = Some(cx.waker().clone());
            }
            if this.activity.in_progress.load(Ordering::SeqCst) > 0 {
                this.timer = None;
                return Poll::Pending;
            }
        }
        let Some(deadline) = this.deadline() else {
            return Poll::Pending;
        };
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "client idle past the timeout",
        )))
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_bytes_tell_http2_once_they_start_as_its_preface() {
        assert_eq!(
            Protocol::of(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
            Some(Protocol::Http2)
        );
        assert_eq!(Protocol::of(b"PRI"), Some(Protocol::Http2));
        assert_eq!(Protocol::of(b"PR"), None);
        assert_eq!(Protocol::of(b"P"), None);
    }

    #[test]
    fn the_first_bytes_tell_http1_as_soon_as_they_leave_the_preface() {
        assert_eq!(Protocol::of(b"PO"), Some(Protocol::Http1));
        assert_eq!(Protocol::of(b"PUT"), Some(Protocol::Http1));
        assert_eq!(Protocol::of(b"GET / HTTP/1.1\r\n"), Some(Protocol::Http1));
    }
}
