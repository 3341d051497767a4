//! Turns of a conversation and the lexical signals read from them: continuity and topic shifts.

use std::hash::BuildHasher;
use std::sync::Arc;

use foldhash::quality::FixedState;

use crate::bounded::Weigh;
use crate::openai::{Message, Role};
use crate::pipeline::config::WindowConfig;
use crate::pipeline::memo::Memo;
use crate::pipeline::stage::StageCx;
use crate::pipeline::text::{Bag, bag_of, content_words, cosine, normalize};

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
pub fn continuity(turns: &[Turn<'_>], memo: &Memo) -> Option<f64> {
    let mut users = turns.iter().rev().filter(|t| t.user().is_some());
    let mut last = || {
        users
            .next()
            .map(|t| UserSignals::memoized(&t.user_text(), memo))
    };
    let (Some(c), Some(b), Some(a)) = (last(), last(), last()) else {
        return None;
    };
    Some((cosine(&c.bag, &b.bag) + cosine(&b.bag, &a.bag)) / 2.0)
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
pub fn last_topic_shift(
    turns: &[Turn<'_>],
    from: usize,
    config: &WindowConfig,
    memo: &Memo,
) -> Option<usize> {
    let mut last = None;
    // The two user messages before each candidate.
    let mut previous: Vec<Arc<UserSignals>> = Vec::new();
    let scan_from = from.saturating_sub(3);
    for (index, turn) in turns.iter().enumerate().skip(scan_from) {
        let Some(_) = turn.user() else { continue };
        let current = UserSignals::memoized(&turn.user_text(), memo);
        if index >= from.max(1) {
            let dropped = previous.len() >= 2 && {
                let (a, b) = (&previous[previous.len() - 2], &previous[previous.len() - 1]);
                a.enough
                    && b.enough
                    && current.enough
                    && cosine(&a.bag, &b.bag) >= config.continuity_high
                    && cosine(&b.bag, &current.bag) <= config.topic_shift_similarity
            };
            if current.explicit || dropped {
                last = Some(index);
            }
        }
        previous.push(current);
    }
    last
}

/// What a user message says of topic shifts, once per text (a conversation's requests and the
/// budget's re-runs read the same messages again).
struct UserSignals {
    bag: Bag,
    /// At least 4 content words: enough to measure a drop against.
    enough: bool,
    /// It says the topic changes ("another question", …).
    explicit: bool,
}

/// Seed of the memo keys of a user message's signals.
const SIGNALS_SEED: u64 = 0x7369_676e_616c_0001;

impl UserSignals {
    fn memoized(text: &str, memo: &Memo) -> Arc<UserSignals> {
        let key = FixedState::with_seed(SIGNALS_SEED).hash_one(text);
        memo.value(key, || {
            let folded = normalize(text);
            let words = content_words(text);
            UserSignals {
                enough: words.len() >= 4,
                bag: bag_of(words),
                explicit: SHIFT_PHRASES.iter().any(|p| folded.contains(p)),
            }
        })
    }
}

impl Weigh for UserSignals {
    fn heap_bytes(&self) -> usize {
        self.bag
            .keys()
            .map(|word| word.capacity() + std::mem::size_of::<(String, f64)>() + 8)
            .sum()
    }
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
            last_topic_shift(&turns, 0, &WindowConfig::default(), &Memo::default()),
            Some(1)
        );
    }
}
