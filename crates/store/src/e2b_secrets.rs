//! What E2B's API adds to the broker's secrets (an id, a version, metadata), and each
//! sandbox's egress header rules. The value of an E2B secret lives in `secrets` like any
//! other (sealed by the daemon); the extra row only says it was made through E2B's API,
//! which is also what lets a sandbox's rules name it.

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{SecretRecord, Store, StoreError};

/// An E2B secret: its broker secret's name and times, and E2B's own fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bSecretRecord {
    /// Owner (the API key's owner it belongs to).
    pub owner: String,
    /// Name, unique per owner (lower case).
    pub name: String,
    /// E2B's `secretID` (`sec_...`), unique.
    pub id: String,
    /// Starts at 1; each update of the value adds one.
    pub version: i64,
    /// The owner's metadata, a JSON object of strings.
    pub metadata: serde_json::Value,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
    /// Last update of value or metadata, unix milliseconds.
    pub updated_at_ms: i64,
}

/// A sandbox's egress rules as stored: the JSON document the broker reads.
#[derive(Debug, Clone, PartialEq)]
pub struct EgressRulesRecord {
    /// The sandbox.
    pub sandbox_id: String,
    /// Its owner, whose secrets the rules may name.
    pub owner: String,
    /// The rules.
    pub rules: serde_json::Value,
}

const E2B_COLUMNS: &str =
    "e.owner, e.name, e.id, e.version, e.metadata, s.created_at_ms, e.updated_at_ms";

fn e2b_from_row(row: &SqliteRow) -> Result<E2bSecretRecord, StoreError> {
    let owner: String = row.try_get("owner")?;
    let name: String = row.try_get("name")?;
    let metadata: String = row.try_get("metadata")?;
    let metadata = serde_json::from_str(&metadata)
        .map_err(|e| StoreError::Corrupt(format!("secret {owner}/{name}: metadata: {e}")))?;
    Ok(E2bSecretRecord {
        id: row.try_get("id")?,
        version: row.try_get("version")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        metadata,
        owner,
        name,
    })
}

impl Store {
    /// Inserts a broker secret and its E2B row in one transaction, unless its owner has
    /// `max_per_owner` secrets already (`false`); a taken name or id is
    /// [`StoreError::Conflict`].
    pub async fn insert_e2b_secret(
        &self,
        s: &SecretRecord,
        id: &str,
        metadata: &serde_json::Value,
        max_per_owner: i64,
    ) -> Result<bool, StoreError> {
        let mut tx = self.writer.begin().await?;
        let done = sqlx::query(
            "INSERT INTO secrets (owner, name, sealed, spec, expires_at_ms, created_at_ms) \
             SELECT $1, $2, $3, $4, $5, $6 \
             WHERE (SELECT COUNT(*) FROM secrets WHERE owner = $1) < $7",
        )
        .bind(&s.owner)
        .bind(&s.name)
        .bind(&s.sealed)
        .bind(serde_json::to_string(&s.spec)?)
        .bind(s.expires_at_ms)
        .bind(s.created_at_ms)
        .bind(max_per_owner)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() != 1 {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO e2b_secrets (owner, name, id, version, metadata, updated_at_ms) \
             VALUES ($1, $2, $3, 1, $4, $5)",
        )
        .bind(&s.owner)
        .bind(&s.name)
        .bind(id)
        .bind(serde_json::to_string(metadata)?)
        .bind(s.created_at_ms)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The E2B secrets of `owner`, by name, starting after name `after`, at most `limit`.
    pub async fn list_e2b_secrets(
        &self,
        owner: &str,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<E2bSecretRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {E2B_COLUMNS} FROM e2b_secrets e \
             JOIN secrets s ON s.owner = e.owner AND s.name = e.name \
             WHERE e.owner = $1 AND e.name > $2 ORDER BY e.name LIMIT $3"
        ))
        .bind(owner)
        .bind(after.unwrap_or(""))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(e2b_from_row).collect()
    }

    /// The E2B secret of `owner` whose id or name is `selector`.
    pub async fn get_e2b_secret(
        &self,
        owner: &str,
        selector: &str,
    ) -> Result<Option<E2bSecretRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {E2B_COLUMNS} FROM e2b_secrets e \
             JOIN secrets s ON s.owner = e.owner AND s.name = e.name \
             WHERE e.owner = $1 AND (e.id = $2 OR e.name = $2) \
             ORDER BY e.id = $2 DESC LIMIT 1"
        ))
        .bind(owner)
        .bind(selector)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(e2b_from_row).transpose()
    }

    /// Stores a new value (sealed) of E2B secret `name` of `owner` as its next version, and
    /// its metadata when given; `None` when there is no such secret.
    pub async fn update_e2b_secret(
        &self,
        owner: &str,
        name: &str,
        sealed: &[u8],
        metadata: Option<&serde_json::Value>,
        now_ms: i64,
    ) -> Result<Option<E2bSecretRecord>, StoreError> {
        let mut tx = self.writer.begin().await?;
        let done = sqlx::query(
            "UPDATE e2b_secrets SET version = version + 1, updated_at_ms = $3, \
             metadata = COALESCE($4, metadata) WHERE owner = $1 AND name = $2",
        )
        .bind(owner)
        .bind(name)
        .bind(now_ms)
        .bind(metadata.map(serde_json::to_string).transpose()?)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        sqlx::query("UPDATE secrets SET sealed = $3 WHERE owner = $1 AND name = $2")
            .bind(owner)
            .bind(name)
            .bind(sealed)
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(&format!(
            "SELECT {E2B_COLUMNS} FROM e2b_secrets e \
             JOIN secrets s ON s.owner = e.owner AND s.name = e.name \
             WHERE e.owner = $1 AND e.name = $2"
        ))
        .bind(owner)
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
        let rec = e2b_from_row(&row)?;
        tx.commit().await?;
        Ok(Some(rec))
    }

    /// Names of the secrets of `owner` made through E2B's API.
    pub async fn e2b_secret_names(&self, owner: &str) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> =
            sqlx::query_as("SELECT name FROM e2b_secrets WHERE owner = $1 ORDER BY name")
                .bind(owner)
                .fetch_all(&self.pool)
                .await?;
        Ok(rows.into_iter().map(|(n,)| n).collect())
    }

    /// Every `(owner, name)` of an E2B secret.
    pub async fn all_e2b_secret_names(&self) -> Result<Vec<(String, String)>, StoreError> {
        Ok(sqlx::query_as("SELECT owner, name FROM e2b_secrets")
            .fetch_all(&self.pool)
            .await?)
    }

    /// Replaces the egress rules of sandbox `sandbox_id` (`None`: it has none).
    pub async fn set_egress_rules(
        &self,
        sandbox_id: &str,
        rules: Option<&serde_json::Value>,
    ) -> Result<(), StoreError> {
        match rules {
            Some(r) => {
                let done = sqlx::query(
                    "INSERT INTO sandbox_egress_rules (sandbox_id, rules) \
                     SELECT id, $2 FROM sandboxes WHERE id = $1 \
                     ON CONFLICT (sandbox_id) DO UPDATE SET rules = excluded.rules",
                )
                .bind(sandbox_id)
                .bind(serde_json::to_string(r)?)
                .execute(&self.writer)
                .await?;
                if done.rows_affected() == 0 {
                    return Err(StoreError::NotFound(format!("sandbox {sandbox_id}")));
                }
            }
            None => {
                sqlx::query("DELETE FROM sandbox_egress_rules WHERE sandbox_id = $1")
                    .bind(sandbox_id)
                    .execute(&self.writer)
                    .await?;
            }
        }
        Ok(())
    }

    /// Every sandbox's egress rules, with the sandbox's owner.
    pub async fn all_egress_rules(&self) -> Result<Vec<EgressRulesRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT r.sandbox_id, s.owner, r.rules FROM sandbox_egress_rules r \
             JOIN sandboxes s ON s.id = r.sandbox_id ORDER BY r.sandbox_id",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let sandbox_id: String = r.try_get("sandbox_id")?;
                let rules: String = r.try_get("rules")?;
                let rules = serde_json::from_str(&rules).map_err(|e| {
                    StoreError::Corrupt(format!("egress rules of {sandbox_id}: {e}"))
                })?;
                Ok(EgressRulesRecord {
                    owner: r.try_get("owner")?,
                    sandbox_id,
                    rules,
                })
            })
            .collect()
    }

    /// Gives each sandbox of `to` the egress rules of `from` (a fork's copies).
    pub async fn copy_egress_rules(&self, from: &str, to: &[String]) -> Result<(), StoreError> {
        let mut tx = self.writer.begin().await?;
        for id in to {
            sqlx::query(
                "INSERT INTO sandbox_egress_rules (sandbox_id, rules) \
                 SELECT $2, rules FROM sandbox_egress_rules WHERE sandbox_id = $1 \
                 ON CONFLICT (sandbox_id) DO UPDATE SET rules = excluded.rules",
            )
            .bind(from)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(owner: &str, name: &str) -> SecretRecord {
        SecretRecord {
            owner: owner.into(),
            name: name.into(),
            sealed: vec![1, 2, 3],
            spec: serde_json::json!({}),
            expires_at_ms: None,
            created_at_ms: 7,
        }
    }

    use crate::secrets::tests::sandbox;

    #[tokio::test]
    async fn egress_rules_go_with_their_sandbox_and_its_forks() {
        let store = Store::open_in_memory().await.unwrap();
        sandbox(&store, "s1", "a").await;
        sandbox(&store, "s2", "a").await;
        let rules = serde_json::json!({"hosts": []});
        let missing = store.set_egress_rules("gone", Some(&rules)).await;
        assert!(
            matches!(missing, Err(StoreError::NotFound(_))),
            "{missing:?}"
        );
        store.set_egress_rules("s1", Some(&rules)).await.unwrap();
        store.set_egress_rules("s1", Some(&rules)).await.unwrap();
        store
            .copy_egress_rules("s1", &["s2".to_string()])
            .await
            .unwrap();
        let all = store.all_egress_rules().await.unwrap();
        assert_eq!(
            all.iter()
                .map(|r| r.sandbox_id.as_str())
                .collect::<Vec<_>>(),
            ["s1", "s2"]
        );
        assert!(all.iter().all(|r| r.owner == "a" && r.rules == rules));
        store.set_egress_rules("s1", None).await.unwrap();
        store.delete_sandbox("s2").await.unwrap();
        assert!(store.all_egress_rules().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn e2b_secrets_version_and_stay_with_their_owner() {
        let store = Store::open_in_memory().await.unwrap();
        let meta = serde_json::json!({"env": "test"});
        assert!(
            store
                .insert_e2b_secret(&secret("a", "gh"), "sec_1", &meta, 10)
                .await
                .unwrap()
        );
        let dup = store
            .insert_e2b_secret(&secret("a", "gh"), "sec_2", &meta, 10)
            .await;
        assert!(matches!(dup, Err(StoreError::Conflict(_))), "{dup:?}");
        let same_id = store
            .insert_e2b_secret(&secret("b", "gh"), "sec_1", &meta, 10)
            .await;
        assert!(
            matches!(same_id, Err(StoreError::Conflict(_))),
            "{same_id:?}"
        );
        // The failed insert left no broker secret behind.
        assert!(store.get_secret("b", "gh").await.unwrap().is_none());
        assert!(
            !store
                .insert_e2b_secret(&secret("a", "more"), "sec_3", &meta, 1)
                .await
                .unwrap()
        );
        let by_id = store.get_e2b_secret("a", "sec_1").await.unwrap().unwrap();
        let by_name = store.get_e2b_secret("a", "gh").await.unwrap().unwrap();
        assert_eq!(by_id, by_name);
        assert_eq!((by_id.version, by_id.created_at_ms), (1, 7));
        assert!(store.get_e2b_secret("b", "sec_1").await.unwrap().is_none());
        let up = store
            .update_e2b_secret("a", "gh", &[9], None, 99)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((up.version, up.updated_at_ms), (2, 99));
        assert_eq!(up.metadata, meta);
        assert_eq!(
            store.get_secret("a", "gh").await.unwrap().unwrap().sealed,
            [9]
        );
        let none = store.update_e2b_secret("b", "gh", &[9], None, 99).await;
        assert!(none.unwrap().is_none());
        assert_eq!(
            store.list_e2b_secrets("a", None, 10).await.unwrap().len(),
            1
        );
        assert!(
            store
                .list_e2b_secrets("a", Some("gh"), 10)
                .await
                .unwrap()
                .is_empty()
        );
        assert!(store.delete_secret("a", "gh").await.unwrap());
        assert!(store.get_e2b_secret("a", "gh").await.unwrap().is_none());
        assert!(store.all_e2b_secret_names().await.unwrap().is_empty());
    }
}
