//! E2B's REST shapes, field for field as its SDKs send and parse them.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// E2B's error body: the HTTP status as a number and a message.
#[derive(Debug, Serialize)]
pub struct Error {
    pub code: u16,
    pub message: String,
}

/// `autoResume` of a create request.
#[derive(Debug, Default, Deserialize)]
pub struct AutoResume {
    #[serde(default)]
    pub enabled: bool,
}

/// One volume mount of a create request.
#[derive(Debug, Deserialize, Serialize, Clone)]
pub struct VolumeMount {
    pub name: String,
    pub path: String,
}

/// `POST /sandboxes` and `POST /v2/sandboxes`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub timeout: Option<u64>,
    pub auto_pause: Option<bool>,
    pub auto_pause_memory: Option<bool>,
    pub auto_resume: Option<AutoResume>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub env_vars: Option<BTreeMap<String, String>>,
    pub secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub network: Option<serde_json::Value>,
    pub volume_mounts: Option<Vec<VolumeMount>>,
    pub mcp: Option<serde_json::Value>,
    pub iam: Option<serde_json::Value>,
}

/// A created, connected, resumed or forked sandbox.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub alias: String,
    pub envd_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traffic_access_token: Option<String>,
    pub domain: String,
}

/// The lifecycle policy shown by sandbox info.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    pub auto_resume: bool,
    pub on_timeout: String,
}

/// A sandbox in a list (`GET /sandboxes`, `GET /v2/sandboxes`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub alias: String,
    pub started_at: String,
    pub end_at: String,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u64,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: &'static str,
    pub envd_version: String,
    pub metadata: BTreeMap<String, String>,
    pub volume_mounts: Vec<VolumeMount>,
}

/// `GET /sandboxes/{id}`: the listed fields plus what only the owner of one sees.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(flatten)]
    pub listed: ListedSandbox,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    pub domain: String,
    pub lifecycle: Lifecycle,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow_internet_access: Option<bool>,
    /// The network `rules` and `maskRequestHost` the sandbox has (`rules.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<serde_json::Value>,
}

/// `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Deserialize)]
pub struct TimeoutRequest {
    pub timeout: u64,
}

/// `POST /sandboxes/{id}/refreshes`.
#[derive(Debug, Default, Deserialize)]
pub struct RefreshRequest {
    pub duration: Option<u64>,
}

/// `POST /sandboxes/{id}/pause`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PauseRequest {
    pub memory: Option<bool>,
    pub require_healthy_guest: Option<bool>,
}

/// `POST /sandboxes/{id}/connect` and `/v2/.../connect`, and the older `/resume`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectRequest {
    pub timeout: Option<u64>,
    pub memory: Option<bool>,
    pub auto_pause: Option<bool>,
}

/// `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Default, Deserialize)]
pub struct SnapshotRequest {
    pub name: Option<String>,
    pub memory: Option<bool>,
}

/// A snapshot: E2B lists snapshots as templates that new sandboxes can start from.
#[derive(Debug, Serialize)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
}

/// `POST /sandboxes/{id}/fork`.
#[derive(Debug, Default, Deserialize)]
pub struct ForkRequest {
    pub timeout: Option<u64>,
    pub count: Option<u32>,
}

/// One result of a fork: a sandbox, or why that copy failed.
#[derive(Debug, Serialize)]
pub struct ForkResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Sandbox>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Error>,
}

/// One sample of `GET /sandboxes/{id}/metrics`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Metric {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u64,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// One build of a template.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuild {
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub status: String,
    pub created_at: String,
    pub updated_at: String,
    pub cpu_count: u64,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
}

/// A template as `GET /templates` and `GET /templates/{id}` show it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Template {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub cpu_count: u64,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub public: bool,
    pub aliases: Vec<String>,
    pub names: Vec<String>,
    pub created_at: String,
    pub updated_at: String,
    pub created_by: Option<String>,
    pub last_spawned_at: Option<String>,
    pub spawn_count: u64,
    pub build_count: u64,
    pub envd_version: String,
    pub build_status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub builds: Option<Vec<TemplateBuild>>,
}

/// `GET /templates/aliases/{alias}`.
#[derive(Debug, Serialize)]
pub struct TemplateAlias {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub public: bool,
}
