//! `compact`: tool results reduced to what matters (seed 000, Fase 2). Large JSON results keep
//! their identifying fields, flatten `{login}`-style objects, drop nulls, shorten prose and cut
//! lists by whole items; large text keeps its head and tail with the identifiers of the omitted
//! middle listed. Old results become a one-line stub. Values are copied, never paraphrased:
//! cuts happen only at whitespace, line or item boundaries, so no kept identifier changes.

use std::collections::HashSet;

use serde_json::{Map, Value, json};

use super::text::identifiers;
use super::{Stage, StageCx, StageOutput};
use crate::openai::{ChatRequest, Content, Message, Nullable, Role};
use crate::tokens::TokenCounter;

pub struct CompactStage;

/// Characters of the first line kept in the stub of an old result.
const STUB_CHARS: usize = 100;
/// Identifiers listed for an omitted middle of a text result.
const MAX_OMITTED_IDS: usize = 20;

impl Stage for CompactStage {
    fn name(&self) -> &'static str {
        "compact"
    }

    fn enabled(&self, config: &super::PipelineConfig) -> bool {
        config.compact.enabled
    }

    fn apply(&self, request: &ChatRequest, cx: &StageCx<'_>) -> StageOutput {
        let results: Vec<usize> = request
            .messages
            .iter()
            .enumerate()
            .filter(|(_, m)| matches!(m.role, Role::Tool | Role::Function))
            .map(|(i, _)| i)
            .collect();
        // Results of the current turn (after the last user message) are never cleared: the
        // model has not read them yet.
        let current_turn = request
            .messages
            .iter()
            .rposition(|m| m.role == Role::User)
            .unwrap_or(0);
        let recent = results.len().saturating_sub(cx.params.keep_recent_results);
        let keep_from = results
            .iter()
            .position(|&i| i > current_turn)
            .map_or(recent, |first_current| recent.min(first_current));
        let (mut cleared, mut json_compacted, mut text_compacted) = (0, 0, 0);
        // Copied on the first change.
        let mut messages: Option<Vec<Message>> = None;
        let mut replace = |index: usize, text: String| {
            let messages = messages.get_or_insert_with(|| request.messages.clone());
            set_text(&mut messages[index], text);
        };
        for (n, &index) in results.iter().enumerate() {
            let tool_name = tool_name_of(&request.messages, index);
            let message = &request.messages[index];
            let Some(text) = message.content.get().map(|c| c.text()) else {
                continue;
            };
            if n < keep_from {
                let stub = stub(&text);
                if stub.len() < text.len() {
                    replace(index, stub);
                    cleared += 1;
                }
                continue;
            }
            if cx.counter.text(&text) <= cx.params.tool_result_max_tokens {
                continue;
            }
            let mut keep: HashSet<&str> = cx
                .config
                .compact
                .keep_fields
                .iter()
                .map(String::as_str)
                .collect();
            if let Some(extra) = tool_name.and_then(|name| cx.config.compact.tool_fields.get(&name))
            {
                keep.extend(extra.iter().map(String::as_str));
            }
            let compacted = match serde_json::from_str::<Value>(&text) {
                Ok(value) if value.is_object() || value.is_array() => {
                    let out = compact_json_to_fit(&value, &keep, cx.params, cx.counter);
                    json_compacted += 1;
                    out
                }
                _ => {
                    text_compacted += 1;
                    compact_text(&text, cx.params.tool_result_max_tokens, cx.counter)
                }
            };
            if compacted.len() < text.len() {
                replace(index, compacted);
            }
        }
        StageOutput {
            messages,
            tools: None,
            details: json!({"cleared": cleared, "json_compacted": json_compacted, "text_compacted": text_compacted}),
        }
    }
}

fn set_text(message: &mut Message, text: String) {
    message.content = Nullable::Value(Content::Text(text));
}

/// The name of the tool whose call `index` answers.
fn tool_name_of(messages: &[Message], index: usize) -> Option<String> {
    let id = messages[index].tool_call_id.get()?;
    messages[..index].iter().rev().find_map(|m| {
        m.tool_calls()
            .iter()
            .find(|c| &c.id == id)
            .map(|c| c.function.name.clone())
    })
}

/// `[Previous result: <first line, ≤100 chars> …]`.
pub fn stub(text: &str) -> String {
    // The first line with words or digits (pretty JSON starts with a lone `{`).
    let first_line = text
        .lines()
        .map(str::trim)
        .find(|l| l.chars().any(char::is_alphanumeric))
        .unwrap_or("");
    format!(
        "[Previous result: {}]",
        cut_at_whitespace(first_line, STUB_CHARS)
    )
}

/// At most `max_chars` characters, cut at whitespace, with ` …` when cut.
fn cut_at_whitespace(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_owned();
    }
    let limit = text
        .char_indices()
        .nth(max_chars)
        .map_or(text.len(), |(i, _)| i);
    let cut = text[..limit].rfind(char::is_whitespace).unwrap_or(0);
    format!("{} …", text[..cut].trim_end())
}

/// Compacts JSON, then cuts lists shorter until the result fits `tool_result_max_tokens`.
fn compact_json_to_fit(
    value: &Value,
    keep: &HashSet<&str>,
    params: &super::Params,
    counter: &TokenCounter,
) -> String {
    let mut list_cap = usize::MAX;
    loop {
        let compacted = compact_value(value, keep, params.max_string_chars, list_cap);
        let text = serde_json::to_string(&compacted).unwrap_or_default();
        let longest = longest_list(&compacted);
        if counter.text(&text) <= params.tool_result_max_tokens || longest <= 1 {
            return text;
        }
        list_cap = (longest.min(list_cap) / 2).max(1);
    }
}

fn longest_list(value: &Value) -> usize {
    match value {
        Value::Array(items) => items
            .len()
            .max(items.iter().map(longest_list).max().unwrap_or(0)),
        Value::Object(map) => map.values().map(longest_list).max().unwrap_or(0),
        _ => 0,
    }
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// `{"login": "octocat", …}` → `"octocat"`.
fn identity_of(value: &Value) -> Option<&Value> {
    value.as_object()?.get("login").filter(|v| v.is_string())
}

fn compact_value(value: &Value, keep: &HashSet<&str>, max_string: usize, list_cap: usize) -> Value {
    match value {
        Value::Object(map) => {
            let has_identifying = map.keys().any(|k| keep.contains(k.as_str()));
            let mut out = Map::new();
            for (key, field) in map {
                if is_empty(field) {
                    continue;
                }
                if let Some(login) = identity_of(field) {
                    out.insert(key.clone(), login.clone());
                    continue;
                }
                if has_identifying && !keep.contains(key.as_str()) {
                    continue;
                }
                let compacted = compact_value(field, keep, max_string, list_cap);
                if !is_empty(&compacted) {
                    out.insert(key.clone(), compacted);
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => {
            let total = items.len();
            let mut out: Vec<Value> = items
                .iter()
                .take(list_cap)
                .map(|item| compact_value(item, keep, max_string, list_cap))
                .collect();
            if total > out.len() {
                out.push(Value::String(format!("(showing {} of {total})", out.len())));
            }
            Value::Array(out)
        }
        Value::String(s) if s.chars().count() > max_string && s.contains(char::is_whitespace) => {
            Value::String(cut_at_whitespace(s, max_string))
        }
        other => other.clone(),
    }
}

/// Head and tail of a text at line boundaries, within `max_tokens`, with the identifiers of the
/// omitted middle listed.
fn compact_text(text: &str, max_tokens: usize, counter: &TokenCounter) -> String {
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() < 3 {
        // One huge line: keep its start, cut at whitespace (about 4 characters a token).
        return cut_at_whitespace(text, max_tokens * 3);
    }
    let half = max_tokens / 2;
    let (mut head, mut head_tokens) = (0, 0);
    while head < lines.len() {
        let t = counter.text(lines[head]) + 1;
        if head_tokens + t > half {
            break;
        }
        head_tokens += t;
        head += 1;
    }
    let (mut tail, mut tail_tokens) = (lines.len(), 0);
    while tail > head {
        let t = counter.text(lines[tail - 1]) + 1;
        if tail_tokens + t > half {
            break;
        }
        tail_tokens += t;
        tail -= 1;
    }
    if tail <= head {
        return text.to_owned();
    }
    let middle = &lines[head..tail];
    let ids = distinct_identifiers(&middle.join("\n"));
    let alerts: Vec<&str> = middle
        .iter()
        .copied()
        .filter(|l| is_alert(l))
        .take(MAX_ALERT_LINES)
        .collect();
    let mut out = lines[..head].join("\n");
    out.push_str(&format!("\n[… {} lines omitted", tail - head));
    if !ids.is_empty() {
        out.push_str(&format!("; identifiers in them: {}", ids.join(" ")));
    }
    out.push_str(" …]\n");
    for alert in alerts {
        out.push_str(alert);
        out.push('\n');
    }
    out.push_str(&lines[tail..].join("\n"));
    out
}

/// Lines of an omitted middle that are kept anyway: errors and warnings.
const MAX_ALERT_LINES: usize = 5;

fn is_alert(line: &str) -> bool {
    let lower = line.to_ascii_lowercase();
    [
        "error",
        "exception",
        "fatal",
        "panic",
        "fail",
        "warn",
        "traceback",
    ]
    .iter()
    .any(|w| lower.contains(w))
}

/// Identifiers of a text, at most two of each shape (digits masked), so that a column of
/// timestamps or sequence numbers does not crowd out the rare path or id.
fn distinct_identifiers(text: &str) -> Vec<String> {
    let mut shapes: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    identifiers(text)
        .into_iter()
        .filter(|id| {
            let shape: String = id
                .chars()
                .map(|c| if c.is_ascii_digit() { '#' } else { c })
                .collect();
            let seen = shapes.entry(shape).or_insert(0);
            *seen += 1;
            *seen <= 2
        })
        .take(MAX_OMITTED_IDS)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{Params, PipelineConfig};
    use crate::tokens::Encoding;

    fn keep() -> HashSet<&'static str> {
        [
            "name",
            "full_name",
            "id",
            "html_url",
            "description",
            "title",
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn json_keeps_identifying_fields_and_flattens_logins() {
        let repo = json!({"id": 1296269, "name": "Hello-World", "full_name": "octocat/Hello-World",
            "owner": {"login": "octocat", "id": 1, "avatar_url": "https://x"}, "private": false,
            "html_url": "https://github.com/octocat/Hello-World", "description": null,
            "forks_url": "https://api.github.com/repos/octocat/Hello-World/forks", "size": 108});
        let out = compact_value(&repo, &keep(), 300, usize::MAX);
        assert_eq!(
            out,
            json!({"id": 1296269, "name": "Hello-World", "full_name": "octocat/Hello-World",
            "owner": "octocat", "html_url": "https://github.com/octocat/Hello-World"})
        );
    }

    #[test]
    fn lists_are_cut_by_whole_items_to_fit() {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let items: Vec<Value> = (0..200)
            .map(|i| json!({"id": i, "name": format!("repo-{i}"), "junk": "x".repeat(50)}))
            .collect();
        let params = Params {
            tool_result_max_tokens: 200,
            ..Params::from_config(&PipelineConfig::default())
        };
        let out = compact_json_to_fit(&Value::Array(items), &keep(), &params, &counter);
        assert!(counter.text(&out) <= 200, "{out}");
        let parsed: Vec<Value> = serde_json::from_str(&out).unwrap();
        let marker = parsed.last().unwrap().as_str().unwrap();
        assert!(marker.starts_with("(showing ") && marker.ends_with(" of 200)"));
        assert_eq!(parsed[0], json!({"id": 0, "name": "repo-0"}));
    }

    #[test]
    fn prose_is_cut_at_whitespace_identifiers_never() {
        let long = format!(
            "{} https://example.com/a/very/long/path/that/must/not/change end",
            "word ".repeat(70)
        );
        let out = compact_value(&Value::String(long.clone()), &keep(), 300, usize::MAX);
        let out = out.as_str().unwrap();
        assert!(out.ends_with(" …"));
        for id in identifiers(out) {
            assert!(long.contains(&id));
        }
        let url = "https://example.com/".repeat(30);
        assert_eq!(
            compact_value(&json!(url), &keep(), 300, usize::MAX),
            json!(url)
        );
    }

    #[test]
    fn text_keeps_head_and_tail_and_lists_middle_identifiers() {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let lines: Vec<String> = (0..400)
            .map(|i| format!("line {i}: build step ok id=STEP{i:04}"))
            .collect();
        let out = compact_text(&lines.join("\n"), 200, &counter);
        assert!(out.starts_with("line 0:"));
        assert!(out.ends_with("line 399: build step ok id=STEP0399"));
        assert!(out.contains("lines omitted; identifiers in them: "));
        assert!(counter.text(&out) < 400);
    }

    #[test]
    fn stub_keeps_the_first_line() {
        assert_eq!(stub("{\"id\": 1}\nmore"), "[Previous result: {\"id\": 1}]");
        let long = "word ".repeat(40);
        assert!(stub(&long).ends_with(" …]"));
    }
}

#[cfg(test)]
mod current_turn_tests {
    use super::*;
    use crate::pipeline::{Params, PipelineConfig};
    use crate::tokens::Encoding;

    #[test]
    fn results_of_the_current_turn_are_never_cleared() {
        let result = |city: &str| {
            format!("{{\n  \"city\": \"{city}\",\n  \"forecast\": \"sunny all week long\"\n}}")
        };
        let calls: Vec<Value> = ["a", "b", "c", "d"]
            .iter()
            .map(|id| json!({"id": id, "type": "function", "function": {"name": "weather", "arguments": "{}"}}))
            .collect();
        let request: ChatRequest = serde_json::from_value(json!({"model": "m", "messages": [
            {"role": "user", "content": "Weather in Rome, Oslo, Lima and Kyiv?"},
            {"role": "assistant", "content": null, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "a", "content": result("Rome")},
            {"role": "tool", "tool_call_id": "b", "content": result("Oslo")},
            {"role": "tool", "tool_call_id": "c", "content": result("Lima")},
            {"role": "tool", "tool_call_id": "d", "content": result("Kyiv")}
        ]}))
        .unwrap();
        let config = PipelineConfig::default();
        let params = Params::from_config(&config);
        let counter = TokenCounter::new(Encoding::O200kBase);
        let cx = StageCx {
            config: &config,
            params: &params,
            counter: &counter,
            memo: &crate::pipeline::Memo::default(),
            sticky_categories: &[],
            original_messages: &request.messages,
        };
        assert!(CompactStage.apply(&request, &cx).messages.is_none());
        assert_eq!(
            stub(&result("Rome")),
            "[Previous result: \"city\": \"Rome\",]"
        );
    }
}
