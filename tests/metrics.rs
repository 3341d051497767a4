//! The token metrics against what was really sent: a mix of requests (optimized, observed,
//! cache hits, dedup hits, streamed, failed, over budget) through the proxy, then `/metrics`
//! compared with the response headers and the usage the mock reported.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{client, long_conversation, metric_sum, proxy_for, start_mock};
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

#[tokio::test]
async fn metrics_match_what_was_sent_and_what_the_upstream_reported() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(
        &mock,
        "[cache.dedup]\nenabled = true\n[prices]\n\"gpt-4o\" = { input = 2.5, output = 10.0 }\n",
    )
    .await;
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
    // gpt-4o input at 2.50 USD per million tokens.
    let pipeline_usd = value("ctxproxy_cost_saved_usd_total", &[("source", "pipeline")]);
    let expected = saved as f64 * 2.5 / 1e6;
    assert!(
        (pipeline_usd - expected).abs() < 1e-9,
        "{pipeline_usd} vs {expected}"
    );
    assert!(value("ctxproxy_cost_saved_usd_total", &[("source", "cache")]) > 0.0);
    assert_eq!(value("ctxproxy_stream_first_byte_seconds_count", &[]), 2.0);
    assert!(value("ctxproxy_compactions_total", &[]) > 0.0);
}
