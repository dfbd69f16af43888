//! API keys: random bearer secrets of which only a SHA-256 digest is stored.

use rand::TryRngCore;
use rand::rngs::OsRng;
use sha2::{Digest, Sha256};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{ApiKey, Store, StoreError, now_ms};

/// Prefix that makes keys recognisable (e.g. by secret scanners) and cheap to reject.
const KEY_PREFIX: &str = "sp_";
/// 20 random bytes = 160 bits, rendered as 40 lowercase hex characters.
const KEY_RANDOM_BYTES: usize = 20;

const KEY_COLUMNS: &str = "id, owner, name, created_at_ms, last_used_at_ms";

/// Digest under which a presented key is stored and looked up.
pub(crate) fn hash_key(presented: &str) -> String {
    hex::encode(Sha256::digest(presented.as_bytes()))
}

/// Prefix of a key's E2B form: E2B's SDKs refuse, client-side, a key that does not match
/// `^e2b_[0-9a-f]+$`, so every key also authenticates with this prefix in place of `sp_`.
pub const E2B_KEY_PREFIX: &str = "e2b_";

fn random_part_ok(rest: &str) -> bool {
    rest.len() == KEY_RANDOM_BYTES * 2
        && rest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether `presented` has the shape of a key we issue, so garbage never reaches the DB.
fn well_formed(presented: &str) -> bool {
    presented
        .strip_prefix(KEY_PREFIX)
        .is_some_and(random_part_ok)
}

/// The key as issued (`sp_…`) for a key presented in either form, `None` for anything else.
/// The E2B form carries the same secret, so it is no weaker and is revoked with its key.
fn canonical(presented: &str) -> Option<String> {
    if well_formed(presented) {
        return Some(presented.to_string());
    }
    presented
        .strip_prefix(E2B_KEY_PREFIX)
        .filter(|rest| random_part_ok(rest))
        .map(|rest| format!("{KEY_PREFIX}{rest}"))
}

/// The E2B form (`e2b_` + 40 hex digits) of a key sandpit issued, for E2B's SDKs; `None`
/// for a string that is not such a key.
pub fn e2b_key_form(key: &str) -> Option<String> {
    canonical(key).map(|k| format!("{E2B_KEY_PREFIX}{}", &k[KEY_PREFIX.len()..]))
}

fn key_from_row(row: &SqliteRow) -> Result<ApiKey, StoreError> {
    Ok(ApiKey {
        id: row.try_get("id")?,
        owner: row.try_get("owner")?,
        name: row.try_get("name")?,
        created_at_ms: row.try_get("created_at_ms")?,
        last_used_at_ms: row.try_get("last_used_at_ms")?,
    })
}

/// How stale `last_used_at_ms` may be before a request refreshes it.
const LAST_USED_GRANULARITY_MS: i64 = 60_000;

impl Store {
    /// Issues a new key for `owner`; the plaintext is returned once and cannot be recovered.
    pub async fn create_api_key(
        &self,
        owner: &str,
        name: &str,
    ) -> Result<(ApiKey, String), StoreError> {
        let mut secret = [0u8; KEY_RANDOM_BYTES];
        // Straight from the OS: a bearer secret must not depend on a userspace PRNG's state.
        OsRng
            .try_fill_bytes(&mut secret)
            .map_err(|e| StoreError::Random(e.to_string()))?;
        let plaintext = format!("{KEY_PREFIX}{}", hex::encode(secret));
        let key = ApiKey {
            id: uuid::Uuid::new_v4().to_string(),
            owner: owner.to_string(),
            name: name.to_string(),
            created_at_ms: now_ms(),
            last_used_at_ms: None,
        };
        sqlx::query(
            "INSERT INTO api_keys (id, owner, name, key_hash, created_at_ms, last_used_at_ms)
             VALUES ($1, $2, $3, $4, $5, NULL)",
        )
        .bind(&key.id)
        .bind(&key.owner)
        .bind(&key.name)
        .bind(hash_key(&plaintext))
        .bind(key.created_at_ms)
        .execute(&self.writer)
        .await?;
        tracing::info!(key_id = %key.id, owner, name, "api key created");
        Ok((key, plaintext))
    }

    /// Gives key `id` the role `role` (a lowercase word); false when there is no such key.
    pub async fn add_api_key_role(&self, id: &str, role: &str) -> Result<bool, StoreError> {
        if role.is_empty() || !role.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
            return Err(StoreError::InvalidRole(role.to_string()));
        }
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let Some(row) = sqlx::query("SELECT roles FROM api_keys WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(false);
        };
        let roles: String = row.try_get("roles")?;
        if !roles.split(',').any(|r| r == role) {
            let roles = if roles.is_empty() {
                role.to_string()
            } else {
                format!("{roles},{role}")
            };
            sqlx::query("UPDATE api_keys SET roles = $1 WHERE id = $2")
                .bind(roles)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        tracing::info!(key_id = id, role, "api key role added");
        Ok(true)
    }

    /// The roles of key `id` (empty for an unknown key).
    pub async fn api_key_roles(&self, id: &str) -> Result<Vec<String>, StoreError> {
        let row = sqlx::query("SELECT roles FROM api_keys WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else {
            return Ok(Vec::new());
        };
        let roles: String = row.try_get("roles")?;
        Ok(roles
            .split(',')
            .filter(|r| !r.is_empty())
            .map(str::to_string)
            .collect())
    }

    /// Whether key `id` has role `role`.
    pub async fn key_has_role(&self, id: &str, role: &str) -> Result<bool, StoreError> {
        Ok(self.api_key_roles(id).await?.iter().any(|r| r == role))
    }

    /// Returns the key matching `presented` (recording its use), or `None` if there is none.
    pub async fn authenticate(&self, presented: &str) -> Result<Option<ApiKey>, StoreError> {
        let Some(issued) = canonical(presented) else {
            return Ok(None);
        };
        // The lookup is by digest, so timing reveals nothing about the stored secret and no
        // constant-time comparison is needed.
        let digest = hash_key(&issued);
        let row = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys WHERE key_hash = $1"
        ))
        .bind(&digest)
        .fetch_optional(&self.pool)
        .await?;
        let Some(mut key) = row.as_ref().map(key_from_row).transpose()? else {
            return Ok(None);
        };
        // Recording every use would make each API request a database write; once a
        // minute is as precise as "last used" needs to be.
        let now = now_ms();
        if key
            .last_used_at_ms
            .is_none_or(|t| now - t >= LAST_USED_GRANULARITY_MS)
        {
            sqlx::query("UPDATE api_keys SET last_used_at_ms = $1 WHERE key_hash = $2")
                .bind(now)
                .bind(&digest)
                .execute(&self.writer)
                .await?;
            key.last_used_at_ms = Some(now);
        }
        Ok(Some(key))
    }

    /// All keys, oldest first.
    pub async fn list_api_keys(&self) -> Result<Vec<ApiKey>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_at_ms, id"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(key_from_row).collect()
    }

    /// Deletes the key so it no longer authenticates; `false` if no such key existed.
    pub async fn revoke_api_key(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM api_keys WHERE id = $1")
            .bind(id)
            .execute(&self.writer)
            .await?;
        let revoked = done.rows_affected() > 0;
        if revoked {
            tracing::info!(key_id = id, "api key revoked");
        }
        Ok(revoked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_check() {
        assert!(well_formed(&format!("sp_{}", "a1".repeat(20))));
        assert!(!well_formed(&format!("sp_{}", "A1".repeat(20))));
        assert!(!well_formed(&format!("sp_{}", "a1".repeat(19))));
        assert!(!well_formed(&format!("xx_{}", "a1".repeat(20))));
        // The E2B form maps onto the issued key and matches E2B's client-side check.
        let issued = format!("sp_{}", "a1".repeat(20));
        let e2b = format!("e2b_{}", "a1".repeat(20));
        assert_eq!(canonical(&e2b).as_deref(), Some(issued.as_str()));
        assert_eq!(e2b_key_form(&issued).as_deref(), Some(e2b.as_str()));
        assert_eq!(e2b_key_form(&e2b).as_deref(), Some(e2b.as_str()));
        assert_eq!(canonical(&format!("e2b_{}", "A1".repeat(20))), None);
        assert_eq!(canonical(&format!("e2b_{}", "a1".repeat(21))), None);
        assert_eq!(canonical("e2b_"), None);
        assert!(!well_formed(""));
    }

    #[tokio::test]
    async fn only_the_digest_is_stored() {
        let store = Store::open_in_memory().await.unwrap();
        let (key, plaintext) = store.create_api_key("alice", "laptop").await.unwrap();
        assert!(well_formed(&plaintext));
        let (stored,): (String,) = sqlx::query_as("SELECT key_hash FROM api_keys WHERE id = $1")
            .bind(&key.id)
            .fetch_one(&store.pool)
            .await
            .unwrap();
        assert_ne!(stored, plaintext);
        assert!(!stored.contains(&plaintext[3..]));
        assert_eq!(stored, hash_key(&plaintext));
        assert_eq!(stored.len(), 64);
    }
}
