//! Deleting snapshots (refused while a later snapshot builds on them), verifying their
//! stored archives, and sweeping objects no record names after a crash.

use crate::error::CoreError;
use crate::manager::{Manager, now_ms};
use crate::snapshot_store::ARCHIVE;
use crate::snapshots::*;

impl Manager {
    /// Deletes a snapshot; one that others build on is refused unless `force`, which
    /// deletes those too.
    pub async fn delete_snapshot(
        &self,
        owner: &str,
        id_or_name: &str,
        force: bool,
    ) -> Result<Vec<String>, CoreError> {
        let snap = self
            .store
            .get_snapshot(owner, id_or_name)
            .await?
            .ok_or_else(|| CoreError::not_found(format!("snapshot {id_or_name} not found")))?;
        // Children first, depth first, so that no record is left with a missing parent.
        let mut order = Vec::new();
        let mut todo = vec![snap.clone()];
        while let Some(s) = todo.pop() {
            let kids = self.store.snapshot_children(&s.id).await?;
            if !kids.is_empty() && !force {
                return Err(CoreError::conflict(format!(
                    "snapshot {} has dependent snapshots ({}); delete them first or pass force=true",
                    s.id,
                    kids.iter()
                        .map(|k| k.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            order.push(s);
            todo.extend(kids);
        }
        let mut deleted = Vec::new();
        for s in order.into_iter().rev() {
            self.store.delete_snapshot(&s.id).await?;
            self.snapshot_store.delete(&s.id).await;
            deleted.push(s.id);
        }
        self.gc_layers().await;
        Ok(deleted)
    }

    /// Checks that every archive of the snapshot's chain is stored and matches its digest.
    pub async fn verify_snapshot(
        &self,
        owner: &str,
        id_or_name: &str,
    ) -> Result<sandpit_api::SnapshotCheck, CoreError> {
        let chain = self.snapshot_chain(owner, id_or_name).await?;
        let mut items = Vec::new();
        for s in &chain {
            let got = self
                .snapshot_store
                .digest(&self.snapshot_store.key(&s.id, ARCHIVE))
                .await;
            let manifest = self.load_manifest(&s.id).await.err();
            let (actual, mut error) = match got {
                Ok(d) => (Some(d), None),
                Err(e) => (None, Some(e.to_string())),
            };
            if let Some(m) = manifest {
                error.get_or_insert(m.chain());
            }
            let ok = error.is_none() && actual.as_deref() == Some(s.digest.as_str());
            items.push(sandpit_api::SnapshotCheckItem {
                id: s.id.clone(),
                ok,
                expected_digest: s.digest.clone(),
                actual_digest: actual,
                error,
            });
        }
        Ok(sandpit_api::SnapshotCheck {
            ok: items.iter().all(|i| i.ok),
            chain: items,
        })
    }

    /// At start: removes stored archives no snapshot record names (an upload that a crash
    /// cut off before the record was written, or a delete cut off after it).
    pub async fn sweep_snapshot_objects(&self) {
        let (stored, known) = match (
            self.snapshot_store.stored_ids().await,
            self.store.list_snapshots(None).await,
        ) {
            (Ok(s), Ok(k)) => (s, k),
            (Err(e), _) => {
                tracing::warn!(error = %e, "listing stored snapshots failed");
                return;
            }
            (_, Err(e)) => {
                tracing::warn!(error = %e, "listing snapshot records failed");
                return;
            }
        };
        let known: std::collections::HashSet<String> = known.into_iter().map(|s| s.id).collect();
        let now = now_ms();
        for (id, newest) in stored {
            if !known.contains(&id) && now - newest > ORPHAN_AGE_MS {
                tracing::info!(snapshot = %id, "removing stored snapshot objects no record names");
                self.snapshot_store.delete(&id).await;
            }
        }
    }
}
