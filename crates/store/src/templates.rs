//! Templates: names mapped to root filesystem directories.

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{Store, StoreError, TemplateRecord};

fn template_from_row(row: &SqliteRow) -> Result<TemplateRecord, StoreError> {
    Ok(TemplateRecord {
        name: row.try_get("name")?,
        rootfs: row.try_get("rootfs")?,
        created_at_ms: row.try_get("created_at_ms")?,
    })
}

impl Store {
    /// Registers a template or repoints an existing one at a new rootfs (keeping its creation time).
    pub async fn upsert_template(&self, t: &TemplateRecord) -> Result<(), StoreError> {
        // ON CONFLICT ... DO UPDATE is spelled the same in SQLite and PostgreSQL.
        sqlx::query(
            "INSERT INTO templates (name, rootfs, created_at_ms) VALUES ($1, $2, $3)
             ON CONFLICT (name) DO UPDATE SET rootfs = excluded.rootfs",
        )
        .bind(&t.name)
        .bind(&t.rootfs)
        .bind(t.created_at_ms)
        .execute(&self.writer)
        .await?;
        tracing::info!(template = %t.name, rootfs = %t.rootfs, "template registered");
        Ok(())
    }

    /// The template with this name, if any.
    pub async fn get_template(&self, name: &str) -> Result<Option<TemplateRecord>, StoreError> {
        let row = sqlx::query("SELECT name, rootfs, created_at_ms FROM templates WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(template_from_row).transpose()
    }

    /// All templates ordered by name.
    pub async fn list_templates(&self) -> Result<Vec<TemplateRecord>, StoreError> {
        let rows = sqlx::query("SELECT name, rootfs, created_at_ms FROM templates ORDER BY name")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(template_from_row).collect()
    }

    /// Removes the template; `false` if it did not exist. Existing sandboxes are unaffected.
    pub async fn delete_template(&self, name: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM templates WHERE name = $1")
            .bind(name)
            .execute(&self.writer)
            .await?;
        let deleted = done.rows_affected() > 0;
        if deleted {
            tracing::info!(template = name, "template deleted");
        }
        Ok(deleted)
    }
}
