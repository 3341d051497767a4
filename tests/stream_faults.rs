//! Answers that fail after their 200, through the running proxy and the mock upstream (its
//! `X-Mock-Stream-Fault`, `X-Mock-Invalid-Json` and `X-Mock-Fault-On` headers): a stream that is
//! reset, stalls, ends early or is cut mid-event ends with one whole OpenAI-format error event
//! and nothing after it (no `[DONE]`, no expanded comment, no usage), in the first answer, an
//! expansion's re-ask or a continuation; a complete stream ends with `[DONE]` (or, when the
//! upstream sends no `[DONE]`, its finish reason and the usage asked for), and nothing the
//! upstream does after `[DONE]` reaches the client or holds it; the request's total timeout
//! bounds the whole exchange; a re-ask answered with something that is not JSON is a 502.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{Mock, Proxy, client, proxy_for, start_mock};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use serde_json::{Value, json};

/// A short total timeout, so that a stall test takes about a second.
const QUICK: &str = "total_timeout_ms = 1000\n";

/// A total timeout no test reaches unless something holds it: for the answers that must come
/// whole (several upstream round trips in a debug build on a busy machine).
const ROOMY: &str = "total_timeout_ms = 10000\n";

/// Every tool goes as a stub, whatever its size; a re-ask defines the tool called in a message
/// appended last (the upstream taken as reading it in place), which the mock's
/// `X-Mock-Fault-On: reask` recognizes. Follows an `[upstream]` key.
const STUBS: &str =
    "tool_definitions = \"in_place\"\n[tools]\nmin_tool_tokens = 0\nmin_stub_tokens = 0\n";

/// Loose bound for a request cut at the 1 s total timeout (the machines are noisy).
const CUT_WITHIN: Duration = Duration::from_millis(2500);

const CALL: (&str, &str) = ("X-Mock-Tool-Call", "get_weather");

fn plain(stream: bool) -> Value {
    json!({"model": "gpt-4o", "stream": stream,
        "messages": [{"role": "user", "content": "Say something about lighthouses."}]})
}

/// A question no keyword ties to a tool: every tool goes as a stub.
fn with_tools(stream: bool) -> Value {
    json!({"model": "gpt-4o", "stream": stream,
    "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
    "messages": [{"role": "user", "content": "Do I need an umbrella in Paris tomorrow?"}],
    "tools": [
        {"type": "function", "function": {"name": "get_weather",
            "description": "Weather forecast for a city. Gives hourly temperatures.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}},
        {"type": "function", "function": {"name": "send_email",
            "description": "Send an email message.",
            "parameters": {"type": "object", "properties": {"to": {"type": "string"}}}}}
    ]})
}

async fn post(proxy: &Proxy, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("Cache-Control", "no-cache")
        .json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

/// The body of a streamed answer, and how long the whole request took.
async fn streamed(proxy: &Proxy, body: &Value, headers: &[(&str, &str)]) -> (String, Duration) {
    let started = Instant::now();
    let response = post(proxy, body, headers).await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    (text, started.elapsed())
}

fn chat_count(mock: &Mock) -> u64 {
    MockStats::get(&mock.stats.chat_requests)
}

/// The events of an SSE body, without their blank lines.
fn events(body: &str) -> Vec<&str> {
    body.split("\n\n")
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect()
}

/// Asserts that every data event of `body` is whole: `[DONE]` or a JSON object.
fn whole_events(body: &str) {
    for event in events(body) {
        if let Some(payload) = event.strip_prefix("data: ") {
            let whole = payload == "[DONE]" || serde_json::from_str::<Value>(payload).is_ok();
            assert!(whole, "an event that is not whole: {event:?} in {body}");
        }
    }
}

/// Asserts that `body` ends with exactly one OpenAI-format error event and that nothing of a
/// complete answer follows or precedes it, every event whole; returns its code.
fn error_at_end(body: &str) -> String {
    whole_events(body);
    let events = events(body);
    let last = events.last().unwrap_or_else(|| panic!("empty body"));
    let payload = last
        .strip_prefix("data: ")
        .unwrap_or_else(|| panic!("the last event is not data: {body}"));
    let value: Value = serde_json::from_str(payload).unwrap();
    let error = &value["error"];
    assert!(error["message"].is_string(), "{body}");
    assert_eq!(error["type"], "server_error", "{body}");
    assert!(error["param"].is_null(), "{body}");
    let errors = events.iter().filter(|e| e.contains("\"error\"")).count();
    assert_eq!(errors, 1, "one error event: {body}");
    assert!(!body.contains("data: [DONE]"), "{body}");
    assert!(!body.contains("x-ctxproxy-tools-expanded"), "{body}");
    error["code"].as_str().unwrap().to_owned()
}

/// Sends `request` with `header` once for each fault a stream can have after its head, on the
/// requests `on` names (`first`, `reask`): each ends with its error event, without usage (no
/// part's, no sum) and within the deadline, after `asked` upstream requests.
async fn each_stream_fault_ends_with_its_error_event(
    (proxy, mock): (&Proxy, &Mock),
    request: &Value,
    header: (&str, &str),
    on: &str,
    asked: u64,
) {
    let expected = [
        ("reset-after=2", "upstream_stream_interrupted"),
        ("early-end-after=2", "upstream_stream_interrupted"),
        ("cut-mid-event-after=2", "upstream_stream_interrupted"),
        ("stall-after=2", "upstream_timeout"),
    ];
    for (fault, code) in expected {
        let before = chat_count(mock);
        let headers = [
            header,
            ("X-Mock-Stream-Fault", fault),
            ("X-Mock-Fault-On", on),
        ];
        let (body, took) = streamed(proxy, request, &headers).await;
        assert_eq!(error_at_end(&body), code, "{fault}");
        assert!(!body.contains("\"usage\""), "{fault}: {body}");
        assert_eq!(chat_count(mock) - before, asked, "{fault}");
        // Once three times the total timeout with stubs: one deadline for the request.
        assert!(took < CUT_WITHIN, "{fault}: {took:?}");
    }
}

/// The OpenAI-format error of a JSON response: its status and code.
async fn json_error(response: reqwest::Response) -> (u16, String) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(body["error"]["param"].is_null(), "{body}");
    (status, body["error"]["code"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn a_plain_stream_that_is_reset_or_ends_early_ends_with_an_error_event() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, QUICK).await;
    let (body, _) = streamed(&proxy, &plain(true), &[]).await;
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");

    // Cut in the middle of the third event: that half is not relayed, the error event is whole.
    for fault in [
        "reset-after=2",
        "early-end-after=2",
        "cut-mid-event-after=2",
    ] {
        let (body, _) = streamed(&proxy, &plain(true), &[("X-Mock-Stream-Fault", fault)]).await;
        assert_eq!(
            error_at_end(&body),
            "upstream_stream_interrupted",
            "{fault}"
        );
        assert_eq!(events(&body).len(), 3, "two chunks, then the error: {body}");
    }
    let failed = proxy
        .metric("ctxproxy_upstream_errors_total", &[("kind", "body")])
        .await;
    assert_eq!(failed, 3.0);
}

#[tokio::test]
async fn a_plain_stream_that_stalls_is_cut_at_the_total_timeout_with_an_error_event() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, QUICK).await;
    let (body, took) = streamed(
        &proxy,
        &plain(true),
        &[("X-Mock-Stream-Fault", "stall-after=2")],
    )
    .await;
    assert_eq!(error_at_end(&body), "upstream_timeout");
    assert!(took < CUT_WITHIN, "{took:?}");
}

#[tokio::test]
async fn a_finish_reason_without_done_is_a_complete_stream() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, QUICK).await;
    let (whole, _) = streamed(&proxy, &plain(true), &[]).await;
    // Everything but `[DONE]`: the finish chunk, then the usage chunk ctxproxy asked for (and
    // leaves out: the client did not ask).
    let fault = format!("early-end-after={}", events(&whole).len());
    let (body, _) = streamed(&proxy, &plain(true), &[("X-Mock-Stream-Fault", &fault)]).await;
    assert_eq!(format!("{body}data: [DONE]\n\n"), whole);
    assert!(!body.contains("\"error\""), "{body}");
}

#[tokio::test]
async fn a_stream_that_ends_after_its_finish_reason_without_the_usage_asked_ends_with_an_error() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, QUICK).await;
    // ctxproxy asks the usage of every stream (the meter reads it): without it, or `[DONE]`,
    // the answer is not known to be whole. The upstream's events: the client's, then the usage
    // chunk; the cut is after the finish chunk.
    let (whole, _) = streamed(&proxy, &plain(true), &[]).await;
    let fault = format!("early-end-after={}", events(&whole).len() - 1);
    let headers = [("X-Mock-Stream-Fault", fault.as_str())];
    let (body, _) = streamed(&proxy, &plain(true), &headers).await;
    assert_eq!(error_at_end(&body), "upstream_stream_interrupted");
    assert!(body.contains("\"finish_reason\":\"stop\""), "{body}");
}

#[tokio::test]
async fn nothing_after_done_reaches_the_client_or_holds_it() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, &format!("{ROOMY}{STUBS}")).await;
    // A plain stream, and an expanded one (the fault on its re-ask: the end of the task).
    let cases = [
        (plain(true), vec![]),
        (with_tools(true), vec![CALL, ("X-Mock-Fault-On", "reask")]),
    ];
    for (request, steer) in cases {
        let (whole, _) = streamed(&proxy, &request, &steer).await;
        assert!(whole.trim_end().ends_with("data: [DONE]"), "{whole}");
        // Far more events than the answer has: all of it, `[DONE]` included, then the fault.
        for fault in ["reset-after=1000", "stall-after=1000"] {
            let headers = [&steer[..], &[("X-Mock-Stream-Fault", fault)]].concat();
            let (body, took) = streamed(&proxy, &request, &headers).await;
            assert_eq!(body, whole, "{fault}");
            // Not held until the 10 s total timeout.
            assert!(took < Duration::from_secs(5), "{fault}: {took:?}");
        }
    }
}

#[tokio::test]
async fn a_first_answer_with_stubs_that_fails_ends_with_an_error_event_and_is_not_asked_again() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, &format!("{QUICK}{STUBS}")).await;
    // No re-ask.
    let request = with_tools(true);
    each_stream_fault_ends_with_its_error_event((&proxy, &mock), &request, CALL, "first", 1).await;
}

#[tokio::test]
async fn a_re_ask_that_fails_mid_stream_ends_with_an_error_event_and_adds_nothing() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, &format!("{QUICK}{STUBS}")).await;
    let roomy = proxy_for(&mock, &format!("{ROOMY}{STUBS}")).await;
    let (whole, _) = streamed(&roomy, &with_tools(true), &[CALL]).await;
    assert!(
        whole
            .trim_end()
            .ends_with(": x-ctxproxy-tools-expanded: get_weather\n\ndata: [DONE]"),
        "{whole}"
    );
    // One re-ask, which fails.
    let request = with_tools(true);
    each_stream_fault_ends_with_its_error_event((&proxy, &mock), &request, CALL, "reask", 2).await;
}

#[tokio::test]
async fn the_total_timeout_bounds_an_expanded_stream_re_asks_included() {
    let mock = start_mock(MockOptions::default()).await;
    let total = "total_timeout_ms = 1500\n";
    let proxy = proxy_for(&mock, &format!("{total}{STUBS}")).await;
    // Each answer's head after `latency`: the re-ask's comes at twice that. With 400 ms it comes
    // in time and stalls; with 900 ms it would come after the deadline. Either way the request
    // ends at 1.5 s; a re-ask with a total timeout of its own would end at 2.3 s or later.
    for latency in ["400", "900"] {
        let headers = [
            CALL,
            ("X-Mock-Latency-Ms", latency),
            ("X-Mock-Stream-Fault", "stall-after=1"),
            ("X-Mock-Fault-On", "reask"),
        ];
        let (body, took) = streamed(&proxy, &with_tools(true), &headers).await;
        assert_eq!(error_at_end(&body), "upstream_timeout", "{latency}");
        assert!(took >= Duration::from_millis(1400), "{latency}: {took:?}");
        assert!(took < Duration::from_millis(2200), "{latency}: {took:?}");
    }
}

#[tokio::test]
async fn a_re_ask_answered_with_invalid_json_is_a_502_or_an_error_event() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, &format!("{QUICK}{STUBS}")).await;
    let headers = [
        CALL,
        ("X-Mock-Invalid-Json", "1"),
        ("X-Mock-Fault-On", "reask"),
    ];
    let response = post(&proxy, &with_tools(false), &headers).await;
    assert_eq!(
        json_error(response).await,
        (502, "upstream_invalid_response".to_owned())
    );
    let (body, _) = streamed(&proxy, &with_tools(true), &headers).await;
    assert_eq!(error_at_end(&body), "upstream_invalid_response");
    assert_eq!(
        proxy
            .metric("ctxproxy_tool_expansions_total", &[("outcome", "error")])
            .await,
        2.0
    );
}

#[tokio::test]
async fn a_json_re_ask_that_fails_midway_is_an_error_status() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, &format!("{QUICK}{STUBS}")).await;
    let expected = [
        ("reset-after=1", 502, "upstream_stream_interrupted"),
        // Half a JSON body, then its end: not JSON.
        ("early-end-after=1", 502, "upstream_invalid_response"),
        ("stall-after=1", 504, "upstream_timeout"),
    ];
    for (fault, status, code) in expected {
        let headers = [
            CALL,
            ("X-Mock-Stream-Fault", fault),
            ("X-Mock-Fault-On", "reask"),
        ];
        let started = Instant::now();
        let response = post(&proxy, &with_tools(false), &headers).await;
        assert_eq!(json_error(response).await, (status, code.to_owned()));
        assert!(started.elapsed() < CUT_WITHIN, "{fault}");
    }
}

#[tokio::test]
async fn a_json_first_answer_is_relayed_as_it_came_or_fails_as_its_body_did() {
    let mock = start_mock(MockOptions::default()).await;
    let proxy = proxy_for(&mock, &format!("{QUICK}{STUBS}")).await;
    // Not JSON, and nothing to read in it: the upstream's own answer, byte for byte.
    let response = post(&proxy, &plain(false), &[("X-Mock-Invalid-Json", "1")]).await;
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    assert!(serde_json::from_str::<Value>(&body).is_err(), "{body}");
    // Reset midway: relayed as it came, so the client's read fails (never a whole 200).
    let response = post(
        &proxy,
        &plain(false),
        &[("X-Mock-Stream-Fault", "reset-after=1")],
    )
    .await;
    assert_eq!(response.status(), 200);
    assert!(response.bytes().await.is_err());
    // With stubs the answer is read whole first: the failure is an error status.
    let headers = [CALL, ("X-Mock-Stream-Fault", "reset-after=1")];
    let response = post(&proxy, &with_tools(false), &headers).await;
    assert_eq!(
        json_error(response).await,
        (502, "upstream_stream_interrupted".to_owned())
    );
}

#[tokio::test]
async fn a_continuation_that_fails_mid_stream_ends_with_an_error_event() {
    let mock = start_mock(MockOptions::default()).await;
    let continued = "[continuation]\nenabled = true\n";
    let proxy = proxy_for(&mock, &format!("{QUICK}{continued}")).await;
    let roomy = proxy_for(&mock, &format!("{ROOMY}{continued}")).await;
    let story = "The keeper climbed the stairs, lit the lamp and watched the ships pass.";
    let request = json!({"model": "gpt-4o", "max_tokens": 4, "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Tell me a short story."}]});
    let (whole, _) = streamed(&roomy, &request, &[("X-Mock-Reply", story)]).await;
    assert!(whole.trim_end().ends_with("data: [DONE]"), "{whole}");
    // The first part, cut at 4 tokens, then its continuation, which fails.
    let reply = ("X-Mock-Reply", story);
    each_stream_fault_ends_with_its_error_event((&proxy, &mock), &request, reply, "reask", 2).await;
}
