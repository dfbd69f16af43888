//! Volume records and which sandboxes use them. A volume is attached to a sandbox and
//! marked for deletion in single transactions on the writer connection, so a create that
//! mounts a volume and a delete of that volume can never both win.

use std::fmt;
use std::str::FromStr;

use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::{SandboxState, Store, StoreError};

const VOLUME_COLUMNS: &str = "id, owner, name, size_bytes, state, created_at_ms";

/// Lifecycle of a volume on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VolumeState {
    /// Its image is being made; a crash leaves it for the next start to remove.
    Creating,
    /// Usable.
    Ready,
    /// Being removed from the host; a crash leaves it for the next start to finish.
    Deleting,
}

impl VolumeState {
    /// The lowercase name used in storage and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeState::Creating => "creating",
            VolumeState::Ready => "ready",
            VolumeState::Deleting => "deleting",
        }
    }
}

impl fmt::Display for VolumeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for VolumeState {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            VolumeState::Creating,
            VolumeState::Ready,
            VolumeState::Deleting,
        ]
        .into_iter()
        .find(|v| v.as_str() == s)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown volume state {s:?}")))
    }
}

/// One volume as persisted. `name` is unique per owner; `id` names its files on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    /// Unique id, used in host paths.
    pub id: String,
    /// Owner (the API key's owner that created it).
    pub owner: String,
    /// Name chosen by the owner.
    pub name: String,
    /// Size of its file system in bytes.
    pub size_bytes: i64,
    /// Where it is in its lifecycle.
    pub state: VolumeState,
    /// Creation time, unix milliseconds.
    pub created_at_ms: i64,
}

/// A volume a new sandbox asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeAttach {
    /// Volume name (of the sandbox's owner).
    pub name: String,
    /// Mount path inside the sandbox.
    pub path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// What [`Store::begin_volume_delete`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeDeletion {
    /// Marked `deleting`; the caller removes it from the host, then the record.
    Started(VolumeRecord),
    /// The owner has no volume of that name.
    NotFound,
    /// Sandboxes (these ids) still have it mounted.
    InUse(Vec<String>),
    /// It is being created or deleted already.
    Busy(VolumeState),
}

fn volume_from_row(row: &SqliteRow) -> Result<VolumeRecord, StoreError> {
    let state: String = row.try_get("state")?;
    Ok(VolumeRecord {
        id: row.try_get("id")?,
        owner: row.try_get("owner")?,
        name: row.try_get("name")?,
        size_bytes: row.try_get("size_bytes")?,
        state: state.parse()?,
        created_at_ms: row.try_get("created_at_ms")?,
    })
}

/// Sandbox states in which a sandbox no longer holds its volumes: its processes, and with
/// them its mount namespace, are gone or being killed. Any other state (including states
/// added later, such as a hibernated sandbox that will start again) counts as a use.
const RELEASED: [SandboxState; 3] = [
    SandboxState::Stopping,
    SandboxState::Stopped,
    SandboxState::Error,
];

/// `SELECT` of the sandboxes using volume `$1` (the states bound as `$2..$4`).
const USERS_QUERY: &str = "SELECT DISTINCT sv.sandbox_id FROM sandbox_volumes sv \
     JOIN sandboxes s ON s.id = sv.sandbox_id \
     WHERE sv.volume_id = $1 AND s.state NOT IN ($2, $3, $4) ORDER BY sv.sandbox_id";

impl Store {
    /// Inserts a new volume unless its owner already has `max_per_owner`; `false` means the
    /// limit was reached, an existing name yields [`StoreError::Conflict`].
    pub async fn insert_volume(
        &self,
        v: &VolumeRecord,
        max_per_owner: i64,
    ) -> Result<bool, StoreError> {
        // Count and insert in one statement, so concurrent creates cannot overshoot.
        let done = sqlx::query(&format!(
            "INSERT INTO volumes ({VOLUME_COLUMNS}) SELECT $1, $2, $3, $4, $5, $6 \
             WHERE (SELECT COUNT(*) FROM volumes WHERE owner = $2) < $7"
        ))
        .bind(&v.id)
        .bind(&v.owner)
        .bind(&v.name)
        .bind(v.size_bytes)
        .bind(v.state.as_str())
        .bind(v.created_at_ms)
        .bind(max_per_owner)
        .execute(&self.writer)
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::Conflict(_) => StoreError::Conflict(format!("volume {} exists", v.name)),
            other => other,
        })?;
        Ok(done.rows_affected() == 1)
    }

    /// Compare-and-set of a volume's state; `false` if it was not in `from`.
    pub async fn set_volume_state(
        &self,
        id: &str,
        from: VolumeState,
        to: VolumeState,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE volumes SET state = $1 WHERE id = $2 AND state = $3")
            .bind(to.as_str())
            .bind(id)
            .bind(from.as_str())
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// The owner's volume of this name, if any.
    pub async fn get_volume(
        &self,
        owner: &str,
        name: &str,
    ) -> Result<Option<VolumeRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE owner = $1 AND name = $2"
        ))
        .bind(owner)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(volume_from_row).transpose()
    }

    /// The owner's volumes by name; every volume when `owner` is `None`.
    pub async fn list_volumes(&self, owner: Option<&str>) -> Result<Vec<VolumeRecord>, StoreError> {
        let rows = match owner {
            Some(o) => {
                sqlx::query(&format!(
                    "SELECT {VOLUME_COLUMNS} FROM volumes WHERE owner = $1 ORDER BY name"
                ))
                .bind(o)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(&format!(
                    "SELECT {VOLUME_COLUMNS} FROM volumes ORDER BY owner, name"
                ))
                .fetch_all(&self.pool)
                .await?
            }
        };
        rows.iter().map(volume_from_row).collect()
    }

    /// Removes a volume's record (and its past attachments); `false` if the id is unknown.
    pub async fn delete_volume(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM volumes WHERE id = $1")
            .bind(id)
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Ids of the sandboxes that have the volume mounted (any state but stopping, stopped
    /// and error).
    pub async fn volume_users(&self, volume_id: &str) -> Result<Vec<String>, StoreError> {
        let rows = sqlx::query(USERS_QUERY)
            .bind(volume_id)
            .bind(RELEASED[0].as_str())
            .bind(RELEASED[1].as_str())
            .bind(RELEASED[2].as_str())
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| r.try_get("sandbox_id").map_err(StoreError::from))
            .collect()
    }

    /// Marks the owner's volume `deleting` if it is ready and no sandbox uses it, in one
    /// transaction with the check.
    pub async fn begin_volume_delete(
        &self,
        owner: &str,
        name: &str,
    ) -> Result<VolumeDeletion, StoreError> {
        let mut tx = self.writer.begin().await?;
        let row = sqlx::query(&format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE owner = $1 AND name = $2"
        ))
        .bind(owner)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(v) = row.as_ref().map(volume_from_row).transpose()? else {
            return Ok(VolumeDeletion::NotFound);
        };
        if v.state != VolumeState::Ready {
            return Ok(VolumeDeletion::Busy(v.state));
        }
        let users: Vec<String> = sqlx::query(USERS_QUERY)
            .bind(&v.id)
            .bind(RELEASED[0].as_str())
            .bind(RELEASED[1].as_str())
            .bind(RELEASED[2].as_str())
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| r.try_get("sandbox_id"))
            .collect::<Result<_, _>>()?;
        if !users.is_empty() {
            return Ok(VolumeDeletion::InUse(users));
        }
        sqlx::query("UPDATE volumes SET state = $1 WHERE id = $2")
            .bind(VolumeState::Deleting.as_str())
            .bind(&v.id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(VolumeDeletion::Started(VolumeRecord {
            state: VolumeState::Deleting,
            ..v
        }))
    }

    /// Records that sandbox `sandbox_id` (already inserted) mounts these volumes of `owner`,
    /// all or none: a volume that is missing or not ready yields [`StoreError::NotFound`].
    /// The rows go with the sandbox's record.
    pub async fn attach_volumes(
        &self,
        sandbox_id: &str,
        owner: &str,
        wanted: &[VolumeAttach],
    ) -> Result<(), StoreError> {
        let mut tx = self.writer.begin().await?;
        for w in wanted {
            let row = sqlx::query(&format!(
                "SELECT {VOLUME_COLUMNS} FROM volumes WHERE owner = $1 AND name = $2 AND state = $3"
            ))
            .bind(owner)
            .bind(&w.name)
            .bind(VolumeState::Ready.as_str())
            .fetch_optional(&mut *tx)
            .await?;
            let Some(v) = row.as_ref().map(volume_from_row).transpose()? else {
                // Dropping the transaction rolls back the rows inserted so far.
                return Err(StoreError::NotFound(format!("volume {} not found", w.name)));
            };
            sqlx::query(
                "INSERT INTO sandbox_volumes (sandbox_id, volume_id, path, read_only) \
                 VALUES ($1, $2, $3, $4)",
            )
            .bind(sandbox_id)
            .bind(&v.id)
            .bind(&w.path)
            .bind(w.read_only)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The volumes sandbox `sandbox_id` mounts, each with where and how, by mount path.
    pub async fn sandbox_volumes(
        &self,
        sandbox_id: &str,
    ) -> Result<Vec<(VolumeRecord, VolumeAttach)>, StoreError> {
        let rows = sqlx::query(
            "SELECT v.id, v.owner, v.name, v.size_bytes, v.state, v.created_at_ms, \
             sv.path, sv.read_only FROM sandbox_volumes sv JOIN volumes v ON v.id = sv.volume_id \
             WHERE sv.sandbox_id = $1 ORDER BY sv.path",
        )
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let v = volume_from_row(r)?;
                let a = VolumeAttach {
                    name: v.name.clone(),
                    path: r.try_get("path")?,
                    read_only: r.try_get("read_only")?,
                };
                Ok((v, a))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SandboxRecord;

    fn volume(id: &str, owner: &str, name: &str) -> VolumeRecord {
        VolumeRecord {
            id: id.into(),
            owner: owner.into(),
            name: name.into(),
            size_bytes: 64 << 20,
            state: VolumeState::Ready,
            created_at_ms: 1,
        }
    }

    fn sandbox(id: &str, owner: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            owner: owner.into(),
            template: "host".into(),
            runtime: "container".into(),
            state: SandboxState::Creating,
            cpu_millis: 1000,
            memory_bytes: 1 << 29,
            disk_bytes: 1 << 30,
            max_processes: 64,
            env: Default::default(),
            secret_env: Default::default(),
            metadata: Default::default(),
            created_at_ms: 1,
            updated_at_ms: 1,
            expires_at_ms: i64::MAX,
            runtime_state: serde_json::Value::Null,
            error: None,
            version: 0,
            pool: None,
            life: Default::default(),
        }
    }

    fn attach(name: &str, path: &str) -> VolumeAttach {
        VolumeAttach {
            name: name.into(),
            path: path.into(),
            read_only: false,
        }
    }

    #[tokio::test]
    async fn names_are_per_owner_and_counted() {
        let s = Store::open_in_memory().await.unwrap();
        assert!(
            s.insert_volume(&volume("v1", "alice", "data"), 2)
                .await
                .unwrap()
        );
        // Another owner may use the same name.
        assert!(
            s.insert_volume(&volume("v2", "bob", "data"), 2)
                .await
                .unwrap()
        );
        let dup = s.insert_volume(&volume("v3", "alice", "data"), 2).await;
        assert!(matches!(dup, Err(StoreError::Conflict(_))), "{dup:?}");
        assert!(
            s.insert_volume(&volume("v4", "alice", "more"), 2)
                .await
                .unwrap()
        );
        // The third of alice's volumes is over the limit of two.
        assert!(
            !s.insert_volume(&volume("v5", "alice", "extra"), 2)
                .await
                .unwrap()
        );
        let names: Vec<String> = s
            .list_volumes(Some("alice"))
            .await
            .unwrap()
            .into_iter()
            .map(|v| v.name)
            .collect();
        assert_eq!(names, ["data", "more"]);
        assert_eq!(s.list_volumes(None).await.unwrap().len(), 3);
        assert_eq!(
            s.get_volume("bob", "data").await.unwrap().map(|v| v.id),
            Some("v2".to_string())
        );
        assert_eq!(s.get_volume("bob", "more").await.unwrap(), None);
    }

    #[tokio::test]
    async fn attach_is_all_or_nothing_and_blocks_deletion_while_in_use() {
        let s = Store::open_in_memory().await.unwrap();
        s.insert_volume(&volume("v1", "alice", "data"), 10)
            .await
            .unwrap();
        s.insert_sandbox(&sandbox("sb1", "alice")).await.unwrap();
        // One missing volume refuses the whole set and records nothing.
        let err = s
            .attach_volumes(
                "sb1",
                "alice",
                &[attach("data", "/a"), attach("nope", "/b")],
            )
            .await
            .unwrap_err();
        assert!(
            matches!(err, StoreError::NotFound(ref m) if m.contains("nope")),
            "{err:?}"
        );
        assert!(s.volume_users("v1").await.unwrap().is_empty());
        // Bob cannot mount alice's volume by name.
        s.insert_sandbox(&sandbox("sb2", "bob")).await.unwrap();
        let err = s
            .attach_volumes("sb2", "bob", &[attach("data", "/a")])
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");

        let ro = VolumeAttach {
            read_only: true,
            ..attach("data", "/b")
        };
        s.attach_volumes("sb1", "alice", &[attach("data", "/a"), ro.clone()])
            .await
            .unwrap();
        let got = s.sandbox_volumes("sb1").await.unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].0.id.as_str(), &got[0].1),
            ("v1", &attach("data", "/a"))
        );
        assert_eq!((got[1].0.id.as_str(), &got[1].1), ("v1", &ro));
        assert!(s.sandbox_volumes("sb2").await.unwrap().is_empty());
        assert_eq!(s.volume_users("v1").await.unwrap(), ["sb1"]);
        assert_eq!(
            s.begin_volume_delete("alice", "data").await.unwrap(),
            VolumeDeletion::InUse(vec!["sb1".into()])
        );
        // A sandbox being torn down no longer holds it.
        s.transition(
            "sb1",
            &[SandboxState::Creating],
            SandboxState::Stopping,
            None,
        )
        .await
        .unwrap();
        assert!(s.volume_users("v1").await.unwrap().is_empty());
        let started = s.begin_volume_delete("alice", "data").await.unwrap();
        assert!(
            matches!(&started, VolumeDeletion::Started(v) if v.state == VolumeState::Deleting),
            "{started:?}"
        );
        // Deleting: neither a second delete nor a new attach gets it.
        assert_eq!(
            s.begin_volume_delete("alice", "data").await.unwrap(),
            VolumeDeletion::Busy(VolumeState::Deleting)
        );
        s.insert_sandbox(&sandbox("sb3", "alice")).await.unwrap();
        assert!(
            s.attach_volumes("sb3", "alice", &[attach("data", "/a")])
                .await
                .is_err()
        );
        assert!(s.delete_volume("v1").await.unwrap());
        assert_eq!(
            s.begin_volume_delete("alice", "data").await.unwrap(),
            VolumeDeletion::NotFound
        );
    }

    #[tokio::test]
    async fn attachments_go_with_the_sandbox_record() {
        let s = Store::open_in_memory().await.unwrap();
        s.insert_volume(&volume("v1", "alice", "data"), 10)
            .await
            .unwrap();
        s.insert_sandbox(&sandbox("sb1", "alice")).await.unwrap();
        s.attach_volumes("sb1", "alice", &[attach("data", "/a")])
            .await
            .unwrap();
        assert!(s.delete_sandbox("sb1").await.unwrap());
        assert!(s.volume_users("v1").await.unwrap().is_empty());
        assert!(
            s.set_volume_state("v1", VolumeState::Ready, VolumeState::Deleting)
                .await
                .unwrap()
        );
        assert!(
            !s.set_volume_state("v1", VolumeState::Ready, VolumeState::Deleting)
                .await
                .unwrap()
        );
    }
}
