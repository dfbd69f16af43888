//! OCI image layouts and docker-save tarballs built here, imported, and checked file by file.

use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde_json::json;
use sha2::{Digest, Sha256};
use tar::{EntryType, Header};

use super::*;
use crate::{
    ImageConfig, ImageError, ImportProgress, UnpackLimits, import_image, import_image_with,
};

fn sha(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

fn hdr(kind: EntryType, mode: u32) -> Header {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_mtime(1_700_000_000);
    h.set_uid(0);
    h.set_gid(0);
    h
}

/// A layer tar written with the tar crate's own (checked) API.
struct Layer(tar::Builder<Vec<u8>>);

impl Layer {
    fn new() -> Layer {
        Layer(tar::Builder::new(Vec::new()))
    }
    fn dir(mut self, p: &str) -> Self {
        let mut h = hdr(EntryType::Directory, 0o755);
        h.set_size(0);
        self.0.append_data(&mut h, p, std::io::empty()).unwrap();
        self
    }
    fn file(mut self, p: &str, data: &[u8], mode: u32) -> Self {
        let mut h = hdr(EntryType::Regular, mode);
        h.set_size(data.len() as u64);
        self.0.append_data(&mut h, p, data).unwrap();
        self
    }
    fn link(mut self, kind: EntryType, p: &str, target: &str) -> Self {
        let mut h = hdr(kind, 0o777);
        h.set_size(0);
        self.0.append_link(&mut h, p, target).unwrap();
        self
    }
    fn done(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

/// Base layer: a small distribution-like tree.
fn layer1() -> Vec<u8> {
    Layer::new()
        .dir("./")
        .dir("etc")
        .file("etc/os-release", b"v1", 0o644)
        .file("etc/remove-me", b"bye", 0o644)
        .dir("usr")
        .dir("usr/bin")
        .file("usr/bin/tool", b"#!tool", 0o755)
        .link(EntryType::Link, "usr/bin/tool2", "usr/bin/tool")
        .dir("usr/share")
        .dir("usr/share/doc")
        .file("usr/share/doc/a", b"a", 0o644)
        .file("usr/share/doc/b", b"b", 0o644)
        .dir("usr/share/doc/sub")
        .file("usr/share/doc/sub/c", b"c", 0o644)
        .link(EntryType::Symlink, "bin", "usr/bin")
        .dir("opt")
        .file("opt/keep", b"keep", 0o644)
        .dir("var/lib/gone")
        .file("var/lib/gone/x", b"x", 0o644)
        .done()
}

/// Second layer: a file deleted, a directory deleted, a directory cleared (its new file
/// comes before the opaque marker, and must survive it), a file replaced, a file added.
fn layer2() -> Vec<u8> {
    Layer::new()
        .dir("etc")
        .file("etc/os-release", b"v2", 0o644)
        .file("etc/.wh.remove-me", b"", 0o644)
        .file("etc/added", b"added", 0o600)
        .dir("usr/share/doc")
        .file("usr/share/doc/new", b"new", 0o644)
        .file("usr/share/doc/.wh..wh..opq", b"", 0o644)
        .file("var/lib/.wh.gone", b"", 0o644)
        .done()
}

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

fn config_json(diff_ids: &[&[u8]], arch: &str) -> Vec<u8> {
    let ids: Vec<String> = diff_ids
        .iter()
        .map(|t| format!("sha256:{}", sha(t)))
        .collect();
    serde_json::to_vec(&json!({
        "architecture": arch,
        "os": "linux",
        "config": {
            "User": "1000:1000",
            "Env": ["PATH=/usr/bin:/bin", "FOO=bar"],
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": ["tool --serve"],
            "WorkingDir": "/srv",
            "Labels": {"org.test": "yes"},
        },
        "rootfs": {"type": "layers", "diff_ids": ids},
        "history": [],
    }))
    .unwrap()
}

fn check_config(c: &ImageConfig) {
    assert_eq!(c.env, ["PATH=/usr/bin:/bin", "FOO=bar"]);
    assert_eq!(c.cmd, ["tool --serve"]);
    assert_eq!(c.entrypoint, ["/bin/sh", "-c"]);
    assert_eq!(c.workdir.as_deref(), Some("/srv"));
    assert_eq!(c.user.as_deref(), Some("1000:1000"));
    assert_eq!(c.labels.get("org.test").map(String::as_str), Some("yes"));
    assert_eq!(c.os.as_deref(), Some("linux"));
}

/// The tree both layers make, flattened.
fn check_tree(r: &Path) {
    assert_eq!(fs::read(r.join("etc/os-release")).unwrap(), b"v2");
    assert!(fs::symlink_metadata(r.join("etc/remove-me")).is_err());
    assert_eq!(fs::read(r.join("etc/added")).unwrap(), b"added");
    assert_eq!(mode(&r.join("etc/added")), 0o600);
    for gone in [
        "usr/share/doc/a",
        "usr/share/doc/b",
        "usr/share/doc/sub",
        "var/lib/gone",
    ] {
        assert!(
            fs::symlink_metadata(r.join(gone)).is_err(),
            "{gone} survived"
        );
    }
    assert!(r.join("var/lib").is_dir());
    assert_eq!(fs::read(r.join("usr/share/doc/new")).unwrap(), b"new");
    assert_eq!(mode(&r.join("usr/bin/tool")), 0o755);
    let ino = |p: &str| fs::metadata(r.join(p)).unwrap().ino();
    assert_eq!(ino("usr/bin/tool"), ino("usr/bin/tool2"));
    assert_eq!(
        fs::read_link(r.join("bin")).unwrap(),
        PathBuf::from("usr/bin")
    );
    assert_eq!(fs::read(r.join("opt/keep")).unwrap(), b"keep");
    // No whiteout marker or whiteout device made it into the rootfs.
    let mut stack = vec![r.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            assert!(!name.starts_with(".wh."), "{name} left in {}", d.display());
            assert!(!is_whiteout(&e.path()));
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
        }
    }
}

/// Writes a blob into an OCI layout and returns its descriptor.
fn blob(layout: &Path, media_type: &str, data: &[u8]) -> serde_json::Value {
    let dir = layout.join("blobs/sha256");
    fs::create_dir_all(&dir).unwrap();
    let h = sha(data);
    fs::write(dir.join(&h), data).unwrap();
    json!({"mediaType": media_type, "digest": format!("sha256:{h}"), "size": data.len()})
}

const LAYER_GZ: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const LAYER_ZST: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX: &str = "application/vnd.oci.image.index.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";

/// An image manifest over the given (media type, stored blob, uncompressed tar) layers.
fn manifest(layout: &Path, layers: &[(&str, Vec<u8>, Vec<u8>)], arch: &str) -> serde_json::Value {
    let tars: Vec<&[u8]> = layers.iter().map(|l| l.2.as_slice()).collect();
    let cfg = blob(layout, CONFIG, &config_json(&tars, arch));
    let descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|(mt, b, _)| blob(layout, mt, b))
        .collect();
    let m = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": cfg,
        "layers": descs,
    }))
    .unwrap();
    let mut d = blob(layout, MANIFEST, &m);
    d["platform"] = json!({"architecture": arch, "os": "linux"});
    d
}

fn write_index(layout: &Path, manifests: Vec<serde_json::Value>) {
    fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let index = json!({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests});
    fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
}

fn two_layer_layout(layout: &Path) -> (u64, u64) {
    let (l1, l2) = (layer1(), layer2());
    let (b1, b2) = (gzip(&l1), zstd::encode_all(&l2[..], 3).unwrap());
    let sizes = (b1.len() as u64, b2.len() as u64);
    let m = manifest(layout, &[(LAYER_GZ, b1, l1), (LAYER_ZST, b2, l2)], "amd64");
    write_index(layout, vec![m]);
    sizes
}

#[test]
fn oci_layout_import_applies_layers_in_order() {
    let t = tempfile::tempdir().unwrap();
    let layout = t.path().join("layout");
    let (s1, s2) = two_layer_layout(&layout);
    let rootfs = t.path().join("rootfs");
    let mut seen = Vec::new();
    let cfg = import_image(&layout, &rootfs, &mut |p| seen.push(p)).unwrap();
    check_config(&cfg);
    check_tree(&rootfs);
    assert_eq!(
        seen,
        [
            ImportProgress {
                index: 1,
                total: 2,
                bytes: s1
            },
            ImportProgress {
                index: 2,
                total: 2,
                bytes: s2
            },
        ]
    );

    // The same layout packed as a tarball (an "oci-archive"), gzip-compressed.
    let mut outer = tar::Builder::new(Vec::new());
    outer.append_dir_all(".", &layout).unwrap();
    let packed = gzip(&outer.into_inner().unwrap());
    let archive = t.path().join("image.tar.gz");
    fs::write(&archive, packed).unwrap();
    let rootfs2 = t.path().join("rootfs2");
    let cfg2 = import_image(&archive, &rootfs2, &mut |_| {}).unwrap();
    assert_eq!(cfg2, cfg);
    check_tree(&rootfs2);

    // The rootfs must be empty.
    let err = import_image(&layout, &rootfs, &mut |_| {}).unwrap_err();
    assert!(matches!(err, ImageError::NotEmpty { .. }), "{err}");
    check_tree(&rootfs);
}

#[test]
fn oci_index_picks_the_host_platform() {
    let t = tempfile::tempdir().unwrap();
    let layout = t.path().join("layout");
    let other = Layer::new().file("arch", b"arm64", 0o644).done();
    let ours = Layer::new().file("arch", b"amd64", 0o644).done();
    let arm = manifest(&layout, &[(LAYER_TAR, other.clone(), other)], "arm64");
    let amd = manifest(&layout, &[(LAYER_TAR, ours.clone(), ours)], "amd64");
    let mut att = amd.clone();
    att["platform"] = json!({"architecture": "unknown", "os": "unknown"});
    att["annotations"] = json!({"vnd.docker.reference.type": "attestation-manifest"});
    let nested = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": INDEX, "manifests": [arm, att, amd],
    }))
    .unwrap();
    let nested = blob(&layout, INDEX, &nested);
    write_index(&layout, vec![nested]);
    let rootfs = t.path().join("rootfs");
    let cfg = import_image(&layout, &rootfs, &mut |_| {}).unwrap();
    if std::env::consts::ARCH == "x86_64" {
        assert_eq!(fs::read(rootfs.join("arch")).unwrap(), b"amd64");
        assert_eq!(cfg.architecture.as_deref(), Some("amd64"));
    }
}

/// A `docker save` tarball: manifest.json, `<hex>.json` config, `<id>/layer.tar` layers, and
/// (as older docker writes for a repeated layer) a layer that is a symlink to another.
fn docker_save(with_repeat: bool) -> Vec<u8> {
    let (l1, l2) = (layer1(), layer2());
    let mut tars: Vec<&[u8]> = vec![&l1, &l2];
    let mut names = vec!["aaa/layer.tar".to_string(), "bbb/layer.tar".to_string()];
    if with_repeat {
        tars.push(&l2);
        names.push("ccc/layer.tar".to_string());
    }
    let cfg = config_json(&tars, "amd64");
    let cfg_name = format!("{}.json", sha(&cfg));
    let manifest = serde_json::to_vec(&json!([{
        "Config": cfg_name, "RepoTags": ["test:latest"], "Layers": names,
    }]))
    .unwrap();
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |p: &str, data: &[u8]| {
        let mut h = hdr(EntryType::Regular, 0o644);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, p, data).unwrap();
    };
    add("aaa/layer.tar", &l1);
    add("bbb/layer.tar", &l2);
    add(&cfg_name, &cfg);
    add("manifest.json", &manifest);
    add("repositories", br#"{"test":{"latest":"bbb"}}"#);
    if with_repeat {
        let mut h = hdr(EntryType::Symlink, 0o777);
        h.set_size(0);
        b.append_link(&mut h, "ccc/layer.tar", "../bbb/layer.tar")
            .unwrap();
    }
    b.into_inner().unwrap()
}

#[test]
fn docker_save_tarball_import() {
    let t = tempfile::tempdir().unwrap();
    let plain = t.path().join("save.tar");
    fs::write(&plain, docker_save(true)).unwrap();
    let rootfs = t.path().join("rootfs");
    let mut seen = Vec::new();
    let cfg = import_image(&plain, &rootfs, &mut |p| seen.push((p.index, p.total))).unwrap();
    check_config(&cfg);
    check_tree(&rootfs);
    assert_eq!(seen, [(1, 3), (2, 3), (3, 3)]);

    // `docker save | gzip`, and the same tarball unpacked into a directory.
    let gz = t.path().join("save.tar.gz");
    fs::write(&gz, gzip(&docker_save(false))).unwrap();
    let rootfs2 = t.path().join("rootfs2");
    assert_eq!(import_image(&gz, &rootfs2, &mut |_| {}).unwrap(), cfg);
    check_tree(&rootfs2);
    let dir = t.path().join("save-dir");
    tar::Archive::new(&docker_save(true)[..])
        .unpack(&dir)
        .unwrap();
    let rootfs3 = t.path().join("rootfs3");
    assert_eq!(import_image(&dir, &rootfs3, &mut |_| {}).unwrap(), cfg);
    check_tree(&rootfs3);
}

/// Imports into `base/rootfs` (absent before) and expects a refusal that leaves no rootfs
/// and nothing else beside the canary.
fn refused(src: &Path, a: &Arena) -> ImageError {
    let rootfs = a.base().join("rootfs");
    let err = import_image(src, &rootfs, &mut |_| {}).unwrap_err();
    assert!(!rootfs.exists(), "a failed import left its rootfs: {err}");
    a.assert_untouched();
    err
}

#[test]
fn oci_layer_with_traversal_is_refused() {
    let a = Arena::new();
    let layout = a.target().join("layout");
    // A tar with `../canary` written raw (the tar crate's setters refuse it).
    let mut evil = tar::Builder::new(Vec::new());
    let mut h = hdr(EntryType::Regular, 0o644);
    h.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../canary");
    h.set_size(5);
    h.set_cksum();
    evil.append(&h, &b"owned"[..]).unwrap();
    let evil = evil.into_inner().unwrap();
    let l1 = layer1();
    let m = manifest(
        &layout,
        &[(LAYER_TAR, l1.clone(), l1), (LAYER_GZ, gzip(&evil), evil)],
        "amd64",
    );
    write_index(&layout, vec![m]);
    let err = refused(&layout, &a);
    assert!(matches!(err, ImageError::UnsafePath { .. }), "{err}");
    assert!(err.is_input_error());
}

#[test]
fn tampered_blobs_and_names_are_refused() {
    let a = Arena::new();
    // A layer whose bytes no longer match its digest (same size, one byte changed).
    let layout = a.target().join("layout");
    let l1 = layer1();
    let m = manifest(&layout, &[(LAYER_TAR, l1.clone(), l1.clone())], "amd64");
    write_index(&layout, vec![m]);
    let path = layout.join("blobs/sha256").join(sha(&l1));
    let mut bytes = fs::read(&path).unwrap();
    let at = bytes.windows(2).position(|w| w == b"v1").unwrap();
    bytes[at + 1] = b'9';
    fs::write(&path, &bytes).unwrap();
    let err = refused(&layout, &a);
    assert!(matches!(err, ImageError::DigestMismatch { .. }), "{err}");

    // A docker save layer changed in place: only its diff_id can tell.
    let save = a.target().join("save-tampered");
    tar::Archive::new(&docker_save(false)[..])
        .unpack(&save)
        .unwrap();
    let layer = save.join("bbb/layer.tar");
    let mut bytes = fs::read(&layer).unwrap();
    // The last "added" is the file content (the first is in the header name).
    let at = bytes.windows(5).rposition(|w| w == b"added").unwrap();
    bytes[at] = b'A';
    fs::write(&layer, &bytes).unwrap();
    let err = refused(&save, &a);
    assert!(
        matches!(err, ImageError::DigestMismatch { ref what, .. } if what.contains("bbb/layer.tar")),
        "{err}"
    );

    // A blob that is a symlink out of the layout.
    fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(a.base().join("canary"), &path).unwrap();
    let err = refused(&layout, &a);
    assert!(matches!(err, ImageError::BadImage(_)), "{err}");

    // A docker manifest naming files outside the tarball, or a digest that is a path.
    for layers in [json!(["../../canary"]), json!(["/etc/passwd"])] {
        let dir = a.target().join("save");
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let cfg = config_json(&[b"x"], "amd64");
        fs::write(dir.join("c.json"), &cfg).unwrap();
        let m = json!([{"Config": "c.json", "Layers": layers}]);
        fs::write(dir.join("manifest.json"), serde_json::to_vec(&m).unwrap()).unwrap();
        let err = refused(&dir, &a);
        assert!(matches!(err, ImageError::UnsafePath { .. }), "{err}");
    }
    let bad_digest = a.target().join("bad-digest");
    fs::create_dir_all(&bad_digest).unwrap();
    let m = json!({"digest": "sha256:../../../canary", "mediaType": MANIFEST, "size": 1});
    write_index(&bad_digest, vec![m]);
    let err = refused(&bad_digest, &a);
    assert!(matches!(err, ImageError::BadImage(_)), "{err}");

    // Garbage where an image should be.
    let junk = a.target().join("junk.tar");
    fs::write(&junk, pattern(3000, 4)).unwrap();
    let err = refused(&junk, &a);
    assert!(err.is_input_error(), "{err}");
}

#[test]
fn import_limits_span_all_layers() {
    let t = tempfile::tempdir().unwrap();
    let layout = t.path().join("layout");
    two_layer_layout(&layout);
    let rootfs = t.path().join("rootfs");
    // Each layer alone fits; together they do not.
    let lim = UnpackLimits {
        max_bytes: 1 << 20,
        max_entries: 22,
    };
    let err = import_image_with(&layout, &rootfs, &lim, &mut |_| {}).unwrap_err();
    assert!(
        matches!(err, ImageError::TooManyEntries { limit: 22 }),
        "{err}"
    );
    assert!(!rootfs.exists());
}

#[test]
fn foreign_platforms_and_bloated_tarballs_are_refused() {
    let a = Arena::new();
    if std::env::consts::ARCH == "x86_64" {
        let layout = a.target().join("arm-only");
        let l = Layer::new().file("x", b"x", 0o644).done();
        let m = manifest(&layout, &[(LAYER_TAR, l.clone(), l)], "arm64");
        write_index(&layout, vec![m]);
        let err = refused(&layout, &a);
        assert!(
            matches!(err, ImageError::BadImage(ref m) if m.contains("linux/amd64")),
            "{err}"
        );
    }
    // An image tarball whose first member carries 4 MiB of PAX records: the index stops
    // reading it at the header window instead of buffering it.
    let mut b = tar::Builder::new(Vec::new());
    let rec = format!("{} comment={}\n", (4 << 20) + 17, "c".repeat(4 << 20));
    assert_eq!(rec.len(), (4 << 20) + 17);
    let mut h = hdr(EntryType::XHeader, 0o644);
    h.set_size(rec.len() as u64);
    h.set_cksum();
    b.append(&h, rec.as_bytes()).unwrap();
    let mut h = hdr(EntryType::Regular, 0o644);
    h.set_size(2);
    b.append_data(&mut h, "manifest.json", &b"[]"[..]).unwrap();
    let path = a.target().join("bloated.tar");
    fs::write(&path, b.into_inner().unwrap()).unwrap();
    let err = refused(&path, &a);
    assert!(
        matches!(err, ImageError::BadArchive(ref m) if m.contains("size limit")),
        "{err}"
    );
}
