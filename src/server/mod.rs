//! The HTTP server: routes, shared state, and graceful shutdown.
//!
//! The request flow of a chat completion lives in [`chat`]; every other `/v1/*` path is a
//! transparent pass-through ([`passthrough`]); [`middleware`] wraps them all with request ids,
//! auth, the concurrency limit, metrics and the access log.

mod cached;
mod chain_tools;
mod chat;
mod command;
mod guarded;
mod housekeeping;
pub mod learned;
mod listener;
mod meter;
mod middleware;
mod ops;
mod passthrough;
mod prefix_state;
pub(crate) mod recall_marks;
mod scope;
mod sticky;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, header};
use axum::routing::{any, get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

pub use command::{CheckConfigArgs, ServeArgs, check_config, cmd};
pub use middleware::RequestContext;

use crate::config::Config;
use crate::cores::{Cores, Pool};
use crate::error::ProxyError;
use crate::metrics::{Metrics, ModelLabels};
use crate::pipeline;
use crate::record::Recorder;
use crate::store::Store;
use crate::tokens::Tokenizers;
use crate::upstream::Upstreams;

/// Everything a request handler can read. Built once at start.
pub struct AppState {
    pub config: Arc<Config>,
    pub upstreams: Upstreams,
    pub metrics: Metrics,
    pub tokenizers: Tokenizers,
    /// Segment summaries shared by every request (see `pipeline::Memo`).
    pub memo: pipeline::Memo,
    /// Conversation state and caches (Redis, or memory).
    pub store: Store,
    /// The bounded set of model names used as metric labels.
    pub model_labels: ModelLabels,
    /// `[record]`: sampled exchanges to the recording file.
    pub recorder: Arc<Recorder>,
    /// Where a large body's rewrite runs, off the serving threads (`ChatCall::run_pipeline`).
    pub rewriters: Pool,
    limiter: Arc<Semaphore>,
    /// Chat bodies being read before a slot is taken (bounds the memory they hold).
    body_readers: Arc<Semaphore>,
    shutting_down: AtomicBool,
}

pub type SharedState = Arc<AppState>;

/// Chat bodies read at once per concurrency slot: reading happens before a slot is taken (a
/// slow client never holds one), and this keeps the memory those bodies hold bounded
/// (`concurrency_limit` × this × `max_body_bytes`).
const BODY_READERS_PER_SLOT: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("upstream client: {0}")]
    Upstream(#[from] std::io::Error),
    #[error("store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("recorder: {0}")]
    Recorder(std::io::Error),
    #[error("rewrite threads: {0}")]
    Rewriters(std::io::Error),
}

impl AppState {
    pub fn new(config: Config) -> Result<SharedState, StartError> {
        let upstreams = Upstreams::new(&config)?;
        let metrics = Metrics::new()?;
        metrics.initialize(&config.upstream_names());
        let store = Store::new(&config.store, metrics.store())?;
        let recorder = Recorder::start(
            &config.record,
            metrics.records_written.clone(),
            metrics.record_dropped.clone(),
        )
        .map(Arc::new)
        .map_err(StartError::Recorder)?;
        let memory = &config.memory;
        let tokenizers = Tokenizers::new(memory.token_counts_max_bytes, memory.idle());
        let memo = pipeline::Memo::new(memory);
        let rewriters = Pool::start("ctxproxy-rewrite", config.server.threads)
            .map_err(StartError::Rewriters)?;
        Ok(Arc::new(AppState {
            model_labels: ModelLabels::new(config.model_names()),
            limiter: Arc::new(Semaphore::new(config.server.concurrency_limit)),
            body_readers: Arc::new(Semaphore::new(
                config.server.concurrency_limit * BODY_READERS_PER_SLOT,
            )),
            config: Arc::new(config),
            upstreams,
            metrics,
            tokenizers,
            memo,
            store,
            recorder,
            rewriters,
            shutting_down: AtomicBool::new(false),
        }))
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }
}

pub fn router(state: SharedState) -> Router {
    let mut router = Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz));
    // With a private metrics address, the API listener does not serve them at all.
    if state.config.server.metrics_listen.is_none() {
        router = router.route("/metrics", get(ops::metrics));
    }
    router
        // GET /v1/chat/completions (stored completions) and friends are plain pass-through.
        .route(
            "/v1/chat/completions",
            post(chat::chat_completions).fallback(passthrough::forward),
        )
        .route(
            "/v1/responses",
            post(chat::responses).fallback(passthrough::forward),
        )
        .route("/v1/ctxproxy/explain", post(chat::explain))
        .route("/v1/{*rest}", any(passthrough::forward))
        .fallback(ops::not_found)
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::observe,
        ))
        .with_state(state)
}

/// `/metrics` alone, for `server.metrics_listen` (no auth: keep that address private).
fn metrics_router(state: SharedState) -> Router {
    Router::new()
        .route("/metrics", get(ops::private_metrics))
        .fallback(ops::not_found)
        .with_state(state)
}

/// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests (streams
/// included) finish for up to `server.shutdown_grace_secs`. With `server.metrics_listen`, the
/// metrics are served there, until the same moment. Every connection is served on the
/// caller's runtime.
pub async fn serve(
    listener: TcpListener,
    state: SharedState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_on(listener, state, &Cores::none(), shutdown).await
}

/// `serve`, each API connection on one of `cores` (the metrics listener's on the caller's).
pub async fn serve_on(
    listener: TcpListener,
    state: SharedState,
    cores: &Cores,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let server = &state.config.server;
    let grace = server.shutdown_grace;
    housekeeping::spawn(&state);
    let (stopping, stopped) = tokio::sync::watch::channel(false);
    let signal_state = state.clone();
    tokio::spawn(async move {
        shutdown.await;
        signal_state.shutting_down.store(true, Ordering::Relaxed);
        tracing::info!(
            grace_secs = grace.as_secs(),
            "shutting down: waiting for in-flight requests"
        );
        let _ = stopping.send(true);
    });
    let until_stopped = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stopping| *stopping).await;
    };
    if let Some(address) = server.metrics_listen {
        let metrics_listener = TcpListener::bind(address).await?;
        tracing::info!(%address, "serving /metrics on its own address");
        let state = state.clone();
        let stop = until_stopped(stopped.clone());
        tokio::spawn(async move {
            let server = &state.config.server;
            let cores = Cores::none();
            let served = listener::serve(
                metrics_listener,
                metrics_router(state.clone()),
                server,
                &state.metrics,
                stop,
                grace,
                &cores,
            );
            if let Err(e) = served.await {
                tracing::error!(error = %e, "the metrics listener failed");
            }
        });
    }
    listener::serve(
        listener,
        router(state.clone()),
        server,
        &state.metrics,
        until_stopped(stopped),
        grace,
        cores,
    )
    .await
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// Reads a whole request body, refusing more than `limit` bytes with a 413.
async fn read_body(body: Body, headers: &HeaderMap, limit: usize) -> Result<Bytes, ProxyError> {
    if content_length(headers).is_some_and(|len| len > limit as u64) {
        return Err(ProxyError::BodyTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ProxyError::BodyTooLarge { limit })
        }
        Err(e) if crate::upstream::find_source::<crate::body::DeadlineExceeded>(&*e).is_some() => {
            Err(ProxyError::BodyTimeout)
        }
        Err(e) => Err(ProxyError::InvalidBody(format!(
            "cannot read the body: {e}"
        ))),
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}
