//! Per-user leases (the seed's `sb_container` rows): one warm sandbox per (owner, user).
//!
//! Every mutation is a compare-and-set on `lock_version`: a single conditional statement
//! that succeeds only if nobody wrote the row since the caller read it, so two daemons (or
//! two requests of one daemon) can never both believe they own the same change.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{Store, StoreError};

const LEASE_COLUMNS: &str = "owner, user_name, sandbox_id, status, paused, runtime, lock_version, \
     usage_ms, last_activity_ms, creating_since_ms, created_at_ms, updated_at_ms";

/// Whether a lease's sandbox is usable or being provisioned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseStatus {
    /// Someone is creating the sandbox (since `creating_since_ms`).
    Creating,
    /// Settled: `sandbox_id` is the user's sandbox, or `None` when the lease has none yet.
    Ready,
}

impl LeaseStatus {
    /// The lowercase name used in storage and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseStatus::Creating => "creating",
            LeaseStatus::Ready => "ready",
        }
    }
}

impl fmt::Display for LeaseStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LeaseStatus {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "creating" => Ok(LeaseStatus::Creating),
            "ready" => Ok(LeaseStatus::Ready),
            other => Err(StoreError::Corrupt(format!(
                "unknown lease status {other:?}"
            ))),
        }
    }
}

/// One lease row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// Owner (API key principal) the lease belongs to.
    pub owner: String,
    /// Caller-chosen user name, unique per owner.
    pub user: String,
    /// The user's sandbox; `None` while creating or before the first one.
    pub sandbox_id: Option<String>,
    /// Creating or ready.
    pub status: LeaseStatus,
    /// Whether the sandbox was paused when the lease was last written.
    pub paused: bool,
    /// Runtime the sandbox runs in.
    pub runtime: String,
    /// Optimistic lock: bumped by every write; a write naming an older value loses.
    pub lock_version: i64,
    /// Active milliseconds of the sandboxes this lease held before the current one.
    pub usage_ms: i64,
    /// Last acquire, unix milliseconds.
    pub last_activity_ms: i64,
    /// When the current `creating` phase began, unix milliseconds.
    pub creating_since_ms: Option<i64>,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
    /// Last write, unix milliseconds.
    pub updated_at_ms: i64,
}

fn lease_from_row(row: &SqliteRow) -> Result<LeaseRecord, StoreError> {
    let status: String = row.try_get("status")?;
    let paused: i64 = row.try_get("paused")?;
    Ok(LeaseRecord {
        owner: row.try_get("owner")?,
        user: row.try_get("user_name")?,
        sandbox_id: row.try_get("sandbox_id")?,
        status: status.parse()?,
        paused: paused != 0,
        runtime: row.try_get("runtime")?,
        lock_version: row.try_get("lock_version")?,
        usage_ms: row.try_get("usage_ms")?,
        last_activity_ms: row.try_get("last_activity_ms")?,
        creating_since_ms: row.try_get("creating_since_ms")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
    })
}

impl Store {
    /// The lease of `user` under `owner`, if any.
    pub async fn get_lease(
        &self,
        owner: &str,
        user: &str,
    ) -> Result<Option<LeaseRecord>, StoreError> {
        // A reader connection sees every commit made before the read starts (WAL), so a
        // CAS loser re-reading here sees the winner's row.
        let row = sqlx::query(&format!(
            "SELECT {LEASE_COLUMNS} FROM leases WHERE owner = $1 AND user_name = $2"
        ))
        .bind(owner)
        .bind(user)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(lease_from_row).transpose()
    }

    /// Every lease of `owner`, by user name.
    pub async fn list_leases(&self, owner: &str) -> Result<Vec<LeaseRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {LEASE_COLUMNS} FROM leases WHERE owner = $1 ORDER BY user_name"
        ))
        .bind(owner)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(lease_from_row).collect()
    }

    /// Inserts `rec` unless a lease of the same (owner, user) exists; `true` if inserted.
    /// The first creator of a lease is decided here, by the primary key.
    pub async fn insert_lease(&self, rec: &LeaseRecord) -> Result<bool, StoreError> {
        let done = sqlx::query(&format!(
            "INSERT INTO leases ({LEASE_COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
             ON CONFLICT (owner, user_name) DO NOTHING"
        ))
        .bind(&rec.owner)
        .bind(&rec.user)
        .bind(&rec.sandbox_id)
        .bind(rec.status.as_str())
        .bind(i64::from(rec.paused))
        .bind(&rec.runtime)
        .bind(rec.lock_version)
        .bind(rec.usage_ms)
        .bind(rec.last_activity_ms)
        .bind(rec.creating_since_ms)
        .bind(rec.created_at_ms)
        .bind(rec.updated_at_ms)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Compare-and-set: writes the mutable fields of `next` if the row's `lock_version` is
    /// still `expected`, bumping it to `expected + 1`. Returns the new row, or `None` when
    /// another writer got there first (or the lease is gone): re-read and decide again.
    pub async fn cas_lease(
        &self,
        expected: i64,
        next: &LeaseRecord,
    ) -> Result<Option<LeaseRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "UPDATE leases SET sandbox_id = $1, status = $2, paused = $3, runtime = $4, \
             usage_ms = $5, last_activity_ms = $6, creating_since_ms = $7, updated_at_ms = $8, \
             lock_version = lock_version + 1 \
             WHERE owner = $9 AND user_name = $10 AND lock_version = $11 RETURNING {LEASE_COLUMNS}"
        ))
        .bind(&next.sandbox_id)
        .bind(next.status.as_str())
        .bind(i64::from(next.paused))
        .bind(&next.runtime)
        .bind(next.usage_ms)
        .bind(next.last_activity_ms)
        .bind(next.creating_since_ms)
        .bind(crate::now_ms())
        .bind(&next.owner)
        .bind(&next.user)
        .bind(expected)
        .fetch_optional(&self.writer)
        .await?;
        row.as_ref().map(lease_from_row).transpose()
    }

    /// Compare-and-delete: removes the lease if its `lock_version` is still `expected`.
    pub async fn delete_lease(
        &self,
        owner: &str,
        user: &str,
        expected: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "DELETE FROM leases WHERE owner = $1 AND user_name = $2 AND lock_version = $3",
        )
        .bind(owner)
        .bind(user)
        .bind(expected)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_unknown_status_is_reported_as_corrupt() {
        let store = Store::open_in_memory().await.unwrap();
        sqlx::query(
            "INSERT INTO leases (owner, user_name, sandbox_id, status, paused, runtime, \
             lock_version, usage_ms, last_activity_ms, creating_since_ms, created_at_ms, \
             updated_at_ms) VALUES ('o', 'u', NULL, 'exploded', 0, 'c', 1, 0, 0, NULL, 0, 0)",
        )
        .execute(&store.writer)
        .await
        .unwrap();
        let err = store.get_lease("o", "u").await.unwrap_err();
        assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
        assert!(store.list_leases("o").await.is_err());
    }
}
