//! Definitions in the messages: a tool a conversation needs after its tool block was decided
//! gets its full definition in a system message placed where the need arose, and stays a stub
//! in the block. The block comes first in the prompt, so growing it re-bills the whole prompt
//! at the full input price; a message placed in the history re-bills nothing that was sent
//! before (ARCHITECTURE.md, principles 4 and 9).
//!
//! Where a definition goes is a function of the history: before the assistant message that
//! first called it. So the re-ask of an answer that called a stub (which appends the
//! definition last) and every later request of the conversation place it at the same spot.
//!
//! Its form is the upstream's (`tool_definitions`): a system message (`in_place`), or, for chat
//! templates that refuse or drop a system message in mid-conversation, the result of a call
//! (`in_result`): an assistant message calling the stub with `{}`, then a tool message with the
//! definition. Every template that renders tool calls renders that pair where it stands.

use std::collections::BTreeSet;

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::block::sends_block_whole;
use super::catalog::{Catalog, tool_name};
use super::classify::{matched_of, turn_scores};
use super::concise::concise;
use super::plan;
use crate::openai::{
    ChatRequest, Content, Extra, FunctionCall, Message, Nullable, Role, Tool, ToolCall,
};
use crate::pipeline::config::{Definitions, PipelineConfig, ToolsConfig};
use crate::pipeline::memo::Memo;
use crate::pipeline::stage::{Params, StageCx};
use crate::tokens::TokenCounter;

/// The first line of a definitions message: what tells it apart, and what it tells the model.
pub const HEADER: &str = "Full definitions of tools that the tools list gives by name only; call them with these parameters:";

/// Definitions placed before the client's message at `at` (`at` = the number of messages: last).
/// At one spot, the definitions the request there needed come before those its answer called
/// (which its re-ask appended after them).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Placed {
    pub at: usize,
    pub answered: bool,
    pub names: Vec<String>,
}

/// A tool the provider holds to its schema (`strict`): only a definition in the block keeps
/// that guarantee, so such a tool is never defined in the messages.
pub fn is_strict(tool: &Tool) -> bool {
    tool.function
        .as_ref()
        .and_then(|f| f.extra.get("strict"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// The system message defining the named tools, in the client's order, each as the compact JSON
/// of the client's function object (`concise`) on its own line.
pub fn message(client_tools: &[Tool], names: &[String]) -> Message {
    let mut text = String::from(HEADER);
    for tool in client_tools {
        if !tool_name(tool).is_some_and(|name| names.iter().any(|n| n == name)) {
            continue;
        }
        if let Some(function) = concise(tool).function {
            text.push('\n');
            text.push_str(&serde_json::to_string(&function).unwrap_or_default());
        }
    }
    Message::text(Role::System, text)
}

/// The messages defining the named tools in the upstream's form (`definitions`): one system
/// message, or (`in_result`) a call of each stub and its result, in the client's order.
pub fn messages(client_tools: &[Tool], names: &[String], definitions: Definitions) -> Vec<Message> {
    if definitions != Definitions::InResult {
        return vec![message(client_tools, names)];
    }
    client_tools
        .iter()
        .filter_map(tool_name)
        .filter(|name| names.iter().any(|n| n == name))
        .flat_map(|name| {
            let id = call_id(name);
            let definition = message(client_tools, &[name.to_owned()]);
            let call = ToolCall {
                id: id.clone(),
                kind: Some("function".to_owned()),
                function: FunctionCall {
                    name: name.to_owned(),
                    arguments: "{}".to_owned(),
                    extra: Extra::new(),
                },
                extra: Extra::new(),
            };
            let asked = Message {
                role: Role::Assistant,
                content: Nullable::Null,
                tool_calls: Nullable::Value(std::sync::Arc::new(vec![call])),
                ..Message::text(Role::Assistant, "")
            };
            let answered = Message {
                role: Role::Tool,
                tool_call_id: Nullable::Value(id.into()),
                ..definition
            };
            [asked, answered]
        })
        .collect()
}

/// Characters of a definition call's id: nine letters and digits, which Mistral's templates
/// require of every tool call id.
const CALL_ID_CHARS: usize = 9;
/// What every definition call's id starts with.
const CALL_ID_PREFIX: &str = "ctxd";

/// The id of the call that defines `name`: the same for every request, replica and version.
fn call_id(name: &str) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let digest = Sha256::digest(name.as_bytes());
    let mut id = String::from(CALL_ID_PREFIX);
    id.extend(
        digest
            .iter()
            .take(CALL_ID_CHARS - CALL_ID_PREFIX.len())
            .map(|b| char::from(DIGITS[usize::from(*b) % DIGITS.len()])),
    );
    id
}

fn is_definition_call_id(id: &str) -> bool {
    id.len() == CALL_ID_CHARS
        && id.starts_with(CALL_ID_PREFIX)
        && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Whether `message` is the call half of a definition (`in_result`): an assistant message
/// whose only calls are definition calls. Its result says it is one; this does not read it.
pub fn is_definition_call(message: &Message) -> bool {
    message.role == Role::Assistant
        && !message.tool_calls().is_empty()
        && message
            .tool_calls()
            .iter()
            .all(|c| is_definition_call_id(&c.id))
}

/// Whether `message` is the result half of a definition (`in_result`).
pub fn is_definition_result(message: &Message) -> bool {
    message.role == Role::Tool
        && message
            .tool_call_id
            .get()
            .is_some_and(|id| is_definition_call_id(id))
        && is_definitions(message)
}

/// Whether `message` is a definition in any form: a definitions system message, or either half
/// of a definition call.
pub fn is_definition(message: &Message) -> bool {
    match message.role {
        Role::System => is_definitions(message),
        Role::Tool => is_definition_result(message),
        Role::Assistant => is_definition_call(message),
        _ => false,
    }
}

/// The definitions messages among `messages` (system messages, or the results of definition
/// calls), each with its lines after the header.
pub fn definition_messages(messages: &[Message]) -> impl Iterator<Item = (&Message, &str)> {
    messages
        .iter()
        .filter(|m| m.role == Role::System || is_definition_result(m))
        .filter_map(|m| match m.content.get() {
            Some(Content::Text(text)) => text.strip_prefix(HEADER).map(|rest| (m, rest)),
            _ => None,
        })
}

/// The function objects that definitions messages among `messages` carry.
pub fn definitions_in(messages: &[Message]) -> Vec<Value> {
    definition_messages(messages)
        .flat_map(|(_, rest)| rest.lines().filter_map(|l| serde_json::from_str(l).ok()))
        .collect()
}

/// The stubs of a request as sent (`tools`, `messages`), by whether its messages define them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stubs {
    /// Those the model has no definition of: a call to one of them is asked again.
    pub undefined: Vec<String>,
    /// Those its messages define in full: the model has their definitions only where a chat
    /// template may drop them, so a call of one of them is checked against the client's schema
    /// (`guards::arguments`).
    pub defined: Vec<String>,
}

/// The stubs of `tools` (as sent, `client`'s as the client sent them), by whether `messages`
/// define them.
pub fn stubs_of(tools: &[Tool], messages: &[Message], client: &[Tool]) -> Stubs {
    let stubbed = super::stubs::stubbed(tools, client);
    if stubbed.is_empty() {
        return Stubs::default();
    }
    let defined = defined_in(messages);
    let (defined, undefined) = stubbed.into_iter().partition(|name| defined.contains(name));
    Stubs { undefined, defined }
}

/// `Stubs::undefined` of a request as sent.
pub fn undefined_stubs(tools: &[Tool], messages: &[Message], client: &[Tool]) -> Vec<String> {
    stubs_of(tools, messages, client).undefined
}

/// Whether a tool needed later goes in full in the block: a strict tool, or any tool when
/// the upstream's definitions go in the block.
pub fn in_block(tool: &Tool, definitions: Definitions) -> bool {
    definitions.in_block() || is_strict(tool)
}

/// `sent` asked again after its answer called the stubs `called`: each called tool that goes
/// in the block (`in_block`) back to its full definition there, the others defined in a
/// message appended last, where the conversation's next requests place it too (before the
/// answer that called them).
pub fn reask(
    sent: &ChatRequest,
    client: &[Tool],
    called: &[String],
    definitions: Definitions,
) -> ChatRequest {
    let strict = |name: &String| {
        client
            .iter()
            .find(|t| tool_name(t) == Some(name.as_str()))
            .is_some_and(|t| in_block(t, definitions))
    };
    let (strict, loose): (Vec<String>, Vec<String>) = called.iter().cloned().partition(strict);
    let mut request = sent.clone();
    if !strict.is_empty()
        && let Some(tools) = sent.tools.get()
    {
        request.tools = Nullable::Value(super::stubs::promote(tools, client, Some(&strict)));
    }
    if !loose.is_empty() {
        request
            .messages
            .extend(messages(client, &loose, definitions));
    }
    request
}

/// `sent` with its definitions messages taken out and the tools they defined in full in the
/// block instead: what an upstream that refuses (or drops) a system message in mid-conversation
/// reads. `None` when `sent` has no definitions message.
pub fn in_block_instead(sent: &ChatRequest, client: &[Tool]) -> Option<ChatRequest> {
    let defined: Vec<String> = defined_in(&sent.messages).into_iter().collect();
    if defined.is_empty() {
        return None;
    }
    let mut request = sent.clone();
    // A definition call goes with its result: the pair is taken out whole.
    let results: BTreeSet<&str> = sent
        .messages
        .iter()
        .filter(|m| is_definition_result(m))
        .filter_map(|m| m.tool_call_id.get().map(|id| id.as_str()))
        .collect();
    request.messages.retain(|m| {
        let answered = (m.tool_calls().iter()).all(|c| results.contains(c.id.as_str()));
        !(is_definition(m) && answered)
    });
    if let Some(tools) = sent.tools.get() {
        request.tools = Nullable::Value(super::stubs::promote(tools, client, Some(&defined)));
    }
    Some(request)
}

fn is_definitions(message: &Message) -> bool {
    matches!(message.content.get(), Some(Content::Text(text)) if text.starts_with(HEADER))
}

/// The names of the tools that definitions messages among `messages` define.
pub fn defined_in(messages: &[Message]) -> BTreeSet<String> {
    definitions_in(messages)
        .iter()
        .filter_map(|f| f.get("name").and_then(Value::as_str).map(str::to_owned))
        .collect()
}

/// `messages`, a rewrite of `original` that keeps a tail of it verbatim (less the system and
/// developer messages merged into the first), with each definitions message before the
/// message of `original` it is placed at. A spot before that tail (summarized) maps to the
/// tail's start, so nothing defined is lost with its turn.
pub fn insert(
    messages: Vec<Message>,
    original: &[Message],
    placed: &[(usize, Message)],
) -> Vec<Message> {
    if placed.is_empty() {
        return messages;
    }
    // (index in `messages`, index in `original`) of the verbatim tail, from the end.
    let mut tail: Vec<(usize, usize)> = Vec::new();
    let (mut i, mut j) = (messages.len(), original.len());
    while i > 0 && j > 0 {
        if messages[i - 1] == original[j - 1] {
            tail.push((i - 1, j - 1));
            i -= 1;
            j -= 1;
        } else if matches!(original[j - 1].role, Role::System | Role::Developer) {
            j -= 1;
        } else {
            break;
        }
    }
    let position = |at: usize| {
        tail.iter()
            .rev()
            .find(|(_, o)| *o >= at)
            .map_or(messages.len(), |(m, _)| *m)
    };
    // A call never goes before a user message (templates that check the roles' alternation
    // refuse it): a spot the window summarized, the tail's first user messages, takes the
    // pair after them.
    let position_of = |at: usize, definition: &Message| {
        let mut p = position(at);
        if definition.role != Role::System {
            while messages.get(p).is_some_and(|m| m.role == Role::User) {
                p += 1;
            }
        }
        p
    };
    let mut positions: Vec<(usize, &Message)> = placed
        .iter()
        .map(|(at, d)| (position_of(*at, d), d))
        .collect();
    positions.sort_by_key(|(p, _)| *p);
    let mut out = Vec::with_capacity(messages.len() + placed.len());
    let mut next = positions.into_iter().peekable();
    for (index, message) in messages.iter().enumerate() {
        while let Some((_, definitions)) = next.next_if(|(p, _)| *p <= index) {
            out.push(definitions.clone());
        }
        out.push(message.clone());
    }
    out.extend(next.map(|(_, definitions)| definitions.clone()));
    out
}

/// The definitions messages of `placed` in the upstream's form, each at its spot (a spot
/// holds one message per tool `in_result`).
pub(super) fn placed_definitions(
    placed: &[Placed],
    tools: &[Tool],
    definitions: Definitions,
) -> Vec<(usize, Message)> {
    placed
        .iter()
        .flat_map(|p| {
            messages(tools, &p.names, definitions)
                .into_iter()
                .map(|m| (p.at, m))
        })
        .collect()
}

/// The definitions `request`'s rewrite places in its messages from the client's message
/// `from` on (those at `from` itself only when an answer called them: the rest ended the
/// rewrite of the request that sent the first `from` messages), less the tools `sent` (that
/// rewrite) already defines: the tool its `tool_choice` named, which the answer at `from`
/// then called. What a conversation's next request appends to its earlier rewrite (`prefix`).
pub fn definitions_from(
    request: &ChatRequest,
    from: usize,
    sent: &[Message],
    config: &PipelineConfig,
    counter: &TokenCounter,
    memo: &Memo,
) -> Vec<(usize, Message)> {
    if sends_block_whole(request, config, counter) {
        return Vec::new();
    }
    let Some(tools) = request.tools.get() else {
        return Vec::new();
    };
    let params = Params::from_config(config);
    let cx = StageCx {
        config,
        params: &params,
        counter,
        memo,
        sticky_categories: &[],
        original_messages: &request.messages,
        decided: &Default::default(),
    };
    let catalog = Catalog::memoized(tools, &config.tools, memo);
    let plan = plan(&catalog, tools, request, &request.messages, &cx);
    let mut placed: Vec<Placed> = plan
        .placed
        .into_iter()
        .filter(|p| p.at > from || (p.at == from && p.answered))
        .collect();
    if placed.iter().any(|p| p.at == from) {
        let defined = defined_in(sent);
        for p in placed.iter_mut().filter(|p| p.at == from) {
            p.names.retain(|name| !defined.contains(name));
        }
        placed.retain(|p| !p.names.is_empty());
    }
    placed_definitions(&placed, tools, config.tools.definitions)
}

/// What the conversation needed after its first turn, in order, each at the client's message
/// it goes before: the tools an assistant message called (before it). With `words` (left-out
/// tools removed: no re-ask can recover a miss), also the tools of the categories a later user
/// message matched (scored as it was then) and, mid tool loop, the tools of the categories the
/// loop used (before its next step, or last). With stubs, neither is predicted: a miss costs
/// one re-ask, and on recorded agent traffic defining what they predicted cost more tokens
/// than the re-asks it saved, at the same bill.
pub(super) fn later_needs(
    catalog: &Catalog,
    messages: &[Message],
    first: usize,
    words: Option<&ToolsConfig>,
    memo: &Memo,
) -> Vec<Placed> {
    let loop_needs = |categories: &BTreeSet<&str>| -> Vec<String> {
        let names: BTreeSet<String> = catalog
            .categories
            .iter()
            .filter(|c| categories.contains(c.name.as_str()))
            .flat_map(|c| c.tools.iter().cloned())
            .collect();
        names.into_iter().collect()
    };
    let mut needs = Vec::new();
    let mut push = |at: usize, answered: bool, names: Vec<String>| {
        if !names.is_empty() {
            needs.push(Placed {
                at,
                answered,
                names,
            });
        }
    };
    // The categories of the tools called since the last user message.
    let mut loop_categories: BTreeSet<&str> = BTreeSet::new();
    for (index, message) in messages.iter().enumerate() {
        match message.role {
            Role::User => {
                loop_categories.clear();
                if let Some(config) = words.filter(|_| index >= first) {
                    let scores = turn_scores(catalog, &messages[..=index], config, memo);
                    let matched = matched_of(&scores, config);
                    let names: BTreeSet<String> = catalog
                        .categories
                        .iter()
                        .filter(|c| matched.contains(&c.name))
                        .flat_map(|c| c.tools.iter().cloned())
                        .collect();
                    push(index, false, names.into_iter().collect());
                }
            }
            Role::Assistant => {
                if index >= first {
                    let after_tool = index
                        .checked_sub(1)
                        .and_then(|i| messages.get(i))
                        .is_some_and(|m| matches!(m.role, Role::Tool | Role::Function));
                    if after_tool && words.is_some() {
                        push(index, false, loop_needs(&loop_categories));
                    }
                    // The names called, sorted and once each (this runs for every message of
                    // every point a cold request decides: no set is built).
                    let mut called: Vec<&str> = (message.tool_calls().iter())
                        .map(|c| c.function.name.as_str())
                        .collect();
                    called.sort_unstable();
                    called.dedup();
                    push(index, true, called.into_iter().map(str::to_owned).collect());
                }
                for call in message.tool_calls() {
                    loop_categories.extend(catalog.categories_of(&call.function.name));
                }
            }
            _ => {}
        }
    }
    let mid_loop = messages
        .last()
        .is_some_and(|m| matches!(m.role, Role::Tool | Role::Function));
    if mid_loop && words.is_some() {
        push(messages.len(), false, loop_needs(&loop_categories));
    }
    needs
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tool(name: &str, strict: bool) -> Tool {
        let mut function = json!({"name": name, "description": format!("Does {name}."),
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}});
        if strict {
            function["strict"] = json!(true);
        }
        serde_json::from_value(json!({"type": "function", "function": function})).unwrap()
    }

    fn text(role: Role, text: &str) -> Message {
        Message::text(role, text)
    }

    #[test]
    fn a_definitions_message_lists_the_named_tools_in_the_clients_order_and_parses_back() {
        let tools = [tool("b", false), tool("a", false), tool("c", false)];
        let message = message(&tools, &["c".to_owned(), "b".to_owned()]);
        let Some(Content::Text(text)) = message.content.get() else {
            panic!("text content")
        };
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], HEADER);
        assert!(lines[1].starts_with(r#"{"name":"b""#), "{}", lines[1]);
        assert!(lines[2].starts_with(r#"{"name":"c""#), "{}", lines[2]);
        assert_eq!(
            defined_in(&[text_message_user(), message.clone()]),
            BTreeSet::from(["b".to_owned(), "c".to_owned()])
        );
        assert_eq!(
            definitions_in(&[message])[0]["parameters"]["properties"]["id"]["type"],
            "string"
        );
    }

    fn text_message_user() -> Message {
        // A user quoting the header defines nothing.
        text(Role::User, &format!("{HEADER}\n{{\"name\":\"x\"}}"))
    }

    fn in_result(tools: &[Tool], names: &[&str]) -> Vec<Message> {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        messages(tools, &names, Definitions::InResult)
    }

    #[test]
    fn a_definition_as_a_result_is_a_call_of_the_stub_then_its_definition() {
        let tools = [tool("b", false), tool("a", false), tool("c", false)];
        let placed = in_result(&tools, &["c", "b"]);
        // One pair per tool, in the client's order: one call per assistant message (Llama's
        // JSON templates refuse more).
        let roles: Vec<Role> = placed.iter().map(|m| m.role.clone()).collect();
        assert_eq!(
            roles,
            [Role::Assistant, Role::Tool, Role::Assistant, Role::Tool]
        );
        let call = &placed[0].tool_calls()[0];
        assert_eq!(call.function.name, "b");
        assert_eq!(call.function.arguments, "{}");
        assert_eq!(
            placed[1].tool_call_id.get().map(|id| id.as_str()),
            Some(call.id.as_str())
        );
        assert_eq!(placed[2].tool_calls()[0].function.name, "c");
        // Nine letters and digits (Mistral's templates), the same on every request.
        assert_eq!(call.id.len(), 9);
        assert!(call.id.bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_eq!(in_result(&tools, &["b"])[0].tool_calls()[0].id, call.id);
        assert_ne!(placed[2].tool_calls()[0].id, call.id);
        assert!(placed.iter().all(is_definition));
        assert!(is_definition_call(&placed[0]) && is_definition_result(&placed[1]));
        assert_eq!(
            defined_in(&placed),
            BTreeSet::from(["b".to_owned(), "c".to_owned()])
        );
        assert_eq!(definitions_in(&placed)[0]["name"], "b");
        // As sent, the call's content is null.
        let sent = serde_json::to_value(&placed[0]).unwrap();
        assert_eq!(sent["content"], Value::Null);
        assert_eq!(sent["tool_calls"][0]["type"], "function");
        // Other placements are one system message.
        let names = ["b".to_owned()];
        for other in [Definitions::InPlace, Definitions::Auto] {
            assert_eq!(messages(&tools, &names, other), [message(&tools, &names)]);
        }
    }

    #[test]
    fn a_clients_tool_result_quoting_the_header_defines_nothing() {
        let mut quoted = text(Role::Tool, &format!("{HEADER}\n{{\"name\":\"x\"}}"));
        quoted.tool_call_id = Nullable::Value("call_abc123".into());
        assert!(!is_definition(&quoted));
        assert!(defined_in(&[quoted]).is_empty());
    }

    #[test]
    fn definitions_in_either_form_can_move_into_the_block() {
        let client = vec![tool("a", false), tool("b", false)];
        let counter = crate::tokens::TokenCounter::new(crate::tokens::Encoding::O200kBase);
        let memo = crate::pipeline::Memo::default();
        let stubs: Vec<Tool> = client
            .iter()
            .map(|t| super::super::stubs::stub(t, 24, &counter, &memo))
            .collect();
        let b = ["b".to_owned()];
        for form in [Definitions::InPlace, Definitions::InResult] {
            let mut sent: ChatRequest =
                serde_json::from_value(json!({"model": "m", "messages": []})).unwrap();
            sent.messages = vec![text(Role::User, "one")];
            sent.messages.extend(messages(&client, &b, form));
            sent.tools = Nullable::Value(stubs.clone());
            // A pair goes whole.
            let moved = in_block_instead(&sent, &client).unwrap();
            assert_eq!(moved.messages, vec![text(Role::User, "one")], "{form:?}");
            let tools = moved.tools.get().unwrap();
            assert_eq!(tools[1], client[1], "b in full, in its place");
            assert_ne!(tools[0], client[0], "a still a stub");
            assert!(in_block_instead(&moved, &client).is_none());
            // A re-ask appends the definitions in the form asked.
            let reasked = reask(&moved, &client, &["a".to_owned()], form);
            assert_eq!(
                reasked.messages[1..],
                messages(&client, &["a".to_owned()], form)[..]
            );
        }
    }

    #[test]
    fn a_definition_as_a_result_never_goes_before_a_user_message() {
        let original = vec![
            text(Role::System, "sys"),
            text(Role::User, "one"),
            text(Role::Assistant, "a1"),
            text(Role::User, "two"),
            text(Role::User, "and three"),
            text(Role::Assistant, "a2"),
        ];
        // The window summarized the first turn, where the tool was called.
        let windowed = vec![
            text(Role::System, "sys + summary"),
            text(Role::User, "two"),
            text(Role::User, "and three"),
            text(Role::Assistant, "a2"),
        ];
        let tools = [tool("b", false)];
        let pair = in_result(&tools, &["b"]);
        let placed: Vec<(usize, Message)> = pair.iter().map(|m| (2, m.clone())).collect();
        let out = insert(windowed.clone(), &original, &placed);
        // After the kept history's first user messages (Llama's templates take what follows
        // the system message for the first user message).
        assert_eq!(out[1..3], windowed[1..3]);
        assert_eq!(out[3..5], pair[..]);
        assert_eq!(out[5], windowed[3]);
    }

    #[test]
    fn strict_tools_are_told_apart() {
        assert!(is_strict(&tool("a", true)));
        assert!(!is_strict(&tool("a", false)));
    }

    #[test]
    fn definitions_go_before_their_message_in_the_kept_tail_or_at_its_start() {
        let original = vec![
            text(Role::System, "sys"),
            text(Role::User, "one"),
            text(Role::Assistant, "a1"),
            text(Role::User, "two"),
            text(Role::Assistant, "a2"),
            text(Role::User, "three"),
        ];
        // The window summarized the first turn.
        let windowed = vec![
            text(Role::System, "sys + summary"),
            text(Role::User, "two"),
            text(Role::Assistant, "a2"),
            text(Role::User, "three"),
        ];
        let d = |n: &str| text(Role::System, n);
        let placed = vec![(1, d("D1")), (4, d("D4")), (5, d("D5")), (6, d("END"))];
        let out = insert(windowed, &original, &placed);
        let texts: Vec<String> = out
            .iter()
            .map(|m| {
                m.content
                    .get()
                    .map(|c| c.text().into_owned())
                    .unwrap_or_default()
            })
            .collect();
        assert_eq!(
            texts,
            [
                "sys + summary",
                "D1",
                "two",
                "D4",
                "a2",
                "D5",
                "three",
                "END"
            ]
        );
    }

    #[test]
    fn a_developer_message_merged_into_the_system_one_does_not_cut_the_tail() {
        let original = vec![
            text(Role::System, "sys"),
            text(Role::User, "one"),
            text(Role::Assistant, "a1"),
            text(Role::Developer, "be brief"),
            text(Role::User, "two"),
        ];
        let merged = vec![
            text(Role::System, "sys + be brief"),
            text(Role::User, "one"),
            text(Role::Assistant, "a1"),
            text(Role::User, "two"),
        ];
        let placed = vec![(2, text(Role::System, "D2"))];
        let out = insert(merged, &original, &placed);
        assert_eq!(out[2], text(Role::System, "D2"));
        assert_eq!(out[3], text(Role::Assistant, "a1"));
    }

    #[test]
    fn nothing_placed_leaves_the_messages_as_they_are() {
        let messages = vec![text(Role::User, "hi")];
        assert_eq!(insert(messages.clone(), &messages, &[]), messages);
    }
}
