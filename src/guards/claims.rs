//! Does an answer claim an action ("I've created…", "listo")? Whole-word phrase matching over
//! folded text (case, accents and punctuation ignored).

use crate::pipeline::text::normalize;

/// How a flagged answer says so: a response header (or, in a stream, an SSE comment) with
/// [`ACTION_CLAIMED`] as its value.
pub const X_CTXPROXY_WARNING: &str = "x-ctxproxy-warning";
/// The header of an answer replaced by a retry that called a tool.
pub const X_CTXPROXY_REPAIRED: &str = "x-ctxproxy-repaired";
pub const ACTION_CLAIMED: &str = "action-claimed-without-tool-call";

fn words(text: &str) -> Vec<String> {
    normalize(text)
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The first pattern `text` contains, as a run of whole words.
pub fn claimed_action<'a>(text: &str, patterns: &'a [String]) -> Option<&'a str> {
    let text = words(text);
    patterns.iter().map(String::as_str).find(|pattern| {
        let pattern = words(pattern);
        !pattern.is_empty() && text.windows(pattern.len()).any(|w| w == pattern.as_slice())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guards::ActionCheckConfig;

    #[test]
    fn claims_in_english_and_spanish_are_found_as_whole_words() {
        let patterns = ActionCheckConfig::default().patterns;
        for text in [
            "Done! The meeting is on Friday.",
            "I've created the ticket ABC-12 for you.",
            "Your reservation has been cancelled.",
            "¡Listo! Ya quedó.",
            "He creado la nota «Ideas».",
            "La reserva ha sido CANCELADA con éxito",
        ] {
            assert!(claimed_action(text, &patterns).is_some(), "{text}");
        }
        for text in [
            "Which date should the meeting be on?",
            "I can create the ticket once you confirm the title.",
            "The doneness of the steak depends on the heat.",
            "¿Quieres que cree la nota?",
        ] {
            assert_eq!(claimed_action(text, &patterns), None, "{text}");
        }
    }
}
