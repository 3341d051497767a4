//! `POST /v1/embeddings` of the mock: deterministic unit vectors derived from each input's
//! SHA-256 (or, for models named `mock-lexical*`, ctxproxy's lexical embedding, so that
//! paraphrases are near), as floats or as base64 (the official SDKs ask for base64 by default).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{MockState, common_prelude, error_response};

const DEFAULT_DIMENSIONS: usize = 16;

pub(super) async fn embeddings(
    State(state): State<MockState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(response) = common_prelude(&state, &headers).await {
        return response;
    }
    state.stats.bump(&state.stats.embeddings_requests);
    // Fails only this endpoint (the chat call of the same client keeps working).
    if let Some(status) = headers
        .get("x-mock-embeddings-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u16>().ok())
        .and_then(|v| StatusCode::from_u16(v).ok())
        .filter(|s| !s.is_success())
    {
        return error_response(status, "mock embeddings failure", "mock_embeddings_failure");
    }
    let request: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string(), "invalid_json"),
    };
    let inputs: Vec<String> = match request.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| i.as_str().map_or_else(|| i.to_string(), str::to_owned))
            .collect(),
        _ => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "'input' is required",
                "invalid_value",
            );
        }
    };
    let dimensions = request
        .get("dimensions")
        .and_then(Value::as_u64)
        .map_or(DEFAULT_DIMENSIONS, |d| d.clamp(1, 4096) as usize);
    let lexical = request
        .get("model")
        .and_then(Value::as_str)
        .is_some_and(|m| m.starts_with("mock-lexical"));
    let base64 = request.get("encoding_format").and_then(Value::as_str) == Some("base64");
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            // `mock-lexical*`: ctxproxy's lexical embedding, so paraphrases are near.
            let vector = if lexical {
                crate::cache::dedup::embed(input)
            } else {
                vector_for(input, dimensions)
            };
            let embedding = if base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|f| f.to_le_bytes()).collect();
                json!(encode_base64(&bytes))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let tokens: usize = inputs
        .iter()
        .map(|i| i.split_whitespace().count().max(1))
        .sum();
    let model = request
        .get("model")
        .cloned()
        .unwrap_or(json!("mock-embedding"));
    axum::Json(json!({
        "object": "list", "data": data, "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response()
}

/// A unit vector from the input's hash (SHA-256 in counter mode).
pub fn vector_for(input: &str, dimensions: usize) -> Vec<f32> {
    let mut values = Vec::with_capacity(dimensions);
    let mut counter: u32 = 0;
    while values.len() < dimensions {
        let digest = Sha256::new()
            .chain_update(counter.to_le_bytes())
            .chain_update(input.as_bytes())
            .finalize();
        for pair in digest.chunks(2) {
            if values.len() < dimensions {
                let raw = u16::from_le_bytes([pair[0], pair[1]]);
                values.push(f32::from(raw) / 32767.5 - 1.0);
            }
        }
        counter += 1;
    }
    let norm = values
        .iter()
        .map(|v| v * v)
        .sum::<f32>()
        .sqrt()
        .max(f32::EPSILON);
    values.iter().map(|v| v / norm).collect()
}

pub(super) fn encode_base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_are_deterministic_unit_vectors() {
        let v = vector_for("hello", 8);
        assert_eq!(v, vector_for("hello", 8));
        assert_ne!(v, vector_for("hello!", 8));
        let norm: f32 = v.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-4);
    }

    #[test]
    fn base64_matches_the_rfc_examples() {
        assert_eq!(encode_base64(b"f"), "Zg==");
        assert_eq!(encode_base64(b"fo"), "Zm8=");
        assert_eq!(encode_base64(b"foo"), "Zm9v");
        assert_eq!(encode_base64(b"foobar"), "Zm9vYmFy");
    }
}
