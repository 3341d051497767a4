//! The phases of a chat request after its rewrite: look up the caches ([`ChatCall::look_up`]),
//! send upstream with the agent guards ([`ChatCall::send`]), and relay the answer through its
//! observers: usage meter, sticky categories, cache writes, recording ([`ChatCall::relay`]).

use std::time::Instant;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::Response;
use bytes::Bytes;
use serde_json::Value;

use super::call::{ChatCall, Outgoing, X_CTXPROXY_BUDGET, X_CTXPROXY_MODE};
use super::call_log::CallLog;
use crate::body::{BodyObserver, Observers};
use crate::error::ProxyError;
use crate::metrics::{CacheOutcome, ChainToolsOutcome};
use crate::openai::{Api, ChatRequest};
use crate::pipeline::Mode;
use crate::pipeline::recall::Mark;
use crate::pipeline::tools::chain::ChainTools;
use crate::pipeline::tools::inline;
use crate::record::ResponseCapture;
use crate::responses;
use crate::server::cached::{self, CacheWrite, DedupPlan, Lookup};
use crate::server::chain_tools;
use crate::server::guarded::refusal::{self, Answered};
use crate::server::guarded::{self, Conversation, ExpandCall, GuardCall, Sent};
use crate::server::meter::{self, ResponseMeter, Saving};
use crate::server::sticky::StickyUpdate;
use crate::upstream::{
    ChatRelay, OutgoingBody, UpstreamResponse, apply_upstream_auth, end_to_end, is_event_stream,
};

/// Where and how a request is sent: what building its re-asks needs.
struct Sending<'a> {
    uri: &'a Uri,
    headers: &'a HeaderMap,
    deadline: tokio::time::Instant,
    usage_asked: bool,
    strip_usage: bool,
    optimize: bool,
}

impl Sending<'_> {
    fn sent<'s>(&'s self, body: &'s Bytes) -> Sent<'s> {
        Sent {
            uri: self.uri,
            headers: self.headers,
            body,
            deadline: self.deadline,
            usage_asked: self.usage_asked,
        }
    }
}

/// What the caches said.
pub enum Looked {
    /// A cached answer.
    Served(Response<Body>),
    /// Not cached: where the upstream's answer may be stored.
    Miss(CacheKeys),
}

/// Where an answer is stored once it has arrived complete.
pub struct CacheKeys {
    deterministic: Option<String>,
    dedup: Option<DedupPlan>,
}

/// The upstream's answer, after the guards.
pub struct Answer {
    answer: UpstreamResponse,
    sent_at: Instant,
    saving: Option<Saving>,
    /// The tokens of the rewrite sent, when the client's bytes did not go.
    sent_tokens: Option<usize>,
    /// The answer called stubs and was asked again.
    expanded: bool,
    /// The client did not ask for the stream's usage event: it is left out of what it gets.
    strip_usage: bool,
    /// The upstream was asked for the stream's usage (by the client or on its behalf).
    usage_asked: bool,
    /// The `usage` of the JSON answer the client gets, when the expansion read it already.
    usage: Option<Value>,
}

/// What the re-asks of a request's answer carry over: where its conversation's recalls were
/// answered, and the tools its chain's history defines (a chained Responses request).
struct Watched<'a> {
    recalls: &'a [Mark],
    upstream_defined: &'a [String],
}

impl ChatCall<'_> {
    /// The deterministic cache (keyed by what is sent), then the dedup cache.
    pub async fn look_up(&self, outgoing: &Outgoing, log: &mut CallLog) -> Looked {
        let api = self.api();
        if !self.responses.as_ref().is_none_or(|c| c.cacheable()) {
            // A Response kept upstream, or a chained one: its id is the client's to chain on.
            log.cache = Some(CacheOutcome::Bypass);
            return Looked::Miss(CacheKeys {
                deterministic: None,
                dedup: None,
            });
        }
        let state = self.state;
        let labels = &log.labels;
        let name = &self.upstream.config.name;
        let asked = cached::Asked {
            chat: &self.chat,
            api,
        };
        let lookup = cached::look_up(
            state,
            asked,
            &outgoing.body,
            &self.parts.headers,
            &self.scope,
            name,
            labels,
        )
        .await;
        let (deterministic, outcome) = match lookup {
            Lookup::Hit(response) => {
                log.cache = Some(CacheOutcome::Hit);
                return Looked::Served(response);
            }
            Lookup::Miss(key) => (Some(key), CacheOutcome::Miss),
            Lookup::WriteOnly(key) => (Some(key), CacheOutcome::Bypass),
            Lookup::Bypass => (None, CacheOutcome::Bypass),
        };
        if api == Api::Responses {
            // Dedup answers other wordings of a chat question; not offered on this API.
            log.cache = Some(outcome);
            return Looked::Miss(CacheKeys {
                deterministic,
                dedup: None,
            });
        }
        let headers = &self.parts.headers;
        let dedup = cached::dedup_plan(
            state,
            &self.chat,
            &outgoing.body,
            headers,
            &self.scope,
            labels,
            self.upstream,
        )
        .await;
        if let Some(plan) = &dedup
            && let Some(response) = cached::dedup_look_up(state, plan, &self.chat, labels).await
        {
            log.cache = Some(CacheOutcome::Dedup);
            return Looked::Served(response);
        }
        // A dedup lookup that found nothing is a miss, whatever the deterministic cache said.
        log.cache = Some(if dedup.is_some() {
            CacheOutcome::Miss
        } else {
            outcome
        });
        Looked::Miss(CacheKeys {
            deterministic,
            dedup,
        })
    }

    /// Sends the request upstream; in optimize mode the agent guards watch the answer and may
    /// ask again.
    pub async fn send(&self, outgoing: Outgoing, log: &mut CallLog) -> Result<Answer, ProxyError> {
        let state = self.state;
        // Usage of every stream, for the token metrics; the client gets it only if it asked.
        let strip_usage = self.mode != Mode::Off
            && self.api() == Api::Chat
            && self.chat.is_stream()
            && !self.chat.include_usage();
        // A complete stream then carries its usage.
        let usage_asked = strip_usage || self.chat.include_usage();
        let body = match strip_usage
            .then(|| meter::with_stream_usage(&outgoing.body))
            .flatten()
        {
            Some(asked) => Bytes::from(asked),
            None => outgoing.body,
        };

        let mut headers = end_to_end(&self.parts.headers);
        headers.remove(header::CONTENT_LENGTH);
        // Responses are read by later stages (usage, caches): ask for them uncompressed.
        headers.remove(header::ACCEPT_ENCODING);
        headers.remove(X_CTXPROXY_MODE);
        headers.remove(X_CTXPROXY_BUDGET);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let upstream = self.upstream;
        apply_upstream_auth(&mut headers, &upstream.config, state.config.auth_enabled());
        let path = match self.api() {
            Api::Chat => "/chat/completions",
            Api::Responses => "/responses",
        };
        let suffix = match self.parts.uri.query() {
            Some(query) => format!("{path}?{query}"),
            None => path.to_owned(),
        };
        let uri = upstream.uri(&suffix)?;
        // Optimize mode only: a call to a stub is asked again with the tool in full, and the
        // agent guards ask again with what was sent.
        let optimize = self.mode == Mode::Optimize;
        // One deadline for the whole answer the client sees: every re-ask gets what is left.
        let deadline = upstream.deadline();
        let sending = Sending {
            uri: &uri,
            headers: &headers,
            deadline,
            usage_asked,
            strip_usage,
            optimize,
        };
        let with_stubs = outgoing.with_stubs.filter(|_| optimize);
        let recalls = outgoing.recalls;
        let mut chain_tools = outgoing.chain_tools;
        let upstream_defined = outgoing.chain_defined;
        let watched = Watched {
            recalls: &recalls,
            upstream_defined: &upstream_defined,
        };
        let (mut expansion, mut guard, mut body) =
            self.watchers(&sending, with_stubs.clone(), body, log, &watched);
        let mut first = body.clone();
        let sent_at = Instant::now();
        let send = |body: Bytes| {
            upstream.send(
                Method::POST,
                uri.clone(),
                headers.clone(),
                OutgoingBody::Buffered(body),
                &state.metrics,
                deadline,
            )
        };
        let mut answer = send(body.clone()).await?;
        // An upstream that refuses the definitions in the messages (`refusal::read`): asked again
        // with them in the block, and so are its later requests.
        let client_tools = self.chat.tools.get().map_or(&[][..], Vec::as_slice);
        let in_block = (answer.response.status() == StatusCode::BAD_REQUEST)
            .then_some(with_stubs.as_ref())
            .flatten()
            .and_then(|request| inline::in_block_instead(request, client_tools));
        if let Some(in_block) = in_block {
            let as_results = (with_stubs.as_ref())
                .is_some_and(|r| r.messages.iter().any(inline::is_definition_call));
            match refusal::read(upstream, answer, as_results).await? {
                Answered::Other(other) => answer = other,
                Answered::RefusedDefinitions => {
                    let bytes = match &self.responses {
                        Some(converted) => responses::write(converted, &in_block),
                        None => serde_json::to_vec(&in_block),
                    }
                    .map_err(|e| ProxyError::Internal(e.to_string()))?;
                    let bytes = Bytes::from(
                        match strip_usage
                            .then(|| meter::with_stream_usage(&bytes))
                            .flatten()
                        {
                            Some(asked) => asked,
                            None => bytes,
                        },
                    );
                    log.sent_rewritten(&bytes);
                    chain_tools = self.chain_tools_of(&in_block, &upstream_defined);
                    (expansion, guard, body) =
                        self.watchers(&sending, Some(in_block), bytes, log, &watched);
                    first = body.clone();
                    answer = send(body).await?;
                    let succeeded = answer.response.status().is_success();
                    refusal::asked_in_block(state, upstream, succeeded);
                }
            }
        }
        let (saving, sent_tokens) = (outgoing.saving, outgoing.sent_tokens);
        let mut usage = None;
        let answer = match expansion {
            Some(expansion) => {
                let expanded = guarded::expand(expansion, answer, first).await?;
                log.expanded = expanded.expanded;
                log.recalled = expanded.recalled;
                usage = expanded.usage;
                if let Some(tools) = &expanded.tools {
                    let defined = expanded.defined;
                    chain_tools = self.chain_tools_with(tools, defined, &upstream_defined);
                }
                if let Some(guard) = &mut guard {
                    guard.answers(expanded.sent);
                }
                expanded.answer
            }
            None => answer,
        };
        let answer = match guard {
            Some(guard) => {
                // A guard may continue the answer: its usage is read from what it gives.
                usage = None;
                let (answer, flags) = guarded::guard(guard, answer).await?;
                if flags.repaired {
                    // The retry that repaired a claim asked with the client's own tools.
                    chain_tools = None;
                }
                log.flags = flags;
                answer
            }
            None => answer,
        };
        let answer = match chain_tools {
            Some(block) => self.remember_chain_tools(answer, block).await?,
            None => answer,
        };
        Ok(Answer {
            answer,
            sent_at,
            saving,
            sent_tokens,
            expanded: !log.expanded.is_empty() || !log.recalled.is_empty(),
            strip_usage,
            usage_asked,
            usage,
        })
    }

    /// Remembers the block a stored JSON Response's request sent under the Response's id,
    /// before the client gets it: a request chained on it at once finds it (`chain_tools`).
    async fn remember_chain_tools(
        &self,
        answer: UpstreamResponse,
        block: ChainTools,
    ) -> Result<UpstreamResponse, ProxyError> {
        let json = answer.response.status().is_success()
            && !is_event_stream(answer.response.headers())
            && self.api() == Api::Responses;
        if !json {
            return Ok(answer);
        }
        let (answer, id) = guarded::read_id(self.upstream, answer).await?;
        if let Some(id) = id
            && chain_tools::save(self.state, &self.scope, &id, &block).await
        {
            let metrics = &self.state.metrics;
            metrics.count_chain_tools(ChainToolsOutcome::Remembered, &self.labels);
        }
        Ok(answer)
    }

    /// The re-asks that watch an answer to `body` (`request`: the rewrite with stubs it is):
    /// the expansion of stub calls and the agent guards, and the body to send (every tool in
    /// full when a stream of several choices could not be expanded).
    fn watchers(
        &self,
        sending: &Sending<'_>,
        request: Option<ChatRequest>,
        body: Bytes,
        log: &CallLog,
        watched: &Watched<'_>,
    ) -> (Option<ExpandCall>, Option<GuardCall>, Bytes) {
        let state = self.state;
        let mut body = body;
        let mut expansion = request.and_then(|request| {
            let request = (request, sending.strip_usage);
            let sent = sending.sent(&body);
            // A chained request's recalls go nowhere: its history is upstream, and no later
            // request of the conversation puts them back.
            let chained = self.responses.as_ref().is_some_and(|c| c.chained());
            let conversation = Conversation {
                id: self.conversation.clone().filter(|_| !chained),
                recalls: watched.recalls.to_vec(),
            };
            let labels = &log.labels;
            ExpandCall::new(
                state,
                self.upstream,
                &self.chat,
                request,
                sent,
                labels,
                conversation,
            )
            .map(|call| {
                call.written_as(self.responses.clone())
                    .defined_upstream(watched.upstream_defined.to_vec())
            })
        });
        if let Some(all_full) = expansion
            .as_ref()
            .filter(|x| x.streams_several_choices())
            .and_then(ExpandCall::all_full)
        {
            body = all_full;
            expansion = None;
        }
        let guard = sending
            .optimize
            .then(|| {
                GuardCall::new(
                    state,
                    self.upstream,
                    &self.chat,
                    self.responses.as_deref(),
                    sending.sent(&body),
                    self.budget(),
                )
            })
            .flatten();
        (expansion, guard, body)
    }

    /// Relays the answer to the client through the observers that read it as it passes.
    pub fn relay(self, answer: Answer, keys: CacheKeys, log: &mut CallLog) -> Response<Body> {
        let state = self.state;
        let api = self.api();
        let Answer {
            answer,
            sent_at,
            saving,
            sent_tokens,
            expanded,
            strip_usage,
            usage_asked,
            usage,
        } = answer;
        let chained = self.responses.as_ref().is_some_and(|c| c.chained());
        let mut observers: Vec<Box<dyn BodyObserver>> = Vec::new();
        // Recorded from the upstream's bytes, before the usage event is left out for the client.
        if let Some(exchange) = log.take_record(&answer.response, sent_at) {
            observers.push(Box::new(ResponseCapture::new(
                state.recorder.clone(),
                exchange,
                log.received,
            )));
        }
        if answer.response.status().is_success() {
            let streamed = is_event_stream(answer.response.headers());
            let name = &self.upstream.config.name;
            observers.push(Box::new(
                ResponseMeter::new(
                    state.clone(),
                    log.labels.clone(),
                    name,
                    streamed,
                    log.received,
                )
                .with_saving(saving)
                .with_price(state.config.price_of(&self.chat.model))
                .with_sent(sent_tokens, expanded)
                .history_upstream(chained)
                .for_api(api)
                .with_answer_usage(usage),
            ));
            let tool_state = self.uses_tool_state() && api == Api::Chat;
            if let Some(conversation) = self.conversation.filter(|_| tool_state) {
                observers.push(Box::new(StickyUpdate::new(
                    state.clone(),
                    conversation,
                    &self.chat,
                    streamed,
                )));
            }
            if keys.deterministic.is_some() || keys.dedup.is_some() {
                observers.push(Box::new(
                    CacheWrite::new(state.clone(), keys.deterministic, keys.dedup, streamed)
                        .for_api(api),
                ));
            }
        }
        let chat = ChatRelay {
            observer: (!observers.is_empty())
                .then(|| Box::new(Observers(observers)) as Box<dyn BodyObserver>),
            drop_event: strip_usage.then_some(meter::is_usage_only_event as fn(&[u8]) -> bool),
            usage_asked,
            api,
        };
        self.upstream
            .relay(answer, &state.metrics, &log.labels, Some(chat))
    }
}
