//! What an appended request (`prefix.rs`) reads of the tools stage, and nothing more: whether
//! the block never changes, the sticky categories a point of the history shows, the
//! definitions placed in the messages since the anchor, and a request without tools. The
//! decisions behind them stay the stage's own.

use std::collections::BTreeSet;

pub use super::block::{sends_block_whole, without_tools};
pub use super::classify::previous_turn_categories;
use super::inline;
use crate::openai::{ChatRequest, Message};
use crate::pipeline::config::PipelineConfig;
use crate::pipeline::memo::Memo;
use crate::tokens::TokenCounter;

/// The definitions a request's rewrite places in its messages from the client's message
/// `from` on, each with the index of the client's message it goes before, and the names of
/// the tools they define.
pub struct Definitions {
    pub placed: Vec<(usize, Message)>,
    pub names: BTreeSet<String>,
}

/// The definitions placed from message `from` on, after `sent` (see `inline::definitions_from`).
pub fn definitions_from(
    request: &ChatRequest,
    from: usize,
    sent: &[Message],
    config: &PipelineConfig,
    counter: &TokenCounter,
    memo: &Memo,
) -> Definitions {
    let placed = inline::definitions_from(request, from, sent, config, counter, memo);
    let messages: Vec<Message> = placed.iter().map(|(_, m)| m.clone()).collect();
    let names = inline::defined_in(&messages);
    Definitions { placed, names }
}
