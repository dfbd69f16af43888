//! Bodies of the usage metering routes: `/v1/usage`, `/v1/sandboxes/{id}/usage` and
//! `/v1/sandboxes/{id}/executions`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// What `egress_bytes` counts.
pub const EGRESS_NOTE: &str = "sent through the egress proxy";

/// Metering of one sandbox (also after it is gone).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct SandboxUsage {
    pub sandbox_id: String,
    pub owner: String,
    /// Last recorded state.
    pub state: String,
    /// Unix milliseconds.
    pub created_at_ms: i64,
    pub ended_at_ms: Option<i64>,
    /// Seconds spent running; paused time is excluded.
    pub active_seconds: f64,
    /// Seconds from creation to the end (or now).
    pub wall_seconds: f64,
    /// CPU time of every process of the sandbox.
    pub cpu_time_ms: u64,
    /// Memory high-water mark of the sandbox (the writable layer counts: it is memory).
    pub memory_peak_bytes: u64,
    /// Bytes used in the writable layer; absent where the runtime has none (`process`).
    pub disk_used_bytes: Option<u64>,
    /// Bytes the sandbox sent out (through the egress proxy), see `egress_note`.
    pub egress_bytes: u64,
    pub egress_note: String,
    /// Execution records of the sandbox.
    pub executions: u64,
}

/// Totals of one usage-log reason.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct ReasonTotal {
    /// Entries.
    pub count: u64,
    /// Sum of their amounts (milliseconds for `command`, nanoseconds for `cpu`, bytes for
    /// file transfers, 1 per keep-alive or lease acquire).
    pub amount: i64,
}

/// `GET /v1/usage`: what one owner used in `[from_ms, to_ms)`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct UsageSummary {
    pub owner: String,
    pub from_ms: i64,
    pub to_ms: i64,
    /// Sandboxes alive at some point of the period.
    pub sandboxes: u64,
    /// Their running seconds within the period (paused time excluded).
    pub active_seconds: f64,
    /// CPU time sampled within the period.
    pub cpu_time_ms: u64,
    /// Commands started within the period.
    pub executions: u64,
    /// The usage log by reason (`command`, `file`, `keepalive`, `lease`, `cpu`).
    pub log: BTreeMap<String, ReasonTotal>,
}

/// When an execution happened (unix milliseconds).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct ExecutionTimes {
    /// The request arrived.
    pub created_ms: i64,
    /// The process started.
    pub started_ms: Option<i64>,
    /// The process ended (absent for background commands, whose end is not watched).
    pub ended_ms: Option<i64>,
}

/// What an execution consumed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct ExecutionResources {
    /// User plus system CPU time of the command and every descendant reaped by its end.
    pub cpu_time_ms: Option<u64>,
    /// Largest resident set among them, MiB (rounded up).
    pub memory_peak_mb: Option<u64>,
    pub memory_peak_kb: Option<u64>,
    /// Always 0: connections are not tied to commands (a sandbox's egress is metered whole).
    pub network_egress_kb: u64,
}

/// What an execution produced.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct ExecutionOutput {
    /// Every byte written to stdout (or the terminal), not only those returned.
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub exit_code: Option<i32>,
    pub timed_out: bool,
}

/// Who ran it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct ExecutionCaller {
    pub owner: String,
    pub api_key_id: Option<String>,
}

/// One command's execution record.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct Execution {
    pub execution_id: String,
    pub sandbox_id: String,
    pub caller: ExecutionCaller,
    /// The program (argv[0]); arguments are not recorded.
    pub command: String,
    pub pid: Option<u32>,
    pub background: bool,
    pub timestamp: ExecutionTimes,
    pub resources: ExecutionResources,
    pub output: ExecutionOutput,
}

/// `GET /v1/sandboxes/{id}/executions`: newest first.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ExecutionList {
    pub items: Vec<Execution>,
    pub next_cursor: Option<String>,
}
