//! Parse → serialize of a chat request: the fixed cost every chat completion pays in ctxproxy;
//! and of the same request as a Responses API body (read as chat, written back).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

// The allocator the binary runs with (src/main.rs), so that the times are the binary's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use ctxproxy::openai::ChatRequest;
use ctxproxy::responses;
use serde_json::{Value, json};

/// A 20-turn agent conversation with tool calls and tool results, about 30 KB.
fn twenty_turn_request() -> Vec<u8> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a support agent for an airline. Follow the policy. ".repeat(40)}),
    ];
    for turn in 0..20 {
        messages.push(json!({"role": "user", "content": format!("Turn {turn}: please check reservation ABC{turn:03} and tell me the status of flight HAT{turn:03}, and whether I can change it.")}));
        if turn % 3 != 2 {
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("call_{turn}"), "type": "function", "function": {"name": "get_reservation_details", "arguments": format!("{{\"reservation_id\":\"ABC{turn:03}\"}}")}}]}));
            messages.push(json!({"role": "tool", "tool_call_id": format!("call_{turn}"), "content": json!({"reservation_id": format!("ABC{turn:03}"), "user_id": "mia_li_3668", "origin": "JFK", "destination": "SEA", "flight_type": "round_trip", "cabin": "economy", "flights": [{"flight_number": format!("HAT{turn:03}"), "date": "2024-05-20", "price": 1234}, {"flight_number": "HAT045", "date": "2024-05-27", "price": 987}], "passengers": [{"first_name": "Mia", "last_name": "Li", "dob": "1990-04-05"}], "payment_history": [{"payment_id": "credit_card_4421486", "amount": 2221}], "created_at": "2024-05-01T10:00:00", "total_baggages": 1, "nonfree_baggages": 0, "insurance": "no", "policy_notes": "Changes are allowed for a fee in basic economy only within 24 hours of booking. ".repeat(5)}).to_string()}));
        }
        messages.push(json!({"role": "assistant", "content": format!("Reservation ABC{turn:03} is confirmed. Flight HAT{turn:03} departs on time. You can change it for a fee according to the policy, which depends on your cabin class and membership level.")}));
    }
    let tools: Vec<Value> = (0..14)
        .map(|i| json!({"type": "function", "function": {"name": format!("tool_{i}"), "description": "Get the details of something by its id, with all fields.", "parameters": {"type": "object", "properties": {"id": {"type": "string", "description": "The id."}}, "required": ["id"]}}}))
        .collect();
    serde_json::to_vec(
        &json!({"model": "gpt-4o", "messages": messages, "tools": tools, "temperature": 0}),
    )
    .unwrap()
}

/// The same request as a Responses API body: the system message as `instructions`, messages
/// and tool calls as items, flat function tools.
fn as_responses(chat: &[u8]) -> Vec<u8> {
    let chat: Value = serde_json::from_slice(chat).unwrap();
    let mut items = Vec::new();
    let mut instructions = Value::Null;
    for message in chat["messages"].as_array().unwrap() {
        match message["role"].as_str().unwrap() {
            "system" => instructions = message["content"].clone(),
            "tool" => items.push(json!({"type": "function_call_output",
                "call_id": message["tool_call_id"], "output": message["content"]})),
            "assistant" => {
                if let Some(text) = message["content"].as_str() {
                    items.push(json!({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}));
                }
                for call in message["tool_calls"].as_array().into_iter().flatten() {
                    items.push(json!({"type": "function_call", "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": call["function"]["arguments"]}));
                }
            }
            role => items.push(json!({"role": role, "content": message["content"]})),
        }
    }
    let tools: Vec<Value> = chat["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let f = &t["function"];
            json!({"type": "function", "name": f["name"], "description": f["description"], "parameters": f["parameters"]})
        })
        .collect();
    serde_json::to_vec(
        &json!({"model": "gpt-4o", "instructions": instructions, "input": items,
        "tools": tools, "temperature": 0, "store": false}),
    )
    .unwrap()
}

fn parse_serialize(c: &mut Criterion) {
    let body = twenty_turn_request();
    let mut group = c.benchmark_group("wire");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function(
        format!("parse_serialize_20_turns_{}KB", body.len() / 1024),
        |b| {
            b.iter(|| {
                let request = ChatRequest::parse(std::hint::black_box(&body)).unwrap();
                serde_json::to_vec(&request).unwrap()
            })
        },
    );
    group.bench_function("parse_only", |b| {
        b.iter(|| ChatRequest::parse(std::hint::black_box(&body)).unwrap())
    });
    let responses_body = as_responses(&body);
    group.bench_function("responses_parse_convert_write", |b| {
        b.iter(|| {
            let parsed = responses::parse(std::hint::black_box(&responses_body)).unwrap();
            let (chat, converted) = responses::to_chat(parsed).unwrap();
            responses::write(&converted, &chat).unwrap()
        })
    });
    group.bench_function("responses_to_chat_only", |b| {
        b.iter_batched(
            || responses::parse(&responses_body).unwrap(),
            |parsed| responses::to_chat(parsed).unwrap(),
            criterion::BatchSize::SmallInput,
        )
    });
    let (chat, converted) = responses::to_chat(responses::parse(&responses_body).unwrap()).unwrap();
    group.bench_function("responses_write_only", |b| {
        b.iter(|| responses::write(&converted, std::hint::black_box(&chat)).unwrap())
    });
    group.bench_function("responses_parse_only", |b| {
        b.iter(|| responses::parse(std::hint::black_box(&responses_body)).unwrap())
    });
    group.finish();
}

criterion_group!(benches, parse_serialize);
criterion_main!(benches);
