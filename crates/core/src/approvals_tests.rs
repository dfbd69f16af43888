//! The gate against a real store: policy, standing grants, decisions and expiry.

use super::*;
use sandpit_store::{
    NewAgentRuntime, NewRun, RunMode, RunStart, RunState, SandboxRecord, SandboxState,
};
use serde_json::json;

fn sandbox(id: &str) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        owner: "alice".into(),
        template: "host".into(),
        runtime: "container".into(),
        state: SandboxState::Running,
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

/// A store with sandbox `sb`, a runtime under `policy` and a running run `r1`.
async fn running(policy: serde_json::Value) -> (tempfile::TempDir, Arc<Approvals>, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("a.db")).await.unwrap();
    store.insert_sandbox(&sandbox("sb")).await.unwrap();
    let policy = checked_policy(Some(&policy), &ApprovalsConfig::default()).unwrap();
    store
        .insert_agent_runtime(&NewAgentRuntime {
            id: "rt".into(),
            sandbox_id: "sb".into(),
            owner: "alice".into(),
            harness: "pi".into(),
            harness_version: None,
            harness_template: None,
            approval_policy: policy,
            model: json!({}),
        })
        .await
        .unwrap();
    let started = store
        .start_run(&NewRun {
            id: "r1".into(),
            runtime_id: "rt".into(),
            task: "t".into(),
            mode: RunMode::Fresh,
            idempotency_key: None,
            max_events: 1000,
        })
        .await
        .unwrap();
    assert!(matches!(started, RunStart::Started(_)));
    store
        .transition_run("r1", RunState::Running, None)
        .await
        .unwrap();
    (dir, Arc::new(Approvals::new(store.clone(), 16)), store)
}

fn egress(host: &str) -> GateRequest {
    GateRequest {
        sandbox_id: "sb".into(),
        capability: GateCapability::Egress,
        host: host.into(),
        port: 80,
        method: Some("GET".into()),
        path: Some("/x".into()),
    }
}

/// The one pending approval, once the held action has recorded it.
async fn pending(store: &Store) -> ApprovalRecord {
    for _ in 0..200 {
        let p = store
            .list_pending_approvals("alice", now_ms())
            .await
            .unwrap();
        if let [one] = p.as_slice() {
            return one.clone();
        }
        assert!(p.len() < 2, "{p:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no approval was requested");
}

#[test]
fn policies_are_checked_and_take_the_daemon_timeout() {
    let cfg = ApprovalsConfig {
        timeout_secs: 42,
        ..ApprovalsConfig::default()
    };
    let p = checked_policy(Some(&json!({"egress": true})), &cfg).unwrap();
    assert_eq!(p["timeout_secs"], 42);
    assert_eq!(p["egress"], true);
    let p = checked_policy(Some(&json!({"timeout_secs": 7})), &cfg).unwrap();
    assert_eq!(p["timeout_secs"], 7);
    assert_eq!(checked_policy(None, &cfg).unwrap()["egress"], false);
    for bad in [
        json!([]),
        json!({"egres": true}),
        json!({"timeout_secs": 0}),
        json!({"credentials": [{"name": ""}]}),
        json!({"credentials": [{"name": "a", "methods": ["P OST"]}]}),
    ] {
        assert!(
            matches!(checked_policy(Some(&bad), &cfg), Err(CoreError::Invalid(_))),
            "{bad}"
        );
    }
}

#[tokio::test]
async fn an_ungated_sandbox_or_capability_is_not_held() {
    let (_d, a, store) =
        running(json!({"credentials": [{"name": "gh", "methods": ["POST"]}]})).await;
    assert_eq!(a.decide(egress("x.test")).await, GateDecision::NotGated);
    let mut other = egress("x.test");
    other.sandbox_id = "elsewhere".into();
    assert_eq!(a.decide(other).await, GateDecision::NotGated);
    // A credential only gated for POST.
    let mut get = egress("api.test");
    get.capability = GateCapability::Credential { name: "gh".into() };
    assert_eq!(a.decide(get.clone()).await, GateDecision::NotGated);
    assert!(
        store
            .list_owner_approvals("alice", now_ms())
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn approved_for_the_run_lets_the_same_target_through_without_asking() {
    let (_d, a, store) = running(json!({"egress": true})).await;
    let held = tokio::spawn({
        let a = a.clone();
        async move { a.decide(egress("x.test")).await }
    });
    let p = pending(&store).await;
    assert_eq!(p.target.host.as_deref(), Some("x.test:80"));
    assert!(
        p.summary.contains("x.test:80")
            && p.summary.contains("whole connection")
            && p.summary.contains("first request: GET /x"),
        "{}",
        p.summary
    );
    assert_eq!(
        store.get_run("r1").await.unwrap().unwrap().state,
        RunState::WaitingApproval
    );
    let decided = store
        .decide_approval(
            &p.id,
            Decision::Approve(ApprovalScope::Run),
            "alice",
            now_ms(),
        )
        .await
        .unwrap();
    assert!(matches!(decided, Decided::Decided(_)));
    a.wake(&p.id);
    assert_eq!(
        held.await.unwrap(),
        GateDecision::Approved {
            approval_id: p.id.clone()
        }
    );
    assert_eq!(
        store.get_run("r1").await.unwrap().unwrap().state,
        RunState::Running
    );
    // The same target again: the standing grant, no new approval.
    assert_eq!(
        a.decide(egress("X.test")).await,
        GateDecision::Approved {
            approval_id: p.id.clone()
        }
    );
    // Another port is another target: held again.
    let mut other = egress("x.test");
    other.port = 22;
    let held = tokio::spawn({
        let a = a.clone();
        async move { a.decide(other).await }
    });
    let p2 = pending(&store).await;
    assert_ne!(p2.id, p.id);
    store
        .decide_approval_with_reason(
            &p2.id,
            Decision::Deny,
            "alice",
            Some("not port 22"),
            now_ms(),
        )
        .await
        .unwrap();
    a.wake(&p2.id);
    assert_eq!(
        held.await.unwrap(),
        GateDecision::Refused {
            approval_id: Some(p2.id.clone()),
            reason: "denied: not port 22".into()
        }
    );
    let all = store.list_owner_approvals("alice", now_ms()).await.unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].reason, None);
    assert_eq!(
        all[1].reason.as_deref(),
        Some("not port 22"),
        "kept with the decision"
    );
}

#[tokio::test]
async fn an_undecided_approval_expires_and_refuses_the_action() {
    let (_d, a, store) = running(json!({"egress": true, "timeout_secs": 1})).await;
    let started = std::time::Instant::now();
    let d = a.decide(egress("slow.test")).await;
    let GateDecision::Refused {
        approval_id: Some(id),
        reason,
    } = d
    else {
        panic!("{d:?}");
    };
    assert!(reason.starts_with("expired"), "{reason}");
    assert!(started.elapsed() >= Duration::from_millis(900));
    let rec = store.get_approval(&id, 0).await.unwrap().unwrap();
    assert_eq!(
        rec.state,
        ApprovalState::Expired,
        "written, not just read so"
    );
    assert_eq!(
        store.get_run("r1").await.unwrap().unwrap().state,
        RunState::Running
    );
    // Deciding it now changes nothing.
    let late = store
        .decide_approval(
            &id,
            Decision::Approve(ApprovalScope::Once),
            "alice",
            now_ms(),
        )
        .await
        .unwrap();
    assert!(matches!(late, Decided::AlreadyDecided(_)));
}

#[tokio::test]
async fn a_gated_credential_stays_gated_when_no_run_is_active() {
    let (_d, a, store) =
        running(json!({"credentials": [{"name": "gh", "methods": ["POST"]}]})).await;
    store
        .transition_run("r1", RunState::Succeeded, None)
        .await
        .unwrap();
    // Code the run left behind posts with the secret: nobody can be asked, so it is refused.
    let mut post = egress("api.test");
    post.capability = GateCapability::Credential { name: "gh".into() };
    post.method = Some("post".into());
    match a.decide(post).await {
        GateDecision::Refused {
            approval_id: None,
            reason,
        } => assert!(
            reason.contains("no run of this sandbox is active"),
            "{reason}"
        ),
        other => panic!("a gated credential went through without a run: {other:?}"),
    }
    // What the policy does not gate is not held; egress outside the list keeps its refusal.
    let mut get = egress("api.test");
    get.capability = GateCapability::Credential { name: "gh".into() };
    assert_eq!(a.decide(get).await, GateDecision::NotGated);
    assert_eq!(a.decide(egress("x.test")).await, GateDecision::NotGated);
    assert!(
        store
            .list_owner_approvals("alice", now_ms())
            .await
            .unwrap()
            .is_empty()
    );
}

/// Every pending approval of the store, once there are `n`.
async fn n_pending(store: &Store, n: usize) -> Vec<ApprovalRecord> {
    for _ in 0..300 {
        let p = store
            .list_pending_approvals("alice", now_ms())
            .await
            .unwrap();
        if p.len() == n {
            return p;
        }
        assert!(p.len() < n, "{p:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{n} approvals were never pending");
}

/// How many held actions wait on approval `id`.
fn holders(a: &Approvals, id: &str) -> usize {
    a.waiting.lock().get(id).map_or(0, |w| w.holders)
}

async fn wait_holders(a: &Approvals, id: &str, n: usize) {
    for _ in 0..300 {
        if holders(a, id) == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("approval {id} never had {n} holders");
}

#[tokio::test]
async fn the_same_action_pending_twice_shares_one_record_and_one_decision() {
    let (_d, a, store) = running(json!({"egress": true})).await;
    let spawn = |req: GateRequest| {
        let a = a.clone();
        tokio::spawn(async move { a.decide(req).await })
    };
    let one = spawn(egress("x.test"));
    let p = pending(&store).await;
    let two = spawn(egress("x.test"));
    wait_holders(&a, &p.id, 2).await;
    assert_eq!(
        n_pending(&store, 1).await.len(),
        1,
        "joined, not asked twice"
    );
    // Another request line is another action: the approver must see what it approves.
    let mut elsewhere = egress("x.test");
    elsewhere.path = Some("/other".into());
    let three = spawn(elsewhere);
    let both = n_pending(&store, 2).await;
    let other = both.iter().find(|r| r.id != p.id).unwrap().clone();
    assert_eq!(other.target.path.as_deref(), Some("/other"));
    store
        .decide_approval(
            &p.id,
            Decision::Approve(ApprovalScope::Once),
            "k1",
            now_ms(),
        )
        .await
        .unwrap();
    a.wake(&p.id);
    let approved = GateDecision::Approved {
        approval_id: p.id.clone(),
    };
    assert_eq!(one.await.unwrap(), approved);
    assert_eq!(two.await.unwrap(), approved);
    assert!(!three.is_finished(), "its own approval is still pending");
    store
        .decide_approval(&other.id, Decision::Deny, "k1", now_ms())
        .await
        .unwrap();
    a.wake(&other.id);
    assert!(matches!(three.await.unwrap(), GateDecision::Refused { .. }));
    let events = store.events_after("r1", 0, 100).await.unwrap();
    let requested = events
        .iter()
        .filter(|e| e.kind == "approval_requested")
        .count();
    assert_eq!(requested, 2, "{events:?}");
}

#[tokio::test]
async fn a_run_at_its_limit_of_pending_approvals_refuses_more_at_once() {
    let (_d, _, store) = running(json!({"egress": true})).await;
    let a = Arc::new(Approvals::new(store.clone(), 2));
    let held: Vec<_> = ["a.test", "b.test"]
        .into_iter()
        .map(|h| {
            let a = a.clone();
            tokio::spawn(async move { a.decide(egress(h)).await })
        })
        .collect();
    n_pending(&store, 2).await;
    let started = std::time::Instant::now();
    let d = a.decide(egress("c.test")).await;
    assert!(started.elapsed() < Duration::from_secs(1), "not held");
    let GateDecision::Refused {
        approval_id: None,
        reason,
    } = d
    else {
        panic!("{d:?}");
    };
    assert!(reason.contains("2 approvals pending"), "{reason}");
    // The same action as a pending one still joins it: no new record is needed.
    let joined = {
        let a = a.clone();
        tokio::spawn(async move { a.decide(egress("a.test")).await })
    };
    let events = store.events_after("r1", 0, 100).await.unwrap();
    let refused: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "approval_refused")
        .collect();
    assert_eq!(refused.len(), 1, "{events:?}");
    assert_eq!(refused[0].payload["target"]["host"], "c.test:80");
    assert!(
        refused[0].payload["reason"]
            .as_str()
            .unwrap()
            .contains("limit")
    );
    assert_eq!(n_pending(&store, 2).await.len(), 2);
    store
        .transition_run("r1", RunState::Cancelled, None)
        .await
        .unwrap();
    for h in held {
        assert!(matches!(h.await.unwrap(), GateDecision::Refused { .. }));
    }
    assert!(matches!(
        joined.await.unwrap(),
        GateDecision::Refused { .. }
    ));
}

#[tokio::test]
async fn an_approval_whose_holder_goes_away_is_abandoned_and_cannot_be_approved() {
    let (_d, a, store) = running(json!({"egress": true})).await;
    let held = {
        let a = a.clone();
        tokio::spawn(async move { a.decide(egress("gone.test")).await })
    };
    let p = pending(&store).await;
    wait_holders(&a, &p.id, 1).await;
    // The proxy drops the gate's future when the held client disconnects.
    held.abort();
    let mut rec = store.get_approval(&p.id, now_ms()).await.unwrap().unwrap();
    for _ in 0..300 {
        if rec.state != ApprovalState::Pending {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        rec = store.get_approval(&p.id, now_ms()).await.unwrap().unwrap();
    }
    assert_eq!(rec.state, ApprovalState::Abandoned);
    assert!(rec.reason.as_deref().unwrap().contains("closed"), "{rec:?}");
    assert_eq!(rec.decided_by, None);
    assert_eq!(
        store.get_run("r1").await.unwrap().unwrap().state,
        RunState::Running
    );
    let late = store
        .decide_approval(&p.id, Decision::Approve(ApprovalScope::Run), "k1", now_ms())
        .await
        .unwrap();
    assert!(matches!(late, Decided::AlreadyDecided(_)), "{late:?}");
    let events = store.events_after("r1", 0, 100).await.unwrap();
    let decided: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "approval_decided")
        .collect();
    assert_eq!(decided.len(), 1, "{events:?}");
    assert_eq!(decided[0].payload["state"], "abandoned");
    // Nothing was let through for the run: the host is held (asked) again.
    let again = {
        let a = a.clone();
        tokio::spawn(async move { a.decide(egress("gone.test")).await })
    };
    let p2 = pending(&store).await;
    assert_ne!(p2.id, p.id);
    again.abort();
}

#[tokio::test]
async fn a_harness_tool_approved_for_the_run_is_let_through_for_other_commands() {
    let (_d, a, store) = running(json!({"harness_permissions": true})).await;
    let ask = |summary: &str| Ask {
        run_id: "r1".into(),
        capability: Capability::HarnessPermission,
        target: ApprovalTarget {
            name: Some("bash".into()),
            ..Default::default()
        },
        summary: summary.into(),
        detail: json!({"request_id": "x"}),
        expires_at_ms: now_ms() + 60_000,
        gone: "the run's harness stopped before a decision",
    };
    let held = {
        let a = a.clone();
        let ask = ask("bash: ls");
        tokio::spawn(async move { a.ask(ask).await })
    };
    let p = pending(&store).await;
    assert_eq!(p.capability, Capability::HarnessPermission);
    assert_eq!(p.target.name.as_deref(), Some("bash"));
    store
        .decide_approval(&p.id, Decision::Approve(ApprovalScope::Run), "k1", now_ms())
        .await
        .unwrap();
    a.wake(&p.id);
    assert!(matches!(held.await.unwrap(), GateDecision::Approved { .. }));
    assert_eq!(
        a.ask(ask("bash: make")).await,
        GateDecision::Approved { approval_id: p.id }
    );
}
