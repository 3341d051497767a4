//! Every `/v1/*` path other than chat completions: method, path, query, end-to-end headers and
//! body forwarded as they are, streamed both ways.
//!
//! When routes are configured and the body is JSON, the body is read (up to
//! `server.max_body_bytes`) to route by its `model`; otherwise it streams to `[upstream]`.

use axum::Extension;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::response::{IntoResponse, Response};
use http_body_util::Limited;
use serde::Deserialize;

use super::{RequestContext, SharedState, content_length, read_body};
use crate::config::Config;
use crate::error::ProxyError;
use crate::metrics::{ChatLabels, NO_LABEL};
use crate::upstream::{OutgoingBody, apply_upstream_auth, end_to_end};

pub async fn forward(
    State(state): State<SharedState>,
    Extension(context): Extension<RequestContext>,
    request: Request,
) -> Result<Response<Body>, ProxyError> {
    let (parts, body) = request.into_parts();
    let server = &state.config.server;
    let limit = server.max_passthrough_body_bytes;
    if content_length(&parts.headers).is_some_and(|len| len > limit as u64) {
        return Err(ProxyError::BodyTooLarge { limit });
    }

    let route_by_model = !state.config.routes.is_empty()
        && is_json(&parts.headers)
        && content_length(&parts.headers).is_some_and(|len| len <= server.max_body_bytes as u64);
    let (upstream_index, body) = if route_by_model {
        let bytes = read_body(body, &parts.headers, server.max_body_bytes).await?;
        let index = match model_of(&bytes) {
            Some(model) => state.config.upstream_for_model(&model),
            None => state.config.default_upstream,
        };
        (index, OutgoingBody::Buffered(bytes))
    } else {
        let limited = Body::new(Limited::new(body, limit));
        (
            state.config.default_upstream,
            OutgoingBody::Streaming(limited),
        )
    };
    if upstream_index.is_none() && parts.method == Method::GET && parts.uri.path() == "/v1/models" {
        return Ok(routed_models(&state.config));
    }
    let upstream = upstream_index
        .and_then(|index| state.upstreams.get(index))
        .ok_or_else(|| ProxyError::ModelNotRouted {
            model: String::new(),
        })?;

    let path = parts.uri.path();
    let suffix = path.strip_prefix("/v1").unwrap_or(path);
    let suffix = match parts.uri.query() {
        Some(query) => format!("{suffix}?{query}"),
        None => suffix.to_owned(),
    };
    let mut headers = end_to_end(&parts.headers);
    apply_upstream_auth(&mut headers, &upstream.config, state.config.auth_enabled());
    let uri = upstream.uri(&suffix)?;
    let answer = upstream
        .send(
            parts.method,
            uri,
            headers,
            body,
            &state.metrics,
            upstream.deadline(),
        )
        .await
        .map_err(|e| match e {
            ProxyError::BodyTooLarge { .. } => ProxyError::BodyTooLarge { limit },
            other => other,
        })?;
    let labels = ChatLabels {
        model: NO_LABEL.to_owned(),
        tenant: context.tenant.as_str().to_owned(),
    };
    Ok(upstream.relay(answer, &state.metrics, &labels, None))
}

/// `GET /v1/models` without a default upstream: the models the routes name (exact names; a
/// glob names no model), owned by their route, as OpenAI lists models.
fn routed_models(config: &Config) -> Response<Body> {
    let data: Vec<serde_json::Value> = config
        .routes
        .iter()
        .flat_map(|route| {
            let owner = config
                .upstreams
                .get(route.upstream)
                .map_or("", |u| u.name.as_str());
            route
                .patterns
                .iter()
                .filter(|p| !p.contains(['*', '?']))
                .map(move |model| {
                    serde_json::json!({"id": model, "object": "model", "created": 0, "owned_by": owner})
                })
        })
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"))
}

fn model_of(bytes: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct ModelOnly {
        model: Option<String>,
    }
    serde_json::from_slice::<ModelOnly>(bytes).ok()?.model
}
