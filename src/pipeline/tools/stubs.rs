//! Stubs: a tool the stage leaves out is still offered, by name and purpose and without
//! parameters, so the model can still call it; a call to a stub is re-asked with the full
//! definition (`server::chat::expand`), invisibly to the client (ARCHITECTURE.md, principle 9).

use std::hash::BuildHasher;
use std::sync::Arc;

use foldhash::quality::FixedState;
use serde_json::json;

use crate::openai::{FunctionDefinition, Nullable, Schema, SharedText, Tool};
use crate::pipeline::memo::Memo;
use crate::tokens::TokenCounter;

use super::catalog::tool_name;
use super::concise::concise;

/// How a tool went upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolForm {
    Full,
    Stub,
    /// A stub in the block, its full definition in the messages (`inline`).
    Inline,
    Removed,
}

impl ToolForm {
    /// Sent as a stub in the block (defined in the messages or not).
    pub fn is_stub(self) -> bool {
        matches!(self, ToolForm::Stub | ToolForm::Inline)
    }
}

const STUB_SEED: u64 = 0x7374_7562_746f_6f6c;

/// `tool` as a stub: its name, the first sentence of its description (at most `max_tokens`),
/// and an empty object schema. Fields of the function beyond these (`strict`…) are left out;
/// fields of the tool itself are kept.
pub fn stub(tool: &Tool, max_tokens: usize, counter: &TokenCounter, memo: &Memo) -> Tool {
    let Some(function) = &tool.function else {
        return tool.clone();
    };
    let description = function.description.get().map(|text| {
        let key = FixedState::with_seed(STUB_SEED).hash_one((text, max_tokens, counter.encoding()));
        memo.text(key, || first_sentence_within(text, max_tokens, counter))
    });
    Tool {
        kind: tool.kind.clone(),
        function: Some(FunctionDefinition {
            name: function.name.clone(),
            description: description
                .filter(|d| !d.is_empty())
                .map_or(Nullable::Absent, |d| Nullable::Value(SharedText::from(&*d))),
            parameters: Nullable::Value(Arc::new(Schema::new(
                json!({"type": "object", "properties": {}}),
            ))),
            extra: Default::default(),
        }),
        extra: tool.extra.clone(),
    }
}

/// The first sentence of `text`, cut at a word to at most `max_tokens` tokens.
fn first_sentence_within(text: &str, max_tokens: usize, counter: &TokenCounter) -> String {
    let sentence = first_sentence(text);
    if counter.text(sentence) <= max_tokens {
        return sentence.to_owned();
    }
    let mut kept = String::new();
    for word in sentence.split_whitespace() {
        let candidate = if kept.is_empty() {
            word.to_owned()
        } else {
            format!("{kept} {word}")
        };
        if counter.text(&candidate) > max_tokens {
            break;
        }
        kept = candidate;
    }
    kept
}

/// Up to the first `.`, `!` or `?` followed by whitespace (or the end), or the first line.
fn first_sentence(text: &str) -> &str {
    let text = text.trim();
    let line = text.lines().next().unwrap_or_default();
    let bytes = line.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if matches!(b, b'.' | b'!' | b'?')
            && bytes
                .get(i + 1)
                .is_none_or(|next| next.is_ascii_whitespace())
        {
            return &line[..=i];
        }
    }
    line
}

/// The names of the tools `sent` offers as stubs: those whose definition is neither the
/// client's tool of the same name nor its `concise` form.
pub fn stubbed(sent: &[Tool], client: &[Tool]) -> Vec<String> {
    sent.iter()
        .filter_map(|tool| {
            let name = tool_name(tool)?;
            let original = client.iter().find(|c| tool_name(c) == Some(name))?;
            (original != tool && concise(original) != *tool).then(|| name.to_owned())
        })
        .collect()
}

/// `sent` with the tools named in `names` back in full, the client's definitions in their
/// `concise` form (all of them when `names` is `None`), in place: the block keeps its order.
pub fn promote(sent: &[Tool], client: &[Tool], names: Option<&[String]>) -> Vec<Tool> {
    sent.iter()
        .map(|tool| {
            let Some(name) = tool_name(tool) else {
                return tool.clone();
            };
            let wanted = names.is_none_or(|names| names.iter().any(|n| n == name));
            match client.iter().find(|c| tool_name(c) == Some(name)) {
                Some(original) if wanted => concise(original),
                _ => tool.clone(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::Encoding;

    fn tool(name: &str, description: &str) -> Tool {
        serde_json::from_value(json!({"type": "function", "function": {"name": name,
            "description": description, "strict": true,
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}},
                "required": ["id"]}}}))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_stub_keeps_the_name_and_first_sentence_and_no_parameters() {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let full = tool(
            "get_order_details",
            "Get the status and details of an order. Use it before any change.",
        );
        let stub = stub(&full, 24, &counter, &Memo::default());
        assert_eq!(
            serde_json::to_value(&stub).unwrap_or_default(),
            json!({"type": "function", "function": {"name": "get_order_details",
                "description": "Get the status and details of an order.",
                "parameters": {"type": "object", "properties": {}}}})
        );
    }

    #[test]
    fn a_long_first_sentence_is_cut_at_a_word_within_the_cap() {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let long = "Search the flights between two cities on a date and return every direct and one-stop itinerary with its price, seats left and fare rules";
        let cut = first_sentence_within(long, 8, &counter);
        assert!(counter.text(&cut) <= 8, "{cut}");
        assert!(long.starts_with(&cut) && !cut.is_empty(), "{cut}");
        assert_eq!(first_sentence("Ends here? Not this."), "Ends here?");
        assert_eq!(
            first_sentence("Version 2.5 of it\nsecond line"),
            "Version 2.5 of it"
        );
    }

    #[test]
    fn stubs_are_found_and_promoted_in_place() {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let client = vec![tool("a", "A."), tool("b", "B."), tool("c", "C.")];
        let sent = vec![
            client[0].clone(),
            stub(&client[1], 24, &counter, &memo),
            stub(&client[2], 24, &counter, &memo),
        ];
        assert_eq!(stubbed(&sent, &client), ["b", "c"]);
        let promoted = promote(&sent, &client, Some(&["c".to_owned()]));
        assert_eq!(stubbed(&promoted, &client), ["b"]);
        assert_eq!(promoted[2], client[2]);
        assert_eq!(promote(&sent, &client, None), client);
    }
}
