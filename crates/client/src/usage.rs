//! Usage metering: per owner and period, per sandbox, and execution records.

use reqwest::Method;
use sandpit_api::usage::{ExecutionList, SandboxUsage, UsageSummary};

use crate::{Client, ClientError};

impl Client {
    /// `GET /v1/usage`: what the caller (or, with the admin key, `owner`) used in
    /// `[from_ms, to_ms)` (unix milliseconds; defaults: everything until now).
    pub async fn usage(
        &self,
        from_ms: Option<i64>,
        to_ms: Option<i64>,
        owner: Option<&str>,
    ) -> Result<UsageSummary, ClientError> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(f) = from_ms {
            query.push(("from", f.to_string()));
        }
        if let Some(t) = to_ms {
            query.push(("to", t.to_string()));
        }
        if let Some(o) = owner {
            query.push(("owner", o.to_string()));
        }
        self.json(self.req(Method::GET, &["usage"])?.query(&query))
            .await
    }

    /// `GET /v1/sandboxes/{id}/usage`: active seconds, CPU, memory peak and disk of one
    /// sandbox (also after it was deleted).
    pub async fn sandbox_usage(&self, id: &str) -> Result<SandboxUsage, ClientError> {
        self.json(self.req(Method::GET, &["sandboxes", id, "usage"])?)
            .await
    }

    /// `GET /v1/sandboxes/{id}/executions`: one page of execution records, newest first.
    pub async fn executions(
        &self,
        id: &str,
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<ExecutionList, ClientError> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(l) = limit {
            query.push(("limit", l.to_string()));
        }
        if let Some(c) = cursor {
            query.push(("cursor", c.to_string()));
        }
        self.json(
            self.req(Method::GET, &["sandboxes", id, "executions"])?
                .query(&query),
        )
        .await
    }
}
