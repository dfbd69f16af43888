//! Snapshots of a sandbox's files: capture (full, or incremental over the snapshot the
//! sandbox descends from), storage in a local directory or an S3-compatible object store,
//! restore as read-only layers, integrity checks, deletion along chains; and forks.

use crate::error::CoreError;
use crate::manager::Manager;
pub use crate::snapshot_store::{SnapshotStore, SnapshotStoreConfig};
use sandpit_store::{SandboxRecord, SnapshotRecord};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Most entries and bytes a restored archive may hold.
pub(crate) const UNPACK_LIMITS: sandpit_image::UnpackLimits = sandpit_image::UnpackLimits {
    max_entries: 2_000_000,
    max_bytes: 64 << 30,
};
/// Most copies one fork makes.
pub const MAX_FORK: u32 = 64;

/// The layer directory a snapshot's archive is unpacked into.
pub fn cache_layer_id(snapshot: &str) -> String {
    format!("snap-{snapshot}")
}

/// The settings a sandbox restored from a snapshot starts with.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub(crate) struct Settings {
    pub(crate) env: BTreeMap<String, String>,
    /// Names of `env` variables whose values are secret.
    pub(crate) secret_env: BTreeSet<String>,
    pub(crate) limits: sandpit_api::LimitsSpec,
    pub(crate) workdir: Option<String>,
    pub(crate) user: Option<String>,
    /// Egress policy of the sandbox when it was taken.
    pub(crate) network: Option<sandpit_api::NetworkPolicy>,
}

/// Snapshot names: 1 to 128 of `[A-Za-z0-9._-]`, not starting with `.`.
pub fn snapshot_name_ok(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 128
        && !n.starts_with('.')
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The API view of a snapshot record.
pub fn to_api(s: &SnapshotRecord) -> sandpit_api::Snapshot {
    sandpit_api::Snapshot {
        id: s.id.clone(),
        name: s.name.clone(),
        sandbox_id: s.sandbox_id.clone(),
        parent: s.parent.clone(),
        template: s.template.clone(),
        runtime: s.runtime.clone(),
        kind: s.kind.clone(),
        size_bytes: s.size_bytes.max(0) as u64,
        entries: s.entries.max(0) as u64,
        digest: s.digest.clone(),
        created_at_ms: s.created_at_ms,
    }
}

impl Manager {
    pub(crate) fn tmp_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("tmp")
    }
}

impl Manager {
    /// A template build's source from a snapshot: its chain unpacked (checked against
    /// its digests), and the snapshot's env, workdir and user where the build request
    /// names none. The admin may name any owner's snapshot by id, its own also by name.
    pub async fn snapshot_template_source(
        &self,
        admin: &str,
        snapshot: &str,
        mut req: sandpit_api::BuildTemplateRequest,
    ) -> Result<
        (
            sandpit_api::BuildTemplateRequest,
            Option<crate::templates::Source>,
        ),
        CoreError,
    > {
        let owner = match self.store.get_snapshot(admin, snapshot).await? {
            Some(s) => s.owner,
            None => self
                .store
                .list_snapshots(None)
                .await?
                .into_iter()
                .find(|s| s.id == snapshot)
                .map(|s| s.owner)
                .ok_or_else(|| CoreError::not_found(format!("snapshot {snapshot} not found")))?,
        };
        let chain = self.snapshot_chain(&owner, snapshot).await?;
        let mut from = Vec::new();
        for s in &chain {
            from.push(self.layer_path(&self.ensure_cached(s).await?)?);
        }
        let top = &chain[0];
        let settings: Settings = serde_json::from_value(top.settings.clone()).unwrap_or_default();
        if req.env.is_empty() {
            // A template shows its env to anyone who can read it: secret values stay out.
            req.env = settings.env;
            req.env.retain(|k, _| !settings.secret_env.contains(k));
        }
        req.workdir = req.workdir.or(settings.workdir);
        req.default_user = req.default_user.or(settings.user);
        req.source = sandpit_api::TemplateSourceSpec::Snapshot {
            snapshot: top.id.clone(),
            base: Some(top.template.clone()),
        };
        Ok((
            req,
            Some(crate::templates::Source::Layers {
                from,
                base: top.template.clone(),
            }),
        ))
    }
}

/// Objects younger than this are left by the orphan sweep: an upload may be under way.
pub(crate) const ORPHAN_AGE_MS: i64 = 10 * 60 * 1000;

impl Manager {}

/// A snapshot's layers and settings, ready for a create.
pub(crate) struct Restore<'a> {
    pub snapshot: SnapshotRecord,
    pub layers: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// Names of `env` variables whose values are secret.
    pub secret_env: BTreeSet<String>,
    pub limits: sandpit_api::LimitsSpec,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub network: Option<sandpit_api::NetworkPolicy>,
    pub(crate) _pins: Vec<crate::lifecycle::Pin<'a>>,
}

/// The limits of a record, as a request would give them.
pub(crate) fn limits_of(rec: &SandboxRecord) -> sandpit_api::LimitsSpec {
    sandpit_api::LimitsSpec {
        cpu_millis: Some(rec.cpu_millis as u64),
        memory_bytes: Some(rec.memory_bytes as u64),
        disk_bytes: Some(rec.disk_bytes as u64),
        max_processes: Some(rec.max_processes as u64),
    }
}

/// What the sandbox's own files cause (names a layer cannot hold, a corrupt archive) is
/// the caller's to fix (422); the host's i/o failing is ours.
pub(crate) fn image_err(e: sandpit_image::ImageError) -> CoreError {
    if e.is_input_error() {
        CoreError::Unprocessable {
            code: "failed_precondition",
            message: format!("the files cannot be captured or restored: {e}"),
        }
    } else {
        CoreError::Image(e)
    }
}
