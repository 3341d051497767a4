//! The official `openai` Python package against ctxproxy in front of the mock upstream.
//!
//! The README's test command installs the package into a virtualenv and sets
//! `CTXPROXY_TEST_PYTHON`; without it this test fails (set `CTXPROXY_SKIP_SDK_TESTS=1` to skip
//! it deliberately, e.g. on a machine without Python).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{proxy_for, start_mock};
use ctxproxy::mock_upstream::MockOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_sdk_chat_stream_tools_embeddings() {
    if std::env::var("CTXPROXY_SKIP_SDK_TESTS").as_deref() == Ok("1") {
        eprintln!("skipped: CTXPROXY_SKIP_SDK_TESTS=1");
        return;
    }
    let python = std::env::var("CTXPROXY_TEST_PYTHON").expect(
        "CTXPROXY_TEST_PYTHON must name a python with the `openai` package (run scripts/test.sh)",
    );
    let mock = start_mock(MockOptions::default()).await;
    // Tools filtered whatever their size: check 8 reads an expanded stub call.
    let proxy = proxy_for(
        &mock,
        "[continuation]\nenabled = true\n[tools]\nmin_tool_tokens = 0\nmin_stub_tokens = 0\n",
    )
    .await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/clients/openai_sdk_check.py"
    );
    let output = tokio::process::Command::new(python)
        .arg(script)
        .env("OPENAI_BASE_URL", proxy.url("/v1"))
        .env_remove("OPENAI_API_KEY")
        .env("NO_PROXY", "127.0.0.1")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "SDK check failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("openai SDK checks passed"));
}
