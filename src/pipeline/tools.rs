//! `tools`: only the tools the current request can need.
//!
//! Each category of the offered tools (see `catalog`) is scored by its keywords in the last
//! user message and the assistant text it answers, plus, with a lower weight, in the recent
//! context (the last turns, the first
//! characters of each message). Selected categories keep their tools. When nothing matches,
//! the conversation's sticky categories (those of its last tool-using turn, from the store) are
//! used, else the `on_no_match` policy. Never removed: tools named by `tool_choice`, tools
//! called in the history that is sent, `tools.always`, single-word utilities (`think`,
//! `calculate`), and, mid tool-loop, the categories already used in the current turn.

pub(crate) mod catalog;
pub mod stubs;

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

pub use catalog::Catalog;

use super::config::{LeftOut, OnNoMatch};
use super::report::{CategoryScore, Classified, StageDetails, StageName, ToolsDetails};
use super::text::content_words;
use super::{Memo, Stage, StageCx, StageOutput};
use crate::glob::glob_match;
use crate::openai::{ChatRequest, Message, Nullable, Role, Tool};
use catalog::tool_name;
use stubs::ToolForm;

pub struct ToolsStage;

/// Why the stage kept what it kept (also the metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Match,
    Sticky,
    NoMatchDrop,
    NoMatchKeep,
    /// Nothing matched: every tool not protected goes as a stub.
    NoMatchStub,
    /// Nothing matched; only protected tools (tool_choice, history, always, tool loop) stay.
    Protected,
    /// The tool definitions total less than `min_tool_tokens`: sent whole.
    SmallBlock,
}

impl Reason {
    pub const ALL: [Reason; 7] = [
        Reason::Match,
        Reason::Sticky,
        Reason::NoMatchDrop,
        Reason::NoMatchKeep,
        Reason::NoMatchStub,
        Reason::Protected,
        Reason::SmallBlock,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Match => "match",
            Reason::Sticky => "sticky",
            Reason::NoMatchDrop => "no_match_drop",
            Reason::NoMatchKeep => "no_match_keep",
            Reason::NoMatchStub => "no_match_stub",
            Reason::Protected => "protected",
            Reason::SmallBlock => "small_block",
        }
    }
}

fn message_text(message: &Message) -> String {
    message
        .content
        .get()
        .map(|c| c.text().into_owned())
        .unwrap_or_default()
}

/// Shortest keyword word that also matches longer words it starts ("cancel" matches
/// "cancellation", "book" matches "booking").
const PREFIX_MIN_CHARS: usize = 4;

fn word_matches(word: &str, keyword: &str) -> bool {
    word == keyword || (keyword.len() >= PREFIX_MIN_CHARS && word.starts_with(keyword))
}

/// Whether `phrase` occurs in `words` as consecutive words.
fn contains_phrase(words: &[String], phrase: &[String]) -> bool {
    !phrase.is_empty()
        && words.windows(phrase.len()).any(|window| {
            window
                .iter()
                .zip(phrase)
                .all(|(word, keyword)| word_matches(word, keyword))
        })
}

/// The end of a text (where an assistant puts its question), at most `chars` characters.
fn last_chars(text: &str, chars: usize) -> &str {
    let start = text
        .char_indices()
        .rev()
        .nth(chars.saturating_sub(1))
        .map_or(0, |(i, _)| i);
    &text[start..]
}

/// Index of the current turn's user message.
fn current_turn_start(messages: &[Message]) -> usize {
    messages
        .iter()
        .rposition(|m| m.role == Role::User)
        .unwrap_or(0)
}

/// The texts read as context: the turns before the current one, at most `turns` of them, the
/// first `chars` characters of each user and assistant message.
fn context_words(messages: &[Message], turns: usize, chars: usize) -> Vec<Vec<String>> {
    let current = current_turn_start(messages);
    let starts: Vec<usize> = messages[..current]
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == Role::User)
        .map(|(i, _)| i)
        .collect();
    let from = starts
        .len()
        .checked_sub(turns)
        .map_or(0, |i| starts.get(i).copied().unwrap_or(0));
    messages[from..current]
        .iter()
        .filter(|m| matches!(m.role, Role::User | Role::Assistant))
        .map(|m| {
            let text: String = message_text(m).chars().take(chars).collect();
            content_words(&text)
        })
        .filter(|w| !w.is_empty())
        .collect()
}

/// Tool names named by `tool_choice` (`{"type":"function","function":{"name":…}}`).
fn chosen_tool(request: &ChatRequest) -> Option<String> {
    request
        .tool_choice
        .get()
        .and_then(|c| c.get("function"))
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// The score and matched keywords of every category with a positive score.
fn score(
    catalog: &Catalog,
    current: &[String],
    context: &[Vec<String>],
    weight: f64,
) -> BTreeMap<String, (f64, Vec<String>)> {
    let mut scores = BTreeMap::new();
    for category in &catalog.categories {
        let mut total = 0.0;
        let mut matched = Vec::new();
        for keyword in &category.keywords {
            let phrase = &keyword.words;
            if contains_phrase(current, phrase) {
                total += keyword.weight;
                matched.push(phrase.join(" "));
            } else if context.iter().any(|words| contains_phrase(words, phrase)) {
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

impl Stage for ToolsStage {
    fn name(&self) -> StageName {
        StageName::Tools
    }

    fn enabled(&self, config: &super::PipelineConfig) -> bool {
        config.tools.enabled
    }

    fn apply(&self, request: &ChatRequest, cx: &StageCx<'_>) -> StageOutput {
        let Some(tools) = request.tools.get().filter(|t| !t.is_empty()) else {
            return StageOutput::unchanged(StageDetails::Tools(ToolsDetails::offered(0)));
        };
        if let Some(choice) = demanded_call(request) {
            return StageOutput::unchanged(StageDetails::Tools(ToolsDetails {
                tool_choice: Some(choice.clone()),
                ..ToolsDetails::all_sent(tools.len(), Reason::Protected)
            }));
        }
        let config = &cx.config.tools;
        let tool_tokens = cx.counter.tools(tools);
        if is_small_block(tool_tokens, config) {
            return StageOutput::unchanged(StageDetails::Tools(ToolsDetails {
                tool_tokens: Some(tool_tokens),
                ..ToolsDetails::all_sent(tools.len(), Reason::SmallBlock)
            }));
        }
        let catalog = Catalog::memoized(tools, config, cx.memo);
        // Scores read what the client sent; protection reads what is sent on (a call the
        // window removed needs no definition).
        let original = cx.original_messages;
        let scores = turn_scores(&catalog, original, config);
        let matched: Vec<String> = matched_of(&scores, config);
        // The conversation's tool block only grows: what an earlier user turn matched, or a
        // tool the conversation called, stays offered, so the tools sent (the start of the
        // prompt) are the same bytes from turn to turn (the provider's prompt cache), and any
        // replica reaches the same block from the history alone.
        let earlier = earlier_turn_categories(&catalog, original, config, cx.memo);

        // Protected tools and categories.
        let messages = &request.messages;
        let current_start = current_turn_start(messages);
        let mut keep: BTreeSet<String> = BTreeSet::new();
        let mut protected: Vec<String> = Vec::new();
        if let Some(chosen) = chosen_tool(request) {
            protected.push(chosen);
        }
        for message in messages.iter().chain(original) {
            protected.extend(message.tool_calls().iter().map(|c| c.function.name.clone()));
        }
        let mid_loop = messages
            .last()
            .is_some_and(|m| matches!(m.role, Role::Tool | Role::Function));
        let mut loop_categories: BTreeSet<String> = BTreeSet::new();
        if mid_loop {
            for message in &messages[current_start..] {
                for call in message.tool_calls() {
                    loop_categories.extend(
                        catalog
                            .categories_of(&call.function.name)
                            .map(str::to_owned),
                    );
                }
            }
        }
        let names: Vec<&str> = tools.iter().filter_map(tool_name).collect();
        for name in &names {
            let utility = config.keep_single_word_tools && catalog::is_single_word(name);
            if utility
                || protected.iter().any(|p| p == name)
                || config.always.iter().any(|p| glob_match(p, name))
            {
                keep.insert((*name).to_owned());
            }
        }

        let sticky: Vec<String> = cx
            .sticky_categories
            .iter()
            .filter(|s| catalog.categories.iter().any(|c| &c.name == *s))
            .cloned()
            .collect();
        // Earlier turns' categories count as sticky: a follow-up needs them again.
        let mut carried = sticky;
        for category in earlier.iter() {
            if !carried.contains(category) {
                carried.push(category.clone());
            }
        }
        let (mut selected, mut reason) = if !matched.is_empty() {
            let mut selected = matched;
            for category in carried {
                if !selected.contains(&category) {
                    selected.push(category);
                }
            }
            (selected, Reason::Match)
        } else if !carried.is_empty() {
            (carried, Reason::Sticky)
        } else if config.on_no_match == OnNoMatch::KeepAll {
            (
                catalog.categories.iter().map(|c| c.name.clone()).collect(),
                Reason::NoMatchKeep,
            )
        } else if config.on_no_match == OnNoMatch::Stub {
            (Vec::new(), Reason::NoMatchStub)
        } else {
            (Vec::new(), Reason::NoMatchDrop)
        };
        for category in &loop_categories {
            if !selected.contains(category) {
                selected.push(category.clone());
            }
        }
        for category in catalog
            .categories
            .iter()
            .filter(|c| selected.contains(&c.name))
        {
            keep.extend(category.tools.iter().cloned());
        }
        // `drop_all` sends the protected tools only: nothing left out goes as a stub.
        let stubs = config.left_out == LeftOut::Stub && reason != Reason::NoMatchDrop;
        if reason == Reason::NoMatchDrop && !keep.is_empty() {
            reason = Reason::Protected;
        }

        let offered = tools.len();
        // Left-out tools become stubs in place (the block keeps the client's order), unless
        // they are removed. Tools without a function name (other tool types) are always kept.
        let mut forms = BTreeMap::new();
        let mut kept: Vec<Tool> = Vec::with_capacity(offered);
        for tool in tools {
            let Some(name) = tool_name(tool) else {
                kept.push(tool.clone());
                continue;
            };
            let form = if keep.contains(name) {
                kept.push(tool.clone());
                ToolForm::Full
            } else if stubs {
                let max = config.stub_description_tokens;
                kept.push(stubs::stub(tool, max, cx.counter, cx.memo));
                ToolForm::Stub
            } else {
                ToolForm::Removed
            };
            forms.insert(name.to_owned(), form);
        }
        let stubbed = forms.values().filter(|f| **f == ToolForm::Stub).count();
        let scores = scores
            .into_iter()
            .map(|(name, (score, keywords))| (name, CategoryScore { score, keywords }))
            .collect();
        let protected: BTreeSet<String> = protected
            .into_iter()
            .filter(|p| names.contains(&p.as_str()))
            .collect();
        let details = StageDetails::Tools(ToolsDetails {
            sent: Some(kept.len() - stubbed),
            stubs: Some(stubbed),
            reason: Some(reason),
            classifier: Some(Classified {
                forms,
                categories: selected,
                scores,
                sticky: cx.sticky_categories.to_vec(),
                protected: protected.into_iter().collect(),
            }),
            ..ToolsDetails::offered(offered)
        });
        if kept.len() == offered && stubbed == 0 {
            return StageOutput::unchanged(details);
        }
        StageOutput {
            messages: None,
            tools: Some(kept),
            details,
        }
    }
}

/// A `tool_choice` of "required", or a choice among allowed tools: the client demands a tool
/// call, and only the client knows which tools may answer it.
fn demanded_call(request: &ChatRequest) -> Option<&Value> {
    request.tool_choice.get().filter(|choice| {
        choice.as_str() == Some("required")
            || choice.get("type").and_then(Value::as_str) == Some("allowed_tools")
    })
}

/// A small block is sent whole: filtering it saves less than one growth of the block costs
/// where the provider caches prompts (a growth re-bills the whole prompt).
fn is_small_block(tool_tokens: usize, config: &super::config::ToolsConfig) -> bool {
    tool_tokens < config.min_tool_tokens
}

/// Whether the stage sends the client's tools as they are, whatever the messages say: filtering
/// off, no tools, a demanded call, or a small block. Then a conversation's tools never change.
pub fn sends_block_whole(
    request: &ChatRequest,
    config: &super::PipelineConfig,
    counter: &crate::tokens::TokenCounter,
) -> bool {
    let tools = request.tools.get().map_or(&[][..], Vec::as_slice);
    !config.tools.enabled
        || tools.is_empty()
        || demanded_call(request).is_some()
        || is_small_block(counter.tools(tools), &config.tools)
}

/// The categories scores for the last user message of `messages` (with the assistant text it
/// answers) and the turns before it as context.
fn turn_scores(
    catalog: &Catalog,
    messages: &[Message],
    config: &super::config::ToolsConfig,
) -> Vec<(String, (f64, Vec<String>))> {
    let start = current_turn_start(messages);
    // The current exchange: the last user message and the assistant text it answers
    // ("Could you give me your user id?" → "mia_li_3668").
    let mut current: Vec<String> = messages
        .get(start)
        .filter(|m| m.role == Role::User)
        .map(|m| content_words(&message_text(m)))
        .unwrap_or_default();
    if let Some(asked) = messages[..start]
        .iter()
        .rev()
        .take_while(|m| m.role != Role::User)
        .find(|m| m.role == Role::Assistant && !message_text(m).trim().is_empty())
    {
        current.extend(content_words(last_chars(
            &message_text(asked),
            config.context_chars,
        )));
    }
    let context = context_words(messages, config.context_turns, config.context_chars);
    score(catalog, &current, &context, config.context_weight)
        .into_iter()
        .collect()
}

fn matched_of(
    scores: &[(String, (f64, Vec<String>))],
    config: &super::config::ToolsConfig,
) -> Vec<String> {
    scores
        .iter()
        .filter(|(_, (s, _))| *s >= config.min_score)
        .map(|(name, _)| name.clone())
        .collect()
}

/// Seed of the memo keys of one user turn's matched categories, and what turns them into the
/// keys of the union of every turn's up to it.
const TURN_SEED: u64 = 0x7475_726e_0000_0001;
const UNION_SEED: u64 = 0x756e_696f_6e00_0001;

/// The categories earlier user turns of `messages` matched (each scored as it was then, with
/// its own context), and those of every tool the conversation called; each turn is scored once
/// per process (memoized by the conversation up to it).
fn earlier_turn_categories(
    catalog: &Catalog,
    messages: &[Message],
    config: &super::config::ToolsConfig,
    memo: &Memo,
) -> BTreeSet<String> {
    use std::hash::{BuildHasher, Hash, Hasher};
    let current = current_turn_start(messages);
    let mut called = BTreeSet::new();
    let mut hasher = foldhash::quality::FixedState::with_seed(TURN_SEED).build_hasher();
    catalog.key.hash(&mut hasher);
    (config.min_score.to_bits(), config.context_weight.to_bits()).hash(&mut hasher);
    (config.context_turns, config.context_chars).hash(&mut hasher);
    // Each earlier user turn, with a key for the conversation up to it.
    let mut turns: Vec<(usize, u64)> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        crate::tokens::hash_message(message, &mut hasher);
        for call in message.tool_calls() {
            called.extend(
                catalog
                    .categories_of(&call.function.name)
                    .map(str::to_owned),
            );
        }
        if index < current && message.role == Role::User {
            turns.push((index, hasher.clone().finish()));
        }
    }
    // The union up to a turn is memoized too: a conversation's next request starts from the
    // previous one's and scores only its new turn.
    let union_key = |key: u64| key ^ UNION_SEED;
    let resume = turns
        .iter()
        .rposition(|&(_, key)| memo.peek::<BTreeSet<String>>(union_key(key)).is_some());
    let mut found: BTreeSet<String> = resume
        .and_then(|k| memo.peek::<BTreeSet<String>>(union_key(turns[k].1)))
        .map(|union| (*union).clone())
        .unwrap_or_default();
    for &(index, key) in &turns[resume.map_or(0, |k| k + 1)..] {
        let matched = memo.value(key, || {
            matched_of(&turn_scores(catalog, &messages[..=index], config), config)
        });
        found.extend(matched.iter().cloned());
        memo.value(union_key(key), || found.clone());
    }
    found.extend(called);
    found
}

/// The request without tools: `tool_choice` and `parallel_tool_calls` would make it invalid.
pub fn without_tools(request: &mut ChatRequest) {
    request.tools = Nullable::Absent;
    request.tool_choice = Nullable::Absent;
    request.extra.shift_remove("parallel_tool_calls");
}

/// The categories of the tools called in the last completed turn (the one before the current
/// user message): the sticky categories a client that sends its whole history carries itself.
pub fn previous_turn_categories(
    request: &ChatRequest,
    config: &super::PipelineConfig,
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
    config: &super::PipelineConfig,
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
    use serde_json::json;

    use super::*;
    use crate::pipeline::{Env, Memo, PipelineConfig, run};
    use crate::tokens::{Encoding, TokenCounter};

    fn tool(name: &str, description: &str) -> Value {
        json!({"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {}}}})
    }

    fn offered() -> Vec<Value> {
        vec![
            tool("calendar_create_event", "Create a meeting in the calendar."),
            tool("calendar_list_events", "List the meetings of a day."),
            tool("email_send", "Send an email message."),
            tool("email_search", "Search the inbox for messages."),
            tool("weather_forecast", "Weather forecast for a city."),
        ]
    }

    /// The tools sent for `messages`, with `sticky` categories and an optional config change.
    fn sent_tools(
        messages: Value,
        extra: Value,
        sticky: &[&str],
        configure: impl FnOnce(&mut PipelineConfig),
    ) -> (Vec<String>, ChatRequest) {
        sent_from(offered(), messages, extra, sticky, configure)
    }

    fn sent_from(
        tools: Vec<Value>,
        messages: Value,
        extra: Value,
        sticky: &[&str],
        configure: impl FnOnce(&mut PipelineConfig),
    ) -> (Vec<String>, ChatRequest) {
        let mut body = json!({"model": "gpt-4o", "messages": messages, "tools": tools});
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        let request: ChatRequest = serde_json::from_value(body).unwrap();
        let mut config = PipelineConfig::default();
        // These lists are small: the classifier is what these tests look at, and what it
        // leaves out is removed (stubs have tests of their own).
        config.tools.min_tool_tokens = 0;
        config.tools.left_out = LeftOut::Remove;
        config.tools.on_no_match = OnNoMatch::DropAll;
        configure(&mut config);
        let sticky: Vec<String> = sticky.iter().map(|s| (*s).to_owned()).collect();
        let rewrite = run(
            &request,
            &Env {
                config: &config,
                counter: &TokenCounter::new(Encoding::O200kBase),
                memo: &Memo::default(),
                budget: 1_000_000,
                sticky_categories: &sticky,
                reinforcement: None,
                remembered: None,
            },
        );
        let names = rewrite
            .request
            .tools
            .get()
            .into_iter()
            .flatten()
            .filter_map(|t| tool_name(t).map(str::to_owned))
            .collect();
        (names, rewrite.request)
    }

    fn user(text: &str) -> Value {
        json!([{"role": "user", "content": text}])
    }

    #[test]
    fn english_and_spanish_with_accents_and_plurals() {
        let (sent, _) = sent_tools(
            user("Schedule a meeting for Monday"),
            json!({}),
            &[],
            |_| {},
        );
        assert_eq!(sent, ["calendar_create_event", "calendar_list_events"]);
        let (sent, _) = sent_tools(
            user("¿Qué tiempo hará? Mándame el forecast por EMAIL"),
            json!({}),
            &[],
            |_| {},
        );
        assert_eq!(sent, ["email_send", "email_search", "weather_forecast"]);
        let config = |c: &mut PipelineConfig| {
            c.tools.categories = vec![crate::pipeline::config::ToolCategory {
                name: "agenda".into(),
                keywords: vec!["reunión".into(), "calendario".into()],
                tools: vec!["calendar_*".into()],
            }];
        };
        let (sent, _) = sent_tools(
            user("Agendá dos REUNIONES el lunes"),
            json!({}),
            &[],
            config,
        );
        assert_eq!(sent, ["calendar_create_event", "calendar_list_events"]);
    }

    #[test]
    fn follow_ups_use_sticky_categories_and_no_match_drops_tools() {
        for follow_up in ["both", "Ambos", "yes do it"] {
            let (sent, _) = sent_tools(user(follow_up), json!({}), &["email"], |_| {});
            assert_eq!(sent, ["email_send", "email_search"], "{follow_up}");
        }
        let (sent, request) = sent_tools(
            user("thanks!"),
            json!({"tool_choice": "auto", "parallel_tool_calls": true}),
            &[],
            |_| {},
        );
        assert!(sent.is_empty());
        assert!(
            request.tool_choice.is_absent() && !request.extra.contains_key("parallel_tool_calls")
        );
        let (sent, _) = sent_tools(user("thanks!"), json!({}), &[], |c| {
            c.tools.on_no_match = OnNoMatch::KeepAll;
        });
        assert_eq!(sent.len(), 5);
    }

    #[test]
    fn sticky_categories_stay_beside_a_new_match() {
        let (sent, _) = sent_tools(
            user("and the weather in Paris?"),
            json!({}),
            &["email"],
            |_| {},
        );
        assert_eq!(sent, ["email_send", "email_search", "weather_forecast"]);
    }

    fn airline() -> Vec<Value> {
        vec![
            tool("update_reservation", "Update the flights of a reservation."),
            tool("cancel_reservation", "Cancel the whole reservation."),
            tool(
                "get_reservation_details",
                "Get the details of a reservation.",
            ),
            tool(
                "transfer_to_human_agents",
                "Transfer the user to a human agent.",
            ),
        ]
    }

    #[test]
    fn name_words_bring_their_synonyms_and_shared_words_select_nothing_alone() {
        let cases: [(&str, &[&str]); 5] = [
            ("I want to change my reservation", &["update_reservation"]),
            ("Quiero cancelar la reserva", &["cancel_reservation"]),
            (
                "Is there a supervisor I can speak to?",
                &["transfer_to_human_agents"],
            ),
            // "reservation" names three tools: it says which API, not which tool.
            ("about my reservation", &[]),
            (
                "Can you show me the reservation details?",
                &["get_reservation_details"],
            ),
        ];
        for (text, expected) in cases {
            let (sent, _) = sent_from(airline(), user(text), json!({}), &[], |_| {});
            assert_eq!(sent, expected, "{text}");
        }
    }

    #[test]
    fn drop_all_sends_only_the_protected_tools_even_with_stubs_on() {
        let mut tools = offered();
        tools.push(tool("calculate", "Evaluate an arithmetic expression."));
        let (sent, request) = sent_from(tools, user("hello there"), json!({}), &[], |c| {
            c.tools.left_out = LeftOut::Stub;
        });
        assert_eq!(sent, ["calculate"]);
        assert_eq!(request.tools.get().map(Vec::len), Some(1));
    }

    #[test]
    fn the_classifier_reads_what_the_client_sent_not_the_window() {
        let original: Vec<Message> = serde_json::from_value(json!([
            {"role": "user", "content": "what's on my calendar?"},
            {"role": "assistant", "content": "Standup at 10. Shall I email this to Ana?"},
            {"role": "user", "content": "yes"}
        ]))
        .unwrap();
        // The budget's smallest window keeps only the current turn.
        let windowed: ChatRequest = serde_json::from_value(json!({"model": "gpt-4o",
            "messages": [{"role": "user", "content": "yes"}], "tools": offered()}))
        .unwrap();
        let mut config = PipelineConfig::default();
        config.tools.min_tool_tokens = 0;
        config.tools.left_out = LeftOut::Remove;
        let counter = TokenCounter::new(Encoding::O200kBase);
        let cx = StageCx {
            config: &config,
            params: &crate::pipeline::Params::from_config(&config),
            counter: &counter,
            memo: &Memo::default(),
            sticky_categories: &[],
            original_messages: &original,
        };
        let kept = ToolsStage.apply(&windowed, &cx).tools.unwrap();
        let names: Vec<&str> = kept.iter().filter_map(tool_name).collect();
        // Email from the answered question; the calendar from the earlier turn, still offered
        // (the conversation's tool block only grows).
        assert_eq!(
            names,
            [
                "calendar_create_event",
                "calendar_list_events",
                "email_send",
                "email_search"
            ]
        );
    }

    #[test]
    fn a_conversations_tool_block_only_grows() {
        let mut config = PipelineConfig::default();
        config.tools.min_tool_tokens = 0;
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let turns = [
            "what's on my calendar today?",
            "thanks, that's all for the calendar",
            "ok",
            "now send an email to Ana",
            "thanks",
        ];
        let mut messages = Vec::new();
        let mut previous: Vec<String> = Vec::new();
        for (i, text) in turns.iter().enumerate() {
            messages.push(json!({"role": "user", "content": text}));
            let request: ChatRequest = serde_json::from_value(
                json!({"model": "gpt-4o", "messages": messages, "tools": offered()}),
            )
            .unwrap();
            let cx = StageCx {
                config: &config,
                params: &crate::pipeline::Params::from_config(&config),
                counter: &counter,
                memo: &memo,
                sticky_categories: &[],
                original_messages: &request.messages,
            };
            let output = ToolsStage.apply(&request, &cx);
            let sent: Vec<String> = output
                .tools
                .unwrap_or_else(|| request.tools.get().cloned().unwrap_or_default())
                .iter()
                .filter_map(tool_name)
                .map(str::to_owned)
                .collect();
            assert!(
                previous.iter().all(|t| sent.contains(t)),
                "turn {i}: {previous:?} → {sent:?}"
            );
            previous = sent;
            messages.push(json!({"role": "assistant", "content": "Done."}));
        }
        assert!(previous.iter().any(|t| t.starts_with("calendar_")));
        assert!(previous.iter().any(|t| t.starts_with("email_")));
    }

    #[test]
    fn a_block_under_min_tool_tokens_is_sent_whole() {
        let messages = user("Send an email to Ana");
        let counter = TokenCounter::new(Encoding::O200kBase);
        let offered_tokens =
            counter.tools(&serde_json::from_value::<Vec<Tool>>(Value::Array(offered())).unwrap());
        let (sent, request) = sent_from(offered(), messages.clone(), json!({}), &[], |c| {
            c.tools.min_tool_tokens = offered_tokens + 1;
        });
        assert_eq!(sent.len(), offered().len());
        assert_eq!(request.tools.get().map(Vec::len), Some(offered().len()));
        // At the threshold, the block is filtered.
        let (sent, _) = sent_from(offered(), messages, json!({}), &[], |c| {
            c.tools.min_tool_tokens = offered_tokens;
        });
        assert_eq!(sent, ["email_send", "email_search"]);
    }

    #[test]
    fn chosen_called_always_and_tool_loop_tools_are_kept() {
        let (sent, _) = sent_tools(
            user("thanks!"),
            json!({"tool_choice": {"type": "function", "function": {"name": "email_send"}}}),
            &[],
            |c| c.tools.always = vec!["weather_*".into()],
        );
        assert_eq!(sent, ["email_send", "weather_forecast"]);
        // A demanded tool call keeps every tool: the client chose among them.
        let (sent, request) = sent_tools(
            user("thanks!"),
            json!({"tool_choice": "required"}),
            &[],
            |_| {},
        );
        assert_eq!(sent.len(), 5);
        assert_eq!(request.tool_choice.get(), Some(&json!("required")));
        // Mid tool-loop: the last message is a result; the loop's categories stay.
        let messages = json!([
            {"role": "user", "content": "what's on my calendar, then email it to Ana"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "calendar_list_events", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "standup at 10"}
        ]);
        let (sent, _) = sent_tools(messages, json!({}), &[], |_| {});
        assert_eq!(
            sent,
            [
                "calendar_create_event",
                "calendar_list_events",
                "email_send",
                "email_search"
            ]
        );
    }
}
