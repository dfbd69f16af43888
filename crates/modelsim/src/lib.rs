//! A scripted model server for tests of coding-agent harnesses.
//!
//! It speaks OpenAI Chat Completions (pi, opencode), Anthropic Messages (Claude Code) and
//! OpenAI Responses (Codex), streaming (SSE) or not, and answers each request from a
//! [`Script`]: the turn is the number of assistant turns already in the request's
//! conversation, and a tool call names alternatives so the first tool the request offers is
//! used. Requests offering no tools (titles, quota probes) get a side text. Every request
//! is recorded, with its headers, in memory and optionally in a JSON lines file.
//!
//! ```no_run
//! # async fn demo() -> Result<(), sandpit_modelsim::ModelSimError> {
//! use sandpit_modelsim::{Config, ModelServer, Script, ToolCall, Turn};
//! use serde_json::json;
//! let script = Script::new()
//!     .turn(Turn::tool(ToolCall::new("bash", json!({"command": "ls"})).or("Bash", json!({"command": "ls"}))))
//!     .turn(Turn::text("done"));
//! let server = ModelServer::start(Config::new("127.0.0.1:0".parse().unwrap(), script)).await?;
//! println!("point the harness at {}/v1", server.base_url());
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod error;
mod record;
mod script;
mod server;
mod tls;
mod wire;

pub use error::ModelSimError;
pub use record::RecordedRequest;
pub use script::{Script, ToolCall, ToolChoice, Turn};
pub use server::{Config, ModelServer};
pub use tls::{TestCa, TestCaFiles, TlsIdentity};
pub use wire::Api;
