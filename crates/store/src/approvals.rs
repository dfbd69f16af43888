//! Approvals: a run's request for a person's decision on a risky action, kept after the
//! decision.
//!
//! The store keeps a run's state in step with its approvals, in the same transactions:
//! a request moves a `running` run to `waiting_approval`; a decision or expiry that leaves
//! no live pending approval moves it back to `running`; a run that ends expires what is
//! still pending. Each request and each decision (or expiry) appends its event
//! (`approval_requested`, `approval_decided`, payload the [`ApprovalRecord`]).
//!
//! Expiry: a pending approval whose `expires_at_ms` has passed reads as `expired`, cannot
//! be decided (a decision on it expires it), and is written `expired` by
//! [`Store::expire_approvals`], which the daemon calls on its tick to refuse the held actions.

use serde::{Deserialize, Serialize};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection};

use crate::run_events::{
    EVENT_APPROVAL_DECIDED, EVENT_APPROVAL_REFUSED, EVENT_APPROVAL_REQUESTED, Gate, push_event,
};
use crate::runs::{RunState, get_run_in};
use crate::{Store, StoreError, now_ms};

const APPROVAL_COLUMNS: &str = "id, run_id, runtime_id, sandbox_id, owner, capability, host, \
     method, path, target_name, summary, detail, scope, state, decided_by, decided_at_ms, \
     expires_at_ms, created_at_ms, reason";

stored_enum! {
    /// What kind of action waits for a person.
    pub enum Capability ("approval capability") {
        /// An outbound connection to a host outside the sandbox's egress allow-list.
        Egress = "egress",
        /// The broker injecting a named credential into a request.
        Credential = "credential",
        /// The harness's own permission request (a tool it wants to use).
        HarnessPermission = "harness_permission",
    }
}

stored_enum! {
    /// How far an approval reaches.
    pub enum ApprovalScope ("approval scope") {
        /// The one action it was asked for.
        Once = "once",
        /// The same capability and target for the rest of the run.
        Run = "run",
    }
}

stored_enum! {
    /// Where an approval is; all but `Pending` are final.
    pub enum ApprovalState ("approval state") {
        /// Waiting for a person.
        Pending = "pending",
        /// Allowed.
        Approved = "approved",
        /// Refused.
        Denied = "denied",
        /// Nobody decided in time, or its run ended first; refused.
        Expired = "expired",
        /// What asked went away before a decision (a held connection's client closed it,
        /// the harness stopped); nothing was let through, and it can no longer be decided.
        Abandoned = "abandoned",
    }
}

/// What an approval is about. Hosts are stored lowercase and methods uppercase.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalTarget {
    /// Destination host (with `:port` if the caller includes one).
    pub host: Option<String>,
    /// HTTP method, when known.
    pub method: Option<String>,
    /// HTTP path, when known; shown to the approver, not part of a standing grant's match.
    pub path: Option<String>,
    /// The credential's name, or the harness tool's.
    pub name: Option<String>,
}

impl ApprovalTarget {
    fn normalized(&self) -> ApprovalTarget {
        ApprovalTarget {
            host: self.host.as_ref().map(|h| h.to_ascii_lowercase()),
            method: self.method.as_ref().map(|m| m.to_ascii_uppercase()),
            path: self.path.clone(),
            name: self.name.clone(),
        }
    }
}

/// What a caller gives to ask for an approval; owner, runtime and sandbox come from the run.
#[derive(Debug, Clone, PartialEq)]
pub struct NewApproval {
    /// Unique id, chosen by the caller.
    pub id: String,
    /// The run that is held.
    pub run_id: String,
    /// What kind of action.
    pub capability: Capability,
    /// What it is about.
    pub target: ApprovalTarget,
    /// One line for the approver (redacted by the caller).
    pub summary: String,
    /// Anything the daemon needs to resume the held action (e.g. the harness's request
    /// id), as JSON; it is part of the approval's events, so it must be redacted too.
    pub detail: serde_json::Value,
    /// When it expires unless decided, unix milliseconds.
    pub expires_at_ms: i64,
}

/// One approval as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalRecord {
    /// Unique id.
    pub id: String,
    /// The held run.
    pub run_id: String,
    /// Its runtime.
    pub runtime_id: String,
    /// Its sandbox.
    pub sandbox_id: String,
    /// Its owner.
    pub owner: String,
    /// What kind of action.
    pub capability: Capability,
    /// What it is about.
    pub target: ApprovalTarget,
    /// One line for the approver.
    pub summary: String,
    /// The daemon's resume data.
    pub detail: serde_json::Value,
    /// `once` until approved for the run.
    pub scope: ApprovalScope,
    /// Pending or how it was decided.
    pub state: ApprovalState,
    /// Why it was denied, as the approver gave it (shown inside the sandbox).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who decided (the approver's principal); `None` for an expiry.
    pub decided_by: Option<String>,
    /// When it was decided or written expired, unix milliseconds.
    pub decided_at_ms: Option<i64>,
    /// When it expires unless decided.
    pub expires_at_ms: i64,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
}

impl ApprovalRecord {
    /// Shows a pending approval past its expiry as expired (not written).
    fn seen_at(mut self, now_ms: i64) -> ApprovalRecord {
        if self.state == ApprovalState::Pending && self.expires_at_ms <= now_ms {
            self.state = ApprovalState::Expired;
        }
        self
    }
}

/// A person's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Allow, for the one action or for the rest of the run.
    Approve(ApprovalScope),
    /// Refuse.
    Deny,
}

/// What [`Store::request_or_join_approval`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Requested {
    /// A new pending approval was recorded.
    Created(ApprovalRecord),
    /// The same action (capability, target and summary) was pending already: this one
    /// waits on that record, and its decision answers both.
    Joined(ApprovalRecord),
    /// The run already had `pending` approvals waiting, its limit: nothing recorded, the
    /// action is to be refused at once (an `approval_refused` event says why).
    TooMany {
        /// How many were pending.
        pending: u32,
    },
}

/// What [`Store::decide_approval`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Decided {
    /// The decision was written.
    Decided(ApprovalRecord),
    /// Too late: it had expired, and is now written so.
    Expired(ApprovalRecord),
    /// Refused: it was decided (or written expired) before; as it stays.
    AlreadyDecided(ApprovalRecord),
}

fn approval_from_row(row: &SqliteRow) -> Result<ApprovalRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let capability: String = row.try_get("capability")?;
    let scope: String = row.try_get("scope")?;
    let state: String = row.try_get("state")?;
    let detail: String = row.try_get("detail")?;
    let detail = serde_json::from_str(&detail)
        .map_err(|e| StoreError::Corrupt(format!("approval {id}: detail: {e}")))?;
    Ok(ApprovalRecord {
        run_id: row.try_get("run_id")?,
        runtime_id: row.try_get("runtime_id")?,
        sandbox_id: row.try_get("sandbox_id")?,
        owner: row.try_get("owner")?,
        capability: capability.parse()?,
        target: ApprovalTarget {
            host: row.try_get("host")?,
            method: row.try_get("method")?,
            path: row.try_get("path")?,
            name: row.try_get("target_name")?,
        },
        summary: row.try_get("summary")?,
        detail,
        scope: scope.parse()?,
        state: state.parse()?,
        reason: row.try_get("reason")?,
        decided_by: row.try_get("decided_by")?,
        decided_at_ms: row.try_get("decided_at_ms")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        created_at_ms: row.try_get("created_at_ms")?,
        id,
    })
}

/// Appends the `approval_decided` event of `a` to its run (dropped past the cap, refused
/// for a finished run unless `gate` allows it).
async fn decided_event(
    conn: &mut SqliteConnection,
    a: &ApprovalRecord,
    gate: Gate,
) -> Result<(), StoreError> {
    push_event(
        conn,
        &a.run_id,
        EVENT_APPROVAL_DECIDED,
        &serde_json::to_value(a)?,
        gate,
    )
    .await?;
    Ok(())
}

/// Moves a run held for approval back to `running` when none of its approvals is still
/// live-pending at `now`.
async fn resume_if_clear(
    conn: &mut SqliteConnection,
    run_id: &str,
    now: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE agent_runs SET state = $1, updated_at_ms = $2 WHERE id = $3 AND state = $4 \
         AND NOT EXISTS (SELECT 1 FROM agent_approvals WHERE run_id = $3 AND state = $5 \
         AND expires_at_ms > $2)",
    )
    .bind(RunState::Running.as_str())
    .bind(now)
    .bind(run_id)
    .bind(RunState::WaitingApproval.as_str())
    .bind(ApprovalState::Pending.as_str())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Expires the pending approvals of a run that is ending, each with its event, inside the
/// ending transaction (before the run's `end` event).
pub(crate) async fn expire_run_approvals_in(
    conn: &mut SqliteConnection,
    run_id: &str,
    now: i64,
) -> Result<(), StoreError> {
    let rows = sqlx::query(&format!(
        "UPDATE agent_approvals SET state = $1, decided_at_ms = $2 \
         WHERE run_id = $3 AND state = $4 RETURNING {APPROVAL_COLUMNS}"
    ))
    .bind(ApprovalState::Expired.as_str())
    .bind(now)
    .bind(run_id)
    .bind(ApprovalState::Pending.as_str())
    .fetch_all(&mut *conn)
    .await?;
    let mut expired = rows
        .iter()
        .map(approval_from_row)
        .collect::<Result<Vec<_>, _>>()?;
    expired.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
    for a in &expired {
        decided_event(conn, a, Gate::ENDING).await?;
    }
    Ok(())
}

/// Run `run_id` if it is live: unknown is [`StoreError::NotFound`], finished
/// [`StoreError::Conflict`].
async fn live_run_in(
    conn: &mut SqliteConnection,
    run_id: &str,
) -> Result<crate::runs::RunRecord, StoreError> {
    let Some(run) = get_run_in(conn, run_id).await? else {
        return Err(StoreError::NotFound(format!("run {run_id}")));
    };
    if run.state.is_terminal() {
        return Err(StoreError::Conflict(format!(
            "run {} has ended ({})",
            run.id, run.state
        )));
    }
    Ok(run)
}

/// Inserts a pending approval of live run `run`, moves the run to `waiting_approval`
/// and appends the `approval_requested` event, inside the caller's transaction.
async fn insert_approval_in(
    conn: &mut SqliteConnection,
    run: &crate::runs::RunRecord,
    new: &NewApproval,
) -> Result<ApprovalRecord, StoreError> {
    let target = new.target.normalized();
    let row = sqlx::query(&format!(
        "INSERT INTO agent_approvals ({APPROVAL_COLUMNS}) VALUES \
         ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, NULL, NULL, $15, $16, NULL) \
         RETURNING {APPROVAL_COLUMNS}"
    ))
    .bind(&new.id)
    .bind(&run.id)
    .bind(&run.runtime_id)
    .bind(&run.sandbox_id)
    .bind(&run.owner)
    .bind(new.capability.as_str())
    .bind(&target.host)
    .bind(&target.method)
    .bind(&target.path)
    .bind(&target.name)
    .bind(&new.summary)
    .bind(serde_json::to_string(&new.detail)?)
    .bind(ApprovalScope::Once.as_str())
    .bind(ApprovalState::Pending.as_str())
    .bind(new.expires_at_ms)
    .bind(now_ms())
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| match StoreError::from(e) {
        StoreError::Conflict(_) => StoreError::Conflict(format!("approval {} exists", new.id)),
        other => other,
    })?;
    let approval = approval_from_row(&row)?;
    sqlx::query(
        "UPDATE agent_runs SET state = $1, updated_at_ms = $2 WHERE id = $3 AND state = $4",
    )
    .bind(RunState::WaitingApproval.as_str())
    .bind(approval.created_at_ms)
    .bind(&run.id)
    .bind(RunState::Running.as_str())
    .execute(&mut *conn)
    .await?;
    push_event(
        conn,
        &run.id,
        EVENT_APPROVAL_REQUESTED,
        &serde_json::to_value(&approval)?,
        Gate::EVENT,
    )
    .await?;
    tracing::debug!(approval_id = %approval.id, run_id = %approval.run_id, capability = %approval.capability, "approval requested");
    Ok(approval)
}

impl Store {
    /// Records a pending approval for a live run, moves the run from `running` to
    /// `waiting_approval`, and appends the `approval_requested` event, in one transaction.
    /// An unknown run is [`StoreError::NotFound`], a finished one [`StoreError::Conflict`],
    /// an existing id [`StoreError::Conflict`].
    pub async fn request_approval(&self, new: &NewApproval) -> Result<ApprovalRecord, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let run = live_run_in(&mut tx, &new.run_id).await?;
        let approval = insert_approval_in(&mut tx, &run, new).await?;
        tx.commit().await?;
        Ok(approval)
    }

    /// As [`Store::request_approval`], in one transaction with two checks first: the
    /// same action (capability, target with its path, and summary) already pending and
    /// live for the run is joined instead of asked twice, and a run with `max_pending`
    /// live pending approvals gets no more ([`Requested::TooMany`], with an
    /// `approval_refused` event naming the action and the reason).
    pub async fn request_or_join_approval(
        &self,
        new: &NewApproval,
        max_pending: u32,
    ) -> Result<Requested, StoreError> {
        let now = now_ms();
        let target = new.target.normalized();
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let run = live_run_in(&mut tx, &new.run_id).await?;
        let run_id = run.id.clone();
        let same = sqlx::query(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM agent_approvals \
             WHERE run_id = $1 AND capability = $2 AND state = $3 AND expires_at_ms > $4 \
             AND COALESCE(host, '') = COALESCE($5, '') \
             AND COALESCE(method, '') = COALESCE($6, '') \
             AND COALESCE(path, '') = COALESCE($7, '') \
             AND COALESCE(target_name, '') = COALESCE($8, '') \
             AND summary = $9 ORDER BY created_at_ms, id LIMIT 1"
        ))
        .bind(&run_id)
        .bind(new.capability.as_str())
        .bind(ApprovalState::Pending.as_str())
        .bind(now)
        .bind(&target.host)
        .bind(&target.method)
        .bind(&target.path)
        .bind(&target.name)
        .bind(&new.summary)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = same {
            let a = approval_from_row(&row)?;
            tx.commit().await?;
            return Ok(Requested::Joined(a));
        }
        let (pending,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM agent_approvals WHERE run_id = $1 AND state = $2 \
             AND expires_at_ms > $3",
        )
        .bind(&run_id)
        .bind(ApprovalState::Pending.as_str())
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let pending = u32::try_from(pending).unwrap_or(u32::MAX);
        if pending >= max_pending {
            let reason = format!(
                "refused at once: the run already has {pending} approvals pending, its limit"
            );
            push_event(
                &mut tx,
                &run_id,
                EVENT_APPROVAL_REFUSED,
                &serde_json::json!({
                    "capability": new.capability.as_str(),
                    "target": target,
                    "summary": new.summary,
                    "reason": reason,
                    "pending": pending,
                }),
                Gate::EVENT,
            )
            .await?;
            tx.commit().await?;
            return Ok(Requested::TooMany { pending });
        }
        let approval = insert_approval_in(&mut tx, &run, new).await?;
        tx.commit().await?;
        Ok(Requested::Created(approval))
    }

    /// Ends a pending approval whose requester went away (state `abandoned`, with
    /// `reason`), appending its `approval_decided` event and resuming the run when nothing
    /// else holds it. `None` when it was no longer pending (decided, expired, unknown).
    pub async fn abandon_approval(
        &self,
        id: &str,
        reason: &str,
        now_ms: i64,
    ) -> Result<Option<ApprovalRecord>, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let row = sqlx::query(&format!(
            "UPDATE agent_approvals SET state = $1, decided_at_ms = $2, reason = $3 \
             WHERE id = $4 AND state = $5 RETURNING {APPROVAL_COLUMNS}"
        ))
        .bind(ApprovalState::Abandoned.as_str())
        .bind(now_ms)
        .bind(reason)
        .bind(id)
        .bind(ApprovalState::Pending.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(a) = row.as_ref().map(approval_from_row).transpose()? else {
            return Ok(None);
        };
        decided_event(&mut tx, &a, Gate::EVENT).await?;
        resume_if_clear(&mut tx, &a.run_id, now_ms).await?;
        tx.commit().await?;
        tracing::debug!(approval_id = id, reason, "approval abandoned");
        Ok(Some(a))
    }

    /// The approval with this id as of `now_ms` (a pending one past its expiry reads as
    /// expired), if any.
    pub async fn get_approval(
        &self,
        id: &str,
        now_ms: i64,
    ) -> Result<Option<ApprovalRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM agent_approvals WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row
            .as_ref()
            .map(approval_from_row)
            .transpose()?
            .map(|a| a.seen_at(now_ms)))
    }

    /// Compare-and-set decision: only a pending approval not yet expired at `now_ms` takes
    /// it; one past its expiry is written expired instead ([`Decided::Expired`]). Either
    /// way the `approval_decided` event is appended and the run resumes when nothing else
    /// holds it. Unknown ids are [`StoreError::NotFound`].
    pub async fn decide_approval(
        &self,
        id: &str,
        decision: Decision,
        decided_by: &str,
        now_ms: i64,
    ) -> Result<Decided, StoreError> {
        self.decide_approval_with_reason(id, decision, decided_by, None, now_ms)
            .await
    }

    /// As [`Store::decide_approval`], keeping the approver's `reason` with the decision
    /// (and in its event).
    pub async fn decide_approval_with_reason(
        &self,
        id: &str,
        decision: Decision,
        decided_by: &str,
        reason: Option<&str>,
        now_ms: i64,
    ) -> Result<Decided, StoreError> {
        let (state, scope) = match decision {
            Decision::Approve(scope) => (ApprovalState::Approved, scope),
            Decision::Deny => (ApprovalState::Denied, ApprovalScope::Once),
        };
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let row = sqlx::query(&format!(
            "UPDATE agent_approvals SET state = $1, scope = $2, decided_by = $3, decided_at_ms = $4, \
             reason = $7 WHERE id = $5 AND state = $6 AND expires_at_ms > $4 RETURNING {APPROVAL_COLUMNS}"
        ))
        .bind(state.as_str())
        .bind(scope.as_str())
        .bind(decided_by)
        .bind(now_ms)
        .bind(id)
        .bind(ApprovalState::Pending.as_str())
        .bind(reason)
        .fetch_optional(&mut *tx)
        .await?;
        let outcome = match row.as_ref().map(approval_from_row).transpose()? {
            Some(a) => Decided::Decided(a),
            None => {
                let row = sqlx::query(&format!(
                    "UPDATE agent_approvals SET state = $1, decided_at_ms = $2 \
                     WHERE id = $3 AND state = $4 RETURNING {APPROVAL_COLUMNS}"
                ))
                .bind(ApprovalState::Expired.as_str())
                .bind(now_ms)
                .bind(id)
                .bind(ApprovalState::Pending.as_str())
                .fetch_optional(&mut *tx)
                .await?;
                match row.as_ref().map(approval_from_row).transpose()? {
                    Some(a) => Decided::Expired(a),
                    None => {
                        let row = sqlx::query(&format!(
                            "SELECT {APPROVAL_COLUMNS} FROM agent_approvals WHERE id = $1"
                        ))
                        .bind(id)
                        .fetch_optional(&mut *tx)
                        .await?;
                        return match row.as_ref().map(approval_from_row).transpose()? {
                            Some(a) => Ok(Decided::AlreadyDecided(a)),
                            None => Err(StoreError::NotFound(format!("approval {id}"))),
                        };
                    }
                }
            }
        };
        let (Decided::Decided(a) | Decided::Expired(a) | Decided::AlreadyDecided(a)) = &outcome;
        decided_event(&mut tx, a, Gate::EVENT).await?;
        resume_if_clear(&mut tx, &a.run_id, now_ms).await?;
        tx.commit().await?;
        tracing::debug!(approval_id = id, state = %a.state, "approval decided");
        Ok(outcome)
    }

    /// Writes every pending approval past its expiry at `now_ms` as expired, with its
    /// event, resuming runs nothing else holds; returns them (the daemon refuses their
    /// held actions).
    pub async fn expire_approvals(&self, now_ms: i64) -> Result<Vec<ApprovalRecord>, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let rows = sqlx::query(&format!(
            "UPDATE agent_approvals SET state = $1, decided_at_ms = $2 \
             WHERE state = $3 AND expires_at_ms <= $2 RETURNING {APPROVAL_COLUMNS}"
        ))
        .bind(ApprovalState::Expired.as_str())
        .bind(now_ms)
        .bind(ApprovalState::Pending.as_str())
        .fetch_all(&mut *tx)
        .await?;
        let mut expired = rows
            .iter()
            .map(approval_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        if expired.is_empty() {
            return Ok(expired);
        }
        expired.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        for a in &expired {
            decided_event(&mut tx, a, Gate::EVENT).await?;
            resume_if_clear(&mut tx, &a.run_id, now_ms).await?;
        }
        tx.commit().await?;
        Ok(expired)
    }

    /// The owner's approvals still pending at `now_ms`, oldest first.
    pub async fn list_pending_approvals(
        &self,
        owner: &str,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM agent_approvals \
             WHERE owner = $1 AND state = $2 AND expires_at_ms > $3 ORDER BY created_at_ms, id"
        ))
        .bind(owner)
        .bind(ApprovalState::Pending.as_str())
        .bind(now_ms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(approval_from_row).collect()
    }

    /// Every approval of the owner's as of `now_ms`, oldest first.
    pub async fn list_owner_approvals(
        &self,
        owner: &str,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>, StoreError> {
        self.approvals_where("owner", owner, now_ms).await
    }

    /// Every approval of a run as of `now_ms`, oldest first.
    pub async fn list_run_approvals(
        &self,
        run_id: &str,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>, StoreError> {
        self.approvals_where("run_id", run_id, now_ms).await
    }

    /// Every approval whose `column` (a fixed name, never input) is `value`, as of
    /// `now_ms`, oldest first.
    async fn approvals_where(
        &self,
        column: &'static str,
        value: &str,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM agent_approvals WHERE {column} = $1 \
             ORDER BY created_at_ms, id"
        ))
        .bind(value)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| approval_from_row(r).map(|a| a.seen_at(now_ms)))
            .collect()
    }

    /// The approval, if any, that already lets this action through for the rest of the
    /// run: approved with scope `run`, same capability, and the same host, method and name
    /// (the path is not compared).
    pub async fn standing_grant(
        &self,
        run_id: &str,
        capability: Capability,
        target: &ApprovalTarget,
    ) -> Result<Option<ApprovalRecord>, StoreError> {
        let target = target.normalized();
        // COALESCE makes "both absent" equal without a backend-specific IS [NOT] DISTINCT.
        let row = sqlx::query(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM agent_approvals \
             WHERE run_id = $1 AND capability = $2 AND state = $3 AND scope = $4 \
             AND COALESCE(host, '') = COALESCE($5, '') \
             AND COALESCE(method, '') = COALESCE($6, '') \
             AND COALESCE(target_name, '') = COALESCE($7, '') \
             ORDER BY decided_at_ms, id LIMIT 1"
        ))
        .bind(run_id)
        .bind(capability.as_str())
        .bind(ApprovalState::Approved.as_str())
        .bind(ApprovalScope::Run.as_str())
        .bind(&target.host)
        .bind(&target.method)
        .bind(&target.name)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(approval_from_row).transpose()
    }
}
