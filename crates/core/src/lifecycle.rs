//! Pause (freeze, memory kept), hibernation (files kept, processes ended), the idle rules
//! that trigger them, and the read-only layers that hibernation, forks and snapshots leave
//! under a sandbox's writable layer.

use crate::error::CoreError;
use crate::manager::{Manager, now_ms};
use crate::pools::POOL_OWNER;
use sandpit_store::{OnTimeout, SandboxRecord, SandboxState};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Top-level entries of a writable layer that belong to sandpit, never to the sandbox's
/// files: mount points and the agent.
pub const SKIP_TOP: &[&str] = &["proc", "sys", "dev", ".sandpit"];

/// How long an automatic pause or hibernation that failed waits before it is tried again.
pub(crate) const AUTO_RETRY: std::time::Duration = std::time::Duration::from_secs(600);

/// Daemon-wide idle and lifetime rules (`[lifecycle]` in the config file).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LifecycleConfig {
    /// Idle timeout of sandboxes whose create names none; 0 = never pause on idleness.
    pub idle_timeout_secs: u64,
    /// A paused sandbox is hibernated after this long; 0 = never.
    pub hibernate_after_secs: u64,
    /// Hard maximum lifetime of any sandbox, whatever its timeout; 0 = none.
    pub max_lifetime_secs: u64,
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        Self {
            idle_timeout_secs: 300,
            hibernate_after_secs: 600,
            max_lifetime_secs: 0,
        }
    }
}

/// Layer ids as they appear in `Lifecycle::layers` and under `DATA_DIR/layers`.
pub fn valid_layer_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Takes a layer id out of garbage collection while it is being made and recorded.
pub(crate) struct Pin<'a> {
    m: &'a Manager,
    id: String,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        let mut p = self.m.layer_pins.lock();
        if let Some(n) = p.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                p.remove(&self.id);
            }
        }
    }
}

impl Manager {
    /// Where read-only layers live (on disk: hibernated files must survive a reboot).
    pub(crate) fn layers_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("layers")
    }

    /// The directory of layer `id`.
    pub(crate) fn layer_path(&self, id: &str) -> Result<PathBuf, CoreError> {
        if !valid_layer_id(id) {
            return Err(CoreError::internal(format!("bad layer id {id:?}")));
        }
        Ok(self.layers_dir().join(id))
    }

    /// Paths of a record's layers, top first.
    pub(crate) fn layer_paths(&self, rec: &SandboxRecord) -> Result<Vec<PathBuf>, CoreError> {
        rec.life.layers.iter().map(|l| self.layer_path(l)).collect()
    }

    /// Keeps layer `id` from garbage collection (and from being folded into) until the
    /// pin is dropped; pins of one layer add up.
    pub(crate) fn pin(&self, id: &str) -> Pin<'_> {
        {
            let mut p = self.layer_pins.lock();
            *p.entry(id.to_string()).or_default() += 1;
        }
        Pin {
            m: self,
            id: id.to_string(),
        }
    }

    /// Serializes pause, resume, hibernation, snapshots and forks of one sandbox.
    pub(crate) async fn op_lock(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut ops = self.ops.lock();
            // Forget locks nobody holds or waits for, so the map stays small.
            ops.retain(|_, l| Arc::strong_count(l) > 1);
            ops.entry(id.to_string()).or_default().clone()
        };
        lock.lock_owned().await
    }

    /// Records that an API call touched sandbox `id` (its idle timer restarts).
    pub fn touch(&self, id: &str) {
        {
            let mut a = self.activity.lock();
            a.insert(id.to_string(), now_ms());
        }
    }

    /// Writes the activity gathered since the last call to the store.
    pub(crate) async fn flush_activity(&self) {
        let touched: Vec<(String, i64)> = {
            let mut a = self.activity.lock();
            a.drain().collect()
        };
        if let Err(e) = self.store.touch_sandboxes(&touched).await {
            tracing::warn!(error = %e, "recording sandbox activity failed");
        }
    }

    /// When an API call last touched the sandbox (including calls not yet flushed).
    pub(crate) fn last_activity(&self, rec: &SandboxRecord) -> i64 {
        let pending = self.activity.lock().get(&rec.id).copied().unwrap_or(0);
        rec.life
            .last_activity_ms
            .max(pending)
            .max(rec.created_at_ms)
    }

    /// The current record, for operations that waited for the sandbox's op lock.
    pub(crate) async fn fresh(&self, id: &str) -> Result<SandboxRecord, CoreError> {
        match self.store.get_sandbox(id).await? {
            Some(r) if r.state != SandboxState::Stopping && !r.state.is_final() => Ok(r),
            _ => Err(CoreError::sandbox_not_found(id)),
        }
    }

    /// Idle pauses, timeouts that pause, automatic hibernation and the hard lifetime
    /// limit; run by the housekeeping tick over the live sandboxes.
    pub(crate) async fn lifecycle_tick(self: &Arc<Self>, live: &[SandboxRecord]) {
        self.flush_activity().await;
        if self
            .gc_wanted
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            self.gc_layers().await;
        }
        let now = now_ms();
        let cfg = self.cfg.lifecycle.clone();
        for rec in live.iter().filter(|r| r.owner != POOL_OWNER) {
            if cfg.max_lifetime_secs > 0
                && now - rec.created_at_ms > cfg.max_lifetime_secs as i64 * 1000
            {
                tracing::info!(id = %rec.id, "sandbox reached the maximum lifetime");
                if let Err(e) = self.destroy(rec).await {
                    tracing::warn!(id = %rec.id, error = %e.chain(), "destroying a sandbox at its maximum lifetime failed");
                }
                continue;
            }
            let action = match rec.state {
                SandboxState::Running
                    if rec.life.idle_timeout_secs > 0
                        && now - self.last_activity(rec)
                            > rec.life.idle_timeout_secs as i64 * 1000
                        && !self.has_requests_in_flight(&rec.id) =>
                {
                    Some(("idle", true))
                }
                SandboxState::Paused
                    if cfg.hibernate_after_secs > 0
                        && rec.life.paused_at_ms.is_some_and(|at| {
                            now - at > cfg.hibernate_after_secs as i64 * 1000
                        }) =>
                {
                    Some(("paused for long", false))
                }
                _ => None,
            };
            if let Some((why, memory)) = action {
                self.spawn_pause(rec, why, memory);
            }
        }
    }

    /// A sandbox past its timeout: destroyed, or paused (with its memory or, for
    /// `hibernate`, only its files) when its `on_timeout` says so.
    pub(crate) async fn expire(self: &Arc<Self>, rec: &SandboxRecord) {
        let keep_memory = match rec.life.on_timeout {
            OnTimeout::Kill => None,
            OnTimeout::Pause => Some(true),
            OnTimeout::Hibernate => Some(false),
        };
        if let Some(memory) = keep_memory
            && matches!(
                rec.state,
                SandboxState::Running | SandboxState::Paused | SandboxState::Hibernated
            )
        {
            // Never selected again by the timeout; a resume sets a new deadline.
            if let Err(e) = self.store.set_expires_at(&rec.id, i64::MAX).await {
                tracing::warn!(id = %rec.id, error = %e, "recording a timeout pause failed");
                return;
            }
            if rec.state == SandboxState::Running {
                self.spawn_pause(rec, "timeout", memory);
            }
            return;
        }
        tracing::info!(id = %rec.id, "sandbox expired");
        if let Err(e) = self.destroy(rec).await {
            tracing::warn!(id = %rec.id, error = %e.chain(), "destroying expired sandbox failed");
        }
    }

    /// Runs a sandbox's timeout action now (E2B's `timeout: 0`) and returns what is left
    /// of it (`None`: it was killed). Unlike [`Manager::expire`] the action is done before
    /// this returns, so the caller sees the sandbox already paused or gone.
    pub async fn expire_now(
        &self,
        rec: &SandboxRecord,
    ) -> Result<Option<SandboxRecord>, CoreError> {
        let memory = match rec.life.on_timeout {
            OnTimeout::Kill => {
                tracing::info!(id = %rec.id, "sandbox expired at once");
                self.destroy(rec).await?;
                return Ok(None);
            }
            OnTimeout::Pause => true,
            OnTimeout::Hibernate => false,
        };
        // Paused first: if that fails, the old deadline stays and the timeout retries.
        let paused = match rec.state {
            SandboxState::Running => self.pause(rec, memory).await?,
            _ => rec.clone(),
        };
        // Never selected again by the timeout; a resume sets a new deadline.
        self.store.set_expires_at(&rec.id, i64::MAX).await?;
        Ok(Some(paused))
    }

    /// Pauses in the background; after a failure the sandbox is left alone for
    /// [`AUTO_RETRY`], so that a sandbox that cannot be paused is not retried every tick.
    pub(crate) fn spawn_pause(
        self: &Arc<Self>,
        rec: &SandboxRecord,
        why: &'static str,
        memory: bool,
    ) {
        {
            let mut failed = self.auto_failures.lock();
            failed.retain(|_, at| at.elapsed() < AUTO_RETRY);
            if failed.contains_key(&rec.id) {
                return;
            }
        }
        let (me, rec) = (self.clone(), rec.clone());
        tokio::spawn(async move {
            match me.pause(&rec, memory).await {
                Ok(r) => tracing::info!(id = %rec.id, why, state = %r.state, "sandbox paused"),
                Err(e) => {
                    tracing::warn!(id = %rec.id, why, error = %e.chain(), "automatic pause failed");
                    {
                        let mut failed = me.auto_failures.lock();
                        failed.insert(rec.id.clone(), std::time::Instant::now());
                    }
                }
            }
        });
    }

    /// Removes layer directories that no live sandbox and no snapshot uses.
    pub(crate) async fn gc_layers(&self) {
        let _gc = self.gc_lock.lock().await;
        // In this order: a layer listed now was either still pinned when the pins are
        // read, or its pin was dropped after the record that holds it was written, which
        // the store read after that then sees.
        let dir = self.layers_dir();
        let listed: Vec<String> = match std::fs::read_dir(&dir) {
            Ok(rd) => rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect(),
            Err(_) => return,
        };
        let mut keep: HashSet<String> = {
            let p = self.layer_pins.lock();
            p.keys().cloned().collect()
        };
        let (Ok(live), Ok(snaps)) = (
            self.store.live_sandboxes().await,
            self.store.list_snapshots(None).await,
        ) else {
            return;
        };
        keep.extend(live.into_iter().flat_map(|r| r.life.layers.into_iter()));
        keep.extend(
            snaps
                .iter()
                .map(|s| crate::snapshots::cache_layer_id(&s.id)),
        );
        let gone = blocking(move || {
            let mut gone = Vec::new();
            for name in listed {
                // `<id>.partial` is a pinned layer being written.
                let stem = name.split('.').next().unwrap_or_default();
                if !keep.contains(&name) && !keep.contains(stem) {
                    let _ = std::fs::remove_dir_all(dir.join(&name));
                    gone.push(name);
                }
            }
            Ok::<_, CoreError>(gone)
        })
        .await
        .unwrap_or_default();
        if !gone.is_empty() {
            tracing::info!(?gone, "removed unused layers");
        }
    }
}

/// Copies a writable layer into a new layer directory: first under a temporary name, so
/// that a crash never leaves a half-copied layer under a name a record could use.
pub(crate) fn copy_into_new_layer(
    from: &sandpit_image::Layer,
    dest: &Path,
) -> Result<(), CoreError> {
    let tmp = dest.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| CoreError::io(format!("create {}", parent.display()), e))?;
    }
    let done = sandpit_image::copy_layer(from, &tmp, SKIP_TOP)
        .map_err(crate::snapshots::image_err)
        .and_then(|_| {
            std::fs::rename(&tmp, dest)
                .map_err(|e| CoreError::io(format!("rename {}", tmp.display()), e))
        });
    if done.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    done
}

/// Refuses a writable layer whose files are larger in all than the sandbox's disk limit.
/// Its tmpfs caps the blocks used, not file sizes: sparse files can claim terabytes that
/// a copy, hash or archive would read and write in full on the host.
pub(crate) fn check_upper_size(upper: &Path, disk_bytes: u64) -> Result<(), CoreError> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0u64;
    let mut seen = HashSet::new();
    let mut dirs = vec![upper.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            if m.is_dir() {
                dirs.push(e.path());
            } else if m.is_file() && (m.nlink() == 1 || seen.insert(m.ino())) {
                total = total.saturating_add(m.len());
            }
        }
        if total > disk_bytes {
            return Err(CoreError::Unprocessable {
                code: "failed_precondition",
                message: format!(
                    "the sandbox's files add up to more than its disk limit of {disk_bytes} bytes                      (sparse files count at their full size); they cannot be copied or captured"
                ),
            });
        }
    }
    Ok(())
}

/// Runs blocking work (runtime calls, file trees) off the async threads.
pub(crate) async fn blocking<T: Send + 'static, E: Into<CoreError> + Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, CoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(CoreError::from)?
        .map_err(Into::into)
}

pub(crate) async fn remove_dir(p: PathBuf) {
    let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(p)).await;
}
