//! The daemon under resource pressure: running out of file descriptors must refuse new
//! work, never tear down the sandboxes that already run.

use sandpit_tests::{Daemon, memory_limit, open_fds, sh};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_descriptors_stops_no_sandbox() {
    const LIMIT: u64 = 256;
    // The listener's connection caps would stop the connections below long before the
    // descriptors run out: set above the limit, they let this test reach the liveness
    // sweep's second line of defence.
    let d = Daemon::builder()
        .config_file(
            "[http]\nmax_connections = 4096\nmax_connections_per_ip = 4096\nheader_read_timeout_secs = 120\n",
        )
        .fd_limit(LIMIT)
        .start()
        .await;
    let pid = d.pid();
    let c = d.client();
    let a = d.sandbox(memory_limit(128)).await;
    let b = d.sandbox(memory_limit(128)).await;
    assert_eq!(sh(&c, &a, "echo up").await.stdout, "up\n");

    // Plain TCP connections to the daemon's listener, never finishing a request, until
    // its descriptor table is full (the rest wait in the kernel's backlog). Bounded in
    // count and time; all are closed when `held` goes.
    let mut held = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while open_fds(pid) + 2 < LIMIT as usize && Instant::now() < deadline && held.len() < 4000 {
        for _ in 0..16 {
            if let Ok(s) = tokio::net::TcpStream::connect(("127.0.0.1", d.port)).await {
                held.push(s);
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        open_fds(pid) + 2 >= LIMIT as usize,
        "the daemon's descriptors never ran out ({} of {LIMIT} after {} connections)",
        open_fds(pid),
        held.len()
    );
    // The liveness sweep runs every second: give it several passes while nothing can be
    // opened, /proc included.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let full_for_the_sweep = open_fds(pid) + 2 >= LIMIT as usize;
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
