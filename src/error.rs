//! The one error type of the request path, mapped once to an OpenAI-format HTTP response.
//!
//! Handlers return `Result<_, ProxyError>`; nothing else builds an error response.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use crate::openai::{ErrorBody, ErrorObject};

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(
        "We could not parse the JSON body of your request: {message} (line {line}, column {column})"
    )]
    MalformedJson {
        message: String,
        line: usize,
        column: usize,
    },
    #[error("Invalid value for '{field}': {message}")]
    InvalidField { field: String, message: String },
    #[error("Invalid request body: {0}")]
    InvalidBody(String),
    #[error("Invalid header {header}: {message}")]
    InvalidHeader {
        header: &'static str,
        message: String,
    },
    #[error(
        "The request needs {tokens_after} prompt tokens after every reduction (it had {tokens_before}), over the budget of {budget}. Shorten the conversation or the tool definitions, or raise the budget (X-Ctxproxy-Budget)."
    )]
    ContextBudgetExceeded {
        budget: usize,
        tokens_before: usize,
        tokens_after: usize,
    },
    #[error("The request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("The request body did not arrive in time (server.body_read_timeout_ms)")]
    BodyTimeout,
    #[error("Missing required parameter: '{field}'")]
    MissingField { field: String },
    #[error("Unknown route: {method} {path}")]
    RouteNotFound { method: String, path: String },
    #[error("{path} does not accept {method}")]
    MethodNotAllowed { method: String, path: String },
    #[error("{}", model_not_routed(model))]
    ModelNotRouted { model: String },
    #[error("Invalid or missing API key. Send a ctxproxy key as 'Authorization: Bearer <key>'.")]
    Unauthorized,
    #[error("The upstream '{upstream}' is unreachable: {reason}")]
    UpstreamUnreachable { upstream: String, reason: String },
    #[error("The upstream '{upstream}' did not answer within {timeout_ms} ms ({phase} timeout)")]
    UpstreamTimeout {
        upstream: String,
        phase: &'static str,
        timeout_ms: u128,
    },
    #[error("The upstream '{upstream}' stream was interrupted: {reason}")]
    UpstreamStreamInterrupted { upstream: String, reason: String },
    #[error("The upstream '{upstream}' sent an answer ctxproxy cannot read: {reason}")]
    UpstreamInvalidResponse { upstream: String, reason: String },
    #[error("ctxproxy is at its concurrency limit; retry later")]
    Overloaded,
    #[error("ctxproxy is shutting down")]
    ShuttingDown,
    #[error("Internal error: {0}")]
    Internal(String),
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::MalformedJson { .. }
            | ProxyError::InvalidField { .. }
            | ProxyError::MissingField { .. }
            | ProxyError::InvalidBody(_)
            | ProxyError::InvalidHeader { .. }
            | ProxyError::ContextBudgetExceeded { .. } => StatusCode::BAD_REQUEST,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ProxyError::RouteNotFound { .. } | ProxyError::ModelNotRouted { .. } => {
                StatusCode::NOT_FOUND
            }
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Unauthorized => StatusCode::UNAUTHORIZED,
            ProxyError::UpstreamUnreachable { .. }
            | ProxyError::UpstreamStreamInterrupted { .. }
            | ProxyError::UpstreamInvalidResponse { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Overloaded | ProxyError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI `type` of the error.
    pub fn openai_type(&self) -> &'static str {
        match self {
            ProxyError::Unauthorized => "authentication_error",
            ProxyError::UpstreamUnreachable { .. }
            | ProxyError::UpstreamTimeout { .. }
            | ProxyError::UpstreamStreamInterrupted { .. }
            | ProxyError::UpstreamInvalidResponse { .. }
            | ProxyError::Overloaded
            | ProxyError::ShuttingDown
            | ProxyError::Internal(_) => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The OpenAI `code`, also a low-cardinality label for metrics and logs.
    pub fn code(&self) -> &'static str {
        match self {
            ProxyError::MalformedJson { .. } => "invalid_json",
            ProxyError::InvalidField { .. } => "invalid_value",
            ProxyError::MissingField { .. } => "missing_required_parameter",
            ProxyError::InvalidBody(_) => "invalid_body",
            ProxyError::InvalidHeader { .. } => "invalid_header",
            ProxyError::ContextBudgetExceeded { .. } => "context_budget_exceeded",
            ProxyError::BodyTooLarge { .. } => "request_too_large",
            ProxyError::BodyTimeout => "request_timeout",
            ProxyError::RouteNotFound { .. } => "unknown_url",
            ProxyError::MethodNotAllowed { .. } => "method_not_allowed",
            ProxyError::ModelNotRouted { .. } => "model_not_found",
            ProxyError::Unauthorized => "invalid_api_key",
            ProxyError::UpstreamUnreachable { .. } => "upstream_unreachable",
            ProxyError::UpstreamTimeout { .. } => "upstream_timeout",
            ProxyError::UpstreamStreamInterrupted { .. } => "upstream_stream_interrupted",
            ProxyError::UpstreamInvalidResponse { .. } => "upstream_invalid_response",
            ProxyError::Overloaded => "overloaded",
            ProxyError::ShuttingDown => "shutting_down",
            ProxyError::Internal(_) => "internal_error",
        }
    }

    fn param(&self) -> Option<String> {
        match self {
            ProxyError::InvalidField { field, .. } | ProxyError::MissingField { field } => {
                Some(field.clone())
            }
            ProxyError::ModelNotRouted { .. } => Some("model".to_owned()),
            ProxyError::InvalidHeader { header, .. } => Some((*header).to_owned()),
            ProxyError::ContextBudgetExceeded { .. } => Some("messages".to_owned()),
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorObject {
                message: self.to_string(),
                kind: self.openai_type().to_owned(),
                param: self.param(),
                code: Some(self.code().to_owned()),
            },
        }
    }

    /// The error as an SSE event: how a stream whose headers are gone says it failed (the
    /// last event of its body).
    pub fn sse_event(&self) -> Bytes {
        let body = serde_json::to_string(&self.body()).unwrap_or_default();
        Bytes::from(format!("data: {body}\n\n"))
    }

    /// The error as the event that ends a Responses API stream (`event: error`).
    pub fn responses_sse_event(&self) -> Bytes {
        let event = serde_json::json!({
            "type": "error",
            "code": self.code(),
            "message": self.to_string(),
            "param": self.param(),
        });
        Bytes::from(format!("event: error\ndata: {event}\n\n"))
    }

    /// Maps a JSON parse failure of a request body to the right 400.
    pub fn from_json(err: serde_path_to_error::Error<serde_json::Error>) -> Self {
        let path = err.path().to_string();
        let inner = err.into_inner();
        let message = strip_position(&inner);
        // "missing field `model`" at the root, or inside `messages[0]`: name the field.
        if let Some(name) = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.strip_suffix('`'))
        {
            let field = if path == "." {
                name.to_owned()
            } else {
                format!("{path}.{name}")
            };
            return ProxyError::MissingField { field };
        }
        match inner.classify() {
            serde_json::error::Category::Data if path != "." => ProxyError::InvalidField {
                field: path,
                message: strip_position(&inner),
            },
            serde_json::error::Category::Data => ProxyError::InvalidBody(
                // serde names the Rust type it expected; the client sent something else.
                strip_position(&inner).replace(
                    "expected struct ChatRequest",
                    "expected a JSON object: a chat completion request",
                ),
            ),
            _ => ProxyError::MalformedJson {
                message: strip_position(&inner),
                line: inner.line(),
                column: inner.column(),
            },
        }
    }
}

fn model_not_routed(model: &str) -> String {
    if model.is_empty() {
        "No default upstream is configured ([upstream] base_url is empty), and this request names no model that a [[routes]] entry claims".to_owned()
    } else {
        format!("No upstream is configured for model '{model}'")
    }
}

/// serde_json appends " at line L column C"; we report those separately (or not at all).
fn strip_position(err: &serde_json::Error) -> String {
    let text = err.to_string();
    match text.rfind(" at line ") {
        Some(i) => text[..i].to_owned(),
        None => text,
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, axum::Json(self.body())).into_response();
        if matches!(self, ProxyError::Unauthorized) {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::ChatRequest;

    fn parse(text: &str) -> ProxyError {
        let mut de = serde_json::Deserializer::from_str(text);
        let err = serde_path_to_error::deserialize::<_, ChatRequest>(&mut de).unwrap_err();
        ProxyError::from_json(err)
    }

    #[test]
    fn a_stream_error_is_an_openai_error_event() {
        let err = ProxyError::UpstreamStreamInterrupted {
            upstream: "default".into(),
            reason: "reset".into(),
        };
        let event = err.sse_event();
        let payload = crate::openai::sse::event_data(&event).unwrap();
        let value: serde_json::Value = serde_json::from_str(&payload).unwrap();
        assert_eq!(value["error"]["code"], "upstream_stream_interrupted");
        assert_eq!(value["error"]["type"], "server_error");
        assert!(value["error"]["param"].is_null());
        assert!(event.ends_with(b"\n\n"));
    }

    #[test]
    fn syntax_errors_carry_line_and_column() {
        let err = parse("{\n  \"model\": \"x\",\n  \"messages\": [,]\n}");
        assert!(
            matches!(err, ProxyError::MalformedJson { line: 3, .. }),
            "{err:?}"
        );
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert!(err.to_string().contains("line 3, column"));
    }

    #[test]
    fn type_errors_name_the_field() {
        let err = parse(r#"{"model":"x","messages":[{"role":"user","content":5}]}"#);
        let body = err.body();
        assert_eq!(body.error.param.as_deref(), Some("messages[0].content"));
        assert_eq!(body.error.code.as_deref(), Some("invalid_value"));
        let err = parse(r#"{"messages":[]}"#);
        assert_eq!(err.to_string(), "Missing required parameter: 'model'");
        assert_eq!(err.body().error.param.as_deref(), Some("model"));
        let err = parse(r#"{"model":"x","messages":[{"content":"hi"}]}"#);
        assert_eq!(err.body().error.param.as_deref(), Some("messages[0].role"));
        assert_eq!(
            err.body().error.code.as_deref(),
            Some("missing_required_parameter")
        );
    }
}
