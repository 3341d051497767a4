//! What the upstream says it spent: `usage` of every chat answer (JSON, or the usage event of a
//! stream) counted per model and tenant, priced with `[prices]` (what the answers cost), and the
//! time to a stream's first event. Streams are
//! asked for usage even when the client did not ask (`stream_options.include_usage`); that
//! usage-only event is then left out of what the client receives. For a rewritten request, the
//! usage also prices what the rewrite saved, with the provider's cached tokens counted.

use bytes::Bytes;
use memchr::memmem;
use serde::Deserialize;
use tokio::time::Instant;

use super::SharedState;
use crate::bill::{self, Prompt};
use crate::body::{BodyEnd, BodyObserver};
use crate::config::ModelPrice;
use crate::guards::expand::EXPANDED_COMMENT;
use crate::metrics::{ChatLabels, SavingSource, TokenPhase, UsageKind};
use crate::openai::sse::event_data;
use crate::openai::{Api, Nullable, Usage, with_first_field};

/// The largest non-streamed answer read for its usage.
const MAX_JSON_BYTES: usize = 4 * 1024 * 1024;

#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Nullable<Usage>,
}

/// What a rewritten request is priced against when its usage arrives.
#[derive(Debug, Clone, Copy)]
pub struct Saving {
    /// The client's request: its tokens, and what the provider would have found cached of it
    /// (the client's previous request of the conversation is a prefix of it).
    pub original: Prompt,
    /// The tokens sent; the usage says how many of them were cached.
    pub sent_tokens: usize,
    pub price: ModelPrice,
}

pub struct ResponseMeter {
    state: SharedState,
    saving: Option<Saving>,
    /// The model's `[prices]` entry, when it has one.
    price: Option<ModelPrice>,
    labels: ChatLabels,
    upstream: String,
    streamed: bool,
    /// When the request arrived; taken when the first event comes.
    received: Option<Instant>,
    json: Vec<u8>,
    /// A stream's usage event, counted at the stream's end: an expanded stream says so after it.
    stream_usage: Option<Usage>,
    /// The tokens of the rewrite sent (optimize mode, the request changed).
    sent_tokens: Option<usize>,
    /// The answer called stubs and was asked again (a stream says so in its comment): its
    /// usage sums every call's prompt.
    expanded: bool,
    /// A chained request's: its usage counts the history the upstream holds, which its report
    /// does not, so what an expansion added cannot be told from it.
    history_upstream: bool,
    /// Which API the answer speaks: where its usage is and what it is called.
    api: Api,
    /// The usage of a JSON answer, when what read the answer before the relay had it: the
    /// answer is then not kept to be read again.
    answer_usage: Option<Usage>,
    /// Bytes of a JSON answer seen: one over `MAX_JSON_BYTES` is not counted, read or not.
    json_bytes: usize,
}

impl ResponseMeter {
    pub fn new(
        state: SharedState,
        labels: ChatLabels,
        upstream: &str,
        streamed: bool,
        received: Instant,
    ) -> ResponseMeter {
        ResponseMeter {
            state,
            saving: None,
            price: None,
            labels,
            upstream: upstream.to_owned(),
            streamed,
            received: Some(received),
            json: Vec::new(),
            stream_usage: None,
            sent_tokens: None,
            expanded: false,
            history_upstream: false,
            api: Api::Chat,
            answer_usage: None,
            json_bytes: 0,
        }
    }

    /// Reads the usage of an answer of `api`.
    pub fn for_api(mut self, api: Api) -> ResponseMeter {
        self.api = api;
        self
    }

    /// The `usage` field of the JSON answer, already read (by the expansion of stub calls);
    /// after [`ResponseMeter::for_api`].
    pub fn with_answer_usage(mut self, usage: Option<serde_json::Value>) -> ResponseMeter {
        self.answer_usage = usage.and_then(|usage| match self.api {
            Api::Chat => Usage::deserialize(&usage).ok(),
            Api::Responses => ResponsesUsage::deserialize(&usage)
                .ok()
                .map(ResponsesUsage::into_chat),
        });
        self
    }

    /// Prices the answer (`ctxproxy_cost_usd_total`) when its usage arrives.
    pub fn with_price(mut self, price: Option<ModelPrice>) -> ResponseMeter {
        self.price = price;
        self
    }

    /// Prices the rewrite's saving when the usage arrives.
    pub fn with_saving(mut self, saving: Option<Saving>) -> ResponseMeter {
        self.saving = saving;
        self
    }

    /// The rewrite sent (its tokens), and whether the answer was re-asked with stubs expanded:
    /// the re-asks' prompts are counted from the usage.
    pub fn with_sent(mut self, sent_tokens: Option<usize>, expanded: bool) -> ResponseMeter {
        self.sent_tokens = sent_tokens;
        self.expanded = expanded;
        self
    }

    /// A chained request (`previous_response_id`, `conversation`): an expanded answer's saving
    /// and re-asked tokens are not counted.
    pub fn history_upstream(mut self, chained: bool) -> ResponseMeter {
        self.history_upstream = chained;
        self
    }

    /// Counted once: at a stream's end, or when a JSON answer is read whole.
    fn count(&self, usage: &Usage) {
        let reported = usage
            .extra
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(serde_json::Value::as_u64);
        let cached = reported.unwrap_or(0);
        let unknown = self.expanded && self.history_upstream;
        if let Some(mut saving) = self.saving.filter(|_| !unknown) {
            if self.expanded {
                saving.sent_tokens = usage.prompt_tokens as usize;
            }
            self.count_saving(saving, reported);
        }
        let metrics = &self.state.metrics;
        let (model, tenant) = (self.labels.model.as_str(), self.labels.tenant.as_str());
        if let Some(sent) = self.sent_tokens.filter(|_| self.expanded && !unknown) {
            let reasked = usage.prompt_tokens.saturating_sub(sent as u64);
            metrics
                .prompt_tokens
                .with_label_values(&[TokenPhase::Reasked.as_str(), model, tenant])
                .inc_by(reasked);
        }
        if let Some(price) = &self.price {
            let prompt = Prompt {
                tokens: usize::try_from(usage.prompt_tokens).unwrap_or(usize::MAX),
                cached: usize::try_from(cached).unwrap_or(usize::MAX),
            };
            let usd = prompt.usd(price) + usage.completion_tokens as f64 * price.output / 1e6;
            metrics
                .cost_usd
                .with_label_values(&[model, tenant])
                .inc_by(usd);
        }
        let reasoning = usage
            .extra
            .get("completion_tokens_details")
            .and_then(|d| d.get("reasoning_tokens"))
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        let tokens = &metrics.usage_tokens;
        for (kind, n) in [
            (UsageKind::Prompt, usage.prompt_tokens),
            (UsageKind::Completion, usage.completion_tokens),
            (UsageKind::CachedPrompt, cached),
            (UsageKind::Reasoning, reasoning),
        ] {
            tokens
                .with_label_values(&[kind.as_str(), model, tenant])
                .inc_by(n);
        }
    }
}

impl ResponseMeter {
    /// The original's input bill minus the rewrite's. A provider that reports no cached tokens
    /// caches nothing (or does not say): then only the tokens count, on both sides.
    fn count_saving(&self, saving: Saving, reported_cached: Option<u64>) {
        let (original_cached, sent_cached) = match reported_cached {
            Some(cached) => (saving.original.cached, cached as usize),
            None => (0, 0),
        };
        let original = Prompt {
            cached: original_cached,
            ..saving.original
        };
        let sent = Prompt {
            tokens: saving.sent_tokens,
            cached: sent_cached,
        };
        let saved = bill::saved_usd(original, sent, &saving.price);
        let (model, tenant) = (self.labels.model.as_str(), self.labels.tenant.as_str());
        let metrics = &self.state.metrics;
        if saved > 0.0 {
            metrics
                .cost_saved_usd
                .with_label_values(&[SavingSource::Pipeline.as_str(), model, tenant])
                .inc_by(saved);
        } else if saved < 0.0 {
            metrics
                .cost_added_usd
                .with_label_values(&[model, tenant])
                .inc_by(-saved);
        }
    }
}

impl BodyObserver for ResponseMeter {
    fn on_data(&mut self, data: &Bytes) {
        if !self.streamed {
            self.json_bytes += data.len();
            if self.json_bytes > MAX_JSON_BYTES {
                self.answer_usage = None;
            }
            if self.answer_usage.is_none() && self.json.len() + data.len() <= MAX_JSON_BYTES {
                self.json.extend_from_slice(data);
            }
            return;
        }
        if let Some(received) = self.received.take() {
            self.state
                .metrics
                .stream_first_byte
                .with_label_values(&[
                    self.upstream.as_str(),
                    &self.labels.model,
                    &self.labels.tenant,
                ])
                .observe(received.elapsed().as_secs_f64());
        }
        if memmem::find(data, EXPANDED_COMMENT.as_bytes()).is_some() {
            self.expanded = true;
        }
        if memmem::find(data, b"\"usage\":{").is_some()
            && let Some(payload) = event_data(data)
            && let Some(usage) = usage_of_event(self.api, &payload)
        {
            self.stream_usage = Some(usage);
        }
    }

    fn on_end(mut self: Box<Self>, end: BodyEnd) {
        if let Some(usage) = self.stream_usage.take() {
            self.count(&usage);
            return;
        }
        if self.streamed || end != BodyEnd::Complete {
            return;
        }
        if let Some(usage) = self
            .answer_usage
            .take()
            .or_else(|| usage_of_answer(self.api, &self.json))
        {
            self.count(&usage);
        }
    }
}

/// The usage of a whole JSON answer of `api`, as chat counts it.
pub fn usage_of_answer(api: Api, json: &[u8]) -> Option<Usage> {
    match api {
        Api::Chat => serde_json::from_slice::<WithUsage>(json)
            .ok()?
            .usage
            .get()
            .cloned(),
        Api::Responses => serde_json::from_slice::<WithResponsesUsage>(json)
            .ok()?
            .usage
            .map(ResponsesUsage::into_chat),
    }
}

/// The usage of one stream event of `api`: chat's usage chunk, or the Response that a Responses
/// stream's last event (`response.completed`, `.incomplete`, `.failed`) carries.
fn usage_of_event(api: Api, payload: &str) -> Option<Usage> {
    match api {
        Api::Chat => serde_json::from_str::<WithUsage>(payload)
            .ok()?
            .usage
            .get()
            .cloned(),
        Api::Responses => {
            #[derive(Deserialize)]
            struct Event {
                response: Option<WithResponsesUsage>,
            }
            serde_json::from_str::<Event>(payload)
                .ok()?
                .response?
                .usage
                .map(ResponsesUsage::into_chat)
        }
    }
}

#[derive(Deserialize)]
struct WithResponsesUsage {
    usage: Option<ResponsesUsage>,
}

/// A Response's `usage`.
#[derive(Deserialize)]
struct ResponsesUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(default)]
    total_tokens: u64,
    #[serde(default)]
    input_tokens_details: Option<serde_json::Value>,
    #[serde(default)]
    output_tokens_details: Option<serde_json::Value>,
}

impl ResponsesUsage {
    /// As chat names it: input tokens are prompt tokens (their cached share in
    /// `prompt_tokens_details`), output tokens completion tokens (reasoning in
    /// `completion_tokens_details`).
    fn into_chat(self) -> Usage {
        let mut extra = serde_json::Map::new();
        if let Some(details) = self.input_tokens_details {
            extra.insert("prompt_tokens_details".into(), details);
        }
        if let Some(details) = self.output_tokens_details {
            extra.insert("completion_tokens_details".into(), details);
        }
        Usage {
            prompt_tokens: self.input_tokens,
            completion_tokens: self.output_tokens,
            total_tokens: self.total_tokens,
            extra,
        }
    }
}

/// Whether an SSE event is the usage-only chunk (`"choices": []` with a `usage` object).
pub fn is_usage_only_event(event: &[u8]) -> bool {
    if memmem::find(event, b"\"usage\":{").is_none() {
        return false;
    }
    #[derive(Deserialize)]
    struct Chunk {
        #[serde(default)]
        choices: Option<Vec<serde_json::Value>>,
        #[serde(default)]
        usage: Option<serde_json::Value>,
    }
    event_data(event)
        .and_then(|payload| serde_json::from_str::<Chunk>(&payload).ok())
        .is_some_and(|c| {
            c.choices.is_some_and(|ch| ch.is_empty()) && c.usage.is_some_and(|u| u.is_object())
        })
}

/// The body with `stream_options.include_usage = true` when the client did not ask for usage,
/// or `None` when it already did (or the body is not a JSON object).
pub fn with_stream_usage(body: &[u8]) -> Option<Vec<u8>> {
    // Usual case, no `stream_options` key anywhere: insert it after the opening brace, without
    // parsing the body again (it was parsed and validated already).
    if memmem::find(body, b"\"stream_options\"").is_none() {
        return with_first_field(body, br#""stream_options":{"include_usage":true}"#);
    }
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object_mut()?;
    let options = object
        .entry("stream_options")
        .or_insert_with(|| serde_json::json!({}));
    if !options.is_object() {
        *options = serde_json::json!({});
    }
    let options = options.as_object_mut()?;
    if options.get("include_usage") == Some(&serde_json::Value::Bool(true)) {
        return None;
    }
    options.insert("include_usage".into(), serde_json::Value::Bool(true));
    serde_json::to_vec(&value).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usage_event_is_recognized_and_usage_is_asked_once() {
        assert!(is_usage_only_event(
            b"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\n"
        ));
        assert!(!is_usage_only_event(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\":{\"}}],\"usage\":null}\n\n"
        ));
        assert!(!is_usage_only_event(b"data: [DONE]\n\n"));
        let asked = with_stream_usage(br#"{"model":"m","stream":true}"#).unwrap();
        let asked: serde_json::Value = serde_json::from_slice(&asked).unwrap();
        assert_eq!(asked["stream_options"]["include_usage"], true);
        assert_eq!(
            with_stream_usage(br#"{"stream":true,"stream_options":{"include_usage":true}}"#),
            None
        );
        // Both paths give valid JSON with the option set, and keep every other field.
        for body in [
            &br#" {"model":"m","stream":true}"#[..],
            br#"{}"#,
            br#"{"stream":true,"stream_options":{"include_usage":false},"n":1}"#,
            br#"{"stream":true,"stream_options":null}"#,
        ] {
            let asked: serde_json::Value =
                serde_json::from_slice(&with_stream_usage(body).unwrap()).unwrap();
            assert_eq!(asked["stream_options"]["include_usage"], true, "{body:?}");
            let original: serde_json::Value = serde_json::from_slice(body).unwrap();
            for (key, value) in original.as_object().unwrap() {
                if key != "stream_options" {
                    assert_eq!(&asked[key], value);
                }
            }
        }
    }
}
