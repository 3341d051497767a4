//! The guards' decisions on a whole Responses API answer (a Response object), as `json` makes
//! them on a chat completion: is it one text answer, was it cut at `max_output_tokens`, does it
//! claim an action without a call, and how a continued part or a retry is taken in.
//!
//! A text answer is a Response whose output is one `message` item, with `reasoning` items
//! before it at most: any call (a function's, a hosted tool's) makes it an answer that acts.

use serde_json::{Map, Value, json};

use super::claims::claimed_action;
use super::continuation::{merge, sum_usage};
use super::json::Appended;

fn output(response: &Value) -> &[Value] {
    response
        .get("output")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn item_type(item: &Value) -> Option<&str> {
    item.get("type").and_then(Value::as_str)
}

/// The index of the one `message` item of a text answer.
fn message_index(response: &Value) -> Option<usize> {
    let items = output(response);
    let mut message = None;
    for (k, item) in items.iter().enumerate() {
        match item_type(item) {
            Some("reasoning") => {}
            Some("message") if message.is_none() => message = Some(k),
            _ => return None,
        }
    }
    message
}

/// The text of a text answer: its message's `output_text` parts, in order.
pub fn text_answer(response: &Value) -> Option<String> {
    let message = &output(response)[message_index(response)?];
    let parts = message.get("content")?.as_array()?;
    let mut text = String::new();
    for part in parts {
        match item_type(part) {
            Some("output_text") => text.push_str(part.get("text")?.as_str()?),
            // A refusal is not text to continue or to check.
            _ => return None,
        }
    }
    Some(text)
}

/// Whether the Response stopped at its output limit.
fn stopped_at_limit(response: &Value) -> bool {
    response.get("status").and_then(Value::as_str) == Some("incomplete")
        && response
            .pointer("/incomplete_details/reason")
            .and_then(Value::as_str)
            == Some("max_output_tokens")
}

/// Whether the answer is one text answer cut at `max_output_tokens` (a Response cut while it
/// was still reasoning has no text to continue).
pub fn is_cut(response: &Value) -> bool {
    stopped_at_limit(response) && text_answer(response).is_some()
}

/// `sent` (a Responses body) with `added` items after its input; a string `input` becomes the
/// user message it stands for.
pub fn with_input_items(sent: &[u8], added: impl IntoIterator<Item = Value>) -> Option<Vec<u8>> {
    let mut body: Map<String, Value> = serde_json::from_slice(sent).ok()?;
    let input = body.entry("input").or_insert_with(|| json!([]));
    if let Value::String(text) = input {
        *input = json!([{"role": "user", "content": std::mem::take(text)}]);
    }
    input.as_array_mut()?.extend(added);
    serde_json::to_vec(&body).ok()
}

/// The request for the rest of a text answer to `sent`: the answer so far as an assistant
/// message, then `instruction` as a user message.
pub fn continuation_request(response: &Value, sent: &[u8], instruction: &str) -> Option<Vec<u8>> {
    let said = text_answer(response)?;
    with_input_items(
        sent,
        [
            json!({"role": "assistant", "content": said}),
            json!({"role": "user", "content": instruction}),
        ],
    )
}

/// The request for a retry after an action claimed without a call: `sent` with `tools` (the
/// client's own, when given), the claim, and `note` as a system message.
pub fn retry_request(
    sent: &[u8],
    claim: &str,
    note: &str,
    tools: Option<&Value>,
) -> Option<Vec<u8>> {
    let body = match tools {
        Some(tools) => {
            let mut body: Map<String, Value> = serde_json::from_slice(sent).ok()?;
            body.insert("tools".into(), tools.clone());
            serde_json::to_vec(&body).ok()?
        }
        None => sent.to_vec(),
    };
    with_input_items(
        &body,
        [
            json!({"role": "assistant", "content": claim}),
            json!({"role": "system", "content": note}),
        ],
    )
}

/// Merges `next`, the answer's next part, into `response`: its text (without what it repeats)
/// into the message's last text part, its status, and the usage of both. The merged Response
/// takes `next`'s id: that stored Response holds the whole answer in its history, so a client
/// that chains on it goes on from all of it. `next`'s reasoning items are left out (they would
/// stand before no item of their own).
pub fn append(response: &mut Value, next: &Value) -> Appended {
    // A part cut while it was still reasoning said nothing yet: asked again, it may.
    let reasoned_only = || {
        let only_reasoning = output(next)
            .iter()
            .all(|item| item_type(item) == Some("reasoning"));
        (stopped_at_limit(next) && only_reasoning).then(String::new)
    };
    let (Some(said), Some(text), Some(at)) = (
        text_answer(response),
        text_answer(next).or_else(reasoned_only),
        message_index(response),
    ) else {
        return Appended::NotText;
    };
    let merged = merge(&said, &text);
    let cut_again = stopped_at_limit(next);
    let usage = match (response.get("usage"), next.get("usage")) {
        (Some(first), Some(second)) => Some(sum_usage(first, second)),
        _ => None,
    };
    let next_message = message_index(next).map(|k| &output(next)[k]);
    if let Some(message) = response
        .get_mut("output")
        .and_then(|o| o.get_mut(at))
        .and_then(Value::as_object_mut)
    {
        if let Some(status) = next_message.and_then(|m| m.get("status")) {
            message.insert("status".into(), status.clone());
        }
        set_text(message, &merged);
    }
    let Some(object) = response.as_object_mut() else {
        return Appended::NotText;
    };
    for key in ["id", "status", "incomplete_details"] {
        if let Some(value) = next.get(key) {
            object.insert(key.into(), value.clone());
        }
    }
    if let Some(usage) = usage {
        object.insert("usage".into(), usage);
    }
    // A convenience field some servers add; kept equal to the text.
    if let Some(Value::String(text)) = object.get_mut("output_text") {
        *text = merged;
    }
    if cut_again {
        Appended::CutAgain
    } else {
        Appended::Finished
    }
}

/// A message's text parts as one: the whole text in the last, the others emptied (the merge
/// runs over their concatenation).
fn set_text(message: &mut Map<String, Value>, merged: &str) {
    let Some(parts) = message.get_mut("content").and_then(Value::as_array_mut) else {
        return;
    };
    let last = parts.len().saturating_sub(1);
    for (k, part) in parts.iter_mut().enumerate() {
        if let Some(part) = part.as_object_mut() {
            let text = if k == last { merged } else { "" };
            part.insert("text".into(), Value::String(text.to_owned()));
        }
    }
}

/// The text of a finished text answer that claims an action (it calls nothing).
pub fn claim(response: &Value, patterns: &[String]) -> Option<String> {
    let text = text_answer(response)?;
    claimed_action(&text, patterns)?;
    Some(text)
}

/// Whether a retry repaired the answer: it calls a function (or a custom tool).
pub fn calls_a_tool(retry: &Value) -> bool {
    output(retry)
        .iter()
        .any(|item| matches!(item_type(item), Some("function_call" | "custom_tool_call")))
}

/// The retry that repaired `response`, as the answer, with the usage of both calls.
pub fn repaired(response: &Value, mut retry: Value) -> Value {
    if let (Some(first), Some(second), Some(object)) = (
        response.get("usage"),
        retry.get("usage").cloned(),
        retry.as_object_mut(),
    ) {
        object.insert("usage".into(), sum_usage(first, &second));
    }
    retry
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(id: &str, text: &str, cut: bool, output_tokens: u64) -> Value {
        let (status, details) = if cut {
            ("incomplete", json!({"reason": "max_output_tokens"}))
        } else {
            ("completed", Value::Null)
        };
        json!({"id": id, "object": "response", "status": status,
            "incomplete_details": details,
            "output": [
                {"type": "reasoning", "id": format!("rs_{id}"), "summary": [],
                    "encrypted_content": "opaque"},
                {"type": "message", "id": format!("msg_{id}"), "role": "assistant",
                    "status": status,
                    "content": [{"type": "output_text", "annotations": [], "text": text}]}],
            "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 2},
                "total_tokens": 10 + output_tokens}})
    }

    fn call(id: &str) -> Value {
        json!({"id": id, "object": "response", "status": "completed",
            "output": [{"type": "function_call", "id": "fc_1", "call_id": "call_1",
                "name": "book", "arguments": "{}", "status": "completed"}],
            "usage": {"input_tokens": 20, "output_tokens": 4, "total_tokens": 24}})
    }

    #[test]
    fn only_one_message_after_reasoning_is_a_text_answer() {
        let cut = response("r1", "The quick", true, 3);
        assert_eq!(text_answer(&cut).as_deref(), Some("The quick"));
        assert!(is_cut(&cut));
        assert!(!is_cut(&response("r1", "Done.", false, 3)));
        assert_eq!(text_answer(&call("r2")), None);
        let mut two = cut.clone();
        let message = two["output"][1].clone();
        two["output"].as_array_mut().unwrap().push(message);
        assert_eq!(text_answer(&two), None);
        // Cut while reasoning: no message, nothing to continue.
        let mut reasoning_only = cut.clone();
        reasoning_only["output"].as_array_mut().unwrap().pop();
        assert!(!is_cut(&reasoning_only));
        let mut refusal = cut.clone();
        refusal["output"][1]["content"] = json!([{"type": "refusal", "refusal": "No."}]);
        assert!(!is_cut(&refusal));
        // Cut for another reason (a content filter) is not continued.
        let mut filtered = cut;
        filtered["incomplete_details"]["reason"] = json!("content_filter");
        assert!(!is_cut(&filtered));
    }

    #[test]
    fn a_continuation_appends_the_answer_and_the_instruction_to_the_input() {
        let cut = response("r1", "The quick", true, 3);
        let sent = br#"{"model":"gpt-5","input":"Tell me a story.","store":false,"x":1}"#;
        let body = continuation_request(&cut, sent, "Go on.").unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body["input"],
            json!([{"role": "user", "content": "Tell me a story."},
                {"role": "assistant", "content": "The quick"},
                {"role": "user", "content": "Go on."}])
        );
        assert_eq!(
            (body["store"].clone(), body["x"].clone()),
            (json!(false), json!(1))
        );
        let keys: Vec<&String> = body.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            ["model", "input", "store", "x"],
            "the client's field order"
        );

        let items =
            br#"{"model":"gpt-5","input":[{"type":"message","role":"user","content":"Hi"}]}"#;
        let body: Value =
            serde_json::from_slice(&continuation_request(&cut, items, "Go on.").unwrap()).unwrap();
        assert_eq!(body["input"].as_array().unwrap().len(), 3);
        assert_eq!(continuation_request(&call("r2"), items, "Go on."), None);
    }

    #[test]
    fn a_continued_part_is_merged_into_the_message_without_its_repeat() {
        let mut answer = response("r1", "The quick brown", true, 3);
        let next = response("r2", "brown fox jumps.", false, 4);
        assert_eq!(append(&mut answer, &next), Appended::Finished);
        assert_eq!(
            text_answer(&answer).as_deref(),
            Some("The quick brown fox jumps.")
        );
        assert_eq!(
            answer["id"], "r2",
            "the Response that holds the whole answer"
        );
        assert_eq!(answer["status"], "completed");
        assert_eq!(answer["incomplete_details"], Value::Null);
        assert_eq!(answer["output"][1]["status"], "completed");
        assert_eq!(
            answer["output"][1]["id"], "msg_r1",
            "the client's message item"
        );
        assert_eq!(
            answer["output"].as_array().unwrap().len(),
            2,
            "one reasoning item"
        );
        assert_eq!(answer["usage"]["output_tokens"], 7);
        assert_eq!(
            answer["usage"]["output_tokens_details"]["reasoning_tokens"],
            4
        );
        assert_eq!(answer["usage"]["total_tokens"], 27);

        let mut answer = response("r1", "One", true, 1);
        assert_eq!(
            append(&mut answer, &response("r2", " two", true, 1)),
            Appended::CutAgain
        );
        assert_eq!(answer["status"], "incomplete");
        assert_eq!(append(&mut answer, &call("r3")), Appended::NotText);
        assert_eq!(text_answer(&answer).as_deref(), Some("One two"));
        // A part cut while reasoning adds nothing and is asked again.
        let mut reasoning_only = response("r4", "", true, 2);
        reasoning_only["output"].as_array_mut().unwrap().pop();
        assert_eq!(append(&mut answer, &reasoning_only), Appended::CutAgain);
        assert_eq!(text_answer(&answer).as_deref(), Some("One two"));
    }

    #[test]
    fn a_claim_is_repaired_by_a_retry_that_calls_a_tool() {
        let patterns = crate::guards::ActionCheckConfig::default().patterns;
        let claimed = response("r1", "I've booked your flight.", false, 5);
        assert_eq!(
            claim(&claimed, &patterns).as_deref(),
            Some("I've booked your flight.")
        );
        assert_eq!(
            claim(&response("r1", "Which date?", false, 2), &patterns),
            None
        );
        assert_eq!(claim(&call("r2"), &patterns), None);
        assert!(calls_a_tool(&call("r2")) && !calls_a_tool(&claimed));

        let body = retry_request(
            br#"{"model":"gpt-5","input":"Book it.","tools":[]}"#,
            "I've booked it.",
            "Call the tool.",
            Some(&json!([{"type": "function", "name": "book"}])),
        )
        .unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["tools"][0]["name"], "book");
        assert_eq!(
            body["input"][2],
            json!({"role": "system", "content": "Call the tool."})
        );

        let fixed = repaired(&claimed, call("r2"));
        assert_eq!(fixed["id"], "r2");
        assert_eq!(fixed["usage"]["output_tokens"], 9);
    }
}
