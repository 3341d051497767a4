//! `compact`: tool results reduced to what matters. Large JSON results keep
//! their identifying fields, flatten `{login}`-style objects, drop nulls, shorten prose and cut
//! lists by whole items; large text keeps its head and tail with the identifiers of the omitted
//! middle listed. Old results become a one-line stub. Values are copied, never paraphrased:
//! cuts happen only at whitespace, line or item boundaries, so no kept identifier changes.

// foldhash: the sets here are read for membership only, and SipHash was a tenth of compaction.
use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::hash::BuildHasher;
use std::sync::Arc;

use foldhash::quality::FixedState;

use serde::Serialize;
use serde_json::{Map, Value};

use super::config::PipelineConfig;
use super::identifiers::{call_label, json_identifiers, render_labelled_once, scalar_identifier};
use super::memo::Memo;
use super::payload;
use super::reads::{self, Read};
use super::recall;
use super::stage::{Params, Stage, StageCx, StageName, StageOutput};
use super::text::identifiers;
use super::tools::inline;
use super::working_set::WorkingSet;
use crate::openai::{ChatRequest, Content, Message, Nullable, Role, SharedText, ToolCall};
use crate::tokens::TokenCounter;

mod listing;
mod table;

use listing::TaskWords;
use table::tabulated;

/// `compact`: tool results cleared to a stub, or compacted as JSON or as text.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct CompactDetails {
    pub cleared: usize,
    pub json_compacted: usize,
    pub text_compacted: usize,
    /// The handles that the results cleared or cut name (`ctxproxy_recall`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub handles: Vec<String>,
}

pub struct CompactStage;

/// Characters of the first line kept in the stub of an old result.
const STUB_CHARS: usize = 100;
/// Identifiers listed for an omitted middle of a text result.
const MAX_OMITTED_IDS: usize = 20;

impl Stage for CompactStage {
    type Details = CompactDetails;

    fn name(&self) -> StageName {
        StageName::Compact
    }

    fn enabled(&self, config: &PipelineConfig) -> bool {
        config.compact.enabled
    }

    fn apply(&self, request: &ChatRequest, cx: &StageCx<'_>) -> StageOutput<CompactDetails> {
        let results: Vec<usize> = request
            .messages
            .iter()
            .enumerate()
            .filter(|(_, m)| matches!(m.role, Role::Tool | Role::Function))
            // A definition placed as a call's result (`in_result`) is not the client's.
            .filter(|(_, m)| !inline::is_definition_result(m))
            .map(|(i, _)| i)
            .collect();
        // The working set is never cleared; the rest is, but for the latest results.
        let working_set = WorkingSet::of(&request.messages, cx.config.window.recent_tool_steps);
        let keep_from = results.len().saturating_sub(cx.params.keep_recent_results);
        let clear = cleared_in_batches(
            &request.messages,
            &results[..keep_from],
            &working_set,
            cx.config.compact.clear_at_least_tokens,
            cx,
        );
        let (mut cleared, mut json_compacted, mut text_compacted) = (0, 0, 0);
        // A result cleared or cut names the handle of its original (`recall.rs`).
        let recall = cx.config.compact.recall
            && recall::can_offer(request, request.tools.get().map_or(&[], Vec::as_slice));
        let mut handles = Vec::new();
        // What the user asked before each result, hashed as the results are met in order.
        let mut asked = AskedSoFar::default();
        // The new texts by index, in order; the messages are copied once, at the end, without
        // the texts they replace.
        let mut replaced: Vec<(usize, SharedText)> = Vec::new();
        let mut replace = |index: usize, text: SharedText| replaced.push((index, text));
        for (n, &index) in results.iter().enumerate() {
            let call = call_of(&request.messages, index);
            let message = &request.messages[index];
            let Some(result) = ResultText::of(message) else {
                continue;
            };
            let text = &result.text;
            let protected = working_set.contains(index);
            if protected {
                let kept = working_set_result(&result, cx.config, cx.counter, cx.memo);
                if let Some((compacted, form)) = kept {
                    match form {
                        Form::Json => json_compacted += 1,
                        Form::Text => text_compacted += 1,
                    }
                    replace(index, compacted);
                }
                continue;
            }
            if n < keep_from && clear.contains(&index) {
                let max_tokens = cx.config.compact.stub_max_tokens;
                let before = &request.messages[..index];
                // What the user asked plays a part only when the stub must be cut.
                let start = stub_start(call, &result, max_tokens, cx.counter, cx.memo);
                let key = match &*start {
                    StubStart::Whole(_) => stub_start_key(call, &result, max_tokens, cx.counter),
                    StubStart::TooLong { .. } => {
                        stub_key(call, &result, max_tokens, asked.hash(before), cx)
                    }
                };
                // The stub as sent, its handle with it: every point and budget step of a
                // conversation clears the same results again.
                let sent_key = FixedState::with_seed(SENT_STUB_SEED).hash_one((key, recall));
                let stub = cx.memo.value(sent_key, || {
                    let cut;
                    let stub: &str = match &*start {
                        StubStart::Whole(stub) => stub,
                        StubStart::TooLong { label, read, held } => {
                            cut = cx.memo.text(key, || {
                                let task = TaskWords::of(before, call);
                                cut_stub(label, read.tree(), held, max_tokens, &task, cx.counter)
                            });
                            &cut
                        }
                    };
                    match recall.then(|| recall::handle_of(text)) {
                        Some(handle) => SentStub(with_handle(stub, &handle).into(), Some(handle)),
                        None => SentStub(stub.into(), None),
                    }
                });
                if stub.0.len() < text.len() {
                    replace(index, stub.0.clone());
                    handles.extend(stub.1.clone());
                    cleared += 1;
                }
                continue;
            }
            let max_tokens = cx.params.tool_result_max_tokens;
            let tokens = cx.counter.text_recurring(text);
            if tokens <= max_tokens {
                // Within the configured cap too, the working-set form is the minified JSON,
                // memoized: each point and budget step meets the same result again.
                let kept = if tokens <= cx.config.compact.tool_result_max_tokens {
                    working_set_result(&result, cx.config, cx.counter, cx.memo)
                } else {
                    minified(text).map(|json| (SharedText::from(json), Form::Json))
                };
                if let Some((kept, form)) = kept {
                    match form {
                        Form::Json => json_compacted += 1,
                        Form::Text => text_compacted += 1,
                    }
                    replace(index, kept);
                }
                continue;
            }
            let cut = cut_result(call, &result, max_tokens, cx);
            match cut.1 {
                Form::Json => json_compacted += 1,
                Form::Text => text_compacted += 1,
            }
            if !recall {
                if cut.0.len() < text.len() {
                    replace(index, cut.0.clone());
                }
                continue;
            }
            let handle = recall::handle_of(text);
            let note = recall::cut_note(&handle);
            if cut.0.len() + note.len() < text.len() {
                let mut compacted = String::with_capacity(cut.0.len() + note.len());
                compacted.push_str(&cut.0);
                compacted.push_str(&note);
                replace(index, compacted.into());
                handles.push(handle);
            }
        }
        let messages = (!replaced.is_empty()).then(|| {
            let mut replaced = replaced.into_iter().peekable();
            request
                .messages
                .iter()
                .enumerate()
                .map(
                    |(index, message)| match replaced.next_if(|(at, _)| *at == index) {
                        Some((_, text)) => with_text(message, text),
                        None => message.clone(),
                    },
                )
                .collect()
        });
        StageOutput {
            messages,
            tools: None,
            details: CompactDetails {
                cleared,
                json_compacted,
                text_compacted,
                handles,
            },
        }
    }
}

/// What a compacted result was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Form {
    Json,
    Text,
}

/// A tool result as the working set keeps it, and as a message appended between
/// recompactions is sent (`prefix.rs`): whole (without the MCP envelopes that say nothing but
/// what they wrap, `payload::bare`), or, over `tool_result_max_tokens`, compacted without
/// losing a field or an identifier (only nulls, empty values and long prose go). `None` when it
/// is sent as it is.
pub(super) fn working_set_result(
    result: &ResultText<'_>,
    config: &PipelineConfig,
    counter: &TokenCounter,
    memo: &Memo,
) -> Option<(SharedText, Form)> {
    let compact = &config.compact;
    let key = FixedState::with_seed(WORKING_SET_SEED).hash_one((
        result.digest,
        compact.tool_result_max_tokens,
        compact.max_string_chars,
        counter.encoding(),
    ));
    let kept = memo.value(key, || {
        WorkingSetForm(
            lossless(&result.text, config, counter, memo).map(|(text, form)| (text.into(), form)),
        )
    });
    kept.0.clone()
}

/// A tool result's text, with the digest that the memo keys of its forms read: a plain
/// string's was taken when it was read, so a result met again at every point and budget step
/// is not hashed again.
pub(super) struct ResultText<'a> {
    text: std::borrow::Cow<'a, str>,
    digest: u64,
}

impl<'a> ResultText<'a> {
    fn of(message: &'a Message) -> Option<ResultText<'a>> {
        match message.content.get()? {
            Content::Text(text) => Some(ResultText {
                text: std::borrow::Cow::Borrowed(text.as_str()),
                digest: text.digest(),
            }),
            parts => {
                let text = parts.text();
                let digest = SharedText::digest_of(&text);
                Some(ResultText { text, digest })
            }
        }
    }
}

/// Seed of the memo keys of the stubs as sent.
const SENT_STUB_SEED: u64 = 0x7365_6e74_7374_0001;

/// A cleared result's stub as sent, and the handle it names (with the recall tool).
struct SentStub(SharedText, Option<String>);

impl crate::bounded::Weigh for SentStub {
    fn heap_bytes(&self) -> usize {
        self.0.len() + self.1.as_ref().map_or(0, String::capacity)
    }
}

/// A result over `max_tokens` outside the working set, cut to fit: its JSON compacted (the
/// fields `keep_fields` and the call's `tool_fields` kept whole), or its text. Memoized: every
/// point of a conversation and every budget re-run cut the same results again.
fn cut_result(
    call: Option<&ToolCall>,
    result: &ResultText<'_>,
    max_tokens: usize,
    cx: &StageCx<'_>,
) -> Arc<CutForm> {
    let compact = &cx.config.compact;
    let extra = call.and_then(|c| compact.tool_fields.get(&c.function.name));
    let text: &str = &result.text;
    let key = FixedState::with_seed(CUT_SEED).hash_one((
        result.digest,
        max_tokens,
        cx.params.max_string_chars,
        &compact.keep_fields,
        extra,
        cx.counter.encoding(),
    ));
    cx.memo.value(key, || {
        let mut keep: HashSet<&str> = compact.keep_fields.iter().map(String::as_str).collect();
        keep.extend(extra.into_iter().flatten().map(String::as_str));
        // What is under an envelope is compacted, not the envelope's one long string.
        match &*reads::read(text, cx.memo) {
            Read::Tree(value) => CutForm(
                compact_json_to_fit(value, &keep, max_tokens, cx.params, cx.counter).into(),
                Form::Json,
            ),
            Read::Text(inner) => CutForm(
                compact_text(
                    inner.as_deref().unwrap_or(text),
                    max_tokens,
                    MAX_OMITTED_IDS,
                    cx.counter,
                )
                .into(),
                Form::Text,
            ),
        }
    })
}

/// Seed of the memo keys of cut results.
const CUT_SEED: u64 = 0x6375_7472_6573_0001;

/// A cut result and what it was read as.
struct CutForm(SharedText, Form);

impl crate::bounded::Weigh for CutForm {
    fn heap_bytes(&self) -> usize {
        self.0.len()
    }
}

/// Seed of the memo keys of working-set forms.
const WORKING_SET_SEED: u64 = 0x776f_726b_7365_7401;

/// A result's working-set form, memoized: the budget stage reruns compaction, and a
/// conversation's later requests append the same results again.
struct WorkingSetForm(Option<(SharedText, Form)>);

impl crate::bounded::Weigh for WorkingSetForm {
    fn heap_bytes(&self) -> usize {
        self.0.as_ref().map_or(0, |(text, _)| text.len())
    }
}

fn lossless(
    text: &str,
    config: &PipelineConfig,
    counter: &TokenCounter,
    memo: &Memo,
) -> Option<(String, Form)> {
    let max_tokens = config.compact.tool_result_max_tokens;
    if counter.text(text) <= max_tokens {
        // Whole, less the MCP envelopes that say nothing but what they wrap.
        let Some(inner) = payload::bare(text) else {
            return minified(text).map(|json| (json, Form::Json));
        };
        return Some(match minified(&inner) {
            Some(json) => (json, Form::Json),
            None if super::identifiers::parse_json(&inner).is_some() => (inner, Form::Json),
            None => (inner, Form::Text),
        });
    }
    let (compacted, form) = match &*reads::read(text, memo) {
        Read::Tree(value) => {
            let rules = Rules::lossless(config.compact.max_string_chars);
            let compacted = tabulated(compact_value(value, &rules));
            let json = serde_json::to_string(&compacted).unwrap_or_default();
            (json, Form::Json)
        }
        Read::Text(inner) => (
            compact_text(
                inner.as_deref().unwrap_or(text),
                max_tokens,
                usize::MAX,
                counter,
            ),
            Form::Text,
        ),
    };
    (!compacted.is_empty() && compacted.len() < text.len()).then_some((compacted, form))
}

/// A JSON text without the whitespace between its tokens, when it has any: the same value,
/// every string and number byte for byte (numbers are not re-printed, so `481.50` stays).
fn minified(text: &str) -> Option<String> {
    let trimmed = text.trim_start();
    if !(trimmed.starts_with('{') || trimmed.starts_with('[')) {
        return None;
    }
    serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in text.chars() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
            out.push(c);
        } else if !c.is_ascii_whitespace() {
            out.push(c);
        }
    }
    (out.len() < text.len()).then_some(out)
}

/// A message as it is appended between recompactions: a tool result in its working-set form,
/// anything else as the client sent it.
pub(super) fn appended(
    message: &Message,
    config: &PipelineConfig,
    counter: &TokenCounter,
    memo: &Memo,
) -> Option<Message> {
    if !config.compact.enabled || !matches!(message.role, Role::Tool | Role::Function) {
        return None;
    }
    let result = ResultText::of(message)?;
    let (compacted, _) = working_set_result(&result, config, counter, memo)?;
    Some(with_text(message, compacted))
}

/// A tool result with only the whitespace between its JSON tokens taken out (byte for byte
/// otherwise), when it is text holding JSON: the one change that loses nothing, for a request
/// whose results have no way back (`seen.rs`). Content parts are left as they are.
pub(super) fn minified_result(message: &Message) -> Option<Message> {
    if !matches!(message.role, Role::Tool | Role::Function) {
        return None;
    }
    let Nullable::Value(Content::Text(text)) = &message.content else {
        return None;
    };
    Some(with_text(message, minified(text)?.into()))
}

/// A copy of `message` with `text` as its content, its old content not copied. Its role, name
/// and call id stay: the prefix stage's floor counts them for every result a rewrite sends.
fn with_text(message: &Message, text: SharedText) -> Message {
    Message {
        role: message.role.clone(),
        content: Nullable::Value(Content::Text(text)),
        name: message.name.clone(),
        tool_calls: message.tool_calls.clone(),
        tool_call_id: message.tool_call_id.clone(),
        extra: message.extra.clone(),
    }
}

/// The tool call that the result at `index` answers.
fn call_of(messages: &[Message], index: usize) -> Option<&ToolCall> {
    let id = messages[index].tool_call_id.get()?;
    messages[..index]
        .iter()
        .rev()
        .find_map(|m| m.tool_calls().iter().find(|c| c.id == id.as_str()))
}

/// The results old enough to clear that are cleared now: in order, as many as fit in the
/// largest multiple of `batch` tokens that they reach together. A new old result changes the
/// cleared set only once `batch` more tokens have gathered, so the prompt sent before stays the
/// same, byte for byte, between batches.
fn cleared_in_batches(
    messages: &[Message],
    old: &[usize],
    working_set: &WorkingSet,
    batch: usize,
    cx: &StageCx<'_>,
) -> HashSet<usize> {
    let eligible: Vec<(usize, usize)> = old
        .iter()
        .filter(|&&i| !working_set.contains(i))
        .map(|&i| {
            let text = messages[i]
                .content
                .get()
                .map(|c| c.text())
                .unwrap_or_default();
            (i, cx.counter.text_recurring(&text))
        })
        .collect();
    if batch == 0 {
        return eligible.into_iter().map(|(i, _)| i).collect();
    }
    let total: usize = eligible.iter().map(|(_, t)| t).sum();
    let allowed = total / batch * batch;
    let mut sum = 0;
    eligible
        .into_iter()
        .take_while(|(_, tokens)| {
            sum += tokens;
            sum <= allowed
        })
        .map(|(i, _)| i)
        .collect()
}

/// Seed of the memo keys of stubs.
const STUB_SEED: u64 = 0x7374_7562_0000_0001;

/// The user messages met so far, hashed one after the other: what a stub's task words come from.
#[derive(Default)]
struct AskedSoFar {
    read: usize,
    hash: u64,
}

impl AskedSoFar {
    /// The hash of the user messages in `before`, reading only those not read yet.
    fn hash(&mut self, before: &[Message]) -> u64 {
        for message in before.iter().skip(self.read) {
            if message.role == Role::User
                && let Some(content) = message.content.get()
            {
                self.hash = FixedState::with_seed(STUB_SEED).hash_one((self.hash, content.text()));
            }
        }
        self.read = self.read.max(before.len());
        self.hash
    }
}

/// Everything a stub depends on: the call, the result, the cap, what the user asked before it
/// and the encoding.
fn stub_key(
    call: Option<&ToolCall>,
    result: &ResultText<'_>,
    max_tokens: usize,
    asked: u64,
    cx: &StageCx<'_>,
) -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut hasher = foldhash::quality::FixedState::with_seed(STUB_SEED).build_hasher();
    cx.counter.encoding().hash(&mut hasher);
    max_tokens.hash(&mut hasher);
    asked.hash(&mut hasher);
    call.map(|c| (&c.function.name, &c.function.arguments))
        .hash(&mut hasher);
    result.digest.hash(&mut hasher);
    hasher.finish()
}

/// What a cleared result leaves behind: the call, and the identifiers the result held with
/// their labels, within `max_tokens`:
/// `[get_order_details(order_id: #W1) result cleared; it held: status: …, items: [item_id: 6117189161, price: 481.5]]`.
/// Where that is too long, listings of names keep first those the task's words say; then the
/// start is kept, cut between two values. A stub that left something out ends with ` …`.
/// (The stage makes the same from the memoized `stub_start`.)
#[cfg(test)]
fn stub(
    call: Option<&ToolCall>,
    text: &str,
    max_tokens: usize,
    task: &TaskWords<'_>,
    counter: &TokenCounter,
) -> String {
    match start_of_stub(call, text, &Arc::new(Read::of(text)), max_tokens, counter) {
        StubStart::Whole(stub) => stub,
        StubStart::TooLong { label, read, held } => {
            cut_stub(&label, read.tree(), &held, max_tokens, task, counter)
        }
    }
}

/// A stub as far as the task's words play no part.
enum StubStart {
    /// The whole stub, within `max_tokens`.
    Whole(String),
    /// Over `max_tokens`: the call's label, what the result held, and the result read (its
    /// tree, when it is one, is what the task's words cut).
    TooLong {
        label: String,
        read: Arc<Read>,
        held: String,
    },
}

impl crate::bounded::Weigh for StubStart {
    fn heap_bytes(&self) -> usize {
        match self {
            StubStart::Whole(stub) => stub.capacity(),
            // The result read too: it stays while this does, memoized on its own or not.
            StubStart::TooLong { label, read, held } => {
                label.capacity() + held.capacity() + read.heap_bytes()
            }
        }
    }
}

/// Seed of the memo keys of stub starts.
const STUB_START_SEED: u64 = 0x7374_7562_0000_0002;

/// `start_of_stub`, memoized by the call, the result and the cap.
fn stub_start(
    call: Option<&ToolCall>,
    result: &ResultText<'_>,
    max_tokens: usize,
    counter: &TokenCounter,
    memo: &Memo,
) -> Arc<StubStart> {
    let text: &str = &result.text;
    memo.value(stub_start_key(call, result, max_tokens, counter), || {
        start_of_stub(call, text, &reads::read(text, memo), max_tokens, counter)
    })
}

fn stub_start_key(
    call: Option<&ToolCall>,
    result: &ResultText<'_>,
    max_tokens: usize,
    counter: &TokenCounter,
) -> u64 {
    FixedState::with_seed(STUB_START_SEED).hash_one((
        call.map(|c| (&c.function.name, &c.function.arguments)),
        result.digest,
        max_tokens,
        counter.encoding(),
    ))
}

/// What every cut stub of a call's result starts with.
fn cut_stub_start(label: &str) -> String {
    format!("[{label} result cleared; it held:")
}

/// The stub within `max_tokens` of a result whose whole stub is over it: listings of names
/// keep first those the task's words say; then the start is kept, cut between two values.
fn cut_stub(
    label: &str,
    tree: Option<&Value>,
    held: &str,
    max_tokens: usize,
    task: &TaskWords<'_>,
    counter: &TokenCounter,
) -> String {
    let mut held = held.to_owned();
    if let Some(value) = tree {
        for cut in listing::cut_to_task(value, task) {
            held = render_labelled_once(&cut, &|_| false);
            let out = format!("{} {held} …]", cut_stub_start(label));
            if counter.fits(&out, max_tokens) {
                return out;
            }
        }
    }
    cut_to_fit(label, &held, max_tokens, counter)
}

fn start_of_stub(
    call: Option<&ToolCall>,
    text: &str,
    read: &Arc<Read>,
    max_tokens: usize,
    counter: &TokenCounter,
) -> StubStart {
    let label = call.map_or_else(
        || "Previous".to_owned(),
        |c| call_label(&c.function.name, &c.function.arguments),
    );
    let held = match &**read {
        Read::Tree(value) => render_labelled_once(value, &|_| false),
        Read::Text(inner) => {
            let mut seen = HashSet::new();
            identifiers(inner.as_deref().unwrap_or(text))
                .into_iter()
                .filter(|id| !id.contains("://") && seen.insert(id.clone()))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    if held.is_empty() {
        // No identifier: the first line with words or digits (pretty JSON starts with `{`).
        let said = match &**read {
            Read::Text(inner) => inner.as_deref().unwrap_or(text),
            Read::Tree(_) => text,
        };
        let first_line = said
            .lines()
            .map(str::trim)
            .find(|l| l.chars().any(char::is_alphanumeric))
            .unwrap_or("");
        return StubStart::Whole(format!(
            "[{label} result cleared: {}]",
            cut_at_whitespace(first_line, STUB_CHARS)
        ));
    }
    let out = format!("[{label} result cleared; it held: {held}]");
    if counter.fits(&out, max_tokens) {
        return StubStart::Whole(out);
    }
    StubStart::TooLong {
        label,
        read: Arc::clone(read),
        held,
    }
}

/// The stub with `held` cut between two values, keeping the start (bytes per token from the
/// whole).
fn cut_to_fit(label: &str, held: &str, max_tokens: usize, counter: &TokenCounter) -> String {
    let mut out = format!("[{label} result cleared; it held: {held}]");
    let ratio = out.len() as f64 / counter.text(&out).max(1) as f64;
    let mut limit = (max_tokens as f64 * ratio) as usize;
    loop {
        let cut = held
            .char_indices()
            .rev()
            .filter(|&(i, c)| i <= limit && matches!(c, ',' | ';'))
            .map(|(i, _)| i)
            .next()
            .unwrap_or(0);
        out = format!("{} {} …]", cut_stub_start(label), &held[..cut]);
        if cut == 0 || counter.fits(&out, max_tokens) {
            return out;
        }
        limit = cut * 9 / 10;
    }
}

/// A stub that ends naming the handle of its original: `[…; recall rc-…]`.
fn with_handle(stub: &str, handle: &str) -> String {
    let open = stub.strip_suffix(']').unwrap_or(stub);
    format!("{open}; recall {handle}]")
}

/// At most `max_chars` characters, cut at whitespace, with ` …` when cut.
fn cut_at_whitespace(text: &str, max_chars: usize) -> String {
    if text.len() <= max_chars || text.chars().count() <= max_chars {
        return text.to_owned();
    }
    let limit = text
        .char_indices()
        .nth(max_chars)
        .map_or(text.len(), |(i, _)| i);
    let cut = text[..limit].rfind(char::is_whitespace).unwrap_or(0);
    format!("{} …", text[..cut].trim_end())
}

/// How JSON is compacted.
struct Rules<'a> {
    /// Fields kept whole from an object that has any of them (the others keep only their
    /// identifiers); `None` keeps every field.
    keep: Option<&'a HashSet<&'a str>>,
    max_string_chars: usize,
    /// Items kept of a list; the identifiers of the others are listed, bounded.
    list_cap: usize,
    /// A shortened prose string lists the identifiers and numbers of what was cut.
    keep_cut_identifiers: bool,
}

impl Rules<'_> {
    /// For the working set: every field stays; only nulls, empties and long prose go, and cut
    /// prose lists the identifiers and numbers it held.
    fn lossless(max_string_chars: usize) -> Rules<'static> {
        Rules {
            keep: None,
            max_string_chars,
            list_cap: usize::MAX,
            keep_cut_identifiers: true,
        }
    }
}

/// Compacts JSON, then cuts lists shorter until the result fits `max_tokens`.
fn compact_json_to_fit(
    value: &Value,
    keep: &HashSet<&str>,
    max_tokens: usize,
    params: &Params,
    counter: &TokenCounter,
) -> String {
    let mut rules = Rules {
        keep: Some(keep),
        max_string_chars: params.max_string_chars,
        list_cap: usize::MAX,
        keep_cut_identifiers: false,
    };
    loop {
        let compacted = compact_value(value, &rules);
        let longest = longest_list(&compacted);
        let text = serde_json::to_string(&tabulated(compacted)).unwrap_or_default();
        if longest <= 1 || rules.list_cap == 1 || counter.fits(&text, max_tokens) {
            return text;
        }
        rules.list_cap = (longest.min(rules.list_cap) / 2).max(1);
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

fn compact_value(value: &Value, rules: &Rules<'_>) -> Value {
    compact_inner(value, rules, false)
}

/// `ids_only`: inside a field an identifying object does not keep, only identifiers stay.
fn compact_inner(value: &Value, rules: &Rules<'_>, ids_only: bool) -> Value {
    match value {
        Value::Object(map) => {
            let keep = rules.keep;
            let has_identifying =
                keep.is_some_and(|keep| map.keys().any(|k| keep.contains(k.as_str())));
            let mut out = Map::with_capacity(map.len());
            for (key, field) in map {
                if is_empty(field) {
                    continue;
                }
                if keep.is_some()
                    && let Some(login) = identity_of(field)
                {
                    out.insert(key.clone(), login.clone());
                    continue;
                }
                let dropped = has_identifying && keep.is_some_and(|k| !k.contains(key.as_str()));
                let compacted = compact_inner(field, rules, ids_only || dropped);
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
                .take(rules.list_cap)
                .map(|item| compact_inner(item, rules, ids_only))
                .filter(|item| !(ids_only && is_empty(item)))
                .collect();
            if total > rules.list_cap {
                let mut distinct = Distinct::new(MAX_OMITTED_IDS);
                let mut ids = Vec::new();
                for item in &items[rules.list_cap..] {
                    if distinct.is_full() {
                        break;
                    }
                    json_identifiers(item, &mut ids);
                    ids.drain(..).for_each(|id| distinct.offer(id));
                }
                let omitted = distinct.kept;
                let mut marker = format!("(showing {} of {total}", rules.list_cap);
                if !omitted.is_empty() {
                    marker.push_str(&format!(
                        "; identifiers in the others: {}",
                        omitted.join(" ")
                    ));
                }
                marker.push(')');
                out.push(Value::String(marker));
            }
            Value::Array(out)
        }
        scalar if ids_only => scalar_identifier(scalar).map_or(Value::Null, |_| scalar.clone()),
        Value::String(s)
            if s.len() > rules.max_string_chars
                && s.chars().count() > rules.max_string_chars
                && s.contains(char::is_whitespace) =>
        {
            let mut cut = cut_at_whitespace(s, rules.max_string_chars);
            if rules.keep_cut_identifiers {
                // The identifiers and numbers of the cut prose stay.
                let kept = cut.trim_end_matches(" …").len();
                let rest = identifiers(&s[kept.min(s.len())..]);
                if !rest.is_empty() {
                    cut.push_str(&format!(" (also: {})", rest.join(", ")));
                }
            }
            Value::String(cut)
        }
        other => other.clone(),
    }
}

/// Head and tail of a text at line boundaries, within `max_tokens`, with (at most `max_ids`)
/// identifiers of the omitted middle listed.
fn compact_text(text: &str, max_tokens: usize, max_ids: usize, counter: &TokenCounter) -> String {
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() < 3 {
        // One huge line: keep its start, cut at whitespace (about 4 characters a token).
        let mut cut = cut_at_whitespace(text, max_tokens * 3);
        if max_ids == usize::MAX {
            let kept = cut.trim_end_matches(" …").len();
            let rest = identifiers(&text[kept.min(text.len())..]);
            if !rest.is_empty() {
                cut.push_str(&format!(" (also: {})", rest.join(", ")));
            }
        }
        return cut;
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
    let ids = if max_ids == usize::MAX {
        let mut seen = HashSet::new();
        identifiers(&middle.join("\n"))
            .into_iter()
            .filter(|id| seen.insert(id.clone()))
            .collect()
    } else {
        distinct_identifiers(&middle.join("\n"), max_ids)
    };
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
fn distinct_identifiers(text: &str, max: usize) -> Vec<String> {
    distinct(identifiers(text), max)
}

/// At most `max` of `ids`, two of each shape, first seen first.
fn distinct(ids: Vec<String>, max: usize) -> Vec<String> {
    let mut distinct = Distinct::new(max);
    for id in ids {
        if distinct.is_full() {
            break;
        }
        distinct.offer(id);
    }
    distinct.kept
}

/// Identifiers offered one by one, kept as `distinct` keeps them: a caller that reads them from
/// a large value stops once it is full.
struct Distinct {
    max: usize,
    seen: HashSet<String>,
    shapes: HashMap<String, usize>,
    kept: Vec<String>,
}

impl Distinct {
    fn new(max: usize) -> Distinct {
        Distinct {
            max,
            seen: HashSet::new(),
            shapes: HashMap::new(),
            kept: Vec::new(),
        }
    }

    fn is_full(&self) -> bool {
        self.kept.len() >= self.max
    }

    fn offer(&mut self, id: String) {
        if self.is_full() || !self.seen.insert(id.clone()) {
            return;
        }
        let shape: String = id
            .chars()
            .map(|c| if c.is_ascii_digit() { '#' } else { c })
            .collect();
        let count = self.shapes.entry(shape).or_insert(0);
        *count += 1;
        if *count <= 2 {
            self.kept.push(id);
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod working_set_tests;
