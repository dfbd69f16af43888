//! The metrics history: batched writes, range reads, pruning, and removal with the sandbox.

use std::collections::BTreeMap;

use sandpit_store::{MetricSample, SandboxRecord, SandboxState, Store};
use serde_json::json;

fn sandbox(id: &str) -> SandboxRecord {
    SandboxRecord {
        id: id.to_string(),
        owner: "alice".to_string(),
        template: "base".to_string(),
        runtime: "ns".to_string(),
        state: SandboxState::Running,
        cpu_millis: 1000,
        memory_bytes: 512 << 20,
        disk_bytes: 1 << 30,
        max_processes: 256,
        env: BTreeMap::new(),
        secret_env: Default::default(),
        metadata: BTreeMap::new(),
        created_at_ms: 1,
        updated_at_ms: 1,
        expires_at_ms: 60_000,
        runtime_state: json!({}),
        error: None,
        version: 0,
        pool: None,
        life: Default::default(),
    }
}

fn sample(id: &str, at_ms: i64, pct: f64) -> MetricSample {
    MetricSample {
        sandbox_id: id.to_string(),
        at_ms,
        cpu_count: 1,
        cpu_used_pct: pct,
        mem_used: 10 << 20,
        mem_total: 512 << 20,
        mem_cache: 1 << 20,
        disk_used: 4096,
        disk_total: 1 << 30,
        net_rx: at_ms * 3,
        net_tx: at_ms * 2,
    }
}

#[tokio::test]
async fn samples_are_read_back_by_half_open_range_oldest_first() {
    let store = Store::open_in_memory().await.unwrap();
    store.insert_sandbox(&sandbox("a")).await.unwrap();
    store.insert_sandbox(&sandbox("b")).await.unwrap();
    let batch: Vec<MetricSample> = (1..=5)
        .rev()
        .map(|i| sample("a", i * 1000, i as f64 * 10.0))
        .chain([sample("b", 3000, 99.5)])
        .collect();
    assert_eq!(store.record_metrics(&batch).await.unwrap(), 6);
    let got = store.metrics_range("a", 2000, 4000, 100).await.unwrap();
    assert_eq!(
        got.iter().map(|s| s.at_ms).collect::<Vec<_>>(),
        [2000, 3000],
        "start inclusive, end exclusive, oldest first"
    );
    assert_eq!(got[1], sample("a", 3000, 30.0), "every field round-trips");
    assert_eq!(
        store
            .metrics_range("a", 0, i64::MAX, 2)
            .await
            .unwrap()
            .len(),
        2
    );
    assert!(
        store
            .metrics_range("a", 6000, 9000, 100)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .metrics_range("a", 4000, 4000, 100)
            .await
            .unwrap()
            .is_empty()
    );
    let b = store.metrics_range("b", 0, i64::MAX, 100).await.unwrap();
    assert_eq!(b, vec![sample("b", 3000, 99.5)], "sandboxes do not mix");
    assert_eq!(
        store.latest_metric("a").await.unwrap().map(|s| s.at_ms),
        Some(5000)
    );
    assert_eq!(store.latest_metric("nobody").await.unwrap(), None);
}

#[tokio::test]
async fn a_sample_of_a_deleted_sandbox_does_not_fail_the_batch() {
    let store = Store::open_in_memory().await.unwrap();
    store.insert_sandbox(&sandbox("live")).await.unwrap();
    let batch = [
        sample("live", 1000, 1.0),
        sample("gone", 1000, 1.0),
        sample("live", 2000, 2.0),
        // The same millisecond twice: the second is ignored, not an error.
        sample("live", 2000, 3.0),
    ];
    assert_eq!(store.record_metrics(&batch).await.unwrap(), 2);
    assert!(
        store
            .metrics_range("gone", 0, i64::MAX, 10)
            .await
            .unwrap()
            .is_empty()
    );
    let live = store.metrics_range("live", 0, i64::MAX, 10).await.unwrap();
    assert_eq!(live.len(), 2);
    assert_eq!(live[1].cpu_used_pct, 2.0);
    assert_eq!(store.record_metrics(&[]).await.unwrap(), 0);
}

#[tokio::test]
async fn history_goes_with_the_sandbox_and_with_age() {
    let store = Store::open_in_memory().await.unwrap();
    for id in ["a", "b"] {
        store.insert_sandbox(&sandbox(id)).await.unwrap();
        let batch: Vec<_> = (1..=4).map(|i| sample(id, i * 1000, 5.0)).collect();
        store.record_metrics(&batch).await.unwrap();
    }
    assert!(store.delete_sandbox("a").await.unwrap());
    assert!(
        store
            .metrics_range("a", 0, i64::MAX, 10)
            .await
            .unwrap()
            .is_empty()
    );
    // A sandbox made again under the same id does not inherit the history.
    store.insert_sandbox(&sandbox("a")).await.unwrap();
    assert!(store.latest_metric("a").await.unwrap().is_none());
    assert_eq!(store.prune_metrics(3000).await.unwrap(), 2);
    let left = store.metrics_range("b", 0, i64::MAX, 10).await.unwrap();
    assert_eq!(
        left.iter().map(|s| s.at_ms).collect::<Vec<_>>(),
        [3000, 4000]
    );
    assert_eq!(store.prune_metrics(3000).await.unwrap(), 0);
}
