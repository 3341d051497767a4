//! Lexical helpers shared by the stages: word normalization (case and accents), stop words in
//! English and Spanish, bag-of-words similarity, identifier spotting, sentence cutting.
//! Deterministic and allocation-light; no models.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

/// Lowercase and strip the accents of Latin letters (á → a, ñ → n).
pub fn fold(c: char) -> char {
    match c {
        'á' | 'à' | 'ä' | 'â' | 'Á' | 'À' | 'Ä' | 'Â' => 'a',
        'é' | 'è' | 'ë' | 'ê' | 'É' | 'È' | 'Ë' | 'Ê' => 'e',
        'í' | 'ì' | 'ï' | 'î' | 'Í' | 'Ì' | 'Ï' | 'Î' => 'i',
        'ó' | 'ò' | 'ö' | 'ô' | 'Ó' | 'Ò' | 'Ö' | 'Ô' => 'o',
        'ú' | 'ù' | 'ü' | 'û' | 'Ú' | 'Ù' | 'Ü' | 'Û' => 'u',
        'ñ' | 'Ñ' => 'n',
        'ç' | 'Ç' => 'c',
        other => other.to_ascii_lowercase(),
    }
}

/// The segments of a name, split at every character that is not a letter or digit and at
/// camelCase humps: `mcp__jira__search_issues` → mcp, jira, search, issues; `getWeather` → get,
/// Weather; `Order Id` → Order, Id.
pub fn name_segments(name: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for part in name
        .split(|c: char| !c.is_alphanumeric())
        .filter(|s| !s.is_empty())
    {
        let mut start = 0;
        let mut previous_lower = false;
        for (i, c) in part.char_indices() {
            if c.is_uppercase() && previous_lower {
                out.push(&part[start..i]);
                start = i;
            }
            previous_lower = c.is_lowercase() || c.is_ascii_digit();
        }
        out.push(&part[start..]);
    }
    out
}

/// The text folded (lowercase, no accents).
pub fn normalize(text: &str) -> String {
    // `fold` of an ASCII character is its lowercase: runs of them are folded at once, and
    // only the other characters one by one.
    let mut folded = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        let ascii = rest
            .bytes()
            .position(|b| !b.is_ascii())
            .unwrap_or(rest.len());
        let (run, after) = rest.split_at(ascii);
        let start = folded.len();
        folded.push_str(run);
        folded[start..].make_ascii_lowercase();
        let mut chars = after.chars();
        if let Some(c) = chars.next() {
            folded.push(fold(c));
        }
        rest = chars.as_str();
    }
    folded
}

const STOP_WORDS: &[&str] = &[
    // English
    "a", "about", "above", "after", "again", "all", "also", "am", "an", "and", "any", "are", "as",
    "at", "be", "because", "been", "before", "being", "both", "but", "by", "can", "could", "did",
    "do", "does", "doing", "for", "from", "had", "has", "have", "having", "he", "her", "here",
    "him", "his", "how", "i", "if", "in", "into", "is", "it", "its", "just", "let", "like", "me",
    "more", "most", "my", "no", "not", "now", "of", "off", "ok", "okay", "on", "once", "only",
    "or", "other", "our", "out", "over", "please", "same", "she", "should", "so", "some", "such",
    "than", "thank", "thanks", "that", "the", "their", "them", "then", "there", "these", "they",
    "this", "those", "to", "too", "up", "us", "very", "was", "we", "were", "what", "when", "where",
    "which", "while", "who", "why", "will", "with", "would", "yes", "you", "your", "want", "need",
    "get", "got", "tell", "know", "one", "also", "well", "sure", "hi", "hello", "i'm", "it's",
    "don't", "can't", "i'd", "i'll", "you're", // Spanish
    "al", "algo", "como", "con", "cual", "de", "del", "el", "ella", "en", "entre", "era", "es",
    "esa", "ese", "eso", "esta", "este", "esto", "fue", "ha", "hay", "la", "las", "le", "les",
    "lo", "los", "mas", "me", "mi", "mis", "muy", "nada", "ni", "no", "nos", "o", "para", "pero",
    "por", "que", "quiero", "se", "si", "sin", "sobre", "su", "sus", "te", "tu", "tus", "un",
    "una", "uno", "unos", "y", "ya", "yo", "hola", "gracias", "puedes", "podes", "necesito",
];

static STOP_WORD_SET: LazyLock<HashSet<&'static str, foldhash::fast::RandomState>> =
    LazyLock::new(|| STOP_WORDS.iter().copied().collect());

pub fn is_stop_word(word: &str) -> bool {
    STOP_WORD_SET.contains(word)
}

/// Content words of a text: folded, split on non-alphanumerics, without stop words and
/// one-letter tokens. A crude plural stem (`-ies`/`-s`, not `-ss`/`-us`/`-is`) makes
/// "flights" match "flight" and leaves "redis" and "status" alone.
pub fn content_words(text: &str) -> Vec<String> {
    normalize(text)
        .split(|c: char| !(c.is_alphanumeric() || c == '\''))
        .map(|w| w.trim_matches('\''))
        .filter(|w| w.chars().count() > 1 && !is_stop_word(w))
        .map(stem)
        .collect()
}

pub fn stem(word: &str) -> String {
    let n = word.len();
    if n > 4 && word.ends_with("ies") {
        format!("{}y", &word[..n - 3])
    } else if n > 3
        && word.ends_with('s')
        && !(word.ends_with("ss") || word.ends_with("us") || word.ends_with("is"))
        && word.is_ascii()
    {
        word[..n - 1].to_owned()
    } else {
        word.to_owned()
    }
}

/// Word counts of a text.
pub type Bag = HashMap<String, f64, foldhash::fast::RandomState>;

/// The counts of a text's content words (`content_words`).
pub fn bag_of(words: Vec<String>) -> Bag {
    let mut bag = Bag::default();
    for word in words {
        *bag.entry(word).or_insert(0.0) += 1.0;
    }
    bag
}

/// Cosine similarity of two bags of words, 0 when either is empty.
pub fn cosine(a: &Bag, b: &Bag) -> f64 {
    if a.is_empty() || b.is_empty() {
        return 0.0;
    }
    let dot: f64 = a.iter().filter_map(|(w, x)| b.get(w).map(|y| x * y)).sum();
    let norm = |m: &Bag| m.values().map(|v| v * v).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// Identifiers in a text, in order of first appearance, copied verbatim: URLs, paths, emails,
/// ids mixing letters and digits (`ABC123`, `HAT045`, `#1043`), and numbers of 2+ digits.
pub fn identifiers(text: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    let mut seen: HashSet<&str, foldhash::fast::RandomState> = HashSet::default();
    for raw in text.split(|c: char| {
        c.is_whitespace()
            || matches!(
                c,
                ',' | ';' | '(' | ')' | '[' | ']' | '{' | '}' | '"' | '\'' | '<' | '>' | '`'
            )
    }) {
        let token = raw.trim_end_matches(['.', ':', '!', '?']);
        // `NAME=value` (an environment variable, a flag) says two things; a query string, a
        // padded cursor or a URL says one.
        let parts = match token.split_once('=') {
            Some((name, value)) if is_assigned_name(name) && !token.contains(['?', '&']) => {
                [Some(name), Some(value)]
            }
            _ => [Some(token), None],
        };
        for token in parts.into_iter().flatten() {
            if token.is_empty() || seen.contains(token) {
                continue;
            }
            if is_identifier(token) {
                seen.insert(token);
                found.push(token.to_owned());
            }
        }
    }
    found
}

pub fn is_identifier(token: &str) -> bool {
    if token.len() > 200 {
        return false;
    }
    if token.contains("://") || (token.contains('@') && token.contains('.')) {
        return true;
    }
    if token.contains('/') && (token.starts_with('/') || token.contains('.')) && token.len() > 2 {
        return true;
    }
    let digits = token.chars().filter(char::is_ascii_digit).count();
    let letters = token.chars().filter(|c| c.is_alphabetic()).count();
    (digits > 0 && letters > 0 && token.len() >= 3) || digits >= 2 || is_code_name(token)
}

/// The left side of `NAME=value`: a name (`POSTGRES_PASSWORD`, `--port`, `max_length`).
fn is_assigned_name(name: &str) -> bool {
    let name = name.trim_start_matches('-');
    name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// A name from code or an API: words joined by underscores (`submit_review`,
/// `POSTGRES_PASSWORD`, `list_for_org`), what agents call and users copy back.
pub fn is_code_name(token: &str) -> bool {
    token.len() >= 4
        && token.len() <= 64
        && token.starts_with(|c: char| c.is_ascii_alphabetic())
        && token.contains('_')
        && token
            .split('_')
            .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// The first sentence of a text (up to `.`, `!`, `?` or a newline), at most `max_words` words.
pub fn first_sentence(text: &str, max_words: usize) -> String {
    let end = text
        .char_indices()
        .find(|&(i, c)| {
            c == '\n'
                || (matches!(c, '.' | '!' | '?')
                    && text[i + c.len_utf8()..].starts_with([' ', '\n']))
        })
        .map_or(text.len(), |(i, c)| i + c.len_utf8());
    truncate_words(text[..end].trim(), max_words)
}

/// At most `max_words` words, with `…` when cut.
pub fn truncate_words(text: &str, max_words: usize) -> String {
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.len() <= max_words {
        words.join(" ")
    } else {
        format!("{}…", words[..max_words].join(" "))
    }
}

/// Whether the word before a period is an abbreviation ("p. ej.", "e.g.", "i.e.").
fn is_abbreviation(before: &str) -> bool {
    let word = before.rsplit(char::is_whitespace).next().unwrap_or("");
    let mut chars = word.chars();
    let single_lowercase = chars.next().is_some_and(char::is_lowercase) && chars.next().is_none();
    single_lowercase || word.contains('.')
}

/// Sentences of a text, split after `.`, `!`, `?` followed by whitespace (not inside `3.5`
/// or `api.github.com`) and at newlines.
pub fn sentences(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        let end = i + c.len_utf8();
        let boundary = c == '\n'
            || (matches!(c, '.' | '!' | '?')
                && text[end..].chars().next().is_none_or(char::is_whitespace)
                && !(c == '.' && is_abbreviation(&text[start..i])));
        if boundary {
            let sentence = text[start..end].trim();
            if !sentence.is_empty() {
                out.push(sentence);
            }
            start = end;
        }
    }
    let tail = text[start..].trim();
    if !tail.is_empty() {
        out.push(tail);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ascii_text_folds_to_its_lowercase() {
        let every: String = (0u8..128).map(char::from).collect();
        assert_eq!(
            normalize(&every),
            every.chars().map(fold).collect::<String>()
        );
        assert_eq!(normalize("ÁRBOL Niño"), "arbol nino");
    }

    proptest::proptest! {
        #[test]
        fn text_folds_as_each_of_its_characters(text in "(?s)[A-Za-z0-9 .,'áÑüÇ€😀\u{0}-\u{7f}]{0,40}") {
            proptest::prop_assert_eq!(normalize(&text), text.chars().map(fold).collect::<String>());
        }
    }

    #[test]
    fn words_fold_accents_plurals_and_stop_words() {
        assert_eq!(
            content_words("¿Dónde están los VUELOS de mañana?"),
            vec!["donde", "estan", "vuelo", "manana"]
        );
        assert_eq!(
            content_words("The flights and the cities"),
            vec!["flight", "city"]
        );
    }

    #[test]
    fn commands_and_code_give_their_names_ports_and_tags() {
        let ids = identifiers(
            "docker run -e POSTGRES_PASSWORD=secret -p 8000:8000 postgres:13 and set max_connections",
        );
        assert_eq!(
            ids,
            vec![
                "POSTGRES_PASSWORD",
                "8000:8000",
                "postgres:13",
                "max_connections"
            ]
        );
        assert!(!is_code_name("_private") && !is_code_name("a_") && !is_code_name("snake"));
        // A value with `=` in it stays whole.
        assert_eq!(
            identifiers("next cursor=Y3Vyc29yOjE= and /search?q=abc12&page=2"),
            vec!["Y3Vyc29yOjE=", "/search?q=abc12&page=2"]
        );
    }

    #[test]
    fn identifiers_are_copied_verbatim() {
        let ids = identifiers(
            "Check reservation ABC123 (flight HAT045), see https://x.io/a?b=1. Mail me at a@b.co, file /etc/hosts, issue #1043 and 2024.",
        );
        assert_eq!(
            ids,
            vec![
                "ABC123",
                "HAT045",
                "https://x.io/a?b=1",
                "a@b.co",
                "/etc/hosts",
                "#1043",
                "2024"
            ]
        );
    }

    #[test]
    fn similarity() {
        let bag = |text: &str| bag_of(content_words(text));
        let a = bag("cancel my flight to Paris");
        assert!((cosine(&a, &bag("cancel the flight to paris")) - 1.0).abs() < 1e-9);
        assert_eq!(cosine(&a, &bag("what's a good pasta recipe")), 0.0);
    }

    #[test]
    fn sentence_helpers() {
        assert_eq!(
            first_sentence("Done. Flight changed to HAT045. Anything else?", 10),
            "Done."
        );
        assert_eq!(first_sentence("one two three four", 2), "one two…");
        assert_eq!(
            sentences("Ship it. Now? See api.github.com, e.g. v3.5 and p. ej. Plan B. End"),
            vec![
                "Ship it.",
                "Now?",
                "See api.github.com, e.g. v3.5 and p. ej.",
                "Plan B.",
                "End"
            ]
        );
    }
}
