//! What an upstream's chat template taught the proxy: it refuses (a 400) or drops a system
//! message in mid-conversation, so its tools needed later are defined in the block from then
//! on (`upstream::Lesson`). A replica that learns it writes it to the store once; a replica
//! that has not learned it asks the store at most once a minute per upstream, the first request
//! that finds the minute over asking while the others go on, so no request pays a store round
//! trip of its own for it and a replica that starts fresh does not pay the refusal or the
//! re-ask again. The store failing costs only that sharing (ARCHITECTURE.md, principle 5).

use std::time::Duration;

use sha2::{Digest, Sha256};

use super::SharedState;
use crate::upstream::Upstream;

pub use crate::upstream::Lesson;

/// How long the store keeps a lesson: a template does not change by itself, a redeploy may
/// change it (the key names the base URL, not the model behind it).
pub const TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// How often a replica that has not learned anything of an upstream asks the store.
pub const CHECK_EVERY: Duration = Duration::from_secs(60);

/// The store key of an upstream's lesson: its name and a short hash of its base URL (an
/// upstream renamed or moved starts over).
pub fn key(upstream: &Upstream) -> String {
    let config = &upstream.config;
    let digest = Sha256::digest(config.base_url.as_bytes());
    format!("template:{}:{}", config.name, hex::encode(&digest[..4]))
}

/// Records `lesson` of `upstream`: the first time, logged (once per upstream and process) and
/// written to the store, in the background, for the other replicas.
pub fn learn(state: &SharedState, upstream: &Upstream, lesson: Lesson) {
    if !upstream.learn(lesson) {
        return;
    }
    let name = &upstream.config.name;
    match lesson {
        Lesson::Refuses => tracing::warn!(
            upstream = %name,
            "the upstream refused tool definitions in the messages (a system message or a \
             call's result in mid-conversation): asked again with them in the block, as its \
             later requests will be; set tool_definitions = \"in_block\" for it"
        ),
        Lesson::Drops => tracing::warn!(
            upstream = %name,
            "the upstream's chat template drops tool definitions in the messages: a tool \
             defined there was called with arguments that fail its schema, and asked again \
             with it in the block, as its later requests will be; set tool_definitions = \
             \"in_block\" for it"
        ),
    }
    let (state, key) = (state.clone(), key(upstream));
    tokio::spawn(async move {
        state.store.set(&key, lesson.as_str().as_bytes(), TTL).await;
    });
}

/// Learns what another replica learned of `upstream`, when its definitions may go in place,
/// it knows nothing yet and the store is due to be asked (at most once per [`CHECK_EVERY`]);
/// otherwise returns at once.
pub async fn refresh(state: &SharedState, upstream: &Upstream) {
    let in_block = upstream.config.pipeline.tools.definitions.in_block();
    if in_block || upstream.learned().is_some() || !upstream.store_check_due(CHECK_EVERY) {
        return;
    }
    let Some(value) = state.store.get(&key(upstream)).await else {
        return;
    };
    let lesson = std::str::from_utf8(&value).ok().and_then(Lesson::parse);
    if let Some(lesson) = lesson
        && upstream.learn(lesson)
    {
        tracing::info!(
            upstream = %upstream.config.name,
            lesson = lesson.as_str(),
            "another replica learned that the upstream {} tool definitions in the messages: \
             tools needed later are defined in the block",
            lesson.as_str()
        );
    }
}
