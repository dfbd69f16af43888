//! What `agent_runs.rs` checks of pi's run lifecycle, for every harness (issue 13): one
//! idempotency key gives one run, a second start while a run is active is a `409`, a
//! daemon killed mid-stream loses no stored event, and a run against a model server that
//! serves HTTPS with a certificate of a test CA succeeds. The model server
//! (`sandpit-modelsim`) listens in a test upstream namespace; nothing leaves the machine.
//!
//! HTTPS goes the way a real model endpoint would: the model key is a broker secret for
//! the model's host, so the broker terminates the harness's TLS with the sandbox's own CA
//! (which the sandbox trusts through `SSL_CERT_FILE`, `NODE_EXTRA_CA_CERTS`, ...) and
//! opens TLS to the model server, verifying its certificate against the test CA
//! (`[broker] extra_ca_file`).

use sandpit_tests::agents::{
    CLAUDE, CODEX, Harness, ModelSim, OPENCODE, PI, all_events, api, broker_daemon_trusting,
    broker_key_file, daemon, is_model_call, key_of, model_secret, restart_keeps_stored_events,
    runtime_of, sandbox, sandbox_with_secret, seqs, shell_turn, start_once_then_conflict,
    start_run, wait_final, wait_mid_stream,
};
use sandpit_tests::netfix::Upstream;
use serde_json::{Value, json};
use std::time::Duration;

const REAL: &str = "sk-real-model-key-0a1b2c3d4e5f6789";

async fn one_run_per_key_and_a_restart_loses_no_event(h: Harness, ip_n: u8, port: u16) {
    let up = Upstream::start(&[]);
    let ip = up.ip(ip_n);
    // A tool call (so events are stored), then an answer held past the restart.
    let m = ModelSim::start(
        &up,
        &ip,
        port,
        json!({"turns": [
            shell_turn("echo one > one.txt"),
            {"text": "too late", "delay_ms": 60000}
        ]}),
    );
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[port]).await;
    let rt = runtime_of(
        &d,
        &sb,
        h.name,
        json!({"base_url": format!("http://{ip}:{port}{}", h.base_path), "model": "modelsim"}),
    )
    .await;
    let id = start_once_then_conflict(&d, &rt, "lifecycle").await;
    let before = wait_mid_stream(&d, &id, &m, 1).await;
    let kinds: Vec<&str> = before.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert!(kinds.contains(&"tool_call"), "{}: {kinds:?}", h.name);
    let d = restart_keeps_stored_events(d, &sb, &id, &before).await;
    // The key still names that run after the restart; a new key may start a run now.
    let path = format!("/v1/agents/{rt}/runs");
    let (status, again) = api(
        &d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": "run a command, then think", "idempotency_key": "lifecycle"})),
    )
    .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["id"], id.as_str(), "{again}");
    assert_eq!(again["state"], "failed", "{again}");
    d.shutdown().await;
}

async fn a_run_against_an_https_model_succeeds(h: Harness, ip_n: u8, port: u16) {
    let host = "model.upstream.test";
    let up = Upstream::start(&[(host, &format!("@{ip_n}"))]);
    let m = ModelSim::start_tls(
        &up,
        &up.ip(ip_n),
        port,
        json!({"turns": [shell_turn("echo tls > tls.txt"), {"text": "done"}]}),
        REAL,
        &[host],
    );
    let keys = broker_key_file();
    let d = broker_daemon_trusting(&up, &keys, &m.ca_file()).await;
    model_secret(&d, "modelkey", REAL, host).await;
    let sb = sandbox_with_secret(&d, "modelkey", host, port).await;
    let rt = runtime_of(
        &d,
        &sb,
        h.name,
        json!({"base_url": format!("https://{host}:{port}{}", h.base_path),
               "model": "modelsim", "api_key_secret": "modelkey"}),
    )
    .await;
    let id = start_run(&d, &rt, json!({"task": "write tls.txt"})).await;
    let done = wait_final(&d, &id, Duration::from_secs(150)).await;
    let events = all_events(&d, &id, 0).await;
    assert_eq!(
        done["state"],
        "succeeded",
        "{}: {done}\n{events:#?}\n{:#?}",
        h.name,
        m.requests()
    );
    let n = events.len() as i64;
    assert_eq!(seqs(&events), (1..=n).collect::<Vec<_>>());
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "message" && e["payload"]["text"] == "done"),
        "{events:#?}"
    );
    let out = sandpit_tests::sh(&d.client(), &sb, "cat /home/user/tls.txt").await;
    assert_eq!(out.stdout, "tls\n", "{out:?}");
    // The server speaks only TLS (its listening line said so), so each recorded request
    // came over TLS; the broker's connection carried the real key in.
    let calls: Vec<Value> = m.requests().into_iter().filter(is_model_call).collect();
    assert!(calls.len() >= 2, "{calls:#?}");
    for r in &calls {
        assert_eq!(r["status"], 200, "{r}");
        assert_eq!(key_of(r), Some(REAL), "{r}");
    }
    assert!(calls.iter().any(|r| r["turn"] == 1), "{calls:#?}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pi_one_run_per_key_and_a_restart_loses_no_event() {
    one_run_per_key_and_a_restart_loses_no_event(PI, 4, 8189).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_one_run_per_key_and_a_restart_loses_no_event() {
    one_run_per_key_and_a_restart_loses_no_event(CLAUDE, 5, 8190).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_one_run_per_key_and_a_restart_loses_no_event() {
    one_run_per_key_and_a_restart_loses_no_event(CODEX, 6, 8191).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_one_run_per_key_and_a_restart_loses_no_event() {
    one_run_per_key_and_a_restart_loses_no_event(OPENCODE, 7, 8192).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pi_against_an_https_model_succeeds() {
    a_run_against_an_https_model_succeeds(PI, 8, 8443).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_against_an_https_model_succeeds() {
    a_run_against_an_https_model_succeeds(CLAUDE, 9, 8443).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_against_an_https_model_succeeds() {
    a_run_against_an_https_model_succeeds(CODEX, 10, 8443).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_against_an_https_model_succeeds() {
    a_run_against_an_https_model_succeeds(OPENCODE, 11, 8443).await;
}
