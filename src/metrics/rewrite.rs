//! Counting a chat request's rewrite into the metrics: tokens by phase and stage, compactions,
//! tools, the classifier's reason and the budget's outcome, read from the typed stage reports.

use super::{
    BudgetOutcome, ChainToolsOutcome, ChatLabels, Compaction, Metrics, TokenPhase, ToolPhase,
};
use crate::pipeline::{Rewrite, StageName};

impl Metrics {
    /// A rewrite sent upstream (optimize mode): what each stage saved, what was compacted, the
    /// tools offered and sent, and the budget's outcome.
    pub fn count_rewrite_sent(
        &self,
        rewrite: &Rewrite,
        outcome: BudgetOutcome,
        labels: &ChatLabels,
    ) {
        self.count_budget(outcome, labels);
        let report = &rewrite.report;
        let (model, tenant) = (labels.model.as_str(), labels.tenant.as_str());
        for (phase, tokens) in [
            (TokenPhase::Original, report.tokens_before),
            (TokenPhase::Sent, report.tokens_after),
        ] {
            self.prompt_tokens
                .with_label_values(&[phase.as_str(), model, tenant])
                .inc_by(tokens as u64);
        }
        for (stage, saved) in report.savings_by_stage() {
            self.tokens_saved
                .with_label_values(&[stage.as_str(), model, tenant])
                .inc_by(saved as u64);
        }
        let changed = rewrite.changed();
        if changed
            && let Some(compact) = report
                .stage(StageName::Compact)
                .and_then(|s| s.details.compact())
        {
            for (method, n) in [
                (Compaction::Cleared, compact.cleared),
                (Compaction::Json, compact.json_compacted),
                (Compaction::Text, compact.text_compacted),
            ] {
                if n > 0 {
                    self.compactions
                        .with_label_values(&[method.as_str()])
                        .inc_by(n as u64);
                }
            }
        }
        if let Some(tools) = report
            .stage(StageName::Tools)
            .and_then(|s| s.details.tools())
        {
            if let Some(sent) = tools.sent {
                // The tools stage's choice stands unless the whole rewrite was dropped.
                let (sent, stubs, defined) = if changed {
                    (sent, tools.stubs.unwrap_or(0), tools.inline.unwrap_or(0))
                } else {
                    (tools.offered, 0, 0)
                };
                for (phase, n) in [
                    (ToolPhase::Offered, tools.offered),
                    (ToolPhase::Sent, sent),
                    (ToolPhase::Stub, stubs),
                    (ToolPhase::Defined, defined),
                ] {
                    self.tools
                        .with_label_values(&[phase.as_str()])
                        .inc_by(n as u64);
                }
            }
            if let Some(reason) = tools.reason {
                self.tool_filter_decisions
                    .with_label_values(&[reason.as_str()])
                    .inc();
            }
        }
    }

    /// A rewrite only observed (observe mode): the original was sent, so prompt tokens count it
    /// as sent, and what the stages would have saved goes to its own counter.
    pub fn count_rewrite_observed(&self, rewrite: &Rewrite, labels: &ChatLabels) {
        let report = &rewrite.report;
        let (model, tenant) = (labels.model.as_str(), labels.tenant.as_str());
        for phase in TokenPhase::ALL {
            self.prompt_tokens
                .with_label_values(&[phase.as_str(), model, tenant])
                .inc_by(report.tokens_before as u64);
        }
        for (stage, saved) in report.savings_by_stage() {
            self.tokens_saveable
                .with_label_values(&[stage.as_str(), model, tenant])
                .inc_by(saved as u64);
        }
    }

    pub fn count_budget(&self, outcome: BudgetOutcome, labels: &ChatLabels) {
        self.budget_outcomes
            .with_label_values(&[outcome.as_str(), &labels.model, &labels.tenant])
            .inc();
    }

    /// A chained Responses request's tool block, or a block remembered for a chain.
    pub fn count_chain_tools(&self, outcome: ChainToolsOutcome, labels: &ChatLabels) {
        self.chain_tools
            .with_label_values(&[&labels.model, &labels.tenant, outcome.as_str()])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::ChatRequest;
    use crate::pipeline::report::{CompactDetails, ToolsDetails};
    use crate::pipeline::tools::Reason;
    use crate::pipeline::{PipelineReport, StageDetails, StageReport};

    fn rewrite(stages: Vec<StageReport>) -> Rewrite {
        let request = ChatRequest::parse(br#"{"model":"m","messages":[]}"#);
        Rewrite {
            request: request.unwrap_or_else(|e| panic!("{e:?}")),
            report: PipelineReport {
                tokens_before: 1_000,
                tokens_after: 400,
                stages,
                budget: 4_000,
                fits: true,
                over_budget: None,
                prefix: None,
            },
            remember: None,
        }
    }

    fn stage(stage: StageName, saved: usize, details: StageDetails) -> StageReport {
        StageReport {
            stage,
            tokens_before: 1_000,
            tokens_after: 1_000 - saved,
            applied: saved > 0,
            details,
        }
    }

    #[test]
    fn a_sent_rewrite_is_counted_from_its_stage_reports() {
        let metrics = Metrics::new().unwrap_or_else(|e| panic!("{e}"));
        let labels = ChatLabels::unknown("default");
        let tools = ToolsDetails {
            sent: Some(2),
            ..ToolsDetails::all_sent(5, Reason::Match)
        };
        let compact = CompactDetails {
            cleared: 3,
            json_compacted: 1,
            text_compacted: 0,
            handles: Vec::new(),
        };
        let rewrite = rewrite(vec![
            stage(StageName::Tools, 100, StageDetails::Tools(tools)),
            stage(StageName::Compact, 500, StageDetails::Compact(compact)),
        ]);
        metrics.count_rewrite_sent(&rewrite, BudgetOutcome::Fit, &labels);

        let tools = |phase: ToolPhase| metrics.tools.with_label_values(&[phase.as_str()]).get();
        assert_eq!((tools(ToolPhase::Offered), tools(ToolPhase::Sent)), (5, 2));
        let compactions = |method: Compaction| {
            metrics
                .compactions
                .with_label_values(&[method.as_str()])
                .get()
        };
        assert_eq!(compactions(Compaction::Cleared), 3);
        assert_eq!(compactions(Compaction::Json), 1);
        assert_eq!(compactions(Compaction::Text), 0);
        let reason = Reason::Match.as_str();
        assert_eq!(
            metrics
                .tool_filter_decisions
                .with_label_values(&[reason])
                .get(),
            1
        );
        let saved = |stage: StageName| {
            metrics
                .tokens_saved
                .with_label_values(&[stage.as_str(), "other", "default"])
                .get()
        };
        assert_eq!(
            (saved(StageName::Tools), saved(StageName::Compact)),
            (100, 500)
        );
        let budget = metrics
            .budget_outcomes
            .with_label_values(&[BudgetOutcome::Fit.as_str(), "other", "default"])
            .get();
        assert_eq!(budget, 1);
    }

    #[test]
    fn a_rewrite_dropped_whole_counts_every_tool_as_sent() {
        let metrics = Metrics::new().unwrap_or_else(|e| panic!("{e}"));
        let tools = ToolsDetails {
            sent: Some(2),
            ..ToolsDetails::all_sent(5, Reason::Match)
        };
        // No stage applied: the client's request went upstream as it was.
        let rewrite = rewrite(vec![stage(StageName::Tools, 0, StageDetails::Tools(tools))]);
        let labels = ChatLabels::unknown("default");
        metrics.count_rewrite_sent(&rewrite, BudgetOutcome::Fit, &labels);
        let sent = metrics
            .tools
            .with_label_values(&[ToolPhase::Sent.as_str()])
            .get();
        assert_eq!(sent, 5);
    }
}
