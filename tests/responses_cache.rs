//! The deterministic cache on `POST /v1/responses`, through the proxy, the mock and the test
//! Redis: a stateless request (`store: false`) is answered from the cache as JSON or as a
//! replayed event stream, whichever way the answer was stored; a request whose Response is kept
//! upstream (`store` true or absent) or chained is never answered from it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Mock, Proxy, client, proxy_for, start_mock};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use serde_json::{Value, json};

fn question(text: &str, stream: bool) -> Value {
    json!({"model": "gpt-4o", "temperature": 0, "store": false, "stream": stream,
           "instructions": "Be brief.", "input": [{"role": "user", "content": text}]})
}

async fn post(proxy: &Proxy, body: &Value) -> reqwest::Response {
    client()
        .post(proxy.url("/v1/responses"))
        .json(body)
        .send()
        .await
        .unwrap()
}

fn cache_of(response: &reqwest::Response) -> String {
    response.headers()["x-ctxproxy-cache"]
        .to_str()
        .unwrap()
        .to_owned()
}

fn upstream_calls(mock: &Mock) -> u64 {
    MockStats::get(&mock.stats.responses_requests)
}

/// Sends `body` until it is a hit (the entry is written once the first answer has ended).
async fn until_hit(proxy: &Proxy, body: &Value) -> reqwest::Response {
    for _ in 0..100 {
        let response = post(proxy, body).await;
        if cache_of(&response) == "hit" {
            return response;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("never a hit");
}

/// The `data` of every event of a stream.
fn events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|event| event.split_once("data: "))
        .map(|(_, data)| serde_json::from_str(data).unwrap())
        .collect()
}

#[tokio::test]
async fn a_stateless_request_is_answered_from_the_cache_as_json_or_as_events() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let body = question("What is the capital of France?", false);
    let first = post(&proxy, &body).await;
    assert_eq!(cache_of(&first), "miss");
    let first: Value = first.json().await.unwrap();
    let hit: Value = until_hit(&proxy, &body).await.json().await.unwrap();
    assert_eq!(hit, first);
    let calls = upstream_calls(&mock);

    let streamed = until_hit(&proxy, &question("What is the capital of France?", true)).await;
    assert_eq!(
        streamed.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let events = events(&streamed.text().await.unwrap());
    assert_eq!(events.first().unwrap()["type"], "response.created");
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.completed");
    assert_eq!(last["response"], first);
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(
        text,
        first["output"][0]["content"][0]["text"].as_str().unwrap()
    );
    assert_eq!(
        upstream_calls(&mock),
        calls,
        "answered without the upstream"
    );
    assert!(proxy.metric("ctxproxy_cache_tokens_saved_total", &[]).await > 0.0);
}

#[tokio::test]
async fn a_streamed_answer_is_stored_from_its_completed_event() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let streamed = post(&proxy, &question("Name a prime number.", true)).await;
    let events = events(&streamed.text().await.unwrap());
    let completed = events.last().unwrap()["response"].clone();
    let hit: Value = until_hit(&proxy, &question("Name a prime number.", false))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(hit, completed);
}

#[tokio::test]
async fn a_response_kept_upstream_or_chained_is_never_answered_from_the_cache() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let mut kept = question("What is two plus two?", false);
    kept.as_object_mut().unwrap().remove("store");
    let mut chained = question("And three plus three?", false);
    chained["previous_response_id"] = json!("resp_1");
    for body in [kept, chained] {
        for _ in 0..3 {
            let answer = post(&proxy, &body).await;
            assert_eq!(cache_of(&answer), "bypass", "{body}");
        }
    }
    assert_eq!(upstream_calls(&mock), 6);
}
