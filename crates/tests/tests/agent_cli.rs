//! Agent runs through the `sandpit` CLI and the Rust client, with the real `pi` harness
//! against the scripted model server (as in `agent_runs.rs`): `agent create/ls/show/rm`,
//! `agent run` and `agent events` with their exit codes and resumption, `agent cancel`,
//! NDJSON event pages, and `workspace create` with its all-or-nothing promise.

use sandpit_api::StartRunRequest;
use sandpit_tests::agents::{
    ModelSim, all_events, api, daemon, daemon_with, harness_processes, req, sandbox, seqs,
    wait_tool_running,
};
use sandpit_tests::netfix::Upstream;
use sandpit_tests::{Daemon, sandboxes};
use serde_json::{Value, json};
use std::io::Read;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Runs the CLI and insists it succeeded; its stdout.
fn cli_ok(d: &Daemon, args: &[&str]) -> String {
    let (code, out, err) = d.cli_code(args);
    assert_eq!(
        code,
        Some(0),
        "sandpit {args:?}\nstdout: {out}\nstderr: {err}"
    );
    out
}

/// The NDJSON lines of the CLI's `--json` event output.
fn ndjson(out: &str) -> Vec<Value> {
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect()
}

/// Waits for a child CLI (at most `within`): (exit code, stdout, stderr).
fn wait_child(mut child: Child, within: Duration) -> (Option<i32>, String, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the CLI did not finish within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (mut out, mut err) = (String::new(), String::new());
    if let Some(mut o) = child.stdout.take() {
        o.read_to_string(&mut out).unwrap();
    }
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut err).unwrap();
    }
    (status.code(), out, err)
}

/// Waits until the stored events of `run` reach `n`.
async fn wait_events(d: &Daemon, run: &str, n: usize) {
    let start = Instant::now();
    while all_events(d, run, 0).await.len() < n {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "run {run} never had {n} events"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_runs_resume_without_gaps_are_idempotent_and_owner_scoped() {
    let up = Upstream::start(&[]);
    let ip = up.ip(13);
    // The second turn is held back, so that a reader can join the run while it runs.
    let m = ModelSim::start(
        &up,
        &ip,
        8085,
        json!({"turns": [
            {"text": "Writing the file.", "tool_calls": [
                {"name": "write", "arguments": {"path": "a.txt", "content": "a\n"}}]},
            {"delay_ms": 3000, "tool_calls": [{"name": "bash", "arguments": {"command": "cat a.txt"}}]},
            {"text": "done"},
            {"text": "continued"}
        ]}),
    );
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[8085]).await;

    // Runtimes: create, list (of the sandbox and of all), show.
    let rt = cli_ok(
        &d,
        &[
            "agent",
            "create",
            &sb,
            "--harness",
            "pi",
            "--model-url",
            &m.url,
            "--model",
            "modelsim",
        ],
    )
    .trim()
    .to_string();
    assert!(rt.starts_with("agt"), "{rt}");
    for args in [vec!["agent", "ls", sb.as_str()], vec!["agent", "ls"]] {
        let out = cli_ok(&d, &args);
        assert!(
            out.lines().any(|l| l.starts_with(&rt) && l.contains(&sb)),
            "{args:?}: {out}"
        );
    }
    let shown: Value =
        serde_json::from_str(&cli_ok(&d, &["agent", "show", &rt, "--json"])).unwrap();
    assert_eq!(shown["state"], "active", "{shown}");
    assert_eq!(shown["model"]["base_url"], m.url.as_str(), "{shown}");

    // A detached start, and a second start with the same key: the same run.
    let start = ["agent", "run", &rt, "write a.txt, then cat it"];
    let keyed = [&start[..], &["--idempotency-key", "k1", "--detach"]].concat();
    let run = cli_ok(&d, &keyed).trim().to_string();
    assert!(run.starts_with("run"), "{run}");
    assert_eq!(cli_ok(&d, &keyed).trim(), run);
    // The client's start with the key gives it back as well.
    let c = d.client();
    let again = c
        .start_run(
            &rt,
            &StartRunRequest {
                task: "write a.txt, then cat it".into(),
                mode: None,
                idempotency_key: Some("k1".into()),
                timeout_secs: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(again.id, run);

    // Join the run while it runs (its second model turn is held back), after its first
    // event: the rest comes with no gap, and the follow ends with the run (exit 0).
    wait_events(&d, &run, 2).await;
    let (_, now) = api(&d, reqwest::Method::GET, &format!("/v1/runs/{run}"), None).await;
    assert_eq!(now["state"], "running", "{now}");
    let (code, out, err) = d.cli_code(&[
        "agent", "events", &run, "--after", "1", "--follow", "--json",
    ]);
    assert_eq!(code, Some(0), "stdout: {out}\nstderr: {err}");
    assert!(err.contains("succeeded"), "{err}");
    let followed = ndjson(&out);
    let stored = all_events(&d, &run, 0).await;
    let n = stored.len() as i64;
    assert!(n > 4, "{stored:#?}");
    assert_eq!(seqs(&followed), (2..=n).collect::<Vec<_>>());
    assert_eq!(followed, stored[1..].to_vec());
    assert_eq!(followed.last().unwrap()["kind"], "end");

    // `--after N` prints exactly N+1..n, as NDJSON and as lines; `--limit` caps it.
    let half = n / 2;
    let out = cli_ok(
        &d,
        &[
            "agent",
            "events",
            &run,
            "--after",
            &half.to_string(),
            "--json",
        ],
    );
    assert_eq!(ndjson(&out), stored[half as usize..].to_vec());
    let out = cli_ok(&d, &["agent", "events", &run, "--after", &half.to_string()]);
    let printed: Vec<i64> = out
        .lines()
        .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(printed, (half + 1..=n).collect::<Vec<_>>(), "{out}");
    let out = cli_ok(
        &d,
        &[
            "agent", "events", &run, "--after", "1", "--limit", "2", "--json",
        ],
    );
    assert_eq!(seqs(&ndjson(&out)), vec![2, 3]);

    // The NDJSON page of the REST API: the same events, the same `after` and `limit`.
    let page = |after: i64, limit: u32| {
        reqwest::Client::new()
            .get(format!(
                "{}/v1/runs/{run}/events?after={after}&limit={limit}",
                d.url
            ))
            .bearer_auth(d.key.trim())
            .header("accept", "application/x-ndjson")
            .send()
    };
    let resp = page(half, 1000).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "application/x-ndjson"
    );
    assert_eq!(
        ndjson(&resp.text().await.unwrap()),
        stored[half as usize..].to_vec()
    );
    let one = page(half, 1).await.unwrap().text().await.unwrap();
    assert_eq!(seqs(&ndjson(&one)), vec![half + 1]);
    assert_eq!(page(n, 10).await.unwrap().text().await.unwrap(), "");

    // A run in the foreground streams to its end: `--continue` resumes pi's session.
    let (code, out, err) = d.cli_code(&["agent", "run", &rt, "and now?", "--continue", "--json"]);
    assert_eq!(code, Some(0), "stdout: {out}\nstderr: {err}");
    let cont = ndjson(&out);
    assert_eq!(seqs(&cont), (1..=cont.len() as i64).collect::<Vec<_>>());
    let end = cont.last().unwrap();
    assert_eq!(end["kind"], "end");
    assert_eq!(end["payload"]["state"], "succeeded", "{end}");
    assert_eq!(m.requests().last().unwrap()["turn"], 3);

    // Another owner's key finds none of it.
    let other = d.owner_key("mallory").await;
    for args in [
        vec!["agent", "show", rt.as_str()],
        vec!["agent", "events", run.as_str()],
        vec!["agent", "events", run.as_str(), "--follow"],
        vec!["agent", "cancel", run.as_str()],
        vec!["agent", "run", rt.as_str(), "x"],
        vec!["agent", "rm", rt.as_str()],
    ] {
        let args = [&["--api-key", other.as_str()], &args[..]].concat();
        let (code, out, err) = d.cli_code(&args);
        assert_eq!(code, Some(1), "{args:?}: {out} {err}");
        assert!(err.contains("not_found"), "{args:?}: {err}");
    }
    let out = cli_ok(&d, &["--api-key", &other, "agent", "ls"]);
    assert!(!out.contains(&rt), "{out}");
    let oc = sandpit_client::Client::new(&d.url, Some(other.clone())).unwrap();
    assert!(oc.get_run(&run).await.unwrap_err().is_not_found());
    let err = oc.follow_run(&run, 0).next_event().await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
    let (status, _) = req(
        &d,
        &other,
        reqwest::Method::GET,
        &format!("/v1/runs/{run}/events"),
        None,
    )
    .await;
    assert_eq!(status, 404);

    // `agent rm` ends the runtime; its record stays.
    assert_eq!(cli_ok(&d, &["agent", "rm", &rt]).trim(), rt);
    let shown: Value =
        serde_json::from_str(&cli_ok(&d, &["agent", "show", &rt, "--json"])).unwrap();
    assert_eq!(shown["state"], "ended", "{shown}");
    d.shutdown().await;
}

/// Ctrl-C on `agent run` stops the reading only (exit 130, with the command to resume);
/// a follower resumed from there sees the rest; `agent cancel` ends the run running
/// `sleep 300`, the follower exits 2, and no sleep is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_detaches_and_cancel_ends_the_run() {
    let up = Upstream::start(&[]);
    let ip = up.ip(14);
    let m = ModelSim::start(
        &up,
        &ip,
        8086,
        json!({"turns": [
            {"text": "Sleeping.", "tool_calls": [{"name": "bash", "arguments": {"command": "sleep 300 & sleep 300"}}]},
            {"text": "never asked"}
        ]}),
    );
    let d = daemon(&up).await;
    let sb = sandbox(&d, &ip, &[8086]).await;
    let rt = sandpit_tests::agents::runtime(&d, &sb, &m).await;
    let child = d
        .cli_command(&["agent", "run", &rt, "sleep"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_tool_running(&d, &sb, "sleep 300", &m).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let (code, out, err) = wait_child(child, Duration::from_secs(20));
    assert_eq!(code, Some(130), "stdout: {out}\nstderr: {err}");
    let run = err
        .lines()
        .find_map(|l| l.strip_prefix("run "))
        .expect("the run's id on stderr")
        .trim()
        .to_string();
    let hint = format!("sandpit agent events {run} --after ");
    let after: i64 = err
        .split(&hint)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no resume command in {err:?}"));
    // What was printed is exactly 1..=after.
    let printed: Vec<i64> = out
        .lines()
        .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(printed, (1..=after).collect::<Vec<_>>(), "{out}");
    let (_, now) = api(&d, reqwest::Method::GET, &format!("/v1/runs/{run}"), None).await;
    assert_eq!(
        now["state"], "running",
        "Ctrl-C must not stop the run: {now}"
    );

    let follower = d
        .cli_command(&[
            "agent",
            "events",
            &run,
            "--after",
            &after.to_string(),
            "--follow",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let out = cli_ok(&d, &["agent", "cancel", &run]);
    assert_eq!(out.trim(), format!("{run} cancelled"));
    let (code, out, err) = wait_child(follower, Duration::from_secs(30));
    assert_eq!(code, Some(2), "stdout: {out}\nstderr: {err}");
    let rest = ndjson(&out);
    let stored = all_events(&d, &run, 0).await;
    assert_eq!(rest, stored[after as usize..].to_vec());
    let end = rest.last().unwrap();
    assert_eq!(end["kind"], "end");
    assert_eq!(end["payload"]["state"], "cancelled", "{end}");
    let left = harness_processes(&d, &sb).await;
    assert!(left.is_empty(), "left in the sandbox: {left:#?}");
    // A finished run's follow ends at once with its exit code.
    let (code, _, _) = d.cli_code(&["agent", "events", &run, "--follow"]);
    assert_eq!(code, Some(2));
    d.shutdown().await;
}

/// Sandboxes `c`'s owner has had at some point (the usage summary counts them).
async fn sandboxes_ever(d: &Daemon, key: &str) -> u64 {
    let (status, u) = req(d, key, reqwest::Method::GET, "/v1/usage", None).await;
    assert_eq!(status, 200, "{u}");
    u["sandboxes"].as_u64().unwrap()
}

/// `workspace create` makes a sandbox with a runtime in one call; a workspace whose
/// runtime is refused leaves no sandbox behind and fails with the runtime's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspaces_are_made_whole_or_not_at_all() {
    let up = Upstream::start(&[]);
    let ip = up.ip(15);
    // With the broker on, an unknown model-key secret is the runtime's 400.
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("broker.key");
    std::fs::write(&key, format!("{}\n", "5e".repeat(32))).unwrap();
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let d = daemon_with(
        &up,
        &format!("[broker]\nkey_file = {:?}\n", key.display().to_string()),
    )
    .await;
    let url = format!("http://{ip}:8087/v1");
    let out = cli_ok(
        &d,
        &[
            "workspace",
            "create",
            "--allow",
            &format!("{ip}:8087"),
            "--timeout",
            "600",
            "--memory",
            "1G",
            "--env",
            "A=1",
            "--model-url",
            &url,
            "--model",
            "modelsim",
            "--json",
        ],
    );
    let ws: Value = serde_json::from_str(&out).unwrap();
    let sb = ws["sandbox"]["id"].as_str().unwrap().to_string();
    let agent = ws["agent"]["id"].as_str().unwrap().to_string();
    assert_eq!(ws["sandbox"]["state"], "running", "{ws}");
    assert_eq!(ws["agent"]["sandbox_id"], sb.as_str(), "{ws}");
    assert_eq!(ws["agent"]["state"], "active", "{ws}");
    let (_, policy) = api(
        &d,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{sb}/network"),
        None,
    )
    .await;
    assert_eq!(policy["mode"], "allowlist", "{policy}");
    assert_eq!(policy["rules"][0]["cidr"], format!("{ip}/32"), "{policy}");
    assert_eq!(policy["rules"][0]["ports"], json!([8087]), "{policy}");
    let c = d.client();
    assert_eq!(sandpit_tests::sh(&c, &sb, "echo $A").await.stdout, "1\n");
    let out = cli_ok(&d, &["agent", "ls", &sb]);
    assert!(out.contains(&agent), "{out}");
    // The human form names both.
    let out = cli_ok(
        &d,
        &[
            "workspace",
            "create",
            "--model-url",
            &url,
            "--model",
            "modelsim",
        ],
    );
    let fields: Vec<(&str, &str)> = out
        .lines()
        .filter_map(|l| l.split_once(char::is_whitespace))
        .map(|(k, v)| (k, v.trim()))
        .collect();
    assert_eq!(fields.len(), 2, "{out}");
    assert_eq!(fields[0].0, "SANDBOX");
    assert_eq!(fields[1].0, "AGENT");
    let (_, shown) = api(
        &d,
        reqwest::Method::GET,
        &format!("/v1/agents/{}", fields[1].1),
        None,
    )
    .await;
    assert_eq!(shown["sandbox_id"], fields[0].1, "{shown}");

    // Refused once the sandbox is made (the model key names no secret of the owner):
    // the sandbox goes again, and the error is what the runtime route says.
    let owner = d.owner_key("wsowner").await;
    let model = json!({"base_url": url, "model": "modelsim", "api_key_secret": "nosuch"});
    let (status, body) = req(
        &d,
        &owner,
        reqwest::Method::POST,
        "/v1/workspaces",
        Some(json!({"timeout": 600, "harness": "pi", "model": model})),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    let (same_status, same) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/agents"),
        Some(json!({"harness": "pi", "model": model})),
    )
    .await;
    assert_eq!(
        (status, &body["code"]),
        (same_status, &same["code"]),
        "{body} {same}"
    );
    let oc = sandpit_client::Client::new(&d.url, Some(owner.clone())).unwrap();
    let start = Instant::now();
    while sandboxes_ever(&d, &owner).await == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the workspace made no sandbox"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let start = Instant::now();
    loop {
        let left = sandboxes(&oc).await;
        if left.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "left behind: {left:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Through the CLI: the same refusal, exit 1, and nothing left.
    let (code, out, err) = d.cli_code(&[
        "--api-key",
        &owner,
        "workspace",
        "create",
        "--model-url",
        &url,
        "--model",
        "modelsim",
        "--api-key-secret",
        "nosuch",
    ]);
    assert_eq!(code, Some(1), "{out} {err}");
    assert!(err.contains(same["code"].as_str().unwrap()), "{err}");
    let start = Instant::now();
    while !sandboxes(&oc).await.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "a sandbox was left behind"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let made = sandboxes_ever(&d, &owner).await;
    // What the runtime refuses without a sandbox is refused before one is made.
    let (status, body) = req(
        &d,
        &owner,
        reqwest::Method::POST,
        "/v1/workspaces",
        Some(json!({"harness": "nosuch", "model": {"base_url": url, "model": "m"}})),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(sandboxes_ever(&d, &owner).await, made);
    assert!(sandboxes(&oc).await.is_empty());

    // The workspace is its owner's only.
    let (status, _) = req(
        &d,
        &owner,
        reqwest::Method::GET,
        &format!("/v1/agents/{agent}"),
        None,
    )
    .await;
    assert_eq!(status, 404);
    let (status, _) = req(
        &d,
        &owner,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{sb}"),
        None,
    )
    .await;
    assert_eq!(status, 404);
    d.shutdown().await;
}
