//! Usage metering: state changes of every sandbox (active time is time spent running),
//! sampled counters (CPU, memory peak, disk), a usage log by reason, and one execution
//! record per command. Rows here outlive the sandboxes they describe.

use serde::{Deserialize, Serialize};
use sqlx::sqlite::SqliteRow;
use sqlx::{QueryBuilder, Row, Sqlite};

use crate::{Store, StoreError};

/// The state name that counts as active time.
const ACTIVE_STATE: &str = "running";
/// Usage-log reason of sampled CPU time (amount in nanoseconds).
pub const CPU_REASON: &str = "cpu";

/// One thing to record; the daemon batches them and writes many in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UsageEvent {
    /// A sandbox changed state; the first event of a sandbox opens its usage row.
    State {
        /// Sandbox id.
        sandbox_id: String,
        /// Its owner.
        owner: String,
        /// The new state's name (`running`, `paused`, `stopping`...).
        state: String,
        /// When, unix milliseconds.
        at_ms: i64,
        /// The sandbox's creation time (used when the row is opened).
        created_at_ms: i64,
        /// Whether this state ends the sandbox's life.
        ends: bool,
        /// CPU counter value that belongs to somebody else (a warm pool's idle time),
        /// subtracted from later samples; used when the row is opened.
        cpu_base_ns: i64,
    },
    /// A reading of the sandbox's cumulative counters.
    Sample {
        /// Sandbox id.
        sandbox_id: String,
        /// When, unix milliseconds.
        at_ms: i64,
        /// Cumulative CPU time of the sandbox's cgroup.
        cpu_raw_ns: i64,
        /// Memory high-water mark.
        memory_peak_bytes: i64,
        /// Bytes used in the writable layer, when measurable.
        disk_used_bytes: Option<i64>,
    },
    /// One usage-log entry.
    Log {
        /// Sandbox id.
        sandbox_id: String,
        /// Its owner.
        owner: String,
        /// Why: `command`, `file`, `keepalive`, `lease`...
        reason: String,
        /// When, unix milliseconds.
        at_ms: i64,
        /// A quantity in the reason's unit (milliseconds, bytes, count).
        amount: i64,
        /// Short free text (the operation's name).
        details: Option<String>,
    },
    /// An execution record, inserted or replaced by id.
    Execution(ExecutionRecord),
}

/// One command's execution record (the shape of seed 003's observability example).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutionRecord {
    /// Unique id.
    pub id: String,
    /// Sandbox the command ran in.
    pub sandbox_id: String,
    /// Owner of the caller.
    pub owner: String,
    /// The caller's API key, when the request carried one.
    pub api_key_id: Option<String>,
    /// The program (argv\[0\]); arguments are not kept, they may hold secrets.
    pub command: String,
    /// The command's pid in the sandbox.
    pub pid: Option<i64>,
    /// Started in the background: its end is not observed.
    pub background: bool,
    /// When the request arrived, unix milliseconds.
    pub created_at_ms: i64,
    /// When the process started.
    pub started_at_ms: Option<i64>,
    /// When it ended.
    pub ended_at_ms: Option<i64>,
    /// User plus system CPU time of the command and the descendants it (or the agent) reaped.
    pub cpu_time_ms: Option<i64>,
    /// Largest resident set of the command or one of those descendants, KiB.
    pub memory_peak_kb: Option<i64>,
    /// Exit code (128 + signal when killed).
    pub exit_code: Option<i64>,
    /// Killed by its timeout.
    pub timed_out: bool,
    /// Bytes written to stdout (or the pty), all of them, not only those returned.
    pub stdout_bytes: i64,
    /// Bytes written to stderr.
    pub stderr_bytes: i64,
}

/// One page of executions, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutionPage {
    /// The records.
    pub items: Vec<ExecutionRecord>,
    /// Cursor of the next (older) page.
    pub next_cursor: Option<String>,
}

/// Metering of one sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxUsageRecord {
    /// Sandbox id.
    pub sandbox_id: String,
    /// Its owner.
    pub owner: String,
    /// Last state recorded.
    pub state: String,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
    /// When it stopped, if it did.
    pub ended_at_ms: Option<i64>,
    /// CPU time charged to the owner.
    pub cpu_ns: i64,
    /// Memory high-water mark.
    pub memory_peak_bytes: i64,
    /// Writable layer usage at the last sample.
    pub disk_used_bytes: Option<i64>,
    /// Network egress (stays 0 until sandboxes have networking).
    pub egress_bytes: i64,
    /// Time of the last sample or state change.
    pub sampled_at_ms: i64,
    /// Every state change, oldest first: (state, unix ms).
    pub states: Vec<(String, i64)>,
}

/// What one owner used in a period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerUsage {
    /// Sandboxes alive at some point of the period, with their state history.
    pub sandboxes: Vec<SandboxUsageRecord>,
    /// CPU time sampled within the period.
    pub cpu_ns: i64,
    /// Executions created within the period.
    pub executions: i64,
    /// Usage-log totals by reason: (reason, entries, sum of amounts).
    pub log: Vec<(String, i64, i64)>,
}

/// Milliseconds spent in the running state within `[from, to)`, given a sandbox's state
/// changes in order. The last state lasts until `to` (pass `now` for a live sandbox).
pub fn active_ms(states: &[(String, i64)], from: i64, to: i64) -> i64 {
    let mut total = 0;
    for (i, (state, at)) in states.iter().enumerate() {
        if state != ACTIVE_STATE {
            continue;
        }
        let end = states.get(i + 1).map(|(_, next)| *next).unwrap_or(to);
        let (start, end) = ((*at).max(from), end.min(to));
        if end > start {
            total += end - start;
        }
    }
    total
}

fn execution_from_row(row: &SqliteRow) -> Result<ExecutionRecord, StoreError> {
    let background: i64 = row.try_get("background")?;
    let timed_out: i64 = row.try_get("timed_out")?;
    Ok(ExecutionRecord {
        id: row.try_get("id")?,
        sandbox_id: row.try_get("sandbox_id")?,
        owner: row.try_get("owner")?,
        api_key_id: row.try_get("api_key_id")?,
        command: row.try_get("command")?,
        pid: row.try_get("pid")?,
        background: background != 0,
        created_at_ms: row.try_get("created_at_ms")?,
        started_at_ms: row.try_get("started_at_ms")?,
        ended_at_ms: row.try_get("ended_at_ms")?,
        cpu_time_ms: row.try_get("cpu_time_ms")?,
        memory_peak_kb: row.try_get("memory_peak_kb")?,
        exit_code: row.try_get("exit_code")?,
        timed_out: timed_out != 0,
        stdout_bytes: row.try_get("stdout_bytes")?,
        stderr_bytes: row.try_get("stderr_bytes")?,
    })
}

const EXECUTION_COLUMNS: &str = "id, sandbox_id, owner, api_key_id, command, pid, background, \
     created_at_ms, started_at_ms, ended_at_ms, cpu_time_ms, memory_peak_kb, exit_code, \
     timed_out, stdout_bytes, stderr_bytes";

const USAGE_COLUMNS: &str = "sandbox_id, owner, state, created_at_ms, ended_at_ms, cpu_ns, \
     memory_peak_bytes, disk_used_bytes, egress_bytes, sampled_at_ms";

fn usage_from_row(row: &SqliteRow) -> Result<SandboxUsageRecord, StoreError> {
    Ok(SandboxUsageRecord {
        sandbox_id: row.try_get("sandbox_id")?,
        owner: row.try_get("owner")?,
        state: row.try_get("state")?,
        created_at_ms: row.try_get("created_at_ms")?,
        ended_at_ms: row.try_get("ended_at_ms")?,
        cpu_ns: row.try_get("cpu_ns")?,
        memory_peak_bytes: row.try_get("memory_peak_bytes")?,
        disk_used_bytes: row.try_get("disk_used_bytes")?,
        egress_bytes: row.try_get("egress_bytes")?,
        sampled_at_ms: row.try_get("sampled_at_ms")?,
        states: Vec::new(),
    })
}

fn encode_cursor(created_at_ms: i64, id: &str) -> String {
    hex::encode(format!("{created_at_ms}:{id}"))
}

fn decode_cursor(cursor: &str) -> Result<(i64, String), StoreError> {
    let bytes = hex::decode(cursor).map_err(|_| StoreError::InvalidCursor)?;
    let text = String::from_utf8(bytes).map_err(|_| StoreError::InvalidCursor)?;
    let (ts, id) = text.split_once(':').ok_or(StoreError::InvalidCursor)?;
    let ts = ts.parse().map_err(|_| StoreError::InvalidCursor)?;
    if id.is_empty() {
        return Err(StoreError::InvalidCursor);
    }
    Ok((ts, id.to_string()))
}

type Tx<'a> = sqlx::Transaction<'a, Sqlite>;

/// Records a state change (opening the sandbox's usage row with the first one).
async fn write_state(tx: &mut Tx<'_>, ev: &UsageEvent) -> Result<(), StoreError> {
    let UsageEvent::State {
        sandbox_id,
        owner,
        state,
        at_ms,
        created_at_ms,
        ends,
        cpu_base_ns,
    } = ev
    else {
        return Ok(());
    };
    sqlx::query(
        "INSERT INTO sandbox_usage (sandbox_id, owner, state, created_at_ms, ended_at_ms, cpu_ns, \
         cpu_base_ns, cpu_last_raw_ns, memory_peak_bytes, disk_used_bytes, egress_bytes, sampled_at_ms) \
         VALUES ($1, $2, $3, $4, CASE WHEN $5 THEN $6 ELSE NULL END, 0, $7, NULL, 0, NULL, 0, $6) \
         ON CONFLICT (sandbox_id) DO UPDATE SET state = excluded.state, \
         sampled_at_ms = CASE WHEN excluded.sampled_at_ms > sandbox_usage.sampled_at_ms \
         THEN excluded.sampled_at_ms ELSE sandbox_usage.sampled_at_ms END, \
         ended_at_ms = CASE WHEN $5 THEN COALESCE(sandbox_usage.ended_at_ms, $6) \
         ELSE sandbox_usage.ended_at_ms END",
    )
    .bind(sandbox_id)
    .bind(owner)
    .bind(state)
    .bind(*created_at_ms)
    .bind(*ends)
    .bind(*at_ms)
    .bind(*cpu_base_ns)
    .execute(&mut **tx)
    .await?;
    sqlx::query("INSERT INTO usage_states (sandbox_id, state, at_ms) VALUES ($1, $2, $3)")
        .bind(sandbox_id)
        .bind(state)
        .bind(*at_ms)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn write_sample(
    tx: &mut Tx<'_>,
    sandbox_id: &str,
    at_ms: i64,
    cpu_raw_ns: i64,
    memory_peak_bytes: i64,
    disk_used_bytes: Option<i64>,
) -> Result<(), StoreError> {
    let row = sqlx::query(
        "SELECT owner, cpu_base_ns, cpu_last_raw_ns FROM sandbox_usage WHERE sandbox_id = $1",
    )
    .bind(sandbox_id)
    .fetch_optional(&mut **tx)
    .await?;
    // A sample of a sandbox nobody owns yet (an idle pool member) is not anyone's usage.
    let Some(row) = row else { return Ok(()) };
    let owner: String = row.try_get("owner")?;
    let base: i64 = row.try_get("cpu_base_ns")?;
    let last: Option<i64> = row.try_get("cpu_last_raw_ns")?;
    let previous = last.unwrap_or(base);
    // A counter that went backwards was reset (the sandbox got a new cgroup): all of the
    // new reading is new time.
    let delta = if cpu_raw_ns >= previous {
        cpu_raw_ns - previous
    } else {
        cpu_raw_ns
    };
    sqlx::query(
        "UPDATE sandbox_usage SET cpu_ns = cpu_ns + $1, cpu_last_raw_ns = $2, \
         memory_peak_bytes = CASE WHEN $3 > memory_peak_bytes THEN $3 ELSE memory_peak_bytes END, \
         disk_used_bytes = COALESCE($4, disk_used_bytes), \
         sampled_at_ms = CASE WHEN $5 > sampled_at_ms THEN $5 ELSE sampled_at_ms END \
         WHERE sandbox_id = $6",
    )
    .bind(delta)
    .bind(cpu_raw_ns)
    .bind(memory_peak_bytes)
    .bind(disk_used_bytes)
    .bind(at_ms)
    .bind(sandbox_id)
    .execute(&mut **tx)
    .await?;
    if delta > 0 {
        write_log(tx, sandbox_id, &owner, CPU_REASON, at_ms, delta, None).await?;
    }
    Ok(())
}

async fn write_log(
    tx: &mut Tx<'_>,
    sandbox_id: &str,
    owner: &str,
    reason: &str,
    at_ms: i64,
    amount: i64,
    details: Option<&str>,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO usage_log (sandbox_id, owner, reason, at_ms, amount, details) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(sandbox_id)
    .bind(owner)
    .bind(reason)
    .bind(at_ms)
    .bind(amount)
    .bind(details)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn write_execution(tx: &mut Tx<'_>, e: &ExecutionRecord) -> Result<(), StoreError> {
    sqlx::query(&format!(
        "INSERT INTO executions ({EXECUTION_COLUMNS}) VALUES \
         ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) \
         ON CONFLICT (id) DO UPDATE SET pid = excluded.pid, \
         started_at_ms = excluded.started_at_ms, ended_at_ms = excluded.ended_at_ms, \
         cpu_time_ms = excluded.cpu_time_ms, memory_peak_kb = excluded.memory_peak_kb, \
         exit_code = excluded.exit_code, timed_out = excluded.timed_out, \
         stdout_bytes = excluded.stdout_bytes, stderr_bytes = excluded.stderr_bytes"
    ))
    .bind(&e.id)
    .bind(&e.sandbox_id)
    .bind(&e.owner)
    .bind(&e.api_key_id)
    .bind(&e.command)
    .bind(e.pid)
    .bind(i64::from(e.background))
    .bind(e.created_at_ms)
    .bind(e.started_at_ms)
    .bind(e.ended_at_ms)
    .bind(e.cpu_time_ms)
    .bind(e.memory_peak_kb)
    .bind(e.exit_code)
    .bind(i64::from(e.timed_out))
    .bind(e.stdout_bytes)
    .bind(e.stderr_bytes)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl Store {
    /// Writes a batch of usage events in one transaction (one commit for many requests).
    pub async fn record_usage(&self, events: &[UsageEvent]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let mut tx = self.writer.begin().await?;
        for ev in events {
            match ev {
                UsageEvent::State { .. } => write_state(&mut tx, ev).await?,
                UsageEvent::Sample {
                    sandbox_id,
                    at_ms,
                    cpu_raw_ns,
                    memory_peak_bytes,
                    disk_used_bytes,
                } => {
                    write_sample(
                        &mut tx,
                        sandbox_id,
                        *at_ms,
                        *cpu_raw_ns,
                        *memory_peak_bytes,
                        *disk_used_bytes,
                    )
                    .await?
                }
                UsageEvent::Log {
                    sandbox_id,
                    owner,
                    reason,
                    at_ms,
                    amount,
                    details,
                } => {
                    write_log(
                        &mut tx,
                        sandbox_id,
                        owner,
                        reason,
                        *at_ms,
                        *amount,
                        details.as_deref(),
                    )
                    .await?
                }
                UsageEvent::Execution(e) => write_execution(&mut tx, e).await?,
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// State changes of one sandbox, oldest first.
    async fn usage_states(&self, sandbox_id: &str) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = sqlx::query(
            "SELECT state, at_ms FROM usage_states WHERE sandbox_id = $1 ORDER BY at_ms, id",
        )
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| Ok((r.try_get("state")?, r.try_get("at_ms")?)))
            .collect()
    }

    /// Metering of one sandbox (also after it is gone), with its state history.
    pub async fn sandbox_usage(
        &self,
        sandbox_id: &str,
    ) -> Result<Option<SandboxUsageRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {USAGE_COLUMNS} FROM sandbox_usage WHERE sandbox_id = $1"
        ))
        .bind(sandbox_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let mut rec = usage_from_row(&row)?;
        rec.states = self.usage_states(sandbox_id).await?;
        Ok(Some(rec))
    }

    /// What `owner` used within `[from_ms, to_ms)`.
    pub async fn owner_usage(
        &self,
        owner: &str,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<OwnerUsage, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {USAGE_COLUMNS} FROM sandbox_usage WHERE owner = $1 AND created_at_ms < $2 \
             AND (ended_at_ms IS NULL OR ended_at_ms >= $3) ORDER BY created_at_ms, sandbox_id"
        ))
        .bind(owner)
        .bind(to_ms)
        .bind(from_ms)
        .fetch_all(&self.pool)
        .await?;
        let mut sandboxes = rows
            .iter()
            .map(usage_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        if !sandboxes.is_empty() {
            let mut qb: QueryBuilder<'_, Sqlite> = QueryBuilder::new(
                "SELECT sandbox_id, state, at_ms FROM usage_states WHERE sandbox_id IN (",
            );
            let mut list = qb.separated(", ");
            for s in &sandboxes {
                list.push_bind(s.sandbox_id.clone());
            }
            list.push_unseparated(") ORDER BY sandbox_id, at_ms, id");
            let mut by_id: std::collections::HashMap<String, Vec<(String, i64)>> =
                std::collections::HashMap::new();
            for r in qb.build().fetch_all(&self.pool).await? {
                let id: String = r.try_get("sandbox_id")?;
                by_id
                    .entry(id)
                    .or_default()
                    .push((r.try_get("state")?, r.try_get("at_ms")?));
            }
            for s in &mut sandboxes {
                s.states = by_id.remove(&s.sandbox_id).unwrap_or_default();
            }
        }
        let log_rows = sqlx::query(
            "SELECT reason, COUNT(*) AS n, COALESCE(SUM(amount), 0) AS total FROM usage_log \
             WHERE owner = $1 AND at_ms >= $2 AND at_ms < $3 GROUP BY reason ORDER BY reason",
        )
        .bind(owner)
        .bind(from_ms)
        .bind(to_ms)
        .fetch_all(&self.pool)
        .await?;
        let mut log = Vec::new();
        let mut cpu_ns = 0;
        for r in &log_rows {
            let (reason, n, total): (String, i64, i64) =
                (r.try_get("reason")?, r.try_get("n")?, r.try_get("total")?);
            if reason == CPU_REASON {
                cpu_ns = total;
            }
            log.push((reason, n, total));
        }
        let (executions,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM executions WHERE owner = $1 AND created_at_ms >= $2 \
             AND created_at_ms < $3",
        )
        .bind(owner)
        .bind(from_ms)
        .bind(to_ms)
        .fetch_one(&self.pool)
        .await?;
        Ok(OwnerUsage {
            sandboxes,
            cpu_ns,
            executions,
            log,
        })
    }

    /// Execution records of a sandbox, newest first; `limit` is clamped to 1..=1000.
    pub async fn list_executions(
        &self,
        sandbox_id: &str,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<ExecutionPage, StoreError> {
        let limit = if limit == 0 { 100 } else { limit.min(1000) } as usize;
        let mut qb: QueryBuilder<'_, Sqlite> = QueryBuilder::new(format!(
            "SELECT {EXECUTION_COLUMNS} FROM executions WHERE sandbox_id = "
        ));
        qb.push_bind(sandbox_id.to_string());
        if let Some(c) = cursor {
            let (ts, id) = decode_cursor(c)?;
            qb.push(" AND (created_at_ms < ")
                .push_bind(ts)
                .push(" OR (created_at_ms = ")
                .push_bind(ts)
                .push(" AND id < ")
                .push_bind(id)
                .push("))");
        }
        qb.push(" ORDER BY created_at_ms DESC, id DESC LIMIT ")
            .push_bind(limit as i64 + 1);
        let rows = qb.build().fetch_all(&self.pool).await?;
        let mut items = rows
            .iter()
            .map(execution_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let next_cursor = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|e| encode_cursor(e.created_at_ms, &e.id))
        } else {
            None
        };
        Ok(ExecutionPage { items, next_cursor })
    }

    /// Number of execution records of a sandbox.
    pub async fn count_executions(&self, sandbox_id: &str) -> Result<i64, StoreError> {
        let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM executions WHERE sandbox_id = $1")
            .bind(sandbox_id)
            .fetch_one(&self.pool)
            .await?;
        Ok(n)
    }

    /// Closes the usage of sandboxes that ended without their last state being recorded
    /// (a crash between the change and the write): every open row whose sandbox is not in
    /// `live` ends at its last sample. Returns how many were closed.
    pub async fn close_orphaned_usage(&self, live: &[String]) -> Result<u64, StoreError> {
        let open: Vec<(String, i64)> = sqlx::query_as(
            "SELECT sandbox_id, sampled_at_ms FROM sandbox_usage WHERE ended_at_ms IS NULL",
        )
        .fetch_all(&self.writer)
        .await?;
        let live: std::collections::HashSet<&str> = live.iter().map(String::as_str).collect();
        let mut tx = self.writer.begin().await?;
        let mut closed = 0;
        for (id, at) in open.iter().filter(|(id, _)| !live.contains(id.as_str())) {
            sqlx::query(
                "UPDATE sandbox_usage SET ended_at_ms = $1, state = 'stopped' WHERE sandbox_id = $2",
            )
            .bind(at)
            .bind(id)
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "INSERT INTO usage_states (sandbox_id, state, at_ms) VALUES ($1, 'stopped', $2)",
            )
            .bind(id)
            .bind(at)
            .execute(&mut *tx)
            .await?;
            closed += 1;
        }
        tx.commit().await?;
        Ok(closed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn states(list: &[(&str, i64)]) -> Vec<(String, i64)> {
        list.iter().map(|(s, t)| (s.to_string(), *t)).collect()
    }

    #[test]
    fn active_time_excludes_paused_and_clips_to_the_period() {
        let s = states(&[
            ("running", 1000),
            ("paused", 3000),
            ("running", 7000),
            ("stopping", 8000),
        ]);
        assert_eq!(active_ms(&s, 0, 10_000), 3000);
        // Clipped on both sides: [2000, 7500) holds 1000 + 500 running.
        assert_eq!(active_ms(&s, 2000, 7500), 1500);
        assert_eq!(active_ms(&s, 3000, 7000), 0);
        // A sandbox still running counts up to `to`.
        let live = states(&[("running", 1000), ("paused", 2000), ("running", 5000)]);
        assert_eq!(active_ms(&live, 0, 6000), 2000);
        // Repeated states do not double count.
        let dup = states(&[("running", 0), ("running", 10), ("stopping", 20)]);
        assert_eq!(active_ms(&dup, 0, 100), 20);
        assert_eq!(active_ms(&[], 0, 100), 0);
    }

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        let c = encode_cursor(42, "ex:1");
        assert_eq!(decode_cursor(&c).unwrap(), (42, "ex:1".to_string()));
        for bad in ["", "zz", &hex::encode("x:y"), &hex::encode("5:")] {
            assert!(matches!(decode_cursor(bad), Err(StoreError::InvalidCursor)));
        }
    }
}
