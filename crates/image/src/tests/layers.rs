//! Manifests, full and incremental archives, copies and merges on real directories.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use super::*;
use crate::{
    Entry, EntryKind, ImageError, Layer, Manifest, Stack, UnpackLimits, copy_layer, merge_layer,
    unpack_layer, write_layer,
};

const SKIP: &[&str] = &["proc", "sys", "dev", ".sandpit"];
/// Host id bases of two sandboxes, multiples of the range so `id % 65536` is the inner id.
const B: u32 = 65536 * 20;
const B2: u32 = 65536 * 30;

fn stack(layers: &[(&Path, u32)]) -> Stack {
    Stack(
        layers
            .iter()
            .map(|(d, b)| Layer {
                dir: d.to_path_buf(),
                id_base: *b,
            })
            .collect(),
    )
}

/// A live upper as a sandbox leaves it: every kind of entry, owners in the sandbox's range,
/// plus what must be skipped (a host-owned mount point, a skipped top dir, a fifo).
fn build_upper(u: &Path, b: u32) {
    dir(u, "", 0o755, b, b);
    dir(u, "etc", 0o755, b, b);
    file(u, "etc/conf", b"hello\n", 0o644, b, b);
    fs::hard_link(u.join("etc/conf"), u.join("etc/conf-link")).unwrap();
    file(u, "etc/empty", b"", 0o600, b, b);
    dir(u, "home", 0o755, b, b);
    dir(u, "home/user", 0o750, b + 1000, b + 1000);
    file(
        u,
        "home/user/notes.txt",
        &pattern(300_000, 1),
        0o640,
        b + 1000,
        b + 1000,
    );
    symlink(u, "home/user/link", "../../etc/conf", b + 1000);
    symlink(u, "abs", "/etc/passwd", b);
    dir(u, "usr", 0o755, b, b);
    whiteout(u, "usr/gone");
    dir(u, "var/cache", 0o755, b, b);
    dir(u, "var", 0o755, b, b);
    make_opaque(u, "var/cache");
    file(u, "var/cache/new", b"new", 0o644, b, b);
    dir(u, "bin", 0o755, b, b);
    file(u, "bin/su", b"su", 0o4755, b, b);
    file(u, "bin/sg", b"sg", 0o2755, b, b + 5);
    dir(u, "tmp", 0o1777, b, b);
    // Owned by another range's ids: not this sandbox's, never captured.
    dir(u, "mnt", 0o755, 4242, 4242);
    file(u, "mnt/hostfile", b"host", 0o644, 4242, 4242);
    // A template file overlayfs copied up for the sandbox: the host's root's, shown
    // inside (and captured) as the overflow id.
    file(u, "etc/renamed", b"from the template", 0o644, 0, 0);
    dir(u, "proc", 0o555, b, b);
    file(u, "proc/x", b"x", 0o644, b, b);
    dir(u, "run", 0o755, b, b);
    rustix::fs::mknodat(
        rustix::fs::CWD,
        u.join("run/fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
}

fn sha(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

fn e(kind: EntryKind, mode: u32, uid: u32, gid: u32) -> Entry {
    Entry {
        kind,
        mode,
        uid,
        gid,
    }
}

fn file_entry(data: &[u8], mode: u32, uid: u32) -> Entry {
    e(
        EntryKind::File {
            size: data.len() as u64,
            sha256: sha(data),
        },
        mode,
        uid,
        uid,
    )
}

#[test]
fn manifest_reads_every_kind_with_inner_ids_and_skips_foreign_and_special() {
    let t = tempfile::tempdir().unwrap();
    let u = t.path().join("upper");
    build_upper(&u, B);
    let (m, stats) = stack(&[(&u, B)]).manifest_with_stats(SKIP).unwrap();
    let g = |k: &str| m.entries.get(k).cloned();
    assert_eq!(g("etc/conf"), Some(file_entry(b"hello\n", 0o644, 0)));
    assert_eq!(g("etc/conf-link"), Some(file_entry(b"hello\n", 0o644, 0)));
    assert_eq!(g("etc/empty"), Some(file_entry(b"", 0o600, 0)));
    assert_eq!(
        g("home/user/notes.txt"),
        Some(file_entry(&pattern(300_000, 1), 0o640, 1000))
    );
    assert_eq!(
        g("home/user"),
        Some(e(EntryKind::Dir { opaque: false }, 0o750, 1000, 1000))
    );
    assert_eq!(
        g("home/user/link"),
        Some(e(
            EntryKind::Symlink {
                target: "../../etc/conf".into()
            },
            0o777,
            1000,
            1000
        ))
    );
    assert_eq!(g("usr/gone"), Some(e(EntryKind::Whiteout, 0, 0, 0)));
    assert_eq!(
        g("var/cache"),
        Some(e(EntryKind::Dir { opaque: true }, 0o755, 0, 0))
    );
    assert_eq!(g("bin/su"), Some(file_entry(b"su", 0o4755, 0)));
    assert_eq!(g("bin/sg").map(|e| (e.mode, e.gid)), Some((0o2755, 5)));
    assert_eq!(g("tmp").map(|e| e.mode), Some(0o1777));
    assert_eq!(
        g("etc/renamed").map(|e| (e.uid, e.gid)),
        Some((65534, 65534)),
        "a copied-up template file is kept, as the overflow id"
    );
    for absent in ["mnt", "mnt/hostfile", "proc", "proc/x", "run/fifo"] {
        assert_eq!(g(absent), None, "{absent} must not be captured");
    }
    assert_eq!(stats.skipped_foreign, 1);
    assert_eq!(stats.skipped_special, 1);
    // JSON round trip.
    let json = serde_json::to_string(&m).unwrap();
    let back: Manifest = serde_json::from_str(&json).unwrap();
    assert_eq!(back, m);
}

#[test]
fn full_layer_round_trip_is_identical() {
    let t = tempfile::tempdir().unwrap();
    let u = t.path().join("upper");
    build_upper(&u, B);
    let src = stack(&[(&u, B)]);
    let m = src.manifest(SKIP).unwrap();
    let mut archive = Vec::new();
    let ls = write_layer(&src, &m, None, &mut archive).unwrap();
    assert_eq!(ls.bytes, archive.len() as u64);
    assert_eq!(ls.sha256, sha(&archive));
    assert_eq!(ls.content_bytes, m.file_bytes());
    let names = members(&archive);
    assert_eq!(ls.entries, names.len() as u64);
    for want in [
        "bin/su",
        "usr/.wh.gone",
        "var/cache/.wh..wh..opq",
        "home/user/link",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }
    for never in ["mnt", "proc", "run/fifo", "usr/gone"] {
        assert!(
            !names.iter().any(|n| n == never),
            "{never} must not be archived"
        );
    }

    let l = t.path().join("layer");
    let us = unpack_layer(&archive[..], &l, &UnpackLimits::default()).unwrap();
    assert_eq!(us.whiteouts, 1);
    let back = stack(&[(&l, 0)]);
    let m2 = back.manifest(SKIP).unwrap();
    assert_eq!(m2, m);
    assert_eq!(contents(&m2, &back), contents(&m, &src));

    // On disk: overlay form, inner ids, modes and mtimes as in the upper.
    assert_eq!(owner(&l.join("home/user/notes.txt")), (1000, 1000));
    assert_eq!(owner(&l.join("etc/conf")), (0, 0));
    assert_eq!(owner(&l.join("bin/sg")), (0, 5));
    assert_eq!(mode(&l.join("bin/su")), 0o4755);
    assert_eq!(mode(&l.join("tmp")), 0o1777);
    assert!(is_whiteout(&l.join("usr/gone")));
    assert_eq!(owner(&l.join("usr/gone")), (0, 0));
    assert!(is_opaque(&l.join("var/cache")));
    assert!(!is_opaque(&l.join("var")));
    assert_eq!(
        fs::read_link(l.join("abs")).unwrap(),
        PathBuf::from("/etc/passwd")
    );
    let mt = |p: &Path| fs::symlink_metadata(p).unwrap().mtime();
    assert_eq!(
        mt(&l.join("home/user/notes.txt")),
        mt(&u.join("home/user/notes.txt"))
    );
    assert_eq!(mt(&l.join("home/user")), mt(&u.join("home/user")));
    assert_eq!(mt(&l.join("home/user/link")), mt(&u.join("home/user/link")));

    // Unpacking again into a non-empty directory is refused and leaves it as it was.
    let err = unpack_layer(&archive[..], &l, &UnpackLimits::default()).unwrap_err();
    assert!(matches!(err, ImageError::NotEmpty { .. }), "{err}");
    assert_eq!(back.manifest(SKIP).unwrap(), m);
}

/// A read-only overlayfs mount, unmounted on drop.
struct Overlay(PathBuf);

impl Overlay {
    fn mount(lowers: &[&Path], at: &Path) -> Overlay {
        fs::create_dir_all(at).unwrap();
        let lower: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
        let st = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o"])
            .arg(format!("lowerdir={}", lower.join(":")))
            .arg(at)
            .status()
            .unwrap();
        assert!(st.success(), "mount overlay");
        Overlay(at.to_path_buf())
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// What a merged tree shows: type, inner owner, mode and content of every path.
fn view(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for ent in fs::read_dir(root.join(&rel)).unwrap() {
            let ent = ent.unwrap();
            let r = rel.join(ent.file_name());
            let p = root.join(&r);
            let m = fs::symlink_metadata(&p).unwrap();
            let what = if m.is_dir() {
                stack.push(r.clone());
                "dir".to_string()
            } else if m.file_type().is_symlink() {
                format!("link {}", fs::read_link(&p).unwrap().display())
            } else {
                format!("file {}", sha(&fs::read(&p).unwrap()))
            };
            let desc = format!(
                "{what} {:o} {}:{}",
                m.mode() & 0o7777,
                m.uid() % 65536,
                m.gid() % 65536
            );
            out.insert(r.display().to_string(), desc);
        }
    }
    out
}

#[test]
fn incremental_layers_hold_only_changes_and_stack_back_to_the_same_tree() {
    let t = tempfile::tempdir().unwrap();
    let p = |s: &str| t.path().join(s);
    // The template under every layer.
    let tpl = p("template");
    dir(&tpl, "", 0o755, 0, 0);
    dir(&tpl, "usr", 0o755, 0, 0);
    file(&tpl, "usr/gone", b"tpl", 0o644, 0, 0);
    file(&tpl, "usr/keep", b"keep", 0o644, 0, 0);
    dir(&tpl, "data", 0o755, 0, 0);
    file(&tpl, "data/tmpl", b"tmpl", 0o644, 0, 0);
    dir(&tpl, "etc", 0o755, 0, 0);
    file(&tpl, "etc/conf", b"template", 0o644, 0, 0);

    // First sandbox: changes over the template, captured whole.
    let u1 = p("u1");
    dir(&u1, "", 0o755, B, B);
    dir(&u1, "etc", 0o755, B, B);
    file(&u1, "etc/conf", b"v1", 0o644, B, B);
    file(&u1, "etc/mode", b"mode", 0o644, B, B);
    dir(&u1, "home/user", 0o750, B + 1000, B + 1000);
    dir(&u1, "home", 0o755, B, B);
    file(
        &u1,
        "home/user/notes.txt",
        &pattern(70_000, 2),
        0o640,
        B + 1000,
        B + 1000,
    );
    dir(&u1, "data", 0o755, B, B);
    file(&u1, "data/a", b"a", 0o644, B, B);
    file(&u1, "data/b", b"b", 0o644, B, B);
    dir(&u1, "usr", 0o755, B, B);
    whiteout(&u1, "usr/gone");
    let s1 = stack(&[(&u1, B)]);
    let m1 = s1.manifest(SKIP).unwrap();
    let mut a1 = Vec::new();
    write_layer(&s1, &m1, None, &mut a1).unwrap();
    let l1 = p("l1");
    unpack_layer(&a1[..], &l1, &UnpackLimits::default()).unwrap();

    // Second sandbox, started from that snapshot: its upper holds what overlayfs writes for
    // a content change, a chmod, a delete, an add and a directory replaced whole.
    let u2 = p("u2");
    dir(&u2, "", 0o755, B2, B2);
    dir(&u2, "etc", 0o755, B2, B2);
    file(&u2, "etc/conf", b"v2", 0o644, B2, B2);
    file(&u2, "etc/mode", b"mode", 0o600, B2, B2);
    dir(&u2, "home/user", 0o750, B2 + 1000, B2 + 1000);
    dir(&u2, "home", 0o755, B2, B2);
    whiteout(&u2, "home/user/notes.txt");
    file(
        &u2,
        "home/user/new.txt",
        b"new",
        0o644,
        B2 + 1000,
        B2 + 1000,
    );
    dir(&u2, "data", 0o755, B2, B2);
    make_opaque(&u2, "data");
    file(&u2, "data/a", b"a", 0o644, B2, B2);
    file(&u2, "data/c", b"c", 0o644, B2, B2);
    let s2 = stack(&[(&u2, B2), (&l1, 0)]);
    let m2 = s2.manifest(SKIP).unwrap();

    let d = m2.diff(&m1);
    assert_eq!(d.added, ["data/c", "home/user/new.txt"]);
    assert_eq!(
        d.changed,
        ["data", "etc/conf", "etc/mode", "home/user/notes.txt"]
    );
    assert_eq!(d.removed, ["data/b"]);

    let mut a2 = Vec::new();
    let ls = write_layer(&s2, &m2, Some(&m1), &mut a2).unwrap();
    let names = members(&a2);
    assert_eq!(
        names,
        [
            "data",
            "data/.wh..wh..opq",
            "data/a",
            "data/c",
            "etc",
            "etc/conf",
            "etc/mode",
            "home",
            "home/user",
            "home/user/new.txt",
            "home/user/.wh.notes.txt",
        ]
    );
    assert_eq!(ls.entries, names.len() as u64);
    let l2 = p("l2");
    unpack_layer(&a2[..], &l2, &UnpackLimits::default()).unwrap();
    let restored = stack(&[(&l2, 0), (&l1, 0)]);
    let m2b = restored.manifest(SKIP).unwrap();
    assert_eq!(m2b, m2);
    assert_eq!(contents(&m2b, &restored), contents(&m2, &s2));

    // The kernel agrees: the restored chain over the template shows what the sandbox saw.
    let live = Overlay::mount(&[&u2, &l1, &tpl], &p("mnt-live"));
    let back = Overlay::mount(&[&l2, &l1, &tpl], &p("mnt-back"));
    let (lv, bv) = (view(&live.0), view(&back.0));
    assert_eq!(bv, lv);
    assert_eq!(fs::read(back.0.join("etc/conf")).unwrap(), b"v2");
    assert!(!back.0.join("home/user/notes.txt").exists());
    assert!(!back.0.join("data/b").exists());
    assert!(!back.0.join("data/tmpl").exists());
    assert!(!back.0.join("usr/gone").exists());
    assert_eq!(fs::read(back.0.join("usr/keep")).unwrap(), b"keep");
    drop((live, back));

    // Nothing changed since the parent: the layer is empty.
    let mut a3 = Vec::new();
    let ls3 = write_layer(&restored, &m2b, Some(&m2), &mut a3).unwrap();
    assert_eq!(ls3.entries, 0);
    assert!(members(&a3).is_empty());
}

#[test]
fn write_layer_refuses_a_file_that_changed_since_the_manifest() {
    let t = tempfile::tempdir().unwrap();
    let u = t.path().join("u");
    dir(&u, "", 0o755, B, B);
    file(&u, "f", b"before", 0o644, B, B);
    let s = stack(&[(&u, B)]);
    let m = s.manifest(SKIP).unwrap();
    fs::write(u.join("f"), b"after!").unwrap();
    let err = write_layer(&s, &m, None, Vec::new()).unwrap_err();
    assert!(
        matches!(err, ImageError::Changed { ref path } if path == "f"),
        "{err}"
    );
    fs::write(u.join("f"), b"sho").unwrap();
    let err = write_layer(&s, &m, None, Vec::new()).unwrap_err();
    assert!(matches!(err, ImageError::Changed { .. }), "{err}");
    // A symlink swapped in for the file is not followed.
    fs::remove_file(u.join("f")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", u.join("f")).unwrap();
    let err = write_layer(&s, &m, None, Vec::new()).unwrap_err();
    assert!(matches!(err, ImageError::Changed { .. }), "{err}");
}

#[test]
fn names_a_layer_cannot_carry_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let u = t.path().join("u");
    dir(&u, "", 0o755, B, B);
    file(&u, ".wh.sneaky", b"x", 0o644, B, B);
    let err = stack(&[(&u, B)]).manifest(SKIP).unwrap_err();
    assert!(matches!(err, ImageError::Unrepresentable { .. }), "{err}");
    fs::remove_file(u.join(".wh.sneaky")).unwrap();
    let bad = std::ffi::OsStr::from_bytes(b"caf\xe9");
    fs::write(u.join(bad), b"x").unwrap();
    let err = stack(&[(&u, B)]).manifest(SKIP).unwrap_err();
    assert!(matches!(err, ImageError::NotUtf8 { .. }), "{err}");
}

use std::os::unix::ffi::OsStrExt;

#[test]
fn copy_layer_shifts_ids_and_keeps_overlay_form() {
    let t = tempfile::tempdir().unwrap();
    let u = t.path().join("upper");
    build_upper(&u, B);
    let dest = t.path().join("copy");
    let st = copy_layer(
        &Layer {
            dir: u.clone(),
            id_base: B,
        },
        &dest,
        SKIP,
    )
    .unwrap();
    assert_eq!(st.skipped_foreign, 1);
    assert_eq!(st.skipped_special, 1);
    assert_eq!(st.whiteouts, 1);
    assert_eq!(
        st.bytes,
        (b"hello\n".len() + 300_000 + b"new".len() + 4 + b"from the template".len()) as u64
    );
    assert_eq!(owner(&dest), (0, 0));
    assert_eq!(owner(&dest.join("etc/renamed")), (65534, 65534));
    assert_eq!(owner(&dest.join("home/user/notes.txt")), (1000, 1000));
    assert_eq!(owner(&dest.join("home/user/link")), (1000, 1000));
    assert_eq!(owner(&dest.join("bin/sg")), (0, 5));
    assert_eq!(mode(&dest.join("bin/su")), 0o4755);
    assert!(is_whiteout(&dest.join("usr/gone")));
    assert!(is_opaque(&dest.join("var/cache")));
    for absent in ["mnt", "proc", "run/fifo"] {
        assert!(
            fs::symlink_metadata(dest.join(absent)).is_err(),
            "{absent} copied"
        );
    }
    let ino = |p: &str| fs::metadata(dest.join(p)).unwrap().ino();
    assert_eq!(ino("etc/conf"), ino("etc/conf-link"));
    let src = stack(&[(&u, B)]);
    let copied = stack(&[(&dest, 0)]);
    let m = src.manifest(SKIP).unwrap();
    assert_eq!(copied.manifest(SKIP).unwrap(), m);
    assert_eq!(contents(&m, &copied), contents(&m, &src));

    let err = copy_layer(
        &Layer {
            dir: u.clone(),
            id_base: B,
        },
        &dest,
        SKIP,
    )
    .unwrap_err();
    assert!(matches!(err, ImageError::NotEmpty { .. }), "{err}");
}

#[test]
fn merge_layer_folds_an_upper_into_a_layer_like_overlayfs() {
    let t = tempfile::tempdir().unwrap();
    let p = |s: &str| t.path().join(s);
    let dest = p("dest");
    dir(&dest, "", 0o755, 0, 0);
    dir(&dest, "a", 0o755, 0, 0);
    file(&dest, "a/x", b"x", 0o644, 0, 0);
    file(&dest, "a/stay", b"stay", 0o644, 0, 0);
    dir(&dest, "b", 0o755, 0, 0);
    file(&dest, "b/y", b"y", 0o644, 0, 0);
    file(&dest, "c", b"c was a file", 0o644, 0, 0);
    whiteout(&dest, "d");
    dir(&dest, "e", 0o700, 1000, 1000);
    file(&dest, "e/old", b"old", 0o644, 1000, 1000);
    dir(&dest, "f", 0o755, 0, 0);
    make_opaque(&dest, "f");
    file(&dest, "f/kept", b"kept", 0o644, 0, 0);
    dir(&dest, "g/deep", 0o755, 0, 0);
    file(&dest, "g/deep/file", b"deep", 0o644, 0, 0);

    let top = p("top");
    dir(&top, "", 0o755, B, B);
    dir(&top, "a", 0o755, B, B);
    whiteout(&top, "a/x");
    dir(&top, "b", 0o755, B, B);
    make_opaque(&top, "b");
    file(&top, "b/z", b"z", 0o644, B, B);
    dir(&top, "c", 0o755, B, B);
    file(&top, "c/k", b"k", 0o644, B, B);
    file(&top, "d", b"d is back", 0o600, B + 7, B + 7);
    dir(&top, "e", 0o755, B + 1000, B + 1000);
    file(&top, "e/new", b"new", 0o644, B + 1000, B + 1000);
    dir(&top, "f", 0o755, B, B);
    file(&top, "f/added", b"added", 0o644, B, B);
    whiteout(&top, "g");
    dir(&top, "mnt", 0o755, 4242, 4242);

    // What the two layers show stacked is what the merged layer must show alone.
    let before = stack(&[(&top, B), (&dest, 0)]);
    let want = before.manifest(SKIP).unwrap();
    let want_files = contents(&want, &before);
    let st = merge_layer(
        &Layer {
            dir: top.clone(),
            id_base: B,
        },
        &dest,
        SKIP,
    )
    .unwrap();
    assert_eq!(st.whiteouts, 2);
    assert_eq!(st.skipped_foreign, 1);
    let after = stack(&[(&dest, 0)]);
    let got = after.manifest(SKIP).unwrap();
    assert_eq!(got, want);
    assert_eq!(contents(&got, &after), want_files);

    assert!(is_whiteout(&dest.join("a/x")));
    assert_eq!(fs::read(dest.join("a/stay")).unwrap(), b"stay");
    assert!(is_opaque(&dest.join("b")));
    assert!(!dest.join("b/y").exists());
    assert_eq!(fs::read(dest.join("b/z")).unwrap(), b"z");
    // A directory over a file hides the template's directory: it becomes opaque.
    assert!(is_opaque(&dest.join("c")));
    assert_eq!(fs::read(dest.join("d")).unwrap(), b"d is back");
    assert_eq!(owner(&dest.join("d")), (7, 7));
    assert!(!is_opaque(&dest.join("e")));
    assert_eq!(
        (owner(&dest.join("e")), mode(&dest.join("e"))),
        ((1000, 1000), 0o755)
    );
    assert_eq!(fs::read(dest.join("e/old")).unwrap(), b"old");
    assert_eq!(fs::read(dest.join("e/new")).unwrap(), b"new");
    // The lower layer's opaque mark stays: the template's f is still hidden.
    assert!(is_opaque(&dest.join("f")));
    assert!(dest.join("f/kept").exists() && dest.join("f/added").exists());
    assert!(is_whiteout(&dest.join("g")));
    assert!(!dest.join("mnt").exists());
}
