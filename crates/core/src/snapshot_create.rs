//! Taking a snapshot: the sandbox is frozen for as long as its writable layer takes to
//! archive (incremental over the snapshot it descends from), then the archive and its
//! manifest are uploaded and the record written.

use crate::error::CoreError;
use crate::lifecycle::{SKIP_TOP, blocking};
use crate::manager::{Manager, now_ms};
use crate::snapshot_store::{ARCHIVE, MANIFEST, StorageError};
use crate::snapshots::*;
use sandpit_api::CreateSnapshotRequest;
use sandpit_store::{SandboxRecord, SandboxState, SnapshotRecord};

impl Manager {
    /// Captures the sandbox's files into a stored snapshot. A running sandbox is frozen
    /// while its files are read, so the snapshot is one point in time.
    pub async fn snapshot(
        &self,
        rec: &SandboxRecord,
        req: &CreateSnapshotRequest,
    ) -> Result<SnapshotRecord, CoreError> {
        if let Some(n) = &req.name
            && !snapshot_name_ok(n)
        {
            return Err(CoreError::invalid(
                "snapshot names are 1-128 of [A-Za-z0-9._-], not starting with '.'",
            ));
        }
        let _op = self.op_lock(&rec.id).await;
        let rec = self.fresh(&rec.id).await?;
        if !matches!(
            rec.state,
            SandboxState::Running | SandboxState::Paused | SandboxState::Hibernated
        ) {
            return Err(CoreError::conflict(format!(
                "sandbox {} is {}",
                rec.id, rec.state
            )));
        }
        let parent = match (&rec.life.snapshot, req.incremental) {
            (Some(p), true) => match self.store.get_snapshot(&rec.owner, p).await? {
                Some(s) => Some(s),
                None => {
                    tracing::info!(id = %rec.id, parent = p, "parent snapshot is gone; taking a full one");
                    None
                }
            },
            _ => None,
        };
        let parent_manifest = match &parent {
            Some(p) => Some(self.load_manifest(&p.id).await?),
            None => None,
        };
        let id = format!("snap{}", uuid::Uuid::new_v4().simple());
        let name = req.name.clone().unwrap_or_else(|| id.clone());
        if self.store.get_snapshot(&rec.owner, &name).await?.is_some() {
            return Err(CoreError::conflict(format!(
                "a snapshot named {name:?} exists"
            )));
        }
        let tmp = self.tmp_dir();
        std::fs::create_dir_all(&tmp)
            .map_err(|e| CoreError::io(format!("create {}", tmp.display()), e))?;
        let archive = tmp.join(format!("{id}.tar.zst"));
        let layers = self.layer_paths(&rec)?;
        let live = match rec.state {
            SandboxState::Hibernated => None,
            _ => Some(self.runtime_of(&rec)?),
        };
        let freeze = rec.state == SandboxState::Running;
        let disk_bytes = rec.disk_bytes as u64;
        let (archive2, t0) = (archive.clone(), std::time::Instant::now());
        let captured = blocking(move || {
            if let (Some((rt, h)), true) = (&live, freeze) {
                rt.freeze(h)?;
            }
            let result = (|| {
                let upper = match &live {
                    Some((rt, h)) => Some(rt.open_upper(h)?),
                    None => None,
                };
                if let Some(u) = &upper {
                    crate::lifecycle::check_upper_size(&u.path(), disk_bytes)?;
                }
                let mut stack = Vec::new();
                if let Some(u) = &upper {
                    stack.push(sandpit_image::Layer {
                        dir: u.path(),
                        id_base: u.id_base,
                    });
                }
                stack.extend(
                    layers
                        .into_iter()
                        .map(|dir| sandpit_image::Layer { dir, id_base: 0 }),
                );
                let stack = sandpit_image::Stack(stack);
                let manifest = stack.manifest(SKIP_TOP).map_err(image_err)?;
                let out = std::fs::File::create(&archive2)
                    .map_err(|e| CoreError::internal_from("create archive", e))?;
                let stats =
                    sandpit_image::write_layer(&stack, &manifest, parent_manifest.as_ref(), out)
                        .map_err(image_err)?;
                Ok::<_, CoreError>((manifest, stats))
            })();
            if let (Some((rt, h)), true) = (&live, freeze)
                && let Err(e) = rt.thaw(h)
            {
                tracing::error!(id = %h.id, error = %e, "thawing after a snapshot failed");
            }
            result
        })
        .await;
        let (manifest, stats) = match captured {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_file(&archive);
                return Err(e);
            }
        };
        let frozen_ms = t0.elapsed().as_millis();
        let uploaded = async {
            self.snapshot_store
                .put_file(&self.snapshot_store.key(&id, ARCHIVE), &archive)
                .await?;
            let m = serde_json::to_vec(&manifest).map_err(StorageError::from)?;
            self.snapshot_store
                .put_bytes(&self.snapshot_store.key(&id, MANIFEST), m)
                .await
        }
        .await;
        let _ = tokio::fs::remove_file(&archive).await;
        if let Err(e) = uploaded {
            self.snapshot_store.delete(&id).await;
            return Err(e.into());
        }
        let settings = Settings {
            env: rec.env.clone(),
            secret_env: rec.secret_env.clone(),
            limits: limits_of(&rec),
            workdir: rec.life.workdir.clone(),
            user: rec.life.user.clone(),
            network: self.net.get().and_then(|n| n.policy_of(&rec.id)),
        };
        let snap = SnapshotRecord {
            id: id.clone(),
            owner: rec.owner.clone(),
            name,
            sandbox_id: rec.id.clone(),
            parent: parent.as_ref().map(|p| p.id.clone()),
            template: rec.template.clone(),
            runtime: rec.runtime.clone(),
            kind: if parent.is_some() {
                "incremental"
            } else {
                "full"
            }
            .into(),
            size_bytes: stats.bytes as i64,
            entries: stats.entries as i64,
            digest: stats.sha256.clone(),
            settings: serde_json::to_value(&settings)?,
            created_at_ms: now_ms(),
        };
        if let Err(e) = self.store.insert_snapshot(&snap).await {
            self.snapshot_store.delete(&id).await;
            return Err(e.into());
        }
        let mut life = rec.life.clone();
        life.snapshot = Some(id.clone());
        self.store.set_life(&rec.id, &life).await?;
        tracing::info!(id = %rec.id, snapshot = %id, kind = %snap.kind, bytes = stats.bytes, entries = stats.entries, frozen_ms, "snapshot taken");
        Ok(snap)
    }
}
