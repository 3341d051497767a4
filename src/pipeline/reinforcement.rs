//! When a conversation gets long, the route's reminder (`[reinforcement]`) ends the system
//! message, so the model keeps following its operating mode. Added by
//! `run` after every other stage: it is the last section, and the budget makes room for it.

use serde::Serialize;

use crate::guards::ReinforcementConfig;
use crate::openai::{Message, Role};

/// `reinforcement`: the reminder added, for a conversation this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReinforcementDetails {
    pub messages: usize,
}

/// Messages of the conversation, system and developer messages not counted.
pub fn conversation_length(messages: &[Message]) -> usize {
    messages
        .iter()
        .filter(|m| !matches!(m.role, Role::System | Role::Developer))
        .count()
}

/// The reminder to add to this request, if any.
pub fn reminder<'a>(messages: &[Message], config: &'a ReinforcementConfig) -> Option<&'a str> {
    let text = config.text.trim();
    (config.enabled && !text.is_empty() && conversation_length(messages) > config.after_messages)
        .then_some(text)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::openai::{ChatRequest, Content};
    use crate::pipeline::StageName;
    use crate::pipeline::{Env, Memo, PipelineConfig, run};
    use crate::tokens::{Encoding, TokenCounter};

    fn conversation(turns: usize, system: bool) -> ChatRequest {
        let mut messages = Vec::new();
        if system {
            messages.push(json!({"role": "system", "content": "You are a filing agent."}));
        }
        for turn in 0..turns {
            messages.push(json!({"role": "user", "content": format!("File report {turn}.")}));
            messages.push(json!({"role": "assistant", "content": format!("Filed report {turn}.")}));
        }
        messages.push(json!({"role": "user", "content": "And the next one?"}));
        serde_json::from_value(json!({"model": "gpt-4o", "messages": messages})).unwrap()
    }

    fn rewritten(request: &ChatRequest, budget: usize) -> crate::pipeline::Rewrite {
        let reinforcement = ReinforcementConfig {
            enabled: true,
            after_messages: 6,
            text: "REMINDER: use the tools.".into(),
        };
        run(
            request,
            &Env {
                config: &PipelineConfig::default(),
                counter: &TokenCounter::new(Encoding::O200kBase),
                memo: &Memo::default(),
                budget,
                sticky_categories: &[],
                reinforcement: Some(&reinforcement),
                remembered: None,
            },
        )
    }

    fn system_text(request: &ChatRequest) -> String {
        match request.messages[0].content.get() {
            Some(Content::Text(text)) if request.messages[0].role == Role::System => {
                text.to_string()
            }
            _ => String::new(),
        }
    }

    #[test]
    fn the_reminder_ends_the_system_message_past_the_threshold_only() {
        // 3 turns + the question = 7 messages: past 6.
        let long = rewritten(&conversation(3, true), 4_000);
        let text = system_text(&long.request);
        assert!(text.starts_with("You are a filing agent."), "{text}");
        assert!(text.ends_with("\n\nREMINDER: use the tools."), "{text}");
        let stage = long.report.stages.last().unwrap();
        assert_eq!(
            (stage.stage, stage.applied),
            (StageName::Reinforcement, true)
        );
        assert!(stage.tokens_after > stage.tokens_before);
        assert_eq!(long.report.tokens_after, stage.tokens_after);

        // 2 turns + the question = 5 messages: nothing added.
        let short = rewritten(&conversation(2, true), 4_000);
        assert_eq!(system_text(&short.request), "You are a filing agent.");
        assert!(
            short
                .report
                .stages
                .iter()
                .all(|s| s.stage != "reinforcement")
        );

        // No system message: one is added first.
        let bare = rewritten(&conversation(4, false), 4_000);
        assert_eq!(system_text(&bare.request), "REMINDER: use the tools.");
        assert_eq!(bare.request.messages.len(), 10);
    }

    #[test]
    fn the_budget_makes_room_for_the_reminder() {
        let request = conversation(40, true);
        let free = rewritten(&request, 1_000_000);
        let budget = free.report.tokens_after - 30;
        let held = rewritten(&request, budget);
        assert!(held.report.fits, "{:?}", held.report);
        assert!(held.report.tokens_after <= budget);
        assert!(system_text(&held.request).ends_with("REMINDER: use the tools."));
        let saved: usize = held.report.savings_by_stage().iter().map(|(_, n)| n).sum();
        assert_eq!(saved, held.report.tokens_before - held.report.tokens_after);
    }
}
