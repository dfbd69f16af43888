//! What the daemon and the in-sandbox agent agree on. The daemon (`sandpit-runtime`) writes
//! the agent's start-up config and starts it under a fixed name; the agent
//! (`sandpit-agent`) reads that config and acts as the sandbox's accounts. Both sides
//! depend on this crate, so neither has to depend on the other.

#![forbid(unsafe_code)]

pub mod config;
pub mod proc;

pub use config::{AgentConfig, CONFIG_ENV, IsolationMode, Live};
pub use proc::kill_tree;

/// The name (argv[0]) under which the `sandpit` binary runs as the agent.
pub const AGENT_ARGV0: &str = "sandpit-agent";

/// Uid (and gid) of `root` inside a container sandbox.
pub const ROOT_UID: u32 = 0;

/// Uid (and gid) of the unprivileged `user` account inside container sandboxes.
pub const USER_UID: u32 = 1000;
