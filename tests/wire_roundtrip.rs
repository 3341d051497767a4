//! Property: any chat request, with unknown fields and explicit nulls at every level, survives
//! parse → serialize unchanged (compared as JSON values).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ctxproxy::openai::{ChatCompletion, ChatCompletionChunk, ChatRequest};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        "[a-zA-Z0-9 éñ\\n\"\\\\]{0,12}".prop_map(Value::from),
    ]
}

fn any_json() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Unknown fields (names that never collide with typed ones).
fn extras() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::btree_map("x_[a-z]{1,6}", any_json(), 0..3)
        .prop_map(|m| m.into_iter().collect())
}

fn maybe(value: impl Strategy<Value = Value>) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![Just(None), Just(Some(Value::Null)), value.prop_map(Some)]
}

fn content() -> impl Strategy<Value = Value> {
    let part = (
        "[a-z_]{1,10}",
        maybe("[a-z ]{0,10}".prop_map(Value::from)),
        extras(),
    )
        .prop_map(|(kind, text, mut extra)| {
            extra.insert("type".into(), json!(kind));
            if let Some(text) = text {
                extra.insert("text".into(), text);
            }
            Value::Object(extra)
        });
    prop_oneof![
        "[a-zA-Z ,.]{0,30}".prop_map(Value::from),
        prop::collection::vec(part, 0..3).prop_map(Value::from),
    ]
}

fn tool_call() -> impl Strategy<Value = Value> {
    (
        "[a-z0-9_]{1,10}",
        "[a-z_]{1,10}",
        "[{}a-z:\" ]{0,20}",
        extras(),
        extras(),
    )
        .prop_map(|(id, name, args, mut fx, mut x)| {
            fx.insert("name".into(), json!(name));
            fx.insert("arguments".into(), json!(args));
            x.insert("id".into(), json!(id));
            x.insert("type".into(), json!("function"));
            x.insert("function".into(), Value::Object(fx));
            Value::Object(x)
        })
}

fn message() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            Just("system"),
            Just("developer"),
            Just("user"),
            Just("assistant"),
            Just("tool"),
            Just("critic")
        ],
        maybe(content()),
        maybe("[a-z]{1,6}".prop_map(Value::from)),
        maybe(prop::collection::vec(tool_call(), 0..3).prop_map(Value::from)),
        maybe("[a-z0-9_]{1,8}".prop_map(Value::from)),
        extras(),
    )
        .prop_map(|(role, content, name, tool_calls, tool_call_id, mut m)| {
            m.insert("role".into(), json!(role));
            for (key, value) in [
                ("content", content),
                ("name", name),
                ("tool_calls", tool_calls),
                ("tool_call_id", tool_call_id),
            ] {
                if let Some(value) = value {
                    m.insert(key.into(), value);
                }
            }
            Value::Object(m)
        })
}

fn tool() -> impl Strategy<Value = Value> {
    (
        "[a-z_]{1,10}",
        maybe("[a-z ]{0,20}".prop_map(Value::from)),
        maybe(any_json()),
        extras(),
    )
        .prop_map(|(name, description, parameters, mut f)| {
            f.insert("name".into(), json!(name));
            if let Some(d) = description {
                f.insert("description".into(), d);
            }
            if let Some(p) = parameters {
                f.insert("parameters".into(), p);
            }
            json!({"type": "function", "function": Value::Object(f)})
        })
}

fn request() -> impl Strategy<Value = Value> {
    (
        prop::collection::vec(message(), 1..6),
        maybe(any::<bool>().prop_map(Value::from)),
        maybe(prop::collection::vec(tool(), 0..3).prop_map(Value::from)),
        maybe(any_json()),
        maybe(any_json()),
        extras(),
    )
        .prop_map(
            |(messages, stream, tools, tool_choice, response_format, mut r)| {
                r.insert("model".into(), json!("gpt-4o"));
                r.insert("messages".into(), Value::from(messages));
                for (key, value) in [
                    ("stream", stream),
                    ("tools", tools),
                    ("tool_choice", tool_choice),
                    ("response_format", response_format),
                ] {
                    if let Some(value) = value {
                        r.insert(key.into(), value);
                    }
                }
                Value::Object(r)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn chat_requests_round_trip(input in request()) {
        let bytes = serde_json::to_vec(&input).unwrap();
        let parsed = ChatRequest::parse(&bytes).unwrap();
        let output = serde_json::to_value(&parsed).unwrap();
        prop_assert_eq!(output, input);
    }
}

#[test]
fn responses_and_chunks_round_trip() {
    let completion = json!({
        "id": "c1", "object": "chat.completion", "created": 1, "model": "m", "service_tier": null,
        "choices": [{"index": 0, "logprobs": null, "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": null, "refusal": null, "annotations": [],
                "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 0}}
    });
    let parsed: ChatCompletion = serde_json::from_value(completion.clone()).unwrap();
    assert_eq!(serde_json::to_value(parsed).unwrap(), completion);

    let chunk = json!({
        "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "obfuscation": "x",
        "choices": [{"index": 0, "finish_reason": null,
            "delta": {"role": "assistant", "content": null,
                "tool_calls": [{"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": ""}}]}}],
        "usage": null
    });
    let parsed: ChatCompletionChunk = serde_json::from_value(chunk.clone()).unwrap();
    assert_eq!(serde_json::to_value(parsed).unwrap(), chunk);
}
