//! The harness itself: what a test leaves in its daemon goes with it, whoever owns it.
//! The API shows each owner only their own sandboxes, so the admin key alone would miss
//! the other owners' ones and leave them running after the test.

use sandpit_tests::{Daemon, create_small, sandboxes};
use std::time::Duration;

/// Whether process `pid` has gone within 10 s (a deleted sandbox is torn down in the
/// background).
async fn gone(pid: i32) -> bool {
    for _ in 0..200 {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_deletes_every_owners_sandboxes_and_volumes() {
    let d = Daemon::start().await;
    let admin = d.client();
    let bob = d.owner("bob").await;
    let mine = create_small(&admin, None).await;
    let bobs = create_small(&bob, None).await;
    bob.create_volume("bobs", 16 << 20).await.unwrap();
    // An owner with no key left in the store: found by the sandbox it still lists.
    let carol = d.owner("carol").await;
    let carols = create_small(&carol, None).await;
    let db = d.store().await;
    for k in db.list_api_keys().await.unwrap() {
        if k.owner == "carol" {
            assert!(db.revoke_api_key(&k.id).await.unwrap());
        }
    }

    d.remove_everything().await;
    assert!(sandboxes(&admin).await.is_empty());
    assert!(sandboxes(&bob).await.is_empty());
    assert!(bob.list_volumes().await.unwrap().is_empty());
    // Their records reach a final state once the background teardown is done.
    let mut live = Vec::new();
    for _ in 0..200 {
        live = db
            .live_sandboxes()
            .await
            .unwrap()
            .into_iter()
            .map(|s| s.id)
            .filter(|id| [&mine, &bobs, &carols].contains(&id))
            .collect();
        if live.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(live.is_empty(), "still live: {live:?}");
    db.close().await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_daemon_deletes_another_owners_sandbox() {
    let d = Daemon::start().await;
    let bob = d.owner("bob").await;
    let id = create_small(&bob, None).await;
    let pid = d.agent_pid(&id).await;
    // A clean stop alone would leave the sandbox running: only the cleanup ends it.
    drop(d);
    let ended = gone(pid).await;
    if !ended {
        // Not left behind for the next test either way.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(ended, "bob's sandbox (agent pid {pid}) outlived the daemon");
}
