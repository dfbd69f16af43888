//! OCI image import: an OCI image layout (directory or tarball) or a `docker save` tarball
//! (directory or tarball, gzip/zstd or plain) flattened onto an empty root filesystem, layer
//! by layer, every blob checked against its digest.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::archive::{self, Counters, Form, UnpackLimits, extract, sanitize};
use crate::error::ImageError;
use crate::fsx::{self, NodeKind, R, Root};

/// What an image says about how to run it (the `config` object of its config blob).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `KEY=value` strings, in the image's order.
    pub env: Vec<String>,
    /// `user`, `uid`, `user:group` or `uid:gid`, as the image wrote it.
    pub user: Option<String>,
    pub workdir: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub stop_signal: Option<String>,
    pub architecture: Option<String>,
    pub os: Option<String>,
}

/// Reported after each layer is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportProgress {
    /// 1-based number of the layer just applied.
    pub index: usize,
    pub total: usize,
    /// Bytes of the layer blob as stored (compressed when the layer is).
    pub bytes: u64,
}

/// Biggest JSON document (index, manifest, config) read into memory.
const MAX_JSON: u64 = 16 << 20;
/// More layers than any real image has (overlayfs itself stops at 500 lower dirs).
const MAX_LAYERS: usize = 512;
/// Members of an outer image tarball that are indexed.
const MAX_OUTER_MEMBERS: usize = 100_000;
/// Symlink hops followed inside an image directory or tarball (legacy docker save links
/// duplicate layers).
const MAX_HOPS: usize = 8;

/// Imports an OCI image layout directory or a `docker save` tarball into an empty rootfs
/// dir, applying layers in order; returns the image config. `progress` is called per layer.
/// On failure the rootfs is emptied again.
pub fn import_image(
    src: &Path,
    rootfs: &Path,
    progress: &mut dyn FnMut(ImportProgress),
) -> Result<ImageConfig, ImageError> {
    import_image_with(src, rootfs, &UnpackLimits::default(), progress)
}

/// [`import_image`] with limits that apply to all layers together.
pub fn import_image_with(
    src: &Path,
    rootfs: &Path,
    limits: &UnpackLimits,
    progress: &mut dyn FnMut(ImportProgress),
) -> Result<ImageConfig, ImageError> {
    let created = fsx::prepare_empty_dir(rootfs)?;
    let res = import_inner(src, rootfs, limits, progress);
    if res.is_err() {
        fsx::discard(rootfs, created);
    }
    res
}

fn import_inner(
    src: &Path,
    rootfs: &Path,
    limits: &UnpackLimits,
    progress: &mut dyn FnMut(ImportProgress),
) -> R<ImageConfig> {
    let scratch = rootfs.parent().unwrap_or(Path::new("."));
    let source = Source::new(src, scratch, limits)?;
    let plan = if source.exists("index.json") {
        oci_plan(&source)?
    } else if source.exists("manifest.json") {
        docker_plan(&source)?
    } else {
        return Err(ImageError::BadImage(
            "neither an OCI image layout (index.json) nor a docker save (manifest.json)".into(),
        ));
    };
    let root = Root::open(rootfs)?;
    let mut counters = Counters::default();
    let total = plan.layers.len();
    for (i, layer) in plan.layers.iter().enumerate() {
        let (reader, size) = source.open(&layer.name)?;
        if let Some(want) = layer.size
            && want != size
        {
            return Err(mismatch(
                &layer.name,
                &format!("{want} bytes"),
                &format!("{size} bytes"),
            ));
        }
        let mut hr = HashRead::new(reader);
        let x = extract(&mut hr, &root, Form::Flatten, limits, &mut counters, true)?;
        // The decompressor may stop before trailing bytes; the digest covers the whole blob.
        io::copy(&mut hr, &mut io::sink())
            .map_err(|e| ImageError::io("read layer", &layer.name, e))?;
        let got = hr.hex();
        if let Some(want) = &layer.digest
            && *want != got
        {
            return Err(mismatch(&layer.name, want, &got));
        }
        if let (Some(want), Some(got)) = (&layer.diff_id, &x.tar_sha256)
            && want != got
        {
            return Err(mismatch(
                &format!("{} (uncompressed)", layer.name),
                want,
                got,
            ));
        }
        tracing::debug!(layer = %layer.name, entries = x.stats.entries, bytes = x.stats.bytes, "applied image layer");
        progress(ImportProgress {
            index: i + 1,
            total,
            bytes: hr.bytes,
        });
    }
    Ok(plan.config)
}

fn mismatch(what: &str, expected: &str, actual: &str) -> ImageError {
    ImageError::DigestMismatch {
        what: what.to_string(),
        expected: expected.to_string(),
        actual: actual.to_string(),
    }
}

fn bad(msg: impl Into<String>) -> ImageError {
    ImageError::BadImage(msg.into())
}

/// One layer to apply: where its blob is, and what it must hash to.
struct LayerRef {
    name: String,
    /// `sha256` hex of the blob as stored (OCI descriptors).
    digest: Option<String>,
    size: Option<u64>,
    /// `sha256` hex of the uncompressed tar (the config's `rootfs.diff_ids`).
    diff_id: Option<String>,
}

struct Plan {
    config: ImageConfig,
    layers: Vec<LayerRef>,
}

// ---------------------------------------------------------------------------------------
// Image formats
// ---------------------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    media_type: Option<String>,
    digest: String,
    size: Option<u64>,
    platform: Option<Platform>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Platform {
    architecture: String,
    os: String,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct OciManifest {
    media_type: Option<String>,
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifest {
    config: String,
    layers: Vec<String>,
}

#[derive(Deserialize, Default)]
struct RawConfig {
    config: Option<RawRunConfig>,
    rootfs: Option<RawRootfs>,
    architecture: Option<String>,
    os: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
struct RawRunConfig {
    user: Option<String>,
    env: Option<Vec<String>>,
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
    working_dir: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    stop_signal: Option<String>,
}

#[derive(Deserialize, Default)]
struct RawRootfs {
    diff_ids: Option<Vec<String>>,
}

const INDEX_TYPES: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// The hex of a `sha256:<hex>` digest; other algorithms and malformed digests are refused.
fn sha256_hex(digest: &str) -> R<String> {
    let hex = digest
        .strip_prefix("sha256:")
        .ok_or_else(|| bad(format!("unsupported digest {digest:?} (only sha256)")))?;
    if hex.len() != 64
        || !hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(bad(format!("malformed digest {digest:?}")));
    }
    Ok(hex.to_string())
}

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

fn parse_config(bytes: &[u8], what: &str) -> R<(ImageConfig, Option<Vec<String>>)> {
    let raw: RawConfig = serde_json::from_slice(bytes).map_err(|e| bad(format!("{what}: {e}")))?;
    let c = raw.config.unwrap_or_default();
    let nonempty = |s: Option<String>| s.filter(|s| !s.is_empty());
    let cfg = ImageConfig {
        env: c.env.unwrap_or_default(),
        user: nonempty(c.user),
        workdir: nonempty(c.working_dir),
        entrypoint: c.entrypoint.unwrap_or_default(),
        cmd: c.cmd.unwrap_or_default(),
        labels: c.labels.unwrap_or_default(),
        stop_signal: nonempty(c.stop_signal),
        architecture: raw.architecture,
        os: raw.os,
    };
    let diff_ids = match raw.rootfs.and_then(|r| r.diff_ids) {
        Some(ids) => Some(ids.iter().map(|d| sha256_hex(d)).collect::<R<Vec<_>>>()?),
        None => None,
    };
    Ok((cfg, diff_ids))
}

/// Reads a blob named by digest, checking size and digest.
fn read_blob(src: &Source, d: &Descriptor) -> R<Vec<u8>> {
    let hex = sha256_hex(&d.digest)?;
    let name = format!("blobs/sha256/{hex}");
    let bytes = src.read_json(&name)?;
    if let Some(size) = d.size
        && size != bytes.len() as u64
    {
        return Err(mismatch(
            &name,
            &format!("{size} bytes"),
            &format!("{} bytes", bytes.len()),
        ));
    }
    let got = hex::encode(Sha256::digest(&bytes));
    if got != hex {
        return Err(mismatch(&name, &hex, &got));
    }
    Ok(bytes)
}

/// Picks the manifest for this host out of an index, descending into nested indexes.
fn pick_manifest(src: &Source, mut index: Index) -> R<OciManifest> {
    for _ in 0..4 {
        let candidates: Vec<&Descriptor> = index
            .manifests
            .iter()
            .filter(|d| {
                // Build attestations sit in indexes as manifests of platform unknown/unknown.
                d.annotations
                    .get("vnd.docker.reference.type")
                    .map(String::as_str)
                    != Some("attestation-manifest")
            })
            .collect();
        let arch = host_arch();
        let chosen = candidates
            .iter()
            .find(|d| {
                d.platform
                    .as_ref()
                    .is_some_and(|p| p.os == "linux" && p.architecture == arch)
            })
            // A manifest that names no platform is taken as it is; one for another
            // platform is not (its binaries would not run here).
            .or_else(|| candidates.iter().find(|d| d.platform.is_none()))
            .ok_or_else(|| bad(format!("the image index has no manifest for linux/{arch}")))?;
        let bytes = read_blob(src, chosen)?;
        let nested = chosen
            .media_type
            .as_deref()
            .is_some_and(|m| INDEX_TYPES.contains(&m));
        if nested {
            index =
                serde_json::from_slice(&bytes).map_err(|e| bad(format!("nested index: {e}")))?;
            continue;
        }
        let m: OciManifest =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("image manifest: {e}")))?;
        if m.media_type
            .as_deref()
            .is_some_and(|t| INDEX_TYPES.contains(&t))
        {
            return Err(bad("an index where an image manifest was expected"));
        }
        return Ok(m);
    }
    Err(bad("image indexes nested too deep"))
}

fn oci_plan(src: &Source) -> R<Plan> {
    if src.exists("oci-layout") {
        let layout: serde_json::Value = serde_json::from_slice(&src.read_json("oci-layout")?)
            .map_err(|e| bad(format!("oci-layout: {e}")))?;
        let v = layout
            .get("imageLayoutVersion")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        if !v.starts_with("1.") {
            return Err(bad(format!("unsupported OCI layout version {v:?}")));
        }
    }
    let index: Index = serde_json::from_slice(&src.read_json("index.json")?)
        .map_err(|e| bad(format!("index.json: {e}")))?;
    let m = pick_manifest(src, index)?;
    let (config, diff_ids) = parse_config(&read_blob(src, &m.config)?, "image config")?;
    check_layer_count(m.layers.len(), diff_ids.as_ref())?;
    let mut layers = Vec::with_capacity(m.layers.len());
    for (i, d) in m.layers.iter().enumerate() {
        let mt = d.media_type.as_deref().unwrap_or("");
        if mt.contains("encrypted")
            || !(mt.is_empty() || mt.contains("tar") || mt.contains("layer"))
        {
            return Err(bad(format!("layer {i} has unsupported media type {mt:?}")));
        }
        let hex = sha256_hex(&d.digest)?;
        layers.push(LayerRef {
            name: format!("blobs/sha256/{hex}"),
            digest: Some(hex),
            size: d.size,
            diff_id: diff_ids.as_ref().map(|ids| ids[i].clone()),
        });
    }
    Ok(Plan { config, layers })
}

fn check_layer_count(n: usize, diff_ids: Option<&Vec<String>>) -> R<()> {
    if n > MAX_LAYERS {
        return Err(bad(format!("{n} layers (at most {MAX_LAYERS})")));
    }
    if let Some(ids) = diff_ids
        && ids.len() != n
    {
        return Err(bad(format!("{n} layers but {} diff_ids", ids.len())));
    }
    Ok(())
}

fn docker_plan(src: &Source) -> R<Plan> {
    let ms: Vec<DockerManifest> = serde_json::from_slice(&src.read_json("manifest.json")?)
        .map_err(|e| bad(format!("manifest.json: {e}")))?;
    let m = ms
        .into_iter()
        .next()
        .ok_or_else(|| bad("manifest.json lists no image"))?;
    let cfg_bytes = src.read_json(&m.config)?;
    // The config's name is its digest (`<hex>.json` or `blobs/sha256/<hex>`): check it.
    let stem = Path::new(&m.config)
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.trim_end_matches(".json"))
        .unwrap_or("");
    if let Ok(hex) = sha256_hex(&format!("sha256:{stem}")) {
        let got = hex::encode(Sha256::digest(&cfg_bytes));
        if got != hex {
            return Err(mismatch(&m.config, &hex, &got));
        }
    }
    let (config, diff_ids) = parse_config(&cfg_bytes, &m.config)?;
    let diff_ids = diff_ids.ok_or_else(|| bad("image config has no rootfs.diff_ids"))?;
    check_layer_count(m.layers.len(), Some(&diff_ids))?;
    let layers = m
        .layers
        .into_iter()
        .zip(diff_ids)
        .map(|(name, diff_id)| LayerRef {
            name,
            digest: None,
            size: None,
            diff_id: Some(diff_id),
        })
        .collect();
    Ok(Plan { config, layers })
}

// ---------------------------------------------------------------------------------------
// Where the image's files come from
// ---------------------------------------------------------------------------------------

/// An image directory, or an image tarball indexed by member name. Names come from the
/// image's own JSON and are untrusted: they are sanitized, looked up beneath the directory
/// without following symlinks (a symlink is resolved by name, within the image only), and
/// never used to write anything.
enum Source {
    Dir(Root),
    Tar {
        file: File,
        members: HashMap<PathBuf, Member>,
    },
}

enum Member {
    File { offset: u64, size: u64 },
    Link(PathBuf),
}

/// Resolves `target` (a symlink's text, or a hardlink's archive path when `base` is empty)
/// by name against `base`; `None` when it is absolute or climbs out of the image.
fn resolve_within(base: &Path, target: &[u8]) -> Option<PathBuf> {
    let t = Path::new(OsStr::from_bytes(target));
    let mut out = PathBuf::new();
    for c in base.components().chain(t.components()) {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

fn unsafe_name(name: &str) -> R<PathBuf> {
    let rel = sanitize(name.as_bytes())?;
    if rel.as_os_str().is_empty() {
        return Err(bad(format!("empty file name {name:?}")));
    }
    Ok(rel)
}

impl Source {
    fn new(src: &Path, scratch: &Path, limits: &UnpackLimits) -> R<Source> {
        let meta = std::fs::metadata(src)
            .map_err(|e| ImageError::io("stat", src.display().to_string(), e))?;
        if meta.is_dir() {
            return Ok(Source::Dir(Root::open(src)?));
        }
        let mut file =
            File::open(src).map_err(|e| ImageError::io("open", src.display().to_string(), e))?;
        let mut magic = [0u8; 4];
        let n = file
            .read(&mut magic)
            .map_err(|e| ImageError::io("read", src.display().to_string(), e))?;
        let compressed =
            (n >= 2 && magic[..2] == [0x1f, 0x8b]) || (n == 4 && magic == [0x28, 0xb5, 0x2f, 0xfd]);
        file.seek(SeekFrom::Start(0))
            .map_err(|e| ImageError::io("seek", src.display().to_string(), e))?;
        let file = if compressed {
            // A compressed tarball cannot be read by offset: it is unpacked once into an
            // unnamed temporary file beside the rootfs (gone when closed).
            let mut tmp = tempfile::tempfile_in(scratch).map_err(|e| {
                ImageError::io("create temporary file in", scratch.display().to_string(), e)
            })?;
            let cap = limits.max_bytes.saturating_add(64 << 20);
            let mut dec = archive::decompress(file)?;
            let n = io::copy(&mut (&mut dec).take(cap.saturating_add(1)), &mut tmp)
                .map_err(|e| ImageError::BadArchive(format!("image tarball: {e}")))?;
            if n > cap {
                return Err(ImageError::TooBig {
                    limit: limits.max_bytes,
                });
            }
            tmp.seek(SeekFrom::Start(0))
                .map_err(|e| ImageError::io("seek", "temporary file", e))?;
            tmp
        } else {
            file
        };
        let members = index_tar(&file)?;
        Ok(Source::Tar { file, members })
    }

    fn exists(&self, name: &str) -> bool {
        match self {
            Source::Dir(root) => matches!(root.lstat(Path::new(name)), Ok(Some(_))),
            Source::Tar { members, .. } => members.contains_key(Path::new(name)),
        }
    }

    /// A reader over the named file and its size.
    fn open(&self, name: &str) -> R<(Box<dyn Read + '_>, u64)> {
        let mut rel = unsafe_name(name)?;
        for _ in 0..MAX_HOPS {
            match self {
                Source::Dir(root) => {
                    let node = root
                        .lstat(&rel)?
                        .ok_or_else(|| bad(format!("{name:?} is missing from the image")))?;
                    if node.kind == NodeKind::Symlink {
                        let (pfd, last) = root.parent(&rel)?;
                        let t = fsx::read_link(&pfd, last, &rel)?;
                        let base = rel.parent().unwrap_or(Path::new("")).to_path_buf();
                        rel = resolve_within(&base, t.as_bytes())
                            .ok_or_else(|| bad(format!("{name:?} links out of the image")))?;
                        continue;
                    }
                    let (f, st) = root.open_file(&rel)?;
                    return Ok((Box::new(f), u64::try_from(st.st_size).unwrap_or(0)));
                }
                Source::Tar { file, members } => match members.get(&rel) {
                    Some(Member::File { offset, size }) => {
                        let r = At {
                            file,
                            pos: *offset,
                            end: offset + size,
                        };
                        return Ok((Box::new(r), *size));
                    }
                    Some(Member::Link(to)) => rel = to.clone(),
                    None => return Err(bad(format!("{name:?} is missing from the image"))),
                },
            }
        }
        Err(bad(format!("{name:?}: too many links")))
    }

    fn read_json(&self, name: &str) -> R<Vec<u8>> {
        let (r, size) = self.open(name)?;
        if size > MAX_JSON {
            return Err(bad(format!(
                "{name:?} is {size} bytes, too big for a JSON document"
            )));
        }
        let mut v = Vec::with_capacity(size as usize);
        r.take(MAX_JSON)
            .read_to_end(&mut v)
            .map_err(|e| ImageError::io("read", name, e))?;
        Ok(v)
    }
}

/// Where each member of an outer image tarball lies. Member data is skipped by seeking; the
/// headers, which the tar reader buffers, are read through a window of bounded size.
fn index_tar(file: &File) -> R<HashMap<PathBuf, Member>> {
    let window = Rc::new(Cell::new(None));
    let mut ar = tar::Archive::new(Windowed {
        file,
        pos: 0,
        window: window.clone(),
    });
    let mut entries = ar
        .entries_with_seek()
        .map_err(|e| ImageError::BadArchive(format!("image tarball: {e}")))?;
    let mut members = HashMap::new();
    loop {
        window.set(Some(archive::HEADER_WINDOW));
        let next = entries.next();
        window.set(None);
        let Some(e) = next else { break };
        let e = e.map_err(|e| ImageError::BadArchive(format!("image tarball: {e}")))?;
        if members.len() >= MAX_OUTER_MEMBERS {
            return Err(bad("the image tarball has too many members"));
        }
        // Names that are unsafe to write are fine to look up, but none of ours look so.
        let Ok(rel) = sanitize(&e.path_bytes()) else {
            continue;
        };
        let kind = e.header().entry_type();
        let link = || {
            e.link_name_bytes()
                .map(|t| t.into_owned())
                .unwrap_or_default()
        };
        let m = match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous => Member::File {
                offset: e.raw_file_position(),
                size: e.size(),
            },
            tar::EntryType::Symlink => {
                let base = rel.parent().unwrap_or(Path::new("")).to_path_buf();
                match resolve_within(&base, &link()) {
                    Some(t) => Member::Link(t),
                    None => continue,
                }
            }
            tar::EntryType::Link => match resolve_within(Path::new(""), &link()) {
                Some(t) => Member::Link(t),
                None => continue,
            },
            _ => continue,
        };
        members.insert(rel, m);
    }
    Ok(members)
}

/// The outer tarball as the tar reader sees it: seeks are free, reads are capped while a
/// window is set.
struct Windowed<'a> {
    file: &'a File,
    pos: u64,
    window: Rc<Cell<Option<u64>>>,
}

impl Read for Windowed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut want = buf.len();
        if let Some(w) = self.window.get() {
            if w == 0 {
                return Err(io::Error::other(
                    "a member's headers exceed their size limit",
                ));
            }
            want = want.min(usize::try_from(w).unwrap_or(usize::MAX));
        }
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        self.pos += n as u64;
        if let Some(w) = self.window.get() {
            self.window.set(Some(w - n as u64));
        }
        Ok(n)
    }
}

impl Seek for Windowed<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let base = match to {
            SeekFrom::Start(p) => {
                self.pos = p;
                return Ok(p);
            }
            SeekFrom::Current(d) => (self.pos, d),
            SeekFrom::End(d) => (self.file.metadata()?.len(), d),
        };
        self.pos = base
            .0
            .checked_add_signed(base.1)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        Ok(self.pos)
    }
}

/// Reads one member of the outer tarball by offset, leaving the file's cursor alone.
struct At<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl Read for At<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.end - self.pos;
        if left == 0 {
            return Ok(0);
        }
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        self.pos += n as u64;
        Ok(n)
    }
}

/// Hashes and counts what is read through it.
struct HashRead<Rd: Read> {
    inner: Rd,
    hash: Sha256,
    bytes: u64,
}

impl<Rd: Read> HashRead<Rd> {
    fn new(inner: Rd) -> Self {
        HashRead {
            inner,
            hash: Sha256::new(),
            bytes: 0,
        }
    }
    fn hex(&self) -> String {
        hex::encode(self.hash.clone().finalize())
    }
}

impl<Rd: Read> Read for HashRead<Rd> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}
