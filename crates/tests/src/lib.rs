//! Harness for end-to-end tests: [`Daemon::builder`] starts `sandpit serve` on a loopback
//! port with its own data directory and tears everything down again; [`fixtures`] holds
//! what the test files share; [`netfix`] is a test "internet" in a network namespace;
//! [`agents`] holds the agent-run tests' model server and helpers.

pub mod agents;
pub mod daemon;
pub mod fixtures;
pub mod netfix;

pub use daemon::{Daemon, DaemonBuilder, sandpit_bin};
pub use fixtures::*;
