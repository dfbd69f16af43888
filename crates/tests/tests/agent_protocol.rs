//! The agent's Connect services spoken directly over its socket, as E2B-style clients do
//! through the pass-through: client-streamed stdin, pty resize, WatchDir streams, and a
//! multipart upload to `/files`.

use base64::Engine;
use sandpit_api::LimitsSpec;
use sandpit_proto::filesystem::__buffa::oneof::watch_dir_response::Event as WatchEvent;
use sandpit_proto::filesystem::{EventType, WatchDirRequest, WatchDirResponse};
use sandpit_proto::process::__buffa::oneof::process_event::Event;
use sandpit_proto::process::__buffa::oneof::process_event::data_event::Output;
use sandpit_proto::process::__buffa::oneof::process_input::Input;
use sandpit_proto::process::__buffa::oneof::process_selector::Selector;
use sandpit_proto::process::__buffa::oneof::stream_input_request::Event as InputEvent;
use sandpit_proto::process::*;
use sandpit_server::agent_conn::AgentConn;
use sandpit_tests::{Daemon, sh};
use std::time::Duration;

fn user_header() -> sandpit_proto::connectrpc::client::CallOptions {
    let v = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("user:")
    );
    sandpit_proto::connectrpc::client::CallOptions::default()
        .try_with_header("authorization", v)
        .unwrap()
}

fn selector(pid: u32) -> ProcessSelector {
    ProcessSelector {
        selector: Some(Selector::Pid(pid)),
        ..Default::default()
    }
}

/// Starts `req`, runs `act` with its pid, then gathers its stdout and pty output until
/// the end event; returns the output and the exit code.
async fn run_with<F, Fut>(agent: &AgentConn, req: StartRequest, act: F) -> (Vec<u8>, Option<i32>)
where
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut events = agent
        .process
        .start_with_options(req, user_header())
        .await
        .unwrap();
    let first = events
        .message::<StartResponse>()
        .await
        .unwrap()
        .unwrap()
        .to_owned_message();
    let Some(Event::Start(s)) = first.event.event.clone() else {
        panic!("no start event")
    };
    act(s.pid).await;
    let (mut out, mut code) = (Vec::new(), None);
    while let Some(m) = events.message::<StartResponse>().await.unwrap() {
        match m.to_owned_message().event.event.clone() {
            Some(Event::Data(d)) => {
                if let Some(Output::Stdout(b) | Output::Pty(b)) = d.output {
                    out.extend(b);
                }
            }
            Some(Event::End(e)) => {
                code = Some(e.exit_code);
                break;
            }
            _ => {}
        }
    }
    (out, code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_streamed_stdin_pty_resize_watchdir_and_multipart() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    let agent = AgentConn::new(d.data.path().join("sandboxes").join(&id).join("agent.sock"));
    let agent = &agent;

    // StreamInput: stdin delivered over a client stream.
    let start = StartRequest {
        process: ProcessConfig {
            cmd: "cat".into(),
            ..Default::default()
        }
        .into(),
        stdin: Some(true),
        ..Default::default()
    };
    let (out, code) = run_with(agent, start, |pid| async move {
        let data = ProcessInput {
            input: Some(Input::Stdin(b"streamed\n".to_vec())),
            ..Default::default()
        };
        let msgs = vec![
            StreamInputRequest {
                event: Some(InputEvent::Start(Box::new(
                    stream_input_request::StartEvent {
                        process: selector(pid).into(),
                        ..Default::default()
                    },
                ))),
                ..Default::default()
            },
            StreamInputRequest {
                event: Some(InputEvent::Data(Box::new(
                    stream_input_request::DataEvent {
                        input: data.into(),
                        ..Default::default()
                    },
                ))),
                ..Default::default()
            },
        ];
        agent
            .process
            .stream_input(futures::stream::iter(msgs))
            .await
            .unwrap();
        let close = CloseStdinRequest {
            process: selector(pid).into(),
            ..Default::default()
        };
        agent.process.close_stdin(close).await.unwrap();
    })
    .await;
    assert_eq!((out.as_slice(), code), (&b"streamed\n"[..], Some(0)));

    // Update: a pty resized while the command waits.
    let size = |cols, rows| PTY {
        size: pty::Size {
            cols,
            rows,
            ..Default::default()
        }
        .into(),
        ..Default::default()
    };
    let start = StartRequest {
        process: ProcessConfig {
            cmd: "bash".into(),
            args: vec!["-c".into(), "sleep 0.5; stty size".into()],
            ..Default::default()
        }
        .into(),
        pty: size(80, 24).into(),
        ..Default::default()
    };
    let (text, _) = run_with(agent, start, |pid| async move {
        let resize = UpdateRequest {
            process: selector(pid).into(),
            pty: size(132, 43).into(),
            ..Default::default()
        };
        agent.process.update(resize).await.unwrap();
    })
    .await;
    assert!(
        String::from_utf8_lossy(&text).contains("43 132"),
        "{}",
        String::from_utf8_lossy(&text)
    );

    // WatchDir: a stream that opens with a start event and then reports changes.
    let req = WatchDirRequest {
        path: "/workspace".into(),
        recursive: true,
        ..Default::default()
    };
    let mut watch = agent
        .fs
        .watch_dir_with_options(req, user_header())
        .await
        .unwrap();
    let first = watch
        .message::<WatchDirResponse>()
        .await
        .unwrap()
        .unwrap()
        .to_owned_message();
    assert!(matches!(first.event, Some(WatchEvent::Start(_))));
    sh(
        &c,
        &id,
        "mkdir -p /workspace/sub && touch /workspace/sub/created",
    )
    .await;
    let mut seen = false;
    for _ in 0..10 {
        let Ok(Ok(Some(m))) =
            tokio::time::timeout(Duration::from_secs(5), watch.message::<WatchDirResponse>()).await
        else {
            break;
        };
        if let Some(WatchEvent::Filesystem(fe)) = m.to_owned_message().event
            && fe.name == "sub/created"
            && fe.r#type.as_known() == Some(EventType::EVENT_TYPE_CREATE)
        {
            seen = true;
            break;
        }
    }
    assert!(seen, "no CREATE event for sub/created");
    drop(watch);

    // Multipart upload through the daemon's pass-through, as E2B's SDKs send it.
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(b"multi\x00part".to_vec()).file_name("m.bin"),
    );
    let r = sandpit_tests::http()
        .post(format!(
            "{}/v1/sandboxes/{id}/agent/files?path=/home/user/m.bin",
            d.url
        ))
        .header("authorization", format!("Bearer {}", d.key))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let written: serde_json::Value = r.json().await.unwrap();
    assert_eq!(written[0]["path"], "/home/user/m.bin");
    assert_eq!(
        c.read_file(&id, "/home/user/m.bin").await.unwrap().as_ref(),
        b"multi\x00part"
    );

    // Stat and ListDir of a symlink report the absolute path it leads to, as E2B does.
    sh(
        &c,
        &id,
        "cd /home/user && echo x > test_file.txt && ln -sf test_file.txt link && ln -sf nothing/here dangling",
    )
    .await;
    let stat = |path: &str| {
        agent.fs.stat_with_options(
            sandpit_proto::filesystem::StatRequest {
                path: path.into(),
                ..Default::default()
            },
            user_header(),
        )
    };
    let info = stat("/home/user/link").await.unwrap().into_owned().entry;
    assert!(info.is_symlink);
    assert_eq!(
        info.symlink_target.as_deref(),
        Some("/home/user/test_file.txt")
    );
    let info = stat("dangling").await.unwrap().into_owned().entry;
    assert_eq!(
        info.symlink_target.as_deref(),
        Some("/home/user/nothing/here")
    );
    let list = agent
        .fs
        .list_dir_with_options(
            sandpit_proto::filesystem::ListDirRequest {
                path: "/home/user".into(),
                depth: 1,
                ..Default::default()
            },
            user_header(),
        )
        .await
        .unwrap()
        .into_owned();
    let link = list.entries.iter().find(|e| e.name == "link").unwrap();
    assert_eq!(
        link.symlink_target.as_deref(),
        Some("/home/user/test_file.txt")
    );
    d.shutdown().await;
}
