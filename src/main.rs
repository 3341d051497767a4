//! The `ctxproxy` command line: parses arguments and calls the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use ctxproxy::cli::{Failure, Outcome};
use ctxproxy::{analyze, mock_upstream, server};

/// mimalloc: the proxy allocates and frees many small JSON values per request; glibc's
/// allocator spent about a third of the CPU at 1,000 requests/s.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    Serve(server::ServeArgs),
    /// Validate a config file and print the effective config (secrets redacted).
    CheckConfig(server::CheckConfigArgs),
    /// Run the pipeline over recorded requests (JSONL) and report the savings per stage and,
    /// with the answers the model gave, the fidelity of the rewrites (per file and overall).
    Analyze(analyze::AnalyzeArgs),
    /// Replay recorded chat requests against a target as a load test, and summarize.
    Replay {
        /// ctxproxy recordings or JSONL request bodies (one per line); cycled as needed.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// A ctxproxy (`http://127.0.0.1:8080`) or any OpenAI-compatible base URL.
        #[arg(long)]
        target: String,
        /// Closed loop: this many requests in flight, each sent when the previous one ends.
        #[arg(long, conflicts_with_all = ["rate", "timing"])]
        concurrency: Option<usize>,
        /// Open loop: this many requests per second, whatever the answers take.
        #[arg(long, conflicts_with = "timing")]
        rate: Option<f64>,
        /// `recorded`: send at the recorded inter-arrival times (`unix_ms` of each line).
        #[arg(long, value_enum)]
        timing: Option<TimingArg>,
        /// With `--timing recorded`: 2 replays twice as fast.
        #[arg(long, default_value_t = 1.0)]
        speed: f64,
        /// Stop after this many requests …
        #[arg(long)]
        requests: Option<u64>,
        /// … or after this long (`30s`, `2m`, `500ms`), whichever comes first. With neither,
        /// every request of the files is sent once.
        #[arg(long, value_parser = parse_duration)]
        duration: Option<Duration>,
        /// An extra request header, `Name: value` (repeatable), e.g. `X-Ctxproxy-Mode: off`.
        #[arg(long = "header", short = 'H')]
        headers: Vec<String>,
        /// Streaming as recorded, or forced on or off.
        #[arg(long, value_enum, default_value = "recorded")]
        stream: StreamArg,
        /// Send a distinct `user` field with every request (`replay-<run>-<n>`): with
        /// `[cache.dedup] scope = "user"`, caches are looked up but never hit.
        #[arg(long)]
        vary_user: bool,
        /// Seconds before one request is given up (an error without a status).
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
        /// Write the summary as JSON.
        #[arg(long)]
        output: Option<PathBuf>,
        /// Run once per ctxproxy mode (`off,optimize`, sent as X-Ctxproxy-Mode) and print the
        /// runs side by side.
        #[arg(long, value_delimiter = ',')]
        compare: Vec<String>,
    },
    /// Work with replay reports.
    Report {
        #[command(subcommand)]
        command: ReportCommand,
    },
    /// Run a fake OpenAI-compatible model (for tests, demos and load runs).
    MockUpstream(mock_upstream::MockUpstreamArgs),
}

#[derive(Subcommand)]
enum ReportCommand {
    /// Two `replay --output` reports side by side.
    Diff { a: PathBuf, b: PathBuf },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum TimingArg {
    Recorded,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum StreamArg {
    Recorded,
    On,
    Off,
}

/// `30s`, `2m`, `500ms`, `1h`, or plain seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration like 30s, 2m, 500ms"))?;
    let seconds = match unit {
        "ms" => value / 1e3,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        other => return Err(format!("unknown unit `{other}` (ms, s, m, h)")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| e.to_string())
}

fn read_report(path: &std::path::Path) -> Result<ctxproxy::replay::Report, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Exit code for an invalid configuration.
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig(args) => exit_code(server::check_config(args)),
        Command::Serve(args) => exit_code(server::cmd(args)),
        Command::Analyze(args) => exit_code(analyze::cmd(args)),
        Command::Replay {
            files,
            target,
            concurrency,
            rate,
            timing,
            speed,
            requests,
            duration,
            headers,
            stream,
            vary_user,
            timeout_secs,
            output,
            compare,
        } => {
            let (recorded, skipped) = match ctxproxy::replay::load(&files) {
                Ok(loaded) => loaded,
                Err(e) => {
                    eprintln!("cannot read the requests: {e}");
                    return ExitCode::FAILURE;
                }
            };
            if skipped > 0 {
                eprintln!("skipped {skipped} lines that hold no chat request");
            }
            let mut parsed_headers = Vec::new();
            for header in &headers {
                let Some((name, value)) = header.split_once(':') else {
                    eprintln!("--header `{header}`: expected `Name: value`");
                    return ExitCode::FAILURE;
                };
                parsed_headers.push((name.trim().to_owned(), value.trim().to_owned()));
            }
            let pacing = match (rate, timing) {
                (Some(rate), _) => ctxproxy::replay::Pacing::Rate { rate },
                (None, Some(TimingArg::Recorded)) => ctxproxy::replay::Pacing::Recorded { speed },
                (None, None) => ctxproxy::replay::Pacing::Closed {
                    concurrency: concurrency.unwrap_or(8),
                },
            };
            let base = ctxproxy::replay::Options {
                target,
                pacing,
                requests,
                duration,
                headers: parsed_headers,
                stream: match stream {
                    StreamArg::Recorded => ctxproxy::replay::StreamMode::Recorded,
                    StreamArg::On => ctxproxy::replay::StreamMode::On,
                    StreamArg::Off => ctxproxy::replay::StreamMode::Off,
                },
                vary_user,
                timeout: Duration::from_secs(timeout_secs),
                progress: true,
                label: "run".to_owned(),
            };
            let runs: Vec<ctxproxy::replay::Options> = if compare.is_empty() {
                vec![base]
            } else {
                compare
                    .iter()
                    .map(|mode| {
                        let mut options = base.clone();
                        options.label = mode.clone();
                        options
                            .headers
                            .push(("X-Ctxproxy-Mode".to_owned(), mode.clone()));
                        options
                    })
                    .collect()
            };
            run_async(async move {
                let mut reports = Vec::new();
                for options in &runs {
                    reports.push(ctxproxy::replay::run(options, &recorded).await?);
                }
                match reports.as_slice() {
                    [one] => print!("{}", one.render()),
                    [a, b, ..] => print!("{}", ctxproxy::replay::diff(a, b)),
                    [] => {}
                }
                if let Some(path) = output {
                    let json = if reports.len() == 1 {
                        serde_json::to_string_pretty(&reports[0])
                    } else {
                        serde_json::to_string_pretty(&reports)
                    }
                    .map_err(|e| e.to_string())?;
                    std::fs::write(&path, json).map_err(|e| format!("{}: {e}", path.display()))?;
                }
                Ok(())
            })
        }
        Command::Report {
            command: ReportCommand::Diff { a, b },
        } => match (read_report(&a), read_report(&b)) {
            (Ok(mut left), Ok(mut right)) => {
                // Two runs of one command share a label: name them by their files.
                if left.label == right.label {
                    left.label = a.display().to_string();
                    right.label = b.display().to_string();
                }
                print!("{}", ctxproxy::replay::diff(&left, &right));
                ExitCode::SUCCESS
            }
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        },
        Command::MockUpstream(args) => exit_code(mock_upstream::cmd(args)),
    }
}

fn exit_code(outcome: Outcome) -> ExitCode {
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("{failure}");
            match failure {
                Failure::Config(_) => ExitCode::from(EXIT_CONFIG),
                Failure::Other(_) => ExitCode::FAILURE,
            }
        }
    }
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
