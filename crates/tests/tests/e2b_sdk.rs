//! E2B's own SDKs, unmodified, against a sandpit daemon: the Python scenarios in
//! `tests/e2b/python` (pytest, e2b and e2b-code-interpreter pinned in
//! `tests/e2b/requirements.txt`) and the JavaScript ones in `tests/e2b/js` (npm `e2b`).
//! `scripts/setup.sh --test` installs both SDKs.

use sandpit_tests::{Daemon, test_tool};
use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `cmd` with the E2B variables pointing at `d`, printing its output, and says
/// whether it succeeded.
async fn run_against(d: &Daemon, mut cmd: Command) -> (bool, String) {
    cmd.current_dir(repo())
        .env("E2B_API_KEY", &d.key)
        .env("E2B_API_URL", &d.url)
        .env("E2B_SANDBOX_URL", &d.url)
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
    let d = Daemon::start().await;
    let mut cmd = Command::new(test_tool("pytest"));
    cmd.args(["-q", "-p", "no:cacheprovider", "tests/e2b/python"]);
    let (ok, text) = run_against(&d, cmd).await;
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
    let (ok, text) = run_against(&d, cmd).await;
    assert!(ok, "the E2B JavaScript SDK scenarios failed:\n{text}");
    assert!(text.contains("# fail 0"), "{text}");
    assert!(!text.contains("# pass 0\n"), "{text}");
    d.shutdown().await;
}
