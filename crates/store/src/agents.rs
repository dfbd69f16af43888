//! Agent runtimes: a coding-agent harness set up in one sandbox, which runs belong to.
//!
//! A runtime is created only while its sandbox is live and of the same owner (checked in
//! the insert itself), and ends with its sandbox: [`Store::end_sandbox_agents`] ends every
//! runtime of the sandbox and cancels their active runs in one transaction, so no run can
//! start on a runtime whose sandbox is going away.

use serde::{Deserialize, Serialize};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::runs::{RunRecord, RunState, transition_in};
use crate::{SandboxState, Store, StoreError, now_ms};

pub(crate) const RUNTIME_COLUMNS: &str = "id, sandbox_id, owner, harness, harness_version, \
     harness_template, approval_policy, session_id, state, reason, created_at_ms, \
     updated_at_ms, ended_at_ms, model";

stored_enum! {
    /// Whether a runtime can still start runs.
    pub enum AgentRuntimeState ("agent runtime state") {
        /// Runs can be started.
        Active = "active",
        /// Deleted, or its sandbox is gone (final); its runs are kept as history.
        Ended = "ended",
    }
}

/// What a caller gives to create a runtime; the rest is the store's.
#[derive(Debug, Clone, PartialEq)]
pub struct NewAgentRuntime {
    /// Unique id, chosen by the caller.
    pub id: String,
    /// The sandbox it lives in; must be live and belong to `owner`.
    pub sandbox_id: String,
    /// Owner (the sandbox's).
    pub owner: String,
    /// Harness name (`pi`, `opencode`, `claude`, `codex`, ...).
    pub harness: String,
    /// Pinned harness version, if any.
    pub harness_version: Option<String>,
    /// Pinned harness template, if any.
    pub harness_template: Option<String>,
    /// Which capabilities need a person's approval, as JSON the daemon interprets.
    pub approval_policy: serde_json::Value,
    /// The model endpoint its harness uses, as JSON the daemon interprets.
    pub model: serde_json::Value,
}

/// One agent runtime as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRuntimeRecord {
    /// Unique id.
    pub id: String,
    /// The sandbox it lives in.
    pub sandbox_id: String,
    /// Owner (the sandbox's).
    pub owner: String,
    /// Harness name.
    pub harness: String,
    /// Pinned harness version, if any.
    pub harness_version: Option<String>,
    /// Pinned harness template, if any.
    pub harness_template: Option<String>,
    /// Approval policy, opaque JSON.
    pub approval_policy: serde_json::Value,
    /// Model endpoint, opaque JSON.
    pub model: serde_json::Value,
    /// The harness's own session id last reported by one of its runs; a `continue` run
    /// resumes it when its previous run reported none.
    pub session_id: Option<String>,
    /// Active or ended.
    pub state: AgentRuntimeState,
    /// Why it ended.
    pub reason: Option<String>,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
    /// Last change, unix milliseconds.
    pub updated_at_ms: i64,
    /// When it ended, unix milliseconds.
    pub ended_at_ms: Option<i64>,
}

/// What ending runtimes changed: the daemon stops the cancelled runs' processes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EndedAgents {
    /// Ids of the runtimes this call ended (not those that had ended before).
    pub runtimes: Vec<String>,
    /// The runs this call cancelled, as they are now.
    pub runs: Vec<RunRecord>,
}

pub(crate) fn runtime_from_row(row: &SqliteRow) -> Result<AgentRuntimeRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let state: String = row.try_get("state")?;
    let policy: String = row.try_get("approval_policy")?;
    let approval_policy = serde_json::from_str(&policy)
        .map_err(|e| StoreError::Corrupt(format!("agent runtime {id}: approval_policy: {e}")))?;
    let model: String = row.try_get("model")?;
    let model = serde_json::from_str(&model)
        .map_err(|e| StoreError::Corrupt(format!("agent runtime {id}: model: {e}")))?;
    Ok(AgentRuntimeRecord {
        sandbox_id: row.try_get("sandbox_id")?,
        owner: row.try_get("owner")?,
        harness: row.try_get("harness")?,
        harness_version: row.try_get("harness_version")?,
        harness_template: row.try_get("harness_template")?,
        approval_policy,
        model,
        session_id: row.try_get("session_id")?,
        state: state.parse()?,
        reason: row.try_get("reason")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        ended_at_ms: row.try_get("ended_at_ms")?,
        id,
    })
}

/// Sandbox states in which no new runtime may be created there.
const GONE: [SandboxState; 3] = [
    SandboxState::Stopping,
    SandboxState::Stopped,
    SandboxState::Error,
];

impl Store {
    /// Creates a runtime in a sandbox that exists, is not stopping or ended, and belongs to
    /// `new.owner` ([`StoreError::NotFound`] otherwise, so another owner learns nothing);
    /// an existing id yields [`StoreError::Conflict`].
    pub async fn insert_agent_runtime(
        &self,
        new: &NewAgentRuntime,
    ) -> Result<AgentRuntimeRecord, StoreError> {
        let now = now_ms();
        // The sandbox check is part of the insert, so a runtime cannot slip in after the
        // sandbox's teardown has begun (which then ends every runtime it has).
        let row = sqlx::query(&format!(
            "INSERT INTO agent_runtimes ({RUNTIME_COLUMNS}) \
             SELECT $1, $2, $3, $4, $5, $6, $7, NULL, $8, NULL, $9, $9, NULL, $13 \
             WHERE EXISTS (SELECT 1 FROM sandboxes WHERE id = $2 AND owner = $3 \
             AND state NOT IN ($10, $11, $12)) RETURNING {RUNTIME_COLUMNS}"
        ))
        .bind(&new.id)
        .bind(&new.sandbox_id)
        .bind(&new.owner)
        .bind(&new.harness)
        .bind(&new.harness_version)
        .bind(&new.harness_template)
        .bind(serde_json::to_string(&new.approval_policy)?)
        .bind(AgentRuntimeState::Active.as_str())
        .bind(now)
        .bind(GONE[0].as_str())
        .bind(GONE[1].as_str())
        .bind(GONE[2].as_str())
        .bind(serde_json::to_string(&new.model)?)
        .fetch_optional(&self.writer)
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::Conflict(_) => {
                StoreError::Conflict(format!("agent runtime {} exists", new.id))
            }
            other => other,
        })?;
        let Some(row) = row else {
            return Err(StoreError::NotFound(format!("sandbox {}", new.sandbox_id)));
        };
        let record = runtime_from_row(&row)?;
        tracing::debug!(runtime_id = %record.id, sandbox_id = %record.sandbox_id, harness = %record.harness, "agent runtime created");
        Ok(record)
    }

    /// The runtime with this id, if any.
    pub async fn get_agent_runtime(
        &self,
        id: &str,
    ) -> Result<Option<AgentRuntimeRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {RUNTIME_COLUMNS} FROM agent_runtimes WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(runtime_from_row).transpose()
    }

    /// Runtimes of `owner` and/or in `sandbox_id` (`None` = any), oldest first.
    pub async fn list_agent_runtimes(
        &self,
        owner: Option<&str>,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<AgentRuntimeRecord>, StoreError> {
        // `$1 IS NULL OR ...` keeps one statement for the four combinations.
        let rows = sqlx::query(&format!(
            "SELECT {RUNTIME_COLUMNS} FROM agent_runtimes \
             WHERE ($1 IS NULL OR owner = $1) AND ($2 IS NULL OR sandbox_id = $2) \
             ORDER BY created_at_ms, id"
        ))
        .bind(owner)
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(runtime_from_row).collect()
    }

    /// Ends one runtime and cancels its active run (reason `reason`), in one transaction.
    /// `None` if the id is unknown; an already ended runtime changes nothing.
    pub async fn end_agent_runtime(
        &self,
        id: &str,
        reason: &str,
    ) -> Result<Option<EndedAgents>, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let exists: Option<(String,)> =
            sqlx::query_as("SELECT state FROM agent_runtimes WHERE id = $1")
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
        if exists.is_none() {
            return Ok(None);
        }
        let ended = end_where(&mut tx, "id", id, reason).await?;
        tx.commit().await?;
        Ok(Some(ended))
    }

    /// Ends every runtime of a sandbox and cancels their active runs (reason `reason`), in
    /// one transaction: what a sandbox's deletion calls.
    pub async fn end_sandbox_agents(
        &self,
        sandbox_id: &str,
        reason: &str,
    ) -> Result<EndedAgents, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let ended = end_where(&mut tx, "sandbox_id", sandbox_id, reason).await?;
        tx.commit().await?;
        if !ended.runtimes.is_empty() || !ended.runs.is_empty() {
            tracing::debug!(
                sandbox_id,
                runtimes = ended.runtimes.len(),
                runs = ended.runs.len(),
                "agent runtimes of sandbox ended"
            );
        }
        Ok(ended)
    }
}

/// Ends the active runtimes whose `column` (`id` or `sandbox_id`) is `value`, and cancels
/// every unfinished run of theirs, inside the caller's transaction.
async fn end_where(
    conn: &mut sqlx::SqliteConnection,
    column: &'static str,
    value: &str,
    reason: &str,
) -> Result<EndedAgents, StoreError> {
    let now = now_ms();
    let ended: Vec<(String,)> = sqlx::query_as(&format!(
        "UPDATE agent_runtimes SET state = $1, reason = $2, ended_at_ms = $3, updated_at_ms = $3 \
         WHERE {column} = $4 AND state = $5 RETURNING id"
    ))
    .bind(AgentRuntimeState::Ended.as_str())
    .bind(reason)
    .bind(now)
    .bind(value)
    .bind(AgentRuntimeState::Active.as_str())
    .fetch_all(&mut *conn)
    .await?;
    let mut runtimes: Vec<String> = ended.into_iter().map(|(id,)| id).collect();
    runtimes.sort();
    // Every unfinished run of the matched runtimes, also those of a runtime that had
    // already ended (none should exist, but a run must never outlive its runtime).
    let runs_column = if column == "id" {
        "runtime_id"
    } else {
        "sandbox_id"
    };
    let live: Vec<(String,)> = sqlx::query_as(&format!(
        "SELECT id FROM agent_runs WHERE {runs_column} = $1 AND state IN ($2, $3, $4) \
         ORDER BY created_at_ms, id"
    ))
    .bind(value)
    .bind(RunState::ACTIVE[0].as_str())
    .bind(RunState::ACTIVE[1].as_str())
    .bind(RunState::ACTIVE[2].as_str())
    .fetch_all(&mut *conn)
    .await?;
    let mut runs = Vec::with_capacity(live.len());
    for (run_id,) in live {
        if let crate::RunUpdate::Applied(run) =
            transition_in(conn, &run_id, RunState::Cancelled, Some(reason)).await?
        {
            runs.push(run);
        }
    }
    Ok(EndedAgents { runtimes, runs })
}
