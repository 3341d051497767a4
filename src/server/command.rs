//! `ctxproxy serve` and `ctxproxy check-config`: the proxy started from its config file, and
//! that file checked without starting it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::AppState;
use crate::cli::{self, Outcome};
use crate::config::Config;
use crate::cores::Cores;
use crate::telemetry;

#[derive(Args)]
pub struct ServeArgs {
    #[arg(long, short, default_value = "config.toml", env = "CTXPROXY_CONFIG")]
    config: PathBuf,
    /// Overrides `server.listen`.
    #[arg(long)]
    listen: Option<SocketAddr>,
}

#[derive(Args)]
pub struct CheckConfigArgs {
    #[arg(long, short, default_value = "config.toml", env = "CTXPROXY_CONFIG")]
    config: PathBuf,
}

/// Runs `ctxproxy serve`.
pub fn cmd(args: ServeArgs) -> Outcome {
    let mut config = cli::load_config(&args.config)?;
    if let Some(listen) = args.listen {
        config.server.listen = listen;
    }
    cli::block_on_this_thread(serve(config))
}

/// Runs `ctxproxy check-config`: prints the effective config, secrets redacted.
pub fn check_config(args: CheckConfigArgs) -> Outcome {
    let config = cli::load_config(&args.config)?;
    print!("{}", config.effective_toml());
    Ok(())
}

/// Serves until SIGINT or SIGTERM, then flushes the recording.
async fn serve(config: Config) -> Result<(), String> {
    telemetry::init(&config.log);
    let listen = config.server.listen;
    let state = AppState::new(config).map_err(|e| e.to_string())?;
    // On a thread of its own: decoding a vocabulary frees about as much as it keeps, and what
    // a thread that ended freed goes back to the system; freed on the runtime's thread, it
    // stayed resident (`bench/memory.py streams`: idle 57 -> 51 MB).
    std::thread::scope(|scope| {
        scope.spawn(|| state.tokenizers.warm_up(&state.config.encodings()));
    });
    state.store.check_at_start().await;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    // Logged under the binary's target, where it always was.
    tracing::info!(
        target: "ctxproxy",
        %listen,
        version = env!("CARGO_PKG_VERSION"),
        "ctxproxy listening"
    );
    for upstream in &state.config.upstreams {
        tracing::info!(
            upstream = %upstream.name,
            base_url = %upstream.base_url,
            tool_definitions = upstream.pipeline.tools.definitions.as_str(),
            "upstream"
        );
    }
    let cores = Cores::start(state.config.server.threads)
        .map_err(|e| format!("cannot start the serving threads: {e}"))?;
    let served = super::serve_on(listener, state.clone(), &cores, super::shutdown_signal()).await;
    drop(cores);
    // What was recorded before the stop reaches the file.
    let _ = tokio::task::spawn_blocking(move || {
        state.recorder.close(Duration::from_secs(5));
    })
    .await;
    served.map_err(|e| e.to_string())
}
