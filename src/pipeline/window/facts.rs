//! Facts the user stated explicitly ("recordá que…", "a partir de ahora…",
//! "decidí…"), taken from turns before they leave the window. Never inferred: only sentences
//! that open with an explicit marker, copied as written. A later fact on the same subject
//! replaces an earlier one; relevant facts and all preferences go to `<user_facts>`.

use std::hash::BuildHasher;

use foldhash::quality::FixedState;

use super::turns::Turn;
use crate::pipeline::memo::Memo;
use crate::pipeline::stage::StageCx;
use crate::pipeline::text::{content_words, normalize, sentences, truncate_words};

#[derive(Debug, Default)]
pub struct Section {
    pub lines: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Domain {
    Work,
    Preferences,
    Decisions,
    Personal,
    Projects,
}

impl Domain {
    fn as_str(self) -> &'static str {
        match self {
            Domain::Work => "work",
            Domain::Preferences => "preferences",
            Domain::Decisions => "decisions",
            Domain::Personal => "personal",
            Domain::Projects => "projects",
        }
    }

    /// Words that put a message in this domain (folded).
    fn keywords(self) -> &'static [&'static str] {
        match self {
            Domain::Work => &[
                "work", "job", "team", "company", "office", "client", "trabajo", "equipo",
                "empresa", "oficina", "cliente",
            ],
            Domain::Projects => &[
                "project",
                "repo",
                "deploy",
                "code",
                "app",
                "release",
                "proyecto",
                "codigo",
                "repositorio",
            ],
            Domain::Decisions => &[
                "decide",
                "decided",
                "decision",
                "chose",
                "plan",
                "decidimos",
                "decidi",
                "decision",
                "plan",
            ],
            Domain::Personal => &[
                "name",
                "family",
                "birthday",
                "live",
                "nombre",
                "familia",
                "cumpleanos",
                "vivo",
            ],
            Domain::Preferences => &[],
        }
    }
}

/// (marker at the start of a sentence, domain, fixed subject). Folded text.
const MARKERS: &[(&str, Option<Domain>, Option<&str>)] = &[
    ("my name is ", Some(Domain::Personal), Some("name")),
    ("call me ", Some(Domain::Personal), Some("name")),
    ("me llamo ", Some(Domain::Personal), Some("name")),
    ("mi nombre es ", Some(Domain::Personal), Some("name")),
    ("i work at ", Some(Domain::Work), Some("workplace")),
    ("i work for ", Some(Domain::Work), Some("workplace")),
    ("i work in ", Some(Domain::Work), Some("workplace")),
    ("i work as ", Some(Domain::Work), Some("role")),
    ("trabajo en ", Some(Domain::Work), Some("workplace")),
    ("trabajo como ", Some(Domain::Work), Some("role")),
    ("i'm working on ", Some(Domain::Projects), None),
    ("i am working on ", Some(Domain::Projects), None),
    ("my project ", Some(Domain::Projects), None),
    ("estoy trabajando en ", Some(Domain::Projects), None),
    ("mi proyecto ", Some(Domain::Projects), None),
    ("i decided ", Some(Domain::Decisions), None),
    ("i've decided ", Some(Domain::Decisions), None),
    ("we decided ", Some(Domain::Decisions), None),
    ("decidi ", Some(Domain::Decisions), None),
    ("decidimos ", Some(Domain::Decisions), None),
    ("from now on", Some(Domain::Preferences), None),
    ("a partir de ahora", Some(Domain::Preferences), None),
    ("de ahora en adelante", Some(Domain::Preferences), None),
    ("i prefer ", Some(Domain::Preferences), None),
    ("prefiero ", Some(Domain::Preferences), None),
    ("always ", Some(Domain::Preferences), None),
    ("siempre ", Some(Domain::Preferences), None),
    ("never ", Some(Domain::Preferences), None),
    ("nunca ", Some(Domain::Preferences), None),
    ("remember that ", None, None),
    ("remember: ", None, None),
    ("recorda que ", None, None),
    ("recuerda que ", None, None),
    ("acordate que ", None, None),
];

#[derive(Debug, Clone)]
struct Fact {
    domain: Domain,
    subject: String,
    text: String,
}

impl crate::bounded::Weigh for Fact {
    fn heap_bytes(&self) -> usize {
        self.subject.capacity() + self.text.capacity()
    }
}

fn domain_of(text: &str) -> Option<Domain> {
    domain_in(&content_words(text))
}

/// The domain whose keywords are among `words` (a text's content words).
fn domain_in(words: &[String]) -> Option<Domain> {
    [
        Domain::Work,
        Domain::Projects,
        Domain::Decisions,
        Domain::Personal,
    ]
    .into_iter()
    .find(|d| d.keywords().iter().any(|k| words.iter().any(|w| w == k)))
}

/// The marker a clause opens with, after "remember that"-style openers are looked through
/// ("remember that I prefer…" is a preference). Returns the domain, fixed subject and the text
/// after the marker.
fn classify(clause: &str) -> Option<(Option<Domain>, Option<&'static str>, &str)> {
    let (marker, domain, subject) = MARKERS.iter().find(|(m, _, _)| clause.starts_with(m))?;
    let rest = clause[marker.len()..].trim_start();
    if domain.is_none()
        && let Some(inner) = classify(rest)
    {
        return Some(inner);
    }
    Some((*domain, *subject, rest))
}

/// Words that may open a clause before its marker ("and from now on…", "por favor recorda…").
const FILLERS: &[&str] = &[
    "please ",
    "also ",
    "and ",
    "so ",
    "oh ",
    "btw ",
    "actually ",
    "ok ",
    "okay ",
    "well ",
    "por favor ",
    "tambien ",
    "y ",
    "bueno ",
    "ah ",
    "ojo ",
];

fn without_fillers(clause: &str) -> &str {
    let mut clause = clause.trim_start_matches(['¡', '¿', '-', '*', ' ', '!']);
    while let Some(rest) = FILLERS.iter().find_map(|f| clause.strip_prefix(f)) {
        clause = rest.trim_start();
    }
    clause
}

/// Seed of the memo keys of one message's facts.
const FACTS_SEED: u64 = 0x6661_6374_7300_0001;

/// The facts of the user messages of `turns`, a later one on the same subject replacing an
/// earlier one. Each message is read once (memoized): a conversation's older turns come back at
/// every request.
fn extract(turns: &[Turn<'_>], memo: &Memo) -> Vec<Fact> {
    let mut facts: Vec<Fact> = Vec::new();
    for turn in turns {
        let text = turn.user_text();
        let key = FixedState::with_seed(FACTS_SEED).hash_one(&*text);
        for fact in memo.value(key, || facts_of(&text)).iter() {
            facts.retain(|f| !(f.domain == fact.domain && f.subject == fact.subject));
            facts.push(fact.clone());
        }
    }
    facts
}

/// The facts one user message states, in order.
fn facts_of(text: &str) -> Vec<Fact> {
    let mut facts = Vec::new();
    for sentence in sentences(text) {
        let folded = normalize(sentence);
        // "Hi, my name is Mia": a marker may open any clause, not only the sentence.
        let Some((domain, subject, rest)) = folded
            .split([',', ';', ':'])
            .map(without_fillers)
            .find_map(classify)
        else {
            continue;
        };
        let domain = domain
            .or_else(|| domain_of(rest))
            .unwrap_or(Domain::Personal);
        let subject = subject
            .map(str::to_owned)
            .or_else(|| content_words(rest).into_iter().next())
            .unwrap_or_default();
        facts.push(Fact {
            domain,
            subject,
            text: truncate_words(sentence, 24),
        });
    }
    facts
}

/// The `<user_facts>` lines for the current message: all preferences, facts of its domain, and
/// facts sharing a word with it; newest first within the token cap.
pub fn section(older: &[Turn<'_>], current: &str, cx: &StageCx<'_>) -> Section {
    let facts = extract(older, cx.memo);
    if facts.is_empty() {
        return Section { lines: Vec::new() };
    }
    let current_words = content_words(current);
    let current_domain = domain_in(&current_words);
    let relevant = |f: &Fact| {
        f.domain == Domain::Preferences
            || Some(f.domain) == current_domain
            || content_words(&f.text)
                .iter()
                .any(|w| current_words.contains(w))
    };
    let mut chosen: Vec<&Fact> = facts
        .iter()
        .filter(|f| f.domain == Domain::Preferences)
        .collect();
    chosen.extend(
        facts
            .iter()
            .rev()
            .filter(|f| f.domain != Domain::Preferences && relevant(f)),
    );
    let mut lines = Vec::new();
    let mut tokens = 0;
    for fact in chosen {
        let line = format!("- [{}] {}", fact.domain.as_str(), fact.text);
        let t = cx.counter.text(&line) + 1;
        if tokens + t > cx.config.facts.max_tokens {
            continue;
        }
        tokens += t;
        lines.push(line);
    }
    Section { lines }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::Message;
    use crate::pipeline::window::turns::split_turns;
    use serde_json::json;

    fn facts_of(texts: &[&str]) -> Vec<(String, String, String)> {
        let messages: Vec<Message> = texts
            .iter()
            .flat_map(|t| {
                [
                    json!({"role": "user", "content": t}),
                    json!({"role": "assistant", "content": "ok"}),
                ]
            })
            .map(|v| serde_json::from_value(v).unwrap())
            .collect();
        let (_, turns) = split_turns(&messages);
        extract(&turns, &Memo::default())
            .into_iter()
            .map(|f| (f.domain.as_str().to_owned(), f.subject, f.text))
            .collect()
    }

    #[test]
    fn markers_open_any_clause_and_look_through_remember() {
        let facts = facts_of(&[
            "Hi, my name is Mia Li.",
            "Please remember that I prefer aisle seats.",
            "Oh and by the way, actually my name is Noah.",
        ]);
        assert_eq!(
            facts,
            vec![
                (
                    "preferences".into(),
                    "aisle".into(),
                    "Please remember that I prefer aisle seats.".into()
                ),
                (
                    "personal".into(),
                    "name".into(),
                    "Oh and by the way, actually my name is Noah.".into()
                ),
            ]
        );
    }

    #[test]
    fn explicit_statements_become_facts_and_later_ones_replace_earlier() {
        let messages: Vec<Message> = serde_json::from_value(json!([
            {"role": "user", "content": "Hi! My name is Ana. I work at Globex on payments."},
            {"role": "assistant", "content": "Nice to meet you."},
            {"role": "user", "content": "From now on answer in Spanish. Remember that the deploy is on Fridays."},
            {"role": "assistant", "content": "Claro."},
            {"role": "user", "content": "Me llamo Ana María. De ahora en adelante respuestas cortas."}
        ]))
        .unwrap();
        let (_, turns) = split_turns(&messages);
        let facts = extract(&turns, &Memo::default());
        let summary: Vec<(&str, &str, &str)> = facts
            .iter()
            .map(|f| (f.domain.as_str(), f.subject.as_str(), f.text.as_str()))
            .collect();
        assert_eq!(
            summary,
            vec![
                ("work", "workplace", "I work at Globex on payments."),
                ("preferences", "answer", "From now on answer in Spanish."),
                (
                    "projects",
                    "deploy",
                    "Remember that the deploy is on Fridays."
                ),
                ("personal", "name", "Me llamo Ana María."),
                (
                    "preferences",
                    "respuesta",
                    "De ahora en adelante respuestas cortas."
                ),
            ]
        );
    }
}
