//! Agent runtimes, runs and run events (issue 13): create a harness runtime in a sandbox,
//! start and cancel runs, read a run's stored events as pages or as server-sent events.
//! Closing an event stream never cancels its run. A workspace (`POST /v1/workspaces`) is
//! a sandbox and a runtime in it, made in one call.

use super::{ApiJson, ApiQuery, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderMap, StatusCode};
use sandpit_api::{
    AgentRun, AgentRunEvent, AgentRunEventPage, AgentRuntime, CreateAgentRequest,
    CreateWorkspaceRequest, ErrorBody, StartRunRequest, Workspace,
};
use sandpit_core::{agent_run, agent_runtime};
use serde::Deserialize;
use std::time::Duration;

/// How often a live stream looks for new stored events.
const POLL: Duration = Duration::from_millis(100);
/// Events read from the store per step of a stream.
const STREAM_PAGE: u32 = 500;
/// The media type of an event page as one JSON event per line.
pub const NDJSON: &str = "application/x-ndjson";

/// The agent routes.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/agents", post(create).get(list))
        .route("/v1/agents", get(list_all))
        .route("/v1/agents/{id}", get(get_one).delete(delete))
        .route("/v1/agents/{id}/runs", post(start_run))
        .route("/v1/runs/{id}", get(get_run))
        .route("/v1/runs/{id}/events", get(events))
        .route("/v1/runs/{id}/events/stream", get(stream))
        .route("/v1/runs/{id}/cancel", post(cancel))
        .route("/v1/workspaces", post(create_workspace))
}

/// Create a workspace: a sandbox and an agent runtime in it. If the runtime is refused,
/// the sandbox made for it is deleted and the runtime's error is returned.
#[utoipa::path(post, path = "/v1/workspaces", request_body = CreateWorkspaceRequest,
    responses((status = 201, body = Workspace), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn create_workspace(
    State(state): State<AppState>,
    owner: Owner,
    ApiJson(req): ApiJson<CreateWorkspaceRequest>,
) -> Result<(StatusCode, Json<Workspace>), ApiError> {
    let (sandbox, rt) = state.manager.create_workspace(&owner.0, &req).await?;
    Ok((
        StatusCode::CREATED,
        Json(Workspace {
            sandbox: super::sandboxes::view(&state, &sandbox).await,
            agent: agent_runtime::to_api(&rt)?,
        }),
    ))
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
    let recs = state
        .manager
        .list_agent_runtimes(&owner.0, Some(&id))
        .await?;
    Ok(Json(
        recs.iter()
            .map(agent_runtime::to_api)
            .collect::<Result<_, _>>()?,
    ))
}

/// Every agent runtime of the caller, in all its sandboxes.
#[utoipa::path(get, path = "/v1/agents",
    responses((status = 200, body = Vec<AgentRuntime>)))]
pub async fn list_all(
    State(state): State<AppState>,
    owner: Owner,
) -> Result<Json<Vec<AgentRuntime>>, ApiError> {
    let recs = state.manager.list_agent_runtimes(&owner.0, None).await?;
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

/// Cancel a run: the harness's abort, then SIGTERM to every process it started and
/// SIGKILL after `[agents] cancel_grace_secs`, then `cancelled` (a finished run is
/// returned as it is). Answers once the processes are gone.
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
#[into_params(parameter_in = Query)]
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

/// A page of a run's stored events after `after`: a JSON `AgentRunEventPage`, or with
/// `Accept: application/x-ndjson` the same events one JSON `AgentRunEvent` per line (the
/// next `after` is the last line's `seq`; an empty body means none are stored yet).
#[utoipa::path(get, path = "/v1/runs/{id}/events", params(EventsQuery),
    responses(
        (status = 200, description = "The page (JSON), or one event per line with `Accept: application/x-ndjson`",
            content(
                (AgentRunEventPage = "application/json"),
                (AgentRunEvent = "application/x-ndjson"),
            )),
        (status = 404, body = ErrorBody)))]
pub async fn events(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Response, ApiError> {
    let page = event_page(&state, &owner.0, &id, q).await?;
    if !wants_ndjson(&headers) {
        return Ok(Json(page).into_response());
    }
    let mut body = Vec::new();
    for e in &page.events {
        serde_json::to_writer(&mut body, e)
            .map_err(|e| ApiError::internal_from("encoding a run event", &e))?;
        body.push(b'\n');
    }
    Ok(([(http::header::CONTENT_TYPE, NDJSON)], body).into_response())
}

/// Whether the caller asked for NDJSON (and not JSON first).
fn wants_ndjson(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.split(';').next().unwrap_or("").trim())
        .find(|t| *t == NDJSON || *t == "application/json")
        .is_some_and(|t| t == NDJSON)
}

/// The events after `q.after`, with the page's bookkeeping.
async fn event_page(
    state: &AppState,
    owner: &str,
    id: &str,
    q: EventsQuery,
) -> Result<AgentRunEventPage, ApiError> {
    let after = q.after.unwrap_or(0).max(0);
    let (run, events) = state
        .manager
        .agent_run_events(owner, id, after, q.limit.unwrap_or(0))
        .await?;
    let next_after = events.last().map_or(after, |e| e.seq);
    // The run record was read before the events: if it was final then, every event
    // (its `end` last) was stored before this page was read.
    let complete = run.state.is_terminal() && next_after >= run.next_seq - 1;
    Ok(AgentRunEventPage {
        events: events.into_iter().map(to_api).collect(),
        next_after,
        complete,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn accept(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::ACCEPT, v.parse().unwrap());
        h
    }

    #[test]
    fn ndjson_only_when_asked_before_json() {
        assert!(!wants_ndjson(&HeaderMap::new()));
        assert!(!wants_ndjson(&accept("*/*")));
        assert!(!wants_ndjson(&accept("application/json")));
        assert!(wants_ndjson(&accept("application/x-ndjson")));
        assert!(wants_ndjson(&accept(
            "application/x-ndjson; q=1, application/json"
        )));
        assert!(!wants_ndjson(&accept(
            "application/json, application/x-ndjson"
        )));
    }
}
