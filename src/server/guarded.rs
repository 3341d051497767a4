//! The agent guards that call the upstream again (see `guards`): an answer cut at the length
//! limit is continued and merged into one answer, JSON or stream; an answer that claims an
//! action without a tool call is counted, flagged and optionally retried. Both sit between the
//! upstream's answer and the relay, so the caches, the usage meter and the recording see the
//! answer the client gets.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, Response, Uri, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::SharedState;
use crate::error::ProxyError;
use crate::guards::Guards;
use crate::guards::claims::claimed_action;
use crate::guards::continuation::{
    continuation_body, may_overlap, merge, overlap, retry_body, sum_usage,
};
use crate::openai::ChatRequest;
use crate::openai::sse::{SseSplitter, event_data, event_too_large_event};
use crate::upstream::{OutgoingBody, Upstream, UpstreamResponse, is_event_stream};

/// The largest JSON answer read to guard it; a larger one is relayed unguarded.
const MAX_JSON_BYTES: usize = 16 * 1024 * 1024;
pub const X_CTXPROXY_WARNING: &str = "x-ctxproxy-warning";
pub const X_CTXPROXY_REPAIRED: &str = "x-ctxproxy-repaired";
const ACTION_CLAIMED: &str = "action-claimed-without-tool-call";

/// What the guards need to ask the upstream again, as the first request was sent.
pub struct GuardCall {
    pub state: SharedState,
    pub model: String,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub sent: Bytes,
    /// The request's token budget, when the budget applies to it.
    pub budget: Option<usize>,
    pub tools_offered: bool,
    /// The client's tools, for a retry (only when retries are on).
    pub client_tools: Option<Value>,
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
    fn guards(&self) -> Option<(&Upstream, &Guards)> {
        let upstream = self
            .state
            .config
            .upstream_for_model(&self.model)
            .and_then(|i| self.state.upstreams.get(i))?;
        Some((upstream, &upstream.config.guards))
    }

    /// Whether an answer needs watching at all.
    pub fn active(&self) -> bool {
        self.guards().is_some_and(|(_, g)| {
            g.continuation.enabled || (g.action_check.enabled && self.tools_offered)
        })
    }

    async fn send(&self, body: Vec<u8>) -> Option<UpstreamResponse> {
        let (upstream, _) = self.guards()?;
        let mut headers = self.headers.clone();
        headers.remove(header::CONTENT_LENGTH);
        let answer = upstream
            .send(
                Method::POST,
                self.uri.clone(),
                headers,
                OutgoingBody::Buffered(Bytes::from(body)),
                &self.state.metrics,
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
        let Some(budget) = self.budget else {
            return true;
        };
        let Some((upstream, _)) = self.guards() else {
            return false;
        };
        let counter = self
            .state
            .tokenizers
            .for_model(&self.model, upstream.config.tokenizer);
        ChatRequest::parse(body).is_ok_and(|request| counter.request(&request) <= budget)
    }

    fn count_continuation(&self, outcome: &str) {
        self.state
            .metrics
            .continuations
            .with_label_values(&[outcome])
            .inc();
    }

    fn count_claim(&self, repair: &str) {
        self.state
            .metrics
            .action_claims
            .with_label_values(&[repair])
            .inc();
    }
}

/// Guards a successful answer: JSON answers are read whole and rewritten when needed; streams
/// are passed through a task that continues them in place.
pub async fn guard(
    call: GuardCall,
    answer: UpstreamResponse,
) -> Result<(UpstreamResponse, Flags), ProxyError> {
    if !answer.response.status().is_success() || !call.active() {
        return Ok((answer, Flags::default()));
    }
    if is_event_stream(answer.response.headers()) {
        return Ok((guard_stream(call, answer), Flags::default()));
    }
    let too_large = answer
        .response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        .is_some_and(|len| len > MAX_JSON_BYTES);
    if too_large {
        return Ok((answer, Flags::default()));
    }
    guard_json(&call, answer).await
}

// ---------------------------------------------------------------------------------------------
// JSON answers
// ---------------------------------------------------------------------------------------------

fn only_choice(completion: &Value) -> Option<&Value> {
    match completion.get("choices")?.as_array()?.as_slice() {
        [choice] => Some(choice),
        _ => None,
    }
}

fn has_tool_calls(message: &Value) -> bool {
    message
        .get("tool_calls")
        .and_then(Value::as_array)
        .is_some_and(|calls| !calls.is_empty())
}

/// The text of a single-choice answer without tool calls, and its finish reason.
fn text_answer(completion: &Value) -> Option<(&str, &str)> {
    let choice = only_choice(completion)?;
    let message = choice.get("message").filter(|m| m.is_object())?;
    if has_tool_calls(message) {
        return None;
    }
    let text = message.get("content").and_then(Value::as_str).unwrap_or("");
    let finish = choice.get("finish_reason").and_then(Value::as_str)?;
    Some((text, finish))
}

async fn guard_json(
    call: &GuardCall,
    answer: UpstreamResponse,
) -> Result<(UpstreamResponse, Flags), ProxyError> {
    let UpstreamResponse {
        response,
        started,
        deadline,
    } = answer;
    let (mut parts, body) = response.into_parts();
    let upstream = call
        .guards()
        .map(|(u, _)| u.config.name.clone())
        .unwrap_or_default();
    let read = Limited::new(body, MAX_JSON_BYTES).collect();
    let bytes = tokio::time::timeout_at(deadline, read)
        .await
        .map_err(|_| ProxyError::UpstreamTimeout {
            upstream: upstream.clone(),
            phase: "total",
            timeout_ms: (deadline - started).as_millis(),
        })?
        .map_err(|e| ProxyError::UpstreamUnreachable {
            upstream,
            reason: format!("cannot read the answer: {e}"),
        })?
        .to_bytes();
    // The answer is in memory: the relay's deadline restarts (continuations took their time).
    let total = call
        .guards()
        .map_or(deadline - started, |(u, _)| u.config.total_timeout);
    let rebuilt = |parts: axum::http::response::Parts, bytes: Bytes| UpstreamResponse {
        response: Response::from_parts(parts, Body::from(bytes)),
        started,
        deadline: tokio::time::Instant::now() + total,
    };
    let (Some((_, guards)), Ok(mut completion)) =
        (call.guards(), serde_json::from_slice::<Value>(&bytes))
    else {
        return Ok((rebuilt(parts, bytes), Flags::default()));
    };
    let mut changed = false;
    if guards.continuation.enabled
        && text_answer(&completion).is_some_and(|(_, finish)| finish == "length")
    {
        let outcome = continue_json(call, &mut completion).await;
        call.count_continuation(outcome);
        changed = true;
    }
    let mut flags = Flags::default();
    let check = &guards.action_check;
    if check.enabled
        && call.tools_offered
        && let Some((text, _)) = text_answer(&completion)
        && claimed_action(text, &check.patterns).is_some()
    {
        flags.claimed_without_tool_call = true;
        if check.retry {
            let body = retry_body(
                &call.sent,
                text,
                &check.retry_note,
                call.client_tools.as_ref(),
            );
            let repaired = match body {
                Some(body) => call.send_json(body).await,
                None => None,
            }
            .filter(|retry| {
                only_choice(retry)
                    .and_then(|c| c.get("message"))
                    .is_some_and(has_tool_calls)
            });
            match repaired {
                Some(mut retry) => {
                    if let (Some(first), Some(second)) =
                        (completion.get("usage"), retry.get("usage"))
                    {
                        retry["usage"] = sum_usage(first, second);
                    }
                    completion = retry;
                    changed = true;
                    flags.repaired = true;
                    call.count_claim("repaired");
                }
                None => call.count_claim("failed"),
            }
        } else {
            call.count_claim("off");
        }
    }
    if !changed {
        return Ok((rebuilt(parts, bytes), flags));
    }
    let bytes = serde_json::to_vec(&completion)
        .map(Bytes::from)
        .unwrap_or(bytes);
    parts.headers.remove(header::CONTENT_LENGTH);
    Ok((rebuilt(parts, bytes), flags))
}

/// Asks for the rest of `completion` until it ends by itself, merging each part in; returns the
/// outcome.
async fn continue_json(call: &GuardCall, completion: &mut Value) -> &'static str {
    let Some((_, guards)) = call.guards() else {
        return "error";
    };
    let config = &guards.continuation;
    for _ in 0..config.max_attempts {
        let Some((said, _)) = text_answer(completion) else {
            return "error";
        };
        let said = said.to_owned();
        let Some(body) = continuation_body(&call.sent, &said, &config.instruction) else {
            return "error";
        };
        if !call.within_budget(&body) {
            return "budget";
        }
        let Some(next) = call.send_json(body).await else {
            return "error";
        };
        let Some((text, finish)) = text_answer(&next) else {
            return "error";
        };
        let merged = merge(&said, text);
        let finish = finish.to_owned();
        completion["choices"][0]["message"]["content"] = Value::String(merged);
        completion["choices"][0]["finish_reason"] = Value::String(finish.clone());
        if let (Some(first), Some(second)) = (completion.get("usage"), next.get("usage")) {
            completion["usage"] = sum_usage(first, second);
        }
        if finish != "length" {
            return "completed";
        }
    }
    "max_attempts"
}

// ---------------------------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------------------------

fn guard_stream(call: GuardCall, answer: UpstreamResponse) -> UpstreamResponse {
    let UpstreamResponse {
        response,
        started,
        deadline,
    } = answer;
    let (mut parts, body) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    // Each continuation part has the whole total timeout of its own.
    let parts_allowed = call.guards().map_or(1, |(_, g)| {
        if g.continuation.enabled {
            1 + g.continuation.max_attempts
        } else {
            1
        }
    });
    let deadline = started + (deadline - started) * parts_allowed;
    let (events, receiver) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        StreamGuard::new(call, events).run(body).await;
    });
    let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
        let event = receiver.recv().await?;
        Some((event, receiver))
    });
    UpstreamResponse {
        response: Response::from_parts(parts, Body::from_stream(stream)),
        started,
        deadline,
    }
}

fn event(payload: &Value) -> Bytes {
    Bytes::from(format!("data: {payload}\n\n"))
}

/// Relays the events of one or more streamed parts as one answer.
struct StreamGuard {
    call: GuardCall,
    events: mpsc::Sender<Result<Bytes, std::io::Error>>,
    /// The text said so far, over every part.
    said: String,
    /// `id`, `created`, `model`… of the first chunk: every chunk the client sees carries them.
    head: Option<Value>,
    tool_calls: bool,
    /// More than one choice: relayed as is.
    several_choices: bool,
    usage: Option<Value>,
    done: bool,
}

/// What one part left to do.
enum PartEnd {
    /// Cut at the length limit: the finish chunk, held back.
    Cut(Value),
    /// Ended; `finished`: with a finish reason.
    Ended { finished: bool },
    /// The client is gone, or the upstream body failed (the client was told): stop.
    Stop,
}

impl StreamGuard {
    fn new(call: GuardCall, events: mpsc::Sender<Result<Bytes, std::io::Error>>) -> Self {
        StreamGuard {
            call,
            events,
            said: String::new(),
            head: None,
            tool_calls: false,
            several_choices: false,
            usage: None,
            done: false,
        }
    }

    async fn run(mut self, first: Body) {
        let Some((_, guards)) = self.call.guards() else {
            return;
        };
        let continuation = guards.continuation.clone();
        let check = guards.action_check.clone();
        let mut body = first;
        let mut part = 0;
        // The finish chunk of the last cut part, sent if what follows does not finish.
        let mut last_cut: Option<Value> = None;
        let outcome = loop {
            let end = self.relay_part(body, part, continuation.enabled).await;
            let held = match end {
                PartEnd::Stop => return,
                PartEnd::Ended { finished: true } => break (part > 0).then_some("completed"),
                PartEnd::Ended { finished: false } => match last_cut.take() {
                    // A continuation that ended without a finish: the cut answer stands.
                    Some(held) => {
                        if !self.forward(event(&held)).await {
                            return;
                        }
                        break Some("error");
                    }
                    None => break None,
                },
                PartEnd::Cut(held) => held,
            };
            let next = if part >= continuation.max_attempts {
                Err("max_attempts")
            } else {
                match continuation_body(&self.call.sent, &self.said, &continuation.instruction) {
                    None => Err("error"),
                    Some(request) if !self.call.within_budget(&request) => Err("budget"),
                    Some(request) => match self.call.send(request).await {
                        Some(answer) if is_event_stream(answer.response.headers()) => {
                            Ok(answer.response.into_body())
                        }
                        _ => Err("error"),
                    },
                }
            };
            match next {
                Ok(next) => {
                    body = next;
                    part += 1;
                    last_cut = Some(held);
                }
                Err(outcome) => {
                    // The cut answer ends as the upstream ended it.
                    if !self.forward(event(&held)).await {
                        return;
                    }
                    break Some(outcome);
                }
            }
        };
        if let Some(outcome) = outcome {
            self.call.count_continuation(outcome);
        }
        if check.enabled
            && self.call.tools_offered
            && !self.tool_calls
            && !self.several_choices
            && claimed_action(&self.said, &check.patterns).is_some()
        {
            // Headers are gone: the stream says it as an SSE comment, which clients ignore.
            self.call.count_claim("off");
            let comment = format!(": {X_CTXPROXY_WARNING}: {ACTION_CLAIMED}\n\n");
            if !self.forward(Bytes::from(comment)).await {
                return;
            }
        }
        if let (Some(usage), Some(head)) = (self.usage.take(), &self.head) {
            let mut chunk = head.clone();
            if let Some(object) = chunk.as_object_mut() {
                object.insert("choices".into(), json!([]));
                object.insert("usage".into(), usage);
            }
            if !self.forward(event(&chunk)).await {
                return;
            }
        }
        if self.done {
            self.forward(Bytes::from_static(b"data: [DONE]\n\n")).await;
        }
    }

    async fn forward(&self, bytes: Bytes) -> bool {
        self.events.send(Ok(bytes)).await.is_ok()
    }

    /// Relays one part. Later parts are re-stamped with the first part's head, lose their role
    /// delta, and hold back their start until it is known whether it repeats what was said.
    async fn relay_part(&mut self, mut body: Body, part: u32, continuing: bool) -> PartEnd {
        let upstream = self.call.guards().map(|(upstream, _)| upstream);
        let max_event = upstream.map_or(usize::MAX, |u| u.config.max_event_bytes);
        let mut splitter = SseSplitter::with_max_event(max_event);
        let said_before = self.said.clone();
        // A later part's first text, held while it may repeat the end of `said_before`.
        let mut start = String::new();
        let mut start_chunk: Option<Value> = None;
        let mut decided = part == 0;
        let mut held = None;
        let mut part_finished = false;
        self.done = false;
        loop {
            let frame = tokio::select! {
                frame = body.frame() => frame,
                () = self.events.closed() => return PartEnd::Stop,
            };
            let (events, finished): (Vec<Bytes>, bool) = match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        splitter.push(&data);
                        let mut events = Vec::new();
                        loop {
                            match splitter.next_event() {
                                Ok(Some(event)) => events.push(event),
                                Ok(None) => break,
                                // Cut with an error event, counted like any upstream failure.
                                Err(too_large) => {
                                    if let Some(upstream) = self.call.guards().map(|(u, _)| u) {
                                        self.call
                                            .state
                                            .metrics
                                            .upstream_errors
                                            .with_label_values(&[
                                                upstream.config.name.as_str(),
                                                "event_too_large",
                                            ])
                                            .inc();
                                    }
                                    self.forward(event_too_large_event(too_large)).await;
                                    return PartEnd::Stop;
                                }
                            }
                        }
                        (events, false)
                    }
                    Err(_) => continue,
                },
                // The upstream failed mid-answer: the client's stream fails too.
                Some(Err(e)) => {
                    let _ = self.events.send(Err(std::io::Error::other(e))).await;
                    return PartEnd::Stop;
                }
                None => (splitter.finish().into_iter().collect(), true),
            };
            for raw in events {
                let chunk = match event_data(&raw).as_deref() {
                    Some("[DONE]") => {
                        self.done = true;
                        continue;
                    }
                    Some(payload) => serde_json::from_str::<Value>(payload)
                        .ok()
                        .filter(Value::is_object),
                    None => None,
                };
                // Comments, errors and shapes it does not know go out untouched.
                let Some(mut chunk) = chunk.filter(|c| c.get("choices").is_some()) else {
                    if !self.forward(raw).await {
                        return PartEnd::Stop;
                    }
                    continue;
                };
                let choices = chunk.get("choices").and_then(Value::as_array);
                if choices.is_some_and(Vec::is_empty)
                    && let Some(usage) = chunk.get("usage").filter(|u| u.is_object())
                {
                    self.usage = Some(match &self.usage {
                        Some(sum) => sum_usage(sum, usage),
                        None => usage.clone(),
                    });
                    continue;
                }
                if choices.is_some_and(|c| c.len() > 1)
                    || chunk["choices"][0]["index"].as_u64().unwrap_or(0) > 0
                {
                    self.several_choices = true;
                }
                if self.head.is_none() {
                    let mut head = chunk.clone();
                    if let Some(head) = head.as_object_mut() {
                        head.remove("choices");
                        head.remove("usage");
                    }
                    self.head = Some(head);
                }
                if chunk["choices"][0]["delta"]
                    .get("tool_calls")
                    .is_some_and(|t| !t.is_null())
                {
                    self.tool_calls = true;
                }
                let text = chunk["choices"][0]["delta"]["content"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned();
                let finish = chunk["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_owned);
                if part > 0 {
                    self.restamp(&mut chunk);
                }
                if !decided && text.is_empty() && finish.is_none() {
                    // The role chunk goes; anything else (a tool call delta…) is relayed.
                    if has_delta(&chunk) && !self.forward(event(&chunk)).await {
                        return PartEnd::Stop;
                    }
                    continue;
                }
                if !decided {
                    start.push_str(&text);
                    start_chunk.get_or_insert_with(|| chunk.clone());
                    if finish.is_none() && may_overlap(&said_before, &start) {
                        continue;
                    }
                    decided = true;
                    if !self
                        .release_start(&said_before, &start, start_chunk.take())
                        .await
                    {
                        return PartEnd::Stop;
                    }
                    set_delta(&mut chunk, json!({}));
                } else {
                    self.said.push_str(&text);
                }
                if let Some(finish) = &finish {
                    part_finished = true;
                    if finish == "length" && continuing && !self.tool_calls && !self.several_choices
                    {
                        // Held back; what it carries besides the reason goes now.
                        let mut rest = chunk.clone();
                        set_finish(&mut rest, Value::Null);
                        if has_delta(&rest) && !self.forward(event(&rest)).await {
                            return PartEnd::Stop;
                        }
                        set_delta(&mut chunk, json!({}));
                        held = Some(chunk);
                        continue;
                    }
                }
                if part > 0 && finish.is_none() && !has_delta(&chunk) {
                    continue;
                }
                if !self.forward_chunk(part, &raw, &chunk).await {
                    return PartEnd::Stop;
                }
            }
            if finished {
                break;
            }
        }
        if !decided
            && !start.is_empty()
            && !self
                .release_start(&said_before, &start, start_chunk.take())
                .await
        {
            return PartEnd::Stop;
        }
        match held {
            Some(held) => PartEnd::Cut(held),
            None => PartEnd::Ended {
                finished: part_finished,
            },
        }
    }

    /// Sends the held start of a later part without what repeats the end of `said_before`.
    async fn release_start(
        &mut self,
        said_before: &str,
        start: &str,
        chunk: Option<Value>,
    ) -> bool {
        let kept = &start[overlap(said_before, start)..];
        self.said.push_str(kept);
        match chunk {
            Some(mut chunk) if !kept.is_empty() => {
                set_delta(&mut chunk, json!({"content": kept}));
                set_finish(&mut chunk, Value::Null);
                self.forward(event(&chunk)).await
            }
            _ => true,
        }
    }

    /// The first part's chunks go out as the upstream sent them; later ones re-serialized.
    async fn forward_chunk(&self, part: u32, raw: &Bytes, chunk: &Value) -> bool {
        if part == 0 {
            self.forward(raw.clone()).await
        } else {
            self.forward(event(chunk)).await
        }
    }

    /// A later part's chunk with the first part's id, created and model, and no role delta.
    fn restamp(&self, chunk: &mut Value) {
        if let (Some(head), Some(chunk)) = (
            self.head.as_ref().and_then(Value::as_object),
            chunk.as_object_mut(),
        ) {
            for (key, value) in head {
                if matches!(key.as_str(), "id" | "created" | "model") {
                    chunk.insert(key.clone(), value.clone());
                }
            }
        }
        if let Some(delta) = first_choice(chunk)
            .and_then(|c| c.get_mut("delta"))
            .and_then(Value::as_object_mut)
        {
            delta.remove("role");
            if delta.get("content").and_then(Value::as_str) == Some("") {
                delta.remove("content");
            }
        }
    }
}

/// The first choice of a chunk, when it has one (never panics on other shapes).
fn first_choice(chunk: &mut Value) -> Option<&mut serde_json::Map<String, Value>> {
    chunk
        .get_mut("choices")?
        .as_array_mut()?
        .first_mut()?
        .as_object_mut()
}

fn set_delta(chunk: &mut Value, delta: Value) {
    if let Some(choice) = first_choice(chunk) {
        choice.insert("delta".into(), delta);
    }
}

fn set_finish(chunk: &mut Value, finish: Value) {
    if let Some(choice) = first_choice(chunk) {
        choice.insert("finish_reason".into(), finish);
    }
}

fn has_delta(chunk: &Value) -> bool {
    chunk["choices"][0]["delta"]
        .as_object()
        .is_some_and(|d| d.values().any(|v| !v.is_null()))
}
