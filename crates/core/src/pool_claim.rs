//! Claiming a ready sandbox from a warm pool: compare-and-set in the store hands it to
//! the caller, the agent's `/init` applies the caller's settings; a member that refuses
//! them is destroyed and the create falls back to a cold start.

use crate::manager::*;
use crate::pools::PoolKey;
use sandpit_api::CreateSandboxRequest;
use sandpit_store::Claim;
use sandpit_store::{SandboxRecord, SandboxState};
use std::sync::Arc;

impl Manager {
    /// Takes a ready sandbox from the pool matching `key`, hands it to `owner` and applies
    /// the caller's settings through the agent's `/init`. `None` means start cold.
    pub(crate) async fn claim(
        self: &Arc<Self>,
        owner: &str,
        key: &PoolKey,
        req: &CreateSandboxRequest,
        workdir: &str,
        expires_at_ms: i64,
        life: &sandpit_store::Lifecycle,
    ) -> Option<SandboxRecord> {
        let mut pool_name = None;
        let secret_env = req.secret_env.iter().cloned().collect();
        while let Some((pool, member)) = self.pools.take(key) {
            {
                let mut at = self.last_claim.lock();
                *at = Some(std::time::Instant::now());
            }
            self.pool_wake.notify_one();
            pool_name = Some(pool.clone());
            let Some(id) = member else { break };
            let claim = Claim {
                owner,
                env: &req.env,
                secret_env: &secret_env,
                metadata: &req.metadata,
                expires_at_ms,
                life,
            };
            let rec = match self.store.claim_pooled(&id, &pool, &claim).await {
                Ok(Some(rec)) => rec,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(id, error = %e, "claiming a pooled sandbox failed");
                    if !self.pools.put_back(&pool, id.clone()) {
                        self.destroy_ids(vec![id]).await;
                    }
                    break;
                }
            };
            let init = AgentInit {
                env: &req.env,
                // Pool members start in the default workdir already.
                workdir: (workdir != DEFAULT_WORKDIR).then_some(workdir),
                user: req.user.as_deref(),
            };
            match self.init_agent(&rec, &init).await {
                Ok(()) => {
                    crate::usage::on_state(self, &rec, SandboxState::Running);
                    self.count_pool(&pool, true);
                    tracing::debug!(id, pool, "sandbox claimed from pool");
                    return Some(rec);
                }
                Err(e) => {
                    tracing::warn!(id, pool, error = %e.chain(), "pooled sandbox refused its settings; destroying it");
                    let _ = self.destroy(&rec).await;
                }
            }
        }
        if let Some(pool) = pool_name {
            self.count_pool(&pool, false);
        }
        None
    }

    pub(crate) fn count_pool(self: &Arc<Self>, pool: &str, hit: bool) {
        self.pools.count(pool, hit);
        let (me, pool) = (self.clone(), pool.to_string());
        tokio::spawn(async move {
            let (h, m) = if hit { (1, 0) } else { (0, 1) };
            if let Err(e) = me.store.count_pool(&pool, h, m).await {
                tracing::warn!(pool, error = %e, "counting a pool claim failed");
            }
        });
    }
}
