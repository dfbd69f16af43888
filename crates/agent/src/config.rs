//! What the daemon tells the agent at start: passed as JSON in one environment variable
//! so that nothing has to exist in the sandbox's filesystem beforehand.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

/// Environment variable holding the JSON [`AgentConfig`]; removed before any command runs.
pub const CONFIG_ENV: &str = "SANDPIT_AGENT_CONFIG";

/// How the agent is confined, which decides how users and paths are interpreted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IsolationMode {
    /// Inside its own namespaces: `/` is the sandbox root and uids can be switched.
    Container,
    /// A plain host process: paths live under `root` and every command runs as the daemon's user.
    Process,
}

/// Agent start-up configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentConfig {
    /// Isolation of this agent.
    pub mode: IsolationMode,
    /// Directory that the file API and command paths are confined to (`/` in a container).
    pub root: PathBuf,
    /// Default working directory of commands, as seen inside the sandbox.
    pub workdir: String,
    /// Environment every command starts with (the sandbox's env).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// An inherited, already listening unix socket.
    #[serde(default)]
    pub listen_fd: Option<i32>,
    /// A path to bind a unix socket on, when no socket is inherited.
    #[serde(default)]
    pub listen_path: Option<PathBuf>,
    /// Settings applied after start by `POST /init` (shared by clones of this config).
    #[serde(skip)]
    pub live: Arc<RwLock<Live>>,
}

/// What `POST /init` changes after start: a pooled sandbox learns its caller's settings.
#[derive(Debug, Default)]
pub struct Live {
    env: BTreeMap<String, String>,
    workdir: Option<String>,
    user: Option<String>,
}

/// Body of `POST /init`, in the shape of E2B's envd.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InitRequest {
    /// Added to (and overriding) the sandbox's environment.
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// User that commands and file operations act as when a request names none.
    pub default_user: Option<String>,
    /// Working directory of commands that name none.
    pub default_workdir: Option<String>,
    /// Accepted for E2B compatibility; the daemon authenticates callers, not the agent.
    #[serde(default)]
    pub access_token: Option<String>,
    /// Accepted for E2B compatibility (the caller's clock).
    #[serde(default)]
    pub timestamp: Option<String>,
}

impl AgentConfig {
    /// The environment every command starts with.
    pub fn env(&self) -> BTreeMap<String, String> {
        let mut env = self.env.clone();
        if let Ok(live) = self.live.read() {
            env.extend(live.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        env
    }

    /// Working directory of commands that name none.
    pub fn workdir(&self) -> String {
        self.live
            .read()
            .ok()
            .and_then(|l| l.workdir.clone())
            .unwrap_or_else(|| self.workdir.clone())
    }

    /// User of requests that name none, if `POST /init` set one.
    pub fn default_user(&self) -> Option<String> {
        self.live.read().ok().and_then(|l| l.user.clone())
    }

    /// Validates and applies an init request; nothing changes when it is refused.
    pub fn apply_init(&self, req: InitRequest) -> Result<(), String> {
        for (k, v) in &req.env_vars {
            if k.is_empty() || k.len() > 256 || k.contains(['=', '\0']) || v.contains('\0') {
                return Err(format!("invalid environment variable {k:?}"));
            }
        }
        if let Some(w) = &req.default_workdir
            && (!w.starts_with('/') || w.contains('\0') || w.split('/').any(|c| c == ".."))
        {
            return Err("defaultWorkdir must be an absolute path without '..'".into());
        }
        if let Some(u) = &req.default_user
            && crate::users::resolve(self, Some(u)).is_none()
        {
            return Err(format!("unknown user {u:?}"));
        }
        let mut live = self
            .live
            .write()
            .map_err(|_| "agent settings are poisoned".to_string())?;
        live.env.extend(req.env_vars);
        if req.default_workdir.is_some() {
            live.workdir = req.default_workdir;
        }
        if req.default_user.is_some() {
            live.user = req.default_user;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> AgentConfig {
        AgentConfig {
            mode: IsolationMode::Container,
            root: "/".into(),
            workdir: "/home/user".into(),
            env: BTreeMap::from([("A".into(), "start".into()), ("B".into(), "kept".into())]),
            listen_fd: None,
            listen_path: None,
            live: Default::default(),
        }
    }

    #[test]
    fn init_overrides_env_workdir_and_user() {
        let c = cfg();
        assert_eq!(c.workdir(), "/home/user");
        assert_eq!(c.default_user(), None);
        c.apply_init(InitRequest {
            env_vars: BTreeMap::from([("A".into(), "claimed".into()), ("C".into(), "new".into())]),
            default_user: Some("root".into()),
            default_workdir: Some("/work".into()),
            ..Default::default()
        })
        .unwrap();
        let env = c.env();
        assert_eq!(env["A"], "claimed");
        assert_eq!(env["B"], "kept");
        assert_eq!(env["C"], "new");
        assert_eq!(c.workdir(), "/work");
        assert_eq!(c.default_user().as_deref(), Some("root"));
        assert_eq!(crate::users::resolve(&c, None).map(|u| u.uid), Some(0));
        // Clones share what init set (the services hold clones of one config).
        assert_eq!(c.clone().workdir(), "/work");
    }

    #[test]
    fn bad_init_requests_change_nothing() {
        let c = cfg();
        let bad = [
            InitRequest {
                env_vars: BTreeMap::from([("X=Y".into(), "v".into())]),
                default_workdir: Some("/ok".into()),
                ..Default::default()
            },
            InitRequest {
                env_vars: BTreeMap::from([("X".into(), "nul\0".into())]),
                ..Default::default()
            },
            InitRequest {
                default_workdir: Some("relative".into()),
                ..Default::default()
            },
            InitRequest {
                default_workdir: Some("/a/../etc".into()),
                ..Default::default()
            },
            InitRequest {
                default_user: Some("mallory".into()),
                ..Default::default()
            },
        ];
        for req in bad {
            assert!(c.apply_init(req).is_err());
        }
        assert_eq!(c.workdir(), "/home/user");
        assert_eq!(c.env().len(), 2);
        assert_eq!(c.default_user(), None);
    }

    #[test]
    fn the_init_body_is_e2b_shaped() {
        let req: InitRequest = serde_json::from_str(
            r#"{"envVars":{"K":"v"},"accessToken":"t","timestamp":"2026-01-01T00:00:00Z","defaultUser":"user","defaultWorkdir":"/w"}"#,
        )
        .unwrap();
        assert_eq!(req.env_vars["K"], "v");
        assert_eq!(req.default_user.as_deref(), Some("user"));
        assert_eq!(req.default_workdir.as_deref(), Some("/w"));
    }
}
