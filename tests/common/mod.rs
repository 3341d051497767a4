//! Shared helpers for integration tests: the mock upstream and the proxy, in process, on
//! ephemeral ports.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;

use ctxproxy::config::Config;
use ctxproxy::cores::Cores;
use ctxproxy::mock_upstream::{self, MockOptions, MockStats};
use ctxproxy::server::{self, AppState, SharedState};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub struct Mock {
    pub addr: SocketAddr,
    pub stats: Arc<MockStats>,
    _stop: oneshot::Sender<()>,
}

impl Mock {
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

pub async fn start_mock(options: MockOptions) -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (router, stats) = mock_upstream::router(options);
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Mock {
        addr,
        stats,
        _stop: stop,
    }
}

pub struct Proxy {
    pub addr: SocketAddr,
    pub state: SharedState,
    stop: Option<oneshot::Sender<()>>,
    handle: JoinHandle<std::io::Result<()>>,
}

impl Proxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// What `/v1/ctxproxy/explain` says of `body` sent with `headers`.
    pub async fn explain(
        &self,
        body: &serde_json::Value,
        headers: &[(&str, &str)],
    ) -> serde_json::Value {
        let mut request = client().post(self.url("/v1/ctxproxy/explain")).json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.send().await.unwrap().json().await.unwrap()
    }

    /// The proxy's metrics text, as `/metrics` serves it (read in process: with auth on,
    /// `/metrics` needs a key of its own; `tests/hardening.rs` covers that).
    pub async fn metrics(&self) -> String {
        self.state.metrics.render()
    }

    /// The sum of the samples of metric `name` that carry every label of `labels`.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        metric_sum(&self.metrics().await, name, labels)
    }

    /// Sends the shutdown signal; returns the server task to await.
    pub fn begin_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub async fn join(self) -> std::io::Result<()> {
        self.handle.await.unwrap()
    }
}

/// The Redis the tests use (the test command exports it; the machine's default otherwise).
pub fn redis_url() -> String {
    std::env::var("CTXPROXY_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A key prefix no other test (or run) uses.
pub fn unique_prefix(name: &str) -> String {
    format!("ctxproxy-test:{name}:{}:", uuid::Uuid::new_v4().simple())
}

/// Starts ctxproxy with `toml` (plus `env` for overrides and upstream keys). Unless `env` says
/// otherwise, the store is the test Redis under a key prefix of this proxy's own.
pub async fn start_proxy_with_env(toml: &str, mut env: Vec<(String, String)>) -> Proxy {
    for (key, value) in [
        ("CTXPROXY_STORE_REDIS_URL", redis_url()),
        ("CTXPROXY_STORE_KEY_PREFIX", unique_prefix("proxy")),
    ] {
        if !env.iter().any(|(k, _)| k == key) {
            env.push((key.to_owned(), value));
        }
    }
    let config = Config::from_toml(toml, env).unwrap();
    let state = AppState::new(config).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let handle = tokio::spawn(server::serve(listener, state.clone(), async move {
        let _ = stopped.await;
    }));
    Proxy {
        addr,
        state,
        stop: Some(stop),
        handle,
    }
}

/// `start_proxy`, each connection served on one of `server.threads` threads of its own
/// (`ctxproxy::cores`), as `ctxproxy serve` serves them.
pub async fn start_proxy_on_threads(toml: &str) -> Proxy {
    let config =
        Config::from_toml(toml, [("CTXPROXY_STORE_BACKEND".into(), "memory".into())]).unwrap();
    let state = AppState::new(config).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let served = state.clone();
    let handle = tokio::spawn(async move {
        let cores = Cores::start(served.config.server.threads)?;
        server::serve_on(listener, served, &cores, async move {
            let _ = stopped.await;
        })
        .await
    });
    Proxy {
        addr,
        state,
        stop: Some(stop),
        handle,
    }
}

pub async fn start_proxy(toml: &str) -> Proxy {
    start_proxy_with_env(toml, Vec::new()).await
}

/// A proxy in front of `mock` with extra config lines.
pub async fn proxy_for(mock: &Mock, extra: &str) -> Proxy {
    start_proxy(&format!(
        "[upstream]\nbase_url = \"{}\"\n{extra}",
        mock.base_url()
    ))
    .await
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// A port where nothing listens.
pub async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

/// The sum of the samples of metric `name` in a Prometheus text exposition that carry every
/// label of `labels` (other labels are free).
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, rest) = match series.split_once('{') {
                Some((metric, rest)) => (metric, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let wanted = metric == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.split(',').any(|pair| pair == format!("{k}=\"{v}\"")));
            wanted.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// A 12-turn travel conversation with a 150-item tool result and a late system message: long
/// enough that every stage has something to do.
pub fn long_conversation() -> serde_json::Value {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a travel agent. Be precise."}),
    ];
    let repos: Vec<serde_json::Value> = (0..150)
        .map(|i| serde_json::json!({"id": 1000 + i, "name": format!("trip-{i}"), "html_url": format!("https://example.com/trips/{i}"),
            "owner": {"login": "acme", "id": 7, "avatar_url": "https://example.com/a.png"}, "notes": null,
            "internal_blob": "x".repeat(40)}))
        .collect();
    for turn in 0..12 {
        messages.push(serde_json::json!({"role": "user", "content": format!("Question {turn} about flight AB{turn:03} to Lisbon and hotel booking options near the airport?")}));
        if turn == 9 {
            messages.push(serde_json::json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "list_trips", "arguments": "{\"city\":\"Lisbon\"}"}}]}));
            messages.push(serde_json::json!({"role": "tool", "tool_call_id": "call_1", "content": serde_json::Value::Array(repos.clone()).to_string()}));
        }
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Answer {turn}: flight AB{turn:03} leaves at 10:{turn:02}. The hotel near the airport has rooms.")}));
        if turn == 4 {
            messages.push(serde_json::json!({"role": "system", "content": "Prices are in EUR."}));
        }
    }
    messages.push(serde_json::json!({"role": "user", "content": "So which flight should I take to Lisbon, given the hotel options?"}));
    serde_json::json!({"model": "gpt-4o", "messages": messages, "tools": [{"type": "function", "function": {"name": "list_trips",
        "description": "List trips", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})
}

/// A Redis of a test's own, on `port`, stopped when dropped; `None` when `redis-server` is not
/// installed.
pub struct OwnRedis {
    child: std::process::Child,
}

impl OwnRedis {
    pub fn start(port: u16) -> Option<OwnRedis> {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Some(OwnRedis { child })
    }

    /// Freezes (`SIGSTOP`) or resumes (`SIGCONT`) the server: it keeps its connections but
    /// answers nothing while frozen.
    pub fn signal(&self, signal: &str) -> bool {
        std::process::Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.signal("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
