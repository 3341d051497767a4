//! What the subcommands share: how one fails (the binary turns that into an exit code), loading
//! the config file, and the runtime an async one runs on.

use std::fmt;
use std::future::Future;
use std::path::Path;

use crate::config::Config;

/// Why a subcommand failed, with the message for stderr.
#[derive(Debug)]
pub enum Failure {
    /// The config file is missing or invalid.
    Config(String),
    /// Anything else: unreadable input, a bad flag value, a run that failed.
    Other(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Config(message) | Failure::Other(message) => f.write_str(message),
        }
    }
}

/// How a subcommand ended.
pub type Outcome = Result<(), Failure>;

/// The config at `path`, or the failure that names the file.
pub fn load_config(path: &Path) -> Result<Config, Failure> {
    Config::load(path)
        .map_err(|e| Failure::Config(format!("invalid config {}: {e}", path.display())))
}

/// Runs `task` to its end on a single-threaded runtime: `ctxproxy serve`'s first serving
/// thread (`cores.rs` starts the others).
pub fn block_on_this_thread(task: impl Future<Output = Result<(), String>>) -> Outcome {
    run_on(tokio::runtime::Builder::new_current_thread(), task)
}

/// Runs `task` to its end on a multi-threaded runtime.
pub fn block_on(task: impl Future<Output = Result<(), String>>) -> Outcome {
    run_on(tokio::runtime::Builder::new_multi_thread(), task)
}

/// Runs `task` to its end on the runtime `builder` makes, with timers and I/O.
fn run_on(
    mut builder: tokio::runtime::Builder,
    task: impl Future<Output = Result<(), String>>,
) -> Outcome {
    let runtime = builder
        .enable_all()
        .build()
        .map_err(|e| Failure::Other(format!("cannot start the runtime: {e}")))?;
    runtime.block_on(task).map_err(Failure::Other)
}
