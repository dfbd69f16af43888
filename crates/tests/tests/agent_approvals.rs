//! Approval gates of agent runs (issue 13, parts 6 and 7), end to end: a run's sandbox
//! connects to a host outside its egress allow-list and the daemon holds the connection
//! until a person decides through the approvals API. The upstream hosts live in the test's
//! own network namespace; nothing leaves the machine.

use sandpit_tests::agents::{
    ModelSim, all_events, api, daemon_with, req, sandbox, start_run, wait_tool_running,
};
use sandpit_tests::netfix::Upstream;
use sandpit_tests::{Daemon, sh};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Seconds an approval of the test runtime waits.
const TIMEOUT_SECS: u64 = 8;

/// Fetches `http://{name}/{path}` from the sandbox, `name` pinned to `ip` (the sandbox's
/// resolver answers no name outside its allow-list): the body and `HTTP <code>`.
fn fetch(
    d: &Daemon,
    sb: &str,
    name: &str,
    ip: &str,
    path: &str,
) -> tokio::task::JoinHandle<String> {
    let c = d.client();
    let sb = sb.to_string();
    let script = format!(
        "curl -s --max-time 60 --resolve {name}:80:{ip} -w '\\nHTTP %{{http_code}}' http://{name}/{path}"
    );
    tokio::spawn(async move { sh(&c, &sb, &script).await.stdout })
}

/// Waits for the one pending approval of `run` (a minute at most).
async fn pending(d: &Daemon, key: &str, run: &str) -> Value {
    let start = Instant::now();
    loop {
        let (status, list) = req(
            d,
            key,
            reqwest::Method::GET,
            &format!("/v1/approvals?state=pending&run={run}"),
            None,
        )
        .await;
        assert_eq!(status, 200, "{list}");
        let list = list.as_array().unwrap();
        assert!(list.len() < 2, "{list:#?}");
        if let Some(one) = list.first() {
            return one.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "nothing was held"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn run_state(d: &Daemon, run: &str) -> String {
    let (status, r) = api(d, reqwest::Method::GET, &format!("/v1/runs/{run}"), None).await;
    assert_eq!(status, 200, "{r}");
    r["state"].as_str().unwrap().to_string()
}

async fn decide(d: &Daemon, key: &str, id: &str, verb: &str, body: Value) -> (u16, Value) {
    req(
        d,
        key,
        reqwest::Method::POST,
        &format!("/v1/approvals/{id}/{verb}"),
        Some(body),
    )
    .await
}

/// Requests the upstream answered for `path`.
fn served(up: &Upstream, path: &str) -> usize {
    up.requests()
        .iter()
        .filter(|r| r["path"].as_str() == Some(path))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_outside_the_allow_list_waits_for_a_person() {
    let up = Upstream::start(&[
        ("other.test", "@3"),
        ("third.test", "@4"),
        ("fourth.test", "@5"),
        ("fifth.test", "@6"),
    ]);
    let ip = up.ip(10);
    // The harness's tool sleeps: the run stays running while the sandbox fetches.
    let m = ModelSim::start(
        &up,
        &ip,
        8081,
        json!({"turns": [
            {"tool_calls": [{"name": "bash", "arguments": {"command": "sleep 300"}}]},
            {"text": "never asked"}
        ]}),
    );
    let d = daemon_with(&up, "[approvals]\nrequire_approver_role = true\n").await;
    let sb = sandbox(&d, &ip, &[8081]).await;

    // A bad policy is refused.
    let agents = format!("/v1/sandboxes/{sb}/agents");
    for bad in [
        json!({"egress": "yes"}),
        json!({"timeout_secs": 0}),
        json!({"credentials": [{"name": "gh", "methods": ["NOT A METHOD"]}]}),
        json!({"unknown": true}),
    ] {
        let (status, body) = api(
            &d,
            reqwest::Method::POST,
            &agents,
            Some(
                json!({"harness": "pi", "model": {"base_url": m.url, "model": "modelsim"},
                        "approval_policy": bad}),
            ),
        )
        .await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, rt) = api(
        &d,
        reqwest::Method::POST,
        &agents,
        Some(
            json!({"harness": "pi", "model": {"base_url": m.url, "model": "modelsim"},
                    "approval_policy": {"egress": true, "timeout_secs": TIMEOUT_SECS}}),
        ),
    )
    .await;
    assert_eq!(status, 201, "{rt}");
    assert_eq!(rt["approval_policy"]["egress"], true, "{rt}");
    let rt = rt["id"].as_str().unwrap().to_string();
    let run = start_run(&d, &rt, json!({"task": "sleep"})).await;
    wait_tool_running(&d, &sb, "sleep 300", &m).await;
    assert_eq!(run_state(&d, &run).await, "running");

    // Keys: the daemon's (the owner's, no role), an approver of the same owner, another owner.
    let db = d.store().await;
    let owner = db.authenticate(&d.key).await.unwrap().unwrap().owner;
    let (approver_rec, approver) = db.create_api_key(&owner, "approver").await.unwrap();
    assert!(
        db.add_api_key_role(&approver_rec.id, "approver")
            .await
            .unwrap()
    );
    assert_eq!(
        db.api_key_roles(&approver_rec.id).await.unwrap(),
        ["approver"]
    );
    db.close().await;
    let stranger = d.owner_key("mallory").await;

    // 1. Held, then approved for the run.
    let first = fetch(&d, &sb, "other.test", &up.ip(3), "one");
    let a = pending(&d, &d.key, &run).await;
    let id = a["id"].as_str().unwrap().to_string();
    assert_eq!(a["capability"], "egress", "{a}");
    assert_eq!(a["host"], "other.test:80", "{a}");
    assert_eq!(a["path"], "/one", "{a}");
    let summary = a["summary"].as_str().unwrap();
    assert!(
        summary.contains("whole connection") && summary.contains("first request: GET /one"),
        "the approver is told what approving covers: {a}"
    );
    assert_eq!(a["run_id"], run.as_str(), "{a}");
    assert!(a["expires_at_ms"].as_i64().unwrap() > a["created_at_ms"].as_i64().unwrap());
    assert_eq!(run_state(&d, &run).await, "waiting_approval");
    assert_eq!(served(&up, "/one"), 0, "nothing goes out before a decision");
    assert!(!first.is_finished());
    // Another owner sees nothing and decides nothing.
    for (method, path) in [
        (reqwest::Method::GET, format!("/v1/approvals/{id}")),
        (reqwest::Method::POST, format!("/v1/approvals/{id}/approve")),
        (reqwest::Method::POST, format!("/v1/approvals/{id}/deny")),
    ] {
        let (status, body) = req(&d, &stranger, method, &path, Some(json!({}))).await;
        assert_eq!(status, 404, "{path}: {body}");
    }
    let (status, list) = req(&d, &stranger, reqwest::Method::GET, "/v1/approvals", None).await;
    assert_eq!((status, list), (200, json!([])));
    // The owner's key without the approver role may read but not decide.
    let (status, body) = decide(&d, &d.key, &id, "approve", json!({"scope": "run"})).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = decide(&d, &approver, &id, "approve", json!({"scope": "forever"})).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = decide(&d, &approver, &id, "approve", json!({"scope": "run"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (body["state"].as_str(), body["scope"].as_str()),
        (Some("approved"), Some("run"))
    );
    assert_eq!(
        body["decided_by"],
        approver_rec.id.as_str(),
        "the deciding key is recorded, not the owner: {body}"
    );
    let out = first.await.unwrap();
    assert!(out.ends_with("HTTP 200"), "{out}");
    assert_eq!(served(&up, "/one"), 1);
    assert_eq!(run_state(&d, &run).await, "running");
    // Deciding twice is a conflict.
    let (status, body) = decide(&d, &approver, &id, "deny", json!({})).await;
    assert_eq!(status, 409, "{body}");

    // 2. The same host again: through without a new approval.
    let out = fetch(&d, &sb, "other.test", &up.ip(3), "two")
        .await
        .unwrap();
    assert!(out.ends_with("HTTP 200"), "{out}");
    let (_, all) = api(
        &d,
        reqwest::Method::GET,
        &format!("/v1/approvals?run={run}"),
        None,
    )
    .await;
    assert_eq!(all.as_array().unwrap().len(), 1, "{all}");

    // 3. Another host, denied with a reason: 403 inside the sandbox naming both.
    let third = fetch(&d, &sb, "third.test", &up.ip(4), "three");
    let a = pending(&d, &d.key, &run).await;
    let denied = a["id"].as_str().unwrap().to_string();
    assert_eq!(a["host"], "third.test:80", "{a}");
    let (status, body) = decide(
        &d,
        &approver,
        &denied,
        "deny",
        json!({"reason": "not that host"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "denied");
    assert_eq!(body["reason"], "not that host");
    let out = third.await.unwrap();
    assert!(out.ends_with("HTTP 403"), "{out}");
    assert!(
        out.contains(&denied) && out.contains("not that host"),
        "{out}"
    );
    assert_eq!(served(&up, "/three"), 0);
    let (status, _) = decide(&d, &approver, &denied, "approve", json!({})).await;
    assert_eq!(status, 409);

    // 3b. The held client gives up: the approval ends abandoned, and approving it is a
    // conflict; nothing is sent.
    let c = d.client();
    let script = format!(
        "curl -s --max-time 3 --resolve fifth.test:80:{} http://fifth.test/gone; echo rc=$?",
        up.ip(6)
    );
    let quitter = sh(&c, &sb, &script);
    let (out, a) = tokio::join!(quitter, pending(&d, &d.key, &run));
    assert!(
        out.stdout.contains("rc=28"),
        "curl timed out: {}",
        out.stdout
    );
    let gone = a["id"].as_str().unwrap().to_string();
    let start = Instant::now();
    let abandoned = loop {
        let (_, one) = api(
            &d,
            reqwest::Method::GET,
            &format!("/v1/approvals/{gone}"),
            None,
        )
        .await;
        if one["state"] != "pending" {
            break one;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "still pending: {one}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(abandoned["state"], "abandoned", "{abandoned}");
    assert!(
        abandoned["reason"].as_str().unwrap().contains("closed"),
        "{abandoned}"
    );
    let (status, body) = decide(&d, &approver, &gone, "approve", json!({})).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(served(&up, "/gone"), 0);
    assert_eq!(run_state(&d, &run).await, "running");

    // 4. Nobody decides: expired, refused.
    let started = Instant::now();
    let out = fetch(&d, &sb, "fourth.test", &up.ip(5), "four")
        .await
        .unwrap();
    assert!(out.ends_with("HTTP 403"), "{out}");
    assert!(out.contains("expired"), "{out}");
    assert!(started.elapsed() >= Duration::from_secs(TIMEOUT_SECS - 1));
    assert_eq!(served(&up, "/four"), 0);
    let (_, expired) = api(
        &d,
        reqwest::Method::GET,
        &format!("/v1/approvals?state=expired&run={run}"),
        None,
    )
    .await;
    let expired = expired.as_array().unwrap();
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_eq!(expired[0]["host"], "fourth.test:80");
    let (status, body) = decide(
        &d,
        &approver,
        expired[0]["id"].as_str().unwrap(),
        "approve",
        json!({}),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    // The CLI: a key made with `--role approver` lists and decides; deciding again fails.
    let (ok, out, err) = d.cli(&[
        "keys", "create", "--owner", &owner, "--role", "approver", "--json",
    ]);
    assert!(ok, "{err}");
    let made: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(made["roles"], json!(["approver"]), "{made}");
    let db = d.store().await;
    assert!(
        db.key_has_role(made["id"].as_str().unwrap(), "approver")
            .await
            .unwrap()
    );
    db.close().await;
    let cli_key = made["key"].as_str().unwrap().to_string();
    let (ok, out, err) = d.cli(&[
        "--api-key",
        &cli_key,
        "--json",
        "approvals",
        "ls",
        "--state",
        "all",
        "--run",
        &run,
    ]);
    assert!(ok, "{err}");
    let listed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 4, "{listed}");
    let (ok, _, err) = d.cli(&[
        "--api-key",
        &cli_key,
        "approvals",
        "approve",
        &denied,
        "--for-run",
    ]);
    assert!(!ok && err.contains("already denied"), "{err}");
    let (ok, _, _) = d.cli(&["keys", "create", "--owner", &owner, "--role", "root"]);
    assert!(!ok, "an unknown role is refused");
    let (status, body) = api(&d, reqwest::Method::GET, "/v1/approvals?state=bogus", None).await;
    assert_eq!(status, 400, "{body}");

    // Every request and decision is a run event; the run goes on.
    let events = all_events(&d, &run, 0).await;
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "approval_requested").count(),
        4,
        "{kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "approval_decided").count(),
        4,
        "{kinds:?}"
    );
    assert_eq!(run_state(&d, &run).await, "running");
    let (status, _) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/runs/{run}/cancel"),
        None,
    )
    .await;
    assert_eq!(status, 200);

    // Without an active run the allow-list refuses as always, and nothing is asked.
    let out = fetch(&d, &sb, "other.test", &up.ip(3), "five")
        .await
        .unwrap();
    assert!(out.ends_with("HTTP 403"), "{out}");
    let (_, all) = api(
        &d,
        reqwest::Method::GET,
        &format!("/v1/approvals?run={run}"),
        None,
    )
    .await;
    assert_eq!(all.as_array().unwrap().len(), 4, "{all}");
    d.shutdown().await;
}

/// A value the sandbox must never see; the upstream gets it only through the broker.
const VALUE: &str = "ghp_ApprovalGate_Secret_7d21e0";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_credential_waits_for_a_person_per_method() {
    use sandpit_api::secrets::{CreateSecretRequest, InjectSpec};
    let up = Upstream::start(&[("api.upstream.test", "@2")]);
    let ip = up.ip(10);
    let m = ModelSim::start(
        &up,
        &ip,
        8081,
        json!({"turns": [
            {"tool_calls": [{"name": "bash", "arguments": {"command": "sleep 300"}}]},
            {"text": "never asked"}
        ]}),
    );
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("broker.key");
    std::fs::write(&key, [7u8; 32]).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let d = daemon_with(
        &up,
        &format!(
            "[broker]\nkey_file = {:?}\nextra_ca_file = {:?}\n",
            key.display().to_string(),
            up.ca_file().display().to_string()
        ),
    )
    .await;
    let c = d.client();
    c.create_secret(
        &CreateSecretRequest {
            name: "gh".into(),
            value: VALUE.into(),
            hosts: vec!["api.upstream.test".into()],
            methods: vec!["GET".into(), "POST".into()],
            path_prefixes: vec![],
            ttl_secs: Some(3600),
            inject: InjectSpec::Header {
                name: "Authorization".into(),
                format: "Bearer {value}".into(),
            },
            allow_http: false,
            expires_at_ms: None,
        },
        None,
    )
    .await
    .unwrap();
    let (status, sb) = api(
        &d,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(json!({
            "timeout": 600,
            "limits": {"memory_bytes": 1u64 << 30},
            "secrets": ["gh"],
            "network": {"mode": "allowlist", "rules": [
                {"action": "allow", "cidr": format!("{ip}/32"), "ports": [8081]},
                {"action": "allow", "domain": "api.upstream.test", "ports": [443]}]},
        })),
    )
    .await;
    assert_eq!(status, 201, "{sb}");
    let sb = sb["id"].as_str().unwrap().to_string();
    let (status, rt) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/agents"),
        Some(
            json!({"harness": "pi", "model": {"base_url": m.url, "model": "modelsim"},
                    "approval_policy": {"credentials": [{"name": "gh", "methods": ["post"]}]}}),
        ),
    )
    .await;
    assert_eq!(status, 201, "{rt}");
    let rt = rt["id"].as_str().unwrap().to_string();
    let run = start_run(&d, &rt, json!({"task": "sleep"})).await;
    wait_tool_running(&d, &sb, "sleep 300", &m).await;
    let curl = |method: &str, path: &str| {
        let c = d.client();
        let sb = sb.clone();
        let script = format!(
            "curl -sS --max-time 60 -X {method} -w '\\nHTTP %{{http_code}}' https://api.upstream.test{path}"
        );
        tokio::spawn(async move {
            let out = sh(&c, &sb, &script).await;
            assert!(!out.stdout.contains(VALUE) && !out.stderr.contains(VALUE));
            out.stdout
        })
    };
    let with_credential = |path: &str| {
        up.requests()
            .iter()
            .filter(|r| {
                r["path"].as_str() == Some(path)
                    && r["authorization"].as_str() == Some(&format!("Bearer {VALUE}"))
            })
            .count()
    };

    // GET is not gated: through at once, with the credential.
    let out = curl("GET", "/get").await.unwrap();
    assert!(out.ends_with("HTTP 200"), "{out}");
    assert_eq!(with_credential("/get"), 1);
    let (_, all) = api(&d, reqwest::Method::GET, "/v1/approvals", None).await;
    assert_eq!(all, json!([]));

    // POST waits; denied: the broker's 403 names the approval, the upstream sees nothing.
    let held = curl("POST", "/post");
    let a = pending(&d, &d.key, &run).await;
    let id = a["id"].as_str().unwrap().to_string();
    assert_eq!(a["capability"], "credential", "{a}");
    assert_eq!(a["name"], "gh", "{a}");
    assert_eq!(a["method"], "POST", "{a}");
    assert_eq!(a["host"], "api.upstream.test:443", "{a}");
    assert_eq!(a["path"], "/post", "{a}");
    assert_eq!(run_state(&d, &run).await, "waiting_approval");
    assert_eq!(served(&up, "/post"), 0);
    let (status, body) = decide(&d, &d.key, &id, "deny", json!({"reason": "no writes"})).await;
    assert_eq!(status, 200, "{body}");
    let out = held.await.unwrap();
    assert!(out.ends_with("HTTP 403"), "{out}");
    assert!(
        out.contains("\"approval\"") && out.contains(&id) && out.contains("no writes"),
        "{out}"
    );
    assert_eq!(served(&up, "/post"), 0);

    // Asked again and approved once: the upstream gets it with the credential.
    let held = curl("POST", "/post");
    let a = pending(&d, &d.key, &run).await;
    assert_ne!(a["id"], id.as_str());
    let (status, body) = decide(&d, &d.key, a["id"].as_str().unwrap(), "approve", json!({})).await;
    assert_eq!(status, 200, "{body}");
    let out = held.await.unwrap();
    assert!(out.ends_with("HTTP 200"), "{out}");
    assert_eq!(with_credential("/post"), 1);
    assert_eq!(run_state(&d, &run).await, "running");
    let (status, _) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/runs/{run}/cancel"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    d.shutdown().await;
}
