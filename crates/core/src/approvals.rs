//! Approval gates (issue 13, part 6): the daemon's [`ApprovalGate`], which the egress
//! proxy and the credential broker ask before a risky action of a sandbox whose active run
//! has an approval policy naming it, and [`Approvals::ask`], which the agent-run driver
//! also uses for the harness's own permission requests. The action is held while a pending approval is
//! stored (the run goes `waiting_approval`); a person's decision through the API, or the
//! approval's expiry, answers the held action. Approvals belong to the run's owner.
//!
//! The same action asked twice while pending (same capability, target and summary) shares
//! one record, and one decision answers every holder; a run has at most
//! `[approvals] max_pending_per_run` pending, and an action beyond that is refused at once
//! (an `approval_refused` event says why). When every holder of a pending approval goes
//! away (the held connection's client closed it, the harness stopped), the approval ends
//! `abandoned` and can no longer be decided.
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
    Decided, Decision, NewApproval, Requested, RunRecord, Store, now_ms,
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
    /// Most approvals one run may have pending; an action beyond that is refused at once.
    pub max_pending_per_run: u32,
}

impl Default for ApprovalsConfig {
    fn default() -> Self {
        ApprovalsConfig {
            timeout_secs: 300,
            require_approver_role: false,
            max_pending_per_run: 16,
        }
    }
}

/// The holders of one pending approval and their wake-up.
struct Waiter {
    /// Bumped on a decision; each holder watches it.
    wake: tokio::sync::watch::Sender<()>,
    /// How many held actions wait on it.
    holders: usize,
    /// Why it ends `abandoned` when the last holder goes away undecided.
    gone: &'static str,
}

/// The held actions and how to ask about new ones.
pub struct Approvals {
    store: Store,
    max_pending: u32,
    waiting: Mutex<HashMap<String, Waiter>>,
}

/// One holder of a pending approval; dropping it before the answer (the holder gave up:
/// its client went away) leaves the approval, and when it was the last holder ends the
/// approval `abandoned`, so nobody can approve an action nothing waits for any more.
struct Registered<'a> {
    approvals: &'a Approvals,
    id: String,
    wake: tokio::sync::watch::Receiver<()>,
    answered: bool,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let gone = {
            let mut waiting = self.approvals.waiting.lock();
            let Some(w) = waiting.get_mut(&self.id) else {
                return;
            };
            w.holders = w.holders.saturating_sub(1);
            if w.holders > 0 {
                return;
            }
            let gone = w.gone;
            waiting.remove(&self.id);
            gone
        };
        if self.answered {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(approval_id = %self.id, "approvals: no runtime to record the abandonment on");
            return;
        };
        let store = self.approvals.store.clone();
        let id = self.id.clone();
        rt.spawn(async move {
            match store.abandon_approval(&id, gone, now_ms()).await {
                Ok(Some(_)) => tracing::info!(approval_id = %id, reason = gone, "approval abandoned"),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(approval_id = %id, error = %e, "approvals: recording the abandonment failed")
                }
            }
        });
    }
}

/// One action to put to a person, whatever holds it.
pub(crate) struct Ask {
    /// The run that is held.
    pub run_id: String,
    /// What kind of action.
    pub capability: Capability,
    /// What it is about.
    pub target: ApprovalTarget,
    /// One line for the approver, redacted and printable.
    pub summary: String,
    /// The holder's own data (redacted), kept with the record.
    pub detail: serde_json::Value,
    /// When the approval expires unless decided.
    pub expires_at_ms: i64,
    /// Why the approval ends `abandoned` if the holder gives up before a decision.
    pub gone: &'static str,
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
    /// Approvals kept in `store`, at most `max_pending` pending per run.
    pub fn new(store: Store, max_pending: u32) -> Approvals {
        Approvals {
            store,
            max_pending,
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
        let (capability, name, gone) = match &req.capability {
            GateCapability::Egress => (
                Capability::Egress,
                None,
                "the sandbox's client closed the held connection before a decision",
            ),
            GateCapability::Credential { name } => (
                Capability::Credential,
                Some(name.clone()),
                "the held request was dropped before a decision (its client went away)",
            ),
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
        let summary = summary(&req, capability, method.as_deref());
        self.ask(Ask {
            run_id: run.id.clone(),
            capability,
            target,
            summary,
            detail: serde_json::json!({}),
            expires_at_ms: policy.expires_at_ms(now_ms()),
            gone,
        })
        .await
    }

    /// Puts one held action to a person: a standing grant of the run lets it through, the
    /// same action already pending is joined, a run at its limit of pending approvals is
    /// refused at once; otherwise a new approval is waited on until it is decided, expires
    /// or its run ends.
    pub(crate) async fn ask(&self, ask: Ask) -> GateDecision {
        let run_id = ask.run_id.as_str();
        match self
            .store
            .standing_grant(run_id, ask.capability, &ask.target)
            .await
        {
            Ok(Some(grant)) => {
                tracing::info!(run_id, approval_id = %grant.id, "approved for the run already");
                return GateDecision::Approved {
                    approval_id: grant.id,
                };
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(run_id, error = %e, "approvals: standing grants unreadable; the action is refused");
                return refused("sandpit could not check earlier approvals");
            }
        }
        let new = NewApproval {
            id: format!("apr{}", new_id()),
            run_id: ask.run_id.clone(),
            capability: ask.capability,
            target: ask.target,
            summary: ask.summary,
            detail: ask.detail,
            expires_at_ms: ask.expires_at_ms,
        };
        let rec = match self
            .store
            .request_or_join_approval(&new, self.max_pending)
            .await
        {
            Ok(Requested::Created(rec)) => {
                tracing::info!(approval_id = %rec.id, run_id, summary = %rec.summary, "action held for approval");
                rec
            }
            Ok(Requested::Joined(rec)) => {
                tracing::info!(approval_id = %rec.id, run_id, "the same action is pending already: held on its approval");
                rec
            }
            Ok(Requested::TooMany { pending }) => {
                tracing::info!(
                    run_id,
                    pending,
                    "too many approvals pending; the action is refused"
                );
                return refused(format!(
                    "refused at once: the run already has {pending} approvals pending, its limit"
                ));
            }
            Err(e) => {
                tracing::warn!(run_id, error = %e, "approvals: could not record; the action is refused");
                return refused("sandpit could not record the approval request");
            }
        };
        let mut registered = self.register(&rec.id, ask.gone);
        let decision = self.wait(&mut registered, rec.expires_at_ms).await;
        registered.answered = true;
        decision
    }

    /// Adds a holder to approval `id`.
    fn register(&self, id: &str, gone: &'static str) -> Registered<'_> {
        let mut waiting = self.waiting.lock();
        let w = waiting.entry(id.to_string()).or_insert_with(|| Waiter {
            wake: tokio::sync::watch::channel(()).0,
            holders: 0,
            gone,
        });
        w.holders += 1;
        Registered {
            approvals: self,
            id: id.to_string(),
            wake: w.wake.subscribe(),
            answered: false,
        }
    }

    /// Waits until approval `r.id` is final; an expired one is written expired. The
    /// record is read before each wait, so a decision made before the holder registered
    /// is seen too.
    async fn wait(&self, r: &mut Registered<'_>, expires_at_ms: i64) -> GateDecision {
        loop {
            let now = now_ms();
            match self.store.get_approval(&r.id, now).await {
                Ok(Some(rec)) => match rec.state {
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
                    ApprovalState::Abandoned => {
                        return self.refusal(&rec.id, "abandoned: its first asker went away");
                    }
                },
                Ok(None) => return refused("the approval record is gone"),
                Err(e) => {
                    tracing::warn!(approval_id = %r.id, error = %e, "approvals: unreadable");
                    if now >= expires_at_ms {
                        return self.refusal(&r.id, "expired: sandpit could not read the approval");
                    }
                }
            }
            let left = u64::try_from(expires_at_ms.saturating_sub(now_ms())).unwrap_or(0);
            let nap = RECHECK.min(Duration::from_millis(left));
            tokio::select! {
                changed = r.wake.changed() => {
                    if changed.is_err() {
                        tokio::time::sleep(nap).await;
                    }
                }
                _ = tokio::time::sleep(nap) => {}
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

    /// Wakes every held action of approval `id`, if this daemon holds any.
    fn wake(&self, id: &str) {
        if let Some(w) = self.waiting.lock().get(id) {
            w.wake.send_replace(());
        }
    }
}

/// The one line an approver reads.
fn summary(req: &GateRequest, capability: Capability, method: Option<&str>) -> String {
    match &req.capability {
        GateCapability::Credential { name } => {
            let request = match (method, &req.path) {
                (Some(m), Some(p)) => format!(" ({m} {p})"),
                (Some(m), None) => format!(" ({m})"),
                _ => String::new(),
            };
            format!(
                "inject credential {name:?} into a request to {}:{}{request}",
                req.host, req.port
            )
        }
        // One approval lets the whole connection through (the proxy sees only what
        // comes before its decision): say so, rather than let the first request stand
        // for all of them.
        GateCapability::Egress => {
            debug_assert_eq!(capability, Capability::Egress);
            let first = match (method, &req.path) {
                (Some(m), Some(p)) => format!("first request: {m} {p}"),
                _ => "its requests are not visible (TLS or not HTTP)".to_string(),
            };
            format!(
                "connection to {}:{} outside the egress allow-list; approving lets the whole \
                 connection through, every request on it; {first}",
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
                    CoreError::invalid(
                        "state must be pending, approved, denied, expired or abandoned",
                    )
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

    /// Decides the caller's pending approval `id` as `by` (the deciding API key's id):
    /// approve (for this action, or the run) or deny with a reason. One already decided,
    /// expired or abandoned is a conflict.
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
