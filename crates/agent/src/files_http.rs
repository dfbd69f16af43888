//! HTTP `GET /files` (download) and `POST /files` (upload, multipart or raw body), streamed
//! in both directions so that a large file never sits in memory. An upload creates the
//! directories missing above its file as root, handing them to the user, as E2B's envd
//! does; the file itself is written as the user.

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
    let r2 = root.clone();
    let p2 = p.clone();
    let u2 = user.clone();
    let (file, size) =
        tokio::task::spawn_blocking(move || users::as_fs_user(&u2, || r2.open_read(&p2)))
            .await
            .map_err(|e| FsError::Io(p.abs.clone(), std::io::Error::other(e)))??;
    let stream =
        tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(file), 256 * 1024);
    let name = std::path::Path::new(&p.abs)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let disposition = content_disposition(&name);
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, size)
        .header(header::CONTENT_DISPOSITION, disposition)
        .body(Body::from_stream(stream))
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

async fn write_stream<S, E>(
    root: &Arc<FsRoot>,
    path: &str,
    user: &users::User,
    mut body: S,
) -> Result<WrittenEntry, FsError>
where
    S: futures::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let p = root.check(path, user)?;
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
        let chunk = chunk.map_err(|e| FsError::InvalidPath(format!("upload interrupted: {e}")))?;
        file.write_all(&chunk)
            .await
            .map_err(|e| FsError::from_io(&p.abs, e))?;
    }
    file.flush()
        .await
        .map_err(|e| FsError::from_io(&p.abs, e))?;
    let name = std::path::Path::new(&p.abs)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(WrittenEntry {
        name,
        r#type: "file",
        path: p.abs,
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
    let is_multipart = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let mut written = Vec::new();
    if is_multipart {
        let (parts, body) = request.into_parts();
        let (body, pump) = drained(body);
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
                written.push(write_stream(&root, &dest, &user, field).await?);
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
        let body = request.into_body().into_data_stream();
        written.push(write_stream(&root, &path, &user, body).await?);
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
