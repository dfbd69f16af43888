//! The lifecycle state machine (manager, lifecycle, pools, leases, reconcile) driven
//! through the in-memory runtime of [`crate::testing`]: no root, no namespaces, no
//! cgroups, no mounts; the agent is the real router, served in-process.

use crate::agent_conn::AgentConn;
use crate::error::CoreError;
use crate::manager::Manager;
use crate::pools::POOL_OWNER;
use crate::testing::{Bed, Call, FakeRuntime, Phase, Step};
use sandpit_api::{CreateSandboxRequest, PoolSpec};
use sandpit_runtime::{Liveness, Runtime, SandboxHandle};
use sandpit_store::{SandboxRecord, SandboxState};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

fn req() -> CreateSandboxRequest {
    CreateSandboxRequest::default()
}

async fn record(m: &Manager, id: &str) -> Option<SandboxRecord> {
    m.store.get_sandbox(id).await.unwrap()
}

async fn state(m: &Manager, id: &str) -> Option<SandboxState> {
    record(m, id).await.map(|r| r.state)
}

fn handle(m: &Manager, rec: &SandboxRecord) -> SandboxHandle {
    m.runtime_of(rec).unwrap().1
}

/// Whether the sandbox's agent answers its health check within `within` (on a fresh
/// connection, not the manager's).
async fn answers(h: &SandboxHandle, within: Duration) -> bool {
    let conn = AgentConn::new(h.socket.clone());
    matches!(tokio::time::timeout(within, conn.healthy()).await, Ok(true))
}

/// The ids the fake was asked to start, in order.
fn started(fake: &FakeRuntime) -> Vec<String> {
    fake.calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::Start(id) => Some(id),
            _ => None,
        })
        .collect()
}

fn calls_of(fake: &FakeRuntime, f: impl Fn(&Call) -> bool) -> usize {
    fake.count(f)
}

/// Waits until `f` holds (panics after five seconds).
async fn eventually(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !f().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_runs_until_deleted_and_is_torn_down_once() {
    let bed = Bed::new().await;
    let (m, fake) = (&bed.m, &bed.fake);
    let rec = m
        .create(
            "alice",
            CreateSandboxRequest {
                user: Some("root".into()),
                env: [("GREETING".to_string(), "hi".to_string())].into(),
                ..req()
            },
        )
        .await
        .unwrap();
    assert_eq!(rec.state, SandboxState::Running);
    assert_eq!(rec.owner, "alice");
    assert_eq!(fake.phase(&rec.id), Some(Phase::Running));
    assert_eq!(started(fake), std::slice::from_ref(&rec.id));
    // The agent's own /init took the default user; its env is the sandbox's.
    let cfg = fake.agent_config(&rec.id).unwrap();
    assert_eq!(cfg.default_user().as_deref(), Some("root"));
    assert_eq!(cfg.env().get("GREETING").map(String::as_str), Some("hi"));
    let (_, conn) = m.agent("alice", &rec.id).await.unwrap();
    assert!(conn.healthy().await);
    drop(conn);
    assert_eq!(m.get("alice", &rec.id).await.unwrap().id, rec.id);
    assert!(matches!(
        m.get("bob", &rec.id).await.unwrap_err(),
        CoreError::SandboxNotFound(_)
    ));

    let h = handle(m, &rec);
    m.destroy(&rec).await.unwrap();
    // Gone for callers at once, before the teardown has finished.
    assert!(matches!(
        m.get("alice", &rec.id).await.unwrap_err(),
        CoreError::SandboxNotFound(_)
    ));
    assert_eq!(calls_of(fake, |c| *c == Call::BeginStop(rec.id.clone())), 1);
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(record(m, &rec.id).await, None);
    assert_eq!(fake.destroys(&rec.id), 1);
    assert!(fake.held().is_empty());
    assert!(!answers(&h, Duration::from_millis(500)).await);
    // A second delete has nothing left to do.
    m.destroy(&rec).await.unwrap();
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(fake.destroys(&rec.id), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_create_or_start_leaves_nothing_behind() {
    let bed = Bed::new().await;
    let (m, fake) = (&bed.m, &bed.fake);

    fake.fail(Step::Create, 1);
    m.create("alice", req()).await.unwrap_err();
    assert!(m.store.live_sandboxes().await.unwrap().is_empty());
    assert!(fake.held().is_empty());
    // Nothing was made, so nothing is destroyed.
    assert_eq!(calls_of(fake, |c| matches!(c, Call::Destroy(_))), 0);

    fake.fail(Step::Start, 1);
    m.create("alice", req()).await.unwrap_err();
    let [id]: [String; 1] = started(fake).try_into().unwrap();
    assert_eq!(record(m, &id).await, None);
    assert_eq!(fake.destroys(&id), 1);
    assert!(fake.held().is_empty());

    let ok = m.create("alice", req()).await.unwrap();
    assert_eq!(fake.held(), std::slice::from_ref(&ok.id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_during_create_tears_down_once() {
    let bed = Bed::new().await;
    let (m, fake) = (bed.m.clone(), bed.fake.clone());
    let hold = fake.hold(Step::Start);
    let creating = tokio::spawn({
        let m = m.clone();
        async move { m.create("alice", req()).await }
    });
    hold.entered(1).await;
    let [rec]: [SandboxRecord; 1] = m.store.live_sandboxes().await.unwrap().try_into().unwrap();
    assert_eq!(rec.state, SandboxState::Creating);
    assert_eq!(fake.phase(&rec.id), Some(Phase::Created));
    // The visible record has no handle yet: the delete removes the record and leaves the
    // runtime side to the create.
    m.destroy(&rec).await.unwrap();
    assert_eq!(record(&m, &rec.id).await, None);
    assert_eq!(fake.destroys(&rec.id), 0);

    hold.release();
    let err = creating.await.unwrap().unwrap_err();
    assert!(matches!(err, CoreError::Conflict(_)), "{err}");
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(fake.destroys(&rec.id), 1);
    assert!(fake.held().is_empty());
    assert_eq!(record(&m, &rec.id).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_while_the_agent_is_silent_ends_the_create_soon() {
    let bed = Bed::new().await;
    let (m, fake) = (bed.m.clone(), bed.fake.clone());
    let hold = fake.hold(Step::Start);
    let creating = tokio::spawn({
        let m = m.clone();
        async move { m.create("alice", req()).await }
    });
    hold.entered(1).await;
    let [rec]: [SandboxRecord; 1] = m.store.live_sandboxes().await.unwrap().try_into().unwrap();
    fake.silence(&rec.id);
    hold.release();
    // The create now waits for an agent that never answers; the delete comes in.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rec = record(&m, &rec.id).await.expect("still there");
    let started = std::time::Instant::now();
    m.destroy(&rec).await.unwrap();
    let err = creating.await.unwrap().unwrap_err();
    assert!(matches!(err, CoreError::Conflict(_)), "{err}");
    // One health check's bound (2 s) at most, not the agent's 10 s deadline.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the create noticed the delete only after {:?}",
        started.elapsed()
    );
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(fake.destroys(&rec.id), 1);
    assert_eq!(record(&m, &rec.id).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_racing_the_liveness_sweep_tear_down_once() {
    let bed = Bed::new().await;
    let (m, fake) = (&bed.m, &bed.fake);
    let mut recs = Vec::new();
    for _ in 0..8 {
        recs.push(m.create("alice", req()).await.unwrap());
    }
    for r in &recs {
        fake.die(&r.id);
    }
    let deletes = futures::future::join_all(recs.iter().map(|r| m.destroy(r)));
    let (deleted, ()) = tokio::join!(deletes, m.tick());
    for d in deleted {
        d.unwrap();
    }
    m.drain_teardowns(Duration::from_secs(5)).await;
    m.tick().await;
    for r in &recs {
        assert_eq!(fake.destroys(&r.id), 1, "{}", r.id);
        let s = state(m, &r.id).await;
        assert!(matches!(s, None | Some(SandboxState::Stopped)), "{s:?}");
    }
    assert!(fake.held().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_during_the_sweeps_teardown_does_not_tear_down_again() {
    let bed = Bed::new().await;
    let (m, fake) = (bed.m.clone(), bed.fake.clone());
    let rec = m.create("alice", req()).await.unwrap();
    fake.die(&rec.id);
    let hold = fake.hold(Step::Destroy);
    let sweep = tokio::spawn({
        let m = m.clone();
        async move { m.tick().await }
    });
    hold.entered(1).await;
    assert_eq!(state(&m, &rec.id).await, Some(SandboxState::Stopping));
    m.destroy(&rec).await.unwrap();
    hold.release();
    sweep.await.unwrap();
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(fake.destroys(&rec.id), 1);
    assert!(fake.held().is_empty());
    // Whatever record is left is final, and deleting it needs no teardown. (Today the
    // sweep's `stopped` survives the delete that came in during its teardown.)
    if let Some(left) = record(&m, &rec.id).await {
        assert!(left.state.is_final(), "{}", left.state);
        m.destroy(&left).await.unwrap();
        assert_eq!(record(&m, &rec.id).await, None);
    }
    assert_eq!(fake.destroys(&rec.id), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_during_a_deletes_teardown_does_not_tear_down_again() {
    let bed = Bed::new().await;
    let (m, fake) = (&bed.m, &bed.fake);
    let rec = m.create("alice", req()).await.unwrap();
    fake.die(&rec.id);
    let hold = fake.hold(Step::Destroy);
    m.destroy(&rec).await.unwrap();
    hold.entered(1).await;
    m.tick().await;
    hold.release();
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(fake.destroys(&rec.id), 1);
    assert_eq!(record(m, &rec.id).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_liveness_never_tears_down_and_dead_does() {
    let bed = Bed::new().await;
    let (m, fake) = (&bed.m, &bed.fake);
    let rec = m.create("alice", req()).await.unwrap();
    let h = handle(m, &rec);
    fake.set_liveness(
        &rec.id,
        Some(Liveness::Unknown("read /proc: too many open files".into())),
    );
    for _ in 0..3 {
        m.tick().await;
    }
    assert!(calls_of(fake, |c| *c == Call::Liveness(rec.id.clone())) >= 3);
    assert_eq!(state(m, &rec.id).await, Some(SandboxState::Running));
    assert_eq!(fake.destroys(&rec.id), 0);
    assert!(answers(&h, Duration::from_secs(2)).await);

    fake.set_liveness(&rec.id, None);
    fake.die(&rec.id);
    m.tick().await;
    let stopped = record(m, &rec.id).await.unwrap();
    assert_eq!(stopped.state, SandboxState::Stopped);
    assert!(
        stopped.error.as_deref().unwrap_or("").contains("exited"),
        "{:?}",
        stopped.error
    );
    assert_eq!(fake.destroys(&rec.id), 1);
    m.tick().await;
    assert_eq!(fake.destroys(&rec.id), 1);
    assert!(fake.held().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_pool_member_that_dies_is_forgotten() {
    let bed = Bed::new().await;
    let m = bed.m.clone();
    let fake = &bed.fake;
    let members = fill_pool(&m, "warm", 1).await;
    m.stop_pools(Duration::from_secs(5)).await;
    fake.die(&members[0]);
    m.tick().await;
    // Nobody can see an unclaimed member's record: it goes with its sandbox.
    assert_eq!(record(&m, &members[0]).await, None);
    assert_eq!(fake.destroys(&members[0]), 1);
    // And it is no longer handed out: the next create starts cold.
    let rec = m.create("alice", req()).await.unwrap();
    assert_ne!(rec.id, members[0]);
    assert_eq!(rec.pool, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_are_idempotent() {
    let bed = Bed::new().await;
    let (m, fake) = (&bed.m, &bed.fake);
    let rec = m.create("alice", req()).await.unwrap();
    let h = handle(m, &rec);
    let freezes = || calls_of(fake, |c| *c == Call::Freeze(rec.id.clone()));
    let thaws = || calls_of(fake, |c| *c == Call::Thaw(rec.id.clone()));

    let (a, b) = tokio::join!(m.pause(&rec, true), m.pause(&rec, true));
    assert_eq!(a.unwrap().state, SandboxState::Paused);
    assert_eq!(b.unwrap().state, SandboxState::Paused);
    assert_eq!(
        m.pause(&rec, true).await.unwrap().state,
        SandboxState::Paused
    );
    assert_eq!(freezes(), 1);
    assert_eq!(fake.phase(&rec.id), Some(Phase::Frozen));
    assert!(!answers(&h, Duration::from_millis(300)).await);
    // The sweep looks at running sandboxes only; a frozen one is left alone.
    m.tick().await;
    assert_eq!(state(m, &rec.id).await, Some(SandboxState::Paused));

    let (a, b) = tokio::join!(m.resume(&rec), m.resume(&rec));
    assert_eq!(a.unwrap().state, SandboxState::Running);
    assert_eq!(b.unwrap().state, SandboxState::Running);
    assert_eq!(m.resume(&rec).await.unwrap().state, SandboxState::Running);
    assert_eq!(thaws(), 1);
    assert!(answers(&h, Duration::from_secs(2)).await);

    // A freeze that fails changes nothing.
    fake.fail(Step::Freeze, 1);
    m.pause(&rec, true).await.unwrap_err();
    assert_eq!(state(m, &rec.id).await, Some(SandboxState::Running));
    assert!(answers(&h, Duration::from_secs(2)).await);

    // A thaw that fails leaves it paused; the next request to its agent resumes it.
    m.pause(&rec, true).await.unwrap();
    fake.fail(Step::Thaw, 1);
    m.resume(&rec).await.unwrap_err();
    assert_eq!(state(m, &rec.id).await, Some(SandboxState::Paused));
    let (running, conn) = m.agent("alice", &rec.id).await.unwrap();
    assert_eq!(running.state, SandboxState::Running);
    assert!(conn.healthy().await);
    assert_eq!(freezes(), 3);
    assert_eq!(thaws(), 3);
}

/// Defines pool `name` of `size` default sandboxes, runs the refiller until it is full and
/// returns the members' ids.
async fn fill_pool(m: &Arc<Manager>, name: &str, size: u32) -> Vec<String> {
    let spec = PoolSpec {
        name: name.into(),
        size,
        ..Default::default()
    };
    m.create_pool(&spec).await.unwrap();
    tokio::spawn(m.clone().run_pools());
    eventually("the pool is full", async || {
        m.pools.view(name).is_some_and(|v| v.ready == size)
    })
    .await;
    let members: Vec<String> = m
        .store
        .live_sandboxes()
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.owner == POOL_OWNER && r.pool.as_deref() == Some(name))
        .map(|r| r.id)
        .collect();
    assert_eq!(members.len(), size as usize);
    members
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_get_the_same_pool_member() {
    let bed = Bed::new().await;
    let m = bed.m.clone();
    let members = fill_pool(&m, "warm", 4).await;
    let owners = ["a", "b", "c", "d", "e", "f"];
    let made = futures::future::join_all(owners.iter().map(|o| m.create(o, req()))).await;
    let made: Vec<SandboxRecord> = made.into_iter().map(Result::unwrap).collect();
    m.stop_pools(Duration::from_secs(5)).await;
    let ids: BTreeSet<&str> = made.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids.len(), owners.len(), "a sandbox was handed out twice");
    // Every member that was ready went to exactly one caller, and is that caller's.
    for member in &members {
        let got: Vec<&SandboxRecord> = made.iter().filter(|r| &r.id == member).collect();
        assert_eq!(got.len(), 1, "member {member}");
        let stored = record(&m, member).await.unwrap();
        assert_eq!(stored.owner, got[0].owner);
        assert_eq!(stored.state, SandboxState::Running);
    }
    for r in &made {
        assert_eq!(state(&m, &r.id).await, Some(SandboxState::Running));
        assert!(answers(&handle(&m, r), Duration::from_secs(2)).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_queued_twice_is_still_claimed_once() {
    let bed = Bed::new().await;
    let m = bed.m.clone();
    let [member]: [String; 1] = fill_pool(&m, "warm", 1).await.try_into().unwrap();
    m.stop_pools(Duration::from_secs(5)).await;
    // The in-memory queue is not the guard: the store's conditional claim is.
    assert!(m.pools.resize("warm", 2).unwrap().is_empty());
    assert!(m.pools.adopt("warm", vec![member.clone()]).is_empty());
    let (a, b) = tokio::join!(m.create("alice", req()), m.create("bob", req()));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_ne!(a.id, b.id);
    let claimed: Vec<&SandboxRecord> = [&a, &b].into_iter().filter(|r| r.id == member).collect();
    assert_eq!(claimed.len(), 1);
    assert_eq!(record(&m, &member).await.unwrap().owner, claimed[0].owner);
}

/// A spec as a create of the manager would give the runtime.
fn spec(id: &str) -> sandpit_runtime::SandboxSpec {
    sandpit_runtime::SandboxSpec {
        id: id.into(),
        template: sandpit_runtime::TemplateSource::Host,
        limits: sandpit_runtime::Limits {
            cpu_millis: 1000,
            memory_bytes: 512 << 20,
            disk_bytes: 1 << 30,
            max_processes: 512,
        },
        env: Default::default(),
        workdir: "/home/user".into(),
        volumes: Vec::new(),
        layers: Vec::new(),
        extra_ca_pem: None,
        net: None,
        sudo: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_after_a_crash_at_each_step() {
    let mut bed = Bed::new().await;
    let m = bed.m.clone();
    let fake = bed.fake.clone();
    let new = async || m.create("alice", req()).await.unwrap();
    let to = async |rec: &SandboxRecord, from: SandboxState, to: SandboxState| {
        m.store
            .transition(&rec.id, &[from], to, None)
            .await
            .unwrap()
            .unwrap()
    };
    use SandboxState::*;

    // Running, alive and answering: adopted.
    let alive = new().await;
    // Running, and /proc cannot be read: kept (no evidence of death).
    let unknown = new().await;
    fake.set_liveness(&unknown.id, Some(Liveness::Unknown("EMFILE".into())));
    // Running, but its agent exited while the daemon was down.
    let died = new().await;
    fake.die(&died.id);
    // Running, its process alive but its agent answers nothing.
    let mute = new().await;
    fake.freeze(&handle(&m, &mute)).unwrap();
    // Paused: frozen, so it cannot answer; adopted on its process alone.
    let paused = m.pause(&new().await, true).await.unwrap();
    // Creating, handle recorded, agent up: the create never finished.
    let half = to(&new().await, Running, Creating).await;
    // Creating, handle recorded, agent dead.
    let half_dead = to(&new().await, Running, Creating).await;
    fake.die(&half_dead.id);
    // Creating, the runtime started it but the handle was never recorded.
    let unrecorded = to(&new().await, Running, Creating).await;
    m.store
        .set_runtime_state(&unrecorded.id, &serde_json::Value::Null)
        .await
        .unwrap();
    // Stopping: a delete claimed the teardown and the daemon died before it finished.
    let stopping = to(&new().await, Running, Stopping).await;
    // The same, and the teardown fails again.
    let stopping_fails = to(&new().await, Running, Stopping).await;
    fake.fail_for(Step::Destroy, &stopping_fails.id, 1);
    // Creating while hibernated: a wake cut short.
    let waking = to(&new().await, Running, Creating).await;
    let mut life = waking.life.clone();
    life.paused_at_ms = Some(crate::manager::now_ms());
    assert!(m.store.set_life(&waking.id, &life).await.unwrap());
    // A sandbox of the runtime's that no record knows.
    let stray = "stray0000000000000000";
    let mut h = fake.create(&spec(stray)).unwrap();
    fake.start(&spec(stray), &mut h).unwrap();
    let destroys_before = calls_of(&fake, |c| matches!(c, Call::Destroy(_)));
    assert_eq!(destroys_before, 0);

    let m = bed.restart().await;
    m.reconcile().await.unwrap();

    let kept = [&alive, &unknown, &paused];
    for r in kept {
        assert_eq!(fake.destroys(&r.id), 0, "{}", r.id);
        assert_eq!(calls_of(&fake, |c| *c == Call::Adopt(r.id.clone())), 1);
    }
    assert_eq!(state(&m, &alive.id).await, Some(Running));
    assert_eq!(state(&m, &unknown.id).await, Some(Running));
    assert_eq!(state(&m, &paused.id).await, Some(Paused));
    assert_eq!(calls_of(&fake, |c| *c == Call::Thaw(paused.id.clone())), 0);
    assert_eq!(fake.phase(&paused.id), Some(Phase::Frozen));

    assert_eq!(state(&m, &died.id).await, Some(Stopped));
    assert_eq!(state(&m, &mute.id).await, Some(Stopped));
    for r in [&half, &half_dead, &unrecorded, &stopping] {
        assert_eq!(state(&m, &r.id).await, None, "{}", r.id);
    }
    let failed = record(&m, &stopping_fails.id).await.unwrap();
    assert_eq!(failed.state, Error);
    assert!(failed.error.unwrap().contains("teardown failed"));
    assert_eq!(state(&m, &waking.id).await, Some(Hibernated));

    // Exactly once each, for everything with a handle that had to go.
    for r in [
        &died,
        &mute,
        &half,
        &half_dead,
        &stopping,
        &stopping_fails,
        &waking,
    ] {
        assert_eq!(fake.destroys(&r.id), 1, "{}", r.id);
    }
    // What had no usable record was swept as an orphan, without a destroy.
    assert_eq!(fake.destroys(&unrecorded.id), 0);
    assert_eq!(fake.destroys(stray), 0);
    let keep: BTreeSet<String> = kept.iter().map(|r| r.id.clone()).collect();
    let swept: Vec<Vec<String>> = fake
        .calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::RemoveOrphans(k) => Some(k),
            _ => None,
        })
        .collect();
    assert_eq!(swept.len(), 1);
    assert_eq!(swept[0].iter().cloned().collect::<BTreeSet<_>>(), keep);
    assert_eq!(fake.held().into_iter().collect::<BTreeSet<_>>(), keep);

    // The adopted are the new daemon's like any other.
    assert!(answers(&handle(&m, &alive), Duration::from_secs(2)).await);
    assert_eq!(
        m.resume(&paused).await.unwrap().state,
        SandboxState::Running
    );
    m.destroy(&alive).await.unwrap();
    // A delete of the failed teardown tries again (the runtime's destroy is idempotent).
    let failed = record(&m, &stopping_fails.id).await.unwrap();
    m.destroy(&failed).await.unwrap();
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(fake.destroys(&alive.id), 1);
    assert_eq!(fake.destroys(&stopping_fails.id), 2);
    assert_eq!(record(&m, &stopping_fails.id).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acquires_of_a_lease_share_one_sandbox() {
    let bed = Bed::new().await;
    let (m, fake) = (&bed.m, &bed.fake);
    let leases = crate::leases::Leases::new(crate::leases::LeaseConfig {
        retry: Duration::from_millis(10),
        ..Default::default()
    });
    let got =
        futures::future::join_all((0..5).map(|_| leases.acquire(m, "alice", "u1", req()))).await;
    let got: Vec<_> = got.into_iter().map(Result::unwrap).collect();
    let ids: BTreeSet<&str> = got.iter().map(|a| a.sandbox.id.as_str()).collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(got.iter().filter(|a| a.created).count(), 1);
    assert_eq!(started(fake).len(), 1);
    let first = got[0].sandbox.id.clone();

    // Its sandbox dies: the next acquire tears it down and makes another.
    fake.die(&first);
    let again = leases.acquire(m, "alice", "u1", req()).await.unwrap();
    assert!(again.created);
    assert_ne!(again.sandbox.id, first);
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(fake.destroys(&first), 1);

    leases.release(m, "alice", "u1", false).await.unwrap();
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(fake.destroys(&again.sandbox.id), 1);
    assert!(fake.held().is_empty());
    assert!(m.store.get_lease("alice", "u1").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hibernation_keeps_the_files_and_a_resume_starts_on_them() {
    let bed = Bed::new().await;
    let (m, fake) = (&bed.m, &bed.fake);
    let rec = m.create("alice", req()).await.unwrap();
    let upper = fake.upper(&rec.id).unwrap();
    std::fs::create_dir_all(upper.join("home/user")).unwrap();
    std::fs::write(upper.join("home/user/notes.txt"), "kept").unwrap();

    let hib = m.hibernate(&rec).await.unwrap();
    assert_eq!(hib.state, SandboxState::Hibernated);
    let [layer]: [String; 1] = hib.life.layers.clone().try_into().unwrap();
    let layer_dir = m.layer_path(&layer).unwrap();
    assert_eq!(
        std::fs::read_to_string(layer_dir.join("home/user/notes.txt")).unwrap(),
        "kept"
    );
    // Frozen while copied, then its processes ended (its handle's incarnation, once).
    assert_eq!(calls_of(fake, |c| *c == Call::Freeze(rec.id.clone())), 1);
    assert_eq!(fake.destroys(&rec.id), 1);
    assert!(fake.held().is_empty());
    assert_eq!(
        m.hibernate(&hib).await.unwrap().state,
        SandboxState::Hibernated
    );
    assert_eq!(fake.destroys(&rec.id), 1);

    let woke = m.resume(&hib).await.unwrap();
    assert_eq!(woke.state, SandboxState::Running);
    assert_eq!(
        fake.layers(&rec.id).unwrap(),
        std::slice::from_ref(&layer_dir)
    );
    assert!(answers(&handle(m, &woke), Duration::from_secs(2)).await);

    // A wake whose start fails leaves it hibernated on the same files.
    let hib = m.hibernate(&woke).await.unwrap();
    fake.fail(Step::Start, 1);
    m.resume(&hib).await.unwrap_err();
    let back = record(m, &rec.id).await.unwrap();
    assert_eq!(back.state, SandboxState::Hibernated);
    assert_eq!(back.life.layers, hib.life.layers);
    assert!(fake.held().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_that_fails_part_way_leaves_only_its_source() {
    let bed = Bed::new().await;
    let (m, fake) = (&bed.m, &bed.fake);
    let rec = m.create("alice", req()).await.unwrap();
    std::fs::write(fake.upper(&rec.id).unwrap().join("f"), "x").unwrap();

    let copies = m
        .fork(
            &rec,
            &sandpit_api::ForkRequest {
                count: Some(2),
                metadata: None,
                limits: None,
                timeout: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(copies.len(), 2);
    for c in &copies {
        assert_eq!(state(m, &c.id).await, Some(SandboxState::Running));
        let layers = fake.layers(&c.id).unwrap();
        assert_eq!(layers.len(), 1);
        assert_eq!(std::fs::read_to_string(layers[0].join("f")).unwrap(), "x");
    }
    // The source was frozen for the copy and runs again.
    assert_eq!(fake.phase(&rec.id), Some(Phase::Running));
    assert_eq!(calls_of(fake, |c| *c == Call::Thaw(rec.id.clone())), 1);

    let before: BTreeSet<String> = fake.held().into_iter().collect();
    fake.fail(Step::Start, 1);
    let failed = m
        .fork(
            &rec,
            &sandpit_api::ForkRequest {
                count: Some(3),
                metadata: None,
                limits: None,
                timeout: None,
            },
        )
        .await;
    assert!(failed.is_err());
    m.drain_teardowns(Duration::from_secs(5)).await;
    assert_eq!(fake.held().into_iter().collect::<BTreeSet<_>>(), before);
    let attempted: Vec<String> = started(fake)
        .into_iter()
        .filter(|id| !before.contains(id))
        .collect();
    assert_eq!(attempted.len(), 3);
    for id in &attempted {
        assert_eq!(fake.destroys(id), 1, "{id}");
        assert_eq!(record(m, id).await, None);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_env_names_must_be_env_variables_and_are_kept_cold_and_from_a_pool() {
    let bed = Bed::new().await;
    let m = bed.m.clone();
    let env: std::collections::BTreeMap<String, String> = [
        ("TOKENISH".to_string(), "value-of-the-secret".to_string()),
        ("PLAIN".to_string(), "p".to_string()),
    ]
    .into();
    let secret = |names: &[&str]| CreateSandboxRequest {
        env: env.clone(),
        secret_env: names.iter().map(|n| n.to_string()).collect(),
        ..req()
    };
    // A name without a variable is a typo: refused before anything starts.
    let e = m.create("alice", secret(&["NOPE"])).await.unwrap_err();
    assert!(matches!(e, CoreError::Invalid(_)), "{e:?}");
    assert!(e.to_string().contains("NOPE"), "{e}");
    assert!(started(&bed.fake).is_empty());
    // Cold: the record keeps the mark, the agent gets the value like any env.
    let cold = m.create("alice", secret(&["TOKENISH"])).await.unwrap();
    let want: BTreeSet<String> = ["TOKENISH".to_string()].into();
    assert_eq!(record(&m, &cold.id).await.unwrap().secret_env, want);
    let cfg = bed.fake.agent_config(&cold.id).unwrap();
    assert_eq!(
        cfg.env().get("TOKENISH").map(String::as_str),
        Some("value-of-the-secret")
    );
    // Claimed from a warm pool: the claim writes the mark too.
    let [member]: [String; 1] = fill_pool(&m, "warm", 1).await.try_into().unwrap();
    m.stop_pools(Duration::from_secs(5)).await;
    let warm = m.create("bob", secret(&["TOKENISH"])).await.unwrap();
    assert_eq!(warm.id, member);
    assert_eq!(warm.secret_env, want);
    assert_eq!(record(&m, &member).await.unwrap().secret_env, want);
    // Without a mark, nothing is secret.
    let plain = m.create("carol", secret(&[])).await.unwrap();
    assert!(record(&m, &plain.id).await.unwrap().secret_env.is_empty());
}
