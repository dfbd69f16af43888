//! What the first bytes of a connection say about its destination: the server name of a
//! TLS ClientHello, or the Host of an HTTP request.

/// Most bytes read from a client before the decision.
pub const MAX_PEEK: usize = 16 * 1024;

/// What the first bytes of a connection are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    /// A TLS ClientHello, with its server name if it has one.
    Tls(Option<String>),
    /// An HTTP/1 request, with its Host (port dropped) if it has one.
    Http(Option<String>),
    /// Something else (or a malformed hello): no name.
    Other,
    /// Not enough bytes yet to tell.
    NeedMore,
}

/// Looks at the bytes read so far.
pub fn sniff(buf: &[u8]) -> Sniffed {
    if buf.is_empty() {
        return Sniffed::NeedMore;
    }
    if buf[0] == 0x16 {
        return tls(buf);
    }
    if looks_like_http(buf) {
        return http(buf);
    }
    Sniffed::Other
}

const METHODS: &[&[u8]] = &[
    b"GET ",
    b"POST ",
    b"PUT ",
    b"HEAD ",
    b"DELETE ",
    b"OPTIONS ",
    b"PATCH ",
    b"TRACE ",
    b"CONNECT ",
];

fn looks_like_http(buf: &[u8]) -> bool {
    METHODS.iter().any(|m| {
        let n = m.len().min(buf.len());
        buf[..n] == m[..n]
    })
}

fn http(buf: &[u8]) -> Sniffed {
    if !METHODS.iter().any(|m| buf.starts_with(m)) {
        return if buf.len() < 8 {
            Sniffed::NeedMore
        } else {
            Sniffed::Other
        };
    }
    let Some(end) = find(buf, b"\r\n\r\n") else {
        return if buf.len() >= MAX_PEEK {
            Sniffed::Http(None)
        } else {
            Sniffed::NeedMore
        };
    };
    let head = String::from_utf8_lossy(&buf[..end]);
    let host = head.split("\r\n").skip(1).find_map(|line| {
        let (k, v) = line.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("host")
            .then(|| strip_port(v.trim()))
    });
    Sniffed::Http(host.filter(|h| !h.is_empty()))
}

/// Drops a `:port` (and the brackets of an IPv6 literal).
fn strip_port(host: &str) -> String {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or_default().to_string();
    }
    match host.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h.to_string(),
        _ => host.to_string(),
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Reassembles the handshake bytes of the leading TLS records (a ClientHello may span
/// several) and reads the server name from them.
fn tls(buf: &[u8]) -> Sniffed {
    let mut hs = Vec::new();
    let mut off = 0;
    loop {
        if buf.len() < off + 5 {
            return more_or_other(buf);
        }
        if buf[off] != 0x16 || buf[off + 1] != 3 {
            return Sniffed::Other;
        }
        let len = u16::from_be_bytes([buf[off + 3], buf[off + 4]]) as usize;
        if buf.len() < off + 5 + len {
            hs.extend_from_slice(&buf[off + 5..]);
            // A partial record: enough if the hello inside is complete already.
            return match client_hello(&hs) {
                Some(r) => Sniffed::Tls(r),
                None => more_or_other(buf),
            };
        }
        hs.extend_from_slice(&buf[off + 5..off + 5 + len]);
        off += 5 + len;
        if let Some(r) = client_hello(&hs) {
            return Sniffed::Tls(r);
        }
        if hs.len() >= 4 && hs[0] != 1 {
            return Sniffed::Other;
        }
    }
}

fn more_or_other(buf: &[u8]) -> Sniffed {
    if buf.len() >= MAX_PEEK {
        Sniffed::Tls(None)
    } else {
        Sniffed::NeedMore
    }
}

/// The server name of a complete ClientHello handshake message (`Some(None)`: complete but
/// without a name); `None` while incomplete.
fn client_hello(hs: &[u8]) -> Option<Option<String>> {
    if hs.len() < 4 {
        return None;
    }
    if hs[0] != 1 {
        return Some(None);
    }
    let len = u32::from_be_bytes([0, hs[1], hs[2], hs[3]]) as usize;
    if hs.len() < 4 + len {
        return None;
    }
    Some(server_name(&hs[4..4 + len]))
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| b[0] as usize)
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    }
}

fn server_name(body: &[u8]) -> Option<String> {
    let mut r = Reader(body);
    r.take(2 + 32)?;
    let sid = r.u8()?;
    r.take(sid)?;
    let suites = r.u16()?;
    r.take(suites)?;
    let comp = r.u8()?;
    r.take(comp)?;
    let ext_len = r.u16()?;
    let mut exts = Reader(r.take(ext_len)?);
    while !exts.0.is_empty() {
        let kind = exts.u16()?;
        let len = exts.u16()?;
        let data = exts.take(len)?;
        if kind != 0 {
            continue;
        }
        let mut sni = Reader(data);
        let list = sni.u16()?;
        let mut list = Reader(sni.take(list)?);
        while !list.0.is_empty() {
            let t = list.u8()?;
            let n = list.u16()?;
            let name = list.take(n)?;
            if t == 0 {
                return std::str::from_utf8(name).ok().map(str::to_string);
            }
        }
    }
    None
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal ClientHello with `name` as its server name.
    pub(crate) fn client_hello_bytes(name: Option<&str>) -> Vec<u8> {
        let mut exts = Vec::new();
        if let Some(n) = name {
            let n = n.as_bytes();
            let mut entry = vec![0u8];
            entry.extend_from_slice(&(n.len() as u16).to_be_bytes());
            entry.extend_from_slice(n);
            let mut sni = (entry.len() as u16).to_be_bytes().to_vec();
            sni.extend_from_slice(&entry);
            exts.extend_from_slice(&0u16.to_be_bytes());
            exts.extend_from_slice(&(sni.len() as u16).to_be_bytes());
            exts.extend_from_slice(&sni);
        }
        // Some other extension after it.
        exts.extend_from_slice(&[0x00, 0x0b, 0x00, 0x02, 0x01, 0x00]);
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7u8; 32]);
        body.push(0);
        body.extend_from_slice(&[0, 2, 0x13, 0x01]);
        body.extend_from_slice(&[1, 0]);
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn tls_server_names() {
        let hello = client_hello_bytes(Some("api.example.com"));
        assert_eq!(sniff(&hello), Sniffed::Tls(Some("api.example.com".into())));
        for cut in [1, 5, 20, hello.len() - 1] {
            assert_eq!(sniff(&hello[..cut]), Sniffed::NeedMore, "cut at {cut}");
        }
        assert_eq!(sniff(&client_hello_bytes(None)), Sniffed::Tls(None));
        // The same hello split over two records.
        let hs = &hello[5..];
        let (a, b) = hs.split_at(30);
        let mut two = vec![0x16, 3, 1];
        two.extend_from_slice(&(a.len() as u16).to_be_bytes());
        two.extend_from_slice(a);
        two.extend_from_slice(&[0x16, 3, 1]);
        two.extend_from_slice(&(b.len() as u16).to_be_bytes());
        two.extend_from_slice(b);
        assert_eq!(sniff(&two), Sniffed::Tls(Some("api.example.com".into())));
        // Garbage that claims to be a hello never panics.
        let mut bad = hello.clone();
        bad[9..].iter_mut().for_each(|b| *b = 0xff);
        let _ = sniff(&bad);
        assert_eq!(sniff(&[0x16, 9, 9, 0, 1, 0]), Sniffed::Other);
    }

    #[test]
    fn http_hosts() {
        let req = b"GET /x HTTP/1.1\r\nUser-Agent: t\r\nhOsT: Example.com:8080\r\n\r\n";
        assert_eq!(sniff(req), Sniffed::Http(Some("Example.com".into())));
        assert_eq!(sniff(&req[..20]), Sniffed::NeedMore);
        assert_eq!(sniff(b"GE"), Sniffed::NeedMore);
        assert_eq!(sniff(b"POST / HTTP/1.0\r\n\r\n"), Sniffed::Http(None));
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n"),
            Sniffed::Http(Some("2001:db8::1".into()))
        );
        assert_eq!(sniff(b"SSH-2.0-OpenSSH\r\n"), Sniffed::Other);
        assert_eq!(sniff(b"\x00\x01binary"), Sniffed::Other);
    }
}
