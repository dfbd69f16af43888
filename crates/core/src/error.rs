//! The core's error: what went wrong, typed, with the failure underneath kept as the
//! source. The server maps each variant to an HTTP status in one place.

use std::error::Error as StdError;

/// A boxed underlying failure.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Why a sandbox operation did not happen.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// The caller asked for something malformed or out of range.
    #[error("{0}")]
    Invalid(String),
    /// A named thing (not a sandbox) does not exist or is not the caller's.
    #[error("{0}")]
    NotFound(String),
    /// The sandbox does not exist or is not the caller's.
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    /// The sandbox has stopped for good; its record can still be read.
    #[error("sandbox {id} is {state}")]
    SandboxStopped { id: String, state: String },
    /// The thing is not in a state that allows the operation.
    #[error("{0}")]
    Conflict(String),
    /// The caller may not do this (a runtime not offered, a disallowed source).
    #[error("{0}")]
    Forbidden(String),
    /// The request was understood but the sandbox could not carry it out (a start command
    /// that failed, a writable layer over its disk limit).
    #[error("{message}")]
    Unprocessable { code: &'static str, message: String },
    /// The host has no room left for it (disk).
    #[error("{0}")]
    InsufficientStorage(String),
    /// A dependency is not ready or is out of capacity for now; trying later may work.
    #[error("{0}")]
    Unavailable(String),
    /// The sandbox's agent refused or failed a call.
    #[error("agent: {0}")]
    Agent(#[from] connectrpc::ConnectError),
    /// The store failed or refused.
    #[error(transparent)]
    Store(#[from] sandpit_store::StoreError),
    /// The runtime failed or refused.
    #[error(transparent)]
    Runtime(#[from] sandpit_runtime::RuntimeError),
    /// Sandbox networking failed or refused.
    #[error(transparent)]
    Net(#[from] sandpit_net::NetError),
    /// The credential broker failed or refused.
    #[error(transparent)]
    Broker(#[from] sandpit_broker::BrokerError),
    /// An image, layer or archive could not be read or written.
    #[error(transparent)]
    Image(#[from] sandpit_image::ImageError),
    /// A host file operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// Snapshot object storage failed.
    #[error("snapshot storage: {0}")]
    Storage(#[from] crate::snapshot_store::StorageError),
    /// Something that should not fail did; `source` keeps why when there is one.
    #[error("{context}")]
    Internal {
        context: String,
        #[source]
        source: Option<BoxError>,
    },
}

impl CoreError {
    /// A malformed or out-of-range request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }
    /// A missing thing that is not a sandbox.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::NotFound(message.into())
    }
    /// A missing (or foreign) sandbox.
    pub fn sandbox_not_found(id: &str) -> Self {
        Self::SandboxNotFound(id.to_string())
    }
    /// A sandbox that has stopped for good.
    pub fn sandbox_stopped(id: &str, state: &str) -> Self {
        Self::SandboxStopped {
            id: id.to_string(),
            state: state.to_string(),
        }
    }
    /// The operation does not fit the current state.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::Conflict(message.into())
    }
    /// Not ready or out of capacity for now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::Unavailable(message.into())
    }
    /// An internal failure with nothing underneath it.
    pub fn internal(context: impl Into<String>) -> Self {
        Self::Internal {
            context: context.into(),
            source: None,
        }
    }
    /// An internal failure caused by `source`.
    pub fn internal_from(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Internal {
            context: context.into(),
            source: Some(source.into()),
        }
    }
    /// A host file operation on `context` failed.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
    /// The whole chain of causes, for logs and messages (`a: b: c`).
    pub fn chain(&self) -> String {
        let mut out = self.to_string();
        let mut cur = self.source();
        while let Some(e) = cur {
            let s = e.to_string();
            if !out.ends_with(&s) {
                out.push_str(": ");
                out.push_str(&s);
            }
            cur = e.source();
        }
        out
    }
}

impl From<tokio::task::JoinError> for CoreError {
    fn from(e: tokio::task::JoinError) -> Self {
        Self::internal_from("a background task failed", e)
    }
}

impl From<serde_json::Error> for CoreError {
    fn from(e: serde_json::Error) -> Self {
        Self::internal_from("encoding state", e)
    }
}
