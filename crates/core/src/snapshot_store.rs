//! Where snapshot archives and manifests are kept: a local directory or an S3-compatible
//! object store, behind `object_store`. Uploads stream (a local store takes a file by a
//! rename), downloads are hashed as they come.

use futures::StreamExt;
use object_store::{ObjectStore, ObjectStoreExt, path::Path as ObjPath};
use sha2::Digest;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// Name of a snapshot's archive object.
pub(crate) const ARCHIVE: &str = "layer.tar.zst";
/// Name of a snapshot's manifest object.
pub(crate) const MANIFEST: &str = "manifest.json";

/// Why snapshot storage failed.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A local file operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The object store failed.
    #[error("{context}: {source}")]
    Object {
        context: String,
        #[source]
        source: object_store::Error,
    },
    /// A manifest could not be encoded.
    #[error("encode a manifest: {0}")]
    Encode(#[from] serde_json::Error),
    /// A blocking task died.
    #[error("a storage task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl StorageError {
    fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
    fn object(context: impl Into<String>, source: object_store::Error) -> Self {
        Self::Object {
            context: context.into(),
            source,
        }
    }
}

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
    pub fn open(cfg: &SnapshotStoreConfig, data_dir: &Path) -> Result<Self, StorageError> {
        let local = |dir: &Path| -> Result<Self, StorageError> {
            std::fs::create_dir_all(dir)
                .map_err(|e| StorageError::io(format!("create {}", dir.display()), e))?;
            let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
                .map_err(|e| StorageError::object("open the local store", e))?;
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
                let s3 = b
                    .build()
                    .map_err(|e| StorageError::object("configure the S3 store", e))?;
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

    pub(crate) fn key(&self, snapshot: &str, file: &str) -> ObjPath {
        if self.prefix.is_empty() {
            ObjPath::from(format!("{snapshot}/{file}"))
        } else {
            ObjPath::from(format!("{}/{snapshot}/{file}", self.prefix))
        }
    }

    /// Where an object lives on this machine, for a local store.
    pub(crate) fn local_file(&self, key: &ObjPath) -> Option<PathBuf> {
        self.local.as_ref().map(|d| d.join(key.as_ref()))
    }

    /// Uploads a local file (streamed, multipart when large); a local store takes it by a
    /// rename.
    pub(crate) async fn put_file(&self, key: &ObjPath, file: &Path) -> Result<(), StorageError> {
        if let Some(dest) = self.local_file(key) {
            let (file, dest2) = (file.to_path_buf(), dest.clone());
            let moved = tokio::task::spawn_blocking(move || {
                if let Some(parent) = dest2.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::rename(&file, &dest2)
            })
            .await?;
            // Another file system: copy through the store as for any other.
            if moved.is_ok() {
                return Ok(());
            }
        }
        let mut src = tokio::fs::File::open(file)
            .await
            .map_err(|e| StorageError::io(format!("open {}", file.display()), e))?;
        let mut w = object_store::buffered::BufWriter::new(self.store.clone(), key.clone());
        tokio::io::copy(&mut src, &mut w)
            .await
            .map_err(|e| StorageError::io(format!("upload {key}"), e))?;
        w.shutdown()
            .await
            .map_err(|e| StorageError::io(format!("upload {key}"), e))
    }

    pub(crate) async fn put_bytes(
        &self,
        key: &ObjPath,
        bytes: Vec<u8>,
    ) -> Result<(), StorageError> {
        self.store
            .put(key, bytes.into())
            .await
            .map(drop)
            .map_err(|e| StorageError::object(format!("upload {key}"), e))
    }

    /// Downloads an object into a local file, returning the sha256 of its bytes.
    pub(crate) async fn get_file(
        &self,
        key: &ObjPath,
        file: &Path,
    ) -> Result<String, StorageError> {
        let mut out = tokio::fs::File::create(file)
            .await
            .map_err(|e| StorageError::io(format!("create {}", file.display()), e))?;
        let digest = self.stream_digest(key, Some((&mut out, file))).await?;
        out.flush()
            .await
            .map_err(|e| StorageError::io(format!("write {}", file.display()), e))?;
        Ok(digest)
    }

    /// The sha256 of a stored object, streamed.
    pub(crate) async fn digest(&self, key: &ObjPath) -> Result<String, StorageError> {
        self.stream_digest(key, None).await
    }

    /// Streams an object through sha256, writing it to `out` as it comes when given.
    pub(crate) async fn stream_digest(
        &self,
        key: &ObjPath,
        mut out: Option<(&mut tokio::fs::File, &Path)>,
    ) -> Result<String, StorageError> {
        let got = self
            .store
            .get(key)
            .await
            .map_err(|e| StorageError::object(format!("download {key}"), e))?;
        let mut stream = got.into_stream();
        let mut hash = sha2::Sha256::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| StorageError::object(format!("download {key}"), e))?;
            hash.update(&chunk);
            if let Some((f, path)) = out.as_mut() {
                f.write_all(&chunk)
                    .await
                    .map_err(|e| StorageError::io(format!("write {}", path.display()), e))?;
            }
        }
        Ok(hex::encode(hash.finalize()))
    }

    pub(crate) async fn get_bytes(&self, key: &ObjPath) -> Result<Vec<u8>, StorageError> {
        let got = self
            .store
            .get(key)
            .await
            .map_err(|e| StorageError::object(format!("download {key}"), e))?;
        got.bytes()
            .await
            .map(|b| b.to_vec())
            .map_err(|e| StorageError::object(format!("download {key}"), e))
    }

    /// Snapshot ids that have objects in the store, with the time of their newest object.
    pub(crate) async fn stored_ids(
        &self,
    ) -> Result<std::collections::HashMap<String, i64>, StorageError> {
        let prefix = (!self.prefix.is_empty()).then(|| ObjPath::from(self.prefix.as_str()));
        let mut listing = self.store.list(prefix.as_ref());
        let mut ids = std::collections::HashMap::new();
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(|e| StorageError::object("list stored snapshots", e))?;
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

    pub(crate) async fn delete(&self, snapshot: &str) {
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

/// The sha256 of a file, streamed.
pub(crate) fn sha256_file(path: &Path) -> Result<String, StorageError> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| StorageError::io(format!("open {}", path.display()), e))?;
    let mut hash = sha2::Sha256::new();
    std::io::copy(&mut f, &mut hash)
        .map_err(|e| StorageError::io(format!("read {}", path.display()), e))?;
    Ok(hex::encode(hash.finalize()))
}
