//! `POST /v1/chat/completions`: the request flow of DESIGN.md, in order — parse → route →
//! pipeline (rewrite, budget) → upstream → relay. Caches and conversation state plug in here.
//! Also `POST /v1/ctxproxy/explain`: the same rewrite, returned instead of sent.

use std::time::Instant;

use axum::Extension;
use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};

use super::cached::{self, CacheWrite, Lookup, X_CTXPROXY_CACHE};
use super::guarded::{self, Flags, GuardCall, Sent};
use super::meter::{self, ResponseMeter};
use super::prefix_state;
use super::scope;
use super::sticky::{self, StickyUpdate};
use super::{RequestContext, SharedState, read_body};
use crate::bill::{Prompt, cached_of};
use crate::body::{BodyObserver, Observers, TapBody};
use crate::conversation::{client_conversation_id, conversation_id};
use crate::error::ProxyError;
use crate::metrics::ChatLabels;
use crate::openai::ChatRequest;
use crate::pipeline::{self, Mode, OnExceed, Rewrite, tools};
use crate::record::{Exchange, ResponseCapture};
use crate::upstream::{OutgoingBody, Upstream, apply_upstream_auth, end_to_end, is_event_stream};

const X_CTXPROXY_MODE: &str = "x-ctxproxy-mode";
const X_CTXPROXY_BUDGET: &str = "x-ctxproxy-budget";
const X_TOKENS_BEFORE: HeaderName = HeaderName::from_static("x-ctxproxy-tokens-before");
const X_TOKENS_AFTER: HeaderName = HeaderName::from_static("x-ctxproxy-tokens-after");
const X_OVER_BUDGET: HeaderName = HeaderName::from_static("x-ctxproxy-over-budget");
const X_TOKENS_SAVEABLE: HeaderName = HeaderName::from_static("x-ctxproxy-tokens-saveable");

/// The token counts a response reports in its headers: what the client sent and what went
/// upstream (in observe mode the same), and in observe mode what the rewrite would have sent.
#[derive(Debug, Clone, Copy)]
struct TokenCounts {
    before: usize,
    after: usize,
    /// Observe mode: the tokens the rewrite would have sent.
    would_send: Option<usize>,
    /// Tokens over the budget of a request forwarded over its floor.
    over_budget: Option<usize>,
}

impl TokenCounts {
    fn set_headers(counts: Option<TokenCounts>, headers: &mut HeaderMap) {
        let Some(counts) = counts else { return };
        headers.insert(X_TOKENS_BEFORE, HeaderValue::from(counts.before));
        headers.insert(X_TOKENS_AFTER, HeaderValue::from(counts.after));
        if let Some(would_send) = counts.would_send {
            headers.insert(X_TOKENS_SAVEABLE, HeaderValue::from(would_send));
        }
        if let Some(over) = counts.over_budget {
            headers.insert(X_OVER_BUDGET, HeaderValue::from(over));
        }
    }
}

pub async fn chat_completions(
    State(state): State<SharedState>,
    Extension(context): Extension<RequestContext>,
    request: Request,
) -> Response<Body> {
    let received = tokio::time::Instant::now();
    let mut labels = ChatLabels::unknown(context.tenant.as_str());
    let request_id = context.request_id.to_str().unwrap_or_default();
    let mut record = state.recorder.sample(request_id, context.tenant.as_str());
    if let Some(exchange) = &mut record {
        exchange.headers = request.headers().clone();
    }
    let response = serve(
        &state,
        &context,
        request,
        &mut labels,
        &mut record,
        received,
    )
    .await
    .unwrap_or_else(IntoResponse::into_response);
    let cache = response
        .headers()
        .get(X_CTXPROXY_CACHE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none");
    state
        .metrics
        .chat_requests
        .with_label_values(&[
            &labels.model,
            &labels.tenant,
            response.status().as_str(),
            cache,
        ])
        .inc();
    // Answers that did not come from the upstream (errors, cache hits) are recorded here.
    match record {
        Some(mut exchange) => {
            exchange.status = response.status().as_u16();
            exchange.cache = Some(cache.to_owned());
            exchange.streamed = is_event_stream(response.headers());
            let capture = ResponseCapture::new(state.clone(), exchange, received);
            response.map(|body| Body::new(TapBody::new(body, Box::new(capture))))
        }
        None => response,
    }
}

async fn serve(
    state: &SharedState,
    context: &RequestContext,
    request: Request,
    labels: &mut ChatLabels,
    record: &mut Option<Exchange>,
    received: tokio::time::Instant,
) -> Result<Response<Body>, ProxyError> {
    let state = state.clone();
    let (parts, body) = request.into_parts();
    let bytes = read_body(body, &parts.headers, state.config.server.max_body_bytes).await?;
    if let Some(exchange) = record.as_mut() {
        exchange.request = bytes.clone();
    }
    let chat = ChatRequest::parse(&bytes)?;
    labels.model = state.model_labels.label(&chat.model).to_owned();
    let labels = &*labels;
    let upstream = route(&state, &chat.model)?;
    let mode = mode_of(&parts.headers, state.config.pipeline.mode)?;
    // Caches and conversation state are the caller's own (see `scope.rs`).
    let scope = scope::of(&state.config, &context.tenant, &parts);
    let conversation = uses_tool_state(&state, &chat, mode)
        .then(|| conversation_id(&scope, &parts.headers, &chat));
    if let Some(exchange) = record.as_mut() {
        exchange.request_is_json = true;
        exchange.model = Some(chat.model.clone());
        exchange.mode = Some(mode.as_str());
        // The client's own conversation id when it sent one, else the derived one.
        exchange.conversation_id = Some(
            client_conversation_id(&parts.headers)
                .or_else(|| conversation.clone())
                .unwrap_or_else(|| conversation_id(&scope, &parts.headers, &chat)),
        );
    }

    let (body, counts, saving) = match mode {
        Mode::Off => (bytes, None, None),
        Mode::Observe | Mode::Optimize => {
            let sticky = sticky_categories(&state, &chat, conversation.as_deref()).await;
            let thread = conversation_id(&scope, &parts.headers, &chat);
            let remembered = prefix_state::load(&state, &thread).await;
            let started = Instant::now();
            let rewrite = rewrite(&state, &chat, upstream, &parts.headers, &sticky, remembered)?;
            if let Some(prefix) = rewrite.remember.filter(|p| Some(*p) != remembered) {
                prefix_state::save(&state, &thread, prefix);
            }
            let report = &rewrite.report;
            if let Some(exchange) = record.as_mut() {
                exchange.pipeline_ms = Some(started.elapsed().as_secs_f64() * 1e3);
                exchange.report = Some(report.clone());
            }
            let over_budget = state.config.pipeline.budget.enabled && !report.fits;
            if mode == Mode::Optimize {
                if over_budget && state.config.pipeline.budget.on_exceed == OnExceed::Reject {
                    state
                        .metrics
                        .budget_outcomes
                        .with_label_values(&["rejected", &labels.model, &labels.tenant])
                        .inc();
                    return Err(ProxyError::ContextBudgetExceeded {
                        budget: report.budget,
                        tokens_before: report.tokens_before,
                        tokens_after: report.tokens_after,
                    });
                }
                let outcome = if over_budget { "over_floor" } else { "fit" };
                state
                    .metrics
                    .budget_outcomes
                    .with_label_values(&[outcome, &labels.model, &labels.tenant])
                    .inc();
                record_savings(&state, &rewrite, labels);
            } else {
                record_observed(&state, &rewrite, labels);
            }
            let observe = mode == Mode::Observe;
            let counts = TokenCounts {
                before: report.tokens_before,
                // Observe mode sends the original: nothing was saved.
                after: if observe {
                    report.tokens_before
                } else {
                    report.tokens_after
                },
                would_send: observe.then_some(report.tokens_after),
                over_budget: report
                    .over_budget
                    .filter(|_| mode == Mode::Optimize)
                    .map(|over| over.tokens_over),
            };
            match (mode, rewrite.changed()) {
                (Mode::Optimize, true) => {
                    let rewritten = serde_json::to_vec(&rewrite.request)
                        .map_err(|e| ProxyError::Internal(e.to_string()))?;
                    let rewritten = Bytes::from(rewritten);
                    if let Some(exchange) = record.as_mut() {
                        exchange.rewritten = Some(rewritten.clone());
                    }
                    let saving = saving_of(&state, &chat.model, report);
                    (rewritten, Some(counts), saving)
                }
                // Nothing changed, or observe mode: the client's own bytes go upstream.
                _ => (bytes, Some(counts), None),
            }
        }
    };

    let cache = cached::look_up(
        &state,
        &chat,
        &body,
        &parts.headers,
        &scope,
        &upstream.config.name,
        labels,
    )
    .await;
    let (cache_key, cache_label) = match cache {
        Lookup::Hit(mut response) => {
            TokenCounts::set_headers(counts, response.headers_mut());
            return Ok(response);
        }
        Lookup::Miss(key) => (Some(key), "miss"),
        Lookup::WriteOnly(key) => (Some(key), "bypass"),
        Lookup::Bypass => (None, "bypass"),
    };
    let dedup = cached::dedup_plan(&state, &chat, &parts.headers, &scope, labels, upstream).await;
    if let Some(plan) = &dedup
        && let Some(mut response) = cached::dedup_look_up(&state, plan, &chat, labels).await
    {
        TokenCounts::set_headers(counts, response.headers_mut());
        return Ok(response);
    }

    // Usage of every stream, for the token metrics; the client gets it only if it asked.
    let strip_usage = mode != Mode::Off && chat.is_stream() && !chat.include_usage();
    let body = match strip_usage
        .then(|| meter::with_stream_usage(&body))
        .flatten()
    {
        Some(asked) => Bytes::from(asked),
        None => body,
    };

    let mut headers = end_to_end(&parts.headers);
    headers.remove(header::CONTENT_LENGTH);
    // Responses are read by later stages (usage, caches): ask for them uncompressed.
    headers.remove(header::ACCEPT_ENCODING);
    headers.remove(X_CTXPROXY_MODE);
    headers.remove(X_CTXPROXY_BUDGET);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    apply_upstream_auth(&mut headers, &upstream.config, state.config.auth_enabled());

    let suffix = match parts.uri.query() {
        Some(query) => format!("/chat/completions?{query}"),
        None => "/chat/completions".to_owned(),
    };
    let uri = upstream.uri(&suffix)?;
    // The agent guards ask again with what was sent (optimize mode only).
    let guard = (mode == Mode::Optimize)
        .then(|| {
            let sent = Sent {
                uri: &uri,
                headers: &headers,
                body: &body,
            };
            let budget = state.config.pipeline.budget.enabled.then(|| {
                budget_of(&parts.headers, state.config.pipeline.budget.max_tokens)
                    .unwrap_or(state.config.pipeline.budget.max_tokens)
            });
            GuardCall::new(&state, upstream, &chat, sent, budget)
        })
        .flatten();
    let sent = Instant::now();
    let answer = upstream
        .send(
            Method::POST,
            uri,
            headers,
            OutgoingBody::Buffered(body),
            &state.metrics,
        )
        .await?;
    let (answer, guard_flags) = match guard {
        Some(guard) => guarded::guard(guard, answer).await?,
        None => (answer, Flags::default()),
    };
    let mut observers: Vec<Box<dyn BodyObserver>> = Vec::new();
    // Recorded from the upstream's bytes, before the usage event is left out for the client.
    if let Some(mut exchange) = record.take() {
        exchange.upstream_ms = Some(sent.elapsed().as_secs_f64() * 1e3);
        exchange.status = answer.response.status().as_u16();
        exchange.cache = Some(cache_label.to_owned());
        exchange.streamed = is_event_stream(answer.response.headers());
        observers.push(Box::new(ResponseCapture::new(
            state.clone(),
            exchange,
            received,
        )));
    }
    if answer.response.status().is_success() {
        let streamed = is_event_stream(answer.response.headers());
        observers.push(Box::new(
            ResponseMeter::new(
                state.clone(),
                labels.clone(),
                &upstream.config.name,
                streamed,
                received,
            )
            .with_saving(saving),
        ));
        if let Some(conversation) = conversation {
            observers.push(Box::new(StickyUpdate::new(
                state.clone(),
                conversation,
                &chat,
                streamed,
            )));
        }
        if cache_key.is_some() || dedup.is_some() {
            observers.push(Box::new(CacheWrite::new(
                state.clone(),
                cache_key,
                dedup,
                streamed,
            )));
        }
    }
    let observer =
        (!observers.is_empty()).then(|| Box::new(Observers(observers)) as Box<dyn BodyObserver>);
    let drop_usage_event = strip_usage.then_some(meter::is_usage_only_event as fn(&[u8]) -> bool);
    let mut response = upstream.relay(answer, &state.metrics, observer, drop_usage_event);
    guard_flags.apply(response.headers_mut());
    response
        .headers_mut()
        .insert(X_CTXPROXY_CACHE, HeaderValue::from_static(cache_label));
    TokenCounts::set_headers(counts, response.headers_mut());
    Ok(response)
}

/// `POST /v1/ctxproxy/explain`: the rewritten request exactly as it would be sent, with the
/// report of every stage. The upstream is not called.
pub async fn explain(
    State(state): State<SharedState>,
    Extension(context): Extension<RequestContext>,
    request: Request,
) -> Result<Json<Value>, ProxyError> {
    let (parts, body) = request.into_parts();
    let bytes = read_body(body, &parts.headers, state.config.server.max_body_bytes).await?;
    let chat = ChatRequest::parse(&bytes)?;
    let upstream = route(&state, &chat.model)?;
    let scope = scope::of(&state.config, &context.tenant, &parts);
    let conversation = uses_tool_state(&state, &chat, Mode::Optimize)
        .then(|| conversation_id(&scope, &parts.headers, &chat));
    let sticky = sticky_categories(&state, &chat, conversation.as_deref()).await;
    // Explain reads what the store remembers, and writes nothing.
    let thread = conversation_id(&scope, &parts.headers, &chat);
    let remembered = prefix_state::load(&state, &thread).await;
    let rewrite = rewrite(&state, &chat, upstream, &parts.headers, &sticky, remembered)?;
    let sent = if rewrite.changed() {
        serde_json::to_value(&rewrite.request)
    } else {
        serde_json::from_slice(&bytes)
    }
    .map_err(|e| ProxyError::Internal(e.to_string()))?;
    let report = rewrite.report;
    Ok(Json(json!({
        "request": sent,
        "tokens_before": report.tokens_before,
        "tokens_after": report.tokens_after,
        "budget": report.budget,
        "fits": report.fits,
        "over_budget": report.over_budget,
        "prefix": report.prefix,
        "stages": report.stages,
    })))
}

fn route<'a>(state: &'a SharedState, model: &str) -> Result<&'a Upstream, ProxyError> {
    state
        .config
        .upstream_for_model(model)
        .and_then(|index| state.upstreams.get(index))
        .ok_or_else(|| ProxyError::ModelNotRouted {
            model: model.to_owned(),
        })
}

fn mode_of(headers: &HeaderMap, default: Mode) -> Result<Mode, ProxyError> {
    match headers.get(X_CTXPROXY_MODE) {
        None => Ok(default),
        Some(value) => {
            value
                .to_str()
                .ok()
                .and_then(Mode::parse)
                .ok_or_else(|| ProxyError::InvalidHeader {
                    header: "X-Ctxproxy-Mode",
                    message: "expected off, observe or optimize".into(),
                })
        }
    }
}

fn budget_of(headers: &HeaderMap, default: usize) -> Result<usize, ProxyError> {
    match headers.get(X_CTXPROXY_BUDGET) {
        None => Ok(default),
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&b| b > 0)
            .ok_or_else(|| ProxyError::InvalidHeader {
                header: "X-Ctxproxy-Budget",
                message: "expected a positive number of tokens".into(),
            }),
    }
}

/// Whether this request reads and writes the conversation's sticky tool categories.
fn uses_tool_state(state: &SharedState, chat: &ChatRequest, mode: Mode) -> bool {
    mode != Mode::Off
        && state.config.pipeline.tools.enabled
        && chat.tools.get().is_some_and(|t| !t.is_empty())
}

/// The conversation's sticky categories: those stored after its last tool-using turn, plus
/// those of the previous turn in the history the client sent (so a store outage loses
/// nothing for clients that send their whole history).
async fn sticky_categories(
    state: &SharedState,
    chat: &ChatRequest,
    conversation: Option<&str>,
) -> Vec<String> {
    let Some(conversation) = conversation else {
        return Vec::new();
    };
    let mut categories = sticky::load(state, conversation).await;
    categories.extend(tools::previous_turn_categories(
        chat,
        &state.config.pipeline,
        &state.memo,
    ));
    categories.sort();
    categories.dedup();
    categories
}

/// Runs the pipeline, timing it.
fn rewrite(
    state: &SharedState,
    chat: &ChatRequest,
    upstream: &Upstream,
    headers: &HeaderMap,
    sticky_categories: &[String],
    remembered: Option<pipeline::PrefixState>,
) -> Result<Rewrite, ProxyError> {
    let config = &state.config.pipeline;
    let budget = budget_of(headers, config.budget.max_tokens)?;
    let counter = state
        .tokenizers
        .for_model(&chat.model, upstream.config.tokenizer);
    let started = Instant::now();
    let rewrite = pipeline::run(
        chat,
        &pipeline::Env {
            config,
            counter,
            memo: &state.memo,
            budget,
            sticky_categories,
            reinforcement: Some(&upstream.config.guards.reinforcement),
            remembered,
        },
    );
    state
        .metrics
        .pipeline_duration
        .observe(started.elapsed().as_secs_f64());
    Ok(rewrite)
}

/// Observe mode sends the original: prompt tokens count it as sent, and what the pipeline
/// would have saved goes to its own counter.
fn record_observed(state: &SharedState, rewrite: &Rewrite, labels: &ChatLabels) {
    let metrics = &state.metrics;
    let report = &rewrite.report;
    let (model, tenant) = (labels.model.as_str(), labels.tenant.as_str());
    for phase in ["original", "sent"] {
        metrics
            .prompt_tokens
            .with_label_values(&[phase, model, tenant])
            .inc_by(report.tokens_before as u64);
    }
    for (stage, saved) in report.savings_by_stage() {
        metrics
            .tokens_saveable
            .with_label_values(&[stage, model, tenant])
            .inc_by(saved as u64);
    }
}

/// What a rewritten request is priced against when its usage arrives (`meter.rs`): the client's
/// request, cached as far as its previous request reached (the provider's rule), and the tokens
/// sent. `None` for a model without a price.
fn saving_of(
    state: &SharedState,
    model: &str,
    report: &pipeline::PipelineReport,
) -> Option<meter::Saving> {
    let price = state.config.price_of(model)?;
    let previous = report.prefix.as_ref().and_then(|p| p.previous_tokens);
    Some(meter::Saving {
        original: Prompt {
            tokens: report.tokens_before,
            cached: previous.map_or(0, |tokens| cached_of(tokens.min(report.tokens_before))),
        },
        sent_tokens: report.tokens_after,
        price,
    })
}

fn record_savings(state: &SharedState, rewrite: &Rewrite, labels: &ChatLabels) {
    let metrics = &state.metrics;
    let report = &rewrite.report;
    let (model, tenant) = (labels.model.as_str(), labels.tenant.as_str());
    metrics
        .prompt_tokens
        .with_label_values(&["original", model, tenant])
        .inc_by(report.tokens_before as u64);
    metrics
        .prompt_tokens
        .with_label_values(&["sent", model, tenant])
        .inc_by(report.tokens_after as u64);
    for (stage, saved) in report.savings_by_stage() {
        metrics
            .tokens_saved
            .with_label_values(&[stage, model, tenant])
            .inc_by(saved as u64);
    }
    if rewrite.changed()
        && let Some(compact) = report.stages.iter().find(|s| s.stage == "compact")
    {
        for (key, method) in [
            ("cleared", "cleared"),
            ("json_compacted", "json"),
            ("text_compacted", "text"),
        ] {
            if let Some(n) = compact.details.get(key).and_then(Value::as_u64)
                && n > 0
            {
                metrics.compactions.with_label_values(&[method]).inc_by(n);
            }
        }
    }
    if let Some(tools) = report.stages.iter().find(|s| s.stage == "tools") {
        let count = |key: &str| tools.details.get(key).and_then(Value::as_u64);
        if let (Some(offered), Some(sent)) = (count("offered"), count("sent")) {
            metrics
                .tools
                .with_label_values(&["offered"])
                .inc_by(offered);
            // The tools stage's choice stands unless the whole rewrite was dropped.
            let sent = if rewrite.changed() { sent } else { offered };
            metrics.tools.with_label_values(&["sent"]).inc_by(sent);
        }
        if let Some(reason) = tools.details.get("reason").and_then(Value::as_str) {
            metrics
                .tool_filter_decisions
                .with_label_values(&[reason])
                .inc();
        }
    }
}
