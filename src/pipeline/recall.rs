//! A way back for what a cap drops: a tool result that the compact stage clears or cuts names a
//! handle (`rc-` and 8 hex digits of its text), and the request offers one small tool,
//! `ctxproxy_recall`, the same bytes on every turn. A model that calls it gets the original
//! from the client's own request, asked again by the proxy (`server::guarded::expand`); the
//! client never sees the call. The original never leaves the request it came in, so a handle
//! is scoped to its tenant and conversation by construction, and no store holds it.

use std::borrow::Cow;
use std::hash::BuildHasher;
use std::sync::{Arc, LazyLock};

use foldhash::quality::FixedState;
use serde_json::Value;

use serde::{Deserialize, Serialize};

use super::config::PipelineConfig;
use super::tools::inline;
use crate::openai::{ChatRequest, Message, Nullable, Role, Tool, ToolCall};
use crate::tokens::TokenCounter;

/// The recall tool's name.
pub const TOOL_NAME: &str = "ctxproxy_recall";

/// Seed of handles: a handle is the same on every replica and every turn.
const HANDLE_SEED: u64 = 0x7265_6361_6c6c_0001;

/// The recall tool, as it is offered: one definition, byte-stable.
static TOOL: LazyLock<Option<Tool>> = LazyLock::new(|| {
    serde_json::from_str(
        r#"{"type":"function","function":{"name":"ctxproxy_recall","description":"Original of a shortened result","parameters":{"type":"object","properties":{"handle":{"type":"string"}}}}}"#,
    )
    .ok()
});

/// The handle of a tool result's text.
pub fn handle_of(text: &str) -> String {
    let hash = FixedState::with_seed(HANDLE_SEED).hash_one(text);
    format!("rc-{:08x}", hash >> 32)
}

/// What a cut result ends with: where the whole of it is.
pub fn cut_note(handle: &str) -> String {
    format!("\n[shortened; recall {handle}]")
}

/// Whether the recall tool may be offered at all: compaction, which names what it recalls, and
/// the recall are on.
pub fn enabled(config: &PipelineConfig) -> bool {
    config.compact.enabled && config.compact.recall
}

/// The request offers the recall tool: it sends tools, and none of the client's has its name.
pub fn can_offer(request: &ChatRequest, client_tools: &[Tool]) -> bool {
    can_offer_beside(request.tools.get().map_or(&[], Vec::as_slice), client_tools)
}

/// The recall tool may join the tools `sent`: there are some, and none of the client's has its
/// name.
pub fn can_offer_beside(sent: &[Tool], client_tools: &[Tool]) -> bool {
    !sent.is_empty() && !names_recall(client_tools)
}

/// The tokens the recall tool takes when `request` (the client's) may be offered it: what the
/// budget allows beside the client's context.
pub fn allowance(request: &ChatRequest, config: &PipelineConfig, counter: &TokenCounter) -> usize {
    let client_tools = request.tools.get().map_or(&[][..], Vec::as_slice);
    match TOOL.as_ref() {
        Some(tool) if enabled(config) && can_offer(request, client_tools) => {
            counter.tools(std::slice::from_ref(tool))
        }
        _ => 0,
    }
}

/// `request` with the recall tool last in its block (once).
pub fn offer(request: &mut ChatRequest) {
    if let Nullable::Value(tools) = &mut request.tools {
        offer_in(tools);
    }
}

/// `tools` with the recall tool last (once).
pub fn offer_in(tools: &mut Vec<Tool>) {
    if let Some(tool) = TOOL.as_ref()
        && !names_recall(tools)
    {
        tools.push(tool.clone());
    }
}

/// `request` without the recall tool: what the last recall round allowed sends.
pub fn withdraw(request: &mut ChatRequest) {
    if let Nullable::Value(tools) = &mut request.tools {
        tools.retain(|t| t.function.as_ref().is_none_or(|f| f.name != TOOL_NAME));
    }
}

/// Whether `tools` offer the recall tool.
pub fn offered(tools: &[Tool]) -> bool {
    names_recall(tools)
}

fn names_recall(tools: &[Tool]) -> bool {
    tools
        .iter()
        .any(|t| t.function.as_ref().is_some_and(|f| f.name == TOOL_NAME))
}

/// The handle a recall call asks for, from its arguments (`{"handle": "rc-…"}`; a model that
/// writes the bare handle is understood too).
pub fn asked_handle(arguments: &str) -> Option<String> {
    let handle = match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(map)) => map.get("handle")?.as_str()?.trim().to_owned(),
        Ok(Value::String(s)) => s.trim().to_owned(),
        _ => arguments.trim().trim_matches('"').to_owned(),
    };
    (!handle.is_empty()).then_some(handle)
}

/// The handles (`rc-` and 8 hex digits) that `text` names, in order.
pub fn handles_in(text: &str) -> impl Iterator<Item = &str> {
    text.match_indices("rc-").filter_map(|(at, _)| {
        let handle = text.get(at..at + 11)?;
        let hex = handle[3..].bytes().all(|b| b.is_ascii_hexdigit());
        let alone = !text[at + 11..].starts_with(|c: char| c.is_ascii_alphanumeric());
        (hex && alone).then_some(handle)
    })
}

/// The handles that `sent` (a rewrite) names in its tool results: the results a recall of it
/// may ask for.
pub fn named_handles(sent: &[Message]) -> Vec<String> {
    let mut named: Vec<String> = Vec::new();
    for text in result_texts(sent) {
        for handle in handles_in(&text) {
            if !named.iter().any(|h| h == handle) {
                named.push(handle.to_owned());
            }
        }
    }
    named
}

/// The texts of the tool results among `messages`.
fn result_texts(messages: &[Message]) -> Vec<Cow<'_, str>> {
    messages
        .iter()
        .filter(|m| matches!(m.role, Role::Tool | Role::Function))
        .filter_map(|m| m.content.get().map(|c| c.text()))
        .collect()
}

/// What a recall answers when the handle names nothing in this conversation.
pub fn unknown(handle: &str) -> String {
    format!(
        "No earlier result has the handle {handle} in this conversation; call the tool that \
         produced it again if you need it."
    )
}

/// One recall the model asked for, answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Recalled {
    pub call: ToolCall,
    /// The handle asked for, and whether the conversation held it.
    pub handle: Option<String>,
    pub found: bool,
    pub text: String,
}

/// Answers each recall call with the original `find` gives for its handle.
pub fn answer(calls: Vec<ToolCall>, find: impl Fn(&str) -> Option<String>) -> Vec<Recalled> {
    calls
        .into_iter()
        .map(|call| {
            let handle = asked_handle(&call.function.arguments);
            let found = handle.as_deref().and_then(&find);
            Recalled {
                found: found.is_some(),
                text: match (&handle, found) {
                    (_, Some(text)) => text,
                    (Some(h), None) => unknown(h),
                    (None, None) => {
                        format!("{TOOL_NAME} needs the handle a shortened result names.")
                    }
                },
                call,
                handle,
            }
        })
        .collect()
}

/// `request` with the recall calls and their answers appended: an assistant message carrying
/// the calls, then one tool message per call.
pub fn appended(request: &ChatRequest, recalled: &[Recalled]) -> ChatRequest {
    let mut request = request.clone();
    request.messages.extend(pair(recalled));
    request
}

/// The assistant message that calls, and the tool messages that answer.
pub fn pair(recalled: &[Recalled]) -> Vec<Message> {
    let mut messages = vec![Mark::of(0, 0, recalled).call];
    messages.extend(results(recalled));
    messages
}

/// One tool message per answered call.
fn results(recalled: &[Recalled]) -> impl Iterator<Item = Message> + '_ {
    recalled.iter().map(|r| {
        let mut result = Message::text(Role::Tool, r.text.clone());
        result.tool_call_id = Nullable::Value(r.call.id.as_str().into());
        result
    })
}

/// Where a recall was answered in a conversation: after the client's first `at` messages, the
/// assistant message `call` that called `ctxproxy_recall` (its answers are read again from the
/// client's messages by handle). Later requests of the conversation keep the pair there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mark {
    pub at: usize,
    pub call: Message,
    /// The digest of those `at` messages (`history_digest`): sessions that share a conversation
    /// key (one `X-Conversation-Id` or `user` for several chats) put back only their own pairs.
    /// Absent from a mark an earlier version stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<u64>,
}

impl Mark {
    /// The mark of a recall answered after `at` messages whose digest is `history`.
    pub fn of(at: usize, history: u64, recalled: &[Recalled]) -> Mark {
        let mut call = Message::text(Role::Assistant, "");
        call.content = Nullable::Null;
        call.tool_calls =
            Nullable::Value(Arc::new(recalled.iter().map(|r| r.call.clone()).collect()));
        Mark {
            at,
            call,
            history: Some(history),
        }
    }

    /// Whether the mark was made after `client`'s first `at` messages.
    fn answered_after(&self, client: &[Message]) -> bool {
        let Some(history) = client.get(..self.at) else {
            return false;
        };
        self.history
            .is_none_or(|digest| digest == history_digest(history))
    }
}

/// Seed of the digests of the histories recalls were answered after.
const HISTORY_SEED: u64 = 0x7265_6361_6c6c_0002;

/// A digest of `messages` for their marks (texts by the digest taken when they were read, the
/// ids of calls too). A replica of another version may digest them otherwise: it then puts no
/// pair back, and the model may recall again.
pub fn history_digest(messages: &[Message]) -> u64 {
    let mut hasher = FixedState::with_seed(HISTORY_SEED).build_hasher();
    for message in messages {
        crate::tokens::hash_message(message, &mut hasher);
        for call in message.tool_calls() {
            std::hash::Hash::hash(&call.id, &mut hasher);
        }
    }
    std::hash::Hasher::finish(&hasher)
}

/// How a rewrite relates to the client's messages (what `PrefixReport` says of it): the
/// client's first `anchor_messages` are rewritten, the `appended_messages` after them appended
/// one for one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    pub anchor_messages: usize,
    pub appended_messages: usize,
}

/// Puts each recall pair of `marks` back where its re-ask put it, into `sent`, the rewrite of
/// `client`: possible where the rewrite appends the client's messages one for one after its
/// anchor (`prefix`), so the pair lands byte for byte where the provider's cache has it. A
/// pair before the anchor (the rewrite was rebuilt since) is not put back. The number of
/// messages inserted.
pub fn replay(
    sent: &mut Vec<Message>,
    client: &[Message],
    prefix: Option<Appended>,
    marks: &[Mark],
) -> usize {
    let n = client.len();
    let (anchor, appended) = prefix.map_or((n, 0), |p| (p.anchor_messages, p.appended_messages));
    if anchor + appended != n || appended > sent.len() {
        return 0;
    }
    let mut inserted = 0;
    let mut marks: Vec<&Mark> = marks
        .iter()
        .filter(|m| anchor <= m.at && m.at <= n && m.answered_after(client))
        .collect();
    marks.sort_by_key(|m| m.at);
    for mark in marks {
        // The call as it was sent; its answers read again from the client's messages.
        let recalled = answer(mark.call.tool_calls().to_vec(), |h| original(client, h));
        let at = spot(sent, n - mark.at);
        let pair: Vec<Message> = std::iter::once(mark.call.clone())
            .chain(results(&recalled))
            .collect();
        inserted += pair.len();
        sent.splice(at..at, pair);
    }
    inserted
}

/// Where a pair goes in `sent`, counted from the end: before the last `since` of the client's
/// messages, and the tool definitions placed among them (`inline`: a system message, or a
/// call and its result).
fn spot(sent: &[Message], since: usize) -> usize {
    let mut at = sent.len();
    let mut seen = 0;
    while at > 0 && seen < since {
        at -= 1;
        if !inline::is_definition(&sent[at]) {
            seen += 1;
        }
    }
    while at > 0 && inline::is_definition(&sent[at - 1]) {
        at -= 1;
    }
    at
}

/// The original text of the tool result whose handle is `handle`, among `messages`.
pub fn original(messages: &[Message], handle: &str) -> Option<String> {
    result_texts(messages)
        .into_iter()
        .find(|text| handle_of(text) == handle)
        .map(Cow::into_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool_message(text: &str) -> Message {
        let mut m = Message::text(Role::Tool, text);
        m.tool_call_id = Nullable::Value("call_1".into());
        m
    }

    fn call(arguments: &str) -> ToolCall {
        serde_json::from_value(serde_json::json!({
            "id": "call_r", "type": "function",
            "function": {"name": TOOL_NAME, "arguments": arguments}
        }))
        .expect("a tool call")
    }

    #[test]
    fn a_handle_is_stable_and_short() {
        let handle = handle_of("{\"order_id\": \"#W1\"}");
        assert_eq!(handle, handle_of("{\"order_id\": \"#W1\"}"));
        assert_ne!(handle, handle_of("{\"order_id\": \"#W2\"}"));
        assert!(handle.starts_with("rc-") && handle.len() == 11, "{handle}");
    }

    #[test]
    fn the_tool_is_offered_once_and_only_with_tools() {
        let mut request: ChatRequest = serde_json::from_value(serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "get_order"}}]
        }))
        .expect("a request");
        let client = request.tools.get().cloned().unwrap_or_default();
        assert!(can_offer(&request, &client));
        offer(&mut request);
        offer(&mut request);
        let tools = request.tools.get().cloned().unwrap_or_default();
        assert_eq!(tools.len(), 2);
        assert!(offered(&tools));
        // A client tool of that name: not offered.
        assert!(!can_offer(&request, &tools));
        let mut plain: ChatRequest = serde_json::from_value(serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}]
        }))
        .expect("a request");
        assert!(!can_offer(&plain, &[]));
        offer(&mut plain);
        assert!(plain.tools.get().is_none());
    }

    #[test]
    fn a_recall_is_answered_with_the_original_or_says_it_is_unknown() {
        let original = "{\"rows\": [[\"29.1\", 1996]]}";
        let handle = handle_of(original);
        let sent = vec![tool_message(&format!("[cleared; recall {handle}]"))];
        assert_eq!(named_handles(&sent), vec![handle.clone()]);
        let client = [tool_message("other"), tool_message(original)];
        let find = |h: &str| self::original(&client, h);
        let recalled = answer(
            vec![
                call(&format!("{{\"handle\": \"{handle}\"}}")),
                call("{\"handle\": \"rc-00000000\"}"),
                call("{}"),
            ],
            find,
        );
        assert_eq!(recalled[0].text, original);
        assert!(recalled[0].found);
        assert!(!recalled[1].found);
        assert!(
            recalled[1].text.contains("rc-00000000"),
            "{}",
            recalled[1].text
        );
        assert!(!recalled[2].found && recalled[2].handle.is_none());
        let pair = pair(&recalled[..1]);
        assert_eq!(pair.len(), 2);
        assert_eq!(
            pair[1].tool_call_id.get().map(|id| id.as_str()),
            Some("call_r")
        );
    }

    #[test]
    fn a_recall_pair_is_put_back_where_the_re_ask_put_it() {
        let original = "{\"rows\": [[\"29.1\", 1996]]}";
        let handle = handle_of(original);
        let client = vec![
            Message::text(Role::User, "q"),
            tool_message(original),
            Message::text(Role::User, "and?"),
        ];
        let recalled = answer(vec![call(&format!("{{\"handle\": \"{handle}\"}}"))], |_| {
            Some(original.to_owned())
        });
        // The re-ask was the first three messages, and the pair after them.
        let mark = Mark::of(3, history_digest(&client), &recalled);
        let mut reasked = vec![
            client[0].clone(),
            tool_message("[cleared]"),
            client[2].clone(),
        ];
        reasked.extend(pair(&recalled));
        // The next request: the answer and a question appended after the same anchor.
        let mut next = client.clone();
        next.extend([
            Message::text(Role::Assistant, "29.1"),
            Message::text(Role::User, "ok"),
        ]);
        let mut sent = vec![
            client[0].clone(),
            tool_message("[cleared]"),
            client[2].clone(),
        ];
        sent.extend(next[3..].iter().cloned());
        let prefix = Appended {
            anchor_messages: 3,
            appended_messages: 2,
        };
        assert_eq!(
            replay(&mut sent, &next, Some(prefix), std::slice::from_ref(&mark)),
            2
        );
        assert_eq!(sent[..5], reasked[..]);
        assert_eq!(sent[5..], next[3..]);
        // Rebuilt past the mark: not put back.
        let rebuilt = Appended {
            anchor_messages: 5,
            appended_messages: 0,
        };
        let mut whole = next.clone();
        assert_eq!(
            replay(
                &mut whole,
                &next,
                Some(rebuilt),
                std::slice::from_ref(&mark)
            ),
            0
        );
        assert_eq!(whole, next);

        // Another session under the same conversation key, whose first three messages differ:
        // the pair was not answered in its history.
        let mut other = next.clone();
        other[2] = Message::text(Role::User, "and the year?");
        let mut sent_other = vec![
            other[0].clone(),
            tool_message("[cleared]"),
            other[2].clone(),
        ];
        sent_other.extend(other[3..].iter().cloned());
        let unchanged = sent_other.clone();
        assert_eq!(
            replay(
                &mut sent_other,
                &other,
                Some(prefix),
                std::slice::from_ref(&mark)
            ),
            0
        );
        assert_eq!(sent_other, unchanged);
        // A mark an earlier version stored, without a digest, is put back as it was.
        let legacy = Mark {
            history: None,
            ..mark
        };
        let mut sent_legacy = unchanged.clone();
        assert_eq!(replay(&mut sent_legacy, &other, Some(prefix), &[legacy]), 2);
    }

    #[test]
    fn a_recall_pair_goes_before_the_clients_messages_since_and_the_definitions_among_them() {
        let definition = || {
            let tools: Vec<Tool> = serde_json::from_value(serde_json::json!([{"type": "function",
                "function": {"name": "x", "parameters": {"type": "object"}}}]))
            .unwrap_or_default();
            let names = ["x".to_owned()];
            let definitions = crate::pipeline::config::Definitions::InResult;
            inline::messages(&tools, &names, definitions)
        };
        let original = "{\"rows\": [[\"29.1\", 1996]]}";
        let handle = handle_of(original);
        let client = vec![Message::text(Role::User, "q"), tool_message(original)];
        let recalled = answer(vec![call(&format!("{{\"handle\": \"{handle}\"}}"))], |_| {
            Some(original.to_owned())
        });
        let mark = Mark::of(2, history_digest(&client), &recalled);
        // Appended since: a call of `x` (defined before it) and its result.
        let mut called = Message::text(Role::Assistant, "");
        called.tool_calls = Nullable::Value(Arc::new(vec![call("{}")]));
        let mut next = client.clone();
        next.extend([called.clone(), tool_message("done")]);
        let mut sent = client.clone();
        sent.extend(definition());
        sent.extend(next[2..].iter().cloned());
        let prefix = Appended {
            anchor_messages: 2,
            appended_messages: 2,
        };
        assert_eq!(replay(&mut sent, &next, Some(prefix), &[mark]), 2);
        assert_eq!(sent[..2], client[..]);
        assert_eq!(sent[2..4], pair(&recalled)[..]);
        assert_eq!(sent[4..6], definition()[..]);
        assert_eq!(sent[6..], next[2..]);
    }

    #[test]
    fn handles_are_read_from_text() {
        let text = "a; recall rc-1a2b3c4d] and rc-zzzzzzzz, rc-1a2b3c4d5 rc-00ff00ff";
        assert_eq!(
            handles_in(text).collect::<Vec<_>>(),
            ["rc-1a2b3c4d", "rc-00ff00ff"]
        );
    }

    #[test]
    fn a_bare_handle_is_understood() {
        assert_eq!(asked_handle("rc-1a2b3c4d").as_deref(), Some("rc-1a2b3c4d"));
        assert_eq!(
            asked_handle("\"rc-1a2b3c4d\"").as_deref(),
            Some("rc-1a2b3c4d")
        );
        assert_eq!(asked_handle(""), None);
    }
}
