//! The transparent egress proxy. Every TCP connection a sandbox opens is redirected here
//! (nftables); the proxy reads the original destination (SO_ORIGINAL_DST), peeks at the
//! first bytes for the TLS server name or HTTP Host, and decides with the sandbox's
//! policy. A connection whose name decides must go to an address that name resolves to:
//! a well-known SNI sent to an arbitrary address, or an address DNS should never have
//! given out, is refused. Allowed connections are spliced (or handed to the interceptor
//! when it wants them), with their bytes counted for the audit and metering.
//!
//! A connection the policy refuses (a blocked range never) is first put to the approval
//! gate when one is installed: it is held, nothing sent upstream, until the gate answers;
//! only an approval lets it on, and then only to an address its name resolves to. While it
//! is held the proxy keeps reading what the client sends (kept, up to [`MAX_HELD`] bytes,
//! to go on if approved): a client that closes the connection ends the wait, and the gate
//! is told by the drop of its future (the daemon then ends the approval `abandoned`). One
//! approval lets the whole connection through; the proxy does not hold each request.
//!
//! The interceptor (the credential broker) is told whether the destination is an address
//! its name resolves to, whatever the policy said: a policy that allows the address alone
//! (open mode, a CIDR rule) lets a client claim any name to any address, and a credential
//! bound to that name must not go along.

use super::Net;
use super::approval::{GateCapability, GateDecision, GateRequest, request_line};
use super::intercept::{Destination, Outbound};
use super::policy::{Attempt, normalize_name};
use super::sniff::{MAX_PEEK, Sniffed, sniff};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

const SO_ORIGINAL_DST: libc::c_int = 80;

/// The address a redirected connection was meant for.
fn original_dst(s: &TcpStream) -> io::Result<SocketAddrV4> {
    use std::os::fd::AsRawFd;
    // SAFETY: sockaddr_in is plain data; getsockopt writes at most `len` bytes into it.
    unsafe {
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let r = libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        );
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
            u16::from_be(addr.sin_port),
        ))
    }
}

/// Accepts the sandboxes' redirected connections until the daemon stops.
pub async fn serve(net: Arc<Net>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((s, peer)) => {
                let net = net.clone();
                tokio::spawn(async move {
                    let _ = s.set_nodelay(true);
                    handle(net, s, peer).await;
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "egress proxy accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Reads the client's first bytes until they tell what it speaks, it stops sending for
/// `wait`, or [`MAX_PEEK`] bytes have come.
async fn peek(client: &mut TcpStream, buf: &mut Vec<u8>, wait: Duration) -> Sniffed {
    let deadline = tokio::time::Instant::now() + wait;
    let mut chunk = [0u8; 4096];
    loop {
        let s = sniff(buf);
        if s != Sniffed::NeedMore {
            return s;
        }
        if buf.len() >= MAX_PEEK {
            return Sniffed::Other;
        }
        let room = (MAX_PEEK - buf.len()).min(chunk.len());
        match tokio::time::timeout_at(deadline, client.read(&mut chunk[..room])).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Sniffed::Other,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn handle(net: Arc<Net>, mut client: TcpStream, peer: SocketAddr) {
    let IpAddr::V4(src) = peer.ip() else { return };
    let Ok(dst) = original_dst(&client) else {
        return;
    };
    // Not a sandbox (nothing else is redirected here): nothing to say to it.
    let Some((sandbox, entry)) = net.sandbox_of(src) else {
        return;
    };
    let (ip, port) = (*dst.ip(), dst.port());
    // Taken before the peek: a connection the proxy waits on holds a socket and a task as
    // much as a spliced one, and a sandbox must not keep thousands of them that way.
    let _slot = match net.connection_slot(&sandbox, &entry.owner) {
        Ok(slot) => slot,
        Err(why) => {
            let attempt = super::audit::Attempt {
                sandbox_id: sandbox.clone(),
                owner: entry.owner.clone(),
                protocol: "tcp",
                dest_name: net.resolved_name(&sandbox, ip),
                dest_ip: Some(ip.to_string()),
                dest_port: port,
                sni: None,
                http_host: None,
            };
            net.audit.record(attempt, false, why);
            return;
        }
    };
    let mut first = Vec::with_capacity(1024);
    let sniffed = peek(&mut client, &mut first, net.peek_timeout).await;
    let (sni, http_host, tls) = match &sniffed {
        Sniffed::Tls(n) => (n.clone(), None, true),
        Sniffed::Http(h) => (None, h.clone(), false),
        _ => (None, None, false),
    };
    // A name the client claims; an address literal in its place is no name.
    let claimed = sni
        .as_deref()
        .or(http_host.as_deref())
        .and_then(normalize_name)
        .filter(|n| n.parse::<Ipv4Addr>().is_err());
    let name = claimed.clone().or_else(|| net.resolved_name(&sandbox, ip));
    let attempt = super::audit::Attempt {
        sandbox_id: sandbox.clone(),
        owner: entry.owner.clone(),
        protocol: "tcp",
        dest_name: name.clone(),
        dest_ip: Some(ip.to_string()),
        dest_port: port,
        sni,
        http_host,
    };
    let verdict = decide(
        &net,
        &sandbox,
        &entry.policy,
        name.as_deref(),
        claimed.is_some(),
        ip,
        port,
    )
    .await;
    let verdict = match verdict {
        Err(Refused::Policy(rule)) => {
            ask_gate(
                &net,
                &sandbox,
                name.as_deref(),
                claimed.is_some(),
                ip,
                port,
                (&mut client, &mut first),
                rule,
            )
            .await
        }
        other => other,
    };
    let allowed = match verdict {
        Ok(allowed) => allowed,
        Err(refused) => {
            let rule = refused.to_string();
            net.audit.record(attempt, false, &rule);
            if matches!(sniffed, Sniffed::Http(_)) && !matches!(refused, Refused::ClientGone) {
                let body = match &refused {
                    Refused::Approval { .. } => {
                        format!("sandpit: this connection was refused: {rule}\n")
                    }
                    _ => format!(
                        "sandpit: the sandbox's egress policy refused this connection ({rule})\n"
                    ),
                };
                let resp = format!(
                    "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ =
                    tokio::time::timeout(Duration::from_secs(2), client.write_all(resp.as_bytes()))
                        .await;
            }
            return;
        }
    };
    let owner = entry.owner.clone();
    let entry_rec = net.audit.record(attempt, true, &allowed.rule);
    let upstream = SocketAddr::V4(dst);
    let outbound = Outbound {
        sandbox_id: sandbox.clone(),
        host: name.clone().unwrap_or_else(|| ip.to_string()),
        port,
        tls,
    };
    if let Some(i) = net.interceptor()
        && i.wants(&outbound)
    {
        // Checked only now, for the few connections the interceptor takes: a lookup for
        // every connection of an open sandbox would be wasted.
        let resolved = allowed.name_resolves
            || resolves_to(&net, &sandbox, &outbound.host, ip)
                .await
                .is_ok();
        if !resolved {
            tracing::info!(sandbox = %sandbox, host = %outbound.host, %ip,
                "a connection names a host that does not resolve to its address; no credential goes with it");
        }
        let client = Box::new(Prefixed::new(first, client));
        let upstream = Destination {
            addr: upstream,
            resolved,
        };
        let (sent, received, error) = match i.serve(outbound, client, upstream).await {
            Ok((s, r)) => (s, r, None),
            Err(e) => (0, 0, Some(e.to_string())),
        };
        net.audit.close(&owner, entry_rec, sent, received, error);
        return;
    }
    let server = match tokio::time::timeout(net.connect_timeout, TcpStream::connect(upstream)).await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            net.audit
                .close(&owner, entry_rec, 0, 0, Some(format!("connect: {e}")));
            return;
        }
        Err(_) => {
            net.audit
                .close(&owner, entry_rec, 0, 0, Some("connect: timed out".into()));
            return;
        }
    };
    let _ = server.set_nodelay(true);
    let (sent, received, error) = splice(client, server, &first).await;
    net.audit.close(&owner, entry_rec, sent, received, error);
}

/// An allowed connection.
struct Allowed {
    /// The deciding rule.
    rule: String,
    /// Whether the name the client claimed is known to resolve to the address (also true
    /// when it claimed none: a name then comes from the resolver's own answers).
    name_resolves: bool,
}

/// Why the proxy refused a connection; its text is the audit's rule and what a plain HTTP
/// client of the sandbox is told.
#[derive(Debug, thiserror::Error)]
enum Refused {
    /// The address is in a range no sandbox may reach.
    #[error("blocked: {0}")]
    Blocked(&'static str),
    /// The sandbox's policy denied it: the deciding rule.
    #[error("{0}")]
    Policy(String),
    /// The claimed name is an address literal other than the destination.
    #[error("{name} is not {ip}")]
    NotTheAddress { name: String, ip: Ipv4Addr },
    /// The claimed name does not resolve to the destination.
    #[error("{name} does not resolve to {ip}")]
    NameMismatch { name: String, ip: Ipv4Addr },
    /// A person refused it, or nobody decided in time.
    #[error("approval {}: {reason}", id.as_deref().unwrap_or("(not recorded)"))]
    Approval { id: Option<String>, reason: String },
    /// The client closed the connection while it was held for approval.
    #[error("the client closed the connection while it was held for approval")]
    ClientGone,
    /// The claimed name could not be looked up.
    #[error("{name} could not be resolved: {source}")]
    Unresolved {
        name: String,
        #[source]
        source: super::dns::DnsError,
    },
}

/// Whether `ip` is an address `name` resolves to: the resolver gave it to the sandbox for
/// that name, or a lookup of the name now returns it. An address literal is only itself.
async fn resolves_to(net: &Net, sandbox: &str, name: &str, ip: Ipv4Addr) -> Result<(), Refused> {
    if let Ok(literal) = name.parse::<Ipv4Addr>() {
        return if literal == ip {
            Ok(())
        } else {
            Err(Refused::NotTheAddress {
                name: name.to_string(),
                ip,
            })
        };
    }
    if net.was_resolved(sandbox, name, ip) {
        return Ok(());
    }
    match net.resolver.resolve_v4(name).await {
        Ok(addrs) if addrs.contains(&ip) => Ok(()),
        Ok(_) => Err(Refused::NameMismatch {
            name: name.to_string(),
            ip,
        }),
        Err(source) => Err(Refused::Unresolved {
            name: name.to_string(),
            source,
        }),
    }
}

/// Most bytes a held client may send that are kept for upstream; past them the proxy stops
/// reading (and so stops noticing a close) and the approval's expiry bounds the wait.
const MAX_HELD: usize = 64 * 1024;

/// Reads what a held client sends, appending it to `kept` (up to [`MAX_HELD`] bytes) to
/// go upstream if the connection is approved; returns when the client has closed the
/// connection (or it failed). A client that only shuts down its sending side counts as
/// gone too: nothing it could still be sent would be asked for.
async fn client_gone(client: &mut TcpStream, kept: &mut Vec<u8>) {
    let mut chunk = [0u8; 4096];
    loop {
        let room = MAX_HELD.saturating_sub(kept.len()).min(chunk.len());
        if room == 0 {
            return std::future::pending().await;
        }
        // `read` is cancel-safe: when the gate answers first, nothing read is lost.
        match client.read(&mut chunk[..room]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => kept.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Asks the approval gate about a connection the policy refused by `rule`; with no gate,
/// or none that asks a person about it, the refusal stands. The connection is held (its
/// client waits, nothing is sent upstream) until the gate answers or the client goes
/// away ([`Refused::ClientGone`]; dropping the gate's future tells it). What the client
/// sends meanwhile is added to `first`.
#[allow(clippy::too_many_arguments)]
async fn ask_gate(
    net: &Net,
    sandbox: &str,
    name: Option<&str>,
    claimed: bool,
    ip: Ipv4Addr,
    port: u16,
    (client, first): (&mut TcpStream, &mut Vec<u8>),
    rule: String,
) -> Result<Allowed, Refused> {
    let Some(gate) = net.approval_gate() else {
        return Err(Refused::Policy(rule));
    };
    let (method, path) = request_line(first).unzip();
    let req = GateRequest {
        sandbox_id: sandbox.to_string(),
        capability: GateCapability::Egress,
        host: name.map_or_else(|| ip.to_string(), str::to_string),
        port,
        method,
        path,
    };
    let decision = tokio::select! {
        d = gate.decide(req) => d,
        () = client_gone(client, first) => {
            tracing::info!(sandbox, %ip, port, "a held connection's client went away before a decision");
            return Err(Refused::ClientGone);
        }
    };
    match decision {
        GateDecision::NotGated => Err(Refused::Policy(rule)),
        GateDecision::Refused {
            approval_id,
            reason,
        } => Err(Refused::Approval {
            id: approval_id,
            reason,
        }),
        GateDecision::Approved { approval_id } => {
            // The person approved a name: the bytes must go to an address it resolves to,
            // or a client could claim an approved name to reach any address.
            if let Some(n) = name.filter(|_| claimed) {
                resolves_to(net, sandbox, n, ip).await?;
            }
            tracing::info!(sandbox, approval_id, %ip, port, "connection let through by an approval");
            Ok(Allowed {
                rule: format!("approval {approval_id}"),
                name_resolves: true,
            })
        }
    }
}

/// The policy's verdict on one connection: allowed, or refused by the rule given.
async fn decide(
    net: &Net,
    sandbox: &str,
    policy: &super::policy::Policy,
    name: Option<&str>,
    claimed: bool,
    ip: Ipv4Addr,
    port: u16,
) -> Result<Allowed, Refused> {
    if let Some(why) = net.blocked(ip, Some(port)) {
        return Err(Refused::Blocked(why));
    }
    let d = policy.decide(&Attempt {
        name,
        ip: Some(ip),
        port: Some(port),
    });
    if !d.allow {
        return Err(Refused::Policy(d.rule));
    }
    let Some(name) = name.filter(|_| claimed) else {
        return Ok(Allowed {
            rule: d.rule,
            name_resolves: true,
        });
    };
    // Allowed whatever the name: the policy need not check it (the interceptor still may).
    let unnamed = policy.decide(&Attempt {
        name: None,
        ip: Some(ip),
        port: Some(port),
    });
    if unnamed.allow {
        return Ok(Allowed {
            rule: d.rule,
            name_resolves: false,
        });
    }
    // The name decided: the address must be one it resolves to.
    resolves_to(net, sandbox, name, ip).await?;
    Ok(Allowed {
        rule: d.rule,
        name_resolves: true,
    })
}

/// Copies both ways until both sides are done (or one fails), counting bytes: (from the
/// client, to the client, error).
async fn splice(client: TcpStream, server: TcpStream, first: &[u8]) -> (u64, u64, Option<String>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let mut up = 0u64;
    let mut down = 0u64;
    let result = {
        let upward = async {
            if !first.is_empty() {
                sw.write_all(first).await?;
                up += first.len() as u64;
            }
            pump(&mut cr, &mut sw, &mut up).await
        };
        let downward = pump(&mut sr, &mut cw, &mut down);
        tokio::try_join!(upward, downward)
    };
    (up, down, result.err().map(|e| e.to_string()))
}

async fn pump<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    r: &mut R,
    w: &mut W,
    count: &mut u64,
) -> io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            let _ = w.shutdown().await;
            return Ok(());
        }
        w.write_all(&buf[..n]).await?;
        *count += n as u64;
    }
}

/// A stream that first replays bytes already read from it.
pub struct Prefixed<S> {
    prefix: Vec<u8>,
    pos: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    /// `inner`, whose next bytes are `prefix`.
    pub fn new(prefix: Vec<u8>, inner: S) -> Self {
        Self {
            prefix,
            pos: 0,
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = (self.prefix.len() - self.pos).min(buf.remaining());
            let start = self.pos;
            buf.put_slice(&self.prefix[start..start + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn prefixed_replays_then_reads_on() {
        let (a, mut b) = tokio::io::duplex(64);
        b.write_all(b" world").await.unwrap();
        drop(b);
        let mut p = Prefixed::new(b"hello".to_vec(), a);
        let mut s = String::new();
        p.read_to_string(&mut s).await.unwrap();
        assert_eq!(s, "hello world");
    }

    #[test]
    fn refusals_read_as_the_sandbox_sees_them_and_keep_the_lookup_failure() {
        use std::error::Error as _;
        let ip = Ipv4Addr::new(192, 0, 2, 7);
        assert_eq!(
            Refused::Blocked("link-local").to_string(),
            "blocked: link-local"
        );
        assert_eq!(
            Refused::Policy("rules[0] deny evil.example".into()).to_string(),
            "rules[0] deny evil.example"
        );
        assert_eq!(
            Refused::NotTheAddress {
                name: "192.0.2.8".into(),
                ip
            }
            .to_string(),
            "192.0.2.8 is not 192.0.2.7"
        );
        let mismatch = Refused::NameMismatch {
            name: "a.example".into(),
            ip,
        };
        assert_eq!(
            mismatch.to_string(),
            "a.example does not resolve to 192.0.2.7"
        );
        assert!(mismatch.source().is_none());
        let unresolved = Refused::Unresolved {
            name: "a.example".into(),
            source: super::super::dns::DnsError::NoUpstream,
        };
        assert_eq!(
            unresolved.to_string(),
            "a.example could not be resolved: no DNS upstream is configured"
        );
        assert!(unresolved.source().is_some());
    }
}
