//! Bodies of the credential broker's routes under `/v1/secrets` and
//! `/v1/sandboxes/{id}/secrets`. A secret's value goes in once, at create, and is never
//! sent back by any route.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /v1/secrets`: a credential the daemon keeps and injects into a sandbox's matching
/// outbound requests, so that the sandbox itself never holds it.
#[derive(Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSecretRequest {
    /// 1 to 64 characters of `[A-Za-z0-9_-]`; unique per owner.
    pub name: String,
    /// The credential (at most 8 KiB, no control characters).
    pub value: String,
    /// Hosts it may be sent to: `api.example.com`, or `*.example.com` for any name below
    /// it (not `example.com` itself).
    pub hosts: Vec<String>,
    /// HTTP methods it may be sent with, e.g. `["GET", "POST"]`.
    pub methods: Vec<String>,
    /// When given, only request paths equal to one of these or below it (`/v1/chat`
    /// allows `/v1/chat` and `/v1/chat/x`, not `/v1/chatty`).
    #[serde(default)]
    pub path_prefixes: Vec<String>,
    /// When it stops being usable, unix milliseconds. One of this and `ttl_secs` is needed.
    pub expires_at_ms: Option<i64>,
    /// Seconds from now until it stops being usable.
    pub ttl_secs: Option<u64>,
    /// How it is put into a request.
    pub inject: InjectSpec,
    /// Also usable over plain HTTP (default false: HTTPS only).
    #[serde(default)]
    pub allow_http: bool,
}

impl std::fmt::Debug for CreateSecretRequest {
    // The value must not reach a log through a debug print of the request.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreateSecretRequest")
            .field("name", &self.name)
            .field("hosts", &self.hosts)
            .field("methods", &self.methods)
            .field("path_prefixes", &self.path_prefixes)
            .field("expires_at_ms", &self.expires_at_ms)
            .field("ttl_secs", &self.ttl_secs)
            .field("inject", &self.inject)
            .field("allow_http", &self.allow_http)
            .finish_non_exhaustive()
    }
}

/// How a secret is put into a matching request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum InjectSpec {
    /// The broker sets header `name` to `format` with `{value}` replaced by the secret,
    /// e.g. `{"type": "header", "name": "Authorization", "format": "Bearer {value}"}`.
    Header {
        name: String,
        /// Default `{value}`.
        #[serde(default = "value_only")]
        format: String,
    },
    /// The sandbox writes the secret's placeholder (`SANDPIT_SECRET_<name>`) into a header
    /// value and the broker replaces it with the secret.
    Placeholder,
}

impl Default for InjectSpec {
    fn default() -> Self {
        InjectSpec::Header {
            name: "Authorization".into(),
            format: "Bearer {value}".into(),
        }
    }
}

fn value_only() -> String {
    "{value}".into()
}

/// A secret as the API shows it: everything but its value.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Secret {
    pub name: String,
    pub owner: String,
    pub hosts: Vec<String>,
    pub methods: Vec<String>,
    pub path_prefixes: Vec<String>,
    /// Unix milliseconds.
    pub expires_at_ms: Option<i64>,
    pub inject: InjectSpec,
    /// The string a sandbox puts into a header for the broker to replace (placeholder form).
    pub placeholder: Option<String>,
    pub allow_http: bool,
    /// Unix milliseconds.
    pub created_at_ms: i64,
}

/// `GET /v1/secrets`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SecretList {
    pub items: Vec<Secret>,
}

/// `PUT /v1/sandboxes/{id}/secrets` (and its answer, as `GET` gives it): the names of the
/// owner's secrets the sandbox may use; a `PUT` replaces the whole set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxSecrets {
    pub secrets: Vec<String>,
}
