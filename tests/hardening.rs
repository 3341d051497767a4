//! Clients that misbehave can't take the proxy down or leave its accounting wrong: slow bodies,
//! slow headers, idle connections and too many connections are bounded by `[server]`, and every
//! request is counted once, a client that leaves before the response included.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{client, proxy_for, start_mock};
use ctxproxy::auth::hash_key;
use ctxproxy::mock_upstream::MockOptions;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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

/// A proxy in front of `mock` with `[server]` limits.
async fn limited(mock: &common::Mock, server: &str) -> common::Proxy {
    common::start_proxy(&format!(
        "[server]\n{server}\n[upstream]\nbase_url = \"{}\"\n",
        mock.base_url()
    ))
    .await
}

/// Whether the server closed `stream` within `within` (EOF or a reset).
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            // A response (a 408, say): keep reading until the close.
            Ok(Ok(_)) => continue,
        }
    }
}

async fn chat_ok(proxy: &common::Proxy) -> Duration {
    let started = Instant::now();
    let response = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    started.elapsed()
}

#[tokio::test]
async fn a_body_that_never_ends_gets_408_and_never_holds_a_slot() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = limited(&mock, "concurrency_limit = 1\nbody_read_timeout_ms = 400").await;
    let mut slow = TcpStream::connect(proxy.addr).await.unwrap();
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    // The only slot is free for others while that body trickles in.
    chat_ok(&proxy).await;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut answer))
        .await
        .expect("answered and closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"code\":\"request_timeout\""), "{answer}");
}

#[tokio::test]
async fn slow_headers_and_idle_connections_are_closed() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = limited(&mock, "header_read_timeout_ms = 300\nidle_timeout_ms = 600").await;
    // Slowloris: a request line, then headers that never end.
    let mut slowloris = TcpStream::connect(proxy.addr).await.unwrap();
    slowloris
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // A connection that never sends a byte.
    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();
    // A keep-alive connection, idle after one request.
    let mut idle = TcpStream::connect(proxy.addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    assert!(idle.read(&mut buf).await.unwrap() > 0, "answered");

    assert!(closed_within(&mut slowloris, Duration::from_secs(3)).await);
    assert!(closed_within(&mut silent, Duration::from_secs(3)).await);
    assert!(closed_within(&mut idle, Duration::from_secs(3)).await);
    // Meanwhile, and after, a normal request is served.
    chat_ok(&proxy).await;
}

#[tokio::test]
async fn a_connection_stalled_inside_the_http2_preface_is_closed_at_the_header_timeout() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = limited(&mock, "header_read_timeout_ms = 300\nidle_timeout_ms = 600").await;
    // Neither HTTP/1 nor yet HTTP/2: the protocol can't be told, and the header clock runs.
    let mut stalled = TcpStream::connect(proxy.addr).await.unwrap();
    stalled.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    assert!(closed_within(&mut stalled, Duration::from_secs(3)).await);
    chat_ok(&proxy).await;
}

#[tokio::test]
async fn a_request_whose_first_byte_comes_alone_is_served() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = limited(&mock, "header_read_timeout_ms = 2000").await;
    // `P` could start `PRI` (HTTP/2) or `POST`: the protocol is told by the next bytes.
    let mut pending = TcpStream::connect(proxy.addr).await.unwrap();
    pending.write_all(b"P").await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    pending
        .write_all(b"OST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), pending.read_to_end(&mut answer))
        .await
        .expect("answered")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 400"),
        "an HTTP/1 answer: {answer}"
    );
}

#[tokio::test]
async fn an_http2_client_with_prior_knowledge_is_served_like_an_http1_one() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}]});
    for _ in 0..2 {
        let answer = h2
            .post(proxy.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.version(), reqwest::Version::HTTP_2);
        assert_eq!(answer.status(), 200);
        let answer: serde_json::Value = answer.json().await.unwrap();
        assert_eq!(answer["object"], "chat.completion");
    }
    chat_ok(&proxy).await;
}

#[tokio::test]
async fn a_long_answer_is_not_cut_by_the_idle_timeout() {
    let mock = start_mock(MockOptions {
        latency: Duration::from_millis(800),
        ..MockOptions::default()
    })
    .await;
    let proxy = limited(&mock, "header_read_timeout_ms = 200\nidle_timeout_ms = 300").await;
    // The upstream takes longer than both timeouts; the request is in progress, not idle.
    chat_ok(&proxy).await;
}

#[tokio::test]
async fn past_max_connections_new_ones_are_closed_and_counted() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = limited(&mock, "max_connections = 3").await;
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(TcpStream::connect(proxy.addr).await.unwrap());
    }
    let mut extra = TcpStream::connect(proxy.addr).await.unwrap();
    assert!(closed_within(&mut extra, Duration::from_secs(5)).await);
    // One place frees up: a request goes through again.
    drop(open.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let sent = client().get(proxy.url("/healthz")).send().await;
        if sent.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        assert!(Instant::now() < deadline, "no place freed");
    }
    assert!(
        proxy
            .metric("ctxproxy_connections_refused_total", &[])
            .await
            >= 1.0
    );
}

#[tokio::test]
async fn with_auth_on_metrics_need_the_metrics_key() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&format!(
        "[upstream]\nbase_url = \"{}\"\n[auth]\nmetrics_key_sha256 = \"{}\"\n[[auth.keys]]\nsha256 = \"{}\"\ntenant = \"acme\"\n",
        mock.base_url(),
        hash_key("prom-key"),
        hash_key("tenant-key"),
    ))
    .await;
    let get = |key: Option<&'static str>| {
        let mut request = client().get(proxy.url("/metrics"));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        async move { request.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(get(None).await, 401);
    assert_eq!(
        get(Some("tenant-key")).await,
        401,
        "a tenant key shows no metrics"
    );
    assert_eq!(get(Some("prom-key")).await, 200);
}

#[tokio::test]
async fn metrics_can_live_on_their_own_address() {
    let mock = start_mock(MockOptions::default()).await;
    let port = common::closed_port().await;
    let proxy = limited(&mock, &format!("metrics_listen = \"127.0.0.1:{port}\"")).await;
    let api = client().get(proxy.url("/metrics")).send().await.unwrap();
    assert_eq!(api.status(), 404, "not on the API listener");
    chat_ok(&proxy).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        match client()
            .get(format!("http://127.0.0.1:{port}/metrics"))
            .send()
            .await
        {
            Ok(response) => break response.text().await.unwrap(),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("metrics address: {e}"),
        }
    };
    assert!(
        common::metric_sum(
            &text,
            "ctxproxy_requests_total",
            &[("route", "chat_completions"), ("status", "200")]
        ) >= 1.0
    );
}

#[tokio::test]
async fn a_kept_alive_connection_lives_for_the_idle_timeout_not_the_header_timeout() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = limited(
        &mock,
        "header_read_timeout_ms = 200\nidle_timeout_ms = 3000",
    )
    .await;
    let mut connection = TcpStream::connect(proxy.addr).await.unwrap();
    let mut buf = [0u8; 1024];
    for _ in 0..2 {
        connection
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let read = tokio::time::timeout(Duration::from_secs(2), connection.read(&mut buf))
            .await
            .expect("answered")
            .unwrap();
        assert!(
            String::from_utf8_lossy(&buf[..read]).starts_with("HTTP/1.1 200"),
            "still open after an idle pause longer than the header timeout"
        );
        // Idle for 4x the header timeout, well within the idle timeout.
        tokio::time::sleep(Duration::from_millis(800)).await;
    }
}
