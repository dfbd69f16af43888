//! E2B's secrets on the broker: values sealed like any secret, with an id, a version and
//! metadata of their own, bound to no host. They go out only through a sandbox's egress
//! rules (`transform.rs`), which name them as `${e2b.secrets.NAME}` placeholders.

use crate::rules::{self, Spec};
use crate::transform::EgressRules;
use crate::{Broker, BrokerError, MAX_SECRETS_PER_OWNER, disabled, secret_from_record};
use sandpit_api::secrets::InjectSpec;
use sandpit_store::{E2bSecretRecord, SecretRecord};
use std::sync::Arc;

/// Most entries of a secret's metadata.
pub const MAX_METADATA_ENTRIES: usize = 32;
/// Longest metadata key, value, and all of it, in bytes.
pub const MAX_METADATA_KEY: usize = 128;
pub const MAX_METADATA_VALUE: usize = 1024;
pub const MAX_METADATA_TOTAL: usize = 8192;
/// Most secrets one page of a list holds.
pub const MAX_PAGE: i64 = 100;

/// The stored rules of an E2B secret: no host, so no request of a sandbox's own gets it.
fn e2b_spec() -> Spec {
    Spec {
        hosts: Vec::new(),
        methods: Vec::new(),
        path_prefixes: Vec::new(),
        inject: InjectSpec::Placeholder,
        allow_http: false,
    }
}

/// Checks an E2B secret's name (as stored: lower case).
pub fn check_e2b_name(name: &str) -> Result<(), BrokerError> {
    rules::check_name(name).map_err(|e| BrokerError::Invalid(e.0))?;
    if name.starts_with("sec_") {
        return Err(BrokerError::Invalid(format!(
            "secret name {name:?}: the sec_ prefix is reserved for secret ids"
        )));
    }
    Ok(())
}

/// Checks metadata: at most 32 entries, keys of 1 to 128 bytes, values of at most 1024,
/// 8192 bytes in all.
pub fn check_metadata(
    m: &std::collections::BTreeMap<String, String>,
) -> Result<serde_json::Value, BrokerError> {
    let invalid = |s: String| Err(BrokerError::Invalid(s));
    if m.len() > MAX_METADATA_ENTRIES {
        return invalid(format!("metadata: at most {MAX_METADATA_ENTRIES} entries"));
    }
    let mut total = 0;
    for (k, v) in m {
        if k.is_empty() || k.len() > MAX_METADATA_KEY {
            return invalid(format!(
                "metadata key {k:?} must be 1 to {MAX_METADATA_KEY} bytes"
            ));
        }
        if v.len() > MAX_METADATA_VALUE {
            return invalid(format!(
                "metadata value of {k:?} is over {MAX_METADATA_VALUE} bytes"
            ));
        }
        total += k.len() + v.len();
    }
    if total > MAX_METADATA_TOTAL {
        return invalid(format!("metadata is over {MAX_METADATA_TOTAL} bytes"));
    }
    serde_json::to_value(m).map_err(BrokerError::Encode)
}

fn new_id() -> Result<String, BrokerError> {
    let mut b = [0u8; 16];
    aws_lc_rs::rand::fill(&mut b).map_err(|_| BrokerError::Crypto("random id"))?;
    Ok(format!("sec_{}", hex::encode(b)))
}

fn not_found(selector: &str) -> BrokerError {
    BrokerError::NotFound(format!("secret {selector} not found"))
}

impl Broker {
    /// Stores a new E2B secret of `owner` (`name` lower-cased).
    pub async fn create_e2b_secret(
        &self,
        owner: &str,
        name: &str,
        value: &str,
        metadata: &std::collections::BTreeMap<String, String>,
    ) -> Result<E2bSecretRecord, BrokerError> {
        let keys = self.inner.keys.as_ref().ok_or_else(disabled)?;
        let name = name.to_ascii_lowercase();
        check_e2b_name(&name)?;
        rules::check_value(value).map_err(|e| BrokerError::Invalid(e.0))?;
        let metadata = check_metadata(metadata)?;
        let now = sandpit_store::now_ms();
        let rec = SecretRecord {
            owner: owner.to_string(),
            name: name.clone(),
            sealed: keys.seal(&rules::seal_label(owner, &name), value.as_bytes())?,
            spec: serde_json::to_value(e2b_spec()).map_err(BrokerError::Encode)?,
            expires_at_ms: None,
            created_at_ms: now,
        };
        let id = new_id()?;
        let _w = self.inner.writes.lock().await;
        match self
            .inner
            .store
            .insert_e2b_secret(&rec, &id, &metadata, MAX_SECRETS_PER_OWNER)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                return Err(BrokerError::TooMany(format!(
                    "at most {MAX_SECRETS_PER_OWNER} secrets per owner"
                )));
            }
            Err(sandpit_store::StoreError::Conflict(_)) => {
                return Err(BrokerError::AlreadyExists(format!(
                    "secret {name} already exists"
                )));
            }
            Err(e) => return Err(e.into()),
        }
        let secret = secret_from_record(rec)?;
        {
            let mut cache = self.inner.cache.write();
            cache.e2b.insert((owner.to_string(), name.clone()));
            cache
                .secrets
                .insert((owner.to_string(), name.clone()), Arc::new(secret));
        }
        tracing::info!(owner, secret = %name, "E2B secret stored");
        self.inner
            .store
            .get_e2b_secret(owner, &id)
            .await?
            .ok_or_else(|| not_found(&id))
    }

    /// The E2B secret of `owner` with id or name `selector`.
    pub async fn get_e2b_secret(
        &self,
        owner: &str,
        selector: &str,
    ) -> Result<E2bSecretRecord, BrokerError> {
        let lower = selector.to_ascii_lowercase();
        let found = match self.inner.store.get_e2b_secret(owner, selector).await? {
            Some(r) => Some(r),
            None if lower != selector => self.inner.store.get_e2b_secret(owner, &lower).await?,
            None => None,
        };
        found.ok_or_else(|| not_found(selector))
    }

    /// A page of `owner`'s E2B secrets by name, after name `after`.
    pub async fn list_e2b_secrets(
        &self,
        owner: &str,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<E2bSecretRecord>, BrokerError> {
        Ok(self
            .inner
            .store
            .list_e2b_secrets(owner, after, limit.clamp(1, MAX_PAGE))
            .await?)
    }

    /// Stores a new value of an E2B secret as its next version (and its metadata, when
    /// given); sandboxes get the new value on their next request.
    pub async fn update_e2b_secret(
        &self,
        owner: &str,
        selector: &str,
        value: &str,
        metadata: Option<&std::collections::BTreeMap<String, String>>,
    ) -> Result<E2bSecretRecord, BrokerError> {
        let keys = self.inner.keys.as_ref().ok_or_else(disabled)?;
        rules::check_value(value).map_err(|e| BrokerError::Invalid(e.0))?;
        let metadata = metadata.map(check_metadata).transpose()?;
        let current = self.get_e2b_secret(owner, selector).await?;
        let sealed = keys.seal(&rules::seal_label(owner, &current.name), value.as_bytes())?;
        let _w = self.inner.writes.lock().await;
        let updated = self
            .inner
            .store
            .update_e2b_secret(
                owner,
                &current.name,
                &sealed,
                metadata.as_ref(),
                sandpit_store::now_ms(),
            )
            .await?
            .ok_or_else(|| not_found(selector))?;
        if let Some(rec) = self.inner.store.get_secret(owner, &current.name).await? {
            let s = secret_from_record(rec)?;
            self.inner
                .cache
                .write()
                .secrets
                .insert((owner.to_string(), current.name.clone()), Arc::new(s));
        }
        tracing::info!(owner, secret = %current.name, version = updated.version, "E2B secret updated");
        Ok(updated)
    }

    /// Deletes an E2B secret; rules that name it refuse their requests from then on.
    pub async fn delete_e2b_secret(&self, owner: &str, selector: &str) -> Result<(), BrokerError> {
        let current = self.get_e2b_secret(owner, selector).await?;
        self.delete_secret(owner, &current.name).await?;
        self.inner
            .cache
            .write()
            .e2b
            .remove(&(owner.to_string(), current.name));
        Ok(())
    }

    /// Checks rules a sandbox of `owner` is to get: the broker can serve them, and every
    /// secret they name is one of `owner`'s E2B secrets.
    pub async fn check_egress_rules(
        &self,
        owner: &str,
        rules: &EgressRules,
    ) -> Result<(), BrokerError> {
        if rules.hosts.is_empty() {
            return Ok(());
        }
        if !self.enabled() {
            return Err(disabled());
        }
        let known = self.inner.store.e2b_secret_names(owner).await?;
        for name in rules.secret_names() {
            if !known.contains(&name) {
                return Err(BrokerError::Invalid(format!(
                    "rules name secret {name:?}, which is not one of your secrets (create it with POST /secrets)"
                )));
            }
        }
        Ok(())
    }

    /// Replaces the egress rules of sandbox `id` of `owner` (`None` or empty: none).
    pub async fn set_egress_rules(
        &self,
        id: &str,
        owner: &str,
        rules: Option<EgressRules>,
    ) -> Result<(), BrokerError> {
        let rules = rules.filter(|r| !r.hosts.is_empty() || r.mask_request_host.is_some());
        if let Some(r) = &rules {
            self.check_egress_rules(owner, r).await?;
        }
        let json = rules
            .as_ref()
            .map(serde_json::to_value)
            .transpose()
            .map_err(BrokerError::Encode)?;
        let _w = self.inner.writes.lock().await;
        self.inner.store.set_egress_rules(id, json.as_ref()).await?;
        let mut cache = self.inner.cache.write();
        match rules {
            Some(r) => {
                cache
                    .egress
                    .insert(id.to_string(), (owner.to_string(), Arc::new(r)));
            }
            None => {
                cache.egress.remove(id);
            }
        }
        Ok(())
    }

    /// The `maskRequestHost` of sandbox `id`, if it has one.
    pub fn mask_request_host(&self, id: &str) -> Option<String> {
        self.inner
            .cache
            .read()
            .egress
            .get(id)
            .and_then(|(_, r)| r.mask_request_host.clone())
    }

    /// The egress rules of sandbox `id`, if it has any.
    pub fn egress_rules(&self, id: &str) -> Option<Arc<EgressRules>> {
        self.inner
            .cache
            .read()
            .egress
            .get(id)
            .map(|(_, r)| r.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandpit_store::Store;

    async fn broker() -> Broker {
        let store = Store::open_in_memory().await.unwrap();
        Broker::with_key(&Default::default(), store, Some(&[7u8; 32]))
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn e2b_secrets_are_owned_validated_and_versioned() {
        let b = broker().await;
        let meta = [("env".to_string(), "test".to_string())].into();
        let s = b
            .create_e2b_secret("alice", "OpenAI-Key", "sk-value-123", &meta)
            .await
            .unwrap();
        assert_eq!(s.name, "openai-key");
        assert!(s.id.starts_with("sec_"));
        assert_eq!(s.version, 1);
        let dup = b
            .create_e2b_secret("alice", "openai-key", "x", &Default::default())
            .await;
        assert!(matches!(dup, Err(BrokerError::AlreadyExists(_))), "{dup:?}");
        // Another owner sees nothing of it, by name or id.
        for sel in [s.id.as_str(), "openai-key"] {
            let other = b.get_e2b_secret("bob", sel).await;
            assert!(matches!(other, Err(BrokerError::NotFound(_))), "{other:?}");
            let up = b.update_e2b_secret("bob", sel, "x", None).await;
            assert!(matches!(up, Err(BrokerError::NotFound(_))), "{up:?}");
            let del = b.delete_e2b_secret("bob", sel).await;
            assert!(matches!(del, Err(BrokerError::NotFound(_))), "{del:?}");
        }
        let up = b
            .update_e2b_secret("alice", "OPENAI-KEY", "sk-new-456", None)
            .await
            .unwrap();
        assert_eq!(
            (up.version, up.metadata.clone()),
            (2, serde_json::json!({"env": "test"}))
        );
        for (name, value) in [
            ("sec_x", "v"),
            ("a b", "v"),
            ("{x}", "v"),
            ("", "v"),
            ("ok", ""),
            ("ok", "a\r\nb"),
        ] {
            let r = b
                .create_e2b_secret("alice", name, value, &Default::default())
                .await;
            assert!(
                matches!(r, Err(BrokerError::Invalid(_))),
                "{name:?} {value:?}: {r:?}"
            );
        }
        let big: std::collections::BTreeMap<String, String> = (0..33)
            .map(|i| (format!("k{i}"), "v".to_string()))
            .collect();
        let r = b.create_e2b_secret("alice", "ok", "v", &big).await;
        assert!(matches!(r, Err(BrokerError::Invalid(_))), "{r:?}");
        b.delete_e2b_secret("alice", &s.id).await.unwrap();
        assert!(b.get_e2b_secret("alice", "openai-key").await.is_err());
    }

    #[tokio::test]
    async fn rules_may_name_only_the_owners_e2b_secrets() {
        let b = broker().await;
        b.create_e2b_secret("alice", "gh", "ghp_value", &Default::default())
            .await
            .unwrap();
        let rules = crate::transform::from_e2b(&serde_json::json!({
            "api.example.com": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.gh}"}}}]
        }))
        .unwrap();
        b.check_egress_rules("alice", &rules).await.unwrap();
        let r = b.check_egress_rules("bob", &rules).await;
        assert!(matches!(r, Err(BrokerError::Invalid(_))), "{r:?}");
        // A native secret of the same name is bound to its own hosts: rules cannot use it.
        let native = sandpit_api::secrets::CreateSecretRequest {
            name: "gh".into(),
            value: "native".into(),
            hosts: vec!["api.example.com".into()],
            methods: vec!["GET".into()],
            ttl_secs: Some(60),
            ..Default::default()
        };
        b.create_secret("carol", &native).await.unwrap();
        let r = b.check_egress_rules("carol", &rules).await;
        assert!(matches!(r, Err(BrokerError::Invalid(_))), "{r:?}");
    }
}
