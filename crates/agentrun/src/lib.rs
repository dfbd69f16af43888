//! Agent runs, the parts that need no I/O: the event envelope a run's events are stored
//! and served in ([`Event`]), the limits and the redaction applied to every event before
//! it is stored ([`Limits`], [`Redactor`], [`sanitize`]), the approval policy of a runtime
//! ([`ApprovalPolicy`]), and one [`Adapter`] per coding-agent harness that turns the
//! harness's own machine-readable output into envelope events and says, as data, how to
//! launch, continue, abort and answer it.
//!
//! The daemon does the I/O: it runs the [`Launch`] an adapter describes inside the
//! sandbox, feeds every output line (or SSE event) to [`Adapter::parse`], passes each
//! event through [`sanitize`], and stores it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod adapter;
mod event;
mod limits;
mod policy;
mod redact;

pub use adapter::{
    Adapter, Answer, Control, Harness, HttpCall, Launch, LaunchError, LaunchFile, LaunchSpec,
    ModelEndpoint, Outcome, Parsed, PermissionRequest, Resume, SESSION_PLACEHOLDER, Stdin,
    StreamSource, WireApi, adapter,
};
pub use event::{
    ErrorPayload, Event, EventKind, FileChange, FileChangePayload, MessagePayload,
    ParseEventKindError, StatusPayload, TextPayload, ToolCallPayload, ToolResultPayload, Usage,
};
pub use limits::{Applied, Limits, truncate_string};
pub use policy::{ApprovalPolicy, CredentialGate, PolicyError};
pub use redact::{MASK, MIN_SECRET_BYTES, Redactor, is_sensitive_key};

/// Redacts, then limits, one event's payload: the order matters, since a string cut
/// first could leave part of a secret that no longer matches its full value.
pub fn sanitize(event: &mut Event, redactor: &Redactor, limits: &Limits) -> Sanitized {
    let masked = redactor.redact(&mut event.payload);
    let applied = limits.apply(&mut event.payload);
    Sanitized { masked, applied }
}

/// What [`sanitize`] changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sanitized {
    /// Values masked by the redactor.
    pub masked: usize,
    /// What the limits cut.
    pub applied: Applied,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_secret_cut_by_a_limit_leaves_no_part_of_itself() {
        let secret = "sk-live-0123456789abcdef";
        let redactor = Redactor::new([secret]);
        let limits = Limits {
            max_string_bytes: 30,
            ..Limits::default()
        };
        // The string limit falls in the middle of the secret: limiting first would keep
        // "sk-live-0123" and the redactor would no longer recognise it.
        let mut event = Event::tool_result(None, None, format!("token is {secret} ok"), false);
        let done = sanitize(&mut event, &redactor, &limits);
        assert_eq!(done.masked, 1);
        assert_eq!(done.applied.strings_truncated, 0);
        let out = event.payload["output"].as_str().unwrap();
        assert_eq!(out, format!("token is {MASK} ok"));
        assert!(!out.contains("sk-live"));

        let mut event =
            Event::tool_result(None, None, format!("{}{secret}", "x".repeat(10)), false);
        sanitize(&mut event, &redactor, &limits);
        let out = event.payload["output"].as_str().unwrap();
        assert!(!out.contains("sk-"), "{out}");
    }

    #[test]
    fn a_harness_event_is_sanitized_before_it_is_stored() {
        // A tool call as Claude Code reports it, carrying a header and a known value.
        let mut claude = adapter::adapter(Harness::Claude);
        let line = json!({"type": "assistant", "message": {"content": [{"type": "tool_use", "id": "t1", "name": "Bash",
            "input": {"command": "curl -H 'Authorization: Bearer ghp_abcdefghijklmnop1234' https://api.example",
                      "env": {"GITHUB_TOKEN": "ghp_abcdefghijklmnop1234", "HOME": "/root"},
                      "note": "the broker value real-secret-value appears here"}}]}});
        let mut parsed = claude.parse(&line.to_string());
        let redactor = Redactor::new(["real-secret-value"]);
        let event = &mut parsed.events[0];
        let done = sanitize(event, &redactor, &Limits::default());
        assert_eq!(done.masked, 3);
        let text = event.payload.to_string();
        assert!(!text.contains("ghp_"), "{text}");
        assert!(!text.contains("real-secret-value"), "{text}");
        assert_eq!(event.payload["input"]["env"]["HOME"], "/root");
        assert_eq!(
            event.payload["input"]["command"],
            format!("curl -H 'Authorization: {MASK}' https://api.example")
        );
    }
}
