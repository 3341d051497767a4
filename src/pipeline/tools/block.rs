//! The decided block: the tools a conversation's first turn sends in full (matched categories,
//! sticky ones, the `on_no_match` policy, and the tools always kept), and when the client's
//! block goes as it is (a demanded call, a small block, no filtering).

use std::collections::BTreeSet;

use serde_json::Value;

use super::catalog::{self, Catalog, tool_name};
use super::classify::{matched_of, turn_scores};
use super::report::Reason;
use crate::glob::glob_match;
use crate::openai::{ChatRequest, Message, Nullable, Role, Tool};
use crate::pipeline::config::{OnNoMatch, PipelineConfig, ToolsConfig};
use crate::pipeline::memo::Memo;
use crate::tokens::TokenCounter;

/// Tool names named by `tool_choice` (`{"type":"function","function":{"name":…}}`).
pub(super) fn chosen_tool(request: &ChatRequest) -> Option<String> {
    request
        .tool_choice
        .get()
        .and_then(|c| c.get("function"))
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// The block of a conversation's first turn: the full tools and why.
pub(super) struct Block {
    pub keep: BTreeSet<String>,
    /// Nothing matched, and `on_no_match = "drop_all"`.
    pub dropped: bool,
    pub reason: Reason,
    pub categories: Vec<String>,
    pub protected: Vec<String>,
}

pub(super) fn first_turn_block(
    catalog: &Catalog,
    tools: &[Tool],
    messages: &[Message],
    sticky: &[String],
    config: &ToolsConfig,
    memo: &Memo,
) -> Block {
    let scores = turn_scores(catalog, messages, config, memo);
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
pub(super) fn first_point(messages: &[Message]) -> usize {
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
pub(super) fn demanded_call(request: &ChatRequest) -> Option<&Value> {
    request.tool_choice.get().filter(|choice| {
        choice.as_str() == Some("required")
            || choice.get("type").and_then(Value::as_str) == Some("allowed_tools")
    })
}

/// A small block is sent whole: filtering it saves less than one growth of the block costs
/// where the provider caches prompts (a growth re-bills the whole prompt).
pub(super) fn is_small_block(tool_tokens: usize, config: &ToolsConfig) -> bool {
    tool_tokens < config.min_tool_tokens
}

/// Whether the stage sends the client's tools as they are, whatever the messages say: filtering
/// off, no tools, a demanded call, or a small block. Then a conversation's tools never change.
pub fn sends_block_whole(
    request: &ChatRequest,
    config: &PipelineConfig,
    counter: &TokenCounter,
) -> bool {
    let tools = request.tools.get().map_or(&[][..], Vec::as_slice);
    !config.tools.enabled
        || tools.is_empty()
        || demanded_call(request).is_some()
        || is_small_block(counter.tools(tools), &config.tools)
}

/// The request without tools: `tool_choice` and `parallel_tool_calls` would make it invalid.
pub fn without_tools(request: &mut ChatRequest) {
    request.tools = Nullable::Absent;
    request.tool_choice = Nullable::Absent;
    request.extra.shift_remove("parallel_tool_calls");
}
