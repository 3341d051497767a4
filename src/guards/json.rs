//! The guards' decisions on a whole JSON answer (`chat.completion`): is it one text answer, was
//! it cut at the length limit, does it claim an action without a tool call, and how a continued
//! part or a retry is taken in. The calls they lead to live in `server::guarded`.

use serde_json::Value;

use super::claims::claimed_action;
use super::continuation::{continuation_body, merge, sum_usage};

/// The choice of a single-choice answer.
pub fn only_choice(completion: &Value) -> Option<&Value> {
    match completion.get("choices")?.as_array()?.as_slice() {
        [choice] => Some(choice),
        _ => None,
    }
}

pub fn has_tool_calls(message: &Value) -> bool {
    message
        .get("tool_calls")
        .and_then(Value::as_array)
        .is_some_and(|calls| !calls.is_empty())
}

/// The text of a single-choice answer without tool calls, and its finish reason.
pub fn text_answer(completion: &Value) -> Option<(&str, &str)> {
    let choice = only_choice(completion)?;
    let message = choice.get("message").filter(|m| m.is_object())?;
    if has_tool_calls(message) {
        return None;
    }
    let text = message.get("content").and_then(Value::as_str).unwrap_or("");
    let finish = choice.get("finish_reason").and_then(Value::as_str)?;
    Some((text, finish))
}

/// Whether the answer is one text answer cut at the length limit.
pub fn is_cut(completion: &Value) -> bool {
    text_answer(completion).is_some_and(|(_, finish)| finish == "length")
}

/// The request for the rest of a text answer to `sent`.
pub fn continuation_request(completion: &Value, sent: &[u8], instruction: &str) -> Option<Vec<u8>> {
    let (said, _) = text_answer(completion)?;
    continuation_body(sent, said, instruction)
}

/// What taking in a continued part made of the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// The answer ends by itself now.
    Finished,
    /// Cut at the length limit again.
    CutAgain,
    /// The part (or the answer) is not a text answer: the answer is left as it was.
    NotText,
}

/// Merges the text of `next`, the answer's next part, into `completion` (without what it
/// repeats), with the part's finish reason and the usage of both.
pub fn append(completion: &mut Value, next: &Value) -> Appended {
    let (Some((said, _)), Some((text, finish))) = (text_answer(completion), text_answer(next))
    else {
        return Appended::NotText;
    };
    let merged = merge(said, text);
    let usage = match (completion.get("usage"), next.get("usage")) {
        (Some(first), Some(second)) => Some(sum_usage(first, second)),
        _ => None,
    };
    if let Some(choice) = first_choice(completion) {
        if let Some(message) = choice.get_mut("message").and_then(Value::as_object_mut) {
            message.insert("content".into(), Value::String(merged));
        }
        choice.insert("finish_reason".into(), Value::String(finish.to_owned()));
    }
    if let (Some(usage), Some(object)) = (usage, completion.as_object_mut()) {
        object.insert("usage".into(), usage);
    }
    if finish == "length" {
        Appended::CutAgain
    } else {
        Appended::Finished
    }
}

/// The text of a single text answer that claims an action (it calls no tool).
pub fn claim<'a>(completion: &'a Value, patterns: &[String]) -> Option<&'a str> {
    let (text, _) = text_answer(completion)?;
    claimed_action(text, patterns).map(|_| text)
}

/// Whether a retry repaired the answer: a single choice that calls a tool.
pub fn calls_a_tool(retry: &Value) -> bool {
    only_choice(retry)
        .and_then(|c| c.get("message"))
        .is_some_and(has_tool_calls)
}

/// The retry that repaired `completion`, as the answer, with the usage of both calls.
pub fn repaired(completion: &Value, mut retry: Value) -> Value {
    if let (Some(first), Some(second), Some(object)) = (
        completion.get("usage"),
        retry.get("usage").cloned(),
        retry.as_object_mut(),
    ) {
        object.insert("usage".into(), sum_usage(first, &second));
    }
    retry
}

fn first_choice(completion: &mut Value) -> Option<&mut serde_json::Map<String, Value>> {
    completion
        .get_mut("choices")?
        .as_array_mut()?
        .first_mut()?
        .as_object_mut()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guards::ActionCheckConfig;
    use serde_json::json;

    fn answer(content: &str, finish: &str, completion_tokens: u64) -> Value {
        json!({"id": "c1", "object": "chat.completion", "model": "gpt-4o",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": completion_tokens,
                "total_tokens": 10 + completion_tokens}})
    }

    fn tool_call_answer() -> Value {
        json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "t1", "type": "function",
                "function": {"name": "book", "arguments": "{}"}}]},
            "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24}})
    }

    #[test]
    fn only_a_single_text_choice_is_a_text_answer() {
        let cut = answer("The quick", "length", 2);
        assert_eq!(text_answer(&cut), Some(("The quick", "length")));
        assert!(is_cut(&cut));
        assert!(!is_cut(&answer("Hi.", "stop", 1)));
        assert_eq!(text_answer(&tool_call_answer()), None);
        let two = json!({"choices": [cut["choices"][0].clone(), cut["choices"][0].clone()]});
        assert_eq!(text_answer(&two), None);
        assert!(!is_cut(&two));
        assert_eq!(text_answer(&json!({"choices": "none"})), None);
    }

    #[test]
    fn a_continued_part_is_merged_in_without_its_repeat() {
        let mut completion = answer("The quick brown", "length", 3);
        let sent = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"Go"}]}"#;
        let request: Value =
            serde_json::from_slice(&continuation_request(&completion, sent, "Go on").unwrap())
                .unwrap();
        assert_eq!(
            request["messages"][1],
            json!({"role": "assistant", "content": "The quick brown"})
        );
        let next = answer(" brown fox", "length", 2);
        assert_eq!(append(&mut completion, &next), Appended::CutAgain);
        let last = answer(" jumps.", "stop", 2);
        assert_eq!(append(&mut completion, &last), Appended::Finished);
        assert_eq!(
            serde_json::to_string(&completion).unwrap(),
            r#"{"id":"c1","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"The quick brown fox jumps."},"finish_reason":"stop"}],"usage":{"prompt_tokens":30,"completion_tokens":7,"total_tokens":37}}"#
        );
    }

    #[test]
    fn a_part_that_is_not_text_leaves_the_answer_as_it_was() {
        let mut completion = answer("The quick brown", "length", 3);
        let before = completion.clone();
        assert_eq!(
            append(&mut completion, &tool_call_answer()),
            Appended::NotText
        );
        assert_eq!(completion, before);
        assert_eq!(
            continuation_request(&tool_call_answer(), b"{}", "Go on"),
            None
        );
    }

    #[test]
    fn a_claim_is_repaired_by_a_retry_that_calls_a_tool() {
        let patterns = ActionCheckConfig::default().patterns;
        let claimed = answer("Done! The meeting is booked.", "stop", 6);
        assert_eq!(
            claim(&claimed, &patterns),
            Some("Done! The meeting is booked.")
        );
        assert_eq!(claim(&answer("Which day?", "stop", 2), &patterns), None);
        assert_eq!(claim(&tool_call_answer(), &patterns), None);
        assert!(!calls_a_tool(&claimed));
        assert!(calls_a_tool(&tool_call_answer()));
        let answer = repaired(&claimed, tool_call_answer());
        assert_eq!(answer["choices"], tool_call_answer()["choices"]);
        assert_eq!(
            answer["usage"],
            json!({"prompt_tokens": 30, "completion_tokens": 10, "total_tokens": 40})
        );
    }
}
