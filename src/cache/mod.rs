//! Response caches: the deterministic cache answers a request that was
//! already answered; the pieces here are pure (eligibility, keys, stream assembly and replay),
//! the I/O is the store's.

pub mod assemble;
pub mod config;
pub mod dedup;
pub mod dedup_scope;
pub mod deterministic;
pub mod embedder;
pub mod responses;
pub mod time_words;

pub use config::CacheConfig;
