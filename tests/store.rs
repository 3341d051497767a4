//! The store's behaviour, one suite run against both backends (the in-memory one and the
//! machine's Redis), and the `Store` facade over a Redis that is down.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use ctxproxy::store::config::Backend as BackendKind;
use ctxproxy::store::{Backend, MemoryBackend, RedisBackend, Store, StoreConfig};

async fn behaves_like_a_store(backend: &impl Backend, prefix: &str) {
    let key = |k: &str| format!("{prefix}{k}");
    assert_eq!(backend.get(&key("absent")).await.unwrap(), None);
    let minute = Duration::from_secs(60);
    backend.set(&key("a"), b"one", minute).await.unwrap();
    assert_eq!(backend.get(&key("a")).await.unwrap(), Some(b"one".to_vec()));
    backend.set(&key("a"), b"two", minute).await.unwrap();
    assert_eq!(backend.get(&key("a")).await.unwrap(), Some(b"two".to_vec()));
    backend.delete(&key("a")).await.unwrap();
    assert_eq!(backend.get(&key("a")).await.unwrap(), None);

    backend
        .set(&key("short"), b"x", Duration::from_millis(30))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(backend.get(&key("short")).await.unwrap(), None, "expired");

    for item in ["1", "2", "3", "4"] {
        backend
            .push_capped(&key("list"), item.as_bytes(), 3, minute)
            .await
            .unwrap();
    }
    let list = backend.list(&key("list")).await.unwrap();
    assert_eq!(list, vec![b"4".to_vec(), b"3".to_vec(), b"2".to_vec()]);
    assert!(backend.list(&key("nothing")).await.unwrap().is_empty());
    backend.delete(&key("list")).await.unwrap();
    backend.ping().await.unwrap();
}

#[tokio::test]
async fn memory_backend_behaves_like_a_store() {
    behaves_like_a_store(&MemoryBackend::new(100, 1 << 20), "").await;
}

#[tokio::test]
async fn redis_backend_behaves_like_a_store() {
    let config = StoreConfig {
        redis_url: common::redis_url(),
        op_timeout_ms: 1_000,
        ..StoreConfig::default()
    };
    let redis = RedisBackend::new(&config).unwrap();
    behaves_like_a_store(&redis, &common::unique_prefix("store-suite")).await;
}

fn metrics() -> ctxproxy::store::StoreMetrics {
    ctxproxy::metrics::Metrics::new().unwrap().store()
}

#[tokio::test]
async fn a_down_redis_fails_fast_serves_from_memory_and_counts_errors() {
    let metrics = metrics();
    let config = StoreConfig {
        backend: BackendKind::Redis,
        redis_url: format!("redis://127.0.0.1:{}", common::closed_port().await),
        breaker_probe_ms: 60_000,
        ..StoreConfig::default()
    };
    let store = Store::new(&config, metrics.clone()).unwrap();
    // The first failures reach Redis (and fail within the op timeout)...
    for _ in 0..config.breaker_failures {
        assert_eq!(store.get("k").await, None);
    }
    assert!(!store.is_up());
    assert_eq!(metrics.up.get(), 0);
    // ...then calls go to memory without waiting.
    let started = Instant::now();
    for i in 0..100 {
        store
            .set(&format!("k{i}"), b"v", Duration::from_secs(60))
            .await;
        assert_eq!(store.get(&format!("k{i}")).await, Some(b"v".to_vec()));
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(store.serving(), "memory");
    let errors: u64 = ["get", "set"]
        .iter()
        .map(|op| metrics.errors.with_label_values(&[op]).get())
        .sum();
    assert_eq!(errors, u64::from(config.breaker_failures));
}

#[tokio::test]
async fn a_cancelled_probe_does_not_keep_the_store_down() {
    let port = common::closed_port().await;
    let Some(redis) = common::OwnRedis::start(port) else {
        eprintln!("redis-server is not installed: skipped (scripts/test.sh installs it)");
        return;
    };
    let config = StoreConfig {
        backend: BackendKind::Redis,
        redis_url: format!("redis://127.0.0.1:{port}"),
        op_timeout_ms: 200,
        breaker_failures: 2,
        breaker_probe_ms: 100,
        ..StoreConfig::default()
    };
    let store = Store::new(&config, metrics()).unwrap();
    store.set("k", b"v", Duration::from_secs(60)).await;
    assert!(store.is_up());

    // Redis hangs: the breaker opens.
    assert!(redis.signal("STOP"));
    while store.is_up() {
        store.get("k").await;
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The probe comes from a client that leaves after 15 ms.
    let left = tokio::time::timeout(Duration::from_millis(15), store.get("k")).await;
    assert!(
        left.is_err(),
        "the probe was still waiting on the frozen Redis"
    );
    assert!(redis.signal("CONT"));

    // The next calls probe again and find Redis back.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !store.is_up() {
        assert!(Instant::now() < deadline, "the store never came back");
        store.get("k").await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(store.serving(), "redis");
}
