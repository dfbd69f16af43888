//! The client against a small in-process mock of the daemon: routes, encoding, auth,
//! error bodies, streaming bodies and the command WebSocket.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{OriginalUri, Path, Query, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use parking_lot::Mutex;
use sandpit_api::{
    ClientMessage, CommandEvent, ErrorBody, Limits, RunCommandRequest, Sandbox, SandboxList,
};
use sandpit_client::{Client, ClientError};

const KEY: &str = "sp_test";

#[derive(Clone, Default)]
struct Mock {
    uploads: Arc<Mutex<BTreeMap<String, Vec<u8>>>>,
}

fn authorized(headers: &HeaderMap) -> Result<(), Box<Response>> {
    let ok = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {KEY}"));
    if ok {
        Ok(())
    } else {
        let body = ErrorBody {
            code: "unauthenticated".into(),
            message: "bad key".into(),
        };
        Err(Box::new(
            (StatusCode::UNAUTHORIZED, Json(body)).into_response(),
        ))
    }
}

fn sandbox(id: &str, template: &str) -> Sandbox {
    Sandbox {
        id: id.into(),
        template: template.into(),
        runtime: "process".into(),
        isolated: false,
        state: "running".into(),
        limits: Limits {
            cpu_millis: 1000,
            memory_bytes: 1,
            disk_bytes: 1,
            max_processes: 1,
        },
        metadata: BTreeMap::new(),
        created_at_ms: 0,
        expires_at_ms: 0,
        error: None,
        pool: None,
        lifecycle: sandpit_api::Lifecycle {
            idle_timeout: 300,
            on_timeout: "kill".into(),
            auto_resume: true,
            last_activity_ms: 0,
            paused_at_ms: None,
            snapshot: None,
        },
        secure: true,
        public: false,
        envd_access_token: None,
        traffic_access_token: None,
        network: None,
    }
}

async fn list(headers: HeaderMap, RawQuery(q): RawQuery) -> Response {
    if let Err(r) = authorized(&headers) {
        return *r;
    }
    // The raw query string comes back as the cursor, so the test can see the encoding.
    Json(SandboxList {
        items: vec![],
        next_cursor: q,
    })
    .into_response()
}

async fn get_one(
    headers: HeaderMap,
    Path(id): Path<String>,
    OriginalUri(uri): OriginalUri,
) -> Response {
    if let Err(r) = authorized(&headers) {
        return *r;
    }
    if id == "missing" {
        let body = ErrorBody {
            code: "not_found".into(),
            message: "no sandbox missing".into(),
        };
        return (StatusCode::NOT_FOUND, Json(body)).into_response();
    }
    if id == "garbage" {
        return "{not json".into_response();
    }
    Json(sandbox(&id, uri.path())).into_response()
}

async fn delete_one(Path(_id): Path<String>) -> StatusCode {
    StatusCode::NO_CONTENT
}

async fn get_file(Query(q): Query<BTreeMap<String, String>>, State(m): State<Mock>) -> Response {
    let path = q.get("path").cloned().unwrap_or_default();
    match m.uploads.lock().get(&path) {
        Some(data) => data.clone().into_response(),
        None => (StatusCode::NOT_FOUND, "plain text, not json").into_response(),
    }
}

async fn put_file(
    Query(q): Query<BTreeMap<String, String>>,
    State(m): State<Mock>,
    body: Bytes,
) -> StatusCode {
    let path = q.get("path").cloned().unwrap_or_default();
    m.uploads.lock().insert(path, body.to_vec());
    StatusCode::NO_CONTENT
}

async fn stream(headers: HeaderMap, ws: WebSocketUpgrade) -> Response {
    if let Err(r) = authorized(&headers) {
        return *r;
    }
    ws.on_upgrade(serve_stream)
}

/// Echo-ish command: stdout is the argv joined, then whatever stdin brings until it closes;
/// stderr is "err"; the exit code is the number of stdin messages.
async fn serve_stream(mut socket: WebSocket) {
    let Some(Ok(Message::Text(first))) = socket.recv().await else {
        return;
    };
    let req: RunCommandRequest = serde_json::from_str(&first).unwrap();
    let send = |e: CommandEvent| Message::Text(serde_json::to_string(&e).unwrap().into());
    socket
        .send(send(CommandEvent::Start { pid: 7 }))
        .await
        .unwrap();
    let out = B64.encode(req.argv.join(" "));
    socket
        .send(send(CommandEvent::Stdout { data: out }))
        .await
        .unwrap();
    let mut count = 0;
    while let Some(Ok(Message::Text(t))) = socket.recv().await {
        match serde_json::from_str::<ClientMessage>(&t).unwrap() {
            ClientMessage::Stdin { data } => {
                count += 1;
                socket
                    .send(send(CommandEvent::Stdout { data }))
                    .await
                    .unwrap();
            }
            ClientMessage::CloseStdin => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    socket
        .send(send(CommandEvent::Stderr {
            data: B64.encode("err"),
        }))
        .await
        .unwrap();
    socket
        .send(send(CommandEvent::End {
            exit_code: count,
            status: "exited".into(),
        }))
        .await
        .unwrap();
    let _ = socket.send(Message::Close(None)).await;
}

async fn start() -> String {
    let app = Router::new()
        .route("/v1/sandboxes", get(list))
        .route("/v1/sandboxes/{id}", get(get_one).delete(delete_one))
        .route("/v1/sandboxes/{id}/files", get(get_file).put(put_file))
        .route("/v1/sandboxes/{id}/commands/stream", get(stream))
        // Uploads are streamed; axum's 2 MB default would refuse the big one.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(Mock::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

#[tokio::test]
async fn list_query_is_encoded() {
    let client = Client::new(&start().await, Some(KEY.into())).unwrap();
    let meta = vec![
        ("k".to_string(), "v w".to_string()),
        ("a&b".to_string(), "=c".to_string()),
    ];
    let page = client
        .list_sandboxes(Some("running"), &meta, Some(5), Some("cur/1"))
        .await
        .unwrap();
    assert_eq!(
        page.next_cursor.as_deref(),
        Some("state=running&metadata=k%3Dv+w&metadata=a%26b%3D%3Dc&limit=5&cursor=cur%2F1")
    );
    let page = client.list_sandboxes(None, &[], None, None).await.unwrap();
    assert_eq!(page.next_cursor, None);
}

#[tokio::test]
async fn ids_are_one_path_segment() {
    // A base URL with a trailing slash must not produce `//v1`.
    let client = Client::new(&format!("{}/", start().await), Some(KEY.into())).unwrap();
    let sb = client.get_sandbox("a b/c?d").await.unwrap();
    assert_eq!(sb.id, "a b/c?d");
    assert_eq!(sb.template, "/v1/sandboxes/a%20b%2Fc%3Fd");
    client.delete_sandbox("x").await.unwrap();
}

#[tokio::test]
async fn errors_are_typed() {
    let base = start().await;
    let client = Client::new(&base, Some(KEY.into())).unwrap();
    match client.get_sandbox("missing").await.unwrap_err() {
        ClientError::Api {
            status,
            code,
            message,
        } => {
            assert_eq!(
                (status, code.as_str(), message.as_str()),
                (404, "not_found", "no sandbox missing")
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        client.get_sandbox("garbage").await,
        Err(ClientError::Decode(_))
    ));
    let anonymous = Client::new(&base, None).unwrap();
    let err = anonymous.get_sandbox("x").await.unwrap_err();
    assert_eq!(err.code(), Some("unauthenticated"));
    let err = anonymous
        .stream_command("x", &RunCommandRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(401), "{err:?}");
    assert!(matches!(
        Client::new("not a url", None),
        Err(ClientError::Config(_))
    ));
    let closed = Client::new("http://127.0.0.1:1", None).unwrap();
    assert!(matches!(closed.health().await, Err(ClientError::Http(_))));
}

#[tokio::test]
async fn files_stream_both_ways() {
    let client = Client::new(&start().await, Some(KEY.into())).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("big");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&local, &data).unwrap();
    client
        .upload_from_file("s", "/tmp/a b&c", &local)
        .await
        .unwrap();
    let mut out = Vec::new();
    let n = client
        .download_to("s", "/tmp/a b&c", &mut out)
        .await
        .unwrap();
    assert_eq!(n, data.len() as u64);
    assert!(out == data);
    client.write_file("s", "/small", "hello").await.unwrap();
    assert_eq!(client.read_file("s", "/small").await.unwrap(), "hello");
    let err = client.read_file("s", "/nope").await.unwrap_err();
    assert_eq!((err.status(), err.code()), (Some(404), Some("not_found")));
    assert_eq!(err.to_string(), "plain text, not json (not_found)");
}

#[tokio::test]
async fn command_stream_round_trip() {
    let client = Client::new(&start().await, Some(KEY.into())).unwrap();
    let req = RunCommandRequest {
        argv: vec!["echo".into(), "hi".into()],
        ..Default::default()
    };
    let mut stream = client.stream_command("s", &req).await.unwrap();
    assert_eq!(
        stream.next_event().await.unwrap(),
        Some(CommandEvent::Start { pid: 7 })
    );
    stream.write_stdin(b"\x00\xff").await.unwrap();
    stream.write_stdin(b"!").await.unwrap();
    stream.close_stdin().await.unwrap();
    let (stdout, stderr, code) = stream.collect().await.unwrap();
    assert_eq!(stdout, b"echo hi\x00\xff!");
    assert_eq!(stderr, b"err");
    assert_eq!(code, 2);
}
