//! The OpenAI error body: `{"error":{"message","type","param","code"}}`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorObject,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    /// Always serialized, as `null` when there is none (OpenAI does the same).
    pub param: Option<String>,
    pub code: Option<String>,
}
