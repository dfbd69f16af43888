//! What the daemon tells the agent at start: passed as JSON in one environment variable
//! so that nothing has to exist in the sandbox's filesystem beforehand.

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

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
    /// Whether the agent serves the sandbox's `sudo` (container sandboxes only; see the
    /// agent's `sudo` module).
    #[serde(default)]
    pub sudo: bool,
    /// Settings applied after start by the agent's `POST /init` (shared by clones of this
    /// config); never on the wire, so the daemon leaves it at its default.
    #[serde(skip)]
    pub live: Arc<RwLock<Live>>,
}

/// What the agent's `POST /init` changes after start: a pooled sandbox learns its
/// caller's settings. The agent validates them before [`AgentConfig::update_live`].
#[derive(Debug, Default)]
pub struct Live {
    env: BTreeMap<String, String>,
    workdir: Option<String>,
    user: Option<String>,
}

impl AgentConfig {
    /// The environment every command starts with.
    pub fn env(&self) -> BTreeMap<String, String> {
        let mut env = self.env.clone();
        let live = self.live.read();
        env.extend(live.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        env
    }

    /// Working directory of commands that name none.
    pub fn workdir(&self) -> String {
        self.live
            .read()
            .workdir
            .clone()
            .unwrap_or_else(|| self.workdir.clone())
    }

    /// User of requests that name none, if `POST /init` set one.
    pub fn default_user(&self) -> Option<String> {
        self.live.read().user.clone()
    }

    /// Adds `env` to the live environment (overriding) and replaces the default workdir
    /// and user where given; the caller has validated all three.
    pub fn update_live(
        &self,
        env: BTreeMap<String, String>,
        workdir: Option<String>,
        user: Option<String>,
    ) {
        let mut live = self.live.write();
        live.env.extend(env);
        if workdir.is_some() {
            live.workdir = workdir;
        }
        if user.is_some() {
            live.user = user;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_shape_is_plain_json_without_live_settings() {
        let cfg = AgentConfig {
            mode: IsolationMode::Container,
            root: "/".into(),
            workdir: "/home/user".into(),
            env: BTreeMap::from([("A".into(), "1".into())]),
            listen_fd: Some(3),
            listen_path: None,
            sudo: false,
            live: Default::default(),
        };
        cfg.update_live(BTreeMap::new(), Some("/work".into()), None);
        let json: serde_json::Value = serde_json::to_value(&cfg).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "mode": "container",
                "root": "/",
                "workdir": "/home/user",
                "env": {"A": "1"},
                "listen_fd": 3,
                "listen_path": null,
                "sudo": false,
            })
        );
        // Optional fields may be left out; a fresh config has no live settings.
        let back: AgentConfig =
            serde_json::from_str(r#"{"mode":"process","root":"/r","workdir":"/w"}"#).unwrap();
        assert_eq!(back.mode, IsolationMode::Process);
        assert!(back.env.is_empty() && back.listen_fd.is_none() && back.listen_path.is_none());
        assert!(!back.sudo, "sudo is off unless the daemon turns it on");
        assert_eq!(back.workdir(), "/w");
        assert_eq!(back.default_user(), None);
    }

    #[test]
    fn live_settings_override_and_are_shared_by_clones() {
        let cfg: AgentConfig = serde_json::from_str(
            r#"{"mode":"container","root":"/","workdir":"/w","env":{"A":"start","B":"kept"}}"#,
        )
        .unwrap();
        let clone = cfg.clone();
        cfg.update_live(
            BTreeMap::from([("A".into(), "claimed".into())]),
            None,
            Some("root".into()),
        );
        let env = clone.env();
        assert_eq!(env["A"], "claimed");
        assert_eq!(env["B"], "kept");
        assert_eq!(clone.workdir(), "/w");
        assert_eq!(clone.default_user().as_deref(), Some("root"));
        // Absent fields keep what an earlier update set.
        cfg.update_live(BTreeMap::new(), Some("/x".into()), None);
        assert_eq!(clone.default_user().as_deref(), Some("root"));
        assert_eq!(clone.workdir(), "/x");
    }
}
