//! The lease calls and the `with_sandbox` wrapper against an in-process mock of the daemon
//! (the same approach as `mock.rs`): which errors count as "the sandbox is gone", and that
//! the wrapper retries exactly once for those and never for anything else.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use parking_lot::Mutex;
use sandpit_api::leases::{Acquired, Lease};
use sandpit_api::{
    CreateSandboxRequest, ErrorBody, Limits, RunCommandRequest, RunCommandResponse, Sandbox,
};
use sandpit_client::{Client, ClientError, SandboxLease};

/// How the mock answers a command on one sandbox.
#[derive(Clone, Copy, Debug)]
enum Answer {
    Ok,
    Status(u16, &'static str),
}

#[derive(Default)]
struct Inner {
    acquires: u32,
    /// Sandbox ids of the command calls, in order.
    calls: Vec<String>,
    /// Answer per sandbox id (default: Ok).
    answers: BTreeMap<String, Answer>,
    /// The template each acquire asked for.
    templates: Vec<Option<String>>,
}

#[derive(Clone, Default)]
struct Mock(Arc<Mutex<Inner>>);

fn sandbox(id: &str) -> Sandbox {
    Sandbox {
        id: id.into(),
        template: "host".into(),
        runtime: "container".into(),
        isolated: true,
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

async fn acquire(
    State(m): State<Mock>,
    Path(user): Path<String>,
    Json(req): Json<CreateSandboxRequest>,
) -> Json<Acquired> {
    let mut inner = m.0.lock();
    inner.acquires += 1;
    inner.templates.push(req.template);
    let id = format!("{user}-sb{}", inner.acquires);
    Json(Acquired {
        lease: Lease {
            user,
            sandbox_id: Some(id.clone()),
            status: "ready".into(),
            paused: false,
            runtime: "container".into(),
            lock_version: i64::from(inner.acquires),
            total_usage_seconds: 0.0,
            last_activity_ms: 0,
            created_at_ms: 0,
            updated_at_ms: 0,
        },
        sandbox: sandbox(&id),
        created: true,
        resumed: false,
    })
}

async fn run(State(m): State<Mock>, Path(id): Path<String>) -> Response {
    let answer = {
        let mut inner = m.0.lock();
        inner.calls.push(id.clone());
        inner.answers.get(&id).copied().unwrap_or(Answer::Ok)
    };
    match answer {
        Answer::Ok => Json(RunCommandResponse {
            pid: 1,
            exit_code: 0,
            stdout: format!("ran in {id}"),
            stderr: String::new(),
            duration_ms: 1,
            truncated: false,
            timed_out: false,
        })
        .into_response(),
        Answer::Status(status, code) => (
            StatusCode::from_u16(status).unwrap(),
            Json(ErrorBody {
                code: code.into(),
                message: format!("{code} for {id}"),
            }),
        )
            .into_response(),
    }
}

async fn start(mock: Mock) -> Client {
    let app = Router::new()
        .route("/v1/leases/{user}/acquire", post(acquire))
        .route("/v1/sandboxes/{id}/commands", post(run))
        .with_state(mock);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Client::new(&format!("http://{addr}"), Some("sp_test".into())).unwrap()
}

fn set(mock: &Mock, id: &str, a: Answer) {
    mock.0.lock().answers.insert(id.into(), a);
}

fn counts(mock: &Mock) -> (u32, Vec<String>) {
    let inner = mock.0.lock();
    (inner.acquires, inner.calls.clone())
}

async fn echo(c: Client, id: String) -> Result<String, ClientError> {
    let req = RunCommandRequest {
        argv: vec!["true".into()],
        ..Default::default()
    };
    c.run(&id, &req).await.map(|r| r.stdout)
}

fn api(status: u16, code: &str) -> ClientError {
    ClientError::Api {
        status,
        code: code.into(),
        message: String::new(),
    }
}

#[test]
fn only_a_vanished_sandbox_is_classified_as_gone() {
    assert!(api(404, "sandbox_not_found").is_sandbox_gone());
    assert!(api(409, "sandbox_stopped").is_sandbox_gone());
    // A missing file, a paused sandbox, a bare 404 from a proxy, server trouble: no.
    for (status, code) in [
        (404, "not_found"),
        (409, "failed_precondition"),
        (409, "sandbox_not_found"),
        (404, "sandbox_stopped"),
        (502, "unavailable"),
        (500, "internal"),
        (400, "invalid_argument"),
    ] {
        assert!(!api(status, code).is_sandbox_gone(), "{status} {code}");
    }
    assert!(!ClientError::Command("sandbox_not_found".into()).is_sandbox_gone());
    assert!(!ClientError::Decode("x".into()).is_sandbox_gone());
}

#[tokio::test]
async fn a_vanished_sandbox_is_replaced_once_and_the_call_repeated() {
    let mock = Mock::default();
    let client = start(mock.clone()).await;
    set(&mock, "alice-sb1", Answer::Status(404, "sandbox_not_found"));
    let opts = CreateSandboxRequest {
        template: Some("py".into()),
        ..Default::default()
    };
    let lease = SandboxLease::new(client, "alice", opts);
    let out = lease.with_sandbox(echo).await.unwrap();
    assert_eq!(out, "ran in alice-sb2");
    assert_eq!(
        counts(&mock),
        (2, vec!["alice-sb1".to_string(), "alice-sb2".to_string()])
    );
    // Both acquires carried the caller's create options.
    assert_eq!(
        mock.0.lock().templates,
        vec![Some("py".to_string()), Some("py".to_string())]
    );
    // The new id is cached: the next call acquires nothing.
    let out = lease.with_sandbox(echo).await.unwrap();
    assert_eq!(out, "ran in alice-sb2");
    assert_eq!(counts(&mock).0, 2);
    assert_eq!(lease.sandbox_id().await.unwrap(), "alice-sb2");
}

#[tokio::test]
async fn a_stopped_sandbox_is_replaced_too() {
    let mock = Mock::default();
    let client = start(mock.clone()).await;
    set(&mock, "bob-sb1", Answer::Status(409, "sandbox_stopped"));
    let lease = SandboxLease::new(client, "bob", CreateSandboxRequest::default());
    assert_eq!(lease.with_sandbox(echo).await.unwrap(), "ran in bob-sb2");
    assert_eq!(counts(&mock).0, 2);
}

#[tokio::test]
async fn other_errors_propagate_without_a_retry() {
    for (status, code) in [
        (404, "not_found"),
        (409, "failed_precondition"),
        (502, "unavailable"),
        (500, "internal"),
    ] {
        let mock = Mock::default();
        let client = start(mock.clone()).await;
        set(&mock, "carol-sb1", Answer::Status(status, code));
        let lease = SandboxLease::new(client, "carol", CreateSandboxRequest::default());
        let err = lease.with_sandbox(echo).await.unwrap_err();
        assert_eq!((err.status(), err.code()), (Some(status), Some(code)));
        assert_eq!(counts(&mock), (1, vec!["carol-sb1".to_string()]));
        // The handle stays cached: the sandbox is still the user's.
        assert_eq!(lease.sandbox_id().await.unwrap(), "carol-sb1");
    }
}

#[tokio::test]
async fn errors_of_the_callers_own_making_propagate_unchanged() {
    let mock = Mock::default();
    let client = start(mock.clone()).await;
    let lease = SandboxLease::new(client, "dave", CreateSandboxRequest::default());
    let mut calls = 0;
    let err = lease
        .with_sandbox(|_c, _id| {
            calls += 1;
            async { Err::<(), _>(ClientError::Command("exit status 3".into())) }
        })
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Command(ref m) if m == "exit status 3"));
    assert_eq!(calls, 1);
    assert_eq!(counts(&mock).0, 1);
}

#[tokio::test]
async fn the_retry_happens_once_only() {
    let mock = Mock::default();
    let client = start(mock.clone()).await;
    set(&mock, "erin-sb1", Answer::Status(404, "sandbox_not_found"));
    set(&mock, "erin-sb2", Answer::Status(404, "sandbox_not_found"));
    let lease = SandboxLease::new(client, "erin", CreateSandboxRequest::default());
    let err = lease.with_sandbox(echo).await.unwrap_err();
    assert!(err.is_sandbox_gone(), "{err:?}");
    assert_eq!(
        counts(&mock),
        (2, vec!["erin-sb1".to_string(), "erin-sb2".to_string()])
    );
    // The next call starts over with a fresh acquire.
    lease.clear().await;
    assert_eq!(lease.with_sandbox(echo).await.unwrap(), "ran in erin-sb3");
}
