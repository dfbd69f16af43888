//! E2B templates built through E2B's build API: a team's named template, its builds (each
//! of which, once ready, is a sandpit template) and the tags that point at builds.

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{Store, StoreError, now_ms};

/// A team's E2B template: a name that builds and tags hang off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bTemplateRecord {
    /// E2B's template id (random, 20 characters).
    pub id: String,
    /// The owner (team) it belongs to.
    pub owner: String,
    /// Its name (E2B's alias), unique per owner.
    pub name: String,
    /// CPU cores and MiB of memory its builds and sandboxes get.
    pub cpu_count: i64,
    /// Memory in MiB.
    pub memory_mb: i64,
    /// Unix ms.
    pub created_at_ms: i64,
    /// Unix ms of the last new build.
    pub updated_at_ms: i64,
}

/// One build of an E2B template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bBuildRecord {
    /// E2B's build id (a UUID).
    pub id: String,
    /// The template it builds.
    pub template_id: String,
    /// `waiting` (requested, not started), `building`, `ready` or `error`.
    pub status: String,
    /// The sandpit template it made (set once it exists).
    pub template: Option<String>,
    /// Why it failed.
    pub reason: Option<String>,
    /// The step that failed (`base`, a step number, `finalize`).
    pub step: Option<String>,
    /// Tags it gets when it is ready.
    pub tags: Vec<String>,
    /// Unix ms.
    pub created_at_ms: i64,
    /// Unix ms.
    pub updated_at_ms: i64,
}

/// A tag of a template and the build it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bTagRecord {
    /// The tag.
    pub tag: String,
    /// The build it names.
    pub build_id: String,
    /// Unix ms of the assignment.
    pub created_at_ms: i64,
}

const T_COLUMNS: &str = "id, owner, name, cpu_count, memory_mb, created_at_ms, updated_at_ms";
const B_COLUMNS: &str =
    "id, template_id, status, template, reason, step, tags, created_at_ms, updated_at_ms";

fn template_row(row: &SqliteRow) -> Result<E2bTemplateRecord, StoreError> {
    Ok(E2bTemplateRecord {
        id: row.try_get("id")?,
        owner: row.try_get("owner")?,
        name: row.try_get("name")?,
        cpu_count: row.try_get("cpu_count")?,
        memory_mb: row.try_get("memory_mb")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
    })
}

fn build_row(row: &SqliteRow) -> Result<E2bBuildRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let tags: String = row.try_get("tags")?;
    Ok(E2bBuildRecord {
        template_id: row.try_get("template_id")?,
        status: row.try_get("status")?,
        template: row.try_get("template")?,
        reason: row.try_get("reason")?,
        step: row.try_get("step")?,
        tags: serde_json::from_str(&tags)
            .map_err(|e| StoreError::Corrupt(format!("e2b build {id}: tags: {e}")))?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        id,
    })
}

impl Store {
    /// The owner's template named `name`, or with id `name`.
    pub async fn e2b_template(
        &self,
        owner: &str,
        name_or_id: &str,
    ) -> Result<Option<E2bTemplateRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {T_COLUMNS} FROM e2b_templates WHERE owner = $1 AND (name = $2 OR id = $2)"
        ))
        .bind(owner)
        .bind(name_or_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(template_row).transpose()
    }

    /// Every E2B template of the owner, oldest first.
    pub async fn e2b_templates(&self, owner: &str) -> Result<Vec<E2bTemplateRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {T_COLUMNS} FROM e2b_templates WHERE owner = $1 ORDER BY created_at_ms, id"
        ))
        .bind(owner)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(template_row).collect()
    }

    /// Finds the owner's template `t.name` (updating its size) or records `t`, then records
    /// a new build of it in state `waiting`. Returns the template as stored.
    pub async fn e2b_request_build(
        &self,
        t: &E2bTemplateRecord,
        build_id: &str,
        tags: &[String],
    ) -> Result<E2bTemplateRecord, StoreError> {
        let now = now_ms();
        let mut tx = self.writer.begin().await?;
        sqlx::query(
            "INSERT INTO e2b_templates (id, owner, name, cpu_count, memory_mb, created_at_ms, \
             updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $6) \
             ON CONFLICT (owner, name) DO UPDATE SET cpu_count = excluded.cpu_count, \
             memory_mb = excluded.memory_mb, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(&t.id)
        .bind(&t.owner)
        .bind(&t.name)
        .bind(t.cpu_count)
        .bind(t.memory_mb)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let row = sqlx::query(&format!(
            "SELECT {T_COLUMNS} FROM e2b_templates WHERE owner = $1 AND name = $2"
        ))
        .bind(&t.owner)
        .bind(&t.name)
        .fetch_one(&mut *tx)
        .await?;
        let stored = template_row(&row)?;
        sqlx::query(&format!(
            "INSERT INTO e2b_builds ({B_COLUMNS}) VALUES ($1, $2, 'waiting', NULL, NULL, NULL, \
             $3, $4, $4)"
        ))
        .bind(build_id)
        .bind(&stored.id)
        .bind(serde_json::to_string(tags)?)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(stored)
    }

    /// A build of template `template_id`.
    pub async fn e2b_build(
        &self,
        template_id: &str,
        build_id: &str,
    ) -> Result<Option<E2bBuildRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {B_COLUMNS} FROM e2b_builds WHERE template_id = $1 AND id = $2"
        ))
        .bind(template_id)
        .bind(build_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(build_row).transpose()
    }

    /// Every build of a template, newest first.
    pub async fn e2b_builds(&self, template_id: &str) -> Result<Vec<E2bBuildRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {B_COLUMNS} FROM e2b_builds WHERE template_id = $1 \
             ORDER BY created_at_ms DESC, id"
        ))
        .bind(template_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(build_row).collect()
    }

    /// Moves a build from state `from` to `to` (compare-and-set); false when it was not
    /// in `from`.
    pub async fn e2b_transition_build(
        &self,
        build_id: &str,
        from: &str,
        to: &str,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE e2b_builds SET status = $1, updated_at_ms = $2 WHERE id = $3 AND status = $4",
        )
        .bind(to)
        .bind(now_ms())
        .bind(build_id)
        .bind(from)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Records the sandpit template a build is making (so a failure can remove it).
    pub async fn e2b_set_build_template(
        &self,
        build_id: &str,
        template: &str,
    ) -> Result<(), StoreError> {
        sqlx::query("UPDATE e2b_builds SET template = $1, updated_at_ms = $2 WHERE id = $3")
            .bind(template)
            .bind(now_ms())
            .bind(build_id)
            .execute(&self.writer)
            .await?;
        Ok(())
    }

    /// Ends a build: `ready` (its tags then point at it, in the same transaction) or
    /// `error` with the reason and the failed step.
    pub async fn e2b_finish_build(
        &self,
        b: &E2bBuildRecord,
        ok: bool,
        reason: Option<&str>,
        step: Option<&str>,
    ) -> Result<(), StoreError> {
        let now = now_ms();
        let mut tx = self.writer.begin().await?;
        sqlx::query(
            "UPDATE e2b_builds SET status = $1, reason = $2, step = $3, updated_at_ms = $4 \
             WHERE id = $5",
        )
        .bind(if ok { "ready" } else { "error" })
        .bind(reason)
        .bind(step)
        .bind(now)
        .bind(&b.id)
        .execute(&mut *tx)
        .await?;
        if ok {
            for tag in &b.tags {
                sqlx::query(
                    "INSERT INTO e2b_tags (template_id, tag, build_id, created_at_ms) \
                     VALUES ($1, $2, $3, $4) ON CONFLICT (template_id, tag) DO UPDATE SET \
                     build_id = excluded.build_id, created_at_ms = excluded.created_at_ms",
                )
                .bind(&b.template_id)
                .bind(tag)
                .bind(&b.id)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// The owner of the E2B template whose build made sandpit template `template`, if a
    /// build made it.
    pub async fn e2b_build_owner(&self, template: &str) -> Result<Option<String>, StoreError> {
        let row: Option<(String,)> = sqlx::query_as(
            "SELECT t.owner FROM e2b_builds b JOIN e2b_templates t ON t.id = b.template_id \
             WHERE b.template = $1 LIMIT 1",
        )
        .bind(template)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|(o,)| o))
    }

    /// The tags of a template, by name.
    pub async fn e2b_tags(&self, template_id: &str) -> Result<Vec<E2bTagRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT tag, build_id, created_at_ms FROM e2b_tags WHERE template_id = $1 \
             ORDER BY tag",
        )
        .bind(template_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(E2bTagRecord {
                    tag: r.try_get("tag")?,
                    build_id: r.try_get("build_id")?,
                    created_at_ms: r.try_get("created_at_ms")?,
                })
            })
            .collect()
    }

    /// Points `tags` of a template at build `build_id`.
    pub async fn e2b_assign_tags(
        &self,
        template_id: &str,
        build_id: &str,
        tags: &[String],
    ) -> Result<(), StoreError> {
        let now = now_ms();
        let mut tx = self.writer.begin().await?;
        for tag in tags {
            sqlx::query(
                "INSERT INTO e2b_tags (template_id, tag, build_id, created_at_ms) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (template_id, tag) DO UPDATE SET \
                 build_id = excluded.build_id, created_at_ms = excluded.created_at_ms",
            )
            .bind(template_id)
            .bind(tag)
            .bind(build_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Removes tags of a template; returns how many existed.
    pub async fn e2b_remove_tags(
        &self,
        template_id: &str,
        tags: &[String],
    ) -> Result<u64, StoreError> {
        let mut tx = self.writer.begin().await?;
        let mut n = 0;
        for tag in tags {
            n += sqlx::query("DELETE FROM e2b_tags WHERE template_id = $1 AND tag = $2")
                .bind(template_id)
                .bind(tag)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        }
        tx.commit().await?;
        Ok(n)
    }

    /// Removes a template with its builds and tags.
    pub async fn e2b_delete_template(&self, template_id: &str) -> Result<(), StoreError> {
        let mut tx = self.writer.begin().await?;
        for table in ["e2b_tags", "e2b_builds"] {
            sqlx::query(&format!("DELETE FROM {table} WHERE template_id = $1"))
                .bind(template_id)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("DELETE FROM e2b_templates WHERE id = $1")
            .bind(template_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(owner: &str, name: &str, id: &str) -> E2bTemplateRecord {
        E2bTemplateRecord {
            id: id.into(),
            owner: owner.into(),
            name: name.into(),
            cpu_count: 1,
            memory_mb: 512,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    #[tokio::test]
    async fn builds_share_their_template_and_tags_follow_ready_builds() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("e2b.db")).await.unwrap();
        let tags = vec!["v1".to_string()];
        let t = s
            .e2b_request_build(&template("a", "app", "t1"), "b1", &tags)
            .await
            .unwrap();
        assert_eq!(t.id, "t1");
        // The same name again is the same template; another owner's is another.
        let again = s
            .e2b_request_build(&template("a", "app", "t2"), "b2", &[])
            .await
            .unwrap();
        assert_eq!(again.id, "t1");
        let other = s
            .e2b_request_build(&template("b", "app", "t3"), "b3", &[])
            .await
            .unwrap();
        assert_eq!(other.id, "t3");
        assert!(s.e2b_template("a", "t3").await.unwrap().is_none());
        assert_eq!(s.e2b_template("a", "app").await.unwrap().unwrap().id, "t1");
        // Started once only.
        assert!(
            s.e2b_transition_build("b1", "waiting", "building")
                .await
                .unwrap()
        );
        assert!(
            !s.e2b_transition_build("b1", "waiting", "building")
                .await
                .unwrap()
        );
        let b1 = s.e2b_build("t1", "b1").await.unwrap().unwrap();
        assert_eq!(b1.status, "building");
        assert!(s.e2b_build("t3", "b1").await.unwrap().is_none());
        // A failed build gets no tags; a ready one does.
        s.e2b_finish_build(&b1, false, Some("no"), Some("2"))
            .await
            .unwrap();
        assert!(s.e2b_tags("t1").await.unwrap().is_empty());
        let failed = s.e2b_build("t1", "b1").await.unwrap().unwrap();
        assert_eq!(
            (failed.reason.as_deref(), failed.step.as_deref()),
            (Some("no"), Some("2"))
        );
        s.e2b_finish_build(&b1, true, None, None).await.unwrap();
        assert_eq!(s.e2b_build_owner("e2b-t1-b1").await.unwrap(), None);
        s.e2b_set_build_template("b1", "e2b-t1-b1").await.unwrap();
        assert_eq!(
            s.e2b_build_owner("e2b-t1-b1").await.unwrap().as_deref(),
            Some("a")
        );
        let listed = s.e2b_tags("t1").await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(
            (listed[0].tag.as_str(), listed[0].build_id.as_str()),
            ("v1", "b1")
        );
        s.e2b_assign_tags("t1", "b1", &["prod".into()])
            .await
            .unwrap();
        assert_eq!(
            s.e2b_remove_tags("t1", &["prod".into(), "nope".into()])
                .await
                .unwrap(),
            1
        );
        assert_eq!(s.e2b_builds("t1").await.unwrap().len(), 2);
        s.e2b_delete_template("t1").await.unwrap();
        assert!(s.e2b_template("a", "app").await.unwrap().is_none());
        assert!(s.e2b_builds("t1").await.unwrap().is_empty());
        assert!(s.e2b_tags("t1").await.unwrap().is_empty());
        assert!(s.e2b_template("b", "app").await.unwrap().is_some());
    }
}
