//! Per-sandbox metrics history: one row per sample of a running sandbox (CPU, memory,
//! disk, network), written in batches by the daemon's sampler, read by time range, pruned
//! past the retention and removed with the sandbox's record (`ON DELETE CASCADE`).

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{Store, StoreError};

/// One sample of a sandbox's resources.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricSample {
    /// Sandbox id.
    pub sandbox_id: String,
    /// When it was read, unix milliseconds.
    pub at_ms: i64,
    /// Whole CPUs the sandbox may use (its CPU limit rounded up).
    pub cpu_count: i64,
    /// Share of its CPU limit used since the previous sample, 0 to 100.
    pub cpu_used_pct: f64,
    /// Memory in use other than the page cache, bytes.
    pub mem_used: i64,
    /// Its memory limit, bytes.
    pub mem_total: i64,
    /// Its page cache, bytes.
    pub mem_cache: i64,
    /// Bytes used in its writable layer.
    pub disk_used: i64,
    /// Size of its writable layer, bytes.
    pub disk_total: i64,
    /// Bytes its network link has received (cumulative; 0 without a link).
    pub net_rx: i64,
    /// Bytes its network link has sent (cumulative; 0 without a link).
    pub net_tx: i64,
}

const COLUMNS: &str = "sandbox_id, at_ms, cpu_count, cpu_used_pct, mem_used, mem_total, \
                       mem_cache, disk_used, disk_total, net_rx, net_tx";

fn row_to_sample(r: &SqliteRow) -> Result<MetricSample, StoreError> {
    Ok(MetricSample {
        sandbox_id: r.try_get("sandbox_id")?,
        at_ms: r.try_get("at_ms")?,
        cpu_count: r.try_get("cpu_count")?,
        cpu_used_pct: r.try_get("cpu_used_pct")?,
        mem_used: r.try_get("mem_used")?,
        mem_total: r.try_get("mem_total")?,
        mem_cache: r.try_get("mem_cache")?,
        disk_used: r.try_get("disk_used")?,
        disk_total: r.try_get("disk_total")?,
        net_rx: r.try_get("net_rx")?,
        net_tx: r.try_get("net_tx")?,
    })
}

impl Store {
    /// Writes a batch of samples in one transaction and returns how many were kept. A
    /// sample of a sandbox whose record is gone (deleted between the reading and the
    /// write) is skipped rather than failing the batch; a second sample of the same
    /// sandbox and millisecond is ignored.
    pub async fn record_metrics(&self, samples: &[MetricSample]) -> Result<u64, StoreError> {
        if samples.is_empty() {
            return Ok(0);
        }
        let mut tx = self.writer.begin().await?;
        let mut kept = 0;
        for s in samples {
            let done = sqlx::query(
                "INSERT INTO sandbox_metrics (sandbox_id, at_ms, cpu_count, cpu_used_pct, \
                 mem_used, mem_total, mem_cache, disk_used, disk_total, net_rx, net_tx) \
                 SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11 \
                 WHERE EXISTS (SELECT 1 FROM sandboxes WHERE id = $1) \
                 ON CONFLICT (sandbox_id, at_ms) DO NOTHING",
            )
            .bind(&s.sandbox_id)
            .bind(s.at_ms)
            .bind(s.cpu_count)
            .bind(s.cpu_used_pct)
            .bind(s.mem_used)
            .bind(s.mem_total)
            .bind(s.mem_cache)
            .bind(s.disk_used)
            .bind(s.disk_total)
            .bind(s.net_rx)
            .bind(s.net_tx)
            .execute(&mut *tx)
            .await?;
            kept += done.rows_affected();
        }
        tx.commit().await?;
        Ok(kept)
    }

    /// Samples of one sandbox with `start_ms <= at_ms < end_ms`, oldest first, at most
    /// `limit` of them.
    pub async fn metrics_range(
        &self,
        sandbox_id: &str,
        start_ms: i64,
        end_ms: i64,
        limit: u32,
    ) -> Result<Vec<MetricSample>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandbox_metrics \
             WHERE sandbox_id = $1 AND at_ms >= $2 AND at_ms < $3 \
             ORDER BY at_ms LIMIT $4"
        ))
        .bind(sandbox_id)
        .bind(start_ms)
        .bind(end_ms)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(row_to_sample).collect()
    }

    /// The newest sample of a sandbox, if it has any.
    pub async fn latest_metric(
        &self,
        sandbox_id: &str,
    ) -> Result<Option<MetricSample>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandbox_metrics WHERE sandbox_id = $1 \
             ORDER BY at_ms DESC LIMIT 1"
        ))
        .bind(sandbox_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(row_to_sample).transpose()
    }

    /// Removes every sample taken before `before_ms`; returns how many.
    pub async fn prune_metrics(&self, before_ms: i64) -> Result<u64, StoreError> {
        let done = sqlx::query("DELETE FROM sandbox_metrics WHERE at_ms < $1")
            .bind(before_ms)
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected())
    }
}
