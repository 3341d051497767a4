//! The working set under every budget: the last user message, the assistant message it answers
//! and the agent's latest tool steps reach the upstream whatever the budget, and the older steps
//! of an autonomous loop leave their identifiers behind.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ctxproxy::openai::{ChatRequest, Role};
use ctxproxy::pipeline::working_set::WorkingSet;
use ctxproxy::pipeline::{self, Memo, OverPart, PipelineConfig, Rewrite, StageDetails};
use ctxproxy::synthetic;
use ctxproxy::tokens::{Encoding, TokenCounter};

/// Budgets that stop the ladder at several of its steps (1,290: just above the floor of the
/// 30-turn synthetic chat), and none.
const BUDGETS: [usize; 9] = [
    50, 1_000, 1_290, 1_500, 2_000, 2_500, 3_000, 4_000, 1_000_000,
];

fn run(request: &ChatRequest, budget: usize) -> Rewrite {
    pipeline::run(
        request,
        &pipeline::Env {
            config: &PipelineConfig::default(),
            counter: &TokenCounter::new(Encoding::O200kBase),
            memo: &Memo::default(),
            budget,
            sticky_categories: &[],
            reinforcement: None,
            remembered: None,
        },
    )
}

#[test]
fn the_answered_proposal_and_the_reply_survive_every_budget_step() {
    let request = synthetic::conversation(30).unwrap();
    let ws = WorkingSet::of(&request.messages, 4);
    let answered = ws
        .answered
        .clone()
        .expect("an assistant message before the user");
    let last_user = &request.messages[ws.last_user.unwrap()];
    let mut steps_seen = std::collections::BTreeSet::new();
    for budget in BUDGETS {
        let rewrite = run(&request, budget);
        let sent = &rewrite.request.messages;
        for index in answered.clone() {
            assert!(
                sent.contains(&request.messages[index]),
                "budget {budget}: answered message {index} cut"
            );
        }
        assert_eq!(sent.last(), Some(last_user), "budget {budget}");
        if let Some(budget_stage) = rewrite.report.stages.iter().find(|s| s.stage == "budget") {
            let StageDetails::Budget(details) = &budget_stage.details else {
                panic!("budget details: {:?}", budget_stage.details)
            };
            steps_seen.insert(details.steps.len());
        }
    }
    // The budgets walk the ladder, down to its last step.
    assert!(steps_seen.len() >= 3, "{steps_seen:?}");
    assert!(steps_seen.contains(&6), "{steps_seen:?}");
}

#[test]
fn an_autonomous_loop_keeps_its_latest_steps_and_the_ids_of_the_older_ones() {
    let request = synthetic::autonomous_agent(60).unwrap();
    let ws = WorkingSet::of(&request.messages, 4);
    for budget in BUDGETS {
        let rewrite = run(&request, budget);
        let sent = &rewrite.request.messages;
        let text = serde_json::to_string(&rewrite.request).unwrap();
        // The task and the last 4 steps (8 messages) are sent: the calls as they were, the
        // results with every identifier and number (only prose may be shortened).
        assert_eq!(sent[1], request.messages[1], "budget {budget}");
        let tail = &request.messages[ws.recent_from..];
        assert_eq!(tail.len(), 8);
        for (original, kept) in tail.iter().zip(&sent[sent.len() - 8..]) {
            if original.role != Role::Tool {
                assert_eq!(kept, original, "budget {budget}");
                continue;
            }
            let kept = kept.content.get().unwrap().text().into_owned();
            let original = original.content.get().unwrap().text().into_owned();
            for token in original.split(|c: char| "\",:{}[] ".contains(c)) {
                if token.chars().any(|c| c.is_ascii_digit()) {
                    assert!(kept.contains(token), "budget {budget}: {token} lost");
                }
            }
        }
        // The late call reuses an id found only in the third result: still there.
        assert!(text.contains("TKT-00201"), "budget {budget}");
        // The older results are stubs that name their call, but for the latest few, which
        // wait for a whole batch of `clear_at_least_tokens` (they are sent compacted).
        let stubs = sent
            .iter()
            .filter(|m| m.role == Role::Tool)
            .filter(|m| {
                m.content
                    .get()
                    .is_some_and(|c| c.text().starts_with("[search_tickets("))
            })
            .count();
        assert!(
            (60 - 4 - 3..=60 - 4).contains(&stubs),
            "budget {budget}: {stubs}"
        );
        if budget < 4_000 {
            let over = rewrite.report.over_budget.expect("the floor is over");
            // Counted past the recall tool's allowance beside the budget.
            let allowance = rewrite.report.tokens_after - budget - over.tokens_over;
            assert!(allowance <= 64, "budget {budget}: {allowance}");
            // The system prompt and the two tools are small: the working set and the stubs
            // are what is over, unless the budget is tinier than the prompt itself.
            if budget >= 500 {
                assert!(
                    matches!(over.part, OverPart::WorkingSet | OverPart::History),
                    "budget {budget}: {:?}",
                    over.part
                );
            }
        }
    }
}
