//! Approval gates (issue 13, part 6): the daemon's [`ApprovalGate`], which the egress
//! proxy and the credential broker ask before a risky action of a sandbox whose active run
//! has an approval policy naming it. The action is held while a pending approval is
//! stored (the run goes `waiting_approval`); a person's decision through the API, or the
//! approval's expiry, answers the held action. Approvals belong to the run's owner.
//!
//! Fail closed: when the store cannot record or read an approval, the action is refused;
//! nothing held goes on without an `approved` record.

use crate::error::CoreError;
use crate::manager::{Manager, new_id};
use futures::future::BoxFuture;
use parking_lot::Mutex;
use sandpit_agentrun::ApprovalPolicy;
use sandpit_net::approval::{ApprovalGate, GateCapability, GateDecision, GateRequest};
use sandpit_store::{
    AgentRuntimeState, ApprovalRecord, ApprovalScope, ApprovalState, ApprovalTarget, Capability,
    Decided, Decision, NewApproval, RunRecord, Store, now_ms,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How often a held action looks at its approval even without a wake-up (a decision made
/// by another path, a run that ended).
const RECHECK: Duration = Duration::from_secs(1);

/// Daemon settings for approvals (`[approvals]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalsConfig {
    /// Seconds an approval waits for a decision when the runtime's policy names none.
    pub timeout_secs: u64,
    /// Only API keys with the `approver` role may decide approvals.
    pub require_approver_role: bool,
}

impl Default for ApprovalsConfig {
    fn default() -> Self {
        ApprovalsConfig {
            timeout_secs: 300,
            require_approver_role: false,
        }
    }
}

/// A held action's wake-up.
#[derive(Default)]
struct Waiter {
    notify: tokio::sync::Notify,
}

/// The held actions and how to ask about new ones.
pub struct Approvals {
    store: Store,
    waiting: Mutex<HashMap<String, Arc<Waiter>>>,
}

/// Takes a waiter out of the map however its held action ends.
struct Registered<'a> {
    approvals: &'a Approvals,
    id: String,
    waiter: Arc<Waiter>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.approvals.waiting.lock().remove(&self.id);
    }
}

/// Whom an action must be asked of.
enum Gating {
    /// No active runtime's policy holds the action.
    NotGated,
    /// A policy holds it, but no run of such a runtime is active to ask.
    NoRun,
    /// This run, under this policy, is asked.
    Ask(ApprovalPolicy, Box<RunRecord>),
}

/// A refusal with no record behind it.
fn refused(reason: impl Into<String>) -> GateDecision {
    GateDecision::Refused {
        approval_id: None,
        reason: reason.into(),
    }
}

impl Approvals {
    /// Approvals kept in `store`.
    pub fn new(store: Store) -> Approvals {
        Approvals {
            store,
            waiting: Mutex::new(HashMap::new()),
        }
    }

    /// Which active run of `sandbox_id` must be asked about an action that the policies
    /// matching `gates` hold. Every active runtime's policy counts (one without gates
    /// cannot switch off another's); only runtimes whose policy gates the action have
    /// their active run looked up.
    async fn gating_run(
        &self,
        sandbox_id: &str,
        gates: impl Fn(&ApprovalPolicy) -> bool,
    ) -> Result<Gating, CoreError> {
        let mut gated = false;
        for rt in self
            .store
            .list_agent_runtimes(None, Some(sandbox_id))
            .await?
        {
            if rt.state != AgentRuntimeState::Active {
                continue;
            }
            let policy: ApprovalPolicy = serde_json::from_value(rt.approval_policy.clone())
                .map_err(|e| {
                    CoreError::internal_from(format!("agent runtime {}: approval policy", rt.id), e)
                })?;
            if !gates(&policy) {
                continue;
            }
            gated = true;
            if let Some(run) = self.store.active_run(&rt.id).await? {
                return Ok(Gating::Ask(policy, Box::new(run)));
            }
        }
        Ok(if gated {
            Gating::NoRun
        } else {
            Gating::NotGated
        })
    }

    /// Decides on one held action: not gated, a standing grant, or a new approval waited
    /// on until it is decided or expires.
    pub async fn decide(&self, req: GateRequest) -> GateDecision {
        let method = req.method.as_deref().map(str::to_ascii_uppercase);
        let gates = |p: &ApprovalPolicy| match &req.capability {
            GateCapability::Egress => p.egress,
            GateCapability::Credential { name } => {
                p.credential_needs_approval(name, method.as_deref().unwrap_or(""))
            }
        };
        let (policy, run) = match self.gating_run(&req.sandbox_id, gates).await {
            Ok(Gating::Ask(policy, run)) => (policy, run),
            Ok(Gating::NotGated) => return GateDecision::NotGated,
            // A gated credential stays gated between runs: the secret belongs to the
            // sandbox, and code a run left behind must not get it unasked.
            Ok(Gating::NoRun) => {
                return match &req.capability {
                    // Outside the allow-list and nobody to ask: the usual refusal.
                    GateCapability::Egress => GateDecision::NotGated,
                    GateCapability::Credential { name } => refused(format!(
                        "credential {name:?} needs a person's approval, and no run of this \
                         sandbox is active to ask it for"
                    )),
                };
            }
            Err(e) => {
                tracing::warn!(sandbox_id = %req.sandbox_id, error = %e.chain(),
                    "approvals: cannot read the sandbox's runs; the action is refused");
                return refused("sandpit could not check the approval policy");
            }
        };
        let (capability, name) = match &req.capability {
            GateCapability::Egress => (Capability::Egress, None),
            GateCapability::Credential { name } => (Capability::Credential, Some(name.clone())),
        };
        let target = ApprovalTarget {
            host: Some(format!("{}:{}", req.host, req.port)),
            // A connection is approved whatever it later sends; a credential per method.
            method: if capability == Capability::Credential {
                method.clone()
            } else {
                None
            },
            path: req.path.clone(),
            name,
        };
        match self
            .store
            .standing_grant(&run.id, capability, &target)
            .await
        {
            Ok(Some(grant)) => {
                tracing::info!(run_id = %run.id, approval_id = %grant.id, "approved for the run already");
                return GateDecision::Approved {
                    approval_id: grant.id,
                };
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(run_id = %run.id, error = %e, "approvals: standing grants unreadable; the action is refused");
                return refused("sandpit could not check earlier approvals");
            }
        }
        let summary = summary(&req, capability, method.as_deref());
        let id = format!("apr{}", new_id());
        let registered = self.register(&id);
        let new = NewApproval {
            id: id.clone(),
            run_id: run.id.clone(),
            capability,
            target,
            summary,
            detail: serde_json::json!({}),
            expires_at_ms: policy.expires_at_ms(now_ms()),
        };
        let rec = match self.store.request_approval(&new).await {
            Ok(rec) => rec,
            Err(e) => {
                tracing::warn!(run_id = %run.id, error = %e, "approvals: could not record; the action is refused");
                return refused("sandpit could not record the approval request");
            }
        };
        tracing::info!(approval_id = %rec.id, run_id = %run.id, summary = %rec.summary, "action held for approval");
        self.wait(&registered, rec.expires_at_ms).await
    }

    fn register(&self, id: &str) -> Registered<'_> {
        let waiter = Arc::new(Waiter::default());
        self.waiting.lock().insert(id.to_string(), waiter.clone());
        Registered {
            approvals: self,
            id: id.to_string(),
            waiter,
        }
    }

    /// Waits until approval `r.id` is final; an expired one is written expired.
    async fn wait(&self, r: &Registered<'_>, expires_at_ms: i64) -> GateDecision {
        loop {
            let left = u64::try_from(expires_at_ms.saturating_sub(now_ms())).unwrap_or(0);
            let nap = RECHECK.min(Duration::from_millis(left));
            tokio::select! {
                _ = r.waiter.notify.notified() => {}
                _ = tokio::time::sleep(nap) => {}
            }
            let now = now_ms();
            let rec = match self.store.get_approval(&r.id, now).await {
                Ok(Some(rec)) => rec,
                Ok(None) => return refused("the approval record is gone"),
                Err(e) => {
                    tracing::warn!(approval_id = %r.id, error = %e, "approvals: unreadable");
                    if now >= expires_at_ms {
                        return self.refusal(&r.id, "expired: sandpit could not read the approval");
                    }
                    continue;
                }
            };
            match rec.state {
                ApprovalState::Pending => {}
                ApprovalState::Approved => {
                    return GateDecision::Approved {
                        approval_id: rec.id,
                    };
                }
                ApprovalState::Denied => {
                    let reason = match rec.reason {
                        Some(why) => format!("denied: {why}"),
                        None => "denied".to_string(),
                    };
                    return self.refusal(&rec.id, &reason);
                }
                ApprovalState::Expired => {
                    // Read as expired but maybe not written yet: write it (with its event).
                    if let Err(e) = self.store.expire_approvals(now).await {
                        tracing::warn!(approval_id = %rec.id, error = %e, "approvals: writing the expiry failed");
                    }
                    return self.refusal(&rec.id, "expired: nobody decided in time");
                }
            }
        }
    }

    fn refusal(&self, id: &str, reason: &str) -> GateDecision {
        tracing::info!(approval_id = id, reason, "held action refused");
        GateDecision::Refused {
            approval_id: Some(id.to_string()),
            reason: reason.to_string(),
        }
    }

    /// Wakes the held action of approval `id`, if this daemon holds one.
    fn wake(&self, id: &str) {
        if let Some(w) = self.waiting.lock().get(id) {
            w.notify.notify_one();
        }
    }
}

/// The one line an approver reads.
fn summary(req: &GateRequest, capability: Capability, method: Option<&str>) -> String {
    let request = match (method, &req.path) {
        (Some(m), Some(p)) => format!(" ({m} {p})"),
        (Some(m), None) => format!(" ({m})"),
        _ => String::new(),
    };
    match &req.capability {
        GateCapability::Credential { name } => format!(
            "inject credential {name:?} into a request to {}:{}{request}",
            req.host, req.port
        ),
        GateCapability::Egress => {
            debug_assert_eq!(capability, Capability::Egress);
            format!(
                "connect to {}:{} outside the egress allow-list{request}",
                req.host, req.port
            )
        }
    }
}

/// The gate as the proxy and the broker hold it.
pub struct Gate(pub Arc<Approvals>);

impl ApprovalGate for Gate {
    fn decide(&self, req: GateRequest) -> BoxFuture<'static, GateDecision> {
        let approvals = self.0.clone();
        Box::pin(async move { approvals.decide(req).await })
    }
}

/// The API view of an approval.
pub fn to_api(a: &ApprovalRecord) -> sandpit_api::Approval {
    sandpit_api::Approval {
        id: a.id.clone(),
        run_id: a.run_id.clone(),
        runtime_id: a.runtime_id.clone(),
        sandbox_id: a.sandbox_id.clone(),
        capability: a.capability.as_str().into(),
        host: a.target.host.clone(),
        method: a.target.method.clone(),
        path: a.target.path.clone(),
        name: a.target.name.clone(),
        summary: a.summary.clone(),
        scope: a.scope.as_str().into(),
        state: a.state.as_str().into(),
        reason: a.reason.clone(),
        decided_by: a.decided_by.clone(),
        decided_at_ms: a.decided_at_ms,
        expires_at_ms: a.expires_at_ms,
        created_at_ms: a.created_at_ms,
    }
}

/// Checks a runtime request's approval policy and gives it back as stored: a missing
/// timeout is the daemon's.
pub(crate) fn checked_policy(
    given: Option<&serde_json::Value>,
    cfg: &ApprovalsConfig,
) -> Result<serde_json::Value, CoreError> {
    let mut value = given.cloned().unwrap_or_else(|| serde_json::json!({}));
    let Some(obj) = value.as_object_mut() else {
        return Err(CoreError::invalid("approval_policy must be an object"));
    };
    obj.entry("timeout_secs")
        .or_insert_with(|| serde_json::json!(cfg.timeout_secs));
    let policy: ApprovalPolicy = serde_json::from_value(value)
        .map_err(|e| CoreError::invalid(format!("approval_policy: {e}")))?;
    policy
        .validate()
        .map_err(|e| CoreError::invalid(format!("approval_policy: {e}")))?;
    serde_json::to_value(&policy).map_err(|e| CoreError::internal_from("approval policy", e))
}

impl Manager {
    /// The gate to install into the egress proxy and the broker.
    pub fn approval_gate(&self) -> Arc<dyn ApprovalGate> {
        Arc::new(Gate(self.approvals.clone()))
    }

    /// Whether deciding approvals needs the `approver` role.
    pub fn approver_role_required(&self) -> bool {
        self.cfg.approvals.require_approver_role
    }

    /// The caller's approval `id`; another owner's is not found.
    pub async fn approval(&self, owner: &str, id: &str) -> Result<ApprovalRecord, CoreError> {
        match self.store.get_approval(id, now_ms()).await? {
            Some(a) if a.owner == owner => Ok(a),
            _ => Err(CoreError::not_found(format!("approval {id} not found"))),
        }
    }

    /// The caller's approvals, oldest first, optionally only in `state` or of run `run`.
    pub async fn list_approvals(
        &self,
        owner: &str,
        state: Option<&str>,
        run: Option<&str>,
    ) -> Result<Vec<ApprovalRecord>, CoreError> {
        let state: Option<ApprovalState> = state
            .map(|s| {
                s.parse().map_err(|_| {
                    CoreError::invalid("state must be pending, approved, denied or expired")
                })
            })
            .transpose()?;
        let now = now_ms();
        let all = match run {
            Some(run_id) => match self.store.get_run(run_id).await? {
                Some(r) if r.owner == owner => self.store.list_run_approvals(run_id, now).await?,
                _ => return Err(CoreError::not_found(format!("run {run_id} not found"))),
            },
            None => self.store.list_owner_approvals(owner, now).await?,
        };
        Ok(all
            .into_iter()
            .filter(|a| state.is_none_or(|s| a.state == s))
            .collect())
    }

    /// Decides the caller's pending approval `id` as `by`: approve (for this action, or
    /// the run) or deny with a reason. One already decided, or expired, is a conflict.
    pub async fn decide_approval(
        &self,
        owner: &str,
        id: &str,
        decision: Decision,
        reason: Option<String>,
        by: &str,
    ) -> Result<ApprovalRecord, CoreError> {
        self.approval(owner, id).await?;
        let outcome = self
            .store
            .decide_approval_with_reason(id, decision, by, reason.as_deref(), now_ms())
            .await?;
        match outcome {
            Decided::Decided(a) => {
                tracing::info!(approval_id = id, state = %a.state, scope = %a.scope, by, "approval decided");
                self.approvals.wake(id);
                Ok(a)
            }
            Decided::Expired(a) => {
                self.approvals.wake(id);
                Err(CoreError::conflict(format!(
                    "approval {} expired before it was decided",
                    a.id
                )))
            }
            Decided::AlreadyDecided(a) => Err(CoreError::conflict(format!(
                "approval {} is already {}",
                a.id, a.state
            ))),
        }
    }
}

/// Parses an approve request's scope.
pub fn parse_scope(scope: Option<&str>) -> Result<ApprovalScope, CoreError> {
    scope
        .unwrap_or("once")
        .parse()
        .map_err(|_| CoreError::invalid("scope must be \"once\" or \"run\""))
}

#[cfg(test)]
#[path = "approvals_tests.rs"]
mod tests;
