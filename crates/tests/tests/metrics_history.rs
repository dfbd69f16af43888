//! The per-sandbox metrics history against a real daemon: a CPU loop shows in its range
//! and nowhere else, ranges filter, old samples are pruned, a paused sandbox is not
//! sampled, a deleted one's history goes with it, other owners see nothing, bad ranges
//! are 400s, E2B's routes serve the same samples, and network counters move.

use reqwest::StatusCode;
use sandpit_api::metrics::{MetricSample, SandboxMetrics};
use sandpit_api::{CreateSandboxRequest, LimitsSpec, NetworkMode, NetworkPolicy};
use sandpit_client::Client;
use sandpit_tests::netfix::Upstream;
use sandpit_tests::{Daemon, sh};
use serde_json::Value;
use std::time::Duration;

/// A sample every second, kept an hour.
const FAST: &str = "[metrics]\nsample_interval_secs = 1\nretention_secs = 3600\n";
/// Below this a sample is idle, above it busy: an idle sandbox's agent uses well under 1%
/// of a core, and a busy loop gets far more than this even on a loaded host.
const BUSY_PCT: f64 = 5.0;

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Every sample of `id` so far.
async fn all(c: &Client, id: &str) -> Vec<MetricSample> {
    c.sandbox_metrics(id, None, None)
        .await
        .expect("read metrics")
        .samples
}

/// Waits (up to a minute) until `f` holds for the sandbox's samples, and returns them.
async fn samples_until(
    c: &Client,
    id: &str,
    what: &str,
    f: impl Fn(&[MetricSample]) -> bool,
) -> Vec<MetricSample> {
    for _ in 0..600 {
        let s = all(c, id).await;
        if f(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never: {what}: {:#?}", all(c, id).await);
}

/// A GET with `key` on the daemon: status and JSON body.
async fn get(d: &Daemon, key: &str, path: &str) -> (StatusCode, Value) {
    let r = sandpit_tests::http()
        .get(format!("{}{path}", d.url))
        .header("X-API-Key", key)
        .send()
        .await
        .expect("request");
    let s = r.status();
    (s, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_loop_shows_in_its_range_and_nowhere_else() {
    let d = Daemon::builder().config(FAST).start().await;
    let c = d.client();
    let id = d
        .sandbox(LimitsSpec {
            cpu_millis: Some(1000),
            ..Default::default()
        })
        .await;
    // Idle first: a few samples before the loop.
    samples_until(&c, &id, "idle samples", |s| s.len() >= 3).await;
    let t0 = now_ms();
    let r = sh(&c, &id, "timeout 6 sh -c 'while :; do :; done'; echo done").await;
    assert_eq!(r.stdout, "done\n", "{r:?}");
    let t1 = now_ms();
    // Idle again afterwards.
    let s = samples_until(&c, &id, "idle samples after the loop", |s| {
        s.iter().filter(|m| m.at_ms > t1 + 1000).count() >= 3
    })
    .await;
    assert!(
        s.windows(2).all(|w| w[0].at_ms < w[1].at_ms),
        "oldest first"
    );
    // Each sample after the first covers the time since the one before (the sandbox ran
    // throughout, so every pass gave one).
    let (mut inside, mut before, mut after) = (Vec::new(), Vec::new(), Vec::new());
    for w in s.windows(2) {
        let (from, to, pct) = (w[0].at_ms, w[1].at_ms, w[1].cpu_used_pct);
        assert!((0.0..=100.0).contains(&pct), "{pct}");
        assert_eq!(w[1].cpu_count, 1);
        assert_eq!(w[1].memory_total_bytes, 512 << 20);
        assert!(w[1].memory_used_bytes > 0);
        assert!(w[1].disk_total_bytes > 0 && w[1].disk_used_bytes > 0);
        if from >= t0 && to <= t1 {
            inside.push(pct);
        } else if to <= t0 {
            before.push(pct);
        } else if from >= t1 {
            after.push(pct);
        }
    }
    assert!(!inside.is_empty() && !before.is_empty() && !after.is_empty());
    assert!(inside.iter().all(|&p| p > BUSY_PCT), "loop: {inside:?}");
    assert!(
        before.iter().chain(&after).all(|&p| p < BUSY_PCT),
        "idle: {before:?} {after:?}"
    );

    // The range of the loop holds the busy samples, and only samples of that range.
    let loop_range = c.sandbox_metrics(&id, Some(t0), Some(t1)).await.unwrap();
    assert_eq!((loop_range.start_ms, loop_range.end_ms), (t0, t1));
    assert_eq!(loop_range.sample_interval_secs, 1);
    assert_eq!(loop_range.retention_secs, 3600);
    assert!(loop_range.next_start_ms.is_none());
    assert!(
        loop_range
            .samples
            .iter()
            .all(|m| (t0..t1).contains(&m.at_ms))
    );
    assert!(
        loop_range.samples.iter().any(|m| m.cpu_used_pct > BUSY_PCT),
        "{loop_range:?}"
    );
    // Before the loop: every sample there is idle.
    let earlier = c.sandbox_metrics(&id, None, Some(t0)).await.unwrap();
    assert!(!earlier.samples.is_empty());
    assert!(
        earlier
            .samples
            .iter()
            .all(|m| m.at_ms < t0 && m.cpu_used_pct < BUSY_PCT),
        "{earlier:?}"
    );
    // Before the sandbox existed, and an empty range: nothing.
    let created = c.get_sandbox(&id).await.unwrap().created_at_ms;
    assert!(
        c.sandbox_metrics(&id, Some(0), Some(created))
            .await
            .unwrap()
            .samples
            .is_empty()
    );
    assert!(
        c.sandbox_metrics(&id, Some(t0), Some(t0))
            .await
            .unwrap()
            .samples
            .is_empty()
    );

    // E2B's route serves the same samples, its range in whole seconds, both ends in.
    let (st, v) = get(
        &d,
        &d.key,
        &format!(
            "/sandboxes/{id}/metrics?start={}&end={}",
            t0 / 1000,
            t1 / 1000
        ),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let e2b = v.as_array().expect("a list");
    assert!(!e2b.is_empty());
    for m in e2b {
        let unix = m["timestampUnix"].as_i64().unwrap();
        assert!((t0 / 1000..=t1 / 1000).contains(&unix), "{m}");
        assert!(m["timestamp"].as_str().unwrap().ends_with('Z'), "{m}");
        for k in [
            "cpuCount",
            "memUsed",
            "memTotal",
            "memCache",
            "diskUsed",
            "diskTotal",
        ] {
            assert!(m[k].as_u64().is_some(), "{k} in {m}");
        }
    }
    assert!(
        e2b.iter()
            .any(|m| m["cpuUsedPct"].as_f64().unwrap() > BUSY_PCT)
    );
    let (st, v) = get(
        &d,
        &d.key,
        &format!(
            "/sandboxes/{id}/metrics?start={}&end={}",
            created / 1000 - 3600,
            created / 1000 - 1800
        ),
    )
    .await;
    assert_eq!((st, v), (StatusCode::OK, serde_json::json!([])));
    let (st, v) = get(
        &d,
        &d.key,
        &format!("/sandboxes/metrics?sandbox_ids={id},nosuch"),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let latest = v["sandboxes"].as_object().expect("a map");
    assert_eq!(latest.len(), 1, "{v}");
    let newest = all(&c, &id).await.last().unwrap().at_ms;
    assert!(latest[&id]["timestampUnix"].as_i64().unwrap() >= newest / 1000);

    // The CLI prints the same history, as a table and as JSON.
    let (ok, out, err) = d.cli(&["metrics", &id]);
    assert!(ok, "{err}");
    assert!(out.starts_with("TAKEN"), "{out}");
    assert!(out.lines().count() > 3, "{out}");
    let (ok, out, err) = d.cli(&[
        "--json",
        "metrics",
        &id,
        "--start",
        &t0.to_string(),
        "--end",
        &t1.to_string(),
    ]);
    assert!(ok, "{err}");
    let parsed: SandboxMetrics = serde_json::from_str(&out).expect("JSON");
    assert_eq!(parsed.samples, loop_range.samples);
    let (ok, _, err) = d.cli(&[
        "metrics",
        &id,
        "--start",
        &t1.to_string(),
        "--end",
        &t0.to_string(),
    ]);
    assert!(!ok);
    assert!(err.contains("before"), "{err}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_samples_are_pruned() {
    let d = Daemon::builder()
        .config("[metrics]\nsample_interval_secs = 1\nretention_secs = 2\n")
        .start()
        .await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    let first = samples_until(&c, &id, "a sample", |s| !s.is_empty()).await[0].at_ms;
    // The first sample goes once it is older than the retention; newer ones keep coming.
    let s = samples_until(&c, &id, "the first sample pruned", |s| {
        !s.is_empty() && s.iter().all(|m| m.at_ms > first)
    })
    .await;
    // At most a retention's worth, plus what arrives between two prunes.
    let at = now_ms();
    assert!(s.iter().all(|m| m.at_ms > at - 10_000), "{s:?}");
    assert!(s.len() <= 8, "{} samples kept", s.len());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_is_not_sampled_and_deleted_takes_its_history() {
    let d = Daemon::builder().config(FAST).start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    samples_until(&c, &id, "samples while running", |s| s.len() >= 2).await;
    c.pause(&id).await.unwrap();
    let paused = now_ms();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let resumed = now_ms();
    c.resume(&id).await.unwrap();
    let s = samples_until(&c, &id, "samples after the resume", |s| {
        s.iter().filter(|m| m.at_ms > resumed).count() >= 2
    })
    .await;
    // A pass that read the sandbox just before the pause may land a moment after it.
    let gap: Vec<_> = s
        .iter()
        .filter(|m| m.at_ms > paused + 1500 && m.at_ms < resumed)
        .collect();
    assert!(gap.is_empty(), "sampled while paused: {gap:?}");
    // No sample after the resume covers paused time: the first one pairs with a reading
    // taken after it.
    let first_after = s.iter().position(|m| m.at_ms > resumed).unwrap();
    assert!(s[first_after - 1].at_ms < paused + 1500);

    // Paused, its history is still readable.
    c.pause(&id).await.unwrap();
    assert!(!all(&c, &id).await.is_empty());
    c.delete_sandbox(&id).await.unwrap();
    assert_eq!(
        c.sandbox_metrics(&id, None, None)
            .await
            .unwrap_err()
            .status(),
        Some(404)
    );
    let db = d.store().await;
    for _ in 0..100 {
        if db.get_sandbox(&id).await.unwrap().is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(db.get_sandbox(&id).await.unwrap().is_none());
    assert_eq!(db.latest_metric(&id).await.unwrap(), None);
    db.close().await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_owners_get_404_and_bad_ranges_get_400() {
    let d = Daemon::builder().config(FAST).start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    samples_until(&c, &id, "a sample", |s| !s.is_empty()).await;
    let mallory = d.owner_key("mallory").await;
    let m = Client::new(&d.url, Some(mallory.clone())).unwrap();
    assert_eq!(
        m.sandbox_metrics(&id, None, None)
            .await
            .unwrap_err()
            .status(),
        Some(404)
    );
    for path in [
        format!("/v1/sandboxes/{id}/metrics"),
        format!("/sandboxes/{id}/metrics"),
        format!("/sandboxes/{id}/metrics?start=0&end=9999999999"),
    ] {
        let (s, v) = get(&d, &mallory, &path).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{path}: {v}");
        assert!(!v.to_string().contains("cpu"), "{path} leaked: {v}");
    }
    let (s, v) = get(
        &d,
        &mallory,
        &format!("/sandboxes/metrics?sandbox_ids={id}"),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v, serde_json::json!({"sandboxes": {}}));
    let (s, _) = get(&d, &d.key, "/v1/sandboxes/nosuch/metrics").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // Hostile ids reach nothing: not another sandbox, not a file, not the SQL.
    let long = "a".repeat(10_000);
    for bad in ["..%2F..%2Fetc", "%27%20OR%201%3D1--", "%00", long.as_str()] {
        for path in [
            format!("/v1/sandboxes/{bad}/metrics"),
            format!("/sandboxes/{bad}/metrics"),
        ] {
            let (s, v) = get(&d, &d.key, &path).await;
            assert!(
                s == StatusCode::NOT_FOUND || s == StatusCode::BAD_REQUEST,
                "{path}: {s} {v}"
            );
        }
        let (s, v) = get(
            &d,
            &d.key,
            &format!("/sandboxes/metrics?sandbox_ids={bad},{id}"),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let listed: Vec<&String> = v["sandboxes"].as_object().unwrap().keys().collect();
        assert_eq!(listed, [&id], "{v}");
    }

    // Bad ranges and values: 400 in each API's error shape, never a 500.
    for q in [
        "start=10&end=5",
        "start=abc",
        "end=1.5",
        "start=-1",
        "end=-5",
        "start=99999999999999999999",
        "start=1e3",
        "start=",
        "bogus=1",
    ] {
        let (s, v) = get(&d, &d.key, &format!("/v1/sandboxes/{id}/metrics?{q}")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "native {q}: {v}");
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    for q in [
        "start=10&end=5",
        "start=abc",
        "end=1.5",
        "start=-1",
        "start=99999999999999999999",
        "start=9223372036854776",
        "start=",
    ] {
        let (s, v) = get(&d, &d.key, &format!("/sandboxes/{id}/metrics?{q}")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "e2b {q}: {v}");
        assert_eq!(v["code"], 400, "{v}");
    }
    let (s, v) = get(&d, &d.key, "/sandboxes/metrics").await;
    assert_eq!(
        (s, &v["code"]),
        (StatusCode::BAD_REQUEST, &Value::from(400))
    );
    let many = vec![id.as_str(); 101].join(",");
    // The same id a hundred and one times is one sandbox.
    let (s, _) = get(
        &d,
        &d.key,
        &format!("/sandboxes/metrics?sandbox_ids={many}"),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let many: Vec<String> = (0..101).map(|i| format!("s{i}")).collect();
    let (s, v) = get(
        &d,
        &d.key,
        &format!("/sandboxes/metrics?sandbox_ids={}", many.join(",")),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    // The sandbox is untouched by all of it.
    assert_eq!(sh(&c, &id, "echo ok").await.stdout, "ok\n");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_counters_move_with_traffic() {
    let up = Upstream::start(&[("sink.test", "@2")]);
    let d = Daemon::builder().config(&up.config(FAST)).start().await;
    let c = d.client();
    let id = c
        .create_sandbox(&CreateSandboxRequest {
            timeout: Some(600),
            network: Some(NetworkPolicy {
                mode: NetworkMode::Open,
                rules: Vec::new(),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    let before = samples_until(&c, &id, "a sample", |s| !s.is_empty()).await;
    let base = before.last().unwrap().clone();
    // One MiB up to the test's own upstream namespace; its answer comes back.
    let r = sh(
        &c,
        &id,
        "head -c 1048576 /dev/zero > /tmp/up && curl -s --max-time 20 --data-binary @/tmp/up http://sink.test/",
    )
    .await;
    assert!(r.stdout.contains("\"received\": 1048576"), "{r:?}");
    let sent = now_ms();
    let s = samples_until(&c, &id, "a sample after the upload", |s| {
        s.iter().any(|m| m.at_ms > sent + 1000)
    })
    .await;
    let last = s.last().unwrap();
    assert!(
        last.net_tx_bytes >= base.net_tx_bytes + (1 << 20),
        "{base:?} {last:?}"
    );
    assert!(last.net_rx_bytes > base.net_rx_bytes, "{base:?} {last:?}");
    assert!(s.windows(2).all(|w| w[1].net_tx_bytes >= w[0].net_tx_bytes));
    d.shutdown().await;
}
