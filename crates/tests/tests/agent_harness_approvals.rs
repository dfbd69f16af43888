//! Approval gates, part (c): the harness's own permission requests (issue 13, part 6).
//! A runtime whose policy holds `harness_permissions` launches its harness asking
//! (opencode's `ask` rules through the bridge, Claude Code's `--permission-prompt-tool
//! stdio`); the scripted model asks for a bash call, the harness waits, and a person's
//! decision through `/v1/approvals` lets it run or refuses it inside the sandbox. pi asks
//! through the extension its launch loads. Codex `exec` cannot ask: the policy is refused.

use sandpit_tests::agents::{
    ModelSim, all_events, api, daemon, req, sandbox, start_run, wait_final,
};
use sandpit_tests::netfix::Upstream;
use sandpit_tests::{Daemon, sh};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The file the gated command makes.
const MARK: &str = "/home/user/approved-mark.txt";

/// One bash call that writes [`MARK`], then a final answer (turn 1 also answers a
/// refusal: the model gets it as the tool's result and goes on).
fn script() -> Value {
    let command = format!("echo ran > {MARK}");
    json!({"turns": [
        {"tool_calls": [{"any_of": [
            {"name": "Bash", "arguments": {"command": command}},
            {"name": "bash", "arguments": {"command": command}}]}]},
        {"text": "finished"}
    ]})
}

/// Waits for the one pending approval of `run` (a minute at most).
async fn pending(d: &Daemon, run: &str) -> Value {
    let start = Instant::now();
    loop {
        let (status, list) = api(
            d,
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
        let (_, r) = api(d, reqwest::Method::GET, &format!("/v1/runs/{run}"), None).await;
        assert!(
            start.elapsed() < Duration::from_secs(90) && !r["ended_at_ms"].is_i64(),
            "the harness never asked: {r}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn marked(d: &Daemon, sb: &str) -> bool {
    sh(
        &d.client(),
        sb,
        &format!("test -e {MARK} && echo yes || echo no"),
    )
    .await
    .stdout
    .trim()
        == "yes"
}

/// `told` is what the model must see of a refusal: the approver's reason, or for pi
/// (whose extension's confirm dialog answers only yes or no) the extension's fixed text.
async fn a_harness_permission_waits_for_a_person(
    harness: &str,
    tool: &str,
    base_path: &str,
    told: &str,
) {
    let up = Upstream::start(&[]);
    let ip = up.ip(10);
    let m = ModelSim::start(&up, &ip, 8081, script());
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[8081]).await;
    let base_url = format!("http://{ip}:8081{base_path}");
    let (status, rt) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/agents"),
        Some(
            json!({"harness": harness, "model": {"base_url": base_url, "model": "modelsim"},
                    "approval_policy": {"harness_permissions": true, "timeout_secs": 120}}),
        ),
    )
    .await;
    assert_eq!(status, 201, "{harness}: {rt}");
    assert_eq!(rt["approval_policy"]["harness_permissions"], true);
    let rt = rt["id"].as_str().unwrap().to_string();
    let db = d.store().await;
    let key_id = db.authenticate(&d.key).await.unwrap().unwrap().id;
    db.close().await;
    let stranger = d.owner_key("mallory").await;

    // 1. Asked, held, approved: the command ran.
    let run = start_run(&d, &rt, json!({"task": "make the mark"})).await;
    let a = pending(&d, &run).await;
    let id = a["id"].as_str().unwrap().to_string();
    assert_eq!(a["capability"], "harness_permission", "{a}");
    assert_eq!(a["name"], tool, "{a}");
    assert!(a["summary"].as_str().unwrap().contains("echo ran >"), "{a}");
    assert!(a["expires_at_ms"].as_i64().unwrap() > a["created_at_ms"].as_i64().unwrap());
    let (_, r) = api(&d, reqwest::Method::GET, &format!("/v1/runs/{run}"), None).await;
    assert_eq!(r["state"], "waiting_approval", "{r}");
    assert!(!marked(&d, &sb).await, "nothing runs before a decision");
    for verb in ["approve", "deny"] {
        let (status, body) = req(
            &d,
            &stranger,
            reqwest::Method::POST,
            &format!("/v1/approvals/{id}/{verb}"),
            Some(json!({})),
        )
        .await;
        assert_eq!(status, 404, "{verb}: {body}");
    }
    let (status, body) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/approvals/{id}/approve"),
        Some(json!({})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "approved");
    assert_eq!(
        body["decided_by"],
        key_id.as_str(),
        "the deciding key, not the owner"
    );
    let r = wait_final(&d, &run, Duration::from_secs(90)).await;
    assert_eq!(r["state"], "succeeded", "{harness}: {r}");
    assert!(
        marked(&d, &sb).await,
        "{harness}: the approved command did not run"
    );
    let kinds: Vec<String> = all_events(&d, &run, 0)
        .await
        .iter()
        .filter_map(|e| e["kind"].as_str().map(str::to_string))
        .collect();
    for k in ["approval_requested", "approval_decided"] {
        assert_eq!(
            kinds.iter().filter(|x| *x == k).count(),
            1,
            "{k}: {kinds:?}"
        );
    }
    let (status, _) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/approvals/{id}/deny"),
        Some(json!({})),
    )
    .await;
    assert_eq!(status, 409, "decided once");

    // 2. Denied: the command does not run, the model is told and answers, the run ends.
    sh(&d.client(), &sb, &format!("rm -f {MARK}")).await;
    let asked_before = m.requests().len();
    let run = start_run(&d, &rt, json!({"task": "make the mark again"})).await;
    let a = pending(&d, &run).await;
    let id = a["id"].as_str().unwrap().to_string();
    let (status, body) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/approvals/{id}/deny"),
        Some(json!({"reason": "no marks today"})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let r = wait_final(&d, &run, Duration::from_secs(90)).await;
    assert_eq!(r["state"], "succeeded", "{harness}: {r}");
    assert!(!marked(&d, &sb).await, "{harness}: the denied command ran");
    let told = m.requests()[asked_before..]
        .iter()
        .any(|r| r["body"].to_string().contains(told));
    assert!(
        told,
        "{harness}: the model never saw the refusal: {:#?}",
        m.requests()
    );
    let (_, denied) = api(
        &d,
        reqwest::Method::GET,
        &format!("/v1/approvals/{id}"),
        None,
    )
    .await;
    assert_eq!(denied["state"], "denied", "{denied}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_asks_and_a_person_approves_or_denies() {
    a_harness_permission_waits_for_a_person("opencode", "bash", "/v1", "no marks today").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_asks_and_a_person_approves_or_denies() {
    a_harness_permission_waits_for_a_person("claude", "Bash", "", "no marks today").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_that_cannot_ask_is_refused_the_policy() {
    let up = Upstream::start(&[]);
    let ip = up.ip(10);
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[8081]).await;
    let (status, body) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/agents"),
        Some(json!({"harness": "codex",
                    "model": {"base_url": format!("http://{ip}:8081/v1"), "model": "modelsim"},
                    "approval_policy": {"harness_permissions": true}})),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.to_string().contains("cannot put its tool use"),
        "{body}"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pi_asks_through_its_extension_and_a_person_approves_or_denies() {
    a_harness_permission_waits_for_a_person("pi", "bash", "/v1", "refused by a sandpit approval")
        .await;
}
