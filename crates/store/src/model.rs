//! Plain data types stored and returned by [`crate::Store`].

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An API key's public description; the secret itself is never stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKey {
    /// Stable identifier used to list and revoke the key.
    pub id: String,
    /// Principal the key acts as; sandboxes created with it belong to this owner.
    pub owner: String,
    /// Human label chosen at creation.
    pub name: String,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
    /// Last successful authentication, unix milliseconds.
    pub last_used_at_ms: Option<i64>,
}

/// Lifecycle state of a sandbox; `Stopped` and `Error` are final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Being set up by the runtime.
    Creating,
    /// Up and accepting work.
    Running,
    /// Frozen; can be resumed.
    Paused,
    /// No processes; its files are kept and a resume starts it again on them.
    Hibernated,
    /// Being torn down.
    Stopping,
    /// Torn down (final).
    Stopped,
    /// Failed (final); the record's `error` says why.
    Error,
}

impl SandboxState {
    /// Every state, in lifecycle order.
    pub const ALL: [SandboxState; 7] = [
        SandboxState::Creating,
        SandboxState::Running,
        SandboxState::Paused,
        SandboxState::Hibernated,
        SandboxState::Stopping,
        SandboxState::Stopped,
        SandboxState::Error,
    ];

    /// States from which a sandbox never leaves.
    pub const FINAL: [SandboxState; 2] = [SandboxState::Stopped, SandboxState::Error];

    /// The lowercase name used in storage and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Hibernated => "hibernated",
            SandboxState::Stopping => "stopping",
            SandboxState::Stopped => "stopped",
            SandboxState::Error => "error",
        }
    }

    /// Whether the state is terminal (`Stopped` or `Error`).
    pub fn is_final(self) -> bool {
        matches!(self, SandboxState::Stopped | SandboxState::Error)
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Returned when a string names no [`SandboxState`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown sandbox state {0:?}")]
pub struct ParseSandboxStateError(pub String);

impl FromStr for SandboxState {
    type Err = ParseSandboxStateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SandboxState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| ParseSandboxStateError(s.to_string()))
    }
}

/// One sandbox as persisted; the runtime re-adopts it after a restart from `runtime_state`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// Unique id.
    pub id: String,
    /// Owner (the API key's owner that created it).
    pub owner: String,
    /// Template name the root filesystem came from.
    pub template: String,
    /// Runtime backend name that manages it.
    pub runtime: String,
    /// Lifecycle state; change it only through [`crate::Store::transition`].
    pub state: SandboxState,
    /// CPU limit in thousandths of a core.
    pub cpu_millis: i64,
    /// Memory limit in bytes.
    pub memory_bytes: i64,
    /// Disk limit in bytes.
    pub disk_bytes: i64,
    /// Maximum number of processes.
    pub max_processes: i64,
    /// Environment variables given to processes in the sandbox.
    pub env: BTreeMap<String, String>,
    /// Names of the `env` variables whose values are secret: the API never shows them
    /// and agent runs mask them in their events.
    #[serde(default)]
    pub secret_env: BTreeSet<String>,
    /// Caller-defined labels, filterable in listings.
    pub metadata: BTreeMap<String, String>,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
    /// Last modification time, unix milliseconds.
    pub updated_at_ms: i64,
    /// Time after which the reaper may stop it, unix milliseconds.
    pub expires_at_ms: i64,
    /// Opaque data the runtime needs to re-adopt the sandbox (host pid, uid range...).
    pub runtime_state: serde_json::Value,
    /// Why the sandbox failed, when it did.
    pub error: Option<String>,
    /// Counts state transitions; lets callers detect that a record changed under them.
    pub version: i64,
    /// The warm pool it idles in (while `owner` is empty) or was claimed from.
    #[serde(default)]
    pub pool: Option<String>,
    /// Idle rules, layers and lineage.
    #[serde(default)]
    pub life: Lifecycle,
}

/// What a sandbox does when its TTL passes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    /// Destroy it (the default).
    #[default]
    Kill,
    /// Pause it (and hibernate it later, as the daemon's settings say).
    Pause,
    /// Hibernate it: keep only its files, as E2B's `autoPauseMemory: false` asks.
    Hibernate,
}

/// Lifecycle settings and state of a sandbox beyond its state machine.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Lifecycle {
    /// Read-only layers under its writable one (ids of directories the daemon keeps),
    /// top first: what it was restored, forked or hibernated from.
    pub layers: Vec<String>,
    /// The snapshot its files descend from: the parent of its next incremental snapshot.
    pub snapshot: Option<String>,
    /// Unix ms of the last API call that touched it.
    pub last_activity_ms: i64,
    /// Seconds without API calls after which it is paused; 0 = never.
    pub idle_timeout_secs: u64,
    /// What its TTL does.
    pub on_timeout: OnTimeout,
    /// Whether a call to it while paused or hibernated resumes it.
    pub auto_resume: bool,
    /// Unix ms when it was last paused or hibernated.
    pub paused_at_ms: Option<i64>,
    /// Default working directory and user of its commands (kept for a hibernated
    /// sandbox's restart).
    pub workdir: Option<String>,
    /// Default user of its commands.
    pub user: Option<String>,
    /// Its lifetime in seconds, given again when a resume follows a timeout pause.
    pub timeout_secs: u64,
    /// Whether it has `sudo` through its agent and the `python` alias (kept for every
    /// later boot: wake, fork).
    pub sudo: bool,
}

/// A warm pool: how many idle sandboxes of one kind to keep started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRecord {
    /// Unique pool name.
    pub name: String,
    /// Template its sandboxes start from.
    pub template: String,
    /// Runtime its sandboxes run in.
    pub runtime: String,
    /// CPU limit of its sandboxes, thousandths of a core.
    pub cpu_millis: i64,
    /// Memory limit of its sandboxes in bytes.
    pub memory_bytes: i64,
    /// Disk limit of its sandboxes in bytes.
    pub disk_bytes: i64,
    /// Process limit of its sandboxes.
    pub max_processes: i64,
    /// Idle sandboxes to keep ready.
    pub size: i64,
    /// `config` or `api`: who declared it.
    pub source: String,
    /// Creates served from the pool.
    pub hits: i64,
    /// Matching creates that found it empty.
    pub misses: i64,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
}

/// Criteria for [`crate::Store::list_sandboxes`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxFilter {
    /// Only this owner's sandboxes.
    pub owner: Option<String>,
    /// Only sandboxes in one of these states; empty means any state.
    pub states: Vec<SandboxState>,
    /// Every pair must be present in the sandbox's metadata with exactly this value.
    pub metadata: Vec<(String, String)>,
    /// Page size; 0 means 100, otherwise clamped to 1..=1000.
    pub limit: u32,
    /// Opaque `next_cursor` from a previous page.
    pub cursor: Option<String>,
    /// Newest first (creation time, then id, both descending) instead of oldest first. A
    /// cursor continues in the order of the filter it is used with.
    pub newest_first: bool,
    /// Only sandboxes created at or after this time (unix ms).
    pub created_from_ms: Option<i64>,
    /// Only sandboxes of this template.
    pub template: Option<String>,
}

/// One page of [`crate::Store::list_sandboxes`].
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxPage {
    /// Matching sandboxes ordered by creation time, then id (descending when the filter
    /// asks for the newest first).
    pub items: Vec<SandboxRecord>,
    /// Cursor for the next page; `None` when this page is the last.
    pub next_cursor: Option<String>,
}

/// A stored snapshot of a sandbox's files: one layer archive, full or over its parent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// Unique id.
    pub id: String,
    /// Owner (the sandbox's owner).
    pub owner: String,
    /// Unique per owner.
    pub name: String,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// The snapshot this one adds to (incremental), if any.
    pub parent: Option<String>,
    /// Template under the layers.
    pub template: String,
    /// Runtime of the sandbox it was taken of.
    pub runtime: String,
    /// `full` or `incremental`.
    pub kind: String,
    /// Size of the stored archive in bytes.
    pub size_bytes: i64,
    /// Entries in the archive.
    pub entries: i64,
    /// sha256 of the stored archive, hex.
    pub digest: String,
    /// The sandbox's settings at the time (limits, env, workdir, user), JSON.
    pub settings: serde_json::Value,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
}

/// A named root filesystem sandboxes are created from, with the settings they start with.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateRecord {
    /// Unique template name.
    pub name: String,
    /// Path of the root filesystem directory on the host.
    pub rootfs: String,
    /// Registration time, unix milliseconds.
    pub created_at_ms: i64,
    /// `user` or `root`: who commands run as when a create names nobody.
    #[serde(default)]
    pub default_user: Option<String>,
    /// Working directory of commands when a create names none.
    #[serde(default)]
    pub workdir: Option<String>,
    /// Environment every sandbox of the template starts with (a create's own values win).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Shell command started in the background once a sandbox's agent is up.
    #[serde(default)]
    pub start_cmd: Option<String>,
    /// Shell command run until it exits 0 before a sandbox counts as ready.
    #[serde(default)]
    pub ready_cmd: Option<String>,
    /// How long the readiness check may keep failing (`None`: the daemon's default).
    #[serde(default)]
    pub ready_timeout_secs: Option<i64>,
    /// Where the root filesystem came from (JSON; `null` for a directory registered in place).
    #[serde(default)]
    pub source: serde_json::Value,
    /// Bytes the root filesystem takes (0 when unknown).
    #[serde(default)]
    pub size_bytes: i64,
    /// Build state; only `ready` templates start sandboxes.
    #[serde(default)]
    pub state: TemplateState,
    /// Why the build failed, when it did.
    #[serde(default)]
    pub error: Option<String>,
    /// Last change, unix milliseconds.
    #[serde(default)]
    pub updated_at_ms: i64,
    /// The build that made (or is making) the root filesystem.
    #[serde(default)]
    pub build_id: Option<String>,
}

/// Build state of a template.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TemplateState {
    /// Its root filesystem is being made.
    Building,
    /// Usable.
    #[default]
    Ready,
    /// The build failed; the record says why and nothing of the build is left on disk.
    Failed,
    /// Being removed (no new sandbox may start from it).
    Deleting,
}

impl TemplateState {
    /// Every state.
    pub const ALL: [TemplateState; 4] = [
        TemplateState::Building,
        TemplateState::Ready,
        TemplateState::Failed,
        TemplateState::Deleting,
    ];

    /// The lowercase name used in storage and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            TemplateState::Building => "building",
            TemplateState::Ready => "ready",
            TemplateState::Failed => "failed",
            TemplateState::Deleting => "deleting",
        }
    }
}

impl fmt::Display for TemplateState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TemplateState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TemplateState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| format!("unknown template state {s:?}"))
    }
}
