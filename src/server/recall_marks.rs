//! Where a conversation's recalls were answered (`pipeline::recall::Mark`), remembered in the
//! store for the prefix's TTL, so that its later requests, on any replica, keep each recall
//! pair where the re-ask put it. A miss or a store error only loses that: the model may recall
//! again.

use std::time::Duration;

use super::SharedState;
use crate::pipeline::recall::Mark;

fn key(conversation: &str) -> String {
    format!("recall:{conversation}")
}

/// The conversation's marks (none on a miss or a store error).
pub async fn load(state: &SharedState, conversation: &str) -> Vec<Mark> {
    match state.store.get(&key(conversation)).await {
        Some(bytes) => serde_json::from_slice(&bytes).unwrap_or_default(),
        None => Vec::new(),
    }
}

/// Remembers `marks` for the conversation, in the background.
pub fn save(state: &SharedState, conversation: &str, marks: &[Mark]) {
    let Ok(value) = serde_json::to_vec(marks) else {
        return;
    };
    let (state, key) = (state.clone(), key(conversation));
    let ttl = Duration::from_secs(state.config.pipeline.prefix_ttl_secs);
    tokio::spawn(async move { state.store.set(&key, &value, ttl).await });
}
