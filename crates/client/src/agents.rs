//! Agent runtimes, their runs and run events, and workspaces (a sandbox with a runtime).
//!
//! [`Client::follow_run`] reads a run's events live: it resumes a cut stream where it
//! stopped, so its caller sees every sequence number once, in order, until the run ends.

use std::collections::VecDeque;
use std::time::Duration;

use reqwest::Method;
use sandpit_api::{
    AgentRun, AgentRunEvent, AgentRunEventPage, AgentRuntime, CreateAgentRequest,
    CreateWorkspaceRequest, StartRunRequest, Workspace,
};

use crate::{Client, ClientError};

/// The states a run does not leave.
pub const TERMINAL_STATES: [&str; 4] = ["succeeded", "failed", "cancelled", "timed_out"];
/// Events asked for per page when a gap is filled or a finished run is read to its end.
const FILL_PAGE: u32 = 1000;
/// A stream silent this long is taken as cut (the daemon sends a keep-alive every 15 s).
const SILENCE: Duration = Duration::from_secs(60);
/// Reconnects in a row that deliver nothing before [`RunFollower::next_event`] gives up.
const MAX_RETRIES: u32 = 8;
/// The first pause before a reconnect; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(3);

/// Whether a run in `state` is finished.
pub fn is_terminal(state: &str) -> bool {
    TERMINAL_STATES.contains(&state)
}

impl Client {
    /// `POST /v1/sandboxes/{id}/agents`: creates an agent runtime (a harness) in a sandbox.
    pub async fn create_agent(
        &self,
        sandbox_id: &str,
        req: &CreateAgentRequest,
    ) -> Result<AgentRuntime, ClientError> {
        self.json(
            self.req(Method::POST, &["sandboxes", sandbox_id, "agents"])?
                .json(req),
        )
        .await
    }

    /// `GET /v1/sandboxes/{id}/agents`, or with no sandbox `GET /v1/agents`: the caller's
    /// agent runtimes.
    pub async fn list_agents(
        &self,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<AgentRuntime>, ClientError> {
        let rb = match sandbox_id {
            Some(id) => self.req(Method::GET, &["sandboxes", id, "agents"])?,
            None => self.req(Method::GET, &["agents"])?,
        };
        self.json(rb).await
    }

    /// `GET /v1/agents/{id}`.
    pub async fn get_agent(&self, id: &str) -> Result<AgentRuntime, ClientError> {
        self.json(self.req(Method::GET, &["agents", id])?).await
    }

    /// `DELETE /v1/agents/{id}`: ends the runtime; its active run is cancelled.
    pub async fn delete_agent(&self, id: &str) -> Result<(), ClientError> {
        self.send(self.req(Method::DELETE, &["agents", id])?)
            .await
            .map(drop)
    }

    /// `POST /v1/agents/{id}/runs`: starts a run (`mode` `fresh` or `continue`). A request
    /// with an idempotency key seen before returns that run instead of a new one.
    pub async fn start_run(
        &self,
        agent_id: &str,
        req: &StartRunRequest,
    ) -> Result<AgentRun, ClientError> {
        self.json(
            self.req(Method::POST, &["agents", agent_id, "runs"])?
                .json(req),
        )
        .await
    }

    /// `GET /v1/runs/{id}`.
    pub async fn get_run(&self, id: &str) -> Result<AgentRun, ClientError> {
        self.json(self.req(Method::GET, &["runs", id])?).await
    }

    /// `POST /v1/runs/{id}/cancel`: stops the harness and marks the run cancelled (a
    /// finished run is returned as it is).
    pub async fn cancel_run(&self, id: &str) -> Result<AgentRun, ClientError> {
        self.json(self.req(Method::POST, &["runs", id, "cancel"])?)
            .await
    }

    /// `GET /v1/runs/{id}/events`: the stored events with a sequence number above `after`,
    /// at most `limit` of them (the daemon's default without one).
    pub async fn run_events(
        &self,
        id: &str,
        after: i64,
        limit: Option<u32>,
    ) -> Result<AgentRunEventPage, ClientError> {
        let mut query = vec![("after", after.to_string())];
        if let Some(limit) = limit {
            query.push(("limit", limit.to_string()));
        }
        self.json(
            self.req(Method::GET, &["runs", id, "events"])?
                .query(&query),
        )
        .await
    }

    /// `POST /v1/workspaces`: a sandbox and an agent runtime in it, in one call (no
    /// sandbox is left behind if the runtime is refused).
    pub async fn create_workspace(
        &self,
        req: &CreateWorkspaceRequest,
    ) -> Result<Workspace, ClientError> {
        self.json(self.req(Method::POST, &["workspaces"])?.json(req))
            .await
    }

    /// Follows run `id`'s events from the one after `after` (0: from the first) until
    /// the run has finished and its last event was returned. Dropping the follower stops
    /// reading only; the run goes on.
    pub fn follow_run(&self, id: &str, after: i64) -> RunFollower {
        RunFollower {
            client: self.clone(),
            run_id: id.to_string(),
            last: after.max(0),
            pending: VecDeque::new(),
            conn: None,
            parser: SseParser::default(),
            done: false,
            failures: 0,
            final_run: None,
        }
    }
}

/// A live read of a run's events from [`Client::follow_run`].
///
/// It reads the server-sent event stream; when the connection is cut it reconnects with
/// `Last-Event-ID` set to the last sequence it returned, drops events it has returned
/// already, and fills a gap in the sequence from the pages route. When a stream ends it
/// asks for the run: a finished run is read to its last stored event, then
/// [`RunFollower::next_event`] returns `None` and [`RunFollower::final_run`] is set.
#[derive(Debug)]
pub struct RunFollower {
    client: Client,
    run_id: String,
    /// The last sequence number returned (or the caller's starting point).
    last: i64,
    pending: VecDeque<AgentRunEvent>,
    conn: Option<reqwest::Response>,
    parser: SseParser,
    done: bool,
    /// Connections in a row that failed or ended without delivering an event.
    failures: u32,
    final_run: Option<AgentRun>,
}

impl RunFollower {
    /// The run being followed.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The last sequence number returned so far (the `after` to resume from).
    pub fn last_seq(&self) -> i64 {
        self.last
    }

    /// The run as it finished, once [`RunFollower::next_event`] has returned `None`.
    pub fn final_run(&self) -> Option<&AgentRun> {
        self.final_run.as_ref()
    }

    /// The next event, each sequence number exactly once and in order; `None` once the
    /// run has finished and every event was returned.
    pub async fn next_event(&mut self) -> Result<Option<AgentRunEvent>, ClientError> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                self.last = e.seq;
                return Ok(Some(e));
            }
            if self.done {
                return Ok(None);
            }
            if self.conn.is_none() {
                self.connect().await?;
                continue;
            }
            let read = match self.conn.as_mut() {
                Some(conn) => tokio::time::timeout(SILENCE, conn.chunk()).await,
                None => continue,
            };
            match read {
                Ok(Ok(Some(bytes))) => {
                    for data in self.parser.feed(&bytes) {
                        let event: AgentRunEvent = serde_json::from_str(&data)
                            .map_err(|e| ClientError::Decode(format!("run event {data:?}: {e}")))?;
                        self.accept(event).await?;
                    }
                }
                // The stream ended (the daemon ends it after the run's last event), was
                // cut, or went silent: whether the run is over decides what comes next.
                // A transport error here is a cut connection, handled by resuming.
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                    self.conn = None;
                    self.parser = SseParser::default();
                    self.after_stream().await?;
                }
            }
        }
    }

    /// Opens the stream after the last sequence returned; refusals (404, 401, ...) are
    /// returned, failures to connect are retried with backoff.
    async fn connect(&mut self) -> Result<(), ClientError> {
        loop {
            let next_known = self.last_known();
            let rb = self
                .client
                .req(Method::GET, &["runs", &self.run_id, "events", "stream"])?
                .header("last-event-id", next_known.to_string());
            match self.client.send(rb).await {
                Ok(resp) => {
                    self.conn = Some(resp);
                    return Ok(());
                }
                Err(e) if retryable(&e) && self.failures < MAX_RETRIES => {
                    self.backoff().await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The highest sequence returned or queued.
    fn last_known(&self) -> i64 {
        self.pending.back().map_or(self.last, |e| e.seq)
    }

    /// Queues one streamed event: a duplicate is dropped, a gap before it filled first.
    async fn accept(&mut self, event: AgentRunEvent) -> Result<(), ClientError> {
        let known = self.last_known();
        if event.seq <= known {
            return Ok(());
        }
        if event.seq > known + 1 {
            self.fill(Some(event.seq - 1)).await?;
            // The stream serves only stored events, so the pages hold every one before it.
            if self.last_known() != event.seq - 1 {
                return Err(ClientError::Protocol(format!(
                    "run {}: events {}..{} are missing from the pages",
                    self.run_id,
                    self.last_known() + 1,
                    event.seq - 1
                )));
            }
        }
        self.failures = 0;
        self.pending.push_back(event);
        Ok(())
    }

    /// Queues the stored events after the last known one, up to `upto` (or all).
    async fn fill(&mut self, upto: Option<i64>) -> Result<(), ClientError> {
        loop {
            let after = self.last_known();
            if upto.is_some_and(|u| after >= u) {
                return Ok(());
            }
            let page = self
                .client
                .run_events(&self.run_id, after, Some(FILL_PAGE))
                .await?;
            let mut progressed = false;
            for e in page.events {
                if e.seq <= self.last_known() || upto.is_some_and(|u| e.seq > u) {
                    continue;
                }
                if e.seq != self.last_known() + 1 {
                    return Err(ClientError::Protocol(format!(
                        "run {}: event {} follows {} in a page",
                        self.run_id,
                        e.seq,
                        self.last_known()
                    )));
                }
                self.pending.push_back(e);
                progressed = true;
            }
            if !progressed {
                // Nothing more is stored yet (or the page was empty): what is missing
                // comes with the stream.
                return Ok(());
            }
        }
    }

    /// After a stream ended: a finished run is read to its end, else the stream is
    /// opened again.
    async fn after_stream(&mut self) -> Result<(), ClientError> {
        let run = match self.client.get_run(&self.run_id).await {
            Ok(run) => run,
            Err(e) if retryable(&e) && self.failures < MAX_RETRIES => {
                self.backoff().await;
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        if is_terminal(&run.state) {
            self.fill(None).await?;
            if self.last_known() < run.events {
                return Err(ClientError::Protocol(format!(
                    "run {} finished with {} events, but only {} could be read",
                    self.run_id,
                    run.events,
                    self.last_known()
                )));
            }
            self.final_run = Some(run);
            self.done = true;
            return Ok(());
        }
        // A stream that ends while the run goes on was cut; pause if it keeps happening.
        self.failures += 1;
        if self.failures > MAX_RETRIES {
            return Err(ClientError::Protocol(format!(
                "the event stream of run {} keeps ending while the run goes on",
                self.run_id
            )));
        }
        if self.failures > 1 {
            self.backoff().await;
        }
        Ok(())
    }

    async fn backoff(&mut self) {
        self.failures += 1;
        let factor = 1u32 << self.failures.min(6);
        let pause = (FIRST_BACKOFF * factor).min(MAX_BACKOFF);
        tokio::time::sleep(pause).await;
    }
}

/// Whether a failed call may succeed when tried again.
fn retryable(e: &ClientError) -> bool {
    match e {
        ClientError::Http(_) => true,
        ClientError::Api { status, .. } => matches!(status, 502..=504),
        _ => false,
    }
}

/// The `data` of server-sent events, from the bytes as they arrive.
#[derive(Debug, Default)]
struct SseParser {
    /// Bytes of a line not yet complete.
    partial: Vec<u8>,
    /// `data` lines of the event being read.
    data: Vec<String>,
}

impl SseParser {
    /// Takes more bytes; returns the data of each event they complete.
    fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.partial.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.partial.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.partial.drain(..=nl).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8_lossy(&line);
            if line.is_empty() {
                if !self.data.is_empty() {
                    out.push(self.data.join("\n"));
                    self.data.clear();
                }
            } else if let Some(v) = line.strip_prefix("data:") {
                self.data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
            }
            // `id`, `event`, `retry` and comments (keep-alives) carry nothing the data
            // does not: the event JSON holds its own sequence number and kind.
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_are_cut_at_blank_lines_whatever_the_chunks() {
        let text = ": keep-alive\n\nid: 1\nevent: status\ndata: {\"a\":1}\n\nid: 2\r\ndata: x\r\ndata: y\r\n\r\n";
        for split in 0..text.len() {
            let mut p = SseParser::default();
            let mut got = p.feed(&text.as_bytes()[..split]);
            got.extend(p.feed(&text.as_bytes()[split..]));
            assert_eq!(got, vec!["{\"a\":1}".to_string(), "x\ny".to_string()]);
        }
    }

    #[test]
    fn terminal_states() {
        assert!(is_terminal("cancelled"));
        assert!(is_terminal("timed_out"));
        assert!(!is_terminal("running"));
        assert!(!is_terminal("waiting_approval"));
    }
}
