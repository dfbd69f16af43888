//! The daemon under resource pressure: running out of file descriptors must refuse new
//! work, never tear down the sandboxes that already run.

use sandpit_api::LimitsSpec;
use sandpit_tests::{Daemon, sh};
use std::time::{Duration, Instant};

/// Open descriptors of process `pid`.
fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn small() -> LimitsSpec {
    LimitsSpec {
        memory_bytes: Some(128 << 20),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_descriptors_stops_no_sandbox() {
    const LIMIT: u64 = 256;
    // The listener's connection caps would stop the connections below long before the
    // descriptors run out: set above the limit, they let this test reach the liveness
    // sweep's second line of defence.
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        "[http]\nmax_connections = 4096\nmax_connections_per_ip = 4096\nheader_read_timeout_secs = 120\n",
    )
    .expect("write the config");
    let cfg = cfg.to_str().expect("utf-8 path");
    let d = Daemon::start_with_fd_limit(LIMIT, &["--config", cfg]).await;
    let pid = d.child.as_ref().expect("daemon child").id();
    let c = d.client();
    let a = d.sandbox(small()).await;
    let b = d.sandbox(small()).await;
    assert_eq!(sh(&c, &a, "echo up").await.stdout, "up\n");

    // Plain TCP connections to the daemon's listener, never finishing a request, until
    // its descriptor table is full (the rest wait in the kernel's backlog). Bounded in
    // count and time; all are closed when `held` goes.
    let mut held = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while fd_count(pid) + 2 < LIMIT as usize && Instant::now() < deadline && held.len() < 4000 {
        for _ in 0..16 {
            if let Ok(s) = tokio::net::TcpStream::connect(("127.0.0.1", d.port)).await {
                held.push(s);
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        fd_count(pid) + 2 >= LIMIT as usize,
        "the daemon's descriptors never ran out ({} of {LIMIT} after {} connections)",
        fd_count(pid),
        held.len()
    );
    // The liveness sweep runs every second: give it several passes while nothing can be
    // opened, /proc included.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let full_for_the_sweep = fd_count(pid) + 2 >= LIMIT as usize;
    drop(held);

    // Back to normal: both sandboxes must still be the ones that ran before.
    let mut states = Vec::new();
    for _ in 0..100 {
        states.clear();
        for id in [&a, &b] {
            if let Ok(s) = c.get_sandbox(id).await {
                states.push(s.state);
            }
        }
        if states.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(full_for_the_sweep, "the descriptor table did not stay full");
    assert_eq!(states, ["running", "running"], "a sandbox was stopped");
    assert_eq!(sh(&c, &a, "echo still").await.stdout, "still\n");
    assert_eq!(sh(&c, &b, "echo still").await.stdout, "still\n");
    d.shutdown().await;
}
