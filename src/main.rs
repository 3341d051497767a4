//! The `ctxproxy` command line: parses arguments and calls the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use ctxproxy::config::Config;
use ctxproxy::mock_upstream::{self, MockOptions};
use ctxproxy::server::{self, AppState};
use ctxproxy::telemetry;

#[derive(Parser)]
#[command(
    name = "ctxproxy",
    version,
    about = "Context-optimizing OpenAI-compatible proxy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        #[arg(long, short, default_value = "config.toml", env = "CTXPROXY_CONFIG")]
        config: PathBuf,
        /// Overrides `server.listen`.
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Validate a config file and print the effective config (secrets redacted).
    CheckConfig {
        #[arg(long, short, default_value = "config.toml", env = "CTXPROXY_CONFIG")]
        config: PathBuf,
    },
    /// Run the pipeline over recorded requests (JSONL) and report the savings per stage.
    Analyze {
        /// One request body, or one `{"request": …}` object, per line.
        #[arg(required_unless_present = "growth")]
        file: Option<PathBuf>,
        /// Instead of a file, report the tokens sent for one synthetic agent conversation at
        /// 10, 20, 50 and 100 turns (the window keeps this flat).
        #[arg(long, conflicts_with = "file")]
        growth: bool,
        /// The file holds labelled question pairs (`{"a","b","duplicate"}`): report the
        /// precision and recall of the dedup decision at `--threshold`.
        #[arg(long)]
        pairs: bool,
        #[arg(long, default_value_t = 0.85)]
        threshold: f32,
        #[arg(long, short, default_value = "config.toml", env = "CTXPROXY_CONFIG")]
        config: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Also print every request where tool filtering removed a tool the recorded answer
        /// called, with the classifier's scores (needs FILE.meta.jsonl).
        #[arg(long)]
        misses: bool,
    },
    /// Run a fake OpenAI-compatible model (for tests, demos and load runs).
    MockUpstream {
        #[arg(long, default_value = "127.0.0.1:9000")]
        listen: SocketAddr,
        /// Delay before the first byte of every answer.
        #[arg(long, default_value_t = 0)]
        latency_ms: u64,
        /// Streaming pace; 0 sends every chunk at once.
        #[arg(long, default_value_t = 0.0)]
        tokens_per_sec: f64,
    },
}

/// Exit code for an invalid configuration.
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { config } => match Config::load(&config) {
            Ok(config) => {
                print!("{}", config.effective_toml());
                ExitCode::SUCCESS
            }
            Err(e) => config_error(&config, &e),
        },
        Command::Serve { config, listen } => {
            let mut loaded = match Config::load(&config) {
                Ok(loaded) => loaded,
                Err(e) => return config_error(&config, &e),
            };
            if let Some(listen) = listen {
                loaded.server.listen = listen;
            }
            run_async(serve(loaded))
        }
        Command::Analyze {
            file,
            growth,
            pairs,
            threshold,
            config,
            json,
            misses,
        } => {
            let loaded = match Config::load(&config) {
                Ok(loaded) => loaded,
                Err(e) => return config_error(&config, &e),
            };
            let tokenizers = ctxproxy::tokens::Tokenizers::default();
            tokenizers.warm_up();
            let Some(file) = file.filter(|_| !growth) else {
                let rows = ctxproxy::analyze::growth(&loaded, &tokenizers, &[10, 20, 50, 100]);
                if json {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&rows).unwrap_or_default()
                    );
                } else {
                    print!("{}", ctxproxy::analyze::render_growth(&rows));
                }
                return ExitCode::SUCCESS;
            };
            let reader = match std::fs::File::open(&file) {
                Ok(f) => std::io::BufReader::new(f),
                Err(e) => {
                    eprintln!("cannot read {}: {e}", file.display());
                    return ExitCode::FAILURE;
                }
            };
            if pairs {
                return match ctxproxy::analyze::dedup_pairs(reader, threshold) {
                    Ok(eval) => {
                        println!(
                            "{}",
                            serde_json::to_string_pretty(&eval).unwrap_or_default()
                        );
                        ExitCode::SUCCESS
                    }
                    Err(e) => {
                        eprintln!("cannot read {}: {e}", file.display());
                        ExitCode::FAILURE
                    }
                };
            }
            // The recording's meta file (FILE.meta.jsonl) gives tool recall.
            let meta_path = file.with_extension("meta.jsonl");
            let meta = std::fs::File::open(&meta_path)
                .ok()
                .map(|f| Box::new(std::io::BufReader::new(f)) as Box<dyn std::io::BufRead>);
            match ctxproxy::analyze::analyze(reader, meta, &loaded, &tokenizers) {
                Ok(analysis) if json => {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&analysis).unwrap_or_default()
                    );
                    ExitCode::SUCCESS
                }
                Ok(analysis) => {
                    print!("{}", analysis.render());
                    if misses {
                        print!("{}", analysis.render_misses());
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("cannot read {}: {e}", file.display());
                    ExitCode::FAILURE
                }
            }
        }
        Command::MockUpstream {
            listen,
            latency_ms,
            tokens_per_sec,
        } => {
            let options = MockOptions {
                latency: Duration::from_millis(latency_ms),
                tokens_per_sec: (tokens_per_sec > 0.0).then_some(tokens_per_sec),
            };
            run_async(mock(listen, options))
        }
    }
}

fn config_error(path: &std::path::Path, e: &ctxproxy::config::ConfigError) -> ExitCode {
    eprintln!("invalid config {}: {e}", path.display());
    ExitCode::from(EXIT_CONFIG)
}

fn run_async(task: impl std::future::Future<Output = Result<(), String>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(task) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> Result<(), String> {
    telemetry::init(&config.log);
    let listen = config.server.listen;
    let state = AppState::new(config).map_err(|e| e.to_string())?;
    state.tokenizers.warm_up();
    state.store.check_at_start().await;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    tracing::info!(%listen, version = env!("CARGO_PKG_VERSION"), "ctxproxy listening");
    server::serve(listener, state, server::shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}

async fn mock(listen: SocketAddr, options: MockOptions) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    eprintln!("mock upstream listening on http://{listen}/v1");
    mock_upstream::serve(listener, options, server::shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}
