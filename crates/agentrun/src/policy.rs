//! A runtime's approval policy: which capabilities wait for a person. Stored by the store
//! as opaque JSON (the runtime's `approval_policy`); this is its shape and its checks.

use serde::{Deserialize, Serialize};

/// Longest wait for a decision a policy may set: a day.
const MAX_TIMEOUT_SECS: u64 = 24 * 60 * 60;

/// Which actions of a run need a person's approval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApprovalPolicy {
    /// An outbound connection to a host outside the sandbox's egress allow-list waits for
    /// a person instead of being refused.
    pub egress: bool,
    /// Credentials whose injection by the broker waits for a person.
    pub credentials: Vec<CredentialGate>,
    /// The harness's own permission requests (tool use) wait for a person; without this
    /// the harness runs its tools unasked. Only for a harness that can ask
    /// ([`crate::Harness::can_ask_permission`]).
    pub harness_permissions: bool,
    /// Seconds an approval waits before it expires (and the action is refused).
    pub timeout_secs: u64,
}

impl Default for ApprovalPolicy {
    fn default() -> ApprovalPolicy {
        ApprovalPolicy {
            egress: false,
            credentials: Vec::new(),
            harness_permissions: false,
            timeout_secs: 600,
        }
    }
}

/// One credential that needs approval, for every method or only some.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialGate {
    /// The broker secret's name.
    pub name: String,
    /// HTTP methods that need approval (any case); empty means every method.
    #[serde(default)]
    pub methods: Vec<String>,
}

/// Why a policy is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The timeout is zero or longer than a day.
    #[error("approval timeout must be between 1 and {MAX_TIMEOUT_SECS} seconds, not {0}")]
    Timeout(u64),
    /// A credential gate has no name.
    #[error("a credential gate needs a secret name")]
    EmptyName,
    /// Two gates name the same credential.
    #[error("credential {0:?} is gated twice")]
    DuplicateName(String),
    /// A method is not an HTTP method token.
    #[error("{0:?} is not an HTTP method")]
    BadMethod(String),
}

impl ApprovalPolicy {
    /// Checks the policy as a create request gives it.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.timeout_secs == 0 || self.timeout_secs > MAX_TIMEOUT_SECS {
            return Err(PolicyError::Timeout(self.timeout_secs));
        }
        let mut names = std::collections::BTreeSet::new();
        for gate in &self.credentials {
            if gate.name.is_empty() {
                return Err(PolicyError::EmptyName);
            }
            if !names.insert(gate.name.as_str()) {
                return Err(PolicyError::DuplicateName(gate.name.clone()));
            }
            for m in &gate.methods {
                if m.is_empty() || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
                    return Err(PolicyError::BadMethod(m.clone()));
                }
            }
        }
        Ok(())
    }

    /// Whether injecting credential `name` into a `method` request needs approval.
    pub fn credential_needs_approval(&self, name: &str, method: &str) -> bool {
        self.credentials.iter().any(|g| {
            g.name == name
                && (g.methods.is_empty()
                    || g.methods.iter().any(|m| m.eq_ignore_ascii_case(method)))
        })
    }

    /// Whether nothing needs approval.
    pub fn is_open(&self) -> bool {
        !self.egress && self.credentials.is_empty() && !self.harness_permissions
    }

    /// When an approval asked at `now_ms` expires, unix milliseconds.
    pub fn expires_at_ms(&self, now_ms: i64) -> i64 {
        let wait = i64::try_from(self.timeout_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        now_ms.saturating_add(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_policy_reads_from_partial_json_and_is_checked() {
        let p: ApprovalPolicy = serde_json::from_value(json!({
            "egress": true,
            "credentials": [{"name": "github", "methods": ["post", "DELETE"]}, {"name": "npm"}]
        }))
        .unwrap();
        p.validate().unwrap();
        assert_eq!(p.timeout_secs, 600);
        assert!(p.credential_needs_approval("github", "POST"));
        assert!(p.credential_needs_approval("github", "delete"));
        assert!(!p.credential_needs_approval("github", "GET"));
        assert!(p.credential_needs_approval("npm", "GET"));
        assert!(!p.credential_needs_approval("other", "POST"));
        assert!(!p.is_open());
        assert!(ApprovalPolicy::default().is_open());
        assert_eq!(p.expires_at_ms(1_000), 601_000);
        assert!(serde_json::from_value::<ApprovalPolicy>(json!({"egres": true})).is_err());
    }

    #[test]
    fn bad_policies_are_refused() {
        let gate = |name: &str, methods: &[&str]| CredentialGate {
            name: name.into(),
            methods: methods.iter().map(|m| m.to_string()).collect(),
        };
        let with = |credentials, timeout_secs| ApprovalPolicy {
            credentials,
            timeout_secs,
            ..ApprovalPolicy::default()
        };
        assert_eq!(with(vec![], 0).validate(), Err(PolicyError::Timeout(0)));
        assert_eq!(
            with(vec![], 86_401).validate(),
            Err(PolicyError::Timeout(86_401))
        );
        assert_eq!(
            with(vec![gate("", &[])], 60).validate(),
            Err(PolicyError::EmptyName)
        );
        assert_eq!(
            with(vec![gate("a", &[]), gate("a", &["GET"])], 60).validate(),
            Err(PolicyError::DuplicateName("a".into()))
        );
        assert_eq!(
            with(vec![gate("a", &["PO ST"])], 60).validate(),
            Err(PolicyError::BadMethod("PO ST".into()))
        );
    }
}
