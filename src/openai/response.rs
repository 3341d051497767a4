//! Non-streaming chat completion response.

use serde::{Deserialize, Serialize};

use super::{Extra, Message, Nullable};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: i64,
    pub model: String,
    pub choices: Vec<Choice>,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub usage: Nullable<Usage>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    pub index: u32,
    pub message: Message,
    #[serde(default, skip_serializing_if = "Nullable::is_absent")]
    pub finish_reason: Nullable<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Token usage as the upstream reports it; details (`prompt_tokens_details`…) stay in `extra`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    #[serde(flatten)]
    pub extra: Extra,
}
