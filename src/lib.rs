//! ctxproxy: an OpenAI-compatible reverse proxy that makes chat requests smaller without
//! making answers worse. ARCHITECTURE.md is the map of the code.
#![forbid(unsafe_code)]

pub mod analyze; // `ctxproxy analyze`: the pipeline over recorded requests
pub mod auth; // proxy keys → tenants
pub mod bill; // the input bill with the provider's prompt cache, and what a rewrite saved
pub mod body; // response body adapters (end observation, deadlines, SSE framing)
pub mod bounded; // maps bounded in bytes (LRU, idle sweep): every in-process cache
pub mod cache; // response caches: eligibility, keys, stream assembly and replay
pub mod cli; // what the subcommands share: failures, config loading, the runtime
pub mod config; // typed config, env overrides, validation
pub mod conversation; // conversation identity (header, user, or first messages), per tenant
pub mod cores; // one single-threaded runtime per core; a connection stays on one
pub mod error; // ProxyError → OpenAI-format responses
pub mod glob; // `gpt-*` name patterns for models and tools
pub mod guards; // agent guards: continuation of cut answers, reminders, claimed actions
pub mod metrics; // every Prometheus metric
pub mod mock_upstream; // the fake OpenAI model for tests and load runs
pub mod openai; // lossless wire types and SSE parsing
pub mod pipeline; // the rewriting stages (pure)
pub mod record; // recorded exchanges: sampling, bounded queue, rotating JSONL writer
pub mod replay; // `ctxproxy replay`: recorded traffic as a load test, and its report
pub mod responses; // the Responses API as the pipeline's chat model and back
pub mod server; // routes, middleware, handlers, shutdown
pub mod store; // Redis / in-memory key-value store with breaker and fallback
pub mod synthetic; // generated conversations for benchmarks and the growth report
pub mod telemetry; // tracing setup
pub mod tokens; // BPE token counting (o200k/cl100k) with a per-message cache
pub mod upstream; // upstream clients, routing, timeouts, header policy
