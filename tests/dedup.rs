//! The dedup cache's contract through the running proxy, the mock upstream and the machine's
//! Redis: a paraphrase under the same request contract and conversation gets the earlier
//! answer; a change of contract (response format, tools, tool choice, limits, reasoning, n,
//! logprobs, an unknown field) or of the turns before the question never does, and reaches the
//! model.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{Mock, Proxy, client, start_mock, start_proxy_with_env, unique_prefix};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use serde_json::{Value, json};

async fn setup() -> (Mock, Proxy) {
    let mock = start_mock(MockOptions::default()).await;
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\n[cache.dedup]\nenabled = true\n",
        mock.base_url()
    );
    let env = vec![("CTXPROXY_STORE_KEY_PREFIX".into(), unique_prefix("dedup"))];
    let proxy = start_proxy_with_env(&toml, env).await;
    (mock, proxy)
}

fn ask(text: &str) -> Value {
    json!({"model": "gpt-4o", "temperature": 0.7, "messages": [
        {"role": "system", "content": "You are a support bot."},
        {"role": "user", "content": text}]})
}

/// The cache outcome of `body`, its answer read whole.
async fn outcome(proxy: &Proxy, body: &Value) -> String {
    let response = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let cache = response.headers()["x-ctxproxy-cache"]
        .to_str()
        .unwrap()
        .to_owned();
    response.bytes().await.unwrap();
    cache
}

/// Asks `original`, then `paraphrase` until it is answered from the dedup cache (the entry is
/// written after the first answer ends).
async fn stored(proxy: &Proxy, original: &Value, paraphrase: &Value) {
    outcome(proxy, original).await;
    for _ in 0..100 {
        if outcome(proxy, paraphrase).await == "dedup" {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never a dedup hit for {paraphrase}");
}

fn chats(mock: &Mock) -> u64 {
    MockStats::get(&mock.stats.chat_requests)
}

#[tokio::test]
async fn a_change_of_contract_never_reuses_an_answer() {
    let (mock, proxy) = setup().await;
    let paraphrase = ask("How can I reset my password");
    stored(&proxy, &ask("How do I reset my password?"), &paraphrase).await;
    let tools = json!([{"type": "function", "function": {"name": "reset_password",
        "parameters": {"type": "object", "properties": {}}}}]);
    let changes = [
        ("response_format", json!({"type": "json_object"})),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "answer",
                "schema": {"type": "object"}}}),
        ),
        ("tools", tools.clone()),
        ("max_tokens", json!(5)),
        ("reasoning_effort", json!("high")),
        ("n", json!(2)),
        ("logprobs", json!(true)),
        ("a_parameter_from_next_year", json!(true)),
    ];
    for (field, value) in changes {
        let mut body = paraphrase.clone();
        body[field] = value;
        let before = chats(&mock);
        assert_ne!(outcome(&proxy, &body).await, "dedup", "{field}");
        assert_eq!(chats(&mock), before + 1, "{field} reached the model");
    }
    let mut choice = paraphrase.clone();
    choice["tools"] = tools;
    choice["tool_choice"] = json!("none");
    assert_eq!(outcome(&proxy, &choice).await, "miss");
    // Sampling knobs are not part of the contract.
    let mut colder = paraphrase.clone();
    colder["temperature"] = json!(0.2);
    colder["top_p"] = json!(0.9);
    assert_eq!(outcome(&proxy, &colder).await, "dedup");
}

#[tokio::test]
async fn a_follow_up_is_answered_only_after_the_same_turns() {
    let (mock, proxy) = setup().await;
    let after = |city: &str, question: &str| {
        json!({"model": "gpt-4o", "temperature": 0.7, "messages": [
            {"role": "user", "content": format!("Tell me about {city}.")},
            {"role": "assistant", "content": format!("{city} is a large city.")},
            {"role": "user", "content": question}]})
    };
    stored(
        &proxy,
        &after("Paris", "What is its population?"),
        &after("Paris", "What's its population"),
    )
    .await;
    let before = chats(&mock);
    assert_eq!(
        outcome(&proxy, &after("Tokyo", "What is its population?")).await,
        "miss"
    );
    assert_eq!(chats(&mock), before + 1);
}
