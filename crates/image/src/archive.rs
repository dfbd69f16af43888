//! Layer archives: writing a stack's changes as a zstd tar with OCI whiteouts, and
//! extracting any layer tar, member by member, without ever following a symlink.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::ffi::OsStr;
use std::io::{self, BufReader, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use sha2::{Digest, Sha256};

use crate::error::ImageError;
use crate::fsx::{self, NodeKind, R, Root, show};
use crate::manifest::{Entry, EntryKind, ID_RANGE, Manifest, Stack, WH_OPAQUE, WH_PREFIX, find};

/// Caps on what one archive (or one image import) may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpackLimits {
    /// Total bytes of regular-file content.
    pub max_bytes: u64,
    /// Total number of members, whiteouts and directories included.
    pub max_entries: u64,
}

impl Default for UnpackLimits {
    fn default() -> Self {
        UnpackLimits {
            max_bytes: 32 << 30,
            max_entries: 2_000_000,
        }
    }
}

/// What [`write_layer`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerStats {
    /// Bytes of the compressed archive.
    pub bytes: u64,
    /// Tar members, whiteouts and opaque markers included.
    pub entries: u64,
    /// Bytes of regular-file content in the archive.
    pub content_bytes: u64,
    /// sha256 (hex) of the compressed archive bytes.
    pub sha256: String,
}

/// What an unpack or layer apply did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnpackStats {
    /// Members read.
    pub entries: u64,
    /// Bytes of regular-file content written.
    pub bytes: u64,
    /// Whiteouts made (overlay form) or applied (flatten).
    pub whiteouts: u64,
    /// Members ignored: aufs metadata (`.wh..wh.*`), the archive's root, global headers.
    pub skipped: u64,
}

/// Owner given to files whose ids lie outside the sandbox's range: the kernel's overflow id,
/// which is what such a file would show as anyway.
pub(crate) const OVERFLOW_ID: u32 = 65534;
/// Bytes a member's headers (GNU long names, PAX records) may take.
pub(crate) const HEADER_WINDOW: u64 = 1 << 20;

// ---------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------

/// What goes into an archive for one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Planned<'a> {
    /// The entry, and whether its directory is written opaque.
    Entry(&'a Entry, bool),
    /// The path is deleted.
    Whiteout,
}

fn parent_key(k: &str) -> &str {
    k.rfind('/').map(|i| &k[..i]).unwrap_or("")
}

fn ancestors(k: &str) -> impl Iterator<Item = &str> {
    k.match_indices('/').map(move |(i, _)| &k[..i])
}

fn is_opaque_dir(e: &Entry) -> bool {
    matches!(e.kind, EntryKind::Dir { opaque: true })
}

/// Decides the members of a layer: the entries of `current` that differ from `parent`,
/// whiteouts for what `parent` has and `current` lacks, all of a directory's subtree when it
/// is written opaque (an opaque directory hides the parent layer's copies), and every
/// ancestor directory (with its own metadata, so unpacking never invents one).
pub(crate) fn plan<'a>(
    current: &'a Manifest,
    parent: Option<&Manifest>,
) -> R<BTreeMap<String, Planned<'a>>> {
    let mut plan: BTreeMap<String, Planned<'a>> = BTreeMap::new();
    match parent {
        None => {
            for (k, e) in &current.entries {
                plan.insert(k.clone(), Planned::Entry(e, is_opaque_dir(e)));
            }
        }
        Some(p) => {
            let mut opaque_roots = Vec::new();
            for (k, e) in &current.entries {
                if p.entries.get(k) != Some(e) {
                    plan.insert(k.clone(), Planned::Entry(e, is_opaque_dir(e)));
                    if is_opaque_dir(e) {
                        opaque_roots.push(k.as_str());
                    }
                }
            }
            for r in opaque_roots {
                let prefix = format!("{r}/");
                for (k, e) in current.entries.range(prefix.clone()..) {
                    if !k.starts_with(&prefix) {
                        break;
                    }
                    plan.entry(k.clone())
                        .or_insert(Planned::Entry(e, is_opaque_dir(e)));
                }
            }
            let written_opaque = |plan: &BTreeMap<String, Planned>, k: &str| {
                matches!(plan.get(k), Some(Planned::Entry(_, true)))
            };
            let mut deleted = Vec::new();
            for (k, e) in &p.entries {
                if current.entries.contains_key(k) || e.kind == EntryKind::Whiteout {
                    continue;
                }
                // Only the topmost deleted path needs a whiteout, and none is needed where
                // a non-directory or an opaque directory already hides the parent layer.
                let par = parent_key(k);
                let needed = par.is_empty()
                    || (matches!(
                        current.entries.get(par).map(|e| &e.kind),
                        Some(EntryKind::Dir { .. })
                    ) && !written_opaque(&plan, par)
                        && !ancestors(par).any(|a| written_opaque(&plan, a)));
                if needed {
                    deleted.push(k.as_str());
                }
            }
            for k in deleted {
                plan.insert(k.to_string(), Planned::Whiteout);
            }
        }
    }
    let keys: Vec<String> = plan.keys().cloned().collect();
    for k in &keys {
        for a in ancestors(k) {
            match (plan.get(a), current.entries.get_key_value(a)) {
                (Some(Planned::Entry(e, _)), _) if matches!(e.kind, EntryKind::Dir { .. }) => {}
                (None, Some((ak, e))) if matches!(e.kind, EntryKind::Dir { .. }) => {
                    plan.insert(ak.clone(), Planned::Entry(e, false));
                }
                _ => {
                    return Err(ImageError::InvalidManifest(format!(
                        "{k:?} lies below {a:?}, which is not a directory"
                    )));
                }
            }
        }
    }
    Ok(plan)
}

/// Counts and hashes what passes through to the real output.
struct HashWriter<W: Write> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Yields exactly `left` bytes of a file, hashing them; a file that shrank fails.
struct Exact<Rd: Read> {
    inner: Rd,
    left: u64,
    hash: Sha256,
    short: bool,
}

impl<Rd: Read> Read for Exact<Rd> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            self.short = true;
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        self.hash.update(&buf[..n]);
        self.left -= n as u64;
        Ok(n)
    }
}

fn header(
    kind: tar::EntryType,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    size: u64,
) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(uid.into());
    h.set_gid(gid.into());
    h.set_mtime(u64::try_from(mtime).unwrap_or(0));
    h.set_size(size);
    h
}

fn werr(e: io::Error) -> ImageError {
    ImageError::io("write archive", "", e)
}

/// Writes an archive of the entries of `current` that differ from `parent` (everything when
/// None), plus whiteouts for paths `parent` has that `current` lacks; contents are read from
/// the topmost layer of `stack` that holds each path. A file whose content no longer matches
/// `current` fails with [`ImageError::Changed`]: freeze the sandbox while archiving.
pub fn write_layer(
    stack: &Stack,
    current: &Manifest,
    parent: Option<&Manifest>,
    out: impl Write,
) -> Result<LayerStats, ImageError> {
    let plan = plan(current, parent)?;
    write_plan(stack, &plan, out)
}

fn write_plan(
    stack: &Stack,
    plan: &BTreeMap<String, Planned<'_>>,
    out: impl Write,
) -> R<LayerStats> {
    let hw = HashWriter {
        inner: out,
        hash: Sha256::new(),
        bytes: 0,
    };
    let roots = stack.open()?;
    let enc = zstd::stream::write::Encoder::new(hw, 3).map_err(werr)?;
    let mut b = tar::Builder::new(enc);
    let mut entries = 0u64;
    let mut content = 0u64;
    let empty = || io::empty();
    for (key, item) in plan {
        let key = key.as_str();
        let rel = Path::new(key);
        let (par, name) = (parent_key(key), &key[parent_key(key).len()..]);
        let name = name.trim_start_matches('/');
        let joined = |n: &str| {
            if par.is_empty() {
                n.to_string()
            } else {
                format!("{par}/{n}")
            }
        };
        let entry = match item {
            Planned::Whiteout => None,
            Planned::Entry(e, _) if e.kind == EntryKind::Whiteout => None,
            Planned::Entry(e, op) => Some((*e, *op)),
        };
        let Some((e, opaque)) = entry else {
            let mut h = header(tar::EntryType::Regular, 0o644, 0, 0, 0, 0);
            b.append_data(&mut h, joined(&format!("{WH_PREFIX}{name}")), empty())
                .map_err(werr)?;
            entries += 1;
            continue;
        };
        let found = find(&roots, rel)?;
        let changed = || ImageError::Changed {
            path: key.to_string(),
        };
        let want = match e.kind {
            EntryKind::Dir { .. } => NodeKind::Dir,
            EntryKind::File { .. } => NodeKind::File,
            EntryKind::Symlink { .. } => NodeKind::Symlink,
            EntryKind::Whiteout => NodeKind::Whiteout,
        };
        let Some((root, node)) = found.filter(|(_, n)| n.kind == want) else {
            return Err(changed());
        };
        match &e.kind {
            EntryKind::Dir { .. } => {
                let mut h = header(
                    tar::EntryType::Directory,
                    e.mode,
                    e.uid,
                    e.gid,
                    node.mtime,
                    0,
                );
                b.append_data(&mut h, key, empty()).map_err(werr)?;
                entries += 1;
                if opaque {
                    let mut h = header(tar::EntryType::Regular, 0o644, 0, 0, 0, 0);
                    b.append_data(&mut h, format!("{key}/{WH_OPAQUE}"), empty())
                        .map_err(werr)?;
                    entries += 1;
                }
            }
            EntryKind::Symlink { target } => {
                let mut h = header(tar::EntryType::Symlink, 0o777, e.uid, e.gid, node.mtime, 0);
                b.append_link(&mut h, key, target).map_err(werr)?;
                entries += 1;
            }
            EntryKind::File { size, sha256 } => {
                let (f, _) = root.open_file(rel)?;
                let mut ex = Exact {
                    inner: f,
                    left: *size,
                    hash: Sha256::new(),
                    short: false,
                };
                let mut h = header(
                    tar::EntryType::Regular,
                    e.mode,
                    e.uid,
                    e.gid,
                    node.mtime,
                    *size,
                );
                match b.append_data(&mut h, key, &mut ex) {
                    Ok(()) => {}
                    Err(_) if ex.short => return Err(changed()),
                    Err(err) => return Err(werr(err)),
                }
                if hex::encode(ex.hash.finalize()) != *sha256 {
                    return Err(changed());
                }
                entries += 1;
                content += size;
            }
            EntryKind::Whiteout => {}
        }
    }
    let enc = b.into_inner().map_err(werr)?;
    let mut hw = enc.finish().map_err(werr)?;
    hw.flush().map_err(werr)?;
    Ok(LayerStats {
        bytes: hw.bytes,
        entries,
        content_bytes: content,
        sha256: hex::encode(hw.hash.finalize()),
    })
}

// ---------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------

/// The two ways a layer tar lands on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// A layer dir for overlayfs: whiteouts become 0:0 char devices, opaque markers xattrs.
    Overlay,
    /// Applied onto a root filesystem: whiteouts delete, opaque markers clear lower content.
    Flatten,
}

/// Running totals that may span several archives (the layers of one image).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub entries: u64,
    pub bytes: u64,
}

/// The decompressed stream of a layer, its compression told by magic bytes.
pub(crate) enum Decoded<Rd: Read> {
    Plain(BufReader<Rd>),
    Gzip(Box<flate2::bufread::MultiGzDecoder<BufReader<Rd>>>),
    Zstd(Box<zstd::stream::read::Decoder<'static, BufReader<Rd>>>),
}

impl<Rd: Read> Read for Decoded<Rd> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Decoded::Plain(r) => r.read(buf),
            Decoded::Gzip(r) => r.read(buf),
            Decoded::Zstd(r) => r.read(buf),
        }
    }
}

pub(crate) type Head<Rd> = io::Chain<io::Cursor<Vec<u8>>, Rd>;

pub(crate) fn decompress<Rd: Read>(mut src: Rd) -> R<Decoded<Head<Rd>>> {
    let mut head = [0u8; 4];
    let mut n = 0;
    while n < head.len() {
        match src.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ImageError::io("read archive", "", e)),
        }
    }
    let r = BufReader::with_capacity(128 * 1024, io::Cursor::new(head[..n].to_vec()).chain(src));
    Ok(if n >= 2 && head[..2] == [0x1f, 0x8b] {
        Decoded::Gzip(Box::new(flate2::bufread::MultiGzDecoder::new(r)))
    } else if n == 4 && head == [0x28, 0xb5, 0x2f, 0xfd] {
        let d = zstd::stream::read::Decoder::with_buffer(r)
            .map_err(|e| ImageError::BadArchive(format!("zstd: {e}")))?;
        Decoded::Zstd(Box::new(d))
    } else {
        Decoded::Plain(r)
    })
}

/// A cap on everything read from the decompressed stream, and a tighter one while the tar
/// reader parses a member's headers (which it buffers in memory).
#[derive(Debug)]
pub(crate) struct Meter {
    pub(crate) left: u64,
    pub(crate) window: Option<u64>,
    pub(crate) exceeded: bool,
}

pub(crate) struct Metered<Rd: Read> {
    pub(crate) inner: Rd,
    pub(crate) meter: Rc<RefCell<Meter>>,
    pub(crate) hash: Option<Sha256>,
    pub(crate) bytes: u64,
}

impl<Rd: Read> Read for Metered<Rd> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let cap = {
            let m = self.meter.borrow();
            m.window.map_or(m.left, |w| w.min(m.left))
        };
        if cap == 0 {
            self.meter.borrow_mut().exceeded = true;
            return Err(io::Error::other("archive exceeds its size limit"));
        }
        let want = buf.len().min(usize::try_from(cap).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        {
            let mut m = self.meter.borrow_mut();
            m.left -= n as u64;
            if let Some(w) = m.window.as_mut() {
                *w -= n as u64;
            }
        }
        if let Some(h) = self.hash.as_mut() {
            h.update(&buf[..n]);
        }
        self.bytes += n as u64;
        Ok(n)
    }
}

/// A hardlink member's target, confined to the archive like a member name, and what
/// refuses the link (naming the member and its target as written).
pub(crate) fn hardlink_target<Rd: Read>(
    entry: &tar::Entry<'_, Rd>,
    rel: &Path,
) -> Result<(PathBuf, BadLink), ImageError> {
    let bad = BadLink {
        path: show(rel),
        raw: entry
            .link_name_bytes()
            .map(|t| t.into_owned())
            .unwrap_or_default(),
    };
    let target = sanitize(&bad.raw).map_err(|_| bad.refuse("target lies outside the archive"))?;
    Ok((target, bad))
}

/// A hardlink member being checked: the error for each reason to refuse it.
pub(crate) struct BadLink {
    path: String,
    raw: Vec<u8>,
}

impl BadLink {
    /// `UnsafeHardlink` for this member, saying `reason`.
    pub(crate) fn refuse(&self, reason: &'static str) -> ImageError {
        ImageError::UnsafeHardlink {
            path: self.path.clone(),
            target: String::from_utf8_lossy(&self.raw).into_owned(),
            reason,
        }
    }
}

/// Checks a member name and normalizes it: no NUL, not absolute, no `..`, no name longer
/// than NAME_MAX, the whole no longer than PATH_MAX. `.` and empty components are dropped.
pub(crate) fn sanitize(raw: &[u8]) -> R<PathBuf> {
    let bad = |reason| ImageError::UnsafePath {
        path: String::from_utf8_lossy(raw).into_owned(),
        reason,
    };
    if raw.contains(&0) {
        return Err(bad("contains NUL"));
    }
    if raw.len() > fsx::PATH_MAX {
        return Err(bad("longer than PATH_MAX"));
    }
    if raw.starts_with(b"/") {
        return Err(bad("absolute path"));
    }
    let mut out = PathBuf::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(bad("has a .. component")),
            c if c.len() > fsx::NAME_MAX => return Err(bad("a name is longer than NAME_MAX")),
            c => out.push(OsStr::from_bytes(c)),
        }
    }
    Ok(out)
}

/// The result of one extraction, with what the caller may verify against a digest.
pub(crate) struct Extracted {
    pub stats: UnpackStats,
    /// sha256 (hex) of the decompressed tar stream, when asked for.
    pub tar_sha256: Option<String>,
}

struct Extractor<'a> {
    root: &'a Root,
    form: Form,
    limits: &'a UnpackLimits,
    counters: &'a mut Counters,
    stats: UnpackStats,
    /// Regular files this archive made: the only valid hardlink targets.
    files: HashSet<PathBuf>,
    /// Paths this archive holds, with their ancestors (flatten: what an opaque marker keeps
    /// and a whiteout must not delete).
    this_layer: HashSet<PathBuf>,
    /// Directory mtimes, set last (writing children changes them).
    dir_times: BTreeMap<PathBuf, i64>,
    buf: Vec<u8>,
}

/// Extracts a tar stream (gzip/zstd/plain) beneath `root`.
pub(crate) fn extract(
    src: impl Read,
    root: &Root,
    form: Form,
    limits: &UnpackLimits,
    counters: &mut Counters,
    want_tar_sha: bool,
) -> R<Extracted> {
    let meter = Rc::new(RefCell::new(Meter {
        left: limits
            .max_bytes
            .saturating_add(limits.max_entries.saturating_mul(8192))
            .saturating_add(64 << 20),
        window: None,
        exceeded: false,
    }));
    let metered = Metered {
        inner: decompress(src)?,
        meter: meter.clone(),
        hash: want_tar_sha.then(Sha256::new),
        bytes: 0,
    };
    let too_big = ImageError::TooBig {
        limit: limits.max_bytes,
    };
    let read_err = |e: io::Error, meter: &Rc<RefCell<Meter>>| {
        if meter.borrow().exceeded {
            ImageError::TooBig {
                limit: limits.max_bytes,
            }
        } else {
            ImageError::BadArchive(e.to_string())
        }
    };
    let mut ar = tar::Archive::new(metered);
    let mut x = Extractor {
        root,
        form,
        limits,
        counters,
        stats: UnpackStats::default(),
        files: HashSet::new(),
        this_layer: HashSet::new(),
        dir_times: BTreeMap::new(),
        buf: vec![0u8; 128 * 1024],
    };
    {
        let mut entries = ar.entries().map_err(|e| read_err(e, &meter))?;
        loop {
            meter.borrow_mut().window = Some(HEADER_WINDOW);
            let next = entries.next();
            meter.borrow_mut().window = None;
            let Some(entry) = next else { break };
            let mut entry = entry.map_err(|e| read_err(e, &meter))?;
            x.member(&mut entry, &meter)?;
            // Whatever a member carries beyond what was used (a directory with a size,
            // say) is read here, under the total cap, rather than skipped in the header window.
            io::copy(&mut entry, &mut io::sink()).map_err(|e| read_err(e, &meter))?;
        }
    }
    let mut rest = ar.into_inner();
    // The end-of-archive blocks and any record padding belong to the digest too.
    io::copy(&mut rest, &mut io::sink()).map_err(|e| read_err(e, &meter))?;
    if meter.borrow().exceeded {
        return Err(too_big);
    }
    x.finish_dirs()?;
    let stats = x.stats;
    Ok(Extracted {
        stats,
        tar_sha256: rest.hash.take().map(|h| hex::encode(h.finalize())),
    })
}

impl Extractor<'_> {
    fn note_layer_path(&mut self, rel: &Path) {
        if self.form != Form::Flatten {
            return;
        }
        let mut p = rel;
        loop {
            if !self.this_layer.insert(p.to_path_buf()) {
                break;
            }
            match p.parent() {
                Some(q) if !q.as_os_str().is_empty() => p = q,
                _ => break,
            }
        }
    }

    /// Opens `rel`'s parent (creating missing ones) and clears the name for a new entry;
    /// an existing directory stays when a directory is wanted.
    fn clear_for<'p>(&mut self, rel: &'p Path, want_dir: bool) -> R<(OwnedFd, &'p OsStr, bool)> {
        let (pfd, name) = self.root.parent_create(rel, &mut |_| {})?;
        match fsx::statat(&pfd, name, rel)? {
            None => Ok((pfd, name, false)),
            Some(n) if n.kind == NodeKind::Dir && want_dir => Ok((pfd, name, true)),
            Some(n) => {
                self.files.remove(rel);
                if n.kind == NodeKind::Dir {
                    drop(pfd);
                    self.root.remove_all(rel)?;
                    let (pfd, name) = self.root.parent(rel)?;
                    Ok((pfd, name, false))
                } else {
                    rustix::fs::unlinkat(&pfd, name, rustix::fs::AtFlags::empty())
                        .map_err(|e| fsx::classify("unlink", rel, e))?;
                    Ok((pfd, name, false))
                }
            }
        }
    }

    fn member<Rd: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, Rd>,
        meter: &Rc<RefCell<Meter>>,
    ) -> R<()> {
        let raw = entry.path_bytes().into_owned();
        let rel = sanitize(&raw)?;
        self.counters.entries += 1;
        self.stats.entries += 1;
        if self.counters.entries > self.limits.max_entries {
            return Err(ImageError::TooManyEntries {
                limit: self.limits.max_entries,
            });
        }
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions() {
            self.stats.skipped += 1;
            return Ok(());
        }
        if rel.as_os_str().is_empty() {
            // The archive's own root ("./"): the destination's root stays as it is.
            if kind.is_dir() {
                self.stats.skipped += 1;
                return Ok(());
            }
            return Err(ImageError::UnsafePath {
                path: show(Path::new(OsStr::from_bytes(&raw))),
                reason: "the archive root is not a directory",
            });
        }
        let (parent, name) = fsx::split(&rel);
        let name = name.as_bytes();
        if let Some(stripped) = name.strip_prefix(WH_PREFIX.as_bytes()) {
            if name == WH_OPAQUE.as_bytes() {
                return self.opaque(parent);
            }
            if stripped.starts_with(WH_PREFIX.as_bytes()) {
                // aufs bookkeeping (.wh..wh.plnk and friends), meaningless here.
                self.stats.skipped += 1;
                return Ok(());
            }
            if stripped.is_empty() || stripped == b"." || stripped == b".." {
                return Err(ImageError::UnsafePath {
                    path: show(&rel),
                    reason: "whiteout of an invalid name",
                });
            }
            let target = parent.join(OsStr::from_bytes(stripped));
            return self.whiteout(&target);
        }

        let h = entry.header();
        let bad = |e: io::Error| ImageError::BadArchive(format!("{}: {e}", show(&rel)));
        let uid = h.uid().map_err(bad)?;
        let gid = h.gid().map_err(bad)?;
        let mode = h.mode().map_err(bad)? & 0o7777;
        let mtime = h
            .mtime()
            .map(|t| i64::try_from(t).unwrap_or(0))
            .unwrap_or(0);
        let in_range = uid < u64::from(ID_RANGE) && gid < u64::from(ID_RANGE);
        let clamp = |id: u64| {
            u32::try_from(id)
                .ok()
                .filter(|i| *i < ID_RANGE)
                .unwrap_or(OVERFLOW_ID)
        };
        let (u, g) = (clamp(uid), clamp(gid));
        use tar::EntryType as T;
        match kind {
            T::Regular | T::Continuous | T::GNUSparse => {
                if mode & 0o6000 != 0 && !in_range {
                    return Err(ImageError::ForeignSetuid {
                        path: show(&rel),
                        uid,
                        gid,
                    });
                }
                self.note_layer_path(&rel);
                self.file(entry, &rel, u, g, mode, mtime, meter)
            }
            T::Directory => {
                self.note_layer_path(&rel);
                // A directory's setgid only steers group inheritance; from a foreign owner
                // it is dropped with the owner.
                let mode = if in_range { mode } else { mode & !0o6000 };
                let (pfd, name, exists) = self.clear_for(&rel, true)?;
                let fd = if exists {
                    fsx::open_child_dir(&pfd, name, &rel)?
                } else {
                    fsx::make_dir(&pfd, name, &rel)?
                };
                fsx::own_and_mode(&fd, &rel, u, g, mode)?;
                self.dir_times.insert(rel, mtime);
                Ok(())
            }
            T::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                if target.is_empty() || target.contains(&0) || target.len() > fsx::PATH_MAX {
                    return Err(ImageError::UnsafePath {
                        path: show(&rel),
                        reason: "symlink target is empty, has a NUL or is longer than PATH_MAX",
                    });
                }
                self.note_layer_path(&rel);
                let (pfd, name, _) = self.clear_for(&rel, false)?;
                fsx::make_symlink(&pfd, name, OsStr::from_bytes(&target), &rel, u, g, mtime)
            }
            T::Link => {
                let (target, bad_link) = hardlink_target(entry, &rel)?;
                if target.as_os_str().is_empty() || !self.files.contains(&target) {
                    return Err(bad_link.refuse("target is not a file this archive extracted"));
                }
                if target == rel {
                    self.stats.skipped += 1;
                    return Ok(());
                }
                match self.root.lstat(&target)? {
                    Some(n) if n.kind == NodeKind::File => {}
                    _ => return Err(bad_link.refuse("target is no longer a regular file")),
                }
                self.note_layer_path(&rel);
                self.clear_for(&rel, false)?;
                fsx::link(self.root, &target, &rel)?;
                self.files.insert(rel);
                Ok(())
            }
            T::Char => Err(self.special(&rel, "character device")),
            T::Block => Err(self.special(&rel, "block device")),
            T::Fifo => Err(self.special(&rel, "fifo")),
            _ => Err(self.special(&rel, "member of an unsupported type")),
        }
    }

    fn special(&self, rel: &Path, kind: &'static str) -> ImageError {
        ImageError::SpecialFile {
            path: show(rel),
            kind,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn file<Rd: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, Rd>,
        rel: &Path,
        u: u32,
        g: u32,
        mode: u32,
        mtime: i64,
        meter: &Rc<RefCell<Meter>>,
    ) -> R<()> {
        let too_big = || ImageError::TooBig {
            limit: self.limits.max_bytes,
        };
        let left = self.limits.max_bytes.saturating_sub(self.counters.bytes);
        if entry.size() > left {
            return Err(too_big());
        }
        let (pfd, name, _) = self.clear_for(rel, false)?;
        let mut f = fsx::create_file(&pfd, name, rel)?;
        let mut written = 0u64;
        loop {
            let n = match entry.read(&mut self.buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) if meter.borrow().exceeded => return Err(too_big()),
                Err(e) => return Err(ImageError::BadArchive(format!("{}: {e}", show(rel)))),
            };
            written += n as u64;
            if written > left {
                return Err(too_big());
            }
            f.write_all(&self.buf[..n])
                .map_err(|e| ImageError::io("write", show(rel), e))?;
        }
        self.counters.bytes += written;
        self.stats.bytes += written;
        fsx::own_and_mode(&f, rel, u, g, mode)?;
        fsx::set_mtime_fd(&f, rel, mtime)?;
        self.files.insert(rel.to_path_buf());
        Ok(())
    }

    fn whiteout(&mut self, rel: &Path) -> R<()> {
        self.stats.whiteouts += 1;
        self.files.remove(rel);
        match self.form {
            Form::Overlay => {
                let (pfd, name, _) = self.clear_for(rel, false)?;
                fsx::make_whiteout(&pfd, name, rel)
            }
            Form::Flatten => {
                // A whiteout hides lower layers only, never a path of its own layer.
                if self.this_layer.contains(rel) {
                    return Ok(());
                }
                self.root.remove_all(rel)
            }
        }
    }

    fn opaque(&mut self, dir: &Path) -> R<()> {
        match self.form {
            Form::Overlay => {
                if dir.as_os_str().is_empty() {
                    // overlayfs never consults a layer root's opaque mark.
                    self.stats.skipped += 1;
                    return Ok(());
                }
                // The marker's directory is made when missing, never replaced: a symlink
                // or file there is a path through a non-directory, refused like any other.
                let marker = dir.join(WH_OPAQUE);
                self.root.parent_create(&marker, &mut |_| {})?;
                let fd = self.root.open_dir(dir)?;
                fsx::set_opaque(&fd, dir)
            }
            Form::Flatten => {
                if !dir.as_os_str().is_empty() {
                    self.note_layer_path(dir);
                }
                match self.root.lstat(dir)? {
                    Some(n) if n.kind == NodeKind::Dir => {}
                    None => return Ok(()),
                    Some(_) => return Err(ImageError::ThroughSymlink { path: show(dir) }),
                }
                let keep = &self.this_layer;
                self.root
                    .remove_children_except(dir, &mut |p| keep.contains(p))
            }
        }
    }

    fn finish_dirs(&mut self) -> R<()> {
        for (rel, mtime) in self.dir_times.iter().rev() {
            let (parent, name) = fsx::split(rel);
            let Some(pfd) = self.root.try_open_path(parent)? else {
                continue;
            };
            match fsx::statat(&pfd, name, rel)? {
                Some(n) if n.kind == NodeKind::Dir => fsx::set_mtime_at(&pfd, name, rel, *mtime)?,
                _ => {}
            }
        }
        Ok(())
    }
}

/// Unpacks an archive into an empty (or absent) `dir` in overlay form with inner ids:
/// whiteouts become 0:0 char devices, `.wh..wh..opq` becomes the opaque xattr. Unsafe members
/// are refused with a typed error, and then `dir` is emptied again.
pub fn unpack_layer(
    archive: impl Read,
    dir: &Path,
    limits: &UnpackLimits,
) -> Result<UnpackStats, ImageError> {
    let created = fsx::prepare_empty_dir(dir)?;
    let res = Root::open(dir).and_then(|root| {
        extract(
            archive,
            &root,
            Form::Overlay,
            limits,
            &mut Counters::default(),
            false,
        )
    });
    match res {
        Ok(x) => Ok(x.stats),
        Err(e) => {
            fsx::discard(dir, created);
            Err(e)
        }
    }
}

/// Applies one layer archive (OCI/docker layer tar; gzip, zstd or plain, told by magic)
/// onto a root filesystem dir as the OCI image spec says: whiteouts delete, opaque markers
/// clear what lower layers put in their directory. On error the rootfs is left part-way;
/// callers discard it.
pub fn apply_oci_layer(
    tar: impl Read,
    rootfs: &Path,
    limits: &UnpackLimits,
) -> Result<UnpackStats, ImageError> {
    let root = Root::open(rootfs)?;
    extract(
        tar,
        &root,
        Form::Flatten,
        limits,
        &mut Counters::default(),
        false,
    )
    .map(|x| x.stats)
}
