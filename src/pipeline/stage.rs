//! What every stage shares, and nothing else: the stage's name, the trait it implements, the
//! read-only context it runs in and what it returns. A leaf below every stage, so that a stage's
//! imports say what it reads: this, the config, the tokenizer, the memo, and the helpers it
//! names; never the report that gathers the stages' accounts (`report.rs`, above them).

use serde::Serialize;

use super::config::PipelineConfig;
use super::memo::Memo;
use crate::openai::{ChatRequest, Message, Tool};
use crate::tokens::TokenCounter;

/// The pipeline's stages, in the order they run (also the `stage` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StageName {
    System,
    Window,
    Tools,
    Compact,
    Budget,
    Reinforcement,
    Append,
}

impl StageName {
    pub const ALL: [StageName; 7] = [
        StageName::System,
        StageName::Window,
        StageName::Tools,
        StageName::Compact,
        StageName::Budget,
        StageName::Reinforcement,
        StageName::Append,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StageName::System => "system",
            StageName::Window => "window",
            StageName::Tools => "tools",
            StageName::Compact => "compact",
            StageName::Budget => "budget",
            StageName::Reinforcement => "reinforcement",
            StageName::Append => "append",
        }
    }
}

impl std::fmt::Display for StageName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stage by its name, as the explain output and the metrics spell it.
impl PartialEq<&str> for StageName {
    fn eq(&self, name: &&str) -> bool {
        self.as_str() == *name
    }
}

/// Knobs the stages read. The budget stage tightens them step by step.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Upper bound on verbatim turns, below the adaptive choice (budget only).
    pub window_turns_cap: Option<usize>,
    pub max_segments: usize,
    pub keep_recent_results: usize,
    pub tool_result_max_tokens: usize,
    pub max_string_chars: usize,
}

impl Params {
    pub fn from_config(config: &PipelineConfig) -> Params {
        Params {
            window_turns_cap: None,
            max_segments: config.window.max_segments,
            keep_recent_results: config.compact.keep_recent_results,
            tool_result_max_tokens: config.compact.tool_result_max_tokens,
            max_string_chars: config.compact.max_string_chars,
        }
    }
}

/// Read-only context of a stage.
pub struct StageCx<'a> {
    pub config: &'a PipelineConfig,
    pub params: &'a Params,
    pub counter: &'a TokenCounter,
    pub memo: &'a Memo,
    /// Tool categories of this conversation's last tool-using turn (from the store).
    pub sticky_categories: &'a [String],
    /// The messages the client sent, before any stage: what a classifier reads, so that a
    /// smaller window never changes which tools are chosen.
    pub original_messages: &'a [Message],
    /// What stages decided from the client's request alone, shared by the runs of one rewrite.
    pub decided: &'a Decided,
}

impl StageCx<'_> {
    /// `run` with the context of a whole rewrite's first pass over the client's messages
    /// `original`: the configured parameters, nothing decided yet.
    pub fn first_pass<T>(
        env: &super::Env<'_>,
        original: &[Message],
        run: impl FnOnce(&StageCx<'_>) -> T,
    ) -> T {
        let (params, decided) = (Params::from_config(env.config), Decided::default());
        run(&StageCx {
            config: env.config,
            params: &params,
            counter: env.counter,
            memo: env.memo,
            sticky_categories: env.sticky_categories,
            original_messages: original,
            decided: &decided,
        })
    }
}

#[cfg(test)]
impl<'a> StageCx<'a> {
    /// A stage's context for a test: `original` as the client's messages, no sticky categories.
    pub fn test(
        (config, params): (&'a PipelineConfig, &'a Params),
        counter: &'a TokenCounter,
        memo: &'a Memo,
        original: &'a [Message],
        decided: &'a Decided,
    ) -> StageCx<'a> {
        StageCx {
            config,
            params,
            counter,
            memo,
            sticky_categories: &[],
            original_messages: original,
            decided,
        }
    }
}

/// What a stage decides from the client's request alone (not from `Params`), made once per
/// rewrite (or before it, `planned`): the budget's re-runs of the stages read it instead of
/// deciding again.
#[derive(Default)]
pub struct Decided {
    pub tools: std::cell::OnceCell<super::tools::decision::Decision>,
    /// The tools stage's plan, when it was made before the rewrite (`tools::planned`) for the
    /// same messages: taken by the first pass's decision.
    pub planned: std::cell::Cell<Option<super::tools::decision::Planned>>,
}

/// What a stage produced: new messages and/or tools (`None` when unchanged) and a description
/// of what it did.
pub struct StageOutput<Details> {
    pub messages: Option<Vec<Message>>,
    /// The tool definitions to send; an empty list removes tools (and `tool_choice`).
    pub tools: Option<Vec<Tool>>,
    pub details: Details,
}

impl<Details> StageOutput<Details> {
    pub fn unchanged(details: Details) -> StageOutput<Details> {
        StageOutput {
            messages: None,
            tools: None,
            details,
        }
    }
}

/// One rewriting step: reads the request, returns what it would change. Stages borrow, so a
/// stage with nothing to do costs no copy.
pub trait Stage {
    /// The stage's own account of what it did (`report.rs` gathers them in `StageDetails`).
    type Details;
    fn name(&self) -> StageName;
    fn enabled(&self, config: &PipelineConfig) -> bool;
    fn apply(&self, request: &ChatRequest, cx: &StageCx<'_>) -> StageOutput<Self::Details>;
    /// A structural stage's change is kept even when it costs a few tokens (the pipeline as a
    /// whole still never grows a prompt).
    fn structural(&self) -> bool {
        false
    }
}
