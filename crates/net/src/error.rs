//! What can go wrong in sandbox networking, with the cause kept.

/// Why networking could not be set up, or a sandbox's policy not planned or applied.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The `[network]` configuration cannot be used on this host.
    #[error("[network] {0}")]
    Config(String),
    /// A host operation failed: what was being done, and the OS's answer.
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    /// A sandbox asked for a policy that is not valid, or not possible here.
    #[error("{0}")]
    InvalidPolicy(String),
    /// The sandbox is not (or no longer) recorded.
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    #[error("store: {0}")]
    Store(#[from] sandpit_store::StoreError),
    /// Anything else: a failed task, a policy that would not serialize.
    #[error("{0}")]
    Internal(String),
}
