//! The Responses mock through its router, in process: JSON answers, event streams, refusals.

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower_service::Service;

use super::super::{MockOptions, router};
use super::*;
use crate::pipeline::tools::inline;

/// The mock's status, headers and body for one request.
async fn call(
    router: &mut Router,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, HeaderMap, String) {
    let mut request = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Body::from(body.to_owned())).unwrap();
    let response = router.call(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

async fn post(router: &mut Router, headers: &[(&str, &str)], body: &Value) -> (StatusCode, Value) {
    let (status, _, text) = call(
        router,
        Method::POST,
        "/v1/responses",
        headers,
        &body.to_string(),
    )
    .await;
    (status, serde_json::from_str(&text).unwrap())
}

async fn answer(headers: &[(&str, &str)], body: Value) -> Value {
    let (status, response) = post(&mut router(MockOptions::default()).0, headers, &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    response
}

/// The error a refused request gets.
async fn refusal(headers: &[(&str, &str)], body: &str) -> (StatusCode, Value) {
    let mut router = router(MockOptions::default()).0;
    let (status, _, text) = call(&mut router, Method::POST, "/v1/responses", headers, body).await;
    (
        status,
        serde_json::from_str::<Value>(&text).unwrap()["error"].clone(),
    )
}

fn weather_tools() -> Value {
    json!([
        {"type": "web_search"},
        {"type": "function", "name": "get_weather", "description": "Weather of a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "days": {"type": "integer"}}, "required": ["city", "days"]}},
    ])
}

#[tokio::test]
async fn a_text_answer_is_a_completed_response_with_one_message() {
    let response = answer(
        &[],
        json!({"model": "gpt-4.1", "input": "Hello there",
        "instructions": "Be brief.", "store": false}),
    )
    .await;
    assert_eq!(response["object"], "response");
    assert_eq!(response["status"], "completed");
    assert!(response["id"].as_str().unwrap().starts_with("resp_mock_"));
    assert_eq!(response["model"], "gpt-4.1");
    assert_eq!(response["store"], false);
    assert_eq!(response["instructions"], "Be brief.");
    assert_eq!(response["incomplete_details"], Value::Null);
    let output = response["output"].as_array().unwrap();
    assert_eq!(output.len(), 1);
    assert_eq!(output[0]["type"], "message");
    assert_eq!(output[0]["role"], "assistant");
    assert_eq!(output[0]["status"], "completed");
    assert!(output[0]["id"].as_str().unwrap().starts_with("msg_mock_"));
    // The instructions are the first message the model reads.
    assert_eq!(
        output[0]["content"][0],
        json!({"type": "output_text", "annotations": [], "logprobs": [],
            "text": "Mock answer to \"Hello there\" after 2 messages."})
    );
    let usage = &response["usage"];
    let input = usage["input_tokens"].as_u64().unwrap();
    // One output token a word.
    let output_tokens = output[0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .split(' ')
        .count() as u64;
    assert!(input > 0);
    assert_eq!(usage["output_tokens"], output_tokens);
    assert_eq!(usage["total_tokens"], input + output_tokens);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 0);
    // The same request, the same answer.
    let again = answer(
        &[],
        json!({"model": "gpt-4.1", "input": "Hello there",
        "instructions": "Be brief.", "store": false}),
    )
    .await;
    assert_eq!(again, response);
}

#[tokio::test]
async fn a_function_call_is_filled_from_the_tools_schema() {
    let body = json!({"model": "gpt-4.1", "tools": weather_tools(),
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}]});
    let response = answer(&[("x-mock-tool-call", "auto")], body).await;
    let output = response["output"].as_array().unwrap();
    assert_eq!(output.len(), 1);
    let call = &output[0];
    assert_eq!(call["type"], "function_call");
    assert_eq!(call["status"], "completed");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["arguments"], r#"{"city":"mock","days":1}"#);
    assert!(call["id"].as_str().unwrap().starts_with("fc_mock_"));
    assert!(call["call_id"].as_str().unwrap().starts_with("call_mock_"));
    // The tools are echoed as sent, hosted ones included.
    assert_eq!(response["tools"], weather_tools());

    // With a preamble, a message says it first.
    let body = json!({"model": "gpt-4.1", "tools": weather_tools(), "input": "Weather?"});
    let response = answer(
        &[
            ("x-mock-tool-call", "get_weather"),
            ("x-mock-preamble", "Let me check."),
        ],
        body,
    )
    .await;
    let kinds: Vec<&str> = response["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["message", "function_call"]);
    assert_eq!(response["output"][0]["content"][0]["text"], "Let me check.");
}

#[tokio::test]
async fn a_stub_is_filled_from_the_definitions_message_of_the_input() {
    let definition = json!({"name": "lookup", "parameters": {"type": "object",
        "properties": {"id": {"type": "integer"}, "exact": {"type": "boolean"}},
        "required": ["id", "exact"]}});
    let body = json!({"model": "gpt-4.1",
    "tools": [{"type": "function", "name": "lookup", "description": "Looks a record up.",
        "parameters": {"type": "object", "properties": {}}}],
    "input": [
        {"role": "user", "content": "Find record 7"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text",
            "text": format!("{}\n{definition}", inline::HEADER)}]},
    ]});
    let response = answer(&[("x-mock-tool-call", "lookup")], body).await;
    assert_eq!(response["output"][0]["name"], "lookup");
    assert_eq!(
        response["output"][0]["arguments"],
        r#"{"id":1,"exact":true}"#
    );
}

#[tokio::test]
async fn reasoning_models_and_requests_start_with_a_reasoning_item() {
    let plain = answer(&[], json!({"model": "gpt-4.1", "input": "hi"})).await;
    assert_eq!(plain["output"][0]["type"], "message");
    assert_eq!(plain["reasoning"], json!({"effort": null, "summary": null}));

    let reasoning = answer(&[], json!({"model": "o3-mini", "input": "hi"})).await;
    let item = &reasoning["output"][0];
    assert_eq!(item["type"], "reasoning");
    assert!(item["id"].as_str().unwrap().starts_with("rs_mock_"));
    assert_eq!(item["summary"], json!([]));
    assert!(item.get("encrypted_content").is_none());
    assert_eq!(reasoning["output"][1]["type"], "message");
    let usage = &reasoning["usage"];
    let thought = usage["output_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap();
    assert!((16..64).contains(&thought));
    // The same text as without reasoning, and the reasoning tokens.
    assert_eq!(
        usage["output_tokens"].as_u64().unwrap(),
        thought + plain["usage"]["output_tokens"].as_u64().unwrap()
    );

    let asked = answer(
        &[],
        json!({"model": "gpt-4.1", "input": "hi",
        "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"]}),
    )
    .await;
    let item = &asked["output"][0];
    assert_eq!(item["type"], "reasoning");
    let content = item["encrypted_content"].as_str().unwrap();
    assert!(content.starts_with("gAAAAAB"));
    assert_eq!(content, encrypted_content(item["id"].as_str().unwrap()));
    assert_eq!(asked["reasoning"], json!({"effort": "low"}));

    let none = answer(
        &[],
        json!({"model": "gpt-5.1", "input": "hi",
        "reasoning": {"effort": "none"}}),
    )
    .await;
    assert_eq!(none["output"][0]["type"], "message");
    assert!(reasons(
        &json!({"model": "openai/o4-mini"})
            .as_object()
            .unwrap()
            .clone()
    ));
    assert!(!reasons(
        &json!({"model": "omni"}).as_object().unwrap().clone()
    ));
}

#[tokio::test]
async fn a_turn_that_puts_the_answer_back_is_answered_and_a_split_pair_refused() {
    let mut router = router(MockOptions::default()).0;
    let first = json!({"model": "o3", "tools": weather_tools(), "store": false,
        "include": ["reasoning.encrypted_content"],
        "input": [{"role": "user", "content": "Weather in Paris?"}]});
    let (status, response) = post(&mut router, &[("x-mock-tool-call", "auto")], &first).await;
    assert_eq!(status, StatusCode::OK);
    let output = response["output"].as_array().unwrap().clone();
    assert_eq!(output.len(), 2);
    let call_id = output[1]["call_id"].clone();
    let mut input = first["input"].as_array().unwrap().clone();
    input.extend(output.iter().cloned());
    input.push(json!({"type": "function_call_output", "call_id": call_id,
        "output": "{\"temp\": 21}"}));
    let mut second = first.clone();
    second["input"] = json!(input);
    let (status, response) = post(&mut router, &[], &second).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let message = &response["output"][1];
    assert_eq!(
        message["content"][0]["text"],
        "Mock summary of the tool result: {\"temp\": 21}"
    );

    // The reasoning item without the call it came with.
    let mut split = input.clone();
    split.remove(2);
    split.pop();
    second["input"] = json!(split);
    let (status, error) = refusal(&[], &second.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let reasoning_id = output[0]["id"].as_str().unwrap();
    assert_eq!(
        error["message"],
        format!(
            "Item '{reasoning_id}' of type 'reasoning' was provided without its required following item."
        )
    );
    assert_eq!(error["param"], "input");
    assert_eq!(error["type"], "invalid_request_error");

    // Before another answer's item.
    let mut moved = input.clone();
    moved[2]["id"] = json!("fc_mock_000000000000000000000000");
    second["input"] = json!(moved);
    let (status, _) = refusal(&[], &second.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // Its encrypted content altered.
    let mut altered = input.clone();
    altered[1]["encrypted_content"] = json!("gAAAAABtampered");
    second["input"] = json!(altered);
    let (status, error) = refusal(&[], &second.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error["code"], "invalid_encrypted_content");
}

#[tokio::test]
async fn a_request_extending_the_previous_one_gets_its_prefix_as_cached_tokens() {
    let mut router = router(MockOptions::default()).0;
    let long = "word ".repeat(2_000);
    let first = json!({"model": "gpt-4.1", "instructions": "Be brief.",
        "input": [{"role": "user", "content": long}]});
    let (_, response) = post(&mut router, &[], &first).await;
    assert_eq!(
        response["usage"]["input_tokens_details"]["cached_tokens"],
        0
    );
    let mut second = first.clone();
    let mut input = first["input"].as_array().unwrap().clone();
    input.push(response["output"][0].clone());
    input.push(json!({"role": "user", "content": "And then?"}));
    second["input"] = json!(input);
    let (_, response) = post(&mut router, &[], &second).await;
    let usage = &response["usage"];
    let cached = usage["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 2_048, "{usage}");
    assert_eq!(cached % 128, 0);
    assert!(cached <= usage["input_tokens"].as_u64().unwrap());
    // Another instructions text changes the prefix from its start.
    second["instructions"] = json!("Be very brief.");
    let (_, response) = post(&mut router, &[], &second).await;
    assert_eq!(
        response["usage"]["input_tokens_details"]["cached_tokens"],
        0
    );
}

/// A stream's events as (event name, data), checking that each frame names its data's type.
fn events_of(body: &str) -> Vec<Value> {
    assert!(!body.contains("[DONE]"));
    body.split("\n\n")
        .filter(|frame| !frame.is_empty())
        .map(|frame| {
            let (event, data) = frame.split_once('\n').unwrap();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(event.strip_prefix("event: ").unwrap(), data["type"]);
            data
        })
        .collect()
}

async fn stream(headers: &[(&str, &str)], body: Value) -> Vec<Value> {
    let mut router = router(MockOptions::default()).0;
    let (status, response_headers, text) = call(
        &mut router,
        Method::POST,
        "/v1/responses",
        headers,
        &body.to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        response_headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = events_of(&text);
    for (number, event) in events.iter().enumerate() {
        assert_eq!(event["sequence_number"], number);
    }
    events
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

#[tokio::test]
async fn a_stream_tells_each_item_in_order_and_ends_with_the_whole_response() {
    let events = stream(
        &[("x-mock-reply", "one two three")],
        json!({"model": "o4-mini", "input": "count", "stream": true}),
    )
    .await;
    assert_eq!(
        types(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    assert_eq!(events[0]["response"]["status"], "in_progress");
    assert_eq!(events[0]["response"]["output"], json!([]));
    assert_eq!(events[0]["response"]["usage"], Value::Null);
    let completed = &events[12]["response"];
    assert_eq!(completed["status"], "completed");
    assert!(completed["usage"]["output_tokens"].as_u64().unwrap() > 3);
    let output = completed["output"].as_array().unwrap();
    // Every item event names its place in the output, and the finished items are the output.
    assert_eq!(events[2]["output_index"], 0);
    assert_eq!(events[3]["item"], output[0]);
    let message_id = output[1]["id"].as_str().unwrap();
    for event in &events[4..12] {
        assert_eq!(event["output_index"], 1);
        if let Some(item_id) = event.get("item_id") {
            assert_eq!(item_id, message_id);
            assert_eq!(event["content_index"], 0);
        }
    }
    assert_eq!(events[4]["item"]["status"], "in_progress");
    assert_eq!(events[11]["item"], output[1]);
    let text: String = events[6..9]
        .iter()
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, "one two three");
    assert_eq!(events[9]["text"], "one two three");
    assert_eq!(events[10]["part"]["text"], "one two three");
}

#[tokio::test]
async fn a_streamed_function_call_sends_its_arguments_in_pieces() {
    let events = stream(
        &[("x-mock-tool-call", "auto")],
        json!({"model": "gpt-4.1", "input": "Weather?", "tools": weather_tools(), "stream": true}),
    )
    .await;
    let kinds = types(&events);
    assert_eq!(kinds[2], "response.output_item.added");
    assert_eq!(events[2]["item"]["arguments"], "");
    let deltas: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .collect();
    assert!(deltas.len() > 1);
    let arguments: String = deltas
        .iter()
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(arguments, r#"{"city":"mock","days":1}"#);
    let done = &events[kinds.len() - 3];
    assert_eq!(done["type"], "response.function_call_arguments.done");
    assert_eq!(done["arguments"], arguments);
    assert_eq!(done["name"], "get_weather");
    let output = &events[kinds.len() - 1]["response"]["output"];
    assert_eq!(events[kinds.len() - 2]["item"], output[0]);
    assert_eq!(done["item_id"], output[0]["id"]);
}

#[tokio::test]
async fn max_output_tokens_cuts_the_text_and_the_response_is_incomplete() {
    let body = json!({"model": "gpt-4.1", "input": "count", "max_output_tokens": 3});
    let headers = [("x-mock-reply", "one two three four five")];
    let response = answer(&headers, body.clone()).await;
    assert_eq!(response["status"], "incomplete");
    assert_eq!(
        response["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(response["max_output_tokens"], 3);
    let message = &response["output"][0];
    assert_eq!(message["status"], "incomplete");
    assert_eq!(message["content"][0]["text"], "one two three");

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let events = stream(&headers, streamed).await;
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.incomplete");
    assert_eq!(last["response"]["status"], "incomplete");
}

#[tokio::test]
async fn bad_input_gets_an_openai_format_400() {
    let cases = [
        ("not json", None),
        ("[1, 2]", None),
        (r#"{"input": "hi"}"#, Some("model")),
        (r#"{"model": "m"}"#, Some("input")),
        (r#"{"model": "m", "input": 3}"#, Some("input")),
        (r#"{"model": "m", "input": ["hi"]}"#, Some("input[0]")),
        (
            r#"{"model": "m", "input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}"#,
            Some("input"),
        ),
        (
            r#"{"model": "m", "input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "id": "rs_1", "summary": []}]}"#,
            Some("input"),
        ),
    ];
    for (body, param) in cases {
        let (status, error) = refusal(&[], body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(error["type"], "invalid_request_error", "{body}");
        assert_eq!(error["param"].as_str(), param, "{body}");
        assert!(!error["message"].as_str().unwrap().is_empty());
    }
    let (_, error) = refusal(
        &[],
        r#"{"model": "m", "input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}"#,
    )
    .await;
    assert_eq!(
        error["message"],
        "No tool call found for function call output with call_id c1."
    );
    // The history upstream may hold the call.
    let chained = json!({"model": "m", "previous_response_id": "resp_1",
        "input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]});
    answer(&[], chained).await;
    // Item types the mock does not know pass.
    let unknown = json!({"model": "m", "input": [{"type": "compaction", "encrypted_content": "x"},
        {"type": "item_reference", "id": "msg_1"}, {"role": "user", "content": "hi"}]});
    answer(&[], unknown).await;
}

#[tokio::test]
async fn a_later_system_message_is_refused_or_dropped_as_the_template_says() {
    let body = json!({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "Answer in French."}]});
    let (status, error) = refusal(&[("x-mock-system-messages", "reject")], &body.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error["message"], super::super::template::REFUSAL);
    let dropped = answer(&[("x-mock-system-messages", "drop")], body).await;
    assert_eq!(
        dropped["output"][0]["content"][0]["text"],
        "Mock answer to \"hi\" after 2 messages."
    );
}

#[tokio::test]
async fn recall_echo_and_faults_work_as_for_chat() {
    let handle = "rc-0123abcd";
    let body = json!({"model": "m",
        "tools": [{"type": "function", "name": "ctxproxy_recall", "parameters": {"type": "object",
            "properties": {"handle": {"type": "string"}}, "required": ["handle"]}}],
        "input": [{"role": "user", "content": format!("The log was cleared ({handle}).")}]});
    let recalled = answer(
        &[("x-mock-recall", "first"), ("x-mock-echo", "1")],
        body.clone(),
    )
    .await;
    assert_eq!(recalled["output"][0]["name"], "ctxproxy_recall");
    assert_eq!(
        recalled["output"][0]["arguments"],
        json!({"handle": handle}).to_string()
    );
    assert_eq!(recalled["mock_echo"]["body"], body);
    assert_eq!(recalled["mock_echo"]["headers"]["x-mock-recall"], "first");

    let mut router = router(MockOptions::default()).0;
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (status, _, text) = call(
        &mut router,
        Method::POST,
        "/v1/responses",
        &[("x-mock-stream-fault", "early-end-after=3")],
        &streamed.to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(events_of(&text).len(), 3);
    let (status, _, _) = call(
        &mut router,
        Method::POST,
        "/v1/responses",
        &[("x-mock-status", "429")],
        &streamed.to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn a_stored_response_is_never_found() {
    let mut router = router(MockOptions::default()).0;
    for (method, path) in [
        (Method::GET, "/v1/responses/resp_123"),
        (Method::DELETE, "/v1/responses/resp_123"),
        (Method::GET, "/v1/responses/resp_123/input_items"),
        (Method::POST, "/v1/responses/resp_123/cancel"),
    ] {
        let (status, _, text) = call(&mut router, method, path, &[], "").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            body["error"]["message"],
            "Response with id 'resp_123' not found."
        );
    }
}
