//! What a rewrite reports, stage by stage, as typed values: the explain output, the recording
//! and the metrics all read these fields, so renaming one is a compile error, not a metric that
//! silently stops counting. The serialized form is the explain JSON (golden-tested).
//!
//! This module sits above the stages: each stage owns its details type and returns it, and
//! the report gathers them (`StageDetails`) with the token counts of each stage and of the whole
//! rewrite. No stage imports this module.

use std::collections::BTreeSet;

use serde::Serialize;

pub use super::budget::{BudgetDetails, OverBudget};
pub use super::compact::CompactDetails;
pub use super::prefix::{AppendDetails, PrefixReport};
pub use super::reinforcement::ReinforcementDetails;
pub use super::stage::StageName;
pub use super::system::SystemDetails;
pub use super::tools::report::{CategoryScore, Classified, Reason, ToolsDetails};
pub use super::tools::stubs::ToolForm;
pub use super::window::{WindowDetails, WindowSummary, WindowTarget};

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

macro_rules! stage_details_from {
    ($($variant:ident($details:ty)),* $(,)?) => {
        $(impl From<$details> for StageDetails {
            fn from(details: $details) -> StageDetails {
                StageDetails::$variant(details)
            }
        })*
    };
}

stage_details_from!(
    System(SystemDetails),
    Window(WindowDetails),
    Tools(ToolsDetails),
    Compact(CompactDetails),
    Budget(BudgetDetails),
    Reinforcement(ReinforcementDetails),
    Append(AppendDetails),
);

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

    /// The stages of this report, as a request that appends `appended` to its rewrite reports
    /// them: each shifted by the `before` tokens the appended messages had as the client sent
    /// them, the stubs defined since in the messages (`defined`) counted as inline, and a last
    /// stage `append` for what appending saved (`after` tokens as sent), so that the stages
    /// still sum to the whole saving.
    pub fn appended_stages(
        &self,
        (before, after): (usize, usize),
        appended: AppendDetails,
        defined: &BTreeSet<String>,
    ) -> Vec<StageReport> {
        let mut stages: Vec<StageReport> = self
            .stages
            .iter()
            .cloned()
            .map(|mut stage| {
                stage.tokens_before += before;
                stage.tokens_after += before;
                if let StageDetails::Tools(tools) = &mut stage.details
                    && !defined.is_empty()
                {
                    tools.define(defined);
                }
                stage
            })
            .collect();
        stages.push(StageReport {
            stage: StageName::Append,
            tokens_before: self.tokens_after + before,
            tokens_after: self.tokens_after + after,
            applied: appended.compacted > 0,
            details: StageDetails::Append(appended),
        });
        stages
    }

    /// The report of `stage`, when it ran.
    pub fn stage(&self, stage: StageName) -> Option<&StageReport> {
        self.stages.iter().find(|s| s.stage == stage)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

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
