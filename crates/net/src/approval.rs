//! The seam between the places that hold a risky action (the egress proxy, the credential
//! broker) and whatever asks a person about it (the daemon's approvals). The holder asks
//! [`ApprovalGate::decide`] and waits; nothing it holds goes on without an answer.

use futures::future::BoxFuture;

/// What kind of action is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateCapability {
    /// A connection to a host outside the sandbox's egress allow-list.
    Egress,
    /// The broker injecting the named credential into a request.
    Credential {
        /// The broker secret's name.
        name: String,
    },
}

/// One held action, as its holder sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateRequest {
    /// The sandbox that asked for it.
    pub sandbox_id: String,
    /// What kind of action.
    pub capability: GateCapability,
    /// The destination host (the name the sandbox asked for, or the address).
    pub host: String,
    /// Destination port.
    pub port: u16,
    /// HTTP method, when the holder saw one.
    pub method: Option<String>,
    /// HTTP path, when the holder saw one.
    pub path: Option<String>,
}

/// The gate's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateDecision {
    /// Nothing asks a person about this action: the holder does what it would without a
    /// gate (the proxy refuses, the broker injects).
    NotGated,
    /// A person allowed it (`approval_id` is the record; for a standing grant, the grant).
    Approved {
        /// The approval that let it through.
        approval_id: String,
    },
    /// A person refused it, nobody decided in time, or the request could not be recorded.
    Refused {
        /// The approval, when one was recorded.
        approval_id: Option<String>,
        /// Why, as the sandbox is told.
        reason: String,
    },
}

/// Asks a person about held actions.
pub trait ApprovalGate: Send + Sync + 'static {
    /// Decides on `req`, waiting as long as the approval may (its expiry). The future is
    /// only dropped when the holder gives up on the action (its client went away).
    fn decide(&self, req: GateRequest) -> BoxFuture<'static, GateDecision>;
}

/// The method and path of an HTTP/1 request line at the start of `first`, if it has one.
pub fn request_line(first: &[u8]) -> Option<(String, String)> {
    let end = first.iter().position(|&b| b == b'\r' || b == b'\n')?;
    let line = std::str::from_utf8(&first[..end]).ok()?;
    let mut parts = line.split(' ');
    let method = parts.next()?;
    let path = parts.next()?;
    let version = parts.next()?;
    if method.is_empty()
        || !method.bytes().all(|b| b.is_ascii_uppercase())
        || !version.starts_with("HTTP/")
        || parts.next().is_some()
    {
        return None;
    }
    Some((method.to_string(), printable_path(path)))
}

/// A request path as a person is shown it in an approval: printable ASCII only (no control
/// characters that could rewrite the approver's terminal), at most 256 characters.
pub fn printable_path(path: &str) -> String {
    path.chars()
        .filter(|c| c.is_ascii_graphic())
        .take(256)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_line_reads_method_and_path_and_refuses_the_rest() {
        assert_eq!(
            request_line(b"POST /v1/x?a=b HTTP/1.1\r\nHost: h\r\n\r\n"),
            Some(("POST".into(), "/v1/x?a=b".into()))
        );
        assert_eq!(request_line(b"\x16\x03\x01\x02"), None);
        assert_eq!(printable_path("/a\u{1b}[2J\u{9b}b c"), "/a[2Jbc");
        assert_eq!(request_line(b"get / HTTP/1.1\r\n"), None);
        assert_eq!(request_line(b"GET / HTTP/1.1 extra\r\n"), None);
        assert_eq!(request_line(b"GET / HTTP/1.1"), None);
        let long = format!("GET /{} HTTP/1.1\r\n", "a".repeat(1000));
        assert_eq!(request_line(long.as_bytes()).unwrap().1.len(), 256);
    }
}
