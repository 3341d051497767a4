//! The agent guards through the running proxy and the mock upstream: continuation of answers
//! cut at `max_tokens` (JSON and streams), reinforcement of long conversations, and the
//! claim-vs-action check with its retry; and nothing at all when they are off.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Mock, Proxy, client, proxy_for, start_mock};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use serde_json::{Value, json};

const STORY: &str = "The keeper climbed the stairs, lit the lamp, wound the clock and watched \
    the ships pass the reef until the sun came up over the bay.";

async fn post(proxy: &Proxy, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client().post(proxy.url("/v1/chat/completions")).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

fn story_request(max_tokens: u64, stream: bool) -> Value {
    json!({"model": "gpt-4o", "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": "Tell me a short story."}]})
}

fn chat_count(mock: &Mock) -> u64 {
    MockStats::get(&mock.stats.chat_requests)
}

/// The content, finish reasons, ids and usage of an SSE answer.
fn read_stream(text: &str) -> (String, Vec<String>, Vec<String>, Option<Value>) {
    let (mut content, mut finishes, mut ids, mut usage) =
        (String::new(), Vec::new(), Vec::new(), None);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    for payload in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if payload == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(payload).unwrap();
        ids.push(chunk["id"].as_str().unwrap().to_owned());
        if chunk["usage"].is_object() {
            usage = Some(chunk["usage"].clone());
        }
        if let Some(choice) = chunk["choices"].get(0) {
            content.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
            if let Some(finish) = choice["finish_reason"].as_str() {
                finishes.push(finish.to_owned());
            }
        }
    }
    (content, finishes, ids, usage)
}

#[tokio::test]
async fn a_cut_answer_is_continued_and_merged_without_a_seam() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "[continuation]\nenabled = true\n").await;
    let headers = [("X-Mock-Reply", STORY), ("X-Mock-Overlap", "9")];

    let answer: Value = post(&proxy, &story_request(8, false), &headers)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], STORY);
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    // 24 words: 8 in the first part, then parts of 8 pieces that begin with a repeat.
    let calls = chat_count(&mock);
    assert!((3..=4).contains(&calls), "{calls}");
    let completion = answer["usage"]["completion_tokens"].as_u64().unwrap();
    // Usage is summed over the parts: every part but the last gave 8 pieces.
    assert!(
        completion > 8 * (calls - 1) && completion <= 8 * calls,
        "{completion} over {calls} parts"
    );
    assert!(answer["usage"]["prompt_tokens"].as_u64().unwrap() > 3 * 10);

    // The same as a stream: one answer, one id, one finish reason, summed usage at the end.
    let mut streamed = story_request(8, true);
    streamed["stream_options"] = json!({"include_usage": true});
    let text = post(&proxy, &streamed, &headers)
        .await
        .text()
        .await
        .unwrap();
    let (content, finishes, ids, usage) = read_stream(&text);
    assert_eq!(content, STORY);
    assert_eq!(finishes, ["stop"]);
    assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
    assert_eq!(
        usage.unwrap()["completion_tokens"].as_u64(),
        Some(completion)
    );
    assert_eq!(
        proxy
            .metric("ctxproxy_continuations_total", &[("outcome", "completed")])
            .await,
        2.0
    );
}

#[tokio::test]
async fn a_failed_continuation_returns_the_cut_answer_as_it_was() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "[continuation]\nenabled = true\n").await;
    let headers = [("X-Mock-Reply", STORY), ("X-Mock-Follow-Up-Status", "503")];
    let first_part: Vec<&str> = STORY.split(' ').take(4).collect();
    let answer: Value = post(&proxy, &story_request(4, false), &headers)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        first_part.join(" ")
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    let mut streamed = story_request(4, true);
    streamed["stream_options"] = json!({"include_usage": true});
    let text = post(&proxy, &streamed, &headers)
        .await
        .text()
        .await
        .unwrap();
    let (content, finishes, _, usage) = read_stream(&text);
    assert_eq!(content, first_part.join(" "));
    assert_eq!(finishes, ["length"]);
    assert_eq!(usage.unwrap()["completion_tokens"], 4);
    assert_eq!(
        chat_count(&mock),
        4,
        "two answers, one failed continuation each"
    );
    assert_eq!(
        proxy
            .metric("ctxproxy_continuations_total", &[("outcome", "error")])
            .await,
        2.0
    );
}

#[tokio::test]
async fn attempts_are_bounded_and_tool_calls_never_continued() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "[continuation]\nenabled = true\nmax_attempts = 2\n").await;
    let headers = [("X-Mock-Reply", STORY)];

    let answer: Value = post(&proxy, &story_request(3, false), &headers)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(chat_count(&mock), 3, "the answer and two continuations");
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    let words: Vec<&str> = STORY.split(' ').take(9).collect();
    assert_eq!(answer["choices"][0]["message"]["content"], words.join(" "));
    let text = post(&proxy, &story_request(3, true), &headers)
        .await
        .text()
        .await
        .unwrap();
    let (content, finishes, _, _) = read_stream(&text);
    assert_eq!(
        (content, finishes),
        (words.join(" "), vec!["length".to_owned()])
    );
    assert_eq!(chat_count(&mock), 6);
    assert_eq!(
        proxy
            .metric(
                "ctxproxy_continuations_total",
                &[("outcome", "max_attempts")]
            )
            .await,
        2.0
    );

    // A tool call is never continued, whatever its finish reason.
    let mut with_tools = story_request(1, false);
    with_tools["tools"] = json!([{"type": "function", "function": {"name": "tell_story",
        "parameters": {"type": "object", "properties": {}}}}]);
    let answer: Value = post(&proxy, &with_tools, &[("X-Mock-Tool-Call", "auto")])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(chat_count(&mock), 7);

    // A continuation that would not fit in the request's budget is not sent.
    let answer: Value = post(
        &proxy,
        &story_request(3, false),
        &[("X-Mock-Reply", STORY), ("X-Ctxproxy-Budget", "40")],
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(chat_count(&mock), 8);
    assert_eq!(
        proxy
            .metric("ctxproxy_continuations_total", &[("outcome", "budget")])
            .await,
        1.0
    );
}

fn conversation(turns: usize) -> Value {
    let mut messages = vec![json!({"role": "system", "content": "You are a ticket agent."})];
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Open ticket {turn}.")}));
        messages.push(json!({"role": "assistant", "content": format!("Ticket {turn} is open.")}));
    }
    messages.push(json!({"role": "user", "content": "Now close the first one."}));
    json!({"model": "gpt-4o", "messages": messages})
}

/// The system message the upstream received.
async fn received_system(proxy: &Proxy, body: &Value) -> String {
    let answer: Value = post(proxy, body, &[("X-Mock-Echo", "1")])
        .await
        .json()
        .await
        .unwrap();
    let messages = answer["mock_echo"]["body"]["messages"].as_array().unwrap();
    assert_eq!(messages.iter().filter(|m| m["role"] == "system").count(), 1);
    assert_eq!(messages[0]["role"], "system");
    messages[0]["content"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn the_reminder_ends_the_system_message_of_long_conversations_only() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(
        &mock,
        "[reinforcement]\nenabled = true\nafter_messages = 6\ntext = \"REMINDER: act through the tools.\"\n",
    )
    .await;
    // 3 turns + 1 = 7 messages: past the threshold.
    let long = received_system(&proxy, &conversation(3)).await;
    assert!(long.starts_with("You are a ticket agent."), "{long}");
    assert!(
        long.ends_with("\n\nREMINDER: act through the tools."),
        "{long}"
    );
    assert_eq!(long.matches("REMINDER").count(), 1);
    let short = received_system(&proxy, &conversation(2)).await;
    assert_eq!(short, "You are a ticket agent.");
    let explained: Value = client()
        .post(proxy.url("/v1/ctxproxy/explain"))
        .json(&conversation(3))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let stages: Vec<&str> = explained["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["stage"].as_str().unwrap())
        .collect();
    assert_eq!(stages.last(), Some(&"reinforcement"));
}

fn ticket_request(stream: bool) -> Value {
    json!({"model": "gpt-4o", "stream": stream,
        "messages": [{"role": "user", "content": "Create a ticket about the broken printer."}],
        "tools": [{"type": "function", "function": {"name": "create_ticket",
            "parameters": {"type": "object", "properties": {"title": {"type": "string"}},
                "required": ["title"]}}}]})
}

#[tokio::test]
async fn a_claim_without_a_tool_call_is_flagged_and_repaired_on_demand() {
    let mock = start_mock(MockOptions::default()).await;
    let claim = [(
        "X-Mock-Reply",
        "Done! I've created the ticket for the printer.",
    )];
    let proxy = proxy_for(&mock, "[action_check]\nenabled = true\n").await;
    let answer = post(&proxy, &ticket_request(false), &claim).await;
    assert_eq!(
        answer.headers()["x-ctxproxy-warning"],
        "action-claimed-without-tool-call"
    );
    let body: Value = answer.json().await.unwrap();
    assert!(
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("Done!")
    );
    // A real question is not a claim; a stream says it in an SSE comment.
    let question = [("X-Mock-Reply", "Which printer is broken?")];
    let answer = post(&proxy, &ticket_request(false), &question).await;
    assert!(answer.headers().get("x-ctxproxy-warning").is_none());
    let text = post(&proxy, &ticket_request(true), &claim)
        .await
        .text()
        .await
        .unwrap();
    assert!(
        text.contains(": x-ctxproxy-warning: action-claimed-without-tool-call"),
        "{text}"
    );
    assert_eq!(
        read_stream(&text).0,
        "Done! I've created the ticket for the printer."
    );
    assert_eq!(
        proxy
            .metric(
                "ctxproxy_action_claims_without_tool_call_total",
                &[("repair", "off")]
            )
            .await,
        2.0
    );

    // With retry, the model is asked once more (the note carries the mock's tool-call marker).
    let repairing = proxy_for(
        &mock,
        // Its one small tool is filtered (min_tool_tokens = 0), as a large block would be; the
        // recall tool (40 tokens) would outweigh what filtering one tool saves.
        "[pipeline.compact]\nrecall = false\n[tools]\nmin_tool_tokens = 0\nmin_stub_tokens = 0\n[action_check]\nenabled = true\nretry = true\nretry_note = \"No tool was called. Call it now. [mock:tool_call]\"\n",
    )
    .await;
    let before = chat_count(&mock);
    let answer = post(&repairing, &ticket_request(false), &claim).await;
    assert_eq!(
        answer.headers()["x-ctxproxy-repaired"],
        "action-claimed-without-tool-call"
    );
    let body: Value = answer.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "create_ticket"
    );
    assert_eq!(chat_count(&mock), before + 2);
    assert_eq!(
        repairing
            .metric(
                "ctxproxy_action_claims_without_tool_call_total",
                &[("repair", "repaired")]
            )
            .await,
        1.0
    );
    // The filter sent no tool for an unrelated message; the retry offers the client's tools.
    let mut unrelated = ticket_request(false);
    unrelated["messages"][0]["content"] = json!("Good morning, how are you today?");
    let answer = post(&repairing, &unrelated, &claim).await;
    let tokens = |name: &str| {
        answer.headers()[name]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    assert!(tokens("x-ctxproxy-tokens-after") < tokens("x-ctxproxy-tokens-before"));
    assert_eq!(
        answer.headers()["x-ctxproxy-repaired"],
        "action-claimed-without-tool-call"
    );
    // A retry that fails leaves the first answer, flagged.
    let failing = [claim[0], ("X-Mock-Follow-Up-Status", "500")];
    let answer = post(&repairing, &ticket_request(false), &failing).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(
        answer.headers()["x-ctxproxy-warning"],
        "action-claimed-without-tool-call"
    );
    assert_eq!(
        repairing
            .metric(
                "ctxproxy_action_claims_without_tool_call_total",
                &[("repair", "failed")]
            )
            .await,
        1.0
    );
}

#[tokio::test]
async fn nothing_changes_when_the_guards_are_off() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "").await;
    let answer: Value = post(&proxy, &story_request(5, false), &[("X-Mock-Reply", STORY)])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(chat_count(&mock), 1);
    let claim = [("X-Mock-Reply", "Done! I've created the ticket.")];
    let answer = post(&proxy, &ticket_request(false), &claim).await;
    assert!(answer.headers().get("x-ctxproxy-warning").is_none());
    assert_eq!(
        received_system(&proxy, &conversation(8)).await,
        "You are a ticket agent."
    );
    // Mode off skips the guards even when they are on.
    let guarded = proxy_for(&mock, "[continuation]\nenabled = true\n").await;
    let before = chat_count(&mock);
    let answer: Value = post(
        &guarded,
        &story_request(5, false),
        &[("X-Mock-Reply", STORY), ("X-Ctxproxy-Mode", "off")],
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(chat_count(&mock), before + 1);
}

async fn post_responses(
    proxy: &Proxy,
    body: &Value,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut request = client().post(proxy.url("/v1/responses")).json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

fn responses_count(mock: &Mock) -> u64 {
    MockStats::get(&mock.stats.responses_requests)
}

/// The events of a Responses stream, in order.
fn read_events(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

/// The text of a Response's message items.
fn response_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap())
        .map(|part| part["text"].as_str().unwrap())
        .collect()
}

#[tokio::test]
async fn a_cut_response_is_continued_and_merged_into_one_message() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, "[continuation]\nenabled = true\n").await;
    let headers = [("X-Mock-Reply", STORY), ("X-Mock-Overlap", "9")];
    let request = json!({"model": "gpt-4o", "max_output_tokens": 8,
        "input": "Tell me a short story.", "store": false});

    let answer: Value = post_responses(&proxy, &request, &headers)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(response_text(&answer), STORY);
    assert_eq!(answer["status"], "completed", "{answer}");
    assert_eq!(answer["incomplete_details"], Value::Null);
    let messages = answer["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .count();
    assert_eq!(messages, 1, "one message item: {answer}");
    let calls = responses_count(&mock);
    assert!((3..=4).contains(&calls), "{calls}");
    let output = answer["usage"]["output_tokens"].as_u64().unwrap();
    assert!(
        output > 8 * (calls - 1) && output <= 8 * calls,
        "{output} over {calls} parts"
    );
    assert_eq!(
        proxy
            .metric("ctxproxy_continuations_total", &[("outcome", "completed")])
            .await,
        1.0
    );

    // The same as a stream: one Response, its events numbered in order, one message.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let text = post_responses(&proxy, &streamed, &headers)
        .await
        .text()
        .await
        .unwrap();
    let events = read_events(&text);
    let sequence: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(
        sequence,
        (0..events.len() as u64).collect::<Vec<_>>(),
        "{text}"
    );
    let of = |kind: &str| -> Vec<&Value> { events.iter().filter(|e| e["type"] == kind).collect() };
    assert_eq!(of("response.created").len(), 1);
    let deltas: String = of("response.output_text.delta")
        .iter()
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, STORY);
    let item_ids: Vec<&Value> = of("response.output_text.delta")
        .iter()
        .map(|e| &e["item_id"])
        .collect();
    assert!(
        item_ids.windows(2).all(|w| w[0] == w[1]),
        "one message item"
    );
    assert_eq!(of("response.output_text.done")[0]["text"], STORY);
    assert_eq!(of("response.output_item.added").len(), 1, "{text}");
    let done = of("response.output_item.done");
    assert_eq!(
        (done.len(), &done[0]["item"]["status"]),
        (1, &json!("completed"))
    );
    assert!(of("response.incomplete").is_empty(), "{text}");
    let completed = of("response.completed");
    assert_eq!(completed.len(), 1);
    let whole = &completed[0]["response"];
    assert_eq!(whole["id"], of("response.created")[0]["response"]["id"]);
    assert_eq!(response_text(whole), STORY);
    assert_eq!(whole["usage"]["output_tokens"].as_u64(), Some(output));
    assert_eq!(
        proxy
            .metric("ctxproxy_continuations_total", &[("outcome", "completed")])
            .await,
        2.0
    );

    // A stored Response streams under the first part's id: relayed as the upstream cut it
    // (its stored copy would not be what the client got). So is every answer with the guard off.
    streamed["store"] = json!(true);
    let text = post_responses(&proxy, &streamed, &headers)
        .await
        .text()
        .await
        .unwrap();
    assert!(text.contains("event: response.incomplete"), "{text}");
    let unguarded = proxy_for(&mock, "").await;
    let answer: Value = post_responses(&unguarded, &request, &headers)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["status"], "incomplete");
    assert_eq!(answer["incomplete_details"]["reason"], "max_output_tokens");
}

#[tokio::test]
async fn a_claimed_action_in_a_response_is_flagged_and_repaired() {
    let mock = start_mock(MockOptions::default()).await;
    let claim = [(
        "X-Mock-Reply",
        "Done! I've created the ticket for the printer.",
    )];
    let request = json!({"model": "gpt-4o", "store": false,
        "input": [{"role": "user", "content": "Create a ticket about the broken printer."}],
        "tools": [{"type": "function", "name": "create_ticket",
            "parameters": {"type": "object", "properties": {"title": {"type": "string"}},
                "required": ["title"]}}]});
    let flagging = proxy_for(&mock, "[action_check]\nenabled = true\n").await;
    let answer = post_responses(&flagging, &request, &claim).await;
    assert_eq!(
        answer.headers()["x-ctxproxy-warning"],
        "action-claimed-without-tool-call"
    );
    let body: Value = answer.json().await.unwrap();
    assert!(response_text(&body).starts_with("Done!"), "{body}");
    // A stream says it in an SSE comment, before its terminal event.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let text = post_responses(&flagging, &streamed, &claim)
        .await
        .text()
        .await
        .unwrap();
    let comment = text
        .find(": x-ctxproxy-warning: action-claimed-without-tool-call")
        .unwrap_or_else(|| panic!("{text}"));
    assert!(comment < text.find("event: response.completed").unwrap());
    assert_eq!(
        read_events(&text).last().unwrap()["type"],
        "response.completed"
    );

    let repairing = proxy_for(
        &mock,
        "[pipeline.compact]\nrecall = false\n[tools]\nmin_tool_tokens = 0\nmin_stub_tokens = 0\n[action_check]\nenabled = true\nretry = true\nretry_note = \"No tool was called. Call it now. [mock:tool_call]\"\n",
    )
    .await;
    let before = responses_count(&mock);
    let answer = post_responses(&repairing, &request, &claim).await;
    assert_eq!(
        answer.headers()["x-ctxproxy-repaired"],
        "action-claimed-without-tool-call"
    );
    let body: Value = answer.json().await.unwrap();
    let call = body["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["type"] == "function_call")
        .unwrap_or_else(|| panic!("{body}"));
    assert_eq!(call["name"], "create_ticket");
    assert_eq!(responses_count(&mock), before + 2);
    assert_eq!(
        repairing
            .metric(
                "ctxproxy_action_claims_without_tool_call_total",
                &[("repair", "repaired")]
            )
            .await,
        1.0
    );
}
