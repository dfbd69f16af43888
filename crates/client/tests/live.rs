//! The client against a running daemon. Ignored by default; run with
//! `SANDPIT_TEST_URL=http://127.0.0.1:7423 SANDPIT_TEST_API_KEY=sp_... cargo test -p sandpit-client -- --ignored`
//! (`SANDPIT_TEST_RUNTIME` picks the runtime, default: the daemon's).

use std::time::Duration;

use sandpit_api::{CommandEvent, CreateSandboxRequest, RunCommandRequest};
use sandpit_client::{Client, ClientError};

fn client() -> Client {
    let url = std::env::var("SANDPIT_TEST_URL").expect("set SANDPIT_TEST_URL to a running daemon");
    Client::new(&url, std::env::var("SANDPIT_TEST_API_KEY").ok()).unwrap()
}

fn argv(args: &[&str]) -> RunCommandRequest {
    RunCommandRequest {
        argv: args.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

#[tokio::test]
#[ignore = "needs a running daemon (SANDPIT_TEST_URL)"]
async fn everything_against_a_daemon() {
    let c = client();
    c.health().await.unwrap();
    let info = c.info().await.unwrap();
    assert!(!info.runtimes.is_empty());
    assert!(
        c.list_templates()
            .await
            .unwrap()
            .iter()
            .any(|t| t.name == "host")
    );

    let runtime = std::env::var("SANDPIT_TEST_RUNTIME").ok();
    let mut req = CreateSandboxRequest {
        runtime,
        timeout: Some(120),
        ..Default::default()
    };
    req.metadata.insert("test".into(), "client live".into());
    let sb = c.create_sandbox(&req).await.unwrap();
    let id = sb.id.as_str();
    assert_eq!(c.get_sandbox(id).await.unwrap().state, "running");
    let meta = [("test".to_string(), "client live".to_string())];
    let page = c
        .list_sandboxes(Some("running"), &meta, Some(10), None)
        .await
        .unwrap();
    assert!(page.items.iter().any(|s| s.id == id));
    c.set_timeout(id, 90).await.unwrap();
    c.keepalive(id).await.unwrap();

    // Commands.
    let out = c
        .run(id, &argv(&["sh", "-c", "echo out; echo err >&2; exit 3"]))
        .await
        .unwrap();
    assert_eq!(
        (out.stdout.as_str(), out.stderr.as_str(), out.exit_code),
        ("out\n", "err\n", 3)
    );
    let stream = c
        .stream_command(id, &argv(&["sh", "-c", "printf 'a\\0b'; exit 4"]))
        .await
        .unwrap();
    assert_eq!(
        stream.collect().await.unwrap(),
        (b"a\0b".to_vec(), vec![], 4)
    );

    // A REST background command gets no open stdin (text in `stdin` is written, then
    // closed), so the open-stdin command is started on a WebSocket and detached.
    let mut cat = argv(&["cat"]);
    cat.stdin = Some(String::new());
    let mut first = c.stream_command(id, &cat).await.unwrap();
    let Some(CommandEvent::Start { pid }) = first.next_event().await.unwrap() else {
        panic!("no start")
    };
    first.close().await.unwrap();
    assert!(
        c.list_commands(id)
            .await
            .unwrap()
            .iter()
            .any(|p| p.pid == pid)
    );
    c.send_stdin(id, pid, "hello ", false).await.unwrap();
    let mut attached = c.attach(id, pid).await.unwrap();
    assert_eq!(
        attached.next_event().await.unwrap(),
        Some(CommandEvent::Start { pid })
    );
    attached.write_stdin(b"world").await.unwrap();
    attached.close_stdin().await.unwrap();
    assert_eq!(attached.collect().await.unwrap().0, b"hello world");

    let sleeper = c
        .run_background(id, &argv(&["sleep", "100"]))
        .await
        .unwrap();
    c.signal(id, sleeper.pid, "SIGKILL").await.unwrap();

    // Files.
    let dir = "/tmp/client live";
    c.mkdir(id, dir).await.unwrap();
    c.write_file(id, &format!("{dir}/a.txt"), "alpha")
        .await
        .unwrap();
    assert_eq!(
        c.read_file(id, &format!("{dir}/a.txt")).await.unwrap(),
        "alpha"
    );
    c.copy_path(id, &format!("{dir}/a.txt"), &format!("{dir}/b.txt"))
        .await
        .unwrap();
    c.move_path(id, &format!("{dir}/b.txt"), &format!("{dir}/c&d.txt"))
        .await
        .unwrap();
    let entries = c.list_dir(id, dir, 1).await.unwrap();
    let mut names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["a.txt", "c&d.txt"]);
    assert_eq!(c.stat(id, &format!("{dir}/c&d.txt")).await.unwrap().size, 5);
    let local = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(local.path(), vec![7u8; 3 << 20]).unwrap();
    c.upload_from_file(id, &format!("{dir}/big"), local.path())
        .await
        .unwrap();
    let mut back = Vec::new();
    assert_eq!(
        c.download_to(id, &format!("{dir}/big"), &mut back)
            .await
            .unwrap(),
        3 << 20
    );
    c.remove(id, dir).await.unwrap();
    let err = c.stat(id, dir).await.unwrap_err();
    assert!(err.is_not_found(), "{err:?}");

    if info.runtimes.iter().any(|r| r.stats) {
        let _ = c.stats(id).await;
    }
    c.delete_sandbox(id).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    match c.get_sandbox(id).await {
        Err(e) => assert!(e.is_not_found(), "{e:?}"),
        Ok(sb) => assert!(
            matches!(sb.state.as_str(), "stopping" | "stopped"),
            "{sb:?}"
        ),
    }
    assert!(matches!(
        c.delete_sandbox("no-such-sandbox").await,
        Err(ClientError::Api { status: 404, .. })
    ));
}
