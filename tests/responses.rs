//! `POST /v1/responses` through the proxy against the mock: a stateless agent's history is
//! rewritten by the chat pipeline and sent back in the Responses format, reasoning items byte for
//! byte right before the item that followed them; streams are relayed and end complete or with a
//! Responses error event, and a call to a stub or to the recall tool is answered by the proxy in
//! JSON and in the event stream; chained requests and other `/v1/responses/*` paths go as they came.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Mock, client, proxy_for, start_mock};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use ctxproxy::pipeline::recall;
use serde_json::{Value, json};

fn reasoning(k: usize) -> Value {
    json!({"type": "reasoning", "id": format!("rs_{k}"), "summary": [],
           "encrypted_content": format!("gAAAAB{}", "x".repeat(40) + &k.to_string())})
}

/// A support agent's stateless history: per turn a question, a reasoning item, a call, its
/// result (a sizeable JSON) and an answer; a hosted call and an unknown item in the middle; a
/// last question.
fn agent_history(turns: usize) -> Value {
    let mut input = Vec::new();
    for k in 0..turns {
        input.push(json!({"role": "user", "content": format!("What is the status of order {}?", 4700 + k)}));
        input.push(reasoning(k));
        input.push(
            json!({"type": "function_call", "call_id": format!("call_{k}"), "name": "get_order",
                          "arguments": format!("{{\"order_id\":\"{}\"}}", 4700 + k)}),
        );
        let items: Vec<Value> = (0..12)
            .map(|i| json!({"sku": format!("SKU-{k}-{i}"), "name": format!("Item number {i} of order {k}"), "qty": i + 1}))
            .collect();
        input.push(json!({"type": "function_call_output", "call_id": format!("call_{k}"),
                          "output": json!({"order_id": 4700 + k, "status": "shipped", "carrier": "DHL",
                                            "tracking": format!("TRK{k:06}"), "items": items}).to_string()}));
        input.push(json!({"type": "message", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": format!("Order {} has shipped with DHL.", 4700 + k), "annotations": []}]}));
        if k == turns / 2 {
            input.push(
                json!({"type": "web_search_call", "id": "ws_1", "status": "completed",
                              "action": {"type": "search", "query": "DHL delays"}}),
            );
            input.push(json!({"type": "future_item", "id": "fi_1"}));
        }
    }
    input.push(json!({"role": "user", "content": "And what about order 4711, the last one?"}));
    json!({
        "model": "gpt-4o",
        "store": false,
        "instructions": "You are a support agent for an online shop.",
        "include": ["reasoning.encrypted_content"],
        "input": input,
        "tools": [
            {"type": "function", "name": "get_order", "description": "Look up an order by id.",
             "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}},
            {"type": "web_search"}
        ],
        "text": {"verbosity": "low"}
    })
}

/// Every reasoning item of `sent` is one of `client`'s, still followed by the item that
/// followed it there.
fn reasoning_in_place(client: &Value, sent: &Value) -> bool {
    let (client, sent) = (
        client["input"].as_array().unwrap(),
        sent["input"].as_array().unwrap(),
    );
    sent.iter().enumerate().all(|(k, item)| {
        item["type"] != "reasoning"
            || client
                .iter()
                .position(|c| c == item)
                .is_some_and(|at| client.get(at + 1) == sent.get(k + 1))
    })
}

async fn post(proxy: &common::Proxy, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client().post(proxy.url("/v1/responses")).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn a_long_history_is_rewritten_and_each_reasoning_item_stays_with_its_item() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let body = agent_history(14);
    let answer = post(
        &proxy,
        &body,
        &[("X-Mock-Echo", "1"), ("X-Ctxproxy-Budget", "1500")],
    )
    .await;
    assert_eq!(answer.status(), 200);
    let header = |name: &str| {
        answer.headers()[name]
            .to_str()
            .unwrap()
            .parse::<usize>()
            .unwrap()
    };
    let (before, after) = (
        header("x-ctxproxy-tokens-before"),
        header("x-ctxproxy-tokens-after"),
    );
    assert!(after < before / 2, "rewritten: {before} -> {after}");
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(answer["object"], "response");
    let sent = &answer["mock_echo"]["body"];
    assert!(reasoning_in_place(&body, sent), "{sent}");
    let items = sent["input"].as_array().unwrap();
    assert!(items.len() < body["input"].as_array().unwrap().len());
    assert_eq!(items.last(), body["input"].as_array().unwrap().last());
    // The latest tool steps are kept whole, their reasoning with them.
    assert!(items.contains(&reasoning(13)));
    // Hosted and unknown items are never altered: kept byte for byte, or left out with their turn.
    for kept in items
        .iter()
        .filter(|i| i["type"] == "web_search_call" || i["type"] == "future_item")
    {
        assert!(body["input"].as_array().unwrap().contains(kept));
    }
    // What the pipeline does not own is the client's.
    for field in ["store", "include", "text", "model"] {
        assert_eq!(sent[field], body[field], "{field}");
    }
    // The client's tools, and the recall tool where a result sent names a handle.
    let mut tools = sent["tools"].as_array().unwrap().clone();
    let names_a_handle = sent["input"].to_string().contains("; recall rc-");
    if names_a_handle {
        assert_eq!(tools.pop().unwrap()["name"], recall::TOOL_NAME);
    }
    assert_eq!(Value::Array(tools), body["tools"]);
    assert!(
        sent["instructions"]
            .as_str()
            .unwrap()
            .starts_with("You are a support agent for an online shop.")
    );
}

#[tokio::test]
async fn a_stream_is_relayed_whole_and_its_usage_counted() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let mut body = agent_history(3);
    body["stream"] = json!(true);
    body["model"] = json!("gpt-5");
    let answer = post(&proxy, &body, &[]).await;
    assert_eq!(answer.status(), 200);
    let text = answer.text().await.unwrap();
    assert!(text.starts_with("event: response.created"), "{text}");
    assert!(text.contains("event: response.completed"), "{text}");
    assert!(!text.contains("[DONE]"));
    let prompt = proxy
        .metric("ctxproxy_usage_tokens_total", &[("kind", "prompt")])
        .await;
    assert!(prompt > 0.0, "usage counted from response.completed");
    let reasoning = proxy
        .metric("ctxproxy_usage_tokens_total", &[("kind", "reasoning")])
        .await;
    assert!(reasoning > 0.0, "a reasoning model's reasoning tokens");
    let requests = proxy
        .metric("ctxproxy_requests_total", &[("route", "responses")])
        .await;
    assert!(requests >= 1.0);
}

#[tokio::test]
async fn a_stream_that_fails_midway_ends_with_a_responses_error_event() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let mut body = agent_history(1);
    body["stream"] = json!(true);
    for fault in ["reset-after=2", "early-end-after=2"] {
        let answer = post(&proxy, &body, &[("X-Mock-Stream-Fault", fault)]).await;
        let text = answer.text().await.unwrap();
        let last = text.trim_end().rsplit("\n\n").next().unwrap();
        assert!(last.starts_with("event: error\ndata: "), "{fault}: {text}");
        let data: Value = serde_json::from_str(last.split_once("data: ").unwrap().1).unwrap();
        assert_eq!(data["type"], "error");
        assert_eq!(data["code"], "upstream_stream_interrupted");
    }
}

#[tokio::test]
async fn a_chained_request_gets_only_its_json_results_sent_without_whitespace() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    // What an agent chaining on a stored Response sends: the outputs of the calls the last
    // answer made (the calls themselves are upstream), pretty-printed rows.
    let rows: Vec<Value> = (0..12)
        .map(|i| json!({"sku": format!("SKU-{i}"), "name": format!("Item number {i}"), "qty": i + 1}))
        .collect();
    let mut body = agent_history(14);
    body["previous_response_id"] = json!("resp_123");
    body["store"] = json!(true);
    body["input"] = json!([
        {"type": "function_call_output", "call_id": "call_up_1",
         "output": serde_json::to_string_pretty(&json!({"order_id": 4711, "items": rows})).unwrap()},
        {"type": "function_call_output", "call_id": "call_up_2", "output": "done"}
    ]);
    let answer = post(
        &proxy,
        &body,
        &[("X-Mock-Echo", "1"), ("X-Ctxproxy-Budget", "50")],
    )
    .await;
    let status = answer.status();
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(status, 200, "{answer}");
    let sent = &answer["mock_echo"]["body"];
    // Nothing added, moved or left out; every field and the tools as the client wrote them.
    for field in [
        "previous_response_id",
        "tools",
        "instructions",
        "store",
        "include",
        "text",
    ] {
        assert_eq!(sent[field], body[field], "{field}");
    }
    let (items, client) = (
        sent["input"].as_array().unwrap(),
        body["input"].as_array().unwrap(),
    );
    assert_eq!(items.len(), 2);
    assert_eq!(items[1], client[1]);
    // The result is smaller and keeps every value.
    let output = items[0]["output"].as_str().unwrap();
    assert!(
        output.len() < client[0]["output"].as_str().unwrap().len(),
        "{output}"
    );
    for i in 0..12 {
        assert!(
            output.contains(&format!("SKU-{i}")) && output.contains(&format!("Item number {i}"))
        );
    }
    assert_eq!(items[0]["call_id"], "call_up_1");
}

#[tokio::test]
async fn a_chat_body_with_a_conversation_field_gets_the_whole_pipeline() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let mut messages = vec![json!({"role": "system", "content": "You are a travel agent."})];
    for k in 0..30 {
        messages.push(json!({"role": "user", "content": format!("Plan day {k} of my trip to Lisbon, with museums and food.")}));
        messages.push(json!({"role": "assistant", "content": format!("Day {k}: {}", "visit a museum, lunch by the river, a walk in Alfama. ".repeat(6))}));
    }
    messages.push(json!({"role": "user", "content": "And the last day?"}));
    // Chat Completions has no such field: only a Responses body chains on it.
    let body = json!({"model": "gpt-4o", "messages": messages, "conversation": "conv_1"});
    let explained = proxy.explain(&body, &[("X-Ctxproxy-Budget", "600")]).await;
    let stages: Vec<&str> = explained["stages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["stage"].as_str())
        .collect();
    assert!(stages.contains(&"window"), "{stages:?}");
    assert!(
        explained["tokens_after"].as_u64() < Some(700),
        "{explained}"
    );
    assert_eq!(explained["request"]["conversation"], "conv_1");
}

#[tokio::test]
async fn bad_input_gets_clear_errors_and_unknown_items_pass_in_place() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let orphan = json!({"model": "gpt-4o", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "call_9", "output": "42"}
    ]});
    let answer = post(&proxy, &orphan, &[]).await;
    assert_eq!(answer.status(), 400);
    let error: Value = answer.json().await.unwrap();
    assert_eq!(error["error"]["param"], "input[1].call_id");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("call_9")
    );

    for (input, param) in [
        (json!([1]), "input[0]"),
        (
            json!([{"type": "function_call", "name": "f"}]),
            "input[0].call_id",
        ),
        (json!(7), "input"),
    ] {
        let answer = post(&proxy, &json!({"model": "gpt-4o", "input": input}), &[]).await;
        assert_eq!(answer.status(), 400);
        let error: Value = answer.json().await.unwrap();
        assert_eq!(error["error"]["param"], param, "{error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");
    }

    let unknown = json!({"model": "gpt-4o", "input": [
        {"role": "user", "content": "hi"},
        {"type": "future_item", "payload": {"a": 1}},
        {"role": "user", "content": "there"}
    ]});
    let answer = post(&proxy, &unknown, &[("X-Mock-Echo", "1")]).await;
    assert_eq!(answer.status(), 200);
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(answer["mock_echo"]["body"]["input"], unknown["input"]);

    let string_input = json!({"model": "gpt-4o", "input": "hello"});
    let answer = post(&proxy, &string_input, &[("X-Mock-Echo", "1")]).await;
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(answer["mock_echo"]["body"], string_input);
}

#[tokio::test]
async fn other_responses_paths_pass_through_routed() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    for (method, path) in [
        (reqwest::Method::GET, "/v1/responses/resp_1"),
        (reqwest::Method::GET, "/v1/responses/resp_1/input_items"),
        (reqwest::Method::DELETE, "/v1/responses/resp_1"),
    ] {
        let answer = client()
            .request(method.clone(), proxy.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(
            answer.status(),
            404,
            "{method} {path}: the mock stores nothing"
        );
        let error: Value = answer.json().await.unwrap();
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("resp_1")
        );
    }
}

#[tokio::test]
async fn explain_answers_a_responses_body_with_its_rewrite() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let body = agent_history(14);
    let explained = proxy.explain(&body, &[("X-Ctxproxy-Budget", "1500")]).await;
    let sent = &explained["request"];
    assert!(sent["input"].is_array() && sent.get("messages").is_none());
    assert!(reasoning_in_place(&body, sent));
    assert!(explained["tokens_after"].as_u64() < explained["tokens_before"].as_u64());
}

/// Tools filtered whatever their size, definitions of later needs in place, old results cleared.
fn filtering(mock: &Mock) -> String {
    format!(
        "[upstream]\nbase_url = \"{}\"\ntool_definitions = \"in_place\"\n\
         [tools]\nmin_tool_tokens = 0\nmin_stub_tokens = 0\n\
         [pipeline.compact]\nclear_at_least_tokens = 0\n",
        mock.base_url()
    )
}

/// The JSON answer to `body`, and the tools the mock was sent for it.
async fn answered_with_tools_sent(proxy: &common::Proxy, body: &Value) -> (Value, Value) {
    let answer: Value = post(proxy, body, &[("X-Mock-Echo", "1")])
        .await
        .json()
        .await
        .unwrap();
    let tools = answer["mock_echo"]["body"]["tools"].clone();
    (answer, tools)
}

/// `deferred`, its Response kept upstream (`store` left to its default): one a client may chain on.
fn kept_upstream(stream: bool) -> Value {
    let mut body = deferred(stream);
    body.as_object_mut().unwrap().remove("store");
    body
}

/// A question no tool's words name, with two function tools and a hosted one.
fn deferred(stream: bool) -> Value {
    json!({
        "model": "gpt-4o", "store": false, "stream": stream,
        "input": [{"role": "user", "content": "Do I need an umbrella in Paris tomorrow?"}],
        "tools": [
            {"type": "function", "name": "get_weather", "description": "Weather for a city.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
            {"type": "function", "name": "send_email", "description": "Send an email.",
             "parameters": {"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]}},
            {"type": "web_search"}
        ]
    })
}

#[tokio::test]
async fn a_call_to_a_stub_is_asked_again_and_the_client_gets_only_the_full_call() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&filtering(&mock)).await;
    let body = deferred(false);
    let explained = proxy.explain(&body, &[]).await;
    let stubbed = explained["request"]["tools"].to_string();
    assert!(!stubbed.contains("\"city\""), "sent as stubs: {stubbed}");
    assert!(
        stubbed.contains("web_search"),
        "a hosted tool is never left out"
    );

    let answer = post(
        &proxy,
        &body,
        &[("X-Mock-Tool-Call", "get_weather"), ("X-Mock-Echo", "1")],
    )
    .await;
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["x-ctxproxy-tools-expanded"], "get_weather");
    let answer: Value = answer.json().await.unwrap();
    let call = function_call(&answer);
    assert_eq!(call["name"], "get_weather");
    assert_eq!(
        serde_json::from_str::<Value>(call["arguments"].as_str().unwrap()).unwrap(),
        json!({"city": "mock"})
    );
    // The re-ask defined the tool; usage sums both calls.
    let reasked = answer["mock_echo"]["body"].to_string();
    assert!(
        reasked.contains("\\\"city\\\"") || reasked.contains("\"city\""),
        "{reasked}"
    );
    assert_eq!(MockStats::get(&mock.stats.responses_requests), 2);
    assert!(answer["usage"]["input_tokens"].as_u64().unwrap() > 0);
}

/// The `function_call` items a Responses stream finished, in order.
fn streamed_calls(events: &[Value]) -> Vec<&Value> {
    events
        .iter()
        .filter(|e| e["type"] == "response.output_item.done")
        .map(|e| &e["item"])
        .filter(|item| item["type"] == "function_call")
        .collect()
}

/// The first `function_call` item of a JSON Response.
fn function_call(answer: &Value) -> &Value {
    answer["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["type"] == "function_call")
        .unwrap()
}

/// The events of a Responses stream, checked as a client reads them: numbered from 0 without
/// a gap, each item's events under the index its `output_item.added` took, counted in order.
fn parsed_events(text: &str) -> Vec<Value> {
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    let mut items = 0;
    for (k, event) in events.iter().enumerate() {
        if event["type"] == "error" {
            continue;
        }
        assert_eq!(event["sequence_number"], k, "{event}");
        if event["type"] == "response.output_item.added" {
            assert_eq!(event["output_index"], items, "{event}");
            items += 1;
        } else if let Some(index) = event["output_index"].as_u64() {
            assert!(index < items, "{event}");
        }
    }
    events
}

#[tokio::test]
async fn a_streamed_call_to_a_stub_is_asked_again_in_the_same_stream() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&filtering(&mock)).await;
    let body = deferred(true);
    let explained = proxy.explain(&body, &[]).await;
    let stubbed = explained["request"]["tools"].to_string();
    assert!(!stubbed.contains("\"city\""), "sent as stubs: {stubbed}");
    let answer = post(&proxy, &body, &[("X-Mock-Tool-Call", "get_weather")]).await;
    assert_eq!(answer.status(), 200);
    let text = answer.text().await.unwrap();
    assert!(
        text.contains(": x-ctxproxy-tools-expanded: get_weather"),
        "{text}"
    );
    let events = parsed_events(&text);
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[0], "response.created");
    assert_eq!(
        kinds.iter().filter(|k| **k == "response.created").count(),
        1
    );
    assert_eq!(kinds.last(), Some(&"response.completed"));
    // One call, the full one, with its arguments filled from the definition.
    let calls = streamed_calls(&events);
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0]["name"], "get_weather");
    let arguments: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "mock"}));
    // The final Response lists what the client got, and the usage of both calls.
    let response = &events.last().unwrap()["response"];
    let output = response["output"].as_array().unwrap();
    assert_eq!(output.len(), 1);
    assert_eq!(output[0], *calls[0]);
    assert_eq!(MockStats::get(&mock.stats.responses_requests), 2);
    let input = response["usage"]["input_tokens"].as_u64().unwrap();
    let prompt = proxy
        .metric("ctxproxy_usage_tokens_total", &[("kind", "prompt")])
        .await;
    assert_eq!(prompt as u64, input, "the summed usage is what is counted");
    let expansions = proxy
        .metric("ctxproxy_tool_expansions_total", &[("outcome", "expanded")])
        .await;
    assert_eq!(expansions, 1.0);
}

#[tokio::test]
async fn a_re_ask_that_fails_midway_ends_the_stream_with_an_error_event() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&filtering(&mock)).await;
    let body = deferred(true);
    for fault in ["reset-after=3", "early-end-after=3"] {
        let answer = post(
            &proxy,
            &body,
            &[
                ("X-Mock-Tool-Call", "get_weather"),
                ("X-Mock-Stream-Fault", fault),
                ("X-Mock-Fault-On", "reask"),
            ],
        )
        .await;
        let text = answer.text().await.unwrap();
        let events = parsed_events(&text);
        let last = events.last().unwrap();
        assert_eq!(last["type"], "error", "{fault}: {text}");
        assert_eq!(last["code"], "upstream_stream_interrupted");
        assert!(
            events.iter().all(|e| e["type"] != "response.completed"),
            "{text}"
        );
    }
}

#[tokio::test]
async fn a_streamed_recall_is_answered_by_the_proxy() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&filtering(&mock)).await;
    let mut body = agent_history(8);
    body["model"] = json!("gpt-4o");
    body["stream"] = json!(true);
    let explained = proxy.explain(&body, &[]).await;
    assert_eq!(
        explained["request"]["tools"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()["name"],
        recall::TOOL_NAME
    );
    let answer = post(&proxy, &body, &[("X-Mock-Recall", "first")]).await;
    assert_eq!(answer.status(), 200);
    let text = answer.text().await.unwrap();
    let events = parsed_events(&text);
    let items = events.iter().filter(|e| e["item"].is_object());
    assert!(
        items
            .clone()
            .all(|e| e["item"]["name"] != recall::TOOL_NAME),
        "the client never sees the recall call: {text}"
    );
    assert!(items.count() > 0);
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    assert_eq!(MockStats::get(&mock.stats.responses_requests), 2);
    let found = proxy
        .metric("ctxproxy_tool_recalls_total", &[("outcome", "found")])
        .await;
    assert_eq!(found, 1.0);
}

#[tokio::test]
async fn a_recall_is_answered_by_the_proxy_on_a_json_answer() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&filtering(&mock)).await;
    let mut body = agent_history(8);
    body["model"] = json!("gpt-4o");
    let explained = proxy.explain(&body, &[]).await;
    let sent = &explained["request"];
    assert_eq!(
        sent["tools"].as_array().unwrap().last().unwrap()["name"],
        recall::TOOL_NAME
    );
    assert!(
        sent["input"].to_string().contains("recall rc-"),
        "a cleared result names its handle"
    );
    let answer = post(
        &proxy,
        &body,
        &[("X-Mock-Recall", "first"), ("X-Mock-Echo", "1")],
    )
    .await;
    assert_eq!(answer.status(), 200);
    assert!(answer.headers().contains_key("x-ctxproxy-recalled"));
    let answer: Value = answer.json().await.unwrap();
    assert!(
        answer["output"]
            .as_array()
            .unwrap()
            .iter()
            .all(|item| item["type"] != "function_call"),
        "the client never sees the recall call: {answer}"
    );
    let reasked = &answer["mock_echo"]["body"]["input"];
    let pair: Vec<&Value> = reasked
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["name"] == recall::TOOL_NAME || item["type"] == "function_call_output")
        .collect();
    assert!(pair.iter().any(|item| item["name"] == recall::TOOL_NAME));
}

#[tokio::test]
async fn a_streamed_request_whose_response_is_kept_upstream_sends_its_tools_whole() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&filtering(&mock)).await;
    let kept = kept_upstream(true);
    let explained = proxy.explain(&kept, &[]).await;
    assert_eq!(
        explained["request"]["tools"], kept["tools"],
        "a client may chain on the streamed id: nothing it sees may be re-asked"
    );
    let mut json = kept.clone();
    json["stream"] = json!(false);
    let stubbed = proxy.explain(&json, &[]).await["request"]["tools"].to_string();
    assert!(
        !stubbed.contains("\"city\""),
        "a JSON answer keeps the re-ask's id: stubs"
    );
}

#[tokio::test]
async fn a_request_chained_on_a_stored_response_sends_the_block_its_request_sent() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&filtering(&mock)).await;
    let mut first = kept_upstream(false);
    // Any arguments answer its schema: the mock, which keeps no history, calls a stub with none.
    first["tools"][0]["parameters"]
        .as_object_mut()
        .unwrap()
        .remove("required");
    let (answer, block) = answered_with_tools_sent(&proxy, &first).await;
    assert!(!block.to_string().contains("\"city\""), "stubs: {block}");
    let chained = |previous: &Value| {
        json!({"model": "gpt-4o", "previous_response_id": previous, "tools": first["tools"],
               "input": [{"role": "user", "content": "And in Rome, the day after?"}]})
    };
    // Remembered before the client got the answer: a chained request at once finds it.
    let second = chained(&answer["id"]);
    let explained = proxy.explain(&second, &[]).await;
    assert_eq!(explained["request"]["tools"], block, "the chain's block");
    let stages = &explained["stages"];
    assert_eq!(stages[1]["stage"], "tools", "{stages}");
    assert_eq!(stages[1]["details"]["reason"], "chain", "{stages}");

    // Sent so, a call to a stub is asked again; the client gets the full call, and the answer it
    // chains on next was asked with the same block (its definition went in a message).
    let asked = || MockStats::get(&mock.stats.responses_requests);
    let before = asked();
    let headers = [("X-Mock-Tool-Call", "get_weather"), ("X-Mock-Echo", "1")];
    let answer = post(&proxy, &second, &headers).await;
    assert_eq!(answer.headers()["x-ctxproxy-tools-expanded"], "get_weather");
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(asked() - before, 2, "asked again once");
    assert_eq!(answer["mock_echo"]["body"]["tools"], block);
    assert_eq!(
        answer["mock_echo"]["body"]["previous_response_id"],
        second["previous_response_id"]
    );
    // The chain's history defines the tool now: a later call of it is checked, not asked again.
    let third = chained(&answer["id"]);
    assert_eq!(proxy.explain(&third, &[]).await["request"]["tools"], block);
    let before = asked();
    let answer = post(&proxy, &third, &headers).await;
    assert!(answer.headers().get("x-ctxproxy-tools-expanded").is_none());
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(asked() - before, 1, "not asked again");
    let call = function_call(&answer);
    assert_eq!(call["name"], "get_weather");
    let chain_tools = "ctxproxy_chain_tools_total";
    let applied = proxy.metric(chain_tools, &[("outcome", "applied")]).await;
    let remembered = proxy
        .metric(chain_tools, &[("outcome", "remembered")])
        .await;
    assert_eq!((applied, remembered), (2.0, 3.0));

    // Another caller's key, other tools, or a Response run in the background, and the client's
    // tools go as they are.
    let whole = &first["tools"];
    let other_key = [("Authorization", "Bearer someone-else")];
    let explained = proxy.explain(&second, &other_key).await;
    assert_eq!(explained["request"]["tools"], *whole);
    let mut fewer = second.clone();
    fewer["tools"].as_array_mut().unwrap().pop();
    assert_eq!(
        proxy.explain(&fewer, &[]).await["request"]["tools"],
        fewer["tools"]
    );
    let mut background = second.clone();
    background["background"] = json!(true);
    assert_eq!(
        proxy.explain(&background, &[]).await["request"]["tools"],
        *whole
    );
    // Sent, they are counted: nothing known under another key, a block known but other tools.
    for (body, headers) in [(&second, &other_key[..]), (&fewer, &[][..])] {
        assert_eq!(post(&proxy, body, headers).await.status(), 200);
    }
    let missing = proxy.metric(chain_tools, &[("outcome", "missing")]).await;
    let whole = proxy.metric(chain_tools, &[("outcome", "whole")]).await;
    assert_eq!((missing, whole), (1.0, 1.0));
}

#[tokio::test]
async fn a_streamed_chained_request_sends_the_block_unless_its_response_is_kept() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&filtering(&mock)).await;
    let first = kept_upstream(false);
    let (answer, block) = answered_with_tools_sent(&proxy, &first).await;
    let mut chained = json!({"model": "gpt-4o", "previous_response_id": answer["id"],
        "tools": first["tools"], "store": false, "stream": true,
        "input": [{"role": "user", "content": "And in Rome?"}]});
    assert_eq!(
        proxy.explain(&chained, &[]).await["request"]["tools"],
        block
    );
    // Not kept upstream: a call to a stub is asked again in the same stream.
    let answer = post(&proxy, &chained, &[("X-Mock-Tool-Call", "get_weather")]).await;
    let text = answer.text().await.unwrap();
    assert!(
        text.contains(": x-ctxproxy-tools-expanded: get_weather"),
        "{text}"
    );
    let events = parsed_events(&text);
    let calls = streamed_calls(&events);
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    // Its usage counts the history upstream: what the re-ask added is not told from it.
    let reasked = proxy
        .metric("ctxproxy_prompt_tokens_total", &[("phase", "reasked")])
        .await;
    assert_eq!(reasked, 0.0);
    // Kept upstream, a stream's expansion could not be hidden: the tools go whole.
    chained.as_object_mut().unwrap().remove("store");
    let explained = proxy.explain(&chained, &[]).await;
    assert_eq!(explained["request"]["tools"], first["tools"]);
}

#[tokio::test]
async fn a_chained_call_failing_a_schema_the_chain_defines_teaches_nothing_of_the_template() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = common::start_proxy(&filtering(&mock)).await;
    let first = kept_upstream(false);
    let chained = |previous: &Value| {
        json!({"model": "gpt-4o", "previous_response_id": previous, "tools": first["tools"],
               "input": [{"role": "user", "content": "And in Rome?"}]})
    };
    let call = [("X-Mock-Tool-Call", "get_weather")];
    let answer: Value = post(&proxy, &first, &[]).await.json().await.unwrap();
    // Expanded: the re-ask defines the tool in a message, kept in the chain's history upstream.
    let answer: Value = post(&proxy, &chained(&answer["id"]), &call)
        .await
        .json()
        .await
        .unwrap();
    // The mock, holding no history, calls it with `{}`, which fails `required`: asked again with
    // the tool in the block, but what the chain defines upstream says nothing of a template.
    let answer = post(&proxy, &chained(&answer["id"]), &call).await;
    assert_eq!(answer.headers()["x-ctxproxy-tools-expanded"], "get_weather");
    let answer: Value = answer.json().await.unwrap();
    let arguments = function_call(&answer)["arguments"].as_str().unwrap();
    assert_eq!(arguments, r#"{"city":"mock"}"#);
    let upstream = proxy.state.upstreams.get(0).unwrap();
    assert_eq!(upstream.learned(), None);
}
