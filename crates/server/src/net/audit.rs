//! The audit of outbound attempts: every entry is streamed live at once and written to
//! the store in batches by one writer task, off the connections' paths. A closed
//! connection's byte counts follow as an update, and its bytes sent feed usage metering.

use sandpit_api::network::{NetworkAuditEntry, Verdict};
use sandpit_store::{AuditRecord, AuditWrite, Store};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use tokio::sync::{broadcast, mpsc};

/// Writes waiting for the writer; beyond this they are dropped (and counted).
const QUEUE: usize = 1 << 16;
/// Most writes in one transaction.
const BATCH: usize = 1024;

/// One entry on the live stream, with the owner it is shown to.
#[derive(Debug, Clone)]
pub struct Live {
    pub owner: String,
    pub entry: NetworkAuditEntry,
}

// Nearly every message is a write: boxing it would cost an allocation each.
#[allow(clippy::large_enum_variant)]
enum Msg {
    Write(AuditWrite),
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// The audit queue and live stream.
pub struct Audit {
    tx: mpsc::Sender<Msg>,
    next_id: AtomicI64,
    live: broadcast::Sender<Live>,
    dropped: AtomicU64,
    /// Set when the daemon stops: live streams end.
    closing: tokio::sync::watch::Sender<bool>,
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
    }
}

impl Audit {
    /// Starts the writer; ids continue after `last_id`.
    pub fn start(store: Store, last_id: i64) -> Audit {
        let (tx, rx) = mpsc::channel(QUEUE);
        let (live, _) = broadcast::channel(4096);
        tokio::spawn(writer(store, rx));
        Audit {
            tx,
            next_id: AtomicI64::new(last_id + 1),
            live,
            dropped: AtomicU64::new(0),
            closing: tokio::sync::watch::Sender::new(false),
        }
    }

    fn push(&self, w: AuditWrite) {
        if self.tx.try_send(Msg::Write(w)).is_err() {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed);
            if n.is_multiple_of(1000) {
                tracing::warn!(dropped = n + 1, "network audit queue full; entries dropped");
            }
        }
    }

    /// Records a decided attempt and returns its entry (whose id a later close names).
    pub fn record(&self, a: Attempt, allow: bool, rule: &str) -> NetworkAuditEntry {
        let rec = AuditRecord {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            at_ms: crate::manager::now_ms(),
            sandbox_id: a.sandbox_id,
            owner: a.owner.clone(),
            protocol: a.protocol.into(),
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
        };
        let entry = to_api(&rec);
        self.push(AuditWrite::Insert(rec));
        let _ = self.live.send(Live {
            owner: a.owner,
            entry: entry.clone(),
        });
        entry
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
        let now = crate::manager::now_ms();
        self.push(AuditWrite::Close {
            id: entry.id,
            bytes_sent: i64::try_from(sent).unwrap_or(i64::MAX),
            bytes_received: i64::try_from(received).unwrap_or(i64::MAX),
            ended_at_ms: now,
            error: error.clone(),
        });
        if sent > 0 {
            self.push(AuditWrite::Egress {
                sandbox_id: entry.sandbox_id.clone(),
                bytes: i64::try_from(sent).unwrap_or(i64::MAX),
            });
        }
        entry.bytes_sent = sent;
        entry.bytes_received = received;
        entry.ended_at_ms = Some(now);
        entry.error = error;
        let _ = self.live.send(Live {
            owner: owner.to_string(),
            entry,
        });
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
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).await.is_ok() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), rx).await;
        }
    }
}

async fn writer(store: Store, mut rx: mpsc::Receiver<Msg>) {
    let mut msgs = Vec::with_capacity(BATCH);
    let mut batch = Vec::with_capacity(BATCH);
    let mut waiting = Vec::new();
    while rx.recv_many(&mut msgs, BATCH).await > 0 {
        for m in msgs.drain(..) {
            match m {
                Msg::Write(w) => batch.push(w),
                Msg::Flush(done) => waiting.push(done),
            }
        }
        if let Err(e) = store.write_audit(&batch).await {
            tracing::warn!(error = %e, n = batch.len(), "writing network audit entries failed");
        }
        batch.clear();
        for done in waiting.drain(..) {
            let _ = done.send(());
        }
    }
}
