//! E2B's volume-content API (`/volumecontent/{volumeID}/...`, the host the SDKs reach at
//! `E2B_VOLUME_API_URL`): read, write, list, make directories, stat, update owner and
//! mode, remove, on the volume's host mount through `sandpit_runtime::volume_files`, which
//! keeps every operation inside the volume.
//!
//! Authentication: `Authorization: Bearer <token>` with the volume's own token (an HMAC of
//! its id under a key kept in `DATA_DIR/volumes/content.key`, so it opens that volume
//! only and survives restarts), or an API key of the volume's owner. A token for another
//! volume is 403; another owner's volume is 404.

use super::E2bError;
use crate::api::AppState;
use crate::error::ApiError;
use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use http::{HeaderMap, StatusCode};
use sandpit_runtime::volume_files::{Entry, EntryKind, Meta, VolumeFileError, VolumeRoot};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use tokio::io::AsyncWriteExt;

/// Prefix of a volume token (what tells it from an API key).
pub const TOKEN_PREFIX: &str = "sp_vol_";
/// Largest upload accepted, in bytes (the volume's file system is the limit below it).
pub const MAX_UPLOAD: u64 = 4 << 30;

/// Where the token key lives under the data directory.
const KEY_FILE: &str = "volumes/content.key";

/// The daemon's key for volume tokens, made on first use.
fn content_key(state: &AppState) -> Result<[u8; 32], E2bError> {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = state.manager.config().data_dir.join(KEY_FILE);
    let read = |p: &std::path::Path| -> std::io::Result<Option<[u8; 32]>> {
        match std::fs::File::open(p) {
            Ok(mut f) => {
                let mut k = [0u8; 32];
                f.read_exact(&mut k)?;
                Ok(Some(k))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    };
    let internal = |e: std::io::Error| {
        E2bError(ApiError::internal_from(
            "reading the volume token key",
            &e as &(dyn std::error::Error + 'static),
        ))
    };
    if let Some(k) = read(&path).map_err(internal)? {
        return Ok(k);
    }
    let mut k = [0u8; 32];
    rand::Rng::fill(&mut rand::rng(), &mut k);
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
    {
        Ok(mut f) => {
            f.write_all(&k).map_err(internal)?;
            f.sync_all().map_err(internal)?;
            Ok(k)
        }
        // Made meanwhile by another request: use that one.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read(&path)
            .map_err(internal)?
            .ok_or_else(|| E2bError(ApiError::internal("the volume token key vanished"))),
        Err(e) => Err(internal(e)),
    }
}

fn mac(key: &[u8; 32], volume_id: &str) -> Result<hmac::Hmac<sha2::Sha256>, E2bError> {
    use hmac::Mac;
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(key)
        .map_err(|_| E2bError(ApiError::internal("bad volume token key")))?;
    m.update(b"sandpit-volume-content\n");
    m.update(volume_id.as_bytes());
    Ok(m)
}

/// The token that opens volume `volume_id`'s content.
pub fn volume_token(state: &AppState, volume_id: &str) -> Result<String, E2bError> {
    use hmac::Mac;
    let m = mac(&content_key(state)?, volume_id)?;
    let hex: String = m
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(format!("{TOKEN_PREFIX}{hex}"))
}

fn token_opens(state: &AppState, token: &str, volume_id: &str) -> Result<bool, E2bError> {
    use hmac::Mac;
    let Some(hex) = token.strip_prefix(TOKEN_PREFIX) else {
        return Ok(false);
    };
    if hex.len() != 64 {
        return Ok(false);
    }
    let mut raw = [0u8; 32];
    for (i, b) in raw.iter_mut().enumerate() {
        match u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("zz"), 16) {
            Ok(v) => *b = v,
            Err(_) => return Ok(false),
        }
    }
    // verify_slice compares in constant time.
    Ok(mac(&content_key(state)?, volume_id)?
        .verify_slice(&raw)
        .is_ok())
}

fn bearer(headers: &HeaderMap) -> Option<String> {
    let auth = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    auth.strip_prefix("Bearer ").map(|t| t.trim().to_string())
}

/// The host mount of volume `id` if the request may open it.
async fn open(state: &AppState, headers: &HeaderMap, id: &str) -> Result<PathBuf, E2bError> {
    let all = state.store.list_volumes(None).await?;
    let found = match bearer(headers) {
        Some(t) if t.starts_with(TOKEN_PREFIX) => {
            if !token_opens(state, &t, id)? {
                return Err(E2bError::new(
                    StatusCode::FORBIDDEN,
                    "the token does not open this volume",
                ));
            }
            all.into_iter().find(|v| v.id == id)
        }
        _ => {
            let (owner, _) = crate::api::resolve_owner(state, headers).await?;
            all.into_iter().find(|v| v.id == id && v.owner == owner)
        }
    };
    let v = found.ok_or_else(|| E2bError(ApiError::not_found(format!("volume {id} not found"))))?;
    if v.state != sandpit_store::VolumeState::Ready {
        return Err(E2bError(ApiError::conflict(format!(
            "volume {id} is {}",
            v.state.as_str()
        ))));
    }
    Ok(state.manager.volume_host_dir(&v.id).await?)
}

impl From<VolumeFileError> for E2bError {
    fn from(e: VolumeFileError) -> Self {
        let status = match &e {
            VolumeFileError::InvalidPath(_)
            | VolumeFileError::InvalidArgument(_)
            | VolumeFileError::WrongType(_) => StatusCode::BAD_REQUEST,
            VolumeFileError::NotFound(_) => StatusCode::NOT_FOUND,
            VolumeFileError::Denied(_) => StatusCode::FORBIDDEN,
            VolumeFileError::Conflict(_) => StatusCode::CONFLICT,
            VolumeFileError::NoSpace => StatusCode::INSUFFICIENT_STORAGE,
            VolumeFileError::Sys { .. } => {
                return E2bError(ApiError::internal_from(
                    "volume file operation",
                    &e as &(dyn std::error::Error + 'static),
                ));
            }
        };
        E2bError::new(status, e.to_string())
    }
}

/// Runs a file operation on the volume's root on the blocking pool.
async fn on_root<T: Send + 'static>(
    dir: PathBuf,
    f: impl FnOnce(&VolumeRoot) -> Result<T, VolumeFileError> + Send + 'static,
) -> Result<T, E2bError> {
    tokio::task::spawn_blocking(move || f(&VolumeRoot::open(&dir)?))
        .await
        .map_err(|e| E2bError(ApiError::internal(format!("volume file task: {e}"))))?
        .map_err(E2bError::from)
}

/// One entry as E2B's `VolumeEntryStat`.
#[derive(Debug, Serialize)]
pub struct EntryStat {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: String,
    pub mtime: String,
    pub ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

impl From<Entry> for EntryStat {
    fn from(e: Entry) -> Self {
        let t = |ns: i64| super::rfc3339(ns / 1_000_000);
        Self {
            kind: match e.kind {
                EntryKind::File => "file",
                EntryKind::Directory => "directory",
                EntryKind::Symlink => "symlink",
                EntryKind::Other => "unknown",
            },
            atime: t(e.atime_ns),
            mtime: t(e.mtime_ns),
            ctime: t(e.ctime_ns),
            name: if e.path == "/" { "/".into() } else { e.name },
            path: e.path,
            size: e.size,
            mode: e.mode,
            uid: e.uid,
            gid: e.gid,
            target: e.target,
        }
    }
}

/// Query of every content request.
#[derive(Debug, Deserialize)]
pub struct ContentQuery {
    pub path: String,
    pub depth: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
    pub force: Option<bool>,
}

impl ContentQuery {
    fn meta(&self) -> Meta {
        Meta {
            uid: self.uid,
            gid: self.gid,
            mode: self.mode,
        }
    }
}

fn query(q: Result<Query<ContentQuery>, QueryRejection>) -> Result<ContentQuery, E2bError> {
    q.map(|Query(q)| q)
        .map_err(|e| E2bError::bad_request(format!("invalid query: {}", e.body_text())))
}

/// `PATCH /volumecontent/{id}/path` body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetaUpdate {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

/// `GET .../file`: the file's bytes, streamed.
async fn read_file(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
) -> Result<Response, E2bError> {
    let q = query(q)?;
    let dir = open(&state, &headers, &id).await?;
    let (file, size) = on_root(dir, move |r| r.open_read(&q.path)).await?;
    let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file));
    Ok((
        [
            (
                http::header::CONTENT_TYPE,
                "application/octet-stream".to_string(),
            ),
            (http::header::CONTENT_LENGTH, size.to_string()),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// `PUT .../file`: writes the body to the file (made when missing), 201 with its stat.
async fn write_file(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
    body: Body,
) -> Result<(StatusCode, Json<EntryStat>), E2bError> {
    let q = query(q)?;
    let dir = open(&state, &headers, &id).await?;
    let (meta, force, path) = (q.meta(), q.force.unwrap_or(false), q.path.clone());
    let p = path.clone();
    let (file, created) = on_root(dir.clone(), move |r| {
        r.open_write(&p, &meta, force, sandpit_runtime::volume::ROOT_OWNER)
    })
    .await?;
    let mut f = tokio::fs::File::from_std(file);
    let copied: Result<(), E2bError> = async {
        let mut total = 0u64;
        let mut s = body.into_data_stream();
        while let Some(chunk) = s.next().await {
            let c = chunk.map_err(|e| E2bError::bad_request(format!("reading the body: {e}")))?;
            total += c.len() as u64;
            if total > MAX_UPLOAD {
                return Err(E2bError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("an upload is at most {MAX_UPLOAD} bytes"),
                ));
            }
            f.write_all(&c).await.map_err(write_error)?;
        }
        f.flush().await.map_err(write_error)
    }
    .await;
    let file = f.into_std().await;
    let p = path.clone();
    let done = match copied {
        Ok(()) => on_root(dir.clone(), move |r| r.finish_write(&file, &p, &meta)).await,
        Err(e) => Err(e),
    };
    match done {
        Ok(e) => Ok((StatusCode::CREATED, Json(e.into()))),
        Err(e) => {
            if created {
                // A half-written new file is not left behind.
                let _ = on_root(dir, move |r| r.remove(&path)).await;
            }
            Err(e)
        }
    }
}

fn write_error(e: std::io::Error) -> E2bError {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => VolumeFileError::NoSpace.into(),
        _ => E2bError(ApiError::internal_from(
            "writing a volume file",
            &e as &(dyn std::error::Error + 'static),
        )),
    }
}

/// `GET .../dir`: the entries of a directory, `depth` levels down (default 1).
async fn list_dir(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
) -> Result<Json<Vec<EntryStat>>, E2bError> {
    let q = query(q)?;
    let dir = open(&state, &headers, &id).await?;
    let depth = q.depth.unwrap_or(1);
    let l = on_root(dir, move |r| r.list(&q.path, depth)).await?;
    Ok(Json(l.into_iter().map(EntryStat::from).collect()))
}

/// `POST .../dir`: makes a directory, 201 with its stat.
async fn make_dir(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
) -> Result<(StatusCode, Json<EntryStat>), E2bError> {
    let q = query(q)?;
    let dir = open(&state, &headers, &id).await?;
    let (meta, force) = (q.meta(), q.force.unwrap_or(false));
    let e = on_root(dir, move |r| {
        r.make_dir(&q.path, &meta, force, sandpit_runtime::volume::ROOT_OWNER)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(e.into())))
}

/// `GET .../path`: stat of an entry (a symlink is reported, not followed).
async fn stat(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
) -> Result<Json<EntryStat>, E2bError> {
    let q = query(q)?;
    let dir = open(&state, &headers, &id).await?;
    Ok(Json(on_root(dir, move |r| r.stat(&q.path)).await?.into()))
}

/// `PATCH .../path`: sets uid, gid and mode.
async fn update(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
    body: axum::body::Bytes,
) -> Result<Json<EntryStat>, E2bError> {
    let q = query(q)?;
    let m: MetaUpdate = if body.iter().all(u8::is_ascii_whitespace) {
        MetaUpdate::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| E2bError::bad_request(format!("invalid body: {e}")))?
    };
    let dir = open(&state, &headers, &id).await?;
    let meta = Meta {
        uid: m.uid,
        gid: m.gid,
        mode: m.mode,
    };
    Ok(Json(
        on_root(dir, move |r| r.set_meta(&q.path, &meta))
            .await?
            .into(),
    ))
}

/// `DELETE .../path`: removes a file or a directory with its contents, 204.
async fn remove(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
) -> Result<StatusCode, E2bError> {
    let q = query(q)?;
    let dir = open(&state, &headers, &id).await?;
    on_root(dir, move |r| r.remove(&q.path)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The content API's routes (authenticated here, by volume token or API key).
pub fn routes() -> Router<AppState> {
    use axum::routing::get;
    Router::new()
        .route(
            "/volumecontent/{id}/file",
            get(read_file)
                .put(write_file)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/volumecontent/{id}/dir", get(list_dir).post(make_dir))
        .route(
            "/volumecontent/{id}/path",
            get(stat)
                .patch(update)
                .delete(remove)
                .layer(axum::extract::DefaultBodyLimit::max(64 << 10)),
        )
}
