//! Which conversation a request belongs to, always scoped by tenant: the `X-Conversation-Id`
//! header, else the request's `user` field, else a hash of the first system and first user
//! message (stable across the turns of one conversation).

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::openai::{ChatRequest, Message, Role};

pub const X_CONVERSATION_ID: &str = "x-conversation-id";

fn first_text(messages: &[Message], roles: &[Role]) -> String {
    messages
        .iter()
        .find(|m| roles.contains(&m.role))
        .and_then(|m| m.content.get())
        .map(|c| c.text().into_owned())
        .unwrap_or_default()
}

/// The `X-Conversation-Id` the client sent, if any.
pub fn client_conversation_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get(X_CONVERSATION_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

/// A hex SHA-256 naming the conversation of `chat` for `tenant` (a caller's scope).
pub fn conversation_id(tenant: &str, headers: &HeaderMap, chat: &ChatRequest) -> String {
    let mut hasher = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    field(tenant.as_bytes());
    let header = headers
        .get(X_CONVERSATION_ID)
        .map(|v| v.as_bytes())
        .filter(|v| !v.is_empty());
    let user = chat
        .extra
        .get("user")
        .and_then(|u| u.as_str())
        .filter(|u| !u.is_empty());
    if let Some(id) = header {
        field(b"header");
        field(id);
    } else if let Some(user) = user {
        field(b"user");
        field(user.as_bytes());
    } else {
        field(b"derived");
        field(first_text(&chat.messages, &[Role::System, Role::Developer]).as_bytes());
        field(first_text(&chat.messages, &[Role::User]).as_bytes());
    }
    hex::encode(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(value: serde_json::Value) -> ChatRequest {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn header_then_user_then_first_messages_scoped_by_tenant() {
        let first = chat(json!({"model": "m", "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}));
        let later = chat(json!({"model": "m", "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]}));
        let none = HeaderMap::new();
        let derived = conversation_id("t", &none, &first);
        assert_eq!(derived, conversation_id("t", &none, &later));
        assert_ne!(derived, conversation_id("other", &none, &first));

        let mut headers = HeaderMap::new();
        headers.insert(X_CONVERSATION_ID, "c-1".parse().unwrap());
        assert_ne!(conversation_id("t", &headers, &first), derived);
        assert_eq!(
            conversation_id("t", &headers, &first),
            conversation_id("t", &headers, &later)
        );
        let with_user = chat(json!({"model": "m", "user": "u-9", "messages": [
            {"role": "user", "content": "different"}]}));
        assert_ne!(conversation_id("t", &none, &with_user), derived);
    }
}
