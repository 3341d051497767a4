//! Turns of a conversation and the lexical signals read from them: continuity and topic shifts.

use std::collections::HashMap;

use crate::openai::{Message, Role};
use crate::pipeline::config::WindowConfig;
use crate::pipeline::stage::StageCx;
use crate::pipeline::text::{bag, content_words, cosine, normalize};

/// A user message and everything up to the next one (the first turn may have no user message).
pub struct Turn<'a> {
    pub messages: &'a [Message],
    /// Index of its first message in the request.
    pub start: usize,
}

impl Turn<'_> {
    pub fn user(&self) -> Option<&Message> {
        self.messages.first().filter(|m| m.role == Role::User)
    }

    pub fn user_text(&self) -> String {
        self.user()
            .and_then(|m| m.content.get())
            .map(|c| c.text().into_owned())
            .unwrap_or_default()
    }

    pub fn instructions(&self) -> impl Iterator<Item = &Message> {
        self.messages
            .iter()
            .filter(|m| matches!(m.role, Role::System | Role::Developer))
    }

    /// Tokens of the turn once compaction has run: large tool results count at most the
    /// compaction threshold.
    pub fn tokens_after_compaction(&self, cx: &StageCx<'_>) -> usize {
        self.messages
            .iter()
            .map(|m| {
                let tokens = cx.counter.message(m);
                if matches!(m.role, Role::Tool | Role::Function) && cx.config.compact.enabled {
                    tokens.min(cx.params.tool_result_max_tokens + 8)
                } else {
                    tokens
                }
            })
            .sum()
    }
}

/// Leading instruction messages, then the turns.
pub fn split_turns(messages: &[Message]) -> (&[Message], Vec<Turn<'_>>) {
    let head_len = messages
        .iter()
        .take_while(|m| matches!(m.role, Role::System | Role::Developer))
        .count();
    let (head, rest) = messages.split_at(head_len);
    let mut turns = Vec::new();
    let mut start = 0;
    for (i, message) in rest.iter().enumerate() {
        if message.role == Role::User && i > start {
            turns.push(Turn {
                messages: &rest[start..i],
                start: head_len + start,
            });
            start = i;
        }
    }
    if start < rest.len() {
        turns.push(Turn {
            messages: &rest[start..],
            start: head_len + start,
        });
    }
    (head, turns)
}

/// Mean similarity of the last user message to the one before, and that one to its
/// predecessor (the similarity of the last 2). `None` with fewer than 2 pairs.
pub fn continuity(turns: &[Turn<'_>]) -> Option<f64> {
    let users: Vec<String> = turns
        .iter()
        .filter(|t| t.user().is_some())
        .map(Turn::user_text)
        .collect();
    if users.len() < 3 {
        return None;
    }
    let bags: Vec<_> = users[users.len() - 3..].iter().map(|t| bag(t)).collect();
    Some((cosine(&bags[2], &bags[1]) + cosine(&bags[1], &bags[0])) / 2.0)
}

/// Phrases that open a new topic, folded (no accents, lowercase).
const SHIFT_PHRASES: &[&str] = &[
    "otra cosa",
    "cambiando de tema",
    "cambiemos de tema",
    "te queria preguntar sobre",
    "dejando eso de lado",
    "nuevo tema",
    "change of topic",
    "changing the subject",
    "change the subject",
    "let's change topic",
    "lets change topic",
    "different topic",
    "new topic",
    "on another note",
    "unrelated question",
    "something else entirely",
];

/// The index of the last turn at or after `from` that starts a new topic: an explicit phrase,
/// or a sharp drop in similarity after a continuous stretch. Turns before `from` are read only
/// as the stretch a drop is measured against, so the cost does not grow with the history.
pub fn last_topic_shift(turns: &[Turn<'_>], from: usize, config: &WindowConfig) -> Option<usize> {
    let mut last = None;
    // The two user messages before each candidate, as (bag, enough content words).
    let mut previous: Vec<(HashMap<String, f64>, bool)> = Vec::new();
    let scan_from = from.saturating_sub(3);
    for (index, turn) in turns.iter().enumerate().skip(scan_from) {
        let Some(_) = turn.user() else { continue };
        let text = turn.user_text();
        let words = content_words(&text).len();
        let current = (bag(&text), words >= 4);
        if index >= from.max(1) {
            let folded = normalize(&text);
            let explicit = SHIFT_PHRASES.iter().any(|p| folded.contains(p));
            let dropped = previous.len() >= 2 && {
                let (a, b) = (&previous[previous.len() - 2], &previous[previous.len() - 1]);
                a.1 && b.1
                    && current.1
                    && cosine(&a.0, &b.0) >= config.continuity_high
                    && cosine(&b.0, &current.0) <= config.topic_shift_similarity
            };
            if explicit || dropped {
                last = Some(index);
            }
        }
        previous.push(current);
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn messages(value: serde_json::Value) -> Vec<Message> {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn turns_start_at_user_messages_and_keep_tool_groups() {
        let all = messages(json!([
            {"role": "system", "content": "s"},
            {"role": "assistant", "content": "Welcome"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "r"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "b"}
        ]));
        let (head, turns) = split_turns(&all);
        assert_eq!(head.len(), 1);
        assert_eq!(
            turns.iter().map(|t| t.messages.len()).collect::<Vec<_>>(),
            vec![1, 4, 1]
        );
        assert!(turns[0].user().is_none());
    }

    #[test]
    fn explicit_phrases_shift_the_topic() {
        let all = messages(json!([
            {"role": "user", "content": "flight to Paris"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "Cambiando de tema, ¿qué tal Python?"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and its typing module?"}
        ]));
        let (_, turns) = split_turns(&all);
        assert_eq!(
            last_topic_shift(&turns, 0, &WindowConfig::default()),
            Some(1)
        );
    }
}
