//! The pass-through proxy end to end: mock upstream and ctxproxy on ephemeral ports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{
    client, closed_port, metric_sum, proxy_for, start_mock, start_proxy, start_proxy_on_threads,
    start_proxy_with_env,
};
use ctxproxy::auth::hash_key;
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use futures_util::StreamExt;
use serde_json::{Value, json};

fn chat(stream: bool) -> Value {
    json!({
        "model": "gpt-4o",
        "stream": stream,
        "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}
        ]
    })
}

async fn post(url: &str, body: &Value) -> reqwest::Response {
    client().post(url).json(body).send().await.unwrap()
}

#[tokio::test]
async fn non_streaming_and_streaming_answers_are_byte_identical_to_the_upstream() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    for stream in [false, true] {
        let body = chat(stream);
        let direct = post(&format!("{}/chat/completions", mock.base_url()), &body).await;
        let via = post(&proxy.url("/v1/chat/completions"), &body).await;
        assert_eq!(via.status(), direct.status());
        assert_eq!(
            via.headers()["content-type"],
            direct.headers()["content-type"]
        );
        assert!(via.headers().contains_key("x-request-id"));
        let (direct, via) = (direct.bytes().await.unwrap(), via.bytes().await.unwrap());
        assert_eq!(via, direct, "stream={stream}");
        if stream {
            assert!(via.ends_with(b"data: [DONE]\n\n"));
        }
    }
}

#[tokio::test]
async fn connections_served_on_threads_of_their_own_get_the_upstreams_answers() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = start_proxy_on_threads(&format!(
        "[server]\nthreads = 3\n[upstream]\nbase_url = \"{}\"\n",
        mock.base_url()
    ))
    .await;
    // Six clients, a connection each, open at once: two per thread, each of whose requests
    // goes upstream on its thread's own pool.
    let clients: Vec<_> = (0..6).map(|_| client()).collect();
    for round in 0..2 {
        let answers =
            futures_util::future::join_all(clients.iter().enumerate().map(|(i, client)| {
                let body = chat((i + round) % 2 == 1);
                let url = proxy.url("/v1/chat/completions");
                let direct = format!("{}/chat/completions", mock.base_url());
                async move {
                    let via = client.post(url).json(&body).send().await.unwrap();
                    assert_eq!(via.status(), 200);
                    let via = via.bytes().await.unwrap();
                    let direct = client.post(direct).json(&body).send().await.unwrap();
                    (via, direct.bytes().await.unwrap())
                }
            }))
            .await;
        for (via, direct) in answers {
            assert_eq!(via, direct);
        }
    }
    assert_eq!(proxy.metric("ctxproxy_open_connections", &[]).await, 6.0);
}

/// An agent's request of about 60 KB: a large tool result the pipeline compacts.
fn large_agent_request() -> Value {
    let rows: Vec<Value> = (0..600)
        .map(|k| json!({"order_id": format!("#W{k:05}"), "status": "delivered", "note": null, "total": k * 7}))
        .collect();
    json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "You help with orders."},
            {"role": "user", "content": "List my orders."},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "list_orders", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": serde_json::to_string_pretty(&rows).unwrap()},
            {"role": "user", "content": "Which one is #W00412?"}
        ]
    })
}

#[tokio::test]
async fn a_large_body_rewritten_off_a_shared_thread_gets_the_same_answer() {
    // A mock each: the mock's prompt cache would tell the second request from the first.
    let (mock, other_mock) = (
        start_mock(MockOptions::default()).await,
        start_mock(MockOptions::default()).await,
    );
    let toml = |mock: &common::Mock| format!("[upstream]\nbase_url = \"{}\"\n", mock.base_url());
    // One serving thread with two connections open: a large body's rewrite leaves it.
    let shared = start_proxy_on_threads(&format!("[server]\nthreads = 1\n{}", toml(&mock))).await;
    let memory = vec![("CTXPROXY_STORE_BACKEND".to_owned(), "memory".to_owned())];
    let inline = start_proxy_with_env(&toml(&other_mock), memory).await;
    let body = large_agent_request();
    assert!(serde_json::to_vec(&body).unwrap().len() > 40_000);
    let (idle, busy) = (client(), client());
    let url = shared.url("/v1/chat/completions");
    assert_eq!(
        idle.post(&url)
            .json(&chat(false))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let via_pool = busy.post(&url).json(&body).send().await.unwrap();
    assert_eq!(via_pool.status(), 200);
    assert_eq!(shared.metric("ctxproxy_open_connections", &[]).await, 2.0);
    let via_inline = post(&inline.url("/v1/chat/completions"), &body).await;
    assert_eq!(via_inline.status(), 200);
    let (via_pool, via_inline) = (
        via_pool.bytes().await.unwrap(),
        via_inline.bytes().await.unwrap(),
    );
    assert_eq!(via_pool, via_inline);
    let saved = |text: &str| metric_sum(text, "ctxproxy_tokens_saved_total", &[]);
    let saved_by_pool = saved(&shared.metrics().await);
    assert!(saved_by_pool > 0.0, "the large body was rewritten");
    assert_eq!(saved_by_pool, saved(&inline.metrics().await));
}

#[tokio::test]
async fn streamed_events_arrive_one_per_frame() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let response = post(&proxy.url("/v1/chat/completions"), &chat(true)).await;
    let mut frames = response.bytes_stream();
    let mut count = 0;
    while let Some(frame) = frames.next().await {
        let frame = frame.unwrap();
        // Each frame is exactly one whole event.
        assert!(
            frame.starts_with(b"data: ") && frame.ends_with(b"\n\n"),
            "{frame:?}"
        );
        assert_eq!(frame.windows(2).filter(|w| w == b"\n\n").count(), 1);
        count += 1;
    }
    assert!(count > 3);
}

#[tokio::test]
async fn vendor_fields_and_nulls_reach_the_upstream_intact() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let body = json!({
        "model": "llama-3.1-8b",
        "chat_template_kwargs": {"enable_thinking": false},
        "top_k": 20,
        "messages": [
            {"role": "user", "content": "hi", "x_vendor_tag": {"a": [1, 2]}},
            {"role": "assistant", "content": null, "tool_calls": null, "function_call": null},
            {"role": "user", "content": [{"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
        ],
        "response_format": {"type": "json_object"},
        "temperature": null
    });
    let response = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("x-mock-echo", "1")
        .header("x-request-id", "req-abc-123")
        .header("openai-organization", "org-test")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["x-request-id"], "req-abc-123");
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["mock_echo"]["body"], body);
    let headers = &answer["mock_echo"]["headers"];
    assert_eq!(headers["x-request-id"], "req-abc-123");
    assert_eq!(headers["openai-organization"], "org-test");
}

#[tokio::test]
async fn models_and_embeddings_pass_through() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let direct = client()
        .get(format!("{}/models?limit=2", mock.base_url()))
        .send()
        .await
        .unwrap();
    let via = client()
        .get(proxy.url("/v1/models?limit=2"))
        .send()
        .await
        .unwrap();
    assert_eq!(via.status(), 200);
    assert_eq!(via.bytes().await.unwrap(), direct.bytes().await.unwrap());

    let via = client()
        .get(proxy.url("/v1/models/gpt-4o"))
        .send()
        .await
        .unwrap();
    let model: Value = via.json().await.unwrap();
    assert_eq!(model["id"], "gpt-4o");

    let body =
        json!({"model": "text-embedding-3-small", "input": ["a", "b"], "encoding_format": "float"});
    let direct = post(&format!("{}/embeddings", mock.base_url()), &body).await;
    let via = post(&proxy.url("/v1/embeddings"), &body).await;
    assert_eq!(via.status(), 200);
    let (direct, via): (Value, Value) = (direct.json().await.unwrap(), via.json().await.unwrap());
    assert_eq!(via, direct);
    assert_eq!(via["data"].as_array().unwrap().len(), 2);
}

async fn error_of(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    let error = &body["error"];
    for field in ["message", "type", "param", "code"] {
        assert!(error.get(field).is_some(), "{body} lacks error.{field}");
    }
    (status, error.clone())
}

#[tokio::test]
async fn bad_requests_get_openai_format_errors() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "[server]\nmax_body_bytes = 2048\n").await;
    let url = proxy.url("/v1/chat/completions");

    let malformed = client()
        .post(&url)
        .body("{\n \"model\": \"gpt-4o\",\n \"messages\": [}")
        .send()
        .await
        .unwrap();
    let (status, error) = error_of(malformed).await;
    assert_eq!(status, 400);
    assert_eq!(error["code"], "invalid_json");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("line 3, column"),
        "{error}"
    );

    let wrong_type = post(
        &url,
        &json!({"model": "gpt-4o", "messages": [{"role": "user", "content": 5}]}),
    )
    .await;
    let (status, error) = error_of(wrong_type).await;
    assert_eq!(status, 400);
    assert_eq!(error["param"], "messages[0].content");

    let wrong_type = post(&url, &json!({"model": "gpt-4o", "messages": "hi"})).await;
    let (status, error) = error_of(wrong_type).await;
    assert_eq!((status, error["param"].as_str()), (400, Some("messages")));

    // Not an object at all: said in the client's terms, not the proxy's type names.
    let array = post(&url, &json!([{"role": "user", "content": "Hi"}])).await;
    let (status, error) = error_of(array).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (400, Some("invalid_body"))
    );
    let message = error["message"].as_str().unwrap();
    assert!(message.contains("expected a JSON object"), "{message}");
    assert!(!message.contains("ChatRequest"), "{message}");

    let missing = post(&url, &json!({"messages": []})).await;
    let (status, error) = error_of(missing).await;
    assert_eq!(status, 400);
    assert!(error["message"].as_str().unwrap().contains("model"));

    let big =
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x".repeat(4096)}]});
    let (status, error) = error_of(post(&url, &big).await).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (413, Some("request_too_large"))
    );

    let (status, error) = error_of(
        client()
            .get(proxy.url("/v2/whatever"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, error["code"].as_str()), (404, Some("unknown_url")));

    // Nothing reached the upstream.
    assert_eq!(MockStats::get(&mock.stats.requests), 0);
}

#[tokio::test]
async fn upstream_failures_map_to_502_504_and_upstream_errors_pass_through() {
    let port = closed_port().await;
    let proxy = start_proxy(&format!(
        "[upstream]\nbase_url = \"http://127.0.0.1:{port}/v1\"\nconnect_retries = 1\n"
    ))
    .await;
    let (status, error) =
        error_of(post(&proxy.url("/v1/chat/completions"), &chat(false)).await).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (502, Some("upstream_unreachable"))
    );
    let metrics = client()
        .get(proxy.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // One failed attempt plus one retry.
    assert!(
        metrics.contains("ctxproxy_upstream_errors_total{kind=\"connect\",upstream=\"default\"} 2"),
        "{metrics}"
    );

    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "first_byte_timeout_ms = 200\n").await;
    let slow = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("x-mock-latency-ms", "3000")
        .json(&chat(false))
        .send()
        .await
        .unwrap();
    let (status, error) = error_of(slow).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (504, Some("upstream_timeout"))
    );

    for stream in [false, true] {
        let direct = client()
            .post(format!("{}/chat/completions", mock.base_url()))
            .header("x-mock-status", "503")
            .json(&chat(stream))
            .send()
            .await
            .unwrap();
        let via = client()
            .post(proxy.url("/v1/chat/completions"))
            .header("x-mock-status", "503")
            .json(&chat(stream))
            .send()
            .await
            .unwrap();
        assert_eq!(via.status(), 503);
        assert_eq!(via.bytes().await.unwrap(), direct.bytes().await.unwrap());
    }
}

#[tokio::test]
async fn auth_on_requires_a_key_and_never_forwards_it() {
    let mock = start_mock(MockOptions::default()).await;
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\napi_key_env = \"TEST_UPSTREAM_KEY\"\n[[auth.keys]]\nsha256 = \"{}\"\ntenant = \"acme\"\n",
        mock.base_url(),
        hash_key("sk-proxy-acme")
    );
    let proxy = start_proxy_with_env(
        &toml,
        vec![("TEST_UPSTREAM_KEY".into(), "sk-upstream-own".into())],
    )
    .await;
    let url = proxy.url("/v1/chat/completions");

    let none = client().post(&url).json(&chat(false)).send().await.unwrap();
    let (status, error) = error_of(none).await;
    assert_eq!(
        (status, error["type"].as_str()),
        (401, Some("authentication_error"))
    );
    let wrong = client()
        .post(&url)
        .bearer_auth("sk-nope")
        .json(&chat(false))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let models = client().get(proxy.url("/v1/models")).send().await.unwrap();
    assert_eq!(models.status(), 401);
    assert_eq!(MockStats::get(&mock.stats.requests), 0);

    let ok = client()
        .post(&url)
        .bearer_auth("sk-proxy-acme")
        .header("x-mock-echo", "1")
        .json(&chat(false))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let answer: Value = ok.json().await.unwrap();
    assert_eq!(
        answer["mock_echo"]["headers"]["authorization"],
        "Bearer sk-upstream-own"
    );
}

#[tokio::test]
async fn auth_off_forwards_the_client_key_and_auth_without_upstream_key_strips_it() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let answer: Value = client()
        .post(proxy.url("/v1/chat/completions"))
        .bearer_auth("sk-client-own")
        .header("x-mock-echo", "1")
        .json(&chat(false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        answer["mock_echo"]["headers"]["authorization"],
        "Bearer sk-client-own"
    );

    let proxy = proxy_for(
        &mock,
        &format!(
            "[[auth.keys]]\nsha256 = \"{}\"\ntenant = \"t\"\n",
            hash_key("sk-p")
        ),
    )
    .await;
    let answer: Value = client()
        .post(proxy.url("/v1/chat/completions"))
        .bearer_auth("sk-p")
        .header("x-mock-echo", "1")
        .json(&chat(false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        answer["mock_echo"]["headers"]
            .get("authorization")
            .is_none()
    );
}

#[tokio::test]
async fn routes_send_models_to_their_upstream() {
    let openai = start_mock(MockOptions::default()).await;
    let local = start_mock(MockOptions::default()).await;
    let extra = format!(
        "[[routes]]\nname = \"local\"\nmodels = [\"llama-*\"]\nbase_url = \"{}\"\n",
        local.base_url()
    );
    let proxy = proxy_for(&openai, &extra).await;
    let mut body = chat(false);
    body["model"] = json!("llama-3.1-8b");
    assert_eq!(
        post(&proxy.url("/v1/chat/completions"), &body)
            .await
            .status(),
        200
    );
    // Embeddings are routed by their model too.
    let embed = json!({"model": "llama-embed", "input": "x"});
    assert_eq!(
        post(&proxy.url("/v1/embeddings"), &embed).await.status(),
        200
    );
    assert_eq!(
        post(&proxy.url("/v1/chat/completions"), &chat(false))
            .await
            .status(),
        200
    );
    assert_eq!(MockStats::get(&local.stats.requests), 2);
    assert_eq!(MockStats::get(&openai.stats.requests), 1);
}

#[tokio::test]
async fn unrouted_model_without_default_upstream_is_404() {
    let local = start_mock(MockOptions::default()).await;
    let proxy = start_proxy(&format!(
        "[upstream]\nbase_url = \"\"\n[[routes]]\nmodels = [\"llama-*\"]\nbase_url = \"{}\"\n",
        local.base_url()
    ))
    .await;
    let (status, error) =
        error_of(post(&proxy.url("/v1/chat/completions"), &chat(false)).await).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (404, Some("model_not_found"))
    );
}

#[tokio::test]
async fn without_default_upstream_the_routes_list_their_models() {
    let local = start_mock(MockOptions::default()).await;
    let proxy = start_proxy(&format!(
        "[upstream]\nbase_url = \"\"\n[[routes]]\nname = \"local\"\n\
         models = [\"llama-3.1-8b\", \"qwen*\"]\nbase_url = \"{}\"\n",
        local.base_url()
    ))
    .await;
    let models: Value = client()
        .get(proxy.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "llama-3.1-8b");
    assert_eq!(models["data"][0]["owned_by"], "local");
    assert_eq!(
        models["data"].as_array().unwrap().len(),
        1,
        "a glob names no model"
    );
    // Another path that names no model: said plainly.
    let files = client().get(proxy.url("/v1/files")).send().await.unwrap();
    let (status, error) = error_of(files).await;
    assert_eq!(status, 404);
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("No default upstream"),
        "{error}"
    );
}

#[tokio::test]
async fn client_disconnect_mid_stream_drops_the_upstream_request() {
    let mock = start_mock(MockOptions {
        tokens_per_sec: Some(20.0),
        ..MockOptions::default()
    })
    .await;
    let proxy = proxy_for(&mock, "").await;
    let response = post(&proxy.url("/v1/chat/completions"), &chat(true)).await;
    let mut frames = response.bytes_stream();
    let first = frames.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(frames);
    let cancelled = mock
        .stats
        .wait_until(|s| MockStats::get(&s.streams_cancelled) == 1);
    tokio::time::timeout(Duration::from_secs(10), cancelled)
        .await
        .expect("upstream stream was not dropped");
    assert_eq!(MockStats::get(&mock.stats.streams_completed), 0);
}

#[tokio::test]
async fn a_stream_in_flight_during_shutdown_completes() {
    let mock = start_mock(MockOptions {
        tokens_per_sec: Some(40.0),
        ..MockOptions::default()
    })
    .await;
    let mut proxy = proxy_for(&mock, "[server]\nshutdown_grace_secs = 20\n").await;
    let response = post(&proxy.url("/v1/chat/completions"), &chat(true)).await;
    let mut frames = response.bytes_stream();
    let mut received = frames.next().await.unwrap().unwrap().to_vec();
    proxy.begin_shutdown();
    // Readiness flips while the stream goes on.
    while let Some(frame) = frames.next().await {
        received.extend_from_slice(&frame.unwrap());
    }
    assert!(received.ends_with(b"data: [DONE]\n\n"));
    let completed = mock
        .stats
        .wait_until(|s| MockStats::get(&s.streams_completed) == 1);
    tokio::time::timeout(Duration::from_secs(10), completed)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), proxy.join())
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_connection_that_sent_nothing_does_not_hold_the_shutdown() {
    let mock = start_mock(MockOptions::default()).await;
    // The first request's headers would be due in 10 s: the shutdown does not wait for them.
    let mut proxy = proxy_for(
        &mock,
        "[server]\nshutdown_grace_secs = 20\nheader_read_timeout_ms = 10000\n",
    )
    .await;
    let silent = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.begin_shutdown();
    tokio::time::timeout(Duration::from_secs(3), proxy.join())
        .await
        .expect("shut down without waiting for the silent connection")
        .unwrap();
    drop(silent);
}

#[tokio::test]
async fn concurrency_limit_applies_back_pressure_then_503() {
    let mock = start_mock(MockOptions {
        tokens_per_sec: Some(10.0),
        ..MockOptions::default()
    })
    .await;
    let proxy = proxy_for(
        &mock,
        "[server]\nconcurrency_limit = 1\nqueue_timeout_ms = 150\n",
    )
    .await;
    let holding = post(&proxy.url("/v1/chat/completions"), &chat(true)).await;
    let mut frames = holding.bytes_stream();
    frames.next().await.unwrap().unwrap();
    let (status, error) =
        error_of(post(&proxy.url("/v1/chat/completions"), &chat(false)).await).await;
    assert_eq!((status, error["code"].as_str()), (503, Some("overloaded")));
    // Health endpoints are outside the limit.
    assert_eq!(
        client()
            .get(proxy.url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    drop(frames);
}

#[tokio::test]
async fn passthrough_body_limit_is_413() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "[server]\nmax_passthrough_body_bytes = 100\n").await;
    let response = client()
        .post(proxy.url("/v1/files"))
        .header("content-type", "application/octet-stream")
        .body(vec![b'x'; 1000])
        .send()
        .await
        .unwrap();
    let (status, error) = error_of(response).await;
    assert_eq!(
        (status, error["code"].as_str()),
        (413, Some("request_too_large"))
    );
    // A streamed body without a length is cut at the limit too.
    let chunks =
        futures_util::stream::iter((0..20).map(|_| Ok::<_, std::io::Error>(vec![b'y'; 50])));
    let response = client()
        .post(proxy.url("/v1/files"))
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
}

#[tokio::test]
async fn health_readiness_and_metrics() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    assert_eq!(
        client()
            .get(proxy.url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        client()
            .get(proxy.url("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    for _ in 0..3 {
        post(&proxy.url("/v1/chat/completions"), &chat(false))
            .await
            .bytes()
            .await
            .unwrap();
    }
    post(&proxy.url("/v1/chat/completions"), &json!({"model": 1}))
        .await
        .bytes()
        .await
        .unwrap();
    let metrics = client().get(proxy.url("/metrics")).send().await.unwrap();
    assert!(
        metrics.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = metrics.text().await.unwrap();
    for needle in [
        "ctxproxy_requests_total{route=\"chat_completions\",status=\"200\"} 3",
        "ctxproxy_requests_total{route=\"chat_completions\",status=\"400\"} 1",
        // The scrape itself is not an API request in flight.
        "ctxproxy_in_flight_requests 0",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    // Latencies carry the tenant (and the model), for the dashboard's variables.
    for (name, labels, count) in [
        (
            "ctxproxy_request_duration_seconds_count",
            &[("route", "chat_completions"), ("tenant", "default")][..],
            4.0,
        ),
        (
            "ctxproxy_upstream_duration_seconds_count",
            &[("upstream", "default"), ("tenant", "default")][..],
            3.0,
        ),
        (
            "ctxproxy_upstream_duration_seconds_count",
            &[("upstream", "default"), ("model", "none")][..],
            0.0,
        ),
    ] {
        assert_eq!(
            metric_sum(&text, name, labels),
            count,
            "{name} {labels:?}\n{text}"
        );
    }
}

#[tokio::test]
async fn unknown_routes_and_wrong_methods_get_openai_errors() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let client = client();
    let (status, error) = error_of(
        client
            .get(proxy.url("/v1/ctxproxy/explain"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, error["code"].as_str()),
        (405, Some("method_not_allowed"))
    );
    let (status, error) = error_of(client.get(proxy.url("/nope")).send().await.unwrap()).await;
    assert_eq!((status, error["code"].as_str()), (404, Some("unknown_url")));
}

#[tokio::test]
async fn logs_written_to_a_pipe_carry_no_colour_codes() {
    use std::io::BufRead;
    let port = common::closed_port().await;
    let mut serve = std::process::Command::new(env!("CARGO_BIN_EXE_ctxproxy"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env("CTXPROXY_STORE_BACKEND", "memory")
        .env("CTXPROXY_LOG_FORMAT", "pretty")
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = serve.stdout.take().unwrap();
    let first = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .map(|_| line)
    });
    let line = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    serve.kill().unwrap();
    let _ = serve.wait();
    assert!(line.contains("INFO"), "{line}");
    assert!(!line.contains('\x1b'), "{line:?}");
}
