//! The sandboxes' DNS resolver. Every query a sandbox sends (to any address, UDP or TCP
//! port 53) arrives here; a name its policy does not allow is answered NXDOMAIN without
//! leaving the host (DNS questions can carry data out), an allowed one is forwarded to
//! the configured upstream, and addresses no sandbox may reach are dropped from the
//! answer (DNS rebinding). The addresses handed out are remembered per sandbox, so that
//! the proxy can tell which name a connection's address came from.
//!
//! No sandbox can make the resolver work without bound: its questions are limited in
//! rate and in number in flight (beyond that they are dropped before any work is spawned,
//! and summed up in the audit once a second), its TCP connections in number, and the
//! sockets toward the upstreams form one bounded pool. An owner's sandboxes together are
//! limited too, below the daemon's totals: many sandboxes of one owner cannot take every
//! question in flight (and so every upstream socket) from the other owners. Each sandbox has its own answer
//! cache, so that none can tell by timing what another one resolved.

use super::policy::Attempt;
use super::{Entry, Net, NetworkConfig};
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long an upstream has to answer before the next one is asked.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest and shortest time an answer is cached.
const TTL_MAX: u32 = 300;
const TTL_MIN: u32 = 1;
/// How long a DNS-over-TCP connection may stay idle (or take to send one question).
const TCP_IDLE: Duration = Duration::from_secs(10);
/// How often the drops of each sandbox are summed up in the audit.
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// The resolver's limits, from `[network]`.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Questions of one sandbox being worked on at once.
    pub in_flight_per_sandbox: usize,
    /// Questions of one owner's sandboxes being worked on at once.
    pub in_flight_per_owner: usize,
    /// Questions of all sandboxes being worked on at once.
    pub in_flight: usize,
    /// Questions a sandbox may send per second, on average.
    pub queries_per_second: u32,
    /// Questions a sandbox may send at once above its rate.
    pub query_burst: u32,
    /// Sockets toward the upstreams at once (UDP and TCP).
    pub upstream_sockets: usize,
    /// Open DNS-over-TCP connections of one sandbox.
    pub tcp_per_sandbox: usize,
    /// Open DNS-over-TCP connections of one owner's sandboxes.
    pub tcp_per_owner: usize,
    /// Open DNS-over-TCP connections of all sandboxes.
    pub tcp: usize,
    /// Cached answers of one sandbox.
    pub cache_per_sandbox: usize,
    /// Cached answers of all sandboxes.
    pub cache: usize,
}

/// Why the resolver could not be configured or could not get an answer.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// A `[network]` DNS limit set to 0.
    #[error("{0} must be at least 1")]
    ZeroLimit(&'static str),
    /// More upstream sockets than a semaphore can count.
    #[error("dns_upstream_sockets is too large")]
    TooManySockets,
    /// A `dns_upstream` that is not an address (the value as given).
    #[error("bad DNS upstream {0:?} (an address, optionally with :port)")]
    BadUpstream(String),
    /// A name that is not a DNS name.
    #[error("{0}")]
    BadName(#[source] hickory_proto::ProtoError),
    /// The question could not be encoded.
    #[error("encode query: {0}")]
    Encode(#[source] hickory_proto::ProtoError),
    /// The resolver is shutting down.
    #[error("the resolver is closing")]
    Closing,
    /// No upstream socket came free in time.
    #[error("every upstream socket is in use")]
    Busy,
    /// There is no upstream to ask.
    #[error("no DNS upstream is configured")]
    NoUpstream,
    /// The last upstream asked failed (earlier ones too).
    #[error("{upstream}: {source}")]
    Upstream {
        upstream: SocketAddr,
        #[source]
        source: ExchangeError,
    },
}

/// Why one question to one upstream got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// A socket operation failed.
    #[error("{0}")]
    Io(#[source] std::io::Error),
    /// The question does not fit a DNS-over-TCP length prefix.
    #[error("query too long")]
    TooLong,
    /// The upstream's TCP answer is not a DNS message.
    #[error("{0}")]
    Malformed(#[source] hickory_proto::serialize::binary::DecodeError),
    /// No answer over UDP in time.
    #[error("timed out")]
    Timeout,
    /// No answer over TCP in time.
    #[error("timed out over TCP")]
    TcpTimeout,
}

impl Limits {
    /// The limits `cfg` sets; every one must be at least 1.
    pub fn from_config(cfg: &NetworkConfig) -> Result<Limits, DnsError> {
        let l = Limits {
            in_flight_per_sandbox: cfg.dns_max_in_flight_per_sandbox,
            in_flight_per_owner: cfg.dns_max_in_flight_per_owner,
            in_flight: cfg.dns_max_in_flight,
            queries_per_second: cfg.dns_queries_per_second,
            query_burst: cfg.dns_query_burst,
            upstream_sockets: cfg.dns_upstream_sockets,
            tcp_per_sandbox: cfg.dns_tcp_connections_per_sandbox,
            tcp_per_owner: cfg.dns_tcp_connections_per_owner,
            tcp: cfg.dns_tcp_connections,
            cache_per_sandbox: cfg.dns_cache_per_sandbox,
            cache: cfg.dns_cache_total,
        };
        for (key, v) in [
            ("dns_max_in_flight_per_sandbox", l.in_flight_per_sandbox),
            ("dns_max_in_flight_per_owner", l.in_flight_per_owner),
            ("dns_max_in_flight", l.in_flight),
            ("dns_queries_per_second", l.queries_per_second as usize),
            ("dns_query_burst", l.query_burst as usize),
            ("dns_upstream_sockets", l.upstream_sockets),
            ("dns_tcp_connections_per_sandbox", l.tcp_per_sandbox),
            ("dns_tcp_connections_per_owner", l.tcp_per_owner),
            ("dns_tcp_connections", l.tcp),
            ("dns_cache_per_sandbox", l.cache_per_sandbox),
            ("dns_cache_total", l.cache),
        ] {
            if v == 0 {
                return Err(DnsError::ZeroLimit(key));
            }
        }
        // More permits than the semaphore can hold would panic at start.
        if l.upstream_sockets > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(DnsError::TooManySockets);
        }
        Ok(l)
    }
}

/// A token bucket: `rate` tokens a second, at most `burst` saved up.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(burst: u32, now: Instant) -> Self {
        Self {
            tokens: f64::from(burst),
            at: now,
        }
    }

    /// Takes a token if there is one.
    fn take(&mut self, rate: u32, burst: u32, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * f64::from(rate)).min(f64::from(burst));
        self.at = self.at.max(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Why a question or connection was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The sandbox is over its rate.
    Rate,
    /// The sandbox has as many questions in flight as it may.
    InFlight,
    /// Its owner's sandboxes together have as many questions in flight as they may.
    InFlightOwner,
    /// All sandboxes together have as many questions in flight as the daemon takes.
    InFlightTotal,
    /// The sandbox has as many TCP connections open as it may.
    Tcp,
    /// Its owner's sandboxes together have as many TCP connections open as they may.
    TcpOwner,
    /// All sandboxes together have as many TCP connections open as the daemon takes.
    TcpTotal,
}

/// What was turned away since the last report.
#[derive(Default)]
struct Drops {
    rate: AtomicU64,
    in_flight: AtomicU64,
    in_flight_owner: AtomicU64,
    in_flight_total: AtomicU64,
    tcp: AtomicU64,
    tcp_owner: AtomicU64,
    tcp_total: AtomicU64,
}

impl Drops {
    fn count(&self, why: Refusal) {
        let c = match why {
            Refusal::Rate => &self.rate,
            Refusal::InFlight => &self.in_flight,
            Refusal::InFlightOwner => &self.in_flight_owner,
            Refusal::InFlightTotal => &self.in_flight_total,
            Refusal::Tcp => &self.tcp,
            Refusal::TcpOwner => &self.tcp_owner,
            Refusal::TcpTotal => &self.tcp_total,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The audit rule summing up the drops so far (None when there were none), which
    /// start again from zero.
    fn take_summary(&self, l: &Limits) -> Option<String> {
        let take = |c: &AtomicU64| c.swap(0, Ordering::Relaxed);
        let (rate, in_flight, owner, total) = (
            take(&self.rate),
            take(&self.in_flight),
            take(&self.in_flight_owner),
            take(&self.in_flight_total),
        );
        let (tcp, tcp_owner, tcp_total) = (
            take(&self.tcp),
            take(&self.tcp_owner),
            take(&self.tcp_total),
        );
        let queries = rate + in_flight + owner + total;
        let closed = tcp + tcp_owner + tcp_total;
        if queries + closed == 0 {
            return None;
        }
        let mut why = Vec::new();
        if rate > 0 {
            why.push(format!(
                "{rate} over {}/s (burst {})",
                l.queries_per_second, l.query_burst
            ));
        }
        if in_flight > 0 {
            why.push(format!(
                "{in_flight} over {} in flight",
                l.in_flight_per_sandbox
            ));
        }
        if owner > 0 {
            why.push(format!(
                "{owner} over the owner's {} in flight",
                l.in_flight_per_owner
            ));
        }
        if total > 0 {
            why.push(format!(
                "{total} over the daemon's {} in flight",
                l.in_flight
            ));
        }
        let mut parts = Vec::new();
        if queries > 0 {
            parts.push(format!("dropped {queries} queries ({})", why.join(", ")));
        }
        if closed > 0 {
            let mut why = Vec::new();
            if tcp > 0 {
                why.push(format!("{tcp} over {} open", l.tcp_per_sandbox));
            }
            if tcp_owner > 0 {
                why.push(format!(
                    "{tcp_owner} over the owner's {} open",
                    l.tcp_per_owner
                ));
            }
            if tcp_total > 0 {
                why.push(format!("{tcp_total} over the daemon's {} open", l.tcp));
            }
            parts.push(format!(
                "closed {closed} TCP connections ({})",
                why.join(", ")
            ));
        }
        Some(format!("dns limits: {}", parts.join("; ")))
    }
}

type CacheKey = (Name, RecordType);

/// One sandbox's share of the resolver: its rate, what it has in flight, what was
/// turned away, and its own answer cache (a shared one would tell a sandbox, by timing,
/// which names another one resolved).
pub struct Quota {
    owner: Mutex<String>,
    bucket: Mutex<Bucket>,
    queries: AtomicUsize,
    tcp: AtomicUsize,
    drops: Drops,
    cache: Mutex<HashMap<CacheKey, (Instant, Message)>>,
    /// Set once the sandbox is gone: nothing more is cached for it.
    gone: AtomicBool,
}

/// What one owner's sandboxes have in flight together.
#[derive(Default)]
struct OwnerQuota {
    queries: AtomicUsize,
    tcp: AtomicUsize,
}

/// A question or connection being worked on, counted against its sandbox's limit, its
/// owner's and the daemon's until dropped.
pub struct Held {
    quota: Arc<Quota>,
    owner: Arc<OwnerQuota>,
    tcp: bool,
    total: Arc<AtomicUsize>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let (own, owner) = if self.tcp {
            (&self.quota.tcp, &self.owner.tcp)
        } else {
            (&self.quota.queries, &self.owner.queries)
        };
        own.fetch_sub(1, Ordering::AcqRel);
        owner.fetch_sub(1, Ordering::AcqRel);
        self.total.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts one more against each counter, within its maximum; the refusal of the first
/// that is full otherwise (and nothing counted).
fn hold(counters: &[(&AtomicUsize, usize, Refusal)]) -> Result<(), Refusal> {
    for (i, (c, max, why)) in counters.iter().enumerate() {
        if c.fetch_add(1, Ordering::AcqRel) >= *max {
            for (c, _, _) in &counters[..=i] {
                c.fetch_sub(1, Ordering::AcqRel);
            }
            return Err(*why);
        }
    }
    Ok(())
}

/// Asks the upstream servers, within the limits, with a small cache per sandbox.
pub struct Resolver {
    upstreams: Vec<SocketAddr>,
    limits: Limits,
    /// One permit per socket toward an upstream: whatever the upstreams do (a name server
    /// that never answers holds each socket for the whole timeout), the descriptors upstream
    /// questions take stay bounded.
    sockets: tokio::sync::Semaphore,
    quotas: Mutex<HashMap<String, Arc<Quota>>>,
    /// Per owner, what their sandboxes have in flight (an entry per owner seen).
    owners: Mutex<HashMap<String, Arc<OwnerQuota>>>,
    /// Sandboxes gone since the last report, with their last drops.
    gone: Mutex<Vec<(String, Arc<Quota>)>>,
    in_flight: Arc<AtomicUsize>,
    tcp_open: Arc<AtomicUsize>,
    /// Cached answers of all sandboxes.
    cached: AtomicUsize,
}

/// The nameservers of `/etc/resolv.conf`, port 53.
pub fn system_upstreams() -> Vec<SocketAddr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver"))
                .then(|| w.next())
                .flatten()
                .and_then(|a| a.split('%').next()?.parse::<IpAddr>().ok())
        })
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}

/// Parses `ip` or `ip:port` (`[v6]:port`).
pub fn parse_upstream(s: &str) -> Result<SocketAddr, DnsError> {
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok(sa);
    }
    s.parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, 53))
        .map_err(|_| DnsError::BadUpstream(s.to_string()))
}

fn min_ttl(m: &Message) -> u32 {
    m.answers
        .iter()
        .map(|r| r.ttl)
        .min()
        .unwrap_or(10)
        .clamp(TTL_MIN, TTL_MAX)
}

impl Resolver {
    /// A resolver over these upstreams, within these limits.
    pub fn new(upstreams: Vec<SocketAddr>, limits: Limits) -> Self {
        Self {
            upstreams,
            sockets: tokio::sync::Semaphore::new(limits.upstream_sockets),
            limits,
            quotas: Mutex::default(),
            owners: Mutex::default(),
            gone: Mutex::default(),
            in_flight: Arc::default(),
            tcp_open: Arc::default(),
            cached: AtomicUsize::new(0),
        }
    }

    /// Sandbox `id`'s share (made on its first question).
    fn quota(&self, id: &str, owner: &str) -> Arc<Quota> {
        let mut m = self.quotas.lock();
        if let Some(q) = m.get(id) {
            let mut o = q.owner.lock();
            if *o != owner {
                // A warm pool's sandbox, claimed since.
                *o = owner.to_string();
            }
            return q.clone();
        }
        let q = Arc::new(Quota {
            owner: Mutex::new(owner.to_string()),
            bucket: Mutex::new(Bucket::full(self.limits.query_burst, Instant::now())),
            queries: AtomicUsize::new(0),
            tcp: AtomicUsize::new(0),
            drops: Drops::default(),
            cache: Mutex::default(),
            gone: AtomicBool::new(false),
        });
        m.insert(id.to_string(), q.clone());
        q
    }

    /// What the owner of `q`'s sandbox has in flight.
    fn owner_of(&self, q: &Quota) -> Arc<OwnerQuota> {
        let owner = q.owner.lock().clone();
        self.owners.lock().entry(owner).or_default().clone()
    }

    /// Lets one more question of `q` in, or says why not (the refusal is counted).
    fn admit(&self, q: &Arc<Quota>) -> Option<Held> {
        let l = &self.limits;
        let owner = self.owner_of(q);
        let r = (|| {
            let within_rate =
                q.bucket
                    .lock()
                    .take(l.queries_per_second, l.query_burst, Instant::now());
            if !within_rate {
                return Err(Refusal::Rate);
            }
            hold(&[
                (&q.queries, l.in_flight_per_sandbox, Refusal::InFlight),
                (
                    &owner.queries,
                    l.in_flight_per_owner,
                    Refusal::InFlightOwner,
                ),
                (&self.in_flight, l.in_flight, Refusal::InFlightTotal),
            ])
        })();
        match r {
            Ok(()) => Some(Held {
                quota: q.clone(),
                owner,
                tcp: false,
                total: self.in_flight.clone(),
            }),
            Err(why) => {
                q.drops.count(why);
                None
            }
        }
    }

    /// Lets one more TCP connection of `q` in, or says why not (the refusal is counted).
    fn admit_tcp(&self, q: &Arc<Quota>) -> Option<Held> {
        let owner = self.owner_of(q);
        let l = &self.limits;
        match hold(&[
            (&q.tcp, l.tcp_per_sandbox, Refusal::Tcp),
            (&owner.tcp, l.tcp_per_owner, Refusal::TcpOwner),
            (&self.tcp_open, l.tcp, Refusal::TcpTotal),
        ]) {
            Ok(()) => Some(Held {
                quota: q.clone(),
                owner,
                tcp: true,
                total: self.tcp_open.clone(),
            }),
            Err(why) => {
                q.drops.count(why);
                None
            }
        }
    }

    /// Forgets sandbox `id`: its cache goes at once, its last drops with the next report.
    pub fn forget(&self, id: &str) {
        let q = self.quotas.lock().remove(id);
        if let Some(q) = q {
            self.retire(id.to_string(), q);
        }
    }

    /// Forgets every sandbox `keep` says no to.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<(String, Arc<Quota>)> = {
            let mut m = self.quotas.lock();
            let ids: Vec<String> = m.keys().filter(|id| !keep(id)).cloned().collect();
            ids.into_iter()
                .filter_map(|id| m.remove(&id).map(|q| (id, q)))
                .collect()
        };
        for (id, q) in gone {
            self.retire(id, q);
        }
    }

    fn retire(&self, id: String, q: Arc<Quota>) {
        {
            let mut c = q.cache.lock();
            q.gone.store(true, Ordering::Release);
            self.cached.fetch_sub(c.len(), Ordering::AcqRel);
            c.clear();
        }
        self.gone.lock().push((id, q));
    }

    /// Each sandbox's drops since the last call: (sandbox, owner, audit rule).
    fn take_drops(&self) -> Vec<(String, String, String)> {
        let mut all: Vec<(String, Arc<Quota>)> = std::mem::take(&mut *self.gone.lock());
        all.extend(
            self.quotas
                .lock()
                .iter()
                .map(|(id, q)| (id.clone(), q.clone())),
        );
        all.into_iter()
            .filter_map(|(id, q)| {
                let rule = q.drops.take_summary(&self.limits)?;
                let owner = q.owner.lock().clone();
                Some((id, owner, rule))
            })
            .collect()
    }

    /// The upstream's answer to one question of sandbox `q` (from its own cache while
    /// fresh).
    async fn query_for(
        &self,
        q: &Quota,
        name: &Name,
        qtype: RecordType,
    ) -> Result<Message, DnsError> {
        let key = (name.to_lowercase(), qtype);
        let fresh = q
            .cache
            .lock()
            .get(&key)
            .filter(|(until, _)| *until > Instant::now())
            .map(|(_, m)| m.clone());
        if let Some(m) = fresh {
            return Ok(m);
        }
        let m = self.query(name, qtype).await?;
        if matches!(
            m.metadata.response_code,
            ResponseCode::NoError | ResponseCode::NXDomain
        ) {
            let until = Instant::now() + Duration::from_secs(min_ttl(&m).into());
            self.cache_put(q, key, until, m.clone());
        }
        Ok(m)
    }

    /// Caches an answer for sandbox `q`, within its bound and the total one.
    fn cache_put(&self, q: &Quota, key: CacheKey, until: Instant, m: Message) {
        let over = {
            let mut c = q.cache.lock();
            if q.gone.load(Ordering::Acquire) {
                return;
            }
            if c.len() >= self.limits.cache_per_sandbox && !c.contains_key(&key) {
                let before = c.len();
                let now = Instant::now();
                c.retain(|_, (u, _)| *u > now);
                if c.len() >= self.limits.cache_per_sandbox {
                    c.clear();
                }
                self.cached.fetch_sub(before - c.len(), Ordering::AcqRel);
            }
            if c.insert(key, (until, m)).is_none() {
                self.cached.fetch_add(1, Ordering::AcqRel) + 1 > self.limits.cache
            } else {
                false
            }
        };
        if over {
            self.shrink_caches();
        }
    }

    /// Brings the cached answers of all sandboxes back under the total: the expired ones
    /// go, then the largest caches, so that one sandbox filling its share does not push
    /// out the others' answers.
    fn shrink_caches(&self) {
        let quotas: Vec<Arc<Quota>> = self.quotas.lock().values().cloned().collect();
        let now = Instant::now();
        for q in &quotas {
            let mut c = q.cache.lock();
            let before = c.len();
            c.retain(|_, (u, _)| *u > now);
            self.cached.fetch_sub(before - c.len(), Ordering::AcqRel);
        }
        while self.cached.load(Ordering::Acquire) > self.limits.cache {
            let len = |q: &Arc<Quota>| q.cache.lock().len();
            let Some(biggest) = quotas.iter().max_by_key(|q| len(q)) else {
                return;
            };
            let mut c = biggest.cache.lock();
            if c.is_empty() {
                return;
            }
            self.cached.fetch_sub(c.len(), Ordering::AcqRel);
            c.clear();
        }
    }

    /// The upstreams' answer to one question, not cached (there is no sandbox to cache
    /// it for).
    pub async fn query(&self, name: &Name, qtype: RecordType) -> Result<Message, DnsError> {
        let mut q = Message::query();
        q.metadata.recursion_desired = true;
        q.add_query(Query::query(name.clone(), qtype));
        let bytes = q.to_vec().map_err(DnsError::Encode)?;
        let mut last = DnsError::NoUpstream;
        for up in &self.upstreams {
            // Waiting for a socket is bounded like the question itself: questions beyond
            // the limits are not even taken in, so few wait here.
            let _socket = match tokio::time::timeout(UPSTREAM_TIMEOUT, self.sockets.acquire()).await
            {
                Ok(Ok(p)) => p,
                Ok(Err(_)) => return Err(DnsError::Closing),
                Err(_) => return Err(DnsError::Busy),
            };
            match exchange(*up, q.metadata.id, &bytes).await {
                Ok(m) => return Ok(m),
                Err(source) => {
                    last = DnsError::Upstream {
                        upstream: *up,
                        source,
                    }
                }
            }
        }
        Err(last)
    }

    /// The IPv4 addresses of `name` (not cached: the proxy asks for no sandbox in
    /// particular, and a shared cache would be a timing channel between sandboxes).
    pub async fn resolve_v4(&self, name: &str) -> Result<Vec<Ipv4Addr>, DnsError> {
        let n = Name::from_ascii(format!("{name}.")).map_err(DnsError::BadName)?;
        let m = self.query(&n, RecordType::A).await?;
        Ok(m.answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some(a.0),
                _ => None,
            })
            .collect())
    }
}

/// One question and answer with an upstream: UDP, then TCP when the answer is truncated.
/// Takes one socket at a time (the caller holds one permit for it): the UDP one is
/// closed before the TCP one opens.
async fn exchange(up: SocketAddr, id: u16, query: &[u8]) -> Result<Message, ExchangeError> {
    let answer = exchange_udp(up, id, query).await?;
    if !answer.metadata.truncation {
        return Ok(answer);
    }
    tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        let mut s = tokio::net::TcpStream::connect(up)
            .await
            .map_err(ExchangeError::Io)?;
        let len = u16::try_from(query.len()).map_err(|_| ExchangeError::TooLong)?;
        s.write_all(&len.to_be_bytes())
            .await
            .map_err(ExchangeError::Io)?;
        s.write_all(query).await.map_err(ExchangeError::Io)?;
        let n = s.read_u16().await.map_err(ExchangeError::Io)? as usize;
        let mut b = vec![0u8; n];
        s.read_exact(&mut b).await.map_err(ExchangeError::Io)?;
        Message::from_vec(&b).map_err(ExchangeError::Malformed)
    })
    .await
    .map_err(|_| ExchangeError::TcpTimeout)?
}

/// The UDP half of [`exchange`], from a socket of its own (a random source port for
/// every question, as spoofed answers would have to guess it).
async fn exchange_udp(up: SocketAddr, id: u16, query: &[u8]) -> Result<Message, ExchangeError> {
    let bind: SocketAddr = if up.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = tokio::net::UdpSocket::bind(bind)
        .await
        .map_err(ExchangeError::Io)?;
    sock.connect(up).await.map_err(ExchangeError::Io)?;
    sock.send(query).await.map_err(ExchangeError::Io)?;
    let mut buf = vec![0u8; 4096];
    tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        loop {
            let n = sock.recv(&mut buf).await.map_err(ExchangeError::Io)?;
            if let Ok(m) = Message::from_vec(&buf[..n])
                && m.metadata.id == id
                && m.metadata.message_type == MessageType::Response
            {
                return Ok::<_, ExchangeError>(m);
            }
        }
    })
    .await
    .map_err(|_| ExchangeError::Timeout)?
}

fn reply(req: &Message, code: ResponseCode) -> Message {
    let mut m = Message::error_msg(req.metadata.id, req.metadata.op_code, code);
    m.metadata.recursion_desired = req.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.queries = req.queries.clone();
    m
}

/// Answers one query of sandbox `sandbox`; None drops it (not DNS at all).
async fn answer(
    net: &Net,
    sandbox: &str,
    entry: &Entry,
    quota: &Quota,
    bytes: &[u8],
) -> Option<Message> {
    let req = Message::from_vec(bytes).ok()?;
    if req.metadata.message_type != MessageType::Query {
        return None;
    }
    if req.metadata.op_code != OpCode::Query || req.queries.len() != 1 {
        return Some(reply(&req, ResponseCode::NotImp));
    }
    let q = &req.queries[0];
    let qtype = q.query_type();
    let Some(name) = super::policy::normalize_name(&q.name().to_ascii()) else {
        return Some(reply(&req, ResponseCode::NXDomain));
    };
    let decision = entry.policy.name_resolvable(&name);
    let audit = |allow: bool, rule: &str, ip: Option<String>| {
        if qtype == RecordType::AAAA {
            // Answered here (the sandbox has no IPv6); its A twin is what gets audited.
            return;
        }
        net.audit.record(
            super::audit::Attempt {
                sandbox_id: sandbox.to_string(),
                owner: entry.owner.clone(),
                protocol: "dns",
                dest_name: Some(name.clone()),
                dest_ip: ip,
                dest_port: 53,
                ..Default::default()
            },
            allow,
            rule,
        );
    };
    if !decision.allow {
        audit(false, &decision.rule, None);
        return Some(reply(&req, ResponseCode::NXDomain));
    }
    if qtype == RecordType::AAAA {
        return Some(reply(&req, ResponseCode::NoError));
    }
    let upstream = match net.resolver.query_for(quota, q.name(), qtype).await {
        Ok(m) => m,
        Err(e) => {
            tracing::debug!(name, error = %e, "DNS upstream failed");
            audit(false, &format!("upstream failed: {e}"), None);
            return Some(reply(&req, ResponseCode::ServFail));
        }
    };
    let mut resp = upstream;
    resp.metadata.id = req.metadata.id;
    resp.metadata.recursion_desired = req.metadata.recursion_desired;
    resp.queries = req.queries.clone();
    let mut kept = Vec::new();
    let mut dropped = Vec::new();
    let mut ttl = TTL_MAX;
    let keep = |data: &RData, kept: &mut Vec<Ipv4Addr>, dropped: &mut Vec<String>| match data {
        RData::A(a) => {
            let ip = a.0;
            let why = net
                .blocked(ip, None)
                .map(|w| format!("blocked: {w}"))
                .or_else(|| {
                    let d = entry.policy.decide(&Attempt {
                        name: Some(&name),
                        ip: Some(ip),
                        port: None,
                    });
                    (!d.allow).then_some(d.rule)
                });
            match why {
                Some(w) => {
                    dropped.push(format!("{ip} ({w})"));
                    false
                }
                None => {
                    kept.push(ip);
                    true
                }
            }
        }
        RData::AAAA(_) => false,
        _ => true,
    };
    resp.answers.retain(|r| {
        let k = keep(&r.data, &mut kept, &mut dropped);
        if k {
            ttl = ttl.min(r.ttl);
        }
        k
    });
    resp.additionals
        .retain(|r| !matches!(r.data, RData::A(_) | RData::AAAA(_)));
    resp.authorities
        .retain(|r| !matches!(r.data, RData::A(_) | RData::AAAA(_)));
    if !kept.is_empty() {
        net.note_resolved(sandbox, &name, &kept, ttl);
    }
    let rule = if dropped.is_empty() {
        decision.rule.clone()
    } else {
        format!("{}; removed {}", decision.rule, dropped.join(", "))
    };
    audit(true, &rule, kept.first().map(|ip| ip.to_string()));
    Some(resp)
}

/// The largest answer a UDP client takes (its EDNS size, or 512).
fn udp_limit(req: &[u8]) -> usize {
    Message::from_vec(req)
        .ok()
        .and_then(|m| m.edns.map(|e| e.max_payload() as usize))
        .unwrap_or(512)
        .clamp(512, 4096)
}

/// The sandbox at `from` and its share of the resolver; None for an address that is no
/// sandbox's.
fn who(net: &Net, from: IpAddr) -> Option<(String, Arc<Entry>, Arc<Quota>)> {
    let IpAddr::V4(src) = from else { return None };
    let (sandbox, entry) = net.sandbox_of(src)?;
    let quota = net.resolver.quota(&sandbox, &entry.owner);
    Some((sandbox, entry, quota))
}

/// Serves the sandboxes' DNS over UDP. A question beyond its sandbox's limits (rate,
/// questions in flight) or the daemon's is dropped unanswered before any work is spawned
/// for it: the client retries later, as it would for a lost packet.
pub async fn serve_udp(net: Arc<Net>, sock: tokio::net::UdpSocket) {
    tokio::spawn(report_drops(net.clone()));
    let sock = Arc::new(sock);
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "DNS socket failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some((sandbox, entry, quota)) = who(&net, from.ip()) else {
            continue;
        };
        let Some(held) = net.resolver.admit(&quota) else {
            continue;
        };
        let req = buf[..n].to_vec();
        let (net, sock) = (net.clone(), sock.clone());
        tokio::spawn(async move {
            let _held = held;
            let Some(resp) = answer(&net, &sandbox, &entry, &quota, &req).await else {
                return;
            };
            let limit = udp_limit(&req);
            let mut bytes = match resp.to_vec() {
                Ok(b) => b,
                Err(_) => return,
            };
            if bytes.len() > limit {
                match resp.truncate().to_vec() {
                    Ok(b) => bytes = b,
                    Err(_) => return,
                }
            }
            let _ = sock.send_to(&bytes, from).await;
        });
    }
}

/// Serves the sandboxes' DNS over TCP. A connection beyond its sandbox's limit or the
/// daemon's is closed at once; a question on a connection beyond the limits UDP has
/// closes the connection (a client then retries, as after a dropped datagram).
pub async fn serve_tcp(net: Arc<Net>, listener: tokio::net::TcpListener) {
    loop {
        let (s, from) = match listener.accept().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "DNS listener failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some((sandbox, entry, quota)) = who(&net, from.ip()) else {
            continue;
        };
        let Some(conn) = net.resolver.admit_tcp(&quota) else {
            continue;
        };
        let net = net.clone();
        tokio::spawn(async move {
            let _conn = conn;
            serve_tcp_conn(&net, s, &sandbox, &entry, &quota).await;
        });
    }
}

async fn serve_tcp_conn(
    net: &Net,
    mut s: tokio::net::TcpStream,
    sandbox: &str,
    entry: &Entry,
    quota: &Arc<Quota>,
) {
    loop {
        let read = tokio::time::timeout(TCP_IDLE, async {
            let n = s.read_u16().await? as usize;
            let mut b = vec![0u8; n];
            s.read_exact(&mut b).await?;
            Ok::<_, std::io::Error>(b)
        })
        .await;
        let Ok(Ok(req)) = read else { return };
        let Some(_held) = net.resolver.admit(quota) else {
            return;
        };
        let Some(resp) = answer(net, sandbox, entry, quota, &req).await else {
            return;
        };
        let Ok(bytes) = resp.to_vec() else { return };
        let Ok(len) = u16::try_from(bytes.len()) else {
            return;
        };
        let wrote = tokio::time::timeout(TCP_IDLE, async {
            s.write_all(&len.to_be_bytes()).await?;
            s.write_all(&bytes).await
        })
        .await;
        if !matches!(wrote, Ok(Ok(()))) {
            return;
        }
    }
}

/// Sums up what each sandbox had turned away in one audit entry per sandbox and
/// interval, instead of one per question (a flood would flood the audit too).
async fn report_drops(net: Arc<Net>) {
    loop {
        tokio::time::sleep(REPORT_EVERY).await;
        for (sandbox, owner, rule) in net.resolver.take_drops() {
            tracing::info!(sandbox, rule, "DNS questions over the limits dropped");
            net.audit.record(
                super::audit::Attempt {
                    sandbox_id: sandbox,
                    owner,
                    protocol: "dns",
                    dest_port: 53,
                    ..Default::default()
                },
                false,
                &rule,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::rr::Record;
    use hickory_proto::rr::rdata::A;

    fn limits() -> Limits {
        Limits::from_config(&NetworkConfig::default()).unwrap()
    }

    fn held_total(r: &Resolver) -> usize {
        r.in_flight.load(Ordering::Acquire)
    }

    #[test]
    fn the_bucket_gives_the_burst_then_the_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::full(5, t0);
        assert_eq!((0..8).filter(|_| b.take(10, 5, t0)).count(), 5);
        // 10 a second: one more after 100 ms, not two.
        let t1 = t0 + Duration::from_millis(100);
        assert!(b.take(10, 5, t1));
        assert!(!b.take(10, 5, t1));
        // Saved up for a long time: still no more than the burst.
        let t2 = t1 + Duration::from_secs(60);
        assert_eq!((0..8).filter(|_| b.take(10, 5, t2)).count(), 5);
        // A clock read out of order takes nothing back.
        assert!(!b.take(10, 5, t1));
    }

    #[test]
    fn questions_over_the_limits_are_refused_and_summed_up() {
        let r = Resolver::new(
            vec![],
            Limits {
                in_flight_per_sandbox: 2,
                in_flight: 3,
                ..limits()
            },
        );
        let a = r.quota("a", "alice");
        let b = r.quota("b", "bob");
        let a1 = r.admit(&a).unwrap();
        let _a2 = r.admit(&a).unwrap();
        assert!(r.admit(&a).is_none(), "a third in flight for a");
        let _b1 = r.admit(&b).unwrap();
        assert!(r.admit(&b).is_none(), "a fourth in flight in all");
        assert_eq!(held_total(&r), 3);
        drop(a1);
        assert_eq!(held_total(&r), 2);
        let _b2 = r.admit(&b).unwrap();
        let mut drops = r.take_drops();
        drops.sort();
        assert_eq!(
            drops,
            vec![
                (
                    "a".into(),
                    "alice".into(),
                    "dns limits: dropped 1 queries (1 over 2 in flight)".into()
                ),
                (
                    "b".into(),
                    "bob".into(),
                    "dns limits: dropped 1 queries (1 over the daemon's 3 in flight)".into()
                ),
            ]
        );
        // Reported once: the counts start again.
        assert!(r.take_drops().is_empty());
    }

    #[test]
    fn an_owners_sandboxes_share_a_limit_below_the_daemons() {
        let r = Resolver::new(
            vec![],
            Limits {
                in_flight_per_sandbox: 2,
                in_flight_per_owner: 3,
                in_flight: 10,
                tcp_per_sandbox: 2,
                tcp_per_owner: 2,
                tcp: 10,
                ..limits()
            },
        );
        let a = r.quota("a", "alice");
        let b = r.quota("b", "alice");
        let c = r.quota("c", "carol");
        let held: Vec<Held> = [&a, &a, &b].iter().map(|q| r.admit(q).unwrap()).collect();
        assert!(r.admit(&b).is_none(), "a fourth in flight for alice");
        let _c = r.admit(&c).unwrap();
        let _t1 = r.admit_tcp(&a).unwrap();
        let _t2 = r.admit_tcp(&b).unwrap();
        assert!(r.admit_tcp(&b).is_none(), "a third connection for alice");
        assert!(r.admit_tcp(&c).is_some());
        drop(held);
        assert!(r.admit(&b).is_some(), "alice's places were given back");
        let mut drops = r.take_drops();
        drops.sort();
        assert_eq!(
            drops,
            vec![(
                "b".into(),
                "alice".into(),
                "dns limits: dropped 1 queries (1 over the owner's 3 in flight); closed 1 \
                 TCP connections (1 over the owner's 2 open)"
                    .into()
            )]
        );
    }

    #[test]
    fn the_rate_is_per_sandbox() {
        let r = Resolver::new(
            vec![],
            Limits {
                queries_per_second: 1,
                query_burst: 3,
                ..limits()
            },
        );
        let a = r.quota("a", "alice");
        let b = r.quota("b", "bob");
        // Answered at once, so nothing stays in flight: only the rate refuses.
        let admitted = (0..10).filter(|_| r.admit(&a).is_some()).count();
        assert_eq!(admitted, 3);
        assert!(r.admit(&b).is_some(), "b has a bucket of its own");
        assert_eq!(held_total(&r), 0);
        assert_eq!(
            r.take_drops(),
            vec![(
                "a".into(),
                "alice".into(),
                "dns limits: dropped 7 queries (7 over 1/s (burst 3))".into()
            )]
        );
    }

    #[test]
    fn tcp_connections_are_capped_per_sandbox_and_in_all() {
        let r = Resolver::new(
            vec![],
            Limits {
                tcp_per_sandbox: 1,
                tcp: 2,
                ..limits()
            },
        );
        let a = r.quota("a", "alice");
        let b = r.quota("b", "bob");
        let c = r.quota("c", "carol");
        let a1 = r.admit_tcp(&a).unwrap();
        assert!(r.admit_tcp(&a).is_none());
        let _b1 = r.admit_tcp(&b).unwrap();
        assert!(r.admit_tcp(&c).is_none());
        drop(a1);
        let _c1 = r.admit_tcp(&c).unwrap();
        let mut drops = r.take_drops();
        drops.sort();
        assert_eq!(
            drops.iter().map(|d| d.2.as_str()).collect::<Vec<_>>(),
            vec![
                "dns limits: closed 1 TCP connections (1 over 1 open)",
                "dns limits: closed 1 TCP connections (1 over the daemon's 2 open)",
            ]
        );
    }

    #[test]
    fn zero_limits_are_refused() {
        let cfg = NetworkConfig {
            dns_queries_per_second: 0,
            ..NetworkConfig::default()
        };
        assert_eq!(
            Limits::from_config(&cfg).unwrap_err().to_string(),
            "dns_queries_per_second must be at least 1"
        );
    }

    /// A test upstream on loopback: answers every A question with 192.0.2.N, N counting
    /// the questions it got.
    async fn counting_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let asked = Arc::new(AtomicUsize::new(0));
        let n = asked.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let Ok((len, from)) = sock.recv_from(&mut buf).await else {
                    return;
                };
                let q = Message::from_vec(&buf[..len]).unwrap();
                let k = n.fetch_add(1, Ordering::AcqRel) + 1;
                let mut m = Message::response(q.metadata.id, OpCode::Query);
                m.queries = q.queries.clone();
                m.add_answer(Record::from_rdata(
                    q.queries[0].name().clone(),
                    60,
                    RData::A(A(Ipv4Addr::new(192, 0, 2, k as u8))),
                ));
                let _ = sock.send_to(&m.to_vec().unwrap(), from).await;
            }
        });
        (addr, asked)
    }

    fn first_a(m: &Message) -> Ipv4Addr {
        match m.answers[0].data {
            RData::A(a) => a.0,
            ref other => panic!("not an A record: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_sandbox_never_gets_another_ones_cached_answer() {
        let (up, asked) = counting_upstream().await;
        let r = Resolver::new(vec![up], limits());
        let name = Name::from_ascii("seen.example.").unwrap();
        let a = r.quota("a", "alice");
        let b = r.quota("b", "bob");
        let first = r.query_for(&a, &name, RecordType::A).await.unwrap();
        assert_eq!(first_a(&first), Ipv4Addr::new(192, 0, 2, 1));
        let again = r.query_for(&a, &name, RecordType::A).await.unwrap();
        assert_eq!(first_a(&again), Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(
            asked.load(Ordering::Acquire),
            1,
            "a's second answer is cached"
        );
        // b asks upstream itself (and so takes as long as a did the first time).
        let theirs = r.query_for(&b, &name, RecordType::A).await.unwrap();
        assert_eq!(first_a(&theirs), Ipv4Addr::new(192, 0, 2, 2));
        assert_eq!(asked.load(Ordering::Acquire), 2);
        // The proxy's lookups use no cache at all.
        assert_eq!(
            r.resolve_v4("seen.example").await.unwrap(),
            vec![Ipv4Addr::new(192, 0, 2, 3)]
        );
        // A sandbox that goes takes its cache with it.
        assert_eq!(r.cached.load(Ordering::Acquire), 2);
        r.forget("a");
        assert_eq!(r.cached.load(Ordering::Acquire), 1);
        let a = r.quota("a", "alice");
        let fresh = r.query_for(&a, &name, RecordType::A).await.unwrap();
        assert_eq!(first_a(&fresh), Ipv4Addr::new(192, 0, 2, 4));
    }

    fn answer_for(name: &str) -> (CacheKey, Message) {
        let n = Name::from_ascii(name).unwrap();
        let mut m = Message::response(1, OpCode::Query);
        m.add_query(Query::query(n.clone(), RecordType::A));
        ((n, RecordType::A), m)
    }

    fn sizes(r: &Resolver, ids: &[&str]) -> Vec<usize> {
        let m = r.quotas.lock();
        ids.iter().map(|id| m[*id].cache.lock().len()).collect()
    }

    #[test]
    fn the_caches_are_bounded_per_sandbox_and_in_all() {
        let r = Resolver::new(
            vec![],
            Limits {
                cache_per_sandbox: 4,
                cache: 6,
                ..limits()
            },
        );
        let until = Instant::now() + Duration::from_secs(60);
        let x = r.quota("x", "xavier");
        for i in 0..10 {
            let (k, m) = answer_for(&format!("n{i}.x.example."));
            r.cache_put(&x, k, until, m);
            assert!(sizes(&r, &["x"])[0] <= 4);
        }
        r.forget("x");
        assert_eq!(r.cached.load(Ordering::Acquire), 0);
        let a = r.quota("a", "alice");
        let b = r.quota("b", "bob");
        for i in 0..4 {
            let (k, m) = answer_for(&format!("n{i}.a.example."));
            r.cache_put(&a, k, until, m);
        }
        for i in 0..3 {
            let (k, m) = answer_for(&format!("n{i}.b.example."));
            r.cache_put(&b, k, until, m);
        }
        let s = sizes(&r, &["a", "b"]);
        // Over the total: the biggest cache went, not the newcomer's.
        assert_eq!(s, vec![0, 3]);
        assert_eq!(r.cached.load(Ordering::Acquire), s[0] + s[1]);
        // Expired answers go first.
        let past = Instant::now();
        let c = r.quota("c", "carol");
        for i in 0..4 {
            let (k, m) = answer_for(&format!("n{i}.c.example."));
            r.cache_put(&c, k, past, m);
        }
        let (k, m) = answer_for("last.c.example.");
        r.cache_put(&c, k, until, m);
        let s = sizes(&r, &["a", "b", "c"]);
        assert_eq!(s[2], 1, "{s:?}");
        assert_eq!(r.cached.load(Ordering::Acquire), s.iter().sum::<usize>());
        assert!(s.iter().sum::<usize>() <= 6, "{s:?}");
    }

    #[tokio::test]
    async fn a_silent_upstream_holds_no_more_sockets_than_the_pool() {
        // Never answers; remembers the source port of every question.
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let up = sock.local_addr().unwrap();
        let ports = Arc::new(Mutex::new(std::collections::HashSet::new()));
        let seen = ports.clone();
        let server = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok((_, from)) = sock.recv_from(&mut buf).await {
                seen.lock().insert(from.port());
            }
        });
        let r = Arc::new(Resolver::new(
            vec![up],
            Limits {
                upstream_sockets: 3,
                ..limits()
            },
        ));
        let asks: Vec<_> = (0..20)
            .map(|i| {
                let r = r.clone();
                tokio::spawn(async move {
                    let n = Name::from_ascii(format!("q{i}.blackhole.example.")).unwrap();
                    r.query(&n, RecordType::A).await
                })
            })
            .collect();
        // Well within the upstream timeout: three questions are out, the others wait.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(ports.lock().len(), 3);
        assert_eq!(r.sockets.available_permits(), 0);
        for a in asks {
            assert!(a.await.unwrap().is_err());
        }
        assert_eq!(r.sockets.available_permits(), 3);
        server.abort();
    }

    #[test]
    fn a_bad_upstream_address_is_named() {
        assert_eq!(
            parse_upstream("8.8.8").unwrap_err().to_string(),
            "bad DNS upstream \"8.8.8\" (an address, optionally with :port)"
        );
        assert_eq!(
            parse_upstream("192.0.2.1").unwrap(),
            "192.0.2.1:53".parse::<SocketAddr>().unwrap()
        );
    }

    #[tokio::test]
    async fn an_upstream_failure_keeps_the_upstream_and_the_os_error() {
        use std::error::Error as _;
        // A port nothing listens on: loopback answers the question with a refusal.
        let closed = {
            let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            s.local_addr().unwrap()
        };
        let r = Resolver::new(vec![closed], limits());
        let n = Name::from_ascii("refused.example.").unwrap();
        let e = r.query(&n, RecordType::A).await.unwrap_err();
        assert!(e.to_string().starts_with(&format!("{closed}: ")), "{e}");
        let exchange = e.source().expect("the exchange's failure is kept");
        let io = exchange.source().expect("the OS error is kept");
        assert_eq!(
            io.downcast_ref::<std::io::Error>()
                .map(std::io::Error::kind),
            Some(std::io::ErrorKind::ConnectionRefused)
        );
        let none = Resolver::new(vec![], limits());
        assert_eq!(
            none.query(&n, RecordType::A).await.unwrap_err().to_string(),
            "no DNS upstream is configured"
        );
        assert_eq!(ExchangeError::Timeout.to_string(), "timed out");
        assert_eq!(ExchangeError::TcpTimeout.to_string(), "timed out over TCP");
    }
}
