//! Transparent expansion: when the upstream's answer calls a tool that went as a stub without a
//! definition, the request is asked again with that tool defined (`inline::reask`: in a message
//! appended last, or in full in the block when strict), and the client gets only the new answer
//! (JSON) or the new answer's calls spliced into the same stream. A call of a tool defined only
//! in the messages whose arguments fail the client's schema (`guards::arguments`: the template
//! dropped the definition) is asked again the same way, with the definitions in the block; the
//! upstream then defines tools in the block (`server::learned`). The decisions are
//! `guards::expand`'s; this sends, reads and counts.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::response::Parts;
use axum::http::{HeaderMap, Method, Response, StatusCode, Uri, header};
use bytes::Bytes;
use serde_json::Value;

use super::pump::{Events, PartRewriter, channel_body, forward, forward_all, pump};
use super::refusal::{self, Answered};
use super::{Sent, read_whole, too_large};
use crate::error::ProxyError;
use crate::guards::arguments::{ArgumentCheck, Failed};
use crate::guards::expand::{EXPANDED_COMMENT, ExpandStream, PartEnd, called_stubs, with_usage_of};
use crate::guards::responses_expand::ResponsesExpandStream;
use crate::metrics::{ChatLabels, ExpansionOutcome, RecallOutcome};
use crate::openai::{ChatRequest, Nullable, Tool, ToolCall};
use crate::pipeline::config::Definitions;
use crate::pipeline::recall::{self, Mark};
use crate::pipeline::tools::inline::{self, defined_in, reask, stubs_of};
use crate::pipeline::tools::stubs::promote;
use crate::responses;
use crate::server::learned::{self, Lesson};
use crate::server::meter;
use crate::server::{SharedState, recall_marks};
use crate::upstream::{OutgoingBody, Upstream, UpstreamResponse, is_event_stream};

/// What an expansion needs: the request as sent (with its stubs), the client's tools, and
/// where to ask again.
pub struct ExpandCall {
    state: SharedState,
    upstream: Arc<Upstream>,
    uri: Uri,
    headers: HeaderMap,
    /// The request's deadline: every re-ask ends by it.
    deadline: tokio::time::Instant,
    /// Its streams were asked for usage.
    usage_asked: bool,
    request: ChatRequest,
    /// The client's request: its tools are what a re-ask defines in full.
    client: Arc<ChatRequest>,
    /// The tools `request` offers as stubs.
    stubs: Vec<String>,
    /// The tools `request` defines only in its messages, or that its chain's history upstream
    /// defines (`upstream_defined`): their calls' arguments are checked.
    defined: Vec<String>,
    /// Of a chained Responses request, the stubs whose definitions its chain's history holds.
    upstream_defined: Vec<String>,
    /// The checks of those arguments (a stream's rewriter holds them while it relays).
    arguments: ArgumentCheck,
    /// This request's re-asks define tools in the block: its upstream refused a definitions
    /// message, or a call failed its schema.
    in_block: bool,
    /// A call failed its schema the way a model that never read the definition calls it: the
    /// answer to the re-ask that put it in the block teaches the upstream (`Lesson::Drops`).
    unread: bool,
    /// A re-ask was for arguments that failed their schema (the metric's outcome).
    invalid_arguments: bool,
    /// The request offers `ctxproxy_recall`: the originals its handles name.
    recall: Option<Recall>,
    /// The handles recalled so far.
    recalled: Vec<String>,
    /// Re-asks so far.
    rounds: u32,
    /// The last re-ask allowed sent every tool in full.
    all_full: bool,
    /// The stream's usage was asked for on the client's behalf.
    stream_usage: bool,
    labels: ChatLabels,
    /// A Responses API request: its re-asks are written back as Responses bodies, and its
    /// answers read as Responses.
    responses: Option<Arc<responses::Converted>>,
}

/// What the proxy answers `ctxproxy_recall` with: the originals of the rewrite's handles, read
/// from the client's own request when recalled (`pipeline::recall`).
struct Recall {
    /// The handles the rewrite names.
    named: Vec<String>,
    rounds: u32,
    /// The conversation whose marks a recall adds to, its marks so far, and how many messages
    /// the client sent (where the pair goes).
    conversation: Option<String>,
    marks: Vec<Mark>,
    client_messages: usize,
    /// The digest of the client's messages (`recall::history_digest`), for its marks.
    client_history: u64,
}

/// Where a conversation's recalls go: its id (when it has one) and its recalls so far.
pub struct Conversation {
    pub id: Option<String>,
    pub recalls: Vec<Mark>,
}

/// Recall rounds at most in one answer; the last takes the tool out of the request, so the
/// next answer cannot call it again.
const MAX_RECALL_ROUNDS: u32 = 3;

/// The answer the client gets, and what it took.
pub struct Expanded {
    pub answer: UpstreamResponse,
    /// The stubs the answers called, asked again with their definitions (for a stream, known
    /// only as it ends: it says them in an SSE comment).
    pub expanded: Vec<String>,
    /// The request the final answer answers: what the guards ask again with.
    pub sent: Bytes,
    /// The handles recalled (JSON answers; a stream's are counted in the metrics only).
    pub recalled: Vec<String>,
    /// The `usage` of a JSON answer as the client gets it, read here already (the meter then
    /// need not read the answer again).
    pub usage: Option<Value>,
    /// The tools of the request a JSON answer answers (`None` for a stream or an error).
    pub tools: Option<Vec<Tool>>,
    /// The tools that request defines in its messages.
    pub defined: Vec<String>,
}

/// The tools the client offered (none when it offered none).
fn tools_of(client: &ChatRequest) -> &[Tool] {
    client.tools.get().map_or(&[], Vec::as_slice)
}

impl ExpandCall {
    /// `request`: the rewrite sent as `sent` (with `stream_usage`: its stream asked for usage on
    /// the client's behalf). `None` when it offers no stub.
    pub fn new(
        state: &SharedState,
        upstream: &Arc<Upstream>,
        client: &Arc<ChatRequest>,
        (request, stream_usage): (ChatRequest, bool),
        sent: Sent<'_>,
        labels: &ChatLabels,
        conversation: Conversation,
    ) -> Option<ExpandCall> {
        let client_tools = client.tools.get()?;
        let tools = request.tools.get()?;
        let inline::Stubs {
            undefined: stubs,
            defined,
        } = stubs_of(tools, &request.messages, client_tools);
        let recall = recall::offered(tools).then(|| Recall {
            named: recall::named_handles(&request.messages),
            rounds: 0,
            conversation: conversation.id,
            marks: conversation.recalls,
            client_messages: client.messages.len(),
            client_history: recall::history_digest(&client.messages),
        });
        if stubs.is_empty() && defined.is_empty() && recall.is_none() {
            return None;
        }
        Some(ExpandCall {
            state: state.clone(),
            upstream: upstream.clone(),
            uri: sent.uri.clone(),
            headers: sent.headers.clone(),
            deadline: sent.deadline,
            usage_asked: sent.usage_asked,
            request,
            client: client.clone(),
            stubs,
            defined,
            upstream_defined: Vec::new(),
            arguments: ArgumentCheck::default(),
            in_block: false,
            unread: false,
            invalid_arguments: false,
            recall,
            recalled: Vec::new(),
            rounds: 0,
            all_full: false,
            stream_usage,
            labels: labels.clone(),
            responses: None,
        })
    }

    /// A chained request whose chain's history defines the tools `names`: a call of one of
    /// them is checked, not asked again.
    pub fn defined_upstream(mut self, names: Vec<String>) -> ExpandCall {
        self.upstream_defined = names;
        self.watch();
        self
    }

    /// Re-asks written as the Responses body `converted` was read from (`None`: chat).
    pub fn written_as(mut self, converted: Option<Arc<responses::Converted>>) -> ExpandCall {
        self.responses = converted;
        self
    }

    /// An answer as chat reads it: a Responses answer's function calls as a chat completion's
    /// (`responses::answer_as_chat`).
    fn as_chat<'v>(&self, answer: &'v Value) -> std::borrow::Cow<'v, Value> {
        match &self.responses {
            Some(_) => std::borrow::Cow::Owned(responses::answer_as_chat(answer)),
            None => std::borrow::Cow::Borrowed(answer),
        }
    }

    /// `request` as the upstream is sent it: chat, or the Responses body it rewrites.
    fn serialized(&self, request: &ChatRequest) -> Result<Vec<u8>, serde_json::Error> {
        match &self.responses {
            Some(converted) => responses::write(converted, request),
            None => serde_json::to_vec(request),
        }
    }

    /// The names whose calls the answer is watched for: the stubs, and `ctxproxy_recall`.
    fn watched(&self) -> Vec<String> {
        let mut names = self.stubs.clone();
        if self.recall.is_some() {
            names.push(recall::TOOL_NAME.to_owned());
        }
        names
    }

    /// The request to ask again with, for an answer that called `called`: with the recall
    /// calls (`recalls`) answered when it called `ctxproxy_recall`, else with the stubs'
    /// definitions.
    fn re_ask(&mut self, called: &[String], recalls: Vec<ToolCall>) -> Result<Bytes, ProxyError> {
        if called.iter().any(|c| c == recall::TOOL_NAME) {
            self.answer_recalls(recalls)
        } else {
            self.define(called)
        }
    }

    /// The request with the recall calls and the originals they asked for appended; the last
    /// round allowed (or calls that could not be read) takes the tool out of the request.
    fn answer_recalls(&mut self, calls: Vec<ToolCall>) -> Result<Bytes, ProxyError> {
        let Some(recall) = self.recall.as_mut() else {
            return Err(ProxyError::Internal(
                "a recall without the tool offered".into(),
            ));
        };
        recall.rounds += 1;
        let (named, client) = (&recall.named, &self.client.messages);
        let find = |h: &str| {
            named
                .iter()
                .any(|handle| handle == h)
                .then(|| recall::original(client, h))
                .flatten()
        };
        let answered = recall::answer(calls, find);
        let metrics = &self.state.metrics;
        let (model, tenant) = (self.labels.model.as_str(), self.labels.tenant.as_str());
        for r in &answered {
            let outcome = if r.found {
                RecallOutcome::Found
            } else {
                RecallOutcome::Unknown
            };
            metrics
                .tool_recalls
                .with_label_values(&[model, tenant, outcome.as_str()])
                .inc();
        }
        self.recalled
            .extend(answered.iter().filter_map(|r| r.handle.clone()));
        let last = answered.is_empty() || recall.rounds >= MAX_RECALL_ROUNDS;
        if !answered.is_empty() {
            self.request = recall::appended(&self.request, &answered);
            // The conversation's next requests keep the pair here.
            recall.marks.push(Mark::of(
                recall.client_messages,
                recall.client_history,
                &answered,
            ));
            if let Some(conversation) = &recall.conversation {
                recall_marks::save(&self.state, conversation, &recall.marks);
            }
        }
        if last {
            recall::withdraw(&mut self.request);
            self.recall = None;
        }
        self.body()
    }

    /// The request with the definitions of `called` (`inline::reask`); the last round allowed
    /// sends every tool in full.
    fn define(&mut self, called: &[String]) -> Result<Bytes, ProxyError> {
        self.rounds += 1;
        let max = self.state.config.pipeline.tools.max_expansions;
        if self.rounds < max {
            let definitions = if self.in_block {
                Definitions::InBlock
            } else {
                self.upstream.pipeline().tools.definitions
            };
            self.request = reask(&self.request, tools_of(&self.client), called, definitions);
        } else {
            let tools = self.request.tools.get().map_or(&[][..], Vec::as_slice);
            self.request.tools = Nullable::Value(promote(tools, tools_of(&self.client), None));
            self.all_full = true;
        }
        self.body()
    }

    /// The request with the tools defined in its messages in full in the block instead, after
    /// an answer called some of them (`failed`) with arguments that fail their schema: the
    /// template dropped the message, or the model misread it. Its later re-asks define tools
    /// in the block too.
    fn define_in_block(&mut self, failed: &Failed) -> Result<Bytes, ProxyError> {
        self.request = match inline::in_block_instead(&self.request, tools_of(&self.client)) {
            Some(in_block) => in_block,
            None => {
                let mut request = self.request.clone();
                let tools = request.tools.get().map_or(&[][..], Vec::as_slice);
                let names = Some(failed.tools.as_slice());
                request.tools = Nullable::Value(promote(tools, tools_of(&self.client), names));
                request
            }
        };
        self.in_block = true;
        // What the chain's history defines upstream tells nothing of the template: no lesson.
        let here = failed
            .tools
            .iter()
            .any(|t| !self.upstream_defined.contains(t));
        self.unread |= failed.unread && here;
        self.invalid_arguments = true;
        self.body()
    }

    /// The body of the request as it is now, after what it watches for is brought up to date.
    fn body(&mut self) -> Result<Bytes, ProxyError> {
        self.watch();
        let body = self
            .serialized(&self.request)
            .map_err(|e| ProxyError::Internal(e.to_string()))?;
        Ok(self.as_sent(body))
    }

    /// What the request now offers as stubs and defines only in its messages.
    fn watch(&mut self) {
        let tools = self.request.tools.get().map_or(&[][..], Vec::as_slice);
        let inline::Stubs {
            undefined: stubs,
            defined,
        } = stubs_of(tools, &self.request.messages, tools_of(&self.client));
        self.defined = defined;
        let (upstream, stubs): (Vec<String>, Vec<String>) = stubs
            .into_iter()
            .partition(|name| self.upstream_defined.contains(name));
        self.defined.extend(upstream);
        self.stubs = stubs;
    }

    /// The checked tools a JSON answer calls with arguments that fail their schema.
    fn failing(&mut self, answer: &Value) -> Option<Failed> {
        if self.defined.is_empty() {
            return None;
        }
        self.arguments.watch(tools_of(&self.client), &self.defined);
        let calls = calls_in(answer);
        self.arguments
            .failing(calls.iter().map(|(n, a)| (n.as_str(), a.as_str())))
    }

    /// A body of this request as the first one went: a stream asks for its usage (the meter
    /// reads it; the client gets it only if it asked).
    fn as_sent(&self, body: Vec<u8>) -> Bytes {
        let asked = self
            .stream_usage
            .then(|| meter::with_stream_usage(&body))
            .flatten();
        Bytes::from(asked.unwrap_or(body))
    }

    /// Several choices streamed at once: each would need its own splice, so such a request
    /// goes with every tool in full from the start.
    pub fn streams_several_choices(&self) -> bool {
        self.request.is_stream()
            && self
                .request
                .extra
                .get("n")
                .and_then(serde_json::Value::as_f64)
                .is_some_and(|n| n > 1.0)
    }

    /// The request with every stub expanded.
    pub fn all_full(&self) -> Option<Bytes> {
        let tools = self.request.tools.get()?;
        let mut request = self.request.clone();
        request.tools = Nullable::Value(promote(tools, tools_of(&self.client), None));
        self.serialized(&request)
            .ok()
            .map(|body| self.as_sent(body))
    }

    /// The body of a streamed re-ask's answer; an answer that is not a successful stream (an
    /// error status, JSON) is an error: the stream's headers are gone, it cannot be relayed.
    fn stream_of(&self, answer: UpstreamResponse) -> Result<Body, ProxyError> {
        let status = answer.response.status();
        if status.is_success() && is_event_stream(answer.response.headers()) {
            return Ok(answer.response.into_body());
        }
        Err(ProxyError::UpstreamInvalidResponse {
            upstream: self.upstream.config.name.clone(),
            reason: format!(
                "the answer to a re-ask with a tool's definition is not a stream (status {status})"
            ),
        })
    }

    /// Asks again with `body`; an upstream that refuses the definitions in the messages (a 400,
    /// `refusal::read`) is asked once more with those tools in full in the block. The answer, and what was sent.
    async fn ask(&mut self, body: Bytes) -> Result<(UpstreamResponse, Bytes), ProxyError> {
        let answer = self.send(body.clone()).await?;
        if answer.response.status().is_success() && std::mem::take(&mut self.unread) {
            // Its definitions in the block, the call it could not make is answered.
            learned::learn(&self.state, &self.upstream, Lesson::Drops);
        }
        let in_block = (answer.response.status() == StatusCode::BAD_REQUEST)
            .then(|| inline::in_block_instead(&self.request, tools_of(&self.client)))
            .flatten();
        let Some(in_block) = in_block else {
            return Ok((answer, body));
        };
        let as_results = self.request.messages.iter().any(inline::is_definition_call);
        match refusal::read(&self.upstream, answer, as_results).await? {
            Answered::Other(answer) => Ok((answer, body)),
            Answered::RefusedDefinitions => {
                self.request = in_block;
                self.in_block = true;
                let body = self.body()?;
                let answer = self.send(body.clone()).await?;
                let succeeded = answer.response.status().is_success();
                refusal::asked_in_block(&self.state, &self.upstream, succeeded);
                Ok((answer, body))
            }
        }
    }

    async fn send(&self, body: Bytes) -> Result<UpstreamResponse, ProxyError> {
        let mut headers = self.headers.clone();
        headers.remove(header::CONTENT_LENGTH);
        self.upstream
            .send(
                Method::POST,
                self.uri.clone(),
                headers,
                OutgoingBody::Buffered(body),
                &self.state.metrics,
                self.deadline,
            )
            .await
    }

    fn count(&self, outcome: ExpansionOutcome, started: Instant) {
        let metrics = &self.state.metrics;
        let (model, tenant) = (self.labels.model.as_str(), self.labels.tenant.as_str());
        metrics
            .tool_expansions
            .with_label_values(&[model, tenant, outcome.as_str()])
            .inc();
        metrics
            .tool_expansion_duration
            .observe(started.elapsed().as_secs_f64());
    }

    /// How the expansion ended: every tool went in full, a call that failed its schema was
    /// asked again with its tool in the block, or the called ones were enough.
    fn outcome(&self) -> ExpansionOutcome {
        if self.all_full {
            ExpansionOutcome::AllFull
        } else if self.invalid_arguments {
            ExpansionOutcome::InvalidArguments
        } else {
            ExpansionOutcome::Expanded
        }
    }
}

/// The answer to give the client: the upstream's, or, when it called stubs, the answer to the
/// request asked again with them in full.
pub async fn expand(
    call: ExpandCall,
    answer: UpstreamResponse,
    sent: Bytes,
) -> Result<Expanded, ProxyError> {
    if !answer.response.status().is_success() {
        return Ok(Expanded {
            answer,
            expanded: Vec::new(),
            sent,
            recalled: Vec::new(),
            usage: None,
            tools: None,
            defined: Vec::new(),
        });
    }
    if is_event_stream(answer.response.headers()) {
        return Ok(expand_stream(call, answer, sent));
    }
    // An answer too large to read whole is not a tool call: relayed as it comes.
    if too_large(&answer) {
        return Ok(Expanded {
            answer,
            expanded: Vec::new(),
            sent,
            recalled: Vec::new(),
            usage: None,
            tools: call.request.tools.get().cloned(),
            defined: defined_in(&call.request.messages).into_iter().collect(),
        });
    }
    expand_json(call, answer, sent).await
}

async fn expand_json(
    mut call: ExpandCall,
    answer: UpstreamResponse,
    mut sent: Bytes,
) -> Result<Expanded, ProxyError> {
    let (mut parts, bytes, started) = read_whole(&call.upstream, answer).await?;
    let total_timeout = call.upstream.config.total_timeout;
    let done = |parts, bytes: Bytes, expanded, sent, recalled, usage, call: &ExpandCall| Expanded {
        answer: UpstreamResponse {
            response: Response::from_parts(parts, Body::from(bytes)),
            started,
            deadline: tokio::time::Instant::now() + total_timeout,
        },
        expanded,
        sent,
        recalled,
        usage,
        tools: call.request.tools.get().cloned(),
        defined: defined_in(&call.request.messages).into_iter().collect(),
    };
    // Only what the watch reads: a Response echoes its instructions and tools, which an answer
    // that calls no stub would parse for nothing.
    let Some(mut answer) = watched_fields(&bytes) else {
        return Ok(done(
            parts,
            bytes,
            Vec::new(),
            sent,
            Vec::new(),
            None,
            &call,
        ));
    };
    let mut earlier = Vec::new();
    let mut expanded: Vec<String> = Vec::new();
    let expanding = Instant::now();
    loop {
        let answer_calls = call.as_chat(&answer);
        let called = called_stubs(&answer_calls, &call.watched());
        if !called.is_empty() {
            sent = call.re_ask(&called, calls_of(&answer_calls, recall::TOOL_NAME))?;
            note(
                &mut expanded,
                called.into_iter().filter(|c| c != recall::TOOL_NAME),
            );
        } else if let Some(failed) = call.failing(&answer_calls) {
            sent = call.define_in_block(&failed)?;
            note(&mut expanded, failed.tools);
        } else {
            break;
        }
        let (next_parts, next_answer) = match ask_json(&mut call, &mut sent).await {
            Ok(Reasked::Answer(parts, answer)) => (parts, answer),
            // An upstream error to a re-ask is the client's answer: never the call to a stub.
            Ok(Reasked::Refused(answer)) => {
                call.count(ExpansionOutcome::Error, expanding);
                return Ok(Expanded {
                    answer,
                    expanded,
                    sent,
                    recalled: call.recalled,
                    usage: None,
                    tools: None,
                    defined: Vec::new(),
                });
            }
            Err(e) => {
                call.count(ExpansionOutcome::Error, expanding);
                return Err(e);
            }
        };
        parts = next_parts;
        earlier.push(std::mem::replace(&mut answer, next_answer));
    }
    if earlier.is_empty() {
        let usage = answer.get("usage").cloned();
        return Ok(done(parts, bytes, expanded, sent, Vec::new(), usage, &call));
    }
    if !expanded.is_empty() {
        call.count(call.outcome(), expanding);
    }
    let merged = with_usage_of(answer, &earlier);
    let body = serde_json::to_vec(&merged).map_err(|e| ProxyError::Internal(e.to_string()))?;
    parts.headers.remove(header::CONTENT_LENGTH);
    let usage = merged.get("usage").cloned();
    let recalled = std::mem::take(&mut call.recalled);
    Ok(done(
        parts,
        Bytes::from(body),
        expanded,
        sent,
        recalled,
        usage,
        &call,
    ))
}

/// The fields of a JSON answer that the watch for stub calls reads, and that the merge of a
/// re-asked answer reads of the earlier ones: a chat completion's `choices`, a Response's
/// `output`, and `usage`; every other field is skipped, not parsed. Read as a JSON object is
/// (a repeated field's last value), `None` when the answer is not a JSON object.
fn watched_fields(bytes: &[u8]) -> Option<Value> {
    struct Watched;
    impl<'de> serde::de::Visitor<'de> for Watched {
        type Value = serde_json::Map<String, Value>;

        fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
            formatter.write_str("a JSON object")
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut fields = serde_json::Map::new();
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if matches!(key.as_ref(), "choices" | "output" | "usage") {
                    fields.insert(key.into_owned(), map.next_value::<Value>()?);
                } else {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
            Ok(fields)
        }
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let fields = serde::Deserializer::deserialize_map(&mut deserializer, Watched).ok()?;
    deserializer.end().ok()?;
    Some(Value::Object(fields))
}

/// Adds the tools asked again for to `expanded`, once each.
fn note(expanded: &mut Vec<String>, names: impl IntoIterator<Item = String>) {
    for name in names {
        if !expanded.contains(&name) {
            expanded.push(name);
        }
    }
}

/// The tool calls (name, arguments) of every choice of a JSON answer.
fn calls_in(answer: &Value) -> Vec<(String, String)> {
    let choices = answer["choices"].as_array().into_iter().flatten();
    choices
        .flat_map(|choice| {
            choice["message"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
        })
        .filter_map(|call| {
            let function = &call["function"];
            let name = function["name"].as_str()?.to_owned();
            let arguments = match &function["arguments"] {
                Value::String(text) => text.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            Some((name, arguments))
        })
        .collect()
}

/// The calls of the tool `name` in a JSON answer's first choice.
fn calls_of(answer: &Value, name: &str) -> Vec<ToolCall> {
    answer["choices"][0]["message"]["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|call| call["function"]["name"] == name)
        .filter_map(|call| serde_json::from_value(call.clone()).ok())
        .collect()
}

/// The answer to a JSON re-ask.
enum Reasked {
    Answer(Parts, Value),
    /// An upstream error status: the client gets it as it came.
    Refused(UpstreamResponse),
}

/// Asks again with `sent` and reads the answer whole; one that is not JSON is an error (a 502),
/// as is one that fails or comes too late.
async fn ask_json(call: &mut ExpandCall, sent: &mut Bytes) -> Result<Reasked, ProxyError> {
    let (next, asked) = call.ask(sent.clone()).await?;
    *sent = asked;
    if !next.response.status().is_success() {
        return Ok(Reasked::Refused(next));
    }
    let (parts, bytes, _) = read_whole(&call.upstream, next).await?;
    let answer = serde_json::from_slice::<Value>(&bytes).map_err(|e| {
        ProxyError::UpstreamInvalidResponse {
            upstream: call.upstream.config.name.clone(),
            reason: format!("the answer to a re-ask with a tool's definition is not JSON ({e})"),
        }
    })?;
    Ok(Reasked::Answer(parts, answer))
}

/// A streamed answer through the pure [`ExpandStream`], in a task: text and calls of full tools
/// go out as they come, and a call to a stub is asked again in the same stream.
fn expand_stream(call: ExpandCall, answer: UpstreamResponse, sent: Bytes) -> Expanded {
    // Which stubs a stream calls is known only as it ends: a guard's re-ask offers them all.
    let sent = call.all_full().unwrap_or(sent);
    let (started, deadline) = (answer.started, answer.deadline);
    let (mut parts, body) = answer.response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    // The relay applies the request's deadline to every part: a stalled one ends the stream
    // with an error event.
    let max_event = call.upstream.config.max_event_bytes;
    let watched = call.watched();
    let body = channel_body(|events| async move {
        match call.responses {
            Some(_) => {
                let rewriter = ResponsesExpandStream::new(watched, max_event);
                relay(call, body, &events, rewriter).await;
            }
            None => relay(call, body, &events, ExpandStream::new(watched, max_event)).await,
        }
    });
    Expanded {
        answer: UpstreamResponse {
            response: Response::from_parts(parts, body),
            started,
            deadline,
        },
        expanded: Vec::new(),
        sent,
        recalled: Vec::new(),
        usage: None,
        tools: None,
        defined: Vec::new(),
    }
}

/// A pure stream rewriter that splices re-asked answers into the client's stream: chat's
/// ([`ExpandStream`]) or the Responses event stream's ([`ResponsesExpandStream`]).
trait Splicer: PartRewriter<End = PartEnd> {
    /// The re-asked answer is arriving; `watched`: the calls its request answers itself.
    fn re_asked(&mut self, watched: Vec<String>);
    fn arguments(&mut self) -> &mut ArgumentCheck;
    /// The held calls of the tool `name` of the part that just ended.
    fn held_calls_of(&self, name: &str) -> Vec<ToolCall>;
    /// Where the comment naming the tools expanded goes among the last events.
    fn comment_at(last: &[Bytes]) -> usize;
}

impl Splicer for ExpandStream {
    fn re_asked(&mut self, watched: Vec<String>) {
        ExpandStream::re_asked(self, watched);
    }

    fn arguments(&mut self) -> &mut ArgumentCheck {
        ExpandStream::arguments(self)
    }

    fn held_calls_of(&self, name: &str) -> Vec<ToolCall> {
        ExpandStream::held_calls_of(self, name)
    }

    /// After the calls and the usage, just before `[DONE]`.
    fn comment_at(last: &[Bytes]) -> usize {
        last.iter()
            .rposition(|e| e.as_ref() == b"data: [DONE]\n\n")
            .unwrap_or(last.len())
    }
}

impl Splicer for ResponsesExpandStream {
    fn re_asked(&mut self, watched: Vec<String>) {
        ResponsesExpandStream::re_asked(self, watched);
    }

    fn arguments(&mut self) -> &mut ArgumentCheck {
        ResponsesExpandStream::arguments(self)
    }

    fn held_calls_of(&self, name: &str) -> Vec<ToolCall> {
        ResponsesExpandStream::held_calls_of(self, name)
    }

    fn comment_at(last: &[Bytes]) -> usize {
        ResponsesExpandStream::comment_at(last)
    }
}

async fn relay<S: Splicer>(mut call: ExpandCall, first: Body, events: &Events, mut rewriter: S) {
    rewriter
        .arguments()
        .watch(tools_of(&call.client), &call.defined);
    let mut body = first;
    let mut expanded: Vec<String> = Vec::new();
    let expanding = Instant::now();
    loop {
        let pumped = pump(
            &call.upstream,
            &call.state.metrics,
            &mut rewriter,
            body,
            events,
            call.usage_asked,
        );
        let Some(end) = pumped.await else {
            return;
        };
        let request = match end {
            PartEnd::Done(mut last) => {
                if !expanded.is_empty() {
                    call.count(call.outcome(), expanding);
                    let comment = format!("{EXPANDED_COMMENT}{}\n\n", expanded.join(","));
                    last.insert(S::comment_at(&last), Bytes::from(comment));
                }
                forward_all(events, last).await;
                return;
            }
            PartEnd::ReAsk(called) => {
                let recalls = rewriter.held_calls_of(recall::TOOL_NAME);
                let request = call.re_ask(&called, recalls);
                note(
                    &mut expanded,
                    called.into_iter().filter(|c| c != recall::TOOL_NAME),
                );
                request
            }
            PartEnd::Invalid(failed) => {
                let request = call.define_in_block(&failed);
                note(&mut expanded, failed.tools);
                request
            }
        };
        let next = match request {
            // A client that left is not asked for again.
            Ok(request) => tokio::select! {
                next = call.ask(request) => next.map(|(next, _)| next),
                () = events.closed() => return,
            },
            Err(e) => Err(e),
        };
        match next.and_then(|next| call.stream_of(next)) {
            Ok(next) => {
                rewriter.re_asked(call.watched());
                rewriter
                    .arguments()
                    .watch(tools_of(&call.client), &call.defined);
                body = next;
            }
            // The error event says why: the upstream's timeout, failure, or answer.
            Err(e) => {
                call.count(ExpansionOutcome::Error, expanding);
                forward(events, rewriter.error_event(&e)).await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::watched_fields;

    #[test]
    fn an_answer_is_read_for_its_calls_and_usage_as_a_json_object_reads() {
        let answer = br#"{"id":"r","instructions":"long","tools":[{"type":"function"}],
            "output":[{"type":"function_call","name":"a"}],"usage":{"input_tokens":1},
            "output":[{"type":"function_call","name":"b"}]}"#;
        assert_eq!(
            watched_fields(answer),
            Some(
                json!({"output": [{"type": "function_call", "name": "b"}], "usage": {"input_tokens": 1}})
            )
        );
        assert_eq!(
            watched_fields(br#"{"choices":[],"model":"m"}"#),
            Some(json!({"choices": []}))
        );
        for not_an_object in [
            &b"[[], [], {}]"[..],
            b"\"text\"",
            b"{\"choices\":[]} trailing",
            b"{",
        ] {
            assert_eq!(watched_fields(not_an_object), None);
        }
    }
}
