//! Deferred tools through the running proxy and the mock upstream: what the tools stage leaves
//! out goes as a stub; an answer that calls a stub is asked again with the tool in full, and the
//! client gets only that answer (JSON and streams, before or after text), with the usage of
//! both, the `X-Ctxproxy-Tools-Expanded` header or SSE comment, and the metric. A streamed call
//! of a full tool goes out as soon as its name is known. A few small tools reach the upstream
//! unchanged.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Mock, Proxy, client, proxy_for, start_mock};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use ctxproxy::pipeline::recall;
use ctxproxy::pipeline::tools::inline;
use ctxproxy::server::learned;
use serde_json::{Value, json};

/// Filtered whatever their size (three small tools stand for a large block).
const FILTER_ALL: &str = "[tools]\nmin_tool_tokens = 0\nmin_stub_tokens = 0\n";

/// A proxy filtering every tool, in front of the mock taken as a provider that reads a
/// definitions message in place (as OpenAI does; a loopback upstream is `in_result` by default).
async fn in_place_proxy(mock: &Mock) -> common::Proxy {
    let upstream = format!(
        "[upstream]\nbase_url = \"{}\"\ntool_definitions = \"in_place\"\n",
        mock.base_url()
    );
    common::start_proxy(&format!("{upstream}{FILTER_ALL}")).await
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "Weather forecast for a city. Gives hourly temperatures and rain.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                "days": {"type": "integer"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "send_email",
            "description": "Send an email message.",
            "parameters": {"type": "object", "properties": {"to": {"type": "string"},
                "body": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "create_event",
            "description": "Create a calendar event.",
            "parameters": {"type": "object", "properties": {"title": {"type": "string"}}}}}
    ])
}

/// A question no keyword ties to a tool: every tool goes as a stub.
fn request(stream: bool) -> Value {
    json!({"model": "gpt-4o", "stream": stream,
        "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
        "messages": [{"role": "user", "content": "Do I need an umbrella in Paris tomorrow?"}],
        "tools": tools()})
}

async fn post(proxy: &Proxy, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client().post(proxy.url("/v1/chat/completions")).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

/// The JSON answer to `body`.
async fn answer_to(proxy: &Proxy, body: &Value, headers: &[(&str, &str)]) -> Value {
    post(proxy, body, headers).await.json().await.unwrap()
}

fn chat_count(mock: &Mock) -> u64 {
    MockStats::get(&mock.stats.chat_requests)
}

/// Tool calls (name, arguments), text, usage and `data:` chunk ids of an SSE answer.
struct Streamed {
    calls: Vec<(String, String)>,
    text: String,
    usage: Option<Value>,
    ids: Vec<String>,
    comments: Vec<String>,
}

fn read_stream(body: &str) -> Streamed {
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert_eq!(body.matches("data: [DONE]").count(), 1, "{body}");
    let mut out = Streamed {
        calls: Vec::new(),
        text: String::new(),
        usage: None,
        ids: Vec::new(),
        comments: body
            .lines()
            .filter_map(|l| l.strip_prefix(": "))
            .map(str::to_owned)
            .collect(),
    };
    for payload in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if payload == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(payload).unwrap();
        out.ids.push(chunk["id"].as_str().unwrap().to_owned());
        if chunk["usage"].is_object() {
            out.usage = Some(chunk["usage"].clone());
        }
        let delta = &chunk["choices"][0]["delta"];
        out.text.push_str(delta["content"].as_str().unwrap_or(""));
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if out.calls.len() <= index {
                out.calls.push((String::new(), String::new()));
            }
            if let Some(name) = call["function"]["name"].as_str() {
                out.calls[index].0 = name.to_owned();
            }
            if let Some(arguments) = call["function"]["arguments"].as_str() {
                out.calls[index].1.push_str(arguments);
            }
        }
    }
    out
}

#[tokio::test]
async fn a_json_answer_that_calls_a_stub_is_asked_again_with_the_tool_in_full() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = in_place_proxy(&mock).await;
    // What goes upstream: every tool as a stub.
    let explained = proxy.explain(&request(false), &[]).await;
    let sent = &explained["request"]["tools"];
    // And the proxy's recall tool, last (the block is decided).
    assert_eq!(sent.as_array().unwrap().len(), 4);
    assert_eq!(sent[3]["function"]["name"], recall::TOOL_NAME);
    assert_eq!(
        sent[0]["function"],
        json!({"name": "get_weather", "description": "Weather forecast for a city.",
            "parameters": {"type": "object", "properties": {}}})
    );

    let response = post(
        &proxy,
        &request(false),
        &[("X-Mock-Tool-Call", "get_weather")],
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["x-ctxproxy-tools-expanded"],
        "get_weather"
    );
    let sent: f64 = response.headers()["x-ctxproxy-tokens-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let answer: Value = response.json().await.unwrap();
    let call = &answer["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather");
    // Filled from the full schema, not the stub's `{}`.
    assert_eq!(call["arguments"], r#"{"city":"mock"}"#);
    assert_eq!(chat_count(&mock), 2);
    // Usage of both calls.
    let usage = &answer["usage"];
    let one = post(&proxy, &request(false), &[("Cache-Control", "no-cache")]).await;
    let one: Value = one.json().await.unwrap();
    assert!(
        usage["prompt_tokens"].as_u64().unwrap() > one["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{usage} vs {}",
        one["usage"]
    );
    let expanded = proxy
        .metric("ctxproxy_tool_expansions_total", &[("outcome", "expanded")])
        .await;
    assert_eq!(expanded, 1.0);
    // The re-ask's prompt is counted beside what the rewrite sent: the summed usage less it.
    let reasked = proxy
        .metric("ctxproxy_prompt_tokens_total", &[("phase", "reasked")])
        .await;
    assert!(reasked > 0.0);
    assert_eq!(reasked, usage["prompt_tokens"].as_f64().unwrap() - sent);
}

#[tokio::test]
async fn a_streamed_stub_call_is_replaced_in_the_same_stream() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = in_place_proxy(&mock).await;
    for (conversation, preamble) in [("a", None), ("b", Some("Let me check the forecast."))] {
        // Each its own conversation: the first one's call made the tool sticky in full.
        let mut headers = vec![
            ("X-Mock-Tool-Call", "get_weather"),
            ("X-Conversation-Id", conversation),
        ];
        if let Some(text) = preamble {
            headers.push(("X-Mock-Preamble", text));
        }
        let before = chat_count(&mock);
        let response = post(&proxy, &request(true), &headers).await;
        assert_eq!(response.status(), 200);
        let body = response.text().await.unwrap();
        // The comment comes after the calls and the usage, just before `[DONE]`.
        assert!(
            body.trim_end()
                .ends_with("\n: x-ctxproxy-tools-expanded: get_weather\n\ndata: [DONE]"),
            "{body}"
        );
        let streamed = read_stream(&body);
        assert_eq!(chat_count(&mock) - before, 2, "one re-ask");
        assert_eq!(
            streamed.calls,
            [("get_weather".to_owned(), r#"{"city":"mock"}"#.to_owned())]
        );
        // Text said before the call is said once; one id for the whole answer.
        assert_eq!(streamed.text, preamble.unwrap_or(""));
        assert!(streamed.ids.iter().all(|id| *id == streamed.ids[0]));
        assert_eq!(
            streamed.comments,
            ["x-ctxproxy-tools-expanded: get_weather"]
        );
        let usage = streamed.usage.unwrap();
        assert_eq!(
            usage["total_tokens"].as_u64().unwrap(),
            usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
        );
    }
    // The re-asks' prompts are counted, though a stream says it was expanded after its usage.
    let mut reasked = 0.0;
    for _ in 0..50 {
        reasked = proxy
            .metric("ctxproxy_prompt_tokens_total", &[("phase", "reasked")])
            .await;
        if reasked > 0.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(reasked > 0.0, "no re-asked prompt counted");
}

#[tokio::test]
async fn max_expansions_bounds_the_re_asks_and_the_last_sends_every_tool_in_full() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(
        &mock,
        "[tools]\nmin_tool_tokens = 0\nmin_stub_tokens = 0\nmax_expansions = 1\n",
    )
    .await;
    let headers = [("X-Mock-Tool-Call", "send_email"), ("X-Mock-Echo", "1")];
    let response = post(&proxy, &request(false), &headers).await;
    assert_eq!(response.status(), 200);
    assert_eq!(chat_count(&mock), 2);
    let all_full = proxy
        .metric("ctxproxy_tool_expansions_total", &[("outcome", "all_full")])
        .await;
    assert_eq!(all_full, 1.0);
    // The answer is the re-ask's, which offered every tool in full (the mock echoes it).
    let answer: Value = response.json().await.unwrap();
    let mut reasked = answer["mock_echo"]["body"]["tools"].clone();
    let recall_tool = reasked.as_array_mut().unwrap().pop().unwrap();
    assert_eq!(recall_tool["function"]["name"], recall::TOOL_NAME);
    assert_eq!(reasked, tools());
}

#[tokio::test]
async fn an_upstream_not_known_to_read_definitions_in_place_gets_them_as_a_calls_result() {
    let mock = start_mock(MockOptions::default()).await;
    // The default `tool_definitions = "auto"`: a loopback upstream is not OpenAI. A template
    // that refuses or drops a system message in mid-conversation still reads a tool result.
    let proxy = proxy_for(&mock, FILTER_ALL).await;
    let headers = [
        ("X-Mock-Tool-Call", "send_email"),
        ("X-Mock-Echo", "1"),
        ("X-Mock-System-Messages", "reject"),
    ];
    let response = post(&proxy, &request(false), &headers).await;
    assert_eq!(response.status(), 200);
    assert_eq!(chat_count(&mock), 2, "the stub call was asked again");
    let answer: Value = response.json().await.unwrap();
    let reasked: ctxproxy::openai::ChatRequest =
        serde_json::from_value(answer["mock_echo"]["body"].clone()).unwrap();
    // The block keeps its bytes; the re-ask ends with a call of the stub and its definition.
    let first: ctxproxy::openai::ChatRequest =
        serde_json::from_value(proxy.explain(&request(false), &[]).await["request"].clone())
            .unwrap();
    assert_eq!(reasked.tools, first.tools);
    let [.., call, definition] = reasked.messages.as_slice() else {
        panic!("{:?}", reasked.messages)
    };
    assert!(inline::is_definition_call(call), "{call:?}");
    assert_eq!(call.tool_calls()[0].function.name, "send_email");
    assert_eq!(call.tool_calls()[0].function.arguments, "{}");
    assert!(inline::is_definition_result(definition), "{definition:?}");
    assert_eq!(
        definition.tool_call_id.get().map(|id| id.as_str()),
        Some(call.tool_calls()[0].id.as_str())
    );
    assert_eq!(inline::definitions_in(&reasked.messages).len(), 1);
    let called = &answer["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(called["name"], "send_email");
    assert!(
        !answer["choices"][0]["message"].to_string().contains("ctxd"),
        "the client never sees the definition's call"
    );
    // The next turn places the pair where the re-ask put it: the re-ask is its prefix.
    let call = answer["choices"][0]["message"].clone();
    let mut next = request(false);
    let messages = next["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": call["tool_calls"]}));
    messages.push(
        json!({"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "sent"}),
    );
    let explained = proxy.explain(&next, &[]).await;
    let rewrite: ctxproxy::openai::ChatRequest =
        serde_json::from_value(explained["request"].clone()).unwrap();
    assert_eq!(rewrite.tools, first.tools);
    assert_eq!(
        rewrite.messages[..reasked.messages.len()],
        reasked.messages[..]
    );
    assert_eq!(rewrite.messages.len(), reasked.messages.len() + 2);
    // `in_block` grows the block instead; `in_place` defines it in a system message.
    let in_block = proxy_for(
        &mock,
        &format!("tool_definitions = \"in_block\"\n{FILTER_ALL}"),
    )
    .await;
    let answer: Value = answer_to(&in_block, &request(false), &headers).await;
    let reasked: ctxproxy::openai::ChatRequest =
        serde_json::from_value(answer["mock_echo"]["body"].clone()).unwrap();
    assert!(inline::definitions_in(&reasked.messages).is_empty());
    let full: Vec<ctxproxy::openai::Tool> = serde_json::from_value(tools()).unwrap();
    let send_email = full
        .iter()
        .find(|t| t.function.as_ref().unwrap().name == "send_email");
    assert!(reasked.tools.get().unwrap().contains(send_email.unwrap()));
    let in_place = in_place_proxy(&mock).await;
    let answer: Value = answer_to(&in_place, &request(false), &headers[..2]).await;
    let reasked: ctxproxy::openai::ChatRequest =
        serde_json::from_value(answer["mock_echo"]["body"].clone()).unwrap();
    assert_eq!(
        inline::defined_in(&reasked.messages)
            .into_iter()
            .collect::<Vec<_>>(),
        ["send_email"]
    );
    assert_eq!(
        reasked.messages.last().unwrap().role,
        ctxproxy::openai::Role::System
    );
}

#[tokio::test]
async fn left_out_remove_sends_no_stub_and_asks_once() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(
        &mock,
        "[tools]\nmin_tool_tokens = 0\nmin_stub_tokens = 0\nleft_out = \"remove\"\n",
    )
    .await;
    let explained = proxy.explain(&request(false), &[]).await;
    assert!(explained["request"].get("tools").is_none(), "{explained}");
    let response = post(
        &proxy,
        &request(false),
        &[("X-Mock-Tool-Call", "get_weather")],
    )
    .await;
    assert_eq!(response.status(), 200);
    assert!(
        response
            .headers()
            .get("x-ctxproxy-tools-expanded")
            .is_none()
    );
    assert_eq!(chat_count(&mock), 1);
}

#[tokio::test]
async fn a_few_small_tools_reach_the_upstream_unchanged() {
    let mock = start_mock(MockOptions::default()).await;
    // The default config: a block under `min_tool_tokens` is never filtered.
    let proxy = proxy_for(&mock, "").await;
    let response = post(&proxy, &request(false), &[("X-Mock-Echo", "1")]).await;
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["mock_echo"]["body"]["tools"], tools());
}

#[tokio::test]
async fn a_stream_that_did_not_ask_for_usage_gets_none_and_both_calls_are_metered() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = in_place_proxy(&mock).await;
    let mut body = request(true);
    body.as_object_mut().unwrap().remove("stream_options");
    let response = post(&proxy, &body, &[("X-Mock-Tool-Call", "get_weather")]).await;
    let streamed = read_stream(&response.text().await.unwrap());
    assert_eq!(streamed.calls.len(), 1);
    assert!(streamed.usage.is_none(), "the client did not ask for usage");
    // The same question's prompt, once, as the mock counts it (messages and tools).
    let once: Value = answer_to(&proxy, &request(false), &[("Cache-Control", "no-cache")]).await;
    let once = once["usage"]["prompt_tokens"].as_f64().unwrap();
    // The re-ask's prompt: the rewrite (its stubs) and the definition of the tool called.
    let client_tools: Vec<ctxproxy::openai::Tool> = serde_json::from_value(tools()).unwrap();
    let defined = inline::message(&client_tools, &["get_weather".to_owned()]);
    let mut reask = proxy.explain(&request(false), &[]).await["request"].clone();
    reask["messages"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::to_value(&defined).unwrap());
    let reask: Value = client()
        .post(format!("{}/chat/completions", mock.base_url()))
        .json(&reask)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let reask = reask["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(reask > once);
    let expected = once + reask + once;
    let mut metered = 0.0;
    for _ in 0..50 {
        metered = proxy
            .metric("ctxproxy_usage_tokens_total", &[("kind", "prompt")])
            .await;
        if metered >= expected {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The stream's two calls and the JSON one.
    assert_eq!(metered, expected);
}

#[tokio::test]
async fn several_streamed_choices_go_with_every_tool_in_full() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = in_place_proxy(&mock).await;
    let mut body = request(true);
    body["n"] = json!(2);
    let response = post(&proxy, &body, &[("X-Mock-Tool-Call", "get_weather")]).await;
    let streamed = read_stream(&response.text().await.unwrap());
    // No stub was offered, so none was called, and nothing was asked again.
    assert_eq!(chat_count(&mock), 1);
    assert_eq!(
        streamed.calls,
        [("get_weather".to_owned(), r#"{"city":"mock"}"#.to_owned())]
    );
    assert!(streamed.comments.is_empty());
}

#[tokio::test]
async fn the_next_turn_extends_the_re_ask_byte_for_byte() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = in_place_proxy(&mock).await;
    let headers = [
        ("X-Mock-Tool-Call", "get_weather"),
        ("X-Mock-Echo", "1"),
        ("X-Conversation-Id", "umbrella"),
    ];
    let first: Value = answer_to(&proxy, &request(false), &headers).await;
    // The re-ask: the block as it was (stubs), the definition appended last.
    let reask = &first["mock_echo"]["body"];
    let explained = proxy.explain(&request(false), &[]).await;
    assert_eq!(reask["tools"], explained["request"]["tools"]);
    let sent = reask["messages"].as_array().unwrap();
    assert_eq!(sent.len(), 2);
    assert!(
        sent[1]["content"]
            .as_str()
            .unwrap()
            .starts_with(inline::HEADER)
    );

    // The client goes on with the call it got and its result.
    let call = first["choices"][0]["message"].clone();
    let call_id = call["tool_calls"][0]["id"].clone();
    let mut next = request(false);
    let messages = next["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": call["tool_calls"]}));
    messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": "{\"rain_mm\": 4}"}));
    let before = chat_count(&mock);
    let second: Value = post(
        &proxy,
        &next,
        &[("X-Mock-Echo", "1"), ("X-Conversation-Id", "umbrella")],
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(
        chat_count(&mock) - before,
        1,
        "the tool is defined: no re-ask"
    );
    let body = &second["mock_echo"]["body"];
    // The same tools, and the re-ask's messages first: the provider's cached prefix holds.
    assert_eq!(body["tools"], reask["tools"]);
    let now = body["messages"].as_array().unwrap();
    assert_eq!(&now[..sent.len()], &sent[..]);
    assert_eq!(now.len(), sent.len() + 2);
    // The second request sent get_weather as a stub defined in the messages.
    let defined = proxy
        .metric("ctxproxy_tools_total", &[("phase", "defined")])
        .await;
    assert_eq!(defined, 1.0);
}

#[tokio::test]
async fn a_strict_stub_goes_in_full_and_the_next_turn_extends_the_re_ask() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = in_place_proxy(&mock).await;
    let mut tools = tools();
    tools[2]["function"]["strict"] = json!(true);
    // A long conversation sent appended to its first rewrite (no recompaction pays): a rebuild
    // would summarize its earlier turns.
    let mut messages = vec![json!({"role": "system", "content": "You are an assistant."})];
    for turn in 0..10 {
        messages.push(json!({"role": "user", "content": format!("Tell me fact number {turn} about lighthouses, at length.")}));
        messages.push(json!({"role": "assistant", "content": format!("Fact {turn}: {}", "Lighthouses guide ships along dangerous coasts. ".repeat(2))}));
    }
    messages
        .push(json!({"role": "user", "content": "Put lunch on my schedule for Friday at noon."}));
    let body = json!({"model": "gpt-4o", "messages": messages, "tools": tools});
    let headers = [
        ("X-Mock-Tool-Call", "create_event"),
        ("X-Mock-Echo", "1"),
        ("X-Conversation-Id", "lunch"),
    ];
    let first: Value = answer_to(&proxy, &body, &headers).await;
    let reask = first["mock_echo"]["body"].clone();
    // Promoted in place in the block (strict), nothing appended to the messages.
    assert_eq!(reask["tools"][2], tools[2]);
    let sent = reask["messages"].as_array().unwrap().clone();
    assert!(
        !sent.last().unwrap()["content"]
            .as_str()
            .unwrap_or("")
            .starts_with(inline::HEADER)
    );

    let call = first["choices"][0]["message"].clone();
    let mut next = body.clone();
    let history = next["messages"].as_array_mut().unwrap();
    history.push(json!({"role": "assistant", "content": null, "tool_calls": call["tool_calls"]}));
    history.push(json!({"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "{\"id\": \"E-1\"}"}));
    let second: Value = post(
        &proxy,
        &next,
        &[("X-Mock-Echo", "1"), ("X-Conversation-Id", "lunch")],
    )
    .await
    .json()
    .await
    .unwrap();
    let now = &second["mock_echo"]["body"];
    assert_eq!(now["tools"], reask["tools"]);
    let now = now["messages"].as_array().unwrap();
    assert_eq!(
        &now[..sent.len()],
        &sent[..],
        "the re-ask's messages come first"
    );
}

#[tokio::test]
async fn a_tool_choice_naming_a_stub_defines_it_last_and_keeps_the_block() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = in_place_proxy(&mock).await;
    let mut body = request(false);
    body["tool_choice"] = json!({"type": "function", "function": {"name": "send_email"}});
    let explained = proxy.explain(&body, &[]).await;
    let plain = proxy.explain(&request(false), &[]).await;
    // The block is the conversation's, whatever this request's tool_choice says.
    assert_eq!(explained["request"]["tools"], plain["request"]["tools"]);
    let messages = explained["request"]["messages"].as_array().unwrap();
    let last = messages.last().unwrap()["content"].as_str().unwrap();
    assert!(last.starts_with(inline::HEADER), "{last}");
    assert!(last.contains("\"name\":\"send_email\""), "{last}");
}

/// An upstream that streams the start of a call of `get_weather`, then waits for `go` before
/// the call's arguments, the finish and `[DONE]`.
async fn upstream_pausing_after_a_call_start(go: tokio::sync::oneshot::Receiver<()>) -> String {
    use axum::body::Body;
    use futures_util::StreamExt;
    let chunk = |delta: Value, finish: Value| {
        let chunk = json!({"id": "up", "object": "chat.completion.chunk", "created": 1,
            "model": "gpt-4o", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        bytes::Bytes::from(format!("data: {chunk}\n\n"))
    };
    let head = vec![
        chunk(json!({"role": "assistant", "content": null}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_w", "type": "function",
                "function": {"name": "get_weather", "arguments": ""}}]}),
            Value::Null,
        ),
    ];
    let tail = vec![
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":\"Paris\"}"}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        bytes::Bytes::from_static(b"data: [DONE]\n\n"),
    ];
    let go = std::sync::Arc::new(std::sync::Mutex::new(Some(go)));
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move || {
            let go = go.lock().unwrap().take();
            let (head, tail) = (head.clone(), tail.clone());
            async move {
                let waited = futures_util::stream::once(async move {
                    if let Some(go) = go {
                        let _ = go.await;
                    }
                    futures_util::stream::iter(tail)
                })
                .flatten();
                let body = futures_util::stream::iter(head)
                    .chain(waited)
                    .map(Ok::<_, std::convert::Infallible>);
                axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(body))
                    .unwrap()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/v1")
}

#[tokio::test]
async fn a_streamed_call_of_a_full_tool_goes_out_before_the_answer_ends() {
    use futures_util::StreamExt;
    let (go, wait) = tokio::sync::oneshot::channel();
    let upstream = upstream_pausing_after_a_call_start(wait).await;
    // get_weather in full, the other tools as stubs: the answer may still call a stub.
    let proxy = common::start_proxy(&format!(
        "[upstream]\nbase_url = \"{upstream}\"\ntool_definitions = \"in_place\"\n{FILTER_ALL}always = [\"get_weather\"]\n"
    ))
    .await;
    let explained = proxy.explain(&request(true), &[]).await;
    let full: Vec<&str> = explained["request"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| {
            t["function"]["parameters"]["properties"]
                .as_object()
                .is_some_and(|p| !p.is_empty())
                && t["function"]["name"] != recall::TOOL_NAME
        })
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(full, ["get_weather"], "{explained}");
    let response = post(&proxy, &request(true), &[]).await;
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut received = String::new();
    // The call's start reaches the client while the upstream still holds the rest.
    let started = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while !received.contains("\"name\":\"get_weather\"") {
            let bytes = body.next().await.unwrap().unwrap();
            received.push_str(&String::from_utf8_lossy(&bytes));
        }
    })
    .await;
    assert!(started.is_ok(), "the call was held: {received}");
    go.send(()).unwrap();
    while let Some(bytes) = body.next().await {
        received.push_str(&String::from_utf8_lossy(&bytes.unwrap()));
    }
    let streamed = read_stream(&received);
    assert_eq!(
        streamed.calls,
        [("get_weather".to_owned(), r#"{"city":"Paris"}"#.to_owned())]
    );
    assert!(received.trim_end().ends_with("data: [DONE]"), "{received}");
}

/// A next turn of `request(stream)`: the client went on with a call of `send_email` and its
/// result, so the rewrite defines `send_email` where it was called.
fn after_a_send_email_call(stream: bool) -> Value {
    let mut next = request(stream);
    let messages = next["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
        "type": "function", "function": {"name": "send_email", "arguments": "{\"to\":\"a@b.co\"}"}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": "c1", "content": "sent"}));
    messages.push(json!({"role": "user", "content": "Send another one to the same address."}));
    next
}

/// `ctxproxy_tool_definitions_refused_total` of the default upstream.
async fn refusals(proxy: &Proxy) -> f64 {
    proxy
        .metric(
            "ctxproxy_tool_definitions_refused_total",
            &[("upstream", "default")],
        )
        .await
}

/// How many tools the rewrite of `body` defines in messages (explain).
async fn defined_in_rewrite(proxy: &Proxy, body: &Value) -> usize {
    let explained = proxy.explain(body, &[]).await;
    let rewrite: ctxproxy::openai::ChatRequest =
        serde_json::from_value(explained["request"].clone()).unwrap();
    inline::defined_in(&rewrite.messages).len()
}

#[tokio::test]
async fn an_upstream_that_refuses_definitions_in_place_is_asked_again_with_them_in_the_block() {
    let mock = start_mock(MockOptions::default()).await;
    let refuses = [("X-Mock-System-Messages", "reject")];
    for stream in [false, true] {
        // Configured as reading definitions in place, wrongly: its template refuses them.
        let proxy = in_place_proxy(&mock).await;
        let next = after_a_send_email_call(stream);
        assert_eq!(defined_in_rewrite(&proxy, &next).await, 1);
        let before = chat_count(&mock);
        let response = post(&proxy, &next, &refuses).await;
        assert_eq!(response.status(), 200, "stream {stream}");
        let text = response.text().await.unwrap();
        assert!(!text.contains("error"), "{text}");
        assert_eq!(chat_count(&mock) - before, 2, "refused, then asked again");
        let refused = refusals(&proxy).await;
        assert_eq!(refused, 1.0);
        // Learned: the upstream's next requests define tools in the block.
        assert_eq!(defined_in_rewrite(&proxy, &next).await, 0);
        // A re-ask (a stub called) that the template refuses is asked again the same way.
        let fresh = in_place_proxy(&mock).await;
        let headers = [refuses[0], ("X-Mock-Tool-Call", "get_weather")];
        let before = chat_count(&mock);
        let response = post(&fresh, &request(stream), &headers).await;
        assert_eq!(response.status(), 200);
        let text = response.text().await.unwrap();
        // Filled from the definition in the block (the stub has no parameters).
        assert!(
            text.contains("get_weather") && text.contains("city"),
            "{text}"
        );
        assert!(!text.contains("\"error\""), "{text}");
        assert_eq!(
            chat_count(&mock) - before,
            3,
            "first, refused re-ask, re-ask in the block"
        );
    }
}

#[tokio::test]
async fn any_other_400_is_the_clients_answer_and_teaches_nothing() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = in_place_proxy(&mock).await;
    let next = after_a_send_email_call(false);
    let requests = || MockStats::get(&mock.stats.requests);
    let before = requests();
    // A context too long, an invalid parameter: not a template's refusal.
    let response = post(&proxy, &next, &[("X-Mock-Status", "400")]).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["message"], "mock failure with status 400");
    assert_eq!(requests() - before, 1, "not asked again");
    let refused = refusals(&proxy).await;
    assert_eq!(refused, 0.0);
    assert_eq!(defined_in_rewrite(&proxy, &next).await, 1, "still in place");
}

#[tokio::test]
async fn a_template_that_drops_definitions_gets_them_in_the_block_by_default() {
    let mock = start_mock(MockOptions::default()).await;
    let headers = [
        ("X-Mock-System-Messages", "drop"),
        ("X-Mock-Tool-Call", "get_weather"),
    ];
    // The default for a loopback upstream: in the block, read whatever the template.
    let default = proxy_for(&mock, FILTER_ALL).await;
    let before = chat_count(&mock);
    let answer: Value = answer_to(&default, &request(false), &headers).await;
    let call = &answer["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["arguments"], r#"{"city":"mock"}"#);
    assert_eq!(
        chat_count(&mock) - before,
        2,
        "the stub call, then in the block"
    );
    assert_eq!(invalid_arguments(&default).await, 0.0);
}

/// `ctxproxy_tool_expansions_total{outcome="invalid_arguments"}`.
async fn invalid_arguments(proxy: &Proxy) -> f64 {
    proxy
        .metric(
            "ctxproxy_tool_expansions_total",
            &[("outcome", "invalid_arguments")],
        )
        .await
}

/// The (name, arguments) of the calls a JSON or streamed answer gives the client.
async fn calls_of(response: reqwest::Response, stream: bool) -> Vec<(String, String)> {
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    if stream {
        return read_stream(&body).calls;
    }
    let answer: Value = serde_json::from_str(&body).unwrap();
    answer["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let f = &c["function"];
            (
                f["name"].as_str().unwrap().to_owned(),
                f["arguments"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// A next turn of `request(stream)` after the client called `get_weather`: the rewrite defines
/// it in the messages, where a dropping template loses it.
fn after_a_get_weather_call(stream: bool) -> Value {
    let mut next = request(stream);
    let messages = next["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
        "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": "c1", "content": "{\"rain_mm\": 4}"}));
    messages.push(json!({"role": "user", "content": "And in Lyon?"}));
    next
}

const DROPS: (&str, &str) = ("X-Mock-System-Messages", "drop");

#[tokio::test]
async fn a_provider_that_refuses_a_call_it_did_not_write_gets_the_definitions_in_the_block() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, FILTER_ALL).await;
    // Thinking mode: a tool call without its reasoning is a 400, whatever its words.
    let headers = [
        ("X-Mock-Thinking", "1"),
        ("X-Mock-Tool-Call", "get_weather"),
    ];
    for stream in [false, true] {
        let before = chat_count(&mock);
        let calls = calls_of(post(&proxy, &request(stream), &headers).await, stream).await;
        assert_eq!(calls.len(), 1, "stream {stream}");
        assert_eq!(calls[0].0, "get_weather");
        assert!(calls[0].1.contains("\"city\""), "{calls:?}");
        if stream {
            // Learned: the stub's re-ask defines it in the block at once.
            assert_eq!(chat_count(&mock) - before, 2);
        } else {
            // The first ask, its re-ask with the definition as a call's result (refused),
            // and that re-ask with the tool in the block.
            assert_eq!(chat_count(&mock) - before, 3);
        }
    }
    assert_eq!(refusals(&proxy).await, 1.0);
}

#[tokio::test]
async fn every_kind_of_template_reads_a_definition_given_as_a_calls_result_at_once() {
    let mock = start_mock(MockOptions::default()).await;
    // The default for a loopback upstream; the tool's schema requires `city`.
    let proxy = proxy_for(&mock, FILTER_ALL).await;
    for mode in ["in_place", "reject", "drop"] {
        for stream in [false, true] {
            let headers = [
                ("X-Mock-System-Messages", mode),
                ("X-Mock-Tool-Call", "get_weather"),
            ];
            let before = chat_count(&mock);
            let calls = calls_of(post(&proxy, &request(stream), &headers).await, stream).await;
            // The stub's call asked again once, with the definition read: the call has the
            // parameters the schema requires, and nothing was asked in the block.
            assert_eq!(calls.len(), 1, "{mode} stream {stream}");
            assert_eq!(calls[0].0, "get_weather");
            assert!(calls[0].1.contains("\"city\""), "{mode}: {calls:?}");
            assert_eq!(chat_count(&mock) - before, 2, "{mode} stream {stream}");
        }
    }
    assert_eq!(refusals(&proxy).await, 0.0);
    assert_eq!(invalid_arguments(&proxy).await, 0.0);
}

#[tokio::test]
async fn a_call_that_fails_its_schema_after_a_dropped_definition_is_asked_again_in_the_block() {
    let mock = start_mock(MockOptions::default()).await;
    for stream in [false, true] {
        // Configured as reading definitions in place, wrongly: its template drops them.
        let proxy = in_place_proxy(&mock).await;
        let next = after_a_get_weather_call(stream);
        assert_eq!(defined_in_rewrite(&proxy, &next).await, 1);
        let headers = [DROPS, ("X-Mock-Tool-Call", "get_weather")];
        let before = chat_count(&mock);
        let response = post(&proxy, &next, &headers).await;
        assert_eq!(
            response.headers().get("x-ctxproxy-tools-expanded").cloned(),
            (!stream).then(|| "get_weather".parse().unwrap())
        );
        // The model, left with the stub, called it with `{}`: that failed the schema (`city`
        // is required) and was asked again with the tool in the block.
        let calls = calls_of(response, stream).await;
        assert_eq!(
            calls,
            [("get_weather".to_owned(), r#"{"city":"mock"}"#.to_owned())],
            "stream {stream}"
        );
        assert_eq!(chat_count(&mock) - before, 2, "stream {stream}");
        assert_eq!(invalid_arguments(&proxy).await, 1.0, "stream {stream}");
        // Learned: the upstream's next requests define tools in the block from the start.
        assert_eq!(defined_in_rewrite(&proxy, &next).await, 0);
        let before = chat_count(&mock);
        let calls = calls_of(post(&proxy, &next, &headers).await, stream).await;
        assert_eq!(calls[0].1, r#"{"city":"mock"}"#);
        assert_eq!(chat_count(&mock) - before, 1, "no re-ask");
        assert_eq!(invalid_arguments(&proxy).await, 1.0);
    }
}

#[tokio::test]
async fn a_stub_call_asked_again_in_place_and_dropped_is_asked_again_in_the_block() {
    let mock = start_mock(MockOptions::default()).await;
    for stream in [false, true] {
        let proxy = in_place_proxy(&mock).await;
        let headers = [DROPS, ("X-Mock-Tool-Call", "get_weather")];
        let before = chat_count(&mock);
        let calls = calls_of(post(&proxy, &request(stream), &headers).await, stream).await;
        assert_eq!(
            calls,
            [("get_weather".to_owned(), r#"{"city":"mock"}"#.to_owned())],
            "stream {stream}"
        );
        assert_eq!(
            chat_count(&mock) - before,
            3,
            "the stub call, its re-ask in place (dropped), then in the block"
        );
        assert_eq!(invalid_arguments(&proxy).await, 1.0, "stream {stream}");
        assert_eq!(
            defined_in_rewrite(&proxy, &after_a_get_weather_call(stream)).await,
            0
        );
    }
}

/// The tools of `request`, and `set_mode`, whose schema the mock's placeholder arguments
/// (`"mock"`) fail.
fn with_set_mode(stream: bool) -> Value {
    let mut body = request(stream);
    body["tools"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "function", "function": {
        "name": "set_mode", "description": "Set the forecast mode.",
        "parameters": {"type": "object", "properties": {"mode": {"type": "string",
            "pattern": "^(fast|slow)$"}}, "required": ["mode"]}}}));
    body
}

#[tokio::test]
async fn a_tool_in_full_in_the_block_is_never_asked_again_for_its_arguments() {
    let mock = start_mock(MockOptions::default()).await;
    let headers = [DROPS, ("X-Mock-Tool-Call", "set_mode")];
    let failing = [("set_mode".to_owned(), r#"{"mode":"mock"}"#.to_owned())];
    for stream in [false, true] {
        // Four small tools reach the upstream unchanged: the call is the model's answer.
        let unfiltered = proxy_for(&mock, "").await;
        let before = chat_count(&mock);
        let calls = calls_of(
            post(&unfiltered, &with_set_mode(stream), &headers).await,
            stream,
        );
        assert_eq!(calls.await, failing, "stream {stream}");
        assert_eq!(chat_count(&mock) - before, 1);
        // A stub defined in the block when called: asked once, for the definition only.
        let config = format!("tool_definitions = \"in_block\"\n{FILTER_ALL}");
        let in_block = proxy_for(&mock, &config).await;
        let before = chat_count(&mock);
        let calls = calls_of(
            post(&in_block, &with_set_mode(stream), &headers).await,
            stream,
        );
        assert_eq!(calls.await, failing, "stream {stream}");
        assert_eq!(chat_count(&mock) - before, 2);
        assert_eq!(invalid_arguments(&in_block).await, 0.0);
    }
}

#[tokio::test]
async fn a_model_that_read_the_definition_and_got_it_wrong_is_asked_again_and_teaches_nothing() {
    let mock = start_mock(MockOptions::default()).await;
    for stream in [false, true] {
        // A template that reads definitions in place: the model names `mode`, wrongly.
        let proxy = in_place_proxy(&mock).await;
        let before = chat_count(&mock);
        let headers = [("X-Mock-Tool-Call", "set_mode")];
        let calls = calls_of(post(&proxy, &with_set_mode(stream), &headers).await, stream).await;
        // Asked once more with it in the block, where a wrong answer is the client's.
        assert_eq!(
            calls,
            [("set_mode".to_owned(), r#"{"mode":"mock"}"#.to_owned())]
        );
        assert_eq!(chat_count(&mock) - before, 3, "stream {stream}");
        assert_eq!(invalid_arguments(&proxy).await, 1.0);
        // Not a dropped message: the upstream still gets definitions in place.
        assert_eq!(
            defined_in_rewrite(&proxy, &after_a_get_weather_call(stream)).await,
            1
        );
    }
}

#[tokio::test]
async fn what_one_replica_learns_of_a_template_the_others_read_from_the_store() {
    let mock = start_mock(MockOptions::default()).await;
    let shared = common::unique_prefix("learned");
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\ntool_definitions = \"in_place\"\n{FILTER_ALL}",
        mock.base_url()
    );
    let replica = || {
        let env = vec![("CTXPROXY_STORE_KEY_PREFIX".to_owned(), shared.clone())];
        common::start_proxy_with_env(&toml, env)
    };
    let (first, second) = (replica().await, replica().await);
    let next = after_a_get_weather_call(false);
    let headers = [DROPS, ("X-Mock-Tool-Call", "get_weather")];
    let calls = calls_of(post(&first, &next, &headers).await, false).await;
    assert_eq!(calls[0].1, r#"{"city":"mock"}"#);
    // Written in the background.
    let upstream = first.state.upstreams.get(0).unwrap();
    let key = learned::key(upstream);
    let mut stored = None;
    for _ in 0..100 {
        stored = first.state.store.get(&key).await;
        if stored.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(stored.as_deref(), Some(&b"drops"[..]));
    // The other replica reads it on its next request: definitions in the block from the start.
    assert_eq!(defined_in_rewrite(&second, &next).await, 0);
    let before = chat_count(&mock);
    let calls = calls_of(post(&second, &next, &headers).await, false).await;
    assert_eq!(calls[0].1, r#"{"city":"mock"}"#);
    assert_eq!(chat_count(&mock) - before, 1, "no re-ask");
    // A replica of another deployment (another key prefix) learns nothing from it.
    let other = in_place_proxy(&mock).await;
    assert_eq!(defined_in_rewrite(&other, &next).await, 1);
}

#[tokio::test]
async fn with_the_store_down_a_replica_still_learns_for_itself() {
    let mock = start_mock(MockOptions::default()).await;
    let port = common::closed_port().await;
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\ntool_definitions = \"in_place\"\n{FILTER_ALL}",
        mock.base_url()
    );
    let env = vec![(
        "CTXPROXY_STORE_REDIS_URL".to_owned(),
        format!("redis://127.0.0.1:{port}"),
    )];
    let proxy = common::start_proxy_with_env(&toml, env).await;
    let next = after_a_get_weather_call(true);
    let headers = [DROPS, ("X-Mock-Tool-Call", "get_weather")];
    let calls = calls_of(post(&proxy, &next, &headers).await, true).await;
    assert_eq!(calls[0].1, r#"{"city":"mock"}"#);
    assert_eq!(defined_in_rewrite(&proxy, &next).await, 0);
}

/// The Responses form of `an_upstream_that_refuses_definitions_in_place_…`: the re-ask
/// with the definitions in the block must still be a Responses body.
#[tokio::test]
async fn a_responses_request_refused_in_place_is_asked_again_as_a_responses_body() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = in_place_proxy(&mock).await;
    let flat: Vec<Value> = tools()
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let mut flat = t["function"].clone();
            flat["type"] = json!("function");
            flat
        })
        .collect();
    let body = json!({"model": "gpt-4o", "store": false, "tools": flat, "input": [
        {"role": "user", "content": "Do I need an umbrella in Paris tomorrow?"},
        {"type": "function_call", "call_id": "c1", "name": "send_email", "arguments": "{\"to\":\"a@b.co\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sent"},
        {"role": "user", "content": "Send another one to the same address."}
    ]});
    let explained = proxy.explain(&body, &[]).await;
    let sent = explained["request"].to_string();
    assert!(
        sent.contains("send_email") && explained["request"]["input"].is_array(),
        "{sent}"
    );
    let response = client()
        .post(proxy.url("/v1/responses"))
        .header("X-Mock-System-Messages", "reject")
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["object"], "response", "{text}");
    assert!(answer["error"].is_null(), "{text}");
}
