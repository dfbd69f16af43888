//! The sandboxes' DNS resolver. Every query a sandbox sends (to any address, UDP or TCP
//! port 53) arrives here; a name its policy does not allow is answered NXDOMAIN without
//! leaving the host (DNS questions can carry data out), an allowed one is forwarded to
//! the configured upstream, and addresses no sandbox may reach are dropped from the
//! answer (DNS rebinding). The addresses handed out are remembered per sandbox, so that
//! the proxy can tell which name a connection's address came from.

use super::Net;
use super::policy::Attempt;
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long an upstream has to answer before the next one is asked.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Cached answers, at most.
const CACHE_MAX: usize = 8192;
/// Longest and shortest time an answer is cached.
const TTL_MAX: u32 = 300;
const TTL_MIN: u32 = 1;

/// Asks the upstream servers, with a small cache.
pub struct Resolver {
    upstreams: Vec<SocketAddr>,
    cache: Mutex<HashMap<(Name, RecordType), (Instant, Message)>>,
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
pub fn parse_upstream(s: &str) -> Result<SocketAddr, String> {
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok(sa);
    }
    s.parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, 53))
        .map_err(|_| format!("bad DNS upstream {s:?} (an address, optionally with :port)"))
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
    /// A resolver over these upstreams.
    pub fn new(upstreams: Vec<SocketAddr>) -> Self {
        Self {
            upstreams,
            cache: Mutex::default(),
        }
    }

    /// The upstream's answer to one question (from the cache while it is fresh).
    pub async fn query(&self, name: &Name, qtype: RecordType) -> Result<Message, String> {
        let key = (name.to_lowercase(), qtype);
        if let Ok(c) = self.cache.lock()
            && let Some((until, m)) = c.get(&key)
            && *until > Instant::now()
        {
            return Ok(m.clone());
        }
        let mut q = Message::query();
        q.metadata.recursion_desired = true;
        q.add_query(Query::query(name.clone(), qtype));
        let bytes = q.to_vec().map_err(|e| format!("encode query: {e}"))?;
        let mut last = "no DNS upstream is configured".to_string();
        for up in &self.upstreams {
            match exchange(*up, q.metadata.id, &bytes).await {
                Ok(m) => {
                    if matches!(
                        m.metadata.response_code,
                        ResponseCode::NoError | ResponseCode::NXDomain
                    ) {
                        let ttl = min_ttl(&m);
                        if let Ok(mut c) = self.cache.lock() {
                            if c.len() >= CACHE_MAX {
                                c.retain(|_, (until, _)| *until > Instant::now());
                                if c.len() >= CACHE_MAX {
                                    c.clear();
                                }
                            }
                            c.insert(
                                key,
                                (Instant::now() + Duration::from_secs(ttl.into()), m.clone()),
                            );
                        }
                    }
                    return Ok(m);
                }
                Err(e) => last = format!("{up}: {e}"),
            }
        }
        Err(last)
    }

    /// The IPv4 addresses of `name`.
    pub async fn resolve_v4(&self, name: &str) -> Result<Vec<Ipv4Addr>, String> {
        let n = Name::from_ascii(format!("{name}.")).map_err(|e| e.to_string())?;
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
async fn exchange(up: SocketAddr, id: u16, query: &[u8]) -> Result<Message, String> {
    let bind: SocketAddr = if up.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = tokio::net::UdpSocket::bind(bind)
        .await
        .map_err(|e| e.to_string())?;
    sock.connect(up).await.map_err(|e| e.to_string())?;
    sock.send(query).await.map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 4096];
    let answer = tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        loop {
            let n = sock.recv(&mut buf).await.map_err(|e| e.to_string())?;
            if let Ok(m) = Message::from_vec(&buf[..n])
                && m.metadata.id == id
                && m.metadata.message_type == MessageType::Response
            {
                return Ok::<_, String>(m);
            }
        }
    })
    .await
    .map_err(|_| "timed out".to_string())??;
    if !answer.metadata.truncation {
        return Ok(answer);
    }
    let tcp = tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        let mut s = tokio::net::TcpStream::connect(up)
            .await
            .map_err(|e| e.to_string())?;
        let len = u16::try_from(query.len()).map_err(|_| "query too long".to_string())?;
        s.write_all(&len.to_be_bytes())
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(query).await.map_err(|e| e.to_string())?;
        let n = s.read_u16().await.map_err(|e| e.to_string())? as usize;
        let mut b = vec![0u8; n];
        s.read_exact(&mut b).await.map_err(|e| e.to_string())?;
        Message::from_vec(&b).map_err(|e| e.to_string())
    })
    .await
    .map_err(|_| "timed out over TCP".to_string())??;
    Ok(tcp)
}

fn reply(req: &Message, code: ResponseCode) -> Message {
    let mut m = Message::error_msg(req.metadata.id, req.metadata.op_code, code);
    m.metadata.recursion_desired = req.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.queries = req.queries.clone();
    m
}

/// Answers one query of the sandbox at `from`; None drops it (not from a sandbox, or
/// not DNS at all).
pub async fn answer(net: &Net, from: Ipv4Addr, bytes: &[u8]) -> Option<Message> {
    let req = Message::from_vec(bytes).ok()?;
    if req.metadata.message_type != MessageType::Query {
        return None;
    }
    let (sandbox, entry) = net.sandbox_of(from)?;
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
                sandbox_id: sandbox.clone(),
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
    let upstream = match net.resolver.query(q.name(), qtype).await {
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
        net.note_resolved(&sandbox, &name, &kept, ttl);
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

/// Serves the sandboxes' DNS over UDP.
pub async fn serve_udp(net: Arc<Net>, sock: tokio::net::UdpSocket) {
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
        let IpAddr::V4(src) = from.ip() else { continue };
        let req = buf[..n].to_vec();
        let (net, sock) = (net.clone(), sock.clone());
        tokio::spawn(async move {
            let Some(resp) = answer(&net, src, &req).await else {
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

/// Serves the sandboxes' DNS over TCP.
pub async fn serve_tcp(net: Arc<Net>, listener: tokio::net::TcpListener) {
    loop {
        let (mut s, from) = match listener.accept().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "DNS listener failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let IpAddr::V4(src) = from.ip() else { continue };
        let net = net.clone();
        tokio::spawn(async move {
            loop {
                let read = tokio::time::timeout(Duration::from_secs(10), async {
                    let n = s.read_u16().await? as usize;
                    let mut b = vec![0u8; n];
                    s.read_exact(&mut b).await?;
                    Ok::<_, std::io::Error>(b)
                })
                .await;
                let Ok(Ok(req)) = read else { return };
                let Some(resp) = answer(&net, src, &req).await else {
                    return;
                };
                let Ok(bytes) = resp.to_vec() else { return };
                let Ok(len) = u16::try_from(bytes.len()) else {
                    return;
                };
                if s.write_all(&len.to_be_bytes()).await.is_err()
                    || s.write_all(&bytes).await.is_err()
                {
                    return;
                }
            }
        });
    }
}
