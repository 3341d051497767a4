//! The ledger's cap, as the budget reports it: a 15-turn agent conversation sent turn by turn
//! (each request extends the one before, as an agent sends it) under a budget its floor is
//! over. The ledger grows by appending and is rebuilt within `ledger_max_tokens` before it
//! would pass half as much again: whatever the floor says of the ledger is within that, and the
//! ledger lines really sent are too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ctxproxy::openai::ChatRequest;
use ctxproxy::pipeline::{self, Memo, PipelineConfig};
use ctxproxy::tokens::{Encoding, TokenCounter};
use serde_json::{Value, json};

/// A support agent's conversation: each turn a user asks about an order, the agent looks it up
/// (a result with many identifiers) and answers naming some of them.
fn agent_conversation(turns: usize) -> Vec<Value> {
    let policy = "You are a retail support agent. Verify the user's identity first, then look \
                  up orders with the tools, and never change an order without an explicit yes. "
        .repeat(12);
    let mut messages = vec![json!({"role": "system", "content": policy})];
    for turn in 0..turns {
        let order = format!("#W{:07}", 4_210_000 + turn * 37);
        messages.push(json!({"role": "user", "content":
            format!("Hi, this is user_{turn:02}@example.com: where is order {order}? My zip is 9{turn:04}.")}));
        let call_id = format!("call_{turn}");
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": call_id,
            "type": "function", "function": {"name": "get_order_details",
            "arguments": json!({"order_id": order}).to_string()}}]}),
        );
        let items: Vec<Value> = (0..6)
            .map(|i| {
                json!({"item_id": format!("{}", 6_117_189_000 + turn * 100 + i),
                    "product_id": format!("P{}-{}", 800 + turn, i), "price": 100.5 + (turn * 7 + i) as f64,
                    "tracking": format!("TRK{:09}", 31_000_000 + turn * 1000 + i)})
            })
            .collect();
        let result = json!({"order_id": order, "status": "pending", "user_id": format!("user_{turn:02}_4412"),
            "payment_method_id": format!("credit_card_{}", 885_000 + turn), "items": items});
        messages
            .push(json!({"role": "tool", "tool_call_id": call_id, "content": result.to_string()}));
        messages.push(json!({"role": "assistant", "content":
            format!("Order {order} is pending; item {} ships with tracking TRK{:09}.",
                6_117_189_000 + turn * 100, 31_000_000 + turn * 1000)}));
    }
    messages
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_order_details",
        "description": "Get the status and items of an order.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"]}}}])
}

/// The ledger lines of a summary section as sent ("- line" each), and the rest of the section.
fn ledger_lines(text: &str) -> Option<(&str, String)> {
    let start = text.find("<conversation_summary>")?;
    let end = text.find("</conversation_summary>")?;
    let section = &text[start..end];
    let heading = "word for word:\n";
    let at = section.find(heading)? + heading.len();
    let lines_at = section[at..]
        .find("Earlier turns, oldest first:")
        .map_or(section.len(), |i| at + i);
    let rest = format!("{}{}", &section[..at], &section[lines_at..]);
    Some((&section[at..lines_at], rest))
}

#[test]
fn the_floors_ledger_holds_ledger_max_tokens_turn_by_turn() {
    let config = PipelineConfig::default();
    assert_eq!(
        config.window.ledger_max_tokens, 600,
        "config.toml's default"
    );
    // Rebuilt within the cap before a block would take it over half as much again.
    let cap = config.window.ledger_max_tokens * 3 / 2;
    let counter = TokenCounter::new(Encoding::O200kBase);
    let memo = Memo::default();
    let messages = agent_conversation(15);
    let (mut over_floor, mut full_ledgers) = (0, 0);
    // Every request of the conversation: up to each user message, and up to each tool result.
    for end in (2..=messages.len()).filter(|&i| i % 4 == 2 || i % 4 == 0) {
        let request: ChatRequest = serde_json::from_value(json!({"model": "gpt-4o",
            "messages": messages[..end], "tools": tools()}))
        .unwrap();
        let rewrite = pipeline::run(
            &request,
            &pipeline::Env {
                config: &config,
                counter: &counter,
                memo: &memo,
                budget: 1_200,
                sticky_categories: &[],
                reinforcement: None,
                remembered: None,
            },
        );
        let system = rewrite.request.messages[0].content.get().unwrap().text();
        let ledger = ledger_lines(&system).map(|(lines, rest)| {
            let sent = counter.text(lines);
            assert!(sent <= cap, "request {end}: {sent} ledger tokens sent");
            if sent > config.window.ledger_max_tokens * 9 / 10 {
                full_ledgers += 1;
            }
            (sent, counter.text(&rest))
        });
        if let Some(over) = rewrite.report.over_budget {
            over_floor += 1;
            assert!(
                over.floor.ledger <= cap,
                "request {end}: floor {:?}",
                over.floor
            );
            // The rest of the summary section (headings, summary lines) is reported apart.
            if let Some((sent, rest)) = ledger {
                assert_eq!(over.floor.ledger, sent, "request {end}");
                assert!(
                    over.floor.summary >= rest,
                    "request {end}: {:?}",
                    over.floor
                );
            }
        }
    }
    assert!(over_floor > 5, "{over_floor} requests over the floor");
    assert!(full_ledgers > 2, "{full_ledgers} full ledgers");
}
