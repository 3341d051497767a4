//! `budget`: holds a request to its token budget (default 4,000).
//! When the other stages leave it too large, they run again with tighter settings, one step at
//! a time, least information per token first, until it fits: fewer summary segments, a smaller
//! window (`min_turns`, then the working set alone), all but the last tool result cleared, harder
//! compaction, shorter tool-parameter descriptions, and last no summary lines at all.
//!
//! No step touches the floor (ARCHITECTURE.md, principle 8): the system message, the tools kept, the
//! working set and the ledger. When the floor alone exceeds the budget, the report says which
//! part is over; the caller's policy forwards it flagged (default) or rejects it.

use memchr::memmem;
use serde::Serialize;

use super::config::PipelineConfig;
use super::stage::Params;
use super::window::section::{LEDGER_HEADER, LINES_HEADER};
use super::working_set::WorkingSet;
use crate::openai::{ChatRequest, Role};
use crate::tokens::TokenCounter;

/// `budget`: the steps taken to fit the budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BudgetDetails {
    pub budget: usize,
    pub steps: Vec<&'static str>,
    pub fits: bool,
}

type Step = (&'static str, fn(&mut Params, &PipelineConfig));

const STEPS: &[Step] = &[
    ("fewer_summary_segments", |p, _| {
        p.max_segments = p.max_segments.min(2)
    }),
    ("window_min_turns", |p, c| {
        p.window_turns_cap = Some(c.window.min_turns)
    }),
    ("clear_all_but_last_tool_result", |p, _| {
        p.keep_recent_results = p.keep_recent_results.min(1)
    }),
    ("harder_compaction", |p, _| {
        p.tool_result_max_tokens = (p.tool_result_max_tokens / 4).max(100);
        p.max_string_chars = p.max_string_chars.min(100);
    }),
    // The last turn and the assistant message it answers; the rest goes to the ledger.
    ("window_working_set", |p, _| p.window_turns_cap = Some(1)),
    // Last resort, before the policy refuses the request.
    ("no_summary_segments", |p, _| p.max_segments = 0),
];

/// The parts of a request that no budget step cuts, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Floor {
    /// The system message, without the proxy's summary section.
    pub system: usize,
    pub tools: usize,
    pub working_set: usize,
    /// The ledger's lines in the summary section: what `ledger_max_tokens` caps.
    pub ledger: usize,
    /// The rest of the summary section: its headings and the summary lines of older turns left
    /// (at most `max_segments` × `segment_max_tokens`). Not part of the floor: the budget's
    /// steps cut these lines, but a request that appends to an earlier rewrite keeps them.
    pub summary: usize,
    /// Everything else that was left (stubs, compacted results, older turns).
    pub history: usize,
}

/// Which part of the floor first exceeds the budget, counted in the order system, tools,
/// working set (with the ledger); `history` when the floor fits and the rest does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OverPart {
    System,
    Tools,
    WorkingSet,
    History,
}

/// A request still over its budget after every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OverBudget {
    /// Tokens over the budget.
    pub tokens_over: usize,
    pub part: OverPart,
    pub floor: Floor,
}

impl Floor {
    pub fn of(request: &ChatRequest, recent_tool_steps: usize, counter: &TokenCounter) -> Floor {
        let working_set = WorkingSet::of(&request.messages, recent_tool_steps);
        let mut floor = Floor {
            system: 0,
            tools: counter.tools(request.tools.get().map_or(&[], Vec::as_slice)),
            working_set: 0,
            ledger: 0,
            summary: 0,
            history: 0,
        };
        for (index, message) in request.messages.iter().enumerate() {
            let tokens = counter.message(message);
            if matches!(message.role, Role::System | Role::Developer) {
                let (section, ledger) = message
                    .content
                    .get()
                    .map(|c| c.text())
                    .and_then(|text| {
                        let section = summary_section(&text)?;
                        let ledger = ledger_lines(section).map_or(0, |l| counter.instructions(l));
                        Some((counter.instructions(section), ledger))
                    })
                    .unwrap_or((0, 0));
                let section = section.min(tokens);
                let ledger = ledger.min(section);
                floor.ledger += ledger;
                floor.summary += section - ledger;
                floor.system += tokens - section;
            } else if working_set.contains(index) {
                floor.working_set += tokens;
            } else {
                floor.history += tokens;
            }
        }
        floor
    }

    /// Which part crosses `budget` first, and by how much the whole is over it.
    pub fn over(self, budget: usize, total: usize) -> Option<OverBudget> {
        if total <= budget {
            return None;
        }
        let parts = [
            (OverPart::System, self.system),
            (OverPart::Tools, self.tools),
            (OverPart::WorkingSet, self.working_set + self.ledger),
        ];
        let mut sum = 0;
        let part = parts
            .iter()
            .find(|(_, tokens)| {
                sum += tokens;
                sum > budget
            })
            .map_or(OverPart::History, |(part, _)| *part);
        Some(OverBudget {
            tokens_over: total - budget,
            part,
            floor: self,
        })
    }
}

/// The `<conversation_summary>` section of a system message text.
fn summary_section(text: &str) -> Option<&str> {
    // memmem: the system message is long (an agent's policy), and this is read per budget step.
    let find = |haystack: &str, tag: &str| memmem::find(haystack.as_bytes(), tag.as_bytes());
    let start = find(text, "<conversation_summary>")?;
    let end = find(&text[start..], "</conversation_summary>")? + start;
    Some(&text[start..end + "</conversation_summary>".len()])
}

/// The ledger's lines (`- …` each) of a summary section, without the summary lines or the
/// closing tag after them.
fn ledger_lines(section: &str) -> Option<&str> {
    let start = section.find(LEDGER_HEADER)? + LEDGER_HEADER.len();
    let rest = section[start..].trim_start_matches('\n');
    let end = rest
        .find(LINES_HEADER)
        .or_else(|| rest.find("</conversation_summary>"))?;
    Some(&rest[..end])
}

/// Tightens `Params` step by step, re-running the stages through `rerun` (the request they
/// leave and its tokens), and keeps the first (least reduced) step that fits. Each step only
/// reduces more than the one before, so the tightest is tried first (when even it does not
/// fit, it is the best effort) and the first fitting step is found by bisection: at most
/// 1 + log2(7) re-runs. Returns the request kept, its tokens (`tokens_before` when no step made
/// it smaller) and what was done.
pub fn fit(
    original: &ChatRequest,
    config: &PipelineConfig,
    budget: usize,
    tokens_before: usize,
    rerun: &dyn Fn(&Params) -> (ChatRequest, usize),
) -> (ChatRequest, usize, BudgetDetails) {
    let attempt = |steps: usize| {
        let mut params = Params::from_config(config);
        for (_, tighten) in &STEPS[..steps] {
            tighten(&mut params, config);
        }
        rerun(&params)
    };
    let mut best = (STEPS.len(), attempt(STEPS.len()));
    if best.1.1 <= budget {
        let (mut low, mut high) = (1, STEPS.len());
        while low < high {
            let middle = (low + high) / 2;
            let result = attempt(middle);
            if result.1 <= budget {
                high = middle;
                best = (middle, result);
            } else {
                low = middle + 1;
            }
        }
    }
    let (steps, (request, tokens)) = best;
    let (request, tokens_after) = if tokens < tokens_before {
        (request, tokens)
    } else {
        (original.clone(), tokens_before)
    };
    let names: Vec<&str> = STEPS[..steps].iter().map(|(name, _)| *name).collect();
    let details = BudgetDetails {
        budget,
        steps: names,
        fits: tokens_after <= budget,
    };
    (request, tokens_after, details)
}
