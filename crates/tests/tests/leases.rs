//! Per-user leases against a real daemon and real sandboxes: concurrent acquires, resume,
//! replacement of dead sandboxes, stale `creating` rows, the `with_sandbox` wrapper, and
//! bad input.

use sandpit_api::{CreateSandboxRequest, RunCommandRequest};
use sandpit_client::{Client, ClientError, SandboxLease};
use sandpit_store::{LeaseRecord, LeaseStatus};
use sandpit_tests::{Daemon, http, now_ms, sandboxes, sh, small_request, wait_no_leftovers};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

fn lease_label(user: &str) -> Vec<(String, String)> {
    vec![("sandpit-lease".to_string(), user.to_string())]
}

/// Sandboxes labelled as `user`'s lease sandbox, in any state but stopping.
async fn lease_sandboxes(c: &Client, user: &str) -> Vec<sandpit_api::Sandbox> {
    c.list_sandboxes(None, &lease_label(user), Some(1000), None)
        .await
        .unwrap()
        .items
}

/// Kills a sandbox from outside (as the OOM killer would) and waits until the daemon has
/// noticed (its liveness sweep runs every second).
async fn kill_sandbox(d: &Daemon, id: &str) {
    let pid = d.agent_pid(id).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let c = d.client();
    for _ in 0..400 {
        match c.get_sandbox(id).await {
            Ok(sb) if sb.state == "running" => {}
            _ => return,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the daemon never noticed that sandbox {id} died");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_acquires_share_one_sandbox_created_once() {
    let d = Daemon::start().await;
    let c = d.client();
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.acquire("alice", &small_request()).await
        }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap().expect("acquire"));
    }
    let id = got[0].sandbox.id.clone();
    assert!(
        got.iter().all(|a| a.sandbox.id == id),
        "different sandboxes"
    );
    assert!(got.iter().all(|a| a.sandbox.state == "running"));
    assert_eq!(got.iter().filter(|a| a.created).count(), 1);
    assert!(got.iter().all(|a| a.lease.status == "ready"));
    assert!(
        got.iter()
            .all(|a| a.lease.sandbox_id.as_deref() == Some(id.as_str()))
    );
    // Exactly one sandbox exists at all: one create.
    let all = c.list_sandboxes(None, &[], Some(1000), None).await.unwrap();
    assert_eq!(all.items.len(), 1, "{:?}", all.items);
    assert_eq!(all.items[0].metadata.get("sandpit-lease").unwrap(), "alice");
    assert_eq!(sh(&c, &id, "echo ok").await.stdout, "ok\n");

    // Later acquires return it without creating.
    let again = c.acquire("alice", &small_request()).await.unwrap();
    assert_eq!(again.sandbox.id, id);
    assert!(!again.created && !again.resumed);
    // Another user gets another sandbox.
    let bob = c.acquire("bob", &small_request()).await.unwrap();
    assert_ne!(bob.sandbox.id, id);
    assert!(bob.created);
    let leases = c.list_leases().await.unwrap();
    let users: Vec<&str> = leases.iter().map(|l| l.user.as_str()).collect();
    assert_eq!(users, ["alice", "bob"]);
    let lease = c.get_lease("alice").await.unwrap();
    assert_eq!(lease.sandbox_id.as_deref(), Some(id.as_str()));
    assert!(lease.lock_version >= 2, "{lease:?}");
    assert!(!lease.paused);

    // Release destroys the sandbox; `keep` leaves it running.
    c.release("alice", false).await.unwrap();
    assert_eq!(c.get_lease("alice").await.unwrap_err().status(), Some(404));
    assert_eq!(wait_no_leftovers(&d, &id).await, Vec::<String>::new());
    assert!(c.get_sandbox(&id).await.unwrap_err().is_sandbox_gone());
    c.release("bob", true).await.unwrap();
    assert_eq!(
        c.get_sandbox(&bob.sandbox.id).await.unwrap().state,
        "running"
    );
    assert_eq!(
        c.release("bob", false).await.unwrap_err().status(),
        Some(404)
    );
    // A new acquire after a release starts a new lease.
    let fresh = c.acquire("alice", &small_request()).await.unwrap();
    assert!(fresh.created);
    assert_ne!(fresh.sandbox.id, id);
    d.shutdown().await;
}

#[tokio::test]
async fn a_paused_sandbox_is_resumed_and_a_dead_one_replaced() {
    let d = Daemon::start().await;
    let c = d.client();
    let first = c.acquire("carol", &small_request()).await.unwrap();
    let id = first.sandbox.id.clone();
    sh(&c, &id, "echo kept > /tmp/mark").await;
    c.pause(&id).await.unwrap();
    assert!(c.get_lease("carol").await.unwrap().paused);
    let resumed = c.acquire("carol", &small_request()).await.unwrap();
    assert_eq!(resumed.sandbox.id, id);
    assert!(resumed.resumed && !resumed.created);
    assert_eq!(resumed.sandbox.state, "running");
    assert!(!resumed.lease.paused);
    assert_eq!(sh(&c, &id, "cat /tmp/mark").await.stdout, "kept\n");
    // Hibernated (files kept, processes ended): woken by the acquire, on the same files.
    c.hibernate(&id).await.unwrap();
    assert!(c.get_lease("carol").await.unwrap().paused);
    let woken = c.acquire("carol", &small_request()).await.unwrap();
    assert_eq!(woken.sandbox.id, id);
    assert!(woken.resumed && !woken.created);
    assert_eq!(woken.sandbox.state, "running");
    assert_eq!(sh(&c, &id, "cat /tmp/mark").await.stdout, "kept\n");

    // Killed from outside: the next acquire creates a replacement.
    kill_sandbox(&d, &id).await;
    let replaced = c.acquire("carol", &small_request()).await.unwrap();
    assert_ne!(replaced.sandbox.id, id);
    assert!(replaced.created);
    assert_eq!(
        sh(&c, &replaced.sandbox.id, "echo new").await.stdout,
        "new\n"
    );
    // Deleted through the API: replaced too.
    c.delete_sandbox(&replaced.sandbox.id).await.unwrap();
    let third = c.acquire("carol", &small_request()).await.unwrap();
    assert!(third.created);
    assert_ne!(third.sandbox.id, replaced.sandbox.id);
    let running: Vec<_> = lease_sandboxes(&c, "carol")
        .await
        .into_iter()
        .filter(|s| s.state == "running")
        .collect();
    assert_eq!(running.len(), 1);
    assert_eq!(running[0].id, third.sandbox.id);
    d.shutdown().await;
}

fn creating(user: &str, since_ms: i64, version: i64) -> LeaseRecord {
    LeaseRecord {
        owner: "admin".into(),
        user: user.into(),
        sandbox_id: None,
        status: LeaseStatus::Creating,
        paused: false,
        runtime: "container".into(),
        lock_version: version,
        usage_ms: 0,
        last_activity_ms: since_ms,
        creating_since_ms: Some(since_ms),
        created_at_ms: since_ms,
        updated_at_ms: since_ms,
    }
}

fn takeovers(log: &std::path::Path, user: &str) -> usize {
    let text = std::fs::read_to_string(log).unwrap();
    text.lines()
        .filter(|l| l.contains("taking it over") && l.contains(&format!("user=\"{user}\"")))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_creating_record_is_taken_over_with_one_warning() {
    let mut d = Daemon::start().await;
    d.stop();
    // What a daemon that crashed mid-create leaves behind: a row in `creating`, 30 s old
    // (the default stale timeout is 25 s).
    let db = d.store().await;
    assert!(
        db.insert_lease(&creating("old", now_ms() - 30_000, 7))
            .await
            .unwrap()
    );
    db.close().await;
    let log = d.data.path().join("daemon.log");
    let d = d.restart().log(&log).log_level("warn").start().await;
    let c = d.client();
    // Several acquirers meet the stale row at once: one takes it over, all get its sandbox.
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.acquire("old", &small_request()).await
        }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap().expect("acquire"));
    }
    let id = got[0].sandbox.id.clone();
    assert!(got.iter().all(|a| a.sandbox.id == id));
    assert_eq!(got.iter().filter(|a| a.created).count(), 1);
    let lease = c.get_lease("old").await.unwrap();
    assert_eq!(lease.status, "ready");
    // Taken over (8) and published (9), at least.
    assert!(lease.lock_version >= 9, "{lease:?}");
    assert_eq!(lease_sandboxes(&c, "old").await.len(), 1);
    assert_eq!(
        takeovers(&log, "old"),
        1,
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    d.shutdown().await;
}

#[tokio::test]
async fn the_stale_timeout_is_configurable_and_fresh_rows_are_waited_for() {
    let mut d = Daemon::start().await;
    d.stop();
    let db = d.store().await;
    // Fresh when the daemon starts; stale after 2 s with `--lease-stale-secs 2`.
    assert!(
        db.insert_lease(&creating("fresh", now_ms(), 1))
            .await
            .unwrap()
    );
    db.close().await;
    let log = d.data.path().join("daemon.log");
    let d = d
        .restart()
        .args(&["--lease-stale-secs", "2"])
        .log(&log)
        .log_level("warn")
        .start()
        .await;
    let c = d.client();
    let got = c.acquire("fresh", &small_request()).await.unwrap();
    assert!(got.created);
    assert_eq!(takeovers(&log, "fresh"), 1);
    // The acquirer waited for the row to go stale: the takeover came after its creation
    // time plus the timeout (read from the lease, not from a clock in this test).
    let lease = c.get_lease("fresh").await.unwrap();
    assert!(
        lease.last_activity_ms - lease.created_at_ms >= 2000,
        "{lease:?}"
    );
    // A healthy lease is never taken over.
    let again = c.acquire("fresh", &small_request()).await.unwrap();
    assert_eq!(again.sandbox.id, got.sandbox.id);
    assert_eq!(takeovers(&log, "fresh"), 1);
    d.shutdown().await;
}

#[tokio::test]
async fn with_sandbox_recreates_a_killed_sandbox_once_and_propagates_other_errors() {
    let d = Daemon::start().await;
    let c = d.client();
    // Without auto-resume, a call to a paused sandbox fails (409) instead of waking it.
    let no_auto = CreateSandboxRequest {
        auto_resume: Some(false),
        ..small_request()
    };
    let lease = SandboxLease::new(c.clone(), "dora", no_auto);
    let calls = Arc::new(AtomicU32::new(0));
    let run = |argv: &[&str]| RunCommandRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let first = lease
        .with_sandbox(|c, id| {
            calls.fetch_add(1, Ordering::SeqCst);
            let req = run(&["sh", "-c", "echo one > /tmp/f; cat /tmp/f"]);
            async move { c.run(&id, &req).await.map(|r| (id, r.stdout)) }
        })
        .await
        .unwrap();
    assert_eq!(first.1, "one\n");
    assert_eq!(calls.swap(0, Ordering::SeqCst), 1);
    let old = first.0;

    kill_sandbox(&d, &old).await;
    let second = lease
        .with_sandbox(|c, id| {
            calls.fetch_add(1, Ordering::SeqCst);
            let req = run(&["sh", "-c", "cat /tmp/f 2>/dev/null || echo fresh"]);
            async move { c.run(&id, &req).await.map(|r| (id, r.stdout)) }
        })
        .await
        .unwrap();
    // Ran twice: once on the dead sandbox (sandbox gone), once on its replacement.
    assert_eq!(calls.swap(0, Ordering::SeqCst), 2);
    assert_ne!(second.0, old);
    assert_eq!(second.1, "fresh\n");
    assert_eq!(lease.sandbox_id().await.unwrap(), second.0);
    let running: Vec<_> = lease_sandboxes(&c, "dora")
        .await
        .into_iter()
        .filter(|s| s.state == "running")
        .collect();
    assert_eq!(running.len(), 1);

    // Not "sandbox gone": a missing file, a program that does not exist, a paused
    // sandbox. Each propagates at once, unchanged, without a new sandbox.
    let err = lease
        .with_sandbox(|c, id| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move { c.stat(&id, "/no/such/file").await }
        })
        .await
        .unwrap_err();
    assert_eq!((err.status(), err.code()), (Some(404), Some("not_found")));
    assert_eq!(calls.swap(0, Ordering::SeqCst), 1);
    let err = lease
        .with_sandbox(|c, id| {
            calls.fetch_add(1, Ordering::SeqCst);
            let req = run(&["/no/such/program"]);
            async move { c.run(&id, &req).await }
        })
        .await
        .unwrap_err();
    assert!(!err.is_sandbox_gone(), "{err:?}");
    assert!(matches!(err, ClientError::Api { .. }), "{err:?}");
    assert_eq!(calls.swap(0, Ordering::SeqCst), 1);
    c.pause(&second.0).await.unwrap();
    let err = lease
        .with_sandbox(|c, id| {
            calls.fetch_add(1, Ordering::SeqCst);
            let req = run(&["true"]);
            async move { c.run(&id, &req).await }
        })
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(409), "{err:?}");
    assert_eq!(calls.swap(0, Ordering::SeqCst), 1);
    assert_eq!(lease.sandbox_id().await.unwrap(), second.0);
    // No sandbox was created for those: the only live one is the replacement.
    let live: Vec<String> = lease_sandboxes(&c, "dora")
        .await
        .into_iter()
        .filter(|s| matches!(s.state.as_str(), "running" | "paused"))
        .map(|s| s.id)
        .collect();
    assert_eq!(live, std::slice::from_ref(&second.0));
    d.shutdown().await;
}

#[tokio::test]
async fn bad_users_and_bodies_are_refused_and_leave_nothing_behind() {
    let d = Daemon::start().await;
    let c = d.client();
    for bad in ["a b", "ü", "x/y", &"u".repeat(129), "a\"b", "%00"] {
        let err = c.acquire(bad, &small_request()).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{bad:?}: {err:?}");
        assert_eq!(err.code(), Some("invalid_argument"));
    }
    // URL parsing folds `.` and `..` away before a request leaves the client (the daemon
    // refuses them too, see the unit tests); whatever route they reach, nothing is made.
    for dots in [".", ".."] {
        let err = c.acquire(dots, &small_request()).await.unwrap_err();
        assert!(
            err.status().is_some_and(|s| (400..500).contains(&s)),
            "{err:?}"
        );
    }
    assert!(c.list_leases().await.unwrap().is_empty());
    let url = format!("{}/v1/leases/ok/acquire", d.url);
    let http = http();
    let auth = format!("Bearer {}", d.key);
    for body in ["{", "[]", "{\"template\": 5}", "{\"nope\": 1}"] {
        let r = http
            .post(&url)
            .header("authorization", &auth)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400, "{body}");
    }
    // A create that fails (unknown template) hands the lease back at once: the next
    // acquire does not wait out a stale timeout, and creates.
    let bad = CreateSandboxRequest {
        template: Some("no-such-template".into()),
        ..small_request()
    };
    let err = c.acquire("ok", &bad).await.unwrap_err();
    assert_eq!(err.status(), Some(404), "{err:?}");
    let lease = c.get_lease("ok").await.unwrap();
    assert_eq!((lease.status.as_str(), lease.sandbox_id), ("ready", None));
    assert!(sandboxes(&c).await.is_empty());
    let good = tokio::time::timeout(Duration::from_secs(20), c.acquire("ok", &small_request()))
        .await
        .expect("no stale wait")
        .unwrap();
    assert!(good.created);
    // Other owners neither see nor touch the lease; their own "ok" is another lease.
    let m = d.owner("mallory").await;
    assert!(m.list_leases().await.unwrap().is_empty());
    assert_eq!(m.get_lease("ok").await.unwrap_err().status(), Some(404));
    assert_eq!(
        m.release("ok", false).await.unwrap_err().status(),
        Some(404)
    );
    let theirs = m.acquire("ok", &small_request()).await.unwrap();
    assert_ne!(theirs.sandbox.id, good.sandbox.id);
    assert!(
        m.get_sandbox(&good.sandbox.id)
            .await
            .unwrap_err()
            .is_sandbox_gone()
    );
    m.release("ok", false).await.unwrap();
    assert_eq!(
        c.get_lease("ok").await.unwrap().sandbox_id,
        Some(good.sandbox.id)
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_acquires_lists_and_releases() {
    let d = Daemon::start().await;
    let (ok, out, err) = d.cli(&["lease", "acquire", "erin", "--memory", "256M"]);
    assert!(ok, "{err}");
    let id = out.trim().to_string();
    let c = d.client();
    let sb = c.get_sandbox(&id).await.unwrap();
    assert_eq!(sb.limits.memory_bytes, 256 << 20);
    let (ok, again, _) = d.cli(&["lease", "acquire", "erin"]);
    assert!(ok);
    assert_eq!(again.trim(), id);
    let (ok, table, _) = d.cli(&["lease", "ls"]);
    assert!(ok);
    assert!(table.starts_with("USER"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("erin") && l.contains(&id)),
        "{table}"
    );
    let (ok, json, _) = d.cli(&["--json", "lease", "ls"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v[0]["user"], "erin");
    assert_eq!(v[0]["status"], "ready");
    let (ok, _, err) = d.cli(&["lease", "acquire", "bad user"]);
    assert!(!ok);
    assert!(err.contains("user must be"), "{err}");
    let (ok, out, _) = d.cli(&["lease", "rm", "erin"]);
    assert!(ok);
    assert_eq!(out.trim(), "released erin");
    assert!(c.get_sandbox(&id).await.unwrap_err().is_sandbox_gone());
    let (ok, _, err) = d.cli(&["lease", "rm", "erin"]);
    assert!(!ok);
    assert!(err.contains("no lease"), "{err}");
    d.shutdown().await;
}
