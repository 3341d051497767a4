//! `ctxproxy replay`: sends recorded chat requests to a target (a ctxproxy, or any
//! OpenAI-compatible URL) as a load test, closed loop (`concurrency` workers back to back) or
//! open loop (a fixed rate, or the recorded inter-arrival times), and summarizes what came back.
//! Open-loop latency is measured from each request's intended send time, so a slow target
//! cannot hide its queueing (no coordinated omission).

mod command;
pub mod report;
pub mod source;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request, header};
use http_body_util::BodyExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::upstream::{HttpClient, http_client};
pub use command::{ReplayArgs, ReportCommand, cmd, report_cmd};
pub use report::{Report, Sample, diff};
pub use source::{Recorded, load};

/// How requests are paced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pacing {
    /// `concurrency` workers, each sending its next request when the previous one ends.
    Closed { concurrency: usize },
    /// One request every 1/`rate` seconds, whatever the answers take.
    Rate { rate: f64 },
    /// The recorded inter-arrival times (`unix_ms` of each line), divided by `speed`.
    Recorded { speed: f64 },
}

/// Streaming as recorded, or forced on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamMode {
    Recorded,
    On,
    Off,
}

#[derive(Debug, Clone)]
pub struct Options {
    /// Base URL (`http://host:port`, with or without `/v1`) or the full chat completions URL.
    pub target: String,
    pub pacing: Pacing,
    /// Stop after this many requests (the file is cycled) …
    pub requests: Option<u64>,
    /// … or after this long, whichever comes first (neither: every request once).
    pub duration: Option<Duration>,
    pub headers: Vec<(String, String)>,
    pub stream: StreamMode,
    /// A distinct `user` on every request: with `[cache.dedup] scope = "user"` the caches are
    /// consulted but never answer, so every request runs the whole pipeline and the model call.
    pub vary_user: bool,
    /// Give up on one request after this long (counted as an error without a status).
    pub timeout: Duration,
    pub progress: bool,
    /// Names the run in reports and comparisons.
    pub label: String,
}

/// The chat completions URL of a target.
pub fn chat_url(target: &str) -> String {
    let target = target.trim_end_matches('/');
    if target.ends_with("/chat/completions") {
        target.to_owned()
    } else if target.ends_with("/v1") {
        format!("{target}/chat/completions")
    } else {
        format!("{target}/v1/chat/completions")
    }
}

/// The Responses API URL of a target (given as its base, or as its chat completions URL).
pub fn responses_url(target: &str) -> String {
    let chat = chat_url(target);
    let base = chat.strip_suffix("/chat/completions").unwrap_or(&chat);
    format!("{base}/responses")
}

/// Whether a body is a Responses API body (`input`, no `messages`): sent to `/v1/responses`.
fn is_responses(body: &Value) -> bool {
    body.get("input").is_some() && body.get("messages").is_none()
}

/// A request body as this run sends it, and whether it streams.
fn prepared(body: &Value, stream: StreamMode, vary_user: bool) -> (bytes::Bytes, bool) {
    let mut body = body.clone();
    if let Some(object) = body.as_object_mut() {
        if vary_user {
            object.remove("user");
        }
        match stream {
            StreamMode::Recorded => {}
            StreamMode::On => {
                object.insert("stream".into(), Value::Bool(true));
            }
            StreamMode::Off => {
                object.remove("stream");
                object.remove("stream_options");
            }
        }
    }
    let streamed = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    (
        serde_json::to_vec(&body).unwrap_or_default().into(),
        streamed,
    )
}

/// `body` with `"user": "replay-<run>-<index>"` as its first field (`body` is a serialized
/// object without `user`).
fn with_user(body: &[u8], run: &str, index: u64) -> bytes::Bytes {
    let field = format!("\"user\":\"replay-{run}-{index}\"");
    crate::openai::with_first_field(body, field.as_bytes())
        .unwrap_or_else(|| body.to_vec())
        .into()
}

struct Shared {
    client: HttpClient,
    url: String,
    /// Where Responses API bodies go.
    responses_url: String,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// Each body as sent, whether it streams, and whether it is a Responses API body.
    bodies: Vec<(bytes::Bytes, bool, bool)>,
    /// With `vary_user`: this run's id, so that runs never share a user.
    vary_user: Option<String>,
    timeout: Duration,
    progress: ProgressBar,
}

/// Sends body `index` (cycled) and measures it from `start` (the intended send time).
async fn send_one(shared: &Shared, index: u64, start: Instant) -> Sample {
    let (body, streamed, responses) = &shared.bodies[(index % shared.bodies.len() as u64) as usize];
    let (body, streamed) = match &shared.vary_user {
        Some(run) => (with_user(body, run, index), *streamed),
        None => (body.clone(), *streamed),
    };
    let url = if *responses {
        &shared.responses_url
    } else {
        &shared.url
    };
    let mut builder = Request::builder()
        .method(Method::POST)
        .uri(url.as_str())
        .header(header::CONTENT_TYPE, "application/json");
    for (name, value) in &shared.headers {
        builder = builder.header(name, value);
    }
    let Ok(request) = builder.body(Body::from(body)) else {
        return Sample::default();
    };
    let exchange = async {
        let response = shared.client.request(request).await.ok()?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let mut sample = Sample {
            status: response.status().as_u16(),
            tokens_before: header("x-ctxproxy-tokens-before").and_then(|v| v.parse().ok()),
            tokens_after: header("x-ctxproxy-tokens-after").and_then(|v| v.parse().ok()),
            cache: header("x-ctxproxy-cache"),
            ..Sample::default()
        };
        let mut body = response.into_body();
        while let Some(frame) = body.frame().await {
            if frame.is_err() {
                sample.status = 0;
                break;
            }
            if streamed && sample.ttfb_ms.is_none() {
                sample.ttfb_ms = Some(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        Some(sample)
    };
    let mut sample = tokio::time::timeout(shared.timeout, exchange)
        .await
        .ok()
        .flatten()
        .unwrap_or_default();
    sample.latency_ms = start.elapsed().as_secs_f64() * 1e3;
    shared.progress.inc(1);
    sample
}

/// Runs the load described by `options` over `requests` and summarizes it.
pub async fn run(options: &Options, requests: &[Recorded]) -> Result<Report, String> {
    if requests.is_empty() {
        return Err("no requests to replay".into());
    }
    // Neither a count nor a duration: every request of the file, once.
    let limit = match (options.requests, options.duration) {
        (Some(n), _) => n,
        (None, None) => requests.len() as u64,
        (None, Some(_)) => u64::MAX,
    };
    let headers = options
        .headers
        .iter()
        .map(|(k, v)| {
            let name = HeaderName::try_from(k.as_str()).map_err(|e| format!("header {k}: {e}"))?;
            let value =
                HeaderValue::try_from(v.as_str()).map_err(|e| format!("header {k}: {e}"))?;
            Ok((name, value))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let progress = if options.progress {
        let bar = match limit {
            u64::MAX => ProgressBar::new_spinner(),
            n => ProgressBar::new(n),
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} {elapsed_precise} [{bar:40}] {pos}/{len} {per_sec}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let shared = Arc::new(Shared {
        client: http_client(Duration::from_secs(5), Duration::from_secs(90), 1024),
        url: chat_url(&options.target),
        responses_url: responses_url(&options.target),
        headers,
        bodies: requests
            .iter()
            .map(|r| {
                let (body, streamed) = prepared(&r.body, options.stream, options.vary_user);
                (body, streamed, is_responses(&r.body))
            })
            .collect(),
        vary_user: options.vary_user.then(|| {
            let id = uuid::Uuid::new_v4().simple().to_string();
            id[..8].to_owned()
        }),
        timeout: options.timeout,
        progress: progress.clone(),
    });
    let started = Instant::now();
    let deadline = options.duration.map(|d| started + d);
    let open = |now: Instant| deadline.is_none_or(|d| now < d);
    let mut tasks = JoinSet::new();
    let mut samples = Vec::new();
    match options.pacing {
        Pacing::Closed { concurrency } => {
            let next = Arc::new(AtomicU64::new(0));
            for _ in 0..concurrency.max(1) {
                let (shared, next) = (shared.clone(), next.clone());
                tasks.spawn(async move {
                    let mut mine = Vec::new();
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let now = Instant::now();
                        if index >= limit || deadline.is_some_and(|d| now >= d) {
                            return mine;
                        }
                        mine.push(send_one(&shared, index, now).await);
                    }
                });
            }
        }
        Pacing::Rate { .. } | Pacing::Recorded { .. } => {
            let first_ms = requests[0].unix_ms.unwrap_or(0.0);
            for index in 0..limit {
                let offset = match options.pacing {
                    Pacing::Rate { rate } => index as f64 / rate.max(f64::MIN_POSITIVE),
                    Pacing::Recorded { speed } => {
                        // The file's timeline, looped when it runs out.
                        let len = requests.len() as u64;
                        let lap = index / len;
                        let last_ms = requests[requests.len() - 1].unix_ms.unwrap_or(first_ms);
                        let at = requests[(index % len) as usize].unix_ms.unwrap_or(first_ms);
                        ((lap as f64) * (last_ms - first_ms + 1.0) + (at - first_ms))
                            / 1e3
                            / speed.max(f64::MIN_POSITIVE)
                    }
                    Pacing::Closed { .. } => 0.0,
                };
                let intended = started + Duration::from_secs_f64(offset.max(0.0));
                if !open(intended) {
                    break;
                }
                tokio::time::sleep_until(intended).await;
                let shared = shared.clone();
                tasks.spawn(async move { vec![send_one(&shared, index, intended).await] });
                // Collect what is done meanwhile, so memory stays flat on long runs.
                while let Some(done) = tasks.try_join_next() {
                    samples.extend(done.unwrap_or_default());
                }
            }
        }
    }
    while let Some(done) = tasks.join_next().await {
        samples.extend(done.unwrap_or_default());
    }
    progress.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();
    Ok(Report::of(&options.label, &samples, elapsed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_and_stream_modes() {
        assert_eq!(chat_url("http://h:1"), "http://h:1/v1/chat/completions");
        assert_eq!(responses_url("http://h:1"), "http://h:1/v1/responses");
        assert_eq!(
            responses_url("http://h:1/v1/chat/completions"),
            "http://h:1/v1/responses"
        );
        assert_eq!(chat_url("http://h:1/v1/"), "http://h:1/v1/chat/completions");
        assert_eq!(
            chat_url("http://h:1/v1/chat/completions"),
            "http://h:1/v1/chat/completions"
        );
        let body = serde_json::json!({"model": "m", "messages": [], "stream": true,
            "stream_options": {"include_usage": true}});
        let (off, streamed) = prepared(&body, StreamMode::Off, false);
        let off: Value = serde_json::from_slice(&off).unwrap();
        assert!(off.get("stream").is_none() && off.get("stream_options").is_none());
        assert!(!streamed);
        let (on, streamed) = prepared(&serde_json::json!({"messages": []}), StreamMode::On, false);
        let on: Value = serde_json::from_slice(&on).unwrap();
        assert_eq!(on["stream"], true);
        assert!(streamed);
    }

    #[test]
    fn every_request_can_carry_its_own_user() {
        let body = serde_json::json!({"model": "m", "user": "u1", "messages": []});
        let (prepared, _) = prepared(&body, StreamMode::Recorded, true);
        let sent: Value = serde_json::from_slice(&with_user(&prepared, "r1", 7)).unwrap();
        assert_eq!(sent["user"], "replay-r1-7");
        assert_eq!(sent["model"], "m");
        assert_eq!(sent.as_object().unwrap().len(), 3);
    }
}
