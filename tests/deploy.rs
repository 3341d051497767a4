//! The shipped deployment files against the binary: the Compose file and the Kubernetes
//! manifests parse, name the same image (this crate's version), the port the container listens
//! on, probe paths the proxy really serves, and only environment overrides the config accepts;
//! the ConfigMap holds the repo's config.toml.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{client, start_proxy};
use serde_yaml_ng::Value;

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn yaml(path: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(&repo_file(path))
        .map(|document| {
            serde::Deserialize::deserialize(document).unwrap_or_else(|e| panic!("{path}: {e}"))
        })
        .collect()
}

fn image() -> String {
    format!("ghcr.io/ctxproxy/ctxproxy:{}", env!("CARGO_PKG_VERSION"))
}

/// A Compose value with its `${VAR:-default}` / `${VAR:+alt}` interpolation resolved as with
/// every variable unset.
fn compose_value(value: &str) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').unwrap() + start;
        let inner = &rest[start + 2..end];
        if let Some((_, default)) = inner.split_once(":-") {
            out.push_str(default);
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// The environment overrides are accepted by the config loader, with the repo's config.toml.
fn assert_env_accepted(env: Vec<(String, String)>, origin: &str) {
    let mut env = env;
    env.push(("OPENAI_API_KEY".into(), "sk-test".into()));
    if let Err(e) = ctxproxy::config::Config::from_toml(&repo_file("config.toml"), env.clone()) {
        panic!("{origin}: {env:?} refused: {e}");
    }
    let listen = env
        .iter()
        .find(|(k, _)| k == "CTXPROXY_SERVER_LISTEN")
        .map(|(_, v)| v.as_str());
    assert_eq!(listen, Some("0.0.0.0:8080"), "{origin}");
}

#[test]
fn compose_runs_the_image_with_valid_overrides_and_probes() {
    let compose = yaml("deploy/docker-compose.yml").remove(0);
    let services = &compose["services"];
    for name in [
        "ctxproxy",
        "redis",
        "prometheus",
        "grafana",
        "mock-upstream",
    ] {
        assert!(services.get(name).is_some(), "service {name}");
    }
    let proxy = &services["ctxproxy"];
    assert_eq!(proxy["image"].as_str(), Some(image().as_str()));
    assert_eq!(
        proxy["build"]["dockerfile"].as_str(),
        Some("deploy/Dockerfile")
    );
    assert_eq!(
        services["mock-upstream"]["image"].as_str(),
        Some(image().as_str())
    );
    let ports: Vec<&str> = proxy["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(ports.contains(&"8080:8080"), "{ports:?}");
    let env: Vec<(String, String)> = proxy["environment"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let value = v.as_str().map_or_else(|| format!("{v:?}"), compose_value);
            (k.as_str().unwrap().to_owned(), value)
        })
        .filter(|(k, _)| k.starts_with("CTXPROXY_"))
        .collect();
    assert_env_accepted(env, "docker-compose.yml");
    let healthcheck = format!("{:?}", proxy["healthcheck"]["test"]);
    assert!(
        healthcheck.contains("http://127.0.0.1:8080/readyz"),
        "{healthcheck}"
    );
    let dockerfile = repo_file("deploy/Dockerfile");
    for needed in [
        "EXPOSE 8080",
        "CTXPROXY_SERVER_LISTEN=0.0.0.0:8080",
        "http://127.0.0.1:8080/healthz",
        "/etc/ctxproxy/config.toml",
    ] {
        assert!(dockerfile.contains(needed), "Dockerfile lacks {needed}");
    }
    let prometheus = repo_file("deploy/prometheus/prometheus.yml");
    assert!(prometheus.contains("ctxproxy:8080") && prometheus.contains("/metrics"));
}

#[test]
fn kubernetes_manifests_run_the_image_with_valid_overrides_and_probes() {
    let kustomization = yaml("deploy/k8s/kustomization.yaml").remove(0);
    let mut kinds = Vec::new();
    let mut deployment = None;
    let mut config_map = None;
    for file in kustomization["resources"].as_sequence().unwrap() {
        for document in yaml(&format!("deploy/k8s/{}", file.as_str().unwrap())) {
            let kind = document["kind"].as_str().unwrap().to_owned();
            match kind.as_str() {
                "Deployment" => deployment = Some(document.clone()),
                "ConfigMap" => config_map = Some(document.clone()),
                _ => {}
            }
            kinds.push(kind);
        }
    }
    for kind in [
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ServiceMonitor",
    ] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} missing: {kinds:?}");
    }
    let deployment = deployment.unwrap();
    assert!(deployment["spec"]["replicas"].as_u64().unwrap() >= 2);
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"].as_str(), Some(image().as_str()));
    assert_eq!(container["ports"][0]["containerPort"].as_u64(), Some(8080));
    assert_eq!(
        container["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    assert_eq!(
        container["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(container[probe]["httpGet"]["port"].as_u64(), Some(8080));
    }
    let env: Vec<(String, String)> = container["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_owned(),
                e["value"].as_str()?.to_owned(),
            ))
        })
        .filter(|(k, _)| k.starts_with("CTXPROXY_"))
        .collect();
    assert_env_accepted(env, "deployment.yaml");
    let mounted = config_map.unwrap()["data"]["config.toml"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        mounted,
        repo_file("config.toml"),
        "the ConfigMap is not config.toml"
    );
}

#[tokio::test]
async fn the_probe_and_metrics_paths_are_served() {
    let proxy = start_proxy("").await;
    for path in ["/healthz", "/readyz", "/metrics"] {
        let response = client().get(proxy.url(path)).send().await.unwrap();
        assert_eq!(response.status(), 200, "{path}");
    }
}
