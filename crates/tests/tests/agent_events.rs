//! What a run's stored events may hold, end to end with pi and the scripted model server:
//! the daemon's `[agents]` event limits (count per run, string length) and the masking of
//! the sandbox's secret env values.

use sandpit_tests::agents::{ModelSim, all_events, api, daemon, daemon_with, runtime, wait_final};
use sandpit_tests::netfix::Upstream;
use serde_json::{Value, json};
use std::time::Duration;

/// The raw text of a run's first events page, as a client reads it.
async fn raw_events(d: &sandpit_tests::daemon::Daemon, run: &str) -> String {
    let resp = reqwest::Client::new()
        .get(format!("{}/v1/runs/{run}/events?after=0&limit=1000", d.url))
        .bearer_auth(d.key.trim())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap()
}

/// Starts a run of `rt` with `task` and waits until it is finished; (run id, run).
async fn run_to_end(d: &sandpit_tests::daemon::Daemon, rt: &str, task: &str) -> (String, Value) {
    let (status, run) = api(
        d,
        reqwest::Method::POST,
        &format!("/v1/agents/{rt}/runs"),
        Some(json!({"task": task})),
    )
    .await;
    assert_eq!(status, 201, "{run}");
    let id = run["id"].as_str().unwrap().to_string();
    let done = wait_final(d, &id, Duration::from_secs(120)).await;
    (id, done)
}

/// With `max_events_per_run = 6` and `max_string_bytes = 100`, a run making more events
/// than that keeps its first five, then the `truncated` marker (the sixth), then `end`;
/// the long command and its output keep their first 100 bytes and say how much went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_events_are_capped_and_long_strings_cut_at_the_configured_limits() {
    let up = Upstream::start(&[]);
    let ip = up.ip(9);
    let long = "x".repeat(200);
    let m = ModelSim::start(
        &up,
        &ip,
        8095,
        json!({"turns": [
            {"tool_calls": [{"name": "bash", "arguments": {"command": format!("echo {long}")}}]},
            {"tool_calls": [{"name": "bash", "arguments": {"command": "echo two"}}]},
            {"tool_calls": [{"name": "bash", "arguments": {"command": "echo three"}}]},
            {"text": "done"}
        ]}),
    );
    let d = daemon_with(&up, "max_events_per_run = 6\nmax_string_bytes = 100\n").await;
    let sb = sandpit_tests::agents::sandbox(&d, &ip, &[8095]).await;
    let rt = runtime(&d, &sb, &m).await;
    let (id, done) = run_to_end(&d, &rt, "print a long line, then two more").await;
    let events = all_events(&d, &id, 0).await;
    assert_eq!(done["state"], "succeeded", "{done}\n{events:#?}");
    // Three tool calls and their results alone are more than the cap: it was reached.
    assert!(m.requests().len() >= 4, "{:#?}", m.requests());
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds.len(), 7, "{events:#?}");
    assert_eq!(kinds[5], "truncated", "{kinds:?}");
    assert_eq!(events[5]["payload"], json!({"max_events": 6}));
    assert_eq!(kinds[6], "end", "{kinds:?}");
    assert!(
        !kinds[..5].contains(&"truncated") && !kinds[..5].contains(&"end"),
        "{kinds:?}"
    );
    assert!(done["events_dropped"].as_i64().unwrap() > 0, "{done}");

    // The command (`echo ` and 200 x's) keeps 100 bytes, its output (200 x's, with or
    // without the newline) too, each followed by the marker of what went.
    let text = raw_events(&d, &id).await;
    let cut_command = format!("\"echo {}…[truncated 105 bytes]\"", "x".repeat(95));
    let cut_output = format!("\"{}…[truncated 10", "x".repeat(100));
    assert!(text.contains(&cut_command), "{text}");
    assert!(text.contains(&cut_output), "{text}");
    assert!(!text.contains(&"x".repeat(101)), "{text}");
    d.shutdown().await;
}

/// A value of the sandbox's env marked secret, printed by the agent's tool, is stored as
/// the mask; a plain env value printed beside it is kept (the output did reach the events).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_env_value_printed_by_a_tool_is_masked_in_the_stored_events() {
    const SECRET: &str = "correct-horse-battery-staple-4711";
    const PLAIN: &str = "plain-value-visible-0815";
    let up = Upstream::start(&[]);
    let ip = up.ip(9);
    let m = ModelSim::start(
        &up,
        &ip,
        8096,
        json!({"turns": [
            // Neither name looks like a credential, so only the secret mark masks it.
            {"tool_calls": [{"name": "bash", "arguments": {
                "command": "echo \"phrase $DEPLOY_PHRASE and $SHOWN_VALUE\"; echo $DEPLOY_PHRASE > said.txt"}}]},
            {"text": "done"}
        ]}),
    );
    let d = daemon(&up).await;
    let (status, sb) = api(
        &d,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(json!({
            "timeout": 600,
            "limits": {"memory_bytes": 1u64 << 30},
            "env": {"DEPLOY_PHRASE": SECRET, "SHOWN_VALUE": PLAIN},
            "secret_env": ["DEPLOY_PHRASE"],
            "network": {"mode": "allowlist", "rules": [
                {"action": "allow", "cidr": format!("{ip}/32"), "ports": [8096]}]},
        })),
    )
    .await;
    assert_eq!(status, 201, "{sb}");
    assert!(!sb.to_string().contains(SECRET), "{sb}");
    let sb = sb["id"].as_str().unwrap().to_string();
    let rt = runtime(&d, &sb, &m).await;
    let (id, done) = run_to_end(&d, &rt, "say the phrase").await;
    let text = raw_events(&d, &id).await;
    assert_eq!(done["state"], "succeeded", "{done}\n{text}");
    // The tool did print it: the model was sent the output, and the file holds it.
    let asked = serde_json::to_string(&m.requests()).unwrap();
    assert!(
        asked.contains(SECRET),
        "the tool's output never reached the model"
    );
    let c = d.client();
    assert_eq!(
        sandpit_tests::sh(&c, &sb, "cat /home/user/said.txt")
            .await
            .stdout,
        format!("{SECRET}\n")
    );
    assert!(!text.contains(SECRET), "the secret is in an event: {text}");
    assert!(
        text.contains(&format!("phrase [redacted] and {PLAIN}")),
        "{text}"
    );
    d.shutdown().await;
}
