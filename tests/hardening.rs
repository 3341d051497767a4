//! Clients that misbehave can't leave the proxy's accounting wrong: every request is counted
//! once, a client that leaves before the response included.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{client, proxy_for, start_mock};
use ctxproxy::mock_upstream::MockOptions;
use serde_json::json;

#[tokio::test]
async fn clients_that_leave_early_are_counted_as_499_and_leave_the_gauge_alone() {
    let mock = start_mock(MockOptions {
        latency: Duration::from_secs(2),
        ..MockOptions::default()
    })
    .await;
    let proxy = proxy_for(&mock, "").await;
    let in_flight = || proxy.metric("ctxproxy_in_flight_requests", &[]);
    let before = in_flight().await;

    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}]});
    for _ in 0..20 {
        let sent = impatient
            .post(proxy.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await;
        assert!(sent.is_err(), "the client gave up before the answer");
    }

    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let gone = proxy
            .metric(
                "ctxproxy_requests_total",
                &[("route", "chat_completions"), ("status", "499")],
            )
            .await;
        if gone == 20.0 && in_flight().await == before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "499s counted: {gone}, in flight: {} (was {before})",
            in_flight().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And the proxy still answers.
    let ok = client().get(proxy.url("/healthz")).send().await.unwrap();
    assert!(ok.status().is_success());
}
