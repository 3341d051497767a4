//! Key-value summaries of 3-turn segments (structured, never narrative), made
//! without any model: topic and discussed words by frequency, the outcome and decisions copied
//! from the text, and open questions. Identifiers go to the ledger (`ledger.rs`), word for word. Each is at most
//! `segment_max_tokens` tokens, and a segment's summary depends only on its own turns, so it
//! never changes once written (write-once).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, LazyLock};

use regex_automata::meta::Regex;

use serde_json::{Map, Value, json};

use super::turns::Turn;
use crate::openai::{Message, Role};
use crate::pipeline::stage::StageCx;
use crate::pipeline::text::{content_words, normalize, sentences, truncate_words};
use crate::tokens::hash_message;

pub struct Segment {
    pub line: Arc<str>,
}

/// Seed of the memo keys of segment summaries.
const SUMMARY_SEED: u64 = 0x7375_6d6d_6172_7931;

/// Decision markers (English and Spanish, folded).
const DECISION_MARKERS: &[&str] = &[
    "decided",
    "decide to",
    "let's go with",
    "we'll use",
    "i'll use",
    "we will use",
    "chose",
    "agreed",
    "decidi",
    "decidimos",
    "vamos con",
    "elegi",
    "usaremos",
    "quedamos en",
];

/// How many segments `turns` make, counted from the first turn.
pub fn count(turns: &[Turn<'_>], cx: &StageCx<'_>) -> usize {
    turns.len().div_ceil(cx.config.window.segment_turns.max(1))
}

/// Summaries of the last `max` segments of `turns`, oldest first. Segments are counted from
/// the first turn, so a segment's boundaries (and its summary) never move as turns are added;
/// each summary is computed once (see `Memo`).
pub fn latest(turns: &[Turn<'_>], max: usize, cx: &StageCx<'_>) -> Vec<Segment> {
    let size = cx.config.window.segment_turns.max(1);
    let skip = count(turns, cx).saturating_sub(max);
    turns
        .chunks(size)
        .enumerate()
        .skip(skip)
        .map(|(i, chunk)| {
            let first_turn = i * size + 1;
            Segment {
                line: cx.memo.text(summary_key(chunk, first_turn, cx), || {
                    summarize(chunk, first_turn, cx)
                }),
            }
        })
        .collect()
}

/// Everything a summary depends on: its turns, their position, the token limit and encoding.
fn summary_key(turns: &[Turn<'_>], first_turn: usize, cx: &StageCx<'_>) -> u64 {
    let mut hasher = foldhash::quality::FixedState::with_seed(SUMMARY_SEED).build_hasher();
    cx.counter.encoding().hash(&mut hasher);
    (first_turn, cx.config.window.segment_max_tokens).hash(&mut hasher);
    for message in turns.iter().flat_map(|t| t.messages.iter()) {
        hash_message(message, &mut hasher);
    }
    hasher.finish()
}

/// Words ranked by frequency, ties by first appearance, from the content words of texts.
fn ranked_words<'a>(texts: impl Iterator<Item = &'a Vec<String>>) -> Vec<String> {
    let mut counts: HashMap<&str, (usize, usize), foldhash::fast::RandomState> = HashMap::default();
    let mut order = 0;
    for word in texts.flatten() {
        if word.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let entry = counts.entry(word).or_insert((0, order));
        entry.0 += 1;
        order += 1;
    }
    let mut words: Vec<(&str, (usize, usize))> = counts.into_iter().collect();
    words.sort_by(|a, b| b.1.0.cmp(&a.1.0).then(a.1.1.cmp(&b.1.1)));
    words.into_iter().map(|(w, _)| w.to_owned()).collect()
}

/// Whether a folded sentence states a decision: one search for every marker at once (the
/// markers are literal text, see the tests).
fn states_a_decision(folded: &str) -> bool {
    static MARKERS: LazyLock<Option<Regex>> =
        LazyLock::new(|| Regex::new_many(DECISION_MARKERS).ok());
    match &*MARKERS {
        Some(markers) => markers.is_match(folded),
        None => DECISION_MARKERS.iter().any(|m| folded.contains(m)),
    }
}

fn summarize(turns: &[Turn<'_>], first_turn: usize, cx: &StageCx<'_>) -> String {
    let messages: Vec<&Message> = turns.iter().flat_map(|t| t.messages.iter()).collect();
    let user_texts: Vec<String> = messages
        .iter()
        .filter(|m| m.role == Role::User)
        .map(|m| m.content_text())
        .collect();
    let assistant_texts: Vec<String> = messages
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .map(|m| m.content_text())
        .filter(|t| !t.trim().is_empty())
        .collect();
    let tool_names: Vec<String> = messages
        .iter()
        .flat_map(|m| m.tool_calls().iter().map(|c| c.function.name.clone()))
        .fold(Vec::new(), |mut acc, name| {
            if !acc.contains(&name) {
                acc.push(name);
            }
            acc
        });

    let user_words: Vec<Vec<String>> = user_texts.iter().map(|t| content_words(t)).collect();
    let assistant_words: Vec<Vec<String>> =
        assistant_texts.iter().map(|t| content_words(t)).collect();
    let topic: Vec<String> = ranked_words(user_words.iter())
        .into_iter()
        .take(2)
        .collect();
    let mut discussed: Vec<String> = ranked_words(user_words.iter().chain(&assistant_words))
        .into_iter()
        .filter(|w| !topic.contains(w))
        .take(3)
        .collect();
    discussed.extend(tool_names);
    let outcome = outcome(&assistant_texts);
    // A sentence folds to a part of its text's folding: a text with no marker has no sentence
    // that states a decision.
    let decisions: Vec<String> = user_texts
        .iter()
        .chain(assistant_texts.iter())
        .filter(|t| states_a_decision(&normalize(t)))
        .flat_map(|t| sentences(t).into_iter())
        .filter(|s| states_a_decision(&normalize(s)))
        .map(|s| truncate_words(s, 10))
        .take(2)
        .collect();
    let open_questions: Vec<String> = open_questions(turns);
    let last_turn = first_turn + turns.len() - 1;
    let mut fields = Fields {
        turns: if first_turn == last_turn {
            first_turn.to_string()
        } else {
            format!("{first_turn}-{last_turn}")
        },
        topic: topic.join(" "),
        discussed,
        outcome,
        decisions,
        open_questions,
    };
    fields.fit(cx.config.window.segment_max_tokens, cx)
}

/// The outcome of a segment: the first informative sentence of its last assistant answer
/// (or an earlier one), skipping fillers ("Certainly!"), code and table lines.
fn outcome(assistant_texts: &[String]) -> String {
    assistant_texts
        .iter()
        .rev()
        .flat_map(|t| sentences(t))
        .find(|s| !s.contains("```") && !s.starts_with('|') && content_words(s).len() >= 3)
        .map(|s| truncate_words(s, 12))
        .unwrap_or_default()
}

/// Questions left open: the questions of the segment's last message when it asks something, and
/// a last user question that got no textual answer.
fn open_questions(turns: &[Turn<'_>]) -> Vec<String> {
    let Some(last) = turns.last() else {
        return Vec::new();
    };
    let last_text = last.messages.iter().rev().find(|m| {
        matches!(m.role, Role::Assistant | Role::User) && !m.content_text().trim().is_empty()
    });
    last_text
        .map(|m| {
            sentences(&m.content_text())
                .into_iter()
                .filter(|s| s.ends_with('?'))
                .map(|s| truncate_words(s, 12))
                .take(1)
                .collect()
        })
        .unwrap_or_default()
}

struct Fields {
    turns: String,
    topic: String,
    discussed: Vec<String>,
    outcome: String,
    decisions: Vec<String>,
    open_questions: Vec<String>,
}

impl Fields {
    fn render(&self) -> String {
        let mut map = Map::new();
        map.insert("turns".into(), json!(self.turns));
        let mut put = |key: &str, value: Value, empty: bool| {
            if !empty {
                map.insert(key.into(), value);
            }
        };
        put("topic", json!(self.topic), self.topic.is_empty());
        put(
            "discussed",
            json!(self.discussed),
            self.discussed.is_empty(),
        );
        put("outcome", json!(self.outcome), self.outcome.is_empty());
        put(
            "decisions",
            json!(self.decisions),
            self.decisions.is_empty(),
        );
        put(
            "open_questions",
            json!(self.open_questions),
            self.open_questions.is_empty(),
        );
        Value::Object(map).to_string()
    }

    /// Drops detail, least important first, until the line fits `max_tokens`. The first
    /// count gives the line's bytes per token; detail is dropped by that estimate before the
    /// next count, so a line is tokenized two or three times, not once per dropped item.
    fn fit(&mut self, max_tokens: usize, cx: &StageCx<'_>) -> String {
        let mut line = self.render();
        let mut tokens = cx.counter.text(&line);
        while tokens > max_tokens {
            let bytes_per_token = line.len() as f64 / tokens as f64;
            let target_bytes = (max_tokens as f64 * bytes_per_token) as usize;
            loop {
                if !self.drop_detail() {
                    return line;
                }
                line = self.render();
                if line.len() <= target_bytes {
                    break;
                }
            }
            tokens = cx.counter.text(&line);
        }
        line
    }

    /// Drops the least important remaining detail; false when nothing is left to drop.
    fn drop_detail(&mut self) -> bool {
        if self.discussed.len() > 2 {
            self.discussed.pop();
        } else if !self.decisions.is_empty() {
            self.decisions.pop();
        } else if !self.open_questions.is_empty() {
            self.open_questions.pop();
        } else if self.outcome.split_whitespace().count() > 6 {
            self.outcome = truncate_words(self.outcome.trim_end_matches('…'), 6);
        } else if !self.discussed.is_empty() {
            self.discussed.pop();
        } else if !self.outcome.is_empty() {
            self.outcome.clear();
        } else {
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_are_found_as_a_search_for_each_marker_finds_them() {
        // Literal text: no character a pattern would read otherwise.
        for marker in DECISION_MARKERS {
            assert!(
                marker
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || matches!(c, ' ' | '\'')),
                "{marker}"
            );
        }
        let sentences = [
            "we decided to book the later flight",
            "so let's go with the window seat",
            "decidimos cancelar la reserva",
            "nothing was agreed",
            "she chose nothing",
            "we will use the voucher",
            "we will not use it",
            "the deciding factor",
            "",
        ];
        for sentence in sentences {
            assert_eq!(
                states_a_decision(sentence),
                DECISION_MARKERS.iter().any(|m| sentence.contains(m)),
                "{sentence}"
            );
        }
    }
}
