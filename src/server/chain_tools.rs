//! The tool block of a `previous_response_id` chain, in the store: after a stored Response whose
//! request sent a block of its own (stubs), the block is remembered under the Response's id,
//! scoped to the tenant, so that a request chained on it sends the same block
//! (`pipeline::tools::chain`). Only JSON answers are read: a stored Response that streams is
//! sent its tools whole (`ChatCall::expansion_hidden`). A miss or a store error sends the
//! client's tools whole, as a chained request went before.

use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::SharedState;
use crate::body::{BodyEnd, BodyObserver};
use crate::pipeline::tools::chain::ChainTools;

/// The largest JSON answer read for its id (a Response echoes its tools and instructions).
const MAX_JSON_BYTES: usize = 8 * 1024 * 1024;

fn key(scope: &str, response_id: &str) -> String {
    let mut hasher = Sha256::new();
    for field in [scope, response_id] {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field.as_bytes());
    }
    format!("chain:{}", hex::encode(hasher.finalize()))
}

/// The block remembered for the Response `previous` of `scope` (`None` on a miss or an error).
pub async fn load(state: &SharedState, scope: &str, previous: &str) -> Option<ChainTools> {
    let bytes = state.store.get(&key(scope, previous)).await?;
    serde_json::from_slice(&bytes).ok()
}

/// Reads a JSON Response as it passes and, once it is complete, remembers `block` under its id.
pub struct ChainToolsWrite {
    state: SharedState,
    scope: String,
    block: ChainTools,
    json: Vec<u8>,
    too_large: bool,
}

impl ChainToolsWrite {
    pub fn new(state: SharedState, scope: String, block: ChainTools) -> ChainToolsWrite {
        ChainToolsWrite {
            state,
            scope,
            block,
            json: Vec::new(),
            too_large: false,
        }
    }
}

/// The one field read of the Response.
#[derive(Deserialize)]
struct Identified {
    id: String,
}

impl BodyObserver for ChainToolsWrite {
    fn on_data(&mut self, data: &Bytes) {
        if self.too_large {
            return;
        }
        if self.json.len() + data.len() > MAX_JSON_BYTES {
            self.too_large = true;
            self.json = Vec::new();
            return;
        }
        self.json.extend_from_slice(data);
    }

    fn on_end(self: Box<Self>, end: BodyEnd) {
        if end != BodyEnd::Complete || self.too_large {
            return;
        }
        let Ok(Identified { id }) = serde_json::from_slice(&self.json) else {
            return;
        };
        let Ok(value) = serde_json::to_vec(&self.block) else {
            return;
        };
        let key = key(&self.scope, &id);
        let ttl = Duration::from_secs(self.state.config.pipeline.prefix_ttl_secs);
        let state = self.state;
        tokio::spawn(async move { state.store.set(&key, &value, ttl).await });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_scoped_by_tenant_and_response() {
        assert_eq!(key("a", "resp_1"), key("a", "resp_1"));
        assert_ne!(key("a", "resp_1"), key("b", "resp_1"));
        assert_ne!(key("a", "resp_1"), key("a", "resp_2"));
        // The fields are length-prefixed: no two splits of one string meet.
        assert_ne!(key("ab", "c"), key("a", "bc"));
    }
}
