//! Which headers cross the proxy: everything but hop-by-hop headers, and the upstream key
//! policy for `Authorization`.

use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::config::UpstreamConfig;

/// Headers that describe one connection, never forwarded (RFC 9110 §7.6.1), plus `host`.
const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HOST,
];

/// A copy of `headers` without hop-by-hop headers (including those named by `Connection`).
/// Whether a response is a server-sent event stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

pub fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    let named_by_connection: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let hop = HOP_BY_HOP.contains(name)
            || name.as_str() == "keep-alive"
            || named_by_connection.iter().any(|n| n == name.as_str());
        if !hop {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// Sets the upstream's `Authorization`: its own key when it has one; otherwise the client's
/// header, unless proxy auth is on (a proxy key is never forwarded).
pub fn apply_upstream_auth(headers: &mut HeaderMap, upstream: &UpstreamConfig, proxy_auth: bool) {
    match &upstream.api_key {
        Some(key) => match HeaderValue::from_str(&format!("Bearer {}", key.expose())) {
            Ok(mut value) => {
                value.set_sensitive(true);
                headers.insert(header::AUTHORIZATION, value);
            }
            Err(_) => {
                headers.remove(header::AUTHORIZATION);
            }
        },
        None if proxy_auth => {
            headers.remove(header::AUTHORIZATION);
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("x-private", HeaderValue::from_static("1"));
        headers.insert(header::HOST, HeaderValue::from_static("proxy"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert("openai-organization", HeaderValue::from_static("org-1"));
        let out = end_to_end(&headers);
        assert_eq!(out.len(), 1);
        assert_eq!(out["openai-organization"], "org-1");
    }

    #[test]
    fn upstream_auth_policy() {
        let config = Config::from_toml("", Vec::new()).unwrap();
        let mut upstream = config.upstreams[0].clone();
        let client = || {
            let mut h = HeaderMap::new();
            h.insert(
                header::AUTHORIZATION,
                HeaderValue::from_static("Bearer client"),
            );
            h
        };
        let mut headers = client();
        apply_upstream_auth(&mut headers, &upstream, false);
        assert_eq!(headers[header::AUTHORIZATION], "Bearer client");
        let mut headers = client();
        apply_upstream_auth(&mut headers, &upstream, true);
        assert!(headers.get(header::AUTHORIZATION).is_none());
        upstream.api_key = Some(crate::config::Secret::new("sk-own"));
        let mut headers = client();
        apply_upstream_auth(&mut headers, &upstream, true);
        assert_eq!(headers[header::AUTHORIZATION], "Bearer sk-own");
    }
}
