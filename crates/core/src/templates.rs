//! Templates: building root filesystems in the background with a progress log (a copy of
//! a directory, debootstrap, an OCI image or `docker save` tarball through
//! `sandpit-image`), resolving a template for a create, and the start command and
//! readiness check its sandboxes run before they are handed out.
//!
//! A build works in `DATA_DIR/templates/<name>-<build id>/`, which it owns: a failed or
//! cancelled build removes it, and the record says why. Templates registered in place
//! (`sandpit template add`) point at the user's directory, which sandpit never removes.

mod build;
mod copy;
mod debootstrap;
mod remove;
mod start;

use build::*;
pub use start::{start_services, with_defaults};

use crate::agent_conn::AgentConn;
use crate::error::CoreError;
use crate::manager::Manager;
use parking_lot::Mutex;
use sandpit_api::{
    BuildLogLine, BuildTemplateRequest, CreateSandboxRequest, RunCommandRequest, Template,
    TemplateBuild, TemplateSettings, TemplateSourceSpec,
};
use sandpit_runtime::{SandboxHandle, TemplateSource};
use sandpit_store::{SandboxRecord, Store, StoreError, TemplateRecord, TemplateState};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Lines a build log keeps (the oldest go first).
const LOG_LINES: usize = 5000;
/// Longest line kept in a build log.
const LOG_LINE_BYTES: usize = 2000;
/// How long a readiness check may keep failing when the template does not say.
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest readiness timeout a template may ask for.
const MAX_READY_TIMEOUT_SECS: u32 = 3600;
/// Longest start or readiness command.
const MAX_COMMAND_BYTES: usize = 16 * 1024;
/// Longest a progress request may wait for new lines.
pub const MAX_WAIT: Duration = Duration::from_secs(30);
/// Output of a failed readiness check quoted in the error, per stream.
const QUOTED_OUTPUT: usize = 2000;
/// Marker a build writes into its directory, so that leftovers can be told from anything else.
const MARKER: &str = "sandpit-build.json";

/// Why a build failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("the build was cancelled")]
    Cancelled,
    #[error("{0}")]
    Failed(String),
}

impl BuildError {
    fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        BuildError::Io {
            op,
            path: path.display().to_string(),
            source,
        }
    }
}

/// One build's progress: its log (with offsets counted from the start of the build), its
/// state, and the token that cancels it.
pub struct Build {
    pub id: String,
    log: Mutex<Log>,
    version: tokio::sync::watch::Sender<u64>,
    cancel: CancellationToken,
}

struct Log {
    /// Offset of `lines[0]`.
    first: u64,
    lines: VecDeque<String>,
    state: TemplateState,
    error: Option<String>,
}

impl Build {
    fn new(id: String) -> Self {
        Build {
            id,
            log: Mutex::new(Log {
                first: 0,
                lines: VecDeque::new(),
                state: TemplateState::Building,
                error: None,
            }),
            version: tokio::sync::watch::channel(0).0,
            cancel: CancellationToken::new(),
        }
    }

    /// Appends a line to the log.
    fn push(&self, line: impl Into<String>) {
        let mut line: String = line.into();
        if line.len() > LOG_LINE_BYTES {
            let mut cut = LOG_LINE_BYTES;
            while !line.is_char_boundary(cut) {
                cut -= 1;
            }
            line.truncate(cut);
            line.push('…');
        }
        tracing::debug!(build = %self.id, "{line}");
        {
            let mut log = self.log.lock();
            log.lines.push_back(line);
            if log.lines.len() > LOG_LINES {
                log.lines.pop_front();
                log.first += 1;
            }
        }
        self.version.send_modify(|v| *v += 1);
    }

    fn finish(&self, state: TemplateState, error: Option<String>) {
        {
            let mut log = self.log.lock();
            log.state = state;
            log.error = error;
        }
        self.version.send_modify(|v| *v += 1);
    }

    fn state(&self) -> TemplateState {
        self.log.lock().state
    }

    /// The most recent line matching `f`.
    fn last_line(&self, f: impl Fn(&str) -> bool) -> Option<String> {
        let log = self.log.lock();
        log.lines.iter().rev().find(|l| f(l)).cloned()
    }

    /// Lines from `offset` on, the next offset, whether lines before `offset` were
    /// dropped, the state and the error.
    fn read(&self, offset: u64) -> (Vec<BuildLogLine>, u64, bool, TemplateState, Option<String>) {
        let log = self.log.lock();
        let end = log.first + log.lines.len() as u64;
        let from = offset.clamp(log.first, end);
        let lines = log
            .lines
            .iter()
            .skip((from - log.first) as usize)
            .enumerate()
            .map(|(i, text)| BuildLogLine {
                offset: from + i as u64,
                text: text.clone(),
            })
            .collect();
        (lines, end, offset < log.first, log.state, log.error.clone())
    }

    /// Waits (up to `max`) until the build has ended.
    async fn wait_done(&self, max: Duration) {
        let mut rx = self.version.subscribe();
        let deadline = tokio::time::Instant::now() + max;
        while self.state() == TemplateState::Building {
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return;
            }
        }
    }
}

/// What a create takes from its template; holding it keeps the template from being
/// deleted until the sandbox is recorded (see [`Templates::delete`]).
#[derive(Clone, Default)]
pub struct Defaults {
    pub template: String,
    pub user: Option<String>,
    pub workdir: Option<String>,
    pub env: BTreeMap<String, String>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    pub ready_timeout: Duration,
    /// Read-only layers over the root filesystem (templates made from snapshots), top first.
    pub layers: Vec<PathBuf>,
    _hold: Option<Arc<Hold>>,
}

/// One create that resolved a template and may not have recorded its sandbox yet.
struct Hold {
    counts: Arc<Mutex<HashMap<String, usize>>>,
    name: String,
}

impl Hold {
    fn new(counts: &Arc<Mutex<HashMap<String, usize>>>, name: &str) -> Hold {
        {
            let mut c = counts.lock();
            *c.entry(name.to_string()).or_default() += 1;
        }
        Hold {
            counts: counts.clone(),
            name: name.to_string(),
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut c = self.counts.lock();
        if let Some(n) = c.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                c.remove(&self.name);
            }
        }
    }
}

/// What a build makes the root filesystem from, validated.
/// A checked build source.
pub enum Source {
    Dir(PathBuf),
    Oci(PathBuf),
    /// Read-only layers (top first) copied into the template, over template `base`.
    Layers {
        from: Vec<PathBuf>,
        base: String,
    },
    Debootstrap {
        suite: String,
        packages: Vec<String>,
        mirror: Option<String>,
    },
}

/// Template builds of this daemon and the creates holding templates.
pub struct Templates {
    /// `DATA_DIR/templates`.
    dir: PathBuf,
    data_dir: PathBuf,
    /// The latest build of each template started by this daemon.
    builds: Mutex<HashMap<String, Arc<Build>>>,
    /// Creates under way per template.
    held: Arc<Mutex<HashMap<String, usize>>>,
}

/// Template names are short identifiers; `host` is built in.
pub fn check_name(name: &str) -> Result<(), CoreError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !name.starts_with(['.', '-']);
    if !ok {
        return Err(CoreError::invalid(format!(
            "bad template name {name:?}: up to 64 letters, digits, '-', '_' or '.', not starting with '.' or '-'"
        )));
    }
    if name == "host" {
        return Err(CoreError::invalid(
            "`host` is the built-in template and cannot be built, replaced or removed",
        ));
    }
    Ok(())
}

fn check_command(what: &str, cmd: &Option<String>) -> Result<(), CoreError> {
    if let Some(c) = cmd
        && (c.trim().is_empty() || c.len() > MAX_COMMAND_BYTES || c.contains('\0'))
    {
        return Err(CoreError::invalid(format!(
            "{what} must be a non-empty shell command of at most {MAX_COMMAND_BYTES} bytes"
        )));
    }
    Ok(())
}

/// Checks the settings a template gives its sandboxes.
fn check_settings(req: &BuildTemplateRequest) -> Result<(), CoreError> {
    if let Some(u) = &req.default_user
        && !matches!(u.as_str(), "user" | "root")
    {
        return Err(CoreError::invalid(format!(
            "unknown user {u:?}: sandboxes have `user` and `root`"
        )));
    }
    if let Some(w) = &req.workdir
        && (!w.starts_with('/')
            || w.len() > 4096
            || w.contains('\0')
            || w.split('/').any(|c| c == ".."))
    {
        return Err(CoreError::invalid(
            "workdir must be an absolute path without '..'",
        ));
    }
    crate::manager::check_env(&req.env)?;
    check_command("start_cmd", &req.start_cmd)?;
    check_command("ready_cmd", &req.ready_cmd)?;
    if let Some(t) = req.ready_timeout_secs
        && !(1..=MAX_READY_TIMEOUT_SECS).contains(&t)
    {
        return Err(CoreError::invalid(format!(
            "ready_timeout_secs must be between 1 and {MAX_READY_TIMEOUT_SECS}"
        )));
    }
    Ok(())
}

/// A path on the host a build reads: absolute, existing, and neither holding nor inside
/// the daemon's data directory (whose keys and database no template may carry, and which
/// a copy would otherwise copy into itself). Returns it with symlinks resolved.
fn check_host_path(path: &str, data_dir: &Path) -> Result<PathBuf, CoreError> {
    if !path.starts_with('/') || path.len() > 4096 || path.contains('\0') {
        return Err(CoreError::invalid(format!(
            "source path {path:?} must be an absolute path"
        )));
    }
    let found = std::fs::canonicalize(path)
        .map_err(|e| CoreError::invalid(format!("source path {path}: {e}")))?;
    let data = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    if data.starts_with(&found) || found.starts_with(&data) {
        return Err(CoreError::invalid(format!(
            "source path {path} overlaps the daemon's data directory {}",
            data.display()
        )));
    }
    Ok(found)
}

/// A directory on the host to copy: see [`check_host_path`]; it must also look like a
/// root filesystem.
fn check_source_dir(path: &str, data_dir: &Path) -> Result<PathBuf, CoreError> {
    let dir = check_host_path(path, data_dir)?;
    if !dir.is_dir() {
        return Err(CoreError::invalid(format!(
            "source path {path} is not a directory"
        )));
    }
    let has = |p: &str| std::fs::symlink_metadata(dir.join(p)).is_ok();
    if !has("bin") && !has("usr/bin") {
        return Err(CoreError::invalid(format!(
            "{path} does not look like a root filesystem (no bin or usr/bin)"
        )));
    }
    Ok(dir)
}

fn check_source(source: &TemplateSourceSpec, data_dir: &Path) -> Result<Source, CoreError> {
    match source {
        TemplateSourceSpec::Dir { path } => Ok(Source::Dir(check_source_dir(path, data_dir)?)),
        TemplateSourceSpec::Debootstrap {
            suite,
            packages,
            mirror,
        } => {
            debootstrap::check_suite(suite)?;
            debootstrap::check_packages(packages)?;
            let mirror = mirror
                .as_deref()
                .map(debootstrap::check_mirror)
                .transpose()?;
            Ok(Source::Debootstrap {
                suite: suite.clone(),
                packages: packages.clone(),
                mirror,
            })
        }
        TemplateSourceSpec::Oci { path } => {
            let found = check_host_path(path, data_dir)?;
            if !found.is_dir() && !found.is_file() {
                return Err(CoreError::invalid(format!(
                    "{path} is neither an image directory nor a tarball"
                )));
            }
            Ok(Source::Oci(found))
        }
        TemplateSourceSpec::Snapshot { .. } => Err(CoreError::internal(
            "a snapshot source is resolved by the manager before the build",
        )),
        TemplateSourceSpec::Path { .. } => Err(CoreError::invalid(
            "kind \"path\" registers a directory in place, which is local administration \
             (`sandpit template add`); a build copies: use kind \"dir\"",
        )),
    }
}

fn new_build_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..12)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// The settings a template record gives its sandboxes.
fn defaults_of(t: TemplateRecord) -> Defaults {
    let ready_timeout = t
        .ready_timeout_secs
        .and_then(|s| u64::try_from(s).ok())
        .filter(|s| *s > 0)
        .map_or(DEFAULT_READY_TIMEOUT, Duration::from_secs);
    Defaults {
        template: t.name,
        user: t.default_user,
        workdir: t.workdir,
        env: t.env,
        start_cmd: t.start_cmd,
        ready_cmd: t.ready_cmd,
        ready_timeout,
        layers: Vec::new(),
        _hold: None,
    }
}

/// The API's view of a template record.
pub fn to_api(rec: TemplateRecord) -> Template {
    let source = if rec.source.is_null() {
        Some(TemplateSourceSpec::Path {
            path: rec.rootfs.clone(),
        })
    } else {
        serde_json::from_value(rec.source).ok()
    };
    Template {
        name: rec.name,
        rootfs: rec.rootfs,
        state: rec.state.as_str().to_string(),
        settings: TemplateSettings {
            default_user: rec.default_user,
            workdir: rec.workdir,
            env: rec.env,
            start_cmd: rec.start_cmd,
            ready_cmd: rec.ready_cmd,
            ready_timeout_secs: rec.ready_timeout_secs.and_then(|s| u32::try_from(s).ok()),
        },
        source,
        size_bytes: u64::try_from(rec.size_bytes).unwrap_or(0),
        error: rec.error,
        build_id: rec.build_id,
        created_at_ms: rec.created_at_ms,
        updated_at_ms: rec.updated_at_ms,
    }
}

/// The built-in `host` template as the API shows it.
pub fn host_template() -> Template {
    Template {
        name: "host".into(),
        rootfs: "host".into(),
        state: TemplateState::Ready.as_str().into(),
        ..Default::default()
    }
}

impl Templates {
    /// Templates under `data_dir/templates`.
    pub fn new(data_dir: &Path) -> Templates {
        Templates {
            dir: data_dir.join("templates"),
            data_dir: data_dir.to_path_buf(),
            builds: Mutex::default(),
            held: Arc::default(),
        }
    }

    fn build_of(&self, name: &str) -> Option<Arc<Build>> {
        self.builds.lock().get(name).cloned()
    }

    /// The directory a build of `rec` made and owns, if it made one.
    fn owned_dir(&self, rec: &TemplateRecord) -> Option<PathBuf> {
        let id = rec.build_id.as_deref()?;
        if rec.source.is_null() {
            return None;
        }
        let work = self.dir.join(format!("{}-{id}", rec.name));
        (Path::new(&rec.rootfs) == work.join("rootfs")).then_some(work)
    }

    /// The root filesystem and settings of template `name` for a create; only ready
    /// templates start sandboxes.
    pub async fn resolve(
        &self,
        store: &Store,
        name: &str,
    ) -> Result<(TemplateSource, Defaults), CoreError> {
        if name == "host" {
            return Ok((TemplateSource::Host, Defaults::default()));
        }
        // Counted before the read: a delete that marks the template after this read has
        // begun sees the count (see `delete`).
        let hold = Hold::new(&self.held, name);
        let Some(t) = store.get_template(name).await? else {
            return Err(CoreError::not_found(format!("template {name:?} not found")));
        };
        match t.state {
            TemplateState::Ready => {}
            TemplateState::Building => {
                return Err(CoreError::conflict(format!(
                    "template {name} is still being built"
                )));
            }
            TemplateState::Deleting => {
                return Err(CoreError::conflict(format!(
                    "template {name} is being removed"
                )));
            }
            TemplateState::Failed => {
                return Err(CoreError::conflict(format!(
                    "template {name} failed to build: {}",
                    t.error.as_deref().unwrap_or("no reason recorded")
                )));
            }
        }
        if let Some(base) = layered_base(&t) {
            // Its own layers over whatever its base template resolves to.
            let (source, below) = Box::pin(self.resolve(store, &base)).await?;
            let mut layers = layer_dirs(Path::new(&t.rootfs))?;
            layers.extend(below.layers.iter().cloned());
            return Ok((
                source,
                Defaults {
                    layers,
                    _hold: Some(Arc::new(hold)),
                    ..defaults_of(t)
                },
            ));
        }
        Ok((
            TemplateSource::Rootfs {
                path: t.rootfs.clone().into(),
            },
            Defaults {
                _hold: Some(Arc::new(hold)),
                ..defaults_of(t)
            },
        ))
    }

    /// Starts building a template; the answer comes at once, the build goes on in the
    /// background (follow it with [`Templates::progress`]).
    pub async fn build(
        &self,
        store: &Store,
        req: BuildTemplateRequest,
        prepared: Option<Source>,
    ) -> Result<Template, CoreError> {
        check_name(&req.name)?;
        check_settings(&req)?;
        let source = match prepared {
            Some(s) => s,
            None => check_source(&req.source, &self.data_dir)?,
        };
        let source_json = serde_json::to_value(&req.source)?;
        let id = new_build_id();
        let work = self.dir.join(format!("{}-{id}", req.name));
        let now = crate::manager::now_ms();
        let rec = TemplateRecord {
            name: req.name.clone(),
            rootfs: work.join("rootfs").to_string_lossy().into_owned(),
            created_at_ms: now,
            default_user: req.default_user.clone(),
            workdir: req.workdir.clone(),
            env: req.env.clone(),
            start_cmd: req.start_cmd.clone(),
            ready_cmd: req.ready_cmd.clone(),
            ready_timeout_secs: req.ready_timeout_secs.map(i64::from),
            source: source_json,
            size_bytes: 0,
            state: TemplateState::Building,
            error: None,
            updated_at_ms: now,
            build_id: Some(id.clone()),
        };
        store
            .insert_template_build(&rec)
            .await
            .map_err(|e| match e {
                StoreError::Conflict(_) => CoreError::conflict(format!(
                    "template {} exists; remove it first (`sandpit template rm {}`)",
                    req.name, req.name
                )),
                other => other.into(),
            })?;
        let build = Arc::new(Build::new(id));
        {
            let mut builds = self.builds.lock();
            builds.insert(req.name.clone(), build.clone());
        }
        if let Err(e) = prepare_work_dir(&self.dir, &work, &rec) {
            let msg = e.to_string();
            let _ = remove::remove_tree(&work);
            build.push(format!("error: {msg}"));
            build.finish(TemplateState::Failed, Some(msg.clone()));
            let failed = TemplateRecord {
                state: TemplateState::Failed,
                error: Some(msg.clone()),
                ..rec
            };
            let _ = store.finish_template_build(&failed).await;
            return Err(CoreError::internal(format!(
                "cannot prepare the build directory: {msg}"
            )));
        }
        let view = to_api(rec.clone());
        tokio::spawn(run_build(store.clone(), build, rec, source, work));
        Ok(view)
    }

    /// A build's state and log from `offset` on, waiting up to `wait` for something new
    /// while it runs. A template built before this daemon started has no log.
    pub async fn progress(
        &self,
        store: &Store,
        name: &str,
        offset: u64,
        wait: Duration,
    ) -> Result<TemplateBuild, CoreError> {
        let rec = self.get(store, name).await?;
        let build = self
            .build_of(name)
            .filter(|b| rec.build_id.as_deref() == Some(b.id.as_str()));
        let Some(build) = build else {
            return Ok(TemplateBuild {
                name: rec.name,
                build_id: rec.build_id,
                state: rec.state.as_str().into(),
                error: rec.error,
                lines: Vec::new(),
                next_offset: offset,
                truncated: false,
            });
        };
        let mut rx = build.version.subscribe();
        let deadline = tokio::time::Instant::now() + wait.min(MAX_WAIT);
        loop {
            let (lines, next, truncated, state, error) = build.read(offset);
            let waiting = lines.is_empty() && state == TemplateState::Building;
            if !waiting
                || tokio::time::timeout_at(deadline, rx.changed())
                    .await
                    .is_err()
            {
                // A build that ended reports the record's state, which it wrote first.
                let state = if state == TemplateState::Building {
                    state
                } else {
                    rec_state_now(store, name).await.unwrap_or(state)
                };
                return Ok(TemplateBuild {
                    name: name.to_string(),
                    build_id: Some(build.id.clone()),
                    state: state.as_str().into(),
                    error,
                    lines,
                    next_offset: next,
                    truncated,
                });
            }
        }
    }

    /// The template record, 404 when there is none.
    pub async fn get(&self, store: &Store, name: &str) -> Result<TemplateRecord, CoreError> {
        store
            .get_template(name)
            .await?
            .ok_or_else(|| CoreError::not_found(format!("template {name} not found")))
    }

    /// Removes a template and the directory its build made. Refused (409) while sandboxes
    /// or pools use it; a build under way is cancelled first.
    ///
    /// Safe against a concurrent create: the create counts itself as holding the template
    /// before it reads the record, and the delete marks the record `deleting` before it
    /// looks at the count. Either the create sees `deleting` and fails, or the delete
    /// sees the count (or the sandbox's record) and refuses.
    pub async fn delete(&self, store: &Store, name: &str) -> Result<(), CoreError> {
        check_name(name)?;
        let rec = self.get(store, name).await?;
        if rec.state == TemplateState::Building {
            if let Some(b) = self
                .build_of(name)
                .filter(|b| rec.build_id.as_deref() == Some(b.id.as_str()))
            {
                b.cancel.cancel();
                b.wait_done(Duration::from_secs(120)).await;
            } else {
                // No build of this daemon: left by one that stopped mid-build.
                store
                    .transition_template(
                        name,
                        &[TemplateState::Building],
                        TemplateState::Failed,
                        Some("the build was interrupted"),
                    )
                    .await?;
            }
        }
        if let Some(why) = dependents(store, name).await? {
            return Err(CoreError::conflict(why));
        }
        let current = self.get(store, name).await?;
        let from = [TemplateState::Ready, TemplateState::Failed];
        let Some(marked) = store
            .transition_template(name, &from, TemplateState::Deleting, None)
            .await?
        else {
            let now = self.get(store, name).await?;
            return Err(CoreError::conflict(format!(
                "template {name} is {}",
                now.state
            )));
        };
        if let Some(why) = self.users(store, name).await? {
            store
                .transition_template(
                    name,
                    &[TemplateState::Deleting],
                    current.state,
                    current.error.as_deref(),
                )
                .await?;
            return Err(CoreError::conflict(why));
        }
        if let Some(work) = self.owned_dir(&marked) {
            let w = work.clone();
            let removed = tokio::task::spawn_blocking(move || remove::remove_tree(&w)).await?;
            if let Err(e) = removed {
                let msg = format!("removing {} failed: {e}", work.display());
                tracing::error!(template = name, "{msg}");
                store
                    .transition_template(
                        name,
                        &[TemplateState::Deleting],
                        TemplateState::Failed,
                        Some(&msg),
                    )
                    .await?;
                return Err(CoreError::internal(msg));
            }
        }
        store.delete_template(name).await?;
        {
            let mut builds = self.builds.lock();
            builds.remove(name);
        }
        tracing::info!(template = name, "template removed");
        Ok(())
    }

    /// Why the template cannot go now, if it cannot. Sandboxes being torn down are waited
    /// for (briefly): they are gone in a moment.
    async fn users(&self, store: &Store, name: &str) -> Result<Option<String>, CoreError> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let held = self.held.lock().get(name).copied().unwrap_or(0);
            let u = store.template_users(name, 5).await?;
            if held == 0 && u.is_empty() {
                return Ok(None);
            }
            let only_stopping = held == 0 && u.sandboxes.is_empty() && u.pools.is_empty();
            if only_stopping && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let mut parts = Vec::new();
            if !u.sandboxes.is_empty() || !u.stopping.is_empty() {
                let ids: Vec<String> = u.sandboxes.iter().chain(&u.stopping).cloned().collect();
                parts.push(format!("sandboxes {}", ids.join(", ")));
            }
            if !u.pools.is_empty() {
                parts.push(format!("pools {}", u.pools.join(", ")));
            }
            if held > 0 {
                parts.push(format!("{held} create(s) under way"));
            }
            return Ok(Some(format!(
                "template {name} is in use by {}; delete those first",
                parts.join(" and ")
            )));
        }
    }

    /// At start: builds that were under way when the daemon stopped are marked failed and
    /// their directories removed; removals cut short are finished; build directories no
    /// record owns are removed.
    pub async fn recover(&self, store: &Store) {
        let Ok(all) = store.list_templates().await else {
            tracing::warn!("listing templates at start failed");
            return;
        };
        let mut keep = Vec::new();
        for rec in all {
            match rec.state {
                TemplateState::Building => {
                    tracing::warn!(template = %rec.name, "a template build was interrupted by a daemon stop");
                    let _ = store
                        .transition_template(
                            &rec.name,
                            &[TemplateState::Building],
                            TemplateState::Failed,
                            Some("the build was interrupted (the daemon stopped)"),
                        )
                        .await;
                }
                TemplateState::Deleting => {
                    let gone = match self.owned_dir(&rec) {
                        Some(work) => remove::remove_tree(&work).is_ok(),
                        None => true,
                    };
                    if gone {
                        let _ = store.delete_template(&rec.name).await;
                    }
                }
                TemplateState::Ready => {
                    if let Some(work) = self.owned_dir(&rec) {
                        keep.push(work);
                    }
                }
                TemplateState::Failed => {}
            }
        }
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            let is_build = std::fs::symlink_metadata(p.join(MARKER)).is_ok_and(|m| m.is_file());
            if is_build && !keep.contains(&p) {
                tracing::info!(dir = %p.display(), "removing the leftovers of a template build");
                if let Err(err) = remove::remove_tree(&p) {
                    tracing::warn!(dir = %p.display(), error = %err, "removing build leftovers failed");
                }
            }
        }
    }
}

/// The base template of a template made from a snapshot (its layers lie over the base).
fn layered_base(t: &TemplateRecord) -> Option<String> {
    (t.source.get("kind").and_then(|k| k.as_str()) == Some("snapshot"))
        .then(|| t.source.get("base")?.as_str().map(String::from))
        .flatten()
}

/// The layer directories of a template made from a snapshot, top first.
fn layer_dirs(dir: &Path) -> Result<Vec<PathBuf>, CoreError> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| CoreError::io(format!("read {}", dir.display()), e))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    Ok(dirs)
}

/// Templates and snapshots that build on template `name`.
pub(crate) async fn dependents(store: &Store, name: &str) -> Result<Option<String>, CoreError> {
    let templates: Vec<String> = store
        .list_templates()
        .await?
        .into_iter()
        .filter(|t| layered_base(t).as_deref() == Some(name))
        .map(|t| t.name)
        .collect();
    let snapshots: Vec<String> = store
        .list_snapshots(None)
        .await?
        .into_iter()
        .filter(|s| s.template == name)
        .map(|s| s.id)
        .collect();
    if templates.is_empty() && snapshots.is_empty() {
        return Ok(None);
    }
    let mut parts = Vec::new();
    if !templates.is_empty() {
        parts.push(format!("templates {}", templates.join(", ")));
    }
    if !snapshots.is_empty() {
        parts.push(format!("snapshots {}", snapshots.join(", ")));
    }
    Ok(Some(format!(
        "template {name} is the base of {}; delete those first",
        parts.join(" and ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_short_identifiers() {
        for ok in ["ubuntu-24.04", "py_3", "a"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "host",
            "a/b",
            "..",
            ".hidden",
            "-x",
            "a b",
            &"x".repeat(65),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_build_log_keeps_offsets_when_it_drops_old_lines() {
        let b = Build::new("b".into());
        for i in 0..(LOG_LINES + 10) {
            b.push(format!("line {i}"));
        }
        let (lines, next, truncated, state, _) = b.read(0);
        assert!(truncated);
        assert_eq!(state, TemplateState::Building);
        assert_eq!(lines.len(), LOG_LINES);
        assert_eq!(lines[0].offset, 10);
        assert_eq!(lines[0].text, "line 10");
        assert_eq!(next, (LOG_LINES + 10) as u64);
        let (lines, next2, truncated, _, _) = b.read(next - 2);
        assert!(!truncated);
        assert_eq!(lines.len(), 2);
        assert_eq!(next2, next);
        // Past the end: nothing, and the offset stays where the log ends.
        let (lines, next3, _, _, _) = b.read(next + 100);
        assert!(lines.is_empty());
        assert_eq!(next3, next);
        b.push("x".repeat(LOG_LINE_BYTES * 2));
        let (lines, _, _, _, _) = b.read(next);
        assert!(lines[0].text.len() <= LOG_LINE_BYTES + '…'.len_utf8());
        b.finish(TemplateState::Failed, Some("boom".into()));
        assert_eq!(b.state(), TemplateState::Failed);
    }

    #[test]
    fn a_create_request_overrides_the_template() {
        let d = Defaults {
            user: Some("root".into()),
            workdir: Some("/srv".into()),
            env: [("A", "t"), ("B", "t")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into(),
            ..Default::default()
        };
        let req = CreateSandboxRequest {
            env: [("B".to_string(), "r".to_string())].into(),
            workdir: Some("/w".into()),
            ..Default::default()
        };
        let got = with_defaults(req, &d);
        assert_eq!(got.env["A"], "t");
        assert_eq!(got.env["B"], "r");
        assert_eq!(got.workdir.as_deref(), Some("/w"));
        assert_eq!(got.user.as_deref(), Some("root"));
        let plain = with_defaults(CreateSandboxRequest::default(), &Defaults::default());
        assert!(plain.env.is_empty() && plain.workdir.is_none() && plain.user.is_none());
    }

    #[test]
    fn image_commands_are_quoted_and_users_mapped() {
        assert_eq!(shell_quote("/bin/sh"), "/bin/sh");
        assert_eq!(shell_quote("echo hi; rm x"), "'echo hi; rm x'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$HOME"), "'$HOME'");
        for root in [
            None,
            Some(""),
            Some("root"),
            Some("0"),
            Some("0:0"),
            Some("root:wheel"),
        ] {
            assert_eq!(account_of_image_user(root), "root", "{root:?}");
        }
        for other in [
            Some("1000"),
            Some("nginx"),
            Some("1000:1000"),
            Some("app:app"),
        ] {
            assert_eq!(account_of_image_user(other), "user", "{other:?}");
        }
        let b = Build::new("b".into());
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("bin")).unwrap();
        std::fs::write(t.path().join("bin/sh"), "").unwrap();
        let mut rec = TemplateRecord {
            env: [("B".to_string(), "mine".to_string())].into(),
            ..Default::default()
        };
        let config = sandpit_image::ImageConfig {
            env: vec!["A=1".into(), "B=image".into(), "broken".into()],
            user: Some("1000".into()),
            workdir: Some("/srv/../etc".into()),
            entrypoint: vec!["/bin/sh".into(), "-c".into()],
            cmd: vec!["echo $X > /tmp/y".into()],
            ..Default::default()
        };
        apply_image_config(&b, &mut rec, config, t.path());
        assert_eq!(rec.env["A"], "1");
        assert_eq!(rec.env["B"], "mine", "the request wins over the image");
        assert!(!rec.env.contains_key("broken"));
        assert_eq!(rec.default_user.as_deref(), Some("user"));
        assert_eq!(rec.workdir, None, "a workdir with '..' is not taken");
        assert_eq!(
            rec.start_cmd.as_deref(),
            Some("exec /bin/sh -c 'echo $X > /tmp/y'")
        );
        assert!(b.last_line(|l| l.contains("broken")).is_some());
    }

    #[test]
    fn source_directories_are_checked() {
        let data = tempfile::tempdir().unwrap();
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("usr/bin")).unwrap();
        let p = src.path().to_str().unwrap();
        assert!(check_source_dir(p, data.path()).is_ok());
        assert!(matches!(
            check_source_dir("relative/x", data.path()).unwrap_err(),
            CoreError::Invalid(_)
        ));
        assert!(check_source_dir("/nonexistent-sandpit-dir", data.path()).is_err());
        // Not a root filesystem.
        assert!(
            check_source_dir(data.path().parent().unwrap().to_str().unwrap(), data.path()).is_err()
        );
        // The data directory, a parent of it, or a directory inside it.
        std::fs::create_dir_all(data.path().join("x/usr/bin")).unwrap();
        assert!(check_source_dir(data.path().join("x").to_str().unwrap(), data.path()).is_err());
        assert!(check_source_dir("/", data.path()).is_err());
        let e = check_source(&TemplateSourceSpec::Oci { path: "/x".into() }, data.path());
        assert!(e.is_err());
    }
}
