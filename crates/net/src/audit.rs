//! The audit of outbound attempts. Every sandbox has a lane of its own where its entries
//! wait for the one writer task, which takes from the lanes in turn and writes to the
//! store in batches, off the connections' paths. There is no shared queue to fill: a
//! flood can only ever cost its own sandbox entries.
//!
//! A lane admits at most `rows_per_sandbox_per_minute` new rows a minute, of which DNS
//! questions (anything but a connection) take at most half, so connection attempts always
//! have room. Identical DNS questions and identical refused connections within the minute
//! are one row with a count. What a lane cannot admit is counted in a summary row ("N
//! entries dropped (rate limit)"). Beyond `max_rows` rows in all, the oldest go, those of
//! the owners with the most rows first (one owner's flood prunes its own). A closed
//! connection's byte counts follow as an update, and its bytes sent feed usage metering;
//! neither is ever dropped.

use parking_lot::{Mutex, MutexGuard};
use sandpit_api::network::{NetworkAuditEntry, Verdict};
use sandpit_store::{AuditRecord, AuditWrite, Store};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, broadcast, oneshot};

/// The window rows are counted and aggregated in.
pub const WINDOW_MS: i64 = 60_000;
/// Most writes in one transaction.
const BATCH: usize = 1024;
/// Most items one lane gives a batch before the next lane's turn.
const QUANTUM: usize = 64;
/// Least time between two transactions while no listing waits: a flood's repeats then
/// cost one update per row and interval, not one transaction each.
const MIN_GAP: Duration = Duration::from_millis(50);
/// How often lanes of sandboxes gone quiet are forgotten.
const FORGET_EVERY: Duration = Duration::from_secs(10);

/// Bounds on what the audit keeps (the `[network]` section's `audit_*` keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// New rows one sandbox may add per minute (at least 2); DNS questions and other
    /// attempts that are not connections take at most half of them.
    pub rows_per_sandbox_per_minute: u64,
    /// Rows kept in all; beyond, the oldest go (0: no cap).
    pub max_rows: u64,
}

/// One entry on the live stream, with the owner it is shown to.
#[derive(Debug, Clone)]
pub struct Live {
    pub owner: String,
    pub entry: NetworkAuditEntry,
}

/// What the proxy or resolver knows of an attempt when it decides.
#[derive(Debug, Clone, Default)]
pub struct Attempt {
    pub sandbox_id: String,
    pub owner: String,
    pub protocol: &'static str,
    pub dest_name: Option<String>,
    pub dest_ip: Option<String>,
    pub dest_port: u16,
    pub sni: Option<String>,
    pub http_host: Option<String>,
}

/// The API view of a stored entry.
pub fn to_api(a: &AuditRecord) -> NetworkAuditEntry {
    NetworkAuditEntry {
        id: a.id,
        at_ms: a.at_ms,
        sandbox_id: a.sandbox_id.clone(),
        protocol: a.protocol.clone(),
        dest_name: a.dest_name.clone(),
        dest_ip: a.dest_ip.clone(),
        dest_port: u16::try_from(a.dest_port).unwrap_or(0),
        sni: a.sni.clone(),
        http_host: a.http_host.clone(),
        verdict: if a.verdict == "allow" {
            Verdict::Allow
        } else {
            Verdict::Deny
        },
        rule: a.rule.clone(),
        bytes_sent: u64::try_from(a.bytes_sent).unwrap_or(0),
        bytes_received: u64::try_from(a.bytes_received).unwrap_or(0),
        ended_at_ms: a.ended_at_ms,
        error: a.error.clone(),
        count: u64::try_from(a.count).unwrap_or(1),
        last_at_ms: a.last_at_ms,
    }
}

/// Why a lane dropped entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Reason {
    /// Over the sandbox's rows per minute.
    RateLimit,
    /// The writer is a whole minute's rows behind with this sandbox.
    Backlog,
}

impl Reason {
    fn rule(self, n: u64) -> String {
        let what = if n == 1 { "entry" } else { "entries" };
        match self {
            Reason::RateLimit => format!("{n} {what} dropped (rate limit)"),
            Reason::Backlog => format!("{n} {what} dropped (audit writer behind)"),
        }
    }
}

/// What makes two attempts the same for aggregation (the sandbox is the lane's).
#[derive(Debug, PartialEq, Eq, Hash)]
struct Key {
    protocol: &'static str,
    allow: bool,
    dest_name: Option<String>,
    dest_ip: Option<String>,
    dest_port: u16,
    sni: Option<String>,
    http_host: Option<String>,
    rule: String,
}

/// A row whose count can still grow.
struct Cell {
    count: u64,
    last_at_ms: i64,
    /// Its update waits in the lane.
    queued: bool,
    /// Its window has passed: forgotten once its update is taken.
    stale: bool,
    /// A drop summary, whose rule tells its count.
    reason: Option<Reason>,
}

// Nearly every item is a write: boxing it would cost an allocation each.
#[allow(clippy::large_enum_variant)]
enum Item {
    Write(AuditWrite),
    /// The current count of an aggregated row.
    Count(i64),
}

/// One sandbox's share of the audit.
struct Lane {
    /// The window (`at_ms / WINDOW_MS`) the counts below are of.
    window: i64,
    /// New rows this window.
    rows: u64,
    /// Of those, the rows that are not connections.
    other_rows: u64,
    /// Aggregated rows of this window, by what they are.
    same: HashMap<Key, i64>,
    /// Drop summaries of this window: (protocol, allowed, reason) -> row id.
    summaries: HashMap<(&'static str, bool, Reason), i64>,
    /// Aggregated rows (including summaries) by id.
    cells: HashMap<i64, Cell>,
    /// Connection attempts and their closes, taken first.
    conn: VecDeque<Item>,
    /// Everything else.
    other: VecDeque<Item>,
    /// Items ever queued and taken; a flush waits for `taken` to reach `pushed`.
    pushed: u64,
    taken: u64,
}

impl Lane {
    fn new(window: i64) -> Lane {
        Lane {
            window,
            rows: 0,
            other_rows: 0,
            same: HashMap::new(),
            summaries: HashMap::new(),
            cells: HashMap::new(),
            conn: VecDeque::new(),
            other: VecDeque::new(),
            pushed: 0,
            taken: 0,
        }
    }

    fn is_idle(&self) -> bool {
        self.conn.is_empty() && self.other.is_empty()
    }

    /// Starts a new window: fresh budgets, and repeats make new rows.
    fn roll(&mut self, window: i64) {
        self.window = window;
        self.rows = 0;
        self.other_rows = 0;
        let ids: Vec<i64> = self
            .same
            .drain()
            .map(|(_, id)| id)
            .chain(self.summaries.drain().map(|(_, id)| id))
            .collect();
        for id in ids {
            if let Some(c) = self.cells.get_mut(&id) {
                if c.queued {
                    c.stale = true;
                } else {
                    self.cells.remove(&id);
                }
            }
        }
    }

    /// Queues an item; true when the lane was idle (it then needs a turn).
    fn push(&mut self, conn: bool, item: Item) -> bool {
        let idle = self.is_idle();
        if conn {
            self.conn.push_back(item);
        } else {
            self.other.push_back(item);
        }
        self.pushed += 1;
        idle
    }

    /// One more attempt counted in row `id`; returns its count. True in the second place
    /// when the lane needs a turn.
    fn bump(&mut self, conn: bool, id: i64, now: i64) -> (u64, bool) {
        let Some(c) = self.cells.get_mut(&id) else {
            return (1, false);
        };
        c.count += 1;
        c.last_at_ms = now;
        let count = c.count;
        if c.queued {
            return (count, false);
        }
        c.queued = true;
        (count, self.push(conn, Item::Count(id)))
    }

    fn new_cell(&mut self, id: i64, now: i64, reason: Option<Reason>) {
        self.cells.insert(
            id,
            Cell {
                count: 1,
                last_at_ms: now,
                queued: false,
                stale: false,
                reason,
            },
        );
    }

    /// The write an item stands for, when it is taken.
    fn take(&mut self, item: Item) -> Option<AuditWrite> {
        self.taken += 1;
        match item {
            Item::Write(w) => Some(w),
            Item::Count(id) => {
                let c = self.cells.get_mut(&id)?;
                c.queued = false;
                let w = AuditWrite::Count {
                    id,
                    count: i64::try_from(c.count).unwrap_or(i64::MAX),
                    last_at_ms: c.last_at_ms,
                    rule: c.reason.map(|r| r.rule(c.count)),
                };
                if c.stale {
                    self.cells.remove(&id);
                }
                Some(w)
            }
        }
    }
}

/// A listing waiting until what was queued before it asked is in the store.
struct Flush {
    /// (lane, items it had queued then).
    upto: Vec<(String, u64)>,
    done: oneshot::Sender<()>,
}

#[derive(Default)]
struct State {
    lanes: HashMap<String, Lane>,
    /// Lanes with items waiting, in turn.
    ready: VecDeque<String>,
    /// Bytes sent per sandbox, not yet added to its metering.
    egress: HashMap<String, i64>,
    flushes: Vec<Flush>,
    /// The audit is gone: the writer ends once everything is written.
    closed: bool,
}

/// What a recorded attempt became.
enum Admitted {
    /// A row of its own.
    Row,
    /// Counted in row `id` (with the count it has now).
    Counted(i64, u64),
    /// Dropped; the summary it made, if it was the first.
    Dropped(Option<Box<AuditRecord>>),
}

type Clock = Box<dyn Fn() -> i64 + Send + Sync>;

struct Shared {
    state: Mutex<State>,
    /// Something was queued.
    wake: Notify,
    /// A listing waits.
    urgent: Notify,
    limits: Limits,
    clock: Clock,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }
}

/// The audit queue and live stream.
pub struct Audit {
    shared: Arc<Shared>,
    next_id: AtomicI64,
    live: broadcast::Sender<Live>,
    /// Set when the daemon stops: live streams end.
    closing: tokio::sync::watch::Sender<bool>,
}

impl Audit {
    /// Starts the writer; ids continue after `last_id`.
    pub fn start(store: Store, last_id: i64, limits: Limits) -> Audit {
        Self::with_clock(store, last_id, limits, Box::new(sandpit_store::now_ms))
    }

    fn with_clock(store: Store, last_id: i64, mut limits: Limits, clock: Clock) -> Audit {
        if limits.rows_per_sandbox_per_minute < 2 {
            tracing::warn!(
                configured = limits.rows_per_sandbox_per_minute,
                "audit_rows_per_sandbox_per_minute is at least 2; using 2"
            );
            limits.rows_per_sandbox_per_minute = 2;
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Notify::new(),
            urgent: Notify::new(),
            limits,
            clock,
        });
        let (live, _) = broadcast::channel(4096);
        tokio::spawn(writer(shared.clone(), store));
        Audit {
            shared,
            next_id: AtomicI64::new(last_id + 1),
            live,
            closing: tokio::sync::watch::Sender::new(false),
        }
    }

    fn new_id(&self) -> i64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Records a decided attempt and returns its entry (whose id a later close names).
    /// A repeat counted in an earlier row returns that row.
    pub fn record(&self, a: Attempt, allow: bool, rule: &str) -> NetworkAuditEntry {
        let now = (self.shared.clock)();
        let protocol = a.protocol;
        let conn = protocol == "tcp";
        let rec = AuditRecord {
            id: self.new_id(),
            at_ms: now,
            sandbox_id: a.sandbox_id,
            owner: a.owner,
            protocol: protocol.into(),
            dest_name: a.dest_name,
            dest_ip: a.dest_ip,
            dest_port: i64::from(a.dest_port),
            sni: a.sni,
            http_host: a.http_host,
            verdict: if allow { "allow" } else { "deny" }.into(),
            rule: rule.to_string(),
            bytes_sent: 0,
            bytes_received: 0,
            ended_at_ms: None,
            error: None,
            count: 1,
            last_at_ms: None,
        };
        let mut entry = to_api(&rec);
        // An allowed connection's row gets its own byte counts; anything else repeated
        // is the same fact again.
        let key = (!conn || !allow).then(|| Key {
            protocol,
            allow,
            dest_name: rec.dest_name.clone(),
            dest_ip: rec.dest_ip.clone(),
            dest_port: a.dest_port,
            sni: rec.sni.clone(),
            http_host: rec.http_host.clone(),
            rule: rec.rule.clone(),
        });
        let owner = rec.owner.clone();
        let (admitted, turn) = self.admit(rec, key, protocol, allow, now);
        match admitted {
            Admitted::Row => self.stream(&owner, entry.clone()),
            Admitted::Counted(id, count) => {
                entry.id = id;
                entry.count = count;
                entry.last_at_ms = Some(now);
            }
            Admitted::Dropped(summary) => {
                if let Some(s) = summary {
                    self.stream(&owner, to_api(&s));
                }
            }
        }
        if turn {
            self.shared.wake.notify_one();
        }
        entry
    }

    /// Decides what becomes of a record in its sandbox's lane; true in the second place
    /// when the writer has something new to do.
    fn admit(
        &self,
        rec: AuditRecord,
        key: Option<Key>,
        protocol: &'static str,
        allow: bool,
        now: i64,
    ) -> (Admitted, bool) {
        let conn = protocol == "tcp";
        let limit = self.shared.limits.rows_per_sandbox_per_minute;
        let window = now.div_euclid(WINDOW_MS);
        let sandbox = rec.sandbox_id.clone();
        let mut guard = self.shared.lock();
        let st = &mut *guard;
        let lane = st
            .lanes
            .entry(sandbox.clone())
            .or_insert_with(|| Lane::new(window));
        if lane.window != window {
            lane.roll(window);
        }
        if let Some(id) = key.as_ref().and_then(|k| lane.same.get(k)).copied() {
            let (count, idle) = lane.bump(conn, id, now);
            if idle {
                st.ready.push_back(sandbox);
            }
            return (Admitted::Counted(id, count), idle);
        }
        let within = if conn {
            lane.rows < limit
        } else {
            lane.rows < limit && lane.other_rows < limit / 2
        };
        // Admitted rows are at most a minute's worth, so a longer queue means the writer
        // is that far behind (a stalled disk): this lane stops growing.
        let room = if conn { &lane.conn } else { &lane.other }.len()
            < usize::try_from(limit).unwrap_or(usize::MAX).max(QUANTUM);
        if within && room {
            lane.rows += 1;
            if !conn {
                lane.other_rows += 1;
            }
            if let Some(k) = key {
                lane.same.insert(k, rec.id);
                lane.new_cell(rec.id, now, None);
            }
            if lane.push(conn, Item::Write(AuditWrite::Insert(rec))) {
                st.ready.push_back(sandbox);
            }
            return (Admitted::Row, true);
        }
        let reason = if within {
            Reason::Backlog
        } else {
            Reason::RateLimit
        };
        if let Some(id) = lane.summaries.get(&(protocol, allow, reason)).copied() {
            let (_, idle) = lane.bump(conn, id, now);
            if idle {
                st.ready.push_back(sandbox);
            }
            return (Admitted::Dropped(None), idle);
        }
        if lane.summaries.is_empty() {
            tracing::warn!(
                sandbox = %sandbox,
                reason = ?reason,
                "network audit entries of this sandbox dropped this minute; a summary row counts them"
            );
        }
        let summary = AuditRecord {
            id: self.new_id(),
            dest_name: None,
            dest_ip: None,
            dest_port: 0,
            sni: None,
            http_host: None,
            rule: reason.rule(1),
            ..rec
        };
        lane.summaries.insert((protocol, allow, reason), summary.id);
        lane.new_cell(summary.id, now, Some(reason));
        if lane.push(conn, Item::Write(AuditWrite::Insert(summary.clone()))) {
            st.ready.push_back(sandbox);
        }
        (Admitted::Dropped(Some(Box::new(summary))), true)
    }

    fn stream(&self, owner: &str, entry: NetworkAuditEntry) {
        let _ = self.live.send(Live {
            owner: owner.to_string(),
            entry,
        });
    }

    /// Records how an allowed connection ended; its bytes sent count as egress.
    pub fn close(
        &self,
        owner: &str,
        mut entry: NetworkAuditEntry,
        sent: u64,
        received: u64,
        error: Option<String>,
    ) {
        let now = (self.shared.clock)();
        let close = AuditWrite::Close {
            id: entry.id,
            bytes_sent: i64::try_from(sent).unwrap_or(i64::MAX),
            bytes_received: i64::try_from(received).unwrap_or(i64::MAX),
            ended_at_ms: now,
            error: error.clone(),
        };
        {
            let mut guard = self.shared.lock();
            let st = &mut *guard;
            let lane = st
                .lanes
                .entry(entry.sandbox_id.clone())
                .or_insert_with(|| Lane::new(now.div_euclid(WINDOW_MS)));
            // A close is never dropped: there is one per admitted connection at most.
            if lane.push(true, Item::Write(close)) {
                st.ready.push_back(entry.sandbox_id.clone());
            }
            if sent > 0 {
                let e = st.egress.entry(entry.sandbox_id.clone()).or_insert(0);
                *e = e.saturating_add(i64::try_from(sent).unwrap_or(i64::MAX));
            }
        }
        self.shared.wake.notify_one();
        entry.bytes_sent = sent;
        entry.bytes_received = received;
        entry.ended_at_ms = Some(now);
        entry.error = error;
        self.stream(owner, entry);
    }

    /// Follows entries as they are made; the watch turns true when the daemon stops.
    pub fn subscribe(
        &self,
    ) -> (
        broadcast::Receiver<Live>,
        tokio::sync::watch::Receiver<bool>,
    ) {
        (self.live.subscribe(), self.closing.subscribe())
    }

    /// Ends every live stream (the daemon is stopping).
    pub fn close_streams(&self) {
        self.closing.send_replace(true);
    }

    /// Waits (up to five seconds) until every write queued so far is in the store, so
    /// that a listing shows what was streamed.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.shared.lock();
            let upto = st
                .lanes
                .iter()
                .filter(|(_, l)| l.taken < l.pushed)
                .map(|(k, l)| (k.clone(), l.pushed))
                .collect();
            st.flushes.push(Flush { upto, done: tx });
        }
        self.shared.urgent.notify_one();
        self.shared.wake.notify_one();
        let _ = tokio::time::timeout(Duration::from_secs(5), rx).await;
    }
}

impl Drop for Audit {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_one();
    }
}

/// One batch's worth of work taken from the lanes.
struct Taken {
    writes: Vec<AuditWrite>,
    inserts: u64,
    done: Vec<oneshot::Sender<()>>,
}

impl State {
    fn has_work(&self) -> bool {
        !self.ready.is_empty() || !self.egress.is_empty() || !self.flushes.is_empty()
    }

    /// Takes up to a batch, lane by lane in turn (connections first within a lane), and
    /// the listings that batch satisfies.
    fn take(&mut self) -> Taken {
        let mut writes = Vec::with_capacity(BATCH.min(256));
        let mut inserts = 0;
        while writes.len() < BATCH {
            let Some(key) = self.ready.pop_front() else {
                break;
            };
            let Some(lane) = self.lanes.get_mut(&key) else {
                continue;
            };
            let mut n = 0;
            while n < QUANTUM && writes.len() < BATCH {
                let Some(item) = lane.conn.pop_front().or_else(|| lane.other.pop_front()) else {
                    break;
                };
                n += 1;
                if let Some(w) = lane.take(item) {
                    if matches!(w, AuditWrite::Insert(_)) {
                        inserts += 1;
                    }
                    writes.push(w);
                }
            }
            if !lane.is_idle() {
                self.ready.push_back(key);
            }
        }
        for (sandbox_id, bytes) in self.egress.drain() {
            writes.push(AuditWrite::Egress { sandbox_id, bytes });
        }
        let lanes = &self.lanes;
        let (satisfied, waiting): (Vec<Flush>, Vec<Flush>) = std::mem::take(&mut self.flushes)
            .into_iter()
            .partition(|f| {
                f.upto
                    .iter()
                    .all(|(k, n)| lanes.get(k).is_none_or(|l| l.taken >= *n))
            });
        self.flushes = waiting;
        Taken {
            writes,
            inserts,
            done: satisfied.into_iter().map(|f| f.done).collect(),
        }
    }

    /// Forgets lanes with nothing waiting whose window has passed.
    fn forget_quiet(&mut self, window: i64) {
        self.lanes
            .retain(|_, l| !(l.is_idle() && l.window < window));
    }
}

async fn writer(shared: Arc<Shared>, store: Store) {
    let max_rows = shared.limits.max_rows;
    let mut rows = if max_rows > 0 {
        store.count_audit().await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "counting the network audit's rows failed");
            0
        })
    } else {
        0
    };
    let mut last_write: Option<Instant> = None;
    let mut last_forget = Instant::now();
    loop {
        let urgent = !shared.lock().flushes.is_empty();
        if let Some(t) = last_write
            && !urgent
            && t.elapsed() < MIN_GAP
        {
            tokio::select! {
                _ = tokio::time::sleep(MIN_GAP - t.elapsed()) => {}
                _ = shared.urgent.notified() => {}
            }
        }
        let taken = {
            let mut st = shared.lock();
            if last_forget.elapsed() >= FORGET_EVERY {
                st.forget_quiet((shared.clock)().div_euclid(WINDOW_MS));
                last_forget = Instant::now();
            }
            if st.has_work() {
                Some(st.take())
            } else if st.closed {
                return;
            } else {
                None
            }
        };
        let Some(taken) = taken else {
            shared.wake.notified().await;
            continue;
        };
        if !taken.writes.is_empty() {
            if let Err(e) = store.write_audit(&taken.writes).await {
                tracing::warn!(error = %e, n = taken.writes.len(), "writing network audit entries failed");
            }
            last_write = Some(Instant::now());
        }
        rows += taken.inserts;
        if max_rows > 0 && rows > max_rows {
            rows = prune(&store, max_rows).await.unwrap_or(rows);
        }
        for done in taken.done {
            let _ = done.send(());
        }
    }
}

/// Deletes the oldest rows down to fifteen sixteenths of `max_rows` (so that the next
/// prune is some way off); returns how many rows are left.
async fn prune(store: &Store, max_rows: u64) -> Option<u64> {
    let keep = max_rows - max_rows / 16;
    match store.prune_audit_rows(keep).await {
        Ok(n) => tracing::info!(
            n,
            max_rows,
            "network audit over its row cap: oldest entries deleted"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "pruning the network audit to its row cap failed");
            return None;
        }
    }
    store.count_audit().await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandpit_store::AuditFilter;

    /// The start of a minute, so that tests know which window each entry falls in.
    const T0: i64 = 1_700_000_040_000;
    const DENY: &str = "default deny (allowlist)";

    struct Fixture {
        store: Store,
        audit: Audit,
        clock: Arc<AtomicI64>,
    }

    async fn fixture(rows_per_sandbox_per_minute: u64, max_rows: u64) -> Fixture {
        let store = Store::open_in_memory().await.unwrap();
        let clock = Arc::new(AtomicI64::new(T0));
        let c = clock.clone();
        let audit = Audit::with_clock(
            store.clone(),
            0,
            Limits {
                rows_per_sandbox_per_minute,
                max_rows,
            },
            Box::new(move || c.load(Ordering::Relaxed)),
        );
        Fixture {
            store,
            audit,
            clock,
        }
    }

    impl Fixture {
        fn advance(&self, ms: i64) {
            self.clock.fetch_add(ms, Ordering::Relaxed);
        }

        /// Every stored row of `sandbox`, after what was queued is written.
        async fn rows(&self, sandbox: &str) -> Vec<AuditRecord> {
            self.audit.flush().await;
            let mut out = Vec::new();
            let mut before_id = None;
            loop {
                let (page, next) = self
                    .store
                    .list_audit(&AuditFilter {
                        sandbox_id: Some(sandbox.into()),
                        before_id,
                        limit: 1000,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                out.extend(page);
                match next {
                    Some(n) => before_id = Some(n),
                    None => return out,
                }
            }
        }
    }

    fn dns(sandbox: &str, owner: &str, name: &str) -> Attempt {
        Attempt {
            sandbox_id: sandbox.into(),
            owner: owner.into(),
            protocol: "dns",
            dest_name: Some(name.into()),
            dest_port: 53,
            ..Default::default()
        }
    }

    fn tcp(sandbox: &str, owner: &str, ip: &str, port: u16) -> Attempt {
        Attempt {
            sandbox_id: sandbox.into(),
            owner: owner.into(),
            protocol: "tcp",
            dest_ip: Some(ip.into()),
            dest_port: port,
            ..Default::default()
        }
    }

    fn summaries(rows: &[AuditRecord]) -> Vec<&AuditRecord> {
        rows.iter().filter(|r| r.rule.contains("dropped")).collect()
    }

    // The default (single-threaded) runtime keeps the writer from running during the
    // flood, as a writer slower than the flood would: everything must wait somewhere.
    #[tokio::test]
    async fn a_dns_flood_loses_only_its_own_dns_entries() {
        let f = fixture(200, 0).await;
        let a = &f.audit;
        let mut allowed = None;
        // Far more than one shared queue held, and than any DNS rate limit lets through.
        for i in 0..100_000u32 {
            a.record(dns("A", "alice", &format!("n{i}.flood.test")), false, DENY);
            if i % 5000 == 0 {
                a.record(dns("B", "bob", &format!("b{i}.test")), false, DENY);
                a.record(
                    tcp("B", "bob", "198.51.100.7", 1000 + (i / 5000) as u16),
                    false,
                    DENY,
                );
            }
            if i == 70_000 {
                a.record(tcp("A", "alice", "203.0.113.9", 443), false, DENY);
                allowed = Some(a.record(tcp("A", "alice", "203.0.113.10", 443), true, "rules[0]"));
            }
        }
        a.close("alice", allowed.unwrap(), 100, 200, None);
        // Connections keep their half of the minute's rows whatever DNS did.
        for port in 0..90u16 {
            a.record(tcp("A", "alice", "203.0.113.11", 2000 + port), false, DENY);
        }

        let b = f.rows("B").await;
        assert_eq!(b.len(), 40, "{b:#?}");
        assert!(summaries(&b).is_empty());
        for i in (0..100_000).step_by(5000) {
            assert!(
                b.iter()
                    .any(|r| r.dest_name.as_deref() == Some(&format!("b{i}.test")))
            );
        }
        assert_eq!(b.iter().filter(|r| r.protocol == "tcp").count(), 20);

        let rows = f.rows("A").await;
        let denied = rows
            .iter()
            .find(|r| r.dest_ip.as_deref() == Some("203.0.113.9"))
            .expect("A's refused connection in the middle of its flood");
        assert_eq!(
            (denied.protocol.as_str(), denied.verdict.as_str()),
            ("tcp", "deny")
        );
        let ok = rows
            .iter()
            .find(|r| r.dest_ip.as_deref() == Some("203.0.113.10"))
            .expect("A's allowed connection");
        assert_eq!((ok.bytes_sent, ok.bytes_received), (100, 200));
        assert!(ok.ended_at_ms.is_some());
        let later = rows
            .iter()
            .filter(|r| r.dest_ip.as_deref() == Some("203.0.113.11"))
            .count();
        assert_eq!(later, 90);
        let named = rows
            .iter()
            .filter(|r| r.protocol == "dns" && r.dest_name.is_some())
            .count();
        assert_eq!(named, 100, "DNS takes at most half of the 200 rows");
        let s = summaries(&rows);
        assert_eq!(s.len(), 1, "{s:#?}");
        assert_eq!(
            (s[0].protocol.as_str(), s[0].verdict.as_str()),
            ("dns", "deny")
        );
        assert_eq!(s[0].count, 99_900);
        assert_eq!(s[0].rule, "99900 entries dropped (rate limit)");
        assert_eq!(s[0].owner, "alice");
        assert_eq!(rows.len(), 100 + 2 + 90 + 1);
    }

    #[tokio::test]
    async fn identical_attempts_are_one_row_with_a_count() {
        let f = fixture(200, 0).await;
        let a = &f.audit;
        let first = a.record(dns("A", "alice", "same.test"), false, DENY);
        assert_eq!(first.count, 1);
        for _ in 1..250 {
            f.advance(1);
            a.record(dns("A", "alice", "same.test"), false, DENY);
        }
        let rows = f.rows("A").await;
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].count, 250);
        for _ in 250..500 {
            f.advance(1);
            let e = a.record(dns("A", "alice", "same.test"), false, DENY);
            assert_eq!(e.id, first.id);
        }
        for _ in 0..300 {
            a.record(tcp("A", "alice", "203.0.113.9", 443), false, DENY);
        }
        // Allowed connections are each a row: each has its own bytes.
        for _ in 0..3 {
            a.record(tcp("A", "alice", "203.0.113.10", 443), true, "rules[0]");
        }
        // The same question decided otherwise is another row.
        a.record(
            dns("A", "alice", "same.test"),
            false,
            "rules[1] deny same.test",
        );
        let rows = f.rows("A").await;
        let same: Vec<_> = rows
            .iter()
            .filter(|r| r.dest_name.as_deref() == Some("same.test") && r.rule == DENY)
            .collect();
        assert_eq!(same.len(), 1);
        assert_eq!(same[0].count, 500);
        assert_eq!(same[0].at_ms, T0);
        assert_eq!(same[0].last_at_ms, Some(T0 + 499));
        let refused: Vec<_> = rows
            .iter()
            .filter(|r| r.dest_ip.as_deref() == Some("203.0.113.9"))
            .collect();
        assert_eq!((refused.len(), refused[0].count), (1, 300));
        let allowed = rows
            .iter()
            .filter(|r| r.dest_ip.as_deref() == Some("203.0.113.10"))
            .count();
        assert_eq!(allowed, 3);
        assert_eq!(rows.len(), 1 + 1 + 3 + 1);
        assert!(summaries(&rows).is_empty());

        // A new minute starts a new row.
        f.advance(WINDOW_MS);
        let e = a.record(dns("A", "alice", "same.test"), false, DENY);
        assert_ne!(e.id, first.id);
        let rows = f.rows("A").await;
        let same: Vec<_> = rows
            .iter()
            .filter(|r| r.dest_name.as_deref() == Some("same.test") && r.rule == DENY)
            .map(|r| r.count)
            .collect();
        assert_eq!(same, vec![1, 500]);
    }

    #[tokio::test]
    async fn drops_are_summarised_per_sandbox_protocol_and_minute() {
        let f = fixture(10, 0).await;
        let a = &f.audit;
        let (mut live, _) = a.subscribe();
        for i in 0..20 {
            a.record(dns("A", "alice", &format!("d{i}.test")), false, DENY);
        }
        for i in 0..3 {
            a.record(dns("A", "alice", &format!("ok{i}.test")), true, "rules[0]");
        }
        for port in 0..8 {
            a.record(tcp("A", "alice", "203.0.113.9", port), false, DENY);
        }
        let rows = f.rows("A").await;
        let mut s: Vec<_> = summaries(&rows)
            .iter()
            .map(|r| {
                (
                    r.protocol.clone(),
                    r.verdict.clone(),
                    r.count,
                    r.rule.clone(),
                )
            })
            .collect();
        s.sort();
        assert_eq!(
            s,
            vec![
                (
                    "dns".into(),
                    "allow".into(),
                    3,
                    "3 entries dropped (rate limit)".into()
                ),
                (
                    "dns".into(),
                    "deny".into(),
                    15,
                    "15 entries dropped (rate limit)".into()
                ),
                (
                    "tcp".into(),
                    "deny".into(),
                    3,
                    "3 entries dropped (rate limit)".into()
                ),
            ]
        );
        assert_eq!(rows.len(), 10 + 3);
        // The live stream shows the rows, not what they later count.
        let mut streamed = 0;
        while live.try_recv().is_ok() {
            streamed += 1;
        }
        assert_eq!(streamed, 13);

        // The next minute has its own budget and its own summary.
        f.advance(WINDOW_MS);
        for i in 0..7 {
            a.record(dns("A", "alice", &format!("e{i}.test")), false, DENY);
        }
        let rows = f.rows("A").await;
        let s: Vec<_> = summaries(&rows)
            .iter()
            .filter(|r| r.at_ms >= T0 + WINDOW_MS)
            .map(|r| (r.count, r.rule.clone()))
            .collect();
        assert_eq!(s, vec![(2, "2 entries dropped (rate limit)".to_string())]);
        assert_eq!(rows.len(), 13 + 5 + 1);
    }

    #[tokio::test]
    async fn the_oldest_rows_go_beyond_the_row_cap() {
        let f = fixture(100_000, 160).await;
        let mut last = 0;
        for round in 0..10 {
            for i in 0..100 {
                last = f
                    .audit
                    .record(
                        dns("A", "alice", &format!("r{round}-{i}.test")),
                        false,
                        DENY,
                    )
                    .id;
            }
            f.audit.flush().await;
            assert!(f.store.count_audit().await.unwrap() <= 160);
        }
        let rows = f.rows("A").await;
        assert!(rows.len() >= 100 && rows.len() <= 160, "{}", rows.len());
        assert_eq!(rows[0].id, last);
        assert!(rows.iter().all(|r| r.id > last - 160));
    }

    #[tokio::test]
    async fn a_flush_waits_only_for_what_was_queued_before_it() {
        let f = fixture(1_000_000, 0).await;
        for i in 0..5000 {
            f.audit
                .record(dns("A", "alice", &format!("q{i}.test")), false, DENY);
        }
        f.audit.flush().await;
        assert_eq!(f.store.count_audit().await.unwrap(), 5000);
    }
}
