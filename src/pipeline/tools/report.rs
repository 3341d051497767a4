//! The tools stage's account of a request (`StageDetails::Tools` in the pipeline's report):
//! what was offered, sent in full, as stubs or in the messages, and why.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::Value;

use super::stubs::ToolForm;

/// Why the stage kept what it kept (also the metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Match,
    Sticky,
    NoMatchDrop,
    NoMatchKeep,
    /// Nothing matched: every tool not protected goes as a stub.
    NoMatchStub,
    /// Nothing matched; only protected tools (tool_choice, history, always, tool loop) stay.
    Protected,
    /// The tool definitions total less than `min_tool_tokens`: sent whole.
    SmallBlock,
    /// A chained request: the block its chain's previous request sent (`chain`).
    Chain,
}

impl Reason {
    pub const ALL: [Reason; 8] = [
        Reason::Match,
        Reason::Sticky,
        Reason::NoMatchDrop,
        Reason::NoMatchKeep,
        Reason::NoMatchStub,
        Reason::Protected,
        Reason::SmallBlock,
        Reason::Chain,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Match => "match",
            Reason::Sticky => "sticky",
            Reason::NoMatchDrop => "no_match_drop",
            Reason::NoMatchKeep => "no_match_keep",
            Reason::NoMatchStub => "no_match_stub",
            Reason::Protected => "protected",
            Reason::SmallBlock => "small_block",
            Reason::Chain => "chain",
        }
    }
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
    pub fn define(&mut self, names: &BTreeSet<String>) {
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
