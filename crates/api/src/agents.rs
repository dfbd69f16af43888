//! Agent runtimes (a coding-agent harness in a sandbox), their runs, and run events.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Where a runtime's harness reaches its model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentModelSpec {
    /// The URL the wire API's paths are relative to (for Chat Completions the one ending
    /// in `/v1`). It must be reachable through the sandbox's egress policy.
    pub base_url: String,
    /// The model id to ask for.
    pub model: String,
    /// A broker secret (placeholder form) holding the API key: the harness is given only
    /// its placeholder, which the broker swaps for the key on the way out. Without one
    /// the harness gets a fixed dummy key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret: Option<String>,
    /// `chat_completions`, `responses` or `anthropic_messages`; by default the harness's
    /// own (pi and opencode: chat_completions, claude: anthropic_messages, codex:
    /// responses). For
    /// `anthropic_messages` `base_url` is the URL before `/v1/messages`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<String>,
}

/// `POST /v1/sandboxes/{id}/agents`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateAgentRequest {
    /// `pi`, `opencode`, `claude` or `codex`.
    pub harness: String,
    /// The model endpoint.
    pub model: AgentModelSpec,
    /// Which actions of its runs wait for a person: `{"egress": true, "credentials":
    /// [{"name": "github", "methods": ["POST"]}], "harness_permissions": true,
    /// "timeout_secs": 300}`. `harness_permissions` needs a harness that can ask (pi,
    /// opencode, claude; codex is refused with 400).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub approval_policy: Option<serde_json::Value>,
}

/// An agent runtime.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AgentRuntime {
    pub id: String,
    pub sandbox_id: String,
    pub harness: String,
    pub model: AgentModelSpec,
    /// The approval policy as stored.
    #[schema(value_type = Object)]
    pub approval_policy: serde_json::Value,
    /// `active` or `ended`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub created_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<i64>,
}

/// `POST /v1/agents/{id}/runs`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StartRunRequest {
    /// The task (prompt).
    pub task: String,
    /// `fresh` (default) or `continue`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Retries with the same key return the same run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Wall-clock limit of the run in seconds (at least 1); past it the run ends
    /// `timed_out`. The daemon's `[agents] max_run_secs` (default 7 days) caps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub timeout_secs: Option<u64>,
}

/// A run of an agent runtime.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AgentRun {
    pub id: String,
    pub runtime_id: String,
    pub sandbox_id: String,
    /// 1 for the runtime's first run, then 2, 3, ...
    pub number: i64,
    pub task: String,
    pub mode: String,
    /// `queued`, `running`, `waiting_approval`, `succeeded`, `failed`, `cancelled` or
    /// `timed_out`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_run_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    pub created_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<i64>,
    /// Events stored so far.
    pub events: i64,
    /// Events refused because the run reached its cap.
    pub events_dropped: i64,
}

/// One stored run event: numbered from 1 without gaps, stored before it is served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AgentRunEvent {
    pub seq: i64,
    pub at_ms: i64,
    pub kind: String,
    #[schema(value_type = Object)]
    pub payload: serde_json::Value,
}

/// `GET /v1/runs/{id}/events`: the events after `after`, in order.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AgentRunEventPage {
    pub events: Vec<AgentRunEvent>,
    /// The sequence to pass as `after` for the next page.
    pub next_after: i64,
    /// The run is finished and every event is in this page or before it.
    pub complete: bool,
}

/// `POST /v1/workspaces`: a sandbox and an agent runtime in it, made in one call. The
/// sandbox fields are those of [`crate::CreateSandboxRequest`] an agent's sandbox needs;
/// the rest are the runtime's ([`CreateAgentRequest`]).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWorkspaceRequest {
    /// Template name (default `host`; another template must carry the harness, as one built
    /// by `scripts/build-agent-template.sh` does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Seconds until the sandbox expires (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    #[serde(default)]
    pub limits: crate::LimitsSpec,
    /// Environment of the sandbox's commands.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Names of `env` variables whose values are secret (see
    /// [`crate::CreateSandboxRequest::secret_env`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_env: Vec<String>,
    #[serde(default)]
    pub metadata: std::collections::BTreeMap<String, String>,
    /// Names of the owner's secrets the broker may inject (the model key's among them).
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Egress policy; the model's address must be allowed by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::NetworkPolicy>,
    /// `pi`, `opencode`, `claude` or `codex`.
    pub harness: String,
    /// The model endpoint.
    pub model: AgentModelSpec,
    /// The runtime's approval policy (see [`CreateAgentRequest::approval_policy`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub approval_policy: Option<serde_json::Value>,
}

/// A workspace: the sandbox and the agent runtime made in it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Workspace {
    pub sandbox: crate::Sandbox,
    pub agent: AgentRuntime,
}

/// A run's request for a person's decision on a risky action.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Approval {
    pub id: String,
    pub run_id: String,
    pub runtime_id: String,
    pub sandbox_id: String,
    /// `egress`, `credential` or `harness_permission`.
    pub capability: String,
    /// Destination `host:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The credential's name, or for a harness permission the tool the harness asks to use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub summary: String,
    /// `once` or `run`.
    pub scope: String,
    /// `pending`, `approved`, `denied`, `expired` or `abandoned` (what asked went away
    /// before a decision: a held connection's client closed it, the harness stopped).
    pub state: String,
    /// Why it was denied (the approver's words) or abandoned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The id of the API key that decided (`insecure-no-auth` on a daemon without keys);
    /// none for an expiry or an abandonment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at_ms: Option<i64>,
    pub expires_at_ms: i64,
    pub created_at_ms: i64,
}

/// `POST /v1/approvals/{id}/approve`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApproveRequest {
    /// `once` (default): this action; `run`: the same capability and target for the rest
    /// of the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
}

/// `POST /v1/approvals/{id}/deny`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DenyRequest {
    /// Told to the sandbox with the refusal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}
