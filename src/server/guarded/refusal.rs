//! Upstreams that refuse the tool definitions a request places in its messages: a chat template
//! that refuses a system message in mid-conversation (vLLM's "Only user and assistant roles are
//! supported…" for Mistral's templates), or a provider that refuses an assistant tool call it
//! did not write (one that wants the call's reasoning or signature back: DeepSeek, Kimi or
//! Gemini thinking). Such a 400 is asked again with those tools in the block, and once that
//! works, the upstream's later requests define tools in the block.

use axum::body::Body;
use axum::http::{Response, StatusCode};

use super::read_whole;
use crate::error::ProxyError;
use crate::server::SharedState;
use crate::server::learned::{self, Lesson};
use crate::upstream::{Upstream, UpstreamResponse};

/// What a 400 said.
pub enum Answered {
    /// The upstream refused the definitions in the messages.
    RefusedDefinitions,
    /// Anything else: the answer, as it came.
    Other(UpstreamResponse),
}

/// Reads a 400 answer to a request that defines tools in its messages. Definitions given as
/// calls' results (`as_results`) are taken as refused by any 400: what a provider says of a
/// call it did not write varies, and asking again in the block costs one request where the
/// error was another. A definitions system message is refused only by a template's role check;
/// any other error (a context too long, an invalid parameter) is the client's answer, never
/// asked again.
pub async fn read(
    upstream: &Upstream,
    answer: UpstreamResponse,
    as_results: bool,
) -> Result<Answered, ProxyError> {
    if answer.response.status() != StatusCode::BAD_REQUEST {
        return Ok(Answered::Other(answer));
    }
    if as_results {
        return Ok(Answered::RefusedDefinitions);
    }
    let deadline = answer.deadline;
    let (parts, bytes, started) = read_whole(upstream, answer).await?;
    if refuses_system_messages(&bytes) {
        return Ok(Answered::RefusedDefinitions);
    }
    Ok(Answered::Other(UpstreamResponse {
        response: Response::from_parts(parts, Body::from(bytes)),
        started,
        deadline,
    }))
}

/// Whether an error body is a chat template's role check: "Only user and assistant roles are
/// supported…" (vLLM), "Conversation roles must alternate user/assistant…", "System role not
/// supported".
fn refuses_system_messages(body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(body).to_lowercase();
    text.contains("role")
        && ["system", "alternate", "only user and assistant"]
            .iter()
            .any(|said| text.contains(said))
}

/// Counts a request asked again with its definitions in the block; when that answer is a
/// success, the upstream defines tools in the block from now on (logged once, shared with the
/// other replicas: `server::learned`).
pub fn asked_in_block(state: &SharedState, upstream: &Upstream, succeeded: bool) {
    let name = &upstream.config.name;
    state
        .metrics
        .tool_definitions_refused
        .with_label_values(&[name.as_str()])
        .inc();
    if succeeded {
        learned::learn(state, upstream, Lesson::Refuses);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_refusals_are_told_from_other_errors() {
        for refusal in [
            r#"{"object":"error","message":"Only user and assistant roles are supported, with the exception of an initial optional system message!","type":"BadRequestError","code":400}"#,
            r#"{"error":{"message":"Conversation roles must alternate user/assistant/user/assistant/..."}}"#,
            r#"{"error":"System role not supported"}"#,
        ] {
            assert!(refuses_system_messages(refusal.as_bytes()), "{refusal}");
        }
        for other in [
            r#"{"error":{"message":"This model's maximum context length is 128000 tokens.","code":"context_length_exceeded"}}"#,
            r#"{"error":{"message":"Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'."}}"#,
        ] {
            assert!(!refuses_system_messages(other.as_bytes()), "{other}");
        }
    }
}
