//! Where a dedup answer may be reused (pure): only for a request with the same contract and
//! the same conversation before the question. Like the deterministic key, the scope is a
//! deny-list: the canonical request as sent, without the question itself and without the
//! fields that do not change what a right answer is, so a new or unknown field splits the scope
//! instead of colliding. `max_tokens` stays in it: an answer is reused only under the limit it
//! was given.

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::config::DedupScope;
use super::deterministic::canonical;

/// Fields that never change what a right answer is: sampling knobs and transport.
const IGNORED: &[&str] = &[
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "stream_options",
    "metadata",
];

/// Why a request may never get a dedup answer (only single-choice text answers are reused).
pub fn ineligible(request: &Value) -> Option<&'static str> {
    let field = |name: &str| request.get(name).filter(|v| !v.is_null());
    if field("n").and_then(Value::as_f64).is_some_and(|n| n != 1.0) {
        return Some("n");
    }
    if field("logprobs").is_some_and(|v| v != &Value::Bool(false))
        || field("top_logprobs").is_some()
    {
        return Some("logprobs");
    }
    let text_only = |modalities: &Value| {
        modalities
            .as_array()
            .is_some_and(|m| m.iter().all(|x| x.as_str() == Some("text")))
    };
    if field("audio").is_some() || field("modalities").is_some_and(|m| !text_only(m)) {
        return Some("modalities");
    }
    if field("prediction").is_some() {
        return Some("prediction");
    }
    None
}

/// The digest of `sent` (the request as it goes upstream) without its last message, the user's
/// question, and without the fields of [`IGNORED`] (and `user`, unless answers are shared per
/// user). `None` when the last message is not the user's.
pub fn scope_digest(sent: &Value, scope: DedupScope) -> Option<String> {
    let mut body = sent.clone();
    let fields = body.as_object_mut()?;
    let messages = fields.get_mut("messages")?.as_array_mut()?;
    let question = messages.pop()?;
    if question.get("role").and_then(Value::as_str) != Some("user") {
        return None;
    }
    for field in IGNORED {
        fields.remove(*field);
    }
    if scope == DedupScope::System {
        fields.remove("user");
    }
    Some(hex::encode(Sha256::digest(canonical(&body).as_bytes())))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn base() -> Value {
        json!({"model": "gpt-4o", "temperature": 0.7, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]})
    }

    fn with(field: &str, value: Value) -> Value {
        let mut body = base();
        body[field] = value;
        body
    }

    fn digest(body: &Value) -> String {
        scope_digest(body, DedupScope::System).unwrap_or_default()
    }

    #[test]
    fn every_field_that_changes_the_answer_splits_the_scope() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        for (field, value) in [
            ("response_format", json!({"type": "json_object"})),
            (
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            ),
            ("tools", tools.clone()),
            ("max_tokens", json!(5)),
            ("max_completion_tokens", json!(5)),
            ("reasoning_effort", json!("high")),
            ("model", json!("gpt-4.1")),
            ("seed", json!(7)),
            ("a_field_nobody_knows_yet", json!(true)),
        ] {
            assert_ne!(digest(&with(field, value)), digest(&base()), "{field}");
        }
        let mut choice = with("tools", tools);
        let offered = digest(&choice);
        choice["tool_choice"] = json!("none");
        assert_ne!(digest(&choice), offered, "tool_choice");
    }

    #[test]
    fn sampling_knobs_transport_and_the_question_do_not() {
        for (field, value) in [
            ("temperature", json!(0)),
            ("top_p", json!(0.5)),
            ("presence_penalty", json!(1)),
            ("frequency_penalty", json!(1)),
            ("stream", json!(true)),
            ("stream_options", json!({"include_usage": true})),
            ("metadata", json!({"run": "a"})),
            ("user", json!("ana")),
        ] {
            assert_eq!(digest(&with(field, value)), digest(&base()), "{field}");
        }
        let mut other = base();
        other["messages"][1]["content"] = json!("Which city is France's capital?");
        assert_eq!(digest(&other), digest(&base()));
        // Shared per user: the user splits it.
        let ana = scope_digest(&with("user", json!("ana")), DedupScope::User);
        assert_ne!(ana, scope_digest(&base(), DedupScope::User));
    }

    #[test]
    fn a_follow_up_is_scoped_by_the_turns_before_it() {
        let after = |city: &str| {
            json!({"model": "gpt-4o", "messages": [
                {"role": "user", "content": format!("Tell me about {city}.")},
                {"role": "assistant", "content": format!("{city} is a large city.")},
                {"role": "user", "content": "What is its population?"}]})
        };
        assert_ne!(digest(&after("Tokyo")), digest(&after("Paris")));
        assert_eq!(digest(&after("Tokyo")), digest(&after("Tokyo")));
        let first_turn = |question: &str| json!({"model": "gpt-4o", "messages": [{"role": "user", "content": question}]});
        assert_eq!(
            digest(&first_turn("How do I reset my password?")),
            digest(&first_turn("How can I reset my password?"))
        );
        let not_a_question =
            json!({"model": "m", "messages": [{"role": "assistant", "content": "Hi"}]});
        assert_eq!(scope_digest(&not_a_question, DedupScope::System), None);
    }

    #[test]
    fn only_single_choice_text_answers_are_reused() {
        assert_eq!(ineligible(&base()), None);
        assert_eq!(ineligible(&with("n", json!(1))), None);
        assert_eq!(ineligible(&with("logprobs", json!(false))), None);
        assert_eq!(ineligible(&with("modalities", json!(["text"]))), None);
        for (field, value, reason) in [
            ("n", json!(2), "n"),
            ("logprobs", json!(true), "logprobs"),
            ("top_logprobs", json!(3), "logprobs"),
            ("audio", json!({"voice": "alloy"}), "modalities"),
            ("modalities", json!(["text", "audio"]), "modalities"),
            ("prediction", json!({"type": "content"}), "prediction"),
        ] {
            assert_eq!(ineligible(&with(field, value)), Some(reason), "{field}");
        }
    }
}
