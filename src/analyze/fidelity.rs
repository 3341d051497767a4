//! Fidelity of rewrites against what the model really answered next: the identifiers of that
//! answer the rewrite still carries, whether the tool it called is still offered, and whether
//! the rewrite is valid. The definitions are those of `shared/tools/eval_fidelity.py` (the
//! reference), so `ctxproxy analyze` and that script agree on the same traffic.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::Value;

use crate::openai::{ChatRequest, Message, Role};
use crate::pipeline::payload::{self, Payload};
use crate::pipeline::{OverPart, Rewrite, StageName};

/// What the model answered to a recorded request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    /// Identifiers of the answer (the reference definition, see `answer_identifiers`).
    pub identifiers: BTreeSet<String>,
    /// Tools it called.
    pub tools: Vec<String>,
    /// For scaffolded conversations without a recorded answer, the tool expected next (tool
    /// recall only; fidelity counts recorded calls, as the reference does).
    pub expected_tools: Vec<String>,
}

impl Answer {
    /// From a meta line: `response` (the assistant message) and `response_tool_names` (for
    /// scaffolded conversations without a recorded answer, `scaffold_expected_next_tool`).
    pub fn from_meta(meta: &Value) -> Option<Answer> {
        let response = meta.get("response").filter(|r| r.is_object());
        let tools: Option<Vec<String>> = meta
            .get("response_tool_names")
            .and_then(|n| serde_json::from_value(n.clone()).ok());
        let expected: Option<Vec<String>> = meta
            .get("scaffold_expected_next_tool")
            .and_then(Value::as_str)
            .map(|name| vec![name.to_owned()]);
        if response.is_none() && tools.is_none() && expected.is_none() {
            return None;
        }
        let tools = tools.unwrap_or_default();
        Some(Answer {
            identifiers: response.map(answer_identifiers).unwrap_or_default(),
            expected_tools: if tools.is_empty() {
                expected.unwrap_or_default()
            } else {
                tools.clone()
            },
            tools,
        })
    }

    /// From a `[record]` line: the first choice of its `response`.
    pub fn from_recording(line: &Value) -> Option<Answer> {
        let message = line
            .get("response")?
            .get("choices")?
            .get(0)?
            .get("message")
            .filter(|m| m.is_object())?;
        let tools = called_tools(message);
        Some(Answer {
            identifiers: answer_identifiers(message),
            expected_tools: tools.clone(),
            tools,
        })
    }
}

fn called_tools(message: &Value) -> Vec<String> {
    message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("function")?.get("name")?.as_str().map(str::to_owned))
        .collect()
}

/// The identifiers of an assistant message: its tool-call argument scalars (strings and
/// numbers at any depth, 3–80 characters as text), and the tokens of its text content made of
/// `[A-Za-z0-9_\-.@/:]` (3+), stripped of `.:/,` at both ends, that are 4+ characters long
/// and hold a digit or `@`, or are all capitals of 5+ characters.
pub fn answer_identifiers(message: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for call in message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let arguments = call
            .get("function")
            .and_then(|f| f.get("arguments"))
            .and_then(Value::as_str)
            .unwrap_or("{}");
        if let Ok(value) = serde_json::from_str::<Value>(arguments) {
            argument_scalars(&value, &mut out);
        }
    }
    if let Some(text) = message.get("content").and_then(Value::as_str) {
        for token in id_tokens(text) {
            let token = token.trim_matches(['.', ':', '/', ',']);
            let upper = token.chars().any(|c| c.is_ascii_alphabetic())
                && !token.chars().any(|c| c.is_ascii_lowercase());
            if token.chars().count() >= 4
                && (token.chars().any(|c| c.is_ascii_digit())
                    || token.contains('@')
                    || (upper && token.chars().count() >= 5))
            {
                out.insert(token.to_owned());
            }
        }
    }
    out
}

fn argument_scalars(value: &Value, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) => map.values().for_each(|v| argument_scalars(v, out)),
        Value::Array(items) => items.iter().for_each(|v| argument_scalars(v, out)),
        Value::String(s) if (3..=80).contains(&s.chars().count()) => {
            out.insert(s.clone());
        }
        Value::Number(n) => {
            let text = python_number(n);
            if (3..=80).contains(&text.chars().count()) {
                out.insert(text);
            }
        }
        _ => {}
    }
}

/// A number as Python's `str()` writes it (`2.0` stays `2.0`, `1e+20` as `1e+20`).
fn python_number(n: &serde_json::Number) -> String {
    match (n.as_i64(), n.as_u64(), n.as_f64()) {
        (Some(i), _, _) => i.to_string(),
        (None, Some(u), _) => u.to_string(),
        (_, _, Some(f)) if f.fract() == 0.0 && f.abs() < 1e16 => format!("{f:.1}"),
        _ => n.to_string(),
    }
}

/// Maximal runs of 3+ characters of `[A-Za-z0-9_\-.@/:]`.
fn id_tokens(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| {
        !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '@' | '/' | ':'))
    })
    .filter(|t| t.len() >= 3)
}

/// Every tool message answers a call of the assistant message before it, and no call is left
/// unanswered.
pub fn valid_pairs(messages: &[Message]) -> bool {
    let mut pending: Vec<&str> = Vec::new();
    for message in messages {
        if message.role == Role::Tool {
            let id = message.tool_call_id.get().map_or("", |id| id.as_str());
            let Some(at) = pending.iter().position(|p| *p == id) else {
                return false;
            };
            pending.remove(at);
        } else {
            if !pending.is_empty() {
                return false;
            }
            if message.role == Role::Assistant {
                pending = message.tool_calls().iter().map(|c| c.id.as_str()).collect();
            }
        }
    }
    pending.is_empty()
}

fn last_user(messages: &[Message]) -> Option<&Message> {
    messages.iter().rev().find(|m| m.role == Role::User)
}

/// One identifier the rewrite lost.
#[derive(Debug, Clone, Serialize)]
pub struct Loss {
    /// 0-based index of the request in its file.
    pub index: u64,
    pub id: String,
    /// The last original message holding it: its role and position from the end (-1 = last).
    pub role: Option<String>,
    pub from_end: Option<i64>,
    /// The first stage whose output lacks it (`budget` when the first pass kept it).
    pub stage: StageName,
    /// What it was in that message.
    pub kind: LossKind,
}

/// What a lost identifier was where the conversation said it, most specific first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// In a fenced code block or inline code.
    Code,
    /// In a row of a table: a list of objects, or lines with `|` or tabs.
    Table,
    /// A number outside a table.
    Number,
    /// In text that is no JSON (prose, logs).
    Prose,
    /// An id, code or name in a JSON value.
    Id,
}

impl LossKind {
    pub const ALL: [LossKind; 5] = [
        LossKind::Table,
        LossKind::Number,
        LossKind::Prose,
        LossKind::Code,
        LossKind::Id,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LossKind::Code => "code",
            LossKind::Table => "table",
            LossKind::Number => "number",
            LossKind::Prose => "prose",
            LossKind::Id => "id",
        }
    }

    /// What `id` was in `text`, the content of the message that held it.
    pub fn of(id: &str, text: &str) -> LossKind {
        if in_code(id, text) {
            return LossKind::Code;
        }
        let content = payload::read(text);
        let in_table = match &content {
            Payload::Tree(tree) => in_rows(id, tree),
            Payload::Text(text) => text
                .lines()
                .any(|l| l.contains(id) && (l.contains(" | ") || l.contains('\t'))),
        };
        if in_table {
            LossKind::Table
        } else if id.parse::<f64>().is_ok() {
            LossKind::Number
        } else if matches!(content, Payload::Text(_)) {
            LossKind::Prose
        } else {
            LossKind::Id
        }
    }
}

/// Whether `id` is inside a fenced block or between backticks of `text`.
fn in_code(id: &str, text: &str) -> bool {
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if line.contains(id)
            && (fenced
                || line
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .any(|code| code.contains(id)))
        {
            return true;
        }
    }
    false
}

/// Whether `id` is a value of a list of at least two objects (rows) in `tree`.
fn in_rows(id: &str, tree: &Value) -> bool {
    match tree {
        Value::Array(items) => {
            let rows = items.len() >= 2 && items.iter().all(Value::is_object);
            (rows && items.iter().any(|row| row.to_string().contains(id)))
                || items.iter().any(|item| in_rows(id, item))
        }
        Value::Object(map) => map.values().any(|v| in_rows(id, v)),
        _ => false,
    }
}

/// Fidelity totals over some requests.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Fidelity {
    pub requests: u64,
    pub tokens_before: u64,
    pub tokens_after: u64,
    /// Answer identifiers present in the original messages, and those still in the rewrite.
    pub ids: u64,
    pub ids_kept: u64,
    pub next_tools: u64,
    pub next_tools_kept: u64,
    pub invalid: u64,
    pub last_user_changed: u64,
    pub over_budget: u64,
    /// Over-budget rewrites by the part of the floor that is over (system, tools, working set).
    pub over_budget_by_part: BTreeMap<&'static str, u64>,
    pub losses: Vec<Loss>,
}

impl Fidelity {
    pub fn reduction(&self) -> Option<f64> {
        (self.tokens_before > 0).then(|| {
            100.0 * (self.tokens_before as f64 - self.tokens_after as f64)
                / self.tokens_before as f64
        })
    }

    pub fn ids_kept_percent(&self) -> Option<f64> {
        (self.ids > 0).then(|| 100.0 * self.ids_kept as f64 / self.ids as f64)
    }

    pub fn next_tools_kept_percent(&self) -> Option<f64> {
        (self.next_tools > 0).then(|| 100.0 * self.next_tools_kept as f64 / self.next_tools as f64)
    }

    pub fn add(&mut self, other: &Fidelity) {
        self.requests += other.requests;
        self.tokens_before += other.tokens_before;
        self.tokens_after += other.tokens_after;
        self.ids += other.ids;
        self.ids_kept += other.ids_kept;
        self.next_tools += other.next_tools;
        self.next_tools_kept += other.next_tools_kept;
        self.invalid += other.invalid;
        self.last_user_changed += other.last_user_changed;
        self.over_budget += other.over_budget;
        for (part, n) in &other.over_budget_by_part {
            *self.over_budget_by_part.entry(part).or_default() += n;
        }
        self.losses.extend(other.losses.iter().cloned());
    }

    /// Adds one request. `snapshots` gives the request after each stage (to name the stage
    /// that lost an identifier); it is computed only when something was lost.
    pub fn measure(
        &mut self,
        index: u64,
        original: &ChatRequest,
        rewrite: &Rewrite,
        answer: Option<&Answer>,
        snapshots: &dyn Fn() -> Vec<(StageName, ChatRequest)>,
    ) {
        let report = &rewrite.report;
        self.requests += 1;
        self.tokens_before += report.tokens_before as u64;
        self.tokens_after += report.tokens_after as u64;
        let sent = &rewrite.request;
        self.invalid += u64::from(!valid_pairs(&sent.messages));
        let user_before = last_user(&original.messages).map(|m| &m.content);
        let user_after = last_user(&sent.messages).map(|m| &m.content);
        self.last_user_changed += u64::from(user_before.is_some() && user_before != user_after);
        if let Some(over) = &report.over_budget {
            self.over_budget += 1;
            *self
                .over_budget_by_part
                .entry(part_name(over.part))
                .or_default() += 1;
        } else if report.over_its_budget() {
            self.over_budget += 1;
        }
        let Some(answer) = answer else { return };
        let offered: BTreeSet<&str> = sent
            .tools
            .get()
            .into_iter()
            .flatten()
            .filter_map(|t| t.function.as_ref().map(|f| f.name.as_str()))
            .collect();
        self.next_tools += answer.tools.len() as u64;
        self.next_tools_kept += answer
            .tools
            .iter()
            .filter(|t| offered.contains(t.as_str()))
            .count() as u64;
        let original_text = serde_json::to_string(&original.messages).unwrap_or_default();
        let sent_text = serde_json::to_string(sent).unwrap_or_default();
        let lost: Vec<&String> = answer
            .identifiers
            .iter()
            .filter(|id| original_text.contains(id.as_str()))
            .inspect(|_| self.ids += 1)
            .filter(|id| !sent_text.contains(id.as_str()))
            .collect();
        self.ids_kept += (answer
            .identifiers
            .iter()
            .filter(|id| original_text.contains(id.as_str()))
            .count()
            - lost.len()) as u64;
        if lost.is_empty() {
            return;
        }
        let snapshots: Vec<(StageName, String)> = snapshots()
            .into_iter()
            .map(|(stage, request)| (stage, serde_json::to_string(&request).unwrap_or_default()))
            .collect();
        for id in lost {
            let holder = original.messages.iter().rev().enumerate().find(|(_, m)| {
                serde_json::to_string(m).is_ok_and(|text| text.contains(id.as_str()))
            });
            let stage = snapshots
                .iter()
                .find(|(_, text)| !text.contains(id.as_str()))
                .map_or(StageName::Budget, |(stage, _)| *stage);
            let text = holder.map(|(_, m)| {
                m.content
                    .get()
                    .map(|c| c.text().into_owned())
                    .unwrap_or_default()
                    + &serde_json::to_string(m.tool_calls()).unwrap_or_default()
            });
            self.losses.push(Loss {
                index,
                id: id.clone(),
                role: holder.map(|(_, m)| m.role.as_str().to_owned()),
                from_end: holder.map(|(k, _)| -(k as i64 + 1)),
                stage,
                kind: LossKind::of(id, text.as_deref().unwrap_or_default()),
            });
        }
    }
}

pub fn part_name(part: OverPart) -> &'static str {
    match part {
        OverPart::System => "system",
        OverPart::Tools => "tools",
        OverPart::WorkingSet => "working_set",
        OverPart::History => "history",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn answer_identifiers_follow_the_reference_definition() {
        let message = json!({"role": "assistant",
            "content": "Order #W9348897 is pending; mail a.b@x.io or call SUPPORT. Total: 1,166.98. ok 12",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "modify",
                "arguments": "{\"order_id\": \"#W9348897\", \"item_ids\": [\"6117189161\"], \"qty\": 2, \"price\": 481.5, \"ok\": true, \"x\": \"ab\"}"}}]});
        let ids: Vec<String> = answer_identifiers(&message).into_iter().collect();
        assert_eq!(
            ids,
            vec![
                "#W9348897",
                "166.98",
                "481.5",
                "6117189161",
                "SUPPORT",
                "W9348897",
                "a.b@x.io"
            ]
        );
        let answer =
            Answer::from_recording(&json!({"response": {"choices": [{"message": message}]}}))
                .unwrap();
        assert_eq!(answer.tools, vec!["modify"]);
    }

    #[test]
    fn losses_are_told_apart_by_kind() {
        let code =
            "Run it:\n```sh\ndocker run -p 8000:8000 postgres:13\n```\nThen `export PGPORT=5433`.";
        assert_eq!(LossKind::of("8000:8000", code), LossKind::Code);
        assert_eq!(LossKind::of("PGPORT", code), LossKind::Code);
        let rows = r#"[{"dept": "Finance", "avg": "35.8"}, {"dept": "Sales", "avg": "34.6"}]"#;
        assert_eq!(LossKind::of("34.6", rows), LossKind::Table);
        assert_eq!(
            LossKind::of("29.1", "avg | 29.1\nmax | 31"),
            LossKind::Table
        );
        assert_eq!(LossKind::of("29.1", r#"{"avg": 29.1}"#), LossKind::Number);
        assert_eq!(LossKind::of("Mia", "Hi, I am Mia."), LossKind::Prose);
        assert_eq!(LossKind::of("W77", r#"{"order": "W77"}"#), LossKind::Id);
    }

    #[test]
    fn pairs_are_checked_like_the_upstream_does() {
        let ok: Vec<Message> = serde_json::from_value(json!([
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "r"}
        ]))
        .unwrap();
        assert!(valid_pairs(&ok));
        assert!(!valid_pairs(&ok[..2]));
        assert!(!valid_pairs(&[ok[0].clone(), ok[2].clone()]));
    }
}
