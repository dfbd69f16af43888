//! Warm pools against a real daemon: claims apply the caller's settings, never hand one
//! sandbox out twice, refill, survive restarts, and follow the config file.

use sandpit_api::{CreateSandboxRequest, LimitsSpec, PoolSpec, RunCommandRequest};
use sandpit_client::Client;
use sandpit_tests::{
    Daemon, error_status, leftovers, memory_limit, sandboxes, sh, tmpfs_mounted_on,
    wait_no_leftovers,
};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// Limits of the pools under test (small, and distinct from the defaults).
fn small() -> LimitsSpec {
    LimitsSpec {
        max_processes: Some(128),
        ..memory_limit(128)
    }
}

fn pool(name: &str, size: u32) -> PoolSpec {
    PoolSpec {
        name: name.into(),
        limits: small(),
        size,
        ..Default::default()
    }
}

/// Waits until the pool has `n` ready sandboxes.
async fn wait_ready(c: &Client, name: &str, n: u32) {
    for _ in 0..300 {
        if c.get_pool(name).await.unwrap().ready == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "pool {name} never had {n} ready: {:?}",
        c.get_pool(name).await
    );
}

/// Ids of a pool's idle sandboxes, read from the store (they belong to no API owner).
async fn idle_members(d: &Daemon, name: &str) -> BTreeSet<String> {
    let db = d.store().await;
    let ids = db
        .pool_members(name)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    db.close().await;
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_applies_env_workdir_and_metadata_then_the_pool_refills() {
    let d = Daemon::start().await;
    let c = d.client();
    let created = c.create_pool(&pool("warm", 2)).await.unwrap();
    assert_eq!((created.size, created.source.as_str()), (2, "api"));
    assert_eq!(created.limits.memory_bytes, 128 << 20);
    wait_ready(&c, "warm", 2).await;
    let before = idle_members(&d, "warm").await;
    assert_eq!(before.len(), 2);

    let req = CreateSandboxRequest {
        limits: small(),
        env: BTreeMap::from([("GREETING".into(), "hello pool".into())]),
        metadata: BTreeMap::from([("team".into(), "a".into())]),
        workdir: Some("/tmp".into()),
        timeout: Some(120),
        ..Default::default()
    };
    let sb = c.create_sandbox(&req).await.unwrap();
    assert_eq!(sb.pool.as_deref(), Some("warm"));
    assert!(before.contains(&sb.id), "the claim took an idle member");
    assert_eq!(sb.state, "running");
    assert_eq!(sb.metadata.get("team").map(String::as_str), Some("a"));
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    assert!(
        (sb.expires_at_ms - now_ms - 120_000).abs() < 10_000,
        "the caller's timeout applies: {}",
        sb.expires_at_ms - now_ms
    );
    let out = sh(&c, &sb.id, "echo \"$GREETING\"; pwd; id -un").await;
    assert_eq!(out.stdout, "hello pool\n/tmp\nuser\n");
    // The env is the sandbox's, for every command, as root too.
    let as_root = c
        .run(
            &sb.id,
            &RunCommandRequest {
                argv: vec!["printenv".into(), "GREETING".into()],
                user: Some("root".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(as_root.stdout, "hello pool\n");
    // The claimed sandbox is the caller's, listed and filtered like any other.
    let listed = c
        .list_sandboxes(None, &[("team".into(), "a".into())], None, None)
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].id, sb.id);
    // Idle members are nobody's: the admin's list does not show them.
    let all = c.list_sandboxes(None, &[], None, None).await.unwrap();
    assert_eq!(all.items.len(), 1);

    let p = c.get_pool("warm").await.unwrap();
    assert_eq!((p.hits, p.misses), (1, 0));
    wait_ready(&c, "warm", 2).await;
    let after = idle_members(&d, "warm").await;
    assert!(!after.contains(&sb.id));

    // Other limits: no pool matches, a cold start that counts as neither hit nor miss.
    let cold = c
        .create_sandbox(&CreateSandboxRequest {
            limits: LimitsSpec {
                max_processes: Some(100),
                ..small()
            },
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(cold.pool, None);
    let p = c.get_pool("warm").await.unwrap();
    assert_eq!((p.hits, p.misses), (1, 0));

    // Deleting a claimed sandbox does not disturb the pool.
    c.delete_sandbox(&sb.id).await.unwrap();
    assert_eq!(wait_no_leftovers(&d, &sb.id).await, Vec::<String>::new());
    assert_eq!(c.get_pool("warm").await.unwrap().ready, 2);

    // Deleting the pool destroys its idle members and nothing else.
    c.delete_pool("warm").await.unwrap();
    for id in &after {
        assert_eq!(wait_no_leftovers(&d, id).await, Vec::<String>::new());
    }
    assert!(idle_members(&d, "warm").await.is_empty());
    assert_eq!(sh(&c, &cold.id, "echo alive").await.stdout, "alive\n");
    assert_eq!(c.get_pool("warm").await.unwrap_err().status(), Some(404));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_share_a_sandbox() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_pool(&pool("race", 4)).await.unwrap();
    wait_ready(&c, "race", 4).await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let req = CreateSandboxRequest {
                limits: small(),
                env: BTreeMap::from([("WHO".into(), format!("caller{i}"))]),
                ..Default::default()
            };
            let sb = c.create_sandbox(&req).await.unwrap();
            let who = sh(&c, &sb.id, "echo $WHO").await.stdout;
            (i, sb, who)
        }));
    }
    let mut ids = BTreeSet::new();
    let mut from_pool = 0;
    for t in tasks {
        let (i, sb, who) = t.await.unwrap();
        assert_eq!(who, format!("caller{i}\n"), "each caller sees its own env");
        assert!(
            ids.insert(sb.id.clone()),
            "sandbox {} handed out twice",
            sb.id
        );
        if sb.pool.is_some() {
            from_pool += 1;
        }
    }
    let p = c.get_pool("race").await.unwrap();
    assert_eq!(p.hits + p.misses, 8);
    assert_eq!(p.hits, from_pool);
    assert!(p.hits >= 4, "the 4 ready sandboxes were used: {p:?}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_survive_a_restart_and_follow_the_config_file() {
    let mut d = Daemon::builder()
        .config("[[pools]]\nname = \"fromfile\"\nsize = 1\nlimits = { memory_bytes = 134217728, max_processes = 128 }\n")
        .start()
        .await;
    let c = d.client();
    let p = c.get_pool("fromfile").await.unwrap();
    assert_eq!((p.source.as_str(), p.size), ("config", 1));
    c.create_pool(&PoolSpec {
        name: "byapi".into(),
        limits: LimitsSpec {
            max_processes: Some(100),
            ..small()
        },
        size: 2,
        ..Default::default()
    })
    .await
    .unwrap();
    wait_ready(&c, "fromfile", 1).await;
    wait_ready(&c, "byapi", 2).await;
    let file_members = idle_members(&d, "fromfile").await;
    let api_members = idle_members(&d, "byapi").await;

    // A clean stop leaves idle members running; the next start adopts them.
    d.stop();
    let d = d.restart().start().await;
    let c = d.client();
    let p = c.get_pool("byapi").await.unwrap();
    assert_eq!((p.ready, p.source.as_str()), (2, "api"));
    assert_eq!(
        idle_members(&d, "byapi").await,
        api_members,
        "adopted, not remade"
    );
    let claimed = c
        .create_sandbox(&CreateSandboxRequest {
            limits: LimitsSpec {
                max_processes: Some(100),
                ..small()
            },
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(api_members.contains(&claimed.id));
    assert_eq!(sh(&c, &claimed.id, "echo ok").await.stdout, "ok\n");

    // The config file changes the pool's limits: its old member is not adopted (it would
    // serve creates that ask for the new limits) but replaced.
    let mut d = d;
    d.stop();
    std::fs::write(
        d.data.path().join("config.toml"),
        "[[pools]]\nname = \"fromfile\"\nsize = 1\nlimits = { memory_bytes = 100663296, max_processes = 128 }\n",
    )
    .unwrap();
    let mut d = d.restart().start().await;
    let c = d.client();
    assert_eq!(
        c.get_pool("fromfile").await.unwrap().limits.memory_bytes,
        96 << 20
    );
    for id in &file_members {
        assert_eq!(wait_no_leftovers(&d, id).await, Vec::<String>::new());
    }
    wait_ready(&c, "fromfile", 1).await;
    let file_members = idle_members(&d, "fromfile").await;
    assert!(file_members.is_disjoint(&idle_members(&d, "byapi").await));

    // The pool leaves the config file: at the next start it goes, with its sandbox.
    d.stop();
    std::fs::write(d.data.path().join("config.toml"), "").unwrap();
    let d = d.restart().start().await;
    let c = d.client();
    assert_eq!(
        c.get_pool("fromfile").await.unwrap_err().status(),
        Some(404)
    );
    for id in &file_members {
        assert_eq!(wait_no_leftovers(&d, id).await, Vec::<String>::new());
    }
    assert_eq!(c.get_pool("byapi").await.unwrap().size, 2);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_requests_are_checked() {
    let d = Daemon::start().await;
    let c = d.client();
    let bad_name = PoolSpec {
        name: "../x".into(),
        ..pool("x", 1)
    };
    assert_eq!(error_status(c.create_pool(&bad_name).await), Some(400));
    assert_eq!(
        error_status(c.create_pool(&pool("big", 100_000)).await),
        Some(400)
    );
    let bad_template = PoolSpec {
        template: Some("nope".into()),
        ..pool("t", 1)
    };
    assert_eq!(error_status(c.create_pool(&bad_template).await), Some(404));
    let bad_limits = PoolSpec {
        limits: LimitsSpec {
            memory_bytes: Some(1),
            ..Default::default()
        },
        ..pool("l", 1)
    };
    assert_eq!(error_status(c.create_pool(&bad_limits).await), Some(400));
    let process = PoolSpec {
        runtime: Some("process".into()),
        ..pool("p", 1)
    };
    assert_eq!(error_status(c.create_pool(&process).await), Some(403));
    c.create_pool(&pool("one", 1)).await.unwrap();
    assert_eq!(
        error_status(c.create_pool(&pool("one", 1)).await),
        Some(409)
    );
    // A second pool of the same kind would make claims ambiguous.
    assert_eq!(
        error_status(c.create_pool(&pool("same-kind", 1)).await),
        Some(409)
    );
    assert_eq!(error_status(c.resize_pool("nope", 1).await), Some(404));
    assert_eq!(c.delete_pool("nope").await.unwrap_err().status(), Some(404));

    // Only the admin key manages pools; any key may read them.
    let other = d.owner("mallory").await;
    assert_eq!(
        error_status(other.create_pool(&pool("m", 1)).await),
        Some(403)
    );
    assert_eq!(error_status(other.resize_pool("one", 5).await), Some(403));
    assert_eq!(
        other.delete_pool("one").await.unwrap_err().status(),
        Some(403)
    );
    assert_eq!(other.list_pools().await.unwrap().len(), 1);

    // Shrinking to zero destroys the idle member.
    wait_ready(&c, "one", 1).await;
    let member = idle_members(&d, "one").await;
    assert_eq!(c.resize_pool("one", 0).await.unwrap().ready, 0);
    for id in &member {
        assert_eq!(wait_no_leftovers(&d, id).await, Vec::<String>::new());
        assert!(leftovers(&d, id).is_empty());
    }
    // An empty pool is a miss, and the create still succeeds cold.
    let sb = c
        .create_sandbox(&CreateSandboxRequest {
            limits: small(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(sb.pool, None);
    assert_eq!(c.get_pool("one").await.unwrap().misses, 1);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_user_applies_to_claimed_and_cold_sandboxes() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_pool(&pool("users", 1)).await.unwrap();
    wait_ready(&c, "users", 1).await;
    let as_root = |limits| CreateSandboxRequest {
        limits,
        user: Some("root".into()),
        ..Default::default()
    };
    let claimed = c.create_sandbox(&as_root(small())).await.unwrap();
    assert_eq!(claimed.pool.as_deref(), Some("users"));
    let cold_limits = LimitsSpec {
        max_processes: Some(99),
        ..small()
    };
    let cold = c.create_sandbox(&as_root(cold_limits)).await.unwrap();
    assert_eq!(cold.pool, None);
    for id in [&claimed.id, &cold.id] {
        let out = sh(&c, id, "id -un; echo $HOME; touch /root/mine && echo wrote").await;
        assert_eq!(out.stdout, "root\n/root\nwrote\n", "{id}: {out:?}");
        // Naming a user still wins over the default.
        let named = c
            .run(
                id,
                &RunCommandRequest {
                    argv: vec!["id".into(), "-un".into()],
                    user: Some("user".into()),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(named.stdout, "user\n");
    }
    let bad = CreateSandboxRequest {
        user: Some("mallory".into()),
        ..Default::default()
    };
    assert_eq!(
        c.create_sandbox(&bad).await.unwrap_err().status(),
        Some(400)
    );
    assert_eq!(sandboxes(&c).await.len(), 2);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_right_after_deleting_a_filling_pool_leaves_nothing() {
    for round in 0..3 {
        let d = Daemon::start().await;
        let c = d.client();
        c.create_pool(&pool("brief", 2)).await.unwrap();
        // Refills are under way (or about to be) when the pool goes and the daemon stops.
        tokio::time::sleep(Duration::from_millis(3 * round)).await;
        let dir = d.data.path().join("sandboxes");
        d.shutdown().await;
        // A sandbox left running keeps its directory, so the sandboxes tmpfs would stay.
        let still_mounted = tmpfs_mounted_on(&dir);
        assert!(
            !still_mounted,
            "round {round}: a refill outlived the daemon"
        );
    }
}

/// The host's memory as the daemon sees it (`MemTotal`), in bytes.
fn host_memory() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_sizes_are_capped_by_the_configured_maximum_and_the_hosts_memory() {
    let d = Daemon::builder()
        .config("[pool_limits]\nmax_size = 4\n")
        .start()
        .await;
    let c = d.client();
    // Over the configured maximum: 400, naming the setting.
    for size in [5, 194] {
        let err = c.create_pool(&pool("big", size)).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{err}");
        assert!(err.to_string().contains("max_size"), "{err}");
    }
    // Sandboxes whose memory limits together exceed the host's memory: 409.
    let mib = |b: u64| b >> 20 << 20;
    let most = mib(host_memory() / 5 * 3);
    assert!(
        most <= 64 << 30,
        "this test needs a host with at most 100 GiB"
    );
    let heavy = |name: &str, memory: u64, size: u32| PoolSpec {
        limits: LimitsSpec {
            memory_bytes: Some(memory),
            max_processes: Some(128),
            ..Default::default()
        },
        ..pool(name, size)
    };
    let err = c.create_pool(&heavy("heavy", most, 2)).await.unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("no capacity"), "{err}");
    assert_eq!(
        c.list_pools().await.unwrap().len(),
        0,
        "nothing was created"
    );
    // One fits; a second pool that would not fit beside it is refused, and so is
    // growing the first beyond the host or beyond the maximum.
    c.create_pool(&heavy("heavy", most, 1)).await.unwrap();
    let err = c
        .create_pool(&heavy("beside", most + (1 << 20), 1))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(
        err.to_string().contains("other pools already hold"),
        "{err}"
    );
    let err = c.resize_pool("heavy", 2).await.unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("no capacity"), "{err}");
    assert_eq!(error_status(c.resize_pool("heavy", 5).await), Some(400));
    assert_eq!(c.get_pool("heavy").await.unwrap().size, 1);
    // Shrinking is always allowed; pools within both bounds are accepted.
    assert_eq!(c.resize_pool("heavy", 0).await.unwrap().size, 0);
    assert_eq!(c.create_pool(&pool("light", 4)).await.unwrap().size, 4);
    assert_eq!(c.resize_pool("light", 2).await.unwrap().size, 2);
    c.delete_pool("heavy").await.unwrap();
    c.delete_pool("light").await.unwrap();
    d.shutdown().await;

    // A pool in the config file over the maximum stops the start, with an error that
    // names the pool, and the failed start leaves nothing mounted.
    let (status, stderr, data) = Daemon::builder()
        .config(
            "[pool_limits]\nmax_size = 2\n\n[[pools]]\nname = \"toobig\"\nsize = 3\n\
             limits = { memory_bytes = 134217728, max_processes = 128 }\n",
        )
        .start_failing();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("pool toobig in the config file") && stderr.contains("max_size"),
        "{stderr}"
    );
    assert!(
        !tmpfs_mounted_on(&data.path().join("sandboxes")),
        "{stderr}"
    );
    // And one beyond the host's memory, likewise.
    let (status, stderr, data) = Daemon::builder()
        .config(&format!(
            "[[pools]]\nname = \"toomuch\"\nsize = 2\n\
             limits = {{ memory_bytes = {most}, max_processes = 128 }}\n"
        ))
        .start_failing();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("pool toomuch in the config file") && stderr.contains("no capacity"),
        "{stderr}"
    );
    assert!(
        !tmpfs_mounted_on(&data.path().join("sandboxes")),
        "{stderr}"
    );
}
