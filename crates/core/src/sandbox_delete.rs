//! Deleting a sandbox: gone for callers at once, torn down exactly once in the background
//! (runtime, network, mounts, files), the record removed when the teardown is done.

use crate::error::CoreError;
use crate::manager::*;
use sandpit_runtime::{Runtime, SandboxHandle};
use sandpit_store::{SandboxRecord, SandboxState};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// `Runtime::destroy` on a blocking thread.
pub(crate) async fn run_destroy(rt: Arc<dyn Runtime>, h: SandboxHandle) -> Result<(), CoreError> {
    Ok(tokio::task::spawn_blocking(move || rt.destroy(&h)).await??)
}

/// Waits until `count` is zero, or `max` has passed.
pub(crate) async fn wait_for_zero(count: &AtomicUsize, max: Duration) {
    let deadline = tokio::time::Instant::now() + max;
    while count.load(Ordering::Acquire) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl Manager {
    /// Makes a sandbox unreachable at once and removes its resources and record in the
    /// background. A crash before that finishes leaves a `stopping` record, which the next
    /// start's reconcile finishes off.
    pub async fn destroy(&self, rec: &SandboxRecord) -> Result<(), CoreError> {
        // The state change is the claim on the teardown: whoever moves the record to
        // `stopping` tears the sandbox down, so it happens exactly once. `stopped` means
        // the resources are gone already (the liveness sweep removed them).
        let from = [
            SandboxState::Creating,
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Hibernated,
            SandboxState::Error,
        ];
        let Some(cur) = self
            .store
            .transition(&rec.id, &from, SandboxState::Stopping, None)
            .await?
        else {
            if let Some(now) = self.store.get_sandbox(&rec.id).await?
                && now.state == SandboxState::Stopped
            {
                self.store.delete_sandbox(&rec.id).await?;
            }
            return Ok(());
        };
        crate::usage::on_state(self, &cur, SandboxState::Stopping);
        self.end_sandbox_agents(&cur.id).await;
        self.forget(&cur.id);
        self.pools.forget(&cur.id);
        // Set once the record is gone: its layers are unused from then on.
        let gc = (!cur.life.layers.is_empty()).then(|| self.gc_wanted.clone());
        let store = self.store.clone();
        let id = cur.id.clone();
        // The handle comes from the row just changed: a copy read before the create
        // finished may not have it yet.
        match (self.runtime(&cur.runtime).cloned(), handle_of(&cur)) {
            (Ok(rt), Some(h)) => {
                rt.begin_stop(&h);
                let teardowns = self.teardowns.clone();
                teardowns.fetch_add(1, Ordering::AcqRel);
                tokio::spawn(async move {
                    let done = match run_destroy(rt, h).await {
                        Ok(()) => store.delete_sandbox(&id).await.map(drop),
                        Err(why) => {
                            let why = why.chain();
                            tracing::error!(id, error = %why, "tearing down a sandbox failed");
                            store
                                .transition(
                                    &id,
                                    &[SandboxState::Stopping],
                                    SandboxState::Error,
                                    Some(&why),
                                )
                                .await
                                .map(drop)
                        }
                    };
                    if let Err(e) = done {
                        tracing::warn!(id, error = %e, "recording a teardown failed");
                    }
                    if let Some(gc) = gc {
                        gc.store(true, Ordering::Release);
                    }
                    teardowns.fetch_sub(1, Ordering::AcqRel);
                });
            }
            // Never started (or its create is still under way and will find the record
            // gone and clean up after itself).
            _ => {
                self.store.delete_sandbox(&id).await?;
                if let Some(gc) = gc {
                    gc.store(true, Ordering::Release);
                }
            }
        }
        Ok(())
    }

    pub(crate) async fn destroy_ids(&self, ids: Vec<String>) {
        for id in ids {
            match self.store.get_sandbox(&id).await {
                Ok(Some(rec)) => {
                    if let Err(e) = self.destroy(&rec).await {
                        tracing::warn!(id, error = %e.chain(), "destroying an idle pool member failed");
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(id, error = %e, "reading an idle pool member failed"),
            }
        }
    }

    /// Removes a sandbox's resources and waits for it.
    pub(crate) async fn teardown_now(&self, rec: &SandboxRecord) -> Result<(), CoreError> {
        self.forget(&rec.id);
        self.pools.forget(&rec.id);
        match self.runtime_of(rec) {
            Ok((rt, h)) => run_destroy(rt, h).await.inspect_err(|e| {
                tracing::warn!(id = %rec.id, error = %e, "teardown failed");
            }),
            Err(_) => Ok(()),
        }
    }

    /// Waits (up to `max`) for background teardowns to finish; what is left is finished by
    /// the next start's reconcile.
    pub async fn drain_teardowns(&self, max: Duration) {
        wait_for_zero(&self.teardowns, max).await;
    }
}
