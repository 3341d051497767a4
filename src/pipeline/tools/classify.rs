//! Classification: which categories of the offered tools a turn's words select. Each category
//! is scored by its keywords in the last user message and the assistant text it answers, and,
//! with a lower weight, in the turns before (`context_turns`); and the categories of the tools
//! a turn called (what a conversation keeps as sticky).

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use foldhash::quality::FixedState;

use super::catalog::Catalog;
use crate::openai::{ChatRequest, Message, Role};
use crate::pipeline::config::{PipelineConfig, ToolsConfig};
use crate::pipeline::memo::Memo;
use crate::pipeline::text::content_words;

/// Each category with a positive score: its score and the keywords that matched, by name.
pub(super) type Scores = Vec<(String, (f64, Vec<String>))>;

/// Seed of the memo keys of a turn's scores.
const SCORES_SEED: u64 = 0x7363_6f72_6573_0001;

/// Shortest keyword word that also matches longer words it starts ("cancel" matches
/// "cancellation", "book" matches "booking").
pub(super) const PREFIX_MIN_CHARS: usize = 4;

pub(super) fn word_matches(word: &str, keyword: &str) -> bool {
    word == keyword || (keyword.len() >= PREFIX_MIN_CHARS && word.starts_with(keyword))
}

/// Whether `phrase` occurs in `words` as consecutive words.
pub(super) fn contains_phrase(words: &[String], phrase: &[String]) -> bool {
    !phrase.is_empty()
        && words.windows(phrase.len()).any(|window| {
            window
                .iter()
                .zip(phrase)
                .all(|(word, keyword)| word_matches(word, keyword))
        })
}

/// The end of a text (where an assistant puts its question), at most `chars` characters.
pub(super) fn last_chars(text: &str, chars: usize) -> &str {
    let start = text
        .char_indices()
        .rev()
        .nth(chars.saturating_sub(1))
        .map_or(0, |(i, _)| i);
    &text[start..]
}

/// Index of the current turn's user message.
pub(super) fn current_turn_start(messages: &[Message]) -> usize {
    messages
        .iter()
        .rposition(|m| m.role == Role::User)
        .unwrap_or(0)
}

/// The texts read as context: the turns before the current one, at most `turns` of them, the
/// first `chars` characters of each user and assistant message.
pub(super) fn context_words(messages: &[Message], turns: usize, chars: usize) -> Vec<Vec<String>> {
    let current = current_turn_start(messages);
    let from = context_start(messages, current, turns);
    messages[from..current]
        .iter()
        .filter(|m| matches!(m.role, Role::User | Role::Assistant))
        .map(|m| {
            let text: String = m.content_text().chars().take(chars).collect();
            content_words(&text)
        })
        .filter(|w| !w.is_empty())
        .collect()
}

/// Where the context of the turn starting at `current` starts: the `turns`-th user message
/// before it.
fn context_start(messages: &[Message], current: usize, turns: usize) -> usize {
    let starts: Vec<usize> = messages[..current]
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == Role::User)
        .map(|(i, _)| i)
        .collect();
    starts
        .len()
        .checked_sub(turns)
        .map_or(0, |i| starts.get(i).copied().unwrap_or(0))
}

/// Words sorted, so that a one-word keyword (most are) is looked up instead of compared with
/// every word of the turns.
struct SortedWords<'a>(Vec<&'a str>);

impl<'a> SortedWords<'a> {
    fn of(lists: impl IntoIterator<Item = &'a [String]>) -> SortedWords<'a> {
        let mut words: Vec<&str> = lists.into_iter().flatten().map(String::as_str).collect();
        words.sort_unstable();
        words.dedup();
        SortedWords(words)
    }

    /// Whether a word matches `keyword` (`word_matches`): a word equal to it or starting with it
    /// sorts first among those at or after it.
    fn has(&self, keyword: &str) -> bool {
        let at = self.0.partition_point(|word| *word < keyword);
        self.0
            .get(at)
            .is_some_and(|word| word_matches(word, keyword))
    }
}

/// The score and matched keywords of every category with a positive score.
pub(super) fn score(
    catalog: &Catalog,
    current: &[String],
    context: &[Vec<String>],
    weight: f64,
) -> BTreeMap<String, (f64, Vec<String>)> {
    let mut scores = BTreeMap::new();
    let current_sorted = SortedWords::of([current]);
    let context_sorted = SortedWords::of(context.iter().map(Vec::as_slice));
    for category in &catalog.categories {
        let mut total = 0.0;
        let mut matched = Vec::new();
        for keyword in &category.keywords {
            let phrase = &keyword.words;
            let in_context = || match phrase.as_slice() {
                [word] => context_sorted.has(word),
                _ => context.iter().any(|words| contains_phrase(words, phrase)),
            };
            let in_current = match phrase.as_slice() {
                [word] => current_sorted.has(word),
                _ => contains_phrase(current, phrase),
            };
            if in_current {
                total += keyword.weight;
                matched.push(phrase.join(" "));
            } else if in_context() {
                total += weight * keyword.weight;
                matched.push(format!("{} (context)", phrase.join(" ")));
            }
        }
        if total > 0.0 {
            scores.insert(category.name.clone(), (total, matched));
        }
    }
    scores
}

/// The categories scores for the last user message of `messages` (with the assistant text it
/// answers) and the turns before it as context. Memoized by the messages read (the context
/// turns and the current one), so the stages' re-runs and a conversation's points score each
/// turn once.
pub(super) fn turn_scores(
    catalog: &Catalog,
    messages: &[Message],
    config: &ToolsConfig,
    memo: &Memo,
) -> Arc<Scores> {
    let start = current_turn_start(messages);
    let from = context_start(messages, start, config.context_turns);
    let mut hasher = FixedState::with_seed(SCORES_SEED).build_hasher();
    catalog.key.hash(&mut hasher);
    config.context_turns.hash(&mut hasher);
    config.context_chars.hash(&mut hasher);
    config.context_weight.to_bits().hash(&mut hasher);
    // What scoring reads of these messages: their roles, and the text of users and
    // assistants (tool results, often the longest, are not read).
    for message in &messages[from..messages.len().min(start + 1)] {
        message.role.hash(&mut hasher);
        if matches!(message.role, Role::User | Role::Assistant) {
            message.content.get().map(|c| c.text()).hash(&mut hasher);
        }
    }
    memo.value(hasher.finish(), || scores_of(catalog, messages, config))
}

fn scores_of(catalog: &Catalog, messages: &[Message], config: &ToolsConfig) -> Scores {
    let start = current_turn_start(messages);
    // The current exchange: the last user message and the assistant text it answers
    // ("Could you give me your user id?" → "mia_li_3668").
    let mut current: Vec<String> = messages
        .get(start)
        .filter(|m| m.role == Role::User)
        .map(|m| content_words(&m.content_text()))
        .unwrap_or_default();
    if let Some(asked) = messages[..start]
        .iter()
        .rev()
        .take_while(|m| m.role != Role::User)
        .find(|m| m.role == Role::Assistant && !m.content_text().trim().is_empty())
    {
        current.extend(content_words(last_chars(
            &asked.content_text(),
            config.context_chars,
        )));
    }
    let context = context_words(messages, config.context_turns, config.context_chars);
    score(catalog, &current, &context, config.context_weight)
        .into_iter()
        .collect()
}

pub(super) fn matched_of(
    scores: &[(String, (f64, Vec<String>))],
    config: &ToolsConfig,
) -> Vec<String> {
    scores
        .iter()
        .filter(|(_, (s, _))| *s >= config.min_score)
        .map(|(name, _)| name.clone())
        .collect()
}

/// The categories of the tools called in the last completed turn (the one before the current
/// user message): the sticky categories a client that sends its whole history carries itself.
pub fn previous_turn_categories(
    request: &ChatRequest,
    config: &PipelineConfig,
    memo: &Memo,
) -> Vec<String> {
    let messages = &request.messages;
    let current = current_turn_start(messages);
    let previous = messages[..current]
        .iter()
        .rposition(|m| m.role == Role::User)
        .unwrap_or(0);
    let used: Vec<String> = messages[previous..current]
        .iter()
        .flat_map(|m| m.tool_calls().iter().map(|c| c.function.name.clone()))
        .collect();
    categories_of(request, config, memo, &used)
}

/// The names of the tools called in the current turn (after the last user message).
pub fn current_turn_calls(request: &ChatRequest) -> Vec<String> {
    let messages = &request.messages;
    messages[current_turn_start(messages)..]
        .iter()
        .flat_map(|m| m.tool_calls().iter().map(|c| c.function.name.clone()))
        .collect()
}

/// The categories of the named tools among the request's offered tools (what a conversation
/// keeps as sticky after a tool-using turn).
pub fn categories_of(
    request: &ChatRequest,
    config: &PipelineConfig,
    memo: &Memo,
    used: &[String],
) -> Vec<String> {
    let Some(tools) = request.tools.get() else {
        return Vec::new();
    };
    let catalog = Catalog::memoized(tools, &config.tools, memo);
    let mut categories: BTreeSet<String> = BTreeSet::new();
    for name in used {
        categories.extend(catalog.categories_of(name).map(str::to_owned));
    }
    categories.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn a_sorted_lookup_matches_as_a_pass_over_every_word(
            words in proptest::collection::vec("[ab]{1,6}", 0..12),
            keyword in "[ab]{1,6}",
        ) {
            let sorted = SortedWords::of([words.as_slice()]);
            prop_assert_eq!(
                sorted.has(&keyword),
                words.iter().any(|w| word_matches(w, &keyword))
            );
        }
    }
}
