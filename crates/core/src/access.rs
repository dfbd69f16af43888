//! Each sandbox's own credentials for its data plane: the envd token and the traffic
//! token (what E2B's control plane returns as `envdAccessToken` / `trafficAccessToken`),
//! and whether its envd needs a token (`secure`) and its ports are open to anyone
//! (`public`). Made when a sandbox is created or claimed, inherited in kind by forks, read
//! by the ingress on every proxied request.

use crate::error::CoreError;
use crate::manager::Manager;
use sandpit_store::{SandboxAccess, SandboxState};

/// An unisolated sandbox runs its commands on the host, and its "loopback" is the
/// host's: opening either to anyone would open the host, so its envd always needs the
/// token and its ports are never public, whatever was asked.
pub fn enforce_unisolated(a: &mut SandboxAccess) {
    a.secure = true;
    a.public = false;
}

/// A fresh 256-bit token, hex.
pub fn random_token() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

fn fresh_access(id: &str, secure: bool, public: bool) -> SandboxAccess {
    SandboxAccess {
        sandbox_id: id.to_string(),
        envd_token: random_token(),
        traffic_token: random_token(),
        secure,
        public,
        updated_at_ms: crate::manager::now_ms(),
    }
}

/// How long credentials read from the store are used without reading them again. This
/// daemon's own changes apply at once; another daemon's on a shared store (a rotated
/// token) within this time.
const ACCESS_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(5);
/// Most credentials remembered at once (the cache is emptied when it would grow beyond).
const ACCESS_CACHE_MAX: usize = 4096;

type AccessCache = std::collections::HashMap<String, (SandboxAccess, std::time::Instant)>;

/// Recently used credentials, so that a proxied request costs one store read (its
/// sandbox's record), not two.
static ACCESS_CACHE: std::sync::LazyLock<parking_lot::Mutex<AccessCache>> =
    std::sync::LazyLock::new(Default::default);

fn cached(id: &str) -> Option<SandboxAccess> {
    let map = ACCESS_CACHE.lock();
    let (a, at) = map.get(id)?;
    (at.elapsed() < ACCESS_CACHE_TTL).then(|| a.clone())
}

fn remember(a: &SandboxAccess) {
    {
        let mut map = ACCESS_CACHE.lock();
        if map.len() >= ACCESS_CACHE_MAX {
            map.clear();
        }
        map.insert(a.sandbox_id.clone(), (a.clone(), std::time::Instant::now()));
    }
}

/// Stores credentials (replacing any) and uses them from now on.
pub async fn store_access(m: &Manager, a: &SandboxAccess) -> Result<(), CoreError> {
    m.store.put_access(a).await.map_err(|e| match e {
        sandpit_store::StoreError::NotFound(_) => CoreError::sandbox_not_found(&a.sandbox_id),
        other => other.into(),
    })?;
    remember(a);
    Ok(())
}

/// The proxy credentials of sandbox `id` (made on first use for sandboxes that have
/// none: secure, private). This is what E2B's control plane returns as
/// `envdAccessToken` / `trafficAccessToken`. Does not check the owner: callers do.
pub async fn access(m: &Manager, id: &str) -> Result<SandboxAccess, CoreError> {
    if let Some(a) = cached(id) {
        return Ok(a);
    }
    let a = match m.store.get_access(id).await? {
        Some(a) => a,
        None => m
            .store
            .ensure_access(&fresh_access(id, true, false))
            .await
            .map_err(|e| match e {
                sandpit_store::StoreError::NotFound(_) => CoreError::sandbox_not_found(id),
                other => other.into(),
            })?,
    };
    remember(&a);
    Ok(a)
}

/// Gives a newly created (or newly claimed) sandbox new credentials and its exposure.
pub async fn on_create(
    m: &Manager,
    id: &str,
    secure: Option<bool>,
    public: Option<bool>,
) -> Result<SandboxAccess, CoreError> {
    let a = fresh_access(id, secure.unwrap_or(true), public.unwrap_or(false));
    store_access(m, &a).await?;
    Ok(a)
}

/// A fork gets tokens of its own and its source's exposure.
pub async fn inherit(m: &Manager, from: &str, to: &str) -> Result<(), CoreError> {
    let src = access(m, from).await?;
    store_access(m, &fresh_access(to, src.secure, src.public)).await
}

/// Fills the owner-only proxy fields of sandbox views.
pub async fn with_access(m: &Manager, views: &mut [sandpit_api::Sandbox]) {
    let ids: Vec<String> = views.iter().map(|v| v.id.clone()).collect();
    let mut found: std::collections::HashMap<String, SandboxAccess> =
        match m.store.get_access_many(&ids).await {
            Ok(list) => list
                .into_iter()
                .map(|a| (a.sandbox_id.clone(), a))
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "reading sandbox credentials failed");
                return;
            }
        };
    for v in views.iter_mut() {
        let live = v.state.parse::<SandboxState>().is_ok_and(|s| !s.is_final());
        if !found.contains_key(&v.id)
            && live
            && let Ok(a) = access(m, &v.id).await
        {
            found.insert(v.id.clone(), a);
        }
        if let Some(a) = found.get_mut(&v.id) {
            if !v.isolated {
                enforce_unisolated(a);
            }
            v.secure = a.secure;
            v.public = a.public;
            v.envd_access_token = Some(a.envd_token.clone());
            v.traffic_access_token = Some(a.traffic_token.clone());
        }
    }
}
