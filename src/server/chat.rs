//! `POST /v1/chat/completions`: the request flow of DESIGN.md, in order. Today: parse → route →
//! upstream → relay; the pipeline, caches and state plug in here.

use axum::Extension;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::response::Response;

use super::{RequestContext, SharedState, read_body};
use crate::error::ProxyError;
use crate::openai::ChatRequest;
use crate::upstream::{OutgoingBody, apply_upstream_auth, end_to_end};

pub async fn chat_completions(
    State(state): State<SharedState>,
    Extension(_context): Extension<RequestContext>,
    request: Request,
) -> Result<Response<Body>, ProxyError> {
    let (parts, body) = request.into_parts();
    let bytes = read_body(body, &parts.headers, state.config.server.max_body_bytes).await?;
    let chat = ChatRequest::parse(&bytes)?;

    let upstream = state
        .config
        .upstream_for_model(&chat.model)
        .and_then(|index| state.upstreams.get(index))
        .ok_or_else(|| ProxyError::ModelNotRouted {
            model: chat.model.clone(),
        })?;

    let mut headers = end_to_end(&parts.headers);
    headers.remove(header::CONTENT_LENGTH);
    // Responses are read by later stages (usage, caches): ask for them uncompressed.
    headers.remove(header::ACCEPT_ENCODING);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    apply_upstream_auth(&mut headers, &upstream.config, state.config.auth_enabled());

    let suffix = match parts.uri.query() {
        Some(query) => format!("/chat/completions?{query}"),
        None => "/chat/completions".to_owned(),
    };
    let uri = upstream.uri(&suffix)?;
    // Nothing rewrites the request yet: the client's own bytes go upstream.
    let answer = upstream
        .send(
            Method::POST,
            uri,
            headers,
            OutgoingBody::Buffered(bytes),
            &state.metrics,
        )
        .await?;
    Ok(upstream.relay(answer, &state.metrics))
}
