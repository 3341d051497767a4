//! Continuing an answer cut at the length limit: the request that asks for the rest, and the
//! seamless merge of the parts (an overlap the model repeats is dropped, usage is summed).

use serde_json::{Map, Value, json};

/// The longest repeat looked for, in bytes of the part said so far.
const MAX_OVERLAP: usize = 2_000;
/// A shorter repeat is taken for a coincidence, unless it is all of what was said.
const MIN_OVERLAP: usize = 4;
/// A repeat at least this long may start inside a word (a model repeats tokens, not words);
/// a shorter one must start at a word.
const MID_WORD_OVERLAP: usize = 6;

/// The request for the next part: the request sent, then the answer so far as an assistant
/// message and `instruction` as a user message.
pub fn continuation_body(sent: &[u8], said: &str, instruction: &str) -> Option<Vec<u8>> {
    with_messages(
        sent,
        [
            json!({"role": "assistant", "content": said}),
            json!({"role": "user", "content": instruction}),
        ],
    )
}

/// The request for a retry after an action claimed without a tool call: the request sent with
/// every tool the client offered (the filter may have left out the one needed), the claim, and
/// `note` as a system message.
pub fn retry_body(sent: &[u8], claim: &str, note: &str, tools: Option<&Value>) -> Option<Vec<u8>> {
    let mut body: Value = serde_json::from_slice(sent).ok()?;
    if let (Some(tools), Some(object)) = (tools, body.as_object_mut()) {
        object.insert("tools".into(), tools.clone());
    }
    add_messages(
        body,
        [
            json!({"role": "assistant", "content": claim}),
            json!({"role": "system", "content": note}),
        ],
    )
}

fn with_messages(sent: &[u8], added: [Value; 2]) -> Option<Vec<u8>> {
    add_messages(serde_json::from_slice(sent).ok()?, added)
}

fn add_messages(mut body: Value, added: [Value; 2]) -> Option<Vec<u8>> {
    body.get_mut("messages")?.as_array_mut()?.extend(added);
    serde_json::to_vec(&body).ok()
}

/// How many leading bytes of `next` repeat the end of `said` (0 when none does).
pub fn overlap(said: &str, next: &str) -> usize {
    let longest = next.len().min(said.len()).min(MAX_OVERLAP);
    (1..=longest)
        .rev()
        .filter(|&k| next.is_char_boundary(k) && said.is_char_boundary(said.len() - k))
        .filter(|&k| said.ends_with(&next[..k]))
        .find(|&k| {
            let start = said.len() - k;
            let at_word_start = start == 0
                || said[..start]
                    .chars()
                    .next_back()
                    .is_some_and(|c| !c.is_alphanumeric())
                || !next[..k].starts_with(char::is_alphanumeric);
            (k >= MIN_OVERLAP || k == said.len()) && (at_word_start || k >= MID_WORD_OVERLAP)
        })
        .unwrap_or(0)
}

/// Whether `start`, the beginning of the next part, may still grow into a repeat of the end of
/// `said` (a stream holds it back until it knows).
pub fn may_overlap(said: &str, start: &str) -> bool {
    let from = said.len().saturating_sub(MAX_OVERLAP);
    let from = (from..said.len())
        .find(|&i| said.is_char_boundary(i))
        .unwrap_or(said.len());
    let tail = &said[from..];
    !start.is_empty()
        && tail
            .match_indices(start)
            .any(|(i, _)| i + start.len() < tail.len())
}

/// `said` followed by `next` without the part of `next` that repeats it.
pub fn merge(said: &str, next: &str) -> String {
    format!("{said}{}", &next[overlap(said, next)..])
}

/// Two `usage` objects added field by field (nested details too).
pub fn sum_usage(a: &Value, b: &Value) -> Value {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            let mut out = Map::new();
            for key in a.keys().chain(b.keys()) {
                if out.contains_key(key) {
                    continue;
                }
                let sum = match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => sum_usage(x, y),
                    (Some(x), None) | (None, Some(x)) => x.clone(),
                    (None, None) => Value::Null,
                };
                out.insert(key.clone(), sum);
            }
            Value::Object(out)
        }
        (Value::Number(x), Value::Number(y)) => match (x.as_u64(), y.as_u64()) {
            (Some(x), Some(y)) => json!(x + y),
            _ => json!(x.as_f64().unwrap_or(0.0) + y.as_f64().unwrap_or(0.0)),
        },
        (Value::Null, other) | (other, Value::Null) => other.clone(),
        (a, _) => a.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_merged_without_a_seam() {
        assert_eq!(
            merge("The quick brown", " fox jumps."),
            "The quick brown fox jumps."
        );
        // The model repeated the last words.
        assert_eq!(
            merge("The quick brown", " brown fox."),
            "The quick brown fox."
        );
        assert_eq!(
            merge("Step 1: open the file.\nStep 2: ", "Step 2: save it."),
            "Step 1: open the file.\nStep 2: save it."
        );
        // A coincidence of a letter or two is not an overlap.
        assert_eq!(merge("It is a", "a test"), "It is aa test");
        assert_eq!(merge("see the", "theory"), "see thetheory");
        assert_eq!(merge("", "all new"), "all new");
        // A long repeat may start inside a word.
        assert_eq!(
            merge("and watched the", "tched the ships"),
            "and watched the ships"
        );
        assert_eq!(merge("a rest", "est of it"), "a restest of it");
        assert_eq!(merge("the stairs,", "tairs, lit"), "the stairs, lit");
        // Never cut inside a character.
        assert_eq!(merge("café", "x"), "caféx");
        assert_eq!(merge("está bien así", "así que sí"), "está bien así que sí");
        assert_eq!(merge("日本語の文", "の文章"), "日本語の文章");
        assert_eq!(merge("ünïcödé ", "ünïcödé rest"), "ünïcödé rest");
    }

    #[test]
    fn a_stream_holds_back_only_what_may_repeat() {
        let said = "We meet at the station at nine";
        assert!(may_overlap(said, " at the st"));
        assert!(!may_overlap(said, " at nine"), "a whole repeat: decide now");
        assert!(!may_overlap(said, " o'clock"));
        assert_eq!(overlap(said, " at nine o'clock"), " at nine".len());
    }

    #[test]
    fn requests_carry_the_partial_answer_and_usage_adds_up() {
        let sent = br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}"#;
        let body: Value =
            serde_json::from_slice(&continuation_body(sent, "Hello th", "Go on").unwrap()).unwrap();
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 3);
        assert_eq!(
            messages[1],
            json!({"role": "assistant", "content": "Hello th"})
        );
        assert_eq!(messages[2]["role"], "user");
        assert_eq!(body["max_tokens"], 5);
        let tools = json!([{"type": "function", "function": {"name": "create"}}]);
        let retry: Value = serde_json::from_slice(
            &retry_body(sent, "Done!", "Call the tool.", Some(&tools)).unwrap(),
        )
        .unwrap();
        assert_eq!(retry["messages"][2]["role"], "system");
        assert_eq!(retry["tools"], tools);
        assert_eq!(
            sum_usage(
                &json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                    "completion_tokens_details": {"reasoning_tokens": 1}}),
                &json!({"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27})
            ),
            json!({"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42,
                "completion_tokens_details": {"reasoning_tokens": 1}})
        );
    }
}
