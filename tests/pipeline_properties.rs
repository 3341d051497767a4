//! Properties of the pipeline over generated conversations with tool calls: the output is a
//! valid request, the last user message is byte-identical, the prompt never grows, the rewrite
//! is deterministic, and every identifier kept in a tool result was in that tool result.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;

use ctxproxy::openai::{ChatRequest, Role};
use ctxproxy::pipeline::recall;
use ctxproxy::pipeline::tools::inline;
use ctxproxy::pipeline::working_set::WorkingSet;
use ctxproxy::pipeline::{self, PipelineConfig};
use ctxproxy::tokens::{Encoding, TokenCounter};
use proptest::prelude::*;
use serde_json::{Value, json};

const WORDS: &[&str] = &[
    "flight",
    "hotel",
    "Lisbon",
    "booking",
    "refund",
    "AB123",
    "cancel",
    "remember",
    "that",
    "my",
    "name",
    "is",
    "Ana",
    "from",
    "now",
    "on",
    "answer",
    "in",
    "Spanish",
    "the",
    "deploy",
    "repo",
    "https://example.com/x/1",
    "/etc/app.conf",
    "#1043",
    "2024",
    "why",
    "?",
    "and",
    "cambiando de tema",
];

fn sentence() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(WORDS), 1..14).prop_map(|w| w.join(" "))
}

fn tool_result() -> impl Strategy<Value = String> {
    prop_oneof![
        sentence(),
        (1usize..120).prop_map(|n| {
            let items: Vec<Value> = (0..n)
                .map(|i| json!({"id": i, "name": format!("item-{i}"), "html_url": format!("https://example.com/i/{i}"),
                    "owner": {"login": "acme", "id": 3}, "blob": "lorem ipsum dolor sit amet ".repeat(8), "none": null}))
                .collect();
            Value::Array(items).to_string()
        }),
        (10usize..400).prop_map(|n| (0..n).map(|i| format!("log line {i} id=L{i:04} ok")).collect::<Vec<_>>().join("\n")),
    ]
}

#[derive(Debug, Clone)]
struct TurnSpec {
    user: String,
    tool_results: Vec<String>,
    answer: Option<String>,
    /// Which of `TOOLS` the turn calls.
    tool: usize,
}

/// The tools every generated request offers (the tools stage filters them).
const TOOLS: [(&str, &str); 4] = [
    ("lookup", "Look something up. Use it often."),
    ("weather_forecast", "Weather forecast for a city."),
    ("email_send", "Send an email message."),
    ("calendar_list_events", "List the meetings of a day."),
];

fn turn() -> impl Strategy<Value = TurnSpec> {
    (
        sentence(),
        prop::collection::vec(tool_result(), 0..3),
        prop::option::of(sentence()),
        0..TOOLS.len(),
    )
        .prop_map(|(user, tool_results, answer, tool)| TurnSpec {
            user,
            tool_results,
            answer,
            tool,
        })
}

fn conversation() -> impl Strategy<Value = ChatRequest> {
    (prop::collection::vec(turn(), 1..16), any::<bool>(), prop::option::of(0..TOOLS.len())).prop_map(|(turns, second_system, choice)| {
        let mut messages = vec![json!({"role": "system", "content": "You are helpful."})];
        let mut call = 0;
        let last = turns.len() - 1;
        for (t, spec) in turns.iter().enumerate() {
            messages.push(json!({"role": "user", "content": spec.user}));
            if t == 1 && second_system {
                messages.push(json!({"role": "developer", "content": "Answer briefly."}));
            }
            // A tool_choice naming a function is what the model answers every turn with: a call
            // to it, never text.
            let forced = vec!["ok".to_owned()];
            let results = match choice {
                Some(_) if spec.tool_results.is_empty() => &forced,
                _ => &spec.tool_results,
            };
            if !results.is_empty() {
                let ids: Vec<String> = results.iter().map(|_| { call += 1; format!("call_{call}") }).collect();
                let called = TOOLS[choice.unwrap_or(spec.tool)].0;
                let calls: Vec<Value> = ids.iter().map(|id| json!({"id": id, "type": "function",
                    "function": {"name": called, "arguments": "{\"q\":\"x\"}"}})).collect();
                messages.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
                for (id, result) in ids.iter().zip(results) {
                    messages.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
                }
            }
            // The last turn has no answer yet: it ends with the user or mid tool-loop.
            if let Some(answer) = spec.answer.as_ref().filter(|_| t != last && choice.is_none()) {
                messages.push(json!({"role": "assistant", "content": answer}));
            }
        }
        let tools: Vec<Value> = TOOLS.iter().map(|(name, description)| json!({"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "The query. Be specific."}}}}})).collect();
        let mut body = json!({"model": "gpt-4o", "messages": messages, "tools": tools});
        if let Some(choice) = choice {
            body["tool_choice"] = json!({"type": "function", "function": {"name": TOOLS[choice].0}});
        }
        serde_json::from_value(body).unwrap()
    })
}

/// Every tool message follows its assistant tool call (possibly after sibling results), and
/// every tool call has its result.
fn assert_valid(request: &ChatRequest) {
    let mut open: Vec<String> = Vec::new();
    for message in &request.messages {
        match message.role {
            Role::Tool => {
                let id = message.tool_call_id.get().unwrap();
                let position = open
                    .iter()
                    .position(|o| o == id.as_str())
                    .unwrap_or_else(|| panic!("orphan tool result {id}"));
                open.remove(position);
            }
            _ => {
                assert!(open.is_empty(), "tool calls without results: {open:?}");
                open = message.tool_calls().iter().map(|c| c.id.clone()).collect();
            }
        }
    }
    assert!(
        open.is_empty(),
        "tool calls without results at the end: {open:?}"
    );
}

/// The client's tool results (not the definitions placed as calls' results).
fn tool_texts(request: &ChatRequest) -> Vec<(String, String)> {
    request
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool && !inline::is_definition_result(m))
        .map(|m| {
            (
                m.tool_call_id.get().unwrap().to_string(),
                m.content.get().unwrap().text().into_owned(),
            )
        })
        .collect()
}

/// Identifier-like tokens of a text, without the proxy's own markers.
fn identifiers(text: &str) -> HashSet<String> {
    text.split(|c: char| c.is_whitespace() || "\"',:;[]{}()=".contains(c))
        .map(|t| t.trim_end_matches(['.', '…']))
        .filter(|t| t.chars().any(|c| c.is_ascii_digit()) && t.len() >= 3)
        .map(str::to_owned)
        .collect()
}

fn env<'a>(
    config: &'a PipelineConfig,
    counter: &'a TokenCounter,
    memo: &'a pipeline::Memo,
    budget: usize,
) -> pipeline::Env<'a> {
    pipeline::Env {
        config,
        counter,
        memo,
        budget,
        sticky_categories: &[],
        reinforcement: None,
        remembered: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn pipeline_invariants(request in conversation(), budget in prop::sample::select(vec![300usize, 1500, 4000, 1_000_000]), in_result in any::<bool>()) {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = pipeline::Memo::default();
        let mut config = PipelineConfig::default();
        if in_result {
            // Small tools filtered, later ones defined as calls' results.
            config.tools.min_tool_tokens = 0;
            config.tools.min_stub_tokens = 0;
            config.tools.definitions = pipeline::config::Definitions::InResult;
        }
        let env = env(&config, &counter, &memo, budget);
        let rewrite = pipeline::run(&request, &env);
        let output = &rewrite.request;

        assert_valid(output);
        // Filtering never leaves a reference to a removed tool.
        let sent: Vec<String> = output.tools.get().into_iter().flatten().filter_map(|t| t.function.as_ref().map(|f| f.name.clone())).collect();
        if let Some(choice) = output.tool_choice.get().and_then(|c| c.pointer("/function/name")).and_then(Value::as_str) {
            prop_assert!(sent.iter().any(|s| s == choice), "tool_choice names removed tool {}", choice);
        }
        for call in output.messages.iter().flat_map(|m| m.tool_calls()) {
            prop_assert!(sent.contains(&call.function.name), "history calls removed tool {}", call.function.name);
        }
        let last_user = |r: &ChatRequest| r.messages.iter().rev().find(|m| m.role == Role::User).cloned();
        prop_assert_eq!(serde_json::to_value(last_user(output)).unwrap(), serde_json::to_value(last_user(&request)).unwrap());
        // Never larger, unless tools too small to filter are filtered: a definition placed in
        // the messages can then outweigh the stubs, and the block stays as decided.
        if !in_result {
            prop_assert!(counter.request(output) <= counter.request(&request));
        }
        prop_assert_eq!(rewrite.report.tokens_after, counter.request(output));
        let again = pipeline::run(&request, &env);
        prop_assert_eq!(&again.request, output);

        // The working set is never cut: every identifier of it is still sent.
        let sent_text = serde_json::to_string(output).unwrap();
        let working_set = WorkingSet::of(&request.messages, config.window.recent_tool_steps);
        for (index, message) in request.messages.iter().enumerate() {
            if !working_set.contains(index) {
                continue;
            }
            let text = message.content.get().map(|c| c.text().into_owned()).unwrap_or_default();
            for id in identifiers(&text) {
                prop_assert!(sent_text.contains(&id), "working-set identifier {} lost (message {})", id, index);
            }
        }

        let originals: std::collections::HashMap<String, String> = tool_texts(&request).into_iter().collect();
        for (id, text) in tool_texts(output) {
            let original = identifiers(&originals[&id]);
            // A stub starts with the call it answers: its arguments are not the result's.
            let text = match text.split_once(" result cleared") {
                Some((_, held)) if text.starts_with('[') => held.to_owned(),
                _ => text,
            };
            // The handle a shortened result names is the proxy's, not the result's.
            let handles: Vec<String> = recall::handles_in(&text).map(str::to_owned).collect();
            let text = handles.iter().fold(text, |t, h| t.replace(h.as_str(), ""));
            for kept in identifiers(&text) {
                let marker = text.contains(&format!("of {kept})")) || text.contains(&format!("of {kept};")) || text.contains(&format!("showing {kept} ")) || text.contains(&format!("[… {kept} lines"));
                prop_assert!(marker || original.contains(&kept), "identifier {} not in the original result", kept);
            }
        }

        // A way back: every identifier of a cleared or shortened result is still sent, or the
        // result names a handle that the proxy can answer from the client's request.
        let offers_recall = output.tools.get().is_some_and(|t| recall::offered(t));
        let named = recall::named_handles(&output.messages);
        for (id, text) in tool_texts(output) {
            let original = &originals[&id];
            let shortened = text.contains(" result cleared") || text.contains("[shortened; recall ");
            if !shortened {
                continue;
            }
            let lost: Vec<String> = identifiers(original).into_iter().filter(|i| !sent_text.contains(i)).collect();
            if lost.is_empty() || request.tools.get().is_none_or(Vec::is_empty) {
                continue;
            }
            let handle = recall::handle_of(original);
            prop_assert!(offers_recall && text.contains(&handle), "{:?} lost and no handle in {}", lost, text);
            let answer = recall::original(&request.messages, &handle);
            prop_assert!(named.contains(&handle) && answer.as_ref() == Some(original), "handle {} not answerable", handle);
        }
    }
}

/// Every tool an assistant message of the rewrite calls is in full in the block, or defined
/// by a definitions message before that assistant message: the model always saw what it
/// called.
fn assert_called_tools_defined(rewrite: &ChatRequest, client: &ChatRequest) {
    let client_tools = client.tools.get().cloned().unwrap_or_default();
    let sent = rewrite.tools.get().cloned().unwrap_or_default();
    let stubs = pipeline::tools::stubs::stubbed(&sent, &client_tools);
    for (index, message) in rewrite.messages.iter().enumerate() {
        // A definition's own call (`in_result`) is answered by the definition.
        if inline::is_definition_call(message) {
            continue;
        }
        let defined = inline::defined_in(&rewrite.messages[..index]);
        for call in message.tool_calls() {
            let name = &call.function.name;
            assert!(
                !stubs.contains(name) || defined.contains(name),
                "{name} called at {index} with no definition before it: {:?}",
                rewrite.messages
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Whatever a stage removes leaves its identifiers behind: with caps large enough, every
    /// identifier of every original tool result is in the output (its result, a stub, or the
    /// ledger), whatever the budget.
    #[test]
    fn removed_results_leave_their_identifiers(request in conversation(), budget in prop::sample::select(vec![300usize, 1500, 4000])) {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = pipeline::Memo::default();
        let mut config = PipelineConfig::default();
        config.window.ledger_max_tokens = 1_000_000;
        config.compact.stub_max_tokens = 1_000_000;
        // Compaction that cuts lists and log middles is bounded by design; leave it out here.
        config.compact.tool_result_max_tokens = 1_000_000;
        let rewrite = pipeline::run(&request, &env(&config, &counter, &memo, budget));
        let sent_text = serde_json::to_string(&rewrite.request).unwrap();
        for (_, text) in tool_texts(&request) {
            for id in identifiers(&text) {
                if id.contains("://") || id.starts_with("//") {
                    continue;
                }
                prop_assert!(sent_text.contains(&id), "identifier {} of a tool result lost", id);
            }
        }
    }
}

/// The requests a client sent to reach `request`, in order: before each assistant message that
/// follows a user turn (and no other assistant message), and `request` itself.
fn earlier_requests(request: &ChatRequest) -> Vec<ChatRequest> {
    let messages = &request.messages;
    let mut lens = Vec::new();
    let mut seen_user = false;
    for (i, m) in messages.iter().enumerate() {
        if seen_user
            && i > 0
            && m.role == Role::Assistant
            && messages[i - 1].role != Role::Assistant
        {
            lens.push(i);
        }
        seen_user |= m.role == Role::User;
    }
    lens.push(messages.len());
    lens.into_iter()
        .map(|len| {
            let mut earlier = request.clone();
            earlier.messages.truncate(len);
            earlier
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Prefix stability: replayed request by request, each rewrite is the previous one, byte for
    /// byte (same tools, its messages first), followed by the new messages, except where the
    /// report says it was rebuilt; every one is valid; and the last comes out the same without
    /// the memo (from the history alone).
    #[test]
    fn each_rewrite_extends_the_previous_one_except_at_recompactions(request in conversation(), budget in prop::sample::select(vec![300usize, 1500, 4000, 1_000_000]), filter in any::<bool>(), in_result in any::<bool>()) {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = pipeline::Memo::default();
        let mut config = PipelineConfig::default();
        if filter {
            // Small tools filtered as a large block would be: stubs, and definitions placed in
            // the messages as the conversation calls them (system messages, or calls' results).
            config.tools.min_tool_tokens = 0;
            config.tools.min_stub_tokens = 0;
            if in_result {
                config.tools.definitions = pipeline::config::Definitions::InResult;
            }
        }
        let env = env(&config, &counter, &memo, budget);
        let mut previous: Option<ChatRequest> = None;
        for earlier in earlier_requests(&request) {
            let rewrite = pipeline::run(&earlier, &env);
            assert_valid(&rewrite.request);
            assert_called_tools_defined(&rewrite.request, &earlier);
            let prefix = rewrite.report.prefix.clone().expect("a prefix report");
            if let (None, Some(before)) = (prefix.rebuilt, &previous) {
                prop_assert_eq!(&rewrite.request.tools, &before.tools);
                prop_assert!(rewrite.request.messages.starts_with(&before.messages), "not appended");
                prop_assert_eq!(prefix.appended_messages, earlier.messages.len() - prefix.anchor_messages);
            }
            prop_assert!(previous.is_some() || prefix.rebuilt == Some(pipeline::Rebuilt::First));
            previous = Some(rewrite.request);
        }
        let cold_memo = pipeline::Memo::default();
        let cold = pipeline::run(&request, &pipeline::Env { memo: &cold_memo, ..env });
        prop_assert_eq!(Some(cold.request), previous);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// The replay's floor shortcut (`prefix.rs`) only saves work: replayed request by request,
    /// every rewrite and every reason to rebuild are those of a replay that makes each point's
    /// whole rewrite (a reinforcement reminder that never starts turns the shortcut off).
    #[test]
    fn the_floor_shortcut_never_changes_a_decision(request in conversation(), budget in prop::sample::select(vec![300usize, 1500, 4000, 1_000_000])) {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let config = PipelineConfig::default();
        let never = ctxproxy::guards::ReinforcementConfig {
            enabled: true,
            after_messages: usize::MAX,
            text: "unused".into(),
        };
        let (fast, slow) = (pipeline::Memo::default(), pipeline::Memo::default());
        for earlier in earlier_requests(&request) {
            let shortcut = pipeline::run(&earlier, &env(&config, &counter, &fast, budget));
            let full = pipeline::run(&earlier, &pipeline::Env {
                reinforcement: Some(&never),
                ..env(&config, &counter, &slow, budget)
            });
            prop_assert_eq!(&shortcut.request, &full.request);
            let rebuilt = |r: &pipeline::Rewrite| r.report.prefix.as_ref().and_then(|p| p.rebuilt);
            prop_assert_eq!(rebuilt(&shortcut), rebuilt(&full));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Every tool the client sent is in the rewrite, in full or as a stub, in the client's
    /// order; only `left_out = "remove"` removes tools. Filtered whatever the block's size.
    #[test]
    fn every_tool_stays_callable_unless_removal_is_asked(request in conversation(), budget in prop::sample::select(vec![300usize, 1500, 4000, 1_000_000])) {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let mut config = PipelineConfig::default();
        config.tools.min_tool_tokens = 0;
        config.tools.min_stub_tokens = 0;
        let stubbed = pipeline::run(&request, &env(&config, &counter, &pipeline::Memo::default(), budget));
        // The recall tool, when offered, comes last.
        let mut names = stubbed.request.tool_names();
        if names.last().is_some_and(|n| *n == recall::TOOL_NAME) {
            names.pop();
        }
        prop_assert_eq!(names, request.tool_names());
        config.tools.left_out = pipeline::config::LeftOut::Remove;
        let removed = pipeline::run(&request, &env(&config, &counter, &pipeline::Memo::default(), budget));
        let kept = removed.request.tool_names();
        prop_assert!(kept.iter().filter(|n| **n != recall::TOOL_NAME).all(|name| request.tool_names().contains(name)));
    }
}

/// The ledger lines of a rewrite's `<conversation_summary>` section.
fn ledger_lines(request: &ChatRequest) -> Vec<String> {
    let system = request
        .messages
        .first()
        .and_then(|m| m.content.get())
        .map(|c| c.text().into_owned())
        .unwrap_or_default();
    let Some(start) = system.find("<conversation_summary>\n") else {
        return Vec::new();
    };
    system[start..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("</conversation_summary>"))
        .filter_map(|l| l.strip_prefix("- "))
        .map(str::to_owned)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Prefix stability of the summary: rewritten whole at every request of a conversation, at
    /// any budget, two consecutive requests' ledgers agree line for line on what they both
    /// summarize; only the last summarized turn's answer (at most its text or its calls, the last
    /// lines) may be left out while it is kept verbatim. With no cap, the ledger never folds.
    #[test]
    fn the_summary_ledger_grows_by_appending(request in conversation(), budget in prop::sample::select(vec![300usize, 1500, 4000, 1_000_000])) {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = pipeline::Memo::default();
        let mut config = PipelineConfig {
            clear_at_least_tokens: 0,
            ..PipelineConfig::default()
        };
        config.window.ledger_max_tokens = 1_000_000;
        let env = env(&config, &counter, &memo, budget);
        let ledgers: Vec<Vec<String>> = earlier_requests(&request)
            .iter()
            .map(|earlier| ledger_lines(&pipeline::run(earlier, &env).request))
            .collect();
        for pair in ledgers.windows(2) {
            let (before, after) = (&pair[0], &pair[1]);
            let common = before.iter().zip(after).take_while(|(a, b)| a == b).count();
            let shorter = before.len().min(after.len());
            prop_assert!(common + 4 >= shorter, "{:#?}\n---\n{:#?}", before, after);
        }
    }
}
