//! Leases (compare-and-set on lock_version) and usage metering against a real SQLite file.

use sandpit_store::{
    ExecutionRecord, LeaseRecord, LeaseStatus, Store, StoreError, UsageEvent, active_ms,
};

async fn file_store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db")).await.unwrap();
    (dir, store)
}

fn lease(owner: &str, user: &str) -> LeaseRecord {
    LeaseRecord {
        owner: owner.into(),
        user: user.into(),
        sandbox_id: None,
        status: LeaseStatus::Creating,
        paused: false,
        runtime: "container".into(),
        lock_version: 1,
        usage_ms: 0,
        last_activity_ms: 10,
        creating_since_ms: Some(10),
        created_at_ms: 10,
        updated_at_ms: 10,
    }
}

#[tokio::test]
async fn the_first_insert_wins_and_the_second_sees_the_row() {
    let (_d, s) = file_store().await;
    assert!(s.insert_lease(&lease("o", "alice")).await.unwrap());
    let mut other = lease("o", "alice");
    other.runtime = "process".into();
    assert!(!s.insert_lease(&other).await.unwrap());
    let got = s.get_lease("o", "alice").await.unwrap().unwrap();
    assert_eq!(got.runtime, "container");
    // Same user name under another owner is another lease.
    assert!(s.insert_lease(&lease("p", "alice")).await.unwrap());
    assert_eq!(s.list_leases("o").await.unwrap().len(), 1);
    assert!(s.get_lease("o", "bob").await.unwrap().is_none());
}

#[tokio::test]
async fn of_two_writers_with_the_same_version_exactly_one_wins() {
    let (_d, s) = file_store().await;
    s.insert_lease(&lease("o", "u")).await.unwrap();
    let read = s.get_lease("o", "u").await.unwrap().unwrap();
    assert_eq!(read.lock_version, 1);
    let mut a = read.clone();
    a.status = LeaseStatus::Ready;
    a.sandbox_id = Some("sb-a".into());
    let mut b = read.clone();
    b.status = LeaseStatus::Ready;
    b.sandbox_id = Some("sb-b".into());
    let (ra, rb) = tokio::join!(s.cas_lease(1, &a), s.cas_lease(1, &b));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert!(ra.is_some() != rb.is_some(), "{ra:?} {rb:?}");
    let winner = ra.or(rb).unwrap();
    assert_eq!(winner.lock_version, 2);
    let now = s.get_lease("o", "u").await.unwrap().unwrap();
    assert_eq!(now, winner);
    assert!(matches!(now.sandbox_id.as_deref(), Some("sb-a" | "sb-b")));
    // The loser re-reads, and a write with the fresh version succeeds.
    let mut again = now.clone();
    again.paused = true;
    let after = s
        .cas_lease(now.lock_version, &again)
        .await
        .unwrap()
        .unwrap();
    assert!(after.paused);
    assert_eq!(after.lock_version, 3);
    // A stale version never writes.
    assert!(s.cas_lease(2, &again).await.unwrap().is_none());
    assert!(s.cas_lease(1, &again).await.unwrap().is_none());
}

#[tokio::test]
async fn many_concurrent_writers_advance_the_version_once_each_win() {
    let (_d, s) = file_store().await;
    s.insert_lease(&lease("o", "u")).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut wins = 0;
            // Each writer makes 5 changes, re-reading after every loss.
            while wins < 5 {
                let cur = s.get_lease("o", "u").await.unwrap().unwrap();
                let mut next = cur.clone();
                next.usage_ms += 1;
                next.runtime = format!("w{i}");
                if s.cas_lease(cur.lock_version, &next)
                    .await
                    .unwrap()
                    .is_some()
                {
                    wins += 1;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let end = s.get_lease("o", "u").await.unwrap().unwrap();
    // No update was lost: 80 increments, 80 version bumps.
    assert_eq!(end.usage_ms, 80);
    assert_eq!(end.lock_version, 81);
}

#[tokio::test]
async fn compare_and_delete() {
    let (_d, s) = file_store().await;
    s.insert_lease(&lease("o", "u")).await.unwrap();
    assert!(!s.delete_lease("o", "u", 7).await.unwrap());
    assert!(s.get_lease("o", "u").await.unwrap().is_some());
    assert!(s.delete_lease("o", "u", 1).await.unwrap());
    assert!(s.get_lease("o", "u").await.unwrap().is_none());
    assert!(!s.delete_lease("o", "u", 1).await.unwrap());
}

fn state(id: &str, owner: &str, st: &str, at: i64, ends: bool) -> UsageEvent {
    UsageEvent::State {
        sandbox_id: id.into(),
        owner: owner.into(),
        state: st.into(),
        at_ms: at,
        created_at_ms: 1000,
        ends,
        cpu_base_ns: 0,
    }
}

fn sample(id: &str, at: i64, cpu: i64, mem: i64, disk: Option<i64>) -> UsageEvent {
    UsageEvent::Sample {
        sandbox_id: id.into(),
        at_ms: at,
        cpu_raw_ns: cpu,
        memory_peak_bytes: mem,
        disk_used_bytes: disk,
    }
}

#[tokio::test]
async fn usage_rows_follow_states_and_samples() {
    let (_d, s) = file_store().await;
    s.record_usage(&[
        state("sb1", "o", "running", 1000, false),
        sample("sb1", 2000, 5_000_000, 100, Some(4096)),
        state("sb1", "o", "paused", 3000, false),
        sample("sb1", 3000, 7_000_000, 50, None),
        state("sb1", "o", "running", 9000, false),
        sample("sb1", 9500, 8_000_000, 300, Some(8192)),
        state("sb1", "o", "stopping", 10_000, true),
        state("sb1", "o", "stopped", 10_500, true),
    ])
    .await
    .unwrap();
    let u = s.sandbox_usage("sb1").await.unwrap().unwrap();
    assert_eq!(u.owner, "o");
    assert_eq!(u.state, "stopped");
    assert_eq!(u.created_at_ms, 1000);
    // The first end sticks.
    assert_eq!(u.ended_at_ms, Some(10_000));
    assert_eq!(u.cpu_ns, 8_000_000);
    assert_eq!(u.memory_peak_bytes, 300);
    assert_eq!(u.disk_used_bytes, Some(8192));
    assert_eq!(u.egress_bytes, 0);
    assert_eq!(u.states.len(), 5);
    assert_eq!(active_ms(&u.states, 0, 20_000), 2000 + 1000);

    let period = s.owner_usage("o", 0, 20_000).await.unwrap();
    assert_eq!(period.sandboxes.len(), 1);
    assert_eq!(period.cpu_ns, 8_000_000);
    let cpu = period.log.iter().find(|(r, _, _)| r == "cpu").unwrap();
    assert_eq!((cpu.1, cpu.2), (3, 8_000_000));
    // Periods: CPU counts where it was sampled; sandboxes where they lived.
    let early = s.owner_usage("o", 0, 2500).await.unwrap();
    assert_eq!(early.cpu_ns, 5_000_000);
    assert_eq!(early.sandboxes.len(), 1);
    let after = s.owner_usage("o", 11_000, 20_000).await.unwrap();
    assert!(after.sandboxes.is_empty());
    assert_eq!(after.cpu_ns, 0);
    assert!(
        s.owner_usage("other", 0, 20_000)
            .await
            .unwrap()
            .sandboxes
            .is_empty()
    );
    assert!(s.sandbox_usage("nope").await.unwrap().is_none());
}

#[tokio::test]
async fn pool_base_and_counter_resets_are_accounted() {
    let (_d, s) = file_store().await;
    let claimed = UsageEvent::State {
        sandbox_id: "p1".into(),
        owner: "o".into(),
        state: "running".into(),
        at_ms: 100,
        created_at_ms: 100,
        ends: false,
        cpu_base_ns: 40_000,
    };
    // A sample of a sandbox without a usage row (an idle pool member) is ignored.
    s.record_usage(&[sample("p1", 50, 30_000, 1, None)])
        .await
        .unwrap();
    assert!(s.sandbox_usage("p1").await.unwrap().is_none());
    s.record_usage(&[
        claimed,
        sample("p1", 200, 50_000, 1, None),
        // The cgroup was recreated: the counter restarted from zero.
        sample("p1", 300, 7_000, 1, None),
    ])
    .await
    .unwrap();
    let u = s.sandbox_usage("p1").await.unwrap().unwrap();
    assert_eq!(u.cpu_ns, 10_000 + 7_000);
}

fn execution(id: &str, sb: &str, created: i64) -> ExecutionRecord {
    ExecutionRecord {
        id: id.into(),
        sandbox_id: sb.into(),
        owner: "o".into(),
        api_key_id: Some("k1".into()),
        command: "sh".into(),
        pid: Some(7),
        background: false,
        created_at_ms: created,
        started_at_ms: Some(created + 1),
        ended_at_ms: Some(created + 5),
        cpu_time_ms: Some(3),
        memory_peak_kb: Some(2048),
        exit_code: Some(0),
        timed_out: false,
        stdout_bytes: 8,
        stderr_bytes: 0,
    }
}

#[tokio::test]
async fn executions_page_newest_first_and_replace_by_id() {
    let (_d, s) = file_store().await;
    let mut events = Vec::new();
    for i in 0..7 {
        events.push(UsageEvent::Execution(execution(
            &format!("ex{i}"),
            "sb",
            100 + i,
        )));
    }
    // Two with the same timestamp order by id.
    events.push(UsageEvent::Execution(execution("ex9", "sb", 106)));
    events.push(UsageEvent::Execution(execution("other", "sb2", 1)));
    s.record_usage(&events).await.unwrap();
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = s.list_executions("sb", 3, cursor.as_deref()).await.unwrap();
        assert!(page.items.len() <= 3);
        seen.extend(page.items.iter().map(|e| e.id.clone()));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(
        seen,
        ["ex9", "ex6", "ex5", "ex4", "ex3", "ex2", "ex1", "ex0"]
    );
    assert_eq!(s.count_executions("sb").await.unwrap(), 8);
    // A background record is completed later under the same id.
    let mut bg = execution("bg", "sb2", 50);
    bg.background = true;
    bg.ended_at_ms = None;
    bg.exit_code = None;
    s.record_usage(&[UsageEvent::Execution(bg.clone())])
        .await
        .unwrap();
    bg.ended_at_ms = Some(60);
    bg.exit_code = Some(3);
    s.record_usage(&[UsageEvent::Execution(bg)]).await.unwrap();
    let page = s.list_executions("sb2", 10, None).await.unwrap();
    assert_eq!(page.items.len(), 2);
    let got = page.items.iter().find(|e| e.id == "bg").unwrap();
    assert_eq!((got.ended_at_ms, got.exit_code), (Some(60), Some(3)));
    assert!(matches!(
        s.list_executions("sb", 3, Some("zz")).await,
        Err(StoreError::InvalidCursor)
    ));
    let period = s.owner_usage("o", 100, 104).await.unwrap();
    assert_eq!(period.executions, 4);
}

#[tokio::test]
async fn open_usage_of_vanished_sandboxes_is_closed() {
    let (_d, s) = file_store().await;
    s.record_usage(&[
        state("live", "o", "running", 1000, false),
        state("gone", "o", "running", 1000, false),
        sample("gone", 4000, 1, 1, None),
    ])
    .await
    .unwrap();
    assert_eq!(s.close_orphaned_usage(&["live".into()]).await.unwrap(), 1);
    let gone = s.sandbox_usage("gone").await.unwrap().unwrap();
    assert_eq!(gone.ended_at_ms, Some(4000));
    assert_eq!(active_ms(&gone.states, 0, 99_999), 3000);
    let live = s.sandbox_usage("live").await.unwrap().unwrap();
    assert_eq!(live.ended_at_ms, None);
    assert_eq!(s.close_orphaned_usage(&["live".into()]).await.unwrap(), 0);
}
