//! Long listings of names (tools, actions, fields, categories) in a result whose stub must be
//! cut: the names that share words with what the user asked go first, so a catalog of 300
//! actions keeps the dozen the task is about instead of the first forty. Pure.

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::cell::OnceCell;

use serde_json::Value;

use crate::openai::{Message, Role, ToolCall};

/// Items an array needs to count as a listing.
const MIN_LISTING_ITEMS: usize = 8;
/// Longest string read as a name.
const MAX_NAME_CHARS: usize = 64;
/// Words too common to tell two names apart.
const COMMON_WORDS: &[&str] = &[
    "the", "and", "for", "with", "from", "into", "this", "that", "you", "your", "are", "all",
    "not", "any", "can", "has", "have", "was", "will",
];

/// The words of what the user asked before a result, and of the call that produced it. Built
/// from messages that come before the result only, so a stub stays the same on every later
/// turn; read only when a stub must be cut.
#[derive(Debug, Default)]
pub struct TaskWords<'a> {
    before: &'a [Message],
    call: Option<&'a ToolCall>,
    words: OnceCell<HashSet<String>>,
}

impl<'a> TaskWords<'a> {
    pub fn of(before: &'a [Message], call: Option<&'a ToolCall>) -> Self {
        TaskWords {
            before,
            call,
            words: OnceCell::new(),
        }
    }

    fn words(&self) -> &HashSet<String> {
        self.words.get_or_init(|| {
            let mut words = HashSet::new();
            for message in self.before.iter().filter(|m| m.role == Role::User) {
                if let Some(content) = message.content.get() {
                    words.extend(words_of(&content.text()));
                }
            }
            if let Some(call) = self.call {
                words.extend(words_of(&call.function.arguments));
            }
            words
        })
    }

    /// The share of a name's words the task says (0 for a name with no word to tell).
    fn share(&self, name: &str) -> f64 {
        let words = words_of(name);
        if words.is_empty() {
            return 0.0;
        }
        let task = self.words();
        let said = words.iter().filter(|w| task.contains(*w)).count();
        said as f64 / words.len() as f64
    }
}

/// The value with its listings cut to the names that share at least `min_share` of their words
/// with the task, each from the most inclusive: one candidate per share that some name
/// reaches, most names first. None when no listing has a name the task says.
pub(super) fn cut_to_task(value: &Value, task: &TaskWords<'_>) -> Vec<Value> {
    // Each name's share, read once for every cut made.
    let mut shares = Shares::new();
    collect_shares(value, task, &mut shares);
    let mut levels: Vec<f64> = shares.values().copied().filter(|&s| s > 0.0).collect();
    levels.sort_by(|a, b| a.total_cmp(b));
    levels.dedup();
    let cuts = Cut { task, shares };
    levels
        .into_iter()
        .map(|min_share| kept(value, &cuts, min_share))
        .collect()
}

/// The share of each name of a value's listings.
type Shares<'v> = HashMap<&'v str, f64>;

/// What a cut reads: the shares already read, and the task for a name they miss.
struct Cut<'t, 'v> {
    task: &'t TaskWords<'t>,
    shares: Shares<'v>,
}

impl Cut<'_, '_> {
    fn share(&self, name: &str) -> f64 {
        self.shares
            .get(name)
            .copied()
            .unwrap_or_else(|| self.task.share(name))
    }
}

fn collect_shares<'v>(value: &'v Value, task: &TaskWords<'_>, out: &mut Shares<'v>) {
    match value {
        Value::Object(map) => map.values().for_each(|v| collect_shares(v, task, out)),
        Value::Array(items) if is_listing(items) => {
            for name in items.iter().filter_map(Value::as_str) {
                out.entry(name).or_insert_with(|| task.share(name));
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_shares(v, task, out)),
        _ => {}
    }
}

fn kept(value: &Value, cut: &Cut<'_, '_>, min_share: f64) -> Value {
    // A copy cut in place: cloning a map copies its table, collecting one hashes every key.
    let mut kept = value.clone();
    cut_listings(&mut kept, cut, min_share);
    kept
}

fn cut_listings(value: &mut Value, cut: &Cut<'_, '_>, min_share: f64) {
    match value {
        Value::Object(map) => map
            .values_mut()
            .for_each(|v| cut_listings(v, cut, min_share)),
        Value::Array(items) if is_listing(items) => {
            items.retain(|item| item.as_str().is_some_and(|n| cut.share(n) >= min_share));
        }
        Value::Array(items) => items
            .iter_mut()
            .for_each(|v| cut_listings(v, cut, min_share)),
        _ => {}
    }
}

/// Many names and nothing else: no ids or numbers, which a task's words cannot rank.
fn is_listing(items: &[Value]) -> bool {
    items.len() >= MIN_LISTING_ITEMS && items.iter().all(|item| item.as_str().is_some_and(is_name))
}

fn is_name(text: &str) -> bool {
    !text.is_empty()
        && text.chars().count() <= MAX_NAME_CHARS
        && text.chars().any(char::is_alphabetic)
        && text
            .chars()
            .all(|c| c.is_alphabetic() || matches!(c, '_' | '-' | '.' | '/' | ':'))
}

/// Lower-case words of three letters or more, split at punctuation and camelCase, a plural's
/// `s` dropped: `listPullRequests` → list, pull, request.
fn words_of(text: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut previous_lower = false;
    let mut push = |word: &mut String| {
        let mut w = std::mem::take(word);
        if w.len() > 3 && w.ends_with('s') && !w.ends_with("ss") {
            w.pop();
        }
        if w.len() >= 3 && !COMMON_WORDS.contains(&w.as_str()) {
            words.push(w);
        }
    };
    for c in text.chars() {
        if !c.is_alphabetic() {
            push(&mut word);
            previous_lower = false;
            continue;
        }
        if c.is_uppercase() && previous_lower {
            push(&mut word);
        }
        previous_lower = c.is_lowercase();
        word.extend(c.to_lowercase());
    }
    push(&mut word);
    words
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn task(messages: &[Message]) -> TaskWords<'_> {
        TaskWords::of(messages, None)
    }

    fn asked(text: &str) -> [Message; 1] {
        [Message::text(Role::User, text)]
    }

    #[test]
    fn words_split_at_case_and_punctuation_without_plurals() {
        assert_eq!(
            words_of("listPullRequests submit_review for the Labels"),
            ["list", "pull", "request", "submit", "review", "label"]
        );
    }

    #[test]
    fn a_listing_is_cut_to_what_the_task_says_from_the_most_inclusive() {
        let names: Vec<String> = [
            "list_for_org",
            "get_commit",
            "create_commit",
            "submit_review",
        ]
        .into_iter()
        .chain(["delete_hook", "ping_hook", "list_teams", "get_team"])
        .map(str::to_owned)
        .collect();
        let value = json!({"category_actions": {"GITHUB": names}});
        let asked = asked("Create a commit, then list it");
        let cuts = cut_to_task(&value, &task(&asked));
        assert_eq!(
            cuts,
            [
                json!({"category_actions": {"GITHUB": ["list_for_org", "get_commit", "create_commit", "list_teams"]}}),
                json!({"category_actions": {"GITHUB": ["create_commit"]}}),
            ]
        );
    }

    #[test]
    fn ids_and_short_lists_are_never_cut() {
        let ids = json!({"orders": ["#W1", "#W2", "#W3", "#W4", "#W5", "#W6", "#W7", "#W8"]});
        assert!(cut_to_task(&ids, &task(&asked("order W1"))).is_empty());
        let short = json!({"tools": ["get_commit", "create_commit"]});
        assert!(cut_to_task(&short, &task(&asked("commit"))).is_empty());
    }

    #[test]
    fn only_what_came_before_the_result_counts() {
        let messages = [
            Message::text(Role::System, "review everything"),
            Message::text(Role::User, "label the issue"),
        ];
        let words = TaskWords::of(&messages, None);
        assert_eq!(words.share("add_labels"), 0.5);
        assert_eq!(words.share("submit_review"), 0.0);
    }
}
