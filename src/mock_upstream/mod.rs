//! `ctxproxy mock-upstream`: an OpenAI-compatible fake model for tests, demos and load runs.
//!
//! Answers are deterministic functions of the request ([`reply`]). Request headers steer it:
//! `X-Mock-Status: 503` fails with that status, `X-Mock-Tool-Call: auto|<name>` answers with a
//! tool call (its arguments filled from the tool's schema as received, or from its definition
//! in a definitions message of ctxproxy's: `{}` for a stub without one;
//! `X-Mock-Preamble: <text>` says text before it), `X-Mock-Latency-Ms` overrides the latency, `X-Mock-Echo: 1` adds the received
//! body and headers to a non-streaming answer, `X-Mock-Reply: <text>` sets the text of the
//! answer (continued where an assistant message of the request left it, repeating the last
//! `X-Mock-Overlap` characters), `X-Mock-Reply-Repeat: N` says the answer N times, one stream
//! event each (large answers for load tests). `max_tokens` / `max_completion_tokens` cut a text answer at that
//! many pieces with `finish_reason: "length"`; `X-Mock-Follow-Up-Status: 503` fails only follow-up
//! requests (those ending with an assistant message and then a user or system message, as a
//! continuation or a retry does). `X-Mock-Stream-Fault` and `X-Mock-Invalid-Json` fail an
//! answer after its 200 ([`fault`]). `X-Mock-Recall: first|<handle>` calls `ctxproxy_recall`
//! (with the first handle the messages name, or that one) unless the last message answers it. `X-Mock-System-Messages: reject|drop` imitates chat
//! templates that refuse or drop a system message after the first ([`template`]). `usage.prompt_tokens_details.cached_tokens` is what a
//! provider's prompt cache would serve: the common prefix with the conversation's previous
//! request. It stores nothing; `/mock/stats` exposes counters.
//!
//! `POST /v1/responses` ([`responses`]) is the same model behind OpenAI's Responses API: the
//! body is read as the chat request it amounts to and answered by the same code, steered by the
//! same headers, then written as Response output items (reasoning, message, function calls) in
//! JSON or as the Responses event stream. `GET`/`DELETE /v1/responses/{id}` find nothing.

mod command;
mod embeddings;
mod fault;
mod reply;
mod responses;
mod template;

pub use template::SystemMessages;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};

pub use command::{MockUpstreamArgs, cmd};
pub use reply::{MockToolCall, Reply, reply_for};

use crate::openai::ChatRequest;

#[derive(Debug, Clone, Default)]
pub struct MockOptions {
    /// Delay before the first byte of every answer.
    pub latency: Duration,
    /// Stream pacing; `None` sends every chunk at once.
    pub tokens_per_sec: Option<f64>,
    /// A uniformly random extra delay, from 0 to this, on top of `latency`.
    pub jitter: Duration,
    /// Share of requests (0 to 1) answered with a 500 error, at random.
    pub error_rate: f64,
    /// What the "chat template" does with a system message after the first (a request may
    /// say otherwise with `X-Mock-System-Messages`).
    pub system_messages: SystemMessages,
}

/// A uniform random number in [0, 1) (from the OS's random source, through a v4 UUID).
fn uniform() -> f64 {
    (uuid::Uuid::new_v4().as_u128() >> 75) as f64 / (1_u64 << 53) as f64
}

/// Counters a test can read (in process, or as JSON at `GET /mock/stats`).
#[derive(Debug, Default)]
pub struct MockStats {
    pub requests: AtomicU64,
    pub chat_requests: AtomicU64,
    pub responses_requests: AtomicU64,
    pub embeddings_requests: AtomicU64,
    pub streams_started: AtomicU64,
    pub streams_completed: AtomicU64,
    /// Streams whose client (the proxy) went away before the end.
    pub streams_cancelled: AtomicU64,
    changed: Notify,
}

impl MockStats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::SeqCst)
    }

    /// Waits until `condition` holds (checked after every change).
    pub async fn wait_until(&self, condition: impl Fn(&MockStats) -> bool) {
        loop {
            let changed = self.changed.notified();
            if condition(self) {
                return;
            }
            changed.await;
        }
    }

    fn bump(&self, counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    fn to_json(&self) -> Value {
        json!({
            "requests": Self::get(&self.requests),
            "chat_requests": Self::get(&self.chat_requests),
            "responses_requests": Self::get(&self.responses_requests),
            "streams_started": Self::get(&self.streams_started),
            "streams_completed": Self::get(&self.streams_completed),
            "streams_cancelled": Self::get(&self.streams_cancelled),
        })
    }
}

#[derive(Clone)]
struct MockState {
    options: Arc<MockOptions>,
    stats: Arc<MockStats>,
    /// The last prompt of each conversation, for `cached_tokens`.
    prompts: Arc<std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>>,
}

/// Conversations whose last prompt the mock remembers (then it forgets them all).
const MAX_CONVERSATIONS: usize = 10_000;

impl MockState {
    /// A provider's prompt cache: `prompt`'s common prefix with the previous prompt of the same
    /// `conversation`, at ~4 bytes a token, none under 1,024 tokens, else in steps of 128
    /// (OpenAI's rule), at most `prompt_tokens`.
    fn cached_tokens(&self, conversation: String, prompt: Vec<u8>, prompt_tokens: u64) -> u64 {
        let Ok(mut prompts) = self.prompts.lock() else {
            return 0;
        };
        let shared = prompts.get(&conversation).map_or(0, |previous| {
            previous
                .iter()
                .zip(&prompt)
                .take_while(|(a, b)| a == b)
                .count()
        });
        if prompts.len() >= MAX_CONVERSATIONS {
            prompts.clear();
        }
        prompts.insert(conversation, prompt);
        let tokens = (shared / 4) as u64;
        if tokens < 1024 {
            0
        } else {
            (tokens / 128 * 128).min(prompt_tokens)
        }
    }
}

/// The conversation a request belongs to, for `cached_tokens`: `X-Conversation-Id`, else its
/// first user message.
fn conversation_of(headers: &HeaderMap, request: &ChatRequest) -> String {
    header_str(headers, "x-conversation-id")
        .map(str::to_owned)
        .unwrap_or_else(|| {
            request
                .messages
                .iter()
                .find(|m| m.role == crate::openai::Role::User)
                .and_then(|m| m.content.get())
                .map(|c| c.text().into_owned())
                .unwrap_or_default()
        })
}

pub fn router(options: MockOptions) -> (Router, Arc<MockStats>) {
    let stats = Arc::new(MockStats::default());
    let state = MockState {
        options: Arc::new(options),
        stats: stats.clone(),
        prompts: Arc::default(),
    };
    let router = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::not_found).delete(responses::not_found),
        )
        .route("/v1/responses/{id}/input_items", get(responses::not_found))
        .route("/v1/responses/{id}/cancel", post(responses::not_found))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/mock/stats", get(stats_json))
        // Recorded agent requests reach several MB; a real API takes them.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state);
    (router, stats)
}

/// The largest request body the mock accepts.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Serves the mock until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    options: MockOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let (router, _stats) = router(options);
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

fn error_response(status: StatusCode, message: &str, code: &str) -> Response {
    let body =
        json!({"error": {"message": message, "type": "mock_error", "param": null, "code": code}});
    (status, axum::Json(body)).into_response()
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Applies `X-Mock-Latency-Ms` / the configured latency, then `X-Mock-Status`.
async fn common_prelude(state: &MockState, headers: &HeaderMap) -> Result<(), Response> {
    state.stats.bump(&state.stats.requests);
    let jitter = state.options.jitter.mul_f64(uniform());
    let latency = header_str(headers, "x-mock-latency-ms")
        .and_then(|v| v.parse().ok())
        .map_or(state.options.latency + jitter, Duration::from_millis);
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    if state.options.error_rate > 0.0 && uniform() < state.options.error_rate {
        return Err(error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "mock failure (--error-rate)",
            "mock_random_failure",
        ));
    }
    if let Some(status) = header_str(headers, "x-mock-status").and_then(|v| v.parse::<u16>().ok()) {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if !status.is_success() {
            let message = format!("mock failure with status {}", status.as_u16());
            return Err(error_response(
                status,
                &message,
                &format!("mock_status_{}", status.as_u16()),
            ));
        }
    }
    Ok(())
}

async fn chat_completions(
    State(state): State<MockState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(response) = common_prelude(&state, &headers).await {
        return response;
    }
    state.stats.bump(&state.stats.chat_requests);
    let request: ChatRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string(), "invalid_json"),
    };
    let (request, faults) = match admit(&state, &headers, request) {
        Ok(admitted) => admitted,
        Err(not_answered) => return not_answered.into_response(),
    };
    let mut reply = steered_reply(&request, &body, &headers);
    let prompt = serde_json::to_vec(&(request.tools.get(), &request.messages)).unwrap_or_default();
    reply.cached_tokens = state.cached_tokens(
        conversation_of(&headers, &request),
        prompt,
        reply.prompt_tokens,
    );
    if request.is_stream() {
        let events = stream_events(&reply, request.include_usage());
        return stream_response(&state, events, faults.fault);
    }
    let mut completion = completion_json(&reply);
    if header_str(&headers, "x-mock-echo") == Some("1") {
        completion["mock_echo"] = echo(&body, &headers);
    }
    json_answer(completion, faults.fault)
}

/// What the headers do to a parsed request before it is answered: `X-Mock-Follow-Up-Status`
/// fails it, the chat template (`X-Mock-System-Messages`) refuses it or drops its later system
/// messages, a provider in thinking mode (`X-Mock-Thinking`) refuses a tool call without its
/// reasoning, `X-Mock-Invalid-Json` answers it with a broken body; else the request the model
/// reads and the faults its answer will have.
fn admit(
    state: &MockState,
    headers: &HeaderMap,
    request: ChatRequest,
) -> Result<(ChatRequest, fault::Faults), NotAnswered> {
    if let Some(status) = header_str(headers, "x-mock-follow-up-status")
        .and_then(|v| v.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        && is_follow_up(&request)
    {
        return Err(NotAnswered::FollowUp(status));
    }
    let template = SystemMessages::from_header(
        header_str(headers, "x-mock-system-messages"),
        state.options.system_messages,
    );
    let request = template.render(request).map_err(NotAnswered::Refused)?;
    if header_str(headers, "x-mock-thinking") == Some("1") && template::lacks_reasoning(&request) {
        return Err(NotAnswered::Refused(template::REASONING_MISSING));
    }
    let faults = fault::Faults::of(headers, &request);
    if faults.invalid_json {
        return Err(NotAnswered::InvalidJson);
    }
    Ok((request, faults))
}

/// Why [`admit`] gives no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NotAnswered {
    /// `X-Mock-Follow-Up-Status` on a follow-up request.
    FollowUp(StatusCode),
    /// The chat template's refusal.
    Refused(&'static str),
    /// `X-Mock-Invalid-Json`.
    InvalidJson,
}

impl IntoResponse for NotAnswered {
    fn into_response(self) -> Response {
        match self {
            NotAnswered::FollowUp(status) => error_response(
                status,
                "mock failure of a follow-up request",
                "mock_follow_up",
            ),
            NotAnswered::Refused(refusal) => {
                error_response(StatusCode::BAD_REQUEST, refusal, "BadRequestError")
            }
            NotAnswered::InvalidJson => fault::invalid_json(),
        }
    }
}

/// The answer to `request` as the headers steer it (`X-Mock-Tool-Call`, `-Reply`, `-Overlap`,
/// `-Recall`, `-Preamble`, `-Reply-Repeat`), cut at the request's output limit.
fn steered_reply(request: &ChatRequest, body: &[u8], headers: &HeaderMap) -> Reply {
    let mut reply = reply_for(request, body, header_str(headers, "x-mock-tool-call"));
    if let Some(text) = header_str(headers, "x-mock-reply") {
        let overlap = header_str(headers, "x-mock-overlap")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        reply = reply::scripted(reply, request, text, overlap);
    }
    if let Some(wanted) = header_str(headers, "x-mock-recall") {
        reply = reply::recalling(reply, request, wanted);
    }
    if let Some(text) = header_str(headers, "x-mock-preamble") {
        reply = reply::with_preamble(reply, text);
    }
    if let Some(times) = header_str(headers, "x-mock-reply-repeat").and_then(|v| v.parse().ok()) {
        reply = reply::repeated(reply, times);
    }
    reply::limited(reply, request)
}

/// `X-Mock-Echo: 1`: the body and headers the mock received.
fn echo(body: &[u8], headers: &HeaderMap) -> Value {
    let received: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let echoed_headers: serde_json::Map<String, Value> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v.to_str().unwrap_or(""))))
        .collect();
    json!({"body": received, "headers": echoed_headers})
}

/// A JSON answer, failing after its first half when a fault is asked for.
fn json_answer(answer: Value, fault: Option<fault::Fault>) -> Response {
    match fault {
        Some(fault) => fault::failing_json(answer.to_string().into_bytes(), fault),
        None => axum::Json(answer).into_response(),
    }
}

/// A tool call's arguments as a model streams them: 8 characters at a time.
fn argument_chunks(arguments: &str) -> Vec<String> {
    let chars: Vec<char> = arguments.chars().collect();
    chars.chunks(8).map(|part| part.iter().collect()).collect()
}

/// A request that follows up an answer: an assistant message, then a user or system message.
fn is_follow_up(request: &ChatRequest) -> bool {
    use crate::openai::Role;
    matches!(request.messages.as_slice(), [.., answer, next]
        if answer.role == Role::Assistant && matches!(next.role, Role::User | Role::System))
}

fn completion_json(reply: &Reply) -> Value {
    let mut message = json!({"role": "assistant", "content": reply.content()});
    if !reply.tool_calls.is_empty() {
        if reply.pieces.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = reply
            .tool_calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
    }
    json!({
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": reply.finish_reason()}],
        "usage": reply.usage(),
        "system_fingerprint": "fp_mock",
    })
}

/// The SSE events of a reply, `data: [DONE]` included.
fn stream_events(reply: &Reply, include_usage: bool) -> Vec<String> {
    let chunk = |delta: Value, finish: Value| {
        json!({
            "id": reply.id, "object": "chat.completion.chunk", "created": reply.created,
            "model": reply.model, "system_fingerprint": "fp_mock",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        })
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    for piece in &reply.pieces {
        events.push(chunk(json!({"content": piece}), Value::Null));
    }
    for (index, call) in reply.tool_calls.iter().enumerate() {
        events.push(chunk(
            json!({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                   "function": {"name": call.name, "arguments": ""}}]}),
            Value::Null,
        ));
        for text in argument_chunks(&call.arguments) {
            events.push(chunk(
                json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]}),
                Value::Null,
            ));
        }
    }
    events.push(chunk(json!({}), json!(reply.finish_reason())));
    let mut lines: Vec<String> = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    if include_usage {
        let usage = json!({
            "id": reply.id, "object": "chat.completion.chunk", "created": reply.created,
            "model": reply.model, "system_fingerprint": "fp_mock", "choices": [], "usage": reply.usage(),
        });
        lines.push(format!("data: {usage}\n\n"));
    }
    lines.push("data: [DONE]\n\n".to_owned());
    lines
}

/// `events` as a `text/event-stream` body, paced by `--tokens-per-sec`, failing as `fault` says.
fn stream_response(
    state: &MockState,
    events: Vec<String>,
    fault: Option<fault::Fault>,
) -> Response {
    let pause = state
        .options
        .tokens_per_sec
        .filter(|tps| *tps > 0.0)
        .map(|tps| Duration::from_secs_f64(1.0 / tps));
    let stats = state.stats.clone();
    stats.bump(&stats.streams_started);
    let (tx, rx) = mpsc::channel::<Bytes>(1);
    let sender_stats = stats.clone();
    tokio::spawn(async move {
        for (i, event) in events.into_iter().enumerate() {
            if let (true, Some(pause)) = (i > 0, pause) {
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = tx.closed() => {
                        sender_stats.bump(&sender_stats.streams_cancelled);
                        return;
                    }
                }
            }
            if tx.send(Bytes::from(event)).await.is_err() {
                sender_stats.bump(&sender_stats.streams_cancelled);
                return;
            }
        }
    });
    // The sender only stops early when the receiver is gone, so a stream that sees the channel
    // end has delivered every event.
    let stream = futures_util::stream::unfold(rx, move |mut rx| {
        let stats = stats.clone();
        async move {
            match rx.recv().await {
                Some(bytes) => Some((Ok::<_, Infallible>(bytes), rx)),
                None => {
                    stats.bump(&stats.streams_completed);
                    None
                }
            }
        }
    });
    let body = match fault {
        Some(fault) => fault::failing(Box::pin(stream), fault),
        None => Body::from_stream(stream),
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

const MODELS: &[&str] = &[
    "gpt-4o",
    "gpt-4o-mini",
    "gpt-4.1",
    "o3-mini",
    "mock-embedding",
];

fn model_json(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 1_700_000_000, "owned_by": "ctxproxy-mock"})
}

async fn models(State(state): State<MockState>, headers: HeaderMap) -> Response {
    if let Err(response) = common_prelude(&state, &headers).await {
        return response;
    }
    let data: Vec<Value> = MODELS.iter().map(|id| model_json(id)).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn model(
    State(state): State<MockState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(response) = common_prelude(&state, &headers).await {
        return response;
    }
    axum::Json(model_json(&id)).into_response()
}

async fn stats_json(State(state): State<MockState>) -> Response {
    axum::Json(state.stats.to_json()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_events_rebuild_the_reply() {
        let request: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi [mock:tool_call]"}],
            "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {
                "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
        }))
        .unwrap();
        let reply = reply_for(&request, b"x", None);
        let events = stream_events(&reply, true);
        assert_eq!(events.last().unwrap(), "data: [DONE]\n\n");
        let mut arguments = String::new();
        for event in &events[..events.len() - 1] {
            let chunk: Value =
                serde_json::from_str(event.trim_start_matches("data: ").trim()).unwrap();
            if let Some(args) = chunk.pointer("/choices/0/delta/tool_calls/0/function/arguments") {
                arguments.push_str(args.as_str().unwrap());
            }
        }
        assert_eq!(arguments, reply.tool_calls[0].arguments);
    }
}
