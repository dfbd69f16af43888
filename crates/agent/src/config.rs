//! What the daemon tells the agent at start: passed as JSON in one environment variable
//! so that nothing has to exist in the sandbox's filesystem beforehand.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

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
}
