//! Running warm pools: creating, resizing and deleting them (from the API or the config
//! file), and the loop that keeps each filled to its size within the host's limits.

use crate::error::CoreError;
use crate::manager::*;
use crate::pools::{POOL_OWNER, PoolKey, PoolView};
use crate::sandbox_delete::wait_for_zero;
use sandpit_api::PoolSpec;
use sandpit_store::PoolRecord;
use sandpit_store::SandboxState;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The host's memory (`MemTotal` of `/proc/meminfo`), in bytes.
pub(crate) fn host_memory_bytes() -> Result<u64, CoreError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| CoreError::Io {
        context: "read /proc/meminfo".into(),
        source: e,
    })?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib.saturating_mul(1024))
        .ok_or_else(|| CoreError::internal("no MemTotal in /proc/meminfo"))
}

/// Memory the idle sandboxes of `pools` hold at their sizes, leaving out pool `except`.
fn committed_bytes<'a>(pools: impl Iterator<Item = &'a PoolRecord>, except: &str) -> u64 {
    pools
        .filter(|p| p.name != except)
        .map(|p| (p.size.max(0) as u64).saturating_mul(p.memory_bytes.max(0) as u64))
        .fold(0u64, u64::saturating_add)
}

impl Manager {
    /// Refuses `size` sandboxes of `memory_bytes` for pool `name` when that is over the
    /// configured maximum or more than the host's memory holds next to the pools in
    /// `others` (400 and 409 at the API).
    pub(crate) fn check_pool_fits<'a>(
        &self,
        name: &str,
        size: u32,
        memory_bytes: u64,
        others: impl Iterator<Item = &'a PoolRecord>,
    ) -> Result<(), CoreError> {
        crate::pools::check_pool_limits(
            &self.cfg.pool_limits,
            size,
            memory_bytes,
            committed_bytes(others, name),
            host_memory_bytes()?,
        )
        .map_err(CoreError::from)
    }

    /// Validates a pool definition into a store record.
    pub(crate) async fn pool_record(
        &self,
        spec: &PoolSpec,
        source: &str,
    ) -> Result<PoolRecord, CoreError> {
        if !pool_name_ok(&spec.name) {
            return Err(CoreError::invalid(
                "pool name must be 1 to 64 characters of [a-zA-Z0-9_-]",
            ));
        }
        let plan = self
            .plan(
                spec.template.as_deref(),
                spec.runtime.as_deref(),
                &spec.limits,
            )
            .await?;
        let l = plan.key.limits;
        Ok(PoolRecord {
            name: spec.name.clone(),
            template: plan.key.template,
            runtime: plan.key.runtime,
            cpu_millis: l.cpu_millis as i64,
            memory_bytes: l.memory_bytes as i64,
            disk_bytes: l.disk_bytes as i64,
            max_processes: l.max_processes as i64,
            size: spec.size as i64,
            source: source.to_string(),
            hits: 0,
            misses: 0,
            created_at_ms: now_ms(),
        })
    }

    /// Creates a pool through the API; it fills in the background.
    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<PoolView, CoreError> {
        let def = self.pool_record(spec, "api").await?;
        let others: Vec<PoolRecord> = self.pools.views().into_iter().map(|v| v.def).collect();
        self.check_pool_fits(&def.name, spec.size, def.memory_bytes as u64, others.iter())?;
        let key = PoolKey::of(&def);
        if let Some(other) = self
            .pools
            .views()
            .into_iter()
            .find(|v| PoolKey::of(&v.def) == key)
        {
            return Err(CoreError::conflict(format!(
                "pool {} already keeps sandboxes of this template, runtime and limits",
                other.def.name
            )));
        }
        self.store.insert_pool(&def).await?;
        let stale = self.pools.define(def);
        self.destroy_ids(stale).await;
        self.pool_wake.notify_one();
        self.pools
            .view(&spec.name)
            .ok_or_else(|| CoreError::internal("pool vanished"))
    }

    /// Changes how many idle sandboxes a pool keeps; extra idle ones are destroyed.
    pub async fn resize_pool(&self, name: &str, size: u32) -> Result<PoolView, CoreError> {
        let defs: Vec<PoolRecord> = self.pools.views().into_iter().map(|v| v.def).collect();
        // A pool the store has but that is not in use (another pool keeps its kind) holds
        // no memory: only the maximum applies to it.
        let (current, memory) = defs
            .iter()
            .find(|d| d.name == name)
            .map_or((0, 0), |d| (d.size, d.memory_bytes as u64));
        // Shrinking is always allowed, even on a host that has lost memory since.
        if i64::from(size) > current {
            self.check_pool_fits(name, size, memory, defs.iter())?;
        }
        if !self.store.resize_pool(name, size as i64).await? {
            return Err(CoreError::not_found(format!("pool {name} not found")));
        }
        let extra = self.pools.resize(name, size).unwrap_or_default();
        self.destroy_ids(extra).await;
        self.pool_wake.notify_one();
        self.pools
            .view(name)
            .ok_or_else(|| CoreError::not_found(format!("pool {name} not found")))
    }

    /// Removes a pool and destroys its idle sandboxes (claimed ones stay their owners').
    pub async fn delete_pool(&self, name: &str) -> Result<(), CoreError> {
        if !self.store.delete_pool(name).await? {
            return Err(CoreError::not_found(format!("pool {name} not found")));
        }
        let members = self.pools.remove(name).unwrap_or_default();
        self.destroy_ids(members).await;
        Ok(())
    }

    /// After reconcile: applies the config file's pools (which replace earlier config
    /// pools), loads every pool, adopts surviving idle members and destroys the rest.
    /// A config pool over the size limits fails it (`Invalid` over the maximum,
    /// `Conflict` beyond the host's memory) before anything is changed: the daemon does
    /// not start with it.
    pub async fn load_pools(&self, from_config: &[PoolSpec]) -> Result<(), CoreError> {
        let declared: Vec<String> = from_config.iter().map(|s| s.name.clone()).collect();
        // What the pools will hold: the API's pools and the file's, not the file's old ones.
        let mut kept: Vec<PoolRecord> = self
            .store
            .list_pools()
            .await?
            .into_iter()
            .filter(|p| p.source != "config")
            .collect();
        let mut accepted = Vec::new();
        for spec in from_config {
            // A refused entry (say, its template is missing just now) keeps what the store
            // has: only a pool taken out of the file is removed.
            match self.pool_record(spec, "config").await {
                Ok(def) => {
                    let in_file = |m: String| format!("pool {} in the config file: {m}", spec.name);
                    self.check_pool_fits(
                        &def.name,
                        spec.size,
                        def.memory_bytes as u64,
                        kept.iter(),
                    )
                    .map_err(|e| match e {
                        CoreError::Invalid(m) => CoreError::Invalid(in_file(m)),
                        CoreError::Conflict(m) => CoreError::Conflict(in_file(m)),
                        other => other,
                    })?;
                    kept.push(def.clone());
                    accepted.push(def);
                }
                Err(e) => {
                    tracing::error!(pool = %spec.name, error = %e.chain(), "pool in the config file refused")
                }
            }
        }
        for def in &accepted {
            self.store.upsert_pool(def).await?;
        }
        let mut keys: Vec<PoolKey> = Vec::new();
        for def in self.store.list_pools().await? {
            if def.source == "config" && !declared.contains(&def.name) {
                tracing::info!(pool = %def.name, "pool removed from the config file");
                self.store.delete_pool(&def.name).await?;
                continue;
            }
            let key = PoolKey::of(&def);
            if keys.contains(&key) {
                tracing::error!(pool = %def.name, "another pool keeps sandboxes of the same template, runtime and limits; this one is not used");
                continue;
            }
            keys.push(key);
            self.pools.define(def);
        }
        match self.store.delete_final_pool_records().await {
            Ok(n) if n > 0 => tracing::info!(n, "removed records of dead idle pool sandboxes"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "removing records of dead pool sandboxes failed"),
        }
        let mut unwanted = Vec::new();
        let mut members: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for rec in self.store.live_sandboxes().await? {
            if rec.owner != POOL_OWNER {
                continue;
            }
            // A member is adopted only into a pool whose definition it still matches (the
            // config file may have changed the limits while the daemon was down).
            let own_key = PoolKey::of_sandbox(&rec);
            let pool = rec.pool.clone().unwrap_or_default();
            let fits = self.pools.key(&pool).is_some_and(|k| k == own_key);
            if fits && rec.state == SandboxState::Running {
                members.entry(pool).or_default().push(rec.id);
            } else {
                unwanted.push(rec.id);
            }
        }
        for (pool, ids) in members {
            let n = ids.len();
            let extra = self.pools.adopt(&pool, ids);
            tracing::info!(
                pool,
                adopted = n - extra.len(),
                "re-adopted idle pool sandboxes"
            );
            unwanted.extend(extra);
        }
        self.destroy_ids(unwanted).await;
        self.pool_wake.notify_one();
        Ok(())
    }

    /// Keeps every pool at its size, a few starts at a time, until the daemon stops.
    pub async fn run_pools(self: Arc<Self>) {
        let mut held_since: Option<std::time::Instant> = None;
        loop {
            // A claimed sandbox's caller usually runs a command right away; a refill
            // starting at that moment would take the CPU from it. Hold refills while claims
            // are recent, but never for long, so that a stream of claims cannot starve them.
            let recent = self
                .last_claim
                .lock()
                .map(|at| at.elapsed())
                .filter(|e| *e < crate::pools::REFILL_QUIET);
            if let Some(elapsed) = recent {
                let since = *held_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() < crate::pools::REFILL_MAX_HOLD {
                    tokio::time::sleep(crate::pools::REFILL_QUIET - elapsed).await;
                    continue;
                }
            }
            held_since = None;
            if self.pools_stopped.load(Ordering::Acquire) {
                return;
            }
            let budget = crate::pools::REFILL_CONCURRENCY
                .saturating_sub(self.refilling.load(Ordering::Acquire));
            for refill in self.pools.plan_refills(budget) {
                self.refilling.fetch_add(1, Ordering::AcqRel);
                let me = self.clone();
                tokio::spawn(async move {
                    let id = me.refill(&refill).await;
                    if !me.pools.started(&refill, id.clone())
                        && let Some(id) = id
                    {
                        me.destroy_ids(vec![id]).await;
                    }
                    me.refilling.fetch_sub(1, Ordering::AcqRel);
                    me.pool_wake.notify_one();
                });
            }
            // Woken by claims and finished refills; the timeout retries after a backoff.
            let _ =
                tokio::time::timeout(Duration::from_millis(500), self.pool_wake.notified()).await;
        }
    }

    /// Starts one idle member of a pool.
    pub(crate) async fn refill(&self, refill: &crate::pools::Refill) -> Option<String> {
        let k = &refill.key;
        let spec = sandpit_api::LimitsSpec {
            cpu_millis: Some(k.limits.cpu_millis),
            memory_bytes: Some(k.limits.memory_bytes),
            disk_bytes: Some(k.limits.disk_bytes),
            max_processes: Some(k.limits.max_processes),
        };
        let started = async {
            let plan = self
                .plan(Some(&k.template), Some(&k.runtime), &spec)
                .await?;
            self.cold_create(NewSandbox {
                owner: POOL_OWNER,
                pool: Some(refill.pool.clone()),
                plan,
                env: BTreeMap::new(),
                secret_env: Default::default(),
                metadata: BTreeMap::new(),
                workdir: DEFAULT_WORKDIR.into(),
                // Idle pool members never expire; a claim sets the caller's deadline.
                expires_at_ms: i64::MAX,
                life: Default::default(),
            })
            .await
        };
        match started.await {
            Ok(rec) => Some(rec.id),
            Err(e) => {
                tracing::warn!(pool = %refill.pool, error = %e.chain(), "refilling a pool failed");
                None
            }
        }
    }

    /// At shutdown: starts no more refills and waits (up to `max`) for those under way,
    /// so that none finishes unrecorded or for a pool deleted meanwhile after the daemon
    /// has gone (their own teardowns are then awaited by [`Self::drain_teardowns`]).
    pub async fn stop_pools(&self, max: Duration) {
        self.pools_stopped.store(true, Ordering::Release);
        self.pool_wake.notify_one();
        wait_for_zero(&self.refilling, max).await;
    }
}

/// Pool names: 1 to 64 characters of `[a-zA-Z0-9_-]`.
pub fn pool_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}
