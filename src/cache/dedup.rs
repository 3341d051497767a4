//! The dedup decision (pure): is a new question the same as an earlier one? A
//! built-in lexical embedder (folded words, word pairs and character trigrams hashed into a
//! fixed-size vector) gives the similarity; a hit also needs every guard to pass — the same
//! negations, no antonym swapped, the same question word and persons, similar lengths, the same
//! numbers and distinctive tokens (names, identifiers, C++), the same content words in the
//! same order, and the same words as sets — so "turn on dark mode" never matches "turn off dark
//! mode", nor "best and worst jobs" "worst jobs". Precision over recall: a wrong answer is worse
//! than a miss. Which requests may share answers at all is `dedup_scope`.

use std::collections::BTreeSet;
use std::hash::BuildHasher;

use crate::pipeline::text::{is_stop_word, normalize, stem};

/// Dimensions of the lexical embedding.
pub const DIMENSIONS: usize = 512;
const SEED: u64 = 0x6465_6475_7065_6d62;

const NEGATIONS: &[&str] = &[
    "not", "no", "never", "dont", "doesnt", "didnt", "cant", "cannot", "wont", "isnt", "arent",
    "wasnt", "shouldnt", "without", "nunca", "sin", "tampoco", "ni", "nadie", "ningun", "ninguna",
    "nothing", "none", "neither", "nor",
];

/// Pairs of words whose swap reverses a question (folded).
const ANTONYMS: &[(&str, &str)] = &[
    ("on", "off"),
    ("enable", "disable"),
    ("accept", "decline"),
    ("increase", "decrease"),
    ("improve", "damage"),
    ("open", "close"),
    ("start", "stop"),
    ("add", "remove"),
    ("buy", "sell"),
    ("before", "after"),
    ("max", "min"),
    ("maximum", "minimum"),
    ("best", "worst"),
    ("more", "less"),
    ("activar", "desactivar"),
    ("encender", "apagar"),
    ("comprar", "vender"),
    ("aceptar", "rechazar"),
    ("antes", "despues"),
    ("in", "out"),
    ("under", "over"),
    ("above", "below"),
    ("import", "export"),
    ("upload", "download"),
    // Advice is not possibility: "should I apply" ≠ "can I apply".
    ("should", "can"),
    ("should", "could"),
    ("debo", "puedo"),
];

/// Question words, by what they ask (what/which ask the same).
const QUESTION_WORDS: &[(&str, &str)] = &[
    ("what", "what"),
    ("which", "what"),
    ("who", "who"),
    ("whom", "who"),
    ("where", "where"),
    ("when", "when"),
    ("why", "why"),
    ("how", "how"),
    ("que", "what"),
    ("cual", "what"),
    ("quien", "who"),
    ("donde", "where"),
    ("cuando", "when"),
    ("por", "why"),
    ("como", "how"),
];

/// Words whose presence in only one question does not change what it asks.
const SOFT_WORDS: &[&str] = &[
    "some", "good", "best", "really", "actually", "way", "please", "exactly", "possible", "easy",
    "easiest", "quick", "quickly", "simple", "favorite", "thing", "anyone", "someone", "tell",
    "know", "can", "could", "would", "should", "do", "does", "doe", "did",
];

/// Words that say whose thing a question is about, by grammatical person: "my palm" and
/// "your palm" are different questions.
const PERSONS: &[(&str, u8)] = &[
    ("i", 1),
    ("me", 1),
    ("my", 1),
    ("mine", 1),
    ("myself", 1),
    ("im", 1),
    ("ive", 1),
    ("you", 2),
    ("your", 2),
    ("yours", 2),
    ("yourself", 2),
    ("youre", 2),
    ("we", 3),
    ("our", 3),
    ("ours", 3),
    ("us", 3),
    ("he", 4),
    ("him", 4),
    ("his", 4),
    ("she", 5),
    ("her", 5),
    ("hers", 5),
    ("they", 6),
    ("them", 6),
    ("their", 6),
    ("yo", 1),
    ("mi", 1),
    ("mis", 1),
    ("tu", 2),
    ("tus", 2),
    ("usted", 2),
    ("su", 6),
    ("nosotros", 3),
    ("nuestro", 3),
    ("nuestra", 3),
];

/// Words whose presence in only one of two questions does not change what it asks: articles,
/// the auxiliaries "be", "do" and "have", and fillers. Pronouns, question words and negations
/// are not here because they have guards of their own; every other word, function words
/// included, counts ("difference between to and for" ≠ "between to and into").
const NEUTRAL: &[&str] = &[
    "a", "an", "the", "is", "are", "am", "was", "were", "be", "been", "being", "do", "does", "doe",
    "did", "have", "has", "had", "some", "please", "really", "actually", "just", "el", "la", "los",
    "las", "un", "una", "unos", "unas", "es", "son", "esta", "estan",
    // "How do I…" asks what "How can I…" and "Who should I…" ask; the antonym guard keeps
    // "should I" apart from "can I", and "could" counts ("can someone" ≠ "could someone").
    "can", "should", // Greetings, thanks and hesitation.
    "hi", "hello", "hey", "thanks", "thank", "cheers", "um", "uh", "er", "erm", "hmm", "ok",
    "okay", "so", "hola", "gracias",
];

/// Auxiliaries of the past (the verbs around them are compared as words).
const PAST: &[&str] = &["was", "were", "did", "had", "fue", "era", "eran", "fueron"];

/// Words that ask the same in a question, each mapped to one of them.
const SYNONYMS: &[(&str, &str)] = &[
    ("meaning", "definition"),
    ("receive", "get"),
    ("shop", "store"),
    ("silence", "mute"),
    ("dispute", "challenge"),
    ("update", "change"),
];

/// A question word's contraction, as the word and "is": "what's" is "what is".
const CONTRACTIONS: &[(&str, &str)] = &[
    ("whats", "what"),
    ("hows", "how"),
    ("wheres", "where"),
    ("whos", "who"),
    ("whens", "when"),
    ("whys", "why"),
];

/// A question this many times longer (in words) than the other asks more than it.
const MAX_LENGTH_RATIO: f32 = 1.5;

/// Folded words with apostrophes dropped ("don't" → "dont").
fn words(text: &str) -> Vec<String> {
    normalize(text)
        .replace(['\'', '’'], "")
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .flat_map(|w| match CONTRACTIONS.iter().find(|(c, _)| *c == w) {
            Some((_, word)) => vec![(*word).to_owned(), "is".to_owned()],
            None => vec![w.to_owned()],
        })
        .collect()
}

fn bucket(feature: &str) -> usize {
    let hash = foldhash::quality::FixedState::with_seed(SEED).hash_one(feature);
    (hash % DIMENSIONS as u64) as usize
}

/// The normalized lexical embedding of a question.
pub fn embed(text: &str) -> Vec<f32> {
    let mut vector = vec![0f32; DIMENSIONS];
    let content: Vec<String> = words(text)
        .into_iter()
        .filter(|w| !is_stop_word(w) || NEGATIONS.contains(&w.as_str()))
        .map(|w| stem(&w))
        .collect();
    for word in &content {
        vector[bucket(word)] += 1.0;
        let padded: Vec<char> = format!("^{word}$").chars().collect();
        for gram in padded.windows(3) {
            vector[bucket(&gram.iter().collect::<String>())] += 0.25;
        }
    }
    for pair in content.windows(2) {
        vector[bucket(&format!("{} {}", pair[0], pair[1]))] += 0.5;
    }
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        vector.iter_mut().for_each(|x| *x /= norm);
    }
    vector
}

/// A vector as hex of its components quantized to i8 (compact to store beside a question).
/// A vector as hex of signed bytes, scaled so its largest component is ±127 (the cosine does
/// not depend on the scale, and small components of long vectors keep their precision).
pub fn encode(vector: &[f32]) -> String {
    let largest = vector
        .iter()
        .fold(0.0_f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    let bytes: Vec<u8> = vector
        .iter()
        .map(|x| (x / largest * 127.0).round().clamp(-127.0, 127.0) as i8 as u8)
        .collect();
    hex::encode(bytes)
}

pub fn decode(text: &str) -> Option<Vec<f32>> {
    let bytes = hex::decode(text).ok()?;
    (!bytes.is_empty()).then(|| bytes.iter().map(|b| f32::from(*b as i8) / 127.0).collect())
}

/// Cosine similarity; 0 for vectors of different lengths (made by different embedders).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return 0.0;
    }
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let norms = norm(a) * norm(b);
    if norms > 0.0 { dot / norms } else { 0.0 }
}

/// Numbers, identifiers (letters and digits) and capitalized names (not the first word), in
/// order: what a question is about, which no paraphrase changes.
fn distinctive(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, raw) in text
        .split(|c: char| c.is_whitespace() || matches!(c, ',' | ';' | '?' | '!' | '(' | ')' | '"'))
        .filter(|w| !w.is_empty())
        .enumerate()
    {
        let token = raw.trim_matches(|c: char| !c.is_alphanumeric());
        if token.is_empty() {
            continue;
        }
        let has_digit = token.chars().any(|c| c.is_ascii_digit());
        let capitalized = i > 0 && token.chars().next().is_some_and(char::is_uppercase);
        let symbols = raw.contains(['+', '#', '£', '$', '€', '%']);
        if has_digit || capitalized || symbols {
            out.push(normalize(raw.trim_matches(['.', ':'])));
        }
    }
    out
}

/// Why two questions must not share an answer, if they must not.
pub fn guard(a: &str, b: &str) -> Result<(), &'static str> {
    let (wa, wb) = (words(a), words(b));
    let negations = |w: &[String]| w.iter().filter(|x| NEGATIONS.contains(&x.as_str())).count();
    if negations(&wa) % 2 != negations(&wb) % 2 {
        return Err("negation");
    }
    for (x, y) in ANTONYMS {
        let has = |w: &[String], t: &str| w.iter().any(|v| v == t);
        if (has(&wa, x) && has(&wb, y) && !has(&wa, y))
            || (has(&wa, y) && has(&wb, x) && !has(&wa, x))
        {
            return Err("antonym");
        }
    }
    let (shorter, longer) = (wa.len().min(wb.len()), wa.len().max(wb.len()));
    if longer as f32 > shorter as f32 * MAX_LENGTH_RATIO {
        return Err("length");
    }
    let persons = |w: &[String]| -> Vec<u8> {
        let mut found: Vec<u8> = w
            .iter()
            .filter_map(|x| PERSONS.iter().find(|(p, _)| p == x).map(|(_, n)| *n))
            .collect();
        found.sort_unstable();
        found.dedup();
        found
    };
    if persons(&wa) != persons(&wb) {
        return Err("person");
    }
    let asks = |w: &[String]| -> Vec<&str> {
        let mut kinds: Vec<&str> = w
            .iter()
            .filter_map(|x| QUESTION_WORDS.iter().find(|(q, _)| q == x).map(|(_, k)| *k))
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        kinds
    };
    if asks(&wa) != asks(&wb) {
        return Err("question");
    }
    // "Who was the CEO" is not "who is the CEO": a question in the past asks about the past.
    let past = |w: &[String]| w.iter().any(|x| PAST.contains(&x.as_str()));
    if past(&wa) != past(&wb) {
        return Err("tense");
    }
    let numbers = |w: &[String]| -> Vec<String> {
        w.iter()
            .filter(|x| x.chars().any(|c| c.is_ascii_digit()))
            .cloned()
            .collect()
    };
    if numbers(&wa) != numbers(&wb) {
        return Err("number");
    }
    if distinctive(a) != distinctive(b) {
        return Err("distinctive");
    }
    // The same content words, in the same order ("girls like guys" ≠ "guys like girls").
    let content = |w: &[String]| -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for word in w
            .iter()
            .filter(|x| !is_stop_word(x) && !SOFT_WORDS.contains(&x.as_str()))
            .map(|x| synonym(&stem(x)))
            .filter(|x| !SOFT_WORDS.contains(&x.as_str()))
        {
            if !out.contains(&word) {
                out.push(word);
            }
        }
        out
    };
    if content(&wa) != content(&wb) {
        return Err("content");
    }
    // Every word but the neutral ones, as sets: a qualifier, modifier, comparative, superlative
    // or relation word in one question only ("best and worst" ≠ "worst", "over-excitation" ≠
    // "excitation"), or any quoted word, blocks the hit.
    if meaning(a, &wa) != meaning(b, &wb) {
        return Err("words");
    }
    Ok(())
}

/// What a question says, as a set: its stemmed words but the neutral ones, pronouns and
/// question words (their guards compare them), and every word in quotes.
fn meaning(text: &str, words: &[String]) -> BTreeSet<String> {
    let guarded = |w: &str| {
        NEUTRAL.contains(&w)
            || PERSONS.iter().any(|(p, _)| *p == w)
            || QUESTION_WORDS.iter().any(|(q, _)| *q == w)
    };
    let mut set: BTreeSet<String> = words
        .iter()
        .filter(|w| !guarded(w))
        .map(|w| synonym(&stem(w)))
        .collect();
    set.extend(quoted(text).iter().map(|w| stem(w)));
    set
}

fn synonym(word: &str) -> String {
    SYNONYMS
        .iter()
        .find(|(w, _)| *w == word)
        .map_or_else(|| word.to_owned(), |(_, same)| (*same).to_owned())
}

/// The words inside quotes ("…", '…', “…”, ‘…’), folded.
fn quoted(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let mut inside: Option<char> = None;
    let mut current = String::new();
    for (i, &c) in chars.iter().enumerate() {
        // An apostrophe within a word ("don't", "John's") neither opens nor closes a quote.
        let before = i.checked_sub(1).and_then(|j| chars.get(j));
        let after = chars.get(i + 1);
        let in_word = before.is_some_and(|b| b.is_alphanumeric())
            && after.is_some_and(|a| a.is_alphanumeric());
        let close = match inside {
            Some('“') => '”',
            Some('‘') => '’',
            Some(open) => open,
            None => '\0',
        };
        match inside {
            None if matches!(c, '"' | '“') => inside = Some(c),
            None if matches!(c, '\'' | '‘') && !before.is_some_and(|b| b.is_alphanumeric()) => {
                inside = Some(c)
            }
            Some(_) if c == close && !in_word => {
                out.extend(words(&current));
                current.clear();
                inside = None;
            }
            Some(_) => current.push(c),
            None => {}
        }
    }
    out
}

/// Whether `b` may be answered with `a`'s answer.
pub fn is_duplicate(a: &str, b: &str, threshold: f32) -> bool {
    cosine(&embed(a), &embed(b)) >= threshold && guard(a, b).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_in_one_question_only_blocks_the_hit() {
        for (a, b) in [
            // A qualifier added or dropped.
            (
                "What are the best and worst jobs in finance?",
                "What are the worst jobs in finance?",
            ),
            (
                "What causes over-excitation of neurons?",
                "What causes excitation of neurons?",
            ),
            // A function word that is what the question is about.
            (
                "What is the difference between to and for?",
                "What is the difference between to and into?",
            ),
            // Another relation.
            (
                "Is Python good before learning Java?",
                "Can Python be as good as Java?",
            ),
            // A quoted word, even a neutral one.
            (
                "When do I use 'the' in a title?",
                "When do I use 'a' in a title?",
            ),
            // A modal that asks something else.
            ("Can someone read my palm?", "Could someone read my palm?"),
        ] {
            let said = |q: &str| meaning(q, &words(q));
            assert_ne!(said(a), said(b), "{a} | {b}");
            assert!(guard(a, b).is_err(), "{a} | {b}");
        }
    }

    #[test]
    fn auxiliaries_greetings_and_contractions_do_not() {
        for (a, b) in [
            (
                "How do I cancel a table reservation?",
                "How can I cancel a table reservation?",
            ),
            ("What is the minimum order?", "What's the minimum order?"),
            (
                "How do I fix a dripping tap?",
                "Hi, so how do I fix a dripping tap?",
            ),
            (
                "What is the definition of civil engineering?",
                "What is the meaning of civil engineering?",
            ),
        ] {
            assert_eq!(guard(a, b), Ok(()), "{a} | {b}: {:?}", guard(a, b));
        }
        assert_eq!(
            quoted("Use \"don't\" or ‘never’, it's fine"),
            ["dont", "never"]
        );
    }

    #[test]
    fn vectors_of_any_length_survive_encoding() {
        // Like a 1,536-dimension model embedding: small components everywhere.
        let vector: Vec<f32> = (0..1536)
            .map(|i| ((i * 7919 % 201) as f32 - 100.0) / 4000.0)
            .collect();
        let decoded = decode(&encode(&vector)).unwrap();
        assert_eq!(decoded.len(), 1536);
        assert!(cosine(&vector, &decoded) > 0.999);
        assert_eq!(cosine(&vector, &embed("a question")), 0.0);
        assert_eq!(decode(""), None);
    }

    #[test]
    fn paraphrases_match_and_guards_refuse_look_alikes() {
        assert!(is_duplicate(
            "How do I reset my password?",
            "how do I reset my password",
            0.85
        ));
        assert!(
            cosine(
                &embed("How do I reset my password?"),
                &embed("How can I reset my password?")
            ) > 0.85
        );
        assert_eq!(
            guard("Turn on dark mode", "Turn off dark mode"),
            Err("antonym")
        );
        assert_eq!(
            guard("Show invoice 1043", "Show invoice 1044"),
            Err("number")
        );
        assert_eq!(guard("Can I cancel?", "Can't I cancel?"), Err("negation"));
        assert_eq!(
            guard(
                "Flights from Paris to London",
                "Flights from London to Paris"
            ),
            Err("distinctive")
        );
        assert!(!is_duplicate(
            "What is Rust?",
            "What is the capital of France?",
            0.85
        ));
        assert_eq!(guard("Who is Ada?", "Where is Ada?"), Err("question"));
        assert_eq!(
            guard("Is a good book on design cheap?", "Is a good book cheap?"),
            Err("content")
        );
        assert_eq!(
            guard("Do guys like girls?", "Do girls like guys?"),
            Err("content")
        );
        assert_eq!(
            guard("Learn C++ first?", "Learn C# first?"),
            Err("distinctive")
        );
        assert!(
            guard(
                "How can I reset my password?",
                "How do I reset my password?"
            )
            .is_ok()
        );
        assert_eq!(guard("What is kiss?", "What is in a kiss?"), Err("length"));
        assert_eq!(
            guard(
                "What are your favorite smells?",
                "What are favorite smells?"
            ),
            Err("person")
        );
        assert_eq!(
            guard(
                "Which university should I apply to?",
                "Which university can I apply to?"
            ),
            Err("antonym")
        );
    }
}
