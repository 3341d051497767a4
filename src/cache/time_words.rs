//! Time-dependent questions (never cached): "what time is it", "latest news", "¿qué hay hoy?".

use crate::pipeline::text::normalize;

/// English and Spanish words and phrases, folded (lowercase, no accents).
pub const DEFAULT: &[&str] = &[
    "now",
    "right now",
    "today",
    "tonight",
    "tomorrow",
    "yesterday",
    "currently",
    "current",
    "latest",
    "recent",
    "recently",
    "this week",
    "this month",
    "this year",
    "what time",
    "what day",
    "what date",
    "at the moment",
    "up to date",
    "news",
    "live",
    "ahora",
    "hoy",
    "manana",
    "ayer",
    "actual",
    "actualmente",
    "recien",
    "ultimo",
    "ultima",
    "ultimos",
    "ultimas",
    "esta semana",
    "este mes",
    "este ano",
    "que hora",
    "que dia",
    "que fecha",
    "en este momento",
    "noticias",
];

/// The folded words of a text (letters and digits; no stop-word removal: "now" counts).
fn words(text: &str) -> Vec<String> {
    normalize(text)
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Whether `text` contains one of `phrases` as whole words.
pub fn is_time_dependent(text: &str, phrases: &[String]) -> bool {
    let words = words(text);
    phrases.iter().any(|phrase| {
        let phrase = words_of(phrase);
        !phrase.is_empty() && words.windows(phrase.len()).any(|w| w == phrase.as_slice())
    })
}

fn words_of(phrase: &str) -> Vec<String> {
    words(phrase)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Vec<String> {
        DEFAULT.iter().map(|w| (*w).to_owned()).collect()
    }

    #[test]
    fn time_words_match_whole_words_in_both_languages() {
        let words = defaults();
        assert!(is_time_dependent("What time is it in Tokyo?", &words));
        assert!(is_time_dependent("¿Qué pasó HOY en la bolsa?", &words));
        assert!(is_time_dependent("Dame las últimas noticias", &words));
        assert!(!is_time_dependent(
            "Explain how nowcasting differs from forecasting",
            &words
        ));
        assert!(!is_time_dependent("What is the capital of France?", &words));
    }
}
