//! Operational endpoints: liveness, readiness, Prometheus metrics, and the 404 for unknown paths.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use serde_json::json;

use super::SharedState;
use crate::auth::authorize_metrics;
use crate::error::ProxyError;

/// Alive as long as the process answers.
pub async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

/// Ready to take traffic: not shutting down.
/// Ready unless shutting down. A store outage does not make a replica unready (requests are
/// served, from memory), but the body reports it.
pub async fn readyz(State(state): State<SharedState>) -> impl IntoResponse {
    let store = &state.store;
    let store_up = store.ping().await;
    let store = json!({"backend": store.backend(), "up": store_up, "serving": store.serving()});
    if state.is_shutting_down() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down", "store": store})),
        )
    } else {
        (
            StatusCode::OK,
            Json(json!({"status": "ready", "store": store})),
        )
    }
}

/// Prometheus metrics on the API listener (a key is needed when auth is on).
pub async fn metrics(
    State(state): State<SharedState>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ProxyError> {
    authorize_metrics(&state.config, &headers)?;
    Ok(metrics_text(&state))
}

/// Prometheus metrics on the private `metrics_listen` address.
pub async fn private_metrics(State(state): State<SharedState>) -> impl IntoResponse {
    metrics_text(&state)
}

fn metrics_text(state: &SharedState) -> impl IntoResponse + use<> {
    super::housekeeping::export(state);
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
