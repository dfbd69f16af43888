//! The agent's start-up config, whose shape the daemon shares through `sandpit-abi`, and
//! `POST /init`, which changes its live settings after start.

use serde::Deserialize;
use std::collections::BTreeMap;

pub use sandpit_abi::config::{AgentConfig, CONFIG_ENV, IsolationMode, Live};

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

/// Validates and applies an init request to `cfg`; nothing changes when it is refused.
pub fn apply_init(cfg: &AgentConfig, req: InitRequest) -> Result<(), String> {
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
        && crate::users::resolve(cfg, Some(u)).is_none()
    {
        return Err(format!("unknown user {u:?}"));
    }
    cfg.update_live(req.env_vars, req.default_workdir, req.default_user);
    Ok(())
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
        apply_init(
            &c,
            InitRequest {
                env_vars: BTreeMap::from([
                    ("A".into(), "claimed".into()),
                    ("C".into(), "new".into()),
                ]),
                default_user: Some("root".into()),
                default_workdir: Some("/work".into()),
                ..Default::default()
            },
        )
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
            assert!(apply_init(&c, req).is_err());
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
