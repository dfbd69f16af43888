//! Agent runtimes, runs and run events (issue 13): create a harness runtime in a sandbox,
//! start and cancel runs, read a run's stored events as pages or as server-sent events.
//! Closing an event stream never cancels its run.

use super::{ApiJson, ApiQuery, AppState, Owner};
use crate::error::ApiError;
use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::routing::{get, post};
use http::{HeaderMap, StatusCode};
use sandpit_api::{
    AgentRun, AgentRunEvent, AgentRunEventPage, AgentRuntime, CreateAgentRequest, ErrorBody,
    StartRunRequest,
};
use sandpit_core::{agent_run, agent_runtime};
use serde::Deserialize;
use std::time::Duration;

/// How often a live stream looks for new stored events.
const POLL: Duration = Duration::from_millis(100);
/// Events read from the store per step of a stream.
const STREAM_PAGE: u32 = 500;

/// The agent routes.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/agents", post(create).get(list))
        .route("/v1/agents/{id}", get(get_one).delete(delete))
        .route("/v1/agents/{id}/runs", post(start_run))
        .route("/v1/runs/{id}", get(get_run))
        .route("/v1/runs/{id}/events", get(events))
        .route("/v1/runs/{id}/events/stream", get(stream))
        .route("/v1/runs/{id}/cancel", post(cancel))
}

/// Create an agent runtime (a harness) in a sandbox.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/agents", request_body = CreateAgentRequest,
    responses((status = 201, body = AgentRuntime), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CreateAgentRequest>,
) -> Result<(StatusCode, Json<AgentRuntime>), ApiError> {
    let rec = state
        .manager
        .create_agent_runtime(&owner.0, &id, &req)
        .await?;
    Ok((StatusCode::CREATED, Json(agent_runtime::to_api(&rec)?)))
}

/// The agent runtimes of a sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/agents",
    responses((status = 200, body = Vec<AgentRuntime>), (status = 404, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<Vec<AgentRuntime>>, ApiError> {
    let recs = state.manager.list_agent_runtimes(&owner.0, &id).await?;
    Ok(Json(
        recs.iter()
            .map(agent_runtime::to_api)
            .collect::<Result<_, _>>()?,
    ))
}

/// An agent runtime.
#[utoipa::path(get, path = "/v1/agents/{id}",
    responses((status = 200, body = AgentRuntime), (status = 404, body = ErrorBody)))]
pub async fn get_one(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<AgentRuntime>, ApiError> {
    let rec = state.manager.agent_runtime(&owner.0, &id).await?;
    Ok(Json(agent_runtime::to_api(&rec)?))
}

/// End an agent runtime: its active run is cancelled and its processes killed.
#[utoipa::path(delete, path = "/v1/agents/{id}",
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.manager.delete_agent_runtime(&owner.0, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Start a run: 201 for a new run, 200 for the run an idempotency key already named,
/// 409 while another run of the runtime is active.
#[utoipa::path(post, path = "/v1/agents/{id}/runs", request_body = StartRunRequest,
    responses((status = 201, body = AgentRun), (status = 200, body = AgentRun), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn start_run(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<StartRunRequest>,
) -> Result<(StatusCode, Json<AgentRun>), ApiError> {
    let (run, created) = state.manager.start_agent_run(&owner.0, &id, &req).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(agent_run::to_api(&run))))
}

/// A run.
#[utoipa::path(get, path = "/v1/runs/{id}",
    responses((status = 200, body = AgentRun), (status = 404, body = ErrorBody)))]
pub async fn get_run(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<AgentRun>, ApiError> {
    let run = state.manager.agent_run(&owner.0, &id).await?;
    Ok(Json(agent_run::to_api(&run)))
}

/// Cancel a run: the harness's abort, then its process tree killed, then `cancelled`
/// (a finished run is returned as it is).
#[utoipa::path(post, path = "/v1/runs/{id}/cancel",
    responses((status = 200, body = AgentRun), (status = 404, body = ErrorBody)))]
pub async fn cancel(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<AgentRun>, ApiError> {
    let run = state.manager.cancel_agent_run(&owner.0, &id).await?;
    Ok(Json(agent_run::to_api(&run)))
}

/// Query of the event routes.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Only events with a sequence number above this (0: from the start).
    pub after: Option<i64>,
    /// Page size (default 100, at most 1000).
    pub limit: Option<u32>,
}

fn to_api(e: sandpit_store::RunEvent) -> AgentRunEvent {
    AgentRunEvent {
        seq: e.seq,
        at_ms: e.at_ms,
        kind: e.kind,
        payload: e.payload,
    }
}

/// A page of a run's stored events after `after`.
#[utoipa::path(get, path = "/v1/runs/{id}/events", params(EventsQuery),
    responses((status = 200, body = AgentRunEventPage), (status = 404, body = ErrorBody)))]
pub async fn events(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Json<AgentRunEventPage>, ApiError> {
    let after = q.after.unwrap_or(0).max(0);
    let (run, events) = state
        .manager
        .agent_run_events(&owner.0, &id, after, q.limit.unwrap_or(0))
        .await?;
    let next_after = events.last().map_or(after, |e| e.seq);
    // The run record was read before the events: if it was final then, every event
    // (its `end` last) was stored before this page was read.
    let complete = run.state.is_terminal() && next_after >= run.next_seq - 1;
    Ok(Json(AgentRunEventPage {
        events: events.into_iter().map(to_api).collect(),
        next_after,
        complete,
    }))
}

/// Follow a run's events as server-sent events (`id` = sequence number, `event` = kind,
/// `data` = the event as JSON), from `Last-Event-ID` or `after`; it ends after the
/// run's `end` event. Disconnecting does not cancel the run.
#[utoipa::path(get, path = "/v1/runs/{id}/events/stream", params(EventsQuery),
    responses((status = 200, description = "text/event-stream of AgentRunEvent"), (status = 404, body = ErrorBody)))]
pub async fn stream(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Sse<impl futures::Stream<Item = Result<Event, std::convert::Infallible>>>, ApiError> {
    let last_id = match headers.get("last-event-id") {
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .ok_or_else(|| ApiError::bad_request("Last-Event-ID must be a sequence number"))?,
        ),
        None => None,
    };
    let after = last_id.or(q.after).unwrap_or(0).max(0);
    // Checks the run is the caller's before the stream starts.
    let run = state.manager.agent_run(&owner.0, &id).await?;
    let manager = state.manager.clone();
    let owner = owner.0;
    let pending: std::collections::VecDeque<sandpit_store::RunEvent> = Default::default();
    let stream = futures::stream::unfold(
        (after, pending, false, run.id),
        move |(mut after, mut pending, mut done, run_id)| {
            let (manager, owner) = (manager.clone(), owner.clone());
            async move {
                loop {
                    if let Some(e) = pending.pop_front() {
                        after = e.seq;
                        let kind = e.kind.clone();
                        let ev = to_api(e);
                        let data = serde_json::to_string(&ev).unwrap_or_else(|_| "{}".into());
                        let sse = Event::default()
                            .id(ev.seq.to_string())
                            .event(kind)
                            .data(data);
                        return Some((Ok(sse), (after, pending, done, run_id)));
                    }
                    if done {
                        return None;
                    }
                    match manager
                        .agent_run_events(&owner, &run_id, after, STREAM_PAGE)
                        .await
                    {
                        Ok((run, events)) => {
                            if events.is_empty() {
                                if run.state.is_terminal() && after >= run.next_seq - 1 {
                                    done = true;
                                    continue;
                                }
                                tokio::time::sleep(POLL).await;
                            }
                            pending.extend(events);
                        }
                        Err(e) => {
                            tracing::debug!(run_id, error = %e.chain(), "run event stream ended");
                            return None;
                        }
                    }
                }
            }
        },
    );
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
