//! TCP connections to loopback inside a sandbox's network namespace. A socket keeps the
//! namespace it was created in, so a short-lived thread enters the namespace, creates the
//! sockets, and ends: no thread of the daemon is ever left in a sandbox's namespace, and
//! none waits for a sandbox's listener (the connect itself runs on the async runtime).

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

/// A loopback connect answers at once; this bounds a listener whose backlog is full.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Socket-making threads alive at once: a flood of requests queues here instead of making
/// the daemon spawn threads without bound. A thread never waits on the sandbox, so a
/// sandbox whose listener never answers cannot hold these up for everyone else.
static CONNECTING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(128);

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Nothing listens on the port.
    #[error("nothing listens on port {0}")]
    Refused(u16),
    /// The sandbox's process is gone (or its pid now names another process).
    #[error("the sandbox's process is gone")]
    Gone,
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Connects to `127.0.0.1:port` (then `[::1]:port`) in the network namespace of process
/// `pid` (which must have started at `pid_start`). A process in the daemon's own
/// namespace (the unisolated `process` runtime) gets a connection on the host loopback.
pub async fn connect(
    pid: i32,
    pid_start: u64,
    port: u16,
) -> Result<tokio::net::TcpStream, ConnectError> {
    let sockets = {
        let _permit = CONNECTING
            .acquire()
            .await
            .map_err(|_| io::Error::other("the proxy is shutting down"))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("sandpit-netns".into())
            .spawn(move || {
                let _ = tx.send(sockets_in(pid, pid_start));
            })?;
        // The permit is held until the thread has answered (or died), which is when it is
        // done.
        rx.await
            .map_err(|_| io::Error::other("the socket thread ended without an answer"))??
    };
    let mut failure = None;
    for (fd, ip) in sockets {
        let addr = SocketAddr::new(ip, port);
        let socket = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
        match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(addr)).await {
            Ok(Ok(stream)) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Ok(Err(e)) if not_listening(&e) => {}
            Ok(Err(e)) => {
                failure.get_or_insert(e);
            }
            Err(_) => {
                failure.get_or_insert(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connection timed out",
                ));
            }
        }
    }
    Err(failure.map_or(ConnectError::Refused(port), ConnectError::Io))
}

/// Runs on a thread of its own that ends right after: it may be left in the sandbox's
/// namespace. Returns unconnected non-blocking TCP sockets of that namespace, for its
/// IPv4 and (where the namespace has IPv6) IPv6 loopback.
fn sockets_in(pid: i32, pid_start: u64) -> Result<Vec<(OwnedFd, std::net::IpAddr)>, ConnectError> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    if pid <= 0 {
        return Err(ConnectError::Gone);
    }
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).map_err(|_| ConnectError::Gone)?;
    // Checked after the open: the descriptor then names the namespace of the right
    // process even if the pid is reused right after.
    if !sandpit_runtime::same_process(pid, pid_start) {
        return Err(ConnectError::Gone);
    }
    let own = std::fs::metadata("/proc/thread-self/ns/net")?;
    let theirs = ns.metadata()?;
    if (own.dev(), own.ino()) != (theirs.dev(), theirs.ino()) {
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| io::Error::other(format!("enter the sandbox's network namespace: {e}")))?;
    }
    let flags = SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK;
    let mut out = Vec::with_capacity(2);
    let v4 = socket(AddressFamily::Inet, SockType::Stream, flags, None)
        .map_err(|e| io::Error::other(format!("socket: {e}")))?;
    out.push((v4, Ipv4Addr::LOCALHOST.into()));
    // A namespace without IPv6 cannot make the second one; the first is enough then.
    if let Ok(v6) = socket(AddressFamily::Inet6, SockType::Stream, flags, None) {
        out.push((v6, Ipv6Addr::LOCALHOST.into()));
    }
    Ok(out)
}

/// Errors that mean nobody listens there (IPv6 may be missing from the namespace).
fn not_listening(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::AddrNotAvailable
    ) || matches!(
        e.raw_os_error(),
        Some(libc::ENETUNREACH) | Some(libc::EAFNOSUPPORT) | Some(libc::EADDRNOTAVAIL)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn own_namespace_and_refusals() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let me = std::process::id() as i32;
        let start = sandpit_runtime::pid_start_time(me).unwrap();
        let s = connect(me, start, port).await.unwrap();
        assert_eq!(s.peer_addr().unwrap().port(), port);
        drop(l);
        assert!(matches!(
            connect(me, start, port).await,
            Err(ConnectError::Refused(p)) if p == port
        ));
        // A pid whose start time does not match is not the sandbox any more.
        assert!(matches!(
            connect(me, start + 1, port).await,
            Err(ConnectError::Gone)
        ));
    }
}
