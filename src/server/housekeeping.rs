//! The process's periodic chores: the caches drop what no request used within
//! `[memory] idle_secs`, the in-memory store its expired entries,
//! `ctxproxy_memory_cache_bytes` says what each cache holds, and the allocator gives back to
//! the system what was freed.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::AppState;
use crate::metrics::MemoryCache;

/// How often the caches are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// A block in mimalloc's huge class (over 512 KiB: a page of its own, freed at once).
const HUGE_BLOCK: usize = 1 << 20;

/// Sweeps every `SWEEP_EVERY` for as long as the state lives.
pub fn spawn(state: &Arc<AppState>) {
    let state = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(SWEEP_EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let Some(state) = Weak::upgrade(&state) else {
                return;
            };
            sweep(&state, Instant::now());
        }
    });
}

/// Drops what is idle or expired, then exports what is left.
pub fn sweep(state: &AppState, now: Instant) {
    state.memo.sweep(now);
    state.tokenizers.sweep(now);
    state.store.sweep(now);
    export(state);
    let_the_allocator_purge();
}

/// mimalloc gives freed memory back to the system (purges it) a second after it was returned
/// to its arenas, but only when it next frees a page, so a process that goes idle keeps in its
/// RSS what it freed last: 8–10 MB of the vocabulary's decoding at start, and what the last
/// burst of requests used. Freeing a block of a page of its own runs the purges that are due
/// (pages a thread still holds, retired or partly used, are not among them). `black_box` keeps
/// the compiler from leaving out an allocation that nothing reads; no byte of it is touched,
/// and without the memory nothing is done.
fn let_the_allocator_purge() {
    let mut block = Vec::<u8>::new();
    if block.try_reserve_exact(HUGE_BLOCK).is_ok() {
        drop(std::hint::black_box(block));
    }
}

/// Sets `ctxproxy_memory_cache_bytes` from what each cache holds now.
pub fn export(state: &AppState) {
    let (memo, rewrites) = state.memo.bytes();
    let sizes = [
        (MemoryCache::Memo, memo),
        (MemoryCache::Rewrites, rewrites),
        (MemoryCache::TokenCounts, state.tokenizers.bytes()),
        (
            MemoryCache::TokenPieces,
            crate::tokens::piece_cache_bytes_total(),
        ),
        (MemoryCache::Store, state.store.memory_bytes()),
    ];
    for (cache, bytes) in sizes {
        state
            .metrics
            .memory_cache_bytes
            .with_label_values(&[cache.as_str()])
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
}
