//! Networking: each sandbox's egress policy (a JSON document the daemon validates), and
//! the audit of outbound connection attempts, which outlives the sandboxes it describes.

use sqlx::sqlite::SqliteRow;
use sqlx::{QueryBuilder, Row, Sqlite};

use crate::{Store, StoreError};

/// One audited outbound attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRecord {
    /// Assigned by the daemon (unique, increasing).
    pub id: i64,
    /// Unix ms when it was decided.
    pub at_ms: i64,
    /// The sandbox that made it.
    pub sandbox_id: String,
    /// The sandbox's owner at the time.
    pub owner: String,
    /// `tcp` or `dns`.
    pub protocol: String,
    /// Destination name (SNI, Host, DNS question or the name the address came from).
    pub dest_name: Option<String>,
    /// Destination address.
    pub dest_ip: Option<String>,
    /// Destination port.
    pub dest_port: i64,
    /// TLS server name sent.
    pub sni: Option<String>,
    /// HTTP Host sent.
    pub http_host: Option<String>,
    /// `allow` or `deny`.
    pub verdict: String,
    /// What decided.
    pub rule: String,
    /// Bytes from the sandbox.
    pub bytes_sent: i64,
    /// Bytes to the sandbox.
    pub bytes_received: i64,
    /// When an allowed connection closed.
    pub ended_at_ms: Option<i64>,
    /// Why an allowed connection failed.
    pub error: Option<String>,
    /// How many identical attempts the row stands for (1: itself alone).
    pub count: i64,
    /// When the last of them was decided (unix ms), once there is more than one.
    pub last_at_ms: Option<i64>,
}

/// One write of the audit writer; a batch goes in one transaction.
// Nearly every write is an insert: boxing it would cost an allocation each.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum AuditWrite {
    /// A new entry.
    Insert(AuditRecord),
    /// A connection closed: its byte counts and end.
    Close {
        /// Entry id.
        id: i64,
        /// Bytes from the sandbox.
        bytes_sent: i64,
        /// Bytes to the sandbox.
        bytes_received: i64,
        /// Unix ms.
        ended_at_ms: i64,
        /// Why it failed, if it did.
        error: Option<String>,
    },
    /// An aggregated row's count so far (absolute, so a repeated write is harmless), when
    /// the last of its attempts came, and a new rule text when it changes with the count.
    Count {
        /// Entry id.
        id: i64,
        /// Attempts the row stands for.
        count: i64,
        /// Unix ms of the last.
        last_at_ms: i64,
        /// Replaces the rule (a drop summary says how many it stands for).
        rule: Option<String>,
    },
    /// Bytes a sandbox sent out, added to its metered egress.
    Egress {
        /// Sandbox id.
        sandbox_id: String,
        /// Bytes.
        bytes: i64,
    },
}

/// Which audit entries to list.
#[derive(Debug, Clone, Default)]
pub struct AuditFilter {
    /// Only this owner's (None: everyone's).
    pub owner: Option<String>,
    /// Only this sandbox's.
    pub sandbox_id: Option<String>,
    /// Seen at or after (unix ms): an aggregated row's last attempt counts.
    pub since_ms: Option<i64>,
    /// First seen before (unix ms).
    pub until_ms: Option<i64>,
    /// `allow` or `deny`.
    pub verdict: Option<String>,
    /// Entries older than this id (the page cursor).
    pub before_id: Option<i64>,
    /// Page size, clamped to 1..=1000 (0: 100).
    pub limit: u32,
}

const AUDIT_COLUMNS: &str = "id, at_ms, sandbox_id, owner, protocol, dest_name, dest_ip, \
     dest_port, sni, http_host, verdict, rule, bytes_sent, bytes_received, ended_at_ms, error, count, last_at_ms";

fn audit_from_row(r: &SqliteRow) -> Result<AuditRecord, StoreError> {
    Ok(AuditRecord {
        id: r.try_get("id")?,
        at_ms: r.try_get("at_ms")?,
        sandbox_id: r.try_get("sandbox_id")?,
        owner: r.try_get("owner")?,
        protocol: r.try_get("protocol")?,
        dest_name: r.try_get("dest_name")?,
        dest_ip: r.try_get("dest_ip")?,
        dest_port: r.try_get("dest_port")?,
        sni: r.try_get("sni")?,
        http_host: r.try_get("http_host")?,
        verdict: r.try_get("verdict")?,
        rule: r.try_get("rule")?,
        bytes_sent: r.try_get("bytes_sent")?,
        bytes_received: r.try_get("bytes_received")?,
        ended_at_ms: r.try_get("ended_at_ms")?,
        error: r.try_get("error")?,
        count: r.try_get("count")?,
        last_at_ms: r.try_get("last_at_ms")?,
    })
}

impl Store {
    /// Stores a sandbox's egress policy; false when the sandbox has no record.
    pub async fn set_network_policy(
        &self,
        sandbox_id: &str,
        policy: &serde_json::Value,
    ) -> Result<bool, StoreError> {
        let text = policy.to_string();
        let r = sqlx::query(
            "INSERT INTO sandbox_network (sandbox_id, policy, updated_at_ms) \
             SELECT id, $2, $3 FROM sandboxes WHERE id = $1 \
             ON CONFLICT (sandbox_id) DO UPDATE SET policy = excluded.policy, \
             updated_at_ms = excluded.updated_at_ms",
        )
        .bind(sandbox_id)
        .bind(text)
        .bind(crate::now_ms())
        .execute(&self.writer)
        .await?;
        Ok(r.rows_affected() > 0)
    }

    /// A sandbox's stored egress policy.
    pub async fn network_policy(
        &self,
        sandbox_id: &str,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let row = sqlx::query("SELECT policy FROM sandbox_network WHERE sandbox_id = $1")
            .bind(sandbox_id)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(r) => {
                let text: String = r.try_get("policy")?;
                Ok(Some(serde_json::from_str(&text).map_err(|e| {
                    StoreError::Corrupt(format!("network policy of {sandbox_id}: {e}"))
                })?))
            }
            None => Ok(None),
        }
    }

    /// Every stored egress policy with its sandbox's owner: (sandbox id, owner, policy).
    pub async fn network_policies(
        &self,
    ) -> Result<Vec<(String, String, serde_json::Value)>, StoreError> {
        let rows = sqlx::query(
            "SELECT n.sandbox_id, s.owner, n.policy FROM sandbox_network n \
             JOIN sandboxes s ON s.id = n.sandbox_id",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let text: String = r.try_get("policy")?;
            out.push((
                r.try_get("sandbox_id")?,
                r.try_get("owner")?,
                serde_json::from_str(&text)
                    .map_err(|e| StoreError::Corrupt(format!("network policy: {e}")))?,
            ));
        }
        Ok(out)
    }

    /// The highest audit entry id so far (0 when there is none).
    pub async fn max_audit_id(&self) -> Result<i64, StoreError> {
        let (id,): (i64,) = sqlx::query_as("SELECT COALESCE(MAX(id), 0) FROM network_audit")
            .fetch_one(&self.pool)
            .await?;
        Ok(id)
    }

    /// Writes a batch of audit changes in one transaction.
    pub async fn write_audit(&self, batch: &[AuditWrite]) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut tx = self.writer.begin().await?;
        for w in batch {
            match w {
                AuditWrite::Insert(a) => {
                    sqlx::query(&format!(
                        "INSERT INTO network_audit ({AUDIT_COLUMNS}) VALUES \
                         ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, \
                         $17, $18) \
                         ON CONFLICT (id) DO NOTHING"
                    ))
                    .bind(a.id)
                    .bind(a.at_ms)
                    .bind(&a.sandbox_id)
                    .bind(&a.owner)
                    .bind(&a.protocol)
                    .bind(&a.dest_name)
                    .bind(&a.dest_ip)
                    .bind(a.dest_port)
                    .bind(&a.sni)
                    .bind(&a.http_host)
                    .bind(&a.verdict)
                    .bind(&a.rule)
                    .bind(a.bytes_sent)
                    .bind(a.bytes_received)
                    .bind(a.ended_at_ms)
                    .bind(&a.error)
                    .bind(a.count)
                    .bind(a.last_at_ms)
                    .execute(&mut *tx)
                    .await?;
                }
                AuditWrite::Close {
                    id,
                    bytes_sent,
                    bytes_received,
                    ended_at_ms,
                    error,
                } => {
                    sqlx::query(
                        "UPDATE network_audit SET bytes_sent = $1, bytes_received = $2, \
                         ended_at_ms = $3, error = $4 WHERE id = $5",
                    )
                    .bind(bytes_sent)
                    .bind(bytes_received)
                    .bind(ended_at_ms)
                    .bind(error)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                }
                AuditWrite::Count {
                    id,
                    count,
                    last_at_ms,
                    rule,
                } => {
                    sqlx::query(
                        "UPDATE network_audit SET count = $1, last_at_ms = $2, \
                         rule = COALESCE($3, rule) WHERE id = $4",
                    )
                    .bind(count)
                    .bind(last_at_ms)
                    .bind(rule)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                }
                AuditWrite::Egress { sandbox_id, bytes } => {
                    sqlx::query(
                        "UPDATE sandbox_usage SET egress_bytes = egress_bytes + $1 \
                         WHERE sandbox_id = $2",
                    )
                    .bind(bytes)
                    .bind(sandbox_id)
                    .execute(&mut *tx)
                    .await?;
                }
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// Audit entries matching `f`, newest first, and the cursor of the next page.
    pub async fn list_audit(
        &self,
        f: &AuditFilter,
    ) -> Result<(Vec<AuditRecord>, Option<i64>), StoreError> {
        let limit = if f.limit == 0 { 100 } else { f.limit.min(1000) } as usize;
        let mut qb: QueryBuilder<'_, Sqlite> = QueryBuilder::new(format!(
            "SELECT {AUDIT_COLUMNS} FROM network_audit WHERE 1 = 1"
        ));
        if let Some(o) = &f.owner {
            qb.push(" AND owner = ").push_bind(o.clone());
        }
        if let Some(s) = &f.sandbox_id {
            qb.push(" AND sandbox_id = ").push_bind(s.clone());
        }
        if let Some(t) = f.since_ms {
            qb.push(" AND COALESCE(last_at_ms, at_ms) >= ").push_bind(t);
        }
        if let Some(t) = f.until_ms {
            qb.push(" AND at_ms < ").push_bind(t);
        }
        if let Some(v) = &f.verdict {
            qb.push(" AND verdict = ").push_bind(v.clone());
        }
        if let Some(b) = f.before_id {
            qb.push(" AND id < ").push_bind(b);
        }
        qb.push(" ORDER BY id DESC LIMIT ")
            .push_bind(limit as i64 + 1);
        let rows = qb.build().fetch_all(&self.pool).await?;
        let mut items = rows
            .iter()
            .map(audit_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let next = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|a| a.id)
        } else {
            None
        };
        Ok((items, next))
    }

    /// Deletes audit entries older than `before_ms`; returns how many went.
    pub async fn prune_audit(&self, before_ms: i64) -> Result<u64, StoreError> {
        let r = sqlx::query("DELETE FROM network_audit WHERE at_ms < $1")
            .bind(before_ms)
            .execute(&self.writer)
            .await?;
        Ok(r.rows_affected())
    }

    /// How many audit rows there are.
    pub async fn count_audit(&self) -> Result<u64, StoreError> {
        let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM network_audit")
            .fetch_one(&self.pool)
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Deletes audit rows until `keep` are left; returns how many went. The owners with
    /// the most rows lose their oldest first: every owner keeps as many rows as an even
    /// share of `keep` allows (an owner with fewer keeps all of theirs), so that one
    /// owner's flood of entries cannot push another owner's out of the audit.
    pub async fn prune_audit_rows(&self, keep: u64) -> Result<u64, StoreError> {
        let counts: Vec<(String, i64)> =
            sqlx::query_as("SELECT owner, COUNT(*) FROM network_audit GROUP BY owner")
                .fetch_all(&self.pool)
                .await?;
        let counts: Vec<(String, u64)> = counts
            .into_iter()
            .map(|(o, n)| (o, u64::try_from(n).unwrap_or(0)))
            .collect();
        let Some(share) = fair_share(counts.iter().map(|(_, n)| *n).collect(), keep) else {
            return Ok(0);
        };
        let mut total = 0;
        for (owner, n) in counts {
            if n > share {
                total += self.delete_oldest_audit_of(&owner, n - share).await?;
            }
        }
        Ok(total)
    }

    /// Deletes the oldest `n` audit rows of `owner`; returns how many went.
    async fn delete_oldest_audit_of(&self, owner: &str, n: u64) -> Result<u64, StoreError> {
        // Ids grow with time, so the lowest are the oldest. In chunks, each its own
        // statement, so that other writes get the writer in between.
        let mut total = 0;
        while total < n {
            let chunk = i64::try_from(n - total)
                .unwrap_or(i64::MAX)
                .min(PRUNE_CHUNK);
            let r = sqlx::query(
                "DELETE FROM network_audit WHERE id IN \
                 (SELECT id FROM network_audit WHERE owner = $1 ORDER BY id LIMIT $2)",
            )
            .bind(owner)
            .bind(chunk)
            .execute(&self.writer)
            .await?;
            total += r.rows_affected();
            if r.rows_affected() < chunk as u64 {
                break;
            }
        }
        Ok(total)
    }
}

/// The most rows each owner may keep so that no more than `keep` are kept in all, when
/// every owner below that share keeps all of theirs; None when all rows fit.
fn fair_share(mut counts: Vec<u64>, keep: u64) -> Option<u64> {
    counts.sort_unstable();
    let mut budget = keep;
    let owners = counts.len() as u64;
    for (i, n) in counts.into_iter().enumerate() {
        let rest = owners - i as u64;
        if n.saturating_mul(rest) <= budget {
            budget -= n;
        } else {
            return Some(budget / rest);
        }
    }
    None
}

/// Rows one statement of [`Store::prune_audit_rows`] deletes at most.
const PRUNE_CHUNK: i64 = 2000;

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: i64, sandbox: &str, owner: &str, verdict: &str) -> AuditRecord {
        AuditRecord {
            id,
            at_ms: id * 10,
            sandbox_id: sandbox.into(),
            owner: owner.into(),
            protocol: "tcp".into(),
            dest_name: Some("example.com".into()),
            dest_ip: Some("203.0.113.5".into()),
            dest_port: 443,
            sni: Some("example.com".into()),
            http_host: None,
            verdict: verdict.into(),
            rule: "default deny".into(),
            bytes_sent: 0,
            bytes_received: 0,
            ended_at_ms: None,
            error: None,
            count: 1,
            last_at_ms: None,
        }
    }

    #[tokio::test]
    async fn audit_pages_filter_and_close() {
        let s = Store::open_in_memory().await.unwrap();
        let mut batch: Vec<AuditWrite> = (1..=5)
            .map(|i| {
                AuditWrite::Insert(rec(
                    i,
                    if i % 2 == 0 { "a" } else { "b" },
                    "o1",
                    if i == 5 { "allow" } else { "deny" },
                ))
            })
            .collect();
        batch.push(AuditWrite::Insert(rec(6, "c", "o2", "deny")));
        batch.push(AuditWrite::Close {
            id: 5,
            bytes_sent: 10,
            bytes_received: 20,
            ended_at_ms: 99,
            error: None,
        });
        s.write_audit(&batch).await.unwrap();
        assert_eq!(s.max_audit_id().await.unwrap(), 6);
        let mine = AuditFilter {
            owner: Some("o1".into()),
            limit: 2,
            ..Default::default()
        };
        let (page, next) = s.list_audit(&mine).await.unwrap();
        assert_eq!(page.iter().map(|a| a.id).collect::<Vec<_>>(), vec![5, 4]);
        assert_eq!(page[0].bytes_sent, 10);
        assert_eq!(page[0].bytes_received, 20);
        assert_eq!(page[0].ended_at_ms, Some(99));
        let (page, _) = s
            .list_audit(&AuditFilter {
                before_id: next,
                ..mine.clone()
            })
            .await
            .unwrap();
        assert_eq!(page.iter().map(|a| a.id).collect::<Vec<_>>(), vec![3, 2]);
        let (page, _) = s
            .list_audit(&AuditFilter {
                sandbox_id: Some("a".into()),
                verdict: Some("deny".into()),
                since_ms: Some(30),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(page.iter().map(|a| a.id).collect::<Vec<_>>(), vec![4]);
        assert_eq!(s.prune_audit(35).await.unwrap(), 3);
        let (all, _) = s.list_audit(&AuditFilter::default()).await.unwrap();
        assert_eq!(all.len(), 3);
    }

    #[tokio::test]
    async fn aggregated_rows_keep_their_count_and_last_time() {
        let s = Store::open_in_memory().await.unwrap();
        let mut batch: Vec<AuditWrite> = (1..=3)
            .map(|i| AuditWrite::Insert(rec(i, "a", "o1", "deny")))
            .collect();
        batch.push(AuditWrite::Count {
            id: 1,
            count: 7,
            last_at_ms: 500,
            rule: None,
        });
        batch.push(AuditWrite::Count {
            id: 2,
            count: 40,
            last_at_ms: 60,
            rule: Some("40 entries dropped (rate limit)".into()),
        });
        s.write_audit(&batch).await.unwrap();
        let (all, _) = s.list_audit(&AuditFilter::default()).await.unwrap();
        let by_id = |id: i64| all.iter().find(|a| a.id == id).unwrap().clone();
        assert_eq!((by_id(1).count, by_id(1).last_at_ms), (7, Some(500)));
        assert_eq!(by_id(1).rule, "default deny");
        assert_eq!(by_id(2).count, 40);
        assert_eq!(by_id(2).rule, "40 entries dropped (rate limit)");
        assert_eq!((by_id(3).count, by_id(3).last_at_ms), (1, None));
        // A row first seen before `since` but seen again after it is listed.
        let (page, _) = s
            .list_audit(&AuditFilter {
                since_ms: Some(100),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(page.iter().map(|a| a.id).collect::<Vec<_>>(), vec![1]);
    }

    #[tokio::test]
    async fn the_oldest_rows_go_beyond_a_row_cap() {
        let s = Store::open_in_memory().await.unwrap();
        let batch: Vec<AuditWrite> = (1..=10)
            .map(|i| AuditWrite::Insert(rec(i, "a", "o1", "deny")))
            .collect();
        s.write_audit(&batch).await.unwrap();
        assert_eq!(s.count_audit().await.unwrap(), 10);
        assert_eq!(s.prune_audit_rows(20).await.unwrap(), 0);
        assert_eq!(s.prune_audit_rows(4).await.unwrap(), 6);
        let (all, _) = s.list_audit(&AuditFilter::default()).await.unwrap();
        assert_eq!(
            all.iter().map(|a| a.id).collect::<Vec<_>>(),
            vec![10, 9, 8, 7]
        );
        assert_eq!(s.prune_audit_rows(0).await.unwrap(), 4);
        assert_eq!(s.count_audit().await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_row_cap_prunes_the_owners_with_the_most_rows_first() {
        let s = Store::open_in_memory().await.unwrap();
        // o1 made two rows first, then o2 a flood, then o3 a few.
        let mut batch = vec![
            AuditWrite::Insert(rec(1, "a", "o1", "deny")),
            AuditWrite::Insert(rec(2, "a", "o1", "deny")),
        ];
        batch.extend((3..=20).map(|i| AuditWrite::Insert(rec(i, "b", "o2", "deny"))));
        batch.extend((21..=24).map(|i| AuditWrite::Insert(rec(i, "c", "o3", "deny"))));
        s.write_audit(&batch).await.unwrap();
        // Ten kept: o1 and o3 keep all theirs (below an even share), o2 the four left.
        assert_eq!(s.prune_audit_rows(10).await.unwrap(), 14);
        let (all, _) = s.list_audit(&AuditFilter::default()).await.unwrap();
        assert_eq!(
            all.iter().map(|a| a.id).collect::<Vec<_>>(),
            vec![24, 23, 22, 21, 20, 19, 18, 17, 2, 1]
        );
    }

    #[test]
    fn fair_shares() {
        assert_eq!(fair_share(vec![2, 18, 4], 24), None);
        assert_eq!(fair_share(vec![2, 18, 4], 10), Some(4));
        assert_eq!(fair_share(vec![10], 4), Some(4));
        assert_eq!(fair_share(vec![5, 5, 5], 10), Some(3));
        assert_eq!(fair_share(vec![], 0), None);
        assert_eq!(fair_share(vec![3], 0), Some(0));
    }

    #[tokio::test]
    async fn a_prune_beyond_one_chunk_deletes_them_all() {
        let s = Store::open_in_memory().await.unwrap();
        let n = 2 * PRUNE_CHUNK + 10;
        let batch: Vec<AuditWrite> = (1..=n)
            .map(|i| AuditWrite::Insert(rec(i, "a", "o1", "deny")))
            .collect();
        s.write_audit(&batch).await.unwrap();
        assert_eq!(s.prune_audit_rows(5).await.unwrap(), (n - 5) as u64);
        let (all, _) = s.list_audit(&AuditFilter::default()).await.unwrap();
        assert_eq!(
            all.iter().map(|a| a.id).collect::<Vec<_>>(),
            ((n - 4)..=n).rev().collect::<Vec<_>>()
        );
    }

    #[tokio::test]
    async fn rows_written_before_counts_existed_count_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        let s = Store::open(&path).await.unwrap();
        // As if made by a build without migration 10, with one entry in it.
        for q in [
            "DELETE FROM schema_version WHERE version = 10",
            "ALTER TABLE network_audit DROP COLUMN count",
            "ALTER TABLE network_audit DROP COLUMN last_at_ms",
            "INSERT INTO network_audit (id, at_ms, sandbox_id, owner, protocol, dest_port, \
             verdict, rule, bytes_sent, bytes_received) \
             VALUES (1, 5, 'a', 'o1', 'dns', 53, 'deny', 'default deny', 0, 0)",
        ] {
            sqlx::query(q).execute(&s.writer).await.unwrap();
        }
        s.close().await;
        let s = Store::open(&path).await.unwrap();
        let (all, _) = s.list_audit(&AuditFilter::default()).await.unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!((all[0].count, all[0].last_at_ms), (1, None));
    }

    #[tokio::test]
    async fn a_policy_needs_its_sandbox() {
        let s = Store::open_in_memory().await.unwrap();
        let p = serde_json::json!({"mode": "open"});
        assert!(!s.set_network_policy("nope", &p).await.unwrap());
        assert!(s.network_policy("nope").await.unwrap().is_none());
    }
}
