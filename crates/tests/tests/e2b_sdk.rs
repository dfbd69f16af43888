//! E2B's own SDKs, unmodified, against a sandpit daemon: the Python scenarios in
//! `tests/e2b/python` (pytest, e2b and e2b-code-interpreter pinned in
//! `tests/e2b/requirements.txt`) and the JavaScript ones in `tests/e2b/js` (npm `e2b`).
//! `scripts/setup.sh --test` installs both SDKs, and older Python releases
//! (`tests/e2b/versions`) that run the common-path scenarios with the key in its E2B form.

use sandpit_tests::{Daemon, test_tool};
use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `cmd` with the E2B variables pointing at `d` (and `key` as the API key),
/// printing its output, and says whether it succeeded.
async fn run_against(d: &Daemon, key: &str, mut cmd: Command) -> (bool, String) {
    cmd.current_dir(repo())
        .env("E2B_API_KEY", key)
        .env("E2B_API_URL", &d.url)
        .env("E2B_SANDBOX_URL", &d.url)
        // The volume-content client's own host: the daemon, never E2B's cloud.
        .env("E2B_VOLUME_API_URL", &d.url)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_ACCESS_TOKEN");
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("run the SDK scenarios");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread")]
async fn python_sdk_scenarios_pass() {
    // A broker key, for the secrets scenarios (`test_secrets_volumes.py`).
    let b = Daemon::builder();
    let key = b.data_path().join("broker.key");
    std::fs::write(
        &key,
        "7c1c2a9e8b7d6c5f4e3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e",
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let d = b
        .config(&format!(
            "[broker]\nkey_file = {:?}\n",
            key.display().to_string()
        ))
        .start()
        .await;
    let mut cmd = Command::new(test_tool("pytest"));
    cmd.args(["-q", "-p", "no:cacheprovider", "tests/e2b/python"]);
    let (ok, text) = run_against(&d, &d.key, cmd).await;
    assert!(ok, "the E2B Python SDK scenarios failed:\n{text}");
    // Every scenario ran: none was skipped or deselected.
    assert!(text.contains(" passed"), "{text}");
    assert!(!text.contains("skipped"), "{text}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn javascript_sdk_scenarios_pass() {
    let d = Daemon::start().await;
    let mut cmd = Command::new("node");
    cmd.args([
        "--test",
        "tests/e2b/js/sdk.test.cjs",
        "tests/e2b/js/template_build.test.cjs",
    ])
    .env("NODE_PATH", repo().join("target/test-node/node_modules"));
    let (ok, text) = run_against(&d, &d.key, cmd).await;
    assert!(ok, "the E2B JavaScript SDK scenarios failed:\n{text}");
    assert!(text.contains("# fail 0"), "{text}");
    assert!(!text.contains("# pass 0\n"), "{text}");
    d.shutdown().await;
}

/// Runs the common-path scenarios (`test_sdk.py`) with the older E2B Python SDK release
/// `version`, installed by `scripts/setup.sh --test` into `target/e2b-venv-<version>`.
/// The key is given in its E2B form (`e2b_` + 40 hex digits): releases before about 2.5x
/// refuse any other shape client-side, so this also proves that form authenticates.
async fn older_python_sdk_passes(version: &str) {
    let venv = repo().join(format!("target/e2b-venv-{version}"));
    let pytest = venv.join("bin/pytest");
    assert!(
        pytest.exists(),
        "{} is missing: run scripts/setup.sh --test",
        pytest.display()
    );
    // The venv holds exactly the pinned release, so a stale install cannot pass as it.
    let probe = Command::new(venv.join("bin/python"))
        .args([
            "-c",
            "import importlib.metadata as m; print(m.version('e2b'))",
        ])
        .output()
        .expect("ask the venv for its e2b version");
    assert_eq!(String::from_utf8_lossy(&probe.stdout).trim(), version);

    let d = Daemon::start().await;
    let e2b_key = sandpit_store::e2b_key_form(&d.key).expect("the daemon's key has an E2B form");
    assert!(e2b_key.starts_with("e2b_"), "{e2b_key}");
    let mut cmd = Command::new(pytest);
    cmd.args([
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/e2b/python/test_sdk.py",
    ]);
    let (ok, text) = run_against(&d, &e2b_key, cmd).await;
    assert!(ok, "e2b {version} failed the scenarios:\n{text}");
    assert!(text.contains(" passed"), "{text}");
    assert!(!text.contains("skipped"), "{text}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn python_sdk_2_45_scenarios_pass() {
    older_python_sdk_passes("2.45.1").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn python_sdk_2_55_scenarios_pass() {
    older_python_sdk_passes("2.55.1").await;
}
