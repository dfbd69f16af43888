//! Sandbox records: inserts, compare-and-set state transitions, keyset-paginated listing.

use std::collections::BTreeMap;

use sqlx::sqlite::SqliteRow;
use sqlx::{QueryBuilder, Row, Sqlite};

use crate::{SandboxFilter, SandboxPage, SandboxRecord, SandboxState, Store, StoreError, now_ms};

pub(crate) const SANDBOX_COLUMNS: &str = "id, owner, template, runtime, state, cpu_millis, memory_bytes, \
     disk_bytes, max_processes, env, metadata, created_at_ms, updated_at_ms, expires_at_ms, \
     runtime_state, error, version, pool, life, secret_env";

const DEFAULT_LIMIT: u32 = 100;
const MAX_LIMIT: u32 = 1000;

/// Page size after applying the documented defaults and bounds.
fn effective_limit(requested: u32) -> usize {
    let limit = if requested == 0 {
        DEFAULT_LIMIT
    } else {
        requested.clamp(1, MAX_LIMIT)
    };
    // u32 -> usize is lossless on every platform this runs on.
    limit as usize
}

/// Position of a row in the (created_at_ms, id) listing order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Position {
    created_at_ms: i64,
    id: String,
}

/// Hex keeps the cursor URL-safe and opaque without pulling in another encoding.
fn encode_cursor(pos: &Position) -> String {
    hex::encode(format!("{}:{}", pos.created_at_ms, pos.id))
}

fn decode_cursor(cursor: &str) -> Result<Position, StoreError> {
    let bytes = hex::decode(cursor).map_err(|_| StoreError::InvalidCursor)?;
    let text = String::from_utf8(bytes).map_err(|_| StoreError::InvalidCursor)?;
    // The timestamp never contains ':', so splitting at the first one keeps ids with ':' intact.
    let (ts, id) = text.split_once(':').ok_or(StoreError::InvalidCursor)?;
    let created_at_ms = ts.parse().map_err(|_| StoreError::InvalidCursor)?;
    if id.is_empty() {
        return Err(StoreError::InvalidCursor);
    }
    Ok(Position {
        created_at_ms,
        id: id.to_string(),
    })
}

fn decode_json<T: serde::de::DeserializeOwned>(
    id: &str,
    column: &str,
    text: &str,
) -> Result<T, StoreError> {
    serde_json::from_str(text)
        .map_err(|e| StoreError::Corrupt(format!("sandbox {id}: column {column}: {e}")))
}

pub(crate) fn sandbox_from_row(row: &SqliteRow) -> Result<SandboxRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let state: String = row.try_get("state")?;
    let state = state
        .parse()
        .map_err(|e| StoreError::Corrupt(format!("sandbox {id}: {e}")))?;
    let env: String = row.try_get("env")?;
    let metadata: String = row.try_get("metadata")?;
    let runtime_state: String = row.try_get("runtime_state")?;
    let life: String = row.try_get("life")?;
    let secret_env: String = row.try_get("secret_env")?;
    Ok(SandboxRecord {
        secret_env: decode_json(&id, "secret_env", &secret_env)?,
        life: decode_json(&id, "life", &life)?,
        owner: row.try_get("owner")?,
        template: row.try_get("template")?,
        runtime: row.try_get("runtime")?,
        state,
        cpu_millis: row.try_get("cpu_millis")?,
        memory_bytes: row.try_get("memory_bytes")?,
        disk_bytes: row.try_get("disk_bytes")?,
        max_processes: row.try_get("max_processes")?,
        env: decode_json(&id, "env", &env)?,
        metadata: decode_json(&id, "metadata", &metadata)?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        runtime_state: decode_json(&id, "runtime_state", &runtime_state)?,
        error: row.try_get("error")?,
        version: row.try_get("version")?,
        pool: row.try_get("pool")?,
        id,
    })
}

/// Appends `AND state IN (...)`; callers must handle the empty list themselves.
fn push_state_in(qb: &mut QueryBuilder<'_, Sqlite>, states: &[SandboxState]) {
    qb.push(" AND state IN (");
    let mut list = qb.separated(", ");
    for state in states {
        list.push_bind(state.as_str());
    }
    list.push_unseparated(")");
}

fn metadata_matches(metadata: &BTreeMap<String, String>, wanted: &[(String, String)]) -> bool {
    wanted
        .iter()
        .all(|(k, v)| metadata.get(k).is_some_and(|have| have == v))
}

impl Store {
    /// Inserts a new sandbox exactly as given; an existing id yields [`StoreError::Conflict`].
    pub async fn insert_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO sandboxes ({SANDBOX_COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20)"
        ))
        .bind(&s.id)
        .bind(&s.owner)
        .bind(&s.template)
        .bind(&s.runtime)
        .bind(s.state.as_str())
        .bind(s.cpu_millis)
        .bind(s.memory_bytes)
        .bind(s.disk_bytes)
        .bind(s.max_processes)
        .bind(serde_json::to_string(&s.env)?)
        .bind(serde_json::to_string(&s.metadata)?)
        .bind(s.created_at_ms)
        .bind(s.updated_at_ms)
        .bind(s.expires_at_ms)
        .bind(serde_json::to_string(&s.runtime_state)?)
        .bind(&s.error)
        .bind(s.version)
        .bind(&s.pool)
        .bind(serde_json::to_string(&s.life)?)
        .bind(serde_json::to_string(&s.secret_env)?)
        .execute(&self.writer)
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::Conflict(_) => StoreError::Conflict(format!("sandbox {} exists", s.id)),
            other => other,
        })?;
        tracing::debug!(sandbox_id = %s.id, owner = %s.owner, state = %s.state, "sandbox inserted");
        Ok(())
    }

    /// The sandbox with this id, if any.
    pub async fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(sandbox_from_row).transpose()
    }

    /// One page of sandboxes matching `f`, ordered by (created_at_ms, id).
    ///
    /// Metadata is matched in Rust rather than with a backend-specific JSON operator; the scan
    /// continues until the page is full, so only the last page can come back short.
    pub async fn list_sandboxes(&self, f: &SandboxFilter) -> Result<SandboxPage, StoreError> {
        let limit = effective_limit(f.limit);
        let mut after = f.cursor.as_deref().map(decode_cursor).transpose()?;
        // One extra match tells whether a next page exists, so no caller ever fetches an
        // empty trailing page.
        let wanted = limit + 1;
        let batch = if f.metadata.is_empty() {
            wanted
        } else {
            // Filtered scans discard rows; larger batches mean fewer round trips.
            (wanted * 4).min(MAX_LIMIT as usize + 1)
        };
        let mut items = Vec::with_capacity(wanted);
        'scan: loop {
            let rows = self.scan_batch(f, after.as_ref(), batch).await?;
            let exhausted = rows.len() < batch;
            for row in &rows {
                let record = sandbox_from_row(row)?;
                after = Some(Position {
                    created_at_ms: record.created_at_ms,
                    id: record.id.clone(),
                });
                if metadata_matches(&record.metadata, &f.metadata) {
                    items.push(record);
                    if items.len() == wanted {
                        break 'scan;
                    }
                }
            }
            if exhausted {
                break;
            }
        }
        let next_cursor = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|last| {
                encode_cursor(&Position {
                    created_at_ms: last.created_at_ms,
                    id: last.id.clone(),
                })
            })
        } else {
            None
        };
        Ok(SandboxPage { items, next_cursor })
    }

    /// Rows after `after` matching the owner/state part of `f`, in listing order.
    async fn scan_batch(
        &self,
        f: &SandboxFilter,
        after: Option<&Position>,
        batch: usize,
    ) -> Result<Vec<SqliteRow>, StoreError> {
        let mut qb: QueryBuilder<'_, Sqlite> = QueryBuilder::new(format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE 1 = 1"
        ));
        if let Some(owner) = &f.owner {
            qb.push(" AND owner = ").push_bind(owner.clone());
        }
        if !f.states.is_empty() {
            push_state_in(&mut qb, &f.states);
        }
        if let Some(from) = f.created_from_ms {
            qb.push(" AND created_at_ms >= ").push_bind(from);
        }
        if let Some(template) = &f.template {
            qb.push(" AND template = ").push_bind(template.clone());
        }
        let (cmp, order) = if f.newest_first {
            ("<", " ORDER BY created_at_ms DESC, id DESC LIMIT ")
        } else {
            (">", " ORDER BY created_at_ms, id LIMIT ")
        };
        if let Some(pos) = after {
            // Expanded form of (created_at_ms, id) > (?, ?), which not every backend indexes well.
            qb.push(format!(" AND (created_at_ms {cmp} "))
                .push_bind(pos.created_at_ms)
                .push(" OR (created_at_ms = ")
                .push_bind(pos.created_at_ms)
                .push(format!(" AND id {cmp} "))
                .push_bind(pos.id.clone())
                .push("))");
        }
        qb.push(order)
            .push_bind(i64::try_from(batch).unwrap_or(i64::MAX));
        Ok(qb.build().fetch_all(&self.pool).await?)
    }

    /// Atomic compare-and-set of the state: succeeds only if the current state is one of `from`;
    /// bumps `version` and `updated_at_ms`, replaces `error` (None clears it) and returns the new
    /// record, or `None` when the state did not match or the row is missing.
    pub async fn transition(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        error: Option<&str>,
    ) -> Result<Option<SandboxRecord>, StoreError> {
        self.transition_with(id, from, to, error, None).await
    }

    /// [`Self::transition`] that also replaces the lifecycle document in the same write, so
    /// that a state and the layers it depends on never disagree.
    pub async fn transition_life(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        life: &crate::Lifecycle,
    ) -> Result<Option<SandboxRecord>, StoreError> {
        self.transition_with(id, from, to, None, Some(life)).await
    }

    async fn transition_with(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        error: Option<&str>,
        life: Option<&crate::Lifecycle>,
    ) -> Result<Option<SandboxRecord>, StoreError> {
        if from.is_empty() {
            return Ok(None);
        }
        // A single conditional UPDATE is the CAS: no read-then-write window for a racing caller.
        let mut qb: QueryBuilder<'_, Sqlite> = QueryBuilder::new("UPDATE sandboxes SET state = ");
        qb.push_bind(to.as_str())
            .push(", error = ")
            .push_bind(error.map(str::to_string));
        if let Some(life) = life {
            qb.push(", life = ").push_bind(serde_json::to_string(life)?);
        }
        qb.push(", version = version + 1, updated_at_ms = ")
            .push_bind(now_ms())
            .push(" WHERE id = ")
            .push_bind(id.to_string());
        push_state_in(&mut qb, from);
        qb.push(format!(" RETURNING {SANDBOX_COLUMNS}"));
        let row = qb.build().fetch_optional(&self.writer).await?;
        let record = row.as_ref().map(sandbox_from_row).transpose()?;
        match &record {
            Some(r) => {
                tracing::debug!(sandbox_id = id, to = %to, version = r.version, "sandbox state changed")
            }
            None => tracing::debug!(sandbox_id = id, ?from, to = %to, "sandbox transition refused"),
        }
        Ok(record)
    }

    /// Records the runtime's opaque re-adoption data of a sandbox that is still being
    /// created; [`StoreError::NotFound`] if the id is unknown or no longer `creating` (a
    /// delete that came first never saw the handle, so the creator must clean up).
    pub async fn set_runtime_state(
        &self,
        id: &str,
        runtime_state: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(
            "UPDATE sandboxes SET runtime_state = $1, updated_at_ms = $2 WHERE id = $3 AND state = $4",
        )
        .bind(serde_json::to_string(runtime_state)?)
        .bind(now_ms())
        .bind(id)
        .bind(SandboxState::Creating.as_str())
        .execute(&self.writer)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound(format!("sandbox {id} being created")));
        }
        Ok(())
    }

    /// Moves the expiry deadline (unix ms); `false` if the id is unknown.
    pub async fn set_expires_at(&self, id: &str, expires_at_ms: i64) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE sandboxes SET expires_at_ms = $1, updated_at_ms = $2 WHERE id = $3",
        )
        .bind(expires_at_ms)
        .bind(now_ms())
        .bind(id)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Replaces a sandbox's lifecycle document; `false` if the id is unknown.
    pub async fn set_life(&self, id: &str, life: &crate::Lifecycle) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE sandboxes SET life = $1, updated_at_ms = $2 WHERE id = $3")
            .bind(serde_json::to_string(life)?)
            .bind(now_ms())
            .bind(id)
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Records API activity: each sandbox's `last_activity_ms`, never moved backwards.
    pub async fn touch_sandboxes(&self, touched: &[(String, i64)]) -> Result<(), StoreError> {
        if touched.is_empty() {
            return Ok(());
        }
        let mut tx = self.writer.begin().await?;
        for (id, at) in touched {
            sqlx::query(
                "UPDATE sandboxes SET life = json_set(life, '$.last_activity_ms', $1) \
                 WHERE id = $2 AND COALESCE(json_extract(life, '$.last_activity_ms'), 0) < $1",
            )
            .bind(at)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Removes the record; `false` if the id is unknown.
    pub async fn delete_sandbox(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM sandboxes WHERE id = $1")
            .bind(id)
            .execute(&self.writer)
            .await?;
        let deleted = done.rows_affected() > 0;
        if deleted {
            tracing::debug!(sandbox_id = id, "sandbox deleted");
        }
        Ok(deleted)
    }

    /// Sandboxes in any of `states` (empty = any state) whose `expires_at_ms <= now_ms`,
    /// soonest-expired first.
    pub async fn expired_sandboxes(
        &self,
        now_ms: i64,
        states: &[SandboxState],
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        let mut qb: QueryBuilder<'_, Sqlite> = QueryBuilder::new(format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE expires_at_ms <= "
        ));
        qb.push_bind(now_ms);
        if !states.is_empty() {
            push_state_in(&mut qb, states);
        }
        qb.push(" ORDER BY expires_at_ms, id");
        let rows = qb.build().fetch_all(&self.pool).await?;
        rows.iter().map(sandbox_from_row).collect()
    }

    /// Every sandbox not in a final state, oldest first (for reconciling after a restart).
    pub async fn live_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let mut qb: QueryBuilder<'_, Sqlite> = QueryBuilder::new(format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE state NOT IN ("
        ));
        let mut list = qb.separated(", ");
        for state in SandboxState::FINAL {
            list.push_bind(state.as_str());
        }
        list.push_unseparated(") ORDER BY created_at_ms, id");
        let rows = qb.build().fetch_all(&self.pool).await?;
        rows.iter().map(sandbox_from_row).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_roundtrip_keeps_colons_in_ids() {
        let pos = Position {
            created_at_ms: 1_700_000_000_123,
            id: "sb:with:colons".into(),
        };
        assert_eq!(decode_cursor(&encode_cursor(&pos)).unwrap(), pos);
        let negative = Position {
            created_at_ms: -5,
            id: "x".into(),
        };
        assert_eq!(decode_cursor(&encode_cursor(&negative)).unwrap(), negative);
    }

    #[test]
    fn malformed_cursors_are_rejected() {
        for bad in [
            "",
            "zz",
            "abc",                            // odd length
            &hex::encode("no-colon"),         // no separator
            &hex::encode("12x:id"),           // non-numeric timestamp
            &hex::encode("12:"),              // empty id
            &hex::encode([0xff, 0xfe, b':']), // not UTF-8
        ] {
            assert!(
                matches!(decode_cursor(bad), Err(StoreError::InvalidCursor)),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn limits_are_clamped() {
        assert_eq!(effective_limit(0), 100);
        assert_eq!(effective_limit(1), 1);
        assert_eq!(effective_limit(1000), 1000);
        assert_eq!(effective_limit(5000), 1000);
    }
}
