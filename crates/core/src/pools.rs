//! Warm pools: per (template, runtime, limits) a number of sandboxes kept started and idle.
//! A matching create takes one from the ready queue (an in-process pop, then a conditional
//! UPDATE in the store, so a sandbox is never handed out twice) and the pool refills in the
//! background. Idle members are ordinary running sandboxes with an empty owner, so restart
//! reconciliation re-adopts or cleans them like any other.

use parking_lot::Mutex;
use sandpit_api::Limits;
use sandpit_store::PoolRecord;
use std::collections::{HashMap, VecDeque};

pub use sandpit_store::POOL_OWNER;

/// Sandboxes started at once to refill pools: each start takes a core for a few ms, and
/// refills must not starve the creates and execs that callers are waiting for.
pub const REFILL_CONCURRENCY: usize = 2;
/// Refills wait until no claim has happened for this long...
pub const REFILL_QUIET: std::time::Duration = std::time::Duration::from_millis(25);
/// ... but hold back no longer than this.
pub const REFILL_MAX_HOLD: std::time::Duration = std::time::Duration::from_millis(250);
/// Pause after a failed refill before the pool tries again.
pub const REFILL_BACKOFF: std::time::Duration = std::time::Duration::from_secs(2);
/// Largest size of one pool, whatever `[pool_limits] max_size` says.
pub const MAX_POOL_SIZE: u32 = 2048;
/// Default of `[pool_limits] max_size`.
pub const DEFAULT_MAX_POOL_SIZE: u32 = 64;

/// Bounds on warm pools (`[pool_limits]` in the config file).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolLimits {
    /// Most idle sandboxes one pool may keep (at most [`MAX_POOL_SIZE`]).
    pub max_size: u32,
}

impl Default for PoolLimits {
    fn default() -> Self {
        Self {
            max_size: DEFAULT_MAX_POOL_SIZE,
        }
    }
}

/// Why a pool of some size was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolLimitError {
    /// Larger than the configured maximum.
    #[error("pool size {size} is over the maximum of {max} ([pool_limits] max_size)")]
    OverMax { size: u32, max: u32 },
    /// Its sandboxes' memory limits do not fit in what the host has left for pools.
    #[error(
        "no capacity for {size} sandboxes of {per_mib} MiB ({need_mib} MiB): the host has \
         {total_mib} MiB of memory and other pools already hold {committed_mib} MiB"
    )]
    NoCapacity {
        size: u32,
        per_mib: u64,
        need_mib: u64,
        total_mib: u64,
        committed_mib: u64,
    },
}

impl From<PoolLimitError> for crate::error::CoreError {
    fn from(e: PoolLimitError) -> Self {
        match e {
            PoolLimitError::OverMax { .. } => Self::Invalid(e.to_string()),
            PoolLimitError::NoCapacity { .. } => Self::Conflict(e.to_string()),
        }
    }
}

/// Checks a pool of `size` sandboxes with `memory_bytes` each against the configured
/// maximum and the host's memory: all pools' idle sandboxes together (`committed_bytes`
/// for the others) may at most reach `mem_total_bytes`, so that an admin's typo cannot
/// start more idle sandboxes than the host could ever run.
pub fn check_pool_limits(
    limits: &PoolLimits,
    size: u32,
    memory_bytes: u64,
    committed_bytes: u64,
    mem_total_bytes: u64,
) -> Result<(), PoolLimitError> {
    let max = limits.max_size.min(MAX_POOL_SIZE);
    if size > max {
        return Err(PoolLimitError::OverMax { size, max });
    }
    if size == 0 {
        return Ok(());
    }
    let need = u128::from(size) * u128::from(memory_bytes);
    if need + u128::from(committed_bytes) > u128::from(mem_total_bytes) {
        let mib = |b: u128| u64::try_from(b >> 20).unwrap_or(u64::MAX);
        return Err(PoolLimitError::NoCapacity {
            size,
            per_mib: memory_bytes >> 20,
            need_mib: mib(need),
            total_mib: mem_total_bytes >> 20,
            committed_mib: committed_bytes >> 20,
        });
    }
    Ok(())
}

/// What a create must match to be served from a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolKey {
    pub template: String,
    pub runtime: String,
    pub limits: Limits,
    /// Whether its sandboxes have `sudo` (pool members never do: a create that asks for
    /// it starts cold).
    pub sudo: bool,
}

impl PoolKey {
    /// The kind of sandbox a record describes (what a pool member must still match).
    pub fn of_sandbox(r: &sandpit_store::SandboxRecord) -> Self {
        PoolKey {
            template: r.template.clone(),
            runtime: r.runtime.clone(),
            limits: Limits {
                cpu_millis: r.cpu_millis as u64,
                memory_bytes: r.memory_bytes as u64,
                disk_bytes: r.disk_bytes as u64,
                max_processes: r.max_processes as u64,
            },
            sudo: r.life.sudo,
        }
    }

    /// The key of a stored pool definition.
    pub fn of(p: &PoolRecord) -> Self {
        PoolKey {
            template: p.template.clone(),
            runtime: p.runtime.clone(),
            limits: Limits {
                cpu_millis: p.cpu_millis as u64,
                memory_bytes: p.memory_bytes as u64,
                disk_bytes: p.disk_bytes as u64,
                max_processes: p.max_processes as u64,
            },
            sudo: false,
        }
    }
}

/// In-memory state of one pool.
#[derive(Debug)]
struct PoolState {
    def: PoolRecord,
    key: PoolKey,
    /// Ids of idle, started members, oldest first.
    ready: VecDeque<String>,
    /// Members being started.
    starting: u32,
    /// After a failed start, no refill before this time (a broken template must not spin).
    retry_at: Option<std::time::Instant>,
    /// Tells a pool from an earlier one of the same name (refills report to the one that
    /// started them).
    generation: u64,
}

impl PoolState {
    fn view(&self) -> PoolView {
        PoolView {
            def: self.def.clone(),
            ready: self.ready.len() as u32,
            starting: self.starting,
        }
    }
}

/// A pool's definition and live counts.
#[derive(Debug, Clone)]
pub struct PoolView {
    pub def: PoolRecord,
    pub ready: u32,
    pub starting: u32,
}

/// A refill the caller should start now.
#[derive(Debug, Clone)]
pub struct Refill {
    pub pool: String,
    pub key: PoolKey,
    generation: u64,
}

/// The pools of this daemon.
#[derive(Debug, Default)]
pub struct Pools {
    inner: Mutex<HashMap<String, PoolState>>,
    generations: std::sync::atomic::AtomicU64,
}

impl Pools {
    fn lock(&self) -> parking_lot::MutexGuard<'_, HashMap<String, PoolState>> {
        // A panic while holding this lock cannot leave the map half-updated in a way that
        // matters more than losing pooling, so a poisoned lock is taken over.
        self.inner.lock()
    }

    /// Adds or redefines a pool; when its key changes, the old idle members are returned
    /// for the caller to destroy (and refills under way for the old key are not wanted).
    pub fn define(&self, def: PoolRecord) -> Vec<String> {
        let key = PoolKey::of(&def);
        let generation = self
            .generations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut pools = self.lock();
        match pools.get_mut(&def.name) {
            Some(p) if p.key == key => {
                p.def = def;
                Vec::new()
            }
            Some(p) => {
                p.def = def;
                p.key = key;
                p.generation = generation;
                p.starting = 0;
                p.ready.drain(..).collect()
            }
            None => {
                pools.insert(
                    def.name.clone(),
                    PoolState {
                        def,
                        key,
                        ready: VecDeque::new(),
                        starting: 0,
                        retry_at: None,
                        generation,
                    },
                );
                Vec::new()
            }
        }
    }

    /// Forgets a pool and returns its idle members for the caller to destroy.
    pub fn remove(&self, name: &str) -> Option<Vec<String>> {
        self.lock()
            .remove(name)
            .map(|p| p.ready.into_iter().collect())
    }

    /// Sets a pool's size; returns the idle members now beyond it, for the caller to destroy.
    pub fn resize(&self, name: &str, size: u32) -> Option<Vec<String>> {
        let mut pools = self.lock();
        let p = pools.get_mut(name)?;
        p.def.size = size as i64;
        let excess = p.ready.len().saturating_sub(size as usize);
        Some(p.ready.drain(..excess).collect())
    }

    /// The pool whose key matches, and (if it has one) an idle member taken out of it.
    /// `None` when no pool has this key.
    pub fn take(&self, key: &PoolKey) -> Option<(String, Option<String>)> {
        let mut pools = self.lock();
        let p = pools.values_mut().find(|p| &p.key == key)?;
        Some((p.def.name.clone(), p.ready.pop_front()))
    }

    /// Puts a member back at the front (its claim did not go through); false if the pool
    /// is gone, and the caller must destroy the member.
    pub fn put_back(&self, pool: &str, id: String) -> bool {
        match self.lock().get_mut(pool) {
            Some(p) => {
                p.ready.push_front(id);
                true
            }
            None => false,
        }
    }

    /// The key of a pool, if it exists.
    pub fn key(&self, pool: &str) -> Option<PoolKey> {
        self.lock().get(pool).map(|p| p.key.clone())
    }

    /// Drops a sandbox from every ready queue (it died or is being destroyed).
    pub fn forget(&self, id: &str) {
        for p in self.lock().values_mut() {
            p.ready.retain(|r| r != id);
        }
    }

    /// Refills to start now, at most `budget`; each is counted as starting.
    pub fn plan_refills(&self, budget: usize) -> Vec<Refill> {
        let mut pools = self.lock();
        let mut out = Vec::new();
        let now = std::time::Instant::now();
        // Round-robin, so one big pool does not hold back a small one.
        loop {
            let before = out.len();
            for p in pools.values_mut() {
                if out.len() >= budget {
                    return out;
                }
                let have = p.ready.len() as i64 + p.starting as i64;
                let waiting = p.retry_at.is_some_and(|t| t > now);
                if have < p.def.size && !waiting {
                    p.starting += 1;
                    out.push(Refill {
                        pool: p.def.name.clone(),
                        key: p.key.clone(),
                        generation: p.generation,
                    });
                }
            }
            if out.len() == before {
                return out;
            }
        }
    }

    /// A refill finished. Returns false if the sandbox is not wanted any more (the pool was
    /// removed, shrunk or redefined meanwhile) and must be destroyed.
    pub fn started(&self, refill: &Refill, id: Option<String>) -> bool {
        let mut pools = self.lock();
        let Some(p) = pools
            .get_mut(&refill.pool)
            .filter(|p| p.generation == refill.generation)
        else {
            return id.is_none();
        };
        p.starting = p.starting.saturating_sub(1);
        let Some(id) = id else {
            p.retry_at = Some(std::time::Instant::now() + REFILL_BACKOFF);
            return true;
        };
        p.retry_at = None;
        if p.ready.len() as i64 >= p.def.size {
            return false;
        }
        p.ready.push_back(id);
        true
    }

    /// Adopts members found running after a restart; returns those not wanted.
    pub fn adopt(&self, pool: &str, ids: Vec<String>) -> Vec<String> {
        let mut pools = self.lock();
        let Some(p) = pools.get_mut(pool) else {
            return ids;
        };
        let mut extra = Vec::new();
        for id in ids {
            if (p.ready.len() as i64) < p.def.size {
                p.ready.push_back(id);
            } else {
                extra.push(id);
            }
        }
        extra
    }

    /// One pool's definition and counts.
    pub fn view(&self, name: &str) -> Option<PoolView> {
        self.lock().get(name).map(PoolState::view)
    }

    /// Every pool, by name.
    pub fn views(&self) -> Vec<PoolView> {
        let mut v: Vec<PoolView> = self.lock().values().map(PoolState::view).collect();
        v.sort_by(|a, b| a.def.name.cmp(&b.def.name));
        v
    }

    /// Adds to the in-memory hit/miss counters shown until the store's copy is re-read.
    pub fn count(&self, name: &str, hit: bool) {
        if let Some(p) = self.lock().get_mut(name) {
            if hit {
                p.def.hits += 1;
            } else {
                p.def.misses += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(name: &str, size: i64, cpu: i64) -> PoolRecord {
        PoolRecord {
            name: name.into(),
            template: "host".into(),
            runtime: "container".into(),
            cpu_millis: cpu,
            memory_bytes: 1 << 29,
            disk_bytes: 1 << 30,
            max_processes: 512,
            size,
            source: "api".into(),
            hits: 0,
            misses: 0,
            created_at_ms: 0,
        }
    }

    #[test]
    fn refills_respect_size_budget_and_fairness() {
        let pools = Pools::default();
        pools.define(def("a", 3, 1000));
        pools.define(def("b", 1, 500));
        let first = pools.plan_refills(2);
        let names: Vec<&str> = first.iter().map(|r| r.pool.as_str()).collect();
        assert_eq!(names.len(), 2);
        assert!(names.contains(&"a") && names.contains(&"b"), "{names:?}");
        // Two more for a, none for b (it has one starting).
        let second = pools.plan_refills(10);
        assert_eq!(second.len(), 2);
        assert!(second.iter().all(|r| r.pool == "a"));
        assert!(pools.plan_refills(10).is_empty());
        let a: Vec<&Refill> = first
            .iter()
            .chain(&second)
            .filter(|r| r.pool == "a")
            .collect();
        assert!(pools.started(a[0], Some("s1".into())));
        assert!(pools.started(a[1], None)); // a failed start frees its place...
        let v = pools.view("a").unwrap();
        assert_eq!((v.ready, v.starting), (1, 1));
        // ... but the pool waits before trying again.
        assert!(pools.plan_refills(10).is_empty());
    }

    #[test]
    fn take_matches_the_key_and_never_hands_out_twice() {
        let pools = Pools::default();
        pools.define(def("a", 2, 1000));
        let key = PoolKey::of(&def("a", 2, 1000));
        let other = PoolKey::of(&def("x", 2, 999));
        assert!(pools.take(&other).is_none());
        assert_eq!(pools.take(&key), Some(("a".into(), None)));
        pools.adopt("a", vec!["s1".into(), "s2".into()]);
        let got: Vec<_> = (0..3).map(|_| pools.take(&key).unwrap().1).collect();
        assert_eq!(got, [Some("s1".into()), Some("s2".into()), None]);
        assert!(pools.put_back("a", "s1".into()));
        assert_eq!(pools.take(&key).unwrap().1.as_deref(), Some("s1"));
        assert!(!pools.put_back("gone", "s9".into()));
    }

    #[test]
    fn shrinking_removing_and_redefining_return_unwanted_members() {
        let pools = Pools::default();
        pools.define(def("a", 3, 1000));
        let refill = pools.plan_refills(1).remove(0);
        assert!(pools.adopt("a", vec!["1".into(), "2".into(), "3".into(), "4".into()]) == ["4"]);
        assert_eq!(pools.resize("a", 1).unwrap(), ["1", "2"]);
        assert_eq!(pools.view("a").unwrap().ready, 1);
        // A refill that finishes after a shrink is not wanted.
        assert!(!pools.started(&refill, Some("5".into())));
        // New limits: the old members no longer match, nor do refills for the old key.
        let old = pools.plan_refills(1);
        assert!(old.is_empty(), "full pool");
        pools.resize("a", 2);
        let old = pools.plan_refills(1).remove(0);
        assert_eq!(pools.define(def("a", 1, 2000)), ["3"]);
        assert!(!pools.started(&old, Some("6".into())));
        assert_eq!(pools.view("a").unwrap().starting, 0);
        pools.adopt("a", vec!["7".into()]);
        pools.forget("7");
        assert_eq!(pools.view("a").unwrap().ready, 0);
        // Removed and made again under the same name: the old pool's refill is not counted.
        let stale = pools.plan_refills(1).remove(0);
        assert_eq!(pools.remove("a"), Some(vec![]));
        assert!(pools.remove("a").is_none());
        pools.define(def("a", 1, 2000));
        assert!(!pools.started(&stale, Some("8".into())));
        assert!(pools.started(&stale, None));
        assert_eq!(pools.view("a").unwrap().starting, 0);
    }

    #[test]
    fn pool_sizes_are_bounded_by_the_maximum_and_the_hosts_memory() {
        const GIB: u64 = 1 << 30;
        let limits = PoolLimits::default();
        assert_eq!(limits.max_size, 64);
        assert_eq!(check_pool_limits(&limits, 64, GIB / 4, 0, 24 * GIB), Ok(()));
        assert_eq!(
            check_pool_limits(&limits, 194, GIB / 4, 0, 1 << 50),
            Err(PoolLimitError::OverMax { size: 194, max: 64 })
        );
        // Exactly full fits; one byte more than the host has does not.
        assert_eq!(
            check_pool_limits(&limits, 8, GIB, 16 * GIB, 24 * GIB),
            Ok(())
        );
        assert!(matches!(
            check_pool_limits(&limits, 8, GIB, 16 * GIB + 1, 24 * GIB),
            Err(PoolLimitError::NoCapacity {
                need_mib: 8192,
                committed_mib: 16384,
                ..
            })
        ));
        // A configured maximum above the hard one is held to it; nothing overflows.
        let huge = PoolLimits { max_size: u32::MAX };
        assert_eq!(
            check_pool_limits(&huge, MAX_POOL_SIZE + 1, 1, 0, u64::MAX),
            Err(PoolLimitError::OverMax {
                size: MAX_POOL_SIZE + 1,
                max: MAX_POOL_SIZE
            })
        );
        assert!(check_pool_limits(&huge, MAX_POOL_SIZE, u64::MAX, u64::MAX, u64::MAX).is_err());
        assert_eq!(check_pool_limits(&limits, 0, u64::MAX, u64::MAX, 0), Ok(()));
    }
}
