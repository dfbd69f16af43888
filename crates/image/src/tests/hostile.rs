//! Archives built to break out: each is refused with a typed error, and nothing appears or
//! changes outside the target directory.

use std::fs;
use std::path::Path;

use tar::{EntryType, Header};

use super::*;
use crate::{ImageError, UnpackLimits, apply_oci_layer, unpack_layer};

/// Builds tars header by header, names and link targets written raw (the tar crate's own
/// path setters refuse `..` and absolute paths, which is exactly what these tests need).
struct RawTar {
    b: tar::Builder<Vec<u8>>,
}

impl RawTar {
    fn new() -> RawTar {
        RawTar {
            b: tar::Builder::new(Vec::new()),
        }
    }

    fn long(&mut self, kind: EntryType, data: &[u8]) {
        let mut h = Header::new_gnu();
        h.as_gnu_mut().unwrap().name[..13].copy_from_slice(b"././@LongLink");
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_cksum();
        self.b.append(&h, data).unwrap();
    }

    #[allow(clippy::too_many_arguments)]
    fn raw(
        &mut self,
        name: &[u8],
        kind: EntryType,
        link: &[u8],
        mode: u32,
        uid: u64,
        data: &[u8],
    ) -> &mut Self {
        if name.len() > 99 {
            let mut n = name.to_vec();
            n.push(0);
            self.long(EntryType::GNULongName, &n);
        }
        let mut h = Header::new_gnu();
        {
            let g = h.as_gnu_mut().unwrap();
            let n = name.len().min(99);
            g.name[..n].copy_from_slice(&name[..n]);
            g.linkname[..link.len()].copy_from_slice(link);
        }
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(uid);
        h.set_mtime(1_600_000_000);
        h.set_size(data.len() as u64);
        if matches!(kind, EntryType::Char | EntryType::Block) {
            h.set_device_major(1).unwrap();
            h.set_device_minor(3).unwrap();
        }
        h.set_cksum();
        self.b.append(&h, data).unwrap();
        self
    }

    fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
        self.raw(name.as_bytes(), EntryType::Regular, b"", 0o644, 0, data)
    }

    fn dir(&mut self, name: &str) -> &mut Self {
        self.raw(name.as_bytes(), EntryType::Directory, b"", 0o755, 0, b"")
    }

    fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.raw(
            name.as_bytes(),
            EntryType::Symlink,
            target.as_bytes(),
            0o777,
            0,
            b"",
        )
    }

    fn hardlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.raw(
            name.as_bytes(),
            EntryType::Link,
            target.as_bytes(),
            0o644,
            0,
            b"",
        )
    }

    fn done(&mut self) -> Vec<u8> {
        let b = std::mem::replace(&mut self.b, tar::Builder::new(Vec::new()));
        b.into_inner().unwrap()
    }
}

fn limits() -> UnpackLimits {
    UnpackLimits::default()
}

/// Runs an archive through both extractors (overlay form into an empty dir, flatten onto a
/// rootfs that already has content) and hands back both errors; checks nothing leaked.
fn refuse_both(archive: &[u8], lim: &UnpackLimits) -> (ImageError, ImageError) {
    let a = Arena::new();
    let e1 = unpack_layer(archive, &a.target(), lim).expect_err("unpack_layer accepted it");
    a.assert_untouched();
    // unpack_layer leaves its target empty after a refusal.
    assert_eq!(fs::read_dir(a.target()).unwrap().count(), 0);

    let b = Arena::new();
    fs::write(b.target().join("existing"), b"lower layer").unwrap();
    let e2 = apply_oci_layer(archive, &b.target(), lim).expect_err("apply_oci_layer accepted it");
    b.assert_untouched();
    (e1, e2)
}

fn assert_unsafe_path(archive: &[u8]) {
    let (e1, e2) = refuse_both(archive, &limits());
    for e in [e1, e2] {
        assert!(matches!(e, ImageError::UnsafePath { .. }), "{e}");
        assert!(e.is_input_error());
    }
}

#[test]
fn dotdot_and_absolute_members_are_refused() {
    assert_unsafe_path(
        &RawTar::new()
            .file("ok", b"fine")
            .file("../x", b"escape")
            .done(),
    );
    assert_unsafe_path(&RawTar::new().dir("a").file("a/../../x", b"escape").done());
    assert_unsafe_path(&RawTar::new().file("..", b"escape").done());
    let abs = format!("/etc/sandpit-image-test-{}", std::process::id());
    assert_unsafe_path(&RawTar::new().file(&abs, b"escape").done());
    assert!(!Path::new(&abs).exists());
    // The same through a GNU long name, and the tar crate's PAX-free long link.
    let long_escape = format!("{}/../../../x", "d/".repeat(60));
    assert_unsafe_path(&RawTar::new().file(&long_escape, b"escape").done());
}

#[test]
fn names_with_nul_or_past_path_max_are_refused() {
    let mut t = RawTar::new();
    t.long(EntryType::GNULongName, b"a\0b/c\0");
    t.file("placeholder", b"x");
    assert_unsafe_path(&t.done());
    let long = "n/".repeat(2100) + "f";
    assert_unsafe_path(&RawTar::new().file(&long, b"x").done());
    let wide = "w".repeat(300);
    assert_unsafe_path(&RawTar::new().file(&wide, b"x").done());
}

#[test]
fn writing_through_a_symlink_member_is_refused() {
    let a = Arena::new();
    let outside = a.base().display().to_string();
    for (link, target) in [("evil", "/"), ("evil", outside.as_str()), ("evil", "..")] {
        let archive = RawTar::new()
            .symlink(link, target)
            .file("evil/canary", b"overwritten")
            .done();
        let (e1, e2) = refuse_both(&archive, &limits());
        for e in [e1, e2] {
            assert!(
                matches!(e, ImageError::ThroughSymlink { .. }),
                "{target}: {e}"
            );
        }
        // Directories and whiteouts through a symlink, too.
        let archive = RawTar::new().symlink("evil", target).dir("evil/sub").done();
        let (e1, e2) = refuse_both(&archive, &limits());
        assert!(matches!(e1, ImageError::ThroughSymlink { .. }), "{e1}");
        assert!(matches!(e2, ImageError::ThroughSymlink { .. }), "{e2}");
        let archive = RawTar::new()
            .symlink("evil", target)
            .file("evil/.wh.canary", b"")
            .done();
        let (e1, e2) = refuse_both(&archive, &limits());
        assert!(matches!(e1, ImageError::ThroughSymlink { .. }), "{e1}");
        assert!(matches!(e2, ImageError::ThroughSymlink { .. }), "{e2}");
        let archive = RawTar::new()
            .symlink("evil", target)
            .file("evil/.wh..wh..opq", b"")
            .done();
        let (e1, e2) = refuse_both(&archive, &limits());
        assert!(matches!(e1, ImageError::ThroughSymlink { .. }), "{e1}");
        assert!(matches!(e2, ImageError::ThroughSymlink { .. }), "{e2}");
    }
    // A symlink replacing a directory the archive made, then a write below it.
    let archive = RawTar::new()
        .dir("d")
        .symlink("d", &outside)
        .file("d/canary", b"overwritten")
        .done();
    let (e1, e2) = refuse_both(&archive, &limits());
    assert!(matches!(e1, ImageError::ThroughSymlink { .. }), "{e1}");
    assert!(matches!(e2, ImageError::ThroughSymlink { .. }), "{e2}");
}

#[test]
fn a_symlink_member_alone_is_data() {
    let a = Arena::new();
    let archive = RawTar::new()
        .symlink("evil", "/")
        .symlink("up", "../canary")
        .done();
    unpack_layer(&archive[..], &a.target(), &limits()).unwrap();
    assert_eq!(
        fs::read_link(a.target().join("evil")).unwrap(),
        Path::new("/")
    );
    a.assert_untouched();
}

#[test]
fn hardlinks_outside_or_to_unextracted_targets_are_refused() {
    let a = Arena::new();
    let outside = a.base().join("canary").display().to_string();
    let cases: Vec<Vec<u8>> = vec![
        RawTar::new().hardlink("h", "/etc/passwd").done(),
        RawTar::new().hardlink("h", "../canary").done(),
        RawTar::new().hardlink("h", &outside).done(),
        // Not extracted (yet): a later member, or a file already in the rootfs.
        RawTar::new()
            .hardlink("h", "later")
            .file("later", b"x")
            .done(),
        RawTar::new().hardlink("h", "existing").done(),
        // Not a file: a symlink the archive made, pointing outside.
        RawTar::new()
            .symlink("s", &outside)
            .hardlink("h", "s")
            .done(),
        RawTar::new().dir("d").hardlink("h", "d").done(),
    ];
    for archive in cases {
        let (e1, e2) = refuse_both(&archive, &limits());
        for e in [e1, e2] {
            assert!(matches!(e, ImageError::UnsafeHardlink { .. }), "{e}");
        }
    }
    // A file replaced by a symlink after it was extracted is no longer a valid target.
    let archive = RawTar::new()
        .file("f", b"x")
        .symlink("f", &outside)
        .hardlink("h", "f")
        .done();
    let (e1, _) = refuse_both(&archive, &limits());
    assert!(matches!(e1, ImageError::UnsafeHardlink { .. }), "{e1}");
}

#[test]
fn hardlinks_within_the_archive_work() {
    let a = Arena::new();
    let archive = RawTar::new()
        .dir("d")
        .file("d/f", b"shared")
        .hardlink("d/g", "./d/f")
        .done();
    unpack_layer(&archive[..], &a.target(), &limits()).unwrap();
    use std::os::unix::fs::MetadataExt;
    let ino = |p: &str| fs::metadata(a.target().join(p)).unwrap().ino();
    assert_eq!(ino("d/f"), ino("d/g"));
    a.assert_untouched();
}

#[test]
fn devices_and_fifos_are_refused() {
    for kind in [EntryType::Char, EntryType::Block, EntryType::Fifo] {
        let archive = RawTar::new()
            .file("ok", b"x")
            .raw(b"dev/thing", kind, b"", 0o666, 0, b"")
            .done();
        let (e1, e2) = refuse_both(&archive, &limits());
        for e in [e1, e2] {
            assert!(matches!(e, ImageError::SpecialFile { .. }), "{kind:?}: {e}");
        }
    }
}

#[test]
fn setuid_from_a_foreign_owner_is_refused_and_kept_otherwise() {
    let archive = RawTar::new()
        .raw(b"su", EntryType::Regular, b"", 0o4755, 70_000, b"x")
        .done();
    let (e1, e2) = refuse_both(&archive, &limits());
    for e in [e1, e2] {
        assert!(
            matches!(e, ImageError::ForeignSetuid { uid: 70_000, .. }),
            "{e}"
        );
    }
    let a = Arena::new();
    let archive = RawTar::new()
        .raw(b"su", EntryType::Regular, b"", 0o4755, 0, b"x")
        .raw(b"sg", EntryType::Regular, b"", 0o2711, 1000, b"x")
        .raw(b"big", EntryType::Regular, b"", 0o644, 70_000, b"x")
        .done();
    unpack_layer(&archive[..], &a.target(), &limits()).unwrap();
    assert_eq!(mode(&a.target().join("su")), 0o4755);
    assert_eq!(mode(&a.target().join("sg")), 0o2711);
    assert_eq!(owner(&a.target().join("sg")), (1000, 1000));
    // Out-of-range owners show as the overflow id, as the kernel would show them.
    assert_eq!(owner(&a.target().join("big")), (65534, 65534));
}

#[test]
fn entry_and_byte_limits_hold() {
    let mut t = RawTar::new();
    for i in 0..10 {
        t.file(&format!("f{i}"), b"x");
    }
    let lim = UnpackLimits {
        max_bytes: 1 << 20,
        max_entries: 5,
    };
    let (e1, e2) = refuse_both(&t.done(), &lim);
    for e in [e1, e2] {
        assert!(matches!(e, ImageError::TooManyEntries { limit: 5 }), "{e}");
    }

    let lim = UnpackLimits {
        max_bytes: 1000,
        max_entries: 100,
    };
    let one_big = RawTar::new().file("big", &pattern(2000, 3)).done();
    let many_small = {
        let mut t = RawTar::new();
        for i in 0..5 {
            t.file(&format!("f{i}"), &pattern(300, i));
        }
        t.done()
    };
    for archive in [one_big, many_small] {
        let (e1, e2) = refuse_both(&archive, &lim);
        for e in [e1, e2] {
            assert!(matches!(e, ImageError::TooBig { limit: 1000 }), "{e}");
        }
    }
    // A header that claims megabytes of PAX records is cut off, not buffered.
    let mut t = RawTar::new();
    let mut pax = Vec::new();
    let rec = format!("{} comment={}\n", 2_000_017, "c".repeat(2_000_000));
    assert_eq!(rec.len(), 2_000_017);
    pax.extend_from_slice(rec.as_bytes());
    t.raw(b"pax", EntryType::XHeader, b"", 0o644, 0, &pax);
    t.file("after", b"x");
    let (e1, e2) = refuse_both(&t.done(), &limits());
    for e in [e1, e2] {
        assert!(matches!(e, ImageError::TooBig { .. }), "{e}");
    }
}

#[test]
fn compressed_bombs_stop_at_the_limit() {
    // 64 MiB of zeros compresses to a few KiB; the limit stops it early.
    let data = vec![0u8; 64 << 20];
    let tar = RawTar::new().file("zeros", &data).done();
    let z = zstd::encode_all(&tar[..], 19).unwrap();
    assert!(z.len() < 1 << 20);
    let lim = UnpackLimits {
        max_bytes: 1 << 20,
        max_entries: 10,
    };
    let (e1, e2) = refuse_both(&z, &lim);
    for e in [e1, e2] {
        assert!(matches!(e, ImageError::TooBig { .. }), "{e}");
    }
}

#[test]
fn bad_whiteout_names_and_garbage_are_refused() {
    for name in [".wh..", ".wh...", "d/.wh."] {
        let archive = RawTar::new().dir("d").file(name, b"").done();
        let (e1, e2) = refuse_both(&archive, &limits());
        for e in [e1, e2] {
            assert!(matches!(e, ImageError::UnsafePath { .. }), "{name}: {e}");
        }
    }
    let (e1, e2) = refuse_both(&pattern(5000, 9), &limits());
    for e in [e1, e2] {
        assert!(matches!(e, ImageError::BadArchive(_)), "{e}");
    }
}
