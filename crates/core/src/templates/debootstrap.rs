//! Root filesystems made by `debootstrap --variant=minbase`. The suite, packages and
//! mirror become arguments of the program (never a shell line), so each is checked to be
//! exactly what it claims to be. debootstrap runs in a mount namespace of its own, so the
//! /proc and /sys it mounts inside the target vanish with it however it ends.

use super::{Build, BuildError};
use crate::error::CoreError;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// Longest a debootstrap run may take.
const MAX_RUN: Duration = Duration::from_secs(3600);
/// Most packages one build may name.
const MAX_PACKAGES: usize = 512;

/// A suite (codename) such as `bookworm`: a lowercase letter, then letters, digits, `.`, `-`.
pub fn check_suite(suite: &str) -> Result<(), CoreError> {
    let ok = (1..=64).contains(&suite.len())
        && suite.as_bytes()[0].is_ascii_lowercase()
        && suite
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(CoreError::invalid(format!(
            "bad suite {suite:?}: a codename such as \"bookworm\" (a-z, 0-9, '.', '-')"
        )))
    }
}

/// Package names as Debian policy defines them: lowercase letters, digits, `+`, `-`, `.`,
/// at least two characters, starting with a letter or digit.
pub fn check_packages(packages: &[String]) -> Result<(), CoreError> {
    if packages.len() > MAX_PACKAGES {
        return Err(CoreError::invalid(format!(
            "at most {MAX_PACKAGES} packages"
        )));
    }
    for p in packages {
        let ok = (2..=128).contains(&p.len())
            && p.as_bytes()[0].is_ascii_alphanumeric()
            && p.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'+' | b'-' | b'.')
            });
        if !ok {
            return Err(CoreError::invalid(format!(
                "bad package name {p:?}: lowercase letters, digits, '+', '-' and '.'"
            )));
        }
    }
    Ok(())
}

/// An http(s) mirror URL without credentials, query or fragment; returns it normalized.
pub fn check_mirror(mirror: &str) -> Result<String, CoreError> {
    let bad = |why: &str| Err(CoreError::invalid(format!("bad mirror {mirror:?}: {why}")));
    if mirror.len() > 2048 || mirror.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return bad("at most 2048 characters, no spaces or control characters");
    }
    let url = match url::Url::parse(mirror) {
        Ok(u) => u,
        Err(e) => return bad(&e.to_string()),
    };
    if !matches!(url.scheme(), "http" | "https") {
        return bad("only http and https mirrors");
    }
    if url.host_str().is_none_or(str::is_empty) {
        return bad("no host");
    }
    if !url.username().is_empty() || url.password().is_some() {
        return bad("credentials do not belong in a mirror URL");
    }
    if url.query().is_some() || url.fragment().is_some() {
        return bad("no query or fragment");
    }
    Ok(url.to_string())
}

/// The command line of a build (program first).
pub fn argv(suite: &str, packages: &[String], mirror: Option<&str>, target: &Path) -> Vec<String> {
    let mut argv: Vec<String> = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "debootstrap",
        "--variant=minbase",
    ]
    .map(String::from)
    .into();
    if !packages.is_empty() {
        argv.push(format!("--include={}", packages.join(",")));
    }
    argv.push(suite.to_string());
    argv.push(target.to_string_lossy().into_owned());
    if let Some(m) = mirror {
        argv.push(m.to_string());
    }
    argv
}

/// Runs debootstrap into `target` (which must not exist yet), streaming its output into
/// the build log; stops it (its whole process group) when the build is cancelled.
pub async fn run(
    build: &Build,
    suite: &str,
    packages: &[String],
    mirror: Option<&str>,
    target: &Path,
) -> Result<(), BuildError> {
    let argv = argv(suite, packages, mirror, target);
    build.push(format!("$ {}", argv[5..].join(" ")));
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        // The daemon's environment (tokens, proxies meant for it) is not debootstrap's.
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("HOME", "/root")
        .env("LC_ALL", "C")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            BuildError::Failed(
                "debootstrap (or unshare) is not installed on the daemon's host (apt-get install debootstrap)".into(),
            )
        } else {
            BuildError::io("start", Path::new("debootstrap"), e)
        }
    })?;
    let pgid = child.id().map(|p| nix::unistd::Pid::from_raw(p as i32));
    let out = child.stdout.take().map(|o| forward(o, build));
    let err = child.stderr.take().map(|e| forward(e, build));
    let lines = async {
        if let Some(o) = out {
            o.await;
        }
    };
    let errs = async {
        if let Some(e) = err {
            e.await;
        }
    };
    let kill = || {
        if let Some(pg) = pgid {
            let _ = nix::sys::signal::killpg(pg, nix::sys::signal::Signal::SIGKILL);
        }
    };
    let (status, (), ()) = tokio::join!(
        async {
            let s = tokio::select! {
                status = child.wait() => Some(status),
                _ = build.cancel.cancelled() => None,
                _ = tokio::time::sleep(MAX_RUN) => Some(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("debootstrap ran longer than {} s", MAX_RUN.as_secs()),
                ))),
            };
            // Also after a normal exit: anything debootstrap left running in its group
            // would hold the output pipes open.
            kill();
            if !matches!(s, Some(Ok(_))) {
                let _ = child.wait().await;
            }
            s
        },
        lines,
        errs
    );
    match status {
        None => Err(BuildError::Cancelled),
        Some(Err(e)) => Err(BuildError::io("run", Path::new("debootstrap"), e)),
        Some(Ok(s)) if s.success() => Ok(()),
        Some(Ok(s)) => {
            let why = build
                .last_line(|l| l.starts_with("E:"))
                .or_else(|| build.last_line(|l| l.starts_with("W:")))
                .map(|l| format!(": {l}"))
                .unwrap_or_default();
            // The details are in the target, which goes with the failed build: keep the
            // end of them in the build log.
            for line in log_tail(target, LOG_TAIL_LINES) {
                build.push(format!("debootstrap.log: {line}"));
            }
            Err(BuildError::Failed(format!("debootstrap failed ({s}){why}")))
        }
    }
}

/// Lines of debootstrap's own log kept when a build fails.
const LOG_TAIL_LINES: usize = 30;

/// The last `n` lines of `target/debootstrap/debootstrap.log`, read as a bounded regular
/// file and never through a symlink (the packages it unpacked share the directory).
fn log_tail(target: &Path, n: usize) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::unix::fs::OpenOptionsExt;
    let dir = target.join("debootstrap");
    if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
        return Vec::new();
    }
    let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(dir.join("debootstrap.log"))
    else {
        return Vec::new();
    };
    let Ok(meta) = f.metadata() else {
        return Vec::new();
    };
    if !meta.is_file()
        || f.seek(SeekFrom::Start(meta.len().saturating_sub(16 << 10)))
            .is_err()
    {
        return Vec::new();
    }
    let mut bytes = Vec::new();
    if f.take(16 << 10).read_to_end(&mut bytes).is_err() {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| l.to_string())
        .collect()
}

/// Copies the lines of one output pipe into the build log.
async fn forward(pipe: impl AsyncRead + Unpin, build: &Build) {
    let mut reader = BufReader::new(pipe);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => build.push(String::from_utf8_lossy(&line).trim_end().to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_checked_strictly() {
        assert!(check_suite("bookworm").is_ok());
        assert!(check_suite("bookworm-backports").is_ok());
        for bad in [
            "",
            "-v",
            "Bookworm",
            "book worm",
            "a/b",
            "../x",
            "x;rm",
            "1x",
        ] {
            assert!(check_suite(bad).is_err(), "{bad:?}");
        }
        assert!(check_packages(&["curl".into(), "g++".into(), "python3.11".into()]).is_ok());
        for bad in ["", "a", "-x", "--foo=bar", "Curl", "a,b", "a b", "x\n"] {
            assert!(check_packages(&[bad.to_string()]).is_err(), "{bad:?}");
        }
        assert!(check_packages(&vec!["ab".to_string(); MAX_PACKAGES + 1]).is_err());
        assert_eq!(
            check_mirror("http://deb.debian.org/debian").unwrap(),
            "http://deb.debian.org/debian"
        );
        for bad in [
            "ftp://x/debian",
            "file:///etc",
            "http://user:pw@x/debian",
            "http://x/debian?a=b",
            "-http://x",
            "http://x/de bian",
            "http://x/\n",
            "not a url",
        ] {
            assert!(check_mirror(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_log_tail_is_bounded_and_never_read_through_a_symlink() {
        let t = tempfile::tempdir().unwrap();
        assert!(log_tail(t.path(), 3).is_empty());
        std::fs::create_dir(t.path().join("debootstrap")).unwrap();
        let text: String = (0..100_000).map(|i| format!("line {i}\n")).collect();
        std::fs::write(t.path().join("debootstrap/debootstrap.log"), text).unwrap();
        assert_eq!(log_tail(t.path(), 2), ["line 99998", "line 99999"]);
        let other = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc/passwd", other.path().join("debootstrap")).unwrap();
        assert!(log_tail(other.path(), 3).is_empty());
        std::fs::remove_file(other.path().join("debootstrap")).unwrap();
        std::fs::create_dir(other.path().join("debootstrap")).unwrap();
        std::os::unix::fs::symlink(
            "/etc/passwd",
            other.path().join("debootstrap/debootstrap.log"),
        )
        .unwrap();
        assert!(log_tail(other.path(), 3).is_empty());
    }

    #[test]
    fn the_command_line_has_one_argument_per_value() {
        let argv = argv(
            "bookworm",
            &["curl".into(), "git".into()],
            Some("http://m/debian"),
            Path::new("/d/t-1/rootfs"),
        );
        assert_eq!(
            argv,
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "debootstrap",
                "--variant=minbase",
                "--include=curl,git",
                "bookworm",
                "/d/t-1/rootfs",
                "http://m/debian"
            ]
        );
    }
}
