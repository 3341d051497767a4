//! The working set (ARCHITECTURE.md, principle 8): what the next answer is about to use, which no window
//! or budget step may remove. It is the last user message, the assistant message it answers
//! (with that message's tool results), and the agent's latest `recent_tool_steps` tool calls
//! after the last user message, with their results, whole.
//!
//! An autonomous agent's conversation is often one task followed by dozens of tool calls: only
//! the latest steps of that loop are in the working set; older ones are history like any other.

use std::ops::Range;

use super::tools::inline;
use crate::openai::{Message, Role};

/// Indices into a request's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkingSet {
    /// The last user message.
    pub last_user: Option<usize>,
    /// The assistant message just before the last user message, and its tool results.
    pub answered: Option<Range<usize>>,
    /// Every message from here to the end: the latest tool steps of the current loop (the
    /// end of the messages when there are none).
    pub recent_from: usize,
}

impl WorkingSet {
    pub fn of(messages: &[Message], recent_tool_steps: usize) -> WorkingSet {
        let last_user = messages.iter().rposition(|m| m.role == Role::User);
        let answered = last_user.and_then(|user| {
            let start = messages[..user]
                .iter()
                .rposition(|m| m.role == Role::Assistant)?;
            // Only tool results may stand between it and the user message.
            messages[start + 1..user]
                .iter()
                .all(|m| matches!(m.role, Role::Tool | Role::Function))
                .then_some(start..user)
        });
        let loop_start = last_user.map_or(0, |u| u + 1);
        let mut recent_from = messages.len();
        let mut calls = 0;
        if recent_tool_steps > 0 {
            for index in (loop_start..messages.len()).rev() {
                let message = &messages[index];
                if message.role == Role::User {
                    break;
                }
                recent_from = index;
                // Text-only messages and instructions in the loop are kept, but only calls count
                // (not those that place a definition, `in_result`).
                if !inline::is_definition_call(message) {
                    calls += message.tool_calls().len();
                }
                if calls >= recent_tool_steps {
                    break;
                }
            }
        }
        // Results at the very end whose call is older than the window belong to that call.
        while recent_from < messages.len()
            && recent_from > loop_start
            && matches!(messages[recent_from].role, Role::Tool | Role::Function)
        {
            recent_from -= 1;
        }
        WorkingSet {
            last_user,
            answered,
            recent_from,
        }
    }

    pub fn contains(&self, index: usize) -> bool {
        Some(index) == self.last_user
            || self.answered.as_ref().is_some_and(|r| r.contains(&index))
            || index >= self.recent_from
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn messages(value: serde_json::Value) -> Vec<Message> {
        serde_json::from_value(value).unwrap()
    }

    fn call(id: &str) -> serde_json::Value {
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]})
    }

    fn result(id: &str) -> serde_json::Value {
        json!({"role": "tool", "tool_call_id": id, "content": "r"})
    }

    #[test]
    fn the_answered_proposal_and_the_user_reply() {
        let all = messages(json!([
            {"role": "system", "content": "s"},
            {"role": "user", "content": "a"},
            call("1"), result("1"),
            {"role": "assistant", "content": "Shall I?"},
            {"role": "user", "content": "yes"}
        ]));
        let ws = WorkingSet::of(&all, 4);
        assert_eq!(ws.last_user, Some(5));
        assert_eq!(ws.answered, Some(4..5));
        assert_eq!(ws.recent_from, 6);
        assert!(!ws.contains(3) && ws.contains(4) && ws.contains(5));
    }

    #[test]
    fn only_the_latest_steps_of_a_long_loop() {
        let mut list = vec![json!({"role": "user", "content": "task"})];
        for i in 0..10 {
            list.push(call(&i.to_string()));
            list.push(result(&i.to_string()));
        }
        let all = messages(json!(list));
        let ws = WorkingSet::of(&all, 4);
        assert_eq!(ws.answered, None);
        // The last 4 calls: messages 13..21.
        assert_eq!(ws.recent_from, 13);
        assert!(ws.contains(0) && !ws.contains(12) && ws.contains(13));
    }

    #[test]
    fn only_calls_count_and_instructions_do_not_end_the_loop() {
        let all = messages(json!([
            {"role": "user", "content": "task"},
            call("1"), result("1"),
            call("2"), result("2"),
            {"role": "system", "content": "reminder"},
            {"role": "assistant", "content": "checking…"},
            call("3"), result("3")
        ]));
        assert_eq!(WorkingSet::of(&all, 3).recent_from, 1);
        assert_eq!(WorkingSet::of(&all, 2).recent_from, 3);
    }

    #[test]
    fn a_multi_call_message_is_never_split() {
        let all = messages(json!([
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            result("a"), result("b"), result("c"),
            call("d"), result("d")
        ]));
        assert_eq!(WorkingSet::of(&all, 2).recent_from, 1);
        assert_eq!(WorkingSet::of(&all, 1).recent_from, 5);
    }
}
