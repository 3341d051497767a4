//! `system`: every `system` and `developer` message, wherever it stands, becomes one message at
//! position 0 — the first verbatim, later ones after it in order, each in its own XML-tagged
//! section; empty and exactly duplicated ones are dropped.

use serde::Serialize;

use super::config::PipelineConfig;
use super::stage::{Stage, StageCx, StageName, StageOutput};
use crate::openai::{ChatRequest, Content, Message, Role};

/// `system`: system messages merged into one, empty and duplicated ones dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct SystemDetails {
    pub merged: usize,
    pub dropped_empty: usize,
    pub dropped_duplicate: usize,
}

pub struct SystemStage;

fn is_instruction(message: &Message) -> bool {
    matches!(message.role, Role::System | Role::Developer)
}

impl Stage for SystemStage {
    type Details = SystemDetails;

    fn name(&self) -> StageName {
        StageName::System
    }

    fn enabled(&self, config: &PipelineConfig) -> bool {
        config.system.enabled
    }

    /// One system message at position 0 is what models are trained on (and what some chat
    /// templates require), even when the section tags cost a token or two.
    fn structural(&self) -> bool {
        true
    }

    fn apply(&self, request: &ChatRequest, _cx: &StageCx<'_>) -> StageOutput<SystemDetails> {
        let count = request
            .messages
            .iter()
            .filter(|m| is_instruction(m))
            .count();
        let first_is_instruction = request.messages.first().is_some_and(is_instruction);
        if count == 0 || (count == 1 && first_is_instruction) {
            return StageOutput::unchanged(SystemDetails::default());
        }
        let (instructions, rest): (Vec<&Message>, Vec<&Message>) =
            request.messages.iter().partition(|m| is_instruction(m));
        let mut messages = Vec::with_capacity(rest.len() + 1);

        let mut kept: Vec<&Message> = Vec::new();
        let mut seen: Vec<String> = Vec::new();
        let (mut dropped_empty, mut dropped_duplicate) = (0, 0);
        for message in instructions {
            let text = message
                .content
                .get()
                .map(|c| c.text().into_owned())
                .unwrap_or_default();
            if text.trim().is_empty() {
                dropped_empty += 1;
            } else if seen.contains(&text) {
                dropped_duplicate += 1;
            } else {
                seen.push(text);
                kept.push(message);
            }
        }
        let merged = kept.len().saturating_sub(1);
        let mut kept = kept.into_iter();
        if let Some(first) = kept.next() {
            let mut first = first.clone();
            let sections: Vec<String> = kept
                .map(|m| {
                    let tag = m.role.as_str().to_owned();
                    let text = m
                        .content
                        .get()
                        .map(|c| c.text().into_owned())
                        .unwrap_or_default();
                    format!("<{tag}>\n{}\n</{tag}>", text.trim())
                })
                .collect();
            if !sections.is_empty() {
                append_text(&mut first, &sections.join("\n\n"));
            }
            messages.push(first);
        }
        messages.extend(rest.into_iter().cloned());
        StageOutput {
            messages: Some(messages),
            tools: None,
            details: SystemDetails {
                merged,
                dropped_empty,
                dropped_duplicate,
            },
        }
    }
}

/// Adds `text` as the last section of the system message (inserting one when the request has
/// none): the end is the only place where it keeps the prefix stable.
pub fn append_reminder(request: &mut ChatRequest, text: &str) {
    match request.messages.first_mut() {
        Some(first) if is_instruction(first) => append_text(first, text),
        _ => request
            .messages
            .insert(0, Message::text(Role::System, text)),
    }
}

/// Appends a section after a message's own text (prefix stability: the client's text stays
/// first and unchanged).
pub(super) fn append_text(message: &mut Message, section: &str) {
    match message.content.get_mut() {
        Some(Content::Text(text)) => {
            let mut joined = String::with_capacity(text.len() + 2 + section.len());
            joined.push_str(text);
            joined.push_str("\n\n");
            joined.push_str(section);
            *text = joined.into();
        }
        Some(Content::Parts(parts)) => parts.push(crate::openai::ContentPart {
            kind: "text".into(),
            text: crate::openai::Nullable::Value(section.to_owned()),
            extra: Default::default(),
        }),
        None => message.content = crate::openai::Nullable::Value(Content::Text(section.into())),
    }
}

/// Adds a proxy-generated section to the system message at position 0, creating one if there
/// is none.
pub(super) fn add_section(messages: &mut Vec<Message>, section: &str) {
    match messages.first_mut() {
        Some(first) if is_instruction(first) => append_text(first, section),
        _ => messages.insert(0, Message::text(Role::System, section)),
    }
}
