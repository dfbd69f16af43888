//! Running sandpit as a service: the systemd unit and its install script, and a start
//! that fails (its port in use) without leaving anything on the host.

use sandpit_tests::{Daemon, tmpfs_mounted_on};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `key=value` lines of each section of a unit file (later values are appended).
fn parse_unit(text: &str) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let mut out: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.to_string();
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("not a key=value line: {line}"));
        assert!(!section.is_empty(), "{line} outside a section");
        out.entry(section.clone())
            .or_default()
            .entry(k.trim().to_string())
            .or_default()
            .push(v.trim().to_string());
    }
    out
}

#[test]
fn the_systemd_unit_has_what_a_service_needs() {
    let path = repo().join("scripts/sandpit.service");
    let text = std::fs::read_to_string(&path).unwrap();
    let unit = parse_unit(&text);
    let get = |section: &str, key: &str| -> String {
        unit.get(section)
            .and_then(|s| s.get(key))
            .and_then(|v| v.last())
            .cloned()
            .unwrap_or_else(|| panic!("[{section}] {key} missing"))
    };
    assert!(get("Service", "ExecStart").starts_with("/usr/local/bin/sandpit serve"));
    assert_eq!(get("Service", "Restart"), "on-failure");
    // Stopping the daemon must leave its sandboxes for the next start to re-adopt.
    assert_eq!(get("Service", "KillMode"), "process");
    assert_eq!(get("Service", "Delegate"), "yes");
    assert_eq!(get("Service", "TasksMax"), "infinity");
    let nofile: u64 = get("Service", "LimitNOFILE").parse().unwrap();
    assert!(nofile >= 65536, "LimitNOFILE {nofile}");
    assert_eq!(get("Service", "StandardError"), "journal");
    assert_eq!(get("Install", "WantedBy"), "multi-user.target");

    // systemd's own check, where it is installed. It insists that ExecStart exists, so the
    // copy it checks names the binary built beside this test.
    let Ok(out) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("systemd-analyze is not installed: checked the keys only");
        return;
    };
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("sandpit.service");
    let bin = sandpit_tests::sandpit_bin();
    std::fs::write(
        &copy,
        text.replace("/usr/local/bin/sandpit", bin.to_str().unwrap()),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // verify exits 0 on unknown keys and unparsable values; it names the file in them.
    assert!(!stderr.contains("sandpit.service"), "{stderr}");
}

#[test]
fn the_install_script_is_valid_shell_and_installs_the_unit() {
    let script = repo().join("scripts/install-service.sh");
    let out = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&script).unwrap();
    for needed in [
        "scripts/sandpit.service",
        "/etc/systemd/system/sandpit.service",
        "systemctl daemon-reload",
        "systemctl enable --now sandpit",
        "/proc/1/comm",
        "ln -sf",
    ] {
        assert!(text.contains(needed), "install-service.sh lacks {needed:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_on_a_taken_port_fails_clearly_and_leaves_nothing_mounted() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let (status, stderr, data) = Daemon::builder().port(port).start_failing();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("listen on 127.0.0.1:{port}")) && stderr.contains("in use"),
        "{stderr}"
    );
    let sandboxes = data.path().join("sandboxes");
    assert!(!tmpfs_mounted_on(&sandboxes), "{stderr}");
    drop(taken);
}
