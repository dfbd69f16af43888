//! Hibernation: a paused sandbox's writable layer is captured as a read-only layer and
//! its processes end, so it holds no memory; waking boots it again on the same files.

use crate::error::CoreError;
use crate::lifecycle::*;
use crate::manager::{DEFAULT_WORKDIR, Failed, Manager, now_ms};
use sandpit_runtime::{Runtime, SandboxHandle, SandboxSpec};
use sandpit_store::{SandboxRecord, SandboxState};
use std::path::Path;
use std::sync::Arc;

impl Manager {
    /// Keeps the sandbox's files, ends its processes and frees everything else. Its writable
    /// layer becomes a read-only layer on disk, which a resume starts it on.
    pub async fn hibernate(&self, rec: &SandboxRecord) -> Result<SandboxRecord, CoreError> {
        let _op = self.op_lock(&rec.id).await;
        let rec = self.fresh(&rec.id).await?;
        match rec.state {
            SandboxState::Running | SandboxState::Paused => {}
            SandboxState::Hibernated => return Ok(rec),
            other => {
                return Err(CoreError::conflict(format!(
                    "sandbox {} is {other}, not running or paused",
                    rec.id
                )));
            }
        }
        let (rt, h) = self.runtime_of(&rec)?;
        let layer_id = format!("hib-{}-{}", rec.id, now_ms());
        let dest = self.layer_path(&layer_id)?;
        let _pin = self.pin(&layer_id);
        let was_running = rec.state == SandboxState::Running;
        self.capture_upper(&rt, &h, was_running, &dest, rec.disk_bytes as u64)
            .await?;
        let mut life = rec.life.clone();
        life.layers.insert(0, layer_id.clone());
        life.paused_at_ms = Some(now_ms());
        let from = [SandboxState::Running, SandboxState::Paused];
        let Some(cur) = self
            .store
            .transition_life(&rec.id, &from, SandboxState::Hibernated, &life)
            .await?
        else {
            remove_dir(dest).await;
            if was_running {
                let (rt, h) = (rt.clone(), h.clone());
                let _ = blocking(move || rt.thaw(&h)).await;
            }
            return Err(CoreError::conflict(
                "sandbox changed state while hibernating",
            ));
        };
        crate::usage::on_state(self, &cur, SandboxState::Hibernated);
        self.forget(&rec.id);
        if let Err(e) = crate::sandbox_delete::run_destroy(rt, h).await {
            // The files are safe; what is left of the processes goes with the next
            // start's orphan sweep.
            tracing::warn!(id = %rec.id, error = %e, "ending a hibernated sandbox's processes failed");
        }
        tracing::info!(id = %rec.id, layer = layer_id, "sandbox hibernated");
        Ok(self.fold_private_layer(cur).await)
    }

    /// Copies a sandbox's writable layer into a new read-only layer at `dest`, freezing
    /// the sandbox meanwhile when it runs (and thawing it after a failure).
    pub(crate) async fn capture_upper(
        &self,
        rt: &Arc<dyn Runtime>,
        h: &SandboxHandle,
        freeze: bool,
        dest: &Path,
        disk_bytes: u64,
    ) -> Result<(), CoreError> {
        if freeze {
            let (rt, h) = (rt.clone(), h.clone());
            blocking(move || rt.freeze(&h)).await?;
        }
        let (rt2, h2, dest2) = (rt.clone(), h.clone(), dest.to_path_buf());
        let copied = blocking(move || {
            let up = rt2.open_upper(&h2)?;
            check_upper_size(&up.path(), disk_bytes)?;
            copy_into_new_layer(
                &sandpit_image::Layer {
                    dir: up.path(),
                    id_base: up.id_base,
                },
                &dest2,
            )
        })
        .await;
        if let Err(e) = copied {
            if freeze {
                let (rt, h) = (rt.clone(), h.clone());
                let _ = blocking(move || rt.thaw(&h)).await;
            }
            return Err(e);
        }
        Ok(())
    }

    /// Folds a freshly hibernated sandbox's top layer into the layer below it when that
    /// one is its own from an earlier hibernation and nobody else uses it, so that
    /// hibernating again and again does not stack up layers.
    pub(crate) async fn fold_private_layer(&self, rec: SandboxRecord) -> SandboxRecord {
        let [top, below, ..] = rec.life.layers.as_slice() else {
            return rec;
        };
        // A fork under way may be about to start on it.
        let pinned = self.layer_pins.lock().contains_key(below);
        if !below.starts_with(&format!("hib-{}-", rec.id)) || pinned {
            return rec;
        }
        let Ok(live) = self.store.live_sandboxes().await else {
            return rec;
        };
        if live
            .iter()
            .any(|r| r.id != rec.id && r.life.layers.contains(below))
        {
            return rec;
        }
        let (Ok(top_dir), Ok(below_dir)) = (self.layer_path(top), self.layer_path(below)) else {
            return rec;
        };
        let merged = blocking(move || {
            sandpit_image::merge_layer(
                &sandpit_image::Layer {
                    dir: top_dir,
                    id_base: 0,
                },
                &below_dir,
                &[],
            )
            .map_err(|e| CoreError::internal_from("merge layers", e))
        })
        .await;
        if let Err(e) = merged {
            tracing::warn!(id = %rec.id, error = %e.chain(), "folding hibernation layers failed; keeping both");
            return rec;
        }
        // The lower layer now holds both; until the record says so, both are listed,
        // which gives the same files.
        let mut life = rec.life.clone();
        let top = life.layers.remove(0);
        match self.store.set_life(&rec.id, &life).await {
            Ok(true) => {
                if let Ok(p) = self.layer_path(&top) {
                    remove_dir(p).await;
                }
                SandboxRecord { life, ..rec }
            }
            _ => rec,
        }
    }

    /// Starts a hibernated sandbox again on its files (called under its op lock).
    pub(crate) async fn wake(&self, rec: &SandboxRecord) -> Result<SandboxRecord, CoreError> {
        let limits = crate::snapshots::limits_of(rec);
        let plan = self
            .plan(Some(&rec.template), Some(&rec.runtime), &limits)
            .await?;
        let layers = self.start_layers(rec, &plan.defaults)?;
        let volumes = self.volume_mounts(&rec.id).await?;
        let cur = self
            .store
            .transition(
                &rec.id,
                &[SandboxState::Hibernated],
                SandboxState::Creating,
                None,
            )
            .await?
            .ok_or_else(|| CoreError::conflict("sandbox changed state while resuming"))?;
        // A delete from here on must not tear down with the handle of the processes
        // hibernation ended (it would hit the new start's cgroup and uid slot).
        self.store
            .set_runtime_state(&rec.id, &serde_json::Value::Null)
            .await?;
        let spec = SandboxSpec {
            id: rec.id.clone(),
            template: plan.template.clone(),
            limits: plan.runtime_limits(),
            env: rec.env.clone(),
            workdir: rec
                .life
                .workdir
                .clone()
                .unwrap_or_else(|| DEFAULT_WORKDIR.into()),
            layers,
            volumes,
            extra_ca_pem: self.broker.ca_pem(&rec.id),
            net: None,
            sudo: rec.life.sudo,
        };
        let running = self
            .boot(
                &cur,
                plan.runtime.clone(),
                spec,
                Failed::Restore(SandboxState::Hibernated),
            )
            .await?;
        if let Some(user) = rec.life.user.as_deref() {
            self.set_default_user(&running, user).await?;
        }
        let mut life = running.life.clone();
        life.paused_at_ms = None;
        self.store.set_life(&running.id, &life).await?;
        tracing::info!(id = %rec.id, "hibernated sandbox resumed");
        Ok(SandboxRecord { life, ..running })
    }
}
