//! The agent guards that call the upstream again (see `guards`): an answer cut at the length
//! limit is continued and merged into one answer, JSON or stream; an answer that claims an
//! action without a tool call is counted, flagged and optionally retried. Both sit between the
//! upstream's answer and the relay, so the caches, the usage meter and the recording see the
//! answer the client gets. The decisions are `guards::json` and `guards::stream`; this module
//! only sends the requests they ask for and pumps the bytes.

mod expand;
mod json;
mod pump;
pub mod refusal;
mod stream;

pub use expand::{Conversation, ExpandCall, expand};

use std::sync::Arc;

use axum::body::Body;
use axum::http::Response;
use axum::http::response::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, Uri, header};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::Value;
use tokio::time::Instant;

use super::SharedState;
use crate::error::ProxyError;
use crate::guards::Guards;
use crate::guards::claims::{ACTION_CLAIMED, X_CTXPROXY_REPAIRED, X_CTXPROXY_WARNING};
use crate::guards::decisions::Decisions;
use crate::metrics::{ClaimRepair, ContinuationOutcome};
use crate::openai::{Api, ChatRequest};
use crate::responses;
use crate::tokens::Encoding;
use crate::upstream::{OutgoingBody, Upstream, UpstreamResponse, interrupted, is_event_stream};

/// The largest JSON answer read to guard it; a larger one is relayed unguarded.
const MAX_JSON_BYTES: usize = 16 * 1024 * 1024;

/// What the guards need to ask the upstream again, as the first request was sent: the route
/// and its guards, resolved once.
pub struct GuardCall {
    state: SharedState,
    /// The route's upstream; its config holds the guards.
    upstream: Arc<Upstream>,
    uri: Uri,
    headers: HeaderMap,
    sent: Bytes,
    /// The request's deadline: every re-ask ends by it.
    deadline: Instant,
    /// Its streams were asked for usage.
    usage_asked: bool,
    budget: Option<Budget>,
    tools_offered: bool,
    /// The client's tools, in its API's form, for a retry (only when retries are on).
    client_tools: Option<Value>,
    /// The API the request and its answers speak.
    api: Api,
    /// The upstream keeps the Response (a Responses request without `store: false`).
    stored: bool,
}

/// The request as it was sent upstream, when the whole answer must have arrived, and whether
/// a complete stream of it carries usage.
#[derive(Clone, Copy)]
pub struct Sent<'a> {
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    pub body: &'a Bytes,
    pub deadline: Instant,
    pub usage_asked: bool,
}

/// The request's token budget, and the encoding its continuation requests are counted in.
struct Budget {
    max_tokens: usize,
    encoding: Encoding,
}

/// What the guards did to a JSON answer, for the response headers.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Flags {
    pub claimed_without_tool_call: bool,
    pub repaired: bool,
}

impl Flags {
    pub fn apply(self, headers: &mut HeaderMap) {
        if self.repaired {
            headers.insert(
                X_CTXPROXY_REPAIRED,
                HeaderValue::from_static(ACTION_CLAIMED),
            );
        } else if self.claimed_without_tool_call {
            headers.insert(X_CTXPROXY_WARNING, HeaderValue::from_static(ACTION_CLAIMED));
        }
    }
}

impl GuardCall {
    /// The guards of `upstream` over its answer to `chat`, sent as `sent` (the Responses body
    /// `responses` was read from, when it is one); `budget`: the request's token budget, when
    /// the budget applies to it. `None` when no guard watches the answer (all off, or only the
    /// action check and no tools offered).
    pub fn new(
        state: &SharedState,
        upstream: &Arc<Upstream>,
        chat: &ChatRequest,
        responses: Option<&responses::Converted>,
        sent: Sent<'_>,
        budget: Option<usize>,
    ) -> Option<GuardCall> {
        let guards = &upstream.config.guards;
        let tools = chat.tools.get().filter(|t| !t.is_empty());
        let tools_offered = tools.is_some();
        let check = &guards.action_check;
        let watched = guards.continuation.enabled || (check.enabled && tools_offered);
        if !watched {
            return None;
        }
        let encoding = state
            .tokenizers
            .for_model(&chat.model, upstream.config.tokenizer)
            .encoding();
        Some(GuardCall {
            state: state.clone(),
            upstream: upstream.clone(),
            uri: sent.uri.clone(),
            headers: sent.headers.clone(),
            sent: sent.body.clone(),
            deadline: sent.deadline,
            usage_asked: sent.usage_asked,
            budget: budget.map(|max_tokens| Budget {
                max_tokens,
                encoding,
            }),
            tools_offered,
            client_tools: tools
                .filter(|_| check.enabled && check.retry)
                .and_then(|t| match responses {
                    Some(converted) => converted.client_tools(),
                    None => serde_json::to_value(t).ok(),
                }),
            api: if responses.is_some() {
                Api::Responses
            } else {
                Api::Chat
            },
            stored: responses.is_some_and(responses::Converted::stored),
        })
    }

    fn decisions(&self) -> Decisions {
        Decisions(self.api)
    }

    /// The request the answer being guarded answers, when a re-ask changed it.
    pub fn answers(&mut self, sent: Bytes) {
        self.sent = sent;
    }

    fn guards(&self) -> &Guards {
        &self.upstream.config.guards
    }

    async fn send(&self, body: Vec<u8>) -> Option<UpstreamResponse> {
        let mut headers = self.headers.clone();
        headers.remove(header::CONTENT_LENGTH);
        let answer = self
            .upstream
            .send(
                Method::POST,
                self.uri.clone(),
                headers,
                OutgoingBody::Buffered(Bytes::from(body)),
                &self.state.metrics,
                self.deadline,
            )
            .await
            .ok()?;
        answer.response.status().is_success().then_some(answer)
    }

    async fn send_json(&self, body: Vec<u8>) -> Option<Value> {
        let answer = self.send(body).await?;
        let read = Limited::new(answer.response.into_body(), MAX_JSON_BYTES).collect();
        let bytes = tokio::time::timeout_at(answer.deadline, read)
            .await
            .ok()?
            .ok()?
            .to_bytes();
        serde_json::from_slice(&bytes).ok()
    }

    /// Whether a continuation request stays within the request's budget.
    fn within_budget(&self, body: &[u8]) -> bool {
        let Some(budget) = &self.budget else {
            return true;
        };
        let counter = self.state.tokenizers.for_encoding(budget.encoding);
        let request = match self.api {
            Api::Chat => ChatRequest::parse(body).ok(),
            Api::Responses => responses::parse(body)
                .and_then(responses::to_chat)
                .ok()
                .map(|(chat, _)| chat),
        };
        request.is_some_and(|request| counter.request(&request) <= budget.max_tokens)
    }

    fn count_continuation(&self, outcome: ContinuationOutcome) {
        self.state
            .metrics
            .continuations
            .with_label_values(&[outcome.as_str()])
            .inc();
    }

    fn count_claim(&self, repair: ClaimRepair) {
        self.state
            .metrics
            .action_claims
            .with_label_values(&[repair.as_str()])
            .inc();
    }
}

/// A JSON answer that says it is larger than `MAX_JSON_BYTES`: relayed unread.
fn too_large(answer: &UpstreamResponse) -> bool {
    answer
        .response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        .is_some_and(|len| len > MAX_JSON_BYTES)
}

/// A JSON answer read whole, and its top-level `id` (a Response's); one too large to read is
/// given back as it is, without.
pub async fn read_id(
    upstream: &Upstream,
    answer: UpstreamResponse,
) -> Result<(UpstreamResponse, Option<String>), ProxyError> {
    #[derive(serde::Deserialize)]
    struct Identified {
        id: String,
    }
    let hinted = http_body::Body::size_hint(answer.response.body()).exact();
    if too_large(&answer) || hinted.is_some_and(|len| len > MAX_JSON_BYTES as u64) {
        return Ok((answer, None));
    }
    let deadline = answer.deadline;
    let (parts, bytes, started) = read_whole(upstream, answer).await?;
    let id = serde_json::from_slice::<Identified>(&bytes)
        .ok()
        .map(|i| i.id);
    let answer = UpstreamResponse {
        response: Response::from_parts(parts, Body::from(bytes)),
        started,
        deadline,
    };
    Ok((answer, id))
}

/// Reads a JSON answer whole (at most `MAX_JSON_BYTES`, by its deadline): its parts, its body
/// and when it was asked.
pub(super) async fn read_whole(
    upstream: &Upstream,
    answer: UpstreamResponse,
) -> Result<(Parts, Bytes, Instant), ProxyError> {
    let (started, deadline) = (answer.started, answer.deadline);
    let (parts, body) = answer.response.into_parts();
    let read = Limited::new(body, MAX_JSON_BYTES).collect();
    let bytes = tokio::time::timeout_at(deadline, read)
        .await
        .map_err(|_| upstream.total_timeout())?
        .map_err(|e| {
            let name = &upstream.config.name;
            if e.is::<LengthLimitError>() {
                return ProxyError::UpstreamInvalidResponse {
                    upstream: name.clone(),
                    reason: format!("the answer is larger than {MAX_JSON_BYTES} bytes"),
                };
            }
            // It answered: its body failed midway.
            interrupted(name, &*e)
        })?
        .to_bytes();
    Ok((parts, bytes, started))
}

/// Guards a successful answer: JSON answers are read whole and rewritten when needed; streams
/// are passed through a task that continues them in place.
pub async fn guard(
    call: GuardCall,
    answer: UpstreamResponse,
) -> Result<(UpstreamResponse, Flags), ProxyError> {
    if !answer.response.status().is_success() {
        return Ok((answer, Flags::default()));
    }
    if is_event_stream(answer.response.headers()) {
        return Ok((stream::guard_stream(call, answer), Flags::default()));
    }
    if too_large(&answer) {
        return Ok((answer, Flags::default()));
    }
    json::guard_json(&call, answer).await
}
