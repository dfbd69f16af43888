//! Network namespaces and their veth links, made through netlink (never by spawning `ip`).
//!
//! A namespace is held by a descriptor only, never bind-mounted under a name: the daemon's
//! descriptor keeps a prepared one alive, the sandbox's processes keep a used one alive,
//! and when the last holder goes the kernel removes the namespace and its veth pair in the
//! background. A daemon that dies leaves nothing of its unused namespaces behind, and a
//! sandbox's teardown never waits for a veth delete (some 30 ms).

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use parking_lot::Mutex;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

/// Name of the sandbox's end of its veth pair.
pub const SANDBOX_IF: &str = "eth0";

/// A synchronous rtnetlink socket, bound to the network namespace of the thread that
/// opened it for as long as it lives.
pub struct Netlink {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

fn nl_err(e: netlink_packet_core::DecodeError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("netlink: {e}"))
}

impl Netlink {
    /// Opens a socket in the calling thread's network namespace.
    pub fn open() -> io::Result<Self> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind_auto()?;
        sock.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            sock,
            seq: 0,
            buf: vec![0; 64 * 1024],
        })
    }

    fn send(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        packet.finalize();
        let mut out = vec![0u8; packet.buffer_len()];
        packet.serialize(&mut out);
        self.sock.send(&out, 0)?;
        Ok(self.seq)
    }

    /// Receives the messages answering request `seq`, handing each to `each`, until the
    /// kernel's acknowledgement (or the end of a dump).
    fn receive(&mut self, seq: u32, mut each: impl FnMut(RouteNetlinkMessage)) -> io::Result<()> {
        loop {
            let n = self.sock.recv(&mut &mut self.buf[..], 0)?;
            let mut off = 0;
            while off < n {
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&self.buf[off..n])
                    .map_err(nl_err)?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "netlink: empty message",
                    ));
                }
                off += (len + 3) & !3;
                if msg.header.sequence_number != seq {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(()),
                            Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                        };
                    }
                    NetlinkPayload::Done(_) => return Ok(()),
                    NetlinkPayload::InnerMessage(m) => each(m),
                    _ => {}
                }
            }
        }
    }

    /// Sends a request and waits for the kernel to acknowledge it.
    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
        let seq = self.send(msg, NLM_F_ACK | flags)?;
        self.receive(seq, |_| {})
    }

    /// Creates a veth pair: `host` here, its peer [`SANDBOX_IF`] in namespace `netns`.
    pub fn add_veth(&mut self, host: &str, netns: &OwnedFd) -> io::Result<()> {
        let mut peer = LinkMessage::default();
        peer.attributes
            .push(LinkAttribute::IfName(SANDBOX_IF.into()));
        peer.attributes
            .push(LinkAttribute::NetNsFd(netns.as_fd().as_raw_fd()));
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(host.into()));
        msg.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
        ]));
        self.request(RouteNetlinkMessage::NewLink(msg), NLM_F_CREATE | NLM_F_EXCL)
    }

    /// Index of link `name` in this socket's namespace.
    pub fn index_of(&mut self, name: &str) -> io::Result<u32> {
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.into()));
        let seq = self.send(RouteNetlinkMessage::GetLink(msg), NLM_F_ACK)?;
        let mut index = None;
        self.receive(seq, |m| {
            if let RouteNetlinkMessage::NewLink(l) = m {
                index = Some(l.header.index);
            }
        })?;
        index.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no link {name}")))
    }

    /// Sets link `index` up or down.
    pub fn set_up(&mut self, index: u32, up: bool) -> io::Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        if up {
            msg.header.flags = LinkFlags::Up;
        }
        msg.header.change_mask = LinkFlags::Up;
        self.request(RouteNetlinkMessage::SetLink(msg), 0)
    }

    /// Gives link `index` the point-to-point address `local` whose other end is `peer`.
    pub fn add_p2p_address(
        &mut self,
        index: u32,
        local: Ipv4Addr,
        peer: Ipv4Addr,
    ) -> io::Result<()> {
        let mut msg = AddressMessage::default();
        msg.header.family = netlink_packet_route::AddressFamily::Inet;
        msg.header.prefix_len = 32;
        msg.header.index = index;
        msg.attributes.push(AddressAttribute::Local(local.into()));
        msg.attributes.push(AddressAttribute::Address(peer.into()));
        self.request(
            RouteNetlinkMessage::NewAddress(msg),
            NLM_F_CREATE | NLM_F_EXCL,
        )
    }

    fn default_route(index: u32, gateway: Ipv4Addr) -> RouteMessage {
        let mut msg = RouteMessage::default();
        msg.header.address_family = netlink_packet_route::AddressFamily::Inet;
        msg.header.destination_prefix_length = 0;
        msg.header.table = RouteHeader::RT_TABLE_MAIN;
        msg.header.protocol = RouteProtocol::Static;
        msg.header.scope = RouteScope::Universe;
        msg.header.kind = RouteType::Unicast;
        msg.attributes
            .push(RouteAttribute::Gateway(RouteAddress::Inet(gateway)));
        msg.attributes.push(RouteAttribute::Oif(index));
        msg
    }

    /// Adds the default route through `gateway` on link `index`; one that exists is kept.
    pub fn add_default_route(&mut self, index: u32, gateway: Ipv4Addr) -> io::Result<()> {
        match self.request(
            RouteNetlinkMessage::NewRoute(Self::default_route(index, gateway)),
            NLM_F_CREATE | NLM_F_EXCL,
        ) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            other => other,
        }
    }

    /// Deletes link `index` (with a veth, its peer goes too).
    pub fn del_link(&mut self, index: u32) -> io::Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        self.request(RouteNetlinkMessage::DelLink(msg), 0)
    }

    /// Every link of this namespace: (index, name).
    pub fn links(&mut self) -> io::Result<Vec<(u32, String)>> {
        let seq = self.send(
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            NLM_F_DUMP,
        )?;
        let mut out = Vec::new();
        self.receive(seq, |m| {
            if let RouteNetlinkMessage::NewLink(l) = m {
                let name = l.attributes.iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                });
                if let Some(name) = name {
                    out.push((l.header.index, name));
                }
            }
        })?;
        Ok(out)
    }

    /// Every IPv4 route of the main table: (destination, prefix length, output link).
    pub fn routes_v4(&mut self) -> io::Result<Vec<(Ipv4Addr, u8, Option<u32>)>> {
        let mut q = RouteMessage::default();
        q.header.address_family = netlink_packet_route::AddressFamily::Inet;
        let seq = self.send(RouteNetlinkMessage::GetRoute(q), NLM_F_DUMP)?;
        let mut out = Vec::new();
        self.receive(seq, |m| {
            if let RouteNetlinkMessage::NewRoute(r) = m {
                if r.header.table != RouteHeader::RT_TABLE_MAIN {
                    return;
                }
                let mut dst = Ipv4Addr::UNSPECIFIED;
                let mut oif = None;
                for a in &r.attributes {
                    match a {
                        RouteAttribute::Destination(RouteAddress::Inet(d)) => dst = *d,
                        RouteAttribute::Oif(i) => oif = Some(*i),
                        _ => {}
                    }
                }
                out.push((dst, r.header.destination_prefix_length, oif));
            }
        })?;
        Ok(out)
    }
}

impl Netlink {
    /// Every IPv4 address of this namespace: (local address, prefix length, peer or
    /// network address).
    pub fn addresses_v4(&mut self) -> io::Result<Vec<(Ipv4Addr, u8, Ipv4Addr)>> {
        let mut q = AddressMessage::default();
        q.header.family = netlink_packet_route::AddressFamily::Inet;
        let seq = self.send(RouteNetlinkMessage::GetAddress(q), NLM_F_DUMP)?;
        let mut out = Vec::new();
        self.receive(seq, |m| {
            if let RouteNetlinkMessage::NewAddress(a) = m {
                let (mut local, mut addr) = (None, None);
                for at in &a.attributes {
                    match at {
                        AddressAttribute::Local(std::net::IpAddr::V4(l)) => local = Some(*l),
                        AddressAttribute::Address(std::net::IpAddr::V4(l)) => addr = Some(*l),
                        _ => {}
                    }
                }
                if let Some(l) = local.or(addr) {
                    out.push((l, a.header.prefix_len, addr.unwrap_or(l)));
                }
            }
        })?;
        Ok(out)
    }
}

/// Writes a sysctl of the calling thread's network namespace.
pub fn sysctl(path: &str, value: &str) -> io::Result<()> {
    std::fs::write(format!("/proc/sys/{path}"), value)
}

/// The network namespace of the calling thread.
pub fn current_netns() -> io::Result<OwnedFd> {
    let f = std::fs::File::open("/proc/thread-self/ns/net")?;
    Ok(OwnedFd::from(f))
}

/// One namespace made ready for a sandbox: its veth pair is configured, the host end is
/// up and addressed, the sandbox's end is addressed but down (no route at all) until a
/// policy other than `none` brings it up.
pub struct Prepared {
    pub netns: Arc<OwnedFd>,
    pub address: Ipv4Addr,
    pub host_if: String,
    /// A netlink socket inside the namespace, for changes while the sandbox runs.
    pub inner: Arc<Mutex<InnerLink>>,
}

/// The sandbox's end of the link, as the daemon reaches it.
pub struct InnerLink {
    pub nl: Netlink,
    pub index: u32,
    /// Whether the link is up with its default route.
    pub routed: bool,
}

impl InnerLink {
    /// Brings the sandbox's link up with its default route, or down (no route at all).
    pub fn set_routed(&mut self, routed: bool, gateway: Ipv4Addr) -> io::Result<()> {
        if routed {
            self.nl.set_up(self.index, true)?;
            self.nl.add_default_route(self.index, gateway)?;
        } else {
            // Down takes every route through the link with it.
            self.nl.set_up(self.index, false)?;
        }
        self.routed = routed;
        Ok(())
    }
}

/// Makes a new namespace with a veth pair, on the calling thread, which must be a thread
/// of its own (it enters the new namespace for a moment). `host` is a netlink socket and
/// `host_ns` the namespace of the host.
pub fn prepare(
    host: &mut Netlink,
    host_ns: &OwnedFd,
    host_if: &str,
    gateway: Ipv4Addr,
    address: Ipv4Addr,
) -> io::Result<Prepared> {
    use nix::sched::{CloneFlags, setns, unshare};
    unshare(CloneFlags::CLONE_NEWNET)?;
    let inside = (|| -> io::Result<(OwnedFd, Netlink)> {
        let ns = current_netns()?;
        // The sandbox speaks IPv4 only: no IPv6 address (not even link-local) on its link.
        sysctl("net/ipv6/conf/default/disable_ipv6", "1")?;
        Ok((ns, Netlink::open()?))
    })();
    // Back to the host's namespace whatever happened: this thread makes the next one.
    setns(host_ns, CloneFlags::CLONE_NEWNET)?;
    let (ns, mut inner) = inside?;
    host.add_veth(host_if, &ns)?;
    let configured = (|| -> io::Result<u32> {
        let hidx = host.index_of(host_if)?;
        let _ = sysctl(&format!("net/ipv6/conf/{host_if}/disable_ipv6"), "1");
        // Strict reverse-path filtering: a packet from this link must come from the
        // sandbox's own address.
        sysctl(&format!("net/ipv4/conf/{host_if}/rp_filter"), "1")?;
        host.add_p2p_address(hidx, gateway, address)?;
        host.set_up(hidx, true)?;
        let idx = inner.index_of(SANDBOX_IF)?;
        inner.add_p2p_address(idx, address, gateway)?;
        let lo = inner.index_of("lo")?;
        inner.set_up(lo, true)?;
        Ok(idx)
    })();
    match configured {
        Ok(index) => Ok(Prepared {
            netns: Arc::new(ns),
            address,
            host_if: host_if.to_string(),
            inner: Arc::new(Mutex::new(InnerLink {
                nl: inner,
                index,
                routed: false,
            })),
        }),
        Err(e) => {
            if let Ok(i) = host.index_of(host_if) {
                let _ = host.del_link(i);
            }
            Err(e)
        }
    }
}

/// Opens a netlink socket inside namespace `ns`, on the calling thread (which must be a
/// thread of its own, as for [`prepare`]).
pub fn open_inside(ns: &OwnedFd, host_ns: &OwnedFd) -> io::Result<Netlink> {
    use nix::sched::{CloneFlags, setns};
    setns(ns, CloneFlags::CLONE_NEWNET)?;
    let nl = Netlink::open();
    setns(host_ns, CloneFlags::CLONE_NEWNET)?;
    nl
}
