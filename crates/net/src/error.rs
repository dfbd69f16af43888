//! What can go wrong in sandbox networking, with the cause kept.

use crate::dns::DnsError;
use crate::nft::NftError;
use crate::policy::PolicyError;

/// Why networking could not be set up, or a sandbox's policy not planned or applied.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The `[network]` configuration cannot be used on this host.
    #[error("[network] {0}")]
    Config(String),
    /// A `[network]` address, network or port list is not valid.
    #[error("[network] {0}")]
    ConfigValue(#[source] PolicyError),
    /// A `[network]` DNS setting is not valid.
    #[error("[network] {0}")]
    Dns(#[source] DnsError),
    /// The nftables table could not be applied.
    #[error("[network] {0}")]
    Nft(#[source] NftError),
    /// A host operation failed: what was being done, and the OS's answer.
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    /// A sandbox asked for a policy that is not possible here.
    #[error("{0}")]
    InvalidPolicy(String),
    /// A sandbox asked for a policy that is not valid.
    #[error("network: {0}")]
    Policy(#[source] PolicyError),
    /// The sandbox is not (or no longer) recorded.
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    /// The store failed or refused.
    #[error("store: {0}")]
    Store(#[from] sandpit_store::StoreError),
    /// A policy or the daemon's network state would not encode or decode.
    #[error("{what}: {source}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// A blocking task applying a policy panicked or was cancelled.
    #[error("task: {0}")]
    Task(#[source] tokio::task::JoinError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn net_errors_read_as_before_and_keep_their_cause() {
        let policy = NetError::Policy(PolicyError::TooManyRules);
        assert_eq!(policy.to_string(), "network: at most 256 rules");
        assert!(policy.source().is_some_and(|s| s.is::<PolicyError>()));
        let value = NetError::ConfigValue(PolicyError::NotANetwork("x".into()));
        assert_eq!(
            value.to_string(),
            "[network] \"x\" is not an IPv4 network (a.b.c.d/len)"
        );
        assert!(value.source().is_some());
        let dns = NetError::Dns(DnsError::ZeroLimit("dns_cache_total"));
        assert_eq!(
            dns.to_string(),
            "[network] dns_cache_total must be at least 1"
        );
        assert!(dns.source().is_some_and(|s| s.is::<DnsError>()));
        let nft = NetError::Nft(NftError::Spawn(std::io::Error::from(
            std::io::ErrorKind::NotFound,
        )));
        assert!(nft.to_string().starts_with("[network] run nft: "), "{nft}");
        assert!(nft.source().and_then(|s| s.source()).is_some());
        let json = NetError::Json {
            what: "encode the network policy",
            source: serde_json::from_str::<u8>("x").unwrap_err(),
        };
        assert!(
            json.to_string().starts_with("encode the network policy: "),
            "{json}"
        );
        assert!(json.source().is_some_and(|s| s.is::<serde_json::Error>()));
    }

    #[tokio::test]
    async fn a_failed_task_is_kept() {
        let join = tokio::spawn(async { panic!("boom") }).await.unwrap_err();
        let e = NetError::Task(join);
        assert!(e.to_string().starts_with("task: "), "{e}");
        assert!(e.source().is_some_and(|s| s.is::<tokio::task::JoinError>()));
    }
}
