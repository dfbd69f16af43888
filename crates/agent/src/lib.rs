//! The in-sandbox agent. It runs as PID 1 of a container sandbox (or as a plain child of
//! the daemon for the unisolated `process` runtime), reaps orphans, forwards termination
//! to its children, and serves `process.Process`, `filesystem.Filesystem` and HTTP
//! `/files` to the daemon over an inherited unix socket, and the code interpreter under `/code`.
//! Run as `sandpit-supervisor` ([`supervise`]), the same binary supervises one command
//! (an agent run's harness) and every process it leaves behind.

#![allow(refining_impl_trait)]

pub mod config;
pub mod encoding;
pub mod files_http;
pub mod fs;
pub mod interp;
pub mod metadata;
pub mod process;
pub mod rusage;
pub mod server;
pub mod sudo;
pub mod supervise;
mod users;
pub mod watch;

pub use config::{AgentConfig, IsolationMode};
pub use server::{AgentError, run, run_from_env};
pub use users::USER_UID;
