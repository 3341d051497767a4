//! The tools stage's tests: the block decided on the first turn, what later turns add, and
//! the report.

use serde_json::{Value, json};

use super::*;
use crate::pipeline::config::OnNoMatch;
use crate::pipeline::{Decided, Env, Memo, PipelineConfig, run};
use crate::tokens::{Encoding, TokenCounter};

fn tool(name: &str, description: &str) -> Value {
    json!({"type": "function", "function": {"name": name, "description": description,
        "parameters": {"type": "object", "properties": {}}}})
}

/// Settings under which a few short tools are classified: no block is too small to filter, no
/// definition too short to stub, and one keyword selects a category.
fn small_lists() -> PipelineConfig {
    let mut config = PipelineConfig::default();
    config.tools.min_tool_tokens = 0;
    config.tools.min_stub_tokens = 0;
    config.tools.min_score = 1.0;
    config
}

fn offered() -> Vec<Value> {
    vec![
        tool("calendar_create_event", "Create a meeting in the calendar."),
        tool("calendar_list_events", "List the meetings of a day."),
        tool("email_send", "Send an email message."),
        tool("email_search", "Search the inbox for messages."),
        tool("weather_forecast", "Weather forecast for a city."),
    ]
}

/// The tools sent for `messages`, with `sticky` categories and an optional config change.
fn sent_tools(
    messages: Value,
    extra: Value,
    sticky: &[&str],
    configure: impl FnOnce(&mut PipelineConfig),
) -> (Vec<String>, ChatRequest) {
    sent_from(offered(), messages, extra, sticky, configure)
}

fn sent_from(
    tools: Vec<Value>,
    messages: Value,
    extra: Value,
    sticky: &[&str],
    configure: impl FnOnce(&mut PipelineConfig),
) -> (Vec<String>, ChatRequest) {
    let mut body = json!({"model": "gpt-4o", "messages": messages, "tools": tools});
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    let request: ChatRequest = serde_json::from_value(body).unwrap();
    // These lists are small: the classifier is what these tests look at, and what it
    // leaves out is removed (stubs have tests of their own).
    let mut config = small_lists();
    config.tools.left_out = LeftOut::Remove;
    config.tools.on_no_match = OnNoMatch::DropAll;
    // The recall tool is the proxy's, not the classifier's (tests in `recall.rs`).
    config.compact.recall = false;
    configure(&mut config);
    let sticky: Vec<String> = sticky.iter().map(|s| (*s).to_owned()).collect();
    let rewrite = run(
        &request,
        &Env {
            config: &config,
            counter: &TokenCounter::new(Encoding::O200kBase),
            memo: &Memo::default(),
            budget: 1_000_000,
            sticky_categories: &sticky,
            reinforcement: None,
            remembered: None,
        },
    );
    let names = rewrite
        .request
        .tools
        .get()
        .into_iter()
        .flatten()
        .filter_map(|t| tool_name(t).map(str::to_owned))
        .collect();
    (names, rewrite.request)
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn english_and_spanish_with_accents_and_plurals() {
    let (sent, _) = sent_tools(
        user("Schedule a meeting for Monday"),
        json!({}),
        &[],
        |_| {},
    );
    assert_eq!(sent, ["calendar_create_event", "calendar_list_events"]);
    let (sent, _) = sent_tools(
        user("¿Qué tiempo hará? Mándame el forecast por EMAIL"),
        json!({}),
        &[],
        |_| {},
    );
    assert_eq!(sent, ["email_send", "email_search", "weather_forecast"]);
    let config = |c: &mut PipelineConfig| {
        c.tools.categories = vec![crate::pipeline::config::ToolCategory {
            name: "agenda".into(),
            keywords: vec!["reunión".into(), "calendario".into()],
            tools: vec!["calendar_*".into()],
        }];
    };
    let (sent, _) = sent_tools(
        user("Agendá dos REUNIONES el lunes"),
        json!({}),
        &[],
        config,
    );
    assert_eq!(sent, ["calendar_create_event", "calendar_list_events"]);
}

#[test]
fn follow_ups_use_sticky_categories_and_no_match_drops_tools() {
    for follow_up in ["both", "Ambos", "yes do it"] {
        let (sent, _) = sent_tools(user(follow_up), json!({}), &["email"], |_| {});
        assert_eq!(sent, ["email_send", "email_search"], "{follow_up}");
    }
    let (sent, request) = sent_tools(
        user("thanks!"),
        json!({"tool_choice": "auto", "parallel_tool_calls": true}),
        &[],
        |_| {},
    );
    assert!(sent.is_empty());
    assert!(request.tool_choice.is_absent() && !request.extra.contains_key("parallel_tool_calls"));
    let (sent, _) = sent_tools(user("thanks!"), json!({}), &[], |c| {
        c.tools.on_no_match = OnNoMatch::KeepAll;
    });
    assert_eq!(sent.len(), 5);
}

#[test]
fn sticky_categories_stay_beside_a_new_match() {
    let (sent, _) = sent_tools(
        user("and the weather in Paris?"),
        json!({}),
        &["email"],
        |_| {},
    );
    assert_eq!(sent, ["email_send", "email_search", "weather_forecast"]);
}

fn airline() -> Vec<Value> {
    vec![
        tool("update_reservation", "Update the flights of a reservation."),
        tool("cancel_reservation", "Cancel the whole reservation."),
        tool(
            "get_reservation_details",
            "Get the details of a reservation.",
        ),
        tool(
            "transfer_to_human_agents",
            "Transfer the user to a human agent.",
        ),
    ]
}

#[test]
fn name_words_bring_their_synonyms_and_shared_words_select_nothing_alone() {
    let cases: [(&str, &[&str]); 5] = [
        ("I want to change my reservation", &["update_reservation"]),
        ("Quiero cancelar la reserva", &["cancel_reservation"]),
        (
            "Is there a supervisor I can speak to?",
            &["transfer_to_human_agents"],
        ),
        // "reservation" names three tools: it says which API, not which tool.
        ("about my reservation", &[]),
        (
            "Can you show me the reservation details?",
            &["get_reservation_details"],
        ),
    ];
    for (text, expected) in cases {
        let (sent, _) = sent_from(airline(), user(text), json!({}), &[], |_| {});
        assert_eq!(sent, expected, "{text}");
    }
}

#[test]
fn drop_all_sends_only_the_protected_tools_even_with_stubs_on() {
    let mut tools = offered();
    tools.push(tool("calculate", "Evaluate an arithmetic expression."));
    let (sent, request) = sent_from(tools, user("hello there"), json!({}), &[], |c| {
        c.tools.left_out = LeftOut::Stub;
    });
    assert_eq!(sent, ["calculate"]);
    assert_eq!(request.tools.get().map(Vec::len), Some(1));
}

#[test]
fn the_classifier_reads_what_the_client_sent_not_the_window() {
    let original: Vec<Message> = serde_json::from_value(json!([
        {"role": "user", "content": "what's on my calendar?"},
        {"role": "assistant", "content": "Standup at 10. Shall I email this to Ana?"},
        {"role": "user", "content": "yes"}
    ]))
    .unwrap();
    // The budget's smallest window keeps only the current turn.
    let windowed: ChatRequest = serde_json::from_value(json!({"model": "gpt-4o",
        "messages": [{"role": "user", "content": "yes"}], "tools": offered()}))
    .unwrap();
    let mut config = small_lists();
    config.tools.left_out = LeftOut::Remove;
    let counter = TokenCounter::new(Encoding::O200kBase);
    let (params, memo) = (
        crate::pipeline::Params::from_config(&config),
        Memo::default(),
    );
    let decided = Decided::default();
    let cx = StageCx::test((&config, &params), &counter, &memo, &original, &decided);
    let kept = ToolsStage.apply(&windowed, &cx).tools.unwrap();
    let names: Vec<&str> = kept.iter().filter_map(tool_name).collect();
    // The calendar from the first turn; email from the answered question (with
    // left_out = "remove", a later turn's words grow the block).
    assert_eq!(
        names,
        [
            "calendar_create_event",
            "calendar_list_events",
            "email_send",
            "email_search"
        ]
    );
}

#[test]
fn a_conversations_tool_block_only_grows() {
    let config = small_lists();
    let counter = TokenCounter::new(Encoding::O200kBase);
    let memo = Memo::default();
    let turns = [
        "what's on my calendar today?",
        "thanks, that's all for the calendar",
        "ok",
        "now send an email to Ana",
        "thanks",
    ];
    let mut messages = Vec::new();
    let mut previous: Vec<String> = Vec::new();
    for (i, text) in turns.iter().enumerate() {
        messages.push(json!({"role": "user", "content": text}));
        let request: ChatRequest = serde_json::from_value(
            json!({"model": "gpt-4o", "messages": messages, "tools": offered()}),
        )
        .unwrap();
        let params = crate::pipeline::Params::from_config(&config);
        let decided = Decided::default();
        let original = &request.messages;
        let cx = StageCx::test((&config, &params), &counter, &memo, original, &decided);
        let output = ToolsStage.apply(&request, &cx);
        let sent: Vec<String> = output
            .tools
            .unwrap_or_else(|| request.tools.get().cloned().unwrap_or_default())
            .iter()
            .filter_map(tool_name)
            .map(str::to_owned)
            .collect();
        assert!(
            previous.iter().all(|t| sent.contains(t)),
            "turn {i}: {previous:?} → {sent:?}"
        );
        previous = sent;
        messages.push(json!({"role": "assistant", "content": "Done."}));
    }
    assert!(previous.iter().any(|t| t.starts_with("calendar_")));
    assert!(previous.iter().any(|t| t.starts_with("email_")));
}

#[test]
fn a_later_tool_loop_defines_what_it_called_and_predicts_only_without_stubs() {
    let messages = json!([
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "what's on my calendar today?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "calendar_list_events", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "standup at 10"}
    ]);
    // Stubs: the block stays the first turn's, and only the tool called is defined, before
    // the call; the loop's other calendar tool is not defined ahead of a call.
    let (sent, request) = sent_tools(messages.clone(), json!({}), &[], |c| {
        c.tools.left_out = LeftOut::Stub;
        c.tools.on_no_match = OnNoMatch::Stub;
    });
    assert_eq!(sent.len(), 5);
    assert_eq!(
        inline::defined_in(&request.messages),
        BTreeSet::from(["calendar_list_events".to_owned()])
    );
    let at = request
        .messages
        .iter()
        .position(|m| !m.tool_calls().is_empty())
        .unwrap();
    assert_eq!(inline::defined_in(&request.messages[..at]).len(), 1);
    // Removed: no re-ask can recover a miss, so the block grows with the loop's categories.
    let (sent, request) = sent_tools(messages, json!({}), &[], |_| {});
    assert_eq!(sent, ["calendar_create_event", "calendar_list_events"]);
    assert!(inline::defined_in(&request.messages).is_empty());
}

#[test]
fn a_block_under_min_tool_tokens_is_sent_whole() {
    let messages = user("Send an email to Ana");
    let counter = TokenCounter::new(Encoding::O200kBase);
    let offered_tokens =
        counter.tools(&serde_json::from_value::<Vec<Tool>>(Value::Array(offered())).unwrap());
    let (sent, request) = sent_from(offered(), messages.clone(), json!({}), &[], |c| {
        c.tools.min_tool_tokens = offered_tokens + 1;
    });
    assert_eq!(sent.len(), offered().len());
    assert_eq!(request.tools.get().map(Vec::len), Some(offered().len()));
    // At the threshold, the block is filtered.
    let (sent, _) = sent_from(offered(), messages, json!({}), &[], |c| {
        c.tools.min_tool_tokens = offered_tokens;
    });
    assert_eq!(sent, ["email_send", "email_search"]);
}

#[test]
fn chosen_called_always_and_tool_loop_tools_are_kept() {
    let (sent, _) = sent_tools(
        user("thanks!"),
        json!({"tool_choice": {"type": "function", "function": {"name": "email_send"}}}),
        &[],
        |c| c.tools.always = vec!["weather_*".into()],
    );
    assert_eq!(sent, ["email_send", "weather_forecast"]);
    // A demanded tool call keeps every tool: the client chose among them.
    let (sent, request) = sent_tools(
        user("thanks!"),
        json!({"tool_choice": "required"}),
        &[],
        |_| {},
    );
    assert_eq!(sent.len(), 5);
    assert_eq!(request.tool_choice.get(), Some(&json!("required")));
    // Mid tool-loop: the last message is a result; the loop's categories stay.
    let messages = json!([
        {"role": "user", "content": "what's on my calendar, then email it to Ana"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "calendar_list_events", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "standup at 10"}
    ]);
    let (sent, _) = sent_tools(messages, json!({}), &[], |_| {});
    assert_eq!(
        sent,
        [
            "calendar_create_event",
            "calendar_list_events",
            "email_send",
            "email_search"
        ]
    );
}

#[test]
fn a_budget_rerun_reads_the_decision_and_places_it_in_its_own_window() {
    let messages: Vec<Value> = vec![
        json!({"role": "user", "content": "hello"}),
        json!({"role": "assistant", "content": "Hi! How can I help?"}),
        json!({"role": "user", "content": "what's on my calendar today?"}),
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
            "type": "function", "function": {"name": "calendar_list_events", "arguments": "{}"}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "standup at 10"}),
    ];
    let request = |messages: &[Value]| -> ChatRequest {
        serde_json::from_value(json!({"model": "gpt-4o", "messages": messages, "tools": offered()}))
            .unwrap()
    };
    let original = request(&messages);
    // A tighter budget step's window: the last turn only.
    let windowed = request(&messages[2..]);
    let mut config = small_lists();
    config.tools.left_out = LeftOut::Stub;
    config.tools.on_no_match = OnNoMatch::Stub;
    let counter = TokenCounter::new(Encoding::O200kBase);
    let memo = Memo::default();
    let params = crate::pipeline::Params::from_config(&config);
    let apply = |input: &ChatRequest, decided: &Decided| {
        let messages = &original.messages;
        let cx = StageCx::test((&config, &params), &counter, &memo, messages, decided);
        let output = ToolsStage.apply(input, &cx);
        (output.messages, output.tools, output.details)
    };
    let shared = Decided::default();
    let first = apply(&original, &shared);
    let rerun = apply(&windowed, &shared);
    assert!(shared.tools.get().is_some());
    assert_eq!(first, apply(&original, &Decided::default()));
    assert_eq!(rerun, apply(&windowed, &Decided::default()));
    // The definition goes before the call in each run's own messages.
    let placed = |m: &Option<Vec<Message>>| inline::defined_in(m.as_deref().unwrap_or(&[]));
    assert_eq!(placed(&first.0), placed(&rerun.0));
    assert_eq!(placed(&rerun.0).len(), 1);
    assert_ne!(first.0, rerun.0);
}

#[test]
fn a_tool_named_by_tool_choice_is_defined_once_when_the_next_request_appends() {
    let mut config = small_lists();
    config.tools.definitions = crate::pipeline::config::Definitions::InResult;
    config.compact.recall = false;
    let counter = TokenCounter::new(Encoding::O200kBase);
    let memo = Memo::default();
    let env = Env {
        config: &config,
        counter: &counter,
        memo: &memo,
        budget: 1_000_000,
        sticky_categories: &[],
        reinforcement: None,
        remembered: None,
    };
    let choice = json!({"type": "function", "function": {"name": "email_send"}});
    let first = json!([{"role": "user", "content": "Is it raining in Paris today?"}]);
    let body = |messages: &Value| {
        let body = json!({"model": "gpt-4o", "messages": messages, "tools": offered(),
            "tool_choice": choice});
        serde_json::from_value::<ChatRequest>(body).unwrap()
    };
    let sent = run(&body(&first), &env).request;
    // Defined last, as a call of the stub and its result.
    assert_eq!(
        inline::defined_in(&sent.messages),
        BTreeSet::from(["email_send".to_owned()])
    );
    let mut next = first.as_array().unwrap().clone();
    next.extend([
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
            "type": "function", "function": {"name": "email_send", "arguments": "{}"}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "sent"}),
        json!({"role": "user", "content": "Thanks"}),
    ]);
    let rewrite = run(&body(&Value::Array(next)), &env);
    assert!(rewrite.report.prefix.as_ref().unwrap().rebuilt.is_none());
    assert!(rewrite.request.messages.starts_with(&sent.messages));
    // The call that the tool choice placed is the one the answer's call needed: one pair.
    let calls: Vec<&str> = (rewrite.request.messages.iter())
        .filter(|m| inline::is_definition_call(m))
        .flat_map(|m| m.tool_calls().iter().map(|c| c.id.as_str()))
        .collect();
    assert_eq!(calls.len(), 1, "{:?}", rewrite.request.messages);
}

#[test]
fn a_tool_in_full_goes_without_the_titles_that_restate_a_name_and_is_no_stub() {
    let titled = |name: &str, description: &str| {
        json!({"type": "function", "function": {"name": name, "description": description,
            "parameters": {"title": "parameters", "type": "object", "properties": {
                "day": {"title": "Day", "type": "string", "description": "ISO date."}},
                "required": ["day"]}}})
    };
    let tools = vec![
        titled("calendar_list_events", "List the meetings of a day."),
        titled("email_send", "Send an email message."),
    ];
    let messages = json!([
        {"role": "user", "content": "what's on my calendar today?"},
        {"role": "assistant", "content": "Let me look."},
        {"role": "user", "content": "and mail Ann the list"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "email_send", "arguments": "{\"day\":\"2026-11-27\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sent"}
    ]);
    let (_, request) = sent_from(tools.clone(), messages, json!({}), &[], |c| {
        c.tools.left_out = LeftOut::Stub;
        c.tools.on_no_match = OnNoMatch::Stub;
    });
    let concise = json!({"type": "object", "properties": {
        "day": {"type": "string", "description": "ISO date."}}, "required": ["day"]});
    let parameters =
        |tool: &Tool| serde_json::to_value(tool).unwrap()["function"]["parameters"].take();
    let sent = request.tools.get().unwrap();
    let full = sent
        .iter()
        .find(|t| tool_name(t) == Some("calendar_list_events"))
        .unwrap();
    assert_eq!(parameters(full), concise);
    // The later tool's definition, in the messages, is as concise.
    let definitions = inline::definitions_in(&request.messages);
    assert_eq!(definitions.len(), 1);
    assert_eq!(definitions[0]["parameters"], concise);
    // What the guards read as stubs: the stub only, not the full tool in its concise form.
    let client: Vec<Tool> = serde_json::from_value(Value::Array(tools)).unwrap();
    assert_eq!(stubs::stubbed(sent, &client), ["email_send"]);
    let promoted = stubs::promote(sent, &client, None);
    assert!(promoted.iter().all(|t| parameters(t) == concise));
}

#[test]
fn a_block_of_tools_all_in_full_goes_concise_too() {
    let titled = |name: &str, description: &str| {
        json!({"type": "function", "function": {"name": name, "description": description,
            "parameters": {"title": "parameters", "type": "object", "properties": {}}}})
    };
    let tools = vec![
        titled("calendar_list_events", "List the meetings of a day."),
        titled("email_send", "Send an email message."),
    ];
    let (sent, request) = sent_from(
        tools,
        user("check my calendar, then send an email"),
        json!({}),
        &[],
        |c| c.tools.left_out = LeftOut::Stub,
    );
    assert_eq!(sent, ["calendar_list_events", "email_send"]);
    let block = serde_json::to_value(request.tools.get().unwrap()).unwrap();
    assert!(
        block
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["function"]["parameters"] == json!({"type": "object", "properties": {}})),
        "{block}"
    );
}
