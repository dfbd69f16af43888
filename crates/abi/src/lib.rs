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

/// The name (argv[0]) under which the `sandpit` binary runs as the supervisor of one
/// command (an agent run's harness): `sandpit-supervisor GRACE_MS -- COMMAND [ARGS...]`.
pub const SUPERVISOR_ARGV0: &str = "sandpit-supervisor";

/// Header of a `process.Process` start (sandpit's own) asking the agent to run the
/// command under the supervisor; its value is the grace period in milliseconds between
/// the SIGTERM and the SIGKILL the supervisor sends to everything below it.
pub const SUPERVISE_HEADER: &str = "sandpit-supervise";

/// The longest grace period a supervised command may be given: the daemon's cancel
/// waits for it.
pub const MAX_SUPERVISE_GRACE: std::time::Duration = std::time::Duration::from_secs(300);

/// Uid (and gid) of `root` inside a container sandbox.
pub const ROOT_UID: u32 = 0;

/// Uid (and gid) of the unprivileged `user` account inside container sandboxes.
pub const USER_UID: u32 = 1000;
