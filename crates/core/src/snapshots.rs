//! Snapshots of a sandbox's files: capture (full, or incremental over the snapshot the
//! sandbox descends from), storage in a local directory or an S3-compatible object store,
//! restore as read-only layers, integrity checks, deletion along chains; and forks.

use crate::error::CoreError;
use crate::lifecycle::{SKIP_TOP, blocking};
use crate::manager::{DEFAULT_WORKDIR, Manager, now_ms};
use futures::StreamExt;
use object_store::{ObjectStore, ObjectStoreExt, path::Path as ObjPath};
use sandpit_api::{CreateSnapshotRequest, ForkRequest};
use sandpit_store::{Lifecycle, SandboxRecord, SandboxState, SnapshotRecord};
use sha2::Digest;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// Where snapshot archives go (`[snapshots]` in the config file).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum SnapshotStoreConfig {
    /// A directory on this machine (default: `DATA_DIR/snapshots`).
    #[default]
    Local,
    /// A directory given by path.
    Dir { path: PathBuf },
    /// An S3-compatible object store. Credentials not given here come from the usual
    /// `AWS_*` environment variables.
    S3 {
        bucket: String,
        #[serde(default)]
        prefix: String,
        endpoint: Option<String>,
        region: Option<String>,
        access_key_id: Option<String>,
        secret_access_key: Option<String>,
        /// Plain http to the endpoint (a store on loopback).
        #[serde(default)]
        allow_http: bool,
    },
}

/// The object store holding snapshot archives and manifests.
#[derive(Debug, Clone)]
pub struct SnapshotStore {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    /// The directory of a local store: archives are moved in and read in place there
    /// instead of being copied through the object store's streams.
    local: Option<PathBuf>,
    /// Shown in logs and the README's terms: `local:/path` or `s3://bucket/prefix`.
    pub describe: String,
}

impl SnapshotStore {
    /// Opens the configured store (nothing is contacted yet).
    pub fn open(cfg: &SnapshotStoreConfig, data_dir: &Path) -> Result<Self, String> {
        let local = |dir: &Path| -> Result<Self, String> {
            std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
            let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
                .map_err(|e| e.to_string())?;
            Ok(Self {
                store: Arc::new(fs),
                prefix: String::new(),
                describe: format!("local:{}", dir.display()),
                local: Some(dir.to_path_buf()),
            })
        };
        match cfg {
            SnapshotStoreConfig::Local => local(&data_dir.join("snapshots")),
            SnapshotStoreConfig::Dir { path } => local(path),
            SnapshotStoreConfig::S3 {
                bucket,
                prefix,
                endpoint,
                region,
                access_key_id,
                secret_access_key,
                allow_http,
            } => {
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_bucket_name(bucket)
                    .with_allow_http(*allow_http);
                if let Some(e) = endpoint {
                    b = b.with_endpoint(e);
                }
                if let Some(r) = region {
                    b = b.with_region(r);
                }
                if let Some(k) = access_key_id {
                    b = b.with_access_key_id(k);
                }
                if let Some(s) = secret_access_key {
                    b = b.with_secret_access_key(s);
                }
                let s3 = b.build().map_err(|e| e.to_string())?;
                let prefix = prefix.trim_matches('/').to_string();
                Ok(Self {
                    store: Arc::new(s3),
                    describe: format!("s3://{bucket}/{prefix}"),
                    prefix,
                    local: None,
                })
            }
        }
    }

    fn key(&self, snapshot: &str, file: &str) -> ObjPath {
        if self.prefix.is_empty() {
            ObjPath::from(format!("{snapshot}/{file}"))
        } else {
            ObjPath::from(format!("{}/{snapshot}/{file}", self.prefix))
        }
    }

    /// Where an object lives on this machine, for a local store.
    fn local_file(&self, key: &ObjPath) -> Option<PathBuf> {
        self.local.as_ref().map(|d| d.join(key.as_ref()))
    }

    /// Uploads a local file (streamed, multipart when large); a local store takes it by a
    /// rename.
    async fn put_file(&self, key: &ObjPath, file: &Path) -> Result<(), String> {
        if let Some(dest) = self.local_file(key) {
            let (file, dest2) = (file.to_path_buf(), dest.clone());
            let moved = tokio::task::spawn_blocking(move || {
                if let Some(parent) = dest2.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::rename(&file, &dest2)
            })
            .await
            .map_err(|e| e.to_string())?;
            // Another file system: copy through the store as for any other.
            if moved.is_ok() {
                return Ok(());
            }
        }
        let mut src = tokio::fs::File::open(file)
            .await
            .map_err(|e| format!("open {}: {e}", file.display()))?;
        let mut w = object_store::buffered::BufWriter::new(self.store.clone(), key.clone());
        tokio::io::copy(&mut src, &mut w)
            .await
            .map_err(|e| format!("upload {key}: {e}"))?;
        w.shutdown().await.map_err(|e| format!("upload {key}: {e}"))
    }

    async fn put_bytes(&self, key: &ObjPath, bytes: Vec<u8>) -> Result<(), String> {
        self.store
            .put(key, bytes.into())
            .await
            .map(drop)
            .map_err(|e| format!("upload {key}: {e}"))
    }

    /// Downloads an object into a local file, returning the sha256 of its bytes.
    async fn get_file(&self, key: &ObjPath, file: &Path) -> Result<String, String> {
        let mut out = tokio::fs::File::create(file)
            .await
            .map_err(|e| format!("create {}: {e}", file.display()))?;
        let digest = self.stream_digest(key, Some((&mut out, file))).await?;
        out.flush().await.map_err(|e| e.to_string())?;
        Ok(digest)
    }

    /// The sha256 of a stored object, streamed.
    async fn digest(&self, key: &ObjPath) -> Result<String, String> {
        self.stream_digest(key, None).await
    }

    /// Streams an object through sha256, writing it to `out` as it comes when given.
    async fn stream_digest(
        &self,
        key: &ObjPath,
        mut out: Option<(&mut tokio::fs::File, &Path)>,
    ) -> Result<String, String> {
        let got = self
            .store
            .get(key)
            .await
            .map_err(|e| format!("download {key}: {e}"))?;
        let mut stream = got.into_stream();
        let mut hash = sha2::Sha256::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| format!("download {key}: {e}"))?;
            hash.update(&chunk);
            if let Some((f, path)) = out.as_mut() {
                f.write_all(&chunk)
                    .await
                    .map_err(|e| format!("write {}: {e}", path.display()))?;
            }
        }
        Ok(hex::encode(hash.finalize()))
    }

    async fn get_bytes(&self, key: &ObjPath) -> Result<Vec<u8>, String> {
        let got = self
            .store
            .get(key)
            .await
            .map_err(|e| format!("download {key}: {e}"))?;
        got.bytes()
            .await
            .map(|b| b.to_vec())
            .map_err(|e| format!("download {key}: {e}"))
    }

    /// Snapshot ids that have objects in the store, with the time of their newest object.
    async fn stored_ids(&self) -> Result<std::collections::HashMap<String, i64>, String> {
        let prefix = (!self.prefix.is_empty()).then(|| ObjPath::from(self.prefix.as_str()));
        let mut listing = self.store.list(prefix.as_ref());
        let mut ids = std::collections::HashMap::new();
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(|e| e.to_string())?;
            let parts: Vec<String> = meta
                .location
                .parts()
                .map(|p| p.as_ref().to_string())
                .collect();
            // `<prefix>/<snapshot id>/<file>`: anything else is not sandpit's.
            if let [.., id, file] = parts.as_slice()
                && (file == ARCHIVE || file == MANIFEST)
                && id.starts_with("snap")
            {
                let at = meta.last_modified.timestamp_millis();
                let newest = ids.entry(id.clone()).or_insert(at);
                *newest = (*newest).max(at);
            }
        }
        Ok(ids)
    }

    async fn delete(&self, snapshot: &str) {
        for f in [ARCHIVE, MANIFEST] {
            let key = self.key(snapshot, f);
            match self.store.delete(&key).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => tracing::warn!(%key, error = %e, "deleting a snapshot object failed"),
            }
        }
        // A local store keeps the snapshot's directory; it goes once empty.
        if let Some(dir) = self
            .local_file(&self.key(snapshot, ARCHIVE))
            .and_then(|p| p.parent().map(Path::to_path_buf))
        {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

const ARCHIVE: &str = "layer.tar.zst";
const MANIFEST: &str = "manifest.json";
/// Most entries and bytes a restored archive may hold.
const UNPACK_LIMITS: sandpit_image::UnpackLimits = sandpit_image::UnpackLimits {
    max_entries: 2_000_000,
    max_bytes: 64 << 30,
};
/// Most copies one fork makes.
pub const MAX_FORK: u32 = 64;

/// The sha256 of a file, streamed.
fn sha256_file(path: &Path) -> Result<String, String> {
    let mut f = std::fs::File::open(path).map_err(|e| format!("open {}: {e}", path.display()))?;
    let mut hash = sha2::Sha256::new();
    std::io::copy(&mut f, &mut hash).map_err(|e| format!("read {}: {e}", path.display()))?;
    Ok(hex::encode(hash.finalize()))
}

/// The layer directory a snapshot's archive is unpacked into.
pub fn cache_layer_id(snapshot: &str) -> String {
    format!("snap-{snapshot}")
}

/// The settings a sandbox restored from a snapshot starts with.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
struct Settings {
    env: BTreeMap<String, String>,
    limits: sandpit_api::LimitsSpec,
    workdir: Option<String>,
    user: Option<String>,
    /// Egress policy of the sandbox when it was taken.
    network: Option<sandpit_api::NetworkPolicy>,
}

fn snapshot_name_ok(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 128
        && !n.starts_with('.')
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The API view of a snapshot record.
pub fn to_api(s: &SnapshotRecord) -> sandpit_api::Snapshot {
    sandpit_api::Snapshot {
        id: s.id.clone(),
        name: s.name.clone(),
        sandbox_id: s.sandbox_id.clone(),
        parent: s.parent.clone(),
        template: s.template.clone(),
        runtime: s.runtime.clone(),
        kind: s.kind.clone(),
        size_bytes: s.size_bytes.max(0) as u64,
        entries: s.entries.max(0) as u64,
        digest: s.digest.clone(),
        created_at_ms: s.created_at_ms,
    }
}

fn store_err(e: String) -> CoreError {
    CoreError::unavailable(format!("snapshot storage: {e}"))
}

impl Manager {
    fn tmp_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("tmp")
    }

    /// Captures the sandbox's files into a stored snapshot. A running sandbox is frozen
    /// while its files are read, so the snapshot is one point in time.
    pub async fn snapshot(
        &self,
        rec: &SandboxRecord,
        req: &CreateSnapshotRequest,
    ) -> Result<SnapshotRecord, CoreError> {
        if let Some(n) = &req.name
            && !snapshot_name_ok(n)
        {
            return Err(CoreError::invalid(
                "snapshot names are 1-128 of [A-Za-z0-9._-], not starting with '.'",
            ));
        }
        let _op = self.op_lock(&rec.id).await;
        let rec = self.fresh(&rec.id).await?;
        if !matches!(
            rec.state,
            SandboxState::Running | SandboxState::Paused | SandboxState::Hibernated
        ) {
            return Err(CoreError::conflict(format!(
                "sandbox {} is {}",
                rec.id, rec.state
            )));
        }
        let parent = match (&rec.life.snapshot, req.incremental) {
            (Some(p), true) => match self.store.get_snapshot(&rec.owner, p).await? {
                Some(s) => Some(s),
                None => {
                    tracing::info!(id = %rec.id, parent = p, "parent snapshot is gone; taking a full one");
                    None
                }
            },
            _ => None,
        };
        let parent_manifest = match &parent {
            Some(p) => Some(self.load_manifest(&p.id).await?),
            None => None,
        };
        let id = format!("snap{}", uuid::Uuid::new_v4().simple());
        let name = req.name.clone().unwrap_or_else(|| id.clone());
        if self.store.get_snapshot(&rec.owner, &name).await?.is_some() {
            return Err(CoreError::conflict(format!(
                "a snapshot named {name:?} exists"
            )));
        }
        let tmp = self.tmp_dir();
        std::fs::create_dir_all(&tmp).map_err(|e| CoreError::internal(e.to_string()))?;
        let archive = tmp.join(format!("{id}.tar.zst"));
        let layers = self.layer_paths(&rec)?;
        let live = match rec.state {
            SandboxState::Hibernated => None,
            _ => Some(self.runtime_of(&rec)?),
        };
        let freeze = rec.state == SandboxState::Running;
        let disk_bytes = rec.disk_bytes as u64;
        let (archive2, t0) = (archive.clone(), std::time::Instant::now());
        let captured = blocking(move || {
            if let (Some((rt, h)), true) = (&live, freeze) {
                rt.freeze(h)?;
            }
            let result = (|| {
                let upper = match &live {
                    Some((rt, h)) => Some(rt.open_upper(h)?),
                    None => None,
                };
                if let Some(u) = &upper {
                    crate::lifecycle::check_upper_size(&u.path(), disk_bytes)?;
                }
                let mut stack = Vec::new();
                if let Some(u) = &upper {
                    stack.push(sandpit_image::Layer {
                        dir: u.path(),
                        id_base: u.id_base,
                    });
                }
                stack.extend(
                    layers
                        .into_iter()
                        .map(|dir| sandpit_image::Layer { dir, id_base: 0 }),
                );
                let stack = sandpit_image::Stack(stack);
                let manifest = stack.manifest(SKIP_TOP).map_err(image_err)?;
                let out = std::fs::File::create(&archive2)
                    .map_err(|e| CoreError::internal(format!("create archive: {e}")))?;
                let stats =
                    sandpit_image::write_layer(&stack, &manifest, parent_manifest.as_ref(), out)
                        .map_err(image_err)?;
                Ok::<_, CoreError>((manifest, stats))
            })();
            if let (Some((rt, h)), true) = (&live, freeze)
                && let Err(e) = rt.thaw(h)
            {
                tracing::error!(id = %h.id, error = %e, "thawing after a snapshot failed");
            }
            result
        })
        .await;
        let (manifest, stats) = match captured {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_file(&archive);
                return Err(e);
            }
        };
        let frozen_ms = t0.elapsed().as_millis();
        let uploaded = async {
            self.snapshot_store
                .put_file(&self.snapshot_store.key(&id, ARCHIVE), &archive)
                .await?;
            let m = serde_json::to_vec(&manifest).map_err(|e| e.to_string())?;
            self.snapshot_store
                .put_bytes(&self.snapshot_store.key(&id, MANIFEST), m)
                .await
        }
        .await;
        let _ = tokio::fs::remove_file(&archive).await;
        if let Err(e) = uploaded {
            self.snapshot_store.delete(&id).await;
            return Err(store_err(e));
        }
        let settings = Settings {
            env: rec.env.clone(),
            limits: limits_of(&rec),
            workdir: rec.life.workdir.clone(),
            user: rec.life.user.clone(),
            network: self.net.get().and_then(|n| n.policy_of(&rec.id)),
        };
        let snap = SnapshotRecord {
            id: id.clone(),
            owner: rec.owner.clone(),
            name,
            sandbox_id: rec.id.clone(),
            parent: parent.as_ref().map(|p| p.id.clone()),
            template: rec.template.clone(),
            runtime: rec.runtime.clone(),
            kind: if parent.is_some() {
                "incremental"
            } else {
                "full"
            }
            .into(),
            size_bytes: stats.bytes as i64,
            entries: stats.entries as i64,
            digest: stats.sha256.clone(),
            settings: serde_json::to_value(&settings)
                .map_err(|e| CoreError::internal(e.to_string()))?,
            created_at_ms: now_ms(),
        };
        if let Err(e) = self.store.insert_snapshot(&snap).await {
            self.snapshot_store.delete(&id).await;
            return Err(e.into());
        }
        let mut life = rec.life.clone();
        life.snapshot = Some(id.clone());
        self.store.set_life(&rec.id, &life).await?;
        tracing::info!(id = %rec.id, snapshot = %id, kind = %snap.kind, bytes = stats.bytes, entries = stats.entries, frozen_ms, "snapshot taken");
        Ok(snap)
    }

    async fn load_manifest(&self, snapshot: &str) -> Result<sandpit_image::Manifest, CoreError> {
        let bytes = self
            .snapshot_store
            .get_bytes(&self.snapshot_store.key(snapshot, MANIFEST))
            .await
            .map_err(store_err)?;
        serde_json::from_slice(&bytes)
            .map_err(|e| CoreError::internal(format!("manifest of {snapshot}: {e}")))
    }

    /// A snapshot and its ancestors, newest first.
    pub async fn snapshot_chain(
        &self,
        owner: &str,
        id_or_name: &str,
    ) -> Result<Vec<SnapshotRecord>, CoreError> {
        let first = self
            .store
            .get_snapshot(owner, id_or_name)
            .await?
            .ok_or_else(|| CoreError::not_found(format!("snapshot {id_or_name} not found")))?;
        let mut chain = vec![first];
        while let Some(p) = chain.last().and_then(|s| s.parent.clone()) {
            if chain.len() > 1000 || chain.iter().any(|s| s.id == p) {
                return Err(CoreError::internal("snapshot chain loops"));
            }
            let parent = self.store.get_snapshot(owner, &p).await?.ok_or_else(|| {
                CoreError::conflict(format!("snapshot {p}, a parent in the chain, is gone"))
            })?;
            chain.push(parent);
        }
        Ok(chain)
    }

    /// Makes sure a snapshot's archive is unpacked as a layer (checking its digest).
    async fn ensure_cached(&self, snap: &SnapshotRecord) -> Result<String, CoreError> {
        let layer = cache_layer_id(&snap.id);
        let dir = self.layer_path(&layer)?;
        let _op = self.op_lock(&layer).await;
        if dir.is_dir() {
            return Ok(layer);
        }
        let tmp = self.tmp_dir();
        tokio::fs::create_dir_all(&tmp)
            .await
            .map_err(|e| CoreError::internal(e.to_string()))?;
        let key = self.snapshot_store.key(&snap.id, ARCHIVE);
        // A local store's archive is read where it is; anything else is downloaded.
        let (file, downloaded) = match self.snapshot_store.local_file(&key) {
            Some(path) => (path, false),
            None => (tmp.join(format!("{}.get", snap.id)), true),
        };
        let digest = if downloaded {
            self.snapshot_store.get_file(&key, &file).await
        } else {
            let f = file.clone();
            blocking(move || Ok::<_, CoreError>(sha256_file(&f)))
                .await
                .map_err(|e| e.chain())
                .and_then(|d| d)
        };
        let digest = match digest {
            Ok(d) => d,
            Err(e) => {
                if downloaded {
                    let _ = tokio::fs::remove_file(&file).await;
                }
                return Err(store_err(e));
            }
        };
        if digest != snap.digest {
            if downloaded {
                let _ = tokio::fs::remove_file(&file).await;
            }
            return Err(CoreError::conflict(format!(
                "snapshot {} is corrupt: its archive's sha256 is {digest}, not {}",
                snap.id, snap.digest
            )));
        }
        let unpacked = blocking(move || {
            let partial = dir.with_extension("partial");
            let _ = std::fs::remove_dir_all(&partial);
            let res = (|| {
                std::fs::create_dir_all(&partial)
                    .map_err(|e| CoreError::internal(e.to_string()))?;
                let f =
                    std::fs::File::open(&file).map_err(|e| CoreError::internal(e.to_string()))?;
                sandpit_image::unpack_layer(f, &partial, &UNPACK_LIMITS).map_err(image_err)?;
                std::fs::rename(&partial, &dir).map_err(|e| CoreError::internal(e.to_string()))
            })();
            if res.is_err() {
                let _ = std::fs::remove_dir_all(&partial);
            }
            if downloaded {
                let _ = std::fs::remove_file(&file);
            }
            res
        })
        .await;
        unpacked.map(|()| layer)
    }

    /// Lifecycle and settings of a sandbox that starts from a snapshot: its chain's layers
    /// (unpacked as needed and pinned until the record holds them).
    pub(crate) async fn restore_plan(
        &self,
        owner: &str,
        snapshot: &str,
    ) -> Result<Restore<'_>, CoreError> {
        let chain = self.snapshot_chain(owner, snapshot).await?;
        let mut layers = Vec::new();
        let mut pins = Vec::new();
        for s in &chain {
            let l = self.ensure_cached(s).await?;
            pins.push(self.pin(&l));
            layers.push(l);
        }
        let top = &chain[0];
        let settings: Settings = serde_json::from_value(top.settings.clone()).unwrap_or_default();
        Ok(Restore {
            snapshot: top.clone(),
            layers,
            env: settings.env,
            limits: settings.limits,
            workdir: settings.workdir,
            user: settings.user,
            network: settings.network,
            _pins: pins,
        })
    }

    /// Deletes a snapshot; one that others build on is refused unless `force`, which
    /// deletes those too.
    pub async fn delete_snapshot(
        &self,
        owner: &str,
        id_or_name: &str,
        force: bool,
    ) -> Result<Vec<String>, CoreError> {
        let snap = self
            .store
            .get_snapshot(owner, id_or_name)
            .await?
            .ok_or_else(|| CoreError::not_found(format!("snapshot {id_or_name} not found")))?;
        // Children first, depth first, so that no record is left with a missing parent.
        let mut order = Vec::new();
        let mut todo = vec![snap.clone()];
        while let Some(s) = todo.pop() {
            let kids = self.store.snapshot_children(&s.id).await?;
            if !kids.is_empty() && !force {
                return Err(CoreError::conflict(format!(
                    "snapshot {} has dependent snapshots ({}); delete them first or pass force=true",
                    s.id,
                    kids.iter()
                        .map(|k| k.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            order.push(s);
            todo.extend(kids);
        }
        let mut deleted = Vec::new();
        for s in order.into_iter().rev() {
            self.store.delete_snapshot(&s.id).await?;
            self.snapshot_store.delete(&s.id).await;
            deleted.push(s.id);
        }
        self.gc_layers().await;
        Ok(deleted)
    }

    /// Checks that every archive of the snapshot's chain is stored and matches its digest.
    pub async fn verify_snapshot(
        &self,
        owner: &str,
        id_or_name: &str,
    ) -> Result<sandpit_api::SnapshotCheck, CoreError> {
        let chain = self.snapshot_chain(owner, id_or_name).await?;
        let mut items = Vec::new();
        for s in &chain {
            let got = self
                .snapshot_store
                .digest(&self.snapshot_store.key(&s.id, ARCHIVE))
                .await;
            let manifest = self.load_manifest(&s.id).await.err();
            let (actual, mut error) = match got {
                Ok(d) => (Some(d), None),
                Err(e) => (None, Some(e)),
            };
            if let Some(m) = manifest {
                error.get_or_insert(m.chain());
            }
            let ok = error.is_none() && actual.as_deref() == Some(s.digest.as_str());
            items.push(sandpit_api::SnapshotCheckItem {
                id: s.id.clone(),
                ok,
                expected_digest: s.digest.clone(),
                actual_digest: actual,
                error,
            });
        }
        Ok(sandpit_api::SnapshotCheck {
            ok: items.iter().all(|i| i.ok),
            chain: items,
        })
    }

    /// Makes `count` independent sandboxes that start on a copy of this one's files: its
    /// writable layer is copied once into a shared read-only layer, and each copy gets
    /// its own writable layer over it (copy-on-write), processes, limits and identity.
    pub async fn fork(
        self: &Arc<Self>,
        rec: &SandboxRecord,
        req: &ForkRequest,
    ) -> Result<Vec<SandboxRecord>, CoreError> {
        let count = req.count.unwrap_or(1);
        if count == 0 || count > MAX_FORK {
            return Err(CoreError::invalid(format!(
                "count must be between 1 and {MAX_FORK}"
            )));
        }
        let limits = req.limits.unwrap_or_else(|| limits_of(rec));
        let mut plan = self
            .plan(Some(&rec.template), Some(&rec.runtime), &limits)
            .await?;
        // A volume is shared, not copied: each copy mounts its source's.
        plan.volumes = self.volume_specs(&rec.id).await?;
        let source_policy = self.net.get().and_then(|n| n.policy_of(&rec.id));
        plan.network =
            crate::net::plan_policy(self.net.get(), &plan.key.runtime, source_policy.as_ref())?;
        let timeout = self.timeout(req.timeout)?;
        let metadata = req.metadata.clone().unwrap_or_else(|| rec.metadata.clone());
        crate::manager::check_metadata(&metadata)?;
        let (layers, _pins): (Vec<String>, Vec<crate::lifecycle::Pin<'_>>) = {
            let _op = self.op_lock(&rec.id).await;
            let src = self.fresh(&rec.id).await?;
            match src.state {
                // Shared as they are, pinned until the copies' records hold them.
                SandboxState::Hibernated => (
                    src.life.layers.clone(),
                    src.life.layers.iter().map(|l| self.pin(l)).collect(),
                ),
                SandboxState::Running | SandboxState::Paused => {
                    let (rt, h) = self.runtime_of(&src)?;
                    let layer = format!("fork-{}-{}", src.id, uuid::Uuid::new_v4().simple());
                    let pin = self.pin(&layer);
                    let running = src.state == SandboxState::Running;
                    self.capture_upper(
                        &rt,
                        &h,
                        running,
                        &self.layer_path(&layer)?,
                        src.disk_bytes as u64,
                    )
                    .await?;
                    if running {
                        blocking(move || rt.thaw(&h)).await?;
                    }
                    let mut layers = vec![layer];
                    layers.extend(src.life.layers.iter().cloned());
                    let mut pins = vec![pin];
                    pins.extend(src.life.layers.iter().map(|l| self.pin(l)));
                    (layers, pins)
                }
                other => {
                    return Err(CoreError::conflict(format!(
                        "sandbox {} is {other}",
                        src.id
                    )));
                }
            }
        };
        let life = Lifecycle {
            layers,
            snapshot: rec.life.snapshot.clone(),
            last_activity_ms: now_ms(),
            idle_timeout_secs: rec.life.idle_timeout_secs,
            on_timeout: rec.life.on_timeout,
            auto_resume: rec.life.auto_resume,
            paused_at_ms: None,
            workdir: rec.life.workdir.clone(),
            user: rec.life.user.clone(),
            timeout_secs: timeout,
        };
        let workdir = rec
            .life
            .workdir
            .clone()
            .unwrap_or_else(|| DEFAULT_WORKDIR.into());
        let expires = now_ms() + timeout as i64 * 1000;
        let mut made = Vec::new();
        let mut failure = None;
        // A few at a time: each start is CPU-bound.
        let starts = futures::stream::iter(0..count)
            .map(|_| {
                self.start_new(crate::manager::NewSandbox {
                    owner: &rec.owner,
                    pool: None,
                    plan: plan.clone(),
                    env: rec.env.clone(),
                    metadata: metadata.clone(),
                    workdir: workdir.clone(),
                    expires_at_ms: expires,
                    life: life.clone(),
                })
            })
            .buffer_unordered(4)
            .collect::<Vec<_>>()
            .await;
        for s in starts {
            match s {
                Ok(r) => made.push(r),
                Err(e) => failure = Some(e),
            }
        }
        if failure.is_none() {
            // Each copy gets proxy tokens of its own and its source's exposure.
            for r in &made {
                if let Err(e) = crate::access::inherit(self, &rec.id, &r.id).await {
                    failure = Some(e);
                    break;
                }
            }
        }
        let ids: Vec<String> = made.iter().map(|r| r.id.clone()).collect();
        if failure.is_none()
            && let Err(e) = self.broker.copy_attachments(&rec.id, &ids).await
        {
            failure = Some(e.into());
        }
        if let Some(e) = failure {
            for r in &made {
                let _ = self.destroy(r).await;
            }
            return Err(e);
        }
        tracing::info!(id = %rec.id, count, "sandbox forked");
        Ok(made)
    }
}

impl Manager {
    /// A template build's source from a snapshot: its chain unpacked (checked against
    /// its digests), and the snapshot's env, workdir and user where the build request
    /// names none. The admin may name any owner's snapshot by id, its own also by name.
    pub async fn snapshot_template_source(
        &self,
        admin: &str,
        snapshot: &str,
        mut req: sandpit_api::BuildTemplateRequest,
    ) -> Result<
        (
            sandpit_api::BuildTemplateRequest,
            Option<crate::templates::Source>,
        ),
        CoreError,
    > {
        let owner = match self.store.get_snapshot(admin, snapshot).await? {
            Some(s) => s.owner,
            None => self
                .store
                .list_snapshots(None)
                .await?
                .into_iter()
                .find(|s| s.id == snapshot)
                .map(|s| s.owner)
                .ok_or_else(|| CoreError::not_found(format!("snapshot {snapshot} not found")))?,
        };
        let chain = self.snapshot_chain(&owner, snapshot).await?;
        let mut from = Vec::new();
        for s in &chain {
            from.push(self.layer_path(&self.ensure_cached(s).await?)?);
        }
        let top = &chain[0];
        let settings: Settings = serde_json::from_value(top.settings.clone()).unwrap_or_default();
        if req.env.is_empty() {
            req.env = settings.env;
        }
        req.workdir = req.workdir.or(settings.workdir);
        req.default_user = req.default_user.or(settings.user);
        req.source = sandpit_api::TemplateSourceSpec::Snapshot {
            snapshot: top.id.clone(),
            base: Some(top.template.clone()),
        };
        Ok((
            req,
            Some(crate::templates::Source::Layers {
                from,
                base: top.template.clone(),
            }),
        ))
    }
}

/// Objects younger than this are left by the orphan sweep: an upload may be under way.
const ORPHAN_AGE_MS: i64 = 10 * 60 * 1000;

impl Manager {
    /// At start: removes stored archives no snapshot record names (an upload that a crash
    /// cut off before the record was written, or a delete cut off after it).
    pub async fn sweep_snapshot_objects(&self) {
        let (stored, known) = match (
            self.snapshot_store.stored_ids().await,
            self.store.list_snapshots(None).await,
        ) {
            (Ok(s), Ok(k)) => (s, k),
            (Err(e), _) => {
                tracing::warn!(error = %e, "listing stored snapshots failed");
                return;
            }
            (_, Err(e)) => {
                tracing::warn!(error = %e, "listing snapshot records failed");
                return;
            }
        };
        let known: std::collections::HashSet<String> = known.into_iter().map(|s| s.id).collect();
        let now = now_ms();
        for (id, newest) in stored {
            if !known.contains(&id) && now - newest > ORPHAN_AGE_MS {
                tracing::info!(snapshot = %id, "removing stored snapshot objects no record names");
                self.snapshot_store.delete(&id).await;
            }
        }
    }
}

/// A snapshot's layers and settings, ready for a create.
pub(crate) struct Restore<'a> {
    pub snapshot: SnapshotRecord,
    pub layers: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub limits: sandpit_api::LimitsSpec,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub network: Option<sandpit_api::NetworkPolicy>,
    _pins: Vec<crate::lifecycle::Pin<'a>>,
}

/// The limits of a record, as a request would give them.
pub(crate) fn limits_of(rec: &SandboxRecord) -> sandpit_api::LimitsSpec {
    sandpit_api::LimitsSpec {
        cpu_millis: Some(rec.cpu_millis as u64),
        memory_bytes: Some(rec.memory_bytes as u64),
        disk_bytes: Some(rec.disk_bytes as u64),
        max_processes: Some(rec.max_processes as u64),
    }
}

/// What the sandbox's own files cause (names a layer cannot hold, a corrupt archive) is
/// the caller's to fix (422); the host's i/o failing is ours.
pub(crate) fn image_err(e: sandpit_image::ImageError) -> CoreError {
    if e.is_input_error() {
        CoreError::Unprocessable {
            code: "failed_precondition",
            message: format!("the files cannot be captured or restored: {e}"),
        }
    } else {
        CoreError::Image(e)
    }
}
