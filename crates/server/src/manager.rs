//! The lifecycle manager: creates and destroys sandboxes, keeps the store in step with the
//! runtimes, expires sandboxes at their TTL, notices dead agents, and reconciles after a
//! restart so that nothing is leaked whether the daemon stopped cleanly or was killed.

use crate::agent_client::AgentConn;
use crate::error::ApiError;
use sandpit_api::{CreateSandboxRequest, Limits};
use sandpit_runtime::{Runtime, SandboxHandle, SandboxSpec, TemplateSource};
use sandpit_store::{SandboxRecord, SandboxState, Store};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Limits applied when a request leaves them out.
pub const DEFAULT_LIMITS: Limits = Limits {
    cpu_millis: 1000,
    memory_bytes: 512 << 20,
    disk_bytes: 1 << 30,
    max_processes: 512,
};
/// Accepted ranges of each limit.
pub const CPU_RANGE: (u64, u64) = (50, 64_000);
pub const MEMORY_RANGE: (u64, u64) = (32 << 20, 64 << 30);
pub const DISK_RANGE: (u64, u64) = (1 << 20, 64 << 30);
pub const PROCESSES_RANGE: (u64, u64) = (8, 65_536);
/// Default sandbox lifetime in seconds.
pub const DEFAULT_TIMEOUT: u64 = 300;

/// Daemon-wide settings the manager needs.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    pub max_timeout_secs: u64,
    pub default_runtime: String,
    /// Whether clients may ask for the unisolated `process` runtime.
    pub allow_process_runtime: bool,
}

/// Owns sandbox lifecycles.
pub struct Manager {
    pub store: Store,
    pub runtimes: BTreeMap<String, Arc<dyn Runtime>>,
    pub cfg: ManagerConfig,
    conns: Mutex<HashMap<String, Arc<AgentConn>>>,
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn new_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..20)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

fn in_range(name: &str, v: u64, (lo, hi): (u64, u64)) -> Result<u64, ApiError> {
    if v < lo || v > hi {
        return Err(ApiError::bad_request(format!(
            "{name} must be between {lo} and {hi}, got {v}"
        )));
    }
    Ok(v)
}

/// Checks an environment variable name and value.
pub fn check_env(env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    for (k, v) in env {
        let valid_name = !k.is_empty() && k.len() <= 256 && !k.contains(['=', '\0']);
        if !valid_name || v.contains('\0') || v.len() > 128 * 1024 {
            return Err(ApiError::bad_request(format!(
                "invalid environment variable {k:?}"
            )));
        }
    }
    if env.len() > 1024 {
        return Err(ApiError::bad_request("at most 1024 environment variables"));
    }
    Ok(())
}

fn handle_of(rec: &SandboxRecord) -> Option<SandboxHandle> {
    serde_json::from_value(rec.runtime_state.clone()).ok()
}

impl Manager {
    /// A manager over the given store and runtimes.
    pub fn new(
        store: Store,
        runtimes: BTreeMap<String, Arc<dyn Runtime>>,
        cfg: ManagerConfig,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            runtimes,
            cfg,
            conns: Mutex::default(),
        })
    }

    fn runtime(&self, name: &str) -> Result<&Arc<dyn Runtime>, ApiError> {
        self.runtimes
            .get(name)
            .ok_or_else(|| ApiError::bad_request(format!("unknown runtime {name:?}")))
    }

    /// The effective limits of a request, validated.
    pub fn limits(req: &CreateSandboxRequest) -> Result<Limits, ApiError> {
        let l = &req.limits;
        Ok(Limits {
            cpu_millis: in_range(
                "cpu_millis",
                l.cpu_millis.unwrap_or(DEFAULT_LIMITS.cpu_millis),
                CPU_RANGE,
            )?,
            memory_bytes: in_range(
                "memory_bytes",
                l.memory_bytes.unwrap_or(DEFAULT_LIMITS.memory_bytes),
                MEMORY_RANGE,
            )?,
            disk_bytes: in_range(
                "disk_bytes",
                l.disk_bytes.unwrap_or(DEFAULT_LIMITS.disk_bytes),
                DISK_RANGE,
            )?,
            max_processes: in_range(
                "max_processes",
                l.max_processes.unwrap_or(DEFAULT_LIMITS.max_processes),
                PROCESSES_RANGE,
            )?,
        })
    }

    fn timeout(&self, t: Option<u64>) -> Result<u64, ApiError> {
        let t = t.unwrap_or(DEFAULT_TIMEOUT.min(self.cfg.max_timeout_secs));
        if t == 0 || t > self.cfg.max_timeout_secs {
            return Err(ApiError::bad_request(format!(
                "timeout must be between 1 and {} seconds",
                self.cfg.max_timeout_secs
            )));
        }
        Ok(t)
    }

    async fn template(&self, name: &str) -> Result<TemplateSource, ApiError> {
        if name == "host" {
            return Ok(TemplateSource::Host);
        }
        match self.store.get_template(name).await? {
            Some(t) => Ok(TemplateSource::Rootfs {
                path: t.rootfs.into(),
            }),
            None => Err(ApiError::bad_request(format!("unknown template {name:?}"))),
        }
    }

    /// Creates a sandbox and returns it running; on any failure nothing is left behind.
    pub async fn create(
        self: &Arc<Self>,
        owner: &str,
        req: CreateSandboxRequest,
    ) -> Result<SandboxRecord, ApiError> {
        let runtime_name = req
            .runtime
            .clone()
            .unwrap_or_else(|| self.cfg.default_runtime.clone());
        if runtime_name == "process" && !self.cfg.allow_process_runtime {
            return Err(ApiError::new(
                http::StatusCode::FORBIDDEN,
                "permission_denied",
                "the unisolated process runtime is disabled; start the daemon with --allow-process-runtime (development only)",
            ));
        }
        let runtime = self.runtime(&runtime_name)?.clone();
        let template_name = req.template.clone().unwrap_or_else(|| "host".into());
        let template = self.template(&template_name).await?;
        let limits = Self::limits(&req)?;
        let timeout = self.timeout(req.timeout)?;
        check_env(&req.env)?;
        if req.metadata.len() > 64
            || req
                .metadata
                .iter()
                .any(|(k, v)| k.is_empty() || k.len() > 256 || v.len() > 1024)
        {
            return Err(ApiError::bad_request(
                "metadata: at most 64 entries, keys 1..=256 and values up to 1024 bytes",
            ));
        }
        let workdir = req.workdir.clone().unwrap_or_else(|| "/home/user".into());
        if !workdir.starts_with('/')
            || workdir.contains('\0')
            || workdir.split('/').any(|c| c == "..")
        {
            return Err(ApiError::bad_request(
                "workdir must be an absolute path without '..'",
            ));
        }
        let now = now_ms();
        let rec = SandboxRecord {
            id: new_id(),
            owner: owner.to_string(),
            template: template_name,
            runtime: runtime_name,
            state: SandboxState::Creating,
            cpu_millis: limits.cpu_millis as i64,
            memory_bytes: limits.memory_bytes as i64,
            disk_bytes: limits.disk_bytes as i64,
            max_processes: limits.max_processes as i64,
            env: req.env.clone(),
            metadata: req.metadata.clone(),
            created_at_ms: now,
            updated_at_ms: now,
            expires_at_ms: now + (timeout as i64) * 1000,
            runtime_state: serde_json::Value::Null,
            error: None,
            version: 0,
        };
        self.store.insert_sandbox(&rec).await?;
        let spec = SandboxSpec {
            id: rec.id.clone(),
            template,
            limits: sandpit_runtime::Limits {
                cpu_millis: limits.cpu_millis,
                memory_bytes: limits.memory_bytes,
                disk_bytes: limits.disk_bytes,
                max_processes: limits.max_processes,
            },
            env: req.env,
            workdir,
        };
        let rt = runtime.clone();
        let created = tokio::task::spawn_blocking(move || {
            let mut h = rt.create(&spec)?;
            if let Err(e) = rt.start(&spec, &mut h) {
                if let Err(c) = rt.destroy(&h) {
                    tracing::error!(id = %spec.id, error = %c, "cleanup after a failed start");
                }
                return Err(e);
            }
            Ok(h)
        })
        .await;
        let handle = match created {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => {
                let _ = self.store.delete_sandbox(&rec.id).await;
                return Err(e.into());
            }
            Err(e) => {
                let _ = self.store.delete_sandbox(&rec.id).await;
                return Err(ApiError::internal(format!("create task: {e}")));
            }
        };
        match self.finish_create(&rec, &handle).await {
            Ok(r) => Ok(r),
            Err(e) => {
                let rt = runtime.clone();
                let h = handle.clone();
                let _ = tokio::task::spawn_blocking(move || rt.destroy(&h)).await;
                self.forget(&rec.id);
                let _ = self.store.delete_sandbox(&rec.id).await;
                Err(e)
            }
        }
    }

    async fn finish_create(
        &self,
        rec: &SandboxRecord,
        handle: &SandboxHandle,
    ) -> Result<SandboxRecord, ApiError> {
        let state = serde_json::to_value(handle).map_err(|e| ApiError::internal(e.to_string()))?;
        self.store.set_runtime_state(&rec.id, &state).await?;
        let conn = self.conn_for(&rec.id, handle);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut delay = Duration::from_micros(200);
        while !conn.healthy().await {
            if tokio::time::Instant::now() > deadline {
                return Err(ApiError::unavailable(
                    "the sandbox agent did not become ready",
                ));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(20));
        }
        self.store
            .transition(
                &rec.id,
                &[SandboxState::Creating],
                SandboxState::Running,
                None,
            )
            .await?
            .ok_or_else(|| ApiError::conflict("sandbox was deleted while it was being created"))
    }

    fn conn_for(&self, id: &str, handle: &SandboxHandle) -> Arc<AgentConn> {
        let Ok(mut conns) = self.conns.lock() else {
            return Arc::new(AgentConn::new(handle.socket.clone()));
        };
        conns
            .entry(id.to_string())
            .or_insert_with(|| Arc::new(AgentConn::new(handle.socket.clone())))
            .clone()
    }

    fn forget(&self, id: &str) {
        if let Ok(mut conns) = self.conns.lock() {
            conns.remove(id);
        }
    }

    /// A sandbox of `owner`; anyone else's is reported as not found.
    pub async fn get(&self, owner: &str, id: &str) -> Result<SandboxRecord, ApiError> {
        match self.store.get_sandbox(id).await? {
            Some(r) if r.owner == owner => Ok(r),
            _ => Err(ApiError::not_found(format!("sandbox {id} not found"))),
        }
    }

    /// The agent of a running sandbox of `owner`.
    pub async fn agent(
        &self,
        owner: &str,
        id: &str,
    ) -> Result<(SandboxRecord, Arc<AgentConn>), ApiError> {
        let rec = self.get(owner, id).await?;
        if rec.state != SandboxState::Running {
            return Err(ApiError::conflict(format!(
                "sandbox {id} is {}",
                rec.state.as_str()
            )));
        }
        let handle =
            handle_of(&rec).ok_or_else(|| ApiError::internal("sandbox has no runtime state"))?;
        Ok((rec.clone(), self.conn_for(&rec.id, &handle)))
    }

    /// Runtime and handle of a sandbox.
    pub fn runtime_of(
        &self,
        rec: &SandboxRecord,
    ) -> Result<(Arc<dyn Runtime>, SandboxHandle), ApiError> {
        let rt = self.runtime(&rec.runtime)?.clone();
        let h =
            handle_of(rec).ok_or_else(|| ApiError::conflict("sandbox has no runtime state yet"))?;
        Ok((rt, h))
    }

    /// Kills and removes a sandbox and its record.
    pub async fn destroy(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        let from = [
            SandboxState::Creating,
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Error,
            SandboxState::Stopped,
            SandboxState::Stopping,
        ];
        self.store
            .transition(&rec.id, &from, SandboxState::Stopping, None)
            .await?;
        self.forget(&rec.id);
        if let (Ok(rt), Some(h)) = (self.runtime(&rec.runtime).cloned(), handle_of(rec)) {
            let r = tokio::task::spawn_blocking(move || rt.destroy(&h)).await;
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.store
                        .transition(
                            &rec.id,
                            &[SandboxState::Stopping],
                            SandboxState::Error,
                            Some(&e.to_string()),
                        )
                        .await?;
                    return Err(e.into());
                }
                Err(e) => return Err(ApiError::internal(format!("destroy task: {e}"))),
            }
        }
        self.store.delete_sandbox(&rec.id).await?;
        Ok(())
    }

    /// Freezes every process of a running sandbox (memory stays in RAM).
    pub async fn pause(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        self.set_frozen(rec, true).await
    }

    /// Thaws a paused sandbox.
    pub async fn resume(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        self.set_frozen(rec, false).await
    }

    async fn set_frozen(&self, rec: &SandboxRecord, freeze: bool) -> Result<(), ApiError> {
        let (from, to, verb) = if freeze {
            (SandboxState::Running, SandboxState::Paused, "pausing")
        } else {
            (SandboxState::Paused, SandboxState::Running, "resuming")
        };
        if rec.state != from {
            return Err(ApiError::conflict(format!(
                "sandbox {} is {}, not {}",
                rec.id,
                rec.state.as_str(),
                from.as_str()
            )));
        }
        let (rt, h) = self.runtime_of(rec)?;
        tokio::task::spawn_blocking(move || if freeze { rt.freeze(&h) } else { rt.thaw(&h) })
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
        match self.store.transition(&rec.id, &[from], to, None).await? {
            Some(_) => Ok(()),
            None => Err(ApiError::conflict(format!(
                "sandbox changed state while {verb}"
            ))),
        }
    }

    /// Sets the sandbox to expire `secs` from now.
    pub async fn set_timeout(&self, rec: &SandboxRecord, secs: u64) -> Result<(), ApiError> {
        let secs = self.timeout(Some(secs))?;
        self.store
            .set_expires_at(&rec.id, now_ms() + secs as i64 * 1000)
            .await?;
        Ok(())
    }

    /// One pass of housekeeping: expire sandboxes past their TTL and clean up dead ones.
    pub async fn tick(&self) {
        let states = [
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Error,
        ];
        match self.store.expired_sandboxes(now_ms(), &states).await {
            Ok(expired) => {
                for rec in expired {
                    tracing::info!(id = %rec.id, "sandbox expired");
                    if let Err(e) = self.destroy(&rec).await {
                        tracing::warn!(id = %rec.id, error = %e.message, "destroying expired sandbox failed");
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing expired sandboxes failed"),
        }
        let Ok(live) = self.store.live_sandboxes().await else {
            return;
        };
        for rec in live
            .into_iter()
            .filter(|r| r.state == SandboxState::Running)
        {
            let Ok((rt, h)) = self.runtime_of(&rec) else {
                continue;
            };
            let alive = tokio::task::spawn_blocking(move || rt.is_alive(&h))
                .await
                .unwrap_or(true);
            if !alive {
                tracing::warn!(id = %rec.id, "sandbox agent exited; cleaning up");
                self.mark_dead(&rec, "the sandbox's agent exited").await;
            }
        }
    }

    async fn mark_dead(&self, rec: &SandboxRecord, why: &str) {
        self.forget(&rec.id);
        if let Ok((rt, h)) = self.runtime_of(rec) {
            let _ = tokio::task::spawn_blocking(move || rt.destroy(&h)).await;
        }
        let from = [
            SandboxState::Creating,
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Stopping,
        ];
        if let Err(e) = self
            .store
            .transition(&rec.id, &from, SandboxState::Stopped, Some(why))
            .await
        {
            tracing::warn!(id = %rec.id, error = %e, "marking sandbox stopped failed");
        }
    }

    /// After a start: re-adopt live sandboxes, clean up dead and half-made ones, and sweep
    /// runtime leftovers that the store does not know.
    pub async fn reconcile(&self) -> Result<(), ApiError> {
        let live = self.store.live_sandboxes().await?;
        let mut keep = Vec::new();
        for rec in live {
            let usable = match self.runtime_of(&rec) {
                Ok((rt, h)) => {
                    let (rt2, h2) = (rt.clone(), h.clone());
                    let alive = tokio::task::spawn_blocking(move || rt2.is_alive(&h2))
                        .await
                        .unwrap_or(false);
                    // A paused sandbox's agent is frozen and cannot answer; it is adopted
                    // on the strength of its process alone.
                    let answers = rec.state == SandboxState::Paused
                        || self.conn_for(&rec.id, &h).healthy().await;
                    if alive && rec.state != SandboxState::Creating && answers {
                        rt.adopt(&h);
                        true
                    } else {
                        false
                    }
                }
                Err(_) => false,
            };
            if usable {
                tracing::info!(id = %rec.id, "re-adopted sandbox");
                keep.push(rec.id.clone());
            } else if rec.state == SandboxState::Creating {
                tracing::info!(id = %rec.id, "removing half-created sandbox");
                self.mark_dead(&rec, "half-created").await;
                let _ = self.store.delete_sandbox(&rec.id).await;
            } else {
                tracing::info!(id = %rec.id, "sandbox died while the daemon was down");
                self.mark_dead(&rec, "the sandbox died while the daemon was not running")
                    .await;
            }
        }
        for rt in self.runtimes.values() {
            let (rt, keep) = (rt.clone(), keep.clone());
            match tokio::task::spawn_blocking(move || rt.remove_orphans(&keep)).await {
                Ok(Ok(removed)) if !removed.is_empty() => {
                    tracing::info!(?removed, "removed orphaned sandbox leftovers")
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "sweeping orphans failed"),
                _ => {}
            }
        }
        Ok(())
    }
}
