//! The block along a `previous_response_id` chain. A chained request's history is upstream, so
//! the stage cannot decide its block from the first turn; instead the block the chain's previous
//! request sent is remembered by the Response's id (`server::chain_tools`) and sent again, the
//! same bytes: the provider's prompt cache keeps the prefix, and the chain keeps its stubs.

use std::hash::BuildHasher;

use foldhash::quality::FixedState;
use serde::{Deserialize, Serialize};

use super::block::{chosen_tool, demanded_call};
use super::catalog::tool_name;
use super::report::{Reason, ToolsDetails};
use super::stubs::{promote, stubbed};
use crate::openai::{ChatRequest, Tool};

const CLIENT_SEED: u64 = 0x6368_6169_6e74_6f6f;

/// The tools a Response's request sent in place of the client's, which client tools they
/// stand for (a digest of the client's list: a chain whose client changes its tools is sent
/// them whole), and the tools whose definitions the chain's history upstream holds (placed in
/// a message by one of its requests: a call of one is checked, not asked again).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainTools {
    client: u64,
    sent: Vec<Tool>,
    #[serde(default)]
    defined: Vec<String>,
}

impl ChainTools {
    /// What a request that sent `sent` for `client`'s tools, with the definitions of `defined`
    /// in its history, leaves its chain. `None` when it sent the client's own tools (a chained
    /// request is sent them by default), or left one of them out (a chained request could not
    /// add it back when a later turn needs it).
    pub fn of(client: &ChatRequest, sent: &[Tool], defined: Vec<String>) -> Option<ChainTools> {
        let tools = client.tools.get()?;
        (tools.as_slice() != sent && offers_all(sent, tools)).then(|| ChainTools {
            client: digest(tools),
            sent: sent.to_vec(),
            defined,
        })
    }

    /// The tools whose definitions the chain's history holds.
    pub fn into_defined(self) -> Vec<String> {
        self.defined
    }

    /// The block a chained `request` sends, and the stage's account of it: the chain's block when
    /// `request` offers the same tools and demands no call the block may not answer; a tool its
    /// `tool_choice` names goes in full. `None`: the client's tools go as they are.
    pub fn block_for(&self, request: &ChatRequest) -> Option<(Vec<Tool>, ToolsDetails)> {
        let client = request.tools.get().filter(|t| !t.is_empty())?;
        if digest(client) != self.client
            || demanded_call(request).is_some()
            || !offers_all(&self.sent, client)
        {
            return None;
        }
        let block = match chosen_tool(request) {
            Some(chosen) => promote(&self.sent, client, Some(&[chosen])),
            None => self.sent.clone(),
        };
        let stubs = stubbed(&block, client).len();
        let details = ToolsDetails {
            sent: Some(block.len() - stubs),
            stubs: Some(stubs),
            reason: Some(Reason::Chain),
            ..ToolsDetails::offered(client.len())
        };
        Some((block, details))
    }
}

/// Whether `sent` offers every named tool of `client`'s (in full or as a stub).
fn offers_all(sent: &[Tool], client: &[Tool]) -> bool {
    let offered = |name: &str| sent.iter().any(|t| tool_name(t) == Some(name));
    client.iter().filter_map(tool_name).all(offered)
}

fn digest(tools: &[Tool]) -> u64 {
    let json = serde_json::to_string(tools).unwrap_or_default();
    FixedState::with_seed(CLIENT_SEED).hash_one(json)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::openai::Nullable;
    use crate::pipeline::Memo;
    use crate::pipeline::tools::stubs::stub;
    use crate::tokens::{Encoding, TokenCounter};

    fn request(choice: Option<serde_json::Value>) -> ChatRequest {
        let tool = |name: &str| {
            json!({"type": "function", "function": {"name": name,
                "description": format!("Does {name}. It takes a long time and many words."),
                "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}})
        };
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "go on"}],
            "tools": [tool("get_order"), tool("cancel_order"), tool("send_email")]});
        if let Some(choice) = choice {
            body["tool_choice"] = choice;
        }
        serde_json::from_value(body).expect("a request")
    }

    /// The block of a first request: `get_order` in full, the others as stubs.
    fn first_block(client: &ChatRequest) -> Vec<Tool> {
        let (counter, memo) = (TokenCounter::new(Encoding::O200kBase), Memo::default());
        let tools = client.tools.get().expect("tools");
        let mut block = vec![tools[0].clone()];
        block.extend(tools[1..].iter().map(|t| stub(t, 8, &counter, &memo)));
        block
    }

    #[test]
    fn a_chained_request_with_the_same_tools_sends_the_chains_block() {
        let client = request(None);
        let block = first_block(&client);
        let chain = ChainTools::of(&client, &block, Vec::new()).expect("not the client's tools");
        let (sent, details) = chain.block_for(&request(None)).expect("the same tools");
        assert_eq!(sent, block);
        assert_eq!((details.sent, details.stubs), (Some(1), Some(2)));
        assert_eq!(details.reason, Some(Reason::Chain));
        // Remembered in the store as JSON: read back, it is the same block.
        let read: ChainTools =
            serde_json::from_slice(&serde_json::to_vec(&chain).unwrap()).unwrap();
        assert_eq!(read, chain);
    }

    #[test]
    fn the_clients_own_tools_other_tools_or_a_demanded_call_send_the_tools_whole() {
        let client = request(None);
        let tools = client.tools.get().unwrap().clone();
        assert!(ChainTools::of(&client, &tools, Vec::new()).is_none());
        let left_out = &first_block(&client)[..2];
        assert!(
            ChainTools::of(&client, left_out, Vec::new()).is_none(),
            "a block that leaves a tool out is not carried along a chain"
        );
        // A record of an earlier build that left a tool out is not sent either.
        let old = ChainTools {
            client: digest(&tools),
            sent: left_out.to_vec(),
            defined: Vec::new(),
        };
        assert!(old.block_for(&request(None)).is_none());
        let chain = ChainTools::of(&client, &first_block(&client), Vec::new()).unwrap();
        let mut other = request(None);
        other.tools = Nullable::Value(tools[..2].to_vec());
        assert!(
            chain.block_for(&other).is_none(),
            "the client changed its tools"
        );
        assert!(chain.block_for(&request(Some(json!("required")))).is_none());
    }

    #[test]
    fn a_tool_the_choice_names_goes_in_full_in_its_place() {
        let client = request(None);
        let chain = ChainTools::of(&client, &first_block(&client), Vec::new()).unwrap();
        let choice = json!({"type": "function", "function": {"name": "send_email"}});
        let (sent, details) = chain.block_for(&request(Some(choice))).unwrap();
        let tools = client.tools.get().unwrap();
        assert_eq!(sent[2], tools[2]);
        assert_ne!(sent[1], tools[1]);
        assert_eq!(details.stubs, Some(1));
    }
}
