//! E2B's lifecycle rules on sandpit's manager: what a create that says nothing of its
//! lifecycle or ports gets (E2B's defaults, not `/v1`'s), and `timeout: 0`.

use super::types::{self, NewSandbox};
use super::{E2bError, Required};
use crate::api::{AppState, Owner};
use axum::extract::{Path, State};
use http::StatusCode;

/// The lifecycle of an E2B create, as sandpit's create fields.
#[derive(Debug, PartialEq, Eq)]
pub struct E2bLifecycle {
    /// `on_timeout`: `kill`, `pause` or `hibernate`.
    pub on_timeout: &'static str,
    /// Whether a request to the paused sandbox resumes it.
    pub auto_resume: bool,
}

/// E2B's lifecycle defaults: the timeout kills and nothing resumes a paused sandbox
/// unless the create asks (`autoPause`, `autoPauseMemory`, `autoResume`). sandpit's own
/// `/v1` default (`auto_resume: true`) would let a health probe wake a sandbox that the
/// caller had just paused.
pub fn lifecycle_of(req: &NewSandbox) -> E2bLifecycle {
    // `autoPauseMemory: false` (the SDKs' `keep_memory: false`) asks for a files-only
    // pause; without `autoPause` it means nothing.
    let on_timeout = match (req.auto_pause, req.auto_pause_memory) {
        (Some(true), Some(false)) => "hibernate",
        (Some(true), _) => "pause",
        _ => "kill",
    };
    E2bLifecycle {
        on_timeout,
        auto_resume: req.auto_resume.as_ref().is_some_and(|a| a.enabled),
    }
}

/// Whether the sandbox's other ports are open without its traffic token: what
/// `network.allowPublicTraffic` says, else the daemon's `[e2b] public_ports` (E2B's
/// default, `true`, unless the operator closed it).
pub fn public_ports(asked: Option<bool>, default: bool) -> bool {
    asked.unwrap_or(default)
}

/// `mcp` of a create: E2B accepts an object of server configurations and leaves the
/// gateway to the SDK, which starts `mcp-gateway` in the new sandbox (and kills the
/// sandbox when that fails). sandpit ships no gateway, so only the shape is checked.
pub fn check_mcp(mcp: Option<&serde_json::Value>) -> Result<(), E2bError> {
    match mcp {
        None | Some(serde_json::Value::Null) | Some(serde_json::Value::Object(_)) => Ok(()),
        Some(_) => Err(E2bError::bad_request(
            "mcp must be an object of MCP server configurations",
        )),
    }
}

/// `POST /sandboxes/{id}/timeout`: the sandbox ends `timeout` seconds from now; `0` ends
/// its time now, so its timeout action (kill, or pause as its lifecycle says) is done
/// before the answer.
pub async fn set_timeout(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    Required(req): Required<types::TimeoutRequest>,
) -> Result<StatusCode, E2bError> {
    let rec = super::sandboxes::live(&state, &owner, &id).await?;
    if req.timeout == 0 {
        state.manager.expire_now(&rec).await?;
    } else {
        state.manager.set_timeout(&rec, req.timeout).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(body: serde_json::Value) -> NewSandbox {
        serde_json::from_value(body).expect("a create body")
    }

    #[test]
    fn nothing_said_is_kill_without_auto_resume() {
        let l = lifecycle_of(&new(serde_json::json!({"templateID": "base"})));
        assert_eq!(
            l,
            E2bLifecycle {
                on_timeout: "kill",
                auto_resume: false
            }
        );
        let l = lifecycle_of(&new(
            serde_json::json!({"templateID": "base", "autoPause": false, "autoPauseMemory": false}),
        ));
        assert_eq!(l.on_timeout, "kill");
        assert!(!l.auto_resume);
    }

    #[test]
    fn auto_pause_and_auto_resume_as_asked() {
        let l = lifecycle_of(&new(serde_json::json!({
            "templateID": "base", "autoPause": true, "autoResume": {"enabled": true}
        })));
        assert_eq!(l.on_timeout, "pause");
        assert!(l.auto_resume);
        let l = lifecycle_of(&new(serde_json::json!({
            "templateID": "base", "autoPause": true, "autoPauseMemory": false,
            "autoResume": {"enabled": false}
        })));
        assert_eq!(l.on_timeout, "hibernate");
        assert!(!l.auto_resume);
        let l = lifecycle_of(&new(serde_json::json!({
            "templateID": "base", "autoPause": true, "autoPauseMemory": true
        })));
        assert_eq!(l.on_timeout, "pause");
        assert!(!l.auto_resume);
    }

    #[test]
    fn ports_follow_the_ask_else_the_default() {
        assert!(public_ports(None, true));
        assert!(!public_ports(None, false));
        assert!(!public_ports(Some(false), true));
        assert!(public_ports(Some(true), false));
    }

    #[test]
    fn mcp_must_be_an_object() {
        assert!(check_mcp(None).is_ok());
        assert!(check_mcp(Some(&serde_json::Value::Null)).is_ok());
        assert!(check_mcp(Some(&serde_json::json!({"server": {}}))).is_ok());
        for bad in [
            serde_json::json!("x"),
            serde_json::json!([1]),
            serde_json::json!(3),
        ] {
            assert!(check_mcp(Some(&bad)).is_err(), "{bad}");
        }
    }
}
