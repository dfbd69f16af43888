//! The once-a-second watch over running sandboxes: a sandbox whose processes died is
//! marked stopped and cleaned up (only on a definite `Dead`, never on a busy host's
//! `Unknown`), and the idle and lifetime rules run.

use crate::manager::*;
use crate::pools::POOL_OWNER;
use sandpit_runtime::{Liveness, Runtime, SandboxHandle};
use sandpit_store::{SandboxRecord, SandboxState};
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Manager {
    /// One pass of housekeeping: expire sandboxes past their TTL and clean up dead ones.
    pub async fn tick(self: &Arc<Self>) {
        self.time_out_agent_runs().await;
        let states = [
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Hibernated,
            SandboxState::Error,
        ];
        match self.store.expired_sandboxes(now_ms(), &states).await {
            Ok(expired) => {
                for rec in expired {
                    self.expire(&rec).await;
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing expired sandboxes failed"),
        }
        let Ok(live) = self.store.live_sandboxes().await else {
            return;
        };
        self.lifecycle_tick(&live).await;
        let running: Vec<(SandboxRecord, Arc<dyn Runtime>, SandboxHandle)> = live
            .into_iter()
            .filter(|r| r.state == SandboxState::Running)
            .filter_map(|r| self.runtime_of(&r).ok().map(|(rt, h)| (r, rt, h)))
            .collect();
        // One blocking task for the whole sweep: with a thousand sandboxes, a task each
        // would cost more than the /proc reads themselves.
        let swept = tokio::task::spawn_blocking(move || {
            let mut dead = Vec::new();
            let mut unknown = Vec::new();
            for (r, rt, h) in running {
                match rt.liveness(&h) {
                    Liveness::Alive => {}
                    Liveness::Dead => dead.push(r),
                    Liveness::Unknown(why) => unknown.push((r.id, why)),
                }
            }
            (dead, unknown)
        })
        .await;
        // A sweep that could not run proves nothing either.
        let Ok((dead, unknown)) = swept else { return };
        if let Some((id, why)) = unknown.first() {
            // Under descriptor or memory pressure /proc cannot be read: the sandboxes are
            // left alone until there is evidence (ENOENT, a zombie, a reused pid).
            tracing::warn!(count = unknown.len(), first = %id, error = %why,
                "cannot tell whether sandboxes are alive; leaving them running");
        }
        for rec in dead {
            self.mark_dead(&rec, "the sandbox's agent exited").await;
        }
    }

    /// Removes a dead sandbox's resources and records it as stopped (why), unless a
    /// delete got to it first: moving the record to `stopping` claims the teardown.
    pub(crate) async fn mark_dead(&self, rec: &SandboxRecord, why: &str) {
        let from = [
            SandboxState::Creating,
            SandboxState::Running,
            SandboxState::Paused,
        ];
        let cur = match self
            .store
            .transition(&rec.id, &from, SandboxState::Stopping, None)
            .await
        {
            Ok(Some(cur)) => cur,
            // Deleted meanwhile: the delete tears it down.
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(id = %rec.id, error = %e, "marking sandbox stopped failed");
                return;
            }
        };
        crate::usage::on_state(self, &cur, SandboxState::Stopping);
        tracing::warn!(id = %cur.id, why, "sandbox stopped; cleaning up");
        let (to, note) = match self.teardown_now(&cur).await {
            Ok(()) => (SandboxState::Stopped, why.to_string()),
            // Left in `error` so that a delete tries the teardown again.
            Err(e) => (SandboxState::Error, format!("{why}; teardown failed: {e}")),
        };
        if cur.owner == POOL_OWNER && to == SandboxState::Stopped {
            // Nobody can ever look at an unclaimed pool member's record.
            let _ = self.store.delete_sandbox(&cur.id).await;
            return;
        }
        if let Err(e) = self
            .store
            .transition(&cur.id, &[SandboxState::Stopping], to, Some(&note))
            .await
        {
            tracing::warn!(id = %cur.id, error = %e, "recording a stopped sandbox failed");
        }
        if !cur.life.layers.is_empty() {
            self.gc_wanted.store(true, Ordering::Release);
        }
    }
}
