//! Approvals of agent runs' risky actions: list, read, approve, deny.

use reqwest::Method;
use sandpit_api::{Approval, ApproveRequest, DenyRequest};

use crate::{Client, ClientError};

impl Client {
    /// `GET /v1/approvals`: the caller's approvals, optionally only in `state` (`pending`,
    /// `approved`, `denied`, `expired`) or of run `run`.
    pub async fn list_approvals(
        &self,
        state: Option<&str>,
        run: Option<&str>,
    ) -> Result<Vec<Approval>, ClientError> {
        let mut q: Vec<(&str, &str)> = Vec::new();
        if let Some(s) = state {
            q.push(("state", s));
        }
        if let Some(r) = run {
            q.push(("run", r));
        }
        self.json(self.req(Method::GET, &["approvals"])?.query(&q))
            .await
    }

    /// `GET /v1/approvals/{id}`.
    pub async fn get_approval(&self, id: &str) -> Result<Approval, ClientError> {
        self.json(self.req(Method::GET, &["approvals", id])?).await
    }

    /// `POST /v1/approvals/{id}/approve`: `scope` `once` (default) or `run`.
    pub async fn approve(&self, id: &str, scope: Option<&str>) -> Result<Approval, ClientError> {
        let body = ApproveRequest {
            scope: scope.map(str::to_string),
        };
        self.json(
            self.req(Method::POST, &["approvals", id, "approve"])?
                .json(&body),
        )
        .await
    }

    /// `POST /v1/approvals/{id}/deny`, with a reason told to the sandbox.
    pub async fn deny(&self, id: &str, reason: Option<&str>) -> Result<Approval, ClientError> {
        let body = DenyRequest {
            reason: reason.map(str::to_string),
        };
        self.json(
            self.req(Method::POST, &["approvals", id, "deny"])?
                .json(&body),
        )
        .await
    }
}
