//! The seam between the egress proxy and whatever terminates selected connections (the
//! credential broker): the proxy decides *whether* a connection may go out, the interceptor
//! decides *how* it is carried when it wants it.

use futures::future::BoxFuture;
use std::net::SocketAddr;
use tokio::io::{AsyncRead, AsyncWrite};

/// A byte stream in either direction; the proxy's client side may replay peeked bytes.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// A boxed [`Io`].
pub type BoxedIo = Box<dyn Io>;

/// What the egress proxy knows of one outbound connection the policy allowed.
#[derive(Debug, Clone)]
pub struct Outbound {
    /// The sandbox that opened the connection.
    pub sandbox_id: String,
    /// The name the sandbox asked for: TLS SNI, or the HTTP Host without its port.
    pub host: String,
    /// Destination port.
    pub port: u16,
    /// True when the connection starts with a TLS ClientHello.
    pub tls: bool,
}

/// Where the proxy would carry a connection the policy allowed.
#[derive(Debug, Clone, Copy)]
pub struct Destination {
    /// The address the sandbox connected to.
    pub addr: SocketAddr,
    /// Whether `addr` is an address [`Outbound::host`] resolves to: the daemon's resolver
    /// gave it to this sandbox for that name, or the proxy's own lookup of the name
    /// returned it. The policy may allow an address whatever name the client claims (open
    /// mode, a CIDR rule), so without this the name says nothing about who gets the bytes.
    pub resolved: bool,
}

/// Bytes carried by one connection: (client to upstream, upstream to client).
pub type Carried = (u64, u64);

/// Takes over the connections it wants instead of the proxy's plain byte splice.
pub trait Interceptor: Send + Sync + 'static {
    /// Whether this connection is to be terminated and served by the interceptor.
    fn wants(&self, conn: &Outbound) -> bool;

    /// Serves one connection. `client` replays any bytes the proxy already read from it;
    /// `upstream` is where the proxy allowed this connection to go.
    fn serve(
        &self,
        conn: Outbound,
        client: BoxedIo,
        upstream: Destination,
    ) -> BoxFuture<'static, std::io::Result<Carried>>;
}
