//! `ctxproxy replay` and `ctxproxy report diff`: their flags, turned into the [`Options`] of
//! each run, and the reports printed or written.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};

use super::{Options, Pacing, Recorded, Report, StreamMode};
use crate::cli::{self, Failure, Outcome};

#[derive(Args)]
pub struct ReplayArgs {
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
}

#[derive(Clone, Copy, ValueEnum)]
enum TimingArg {
    Recorded,
}

#[derive(Clone, Copy, ValueEnum)]
enum StreamArg {
    Recorded,
    On,
    Off,
}

#[derive(Subcommand)]
pub enum ReportCommand {
    /// Two `replay --output` reports side by side.
    Diff { a: PathBuf, b: PathBuf },
}

/// Runs `ctxproxy replay`.
pub fn cmd(args: ReplayArgs) -> Outcome {
    let (recorded, skipped) = super::load(&args.files)
        .map_err(|e| Failure::Other(format!("cannot read the requests: {e}")))?;
    if skipped > 0 {
        eprintln!("skipped {skipped} lines that hold no chat request");
    }
    let runs = runs(&args)?;
    cli::block_on(replay(runs, recorded, args.output))
}

/// One run's options, or one per `--compare` mode.
fn runs(args: &ReplayArgs) -> Result<Vec<Options>, Failure> {
    let mut headers = Vec::new();
    for header in &args.headers {
        let Some((name, value)) = header.split_once(':') else {
            return Err(Failure::Other(format!(
                "--header `{header}`: expected `Name: value`"
            )));
        };
        headers.push((name.trim().to_owned(), value.trim().to_owned()));
    }
    let pacing = match (args.rate, args.timing) {
        (Some(rate), _) => Pacing::Rate { rate },
        (None, Some(TimingArg::Recorded)) => Pacing::Recorded { speed: args.speed },
        (None, None) => Pacing::Closed {
            concurrency: args.concurrency.unwrap_or(8),
        },
    };
    let base = Options {
        target: args.target.clone(),
        pacing,
        requests: args.requests,
        duration: args.duration,
        headers,
        stream: match args.stream {
            StreamArg::Recorded => StreamMode::Recorded,
            StreamArg::On => StreamMode::On,
            StreamArg::Off => StreamMode::Off,
        },
        vary_user: args.vary_user,
        timeout: Duration::from_secs(args.timeout_secs),
        progress: true,
        label: "run".to_owned(),
    };
    if args.compare.is_empty() {
        return Ok(vec![base]);
    }
    Ok(args
        .compare
        .iter()
        .map(|mode| {
            let mut options = base.clone();
            options.label = mode.clone();
            options
                .headers
                .push(("X-Ctxproxy-Mode".to_owned(), mode.clone()));
            options
        })
        .collect())
}

/// Runs one after the other, prints the report (or two side by side), writes `output`.
async fn replay(
    runs: Vec<Options>,
    recorded: Vec<Recorded>,
    output: Option<PathBuf>,
) -> Result<(), String> {
    let mut reports = Vec::new();
    for options in &runs {
        reports.push(super::run(options, &recorded).await?);
    }
    match reports.as_slice() {
        [one] => print!("{}", one.render()),
        [a, b, ..] => print!("{}", super::diff(a, b)),
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
}

/// Runs `ctxproxy report`.
pub fn report_cmd(command: ReportCommand) -> Outcome {
    let ReportCommand::Diff { a, b } = command;
    let (mut left, mut right) = match (read_report(&a), read_report(&b)) {
        (Ok(left), Ok(right)) => (left, right),
        (Err(e), _) | (_, Err(e)) => return Err(Failure::Other(e)),
    };
    // Two runs of one command share a label: name them by their files.
    if left.label == right.label {
        left.label = a.display().to_string();
        right.label = b.display().to_string();
    }
    print!("{}", super::diff(&left, &right));
    Ok(())
}

fn read_report(path: &Path) -> Result<Report, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
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
