//! The deterministic cache on the request path: look up before the upstream call (a hit is
//! answered as JSON or as a replayed stream, as the client asked), and store a complete, 2xx
//! answer after it (streamed answers are assembled first; a cut stream is never stored).
//! Store errors are misses; an undecodable entry is deleted.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;

use super::SharedState;
use crate::body::{BodyEnd, BodyObserver};
use crate::cache::assemble::{StreamAssembler, replay, sse_body};
use crate::cache::deterministic::{Decision, decide, key};
use crate::openai::sse::event_data;
use crate::openai::{ChatCompletion, ChatCompletionChunk, ChatRequest};

pub const X_CTXPROXY_CACHE: HeaderName = HeaderName::from_static("x-ctxproxy-cache");

/// The largest answer the cache stores.
const MAX_ENTRY_BYTES: usize = 4 * 1024 * 1024;

pub enum Lookup {
    Hit(Response<Body>),
    /// Not in the cache: the answer is stored under the key.
    Miss(String),
    /// `Cache-Control: no-cache`: no lookup, but the fresh answer is stored.
    WriteOnly(String),
    Bypass,
}

fn count(state: &SharedState, result: &str) {
    state
        .metrics
        .cache_requests
        .with_label_values(&["deterministic", result])
        .inc();
}

/// Looks `sent` (the body going upstream) up for `tenant` on upstream `route`. `chat` is the
/// client's request: it says whether to answer as a stream, with usage.
pub async fn look_up(
    state: &SharedState,
    chat: &ChatRequest,
    sent: &Bytes,
    headers: &HeaderMap,
    tenant: &str,
    route: &str,
) -> Lookup {
    let config = &state.config.cache;
    let decision = decide(chat, headers, config);
    if matches!(decision, Decision::Bypass(_)) || !state.store.is_up() {
        count(state, "bypass");
        return Lookup::Bypass;
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(sent) else {
        count(state, "bypass");
        return Lookup::Bypass;
    };
    let key = key(&value, tenant, route, config);
    if decision == Decision::WriteOnly {
        count(state, "bypass");
        return Lookup::WriteOnly(key);
    }
    let started = Instant::now();
    let entry = state.store.get(&key).await;
    state
        .metrics
        .cache_lookup_duration
        .observe(started.elapsed().as_secs_f64());
    let Some(bytes) = entry else {
        count(state, "miss");
        return Lookup::Miss(key);
    };
    let Ok(completion) = serde_json::from_slice::<ChatCompletion>(&bytes) else {
        state.store.delete(&key).await;
        count(state, "error");
        return Lookup::Miss(key);
    };
    count(state, "hit");
    if let Some(usage) = completion.usage.get() {
        let saved = &state.metrics.cache_tokens_saved;
        saved
            .with_label_values(&["prompt"])
            .inc_by(usage.prompt_tokens);
        saved
            .with_label_values(&["completion"])
            .inc_by(usage.completion_tokens);
    }
    Lookup::Hit(answer(&completion, chat))
}

fn answer(completion: &ChatCompletion, chat: &ChatRequest) -> Response<Body> {
    let (content_type, body) = if chat.is_stream() {
        let chunks = replay(completion, chat.include_usage());
        ("text/event-stream", sse_body(&chunks))
    } else {
        (
            "application/json",
            serde_json::to_vec(completion).unwrap_or_default(),
        )
    };
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(X_CTXPROXY_CACHE, HeaderValue::from_static("hit"));
    response
}

/// Collects an answer and stores it under `key` when it ends complete.
pub struct CacheWrite {
    state: SharedState,
    key: String,
    streamed: bool,
    assembler: StreamAssembler,
    done: bool,
    json: Vec<u8>,
    too_large: bool,
}

impl CacheWrite {
    pub fn new(state: SharedState, key: String, streamed: bool) -> CacheWrite {
        CacheWrite {
            state,
            key,
            streamed,
            assembler: StreamAssembler::default(),
            done: false,
            json: Vec::new(),
            too_large: false,
        }
    }
}

impl BodyObserver for CacheWrite {
    fn on_data(&mut self, data: &Bytes) {
        if self.streamed {
            match event_data(data).as_deref() {
                Some("[DONE]") => self.done = true,
                Some(payload) => match serde_json::from_str::<ChatCompletionChunk>(payload) {
                    Ok(chunk) => self.assembler.push(chunk),
                    // An error event or an unknown shape: not a cacheable answer.
                    Err(_) => self.too_large = true,
                },
                None => {}
            }
        } else if self.json.len() + data.len() <= MAX_ENTRY_BYTES {
            self.json.extend_from_slice(data);
        } else {
            self.too_large = true;
        }
    }

    fn on_end(self: Box<Self>, end: BodyEnd) {
        let this = *self;
        if end != BodyEnd::Complete || this.too_large {
            return;
        }
        let completion = if this.streamed {
            if !this.done {
                return;
            }
            this.assembler.finish()
        } else {
            serde_json::from_slice::<ChatCompletion>(&this.json).ok()
        };
        let Some(value) = completion.and_then(|c| serde_json::to_vec(&c).ok()) else {
            return;
        };
        let (state, key) = (this.state, this.key);
        let ttl = Duration::from_secs(state.config.cache.deterministic.ttl_secs);
        tokio::spawn(async move {
            state.store.set(&key, &value, ttl).await;
        });
    }
}
