//! `window`: the last turns stay verbatim; older turns become compact key-value summaries and
//! the facts the user stated.
//!
//! A turn is a user message and everything after it up to the next user message, so a tool
//! call and its results are never split. The verbatim window holds N turns (3; 4 when recent
//! user messages continue one topic, 2 for chit-chat), starts after a topic shift, and is
//! capped in tokens. Older turns are cut in segments of 3 counted from the start of the
//! conversation, so the window moves in steps and consecutive requests share a prefix.
//!
//! It never removes the working set: the assistant message the last user message answers stays
//! even when its turn is summarized. What the summarized turns held goes to the ledger, word
//! for word (`ledger.rs`), in a section that grows by appending (`section.rs`).

mod facts;
mod ledger;
pub(super) mod section;
mod summary;
mod turns;

use serde::Serialize;

use super::config::PipelineConfig;
use super::stage::{Stage, StageCx, StageName, StageOutput};
use super::system::add_section;
use super::working_set::WorkingSet;
use crate::openai::{ChatRequest, Message};
use turns::{Turn, split_turns};

/// `window`: the turns kept verbatim, and what summarizes the others. A window with nothing to
/// summarize reports only `turns`, `verbatim_turns` and `reason`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowDetails {
    pub turns: usize,
    pub verbatim_turns: usize,
    #[serde(flatten)]
    pub target: Option<WindowTarget>,
    pub reason: &'static str,
    #[serde(flatten)]
    pub summary: Option<WindowSummary>,
}

/// How many turns the adaptive window aimed at, and why.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WindowTarget {
    pub target_turns: usize,
    pub continuity: Option<f64>,
    /// 1-based.
    pub topic_shift_at_turn: Option<usize>,
}

/// What stands for the turns before the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WindowSummary {
    pub summarized_turns: usize,
    pub segments: usize,
    pub segments_kept: usize,
    pub ledger_lines: usize,
    /// How many times the summary section was rebuilt as the conversation grew (it is
    /// otherwise appended to: `window/section.rs`).
    pub folds: usize,
    pub answered_kept: bool,
    pub facts: usize,
}

pub struct WindowStage;

impl Stage for WindowStage {
    type Details = WindowDetails;

    fn name(&self) -> StageName {
        StageName::Window
    }

    fn enabled(&self, config: &PipelineConfig) -> bool {
        config.window.enabled
    }

    fn apply(&self, request: &ChatRequest, cx: &StageCx<'_>) -> StageOutput<WindowDetails> {
        let (head, turns) = split_turns(&request.messages);
        let plan = plan_window(&turns, cx);
        if plan.start == 0 {
            return StageOutput::unchanged(WindowDetails {
                turns: turns.len(),
                verbatim_turns: turns.len(),
                target: None,
                reason: plan.reason,
                summary: None,
            });
        }
        let (older, window) = turns.split_at(plan.start);
        let segments = summary::count(older, cx);
        let facts = if cx.config.facts.enabled {
            let current = turns.last().map(Turn::user_text).unwrap_or_default();
            facts::section(older, &current, cx)
        } else {
            facts::Section::default()
        };
        // The assistant message the last user message answers is never summarized away.
        let working_set = WorkingSet::of(&request.messages, cx.config.window.recent_tool_steps);
        let window_start = window.first().map_or(request.messages.len(), |t| t.start);
        let answered = working_set
            .answered
            .clone()
            .filter(|range| range.start < window_start)
            .unwrap_or(0..0);

        let mut messages: Vec<Message> = head.to_vec();
        // Instructions found inside summarized turns (system stage off) are kept.
        messages.extend(older.iter().flat_map(|t| t.instructions().cloned()));
        messages.extend(request.messages[answered.clone()].iter().cloned());
        messages.extend(window.iter().flat_map(|t| t.messages.iter().cloned()));

        let section = section::build(head, older, !answered.is_empty(), cx);
        if !section.text.is_empty() {
            add_section(&mut messages, &section.text);
        }
        if !facts.lines.is_empty() {
            add_section(
                &mut messages,
                &format!("<user_facts>\n{}\n</user_facts>", facts.lines.join("\n")),
            );
        }
        let details = WindowDetails {
            turns: turns.len(),
            verbatim_turns: window.len(),
            target: Some(WindowTarget {
                target_turns: plan.target,
                continuity: plan.continuity,
                topic_shift_at_turn: plan.topic_shift.map(|i| i + 1),
            }),
            reason: plan.reason,
            summary: Some(WindowSummary {
                summarized_turns: older.len(),
                segments,
                segments_kept: section.segment_lines,
                ledger_lines: section.ledger_lines,
                folds: section.folds,
                answered_kept: !answered.is_empty(),
                facts: facts.lines.len(),
            }),
        };
        StageOutput {
            messages: Some(messages),
            tools: None,
            details,
        }
    }
}

struct Plan {
    /// Index of the first verbatim turn.
    start: usize,
    target: usize,
    continuity: Option<f64>,
    topic_shift: Option<usize>,
    reason: &'static str,
}

fn plan_window(turns: &[Turn<'_>], cx: &StageCx<'_>) -> Plan {
    let config = &cx.config.window;
    let total = turns.len();
    let continuity = turns::continuity(turns, cx.memo);
    let mut target = match continuity {
        Some(c) if c >= config.continuity_high => config.max_turns,
        Some(c) if c <= config.continuity_low => config.min_turns,
        _ => config.turns,
    };
    let mut reason = "adaptive";
    if let Some(cap) = cx.params.window_turns_cap {
        target = target.min(cap.max(1));
        reason = "budget";
    }
    let mut start = if total > target {
        let raw = total - target;
        if cx.params.window_turns_cap.is_some() {
            raw
        } else {
            // Align to whole segments counted from the start (prefix stability).
            raw / config.segment_turns * config.segment_turns
        }
    } else {
        0
    };
    let topic_shift = turns::last_topic_shift(turns, start + 1, config, cx.memo);
    if let Some(shift) = topic_shift {
        start = shift;
        reason = "topic_shift";
    }
    // Cap the verbatim window in tokens, down to the minimum number of turns.
    let min_turns = config
        .min_turns
        .min(cx.params.window_turns_cap.unwrap_or(usize::MAX))
        .max(1);
    let mut tokens: usize = turns[start..]
        .iter()
        .map(|t| t.tokens_after_compaction(cx))
        .sum();
    while tokens > config.max_tokens && total - start > min_turns {
        tokens -= turns[start].tokens_after_compaction(cx);
        start += 1;
        reason = "token_cap";
    }
    Plan {
        start,
        target,
        continuity,
        topic_shift,
        reason,
    }
}
