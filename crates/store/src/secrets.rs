//! Secrets of the credential broker and which sandboxes may use them. The store only keeps
//! what the daemon hands it: the value arrives sealed (encrypted by the daemon's broker key)
//! and is never seen here in the clear; the binding rules are an opaque JSON document.

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{Store, StoreError};

const SECRET_COLUMNS: &str = "owner, name, sealed, spec, expires_at_ms, created_at_ms";

/// One stored secret. `(owner, name)` is unique.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretRecord {
    /// Owner (the API key's owner it belongs to).
    pub owner: String,
    /// Name chosen by the owner; sandboxes attach it by this name.
    pub name: String,
    /// The value, encrypted by the daemon (nonce and ciphertext with its tag).
    pub sealed: Vec<u8>,
    /// Binding rules and injection form, as JSON the daemon interprets.
    pub spec: serde_json::Value,
    /// When it stops being usable, unix milliseconds.
    pub expires_at_ms: Option<i64>,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
}

impl std::fmt::Debug for SecretRecord {
    // Sealed bytes are harmless, but a record printed whole invites copying it into logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretRecord")
            .field("owner", &self.owner)
            .field("name", &self.name)
            .field("expires_at_ms", &self.expires_at_ms)
            .finish_non_exhaustive()
    }
}

/// One attachment: sandbox `sandbox_id` (of `owner`) may use its owner's secret `name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretAttachment {
    /// The sandbox.
    pub sandbox_id: String,
    /// The sandbox's owner, whose secret of that name it uses.
    pub owner: String,
    /// The secret's name.
    pub name: String,
}

fn secret_from_row(row: &SqliteRow) -> Result<SecretRecord, StoreError> {
    let owner: String = row.try_get("owner")?;
    let name: String = row.try_get("name")?;
    let spec: String = row.try_get("spec")?;
    let spec = serde_json::from_str(&spec)
        .map_err(|e| StoreError::Corrupt(format!("secret {owner}/{name}: spec: {e}")))?;
    Ok(SecretRecord {
        sealed: row.try_get("sealed")?,
        spec,
        expires_at_ms: row.try_get("expires_at_ms")?,
        created_at_ms: row.try_get("created_at_ms")?,
        owner,
        name,
    })
}

impl Store {
    /// Inserts a new secret unless its owner already has `max_per_owner`; `false` means the
    /// limit was reached, an existing name yields [`StoreError::Conflict`].
    pub async fn insert_secret(
        &self,
        s: &SecretRecord,
        max_per_owner: i64,
    ) -> Result<bool, StoreError> {
        // Count and insert in one statement, so concurrent creates cannot overshoot.
        let done = sqlx::query(&format!(
            "INSERT INTO secrets ({SECRET_COLUMNS}) SELECT $1, $2, $3, $4, $5, $6 \
             WHERE (SELECT COUNT(*) FROM secrets WHERE owner = $1) < $7"
        ))
        .bind(&s.owner)
        .bind(&s.name)
        .bind(&s.sealed)
        .bind(serde_json::to_string(&s.spec)?)
        .bind(s.expires_at_ms)
        .bind(s.created_at_ms)
        .bind(max_per_owner)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// One secret of `owner`.
    pub async fn get_secret(
        &self,
        owner: &str,
        name: &str,
    ) -> Result<Option<SecretRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {SECRET_COLUMNS} FROM secrets WHERE owner = $1 AND name = $2"
        ))
        .bind(owner)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(secret_from_row).transpose()
    }

    /// Secrets of `owner` by name, or of every owner when `owner` is `None`.
    pub async fn list_secrets(&self, owner: Option<&str>) -> Result<Vec<SecretRecord>, StoreError> {
        let rows = match owner {
            Some(o) => {
                sqlx::query(&format!(
                    "SELECT {SECRET_COLUMNS} FROM secrets WHERE owner = $1 ORDER BY name"
                ))
                .bind(o)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(&format!(
                    "SELECT {SECRET_COLUMNS} FROM secrets ORDER BY owner, name"
                ))
                .fetch_all(&self.pool)
                .await?
            }
        };
        rows.iter().map(secret_from_row).collect()
    }

    /// Deletes a secret and detaches it from its owner's sandboxes, in one transaction: a
    /// later secret of the same name is not silently picked up by them. `false`: no such secret.
    pub async fn delete_secret(&self, owner: &str, name: &str) -> Result<bool, StoreError> {
        let mut tx = self.writer.begin().await?;
        let done = sqlx::query("DELETE FROM secrets WHERE owner = $1 AND name = $2")
            .bind(owner)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        sqlx::query(
            "DELETE FROM sandbox_secrets WHERE name = $2 AND sandbox_id IN \
             (SELECT id FROM sandboxes WHERE owner = $1)",
        )
        .bind(owner)
        .bind(name)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Replaces the secrets sandbox `sandbox_id` may use with `names` (secrets of the
    /// sandbox's owner), in one transaction that also checks each still exists: a name
    /// that does not is returned as the error's message, and nothing changes.
    pub async fn set_sandbox_secrets(
        &self,
        sandbox_id: &str,
        names: &[String],
    ) -> Result<(), StoreError> {
        let mut tx = self.writer.begin().await?;
        let owner: Option<(String,)> = sqlx::query_as("SELECT owner FROM sandboxes WHERE id = $1")
            .bind(sandbox_id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some((owner,)) = owner else {
            return Err(StoreError::NotFound(format!("sandbox {sandbox_id}")));
        };
        sqlx::query("DELETE FROM sandbox_secrets WHERE sandbox_id = $1")
            .bind(sandbox_id)
            .execute(&mut *tx)
            .await?;
        let unique: std::collections::BTreeSet<&String> = names.iter().collect();
        for name in unique {
            let done = sqlx::query(
                "INSERT OR IGNORE INTO sandbox_secrets (sandbox_id, name) \
                 SELECT $1, $2 WHERE EXISTS \
                 (SELECT 1 FROM secrets WHERE owner = $3 AND name = $2)",
            )
            .bind(sandbox_id)
            .bind(name)
            .bind(&owner)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 0 {
                return Err(StoreError::NotFound(format!("secret {name}")));
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// Names of the secrets sandbox `sandbox_id` may use.
    pub async fn sandbox_secrets(&self, sandbox_id: &str) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> =
            sqlx::query_as("SELECT name FROM sandbox_secrets WHERE sandbox_id = $1 ORDER BY name")
                .bind(sandbox_id)
                .fetch_all(&self.pool)
                .await?;
        Ok(rows.into_iter().map(|(n,)| n).collect())
    }

    /// Gives each sandbox of `to` the secrets `from` may use (a fork's copies).
    pub async fn copy_sandbox_secrets(&self, from: &str, to: &[String]) -> Result<(), StoreError> {
        let mut tx = self.writer.begin().await?;
        for id in to {
            sqlx::query(
                "INSERT OR IGNORE INTO sandbox_secrets (sandbox_id, name) \
                 SELECT $2, name FROM sandbox_secrets WHERE sandbox_id = $1",
            )
            .bind(from)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Every attachment, with the owner of its sandbox.
    pub async fn secret_attachments(&self) -> Result<Vec<SecretAttachment>, StoreError> {
        let rows = sqlx::query(
            "SELECT ss.sandbox_id, s.owner, ss.name FROM sandbox_secrets ss \
             JOIN sandboxes s ON s.id = ss.sandbox_id ORDER BY ss.sandbox_id, ss.name",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(SecretAttachment {
                    sandbox_id: r.try_get("sandbox_id")?,
                    owner: r.try_get("owner")?,
                    name: r.try_get("name")?,
                })
            })
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{Lifecycle, SandboxRecord, SandboxState};

    fn secret(owner: &str, name: &str) -> SecretRecord {
        SecretRecord {
            owner: owner.into(),
            name: name.into(),
            sealed: vec![1, 2, 3],
            spec: serde_json::json!({"hosts": ["api.example.com"]}),
            expires_at_ms: Some(42),
            created_at_ms: 7,
        }
    }

    /// Records a running sandbox `id` of `owner` (the other stores' tests use it too).
    pub(crate) async fn sandbox(store: &Store, id: &str, owner: &str) {
        let rec = SandboxRecord {
            id: id.into(),
            owner: owner.into(),
            template: "host".into(),
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
            expires_at_ms: 0,
            runtime_state: serde_json::Value::Null,
            error: None,
            version: 0,
            pool: None,
            life: Lifecycle::default(),
        };
        store.insert_sandbox(&rec).await.unwrap();
    }

    #[tokio::test]
    async fn secrets_round_trip_and_are_unique_per_owner() {
        let store = Store::open_in_memory().await.unwrap();
        assert!(store.insert_secret(&secret("a", "gh"), 10).await.unwrap());
        assert!(store.insert_secret(&secret("b", "gh"), 10).await.unwrap());
        let dup = store.insert_secret(&secret("a", "gh"), 10).await;
        assert!(matches!(dup, Err(StoreError::Conflict(_))), "{dup:?}");
        assert!(!store.insert_secret(&secret("a", "other"), 1).await.unwrap());
        let got = store.get_secret("a", "gh").await.unwrap().unwrap();
        assert_eq!(got, secret("a", "gh"));
        assert!(store.get_secret("a", "nope").await.unwrap().is_none());
        assert_eq!(store.list_secrets(Some("b")).await.unwrap().len(), 1);
        assert_eq!(store.list_secrets(None).await.unwrap().len(), 2);
    }

    #[tokio::test]
    async fn attachments_follow_sandboxes_and_secrets() {
        let store = Store::open_in_memory().await.unwrap();
        store.insert_secret(&secret("a", "gh"), 10).await.unwrap();
        store.insert_secret(&secret("a", "npm"), 10).await.unwrap();
        store
            .insert_secret(&secret("b", "b-only"), 10)
            .await
            .unwrap();
        sandbox(&store, "s1", "a").await;
        sandbox(&store, "s2", "a").await;
        let names = vec!["npm".to_string(), "gh".to_string(), "gh".to_string()];
        store.set_sandbox_secrets("s1", &names).await.unwrap();
        assert_eq!(store.sandbox_secrets("s1").await.unwrap(), ["gh", "npm"]);
        // Another owner's secret is unknown to this sandbox, and nothing changes.
        let err = store
            .set_sandbox_secrets("s1", &["b-only".to_string()])
            .await;
        assert!(matches!(err, Err(StoreError::NotFound(_))), "{err:?}");
        assert_eq!(store.sandbox_secrets("s1").await.unwrap(), ["gh", "npm"]);
        store
            .copy_sandbox_secrets("s1", &["s2".to_string()])
            .await
            .unwrap();
        assert_eq!(store.sandbox_secrets("s2").await.unwrap(), ["gh", "npm"]);
        assert!(store.delete_secret("a", "gh").await.unwrap());
        assert!(!store.delete_secret("a", "gh").await.unwrap());
        assert_eq!(store.sandbox_secrets("s2").await.unwrap(), ["npm"]);
        store.delete_sandbox("s1").await.unwrap();
        let all = store.secret_attachments().await.unwrap();
        assert_eq!(
            all,
            vec![SecretAttachment {
                sandbox_id: "s2".into(),
                owner: "a".into(),
                name: "npm".into()
            }]
        );
        let missing = store.set_sandbox_secrets("gone", &[]).await;
        assert!(
            matches!(missing, Err(StoreError::NotFound(_))),
            "{missing:?}"
        );
    }
}
