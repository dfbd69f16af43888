//! Per-sandbox credentials of the data-plane proxy: the envd access token, the traffic
//! token of its other ports, and whether either is required. The row goes with the
//! sandbox's record (foreign key), so a deleted sandbox leaves no credential behind.

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{Store, StoreError, now_ms};

const ACCESS_COLUMNS: &str = "sandbox_id, envd_token, traffic_token, secure, public, updated_at_ms";

/// The proxy credentials and exposure settings of one sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxAccess {
    /// The sandbox they belong to.
    pub sandbox_id: String,
    /// Required as `X-Access-Token` on its envd ports while `secure`.
    pub envd_token: String,
    /// Required on its other ports (header, or the key of signed URLs) unless `public`.
    pub traffic_token: String,
    /// Whether its envd ports need the envd token.
    pub secure: bool,
    /// Whether its other ports are open to anyone.
    pub public: bool,
    /// Last change, unix milliseconds.
    pub updated_at_ms: i64,
}

fn access_from_row(row: &SqliteRow) -> Result<SandboxAccess, StoreError> {
    Ok(SandboxAccess {
        sandbox_id: row.try_get("sandbox_id")?,
        envd_token: row.try_get("envd_token")?,
        traffic_token: row.try_get("traffic_token")?,
        secure: row.try_get("secure")?,
        public: row.try_get("public")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
    })
}

/// Whether a failed insert means the sandbox row is missing (deleted meanwhile).
fn is_missing_sandbox(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.is_foreign_key_violation())
}

impl Store {
    /// The credentials of sandbox `id`, if it has any yet.
    pub async fn get_access(&self, id: &str) -> Result<Option<SandboxAccess>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {ACCESS_COLUMNS} FROM sandbox_access WHERE sandbox_id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(access_from_row).transpose()
    }

    /// The credentials of several sandboxes at once (those that have any).
    pub async fn get_access_many(&self, ids: &[String]) -> Result<Vec<SandboxAccess>, StoreError> {
        let mut out = Vec::with_capacity(ids.len());
        // SQLite limits bound parameters per statement; a page of a list stays far below.
        for chunk in ids.chunks(500) {
            let mut qb = sqlx::QueryBuilder::new(format!(
                "SELECT {ACCESS_COLUMNS} FROM sandbox_access WHERE sandbox_id IN ("
            ));
            let mut list = qb.separated(", ");
            for id in chunk {
                list.push_bind(id);
            }
            list.push_unseparated(")");
            for row in qb.build().fetch_all(&self.pool).await? {
                out.push(access_from_row(&row)?);
            }
        }
        Ok(out)
    }

    /// Sets the credentials of a sandbox, replacing any it had (a claimed pool member or
    /// a fresh create must never keep tokens someone saw before).
    /// [`StoreError::NotFound`] when the sandbox has no record.
    pub async fn put_access(&self, a: &SandboxAccess) -> Result<(), StoreError> {
        self.insert_access(
            a,
            "DO UPDATE SET envd_token = excluded.envd_token, \
             traffic_token = excluded.traffic_token, secure = excluded.secure, \
             public = excluded.public, updated_at_ms = excluded.updated_at_ms",
        )
        .await
    }

    /// Inserts `a`; `on_conflict` says what an existing row of the sandbox gets.
    async fn insert_access(&self, a: &SandboxAccess, on_conflict: &str) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO sandbox_access ({ACCESS_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (sandbox_id) {on_conflict}"
        ))
        .bind(&a.sandbox_id)
        .bind(&a.envd_token)
        .bind(&a.traffic_token)
        .bind(a.secure)
        .bind(a.public)
        .bind(a.updated_at_ms)
        .execute(&self.writer)
        .await
        .map_err(|e| {
            if is_missing_sandbox(&e) {
                StoreError::NotFound(format!("sandbox {}", a.sandbox_id))
            } else {
                e.into()
            }
        })?;
        Ok(())
    }

    /// Stores `a` unless the sandbox has credentials already, and returns whichever are
    /// stored: two first requests racing both end up with the same tokens.
    pub async fn ensure_access(&self, a: &SandboxAccess) -> Result<SandboxAccess, StoreError> {
        self.insert_access(a, "DO NOTHING").await?;
        // Read back on the writer: the row just written may not be visible to a reader yet.
        let row = sqlx::query(&format!(
            "SELECT {ACCESS_COLUMNS} FROM sandbox_access WHERE sandbox_id = $1"
        ))
        .bind(&a.sandbox_id)
        .fetch_optional(&self.writer)
        .await?;
        row.as_ref()
            .map(access_from_row)
            .transpose()?
            .ok_or_else(|| StoreError::NotFound(format!("sandbox {}", a.sandbox_id)))
    }

    /// Opens or closes a sandbox's non-envd ports to anyone; `false` if it has no
    /// credentials row.
    pub async fn set_access_public(&self, id: &str, public: bool) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE sandbox_access SET public = $1, updated_at_ms = $2 WHERE sandbox_id = $3",
        )
        .bind(public)
        .bind(now_ms())
        .bind(id)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Lifecycle, SandboxRecord, SandboxState};

    fn sandbox(id: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            owner: "o".into(),
            template: "t".into(),
            runtime: "r".into(),
            state: SandboxState::Running,
            cpu_millis: 0,
            memory_bytes: 0,
            disk_bytes: 0,
            max_processes: 0,
            env: Default::default(),
            secret_env: Default::default(),
            metadata: Default::default(),
            created_at_ms: 0,
            updated_at_ms: 0,
            expires_at_ms: 0,
            runtime_state: serde_json::Value::Null,
            error: None,
            version: 0,
            pool: None,
            life: Lifecycle::default(),
        }
    }

    fn access(id: &str, tag: &str) -> SandboxAccess {
        SandboxAccess {
            sandbox_id: id.into(),
            envd_token: format!("envd-{tag}"),
            traffic_token: format!("traffic-{tag}"),
            secure: true,
            public: false,
            updated_at_ms: 1,
        }
    }

    #[tokio::test]
    async fn credentials_follow_the_sandbox_record() {
        let store = Store::open_in_memory().await.unwrap();
        // No record, no credentials: nothing dangling can be made.
        assert!(matches!(
            store.put_access(&access("ghost", "a")).await,
            Err(StoreError::NotFound(_))
        ));
        assert!(matches!(
            store.ensure_access(&access("ghost", "a")).await,
            Err(StoreError::NotFound(_))
        ));
        store.insert_sandbox(&sandbox("s1")).await.unwrap();
        assert_eq!(store.get_access("s1").await.unwrap(), None);
        // The first ensure wins; a later one gets the stored tokens back.
        let first = store.ensure_access(&access("s1", "a")).await.unwrap();
        assert_eq!(first.envd_token, "envd-a");
        let second = store.ensure_access(&access("s1", "b")).await.unwrap();
        assert_eq!(second.envd_token, "envd-a");
        // A put replaces them.
        store.put_access(&access("s1", "c")).await.unwrap();
        let got = store.get_access("s1").await.unwrap().unwrap();
        assert_eq!(got.traffic_token, "traffic-c");
        assert!(!got.public);
        assert!(store.set_access_public("s1", true).await.unwrap());
        assert!(store.get_access("s1").await.unwrap().unwrap().public);
        assert!(!store.set_access_public("nope", true).await.unwrap());
        store.insert_sandbox(&sandbox("s2")).await.unwrap();
        store.put_access(&access("s2", "d")).await.unwrap();
        let many = store
            .get_access_many(&["s1".into(), "s2".into(), "s3".into()])
            .await
            .unwrap();
        assert_eq!(many.len(), 2);
        // Deleting the sandbox deletes its credentials.
        store.delete_sandbox("s1").await.unwrap();
        assert_eq!(store.get_access("s1").await.unwrap(), None);
    }
}
