//! A way back for what a cap drops, through the running proxy and the mock upstream: a cleared
//! result names a handle, the request offers `ctxproxy_recall`, and a model that calls it gets
//! the original, asked again by the proxy; the client sees only the answer after it (JSON and
//! streams), with the `X-Ctxproxy-Recalled` header and the metric. A handle that names nothing
//! in the request gets a clear tool result; the store plays no part, so Redis down changes
//! nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Mock, Proxy, client, closed_port, start_mock, start_proxy_with_env};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use ctxproxy::pipeline::recall;
use serde_json::{Value, json};

/// Every old result cleared as soon as it is old enough; the tools block sent whole.
fn config(mock: &Mock) -> String {
    format!(
        "[upstream]\nbase_url = \"{}\"\ntool_definitions = \"in_place\"\n\
         [pipeline.compact]\nclear_at_least_tokens = 0\n",
        mock.base_url()
    )
}

async fn proxy(mock: &Mock) -> Proxy {
    start_proxy_with_env(&config(mock), Vec::new()).await
}

/// One query's result: a table of rows, large enough that clearing the old ones pays for the
/// prefix it breaks (`clear_at_least_tokens`).
fn result(step: usize) -> String {
    let rows: Vec<Value> = (0..24)
        .map(|row| {
            json!({"region": format!("R{step}-{row:02}"), "revenue": 1000 + step * 100 + row,
                "note": "Figures are net of returns and include every channel of the quarter."})
        })
        .collect();
    serde_json::to_string_pretty(&rows).unwrap()
}

/// An agent conversation with six query results, then a question.
fn conversation(stream: bool, question: &str) -> Value {
    let mut messages =
        vec![json!({"role": "user", "content": "Report revenue by region for six quarters."})];
    for step in 0..6 {
        let id = format!("call_{step}");
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
            "type": "function", "function": {"name": "run_query",
                "arguments": format!("{{\"quarter\": {step}}}")}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": result(step)}));
    }
    messages.push(json!({"role": "assistant", "content": "I have all six quarters."}));
    messages.push(json!({"role": "user", "content": question}));
    json!({"model": "gpt-4o", "stream": stream,
        "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
        "messages": messages,
        "tools": [{"type": "function", "function": {"name": "run_query",
            "description": "Run a revenue query for a quarter.",
            "parameters": {"type": "object", "properties": {"quarter": {"type": "integer"}}}}}]})
}

async fn post(proxy: &Proxy, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client().post(proxy.url("/v1/chat/completions")).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

fn chat_count(mock: &Mock) -> u64 {
    MockStats::get(&mock.stats.chat_requests)
}

#[tokio::test]
async fn a_cleared_result_names_a_handle_and_the_request_offers_recall() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy(&mock).await;
    let explained = proxy
        .explain(&conversation(false, "Which region led?"), &[])
        .await;
    let sent = &explained["request"];
    let tools = sent["tools"].as_array().unwrap();
    assert_eq!(tools.last().unwrap()["function"]["name"], recall::TOOL_NAME);
    let first = sent["messages"][2]["content"].as_str().unwrap();
    let handle = recall::handle_of(&result(0));
    assert!(
        first.contains("result cleared") && first.ends_with(&format!("; recall {handle}]")),
        "{first}"
    );
    let compact = explained["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "compact")
        .unwrap();
    assert!(
        compact["details"]["handles"]
            .as_array()
            .unwrap()
            .contains(&json!(handle)),
        "{compact}"
    );
}

#[tokio::test]
async fn a_json_recall_is_answered_by_the_proxy_and_the_client_sees_only_the_answer() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy(&mock).await;
    let headers = [("X-Mock-Recall", "first"), ("X-Mock-Echo", "1")];
    let response = post(&proxy, &conversation(false, "Which region led?"), &headers).await;
    assert_eq!(response.status(), 200);
    let handle = recall::handle_of(&result(0));
    assert_eq!(response.headers()["x-ctxproxy-recalled"], handle.as_str());
    let answer: Value = response.json().await.unwrap();
    let message = &answer["choices"][0]["message"];
    assert!(message["tool_calls"].is_null(), "{answer}");
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    assert!(
        message["content"]
            .as_str()
            .unwrap()
            .starts_with("Mock summary of the tool result: ["),
        "{answer}"
    );
    assert_eq!(chat_count(&mock), 2);
    // The re-ask carries the call and the original, byte for byte, last.
    let reasked = answer["mock_echo"]["body"]["messages"].as_array().unwrap();
    let (call, original) = (&reasked[reasked.len() - 2], &reasked[reasked.len() - 1]);
    assert_eq!(call["tool_calls"][0]["function"]["name"], recall::TOOL_NAME);
    assert_eq!(original["tool_call_id"], call["tool_calls"][0]["id"]);
    assert_eq!(original["content"].as_str().unwrap(), result(0));
    let found = proxy
        .metric("ctxproxy_tool_recalls_total", &[("outcome", "found")])
        .await;
    assert_eq!(found, 1.0);
}

#[tokio::test]
async fn a_streamed_recall_is_answered_in_the_same_stream() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy(&mock).await;
    let response = post(
        &proxy,
        &conversation(true, "Which region led?"),
        &[("X-Mock-Recall", "first")],
    )
    .await;
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert!(!body.contains(recall::TOOL_NAME), "{body}");
    let mut text = String::new();
    let mut usage = None;
    for payload in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if payload == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(payload).unwrap();
        text.push_str(
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or(""),
        );
        if chunk["usage"].is_object() {
            usage = Some(chunk["usage"].clone());
        }
    }
    assert!(
        text.starts_with("Mock summary of the tool result: ["),
        "{text}"
    );
    assert_eq!(chat_count(&mock), 2);
    // The usage of both answers.
    assert!(usage.unwrap()["completion_tokens"].as_u64().unwrap() > 0);
    let found = proxy
        .metric("ctxproxy_tool_recalls_total", &[("outcome", "found")])
        .await;
    assert_eq!(found, 1.0);
}

#[tokio::test]
async fn a_handle_of_another_conversation_gets_a_clear_tool_result() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy(&mock).await;
    // A handle this request never held (another conversation's result, any tenant's).
    let foreign = recall::handle_of("a result of another conversation");
    let headers = [("X-Mock-Recall", foreign.as_str()), ("X-Mock-Echo", "1")];
    let response = post(&proxy, &conversation(false, "Which region led?"), &headers).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert!(answer["choices"][0]["message"]["tool_calls"].is_null());
    let reasked = answer["mock_echo"]["body"]["messages"].as_array().unwrap();
    let told = reasked.last().unwrap()["content"].as_str().unwrap();
    assert_eq!(told, recall::unknown(&foreign));
    let unknown = proxy
        .metric("ctxproxy_tool_recalls_total", &[("outcome", "unknown")])
        .await;
    assert_eq!(unknown, 1.0);
}

#[tokio::test]
async fn recall_needs_no_store() {
    let mock = start_mock(MockOptions::default()).await;
    let down = format!("redis://127.0.0.1:{}", closed_port().await);
    let proxy = start_proxy_with_env(
        &config(&mock),
        vec![("CTXPROXY_STORE_REDIS_URL".into(), down)],
    )
    .await;
    let headers = [("X-Mock-Recall", "first"), ("X-Mock-Echo", "1")];
    let answer: Value = post(&proxy, &conversation(false, "Which region led?"), &headers)
        .await
        .json()
        .await
        .unwrap();
    let reasked = answer["mock_echo"]["body"]["messages"].as_array().unwrap();
    assert_eq!(
        reasked.last().unwrap()["content"].as_str().unwrap(),
        result(0)
    );
}

#[tokio::test]
async fn no_recall_tool_without_a_shortened_result_or_without_client_tools() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy(&mock).await;
    // Nothing cleared: the client's block as it came.
    let short = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}],
        "tools": conversation(false, "")["tools"].clone()});
    let explained = proxy.explain(&short, &[]).await;
    let names: Vec<&str> = explained["request"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(names, ["run_query"]);
    // Results but no tools: stubs name no handle, no tool is added.
    let mut toolless = conversation(false, "Which region led?");
    toolless.as_object_mut().unwrap().remove("tools");
    let explained = proxy.explain(&toolless, &[]).await;
    assert!(explained["request"]["tools"].is_null(), "{explained}");
    let first = explained["request"]["messages"][2]["content"]
        .as_str()
        .unwrap();
    assert!(!first.contains("rc-"), "{first}");
}

#[tokio::test]
async fn the_next_turn_keeps_the_recalled_result_where_the_re_ask_put_it() {
    let mock = start_mock(MockOptions::default()).await;
    // A conversation appended to: rebuilding never pays here.
    let appended = format!(
        "[pipeline]\nclear_at_least_tokens = 1000000\n{}",
        config(&mock)
    );
    let proxy = start_proxy_with_env(&appended, Vec::new()).await;
    let first = conversation(false, "Which region led?");
    let headers = [("X-Mock-Recall", "first"), ("X-Mock-Echo", "1")];
    let answer: Value = post(&proxy, &first, &headers).await.json().await.unwrap();
    let reasked = answer["mock_echo"]["body"]["messages"].clone();
    let said = answer["choices"][0]["message"]["content"].clone();
    // The client's next turn: its history, the answer it got, a new question.
    let mut next = first.clone();
    let messages = next["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": said}));
    messages.push(json!({"role": "user", "content": "And the lowest?"}));
    // The mark is saved in the background.
    let mut sent = Value::Null;
    for _ in 0..50 {
        let answer: Value = post(&proxy, &next, &[("X-Mock-Echo", "1")])
            .await
            .json()
            .await
            .unwrap();
        sent = answer["mock_echo"]["body"]["messages"].clone();
        if sent.as_array().unwrap().len() > next["messages"].as_array().unwrap().len() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (reasked, sent) = (reasked.as_array().unwrap(), sent.as_array().unwrap());
    // What the re-ask sent is a prefix of the next request, byte for byte: the pair stays.
    assert_eq!(&sent[..reasked.len()], &reasked[..], "{sent:#?}");
    assert_eq!(sent[reasked.len()]["content"], said);
}
