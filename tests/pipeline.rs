//! The pipeline through the running proxy: the mock upstream receives the rewritten request,
//! the headers carry the counts, `observe` forwards the original, `off` does nothing, an
//! over-budget request is refused with the counts, and a second replica appends to a
//! conversation where the first left off (prefix state in Redis).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{client, proxy_for, start_mock};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use serde_json::Value;

/// A 12-turn conversation with two system messages, a tool call and a large JSON tool result.
async fn send(url: &str, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client().post(url).header("x-mock-echo", "1").json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

fn counts(response: &reqwest::Response) -> (usize, usize) {
    let get = |name: &str| {
        response.headers()[name]
            .to_str()
            .unwrap()
            .parse::<usize>()
            .unwrap()
    };
    (
        get("x-ctxproxy-tokens-before"),
        get("x-ctxproxy-tokens-after"),
    )
}

#[tokio::test]
async fn optimize_sends_the_rewritten_request_and_reports_counts() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let body = common::long_conversation();
    let response = send(&proxy.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(response.status(), 200);
    let (before, after) = counts(&response);
    assert!(after < before / 2, "{before} → {after}");
    let answer: Value = response.json().await.unwrap();
    let sent = &answer["mock_echo"]["body"];

    // What the upstream got is exactly what explain says would be sent.
    let explained: Value = client()
        .post(proxy.url("/v1/ctxproxy/explain"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(&explained["request"], sent);
    assert_eq!(explained["tokens_before"], before);
    assert_eq!(explained["tokens_after"], after);
    let stages: Vec<&str> = explained["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["stage"].as_str().unwrap())
        .collect();
    // The history shows earlier requests: the last rewrite rebuilt whole is appended to.
    assert_eq!(
        stages,
        vec!["system", "window", "tools", "compact", "append"]
    );
    assert!(explained["prefix"]["appended_messages"].as_u64().unwrap() > 0);

    let messages = sent["messages"].as_array().unwrap();
    // One system message, first, with the client's text verbatim at its start.
    assert_eq!(messages.iter().filter(|m| m["role"] == "system").count(), 1);
    let system = messages[0]["content"].as_str().unwrap();
    assert!(system.starts_with("You are a travel agent. Be precise."));
    assert!(system.contains("<system>\nPrices are in EUR.\n</system>"));
    assert!(system.contains("<conversation_summary>"));
    // The last user message is byte-identical.
    assert_eq!(messages.last(), body["messages"].as_array().unwrap().last());
    // The tool call and its (compacted) result stay together; identifiers kept verbatim.
    let tool_index = messages.iter().position(|m| m["role"] == "tool").unwrap();
    assert_eq!(messages[tool_index - 1]["tool_calls"][0]["id"], "call_1");
    let result = messages[tool_index]["content"].as_str().unwrap();
    assert!(
        result.contains("\"owner\":\"acme\"") && result.contains("https://example.com/trips/0")
    );
    assert!(result.contains(" of 150; identifiers in the others: "));
}

#[tokio::test]
async fn observe_forwards_the_original_and_off_reports_nothing() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let body = common::long_conversation();
    let observed = send(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("x-ctxproxy-mode", "observe")],
    )
    .await;
    let (before, after) = counts(&observed);
    assert_eq!(after, before, "observe sends the original");
    let saveable: usize = observed.headers()["x-ctxproxy-tokens-saveable"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(saveable < before);
    let answer: Value = observed.json().await.unwrap();
    assert_eq!(answer["mock_echo"]["body"], body);
    assert!(
        answer["mock_echo"]["headers"]
            .get("x-ctxproxy-mode")
            .is_none()
    );

    let off = send(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("x-ctxproxy-mode", "off")],
    )
    .await;
    assert!(off.headers().get("x-ctxproxy-tokens-before").is_none());
    let answer: Value = off.json().await.unwrap();
    assert_eq!(answer["mock_echo"]["body"], body);

    let bad = send(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("x-ctxproxy-mode", "fast")],
    )
    .await;
    assert_eq!(bad.status(), 400);
    let error: Value = bad.json().await.unwrap();
    assert_eq!(error["error"]["param"], "X-Ctxproxy-Mode");

    // Observe counts the original as sent and what it would have saved apart.
    let metrics = proxy.metrics().await;
    assert_eq!(
        sum_of(
            &metrics,
            "ctxproxy_prompt_tokens_total",
            &[("phase", "sent")]
        ),
        before
    );
    assert_eq!(sum_of(&metrics, "ctxproxy_tokens_saved_total", &[]), 0);
    assert_eq!(
        sum_of(&metrics, "ctxproxy_observe_tokens_saveable_total", &[]),
        before - saveable
    );
}

/// The sum of the samples whose line starts with `needle`.
fn sum_of(metrics: &str, name: &str, labels: &[(&str, &str)]) -> usize {
    common::metric_sum(metrics, name, labels) as usize
}

#[tokio::test]
async fn over_the_floor_is_forwarded_flagged_by_default_or_refused_by_policy() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let body = common::long_conversation();
    // Default: the floor (system, tools, working set, ledger) is sent, flagged and counted.
    let forwarded = send(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("x-ctxproxy-budget", "20")],
    )
    .await;
    assert_eq!(forwarded.status(), 200);
    let (_, after) = counts(&forwarded);
    let over: usize = forwarded.headers()["x-ctxproxy-over-budget"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // Over the budget and the recall tool's allowance beside it (`pipeline::recall`).
    let allowance = after - 20 - over;
    assert!(allowance > 0 && allowance <= 64, "{allowance}");
    assert_eq!(MockStats::get(&mock.stats.chat_requests), 1);
    let metrics = proxy.metrics().await;
    assert_eq!(
        sum_of(
            &metrics,
            "ctxproxy_budget_outcomes_total",
            &[("outcome", "over_floor")]
        ),
        1,
        "{metrics}"
    );
    // Explain says which part of the floor is over.
    let explained = proxy.explain(&body, &[("x-ctxproxy-budget", "20")]).await;
    assert_eq!(explained["over_budget"]["tokens_over"], over);
    // The system message fits the budget applied (20 and the recall tool's allowance); the
    // working set is what goes over it.
    assert_eq!(explained["over_budget"]["part"], "working_set");
    assert!(
        explained["over_budget"]["floor"]["working_set"]
            .as_u64()
            .unwrap()
            > 0
    );

    // A budget the stages can reach: the tighter steps run, the request fits, no flag.
    let fitted = send(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("x-ctxproxy-budget", "900")],
    )
    .await;
    assert_eq!(fitted.status(), 200);
    let (_, after) = counts(&fitted);
    assert!(after <= 900, "{after}");
    assert!(fitted.headers().get("x-ctxproxy-over-budget").is_none());

    let rejecting = proxy_for(&mock, "[pipeline.budget]\non_exceed = \"reject\"\n").await;
    let refused = send(
        &rejecting.url("/v1/chat/completions"),
        &body,
        &[("x-ctxproxy-budget", "20")],
    )
    .await;
    assert_eq!(refused.status(), 400);
    let error: Value = refused.json().await.unwrap();
    assert_eq!(error["error"]["code"], "context_budget_exceeded");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("budget of 20")
    );
    assert_eq!(MockStats::get(&mock.stats.chat_requests), 2);
}

#[tokio::test]
async fn savings_are_counted_in_metrics() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let response = send(
        &proxy.url("/v1/chat/completions"),
        &common::long_conversation(),
        &[],
    )
    .await;
    let (before, after) = counts(&response);
    let metrics = proxy.metrics().await;
    let tokens = |phase: &str| {
        sum_of(
            &metrics,
            "ctxproxy_prompt_tokens_total",
            &[("phase", phase)],
        )
    };
    assert_eq!(tokens("original"), before);
    assert_eq!(tokens("sent"), after);
    assert_eq!(
        sum_of(&metrics, "ctxproxy_tokens_saved_total", &[]),
        before - after
    );
    assert_eq!(
        sum_of(
            &metrics,
            "ctxproxy_pipeline_duration_seconds_count",
            &[("tenant", "default")]
        ),
        1
    );
}

/// Prefix stability across replicas: replica A serves a conversation request by request and
/// remembers in Redis where its rewrite was last rebuilt; replica B, which never saw the
/// conversation, serves the next request: it sends what A would have sent, appended to what A
/// sent before.
#[tokio::test]
async fn a_second_replica_appends_where_the_first_left_off() {
    let mock = start_mock(MockOptions::default()).await;
    let prefix = common::unique_prefix("prefix-state");
    let env = vec![("CTXPROXY_STORE_KEY_PREFIX".to_owned(), prefix.clone())];
    let toml = format!("[upstream]\nbase_url = \"{}\"\n", mock.base_url());
    let a = common::start_proxy_with_env(&toml, env.clone()).await;
    let b = common::start_proxy_with_env(&toml, env).await;

    // The requests a client sent: before each assistant message that follows a user turn.
    let full = serde_json::to_value(ctxproxy::synthetic::conversation(12).unwrap()).unwrap();
    let messages = full["messages"].as_array().unwrap();
    let mut lens: Vec<usize> = (2..messages.len())
        .filter(|&i| messages[i]["role"] == "assistant" && messages[i - 1]["role"] != "assistant")
        .collect();
    lens.push(messages.len());
    let request = |len: usize| {
        let mut body = full.clone();
        body["messages"] = Value::Array(messages[..len].to_vec());
        body
    };
    // No budget pressure: appending is what the threshold decides.
    let headers = [
        ("x-conversation-id", "replicas-1"),
        ("x-ctxproxy-budget", "1000000"),
    ];
    let sent_by = |answer: &Value| answer["mock_echo"]["body"].clone();
    let mut previous = Value::Null;
    for &len in &lens[..lens.len() - 1] {
        let response = send(&a.url("/v1/chat/completions"), &request(len), &headers).await;
        assert_eq!(response.status(), 200);
        previous = sent_by(&response.json().await.unwrap());
    }

    // What A remembered: as of its last request.
    let mut redis = redis::Client::open(common::redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}prefix:*"))
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let stored: String = redis::cmd("GET")
        .arg(&keys[0])
        .query_async(&mut redis)
        .await
        .unwrap();
    let stored: Value = serde_json::from_str(&stored).unwrap();
    assert_eq!(stored["as_of"], lens[lens.len() - 2]);

    // B serves the next request; A explains it.
    let last = request(messages.len());
    let response = send(&b.url("/v1/chat/completions"), &last, &headers).await;
    assert_eq!(response.status(), 200);
    let sent = sent_by(&response.json().await.unwrap());
    let explained = a.explain(&last, &headers).await;
    assert_eq!(sent, explained["request"]);
    assert!(
        explained["prefix"]["rebuilt"].is_null(),
        "{}",
        explained["prefix"]
    );
    assert!(explained["prefix"]["appended_messages"].as_u64().unwrap() > 1);
    assert_eq!(sent["tools"], previous["tools"]);
    let (now, before) = (
        sent["messages"].as_array().unwrap(),
        previous["messages"].as_array().unwrap(),
    );
    assert_eq!(&now[..before.len()], &before[..]);
}

/// A proxy on its own key prefix, with a connection to its store.
async fn proxy_with_store(
    name: &str,
) -> (
    common::Mock,
    common::Proxy,
    String,
    redis::aio::MultiplexedConnection,
) {
    let mock = start_mock(MockOptions::default()).await;
    let prefix = common::unique_prefix(name);
    let env = vec![("CTXPROXY_STORE_KEY_PREFIX".to_owned(), prefix.clone())];
    let toml = format!("[upstream]\nbase_url = \"{}\"\n", mock.base_url());
    let proxy = common::start_proxy_with_env(&toml, env).await;
    let redis = redis::Client::open(common::redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    (mock, proxy, prefix, redis)
}

async fn keys(redis: &mut redis::aio::MultiplexedConnection, pattern: &str) -> Vec<String> {
    redis::cmd("KEYS")
        .arg(pattern)
        .query_async(redis)
        .await
        .unwrap()
}

/// The keys matching `pattern`, once there are some (the proxy writes in the background).
async fn written(redis: &mut redis::aio::MultiplexedConnection, pattern: &str) -> Vec<String> {
    for _ in 0..200 {
        let found = keys(redis, pattern).await;
        if !found.is_empty() {
            return found;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    Vec::new()
}

fn first_request() -> Value {
    serde_json::json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a ledger?"}
    ]})
}

fn second_request() -> Value {
    let mut later = first_request();
    let messages = later["messages"].as_array_mut().unwrap();
    messages.push(serde_json::json!({"role": "assistant", "content": "A record of entries."}));
    messages.push(serde_json::json!({"role": "user", "content": "And a journal?"}));
    later
}

#[tokio::test]
async fn a_first_request_leaves_no_prefix_state_and_a_later_one_does() {
    let (_mock, proxy, prefix, mut redis) = proxy_with_store("first-request").await;
    let url = proxy.url("/v1/chat/completions");
    // Any replica finds a first request's state from its history alone: none is written.
    let response = send(&url, &first_request(), &[("x-conversation-id", "first-1")]).await;
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    // A later request of another conversation, sent after it: once its state is written, the
    // first request's would have been too.
    let response = send(&url, &second_request(), &[("x-conversation-id", "later-1")]).await;
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    let stored = written(&mut redis, &format!("{prefix}prefix:*")).await;
    // One key: the later request's (each conversation id hashes to a key of its own).
    assert_eq!(stored.len(), 1, "{stored:?}");
}

#[tokio::test]
async fn a_recall_pair_is_not_put_back_into_a_first_request_without_tools() {
    let (_mock, proxy, prefix, mut redis) = proxy_with_store("first-no-tools").await;
    let url = proxy.url("/v1/chat/completions");
    let headers = [("x-conversation-id", "marked-1"), ("X-Mock-Echo", "1")];
    // The conversation's key as the proxy writes it, from a later request's state.
    let response = send(&url, &second_request(), &headers).await;
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    let stored = written(&mut redis, &format!("{prefix}prefix:*")).await;
    let conversation = stored[0].strip_prefix(&format!("{prefix}prefix:")).unwrap();
    // A recall answered after the first request's messages (by a request under the same key
    // that sent tools).
    let first = first_rewritten();
    let at = first["messages"].as_array().unwrap().len();
    let mark = serde_json::json!([{"at": at, "call": {"role": "assistant", "content": null,
        "tool_calls": [{"id": "call_recall", "type": "function", "function": {
            "name": "ctxproxy_recall", "arguments": "{\"handle\": \"rc-0000abcd\"}"}}]}}]);
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}recall:{conversation}"))
        .arg(mark.to_string())
        .query_async(&mut redis)
        .await
        .unwrap();

    // Without tools the request cannot call the recall tool: no recall pair goes into it.
    let response = send(&url, &first, &headers).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    let sent = answer["mock_echo"]["body"]["messages"]
        .as_array()
        .unwrap()
        .clone();
    // Its instructions sent once: the request was rewritten.
    assert_eq!(sent.len(), at - 1, "{sent:?}");
    assert!(sent.iter().all(|m| m["role"] != "tool"), "{sent:?}");
}

/// A first request the pipeline rewrites (its repeated instructions sent once), without tools.
fn first_rewritten() -> Value {
    let rule = "Be brief and answer in English, please.";
    serde_json::json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": rule},
        {"role": "system", "content": rule},
        {"role": "user", "content": "What is a ledger?"}
    ]})
}
