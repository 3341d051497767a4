//! Client authentication against the configured proxy keys, and the tenant each key belongs to.
//!
//! Keys are stored as SHA-256 digests only; the plaintext key is never kept or logged.

use std::sync::Arc;

use axum::http::{HeaderMap, header};
use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::error::ProxyError;

/// Who a request belongs to; scopes caches, state and metrics in later stages.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tenant(Arc<str>);

impl Tenant {
    pub fn default_tenant() -> Self {
        Tenant(Arc::from("default"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// With no keys configured every request is tenant `default`; otherwise the bearer token must
/// hash to a configured key.
pub fn authenticate(config: &Config, headers: &HeaderMap) -> Result<Tenant, ProxyError> {
    if !config.auth_enabled() {
        return Ok(Tenant::default_tenant());
    }
    let token = bearer_token(headers).ok_or(ProxyError::Unauthorized)?;
    let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
    config
        .auth_keys
        .get(&digest)
        .map(|tenant| Tenant(Arc::from(tenant.as_str())))
        .ok_or(ProxyError::Unauthorized)
}

/// `/metrics` on the API listener: open while auth is off; with auth on, only for the
/// `[auth] metrics_key_sha256` key (tenant keys would reveal every tenant's counters).
pub fn authorize_metrics(config: &Config, headers: &HeaderMap) -> Result<(), ProxyError> {
    if !config.auth_enabled() {
        return Ok(());
    }
    let expected = config.metrics_key.ok_or(ProxyError::Unauthorized)?;
    let token = bearer_token(headers).ok_or(ProxyError::Unauthorized)?;
    let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
    if digest == expected {
        Ok(())
    } else {
        Err(ProxyError::Unauthorized)
    }
}

fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Hex SHA-256 of a key, the form `[[auth.keys]] sha256` expects.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn config_with_key(key: &str) -> Config {
        let text = format!(
            "[[auth.keys]]\nsha256 = \"{}\"\ntenant = \"acme\"\n",
            hash_key(key)
        );
        Config::from_toml(&text, Vec::new()).unwrap()
    }

    fn headers(auth: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_str(auth).unwrap());
        headers
    }

    #[test]
    fn keys_map_to_tenants() {
        let config = config_with_key("sk-proxy-1");
        let tenant = authenticate(&config, &headers("Bearer sk-proxy-1")).unwrap();
        assert_eq!(tenant.as_str(), "acme");
        assert!(authenticate(&config, &headers("Bearer sk-other")).is_err());
        assert!(authenticate(&config, &headers("sk-proxy-1")).is_err());
        assert!(authenticate(&config, &HeaderMap::new()).is_err());
    }

    #[test]
    fn no_keys_means_default_tenant() {
        let config = Config::from_toml("", Vec::new()).unwrap();
        let tenant = authenticate(&config, &HeaderMap::new()).unwrap();
        assert_eq!(tenant, Tenant::default_tenant());
    }
}
