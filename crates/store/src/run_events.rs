//! The durable event log of a run: per-run sequence numbers assigned at append, pages read
//! by "after sequence N", and a per-run cap.
//!
//! **Numbering.** An append takes the run's `next_seq` and bumps it in one conditional
//! UPDATE inside the append's transaction, then inserts the event under that number; the
//! `(run_id, seq)` primary key backs it. Concurrent appenders therefore get 1, 2, 3, ...
//! with no gap and no duplicate, and an event is stored before anyone can be told of it.
//!
//! **Cap.** A run stores at most `max_events` events (fixed at its start) counting a final
//! marker: the append that would take number `max_events` stores a `truncated` event
//! (`{"max_events": N}`) in its place and reports [`Appended::Truncated`]; later appends
//! store nothing, count in the run's `events_dropped`, and report [`Appended::Dropped`].
//! The run's `end` event is written beyond the cap, so a finished run's log always ends
//! with it.
//!
//! **Finished runs.** Appends to a run in a final state are refused
//! ([`Appended::RunEnded`]): nothing follows the `end` event.

use serde::{Deserialize, Serialize};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection};

use crate::runs::RunState;
use crate::{Store, StoreError, now_ms};

/// Kind of the marker stored in place of the event that reached a run's cap.
pub const EVENT_TRUNCATED: &str = "truncated";
/// Kind of the last event of every finished run: `{"state": ..., "reason": ...}`.
pub const EVENT_END: &str = "end";
/// Kind of the event recorded with a new approval; its payload is the [`crate::ApprovalRecord`].
pub const EVENT_APPROVAL_REQUESTED: &str = "approval_requested";
/// Kind of the event recorded with an approval's decision or expiry; payload as above.
pub const EVENT_APPROVAL_DECIDED: &str = "approval_decided";
/// Kind of the event recorded when an action is refused without asking, because its run
/// has as many approvals pending as it may: `{capability, target, summary, reason, pending}`.
pub const EVENT_APPROVAL_REFUSED: &str = "approval_refused";

const DEFAULT_PAGE: u32 = 100;
const MAX_PAGE: u32 = 1000;

/// One event to append.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// Event kind (`message_delta`, `tool_call`, ...).
    pub kind: String,
    /// Its payload, already redacted and limited by the caller.
    pub payload: serde_json::Value,
}

/// One stored event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunEvent {
    /// Its run.
    pub run_id: String,
    /// Position in the run, from 1, without gaps.
    pub seq: i64,
    /// When it was stored, unix milliseconds.
    pub at_ms: i64,
    /// Event kind.
    pub kind: String,
    /// Payload.
    pub payload: serde_json::Value,
}

/// What one append did.
#[derive(Debug, Clone, PartialEq)]
pub enum Appended {
    /// Stored under its sequence number.
    Stored(RunEvent),
    /// The run reached its cap: this `truncated` marker was stored instead of the event.
    Truncated(RunEvent),
    /// The cap was reached before: nothing stored.
    Dropped,
    /// The run is finished (in this state): nothing stored.
    RunEnded(RunState),
}

impl Appended {
    /// The stored event, if one was.
    pub fn event(&self) -> Option<&RunEvent> {
        match self {
            Appended::Stored(e) | Appended::Truncated(e) => Some(e),
            Appended::Dropped | Appended::RunEnded(_) => None,
        }
    }
}

/// Which checks an internal append makes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gate {
    /// Refuse when the run is in a final state.
    live_only: bool,
    /// Apply the run's cap.
    capped: bool,
}

impl Gate {
    /// A caller's event: live runs only, capped.
    pub(crate) const EVENT: Gate = Gate {
        live_only: true,
        capped: true,
    };
    /// An event of a run being ended, written in the ending transaction before `end`.
    pub(crate) const ENDING: Gate = Gate {
        live_only: false,
        capped: true,
    };
    /// The `end` event itself.
    pub(crate) const FINAL: Gate = Gate {
        live_only: false,
        capped: false,
    };
}

fn event_from_row(row: &SqliteRow) -> Result<RunEvent, StoreError> {
    let run_id: String = row.try_get("run_id")?;
    let seq: i64 = row.try_get("seq")?;
    let payload: String = row.try_get("payload")?;
    let payload = serde_json::from_str(&payload)
        .map_err(|e| StoreError::Corrupt(format!("run {run_id} event {seq}: payload: {e}")))?;
    Ok(RunEvent {
        at_ms: row.try_get("at_ms")?,
        kind: row.try_get("kind")?,
        payload,
        run_id,
        seq,
    })
}

/// Appends one event inside the caller's transaction (see the module docs).
pub(crate) async fn push_event(
    conn: &mut SqliteConnection,
    run_id: &str,
    kind: &str,
    payload: &serde_json::Value,
    gate: Gate,
) -> Result<Appended, StoreError> {
    let text = serde_json::to_string(payload)?;
    let mut sql = String::from(
        "UPDATE agent_runs SET next_seq = next_seq + 1 WHERE id = $1 AND ($2 = 0 OR state IN ($3, $4, $5))",
    );
    if gate.capped {
        sql.push_str(" AND next_seq <= max_events");
    }
    sql.push_str(" RETURNING next_seq - 1 AS seq, max_events");
    let taken: Option<(i64, i64)> = sqlx::query_as(&sql)
        .bind(run_id)
        .bind(i64::from(gate.live_only))
        .bind(RunState::ACTIVE[0].as_str())
        .bind(RunState::ACTIVE[1].as_str())
        .bind(RunState::ACTIVE[2].as_str())
        .fetch_optional(&mut *conn)
        .await?;
    let Some((seq, max_events)) = taken else {
        let row: Option<(String,)> = sqlx::query_as("SELECT state FROM agent_runs WHERE id = $1")
            .bind(run_id)
            .fetch_optional(&mut *conn)
            .await?;
        let Some((state,)) = row else {
            return Err(StoreError::NotFound(format!("run {run_id}")));
        };
        let state: RunState = state.parse()?;
        if gate.live_only && state.is_terminal() {
            return Ok(Appended::RunEnded(state));
        }
        sqlx::query("UPDATE agent_runs SET events_dropped = events_dropped + 1 WHERE id = $1")
            .bind(run_id)
            .execute(&mut *conn)
            .await?;
        return Ok(Appended::Dropped);
    };
    let truncated = gate.capped && seq >= max_events;
    let (kind, payload, text) = if truncated {
        let marker = serde_json::json!({ "max_events": max_events });
        let text = serde_json::to_string(&marker)?;
        (EVENT_TRUNCATED, marker, text)
    } else {
        (kind, payload.clone(), text)
    };
    let at_ms = now_ms();
    sqlx::query(
        "INSERT INTO agent_run_events (run_id, seq, at_ms, kind, payload) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(run_id)
    .bind(seq)
    .bind(at_ms)
    .bind(kind)
    .bind(&text)
    .execute(&mut *conn)
    .await?;
    let event = RunEvent {
        run_id: run_id.to_string(),
        seq,
        at_ms,
        kind: kind.to_string(),
        payload,
    };
    if truncated {
        tracing::warn!(run_id, max_events, "run reached its event cap");
        Ok(Appended::Truncated(event))
    } else {
        Ok(Appended::Stored(event))
    }
}

impl Store {
    /// Appends one event to a live run under its next sequence number (see the module
    /// docs for the cap and finished runs); an unknown run is [`StoreError::NotFound`].
    pub async fn append_event(
        &self,
        run_id: &str,
        event: &NewEvent,
    ) -> Result<Appended, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let done = push_event(&mut tx, run_id, &event.kind, &event.payload, Gate::EVENT).await?;
        tx.commit().await?;
        Ok(done)
    }

    /// Appends several events in order in one transaction (one commit for the batch),
    /// with one outcome per event, as [`Store::append_event`] would give them.
    pub async fn append_events(
        &self,
        run_id: &str,
        events: &[NewEvent],
    ) -> Result<Vec<Appended>, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let mut done = Vec::with_capacity(events.len());
        for event in events {
            done.push(push_event(&mut tx, run_id, &event.kind, &event.payload, Gate::EVENT).await?);
        }
        tx.commit().await?;
        Ok(done)
    }

    /// Up to `limit` events of a run with sequence numbers above `after`, in order
    /// (`limit` 0 means 100; at most 1000). `after` 0 reads from the start; a short page
    /// means nothing more is stored yet.
    pub async fn events_after(
        &self,
        run_id: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<RunEvent>, StoreError> {
        let limit = if limit == 0 {
            DEFAULT_PAGE
        } else {
            limit.min(MAX_PAGE)
        };
        let rows = sqlx::query(
            "SELECT run_id, seq, at_ms, kind, payload FROM agent_run_events \
             WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(run_id)
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(event_from_row).collect()
    }
}
