//! Slow and idle clients on the daemon's HTTP listener (`[http]` in the config file): heads
//! that never finish are cut at the header timeout, connections over the per-address and
//! total caps are refused at once, the daemon's descriptors stay bounded and other clients
//! and the sandboxes keep working; idle keep-alive connections are closed after the idle
//! timeout while silent requests and streams on other connections run on past it.

use base64::Engine;
use sandpit_api::{CommandEvent, CreateSandboxRequest};
use sandpit_tests::{
    Daemon, bash, connect_envelope, connect_from, http_from, open_fds, port_host, sh,
};
use std::future::Future;
use std::net::Ipv4Addr;
use std::pin::pin;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const HEADER_SECS: u64 = 4;
const IDLE_SECS: u64 = 6;
const PER_IP: usize = 50;
const TOTAL: usize = 100;
/// Time allowed beyond a timeout for the daemon to act on it.
const SLACK: Duration = Duration::from_secs(6);

/// A daemon with the `[http]` timeouts and caps above.
async fn daemon() -> Daemon {
    Daemon::builder()
        .config_file(&format!(
            "[http]\nheader_read_timeout_secs = {HEADER_SECS}\nidle_timeout_secs = {IDLE_SECS}\n\
             max_connections = {TOTAL}\nmax_connections_per_ip = {PER_IP}\n"
        ))
        .start()
        .await
}

/// Runs `f` while sampling the daemon's open descriptors; returns its output and the most
/// descriptors seen.
async fn max_fds_during<T>(pid: u32, f: impl Future<Output = T>) -> (T, usize) {
    let mut f = pin!(f);
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut max = 0;
    loop {
        tokio::select! {
            r = &mut f => return (r, max.max(open_fds(pid))),
            _ = tick.tick() => max = max.max(open_fds(pid)),
        }
    }
}

/// How a connection with a partial head ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Closed (503 or not) before the header timeout could apply: over a cap.
    Refused,
    /// Closed by the daemon after the header timeout.
    Cut,
    /// Still open at the end of the wait.
    Open,
}

/// Opens a connection from `from`, sends part of a head and never finishes it, and
/// reports how it ended (waiting up to `limit`).
async fn slow_head(port: u16, from: Ipv4Addr, limit: Duration) -> (End, bool) {
    let mut s = connect_from(port, from).await.unwrap();
    let opened = Instant::now();
    // Refused connections may already be closed; the write may fail then.
    let _ = s
        .write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        .await;
    let mut got = Vec::new();
    let mut chunk = [0u8; 512];
    let end = loop {
        match tokio::time::timeout_at(opened + limit, s.read(&mut chunk)).await {
            Err(_) => break End::Open,
            Ok(Ok(0)) | Ok(Err(_)) => {
                break if opened.elapsed() < Duration::from_secs(HEADER_SECS) / 2 {
                    End::Refused
                } else {
                    End::Cut
                };
            }
            Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
        }
    };
    let busy = got.starts_with(b"HTTP/1.1 503 ");
    // A 503 is only ever the cap's answer.
    (if busy { End::Refused } else { end }, busy)
}

/// `n` slow heads from each address, opened at once; returns how they ended.
async fn flood(port: u16, from: Vec<Ipv4Addr>, n: usize) -> Vec<(End, bool)> {
    let limit = Duration::from_secs(HEADER_SECS) + SLACK;
    let mut tasks = Vec::new();
    for ip in from {
        for _ in 0..n {
            tasks.push(tokio::spawn(slow_head(port, ip, limit)));
            // Paced a little so the flood stays well within the header timeout and the
            // accept backlog.
            if tasks.len() % 25 == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn count(ends: &[(End, bool)], which: End) -> usize {
    ends.iter().filter(|(e, _)| *e == which).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_are_capped_and_cut_and_others_keep_working() {
    let d = daemon().await;
    let c = d.client();
    let id = d.sandbox(Default::default()).await;
    assert_eq!(sh(&c, &id, "echo ready").await.stdout, "ready\n");
    let pid = d.pid();
    let port = d.port;
    let baseline = open_fds(pid);
    let lo1 = Ipv4Addr::new(127, 0, 0, 1);
    let lo2 = Ipv4Addr::new(127, 0, 0, 2);

    // 300 slow heads from one address; meanwhile another address is served.
    let other = async {
        // Let the flood fill the per-address cap first.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let (full, _) = slow_head(port, lo1, Duration::from_secs(HEADER_SECS) + SLACK).await;
        let h = http_from(lo2);
        let auth = format!("Bearer {}", d.key);
        let r = h
            .get(format!("{}/v1/sandboxes/{id}", d.url))
            .header("authorization", &auth)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["state"], "running", "{v}");
        let r = h
            .post(format!("{}/v1/sandboxes/{id}/commands", d.url))
            .header("authorization", &auth)
            .json(&serde_json::json!({"argv": ["echo", "alive"]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(
            (v["exit_code"].as_i64(), v["stdout"].as_str()),
            (Some(0), Some("alive\n")),
            "{v}"
        );
        full
    };
    let ((ends, late), max) = max_fds_during(pid, async {
        tokio::join!(flood(port, vec![lo1], 300), other)
    })
    .await;
    eprintln!(
        "per-address flood: refused {} ({} with a 503), cut {}, open {}; fds {baseline} -> max {max}",
        count(&ends, End::Refused),
        ends.iter().filter(|(_, busy)| *busy).count(),
        count(&ends, End::Cut),
        count(&ends, End::Open)
    );
    assert_eq!(count(&ends, End::Open), 0, "slow heads left open");
    assert!(count(&ends, End::Refused) >= 300 - PER_IP, "{ends:?}");
    assert!(count(&ends, End::Cut) <= PER_IP, "{ends:?}");
    assert!(
        count(&ends, End::Cut) >= PER_IP / 2,
        "few were admitted: {ends:?}"
    );
    assert_eq!(late, End::Refused, "the address was over its cap");
    assert!(
        max <= baseline + PER_IP + 40,
        "descriptors grew from {baseline} to {max}"
    );

    // Spread over five addresses, each under its own cap: the total cap holds.
    let many: Vec<Ipv4Addr> = (3..8).map(|i| Ipv4Addr::new(127, 0, 0, i)).collect();
    let (ends, max) = max_fds_during(pid, flood(port, many, 40)).await;
    eprintln!(
        "total flood: refused {}, cut {}, open {}; fds {baseline} -> max {max}",
        count(&ends, End::Refused),
        count(&ends, End::Cut),
        count(&ends, End::Open)
    );
    assert_eq!(count(&ends, End::Open), 0, "slow heads left open");
    assert!(count(&ends, End::Refused) >= 200 - TOTAL, "{ends:?}");
    assert!(count(&ends, End::Cut) <= TOTAL, "{ends:?}");
    assert!(
        max <= baseline + TOTAL + 40,
        "descriptors grew from {baseline} to {max}"
    );

    // Afterwards everything is as before, from the first address too.
    let s = c.get_sandbox(&id).await.unwrap();
    assert_eq!(s.state, "running");
    assert_eq!(sh(&c, &id, "echo still-here").await.stdout, "still-here\n");
    d.shutdown().await;
}

/// The stdout of a Connect stream of envd's `process.Process/Start`.
fn connect_stdout(mut body: &[u8]) -> String {
    let mut out = Vec::new();
    while body.len() >= 5 {
        let n = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        let m: serde_json::Value = serde_json::from_slice(&body[5..5 + n]).unwrap();
        if let Some(s) = m["event"]["data"]["stdout"].as_str() {
            out.extend(base64::engine::general_purpose::STANDARD.decode(s).unwrap());
        }
        body = &body[5 + n..];
    }
    String::from_utf8(out).unwrap()
}

/// Sends a GET of `/v1/health` on `s` and reads the whole answer.
async fn health_on(s: &mut TcpStream) {
    s.write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 1024];
    while !String::from_utf8_lossy(&got).ends_with("\"ok\"}") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
            .await
            .expect("an answer in time")
            .unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&chunk[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200 "));
}

/// Waits for the daemon to close `s`; returns how long that took.
async fn closed_after(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut chunk = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(start + limit, s.read(&mut chunk)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_close_while_silent_streams_run_on() {
    let d = daemon().await;
    let c = d.client();
    let sb = c
        .create_sandbox(&CreateSandboxRequest {
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = sb.id.clone();
    let token = sb.envd_access_token.clone().unwrap();
    // Silent for longer than the idle timeout (and the header timeout), then one line.
    let script = format!("sleep {}; echo done", IDLE_SECS + 4);
    let cmd = bash(&script);

    // A request whose answer comes only at the end.
    let run = {
        let (c, id, cmd) = (c.clone(), id.clone(), cmd.clone());
        tokio::spawn(async move { c.run(&id, &cmd).await.unwrap() })
    };
    // The same over the WebSocket stream (an upgraded connection).
    let ws = {
        let (c, id, cmd) = (c.clone(), id.clone(), cmd.clone());
        tokio::spawn(async move {
            let mut s = c.stream_command(&id, &cmd).await.unwrap();
            let mut out = Vec::new();
            let mut code = None;
            while let Some(e) = s.next_event().await.unwrap() {
                match e {
                    CommandEvent::Stdout { data } => out.extend(
                        base64::engine::general_purpose::STANDARD
                            .decode(data)
                            .unwrap(),
                    ),
                    CommandEvent::End { exit_code, .. } => code = Some(exit_code),
                    _ => {}
                }
            }
            (String::from_utf8(out).unwrap(), code)
        })
    };
    // And as a Connect server stream through the port proxy: its head is answered at
    // once, then the body is silent until the command prints.
    let envd = {
        let (url, host, token) = (d.url.clone(), port_host(&d, 49983, &id), token.clone());
        let start = serde_json::json!({"process": {"cmd": "/bin/bash", "args": ["-c", script]}});
        tokio::spawn(async move {
            let r = http_from(Ipv4Addr::LOCALHOST)
                .post(format!("{url}/process.Process/Start"))
                .header("host", host)
                .header("x-access-token", token)
                .header(
                    "authorization",
                    format!(
                        "Basic {}",
                        base64::engine::general_purpose::STANDARD.encode("user:")
                    ),
                )
                .header("content-type", "application/connect+json")
                .body(connect_envelope(&start))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            connect_stdout(&r.bytes().await.unwrap())
        })
    };

    // An idle keep-alive connection is closed after the idle timeout.
    let idle = async {
        let mut s = connect_from(d.port, Ipv4Addr::LOCALHOST).await.unwrap();
        health_on(&mut s).await;
        closed_after(&mut s, Duration::from_secs(IDLE_SECS) + SLACK).await
    };
    // One kept idle past the header timeout still takes the next request.
    let kept = async {
        let mut s = connect_from(d.port, Ipv4Addr::LOCALHOST).await.unwrap();
        health_on(&mut s).await;
        tokio::time::sleep(Duration::from_secs(HEADER_SECS + 1)).await;
        health_on(&mut s).await;
    };
    // A head begun on a kept-alive connection and never finished: the header timeout.
    let stalled = async {
        let mut s = connect_from(d.port, Ipv4Addr::LOCALHOST).await.unwrap();
        health_on(&mut s).await;
        s.write_all(b"GET /v1/health HTTP/1.1\r\nHo").await.unwrap();
        closed_after(&mut s, Duration::from_secs(HEADER_SECS) + SLACK).await
    };
    let (idle_took, (), stalled_took) = tokio::join!(idle, kept, stalled);
    let idle_took = idle_took.expect("the idle connection was closed");
    let stalled_took = stalled_took.expect("the stalled head was cut");
    eprintln!("idle connection closed after {idle_took:?}, stalled head after {stalled_took:?}");
    assert!(
        idle_took >= Duration::from_secs(IDLE_SECS - 1),
        "closed before the idle timeout: {idle_took:?}"
    );
    assert!(
        stalled_took < Duration::from_secs(IDLE_SECS),
        "a stalled head waited for the idle timeout: {stalled_took:?}"
    );
    assert!(
        !run.is_finished() && !ws.is_finished() && !envd.is_finished(),
        "the streams should still be running when the idle connection is closed"
    );

    let r = run.await.unwrap();
    assert_eq!((r.exit_code, r.stdout.as_str()), (0, "done\n"));
    assert_eq!(ws.await.unwrap(), ("done\n".to_string(), Some(0)));
    assert_eq!(envd.await.unwrap(), "done\n");
    d.shutdown().await;
}
