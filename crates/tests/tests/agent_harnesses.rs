//! Claude Code, Codex and opencode driven end to end as agent runs (as `agent_runs.rs`
//! does for pi): `sandpit-modelsim` speaks each harness's wire API (Anthropic Messages,
//! OpenAI Responses, Chat Completions) inside a test upstream namespace, the model key is
//! a broker secret the model server requires, and the daemon drives the harness in the
//! sandbox (opencode's `serve` through the daemon's bridge script).

use sandpit_tests::agents::{
    ModelSim, all_events, api, assert_cancelled_for_good, broker_daemon, broker_key_file, daemon,
    harness_processes, is_model_call, key_of, model_secret, procs_holding, runtime_of, sandbox,
    sandbox_with_secret, seqs, start_run, wait_final,
};
use sandpit_tests::netfix::Upstream;
use sandpit_tests::sh;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const REAL: &str = "sk-real-model-key-fedcba9876543210";
const PLACEHOLDER: &str = "SANDPIT_SECRET_modelkey";

/// What differs between the harnesses under test.
struct Case {
    harness: &'static str,
    /// Appended to `http://HOST:PORT` for the model's base URL.
    base_path: &'static str,
    /// A wire API the harness cannot speak.
    foreign_api: &'static str,
}

const CLAUDE: Case = Case {
    harness: "claude",
    base_path: "",
    foreign_api: "chat_completions",
};
const CODEX: Case = Case {
    harness: "codex",
    base_path: "/v1",
    foreign_api: "anthropic_messages",
};
const OPENCODE: Case = Case {
    harness: "opencode",
    base_path: "/v1",
    foreign_api: "responses",
};

/// Writes a file, runs a command, answers (held long enough to look into the sandbox
/// while the harness waits), then answers the `continue` run.
fn script() -> Value {
    json!({"turns": [
        {"text": "Writing the file.", "tool_calls": [{"any_of": [
            {"name": "Write", "arguments": {"file_path": "hello.txt", "content": "hi\n"}},
            {"name": "write", "arguments": {"filePath": "hello.txt", "content": "hi\n"}},
            {"name": "exec_command", "arguments": {"cmd": "printf 'hi\\n' > hello.txt"}}]}]},
        {"tool_calls": [{"any_of": [
            {"name": "Bash", "arguments": {"command": "cat hello.txt && echo ran > ran.txt"}},
            {"name": "bash", "arguments": {"command": "cat hello.txt && echo ran > ran.txt"}},
            {"name": "exec_command", "arguments": {"cmd": "cat hello.txt && echo ran > ran.txt"}}]}]},
        {"text": "done", "delay_ms": 3000},
        {"text": "continued"}
    ]})
}

async fn a_run_writes_runs_continues_and_never_holds_the_key(case: Case, ip_n: u8, port: u16) {
    let h = case.harness;
    let up = Upstream::start(&[("model.upstream.test", &format!("@{ip_n}"))]);
    let m = ModelSim::start_with_key(&up, &up.ip(ip_n), port, script(), REAL);
    let keys = broker_key_file();
    let d = broker_daemon(&up, &keys).await;
    model_secret(&d, "modelkey", REAL, "model.upstream.test").await;
    let sb = sandbox_with_secret(&d, "modelkey", "model.upstream.test", port).await;
    let base_url = format!("http://model.upstream.test:{port}{}", case.base_path);

    // A wire API the harness cannot speak is refused at create.
    let (status, body) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/agents"),
        Some(
            json!({"harness": h, "model": {"base_url": base_url, "model": "modelsim",
            "api": case.foreign_api}}),
        ),
    )
    .await;
    assert_eq!(status, 400, "{h}: {body}");
    assert!(body.to_string().contains("cannot use"), "{body}");

    // No `api`: the harness's own is taken.
    let rt = runtime_of(
        &d,
        &sb,
        h,
        json!({"base_url": base_url, "model": "modelsim", "api_key_secret": "modelkey"}),
    )
    .await;
    let path = format!("/v1/agents/{rt}/runs");
    let task = "write hello.txt, then run a command";
    let (status, run) = api(
        &d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": task})),
    )
    .await;
    assert_eq!(status, 201, "{run}");
    let id = run["id"].as_str().unwrap().to_string();

    // While the model holds its last answer the harness is alive: only the placeholder
    // is in its environment, the real key in no process's environment or arguments.
    let start = Instant::now();
    while !m.requests().iter().any(|r| r["turn"] == 2) {
        let (_, now) = api(&d, reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await;
        assert!(
            start.elapsed() < Duration::from_secs(120)
                && ["queued", "running"].contains(&now["state"].as_str().unwrap_or_default()),
            "turn 2 never asked: {now}\n{:#?}\n{:#?}",
            m.requests(),
            all_events(&d, &id, 0).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let holding = procs_holding(&d, &sb, PLACEHOLDER).await;
    assert!(
        holding
            .iter()
            .any(|l| l.contains("/environ") && l.contains(h)),
        "the scan finds no placeholder: {holding:#?}\n{:?}",
        sh(
            &d.client(),
            &sb,
            "ps -eo pid,user,args; for p in /proc/[0-9]*; do echo $p; tr '\\0' '\\n' < $p/environ | grep -i -e key -e SANDPIT; done"
        )
        .await
    );
    let leaks = procs_holding(&d, &sb, REAL).await;
    assert!(leaks.is_empty(), "the real key in the sandbox: {leaks:#?}");

    let done = wait_final(&d, &id, Duration::from_secs(120)).await;
    let events = all_events(&d, &id, 0).await;
    assert_eq!(
        done["state"],
        "succeeded",
        "{done}\n{events:#?}\n{:#?}",
        m.requests()
    );
    let c = d.client();
    assert_eq!(sh(&c, &sb, "cat /home/user/hello.txt").await.stdout, "hi\n");
    assert_eq!(sh(&c, &sb, "cat /home/user/ran.txt").await.stdout, "ran\n");

    // Ordered 1..N, no gap, `end` last; messages, tool calls and their results.
    let n = events.len() as i64;
    assert_eq!(seqs(&events), (1..=n).collect::<Vec<_>>());
    assert_eq!(done["events"].as_i64(), Some(n));
    assert_eq!(events.last().unwrap()["kind"], "end");
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    for k in ["message", "tool_call", "tool_result"] {
        assert!(kinds.contains(&k), "{h}: no {k} in {kinds:?}");
    }
    assert!(
        kinds.iter().filter(|k| **k == "tool_result").count() >= 2,
        "{kinds:?}"
    );
    let final_text = events
        .iter()
        .filter(|e| e["kind"] == "message")
        .filter_map(|e| e["payload"]["text"].as_str())
        .collect::<Vec<_>>();
    assert!(final_text.contains(&"done"), "{final_text:?}");
    // The broker put the real key into every model request; no event shows either key.
    let calls: Vec<Value> = m.requests().into_iter().filter(is_model_call).collect();
    assert!(calls.len() >= 3, "{calls:#?}");
    for r in &calls {
        assert_eq!(r["status"], 200, "{r}");
        assert_eq!(key_of(r), Some(REAL), "{r}");
    }
    let text = serde_json::to_string(&events).unwrap();
    assert!(!text.contains(REAL), "the key is in an event");
    assert!(
        !text.contains(PLACEHOLDER),
        "the placeholder is in an event"
    );

    // `continue` resumes the harness's session: the model is asked with the earlier
    // conversation (three assistant turns, so modelsim answers with turn 3, and the
    // first task).
    let (status, cont) = api(
        &d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": "and now?", "mode": "continue"})),
    )
    .await;
    assert_eq!(status, 201, "{cont}");
    assert_eq!(cont["parent_run_id"], id.as_str(), "{cont}");
    let cont_id = cont["id"].as_str().unwrap().to_string();
    let cont_done = wait_final(&d, &cont_id, Duration::from_secs(120)).await;
    let cont_events = all_events(&d, &cont_id, 0).await;
    assert_eq!(
        cont_done["state"], "succeeded",
        "{cont_done}\n{cont_events:#?}"
    );
    let last = m
        .requests()
        .into_iter()
        .rfind(is_model_call)
        .expect("a model call");
    assert_eq!(last["turn"], 3, "{last}");
    let body = last["body"].to_string();
    assert!(body.contains(task) && body.contains("and now?"), "{body}");
    assert_eq!(
        seqs(&cont_events),
        (1..=cont_events.len() as i64).collect::<Vec<_>>()
    );
    let text = serde_json::to_string(&cont_events).unwrap();
    assert!(!text.contains(REAL) && !text.contains(PLACEHOLDER));
    d.shutdown().await;
}

async fn cancel_mid_run_leaves_no_harness_process(case: Case, ip_n: u8, port: u16) {
    let h = case.harness;
    let up = Upstream::start(&[]);
    let ip = up.ip(ip_n);
    let m = ModelSim::start(
        &up,
        &ip,
        port,
        json!({"turns": [
            {"tool_calls": [{"any_of": [
                {"name": "Bash", "arguments": {"command": "sleep 300 & sleep 300"}},
                {"name": "bash", "arguments": {"command": "sleep 300 & sleep 300"}},
                {"name": "exec_command", "arguments": {"cmd": "sleep 300 & sleep 300"}}]}]},
            {"text": "too late"}
        ]}),
    );
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[port]).await;
    let base_url = format!("http://{ip}:{port}{}", case.base_path);
    let rt = runtime_of(
        &d,
        &sb,
        h,
        json!({"base_url": base_url, "model": "modelsim"}),
    )
    .await;
    let id = start_run(&d, &rt, json!({"task": "sleep"})).await;

    let start = Instant::now();
    while !harness_processes(&d, &sb)
        .await
        .iter()
        .any(|l| l.contains("sleep 300"))
    {
        let (_, now) = api(&d, reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await;
        assert!(
            start.elapsed() < Duration::from_secs(90)
                && ["queued", "running"].contains(&now["state"].as_str().unwrap_or_default()),
            "the tool never started: {now}\n{:#?}\n{:#?}",
            m.requests(),
            all_events(&d, &id, 0).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !harness_processes(&d, &sb)
            .await
            .iter()
            .filter(|l| !l.contains("sleep 300"))
            .collect::<Vec<_>>()
            .is_empty(),
        "the harness itself is not seen, so its absence later would prove nothing"
    );
    let (status, cancelled) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/runs/{id}/cancel"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
    let left = harness_processes(&d, &sb).await;
    assert!(left.is_empty(), "{h} left in the sandbox: {left:#?}");
    assert_cancelled_for_good(&d, &id).await;
    let left = harness_processes(&d, &sb).await;
    assert!(left.is_empty(), "{h} left in the sandbox: {left:#?}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_writes_runs_continues_and_never_holds_the_key() {
    a_run_writes_runs_continues_and_never_holds_the_key(CLAUDE, 5, 8090).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_writes_runs_continues_and_never_holds_the_key() {
    a_run_writes_runs_continues_and_never_holds_the_key(CODEX, 6, 8091).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_cancel_mid_run_leaves_no_harness_process() {
    cancel_mid_run_leaves_no_harness_process(CLAUDE, 7, 8092).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_cancel_mid_run_leaves_no_harness_process() {
    cancel_mid_run_leaves_no_harness_process(CODEX, 8, 8093).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_writes_runs_continues_and_never_holds_the_key() {
    a_run_writes_runs_continues_and_never_holds_the_key(OPENCODE, 9, 8094).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_cancel_mid_run_leaves_no_harness_process() {
    cancel_mid_run_leaves_no_harness_process(OPENCODE, 10, 8095).await;
}
