//! The README's quick-start snippets, run as written: every fenced block marked
//! `<!-- readme-test: KIND -->` is read from README.md itself, so an edit that breaks one fails
//! here. `servers` starts the demo (the mock upstream and the proxy, with this build's binary for
//! `cargo run --release --`); `sh` and `python` are client snippets run against it, each of which
//! must exit 0 and get a 200 from the proxy that the mock answered. Everything listens on
//! 127.0.0.1, on free ports put in place of the README's 8080 and 9000; nothing reaches the
//! internet. A marker with `with-key` is a snippet that reads the user's own `OPENAI_API_KEY`
//! (a dummy one is set); the others run without any.
//!
//! Python snippets (and shell snippets that call `python3`) need `CTXPROXY_TEST_PYTHON`, a
//! python with the `openai` package (the README's test command sets it); without it this test
//! fails, unless `CTXPROXY_SKIP_SDK_TESTS=1` skips them deliberately.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::Duration;

use common::{client, closed_port, metric_sum, redis_url, unique_prefix};

/// One marked snippet of the README.
#[derive(Debug)]
struct Snippet {
    kind: String,
    /// It reads the user's `OPENAI_API_KEY`.
    with_key: bool,
    /// Its line in README.md (for messages).
    line: usize,
    code: String,
}

const MARKER: &str = "<!-- readme-test:";

fn readme_snippets() -> Vec<Snippet> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
    let readme = std::fs::read_to_string(path).unwrap();
    let lines: Vec<&str> = readme.lines().collect();
    let mut snippets = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim().strip_prefix(MARKER) else {
            continue;
        };
        let words: Vec<&str> = rest.trim_end_matches("-->").split_whitespace().collect();
        let fence = lines.get(index + 1).copied().unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "README.md:{}: a readme-test marker must be right above a fenced block",
            index + 1
        );
        let body: Vec<&str> = lines[index + 2..]
            .iter()
            .take_while(|l| !l.starts_with("```"))
            .copied()
            .collect();
        snippets.push(Snippet {
            kind: words.first().copied().unwrap_or_default().to_owned(),
            with_key: words.contains(&"with-key"),
            line: index + 3,
            code: body.join("\n"),
        });
    }
    snippets
}

/// The snippet with the demo's addresses moved to free ports and `cargo run --release --` as
/// this build's binary.
fn as_run(code: &str, proxy: &str, mock: &str) -> String {
    code.replace(
        "cargo run --release --",
        &format!("'{}'", env!("CARGO_BIN_EXE_ctxproxy")),
    )
    .replace("127.0.0.1:8080", proxy)
    .replace("127.0.0.1:9000", mock)
}

/// The demo's processes, in a process group of their own, stopped when dropped.
struct Demo {
    child: std::process::Child,
    log: PathBuf,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = std::process::Command::new("kill")
            .args(["-TERM", "--", &group])
            .status();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A shell command with the client environment of the test: no proxy settings, no OpenAI
/// variables but those the snippet asks for, the test's python first in PATH.
fn client_command(program: &str, python: Option<&str>, with_key: bool) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(program);
    for name in [
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
        "OPENAI_ORG_ID",
        "OPENAI_PROJECT_ID",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        command.env_remove(name);
    }
    command
        .env("NO_PROXY", "127.0.0.1")
        .env("no_proxy", "127.0.0.1");
    if with_key {
        command.env("OPENAI_API_KEY", "sk-readme-test");
    }
    if let Some(dir) = python.and_then(|p| PathBuf::from(p).parent().map(PathBuf::from)) {
        let path = std::env::var("PATH").unwrap_or_default();
        command.env("PATH", format!("{}:{path}", dir.display()));
    }
    command.kill_on_drop(true);
    command
}

/// What the demo proxy and the mock have answered: (chat and Responses requests answered 200 by
/// the proxy, chat and Responses requests the mock received).
async fn answered(proxy: &str, mock: &str) -> (f64, u64) {
    let metrics = client()
        .get(format!("http://{proxy}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let stats: serde_json::Value = client()
        .get(format!("http://{mock}/mock/stats"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    (
        metric_sum(
            &metrics,
            "ctxproxy_chat_requests_total",
            &[("status", "200")],
        ),
        stats["chat_requests"].as_u64().unwrap() + stats["responses_requests"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_quick_start_snippets_run_as_written() {
    let snippets = readme_snippets();
    let count = |kind: &str| snippets.iter().filter(|s| s.kind == kind).count();
    assert_eq!(count("servers"), 1, "{snippets:#?}");
    assert!(count("python") >= 1 && count("sh") >= 2, "{snippets:#?}");
    for snippet in &snippets {
        assert!(
            ["servers", "sh", "python"].contains(&snippet.kind.as_str()),
            "README.md:{}: unknown readme-test kind {:?}",
            snippet.line,
            snippet.kind
        );
    }
    let skip_python = std::env::var("CTXPROXY_SKIP_SDK_TESTS").as_deref() == Ok("1");
    let python = if skip_python {
        None
    } else {
        Some(std::env::var("CTXPROXY_TEST_PYTHON").expect(
            "CTXPROXY_TEST_PYTHON must name a python with the `openai` package (run scripts/test.sh)",
        ))
    };

    let proxy = format!("127.0.0.1:{}", closed_port().await);
    let mock = format!("127.0.0.1:{}", closed_port().await);
    let Some(servers) = snippets.iter().find(|s| s.kind == "servers") else {
        unreachable!("counted above")
    };
    assert!(
        servers.code.contains("127.0.0.1:9000"),
        "the demo's mock address moved: update this test"
    );
    let log = std::env::temp_dir().join(format!("ctxproxy-readme-{}.log", std::process::id()));
    // The proxy's own address comes from config.toml (127.0.0.1:8080): moved with the
    // environment override the README documents; the store is the test Redis, under a prefix
    // of its own.
    let child = std::process::Command::new("bash")
        .arg("-c")
        .arg(as_run(&servers.code, &proxy, &mock))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("CTXPROXY_SERVER_LISTEN", &proxy)
        .env("CTXPROXY_STORE_REDIS_URL", redis_url())
        .env("CTXPROXY_STORE_KEY_PREFIX", unique_prefix("readme"))
        .env_remove("CTXPROXY_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut demo = Demo { child, log };
    let mut ready = false;
    for _ in 0..600 {
        if let Some(status) = demo.child.try_wait().unwrap() {
            panic!(
                "README.md:{}: the demo exited ({status}):\n{}",
                servers.line,
                std::fs::read_to_string(&demo.log).unwrap_or_default()
            );
        }
        let up = |address: &str, path: &str| {
            let url = format!("http://{address}{path}");
            async move {
                client()
                    .get(url)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200)
            }
        };
        if up(&proxy, "/readyz").await && up(&mock, "/mock/stats").await {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        ready,
        "README.md:{}: the demo did not start:\n{}",
        servers.line,
        std::fs::read_to_string(&demo.log).unwrap_or_default()
    );

    for snippet in snippets.iter().filter(|s| s.kind != "servers") {
        let uses_python = snippet.kind == "python" || snippet.code.contains("python");
        if uses_python && skip_python {
            eprintln!(
                "skipped README.md:{} (CTXPROXY_SKIP_SDK_TESTS=1)",
                snippet.line
            );
            continue;
        }
        let code = as_run(&snippet.code, &proxy, &mock);
        let mut command = match snippet.kind.as_str() {
            "python" => {
                let mut command = client_command(
                    python.as_deref().unwrap_or("python3"),
                    python.as_deref(),
                    snippet.with_key,
                );
                command.arg("-c").arg(&code);
                command
            }
            _ => {
                let mut command = client_command("bash", python.as_deref(), snippet.with_key);
                command.args(["-e", "-o", "pipefail", "-c"]).arg(&code);
                command
            }
        };
        let before = answered(&proxy, &mock).await;
        let output = command.output().await.unwrap();
        let after = answered(&proxy, &mock).await;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "README.md:{} failed ({}):\n{code}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            snippet.line,
            output.status
        );
        assert!(
            after.0 > before.0 && after.1 > before.1,
            "README.md:{}: no chat request answered 200 through the proxy by the mock \
             ({before:?} -> {after:?})\nstdout:\n{stdout}\nstderr:\n{stderr}",
            snippet.line
        );
    }
    drop(demo);
}
