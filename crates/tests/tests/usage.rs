//! Usage metering against a real daemon and real sandboxes: active time without paused
//! time, sampled counters, the usage log, and execution records of commands.

use sandpit_api::usage::Execution;
use sandpit_api::{CommandEvent, LimitsSpec, RunCommandRequest};
use sandpit_client::Client;
use sandpit_tests::{Daemon, command, sh};
use std::time::Duration;

/// 300,000 iterations of a shell loop: a few hundred milliseconds of CPU.
const SPIN: &str = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done";

/// The newest `n` execution records of a sandbox, once that many have ended (records are
/// written in the background after a command ends).
async fn ended_executions(c: &Client, id: &str, n: usize) -> Vec<Execution> {
    for _ in 0..200 {
        let list = c.executions(id, Some(1000), None).await.unwrap();
        let ended: Vec<Execution> = list
            .items
            .into_iter()
            .filter(|e| e.timestamp.ended_ms.is_some())
            .collect();
        if ended.len() >= n {
            return ended;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("fewer than {n} execution records of {id}");
}

#[tokio::test]
async fn metering_excludes_paused_time() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    // Some work: a fixed amount of CPU (not a time: the machine may be busy), and 8 MiB
    // in the writable layer.
    sh(
        &c,
        &id,
        &format!("head -c 8388608 /dev/urandom > /home/user/blob; {SPIN}"),
    )
    .await;
    c.pause(&id).await.unwrap();
    const PAUSED_SECS: f64 = 3.0;
    tokio::time::sleep(Duration::from_secs_f64(PAUSED_SECS)).await;
    c.resume(&id).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let u = c.sandbox_usage(&id).await.unwrap();
    assert_eq!(u.sandbox_id, id);
    assert_eq!(u.owner, "admin");
    assert_eq!(u.state, "running");
    assert!(u.active_seconds > 0.0, "{u:?}");
    // The pause lasted at least PAUSED_SECS between the two recorded changes.
    assert!(
        u.active_seconds < u.wall_seconds - PAUSED_SECS + 0.25,
        "{u:?}"
    );
    assert!(u.cpu_time_ms >= 20, "{u:?}");
    assert!(u.memory_peak_bytes > 8 << 20, "{u:?}");
    let disk = u
        .disk_used_bytes
        .expect("container sandboxes report disk use");
    assert!((8 << 20..(64 << 20)).contains(&disk), "{u:?}");
    assert_eq!(u.egress_bytes, 0);
    assert_eq!(u.egress_note, sandpit_api::usage::EGRESS_NOTE);
    assert!(u.executions >= 1);

    // The owner's summary for a period covering the sandbox says the same.
    let s = c.usage(Some(u.created_at_ms), None, None).await.unwrap();
    assert_eq!(s.owner, "admin");
    assert_eq!(s.sandboxes, 1);
    assert!(s.active_seconds > 0.0);
    assert!(
        s.active_seconds < u.wall_seconds - PAUSED_SECS + 1.0,
        "{s:?}"
    );
    assert!(s.cpu_time_ms >= 20, "{s:?}");
    assert!(s.executions >= 1);
    assert!(
        s.log
            .get("cpu")
            .is_some_and(|t| t.count >= 1 && t.amount > 0),
        "{s:?}"
    );
    // A period before the sandbox existed is empty.
    let before = c
        .usage(Some(0), Some(u.created_at_ms - 1), None)
        .await
        .unwrap();
    assert_eq!((before.sandboxes, before.executions), (0, 0));
    assert_eq!(before.active_seconds, 0.0);

    // Usage outlives the sandbox, and stops growing with it.
    c.delete_sandbox(&id).await.unwrap();
    let mut after = c.sandbox_usage(&id).await.unwrap();
    for _ in 0..100 {
        if after.ended_at_ms.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        after = c.sandbox_usage(&id).await.unwrap();
    }
    let ended = after.ended_at_ms.expect("ended");
    assert!(ended >= u.created_at_ms);
    assert!(after.active_seconds >= u.active_seconds);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = c.sandbox_usage(&id).await.unwrap();
    assert_eq!(later.active_seconds, after.active_seconds);
    assert_eq!(later.cpu_time_ms, after.cpu_time_ms);
    d.shutdown().await;
}

#[tokio::test]
async fn execution_records_count_cpu_memory_and_every_output_byte() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    // Its own work is small; most of the CPU is a background child, killed (not waited
    // for) and collected by the agent as an orphan of the command's session.
    let script = "head -c 3000000 /dev/zero | wc -c; yes > /dev/null & sleep 0.3; kill %1";
    let out = c.run(&id, &command(&["bash", "-c", script])).await.unwrap();
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, "3000000\n"));
    let e = &ended_executions(&c, &id, 1).await[0];
    assert_eq!(e.sandbox_id, id);
    assert!(e.execution_id.starts_with("ex_"));
    assert_eq!(e.command, "bash");
    assert_eq!(e.caller.owner, "admin");
    assert!(e.caller.api_key_id.is_some(), "{e:?}");
    assert_eq!(e.pid, Some(out.pid));
    assert!(!e.background);
    let cpu = e.resources.cpu_time_ms.expect("cpu time");
    assert!(cpu > 0, "{e:?}");
    let mem = e.resources.memory_peak_mb.expect("memory peak");
    assert!(mem >= 1, "{e:?}");
    assert_eq!(e.resources.network_egress_kb, 0);
    assert_eq!(e.output.stdout_bytes, 8);
    assert_eq!(e.output.stderr_bytes, 0);
    assert_eq!(e.output.exit_code, Some(0));
    assert!(!e.output.timed_out);
    let t = &e.timestamp;
    let (started, ended) = (t.started_ms.unwrap(), t.ended_ms.unwrap());
    assert!(t.created_ms <= started && started <= ended, "{t:?}");
    // The agent counted two processes for it: bash, and `yes`, which bash did not wait
    // for (it was collected by the agent as an orphan of the command's session).
    let agent = sandpit_tests::http()
        .get(format!(
            "{}/v1/sandboxes/{id}/agent/rusage?pid={}",
            d.url, out.pid
        ))
        .bearer_auth(&d.key)
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = agent.json().await.unwrap();
    assert_eq!(v["processes"], 2, "{v}");
    assert_eq!((v["cpu_time_us"].as_u64().unwrap() + 500) / 1000, cpu);
    // A fixed amount of work in the command's own shell is counted in full.
    let spin = c.run(&id, &command(&["sh", "-c", SPIN])).await;
    assert_eq!(spin.unwrap().exit_code, 0);
    let spun = &ended_executions(&c, &id, 2).await[0];
    assert!(spun.resources.cpu_time_ms.unwrap() >= 20, "{spun:?}");

    // Over the WebSocket: output sizes on both streams and the exit code.
    let s = c
        .stream_command(
            &id,
            &command(&["sh", "-c", "printf abc; printf de >&2; exit 3"]),
        )
        .await
        .unwrap();
    let (o, err, code) = s.collect().await.unwrap();
    assert_eq!(
        (o.as_slice(), err.as_slice(), code),
        (&b"abc"[..], &b"de"[..], 3)
    );
    // Every byte is counted, also beyond what the response returns.
    let big = RunCommandRequest {
        max_output_bytes: Some(1000),
        ..command(&["head", "-c", "2000000", "/dev/zero"])
    };
    let out = c.run(&id, &big).await.unwrap();
    assert!(out.truncated);
    // A command killed by its timeout.
    let slow = RunCommandRequest {
        timeout_ms: Some(300),
        ..command(&["sleep", "30"])
    };
    let out = c.run(&id, &slow).await.unwrap();
    assert!(out.timed_out);
    let all = ended_executions(&c, &id, 5).await;
    // Newest first.
    let by_cmd = |name: &str| all.iter().find(|e| e.command == name).unwrap().clone();
    assert_eq!(all[0].command, "sleep");
    let ws = by_cmd("sh");
    assert_eq!((ws.output.stdout_bytes, ws.output.stderr_bytes), (3, 2));
    assert_eq!(ws.output.exit_code, Some(3));
    let head = by_cmd("head");
    assert_eq!(head.output.stdout_bytes, 2_000_000);
    let sleep = by_cmd("sleep");
    assert!(sleep.output.timed_out);
    assert_eq!(sleep.output.exit_code, Some(137));

    // A background command is recorded when it starts.
    let bg = c
        .run_background(&id, &command(&["sleep", "1"]))
        .await
        .unwrap();
    let mut found = None;
    for _ in 0..100 {
        let list = c.executions(&id, None, None).await.unwrap();
        found = list.items.into_iter().find(|e| e.pid == Some(bg.pid));
        if found.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let found = found.expect("background record");
    assert!(found.background && found.timestamp.started_ms.is_some());

    // Pages, newest first, each record once.
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = c.executions(&id, Some(2), cursor.as_deref()).await.unwrap();
        assert!(page.items.len() <= 2);
        seen.extend(page.items.into_iter().map(|e| e.execution_id));
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(seen.len(), 6, "{seen:?}");
    let mut unique = seen.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 6);

    // The usage log has them by reason, with file operations and keep-alives.
    c.write_file(&id, "/home/user/x", "hi").await.unwrap();
    c.stat(&id, "/home/user/x").await.unwrap();
    c.keepalive(&id).await.unwrap();
    let s = c.usage(None, None, None).await.unwrap();
    assert!(s.executions >= 6, "{s:?}");
    let count = |reason: &str| s.log.get(reason).map(|t| t.count).unwrap_or(0);
    assert!(count("command") >= 6, "{s:?}");
    assert!(count("file") >= 2, "{s:?}");
    assert_eq!(count("keepalive"), 1, "{s:?}");
    d.shutdown().await;
}

#[tokio::test]
async fn usage_is_private_and_queries_are_checked() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    sh(&c, &id, "true").await;
    ended_executions(&c, &id, 1).await;
    let m = d.owner("mallory").await;
    let err = m.sandbox_usage(&id).await.unwrap_err();
    assert!(err.is_sandbox_gone(), "{err:?}");
    let err = m.executions(&id, None, None).await.unwrap_err();
    assert!(err.is_sandbox_gone(), "{err:?}");
    assert_eq!(
        m.usage(None, None, Some("admin"))
            .await
            .unwrap_err()
            .status(),
        Some(403)
    );
    let mine = m.usage(None, None, None).await.unwrap();
    assert_eq!(
        (mine.owner.as_str(), mine.sandboxes, mine.executions),
        ("mallory", 0, 0)
    );
    // The admin may read anyone's.
    let theirs = c.usage(None, None, Some("mallory")).await.unwrap();
    assert_eq!(theirs.owner, "mallory");
    // A period that ends before it begins is empty, not an error.
    let empty = c.usage(Some(10), Some(5), None).await.unwrap();
    assert_eq!(
        (
            empty.from_ms,
            empty.to_ms,
            empty.sandboxes,
            empty.executions
        ),
        (10, 10, 0, 0)
    );
    assert_eq!(
        c.usage(Some(-1), None, None).await.unwrap_err().status(),
        Some(400)
    );
    let err = c
        .executions(&id, None, Some("not-a-cursor"))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400));
    assert!(
        c.sandbox_usage("no-such-sandbox")
            .await
            .unwrap_err()
            .is_sandbox_gone()
    );
    let raw = sandpit_tests::http()
        .get(format!("{}/v1/usage?from=abc", d.url))
        .bearer_auth(&d.key)
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400);
    d.shutdown().await;
}

#[tokio::test]
async fn the_agents_usage_route_does_not_change_the_e2b_protocol() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    // Commands through the stream report the same events as before: start, output, end.
    let mut s = c
        .stream_command(&id, &command(&["sh", "-c", "echo hi"]))
        .await
        .unwrap();
    let mut kinds = Vec::new();
    while let Some(ev) = s.next_event().await.unwrap() {
        kinds.push(match ev {
            CommandEvent::Start { .. } => "start",
            CommandEvent::Stdout { .. } => "stdout",
            CommandEvent::End { .. } => "end",
            other => panic!("unexpected {other:?}"),
        });
    }
    assert_eq!(kinds, ["start", "stdout", "end"]);
    // The usage is a route of its own on the agent, for pids of commands only.
    let out = c.run(&id, &command(&["true"])).await.unwrap();
    let http = sandpit_tests::http();
    let get = |pid: u32| {
        http.get(format!(
            "{}/v1/sandboxes/{id}/agent/rusage?pid={pid}",
            d.url
        ))
        .bearer_auth(&d.key)
        .send()
    };
    let r = get(out.pid).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["pid"], out.pid);
    assert!(v["processes"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(get(999_999).await.unwrap().status().as_u16(), 404);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_shows_usage_and_executions() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    c.run(&id, &command(&["sh", "-c", "printf hello"]))
        .await
        .unwrap();
    ended_executions(&c, &id, 1).await;
    let (ok, table, err) = d.cli(&["executions", &id]);
    assert!(ok, "{err}");
    let mut lines = table.lines();
    assert!(lines.next().unwrap().starts_with("EXECUTION"), "{table}");
    let row = lines.next().unwrap();
    assert!(
        row.starts_with("ex_") && row.contains(" sh ") && row.contains("5 B"),
        "{table}"
    );
    let (ok, json, _) = d.cli(&["--json", "executions", &id]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["items"][0]["output"]["stdout_bytes"], 5);
    let (ok, json, err) = d.cli(&["--json", "usage", "--from", "1h"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["owner"], "admin");
    assert_eq!(v["sandboxes"], 1);
    assert_eq!(v["executions"], 1);
    let (ok, table, _) = d.cli(&["usage", &id]);
    assert!(ok);
    assert!(table.contains(sandpit_api::usage::EGRESS_NOTE), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("executions") && l.ends_with('1')),
        "{table}"
    );
    let (ok, _, err) = d.cli(&["usage", "--from", "yesterday"]);
    assert!(!ok);
    assert!(err.contains("yesterday"), "{err}");
    let (ok, _, err) = d.cli(&["executions", "no-such-sandbox"]);
    assert!(!ok);
    assert!(err.contains("not found"), "{err}");
    d.shutdown().await;
}
