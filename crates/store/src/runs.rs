//! Runs of an agent runtime: start (at most one active per runtime, idempotent by key),
//! compare-and-set state transitions in which terminal states are final, and lineage.
//!
//! A run's events are in `run_events.rs`. Ending a run (any terminal transition) also, in
//! the same transaction, expires its pending approvals and appends its `end` event, so the
//! `end` event is always the last event of a finished run.

use serde::{Deserialize, Serialize};
use sqlx::sqlite::SqliteRow;
use sqlx::{QueryBuilder, Row, Sqlite, SqliteConnection};

use crate::agents::{AgentRuntimeState, runtime_from_row};
use crate::run_events::{Gate, push_event};
use crate::{EVENT_END, Store, StoreError, now_ms};

pub(crate) const RUN_COLUMNS: &str = "id, runtime_id, number, sandbox_id, owner, task, mode, \
     parent_run_id, resume_session_id, session_id, idempotency_key, state, reason, \
     created_at_ms, started_at_ms, ended_at_ms, updated_at_ms, next_seq, max_events, \
     events_dropped";

stored_enum! {
    /// Whether a run starts a new harness conversation or continues the previous run's.
    pub enum RunMode ("run mode") {
        /// A new conversation.
        Fresh = "fresh",
        /// The previous run's harness session, resumed.
        Continue = "continue",
    }
}

stored_enum! {
    /// Where a run is; `Succeeded`, `Failed`, `Cancelled` and `TimedOut` are final.
    pub enum RunState ("run state") {
        /// Recorded, the harness not started yet.
        Queued = "queued",
        /// The harness is working.
        Running = "running",
        /// Held until a person decides a pending approval.
        WaitingApproval = "waiting_approval",
        /// Finished with a result (final).
        Succeeded = "succeeded",
        /// Finished without one; `reason` says why (final).
        Failed = "failed",
        /// Stopped on request (final).
        Cancelled = "cancelled",
        /// Stopped by its wall-clock limit or the daemon's cap on a run (final).
        TimedOut = "timed_out",
    }
}

impl RunState {
    /// The states of a run that has not finished; a runtime has at most one run in them.
    pub const ACTIVE: [RunState; 3] = [
        RunState::Queued,
        RunState::Running,
        RunState::WaitingApproval,
    ];

    /// Whether the state is final.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunState::Succeeded | RunState::Failed | RunState::Cancelled | RunState::TimedOut
        )
    }

    /// The states a run may move to `self` from. Nothing leaves a final state, and
    /// nothing goes back to `Queued`.
    pub fn allowed_from(self) -> &'static [RunState] {
        match self {
            RunState::Queued => &[],
            RunState::Running => &[RunState::Queued, RunState::WaitingApproval],
            RunState::WaitingApproval => &[RunState::Running],
            RunState::Succeeded | RunState::Failed | RunState::Cancelled | RunState::TimedOut => {
                &RunState::ACTIVE
            }
        }
    }
}

/// What a caller gives to start a run; owner and sandbox come from the runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRun {
    /// Unique id, chosen by the caller (unused when the idempotency key finds a run).
    pub id: String,
    /// The runtime to run in.
    pub runtime_id: String,
    /// The task (prompt) given to the harness.
    pub task: String,
    /// Fresh or continue.
    pub mode: RunMode,
    /// Retries with the same key get the same run back; unique per runtime.
    pub idempotency_key: Option<String>,
    /// Cap on the run's events (see [`Store::append_event`]), fixed for the run's life.
    pub max_events: i64,
}

/// One run as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Unique id.
    pub id: String,
    /// Its runtime.
    pub runtime_id: String,
    /// 1 for the runtime's first run, then 2, 3, ...
    pub number: i64,
    /// The runtime's sandbox.
    pub sandbox_id: String,
    /// The runtime's owner.
    pub owner: String,
    /// The task (prompt).
    pub task: String,
    /// Fresh or continue.
    pub mode: RunMode,
    /// The run a `continue` run continues (the runtime's run before it); `None` for fresh.
    pub parent_run_id: Option<String>,
    /// The harness session a `continue` run resumes, when one was known at its start.
    pub resume_session_id: Option<String>,
    /// The harness session this run reported, once seen.
    pub session_id: Option<String>,
    /// Idempotency key it was started with.
    pub idempotency_key: Option<String>,
    /// Where it is.
    pub state: RunState,
    /// Why it ended (or last changed state), if said.
    pub reason: Option<String>,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
    /// When it first went `running`.
    pub started_at_ms: Option<i64>,
    /// When it reached a final state.
    pub ended_at_ms: Option<i64>,
    /// Last state change.
    pub updated_at_ms: i64,
    /// The sequence number its next event gets (so `next_seq - 1` events are stored).
    pub next_seq: i64,
    /// Its event cap.
    pub max_events: i64,
    /// Events refused because the cap was reached.
    pub events_dropped: i64,
}

impl RunRecord {
    /// Whether the run is still active (queued, running or waiting for approval).
    pub fn is_active(&self) -> bool {
        !self.state.is_terminal()
    }
}

/// What [`Store::start_run`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum RunStart {
    /// A new run was recorded, `queued`.
    Started(RunRecord),
    /// The idempotency key named an existing run of the runtime: it, unchanged.
    Existing(RunRecord),
}

impl RunStart {
    /// The run, new or existing.
    pub fn run(&self) -> &RunRecord {
        match self {
            RunStart::Started(r) | RunStart::Existing(r) => r,
        }
    }
}

/// What a compare-and-set state transition did.
#[derive(Debug, Clone, PartialEq)]
pub enum RunUpdate {
    /// Written; the run as it is now.
    Applied(RunRecord),
    /// Refused: the run had already finished (e.g. a late `succeeded` after `cancelled`);
    /// it stays as shown.
    AlreadyFinal(RunRecord),
    /// Refused: the run is active but the transition is not allowed from its state.
    NotAllowed(RunRecord),
}

pub(crate) fn run_from_row(row: &SqliteRow) -> Result<RunRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let mode: String = row.try_get("mode")?;
    let state: String = row.try_get("state")?;
    Ok(RunRecord {
        runtime_id: row.try_get("runtime_id")?,
        number: row.try_get("number")?,
        sandbox_id: row.try_get("sandbox_id")?,
        owner: row.try_get("owner")?,
        task: row.try_get("task")?,
        mode: mode
            .parse()
            .map_err(|e| StoreError::Corrupt(format!("run {id}: {e}")))?,
        parent_run_id: row.try_get("parent_run_id")?,
        resume_session_id: row.try_get("resume_session_id")?,
        session_id: row.try_get("session_id")?,
        idempotency_key: row.try_get("idempotency_key")?,
        state: state
            .parse()
            .map_err(|e| StoreError::Corrupt(format!("run {id}: {e}")))?,
        reason: row.try_get("reason")?,
        created_at_ms: row.try_get("created_at_ms")?,
        started_at_ms: row.try_get("started_at_ms")?,
        ended_at_ms: row.try_get("ended_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        next_seq: row.try_get("next_seq")?,
        max_events: row.try_get("max_events")?,
        events_dropped: row.try_get("events_dropped")?,
        id,
    })
}

/// Appends `AND state IN (...)` for `states` (which must not be empty).
pub(crate) fn push_run_state_in(qb: &mut QueryBuilder<'_, Sqlite>, states: &[RunState]) {
    qb.push(" AND state IN (");
    let mut list = qb.separated(", ");
    for state in states {
        list.push_bind(state.as_str());
    }
    list.push_unseparated(")");
}

pub(crate) async fn get_run_in(
    conn: &mut SqliteConnection,
    id: &str,
) -> Result<Option<RunRecord>, StoreError> {
    let row = sqlx::query(&format!(
        "SELECT {RUN_COLUMNS} FROM agent_runs WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(conn)
    .await?;
    row.as_ref().map(run_from_row).transpose()
}

/// The compare-and-set transition of run `id` to `to`, inside the caller's transaction.
/// Ending a run also expires its pending approvals (each with its `approval_decided`
/// event) and appends the `end` event, in that order.
pub(crate) async fn transition_in(
    conn: &mut SqliteConnection,
    id: &str,
    to: RunState,
    reason: Option<&str>,
) -> Result<RunUpdate, StoreError> {
    let now = now_ms();
    let from = to.allowed_from();
    let updated = if from.is_empty() {
        None
    } else {
        let mut qb: QueryBuilder<'_, Sqlite> = QueryBuilder::new("UPDATE agent_runs SET state = ");
        qb.push_bind(to.as_str())
            .push(", reason = ")
            .push_bind(reason.map(str::to_string))
            .push(", updated_at_ms = ")
            .push_bind(now);
        if to == RunState::Running {
            qb.push(", started_at_ms = COALESCE(started_at_ms, ")
                .push_bind(now)
                .push(")");
        }
        if to.is_terminal() {
            qb.push(", ended_at_ms = ").push_bind(now);
        }
        qb.push(" WHERE id = ").push_bind(id.to_string());
        push_run_state_in(&mut qb, from);
        qb.push(" RETURNING id");
        qb.build().fetch_optional(&mut *conn).await?
    };
    if updated.is_none() {
        let Some(current) = get_run_in(conn, id).await? else {
            return Err(StoreError::NotFound(format!("run {id}")));
        };
        tracing::debug!(run_id = id, state = %current.state, to = %to, "run transition refused");
        return Ok(if current.state.is_terminal() {
            RunUpdate::AlreadyFinal(current)
        } else {
            RunUpdate::NotAllowed(current)
        });
    }
    if to.is_terminal() {
        crate::approvals::expire_run_approvals_in(conn, id, now).await?;
        let payload = serde_json::json!({ "state": to.as_str(), "reason": reason });
        push_event(conn, id, EVENT_END, &payload, Gate::FINAL).await?;
    }
    let Some(run) = get_run_in(conn, id).await? else {
        return Err(StoreError::NotFound(format!("run {id}")));
    };
    tracing::debug!(run_id = id, to = %to, "run state changed");
    Ok(RunUpdate::Applied(run))
}

impl Store {
    /// Starts a run, `queued`, in one transaction that also decides:
    /// - an idempotency key the runtime has seen returns that run ([`RunStart::Existing`],
    ///   whatever its state), or [`StoreError::Conflict`] if it was for another task or mode;
    /// - an unknown runtime is [`StoreError::NotFound`], an ended one [`StoreError::Conflict`];
    /// - an active run of the runtime is [`StoreError::ActiveRun`] (a unique index backs it);
    /// - `continue` takes the runtime's latest run as parent and resumes its harness
    ///   session (else the runtime's last known one); with no run before it is a
    ///   [`StoreError::Conflict`].
    pub async fn start_run(&self, new: &NewRun) -> Result<RunStart, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        if let Some(key) = &new.idempotency_key {
            let row = sqlx::query(&format!(
                "SELECT {RUN_COLUMNS} FROM agent_runs WHERE runtime_id = $1 AND idempotency_key = $2"
            ))
            .bind(&new.runtime_id)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(existing) = row.as_ref().map(run_from_row).transpose()? {
                if existing.task != new.task || existing.mode != new.mode {
                    return Err(StoreError::Conflict(format!(
                        "idempotency key {key:?} was used for another run request"
                    )));
                }
                return Ok(RunStart::Existing(existing));
            }
        }
        let row = sqlx::query(&format!(
            "SELECT {} FROM agent_runtimes WHERE id = $1",
            crate::agents::RUNTIME_COLUMNS
        ))
        .bind(&new.runtime_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(runtime) = row.as_ref().map(runtime_from_row).transpose()? else {
            return Err(StoreError::NotFound(format!(
                "agent runtime {}",
                new.runtime_id
            )));
        };
        if runtime.state == AgentRuntimeState::Ended {
            return Err(StoreError::Conflict(format!(
                "agent runtime {} has ended",
                runtime.id
            )));
        }
        let mut qb: QueryBuilder<'_, Sqlite> =
            QueryBuilder::new("SELECT id FROM agent_runs WHERE runtime_id = ");
        qb.push_bind(new.runtime_id.clone());
        push_run_state_in(&mut qb, &RunState::ACTIVE);
        if let Some(active) = qb.build().fetch_optional(&mut *tx).await? {
            return Err(StoreError::ActiveRun {
                runtime_id: new.runtime_id.clone(),
                run_id: active.try_get("id")?,
            });
        }
        let last = sqlx::query(&format!(
            "SELECT {RUN_COLUMNS} FROM agent_runs WHERE runtime_id = $1 \
             ORDER BY number DESC LIMIT 1"
        ))
        .bind(&new.runtime_id)
        .fetch_optional(&mut *tx)
        .await?;
        let last = last.as_ref().map(run_from_row).transpose()?;
        let (parent_run_id, resume_session_id) = match (new.mode, &last) {
            (RunMode::Fresh, _) => (None, None),
            (RunMode::Continue, None) => {
                return Err(StoreError::Conflict(format!(
                    "agent runtime {} has no run to continue",
                    runtime.id
                )));
            }
            (RunMode::Continue, Some(last)) => (
                Some(last.id.clone()),
                last.session_id.clone().or(runtime.session_id.clone()),
            ),
        };
        let number = last.as_ref().map_or(1, |l| l.number + 1);
        let now = now_ms();
        let row = sqlx::query(&format!(
            "INSERT INTO agent_runs ({RUN_COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, NULL, $10, $11, NULL, $12, NULL, NULL, $12, 1, $13, 0) \
             RETURNING {RUN_COLUMNS}"
        ))
        .bind(&new.id)
        .bind(&new.runtime_id)
        .bind(number)
        .bind(&runtime.sandbox_id)
        .bind(&runtime.owner)
        .bind(&new.task)
        .bind(new.mode.as_str())
        .bind(&parent_run_id)
        .bind(&resume_session_id)
        .bind(&new.idempotency_key)
        .bind(RunState::Queued.as_str())
        .bind(now)
        // A cap below one would make the truncation marker itself impossible.
        .bind(new.max_events.max(1))
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::Conflict(m) => StoreError::Conflict(format!("run {}: {m}", new.id)),
            other => other,
        })?;
        let run = run_from_row(&row)?;
        tx.commit().await?;
        tracing::debug!(run_id = %run.id, runtime_id = %run.runtime_id, number = run.number, mode = %run.mode, "run started");
        Ok(RunStart::Started(run))
    }

    /// The run with this id, if any.
    pub async fn get_run(&self, id: &str) -> Result<Option<RunRecord>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        get_run_in(&mut conn, id).await
    }

    /// Every run of a runtime, by number (its lineage in order).
    pub async fn list_runs(&self, runtime_id: &str) -> Result<Vec<RunRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {RUN_COLUMNS} FROM agent_runs WHERE runtime_id = $1 ORDER BY number"
        ))
        .bind(runtime_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(run_from_row).collect()
    }

    /// The runtime's active run, if it has one.
    pub async fn active_run(&self, runtime_id: &str) -> Result<Option<RunRecord>, StoreError> {
        let mut qb: QueryBuilder<'_, Sqlite> = QueryBuilder::new(format!(
            "SELECT {RUN_COLUMNS} FROM agent_runs WHERE runtime_id = "
        ));
        qb.push_bind(runtime_id.to_string());
        push_run_state_in(&mut qb, &RunState::ACTIVE);
        let row = qb.build().fetch_optional(&self.pool).await?;
        row.as_ref().map(run_from_row).transpose()
    }

    /// Every active run, oldest first: what a restarted daemon re-attaches or fails.
    pub async fn live_runs(&self) -> Result<Vec<RunRecord>, StoreError> {
        let mut qb: QueryBuilder<'_, Sqlite> =
            QueryBuilder::new(format!("SELECT {RUN_COLUMNS} FROM agent_runs WHERE 1 = 1"));
        push_run_state_in(&mut qb, &RunState::ACTIVE);
        qb.push(" ORDER BY created_at_ms, id");
        let rows = qb.build().fetch_all(&self.pool).await?;
        rows.iter().map(run_from_row).collect()
    }

    /// Compare-and-set of a run's state along [`RunState::allowed_from`]; `reason`
    /// replaces the stored one. A final state is never left: a transition out of one is
    /// [`RunUpdate::AlreadyFinal`] with the run as it stays. Unknown ids are
    /// [`StoreError::NotFound`]. Ending a run expires its pending approvals and appends its
    /// `end` event (`{"state": ..., "reason": ...}`, not subject to the event cap) in the
    /// same transaction.
    pub async fn transition_run(
        &self,
        id: &str,
        to: RunState,
        reason: Option<&str>,
    ) -> Result<RunUpdate, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let update = transition_in(&mut tx, id, to, reason).await?;
        if matches!(update, RunUpdate::Applied(_)) {
            tx.commit().await?;
        }
        Ok(update)
    }

    /// Records the harness session id a run reported, on the run and as its runtime's
    /// latest (what a later `continue` resumes); `false` if the run is unknown.
    pub async fn set_run_session(
        &self,
        run_id: &str,
        session_id: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let row: Option<(String,)> = sqlx::query_as(
            "UPDATE agent_runs SET session_id = $1 WHERE id = $2 RETURNING runtime_id",
        )
        .bind(session_id)
        .bind(run_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((runtime_id,)) = row else {
            return Ok(false);
        };
        sqlx::query("UPDATE agent_runtimes SET session_id = $1, updated_at_ms = $2 WHERE id = $3")
            .bind(session_id)
            .bind(now_ms())
            .bind(&runtime_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{NewAgentRuntime, SandboxRecord, SandboxState};

    async fn store_with_runtime() -> Store {
        let s = Store::open_in_memory().await.unwrap();
        s.insert_sandbox(&SandboxRecord {
            id: "sb".into(),
            owner: "o".into(),
            template: "t".into(),
            runtime: "container".into(),
            state: SandboxState::Running,
            cpu_millis: 1,
            memory_bytes: 1,
            disk_bytes: 1,
            max_processes: 1,
            env: Default::default(),
            secret_env: Default::default(),
            metadata: Default::default(),
            created_at_ms: 0,
            updated_at_ms: 0,
            expires_at_ms: i64::MAX,
            runtime_state: serde_json::Value::Null,
            error: None,
            version: 0,
            pool: None,
            life: Default::default(),
        })
        .await
        .unwrap();
        s.insert_agent_runtime(&NewAgentRuntime {
            id: "rt".into(),
            sandbox_id: "sb".into(),
            owner: "o".into(),
            harness: "pi".into(),
            harness_version: None,
            harness_template: None,
            approval_policy: serde_json::json!({}),
            model: serde_json::json!({}),
        })
        .await
        .unwrap();
        s
    }

    async fn raw_run(s: &Store, id: &str, number: i64, state: &str) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO agent_runs ({RUN_COLUMNS}) VALUES ($1, 'rt', $2, 'sb', 'o', 't', \
             'fresh', NULL, NULL, NULL, NULL, $3, NULL, 0, NULL, NULL, 0, 1, 10, 0)"
        ))
        .bind(id)
        .bind(number)
        .bind(state)
        .execute(&s.writer)
        .await?;
        Ok(())
    }

    #[tokio::test]
    async fn the_index_refuses_a_second_active_run_past_the_check() {
        let s = store_with_runtime().await;
        raw_run(&s, "a", 1, "running").await.unwrap();
        for state in ["queued", "running", "waiting_approval"] {
            let err = raw_run(&s, "b", 2, state).await.unwrap_err();
            assert!(matches!(err, StoreError::Conflict(_)), "{state}: {err:?}");
        }
        // Finished runs do not count.
        raw_run(&s, "c", 2, "succeeded").await.unwrap();
        raw_run(&s, "d", 3, "cancelled").await.unwrap();
    }

    #[tokio::test]
    async fn an_unknown_state_is_reported_as_corrupt() {
        let s = store_with_runtime().await;
        raw_run(&s, "a", 1, "exploded").await.unwrap();
        let err = s.get_run("a").await.unwrap_err();
        assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
        assert!(s.list_runs("rt").await.is_err());
    }

    #[test]
    fn final_states_are_never_left() {
        for to in RunState::ALL {
            for from in to.allowed_from() {
                assert!(!from.is_terminal(), "{from} -> {to}");
            }
        }
        assert!(RunState::Queued.allowed_from().is_empty());
        for state in RunState::ALL {
            assert_eq!(state.as_str().parse::<RunState>().unwrap(), *state);
            assert_eq!(
                serde_json::to_value(state).unwrap(),
                serde_json::Value::String(state.as_str().into())
            );
            assert_eq!(RunState::ACTIVE.contains(state), !state.is_terminal());
        }
    }
}
