//! Pausing a sandbox (its processes frozen, memory kept) and resuming it; both are
//! idempotent, and a hibernated sandbox is woken by resume.

use crate::error::CoreError;
use crate::lifecycle::*;
use crate::manager::{Manager, now_ms};
use sandpit_store::{SandboxRecord, SandboxState};

impl Manager {
    /// Pauses a sandbox: `memory` keeps its processes frozen in RAM, otherwise it is
    /// hibernated (files kept, processes ended).
    pub async fn pause(
        &self,
        rec: &SandboxRecord,
        memory: bool,
    ) -> Result<SandboxRecord, CoreError> {
        if !memory {
            return self.hibernate(rec).await;
        }
        let _op = self.op_lock(&rec.id).await;
        let rec = self.fresh(&rec.id).await?;
        match rec.state {
            SandboxState::Running => {}
            SandboxState::Paused | SandboxState::Hibernated => return Ok(rec),
            other => {
                return Err(CoreError::conflict(format!(
                    "sandbox {} is {other}, not running",
                    rec.id
                )));
            }
        }
        let (rt, h) = self.runtime_of(&rec)?;
        blocking(move || rt.freeze(&h)).await?;
        let mut life = rec.life.clone();
        life.paused_at_ms = Some(now_ms());
        let paused = self
            .store
            .transition_life(
                &rec.id,
                &[SandboxState::Running],
                SandboxState::Paused,
                &life,
            )
            .await?
            .ok_or_else(|| CoreError::conflict("sandbox changed state while pausing"))?;
        crate::usage::on_state(self, &paused, SandboxState::Paused);
        Ok(paused)
    }

    /// Resumes a paused sandbox (thaw) or a hibernated one (start again on its files); a
    /// running one is returned as it is.
    pub async fn resume(&self, rec: &SandboxRecord) -> Result<SandboxRecord, CoreError> {
        let _op = self.op_lock(&rec.id).await;
        let rec = self.fresh(&rec.id).await?;
        let woken = match rec.state {
            SandboxState::Running => return Ok(rec),
            SandboxState::Paused => {
                let (rt, h) = self.runtime_of(&rec)?;
                blocking(move || rt.thaw(&h)).await?;
                let mut life = rec.life.clone();
                life.paused_at_ms = None;
                let thawed = self
                    .store
                    .transition_life(
                        &rec.id,
                        &[SandboxState::Paused],
                        SandboxState::Running,
                        &life,
                    )
                    .await?
                    .ok_or_else(|| CoreError::conflict("sandbox changed state while resuming"))?;
                crate::usage::on_state(self, &thawed, SandboxState::Running);
                thawed
            }
            SandboxState::Hibernated => self.wake(&rec).await?,
            other => {
                return Err(CoreError::conflict(format!(
                    "sandbox {} is {other}, not paused",
                    rec.id
                )));
            }
        };
        self.touch(&woken.id);
        if woken.expires_at_ms == i64::MAX && woken.life.timeout_secs > 0 {
            // Paused by its timeout: a resume gives it its lifetime again.
            let at = now_ms() + woken.life.timeout_secs as i64 * 1000;
            self.store.set_expires_at(&woken.id, at).await?;
            return Ok(SandboxRecord {
                expires_at_ms: at,
                ..woken
            });
        }
        Ok(woken)
    }
}
