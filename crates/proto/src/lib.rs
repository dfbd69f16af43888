//! The agent protocol: `process.Process` and `filesystem.Filesystem` Connect RPC services
//! whose packages, methods and fields follow the public shape of E2B's in-sandbox daemon.
#![allow(clippy::all, missing_docs)]
#![forbid(unsafe_code)]

connectrpc::include_generated!();

pub use buffa;
pub use buffa_types;
pub use connectrpc;
