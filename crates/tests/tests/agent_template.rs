//! A template with the harnesses inside (`scripts/build-agent-template.sh`): built from a
//! small base root filesystem and the already-installed `.deps/harnesses` (`--from`, no
//! npm), its sandboxes run pi from the template itself. The daemon's own harness directory
//! is an empty one, so nothing can come from the host bind. The model is `sandpit-modelsim`
//! in a test namespace; nothing leaves the machine.

use sandpit_tests::agents::{
    ModelSim, all_events, api, harness_dir, runtime, seqs, start_run, wait_final,
};
use sandpit_tests::netfix::Upstream;
use sandpit_tests::{
    Daemon, build_ready, dir_build, free_port, rootfs_with_programs, sandpit_bin, sh, temp_dir,
};
use serde_json::json;
use std::path::Path;
use std::time::Duration;

/// The base the script starts from: a shell, bash (pi's `bash` tool), `env` (the
/// harnesses' `#!/usr/bin/env node`) and what the daemon's file writes use.
fn base_rootfs(dir: &Path) {
    rootfs_with_programs(
        dir,
        &[
            ("/bin/dash", "usr/bin/sh"),
            ("/bin/bash", "usr/bin/bash"),
            ("/usr/bin/env", "usr/bin/env"),
            ("/bin/cat", "usr/bin/cat"),
            ("/bin/mkdir", "usr/bin/mkdir"),
            ("/usr/bin/dirname", "usr/bin/dirname"),
            ("/bin/chmod", "usr/bin/chmod"),
        ],
    );
    std::fs::create_dir_all(dir.join("etc")).unwrap();
}

/// A sandbox of `template` allowed to reach only `ip:port`.
async fn sandbox_of(d: &sandpit_tests::Daemon, template: &str, ip: &str, port: u16) -> String {
    let (status, sb) = api(
        d,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(json!({
            "template": template,
            "timeout": 600,
            "limits": {"memory_bytes": 1u64 << 30},
            "network": {"mode": "allowlist", "rules": [
                {"action": "allow", "cidr": format!("{ip}/32"), "ports": [port]}]},
        })),
    )
    .await;
    assert_eq!(status, 201, "{sb}");
    sb["id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_built_with_the_harnesses_runs_pi_without_the_host_bind() {
    let up = Upstream::start(&[]);
    let ip = up.ip(11);
    let m = ModelSim::start(
        &up,
        &ip,
        8090,
        json!({"turns": [
            {"text": "Writing the file.", "tool_calls": [
                {"name": "write", "arguments": {"path": "hello.txt", "content": "from the template\n"}}]},
            {"tool_calls": [{"name": "bash", "arguments": {"command": "cat hello.txt > copy.txt"}}]},
            {"text": "done"}
        ]}),
    );
    // An empty harness directory: a run that used the host bind would find no pi.
    let empty = temp_dir("sandpit-no-harnesses-");
    let data = tempfile::Builder::new()
        .prefix("sandpit-test-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::write(
        data.path().join("config.toml"),
        format!(
            "{}[agents]\nharness_dir = {:?}\n",
            up.config(""),
            empty.path().display().to_string()
        ),
    )
    .unwrap();
    let d = Daemon::builder()
        .data_dir(data)
        .port(free_port())
        .start()
        .await;
    let c = d.client();
    let base = temp_dir("sandpit-agent-base-");
    base_rootfs(base.path());

    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-agent-template.sh");
    let out = tokio::process::Command::new(&script)
        .args(["agents-test", "--harnesses", "pi", "--from"])
        .arg(harness_dir())
        .arg("--base")
        .arg(base.path())
        .arg("--sandpit")
        .arg(sandpit_bin())
        .env("SANDPIT_URL", &d.url)
        .env("SANDPIT_API_KEY", d.key.trim())
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let (status, t) = api(&d, reqwest::Method::GET, "/v1/templates/agents-test", None).await;
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["state"], "ready", "{t}");
    // The script's staging directory is gone.
    let left: Vec<_> = std::fs::read_dir("/var/tmp")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("sandpit-agent-template."))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    let sb = sandbox_of(&d, "agents-test", &ip, 8090).await;
    let rt = runtime(&d, &sb, &m).await;
    let id = start_run(&d, &rt, json!({"task": "write hello.txt"})).await;
    let done = wait_final(&d, &id, Duration::from_secs(120)).await;
    let events = all_events(&d, &id, 0).await;
    assert_eq!(done["state"], "succeeded", "{done}\n{events:#?}");
    let n = events.len() as i64;
    assert_eq!(seqs(&events), (1..=n).collect::<Vec<_>>());
    assert_eq!(
        sh(&c, &sb, "cat /home/user/hello.txt /home/user/copy.txt")
            .await
            .stdout,
        "from the template\nfrom the template\n"
    );
    // pi ran from the template's own tree, not from a host mount.
    assert!(
        sh(
            &c,
            &sb,
            "test -d /opt/sandpit/harnesses/node_modules || echo none"
        )
        .await
        .stdout
        .contains("none")
    );
    assert!(m.requests().len() >= 3, "{:#?}", m.requests());

    // A template without the harness is refused with a pointer to the script.
    build_ready(&c, &dir_build("plain-test", base.path())).await;
    let plain = sandbox_of(&d, "plain-test", &ip, 8090).await;
    let (status, body) = api(
        &d,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{plain}/agents"),
        Some(json!({"harness": "pi", "model": {"base_url": m.url, "model": "modelsim"}})),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("build-agent-template"), "{body}");

    for s in [&sb, &plain] {
        let (status, _) = api(
            &d,
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{s}"),
            None,
        )
        .await;
        assert_eq!(status, 204);
    }
    // The deleted sandboxes' teardowns end in the background; until then the templates
    // are in use (409).
    for t in ["agents-test", "plain-test"] {
        let start = std::time::Instant::now();
        loop {
            match c.delete_template(t).await {
                Ok(()) => break,
                Err(e) if e.status() == Some(409) && start.elapsed() < Duration::from_secs(30) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("delete template {t}: {e}"),
            }
        }
    }
    d.shutdown().await;
}
