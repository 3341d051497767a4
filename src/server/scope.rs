//! Who may share a cached answer or a conversation's state: the caller's scope. A cached
//! answer goes only to a caller who could have got it from the upstream.
//!
//! With auth on, the tenant (and the `api-key` / `x-api-key` a client sends upstream). With
//! auth off (the default), a digest of the credential the client sends upstream
//! (`Authorization`, `api-key`, `x-api-key`), so a caller without a key, or with
//! another key, never gets an answer paid for by someone else. Either way, the query string and
//! the routing headers that go upstream (`OpenAI-Organization`, `OpenAI-Project`, and
//! `[cache] key_headers`) are part of it.

use axum::http::HeaderMap;
use axum::http::request::Parts;
use sha2::{Digest, Sha256};

use crate::auth::Tenant;
use crate::config::Config;

/// Headers that carry the client's credential to the upstream (`authorization` first).
const CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "api-key", "x-api-key"];
/// Headers that route a request to an account upstream.
const ROUTING_HEADERS: [&str; 2] = ["openai-organization", "openai-project"];

/// The scope of a request: `tenant` itself when nothing else splits it, else the tenant and a
/// digest (`default~3f2a…`), so that metrics and logs can keep using the tenant.
pub fn of(config: &Config, tenant: &Tenant, parts: &Parts) -> String {
    let mut hasher = Sha256::new();
    let mut field = |name: &str, value: &[u8]| {
        for part in [name.as_bytes(), value] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
    };
    let mut split = false;
    // With auth on, `Authorization` is the proxy's key (never forwarded); the others still go
    // upstream and decide what the upstream answers.
    let skip = usize::from(config.auth_enabled());
    for name in &CREDENTIAL_HEADERS[skip..] {
        split |= add_header(&parts.headers, name, &mut field);
    }
    if let Some(query) = parts.uri.query().filter(|q| !q.is_empty()) {
        field("?", query.as_bytes());
        split = true;
    }
    let extra = config.cache.key_headers.iter().map(String::as_str);
    for name in ROUTING_HEADERS.into_iter().chain(extra) {
        split |= add_header(&parts.headers, name, &mut field);
    }
    if !split {
        return tenant.as_str().to_owned();
    }
    let digest = hex::encode(hasher.finalize());
    format!("{}~{}", tenant.as_str(), &digest[..32])
}

/// Adds every value of header `name` (lowercase); whether there was one.
fn add_header(headers: &HeaderMap, name: &str, field: &mut impl FnMut(&str, &[u8])) -> bool {
    let mut found = false;
    for value in headers.get_all(name) {
        field(name, value.as_bytes());
        found = true;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut request = Request::builder().uri(uri);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap().into_parts().0
    }

    fn config(text: &str) -> Config {
        Config::from_toml(text, Vec::new()).unwrap()
    }

    fn scope(config: &Config, uri: &str, headers: &[(&str, &str)]) -> String {
        of(config, &Tenant::default_tenant(), &parts(uri, headers))
    }

    #[test]
    fn without_auth_each_credential_is_its_own_scope() {
        let config = config("");
        let one = scope(
            &config,
            "/v1/chat/completions",
            &[("authorization", "Bearer sk-ONE")],
        );
        let two = scope(
            &config,
            "/v1/chat/completions",
            &[("authorization", "Bearer sk-TWO")],
        );
        let none = scope(&config, "/v1/chat/completions", &[]);
        let azure = scope(&config, "/v1/chat/completions", &[("api-key", "sk-ONE")]);
        assert_eq!(none, "default");
        assert!(one.starts_with("default~") && !one.contains("sk-"));
        assert_eq!(one.len(), "default~".len() + 32);
        for (a, b) in [(&one, &two), (&one, &none), (&one, &azure)] {
            assert_ne!(a, b);
        }
        assert_eq!(
            one,
            scope(
                &config,
                "/v1/chat/completions",
                &[("authorization", "Bearer sk-ONE")]
            )
        );
    }

    #[test]
    fn the_query_and_routing_headers_split_the_scope() {
        let config = config("[cache]\nkey_headers = [\"x-region\"]\n");
        let base = scope(&config, "/v1/chat/completions", &[]);
        let split = [
            scope(&config, "/v1/chat/completions?api-version=2024-06-01", &[]),
            scope(
                &config,
                "/v1/chat/completions",
                &[("openai-organization", "org-1")],
            ),
            scope(
                &config,
                "/v1/chat/completions",
                &[("openai-project", "proj-1")],
            ),
            scope(&config, "/v1/chat/completions", &[("x-region", "eu")]),
        ];
        for (i, s) in split.iter().enumerate() {
            assert_ne!(s, &base, "{i}");
            for other in &split[i + 1..] {
                assert_ne!(s, other);
            }
        }
        // A header nobody listed changes nothing.
        assert_eq!(
            scope(&config, "/v1/chat/completions", &[("x-trace", "1")]),
            base
        );
    }
}

#[cfg(test)]
mod auth_on {
    use super::*;
    use axum::http::Request;

    #[test]
    fn with_auth_the_tenant_is_the_scope_whatever_the_key() {
        let digest = hex::encode(Sha256::digest(b"sk-acme"));
        let text = format!("[[auth.keys]]\nsha256 = \"{digest}\"\ntenant = \"acme\"\n");
        let config = Config::from_toml(&text, Vec::new()).unwrap();
        let tenant = crate::auth::authenticate(
            &config,
            &[(
                axum::http::header::AUTHORIZATION,
                axum::http::HeaderValue::from_static("Bearer sk-acme"),
            )]
            .into_iter()
            .collect(),
        )
        .unwrap();
        let parts = Request::builder()
            .header("authorization", "Bearer sk-acme")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        assert_eq!(of(&config, &tenant, &parts), "acme");
        // An Azure-style key still goes upstream: it splits the scope.
        let azure = Request::builder()
            .header("authorization", "Bearer sk-acme")
            .header("api-key", "azure-1")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        assert_ne!(of(&config, &tenant, &azure), "acme");
    }
}
