//! Tests of `from_chat` and `to_chat`: Responses bodies read as chat and written back.

use serde_json::{Value, json};

use crate::openai::{Content, Message, Nullable, Role};
use crate::responses::{ResponsesBody, from_chat, reasoning_in_place, to_chat, write};

fn body(value: Value) -> ResponsesBody {
    match value {
        Value::Object(map) => map,
        _ => unreachable!("fixtures are objects"),
    }
}

fn reasoning(id: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "encrypted_content": format!("gAAAA{id}")})
}

/// A stateless agent's history: instructions, a reasoning item before each tool-calling turn, a
/// hosted call, an unknown item, a function tool and a hosted tool.
fn agent() -> Value {
    json!({
        "model": "gpt-5",
        "instructions": "You are a support agent.",
        "store": false,
        "input": [
            {"role": "user", "content": "Where is order 4711?"},
            reasoning("rs_1"),
            {"type": "function_call", "call_id": "call_1", "name": "get_order", "arguments": "{\"id\":\"4711\"}", "id": "fc_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "{\"status\":\"shipped\",\"carrier\":\"DHL\"}", "id": "fco_1"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "DHL"}},
            {"type": "message", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "It shipped with DHL.", "annotations": []}]},
            {"type": "future_item", "x": 1},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks, and order 4712?"}]}
        ],
        "tools": [
            {"type": "function", "name": "get_order", "description": "Look up an order", "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}, "strict": true},
            {"type": "web_search"}
        ],
        "tool_choice": "auto",
        "include": ["reasoning.encrypted_content"],
        "text": {"verbosity": "low"}
    })
}

#[test]
fn an_unchanged_rewrite_writes_back_the_client_body_byte_for_byte() {
    for original in [
        agent(),
        json!({"model": "m", "input": "hello", "temperature": 0}),
    ] {
        let (chat, converted) = to_chat(body(original.clone())).expect("converts");
        let back = from_chat(&converted, &chat);
        assert_eq!(
            serde_json::to_string(&back).ok(),
            serde_json::to_string(&original).ok()
        );
        assert_eq!(
            write(&converted, &chat).ok(),
            serde_json::to_vec(&original).ok()
        );
    }
}

#[test]
fn items_read_as_chat_messages() {
    let (chat, converted) = to_chat(body(agent())).expect("converts");
    let roles: Vec<&str> = chat.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "assistant", "user"]
    );
    let call = &chat.messages[2].tool_calls()[0];
    assert_eq!(
        (call.id.as_str(), call.function.name.as_str()),
        ("call_1", "get_order")
    );
    assert_eq!(chat.tool_names(), ["get_order"]);
    assert_eq!(chat.last_user_text(), "Thanks, and order 4712?");
    assert!(chat.extra.contains_key("store"));
    assert!(!chat.extra.contains_key("input"));
    assert!(converted.pairs_in_order());
}

#[test]
fn a_left_out_turn_takes_its_reasoning_and_carried_items_with_it() {
    let (chat, converted) = to_chat(body(agent())).expect("converts");
    let mut rewritten = chat.clone();
    // A summary in place of the first exchange: the user's question, the call and its result.
    let summary = Message::text(Role::System, "Summary: order 4711 shipped (DHL).");
    rewritten.messages.splice(1..4, [summary]);
    let back = from_chat(&converted, &rewritten);
    assert_eq!(
        write(&converted, &rewritten).ok(),
        serde_json::to_vec(&back).ok()
    );
    let input = back["input"].as_array().expect("items");
    let types: Vec<&str> = input
        .iter()
        .map(|i| i.get("type").and_then(Value::as_str).unwrap_or("easy"))
        .collect();
    assert_eq!(
        types,
        [
            "easy",
            "web_search_call",
            "message",
            "future_item",
            "message"
        ]
    );
    assert_eq!(
        input[0],
        json!({"role": "system", "content": "Summary: order 4711 shipped (DHL)."})
    );
    assert!(
        !serde_json::to_string(&back)
            .unwrap_or_default()
            .contains("rs_1")
    );
}

#[test]
fn a_kept_call_keeps_its_reasoning_right_before_it() {
    let (chat, converted) = to_chat(body(agent())).expect("converts");
    let mut rewritten = chat.clone();
    rewritten.messages.remove(1);
    let back = from_chat(&converted, &rewritten);
    let input = back["input"].as_array().expect("items");
    assert_eq!(input[0], reasoning("rs_1"));
    assert_eq!(input[1]["id"], "fc_1");
    assert!(reasoning_in_place(&body(agent()), &back));
}

#[test]
fn reasoning_moved_or_altered_is_told() {
    let client = body(agent());
    let mut moved = client.clone();
    if let Some(Value::Array(items)) = moved.get_mut("input") {
        items.swap(1, 0);
    }
    assert!(!reasoning_in_place(&client, &moved));
    let mut altered = client.clone();
    altered["input"][1]["encrypted_content"] = json!("gAAAAother");
    assert!(!reasoning_in_place(&client, &altered));
    assert!(reasoning_in_place(&client, &client));
}

#[test]
fn a_compacted_result_keeps_its_item_with_the_new_output() {
    let (chat, converted) = to_chat(body(agent())).expect("converts");
    let mut rewritten = chat.clone();
    rewritten.messages[3].content =
        Nullable::Value(Content::Text("{\"status\":\"shipped\"}".into()));
    let back = from_chat(&converted, &rewritten);
    let output = back["input"]
        .as_array()
        .and_then(|items| items.iter().find(|i| i["type"] == "function_call_output"))
        .cloned();
    assert_eq!(
        output,
        Some(
            json!({"type": "function_call_output", "call_id": "call_1", "output": "{\"status\":\"shipped\"}", "id": "fco_1"})
        )
    );
}

#[test]
fn changed_instructions_and_tools_are_written_in_the_responses_shape() {
    let (chat, converted) = to_chat(body(agent())).expect("converts");
    let mut rewritten = chat.clone();
    rewritten.messages[0] = Message::text(Role::System, "You are a support agent.\n\nBe brief.");
    if let Nullable::Value(tools) = &mut rewritten.tools
        && let Some(function) = tools[0].function.as_mut()
    {
        function.description = Nullable::Value("Look up an order (stub)".into());
    }
    rewritten.tool_choice =
        Nullable::Value(json!({"type": "function", "function": {"name": "get_order"}}));
    let back = from_chat(&converted, &rewritten);
    assert_eq!(
        back["instructions"],
        "You are a support agent.\n\nBe brief."
    );
    assert_eq!(back["tools"][0]["description"], "Look up an order (stub)");
    assert_eq!(back["tools"][0]["strict"], true);
    assert_eq!(back["tools"][1], json!({"type": "web_search"}));
    assert_eq!(
        back["tool_choice"],
        json!({"type": "function", "name": "get_order"})
    );
}

#[test]
fn a_rewrite_without_tools_sends_no_tools_nor_tool_choice() {
    let mut client = agent();
    client["parallel_tool_calls"] = json!(false);
    let (chat, converted) = to_chat(body(client)).expect("converts");
    let mut rewritten = chat.clone();
    rewritten.tools = Nullable::Absent;
    rewritten.tool_choice = Nullable::Absent;
    rewritten.extra.remove("parallel_tool_calls");
    let back = from_chat(&converted, &rewritten);
    assert!(!back.contains_key("tools") && !back.contains_key("tool_choice"));
    assert!(!back.contains_key("parallel_tool_calls"));
    assert_eq!(back["include"], json!(["reasoning.encrypted_content"]));
}

#[test]
fn a_compaction_item_stands_for_what_came_before_it_but_system_messages() {
    let original = json!({"model": "m", "input": [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "old question"},
        {"role": "assistant", "content": "old answer"},
        {"type": "compaction", "id": "cmp_1", "encrypted_content": "xyz"},
        {"role": "user", "content": "new question"}
    ]});
    let (chat, converted) = to_chat(body(original)).expect("converts");
    assert_eq!(converted.compacted_items, 2);
    let back = from_chat(&converted, &chat);
    let input = back["input"].as_array().expect("items");
    assert_eq!(input.len(), 3);
    assert_eq!(input[1]["type"], "compaction");
}

#[test]
fn an_orphan_output_is_refused_unless_the_history_is_upstream() {
    let orphan = json!({"model": "m", "input": [
        {"type": "function_call_output", "call_id": "call_9", "output": "42"}
    ]});
    let error = to_chat(body(orphan.clone())).err().map(|e| e.to_string());
    assert!(error.is_some_and(|e| e.contains("call_9")), "a clear error");
    let mut chained = orphan;
    chained["previous_response_id"] = json!("resp_1");
    let (_, converted) = to_chat(body(chained)).expect("a chained request's call is upstream");
    assert!(!converted.pairs_in_order());
}

#[test]
fn malformed_items_are_named() {
    let cases = [
        (json!([1]), "input[0]"),
        (
            json!([{"type": "function_call", "name": "f"}]),
            "input[0].call_id",
        ),
        (json!([{"role": "user"}]), "input[0].content"),
        (json!([{"role": "user", "content": 5}]), "input[0].content"),
    ];
    for (input, field) in cases {
        let error = to_chat(body(json!({"model": "m", "input": input})))
            .err()
            .map(|e| e.to_string());
        assert!(
            error.as_deref().is_some_and(|e| e.contains(field)),
            "{error:?} names {field}"
        );
    }
}

// Found by review: carried items of folded system messages, equal messages, pairs of calls
// other than chat's, and outputs of referenced calls.

/// The items of `back`'s input whose `type` is `kind`, by `call_id`.
fn call_ids(back: &ResponsesBody, kind: &str) -> Vec<String> {
    back["input"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["type"] == kind)
        .filter_map(|i| i["call_id"].as_str().map(str::to_owned))
        .collect()
}

/// The system stage folds a developer message into `instructions` (here: drops it as a
/// duplicate of `instructions`, which makes the prompt smaller, so the rewrite is sent); the
/// items that message carried (here the `compaction` item that stands for the whole earlier
/// conversation) must not vanish with it.
#[test]
fn a_folded_developer_message_keeps_the_items_it_carries() {
    use crate::pipeline::{Env, Memo, PipelineConfig, run};
    use crate::tokens::{Encoding, TokenCounter};
    let original = json!({"model": "gpt-5", "instructions": "You are a support agent.", "store": false,
    "input": [
        {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAAAhistory"},
        {"role": "developer", "content": "You are a support agent."},
        {"role": "user", "content": "And order 4712?"}
    ]});
    let (chat, converted) = to_chat(body(original)).expect("converts");
    let config = PipelineConfig::default();
    let counter = TokenCounter::new(Encoding::O200kBase);
    let memo = Memo::default();
    let rewrite = run(
        &chat,
        &Env {
            config: &config,
            counter: &counter,
            memo: &memo,
            budget: 100_000,
            sticky_categories: &[],
            reinforcement: None,
            remembered: None,
        },
    );
    assert!(
        rewrite.changed(),
        "the system stage folds the developer message"
    );
    let back = from_chat(&converted, &rewrite.request);
    let sent = serde_json::to_string(&back).unwrap_or_default();
    assert!(
        sent.contains("cmp_1"),
        "the compaction item was dropped with the folded developer message: {sent}"
    );
}

/// Two equal user messages ("yes"): the first is summarized, the second kept. The kept one must
/// go with its own carried items, not the earlier one's.
#[test]
fn an_equal_earlier_message_does_not_take_the_place_of_the_kept_one() {
    let original = json!({"model": "m", "store": false, "input": [
        {"role": "user", "content": "Delete the old branch?"},
        {"type": "mcp_call", "id": "mcp_1", "server_label": "git", "name": "list", "arguments": "{}", "output": "old"},
        {"role": "user", "content": "yes"},
        {"type": "message", "role": "assistant", "id": "msg_1", "content": [{"type": "output_text", "text": "Deleted."}]},
        {"type": "web_search_call", "id": "ws_2", "status": "completed", "action": {"type": "search", "query": "x"}},
        {"role": "user", "content": "yes"},
        {"type": "message", "role": "assistant", "id": "msg_2", "content": [{"type": "output_text", "text": "Done too."}]},
        {"role": "user", "content": "Thanks"}
    ]});
    let (chat, converted) = to_chat(body(original)).expect("converts");
    let mut rewritten = chat.clone();
    // The first exchange (through "Deleted.") summarized.
    let summary = Message::text(Role::System, "Summary: the old branch was deleted.");
    rewritten.messages.splice(0..3, [summary]);
    let back = from_chat(&converted, &rewritten);
    let sent = serde_json::to_string(&back).unwrap_or_default();
    assert!(
        sent.contains("ws_2"),
        "the kept \"yes\" lost the item it carried: {sent}"
    );
    assert!(
        !sent.contains("mcp_1"),
        "a summarized turn's item came back: {sent}"
    );
}

/// A parallel function call and custom tool call: the custom call rides with the function
/// call's output, its output with the next step. Summarizing the first step (call and result,
/// a valid chat cut) must not leave the custom call's output without its call.
#[test]
fn a_summarized_step_takes_a_parallel_custom_call_and_its_output_together() {
    let original = json!({"model": "m", "store": false, "input": [
        {"role": "user", "content": "Fix the bug."},
        reasoning("rs_1"),
        {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": "{}", "id": "fc_1"},
        {"type": "custom_tool_call", "call_id": "ct_1", "name": "apply_patch", "input": "*** Begin Patch", "id": "ctc_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": "fn main() {}"},
        {"type": "custom_tool_call_output", "call_id": "ct_1", "output": "patched"},
        reasoning("rs_2"),
        {"type": "function_call", "call_id": "call_2", "name": "run_tests", "arguments": "{}", "id": "fc_2"},
        {"type": "function_call_output", "call_id": "call_2", "output": "ok"}
    ]});
    let (chat, converted) = to_chat(body(original)).expect("converts");
    let roles: Vec<&str> = chat.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant", "tool"]);
    let mut rewritten = chat.clone();
    // The older step (assistant call_1 and its result) summarized; the latest step kept.
    let summary = Message::text(Role::User, "Summary: read the file.");
    rewritten.messages.splice(1..3, [summary]);
    let back = from_chat(&converted, &rewritten);
    let calls = call_ids(&back, "custom_tool_call");
    let outputs = call_ids(&back, "custom_tool_call_output");
    assert!(
        outputs.iter().all(|id| calls.contains(id)),
        "custom_tool_call_output {outputs:?} sent without its call (calls: {calls:?})"
    );
}

/// A compaction item between a custom tool call and its output: the call must be kept, as it is
/// for a function call.
#[test]
fn a_compaction_does_not_part_a_custom_call_from_its_output() {
    let original = json!({"model": "m", "store": false, "input": [
        {"role": "user", "content": "Patch it."},
        {"type": "custom_tool_call", "call_id": "ct_1", "name": "apply_patch", "input": "*** Begin Patch", "id": "ctc_1"},
        {"type": "compaction", "id": "cmp_1", "encrypted_content": "xyz"},
        {"type": "custom_tool_call_output", "call_id": "ct_1", "output": "patched"},
        {"role": "user", "content": "Next?"}
    ]});
    let (chat, converted) = to_chat(body(original)).expect("converts");
    let back = from_chat(&converted, &chat);
    let calls = call_ids(&back, "custom_tool_call");
    let outputs = call_ids(&back, "custom_tool_call_output");
    assert!(
        outputs.iter().all(|id| calls.contains(id)),
        "custom_tool_call_output {outputs:?} sent without its call (calls: {calls:?})"
    );
}

/// A function call the client sends as an `item_reference` (to an item the upstream stored):
/// its output is not an orphan, and OpenAI accepts it. ctxproxy must not answer 400.
#[test]
fn an_output_of_a_referenced_call_is_not_refused() {
    let original = json!({"model": "m", "input": [
        {"role": "user", "content": "Where is order 4711?"},
        {"type": "item_reference", "id": "fc_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": "shipped"}
    ]});
    let result = to_chat(body(original))
        .map(|_| ())
        .map_err(|e| e.to_string());
    assert_eq!(result, Ok(()));
}

#[test]
fn a_body_without_input_gets_none_added() {
    let (chat, converted) =
        to_chat(body(json!({"model": "m", "instructions": "Be brief."}))).expect("converts");
    let mut rewritten = chat.clone();
    rewritten.messages[0] = Message::text(Role::System, "Be brief. Really.");
    let back = from_chat(&converted, &rewritten);
    assert!(!back.contains_key("input"), "{back:?}");
    assert_eq!(back["instructions"], "Be brief. Really.");
}

#[test]
fn a_kept_tool_goes_as_the_client_wrote_it_and_a_changed_one_does_not() {
    let mut client = agent();
    client["tools"] = json!([
        {"strict": false, "parameters": {"type": "object"}, "name": "a", "type": "function", "description": null},
        {"type": "function", "name": "b", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}},
        {"type": "file_search", "vector_store_ids": ["vs_1"]}
    ]);
    let (chat, converted) = to_chat(body(client.clone())).expect("converts");
    let mut rewritten = chat.clone();
    rewritten.messages[0] = Message::text(Role::System, "changed");
    let back = from_chat(&converted, &rewritten);
    let tools_json = |body: &Value| serde_json::to_string(&body["tools"]).unwrap();
    assert_eq!(tools_json(&Value::Object(back)), tools_json(&client));
    let written: Value = serde_json::from_slice(&write(&converted, &rewritten).unwrap()).unwrap();
    assert_eq!(tools_json(&written), tools_json(&client));
    assert_eq!(
        tools_json(&Value::Object(converted.client_body())),
        tools_json(&client)
    );
    if let Nullable::Value(tools) = &mut rewritten.tools
        && let Some(function) = tools[1].function.as_mut()
    {
        function.parameters = Nullable::Value(std::sync::Arc::new(crate::openai::Schema::new(
            json!({"type": "object", "properties": {}}),
        )));
    }
    let back = from_chat(&converted, &rewritten);
    assert_eq!(back["tools"][0], client["tools"][0]);
    assert_eq!(
        back["tools"][1],
        json!({"type": "function", "name": "b", "parameters": {"type": "object", "properties": {}}})
    );
}

#[test]
fn a_chained_body_is_rewritable_only_when_its_items_stay_where_they_are() {
    let chained = |input: Value| {
        body(json!({"model": "m", "previous_response_id": "resp_1", "input": input}))
    };
    let pretty = "{\n  \"id\": 1\n}";
    let (_, in_order) = to_chat(chained(json!([
        {"type": "function_call_output", "call_id": "c1", "output": pretty},
        {"type": "function_call_output", "call_id": "c2", "output": "done"}
    ])))
    .expect("converts");
    assert!(in_order.rewritable());
    // A call answered later would be moved next to its answer: sent as written.
    let (_, held) = to_chat(chained(json!([
        {"type": "custom_tool_call", "call_id": "x1", "name": "shell", "input": "ls"},
        {"type": "function_call_output", "call_id": "c1", "output": pretty},
        {"type": "custom_tool_call_output", "call_id": "x1", "output": "a.txt"}
    ])))
    .expect("converts");
    assert!(!held.rewritable());
    // A compaction item would leave earlier items out: sent as written.
    let (_, compacted) = to_chat(chained(json!([
        {"role": "user", "content": "hi"},
        {"type": "compaction", "id": "cmp_1", "encrypted_content": "x"},
        {"type": "function_call_output", "call_id": "c1", "output": pretty}
    ])))
    .expect("converts");
    assert!(!compacted.rewritable());
}

#[test]
fn a_compacted_output_is_the_latest_with_its_call_id() {
    let client = json!({"model": "m", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "c1", "output": "[1, 2]"},
        {"type": "function_call_output", "call_id": "c1", "output": "[3, 4]"}
    ]});
    let (chat, converted) = to_chat(body(client.clone())).expect("converts");
    let mut rewritten = chat.clone();
    rewritten.messages[1].content = Nullable::Value(Content::Text("[3,4]".into()));
    let back = from_chat(&converted, &rewritten);
    assert_eq!(
        back["input"],
        json!([
            {"type": "function_call_output", "call_id": "c1", "output": "[1, 2]"},
            {"type": "function_call_output", "call_id": "c1", "output": "[3,4]"}
        ])
    );
}
