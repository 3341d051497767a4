//! The `ctxproxy` command line: parses arguments, hands each subcommand to the module that owns
//! it, and turns how it ended into the exit code.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use ctxproxy::cli::Failure;
use ctxproxy::{analyze, mock_upstream, replay, server};

/// mimalloc: the proxy allocates and frees many small JSON values per request; glibc's
/// allocator spent about a third of the CPU at 1,000 requests/s. Built without transparent
/// huge pages (`no_thp`): with them, each arena page the proxy touched was resident as 2 MiB
/// (idle RSS 108 -> 85 MB, 1,000 streams in flight 221 -> 178 MB, `bench/memory.py streams`).
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
    Replay(replay::ReplayArgs),
    /// Work with replay reports.
    Report {
        #[command(subcommand)]
        command: replay::ReportCommand,
    },
    /// Run a fake OpenAI-compatible model (for tests, demos and load runs).
    MockUpstream(mock_upstream::MockUpstreamArgs),
}

/// Exit code for an invalid configuration.
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    let outcome = match Cli::parse().command {
        Command::Serve(args) => server::cmd(args),
        Command::CheckConfig(args) => server::check_config(args),
        Command::Analyze(args) => analyze::cmd(args),
        Command::Replay(args) => replay::cmd(args),
        Command::Report { command } => replay::report_cmd(command),
        Command::MockUpstream(args) => mock_upstream::cmd(args),
    };
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
