//! The token metrics against what was really sent: a mix of requests (optimized, observed,
//! cache hits, dedup hits, streamed, failed, over budget) through the proxy, then `/metrics`
//! compared with the response headers and the usage the mock reported.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Proxy, client, long_conversation, metric_sum, proxy_for, start_mock};
use ctxproxy::mock_upstream::MockOptions;
use serde_json::{Value, json};

async fn send(url: &str, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client().post(url).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

fn header(response: &reqwest::Response, name: &str) -> String {
    response
        .headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

fn counts(response: &reqwest::Response) -> (u64, u64) {
    let number = |name: &str| header(response, name).parse::<u64>().unwrap();
    (
        number("x-ctxproxy-tokens-before"),
        number("x-ctxproxy-tokens-after"),
    )
}

/// Usage (prompt, completion) of an answer: JSON, or the usage event of an SSE body.
fn usage_of(body: &str) -> Option<(u64, u64)> {
    let usage = |v: &Value| {
        let u = v.get("usage").filter(|u| u.is_object())?;
        Some((
            u["prompt_tokens"].as_u64().unwrap(),
            u["completion_tokens"].as_u64().unwrap(),
        ))
    };
    match serde_json::from_str::<Value>(body) {
        Ok(value) => usage(&value),
        Err(_) => body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| usage(&v)),
    }
}

fn add_usage(total: &mut (u64, u64), body: &str) {
    let (prompt, completion) = usage_of(body).expect("an answer with usage");
    *total = (total.0 + prompt, total.1 + completion);
}

/// Dedup on, and a price for gpt-4o (2.50 USD per million input tokens).
const CONFIG: &str = "[cache.dedup]\nenabled = true\n[prices]\n\"gpt-4o\" = { input = 2.5, output = 10.0 }\n[pipeline.budget]\non_exceed = \"reject\"\n";

/// What the mix sent: the sum of the tokens-before − after headers, and the usage the upstream
/// reported (prompt, completion).
struct Sent {
    saved: u64,
    /// Of `saved`, what the deterministic hit saved.
    hit_saved: u64,
    usage: (u64, u64),
}

/// A mix of requests: optimized (a miss, then a deterministic hit), observed, a question and
/// its paraphrase (dedup hit), two streams, an upstream failure, one over budget.
async fn drive_mix(proxy: &Proxy) -> Sent {
    let url = proxy.url("/v1/chat/completions");
    let (mut saved, mut usage) = (0_u64, (0_u64, 0_u64));

    // Optimized, twice at temperature 0: a miss, then a deterministic hit (upstream not called).
    let mut long = long_conversation();
    long["temperature"] = json!(0);
    let first = send(&url, &long, &[]).await;
    let (before, after) = counts(&first);
    assert!(after < before);
    saved += before - after;
    add_usage(&mut usage, &first.text().await.unwrap());
    let mut hit = None;
    for _ in 0..100 {
        let again = send(&url, &long, &[]).await;
        if header(&again, "x-ctxproxy-cache") == "hit" {
            hit = Some(counts(&again));
            break;
        }
        let (b, a) = counts(&again);
        saved += b - a;
        add_usage(&mut usage, &again.text().await.unwrap());
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (b, a) = hit.expect("never a cache hit");
    saved += b - a;
    // A hit never reaches the upstream: its saving is the cache's, not priced as the pipeline's.
    let hit_saved = b - a;

    // Observed: sent as received; nothing counts as saved.
    let observed = send(
        &url,
        &long_conversation(),
        &[
            ("x-ctxproxy-mode", "observe"),
            ("cache-control", "no-cache"),
        ],
    )
    .await;
    assert_eq!(observed.status(), 200);
    add_usage(&mut usage, &observed.text().await.unwrap());

    // A question, then a paraphrase answered by the dedup cache.
    let ask = |text: &str| {
        json!({"model": "gpt-4o", "temperature": 0.7, "messages": [
            {"role": "user", "content": text}]})
    };
    let asked = send(&url, &ask("How do I rotate my API key?"), &[]).await;
    let (b, a) = counts(&asked);
    saved += b - a;
    add_usage(&mut usage, &asked.text().await.unwrap());
    let mut dedup = false;
    for _ in 0..100 {
        let again = send(&url, &ask("How can I rotate my API key"), &[]).await;
        let (b, a) = counts(&again);
        saved += b - a;
        if header(&again, "x-ctxproxy-cache") == "dedup" {
            dedup = true;
            break;
        }
        add_usage(&mut usage, &again.text().await.unwrap());
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(dedup, "never a dedup hit");

    // Streamed without include_usage: the client gets no usage event, the metric counts it.
    let mut stream = ask("Tell me a story about a lighthouse.");
    stream["stream"] = json!(true);
    let streamed = send(&url, &stream, &[]).await;
    let (b, a) = counts(&streamed);
    saved += b - a;
    let text = streamed.text().await.unwrap();
    assert!(text.contains("data: [DONE]"));
    assert_eq!(
        usage_of(&text),
        None,
        "usage leaked to a client that did not ask"
    );
    // The same stream asking for usage shows what the upstream reported for it.
    stream["stream_options"] = json!({"include_usage": true});
    let with_usage = send(&url, &stream, &[("cache-control", "no-cache")]).await;
    let (b, a) = counts(&with_usage);
    saved += b - a;
    let text = with_usage.text().await.unwrap();
    add_usage(&mut usage, &text);
    add_usage(&mut usage, &text);

    // A failed upstream call and a request over budget.
    let failed = send(&url, &ask("hello"), &[("x-mock-status", "503")]).await;
    assert_eq!(failed.status(), 503);
    let (b, a) = counts(&failed);
    saved += b - a;
    let rejected = send(&url, &long_conversation(), &[("x-ctxproxy-budget", "20")]).await;
    assert_eq!(rejected.status(), 400);
    Sent {
        saved,
        hit_saved,
        usage,
    }
}

#[tokio::test]
async fn metrics_match_what_was_sent_and_what_the_upstream_reported() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, CONFIG).await;
    let Sent {
        saved,
        hit_saved,
        usage,
    } = drive_mix(&proxy).await;
    let metrics = proxy.metrics().await;
    let value = |name: &str, labels: &[(&str, &str)]| metric_sum(&metrics, name, labels);
    assert_eq!(value("ctxproxy_tokens_saved_total", &[]) as u64, saved);
    assert_eq!(
        value("ctxproxy_usage_tokens_total", &[("kind", "prompt")]) as u64,
        usage.0
    );
    assert_eq!(
        value("ctxproxy_usage_tokens_total", &[("kind", "completion")]) as u64,
        usage.1
    );
    let requests = |labels: &[(&str, &str)]| {
        let mut all = vec![("model", "gpt-4o"), ("tenant", "default")];
        all.extend_from_slice(labels);
        value("ctxproxy_chat_requests_total", &all) as u64
    };
    assert_eq!(requests(&[("cache", "hit"), ("status", "200")]), 1);
    assert_eq!(requests(&[("cache", "dedup"), ("status", "200")]), 1);
    assert_eq!(requests(&[("status", "503")]), 1);
    assert_eq!(requests(&[("status", "400"), ("cache", "none")]), 1);
    assert_eq!(
        value(
            "ctxproxy_budget_outcomes_total",
            &[("outcome", "rejected"), ("model", "gpt-4o")]
        ),
        1.0
    );
    // gpt-4o input at 2.50 USD per million tokens, no cached price: only the tokens count, for
    // the requests the upstream answered.
    let pipeline_usd = value("ctxproxy_cost_saved_usd_total", &[("source", "pipeline")]);
    let expected = (saved - hit_saved) as f64 * 2.5 / 1e6;
    assert!(
        (pipeline_usd - expected).abs() < 1e-9,
        "{pipeline_usd} vs {expected}"
    );
    assert!(value("ctxproxy_cost_saved_usd_total", &[("source", "cache")]) > 0.0);
    assert_eq!(value("ctxproxy_stream_first_byte_seconds_count", &[]), 2.0);
    assert!(value("ctxproxy_compactions_total", &[]) > 0.0);
}

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every PromQL expression of the dashboard (panel targets and variable queries).
fn dashboard_queries() -> Vec<String> {
    let dashboard: Value =
        serde_json::from_str(&repo_file("grafana/dashboards/ctxproxy.json")).unwrap();
    let mut queries: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().unwrap().to_owned())
        .collect();
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(definition) = variable["definition"].as_str() {
            queries.push(definition.to_owned());
        }
    }
    assert!(queries.len() > 20, "{} queries", queries.len());
    queries
}

fn alert_queries() -> Vec<String> {
    let rules: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&repo_file("deploy/prometheus/alerts.yml")).unwrap();
    rules["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().cloned().unwrap_or_default())
        .map(|r| r["expr"].as_str().unwrap().to_owned())
        .collect()
}

/// The `ctxproxy_*` metric names an expression reads.
fn metric_names(expr: &str) -> Vec<String> {
    expr.match_indices("ctxproxy_")
        .map(|(i, _)| {
            expr[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[tokio::test]
async fn every_metric_of_the_dashboard_and_the_alerts_is_exported() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, CONFIG).await;
    drive_mix(&proxy).await;
    let exported: std::collections::BTreeSet<String> = proxy
        .metrics()
        .await
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next().map(str::to_owned))
        .collect();
    let queries = [dashboard_queries(), alert_queries()].concat();
    for query in &queries {
        let names = metric_names(query);
        assert!(!names.is_empty(), "no ctxproxy metric in {query}");
        for name in names {
            assert!(
                exported.contains(&name),
                "{name} (in {query}) is not exported"
            );
        }
    }
}

/// A dashboard query as Grafana sends it, its variables filled.
fn as_sent(query: &str) -> String {
    query
        .replace("$__rate_interval", "1m")
        .replace("$__range", "5m")
        .replace("$tenant", ".*")
        .replace("$model", ".*")
}

async fn prometheus_query(base: &str, query: &str) -> Value {
    let encoded: String = query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect();
    let response = client()
        .get(format!("{base}/api/v1/query?query={encoded}"))
        .send()
        .await
        .unwrap();
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["status"], "success", "{query}: {body}");
    body["data"]["result"].clone()
}

/// `prometheus` scraping the proxy during traffic answers every dashboard query with data.
/// Needs CTXPROXY_TEST_PROMETHEUS (the test command installs the Debian package).
#[tokio::test]
async fn a_real_prometheus_answers_every_dashboard_query() {
    let binary = std::env::var("CTXPROXY_TEST_PROMETHEUS")
        .expect("CTXPROXY_TEST_PROMETHEUS: the prometheus binary (set by scripts/test.sh)");
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, CONFIG).await;
    let dir = std::env::temp_dir().join(format!("ctxproxy-prometheus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             scrape_configs:\n  - job_name: ctxproxy\n    static_configs:\n      - targets: ['{}']\n",
            proxy.addr
        ),
    )
    .unwrap();
    let port = common::closed_port().await;
    let base = format!("http://127.0.0.1:{port}");
    let _prometheus = tokio::process::Command::new(binary)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Traffic while Prometheus scrapes: a first scrape, the mix, then scrapes after it.
    let scrapes = "count_over_time(up{job=\"ctxproxy\"}[5m])";
    let mut ready = false;
    for _ in 0..100 {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        if let Ok(response) = client().get(format!("{base}/-/ready")).send().await
            && response.status() == 200
        {
            ready = true;
            break;
        }
    }
    assert!(ready, "prometheus did not start");
    drive_mix(&proxy).await;
    let mut scraped = 0.0;
    for _ in 0..50 {
        let result = prometheus_query(&base, scrapes).await;
        scraped = result[0]["value"][1]
            .as_str()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        if scraped >= 3.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    assert!(scraped >= 3.0, "only {scraped} scrapes");
    for query in dashboard_queries() {
        let sent = as_sent(&query);
        let result = if sent.starts_with("label_values(") {
            let (metric, label) = sent["label_values(".len()..sent.len() - 1]
                .split_once(", ")
                .unwrap();
            prometheus_query(&base, &format!("count by ({label}) ({metric})")).await
        } else {
            prometheus_query(&base, &sent).await
        };
        assert!(
            result.as_array().is_some_and(|r| !r.is_empty()),
            "no data for {sent}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `promtool` accepts the shipped alert rules and Prometheus config.
#[test]
fn promtool_accepts_the_shipped_rules_and_config() {
    let promtool = std::env::var("CTXPROXY_TEST_PROMTOOL")
        .expect("CTXPROXY_TEST_PROMTOOL: the promtool binary (set by scripts/test.sh)");
    let root = env!("CARGO_MANIFEST_DIR");
    for (what, file) in [
        ("rules", "deploy/prometheus/alerts.yml"),
        ("config", "deploy/prometheus/prometheus.yml"),
    ] {
        let mut command = std::process::Command::new(&promtool);
        command.args(["check", what]);
        if what == "config" {
            // The rule file is mounted at /etc/prometheus in containers: check the syntax only.
            command.arg("--syntax-only");
        }
        let output = command.arg(format!("{root}/{file}")).output().unwrap();
        assert!(
            output.status.success(),
            "promtool check {what} {file}:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// The provider's prompt cache as the upstream reports it (`prompt_tokens_details`): the mock
/// caches a conversation's common prefix, and the proxy exports what it reported.
#[tokio::test]
async fn the_providers_cached_prompt_tokens_are_exported() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let policy = "Follow the airline policy exactly and verify the user first. ".repeat(120);
    let mut messages = vec![
        json!({"role": "system", "content": policy}),
        json!({"role": "user", "content": "Hi, I want to change my flight."}),
    ];
    let mut cached = Vec::new();
    for turn in 0..2 {
        let body = json!({"model": "gpt-4o", "messages": messages});
        let response = send(
            &proxy.url("/v1/chat/completions"),
            &body,
            &[("x-conversation-id", "cache-conv")],
        )
        .await;
        let answer: Value = response.json().await.unwrap();
        cached.push(
            answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
        messages.push(json!({"role": "assistant", "content": format!("Answer {turn}.")}));
        messages.push(json!({"role": "user", "content": "And the fee?"}));
    }
    assert_eq!(cached[0], 0, "a conversation's first request");
    assert!(cached[1] >= 1024, "{cached:?}");
    let exported = proxy
        .metric("ctxproxy_usage_tokens_total", &[("kind", "cached_prompt")])
        .await;
    assert_eq!(exported, cached[1] as f64);
}

/// `ctxproxy_cost_saved_usd_total{source="pipeline"}` prices what a rewrite saved with the cached
/// price: the original as cached as far as the client's previous request reached (the provider's
/// rule), the rewrite as cached as the upstream's usage says; a loss goes to
/// `ctxproxy_cost_added_usd_total`.
#[tokio::test]
async fn the_pipelines_saving_is_priced_with_the_cached_price() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(
        &mock,
        "[prices]\n\"gpt-4o\" = { input = 2.5, cached_input = 1.25, output = 10.0 }\n",
    )
    .await;
    let policy = "Follow the airline policy exactly and verify the user first. ".repeat(120);
    let mut messages = vec![
        json!({"role": "system", "content": policy}),
        json!({"role": "user", "content": "Hi, I want to change my flight."}),
    ];
    let (mut saved, mut added) = (0.0_f64, 0.0_f64);
    let mut previous_before: Option<u64> = None;
    // Each request of an agent loop: the user's, then the tool result's.
    for step in 0..8 {
        let turn = step / 2;
        let body = json!({"model": "gpt-4o", "messages": messages});
        let response = send(
            &proxy.url("/v1/chat/completions"),
            &body,
            &[("x-conversation-id", "priced-conv")],
        )
        .await;
        let (before, after) = counts(&response);
        let answer: Value = response.json().await.unwrap();
        let sent_cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        if after < before {
            let original_cached = previous_before.map_or(0, |p| {
                let p = p.min(before);
                if p < 1024 { 0 } else { p / 128 * 128 }
            });
            let bill = |tokens: u64, cached: u64| {
                ((tokens - cached) as f64 * 2.5 + cached as f64 * 1.25) / 1e6
            };
            let usd = bill(before, original_cached) - bill(after, sent_cached.min(after));
            if usd > 0.0 {
                saved += usd;
            } else {
                added -= usd;
            }
        }
        previous_before = Some(before);
        if step % 2 == 0 {
            // A pretty-printed JSON tool result: the rewrite re-encodes it without whitespace.
            let id = format!("call_{turn}");
            messages.push(
                json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
                "type": "function", "function": {"name": "get_reservation", "arguments": "{}"}}]}),
            );
            let result = json!({"reservation_id": format!("R{turn}00"), "flights": [{"number": "HAT170", "date": "2024-05-01"}]});
            messages.push(json!({"role": "tool", "tool_call_id": id,
                "content": serde_json::to_string_pretty(&result).unwrap()}));
        } else {
            messages.push(json!({"role": "assistant", "content": format!("Answer {turn}.")}));
            messages.push(json!({"role": "user", "content": "And the fee?"}));
        }
    }
    assert!(saved > 0.0, "{saved}");
    let metric = |name: &'static str, labels: &'static [(&'static str, &'static str)]| {
        let proxy = &proxy;
        async move { proxy.metric(name, labels).await }
    };
    let exported = metric("ctxproxy_cost_saved_usd_total", &[("source", "pipeline")]).await;
    assert!((exported - saved).abs() < 1e-12, "{exported} vs {saved}");
    let exported = metric("ctxproxy_cost_added_usd_total", &[]).await;
    assert!((exported - added).abs() < 1e-12, "{exported} vs {added}");
}
