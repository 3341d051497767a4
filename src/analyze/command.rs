//! `ctxproxy analyze`: its flags, and which report they ask for: the growth of a synthetic
//! conversation, the dedup decision on labelled pairs, the billed input, or (by default) the
//! savings and fidelity of each file.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use clap::Args;

use crate::cli::{self, Failure, Outcome};
use crate::config::Config;
use crate::tokens::{Encoding, Tokenizers};

#[derive(Args)]
pub struct AnalyzeArgs {
    /// One request body, or one `{"request": …}` object (a recording), per line.
    /// `FILE.meta.jsonl` beside a file gives the recorded answers.
    #[arg(required_unless_present = "growth")]
    files: Vec<PathBuf>,
    /// Instead of a file, report the tokens sent for one synthetic agent conversation at
    /// 10, 20, 50 and 100 turns (the window keeps this flat).
    #[arg(long, conflicts_with = "files")]
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
    /// Also print every identifier of a recorded answer that a rewrite lost: the request,
    /// the message it was in, and the stage that removed it.
    #[arg(long)]
    losses: bool,
    /// Instead, bill the input of conversations in order (FILE.meta.jsonl's `conversation`
    /// groups them) with the provider's prompt cache, as sent and as rewritten: input
    /// tokens, cached share, bill at each cached-price ratio, and USD with `[prices]`.
    #[arg(long)]
    cost: bool,
    /// With --cost: prices of a cached token relative to an uncached one.
    #[arg(long, value_delimiter = ',', default_value = "1,0.5,0.25,0.1")]
    cached_ratio: Vec<f64>,
}

/// Runs `ctxproxy analyze`.
pub fn cmd(args: AnalyzeArgs) -> Outcome {
    let config = cli::load_config(&args.config)?;
    let tokenizers = Tokenizers::default();
    tokenizers.warm_up(&[Encoding::O200kBase, Encoding::Cl100kBase]);
    if args.growth || args.files.is_empty() {
        growth(&config, &tokenizers, args.json);
        Ok(())
    } else if args.pairs {
        pairs(&args.files, args.threshold)
    } else if args.cost {
        cost(&args, &config, &tokenizers)
    } else {
        savings(&args, &config, &tokenizers)
    }
}

fn growth(config: &Config, tokenizers: &Tokenizers, json: bool) {
    let rows = super::growth(config, tokenizers, &[10, 20, 50, 100]);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).unwrap_or_default()
        );
    } else {
        print!("{}", super::render_growth(&rows));
    }
}

fn pairs(files: &[PathBuf], threshold: f32) -> Outcome {
    for file in files {
        let eval = super::dedup_pairs(open(file)?, threshold).map_err(|e| cannot_read(file, e))?;
        println!(
            "{}",
            serde_json::to_string_pretty(&eval).unwrap_or_default()
        );
    }
    Ok(())
}

fn cost(args: &AnalyzeArgs, config: &Config, tokenizers: &Tokenizers) -> Outcome {
    for file in &args.files {
        let report = super::cost::cost(
            open(file)?,
            open_meta(file),
            config,
            tokenizers,
            &args.cached_ratio,
        )
        .map_err(|e| cannot_read(file, e))?;
        if args.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).unwrap_or_default()
            );
        } else {
            println!("== {}", file.display());
            print!("{}", report.render());
        }
    }
    Ok(())
}

fn savings(args: &AnalyzeArgs, config: &Config, tokenizers: &Tokenizers) -> Outcome {
    let mut analyses = Vec::new();
    for file in &args.files {
        let analysis = super::analyze(open(file)?, open_meta(file), config, tokenizers)
            .map_err(|e| cannot_read(file, e))?;
        analyses.push((file.display().to_string(), analysis));
    }
    if args.json {
        let files: serde_json::Map<String, serde_json::Value> = analyses
            .iter()
            .map(|(name, a)| (name.clone(), serde_json::to_value(a).unwrap_or_default()))
            .collect();
        let report = serde_json::json!({
            "files": files,
            "fidelity": super::fidelity_total(&analyses),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
        return Ok(());
    }
    for (name, analysis) in &analyses {
        if analyses.len() > 1 {
            println!("== {name}");
        }
        print!("{}", analysis.render());
        if args.misses {
            print!("{}", analysis.render_misses());
        }
    }
    print!("{}", super::render_fidelity(&analyses));
    print!("{}", super::render_loss_kinds(&analyses));
    if args.losses {
        print!("{}", super::render_losses(&analyses));
    }
    Ok(())
}

fn open(file: &Path) -> Result<BufReader<std::fs::File>, Failure> {
    std::fs::File::open(file)
        .map(BufReader::new)
        .map_err(|e| cannot_read(file, e))
}

/// `FILE.meta.jsonl` beside a file: the recorded answers and conversations.
fn open_meta(file: &Path) -> Option<Box<dyn BufRead>> {
    std::fs::File::open(file.with_extension("meta.jsonl"))
        .ok()
        .map(|f| Box::new(BufReader::new(f)) as Box<dyn BufRead>)
}

fn cannot_read(file: &Path, e: impl std::fmt::Display) -> Failure {
    Failure::Other(format!("cannot read {}: {e}", file.display()))
}
