//! Volumes, the manager's side: names and sizes checked, records kept in step with the
//! host (`sandpit_runtime::volume::VolumeHost` makes, mounts and removes the file systems),
//! and the volumes of a new sandbox recorded and mounted before it starts.

use crate::error::CoreError;
use crate::manager::{Manager, now_ms};
use sandpit_api::{CreateVolumeRequest, Volume, VolumeMountSpec};
use sandpit_runtime::VolumeMount;
use sandpit_runtime::volume::VolumeHost;
use sandpit_store::{VolumeAttach, VolumeDeletion, VolumeRecord, VolumeState};
use std::sync::Arc;

/// Accepted volume sizes in bytes.
pub const SIZE_RANGE: (u64, u64) = (16 << 20, 1 << 40);
/// Most volumes one owner may have.
pub const MAX_PER_OWNER: i64 = 100;
/// Most volumes one sandbox may mount.
pub const MAX_PER_SANDBOX: usize = 16;
/// Longest volume name.
pub const MAX_NAME: usize = 63;

/// Checks a volume name: 1 to 63 characters of `[a-z0-9_-]`, starting with `[a-z0-9]`.
pub fn check_name(name: &str) -> Result<(), CoreError> {
    let ok = name.len() <= MAX_NAME
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(CoreError::invalid(format!(
            "invalid volume name {name:?}: 1 to {MAX_NAME} characters of [a-z0-9_-], starting with a letter or digit"
        )))
    }
}

/// Checks the volumes a create asks for (names, mount paths, how many), before anything
/// is made.
pub fn check_mounts(mounts: &[VolumeMountSpec]) -> Result<(), CoreError> {
    if mounts.len() > MAX_PER_SANDBOX {
        return Err(CoreError::invalid(format!(
            "at most {MAX_PER_SANDBOX} volumes per sandbox"
        )));
    }
    for m in mounts {
        check_name(&m.name)?;
    }
    sandpit_runtime::volume::check_targets(mounts.iter().map(|m| m.path.as_str()))
        .map_err(sandpit_runtime::RuntimeError::from)?;
    Ok(())
}

/// Runs a blocking host operation on the blocking pool.
async fn host<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, sandpit_runtime::RuntimeError> + Send + 'static,
) -> Result<T, CoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(CoreError::from)?
        .map_err(CoreError::from)
}

impl Manager {
    fn volume_host(&self) -> Arc<VolumeHost> {
        self.volumes.clone()
    }

    /// The API view of a volume: usage (mounting it if needed) when it is ready and the
    /// host can mount it.
    async fn volume_view(&self, v: VolumeRecord) -> Result<Volume, CoreError> {
        let (used, available) = if v.state == VolumeState::Ready {
            let (vh, id) = (self.volume_host(), v.id.clone());
            match host(move || vh.usage(&id)).await {
                Ok((u, a)) => (Some(u), Some(a)),
                // One volume the host cannot mount must not hide the others from a list.
                Err(e) => {
                    tracing::warn!(id = %v.id, error = %e.chain(), "reading a volume's usage failed");
                    (None, None)
                }
            }
        } else {
            (None, None)
        };
        Ok(Volume {
            in_use_by: self.store.volume_users(&v.id).await?,
            name: v.name,
            size_bytes: v.size_bytes as u64,
            state: v.state.as_str().to_string(),
            used_bytes: used,
            available_bytes: available,
            created_at_ms: v.created_at_ms,
        })
    }

    /// Creates a volume of `owner` and returns it ready (its file system made and mounted).
    pub async fn create_volume(
        &self,
        owner: &str,
        req: &CreateVolumeRequest,
    ) -> Result<Volume, CoreError> {
        check_name(&req.name)?;
        let (lo, hi) = SIZE_RANGE;
        if req.size_bytes < lo || req.size_bytes > hi {
            return Err(CoreError::invalid(format!(
                "size_bytes must be between {lo} and {hi}, got {}",
                req.size_bytes
            )));
        }
        // The image is sparse; refuse one that could not fill up even now.
        let free = nix::sys::statvfs::statvfs(self.volumes.images_dir())
            .map(|s| s.blocks_available() * s.fragment_size())
            .map_err(|e| CoreError::internal_from("statvfs of the volume directory", e))?;
        if req.size_bytes > free {
            return Err(CoreError::InsufficientStorage(format!(
                "the host has {free} bytes free, less than the {} asked for",
                req.size_bytes
            )));
        }
        let rec = VolumeRecord {
            id: crate::manager::new_id(),
            owner: owner.to_string(),
            name: req.name.clone(),
            size_bytes: req.size_bytes as i64,
            state: VolumeState::Creating,
            created_at_ms: now_ms(),
        };
        match self.store.insert_volume(&rec, MAX_PER_OWNER).await {
            Ok(true) => {}
            Ok(false) => {
                return Err(CoreError::conflict(format!(
                    "at most {MAX_PER_OWNER} volumes per owner"
                )));
            }
            Err(sandpit_store::StoreError::Conflict(_)) => {
                return Err(CoreError::conflict(format!(
                    "volume {} already exists",
                    req.name
                )));
            }
            Err(e) => return Err(e.into()),
        }
        let (vh, id, size) = (self.volume_host(), rec.id.clone(), req.size_bytes);
        if let Err(e) = host(move || vh.create(&id, size)).await {
            // The host side cleaned up after itself.
            let _ = self.store.delete_volume(&rec.id).await;
            return Err(e);
        }
        if !self
            .store
            .set_volume_state(&rec.id, VolumeState::Creating, VolumeState::Ready)
            .await?
        {
            return Err(CoreError::internal("volume record changed while creating"));
        }
        tracing::info!(owner, name = %rec.name, id = %rec.id, size = req.size_bytes, "volume created");
        self.volume_view(VolumeRecord {
            state: VolumeState::Ready,
            ..rec
        })
        .await
    }

    /// The volumes of `owner`, by name.
    pub async fn list_volumes(&self, owner: &str) -> Result<Vec<Volume>, CoreError> {
        let mut out = Vec::new();
        for v in self.store.list_volumes(Some(owner)).await? {
            out.push(self.volume_view(v).await?);
        }
        Ok(out)
    }

    /// One volume of `owner`.
    pub async fn get_volume(&self, owner: &str, name: &str) -> Result<Volume, CoreError> {
        match self.store.get_volume(owner, name).await? {
            Some(v) => self.volume_view(v).await,
            None => Err(CoreError::not_found(format!("volume {name} not found"))),
        }
    }

    /// Deletes a volume of `owner` with everything in it; refused while a sandbox has it
    /// mounted.
    pub async fn delete_volume(&self, owner: &str, name: &str) -> Result<(), CoreError> {
        let v = match self.store.begin_volume_delete(owner, name).await? {
            VolumeDeletion::Started(v) => v,
            VolumeDeletion::NotFound => {
                return Err(CoreError::not_found(format!("volume {name} not found")));
            }
            VolumeDeletion::InUse(ids) => {
                return Err(CoreError::conflict(format!(
                    "volume {name} is mounted by sandbox {}; delete {} first",
                    ids.join(", "),
                    if ids.len() == 1 { "it" } else { "them" }
                )));
            }
            VolumeDeletion::Busy(state) => {
                return Err(CoreError::conflict(format!("volume {name} is {state}")));
            }
        };
        let (vh, id) = (self.volume_host(), v.id.clone());
        if let Err(e) = host(move || vh.remove(&id)).await {
            // Its data is still there (only the mount may be gone, and comes back on use).
            let _ = self
                .store
                .set_volume_state(&v.id, VolumeState::Deleting, VolumeState::Ready)
                .await;
            return Err(e);
        }
        self.store.delete_volume(&v.id).await?;
        tracing::info!(owner, name, id = %v.id, "volume deleted");
        Ok(())
    }

    /// Records that sandbox `sandbox_id` of `owner` mounts `mounts` (a missing volume is a
    /// 404 and records nothing) and mounts them on the host; returns what the runtime
    /// mounts. The records go with the sandbox's.
    pub(crate) async fn attach_volumes(
        &self,
        sandbox_id: &str,
        owner: &str,
        mounts: &[VolumeMountSpec],
    ) -> Result<Vec<VolumeMount>, CoreError> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        let wanted: Vec<VolumeAttach> = mounts
            .iter()
            .map(|m| VolumeAttach {
                name: m.name.clone(),
                path: m.path.clone(),
                read_only: m.read_only,
            })
            .collect();
        self.store
            .attach_volumes(sandbox_id, owner, &wanted)
            .await?;
        self.volume_mounts(sandbox_id).await
    }

    /// The volumes sandbox `sandbox_id` mounts, as a create would ask for them.
    pub(crate) async fn volume_specs(
        &self,
        sandbox_id: &str,
    ) -> Result<Vec<VolumeMountSpec>, CoreError> {
        Ok(self
            .store
            .sandbox_volumes(sandbox_id)
            .await?
            .into_iter()
            .map(|(_, a)| VolumeMountSpec {
                name: a.name,
                path: a.path,
                read_only: a.read_only,
            })
            .collect())
    }

    /// The host mount of ready volume `id` (mounted if needed), for the volume-content
    /// API; the caller has checked who may open it.
    pub async fn volume_host_dir(&self, id: &str) -> Result<std::path::PathBuf, CoreError> {
        let (vh, id) = (self.volume_host(), id.to_string());
        host(move || vh.mount(&id)).await
    }

    /// What the runtime mounts for sandbox `sandbox_id`, each volume mounted on the host
    /// first: at its create, and whenever it starts again on its files (a wake from
    /// hibernation).
    pub async fn volume_mounts(&self, sandbox_id: &str) -> Result<Vec<VolumeMount>, CoreError> {
        let mut out = Vec::new();
        for (v, a) in self.store.sandbox_volumes(sandbox_id).await? {
            let vh = self.volume_host();
            let source = host(move || vh.mount(&v.id)).await?;
            out.push(VolumeMount {
                source,
                target: a.path,
                read_only: a.read_only,
            });
        }
        Ok(out)
    }

    /// After a start: finishes volume creates and deletes that a crash cut short (both
    /// end with the volume gone) and removes host leftovers no record knows. Volumes are
    /// mounted again when first used.
    pub async fn reconcile_volumes(&self) -> Result<(), CoreError> {
        let mut keep = Vec::new();
        for v in self.store.list_volumes(None).await? {
            if v.state == VolumeState::Ready {
                keep.push(v.id);
                continue;
            }
            tracing::info!(id = %v.id, name = %v.name, state = %v.state, "removing a volume left half-made or half-deleted");
            let (vh, id) = (self.volume_host(), v.id.clone());
            match host(move || vh.remove(&id)).await {
                Ok(()) => {
                    self.store.delete_volume(&v.id).await?;
                }
                Err(e) => {
                    tracing::warn!(id = %v.id, error = %e.chain(), "removing a volume failed")
                }
            }
        }
        let vh = self.volume_host();
        let removed = tokio::task::spawn_blocking(move || vh.remove_orphans(&keep))
            .await
            .unwrap_or_default();
        if !removed.is_empty() {
            tracing::info!(?removed, "removed orphaned volume files");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "data", "0cache", "my_vol-2", &"a".repeat(63)] {
            assert!(check_name(ok).is_ok(), "{ok:?} refused");
        }
        for bad in [
            "",
            "-a",
            "_a",
            "Data",
            "a.b",
            "a/b",
            "a b",
            "ä",
            &"a".repeat(64),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn mounts_of_a_create() {
        let m = |name: &str, path: &str| VolumeMountSpec {
            name: name.into(),
            path: path.into(),
            read_only: false,
        };
        assert!(check_mounts(&[m("a", "/data"), m("a", "/copy")]).is_ok());
        assert!(check_mounts(&[m("a", "/data"), m("b", "/data/")]).is_err());
        assert!(check_mounts(&[m("a", "/proc/x")]).is_err());
        assert!(check_mounts(&[m("a", "relative")]).is_err());
        assert!(check_mounts(&[m("a", "/x/../etc")]).is_err());
        assert!(check_mounts(&[m("Bad", "/x")]).is_err());
        let many: Vec<_> = (0..17).map(|i| m("a", &format!("/m{i}"))).collect();
        assert!(check_mounts(&many).is_err());
    }
}
