//! `ctxproxy replay` against the mock upstream and through the proxy: counts, pacing, and the
//! summary against the mock's own counts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{proxy_for, start_mock};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use ctxproxy::replay::{self, Options, Pacing, StreamMode};
use serde_json::json;

/// A small JSONL file: plain bodies and one line in the recording format.
fn fixture() -> Vec<replay::Recorded> {
    let path = std::env::temp_dir().join(format!("ctxproxy-replay-{}.jsonl", uuid::Uuid::new_v4()));
    let lines = [
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "What is a lighthouse?"}]}),
        json!({"model": "gpt-4o", "stream": true, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three rivers."}]}),
        json!({"unix_ms": 1_700_000_000_000_u64, "request": {"model": "gpt-4o", "messages": [
            {"role": "user", "content": "And three lakes?"}]}}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&path, text + "not json\n").unwrap();
    let (recorded, skipped) = replay::load(&[&path]).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!((recorded.len(), skipped), (3, 1));
    recorded
}

fn options(target: String, pacing: Pacing) -> Options {
    Options {
        target,
        pacing,
        requests: None,
        duration: None,
        headers: Vec::new(),
        stream: StreamMode::Recorded,
        vary_user: false,
        timeout: Duration::from_secs(10),
        progress: false,
        label: "test".into(),
    }
}

#[tokio::test]
async fn closed_loop_sends_exactly_n_and_the_mock_sees_them() {
    let mock = start_mock(MockOptions::default()).await;
    let mut run = options(mock.base_url(), Pacing::Closed { concurrency: 3 });
    run.requests = Some(20);
    let report = replay::run(&run, &fixture()).await.unwrap();
    assert_eq!((report.requests, report.errors), (20, 0));
    assert_eq!(MockStats::get(&mock.stats.chat_requests), 20);
    // One body in three streams: its first byte is measured.
    assert_eq!(report.streams, 7);
    assert!(report.ttfb_ms.is_some());
    // Failures are counted by status.
    run.headers = vec![("X-Mock-Status".into(), "503".into())];
    run.requests = Some(5);
    let failed = replay::run(&run, &fixture()).await.unwrap();
    assert_eq!(failed.errors, 5);
    assert_eq!(failed.errors_by_status["503"], 5);
}

#[tokio::test]
async fn open_loop_keeps_the_asked_rate() {
    let mock = start_mock(MockOptions {
        latency: Duration::from_millis(50),
        ..MockOptions::default()
    })
    .await;
    let mut run = options(mock.base_url(), Pacing::Rate { rate: 40.0 });
    run.duration = Some(Duration::from_secs(2));
    let report = replay::run(&run, &fixture()).await.unwrap();
    // 2 s at 40/s: 80 sends (a slow answer never delays the next send).
    assert!((76..=82).contains(&report.requests), "{}", report.requests);
    assert_eq!(report.errors, 0);
    assert!(report.latency_ms.p50 >= 50.0, "{:?}", report.latency_ms);
    assert!(report.duration_s < 3.0, "{}", report.duration_s);
}

#[tokio::test]
async fn through_the_proxy_the_summary_matches_the_mock_and_the_headers() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let mut bodies = fixture();
    for body in &mut bodies {
        body.body["temperature"] = json!(0);
    }
    let mut run = options(proxy.url(""), Pacing::Closed { concurrency: 1 });
    run.requests = Some(12);
    let report = replay::run(&run, &bodies).await.unwrap();
    assert_eq!((report.requests, report.errors), (12, 0));
    let cache = &report.cache;
    assert_eq!(cache.hit + cache.miss + cache.bypass + cache.dedup, 12);
    // Every answer not served by a cache reached the mock.
    assert_eq!(
        MockStats::get(&mock.stats.chat_requests),
        12 - cache.hit - cache.dedup
    );
    assert!(cache.hit >= 6, "{cache:?}");
    assert!(report.tokens_before > 0 && report.tokens_after <= report.tokens_before);
    // Compared with mode off: nothing rewritten, nothing counted.
    run.headers = vec![("X-Ctxproxy-Mode".into(), "off".into())];
    let off = replay::run(&run, &bodies).await.unwrap();
    assert_eq!(off.tokens_before, 0);
    assert!(replay::diff(&off, &report).contains("test"));
}

#[tokio::test]
async fn the_mock_adds_jitter_and_random_errors_for_load_tests() {
    let mock = start_mock(MockOptions {
        latency: Duration::from_millis(20),
        jitter: Duration::from_millis(30),
        error_rate: 0.5,
        ..MockOptions::default()
    })
    .await;
    let mut run = options(mock.base_url(), Pacing::Closed { concurrency: 8 });
    run.requests = Some(200);
    let report = replay::run(&run, &fixture()).await.unwrap();
    assert_eq!(report.requests, 200);
    // About half fail (binomial: 200 draws at 0.5 stay within 60..140 but for 1 in 10^8).
    assert!((60..=140).contains(&report.errors), "{}", report.errors);
    assert_eq!(report.errors_by_status["500"], report.errors);
    assert!(report.latency_ms.p50 >= 20.0 && report.latency_ms.max < 500.0);
    assert!(
        report.latency_ms.p90 - report.latency_ms.p50 > 5.0,
        "no jitter: {:?}",
        report.latency_ms
    );
}
