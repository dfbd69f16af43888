//! What the agent-run tests share: the scripted model server in a test namespace, a
//! daemon with the harnesses bound in, and raw API helpers for runtimes, runs and events.

use crate::netfix::Upstream;
use crate::{Daemon, free_port, sandpit_bin, sh, sh_root};
use serde_json::{Value, json};
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The key the harness is given when its runtime names no secret.
pub const NO_KEY: &str = "sandpit-no-key";

/// The harness installs of `scripts/setup.sh --harnesses` (in the build tree's `.deps`).
pub fn harness_dir() -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.deps/harnesses");
    assert!(
        dir.join("node_modules/.bin/pi").exists(),
        "pi missing: run scripts/setup.sh --harnesses"
    );
    dir.canonicalize().unwrap()
}

/// `sandpit-modelsim` inside the upstream namespace; stopped when dropped.
pub struct ModelSim {
    child: Child,
    dir: tempfile::TempDir,
    /// The base URL a runtime's model spec names (`http://IP:PORT/v1`).
    pub url: String,
}

impl ModelSim {
    /// Starts it on `ip:port` in `up`'s namespace, answering turn by turn from `script`.
    pub fn start(up: &Upstream, ip: &str, port: u16, script: Value) -> ModelSim {
        Self::start_with_key(up, ip, port, script, NO_KEY)
    }

    /// As [`ModelSim::start`], refusing (401) requests without `key`.
    pub fn start_with_key(
        up: &Upstream,
        ip: &str,
        port: u16,
        script: Value,
        key: &str,
    ) -> ModelSim {
        Self::spawn(up, ip, port, script, key, &[])
    }

    /// As [`ModelSim::start_with_key`], serving only HTTPS with a leaf for `names` issued
    /// by a test CA of its own ([`ModelSim::ca_file`]); the URL is `https://NAME:PORT/v1`
    /// with the first name.
    pub fn start_tls(
        up: &Upstream,
        ip: &str,
        port: u16,
        script: Value,
        key: &str,
        names: &[&str],
    ) -> ModelSim {
        assert!(!names.is_empty(), "a TLS model server needs a name");
        Self::spawn(up, ip, port, script, key, names)
    }

    /// Runs the binary; over TLS when `tls_names` is not empty.
    fn spawn(
        up: &Upstream,
        ip: &str,
        port: u16,
        script: Value,
        key: &str,
        tls_names: &[&str],
    ) -> ModelSim {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("script.json"), script.to_string()).unwrap();
        let bin = sandpit_bin().with_file_name("sandpit-modelsim");
        assert!(
            bin.exists(),
            "{} missing: cargo build -p sandpit-modelsim",
            bin.display()
        );
        let mut child = Command::new("ip")
            .args(["netns", "exec", &up.ns])
            .arg(bin)
            .args(["--listen", &format!("{ip}:{port}"), "--api-key", key])
            .arg("--script")
            .arg(dir.path().join("script.json"))
            .arg("--log")
            .arg(dir.path().join("requests.jsonl"))
            .args(if tls_names.is_empty() {
                vec![]
            } else {
                vec!["--tls-generate".into(), dir.path().display().to_string()]
            })
            .args(tls_names.iter().flat_map(|n| ["--tls-name", n]))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("listening"), "modelsim: {line}");
        let url = match tls_names.first() {
            Some(name) => {
                // It serves only what its line says: TLS, so every request it records
                // came over TLS.
                assert!(line.contains("listening on https://"), "modelsim: {line}");
                format!("https://{name}:{port}/v1")
            }
            None => format!("http://{ip}:{port}/v1"),
        };
        ModelSim { child, dir, url }
    }

    /// The PEM file of the test CA that issued a TLS model server's certificate.
    pub fn ca_file(&self) -> std::path::PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// Every request the model got so far, as its log recorded them.
    pub fn requests(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.path().join("requests.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Waits until the model has been asked at least once (a minute at most).
    pub async fn wait_asked(&self) {
        let start = Instant::now();
        while self.requests().is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the model was never asked"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for ModelSim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A daemon with networking over the upstream namespace and the harnesses bound in.
pub async fn daemon(up: &Upstream) -> Daemon {
    daemon_with(up, "").await
}

/// As [`daemon`], with more config appended.
pub async fn daemon_with(up: &Upstream, extra: &str) -> Daemon {
    let data = tempfile::Builder::new()
        .prefix("sandpit-test-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::write(
        data.path().join("config.toml"),
        format!(
            "{}[agents]\nharness_dir = {:?}\n{extra}",
            up.config(""),
            harness_dir().display().to_string()
        ),
    )
    .unwrap();
    Daemon::builder()
        .data_dir(data)
        .port(free_port())
        .start()
        .await
}

/// A raw API call with `key`: (status, JSON body or the text as a string).
pub async fn req(
    d: &Daemon,
    key: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut rb = reqwest::Client::new()
        .request(method, format!("{}{path}", d.url))
        .bearer_auth(key.trim());
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let resp = rb.send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// A raw API call with the admin key.
pub async fn api(
    d: &Daemon,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    req(d, &d.key, method, path, body).await
}

/// A host-template sandbox allowed to reach only `ip` on `ports`.
pub async fn sandbox(d: &Daemon, ip: &str, ports: &[u16]) -> String {
    let (status, sb) = api(
        d,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(json!({
            "timeout": 600,
            "limits": {"memory_bytes": 1u64 << 30},
            "network": {"mode": "allowlist", "rules": [
                {"action": "allow", "cidr": format!("{ip}/32"), "ports": ports}]},
        })),
    )
    .await;
    assert_eq!(status, 201, "{sb}");
    sb["id"].as_str().unwrap().to_string()
}

/// A `pi` runtime in `sb` asking model `m`; its id.
pub async fn runtime(d: &Daemon, sb: &str, m: &ModelSim) -> String {
    runtime_of(d, sb, "pi", json!({"base_url": m.url, "model": "modelsim"})).await
}

/// A runtime of `harness` in `sb` with model spec `model`; its id.
pub async fn runtime_of(d: &Daemon, sb: &str, harness: &str, model: Value) -> String {
    let (status, rt) = api(
        d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{sb}/agents"),
        Some(json!({"harness": harness, "model": model})),
    )
    .await;
    assert_eq!(status, 201, "{harness}: {rt}");
    assert_eq!(rt["state"], "active");
    rt["id"].as_str().unwrap().to_string()
}

/// The key file a broker test daemon encrypts its secrets with (kept while the daemon
/// runs).
pub fn broker_key_file() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("broker.key");
    std::fs::write(&key, format!("{}\n", "4f".repeat(32))).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    keys
}

/// As [`daemon`], with a broker whose key is in `keys` (from [`broker_key_file`]).
pub async fn broker_daemon(up: &Upstream, keys: &tempfile::TempDir) -> Daemon {
    let key = keys.path().join("broker.key");
    daemon_with(
        up,
        &format!("[broker]\nkey_file = {:?}\n", key.display().to_string()),
    )
    .await
}

/// Stores `value` as placeholder secret `name`, sent only with POSTs to `host` (over
/// plain HTTP too: the test model server has no certificate the sandbox trusts).
pub async fn model_secret(d: &Daemon, name: &str, value: &str, host: &str) {
    let (status, body) = api(
        d,
        reqwest::Method::POST,
        "/v1/secrets",
        Some(json!({
            "name": name, "value": value, "hosts": [host],
            "methods": ["POST"], "ttl_secs": 3600, "inject": {"type": "placeholder"},
            "allow_http": true,
        })),
    )
    .await;
    assert_eq!(status, 201, "{body}");
}

/// A host-template sandbox holding secret `secret`, allowed to reach only `domain` on
/// `port`; its id.
pub async fn sandbox_with_secret(d: &Daemon, secret: &str, domain: &str, port: u16) -> String {
    let (status, sb) = api(
        d,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(json!({
            "timeout": 600,
            "limits": {"memory_bytes": 1u64 << 30},
            "secrets": [secret],
            "network": {"mode": "allowlist", "rules": [
                {"action": "allow", "domain": domain, "ports": [port]}]},
        })),
    )
    .await;
    assert_eq!(status, 201, "{sb}");
    sb["id"].as_str().unwrap().to_string()
}

/// `/proc/PID/environ` and `/proc/PID/cmdline` files in sandbox `sb` that hold `needle`
/// (each with the process's arguments), read as the user and as root. The needle reaches the scan in two
/// halves through a file, so neither the scanning shell nor grep holds it whole.
pub async fn procs_holding(d: &Daemon, sb: &str, needle: &str) -> Vec<String> {
    assert!(
        needle.len() >= 4
            && needle
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "a plain needle: {needle}"
    );
    let (a, b) = needle.split_at(needle.len() / 2);
    let script = format!(
        "a='{a}'; b='{b}'; f=$(mktemp); printf '%s%s' \"$a\" \"$b\" > \"$f\"
for p in /proc/[0-9]*; do
  [ \"${{p#/proc/}}\" = \"$$\" ] && continue
  for k in environ cmdline; do
    if grep -qaF -f \"$f\" \"$p/$k\" 2>/dev/null; then
      echo \"$p/$k: $(tr '\\0' ' ' < \"$p/cmdline\" 2>/dev/null | cut -c1-160)\"
    fi
  done
done
rm -f \"$f\""
    );
    // Root in the sandbox may not read the user's processes (no CAP_SYS_PTRACE) and the
    // user not root's, so both look.
    let c = d.client();
    let mut found = std::collections::BTreeSet::new();
    for out in [sh(&c, sb, &script).await, sh_root(&c, sb, &script).await] {
        assert_eq!(out.exit_code, 0, "{out:?}");
        found.extend(out.stdout.lines().map(String::from));
    }
    found.into_iter().collect()
}

/// Starts a run of runtime `rt` with `body` (at least a `task`) and returns its id; the
/// start must be a `201`.
pub async fn start_run(d: &Daemon, rt: &str, body: Value) -> String {
    let path = format!("/v1/agents/{rt}/runs");
    let (status, run) = api(d, reqwest::Method::POST, &path, Some(body)).await;
    assert_eq!(status, 201, "{run}");
    run["id"].as_str().unwrap().to_string()
}

/// Waits (a minute at most) until a process of sandbox `sb` whose line holds `needle` runs:
/// the model's tool call reached the sandbox. What the model was asked is shown if not.
pub async fn wait_tool_running(d: &Daemon, sb: &str, needle: &str, m: &ModelSim) {
    let start = Instant::now();
    while !harness_processes(d, sb)
        .await
        .iter()
        .any(|l| l.contains(needle))
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the tool never started: {:#?}",
            m.requests()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until run `run` is finished (at most `within`); the run.
pub async fn wait_final(d: &Daemon, run: &str, within: Duration) -> Value {
    let start = Instant::now();
    loop {
        let (status, r) = api(d, reqwest::Method::GET, &format!("/v1/runs/{run}"), None).await;
        assert_eq!(status, 200, "{r}");
        if ["succeeded", "failed", "cancelled", "timed_out"].contains(&r["state"].as_str().unwrap())
        {
            return r;
        }
        assert!(start.elapsed() < within, "run still {}: {r}", r["state"]);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The stored events of `run` after `after` (one page of up to 1000).
pub async fn all_events(d: &Daemon, run: &str, after: i64) -> Vec<Value> {
    let (status, page) = api(
        d,
        reqwest::Method::GET,
        &format!("/v1/runs/{run}/events?after={after}&limit=1000"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{page}");
    page["events"].as_array().unwrap().clone()
}

/// The sequence numbers of events.
pub fn seqs(events: &[Value]) -> Vec<i64> {
    events.iter().map(|e| e["seq"].as_i64().unwrap()).collect()
}

/// Processes in the sandbox that belong to a harness (node running pi or Codex, the
/// Claude Code and Codex binaries, anything started from the harness mount) or to the
/// tests' long-running tool (`sleep 300`).
pub async fn harness_processes(d: &Daemon, sb: &str) -> Vec<String> {
    let out = sh(&d.client(), sb, "ps -eo pid,args").await;
    out.stdout
        .lines()
        .filter(|l| {
            [
                "node",
                "pi-coding-agent",
                "/opt/sandpit/harnesses",
                "claude",
                "codex",
                "sleep 300",
            ]
            .iter()
            .any(|n| l.contains(n))
        })
        .filter(|l| !l.contains("ps -eo"))
        .map(String::from)
        .collect()
}

/// Past a slow model's held answer, run `id` is still cancelled and its log is whole
/// (1..N) and ends with `end` saying so.
pub async fn assert_cancelled_for_good(d: &Daemon, id: &str) {
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (_, now) = api(d, reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await;
    assert_eq!(now["state"], "cancelled", "{now}");
    let events = all_events(d, id, 0).await;
    let n = events.len() as i64;
    assert_eq!(seqs(&events), (1..=n).collect::<Vec<_>>());
    let last = events.last().unwrap();
    assert_eq!(last["kind"], "end");
    assert_eq!(last["payload"]["state"], "cancelled", "{last}");
}

/// As [`broker_daemon`], its broker also trusting upstream certificates issued by the CA
/// in PEM file `ca` (a TLS model server's test CA).
pub async fn broker_daemon_trusting(
    up: &Upstream,
    keys: &tempfile::TempDir,
    ca: &std::path::Path,
) -> Daemon {
    let key = keys.path().join("broker.key");
    daemon_with(
        up,
        &format!(
            "[broker]\nkey_file = {:?}\nextra_ca_file = {:?}\n",
            key.display().to_string(),
            ca.display().to_string()
        ),
    )
    .await
}

/// What differs between the harnesses when a test drives each of them alike.
#[derive(Debug, Clone, Copy)]
pub struct Harness {
    /// The runtime's `harness`.
    pub name: &'static str,
    /// Appended to `SCHEME://HOST:PORT` for the model's base URL (Claude Code adds `/v1`
    /// itself).
    pub base_path: &'static str,
}

/// pi (Chat Completions).
pub const PI: Harness = Harness {
    name: "pi",
    base_path: "/v1",
};
/// Claude Code (Anthropic Messages).
pub const CLAUDE: Harness = Harness {
    name: "claude",
    base_path: "",
};
/// Codex (OpenAI Responses).
pub const CODEX: Harness = Harness {
    name: "codex",
    base_path: "/v1",
};
/// opencode (Chat Completions through its `serve` bridge).
pub const OPENCODE: Harness = Harness {
    name: "opencode",
    base_path: "/v1",
};

/// A script turn calling the shell tool of whichever harness asks (pi/opencode `bash`,
/// Claude Code `Bash`, Codex `exec_command`) with `command`.
pub fn shell_turn(command: &str) -> Value {
    json!({"tool_calls": [{"any_of": [
        {"name": "Bash", "arguments": {"command": command}},
        {"name": "bash", "arguments": {"command": command}},
        {"name": "exec_command", "arguments": {"cmd": command}}]}]})
}

/// Whether a recorded request is a model call (not Claude Code's `HEAD /`, not a side
/// request such as opencode's title).
pub fn is_model_call(r: &Value) -> bool {
    r["method"] == "POST"
        && r["path"].as_str().is_some_and(|p| {
            p.ends_with("/messages")
                || p.ends_with("/responses")
                || p.ends_with("/chat/completions")
        })
        && r["side"] != true
}

/// The key a model request carried (Claude Code: `x-api-key`; pi, Codex, opencode: a
/// bearer token).
pub fn key_of(r: &Value) -> Option<&str> {
    let h = &r["headers"];
    h["x-api-key"]
        .as_str()
        .or_else(|| h["authorization"].as_str()?.strip_prefix("Bearer "))
}

/// Starts a run of `rt` with idempotency key `key` twice: the first is a `201`, the
/// retry a `200` with the same run; a start with another key while it is active is a
/// `409`; and the store holds that one run only. The run's id.
pub async fn start_once_then_conflict(d: &Daemon, rt: &str, key: &str) -> String {
    let path = format!("/v1/agents/{rt}/runs");
    let start = json!({"task": "run a command, then think", "idempotency_key": key});
    let (status, run) = api(d, reqwest::Method::POST, &path, Some(start.clone())).await;
    assert_eq!(status, 201, "{run}");
    let id = run["id"].as_str().unwrap().to_string();
    let (status, again) = api(d, reqwest::Method::POST, &path, Some(start)).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["id"], id.as_str(), "{again}");
    let (status, other) = api(
        d,
        reqwest::Method::POST,
        &path,
        Some(json!({"task": "other", "idempotency_key": format!("{key}-other")})),
    )
    .await;
    assert_eq!(status, 409, "{other}");
    let runs = d.store().await.list_runs(rt).await.unwrap();
    assert_eq!(
        runs.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        [id.as_str()],
        "one run only"
    );
    id
}

/// Waits (two minutes at most) until run `id` has stored a `tool_result` and model `m`
/// has been asked for turn `turn` (which it holds): the run is mid-stream. Its events
/// then.
pub async fn wait_mid_stream(d: &Daemon, id: &str, m: &ModelSim, turn: u64) -> Vec<Value> {
    let start = Instant::now();
    loop {
        let asked = m.requests().iter().any(|r| r["turn"] == turn);
        let events = all_events(d, id, 0).await;
        if asked && events.iter().any(|e| e["kind"] == "tool_result") {
            return events;
        }
        let (_, now) = api(d, reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await;
        assert!(
            start.elapsed() < Duration::from_secs(120)
                && ["queued", "running"].contains(&now["state"].as_str().unwrap_or_default()),
            "never mid-stream: {now}\n{events:#?}\n{:#?}",
            m.requests()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Kills daemon `d` (SIGKILL, as a crash would) while run `id` of sandbox `sb` is active
/// with `before` stored, and starts it again on the same data directory: the run is
/// `failed` because the daemon restarted, no harness process is left, and its log is
/// `before` unchanged followed by `end` alone, numbered without a gap. The new daemon.
pub async fn restart_keeps_stored_events(
    mut d: Daemon,
    sb: &str,
    id: &str,
    before: &[Value],
) -> Daemon {
    assert!(!before.is_empty());
    d.kill9();
    let d = d.restart().start().await;
    let (status, now) = api(&d, reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await;
    assert_eq!(status, 200, "{now}");
    assert_eq!(now["state"], "failed", "{now}");
    assert!(
        now["reason"]
            .as_str()
            .is_some_and(|r| r.contains("daemon restarted")),
        "{now}"
    );
    // Killed at the start; a killed process may show `<defunct>` until PID 1 reaps it.
    let start = Instant::now();
    loop {
        let left = harness_processes(&d, sb).await;
        if left.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "left in the sandbox: {left:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = all_events(&d, id, 0).await;
    let n = after.len() as i64;
    assert_eq!(seqs(&after), (1..=n).collect::<Vec<_>>(), "{after:#?}");
    assert!(after.len() > before.len(), "no end event: {after:#?}");
    // Every event stored before the restart is there as it was (seq, kind, payload).
    assert_eq!(&after[..before.len()], before);
    let last = after.last().unwrap();
    assert_eq!(last["kind"], "end", "{last}");
    assert_eq!(last["payload"]["state"], "failed", "{last}");
    assert_eq!(now["events"].as_i64(), Some(n), "{now}");
    d
}
