//! The credential broker: secrets kept by the daemon (sealed at rest with a key from its
//! config or environment), attached to sandboxes by name, and put into a sandbox's
//! matching outbound HTTP requests by the egress proxy's interceptor, so that the sandbox
//! never holds them. Each sandbox trusts a CA of its own, installed at boot, which the
//! broker uses to terminate the TLS connections it intercepts. A credential goes only
//! into a connection to an address its host resolves to (see [`Destination`]); a request
//! that would carry one anywhere else is refused.

#![forbid(unsafe_code)]

pub mod ca;
pub mod crypto;
pub mod e2b;
mod proxy;
pub mod rules;
pub mod transform;

use futures::FutureExt;
use futures::future::BoxFuture;
use parking_lot::RwLock;
use rules::Secret;
use sandpit_api::secrets::CreateSecretRequest;
use sandpit_net::intercept::{BoxedIo, Carried, Destination, Interceptor, Outbound};
use sandpit_store::{SecretRecord, Store};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use zeroize::Zeroizing;

/// Most secrets one owner may keep.
pub const MAX_SECRETS_PER_OWNER: i64 = 256;
/// Most secrets attached to one sandbox.
pub const MAX_ATTACHED: usize = 64;
/// How often the attachment table is read again (sandboxes deleted meanwhile drop out).
const REFRESH_EVERY: Duration = Duration::from_secs(60);

/// `[broker]` in the daemon's config file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerConfig {
    /// File holding the 32-byte master key (64 hex digits, base64, or raw). The
    /// `SANDPIT_BROKER_KEY` environment variable, when set, is used instead.
    pub key_file: Option<PathBuf>,
    /// PEM certificates trusted for upstream servers besides the Mozilla roots (a test
    /// CA, or a company's own).
    pub extra_ca_file: Option<PathBuf>,
}

/// Why the broker cannot do something.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The master key is not usable (the text says why).
    #[error("broker key: {0}")]
    Key(String),
    /// The master key's file could not be read.
    #[error("broker key: read {}: {source}", path.display())]
    KeyFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Sealing, opening or deriving failed (aws-lc says no more than that it failed).
    #[error("{0}")]
    Crypto(&'static str),
    /// A CA or leaf certificate could not be made.
    #[error("certificate: {what}: {source}")]
    Cert {
        what: String,
        #[source]
        source: rcgen::Error,
    },
    /// A TLS configuration was refused: what was being configured, and rustls's answer.
    #[error("{what}: {source}")]
    Tls {
        what: String,
        #[source]
        source: rustls::Error,
    },
    /// `extra_ca_file` could not be read as PEM certificates.
    #[error("extra_ca_file {}: {source}", path.display())]
    ExtraCa {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    /// The configuration is not usable (the text says why).
    #[error("{0}")]
    Config(String),
    /// A stored secret's rules do not decode.
    #[error("secret {owner}/{name}: stored rules: {source}")]
    StoredRules {
        owner: String,
        name: String,
        #[source]
        source: serde_json::Error,
    },
    /// A secret's rules would not encode for the store.
    #[error("encode a secret's rules: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("store: {0}")]
    Store(#[from] sandpit_store::StoreError),
    /// The broker has no key, so it can hold no secret.
    #[error(
        "the credential broker has no key: set `[broker] key_file` in the daemon's config or \
         SANDPIT_BROKER_KEY in its environment (secrets are never stored unencrypted)"
    )]
    Disabled,
    /// The request is not valid (a name, a rule).
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    /// An owner's limit on secrets is reached.
    #[error("{0}")]
    TooMany(String),
}

/// What wants() and serve() read on every connection: secrets (values sealed) and which
/// sandbox may use which.
#[derive(Default)]
struct Cache {
    secrets: HashMap<(String, String), Arc<Secret>>,
    /// Sandbox id to its owner and its secrets' names.
    attached: HashMap<String, (String, Vec<String>)>,
    /// `(owner, name)` of the secrets made through E2B's API: the only ones rules may name.
    e2b: std::collections::HashSet<(String, String)>,
    /// Sandbox id to its owner and its egress header rules.
    egress: HashMap<String, (String, Arc<transform::EgressRules>)>,
}

pub(crate) struct Inner {
    keys: Option<Arc<crypto::Keys>>,
    authority: Option<ca::Authority>,
    upstream_tls: Arc<rustls::ClientConfig>,
    store: Store,
    cache: RwLock<Cache>,
    /// Orders store writes and cache reloads of attachments, so that a reload read before
    /// a change cannot overwrite the cache after it.
    writes: tokio::sync::Mutex<()>,
    /// Asked before a gated credential goes into a request (the daemon's approvals).
    pub(crate) gate: RwLock<Option<Arc<dyn sandpit_net::approval::ApprovalGate>>>,
}

/// The credential broker; cheap to clone.
#[derive(Clone)]
pub struct Broker {
    inner: Arc<Inner>,
}

fn disabled() -> BrokerError {
    BrokerError::Disabled
}

fn secret_from_record(r: SecretRecord) -> Result<Secret, BrokerError> {
    let spec: rules::Spec = match serde_json::from_value(r.spec) {
        Ok(spec) => spec,
        Err(source) => {
            return Err(BrokerError::StoredRules {
                owner: r.owner,
                name: r.name,
                source,
            });
        }
    };
    Ok(Secret {
        owner: r.owner,
        name: r.name,
        sealed: r.sealed,
        spec,
        expires_at_ms: r.expires_at_ms,
        created_at_ms: r.created_at_ms,
    })
}

/// The API view of a secret: everything but the value.
pub fn to_api(s: &Secret) -> sandpit_api::secrets::Secret {
    sandpit_api::secrets::Secret {
        name: s.name.clone(),
        owner: s.owner.clone(),
        hosts: s.spec.hosts.clone(),
        methods: s.spec.methods.clone(),
        path_prefixes: s.spec.path_prefixes.clone(),
        expires_at_ms: s.expires_at_ms,
        inject: s.spec.inject.clone(),
        placeholder: s.placeholder(),
        allow_http: s.spec.allow_http,
        created_at_ms: s.created_at_ms,
    }
}

/// The master key: the environment variable, else the configured file, else none.
fn load_key(cfg: &BrokerConfig) -> Result<Option<Zeroizing<Vec<u8>>>, BrokerError> {
    if let Some(v) = std::env::var_os(crypto::KEY_ENV) {
        let v = Zeroizing::new(v.into_encoded_bytes());
        return crypto::parse_key(&v, false).map(Some);
    }
    let Some(path) = &cfg.key_file else {
        return Ok(None);
    };
    let bytes = Zeroizing::new(std::fs::read(path).map_err(|source| BrokerError::KeyFile {
        path: path.clone(),
        source,
    })?);
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(m) = std::fs::metadata(path)
            && m.permissions().mode() & 0o077 != 0
        {
            tracing::warn!(path = %path.display(), "the broker key file is readable by others than its owner; chmod 600 it");
        }
    }
    crypto::parse_key(&bytes, true).map(Some)
}

fn upstream_tls(extra_ca: Option<&Path>) -> Result<rustls::ClientConfig, BrokerError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = extra_ca {
        let pem_err = |source| BrokerError::ExtraCa {
            path: path.to_path_buf(),
            source,
        };
        let certs = CertificateDer::pem_file_iter(path).map_err(pem_err)?;
        let mut n = 0;
        for cert in certs {
            let cert = cert.map_err(pem_err)?;
            roots.add(cert).map_err(|source| BrokerError::Tls {
                what: format!("extra_ca_file {}", path.display()),
                source,
            })?;
            n += 1;
        }
        if n == 0 {
            return Err(BrokerError::Config(format!(
                "extra_ca_file {} holds no certificate",
                path.display()
            )));
        }
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(ca::provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| BrokerError::Tls {
            what: "upstream TLS versions".into(),
            source,
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

impl Broker {
    /// Installs what is asked before a credential an approval policy gates goes into a
    /// request; without one every matching credential is injected as its rules allow.
    pub fn set_approval_gate(&self, g: Arc<dyn sandpit_net::approval::ApprovalGate>) {
        *self.inner.gate.write() = Some(g);
    }

    /// A broker as configured, its secrets and attachments loaded from the store. Without
    /// a key it is disabled: it wants no connection and refuses to store secrets.
    pub async fn new(cfg: &BrokerConfig, store: Store) -> Result<Self, BrokerError> {
        let master = load_key(cfg)?;
        Self::with_key(cfg, store, master.as_deref().map(|k| k.as_slice())).await
    }

    /// Same as [`Self::new`] with the master key given (tests; `None`: disabled).
    pub async fn with_key(
        cfg: &BrokerConfig,
        store: Store,
        master: Option<&[u8]>,
    ) -> Result<Self, BrokerError> {
        let keys = master.map(crypto::Keys::new).transpose()?.map(Arc::new);
        let broker = Broker {
            inner: Arc::new(Inner {
                authority: keys.clone().map(ca::Authority::new),
                keys,
                upstream_tls: Arc::new(upstream_tls(cfg.extra_ca_file.as_deref())?),
                store,
                cache: RwLock::default(),
                writes: tokio::sync::Mutex::new(()),
                gate: RwLock::new(None),
            }),
        };
        broker.reload().await?;
        if broker.enabled() {
            broker.check_stored();
        } else {
            let stored = broker.inner.cache.read().secrets.len();
            if stored > 0 {
                tracing::warn!(
                    stored,
                    "the credential broker has no key: stored secrets cannot be used"
                );
            }
        }
        Ok(broker)
    }

    /// Whether the broker has a key (and so secrets, CAs and interception).
    pub fn enabled(&self) -> bool {
        self.inner.keys.is_some()
    }

    /// Logs secrets that do not decrypt with the configured key (made with another one).
    fn check_stored(&self) {
        for s in self.inner.cache.read().secrets.values() {
            if self.inner.open(s).is_err() {
                tracing::warn!(owner = %s.owner, secret = %s.name,
                    "a stored secret does not decrypt with the configured broker key; requests needing it are refused");
            }
        }
    }

    /// Reads secrets and attachments from the store again.
    pub async fn reload(&self) -> Result<(), BrokerError> {
        let _w = self.inner.writes.lock().await;
        let mut fresh = Cache::default();
        for rec in self.inner.store.list_secrets(None).await? {
            let s = secret_from_record(rec)?;
            fresh
                .secrets
                .insert((s.owner.clone(), s.name.clone()), Arc::new(s));
        }
        for a in self.inner.store.secret_attachments().await? {
            fresh
                .attached
                .entry(a.sandbox_id)
                .or_insert_with(|| (a.owner, Vec::new()))
                .1
                .push(a.name);
        }
        fresh.e2b = self
            .inner
            .store
            .all_e2b_secret_names()
            .await?
            .into_iter()
            .collect();
        for r in self.inner.store.all_egress_rules().await? {
            match serde_json::from_value::<transform::EgressRules>(r.rules) {
                Ok(rules) => {
                    fresh
                        .egress
                        .insert(r.sandbox_id, (r.owner, Arc::new(rules)));
                }
                // One bad row must not take every sandbox's rules down with it.
                Err(e) => {
                    tracing::warn!(sandbox = %r.sandbox_id, error = %e, "stored egress rules do not decode; they are not applied")
                }
            }
        }
        *self.inner.cache.write() = fresh;
        Ok(())
    }

    /// Re-reads the attachments now and then, so that deleted sandboxes drop out.
    pub fn spawn_refresh(&self) {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(REFRESH_EVERY).await;
                if let Err(e) = me.reload().await {
                    tracing::warn!(error = %e, "reloading the broker's secrets failed");
                }
            }
        });
    }

    /// The CA certificate to install into sandbox `id` at boot (`None`: broker disabled).
    pub fn ca_pem(&self, id: &str) -> Option<String> {
        let authority = self.inner.authority.as_ref()?;
        match authority.ca_pem(id) {
            Ok(pem) => Some(pem),
            Err(e) => {
                tracing::error!(id, error = %e, "making a sandbox CA failed");
                None
            }
        }
    }

    /// [`Self::ca_pem`] made on a blocking thread, to be awaited once the caller's other
    /// start-up work is done (making a CA is CPU work a create would otherwise wait for).
    pub fn ca_pem_soon(&self, id: &str) -> impl std::future::Future<Output = Option<String>> {
        let task = self.enabled().then(|| {
            let (me, id) = (self.clone(), id.to_string());
            tokio::task::spawn_blocking(move || me.ca_pem(&id))
        });
        async move {
            match task {
                Some(t) => t.await.ok().flatten(),
                None => None,
            }
        }
    }

    /// Stores a new secret of `owner`.
    pub async fn create_secret(
        &self,
        owner: &str,
        req: &CreateSecretRequest,
    ) -> Result<sandpit_api::secrets::Secret, BrokerError> {
        let keys = self.inner.keys.as_ref().ok_or_else(disabled)?;
        let now = sandpit_store::now_ms();
        let (spec, expires_at_ms) =
            rules::validate(req, now).map_err(|e| BrokerError::Invalid(e.into()))?;
        let sealed = keys.seal(&rules::seal_label(owner, &req.name), req.value.as_bytes())?;
        let rec = SecretRecord {
            owner: owner.to_string(),
            name: req.name.clone(),
            sealed,
            spec: serde_json::to_value(&spec).map_err(BrokerError::Encode)?,
            expires_at_ms: Some(expires_at_ms),
            created_at_ms: now,
        };
        let _w = self.inner.writes.lock().await;
        let inserted = match self
            .inner
            .store
            .insert_secret(&rec, MAX_SECRETS_PER_OWNER)
            .await
        {
            Ok(i) => i,
            Err(sandpit_store::StoreError::Conflict(_)) => {
                return Err(BrokerError::AlreadyExists(format!(
                    "secret {} already exists",
                    req.name
                )));
            }
            Err(e) => return Err(e.into()),
        };
        if !inserted {
            return Err(BrokerError::TooMany(format!(
                "at most {MAX_SECRETS_PER_OWNER} secrets per owner"
            )));
        }
        let secret = secret_from_record(rec)?;
        let view = to_api(&secret);
        self.inner.cache.write().secrets.insert(
            (secret.owner.clone(), secret.name.clone()),
            Arc::new(secret),
        );
        tracing::info!(owner, secret = %req.name, "secret stored");
        Ok(view)
    }

    /// The secrets of `owner`.
    pub async fn list_secrets(
        &self,
        owner: &str,
    ) -> Result<Vec<sandpit_api::secrets::Secret>, BrokerError> {
        let recs = self.inner.store.list_secrets(Some(owner)).await?;
        recs.into_iter()
            .map(|r| secret_from_record(r).map(|s| to_api(&s)))
            .collect()
    }

    /// One secret of `owner`.
    pub async fn get_secret(
        &self,
        owner: &str,
        name: &str,
    ) -> Result<sandpit_api::secrets::Secret, BrokerError> {
        rules::check_name(name).map_err(|e| BrokerError::Invalid(e.into()))?;
        let rec = self
            .inner
            .store
            .get_secret(owner, name)
            .await?
            .ok_or_else(|| BrokerError::NotFound(format!("secret {name} not found")))?;
        let s = secret_from_record(rec)?;
        Ok(to_api(&s))
    }

    /// Deletes a secret of `owner`; its sandboxes stop getting it at once.
    pub async fn delete_secret(&self, owner: &str, name: &str) -> Result<(), BrokerError> {
        rules::check_name(name).map_err(|e| BrokerError::Invalid(e.into()))?;
        let _w = self.inner.writes.lock().await;
        if !self.inner.store.delete_secret(owner, name).await? {
            return Err(BrokerError::NotFound(format!("secret {name} not found")));
        }
        {
            let mut cache = self.inner.cache.write();
            cache.secrets.remove(&(owner.to_string(), name.to_string()));
            for (o, names) in cache.attached.values_mut() {
                if o == owner {
                    names.retain(|n| n != name);
                }
            }
        }
        tracing::info!(owner, secret = name, "secret deleted");
        Ok(())
    }

    /// Checks names a sandbox of `owner` is to be given, before the sandbox is made.
    pub async fn check_names(&self, owner: &str, names: &[String]) -> Result<(), BrokerError> {
        if names.is_empty() {
            return Ok(());
        }
        if !self.enabled() {
            return Err(disabled());
        }
        if names.len() > MAX_ATTACHED {
            return Err(BrokerError::Invalid(format!(
                "at most {MAX_ATTACHED} secrets per sandbox"
            )));
        }
        for n in names {
            rules::check_name(n).map_err(|e| BrokerError::Invalid(e.into()))?;
            if self.inner.store.get_secret(owner, n).await?.is_none() {
                return Err(BrokerError::NotFound(format!("secret {n:?} not found")));
            }
        }
        Ok(())
    }

    /// Replaces the secrets sandbox `id` (of `owner`) may use.
    pub async fn attach(&self, id: &str, owner: &str, names: &[String]) -> Result<(), BrokerError> {
        self.check_names(owner, names).await?;
        let _w = self.inner.writes.lock().await;
        match self.inner.store.set_sandbox_secrets(id, names).await {
            Ok(()) => {}
            Err(sandpit_store::StoreError::NotFound(what)) if what.starts_with("secret ") => {
                return Err(BrokerError::Invalid(format!("unknown {what}")));
            }
            Err(e) => return Err(e.into()),
        }
        let mut sorted = names.to_vec();
        sorted.sort();
        sorted.dedup();
        {
            let mut cache = self.inner.cache.write();
            if sorted.is_empty() {
                cache.attached.remove(id);
            } else {
                cache
                    .attached
                    .insert(id.to_string(), (owner.to_string(), sorted));
            }
        }
        if let Some(a) = &self.inner.authority {
            a.forget(id);
        }
        Ok(())
    }

    /// Names of the secrets sandbox `id` may use.
    pub async fn attached(&self, id: &str) -> Result<Vec<String>, BrokerError> {
        Ok(self.inner.store.sandbox_secrets(id).await?)
    }

    /// Gives a fork's copies the secrets their source may use.
    pub async fn copy_attachments(&self, from: &str, to: &[String]) -> Result<(), BrokerError> {
        let _w = self.inner.writes.lock().await;
        self.inner.store.copy_sandbox_secrets(from, to).await?;
        self.inner.store.copy_egress_rules(from, to).await?;
        {
            let mut cache = self.inner.cache.write();
            if let Some(entry) = cache.attached.get(from).cloned() {
                for id in to {
                    cache.attached.insert(id.clone(), entry.clone());
                }
            }
            if let Some(entry) = cache.egress.get(from).cloned() {
                for id in to {
                    cache.egress.insert(id.clone(), entry.clone());
                }
            }
        }
        Ok(())
    }
}

impl Inner {
    /// The secrets sandbox `id` may use now.
    fn attached_secrets(&self, id: &str) -> Vec<Arc<Secret>> {
        let cache = self.cache.read();
        let Some((owner, names)) = cache.attached.get(id) else {
            return Vec::new();
        };
        names
            .iter()
            .filter_map(|n| cache.secrets.get(&(owner.clone(), n.clone())).cloned())
            .collect()
    }

    /// The owner and egress rules of sandbox `id`, if it has any.
    fn egress_of(&self, id: &str) -> Option<(String, Arc<transform::EgressRules>)> {
        self.cache.read().egress.get(id).cloned()
    }

    /// E2B secret `name` of `owner`, if it exists (a secret of the native API is never
    /// one: rules cannot move it past its own host binding).
    fn e2b_secret(&self, owner: &str, name: &str) -> Option<Arc<Secret>> {
        let cache = self.cache.read();
        let key = (owner.to_string(), name.to_string());
        if !cache.e2b.contains(&key) {
            return None;
        }
        cache.secrets.get(&key).cloned()
    }

    /// The value of a secret, in the clear for as long as the caller holds it.
    fn open(&self, s: &Secret) -> Result<Zeroizing<Vec<u8>>, BrokerError> {
        let keys = self
            .keys
            .as_ref()
            .ok_or(BrokerError::Crypto("the broker has no key"))?;
        keys.open(&rules::seal_label(&s.owner, &s.name), &s.sealed)
    }
}

impl Interceptor for Broker {
    /// Only connections to a host that one of the sandbox's secrets is bound to (over
    /// plain HTTP, one that allows it) or that its egress rules name; every other
    /// connection passes untouched.
    fn wants(&self, conn: &Outbound) -> bool {
        if !self.enabled() {
            return false;
        }
        let host = rules::normal_host(&conn.host);
        if self
            .inner
            .egress_of(&conn.sandbox_id)
            .is_some_and(|(_, r)| r.lookup(&host).is_some())
        {
            return true;
        }
        self.inner
            .attached_secrets(&conn.sandbox_id)
            .iter()
            .any(|s| s.binds_host(&host) && (conn.tls || s.spec.allow_http))
    }

    fn serve(
        &self,
        conn: Outbound,
        client: BoxedIo,
        upstream: Destination,
    ) -> BoxFuture<'static, std::io::Result<Carried>> {
        proxy::serve(self.inner.clone(), conn, client, upstream).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(key_file: Option<PathBuf>, extra_ca_file: Option<PathBuf>) -> BrokerConfig {
        BrokerConfig {
            key_file,
            extra_ca_file,
        }
    }

    #[tokio::test]
    async fn a_bad_key_or_ca_file_keeps_the_daemon_from_starting() {
        // Only meaningful when the environment does not supply a key instead.
        if std::env::var_os(crypto::KEY_ENV).is_some() {
            return;
        }
        let store = Store::open_in_memory().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short.key");
        std::fs::write(&short, "abcd").unwrap();
        let good = dir.path().join("good.key");
        std::fs::write(&good, hex::encode([3u8; 32])).unwrap();
        let not_pem = dir.path().join("ca.pem");
        std::fs::write(&not_pem, "not a certificate").unwrap();
        for bad in [
            cfg(Some(dir.path().join("missing.key")), None),
            cfg(Some(short), None),
            cfg(Some(good.clone()), Some(not_pem)),
            cfg(Some(good.clone()), Some(dir.path().join("missing.pem"))),
        ] {
            assert!(Broker::new(&bad, store.clone()).await.is_err(), "{bad:?}");
        }
        let ok = Broker::new(&cfg(Some(good), None), store.clone())
            .await
            .unwrap();
        assert!(ok.enabled());
        let none = Broker::new(&cfg(None, None), store).await.unwrap();
        assert!(!none.enabled());
    }

    #[tokio::test]
    async fn config_errors_say_which_file_and_keep_the_cause() {
        use std::error::Error as _;
        if std::env::var_os(crypto::KEY_ENV).is_some() {
            return;
        }
        let store = Store::open_in_memory().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.key");
        let Err(e) = Broker::new(&cfg(Some(missing.clone()), None), store.clone()).await else {
            panic!("a missing key file was accepted");
        };
        assert!(
            e.to_string()
                .starts_with(&format!("broker key: read {}: ", missing.display())),
            "{e}"
        );
        assert!(e.source().is_some_and(|s| s.is::<std::io::Error>()));
        let good = dir.path().join("good.key");
        std::fs::write(&good, hex::encode([3u8; 32])).unwrap();
        let missing_ca = dir.path().join("missing.pem");
        let Err(e) = Broker::new(&cfg(Some(good), Some(missing_ca.clone())), store).await else {
            panic!("a missing CA file was accepted");
        };
        assert!(
            e.to_string()
                .starts_with(&format!("extra_ca_file {}: ", missing_ca.display())),
            "{e}"
        );
        assert!(e.source().is_some());
    }

    #[test]
    fn a_stored_secret_with_bad_rules_is_named_and_keeps_the_decode_error() {
        use std::error::Error as _;
        let rec = SecretRecord {
            owner: "carol".into(),
            name: "gh".into(),
            sealed: Vec::new(),
            spec: serde_json::json!({"hosts": 5}),
            expires_at_ms: None,
            created_at_ms: 0,
        };
        let Err(e) = secret_from_record(rec) else {
            panic!("bad stored rules were accepted");
        };
        assert!(
            e.to_string().starts_with("secret carol/gh: stored rules: "),
            "{e}"
        );
        assert!(e.source().is_some_and(|s| s.is::<serde_json::Error>()));
        let encode = BrokerError::Encode(serde_json::from_str::<u8>("x").unwrap_err());
        assert!(encode.to_string().starts_with("encode a secret's rules: "));
        assert!(encode.source().is_some());
    }
}
