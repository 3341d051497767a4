//! Vectors of questions for the dedup cache: the built-in lexical embedding, or the upstream's
//! `POST /embeddings` (`embedder = "upstream"`). A failed or slow call is an error the caller
//! counts; the question then goes to the model without the dedup cache.

use axum::http::{HeaderMap, HeaderValue, header};
use bytes::Bytes;
use serde_json::{Value, json};

use super::config::{DedupConfig, Embedder};
use super::dedup::embed;
use crate::metrics::Metrics;
use crate::upstream::{Upstream, apply_upstream_auth, end_to_end};

/// The largest embeddings answer read (a 3,072-dimension float vector is about 70 KB).
const MAX_ANSWER_BYTES: usize = 1024 * 1024;

/// What the vectors of a scope were made with: questions embedded differently never meet.
pub fn embedder_id(config: &DedupConfig) -> String {
    match config.embedder {
        Embedder::Lexical => "lexical".to_owned(),
        Embedder::Upstream => format!("upstream:{}", config.embedding_model),
    }
}

/// The vector of `question`. `client_headers` carry the client's credentials to an upstream
/// without a key of its own (as for its chat request).
pub async fn vector(
    config: &DedupConfig,
    question: &str,
    upstream: &Upstream,
    client_headers: &HeaderMap,
    proxy_auth: bool,
    metrics: &Metrics,
) -> Result<Vec<f32>, String> {
    if config.embedder == Embedder::Lexical {
        return Ok(embed(question));
    }
    let body = json!({"model": config.embedding_model, "input": question,
        "encoding_format": "float"});
    let mut headers = end_to_end(client_headers);
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::ACCEPT_ENCODING);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    apply_upstream_auth(&mut headers, &upstream.config, proxy_auth);
    let (status, answer) = upstream
        .call_json(
            "/embeddings",
            headers,
            Bytes::from(body.to_string()),
            MAX_ANSWER_BYTES,
            std::time::Duration::from_millis(config.embedding_timeout_ms),
            metrics,
        )
        .await
        .map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("the upstream answered {status}"));
    }
    parse_vector(&answer).ok_or_else(|| "the answer holds no embedding".to_owned())
}

/// `data[0].embedding` of an embeddings answer, as floats.
fn parse_vector(answer: &[u8]) -> Option<Vec<f32>> {
    let value: Value = serde_json::from_slice(answer).ok()?;
    let vector: Vec<f32> = value
        .pointer("/data/0/embedding")?
        .as_array()?
        .iter()
        .map(|x| x.as_f64().map(|f| f as f32))
        .collect::<Option<_>>()?;
    (!vector.is_empty()).then_some(vector)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeddings_answers_parse_or_are_refused() {
        let answer = br#"{"object":"list","data":[{"object":"embedding","index":0,
            "embedding":[0.5,-0.25,0.0]}],"model":"m"}"#;
        assert_eq!(parse_vector(answer), Some(vec![0.5, -0.25, 0.0]));
        for bad in [
            &br#"{"data":[]}"#[..],
            br#"{"data":[{"embedding":"AAAA"}]}"#,
            br#"{"data":[{"embedding":[]}]}"#,
            br#"{"data":[{"embedding":[1,"x"]}]}"#,
            b"not json",
        ] {
            assert_eq!(parse_vector(bad), None);
        }
        let mut config = DedupConfig::default();
        assert_eq!(embedder_id(&config), "lexical");
        config.embedder = Embedder::Upstream;
        assert_eq!(embedder_id(&config), "upstream:text-embedding-3-small");
    }
}
