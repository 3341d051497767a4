//! The ledger: what the summarized turns held that an agent may reuse, word for word
//! (ARCHITECTURE.md, principle 8). Identifiers are grouped by where they came from, a tool
//! call and its result, a user message or an assistant message, with their labels:
//! `get_order_details(order_id: #W1) → status: pending, items: [item_id: 6117189161, price: 481.5]`.
//!
//! `lines` renders the messages it is given (one summarized turn's, or all of them when the
//! section folds: `section.rs`, which keeps earlier lines byte for byte). A value the caller
//! says is shown (by the instructions or by earlier lines) is not repeated, and within one call
//! a value is said once, on the line mentioned latest. What an assistant's code blocks name
//! (variables, ports, image tags, paths) counts like its prose; its acronyms (`API`, `SQL`)
//! are terms, not references, and stay out. Within
//! `ledger_max_tokens`, the groups whose values were mentioned latest (being referred to again
//! counts as recent) go first: their strong identifiers, then everything where it fits.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use foldhash::quality::FixedState;
use serde_json::Value;

use crate::openai::{Content, Message, Role, SharedText};
use crate::pipeline::identifiers::{
    call_label, is_strong_identifier, json_identifiers, prose_identifiers, prune,
    render_labelled_once,
};
use crate::pipeline::memo::Memo;
use crate::pipeline::reads::{self, Read};
use crate::tokens::TokenCounter;

/// One source of identifiers.
struct Group<'a> {
    /// Position of its message in the conversation (for order and recency).
    position: usize,
    /// Its line, with every identifier (`false`) or only the strong ones (codes, ids, emails:
    /// `true`), leaving out the values the second argument says another line shows; empty when
    /// it has nothing to say. Rendered only when the selection needs it.
    render: Box<Render<'a>>,
    /// The identifiers it holds, by their numbers in `Mentions` (see `values`).
    values: [&'a [u32]; 2],
    /// An assistant's message: its acronyms are terms, not values (`is_acronym`).
    without_acronyms: bool,
    /// A user or assistant message, rather than a tool call or result.
    prose: bool,
    /// A hash of what it is rendered from (for the memo of its lines).
    key: u64,
    /// The last position at which one of its values is mentioned.
    last_mention: usize,
}

impl Group<'_> {
    /// The group with its `last_mention`, from `mentions`.
    fn mentioned(mut self, mentions: &Mentions<'_>) -> Self {
        self.last_mention = self
            .values(mentions)
            .map(|n| mentions.last[n as usize])
            .max()
            .unwrap_or(self.position)
            .max(self.position);
        self
    }

    /// The numbers of the identifiers it holds.
    fn values<'m>(&'m self, mentions: &'m Mentions<'_>) -> impl Iterator<Item = u32> + 'm {
        let without_acronyms = self.without_acronyms;
        self.values
            .iter()
            .flat_map(|v| v.iter())
            .copied()
            .filter(move |&n| !(without_acronyms && is_acronym(mentions.values[n as usize])))
    }
}

/// Which line says a value (`select`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// No line has it yet.
    Nobody,
    /// A tool call's or result's line (which keeps its result whole).
    Tool,
    /// The message line first in the selection's order that has it.
    Message(usize),
}

/// Renders a line: `(strong only, shown on another line) -> text`.
type Render<'a> = dyn Fn(bool, &dyn Fn(&str) -> bool) -> String + 'a;

/// Values the rewritten request still shows.
pub type Shown<'a> = HashSet<&'a str, foldhash::fast::RandomState>;

/// A set of values already shown, however it holds them.
pub trait IsShown {
    fn is_shown(&self, value: &str) -> bool;
}

impl IsShown for Shown<'_> {
    fn is_shown(&self, value: &str) -> bool {
        self.contains(value)
    }
}

impl IsShown for HashSet<String, foldhash::fast::RandomState> {
    fn is_shown(&self, value: &str) -> bool {
        self.contains(value)
    }
}
/// A message's identifiers as the ledger reads them: its content's, then each tool call's
/// arguments', in that order (`Views::message_ids`).
#[derive(Debug, Default)]
pub struct MessageIds {
    pub all: Vec<String>,
    /// How many of `all` are the content's, then each tool call's.
    content: usize,
    calls: Vec<usize>,
}

impl crate::bounded::Weigh for MessageIds {
    fn heap_bytes(&self) -> usize {
        self.all.heap_bytes() + self.calls.capacity() * std::mem::size_of::<usize>()
    }
}

/// The identifiers of the messages a ledger reads, each value numbered once, with the last
/// position that mentions it: the ledger's maps over values are arrays indexed by number.
pub struct Mentions<'a> {
    numbers: HashMap<&'a str, u32, foldhash::fast::RandomState>,
    /// Each number's value, and the last position that mentions it.
    values: Vec<&'a str>,
    last: Vec<usize>,
    /// The numbers of each message's identifiers (in `MessageIds` order), one message after
    /// another, and where each message's start.
    numbered: Vec<u32>,
    starts: Vec<usize>,
    ids: &'a [Arc<MessageIds>],
}

impl<'a> Mentions<'a> {
    /// The mentions of `removed` (messages with their positions), whose identifiers are `ids`.
    pub fn of(removed: &[(usize, &Message)], ids: &'a [Arc<MessageIds>]) -> Mentions<'a> {
        let total = ids.iter().map(|ids| ids.all.len()).sum();
        let mut mentions = Mentions {
            numbers: HashMap::with_capacity_and_hasher(total, Default::default()),
            values: Vec::new(),
            last: Vec::new(),
            numbered: Vec::with_capacity(total),
            starts: Vec::with_capacity(ids.len()),
            ids,
        };
        for ((position, _), message_ids) in removed.iter().zip(ids) {
            mentions.starts.push(mentions.numbered.len());
            for id in &message_ids.all {
                let number = mentions.number(id);
                mentions.last[number as usize] = *position;
                mentions.numbered.push(number);
            }
        }
        mentions
    }

    fn number(&mut self, value: &'a str) -> u32 {
        let next = self.values.len() as u32;
        let number = *self.numbers.entry(value).or_insert(next);
        if number == next {
            self.values.push(value);
            self.last.push(0);
        }
        number
    }

    /// Every value mentioned, once each.
    pub fn values(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.values.iter().copied()
    }

    /// The numbers of the content's identifiers of message `index` (of `removed`).
    fn content(&self, index: usize) -> &[u32] {
        let Some(ids) = self.ids.get(index) else {
            return &[];
        };
        self.slice(index, 0, ids.content)
    }

    /// The numbers of the identifiers of the arguments of message `index`'s tool call `call`.
    fn call(&self, index: usize, call: usize) -> &[u32] {
        let Some(ids) = self.ids.get(index) else {
            return &[];
        };
        let skip = ids.content + ids.calls.iter().take(call).sum::<usize>();
        self.slice(index, skip, ids.calls.get(call).copied().unwrap_or(0))
    }

    /// `len` numbers of message `index`, `skip` after its first; none where it holds fewer
    /// (only a memo key shared by two messages could make its identifiers disagree with the
    /// message: a line then misses values, and no request fails).
    fn slice(&self, index: usize, skip: usize, len: usize) -> &[u32] {
        let Some(&start) = self.starts.get(index) else {
            return &[];
        };
        let end = (self.starts.get(index + 1).copied()).unwrap_or(self.numbered.len());
        let (from, to) = (start + skip, start + skip + len);
        if to > end {
            return &[];
        }
        self.numbered.get(from..to).unwrap_or(&[])
    }

    /// The same, with `value` (one of them) mentioned again at `position`, later.
    #[cfg(test)]
    fn mentioned_at(mut self, value: &str, position: usize) -> Self {
        if let Some(&number) = self.numbers.get(value) {
            self.last[number as usize] = position;
        }
        self
    }
}

/// Fewer remaining tokens than this are not worth a cut group.
const MIN_PARTIAL_TOKENS: usize = 12;

fn content_of(message: &Message) -> std::borrow::Cow<'_, str> {
    message.content.get().map(|c| c.text()).unwrap_or_default()
}

/// The ledger lines of `removed` (messages of summarized turns, in order, with their positions
/// in the conversation), leaving out values in `shown`, within `max_tokens`. `mentions` holds
/// the identifiers of `removed` and the last position where the conversation mentions each.
pub fn lines(
    removed: &[(usize, &Message)],
    shown: &impl IsShown,
    mentions: &Mentions<'_>,
    max_tokens: usize,
    counter: &TokenCounter,
    memo: &Memo,
) -> Vec<String> {
    if max_tokens == 0 {
        return Vec::new();
    }
    let views = Views { memo };
    let views = &views;
    // What a line leaves out: values shown elsewhere, and weak ones in its strong version.
    let left_out = move |value: &str, strong: bool| {
        shown.is_shown(value) || (strong && !is_strong_identifier(value))
    };
    let skip = move |value: &str, strong: bool, elsewhere: &dyn Fn(&str) -> bool| {
        left_out(value, strong) || elsewhere(value)
    };
    // Tool messages already shown with the call they answer (by index into `removed`).
    let mut answered: HashSet<usize, foldhash::fast::RandomState> = HashSet::default();
    let mut groups: Vec<Group<'_>> = Vec::new();
    // `strong` renders only the strong identifiers; "" when there is nothing to say.
    let render = move |prefix: &'static str,
                       content: &str,
                       strong: bool,
                       elsewhere: &dyn Fn(&str) -> bool| {
        let found = views.render(content, &|v| skip(v, strong, elsewhere));
        if found.is_empty() {
            found
        } else {
            format!("{prefix}: {found}")
        }
    };
    for (index, &(position, message)) in removed.iter().enumerate() {
        match message.role {
            Role::Tool | Role::Function => {
                if answered.contains(&index) {
                    continue;
                }
                let content = content_of(message);
                groups.push(
                    Group {
                        position,
                        last_mention: position,
                        values: [mentions.content(index), &[]],
                        without_acronyms: false,
                        prose: false,
                        key: line_key(("tool result", content_digest(message))),
                        render: Box::new(move |strong, elsewhere| {
                            render("tool result", &content, strong, elsewhere)
                        }),
                    }
                    .mentioned(mentions),
                );
            }
            Role::System | Role::Developer | Role::Other(_) => {}
            Role::User | Role::Assistant => {
                // An assistant's code counts like its prose: users come back to the variables,
                // ports, image tags and paths of an earlier answer.
                let content = content_of(message);
                if !content.trim().is_empty() {
                    let role = if message.role == Role::User {
                        "user"
                    } else {
                        "assistant"
                    };
                    let assistant = message.role == Role::Assistant;
                    groups.push(
                        Group {
                            position,
                            last_mention: position,
                            values: [mentions.content(index), &[]],
                            without_acronyms: assistant,
                            prose: true,
                            key: line_key((role, content_digest(message))),
                            render: Box::new(move |strong, elsewhere| {
                                let elsewhere =
                                    |v: &str| elsewhere(v) || (assistant && is_acronym(v));
                                render(role, &content, strong, &elsewhere)
                            }),
                        }
                        .mentioned(mentions),
                    );
                }
                // A call's result is among the tool messages right after it (ids may repeat
                // across turns).
                let block = removed[index + 1..]
                    .iter()
                    .take_while(|(_, m)| matches!(m.role, Role::Tool | Role::Function))
                    .count();
                for (number, call) in message.tool_calls().iter().enumerate() {
                    let result = (index + 1..index + 1 + block).find(|&k| {
                        !answered.contains(&k)
                            && removed[k].1.tool_call_id.get().map(|id| id.as_str())
                                == Some(call.id.as_str())
                    });
                    if let Some(k) = result {
                        answered.insert(k);
                    }
                    let result_text = result.map(|k| content_of(removed[k].1)).unwrap_or_default();
                    let result_values = result.map_or(&[][..], |k| mentions.content(k));
                    let key = line_key((
                        "call",
                        &call.function.name,
                        &call.function.arguments,
                        result.map(|k| content_digest(removed[k].1)),
                    ));
                    groups.push(
                        Group {
                            position,
                            last_mention: position,
                            values: [mentions.call(index, number), result_values],
                            without_acronyms: false,
                            prose: false,
                            key,
                            render: Box::new(move |strong, elsewhere| {
                                let label =
                                    call_label(&call.function.name, &call.function.arguments);
                                let found =
                                    views.render(&result_text, &|v| skip(v, strong, elsewhere));
                                if found.is_empty() {
                                    label
                                } else {
                                    format!("{label} → {found}")
                                }
                            }),
                        }
                        .mentioned(mentions),
                    );
                }
            }
        }
    }
    select(groups, mentions, &left_out, max_tokens, counter, memo)
}

/// A digest of a message's content (the text's own, taken when it was read).
fn content_digest(message: &Message) -> u64 {
    match message.content.get() {
        Some(Content::Text(text)) => text.digest(),
        Some(parts) => SharedText::digest_of(&parts.text()),
        None => 0,
    }
}

/// An all-capitals word (`API`, `SQL`): in an assistant's prose, a term rather than a code.
fn is_acronym(value: &str) -> bool {
    value.chars().all(|c| c.is_ascii_uppercase())
}

/// Memoized views of a content text (a summarized conversation is read again at every turn).
pub struct Views<'a> {
    memo: &'a Memo,
}

/// Seed of the memo keys of ledger lines.
const LINE_SEED: u64 = 0x6c69_6e65_0000_0001;

/// A hash of what a line is rendered from.
fn line_key(parts: impl Hash) -> u64 {
    FixedState::with_seed(LINE_SEED).hash_one(parts)
}

/// Seeds of the memo keys of a text's identifiers and of its JSON skeleton.
const TEXT_IDS_SEED: u64 = 0x7465_7874_6964_0001;
const SKELETON_SEED: u64 = 0x736b_656c_6574_0001;

fn text_key(seed: u64, text: &str) -> u64 {
    FixedState::with_seed(seed).hash_one(text)
}

impl Views<'_> {
    pub fn new(memo: &Memo) -> Views<'_> {
        Views { memo }
    }

    /// The identifiers of a text (see `identifiers::text_identifiers`), from its skeleton when
    /// it is JSON, so that a text is parsed once.
    pub fn ids(&self, text: &str) -> Arc<[String]> {
        self.memo.identifiers(text_key(TEXT_IDS_SEED, text), || {
            match self.skeleton(text) {
                Some(tree) => {
                    let mut out = Vec::new();
                    json_identifiers(&tree, &mut out);
                    out
                }
                None => match &*reads::read(text, self.memo) {
                    Read::Text(inner) => prose_identifiers(inner.as_deref().unwrap_or(text)),
                    Read::Tree(_) => Vec::new(),
                },
            }
        })
    }

    /// Every identifier a message shows: its content's and its tool calls' arguments.
    pub fn message_ids(&self, message: &Message) -> MessageIds {
        let mut all = self.ids(&content_of(message)).to_vec();
        let content = all.len();
        let mut calls = Vec::with_capacity(message.tool_calls().len());
        for call in message.tool_calls() {
            let arguments = self.ids(&call.function.arguments);
            calls.push(arguments.len());
            all.extend(arguments.iter().cloned());
        }
        MessageIds {
            all,
            content,
            calls,
        }
    }

    /// `Some(Null)` for a tree without identifiers, `None` for text that is not a tree (JSON or
    /// a Python literal, under any envelope: `payload`).
    fn skeleton(&self, text: &str) -> Option<Arc<Value>> {
        self.memo.skeleton(text_key(SKELETON_SEED, text), || {
            let read = reads::read(text, self.memo);
            read.tree().map(|value| prune(value).unwrap_or(Value::Null))
        })
    }

    /// A content's identifiers: labelled leaves of JSON, identifier tokens of text.
    fn render(&self, content: &str, skip: &dyn Fn(&str) -> bool) -> String {
        if content.trim().is_empty() {
            return String::new();
        }
        match self.skeleton(content) {
            Some(tree) if tree.is_null() => String::new(),
            Some(tree) => render_labelled_once(&tree, skip),
            None => {
                let mut seen = HashSet::new();
                self.ids(content)
                    .iter()
                    .filter(|id| !skip(id) && seen.insert(id.as_str()))
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        }
    }
}

/// The groups within `max_tokens`, in conversation order, most recently mentioned first (being
/// referred to again counts as recent): first the strong identifiers of as many groups as fit
/// (a group that does not fit whole is cut between two values), then, with what is left, every
/// identifier of the groups that fit whole.
fn select(
    groups: Vec<Group<'_>>,
    mentions: &Mentions<'_>,
    left_out: &dyn Fn(&str, bool) -> bool,
    max_tokens: usize,
    counter: &TokenCounter,
    memo: &Memo,
) -> Vec<String> {
    let mut order: Vec<usize> = (0..groups.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&groups[a], &groups[b]);
        b.last_mention
            .cmp(&a.last_mention)
            .then(b.position.cmp(&a.position))
    });
    // A tool call's line keeps its result whole (labels and rows hang together). A message's
    // line says what no tool line holds, once: the first message line in that order has it.
    let mut owner = vec![Owner::Nobody; mentions.values.len()];
    for group in groups.iter().filter(|g| !g.prose) {
        for number in group.values(mentions) {
            owner[number as usize] = Owner::Tool;
        }
    }
    for &index in order.iter().filter(|&&i| groups[i].prose) {
        for number in groups[index].values(mentions) {
            if owner[number as usize] == Owner::Nobody {
                owner[number as usize] = Owner::Message(index);
            }
        }
    }
    let owned_elsewhere = |number: usize, index: usize| {
        !matches!(owner[number], Owner::Nobody) && owner[number] != Owner::Message(index)
    };
    // "- " and the newline of each line.
    let tokens = |text: &str| counter.text_recurring(text) + 2;
    // A line and its tokens, memoized by what it depends on: its source and which of its values
    // it leaves out (the window moves one turn at a time; most lines stay the same).
    let render = |index: usize, strong: bool| -> Arc<(String, usize)> {
        let group = &groups[index];
        let elsewhere = |value: &str| {
            group.prose
                && mentions
                    .numbers
                    .get(value)
                    .is_some_and(|&n| owned_elsewhere(n as usize, index))
        };
        let mut hasher = FixedState::with_seed(LINE_SEED).build_hasher();
        (group.key, strong, counter.encoding()).hash(&mut hasher);
        for number in group.values(mentions) {
            let value = mentions.values[number as usize];
            (left_out(value, strong) || (group.prose && owned_elsewhere(number as usize, index)))
                .hash(&mut hasher);
        }
        memo.value(hasher.finish(), || {
            let text = (group.render)(strong, &elsewhere);
            let cost = tokens(&text);
            (text, cost)
        })
    };
    let mut left = max_tokens;
    let mut chosen: Vec<Option<(String, usize)>> = groups.iter().map(|_| None).collect();
    for &index in &order {
        if left < MIN_PARTIAL_TOKENS {
            break;
        }
        let line = render(index, true);
        let (strong, cost) = (&line.0, line.1);
        if strong.is_empty() {
            continue;
        }
        if cost <= left {
            left -= cost;
            chosen[index] = Some((strong.clone(), cost));
        } else {
            let cut = cut_to_tokens(strong, left - 2, counter);
            if !cut.is_empty() {
                let cost = tokens(&cut).min(left);
                left -= cost;
                chosen[index] = Some((cut, cost));
            }
        }
    }
    for &index in &order {
        if left < MIN_PARTIAL_TOKENS {
            break;
        }
        let spent = chosen[index].as_ref().map_or(0, |(_, cost)| *cost);
        let line = render(index, false);
        let (full, cost) = (&line.0, line.1);
        if full.is_empty()
            || chosen[index]
                .as_ref()
                .is_some_and(|(s, _)| s.len() >= full.len())
        {
            continue;
        }
        if cost <= left + spent {
            left = left + spent - cost;
            chosen[index] = Some((full.clone(), cost));
        }
    }
    chosen.into_iter().flatten().map(|(text, _)| text).collect()
}

/// The longest prefix of `text` ending between two values (`, ` or `; `) within `max_tokens`,
/// with ` …`.
fn cut_to_tokens(text: &str, max_tokens: usize, counter: &TokenCounter) -> String {
    let mut cuts: Vec<usize> = text.match_indices([',', ';']).map(|(i, _)| i).collect();
    cuts.reverse();
    // Bisection over the cut points: tokens grow with the prefix.
    let fits = |end: usize| counter.text(&text[..end]) + 2 <= max_tokens;
    let (mut low, mut high) = (0usize, cuts.len());
    // cuts[i] for i in low..high, longest first; find the first (longest) that fits.
    let mut best = None;
    while low < high {
        let middle = (low + high) / 2;
        if fits(cuts[middle]) {
            best = Some(cuts[middle]);
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    best.map(|end| format!("{} …", &text[..end]))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::Encoding;
    use serde_json::json;

    fn messages(value: serde_json::Value) -> Vec<Message> {
        serde_json::from_value(value).unwrap()
    }

    fn conversation() -> Vec<Message> {
        messages(json!([
            {"role": "user", "content": "I'm Daiki, zip 80298, order W9348897"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_order_details", "arguments": "{\"order_id\": \"#W9348897\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"order_id\": \"#W9348897\", \"status\": \"pending\", \"items\": [{\"item_id\": \"6117189161\", \"price\": 481.5, \"color\": \"silver\"}], \"payment_method_id\": \"credit_card_8853416\"}"},
            {"role": "assistant", "content": "Your order #W9348897 totals $481.50."}
        ]))
    }

    /// The ledger of `all`, leaving out `shown`, with `value` mentioned again at `position`
    /// when given, within `max_tokens`.
    fn lines_of(
        all: &[Message],
        shown: &impl IsShown,
        again: Option<(&str, usize)>,
        max_tokens: usize,
    ) -> Vec<String> {
        let removed: Vec<(usize, &Message)> = all.iter().enumerate().collect();
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let ids: Vec<Arc<MessageIds>> = removed
            .iter()
            .map(|(_, m)| Arc::new(Views::new(&memo).message_ids(m)))
            .collect();
        let mut mentions = Mentions::of(&removed, &ids);
        if let Some((value, position)) = again {
            mentions = mentions.mentioned_at(value, position);
        }
        lines(&removed, shown, &mentions, max_tokens, &counter, &memo)
    }

    /// The ledger of a whole conversation, nothing shown, no later mention, a roomy cap.
    fn ledger_of(all: &[Message]) -> Vec<String> {
        lines_of(all, &Shown::default(), None, 500)
    }

    #[test]
    fn identifiers_that_disagree_with_their_message_leave_values_out_and_fail_nothing() {
        // What a memo key shared by two messages would hand over: no identifiers, no calls.
        let all = conversation();
        let removed: Vec<(usize, &Message)> = all.iter().enumerate().collect();
        let ids: Vec<Arc<MessageIds>> = removed.iter().map(|_| Arc::default()).collect();
        let mentions = Mentions::of(&removed, &ids);
        assert!(mentions.call(1, 0).is_empty() && mentions.call(1, 5).is_empty());
        assert!(mentions.content(0).is_empty() && mentions.content(99).is_empty());
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let lines = lines(&removed, &Shown::default(), &mentions, 500, &counter, &memo);
        assert!(
            lines.iter().any(|l| l.starts_with("get_order_details(")),
            "{lines:?}"
        );
    }

    #[test]
    fn groups_keep_labels_and_values_word_for_word() {
        let all = conversation();
        assert_eq!(
            ledger_of(&all),
            vec![
                "user: 80298, W9348897",
                "get_order_details(order_id: #W9348897) → order_id: #W9348897, items: [item_id: 6117189161, price: 481.5], payment_method_id: credit_card_8853416",
                // The order id is on the tool line already.
                "assistant: $481.50",
            ]
        );
    }

    #[test]
    fn calls_pair_with_the_results_right_after_them_even_when_ids_repeat() {
        let all = messages(json!([
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function",
                "function": {"name": "get_order", "arguments": "{\"order_id\": \"#W1\"}"}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "{\"item_id\": \"6117189161\"}"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function",
                "function": {"name": "get_user", "arguments": "{\"user_id\": \"u_22\"}"}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "{\"card\": \"credit_card_88\"}"}
        ]));
        assert_eq!(
            ledger_of(&all),
            vec![
                "get_order(order_id: #W1) → item_id: 6117189161",
                "get_user(user_id: u_22) → card: credit_card_88",
            ]
        );
    }

    #[test]
    fn a_value_is_said_once_by_the_line_mentioned_latest() {
        let all = messages(json!([
            {"role": "user", "content": "Order W101 and order W202 please"},
            {"role": "assistant", "content": "W202 is delayed, W303 too."}
        ]));
        assert_eq!(
            ledger_of(&all),
            vec!["user: W101", "assistant: W202, W303"],
            "W202 belongs to the later line only"
        );
    }

    #[test]
    fn assistant_code_is_ledgered_and_acronyms_are_not() {
        let all = messages(json!([
            {"role": "user", "content": "Why does my PHP call to /api/v2 fail with 500?"},
            {"role": "assistant", "content": "The API returns 500 for order W77.\n```php\n$x = fetch('/api/v3', max_length=20);\n```\nCheck the SQL."}
        ]));
        assert_eq!(
            ledger_of(&all),
            vec![
                "user: /api/v2, PHP",
                "assistant: 500, W77, /api/v3, max_length, 20"
            ]
        );
    }

    #[test]
    fn shown_values_are_not_repeated_and_the_cap_keeps_the_latest_mentioned() {
        let all = conversation();
        let shown: Shown<'_> = ["#W9348897"].into_iter().collect();
        let lines_shown = lines_of(&all, &shown, None, 500);
        assert_eq!(
            lines_shown[1],
            "get_order_details(order_id: #W9348897) → items: [item_id: 6117189161, price: 481.5], payment_method_id: credit_card_8853416"
        );
        assert_eq!(lines_shown[2], "assistant: $481.50");
        // The user's zip is mentioned again later: it outranks the newer assistant line.
        let capped = lines_of(&all, &Shown::default(), Some(("80298", 9)), 14);
        assert_eq!(capped, vec!["user: 80298, W9348897"]);
    }
}
