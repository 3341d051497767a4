//! Tests of the Responses stream expansion: events held, spliced and renumbered.

use serde_json::{Value, json};

use super::*;
use crate::openai::sse::event_data;

/// A Responses event stream being written, as the API numbers it.
struct Stream {
    id: &'static str,
    events: Vec<String>,
}

impl Stream {
    fn new(id: &'static str) -> Stream {
        let mut stream = Stream {
            id,
            events: Vec::new(),
        };
        let response = json!({"response": {"id": id, "status": "in_progress", "output": []}});
        stream.push("response.created", response.clone());
        stream.push("response.in_progress", response);
        stream
    }

    fn push(&mut self, kind: &str, fields: Value) {
        let mut event = json!({"type": kind, "sequence_number": self.events.len()});
        if let (Some(event), Value::Object(fields)) = (event.as_object_mut(), fields) {
            event.extend(fields);
        }
        self.events
            .push(format!("event: {kind}\ndata: {event}\n\n"));
    }

    fn call(&mut self, index: u64, name: &str, arguments: &str) -> &mut Stream {
        let id = format!("fc_{}_{index}", self.id);
        let added = json!({"id": id, "type": "function_call", "status": "in_progress",
            "arguments": "", "call_id": format!("call_{index}"), "name": name});
        self.push(ADDED, json!({"output_index": index, "item": added}));
        let at = json!({"item_id": id, "output_index": index, "delta": arguments});
        self.push("response.function_call_arguments.delta", at);
        let done = json!({"item_id": id, "output_index": index, "arguments": arguments});
        self.push("response.function_call_arguments.done", done);
        let item = json!({"id": id, "type": "function_call", "status": "completed",
            "arguments": arguments, "call_id": format!("call_{index}"), "name": name});
        self.push(DONE, json!({"output_index": index, "item": item}));
        self
    }

    fn message(&mut self, index: u64, text: &str) -> &mut Stream {
        let id = format!("msg_{}_{index}", self.id);
        let added = json!({"id": id, "type": "message", "status": "in_progress",
            "content": [], "role": "assistant"});
        self.push(ADDED, json!({"output_index": index, "item": added}));
        let delta =
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text});
        self.push("response.output_text.delta", delta);
        let item = json!({"id": id, "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]});
        self.push(DONE, json!({"output_index": index, "item": item}));
        self
    }

    fn reasoning(&mut self, index: u64) -> &mut Stream {
        let item =
            json!({"id": format!("rs_{}_{index}", self.id), "type": "reasoning", "summary": []});
        self.push(ADDED, json!({"output_index": index, "item": item}));
        self.push(DONE, json!({"output_index": index, "item": item}));
        self
    }

    fn completed(&mut self, output: Value, input: u64, output_tokens: u64) -> String {
        let usage = json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "total_tokens": input + output_tokens});
        let response =
            json!({"id": self.id, "status": "completed", "output": output, "usage": usage});
        self.push("response.completed", json!({"response": response}));
        self.events.concat()
    }
}

fn events(out: &[Bytes]) -> Vec<Value> {
    out.iter()
        .filter_map(|raw| event_data(raw))
        .map(|data| serde_json::from_str(&data).unwrap())
        .collect()
}

fn relayed(relay: Relay) -> Vec<Bytes> {
    match relay {
        Relay::Events(out) => out,
        Relay::TooLarge(error) => panic!("cut: {error:?}"),
    }
}

fn text(out: &[Bytes]) -> String {
    out.iter().map(|b| String::from_utf8_lossy(b)).collect()
}

fn watching(names: &[&str]) -> ResponsesExpandStream {
    ResponsesExpandStream::new(names.iter().map(|n| (*n).to_owned()).collect(), 1 << 20)
}

/// The first part, then the re-asked one: every event the client gets.
fn first_then_re_asked(first: &str, second: &str) -> Vec<Bytes> {
    let mut stream = watching(&["stubbed", "ctxproxy_recall"]);
    let mut out = relayed(stream.push(first.as_bytes()));
    assert!(matches!(stream.end_part(), PartEnd::ReAsk(_)));
    stream.re_asked(Vec::new());
    out.extend(relayed(stream.push(second.as_bytes())));
    let PartEnd::Done(rest) = stream.end_part() else {
        panic!("the re-asked answer calls nothing watched");
    };
    out.extend(rest);
    out
}

/// The client's events are numbered from 0 without a gap, and each item's events carry the
/// index of its `output_item.added`, counted in order.
fn assert_consistent(events: &[Value]) {
    let mut items = 0;
    for (k, event) in events.iter().enumerate() {
        assert_eq!(event["sequence_number"], k, "{event}");
        if event["type"] == ADDED {
            assert_eq!(event["output_index"], items, "{event}");
            items += 1;
        } else if let Some(index) = event["output_index"].as_u64() {
            assert!(index < items, "{event}");
        }
    }
}

#[test]
fn an_answer_without_a_watched_call_goes_out_byte_for_byte() {
    let mut upstream = Stream::new("a");
    upstream.message(0, "Hi").call(1, "full_one", "{\"x\":1}");
    let all = upstream.completed(json!([]), 5, 3);
    let mut stream = watching(&["stubbed"]);
    let out = relayed(stream.push(all.as_bytes()));
    // Everything but the terminal event, at once; the terminal event at the part's end.
    let terminal = upstream.events.last().unwrap().clone();
    assert_eq!(text(&out), all.replace(&terminal, ""));
    assert_eq!(
        stream.end_part(),
        PartEnd::Done(vec![Bytes::from(terminal)])
    );
}

#[test]
fn a_full_tools_call_streams_as_soon_as_its_name_is_known() {
    let mut upstream = Stream::new("a");
    upstream.call(0, "full_one", "{}");
    let mut stream = watching(&["stubbed"]);
    let head = upstream.events[..3].concat();
    let out = events(&relayed(stream.push(head.as_bytes())));
    assert_eq!(out.last().unwrap()["type"], ADDED);
    assert_eq!(out.last().unwrap()["item"]["name"], "full_one");
}

#[test]
fn a_stub_call_is_held_and_asked_again() {
    let mut upstream = Stream::new("a");
    upstream
        .message(0, "Let me check.")
        .reasoning(1)
        .call(2, "stubbed", "{}");
    let all = upstream.completed(json!([]), 5, 3);
    let mut stream = watching(&["stubbed"]);
    let out = text(&relayed(stream.push(all.as_bytes())));
    assert!(out.contains("Let me check."), "{out}");
    // Nothing of the call, nor of the reasoning that came with it, nor the terminal event.
    for hidden in ["stubbed", "rs_a_1", "response.completed"] {
        assert!(!out.contains(hidden), "{hidden}: {out}");
    }
    assert_eq!(stream.end_part(), PartEnd::ReAsk(vec!["stubbed".into()]));
}

#[test]
fn a_re_asked_answer_is_spliced_renumbered_and_ends_with_summed_usage() {
    let mut first = Stream::new("a");
    first
        .message(0, "Let me check.")
        .call(1, "full_one", "{\"x\":1}")
        .call(2, "stubbed", "{}");
    let first = first.completed(json!([]), 5, 3);
    let mut second = Stream::new("b");
    // The re-ask repeats the message and the full call, then calls the tool now defined.
    second
        .message(0, "Let me check.")
        .call(1, "full_one", "{\"x\":2}")
        .reasoning(2)
        .call(3, "stubbed", "{\"id\":\"7\"}");
    let second = second.completed(json!(["whatever"]), 9, 4);
    let out = events(&first_then_re_asked(&first, &second));
    assert_consistent(&out);
    let kinds: Vec<&str> = out.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "response.created").count(),
        1
    );
    assert_eq!(kinds.last(), Some(&"response.completed"));
    // The message and the first call once each; the reasoning and the re-asked call after them.
    let added: Vec<&Value> = out
        .iter()
        .filter(|e| e["type"] == ADDED)
        .map(|e| &e["item"])
        .collect();
    let ids: Vec<&str> = added.iter().map(|i| i["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["msg_a_0", "fc_a_1", "rs_b_2", "fc_b_3"]);
    let terminal = &out.last().unwrap()["response"];
    assert_eq!(terminal["id"], "a", "the stream is one Response");
    let output: Vec<&str> = terminal["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap())
        .collect();
    assert_eq!(output, ids);
    assert_eq!(terminal["output"][3]["arguments"], "{\"id\":\"7\"}");
    assert_eq!(
        terminal["usage"],
        json!({"input_tokens": 14, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 7, "total_tokens": 21})
    );
}

#[test]
fn a_recall_call_is_hidden_and_read_for_the_re_ask() {
    let mut first = Stream::new("a");
    first.call(0, "ctxproxy_recall", "{\"handle\":\"rc-1\"}");
    let first = first.completed(json!([]), 5, 3);
    let mut stream = watching(&["ctxproxy_recall"]);
    let mut out = relayed(stream.push(first.as_bytes()));
    assert!(!text(&out).contains("ctxproxy_recall"));
    assert_eq!(
        stream.end_part(),
        PartEnd::ReAsk(vec!["ctxproxy_recall".into()])
    );
    let calls = stream.held_calls_of("ctxproxy_recall");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].id, "call_0");
    assert_eq!(calls[0].function.arguments, "{\"handle\":\"rc-1\"}");
    stream.re_asked(Vec::new());
    let mut second = Stream::new("b");
    second.message(0, "Order 7 is shipped.");
    let second = second.completed(json!([]), 9, 4);
    out.extend(relayed(stream.push(second.as_bytes())));
    let PartEnd::Done(rest) = stream.end_part() else {
        panic!("nothing watched");
    };
    out.extend(rest);
    let all = events(&out);
    assert_consistent(&all);
    assert_eq!(all[0]["type"], "response.created");
    assert_eq!(all[0]["response"]["id"], "a");
    let terminal = &all.last().unwrap()["response"];
    assert_eq!(terminal["output"].as_array().unwrap().len(), 1);
    assert_eq!(terminal["usage"]["input_tokens"], 14);
}

#[test]
fn a_call_that_fails_its_schema_is_held_then_asked_again() {
    let client: Vec<crate::openai::Tool> = serde_json::from_value(json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    ]))
    .unwrap();
    let mut stream = watching(&[]);
    stream
        .arguments()
        .watch(&client, &["get_weather".to_owned()]);
    let mut first = Stream::new("a");
    first.call(0, "get_weather", "{}");
    let first = first.completed(json!([]), 5, 3);
    assert!(
        text(&relayed(stream.push(first.as_bytes())))
            .find("get_weather")
            .is_none()
    );
    assert!(matches!(stream.end_part(), PartEnd::Invalid(_)));

    let mut stream = watching(&[]);
    stream
        .arguments()
        .watch(&client, &["get_weather".to_owned()]);
    let mut good = Stream::new("a");
    good.call(0, "get_weather", "{\"city\":\"Paris\"}");
    let good = good.completed(json!([]), 5, 3);
    assert!(
        relayed(stream.push(good.as_bytes())).len() == 2,
        "created, in_progress"
    );
    let PartEnd::Done(rest) = stream.end_part() else {
        panic!("its arguments pass");
    };
    // Released as it came.
    assert_eq!(
        text(&rest),
        good.split_once("event: response.output_item.added")
            .map(|(_, r)| format!("event: response.output_item.added{r}"))
            .unwrap()
    );
}

#[test]
fn a_failed_answer_is_told_at_once_and_nothing_held_follows() {
    let mut upstream = Stream::new("a");
    upstream.call(0, "stubbed", "{}");
    upstream.push(
        "error",
        json!({"code": "server_error", "message": "boom", "param": null}),
    );
    let all = upstream.events.concat();
    let mut stream = watching(&["stubbed"]);
    let out = events(&relayed(stream.push(all.as_bytes())));
    assert_eq!(out.last().unwrap()["type"], "error");
    assert_eq!(out.last().unwrap()["sequence_number"], 2);
    assert_eq!(stream.end_part(), PartEnd::Done(Vec::new()));
}
