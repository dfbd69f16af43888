//! The sandbox state machine and everything it owns: creating, claiming from a warm pool,
//! pausing, hibernating, waking, snapshotting, restoring, forking, deleting and reconciling
//! sandboxes, and the templates, volumes, leases and metering around them.
//!
//! One file per operation where an operation is big enough to have one: "how does a fork
//! work" is answered by `sandbox_fork.rs`. No HTTP API types live here: callers get a
//! [`CoreError`] and the server maps it to statuses in one place. The agent inside each
//! sandbox is reached through [`agent_conn`] (Connect RPC and HTTP over the agent's own
//! socket, which is a transport, not the public API).

#![forbid(unsafe_code)]

pub mod access;
pub mod agent_conn;
pub mod agent_run;
pub mod agent_runtime;
pub mod approvals;
pub mod error;
pub mod exec;
pub mod leases;
pub mod lifecycle;
pub mod manager;
pub mod metrics_history;
pub mod pool_claim;
pub mod pool_manage;
pub mod pools;
pub mod reconcile;
pub mod sandbox_create;
pub mod sandbox_delete;
pub mod sandbox_fork;
pub mod sandbox_hibernate;
pub mod sandbox_pause;
pub mod sandbox_watch;
pub mod snapshot_create;
pub mod snapshot_delete;
pub mod snapshot_restore;
pub mod snapshot_store;
pub mod snapshots;
pub mod templates;
pub mod usage;
pub mod volumes;

/// The credential broker the manager binds secrets with.
pub use sandpit_broker as broker;
/// Sandbox networking the manager plans and attaches.
pub use sandpit_net as net;

pub use error::CoreError;
pub use manager::{Manager, ManagerConfig};

#[cfg(test)]
mod manager_tests;
#[cfg(test)]
pub(crate) mod testing;
