//! Counting a chat request's rewrite into the metrics: tokens by phase and stage, compactions,
//! tools, the classifier's reason and the budget's outcome, read from the typed stage reports.

use super::{BudgetOutcome, ChatLabels, Compaction, Metrics, TokenPhase, ToolPhase};
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
                let sent = if changed { sent } else { tools.offered };
                for (phase, n) in [(ToolPhase::Offered, tools.offered), (ToolPhase::Sent, sent)] {
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
}
