//! Restoring from a snapshot: its chain is walked back to the first full one, each
//! archive downloaded once into a cached read-only layer (digest checked), and the new
//! sandbox is planned on those layers with the snapshot's settings.

use crate::error::CoreError;
use crate::lifecycle::blocking;
use crate::manager::Manager;
use crate::snapshot_store::{ARCHIVE, MANIFEST, StorageError, sha256_file};
use crate::snapshots::*;
use sandpit_store::SnapshotRecord;

impl Manager {
    pub(crate) async fn load_manifest(
        &self,
        snapshot: &str,
    ) -> Result<sandpit_image::Manifest, CoreError> {
        let bytes = self
            .snapshot_store
            .get_bytes(&self.snapshot_store.key(snapshot, MANIFEST))
            .await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| CoreError::internal_from(format!("manifest of {snapshot}"), e))
    }

    /// A snapshot and its ancestors, newest first.
    pub async fn snapshot_chain(
        &self,
        owner: &str,
        id_or_name: &str,
    ) -> Result<Vec<SnapshotRecord>, CoreError> {
        let first = self
            .store
            .get_snapshot(owner, id_or_name)
            .await?
            .ok_or_else(|| CoreError::not_found(format!("snapshot {id_or_name} not found")))?;
        let mut chain = vec![first];
        while let Some(p) = chain.last().and_then(|s| s.parent.clone()) {
            if chain.len() > 1000 || chain.iter().any(|s| s.id == p) {
                return Err(CoreError::internal("snapshot chain loops"));
            }
            let parent = self.store.get_snapshot(owner, &p).await?.ok_or_else(|| {
                CoreError::conflict(format!("snapshot {p}, a parent in the chain, is gone"))
            })?;
            chain.push(parent);
        }
        Ok(chain)
    }

    /// Makes sure a snapshot's archive is unpacked as a layer (checking its digest).
    pub(crate) async fn ensure_cached(&self, snap: &SnapshotRecord) -> Result<String, CoreError> {
        let layer = cache_layer_id(&snap.id);
        let dir = self.layer_path(&layer)?;
        let _op = self.op_lock(&layer).await;
        if dir.is_dir() {
            return Ok(layer);
        }
        let tmp = self.tmp_dir();
        tokio::fs::create_dir_all(&tmp)
            .await
            .map_err(|e| CoreError::io(format!("create {}", tmp.display()), e))?;
        let key = self.snapshot_store.key(&snap.id, ARCHIVE);
        // A local store's archive is read where it is; anything else is downloaded.
        let (file, downloaded) = match self.snapshot_store.local_file(&key) {
            Some(path) => (path, false),
            None => (tmp.join(format!("{}.get", snap.id)), true),
        };
        let digest = if downloaded {
            self.snapshot_store.get_file(&key, &file).await
        } else {
            let f = file.clone();
            tokio::task::spawn_blocking(move || sha256_file(&f))
                .await
                .map_err(StorageError::from)
                .and_then(|d| d)
        };
        let digest = match digest {
            Ok(d) => d,
            Err(e) => {
                if downloaded {
                    let _ = tokio::fs::remove_file(&file).await;
                }
                return Err(e.into());
            }
        };
        if digest != snap.digest {
            if downloaded {
                let _ = tokio::fs::remove_file(&file).await;
            }
            return Err(CoreError::conflict(format!(
                "snapshot {} is corrupt: its archive's sha256 is {digest}, not {}",
                snap.id, snap.digest
            )));
        }
        let unpacked = blocking(move || {
            let partial = dir.with_extension("partial");
            let _ = std::fs::remove_dir_all(&partial);
            let res = (|| {
                std::fs::create_dir_all(&partial)
                    .map_err(|e| CoreError::io(format!("create {}", partial.display()), e))?;
                let f = std::fs::File::open(&file)
                    .map_err(|e| CoreError::io(format!("open {}", file.display()), e))?;
                sandpit_image::unpack_layer(f, &partial, &UNPACK_LIMITS).map_err(image_err)?;
                std::fs::rename(&partial, &dir)
                    .map_err(|e| CoreError::io(format!("rename {}", partial.display()), e))
            })();
            if res.is_err() {
                let _ = std::fs::remove_dir_all(&partial);
            }
            if downloaded {
                let _ = std::fs::remove_file(&file);
            }
            res
        })
        .await;
        unpacked.map(|()| layer)
    }

    /// Lifecycle and settings of a sandbox that starts from a snapshot: its chain's layers
    /// (unpacked as needed and pinned until the record holds them).
    pub(crate) async fn restore_plan(
        &self,
        owner: &str,
        snapshot: &str,
    ) -> Result<Restore<'_>, CoreError> {
        let chain = self.snapshot_chain(owner, snapshot).await?;
        let mut layers = Vec::new();
        let mut pins = Vec::new();
        for s in &chain {
            let l = self.ensure_cached(s).await?;
            pins.push(self.pin(&l));
            layers.push(l);
        }
        let top = &chain[0];
        let settings: Settings = serde_json::from_value(top.settings.clone()).unwrap_or_default();
        Ok(Restore {
            snapshot: top.clone(),
            layers,
            env: settings.env,
            secret_env: settings.secret_env,
            limits: settings.limits,
            workdir: settings.workdir,
            user: settings.user,
            network: settings.network,
            _pins: pins,
        })
    }
}
