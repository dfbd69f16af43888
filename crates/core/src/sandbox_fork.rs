//! Forking: a running sandbox's files are captured once as a layer that every copy
//! boots on, each copy with tokens of its own and its source's exposure.

use crate::error::CoreError;
use crate::lifecycle::blocking;
use crate::manager::{DEFAULT_WORKDIR, Manager, now_ms};
use crate::snapshots::*;
use futures::StreamExt;
use sandpit_api::ForkRequest;
use sandpit_store::{Lifecycle, SandboxRecord, SandboxState};
use std::sync::Arc;

impl Manager {
    /// Makes `count` independent sandboxes that start on a copy of this one's files: its
    /// writable layer is copied once into a shared read-only layer, and each copy gets
    /// its own writable layer over it (copy-on-write), processes, limits and identity.
    pub async fn fork(
        self: &Arc<Self>,
        rec: &SandboxRecord,
        req: &ForkRequest,
    ) -> Result<Vec<SandboxRecord>, CoreError> {
        let count = req.count.unwrap_or(1);
        if count == 0 || count > MAX_FORK {
            return Err(CoreError::invalid(format!(
                "count must be between 1 and {MAX_FORK}"
            )));
        }
        let limits = req.limits.unwrap_or_else(|| limits_of(rec));
        let mut plan = self
            .plan(Some(&rec.template), Some(&rec.runtime), &limits)
            .await?;
        // A volume is shared, not copied: each copy mounts its source's.
        plan.volumes = self.volume_specs(&rec.id).await?;
        let source_policy = self.net.get().and_then(|n| n.policy_of(&rec.id));
        plan.network =
            crate::net::plan_policy(self.net.get(), &plan.key.runtime, source_policy.as_ref())?;
        let timeout = self.timeout(req.timeout)?;
        let metadata = req.metadata.clone().unwrap_or_else(|| rec.metadata.clone());
        crate::manager::check_metadata(&metadata)?;
        let (layers, _pins): (Vec<String>, Vec<crate::lifecycle::Pin<'_>>) = {
            let _op = self.op_lock(&rec.id).await;
            let src = self.fresh(&rec.id).await?;
            match src.state {
                // Shared as they are, pinned until the copies' records hold them.
                SandboxState::Hibernated => (
                    src.life.layers.clone(),
                    src.life.layers.iter().map(|l| self.pin(l)).collect(),
                ),
                SandboxState::Running | SandboxState::Paused => {
                    let (rt, h) = self.runtime_of(&src)?;
                    let layer = format!("fork-{}-{}", src.id, uuid::Uuid::new_v4().simple());
                    let pin = self.pin(&layer);
                    let running = src.state == SandboxState::Running;
                    self.capture_upper(
                        &rt,
                        &h,
                        running,
                        &self.layer_path(&layer)?,
                        src.disk_bytes as u64,
                    )
                    .await?;
                    if running {
                        blocking(move || rt.thaw(&h)).await?;
                    }
                    let mut layers = vec![layer];
                    layers.extend(src.life.layers.iter().cloned());
                    let mut pins = vec![pin];
                    pins.extend(src.life.layers.iter().map(|l| self.pin(l)));
                    (layers, pins)
                }
                other => {
                    return Err(CoreError::conflict(format!(
                        "sandbox {} is {other}",
                        src.id
                    )));
                }
            }
        };
        let life = Lifecycle {
            layers,
            snapshot: rec.life.snapshot.clone(),
            last_activity_ms: now_ms(),
            idle_timeout_secs: rec.life.idle_timeout_secs,
            on_timeout: rec.life.on_timeout,
            auto_resume: rec.life.auto_resume,
            paused_at_ms: None,
            workdir: rec.life.workdir.clone(),
            user: rec.life.user.clone(),
            timeout_secs: timeout,
            sudo: rec.life.sudo,
        };
        let workdir = rec
            .life
            .workdir
            .clone()
            .unwrap_or_else(|| DEFAULT_WORKDIR.into());
        let expires = now_ms() + timeout as i64 * 1000;
        let mut made = Vec::new();
        let mut failure = None;
        // A few at a time: each start is CPU-bound.
        let starts = futures::stream::iter(0..count)
            .map(|_| {
                self.start_new(crate::manager::NewSandbox {
                    owner: &rec.owner,
                    pool: None,
                    plan: plan.clone(),
                    env: rec.env.clone(),
                    secret_env: rec.secret_env.clone(),
                    metadata: metadata.clone(),
                    workdir: workdir.clone(),
                    expires_at_ms: expires,
                    life: life.clone(),
                })
            })
            .buffer_unordered(4)
            .collect::<Vec<_>>()
            .await;
        for s in starts {
            match s {
                Ok(r) => made.push(r),
                Err(e) => failure = Some(e),
            }
        }
        if failure.is_none() {
            // Each copy gets proxy tokens of its own and its source's exposure.
            for r in &made {
                if let Err(e) = crate::access::inherit(self, &rec.id, &r.id).await {
                    failure = Some(e);
                    break;
                }
            }
        }
        let ids: Vec<String> = made.iter().map(|r| r.id.clone()).collect();
        if failure.is_none()
            && let Err(e) = self.broker.copy_attachments(&rec.id, &ids).await
        {
            failure = Some(e.into());
        }
        if let Some(e) = failure {
            for r in &made {
                let _ = self.destroy(r).await;
            }
            return Err(e);
        }
        tracing::info!(id = %rec.id, count, "sandbox forked");
        Ok(made)
    }
}
