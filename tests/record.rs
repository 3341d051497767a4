//! `[record]` through the running proxy: every field of a recorded exchange, no secret in the
//! file, sampling, rotation, a full queue that drops without holding requests, and a recording
//! that `ctxproxy replay` sends through ctxproxy again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Mock, Proxy, client, long_conversation, start_mock, start_proxy_with_env};
use ctxproxy::mock_upstream::{MockOptions, MockStats};
use ctxproxy::record::rotated_path;
use ctxproxy::replay::{self, Options, Pacing, StreamMode};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const CLIENT_KEY: &str = "sk-client-4d2a9f0c7e";
const UPSTREAM_KEY: &str = "sk-upstream-8b31e6d5aa";
const TEAM_TOKEN: &str = "team-token-51c0de";

fn temp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ctxproxy-{name}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn recording_proxy(mock: &Mock, path: &Path, record: &str) -> Proxy {
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\napi_key_env = \"RECORD_TEST_UPSTREAM_KEY\"\n\
         [auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"team-a\" }}]\n\
         [record]\npath = \"{}\"\n{record}",
        mock.base_url(),
        hex::encode(Sha256::digest(CLIENT_KEY)),
        path.display()
    );
    let env = vec![(
        "RECORD_TEST_UPSTREAM_KEY".to_owned(),
        UPSTREAM_KEY.to_owned(),
    )];
    start_proxy_with_env(&toml, env).await
}

async fn post(proxy: &Proxy, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client()
        .post(proxy.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .timeout(Duration::from_secs(20))
        .json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

/// Waits until `n` exchanges are written or dropped (a record is queued when the response body
/// ends, which the client may see a moment earlier).
async fn wait_for_records(proxy: &Proxy, n: f64) -> (f64, f64) {
    for _ in 0..200 {
        let metrics = proxy.metrics().await;
        let written = common::metric_sum(&metrics, "ctxproxy_records_written_total", &[]);
        let dropped = common::metric_sum(&metrics, "ctxproxy_record_dropped_total", &[]);
        if written + dropped >= n {
            return (written, dropped);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("fewer than {n} records after 10 s");
}

/// A FIFO nobody reads, in `dir`: the writer blocks on opening it, as on a stuck disk.
fn stuck_file(dir: &Path) -> PathBuf {
    let fifo = dir.join("stuck.jsonl");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    fifo
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn question(text: &str) -> Value {
    json!({"model": "gpt-4o", "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn every_field_is_recorded_and_no_secret_is_written() {
    let mock = start_mock(MockOptions::default()).await;
    let dir = temp_dir("record-fields");
    let path = dir.join("traffic.jsonl");
    let proxy = recording_proxy(&mock, &path, "redact_headers = [\"X-Team-Token\"]").await;
    let secret_headers = [
        ("X-Team-Token", TEAM_TOKEN),
        ("X-Conversation-Id", "conv-42"),
    ];

    // Rewritten by the pipeline, then a stream without include_usage, a cache miss and hit,
    // an upstream failure and a body that is not JSON.
    let long = post(&proxy, &long_conversation(), &secret_headers).await;
    assert_eq!(long.status(), 200);
    let mut stream = question("Name three rivers.");
    stream["stream"] = json!(true);
    let streamed = post(&proxy, &stream, &secret_headers)
        .await
        .text()
        .await
        .unwrap();
    assert!(
        !streamed.contains("\"usage\":{"),
        "the client did not ask for usage"
    );
    let mut cached = question("What is a lighthouse?");
    cached["temperature"] = json!(0);
    for _ in 0..2 {
        assert_eq!(post(&proxy, &cached, &[]).await.status(), 200);
    }
    let failed = post(&proxy, &question("Fail."), &[("X-Mock-Status", "503")]).await;
    assert_eq!(failed.status(), 503);
    let bad = client()
        .post(proxy.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert_eq!(wait_for_records(&proxy, 6.0).await, (6.0, 0.0));

    let text = std::fs::read_to_string(&path).unwrap();
    for secret in [CLIENT_KEY, UPSTREAM_KEY, TEAM_TOKEN] {
        assert!(!text.contains(secret), "{secret} is in the recording");
    }
    let records = lines(&path);
    assert_eq!(records.len(), 6);
    for record in &records {
        for field in [
            "time",
            "unix_ms",
            "request_id",
            "tenant",
            "conversation_id",
            "status",
            "stream",
            "cache",
            "tokens",
            "timings_ms",
            "request",
            "rewritten",
            "response",
        ] {
            assert!(record.get(field).is_some(), "{field} missing in {record}");
        }
        assert_eq!(record["tenant"], "team-a");
        assert!(record["time"].as_str().unwrap().ends_with('Z'));
        assert!(record["timings_ms"]["total"].as_f64().unwrap() > 0.0);
        assert!(
            record["request_id"]
                .as_str()
                .is_some_and(|id| !id.is_empty())
        );
    }

    let first = &records[0];
    assert_eq!(
        first["request"],
        long_conversation(),
        "the original request, as sent"
    );
    assert_eq!(first["status"], 200);
    assert_eq!(first["cache"], "bypass");
    assert_eq!(first["headers"]["x-conversation-id"], "conv-42");
    assert_eq!(first["conversation_id"], "conv-42", "the client's own id");
    assert!(first["headers"].get("authorization").is_none());
    let tokens = &first["tokens"];
    assert!(tokens["after"].as_u64() < tokens["before"].as_u64());
    let saved: u64 = tokens["saved_by_stage"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(
        saved,
        tokens["before"].as_u64().unwrap() - tokens["after"].as_u64().unwrap()
    );
    assert!(tokens["stages"].as_array().unwrap().len() >= 4);
    let rewritten = first["rewritten"]["messages"].as_array().unwrap();
    assert!(rewritten.len() < long_conversation()["messages"].as_array().unwrap().len());
    for timing in ["pipeline", "upstream", "ttfb", "total"] {
        assert!(first["timings_ms"][timing].is_number(), "{timing}: {first}");
    }
    assert_eq!(first["response"]["object"], "chat.completion");
    assert!(first["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    // The stream is assembled into one completion, usage included (the proxy asked for it).
    let second = &records[1];
    assert_eq!(second["stream"], true);
    assert_eq!(second["response"]["object"], "chat.completion");
    assert!(
        second["response"]["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .len()
            > 3
    );
    assert!(second["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert!(
        second["rewritten"].is_null(),
        "nothing to rewrite in one question"
    );

    assert_eq!(
        (records[2]["cache"].as_str(), records[3]["cache"].as_str()),
        (Some("miss"), Some("hit"))
    );
    assert_eq!(records[3]["response"], records[2]["response"]);
    assert!(
        records[3]["timings_ms"]["upstream"].is_null(),
        "a hit calls no upstream"
    );
    assert_eq!(records[4]["status"], 503);
    assert_eq!(records[5]["status"], 400);
    assert_eq!(records[5]["request"], "{not json");
    assert_eq!(
        records[5]["response"]["error"]["type"],
        "invalid_request_error"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn sampling_and_rotation_keep_the_files_bounded() {
    let mock = start_mock(MockOptions::default()).await;
    let dir = temp_dir("record-rotation");
    let path = dir.join("traffic.jsonl");
    let proxy = recording_proxy(
        &mock,
        &path,
        "sample_rate = 0.5\nmax_bytes = 4096\nmax_files = 3",
    )
    .await;
    for n in 0..40 {
        let body = question(&format!(
            "Question number {n} about the tides of the northern sea?"
        ));
        assert_eq!(post(&proxy, &body, &[]).await.status(), 200);
    }
    // Half of the 40 are recorded; each line is about 1.5 KB, so the files rotated and only
    // three remain.
    let (written, _) = wait_for_records(&proxy, 20.0).await;
    assert_eq!(written, 20.0);
    assert!(rotated_path(&path, 2).exists());
    assert!(!rotated_path(&path, 3).exists());
    let mut kept = Vec::new();
    for file in [rotated_path(&path, 2), rotated_path(&path, 1), path.clone()] {
        assert!(std::fs::metadata(&file).unwrap().len() <= 4096);
        kept.extend(lines(&file));
    }
    // The newest records survive, in order, every other request.
    let asked: Vec<String> = kept
        .iter()
        .map(|r| {
            r["request"]["messages"][0]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert!(asked.len() < 20 && asked.len() >= 4, "{}", asked.len());
    assert_eq!(
        asked.last().unwrap(),
        "Question number 39 about the tides of the northern sea?"
    );
    assert!(asked.windows(2).all(|w| {
        let n = |s: &str| s.split(' ').nth(2).unwrap().parse::<u32>().unwrap();
        n(&w[1]) == n(&w[0]) + 2
    }));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_full_queue_drops_records_and_requests_go_on() {
    let mock = start_mock(MockOptions::default()).await;
    let dir = temp_dir("record-full");
    // A FIFO nobody reads: the writer blocks on opening it, as on a stuck disk.
    let fifo = stuck_file(&dir);
    let proxy = recording_proxy(&mock, &fifo, "queue_capacity = 1").await;
    for n in 0..20 {
        let answer = post(&proxy, &question(&format!("Question {n}?")), &[]).await;
        assert_eq!(answer.status(), 200, "a request waited for the recorder");
    }
    // One record is with the blocked writer and one waits in the queue; the rest are dropped.
    let dropped = proxy.metric("ctxproxy_record_dropped_total", &[("reason", "queue_full")]);
    let dropped = dropped.await;
    assert!((18.0..=19.0).contains(&dropped), "{dropped}");
    // Once the disk is back, what was queued is written.
    let reader = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let file = std::io::BufReader::new(std::fs::File::open(&fifo).unwrap());
        file.lines().take(20 - dropped as usize).count()
    });
    assert_eq!(wait_for_records(&proxy, 20.0).await.0, 20.0 - dropped);
    assert_eq!(reader.await.unwrap(), 20 - dropped as usize);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn the_queue_is_bounded_in_bytes_too() {
    let mock = start_mock(MockOptions::default()).await;
    let dir = temp_dir("record-bytes");
    let fifo = stuck_file(&dir);
    // Room for 1,000 exchanges, but only 40 KB: two of these 12 KB questions at most.
    let record = "queue_capacity = 1000\nqueue_max_bytes = 40000";
    let proxy = recording_proxy(&mock, &fifo, record).await;
    let long = "why ".repeat(3_000);
    for n in 0..20 {
        let answer = post(&proxy, &question(&format!("{long} {n}?")), &[]).await;
        assert_eq!(answer.status(), 200, "a request waited for the recorder");
    }
    let dropped = proxy.metric("ctxproxy_record_dropped_total", &[("reason", "queue_full")]);
    let dropped = dropped.await;
    assert!((17.0..=19.0).contains(&dropped), "{dropped}");
    let reader = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let file = std::io::BufReader::new(std::fs::File::open(&fifo).unwrap());
        file.lines().take(20 - dropped as usize).count()
    });
    assert_eq!(wait_for_records(&proxy, 20.0).await.0, 20.0 - dropped);
    assert_eq!(reader.await.unwrap(), 20 - dropped as usize);
    // One exchange over the bound on its own is dropped as such, the queue empty or not.
    let small = recording_proxy(&mock, &dir.join("small.jsonl"), "queue_max_bytes = 4000").await;
    let answer = post(&small, &question(&format!("{long} again?")), &[]).await;
    assert_eq!(answer.status(), 200);
    wait_for_records(&small, 1.0).await;
    let too_large = small.metric("ctxproxy_record_dropped_total", &[("reason", "too_large")]);
    assert_eq!(too_large.await, 1.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_recording_replays_through_ctxproxy() {
    let mock = start_mock(MockOptions::default()).await;
    let dir = temp_dir("record-replay");
    let path = dir.join("traffic.jsonl");
    let proxy = recording_proxy(&mock, &path, "").await;
    let mut sent = vec![long_conversation()];
    for text in ["What is a fjord?", "¿Qué es un glaciar?", "Name a desert."] {
        sent.push(question(text));
    }
    sent[2]["stream"] = json!(true);
    for body in &sent {
        assert_eq!(post(&proxy, body, &[]).await.status(), 200);
    }
    wait_for_records(&proxy, 4.0).await;

    let (recorded, skipped) = replay::load(&[&path]).unwrap();
    assert_eq!((recorded.len(), skipped), (4, 0));
    for (recorded, original) in recorded.iter().zip(&sent) {
        assert_eq!(&recorded.body, original);
        assert!(recorded.unix_ms.is_some());
    }
    let before = MockStats::get(&mock.stats.chat_requests);
    let options = Options {
        target: proxy.url(""),
        pacing: Pacing::Recorded { speed: 100.0 },
        requests: None,
        duration: None,
        headers: vec![("Authorization".into(), format!("Bearer {CLIENT_KEY}"))],
        stream: StreamMode::Recorded,
        vary_user: false,
        timeout: Duration::from_secs(10),
        progress: false,
        label: "replayed".into(),
    };
    let report = replay::run(&options, &recorded).await.unwrap();
    assert_eq!((report.requests, report.errors, report.streams), (4, 0, 1));
    assert_eq!(MockStats::get(&mock.stats.chat_requests), before + 4);
    assert!(report.tokens_after < report.tokens_before);
    // The replayed requests were recorded in turn.
    wait_for_records(&proxy, 8.0).await;
    assert_eq!(lines(&path).len(), 8);
    std::fs::remove_dir_all(&dir).unwrap();
}
