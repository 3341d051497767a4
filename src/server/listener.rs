//! Accepting connections, so that slow, idle or hostile clients can't take the proxy down: at
//! most `max_connections` at once (more wait a moment in the backlog, then are closed), a
//! request's headers within `header_read_timeout`, and a connection with nothing in progress
//! closed after `idle_timeout`. Graceful shutdown lives here too.

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
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::body::ObservedBody;
use crate::config::ServerConfig;
use crate::metrics::Metrics;

/// How long a connection past `max_connections` waits for a free place before it is closed.
const CONNECTION_WAIT: Duration = Duration::from_secs(1);
/// Pause after an accept error (out of file descriptors, say) before accepting again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

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
) -> io::Result<()> {
    let limits = ClientLimits::of(config);
    let places = Arc::new(Semaphore::new(config.max_connections));
    let graceful = GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read)
        .keep_alive(true);
    builder.http2().timer(TokioTimer::new());
    let mut shutdown = pin!(shutdown);
    loop {
        let place = tokio::select! {
            () = &mut shutdown => break,
            place = tokio::time::timeout(CONNECTION_WAIT, places.clone().acquire_owned()) => place,
        };
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
        // No free place within the wait: this connection is closed at once.
        let Ok(Ok(place)) = place else {
            metrics.connections_refused.inc();
            drop(tcp);
            continue;
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let activity = Arc::new(Activity::default());
        let io = TokioIo::new(Watched::new(tcp, activity.clone(), limits));
        let service = tracked(router.clone(), activity);
        let connection = builder
            .serve_connection_with_upgrades(io, service)
            .into_owned();
        let connection = graceful.watch(connection);
        let open = metrics.open_connections.clone();
        open.inc();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            open.dec();
            drop(place);
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(grace) => {
            tracing::warn!("shutdown grace period elapsed; closing the remaining connections");
        }
    }
    Ok(())
}

/// Requests in progress on one connection (from the request's arrival to its response body's
/// end): while there is one, the connection is not idle.
#[derive(Debug, Default)]
struct Activity {
    in_progress: AtomicUsize,
    /// Requests begun on this connection.
    begun: AtomicUsize,
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
        activity.in_progress.fetch_add(1, Ordering::Relaxed);
        activity.begun.fetch_add(1, Ordering::Relaxed);
        let activity = activity.clone();
        let mut router = router.clone();
        async move {
            let response = router.call(request.map(Body::new)).await?;
            Ok(response.map(|body| {
                Body::new(ObservedBody::new(body, None, move |_| {
                    activity.in_progress.fetch_sub(1, Ordering::Relaxed);
                }))
            }))
        }
    })
}

/// A client connection that is closed when it has nothing in progress and no bytes move: the
/// first request's headers must begin arriving within `header_read` of the connection's start
/// (hyper then bounds the rest of them), later ones within `idle` of the last byte either way.
struct Watched {
    io: TcpStream,
    activity: Arc<Activity>,
    limits: ClientLimits,
    last_io: Instant,
    timer: Option<Pin<Box<Sleep>>>,
}

impl Watched {
    fn new(io: TcpStream, activity: Arc<Activity>, limits: ClientLimits) -> Self {
        Watched {
            io,
            activity,
            limits,
            last_io: Instant::now(),
            timer: None,
        }
    }

    /// When the connection counts as abandoned, if nothing is in progress.
    fn deadline(&self) -> Option<Instant> {
        if self.activity.in_progress.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let wait = if self.activity.begun.load(Ordering::Relaxed) == 0 {
            self.limits.header_read
        } else {
            self.limits.idle
        };
        Some(self.last_io + wait)
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if buf.filled().len() > before {
                    this.last_io = Instant::now();
                }
                this.timer = None;
                Poll::Ready(result)
            }
            Poll::Pending => {
                let Some(deadline) = this.deadline() else {
                    this.timer = None;
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
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = ready!(Pin::new(&mut this.io).poll_write(cx, data));
        if written.as_ref().is_ok_and(|n| *n > 0) {
            this.last_io = Instant::now();
        }
        Poll::Ready(written)
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
        let this = self.get_mut();
        let written = ready!(Pin::new(&mut this.io).poll_write_vectored(cx, bufs));
        if written.as_ref().is_ok_and(|n| *n > 0) {
            this.last_io = Instant::now();
        }
        Poll::Ready(written)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
