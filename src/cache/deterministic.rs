//! The deterministic cache's decisions (pure): whether a request may be answered from the
//! cache, and its key. The key covers the whole rewritten request minus a short deny-list of
//! fields that cannot change the answer, so any new parameter changes the key by default.

use std::collections::BTreeMap;

use axum::http::HeaderMap;
use axum::http::header::CACHE_CONTROL;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::config::{Accept, CacheConfig};
use super::time_words::is_time_dependent;
use crate::openai::ChatRequest;

/// Fields never part of the key: they change how an answer is delivered, not the answer.
pub const IGNORED_FIELDS: &[&str] = &["stream", "stream_options", "user"];

/// What the cache may do for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Look up, and store the answer on a miss.
    Use,
    /// `Cache-Control: no-cache`: do not look up, but store the fresh answer.
    WriteOnly,
    /// Neither (the reason is the metric's and the log's).
    Bypass(&'static str),
}

fn cache_control(headers: &HeaderMap) -> (bool, bool) {
    let directives: Vec<String> = headers
        .get_all(CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|d| d.trim().to_ascii_lowercase())
        .collect();
    let has = |name: &str| directives.iter().any(|d| d == name);
    (has("no-cache"), has("no-store"))
}

pub fn decide(request: &ChatRequest, headers: &HeaderMap, config: &CacheConfig) -> Decision {
    if !config.deterministic.enabled {
        return Decision::Bypass("disabled");
    }
    let (no_cache, no_store) = cache_control(headers);
    if no_store {
        return Decision::Bypass("no_store");
    }
    let number = |name: &str| request.extra.get(name).and_then(Value::as_f64);
    let temperature_zero = number("temperature") == Some(0.0);
    let seeded = request.extra.get("seed").is_some_and(|s| !s.is_null());
    let deterministic = match config.deterministic.accept {
        Accept::TemperatureZero => temperature_zero,
        Accept::Seeded => temperature_zero || seeded,
        Accept::All => true,
    };
    if !deterministic {
        return Decision::Bypass("not_deterministic");
    }
    if number("n").is_some_and(|n| n != 1.0) {
        return Decision::Bypass("n");
    }
    if is_time_dependent(&request.last_user_text(), &config.time_words) {
        return Decision::Bypass("time_dependent");
    }
    if no_cache {
        Decision::WriteOnly
    } else {
        Decision::Use
    }
}

/// JSON with object keys sorted at every level: the same request always hashes the same.
pub fn canonical(value: &Value) -> String {
    fn sorted(value: &Value) -> Value {
        match value {
            Value::Object(map) => {
                let ordered: BTreeMap<&String, Value> =
                    map.iter().map(|(k, v)| (k, sorted(v))).collect();
                let mut out = serde_json::Map::new();
                for (k, v) in ordered {
                    out.insert(k.clone(), v);
                }
                Value::Object(out)
            }
            Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(value).to_string()
}

/// The key of a request as it will be sent upstream, for a tenant and an upstream route.
pub fn key(request: &Value, tenant: &str, route: &str, config: &CacheConfig) -> String {
    let mut body = request.clone();
    if let Some(fields) = body.as_object_mut() {
        for field in IGNORED_FIELDS.iter().copied().chain(
            config
                .deterministic
                .ignore_fields
                .iter()
                .map(String::as_str),
        ) {
            fields.remove(field);
        }
    }
    let mut hasher = Sha256::new();
    for part in [tenant, route, &canonical(&body)] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    format!("cache:det:{}", hex::encode(hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(value: Value) -> ChatRequest {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn only_deterministic_timeless_single_answers_are_cached() {
        let config = CacheConfig::default();
        let none = HeaderMap::new();
        let base = json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "Capital of France?"}]});
        assert_eq!(
            decide(&request(base.clone()), &none, &config),
            Decision::Use
        );
        let mut warm = base.clone();
        warm["temperature"] = json!(0.7);
        assert_eq!(
            decide(&request(warm), &none, &config),
            Decision::Bypass("not_deterministic")
        );
        let mut many = base.clone();
        many["n"] = json!(2);
        assert_eq!(
            decide(&request(many), &none, &config),
            Decision::Bypass("n")
        );
        let timely = json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "¿Qué hora es ahora?"}]});
        assert_eq!(
            decide(&request(timely), &none, &config),
            Decision::Bypass("time_dependent")
        );
        let mut headers = HeaderMap::new();
        headers.insert(CACHE_CONTROL, "no-cache".parse().unwrap());
        assert_eq!(
            decide(&request(base.clone()), &headers, &config),
            Decision::WriteOnly
        );
        headers.insert(CACHE_CONTROL, "max-age=0, no-store".parse().unwrap());
        assert_eq!(
            decide(&request(base), &headers, &config),
            Decision::Bypass("no_store")
        );
    }

    #[test]
    fn keys_ignore_order_and_delivery_but_not_parameters_tenants_or_routes() {
        let config = CacheConfig::default();
        let a =
            json!({"model": "m", "temperature": 0, "messages": [], "stream": true, "user": "u1"});
        let b = json!({"messages": [], "temperature": 0, "model": "m"});
        let k = |v: &Value, t: &str, r: &str| key(v, t, r, &config);
        assert_eq!(k(&a, "t", "default"), k(&b, "t", "default"));
        assert_ne!(k(&a, "t", "default"), k(&a, "other", "default"));
        assert_ne!(k(&a, "t", "default"), k(&a, "t", "local"));
        for (field, value) in [
            ("reasoning_effort", json!("high")),
            ("tool_choice", json!("required")),
            ("response_format", json!({"type": "json_object"})),
            ("temperature", json!(0.0001)),
        ] {
            let mut changed = b.clone();
            changed[field] = value;
            assert_ne!(
                k(&changed, "t", "default"),
                k(&b, "t", "default"),
                "{field}"
            );
        }
    }
}
