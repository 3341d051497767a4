//! A JSON answer guarded: read whole, continued while it was cut, checked for a claimed action
//! and retried when asked to. The decisions are `guards::json`'s; this sends and reads.

use axum::body::Body;
use axum::http::{Response, header};
use bytes::Bytes;
use serde_json::Value;

use super::{Flags, GuardCall, read_whole};
use crate::error::ProxyError;
use crate::guards::json::Appended;
use crate::metrics::{ClaimRepair, ContinuationOutcome};
use crate::upstream::UpstreamResponse;

pub(super) async fn guard_json(
    call: &GuardCall,
    answer: UpstreamResponse,
) -> Result<(UpstreamResponse, Flags), ProxyError> {
    let (mut parts, bytes, started) = read_whole(&call.upstream, answer).await?;
    // The answer is in memory: the relay's deadline restarts (continuations took their time).
    let rebuilt = |parts: axum::http::response::Parts, bytes: Bytes| UpstreamResponse {
        response: Response::from_parts(parts, Body::from(bytes)),
        started,
        deadline: tokio::time::Instant::now() + call.upstream.config.total_timeout,
    };
    let Ok(mut completion) = serde_json::from_slice::<Value>(&bytes) else {
        return Ok((rebuilt(parts, bytes), Flags::default()));
    };
    let guards = call.guards();
    let decide = call.decisions();
    let mut changed = false;
    if guards.continuation.enabled && decide.is_cut(&completion) {
        let outcome = continue_json(call, &mut completion).await;
        call.count_continuation(outcome);
        changed = true;
    }
    let mut flags = Flags::default();
    let check = &guards.action_check;
    if check.enabled
        && call.tools_offered
        && let Some(claim) = decide.claim(&completion, &check.patterns)
    {
        flags.claimed_without_tool_call = true;
        if check.retry {
            let body = decide.retry_request(
                &call.sent,
                &claim,
                &check.retry_note,
                call.client_tools.as_ref(),
            );
            let retry = match body {
                Some(body) => call.send_json(body).await,
                None => None,
            };
            match retry.filter(|retry| decide.calls_a_tool(retry)) {
                Some(retry) => {
                    completion = decide.repaired(&completion, retry);
                    changed = true;
                    flags.repaired = true;
                    call.count_claim(ClaimRepair::Repaired);
                }
                None => call.count_claim(ClaimRepair::Failed),
            }
        } else {
            call.count_claim(ClaimRepair::Off);
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
async fn continue_json(call: &GuardCall, completion: &mut Value) -> ContinuationOutcome {
    let config = &call.guards().continuation;
    let decide = call.decisions();
    for _ in 0..config.max_attempts {
        let Some(body) = decide.continuation_request(completion, &call.sent, &config.instruction)
        else {
            return ContinuationOutcome::Error;
        };
        if !call.within_budget(&body) {
            return ContinuationOutcome::Budget;
        }
        let Some(next) = call.send_json(body).await else {
            return ContinuationOutcome::Error;
        };
        match decide.append(completion, &next) {
            Appended::NotText => return ContinuationOutcome::Error,
            Appended::Finished => return ContinuationOutcome::Completed,
            Appended::CutAgain => {}
        }
    }
    ContinuationOutcome::MaxAttempts
}
