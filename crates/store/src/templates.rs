//! Templates: named root filesystem directories, the settings their sandboxes start with,
//! and the state of the build that made them.

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{Store, StoreError, TemplateRecord, TemplateState, now_ms};

const TEMPLATE_COLUMNS: &str = "name, rootfs, created_at_ms, default_user, workdir, env, \
     start_cmd, ready_cmd, ready_timeout_secs, source, size_bytes, state, error, updated_at_ms, \
     build_id";

fn template_from_row(row: &SqliteRow) -> Result<TemplateRecord, StoreError> {
    let name: String = row.try_get("name")?;
    let corrupt = |column: &str, e: String| {
        StoreError::Corrupt(format!("template {name}: column {column}: {e}"))
    };
    let env: String = row.try_get("env")?;
    let source: String = row.try_get("source")?;
    let state: String = row.try_get("state")?;
    Ok(TemplateRecord {
        rootfs: row.try_get("rootfs")?,
        created_at_ms: row.try_get("created_at_ms")?,
        default_user: row.try_get("default_user")?,
        workdir: row.try_get("workdir")?,
        env: serde_json::from_str(&env).map_err(|e| corrupt("env", e.to_string()))?,
        start_cmd: row.try_get("start_cmd")?,
        ready_cmd: row.try_get("ready_cmd")?,
        ready_timeout_secs: row.try_get("ready_timeout_secs")?,
        source: serde_json::from_str(&source).map_err(|e| corrupt("source", e.to_string()))?,
        size_bytes: row.try_get("size_bytes")?,
        state: state.parse().map_err(|e| corrupt("state", e))?,
        error: row.try_get("error")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        build_id: row.try_get("build_id")?,
        name,
    })
}

/// Who still uses a template: sandboxes (in any state but gone) and warm pools.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateUsers {
    /// Ids of sandboxes started from it, other than those being torn down (at most `max`).
    pub sandboxes: Vec<String>,
    /// Ids of its sandboxes being torn down (gone in a moment).
    pub stopping: Vec<String>,
    /// Names of pools that keep sandboxes of it.
    pub pools: Vec<String>,
}

impl TemplateUsers {
    /// True when nothing uses the template.
    pub fn is_empty(&self) -> bool {
        self.sandboxes.is_empty() && self.stopping.is_empty() && self.pools.is_empty()
    }
}

impl Store {
    /// `INSERT` of every column of `t`, followed by `tail` (an ON CONFLICT clause or nothing).
    async fn write_template(&self, t: &TemplateRecord, tail: &str) -> Result<u64, StoreError> {
        let done = sqlx::query(&format!(
            "INSERT INTO templates ({TEMPLATE_COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15){tail}"
        ))
        .bind(&t.name)
        .bind(&t.rootfs)
        .bind(t.created_at_ms)
        .bind(&t.default_user)
        .bind(&t.workdir)
        .bind(serde_json::to_string(&t.env)?)
        .bind(&t.start_cmd)
        .bind(&t.ready_cmd)
        .bind(t.ready_timeout_secs)
        .bind(serde_json::to_string(&t.source)?)
        .bind(t.size_bytes)
        .bind(t.state.as_str())
        .bind(&t.error)
        .bind(t.updated_at_ms)
        .bind(&t.build_id)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected())
    }

    /// Registers a template or repoints an existing one at a new rootfs (keeping its
    /// creation time). A template under construction or removal is left alone
    /// ([`StoreError::Conflict`]).
    pub async fn upsert_template(&self, t: &TemplateRecord) -> Result<(), StoreError> {
        // ON CONFLICT ... DO UPDATE is spelled the same in SQLite and PostgreSQL.
        let changed = self
            .write_template(
                t,
                " ON CONFLICT (name) DO UPDATE SET rootfs = excluded.rootfs, \
                 default_user = excluded.default_user, workdir = excluded.workdir, \
                 env = excluded.env, start_cmd = excluded.start_cmd, \
                 ready_cmd = excluded.ready_cmd, \
                 ready_timeout_secs = excluded.ready_timeout_secs, source = excluded.source, \
                 size_bytes = excluded.size_bytes, state = excluded.state, \
                 error = excluded.error, updated_at_ms = excluded.updated_at_ms, \
                 build_id = excluded.build_id \
                 WHERE templates.state IN ('ready', 'failed')",
            )
            .await?;
        if changed == 0 {
            return Err(StoreError::Conflict(format!(
                "template {} is being built or removed",
                t.name
            )));
        }
        tracing::info!(template = %t.name, rootfs = %t.rootfs, "template registered");
        Ok(())
    }

    /// Records a template whose build starts now. Replaces a failed template of the same
    /// name; any other yields [`StoreError::Conflict`].
    pub async fn insert_template_build(&self, t: &TemplateRecord) -> Result<(), StoreError> {
        let changed = self
            .write_template(
                t,
                " ON CONFLICT (name) DO UPDATE SET rootfs = excluded.rootfs, \
                 created_at_ms = excluded.created_at_ms, \
                 default_user = excluded.default_user, workdir = excluded.workdir, \
                 env = excluded.env, start_cmd = excluded.start_cmd, \
                 ready_cmd = excluded.ready_cmd, \
                 ready_timeout_secs = excluded.ready_timeout_secs, source = excluded.source, \
                 size_bytes = excluded.size_bytes, state = excluded.state, \
                 error = excluded.error, updated_at_ms = excluded.updated_at_ms, \
                 build_id = excluded.build_id \
                 WHERE templates.state = 'failed'",
            )
            .await?;
        if changed == 0 {
            return Err(StoreError::Conflict(format!("template {} exists", t.name)));
        }
        Ok(())
    }

    /// Writes the outcome of build `build_id` (state, error, size and the settings it
    /// found) if the record is still that build's and still building; `false` when the
    /// template was removed or rebuilt meanwhile.
    pub async fn finish_template_build(&self, t: &TemplateRecord) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE templates SET state = $1, error = $2, size_bytes = $3, default_user = $4, \
             workdir = $5, env = $6, start_cmd = $7, ready_cmd = $8, updated_at_ms = $9 \
             WHERE name = $10 AND build_id = $11 AND state = 'building'",
        )
        .bind(t.state.as_str())
        .bind(&t.error)
        .bind(t.size_bytes)
        .bind(&t.default_user)
        .bind(&t.workdir)
        .bind(serde_json::to_string(&t.env)?)
        .bind(&t.start_cmd)
        .bind(&t.ready_cmd)
        .bind(now_ms())
        .bind(&t.name)
        .bind(&t.build_id)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Moves a template from one of `from` to `to` (with an error text); `None` when it
    /// does not exist or is in another state.
    pub async fn transition_template(
        &self,
        name: &str,
        from: &[TemplateState],
        to: TemplateState,
        error: Option<&str>,
    ) -> Result<Option<TemplateRecord>, StoreError> {
        let mut qb: sqlx::QueryBuilder<'_, sqlx::Sqlite> =
            sqlx::QueryBuilder::new("UPDATE templates SET state = ");
        qb.push_bind(to.as_str());
        qb.push(", error = ");
        qb.push_bind(error);
        qb.push(", updated_at_ms = ");
        qb.push_bind(now_ms());
        qb.push(" WHERE name = ");
        qb.push_bind(name);
        qb.push(" AND state IN (");
        let mut list = qb.separated(", ");
        for s in from {
            list.push_bind(s.as_str());
        }
        list.push_unseparated(")");
        let done = qb.build().execute(&self.writer).await?;
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        self.get_template(name).await
    }

    /// The template with this name, if any.
    pub async fn get_template(&self, name: &str) -> Result<Option<TemplateRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {TEMPLATE_COLUMNS} FROM templates WHERE name = $1"
        ))
        .bind(name)
        .fetch_optional(&self.writer)
        .await?;
        row.as_ref().map(template_from_row).transpose()
    }

    /// All templates ordered by name.
    pub async fn list_templates(&self) -> Result<Vec<TemplateRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {TEMPLATE_COLUMNS} FROM templates ORDER BY name"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(template_from_row).collect()
    }

    /// Sandboxes (up to `max`) and pools that use the template.
    pub async fn template_users(&self, name: &str, max: u32) -> Result<TemplateUsers, StoreError> {
        // Read through the writer: a decision to delete must see every committed create.
        let sandboxes: Vec<(String, String)> = sqlx::query_as(
            "SELECT id, state FROM sandboxes WHERE template = $1 ORDER BY id LIMIT $2",
        )
        .bind(name)
        .bind(i64::from(max))
        .fetch_all(&self.writer)
        .await?;
        let pools: Vec<(String,)> =
            sqlx::query_as("SELECT name FROM pools WHERE template = $1 ORDER BY name")
                .bind(name)
                .fetch_all(&self.writer)
                .await?;
        let (stopping, sandboxes): (Vec<_>, Vec<_>) = sandboxes
            .into_iter()
            .partition(|(_, state)| state == crate::SandboxState::Stopping.as_str());
        Ok(TemplateUsers {
            sandboxes: sandboxes.into_iter().map(|(id, _)| id).collect(),
            stopping: stopping.into_iter().map(|(id, _)| id).collect(),
            pools: pools.into_iter().map(|(n,)| n).collect(),
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn building(name: &str, build: &str) -> TemplateRecord {
        TemplateRecord {
            name: name.into(),
            rootfs: format!("/data/templates/{name}-{build}/rootfs"),
            created_at_ms: 1,
            env: [("A".to_string(), "1".to_string())].into(),
            source: serde_json::json!({"kind": "dir", "path": "/src"}),
            state: TemplateState::Building,
            build_id: Some(build.into()),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_build_replaces_only_a_failed_template_and_finishes_once() {
        let store = Store::open_in_memory().await.unwrap();
        store
            .insert_template_build(&building("t", "b1"))
            .await
            .unwrap();
        // A second build of the same name while the first runs is a conflict.
        let err = store
            .insert_template_build(&building("t", "b2"))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");
        // Registering in place cannot take over a template being built.
        let err = store
            .upsert_template(&building("t", "b3"))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");
        // Only the build that owns the record may finish it.
        let mut done = building("t", "other");
        done.state = TemplateState::Ready;
        assert!(!store.finish_template_build(&done).await.unwrap());
        let mut done = building("t", "b1");
        done.state = TemplateState::Failed;
        done.error = Some("boom".into());
        assert!(store.finish_template_build(&done).await.unwrap());
        assert!(!store.finish_template_build(&done).await.unwrap());
        let got = store.get_template("t").await.unwrap().unwrap();
        assert_eq!(got.state, TemplateState::Failed);
        assert_eq!(got.error.as_deref(), Some("boom"));
        assert_eq!(got.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(got.source["kind"], "dir");
        // A failed template makes way for a new build of the same name.
        store
            .insert_template_build(&building("t", "b4"))
            .await
            .unwrap();
        let got = store.get_template("t").await.unwrap().unwrap();
        assert_eq!(
            (got.state, got.build_id.as_deref()),
            (TemplateState::Building, Some("b4"))
        );
        assert_eq!(got.error, None);
    }

    #[tokio::test]
    async fn transitions_are_conditional_and_users_are_found() {
        let store = Store::open_in_memory().await.unwrap();
        let mut t = building("u", "b1");
        t.state = TemplateState::Ready;
        store.upsert_template(&t).await.unwrap();
        assert!(
            store
                .transition_template("u", &[TemplateState::Building], TemplateState::Failed, None)
                .await
                .unwrap()
                .is_none()
        );
        let got = store
            .transition_template("u", &[TemplateState::Ready], TemplateState::Deleting, None)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.state, TemplateState::Deleting);
        assert!(store.template_users("u", 10).await.unwrap().is_empty());
        sqlx::query(
            "INSERT INTO pools (name, template, runtime, cpu_millis, memory_bytes, disk_bytes,
             max_processes, size, source, hits, misses, created_at_ms)
             VALUES ('p', 'u', 'container', 1, 1, 1, 1, 1, 'api', 0, 0, 0)",
        )
        .execute(&store.pool)
        .await
        .unwrap();
        let users = store.template_users("u", 10).await.unwrap();
        assert_eq!(users.pools, vec!["p".to_string()]);
        assert!(users.sandboxes.is_empty());
        assert!(store.delete_template("u").await.unwrap());
        assert!(!store.delete_template("u").await.unwrap());
    }

    #[tokio::test]
    async fn rows_registered_before_the_migration_read_as_ready() {
        let store = Store::open_in_memory().await.unwrap();
        sqlx::query("INSERT INTO templates (name, rootfs, created_at_ms) VALUES ('old', '/r', 5)")
            .execute(&store.pool)
            .await
            .unwrap();
        let got = store.get_template("old").await.unwrap().unwrap();
        assert_eq!(got.state, TemplateState::Ready);
        assert_eq!(got.source, serde_json::Value::Null);
        assert!(got.env.is_empty() && got.start_cmd.is_none());
    }
}
