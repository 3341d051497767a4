//! The deterministic cache through the running proxy and the machine's Redis: hits skip the
//! upstream, any parameter change misses, tenants never share entries, time-dependent questions
//! and cut streams are never cached, streams are replayed, Cache-Control is honoured.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Mock, Proxy, client, start_mock, start_proxy};
use ctxproxy::auth::hash_key;
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use serde_json::{Value, json};

fn question(text: &str) -> Value {
    json!({"model": "gpt-4o", "temperature": 0, "messages": [{"role": "user", "content": text}]})
}

async fn post(
    proxy: &Proxy,
    body: &Value,
    key: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut request = client()
        .post(proxy.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

fn cache_header(response: &reqwest::Response) -> String {
    response.headers()["x-ctxproxy-cache"]
        .to_str()
        .unwrap()
        .to_owned()
}

async fn setup() -> (Mock, Proxy) {
    let mock = start_mock(MockOptions::default()).await;
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\n[[auth.keys]]\nsha256 = \"{}\"\ntenant = \"a\"\n[[auth.keys]]\nsha256 = \"{}\"\ntenant = \"b\"\n",
        mock.base_url(),
        hash_key("key-a"),
        hash_key("key-b")
    );
    let proxy = start_proxy(&toml).await;
    (mock, proxy)
}

/// Sends `body` until it is a hit (the entry is written after the first answer ends).
async fn until_hit(proxy: &Proxy, body: &Value, key: &str) -> reqwest::Response {
    for _ in 0..100 {
        let response = post(proxy, body, key, &[]).await;
        if cache_header(&response) == "hit" {
            return response;
        }
        response.bytes().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("never a hit");
}

#[tokio::test]
async fn a_repeated_request_is_a_hit_and_any_change_a_miss() {
    let (mock, proxy) = setup().await;
    let body = question("What is the capital of France?");
    let first = post(&proxy, &body, "key-a", &[]).await;
    assert_eq!(cache_header(&first), "miss");
    let original: Value = first.json().await.unwrap();
    let hit = until_hit(&proxy, &body, "key-a").await;
    let served: Value = hit.json().await.unwrap();
    assert_eq!(served, original);
    let calls = MockStats::get(&mock.stats.chat_requests);

    // Any parameter changes the key.
    for (field, value) in [
        ("temperature", json!(0.5)),
        ("reasoning_effort", json!("high")),
        ("response_format", json!({"type": "json_object"})),
        ("tool_choice", json!("none")),
    ] {
        let mut changed = body.clone();
        changed[field] = value;
        let response = post(&proxy, &changed, "key-a", &[]).await;
        assert_ne!(cache_header(&response), "hit", "{field}");
    }
    // Another tenant never gets tenant a's entry.
    assert_eq!(
        cache_header(&post(&proxy, &body, "key-b", &[]).await),
        "miss"
    );
    // Cache-Control: no-cache skips the lookup; no-store skips lookup and write.
    let no_cache = post(&proxy, &body, "key-a", &[("cache-control", "no-cache")]).await;
    assert_eq!(cache_header(&no_cache), "bypass");
    let no_store_body = question("What is the capital of Peru?");
    for _ in 0..3 {
        let response = post(
            &proxy,
            &no_store_body,
            "key-a",
            &[("cache-control", "no-store")],
        )
        .await;
        assert_eq!(cache_header(&response), "bypass");
    }
    assert_eq!(
        cache_header(&post(&proxy, &no_store_body, "key-a", &[]).await),
        "miss"
    );
    assert!(MockStats::get(&mock.stats.chat_requests) > calls);
}

#[tokio::test]
async fn time_dependent_questions_are_never_cached() {
    let (_mock, proxy) = setup().await;
    let body = question("What time is it in Lima right now?");
    for _ in 0..3 {
        let response = post(&proxy, &body, "key-a", &[]).await;
        assert_eq!(cache_header(&response), "bypass");
        response.bytes().await.unwrap();
    }
}

#[tokio::test]
async fn a_stream_is_cached_whole_and_replayed_as_a_stream() {
    let (mock, proxy) = setup().await;
    let mut body = question("List three primes");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let first = post(&proxy, &body, "key-a", &[]).await;
    let streamed = first.text().await.unwrap();
    let hit = until_hit(&proxy, &body, "key-a").await;
    assert!(
        hit.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let replayed = hit.text().await.unwrap();
    let content = |sse: &str| -> (String, bool) {
        let mut text = String::new();
        let mut usage = false;
        for line in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line == "[DONE]" {
                continue;
            }
            let chunk: Value = serde_json::from_str(line).unwrap();
            usage |= chunk["usage"].is_object();
            if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str() {
                text.push_str(piece);
            }
        }
        (text, usage)
    };
    assert_eq!(content(&replayed), content(&streamed));
    assert!(replayed.ends_with("data: [DONE]\n\n"));
    // The same question as JSON is served from the entry the stream wrote.
    let calls = MockStats::get(&mock.stats.chat_requests);
    let json_body = question("List three primes");
    let response = post(&proxy, &json_body, "key-a", &[]).await;
    assert_eq!(cache_header(&response), "hit");
    let answer: Value = response.json().await.unwrap();
    assert_eq!(
        answer["choices"][0]["message"]["content"].as_str().unwrap(),
        content(&streamed).0
    );
    assert_eq!(MockStats::get(&mock.stats.chat_requests), calls);
}

#[tokio::test]
async fn dedup_answers_a_paraphrase_with_the_disclaimer_and_refuses_look_alikes() {
    let mock = start_mock(MockOptions::default()).await;
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\n[cache.dedup]\nenabled = true\n",
        mock.base_url()
    );
    let proxy = start_proxy(&toml).await;
    let ask = |text: &str, user: &str| {
        json!({"model": "gpt-4o", "temperature": 0.7, "user": user, "messages": [
            {"role": "system", "content": "You are a support bot."},
            {"role": "user", "content": text}]})
    };
    let first = post(&proxy, &ask("How do I reset my password?", "u1"), "k", &[]).await;
    let original: Value = first.json().await.unwrap();
    let original_text = original["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    // Another user asks the same thing in other words: the earlier answer, marked.
    let mut reused = None;
    for _ in 0..100 {
        let response = post(&proxy, &ask("How can I reset my password", "u2"), "k", &[]).await;
        if cache_header(&response) == "dedup" {
            reused = Some(response.json::<Value>().await.unwrap());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let reused = reused.expect("never a dedup hit");
    let text = reused["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        text,
        format!("[Answer retrieved from an earlier conversation]\n\n{original_text}")
    );
    assert_eq!(reused["usage"]["total_tokens"], 0);
    // Look-alikes never hit.
    for different in [
        "How do I not reset my password?",
        "How do I reset my PIN?",
        "Why do I reset my password?",
    ] {
        let response = post(&proxy, &ask(different, "u3"), "k", &[]).await;
        assert_ne!(cache_header(&response), "dedup", "{different}");
    }
    // Another scope (system prompt) never hits.
    let mut other = ask("How can I reset my password", "u4");
    other["messages"][0]["content"] = json!("You are a different bot.");
    assert_ne!(cache_header(&post(&proxy, &other, "k", &[]).await), "dedup");
}

#[tokio::test]
async fn dedup_with_the_upstream_embedder_and_its_failures() {
    let mock = start_mock(MockOptions::default()).await;
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\n[cache.dedup]\nenabled = true\nembedder = \"upstream\"\n\
         embedding_model = \"mock-lexical-1\"\n",
        mock.base_url()
    );
    let proxy = start_proxy(&toml).await;
    let ask = |text: &str| {
        json!({"model": "gpt-4o", "temperature": 0.7, "messages": [
            {"role": "system", "content": "You are a support bot."},
            {"role": "user", "content": text}]})
    };
    post(&proxy, &ask("How do I export my data?"), "k", &[])
        .await
        .bytes()
        .await
        .unwrap();
    assert_eq!(MockStats::get(&mock.stats.embeddings_requests), 1);
    let mut hit = false;
    for _ in 0..100 {
        let response = post(&proxy, &ask("How can I export my data"), "k", &[]).await;
        if cache_header(&response) == "dedup" {
            hit = true;
            break;
        }
        response.bytes().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(hit, "never a dedup hit with the upstream embedder");
    // The embeddings call fails: the question goes to the model, uncached, and is counted.
    let chats = MockStats::get(&mock.stats.chat_requests);
    let response = post(
        &proxy,
        &ask("How can I export my data"),
        "k",
        &[("x-mock-embeddings-status", "503")],
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_ne!(cache_header(&response), "dedup");
    response.bytes().await.unwrap();
    assert_eq!(MockStats::get(&mock.stats.chat_requests), chats + 1);
    assert_eq!(
        proxy
            .metric(
                "ctxproxy_cache_requests_total",
                &[("cache", "dedup"), ("result", "error")]
            )
            .await,
        1.0
    );
}

#[tokio::test]
async fn with_redis_down_requests_succeed_and_repeats_are_served_from_memory() {
    let mock = start_mock(MockOptions::default()).await;
    let closed = common::closed_port().await;
    let proxy = common::start_proxy_with_env(
        &format!("[upstream]\nbase_url = \"{}\"\n", mock.base_url()),
        vec![(
            "CTXPROXY_STORE_REDIS_URL".into(),
            format!("redis://127.0.0.1:{closed}"),
        )],
    )
    .await;
    let body = question("What is the capital of Chile?");
    let mut outcomes = Vec::new();
    for _ in 0..8 {
        let response = post(&proxy, &body, "k", &[]).await;
        assert_eq!(response.status(), 200);
        outcomes.push(cache_header(&response));
        response.bytes().await.unwrap();
    }
    // Once the breaker opens, this replica's memory is the store: a miss, then hits.
    assert_eq!(
        outcomes.last().map(String::as_str),
        Some("hit"),
        "{outcomes:?}"
    );
    let asked = MockStats::get(&mock.stats.chat_requests);
    assert!(asked < 8, "{asked} model calls for 8 repeats: {outcomes:?}");
    let ready: Value = client()
        .get(proxy.url("/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["store"]["serving"], "memory", "{ready}");
}

#[tokio::test]
async fn without_auth_an_answer_goes_only_to_callers_with_the_same_key_query_and_account() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::proxy_for(&mock, "").await;
    let body = question("What is the capital of Portugal?");
    until_hit(&proxy, &body, "sk-customer-ONE").await;

    // No key, another key, or the same key to another API version or account: misses.
    let anonymous = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(cache_header(&anonymous), "miss");
    assert_eq!(
        cache_header(&post(&proxy, &body, "sk-revoked", &[]).await),
        "miss"
    );
    let versioned = client()
        .post(proxy.url("/v1/chat/completions?api-version=2024-06-01"))
        .bearer_auth("sk-customer-ONE")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(cache_header(&versioned), "miss");
    for header in ["openai-organization", "openai-project"] {
        let other = post(&proxy, &body, "sk-customer-ONE", &[(header, "other")]).await;
        assert_eq!(cache_header(&other), "miss", "{header}");
    }
    // The same caller still hits.
    assert_eq!(
        cache_header(&post(&proxy, &body, "sk-customer-ONE", &[]).await),
        "hit"
    );
}

#[tokio::test]
async fn answers_over_max_entry_bytes_are_relayed_whole_and_never_stored() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::proxy_for(&mock, "[cache]\nmax_entry_bytes = 2000\n").await;
    let long = "word ".repeat(1000);
    for stream in [false, true] {
        let mut body = question(&format!("Tell me a long story ({stream})"));
        body["stream"] = json!(stream);
        for _ in 0..3 {
            let response = post(&proxy, &body, "sk-one", &[("x-mock-reply", long.trim())]).await;
            assert_eq!(cache_header(&response), "miss", "stream: {stream}");
            let text = response.text().await.unwrap();
            let words = if stream {
                text.matches("word").count()
            } else {
                let answer: Value = serde_json::from_str(&text).unwrap();
                answer["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .matches("word")
                    .count()
            };
            assert_eq!(words, 1000, "relayed whole (stream: {stream})");
        }
    }
    assert!(proxy.metric("ctxproxy_cache_too_large_total", &[]).await >= 6.0);
}
