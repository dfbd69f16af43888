//! Build contexts: the tar (plain or gzip) an E2B SDK uploads with the sources of a COPY
//! step. The archive is untrusted input. [`select_context`] never writes to the host's
//! filesystem: it checks every member (names, types, link targets, sizes), picks the members
//! the step's source pattern names, and writes them as a new plain tar laid out as they land
//! under the step's destination, owned by the step's user. That tar is unpacked inside the
//! sandbox being built, never on the host.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;

use crate::archive::{HEADER_WINDOW, Meter, Metered, decompress, hardlink_target, sanitize};
use crate::error::ImageError;
use crate::fsx::{self, show};

/// Caps on one build context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextLimits {
    /// Total bytes of regular-file content (decompressed).
    pub max_bytes: u64,
    /// Members, directories included.
    pub max_entries: u64,
}

impl Default for ContextLimits {
    fn default() -> Self {
        ContextLimits {
            max_bytes: 1 << 30,
            max_entries: 100_000,
        }
    }
}

/// What a COPY step takes from a context and how it writes it.
#[derive(Debug, Clone)]
pub struct CopySpec<'a> {
    /// The step's source: a relative path or glob (`*`, `?`, `[...]` within one name).
    pub pattern: &'a str,
    /// Owner of everything written.
    pub uid: u32,
    /// Group of everything written.
    pub gid: u32,
    /// Permission bits for every file and directory written (symlinks keep theirs).
    pub mode: Option<u32>,
}

/// What [`select_context`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Members in the context.
    pub entries: u64,
    /// Members written.
    pub written: u64,
    /// Bytes of file content written.
    pub bytes: u64,
    /// Set when the pattern named one file (or symlink) only: its name in the written tar,
    /// which then lands at the destination path itself unless that is a directory.
    pub single_file: Option<String>,
}

/// The kind of a member as far as placement is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Dir,
    File,
    Symlink,
}

/// Reads a build context, checks it and writes the members `spec.pattern` selects to `out`
/// as a plain tar, relative to the destination: a matched file goes in under its own name,
/// a matched directory's contents go in directly (as Docker's COPY does).
///
/// Refused, with a typed error: names that are absolute, have `..` or a NUL, or are too long;
/// members below a symlink of the archive; symlinks whose relative target climbs out of
/// the copied tree; hardlinks to anything but a file copied before them; device nodes,
/// FIFOs and other special files; more content or members than `limits` allow; a pattern
/// that selects nothing. Absolute symlink targets are kept as they are: they name paths of
/// the sandbox's own filesystem, and nothing on the host resolves them.
pub fn select_context(
    input: impl Read,
    out: impl Write,
    spec: &CopySpec<'_>,
    limits: &ContextLimits,
) -> Result<Selection, ImageError> {
    let pattern = parse_pattern(spec.pattern)?;
    let meter = Rc::new(RefCell::new(Meter {
        left: limits
            .max_bytes
            .saturating_add(limits.max_entries.saturating_mul(8192))
            .saturating_add(16 << 20),
        window: None,
        exceeded: false,
    }));
    let read_err = |e: io::Error, meter: &Rc<RefCell<Meter>>| {
        if meter.borrow().exceeded {
            ImageError::TooBig {
                limit: limits.max_bytes,
            }
        } else {
            ImageError::BadArchive(e.to_string())
        }
    };
    let metered = Metered {
        inner: decompress(input)?,
        meter: meter.clone(),
        hash: None,
        bytes: 0,
    };
    let mut ar = tar::Archive::new(metered);
    let mut builder = tar::Builder::new(out);
    let mut sel = Selector {
        pattern,
        spec,
        kinds: HashMap::new(),
        symlinks: HashSet::new(),
        roots: HashMap::new(),
        written_files: HashSet::new(),
        stats: Selection::default(),
        content: 0,
        limits,
    };
    {
        let mut entries = ar.entries().map_err(|e| read_err(e, &meter))?;
        loop {
            meter.borrow_mut().window = Some(HEADER_WINDOW);
            let next = entries.next();
            meter.borrow_mut().window = None;
            let Some(entry) = next else { break };
            let mut entry = entry.map_err(|e| read_err(e, &meter))?;
            sel.member(&mut entry, &mut builder).map_err(|e| match e {
                ImageError::BadArchive(_) if meter.borrow().exceeded => ImageError::TooBig {
                    limit: limits.max_bytes,
                },
                other => other,
            })?;
            io::copy(&mut entry, &mut io::sink()).map_err(|e| read_err(e, &meter))?;
        }
    }
    if meter.borrow().exceeded {
        return Err(ImageError::TooBig {
            limit: limits.max_bytes,
        });
    }
    if sel.roots.is_empty() {
        return Err(ImageError::BadArchive(format!(
            "the COPY source {:?} matches nothing in the uploaded files",
            spec.pattern
        )));
    }
    builder
        .finish()
        .map_err(|e| ImageError::io("write", "the selected files", e))?;
    let mut stats = sel.stats;
    if sel.roots.len() == 1
        && let Some((root, kind)) = sel.roots.iter().next()
        && *kind != Kind::Dir
    {
        stats.single_file = root
            .file_name()
            .map(|n| String::from_utf8_lossy(n.as_bytes()).into_owned());
    }
    Ok(stats)
}

struct Selector<'a> {
    pattern: Vec<Vec<u8>>,
    spec: &'a CopySpec<'a>,
    /// Every member seen, by its (normalized) archive path.
    kinds: HashMap<PathBuf, Kind>,
    /// Archive paths of symlinks: nothing may lie below one.
    symlinks: HashSet<PathBuf>,
    /// Archive paths the pattern matched, and what they are.
    roots: HashMap<PathBuf, Kind>,
    /// Output paths of regular files written: the only hardlink targets.
    written_files: HashSet<PathBuf>,
    stats: Selection,
    content: u64,
    limits: &'a ContextLimits,
}

impl Selector<'_> {
    fn member<Rd: Read, W: Write>(
        &mut self,
        entry: &mut tar::Entry<'_, Rd>,
        out: &mut tar::Builder<W>,
    ) -> Result<(), ImageError> {
        use tar::EntryType as T;
        let raw = entry.path_bytes().into_owned();
        let rel = sanitize(&raw)?;
        self.stats.entries += 1;
        if self.stats.entries > self.limits.max_entries {
            return Err(ImageError::TooManyEntries {
                limit: self.limits.max_entries,
            });
        }
        let etype = entry.header().entry_type();
        if etype.is_pax_global_extensions() {
            return Ok(());
        }
        if rel.as_os_str().is_empty() {
            if etype.is_dir() {
                return Ok(());
            }
            return Err(ImageError::UnsafePath {
                path: String::from_utf8_lossy(&raw).into_owned(),
                reason: "the archive root is not a directory",
            });
        }
        // Nothing is placed below a symlink (or a file) of the archive.
        for a in rel.ancestors().skip(1) {
            if a.as_os_str().is_empty() {
                break;
            }
            if self.symlinks.contains(a) || self.kinds.get(a) == Some(&Kind::File) {
                return Err(ImageError::ThroughSymlink { path: show(&rel) });
            }
        }
        let kind = match etype {
            T::Regular | T::Continuous => Kind::File,
            T::Directory => Kind::Dir,
            T::Symlink => Kind::Symlink,
            T::Link => Kind::File,
            T::Char => return Err(special(&rel, "character device")),
            T::Block => return Err(special(&rel, "block device")),
            T::Fifo => return Err(special(&rel, "fifo")),
            _ => return Err(special(&rel, "member of an unsupported type")),
        };
        match self.kinds.get(&rel) {
            None => {}
            Some(Kind::Dir) if kind == Kind::Dir => {}
            Some(_) => {
                return Err(ImageError::UnsafePath {
                    path: show(&rel),
                    reason: "the archive holds this path twice",
                });
            }
        }
        self.kinds.insert(rel.clone(), kind);
        if kind == Kind::Symlink {
            self.symlinks.insert(rel.clone());
        }
        let size = entry.header().size().unwrap_or(0);
        if kind == Kind::File && etype != T::Link {
            self.content = self.content.saturating_add(size);
            if self.content > self.limits.max_bytes {
                return Err(ImageError::TooBig {
                    limit: self.limits.max_bytes,
                });
            }
        }
        let Some(dest) = self.place(&rel, kind)? else {
            return Ok(());
        };
        let mtime = entry.header().mtime().unwrap_or(0);
        let raw_mode = entry.header().mode().unwrap_or(0o644) & 0o7777;
        // setuid and setgid bits from someone's laptop are never kept.
        let mode = self.spec.mode.unwrap_or(raw_mode & 0o777) & 0o7777;
        let mut h = tar::Header::new_gnu();
        h.set_uid(u64::from(self.spec.uid));
        h.set_gid(u64::from(self.spec.gid));
        h.set_mtime(mtime);
        let write_err = |e: io::Error| ImageError::io("write", show(&dest), e);
        match (kind, etype) {
            (Kind::Dir, _) => {
                h.set_entry_type(T::Directory);
                h.set_mode(mode);
                h.set_size(0);
                out.append_data(&mut h, &dest, io::empty())
                    .map_err(write_err)?;
            }
            (Kind::Symlink, _) => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                check_symlink(&rel, &dest, &target)?;
                h.set_entry_type(T::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                out.append_link(&mut h, &dest, OsStr::from_bytes(&target))
                    .map_err(write_err)?;
            }
            (Kind::File, T::Link) => {
                let (target, bad_link) = hardlink_target(entry, &rel)?;
                let out_target = match self.kinds.get(&target) {
                    Some(Kind::File) => self.place(&target, Kind::File)?,
                    _ => None,
                };
                let Some(out_target) = out_target.filter(|t| self.written_files.contains(t)) else {
                    return Err(bad_link.refuse("target is not a file copied before it"));
                };
                h.set_entry_type(T::Link);
                h.set_mode(mode);
                h.set_size(0);
                out.append_link(&mut h, &dest, &out_target)
                    .map_err(write_err)?;
                self.written_files.insert(dest);
            }
            (Kind::File, _) => {
                h.set_entry_type(T::Regular);
                h.set_mode(mode);
                h.set_size(size);
                out.append_data(&mut h, &dest, entry.by_ref().take(size))
                    .map_err(|e| ImageError::BadArchive(format!("{}: {e}", show(&rel))))?;
                self.stats.bytes += size;
                self.written_files.insert(dest);
            }
        }
        self.stats.written += 1;
        Ok(())
    }

    /// Where member `rel` lands relative to the destination, if the pattern selects it.
    fn place(&mut self, rel: &Path, kind: Kind) -> Result<Option<PathBuf>, ImageError> {
        let parts: Vec<&[u8]> = rel.iter().map(|c| c.as_bytes()).collect();
        let n = self.pattern.len();
        if parts.len() < n
            || !self
                .pattern
                .iter()
                .zip(&parts)
                .all(|(p, name)| glob_match(p, name))
        {
            return Ok(None);
        }
        let root: PathBuf = parts[..n].iter().map(|c| OsStr::from_bytes(c)).collect();
        if parts.len() == n {
            self.roots.insert(root.clone(), kind);
            return Ok(match kind {
                // A matched directory's contents go into the destination; the directory
                // itself is the destination.
                Kind::Dir => None,
                _ => root.file_name().map(PathBuf::from),
            });
        }
        self.roots.entry(root).or_insert(Kind::Dir);
        Ok(Some(
            parts[n..].iter().map(|c| OsStr::from_bytes(c)).collect(),
        ))
    }
}

fn special(rel: &Path, kind: &'static str) -> ImageError {
    ImageError::SpecialFile {
        path: show(rel),
        kind,
    }
}

/// A relative symlink must resolve (lexically) inside the copied tree; absolute targets
/// name the sandbox's own paths and are kept.
fn check_symlink(rel: &Path, dest: &Path, target: &[u8]) -> Result<(), ImageError> {
    let bad = |reason| ImageError::UnsafePath {
        path: show(rel),
        reason,
    };
    if target.is_empty() || target.contains(&0) || target.len() > fsx::PATH_MAX {
        return Err(bad(
            "symlink target is empty, has a NUL or is longer than PATH_MAX",
        ));
    }
    if target.starts_with(b"/") {
        return Ok(());
    }
    let mut depth: i64 = dest.parent().map_or(0, |p| p.iter().count() as i64);
    for c in Path::new(OsStr::from_bytes(target)).components() {
        match c {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            _ => {}
        }
        if depth < 0 {
            return Err(bad("symlink target climbs out of the copied tree"));
        }
    }
    Ok(())
}

/// The pattern's names; it must be relative and free of `..`.
fn parse_pattern(pattern: &str) -> Result<Vec<Vec<u8>>, ImageError> {
    let bad = |reason| ImageError::UnsafePath {
        path: pattern.to_string(),
        reason,
    };
    if pattern.starts_with('/') {
        return Err(bad("a COPY source must be relative to the context"));
    }
    let parts: Vec<Vec<u8>> = sanitize(pattern.as_bytes())?
        .iter()
        .map(|c| c.as_bytes().to_vec())
        .collect();
    if parts.is_empty() {
        // `.`: everything in the context.
        return Ok(vec![b"*".to_vec()]);
    }
    Ok(parts)
}

/// Shell-style matching of one name: `*`, `?`, `[...]` (with `!` or `^`), `\` escapes.
fn glob_match(pattern: &[u8], name: &[u8]) -> bool {
    let (mut p, mut n) = (0usize, 0usize);
    let (mut star_p, mut star_n) = (None, 0usize);
    while n < name.len() {
        if p < pattern.len() {
            match pattern[p] {
                b'*' => {
                    star_p = Some(p);
                    star_n = n;
                    p += 1;
                    continue;
                }
                b'?' => {
                    p += 1;
                    n += 1;
                    continue;
                }
                b'[' => {
                    if let Some((matched, next)) = class(&pattern[p..], name[n])
                        && matched
                    {
                        p += next;
                        n += 1;
                        continue;
                    }
                }
                b'\\' if p + 1 < pattern.len() && pattern[p + 1] == name[n] => {
                    p += 2;
                    n += 1;
                    continue;
                }
                // An escaped character that does not match.
                b'\\' if p + 1 < pattern.len() => {}
                c if c == name[n] => {
                    p += 1;
                    n += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star_p {
            Some(sp) => {
                p = sp + 1;
                star_n += 1;
                n = star_n;
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|c| *c == b'*')
}

/// A `[...]` class at the start of `p`: whether `c` is in it and the class's length.
fn class(p: &[u8], c: u8) -> Option<(bool, usize)> {
    let mut i = 1;
    let negate = matches!(p.get(i), Some(b'!' | b'^'));
    if negate {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    while i < p.len() {
        if p[i] == b']' && !first {
            return Some((matched != negate, i + 1));
        }
        first = false;
        if i + 2 < p.len() && p[i + 1] == b'-' && p[i + 2] != b']' {
            if p[i] <= c && c <= p[i + 2] {
                matched = true;
            }
            i += 3;
        } else {
            if p[i] == c {
                matched = true;
            }
            i += 1;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    enum M<'a> {
        File(&'a str, &'a [u8]),
        Dir(&'a str),
        Link(&'a str, &'a str),
        Hard(&'a str, &'a str),
        Raw(&'a str, tar::EntryType),
    }

    /// A tar written header by header, so that names the `tar` crate's own checks would
    /// refuse can be made too.
    fn archive(members: &[M<'_>], gzip: bool) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for m in members {
            let mut h = tar::Header::new_old();
            let (name, data, kind, link): (&str, &[u8], tar::EntryType, Option<&str>) = match m {
                M::File(n, d) => (n, d, tar::EntryType::Regular, None),
                M::Dir(n) => (n, b"", tar::EntryType::Directory, None),
                M::Link(n, t) => (n, b"", tar::EntryType::Symlink, Some(t)),
                M::Hard(n, t) => (n, b"", tar::EntryType::Link, Some(t)),
                M::Raw(n, k) => (n, b"", *k, None),
            };
            h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            if let Some(t) = link {
                h.as_old_mut().linkname[..t.len()].copy_from_slice(t.as_bytes());
            }
            h.set_entry_type(kind);
            h.set_size(data.len() as u64);
            h.set_mode(0o755);
            h.set_cksum();
            b.append(&h, data).unwrap();
        }
        let plain = b.into_inner().unwrap();
        if !gzip {
            return plain;
        }
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&plain).unwrap();
        gz.finish().unwrap()
    }

    fn spec(pattern: &str) -> CopySpec<'_> {
        CopySpec {
            pattern,
            uid: 1000,
            gid: 1000,
            mode: None,
        }
    }

    /// A written member: name, type, content (or link target) and owner.
    type Written = (String, tar::EntryType, Vec<u8>, u64);

    fn select(
        members: &[M<'_>],
        pattern: &str,
        limits: &ContextLimits,
    ) -> Result<(Selection, Vec<Written>), ImageError> {
        let input = archive(members, true);
        let mut out = Vec::new();
        let s = select_context(&input[..], &mut out, &spec(pattern), limits)?;
        let mut listed = Vec::new();
        let mut ar = tar::Archive::new(&out[..]);
        for e in ar.entries().unwrap() {
            let mut e = e.unwrap();
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            let name = String::from_utf8_lossy(&e.path_bytes()).into_owned();
            let link = e
                .link_name_bytes()
                .map(|l| l.into_owned())
                .unwrap_or_default();
            let uid = e.header().uid().unwrap();
            let kind = e.header().entry_type();
            listed.push((name, kind, if link.is_empty() { data } else { link }, uid));
        }
        Ok((s, listed))
    }

    #[test]
    fn a_glob_places_files_by_name_and_directories_by_content() {
        let (s, got) = select(
            &[
                M::Dir("folder"),
                M::File("folder/a.txt", b"A"),
                M::Link("folder/l.txt", "a.txt"),
                M::Link("folder/abs.txt", "/etc/hostname"),
                M::Dir("folder/sub"),
                M::File("folder/sub/b.txt", b"B"),
                M::File("other.txt", b"O"),
            ],
            "folder/*",
            &ContextLimits::default(),
        )
        .unwrap();
        let names: Vec<&str> = got.iter().map(|g| g.0.as_str()).collect();
        assert_eq!(names, ["a.txt", "l.txt", "abs.txt", "b.txt"]);
        assert_eq!(got[0].2, b"A");
        assert_eq!(got[0].3, 1000, "owned by the step's user");
        assert_eq!(got[1].2, b"a.txt");
        assert_eq!(s.single_file, None);
        assert_eq!(s.bytes, 2);
        // One file: it may land at the destination path itself.
        let (s, got) = select(
            &[M::Dir("folder"), M::File("folder/a.txt", b"A")],
            "folder/a.txt",
            &ContextLimits::default(),
        )
        .unwrap();
        assert_eq!(s.single_file.as_deref(), Some("a.txt"));
        assert_eq!(got.len(), 1);
        // A directory: its contents.
        let (_, got) = select(
            &[
                M::Dir("d"),
                M::Dir("d/e"),
                M::File("d/e/f", b"F"),
                M::File("./d/g", b"G"),
            ],
            "d",
            &ContextLimits::default(),
        )
        .unwrap();
        let names: Vec<&str> = got.iter().map(|g| g.0.as_str()).collect();
        assert_eq!(names, ["e", "e/f", "g"]);
    }

    #[test]
    fn globs_match_one_name_at_a_time() {
        assert!(glob_match(b"*", b"abc"));
        assert!(glob_match(b"*.txt", b"a.txt"));
        assert!(!glob_match(b"*.txt", b"a.txt.bak"));
        assert!(glob_match(b"a?c", b"abc"));
        assert!(glob_match(b"[a-c]x", b"bx"));
        assert!(!glob_match(b"[!a-c]x", b"bx"));
        assert!(glob_match(b"\\*", b"*"));
        assert!(!glob_match(b"\\*", b"a"));
        assert!(glob_match(b"a*b*c", b"aXbYc"));
    }

    #[test]
    fn unsafe_members_are_refused() {
        let limits = ContextLimits::default();
        let cases: Vec<(Vec<M<'_>>, &str)> = vec![
            (vec![M::File("../escape", b"x")], "dotdot"),
            (vec![M::File("a/../../escape", b"x")], "nested dotdot"),
            (vec![M::File("/etc/passwd", b"x")], "absolute"),
            (
                vec![M::Link("a", "/etc"), M::File("a/passwd", b"x")],
                "through an absolute symlink",
            ),
            (
                vec![M::Link("a", "b"), M::Dir("a/c")],
                "through a relative symlink",
            ),
            (
                vec![M::File("a", b"x"), M::File("a/b", b"x")],
                "below a file",
            ),
            (vec![M::Link("l", "../../etc/shadow")], "climbing symlink"),
            (vec![M::Link("d/l", "../../x")], "climbing symlink below"),
            (vec![M::Hard("h", "/etc/shadow")], "hardlink outside"),
            (vec![M::Hard("h", "nothing")], "hardlink to nothing"),
            (
                vec![M::Raw("dev", tar::EntryType::Char)],
                "character device",
            ),
            (vec![M::Raw("blk", tar::EntryType::Block)], "block device"),
            (vec![M::Raw("fifo", tar::EntryType::Fifo)], "fifo"),
            (
                vec![M::File("a", b"x"), M::Link("a", "/etc/passwd")],
                "the same path twice",
            ),
        ];
        for (members, what) in cases {
            let e = select(&members, "*", &limits);
            assert!(e.is_err(), "{what} was accepted");
            let e = e.unwrap_err();
            assert!(e.is_input_error(), "{what}: {e}");
        }
        // The pattern itself.
        for p in ["/etc", "../x", "a/../../b"] {
            assert!(select(&[M::File("a", b"x")], p, &limits).is_err(), "{p}");
        }
        assert!(
            select(&[M::File("a", b"x")], "b*", &limits)
                .unwrap_err()
                .to_string()
                .contains("matches nothing")
        );
        // Relative symlinks inside the tree, and a hardlink to a copied file, are fine.
        let (_, got) = select(
            &[
                M::Dir("d"),
                M::File("d/f", b"x"),
                M::Dir("d/e"),
                M::Link("d/e/l", "../f"),
                M::Hard("d/h", "d/f"),
            ],
            "*",
            &limits,
        )
        .unwrap();
        assert_eq!(got.len(), 4);
        assert_eq!(got[3].1, tar::EntryType::Link);
        assert_eq!(got[3].2, b"f");
    }

    #[test]
    fn size_and_count_bombs_stop_at_the_limits() {
        let big = vec![0u8; 64 << 10];
        let members: Vec<M<'_>> = (0..4).map(|_| M::File("f", &big)).collect();
        let limits = ContextLimits {
            max_bytes: 100 << 10,
            max_entries: 1000,
        };
        // Four different names of 64 KiB each: over 100 KiB.
        let names = ["a", "b", "c", "d"];
        let members: Vec<M<'_>> = names
            .iter()
            .zip(members)
            .map(|(n, _)| M::File(n, &big))
            .collect();
        assert!(matches!(
            select(&members, "*", &limits).unwrap_err(),
            ImageError::TooBig { .. }
        ));
        // A gzip of zeros that expands far beyond the cap stops at it.
        let huge = vec![0u8; 8 << 20];
        let e = select(&[M::File("z", &huge)], "*", &limits).unwrap_err();
        assert!(matches!(e, ImageError::TooBig { .. }), "{e}");
        let many: Vec<String> = (0..20).map(|i| format!("f{i}")).collect();
        let members: Vec<M<'_>> = many.iter().map(|n| M::File(n, b"")).collect();
        let e = select(
            &members,
            "*",
            &ContextLimits {
                max_bytes: 1 << 20,
                max_entries: 10,
            },
        )
        .unwrap_err();
        assert!(matches!(e, ImageError::TooManyEntries { .. }), "{e}");
        // Garbage is a bad archive, not a panic.
        let e = select_context(
            &b"not a tar at all, just some words"[..],
            Vec::new(),
            &spec("*"),
            &limits,
        )
        .unwrap_err();
        assert!(e.is_input_error());
    }

    #[test]
    fn modes_come_from_the_step_and_setuid_is_dropped() {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_path("s").unwrap();
        h.set_size(1);
        h.set_mode(0o4755);
        h.set_cksum();
        b.append(&h, &b"x"[..]).unwrap();
        let input = b.into_inner().unwrap();
        let read_mode = |mode: Option<u32>| {
            let mut out = Vec::new();
            select_context(
                &input[..],
                &mut out,
                &CopySpec {
                    pattern: "s",
                    uid: 0,
                    gid: 0,
                    mode,
                },
                &ContextLimits::default(),
            )
            .unwrap();
            let mut ar = tar::Archive::new(&out[..]);
            let e = ar.entries().unwrap().next().unwrap().unwrap();
            e.header().mode().unwrap()
        };
        assert_eq!(read_mode(None), 0o755);
        assert_eq!(read_mode(Some(0o600)), 0o600);
    }
}
