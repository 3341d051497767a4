//! Agent guards: answers cut at `max_tokens` are continued and merged ([`continuation`]), long
//! conversations get a reminder at the end of the system message (applied by the pipeline, see
//! `pipeline::run`), and answers that claim an action without a tool call are flagged and
//! optionally retried ([`claims`]). All three are off by default and set globally or per route
//! ([`Guards`]). This module holds the pure parts: the decisions on a JSON answer ([`json`];
//! a Response's in [`responses_json`]; [`decisions`] picks by API), the stream rewriters
//! ([`stream`]; the Responses event stream's in [`responses_stream`]), and those of the
//! expansion of stub calls ([`expand`]) and of calls that fail their schema ([`arguments`]), in
//! chat's stream and in the Responses event stream ([`responses_expand`]); the calls they need
//! live in `server::guarded`.

pub mod arguments;
pub(crate) mod chunk;
pub mod claims;
pub mod config;
pub mod continuation;
pub mod decisions;
pub mod expand;
pub mod json;
pub mod responses_expand;
pub mod responses_json;
pub mod responses_stream;
pub mod stream;

pub use config::{ActionCheckConfig, ContinuationConfig, Guards, ReinforcementConfig};
