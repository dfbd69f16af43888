//! `Client::follow_run` against a stand-in daemon on 127.0.0.1 whose event stream is cut
//! mid-event, replays events already sent, skips some, and ends early: the caller still
//! sees every sequence number exactly once, in order, and the follow ends with the run.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use parking_lot::Mutex;
use sandpit_api::{AgentRun, AgentRunEvent, AgentRunEventPage, ErrorBody};
use sandpit_client::Client;
use serde::Deserialize;

/// Events of the stand-in run.
const N: i64 = 10;
/// The stream connection from which on the run is finished.
const FINISHED_FROM: usize = 4;

#[derive(Clone, Default)]
struct Stand {
    /// The `Last-Event-ID` of each stream connection, in order.
    connections: Arc<Mutex<Vec<Option<String>>>>,
}

fn event(seq: i64) -> AgentRunEvent {
    AgentRunEvent {
        seq,
        at_ms: seq * 10,
        kind: if seq == N { "end" } else { "status" }.into(),
        payload: serde_json::json!({"n": seq}),
    }
}

fn sse(seq: i64) -> String {
    let e = event(seq);
    format!(
        "id: {}\nevent: {}\ndata: {}\n\n",
        e.seq,
        e.kind,
        serde_json::to_string(&e).unwrap_or_default()
    )
}

fn run(finished: bool) -> AgentRun {
    AgentRun {
        id: "run1".into(),
        runtime_id: "agt1".into(),
        sandbox_id: "sb1".into(),
        number: 1,
        task: "t".into(),
        mode: "fresh".into(),
        state: if finished { "succeeded" } else { "running" }.into(),
        reason: None,
        parent_run_id: None,
        idempotency_key: None,
        created_at_ms: 0,
        started_at_ms: Some(0),
        ended_at_ms: finished.then_some(1),
        events: if finished { N } else { 8 },
        events_dropped: 0,
    }
}

fn not_found() -> Response {
    let body = ErrorBody {
        code: "not_found".into(),
        message: "no such run".into(),
    };
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}

/// One piece of a stream: bytes, a pause, or a cut connection.
enum Piece {
    Text(String),
    Pause,
    Cut,
}

async fn stream(State(s): State<Stand>, Path(id): Path<String>, headers: HeaderMap) -> Response {
    if id != "run1" {
        return not_found();
    }
    let last = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let n = {
        let mut c = s.connections.lock();
        c.push(last);
        c.len()
    };
    let half = |seq: i64| {
        let t = sse(seq);
        t[..t.len() / 2].to_string()
    };
    let pieces = match n {
        // Four whole events, then half of the fifth, then the connection is cut.
        1 => vec![
            Piece::Text((1..=4).map(sse).collect()),
            Piece::Text(half(5)),
            Piece::Pause,
            Piece::Cut,
        ],
        // 3 and 4 again, 5, then 8: 6 and 7 are missing; then a clean end although the
        // run goes on.
        2 => vec![Piece::Text(format!(
            ": keep-alive\n\n{}{}{}{}",
            sse(3),
            sse(4),
            sse(5),
            sse(8)
        ))],
        // 9, then half of 10 and a cut.
        3 => vec![
            Piece::Text(sse(9)),
            Piece::Pause,
            Piece::Text(half(10)),
            Piece::Pause,
            Piece::Cut,
        ],
        // The rest, and the end of the stream.
        _ => vec![Piece::Text(sse(10))],
    };
    let body = futures::stream::unfold(pieces.into_iter(), |mut it| async move {
        match it.next()? {
            Piece::Text(t) => Some((Ok(Bytes::from(t)), it)),
            Piece::Pause => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Some((Ok(Bytes::new()), it))
            }
            Piece::Cut => Some((Err(std::io::Error::other("cut")), it)),
        }
    });
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(body),
    )
        .into_response()
}

async fn get_run(State(s): State<Stand>, Path(id): Path<String>) -> Response {
    if id != "run1" {
        return not_found();
    }
    let finished = s.connections.lock().len() >= FINISHED_FROM;
    Json(run(finished)).into_response()
}

#[derive(Deserialize)]
struct PageQuery {
    after: i64,
    limit: Option<usize>,
}

async fn page(Path(id): Path<String>, Query(q): Query<PageQuery>) -> Response {
    if id != "run1" {
        return not_found();
    }
    let events: Vec<AgentRunEvent> = (q.after + 1..=N)
        .map(event)
        .take(q.limit.unwrap_or(100))
        .collect();
    let next_after = events.last().map_or(q.after, |e| e.seq);
    Json(AgentRunEventPage {
        events,
        next_after,
        complete: false,
    })
    .into_response()
}

async fn serve(stand: Stand) -> String {
    let app = Router::new()
        .route("/v1/runs/{id}/events/stream", get(stream))
        .route("/v1/runs/{id}/events", get(page))
        .route("/v1/runs/{id}", get(get_run))
        .with_state(stand);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_cut_and_replayed_stream_yields_each_event_once_in_order() {
    let stand = Stand::default();
    let url = serve(stand.clone()).await;
    let client = Client::new(&url, None).expect("client");
    let mut f = client.follow_run("run1", 0);
    let mut seen = Vec::new();
    let read = async {
        while let Some(e) = f.next_event().await.expect("next event") {
            assert_eq!(e, event(e.seq));
            seen.push(e.seq);
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("the follow ends");
    assert_eq!(seen, (1..=N).collect::<Vec<_>>());
    assert_eq!(f.last_seq(), N);
    assert_eq!(f.final_run().map(|r| r.state.as_str()), Some("succeeded"));
    // Each reconnect resumed after the last event returned.
    let conns = stand.connections.lock().clone();
    let want: Vec<Option<String>> = ["0", "4", "8", "9"]
        .iter()
        .map(|s| Some(s.to_string()))
        .collect();
    assert_eq!(conns, want);
}

#[tokio::test]
async fn a_follow_from_the_middle_starts_after_it() {
    let stand = Stand::default();
    // The stand-in's run is finished from the first connection on.
    stand
        .connections
        .lock()
        .extend(std::iter::repeat_n(None, FINISHED_FROM));
    let url = serve(stand.clone()).await;
    let client = Client::new(&url, None).expect("client");
    let mut f = client.follow_run("run1", 6);
    let mut seen = Vec::new();
    while let Some(e) = f.next_event().await.expect("next event") {
        seen.push(e.seq);
    }
    // The stream sends only 10: 7 to 9 come from the pages route.
    assert_eq!(seen, vec![7, 8, 9, 10]);
    assert_eq!(
        stand.connections.lock().last().cloned(),
        Some(Some("6".into()))
    );
}

#[tokio::test]
async fn an_unknown_run_is_an_error_not_a_retry() {
    let url = serve(Stand::default()).await;
    let client = Client::new(&url, None).expect("client");
    let mut f = client.follow_run("nope", 0);
    let err = tokio::time::timeout(Duration::from_secs(5), f.next_event())
        .await
        .expect("answered at once")
        .expect_err("not found");
    assert!(err.is_not_found(), "{err}");
}
