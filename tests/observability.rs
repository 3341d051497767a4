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
    // What the answers cost: their usage at the price (no cached price: cached tokens at the
    // input price).
    let spent = value(
        "ctxproxy_cost_usd_total",
        &[("model", "gpt-4o"), ("tenant", "default")],
    );
    let expected = (usage.0 as f64 * 2.5 + usage.1 as f64 * 10.0) / 1e6;
    assert!((spent - expected).abs() < 1e-9, "{spent} vs {expected}");
    // Latencies carry the model and the tenant, for the dashboard's variables.
    let gpt_4o = [("model", "gpt-4o"), ("tenant", "default")];
    for (name, extra, count) in [
        (
            "ctxproxy_stream_first_byte_seconds_count",
            ("upstream", "default"),
            Some(2.0),
        ),
        (
            "ctxproxy_request_duration_seconds_count",
            ("route", "chat_completions"),
            None,
        ),
        (
            "ctxproxy_upstream_duration_seconds_count",
            ("upstream", "default"),
            None,
        ),
        (
            "ctxproxy_pipeline_duration_seconds_count",
            ("tenant", "default"),
            None,
        ),
        (
            "ctxproxy_cache_lookup_duration_seconds_count",
            ("cache", "dedup"),
            None,
        ),
    ] {
        let mut labels = gpt_4o.to_vec();
        labels.push(extra);
        let observed = value(name, &labels);
        match count {
            Some(count) => assert_eq!(observed, count, "{name}"),
            None => assert!(observed > 0.0, "{name} {labels:?}"),
        }
    }
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

/// Every rule of the shipped alert rules.
fn alert_rules() -> Vec<serde_yaml_ng::Value> {
    let rules: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&repo_file("deploy/prometheus/alerts.yml")).unwrap();
    rules["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().cloned().unwrap_or_default())
        .collect()
}

fn alert_queries() -> Vec<String> {
    alert_rules()
        .iter()
        .map(|r| r["expr"].as_str().unwrap().to_owned())
        .collect()
}

/// The queries that read Prometheus's own scrape health rather than a ctxproxy metric.
const SCRAPE_HEALTH: &str = "up{job=\"ctxproxy\"}";

/// GitHub's anchor of a Markdown heading: lowercase, spaces to `-`, other punctuation dropped.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every panel says what it shows (Grafana's hover text), and every alert links to its
/// runbook: a section of deploy/README.md that exists.
#[test]
fn every_panel_has_a_description_and_every_alert_a_runbook() {
    let dashboard: Value =
        serde_json::from_str(&repo_file("grafana/dashboards/ctxproxy.json")).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    let undescribed: Vec<&str> = panels
        .iter()
        .filter(|p| p["type"] != "row")
        .filter(|p| {
            p["description"]
                .as_str()
                .is_none_or(|d| d.trim().is_empty())
        })
        .map(|p| p["title"].as_str().unwrap_or("?"))
        .collect();
    assert!(
        undescribed.is_empty(),
        "panels without a description: {undescribed:?}"
    );
    let mut ids: Vec<u64> = panels.iter().map(|p| p["id"].as_u64().unwrap()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), panels.len(), "panel ids are not unique");

    let runbook = repo_file("deploy/README.md");
    let anchors: Vec<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| anchor_of(l.trim_start_matches('#')))
        .collect();
    let rules = alert_rules();
    assert!(rules.len() >= 8, "{} rules", rules.len());
    for rule in &rules {
        let name = rule["alert"].as_str().expect("an alerting rule");
        let url = rule["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} has no runbook_url"));
        let (page, anchor) = url
            .split_once('#')
            .unwrap_or_else(|| panic!("{name}: {url} names no section"));
        assert!(
            page.starts_with("https://") && page.ends_with("/deploy/README.md"),
            "{name}: {url}"
        );
        assert_eq!(anchor, name.to_lowercase(), "{name}: its own section");
        assert!(
            anchors.iter().any(|a| a == anchor),
            "{name}: deploy/README.md has no section #{anchor}"
        );
        for key in ["summary", "description"] {
            assert!(
                rule["annotations"][key].as_str().is_some(),
                "{name} has no {key}"
            );
        }
    }
    // The proxy down or gone, and errors on every route (not only chat).
    let expr = |name: &str| {
        rules
            .iter()
            .find(|r| r["alert"] == name)
            .and_then(|r| r["expr"].as_str())
            .unwrap_or_else(|| panic!("no alert {name}"))
            .to_owned()
    };
    assert!(expr("ctxproxyDown").contains("up{job=\"ctxproxy\"} == 0"));
    assert!(expr("ctxproxyAbsent").contains("absent("));
    let errors = expr("ctxproxyHighErrorRate");
    assert!(
        errors.contains("ctxproxy_requests_total") && errors.contains("by (route)"),
        "{errors}"
    );
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
        assert!(
            !names.is_empty() || query.contains(SCRAPE_HEALTH),
            "no ctxproxy metric in {query}"
        );
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

/// Polls `query` until its result satisfies `done`; returns the last result.
async fn wait_for_query(base: &str, query: &str, done: impl Fn(&Value) -> bool) -> Value {
    let mut result = Value::Null;
    for _ in 0..120 {
        result = prometheus_query(base, query).await;
        if done(&result) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    result
}

/// The first sample value of a query's result, or 0.
fn first_value(result: &Value) -> f64 {
    result[0]["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Requests to another `/v1/*` route (embeddings) that the upstream fails with a 500.
async fn failing_passthrough(proxy: &Proxy, count: usize) {
    for _ in 0..count {
        let response = send(
            &proxy.url("/v1/embeddings"),
            &json!({"model": "text-embedding-3-small", "input": "hello"}),
            &[("x-mock-embeddings-status", "500")],
        )
        .await;
        assert_eq!(response.status(), 500);
    }
}

/// `prometheus` scraping the proxy during traffic answers every dashboard query with data, and
/// evaluates the shipped alert rules: every rule without error, `ctxproxyDown` pending for a
/// replica that does not answer, `ctxproxyHighErrorRate` pending for 5xx on a route other than
/// chat. Needs CTXPROXY_TEST_PROMETHEUS (the test command installs the Debian package).
#[tokio::test]
async fn a_real_prometheus_answers_every_dashboard_query() {
    let binary = std::env::var("CTXPROXY_TEST_PROMETHEUS")
        .expect("CTXPROXY_TEST_PROMETHEUS: the prometheus binary (set by scripts/test.sh)");
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, CONFIG).await;
    let dir = std::env::temp_dir().join(format!("ctxproxy-prometheus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    // A second replica that does not answer: ctxproxyDown's case.
    let down = format!("127.0.0.1:{}", common::closed_port().await);
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             rule_files: ['{}/deploy/prometheus/alerts.yml']\n\
             scrape_configs:\n  - job_name: ctxproxy\n    static_configs:\n      - targets: ['{}', '{down}']\n",
            env!("CARGO_MANIFEST_DIR"),
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
    // 5xx on the passthrough route, before and after a scrape (a rate needs an increase).
    let failed = "sum(ctxproxy_requests_total{route=\"passthrough\", status=\"500\"})";
    failing_passthrough(&proxy, 3).await;
    let result = wait_for_query(&base, failed, |r| first_value(r) >= 3.0).await;
    assert!(first_value(&result) >= 3.0, "{result}");
    failing_passthrough(&proxy, 3).await;
    let result = wait_for_query(&base, failed, |r| first_value(r) >= 6.0).await;
    assert!(first_value(&result) >= 6.0, "{result}");
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
    let (rules, pending) = alerts_after_evaluation(&base).await;
    assert_eq!(rules.len(), alert_rules().len(), "{rules:?}");
    for (name, health) in &rules {
        assert_eq!(health, "ok", "{name} does not evaluate");
    }
    let is_pending = |name: &str, label: (&str, &str)| {
        pending
            .iter()
            .any(|(alert, labels)| alert == name && labels[label.0] == label.1)
    };
    assert!(
        is_pending("ctxproxyDown", ("instance", &down)),
        "{pending:?}"
    );
    assert!(
        is_pending("ctxproxyHighErrorRate", ("route", "passthrough")),
        "{pending:?}"
    );
    assert!(
        !pending.iter().any(|(alert, _)| alert == "ctxproxyAbsent"),
        "{pending:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The alerting rules as Prometheus evaluated them, once every rule was evaluated and the two
/// expected alerts are pending (or after a minute): each rule's name and health, and the
/// pending or firing alerts with their labels.
async fn alerts_after_evaluation(base: &str) -> (Vec<(String, String)>, Vec<(String, Value)>) {
    let mut outcome = (Vec::new(), Vec::new());
    for _ in 0..120 {
        let body: Value = client()
            .get(format!("{base}/api/v1/rules?type=alert"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let rules: Vec<Value> = body["data"]["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let health: Vec<(String, String)> = rules
            .iter()
            .map(|r| {
                let error = r["lastError"].as_str().unwrap_or_default();
                let health = r["health"].as_str().unwrap_or_default();
                let health = if error.is_empty() {
                    health.to_owned()
                } else {
                    format!("{health}: {error}")
                };
                (r["name"].as_str().unwrap().to_owned(), health)
            })
            .collect();
        let alerts: Vec<(String, Value)> = rules
            .iter()
            .flat_map(|r| r["alerts"].as_array().cloned().unwrap_or_default())
            .map(|a| {
                (
                    a["labels"]["alertname"].as_str().unwrap().to_owned(),
                    a["labels"].clone(),
                )
            })
            .collect();
        let evaluated = !health.is_empty() && health.iter().all(|(_, h)| h != "unknown");
        let names: Vec<&str> = alerts.iter().map(|(n, _)| n.as_str()).collect();
        let done = evaluated
            && names.contains(&"ctxproxyDown")
            && alerts
                .iter()
                .any(|(n, l)| n == "ctxproxyHighErrorRate" && l["route"] == "passthrough");
        outcome = (health, alerts);
        if done {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    outcome
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
