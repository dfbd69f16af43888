//! Agent runtimes: a coding-agent harness set up in one sandbox of the caller's, which
//! runs are started on ([`crate::agent_run`]). Owner-scoped: another owner's runtime is
//! not found. A sandbox whose template carries the harness at [`TEMPLATE_HARNESSES`]
//! (`scripts/build-agent-template.sh` builds such a template) runs that one; otherwise the
//! harness packages come from the host, bound read-only into `host` sandboxes at
//! [`HARNESS_MOUNT`] (see [`AgentsConfig`]).

use crate::error::CoreError;
use crate::manager::{Manager, new_id};
use sandpit_agentrun::{Harness, WireApi};
use sandpit_api::AgentModelSpec;
use sandpit_store::{AgentRuntimeRecord, NewAgentRuntime, SandboxRecord};
use std::path::PathBuf;
use std::sync::Arc;

/// Bounds on a run's events (`[agents]` `max_events_per_run`, `max_string_bytes`, ...).
pub use sandpit_agentrun::Limits as EventLimits;

/// Where the harness directory appears inside a `host` sandbox.
pub const HARNESS_MOUNT: &str = "/opt/sandpit/harnesses";
/// Where a template carries its own harness installs (`node_modules/.bin/pi`, ...): a
/// sandbox of such a template needs no host bind (and no `[agents] harness_dir`).
pub const TEMPLATE_HARNESSES: &str = "/opt/sandpit/template-harnesses";
/// Key given to a harness whose runtime names no secret (the model server needs none).
pub const NO_KEY: &str = "sandpit-no-key";

/// Default hard cap on a run's wall-clock time (`[agents] max_run_secs`): 7 days.
pub const DEFAULT_MAX_RUN: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// Default grace period between the SIGTERM and the SIGKILL of a cancelled or timed-out
/// run's processes (`[agents] cancel_grace_secs`).
pub const DEFAULT_CANCEL_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
/// The longest grace period allowed: a cancel request waits for it.
pub const MAX_CANCEL_GRACE: std::time::Duration = sandpit_abi::MAX_SUPERVISE_GRACE;

/// Daemon settings for agent runs (`[agents]`).
#[derive(Debug, Clone)]
pub struct AgentsConfig {
    /// Host directory holding the harness installs (`node_modules/.bin/pi`, ...), as
    /// `scripts/setup.sh --harnesses` makes it; bound read-only at [`HARNESS_MOUNT`].
    /// `None`: no harness can run.
    pub harness_dir: Option<PathBuf>,
    /// Longest a run may take, whatever its own `timeout_secs`; past it, `timed_out`.
    pub max_run: std::time::Duration,
    /// Bounds on each run's events (count per run, string length, nesting, size).
    pub event_limits: EventLimits,
    /// How long a cancelled or timed-out run's processes get between SIGTERM and SIGKILL.
    pub cancel_grace: std::time::Duration,
}

impl Default for AgentsConfig {
    fn default() -> Self {
        Self {
            harness_dir: None,
            max_run: DEFAULT_MAX_RUN,
            event_limits: EventLimits::default(),
            cancel_grace: DEFAULT_CANCEL_GRACE,
        }
    }
}

/// The harnesses this daemon drives (opencode through a bridge to its `serve` mode).
const DRIVEN: [Harness; 4] = [
    Harness::Pi,
    Harness::OpenCode,
    Harness::Claude,
    Harness::Codex,
];

/// The wire API of a runtime's model: the one its spec names, else the harness's own
/// default. A harness that cannot speak it is refused, so a runtime is never created that
/// no run of could start.
pub(crate) fn wire_api(harness: Harness, spec: &AgentModelSpec) -> Result<WireApi, CoreError> {
    let api = match spec.api.as_deref() {
        None => return Ok(harness.default_api()),
        Some("chat_completions") => WireApi::ChatCompletions,
        Some("responses") => WireApi::Responses,
        Some("anthropic_messages") => WireApi::AnthropicMessages,
        Some(other) => {
            return Err(CoreError::invalid(format!(
                "unknown model api {other:?}: use chat_completions, responses or anthropic_messages"
            )));
        }
    };
    if !harness.speaks(api) {
        return Err(CoreError::invalid(format!(
            "harness {harness} cannot use a {} model endpoint (its api is {})",
            api.as_str(),
            harness.default_api().as_str()
        )));
    }
    Ok(api)
}

/// The model spec a runtime was created with.
pub(crate) fn model_of(rec: &AgentRuntimeRecord) -> Result<AgentModelSpec, CoreError> {
    serde_json::from_value(rec.model.clone())
        .map_err(|e| CoreError::internal_from(format!("agent runtime {}: model", rec.id), e))
}

/// The program a run of runtime `rt` starts: the template's own install when the
/// runtime was created on a template carrying it (`harness_template` is set), else the
/// host's, mounted at [`HARNESS_MOUNT`].
pub(crate) fn harness_program(rt: &AgentRuntimeRecord, harness: Harness) -> String {
    let root = if rt.harness_template.is_some() {
        TEMPLATE_HARNESSES
    } else {
        HARNESS_MOUNT
    };
    format!("{root}/node_modules/.bin/{}", harness.program())
}

/// The API view of a runtime.
pub fn to_api(rec: &AgentRuntimeRecord) -> Result<sandpit_api::AgentRuntime, CoreError> {
    Ok(sandpit_api::AgentRuntime {
        id: rec.id.clone(),
        sandbox_id: rec.sandbox_id.clone(),
        harness: rec.harness.clone(),
        model: model_of(rec)?,
        approval_policy: rec.approval_policy.clone(),
        state: rec.state.as_str().into(),
        reason: rec.reason.clone(),
        created_at_ms: rec.created_at_ms,
        ended_at_ms: rec.ended_at_ms,
    })
}

impl Manager {
    /// Creates a runtime for `harness` in the caller's running sandbox `sandbox_id`.
    pub async fn create_agent_runtime(
        &self,
        owner: &str,
        sandbox_id: &str,
        req: &sandpit_api::CreateAgentRequest,
    ) -> Result<AgentRuntimeRecord, CoreError> {
        let harness = self.check_agent_request(req)?;
        let approval_policy =
            crate::approvals::checked_policy(req.approval_policy.as_ref(), &self.cfg.approvals)?;
        if approval_policy
            .get("harness_permissions")
            .and_then(serde_json::Value::as_bool)
            == Some(true)
            && !harness.can_ask_permission()
        {
            return Err(CoreError::invalid(format!(
                "approval_policy: harness_permissions: {harness} cannot put its tool use to \
                 sandpit when run headless; use pi, opencode or claude, or gate egress and \
                 credentials instead"
            )));
        }
        let sandbox = self.get(owner, sandbox_id).await?;
        let harness_template = self.harness_source(owner, &sandbox, harness).await?;
        if let Some(secret) = &req.model.api_key_secret {
            self.broker
                .check_names(owner, std::slice::from_ref(secret))
                .await?;
        }
        let rec = self
            .store
            .insert_agent_runtime(&NewAgentRuntime {
                id: format!("agt{}", new_id()),
                sandbox_id: sandbox.id.clone(),
                owner: owner.to_string(),
                harness: harness.as_str().into(),
                harness_version: None,
                harness_template,
                approval_policy,
                model: serde_json::to_value(&req.model)
                    .map_err(|e| CoreError::internal_from("model spec", e))?,
            })
            .await
            .map_err(|e| match e {
                sandpit_store::StoreError::NotFound(_) => CoreError::sandbox_not_found(sandbox_id),
                other => other.into(),
            })?;
        Ok(rec)
    }

    /// The checks of a runtime request that need no sandbox: the harness, the model
    /// spec, and a configured harness directory.
    fn check_agent_request(
        &self,
        req: &sandpit_api::CreateAgentRequest,
    ) -> Result<Harness, CoreError> {
        let harness: Harness = req
            .harness
            .parse()
            .map_err(|e: sandpit_agentrun::LaunchError| CoreError::invalid(e.to_string()))?;
        if !DRIVEN.contains(&harness) {
            return Err(CoreError::invalid(format!(
                "harness {harness} is not driven yet (supported: {})",
                DRIVEN.map(Harness::as_str).join(", ")
            )));
        }
        wire_api(harness, &req.model)?;
        if req.model.base_url.is_empty() || req.model.model.is_empty() {
            return Err(CoreError::invalid(
                "model.base_url and model.model are required",
            ));
        }
        Ok(harness)
    }

    /// Where runs of `harness` in `sandbox` find it: `Some(template)` when the sandbox's
    /// template carries it at [`TEMPLATE_HARNESSES`] (preferred: it needs no host bind),
    /// `None` for the host's install bound into `host` sandboxes. Refused when neither
    /// is there.
    async fn harness_source(
        &self,
        owner: &str,
        sandbox: &SandboxRecord,
        harness: Harness,
    ) -> Result<Option<String>, CoreError> {
        if sandbox.runtime != "container" {
            return Err(CoreError::invalid(
                "agent runtimes need a container sandbox",
            ));
        }
        if sandbox.template == "host" {
            // The host template's files are the host's: it carries no harness of its own.
            self.check_host_harnesses()?;
            return Ok(None);
        }
        let program = format!(
            "{TEMPLATE_HARNESSES}/node_modules/.bin/{}",
            harness.program()
        );
        let (_, conn) = self.agent(owner, &sandbox.id).await?;
        // Asked inside the sandbox, so the template's symlinks (`.bin/pi` is one) resolve
        // there and never on the host; the program runs as the sandbox's user anyway.
        let req = sandpit_api::RunCommandRequest {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "test -x \"$1\"".into(),
                "sh".into(),
                program.clone(),
            ],
            timeout_ms: Some(10_000),
            ..Default::default()
        };
        let found = match crate::exec::run_to_end(&conn, &req).await {
            Ok(out) => out.exit_code == 0,
            Err(e) => {
                tracing::debug!(sandbox_id = %sandbox.id, error = %e.chain(),
                    "looking for the template's harness failed");
                false
            }
        };
        if found {
            return Ok(Some(sandbox.template.clone()));
        }
        Err(CoreError::invalid(format!(
            "template {} carries no {harness} at {program} and only host-template sandboxes \
             get the host's harnesses (build one with scripts/build-agent-template.sh)",
            sandbox.template
        )))
    }

    /// The host's harness directory is configured (it is bound into `host` sandboxes).
    fn check_host_harnesses(&self) -> Result<(), CoreError> {
        if self.cfg.agents.harness_dir.is_none() {
            return Err(CoreError::unavailable(
                "no harness directory is configured ([agents] harness_dir)",
            ));
        }
        Ok(())
    }

    /// Creates a sandbox and a runtime in it (a workspace). A request the runtime would
    /// refuse anyway is refused before any sandbox is made; if the runtime still cannot
    /// be created, the new sandbox is destroyed and the runtime's error returned, so no
    /// half-made workspace is left.
    pub async fn create_workspace(
        self: &Arc<Self>,
        owner: &str,
        req: &sandpit_api::CreateWorkspaceRequest,
    ) -> Result<(SandboxRecord, AgentRuntimeRecord), CoreError> {
        let agent = sandpit_api::CreateAgentRequest {
            harness: req.harness.clone(),
            model: req.model.clone(),
            approval_policy: req.approval_policy.clone(),
        };
        self.check_agent_request(&agent)?;
        // A workspace on the host template is refused before its sandbox is made; one
        // on another template is checked once the sandbox runs (the harness is in it).
        if req.template.as_deref().unwrap_or("host") == "host" {
            self.check_host_harnesses()?;
        }
        crate::approvals::checked_policy(agent.approval_policy.as_ref(), &self.cfg.approvals)?;
        let sandbox_req = sandpit_api::CreateSandboxRequest {
            template: req.template.clone(),
            timeout: req.timeout,
            limits: req.limits,
            env: req.env.clone(),
            secret_env: req.secret_env.clone(),
            metadata: req.metadata.clone(),
            secrets: req.secrets.clone(),
            network: req.network.clone(),
            ..Default::default()
        };
        let sandbox = self.create(owner, sandbox_req).await?;
        match self.create_agent_runtime(owner, &sandbox.id, &agent).await {
            Ok(rt) => Ok((sandbox, rt)),
            Err(e) => {
                tracing::info!(sandbox_id = %sandbox.id, error = %e.chain(),
                    "workspace runtime refused: deleting its sandbox");
                if let Err(d) = self.destroy(&sandbox).await {
                    tracing::warn!(sandbox_id = %sandbox.id, error = %d.chain(),
                        "deleting the sandbox of a refused workspace failed");
                }
                Err(e)
            }
        }
    }

    /// The caller's runtime `id`.
    pub async fn agent_runtime(
        &self,
        owner: &str,
        id: &str,
    ) -> Result<AgentRuntimeRecord, CoreError> {
        match self.store.get_agent_runtime(id).await? {
            Some(r) if r.owner == owner => Ok(r),
            _ => Err(CoreError::not_found(format!(
                "agent runtime {id} not found"
            ))),
        }
    }

    /// The caller's runtimes, in sandbox `sandbox_id` or in all of the caller's.
    pub async fn list_agent_runtimes(
        &self,
        owner: &str,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<AgentRuntimeRecord>, CoreError> {
        Ok(self
            .store
            .list_agent_runtimes(Some(owner), sandbox_id)
            .await?)
    }

    /// Ends the caller's runtime `id`: its active run is cancelled and its processes
    /// killed. The record stays, `ended`.
    pub async fn delete_agent_runtime(&self, owner: &str, id: &str) -> Result<(), CoreError> {
        let rec = self.agent_runtime(owner, id).await?;
        if let Some(ended) = self
            .store
            .end_agent_runtime(&rec.id, "runtime deleted")
            .await?
        {
            for run in ended.runs {
                self.agent_runs.stop_process(&run.id).await;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(api: Option<&str>) -> AgentModelSpec {
        AgentModelSpec {
            base_url: "http://m.example/v1".into(),
            model: "m".into(),
            api_key_secret: None,
            api: api.map(String::from),
        }
    }

    #[test]
    fn each_harness_gets_its_own_wire_api_by_default_and_refuses_a_foreign_one() {
        assert_eq!(
            wire_api(Harness::Pi, &spec(None)).unwrap(),
            WireApi::ChatCompletions
        );
        assert_eq!(
            wire_api(Harness::Claude, &spec(None)).unwrap(),
            WireApi::AnthropicMessages
        );
        assert_eq!(
            wire_api(Harness::Codex, &spec(None)).unwrap(),
            WireApi::Responses
        );
        assert_eq!(
            wire_api(Harness::Pi, &spec(Some("responses"))).unwrap(),
            WireApi::Responses
        );
        for (h, api) in [
            (Harness::Claude, "chat_completions"),
            (Harness::Claude, "responses"),
            (Harness::Codex, "chat_completions"),
            (Harness::Codex, "anthropic_messages"),
        ] {
            let e = wire_api(h, &spec(Some(api))).unwrap_err();
            assert!(matches!(e, CoreError::Invalid(_)), "{h} {api}: {e}");
            assert!(e.to_string().contains("cannot use"), "{e}");
        }
        assert!(wire_api(Harness::Pi, &spec(Some("smoke_signals"))).is_err());
    }
}
