//! The tool block of a `previous_response_id` chain, in the store: after a stored Response whose
//! request sent a block of its own (stubs), the block is remembered under the Response's id,
//! scoped to the caller, before the client gets the answer, so that a request chained on it
//! sends the same block (`pipeline::tools::chain`). Only JSON answers are read: a stored
//! Response that streams is sent its tools whole (`ChatCall::expansion_hidden`). A miss or a
//! store error sends the client's tools whole, as a chained request went before.

use std::time::Duration;

use sha2::{Digest, Sha256};

use super::SharedState;
use crate::pipeline::tools::chain::ChainTools;

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

/// Remembers `block` for the Response `id` of `scope`; whether it was stored (a store error
/// loses it: the chain's next request is sent the client's tools whole).
pub async fn save(state: &SharedState, scope: &str, id: &str, block: &ChainTools) -> bool {
    let Ok(value) = serde_json::to_vec(block) else {
        return false;
    };
    let ttl = Duration::from_secs(state.config.pipeline.prefix_ttl_secs);
    state.store.set(&key(scope, id), &value, ttl).await
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
