//! What the tools stage decides from the client's request alone (its tools, `tool_choice` and
//! messages), which no budget step changes: made once per rewrite and read by the budget's
//! re-runs (`stage::Decided`), or planned before the rewrite (`Planned`). A leaf, so that the
//! stages' context can hold it.

use std::collections::BTreeMap;

use super::report::{Reason, ToolsDetails};
use super::stubs::ToolForm;
use crate::openai::{Message, Tool};

pub struct Decision {
    /// The block sent.
    pub(super) kept: Vec<Tool>,
    pub(super) details: ToolsDetails,
    /// The definitions placed in the messages, each at the client's message it goes before.
    pub(super) placed: Vec<(usize, Message)>,
    /// The client's block is sent as it is, and nothing is placed.
    pub(super) unchanged: bool,
}

/// The tools a plan sends, each in its form, and the definitions it places in the messages.
pub(super) struct Block {
    pub(super) kept: Vec<Tool>,
    pub(super) forms: BTreeMap<String, ToolForm>,
    pub(super) defined_inline: usize,
    pub(super) placed: Vec<(usize, Message)>,
    /// The client's block as it is, and nothing placed.
    pub(super) unchanged: bool,
}

/// What the stage plans for a request's tools, before its report: the block and the
/// definitions placed in the messages, and why. It reads the client's request (messages,
/// tools, `tool_choice`), the sticky categories and the config, never what the stages before
/// it made, so a point of a conversation planned ahead of its whole rewrite (`prefix.rs`) hands
/// it to that rewrite's first pass (`stage::Decided::planned`) instead of planning twice.
pub struct Planned {
    pub(super) block: Block,
    pub(super) reason: Reason,
    pub(super) categories: Vec<String>,
    pub(super) protected: Vec<String>,
}

impl Planned {
    /// The tools sent (before the recall tool joins them), unless the client's block is sent
    /// as it is.
    pub fn sent(&self) -> Option<&[Tool]> {
        (!self.block.unchanged).then_some(self.block.kept.as_slice())
    }

    /// The definitions placed in the messages: every pass of the rewrite sends them all, and
    /// no later stage cuts them.
    pub fn placed(&self) -> impl Iterator<Item = &Message> {
        self.block.placed.iter().map(|(_, m)| m)
    }
}
