//! What every request goes through: request id, authentication, the concurrency limit,
//! request metrics (counted when the response body ends, so streams are measured whole) and the
//! access log. Message contents and `Authorization` are never logged.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::{SharedState, read_body};
use crate::auth::{Tenant, authenticate};
use crate::body::{BodyEnd, ObservedBody, StreamFault};
use crate::error::ProxyError;
use crate::metrics::{ChatLabels, NO_LABEL, Route};

pub const X_REQUEST_ID: &str = "x-request-id";

/// Per-request facts handlers need, inserted by [`observe`].
#[derive(Debug, Clone)]
pub struct RequestContext {
    pub request_id: HeaderValue,
    pub tenant: Tenant,
}

/// The bounded label for a path.
fn route_label(method: &Method, path: &str) -> Route {
    match path {
        "/v1/chat/completions" if method == Method::POST => Route::ChatCompletions,
        "/v1/responses" if method == Method::POST => Route::Responses,
        "/v1/ctxproxy/explain" if method == Method::POST => Route::Explain,
        "/healthz" => Route::Healthz,
        "/readyz" => Route::Readyz,
        "/metrics" => Route::Metrics,
        p if p.starts_with("/v1/") => Route::Passthrough,
        _ => Route::NotFound,
    }
}

pub async fn observe(
    State(state): State<SharedState>,
    mut request: Request,
    next: Next,
) -> Response {
    let route = route_label(request.method(), request.uri().path());
    let request_id = request_id(&request);
    request
        .headers_mut()
        .insert(X_REQUEST_ID, request_id.clone());
    // Counted and logged once, when dropped: with the response body's end, or here when the
    // client leaves before the response headers (status 499).
    let mut exchange = Exchange::start(&state, route, &request, request_id.clone());
    let mut response = if matches!(
        route,
        Route::Passthrough | Route::ChatCompletions | Route::Responses | Route::Explain
    ) {
        match admit(&state, request, &request_id, route).await {
            Ok((permit, tenant, request)) => {
                exchange.permit = Some(permit);
                exchange.tenant = Some(tenant);
                next.run(request).await
            }
            Err(e) => e.into_response(),
        }
    } else {
        next.run(request).await
    };
    exchange.responded(response.status());
    exchange.fault = response.extensions().get::<StreamFault>().cloned();
    exchange.model = response
        .extensions()
        .get::<ChatLabels>()
        .map(|labels| labels.model.clone());
    response.headers_mut().insert(X_REQUEST_ID, request_id);
    let (parts, body) = response.into_parts();
    let body = ObservedBody::new(body, None, move |end: BodyEnd| {
        exchange.end = Some(end);
        drop(exchange);
    });
    Response::from_parts(parts, Body::new(body))
}

/// Status of a request whose client left before the response (nginx's convention).
const CLIENT_CLOSED: u16 = 499;

/// One request's bookkeeping, from its arrival to the end of its response.
struct Exchange {
    state: SharedState,
    route: Route,
    method: Method,
    path: String,
    request_id: HeaderValue,
    started: Instant,
    tenant: Option<Tenant>,
    /// The model label of a chat request that was parsed.
    model: Option<String>,
    permit: Option<OwnedSemaphorePermit>,
    /// Set once the response headers exist (and counted then).
    status: Option<StatusCode>,
    end: Option<BodyEnd>,
    /// Why a stream ended with an error event, once it did.
    fault: Option<StreamFault>,
}

impl Exchange {
    fn start(state: &SharedState, route: Route, request: &Request, id: HeaderValue) -> Self {
        if in_flight_counts(route) {
            state.metrics.in_flight.inc();
        }
        Exchange {
            state: state.clone(),
            route,
            method: request.method().clone(),
            path: request.uri().path().to_owned(),
            request_id: id,
            started: Instant::now(),
            tenant: None,
            model: None,
            permit: None,
            status: None,
            end: None,
            fault: None,
        }
    }

    fn responded(&mut self, status: StatusCode) {
        self.status = Some(status);
        self.count(status);
    }

    fn count(&self, status: StatusCode) {
        self.state
            .metrics
            .requests
            .with_label_values(&[self.route.as_str(), status.as_str()])
            .inc();
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        drop(self.permit.take());
        let status = match self.status {
            Some(status) => status,
            None => {
                let gone = StatusCode::from_u16(CLIENT_CLOSED).unwrap_or(StatusCode::BAD_REQUEST);
                self.count(gone);
                self.end = Some(BodyEnd::Dropped);
                gone
            }
        };
        if in_flight_counts(self.route) {
            self.state.metrics.in_flight.dec();
        }
        let elapsed = self.started.elapsed();
        self.state
            .metrics
            .request_duration
            .with_label_values(&[
                self.route.as_str(),
                self.model.as_deref().unwrap_or(NO_LABEL),
                self.tenant.as_ref().map_or(NO_LABEL, Tenant::as_str),
            ])
            .observe(elapsed.as_secs_f64());
        if matches!(self.route, Route::Healthz | Route::Readyz | Route::Metrics) {
            return;
        }
        // A stream that ended with an error event had a whole body, but failed.
        let cause = self.fault.as_ref().and_then(StreamFault::get);
        let end = cause.map_or(self.end, |_| Some(BodyEnd::Failed));
        macro_rules! access_line {
            ($level:expr) => {
                tracing::event!(
                    target: "ctxproxy::access",
                    $level,
                    request_id = self.request_id.to_str().unwrap_or("-"),
                    tenant = self.tenant.as_ref().map_or("-", Tenant::as_str),
                    method = %self.method,
                    path = self.path,
                    status = status.as_u16(),
                    duration_ms = elapsed.as_secs_f64() * 1000.0,
                    end = end.map_or("-", BodyEnd::as_str),
                    cause = cause.unwrap_or("-"),
                )
            };
        }
        if failed(end) {
            access_line!(tracing::Level::WARN);
        } else {
            access_line!(tracing::Level::INFO);
        }
    }
}

/// Whether a route's requests count in `ctxproxy_in_flight_requests`: the API's, not probes
/// and scrapes (an idle proxy reads 0).
fn in_flight_counts(route: Route) -> bool {
    !matches!(route, Route::Healthz | Route::Readyz | Route::Metrics)
}

/// A response that failed after its head: logged at WARN.
fn failed(end: Option<BodyEnd>) -> bool {
    matches!(end, Some(BodyEnd::Failed | BodyEnd::DeadlineExceeded))
}

/// Authenticates, reads a chat request's body (within `body_read_timeout`), then waits for a
/// concurrency slot (back-pressure) up to the queue timeout: a client that sends its body
/// slowly never holds a slot. Other routes stream their body, bounded by the same timeout.
async fn admit(
    state: &SharedState,
    request: Request,
    request_id: &HeaderValue,
    route: Route,
) -> Result<(OwnedSemaphorePermit, Tenant, Request), ProxyError> {
    if state.is_shutting_down() {
        return Err(ProxyError::ShuttingDown);
    }
    let server = &state.config.server;
    let tenant = authenticate(&state.config, request.headers())?;
    let (parts, body) = request.into_parts();
    let deadline = Instant::now() + server.body_read_timeout;
    let body = ObservedBody::new(body, Some(deadline), |_| {});
    let body = if matches!(route, Route::ChatCompletions | Route::Explain) {
        let _reading = tokio::time::timeout(
            server.queue_timeout,
            state.body_readers.clone().acquire_owned(),
        )
        .await
        .map_err(|_| ProxyError::Overloaded)?
        .map_err(|_| ProxyError::ShuttingDown)?;
        Body::from(read_body(Body::new(body), &parts.headers, server.max_body_bytes).await?)
    } else {
        Body::new(body)
    };
    let mut request = Request::from_parts(parts, body);
    let permit = tokio::time::timeout(server.queue_timeout, state.limiter.clone().acquire_owned())
        .await
        .map_err(|_| ProxyError::Overloaded)?
        .map_err(|_| ProxyError::ShuttingDown)?;
    request.extensions_mut().insert(RequestContext {
        request_id: request_id.clone(),
        tenant: tenant.clone(),
    });
    Ok((permit, tenant, request))
}

/// The client's `X-Request-Id` when it is a sane token, else a new UUID.
fn request_id(request: &Request) -> HeaderValue {
    request
        .headers()
        .get(X_REQUEST_ID)
        .filter(|v| {
            let bytes = v.as_bytes();
            !bytes.is_empty() && bytes.len() <= 128 && bytes.iter().all(|b| b.is_ascii_graphic())
        })
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::new_v4().to_string())
                .unwrap_or_else(|_| HeaderValue::from_static("invalid"))
        })
}
