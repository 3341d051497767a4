//! The compaction and the working set: what the agent's latest steps keep.

use serde_json::json;

use super::*;
use crate::pipeline::{Params, PipelineConfig};
use crate::tokens::Encoding;

/// Compaction with each old result cleared as soon as it is old enough.
fn run(request: &ChatRequest) -> Option<Vec<Message>> {
    run_batched(request, 0)
}

fn run_batched(request: &ChatRequest, batch: usize) -> Option<Vec<Message>> {
    let mut config = PipelineConfig::default();
    config.compact.clear_at_least_tokens = batch;
    let params = Params::from_config(&config);
    let counter = TokenCounter::new(Encoding::O200kBase);
    let (memo, decided) = (crate::pipeline::Memo::default(), Default::default());
    let messages = &request.messages;
    let cx = StageCx::test((&config, &params), &counter, &memo, messages, &decided);
    CompactStage.apply(request, &cx).messages
}

fn result(city: &str) -> String {
    format!(
        // Compact JSON: what these tests look at is clearing, not the minifying.
        "{{\"city\":\"{city}\",\"code\":\"{}X1\",\"forecast\":\"{}\"}}",
        &city[..2],
        "sunny and mild all week long, with a light breeze in the afternoons ".repeat(3)
    )
}

#[test]
fn the_latest_steps_are_never_cleared() {
    let calls: Vec<Value> = ["a", "b", "c", "d"]
        .iter()
        .map(|id| json!({"id": id, "type": "function", "function": {"name": "weather", "arguments": "{}"}}))
        .collect();
    let request: ChatRequest = serde_json::from_value(json!({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Rome, Oslo, Lima and Kyiv?"},
        {"role": "assistant", "content": null, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": result("Rome")},
        {"role": "tool", "tool_call_id": "b", "content": result("Oslo")},
        {"role": "tool", "tool_call_id": "c", "content": result("Lima")},
        {"role": "tool", "tool_call_id": "d", "content": result("Kyiv")}
    ]}))
    .unwrap();
    assert!(run(&request).is_none());
}

fn long_loop() -> ChatRequest {
    let mut messages = vec![json!({"role": "user", "content": "Check every city"})];
    let cities = ["Rome", "Oslo", "Lima", "Kyiv", "Baku", "Doha", "Riga"];
    for (i, city) in cities.iter().enumerate() {
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{i}"),
            "type": "function", "function": {"name": "weather", "arguments": format!("{{\"city\": \"{city}\"}}")}}]}));
        messages.push(
            json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": result(city)}),
        );
    }
    serde_json::from_value(json!({"model": "m", "messages": messages})).unwrap()
}

#[test]
fn old_results_are_cleared_in_batches_of_clear_at_least_tokens() {
    let request = long_loop();
    let counter = TokenCounter::new(Encoding::O200kBase);
    let tokens = |i: usize| counter.text(&request.messages[i].content.get().unwrap().text());
    let cleared = |out: Option<Vec<Message>>| -> Vec<usize> {
        let out = out.unwrap_or_else(|| request.messages.clone());
        (0..out.len())
            .filter(|&i| out[i] != request.messages[i])
            .collect()
    };
    // The three old results (2, 4, 6) hold fewer tokens than a batch: none is cleared yet.
    let three = tokens(2) + tokens(4) + tokens(6);
    assert_eq!(
        cleared(run_batched(&request, three + 1)),
        Vec::<usize>::new()
    );
    // A batch the size of two of them: the oldest two go, the third waits.
    assert_eq!(
        cleared(run_batched(&request, tokens(2) + tokens(4))),
        vec![2, 4]
    );
    assert_eq!(cleared(run_batched(&request, 1)), vec![2, 4, 6]);
}

#[test]
fn older_steps_of_a_long_loop_become_stubs_with_their_identifiers() {
    let request = long_loop();
    let out = run(&request).expect("older results cleared");
    let text = |i: usize| out[i].content.get().unwrap().text().into_owned();
    // Results of the first three calls are stubs; the last four are the working set.
    assert_eq!(
        text(2),
        "[weather(city: Rome) result cleared; it held: city: Rome, code: RoX1]"
    );
    assert!(text(6).starts_with("[weather(city: Lima) result cleared"));
    for i in [8, 10, 12, 14] {
        assert_eq!(out[i], request.messages[i]);
    }
}

/// A database tool's answer as MCP servers wrap it: a text part holding a tool result
/// holding a Python literal of `n` rows.
fn wrapped_rows(n: usize) -> String {
    let rows: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "{{'department_name': 'Dept {i}', 'tenure_years': Decimal('{}.{}'), \
                 'since': datetime.date(19{:02}, 1, 2), 'note': '{}'}}",
                20 + i,
                i % 10,
                60 + i % 40,
                "steady growth with a stable team ".repeat(2)
            )
        })
        .collect();
    let literal = format!("[{}]", rows.join(", "));
    let result = json!({"meta": null, "content": [{"type": "text", "text": literal, "annotations": null}],
        "structuredContent": {"result": [{"type": "text", "text": literal}]}, "isError": false});
    json!({"type": "text", "text": result.to_string()}).to_string()
}

#[test]
fn a_wrapped_result_keeps_its_content_and_every_value_in_the_working_set() {
    let request: ChatRequest = serde_json::from_value(json!({"model": "m", "messages": [
        {"role": "user", "content": "Tenure by department?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "q", "type": "function",
            "function": {"name": "execute_sql", "arguments": "{\"query\": \"SELECT 1\"}"}}]},
        {"role": "tool", "tool_call_id": "q", "content": wrapped_rows(60)}
    ]}))
    .unwrap();
    let out = run(&request).expect("the large result is compacted");
    let text = out[2].content.get().unwrap().text().into_owned();
    // The rows, as a table, not the envelope with its one long string cut.
    assert!(
        text.starts_with("{\"columns\":[\"department_name\",\"tenure_years\",\"since\""),
        "{text}"
    );
    for i in 0..60 {
        assert!(
            text.contains(&format!("\"{}.{}\"", 20 + i, i % 10)),
            "{i}: {text}"
        );
        assert!(text.contains(&format!("\"Dept {i}\"")), "{i}");
    }
    assert!(text.contains("\"1960-01-02\""));
    assert!(text.len() < wrapped_rows(60).len() / 2);
}

#[test]
fn a_cleared_wrapped_result_names_its_values() {
    let counter = TokenCounter::new(Encoding::O200kBase);
    let call: ToolCall = serde_json::from_value(
        json!({"id": "q", "type": "function", "function": {"name": "execute_sql", "arguments": "{}"}}),
    )
    .unwrap();
    let text = stub(
        Some(&call),
        &wrapped_rows(3),
        200,
        &TaskWords::default(),
        &counter,
    );
    assert!(text.contains("tenure_years: 20.0"), "{text}");
    assert!(text.contains("Dept 2") && text.contains("22.2"), "{text}");
}
