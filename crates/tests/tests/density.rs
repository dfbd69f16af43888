//! A thousand idle sandboxes at once on one daemon: every one answers a command, the daemon
//! keeps answering, and deleting them all leaves nothing behind. Figures are printed, not
//! asserted (the benchmark measures them properly).

use futures::StreamExt;
use sandpit_api::{CreateSandboxRequest, LimitsSpec};
use sandpit_tests::{Daemon, command, wait_no_leftovers};
use std::time::{Duration, Instant};

const SANDBOXES: usize = 1000;
/// Requests in flight at once, as from many clients.
const CONCURRENCY: usize = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_idle_sandboxes_each_answer_a_command() {
    let d = Daemon::start().await;
    let c = d.client();
    let req = CreateSandboxRequest {
        limits: LimitsSpec {
            memory_bytes: Some(64 << 20),
            max_processes: Some(64),
            ..Default::default()
        },
        timeout: Some(1800),
        ..Default::default()
    };
    let started = Instant::now();
    let created: Vec<_> = futures::stream::iter(0..SANDBOXES)
        .map(|_| {
            let (c, req) = (c.clone(), req.clone());
            async move { c.create_sandbox(&req).await }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let ids: Vec<String> = created.into_iter().map(|r| r.expect("create").id).collect();
    eprintln!(
        "created {} sandboxes in {:.1} s",
        ids.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(ids.len(), SANDBOXES);

    // Every sandbox answers, while the daemon also serves unrelated requests.
    let probe = {
        let c = c.clone();
        tokio::spawn(async move {
            let mut worst = Duration::ZERO;
            for _ in 0..20 {
                let t = Instant::now();
                c.info().await.expect("the daemon answers under load");
                worst = worst.max(t.elapsed());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            worst
        })
    };
    let true_cmd = command(&["true"]);
    let answers: Vec<_> = futures::stream::iter(ids.clone())
        .map(|id| {
            let (c, cmd) = (c.clone(), true_cmd.clone());
            async move { (c.run(&id, &cmd).await, id) }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let failed: Vec<String> = answers
        .iter()
        .filter(|(r, _)| !matches!(r, Ok(out) if out.exit_code == 0))
        .map(|(r, id)| format!("{id}: {r:?}"))
        .collect();
    assert!(
        failed.is_empty(),
        "{} sandboxes did not answer: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    let worst_info = probe.await.expect("probe task");
    eprintln!("slowest /v1/info while every sandbox ran a command: {worst_info:?}");
    let listed = c
        .list_sandboxes(Some("running"), &[], Some(1000), None)
        .await
        .expect("list");
    assert_eq!(listed.items.len(), SANDBOXES);

    let started = Instant::now();
    let deleted: Vec<_> = futures::stream::iter(ids.clone())
        .map(|id| {
            let c = c.clone();
            async move { c.delete_sandbox(&id).await }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    assert!(deleted.iter().all(Result::is_ok));
    eprintln!("deleted in {:.1} s", started.elapsed().as_secs_f64());
    for id in ids.iter().step_by(50) {
        assert_eq!(wait_no_leftovers(&d, id).await, Vec::<String>::new());
    }
    let left = std::fs::read_dir(d.data.path().join("sandboxes"))
        .map(|rd| rd.count())
        .unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut left = left;
    while left > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        left = std::fs::read_dir(d.data.path().join("sandboxes"))
            .map(|rd| rd.count())
            .unwrap_or(0);
    }
    assert_eq!(left, 0, "sandbox directories left after deleting all");
    d.shutdown().await;
}
