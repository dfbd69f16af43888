//! HTTP `GET /files` (download) and `POST /files` (upload, multipart or raw body), streamed
//! in both directions so that a large file never sits in memory. An upload creates the
//! directories missing above its file as root, handing them to the user, as E2B's envd
//! does; the file itself is written as the user. As in envd 0.6.x, an upload may be
//! gzip-encoded (`Content-Encoding`, decoded in bounded chunks: see [`crate::encoding`]) and
//! carry `X-Metadata-*` headers, stored as `user.e2b.*` attributes ([`crate::metadata`]);
//! a download is gzip-encoded when `Accept-Encoding` asks for it, and a file without a
//! trustworthy size (`/proc`) is streamed to its end.

use crate::fs::{FsError, FsRoot};
use crate::users;
use axum::body::Body;
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// Query parameters of `/files`, as E2B's SDKs send them.
#[derive(Debug, Deserialize)]
pub struct FilesQuery {
    pub path: Option<String>,
    pub username: Option<String>,
}

/// One written file in the upload response.
#[derive(Debug, Serialize)]
pub struct WrittenEntry {
    pub name: String,
    pub r#type: &'static str,
    pub path: String,
    /// The file's `user.e2b.*` metadata as read back after the write (absent when none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<std::collections::HashMap<String, String>>,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({ "code": status.as_u16(), "message": message.into() });
    (status, axum::Json(body)).into_response()
}

impl IntoResponse for FsError {
    fn into_response(self) -> Response {
        error(self.http_status(), self.to_string())
    }
}

fn user_for(root: &FsRoot, q: &FilesQuery, headers: &HeaderMap) -> Result<users::User, FsError> {
    let name = q.username.clone().or_else(|| users::from_headers(headers));
    users::resolve(root.config(), name.as_deref())
        .ok_or_else(|| FsError::UnknownUser(name.unwrap_or_default()))
}

/// `GET /files?path=...`: streams the file's bytes.
pub async fn download(
    State(root): State<Arc<FsRoot>>,
    Query(q): Query<FilesQuery>,
    headers: HeaderMap,
) -> Result<Response, FsError> {
    let user = user_for(&root, &q, &headers)?;
    let path = q
        .path
        .as_deref()
        .ok_or_else(|| FsError::InvalidPath("missing path".into()))?;
    let p = root.check(path, &user)?;
    // Refused before the file is opened, as E2B's envd does (406).
    let coding = crate::encoding::accepted_coding(&headers)
        .map_err(|e| FsError::NotAcceptable(e.to_string()))?;
    let r2 = root.clone();
    let p2 = p.clone();
    let u2 = user.clone();
    let (file, size) =
        tokio::task::spawn_blocking(move || users::as_fs_user(&u2, || r2.open_read(&p2)))
            .await
            .map_err(|e| FsError::Io(p.abs.clone(), std::io::Error::other(e)))??;
    let name = std::path::Path::new(&p.abs)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let disposition = content_disposition(&name);
    let mut resp = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_DISPOSITION, disposition)
        .header(header::VARY, "accept-encoding");
    let body = match coding {
        crate::encoding::Coding::Gzip => {
            resp = resp.header(header::CONTENT_ENCODING, "gzip");
            Body::from_stream(crate::encoding::gzip_reader(file))
        }
        crate::encoding::Coding::Identity => {
            // Without a trustworthy size (`/proc` files report 0) the body is chunked and
            // read to its end.
            if let Some(size) = size {
                resp = resp.header(header::CONTENT_LENGTH, size);
            }
            Body::from_stream(tokio_util::io::ReaderStream::with_capacity(
                tokio::fs::File::from_std(file),
                256 * 1024,
            ))
        }
    };
    Ok(resp
        .body(body)
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response build failed")))
}

/// `attachment` with the file's name (RFC 6266): an ASCII `filename` for old clients, with
/// anything a header cannot carry (controls, quotes, non-ASCII) as `_`, and the exact
/// name percent-encoded in `filename*`. A sandbox names its files freely, so the header
/// must be valid whatever the name.
fn content_disposition(name: &str) -> String {
    let ascii: String = name
        .chars()
        .map(|c| match c {
            ' ' | '!' | '#'..='[' | ']'..='~' => c,
            _ => '_',
        })
        .collect();
    let mut exact = String::with_capacity(name.len());
    for b in name.bytes() {
        // RFC 5987 attr-char: ALPHA / DIGIT / "!#$&+-.^_`|~"
        if b.is_ascii_alphanumeric() || b"!#$&+-.^_`|~".contains(&b) {
            exact.push(char::from(b));
        } else {
            exact.push_str(&format!("%{b:02X}"));
        }
    }
    format!("attachment; filename=\"{ascii}\"; filename*=UTF-8''{exact}")
}

/// An upload body, decoded when it came gzip-encoded; errors already in the agent's terms.
type UploadBody =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<bytes::Bytes, FsError>> + Send>>;

/// The upload body as a stream of plain bytes, whatever its `Content-Encoding`.
fn decoded<S, E>(coding: crate::encoding::Coding, body: S) -> UploadBody
where
    S: futures::Stream<Item = Result<bytes::Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    match coding {
        crate::encoding::Coding::Identity => Box::pin(
            body.map(|c| c.map_err(|e| FsError::BadBody(format!("upload interrupted: {e}")))),
        ),
        crate::encoding::Coding::Gzip => Box::pin(
            crate::encoding::gunzip(body).map(|c| c.map_err(|e| FsError::BadBody(e.to_string()))),
        ),
    }
}

async fn write_stream<S>(
    root: &Arc<FsRoot>,
    path: &str,
    user: &users::User,
    metadata: &std::collections::HashMap<String, String>,
    body: S,
) -> Result<WrittenEntry, FsError>
where
    S: futures::Stream<Item = Result<bytes::Bytes, FsError>> + Unpin,
{
    let p = root.check(path, user)?;
    // The first chunk (or the end) before anything is created: a body that is not gzip
    // at all, or breaks off at once, leaves no file behind.
    let mut body = body.peekable();
    if let Some(Err(_)) = std::pin::Pin::new(&mut body).peek().await
        && let Some(Err(e)) = body.next().await
    {
        return Err(e);
    }
    let (r2, p2, u2) = (root.clone(), p.clone(), user.clone());
    // Missing parents are created as root and handed to the user (E2B's envd does so);
    // the file itself is written as the user, so an existing directory it may not write
    // stays refused.
    let file = tokio::task::spawn_blocking(move || {
        r2.create_missing_parents(&p2, &u2)?;
        users::as_fs_user(&u2, || r2.create_file(&p2, &u2))
    })
    .await
    .map_err(|e| FsError::Io(p.abs.clone(), std::io::Error::other(e)))??;
    // Each tokio file write is a trip to the blocking pool; batching body chunks into 1 MiB
    // writes is what makes uploads run at memory speed rather than per-chunk overhead.
    let mut file = tokio::io::BufWriter::with_capacity(1 << 20, tokio::fs::File::from_std(file));
    while let Some(chunk) = body.next().await {
        file.write_all(&chunk?)
            .await
            .map_err(|e| FsError::from_io(&p.abs, e))?;
    }
    file.flush()
        .await
        .map_err(|e| FsError::from_io(&p.abs, e))?;
    let file = file.into_inner().into_std().await;
    // Always (re)written, an empty set too: an overwrite replaces the whole set, since
    // truncation keeps a file's attributes. Then read back, so the answer shows what was
    // stored (nothing, where the file system keeps no attributes).
    let (u2, md, abs) = (user.clone(), metadata.clone(), p.abs.clone());
    let stored = tokio::task::spawn_blocking(move || {
        let fd = std::os::fd::OwnedFd::from(file);
        users::as_fs_user(&u2, || match crate::metadata::replace(&fd, &md) {
            Ok(()) => Ok(crate::metadata::read(&fd).ok().flatten()),
            Err(e) if e.unsupported() => {
                tracing::warn!(path = %abs, error = %e, "file system keeps no attributes; metadata not stored");
                Ok(None)
            }
            Err(e) if e.no_space() => Err(FsError::NoSpace(format!("{abs}: metadata: {e}"))),
            Err(e) => Err(FsError::Io(abs.clone(), e.source)),
        })
    })
    .await
    .map_err(|e| FsError::Io(p.abs.clone(), std::io::Error::other(e)))??;
    let name = std::path::Path::new(&p.abs)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(WrittenEntry {
        name,
        r#type: "file",
        path: p.abs,
        metadata: stored,
    })
}

/// Bytes of a multipart body read and dropped after its closing boundary at the most.
const DRAIN_MAX: usize = 1 << 20;
/// How long an answer waits for the rest of a multipart body.
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The multipart reader stops at the closing boundary and leaves the body's last bytes
/// (the epilogue's CRLF) unread; the server then closes the connection while the client
/// may still be writing them, and the client sees a broken pipe instead of the answer.
/// This feeds `body` to the reader through a channel and, once the reader is gone, reads
/// the rest to its end (up to [`DRAIN_MAX`]); the task ends when the body has.
fn drained(body: axum::body::Body) -> (axum::body::Body, tokio::task::JoinHandle<()>) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, axum::Error>>(4);
    let pump = tokio::spawn(async move {
        let mut stream = body.into_data_stream();
        let mut open = true;
        let mut dropped = 0usize;
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(b) if open => open = tx.send(Ok(b)).await.is_ok(),
                Ok(b) => {
                    dropped += b.len();
                    if dropped > DRAIN_MAX {
                        break;
                    }
                }
                Err(e) => {
                    if open {
                        let _ = tx.send(Err(e)).await;
                    }
                    break;
                }
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    (axum::body::Body::from_stream(stream), pump)
}

/// `POST /files?path=...`: multipart (field `file`, several allowed) or a raw body.
pub async fn upload(
    State(root): State<Arc<FsRoot>>,
    Query(q): Query<FilesQuery>,
    request: Request,
) -> Result<Response, FsError> {
    let user = user_for(&root, &q, request.headers())?;
    // Both refused before any body is read or any file touched (400).
    let coding = crate::encoding::content_coding(request.headers())
        .map_err(|e| FsError::BadBody(e.to_string()))?;
    let metadata = crate::metadata::from_headers(request.headers())?;
    let is_multipart = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let mut written = Vec::new();
    if is_multipart {
        let (parts, body) = request.into_parts();
        let (body, pump) = drained(body);
        // The coding covers the whole body: the multipart reader parses the decoded bytes.
        let body = match coding {
            crate::encoding::Coding::Identity => body,
            crate::encoding::Coding::Gzip => {
                Body::from_stream(decoded(coding, body.into_data_stream()))
            }
        };
        let mut mp = Multipart::from_request(Request::from_parts(parts, body), &())
            .await
            .map_err(|e| FsError::InvalidPath(format!("bad multipart body: {e}")))?;
        let result = async {
            loop {
                let field = match mp.next_field().await {
                    Ok(Some(f)) => f,
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        return Err(FsError::InvalidPath(format!("bad multipart body: {e}")));
                    }
                };
                // With one file, `path` names it; otherwise each part's filename is its path.
                let dest = match (&q.path, field.file_name()) {
                    (Some(p), _) if written.is_empty() => p.clone(),
                    (_, Some(f)) => f.to_string(),
                    _ => return Err(FsError::InvalidPath("multipart part without a path".into())),
                };
                let field = field
                    .map(|c| c.map_err(|e| FsError::BadBody(format!("bad multipart body: {e}"))));
                written.push(write_stream(&root, &dest, &user, &metadata, field).await?);
            }
        }
        .await;
        drop(mp);
        // Answer only once the body is read to its end (bounded), so that the client is
        // not cut off while it still writes it.
        let _ = tokio::time::timeout(DRAIN_WAIT, pump).await;
        result?;
    } else {
        let path = q
            .path
            .clone()
            .ok_or_else(|| FsError::InvalidPath("missing path".into()))?;
        let body = decoded(coding, request.into_body().into_data_stream());
        written.push(write_stream(&root, &path, &user, &metadata, body).await?);
    }
    Ok((StatusCode::OK, axum::Json(written)).into_response())
}

#[cfg(test)]
mod tests {
    #[test]
    fn any_file_name_makes_a_valid_content_disposition() {
        for name in [
            "plain.txt",
            "a \"q\" b",
            "ctl\u{1}\u{7f}\r\n",
            "é😍",
            "back\\slash",
            "",
        ] {
            let v = super::content_disposition(name);
            assert!(http::HeaderValue::from_str(&v).is_ok(), "{name:?}: {v}");
        }
        assert_eq!(
            super::content_disposition("é a.txt"),
            "attachment; filename=\"_ a.txt\"; filename*=UTF-8''%C3%A9%20a.txt"
        );
    }
}
