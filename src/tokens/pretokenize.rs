//! The pre-tokenization of o200k_base and cl100k_base (tiktoken's split patterns, as
//! `bpe-openai` writes them: a negative look-ahead `\s+(?!\S)` as a pattern that matches one
//! character more, dropped from the piece), searched with a cache of this thread's own.
//!
//! `bpe_openai::Tokenizer::split` searches with the regex's shared cache pool, whose fast path
//! belongs to the thread that first used it: on every other worker thread each piece took and
//! returned a cache through the pool's slow path, about a tenth of the proxy's CPU on real
//! requests. The pieces are the same (a test holds it against `Tokenizer::count`).
//!
//! ASCII text (most of what agents send: JSON, code, English) is split by hand instead, as the
//! patterns split it ([`ascii_piece_end`]): the regex search was a third of the proxy's CPU on
//! requests it had not seen. Property tests hold the two to the same pieces.

use std::cell::RefCell;
use std::sync::LazyLock;

use regex_automata::meta::{Cache, Regex};
use regex_automata::{Anchored, Input};

use super::Encoding;

/// The compiled patterns of an encoding, and which of them carry a look-ahead character.
struct Patterns {
    regex: Regex,
    lookahead: [bool; 3],
}

fn compiled(first: &str) -> Patterns {
    let patterns = [first, "\\s+\\s", "\\s+"];
    Patterns {
        // The patterns are constants known to compile; a failure is a bug caught by the tests.
        regex: Regex::new_many(&patterns).unwrap_or_else(|e| unreachable!("split patterns: {e}")),
        lookahead: [false, true, false],
    }
}

static O200K: LazyLock<Patterns> = LazyLock::new(|| {
    compiled(
        &[
            "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            "\\p{N}{1,3}",
            " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*",
            "\\s*[\\r\\n]+",
            "\\s+$",
        ]
        .join("|"),
    )
});

static CL100K: LazyLock<Patterns> = LazyLock::new(|| {
    compiled(
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+$",
    )
});

fn patterns(encoding: Encoding) -> &'static Patterns {
    match encoding {
        Encoding::O200kBase => &O200K,
        Encoding::Cl100kBase => &CL100K,
    }
}

thread_local! {
    /// This thread's search caches, one per encoding, made on first use.
    static CACHES: RefCell<[Option<Cache>; 2]> = const { RefCell::new([None, None]) };
}

/// Calls `each` with the bytes of every piece of `text` in order, as the encoding's tokenizer
/// splits it (bytes: what the vocabulary reads, and no character boundary to check).
pub fn for_each_piece(encoding: Encoding, text: &str, mut each: impl FnMut(&[u8])) {
    if text.is_ascii() {
        ascii_pieces(encoding, text.as_bytes(), &mut each);
        return;
    }
    // Lines that are all ASCII are split by hand; the others word by word, the words that are
    // all ASCII by hand and the rest by the regex.
    for line in cut_at(text, piece_boundaries_after_line_breaks(text)) {
        if line.is_ascii() {
            ascii_pieces(encoding, line.as_bytes(), &mut each);
            continue;
        }
        for word in cut_at(line, piece_boundaries_at_spaces(line)) {
            if word.is_ascii() {
                ascii_pieces(encoding, word.as_bytes(), &mut each);
            } else {
                regex_pieces(encoding, word, &mut each);
            }
        }
    }
}

/// `text` cut where both encodings always start a piece (after line breaks, see
/// [`piece_boundaries_after_line_breaks`]), every part but the last at least `min_bytes` long.
/// The tokens of `text` are the sum of its parts' tokens, and two texts that start alike are cut
/// alike up to where they differ.
pub fn parts(text: &str, min_bytes: usize) -> impl Iterator<Item = &str> + '_ {
    cut_at(
        text,
        apart(piece_boundaries_after_line_breaks(text), min_bytes),
    )
}

/// `text` cut at spaces where both encodings always start a piece (see
/// [`piece_boundaries_at_spaces`]), every chunk but the last at least `min_bytes` long: the
/// tokens of `text` are the sum of its chunks' tokens. Minified JSON, one part for `parts`, has
/// spaces in its strings.
pub fn chunks_at_spaces(text: &str, min_bytes: usize) -> impl Iterator<Item = &str> + '_ {
    cut_at(text, apart(piece_boundaries_at_spaces(text), min_bytes))
}

/// The `boundaries` at least `min_bytes` after the one kept before (or the start).
fn apart(boundaries: impl Iterator<Item = usize>, min_bytes: usize) -> impl Iterator<Item = usize> {
    let mut last = 0;
    boundaries.filter(move |&at| {
        let far_enough = at - last >= min_bytes;
        if far_enough {
            last = at;
        }
        far_enough
    })
}

/// `text` cut at `boundaries` (increasing positions inside it).
fn cut_at<'t>(
    text: &'t str,
    boundaries: impl Iterator<Item = usize> + 't,
) -> impl Iterator<Item = &'t str> + 't {
    let mut start = 0;
    boundaries.chain([text.len()]).map(move |end| {
        let chunk = &text[start..end];
        start = end;
        chunk
    })
}

fn ascii_pieces(encoding: Encoding, text: &[u8], each: &mut impl FnMut(&[u8])) {
    // One loop per encoding, each with its patterns' choices made at compile time.
    fn pieces<const O200K_BASE: bool>(text: &[u8], each: &mut impl FnMut(&[u8])) {
        let mut last = 0;
        while last < text.len() {
            let end = ascii_piece_end::<O200K_BASE>(text, last);
            each(&text[last..end]);
            last = end;
        }
    }
    match encoding {
        Encoding::O200kBase => pieces::<true>(text, each),
        Encoding::Cl100kBase => pieces::<false>(text, each),
    }
}

/// Positions right after a line break where both encodings always start a piece, whatever came
/// before: no pattern goes on past a line break but to take more line breaks (or, after
/// symbols, `/`), so one does here when the next character is neither and the white space it
/// starts holds no line break. A piece that starts there reads nothing before it.
fn piece_boundaries_after_line_breaks(text: &str) -> impl Iterator<Item = usize> + '_ {
    memchr::memchr2_iter(b'\n', b'\r', text.as_bytes())
        .map(|at| at + 1)
        .filter(move |&at| {
            let mut rest = text[at..].chars();
            match rest.next() {
                None | Some('\r' | '\n' | '/') => false,
                Some(c) if c.is_whitespace() => rest
                    .take_while(|c| c.is_whitespace())
                    .all(|c| c != '\r' && c != '\n'),
                Some(_) => true,
            }
        })
}

/// Positions of a space that follows a character other than white space, where both encodings
/// always start a piece: no pattern takes a space but as its first character or within white
/// space, so the piece before ends there, and a piece that starts there reads nothing before it.
fn piece_boundaries_at_spaces(text: &str) -> impl Iterator<Item = usize> + '_ {
    memchr::memchr_iter(b' ', text.as_bytes()).filter(move |&at| {
        text[..at]
            .chars()
            .next_back()
            .is_some_and(|c| !c.is_whitespace())
    })
}

/// The end of the piece of ASCII `text` that starts at `at` (`at < text.len()`): the first
/// alternative of the split patterns that matches there, taken as a backtracking search takes it
/// (leftmost-first, greedy). o200k_base, in order: an optional non-letter, non-digit character
/// other than a line break, then upper-case letters and at least one lower-case one, or at least
/// one upper-case letter and lower-case ones, each with an optional contraction; one to three
/// digits; an optional space, symbols, and line breaks or slashes; white space up to its last
/// line break; white space to the end; white space but its last character; white space.
/// cl100k_base: a contraction; an optional non-letter, non-digit character other than a line
/// break, then letters; then the same as o200k_base (line breaks only after symbols).
#[inline(always)]
fn ascii_piece_end<const O200K_BASE: bool>(text: &[u8], at: usize) -> usize {
    let first = class(text[at]);
    // Most pieces start with a letter or a digit: no leading character, no contraction before.
    if first & LETTER != 0 {
        return if O200K_BASE {
            let lower = run(text, run(text, at, UPPER), LOWER);
            lower + contraction_len(text, lower)
        } else {
            run(text, at, LETTER)
        };
    }
    if first & DIGIT != 0 {
        // One to three digits: a longer number is read three at a time.
        return run(&text[..text.len().min(at + 3)], at, DIGIT);
    }
    if !O200K_BASE {
        let contraction = contraction_len(text, at);
        if contraction > 0 {
            return at + contraction;
        }
    }
    // The optional leading character (`first` is neither a letter nor a digit): a backtracking
    // search takes it whenever it can, and without it the letters cannot start.
    let start = if first & BREAK == 0 { at + 1 } else { at };
    if text.get(start).is_some_and(|&c| class(c) & LETTER != 0) {
        return if O200K_BASE {
            let lower = run(text, run(text, start, UPPER), LOWER);
            lower + contraction_len(text, lower)
        } else {
            run(text, start, LETTER)
        };
    }
    let symbols = if text[at] == b' ' && text.get(at + 1).is_some_and(|&c| class(c) & SYMBOL != 0) {
        at + 1
    } else {
        at
    };
    if class(text[symbols]) & SYMBOL != 0 {
        let end = run(text, symbols, SYMBOL);
        return run(text, end, if O200K_BASE { BREAK | SLASH } else { BREAK });
    }
    // White space (`first` is: every other character matched above).
    let end = run(text, at, SPACE);
    if let Some(line_break) = (at..end).rev().find(|&k| class(text[k]) & BREAK != 0) {
        line_break + 1
    } else if end == text.len() || end - at == 1 {
        end
    } else {
        end - 1
    }
}

/// Where the run of characters of a class in `classes` (bits of [`CLASSES`]) starting at
/// `from` ends.
#[inline(always)]
fn run(text: &[u8], from: usize, classes: u8) -> usize {
    let rest = text.get(from..).unwrap_or_default();
    from + (rest.iter())
        .position(|&c| class(c) & classes == 0)
        .unwrap_or(rest.len())
}

// The classes of ASCII characters that the split patterns tell apart, bits of [`CLASSES`].
/// `[A-Z]`.
const UPPER: u8 = 1;
/// `[a-z]`.
const LOWER: u8 = 1 << 1;
/// `\p{L}` in ASCII.
const LETTER: u8 = UPPER | LOWER;
/// `\p{N}` in ASCII.
const DIGIT: u8 = 1 << 2;
/// `\s` in ASCII (Unicode's White_Space).
const SPACE: u8 = 1 << 3;
/// `[\r\n]`, also white space.
const BREAK: u8 = 1 << 4;
/// `[^\s\p{L}\p{N}]`.
const SYMBOL: u8 = 1 << 5;
/// `/`, also a symbol.
const SLASH: u8 = 1 << 6;

/// Each ASCII character's classes: one table read instead of a comparison per class.
const CLASSES: [u8; 128] = {
    let mut table = [0; 128];
    let mut c = 0;
    while c < 128 {
        let byte = c as u8;
        table[c] = if byte.is_ascii_uppercase() {
            UPPER
        } else if byte.is_ascii_lowercase() {
            LOWER
        } else if byte.is_ascii_digit() {
            DIGIT
        } else if byte == b'\r' || byte == b'\n' {
            SPACE | BREAK
        } else if matches!(byte, b'\t' | 0x0B | 0x0C | b' ') {
            SPACE
        } else if byte == b'/' {
            SYMBOL | SLASH
        } else {
            SYMBOL
        };
        c += 1;
    }
    table
};

/// The classes of an ASCII character (the text split by hand is all ASCII).
#[inline(always)]
fn class(c: u8) -> u8 {
    CLASSES[usize::from(c & 0x7f)]
}

/// The length of `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at `at`, or 0.
fn contraction_len(text: &[u8], at: usize) -> usize {
    let lower = |k: usize| text.get(at + k).map(u8::to_ascii_lowercase);
    if text.get(at) != Some(&b'\'') {
        return 0;
    }
    match (lower(1), lower(2)) {
        (Some(b's' | b't' | b'm' | b'd'), _) => 2,
        (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => 3,
        _ => 0,
    }
}

/// The pieces as the regex finds them (any text).
fn regex_pieces(encoding: Encoding, text: &str, mut each: impl FnMut(&[u8])) {
    let patterns = patterns(encoding);
    CACHES.with_borrow_mut(|caches| {
        let cache = caches[encoding as usize].get_or_insert_with(|| patterns.regex.create_cache());
        let mut last = 0;
        while last < text.len() {
            let input = Input::new(&text[last..]).anchored(Anchored::Yes);
            let Some(found) = patterns.regex.search_with(cache, &input) else {
                break;
            };
            let mut end = last + found.range().end;
            if patterns.lookahead[found.pattern().as_usize()]
                && let Some(ahead) = text[last..end].chars().next_back()
            {
                end -= ahead.len_utf8();
            }
            if end == last {
                // Never the case with these patterns; stop rather than loop.
                break;
            }
            each(&text.as_bytes()[last..end]);
            last = end;
        }
    });
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn count(encoding: Encoding, text: &str) -> usize {
        let tokenizer = crate::tokens::reference(encoding);
        let normalized = tokenizer.normalize(text);
        let mut total = 0;
        for_each_piece(encoding, normalized.as_str(), |piece| {
            total += tokenizer.bpe.count(piece);
        });
        total
    }

    #[test]
    fn pieces_count_as_the_tokenizer_counts() {
        let texts = [
            "",
            " ",
            "hello world",
            "  leading and trailing  ",
            "tabs\tand\nnew lines\r\n\r\n  indented",
            "I'll say it's 3.14159 or 1234567, DON'T",
            "{\"order_id\": \"W2378156\", \"items\": [1, 2, 3]}\n",
            "naïve café — 東京 🚀 emoji\u{200b}zero-width",
            "    \n\n   x",
            "path/to/file.rs:42 --flag=value",
        ];
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            for text in texts {
                assert_eq!(
                    count(encoding, text),
                    crate::tokens::reference(encoding).count(text),
                    "{encoding:?} {text:?}"
                );
            }
        }
    }

    /// A way of splitting text into pieces.
    type Split = fn(Encoding, &str, &mut dyn FnMut(&[u8]));

    fn pieces(encoding: Encoding, text: &str, split: Split) -> Vec<String> {
        let mut pieces = Vec::new();
        split(encoding, text, &mut |piece| {
            pieces.push(String::from_utf8(piece.to_vec()).expect("a piece is whole characters"))
        });
        pieces
    }

    fn by_hand(encoding: Encoding, text: &str, each: &mut dyn FnMut(&[u8])) {
        assert!(text.is_ascii());
        for_each_piece(encoding, text, each);
    }

    fn by_regex(encoding: Encoding, text: &str, each: &mut dyn FnMut(&[u8])) {
        regex_pieces(encoding, text, each);
    }

    fn assert_splits_as_the_regex(texts: &[&str], split: Split) {
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            for text in texts {
                assert_eq!(
                    pieces(encoding, text, split),
                    pieces(encoding, text, by_regex),
                    "{encoding:?} {text:?}"
                );
            }
        }
    }

    #[test]
    fn ascii_splits_by_hand_as_the_patterns_split_it() {
        let texts = [
            "it's 'RE 'll 'Ve we'd THEY'LL x'q 'sound",
            "HELLOworld Hello HELLO hELLO .Hello .hello .HELLO 'hello",
            "  \n  hello\t\tworld \x0b\x0cx \r\n\r\n\t  ",
            "{\"id\": \"W2378156\", \"n\": [1, 22, 333, 4444, 55555]}\n/path/to/x.rs://a\n/b",
            " {} ,, \x00\x01\x7f  -- a--b __init__ ~/. \n\n/",
            "end with spaces   ",
            "end with one space ",
            "\n",
            " ",
            "a",
            "1234567890",
            "x  \n",
        ];
        assert_splits_as_the_regex(&texts, by_hand);
    }

    fn by_lines(encoding: Encoding, text: &str, each: &mut dyn FnMut(&[u8])) {
        for_each_piece(encoding, text, each);
    }

    #[test]
    fn text_with_other_letters_splits_by_lines_as_the_patterns_split_it() {
        let texts = [
            "- order #W123\n- café: 8000:8000\n",
            "{\n  \"name\": \"Zoë\",\n  \"id\": 7\n}\n",
            "a.\n/é\n\n  \n b",
            "x\r\n\u{a0}\n\u{a0}y ü\n\t\u{2028}z",
            "ß\n\n\n",
            "\n日本\n \u{1F600}",
            "Zoë's  café — naïve 'quote' x\u{a0} y 東京 tower  \u{1F600} !? ÜBER  ",
        ];
        assert_splits_as_the_regex(&texts, by_lines);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn any_text_splits_by_lines_as_the_patterns_split_it(
            text in "([a-zA-Z]{1,3}|[0-9]{1,4}|[ \t\n\r\x0b\x0c]{1,3}|[./:\"{}-]{1,2}|[éßÜ日\u{a0}\u{2028}\u{85}\u{1F600}]){0,40}"
        ) {
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                prop_assert_eq!(pieces(encoding, &text, by_lines), pieces(encoding, &text, by_regex));
            }
        }

        #[test]
        fn any_ascii_splits_by_hand_as_the_patterns_split_it(
            text in "([a-zA-Z]{1,4}|[0-9]{1,5}|'[sStTmMdDrRvVlLeE]{0,2}|[ \t\n\r\x0b\x0c]{1,4}|[!-/:-@\\[-`{-~]{1,3}|[\x00-\x08\x0e-\x1f\x7f]){0,40}"
        ) {
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                prop_assert_eq!(pieces(encoding, &text, by_hand), pieces(encoding, &text, by_regex));
            }
        }

        #[test]
        fn any_text_counts_as_the_sum_of_its_parts(
            text in "([a-zA-Z]{1,3}|[0-9]{1,4}|[ \t\n\r\x0b\x0c]{1,3}|[./:\"{}-]{1,2}|[éßÜ日\u{a0}\u{2028}\u{85}\u{1F600}]){0,60}",
            min_bytes in 0usize..24,
        ) {
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                let whole = crate::tokens::reference(encoding).count(text.as_str());
                let parts: Vec<&str> = parts(&text, min_bytes).collect();
                prop_assert_eq!(parts.concat(), text.as_str());
                let summed: usize = parts
                    .iter()
                    .map(|p| crate::tokens::reference(encoding).count(p))
                    .sum();
                prop_assert_eq!(summed, whole, "{:?}", parts);
            }
        }

        #[test]
        fn any_text_splits_as_the_tokenizer_splits(text in "(\\PC|\\s| |'s|\\d{1,5}|[\\r\\n\\t]){0,60}") {
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                prop_assert_eq!(count(encoding, &text), crate::tokens::reference(encoding).count(text.as_str()));
            }
        }
    }
}
