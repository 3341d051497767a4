//! What the store remembers of a conversation's rewrites (prefix stability, `pipeline/prefix.rs`):
//! where its rewrite was last rebuilt. It saves work, since the pipeline reaches the same
//! decisions from the history alone; a miss or a store error changes what is sent only for a
//! history of more than `MAX_REPLAY` earlier requests, which a replica that knows nothing of it
//! rebuilds (`long_history`) rather than replays.

use std::time::Duration;

use super::SharedState;
use crate::pipeline::PrefixState;

fn key(conversation: &str) -> String {
    format!("prefix:{conversation}")
}

/// The remembered state of a conversation (`None` on a miss or a store error).
pub async fn load(state: &SharedState, conversation: &str) -> Option<PrefixState> {
    let bytes = state.store.get(&key(conversation)).await?;
    serde_json::from_slice(&bytes).ok()
}

/// Remembers `prefix` for the conversation, in the background.
pub fn save(state: &SharedState, conversation: &str, prefix: PrefixState) {
    let Ok(value) = serde_json::to_vec(&prefix) else {
        return;
    };
    let (state, key) = (state.clone(), key(conversation));
    let ttl = Duration::from_secs(state.config.pipeline.prefix_ttl_secs);
    tokio::spawn(async move { state.store.set(&key, &value, ttl).await });
}
