//! The expansion's tests: stub calls found in answers and streams, and the re-ask.

use serde_json::json;

use super::*;

fn chunk(id: &str, delta: Value, finish: Option<&str>) -> String {
    let chunk = json!({"id": id, "object": "chat.completion.chunk", "created": 1,
        "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    format!("data: {chunk}\n\n")
}

fn call(name: &str, arguments: &str) -> Value {
    json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
        "function": {"name": name, "arguments": arguments}}]})
}

fn usage(id: &str, prompt: u64, completion: u64) -> String {
    let chunk = json!({"id": id, "object": "chat.completion.chunk", "created": 1,
        "model": "m", "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}});
    format!("data: {chunk}\n\n")
}

const DONE: &str = "data: [DONE]\n\n";

fn text_of(events: &[Bytes]) -> String {
    events
        .iter()
        .map(|e| String::from_utf8_lossy(e).into_owned())
        .collect()
}

fn relayed(relay: Relay) -> Vec<Bytes> {
    match relay {
        Relay::Events(events) => events,
        Relay::TooLarge(error) => panic!("too large: {error:?}"),
    }
}

/// What the client gets of `first`, which calls the stub, then of its re-ask `second`.
fn first_then_re_asked(first: &str, second: &str) -> Vec<Bytes> {
    let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
    let mut out = relayed(stream.push(first.as_bytes()));
    assert_eq!(stream.end_part(), PartEnd::ReAsk(vec!["stubbed".into()]));
    stream.re_asked(Vec::new());
    out.extend(relayed(stream.push(second.as_bytes())));
    let PartEnd::Done(rest) = stream.end_part() else {
        panic!("the re-asked answer calls no stub");
    };
    out.extend(rest);
    out
}

#[test]
fn a_role_that_came_with_the_stub_call_comes_with_the_re_asked_one() {
    let first = [
        chunk(
            "a",
            json!({"role": "assistant", "content": null,
            "tool_calls": [{"index": 0, "id": "c1", "type": "function",
                "function": {"name": "stubbed", "arguments": "{}"}}]}),
            None,
        ),
        chunk("a", json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
    .concat();
    let second = [
        chunk(
            "b",
            json!({"role": "assistant", "content": null,
            "tool_calls": [{"index": 0, "id": "c2", "type": "function",
                "function": {"name": "stubbed", "arguments": "{\"id\":\"7\"}"}}]}),
            None,
        ),
        chunk("b", json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
    .concat();
    let out = text_of(&first_then_re_asked(&first, &second));
    let roles = out.matches("\"role\":\"assistant\"").count();
    assert_eq!(roles, 1, "{out}");
    assert!(out.contains("\"id\":\"c2\""), "the re-asked call: {out}");
}

#[test]
fn a_re_ask_that_says_more_than_the_client_has_adds_the_rest() {
    let first = [
        chunk("a", json!({"role": "assistant", "content": ""}), None),
        chunk("a", json!({"content": "Let me check."}), None),
        chunk("a", call("stubbed", "{}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
    .concat();
    let second = [
        chunk("b", json!({"role": "assistant", "content": ""}), None),
        chunk("b", json!({"content": "Let me check."}), None),
        chunk("b", json!({"content": " What is your order number?"}), None),
        chunk("b", json!({}), Some("stop")),
        DONE.to_owned(),
    ]
    .concat();
    let out = first_then_re_asked(&first, &second);
    let said: String = out
        .iter()
        .filter_map(|e| {
            let text = String::from_utf8_lossy(e);
            let payload = text.strip_prefix("data: ")?.trim().to_owned();
            let chunk: Value = serde_json::from_str(&payload).ok()?;
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(said, "Let me check. What is your order number?");
    assert!(text_of(&out).contains("\"finish_reason\":\"stop\""));
}

#[test]
fn a_part_ends_at_its_done_and_an_unterminated_last_event_is_not_relayed() {
    let first = [
        chunk("a", json!({"role": "assistant", "content": ""}), None),
        chunk("a", call("stubbed", "{}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
    .concat();
    let answer = [
        chunk("b", json!({"content": "Sunny."}), None),
        chunk("b", json!({}), Some("stop")),
        usage("b", 5, 3),
    ]
    .concat();
    let whole = |out: &str| {
        out.split_terminator("\n\n").all(|event| {
            let data = event.strip_prefix("data: ").unwrap_or("{}");
            data == "[DONE]" || serde_json::from_str::<Value>(data).is_ok()
        })
    };
    // `[DONE]` with a space after it, then what an upstream should not send after it.
    let late = chunk("b", json!({"content": "late"}), None);
    let second = format!("{answer}data: [DONE] \n\n{late}");
    let out = text_of(&first_then_re_asked(&first, &second));
    assert!(out.ends_with(DONE), "{out}");
    assert!(!out.contains("late") && whole(&out), "{out}");
    // Cut in the middle of its last event: that half is not relayed.
    let out = text_of(&first_then_re_asked(&first, &format!("{answer}data: [DO")));
    assert!(!out.contains("[DO") && whole(&out), "{out}");
    assert!(out.contains("\"Sunny.\""), "{out}");
}

#[test]
fn after_an_error_event_nothing_is_asked_again_nor_any_call_relayed() {
    let error = "data: {\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}\n\n";
    let part = [
        chunk("a", json!({"role": "assistant", "content": ""}), None),
        chunk("a", call("stubbed", "{}"), None),
        error.to_owned(),
    ]
    .concat();
    let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
    let out = relayed(stream.push(part.as_bytes()));
    assert!(text_of(&out).ends_with(error), "{}", text_of(&out));
    let PartEnd::Done(rest) = stream.end_part() else {
        panic!("asked again after an error");
    };
    assert!(text_of(&rest).is_empty(), "{}", text_of(&rest));
}

#[test]
fn a_json_answer_names_the_stubs_it_calls() {
    let answer = json!({"choices": [{"message": {"tool_calls": [
        {"function": {"name": "full_one", "arguments": "{}"}},
        {"function": {"name": "stubbed", "arguments": "{}"}},
        {"function": {"name": "stubbed", "arguments": "{}"}}]}}]});
    let stubs = ["stubbed".to_owned(), "other".to_owned()];
    assert_eq!(called_stubs(&answer, &stubs), ["stubbed"]);
    assert!(
        called_stubs(
            &json!({"choices": [{"message": {"content": "hi"}}]}),
            &stubs
        )
        .is_empty()
    );
}

#[test]
fn usage_is_summed_over_every_answer_asked() {
    let first = json!({"usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}});
    let last = json!({"id": "b", "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}});
    let merged = with_usage_of(last, &[first]);
    assert_eq!(merged["id"], "b");
    assert_eq!(
        merged["usage"],
        json!({"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26})
    );
}

#[test]
fn an_answer_without_a_stub_call_goes_out_byte_for_byte() {
    let text = [
        chunk("a", json!({"role": "assistant", "content": ""}), None),
        chunk("a", json!({"content": "Hi"}), None),
    ]
    .concat();
    let calls = [
        chunk("a", call("full_one", "{\"x\":1}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        usage("a", 5, 3),
        DONE.to_owned(),
    ]
    .concat();
    let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
    // Text and a call of a full tool go at once; usage and [DONE] at the part's end.
    let out = relayed(stream.push([text.as_str(), &calls].concat().as_bytes()));
    assert_eq!(
        text_of(&out),
        [text.as_str(), &calls]
            .concat()
            .replace(&usage("a", 5, 3), "")
            .replace(DONE, "")
    );
    let PartEnd::Done(rest) = stream.end_part() else {
        panic!("no stub was called");
    };
    assert_eq!(text_of(&rest), [usage("a", 5, 3), DONE.to_owned()].concat());
}

/// A call's delta of the upstream's index `index`, with its start when `name` is given.
fn call_delta(index: u64, name: Option<&str>, arguments: &str) -> Value {
    let mut call = json!({"index": index, "function": {"arguments": arguments}});
    if let Some(name) = name {
        call["id"] = json!(format!("call_{index}"));
        call["type"] = json!("function");
        call["function"]["name"] = json!(name);
    }
    json!({"tool_calls": [call]})
}

#[test]
fn a_full_tools_call_goes_out_as_soon_as_its_name_is_known() {
    let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
    let start = chunk("a", call_delta(0, Some("full_one"), ""), None);
    assert_eq!(text_of(&relayed(stream.push(start.as_bytes()))), start);
    let more = chunk("a", call_delta(0, None, "{\"x\":"), None);
    assert_eq!(text_of(&relayed(stream.push(more.as_bytes()))), more);
    let end = [
        chunk("a", call_delta(0, None, "1}"), None),
        chunk("a", json!({}), Some("tool_calls")),
    ]
    .concat();
    assert_eq!(text_of(&relayed(stream.push(end.as_bytes()))), end);
    assert_eq!(stream.end_part(), PartEnd::Done(Vec::new()));
}

#[test]
fn a_stub_called_beside_a_relayed_call_adds_only_the_re_asked_stub_call() {
    let first = [
        chunk("a", json!({"role": "assistant", "content": null}), None),
        chunk("a", call_delta(0, Some("full_one"), "{\"x\":1}"), None),
        chunk("a", call_delta(1, Some("stubbed"), ""), None),
        chunk("a", call_delta(1, None, "{}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        usage("a", 5, 3),
        DONE.to_owned(),
    ]
    .concat();
    let mut stream = ExpandStream::new(vec!["stubbed".into()], 1 << 20);
    let out = text_of(&relayed(stream.push(first.as_bytes())));
    // The full tool's call went out; nothing of the stub's.
    assert_eq!(
        out,
        [
            chunk("a", json!({"role": "assistant", "content": null}), None),
            chunk("a", call_delta(0, Some("full_one"), "{\"x\":1}"), None),
        ]
        .concat()
    );
    assert_eq!(stream.end_part(), PartEnd::ReAsk(vec!["stubbed".into()]));
    stream.re_asked(Vec::new());
    // The re-asked answer repeats the first call, with other arguments, and calls the tool
    // now defined.
    let second = [
        chunk("b", json!({"role": "assistant", "content": null}), None),
        chunk("b", call_delta(0, Some("full_one"), "{\"x\":2}"), None),
        chunk("b", call_delta(1, Some("stubbed"), "{\"id\":\"7\"}"), None),
        chunk("b", json!({}), Some("tool_calls")),
        usage("b", 9, 4),
        DONE.to_owned(),
    ]
    .concat();
    let mut out = relayed(stream.push(second.as_bytes()));
    let PartEnd::Done(rest) = stream.end_part() else {
        panic!("the re-asked answer calls no stub");
    };
    out.extend(rest);
    let expected = [
        // Under the first answer's id and at the next index; the repeat is dropped.
        chunk("a", call_delta(1, Some("stubbed"), "{\"id\":\"7\"}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        // One usage, summed over both answers.
        usage("a", 14, 7),
        DONE.to_owned(),
    ]
    .concat();
    assert_eq!(text_of(&out), expected);
}

#[test]
fn a_stub_called_after_text_is_replaced_by_the_re_asked_call_in_the_same_stream() {
    let first = [
        chunk("a", json!({"role": "assistant", "content": ""}), None),
        chunk("a", json!({"content": "Let me check."}), None),
        chunk("a", call("stubbed", "{}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        usage("a", 5, 3),
        DONE.to_owned(),
    ]
    .concat();
    let second = [
        chunk("b", json!({"role": "assistant", "content": ""}), None),
        chunk("b", json!({"content": "Let me check."}), None),
        chunk("b", call("stubbed", "{\"id\":\"7\"}"), None),
        chunk("b", json!({}), Some("tool_calls")),
        usage("b", 9, 4),
        DONE.to_owned(),
    ]
    .concat();
    let out = first_then_re_asked(&first, &second);
    let expected = [
        chunk("a", json!({"role": "assistant", "content": ""}), None),
        chunk("a", json!({"content": "Let me check."}), None),
        // The re-asked call, under the first answer's id, its text left out.
        chunk("a", call("stubbed", "{\"id\":\"7\"}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        // One usage, summed over both answers.
        usage("a", 14, 7),
        DONE.to_owned(),
    ]
    .concat();
    assert_eq!(text_of(&out), expected);
}

#[test]
fn usage_on_a_chunk_with_choices_is_summed_too() {
    let with_usage = |id: &str, prompt: u64, completion: u64| {
        let chunk = json!({"id": id, "object": "chat.completion.chunk", "created": 1,
            "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}});
        format!("data: {chunk}\n\n")
    };
    let first = [
        chunk("a", call("stubbed", "{}"), None),
        with_usage("a", 5, 3),
        DONE.to_owned(),
    ]
    .concat();
    let second = [
        chunk("b", call("stubbed", "{\"id\":\"7\"}"), None),
        with_usage("b", 9, 4),
        DONE.to_owned(),
    ]
    .concat();
    let out = text_of(&first_then_re_asked(&first, &second));
    // One usage, summed, and it comes last.
    assert_eq!(out.matches("\"usage\"").count(), 1, "{out}");
    assert!(
        out.contains(r#""usage":{"prompt_tokens":14,"completion_tokens":7,"total_tokens":21}"#),
        "{out}"
    );
    assert!(out.contains("\"finish_reason\":\"tool_calls\""), "{out}");
}

#[test]
fn a_stub_called_first_lets_the_re_asked_answer_speak() {
    let first = [
        chunk("a", json!({"role": "assistant"}), None),
        chunk("a", call("stubbed", "{}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
    .concat();
    let second = [
        chunk("b", json!({"role": "assistant"}), None),
        chunk("b", json!({"content": "Which order?"}), None),
        chunk("b", json!({}), Some("stop")),
        DONE.to_owned(),
    ]
    .concat();
    let out = first_then_re_asked(&first, &second);
    let expected = [
        chunk("a", json!({"role": "assistant"}), None),
        chunk("a", json!({"content": "Which order?"}), None),
        chunk("a", json!({}), Some("stop")),
        DONE.to_owned(),
    ]
    .concat();
    assert_eq!(text_of(&out), expected);
}

/// A rewriter whose request defines `get_weather` only in its messages (checked against
/// its schema) and offers `full_one` in full.
fn checking() -> ExpandStream {
    let client: Vec<crate::openai::Tool> = serde_json::from_value(json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}},
        {"type": "function", "function": {"name": "full_one", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}},
            "required": ["x"]}}}
    ]))
    .unwrap();
    let mut stream = ExpandStream::new(Vec::new(), 1 << 20);
    stream
        .arguments()
        .watch(&client, &["get_weather".to_owned()]);
    stream
}

#[test]
fn a_call_of_a_tool_defined_in_the_messages_is_held_until_its_arguments_pass() {
    let mut stream = checking();
    let start = chunk("a", call_delta(0, Some("get_weather"), ""), None);
    assert!(relayed(stream.push(start.as_bytes())).is_empty());
    let rest = [
        chunk("a", call_delta(0, None, "{\"city\":"), None),
        chunk("a", call_delta(0, None, "\"Paris\"}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
    .concat();
    assert!(relayed(stream.push(rest.as_bytes())).is_empty());
    let PartEnd::Done(out) = stream.end_part() else {
        panic!("the arguments pass");
    };
    let streamed = text_of(&out);
    assert!(streamed.contains("get_weather"), "{streamed}");
    assert!(
        streamed.contains("Paris") && streamed.ends_with(DONE),
        "{streamed}"
    );
}

#[test]
fn a_call_that_fails_its_schema_is_asked_again_and_the_re_asked_call_spliced() {
    let mut stream = checking();
    let first = [
        chunk("a", json!({"role": "assistant", "content": null}), None),
        chunk("a", call_delta(0, Some("get_weather"), "{}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        usage("a", 5, 3),
        DONE.to_owned(),
    ]
    .concat();
    let out = text_of(&relayed(stream.push(first.as_bytes())));
    assert!(!out.contains("get_weather"), "{out}");
    assert_eq!(
        stream.end_part(),
        PartEnd::Invalid(Failed {
            tools: vec!["get_weather".into()],
            unread: true
        })
    );
    stream.re_asked(Vec::new());
    // Asked again with the tool in the block: nothing is checked any more.
    stream.arguments().watch(&[], &[]);
    let second = [
        chunk("b", json!({"role": "assistant", "content": null}), None),
        chunk(
            "b",
            call_delta(0, Some("get_weather"), "{\"city\":\"Paris\"}"),
            None,
        ),
        chunk("b", json!({}), Some("tool_calls")),
        usage("b", 9, 4),
        DONE.to_owned(),
    ]
    .concat();
    let mut out = relayed(stream.push(second.as_bytes()));
    let PartEnd::Done(rest) = stream.end_part() else {
        panic!("nothing left to check");
    };
    out.extend(rest);
    let out = text_of(&out);
    assert_eq!(out.matches("get_weather").count(), 1, "{out}");
    assert!(out.contains(r#"{\"city\":\"Paris\"}"#), "{out}");
    assert!(
        out.contains(r#""prompt_tokens":14"#),
        "usage of both: {out}"
    );
    // The role went out with the first part.
    assert!(!out.contains("\"role\""), "{out}");
}

#[test]
fn a_full_tools_call_is_relayed_at_once_and_never_checked() {
    let mut stream = checking();
    // Its arguments fail its schema: the model's answer, the client's business.
    let part = [
        chunk("a", call_delta(0, Some("full_one"), "{}"), None),
        chunk("a", json!({}), Some("tool_calls")),
    ]
    .concat();
    assert_eq!(text_of(&relayed(stream.push(part.as_bytes()))), part);
    assert_eq!(stream.end_part(), PartEnd::Done(Vec::new()));
}

#[test]
fn a_call_held_behind_a_failing_one_is_not_taken_for_a_repeat() {
    let mut stream = checking();
    let first = [
        chunk("a", call_delta(0, Some("full_one"), "{\"x\":1}"), None),
        chunk("a", call_delta(1, Some("get_weather"), "{}"), None),
        chunk("a", call_delta(2, Some("full_one"), "{\"x\":2}"), None),
        chunk("a", json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
    .concat();
    let out = text_of(&relayed(stream.push(first.as_bytes())));
    // Only the call before the checked one went out.
    assert!(
        out.contains("{\\\"x\\\":1}") && !out.contains("{\\\"x\\\":2}"),
        "{out}"
    );
    assert!(matches!(stream.end_part(), PartEnd::Invalid(_)));
    stream.re_asked(Vec::new());
    stream.arguments().watch(&[], &[]);
    let second = [
        chunk("b", call_delta(0, Some("full_one"), "{\"x\":1}"), None),
        chunk(
            "b",
            call_delta(1, Some("get_weather"), "{\"city\":\"Paris\"}"),
            None,
        ),
        chunk("b", call_delta(2, Some("full_one"), "{\"x\":2}"), None),
        chunk("b", json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
    .concat();
    let mut out = relayed(stream.push(second.as_bytes()));
    let PartEnd::Done(rest) = stream.end_part() else {
        panic!("nothing left to check");
    };
    out.extend(rest);
    let out = text_of(&out);
    // The repeat of the relayed call is dropped; the held one and the re-asked one come.
    assert!(!out.contains("{\\\"x\\\":1}"), "{out}");
    assert!(
        out.contains("{\\\"x\\\":2}") && out.contains("Paris"),
        "{out}"
    );
    assert!(
        out.contains(r#""index":1"#) && out.contains(r#""index":2"#),
        "{out}"
    );
}
