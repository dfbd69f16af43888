//! Content codings of `/files`, as E2B's envd (0.6.4 and later) speaks them: an upload may
//! be `Content-Encoding: gzip` (the whole body, multipart or raw), and a download is
//! gzip-compressed when `Accept-Encoding` prefers it.
//!
//! Both directions run the codec on a blocking thread between two small bounded channels
//! and hand out chunks of at most [`CHUNK`] bytes, so neither a large file nor a gzip bomb
//! (a few kilobytes that inflate to gigabytes) ever sits in memory: a bomb inflates only
//! as fast as the file write takes it, and stops where the sandbox's disk limit does.

use bytes::{Buf, Bytes};
use futures::{Stream, StreamExt};
use std::io::{BufReader, Read, Write};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Largest chunk handed out by either direction.
pub const CHUNK: usize = 64 * 1024;
/// Chunks waiting in a channel, each way.
const QUEUE: usize = 4;

/// A content coding `/files` understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    /// No coding.
    Identity,
    /// RFC 1952 gzip.
    Gzip,
}

/// A coding header that cannot be served.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodingError {
    /// `Content-Encoding` names a coding other than gzip or identity (400).
    #[error("unsupported Content-Encoding: {0}, supported: [gzip]")]
    Unsupported(String),
    /// `Accept-Encoding` refuses identity and accepts nothing supported (406).
    #[error("no acceptable encoding found, supported: [gzip]")]
    NotAcceptable,
}

/// Why an encoded upload could not be decoded (400).
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The body is not valid gzip (bad header, corrupt or truncated data).
    #[error("error decompressing request body: {0}")]
    Gzip(#[source] std::io::Error),
    /// The body itself broke off.
    #[error("upload interrupted: {0}")]
    Body(String),
}

/// One `coding;q=x` item of a coding header, lowercased (codings are case-insensitive).
fn parse_item(item: &str) -> (String, f64) {
    let mut parts = item.split(';');
    let coding = parts.next().unwrap_or("").trim().to_ascii_lowercase();
    let mut q = 1.0;
    for p in parts {
        let p = p.trim();
        if p.len() > 2
            && p[..2].eq_ignore_ascii_case("q=")
            && let Ok(v) = p[2..].trim().parse::<f64>()
        {
            q = v;
        }
    }
    (coding, q)
}

/// The coding of an upload's body from its `Content-Encoding`.
pub fn content_coding(headers: &http::HeaderMap) -> Result<Coding, CodingError> {
    let Some(v) = headers.get(http::header::CONTENT_ENCODING) else {
        return Ok(Coding::Identity);
    };
    let text = v
        .to_str()
        .map_err(|_| CodingError::Unsupported(String::from_utf8_lossy(v.as_bytes()).into()))?;
    if text.trim().is_empty() {
        return Ok(Coding::Identity);
    }
    match parse_item(text).0.as_str() {
        "identity" => Ok(Coding::Identity),
        "gzip" | "x-gzip" => Ok(Coding::Gzip),
        _ => Err(CodingError::Unsupported(text.to_string())),
    }
}

/// The coding a download is sent in, chosen from `Accept-Encoding` as RFC 9110 12.5.3
/// says (and as E2B's envd does): the supported coding of the highest weight; identity
/// unless refused by `identity;q=0`, or by `*;q=0` without an explicit identity.
pub fn accepted_coding(headers: &http::HeaderMap) -> Result<Coding, CodingError> {
    let text: String = headers
        .get_all(http::header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    if text.trim().is_empty() {
        return Ok(Coding::Identity);
    }
    let mut items: Vec<(String, f64)> = text
        .split(',')
        .map(parse_item)
        .filter(|(c, _)| !c.is_empty())
        .collect();
    let identity_q = items.iter().find(|(c, _)| c == "identity").map(|(_, q)| *q);
    let wildcard_q = items.iter().find(|(c, _)| c == "*").map(|(_, q)| *q);
    let identity_refused =
        identity_q == Some(0.0) || (identity_q.is_none() && wildcard_q == Some(0.0));
    // Stable: among equal weights the header's order decides.
    items.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
    for (c, q) in &items {
        if *q <= 0.0 {
            continue;
        }
        match c.as_str() {
            "identity" => return Ok(Coding::Identity),
            "gzip" | "x-gzip" => return Ok(Coding::Gzip),
            "*" if identity_refused => return Ok(Coding::Gzip),
            "*" => return Ok(Coding::Identity),
            _ => {}
        }
    }
    if identity_refused {
        Err(CodingError::NotAcceptable)
    } else {
        Ok(Coding::Identity)
    }
}

/// Reads the chunks a channel delivers, on a blocking thread. A broken body is recorded
/// in `failed` so the decoder's error can be told from the body's.
struct ChannelReader {
    rx: mpsc::Receiver<Result<Bytes, String>>,
    cur: Bytes,
    failed: Arc<parking_lot::Mutex<Option<String>>>,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => {
                    *self.failed.lock() = Some(e.clone());
                    return Err(std::io::Error::other(e));
                }
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur.advance(n);
        Ok(n)
    }
}

/// Decodes a gzip body (one or more members, as `gzip` concatenates them) into a stream
/// of plain chunks. Memory stays bounded whatever the ratio: the decoder writes into one
/// [`CHUNK`] buffer and waits while the consumer has [`QUEUE`] chunks unread.
pub fn gunzip<S, E>(body: S) -> impl Stream<Item = Result<Bytes, DecodeError>> + Send + Unpin
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let (in_tx, in_rx) = mpsc::channel::<Result<Bytes, String>>(QUEUE);
    let (out_tx, out_rx) = mpsc::channel::<Result<Bytes, DecodeError>>(QUEUE);
    tokio::spawn(async move {
        let mut body = std::pin::pin!(body);
        while let Some(item) = body.next().await {
            let item = item.map_err(|e| e.to_string());
            let stop = item.is_err();
            // The decoder is gone (it failed, or nobody reads): stop reading the body.
            if in_tx.send(item).await.is_err() || stop {
                break;
            }
        }
    });
    let failed = Arc::new(parking_lot::Mutex::new(None));
    let reader = ChannelReader {
        rx: in_rx,
        cur: Bytes::new(),
        failed: failed.clone(),
    };
    tokio::task::spawn_blocking(move || {
        let mut dec = flate2::bufread::MultiGzDecoder::new(BufReader::with_capacity(CHUNK, reader));
        let mut buf = vec![0u8; CHUNK];
        loop {
            match dec.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if out_tx
                        .blocking_send(Ok(Bytes::copy_from_slice(&buf[..n])))
                        .is_err()
                    {
                        // The consumer stopped (the write failed): nothing more to do.
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let err = match failed.lock().take() {
                        Some(body) => DecodeError::Body(body),
                        None => DecodeError::Gzip(e),
                    };
                    let _ = out_tx.blocking_send(Err(err));
                    return;
                }
            }
        }
    });
    Box::pin(futures::stream::unfold(out_rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

/// Sends what is written into a channel, in the writer's chunks.
struct ChannelWriter {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client gone"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Streams `src` gzip-compressed, read and compressed on a blocking thread; the thread
/// ends when the source does or the receiver (the client) goes away.
pub fn gzip_reader<R: Read + Send + 'static>(
    mut src: R,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send + Unpin {
    let (tx, rx) = mpsc::channel(QUEUE);
    tokio::task::spawn_blocking(move || {
        let err_tx = tx.clone();
        let sink = std::io::BufWriter::with_capacity(CHUNK, ChannelWriter { tx });
        let mut enc = flate2::write::GzEncoder::new(sink, flate2::Compression::default());
        let r = std::io::copy(&mut src, &mut enc)
            .and_then(|_| enc.finish())
            .and_then(|mut sink| sink.flush());
        if let Err(e) = r
            && e.kind() != std::io::ErrorKind::BrokenPipe
        {
            tracing::debug!(error = %e, "gzip download failed");
            let _ = err_tx.blocking_send(Err(e));
        }
    });
    Box::pin(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: &'static str, v: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(name, v.parse().unwrap());
        h
    }

    #[test]
    fn content_encoding_is_gzip_identity_or_refused() {
        assert_eq!(
            content_coding(&http::HeaderMap::new()),
            Ok(Coding::Identity)
        );
        assert_eq!(
            content_coding(&headers("content-encoding", "GZIP")),
            Ok(Coding::Gzip)
        );
        assert_eq!(
            content_coding(&headers("content-encoding", "identity")),
            Ok(Coding::Identity)
        );
        assert!(matches!(
            content_coding(&headers("content-encoding", "br")),
            Err(CodingError::Unsupported(_))
        ));
        // Stacked codings are not decoded half-way.
        assert!(content_coding(&headers("content-encoding", "gzip, br")).is_err());
    }

    #[test]
    fn accept_encoding_follows_weights_and_refusals() {
        let a = |v: &str| accepted_coding(&headers("accept-encoding", v));
        assert_eq!(
            accepted_coding(&http::HeaderMap::new()),
            Ok(Coding::Identity)
        );
        assert_eq!(a("gzip"), Ok(Coding::Gzip));
        assert_eq!(a("gzip, deflate, br"), Ok(Coding::Gzip));
        assert_eq!(a("br"), Ok(Coding::Identity));
        assert_eq!(a("gzip;q=0.5, identity"), Ok(Coding::Identity));
        assert_eq!(a("gzip;q=0"), Ok(Coding::Identity));
        assert_eq!(a("*"), Ok(Coding::Identity));
        assert_eq!(a("*;q=0"), Err(CodingError::NotAcceptable));
        assert_eq!(a("identity;q=0, *"), Ok(Coding::Gzip));
        assert_eq!(a("br, identity;q=0"), Err(CodingError::NotAcceptable));
        assert_eq!(a("identity, *;q=0"), Ok(Coding::Identity));
    }

    fn gz(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    async fn collect<S: Stream<Item = Result<Bytes, E>> + Unpin, E>(
        mut s: S,
    ) -> Result<Vec<u8>, E> {
        let mut out = Vec::new();
        while let Some(c) = s.next().await {
            out.extend_from_slice(&c?);
        }
        Ok(out)
    }

    fn chunks(data: Vec<u8>, size: usize) -> impl Stream<Item = Result<Bytes, String>> + Send {
        let parts: Vec<Result<Bytes, String>> = data
            .chunks(size)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        futures::stream::iter(parts)
    }

    #[tokio::test]
    async fn gunzip_decodes_members_and_refuses_garbage() {
        let mut both = gz(b"hello ");
        both.extend(gz(b"world"));
        let out = collect(gunzip(chunks(both, 3))).await.unwrap();
        assert_eq!(out, b"hello world");
        let err = collect(gunzip(chunks(b"not gzip at all".to_vec(), 4)))
            .await
            .unwrap_err();
        assert!(matches!(err, DecodeError::Gzip(_)), "{err}");
        let mut cut = gz(&vec![7u8; 100_000]);
        cut.truncate(cut.len() / 2);
        assert!(collect(gunzip(chunks(cut, 1000))).await.is_err());
        let broken = futures::stream::iter(vec![
            Ok(Bytes::from(gz(b"x")[..5].to_vec())),
            Err("connection reset".to_string()),
        ]);
        let err = collect(gunzip(broken)).await.unwrap_err();
        assert!(matches!(err, DecodeError::Body(_)), "{err}");
    }

    #[tokio::test]
    async fn a_gzip_bomb_inflates_in_bounded_chunks_and_stops_when_the_reader_does() {
        // 1 GiB of zeros in about 1 MiB: one member of 1 MiB of zeros, concatenated 1024
        // times (a valid gzip file, as `cat a.gz b.gz` makes).
        let member = gz(&vec![0u8; 1 << 20]);
        let bomb: Vec<u8> = member
            .iter()
            .copied()
            .cycle()
            .take(member.len() * 1024)
            .collect();
        assert!(bomb.len() < 2 << 20, "{}", bomb.len());
        let mut s = gunzip(chunks(bomb, 64 * 1024));
        let mut seen = 0usize;
        // Read 8 MiB, checking every chunk's size, then walk away.
        while seen < 8 << 20 {
            let c = s.next().await.unwrap().unwrap();
            assert!(c.len() <= CHUNK);
            seen += c.len();
        }
        drop(s);
        // The decoder thread notices and stops; nothing to assert beyond not hanging.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    #[tokio::test]
    async fn gzip_reader_round_trips() {
        let data: Vec<u8> = (0..300_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let packed = collect(gzip_reader(std::io::Cursor::new(data.clone())))
            .await
            .unwrap();
        let mut plain = Vec::new();
        flate2::read::GzDecoder::new(&packed[..])
            .read_to_end(&mut plain)
            .unwrap();
        assert_eq!(plain, data);
    }
}
