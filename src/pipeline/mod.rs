//! The rewriting pipeline: ordered, pure, synchronous stages over an owned chat request
//! (ARCHITECTURE.md, principle 1): `system → window → tools → compact → budget →
//! reinforcement`, run whole or, between recompactions, replaced by an append (`prefix`).
//!
//! No I/O, no clock, no randomness here: the same request and config always give the same
//! rewrite, so rewrites are golden-tested and stable across replicas and turns. A stage whose
//! result is not smaller is dropped for that request, so the pipeline never grows a prompt;
//! the one exception is a conversation's tool block (`tools`), kept once decided.

mod budget;
mod compact;
pub mod config;
pub(crate) mod identifiers;
mod memo;
pub mod payload;
pub mod prefix;
mod reads;
pub mod recall;
mod reinforcement;
pub mod report;
pub mod seen;
mod stage;
mod system;
pub(crate) mod text;
pub mod tools;
mod window;
pub mod working_set;

use std::borrow::Cow;

pub use budget::{Floor, OverBudget, OverPart};
pub use config::{Mode, OnExceed, PipelineConfig};
pub use memo::Memo;
pub use prefix::{PrefixReport, PrefixState, Rebuilt};
pub use report::{PipelineReport, StageDetails, StageReport};
pub use stage::{Decided, Params, Stage, StageCx, StageName, StageOutput};

use crate::guards::ReinforcementConfig;
use crate::openai::{ChatRequest, Message, Nullable};
use crate::tokens::TokenCounter;

/// A rewritten request and how it was obtained.
#[derive(Debug, Clone)]
pub struct Rewrite {
    pub request: ChatRequest,
    pub report: PipelineReport,
    /// What the store should remember of the conversation (prefix stability).
    pub remember: Option<PrefixState>,
}

impl Rewrite {
    pub fn changed(&self) -> bool {
        self.report.stages.iter().any(|s| s.applied)
    }
}

/// What the pipeline runs with, besides the request.
#[derive(Clone, Copy)]
pub struct Env<'a> {
    pub config: &'a PipelineConfig,
    pub counter: &'a TokenCounter,
    /// Saves work across calls; never changes a result.
    pub memo: &'a Memo,
    pub budget: usize,
    pub sticky_categories: &'a [String],
    /// The route's `[reinforcement]`: a reminder ending the system message of long
    /// conversations.
    pub reinforcement: Option<&'a ReinforcementConfig>,
    /// Where the conversation's rewrite was last rebuilt, as the store remembers it: a point
    /// to resume the prefix decisions from (they are the same without it).
    pub remembered: Option<PrefixState>,
}

/// A stage as the run loop drives it: its details gathered in the report's `StageDetails`.
trait Reported {
    fn name(&self) -> StageName;
    fn enabled(&self, config: &PipelineConfig) -> bool;
    fn structural(&self) -> bool;
    fn apply(&self, request: &ChatRequest, cx: &StageCx<'_>) -> StageOutput<StageDetails>;
}

impl<S: Stage> Reported for S
where
    S::Details: Into<StageDetails>,
{
    fn name(&self) -> StageName {
        Stage::name(self)
    }

    fn enabled(&self, config: &PipelineConfig) -> bool {
        Stage::enabled(self, config)
    }

    fn structural(&self) -> bool {
        Stage::structural(self)
    }

    fn apply(&self, request: &ChatRequest, cx: &StageCx<'_>) -> StageOutput<StageDetails> {
        let output = Stage::apply(self, request, cx);
        StageOutput {
            messages: output.messages,
            tools: output.tools,
            details: output.details.into(),
        }
    }
}

/// The stages before the budget, in order.
fn stages() -> [&'static dyn Reported; 4] {
    [
        &system::SystemStage,
        &window::WindowStage,
        &tools::ToolsStage,
        &compact::CompactStage,
    ]
}

/// The rewrite of `request`: rebuilt whole when that pays for the provider's prompt cache it
/// invalidates, else the conversation's last rewrite with the new messages appended
/// (`prefix.rs`).
pub fn run(request: &ChatRequest, env: &Env<'_>) -> Rewrite {
    let _reads = reads::ReadScope::enter();
    // The recall tool is the proxy's, allowed beside the budget: offering it never makes the
    // stages cut more of the client's context. The report says the client's budget; what is
    // over it is counted past the allowance.
    let allowance = recall::allowance(request, env.config, env.counter);
    if allowance == 0 {
        return prefix::run(request, env);
    }
    let widened = Env {
        budget: env.budget + allowance,
        ..*env
    };
    let mut rewrite = prefix::run(request, &widened);
    rewrite.report.budget = env.budget;
    rewrite
}

/// Runs every enabled stage, then holds the result to `env.budget` tokens.
fn whole(request: &ChatRequest, env: &Env<'_>) -> Rewrite {
    whole_counted(request, env, env.counter.request(request), None).with_over_budget(env)
}

/// `whole`, for a request of `tokens_before` tokens (`TokenCounter::request`), with the tools
/// stage's plan when it was made already (`tools::planned` of the same request and `env`).
/// Its report's `over_budget` is left to `with_over_budget`: most whole rewrites of a
/// conversation's earlier points are made only to decide, and are never sent.
fn whole_counted(
    request: &ChatRequest,
    env: &Env<'_>,
    tokens_before: usize,
    planned: Option<tools::Planned>,
) -> Rewrite {
    let (config, counter) = (env.config, env.counter);
    let reminder = env
        .reinforcement
        .and_then(|r| reinforcement::reminder(&request.messages, r));
    // The reminder is added last, so the stages make room for it.
    let reserve = reminder.map_or(0, |text| counter.text(text) + 2);
    let budget = env.budget.saturating_sub(reserve);
    let params = Params::from_config(config);
    let decided = Decided::default();
    decided.planned.set(planned);
    let (rewritten, mut stages, mut tokens_after) =
        run_stages(request, tokens_before, env, &params, &decided);
    let mut best = rewritten;

    if config.budget.enabled && tokens_after > budget {
        let first_pass = tokens_after;
        let (fitted, fitted_tokens, details) =
            budget::fit(request, config, budget, first_pass, &|p| {
                let (rewritten, _, tokens) = run_stages(request, tokens_before, env, p, &decided);
                (rewritten.into_owned(), tokens)
            });
        let report = StageReport {
            stage: StageName::Budget,
            tokens_before: first_pass,
            tokens_after: fitted_tokens,
            applied: fitted_tokens < first_pass,
            details: details.into(),
        };
        if report.applied {
            best = Cow::Owned(fitted);
            tokens_after = report.tokens_after;
        }
        stages.push(report);
    }
    // A conversation's tool block, once decided, is kept even when the definitions placed in
    // the messages outweigh what its stubs save on one request: sending the original instead
    // would change the block, and the provider's cached prefix with it, twice.
    let block_decided = stages
        .iter()
        .any(|s| s.stage == StageName::Tools && s.applied);
    if tokens_after >= tokens_before && stages.iter().any(|s| s.applied) && !block_decided {
        // Structural changes alone never make a prompt larger: send the original.
        best = Cow::Borrowed(request);
        tokens_after = tokens_before;
        for stage in &mut stages {
            stage.applied = false;
            stage.tokens_after = stage.tokens_before;
        }
    }
    if let Some(text) = reminder {
        let mut reminded = best.into_owned();
        system::append_reminder(&mut reminded, text);
        let tokens = counter.request(&reminded);
        stages.push(StageReport {
            stage: StageName::Reinforcement,
            tokens_before: tokens_after,
            tokens_after: tokens,
            applied: true,
            details: StageDetails::Reinforcement(reinforcement::ReinforcementDetails {
                messages: reinforcement::conversation_length(&request.messages),
            }),
        });
        tokens_after = tokens;
        best = Cow::Owned(reminded);
    }
    Rewrite::held_to(
        best.into_owned(),
        (tokens_before, tokens_after),
        stages,
        env.budget,
    )
}

impl Rewrite {
    /// The rewrite `request`, with its stage reports and token counts (before, after), held
    /// to `budget`: whether it fits (which part of the floor is over is `with_over_budget`'s).
    fn held_to(
        request: ChatRequest,
        (tokens_before, tokens_after): (usize, usize),
        stages: Vec<StageReport>,
        budget: usize,
    ) -> Rewrite {
        Rewrite {
            request,
            report: PipelineReport {
                tokens_before,
                tokens_after,
                stages,
                budget,
                fits: tokens_after <= budget,
                over_budget: None,
                prefix: None,
            },
            remember: None,
        }
    }

    /// The rewrite with its report's `over_budget`: when it does not fit, which part of the
    /// floor is over. Made from the request and counts `held_to` was given, before anything
    /// else changes them.
    pub(super) fn with_over_budget(mut self, env: &Env<'_>) -> Rewrite {
        let report = &self.report;
        if !report.fits && env.config.budget.enabled {
            self.report.over_budget = Floor::of(
                &self.request,
                env.config.window.recent_tool_steps,
                env.counter,
            )
            .over(report.budget, report.tokens_after);
        }
        self
    }
}

impl Rewrite {
    /// The rewrite of a request that appends to `anchored`: `sent`, its messages appended,
    /// reported as the anchor's stages shifted by the appended messages (`before` tokens as the
    /// client sent them, `after` as sent) and a last stage `append` (`PipelineReport::
    /// appended_stages`), held to the anchor's budget.
    fn appended(
        anchored: &Rewrite,
        sent: ChatRequest,
        (before, after): (usize, usize),
        details: prefix::AppendDetails,
        defined: &std::collections::BTreeSet<String>,
        env: &Env<'_>,
    ) -> Rewrite {
        let anchor = &anchored.report;
        let stages = anchor.appended_stages((before, after), details, defined);
        Rewrite::held_to(
            sent,
            (anchor.tokens_before + before, anchor.tokens_after + after),
            stages,
            anchor.budget,
        )
        .with_over_budget(env)
    }
}

/// The request after each stage of a first pass (before the budget), to tell which stage
/// removed something (`ctxproxy analyze --losses`).
pub fn stage_snapshots(request: &ChatRequest, env: &Env<'_>) -> Vec<(StageName, ChatRequest)> {
    let _reads = reads::ReadScope::enter();
    let mut snapshots = Vec::new();
    run_stages_into(
        request,
        env.counter.request(request),
        env,
        (&Params::from_config(env.config), &Decided::default()),
        Some(&mut snapshots),
    );
    snapshots
}

/// One stage alone over `input`, `original` the client's messages, as a whole rewrite's first
/// pass runs it (the configured parameters, nothing decided yet); `None` for a name that is
/// not one of the four stages. What `benches/stages.rs` times, stage by stage, on the input
/// each stage gets (`stage_snapshots`).
pub fn run_stage(
    name: StageName,
    input: &ChatRequest,
    original: &[Message],
    env: &Env<'_>,
) -> Option<StageOutput<StageDetails>> {
    let stage = stages().into_iter().find(|s| s.name() == name)?;
    let _reads = reads::ReadScope::enter();
    Some(StageCx::first_pass(env, original, |cx| {
        stage.apply(input, cx)
    }))
}

/// The stages run over `request` (of `tokens` tokens) with `params`: the request they leave,
/// their reports, and its tokens. `decided` is shared by the runs of one rewrite.
fn run_stages<'a>(
    request: &'a ChatRequest,
    tokens: usize,
    env: &Env<'_>,
    params: &Params,
    decided: &Decided,
) -> (Cow<'a, ChatRequest>, Vec<StageReport>, usize) {
    run_stages_into(request, tokens, env, (params, decided), None)
}

fn run_stages_into<'a>(
    request: &'a ChatRequest,
    mut tokens: usize,
    env: &Env<'_>,
    (params, decided): (&Params, &Decided),
    mut snapshots: Option<&mut Vec<(StageName, ChatRequest)>>,
) -> (Cow<'a, ChatRequest>, Vec<StageReport>, usize) {
    let (config, counter) = (env.config, env.counter);
    let cx = StageCx {
        config,
        params,
        counter,
        memo: env.memo,
        sticky_categories: env.sticky_categories,
        original_messages: &request.messages,
        decided,
    };
    let tool_tokens = |r: &ChatRequest| counter.tools(r.tools.get().map_or(&[], Vec::as_slice));
    let mut current = Cow::Borrowed(request);
    let mut tools = tool_tokens(request);
    let mut reports = Vec::new();
    for stage in stages() {
        if !stage.enabled(config) {
            continue;
        }
        let output = stage.apply(&current, &cx);
        let mut report = StageReport {
            stage: stage.name(),
            tokens_before: tokens,
            tokens_after: tokens,
            applied: false,
            details: output.details,
        };
        if let Some(messages) = output.messages {
            let after = counter.messages(&messages) + tools;
            if after < tokens || (stage.structural() && messages != current.messages) {
                report.applied = true;
                report.tokens_after = after;
                tokens = after;
                current = Cow::Owned(with_messages(current, messages));
            }
        }
        if let Some(kept) = output.tools {
            let mut owned = current.into_owned();
            if kept.is_empty() {
                tools::without_tools(&mut owned);
            } else {
                owned.tools = Nullable::Value(kept);
            }
            let after_tools = tool_tokens(&owned);
            tokens = tokens - tools + after_tools;
            tools = after_tools;
            report.applied = true;
            report.tokens_after = tokens;
            current = Cow::Owned(owned);
        }
        if let Some(snapshots) = snapshots.as_deref_mut() {
            snapshots.push((stage.name(), current.clone().into_owned()));
        }
        reports.push(report);
    }
    if offers_recall(&reports, config) {
        let client_tools = request.tools.get().map_or(&[][..], Vec::as_slice);
        if recall::can_offer(&current, client_tools) {
            let mut owned = current.into_owned();
            recall::offer(&mut owned);
            let added = tool_tokens(&owned).saturating_sub(tools);
            // Counted by the stage that made it offered: the one that decided the block, or
            // the compaction that named a handle; the stages after it carry it.
            let by = reports
                .iter()
                .position(|r| r.stage == StageName::Tools && r.applied)
                .or_else(|| reports.iter().position(|r| r.stage == StageName::Compact));
            if let Some(by) = by {
                for (i, report) in reports.iter_mut().enumerate().skip(by) {
                    if i > by {
                        report.tokens_before += added;
                    }
                    report.tokens_after += added;
                }
            }
            tokens += added;
            current = Cow::Owned(owned);
        }
    }
    (current, reports, tokens)
}

/// The request offers `ctxproxy_recall` when a result names a handle, and, so that the block
/// stays the same bytes on every turn, whenever the conversation's tool block was decided.
fn offers_recall(reports: &[StageReport], config: &PipelineConfig) -> bool {
    if !recall::enabled(config) {
        return false;
    }
    reports.iter().any(|r| match &r.details {
        // Handles of a compaction whose messages were not kept (not fewer tokens) name nothing.
        StageDetails::Compact(details) => r.applied && !details.handles.is_empty(),
        StageDetails::Tools(_) => r.applied,
        _ => false,
    })
}

/// The request with other messages, copying the rest only when it is still borrowed.
fn with_messages(request: Cow<'_, ChatRequest>, messages: Vec<Message>) -> ChatRequest {
    match request {
        Cow::Owned(mut owned) => {
            owned.messages = messages;
            owned
        }
        Cow::Borrowed(r) => ChatRequest {
            model: r.model.clone(),
            messages,
            stream: r.stream.clone(),
            stream_options: r.stream_options.clone(),
            tools: r.tools.clone(),
            tool_choice: r.tool_choice.clone(),
            functions: r.functions.clone(),
            function_call: r.function_call.clone(),
            response_format: r.response_format.clone(),
            extra: r.extra.clone(),
        },
    }
}
