//! Every request the server received, kept in memory and, if asked, appended to a JSON
//! lines file as it arrives (a test that runs the binary in a namespace reads that file).

use crate::wire::Api;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;
use tokio::sync::Notify;

/// One request as received, with what the server decided to answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RecordedRequest {
    /// Arrival order, from 1.
    pub seq: u64,
    /// Milliseconds since the Unix epoch when the request's body had been read.
    pub time_ms: u64,
    pub method: String,
    pub path: String,
    /// The query string without `?`, when there is one (Claude Code sends `beta=true`).
    pub query: Option<String>,
    /// Header names in lower case; repeated headers joined with `, `.
    pub headers: BTreeMap<String, String>,
    pub api: Api,
    /// The script turn answered; `None` for side requests, turns past the script and
    /// requests that are not model calls.
    pub turn: Option<usize>,
    /// Whether this was a model request offering no tools (answered with the side text).
    pub side: bool,
    pub stream: bool,
    /// The HTTP status answered.
    pub status: u16,
    /// Why the answer was not the scripted one, if it was not.
    pub note: Option<String>,
    /// The body as JSON, or as a JSON string when it was not JSON (`null` when empty).
    pub body: Value,
}

impl RecordedRequest {
    /// A header's value by its (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    /// The API key the client sent, from `x-api-key` or `Authorization: Bearer`.
    pub fn api_key(&self) -> Option<&str> {
        self.header("x-api-key").or_else(|| {
            self.header("authorization")
                .and_then(|v| v.strip_prefix("Bearer "))
        })
    }
}

/// The shared list of requests.
pub(crate) struct Recorder {
    requests: Mutex<Vec<RecordedRequest>>,
    log: Option<Mutex<std::fs::File>>,
    arrived: Notify,
}

impl Recorder {
    pub(crate) fn new(log: Option<std::fs::File>) -> Self {
        Recorder {
            requests: Mutex::default(),
            log: log.map(Mutex::new),
            arrived: Notify::new(),
        }
    }

    pub(crate) fn push(&self, req: RecordedRequest) {
        if let Some(log) = &self.log {
            match serde_json::to_string(&req) {
                Ok(mut line) => {
                    line.push('\n');
                    let mut file = log.lock();
                    // One write per line, so a reader never sees half a request.
                    if let Err(e) = file.write_all(line.as_bytes()).and_then(|()| file.flush()) {
                        tracing::warn!(error = %e, "writing the request log");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "encoding a request for the log"),
            }
        }
        self.requests.lock().push(req);
        self.arrived.notify_waiters();
    }

    pub(crate) fn all(&self) -> Vec<RecordedRequest> {
        self.requests.lock().clone()
    }

    /// Waits until `pred` holds for the requests so far, or `timeout` passes.
    pub(crate) async fn wait_for(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&[RecordedRequest]) -> bool,
    ) -> Option<Vec<RecordedRequest>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Registered before the check, so a push between check and wait is not missed.
            let arrived = self.arrived.notified();
            {
                let all = self.requests.lock();
                if pred(&all) {
                    return Some(all.clone());
                }
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return None;
            }
        }
    }
}
