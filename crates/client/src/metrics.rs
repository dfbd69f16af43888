//! The metrics history of a sandbox.

use reqwest::Method;
use sandpit_api::metrics::SandboxMetrics;

use crate::{Client, ClientError};

impl Client {
    /// `GET /v1/sandboxes/{id}/metrics`: the samples taken in `[start_ms, end_ms)` (unix
    /// milliseconds; defaults: every sample kept, until now), oldest first.
    pub async fn sandbox_metrics(
        &self,
        id: &str,
        start_ms: Option<i64>,
        end_ms: Option<i64>,
    ) -> Result<SandboxMetrics, ClientError> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(s) = start_ms {
            query.push(("start", s.to_string()));
        }
        if let Some(e) = end_ms {
            query.push(("end", e.to_string()));
        }
        self.json(
            self.req(Method::GET, &["sandboxes", id, "metrics"])?
                .query(&query),
        )
        .await
    }
}
