//! E2B's template build API (`POST /v3/templates`, file uploads, `POST
//! /v2/templates/{id}/builds/{buildID}`, build status with paged logs, tags), on top of
//! sandpit's templates: a build runs its steps in a sandbox of its base template and
//! becomes a sandpit template made from that sandbox's files (see `run.rs`).
//!
//! A team's E2B templates, builds and tags are records of the store (migration 18); each
//! ready build names the sandpit template it made (`e2b-<template id>-<build id>`), which
//! is what `Sandbox.create("name:tag")` starts.

mod run;

use super::{E2bError, Required};
use crate::api::{AppState, Owner};
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, StatusCode};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, LazyLock};

pub use run::image_template_name;

/// Largest upload of a COPY step's files (the compressed tar the SDK sends).
pub const MAX_UPLOAD: u64 = 512 << 20;
/// Most uploads one template keeps (each COPY source set is one).
const MAX_UPLOADS: usize = 256;
/// Most bytes of uploads one template keeps.
const MAX_UPLOAD_BYTES: u64 = 4 << 30;
/// How long an upload URL stays valid.
const UPLOAD_URL_SECS: i64 = 3600;
/// Lines a build log keeps; later lines are dropped and counted.
const MAX_LOG_ENTRIES: usize = 10_000;
/// Longest log line kept.
const MAX_LOG_LINE: usize = 4000;
/// Build logs kept in memory (finished ones go first).
const MAX_LOGS: usize = 256;
/// Most log entries one status answer carries (the SDKs page on).
const MAX_PAGE: usize = 100;
/// Longest template name and tag.
const MAX_NAME: usize = 128;
/// Most steps a build may have.
const MAX_STEPS: usize = 1000;

/// `POST /v3/templates`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestBuild {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    cpu_count: Option<i64>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<i64>,
    #[serde(rename = "teamID")]
    _team_id: Option<String>,
}

/// The answer to `POST /v3/templates`.
#[derive(Debug, Serialize)]
pub struct RequestedBuild {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "buildID")]
    build_id: String,
    public: bool,
    names: Vec<String>,
    tags: Vec<String>,
    aliases: Vec<String>,
}

/// One step of a build as the SDKs send it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StepSpec {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
    files_hash: Option<String>,
    #[serde(default)]
    _force: Option<bool>,
}

/// `POST /v2/templates/{id}/builds/{buildID}`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartBuild {
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<serde_json::Value>,
    #[serde(default)]
    force: bool,
    #[serde(default)]
    steps: Vec<StepSpec>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

/// One line of a build log, as E2B's status answer carries it.
#[derive(Debug, Clone, Serialize)]
pub struct LogEntry {
    timestamp: String,
    level: &'static str,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    step: Option<String>,
}

/// Why a build failed.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Reason {
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    step: Option<String>,
    log_entries: Vec<LogEntry>,
}

/// `GET /templates/{id}/builds/{buildID}/status`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildStatus {
    logs: Vec<String>,
    log_entries: Vec<LogEntry>,
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "buildID")]
    build_id: String,
    status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<Reason>,
}

/// `GET /templates/{id}/files/{hash}`.
#[derive(Debug, Serialize)]
pub struct FileUpload {
    present: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<String>,
}

/// `POST /templates/tags`.
#[derive(Debug, Deserialize)]
pub struct AssignTags {
    target: String,
    tags: Vec<String>,
}

/// The answer to `POST /templates/tags`.
#[derive(Debug, Serialize)]
pub struct AssignedTags {
    tags: Vec<String>,
    #[serde(rename = "buildID")]
    build_id: String,
}

/// `DELETE /templates/tags`.
#[derive(Debug, Deserialize)]
pub struct DeleteTags {
    name: String,
    tags: Vec<String>,
}

/// One tag of `GET /templates/{id}/tags`.
#[derive(Debug, Serialize)]
pub struct TagInfo {
    tag: String,
    #[serde(rename = "buildID")]
    build_id: String,
    #[serde(rename = "createdAt")]
    created_at: String,
}

// ---------------------------------------------------------------------------------------
// Build logs
// ---------------------------------------------------------------------------------------

/// The log of one build run by this daemon.
pub struct BuildLog {
    entries: Mutex<LogState>,
}

struct LogState {
    entries: Vec<LogEntry>,
    dropped: u64,
    done: bool,
}

impl BuildLog {
    fn new() -> Arc<Self> {
        Arc::new(BuildLog {
            entries: Mutex::new(LogState {
                entries: Vec::new(),
                dropped: 0,
                done: false,
            }),
        })
    }

    /// Appends a line (at `level`, for `step`).
    fn push(&self, level: &'static str, step: Option<&str>, message: impl Into<String>) {
        let mut message: String = message.into();
        if message.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push('…');
        }
        tracing::debug!(level, step, "{message}");
        let mut s = self.entries.lock();
        if s.entries.len() >= MAX_LOG_ENTRIES {
            s.dropped += 1;
            return;
        }
        s.entries.push(LogEntry {
            timestamp: now_rfc3339(),
            level,
            message,
            step: step.map(String::from),
        });
    }

    fn info(&self, step: Option<&str>, message: impl Into<String>) {
        self.push("info", step, message);
    }

    fn finish(&self) {
        self.entries.lock().done = true;
    }
}

/// Build logs with their build ids, oldest first.
type LogList = VecDeque<(String, Arc<BuildLog>)>;

/// Logs of the builds this daemon ran, by build id. Kept in the process (like the core's
/// access cache): a restart loses them, and the status answer then says so.
static LOGS: LazyLock<Mutex<LogList>> = LazyLock::new(|| Mutex::new(VecDeque::new()));

fn register_log(build_id: &str) -> Arc<BuildLog> {
    let log = BuildLog::new();
    let mut logs = LOGS.lock();
    while logs.len() >= MAX_LOGS {
        match logs.iter().position(|(_, l)| l.entries.lock().done) {
            Some(i) => {
                logs.remove(i);
            }
            None => break,
        }
    }
    logs.push_back((build_id.to_string(), log.clone()));
    log
}

fn log_of(build_id: &str) -> Option<Arc<BuildLog>> {
    LOGS.lock()
        .iter()
        .find(|(id, _)| id == build_id)
        .map(|(_, l)| l.clone())
}

fn now_rfc3339() -> String {
    use time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::now_utc()
        .format(&Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

// ---------------------------------------------------------------------------------------
// Names, tags, ids
// ---------------------------------------------------------------------------------------

/// A template name or a tag: letters, digits, `-`, `_`, `.`, not starting with `.` or `-`.
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !s.starts_with(['.', '-'])
}

fn check_name(name: &str) -> Result<(), E2bError> {
    if valid_name(name) {
        Ok(())
    } else {
        Err(E2bError::bad_request(format!(
            "invalid template name {name:?}: up to {MAX_NAME} letters, digits, '-', '_' or '.', not starting with '.' or '-'"
        )))
    }
}

fn check_tag(tag: &str) -> Result<(), E2bError> {
    if valid_name(tag) {
        Ok(())
    } else {
        Err(E2bError::bad_request(format!(
            "invalid tag {tag:?}: a tag is up to {MAX_NAME} letters, digits, '-', '_' or '.' (not starting with '.' or '-'), without the template name"
        )))
    }
}

/// `name` or `name:tag`, checked; the tag is `None` when not given.
fn split_name(full: &str) -> Result<(String, Option<String>), E2bError> {
    match full.split_once(':') {
        None => {
            check_name(full)?;
            Ok((full.to_string(), None))
        }
        Some((name, tag)) => {
            if name.is_empty() || tag.is_empty() {
                return Err(E2bError::bad_request(format!(
                    "invalid tag format {full:?}: expected name:tag"
                )));
            }
            check_name(name)?;
            check_tag(tag)?;
            Ok((name.to_string(), Some(tag.to_string())))
        }
    }
}

/// E2B's template ids: 20 lowercase letters and digits.
fn new_template_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..20)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// The sandpit template a build makes.
fn sandpit_name(template_id: &str, build_id: &str) -> String {
    format!("e2b-{template_id}-{}", build_id.replace('-', ""))
}

const DEFAULT_TAG: &str = "default";

/// The sandpit template an E2B template id or `name[:tag]` of `owner` stands for, when it
/// is one built through the build API (`None` otherwise). A bare name starts its
/// `default` tag, else its newest ready build.
pub async fn resolve(state: &AppState, owner: &str, id: &str) -> Result<Option<String>, E2bError> {
    let (name, tag) = match id.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (id, None),
    };
    let Some(t) = state.store.e2b_template(owner, name).await? else {
        return Ok(None);
    };
    let tags = state.store.e2b_tags(&t.id).await?;
    let wanted = tag.unwrap_or(DEFAULT_TAG);
    let build_id = match tags.iter().find(|x| x.tag == wanted) {
        Some(x) => x.build_id.clone(),
        None if tag.is_none() => {
            let builds = state.store.e2b_builds(&t.id).await?;
            match builds.into_iter().find(|b| b.status == "ready") {
                Some(b) => b.id,
                None => {
                    return Err(not_found(format!("template {name} has no ready build yet")));
                }
            }
        }
        None => return Err(not_found(format!("template {id} not found"))),
    };
    let build = state.store.e2b_build(&t.id, &build_id).await?;
    match build.and_then(|b| b.template) {
        Some(s) => Ok(Some(s)),
        None => Err(not_found(format!("template {id} has no ready build"))),
    }
}

fn not_found(message: impl Into<String>) -> E2bError {
    E2bError::new(StatusCode::NOT_FOUND, message)
}

async fn owned_template(
    state: &AppState,
    owner: &Owner,
    id: &str,
) -> Result<sandpit_store::E2bTemplateRecord, E2bError> {
    state
        .store
        .e2b_template(&owner.0, id)
        .await?
        .ok_or_else(|| not_found(format!("template {id} not found")))
}

// ---------------------------------------------------------------------------------------
// Routes
// ---------------------------------------------------------------------------------------

/// `POST /v3/templates`: registers a build of the caller's template `name` (made when new).
pub async fn request_build(
    State(state): State<AppState>,
    owner: Owner,
    Required(req): Required<RequestBuild>,
) -> Result<(StatusCode, Json<RequestedBuild>), E2bError> {
    let full = req
        .name
        .or(req.alias)
        .ok_or_else(|| E2bError::bad_request("name is required"))?;
    let (name, tag) = split_name(&full)?;
    if state.e2b.templates.contains_key(&name) {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("{name} is a template of this daemon's [e2b] config; choose another name"),
        ));
    }
    let mut tags: Vec<String> = Vec::new();
    for t in tag.into_iter().chain(req.tags) {
        check_tag(&t)?;
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    if tags.is_empty() {
        tags.push(DEFAULT_TAG.into());
    }
    let cpu_count = req.cpu_count.unwrap_or(2);
    let memory_mb = req.memory_mb.unwrap_or(1024);
    if !(1..=64).contains(&cpu_count) || !(128..=(256 << 10)).contains(&memory_mb) {
        return Err(E2bError::bad_request(
            "cpuCount must be between 1 and 64 and memoryMB between 128 and 262144",
        ));
    }
    let build_id = uuid::Uuid::new_v4().to_string();
    let record = sandpit_store::E2bTemplateRecord {
        id: new_template_id(),
        owner: owner.0.clone(),
        name: name.clone(),
        cpu_count,
        memory_mb,
        created_at_ms: 0,
        updated_at_ms: 0,
    };
    let stored = state
        .store
        .e2b_request_build(&record, &build_id, &tags)
        .await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(RequestedBuild {
            template_id: stored.id,
            build_id,
            public: false,
            names: vec![name.clone()],
            tags,
            aliases: vec![name],
        }),
    ))
}

/// Where a COPY step's upload is kept: `DATA_DIR/e2b-files/<template id>/<hash>`.
fn upload_path(state: &AppState, template_id: &str, hash: &str) -> PathBuf {
    state
        .manager
        .config()
        .data_dir
        .join("e2b-files")
        .join(template_id)
        .join(hash)
}

fn check_hash(hash: &str) -> Result<(), E2bError> {
    if hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(E2bError::bad_request(
            "a files hash is 64 hexadecimal digits (sha256)",
        ))
    }
}

/// Key of upload URL signatures: made per daemon process, so a URL dies with it.
static UPLOAD_KEY: LazyLock<[u8; 32]> = LazyLock::new(|| {
    use rand::Rng;
    let mut k = [0u8; 32];
    rand::rng().fill(&mut k);
    k
});

fn upload_signature(template_id: &str, hash: &str, expires: i64) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = match Hmac::<sha2::Sha256>::new_from_slice(&UPLOAD_KEY[..]) {
        Ok(m) => m,
        Err(_) => return String::new(),
    };
    mac.update(format!("e2b-upload\n{template_id}\n{hash}\n{expires}").as_bytes());
    hex_encode(&mac.finalize().into_bytes())
}

fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `GET /templates/{id}/files/{hash}`: whether the files of a COPY step are here, and the
/// URL (on this daemon, signed, valid for an hour) the SDK uploads their tar to.
pub async fn file_upload(
    State(state): State<AppState>,
    owner: Owner,
    headers: HeaderMap,
    uri: http::Uri,
    tls: Option<axum::Extension<crate::tls::ConnInfo>>,
    Path((id, hash)): Path<(String, String)>,
) -> Result<(StatusCode, Json<FileUpload>), E2bError> {
    check_hash(&hash)?;
    let t = owned_template(&state, &owner, &id).await?;
    let present =
        std::fs::symlink_metadata(upload_path(&state, &t.id, &hash)).is_ok_and(|m| m.is_file());
    let expires = time::OffsetDateTime::now_utc().unix_timestamp() + UPLOAD_URL_SECS;
    // HTTP/2 names the host in the URI, HTTP/1.1 in the Host header.
    let host = uri
        .authority()
        .map(|a| a.as_str())
        .or_else(|| {
            headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
        })
        .filter(|h| {
            h.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
        })
        .ok_or_else(|| E2bError::bad_request("the request has no usable Host header"))?;
    // The URL goes back the way the request came: over the daemon's TLS, or a TLS front
    // end that says so.
    let forwarded_https = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        == Some("https");
    let scheme = if tls.is_some() || forwarded_https {
        "https"
    } else {
        "http"
    };
    let url = format!(
        "{scheme}://{host}/e2b-uploads/{}/{hash}?expires={expires}&signature={}",
        t.id,
        upload_signature(&t.id, &hash, expires)
    );
    Ok((
        StatusCode::CREATED,
        Json(FileUpload {
            present,
            url: Some(url),
        }),
    ))
}

/// `PUT /e2b-uploads/{id}/{hash}?expires&signature`: the upload itself, authorized by the
/// signature of the URL `file_upload` gave (the SDKs send no API key with it). The body is
/// stored as it comes, up to [`MAX_UPLOAD`] bytes; it is checked when a build uses it.
pub async fn upload(
    State(state): State<AppState>,
    Path((id, hash)): Path<(String, String)>,
    uri: http::Uri,
    body: axum::body::Body,
) -> Result<StatusCode, E2bError> {
    use futures::StreamExt;
    use subtle::ConstantTimeEq;
    use tokio::io::AsyncWriteExt;
    check_hash(&hash)?;
    let (mut expires, mut signature) = (None, None);
    for (k, v) in form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()) {
        match &*k {
            "expires" => expires = v.parse::<i64>().ok(),
            "signature" => signature = Some(v.into_owned()),
            _ => {}
        }
    }
    let denied = || E2bError::new(StatusCode::FORBIDDEN, "invalid or expired upload URL");
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(denied());
    }
    let (Some(expires), Some(signature)) = (expires, signature) else {
        return Err(denied());
    };
    let expected = upload_signature(&id, &hash, expires);
    if expected.is_empty()
        || !bool::from(expected.as_bytes().ct_eq(signature.as_bytes()))
        || expires < time::OffsetDateTime::now_utc().unix_timestamp()
    {
        return Err(denied());
    }
    let dest = upload_path(&state, &id, &hash);
    let dir = dest
        .parent()
        .map(PathBuf::from)
        .ok_or_else(|| E2bError(crate::error::ApiError::internal("upload path")))?;
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| io_err("create the upload directory", e))?;
    let (count, bytes) = stored_uploads(&dir).await;
    if count >= MAX_UPLOADS || bytes >= MAX_UPLOAD_BYTES {
        return Err(E2bError::new(
            StatusCode::INSUFFICIENT_STORAGE,
            format!(
                "template {id} holds {count} uploads ({bytes} bytes), the most one template may keep; delete the template to start over"
            ),
        ));
    }
    let part = dir.join(format!(".{hash}.{}", uuid::Uuid::new_v4().simple()));
    let mut file = tokio::fs::File::create(&part)
        .await
        .map_err(|e| io_err("create the upload file", e))?;
    let mut stream = body.into_data_stream();
    let mut written: u64 = 0;
    let result: Result<(), E2bError> = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| E2bError::bad_request(format!("upload body: {e}")))?;
            written += chunk.len() as u64;
            if written > MAX_UPLOAD {
                return Err(E2bError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("an upload may hold at most {MAX_UPLOAD} bytes"),
                ));
            }
            file.write_all(&chunk)
                .await
                .map_err(|e| io_err("write the upload", e))?;
        }
        file.flush()
            .await
            .map_err(|e| io_err("write the upload", e))?;
        Ok(())
    }
    .await;
    drop(file);
    if let Err(e) = result {
        let _ = tokio::fs::remove_file(&part).await;
        return Err(e);
    }
    tokio::fs::rename(&part, &dest)
        .await
        .map_err(|e| io_err("store the upload", e))?;
    tracing::debug!(template = %id, hash = %hash, bytes = written, "build files uploaded");
    Ok(StatusCode::OK)
}

/// How many uploads a template's directory holds, and their bytes.
async fn stored_uploads(dir: &std::path::Path) -> (usize, u64) {
    let (mut count, mut bytes) = (0, 0);
    if let Ok(mut rd) = tokio::fs::read_dir(dir).await {
        while let Ok(Some(e)) = rd.next_entry().await {
            if let Ok(m) = e.metadata().await {
                count += 1;
                bytes += m.len();
            }
        }
    }
    (count, bytes)
}

fn io_err(what: &str, e: std::io::Error) -> E2bError {
    E2bError(crate::error::ApiError::internal(format!("{what}: {e}")))
}

/// `POST /v2/templates/{id}/builds/{buildID}`: checks the build's base and steps, then
/// runs it in the background (follow it with the status route).
pub async fn start_build(
    State(state): State<AppState>,
    owner: Owner,
    Path((id, build_id)): Path<(String, String)>,
    Required(req): Required<StartBuild>,
) -> Result<StatusCode, E2bError> {
    let t = owned_template(&state, &owner, &id).await?;
    let build = state
        .store
        .e2b_build(&t.id, &build_id)
        .await?
        .ok_or_else(|| not_found(format!("build {build_id} of template {id} not found")))?;
    if build.status != "waiting" {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!(
                "build {build_id} has already been started ({})",
                build.status
            ),
        ));
    }
    let plan = match run::plan(&state, &owner, &t, req).await {
        Ok(p) => p,
        Err(e) => {
            // The build cannot run: it ends here, with the same reason the caller gets.
            let (step, message) = (e.step.clone(), e.message.clone());
            state
                .store
                .e2b_finish_build(&build, false, Some(&message), step.as_deref())
                .await?;
            return Err(E2bError::new(e.status, message));
        }
    };
    // The log exists before the record says `building`: a status read in between must
    // not take the build for one a stopped daemon left.
    let log = register_log(&build.id);
    let moved = state
        .store
        .e2b_transition_build(&build.id, "waiting", "building")
        .await;
    if !matches!(moved, Ok(true)) {
        LOGS.lock().retain(|(_, l)| !Arc::ptr_eq(l, &log));
        moved?;
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("build {build_id} has already been started"),
        ));
    }
    tokio::spawn(run::run(
        state.clone(),
        owner.0.clone(),
        t,
        build,
        plan,
        log,
    ));
    Ok(StatusCode::ACCEPTED)
}

/// `GET /templates/{id}/builds/{buildID}/status?logsOffset&limit&level`.
pub async fn status(
    State(state): State<AppState>,
    owner: Owner,
    Path((id, build_id)): Path<(String, String)>,
    uri: http::Uri,
) -> Result<Json<BuildStatus>, E2bError> {
    let (mut offset, mut limit, mut level) = (0usize, MAX_PAGE, 0u8);
    for (k, v) in form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()) {
        let bad = |what: &str| E2bError::bad_request(format!("invalid {what}: {v:?}"));
        match &*k {
            "logsOffset" => offset = v.parse().map_err(|_| bad("logsOffset"))?,
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .map_err(|_| bad("limit"))?
                    .clamp(0, MAX_PAGE)
            }
            "level" => level = level_rank(&v).ok_or_else(|| bad("level"))?,
            _ => {}
        }
    }
    let t = owned_template(&state, &owner, &id).await?;
    let mut build = state
        .store
        .e2b_build(&t.id, &build_id)
        .await?
        .ok_or_else(|| not_found(format!("build {build_id} of template {id} not found")))?;
    let log = log_of(&build.id);
    if build.status == "building" && log.is_none() {
        // Its runner was in a daemon that stopped.
        let why = "the build was interrupted (the daemon stopped)";
        state
            .store
            .e2b_finish_build(&build, false, Some(why), None)
            .await?;
        build.status = "error".into();
        build.reason = Some(why.into());
        leftovers(&state, &owner.0, &build.id).await;
    }
    let all: Vec<LogEntry> = log
        .map(|l| {
            l.entries
                .lock()
                .entries
                .iter()
                .filter(|e| level_rank(e.level).unwrap_or(0) >= level)
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let page: Vec<LogEntry> = all.iter().skip(offset).take(limit).cloned().collect();
    let reason = (build.status == "error").then(|| Reason {
        message: build
            .reason
            .clone()
            .unwrap_or_else(|| "the build failed".into()),
        step: build.step.clone(),
        log_entries: all
            .iter()
            .rev()
            .take(20)
            .rev()
            .filter(|e| e.level == "error")
            .cloned()
            .collect(),
    });
    Ok(Json(BuildStatus {
        logs: page
            .iter()
            .map(|e| format!("[{}] {}", e.timestamp, e.message))
            .collect(),
        log_entries: page,
        template_id: t.id,
        build_id: build.id,
        status: build.status,
        reason,
    }))
}

/// Removes what an interrupted build left: its sandbox and its snapshot.
async fn leftovers(state: &AppState, owner: &str, build_id: &str) {
    use sandpit_store::{SandboxFilter, SandboxState as S};
    let filter = SandboxFilter {
        owner: Some(owner.to_string()),
        states: vec![S::Creating, S::Running, S::Paused, S::Hibernated],
        metadata: vec![("e2b.build".to_string(), build_id.to_string())],
        ..Default::default()
    };
    if let Ok(page) = state.store.list_sandboxes(&filter).await {
        for rec in page.items {
            if let Err(e) = state.manager.destroy(&rec).await {
                tracing::warn!(sandbox = %rec.id, error = %e.chain(), "removing an interrupted build's sandbox failed");
            }
        }
    }
    let snapshot = format!("e2b-build-{build_id}");
    if let Ok(Some(s)) = state.store.get_snapshot(owner, &snapshot).await
        && let Err(e) = state.manager.delete_snapshot(owner, &s.id, false).await
    {
        tracing::warn!(snapshot = %s.id, error = %e.chain(), "removing an interrupted build's snapshot failed");
    }
}

fn level_rank(level: &str) -> Option<u8> {
    Some(match level {
        "debug" => 0,
        "info" => 1,
        "warn" => 2,
        "error" => 3,
        _ => return None,
    })
}

/// `POST /templates/tags`: points more tags at the build `target` (`name:tag`) names.
pub async fn assign_tags(
    State(state): State<AppState>,
    owner: Owner,
    Required(req): Required<AssignTags>,
) -> Result<(StatusCode, Json<AssignedTags>), E2bError> {
    let (name, tag) = split_name(&req.target)?;
    if req.tags.is_empty() {
        return Err(E2bError::bad_request("tags must name at least one tag"));
    }
    for t in &req.tags {
        check_tag(t)?;
    }
    let t = owned_template(&state, &owner, &name).await?;
    let tag = tag.unwrap_or_else(|| DEFAULT_TAG.into());
    let build_id = state
        .store
        .e2b_tags(&t.id)
        .await?
        .into_iter()
        .find(|x| x.tag == tag)
        .map(|x| x.build_id)
        .ok_or_else(|| not_found(format!("template {name}:{tag} not found")))?;
    state
        .store
        .e2b_assign_tags(&t.id, &build_id, &req.tags)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(AssignedTags {
            tags: req.tags,
            build_id,
        }),
    ))
}

/// `DELETE /templates/tags`: removes tags of the template `name`.
pub async fn delete_tags(
    State(state): State<AppState>,
    owner: Owner,
    Required(req): Required<DeleteTags>,
) -> Result<StatusCode, E2bError> {
    let (name, _) = split_name(&req.name)?;
    for t in &req.tags {
        check_tag(t)?;
    }
    let t = owned_template(&state, &owner, &name).await?;
    let removed = state.store.e2b_remove_tags(&t.id, &req.tags).await?;
    if removed == 0 && !req.tags.is_empty() {
        return Err(not_found(format!(
            "template {name} has none of the tags {}",
            req.tags.join(", ")
        )));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /templates/{id}/tags`.
pub async fn list_tags(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<Vec<TagInfo>>, E2bError> {
    let t = owned_template(&state, &owner, &id).await?;
    Ok(Json(
        state
            .store
            .e2b_tags(&t.id)
            .await?
            .into_iter()
            .map(|x| TagInfo {
                tag: x.tag,
                build_id: x.build_id,
                created_at: super::rfc3339(x.created_at_ms),
            })
            .collect(),
    ))
}

/// The caller's E2B-built template `id` (id or name) as `GET /templates/{id}` shows it, if
/// it is one.
pub async fn describe(
    state: &AppState,
    owner: &Owner,
    id: &str,
) -> Result<Option<super::types::Template>, E2bError> {
    let Some(t) = state.store.e2b_template(&owner.0, id).await? else {
        return Ok(None);
    };
    let builds = state.store.e2b_builds(&t.id).await?;
    let last = builds.first();
    let b = |x: &sandpit_store::E2bBuildRecord| super::types::TemplateBuild {
        build_id: x.id.clone(),
        status: x.status.clone(),
        created_at: super::rfc3339(x.created_at_ms),
        updated_at: super::rfc3339(x.updated_at_ms),
        cpu_count: t.cpu_count as u64,
        memory_mb: t.memory_mb as u64,
    };
    Ok(Some(super::types::Template {
        template_id: t.id.clone(),
        build_id: last.map(|x| x.id.clone()).unwrap_or_default(),
        cpu_count: t.cpu_count as u64,
        memory_mb: t.memory_mb as u64,
        disk_size_mb: 0,
        public: false,
        aliases: vec![t.name.clone()],
        names: vec![t.name.clone()],
        created_at: super::rfc3339(t.created_at_ms),
        updated_at: super::rfc3339(t.updated_at_ms),
        created_by: None,
        last_spawned_at: None,
        spawn_count: 0,
        build_count: builds.len() as u64,
        envd_version: super::ENVD_VERSION.into(),
        build_status: last.map(|x| x.status.clone()).unwrap_or_default(),
        builds: Some(builds.iter().map(b).collect()),
    }))
}

/// The caller's E2B-built templates as `GET /templates` shows them.
pub async fn list(
    state: &AppState,
    owner: &Owner,
) -> Result<Vec<super::types::Template>, E2bError> {
    let mut out = Vec::new();
    for t in state.store.e2b_templates(&owner.0).await? {
        if let Some(mut v) = describe(state, owner, &t.id).await? {
            v.builds = None;
            out.push(v);
        }
    }
    Ok(out)
}

/// Deletes the caller's E2B-built template `id` (id or name) with every build's sandpit
/// template and its uploads, if it is one: `Ok(false)` when it is not. Refused (409) while
/// a build runs or a sandbox uses one of its builds.
pub async fn delete(state: &AppState, owner: &Owner, id: &str) -> Result<bool, E2bError> {
    let Some(t) = state.store.e2b_template(&owner.0, id).await? else {
        return Ok(false);
    };
    let builds = state.store.e2b_builds(&t.id).await?;
    if let Some(b) = builds.iter().find(|b| b.status == "building") {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("build {} of template {} is running", b.id, t.name),
        ));
    }
    for b in &builds {
        if let Some(name) = &b.template
            && state.store.get_template(name).await?.is_some()
        {
            state.manager.templates().delete(&state.store, name).await?;
        }
    }
    state.store.e2b_delete_template(&t.id).await?;
    let files = state
        .manager
        .config()
        .data_dir
        .join("e2b-files")
        .join(&t.id);
    if let Err(e) = tokio::fs::remove_dir_all(&files).await
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(template = %t.id, error = %e, "removing a template's uploads failed");
    }
    Ok(true)
}

/// The routes above that need an API key.
pub fn routes() -> axum::Router<AppState> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v3/templates", post(request_build))
        .route("/templates/{id}/files/{hash}", get(file_upload))
        .route("/v2/templates/{id}/builds/{build_id}", post(start_build))
        .route("/templates/{id}/builds/{build_id}/status", get(status))
        .route("/templates/tags", post(assign_tags).delete(delete_tags))
        .route("/templates/{id}/tags", get(list_tags))
}

/// The upload route, authorized by its URL's signature instead of an API key.
pub fn public_routes() -> axum::Router<AppState> {
    axum::Router::new().route(
        "/e2b-uploads/{id}/{hash}",
        axum::routing::put(upload)
            .post(upload)
            .layer(axum::extract::DefaultBodyLimit::disable()),
    )
}

/// Answers an error of a build step in E2B's shape (used by the runner's plan).
#[derive(Debug, Clone)]
pub struct PlanError {
    status: StatusCode,
    step: Option<String>,
    message: String,
}

impl PlanError {
    fn bad(step: Option<String>, message: impl Into<String>) -> Self {
        PlanError {
            status: StatusCode::BAD_REQUEST,
            step,
            message: message.into(),
        }
    }
}

impl IntoResponse for PlanError {
    fn into_response(self) -> Response {
        E2bError::new(self.status, self.message).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tags_are_checked() {
        assert_eq!(
            split_name("my-template").unwrap(),
            ("my-template".into(), None)
        );
        assert_eq!(
            split_name("my-template:v1.0").unwrap(),
            ("my-template".into(), Some("v1.0".into()))
        );
        for bad in [
            ":tag",
            "name:",
            "a:b:c",
            "",
            "../x",
            "a/b",
            ".hidden",
            "x y",
            &"n".repeat(200),
        ] {
            assert!(split_name(bad).is_err(), "{bad:?}");
        }
        for bad in [":invalid-tag", "e2b-tags-test:", "", "a b", "-x"] {
            assert!(check_tag(bad).is_err(), "{bad:?}");
        }
        assert!(check_hash(&"a".repeat(64)).is_ok());
        for bad in ["", "../../etc", &"g".repeat(64), &"a".repeat(63)] {
            assert!(check_hash(bad).is_err(), "{bad:?}");
        }
        assert!(sandpit_name(&new_template_id(), &uuid::Uuid::new_v4().to_string()).len() <= 64);
    }

    #[test]
    fn upload_signatures_bind_template_hash_and_expiry() {
        let h = "a".repeat(64);
        let s = upload_signature("t1", &h, 100);
        assert_eq!(s, upload_signature("t1", &h, 100));
        assert_ne!(s, upload_signature("t2", &h, 100));
        assert_ne!(s, upload_signature("t1", &"b".repeat(64), 100));
        assert_ne!(s, upload_signature("t1", &h, 101));
    }

    #[test]
    fn a_log_keeps_its_bound() {
        let log = BuildLog::new();
        for i in 0..(MAX_LOG_ENTRIES + 5) {
            log.info(None, format!("{i}"));
        }
        log.info(Some("1"), "x".repeat(MAX_LOG_LINE * 2));
        let s = log.entries.lock();
        assert_eq!(s.entries.len(), MAX_LOG_ENTRIES);
        assert_eq!(s.dropped, 6);
    }
}
