//! Template builds: `POST /v1/templates`, the build log, and the settings a template gives
//! the sandboxes started from it.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// Where a template's root filesystem comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TemplateSourceSpec {
    /// A copy of a directory on the daemon's host (symlinks stay symlinks; device nodes,
    /// FIFOs and sockets are skipped).
    Dir {
        /// Absolute path on the daemon's host.
        path: String,
    },
    /// `debootstrap --variant=minbase` of a Debian or Ubuntu suite.
    Debootstrap {
        /// e.g. `bookworm`.
        suite: String,
        /// Extra packages (`--include`).
        #[serde(default)]
        packages: Vec<String>,
        /// http(s) mirror (default: debootstrap's).
        #[serde(default)]
        mirror: Option<String>,
    },
    /// An OCI image layout directory or a `docker save` tarball on the daemon's host.
    Oci {
        /// Absolute path on the daemon's host.
        path: String,
    },
    /// A snapshot of a sandbox that ran setup commands (E2B's build steps): its files, as
    /// read-only layers over the template the sandbox ran on.
    Snapshot {
        /// Snapshot id, or a name among the admin's snapshots.
        snapshot: String,
        /// Set by the daemon: the template the snapshot's sandbox ran on, under its layers.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        base: Option<String>,
    },
    /// A directory registered in place with `sandpit template add` (not built; cannot be
    /// asked for through the API).
    Path {
        /// The registered directory.
        path: String,
    },
}

impl TemplateSourceSpec {
    /// The `kind` tag.
    pub fn kind(&self) -> &'static str {
        match self {
            TemplateSourceSpec::Dir { .. } => "dir",
            TemplateSourceSpec::Debootstrap { .. } => "debootstrap",
            TemplateSourceSpec::Oci { .. } => "oci",
            TemplateSourceSpec::Snapshot { .. } => "snapshot",
            TemplateSourceSpec::Path { .. } => "path",
        }
    }
}

/// What every sandbox of a template starts with; a create request's own values win.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TemplateSettings {
    /// `user` or `root`.
    #[serde(default)]
    pub default_user: Option<String>,
    /// Default working directory of commands.
    #[serde(default)]
    pub workdir: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Shell command started in the background (as the default user) once the sandbox is up.
    #[serde(default)]
    pub start_cmd: Option<String>,
    /// Shell command run until it exits 0; the sandbox is handed out only after that.
    #[serde(default)]
    pub ready_cmd: Option<String>,
    /// How long the readiness check may keep failing, in seconds (default 60).
    #[serde(default)]
    pub ready_timeout_secs: Option<u32>,
}

/// `POST /v1/templates` (admin key): builds a template in the background.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildTemplateRequest {
    /// 1..=64 characters of `[a-zA-Z0-9._-]`, not starting with `.` or `-`; not `host`.
    pub name: String,
    pub source: TemplateSourceSpec,
    /// `user` or `root` (an OCI image's own user when left out).
    #[serde(default)]
    pub default_user: Option<String>,
    #[serde(default)]
    pub workdir: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub start_cmd: Option<String>,
    #[serde(default)]
    pub ready_cmd: Option<String>,
    #[serde(default)]
    pub ready_timeout_secs: Option<u32>,
}

/// One line of a build's log; `offset` counts lines from the start of the build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BuildLogLine {
    pub offset: u64,
    pub text: String,
}

/// `GET /v1/templates/{name}/build?offset=N&wait_ms=M`: the build's state and its log from
/// `offset` on.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateBuild {
    pub name: String,
    pub build_id: Option<String>,
    /// `building`, `ready`, `failed` or `deleting`.
    pub state: String,
    pub error: Option<String>,
    pub lines: Vec<BuildLogLine>,
    /// Ask for this offset next.
    pub next_offset: u64,
    /// True when lines were dropped from the front of the log (it keeps the most recent).
    #[serde(default)]
    pub truncated: bool,
}

/// The state of a template with nothing else said: ready.
pub fn ready_state() -> String {
    "ready".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_tagged_and_strict() {
        let s: TemplateSourceSpec =
            serde_json::from_str(r#"{"kind":"debootstrap","suite":"bookworm"}"#).unwrap();
        assert_eq!(
            s,
            TemplateSourceSpec::Debootstrap {
                suite: "bookworm".into(),
                packages: vec![],
                mirror: None
            }
        );
        assert!(serde_json::from_str::<TemplateSourceSpec>(r#"{"kind":"dir"}"#).is_err());
        assert!(
            serde_json::from_str::<TemplateSourceSpec>(r#"{"kind":"dir","path":"/x","extra":1}"#)
                .is_err()
        );
        assert!(
            serde_json::from_str::<TemplateSourceSpec>(r#"{"kind":"http","path":"/x"}"#).is_err()
        );
        let req: Result<BuildTemplateRequest, _> = serde_json::from_str(
            r#"{"name":"t","source":{"kind":"dir","path":"/x"},"startCmd":"x"}"#,
        );
        assert!(req.is_err(), "misspelt fields are refused");
    }

    #[test]
    fn a_template_from_an_older_daemon_reads_as_ready() {
        let t: crate::Template = serde_json::from_str(r#"{"name":"a","rootfs":"/r"}"#).unwrap();
        assert_eq!(t.state, "ready");
        assert!(t.settings.env.is_empty() && t.source.is_none());
        let back = serde_json::to_value(&t).unwrap();
        assert_eq!(back["name"], "a");
        assert!(back.get("env").is_some(), "settings are flattened: {back}");
    }
}
