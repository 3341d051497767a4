//! `POST /v1/chat/completions`, `POST /v1/responses` and `POST /v1/ctxproxy/explain`. A chat request goes through its
//! phases in order (ARCHITECTURE.md): read and parse, rewrite, look up the caches, send (with
//! the guards), relay (with the observers), and every exit, error or not, goes through
//! [`CallLog::finish`]. Explain runs the first two and returns the rewrite instead.

mod call;
mod call_log;
mod send;

use axum::Extension;
use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{RequestContext, SharedState};
use crate::error::ProxyError;
use crate::responses;
use call::{ChatCall, Entry};
use call_log::CallLog;
use send::Looked;

pub async fn chat_completions(
    State(state): State<SharedState>,
    Extension(context): Extension<RequestContext>,
    request: Request,
) -> Response<Body> {
    // Boxed: the call's state is large, and each layer above moves its handler's future.
    Box::pin(answer(&state, &context, request, Entry::Chat)).await
}

/// `POST /v1/responses`: the same phases, the body read as a chat request and the rewrite
/// written back as a Responses body (`crate::responses`).
pub async fn responses(
    State(state): State<SharedState>,
    Extension(context): Extension<RequestContext>,
    request: Request,
) -> Response<Body> {
    Box::pin(answer(&state, &context, request, Entry::Responses)).await
}

/// The response to a request of `entry`, through its one exit ([`CallLog::finish`]).
async fn answer(
    state: &SharedState,
    context: &RequestContext,
    request: Request,
    entry: Entry,
) -> Response<Body> {
    let mut log = CallLog::start(state, context, request.headers());
    let response = serve(state, context, request, entry, &mut log)
        .await
        .unwrap_or_else(IntoResponse::into_response);
    log.finish(state, response)
}

async fn serve(
    state: &SharedState,
    context: &RequestContext,
    request: Request,
    entry: Entry,
    log: &mut CallLog,
) -> Result<Response<Body>, ProxyError> {
    let (parts, bytes) = call::read(state, request).await?;
    log.read(&bytes);
    let call = ChatCall::parse(state, context, parts, bytes, entry)?;
    call.log_parsed(log);
    let outgoing = call.rewrite(log).await?;
    let keys = match call.look_up(&outgoing, log).await {
        Looked::Served(response) => return Ok(response),
        Looked::Miss(keys) => keys,
    };
    let answer = call.send(outgoing, log).await?;
    Ok(call.relay(answer, keys, log))
}

/// `POST /v1/ctxproxy/explain`: the rewritten request exactly as it would be sent, with the
/// report of every stage. The upstream is not called, and the store is only read.
pub async fn explain(
    State(state): State<SharedState>,
    Extension(context): Extension<RequestContext>,
    request: Request,
) -> Result<Json<Value>, ProxyError> {
    let (parts, bytes) = call::read(&state, request).await?;
    let call = ChatCall::parse(&state, &context, parts, bytes, Entry::Explain)?;
    if let Some(converted) = call.responses.as_deref()
        && !converted.rewritable()
    {
        return Ok(Json(passed_through(&call)?));
    }
    let rewrite = call.run_pipeline().await?.rewrite;
    let sent = match &call.responses {
        Some(converted) if rewrite.changed() => Ok(Value::Object(responses::from_chat(
            converted,
            &rewrite.request,
        ))),
        None if rewrite.changed() => serde_json::to_value(&rewrite.request),
        _ => serde_json::from_slice(&call.bytes),
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

/// Explain's answer for a Responses body the pipeline leaves as it is (see
/// [`responses::Converted::rewritable`]): the body, and its tokens before and after.
fn passed_through(call: &ChatCall<'_>) -> Result<Value, ProxyError> {
    let sent: Value =
        serde_json::from_slice(&call.bytes).map_err(|e| ProxyError::Internal(e.to_string()))?;
    let counter = call
        .state
        .tokenizers
        .for_model(&call.chat.model, call.upstream.config.tokenizer);
    let tokens = counter.request(&call.chat);
    Ok(json!({
        "request": sent,
        "tokens_before": tokens,
        "tokens_after": tokens,
        "budget": call.budget(),
        "fits": call.budget().is_none_or(|budget| tokens <= budget),
        "over_budget": null,
        "prefix": null,
        "stages": [],
    }))
}
