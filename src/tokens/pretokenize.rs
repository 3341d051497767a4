//! The pre-tokenization of o200k_base and cl100k_base (tiktoken's split patterns, as
//! `bpe-openai` writes them: a negative look-ahead `\s+(?!\S)` as a pattern that matches one
//! character more, dropped from the piece), searched with a cache of this thread's own.
//!
//! `bpe_openai::Tokenizer::split` searches with the regex's shared cache pool, whose fast path
//! belongs to the thread that first used it: on every other worker thread each piece took and
//! returned a cache through the pool's slow path, about a tenth of the proxy's CPU on real
//! requests. The pieces are the same (a test holds it against `Tokenizer::count`).

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

/// Calls `each` with every piece of `text` in order, as the encoding's tokenizer splits it.
pub fn for_each_piece(encoding: Encoding, text: &str, mut each: impl FnMut(&str)) {
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
            each(&text[last..end]);
            last = end;
        }
    });
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn count(encoding: Encoding, text: &str) -> usize {
        let tokenizer = encoding.tokenizer();
        let normalized = tokenizer.normalize(text);
        let mut total = 0;
        for_each_piece(encoding, normalized.as_str(), |piece| {
            total += tokenizer.bpe.count(piece.as_bytes());
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
                    encoding.tokenizer().count(text),
                    "{encoding:?} {text:?}"
                );
            }
        }
    }

    proptest! {
        #[test]
        fn any_text_splits_as_the_tokenizer_splits(text in "(\\PC|\\s| |'s|\\d{1,5}|[\\r\\n\\t]){0,60}") {
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                prop_assert_eq!(count(encoding, &text), encoding.tokenizer().count(text.as_str()));
            }
        }
    }
}
