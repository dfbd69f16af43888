//! Snapshot records: one per stored layer archive, linked to its parent.

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{SnapshotRecord, Store, StoreError};

const COLUMNS: &str = "id, owner, name, sandbox_id, parent, template, runtime, kind, size_bytes, \
     entries, digest, settings, created_at_ms";

fn from_row(row: &SqliteRow) -> Result<SnapshotRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let settings: String = row.try_get("settings")?;
    Ok(SnapshotRecord {
        owner: row.try_get("owner")?,
        name: row.try_get("name")?,
        sandbox_id: row.try_get("sandbox_id")?,
        parent: row.try_get("parent")?,
        template: row.try_get("template")?,
        runtime: row.try_get("runtime")?,
        kind: row.try_get("kind")?,
        size_bytes: row.try_get("size_bytes")?,
        entries: row.try_get("entries")?,
        digest: row.try_get("digest")?,
        settings: serde_json::from_str(&settings)
            .map_err(|e| StoreError::Corrupt(format!("snapshot {id}: settings: {e}")))?,
        created_at_ms: row.try_get("created_at_ms")?,
        id,
    })
}

impl Store {
    /// Records a stored snapshot; a name the owner already uses is a [`StoreError::Conflict`].
    pub async fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO snapshots ({COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
        ))
        .bind(&s.id)
        .bind(&s.owner)
        .bind(&s.name)
        .bind(&s.sandbox_id)
        .bind(&s.parent)
        .bind(&s.template)
        .bind(&s.runtime)
        .bind(&s.kind)
        .bind(s.size_bytes)
        .bind(s.entries)
        .bind(&s.digest)
        .bind(serde_json::to_string(&s.settings)?)
        .bind(s.created_at_ms)
        .execute(&self.writer)
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::Conflict(_) => {
                StoreError::Conflict(format!("a snapshot named {:?} exists", s.name))
            }
            other => other,
        })?;
        Ok(())
    }

    /// The owner's snapshot with this id or name.
    pub async fn get_snapshot(
        &self,
        owner: &str,
        id_or_name: &str,
    ) -> Result<Option<SnapshotRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE owner = $1 AND (id = $2 OR name = $2) \
             ORDER BY id = $2 DESC LIMIT 1"
        ))
        .bind(owner)
        .bind(id_or_name)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// The owner's snapshots, newest first (every owner's when `owner` is None).
    pub async fn list_snapshots(
        &self,
        owner: Option<&str>,
    ) -> Result<Vec<SnapshotRecord>, StoreError> {
        let rows = match owner {
            Some(o) => {
                sqlx::query(&format!(
                    "SELECT {COLUMNS} FROM snapshots WHERE owner = $1 \
                     ORDER BY created_at_ms DESC, id"
                ))
                .bind(o)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(&format!(
                    "SELECT {COLUMNS} FROM snapshots ORDER BY created_at_ms DESC, id"
                ))
                .fetch_all(&self.pool)
                .await?
            }
        };
        rows.iter().map(from_row).collect()
    }

    /// Snapshots whose parent is `id`.
    pub async fn snapshot_children(&self, id: &str) -> Result<Vec<SnapshotRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE parent = $1 ORDER BY created_at_ms, id"
        ))
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(from_row).collect()
    }

    /// Removes a snapshot record; `false` if it was not there.
    pub async fn delete_snapshot(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM snapshots WHERE id = $1")
            .bind(id)
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected() > 0)
    }
}
