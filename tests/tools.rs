//! Tool filtering through the running proxy with the machine's Redis: two replicas share a
//! conversation's sticky categories, a Redis outage costs nothing but the shared state, and
//! the state is used again when Redis is back, without a restart.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use ctxproxy::pipeline::recall;
use std::time::{Duration, Instant};

use common::{
    OwnRedis, Proxy, client, closed_port, start_mock, start_proxy_with_env, unique_prefix,
};
use ctxproxy::mock_upstream::MockOptions;
use serde_json::{Value, json};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "weather_forecast", "description": "Weather forecast for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "email_send", "description": "Send an email message.", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "calendar_list_events", "description": "List the meetings of a day.", "parameters": {"type": "object", "properties": {}}}}
    ])
}

/// Sends one user message of conversation `conversation`; `tool_call` makes the mock answer
/// with a call to that tool. Returns the tool names the upstream received.
async fn ask(
    proxy: &Proxy,
    conversation: &str,
    text: &str,
    tool_call: Option<&str>,
) -> Vec<String> {
    let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": text}], "tools": tools()});
    let mut request = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("x-conversation-id", conversation)
        .header("x-mock-echo", "1")
        .json(&body);
    if let Some(name) = tool_call {
        request = request.header("x-mock-tool-call", name);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    answer["mock_echo"]["body"]["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
                // The client's tools: the proxy's recall tool has tests of its own.
                .filter(|name| name != recall::TOOL_NAME)
                .collect()
        })
        .unwrap_or_default()
}

/// Asks until the tools sent equal `expected` (sticky state is written after the answer
/// ends, off the request path), for at most two seconds.
async fn eventually(proxy: &Proxy, conversation: &str, text: &str, expected: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let sent = ask(proxy, conversation, text, None).await;
        if sent == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "sent {sent:?}, expected {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn proxy_with(mock_url: &str, env: &[(&str, String)]) -> Proxy {
    let env = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect();
    // These three tools are a small block: filtered all the same, as a large one would be.
    // What is left out is removed, as before stubs: these tests read the tools sent.
    start_proxy_with_env(
        &format!(
            "[upstream]\nbase_url = \"{mock_url}\"\n[tools]\nmin_tool_tokens = 0\nmin_stub_tokens = 0\n\
             left_out = \"remove\"\non_no_match = \"drop_all\"\n"
        ),
        env,
    )
    .await
}

#[tokio::test]
async fn two_replicas_share_sticky_categories_through_redis() {
    let mock = start_mock(MockOptions::default()).await;
    let prefix = unique_prefix("sticky");
    let env = [("CTXPROXY_STORE_KEY_PREFIX", prefix)];
    let (a, b) = (
        proxy_with(&mock.base_url(), &env).await,
        proxy_with(&mock.base_url(), &env).await,
    );
    // Replica A: a weather question; the model calls the weather tool.
    let sent = ask(
        &a,
        "conv-1",
        "What's the weather forecast in Lisbon?",
        Some("weather_forecast"),
    )
    .await;
    assert_eq!(sent, ["weather_forecast"]);
    // Replica B: a follow-up with no keyword gets the same tools from the shared state.
    eventually(&b, "conv-1", "and tomorrow?", &["weather_forecast"]).await;
    // Another conversation has no sticky state: no tools.
    assert!(ask(&b, "conv-2", "and tomorrow?", None).await.is_empty());
    // A turn without tools clears the state (one turn without tools).
    ask(&a, "conv-1", "thanks, that's all", None).await;
    eventually(&b, "conv-1", "and tomorrow?", &[]).await;
}

async fn metric(proxy: &Proxy, name: &str) -> f64 {
    proxy
        .metrics()
        .await
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[tokio::test]
async fn requests_succeed_fast_while_redis_is_down() {
    let mock = start_mock(MockOptions::default()).await;
    let closed = format!("redis://127.0.0.1:{}", closed_port().await);
    let proxy = proxy_with(&mock.base_url(), &[("CTXPROXY_STORE_REDIS_URL", closed)]).await;
    let started = Instant::now();
    for i in 0..20 {
        let sent = ask(
            &proxy,
            "conv-down",
            "What's the weather forecast?",
            Some("weather_forecast"),
        )
        .await;
        assert_eq!(sent, ["weather_forecast"], "request {i}");
    }
    // Three failures open the breaker; after that nothing waits for Redis.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let ready: Value = client()
        .get(proxy.url("/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["status"], "ready");
    assert_eq!(ready["store"]["up"], false);
    assert_eq!(ready["store"]["serving"], "memory");
    assert_eq!(metric(&proxy, "ctxproxy_store_up").await, 0.0);
    // Sticky state still works within this replica, from memory.
    eventually(&proxy, "conv-down", "and tomorrow?", &["weather_forecast"]).await;
}

/// A Redis of this test's own, on a port of its own, that the test can stop and restart.
#[tokio::test]
async fn state_is_shared_again_when_redis_comes_back() {
    let port = closed_port().await;
    let Some(redis) = OwnRedis::start(port) else {
        eprintln!("redis-server is not installed: skipped (scripts/test.sh installs it)");
        return;
    };
    let mock = start_mock(MockOptions::default()).await;
    let env = [
        (
            "CTXPROXY_STORE_REDIS_URL",
            format!("redis://127.0.0.1:{port}"),
        ),
        ("CTXPROXY_STORE_BREAKER_PROBE_MS", "100".to_owned()),
        ("CTXPROXY_STORE_KEY_PREFIX", unique_prefix("comeback")),
    ];
    let (a, b) = (
        proxy_with(&mock.base_url(), &env).await,
        proxy_with(&mock.base_url(), &env).await,
    );
    ask(
        &a,
        "conv-3",
        "What's the weather forecast?",
        Some("weather_forecast"),
    )
    .await;
    eventually(&b, "conv-3", "and tomorrow?", &["weather_forecast"]).await;

    drop(redis);
    for _ in 0..5 {
        ask(&a, "conv-4", "Send an email to Ana", Some("email_send")).await;
    }
    let ready: Value = client()
        .get(a.url("/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["store"]["up"], false);

    let _redis = OwnRedis::start(port).expect("restart redis");
    // The breaker probes and closes by itself; A's next tool turn is shared again.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        ask(&a, "conv-5", "Send an email to Ana", Some("email_send")).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if ask(&b, "conv-5", "and another one?", None).await == ["email_send"] {
            break;
        }
        assert!(Instant::now() < deadline, "state never shared again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metric(&a, "ctxproxy_store_up").await, 1.0);
}
