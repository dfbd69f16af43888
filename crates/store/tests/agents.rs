//! Agent runtimes, runs, run events and approvals against a real SQLite file: every
//! guarantee the daemon relies on (one active run, idempotent starts, final states, gapless
//! event numbers, the cap, approvals in step with the run).

use std::collections::BTreeSet;

use sandpit_store::{
    AgentRuntimeState, Appended, ApprovalScope, ApprovalState, ApprovalTarget, Capability, Decided,
    Decision, EVENT_APPROVAL_DECIDED, EVENT_APPROVAL_REQUESTED, EVENT_END, EVENT_TRUNCATED,
    NewAgentRuntime, NewApproval, NewEvent, NewRun, RunMode, RunStart, RunState, RunUpdate,
    SandboxRecord, SandboxState, Store, StoreError, now_ms,
};
use serde_json::json;

async fn file_store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("agents.db")).await.unwrap();
    (dir, store)
}

fn sandbox(id: &str, owner: &str, state: SandboxState) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        owner: owner.into(),
        template: "base".into(),
        runtime: "container".into(),
        state,
        cpu_millis: 1000,
        memory_bytes: 512 << 20,
        disk_bytes: 1 << 30,
        max_processes: 64,
        env: Default::default(),
        secret_env: Default::default(),
        metadata: Default::default(),
        created_at_ms: 1,
        updated_at_ms: 1,
        expires_at_ms: i64::MAX,
        runtime_state: json!({}),
        error: None,
        version: 0,
        pool: None,
        life: Default::default(),
    }
}

fn runtime(id: &str, sandbox_id: &str, owner: &str) -> NewAgentRuntime {
    NewAgentRuntime {
        id: id.into(),
        sandbox_id: sandbox_id.into(),
        owner: owner.into(),
        harness: "pi".into(),
        harness_version: Some("0.73.1".into()),
        harness_template: None,
        approval_policy: json!({"egress": true}),
        model: json!({"model": "m"}),
    }
}

fn run(id: &str, runtime_id: &str, key: Option<&str>) -> NewRun {
    NewRun {
        id: id.into(),
        runtime_id: runtime_id.into(),
        task: "fix the failing test".into(),
        mode: RunMode::Fresh,
        idempotency_key: key.map(str::to_string),
        max_events: 10_000,
    }
}

fn event(kind: &str, payload: serde_json::Value) -> NewEvent {
    NewEvent {
        kind: kind.into(),
        payload,
    }
}

/// A store with sandbox `sb` of alice (running) and runtime `rt` in it.
async fn with_runtime() -> (tempfile::TempDir, Store) {
    let (dir, s) = file_store().await;
    s.insert_sandbox(&sandbox("sb", "alice", SandboxState::Running))
        .await
        .unwrap();
    s.insert_agent_runtime(&runtime("rt", "sb", "alice"))
        .await
        .unwrap();
    (dir, s)
}

async fn started(s: &Store, new: &NewRun) -> sandpit_store::RunRecord {
    match s.start_run(new).await.unwrap() {
        RunStart::Started(r) => r,
        other => panic!("expected a new run, got {other:?}"),
    }
}

async fn applied(s: &Store, id: &str, to: RunState) -> sandpit_store::RunRecord {
    match s.transition_run(id, to, None).await.unwrap() {
        RunUpdate::Applied(r) => r,
        other => panic!("{id} -> {to}: {other:?}"),
    }
}

async fn all_events(s: &Store, run_id: &str) -> Vec<sandpit_store::RunEvent> {
    s.events_after(run_id, 0, 1000).await.unwrap()
}

fn approval(id: &str, run_id: &str, capability: Capability, expires_at_ms: i64) -> NewApproval {
    NewApproval {
        id: id.into(),
        run_id: run_id.into(),
        capability,
        target: ApprovalTarget {
            host: Some("API.GitHub.com".into()),
            method: Some("post".into()),
            path: Some("/repos/o/r/issues".into()),
            name: Some("github".into()),
        },
        summary: "POST /repos/o/r/issues with secret github".into(),
        detail: json!({"request": 7}),
        expires_at_ms,
    }
}

#[tokio::test]
async fn a_runtime_needs_a_live_sandbox_of_its_owner() {
    let (_d, s) = file_store().await;
    s.insert_sandbox(&sandbox("sb", "alice", SandboxState::Running))
        .await
        .unwrap();
    s.insert_sandbox(&sandbox("gone", "alice", SandboxState::Stopping))
        .await
        .unwrap();
    let rt = s
        .insert_agent_runtime(&runtime("rt", "sb", "alice"))
        .await
        .unwrap();
    assert_eq!(rt.state, AgentRuntimeState::Active);
    assert_eq!(rt.approval_policy, json!({"egress": true}));
    assert_eq!(rt.harness_version.as_deref(), Some("0.73.1"));
    assert_eq!(s.get_agent_runtime("rt").await.unwrap(), Some(rt.clone()));

    // Another owner's sandbox, an unknown one and one being torn down are all "not found".
    for (id, sb, owner) in [
        ("x1", "sb", "bob"),
        ("x2", "nope", "alice"),
        ("x3", "gone", "alice"),
    ] {
        let err = s
            .insert_agent_runtime(&runtime(id, sb, owner))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::NotFound(_)), "{id}: {err:?}");
        assert_eq!(s.get_agent_runtime(id).await.unwrap(), None);
    }
    let err = s
        .insert_agent_runtime(&runtime("rt", "sb", "alice"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");

    s.insert_agent_runtime(&runtime("rt2", "sb", "alice"))
        .await
        .unwrap();
    let ids = |v: Vec<sandpit_store::AgentRuntimeRecord>| -> Vec<String> {
        v.into_iter().map(|r| r.id).collect()
    };
    assert_eq!(
        ids(s.list_agent_runtimes(Some("alice"), None).await.unwrap()),
        ["rt", "rt2"]
    );
    assert_eq!(
        ids(s.list_agent_runtimes(None, Some("sb")).await.unwrap()),
        ["rt", "rt2"]
    );
    assert!(
        s.list_agent_runtimes(Some("bob"), None)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        s.list_agent_runtimes(Some("alice"), Some("gone"))
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn a_runtime_has_at_most_one_active_run() {
    let (_d, s) = with_runtime().await;
    let first = started(&s, &run("r1", "rt", None)).await;
    assert_eq!(first.state, RunState::Queued);
    assert_eq!(first.number, 1);
    assert_eq!(first.next_seq, 1);
    assert_eq!(first.owner, "alice");
    assert_eq!(first.sandbox_id, "sb");
    for state in [
        RunState::Queued,
        RunState::Running,
        RunState::WaitingApproval,
    ] {
        if state != RunState::Queued {
            applied(&s, "r1", state).await;
        }
        let err = s.start_run(&run("r2", "rt", None)).await.unwrap_err();
        match err {
            StoreError::ActiveRun { runtime_id, run_id } => {
                assert_eq!((runtime_id.as_str(), run_id.as_str()), ("rt", "r1"));
            }
            other => panic!("{state}: {other:?}"),
        }
    }
    assert_eq!(s.active_run("rt").await.unwrap().unwrap().id, "r1");
    assert!(s.get_run("r2").await.unwrap().is_none());
    applied(&s, "r1", RunState::Failed).await;
    assert!(s.active_run("rt").await.unwrap().is_none());
    let second = started(&s, &run("r2", "rt", None)).await;
    assert_eq!(second.number, 2);
    assert_eq!(second.parent_run_id, None);
    let numbers: Vec<i64> = s
        .list_runs("rt")
        .await
        .unwrap()
        .iter()
        .map(|r| r.number)
        .collect();
    assert_eq!(numbers, [1, 2]);

    let err = s.start_run(&run("r3", "nope", None)).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

#[tokio::test]
async fn the_same_idempotency_key_returns_the_same_run() {
    let (_d, s) = with_runtime().await;
    let first = started(&s, &run("r1", "rt", Some("k1"))).await;
    let again = s
        .start_run(&run("other-id", "rt", Some("k1")))
        .await
        .unwrap();
    assert_eq!(again, RunStart::Existing(first.clone()));
    // Still the same run once it has finished, never a second one.
    applied(&s, "r1", RunState::Running).await;
    applied(&s, "r1", RunState::Succeeded).await;
    let again = s
        .start_run(&run("other-id", "rt", Some("k1")))
        .await
        .unwrap();
    assert_eq!(again.run().id, "r1");
    assert_eq!(again.run().state, RunState::Succeeded);
    assert!(s.get_run("other-id").await.unwrap().is_none());
    // The key with another task is a conflict, not a silent replay.
    let mut changed = run("r9", "rt", Some("k1"));
    changed.task = "something else".into();
    let err = s.start_run(&changed).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");
    // Keys are per runtime.
    s.insert_agent_runtime(&runtime("rt2", "sb", "alice"))
        .await
        .unwrap();
    let elsewhere = started(&s, &run("r2", "rt2", Some("k1"))).await;
    assert_eq!(elsewhere.runtime_id, "rt2");
    assert_eq!(s.list_runs("rt").await.unwrap().len(), 1);
}

#[tokio::test]
async fn concurrent_starts_with_one_key_make_one_run() {
    let (_d, s) = with_runtime().await;
    let mut tasks = Vec::new();
    for i in 0..24 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.start_run(&run(&format!("r{i}"), "rt", Some("same")))
                .await
                .unwrap()
        }));
    }
    let mut ids = BTreeSet::new();
    let mut new = 0;
    for t in tasks {
        let got = t.await.unwrap();
        if matches!(got, RunStart::Started(_)) {
            new += 1;
        }
        ids.insert(got.run().id.clone());
    }
    assert_eq!(new, 1);
    assert_eq!(ids.len(), 1);
    assert_eq!(s.list_runs("rt").await.unwrap().len(), 1);
}

#[tokio::test]
async fn concurrent_starts_without_a_key_let_one_win() {
    let (_d, s) = with_runtime().await;
    let mut tasks = Vec::new();
    for i in 0..24 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.start_run(&run(&format!("r{i}"), "rt", None)).await
        }));
    }
    let (mut won, mut refused) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(RunStart::Started(_)) => won += 1,
            Err(StoreError::ActiveRun { .. }) => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((won, refused), (1, 23));
    assert_eq!(s.list_runs("rt").await.unwrap().len(), 1);
}

#[tokio::test]
async fn transitions_are_compare_and_set_and_final_states_stay() {
    let (_d, s) = with_runtime().await;
    started(&s, &run("r1", "rt", None)).await;
    // Nothing goes back to queued, and waiting needs running first.
    assert!(matches!(
        s.transition_run("r1", RunState::WaitingApproval, None)
            .await
            .unwrap(),
        RunUpdate::NotAllowed(r) if r.state == RunState::Queued
    ));
    let running = applied(&s, "r1", RunState::Running).await;
    let started_at = running.started_at_ms.unwrap();
    assert!(matches!(
        s.transition_run("r1", RunState::Queued, None)
            .await
            .unwrap(),
        RunUpdate::NotAllowed(_)
    ));
    applied(&s, "r1", RunState::WaitingApproval).await;
    let back = applied(&s, "r1", RunState::Running).await;
    assert_eq!(back.started_at_ms, Some(started_at));
    let cancelled = match s
        .transition_run("r1", RunState::Cancelled, Some("cancelled by alice"))
        .await
        .unwrap()
    {
        RunUpdate::Applied(r) => r,
        other => panic!("{other:?}"),
    };
    assert_eq!(cancelled.reason.as_deref(), Some("cancelled by alice"));
    assert!(cancelled.ended_at_ms.is_some());
    // A late success (and any other change) after the cancel is refused and reported so.
    for to in [
        RunState::Succeeded,
        RunState::Failed,
        RunState::Running,
        RunState::Cancelled,
        RunState::TimedOut,
    ] {
        match s.transition_run("r1", to, Some("late")).await.unwrap() {
            RunUpdate::AlreadyFinal(r) => {
                assert_eq!(r.state, RunState::Cancelled);
                assert_eq!(r.reason.as_deref(), Some("cancelled by alice"));
            }
            other => panic!("{to}: {other:?}"),
        }
    }
    assert_eq!(
        s.get_run("r1").await.unwrap().unwrap().state,
        RunState::Cancelled
    );
    let err = s
        .transition_run("nope", RunState::Running, None)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

#[tokio::test]
async fn racing_cancel_and_success_have_one_winner() {
    let (_d, s) = with_runtime().await;
    for round in 0..10 {
        let id = format!("r{round}");
        started(&s, &run(&id, "rt", None)).await;
        applied(&s, &id, RunState::Running).await;
        let (a, b) = tokio::join!(
            s.transition_run(&id, RunState::Cancelled, Some("cancel")),
            s.transition_run(&id, RunState::Succeeded, Some("done")),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        let winner = match (&a, &b) {
            (RunUpdate::Applied(w), RunUpdate::AlreadyFinal(l))
            | (RunUpdate::AlreadyFinal(l), RunUpdate::Applied(w)) => {
                assert_eq!(w.state, l.state);
                w.state
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(s.get_run(&id).await.unwrap().unwrap().state, winner);
        // Exactly one end event, the last one.
        let events = all_events(&s, &id).await;
        let ends: Vec<_> = events.iter().filter(|e| e.kind == EVENT_END).collect();
        assert_eq!(ends.len(), 1);
        assert_eq!(ends[0].payload["state"], winner.as_str());
    }
}

#[tokio::test]
async fn events_are_numbered_paged_and_closed_by_the_end_event() {
    let (_d, s) = with_runtime().await;
    started(&s, &run("r1", "rt", None)).await;
    applied(&s, "r1", RunState::Running).await;
    for i in 1..=25 {
        let done = s
            .append_event("r1", &event("message_delta", json!({"text": i})))
            .await
            .unwrap();
        assert_eq!(done.event().map(|e| e.seq), Some(i));
    }
    let batch: Vec<NewEvent> = (26..=30)
        .map(|i| event("tool_call", json!({"i": i})))
        .collect();
    let done = s.append_events("r1", &batch).await.unwrap();
    let seqs: Vec<i64> = done.iter().map(|d| d.event().unwrap().seq).collect();
    assert_eq!(seqs, [26, 27, 28, 29, 30]);

    let page = s.events_after("r1", 0, 10).await.unwrap();
    assert_eq!(
        page.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..=10).collect::<Vec<_>>()
    );
    assert_eq!(page[0].payload, json!({"text": 1}));
    assert_eq!(page[0].kind, "message_delta");
    // Resuming after the last seen sequence gives exactly the rest.
    let mut seen = page.last().unwrap().seq;
    let mut rest = Vec::new();
    loop {
        let page = s.events_after("r1", seen, 7).await.unwrap();
        let Some(last) = page.last() else { break };
        seen = last.seq;
        rest.extend(page.into_iter().map(|e| e.seq));
    }
    assert_eq!(rest, (11..=30).collect::<Vec<_>>());
    assert!(s.events_after("r1", 30, 10).await.unwrap().is_empty());
    assert_eq!(s.events_after("r1", 0, 0).await.unwrap().len(), 30);

    let done = match s
        .transition_run("r1", RunState::Succeeded, Some("ok"))
        .await
        .unwrap()
    {
        RunUpdate::Applied(r) => r,
        other => panic!("{other:?}"),
    };
    assert_eq!(done.next_seq, 32);
    let end = s.events_after("r1", 30, 10).await.unwrap();
    assert_eq!(end.len(), 1);
    assert_eq!(end[0].seq, 31);
    assert_eq!(end[0].kind, EVENT_END);
    assert_eq!(
        end[0].payload,
        json!({"state": "succeeded", "reason": "ok"})
    );
    // Nothing follows the end event.
    assert_eq!(
        s.append_event("r1", &event("message", json!({})))
            .await
            .unwrap(),
        Appended::RunEnded(RunState::Succeeded)
    );
    let late = s.append_events("r1", &batch).await.unwrap();
    assert!(
        late.iter()
            .all(|a| *a == Appended::RunEnded(RunState::Succeeded))
    );
    assert_eq!(all_events(&s, "r1").await.len(), 31);
    let err = s
        .append_event("nope", &event("message", json!({})))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

#[tokio::test]
async fn concurrent_appenders_get_one_to_n_exactly() {
    let (_d, s) = with_runtime().await;
    started(&s, &run("r1", "rt", None)).await;
    let (tasks_n, per_task) = (32, 25);
    let mut tasks = Vec::new();
    for t in 0..tasks_n {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut seqs = Vec::new();
            for i in 0..per_task {
                let done = if i % 5 == 4 {
                    // Some batches among the single appends.
                    s.append_events(
                        "r1",
                        &[
                            event("b", json!({"t": t, "i": i})),
                            event("b", json!({"t": t, "i": i + 1000})),
                        ],
                    )
                    .await
                    .unwrap()
                } else {
                    vec![
                        s.append_event("r1", &event("e", json!({"t": t, "i": i})))
                            .await
                            .unwrap(),
                    ]
                };
                seqs.extend(done.iter().map(|d| d.event().unwrap().seq));
            }
            seqs
        }));
    }
    let mut seqs = Vec::new();
    for t in tasks {
        let mine = t.await.unwrap();
        // Each appender's own events come back in increasing order.
        assert!(mine.windows(2).all(|w| w[0] < w[1]), "{mine:?}");
        seqs.extend(mine);
    }
    seqs.sort();
    let total = (tasks_n * (per_task + per_task / 5)) as i64;
    assert_eq!(seqs, (1..=total).collect::<Vec<_>>());
    let stored = all_events(&s, "r1").await;
    assert_eq!(stored.len() as i64, total.min(1000));
    let mut payloads = BTreeSet::new();
    let mut after = 0;
    loop {
        let page = s.events_after("r1", after, 1000).await.unwrap();
        let Some(last) = page.last() else { break };
        after = last.seq;
        for e in page {
            assert!(payloads.insert(e.payload.to_string()), "duplicate {e:?}");
        }
    }
    assert_eq!(payloads.len() as i64, total);
    assert_eq!(s.get_run("r1").await.unwrap().unwrap().next_seq, total + 1);
}

#[tokio::test]
async fn the_event_cap_stores_a_marker_then_drops() {
    let (_d, s) = with_runtime().await;
    let mut capped = run("r1", "rt", None);
    capped.max_events = 5;
    started(&s, &capped).await;
    let mut outcomes = Vec::new();
    for i in 1..=8 {
        outcomes.push(
            s.append_event("r1", &event("message_delta", json!({"i": i})))
                .await
                .unwrap(),
        );
    }
    for (i, o) in outcomes.iter().take(4).enumerate() {
        assert!(
            matches!(o, Appended::Stored(e) if e.seq == i as i64 + 1),
            "{o:?}"
        );
    }
    match &outcomes[4] {
        Appended::Truncated(e) => {
            assert_eq!(e.seq, 5);
            assert_eq!(e.kind, EVENT_TRUNCATED);
            assert_eq!(e.payload, json!({"max_events": 5}));
        }
        other => panic!("{other:?}"),
    }
    assert!(outcomes[5..].iter().all(|o| *o == Appended::Dropped));
    let record = s.get_run("r1").await.unwrap().unwrap();
    assert_eq!(record.events_dropped, 3);
    assert_eq!(record.next_seq, 6);
    // The end event still closes the log, beyond the cap.
    applied(&s, "r1", RunState::Failed).await;
    let events = all_events(&s, "r1").await;
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "message_delta",
            "message_delta",
            "message_delta",
            "message_delta",
            EVENT_TRUNCATED,
            EVENT_END
        ]
    );
    assert_eq!(events.last().unwrap().seq, 6);
}

#[tokio::test]
async fn continue_records_lineage_and_the_session_to_resume() {
    let (_d, s) = with_runtime().await;
    let mut cont = run("r0", "rt", None);
    cont.mode = RunMode::Continue;
    let err = s.start_run(&cont).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");

    started(&s, &run("r1", "rt", None)).await;
    assert!(s.set_run_session("r1", "ses_1").await.unwrap());
    assert!(!s.set_run_session("nope", "ses_x").await.unwrap());
    assert_eq!(
        s.get_agent_runtime("rt")
            .await
            .unwrap()
            .unwrap()
            .session_id
            .as_deref(),
        Some("ses_1")
    );
    applied(&s, "r1", RunState::Succeeded).await;

    let mut cont = run("r2", "rt", None);
    cont.mode = RunMode::Continue;
    let r2 = started(&s, &cont).await;
    assert_eq!(r2.mode, RunMode::Continue);
    assert_eq!(r2.parent_run_id.as_deref(), Some("r1"));
    assert_eq!(r2.resume_session_id.as_deref(), Some("ses_1"));
    assert_eq!(r2.session_id, None);
    // r2 reports no session of its own and fails: the next continue still has ses_1.
    applied(&s, "r2", RunState::Failed).await;
    cont.id = "r3".into();
    let r3 = started(&s, &cont).await;
    assert_eq!(r3.parent_run_id.as_deref(), Some("r2"));
    assert_eq!(r3.resume_session_id.as_deref(), Some("ses_1"));
    assert_eq!(r3.number, 3);
}

#[tokio::test]
async fn ending_a_sandbox_ends_its_runtimes_and_cancels_their_runs() {
    let (_d, s) = with_runtime().await;
    s.insert_agent_runtime(&runtime("rt2", "sb", "alice"))
        .await
        .unwrap();
    s.insert_sandbox(&sandbox("other", "alice", SandboxState::Running))
        .await
        .unwrap();
    s.insert_agent_runtime(&runtime("rt3", "other", "alice"))
        .await
        .unwrap();
    // rt: one finished run and one running; rt2: a run held for approval; rt3 elsewhere.
    started(&s, &run("r0", "rt", None)).await;
    applied(&s, "r0", RunState::Succeeded).await;
    started(&s, &run("r1", "rt", None)).await;
    applied(&s, "r1", RunState::Running).await;
    started(&s, &run("r2", "rt2", None)).await;
    applied(&s, "r2", RunState::Running).await;
    s.request_approval(&approval("a1", "r2", Capability::Egress, now_ms() + 60_000))
        .await
        .unwrap();
    started(&s, &run("r3", "rt3", None)).await;

    let ended = s.end_sandbox_agents("sb", "sandbox deleted").await.unwrap();
    assert_eq!(ended.runtimes, ["rt", "rt2"]);
    let mut cancelled: Vec<(&str, RunState)> = ended
        .runs
        .iter()
        .map(|r| (r.id.as_str(), r.state))
        .collect();
    cancelled.sort_by_key(|(id, _)| *id);
    assert_eq!(
        cancelled,
        [("r1", RunState::Cancelled), ("r2", RunState::Cancelled)]
    );
    for id in ["r1", "r2"] {
        let r = s.get_run(id).await.unwrap().unwrap();
        assert_eq!(r.state, RunState::Cancelled);
        assert_eq!(r.reason.as_deref(), Some("sandbox deleted"));
        let events = all_events(&s, id).await;
        let last = events.last().unwrap();
        assert_eq!(last.kind, EVENT_END);
        assert_eq!(last.payload["state"], "cancelled");
    }
    // The finished run kept its state; the pending approval expired before r2's end event.
    assert_eq!(
        s.get_run("r0").await.unwrap().unwrap().state,
        RunState::Succeeded
    );
    let a1 = s.get_approval("a1", 0).await.unwrap().unwrap();
    assert_eq!(a1.state, ApprovalState::Expired);
    let kinds: Vec<String> = all_events(&s, "r2")
        .await
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds,
        [EVENT_APPROVAL_REQUESTED, EVENT_APPROVAL_DECIDED, EVENT_END]
    );
    for rt in ["rt", "rt2"] {
        let r = s.get_agent_runtime(rt).await.unwrap().unwrap();
        assert_eq!(r.state, AgentRuntimeState::Ended);
        assert_eq!(r.reason.as_deref(), Some("sandbox deleted"));
        assert!(r.ended_at_ms.is_some());
    }
    // No new run on an ended runtime; the other sandbox is untouched.
    let err = s.start_run(&run("r4", "rt", None)).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");
    assert_eq!(
        s.get_run("r3").await.unwrap().unwrap().state,
        RunState::Queued
    );
    assert_eq!(
        s.get_agent_runtime("rt3").await.unwrap().unwrap().state,
        AgentRuntimeState::Active
    );
    // Doing it again changes nothing.
    let again = s.end_sandbox_agents("sb", "again").await.unwrap();
    assert!(again.runtimes.is_empty() && again.runs.is_empty());

    // One runtime alone.
    let one = s
        .end_agent_runtime("rt3", "deleted")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(one.runtimes, ["rt3"]);
    assert_eq!(one.runs.len(), 1);
    assert_eq!(one.runs[0].id, "r3");
    assert_eq!(one.runs[0].state, RunState::Cancelled);
    let again = s
        .end_agent_runtime("rt3", "deleted")
        .await
        .unwrap()
        .unwrap();
    assert!(again.runtimes.is_empty() && again.runs.is_empty());
    assert_eq!(s.end_agent_runtime("nope", "x").await.unwrap(), None);
}

#[tokio::test]
async fn approvals_hold_the_run_and_every_decision_is_an_event() {
    let (_d, s) = with_runtime().await;
    started(&s, &run("r1", "rt", None)).await;
    applied(&s, "r1", RunState::Running).await;
    let far = now_ms() + 600_000;
    let a1 = s
        .request_approval(&approval("a1", "r1", Capability::Credential, far))
        .await
        .unwrap();
    assert_eq!(a1.state, ApprovalState::Pending);
    assert_eq!(a1.scope, ApprovalScope::Once);
    assert_eq!(
        (
            a1.owner.as_str(),
            a1.runtime_id.as_str(),
            a1.sandbox_id.as_str()
        ),
        ("alice", "rt", "sb")
    );
    // Host lowercase, method uppercase.
    assert_eq!(a1.target.host.as_deref(), Some("api.github.com"));
    assert_eq!(a1.target.method.as_deref(), Some("POST"));
    assert_eq!(
        s.get_run("r1").await.unwrap().unwrap().state,
        RunState::WaitingApproval
    );
    let dup = s
        .request_approval(&approval("a1", "r1", Capability::Credential, far))
        .await
        .unwrap_err();
    assert!(matches!(dup, StoreError::Conflict(_)), "{dup:?}");
    // A second pending approval: the run waits for both.
    s.request_approval(&approval("a2", "r1", Capability::Egress, far))
        .await
        .unwrap();
    let pending: Vec<String> = s
        .list_pending_approvals("alice", now_ms())
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.id)
        .collect();
    assert_eq!(pending, ["a1", "a2"]);
    assert!(
        s.list_pending_approvals("bob", now_ms())
            .await
            .unwrap()
            .is_empty()
    );

    let now = now_ms();
    let decided = s
        .decide_approval("a1", Decision::Approve(ApprovalScope::Once), "alice", now)
        .await
        .unwrap();
    let Decided::Decided(a) = decided else {
        panic!("{decided:?}")
    };
    assert_eq!(a.state, ApprovalState::Approved);
    assert_eq!(a.decided_by.as_deref(), Some("alice"));
    assert_eq!(a.decided_at_ms, Some(now));
    assert_eq!(
        s.get_run("r1").await.unwrap().unwrap().state,
        RunState::WaitingApproval,
        "a2 still holds the run"
    );
    // Deciding twice is refused; the first decision stays.
    let again = s
        .decide_approval("a1", Decision::Deny, "mallory", now)
        .await
        .unwrap();
    assert!(
        matches!(&again, Decided::AlreadyDecided(a) if a.state == ApprovalState::Approved && a.decided_by.as_deref() == Some("alice")),
        "{again:?}"
    );
    let denied = s
        .decide_approval("a2", Decision::Deny, "alice", now)
        .await
        .unwrap();
    assert!(
        matches!(&denied, Decided::Decided(a) if a.state == ApprovalState::Denied),
        "{denied:?}"
    );
    assert_eq!(
        s.get_run("r1").await.unwrap().unwrap().state,
        RunState::Running
    );
    let err = s
        .decide_approval("nope", Decision::Deny, "alice", now)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");

    let events = all_events(&s, "r1").await;
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            EVENT_APPROVAL_REQUESTED,
            EVENT_APPROVAL_REQUESTED,
            EVENT_APPROVAL_DECIDED,
            EVENT_APPROVAL_DECIDED
        ]
    );
    assert_eq!(events[2].payload["id"], "a1");
    assert_eq!(events[2].payload["state"], "approved");
    assert_eq!(events[3].payload["state"], "denied");
    assert_eq!(events[0].payload["capability"], "credential");
    // Kept after the decision, in order.
    let kept: Vec<(String, ApprovalState)> = s
        .list_run_approvals("r1", now_ms())
        .await
        .unwrap()
        .into_iter()
        .map(|a| (a.id, a.state))
        .collect();
    assert_eq!(
        kept,
        [
            ("a1".to_string(), ApprovalState::Approved),
            ("a2".to_string(), ApprovalState::Denied)
        ]
    );

    // A finished run takes no new approval.
    applied(&s, "r1", RunState::Succeeded).await;
    let err = s
        .request_approval(&approval("a3", "r1", Capability::Egress, far))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");
    let err = s
        .request_approval(&approval("a4", "nope", Capability::Egress, far))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

#[tokio::test]
async fn an_approval_past_its_expiry_is_expired_at_read_decide_and_sweep() {
    let (_d, s) = with_runtime().await;
    started(&s, &run("r1", "rt", None)).await;
    applied(&s, "r1", RunState::Running).await;
    let t = now_ms();
    let expires = t + 1_000;
    s.request_approval(&approval("a1", "r1", Capability::Egress, expires))
        .await
        .unwrap();
    s.request_approval(&approval("a2", "r1", Capability::Egress, expires))
        .await
        .unwrap();
    // Before the expiry it is pending; at and after it, it reads expired.
    let read = |at| {
        let s = s.clone();
        async move { s.get_approval("a1", at).await.unwrap().unwrap().state }
    };
    assert_eq!(read(expires - 1).await, ApprovalState::Pending);
    assert_eq!(read(expires).await, ApprovalState::Expired);
    assert_eq!(
        s.list_pending_approvals("alice", expires - 1)
            .await
            .unwrap()
            .len(),
        2
    );
    assert!(
        s.list_pending_approvals("alice", expires)
            .await
            .unwrap()
            .is_empty()
    );
    // An approval that comes too late is refused and the approval is written expired.
    let late = s
        .decide_approval(
            "a1",
            Decision::Approve(ApprovalScope::Run),
            "alice",
            expires + 5,
        )
        .await
        .unwrap();
    match &late {
        Decided::Expired(a) => {
            assert_eq!(a.state, ApprovalState::Expired);
            assert_eq!(a.decided_by, None);
            assert_eq!(a.scope, ApprovalScope::Once);
        }
        other => panic!("{other:?}"),
    }
    // a2 is past its expiry too, so nothing live holds the run any more (a2 is still
    // pending in the table until the sweep).
    assert_eq!(
        s.get_run("r1").await.unwrap().unwrap().state,
        RunState::Running
    );
    // Nothing approved it for the run.
    assert!(
        s.standing_grant(
            "r1",
            Capability::Egress,
            &approval("x", "r1", Capability::Egress, 0).target
        )
        .await
        .unwrap()
        .is_none()
    );
    let swept = s.expire_approvals(expires + 10).await.unwrap();
    assert_eq!(
        swept.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(),
        ["a2"]
    );
    assert!(s.expire_approvals(expires + 20).await.unwrap().is_empty());
    assert_eq!(
        s.get_run("r1").await.unwrap().unwrap().state,
        RunState::Running
    );
    let decided: Vec<String> = all_events(&s, "r1")
        .await
        .into_iter()
        .filter(|e| e.kind == EVENT_APPROVAL_DECIDED)
        .map(|e| {
            format!(
                "{}:{}",
                e.payload["id"].as_str().unwrap(),
                e.payload["state"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(decided, ["a1:expired", "a2:expired"]);
}

#[tokio::test]
async fn racing_decisions_have_one_winner() {
    let (_d, s) = with_runtime().await;
    started(&s, &run("r1", "rt", None)).await;
    applied(&s, "r1", RunState::Running).await;
    let far = now_ms() + 600_000;
    for i in 0..10 {
        let id = format!("a{i}");
        s.request_approval(&approval(&id, "r1", Capability::Egress, far))
            .await
            .unwrap();
        let now = now_ms();
        let (a, b) = tokio::join!(
            s.decide_approval(&id, Decision::Approve(ApprovalScope::Once), "alice", now),
            s.decide_approval(&id, Decision::Deny, "carol", now),
        );
        let winners = [a.unwrap(), b.unwrap()]
            .into_iter()
            .filter(|d| matches!(d, Decided::Decided(_)))
            .count();
        assert_eq!(winners, 1);
    }
    let decided = all_events(&s, "r1")
        .await
        .into_iter()
        .filter(|e| e.kind == EVENT_APPROVAL_DECIDED)
        .count();
    assert_eq!(
        decided, 10,
        "one event per decision, none for the refused one"
    );
}

#[tokio::test]
async fn a_standing_grant_matches_capability_host_method_and_name_of_the_run() {
    let (_d, s) = with_runtime().await;
    started(&s, &run("r1", "rt", None)).await;
    applied(&s, "r1", RunState::Running).await;
    let far = now_ms() + 600_000;
    s.request_approval(&approval("once", "r1", Capability::Credential, far))
        .await
        .unwrap();
    s.decide_approval(
        "once",
        Decision::Approve(ApprovalScope::Once),
        "alice",
        now_ms(),
    )
    .await
    .unwrap();
    let target = |host: &str, method: &str, path: &str, name: &str| ApprovalTarget {
        host: Some(host.into()),
        method: Some(method.into()),
        path: Some(path.into()),
        name: Some(name.into()),
    };
    let same = target("api.github.com", "POST", "/other/path", "github");
    // An approval for one action is no standing grant.
    assert!(
        s.standing_grant("r1", Capability::Credential, &same)
            .await
            .unwrap()
            .is_none()
    );
    s.request_approval(&approval("run", "r1", Capability::Credential, far))
        .await
        .unwrap();
    s.decide_approval(
        "run",
        Decision::Approve(ApprovalScope::Run),
        "alice",
        now_ms(),
    )
    .await
    .unwrap();
    let grant = s
        .standing_grant("r1", Capability::Credential, &same)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(grant.id, "run");
    assert_eq!(grant.scope, ApprovalScope::Run);
    // Case of host and method does not matter; the path is not compared.
    assert!(
        s.standing_grant(
            "r1",
            Capability::Credential,
            &target("API.GITHUB.COM", "post", "/", "github")
        )
        .await
        .unwrap()
        .is_some()
    );
    for (capability, t) in [
        (
            Capability::Credential,
            target("api.github.com", "DELETE", "/", "github"),
        ),
        (
            Capability::Credential,
            target("evil.example", "POST", "/", "github"),
        ),
        (
            Capability::Credential,
            target("api.github.com", "POST", "/", "other"),
        ),
        (Capability::Egress, same.clone()),
    ] {
        assert!(
            s.standing_grant("r1", capability, &t)
                .await
                .unwrap()
                .is_none(),
            "{capability} {t:?}"
        );
    }
    let no_method = ApprovalTarget {
        method: None,
        ..same.clone()
    };
    assert!(
        s.standing_grant("r1", Capability::Credential, &no_method)
            .await
            .unwrap()
            .is_none()
    );
    // Only for its own run.
    applied(&s, "r1", RunState::Succeeded).await;
    started(&s, &run("r2", "rt", None)).await;
    assert!(
        s.standing_grant("r2", Capability::Credential, &same)
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn runs_and_events_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agents.db");
    {
        let s = Store::open(&path).await.unwrap();
        s.insert_sandbox(&sandbox("sb", "alice", SandboxState::Running))
            .await
            .unwrap();
        s.insert_agent_runtime(&runtime("rt", "sb", "alice"))
            .await
            .unwrap();
        started(&s, &run("r1", "rt", Some("k"))).await;
        applied(&s, "r1", RunState::Running).await;
        for i in 0..3 {
            s.append_event("r1", &event("message_delta", json!({"i": i})))
                .await
                .unwrap();
        }
        s.close().await;
    }
    let s = Store::open(&path).await.unwrap();
    let live = s.live_runs().await.unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].id, "r1");
    assert_eq!(live[0].state, RunState::Running);
    assert_eq!(all_events(&s, "r1").await.len(), 3);
    // Numbering goes on after the restart.
    let next = s
        .append_event("r1", &event("message", json!({})))
        .await
        .unwrap();
    assert_eq!(next.event().unwrap().seq, 4);
    let again = s.start_run(&run("r2", "rt", Some("k"))).await.unwrap();
    assert!(matches!(again, RunStart::Existing(r) if r.id == "r1"));
    // The daemon marks a run whose harness died with it failed.
    match s
        .transition_run("r1", RunState::Failed, Some("daemon restarted"))
        .await
        .unwrap()
    {
        RunUpdate::Applied(r) => assert_eq!(r.reason.as_deref(), Some("daemon restarted")),
        other => panic!("{other:?}"),
    }
    assert!(s.live_runs().await.unwrap().is_empty());
}

#[tokio::test]
async fn two_store_handles_on_one_file_still_number_without_gaps() {
    // Each handle has its own writer connection, so this exercises the database's own
    // locking (BEGIN IMMEDIATE and the conditional UPDATE), not the in-process queue.
    let (dir, a) = with_runtime().await;
    let b = Store::open(&dir.path().join("agents.db")).await.unwrap();
    let (ra, rb) = (run("ra", "rt", Some("k")), run("rb", "rt", Some("k")));
    let (x, y) = tokio::join!(a.start_run(&ra), b.start_run(&rb));
    let (x, y) = (x.unwrap(), y.unwrap());
    assert_eq!(x.run().id, y.run().id);
    let id = x.run().id.clone();
    let mut tasks = Vec::new();
    for (n, s) in [a.clone(), b.clone(), a.clone(), b.clone()]
        .into_iter()
        .enumerate()
    {
        let id = id.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..50 {
                s.append_event(&id, &event("e", json!({"n": n, "i": i})))
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seqs: Vec<i64> = all_events(&a, &id).await.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=200).collect::<Vec<_>>());
}
