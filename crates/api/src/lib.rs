//! Request and response bodies of the REST API under `/v1`, shared by server and client.
#![forbid(unsafe_code)]

pub mod agents;
pub mod leases;
pub mod metrics;
pub mod network;
pub mod paths;
pub mod secrets;
pub mod templates;
pub mod usage;
pub mod volumes;

pub use agents::{
    AgentModelSpec, AgentRun, AgentRunEvent, AgentRunEventPage, AgentRuntime, Approval,
    ApproveRequest, CreateAgentRequest, CreateWorkspaceRequest, DenyRequest, StartRunRequest,
    Workspace,
};
pub use network::{NetworkAuditEntry, NetworkAuditList, NetworkMode, NetworkPolicy, NetworkRule};
pub use volumes::{CreateVolumeRequest, Volume, VolumeList, VolumeMountSpec};

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

pub use templates::{
    BuildLogLine, BuildTemplateRequest, TemplateBuild, TemplateSettings, TemplateSourceSpec,
};

/// Default port of a local daemon.
pub const DEFAULT_PORT: u16 = 7423;
/// Default URL clients use to reach a local daemon.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7423";

/// Every error: a stable machine-readable code and a human message.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// e.g. `not_found`, `invalid_argument`, `unauthenticated`.
    pub code: String,
    pub message: String,
}

/// Resource limits; omitted fields take the daemon's defaults.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct LimitsSpec {
    pub cpu_millis: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub disk_bytes: Option<u64>,
    pub max_processes: Option<u64>,
}

/// Effective limits of a sandbox.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct Limits {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
    pub max_processes: u64,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// Template name (default `host`).
    pub template: Option<String>,
    /// `container` (default) or `process` (unisolated, development only).
    pub runtime: Option<String>,
    /// Seconds until the sandbox expires (default 300).
    pub timeout: Option<u64>,
    #[serde(default)]
    pub limits: LimitsSpec,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Names of `env` variables whose values are secret: no API response shows them, and
    /// agent runs in the sandbox mask them (values of 4 bytes or more) in their events.
    /// Each must be a key of `env` (or of the snapshot's env when starting from one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_env: Vec<String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Default working directory of commands (default `/home/user`).
    pub workdir: Option<String>,
    /// Default user of commands and file operations: `user` (default) or `root`.
    pub user: Option<String>,
    /// Volumes to mount (a create with volumes never takes a warm pool's sandbox).
    #[serde(default)]
    pub volumes: Vec<VolumeMountSpec>,
    /// Start from this snapshot (id or name): its files, template and runtime.
    pub snapshot: Option<String>,
    /// Seconds without API calls after which the sandbox is paused (daemon default 300;
    /// 0 = never).
    pub idle_timeout: Option<u64>,
    /// What its timeout does: `kill` (default), `pause` (with its memory) or `hibernate`
    /// (only its files).
    pub on_timeout: Option<String>,
    /// Whether a call to a paused or hibernated sandbox resumes it (default true).
    pub auto_resume: Option<bool>,
    /// Whether its envd ports (49983, and 49999 of the code interpreter) through the
    /// proxy need its envd access token (default true; `false` opens them, as in E2B).
    #[serde(default)]
    pub secure: Option<bool>,
    /// Whether its other ports are open to anyone through the proxy (default false: they
    /// need its traffic token or a signed URL).
    #[serde(default)]
    pub public: Option<bool>,
    /// Names of the owner's secrets (`/v1/secrets`) the credential broker may inject into
    /// this sandbox's matching requests.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Egress policy (default: the daemon's `[network] default_mode`, no rules; a
    /// snapshot's policy when starting from one).
    #[serde(default)]
    pub network: Option<NetworkPolicy>,
    /// Give the sandbox a `sudo` that runs a command as its root through the agent, and
    /// a `python` alias of `python3` (default false; container runtime only; E2B's
    /// create sets it as the daemon's `[e2b] sudo` says).
    #[serde(default)]
    pub sudo: Option<bool>,
}

/// Lifecycle settings and state of a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct Lifecycle {
    /// Seconds without API calls before an automatic pause; 0 = never.
    pub idle_timeout: u64,
    /// `kill`, `pause` or `hibernate`.
    pub on_timeout: String,
    pub auto_resume: bool,
    /// Unix ms of the last API call that touched it.
    pub last_activity_ms: i64,
    /// Unix ms when it was paused or hibernated.
    pub paused_at_ms: Option<i64>,
    /// The snapshot its files descend from (the parent of its next incremental snapshot).
    pub snapshot: Option<String>,
}

/// `POST /v1/sandboxes/{id}/pause`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PauseRequest {
    /// Keep memory and processes (`true`, default: a freeze) or only the files (`false`:
    /// processes end, and a resume starts the sandbox again on the same files).
    pub memory: Option<bool>,
}

/// `POST /v1/sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    /// Unique per owner (default: generated).
    pub name: Option<String>,
    /// Store only what changed since the snapshot the sandbox descends from (default
    /// false: a full snapshot). A sandbox that descends from none gets a full one.
    #[serde(default)]
    pub incremental: bool,
}

/// A stored snapshot of a sandbox's files.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Snapshot {
    pub id: String,
    pub name: String,
    pub sandbox_id: String,
    /// The snapshot this one adds to (incremental ones).
    pub parent: Option<String>,
    pub template: String,
    pub runtime: String,
    /// `full` or `incremental`.
    pub kind: String,
    /// Size of the stored archive.
    pub size_bytes: u64,
    pub entries: u64,
    /// sha256 of the stored archive.
    pub digest: String,
    pub created_at_ms: i64,
}

/// `GET /v1/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotList {
    pub items: Vec<Snapshot>,
}

/// `POST /v1/snapshots/{id}/verify`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotCheck {
    /// True when every archive of the chain is present and matches its digest.
    pub ok: bool,
    /// One line per snapshot of the chain, newest first.
    pub chain: Vec<SnapshotCheckItem>,
}

/// The check of one archive.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotCheckItem {
    pub id: String,
    pub ok: bool,
    pub expected_digest: String,
    /// None when the archive is missing.
    pub actual_digest: Option<String>,
    pub error: Option<String>,
}

/// `POST /v1/sandboxes/{id}/fork`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Copies to make (default 1, at most 64).
    pub count: Option<u32>,
    /// Metadata of the copies (default: the source's).
    pub metadata: Option<BTreeMap<String, String>>,
    /// Limits of the copies (default: the source's).
    pub limits: Option<LimitsSpec>,
    /// Timeout of the copies in seconds (default: the daemon's).
    pub timeout: Option<u64>,
}

/// The copies a fork made.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ForkResponse {
    pub items: Vec<Sandbox>,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Sandbox {
    pub id: String,
    pub template: String,
    pub runtime: String,
    /// False for the `process` runtime, which does not isolate anything.
    pub isolated: bool,
    /// creating, running, paused (frozen: memory kept), hibernated (files kept, processes
    /// ended), stopping, stopped or error.
    pub state: String,
    pub limits: Limits,
    pub metadata: BTreeMap<String, String>,
    /// Unix milliseconds.
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub error: Option<String>,
    /// The warm pool this sandbox was claimed from, if it came from one.
    #[serde(default)]
    pub pool: Option<String>,
    pub lifecycle: Lifecycle,
    /// Whether its envd ports need `envd_access_token` (as `X-Access-Token`).
    #[serde(default)]
    pub secure: bool,
    /// Whether its other ports are open to anyone through the proxy.
    #[serde(default)]
    pub public: bool,
    /// Token for its envd ports through the proxy (shown to its owner only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    /// Token for its other ports (`E2B-Traffic-Access-Token`), shown to its owner only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_access_token: Option<String>,
    /// Egress policy (absent where the runtime has no network of its own).
    #[serde(default)]
    pub network: Option<NetworkPolicy>,
}

/// `PATCH /v1/sandboxes/{id}/access`: changes how its ports are exposed.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateAccessRequest {
    /// Open (`true`) or close its non-envd ports to anyone.
    pub public: Option<bool>,
    /// Issue a new traffic token: URLs signed with the old one stop working.
    #[serde(default)]
    pub rotate_traffic_token: bool,
}

/// How a sandbox is exposed through the proxy, and its credentials.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxAccess {
    pub secure: bool,
    pub public: bool,
    pub envd_access_token: String,
    pub traffic_access_token: String,
    /// Host names look like `{port}-{sandbox id}.{domain}`.
    pub domain: String,
}

/// `POST /v1/sandboxes/{id}/ports/{port}/url`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PortUrlRequest {
    /// Seconds the URL stays valid (default 3600, at most 7 days).
    pub expires_in: Option<u64>,
    /// Path and query the URL points at (default `/`).
    pub path: Option<String>,
}

/// A URL that reaches one port of a private sandbox without its traffic token.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PortUrl {
    /// `http://{port}-{id}.{domain}{path}` with the signature in its query.
    pub url: String,
    /// The host name alone.
    pub host: String,
    /// Query parameters that carry the signature (for a client using the header form).
    pub query: String,
    /// Unix seconds after which it is refused.
    pub expires_at: i64,
}

/// One page of `GET /v1/sandboxes`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxList {
    pub items: Vec<Sandbox>,
    /// Pass as `cursor` to get the next page.
    pub next_cursor: Option<String>,
}

/// `POST /v1/sandboxes/{id}/timeout`: the sandbox expires this many seconds from now.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetTimeoutRequest {
    pub timeout: u64,
}

/// Resource usage of a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxStats {
    pub cpu_usage_ns: u64,
    pub memory_current_bytes: u64,
    pub memory_peak_bytes: u64,
    pub pids_current: u64,
}

/// `POST /v1/sandboxes/{id}/commands`, and the first message of a command WebSocket.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCommandRequest {
    /// Program and arguments (no shell; use `["bash","-lc","..."]` for one).
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// `user` (default) or `root`.
    pub user: Option<String>,
    /// Text written to stdin, which is then closed.
    pub stdin: Option<String>,
    /// Kill the command's whole process tree after this many milliseconds.
    pub timeout_ms: Option<u64>,
    /// Cap on captured stdout and stderr each (default 10 MiB, at most 64 MiB).
    pub max_output_bytes: Option<u64>,
    /// Return at once with the pid; reattach later.
    #[serde(default)]
    pub background: bool,
    pub tag: Option<String>,
    /// Run on a pseudo-terminal of this size (WebSocket only).
    pub pty: Option<PtySize>,
}

/// Terminal size.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

/// Result of a command run to completion.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RunCommandResponse {
    pub pid: u32,
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
    pub duration_ms: u64,
    /// True if output beyond `max_output_bytes` was dropped.
    pub truncated: bool,
    /// True if the command was killed by its timeout.
    pub timed_out: bool,
}

/// A command started in the background.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BackgroundCommand {
    pub pid: u32,
}

/// A running command.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CommandInfo {
    pub pid: u32,
    pub tag: Option<String>,
    pub argv: Vec<String>,
    pub cwd: Option<String>,
}

/// `POST /v1/sandboxes/{id}/commands/{pid}/signal`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// `SIGTERM` or `SIGKILL` (which kills the whole process tree).
    pub signal: String,
}

/// `POST /v1/sandboxes/{id}/commands/{pid}/stdin`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StdinRequest {
    #[serde(default)]
    pub data: String,
    /// Close stdin after writing.
    #[serde(default)]
    pub close: bool,
}

/// Messages a client sends on a command WebSocket after the start message.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientMessage {
    /// Base64 bytes for stdin (or the pty).
    Stdin {
        data: String,
    },
    CloseStdin,
    Signal {
        signal: String,
    },
    Resize {
        cols: u16,
        rows: u16,
    },
}

/// Events a command WebSocket delivers; output is base64.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CommandEvent {
    Start { pid: u32 },
    Stdout { data: String },
    Stderr { data: String },
    Pty { data: String },
    End { exit_code: i32, status: String },
    Error { message: String },
}

/// A file or directory.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct EntryInfo {
    pub name: String,
    pub path: String,
    /// `file`, `dir` or `symlink` (a symlink reports its target's type and sets `symlink_target`).
    pub r#type: String,
    pub size: i64,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    pub modified_ms: i64,
    pub symlink_target: Option<String>,
}

/// `POST /v1/sandboxes/{id}/files/mkdir`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PathRequest {
    pub path: String,
}

/// `POST /v1/sandboxes/{id}/files/move` and `/files/copy`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    pub from: String,
    pub to: String,
}

/// A template a sandbox can start from.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct Template {
    pub name: String,
    /// Root filesystem directory; `host` for the host template.
    pub rootfs: String,
    /// `building`, `ready`, `failed` or `deleting`; only ready templates start sandboxes.
    #[serde(default = "templates::ready_state")]
    pub state: String,
    #[serde(flatten)]
    pub settings: TemplateSettings,
    /// Where the root filesystem came from (`None` for the built-in `host`).
    #[serde(default)]
    pub source: Option<TemplateSourceSpec>,
    /// Bytes the root filesystem takes.
    #[serde(default)]
    pub size_bytes: u64,
    /// Why the build failed.
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub build_id: Option<String>,
    /// Unix milliseconds.
    #[serde(default)]
    pub created_at_ms: i64,
    #[serde(default)]
    pub updated_at_ms: i64,
}

/// What a runtime can do.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RuntimeInfo {
    pub name: String,
    pub isolated: bool,
    pub freeze: bool,
    pub stats: bool,
    pub enforces_memory: bool,
    pub enforces_disk: bool,
    pub enforces_processes: bool,
}

/// `GET /v1/info`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DaemonInfo {
    pub version: String,
    pub runtimes: Vec<RuntimeInfo>,
    pub default_runtime: String,
    pub max_timeout: u64,
}

/// `POST /v1/pools`: keep `size` sandboxes of one kind started and idle, ready to claim.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// 1..=64 characters of `[a-zA-Z0-9_-]`.
    pub name: String,
    /// Template name (default `host`).
    pub template: Option<String>,
    /// Runtime (default: the daemon's default runtime).
    pub runtime: Option<String>,
    #[serde(default)]
    pub limits: LimitsSpec,
    /// Idle sandboxes to keep ready: at most the daemon's `[pool_limits] max_size`
    /// (default 64), and all pools' sandboxes' memory limits together within the host's.
    pub size: u32,
}

/// A warm pool and its status. A create whose template, runtime and effective limits
/// equal the pool's claims one of its ready sandboxes.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Pool {
    pub name: String,
    pub template: String,
    pub runtime: String,
    pub limits: Limits,
    /// Target number of idle sandboxes.
    pub size: u32,
    /// Idle sandboxes ready to claim now.
    pub ready: u32,
    /// Sandboxes being started to refill the pool.
    pub starting: u32,
    /// Creates served from the pool.
    pub hits: u64,
    /// Matching creates that found the pool empty and started cold.
    pub misses: u64,
    /// `config` (from the daemon's config file) or `api`.
    pub source: String,
}

/// `GET /v1/pools`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PoolList {
    pub items: Vec<Pool>,
}

/// `PATCH /v1/pools/{name}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizePoolRequest {
    pub size: u32,
}
