//! Upstream clients: one pooled HTTP(S) client per configured upstream, routing by model,
//! timeouts (connect, first byte, total), and the retry rule (only when the connection failed,
//! so no byte of the request was sent).

pub mod config;
mod headers;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;

pub use headers::{apply_upstream_auth, end_to_end, is_event_stream};

use crate::body::{
    BodyEnd, BodyObserver, BoxError, CheckedEnd, DeadlineExceeded, DropFrames, EndedEarly,
    ErrorEventEnd, ObservedBody, SseEventBody, StreamFault, TapBody, ToldError,
};
use crate::config::{Config, UpstreamConfig};
use crate::error::ProxyError;
use crate::metrics::{ChatLabels, Metrics, UpstreamError};
use crate::openai::Api;
use crate::pipeline::PipelineConfig;
use crate::pipeline::config::Definitions;

pub type HttpClient = Client<HttpsConnector<HttpConnector>, Body>;

/// All upstreams, indexed as `Config::upstreams`.
pub struct Upstreams {
    list: Vec<Arc<Upstream>>,
}

impl Upstreams {
    pub fn new(config: &Config) -> Result<Upstreams, std::io::Error> {
        let list = config
            .upstreams
            .iter()
            .map(|c| Upstream::new(c.clone(), config.server.threads).map(Arc::new))
            .collect::<Result<_, _>>()?;
        Ok(Upstreams { list })
    }

    pub fn get(&self, index: usize) -> Option<&Arc<Upstream>> {
        self.list.get(index)
    }
}

/// One upstream: its config, pooled clients, and what it taught the proxy.
pub struct Upstream {
    pub config: UpstreamConfig,
    /// A pooled client per serving thread (`cores.rs`): a connection to the upstream is used
    /// by the thread that opened it, so its I/O wakes no other thread.
    clients: Vec<HttpClient>,
    /// The pipeline's config with tools needed later defined in the block, used once the
    /// upstream is known to refuse or drop a definitions message in mid-conversation.
    in_block: Arc<PipelineConfig>,
    /// The pipeline's config with every tool in full and no recall tool, for a request whose
    /// answer the proxy must not re-ask (`ChatCall::run_pipeline`).
    tools_whole: Arc<PipelineConfig>,
    /// What its chat template taught: 0 nothing, else a [`Lesson`].
    learned: AtomicU8,
    /// When the store may next be asked what other replicas learned, in milliseconds since
    /// `born`.
    next_store_check_ms: AtomicU64,
    born: std::time::Instant,
}

/// What an upstream's chat template does to a system message in mid-conversation, once seen:
/// either way, its tools needed later are defined in the block from then on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lesson {
    /// A 400 (vLLM's "Only user and assistant roles are supported…").
    Refuses,
    /// Dropped silently: the model called a tool defined there from its stub.
    Drops,
}

impl Lesson {
    pub fn as_str(self) -> &'static str {
        match self {
            Lesson::Refuses => "refuses",
            Lesson::Drops => "drops",
        }
    }

    pub fn parse(text: &str) -> Option<Lesson> {
        match text {
            "refuses" => Some(Lesson::Refuses),
            "drops" => Some(Lesson::Drops),
            _ => None,
        }
    }

    fn code(self) -> u8 {
        match self {
            Lesson::Refuses => 1,
            Lesson::Drops => 2,
        }
    }

    fn of_code(code: u8) -> Option<Lesson> {
        match code {
            1 => Some(Lesson::Refuses),
            2 => Some(Lesson::Drops),
            _ => None,
        }
    }
}

/// A request body for an upstream: buffered bodies can be re-sent after a connect failure.
pub enum OutgoingBody {
    Buffered(Bytes),
    Streaming(Body),
}

/// The upstream's answer, with the instant it was asked and the deadline of the request it is a
/// part of (the relay cuts the body there). The body is boxed so that a guard can replace it (a
/// continued or repaired answer).
pub struct UpstreamResponse {
    pub response: Response<Body>,
    pub started: Instant,
    pub deadline: Instant,
}

/// A pooled HTTP/1.1 + HTTP/2 client over TCP or TLS (webpki roots), no-delay sockets.
pub fn http_client(
    connect_timeout: std::time::Duration,
    pool_idle_timeout: std::time::Duration,
    pool_max_idle_per_host: usize,
) -> HttpClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(pool_idle_timeout)
        .pool_max_idle_per_host(pool_max_idle_per_host)
        .build(https)
}

impl Upstream {
    fn new(config: UpstreamConfig, threads: usize) -> Result<Upstream, std::io::Error> {
        let clients = (0..threads.max(1))
            .map(|_| {
                http_client(
                    config.connect_timeout,
                    config.pool_idle_timeout,
                    config.pool_max_idle_per_host,
                )
            })
            .collect();
        let mut in_block = PipelineConfig::clone(&config.pipeline);
        in_block.tools.definitions = Definitions::InBlock;
        let mut tools_whole = PipelineConfig::clone(&config.pipeline);
        tools_whole.tools.enabled = false;
        tools_whole.compact.recall = false;
        Ok(Upstream {
            config,
            clients,
            in_block: Arc::new(in_block),
            tools_whole: Arc::new(tools_whole),
            learned: AtomicU8::new(0),
            next_store_check_ms: AtomicU64::new(0),
            born: std::time::Instant::now(),
        })
    }

    /// The calling serving thread's client.
    fn client(&self) -> &HttpClient {
        &self.clients[crate::cores::current() % self.clients.len()]
    }

    /// The pipeline's config with every tool in full and no recall tool.
    pub fn tools_whole_pipeline(&self) -> &Arc<PipelineConfig> {
        &self.tools_whole
    }

    /// The pipeline's config for a request to this upstream: the configured one, or, once the
    /// upstream is known to refuse or drop a definitions message, the same with definitions in
    /// the block.
    pub fn pipeline(&self) -> &Arc<PipelineConfig> {
        if self.learned().is_some() {
            &self.in_block
        } else {
            &self.config.pipeline
        }
    }

    /// What the upstream's template is known to do with a definitions message, if anything.
    pub fn learned(&self) -> Option<Lesson> {
        Lesson::of_code(self.learned.load(Ordering::Relaxed))
    }

    /// Records what the upstream's template does with a definitions message in
    /// mid-conversation: its later requests define tools in the block. `true` the first time
    /// it learns anything (a second lesson changes nothing).
    pub fn learn(&self, lesson: Lesson) -> bool {
        self.learned
            .compare_exchange(0, lesson.code(), Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// Whether the store is to be asked now what other replicas learned: at most once per
    /// `every` (the first request that finds it due asks; the others go on without waiting).
    pub fn store_check_due(&self, every: std::time::Duration) -> bool {
        let now = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_store_check_ms.load(Ordering::Relaxed);
        if now < next {
            return false;
        }
        let later = now.saturating_add(u64::try_from(every.as_millis()).unwrap_or(u64::MAX));
        self.next_store_check_ms
            .compare_exchange(next, later, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// The upstream URL for a path below `/v1` (e.g. `/chat/completions?x=1`).
    pub fn uri(&self, suffix: &str) -> Result<Uri, ProxyError> {
        format!("{}{}", self.config.base_url, suffix)
            .parse()
            .map_err(|e| ProxyError::InvalidBody(format!("cannot build the upstream URL: {e}")))
    }

    /// The deadline of a request that starts now: its whole answer, every part of it, must
    /// have arrived by then.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.config.total_timeout
    }

    /// Sends a request and waits for the response head (first byte), retrying connect failures
    /// of buffered requests. `deadline` is the request's ([`Upstream::deadline`], taken when
    /// its first part was asked): the head must come within the first-byte timeout and by
    /// `deadline`, and the answer's deadline is `deadline`.
    pub async fn send(
        &self,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: OutgoingBody,
        metrics: &Metrics,
        deadline: Instant,
    ) -> Result<UpstreamResponse, ProxyError> {
        let started = Instant::now();
        let first_byte_deadline = (started + self.config.first_byte_timeout).min(deadline);
        let (attempts, buffered, mut streaming) = match body {
            OutgoingBody::Buffered(bytes) => (1 + self.config.connect_retries, Some(bytes), None),
            OutgoingBody::Streaming(body) => (1, None, Some(body)),
        };
        for attempt in 1..=attempts {
            let request_body = match (&buffered, streaming.take()) {
                (Some(bytes), _) => Body::from(bytes.clone()),
                (None, Some(body)) => body,
                (None, None) => break,
            };
            let mut builder = Request::builder().method(method.clone()).uri(uri.clone());
            if let Some(h) = builder.headers_mut() {
                *h = headers.clone();
            }
            let request = builder
                .body(request_body)
                .map_err(|e| ProxyError::Internal(e.to_string()))?;
            let result =
                tokio::time::timeout_at(first_byte_deadline, self.client().request(request)).await;
            match result {
                Ok(Ok(response)) => {
                    return Ok(UpstreamResponse {
                        response: response.map(Body::new),
                        started,
                        deadline,
                    });
                }
                Err(_elapsed) => {
                    self.count_error(metrics, UpstreamError::Timeout);
                    return Err(if first_byte_deadline < deadline {
                        ProxyError::UpstreamTimeout {
                            upstream: self.config.name.clone(),
                            phase: "first byte",
                            timeout_ms: self.config.first_byte_timeout.as_millis(),
                        }
                    } else {
                        self.total_timeout()
                    });
                }
                Ok(Err(e)) if e.is_connect() && attempt < attempts => {
                    self.count_error(metrics, UpstreamError::Connect);
                    tracing::debug!(upstream = %self.config.name, attempt, error = %error_chain(&e), "connect failed, retrying");
                }
                Ok(Err(e)) => {
                    if find_source::<http_body_util::LengthLimitError>(&e).is_some() {
                        // The caller knows the limit it set on the streamed body.
                        return Err(ProxyError::BodyTooLarge { limit: 0 });
                    }
                    // The client's streamed body took longer than `body_read_timeout_ms`.
                    if find_source::<DeadlineExceeded>(&e).is_some() {
                        return Err(ProxyError::BodyTimeout);
                    }
                    let connect = e.is_connect();
                    self.count_error(
                        metrics,
                        if connect {
                            UpstreamError::Connect
                        } else {
                            UpstreamError::Request
                        },
                    );
                    if connect && is_timeout(&e) {
                        return Err(ProxyError::UpstreamTimeout {
                            upstream: self.config.name.clone(),
                            phase: "connect",
                            timeout_ms: self.config.connect_timeout.as_millis(),
                        });
                    }
                    return Err(ProxyError::UpstreamUnreachable {
                        upstream: self.config.name.clone(),
                        reason: error_chain(&e),
                    });
                }
            }
        }
        Err(ProxyError::Internal(
            "upstream retry loop ended without an answer".into(),
        ))
    }

    /// A small JSON call of the proxy's own (e.g. embeddings): the status and the whole body,
    /// within `timeout` and `limit` bytes.
    pub async fn call_json(
        &self,
        suffix: &str,
        headers: HeaderMap,
        body: Bytes,
        limit: usize,
        timeout: std::time::Duration,
        metrics: &Metrics,
    ) -> Result<(StatusCode, Bytes), ProxyError> {
        let uri = self.uri(suffix)?;
        let call = async {
            let answer = self
                .send(
                    Method::POST,
                    uri,
                    headers,
                    OutgoingBody::Buffered(body),
                    metrics,
                    self.deadline(),
                )
                .await?;
            let status = answer.response.status();
            let collected = Limited::new(answer.response.into_body(), limit)
                .collect()
                .await
                .map_err(|e| ProxyError::UpstreamUnreachable {
                    upstream: self.config.name.clone(),
                    reason: format!("cannot read the answer: {e}"),
                })?;
            Ok((status, collected.to_bytes()))
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| ProxyError::UpstreamTimeout {
                upstream: self.config.name.clone(),
                phase: "total",
                timeout_ms: timeout.as_millis(),
            })?
    }

    /// The request's total timeout passed.
    pub fn total_timeout(&self) -> ProxyError {
        ProxyError::UpstreamTimeout {
            upstream: self.config.name.clone(),
            phase: "total",
            timeout_ms: self.config.total_timeout.as_millis(),
        }
    }

    pub fn count_error(&self, metrics: &Metrics, kind: UpstreamError) {
        metrics
            .upstream_errors
            .with_label_values(&[self.config.name.as_str(), kind.as_str()])
            .inc();
    }
}

/// `e` and its sources, joined: hyper's top-level messages alone say little (a source that an
/// outer message already quotes is not repeated).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let said = s.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = s.source();
    }
    text
}

/// The first error of type `T` in `e`'s source chain.
pub(crate) fn find_source<'a, T: std::error::Error + 'static>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a T> {
    let mut source = Some(e);
    while let Some(s) = source {
        if let Some(found) = s.downcast_ref::<T>() {
            return Some(found);
        }
        source = s.source();
    }
    None
}

fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    find_source::<std::io::Error>(e).is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
}

/// What the chat route adds to a relay: the observers of the answer, the SSE events the
/// client does not get, and whether the stream was asked for usage (then a complete one
/// carries it).
#[derive(Default)]
pub struct ChatRelay {
    pub observer: Option<Box<dyn BodyObserver>>,
    pub drop_event: Option<fn(&[u8]) -> bool>,
    pub usage_asked: bool,
    /// Which API's stream it is: how it ends, and the error event that ends a failed one.
    pub api: Api,
}

/// The upstream's stream stopped; `cause` says how.
pub fn interrupted(upstream: &str, cause: &(dyn std::error::Error + 'static)) -> ProxyError {
    ProxyError::UpstreamStreamInterrupted {
        upstream: upstream.to_owned(),
        reason: error_chain(cause),
    }
}

impl Upstream {
    /// The client's response: the upstream's status, end-to-end headers and body, streamed, with
    /// the total deadline applied and SSE re-framed one event per frame. `chat`: the answer to a
    /// chat completion, shown to its observer, with the events `drop_event` picks left out of
    /// what the client receives (after the observer saw them); a successful stream of it ends
    /// complete or with an error event, never cut (its cause in the response's
    /// [`StreamFault`] extension).
    pub fn relay(
        &self,
        answer: UpstreamResponse,
        metrics: &Metrics,
        labels: &ChatLabels,
        chat: Option<ChatRelay>,
    ) -> Response<Body> {
        let UpstreamResponse {
            response,
            started,
            deadline,
        } = answer;
        let (mut parts, body) = response.into_parts();
        parts.headers = end_to_end(&parts.headers);
        let is_sse = is_event_stream(&parts.headers);
        let checked = is_sse && chat.is_some() && parts.status.is_success();
        let duration = metrics.upstream_duration.with_label_values(&[
            self.config.name.as_str(),
            &labels.model,
            &labels.tenant,
        ]);
        let errors = metrics.upstream_errors.clone();
        let name = self.config.name.clone();
        let observed = ObservedBody::new(body, Some(deadline), move |end| {
            duration.observe(started.elapsed().as_secs_f64());
            let kind = match end {
                BodyEnd::DeadlineExceeded => UpstreamError::Timeout,
                BodyEnd::Failed => UpstreamError::Body,
                BodyEnd::Complete | BodyEnd::Dropped => return,
            };
            errors
                .with_label_values(&[name.as_str(), kind.as_str()])
                .inc();
        });
        let ChatRelay {
            observer,
            drop_event,
            usage_asked,
            api,
        } = chat.unwrap_or_default();
        if !is_sse {
            let body = match observer {
                Some(observer) => Body::new(TapBody::new(observed, observer)),
                None => Body::new(observed),
            };
            return Response::from_parts(parts, body);
        }
        parts.headers.remove(axum::http::header::CONTENT_LENGTH);
        let max_event = self.config.max_event_bytes;
        let too_large = {
            let errors = metrics.upstream_errors.clone();
            let name = self.config.name.clone();
            move || {
                tracing::warn!(upstream = %name, max_event, "an upstream stream event is too large: stream cut");
                errors
                    .with_label_values(&[name.as_str(), UpstreamError::EventTooLarge.as_str()])
                    .inc();
            }
        };
        let framed = SseEventBody::new(observed, max_event, too_large);
        let framed = match api {
            _ if !checked => Body::new(framed),
            Api::Chat => Body::new(CheckedEnd::new(framed, usage_asked)),
            Api::Responses => Body::new(CheckedEnd::responses(framed)),
        };
        let tapped = match observer {
            Some(observer) => Body::new(TapBody::new(framed, observer)),
            None => framed,
        };
        let kept = match drop_event {
            Some(drop) => Body::new(DropFrames::new(tapped, drop)),
            None => tapped,
        };
        let body = if checked {
            let fault = StreamFault::default();
            parts.extensions.insert(fault.clone());
            Body::new(ErrorEventEnd::new(
                kept,
                self.stream_failure(metrics, fault, api),
            ))
        } else {
            kept
        };
        Response::from_parts(parts, body)
    }

    /// What a chat stream's failure becomes: the error event that ends it (none when the client
    /// was told already), its cause noted in `fault`; a stream that stopped early is counted
    /// as a failed body.
    fn stream_failure(
        &self,
        metrics: &Metrics,
        fault: StreamFault,
        api: Api,
    ) -> impl FnOnce(BoxError) -> Option<Bytes> + Send + 'static {
        let errors = metrics.upstream_errors.clone();
        let name = self.config.name.clone();
        let timeout = self.total_timeout();
        move |failure| {
            if let Some(told) = find_source::<ToldError>(&*failure) {
                fault.set(told.0.clone());
                return None;
            }
            let error = if find_source::<DeadlineExceeded>(&*failure).is_some() {
                timeout
            } else {
                if find_source::<EndedEarly>(&*failure).is_some() {
                    errors
                        .with_label_values(&[name.as_str(), UpstreamError::Body.as_str()])
                        .inc();
                }
                interrupted(&name, &*failure)
            };
            fault.set(format!("{}: {error}", error.code()));
            Some(match api {
                Api::Chat => error.sse_event(),
                Api::Responses => error.responses_sse_event(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn upstream() -> Upstream {
        let config = Config::from_toml("[upstream]\nbase_url = \"http://127.0.0.1:9/v1\"\n", [])
            .unwrap_or_else(|e| panic!("{e}"));
        Upstream::new(config.upstreams[0].clone(), 1).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn an_upstream_learns_once_and_defines_tools_in_the_block_from_then_on() {
        let upstream = upstream();
        assert_eq!(upstream.learned(), None);
        assert!(!Arc::ptr_eq(upstream.pipeline(), &upstream.in_block));
        assert!(upstream.learn(Lesson::Drops));
        assert!(
            !upstream.learn(Lesson::Refuses),
            "a second lesson changes nothing"
        );
        assert_eq!(upstream.learned(), Some(Lesson::Drops));
        assert!(upstream.pipeline().tools.definitions.in_block());
        for lesson in [Lesson::Refuses, Lesson::Drops] {
            assert_eq!(Lesson::parse(lesson.as_str()), Some(lesson));
        }
        assert_eq!(Lesson::parse("reads"), None);
    }

    #[test]
    fn the_store_is_due_once_per_period() {
        let upstream = upstream();
        let every = Duration::from_secs(60);
        assert!(upstream.store_check_due(every));
        assert!(!upstream.store_check_due(every), "the others go on");
        let often = self::upstream();
        assert!(often.store_check_due(Duration::ZERO));
        assert!(often.store_check_due(Duration::ZERO));
    }
}
