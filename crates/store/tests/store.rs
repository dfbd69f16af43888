//! Behaviour of the public store API against in-memory and file-backed SQLite.

use std::collections::BTreeMap;

use sandpit_store::{
    Claim, PoolRecord, SandboxFilter, SandboxRecord, SandboxState, Store, StoreError,
    TemplateRecord,
};
use serde_json::json;

fn sandbox(id: &str, owner: &str, created_at_ms: i64) -> SandboxRecord {
    SandboxRecord {
        id: id.to_string(),
        owner: owner.to_string(),
        template: "base".to_string(),
        runtime: "ns".to_string(),
        state: SandboxState::Creating,
        cpu_millis: 1000,
        memory_bytes: 512 << 20,
        disk_bytes: 1 << 30,
        max_processes: 256,
        env: BTreeMap::new(),
        secret_env: Default::default(),
        metadata: BTreeMap::new(),
        created_at_ms,
        updated_at_ms: created_at_ms,
        expires_at_ms: created_at_ms + 60_000,
        runtime_state: json!({}),
        error: None,
        version: 0,
        pool: None,
        life: Default::default(),
    }
}

#[tokio::test]
async fn api_key_roles_are_added_once_and_checked_per_key() {
    let store = Store::open_in_memory().await.unwrap();
    let (key, _) = store.create_api_key("alice", "ci").await.unwrap();
    let (other, _) = store.create_api_key("alice", "laptop").await.unwrap();
    assert!(store.api_key_roles(&key.id).await.unwrap().is_empty());
    assert!(!store.key_has_role(&key.id, "approver").await.unwrap());
    assert!(store.add_api_key_role(&key.id, "approver").await.unwrap());
    assert!(store.add_api_key_role(&key.id, "approver").await.unwrap());
    assert!(store.add_api_key_role(&key.id, "auditor").await.unwrap());
    assert_eq!(
        store.api_key_roles(&key.id).await.unwrap(),
        ["approver", "auditor"]
    );
    assert!(store.key_has_role(&key.id, "approver").await.unwrap());
    assert!(!store.key_has_role(&other.id, "approver").await.unwrap());
    assert!(
        !store
            .add_api_key_role("no-such-key", "approver")
            .await
            .unwrap()
    );
    for bad in ["", "Approver", "a,b", "a b"] {
        assert!(
            matches!(
                store.add_api_key_role(&key.id, bad).await,
                Err(StoreError::InvalidRole(_))
            ),
            "{bad:?}"
        );
    }
    assert!(!store.key_has_role("no-such-key", "approver").await.unwrap());
}

#[tokio::test]
async fn api_keys_create_authenticate_list_revoke() {
    let store = Store::open_in_memory().await.unwrap();
    let (key, plaintext) = store.create_api_key("alice", "ci").await.unwrap();
    assert_eq!(key.owner, "alice");
    assert_eq!(key.name, "ci");
    assert_eq!(key.last_used_at_ms, None);
    assert!(plaintext.starts_with("sp_"));
    assert_eq!(plaintext.len(), 43);
    assert!(
        plaintext[3..]
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    );

    let (other, other_plain) = store.create_api_key("bob", "laptop").await.unwrap();
    assert_ne!(plaintext, other_plain);
    assert_ne!(key.id, other.id);

    let authed = store.authenticate(&plaintext).await.unwrap().unwrap();
    assert_eq!(authed.id, key.id);
    assert_eq!(authed.owner, "alice");
    assert!(authed.last_used_at_ms.is_some());

    // Wrong keys: well-formed but unknown, malformed, empty, and a one-character change.
    let unknown = format!("sp_{}", "0".repeat(40));
    let mut tweaked = plaintext.clone();
    let last = if tweaked.ends_with('0') { "1" } else { "0" };
    tweaked.replace_range(42.., last);
    for wrong in [
        unknown.as_str(),
        "sp_nothex",
        "",
        tweaked.as_str(),
        &plaintext[..42],
    ] {
        assert!(
            store.authenticate(wrong).await.unwrap().is_none(),
            "{wrong:?}"
        );
    }

    let listed = store.list_api_keys().await.unwrap();
    assert_eq!(listed.len(), 2);
    let listed_alice = listed.iter().find(|k| k.id == key.id).unwrap();
    assert_eq!(listed_alice.last_used_at_ms, authed.last_used_at_ms);

    assert!(store.revoke_api_key(&key.id).await.unwrap());
    assert!(!store.revoke_api_key(&key.id).await.unwrap());
    assert!(store.authenticate(&plaintext).await.unwrap().is_none());
    // Revoking one key leaves the others working.
    assert!(store.authenticate(&other_plain).await.unwrap().is_some());
    let listed = store.list_api_keys().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, other.id);
}

#[tokio::test]
async fn sandbox_roundtrip_keeps_every_field() {
    let store = Store::open_in_memory().await.unwrap();
    let record = SandboxRecord {
        id: "sb-1".into(),
        owner: "alice".into(),
        template: "python:3.12".into(),
        runtime: "namespaces".into(),
        state: SandboxState::Paused,
        cpu_millis: 2500,
        memory_bytes: 3 << 30,
        disk_bytes: 10 << 30,
        max_processes: 1024,
        env: BTreeMap::from([
            ("PATH".into(), "/usr/bin:/bin".into()),
            ("QUOTE".into(), "a \"quoted\" value\n".into()),
        ]),
        secret_env: ["QUOTE".to_string()].into(),
        metadata: BTreeMap::from([("team".into(), "ml".into()), ("ünï".into(), "cödé".into())]),
        created_at_ms: 1_700_000_000_001,
        updated_at_ms: 1_700_000_000_002,
        expires_at_ms: 1_700_000_900_000,
        runtime_state: json!({"pid": 4242, "uids": [100000, 165536], "nested": {"ok": true}}),
        error: Some("previous failure".into()),
        version: 7,
        pool: Some("warm".into()),
        life: sandpit_store::Lifecycle {
            layers: vec!["snap-1".into(), "hib-2".into()],
            snapshot: Some("snap-1".into()),
            last_activity_ms: 1_700_000_000_003,
            idle_timeout_secs: 300,
            on_timeout: sandpit_store::OnTimeout::Pause,
            auto_resume: true,
            paused_at_ms: Some(1_700_000_000_004),
            workdir: Some("/work".into()),
            user: Some("root".into()),
            timeout_secs: 600,
            sudo: true,
        },
    };
    store.insert_sandbox(&record).await.unwrap();
    let got = store.get_sandbox("sb-1").await.unwrap().unwrap();
    assert_eq!(got, record);
    assert!(store.get_sandbox("missing").await.unwrap().is_none());
}

#[tokio::test]
async fn duplicate_insert_is_conflict() {
    let store = Store::open_in_memory().await.unwrap();
    store.insert_sandbox(&sandbox("dup", "a", 1)).await.unwrap();
    let err = store
        .insert_sandbox(&sandbox("dup", "b", 2))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");
    // The original row is untouched.
    assert_eq!(store.get_sandbox("dup").await.unwrap().unwrap().owner, "a");
}

#[tokio::test]
async fn transition_is_compare_and_set() {
    let store = Store::open_in_memory().await.unwrap();
    let original = sandbox("sb", "alice", 10);
    store.insert_sandbox(&original).await.unwrap();

    let running = store
        .transition("sb", &[SandboxState::Creating], SandboxState::Running, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(running.state, SandboxState::Running);
    assert_eq!(running.version, original.version + 1);
    assert!(running.updated_at_ms > original.updated_at_ms);
    assert_eq!(running.error, None);

    // Refused: the current state (running) is not in `from`; nothing changes.
    let refused = store
        .transition(
            "sb",
            &[SandboxState::Creating],
            SandboxState::Error,
            Some("x"),
        )
        .await
        .unwrap();
    assert!(refused.is_none());
    let now = store.get_sandbox("sb").await.unwrap().unwrap();
    assert_eq!(now, running);

    // Empty `from` never matches; neither does a missing row.
    assert!(
        store
            .transition("sb", &[], SandboxState::Stopped, None)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        store
            .transition("nope", &SandboxState::ALL, SandboxState::Stopped, None)
            .await
            .unwrap()
            .is_none()
    );

    // Allowed from one of several states, with an error message recorded.
    let failed = store
        .transition(
            "sb",
            &[SandboxState::Paused, SandboxState::Running],
            SandboxState::Error,
            Some("oom killed"),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(failed.state, SandboxState::Error);
    assert_eq!(failed.error.as_deref(), Some("oom killed"));
    assert_eq!(failed.version, original.version + 2);
    assert_eq!(
        store.get_sandbox("sb").await.unwrap().unwrap(),
        failed,
        "returned record matches stored row"
    );
}

#[tokio::test]
async fn concurrent_transitions_only_one_wins() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("cas.db")).await.unwrap();
    store
        .insert_sandbox(&sandbox("race", "a", 1))
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .transition(
                    "race",
                    &[SandboxState::Creating],
                    SandboxState::Running,
                    None,
                )
                .await
                .unwrap()
                .is_some()
        }));
    }
    let mut winners = 0;
    for task in tasks {
        if task.await.unwrap() {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
    assert_eq!(store.get_sandbox("race").await.unwrap().unwrap().version, 1);
}

#[tokio::test]
async fn runtime_state_and_expiry_updates() {
    let store = Store::open_in_memory().await.unwrap();
    store.insert_sandbox(&sandbox("sb", "a", 1)).await.unwrap();
    let blob = json!({"pid": 99, "cgroup": "/sys/fs/cgroup/sandpit/sb"});
    store.set_runtime_state("sb", &blob).await.unwrap();
    assert!(store.set_expires_at("sb", 123_456).await.unwrap());
    let got = store.get_sandbox("sb").await.unwrap().unwrap();
    assert_eq!(got.runtime_state, blob);
    assert_eq!(got.expires_at_ms, 123_456);
    assert_eq!(got.version, 0, "only state transitions bump the version");
    assert!(got.updated_at_ms > 1);

    let err = store.set_runtime_state("missing", &blob).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
    // Only while creating: a sandbox deleted meanwhile must not gain a handle.
    let mut gone = sandbox("sb2", "a", 1);
    gone.state = SandboxState::Stopping;
    store.insert_sandbox(&gone).await.unwrap();
    let err = store.set_runtime_state("sb2", &blob).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
    assert!(!store.set_expires_at("missing", 5).await.unwrap());

    assert!(store.delete_sandbox("sb").await.unwrap());
    assert!(!store.delete_sandbox("sb").await.unwrap());
    assert!(store.get_sandbox("sb").await.unwrap().is_none());
}

/// Collects every page, asserting each page is full except possibly the last.
async fn all_pages(store: &Store, mut filter: SandboxFilter) -> (Vec<String>, usize) {
    let mut ids = Vec::new();
    let mut pages = 0;
    loop {
        let page = store.list_sandboxes(&filter).await.unwrap();
        pages += 1;
        ids.extend(page.items.iter().map(|s| s.id.clone()));
        match page.next_cursor {
            Some(cursor) => {
                assert_eq!(
                    page.items.len(),
                    filter.limit as usize,
                    "short non-final page"
                );
                filter.cursor = Some(cursor);
            }
            None => return (ids, pages),
        }
        assert!(pages < 100, "pagination does not terminate");
    }
}

#[tokio::test]
async fn listing_filters_and_paginates() {
    let store = Store::open_in_memory().await.unwrap();
    // 25 rows; several share a timestamp so the id tie-break matters.
    for i in 0..25 {
        let mut s = sandbox(
            &format!("sb-{i:02}"),
            if i % 2 == 0 { "alice" } else { "bob" },
            1000 + (i / 3),
        );
        if i % 3 == 0 {
            s.metadata.insert("tier".into(), "gold".into());
        } else {
            s.metadata.insert("tier".into(), "silver".into());
        }
        s.metadata.insert("idx".into(), i.to_string());
        if i % 5 == 0 {
            s.state = SandboxState::Running;
        }
        store.insert_sandbox(&s).await.unwrap();
    }
    let all: Vec<String> = (0..25).map(|i| format!("sb-{i:02}")).collect();

    // No filter, limit 10: pages of 10, 10, 5 in (created_at, id) order.
    let first = store
        .list_sandboxes(&SandboxFilter {
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(first.items.len(), 10);
    assert!(first.next_cursor.is_some());
    let (ids, pages) = all_pages(
        &store,
        SandboxFilter {
            limit: 10,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids, all);
    assert_eq!(pages, 3);

    // Limit 0 means the default (100): everything in one page.
    let page = store
        .list_sandboxes(&SandboxFilter::default())
        .await
        .unwrap();
    assert_eq!(page.items.len(), 25);
    assert!(page.next_cursor.is_none());

    // Exactly-divisible result set: no empty trailing page.
    let (ids, pages) = all_pages(
        &store,
        SandboxFilter {
            limit: 5,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids.len(), 25);
    assert_eq!(pages, 5);

    // Metadata matching every third row (9 rows: 0,3,...,24), limit 2 → 2,2,2,2,1.
    let gold: Vec<String> = (0..25)
        .filter(|i| i % 3 == 0)
        .map(|i| format!("sb-{i:02}"))
        .collect();
    let filter = SandboxFilter {
        metadata: vec![("tier".into(), "gold".into())],
        limit: 2,
        ..Default::default()
    };
    let (ids, pages) = all_pages(&store, filter).await;
    assert_eq!(ids, gold);
    assert_eq!(pages, 5);

    // Limit 3 divides the 9 matches exactly: three full pages and no empty trailing one.
    let filter = SandboxFilter {
        metadata: vec![("tier".into(), "gold".into())],
        limit: 3,
        ..Default::default()
    };
    let (ids, pages) = all_pages(&store, filter).await;
    assert_eq!(ids, gold);
    assert_eq!(pages, 3);

    // Same with limit 10 over 25 rows: one full scan yields all 9, no cursor.
    let filter = SandboxFilter {
        metadata: vec![("tier".into(), "gold".into())],
        limit: 10,
        ..Default::default()
    };
    let page = store.list_sandboxes(&filter).await.unwrap();
    assert_eq!(
        page.items.iter().map(|s| s.id.clone()).collect::<Vec<_>>(),
        gold
    );
    assert!(page.next_cursor.is_none());

    // Owner filter combined with metadata: alice has the even rows; gold ∩ even = 0,6,12,18,24.
    let filter = SandboxFilter {
        owner: Some("alice".into()),
        metadata: vec![("tier".into(), "gold".into())],
        limit: 2,
        ..Default::default()
    };
    let (ids, _) = all_pages(&store, filter).await;
    assert_eq!(ids, ["sb-00", "sb-06", "sb-12", "sb-18", "sb-24"]);

    // Several metadata pairs must all match.
    let filter = SandboxFilter {
        metadata: vec![("tier".into(), "gold".into()), ("idx".into(), "9".into())],
        ..Default::default()
    };
    let page = store.list_sandboxes(&filter).await.unwrap();
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].id, "sb-09");

    // A key nobody has matches nothing.
    let filter = SandboxFilter {
        metadata: vec![("absent".into(), "gold".into())],
        ..Default::default()
    };
    assert!(
        store
            .list_sandboxes(&filter)
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // State filter: running rows are 0,5,10,15,20; plus creating → everything.
    let filter = SandboxFilter {
        states: vec![SandboxState::Running],
        limit: 2,
        ..Default::default()
    };
    let (ids, pages) = all_pages(&store, filter).await;
    assert_eq!(ids, ["sb-00", "sb-05", "sb-10", "sb-15", "sb-20"]);
    assert_eq!(pages, 3);
    let filter = SandboxFilter {
        states: vec![SandboxState::Running, SandboxState::Creating],
        limit: 7,
        ..Default::default()
    };
    assert_eq!(all_pages(&store, filter).await.0, all);

    // Owner filter alone.
    let filter = SandboxFilter {
        owner: Some("bob".into()),
        limit: 4,
        ..Default::default()
    };
    let (ids, _) = all_pages(&store, filter).await;
    assert_eq!(ids.len(), 12);
    assert!(
        ids.iter()
            .all(|id| id[3..].parse::<u32>().unwrap() % 2 == 1)
    );
}

#[tokio::test]
async fn listing_newest_first_from_a_time_and_by_template() {
    let store = Store::open_in_memory().await.unwrap();
    // Pairs share a timestamp, so the id tie-break is reversed too.
    for i in 0..9 {
        let mut s = sandbox(&format!("sb-{i}"), "o", 1000 + (i / 2));
        if i % 3 == 0 {
            s.template = "other".into();
        }
        store.insert_sandbox(&s).await.unwrap();
    }
    let newest: Vec<String> = (0..9).rev().map(|i| format!("sb-{i}")).collect();
    for limit in [1, 2, 4, 9, 100] {
        let filter = SandboxFilter {
            newest_first: true,
            limit,
            ..Default::default()
        };
        assert_eq!(all_pages(&store, filter).await.0, newest, "limit {limit}");
    }
    // The bound is inclusive: sb-4 and sb-5 were created at exactly 1002.
    let filter = SandboxFilter {
        created_from_ms: Some(1002),
        limit: 2,
        ..Default::default()
    };
    let (ids, pages) = all_pages(&store, filter).await;
    assert_eq!(ids, ["sb-4", "sb-5", "sb-6", "sb-7", "sb-8"]);
    assert_eq!(pages, 3);
    let filter = SandboxFilter {
        created_from_ms: Some(1002),
        newest_first: true,
        template: Some("other".into()),
        limit: 1,
        ..Default::default()
    };
    assert_eq!(all_pages(&store, filter).await.0, ["sb-6"]);
    let filter = SandboxFilter {
        template: Some("other".into()),
        ..Default::default()
    };
    assert_eq!(all_pages(&store, filter).await.0, ["sb-0", "sb-3", "sb-6"]);
}

#[tokio::test]
async fn malformed_cursor_is_invalid_cursor() {
    let store = Store::open_in_memory().await.unwrap();
    store.insert_sandbox(&sandbox("a", "o", 1)).await.unwrap();
    for bad in ["not-hex", "abc", "00ff", "3132333a"] {
        let filter = SandboxFilter {
            cursor: Some(bad.into()),
            ..Default::default()
        };
        let err = store.list_sandboxes(&filter).await.unwrap_err();
        assert!(matches!(err, StoreError::InvalidCursor), "{bad}: {err:?}");
    }
}

#[tokio::test]
async fn expired_and_live_sandboxes() {
    let store = Store::open_in_memory().await.unwrap();
    let specs = [
        ("a", SandboxState::Running, 100),
        ("b", SandboxState::Paused, 200),
        ("c", SandboxState::Running, 300),
        ("d", SandboxState::Stopped, 50),
        ("e", SandboxState::Error, 50),
        ("f", SandboxState::Creating, 10),
        ("g", SandboxState::Stopping, 10_000),
    ];
    for (i, (id, state, expires)) in specs.into_iter().enumerate() {
        let mut s = sandbox(id, "o", i as i64);
        s.state = state;
        s.expires_at_ms = expires;
        store.insert_sandbox(&s).await.unwrap();
    }
    let ids = |v: Vec<SandboxRecord>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();

    let expired = store
        .expired_sandboxes(200, &[SandboxState::Running, SandboxState::Paused])
        .await
        .unwrap();
    assert_eq!(
        ids(expired),
        ["a", "b"],
        "boundary is inclusive, c not yet expired"
    );
    let expired = store
        .expired_sandboxes(99, &[SandboxState::Running, SandboxState::Paused])
        .await
        .unwrap();
    assert!(expired.is_empty());
    // Empty state list means any state, ordered by expiry.
    let expired = store.expired_sandboxes(100, &[]).await.unwrap();
    assert_eq!(ids(expired), ["f", "d", "e", "a"]);

    let live = store.live_sandboxes().await.unwrap();
    assert_eq!(ids(live), ["a", "b", "c", "f", "g"]);
    assert!(SandboxState::Stopped.is_final() && SandboxState::Error.is_final());
    assert!(!SandboxState::Stopping.is_final());
}

#[tokio::test]
async fn templates_crud() {
    let store = Store::open_in_memory().await.unwrap();
    assert!(store.list_templates().await.unwrap().is_empty());
    let base = TemplateRecord {
        name: "base".into(),
        rootfs: "/var/lib/sandpit/base".into(),
        created_at_ms: 5,
        ..Default::default()
    };
    let py = TemplateRecord {
        name: "python".into(),
        rootfs: "/var/lib/sandpit/py".into(),
        created_at_ms: 6,
        ..Default::default()
    };
    store.upsert_template(&py).await.unwrap();
    store.upsert_template(&base).await.unwrap();
    assert_eq!(
        store.get_template("base").await.unwrap(),
        Some(base.clone())
    );
    assert_eq!(
        store.list_templates().await.unwrap(),
        [base.clone(), py.clone()]
    );

    // Upsert repoints the rootfs but keeps the original registration time.
    let moved = TemplateRecord {
        rootfs: "/srv/base-v2".into(),
        created_at_ms: 99,
        ..base.clone()
    };
    store.upsert_template(&moved).await.unwrap();
    let got = store.get_template("base").await.unwrap().unwrap();
    assert_eq!(got.rootfs, "/srv/base-v2");
    assert_eq!(got.created_at_ms, 5);
    assert_eq!(store.list_templates().await.unwrap().len(), 2);

    assert!(store.delete_template("base").await.unwrap());
    assert!(!store.delete_template("base").await.unwrap());
    assert!(store.get_template("base").await.unwrap().is_none());
    assert_eq!(store.list_templates().await.unwrap(), [py]);
}

#[tokio::test]
async fn file_database_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested-name.db");
    let plaintext;
    {
        let store = Store::open(&path).await.unwrap();
        plaintext = store.create_api_key("alice", "k").await.unwrap().1;
        let mut s = sandbox("persist", "alice", 42);
        s.metadata.insert("k".into(), "v".into());
        store.insert_sandbox(&s).await.unwrap();
        store
            .upsert_template(&TemplateRecord {
                name: "t".into(),
                rootfs: "/r".into(),
                created_at_ms: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        store.close().await;
    }
    assert!(path.exists());
    // Reopening re-runs the schema step, which must be a no-op, and the data is still there.
    for _ in 0..2 {
        let store = Store::open(&path).await.unwrap();
        assert_eq!(
            store.authenticate(&plaintext).await.unwrap().unwrap().owner,
            "alice"
        );
        let s = store.get_sandbox("persist").await.unwrap().unwrap();
        assert_eq!(s.metadata.get("k").map(String::as_str), Some("v"));
        assert_eq!(store.list_templates().await.unwrap().len(), 1);
        assert_eq!(store.list_api_keys().await.unwrap().len(), 1);
        store.close().await;
    }
}

#[tokio::test]
async fn two_handles_on_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.db");
    let (a, b) = tokio::join!(Store::open(&path), Store::open(&path));
    let (a, b) = (a.unwrap(), b.unwrap());
    a.insert_sandbox(&sandbox("x", "o", 1)).await.unwrap();
    assert!(b.get_sandbox("x").await.unwrap().is_some());
}

#[test]
fn state_names_roundtrip() {
    for state in SandboxState::ALL {
        assert_eq!(state.as_str().parse::<SandboxState>().unwrap(), state);
        assert_eq!(state.to_string(), state.as_str());
        let json = serde_json::to_string(&state).unwrap();
        assert_eq!(json, format!("\"{}\"", state.as_str()));
    }
    assert!("Running".parse::<SandboxState>().is_err());
    assert!("".parse::<SandboxState>().is_err());
}

fn pool(name: &str, size: i64) -> PoolRecord {
    PoolRecord {
        name: name.into(),
        template: "host".into(),
        runtime: "container".into(),
        cpu_millis: 1000,
        memory_bytes: 512 << 20,
        disk_bytes: 1 << 30,
        max_processes: 512,
        size,
        source: "api".into(),
        hits: 0,
        misses: 0,
        created_at_ms: 1,
    }
}

#[tokio::test]
async fn pools_crud_counters_and_upsert_keeps_counts() {
    let store = Store::open_in_memory().await.unwrap();
    store.insert_pool(&pool("a", 2)).await.unwrap();
    assert!(matches!(
        store.insert_pool(&pool("a", 3)).await,
        Err(StoreError::Conflict(_))
    ));
    store.count_pool("a", 3, 1).await.unwrap();
    // A config reload redefines the pool but must not reset what it has counted.
    let mut redefined = pool("a", 5);
    redefined.source = "config".into();
    store.upsert_pool(&redefined).await.unwrap();
    let got = store.get_pool("a").await.unwrap().unwrap();
    assert_eq!((got.size, got.hits, got.misses), (5, 3, 1));
    assert_eq!(got.source, "config");
    assert!(store.resize_pool("a", 7).await.unwrap());
    assert!(!store.resize_pool("nope", 7).await.unwrap());
    store.insert_pool(&pool("b", 1)).await.unwrap();
    let names: Vec<String> = store
        .list_pools()
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert!(store.delete_pool("a").await.unwrap());
    assert!(!store.delete_pool("a").await.unwrap());
    assert!(store.get_pool("a").await.unwrap().is_none());
}

#[tokio::test]
async fn a_pooled_sandbox_is_claimed_once() {
    let store = Store::open_in_memory().await.unwrap();
    let mut rec = sandbox("p1", "", 10);
    rec.pool = Some("warm".into());
    rec.state = SandboxState::Running;
    store.insert_sandbox(&rec).await.unwrap();
    let mut other = sandbox("p2", "", 11);
    other.pool = Some("warm".into());
    store.insert_sandbox(&other).await.unwrap(); // still creating: not claimable
    let members: Vec<String> = store
        .pool_members("warm")
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(members, ["p1", "p2"]);

    let env = BTreeMap::from([("K".to_string(), "v".to_string())]);
    let secret_env = std::collections::BTreeSet::from(["K".to_string()]);
    let meta = BTreeMap::from([("m".to_string(), "1".to_string())]);
    let life = sandpit_store::Lifecycle::default();
    let claim = |owner| Claim {
        owner,
        env: &env,
        secret_env: &secret_env,
        metadata: &meta,
        expires_at_ms: 99_000,
        life: &life,
    };
    // Many concurrent claimers of the same sandbox: exactly one wins.
    let mut tasks = Vec::new();
    for i in 0..16 {
        let store = store.clone();
        let (env, secret_env, meta, life) =
            (env.clone(), secret_env.clone(), meta.clone(), life.clone());
        tasks.push(tokio::spawn(async move {
            let owner = format!("owner{i}");
            let c = Claim {
                owner: &owner,
                env: &env,
                secret_env: &secret_env,
                metadata: &meta,
                expires_at_ms: 99_000,
                life: &life,
            };
            store.claim_pooled("p1", "warm", &c).await.unwrap()
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        if let Some(r) = t.await.unwrap() {
            winners.push(r);
        }
    }
    assert_eq!(winners.len(), 1);
    let won = &winners[0];
    assert!(won.owner.starts_with("owner"));
    assert_eq!(won.env, env);
    assert_eq!(won.secret_env, secret_env);
    assert_eq!(won.metadata, meta);
    assert_eq!(won.expires_at_ms, 99_000);
    assert_eq!(won.pool.as_deref(), Some("warm"));
    assert!(
        store
            .claim_pooled("p1", "warm", &claim("late"))
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        store
            .claim_pooled("p2", "warm", &claim("x"))
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        store
            .claim_pooled("p2", "other", &claim("x"))
            .await
            .unwrap()
            .is_none()
    );
    let left: Vec<String> = store
        .pool_members("warm")
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(left, ["p2"]);
}

#[tokio::test]
async fn activity_is_recorded_and_never_moves_back() {
    let store = Store::open_in_memory().await.unwrap();
    store.insert_sandbox(&sandbox("a", "o", 1)).await.unwrap();
    store
        .touch_sandboxes(&[("a".into(), 5_000), ("missing".into(), 9)])
        .await
        .unwrap();
    assert_eq!(
        store
            .get_sandbox("a")
            .await
            .unwrap()
            .unwrap()
            .life
            .last_activity_ms,
        5_000
    );
    store.touch_sandboxes(&[("a".into(), 4_000)]).await.unwrap();
    let got = store.get_sandbox("a").await.unwrap().unwrap();
    assert_eq!(got.life.last_activity_ms, 5_000);
    let mut life = got.life.clone();
    life.layers = vec!["l1".into()];
    assert!(store.set_life("a", &life).await.unwrap());
    assert!(!store.set_life("missing", &life).await.unwrap());
    let got = store.get_sandbox("a").await.unwrap().unwrap();
    assert_eq!(got.life.layers, vec!["l1".to_string()]);
    assert_eq!(got.life.last_activity_ms, 5_000);
}

#[tokio::test]
async fn snapshots_are_found_by_id_or_name_and_know_their_children() {
    let store = Store::open_in_memory().await.unwrap();
    let snap = |id: &str, name: &str, parent: Option<&str>| sandpit_store::SnapshotRecord {
        id: id.into(),
        owner: "o".into(),
        name: name.into(),
        sandbox_id: "sb".into(),
        parent: parent.map(String::from),
        template: "host".into(),
        runtime: "container".into(),
        kind: if parent.is_some() {
            "incremental"
        } else {
            "full"
        }
        .into(),
        size_bytes: 10,
        entries: 2,
        digest: "ab".into(),
        settings: json!({"env": {"A": "1"}}),
        created_at_ms: 1,
    };
    store
        .insert_snapshot(&snap("s1", "base", None))
        .await
        .unwrap();
    store
        .insert_snapshot(&snap("s2", "next", Some("s1")))
        .await
        .unwrap();
    let dup = store.insert_snapshot(&snap("s3", "base", None)).await;
    assert!(matches!(dup, Err(StoreError::Conflict(_))), "{dup:?}");
    assert_eq!(
        store.get_snapshot("o", "next").await.unwrap().unwrap().id,
        "s2"
    );
    assert_eq!(
        store.get_snapshot("o", "s1").await.unwrap().unwrap().name,
        "base"
    );
    assert!(store.get_snapshot("other", "s1").await.unwrap().is_none());
    let kids = store.snapshot_children("s1").await.unwrap();
    assert_eq!(
        kids.iter().map(|k| k.id.as_str()).collect::<Vec<_>>(),
        ["s2"]
    );
    assert_eq!(store.list_snapshots(Some("o")).await.unwrap().len(), 2);
    assert_eq!(
        store
            .get_snapshot("o", "s1")
            .await
            .unwrap()
            .unwrap()
            .settings,
        json!({"env": {"A": "1"}})
    );
    assert!(store.delete_snapshot("s2").await.unwrap());
    assert!(store.snapshot_children("s1").await.unwrap().is_empty());
}
