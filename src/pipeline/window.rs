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
//! for word (`ledger.rs`).

mod facts;
mod ledger;
mod summary;
mod turns;

use std::hash::{BuildHasher, Hash, Hasher};

use foldhash::quality::FixedState;

use super::report::{StageDetails, StageName, WindowDetails, WindowSummary, WindowTarget};
use super::system::add_section;
use super::working_set::WorkingSet;
use super::{Stage, StageCx, StageOutput};
use crate::openai::{ChatRequest, Message, Role};
use crate::tokens::hash_message;
use turns::{Turn, split_turns};

pub struct WindowStage;

impl Stage for WindowStage {
    fn name(&self) -> StageName {
        StageName::Window
    }

    fn enabled(&self, config: &super::PipelineConfig) -> bool {
        config.window.enabled
    }

    fn apply(&self, request: &ChatRequest, cx: &StageCx<'_>) -> StageOutput {
        let (head, turns) = split_turns(&request.messages);
        let plan = plan_window(&turns, cx);
        if plan.start == 0 {
            return StageOutput::unchanged(StageDetails::Window(WindowDetails {
                turns: turns.len(),
                verbatim_turns: turns.len(),
                target: None,
                reason: plan.reason,
                summary: None,
            }));
        }
        let (older, window) = turns.split_at(plan.start);
        let segments = summary::count(older, cx);
        let kept = summary::latest(older, cx.params.max_segments, cx);
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

        let removed: Vec<(usize, &Message)> = older
            .iter()
            .flat_map(|t| {
                t.messages
                    .iter()
                    .enumerate()
                    .map(move |(i, m)| (t.start + i, m))
            })
            .filter(|(i, m)| {
                !answered.contains(i) && !matches!(m.role, Role::System | Role::Developer)
            })
            .collect();
        let ledger = if cx.config.window.ledger_max_tokens > 0 {
            // Depends only on what comes before the window (so it stays byte for byte the same
            // until the window moves: prefix stability, and computed once), the answered
            // message kept, the cap and the encoding.
            let before_window = &request.messages[..window_start];
            let key = ledger_key(before_window, &answered, cx);
            let text = cx.memo.text(key, || {
                let views = ledger::Views::new(cx.memo);
                let ids = |m: &Message| {
                    let mut hasher = FixedState::with_seed(IDENTIFIERS_SEED).build_hasher();
                    hash_message(m, &mut hasher);
                    cx.memo
                        .identifiers(hasher.finish(), || views.message_ids(m))
                };
                // Shown before the window: the instructions and the answered message.
                let kept_ids: Vec<_> = before_window
                    .iter()
                    .enumerate()
                    .filter(|(i, m)| {
                        answered.contains(i) || matches!(m.role, Role::System | Role::Developer)
                    })
                    .map(|(_, m)| ids(m))
                    .collect();
                let shown: ledger::Shown<'_> = kept_ids
                    .iter()
                    .flat_map(|ids| ids.iter().map(String::as_str))
                    .collect();
                let all_ids: Vec<_> = before_window.iter().map(ids).collect();
                let mut mentions = ledger::Mentions::with_capacity_and_hasher(
                    all_ids.iter().map(|ids| ids.len()).sum(),
                    Default::default(),
                );
                for (position, ids) in all_ids.iter().enumerate() {
                    for id in ids.iter() {
                        mentions.insert(id.as_str(), position);
                    }
                }
                ledger::lines(
                    &removed,
                    &shown,
                    &mentions,
                    cx.config.window.ledger_max_tokens,
                    cx.counter,
                    cx.memo,
                )
                .join("\n- ")
            });
            if text.is_empty() {
                Vec::new()
            } else {
                vec![text]
            }
        } else {
            Vec::new()
        };
        if !kept.is_empty() || !ledger.is_empty() {
            let mut section = String::from("<conversation_summary>\n");
            if !kept.is_empty() {
                let lines: Vec<&str> = kept.iter().map(|s| &*s.line).collect();
                section.push_str("Earlier turns, oldest first:\n");
                section.push_str(&lines.join("\n"));
                section.push('\n');
            }
            if !ledger.is_empty() {
                section.push_str(LEDGER_HEADING);
                section.push_str("- ");
                section.push_str(&ledger.join("\n- "));
                section.push('\n');
            }
            section.push_str("</conversation_summary>");
            add_section(&mut messages, &section);
        }
        if !facts.lines.is_empty() {
            add_section(
                &mut messages,
                &format!("<user_facts>\n{}\n</user_facts>", facts.lines.join("\n")),
            );
        }
        let details = StageDetails::Window(WindowDetails {
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
                segments_kept: kept.len(),
                ledger_lines: ledger.first().map_or(0, |l| l.lines().count()),
                answered_kept: !answered.is_empty(),
                facts: facts.lines.len(),
            }),
        });
        StageOutput {
            messages: Some(messages),
            tools: None,
            details,
        }
    }
}

/// What introduces the ledger's lines in the summary section (the budget's floor counts the
/// lines after it as the ledger).
pub(super) const LEDGER_HEADING: &str = "Identifiers from those turns, word for word:\n";

/// Seeds of the memo keys of ledgers and of each message's identifiers.
const LEDGER_SEED: u64 = 0x6c65_6467_6572_0001;
const IDENTIFIERS_SEED: u64 = 0x6964_656e_7469_0001;

/// Everything a ledger depends on: the messages before the window, the answered message kept,
/// the cap and the encoding.
fn ledger_key(messages: &[Message], answered: &std::ops::Range<usize>, cx: &StageCx<'_>) -> u64 {
    let mut hasher = FixedState::with_seed(LEDGER_SEED).build_hasher();
    cx.counter.encoding().hash(&mut hasher);
    (answered.start, answered.end).hash(&mut hasher);
    (cx.config.window.ledger_max_tokens, messages.len()).hash(&mut hasher);
    for message in messages {
        hash_message(message, &mut hasher);
    }
    hasher.finish()
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
    let continuity = turns::continuity(turns);
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
    let topic_shift = turns::last_topic_shift(turns, start + 1, config);
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
