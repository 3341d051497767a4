//! `ctxproxy mock-upstream`: its flags, turned into [`MockOptions`], and the fake model served
//! until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use super::{MockOptions, SystemMessages};
use crate::cli::{self, Outcome};
use crate::server::shutdown_signal;

#[derive(Args)]
pub struct MockUpstreamArgs {
    #[arg(long, default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Delay before the first byte of every answer.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Streaming pace; 0 sends every chunk at once.
    #[arg(long, default_value_t = 0.0)]
    tokens_per_sec: f64,
    /// A uniformly random extra delay of up to this many ms, on top of --latency-ms.
    #[arg(long, default_value_t = 0)]
    jitter_ms: u64,
    /// Share of requests (0 to 1) answered with a 500 error, at random.
    #[arg(long, default_value_t = 0.0)]
    error_rate: f64,
    /// What the chat template does with a system message after the first: read it in place,
    /// refuse the request with vLLM's 400, or drop it.
    #[arg(long, value_enum, default_value = "in-place")]
    system_messages: SystemMessages,
}

/// Runs `ctxproxy mock-upstream`.
pub fn cmd(args: MockUpstreamArgs) -> Outcome {
    let options = MockOptions {
        latency: Duration::from_millis(args.latency_ms),
        tokens_per_sec: (args.tokens_per_sec > 0.0).then_some(args.tokens_per_sec),
        jitter: Duration::from_millis(args.jitter_ms),
        error_rate: args.error_rate.clamp(0.0, 1.0),
        system_messages: args.system_messages,
    };
    cli::block_on(serve(args.listen, options))
}

async fn serve(listen: SocketAddr, options: MockOptions) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    eprintln!("mock upstream listening on http://{listen}/v1");
    super::serve(listener, options, shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}
