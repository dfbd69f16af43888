//! Persistent state of the sandpit daemon (API keys, sandboxes, pools, templates,
//! snapshots, volumes, leases, usage, metrics history, secrets, network policies and the audit, agent
//! runtimes with their runs, run events and approvals) behind a small repository API. SQLite is the embedded backend; SQL is kept portable for a later
//! PostgreSQL one.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[macro_use]
mod stored_enum;

mod access;
mod agents;
mod approvals;
mod e2b_templates;
mod error;
mod keys;
pub use keys::{E2B_KEY_PREFIX, e2b_key_form};
mod e2b_secrets;
mod leases;
mod metrics;
mod model;
mod network;
mod pools;
mod run_events;
mod runs;
mod sandboxes;
mod schema;
mod secrets;
mod snapshots;
mod templates;
mod usage;
mod volumes;

use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

pub use access::SandboxAccess;
pub use agents::{AgentRuntimeRecord, AgentRuntimeState, EndedAgents, NewAgentRuntime};
pub use approvals::{
    ApprovalRecord, ApprovalScope, ApprovalState, ApprovalTarget, Capability, Decided, Decision,
    NewApproval, Requested,
};
pub use e2b_secrets::{E2bSecretRecord, EgressRulesRecord};
pub use e2b_templates::{E2bBuildRecord, E2bTagRecord, E2bTemplateRecord};
pub use error::StoreError;
pub use leases::{LeaseRecord, LeaseStatus};
pub use metrics::MetricSample;
pub use model::{
    ApiKey, Lifecycle, OnTimeout, ParseSandboxStateError, PoolRecord, SandboxFilter, SandboxPage,
    SandboxRecord, SandboxState, SnapshotRecord, TemplateRecord, TemplateState,
};
pub use network::{AuditFilter, AuditRecord, AuditWrite};
pub use pools::Claim;
pub use run_events::{
    Appended, EVENT_APPROVAL_DECIDED, EVENT_APPROVAL_REFUSED, EVENT_APPROVAL_REQUESTED, EVENT_END,
    EVENT_TRUNCATED, NewEvent, RunEvent,
};
pub use runs::{NewRun, RunMode, RunRecord, RunStart, RunState, RunUpdate};
pub use schema::SCHEMA_VERSION;
pub use secrets::{SecretAttachment, SecretRecord};
pub use templates::TemplateUsers;
pub use usage::{
    ExecutionPage, ExecutionRecord, OwnerUsage, SandboxUsageRecord, UsageEvent, active_ms,
};
pub use volumes::{VolumeAttach, VolumeDeletion, VolumeRecord, VolumeState};

/// How long a connection waits on another writer's lock before failing with "database is locked".
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// SQLite serialises writers anyway; a few connections let reads proceed beside a write.
const MAX_FILE_CONNECTIONS: u32 = 4;

/// Handle to the daemon's database; cheap to clone (clones share the connection pools).
#[derive(Debug, Clone)]
pub struct Store {
    /// Reads (several at once beside a write, thanks to WAL).
    pool: SqlitePool,
    /// Writes, through one connection: concurrent writers then queue in the daemon
    /// instead of meeting SQLITE_BUSY, whose handler sleeps a millisecond or more.
    writer: SqlitePool,
}

impl Store {
    /// Opens (creating if missing) the database file at `path` and brings its schema up to date.
    pub async fn open(path: &Path) -> Result<Store, StoreError> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            // WAL lets readers run while the daemon writes; NORMAL sync is durable enough
            // under WAL (a power cut can lose the last commits, never corrupt the file).
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true);
        // Switching a new connection to WAL can meet SQLITE_BUSY before the busy timeout is
        // in force (another process opening the same file at that moment); retry briefly.
        let connect = |max: u32| {
            let options = options.clone();
            async move {
                let mut attempt = 0;
                loop {
                    let opened = SqlitePoolOptions::new()
                        .max_connections(max)
                        .connect_with(options.clone())
                        .await;
                    match opened {
                        Err(sqlx::Error::Database(e))
                            if attempt < 50 && e.message().contains("locked") =>
                        {
                            attempt += 1;
                            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        }
                        other => break other,
                    }
                }
            }
        };
        let writer = connect(1).await?;
        schema::apply(&writer).await?;
        let pool = connect(MAX_FILE_CONNECTIONS).await?;
        tracing::info!(path = %path.display(), "store opened");
        Ok(Store { pool, writer })
    }

    /// Opens a fresh private in-memory database (for tests); its data is gone when dropped.
    pub async fn open_in_memory() -> Result<Store, StoreError> {
        let options = SqliteConnectOptions::from_str("sqlite::memory:")?
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true);
        // Each SQLite in-memory connection is its own database, so the pool must hold
        // exactly one connection and never retire it.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await?;
        schema::apply(&pool).await?;
        Ok(Store {
            writer: pool.clone(),
            pool,
        })
    }

    /// Waits for in-flight queries and closes every connection (checkpointing the WAL).
    pub async fn close(&self) {
        self.pool.close().await;
        self.writer.close().await;
    }
}

/// Owner of the idle members of warm pools: nobody can see or claim them by owner.
pub const POOL_OWNER: &str = "";

/// Current wall-clock time in unix milliseconds.
pub fn now_ms() -> i64 {
    // A clock before 1970 is a broken host; 0 keeps timestamps ordered rather than failing.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn schema_rows(store: &Store) -> Vec<i64> {
        sqlx::query_as::<_, (i64,)>("SELECT version FROM schema_version ORDER BY version")
            .fetch_all(&store.pool)
            .await
            .unwrap()
            .into_iter()
            .map(|(v,)| v)
            .collect()
    }

    #[tokio::test]
    async fn schema_is_applied_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("schema.db");
        let store = Store::open(&path).await.unwrap();
        // The versions this build has (numbers are assigned per feature, so gaps are normal).
        // Every migration this build has (versions are assigned per feature, so there can be gaps).
        let all: Vec<i64> = schema::MIGRATIONS.iter().map(|(v, _)| *v).collect();
        assert_eq!(schema_rows(&store).await, all);
        // Applying again on a live database changes nothing and does not fail.
        schema::apply(&store.pool).await.unwrap();
        store.close().await;
        let store = Store::open(&path).await.unwrap();
        assert_eq!(schema_rows(&store).await, all);
        let (mode,): (String,) = sqlx::query_as("PRAGMA journal_mode")
            .fetch_one(&store.pool)
            .await
            .unwrap();
        assert_eq!(mode, "wal");
        let (fk,): (i64,) = sqlx::query_as("PRAGMA foreign_keys")
            .fetch_one(&store.pool)
            .await
            .unwrap();
        assert_eq!(fk, 1);
    }

    #[tokio::test]
    async fn a_migration_that_lands_after_a_higher_one_still_runs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gap.db");
        let store = Store::open(&path).await.unwrap();
        // As if this database had been made by a build without migration 3.
        sqlx::query("DELETE FROM schema_version WHERE version = 3")
            .execute(&store.writer)
            .await
            .unwrap();
        sqlx::query("DROP TABLE snapshots")
            .execute(&store.writer)
            .await
            .unwrap();
        sqlx::query("ALTER TABLE sandboxes DROP COLUMN life")
            .execute(&store.writer)
            .await
            .unwrap();
        store.close().await;
        let store = Store::open(&path).await.unwrap();
        let all: Vec<i64> = schema::MIGRATIONS.iter().map(|(v, _)| *v).collect();
        let mut got = schema_rows(&store).await;
        got.sort();
        assert_eq!(got, all);
        let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM snapshots")
            .fetch_one(&store.pool)
            .await
            .unwrap();
        assert_eq!(n, 0);
    }

    #[tokio::test]
    async fn newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("future.db");
        let store = Store::open(&path).await.unwrap();
        sqlx::query("INSERT INTO schema_version (version, applied_at_ms) VALUES ($1, 0)")
            .bind(SCHEMA_VERSION + 1)
            .execute(&store.pool)
            .await
            .unwrap();
        store.close().await;
        let err = Store::open(&path).await.unwrap_err();
        assert!(matches!(err, StoreError::SchemaTooNew { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn corrupt_rows_are_reported_not_panicked() {
        let store = Store::open_in_memory().await.unwrap();
        sqlx::query(
            "INSERT INTO sandboxes (id, owner, template, runtime, state, cpu_millis, memory_bytes,
             disk_bytes, max_processes, env, metadata, created_at_ms, updated_at_ms,
             expires_at_ms, runtime_state, error, version)
             VALUES ('bad', 'o', 't', 'r', 'exploded', 0, 0, 0, 0, '{}', '{}', 0, 0, 0, '{}', NULL, 0)",
        )
        .execute(&store.pool)
        .await
        .unwrap();
        let err = store.get_sandbox("bad").await.unwrap_err();
        assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
    }
}
