//! The bookkeeping of one chat request, from its arrival to its response: metric labels, the
//! recording, token counts, the cache outcome and the guards' flags. [`CallLog::finish`] is the
//! one exit: it sets every `X-Ctxproxy-*` response header, counts the request, and closes the
//! recording of an answer that did not come from the upstream.

use std::time::Instant;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use bytes::Bytes;

use crate::body::TapBody;
use crate::metrics::{CacheOutcome, ChatLabels};
use crate::pipeline::{Mode, PipelineReport};
use crate::record::{Exchange, ResponseCapture};
use crate::server::guarded::Flags;
use crate::server::{RequestContext, SharedState};
use crate::upstream::is_event_stream;

pub const X_CTXPROXY_CACHE: HeaderName = HeaderName::from_static("x-ctxproxy-cache");
const X_TOKENS_BEFORE: HeaderName = HeaderName::from_static("x-ctxproxy-tokens-before");
const X_TOKENS_AFTER: HeaderName = HeaderName::from_static("x-ctxproxy-tokens-after");
const X_OVER_BUDGET: HeaderName = HeaderName::from_static("x-ctxproxy-over-budget");
const X_TOOLS_EXPANDED: HeaderName = HeaderName::from_static("x-ctxproxy-tools-expanded");
const X_RECALLED: HeaderName = HeaderName::from_static("x-ctxproxy-recalled");
const X_TOKENS_SAVEABLE: HeaderName = HeaderName::from_static("x-ctxproxy-tokens-saveable");

/// The token counts a response reports in its headers: what the client sent and what went
/// upstream (in observe mode the same), and in observe mode what the rewrite would have sent.
#[derive(Debug, Clone, Copy)]
pub struct TokenCounts {
    pub before: usize,
    pub after: usize,
    /// Observe mode: the tokens the rewrite would have sent.
    pub would_send: Option<usize>,
    /// Tokens over the budget of a request forwarded over its floor.
    pub over_budget: Option<usize>,
}

impl TokenCounts {
    fn set_headers(self, headers: &mut HeaderMap) {
        headers.insert(X_TOKENS_BEFORE, HeaderValue::from(self.before));
        headers.insert(X_TOKENS_AFTER, HeaderValue::from(self.after));
        if let Some(would_send) = self.would_send {
            headers.insert(X_TOKENS_SAVEABLE, HeaderValue::from(would_send));
        }
        if let Some(over) = self.over_budget {
            headers.insert(X_OVER_BUDGET, HeaderValue::from(over));
        }
    }
}

/// What every phase of a chat request reports.
pub struct CallLog {
    pub labels: ChatLabels,
    /// The exchange being recorded, until an observer of the upstream's answer takes it.
    pub record: Option<Exchange>,
    pub counts: Option<TokenCounts>,
    /// Where the answer came from; `None` before a cache was consulted.
    pub cache: Option<CacheOutcome>,
    pub flags: Flags,
    /// Tools sent as stubs that the answer called, asked again in full.
    pub expanded: Vec<String>,
    /// Handles of results that the answer recalled (`ctxproxy_recall`), answered by the proxy.
    pub recalled: Vec<String>,
    pub received: tokio::time::Instant,
}

impl CallLog {
    pub fn start(state: &SharedState, context: &RequestContext, headers: &HeaderMap) -> CallLog {
        let request_id = context.request_id.to_str().unwrap_or_default();
        let mut record = state.recorder.sample(request_id, context.tenant.as_str());
        if let Some(exchange) = &mut record {
            exchange.headers = headers.clone();
        }
        CallLog {
            labels: ChatLabels::unknown(context.tenant.as_str()),
            record,
            counts: None,
            cache: None,
            flags: Flags::default(),
            expanded: Vec::new(),
            recalled: Vec::new(),
            received: tokio::time::Instant::now(),
        }
    }

    /// The body arrived.
    pub fn read(&mut self, bytes: &Bytes) {
        if let Some(exchange) = &mut self.record {
            exchange.request = bytes.clone();
        }
    }

    /// The body parsed, and was routed: its metric labels, and for the recording its model,
    /// mode and conversation (`conversation_id` is asked only of a recorded exchange).
    pub fn parsed(
        &mut self,
        labels: &ChatLabels,
        model: &str,
        mode: Mode,
        conversation_id: impl FnOnce() -> String,
    ) {
        self.labels = labels.clone();
        if let Some(exchange) = &mut self.record {
            exchange.request_is_json = true;
            exchange.model = Some(model.to_owned());
            exchange.mode = Some(mode.as_str());
            exchange.conversation_id = Some(conversation_id());
        }
    }

    /// The pipeline ran (`started` when its phase began).
    pub fn rewritten(&mut self, report: &PipelineReport, started: Instant) {
        if let Some(exchange) = &mut self.record {
            exchange.pipeline_ms = Some(started.elapsed().as_secs_f64() * 1e3);
            exchange.report = Some(report.clone());
        }
    }

    /// The rewritten body goes upstream.
    pub fn sent_rewritten(&mut self, body: &Bytes) {
        if let Some(exchange) = &mut self.record {
            exchange.rewritten = Some(body.clone());
        }
    }

    /// The exchange to record from the upstream's answer (its observer sees the upstream's
    /// bytes, before the usage event is left out for the client).
    pub fn take_record(&mut self, response: &Response<Body>, sent: Instant) -> Option<Exchange> {
        let mut exchange = self.record.take()?;
        exchange.upstream_ms = Some(sent.elapsed().as_secs_f64() * 1e3);
        exchange.status = response.status().as_u16();
        exchange.cache = Some(self.cache_label().to_owned());
        exchange.streamed = is_event_stream(response.headers());
        Some(exchange)
    }

    fn cache_label(&self) -> &'static str {
        self.cache.unwrap_or(CacheOutcome::None).as_str()
    }

    /// The one exit: the `X-Ctxproxy-*` headers, the request's count, and the recording of an
    /// answer the upstream did not give (an error, a cache hit).
    pub fn finish(self, state: &SharedState, mut response: Response<Body>) -> Response<Body> {
        let headers = response.headers_mut();
        self.flags.apply(headers);
        if !self.expanded.is_empty()
            && let Ok(names) = HeaderValue::from_str(&self.expanded.join(","))
        {
            headers.insert(X_TOOLS_EXPANDED, names);
        }
        if !self.recalled.is_empty()
            && let Ok(handles) = HeaderValue::from_str(&self.recalled.join(","))
        {
            headers.insert(X_RECALLED, handles);
        }
        if let Some(cache) = self.cache {
            headers.insert(X_CTXPROXY_CACHE, HeaderValue::from_static(cache.as_str()));
        }
        if let Some(counts) = self.counts {
            counts.set_headers(headers);
        }
        let cache = self.cache_label();
        // For the request's duration (`middleware`).
        response.extensions_mut().insert(self.labels.clone());
        state
            .metrics
            .chat_requests
            .with_label_values(&[
                &self.labels.model,
                &self.labels.tenant,
                response.status().as_str(),
                cache,
            ])
            .inc();
        match self.record {
            Some(mut exchange) => {
                exchange.status = response.status().as_u16();
                exchange.cache = Some(cache.to_owned());
                exchange.streamed = is_event_stream(response.headers());
                let capture = ResponseCapture::new(state.recorder.clone(), exchange, self.received);
                response.map(|body| Body::new(TapBody::new(body, Box::new(capture))))
            }
            None => response,
        }
    }
}
