//! After a daemon start: live sandboxes are re-adopted, dead and half-made ones cleaned
//! up, interrupted wakes and teardowns finished, and runtime leftovers the store does not
//! know are swept.

use crate::error::CoreError;
use crate::manager::*;
use sandpit_runtime::{Liveness, Runtime, SandboxHandle};
use sandpit_store::SandboxState;
use std::sync::Arc;
use std::time::Duration;

/// A sandbox's liveness, asked a few times over half a second while the answer is
/// `Unknown` (a start under descriptor pressure should not mistake a busy host for death).
pub(crate) async fn settled_liveness(rt: Arc<dyn Runtime>, h: SandboxHandle) -> Liveness {
    let mut last = Liveness::Unknown("not checked".into());
    for attempt in 0..5 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (rt, h) = (rt.clone(), h.clone());
        last = match tokio::task::spawn_blocking(move || rt.liveness(&h)).await {
            Ok(l) => l,
            Err(e) => Liveness::Unknown(format!("liveness check failed: {e}")),
        };
        if !matches!(last, Liveness::Unknown(_)) {
            break;
        }
    }
    last
}

impl Manager {
    /// After a start: re-adopt live sandboxes, clean up dead and half-made ones, and sweep
    /// runtime leftovers that the store does not know.
    pub async fn reconcile(&self) -> Result<(), CoreError> {
        // Archives half-written or half-downloaded when the daemon stopped.
        let tmp = self.cfg.data_dir.join("tmp");
        if tmp.exists()
            && let Err(e) = std::fs::remove_dir_all(&tmp)
        {
            tracing::warn!(dir = %tmp.display(), error = %e, "removing leftover temporary files failed");
        }
        let live = self.store.live_sandboxes().await?;
        let mut keep = Vec::new();
        for rec in live {
            if rec.state == SandboxState::Hibernated {
                // Nothing of it runs; its files are in its layers.
                continue;
            }
            if rec.state == SandboxState::Creating && rec.life.paused_at_ms.is_some() {
                // A wake from hibernation cut short: whatever it started goes, and the
                // sandbox is hibernated again on the files it had.
                tracing::info!(id = %rec.id, "finishing an interrupted wake: back to hibernated");
                if let Err(e) = self.teardown_now(&rec).await {
                    tracing::warn!(id = %rec.id, error = %e, "removing a half-woken sandbox failed");
                }
                let _ = self
                    .store
                    .transition(
                        &rec.id,
                        &[SandboxState::Creating],
                        SandboxState::Hibernated,
                        None,
                    )
                    .await;
                continue;
            }
            let usable = match self.runtime_of(&rec) {
                Ok((rt, h)) => {
                    let (rt2, h2) = (rt.clone(), h.clone());
                    let liveness = settled_liveness(rt2, h2).await;
                    // A paused sandbox's agent is frozen and cannot answer; it is adopted
                    // on the strength of its process alone.
                    let answers = rec.state == SandboxState::Paused
                        || self.conn_for(&rec.id, &h).healthy().await;
                    let settled =
                        !matches!(rec.state, SandboxState::Creating | SandboxState::Stopping);
                    match liveness {
                        Liveness::Alive if settled && answers => {
                            rt.adopt(&h);
                            true
                        }
                        // No evidence either way: keep it (its resources too); the sweep
                        // decides once /proc can be read again.
                        Liveness::Unknown(why) if settled => {
                            tracing::warn!(id = %rec.id, error = %why,
                                "cannot tell whether a sandbox survived; keeping it");
                            rt.adopt(&h);
                            true
                        }
                        _ => false,
                    }
                }
                Err(_) => false,
            };
            if rec.state == SandboxState::Stopping {
                tracing::info!(id = %rec.id, "finishing an interrupted teardown");
                match self.teardown_now(&rec).await {
                    Ok(()) => {
                        let _ = self.store.delete_sandbox(&rec.id).await;
                    }
                    Err(e) => {
                        let _ = self
                            .store
                            .transition(
                                &rec.id,
                                &[SandboxState::Stopping],
                                SandboxState::Error,
                                Some(&format!("teardown failed: {e}")),
                            )
                            .await;
                    }
                }
            } else if usable {
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
