//! Agent runs end to end with a real harness (pi, from `scripts/setup.sh --harnesses`):
//! the scripted model server (`sandpit-modelsim`) listens inside a test upstream network
//! namespace, the sandbox reaches it through its own egress allow-list, and the daemon
//! drives pi in the sandbox. Nothing leaves the machine.

use sandpit_tests::agents::{
    ModelSim, NO_KEY, all_events, api, assert_cancelled_for_good, broker_daemon, broker_key_file,
    daemon, daemon_with, harness_processes, model_secret, req, runtime, sandbox,
    sandbox_with_secret, seqs, shell_turn, start_run, wait_final, wait_mid_stream,
    wait_tool_running,
};
use sandpit_tests::daemon::Daemon;
use sandpit_tests::netfix::Upstream;
use sandpit_tests::sh;
use serde_json::json;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pi_run_writes_a_file_runs_a_command_and_its_events_resume_without_gaps() {
    let up = Upstream::start(&[]);
    let ip = up.ip(9);
    let m = ModelSim::start(
        &up,
        &ip,
        8080,
        json!({"turns": [
            {"text": "Writing the file.", "tool_calls": [
                {"name": "write", "arguments": {"path": "hello.txt", "content": "hi\n"}}]},
            {"tool_calls": [{"name": "bash", "arguments": {"command": "cat hello.txt && echo ran > ran.txt"}}]},
            {"text": "done"},
            {"text": "continued"}
        ]}),
    );
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[8080]).await;
    let rt = runtime(&d, &sb, &m).await;
    // Unknown harnesses, wire APIs a harness cannot speak and bad modes are refused
    // clearly.
    for (harness, api_name) in [("nosuch", None), ("opencode", Some("responses"))] {
        let (status, body) = api(
            &d,
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{sb}/agents"),
            Some(
                json!({"harness": harness, "model": {"base_url": m.url, "model": "modelsim",
                "api": api_name}}),
            ),
        )
        .await;
        assert_eq!(status, 400, "{harness}: {body}");
    }
    let (status, body) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/agents/{rt}/runs"),
        Some(json!({"task": "x", "mode": "sideways"})),
    )
    .await;
    assert_eq!(status, 400, "{body}");

    let start = json!({"task": "write hello.txt, then run a command", "idempotency_key": "one"});
    let path = format!("/v1/agents/{rt}/runs");
    let (status, run) = api(&d, reqwest::Method::POST, &path, Some(start.clone())).await;
    assert_eq!(status, 201, "{run}");
    let id = run["id"].as_str().unwrap().to_string();
    // The same key gives the same run back, not a second one.
    let (status, again) = api(&d, reqwest::Method::POST, &path, Some(start)).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["id"], id.as_str());

    // A follower that goes away after its first event does not stop the run.
    let mut follower = reqwest::Client::new()
        .get(format!("{}/v1/runs/{id}/events/stream", d.url))
        .bearer_auth(d.key.trim())
        .send()
        .await
        .unwrap();
    assert_eq!(follower.status(), 200);
    let first = tokio::time::timeout(Duration::from_secs(60), follower.chunk())
        .await
        .expect("a first event")
        .unwrap()
        .expect("a chunk");
    let first = String::from_utf8_lossy(&first).into_owned();
    assert!(
        first
            .lines()
            .any(|l| l.strip_prefix("id:").map(str::trim) == Some("1")),
        "{first}"
    );
    drop(follower);

    let done = wait_final(&d, &id, Duration::from_secs(120)).await;
    let events = all_events(&d, &id, 0).await;
    assert_eq!(done["state"], "succeeded", "{done}\n{events:#?}");
    let c = d.client();
    assert_eq!(sh(&c, &sb, "cat /home/user/hello.txt").await.stdout, "hi\n");
    assert_eq!(sh(&c, &sb, "cat /home/user/ran.txt").await.stdout, "ran\n");

    // Ordered 1..N, no gap, the `end` event last; the run counts the same N.
    let n = events.len() as i64;
    assert!(n > 3, "{events:#?}");
    assert_eq!(seqs(&events), (1..=n).collect::<Vec<_>>());
    assert_eq!(done["events"].as_i64(), Some(n));
    assert_eq!(events.last().unwrap()["kind"], "end");
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert!(kinds.contains(&"tool_call"), "{kinds:?}");
    assert!(kinds.contains(&"tool_result"), "{kinds:?}");
    // The model got the placeholder key; no stored event shows it.
    let reqs = m.requests();
    assert!(reqs.len() >= 3, "{reqs:#?}");
    for r in &reqs {
        assert_eq!(r["status"], 200, "{r}");
        assert_eq!(
            r["headers"]["authorization"],
            format!("Bearer {NO_KEY}"),
            "{r}"
        );
    }
    let text = serde_json::to_string(&events).unwrap();
    assert!(!text.contains(NO_KEY), "the key is in an event");

    // A reader that saw up to k gets exactly the rest, as a page and as SSE.
    let k = n / 2;
    let rest = all_events(&d, &id, k).await;
    assert_eq!(seqs(&rest), (k + 1..=n).collect::<Vec<_>>());
    assert_eq!(rest, events[k as usize..].to_vec());
    let sse = reqwest::Client::new()
        .get(format!("{}/v1/runs/{id}/events/stream", d.url))
        .bearer_auth(d.key.trim())
        .header("last-event-id", k.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(sse.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(20), sse.text())
        .await
        .expect("the stream of a finished run ends")
        .unwrap();
    let ids: Vec<i64> = body
        .lines()
        .filter_map(|l| l.strip_prefix("id:"))
        .map(|v| v.trim().parse().unwrap())
        .collect();
    assert_eq!(ids, (k + 1..=n).collect::<Vec<_>>());

    // `continue` resumes pi's session: the model is asked with the three earlier
    // assistant turns in the conversation (modelsim answers with turn 3).
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
    let last = m.requests().last().cloned().unwrap();
    assert_eq!(last["turn"], 3, "{last}");
    assert_eq!(
        seqs(&cont_events),
        (1..=cont_events.len() as i64).collect::<Vec<_>>()
    );

    // Another owner sees none of it.
    let other = d.owner_key("mallory").await;
    for p in [
        format!("/v1/agents/{rt}"),
        format!("/v1/runs/{id}"),
        format!("/v1/runs/{id}/events"),
    ] {
        let (status, body) = req(&d, &other, reqwest::Method::GET, &p, None).await;
        assert_eq!(status, 404, "{p}: {body}");
    }
    for p in [
        format!("/v1/runs/{id}/cancel"),
        format!("/v1/agents/{rt}/runs"),
    ] {
        let (status, body) = req(
            &d,
            &other,
            reqwest::Method::POST,
            &p,
            Some(json!({"task": "x"})),
        )
        .await;
        assert_eq!(status, 404, "{p}: {body}");
    }
    let (status, body) = req(
        &d,
        &other,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/agents"),
        Some(json!({"harness": "pi", "model": {"base_url": m.url, "model": "modelsim"}})),
    )
    .await;
    assert_eq!(status, 404, "{body}");

    // Deleting the sandbox ends its runtime.
    let (status, _) = api(
        &d,
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{sb}"),
        None,
    )
    .await;
    assert_eq!(status, 204);
    let (_, after) = api(&d, reqwest::Method::GET, &format!("/v1/agents/{rt}"), None).await;
    assert_eq!(after["state"], "ended", "{after}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_kills_the_harness_and_a_late_answer_changes_nothing() {
    let up = Upstream::start(&[]);
    let ip = up.ip(10);
    let m = ModelSim::start(
        &up,
        &ip,
        8081,
        json!({"turns": [
            {"tool_calls": [{"name": "bash", "arguments": {"command": "sleep 300 & sleep 300"}}]},
            {"text": "never asked"}
        ]}),
    );
    // A second model that holds its answer: a cancel while the model "thinks".
    let slow = ModelSim::start(
        &up,
        &ip,
        8082,
        json!({"turns": [{"text": "late answer", "delay_ms": 3000}]}),
    );
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[8081, 8082]).await;
    let rt = runtime(&d, &sb, &m).await;
    let path = format!("/v1/agents/{rt}/runs");
    let (status, run) = api(
        &d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": "sleep", "idempotency_key": "a"})),
    )
    .await;
    assert_eq!(status, 201, "{run}");
    let id = run["id"].as_str().unwrap().to_string();
    // A second run while this one is active is a conflict.
    let (status, body) = api(
        &d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": "other", "idempotency_key": "b"})),
    )
    .await;
    assert_eq!(status, 409, "{body}");

    // Wait until the harness's tool runs (sleep in the background and foreground).
    wait_tool_running(&d, &sb, "sleep 300", &m).await;
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
    assert!(left.is_empty(), "left in the sandbox: {left:#?}");

    assert_cancelled_for_good(&d, &id).await;

    // Cancel while the model holds its answer: once the answer is due the run is still
    // cancelled and no harness process is left.
    let rt2 = runtime(&d, &sb, &slow).await;
    let (status, run2) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/agents/{rt2}/runs"),
        Some(json!({"task": "think"})),
    )
    .await;
    assert_eq!(status, 201, "{run2}");
    let id2 = run2["id"].as_str().unwrap().to_string();
    slow.wait_asked().await;
    let (status, cancelled) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/runs/{id2}/cancel"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
    let left = harness_processes(&d, &sb).await;
    assert!(left.is_empty(), "left in the sandbox: {left:#?}");
    assert_cancelled_for_good(&d, &id2).await;
    // A new run may start now.
    let (status, body) = api(
        &d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": "again"})),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let second = body["id"].as_str().unwrap().to_string();
    let (status, _) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/runs/{second}/cancel"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    d.shutdown().await;
}

/// The model key is a broker secret: the harness holds only its placeholder (in its
/// config file inside the sandbox), the broker puts the real key into the request on the
/// way out, and neither the key nor the placeholder shows in an event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_key_is_a_broker_secret_that_never_enters_the_sandbox() {
    const REAL: &str = "sk-real-model-key-0123456789abcdef";
    let up = Upstream::start(&[("model.upstream.test", "@11")]);
    let m = ModelSim::start_with_key(
        &up,
        &up.ip(11),
        8083,
        json!({"turns": [{"text": "done"}]}),
        REAL,
    );
    let keys = broker_key_file();
    let d = broker_daemon(&up, &keys).await;
    model_secret(&d, "modelkey", REAL, "model.upstream.test").await;
    let sb = sandbox_with_secret(&d, "modelkey", "model.upstream.test", 8083).await;
    let (status, rt) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/agents"),
        Some(json!({"harness": "pi", "model": {
            "base_url": "http://model.upstream.test:8083/v1", "model": "modelsim",
            "api_key_secret": "modelkey"}})),
    )
    .await;
    assert_eq!(status, 201, "{rt}");
    let rt = rt["id"].as_str().unwrap().to_string();
    let id = start_run(&d, &rt, json!({"task": "say done"})).await;
    let done = wait_final(&d, &id, Duration::from_secs(120)).await;
    let events = all_events(&d, &id, 0).await;
    // The model refuses any other key, so success means the broker put the real one in.
    assert_eq!(
        done["state"],
        "succeeded",
        "{done}\n{events:#?}\n{:#?}",
        m.requests()
    );
    let reqs = m.requests();
    assert!(!reqs.is_empty());
    for r in &reqs {
        assert_eq!(
            r["headers"]["authorization"],
            format!("Bearer {REAL}"),
            "{r}"
        );
    }
    let text = serde_json::to_string(&events).unwrap();
    assert!(!text.contains(REAL), "the key is in an event");
    assert!(
        !text.contains("SANDPIT_SECRET_modelkey"),
        "the placeholder is in an event"
    );
    // Inside the sandbox only the placeholder exists: in the harness's config, nowhere
    // the real key.
    let c = d.client();
    let found = sh(
        &c,
        &sb,
        "grep -rl SANDPIT_SECRET_modelkey /home/user/.sandpit-agents",
    )
    .await;
    assert!(found.stdout.contains("models.json"), "{found:?}");
    let leak = sh(
        &c,
        &sb,
        &format!("grep -rl {REAL} /home /tmp /etc 2>/dev/null; env | grep -c {REAL}"),
    )
    .await;
    assert_eq!(leak.stdout.trim(), "0", "{leak:?}");
    d.shutdown().await;
}

/// A run whose daemon was killed has no driver after the restart: its harness is
/// stopped and it is marked failed with the reason; its stored events stay whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_left_active_by_a_killed_daemon_is_failed_and_its_harness_stopped() {
    let up = Upstream::start(&[]);
    let ip = up.ip(12);
    let slow = ModelSim::start(
        &up,
        &ip,
        8084,
        json!({"turns": [{"text": "too late", "delay_ms": 60000}]}),
    );
    let mut d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[8084]).await;
    let rt = runtime(&d, &sb, &slow).await;
    let id = start_run(&d, &rt, json!({"task": "think"})).await;
    slow.wait_asked().await;
    d.kill9();
    let d = d.restart().start().await;
    let (status, now) = api(&d, reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await;
    assert_eq!(status, 200, "{now}");
    assert_eq!(now["state"], "failed", "{now}");
    assert!(
        now["reason"].as_str().unwrap().contains("daemon restarted"),
        "{now}"
    );
    let left = harness_processes(&d, &sb).await;
    assert!(left.is_empty(), "left in the sandbox: {left:#?}");
    let events = all_events(&d, &id, 0).await;
    let n = events.len() as i64;
    assert_eq!(seqs(&events), (1..=n).collect::<Vec<_>>());
    assert_eq!(events.last().unwrap()["kind"], "end");
    d.shutdown().await;
}

/// A run past its own `timeout_secs`, or past the daemon's `[agents] max_run_secs`, ends
/// `timed_out` while the model still holds its answer: the harness is killed, the events
/// are kept (the last is `end`), and the answer arriving later changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_past_its_time_limit_ends_timed_out_and_its_harness_is_killed() {
    let up = Upstream::start(&[]);
    let ip = up.ip(9);
    let slow = ModelSim::start(
        &up,
        &ip,
        8090,
        json!({"turns": [
            {"text": "too late", "delay_ms": 8000},
            {"text": "too late again", "delay_ms": 8000}
        ]}),
    );
    let d = daemon_with(&up, "max_run_secs = 4\n").await;
    let sb = sandbox(&d, &ip, &[8090]).await;
    let rt = runtime(&d, &sb, &slow).await;
    let path = format!("/v1/agents/{rt}/runs");
    let (status, body) = api(
        &d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": "think", "timeout_secs": 0})),
    )
    .await;
    assert_eq!(status, 400, "{body}");

    // Its own limit (2 s, under the daemon's cap of 4 s).
    let started = Instant::now();
    let (status, run) = api(
        &d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": "think", "timeout_secs": 2})),
    )
    .await;
    assert_eq!(status, 201, "{run}");
    let id = run["id"].as_str().unwrap().to_string();
    // Whether pi got to ask the model within 2 s depends on the machine's load, so this
    // does not wait for it: the model holds every answer 8 s, so a run that ended any
    // other way than by its limit would read `succeeded` or `failed`, not `timed_out`
    // with the limit as its reason.
    let now = wait_final(&d, &id, Duration::from_secs(30)).await;
    let took = started.elapsed();
    assert_eq!(now["state"], "timed_out", "{now}");
    assert!(now["reason"].as_str().unwrap().contains("2 s"), "{now}");
    assert!(took >= Duration::from_secs(2), "ended after {took:?}");
    assert_timed_out_for_good(&d, &sb, &id).await;

    // No timeout of its own: the daemon's cap ends it.
    let started = Instant::now();
    let (status, run) = api(
        &d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": "think"})),
    )
    .await;
    assert_eq!(status, 201, "{run}");
    let id = run["id"].as_str().unwrap().to_string();
    let now = wait_final(&d, &id, Duration::from_secs(30)).await;
    assert_eq!(now["state"], "timed_out", "{now}");
    assert!(now["reason"].as_str().unwrap().contains("4 s"), "{now}");
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(4), "ended after {took:?}");
    assert_timed_out_for_good(&d, &sb, &id).await;
    d.shutdown().await;
}

/// No harness process is left, and past the model's delay the run is still `timed_out`
/// with its events whole and `end` last.
async fn assert_timed_out_for_good(d: &Daemon, sb: &str, id: &str) {
    let start = Instant::now();
    loop {
        let left = harness_processes(d, sb).await;
        if left.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "left in the sandbox: {left:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(7)).await;
    let (_, now) = api(d, reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await;
    assert_eq!(now["state"], "timed_out", "{now}");
    let events = all_events(d, id, 0).await;
    let n = events.len() as i64;
    assert!(n >= 1, "{events:#?}");
    assert_eq!(seqs(&events), (1..=n).collect::<Vec<_>>());
    let last = events.last().unwrap();
    assert_eq!(last["kind"], "end");
    assert_eq!(last["payload"]["state"], "timed_out", "{last}");
}

/// Every process of a run that the tests below start, as `ps` lines: the harness and its
/// supervisor, and the tools' escaped sleeps and shells (`sleep 1000`, the trap loop).
async fn run_processes(d: &Daemon, sb: &str) -> Vec<String> {
    let out = sh(&d.client(), sb, "ps -eo pid,args").await;
    out.stdout
        .lines()
        .filter(|l| {
            [
                "node",
                "pi-coding-agent",
                "/opt/sandpit/harnesses",
                "sandpit-supervisor",
                "sleep 1000",
                "term.marker",
            ]
            .iter()
            .any(|n| l.contains(n))
        })
        .filter(|l| !l.contains("ps -eo"))
        .map(String::from)
        .collect()
}

/// Waits until `needle` shows among the sandbox's processes.
async fn wait_process(d: &Daemon, sb: &str, needle: &str, m: &ModelSim) {
    let start = Instant::now();
    while !sh(&d.client(), sb, "ps -eo pid,args")
        .await
        .stdout
        .lines()
        .any(|l| l.contains(needle) && !l.contains("ps -eo"))
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{needle} never ran: {:#?}",
            m.requests()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A tool that double-forks a `sleep` into a session of its own escapes the harness's
/// process group and, once its parent is gone, is re-parented: to the run's supervisor,
/// so a cancel still ends it. The tool has returned and the harness waits for the model,
/// whose answer arrives after the cancel and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_ends_a_double_forked_setsid_tool_and_a_later_answer_changes_nothing() {
    let up = Upstream::start(&[]);
    let ip = up.ip(13);
    let m = ModelSim::start(
        &up,
        &ip,
        8091,
        json!({"turns": [
            {"tool_calls": [{"name": "bash", "arguments": {"command":
                "setsid sh -c 'sleep 1000 & echo started' </dev/null >/dev/null 2>&1; echo forked"}}]},
            {"text": "too late", "delay_ms": 5000}
        ]}),
    );
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[8091]).await;
    let rt = runtime(&d, &sb, &m).await;
    let id = start_run(&d, &rt, json!({"task": "fork"})).await;
    wait_process(&d, &sb, "sleep 1000", &m).await;
    // The tool returned and pi asks for the next turn, which the model holds.
    let start = Instant::now();
    while m.requests().len() < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{:#?}",
            m.requests()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, cancelled) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/runs/{id}/cancel"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
    let left = run_processes(&d, &sb).await;
    assert!(left.is_empty(), "left in the sandbox: {left:#?}");
    // Past the held answer: still cancelled, `end` last.
    assert_cancelled_for_good(&d, &id).await;
    d.shutdown().await;
}

/// Cancel sends SIGTERM to the whole tree first (a tool that traps it writes its marker),
/// and a process that ignores it is SIGKILLed once the grace period (`[agents]
/// cancel_grace_secs`, 2 s here) is over; the cancel answers after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_sends_sigterm_first_and_sigkill_after_the_grace() {
    let up = Upstream::start(&[]);
    let ip = up.ip(14);
    let m = ModelSim::start(
        &up,
        &ip,
        8092,
        json!({"turns": [
            {"tool_calls": [{"name": "bash", "arguments": {"command": concat!(
                "setsid sh -c 'trap \"echo term > /home/user/term.marker; exit 0\" TERM; ",
                "while :; do sleep 1; done' </dev/null >/dev/null 2>&1 & ",
                "setsid sh -c 'trap \"\" TERM; exec sleep 1000' </dev/null >/dev/null 2>&1 & ",
                "sleep 300")}}]},
            {"text": "never asked"}
        ]}),
    );
    let grace = Duration::from_secs(2);
    let d = daemon_with(&up, "cancel_grace_secs = 2\n").await;
    let sb = sandbox(&d, &ip, &[8092]).await;
    let rt = runtime(&d, &sb, &m).await;
    let id = start_run(&d, &rt, json!({"task": "trap"})).await;
    wait_process(&d, &sb, "sleep 1000", &m).await;
    wait_process(&d, &sb, "term.marker", &m).await;
    let c = d.client();
    assert!(
        sh(&c, &sb, "test -e /home/user/term.marker && echo yes")
            .await
            .stdout
            .is_empty(),
        "the marker is there before the cancel"
    );
    let start = Instant::now();
    let (status, cancelled) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/runs/{id}/cancel"),
        None,
    )
    .await;
    let took = start.elapsed();
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
    // The process that ignores SIGTERM held the tree until the grace was over.
    assert!(took >= grace, "the cancel answered after {took:?}");
    assert!(
        took < grace + Duration::from_secs(15),
        "the cancel answered after {took:?}"
    );
    let marker = sh(&c, &sb, "cat /home/user/term.marker").await;
    assert_eq!(marker.stdout.trim(), "term", "{marker:?}");
    let left = run_processes(&d, &sb).await;
    assert!(left.is_empty(), "left in the sandbox: {left:#?}");
    assert_cancelled_for_good(&d, &id).await;
    d.shutdown().await;
}

/// A sandbox paused mid-run freezes the harness with it and keeps the run: its stored
/// events read the same while it is paused (the model answers meanwhile), and after the
/// resume the run goes on to `succeeded`, the rest of its events after them, numbered
/// without a gap or a duplicate; `after=N` from the last one seen in the pause gives
/// exactly the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_goes_on_across_a_pause_and_resume_of_its_sandbox_without_a_gap() {
    let up = Upstream::start(&[]);
    let ip = up.ip(15);
    let m = ModelSim::start(
        &up,
        &ip,
        8093,
        json!({"turns": [
            shell_turn("echo across > /home/user/across.txt"),
            {"text": "done", "delay_ms": 3000}
        ]}),
    );
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[8093]).await;
    let rt = runtime(&d, &sb, &m).await;
    let id = start_run(&d, &rt, json!({"task": "write across.txt"})).await;
    // The tool ran and pi waits for the model's held answer.
    let before = wait_mid_stream(&d, &id, &m, 1).await;
    let (status, paused) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/pause"),
        None,
    )
    .await;
    assert_eq!(
        (status, paused["state"].as_str()),
        (200, Some("paused")),
        "{paused}"
    );
    // Past the held answer, with the harness frozen: nothing is lost or added.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let during = all_events(&d, &id, 0).await;
    assert_eq!(during[..before.len()], before[..], "{during:#?}");
    let (_, sandbox_now) = api(
        &d,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{sb}"),
        None,
    )
    .await;
    assert_eq!(
        sandbox_now["state"], "paused",
        "reading the run's events woke it"
    );
    let (status, resumed) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/resume"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{resumed}");
    let run = wait_final(&d, &id, Duration::from_secs(60)).await;
    assert_eq!(run["state"], "succeeded", "{run}");
    let all = all_events(&d, &id, 0).await;
    let n = all.len() as i64;
    assert_eq!(seqs(&all), (1..=n).collect::<Vec<_>>(), "{all:#?}");
    assert_eq!(all[..during.len()], during[..], "{all:#?}");
    let last_seen = during.last().map_or(0, |e| e["seq"].as_i64().unwrap());
    let rest = all_events(&d, &id, last_seen).await;
    assert_eq!(rest[..], all[during.len()..], "{rest:#?}");
    assert!(
        rest.iter().any(|e| e["kind"] == "message"),
        "the answer given during the pause arrived after it: {rest:#?}"
    );
    let c = d.client();
    assert_eq!(
        sh(&c, &sb, "cat /home/user/across.txt").await.stdout,
        "across\n"
    );
    d.shutdown().await;
}
