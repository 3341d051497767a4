//! What a rewrite reports, stage by stage, as typed values: the explain output, the recording
//! and the metrics all read these fields, so renaming one is a compile error, not a metric that
//! silently stops counting. The serialized form is the explain JSON (golden-tested).

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::budget::OverBudget;
use super::prefix::PrefixReport;
use super::tools::Reason;
use super::tools::stubs::ToolForm;

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

/// What one stage did to one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageReport {
    pub stage: StageName,
    pub tokens_before: usize,
    pub tokens_after: usize,
    /// False when the stage had nothing to do or its result was not smaller.
    pub applied: bool,
    pub details: StageDetails,
}

/// A stage's own account of what it did: one variant per stage, serialized as the variant's
/// fields alone.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StageDetails {
    System(SystemDetails),
    Window(WindowDetails),
    Tools(ToolsDetails),
    Compact(CompactDetails),
    Budget(BudgetDetails),
    Reinforcement(ReinforcementDetails),
    Append(AppendDetails),
}

impl StageDetails {
    pub fn tools(&self) -> Option<&ToolsDetails> {
        match self {
            StageDetails::Tools(details) => Some(details),
            _ => None,
        }
    }

    pub fn compact(&self) -> Option<&CompactDetails> {
        match self {
            StageDetails::Compact(details) => Some(details),
            _ => None,
        }
    }
}

/// `system`: system messages merged into one, empty and duplicated ones dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct SystemDetails {
    pub merged: usize,
    pub dropped_empty: usize,
    pub dropped_duplicate: usize,
}

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

/// `tools`: the tool definitions offered and sent, and why. Which fields are present depends
/// on how the decision was made (no tools, a demanded call, a small block, the classifier).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolsDetails {
    pub offered: usize,
    /// Sent in full.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sent: Option<usize>,
    /// Sent as stubs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stubs: Option<usize>,
    /// Of the stubs, those whose full definitions are in the messages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inline: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// The client's `tool_choice` that demands a call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Value>,
    /// The size of a block sent whole for being small.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_tokens: Option<usize>,
    #[serde(flatten)]
    pub classifier: Option<Classified>,
}

impl ToolsDetails {
    /// `offered` tools, nothing decided.
    pub fn offered(offered: usize) -> ToolsDetails {
        ToolsDetails {
            offered,
            sent: None,
            stubs: None,
            inline: None,
            reason: None,
            tool_choice: None,
            tool_tokens: None,
            classifier: None,
        }
    }

    /// Marks the named stubs as defined in the messages (what an appended request placed).
    pub fn define(&mut self, names: &std::collections::BTreeSet<String>) {
        let Some(classified) = self.classifier.as_mut() else {
            return;
        };
        for (name, form) in classified.forms.iter_mut() {
            if *form == ToolForm::Stub && names.contains(name) {
                *form = ToolForm::Inline;
            }
        }
        let inline = classified
            .forms
            .values()
            .filter(|f| **f == ToolForm::Inline)
            .count();
        self.inline = (inline > 0).then_some(inline);
    }

    /// Every one of `offered` tools sent, for `reason`.
    pub fn all_sent(offered: usize, reason: Reason) -> ToolsDetails {
        ToolsDetails {
            sent: Some(offered),
            reason: Some(reason),
            ..ToolsDetails::offered(offered)
        }
    }
}

/// What the classifier saw: the categories chosen, each category's score and keywords, the
/// conversation's sticky categories and the tools protected by the history.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Classified {
    /// Each function tool: sent in full, as a stub, or removed.
    pub forms: BTreeMap<String, ToolForm>,
    pub categories: Vec<String>,
    pub scores: BTreeMap<String, CategoryScore>,
    pub sticky: Vec<String>,
    pub protected: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CategoryScore {
    pub score: f64,
    pub keywords: Vec<String>,
}

/// `compact`: tool results cleared to a stub, or compacted as JSON or as text.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct CompactDetails {
    pub cleared: usize,
    pub json_compacted: usize,
    pub text_compacted: usize,
    /// The handles that the results cleared or cut name (`ctxproxy_recall`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub handles: Vec<String>,
}

/// `budget`: the steps taken to fit the budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BudgetDetails {
    pub budget: usize,
    pub steps: Vec<&'static str>,
    pub fits: bool,
}

/// `reinforcement`: the reminder added, for a conversation this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReinforcementDetails {
    pub messages: usize,
}

/// `append`: messages appended to the conversation's previous rewrite, and how many of them
/// were compacted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AppendDetails {
    pub appended: usize,
    pub compacted: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PipelineReport {
    pub tokens_before: usize,
    pub tokens_after: usize,
    pub stages: Vec<StageReport>,
    /// The budget this request was held to, and whether the result fits in it.
    pub budget: usize,
    pub fits: bool,
    /// When it does not fit: by how much, and which part of the floor is over.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over_budget: Option<OverBudget>,
    /// How the rewrite relates to the conversation's earlier ones (prefix stability).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<PrefixReport>,
}

impl PipelineReport {
    /// More tokens sent than the budget asked, the recall tool's allowance beside it counted
    /// too (`fits`, what `on_exceed` acts on, is judged with the allowance): what `analyze`'s
    /// fidelity table and `eval_fidelity.py` count as over budget.
    pub fn over_its_budget(&self) -> bool {
        self.tokens_after > self.budget
    }

    /// Tokens saved by each stage, summing exactly to `tokens_before - tokens_after`: the few
    /// tokens a structural stage may add are charged to the next stages that save.
    pub fn savings_by_stage(&self) -> Vec<(StageName, usize)> {
        let mut debt = 0usize;
        let mut savings = Vec::new();
        for stage in self.stages.iter().filter(|s| s.applied) {
            if stage.tokens_after > stage.tokens_before {
                debt += stage.tokens_after - stage.tokens_before;
                continue;
            }
            let saved = stage.tokens_before - stage.tokens_after;
            let net = saved.saturating_sub(debt);
            debt = debt.saturating_sub(saved);
            if net > 0 {
                savings.push((stage.stage, net));
            }
        }
        // Tokens added after the last saving stage (the reinforcement reminder) are charged to
        // the savers before it, latest first.
        for (_, saved) in savings.iter_mut().rev() {
            let charged = debt.min(*saved);
            *saved -= charged;
            debt -= charged;
        }
        savings.retain(|(_, saved)| *saved > 0);
        savings
    }

    /// The report of `stage`, when it ran.
    pub fn stage(&self, stage: StageName) -> Option<&StageReport> {
        self.stages.iter().find(|s| s.stage == stage)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn serialized(details: StageDetails) -> String {
        serde_json::to_string(&details).unwrap_or_default()
    }

    #[test]
    fn each_shape_of_the_tools_report_keeps_its_fields_in_order() {
        assert_eq!(
            serialized(StageDetails::Tools(ToolsDetails::offered(0))),
            r#"{"offered":0}"#
        );
        let demanded = ToolsDetails {
            tool_choice: Some(json!("required")),
            ..ToolsDetails::all_sent(3, Reason::Protected)
        };
        assert_eq!(
            serialized(StageDetails::Tools(demanded)),
            r#"{"offered":3,"sent":3,"reason":"protected","tool_choice":"required"}"#
        );
        let small = ToolsDetails {
            tool_tokens: Some(120),
            ..ToolsDetails::all_sent(3, Reason::SmallBlock)
        };
        assert_eq!(
            serialized(StageDetails::Tools(small)),
            r#"{"offered":3,"sent":3,"reason":"small_block","tool_tokens":120}"#
        );
        let classified = ToolsDetails {
            sent: Some(1),
            reason: Some(Reason::NoMatchDrop),
            classifier: Some(Classified {
                forms: BTreeMap::from([("lookup".to_owned(), ToolForm::Full)]),
                categories: vec![],
                scores: BTreeMap::from([(
                    "mail".to_owned(),
                    CategoryScore {
                        score: 0.5,
                        keywords: vec!["send".to_owned()],
                    },
                )]),
                sticky: vec![],
                protected: vec!["lookup".to_owned()],
            }),
            ..ToolsDetails::offered(4)
        };
        assert_eq!(
            serialized(StageDetails::Tools(classified)),
            r#"{"offered":4,"sent":1,"reason":"no_match_drop","forms":{"lookup":"full"},"categories":[],"scores":{"mail":{"score":0.5,"keywords":["send"]}},"sticky":[],"protected":["lookup"]}"#
        );
    }

    #[test]
    fn a_window_with_nothing_to_summarize_reports_three_fields() {
        let details = WindowDetails {
            turns: 2,
            verbatim_turns: 2,
            target: None,
            reason: "adaptive",
            summary: None,
        };
        assert_eq!(
            serialized(StageDetails::Window(details)),
            r#"{"turns":2,"verbatim_turns":2,"reason":"adaptive"}"#
        );
    }

    #[test]
    fn stage_names_are_their_metric_labels() {
        for stage in StageName::ALL {
            assert_eq!(
                serde_json::to_value(stage).ok(),
                Some(json!(stage.as_str()))
            );
            assert!(stage == stage.as_str());
        }
    }
}
