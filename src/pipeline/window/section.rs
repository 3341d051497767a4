//! The `<conversation_summary>` section, grown by appending (ARCHITECTURE.md, principle 4): the
//! ledger one request's section holds is, byte for byte, the start of the next one's, so when
//! the window moves (a recompaction) the provider's cached prefix still runs through it and only
//! what is new is sent uncached.
//!
//! The ledger comes first, one block per summarized turn: the ledger lines (`ledger.rs`) of what
//! that turn held that the section does not show yet. A block is decided when its turn is first
//! summarized and never changes after: it depends on the turns up to its own only, never on where
//! the window starts or on the budget's steps. A turn's answer (its last assistant message, which
//! the next user message answers) opens the next turn's block instead: while it is the answered
//! message kept verbatim after the section it is not repeated, otherwise the same lines end the
//! ledger, where the next block will have them. The segment summary lines (`summary.rs`: the
//! latest `max_segments`, which the budget may cut) come last, where changing them costs only
//! themselves.
//!
//! The ledger stays bounded by folding. When a block would take it over `ledger_max_tokens` plus
//! half of it, it is rebuilt at that turn: the ledger of everything summarized so far chosen as a
//! whole within `ledger_max_tokens`, the most recently mentioned first, as it always was; the
//! next blocks append to that. A fold happens at the same turn for every request of the
//! conversation, so consecutive requests still agree.
//!
//! It must never read anything but the summarized turns and the settings.

use std::collections::HashSet;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use foldhash::quality::FixedState;

use super::ledger::{self, Mentions, MessageIds, Views};
use super::summary;
use super::turns::Turn;
use crate::bounded::Weigh;
use crate::openai::{Message, Role};
use crate::pipeline::stage::StageCx;
use crate::tokens::hash_message;

/// The ledger's first line: the same bytes in every request.
pub(in crate::pipeline) const LEDGER_HEADER: &str =
    "Identifiers from earlier turns, word for word:";
/// The summary lines' first line.
pub(in crate::pipeline) const LINES_HEADER: &str = "Earlier turns, oldest first:";

/// Seeds of the memo keys of ledger states and of each message's identifiers.
const STATE_SEED: u64 = 0x7365_6374_696f_6e01;
const IDENTIFIERS_SEED: u64 = 0x6964_656e_7469_0001;
/// Seed of the memo keys of the block of a ledger's last answer (`answer_block`).
const ANSWER_SEED: u64 = 0x7365_6374_696f_6e02;

/// What the window stage puts in the system message, and what its report says of it.
#[derive(Debug, Default)]
pub struct Section {
    /// `<conversation_summary>…</conversation_summary>`, or empty when there is nothing to say.
    pub text: String,
    /// Segment summary lines shown.
    pub segment_lines: usize,
    pub ledger_lines: usize,
    /// The bytes of `text` that the next request's section starts with too, unless the ledger
    /// folds: the ledger (the summary lines after it may change).
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "what the tests check the next section against")
    )]
    pub stable_len: usize,
    /// How many times the ledger was rebuilt so far (see the module doc).
    pub folds: usize,
}

/// The ledger as of a summarized turn: its text and what the next turn's block reads.
#[derive(Debug, Clone, Default)]
struct State {
    /// Its lines (the fold's, then the blocks appended since), each `- …\n`.
    text: String,
    /// Tokens of its lines.
    tokens: usize,
    lines: usize,
    /// The values it and the instructions show: a later block does not repeat them.
    shown: HashSet<String, foldhash::fast::RandomState>,
    folds: usize,
}

impl Weigh for State {
    fn heap_bytes(&self) -> usize {
        self.text.len() + self.shown.iter().map(|v| v.len() + 24).sum::<usize>()
    }
}

/// The section of the summarized turns `older`, after the leading instructions `head`.
/// `answered_kept`: the last summarized turn's answer (`tail`) is kept verbatim after it.
pub fn build(
    head: &[Message],
    older: &[Turn<'_>],
    answered_kept: bool,
    cx: &StageCx<'_>,
) -> Section {
    let (ledger, ledger_key) = ledger_state(head, older, cx);
    // The last turn's answer, unless it is kept: what the next turn's block will start with.
    let pending = match older.last() {
        Some(last) if !answered_kept => answer_block(ledger_key, &tail(last), &ledger.shown, cx)
            .lines
            .clone(),
        _ => Vec::new(),
    };
    let lines = summary::latest(older, cx.params.max_segments, cx);
    if ledger.text.is_empty() && pending.is_empty() && lines.is_empty() {
        return Section::default();
    }
    let mut text = String::with_capacity(ledger.text.len() + 64 * (lines.len() + 4));
    text.push_str("<conversation_summary>\n");
    if !ledger.text.is_empty() || !pending.is_empty() {
        text.push_str(LEDGER_HEADER);
        text.push('\n');
        text.push_str(&ledger.text);
    }
    let stable_len = text.len();
    for line in &pending {
        push_line(&mut text, line);
    }
    if !lines.is_empty() {
        text.push_str(LINES_HEADER);
        text.push('\n');
        for segment in &lines {
            text.push_str(&segment.line);
            text.push('\n');
        }
    }
    text.push_str("</conversation_summary>");
    Section {
        text,
        segment_lines: lines.len(),
        ledger_lines: ledger.lines + pending.len(),
        stable_len,
        folds: ledger.folds,
    }
}

/// The ledger after the turns `older`, and its memo key: each turn's state is made once, from
/// the one before it.
fn ledger_state(head: &[Message], older: &[Turn<'_>], cx: &StageCx<'_>) -> (Arc<State>, u64) {
    let mut hasher = FixedState::with_seed(STATE_SEED).build_hasher();
    cx.counter.encoding().hash(&mut hasher);
    cx.config.window.ledger_max_tokens.hash(&mut hasher);
    for message in head {
        hash_message(message, &mut hasher);
    }
    let mut state = cx.memo.value(hasher.finish(), || {
        let mut initial = State::default();
        for message in head.iter().filter(|m| is_instruction(m)) {
            initial
                .shown
                .extend(message_ids(message, cx).all.iter().cloned());
        }
        initial
    });
    for (index, turn) in older.iter().enumerate() {
        let previous_key = hasher.finish();
        for message in turn.messages {
            hash_message(message, &mut hasher);
        }
        let previous = Arc::clone(&state);
        state = cx.memo.value(hasher.finish(), || {
            step(&previous, previous_key, head, &older[..=index], cx)
        });
    }
    (state, hasher.finish())
}

/// The ledger after the last turn of `older`, from the one before it (kept under
/// `previous_key`): a block appended (the answer of the turn before, then what the turn held but
/// its own answer), or the ledger folded when the block does not fit.
fn step(
    previous: &State,
    previous_key: u64,
    head: &[Message],
    older: &[Turn<'_>],
    cx: &StageCx<'_>,
) -> State {
    let Some((turn, before)) = older.split_last() else {
        return previous.clone();
    };
    let cap = cx.config.window.ledger_max_tokens;
    let mut next = previous.clone();
    // Instructions inside a summarized turn stay verbatim before the window.
    for message in turn.instructions() {
        next.shown
            .extend(message_ids(message, cx).all.iter().cloned());
    }
    // The same lines the section showed after the turn before, when its answer was not kept
    // (the block it made then, where the turn adds no instructions).
    let answer = before.last().map(tail).unwrap_or_default();
    let answer_block = if turn.instructions().next().is_none() {
        answer_block(previous_key, &answer, &next.shown, cx)
    } else {
        Arc::new(block(&answer, &next.shown, cap, cx))
    };
    let tokens_before = next.tokens;
    let mut after_answer = next;
    let answer_tokens = answer_block.tokens;
    append(&mut after_answer, &answer_block);
    let body_block = block(&body(turn), &after_answer.shown, cap, cx);
    if tokens_before + answer_tokens + body_block.tokens > fold_at(cx) {
        let mut folded = fold(head, older, cx);
        folded.folds = previous.folds + 1;
        return folded;
    }
    append(&mut after_answer, &body_block);
    after_answer
}

/// The ledger rebuilt at the last turn of `older`: all of it but the last turn's answer, chosen
/// as a whole within the cap.
fn fold(head: &[Message], older: &[Turn<'_>], cx: &StageCx<'_>) -> State {
    let mut state = State::default();
    for message in head
        .iter()
        .chain(older.iter().flat_map(|t| t.instructions()))
        .filter(|m| is_instruction(m))
    {
        state
            .shown
            .extend(message_ids(message, cx).all.iter().cloned());
    }
    let Some((last, before)) = older.split_last() else {
        return state;
    };
    let mut removed = removed_of(before);
    removed.extend(body(last));
    let cap = cx.config.window.ledger_max_tokens;
    let block = block(&removed, &state.shown, cap, cx);
    append(&mut state, &block);
    state
}

/// A turn's answer: its last assistant message and the tool results after it (what the next
/// turn's user message answers: the working set's `answered`).
fn tail<'a>(turn: &Turn<'a>) -> Vec<(usize, &'a Message)> {
    removed_of(std::slice::from_ref(turn))
        .into_iter()
        .skip(answer_start(turn))
        .collect()
}

/// A turn's messages but its answer.
fn body<'a>(turn: &Turn<'a>) -> Vec<(usize, &'a Message)> {
    removed_of(std::slice::from_ref(turn))
        .into_iter()
        .take(answer_start(turn))
        .collect()
}

/// The index, among a turn's non-instruction messages, where its answer starts (their count
/// when it has none).
fn answer_start(turn: &Turn<'_>) -> usize {
    let messages: Vec<&Message> = turn
        .messages
        .iter()
        .filter(|m| !is_instruction(m))
        .collect();
    match messages.iter().rposition(|m| m.role == Role::Assistant) {
        Some(start)
            if messages[start + 1..]
                .iter()
                .all(|m| matches!(m.role, Role::Tool | Role::Function)) =>
        {
            start
        }
        _ => messages.len(),
    }
}

/// The identifiers of each message of `removed`.
fn removed_ids(removed: &[(usize, &Message)], cx: &StageCx<'_>) -> Vec<Arc<MessageIds>> {
    removed.iter().map(|(_, m)| message_ids(m, cx)).collect()
}

/// A block of ledger lines, their tokens, and the values they show that were not shown.
#[derive(Debug, Default)]
struct Block {
    lines: Vec<String>,
    tokens: usize,
    found: Vec<String>,
}

impl Weigh for Block {
    fn heap_bytes(&self) -> usize {
        (self.lines.iter().chain(&self.found))
            .map(|s| s.len() + 24)
            .sum()
    }
}

/// The block of `removed` given what the ledger so far shows: its lines (`ledger_lines`), and
/// the identifiers of `removed` that they show whole.
fn block(
    removed: &[(usize, &Message)],
    shown: &HashSet<String, foldhash::fast::RandomState>,
    max_tokens: usize,
    cx: &StageCx<'_>,
) -> Block {
    if max_tokens == 0 || removed.is_empty() {
        return Block::default();
    }
    let ids = removed_ids(removed, cx);
    let mentions = Mentions::of(removed, &ids);
    let lines = ledger::lines(removed, shown, &mentions, max_tokens, cx.counter, cx.memo);
    if lines.is_empty() {
        return Block::default();
    }
    let mut text = String::new();
    for line in &lines {
        push_line(&mut text, line);
    }
    let added = Shows::new(&text);
    let found = mentions
        .values()
        .filter(|value| !shown.contains(*value) && added.shows(value))
        .map(str::to_owned)
        .collect();
    Block {
        tokens: lines_tokens(&lines, cx),
        lines,
        found,
    }
}

/// The block of a turn's answer given the ledger kept under `ledger_key`, which shows `shown`:
/// made once, by the request whose section ends with it, and read again by the next one, whose
/// ledger appends it.
fn answer_block(
    ledger_key: u64,
    answer: &[(usize, &Message)],
    shown: &HashSet<String, foldhash::fast::RandomState>,
    cx: &StageCx<'_>,
) -> Arc<Block> {
    let key = FixedState::with_seed(ANSWER_SEED).hash_one(ledger_key);
    cx.memo.value(key, || {
        block(answer, shown, cx.config.window.ledger_max_tokens, cx)
    })
}

/// Appends a block's lines to a state, and the values they show to what it shows.
fn append(state: &mut State, block: &Block) {
    for line in &block.lines {
        push_line(&mut state.text, line);
    }
    state.shown.extend(block.found.iter().cloned());
    state.tokens += block.tokens;
    state.lines += block.lines.len();
}

fn push_line(text: &mut String, line: &str) {
    text.push_str("- ");
    text.push_str(line);
    text.push('\n');
}

/// The ledger's size at which it folds: the cap and half of it again, room for the blocks
/// appended after a fold.
fn fold_at(cx: &StageCx<'_>) -> usize {
    let cap = cx.config.window.ledger_max_tokens;
    cap + cap / 2
}

/// The tokens of ledger lines as the section holds them (`- ` and the newline).
fn lines_tokens(lines: &[String], cx: &StageCx<'_>) -> usize {
    lines
        .iter()
        .map(|line| cx.counter.text_recurring(line) + 2)
        .sum()
}

fn is_instruction(message: &Message) -> bool {
    matches!(message.role, Role::System | Role::Developer)
}

/// The messages of `turns` the ledger reads (all but instructions), with their positions.
fn removed_of<'a>(turns: &[Turn<'a>]) -> Vec<(usize, &'a Message)> {
    turns
        .iter()
        .flat_map(|t| {
            t.messages
                .iter()
                .enumerate()
                .map(move |(i, m)| (t.start + i, m))
        })
        .filter(|(_, m)| !is_instruction(m))
        .collect()
}

/// Every identifier a message shows, memoized by its content.
fn message_ids(message: &Message, cx: &StageCx<'_>) -> Arc<MessageIds> {
    let mut hasher = FixedState::with_seed(IDENTIFIERS_SEED).build_hasher();
    hash_message(message, &mut hasher);
    cx.memo
        .value(hasher.finish(), || Views::new(cx.memo).message_ids(message))
}

/// A text and its words (the longest runs of letters, digits and `_`): whether it shows a value
/// whole, not inside a longer word or number. A value that is one word is shown exactly when it
/// is one of the words; any other is searched for.
struct Shows<'a> {
    text: &'a str,
    words: ledger::Shown<'a>,
}

impl<'a> Shows<'a> {
    fn new(text: &'a str) -> Shows<'a> {
        let words = text
            .split(|c: char| !is_word_char(c))
            .filter(|w| !w.is_empty())
            .collect();
        Shows { text, words }
    }

    fn shows(&self, value: &str) -> bool {
        // Each word of a value shown whole is a word of the text: only a value whose words all
        // are is searched for.
        if value.is_empty() {
            return false;
        }
        let mut words = value.split(|c: char| !is_word_char(c)).peekable();
        let one_word = words.peek().is_some_and(|w| w.len() == value.len());
        if !words
            .filter(|w| !w.is_empty())
            .all(|w| self.words.contains(w))
        {
            return false;
        }
        one_word || shows(self.text, value)
    }
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Whether `text` shows `value` whole: not inside a longer word or number.
fn shows(text: &str, value: &str) -> bool {
    if value.is_empty() {
        return false;
    }
    let part_of_word = |c: Option<char>| c.is_some_and(is_word_char);
    memchr::memmem::find_iter(text.as_bytes(), value.as_bytes()).any(|at| {
        !part_of_word(text[..at].chars().next_back())
            && !part_of_word(text[at + value.len()..].chars().next())
    })
}

#[cfg(test)]
#[path = "section_tests.rs"]
mod tests;
