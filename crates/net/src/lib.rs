//! Sandbox networking: per-sandbox network namespaces, the egress policy, the host-side DNS
//! resolver and egress proxy, and the audit of outbound connections.
//!
//! Each container sandbox joins a namespace of its own, prepared ahead in a pool, with a
//! veth link to the host. The host end of every link has the gateway address; the
//! sandbox's end has its own address and, unless its policy is `none`, a default route
//! through the gateway. Nothing a sandbox sends is ever routed on by the host: the
//! daemon's nftables table sends every TCP connection to the egress proxy and every DNS
//! query to the resolver, and drops the rest. The proxy and resolver decide with the
//! sandbox's policy and record every attempt in the audit.

pub mod approval;
pub mod audit;
pub mod dns;
mod error;
pub mod intercept;
pub mod link;
pub mod nft;
pub mod policy;
pub mod pool;
pub mod proxy;
pub mod runtime;
pub mod sniff;

pub use error::NetError;
use link::{InnerLink, Prepared};
use parking_lot::{Mutex, RwLock};
use policy::{Cidr, OperatorAllow, Policy};
use sandpit_api::network::{NetworkMode, NetworkPolicy, PortSpec};
use sandpit_store::Store;
use serde::Deserialize;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The `[network]` section of the config file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    /// Give container sandboxes a network of their own. Unset: yes when the host can
    /// enforce policies (nftables present), else sandboxes keep loopback only.
    pub enabled: Option<bool>,
    /// IPv4 network of the sandboxes' addresses (at least a /24). Unset: a free /16 in
    /// 10.200.0.0 to 10.254.0.0, kept across restarts.
    pub subnet: Option<String>,
    /// Namespaces prepared ahead.
    pub pool_size: usize,
    /// Mode of sandboxes created without a policy.
    pub default_mode: NetworkMode,
    /// DNS servers the resolver asks (`ip` or `ip:port`). Unset: `/etc/resolv.conf`'s.
    pub dns_upstream: Vec<String>,
    /// DNS questions of one sandbox the resolver works on at once; more are dropped.
    pub dns_max_in_flight_per_sandbox: usize,
    /// DNS questions of one owner's sandboxes together the resolver works on at once
    /// (below the daemon's total and its upstream sockets, so that many sandboxes of one
    /// owner leave room for the others); more are dropped.
    pub dns_max_in_flight_per_owner: usize,
    /// DNS questions of all sandboxes the resolver works on at once; more are dropped.
    pub dns_max_in_flight: usize,
    /// DNS questions a sandbox may send per second on average (a token bucket); more
    /// are dropped.
    pub dns_queries_per_second: u32,
    /// DNS questions a sandbox may send at once above that rate (the bucket's size).
    pub dns_query_burst: u32,
    /// Sockets the resolver has open toward the upstreams at once (UDP and TCP).
    pub dns_upstream_sockets: usize,
    /// Open DNS-over-TCP connections per sandbox; more are closed at once.
    pub dns_tcp_connections_per_sandbox: usize,
    /// Open DNS-over-TCP connections of one owner's sandboxes together; more are closed.
    pub dns_tcp_connections_per_owner: usize,
    /// Open DNS-over-TCP connections of all sandboxes; more are closed at once.
    pub dns_tcp_connections: usize,
    /// Cached DNS answers per sandbox (each sandbox has a cache of its own).
    pub dns_cache_per_sandbox: usize,
    /// Cached DNS answers of all sandboxes.
    pub dns_cache_total: usize,
    /// Exceptions to the ranges no sandbox may reach (private ranges, link-local, the
    /// host...), for every sandbox.
    pub operator_allow: Vec<OperatorAllowSpec>,
    /// How long the proxy waits for a client's first bytes (TLS hello, HTTP request)
    /// before deciding without a name.
    pub peek_timeout_ms: u64,
    /// How long the proxy waits to connect upstream.
    pub connect_timeout_ms: u64,
    /// Open proxied connections per sandbox, at most.
    pub max_connections_per_sandbox: usize,
    /// Open proxied connections of all sandboxes together, at most. Unset: 16384, or an
    /// eighth of the daemon's descriptor limit when that is smaller (each costs two).
    pub max_connections: Option<usize>,
    /// Open proxied connections of one owner's sandboxes together, at most. Unset: half
    /// of `max_connections`, so that many sandboxes of one owner leave the others room.
    pub max_connections_per_owner: Option<usize>,
    /// Audit entries older than this are deleted; 0 keeps them.
    pub audit_retention_days: u64,
    /// New audit rows one sandbox may add per minute (DNS takes at most half); more are
    /// counted in a summary row. Identical attempts within the minute are one row.
    pub audit_rows_per_sandbox_per_minute: u64,
    /// Audit rows kept in all; beyond, the oldest are deleted (0: no cap).
    pub audit_max_rows: u64,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            enabled: None,
            subnet: None,
            pool_size: 4,
            default_mode: NetworkMode::None,
            dns_upstream: Vec::new(),
            dns_max_in_flight_per_sandbox: 64,
            dns_max_in_flight_per_owner: 128,
            dns_max_in_flight: 1024,
            dns_queries_per_second: 200,
            dns_query_burst: 400,
            dns_upstream_sockets: 256,
            dns_tcp_connections_per_sandbox: 16,
            dns_tcp_connections_per_owner: 64,
            dns_tcp_connections: 256,
            dns_cache_per_sandbox: 1024,
            dns_cache_total: 16384,
            operator_allow: Vec::new(),
            peek_timeout_ms: 500,
            connect_timeout_ms: 10_000,
            max_connections_per_sandbox: 512,
            max_connections: None,
            max_connections_per_owner: None,
            audit_retention_days: 30,
            audit_rows_per_sandbox_per_minute: 1200,
            audit_max_rows: 1_000_000,
        }
    }
}

/// One operator exception: a network, optionally only some ports.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorAllowSpec {
    pub cidr: String,
    #[serde(default)]
    pub ports: Vec<PortSpec>,
}

/// A sandbox's policy as the proxy and resolver see it.
pub struct Entry {
    pub owner: String,
    pub policy: Arc<Policy>,
}

/// A running sandbox's link.
struct Slot {
    address: Ipv4Addr,
    host_if: String,
    netns: Arc<OwnedFd>,
    inner: Arc<Mutex<InnerLink>>,
}

/// The host's own addresses and the networks its links are on.
#[derive(Default)]
struct HostView {
    addrs: Vec<Ipv4Addr>,
    nets: Vec<Cidr>,
}

/// Names a sandbox's resolver handed out addresses for.
#[derive(Default)]
struct Seen {
    /// Address -> (name, until), oldest answer first. Each name keeps its own expiry: one
    /// shared by the address would let a sandbox keep an old answer for one name alive by
    /// looking up another name of the same address again and again.
    by_ip: HashMap<Ipv4Addr, Vec<(String, Instant)>>,
}

/// Most names remembered per address.
const SEEN_NAMES_MAX: usize = 8;

impl Seen {
    /// Remembers that `name` resolved to `ips`, an answer that holds until `until`.
    fn note(&mut self, name: &str, ips: &[Ipv4Addr], now: Instant, until: Instant) {
        if self.by_ip.len() >= SEEN_MAX {
            self.by_ip.retain(|_, names| {
                names.retain(|(_, u)| *u > now);
                !names.is_empty()
            });
            if self.by_ip.len() >= SEEN_MAX {
                self.by_ip.clear();
            }
        }
        for ip in ips {
            let names = self.by_ip.entry(*ip).or_default();
            let mut until = until;
            names.retain(|(n, u)| {
                if n == name {
                    until = until.max(*u);
                }
                n != name && *u > now
            });
            names.push((name.to_string(), until));
            if names.len() > SEEN_NAMES_MAX {
                names.remove(0);
            }
        }
    }

    /// The name whose answer gave `ip` last, while that answer holds.
    fn name_of(&self, ip: Ipv4Addr, now: Instant) -> Option<String> {
        self.by_ip
            .get(&ip)?
            .iter()
            .rev()
            .find(|(_, u)| *u > now)
            .map(|(n, _)| n.clone())
    }

    /// Whether an answer for `name` that still holds gave `ip`.
    fn has(&self, name: &str, ip: Ipv4Addr, now: Instant) -> bool {
        self.by_ip
            .get(&ip)
            .is_some_and(|names| names.iter().any(|(n, u)| n == name && *u > now))
    }
}

/// Most addresses remembered per sandbox.
const SEEN_MAX: usize = 4096;

/// What the daemon remembers of its networking between runs.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
struct Persisted {
    tag: String,
    subnet: String,
}

/// The daemon's networking.
pub struct Net {
    cfg: NetworkConfig,
    subnet: Cidr,
    gateway: Ipv4Addr,
    if_prefix: String,
    table: String,
    pool: pool::Pool,
    alloc: Arc<Mutex<pool::Alloc>>,
    slots: Mutex<HashMap<String, Slot>>,
    /// Host link names taken from the pool and not attached (or given back) yet.
    in_flight: Mutex<std::collections::HashSet<String>>,
    /// The table's rules, applied again should anything remove them.
    rules: nft::Rules,
    by_ip: RwLock<HashMap<Ipv4Addr, String>>,
    policies: RwLock<HashMap<String, Arc<Entry>>>,
    /// What a sandbox without a policy gets.
    none_entry: Arc<Entry>,
    host: RwLock<HostView>,
    host_nl: Mutex<link::Netlink>,
    operator: Vec<OperatorAllow>,
    pub(crate) resolver: dns::Resolver,
    seen: Mutex<HashMap<String, Seen>>,
    /// The record of outbound attempts, which the API lists and streams.
    pub audit: audit::Audit,
    conns: Mutex<Conns>,
    /// Open proxied connections of all sandboxes together, at most.
    max_conns: usize,
    /// Open proxied connections of one owner's sandboxes together, at most.
    max_conns_per_owner: usize,
    interceptor: RwLock<Option<Arc<dyn intercept::Interceptor>>>,
    approval_gate: RwLock<Option<Arc<dyn approval::ApprovalGate>>>,
    listeners: Mutex<Option<Listeners>>,
    pub(crate) peek_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    store: Store,
    /// Locks on the subnet and link-name prefix, held while the daemon runs.
    _locks: Vec<std::fs::File>,
}

struct Listeners {
    proxy: std::net::TcpListener,
    dns_udp: std::net::UdpSocket,
    dns_tcp: std::net::TcpListener,
}

/// A held connection of a sandbox (counted against its limit until dropped).
pub struct ConnSlot<'a> {
    net: &'a Net,
    id: String,
    owner: String,
}

/// Open proxied connections, per sandbox, per owner and in all.
#[derive(Default)]
struct Conns {
    per_sandbox: HashMap<String, usize>,
    per_owner: HashMap<String, usize>,
    total: usize,
}

/// Counts one less for `key`, forgetting it at zero.
fn count_down(m: &mut HashMap<String, usize>, key: &str) {
    if let Some(n) = m.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            m.remove(key);
        }
    }
}

impl Drop for ConnSlot<'_> {
    fn drop(&mut self) {
        let mut c = self.net.conns.lock();
        c.total = c.total.saturating_sub(1);
        count_down(&mut c.per_sandbox, &self.id);
        count_down(&mut c.per_owner, &self.owner);
    }
}

/// The default cap on proxied connections of all sandboxes.
const MAX_CONNECTIONS: usize = 16384;

/// The total cap on proxied connections: by default at most an eighth of the descriptor
/// limit (a spliced connection holds two), so that sandboxes together cannot run the
/// daemon out of descriptors; a configured value is kept.
fn total_conn_cap(configured: Option<usize>, fd_limit: Option<u64>) -> usize {
    match (configured, fd_limit) {
        (Some(n), _) => n,
        (None, Some(limit)) => {
            MAX_CONNECTIONS.min(usize::try_from(limit / 8).unwrap_or(usize::MAX).max(1))
        }
        (None, None) => MAX_CONNECTIONS,
    }
}

fn cfg_err(message: impl Into<String>) -> NetError {
    NetError::Config(message.into())
}

/// Takes an exclusive lock on `/run/sandpit/net/<name>.lock`; None when another daemon
/// holds it.
fn try_lock(name: &str) -> Result<Option<std::fs::File>, NetError> {
    use std::os::fd::AsRawFd;
    let dir = Path::new("/run/sandpit/net");
    std::fs::create_dir_all(dir)
        .map_err(|e| NetError::Io(format!("create {}", dir.display()), e))?;
    let path = dir.join(format!("{name}.lock"));
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| NetError::Io(format!("open {}", path.display()), e))?;
    // SAFETY: flock on a descriptor we own.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    Ok((r == 0).then_some(f))
}

/// Binds a socket to the gateway address before any link has it (IP_FREEBIND).
fn bind_gateway(gw: Ipv4Addr, kind: socket2::Type) -> std::io::Result<socket2::Socket> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, kind, None)?;
    s.set_freebind_v4(true)?;
    s.set_cloexec(true)?;
    s.bind(&SocketAddr::from((gw, 0)).into())?;
    Ok(s)
}

fn local_port(s: &socket2::Socket) -> std::io::Result<u16> {
    s.local_addr()?
        .as_socket()
        .map(|a| a.port())
        .ok_or_else(|| std::io::Error::other("not an inet socket"))
}

impl Net {
    /// Sets up the daemon's networking: the subnet, the proxy's and resolver's sockets,
    /// the nftables table and the namespace worker. `None` when networking is off (by
    /// configuration, or because the host cannot enforce it and it was not asked for).
    pub fn start(
        cfg: &NetworkConfig,
        data_dir: &Path,
        store: Store,
        last_audit_id: i64,
    ) -> Result<Option<Arc<Net>>, NetError> {
        if cfg.enabled == Some(false) {
            tracing::info!("sandbox networking is off: sandboxes have loopback only");
            return Ok(None);
        }
        match Self::setup(cfg, data_dir, store, last_audit_id) {
            Ok(n) => Ok(Some(n)),
            Err(e) if cfg.enabled.is_none() => {
                tracing::warn!(error = %e, "sandbox networking is not available; sandboxes have loopback only");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn setup(
        cfg: &NetworkConfig,
        data_dir: &Path,
        store: Store,
        last_audit_id: i64,
    ) -> Result<Arc<Net>, NetError> {
        if !nft::available() {
            return Err(cfg_err(
                "the `nft` tool (nftables) is needed to enforce egress policies",
            ));
        }
        if cfg.max_connections == Some(0)
            || cfg.max_connections_per_owner == Some(0)
            || cfg.max_connections_per_sandbox == 0
        {
            return Err(cfg_err(
                "max_connections, max_connections_per_owner and max_connections_per_sandbox \
                 must be at least 1",
            ));
        }
        if cfg.pool_size > 256 {
            return Err(cfg_err("pool_size is at most 256"));
        }
        let mut operator = Vec::new();
        for a in &cfg.operator_allow {
            operator.push(OperatorAllow {
                cidr: Cidr::parse(&a.cidr).map_err(NetError::ConfigValue)?,
                ports: policy::parse_ports(&a.ports).map_err(NetError::ConfigValue)?,
            });
        }
        let upstreams = if cfg.dns_upstream.is_empty() {
            dns::system_upstreams()
        } else {
            cfg.dns_upstream
                .iter()
                .map(|u| dns::parse_upstream(u))
                .collect::<Result<Vec<_>, _>>()
                .map_err(NetError::Dns)?
        };
        let dns_limits = dns::Limits::from_config(cfg).map_err(NetError::Dns)?;
        let max_conns = total_conn_cap(
            cfg.max_connections,
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                .ok()
                .map(|(soft, _)| soft),
        );
        if upstreams.is_empty() {
            tracing::warn!(
                "no DNS upstream (none configured, none in /etc/resolv.conf): sandboxes cannot resolve names"
            );
        }
        let mut host_nl =
            link::Netlink::open().map_err(|e| NetError::Io("open a netlink socket".into(), e))?;
        let (persisted, locks) = Self::choose(cfg, data_dir, &mut host_nl)?;
        let subnet = Cidr::parse(&persisted.subnet).map_err(NetError::ConfigValue)?;
        let gateway = Ipv4Addr::from(u32::from(subnet.network()) + 1);
        let if_prefix = format!("sp{}", persisted.tag);
        let table = format!("sandpit_{}", persisted.tag);
        let io = |what: &str| {
            let what = what.to_string();
            move |e: std::io::Error| NetError::Io(what.clone(), e)
        };
        let proxy =
            bind_gateway(gateway, socket2::Type::STREAM).map_err(io("bind the egress proxy"))?;
        proxy
            .listen(1024)
            .map_err(io("listen on the egress proxy"))?;
        let dns_udp =
            bind_gateway(gateway, socket2::Type::DGRAM).map_err(io("bind the DNS resolver"))?;
        let dns_tcp =
            bind_gateway(gateway, socket2::Type::STREAM).map_err(io("bind the DNS resolver"))?;
        dns_tcp
            .listen(256)
            .map_err(io("listen on the DNS resolver"))?;
        let rules = nft::Rules {
            table: table.clone(),
            if_prefix: if_prefix.clone(),
            subnet,
            gateway,
            proxy_port: local_port(&proxy).map_err(io("proxy port"))?,
            dns_udp_port: local_port(&dns_udp).map_err(io("DNS port"))?,
            dns_tcp_port: local_port(&dns_tcp).map_err(io("DNS port"))?,
            // Ten times the resolver's own limits: the resolver decides (and audits its
            // drops); the kernel only stops a flood far beyond them before it crowds the
            // resolver's socket. What the kernel drops is not audited.
            dns_packets_per_second: cfg.dns_queries_per_second.saturating_mul(10),
            dns_packet_burst: cfg.dns_query_burst.saturating_mul(10),
        };
        nft::apply(&rules).map_err(NetError::Nft)?;
        let table_name = rules.table.clone();
        sweep_foreign(&table_name, &mut host_nl);
        let alloc = Arc::new(Mutex::new(pool::Alloc::new(
            subnet.network(),
            subnet.prefix(),
        )));
        let pool = pool::Pool::start(
            alloc.clone(),
            pool::Naming {
                prefix: if_prefix.clone(),
                gateway,
            },
        )
        .map_err(io("start the network worker"))?;
        // One namespace made and thrown away: a host where that cannot work is found out
        // now, not by every create.
        match pool.acquire() {
            Ok(p) => {
                alloc.lock().release(p.address);
            }
            Err(e) => {
                let _ = nft::delete(&rules.table);
                return Err(NetError::Io("prepare a sandbox network".into(), e));
            }
        }
        for s in [&proxy, &dns_udp, &dns_tcp] {
            s.set_nonblocking(true).map_err(io("socket"))?;
        }
        let net = Arc::new(Net {
            cfg: cfg.clone(),
            subnet,
            gateway,
            if_prefix,
            table: table_name,
            pool,
            alloc,
            slots: Mutex::default(),
            in_flight: Mutex::default(),
            rules,
            by_ip: RwLock::default(),
            policies: RwLock::default(),
            none_entry: Arc::new(Entry {
                owner: sandpit_store::POOL_OWNER.to_string(),
                policy: Arc::new(Policy::none()),
            }),
            host: RwLock::default(),
            host_nl: Mutex::new(host_nl),
            operator,
            resolver: dns::Resolver::new(upstreams, dns_limits),
            seen: Mutex::default(),
            audit: audit::Audit::start(
                store.clone(),
                last_audit_id,
                audit::Limits {
                    rows_per_sandbox_per_minute: cfg.audit_rows_per_sandbox_per_minute,
                    max_rows: cfg.audit_max_rows,
                },
            ),
            conns: Mutex::default(),
            max_conns,
            max_conns_per_owner: cfg
                .max_connections_per_owner
                .unwrap_or((max_conns / 2).max(1)),
            interceptor: RwLock::new(None),
            approval_gate: RwLock::new(None),
            listeners: Mutex::new(Some(Listeners {
                proxy: proxy.into(),
                dns_udp: dns_udp.into(),
                dns_tcp: dns_tcp.into(),
            })),
            peek_timeout: Duration::from_millis(cfg.peek_timeout_ms.clamp(10, 10_000)),
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms.clamp(100, 120_000)),
            store,
            _locks: locks,
        });
        net.refresh_host();
        tracing::info!(subnet = %subnet, gateway = %gateway, table = %net.table, "sandbox networking ready");
        Ok(net)
    }

    /// The link-name tag and subnet: this data directory's from before (its sandboxes
    /// may still be running), or new ones no other daemon here uses.
    fn choose(
        cfg: &NetworkConfig,
        data_dir: &Path,
        nl: &mut link::Netlink,
    ) -> Result<(Persisted, Vec<std::fs::File>), NetError> {
        let file = data_dir.join("network.json");
        let old: Option<Persisted> = std::fs::read(&file)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let routes = nl
            .routes_v4()
            .map_err(|e| NetError::Io("list routes".into(), e))?;
        let links: HashMap<u32, String> = nl
            .links()
            .map_err(|e| NetError::Io("list links".into(), e))?
            .into_iter()
            .collect();
        let mut locks = Vec::new();
        let tag = match old.as_ref().map(|p| p.tag.clone()) {
            Some(t) if t.len() == 5 && t.bytes().all(|b| b.is_ascii_hexdigit()) => {
                let lock = try_lock(&format!("tag-{t}"))?
                    .ok_or_else(|| cfg_err("another daemon uses this data directory's network"))?;
                locks.push(lock);
                t
            }
            _ => {
                let mut found = None;
                for _ in 0..64 {
                    let t = format!("{:05x}", rand::random::<u32>() & 0xf_ffff);
                    let prefix = format!("sp{t}");
                    if links.values().any(|n| n.starts_with(&prefix)) {
                        continue;
                    }
                    if let Some(l) = try_lock(&format!("tag-{t}"))? {
                        locks.push(l);
                        found = Some(t);
                        break;
                    }
                }
                found.ok_or_else(|| cfg_err("no free link-name tag"))?
            }
        };
        let own_prefix = format!("sp{tag}");
        // A route through a link of ours is ours; any other one in a subnet means the
        // subnet is in use on this host.
        let clashes = |c: &Cidr| {
            routes.iter().any(|(dst, len, oif)| {
                let ours = oif
                    .and_then(|i| links.get(&i))
                    .is_some_and(|n| n.starts_with(&own_prefix));
                !ours && *len > 0 && c.overlaps(&Cidr::new(*dst, *len))
            })
        };
        let mut candidates: Vec<Cidr> = Vec::new();
        let explicit = cfg.subnet.is_some();
        if let Some(s) = &cfg.subnet {
            let c = Cidr::parse(s).map_err(NetError::ConfigValue)?;
            if c.prefix() > 24 || c.prefix() < 8 {
                return Err(cfg_err("subnet must be between a /8 and a /24"));
            }
            candidates.push(c);
        } else {
            if let Some(c) = old.as_ref().and_then(|p| Cidr::parse(&p.subnet).ok()) {
                candidates.push(c);
            }
            candidates.extend((200..=254).map(|b| Cidr::new(Ipv4Addr::new(10, b, 0, 0), 16)));
        }
        let mut chosen = None;
        for c in candidates {
            if clashes(&c) {
                if explicit {
                    return Err(cfg_err(format!("subnet {c} overlaps a route of this host")));
                }
                continue;
            }
            let name = format!("subnet-{}-{}", c.network(), c.prefix());
            match try_lock(&name)? {
                Some(l) => {
                    locks.push(l);
                    chosen = Some(c);
                    break;
                }
                None if explicit => {
                    return Err(cfg_err(format!("subnet {c} is used by another daemon")));
                }
                None => {}
            }
        }
        let subnet = chosen.ok_or_else(|| cfg_err("no free subnet for sandboxes"))?;
        let p = Persisted {
            tag,
            subnet: subnet.to_string(),
        };
        let text = serde_json::to_vec(&p).map_err(|source| NetError::Json {
            what: "encode the network state",
            source,
        })?;
        std::fs::write(&file, text)
            .map_err(|e| NetError::Io(format!("write {}", file.display()), e))?;
        Ok((p, locks))
    }

    /// After the manager's reconcile (which re-adopted surviving sandboxes): loads the
    /// stored policies, applies them to the adopted links, and starts the proxy, the
    /// resolver, the pool and the housekeeping.
    pub async fn run(self: &Arc<Self>) -> Result<(), NetError> {
        match self.store.network_policies().await {
            Ok(all) => {
                let mut map = HashMap::new();
                for (id, owner, value) in all {
                    match serde_json::from_value::<NetworkPolicy>(value)
                        .map_err(|source| NetError::Json {
                            what: "decode a stored network policy",
                            source,
                        })
                        .and_then(|p| Policy::compile(&p).map_err(NetError::Policy))
                    {
                        Ok(p) => {
                            map.insert(
                                id,
                                Arc::new(Entry {
                                    owner,
                                    policy: Arc::new(p),
                                }),
                            );
                        }
                        Err(e) => {
                            tracing::warn!(id, error = %e, "a stored network policy is unusable; the sandbox gets none")
                        }
                    }
                }
                self.policies.write().extend(map);
            }
            Err(e) => tracing::warn!(error = %e, "loading network policies failed"),
        }
        let ids: Vec<String> = self.slots.lock().keys().cloned().collect();
        for id in ids {
            if let Err(e) = self.apply_route(&id) {
                tracing::warn!(id, error = %e, "applying a re-adopted sandbox's network policy failed");
            }
        }
        let listeners = self.listeners.lock().take();
        let Some(l) = listeners else {
            return Ok(());
        };
        let io = |e| NetError::Io("network listeners".into(), e);
        let proxy = tokio::net::TcpListener::from_std(l.proxy).map_err(io)?;
        let dns_udp = tokio::net::UdpSocket::from_std(l.dns_udp).map_err(io)?;
        let dns_tcp = tokio::net::TcpListener::from_std(l.dns_tcp).map_err(io)?;
        tokio::spawn(proxy::serve(self.clone(), proxy));
        tokio::spawn(dns::serve_udp(self.clone(), dns_udp));
        tokio::spawn(dns::serve_tcp(self.clone(), dns_tcp));
        self.pool.set_target(self.cfg.pool_size);
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = 0u64;
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                tick += 1;
                let m = me.clone();
                let _ = tokio::task::spawn_blocking(move || m.refresh_host()).await;
                if tick.is_multiple_of(5) {
                    let m = me.clone();
                    let _ = tokio::task::spawn_blocking(move || m.check_table()).await;
                }
                if tick.is_multiple_of(30) {
                    me.housekeeping().await;
                }
            }
        });
        Ok(())
    }

    /// Forgets policies and DNS memories of sandboxes that are gone; prunes the audit.
    async fn housekeeping(&self) {
        if let Ok(live) = self.store.live_sandboxes().await {
            let ids: std::collections::HashSet<String> = live.into_iter().map(|r| r.id).collect();
            self.policies.write().retain(|id, _| ids.contains(id));
            self.seen.lock().retain(|id, _| ids.contains(id));
            self.resolver.retain(|id| ids.contains(id));
        }
        if self.cfg.audit_retention_days > 0 {
            let before = sandpit_store::now_ms()
                - i64::try_from(self.cfg.audit_retention_days)
                    .unwrap_or(i64::MAX / 86_400_000)
                    .saturating_mul(86_400_000);
            match self.store.prune_audit(before).await {
                Ok(n) if n > 0 => tracing::info!(n, "pruned old network audit entries"),
                Err(e) => tracing::warn!(error = %e, "pruning the network audit failed"),
                _ => {}
            }
        }
    }

    /// Puts the table back if something removed it (a firewall reload that flushed the
    /// ruleset): without it, sandboxes would reach the host's services directly.
    fn check_table(&self) {
        if nft::exists(&self.table) {
            return;
        }
        match nft::apply(&self.rules) {
            Ok(()) => {
                tracing::warn!(table = %self.table, "the nftables table was gone; applied again")
            }
            Err(e) => {
                tracing::error!(table = %self.table, error = %e, "the nftables table is gone and cannot be applied again")
            }
        }
    }

    fn refresh_host(&self) {
        let Ok(addrs) = self.host_nl.lock().addresses_v4() else {
            return;
        };
        let mut view = HostView::default();
        for (local, len, peer) in addrs {
            view.addrs.push(local);
            // A point-to-point address's other end is a sandbox (or a peer) already
            // covered; a network a link is on is the host's own network.
            if len < 32 {
                view.nets.push(Cidr::new(peer, len));
            }
        }
        *self.host.write() = view;
    }

    /// Why no sandbox may reach `ip` (on `port`, when known), if it may not.
    pub fn blocked(&self, ip: Ipv4Addr, port: Option<u16>) -> Option<&'static str> {
        let host = self.host.read();
        policy::blocked(
            ip,
            port,
            &self.subnet,
            &host.addrs,
            &host.nets,
            &self.operator,
        )
    }

    /// The sandbox at address `ip` and its policy.
    pub fn sandbox_of(&self, ip: Ipv4Addr) -> Option<(String, Arc<Entry>)> {
        let id = self.by_ip.read().get(&ip).cloned()?;
        let entry = self.entry(&id);
        Some((id, entry))
    }

    /// A sandbox's policy (mode `none` when it has none, as idle pool members).
    fn entry(&self, id: &str) -> Arc<Entry> {
        let found = self.policies.read().get(id).cloned();
        found.unwrap_or_else(|| self.none_entry.clone())
    }

    /// The policy a sandbox has, as the API shows it.
    pub fn policy_of(&self, id: &str) -> Option<NetworkPolicy> {
        self.policies
            .read()
            .get(id)
            .map(|e| e.policy.source.clone())
    }

    /// The policy of a sandbox created without one.
    pub fn default_policy(&self) -> NetworkPolicy {
        NetworkPolicy {
            mode: self.cfg.default_mode,
            rules: Vec::new(),
        }
    }

    /// Sets a sandbox's policy in force (new connections follow it; its link comes up or
    /// goes down at once when it runs).
    pub fn set_policy(&self, id: &str, owner: &str, policy: Policy) -> Result<(), NetError> {
        self.policies.write().insert(
            id.to_string(),
            Arc::new(Entry {
                owner: owner.to_string(),
                policy: Arc::new(policy),
            }),
        );
        self.apply_route(id)
    }

    /// Brings a running sandbox's link up with its route, or down, as its policy says.
    fn apply_route(&self, id: &str) -> Result<(), NetError> {
        let routed = self.entry(id).policy.mode() != NetworkMode::None;
        let inner = self.slots.lock().get(id).map(|s| s.inner.clone());
        let Some(inner) = inner else { return Ok(()) };
        let mut l = inner.lock();
        if l.routed == routed {
            return Ok(());
        }
        l.set_routed(routed, self.gateway)
            .map_err(|e| NetError::Io("set the sandbox's route".into(), e))
    }

    /// Remembers the addresses the resolver gave a sandbox for `name`.
    pub fn note_resolved(&self, id: &str, name: &str, ips: &[Ipv4Addr], ttl: u32) {
        let now = Instant::now();
        let until = now + Duration::from_secs(u64::from(ttl.max(60)));
        self.seen
            .lock()
            .entry(id.to_string())
            .or_default()
            .note(name, ips, now, until);
    }

    /// The name a sandbox last resolved `ip` from.
    pub fn resolved_name(&self, id: &str, ip: Ipv4Addr) -> Option<String> {
        self.seen.lock().get(id)?.name_of(ip, Instant::now())
    }

    /// Whether the resolver gave a sandbox `ip` for `name`, in an answer that still holds.
    pub fn was_resolved(&self, id: &str, name: &str, ip: Ipv4Addr) -> bool {
        self.seen
            .lock()
            .get(id)
            .is_some_and(|s| s.has(name, ip, Instant::now()))
    }

    /// Counts a new proxied connection of sandbox `id` of `owner`; past its limit, its
    /// owner's or the limit of all sandboxes together, the reason it is refused.
    pub fn connection_slot(&self, id: &str, owner: &str) -> Result<ConnSlot<'_>, &'static str> {
        let mut c = self.conns.lock();
        if c.total >= self.max_conns {
            return Err("too many open connections of all sandboxes");
        }
        if c.per_owner.get(owner).copied().unwrap_or(0) >= self.max_conns_per_owner {
            return Err("too many open connections of this owner's sandboxes");
        }
        if c.per_sandbox.get(id).copied().unwrap_or(0) >= self.cfg.max_connections_per_sandbox {
            return Err("too many open connections for this sandbox");
        }
        *c.per_sandbox.entry(id.to_string()).or_default() += 1;
        *c.per_owner.entry(owner.to_string()).or_default() += 1;
        c.total += 1;
        Ok(ConnSlot {
            net: self,
            id: id.to_string(),
            owner: owner.to_string(),
        })
    }

    /// Installs what takes over connections it wants (the credential broker).
    pub fn set_interceptor(&self, i: Arc<dyn intercept::Interceptor>) {
        *self.interceptor.write() = Some(i);
    }

    /// The interceptor, if one is installed.
    pub fn interceptor(&self) -> Option<Arc<dyn intercept::Interceptor>> {
        self.interceptor.read().clone()
    }

    /// Installs what asks a person about a connection the policy refuses (the daemon's
    /// approvals); without one such a connection is simply refused.
    pub fn set_approval_gate(&self, g: Arc<dyn approval::ApprovalGate>) {
        *self.approval_gate.write() = Some(g);
    }

    /// The approval gate, if one is installed.
    pub fn approval_gate(&self) -> Option<Arc<dyn approval::ApprovalGate>> {
        self.approval_gate.read().clone()
    }

    /// The address of a running sandbox's link (reachable from the host while its policy
    /// is not `none`).
    pub fn address_of(&self, id: &str) -> Option<Ipv4Addr> {
        self.slots.lock().get(id).map(|s| s.address)
    }

    /// The gateway address (the sandboxes' resolver).
    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    /// The nftables table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Prefix of the host ends' link names.
    pub fn if_prefix(&self) -> &str {
        &self.if_prefix
    }

    /// Namespaces ready in the pool.
    pub fn pool_ready(&self) -> usize {
        self.pool.ready()
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    // ---- the runtime side ----

    /// A prepared namespace for a new sandbox (blocking when the pool is empty).
    fn acquire(&self) -> std::io::Result<Prepared> {
        let p = self.pool.acquire()?;
        self.in_flight.lock().insert(p.host_if.clone());
        Ok(p)
    }

    /// Ties a prepared namespace to sandbox `id`.
    fn attach(&self, id: &str, p: Prepared) {
        self.in_flight.lock().remove(&p.host_if);
        self.by_ip.write().insert(p.address, id.to_string());
        self.slots.lock().insert(
            id.to_string(),
            Slot {
                address: p.address,
                host_if: p.host_if,
                netns: p.netns,
                inner: p.inner,
            },
        );
    }

    /// Lets go of a namespace that was never attached (its link goes with it).
    fn discard(&self, p: Prepared) {
        self.in_flight.lock().remove(&p.host_if);
        self.alloc.lock().release(p.address);
    }

    /// The namespace of sandbox `id`, for its start.
    fn netns_of(&self, id: &str) -> Option<Arc<OwnedFd>> {
        self.slots.lock().get(id).map(|s| s.netns.clone())
    }

    /// Drops a sandbox's hold on its namespace; the kernel removes it (and the link)
    /// once the sandbox's processes are gone.
    fn detach(&self, id: &str) {
        let slot = self.slots.lock().remove(id);
        self.resolver.forget(id);
        if let Some(slot) = slot {
            {
                let mut m = self.by_ip.write();
                if m.get(&slot.address).is_some_and(|holder| holder == id) {
                    m.remove(&slot.address);
                }
            }
            self.alloc.lock().release(slot.address);
            tracing::debug!(id, link = %slot.host_if, "sandbox network released");
        }
    }

    /// Takes back the link of a sandbox that survived a restart.
    fn adopt(&self, id: &str, net: &sandpit_runtime::NetAttachment, pid: i32, pid_start: u64) {
        let opened = (|| -> std::io::Result<Slot> {
            let f = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
            if !sandpit_runtime::same_process(pid, pid_start) {
                return Err(std::io::Error::other("the sandbox's agent is not running"));
            }
            let ns = Arc::new(OwnedFd::from(f));
            let mut nl = self.pool.open_inside(ns.clone())?;
            let index = nl.index_of(link::SANDBOX_IF)?;
            Ok(Slot {
                address: net.address,
                host_if: net.host_if.clone(),
                netns: ns,
                inner: Arc::new(Mutex::new(InnerLink {
                    nl,
                    index,
                    // Unknown: the policy is applied again once loaded.
                    routed: true,
                })),
            })
        })();
        match opened {
            Ok(slot) => {
                self.alloc.lock().mark(net.address);
                self.by_ip.write().insert(net.address, id.to_string());
                self.slots.lock().insert(id.to_string(), slot);
            }
            Err(e) => tracing::warn!(id, error = %e, "re-adopting a sandbox's network failed"),
        }
    }

    /// Deletes host links of this daemon that no sandbox and no pool entry holds (their
    /// namespace is kept alive by something that is not a sandbox of ours any more).
    fn sweep_links(&self) {
        let mut known: Vec<String> = self
            .slots
            .lock()
            .values()
            .map(|s| s.host_if.clone())
            .collect();
        known.extend(self.pool.names());
        known.extend(self.in_flight.lock().iter().cloned());
        let mut nl = self.host_nl.lock();
        let Ok(links) = nl.links() else { return };
        for (index, name) in links {
            if name.starts_with(&self.if_prefix) && !known.contains(&name) {
                match nl.del_link(index) {
                    Ok(()) => tracing::info!(link = name, "removed an orphaned sandbox link"),
                    Err(e) => {
                        tracing::warn!(link = name, error = %e, "removing an orphaned sandbox link failed")
                    }
                }
            }
        }
    }

    /// On a clean stop with no sandbox left: removes the nftables table.
    fn release(&self) {
        let idle = self.slots.lock().is_empty();
        if !idle {
            return;
        }
        if let Err(e) = nft::delete(&self.table) {
            tracing::warn!(error = %e, "removing the nftables table failed");
        }
        // Nothing of this daemon's network is left for a restart to find.
        let tag = self.if_prefix.trim_start_matches("sp");
        let _ = std::fs::remove_file(format!("/run/sandpit/net/tag-{tag}.lock"));
    }

    /// Contents of a sandbox's `/etc/resolv.conf`.
    fn resolv_conf(&self) -> String {
        format!("nameserver {}\noptions edns0\n", self.gateway)
    }
}

/// Removes the tables of daemons that are gone for good: no daemon holds their tag and no
/// sandbox of theirs still has a link (a daemon that stops with none leaves its table to
/// this; one that restarts makes it again).
fn sweep_foreign(own: &str, nl: &mut link::Netlink) {
    let links: Vec<String> = nl
        .links()
        .map(|l| l.into_iter().map(|(_, n)| n).collect())
        .unwrap_or_default();
    for table in nft::tables_with_prefix("sandpit_") {
        let Some(tag) = table.strip_prefix("sandpit_") else {
            continue;
        };
        if table == own || tag.len() != 5 || !tag.bytes().all(|b| b.is_ascii_hexdigit()) {
            continue;
        }
        let prefix = format!("sp{tag}");
        if links.iter().any(|l| l.starts_with(&prefix)) {
            continue;
        }
        let Ok(Some(_held)) = try_lock(&format!("tag-{tag}")) else {
            continue;
        };
        match nft::delete(&table) {
            Ok(()) => {
                let _ = std::fs::remove_file(format!("/run/sandpit/net/tag-{tag}.lock"));
                tracing::info!(table, "removed the table of a daemon that is gone");
            }
            Err(e) => tracing::warn!(table, error = %e, "removing a stale nftables table failed"),
        }
    }
}

// ---- what the manager and the API call ----

/// Validates the `network` of a create (or the default) for a sandbox on `runtime`.
pub fn plan_policy(
    net: Option<&Arc<Net>>,
    runtime: &str,
    requested: Option<&NetworkPolicy>,
) -> Result<Option<Policy>, NetError> {
    let Some(net) = net.filter(|_| runtime == "container") else {
        return match requested {
            Some(p) if p.mode != NetworkMode::None || runtime != "container" => {
                Err(NetError::InvalidPolicy(if runtime == "container" {
                    "networking is off on this daemon: sandboxes have loopback only (network mode none)".to_string()
                } else {
                    format!(
                        "the {runtime} runtime has no network of its own: network policies need the container runtime"
                    )
                }))
            }
            _ => Ok(None),
        };
    };
    let p = requested.cloned().unwrap_or_else(|| net.default_policy());
    Policy::compile(&p).map(Some).map_err(NetError::Policy)
}

/// Stores and applies the policy of a sandbox that has just been recorded (or claimed).
pub async fn assign(
    net: Option<&Arc<Net>>,
    rec: &sandpit_store::SandboxRecord,
    policy: Option<Policy>,
) -> Result<(), NetError> {
    let (Some(net), Some(policy)) = (net, policy) else {
        return Ok(());
    };
    let value = serde_json::to_value(&policy.source).map_err(|source| NetError::Json {
        what: "encode the network policy",
        source,
    })?;
    if !net.store.set_network_policy(&rec.id, &value).await? {
        return Err(NetError::SandboxNotFound(rec.id.clone()));
    }
    let (net, id, owner) = (net.clone(), rec.id.clone(), rec.owner.clone());
    tokio::task::spawn_blocking(move || net.set_policy(&id, &owner, policy))
        .await
        .map_err(NetError::Task)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_name_of_an_address_expires_on_its_own() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let ip: Ipv4Addr = "198.51.100.3".parse().unwrap();
        let mut seen = Seen::default();
        seen.note("allowed.test", &[ip], at(0), at(60));
        // Another name of the same address, looked up again and again past the first
        // answer's end, keeps only its own answer alive.
        for s in (10..=50).step_by(10) {
            seen.note("evil.test", &[ip], at(s), at(s + 60));
        }
        assert!(seen.has("allowed.test", ip, at(59)));
        for s in (60..=120).step_by(10) {
            seen.note("evil.test", &[ip], at(s), at(s + 60));
        }
        assert!(!seen.has("allowed.test", ip, at(121)));
        assert!(seen.has("evil.test", ip, at(150)));
        assert_eq!(seen.name_of(ip, at(121)).as_deref(), Some("evil.test"));
        assert!(!seen.has("evil.test", ip, at(181)));
        assert_eq!(seen.name_of(ip, at(181)), None);
        // A name looked up again gets the later of its answers' ends, and is the latest.
        seen.note("allowed.test", &[ip], at(170), at(230));
        seen.note("allowed.test", &[ip], at(171), at(200));
        assert!(seen.has("allowed.test", ip, at(229)));
        assert_eq!(seen.name_of(ip, at(175)).as_deref(), Some("allowed.test"));
        // Only a few names per address are kept: the oldest goes first.
        for n in 0..SEEN_NAMES_MAX {
            seen.note(&format!("n{n}.test"), &[ip], at(172), at(300));
        }
        assert!(!seen.has("allowed.test", ip, at(175)));
        assert!(seen.has("n0.test", ip, at(175)));
        assert!(!seen.has("n0.test", "198.51.100.4".parse().unwrap(), at(175)));
    }

    #[test]
    fn the_default_total_connection_cap_leaves_descriptors_for_the_rest() {
        assert_eq!(total_conn_cap(None, Some(1_048_576)), MAX_CONNECTIONS);
        assert_eq!(total_conn_cap(None, Some(2048)), 256);
        assert_eq!(total_conn_cap(None, None), MAX_CONNECTIONS);
        assert_eq!(total_conn_cap(Some(5000), Some(2048)), 5000);
    }
}
