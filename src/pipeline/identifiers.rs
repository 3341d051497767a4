//! What a rewrite must never lose (ARCHITECTURE.md, principle 8): the identifiers an agent reuses. An
//! identifier is an id or code (letters with digits, `#W…`, UUIDs, `credit_card_…`, flight
//! numbers), an amount or price, a date or time, an email, or a name. Values are copied word for
//! word with their label (`order_id: #W9348897`), never paraphrased.
//!
//! Pure functions over text and JSON; the compact stage's stubs and the window's ledger are
//! built from them.

use std::collections::HashSet;

use serde_json::Value;

use super::text;

/// Longest scalar treated as an identifier; longer strings are prose or blobs.
const MAX_IDENTIFIER_CHARS: usize = 80;
/// Longest multi-word value treated as one identifier ("113 Hickory Lane", "May 1, 2024").
const MAX_IDENTIFIER_WORDS: usize = 5;

/// Whether a scalar value (a JSON string or number, as text) is an identifier.
pub fn is_identifier_value(value: &str) -> bool {
    let value = value.trim();
    // A character is at most four bytes: a longer value has too many characters to be one.
    if value.len() > 4 * MAX_IDENTIFIER_CHARS {
        return false;
    }
    let ascii = value.is_ascii();
    let chars = if ascii {
        value.len()
    } else {
        value.chars().count()
    };
    if chars == 0 || chars > MAX_IDENTIFIER_CHARS || value.contains("://") {
        return false;
    }
    let tally = Tally::of(value, ascii);
    if tally.words > MAX_IDENTIFIER_WORDS {
        return false;
    }
    if tally.at && !tally.space {
        return true;
    }
    if tally.digits > 0 {
        // Codes and dates mix letters and digits; amounts, zips and times are digits.
        return (tally.letters > 0 && chars >= 3) || tally.digits >= 2 || value.contains('.');
    }
    if value.starts_with('#') && chars >= 3 {
        return true;
    }
    text::is_code_name(value) || is_name(value)
}

/// What the identifier rules read of a value, in one pass: bytes where it is ASCII (most values
/// are), characters where not.
#[derive(Default)]
struct Tally {
    words: usize,
    digits: usize,
    letters: usize,
    at: bool,
    space: bool,
}

impl Tally {
    fn of(value: &str, ascii: bool) -> Tally {
        let mut tally = Tally::default();
        if ascii {
            // One table read a byte, and no branch: most values are ASCII, and a large tool
            // result has thousands of them (paths, hashes, URLs), each read at every use.
            let mut after_white = true;
            for &b in value.as_bytes() {
                let class = BYTE_CLASSES[usize::from(b & 0x7f)];
                let white = class & WHITE != 0;
                tally.words += usize::from(after_white && !white);
                after_white = white;
                tally.space |= white;
                tally.digits += usize::from(class & DIGIT != 0);
                tally.letters += usize::from(class & LETTER != 0);
                tally.at |= class & AT != 0;
            }
        } else {
            let mut in_word = false;
            let mut add = |white: bool, digit: bool, letter: bool, at: bool| {
                if white {
                    tally.space = true;
                    in_word = false;
                } else if !in_word {
                    tally.words += 1;
                    in_word = true;
                }
                tally.digits += usize::from(digit);
                tally.letters += usize::from(letter);
                tally.at |= at;
            };
            for c in value.chars() {
                add(
                    c.is_whitespace(),
                    c.is_ascii_digit(),
                    c.is_alphabetic(),
                    c == '@',
                );
            }
        }
        tally
    }
}

// The classes of ASCII bytes the identifier rules count, bits of `BYTE_CLASSES`.
/// `char::is_whitespace` on ASCII: tab to carriage return (vertical tab too), space.
const WHITE: u8 = 1;
const DIGIT: u8 = 1 << 1;
const LETTER: u8 = 1 << 2;
const AT: u8 = 1 << 3;

/// Each ASCII byte's classes.
const BYTE_CLASSES: [u8; 128] = {
    let mut table = [0; 128];
    let mut b = 0;
    while b < 128 {
        let byte = b as u8;
        table[b] = if matches!(byte, b'\t'..=b'\r' | b' ') {
            WHITE
        } else if byte.is_ascii_digit() {
            DIGIT
        } else if byte.is_ascii_alphabetic() {
            LETTER
        } else if byte == b'@' {
            AT
        } else {
            0
        };
        b += 1;
    }
    table
};

/// A proper name: one to four capitalized words ("Action Camera", "Daiki", "USA").
fn is_name(value: &str) -> bool {
    let mut words = 0;
    for word in value.split_whitespace() {
        words += 1;
        let mut chars = word.chars();
        let capitalized = chars.next().is_some_and(char::is_uppercase)
            && chars.all(|c| c.is_alphabetic() || matches!(c, '-' | '\'' | '.'));
        if words > 4 || !capitalized {
            return false;
        }
    }
    words > 0 && value.chars().count() >= 2
}

/// An identifier that names one thing (a code, an id, an email), as opposed to an amount, a
/// time or a name: what a ledger keeps last when its cap bites.
pub fn is_strong_identifier(value: &str) -> bool {
    // One pass: a ledger asks this of every value of every line it weighs.
    let (mut chars, mut digits, mut letters, mut space, mut at) = (0, 0, 0, false, false);
    for c in value.chars() {
        chars += 1;
        digits += usize::from(c.is_ascii_digit());
        letters += usize::from(c.is_alphabetic());
        space |= c == ' ';
        at |= c == '@';
    }
    (digits > 0 && letters > 0 && chars >= 3 && !space)
        || (value.starts_with('#') && value.len() >= 3)
        || at
        || (digits >= 5 && digits == chars)
}

/// The text of a scalar JSON value, when it is an identifier.
pub fn scalar_identifier(value: &Value) -> Option<String> {
    scalar_text(value).map(std::borrow::Cow::into_owned)
}

/// `scalar_identifier`, borrowed where the value holds it.
fn scalar_text(value: &Value) -> Option<std::borrow::Cow<'_, str>> {
    match value {
        Value::String(s) => is_identifier_value(s).then_some(std::borrow::Cow::Borrowed(s)),
        Value::Number(n) => {
            let text = n.to_string();
            is_identifier_value(&text).then_some(std::borrow::Cow::Owned(text))
        }
        _ => None,
    }
}

/// Every identifier leaf of a JSON value, in document order, with repeats.
pub fn json_identifiers(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                if is_identifier_value(key) && key.chars().any(|c| c.is_ascii_digit()) {
                    out.push(key.clone());
                }
                json_identifiers(child, out);
            }
        }
        Value::Array(items) => items.iter().for_each(|item| json_identifiers(item, out)),
        other => out.extend(scalar_identifier(other)),
    }
}

/// The identifier tokens of a text that is not JSON.
pub fn prose_identifiers(content: &str) -> Vec<String> {
    let mut ids: Vec<String> = text::identifiers(content)
        .into_iter()
        .filter(|id| !id.contains("://"))
        .collect();
    ids.extend(capital_codes(content));
    ids
}

/// Words of three capitals (`PHL`, `ORD`, `EUR`): airport, currency and country codes.
/// Longer capital words are mostly acronyms and shouting in prose.
fn capital_codes(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.len() == 3 && w.chars().all(|c| c.is_ascii_uppercase()))
        .map(str::to_owned)
}

/// The identifier skeleton of a JSON value: only identifier leaves, the objects and lists
/// holding them, and id-like keys (`"6700049080": {…}`) even when nothing under them is left.
/// `None` when nothing is left. Rendering the skeleton gives what rendering the value gives.
pub fn prune(value: &Value) -> Option<Value> {
    match value {
        Value::Object(map) => {
            let mut out = serde_json::Map::new();
            for (key, child) in map {
                match prune(child) {
                    Some(kept) => {
                        out.insert(key.clone(), kept);
                    }
                    None if (child.is_object() || child.is_array())
                        && is_identifier_value(key)
                        && key.chars().any(|c| c.is_ascii_digit()) =>
                    {
                        out.insert(key.clone(), Value::Object(serde_json::Map::new()));
                    }
                    None => {}
                }
            }
            (!out.is_empty()).then_some(Value::Object(out))
        }
        Value::Array(items) => {
            let kept: Vec<Value> = items.iter().filter_map(prune).collect();
            (!kept.is_empty()).then_some(Value::Array(kept))
        }
        scalar => scalar_identifier(scalar).map(|_| scalar.clone()),
    }
}

/// A JSON object or array, when the text is one.
pub fn parse_json(text: &str) -> Option<Value> {
    let trimmed = text.trim_start();
    if !(trimmed.starts_with('{') || trimmed.starts_with('[')) {
        return None;
    }
    serde_json::from_str::<Value>(text)
        .ok()
        .filter(|v| v.is_object() || v.is_array())
}

/// The identifier leaves of a JSON value with their keys, compactly:
/// `order_id: #W1, items: [item_id: 11, price: 2.5; item_id: 12, price: 3]`. A leaf for which
/// `skip` is true is left out (already in the prompt), and so is a leaf repeating the key of the
/// object that holds it (`"6700049080": {"item_id": "6700049080"}`). Empty when nothing is left.
pub fn render_labelled(value: &Value, skip: &dyn Fn(&str) -> bool) -> String {
    let mut out = String::new();
    render_into(value, None, skip, &mut None, &mut out);
    out
}

/// `render_labelled`, with a `key: value` pair said once: the later items of a list show only
/// what differs (`origin: DEN, date: 2024-05-27, flight_number: HAT084; flight_number: HAT175`).
pub fn render_labelled_once(value: &Value, skip: &dyn Fn(&str) -> bool) -> String {
    let mut out = String::new();
    let mut said = HashSet::default();
    render_into(value, None, skip, &mut Some(&mut said), &mut out);
    out
}

/// Pairs already said (hashes of key and value), when each is said once.
type Said<'a> = Option<&'a mut HashSet<u64, foldhash::fast::RandomState>>;

fn pair_hash(key: &str, value: &str) -> u64 {
    use std::hash::BuildHasher;
    foldhash::quality::FixedState::with_seed(0x7361_6964).hash_one((key, value))
}

/// Renders `value` at the end of `out`, writing each part in place and taking back what turns
/// out to say nothing (no copies of nested parts).
fn render_into(
    value: &Value,
    parent_key: Option<&str>,
    skip: &dyn Fn(&str) -> bool,
    said: &mut Said<'_>,
    out: &mut String,
) {
    match value {
        Value::Object(map) => {
            let mut first = true;
            for (key, child) in map {
                let mark = out.len();
                if !first {
                    out.push_str(", ");
                }
                let start = out.len();
                match child {
                    Value::Object(_) | Value::Array(_) => {
                        let (open, close) = if child.is_array() {
                            (": [", ']')
                        } else {
                            (": {", '}')
                        };
                        out.push_str(key);
                        out.push_str(open);
                        let inner = out.len();
                        render_into(child, Some(key), skip, said, out);
                        if out.len() > inner {
                            out.push(close);
                        } else {
                            out.truncate(start);
                            if is_identifier_value(key)
                                && key.chars().any(|c| c.is_ascii_digit())
                                && !skip(key)
                            {
                                out.push_str(key);
                            }
                        }
                    }
                    scalar => {
                        if let Some(text) = scalar_text(scalar)
                            && parent_key != Some(text.as_ref())
                            && !skip(&text)
                            && said
                                .as_deref_mut()
                                .is_none_or(|said| said.insert(pair_hash(key, &text)))
                        {
                            out.push_str(key);
                            out.push_str(": ");
                            out.push_str(&text);
                        }
                    }
                }
                if out.len() == start {
                    out.truncate(mark);
                } else {
                    first = false;
                }
            }
        }
        Value::Array(items) => {
            let mut first = true;
            for item in items {
                let mark = out.len();
                if !first {
                    out.push_str("; ");
                }
                let start = out.len();
                match item {
                    Value::Object(_) => render_into(item, None, skip, said, out),
                    Value::Array(_) => {
                        out.push('[');
                        let inner = out.len();
                        render_into(item, None, skip, said, out);
                        if out.len() > inner {
                            out.push(']');
                        } else {
                            out.truncate(start);
                        }
                    }
                    scalar => {
                        if let Some(text) = scalar_text(scalar)
                            && !skip(&text)
                        {
                            out.push_str(&text);
                        }
                    }
                }
                if out.len() == start {
                    out.truncate(mark);
                } else {
                    first = false;
                }
            }
        }
        scalar => {
            if let Some(text) = scalar_text(scalar)
                && !skip(&text)
            {
                out.push_str(&text);
            }
        }
    }
}

/// A tool call as `name(key: value, …)` with the identifier arguments (all of them when the
/// arguments are not JSON and short).
pub fn call_label(name: &str, arguments: &str) -> String {
    let args = match parse_json(arguments) {
        Some(value) => render_labelled(&value, &|_| false),
        None if arguments.trim().chars().count() <= MAX_IDENTIFIER_CHARS => {
            arguments.trim().to_owned()
        }
        None => String::new(),
    };
    format!("{name}({args})")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The rules as first written, one pass per rule: what the one-pass version must answer.
    fn is_identifier_value_by_each_rule(value: &str) -> bool {
        let value = value.trim();
        let chars = value.chars().count();
        if chars == 0 || chars > MAX_IDENTIFIER_CHARS || value.contains("://") {
            return false;
        }
        if value.split_whitespace().count() > MAX_IDENTIFIER_WORDS {
            return false;
        }
        if value.contains('@') && !value.contains(char::is_whitespace) {
            return true;
        }
        let digits = value.chars().filter(char::is_ascii_digit).count();
        let letters = value.chars().filter(|c| c.is_alphabetic()).count();
        if digits > 0 {
            return (letters > 0 && chars >= 3) || digits >= 2 || value.contains('.');
        }
        if value.starts_with('#') && chars >= 3 {
            return true;
        }
        let code_name = value.len() >= 4
            && value.len() <= 64
            && value.starts_with(|c: char| c.is_ascii_alphabetic())
            && value.split('_').count() >= 2
            && value
                .split('_')
                .all(|part| !part.is_empty() && part.chars().all(|c| c.is_ascii_alphanumeric()));
        let words: Vec<&str> = value.split_whitespace().collect();
        let name = !words.is_empty()
            && words.len() <= 4
            && value.chars().count() >= 2
            && words.iter().all(|w| {
                let mut chars = w.chars();
                chars.next().is_some_and(char::is_uppercase)
                    && chars.all(|c| c.is_alphabetic() || matches!(c, '-' | '\'' | '.'))
            });
        code_name || name
    }

    /// `is_strong_identifier` as first written, one pass per rule.
    fn is_strong_identifier_by_each_rule(value: &str) -> bool {
        let digits = value.chars().filter(char::is_ascii_digit).count();
        let letters = value.chars().filter(|c| c.is_alphabetic()).count();
        (digits > 0 && letters > 0 && value.chars().count() >= 3 && !value.contains(' '))
            || (value.starts_with('#') && value.len() >= 3)
            || value.contains('@')
            || (digits >= 5 && digits == value.chars().count())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4000))]
        /// A strong identifier as the rules one by one say.
        #[test]
        fn a_strong_identifier_in_one_pass(value in "[aZ0-9@# .éÜ\u{663}-]{0,12}") {
            proptest::prop_assert_eq!(
                is_strong_identifier(&value),
                is_strong_identifier_by_each_rule(&value)
            );
        }

        /// The one-pass rules answer as the rules one by one, on values over letters of both
        /// cases, digits, the characters the rules name, white space (also not ASCII) and
        /// letters and digits that are not ASCII.
        #[test]
        fn one_pass_agrees_with_each_rule(
            value in "[aZqR0-9@#_:/.' \t\u{b}\u{c}\r\n\u{85}éÜ\u{a0}\u{2028}\u{663}-]{0,90}",
        ) {
            proptest::prop_assert_eq!(
                is_identifier_value(&value),
                is_identifier_value_by_each_rule(&value)
            );
        }
    }

    #[test]
    fn identifiers_by_the_definition() {
        for id in [
            "#W9348897",
            "6117189161",
            "credit_card_8853416",
            "daiki_sanchez_3253",
            "481.50",
            "$1,166.98",
            "2024-05-01",
            "10:30",
            "HAT045",
            "a.b@example.com",
            "Action Camera",
            "Daiki",
            "113 Hickory Lane",
            "8e2a95c4-efd0-4f12-9951-650414a9a7ee",
        ] {
            assert!(is_identifier_value(id), "{id}");
        }
        for not_id in [
            "",
            "7",
            "black",
            "no longer needed",
            "https://api.github.com/repos/1",
            "We found 3 items in the order you placed last week",
        ] {
            assert!(!is_identifier_value(not_id), "{not_id}");
        }
    }

    #[test]
    fn labelled_leaves_keep_keys_and_drop_repeated_map_keys() {
        let value = json!({"order_id": "#W1", "status": "pending", "paid": true,
            "items": [{"item_id": "6117189161", "price": 481.5, "color": "silver"}],
            "variants": {"6700049080": {"item_id": "6700049080", "price": 466.75, "available": false}}});
        assert_eq!(
            render_labelled(&value, &|_| false),
            "order_id: #W1, items: [item_id: 6117189161, price: 481.5], variants: {6700049080: {price: 466.75}}"
        );
        assert_eq!(
            render_labelled(&value, &|v| v == "#W1" || v == "466.75"),
            "items: [item_id: 6117189161, price: 481.5], variants: {6700049080}"
        );
        let skeleton = prune(&value).unwrap();
        let skips: [&dyn Fn(&str) -> bool; 2] = [&|_| false, &|v| v == "#W1" || v == "466.75"];
        for skip in skips {
            assert_eq!(
                render_labelled(&skeleton, skip),
                render_labelled(&value, skip)
            );
        }
    }

    #[test]
    fn every_leaf_of_a_result_is_found() {
        let value = json!({"a": [{"b": "X12"}, 7, 55], "c": {"d": "2024-01-02"}});
        let mut out = Vec::new();
        json_identifiers(&value, &mut out);
        assert_eq!(out, vec!["X12", "55", "2024-01-02"]);
        assert_eq!(
            call_label("get_order", r##"{"order_id": "#W1", "verbose": true}"##),
            "get_order(order_id: #W1)"
        );
    }
}
