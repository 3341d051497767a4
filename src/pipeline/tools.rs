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

//!
//! The parts: `classify.rs` scores the categories of a turn's words, `block.rs` decides the
//! block of the first turn, `concise.rs` is a tool in full as the stage sends it (the client's
//! definition without the titles that restate a name), `inline.rs` places the definitions of
//! later needs in the messages,
//! `report.rs` is the stage's account, `decision.rs` what one rewrite's runs share of it,
//! `append.rs` is what `prefix.rs` reads of the stage, and `chain.rs` is the block a chained
//! Responses request sends (`seen.rs`).

pub mod append;
mod block;
pub(crate) mod catalog;
pub mod chain;
mod classify;
pub mod concise;
pub(super) mod decision;
pub mod inline;
pub mod report;
pub mod stubs;

use std::collections::{BTreeMap, BTreeSet};

pub use block::{sends_block_whole, without_tools};
pub use catalog::Catalog;
pub use classify::{categories_of, current_turn_calls, previous_turn_categories};
pub use inline::definitions_from;
pub use report::Reason;

use super::config::{LeftOut, PipelineConfig};
use super::stage::{Stage, StageCx, StageName, StageOutput};
use crate::openai::{ChatRequest, Message, Tool};
use block::{chosen_tool, demanded_call, first_point, first_turn_block, is_small_block};
use catalog::tool_name;
use classify::turn_scores;
pub use decision::Planned;
use decision::{Block, Decision};
use inline::{Placed, later_needs, placed_definitions};
use report::{CategoryScore, Classified, ToolsDetails};
use stubs::ToolForm;

pub struct ToolsStage;

impl Stage for ToolsStage {
    type Details = ToolsDetails;

    fn name(&self) -> StageName {
        StageName::Tools
    }

    fn enabled(&self, config: &PipelineConfig) -> bool {
        config.tools.enabled
    }

    fn apply(&self, request: &ChatRequest, cx: &StageCx<'_>) -> StageOutput<ToolsDetails> {
        let Some(tools) = request.tools.get().filter(|t| !t.is_empty()) else {
            return StageOutput::unchanged(ToolsDetails::offered(0));
        };
        if let Some(choice) = demanded_call(request) {
            return StageOutput::unchanged(ToolsDetails {
                tool_choice: Some(choice.clone()),
                ..ToolsDetails::all_sent(tools.len(), Reason::Protected)
            });
        }
        let config = &cx.config.tools;
        let tool_tokens = cx.counter.tools(tools);
        if is_small_block(tool_tokens, config) {
            return StageOutput::unchanged(ToolsDetails {
                tool_tokens: Some(tool_tokens),
                ..ToolsDetails::all_sent(tools.len(), Reason::SmallBlock)
            });
        }
        let decision = cx.decided.tools.get_or_init(|| decide(tools, request, cx));
        if decision.unchanged {
            return StageOutput::unchanged(decision.details.clone());
        }
        let messages = (!decision.placed.is_empty()).then(|| {
            inline::insert(
                request.messages.clone(),
                cx.original_messages,
                &decision.placed,
            )
        });
        StageOutput {
            messages,
            tools: Some(decision.kept.clone()),
            details: decision.details.clone(),
        }
    }

    /// Definitions placed in the messages make them longer; the stubs beside them make the
    /// request shorter (the pipeline as a whole still never grows a prompt).
    fn structural(&self) -> bool {
        true
    }
}

/// The stage's plan of `request` (`Planned`), `cx.original_messages` its client's messages.
fn planned_of(
    catalog: &Catalog,
    tools: &[Tool],
    request: &ChatRequest,
    cx: &StageCx<'_>,
) -> Planned {
    let plan = plan(catalog, tools, request, cx.original_messages, cx);
    let block = Block::of(&plan, tools, cx);
    Planned {
        block,
        reason: plan.reason,
        categories: plan.categories,
        protected: plan.protected,
    }
}

/// What a whole rewrite of `request` plans for its tools where this stage decides its block;
/// `None` when it sends the client's block as it is whatever the messages say. What `apply`
/// does, without running the stages before it: the plan reads the client's request, never what
/// those stages made.
pub fn planned(request: &ChatRequest, env: &super::Env<'_>) -> Option<Planned> {
    if sends_block_whole(request, env.config, env.counter) {
        return None;
    }
    let tools = request.tools.get()?;
    StageCx::first_pass(env, &request.messages, |cx| {
        let catalog = Catalog::memoized(tools, &env.config.tools, env.memo);
        Some(planned_of(&catalog, tools, request, cx))
    })
}

fn decide(tools: &[Tool], request: &ChatRequest, cx: &StageCx<'_>) -> Decision {
    let config = &cx.config.tools;
    let catalog = Catalog::memoized(tools, config, cx.memo);
    let Planned {
        block,
        reason,
        categories,
        protected,
    } = (cx.decided.planned.take()).unwrap_or_else(|| planned_of(&catalog, tools, request, cx));
    // Scores of the current turn, for the report (the block was decided at the first).
    let scores = turn_scores(&catalog, cx.original_messages, config, cx.memo);
    let stubbed = block.forms.values().filter(|f| f.is_stub()).count();
    let scores = scores
        .iter()
        .map(|(name, (score, keywords))| {
            let score = CategoryScore {
                score: *score,
                keywords: keywords.clone(),
            };
            (name.clone(), score)
        })
        .collect();
    let details = ToolsDetails {
        sent: Some(block.kept.len() - stubbed),
        stubs: Some(stubbed),
        inline: (block.defined_inline > 0).then_some(block.defined_inline),
        reason: Some(reason),
        classifier: Some(Classified {
            forms: block.forms,
            categories,
            scores,
            sticky: cx.sticky_categories.to_vec(),
            protected,
        }),
        ..ToolsDetails::offered(tools.len())
    };
    Decision {
        unchanged: block.unchanged,
        kept: block.kept,
        details,
        placed: block.placed,
    }
}

impl Block {
    fn of(plan: &Plan, tools: &[Tool], cx: &StageCx<'_>) -> Block {
        let config = &cx.config.tools;
        // Left-out tools become stubs in place (the block keeps the client's order), unless
        // they are removed. Tools without a function name (other tool types) are always kept.
        let defined_inline: BTreeSet<&str> = plan
            .placed
            .iter()
            .flat_map(|p| p.names.iter().map(String::as_str))
            .collect();
        let mut forms = BTreeMap::new();
        let mut kept: Vec<Tool> = Vec::with_capacity(tools.len());
        for tool in tools {
            let Some(name) = tool_name(tool) else {
                kept.push(tool.clone());
                continue;
            };
            let form = if plan.full.contains(name) {
                kept.push(concise::concise(tool));
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
        let placed = placed_definitions(&plan.placed, tools, config.definitions);
        Block {
            // Every tool in full is not the client's block when a full tool is concise.
            unchanged: placed.is_empty() && kept == tools,
            defined_inline: defined_inline.len(),
            kept,
            forms,
            placed,
        }
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
    let block = first_turn_block(catalog, tools, &original[..first], sticky, config, cx.memo);
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
    let mut needs = later_needs(catalog, original, first, words, cx.memo);
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

#[cfg(test)]
mod tests;
