//! Usage metering: the hooks the manager and the API handlers call, the queue that keeps
//! every usage write off the request path, and the sampler of sandbox counters.
//!
//! Nothing here blocks a request on the store: events go into a bounded queue (dropped
//! with a warning if it is ever full) and one writer task commits them in batches, one
//! transaction per batch, through the store's single writer connection.

use crate::agent_conn::AgentConn;
use crate::manager::{Manager, now_ms};
use crate::pools::POOL_OWNER;
use parking_lot::Mutex;
use sandpit_api::{CommandEvent, RunCommandRequest};
use sandpit_runtime::{Runtime, SandboxHandle};
use sandpit_store::{ExecutionRecord, SandboxRecord, SandboxState, Store, UsageEvent};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Events waiting for the writer; beyond this they are dropped (and counted).
const QUEUE: usize = 1 << 16;
/// Most events written in one transaction.
const BATCH: usize = 1024;
/// How often the counters of running sandboxes are sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(30);
/// Largest answer accepted from an agent's `/rusage`.
pub(crate) const RUSAGE_LIMIT: usize = 4096;

/// Usage-log reasons.
pub const COMMAND: &str = "command";
pub const FILE: &str = "file";
pub const KEEPALIVE: &str = "keepalive";
pub const LEASE: &str = "lease";

// Nearly every message is an event: boxing it would cost an allocation each, for the
// rare flush's sake.
#[allow(clippy::large_enum_variant)]
enum Msg {
    Event(UsageEvent),
    Flush(oneshot::Sender<()>),
}

/// The usage queue; lives in the [`Manager`].
pub struct Usage {
    tx: mpsc::Sender<Msg>,
    rx: Mutex<Option<mpsc::Receiver<Msg>>>,
    dropped: AtomicU64,
}

impl Default for Usage {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        Self {
            tx,
            rx: Mutex::new(Some(rx)),
            dropped: AtomicU64::new(0),
        }
    }
}

impl Usage {
    /// Queues an event without waiting.
    pub fn push(&self, ev: UsageEvent) {
        if let Err(mpsc::error::TrySendError::Full(_)) = self.tx.try_send(Msg::Event(ev)) {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed);
            if n.is_multiple_of(1000) {
                tracing::warn!(dropped = n + 1, "usage queue full; usage events dropped");
            }
        }
    }

    /// Appends a usage-log entry (one line in a handler; never waits).
    pub fn log(&self, owner: &str, sandbox_id: &str, reason: &str, amount: i64, details: &str) {
        self.push(UsageEvent::Log {
            sandbox_id: sandbox_id.to_string(),
            owner: owner.to_string(),
            reason: reason.to_string(),
            at_ms: now_ms(),
            amount,
            details: (!details.is_empty()).then(|| details.to_string()),
        });
    }

    /// Waits (up to `max`) until everything queued before the call is in the store.
    pub async fn flush(&self, max: Duration) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Msg::Flush(done)).await.is_ok() {
            let _ = tokio::time::timeout(max, wait).await;
        }
    }

    /// Commits queued events in batches until the daemon stops.
    async fn run_writer(&self, store: Store, mut rx: mpsc::Receiver<Msg>) {
        let mut batch = Vec::with_capacity(BATCH);
        let mut waiting = Vec::new();
        while let Some(first) = rx.recv().await {
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Event(ev) => batch.push(ev),
                    Msg::Flush(done) => waiting.push(done),
                }
                if batch.len() < BATCH {
                    next = rx.try_recv().ok();
                }
            }
            if let Err(e) = store.record_usage(&batch).await {
                tracing::warn!(error = %e, events = batch.len(), "writing usage failed");
            }
            batch.clear();
            for done in waiting.drain(..) {
                let _ = done.send(());
            }
        }
    }
}

/// Starts the usage writer and the sampler (once, after reconcile).
pub fn start(m: &Arc<Manager>) {
    let Some(rx) = m.usage.rx.lock().take() else {
        return;
    };
    let writer = m.clone();
    tokio::spawn(async move {
        let store = writer.store.clone();
        writer.usage.run_writer(store, rx).await;
    });
    let sampler = m.clone();
    tokio::spawn(async move {
        // What reconcile queued goes in first; then rows whose end was lost in a crash
        // are closed at their last sample.
        sampler.usage.flush(Duration::from_secs(30)).await;
        match sampler.store.live_sandboxes().await {
            Ok(live) => {
                let ids: Vec<String> = live.into_iter().map(|r| r.id).collect();
                match sampler.store.close_orphaned_usage(&ids).await {
                    Ok(n) if n > 0 => {
                        tracing::info!(n, "closed usage of sandboxes that ended unrecorded")
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "closing orphaned usage failed"),
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing live sandboxes failed"),
        }
        loop {
            tokio::time::sleep(SAMPLE_EVERY).await;
            sample_live(&sampler, None).await;
        }
    });
}

/// Counters of one sandbox now, if its runtime keeps them.
fn sample(rt: &dyn Runtime, h: &SandboxHandle, id: &str) -> Option<UsageEvent> {
    if !rt.capabilities().stats {
        return None;
    }
    let s = rt.stats(h).ok()?;
    Some(UsageEvent::Sample {
        sandbox_id: id.to_string(),
        at_ms: now_ms(),
        cpu_raw_ns: i64::try_from(s.cpu_usage_ns).unwrap_or(i64::MAX),
        memory_peak_bytes: i64::try_from(s.memory_peak_bytes).unwrap_or(i64::MAX),
        disk_used_bytes: disk_used(h),
    })
}

/// Bytes used in a container sandbox's writable layer.
pub fn disk_used(h: &SandboxHandle) -> Option<i64> {
    disk_usage(h).and_then(|(used, _)| i64::try_from(used).ok())
}

/// Bytes used in a container sandbox's writable layer, and its size. The sandbox root is
/// an overlay whose `statfs` reports its upper layer, the size-capped tmpfs; it is reached
/// through the agent's `/proc/PID/root` (checked to still be our agent, not a reused pid).
pub fn disk_usage(h: &SandboxHandle) -> Option<(u64, u64)> {
    // Only containers have a writable layer of their own; the process runtime's root
    // is a host directory, whose file system is not the sandbox's.
    h.uid_base?;
    if h.pid <= 0 || !sandpit_runtime::same_process(h.pid, h.pid_start) {
        return None;
    }
    let st = nix::sys::statfs::statfs(format!("/proc/{}/root", h.pid).as_str()).ok()?;
    let block = st.block_size() as u64;
    let used = st.blocks().saturating_sub(st.blocks_free());
    Some((
        used.saturating_mul(block),
        st.blocks().saturating_mul(block),
    ))
}

/// The manager's hook at every state change of a sandbox (create → running, pause,
/// resume, stop, and any state added later): records the change with its time, and the
/// counters when the sandbox stops running (its cgroup may be gone soon after).
pub fn on_state(m: &Manager, rec: &SandboxRecord, state: SandboxState) {
    // Idle pool members are nobody's usage until claimed.
    if rec.owner == POOL_OWNER {
        return;
    }
    let running = state == SandboxState::Running;
    // A claimed pool member's counters hold its idle time in the pool: that part is the
    // base, not the owner's.
    let counters = if !running || rec.pool.is_some() {
        m.runtime_of(rec)
            .ok()
            .and_then(|(rt, h)| sample(rt.as_ref(), &h, &rec.id))
    } else {
        None
    };
    let cpu_base_ns = match (&counters, running) {
        (Some(UsageEvent::Sample { cpu_raw_ns, .. }), true) => *cpu_raw_ns,
        _ => 0,
    };
    m.usage.push(UsageEvent::State {
        sandbox_id: rec.id.clone(),
        owner: rec.owner.clone(),
        state: state.as_str().to_string(),
        at_ms: now_ms(),
        created_at_ms: rec.created_at_ms,
        ends: state.is_final() || state == SandboxState::Stopping,
        cpu_base_ns,
    });
    if let (Some(ev), false) = (counters, running) {
        m.usage.push(ev);
    }
}

/// Samples the counters of running sandboxes (of one owner, or all) and queues them.
pub async fn sample_live(m: &Arc<Manager>, owner: Option<&str>) {
    let live = match m.store.live_sandboxes().await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "listing sandboxes to sample failed");
            return;
        }
    };
    let targets: Vec<(String, Arc<dyn Runtime>, SandboxHandle)> = live
        .into_iter()
        .filter(|r| r.owner != POOL_OWNER && owner.is_none_or(|o| r.owner == o))
        .filter(|r| r.state == SandboxState::Running)
        .filter_map(|r| m.runtime_of(&r).ok().map(|(rt, h)| (r.id, rt, h)))
        .collect();
    if targets.is_empty() {
        return;
    }
    // One blocking task for the whole sweep (a few small reads per sandbox).
    let samples = tokio::task::spawn_blocking(move || {
        targets
            .iter()
            .filter_map(|(id, rt, h)| sample(rt.as_ref(), h, id))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    for s in samples {
        m.usage.push(s);
    }
}

/// Samples one sandbox now (for a usage request about it).
pub async fn sample_one(m: &Arc<Manager>, rec: &SandboxRecord) {
    if rec.state != SandboxState::Running {
        return;
    }
    let Ok((rt, h)) = m.runtime_of(rec) else {
        return;
    };
    let id = rec.id.clone();
    if let Ok(Some(ev)) = tokio::task::spawn_blocking(move || sample(rt.as_ref(), &h, &id)).await {
        m.usage.push(ev);
    }
}

/// Who made a request: the owner and, when known, the API key's id.
#[derive(Debug, Clone)]
pub struct Caller {
    pub owner: String,
    pub api_key_id: Option<String>,
}

fn new_execution_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..20)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("ex_{tail}")
}

/// Follows one command through the daemon and writes its execution record when it ends
/// (or, for commands whose end the daemon does not see, when dropped). The record is
/// completed in a background task, off the request's path.
pub struct ExecMeter {
    inner: Option<Meter>,
}

struct Meter {
    manager: Arc<Manager>,
    conn: Arc<AgentConn>,
    rec: ExecutionRecord,
}

impl ExecMeter {
    /// A meter that records nothing (commands the daemon runs for itself).
    pub fn off() -> Self {
        Self { inner: None }
    }

    /// Starts following a command `caller` asked to run in sandbox `sandbox_id`.
    pub fn begin(
        manager: &Arc<Manager>,
        caller: &Caller,
        sandbox_id: &str,
        conn: &Arc<AgentConn>,
        req: &RunCommandRequest,
    ) -> Self {
        let command: String = req
            .argv
            .first()
            .map(|c| c.chars().take(256).collect())
            .unwrap_or_default();
        Self {
            inner: Some(Meter {
                manager: manager.clone(),
                conn: conn.clone(),
                rec: ExecutionRecord {
                    id: new_execution_id(),
                    sandbox_id: sandbox_id.to_string(),
                    owner: caller.owner.clone(),
                    api_key_id: caller.api_key_id.clone(),
                    command,
                    pid: None,
                    background: req.background,
                    created_at_ms: now_ms(),
                    started_at_ms: None,
                    ended_at_ms: None,
                    cpu_time_ms: None,
                    memory_peak_kb: None,
                    exit_code: None,
                    timed_out: false,
                    stdout_bytes: 0,
                    stderr_bytes: 0,
                },
            }),
        }
    }

    /// The process started with this pid.
    pub fn started(&mut self, pid: u32) {
        if let Some(m) = &mut self.inner {
            m.rec.pid = Some(i64::from(pid));
            m.rec.started_at_ms = Some(now_ms());
        }
    }

    /// `n` bytes of output arrived (stdout or the terminal, else stderr).
    pub fn output(&mut self, stdout: bool, n: usize) {
        if let Some(m) = &mut self.inner {
            let n = i64::try_from(n).unwrap_or(i64::MAX);
            let field = if stdout {
                &mut m.rec.stdout_bytes
            } else {
                &mut m.rec.stderr_bytes
            };
            *field = field.saturating_add(n);
        }
    }

    /// The command was killed by its timeout.
    pub fn timed_out(&mut self) {
        if let Some(m) = &mut self.inner {
            m.rec.timed_out = true;
        }
    }

    /// Follows an event of a command stream.
    pub fn observe(&mut self, ev: &CommandEvent) {
        match ev {
            CommandEvent::Start { pid } => self.started(*pid),
            CommandEvent::Stdout { data } | CommandEvent::Pty { data } => {
                self.output(true, base64_len(data))
            }
            CommandEvent::Stderr { data } => self.output(false, base64_len(data)),
            CommandEvent::End { exit_code, .. } => self.ended(*exit_code),
            CommandEvent::Error { .. } => {}
        }
    }

    /// The command ended: its record is completed with the agent's usage and written.
    pub fn ended(&mut self, exit_code: i32) {
        let Some(mut m) = self.inner.take() else {
            return;
        };
        m.rec.ended_at_ms = Some(now_ms());
        m.rec.exit_code = Some(i64::from(exit_code));
        tokio::spawn(async move {
            if let Some(pid) = m.rec.pid
                && let Some((cpu_us, rss_kb)) = m.conn.rusage(pid).await
            {
                // Rounded to the nearest millisecond.
                m.rec.cpu_time_ms =
                    Some(i64::try_from(cpu_us.saturating_add(500) / 1000).unwrap_or(i64::MAX));
                m.rec.memory_peak_kb = Some(i64::try_from(rss_kb).unwrap_or(i64::MAX));
            }
            write(&m.manager, m.rec);
        });
    }
}

impl Drop for ExecMeter {
    fn drop(&mut self) {
        // A background command, or a stream the client left: what is known is recorded.
        // A command that never started is no execution.
        if let Some(m) = self.inner.take().filter(|m| m.rec.pid.is_some()) {
            write(&m.manager, m.rec);
        }
    }
}

fn write(manager: &Manager, rec: ExecutionRecord) {
    let took = match (rec.started_at_ms, rec.ended_at_ms) {
        (Some(s), Some(e)) => e - s,
        _ => 0,
    };
    manager
        .usage
        .log(&rec.owner, &rec.sandbox_id, COMMAND, took, &rec.command);
    manager.usage.push(UsageEvent::Execution(rec));
}

/// Decoded length of standard base64 text.
fn base64_len(b64: &str) -> usize {
    let pad = b64.bytes().rev().take_while(|b| *b == b'=').count().min(2);
    (b64.len() / 4 * 3).saturating_sub(pad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    #[test]
    fn base64_lengths_match_the_decoded_bytes() {
        let b64 = base64::engine::general_purpose::STANDARD;
        for n in 0..40 {
            let data = vec![7u8; n];
            assert_eq!(base64_len(&b64.encode(&data)), n, "{n}");
        }
    }

    #[tokio::test]
    async fn the_writer_commits_batches_and_flush_waits_for_them() {
        let store = Store::open_in_memory().await.unwrap();
        let usage = Arc::new(Usage::default());
        let rx = usage.rx.lock().take().unwrap();
        let (u, s) = (usage.clone(), store.clone());
        tokio::spawn(async move { u.run_writer(s, rx).await });
        for i in 0..2500 {
            usage.log("o", "sb", FILE, 1, if i % 2 == 0 { "stat" } else { "" });
        }
        usage.flush(Duration::from_secs(30)).await;
        let period = store.owner_usage("o", 0, i64::MAX).await.unwrap();
        assert_eq!(period.log, vec![(FILE.to_string(), 2500, 2500)]);
    }

    #[test]
    fn a_full_queue_drops_instead_of_blocking() {
        let usage = Usage::default();
        for _ in 0..(QUEUE + 5) {
            usage.log("o", "sb", FILE, 1, "x");
        }
        assert_eq!(usage.dropped.load(Ordering::Relaxed), 5);
    }
}
