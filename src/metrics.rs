//! Every Prometheus metric ctxproxy exports, defined in one place on a registry that is passed
//! down (no global statics). Label values come only from closed sets or configured names.

use prometheus::{
    CounterVec, Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::config::Config;
use crate::glob::glob_match;

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

/// More models than this are labelled `other` (labels stay bounded whatever the config says).
const MAX_MODEL_LABELS: usize = 50;

impl ModelLabels {
    pub fn new(config: &Config) -> ModelLabels {
        let mut names: Vec<String> = config
            .routes
            .iter()
            .flat_map(|r| r.patterns.iter().cloned())
            .chain(config.prices.keys().cloned())
            .collect();
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
    /// `route` ∈ chat_completions, passthrough, healthz, readyz, metrics, not_found.
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub upstream_duration: HistogramVec,
    /// `kind` ∈ connect, timeout, body.
    pub upstream_errors: IntCounterVec,
    pub in_flight: IntGauge,
    pub open_connections: IntGauge,
    pub connections_refused: IntCounter,
    pub cache_too_large: IntCounter,
    pub build_info: IntGaugeVec,
    /// `phase` ∈ original, sent.
    pub prompt_tokens: IntCounterVec,
    /// `stage` ∈ the pipeline's stage names.
    pub tokens_saved: IntCounterVec,
    pub tokens_saveable: IntCounterVec,
    pub pipeline_duration: Histogram,
    /// `outcome` ∈ fit, rejected, over_floor.
    pub budget_outcomes: IntCounterVec,
    pub tools: IntCounterVec,
    pub tool_filter_decisions: IntCounterVec,
    pub cache_requests: IntCounterVec,
    pub cache_tokens_saved: IntCounterVec,
    pub cache_lookup_duration: Histogram,
    pub store_errors: IntCounterVec,
    pub store_up: IntGauge,
    /// Chat completions by `model`, `tenant`, HTTP `status` and `cache` result.
    pub chat_requests: IntCounterVec,
    /// `usage` reported by the upstream: `kind` ∈ prompt, completion, cached_prompt.
    pub usage_tokens: IntCounterVec,
    /// `source` ∈ pipeline, cache.
    pub cost_saved_usd: CounterVec,
    /// What rewrites cost more than the originals would have (a broken cached prefix).
    pub cost_added_usd: CounterVec,
    pub stream_first_byte: HistogramVec,
    /// `method` ∈ cleared, json, text.
    pub compactions: IntCounterVec,
    /// Exchanges written to the `[record]` file.
    pub records_written: IntCounter,
    /// `reason` ∈ queue_full, write_error, writer_stopped.
    pub record_dropped: IntCounterVec,
    /// `outcome` ∈ completed, max_attempts, budget, error.
    pub continuations: IntCounterVec,
    /// `repair` ∈ off, repaired, failed.
    pub action_claims: IntCounterVec,
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
        let requests = IntCounterVec::new(
            Opts::new(
                "ctxproxy_requests_total",
                "HTTP requests to ctxproxy, by route and HTTP status (499: the client left before the response headers).",
            ),
            &["route", "status"],
        )?;
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "ctxproxy_request_duration_seconds",
                "Time from receiving a request to the end of its response body (streams included).",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["route"],
        )?;
        let upstream_duration = HistogramVec::new(
            HistogramOpts::new(
                "ctxproxy_upstream_duration_seconds",
                "Time from sending a request upstream to the end of the upstream's response body.",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["upstream"],
        )?;
        let upstream_errors = IntCounterVec::new(
            Opts::new(
                "ctxproxy_upstream_errors_total",
                "Upstream calls that failed without an HTTP response, by kind (connect, timeout, body).",
            ),
            &["upstream", "kind"],
        )?;
        let in_flight = IntGauge::new(
            "ctxproxy_in_flight_requests",
            "Requests being served right now, streams included.",
        )?;
        let open_connections = IntGauge::new(
            "ctxproxy_open_connections",
            "Client connections open right now (at most server.max_connections).",
        )?;
        let cache_too_large = IntCounter::new(
            "ctxproxy_cache_too_large_total",
            "Answers relayed but not stored in a cache: larger than cache.max_entry_bytes.",
        )?;
        let connections_refused = IntCounter::new(
            "ctxproxy_connections_refused_total",
            "Client connections closed at once: server.max_connections were open.",
        )?;
        let build_info = IntGaugeVec::new(
            Opts::new(
                "ctxproxy_build_info",
                "Always 1; the version of the running binary.",
            ),
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let prompt_tokens = IntCounterVec::new(
            Opts::new(
                "ctxproxy_prompt_tokens_total",
                "Prompt tokens of chat requests as received (phase=original) and as sent upstream (phase=sent).",
            ),
            &["phase", "model", "tenant"],
        )?;
        let tokens_saved = IntCounterVec::new(
            Opts::new(
                "ctxproxy_tokens_saved_total",
                "Prompt tokens removed by each pipeline stage on requests sent optimized.",
            ),
            &["stage", "model", "tenant"],
        )?;
        let tokens_saveable = IntCounterVec::new(
            Opts::new(
                "ctxproxy_observe_tokens_saveable_total",
                "Prompt tokens each pipeline stage would have removed from requests forwarded unchanged in observe mode.",
            ),
            &["stage", "model", "tenant"],
        )?;
        let pipeline_duration = Histogram::with_opts(
            HistogramOpts::new(
                "ctxproxy_pipeline_duration_seconds",
                "Time spent rewriting a chat request (the proxy's own overhead on the request path).",
            )
            .buckets(PIPELINE_BUCKETS.to_vec()),
        )?;
        let budget_outcomes = IntCounterVec::new(
            Opts::new(
                "ctxproxy_budget_outcomes_total",
                "Token budget outcomes: fit (within budget), over_floor (the floor of system, tools, working set and ledger alone is over the budget: sent, flagged with X-Ctxproxy-Over-Budget), rejected (400, with on_exceed = \"reject\").",
            ),
            &["outcome", "model", "tenant"],
        )?;

        let tools = IntCounterVec::new(
            Opts::new(
                "ctxproxy_tools_total",
                "Tool definitions of optimized chat requests as offered by the client (phase=offered) and as sent upstream (phase=sent).",
            ),
            &["phase"],
        )?;
        let tool_filter_decisions = IntCounterVec::new(
            Opts::new(
                "ctxproxy_tool_filter_decisions_total",
                "Why the tools stage kept what it kept: match, sticky, no_match_drop, no_match_keep, protected, small_block (sent whole: under [tools] min_tool_tokens).",
            ),
            &["reason"],
        )?;
        let cache_requests = IntCounterVec::new(
            Opts::new(
                "ctxproxy_cache_requests_total",
                "Cache lookups by cache (deterministic, dedup) and result (hit, miss, bypass, error).",
            ),
            &["cache", "result", "model", "tenant"],
        )?;
        let cache_tokens_saved = IntCounterVec::new(
            Opts::new(
                "ctxproxy_cache_tokens_saved_total",
                "Tokens not spent thanks to cache hits, from the stored usage: kind=prompt|completion.",
            ),
            &["kind", "model", "tenant"],
        )?;
        let cache_lookup_duration = Histogram::with_opts(
            HistogramOpts::new(
                "ctxproxy_cache_lookup_duration_seconds",
                "Time of one cache lookup in the store.",
            )
            .buckets(PIPELINE_BUCKETS.to_vec()),
        )?;
        let store_errors = IntCounterVec::new(
            Opts::new(
                "ctxproxy_store_errors_total",
                "Store operations that failed or timed out (each treated as a miss), by operation.",
            ),
            &["op"],
        )?;
        let chat_requests = IntCounterVec::new(
            Opts::new(
                "ctxproxy_chat_requests_total",
                "Chat completion requests by model, tenant, HTTP status and cache result (hit, dedup, miss, bypass; none when no cache was consulted).",
            ),
            &["model", "tenant", "status", "cache"],
        )?;
        let usage_tokens = IntCounterVec::new(
            Opts::new(
                "ctxproxy_usage_tokens_total",
                "Tokens the upstream reported in `usage` (streams included): kind=prompt|completion|cached_prompt.",
            ),
            &["kind", "model", "tenant"],
        )?;
        let cost_saved_usd = CounterVec::new(
            Opts::new(
                "ctxproxy_cost_saved_usd_total",
                "Estimated US dollars not spent, from [prices]: source=pipeline (the original's input bill minus the rewrite's, cached prices counted) or cache (hits' stored usage).",
            ),
            &["source", "model", "tenant"],
        )?;
        let cost_added_usd = CounterVec::new(
            Opts::new(
                "ctxproxy_cost_added_usd_total",
                "Estimated US dollars a rewrite cost more than the original would have (it broke a prefix the provider had cached); the pipeline's net saving is ctxproxy_cost_saved_usd_total{source=\"pipeline\"} minus this.",
            ),
            &["model", "tenant"],
        )?;
        let stream_first_byte = HistogramVec::new(
            HistogramOpts::new(
                "ctxproxy_stream_first_byte_seconds",
                "Streams: time from receiving the request to the first event from the upstream.",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["upstream"],
        )?;
        let compactions = IntCounterVec::new(
            Opts::new(
                "ctxproxy_compactions_total",
                "Tool results compacted by the compact stage, by method: cleared (older result replaced by a note), json, text.",
            ),
            &["method"],
        )?;
        let records_written = IntCounter::new(
            "ctxproxy_records_written_total",
            "Exchanges written to the [record] file.",
        )?;
        let record_dropped = IntCounterVec::new(
            Opts::new(
                "ctxproxy_record_dropped_total",
                "Sampled exchanges not recorded, by reason: queue_full (the writer is behind; the request was not slowed), write_error, writer_stopped.",
            ),
            &["reason"],
        )?;
        let continuations = IntCounterVec::new(
            Opts::new(
                "ctxproxy_continuations_total",
                "Answers cut at the length limit that ctxproxy continued, by outcome: completed (the last part ended by itself), max_attempts, budget (the next request would exceed the token budget), error (a continuation call failed; the cut answer was returned).",
            ),
            &["outcome"],
        )?;
        let action_claims = IntCounterVec::new(
            Opts::new(
                "ctxproxy_action_claims_without_tool_call_total",
                "Answers to requests with tools that claim an action without calling any tool, by repair: off (retry not configured, or a stream), repaired (the retry called a tool and was returned), failed.",
            ),
            &["repair"],
        )?;
        let store_up = IntGauge::new(
            "ctxproxy_store_up",
            "1 while the configured store answers (Redis reachable, or the memory backend); 0 while Redis is down and memory serves instead.",
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(request_duration.clone()))?;
        registry.register(Box::new(upstream_duration.clone()))?;
        registry.register(Box::new(upstream_errors.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(open_connections.clone()))?;
        registry.register(Box::new(connections_refused.clone()))?;
        registry.register(Box::new(cache_too_large.clone()))?;
        registry.register(Box::new(build_info.clone()))?;
        registry.register(Box::new(prompt_tokens.clone()))?;
        registry.register(Box::new(tokens_saved.clone()))?;
        registry.register(Box::new(tokens_saveable.clone()))?;
        registry.register(Box::new(pipeline_duration.clone()))?;
        registry.register(Box::new(budget_outcomes.clone()))?;
        registry.register(Box::new(tools.clone()))?;
        registry.register(Box::new(tool_filter_decisions.clone()))?;
        registry.register(Box::new(cache_requests.clone()))?;
        registry.register(Box::new(cache_tokens_saved.clone()))?;
        registry.register(Box::new(cache_lookup_duration.clone()))?;
        registry.register(Box::new(store_errors.clone()))?;
        registry.register(Box::new(store_up.clone()))?;
        registry.register(Box::new(chat_requests.clone()))?;
        registry.register(Box::new(usage_tokens.clone()))?;
        registry.register(Box::new(cost_saved_usd.clone()))?;
        registry.register(Box::new(cost_added_usd.clone()))?;
        registry.register(Box::new(stream_first_byte.clone()))?;
        registry.register(Box::new(compactions.clone()))?;
        registry.register(Box::new(records_written.clone()))?;
        registry.register(Box::new(record_dropped.clone()))?;
        registry.register(Box::new(continuations.clone()))?;
        registry.register(Box::new(action_claims.clone()))?;
        Ok(Metrics {
            continuations,
            action_claims,
            records_written,
            record_dropped,
            chat_requests,
            usage_tokens,
            cost_saved_usd,
            cost_added_usd,
            stream_first_byte,
            compactions,
            prompt_tokens,
            tokens_saved,
            tokens_saveable,
            pipeline_duration,
            budget_outcomes,
            tools,
            tool_filter_decisions,
            cache_requests,
            cache_tokens_saved,
            cache_lookup_duration,
            store_errors,
            store_up,
            registry,
            requests,
            request_duration,
            upstream_duration,
            upstream_errors,
            in_flight,
            open_connections,
            connections_refused,
            cache_too_large,
            build_info,
        })
    }

    /// Creates the series of closed label sets at zero, so that every metric is exported from
    /// the start and `rate()` sees the first increase.
    pub fn initialize(&self, config: &Config) {
        for op in ["get", "set", "delete", "push", "list", "ping"] {
            self.store_errors.with_label_values(&[op]);
        }
        for upstream in &config.upstreams {
            for kind in ["connect", "request", "timeout", "body"] {
                self.upstream_errors
                    .with_label_values(&[upstream.name.as_str(), kind]);
            }
        }
        for reason in [
            "match",
            "sticky",
            "no_match_drop",
            "no_match_keep",
            "protected",
            "small_block",
        ] {
            self.tool_filter_decisions.with_label_values(&[reason]);
        }
        for phase in ["offered", "sent"] {
            self.tools.with_label_values(&[phase]);
        }
        // Rare by design: exported at zero for the dashboard's net saving.
        self.cost_added_usd.with_label_values(&["other", "default"]);
        for method in ["cleared", "json", "text"] {
            self.compactions.with_label_values(&[method]);
        }
        for reason in ["queue_full", "write_error", "writer_stopped"] {
            self.record_dropped.with_label_values(&[reason]);
        }
        for outcome in ["completed", "max_attempts", "budget", "error"] {
            self.continuations.with_label_values(&[outcome]);
        }
        for repair in ["off", "repaired", "failed"] {
            self.action_claims.with_label_values(&[repair]);
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
            .with_label_values(&["healthz"])
            .observe(0.001);
        metrics
            .upstream_duration
            .with_label_values(&["default"])
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
