//! Bodies of the networking routes: a sandbox's egress policy
//! (`/v1/sandboxes/{id}/network`) and the audit of its outbound connections
//! (`/v1/network/audit`).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// How a sandbox reaches the network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    /// Loopback only: the sandbox has no route anywhere.
    #[default]
    None,
    /// Only what an allow rule matches.
    Allowlist,
    /// Everything but what a deny rule matches.
    Open,
}

impl NetworkMode {
    /// The mode's name as the API spells it.
    pub fn as_str(&self) -> &'static str {
        match self {
            NetworkMode::None => "none",
            NetworkMode::Allowlist => "allowlist",
            NetworkMode::Open => "open",
        }
    }
}

/// What a rule does to the connections it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RuleAction {
    Allow,
    Deny,
}

/// A port or an inclusive range of ports: `443` or `"8000-8100"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PortSpec {
    One(u16),
    Range(String),
}

/// One rule of an egress policy. A rule matches a connection when every selector it has
/// matches (a rule needs at least one). Deny rules win over allow rules, except allow
/// rules with `override` set, which win over deny rules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkRule {
    pub action: RuleAction,
    /// A host name (`example.com`, that name only) or a wildcard (`*.example.com`: any
    /// name below it, not the name itself). Matches the TLS SNI, the HTTP Host, or the
    /// name the sandbox resolved the destination address from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// An IPv4 network (`203.0.113.0/24`, or one address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
    /// Destination ports (any port when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortSpec>,
    /// On an allow rule: it wins over deny rules.
    #[serde(
        default,
        rename = "override",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub overrides: bool,
    /// A label shown in audit entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A sandbox's egress policy: `PUT /v1/sandboxes/{id}/network` and the `network` field
/// of a create. Host addresses, loopback, link-local (169.254.169.254 too), private
/// ranges, other sandboxes and the daemon stay unreachable whatever it says, unless the
/// daemon's operator allows them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    pub mode: NetworkMode,
    #[serde(default)]
    pub rules: Vec<NetworkRule>,
}

/// The verdict of one outbound attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Allow,
    Deny,
}

impl Verdict {
    /// The verdict's name as the API spells it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Allow => "allow",
            Verdict::Deny => "deny",
        }
    }
}

/// One outbound connection attempt (or DNS query) of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct NetworkAuditEntry {
    pub id: i64,
    /// Unix milliseconds when the attempt was decided.
    pub at_ms: i64,
    pub sandbox_id: String,
    /// `tcp` or `dns`.
    pub protocol: String,
    /// The destination's name: the SNI, the HTTP Host, the name asked of DNS, or the
    /// name the sandbox resolved the address from.
    pub dest_name: Option<String>,
    pub dest_ip: Option<String>,
    pub dest_port: u16,
    /// TLS server name the sandbox sent.
    pub sni: Option<String>,
    /// HTTP Host header the sandbox sent.
    pub http_host: Option<String>,
    pub verdict: Verdict,
    /// What decided: `rules[2]` (with the rule), `mode none`, `default deny`,
    /// `blocked: private range`, ...
    pub rule: String,
    /// Bytes from the sandbox to the destination.
    pub bytes_sent: u64,
    /// Bytes from the destination to the sandbox.
    pub bytes_received: u64,
    /// When the connection closed (allowed TCP connections).
    pub ended_at_ms: Option<i64>,
    /// Why an allowed connection failed, if it did.
    pub error: Option<String>,
    /// How many attempts this entry stands for: identical ones (DNS questions, refused
    /// connections) within a minute are counted here rather than listed again, and a
    /// summary of entries the audit's rate limit dropped gives their number. 1 when absent.
    #[serde(default = "one")]
    pub count: u64,
    /// When the last of the attempts counted came (unix ms), once there is more than one.
    #[serde(default)]
    pub last_at_ms: Option<i64>,
}

fn one() -> u64 {
    1
}

/// One page of `GET /v1/network/audit`, newest first.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct NetworkAuditList {
    pub items: Vec<NetworkAuditEntry>,
    /// Pass as `cursor` to get the next (older) page.
    pub next_cursor: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_audit_entry_without_a_count_counts_one() {
        // As sent by a daemon from before entries were aggregated.
        let old = r#"{"id":3,"at_ms":10,"sandbox_id":"s","protocol":"dns","dest_name":"a.test",
            "dest_ip":null,"dest_port":53,"sni":null,"http_host":null,"verdict":"deny",
            "rule":"default deny","bytes_sent":0,"bytes_received":0,"ended_at_ms":null,
            "error":null}"#;
        let e: NetworkAuditEntry = serde_json::from_str(old).unwrap();
        assert_eq!((e.count, e.last_at_ms), (1, None));
        let back = serde_json::to_value(&e).unwrap();
        assert_eq!(back["count"], 1);
        let again: NetworkAuditEntry = serde_json::from_value(back).unwrap();
        assert_eq!(again, e);
    }
}
