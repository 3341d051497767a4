//! `ctxproxy analyze FILE.jsonl`: runs the pipeline over recorded requests (one request body,
//! or one `{"request": …}` object, per line) and reports what each stage saves, in total and
//! per request, with the pipeline's own time. No upstream is called. With the answers the
//! model really gave (`FILE.meta.jsonl`, or the `response` of a `[record]` recording) it also
//! reports fidelity: what the rewrites lost that the answer used (`fidelity.rs`). With
//! `--cost`, the billed input with the provider's prompt cache (`cost.rs`). The flags, and which
//! report they ask for: `command.rs`.

mod command;
pub mod cost;
pub mod fidelity;

use std::collections::BTreeMap;
use std::io::BufRead;
use std::time::Instant;

use serde::Serialize;
use serde_json::Value;

use crate::config::Config;
use crate::openai::{ChatRequest, Role};
use crate::pipeline::tools::inline::{self, undefined_stubs};
use crate::pipeline::{self, StageName};
use crate::responses;
use crate::tokens::Tokenizers;
use fidelity::LossKind;

pub use command::{AnalyzeArgs, cmd};

#[derive(Debug, Default, Serialize)]
pub struct StageTotals {
    pub tokens_saved: u64,
    pub applied: u64,
}

#[derive(Debug, Default, Serialize)]
pub struct Analysis {
    pub requests: u64,
    pub skipped_lines: u64,
    pub tokens_before: u64,
    pub tokens_after: u64,
    /// Tokens of the history: every message except the leading system/developer prompt.
    pub history_tokens_before: u64,
    pub history_tokens_after: u64,
    pub over_budget: u64,
    /// The same history figures over requests of 20 or more turns.
    pub long_requests: u64,
    pub long_history_tokens_before: u64,
    pub long_history_tokens_after: u64,
    pub stages: BTreeMap<String, StageTotals>,
    pub pipeline_micros: Percentiles,
    /// With the recording's meta file: did tool filtering keep the tools the model called?
    pub tools: ToolFiltering,
    /// Identifiers of the recorded answers kept, next tool kept, invalid rewrites, losses.
    pub fidelity: fidelity::Fidelity,
}

/// Tool recall and tool-definition savings (needs `response_tool_names` from a meta file).
#[derive(Debug, Default, Serialize)]
pub struct ToolFiltering {
    /// Requests whose recorded answer called at least one tool, and those calls.
    pub requests_with_calls: u64,
    pub calls: u64,
    /// Called tools offered, in full or as a stub.
    pub calls_kept: u64,
    /// Called tools offered in full.
    pub calls_full: u64,
    /// Requests whose answer's every called tool was kept.
    pub requests_all_kept: u64,
    /// Requests whose answer called a stub: each costs at least one re-ask (the expansion).
    pub requests_expanded: u64,
    /// Requests offering 10 or more tools, and their tool-definition tokens before and after.
    pub requests_10_plus_tools: u64,
    pub tool_tokens_before_10_plus: u64,
    pub tool_tokens_after_10_plus: u64,
    /// Every request where a called tool was removed, to tune categories with.
    pub misses: Vec<ToolMiss>,
}

/// A request whose recorded answer called a tool the filter removed.
#[derive(Debug, Serialize)]
pub struct ToolMiss {
    /// 1-based line of the request in the file.
    pub line: u64,
    pub missing: Vec<String>,
    /// Its first 200 characters.
    pub last_user_message: String,
    /// The `tools` stage's report: scores, matched keywords, sticky and protected tools.
    pub classifier: Value,
}

#[derive(Debug, Default, Clone, Serialize, serde::Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    pub fn of(mut samples: Vec<f64>) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
        Percentiles {
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

/// A line's request as the pipeline reads it: a chat body, or a Responses API body read as one
/// (with what writing its rewrite back needs).
pub(crate) struct LineRequest {
    pub chat: ChatRequest,
    pub responses: Option<responses::Converted>,
}

impl LineRequest {
    /// The request of a JSON body of either API; `None` when it is neither, or is a Responses
    /// body the pipeline leaves as it is (`Converted::rewritable`).
    pub fn of(body: Value) -> Option<LineRequest> {
        let is_responses = body.get("input").is_some() && body.get("messages").is_none();
        if !is_responses {
            return Some(LineRequest {
                chat: serde_json::from_value(body).ok()?,
                responses: None,
            });
        }
        let Value::Object(body) = body else {
            return None;
        };
        let (chat, converted) = responses::to_chat(body).ok()?;
        converted.rewritable().then_some(LineRequest {
            chat,
            responses: Some(converted),
        })
    }

    /// The line's rewrite, as the proxy makes it: a chained Responses body (its history
    /// upstream) gets only what it sends rewritten (`pipeline::seen`).
    pub fn rewrite(&self, env: &pipeline::Env<'_>) -> pipeline::Rewrite {
        match &self.responses {
            Some(converted) if converted.chained() => pipeline::seen::run(&self.chat, env, None),
            _ => pipeline::run(&self.chat, env),
        }
    }

    /// The body that sends `rewritten`, in the line's own API.
    pub fn body_of(&self, rewritten: &ChatRequest) -> Value {
        match &self.responses {
            Some(converted) => Value::Object(responses::from_chat(converted, rewritten)),
            None => serde_json::to_value(rewritten).unwrap_or(Value::Null),
        }
    }

    /// Whether a rewrite keeps every reasoning item where the upstream needs it (always true of
    /// a chat body).
    fn reasoning_in_place(&self, rewritten: &ChatRequest) -> bool {
        let Some(converted) = &self.responses else {
            return true;
        };
        let sent = responses::from_chat(converted, rewritten);
        responses::reasoning_in_place(&converted.client_body(), &sent)
    }
}

/// The request of a line (a body, or a recording's `request`), and the recording's answer.
fn request_of(line: &str) -> Option<(LineRequest, Option<fidelity::Answer>)> {
    let value: Value = serde_json::from_str(line).ok()?;
    match value.get("request") {
        Some(inner) if inner.is_object() => Some((
            LineRequest::of(inner.clone())?,
            fidelity::Answer::from_recording(&value),
        )),
        _ => Some((LineRequest::of(value)?, None)),
    }
}

/// Tokens of the leading system/developer messages, and of the history after them.
fn prompt_split(request: &ChatRequest, tokenizers: &Tokenizers) -> (u64, u64) {
    let counter = tokenizers.for_model(&request.model, None);
    let leading = request
        .messages
        .iter()
        .take_while(|m| matches!(m.role, Role::System | Role::Developer))
        .count();
    let sum = |messages: &[crate::openai::Message]| {
        messages
            .iter()
            .map(|m| counter.message(m) as u64)
            .sum::<u64>()
    };
    (
        sum(&request.messages[..leading]),
        sum(&request.messages[leading..]),
    )
}

/// Turns (user messages) from which a request counts as a long conversation.
const LONG_CONVERSATION_TURNS: usize = 20;

/// Runs the pipeline over `reader`'s requests. `meta`, when given, is the recording's meta
/// file (one line per request, same order) whose `response_tool_names` measure tool recall.
pub fn analyze(
    reader: impl BufRead,
    meta: Option<Box<dyn BufRead>>,
    config: &Config,
    tokenizers: &Tokenizers,
) -> std::io::Result<Analysis> {
    let mut analysis = Analysis::default();
    let mut micros = Vec::new();
    let memo = pipeline::Memo::default();
    let mut meta_lines = meta.map(|m| m.lines());
    for (index, line) in reader.lines().enumerate() {
        let line = line?;
        let line_number = index as u64 + 1;
        let meta_line = match meta_lines.as_mut().and_then(Iterator::next) {
            Some(meta) => Some(meta?),
            None => None,
        };
        if line.trim().is_empty() {
            continue;
        }
        let Some((line_request, recorded)) = request_of(&line) else {
            analysis.skipped_lines += 1;
            continue;
        };
        let request = &line_request.chat;
        let meta_value = meta_line
            .as_deref()
            .and_then(|l| serde_json::from_str::<Value>(l).ok());
        let answer = recorded.or_else(|| meta_value.as_ref().and_then(fidelity::Answer::from_meta));
        let counter = tokenizers.for_model(&request.model, None);
        let started = Instant::now();
        // The store would hold the categories of the previous turn's tools.
        let pipeline_config = config.pipeline_for_model(&request.model);
        let sticky = pipeline::tools::previous_turn_categories(request, pipeline_config, &memo);
        let env = pipeline::Env {
            config: pipeline_config,
            counter,
            memo: &memo,
            budget: config.pipeline.budget.max_tokens,
            sticky_categories: &sticky,
            reinforcement: None,
            remembered: None,
        };
        let rewrite = line_request.rewrite(&env);
        micros.push(started.elapsed().as_secs_f64() * 1e6);
        analysis
            .fidelity
            .measure(index as u64, request, &rewrite, answer.as_ref(), &|| {
                pipeline::stage_snapshots(request, &env)
            });
        if !line_request.reasoning_in_place(&rewrite.request) {
            analysis.fidelity.invalid += 1;
        }
        let report = &rewrite.report;
        analysis.requests += 1;
        analysis.tokens_before += report.tokens_before as u64;
        analysis.tokens_after += report.tokens_after as u64;
        // History after the rewrite excludes the proxy's summary/facts sections in the system
        // message; count them by the system message's growth.
        let (system_before, history_before) = prompt_split(request, tokenizers);
        let (system_after, history_after) = prompt_split(&rewrite.request, tokenizers);
        let history_after = history_after + system_after.saturating_sub(system_before);
        analysis.history_tokens_before += history_before;
        analysis.history_tokens_after += history_after;
        let turns = request
            .messages
            .iter()
            .filter(|m| m.role == Role::User)
            .count();
        if turns >= LONG_CONVERSATION_TURNS {
            analysis.long_requests += 1;
            analysis.long_history_tokens_before += history_before;
            analysis.long_history_tokens_after += history_after;
        }
        if report.over_its_budget() {
            analysis.over_budget += 1;
        }
        let offered = request.tool_names();
        let sent = rewrite.request.tool_names();
        let stubs = match (rewrite.request.tools.get(), request.tools.get()) {
            (Some(sent), Some(client)) => undefined_stubs(sent, &rewrite.request.messages, client),
            _ => Vec::new(),
        };
        let tools = &mut analysis.tools;
        let called = answer
            .as_ref()
            .map(|a| a.expected_tools.clone())
            .unwrap_or_default();
        if !called.is_empty() {
            let kept = called.iter().filter(|c| sent.contains(&c.as_str())).count() as u64;
            if kept < called.len() as u64 {
                tools.misses.push(ToolMiss {
                    line: line_number,
                    missing: called
                        .iter()
                        .filter(|c| !sent.contains(&c.as_str()))
                        .cloned()
                        .collect(),
                    last_user_message: request.last_user_text().chars().take(200).collect(),
                    classifier: report
                        .stage(StageName::Tools)
                        .and_then(|s| serde_json::to_value(&s.details).ok())
                        .unwrap_or_default(),
                });
            }
            tools.requests_with_calls += 1;
            tools.calls += called.len() as u64;
            tools.calls_kept += kept;
            let as_stubs = called.iter().filter(|c| stubs.contains(c)).count() as u64;
            tools.calls_full += kept - as_stubs;
            tools.requests_all_kept += u64::from(kept == called.len() as u64);
            tools.requests_expanded += u64::from(as_stubs > 0);
        }
        if offered.len() >= 10 {
            let tokens =
                |r: &ChatRequest| counter.tools(r.tools.get().map_or(&[], Vec::as_slice)) as u64;
            tools.requests_10_plus_tools += 1;
            tools.tool_tokens_before_10_plus += tokens(request);
            // Definitions placed in the messages are tool definitions too.
            let placed: usize = (rewrite.request.messages.iter())
                .filter(|m| inline::is_definition(m))
                .map(|m| counter.message(m))
                .sum();
            tools.tool_tokens_after_10_plus += tokens(&rewrite.request) + placed as u64;
        }
        for stage in &report.stages {
            let totals = analysis
                .stages
                .entry(stage.stage.as_str().to_owned())
                .or_default();
            totals.applied += u64::from(stage.applied);
        }
        for (stage, saved) in report.savings_by_stage() {
            analysis
                .stages
                .entry(stage.as_str().to_owned())
                .or_default()
                .tokens_saved += saved as u64;
        }
    }
    analysis.pipeline_micros = Percentiles::of(micros);
    Ok(analysis)
}

/// The fidelity of every file together.
pub fn fidelity_total(analyses: &[(String, Analysis)]) -> fidelity::Fidelity {
    let mut total = fidelity::Fidelity::default();
    for (_, analysis) in analyses {
        total.add(&analysis.fidelity);
    }
    total
}

/// One table: per file and overall, reduction, answer identifiers kept, next tool kept,
/// invalid rewrites, last user message changed, over budget (by the part of the floor over).
pub fn render_fidelity(analyses: &[(String, Analysis)]) -> String {
    let total = fidelity_total(analyses);
    let mut rows: Vec<(String, &fidelity::Fidelity)> = analyses
        .iter()
        .map(|(name, a)| {
            let base = std::path::Path::new(name)
                .file_name()
                .map_or_else(|| name.clone(), |f| f.to_string_lossy().into_owned());
            (base, &a.fidelity)
        })
        .collect();
    rows.push(("all".to_owned(), &total));
    let share = |p: Option<f64>, a: u64, b: u64| {
        p.map_or_else(|| "-".to_owned(), |p| format!("{p:.1}% ({a}/{b})"))
    };
    let mut table = vec![[
        "file".to_owned(),
        "requests".to_owned(),
        "reduction".to_owned(),
        "ids kept".to_owned(),
        "next tool kept".to_owned(),
        "invalid".to_owned(),
        "last user changed".to_owned(),
        "over budget (system/tools/working set)".to_owned(),
    ]];
    for (name, f) in &rows {
        let part = |p: &str| f.over_budget_by_part.get(p).copied().unwrap_or(0);
        table.push([
            name.clone(),
            f.requests.to_string(),
            f.reduction()
                .map_or_else(|| "-".to_owned(), |r| format!("{r:.1}%")),
            share(f.ids_kept_percent(), f.ids_kept, f.ids),
            share(f.next_tools_kept_percent(), f.next_tools_kept, f.next_tools),
            f.invalid.to_string(),
            f.last_user_changed.to_string(),
            format!(
                "{} ({}/{}/{})",
                f.over_budget,
                part("system"),
                part("tools"),
                part("working_set")
            ),
        ]);
    }
    let widths: Vec<usize> = (0..8)
        .map(|c| {
            table
                .iter()
                .map(|r| r[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::from("fidelity\n");
    for row in &table {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, v)| {
                if c == 0 {
                    format!("{v:<w$}", w = widths[c])
                } else {
                    format!("{v:>w$}", w = widths[c])
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The identifiers lost, by file and the role of the message that held them, by kind (table,
/// number, prose, code, id). Empty when nothing was lost.
pub fn render_loss_kinds(analyses: &[(String, Analysis)]) -> String {
    let mut rows: BTreeMap<(&str, &str), [u64; 5]> = BTreeMap::new();
    for (name, analysis) in analyses {
        for loss in &analysis.fidelity.losses {
            let role = loss.role.as_deref().unwrap_or("-");
            let column = LossKind::ALL
                .iter()
                .position(|k| *k == loss.kind)
                .unwrap_or(0);
            rows.entry((name.as_str(), role)).or_default()[column] += 1;
        }
    }
    if rows.is_empty() {
        return String::new();
    }
    let width = rows.keys().map(|(f, _)| f.len()).max().unwrap_or(4).max(4);
    let mut out = format!("losses by kind\n{:<width$}  {:<9}", "file", "role");
    for kind in LossKind::ALL {
        out.push_str(&format!("  {:>6}", kind.as_str()));
    }
    out.push('\n');
    for ((file, role), counts) in rows {
        out.push_str(&format!("{file:<width$}  {role:<9}"));
        for n in counts {
            out.push_str(&format!("  {n:>6}"));
        }
        out.push('\n');
    }
    out
}

/// Every identifier a rewrite lost, one line each.
pub fn render_losses(analyses: &[(String, Analysis)]) -> String {
    let mut out = String::new();
    for (name, analysis) in analyses {
        for loss in &analysis.fidelity.losses {
            out.push_str(&format!(
                "lost {name}:{}  {:?}  ({}) in {} message {}  by {}\n",
                loss.index,
                loss.id,
                loss.kind.as_str(),
                loss.role.as_deref().unwrap_or("-"),
                loss.from_end
                    .map_or_else(|| "-".to_owned(), |k| k.to_string()),
                loss.stage
            ));
        }
    }
    out
}

/// Tokens sent for one synthetic conversation cut at a number of turns.
#[derive(Debug, Serialize)]
pub struct GrowthRow {
    pub turns: usize,
    pub bytes: usize,
    pub tokens_before: usize,
    pub tokens_after: usize,
    pub history_tokens_after: u64,
    pub pipeline_micros: f64,
}

/// The O(1) growth report: one synthetic agent conversation (see `synthetic`) cut at each
/// length, through the pipeline. With a working window the sent tokens flatten out.
pub fn growth(config: &Config, tokenizers: &Tokenizers, lengths: &[usize]) -> Vec<GrowthRow> {
    let mut rows = Vec::new();
    let memo = pipeline::Memo::default();
    for &turns in lengths {
        let Ok(request) = crate::synthetic::conversation(turns) else {
            continue;
        };
        let counter = tokenizers.for_model(&request.model, None);
        let started = Instant::now();
        let rewrite = pipeline::run(
            &request,
            &pipeline::Env {
                config: &config.pipeline,
                counter,
                memo: &memo,
                budget: config.pipeline.budget.max_tokens,
                sticky_categories: &[],
                reinforcement: None,
                remembered: None,
            },
        );
        let pipeline_micros = started.elapsed().as_secs_f64() * 1e6;
        let (system_before, _) = prompt_split(&request, tokenizers);
        let (system_after, history_after) = prompt_split(&rewrite.request, tokenizers);
        rows.push(GrowthRow {
            turns,
            bytes: serde_json::to_vec(&request).map_or(0, |b| b.len()),
            tokens_before: rewrite.report.tokens_before,
            tokens_after: rewrite.report.tokens_after,
            history_tokens_after: history_after + system_after.saturating_sub(system_before),
            pipeline_micros,
        });
    }
    rows
}

pub fn render_growth(rows: &[GrowthRow]) -> String {
    let mut out = String::from(
        "turns      bytes   tokens before   tokens sent   history sent   pipeline µs\n",
    );
    for row in rows {
        out.push_str(&format!(
            "{:>5} {:>10} {:>15} {:>13} {:>14} {:>13.0}\n",
            row.turns,
            row.bytes,
            row.tokens_before,
            row.tokens_after,
            row.history_tokens_after,
            row.pipeline_micros
        ));
    }
    out
}

fn percent(before: u64, after: u64) -> f64 {
    if before == 0 {
        0.0
    } else {
        100.0 * (before as f64 - after as f64) / before as f64
    }
}

impl Analysis {
    /// The tool-recall misses, one block each: what was removed, the message, the classifier's
    /// choice and scores.
    pub fn render_misses(&self) -> String {
        let mut out = String::new();
        for miss in &self.tools.misses {
            let c = &miss.classifier;
            out.push_str(&format!(
                "line {}: removed {} (reason {}, categories {}, sticky {})\n  user: {}\n",
                miss.line,
                miss.missing.join(", "),
                c["reason"].as_str().unwrap_or("-"),
                c["categories"],
                c["sticky"],
                miss.last_user_message.replace('\n', " "),
            ));
            for (category, score) in c["scores"].as_object().into_iter().flatten() {
                out.push_str(&format!(
                    "  {category}: {:.2} {}\n",
                    score["score"].as_f64().unwrap_or(0.0),
                    score["keywords"]
                ));
            }
        }
        out
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "requests: {} (skipped lines: {})\n",
            self.requests, self.skipped_lines
        ));
        out.push_str(&format!(
            "prompt tokens: {} → {} ({:.1}% saved)\n",
            self.tokens_before,
            self.tokens_after,
            percent(self.tokens_before, self.tokens_after)
        ));
        out.push_str(&format!(
            "history tokens (all but the client's system prompt): {} → {} ({:.1}% saved)\n",
            self.history_tokens_before,
            self.history_tokens_after,
            percent(self.history_tokens_before, self.history_tokens_after)
        ));
        if self.long_requests > 0 {
            out.push_str(&format!(
                "  in the {} requests of {LONG_CONVERSATION_TURNS}+ turns: {} → {} ({:.1}% saved)\n",
                self.long_requests,
                self.long_history_tokens_before,
                self.long_history_tokens_after,
                percent(
                    self.long_history_tokens_before,
                    self.long_history_tokens_after
                )
            ));
        }
        out.push_str(&format!(
            "over budget after every step: {}\n",
            self.over_budget
        ));
        out.push_str("stage        tokens saved   applied\n");
        for (name, totals) in &self.stages {
            out.push_str(&format!(
                "{name:<12} {:>12}   {:>7}\n",
                totals.tokens_saved, totals.applied
            ));
        }
        let t = &self.tools;
        if t.requests_with_calls > 0 {
            out.push_str(&format!(
                "tool recall: {}/{} called tools offered, in full or as a stub ({:.1}%), {}/{} requests kept all\n",
                t.calls_kept,
                t.calls,
                100.0 * t.calls_kept as f64 / t.calls as f64,
                t.requests_all_kept,
                t.requests_with_calls
            ));
            out.push_str(&format!(
                "called tools offered in full: {}/{} ({:.1}%); re-asks (expansions): {:.1} per 100 tool-calling requests\n",
                t.calls_full,
                t.calls,
                100.0 * t.calls_full as f64 / t.calls as f64,
                100.0 * t.requests_expanded as f64 / t.requests_with_calls as f64,
            ));
        }
        if t.requests_10_plus_tools > 0 {
            out.push_str(&format!(
                "tool definitions in the {} requests with 10+ tools: {} → {} tokens ({:.1}% removed)\n",
                t.requests_10_plus_tools,
                t.tool_tokens_before_10_plus,
                t.tool_tokens_after_10_plus,
                percent(t.tool_tokens_before_10_plus, t.tool_tokens_after_10_plus)
            ));
        }
        let p = &self.pipeline_micros;
        out.push_str(&format!(
            "pipeline time (µs): p50 {:.0}  p90 {:.0}  p99 {:.0}  max {:.0}\n",
            p.p50, p.p90, p.p99, p.max
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_sent_stay_flat_as_a_conversation_grows() {
        let config = Config::from_toml("", Vec::new()).unwrap();
        let rows = growth(&config, &Tokenizers::default(), &[10, 20, 50, 100]);
        let sent: Vec<usize> = rows.iter().map(|r| r.tokens_after).collect();
        let before: Vec<usize> = rows.iter().map(|r| r.tokens_before).collect();
        assert!(before[3] > 4 * before[1], "{before:?}");
        // Between recompactions a conversation appends, so what is sent saw-tooths; it never
        // passes the budget (4,000) that the whole rewrite fits.
        assert!(sent.iter().all(|&n| n <= 4_000), "{sent:?}");
    }
}

/// How the dedup decision did on some labelled pairs.
#[derive(Debug, Default, Clone, Serialize)]
pub struct PairCounts {
    pub pairs: u64,
    pub true_positives: u64,
    pub false_positives: u64,
    pub false_negatives: u64,
    pub true_negatives: u64,
    pub precision: f64,
    pub recall: f64,
}

impl PairCounts {
    fn add(&mut self, decided: bool, label: bool) {
        self.pairs += 1;
        match (decided, label) {
            (true, true) => self.true_positives += 1,
            (true, false) => self.false_positives += 1,
            (false, true) => self.false_negatives += 1,
            (false, false) => self.true_negatives += 1,
        }
        let ratio = |x: u64, y: u64| {
            if x + y == 0 {
                0.0
            } else {
                x as f64 / (x + y) as f64
            }
        };
        self.precision = ratio(self.true_positives, self.false_positives);
        self.recall = ratio(self.true_positives, self.false_negatives);
    }
}

/// The dedup decision over labelled pairs (`{"a", "b", "duplicate"}` per line, and an optional
/// `category`), overall and per category.
#[derive(Debug, Default, Serialize)]
pub struct PairEvaluation {
    #[serde(flatten)]
    pub overall: PairCounts,
    pub threshold: f32,
    pub by_category: BTreeMap<String, PairCounts>,
    /// The pairs labelled distinct that the cache would have answered with each other.
    pub false_positive_pairs: Vec<[String; 2]>,
}

pub fn dedup_pairs(reader: impl BufRead, threshold: f32) -> std::io::Result<PairEvaluation> {
    let mut eval = PairEvaluation {
        threshold,
        ..PairEvaluation::default()
    };
    for line in reader.lines() {
        let line = line?;
        let Ok(pair) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let (Some(a), Some(b), Some(label)) = (
            pair.get("a").and_then(Value::as_str),
            pair.get("b").and_then(Value::as_str),
            pair.get("duplicate").and_then(Value::as_bool),
        ) else {
            continue;
        };
        let decided = crate::cache::dedup::is_duplicate(a, b, threshold);
        eval.overall.add(decided, label);
        if let Some(category) = pair.get("category").and_then(Value::as_str) {
            let counts = eval.by_category.entry(category.to_owned()).or_default();
            counts.add(decided, label);
        }
        if decided && !label {
            eval.false_positive_pairs.push([a.to_owned(), b.to_owned()]);
        }
    }
    Ok(eval)
}
