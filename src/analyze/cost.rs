//! `ctxproxy analyze --cost`: what a user is billed for input when the provider caches prompt
//! prefixes, with and without the rewrite. The rule is the one of `cache_cost.py`, the
//! reference measure:
//!
//! - the prompt as the provider sees it: each tool as compact JSON and a newline, in order,
//!   then each message as `<|role|>`, its content (the string, or the compact JSON of a parts
//!   array), the compact JSON of its `tool_calls` and its `tool_call_id`, o200k_base tokens;
//! - cached tokens: the longest common token prefix with the previous request of the same
//!   conversation, 0 under 1,024, else rounded down to a multiple of 128;
//! - the bill at cached-price ratio r, in uncached-token equivalents: uncached + r × cached; in
//!   US dollars with `[prices]` (`input`, `cached_input`).
//!
//! Beyond the reference, the re-ask of an answer that called a stub without a definition (the
//! meta file's `response_tool_names`) is billed as the request it is; the bill without re-asks
//! is reported beside it.

use std::collections::HashMap;
use std::io::BufRead;

use serde::Serialize;
use serde_json::{Value, json};

use super::LineRequest;
use crate::bill::cached_of;
use crate::config::Config;
use crate::openai::ChatRequest;
use crate::pipeline;
use crate::pipeline::config::Definitions;
use crate::pipeline::tools::inline;
use crate::tokens::{Encoding, Tokenizers};

/// A follow-up whose common prefix is under this share of the previous request broke it.
const BROKEN_BELOW: f64 = 0.9;

/// The billed input of one side (the original requests, or the rewrites).
#[derive(Debug, Default, Clone, Serialize)]
pub struct Bill {
    pub input_tokens: u64,
    pub cached_tokens: u64,
    /// Follow-up requests whose prefix broke (see `BROKEN_BELOW`).
    pub prefix_broken: u64,
    /// US dollars, with `[prices]`, over the requests whose model has a price.
    pub usd: f64,
}

impl Bill {
    pub fn cached_share(&self) -> f64 {
        share(self.cached_tokens, self.input_tokens)
    }

    /// In uncached-token equivalents, a cached token costing `ratio` of an uncached one.
    pub fn at_ratio(&self, ratio: f64) -> f64 {
        (self.input_tokens - self.cached_tokens) as f64 + ratio * self.cached_tokens as f64
    }
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct CostReport {
    pub requests: u64,
    pub conversations: u64,
    pub original: Bill,
    /// The rewrites, and the re-asks of those whose recorded answer called a stub the model
    /// had no definition of (each billed as the request it is, after the one it repeats).
    pub rewritten: Bill,
    /// The rewrites alone: what `cache_cost.py`, which sees no re-ask, bills.
    pub rewritten_without_reasks: Bill,
    /// Re-asks billed in `rewritten` (`inline::reask`): recorded answers (`response_tool_names`
    /// of the meta file) that called a tool the rewrite sent as a stub without a definition.
    pub reasks: u64,
    /// Requests whose model has no `[prices]` entry (left out of the dollars).
    pub unpriced: u64,
    /// Rewrites over the budget (sent over the floor).
    pub over_budget: u64,
    pub ratios: Vec<f64>,
    /// Follow-ups whose client request extends the previous one but whose rewrite does not
    /// start with the previous rewrite, by the first stage that changed it (`budget` when the
    /// stages' first pass kept the prefix and the budget's retries did not).
    pub prefix_changed_by: std::collections::BTreeMap<String, u64>,
    /// Rewrites rebuilt whole (a recompaction), by why (`pipeline/prefix.rs`); the others were
    /// appended to the conversation's previous rewrite.
    pub rebuilt: std::collections::BTreeMap<String, u64>,
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

fn compact(value: &Value) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// The prompt text as the provider sees it (see the module docs).
pub fn render_prompt(request: &Value) -> String {
    let mut out = String::new();
    for tool in request["tools"].as_array().into_iter().flatten() {
        out.push_str(&compact(tool));
        out.push('\n');
    }
    if request.get("input").is_some() && request.get("messages").is_none() {
        render_items(request, &mut out);
        return out;
    }
    for message in request["messages"].as_array().into_iter().flatten() {
        out.push_str("<|");
        match &message["role"] {
            Value::String(role) => out.push_str(role),
            other => out.push_str(&compact(other)),
        }
        out.push_str("|>");
        match &message["content"] {
            Value::String(text) => out.push_str(text),
            Value::Null => {}
            parts => out.push_str(&compact(parts)),
        }
        match &message["tool_calls"] {
            Value::Null | Value::Bool(false) => {}
            Value::Array(calls) if calls.is_empty() => {}
            Value::String(s) if s.is_empty() => {}
            calls => out.push_str(&compact(calls)),
        }
        match &message["tool_call_id"] {
            Value::Null | Value::Bool(false) => {}
            Value::String(id) => out.push_str(id),
            other => out.push_str(&compact(other)),
        }
    }
    out
}

/// A Responses body after its tools: `instructions` as a system message, then each input item:
/// a message as `<|role|>` and its text (the string, or the compact JSON of its parts), a
/// `function_call_output` as `<|tool|>`, its output and its call id, any other item as its
/// compact JSON.
fn render_items(request: &Value, out: &mut String) {
    if let Some(Value::String(instructions)) = request.get("instructions")
        && !instructions.is_empty()
    {
        out.push_str("<|system|>");
        out.push_str(instructions);
    }
    let text = |value: &Value| match value {
        Value::String(text) => text.clone(),
        other => compact(other),
    };
    let items = match &request["input"] {
        Value::String(text) => vec![json!({"role": "user", "content": text})],
        Value::Array(items) => items.clone(),
        _ => Vec::new(),
    };
    for item in &items {
        let kind = match item.get("type").and_then(Value::as_str) {
            None if item.get("role").is_some() => "message",
            kind => kind.unwrap_or(""),
        };
        match kind {
            "message" => {
                out.push_str("<|");
                out.push_str(item["role"].as_str().unwrap_or_default());
                out.push_str("|>");
                out.push_str(&text(&item["content"]));
            }
            "function_call_output" => {
                out.push_str("<|tool|>");
                out.push_str(&text(&item["output"]));
                out.push_str(&match &item["call_id"] {
                    Value::String(id) => id.clone(),
                    Value::Null => "None".into(),
                    other => compact(other),
                });
            }
            _ => out.push_str(&compact(item)),
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A request's prompt after each stage of the first pass.
type StageRenders = Vec<(&'static str, String)>;

/// The previous request of each conversation: as the client sent it, after each stage, as sent.
#[derive(Default)]
struct PreviousRenders {
    last: HashMap<String, (String, StageRenders, String)>,
}

impl PreviousRenders {
    /// The first stage whose output no longer starts with the previous request's output of the
    /// same stage, when the client's request extends the previous one and the rewrite does not
    /// extend the previous rewrite.
    fn changed_by(
        &mut self,
        conversation: &str,
        original: String,
        stages: StageRenders,
        sent: String,
    ) -> Option<&'static str> {
        let found = self.last.get(conversation).and_then(|(o, s, r)| {
            if !original.starts_with(o.as_str()) || sent.starts_with(r.as_str()) {
                return None;
            }
            let first = stages
                .iter()
                .zip(s)
                .find(|((_, now), (_, before))| !now.starts_with(before.as_str()))
                .map(|((name, _), _)| *name);
            Some(first.unwrap_or("budget"))
        });
        self.last
            .insert(conversation.to_owned(), (original, stages, sent));
        found
    }
}

/// One side's running bill: the last prompt of each conversation.
#[derive(Default)]
struct Ledger {
    bill: Bill,
    last: HashMap<String, Vec<u32>>,
}

impl Ledger {
    fn add(&mut self, conversation: &str, prompt: &Value, price: Option<(f64, f64)>) {
        let tokens = Encoding::O200kBase.encode(&render_prompt(prompt));
        let previous = self.last.get(conversation);
        let prefix = previous.map_or(0, |p| common_prefix(p, &tokens));
        let cached = cached_of(prefix);
        if let Some(previous) = previous
            && (prefix as f64) < BROKEN_BELOW * previous.len() as f64
        {
            self.bill.prefix_broken += 1;
        }
        self.bill.input_tokens += tokens.len() as u64;
        self.bill.cached_tokens += cached as u64;
        if let Some((input, cached_input)) = price {
            self.bill.usd +=
                ((tokens.len() - cached) as f64 * input + cached as f64 * cached_input) / 1e6;
        }
        self.last.insert(conversation.to_owned(), tokens);
    }
}

/// Bills every request of `reader` (one body per line, each conversation's requests in order;
/// `meta` lines give each one's `conversation`, else the file is one conversation) as sent and
/// as rewritten by the pipeline of `config`.
pub fn cost(
    reader: impl BufRead,
    meta: Option<Box<dyn BufRead>>,
    config: &Config,
    tokenizers: &Tokenizers,
    ratios: &[f64],
) -> std::io::Result<CostReport> {
    let memo = pipeline::Memo::default();
    let mut meta_lines = meta.map(|m| m.lines());
    let (mut original, mut rewritten) = (Ledger::default(), Ledger::default());
    let mut without_reasks = Ledger::default();
    let mut previous = PreviousRenders::default();
    let mut report = CostReport {
        ratios: ratios.to_vec(),
        ..CostReport::default()
    };
    let mut conversations = std::collections::HashSet::new();
    for line in reader.lines() {
        let line = line?;
        let meta_line = match meta_lines.as_mut().and_then(Iterator::next) {
            Some(meta) => Some(meta?),
            None => None,
        };
        if line.trim().is_empty() {
            continue;
        }
        let Ok(body) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let Some(line_request) = LineRequest::of(body.clone()) else {
            continue;
        };
        let request = &line_request.chat;
        let meta_value = meta_line
            .as_deref()
            .and_then(|l| serde_json::from_str::<Value>(l).ok())
            .unwrap_or(Value::Null);
        let conversation = meta_value["conversation"]
            .as_str()
            .map_or_else(|| "all".to_owned(), str::to_owned);
        let called: Vec<String> = meta_value["response_tool_names"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str().map(str::to_owned))
            .collect();
        conversations.insert(conversation.clone());
        let price = config
            .price_of(&request.model)
            .map(|p| (p.input, p.cached_input()));
        if price.is_none() {
            report.unpriced += 1;
        }
        // As explain would: the previous tool turn's categories stand in for the store's.
        let pipeline_config = config.pipeline_for_model(&request.model);
        let sticky = pipeline::tools::previous_turn_categories(request, pipeline_config, &memo);
        let env = pipeline::Env {
            config: pipeline_config,
            counter: tokenizers.for_model(&request.model, None),
            memo: &memo,
            budget: config.pipeline.budget.max_tokens,
            sticky_categories: &sticky,
            reinforcement: None,
            remembered: None,
        };
        let rewrite = line_request.rewrite(&env);
        if !rewrite.report.fits {
            report.over_budget += 1;
        }
        if let Some(reason) = rewrite.report.prefix.as_ref().and_then(|p| p.rebuilt) {
            let name = serde_json::to_value(reason)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            *report.rebuilt.entry(name).or_default() += 1;
        }
        let sent = if rewrite.changed() {
            line_request.body_of(&rewrite.request)
        } else {
            body.clone()
        };
        original.add(&conversation, &body, price);
        rewritten.add(&conversation, &sent, price);
        without_reasks.add(&conversation, &sent, price);
        let definitions = env.config.tools.definitions;
        if let Some(reask) = reasked(request, &rewrite.request, &called, definitions) {
            rewritten.add(&conversation, &line_request.body_of(&reask), price);
            report.reasks += 1;
        }
        let stages = pipeline::stage_snapshots(request, &env)
            .into_iter()
            .map(|(name, r)| (name.as_str(), render_prompt(&line_request.body_of(&r))))
            .collect();
        if let Some(stage) = previous.changed_by(
            &conversation,
            render_prompt(&body),
            stages,
            render_prompt(&sent),
        ) {
            *report
                .prefix_changed_by
                .entry(stage.to_owned())
                .or_default() += 1;
        }
        report.requests += 1;
    }
    report.conversations = conversations.len() as u64;
    report.original = original.bill;
    report.rewritten = rewritten.bill;
    report.rewritten_without_reasks = without_reasks.bill;
    Ok(report)
}

/// The re-ask `sent` costs when its answer calls `called`: `None` when the model had a
/// definition of every tool called.
fn reasked(
    client: &ChatRequest,
    sent: &ChatRequest,
    called: &[String],
    definitions: Definitions,
) -> Option<ChatRequest> {
    let (Some(client_tools), Some(tools)) = (client.tools.get(), sent.tools.get()) else {
        return None;
    };
    let undefined = inline::undefined_stubs(tools, &sent.messages, client_tools);
    let stubs: Vec<String> = called
        .iter()
        .filter(|c| undefined.contains(c))
        .cloned()
        .collect();
    if stubs.is_empty() {
        return None;
    }
    Some(inline::reask(sent, client_tools, &stubs, definitions))
}

/// `1234567` as `1,234,567`.
fn thousands(n: f64) -> String {
    let digits = format!("{:.0}", n.abs());
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    if n < 0.0 { format!("-{out}") } else { out }
}

fn change(new: f64, old: f64) -> f64 {
    if old == 0.0 {
        0.0
    } else {
        100.0 * (new / old - 1.0)
    }
}

impl CostReport {
    /// The bill's change through ctxproxy at cached-price `ratio`, in percent.
    pub fn bill_change(&self, ratio: f64) -> f64 {
        change(
            self.rewritten.at_ratio(ratio),
            self.original.at_ratio(ratio),
        )
    }

    /// A table row of `bill`, as changes against the original requests.
    fn bill_row(&self, name: &str, bill: &Bill) -> String {
        let original = &self.original;
        let changes: Vec<String> = self
            .ratios
            .iter()
            .map(|r| format!("{:+.1}%", change(bill.at_ratio(*r), original.at_ratio(*r))))
            .collect();
        format!(
            "| {name} | {} ({:+.1}%) | {:.1}% | {} | {:.4} ({:+.1}%) |\n",
            thousands(bill.input_tokens as f64),
            change(bill.input_tokens as f64, original.input_tokens as f64),
            bill.cached_share(),
            changes.join(" | "),
            bill.usd,
            change(bill.usd, original.usd)
        )
    }

    pub fn render(&self) -> String {
        let mut out = format!(
            "{} requests, {} conversations\n",
            self.requests, self.conversations
        );
        let ratios: Vec<String> = self
            .ratios
            .iter()
            .enumerate()
            .map(|(i, r)| {
                if i == 0 {
                    format!("bill ×{r}")
                } else {
                    format!("×{r}")
                }
            })
            .collect();
        out.push_str(&format!(
            "|  | input tokens | share cached | {} | USD ([prices]) |\n",
            ratios.join(" | ")
        ));
        out.push_str(&format!("|{}\n", "---|".repeat(4 + self.ratios.len())));
        let original = &self.original;
        let bills: Vec<String> = self
            .ratios
            .iter()
            .map(|r| thousands(original.at_ratio(*r)))
            .collect();
        out.push_str(&format!(
            "| original requests | {} | {:.1}% | {} | {:.4} |\n",
            thousands(original.input_tokens as f64),
            original.cached_share(),
            bills.join(" | "),
            original.usd
        ));
        out.push_str(&self.bill_row("through ctxproxy", &self.rewritten));
        if self.reasks > 0 {
            out.push_str(&self.bill_row(
                "through ctxproxy, re-asks left out (as cache_cost.py)",
                &self.rewritten_without_reasks,
            ));
            out.push_str(&format!(
                "re-asks billed through ctxproxy: {} (recorded answers that called a tool sent as a stub without its definition)\n",
                self.reasks
            ));
        }
        let follow_ups = self.requests.saturating_sub(self.conversations);
        out.push_str(&format!(
            "prefix broken (common prefix < 90% of the previous request): original {} of {follow_ups}, through ctxproxy {} of {follow_ups}\n",
            original.prefix_broken, self.rewritten.prefix_broken
        ));
        if !self.prefix_changed_by.is_empty() {
            let by: Vec<String> = self
                .prefix_changed_by
                .iter()
                .map(|(stage, n)| format!("{stage} {n}"))
                .collect();
            out.push_str(&format!(
                "rewrites that do not extend the previous one (the client's did), by the first stage that changed it: {}\n",
                by.join(", ")
            ));
        }
        if !self.rebuilt.is_empty() {
            let total: u64 = self.rebuilt.values().sum();
            let by: Vec<String> = self
                .rebuilt
                .iter()
                .map(|(reason, n)| format!("{reason} {n}"))
                .collect();
            out.push_str(&format!(
                "rewrites rebuilt whole: {total} of {} ({}); the others appended to the conversation's previous rewrite\n",
                self.requests,
                by.join(", ")
            ));
        }
        if self.unpriced > 0 {
            out.push_str(&format!(
                "{} requests have a model without a [prices] entry: left out of the USD column\n",
                self.unpriced
            ));
        }
        if self.over_budget > 0 {
            out.push_str(&format!(
                "{} rewrites are over the budget (sent over the floor)\n",
                self.over_budget
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompts_render_tools_first_then_messages() {
        let request = json!({
            "model": "gpt-4o",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "hé"}]}
            ]
        });
        assert_eq!(
            render_prompt(&request),
            "{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}\n\
             <|system|>Be brief.\
             <|assistant|>[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]\
             <|tool|>okc1\
             <|user|>[{\"type\":\"text\",\"text\":\"hé\"}]"
        );
    }

    #[test]
    fn the_first_stage_that_breaks_the_prefix_is_named() {
        let mut previous = PreviousRenders::default();
        let stages = |a: &str, b: &str| vec![("tools", a.to_owned()), ("window", b.to_owned())];
        assert_eq!(
            previous.changed_by("c", "ab".into(), stages("T1", "T1 W1"), "T1 W1".into()),
            None,
            "a conversation's first request"
        );
        // The client appended; the window stage rewrote what it had sent.
        assert_eq!(
            previous.changed_by("c", "abc".into(), stages("T1", "T1 W2 x"), "T1 W2 x".into()),
            Some("window")
        );
        // Appended, and appended again: no change.
        assert_eq!(
            previous.changed_by(
                "c",
                "abcd".into(),
                stages("T1", "T1 W2 x y"),
                "T1 W2 x y".into()
            ),
            None
        );
        // The stages kept the prefix, the final rewrite did not: the budget's retries.
        assert_eq!(
            previous.changed_by(
                "c",
                "abcde".into(),
                stages("T1", "T1 W2 x y z"),
                "T9".into()
            ),
            Some("budget")
        );
    }

    #[test]
    fn numbers_get_thousands_separators() {
        assert_eq!(thousands(2698640.0), "2,698,640");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(-1000.0), "-1,000");
    }

    #[test]
    fn a_stable_prefix_is_cached_and_a_changed_one_is_not() {
        let long = "word ".repeat(1500);
        let first = json!({"messages": [{"role": "system", "content": long}, {"role": "user", "content": "a"}]});
        let second = json!({"messages": [{"role": "system", "content": long}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]});
        let changed = json!({"messages": [{"role": "system", "content": format!("New. {long}")}]});
        let mut ledger = Ledger::default();
        ledger.add("c", &first, Some((2.0, 1.0)));
        assert_eq!(
            ledger.bill.cached_tokens, 0,
            "a conversation's first request"
        );
        ledger.add("c", &second, Some((2.0, 1.0)));
        let cached = ledger.bill.cached_tokens;
        assert!(cached >= 1024 && cached % 128 == 0, "{cached}");
        ledger.add("c", &changed, Some((2.0, 1.0)));
        assert_eq!(
            ledger.bill.cached_tokens, cached,
            "the changed start is not cached"
        );
        assert_eq!(ledger.bill.prefix_broken, 1);
        let uncached = (ledger.bill.input_tokens - cached) as f64;
        let expected = (uncached * 2.0 + cached as f64) / 1e6;
        assert!((ledger.bill.usd - expected).abs() < 1e-12);
    }

    #[test]
    fn an_answer_that_calls_an_undefined_stub_bills_its_re_ask() {
        let tool = |name: &str| {
            json!({"type": "function", "function": {"name": name,
                "description": format!("Does {name}. {}", "It takes care. ".repeat(40)),
                "parameters": {"type": "object", "properties": {"id": {"type": "string",
                    "description": "The id. ".repeat(30)}}}}})
        };
        let tools = json!([tool("calendar_add"), tool("mail_send"), tool("docs_find")]);
        let body = json!({"model": "gpt-4o", "tools": tools,
            "messages": [{"role": "user", "content": "Hello there"}]});
        let line = format!("{body}\n");
        let meta = "{\"conversation\": \"c\", \"response_tool_names\": [\"mail_send\"]}\n";
        let config = Config::from_toml(
            "[store]\nbackend = \"memory\"\n[tools]\nmin_tool_tokens = 0\n",
            Vec::<(String, String)>::new(),
        )
        .unwrap();
        let report = cost(
            line.as_bytes(),
            Some(Box::new(std::io::Cursor::new(meta.as_bytes().to_vec()))),
            &config,
            &Tokenizers::default(),
            &[1.0],
        )
        .unwrap();
        assert_eq!(report.reasks, 1);
        // The re-ask is the stubbed request again with the definition appended.
        let without = &report.rewritten_without_reasks;
        assert!(
            report.rewritten.input_tokens > 2 * without.input_tokens,
            "{report:?}"
        );
        assert!(report.rewritten.cached_tokens >= 1024 || without.input_tokens < 1024);
    }
}
