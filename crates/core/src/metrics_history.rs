//! Per-sandbox metrics history: a sampler that reads every running sandbox's counters
//! every few seconds (`[metrics]`) and keeps them in the store for a while, and the reads
//! the API serves from it.
//!
//! One pass costs one store read (the live sandboxes), one blocking task that reads each
//! running sandbox's cgroup counters (`Runtime::stats`, the same reading `/stats` and
//! metering use), its writable layer's `statfs` and, once for all, the host's interface
//! counters, and one write transaction. A CPU share needs two readings: a sandbox's first
//! reading after it starts running (created, resumed, woken, claimed) only primes the
//! sampler, so no sample ever covers time the sandbox was not running, and a paused or
//! hibernated sandbox has no samples at all.

use crate::error::CoreError;
use crate::manager::{Manager, handle_of, now_ms};
use crate::pools::POOL_OWNER;
use crate::usage::disk_usage;
use sandpit_runtime::{Runtime, SandboxHandle, Stats};
use sandpit_store::{MetricSample, SandboxState};
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Accepted `[metrics] sample_interval_secs`.
pub const INTERVAL_RANGE: (u64, u64) = (1, 3600);
/// Accepted `[metrics] retention_secs` (and at least the interval).
pub const RETENTION_RANGE: (u64, u64) = (1, 90 * 24 * 3600);
/// Most samples one history read answers with; a client pages on with a later start.
pub const MAX_POINTS: u32 = 20_000;
/// Most sandboxes one batch read names.
pub const MAX_BATCH: usize = 100;
/// Longest time between two prunes.
const PRUNE_EVERY_MS: i64 = 60_000;

/// The `[metrics]` section of the daemon's config file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Whether running sandboxes are sampled at all (default on).
    pub enabled: bool,
    /// Seconds between two samples of a sandbox (default 5).
    pub sample_interval_secs: u64,
    /// Seconds a sample is kept (default one day).
    pub retention_secs: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            sample_interval_secs: 5,
            retention_secs: 24 * 3600,
        }
    }
}

/// Samples of one sandbox in a time range.
#[derive(Debug, Clone)]
pub struct History {
    /// Oldest first.
    pub samples: Vec<MetricSample>,
    /// Whether the range holds more than [`MAX_POINTS`] samples (those after the last one
    /// given are left out).
    pub truncated: bool,
}

/// What the sampler remembers of a sandbox from its previous reading.
#[derive(Debug, Clone, Copy)]
struct Prev {
    /// The record's transition count then: any state change since restarts the pairing.
    version: i64,
    cpu_ns: u64,
    at: Instant,
}

/// One sandbox's counters as read in a pass.
#[derive(Debug, Clone)]
struct Reading {
    id: String,
    version: i64,
    at_ms: i64,
    at: Instant,
    cpu_millis: i64,
    memory_limit: i64,
    disk_limit: i64,
    stats: Stats,
    /// Used and total bytes of the writable layer, when measurable.
    disk: Option<(u64, u64)>,
    /// Received and sent bytes of its network link, as the sandbox sees them.
    net: Option<(u64, u64)>,
}

/// The sampler's state between passes.
pub struct Sampler {
    cfg: MetricsConfig,
    prev: HashMap<String, Prev>,
    last_prune_ms: i64,
}

/// A sandbox to read: its id, record version, limits, runtime and handle.
struct Target {
    id: String,
    version: i64,
    cpu_millis: i64,
    memory_limit: i64,
    disk_limit: i64,
    rt: Arc<dyn Runtime>,
    h: SandboxHandle,
}

impl Sampler {
    /// A sampler with nothing primed.
    pub fn new(cfg: MetricsConfig) -> Self {
        Self {
            cfg,
            prev: HashMap::new(),
            last_prune_ms: 0,
        }
    }

    /// One pass: reads every running sandbox, writes the samples in one transaction and
    /// prunes what is past the retention when due. Returns how many samples were kept.
    pub async fn pass(&mut self, m: &Manager) -> u64 {
        let live = match m.store.live_sandboxes().await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "listing sandboxes to sample failed");
                return 0;
            }
        };
        let targets: Vec<Target> = live
            .into_iter()
            .filter(|r| r.owner != POOL_OWNER && r.state == SandboxState::Running)
            .filter_map(|r| {
                let rt = m.runtime(&r.runtime).ok()?.clone();
                if !rt.capabilities().stats {
                    return None;
                }
                let h = handle_of(&r)?;
                Some(Target {
                    id: r.id,
                    version: r.version,
                    cpu_millis: r.cpu_millis,
                    memory_limit: r.memory_bytes,
                    disk_limit: r.disk_bytes,
                    rt,
                    h,
                })
            })
            .collect();
        let readings = if targets.is_empty() {
            Vec::new()
        } else {
            tokio::task::spawn_blocking(move || read_all(&targets))
                .await
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "the metrics reading task failed");
                    Vec::new()
                })
        };
        let samples = self.samples(readings);
        let kept = match m.store.record_metrics(&samples).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, samples = samples.len(), "writing metrics failed");
                0
            }
        };
        self.prune_if_due(m, now_ms()).await;
        kept
    }

    /// Turns readings into samples: a sandbox read in the previous pass in the same state
    /// run gets a sample; one new (or changed state since, or whose counter went back) is
    /// primed. Sandboxes not read this pass are forgotten.
    fn samples(&mut self, readings: Vec<Reading>) -> Vec<MetricSample> {
        let mut next = HashMap::with_capacity(readings.len());
        let mut out = Vec::with_capacity(readings.len());
        for r in readings {
            if let Some(p) = self.prev.get(&r.id)
                && p.version == r.version
                && r.stats.cpu_usage_ns >= p.cpu_ns
                && r.at > p.at
            {
                out.push(sample_of(&r, p));
            }
            next.insert(
                r.id.clone(),
                Prev {
                    version: r.version,
                    cpu_ns: r.stats.cpu_usage_ns,
                    at: r.at,
                },
            );
        }
        self.prev = next;
        out
    }

    async fn prune_if_due(&mut self, m: &Manager, now: i64) {
        let retention_ms =
            i64::try_from(self.cfg.retention_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        if now - self.last_prune_ms < retention_ms.min(PRUNE_EVERY_MS) {
            return;
        }
        self.last_prune_ms = now;
        match m
            .store
            .prune_metrics(now.saturating_sub(retention_ms))
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::debug!(removed = n, "old metrics pruned"),
            Err(e) => tracing::warn!(error = %e, "pruning metrics failed"),
        }
    }
}

/// The sample of a reading paired with the previous one.
fn sample_of(r: &Reading, p: &Prev) -> MetricSample {
    let cpu_millis = r.cpu_millis.max(1);
    let wall_ns = r.at.duration_since(p.at).as_nanos() as f64;
    let used_ns = (r.stats.cpu_usage_ns - p.cpu_ns) as f64;
    // A share of the sandbox's CPU limit: 100 is the whole limit in use.
    let pct = used_ns / (wall_ns * cpu_millis as f64 / 1000.0) * 100.0;
    let cache = r.stats.memory_cache_bytes.min(r.stats.memory_current_bytes);
    let (disk_used, disk_total) = r.disk.unwrap_or((0, r.disk_limit.max(0) as u64));
    let (rx, tx) = r.net.unwrap_or((0, 0));
    let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    MetricSample {
        sandbox_id: r.id.clone(),
        at_ms: r.at_ms,
        cpu_count: (cpu_millis + 999) / 1000,
        cpu_used_pct: if pct.is_finite() {
            pct.clamp(0.0, 100.0)
        } else {
            0.0
        },
        mem_used: int(r.stats.memory_current_bytes - cache),
        mem_total: r.memory_limit.max(0),
        mem_cache: int(cache),
        disk_used: int(disk_used),
        disk_total: int(disk_total),
        net_rx: int(rx),
        net_tx: int(tx),
    }
}

/// Reads every target (on a blocking thread).
fn read_all(targets: &[Target]) -> Vec<Reading> {
    let links = if targets.iter().any(|t| t.h.net.is_some()) {
        match std::fs::read_to_string("/proc/self/net/dev") {
            Ok(text) => parse_net_dev(&text),
            Err(e) => {
                tracing::debug!(error = %e, "reading interface counters failed");
                HashMap::new()
            }
        }
    } else {
        HashMap::new()
    };
    targets
        .iter()
        .filter_map(|t| {
            let stats = match t.rt.stats(&t.h) {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(id = %t.id, error = %e, "reading a sandbox's counters failed");
                    return None;
                }
            };
            let net =
                t.h.net
                    .as_ref()
                    .and_then(|n| links.get(&n.host_if))
                    // The host end receives what the sandbox sends.
                    .map(|&(host_rx, host_tx)| (host_tx, host_rx));
            Some(Reading {
                id: t.id.clone(),
                version: t.version,
                at_ms: now_ms(),
                at: Instant::now(),
                cpu_millis: t.cpu_millis,
                memory_limit: t.memory_limit,
                disk_limit: t.disk_limit,
                stats,
                disk: disk_usage(&t.h),
                net,
            })
        })
        .collect()
}

/// Received and sent bytes of each interface in a `/proc/net/dev` text.
fn parse_net_dev(text: &str) -> HashMap<String, (u64, u64)> {
    text.lines()
        .filter_map(|line| {
            let (name, rest) = line.split_once(':')?;
            let fields: Vec<u64> = rest
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?;
            // Eight receive columns, then the sent bytes.
            let (rx, tx) = (*fields.first()?, *fields.get(8)?);
            Some((name.trim().to_string(), (rx, tx)))
        })
        .collect()
}

/// Starts the sampler (when `[metrics]` has it on); it runs until the daemon exits.
pub fn start(m: &Arc<Manager>, cfg: MetricsConfig) {
    if !cfg.enabled {
        tracing::info!("sandbox metrics history off");
        return;
    }
    let m = m.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(cfg.sample_interval_secs.max(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sampler = Sampler::new(cfg);
        loop {
            tick.tick().await;
            sampler.pass(&m).await;
        }
    });
}

impl Manager {
    /// A sandbox of `owner` that callers can see, without counting the read as activity
    /// (reading its metrics must not keep it from idling out).
    async fn visible(&self, owner: &str, id: &str) -> Result<(), CoreError> {
        match self.store.get_sandbox(id).await? {
            Some(r) if r.owner == owner && r.state != SandboxState::Stopping => Ok(()),
            _ => Err(CoreError::sandbox_not_found(id)),
        }
    }

    /// The samples of one of `owner`'s sandboxes taken in `[start_ms, end_ms)`, oldest
    /// first, at most [`MAX_POINTS`].
    pub async fn metrics_history(
        &self,
        owner: &str,
        id: &str,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<History, CoreError> {
        if start_ms < 0 || end_ms < 0 {
            return Err(CoreError::invalid("start and end must not be negative"));
        }
        if end_ms < start_ms {
            return Err(CoreError::invalid(format!(
                "end ({end_ms}) is before start ({start_ms})"
            )));
        }
        self.visible(owner, id).await?;
        let mut samples = self
            .store
            .metrics_range(id, start_ms, end_ms, MAX_POINTS + 1)
            .await?;
        let truncated = samples.len() > MAX_POINTS as usize;
        samples.truncate(MAX_POINTS as usize);
        Ok(History { samples, truncated })
    }

    /// The newest sample of each of `ids` that is `owner`'s and has one (others are left
    /// out, as a listing leaves out what the caller cannot see).
    pub async fn latest_metrics(
        &self,
        owner: &str,
        ids: &[String],
    ) -> Result<Vec<MetricSample>, CoreError> {
        if ids.len() > MAX_BATCH {
            return Err(CoreError::invalid(format!(
                "at most {MAX_BATCH} sandboxes at once, not {}",
                ids.len()
            )));
        }
        let mut out = Vec::new();
        for id in ids {
            match self.store.get_sandbox(id).await? {
                Some(r) if r.owner == owner && r.state == SandboxState::Running => {}
                _ => continue,
            }
            if let Some(s) = self.store.latest_metric(id).await? {
                out.push(s);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(id: &str, version: i64, at: Instant, secs: u64, cpu_ns: u64) -> Reading {
        Reading {
            id: id.into(),
            version,
            at_ms: 1_000_000 + secs as i64 * 1000,
            at: at + Duration::from_secs(secs),
            cpu_millis: 500,
            memory_limit: 256 << 20,
            disk_limit: 1 << 30,
            stats: Stats {
                cpu_usage_ns: cpu_ns,
                memory_current_bytes: 100 << 20,
                memory_cache_bytes: 30 << 20,
                ..Default::default()
            },
            disk: Some((4 << 20, 1 << 30)),
            net: Some((700, 300)),
        }
    }

    #[test]
    fn the_first_reading_primes_and_the_next_gives_the_share_of_the_limit() {
        let t0 = Instant::now();
        let mut s = Sampler::new(MetricsConfig::default());
        assert!(s.samples(vec![reading("a", 3, t0, 0, 1_000)]).is_empty());
        // Half a core for 2 s on a 0.5-core limit: the whole limit.
        let out = s.samples(vec![reading("a", 3, t0, 2, 1_000 + 1_000_000_000)]);
        assert_eq!(out.len(), 1);
        let m = &out[0];
        assert!((m.cpu_used_pct - 100.0).abs() < 1e-6, "{}", m.cpu_used_pct);
        assert_eq!(m.cpu_count, 1);
        assert_eq!(m.at_ms, 1_002_000);
        assert_eq!(m.mem_used, 70 << 20, "page cache is reported apart");
        assert_eq!(m.mem_cache, 30 << 20);
        assert_eq!(m.mem_total, 256 << 20);
        assert_eq!((m.disk_used, m.disk_total), (4 << 20, 1 << 30));
        assert_eq!((m.net_rx, m.net_tx), (700, 300));
        // A quarter of the limit over the next 4 s.
        let out = s.samples(vec![reading("a", 3, t0, 6, 1_000 + 1_500_000_000)]);
        assert!((out[0].cpu_used_pct - 25.0).abs() < 1e-6);
    }

    #[test]
    fn a_state_change_or_a_gap_in_running_restarts_the_pairing() {
        let t0 = Instant::now();
        let mut s = Sampler::new(MetricsConfig::default());
        s.samples(vec![reading("a", 1, t0, 0, 0)]);
        // Paused and resumed between two passes: the record's version moved.
        assert!(s.samples(vec![reading("a", 3, t0, 5, 10)]).is_empty());
        assert_eq!(s.samples(vec![reading("a", 3, t0, 10, 20)]).len(), 1);
        // Not running in one pass (paused): forgotten, primed again afterwards.
        assert!(s.samples(vec![]).is_empty());
        assert!(s.samples(vec![reading("a", 3, t0, 20, 30)]).is_empty());
        // A counter that went back (a new cgroup) primes instead of a negative share.
        assert!(s.samples(vec![reading("a", 3, t0, 25, 5)]).is_empty());
        assert_eq!(s.samples(vec![reading("a", 3, t0, 30, 6)]).len(), 1);
    }

    #[test]
    fn shares_stay_in_range_and_limits_round_up_to_whole_cpus() {
        let t0 = Instant::now();
        let mut s = Sampler::new(MetricsConfig::default());
        let mut r = reading("a", 1, t0, 0, 0);
        r.cpu_millis = 1500;
        r.stats.memory_cache_bytes = u64::MAX;
        r.disk = None;
        r.net = None;
        s.samples(vec![r.clone()]);
        r.at += Duration::from_secs(1);
        // More CPU time than the limit allows (accounting jitter): capped at 100.
        r.stats.cpu_usage_ns = 10_000_000_000;
        let m = &s.samples(vec![r])[0];
        assert_eq!(m.cpu_used_pct, 100.0);
        assert_eq!(m.cpu_count, 2);
        assert_eq!(m.mem_used, 0, "cache never exceeds what is in use");
        assert_eq!((m.disk_used, m.disk_total), (0, 1 << 30));
        assert_eq!((m.net_rx, m.net_tx), (0, 0));
    }

    /// A pass over the manager: only running sandboxes of owners are read, a pause
    /// leaves a gap, the history is the owner's alone and goes with the sandbox.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn passes_sample_running_sandboxes_only_and_reads_are_owner_checked() {
        use crate::testing::Bed;
        let bed = Bed::new().await;
        let (m, fake) = (&bed.m, &bed.fake);
        let a = m.create("alice", Default::default()).await.unwrap();
        let b = m.create("alice", Default::default()).await.unwrap();
        let mut s = Sampler::new(MetricsConfig::default());
        let mut cpu = 0;
        let mut pass = async |s: &mut Sampler, busy: bool| {
            // `a` is busy (when asked) between passes, more than any limit allows in the
            // time a pass takes, so its share is the whole limit; `b` idles.
            tokio::time::sleep(Duration::from_millis(5)).await;
            if busy {
                cpu += 100_000_000_000;
            }
            fake.set_stats(
                &a.id,
                Stats {
                    cpu_usage_ns: cpu,
                    memory_current_bytes: 5 << 20,
                    ..Default::default()
                },
            );
            s.pass(m).await
        };
        assert_eq!(pass(&mut s, false).await, 0, "the first pass only primes");
        assert_eq!(pass(&mut s, true).await, 2);
        let all = m
            .metrics_history("alice", &a.id, 0, i64::MAX)
            .await
            .unwrap();
        assert_eq!(all.samples.len(), 1);
        assert!(!all.truncated);
        let busy = &all.samples[0];
        assert_eq!(busy.cpu_used_pct, 100.0);
        assert_eq!(busy.mem_used, 5 << 20);
        let idle = m
            .metrics_history("alice", &b.id, 0, i64::MAX)
            .await
            .unwrap();
        assert_eq!(idle.samples[0].cpu_used_pct, 0.0);

        // Paused: no samples, and the first pass after the resume primes again.
        let a = m.pause(&a, true).await.unwrap();
        assert_eq!(pass(&mut s, true).await, 1, "only b");
        m.resume(&a).await.unwrap();
        assert_eq!(pass(&mut s, true).await, 1, "a primes again");
        assert_eq!(pass(&mut s, true).await, 2);
        let a_hist = m
            .metrics_history("alice", &a.id, 0, i64::MAX)
            .await
            .unwrap();
        assert_eq!(a_hist.samples.len(), 2);
        let after = a_hist.samples[0].at_ms;
        assert_eq!(
            m.metrics_history("alice", &a.id, after, after + 1)
                .await
                .unwrap()
                .samples
                .len(),
            1
        );

        // Another owner sees nothing, and bad ranges are refused.
        for id in [&a.id, &b.id, &"nosuch".to_string()] {
            assert!(matches!(
                m.metrics_history("bob", id, 0, i64::MAX).await.unwrap_err(),
                CoreError::SandboxNotFound(_)
            ));
        }
        assert!(matches!(
            m.metrics_history("alice", &a.id, 10, 5).await.unwrap_err(),
            CoreError::Invalid(_)
        ));
        assert!(matches!(
            m.metrics_history("alice", &a.id, -1, 5).await.unwrap_err(),
            CoreError::Invalid(_)
        ));
        let ids = vec![a.id.clone(), b.id.clone(), "nosuch".to_string()];
        assert_eq!(m.latest_metrics("alice", &ids).await.unwrap().len(), 2);
        assert!(m.latest_metrics("bob", &ids).await.unwrap().is_empty());
        let many = vec![a.id.clone(); MAX_BATCH + 1];
        assert!(m.latest_metrics("alice", &many).await.is_err());

        // Deleted: its history goes with its record.
        m.destroy(&b).await.unwrap();
        m.drain_teardowns(Duration::from_secs(5)).await;
        assert!(m.store.latest_metric(&b.id).await.unwrap().is_none());
        assert_eq!(pass(&mut s, true).await, 1);
    }

    #[test]
    fn interface_counters_are_parsed_from_proc_net_dev() {
        let text = "Inter-|   Receive                                                |  Transmit\n \
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    \
 lo: 1234      10    0    0    0     0          0         0     1234      10    0    0    0     0       0          0\n\
spv0a1b2:  900 5 0 0 0 0 0 0 4200 7 0 0 0 0 0 0\n\
broken: 1 2 x\n";
        let got = parse_net_dev(text);
        assert_eq!(got.get("lo"), Some(&(1234, 1234)));
        assert_eq!(got.get("spv0a1b2"), Some(&(900, 4200)));
        assert!(!got.contains_key("broken"));
        assert_eq!(got.len(), 2);
    }
}
