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

/// Why a `POST /init` was refused; its text is the 400 response's body.
#[derive(Debug, thiserror::Error)]
pub enum InitRequestError {
    /// The body is not an init request.
    #[error("bad init body: {0}")]
    Body(#[from] serde_json::Error),
    /// A variable name is empty, too long or holds `=` or NUL, or its value holds NUL.
    #[error("invalid environment variable {name:?}")]
    EnvVar { name: String },
    /// The working directory is relative or climbs with `..`.
    #[error("defaultWorkdir must be an absolute path without '..'")]
    Workdir,
    /// The default user is not an account of the sandbox.
    #[error("unknown user {user:?}")]
    UnknownUser { user: String },
}

/// Validates and applies an init request to `cfg`; nothing changes when it is refused.
pub fn apply_init(cfg: &AgentConfig, req: InitRequest) -> Result<(), InitRequestError> {
    for (k, v) in &req.env_vars {
        if k.is_empty() || k.len() > 256 || k.contains(['=', '\0']) || v.contains('\0') {
            return Err(InitRequestError::EnvVar { name: k.clone() });
        }
    }
    if let Some(w) = &req.default_workdir
        && (!w.starts_with('/') || w.contains('\0') || w.split('/').any(|c| c == ".."))
    {
        return Err(InitRequestError::Workdir);
    }
    if let Some(u) = &req.default_user
        && crate::users::resolve(cfg, Some(u)).is_none()
    {
        return Err(InitRequestError::UnknownUser { user: u.clone() });
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
            sudo: false,
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
        let said: Vec<String> = bad
            .into_iter()
            .map(|req| apply_init(&c, req).unwrap_err().to_string())
            .collect();
        assert_eq!(
            said,
            [
                "invalid environment variable \"X=Y\"",
                "invalid environment variable \"X\"",
                "defaultWorkdir must be an absolute path without '..'",
                "defaultWorkdir must be an absolute path without '..'",
                "unknown user \"mallory\"",
            ]
        );
        assert_eq!(c.workdir(), "/home/user");
        assert_eq!(c.env().len(), 2);
        assert_eq!(c.default_user(), None);
    }

    #[test]
    fn a_malformed_body_keeps_the_parse_error() {
        let parse = serde_json::from_slice::<InitRequest>(b"{\"envVars\": 3}").unwrap_err();
        let shown = parse.to_string();
        let e = InitRequestError::from(parse);
        assert_eq!(e.to_string(), format!("bad init body: {shown}"));
        assert!(std::error::Error::source(&e).is_some());
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
