//! Warm pools and the atomic claim of a pooled sandbox.

use std::collections::BTreeMap;

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{PoolRecord, SandboxRecord, SandboxState, Store, StoreError, now_ms};

const POOL_COLUMNS: &str = "name, template, runtime, cpu_millis, memory_bytes, disk_bytes, \
     max_processes, size, source, hits, misses, created_at_ms";

fn pool_from_row(row: &SqliteRow) -> Result<PoolRecord, StoreError> {
    Ok(PoolRecord {
        name: row.try_get("name")?,
        template: row.try_get("template")?,
        runtime: row.try_get("runtime")?,
        cpu_millis: row.try_get("cpu_millis")?,
        memory_bytes: row.try_get("memory_bytes")?,
        disk_bytes: row.try_get("disk_bytes")?,
        max_processes: row.try_get("max_processes")?,
        size: row.try_get("size")?,
        source: row.try_get("source")?,
        hits: row.try_get("hits")?,
        misses: row.try_get("misses")?,
        created_at_ms: row.try_get("created_at_ms")?,
    })
}

/// What a claim writes into the pooled sandbox's record.
#[derive(Debug, Clone)]
pub struct Claim<'a> {
    /// The new owner.
    pub owner: &'a str,
    /// The caller's environment for the sandbox.
    pub env: &'a BTreeMap<String, String>,
    /// Names of the `env` variables whose values are secret.
    pub secret_env: &'a std::collections::BTreeSet<String>,
    /// The caller's metadata.
    pub metadata: &'a BTreeMap<String, String>,
    /// Expiry computed from the caller's timeout, unix milliseconds.
    pub expires_at_ms: i64,
    /// The caller's lifecycle settings.
    pub life: &'a crate::Lifecycle,
}

impl Store {
    /// Creates a pool or replaces its definition, keeping its counters and creation time.
    pub async fn upsert_pool(&self, p: &PoolRecord) -> Result<(), StoreError> {
        self.write_pool(
            p,
            " ON CONFLICT (name) DO UPDATE SET template = excluded.template, \
             runtime = excluded.runtime, cpu_millis = excluded.cpu_millis, \
             memory_bytes = excluded.memory_bytes, disk_bytes = excluded.disk_bytes, \
             max_processes = excluded.max_processes, size = excluded.size, \
             source = excluded.source",
        )
        .await
    }

    /// Inserts a new pool; an existing name yields [`StoreError::Conflict`].
    pub async fn insert_pool(&self, p: &PoolRecord) -> Result<(), StoreError> {
        // A plain INSERT: the primary key decides between two concurrent creators.
        self.write_pool(p, "").await.map_err(|e| match e {
            StoreError::Conflict(_) => StoreError::Conflict(format!("pool {} exists", p.name)),
            other => other,
        })
    }

    /// `INSERT` of every column of `p`, followed by `on_conflict`.
    async fn write_pool(&self, p: &PoolRecord, on_conflict: &str) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO pools ({POOL_COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12){on_conflict}"
        ))
        .bind(&p.name)
        .bind(&p.template)
        .bind(&p.runtime)
        .bind(p.cpu_millis)
        .bind(p.memory_bytes)
        .bind(p.disk_bytes)
        .bind(p.max_processes)
        .bind(p.size)
        .bind(&p.source)
        .bind(p.hits)
        .bind(p.misses)
        .bind(p.created_at_ms)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    /// Deletes the records of unclaimed pool sandboxes in a final state (nobody else can
    /// see or delete them); returns how many went.
    pub async fn delete_final_pool_records(&self) -> Result<u64, StoreError> {
        let done = sqlx::query("DELETE FROM sandboxes WHERE owner = '' AND state IN ($1, $2)")
            .bind(SandboxState::Stopped.as_str())
            .bind(SandboxState::Error.as_str())
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected())
    }

    /// The pool with this name, if any.
    pub async fn get_pool(&self, name: &str) -> Result<Option<PoolRecord>, StoreError> {
        let row = sqlx::query(&format!("SELECT {POOL_COLUMNS} FROM pools WHERE name = $1"))
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(pool_from_row).transpose()
    }

    /// Every pool, by name.
    pub async fn list_pools(&self) -> Result<Vec<PoolRecord>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {POOL_COLUMNS} FROM pools ORDER BY name"))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(pool_from_row).collect()
    }

    /// Changes a pool's size; `false` if the name is unknown.
    pub async fn resize_pool(&self, name: &str, size: i64) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE pools SET size = $1 WHERE name = $2")
            .bind(size)
            .bind(name)
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Removes a pool's definition; `false` if the name is unknown.
    pub async fn delete_pool(&self, name: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM pools WHERE name = $1")
            .bind(name)
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Adds to a pool's hit and miss counters.
    pub async fn count_pool(&self, name: &str, hits: i64, misses: i64) -> Result<(), StoreError> {
        sqlx::query("UPDATE pools SET hits = hits + $1, misses = misses + $2 WHERE name = $3")
            .bind(hits)
            .bind(misses)
            .bind(name)
            .execute(&self.writer)
            .await?;
        Ok(())
    }

    /// Idle running members of a pool (no owner yet), oldest first.
    pub async fn pool_members(&self, pool: &str) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {} FROM sandboxes WHERE pool = $1 AND owner = '' ORDER BY created_at_ms, id",
            crate::sandboxes::SANDBOX_COLUMNS
        ))
        .bind(pool)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(crate::sandboxes::sandbox_from_row)
            .collect()
    }

    /// Hands the idle pooled sandbox `id` to a caller in one conditional UPDATE, so two
    /// claims can never both win it; `None` if it is no longer idle in `pool`.
    pub async fn claim_pooled(
        &self,
        id: &str,
        pool: &str,
        claim: &Claim<'_>,
    ) -> Result<Option<SandboxRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "UPDATE sandboxes SET owner = $1, env = $2, metadata = $3, expires_at_ms = $4, \
             created_at_ms = $5, updated_at_ms = $5, version = version + 1, life = $9, secret_env = $10 \
             WHERE id = $6 AND pool = $7 AND owner = '' AND state = $8 RETURNING {}",
            crate::sandboxes::SANDBOX_COLUMNS
        ))
        .bind(claim.owner)
        .bind(serde_json::to_string(claim.env)?)
        .bind(serde_json::to_string(claim.metadata)?)
        .bind(claim.expires_at_ms)
        .bind(now_ms())
        .bind(id)
        .bind(pool)
        .bind(SandboxState::Running.as_str())
        .bind(serde_json::to_string(claim.life)?)
        .bind(serde_json::to_string(claim.secret_env)?)
        .fetch_optional(&self.writer)
        .await?;
        row.as_ref()
            .map(crate::sandboxes::sandbox_from_row)
            .transpose()
    }
}
