//! `tools`: full definitions only for the tools a conversation can need, stubs for the rest.
//!
//! The block is decided on the conversation's first turn and then kept, the same bytes
//! (ARCHITECTURE.md, principle 4): each category of the offered tools (see `catalog`) is scored
//! by its keywords in the first turn's user message and the assistant text it answers, plus,
//! with a lower weight, in the context before it; selected categories go in full. When nothing
//! matches, the store's sticky categories are used, else the `on_no_match` policy. Always in
//! full: tools called before the first answer, `tools.always`, single-word utilities (`think`,
//! `calculate`) and definitions under `min_stub_tokens`. A tool called later, or named by
//! `tool_choice`, is defined in the messages where the need arose (`inline`); a strict
//! one grows the block instead. With `left_out = "remove"` the block grows with what later
//! turns need (called, matched by a user message, or of a category a tool loop uses).

pub(crate) mod catalog;
pub mod inline;
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
use inline::Placed;
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
            let text: String = m.content_text().chars().take(chars).collect();
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
        let original = cx.original_messages;
        let plan = plan(&catalog, tools, request, original, cx);
        // Scores of the current turn, for the report (the block was decided at the first).
        let scores = turn_scores(&catalog, original, config);

        let offered = tools.len();
        // Left-out tools become stubs in place (the block keeps the client's order), unless
        // they are removed. Tools without a function name (other tool types) are always kept.
        let defined_inline: BTreeSet<&str> = plan
            .placed
            .iter()
            .flat_map(|p| p.names.iter().map(String::as_str))
            .collect();
        let mut forms = BTreeMap::new();
        let mut kept: Vec<Tool> = Vec::with_capacity(offered);
        for tool in tools {
            let Some(name) = tool_name(tool) else {
                kept.push(tool.clone());
                continue;
            };
            let form = if plan.full.contains(name) {
                kept.push(tool.clone());
                ToolForm::Full
            } else if plan.stubs {
                let max = config.stub_description_tokens;
                kept.push(stubs::stub(tool, max, cx.counter, cx.memo));
                if defined_inline.contains(name) {
                    ToolForm::Inline
                } else {
                    ToolForm::Stub
                }
            } else {
                ToolForm::Removed
            };
            forms.insert(name.to_owned(), form);
        }
        let stubbed = forms.values().filter(|f| f.is_stub()).count();
        let scores = scores
            .into_iter()
            .map(|(name, (score, keywords))| (name, CategoryScore { score, keywords }))
            .collect();
        let details = StageDetails::Tools(ToolsDetails {
            sent: Some(kept.len() - stubbed),
            stubs: Some(stubbed),
            inline: (!defined_inline.is_empty()).then_some(defined_inline.len()),
            reason: Some(plan.reason),
            classifier: Some(Classified {
                forms,
                categories: plan.categories,
                scores,
                sticky: cx.sticky_categories.to_vec(),
                protected: plan.protected,
            }),
            ..ToolsDetails::offered(offered)
        });
        let messages = (!plan.placed.is_empty()).then(|| {
            let placed = definition_messages(&plan.placed, tools);
            inline::insert(request.messages.clone(), original, &placed)
        });
        if kept.len() == offered && stubbed == 0 && messages.is_none() {
            return StageOutput::unchanged(details);
        }
        StageOutput {
            messages,
            tools: Some(kept),
            details,
        }
    }

    /// Definitions placed in the messages make them longer; the stubs beside them make the
    /// request shorter (the pipeline as a whole still never grows a prompt).
    fn structural(&self) -> bool {
        true
    }
}

/// What the stage sends of a request's tools: the block's full tools (decided on the
/// conversation's first turn, grown only by strict tools), whether the others go as stubs,
/// and the definitions placed in the messages.
struct Plan {
    full: BTreeSet<String>,
    stubs: bool,
    placed: Vec<Placed>,
    reason: Reason,
    categories: Vec<String>,
    protected: Vec<String>,
}

/// The tool block is decided once per conversation, on its first turn (the messages up to
/// the first answer to a user): tools the provider's prompt cache sees first stay the same
/// bytes from turn to turn, and any replica reaches the same block from the history alone.
/// A tool needed later is defined in the messages where the need arose (`inline`), or, when
/// it is strict or left-out tools are removed, added to the block (a growth).
fn plan(
    catalog: &Catalog,
    tools: &[Tool],
    request: &ChatRequest,
    original: &[Message],
    cx: &StageCx<'_>,
) -> Plan {
    let config = &cx.config.tools;
    let first = first_point(original);
    // The store's sticky categories speak for a conversation only at its first turn; later,
    // the history says what was used.
    let sticky = if first == original.len() {
        cx.sticky_categories
    } else {
        &[]
    };
    let block = first_turn_block(catalog, tools, &original[..first], sticky, config);
    let names: Vec<&str> = tools.iter().filter_map(tool_name).collect();
    // `drop_all` sends the protected tools only: nothing left out goes as a stub.
    let stubs = config.left_out == LeftOut::Stub && !block.dropped;
    let mut full = block.keep;
    // A short definition goes in full: its stub would save little, and a call costs a re-ask.
    full.extend(
        tools
            .iter()
            .filter(|t| cx.counter.tool(t) < config.min_stub_tokens)
            .filter_map(tool_name)
            .map(str::to_owned),
    );
    let mut defined = full.clone();
    let mut placed = Vec::new();
    let words = (!stubs).then_some(config);
    let mut needs = later_needs(catalog, original, first, words);
    // A tool `tool_choice` names is called now: defined last, where the next request places
    // what this answer called.
    if let Some(chosen) = chosen_tool(request) {
        needs.push(Placed {
            at: original.len(),
            answered: true,
            names: vec![chosen],
        });
    }
    for need in needs {
        let (strict, loose): (Vec<String>, Vec<String>) = need
            .names
            .into_iter()
            .filter(|n| names.contains(&n.as_str()) && !defined.contains(n))
            .partition(|n| {
                tools
                    .iter()
                    .find(|t| tool_name(t) == Some(n.as_str()))
                    .is_some_and(|t| inline::in_block(t, config.definitions))
            });
        defined.extend(strict.iter().chain(&loose).cloned());
        full.extend(strict);
        if !stubs {
            full.extend(loose);
        } else if !loose.is_empty() {
            placed.push(Placed {
                names: loose,
                ..need
            });
        }
    }
    Plan {
        full,
        stubs,
        placed,
        reason: block.reason,
        categories: block.categories,
        protected: block.protected,
    }
}

/// The definitions messages of `placed`, each at its spot.
fn definition_messages(placed: &[Placed], tools: &[Tool]) -> Vec<(usize, Message)> {
    placed
        .iter()
        .map(|p| (p.at, inline::message(tools, &p.names)))
        .collect()
}

/// The definitions `request`'s rewrite places in its messages from the client's message
/// `from` on (those at `from` itself only when an answer called them: the rest ended the
/// rewrite of the request that sent the first `from` messages). What a conversation's next
/// request appends to its earlier rewrite (`prefix`).
pub fn definitions_from(
    request: &ChatRequest,
    from: usize,
    config: &super::PipelineConfig,
    counter: &crate::tokens::TokenCounter,
    memo: &Memo,
) -> Vec<(usize, Message)> {
    if sends_block_whole(request, config, counter) {
        return Vec::new();
    }
    let Some(tools) = request.tools.get() else {
        return Vec::new();
    };
    let params = super::Params::from_config(config);
    let cx = StageCx {
        config,
        params: &params,
        counter,
        memo,
        sticky_categories: &[],
        original_messages: &request.messages,
    };
    let catalog = Catalog::memoized(tools, &config.tools, memo);
    let plan = plan(&catalog, tools, request, &request.messages, &cx);
    let placed: Vec<Placed> = plan
        .placed
        .into_iter()
        .filter(|p| p.at > from || (p.at == from && p.answered))
        .collect();
    definition_messages(&placed, tools)
}

/// The block of a conversation's first turn: the full tools and why.
struct Block {
    keep: BTreeSet<String>,
    /// Nothing matched, and `on_no_match = "drop_all"`.
    dropped: bool,
    reason: Reason,
    categories: Vec<String>,
    protected: Vec<String>,
}

fn first_turn_block(
    catalog: &Catalog,
    tools: &[Tool],
    messages: &[Message],
    sticky: &[String],
    config: &super::config::ToolsConfig,
) -> Block {
    let scores = turn_scores(catalog, messages, config);
    let matched: Vec<String> = matched_of(&scores, config);
    let mut protected: Vec<String> = Vec::new();
    for message in messages {
        protected.extend(message.tool_calls().iter().map(|c| c.function.name.clone()));
    }
    let names: Vec<&str> = tools.iter().filter_map(tool_name).collect();
    let mut keep: BTreeSet<String> = BTreeSet::new();
    for name in &names {
        let utility = config.keep_single_word_tools && catalog::is_single_word(name);
        if utility
            || protected.iter().any(|p| p == name)
            || config.always.iter().any(|p| glob_match(p, name))
        {
            keep.insert((*name).to_owned());
        }
    }
    let carried: Vec<String> = sticky
        .iter()
        .filter(|s| catalog.categories.iter().any(|c| &c.name == *s))
        .cloned()
        .collect();
    let (selected, mut reason) = if !matched.is_empty() {
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
    for category in catalog
        .categories
        .iter()
        .filter(|c| selected.contains(&c.name))
    {
        keep.extend(category.tools.iter().cloned());
    }
    let dropped = reason == Reason::NoMatchDrop;
    if dropped && !keep.is_empty() {
        reason = Reason::Protected;
    }
    let protected: BTreeSet<String> = protected
        .into_iter()
        .filter(|p| names.contains(&p.as_str()))
        .collect();
    Block {
        keep,
        dropped,
        reason,
        categories: selected,
        protected: protected.into_iter().collect(),
    }
}

/// The length of a conversation's first request as its history shows: the messages before
/// the first assistant message that answers a user (all of them when there is none).
fn first_point(messages: &[Message]) -> usize {
    // A conversation without a user message (a task in the system message) starts at its
    // first answer.
    let mut seen_user = !messages.iter().any(|m| m.role == Role::User);
    for (index, message) in messages.iter().enumerate() {
        if seen_user && message.role == Role::Assistant {
            return index;
        }
        seen_user |= message.role == Role::User;
    }
    messages.len()
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

/// What the conversation needed after its first turn, in order, each at the client's message
/// it goes before: the tools an assistant message called (before it). With `words` (left-out
/// tools removed: no re-ask can recover a miss), also the tools of the categories a later user
/// message matched (scored as it was then) and, mid tool loop, the tools of the categories the
/// loop used (before its next step, or last). With stubs, neither is predicted: a miss costs
/// one re-ask, and on recorded agent traffic defining what they predicted cost more tokens
/// than the re-asks it saved, at the same bill.
fn later_needs(
    catalog: &Catalog,
    messages: &[Message],
    first: usize,
    words: Option<&super::config::ToolsConfig>,
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
                    let scores = turn_scores(catalog, &messages[..=index], config);
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
                let called: BTreeSet<String> = message
                    .tool_calls()
                    .iter()
                    .map(|c| c.function.name.clone())
                    .collect();
                if index >= first {
                    let after_tool = index
                        .checked_sub(1)
                        .and_then(|i| messages.get(i))
                        .is_some_and(|m| matches!(m.role, Role::Tool | Role::Function));
                    if after_tool && words.is_some() {
                        push(index, false, loop_needs(&loop_categories));
                    }
                    push(index, true, called.iter().cloned().collect());
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
        config.tools.min_stub_tokens = 0;
        config.tools.min_score = 1.0;
        config.tools.left_out = LeftOut::Remove;
        config.tools.on_no_match = OnNoMatch::DropAll;
        // The recall tool is the proxy's, not the classifier's (tests in `recall.rs`).
        config.compact.recall = false;
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
        config.tools.min_stub_tokens = 0;
        config.tools.min_score = 1.0;
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
        // The calendar from the first turn; email from the answered question (with
        // left_out = "remove", a later turn's words grow the block).
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
        config.tools.min_stub_tokens = 0;
        config.tools.min_score = 1.0;
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
    fn a_later_tool_loop_defines_what_it_called_and_predicts_only_without_stubs() {
        let messages = json!([
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "what's on my calendar today?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "calendar_list_events", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "standup at 10"}
        ]);
        // Stubs: the block stays the first turn's, and only the tool called is defined, before
        // the call; the loop's other calendar tool is not defined ahead of a call.
        let (sent, request) = sent_tools(messages.clone(), json!({}), &[], |c| {
            c.tools.left_out = LeftOut::Stub;
            c.tools.on_no_match = OnNoMatch::Stub;
        });
        assert_eq!(sent.len(), 5);
        assert_eq!(
            inline::defined_in(&request.messages),
            BTreeSet::from(["calendar_list_events".to_owned()])
        );
        let at = request
            .messages
            .iter()
            .position(|m| !m.tool_calls().is_empty())
            .unwrap();
        assert_eq!(inline::defined_in(&request.messages[..at]).len(), 1);
        // Removed: no re-ask can recover a miss, so the block grows with the loop's categories.
        let (sent, request) = sent_tools(messages, json!({}), &[], |_| {});
        assert_eq!(sent, ["calendar_create_event", "calendar_list_events"]);
        assert!(inline::defined_in(&request.messages).is_empty());
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
