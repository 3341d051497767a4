//! What the tools stage decides from the client's request alone (its tools, `tool_choice` and
//! messages), which no budget step changes: made once per rewrite and read by the budget's
//! re-runs (`stage::Decided`). A leaf, so that the stages' context can hold it.

use super::report::ToolsDetails;
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
