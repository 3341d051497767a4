//! The deterministic cache on the request path: look up before the upstream call (a hit is
//! answered as JSON or as a replayed stream, as the client asked), and store a complete, 2xx
//! answer after it (streamed answers are assembled first; a cut stream is never stored).
//! Store errors are misses; an undecodable entry is deleted.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;

use super::SharedState;
use crate::body::{BodyEnd, BodyObserver};
use crate::metrics::{CacheName, ChatLabels, LookupResult, SavingSource, UsageKind};
use sha2::{Digest, Sha256};

use crate::cache::assemble::{StreamAssembler, replay, sse_body};
use crate::cache::dedup::{cosine, decode, encode, guard};
use crate::cache::dedup_scope::{ineligible, scope_digest};
use crate::cache::deterministic::{Decision, decide, key};
use crate::cache::embedder::{self, embedder_id};
use crate::cache::responses::{self, Seen};
use crate::cache::time_words::is_time_dependent;
use crate::openai::sse::event_data;
use crate::openai::{
    Api, ChatCompletion, ChatCompletionChunk, ChatRequest, Content, Nullable, Role, Usage,
};
use crate::server::meter;
use crate::upstream::Upstream;

/// A dedup-eligible question: where its scope's questions live, and the question.
pub struct DedupPlan {
    key: String,
    question: String,
    vector: Vec<f32>,
}

/// One question of a dedup scope's index. The index holds questions and vectors only, so a
/// lookup never fetches answers it won't serve; the answer lives under `answer_key`.
#[derive(serde::Serialize, serde::Deserialize)]
struct DedupEntry {
    question: String,
    vector: String,
    answer_key: String,
}

/// Where the answer to `question` in the scope indexed at `index_key` is stored.
fn dedup_answer_key(index_key: &str, question: &str) -> String {
    format!(
        "{index_key}:answer:{}",
        hex::encode(Sha256::digest(question.as_bytes()))
    )
}

/// Tokens a hit saved, from the usage stored with the answer, and what they would have cost.
fn count_tokens_saved(state: &SharedState, usage: &Usage, chat: &ChatRequest, labels: &ChatLabels) {
    let (model, tenant) = (labels.model.as_str(), labels.tenant.as_str());
    let saved = &state.metrics.cache_tokens_saved;
    saved
        .with_label_values(&[UsageKind::Prompt.as_str(), model, tenant])
        .inc_by(usage.prompt_tokens);
    saved
        .with_label_values(&[UsageKind::Completion.as_str(), model, tenant])
        .inc_by(usage.completion_tokens);
    if let Some(price) = state.config.price_of(&chat.model) {
        let usd = (usage.prompt_tokens as f64 * price.input
            + usage.completion_tokens as f64 * price.output)
            / 1e6;
        state
            .metrics
            .cost_saved_usd
            .with_label_values(&[SavingSource::Cache.as_str(), model, tenant])
            .inc_by(usd);
    }
}

fn count_cache(state: &SharedState, cache: CacheName, result: LookupResult, labels: &ChatLabels) {
    state
        .metrics
        .cache_requests
        .with_label_values(&[
            cache.as_str(),
            result.as_str(),
            &labels.model,
            &labels.tenant,
        ])
        .inc();
}

fn count_dedup(state: &SharedState, result: LookupResult, labels: &ChatLabels) {
    count_cache(state, CacheName::Dedup, result, labels);
}

/// A conversational question the dedup cache may answer: the last message is the user's text,
/// not time-dependent, and the client allows caching.
pub async fn dedup_plan(
    state: &SharedState,
    chat: &ChatRequest,
    sent: &Bytes,
    headers: &HeaderMap,
    scope: &str,
    labels: &ChatLabels,
    upstream: &Upstream,
) -> Option<DedupPlan> {
    let config = &state.config.cache;
    if !config.dedup.enabled {
        return None;
    }
    let last = chat.messages.last().filter(|m| m.role == Role::User)?;
    let question = match last.content.get()? {
        Content::Text(text) => text.to_string(),
        Content::Parts(_) => return None,
    };
    // The contract and the conversation before the question (see `dedup_scope`).
    let contract = serde_json::from_slice::<serde_json::Value>(sent)
        .ok()
        .filter(|body| ineligible(body).is_none())
        .and_then(|body| scope_digest(&body, config.dedup.scope));
    let eligible = !question.trim().is_empty()
        && !is_time_dependent(&question, &config.time_words)
        && !no_store_or_no_cache(headers);
    let Some(contract) = contract.filter(|_| eligible) else {
        count_dedup(state, LookupResult::Bypass, labels);
        return None;
    };
    let embedder = embedder_id(&config.dedup);
    let mut hasher = Sha256::new();
    // The route too: one model name on two upstreams is two models.
    for part in [scope, upstream.config.name.as_str(), &contract, &embedder] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let vector = match embedder::vector(
        &config.dedup,
        &question,
        upstream,
        headers,
        state.config.auth_enabled(),
        &state.metrics,
    )
    .await
    {
        Ok(vector) => vector,
        Err(reason) => {
            tracing::debug!(%reason, embedder, "dedup: no vector for the question, cache skipped");
            count_dedup(state, LookupResult::Error, labels);
            return None;
        }
    };
    Some(DedupPlan {
        // v3: scoped by the request's contract and conversation (v2 and v1 are never read).
        key: format!("cache:dedup:v3:{}", hex::encode(hasher.finalize())),
        vector,
        question,
    })
}

fn no_store_or_no_cache(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|d| {
            matches!(
                d.trim().to_ascii_lowercase().as_str(),
                "no-store" | "no-cache"
            )
        })
}

/// The earlier answer of the same question asked in other words, marked by the proxy.
pub async fn dedup_look_up(
    state: &SharedState,
    plan: &DedupPlan,
    chat: &ChatRequest,
    labels: &ChatLabels,
) -> Option<Response<Body>> {
    let config = &state.config.cache.dedup;
    let started = Instant::now();
    let entries = state.store.list(&plan.key).await;
    let matches = entries.iter().filter_map(|bytes| {
        let entry: DedupEntry = serde_json::from_slice(bytes).ok()?;
        let vector = decode(&entry.vector)?;
        (cosine(&vector, &plan.vector) >= config.threshold
            && guard(&entry.question, &plan.question).is_ok())
        .then_some(entry.answer_key)
    });
    // Only answers to matching questions are fetched, one at a time, until one is still there
    // (an answer may expire before its index entry).
    let mut found = None;
    for answer_key in matches {
        found = state
            .store
            .get(&answer_key)
            .await
            .and_then(|bytes| serde_json::from_slice::<ChatCompletion>(&bytes).ok());
        if found.is_some() {
            break;
        }
    }
    state
        .metrics
        .cache_lookup_duration
        .with_label_values(&[CacheName::Dedup.as_str(), &labels.model, &labels.tenant])
        .observe(started.elapsed().as_secs_f64());
    let Some(mut answer) = found else {
        count_dedup(state, LookupResult::Miss, labels);
        return None;
    };
    count_dedup(state, LookupResult::Hit, labels);
    if let Some(usage) = answer.usage.get() {
        count_tokens_saved(state, usage, chat, labels);
    }
    for choice in &mut answer.choices {
        let text = choice
            .message
            .content
            .get()
            .map(|c| c.text().into_owned())
            .unwrap_or_default();
        choice.message.content = Nullable::Value(Content::Text(
            format!("{}\n\n{text}", config.disclaimer).into(),
        ));
    }
    answer.usage = Nullable::Value(Usage {
        prompt_tokens: 0,
        completion_tokens: 0,
        total_tokens: 0,
        extra: Default::default(),
    });
    Some(self::answer(&answer, chat))
}

pub enum Lookup {
    Hit(Response<Body>),
    /// Not in the cache: the answer is stored under the key.
    Miss(String),
    /// `Cache-Control: no-cache`: no lookup, but the fresh answer is stored.
    WriteOnly(String),
    Bypass,
}

fn count(state: &SharedState, result: LookupResult, labels: &ChatLabels) {
    count_cache(state, CacheName::Deterministic, result, labels);
}

/// Looks `sent` (the body going upstream) up in the caller's `scope` on upstream `route`. `chat` is the
/// client's request: it says whether to answer as a stream, with usage.
pub async fn look_up(
    state: &SharedState,
    asked: Asked<'_>,
    sent: &Bytes,
    headers: &HeaderMap,
    scope: &str,
    route: &str,
    labels: &ChatLabels,
) -> Lookup {
    let Asked { chat, api } = asked;
    let config = &state.config.cache;
    let decision = decide(chat, headers, config);
    // While Redis is down the store serves from this replica's memory: its repeats still hit.
    if matches!(decision, Decision::Bypass(_)) {
        count(state, LookupResult::Bypass, labels);
        return Lookup::Bypass;
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(sent) else {
        count(state, LookupResult::Bypass, labels);
        return Lookup::Bypass;
    };
    let key = key(&value, scope, route, config);
    if decision == Decision::WriteOnly {
        count(state, LookupResult::Bypass, labels);
        return Lookup::WriteOnly(key);
    }
    let started = Instant::now();
    let entry = state.store.get(&key).await;
    state
        .metrics
        .cache_lookup_duration
        .with_label_values(&[
            CacheName::Deterministic.as_str(),
            &labels.model,
            &labels.tenant,
        ])
        .observe(started.elapsed().as_secs_f64());
    let Some(bytes) = entry else {
        count(state, LookupResult::Miss, labels);
        return Lookup::Miss(key);
    };
    let hit = match api {
        Api::Chat => serde_json::from_slice::<ChatCompletion>(&bytes)
            .ok()
            .map(|completion| (completion.usage.get().cloned(), answer(&completion, chat))),
        Api::Responses => responses::storable(&bytes).map(|mut response| {
            let usage = meter::usage_of_answer(Api::Responses, &bytes);
            // The key leaves `user` out; the Response echoes it: this request's.
            responses::echo_user(&mut response, chat.extra.get("user"));
            (usage, responses_answer(&response, chat.is_stream()))
        }),
    };
    let Some((usage, response)) = hit else {
        state.store.delete(&key).await;
        count(state, LookupResult::Error, labels);
        return Lookup::Miss(key);
    };
    count(state, LookupResult::Hit, labels);
    if let Some(usage) = &usage {
        count_tokens_saved(state, usage, chat, labels);
    }
    Lookup::Hit(response)
}

/// A request a cache may answer: its chat form, and the API its client speaks.
#[derive(Clone, Copy)]
pub struct Asked<'a> {
    pub chat: &'a ChatRequest,
    pub api: Api,
}

/// A stored Response as the client asked for it: JSON, or replayed as events.
fn responses_answer(response: &serde_json::Value, stream: bool) -> Response<Body> {
    if stream {
        return with_content_type(Body::from(responses::replay(response)), "text/event-stream");
    }
    let body = serde_json::to_vec(response).unwrap_or_default();
    with_content_type(Body::from(body), "application/json")
}

fn answer(completion: &ChatCompletion, chat: &ChatRequest) -> Response<Body> {
    let (content_type, body) = if chat.is_stream() {
        let chunks = replay(completion, chat.include_usage());
        ("text/event-stream", sse_body(&chunks))
    } else {
        (
            "application/json",
            serde_json::to_vec(completion).unwrap_or_default(),
        )
    };
    with_content_type(Body::from(body), content_type)
}

/// A 200 of `body`; a stream, like a live one, is never stored by intermediaries.
fn with_content_type(body: Body, content_type: &'static str) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if content_type != "application/json" {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    }
    response
}

/// Collects an answer and stores it under `key` when it ends complete.
pub struct CacheWrite {
    state: SharedState,
    key: Option<String>,
    dedup: Option<DedupPlan>,
    streamed: bool,
    assembler: StreamAssembler,
    done: bool,
    json: Vec<u8>,
    /// Bytes of the answer seen so far (JSON or events).
    seen: usize,
    /// Not storable: too large, an error event, or an unknown shape.
    unstorable: bool,
    /// The answer's API; a Responses stream's Response, from its `response.completed`.
    api: Api,
    response: Option<serde_json::Value>,
}

impl CacheWrite {
    pub fn new(
        state: SharedState,
        key: Option<String>,
        dedup: Option<DedupPlan>,
        streamed: bool,
    ) -> CacheWrite {
        CacheWrite {
            state,
            key,
            dedup,
            streamed,
            assembler: StreamAssembler::default(),
            done: false,
            json: Vec::new(),
            seen: 0,
            unstorable: false,
            api: Api::Chat,
            response: None,
        }
    }

    /// Stores an answer of `api` (a Responses answer as its Response, never in dedup).
    pub fn for_api(mut self, api: Api) -> CacheWrite {
        self.api = api;
        self
    }
}

impl BodyObserver for CacheWrite {
    fn on_data(&mut self, data: &Bytes) {
        if self.unstorable {
            return;
        }
        self.seen += data.len();
        if self.seen > self.state.config.cache.max_entry_bytes {
            // Relayed whole, never stored; what was gathered is let go at once.
            self.unstorable = true;
            self.assembler = StreamAssembler::default();
            self.json = Vec::new();
            self.state.metrics.cache_too_large.inc();
            return;
        }
        if self.streamed && self.api == Api::Responses {
            if let Some(payload) = event_data(data) {
                match responses::seen(&payload) {
                    Seen::Completed(response) => {
                        self.response = Some(response);
                        self.done = true;
                    }
                    Seen::Unstorable => self.unstorable = true,
                    Seen::Going => {}
                }
            }
        } else if self.streamed {
            match event_data(data).as_deref() {
                Some("[DONE]") => self.done = true,
                Some(payload) => match serde_json::from_str::<ChatCompletionChunk>(payload) {
                    Ok(chunk) => self.assembler.push(chunk),
                    // An error event or an unknown shape: not a cacheable answer.
                    Err(_) => self.unstorable = true,
                },
                None => {}
            }
        } else {
            self.json.extend_from_slice(data);
        }
    }

    fn on_end(self: Box<Self>, end: BodyEnd) {
        let this = *self;
        if end != BodyEnd::Complete || this.unstorable {
            return;
        }
        if this.api == Api::Responses {
            let response = match this.response {
                Some(response) => Some(response),
                None if !this.streamed => responses::storable(&this.json),
                None => None,
            };
            let (Some(key), Some(value)) =
                (this.key, response.and_then(|r| serde_json::to_vec(&r).ok()))
            else {
                return;
            };
            let state = this.state;
            let ttl = Duration::from_secs(state.config.cache.deterministic.ttl_secs);
            tokio::spawn(async move { state.store.set(&key, &value, ttl).await });
            return;
        }
        let completion = if this.streamed {
            if !this.done {
                return;
            }
            this.assembler.finish()
        } else {
            serde_json::from_slice::<ChatCompletion>(&this.json).ok()
        };
        let Some(completion) = completion else {
            return;
        };
        let (state, key, dedup) = (this.state, this.key, this.dedup);
        // Only plain text answers are reused for other wordings of a question.
        let text_answer = completion.choices.iter().all(|c| {
            c.message.tool_calls().is_empty()
                && c.finish_reason.get().map(String::as_str) == Some("stop")
        });
        let value = serde_json::to_vec(&completion).ok();
        let dedup_entry = dedup.filter(|_| text_answer).and_then(|plan| {
            let answer_key = dedup_answer_key(&plan.key, &plan.question);
            let entry = DedupEntry {
                question: plan.question,
                vector: encode(&plan.vector),
                answer_key: answer_key.clone(),
            };
            let index_entry = serde_json::to_vec(&entry).ok()?;
            Some((plan.key, index_entry, answer_key, value.clone()?))
        });
        let config = &state.config.cache;
        let ttl = Duration::from_secs(config.deterministic.ttl_secs);
        let (dedup_ttl, max_entries) = (
            Duration::from_secs(config.dedup.ttl_secs),
            config.dedup.max_entries,
        );
        tokio::spawn(async move {
            if let (Some(key), Some(value)) = (key, value) {
                state.store.set(&key, &value, ttl).await;
            }
            if let Some((index_key, entry, answer_key, answer)) = dedup_entry {
                // The answer first, so that an index entry never points at nothing for long.
                state.store.set(&answer_key, &answer, dedup_ttl).await;
                state
                    .store
                    .push_capped(&index_key, &entry, max_entries, dedup_ttl)
                    .await;
            }
        });
    }
}
