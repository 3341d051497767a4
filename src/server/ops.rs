//! Operational endpoints: liveness, readiness, Prometheus metrics, and the 404 for unknown paths.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use serde_json::json;

use super::SharedState;
use crate::error::ProxyError;

/// Alive as long as the process answers.
pub async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

/// Ready to take traffic: not shutting down.
pub async fn readyz(State(state): State<SharedState>) -> impl IntoResponse {
    if state.is_shutting_down() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down"})),
        )
    } else {
        (StatusCode::OK, Json(json!({"status": "ready"})))
    }
}

pub async fn metrics(State(state): State<SharedState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

pub async fn not_found(request: Request) -> ProxyError {
    ProxyError::RouteNotFound {
        method: request.method().to_string(),
        path: request.uri().path().to_owned(),
    }
}

pub async fn method_not_allowed(request: Request) -> ProxyError {
    ProxyError::MethodNotAllowed {
        method: request.method().to_string(),
        path: request.uri().path().to_owned(),
    }
}
