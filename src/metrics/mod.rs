//! Every Prometheus metric ctxproxy exports, defined in one place on a registry that is passed
//! down (no global statics). Label values come only from closed sets or configured names.

pub mod labels;
mod rewrite;

use prometheus::core::Collector;
use prometheus::{
    CounterVec, Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

pub use labels::{
    BudgetOutcome, CacheName, CacheOutcome, ChainToolsOutcome, ClaimRepair, Compaction,
    ContinuationOutcome, ExpansionOutcome, LookupResult, MemoryCache, RecallOutcome, RecordDrop,
    Route, SavingSource, StoreOp, TokenPhase, ToolPhase, UpstreamError, UsageKind,
};

use crate::glob::glob_match;
use crate::pipeline::tools::Reason;

/// The `model` and `tenant` labels of one chat request. Both come from bounded sets: the
/// model as named by a configured route or price (else `other`), the tenant from `[auth]`.
#[derive(Debug, Clone)]
pub struct ChatLabels {
    pub model: String,
    pub tenant: String,
}

impl ChatLabels {
    /// A request whose model is not known yet (its body did not parse).
    pub fn unknown(tenant: &str) -> ChatLabels {
        ChatLabels {
            model: "other".to_owned(),
            tenant: tenant.to_owned(),
        }
    }
}

/// The model names that may appear as a label: literal names and glob patterns of `[[routes]]`
/// and `[prices]`. A glob labels its models with the pattern itself (`gpt-4o*`).
#[derive(Debug, Default)]
pub struct ModelLabels {
    names: Vec<String>,
}

/// The `model` or `tenant` label of a request that has none (a probe, a scrape, a request
/// refused before authentication; the model of a request to the other `/v1/*` routes).
pub const NO_LABEL: &str = "none";

/// More models than this are labelled `other` (labels stay bounded whatever the config says).
const MAX_MODEL_LABELS: usize = 50;

impl ModelLabels {
    /// The labels of the models and patterns the config names (`Config::model_names`).
    pub fn new<'a>(models: impl IntoIterator<Item = &'a str>) -> ModelLabels {
        let mut names: Vec<String> = models.into_iter().map(str::to_owned).collect();
        // Literal names first: `gpt-4o-mini` is its own label even beside `gpt-4o*`.
        names.sort_by_key(|n| (n.contains('*'), n.clone()));
        names.dedup();
        names.truncate(MAX_MODEL_LABELS);
        ModelLabels { names }
    }

    pub fn label(&self, model: &str) -> &str {
        self.names
            .iter()
            .find(|n| glob_match(n, model))
            .map_or("other", String::as_str)
    }
}

/// Request and upstream latency buckets, in seconds: from 100 µs to 5 min.
const DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

pub struct Metrics {
    registry: Registry,
    /// `route`: [`Route`].
    pub requests: IntCounterVec,
    /// `route`: [`Route`], `model`, `tenant` ([`NO_LABEL`] where a request has none).
    pub request_duration: HistogramVec,
    /// `upstream`, `model`, `tenant` (`model` is [`NO_LABEL`] for the other `/v1/*` routes).
    pub upstream_duration: HistogramVec,
    /// `kind`: [`UpstreamError`].
    pub upstream_errors: IntCounterVec,
    pub in_flight: IntGauge,
    pub open_connections: IntGauge,
    pub connections_refused: IntCounter,
    pub cache_too_large: IntCounter,
    pub build_info: IntGaugeVec,
    /// `phase`: [`TokenPhase`].
    pub prompt_tokens: IntCounterVec,
    /// `stage`: [`crate::pipeline::StageName`].
    pub tokens_saved: IntCounterVec,
    pub tokens_saveable: IntCounterVec,
    /// `model`, `tenant`.
    pub pipeline_duration: HistogramVec,
    /// `outcome`: [`BudgetOutcome`].
    pub budget_outcomes: IntCounterVec,
    /// `phase`: [`ToolPhase`].
    pub tools: IntCounterVec,
    /// `reason`: [`Reason`].
    pub tool_filter_decisions: IntCounterVec,
    /// `cache`: [`CacheName`], `result`: [`LookupResult`].
    pub cache_requests: IntCounterVec,
    /// `kind`: [`UsageKind`] (prompt, completion).
    pub cache_tokens_saved: IntCounterVec,
    /// `cache`: [`CacheName`], `model`, `tenant`.
    pub cache_lookup_duration: HistogramVec,
    /// `op`: [`StoreOp`].
    pub store_errors: IntCounterVec,
    pub store_up: IntGauge,
    /// `cache`: [`MemoryCache`].
    pub memory_cache_bytes: IntGaugeVec,
    /// Requests asked again because the upstream refused a definitions message, by `upstream`.
    pub tool_definitions_refused: IntCounterVec,
    /// Chat completions by `model`, `tenant`, HTTP `status` and `cache`: [`CacheOutcome`].
    pub chat_requests: IntCounterVec,
    /// `usage` reported by the upstream: `kind`: [`UsageKind`].
    pub usage_tokens: IntCounterVec,
    /// `source`: [`SavingSource`].
    pub cost_saved_usd: CounterVec,
    /// What rewrites cost more than the originals would have (a broken cached prefix).
    pub cost_added_usd: CounterVec,
    /// What the upstream's answers cost, from their usage and `[prices]`: `model`, `tenant`.
    pub cost_usd: CounterVec,
    /// `upstream`, `model`, `tenant`.
    pub stream_first_byte: HistogramVec,
    /// `method`: [`Compaction`].
    pub compactions: IntCounterVec,
    /// Exchanges written to the `[record]` file.
    pub records_written: IntCounter,
    /// `reason`: [`RecordDrop`].
    pub record_dropped: IntCounterVec,
    /// `outcome`: [`ContinuationOutcome`].
    pub continuations: IntCounterVec,
    /// `repair`: [`ClaimRepair`].
    pub action_claims: IntCounterVec,
    /// `outcome`: [`ExpansionOutcome`].
    pub tool_expansions: IntCounterVec,
    /// The upstream time answers that called stubs took beyond the first answer.
    pub tool_expansion_duration: Histogram,
    /// `outcome`: [`RecallOutcome`].
    pub tool_recalls: IntCounterVec,
    /// `outcome`: [`ChainToolsOutcome`].
    pub chain_tools: IntCounterVec,
}

/// Pipeline time buckets, in seconds: from 10 µs to 50 ms.
const PIPELINE_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
];

impl Metrics {
    pub fn store(&self) -> crate::store::StoreMetrics {
        crate::store::StoreMetrics {
            errors: self.store_errors.clone(),
            up: self.store_up.clone(),
        }
    }

    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let r = Registrar(&registry);
        let metrics = Metrics {
            requests: r.counters(
                "ctxproxy_requests_total",
                "HTTP requests to ctxproxy, by route and HTTP status (499: the client left before the response headers).",
                &["route", "status"],
            )?,
            request_duration: r.histograms(
                "ctxproxy_request_duration_seconds",
                "Time from receiving a request to the end of its response body (streams included), by route, model and tenant (\"none\" where the request has none: probes, scrapes, the other /v1/* routes' model).",
                DURATION_BUCKETS,
                &["route", "model", "tenant"],
            )?,
            upstream_duration: r.histograms(
                "ctxproxy_upstream_duration_seconds",
                "Time from sending a request upstream to the end of the upstream's response body, by upstream, model and tenant (model \"none\" for the other /v1/* routes).",
                DURATION_BUCKETS,
                &["upstream", "model", "tenant"],
            )?,
            upstream_errors: r.counters(
                "ctxproxy_upstream_errors_total",
                "Upstream calls that failed without an HTTP response, by kind (connect, request, timeout, body, event_too_large).",
                &["upstream", "kind"],
            )?,
            in_flight: r.gauge(
                "ctxproxy_in_flight_requests",
                "Requests being served right now, streams included.",
            )?,
            open_connections: r.gauge(
                "ctxproxy_open_connections",
                "Client connections open right now (at most server.max_connections).",
            )?,
            connections_refused: r.counter(
                "ctxproxy_connections_refused_total",
                "Client connections closed at once: server.max_connections were open.",
            )?,
            cache_too_large: r.counter(
                "ctxproxy_cache_too_large_total",
                "Answers relayed but not stored in a cache: larger than cache.max_entry_bytes.",
            )?,
            build_info: r.gauges(
                "ctxproxy_build_info",
                "Always 1; the version of the running binary.",
                &["version"],
            )?,
            prompt_tokens: r.counters(
                "ctxproxy_prompt_tokens_total",
                "Prompt tokens of chat requests as received (phase=original) and as sent upstream (phase=sent), plus the prompts of the re-asks of answers that called a stub (phase=reasked: the upstream's usage, every call summed, less phase=sent).",
                &["phase", "model", "tenant"],
            )?,
            tokens_saved: r.counters(
                "ctxproxy_tokens_saved_total",
                "Prompt tokens removed by each pipeline stage on requests sent optimized.",
                &["stage", "model", "tenant"],
            )?,
            tokens_saveable: r.counters(
                "ctxproxy_observe_tokens_saveable_total",
                "Prompt tokens each pipeline stage would have removed from requests forwarded unchanged in observe mode.",
                &["stage", "model", "tenant"],
            )?,
            pipeline_duration: r.histograms(
                "ctxproxy_pipeline_duration_seconds",
                "Time spent rewriting a chat request (the proxy's own overhead on the request path), by model and tenant.",
                PIPELINE_BUCKETS,
                &["model", "tenant"],
            )?,
            budget_outcomes: r.counters(
                "ctxproxy_budget_outcomes_total",
                "Token budget outcomes: fit (within budget), over_floor (the floor of system, tools, working set and ledger alone is over the budget: sent, flagged with X-Ctxproxy-Over-Budget), rejected (400, with on_exceed = \"reject\").",
                &["outcome", "model", "tenant"],
            )?,
            tools: r.counters(
                "ctxproxy_tools_total",
                "Tool definitions of optimized chat requests as offered by the client (phase=offered) and as sent upstream: in full (phase=sent) or as stubs (phase=stub); of the stubs, those whose full definitions are in the messages (phase=defined).",
                &["phase"],
            )?,
            tool_filter_decisions: r.counters(
                "ctxproxy_tool_filter_decisions_total",
                "Why the tools stage kept what it kept: match, sticky, no_match_drop, no_match_keep, no_match_stub (every tool not protected goes as a stub), protected, small_block (sent whole: under [tools] min_tool_tokens).",
                &["reason"],
            )?,
            cache_requests: r.counters(
                "ctxproxy_cache_requests_total",
                "Cache lookups by cache (deterministic, dedup) and result (hit, miss, bypass, error).",
                &["cache", "result", "model", "tenant"],
            )?,
            cache_tokens_saved: r.counters(
                "ctxproxy_cache_tokens_saved_total",
                "Tokens not spent thanks to cache hits, from the stored usage: kind=prompt|completion.",
                &["kind", "model", "tenant"],
            )?,
            cache_lookup_duration: r.histograms(
                "ctxproxy_cache_lookup_duration_seconds",
                "Time of one cache lookup in the store, by cache (deterministic, dedup), model and tenant.",
                PIPELINE_BUCKETS,
                &["cache", "model", "tenant"],
            )?,
            store_errors: r.counters(
                "ctxproxy_store_errors_total",
                "Store operations that failed or timed out (each treated as a miss), by operation.",
                &["op"],
            )?,
            store_up: r.gauge(
                "ctxproxy_store_up",
                "1 while the configured store answers (Redis reachable, or the memory backend); 0 while Redis is down and memory serves instead.",
            )?,
            memory_cache_bytes: r.gauges(
                "ctxproxy_memory_cache_bytes",
                "Bytes held by each in-process cache (memo, rewrites, token_counts, token_pieces, store); each is bounded by [memory] or [store] and sheds what no request used within [memory] idle_secs.",
                &["cache"],
            )?,
            tool_definitions_refused: r.counters(
                "ctxproxy_tool_definitions_refused_total",
                "Requests an upstream refused (400) while they defined tools in a system message in mid-conversation, asked again with those tools in full in the block; the upstream's later requests define tools in the block.",
                &["upstream"],
            )?,
            chat_requests: r.counters(
                "ctxproxy_chat_requests_total",
                "Chat completion and Responses API requests by model, tenant, HTTP status and cache result (hit, dedup, miss, bypass; none when no cache was consulted).",
                &["model", "tenant", "status", "cache"],
            )?,
            usage_tokens: r.counters(
                "ctxproxy_usage_tokens_total",
                "Tokens the upstream reported in `usage` (streams included; chat and Responses API): kind=prompt|completion|cached_prompt|reasoning.",
                &["kind", "model", "tenant"],
            )?,
            cost_saved_usd: r.dollars(
                "ctxproxy_cost_saved_usd_total",
                "Estimated US dollars not spent, from [prices]: source=pipeline (the original's input bill minus the rewrite's, cached prices counted) or cache (hits' stored usage).",
                &["source", "model", "tenant"],
            )?,
            cost_added_usd: r.dollars(
                "ctxproxy_cost_added_usd_total",
                "Estimated US dollars a rewrite cost more than the original would have (it broke a prefix the provider had cached); the pipeline's net saving is ctxproxy_cost_saved_usd_total{source=\"pipeline\"} minus this.",
                &["model", "tenant"],
            )?,
            cost_usd: r.dollars(
                "ctxproxy_cost_usd_total",
                "Estimated US dollars the upstream's chat answers cost, from their usage and [prices]: prompt tokens at the input price (those the provider cached at the cached price) plus completion tokens at the output price. Models without a price count nothing; cache hits cost nothing.",
                &["model", "tenant"],
            )?,
            stream_first_byte: r.histograms(
                "ctxproxy_stream_first_byte_seconds",
                "Streams: time from receiving the request to the first event from the upstream, by upstream, model and tenant.",
                DURATION_BUCKETS,
                &["upstream", "model", "tenant"],
            )?,
            compactions: r.counters(
                "ctxproxy_compactions_total",
                "Tool results compacted by the compact stage, by method: cleared (older result replaced by a note), json, text.",
                &["method"],
            )?,
            records_written: r.counter(
                "ctxproxy_records_written_total",
                "Exchanges written to the [record] file (counted once flushed to it).",
            )?,
            record_dropped: r.counters(
                "ctxproxy_record_dropped_total",
                "Sampled exchanges not recorded, by reason: queue_full (the writer is behind; the request was not slowed), write_error, writer_stopped.",
                &["reason"],
            )?,
            continuations: r.counters(
                "ctxproxy_continuations_total",
                "Answers cut at the length limit that ctxproxy continued, by outcome: completed (the last part ended by itself), max_attempts, budget (the next request would exceed the token budget), error (a continuation call failed; the cut answer was returned).",
                &["outcome"],
            )?,
            action_claims: r.counters(
                "ctxproxy_action_claims_without_tool_call_total",
                "Answers to requests with tools that claim an action without calling any tool, by repair: off (retry not configured, or a stream), repaired (the retry called a tool and was returned), failed.",
                &["repair"],
            )?,
            tool_expansions: r.counters(
                "ctxproxy_tool_expansions_total",
                "Answers that called a tool sent as a stub without its definition, asked again with it defined, by outcome: expanded (the called tools defined were enough), all_full (the last round allowed, [tools] max_expansions, sent every tool in full), invalid_arguments (a call of a tool defined only in the messages failed the client's JSON schema, as when the chat template drops that message: asked again with the tool in full in the block), error (a re-ask failed; the client got the upstream's error).",
                &["model", "tenant", "outcome"],
            )?,
            tool_recalls: r.counters(
                "ctxproxy_tool_recalls_total",
                "Calls of ctxproxy_recall that the proxy answered itself, unseen by the client, by outcome: found (the original of a cleared or shortened tool result), unknown (the handle named nothing in the request; the model was told so).",
                &["model", "tenant", "outcome"],
            )?,
            chain_tools: r.counters(
                "ctxproxy_chain_tools_total",
                "The tool block along previous_response_id chains of the Responses API, by outcome: applied (a chained request was sent the block its chain's previous request sent), missing (none is remembered for the Response it chains on: its tools went whole), whole (one is, but the request sent its tools whole: other tools, a demanded call, or an answer that cannot be expanded unseen), remembered (a stored Response's request sent a block of its own, remembered under its id).",
                &["model", "tenant", "outcome"],
            )?,
            tool_expansion_duration: r.histogram(
                "ctxproxy_tool_expansion_duration_seconds",
                "Upstream time an answer that called stubs took beyond the first answer (its re-asks).",
                DURATION_BUCKETS,
            )?,
            registry: registry.clone(),
        };
        metrics
            .build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        Ok(metrics)
    }

    /// Creates the series of closed label sets at zero, so that every metric is exported from
    /// the start and `rate()` sees the first increase.
    /// `upstreams`: the configured upstreams' names (`Config::upstream_names`).
    pub fn initialize(&self, upstreams: &[&str]) {
        for op in StoreOp::ALL {
            self.store_errors.with_label_values(&[op.as_str()]);
        }
        for cache in MemoryCache::ALL {
            self.memory_cache_bytes.with_label_values(&[cache.as_str()]);
        }
        for upstream in upstreams {
            self.tool_definitions_refused
                .with_label_values(&[*upstream]);
        }
        for upstream in upstreams {
            for kind in UpstreamError::ALL {
                self.upstream_errors
                    .with_label_values(&[*upstream, kind.as_str()]);
            }
        }
        for reason in Reason::ALL {
            self.tool_filter_decisions
                .with_label_values(&[reason.as_str()]);
        }
        for phase in ToolPhase::ALL {
            self.tools.with_label_values(&[phase.as_str()]);
        }
        // Rare by design: exported at zero for the dashboard's net saving.
        self.cost_added_usd.with_label_values(&["other", "default"]);
        self.cost_usd.with_label_values(&["other", "default"]);
        for method in Compaction::ALL {
            self.compactions.with_label_values(&[method.as_str()]);
        }
        for reason in RecordDrop::ALL {
            self.record_dropped.with_label_values(&[reason.as_str()]);
        }
        for outcome in ContinuationOutcome::ALL {
            self.continuations.with_label_values(&[outcome.as_str()]);
        }
        for repair in ClaimRepair::ALL {
            self.action_claims.with_label_values(&[repair.as_str()]);
        }
        // Rare by design: exported at zero for the dashboard.
        for outcome in ExpansionOutcome::ALL {
            self.tool_expansions
                .with_label_values(&["other", "default", outcome.as_str()]);
        }
        for outcome in RecallOutcome::ALL {
            self.tool_recalls
                .with_label_values(&["other", "default", outcome.as_str()]);
        }
        for outcome in ChainToolsOutcome::ALL {
            self.chain_tools
                .with_label_values(&["other", "default", outcome.as_str()]);
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buffer) {
            tracing::warn!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(buffer).unwrap_or_default()
    }
}

/// Builds a metric and registers it in one step.
struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    fn register<M: Collector + Clone + 'static>(&self, metric: M) -> Result<M, prometheus::Error> {
        self.0.register(Box::new(metric.clone()))?;
        Ok(metric)
    }

    fn counter(&self, name: &str, help: &str) -> Result<IntCounter, prometheus::Error> {
        self.register(IntCounter::new(name, help)?)
    }

    fn counters(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntCounterVec, prometheus::Error> {
        self.register(IntCounterVec::new(Opts::new(name, help), labels)?)
    }

    /// A counter of fractional amounts (US dollars).
    fn dollars(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<CounterVec, prometheus::Error> {
        self.register(CounterVec::new(Opts::new(name, help), labels)?)
    }

    fn gauge(&self, name: &str, help: &str) -> Result<IntGauge, prometheus::Error> {
        self.register(IntGauge::new(name, help)?)
    }

    fn gauges(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntGaugeVec, prometheus::Error> {
        self.register(IntGaugeVec::new(Opts::new(name, help), labels)?)
    }

    fn histogram(
        &self,
        name: &str,
        help: &str,
        buckets: &[f64],
    ) -> Result<Histogram, prometheus::Error> {
        self.register(Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        )?)
    }

    fn histograms(
        &self,
        name: &str,
        help: &str,
        buckets: &[f64],
        labels: &[&str],
    ) -> Result<HistogramVec, prometheus::Error> {
        self.register(HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
            labels,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_help_and_the_prefix() {
        let metrics = Metrics::new().unwrap();
        metrics
            .requests
            .with_label_values(&["healthz", "200"])
            .inc();
        metrics
            .request_duration
            .with_label_values(&["healthz", NO_LABEL, NO_LABEL])
            .observe(0.001);
        metrics
            .upstream_duration
            .with_label_values(&["default", NO_LABEL, "default"])
            .observe(0.001);
        metrics
            .upstream_errors
            .with_label_values(&["default", "connect"])
            .inc();
        for family in metrics.registry.gather() {
            assert!(family.name().starts_with("ctxproxy_"), "{}", family.name());
            assert!(!family.help().is_empty(), "{}", family.name());
        }
        assert!(metrics.render().contains("ctxproxy_in_flight_requests 0"));
    }
}
