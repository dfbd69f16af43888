//! The OpenAPI document states what the API enforces: schemathesis (pinned in
//! `tests/openapi/requirements.txt`) generates requests from the document, valid and
//! invalid, and checks each answer against it: schema-valid requests accepted,
//! schema-violating ones refused, no 5xx, every status and body documented. Its settings
//! (`tests/openapi/schemathesis.toml`) name the few operations whose acceptance depends
//! on state a schema cannot state, and why.

use sandpit_tests::agents::{broker_key_file, harness_dir};
use sandpit_tests::daemon::Daemon;
use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_accepts_what_its_document_allows_and_refuses_the_rest() {
    let st = repo().join("target/openapi-venv/bin/st");
    assert!(
        st.exists(),
        "schemathesis is missing: run scripts/setup.sh --test"
    );
    let keys = broker_key_file();
    let key_file = keys.path().join("broker.key").display().to_string();
    // A pool of one at most: the fuzzer creates pools of any size the document allows.
    let d = Daemon::builder()
        .config(&format!(
            "[broker]\nkey_file = {key_file:?}\n[pool_limits]\nmax_size = 1\n\
             [agents]\nharness_dir = {:?}\n",
            harness_dir().display().to_string()
        ))
        .start()
        .await;
    let url = d.url.clone();
    let key = d.key.clone();
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let scratch_path = scratch.path().to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        let scratch = scratch_path;
        Command::new(&st)
            .arg("--config-file")
            .arg(repo().join("tests/openapi/schemathesis.toml"))
            .arg("run")
            .arg(format!("{url}/v1/openapi.json"))
            .args(["-H", &format!("Authorization: Bearer {key}")])
            // Streams never end by themselves; their routes are tested elsewhere.
            .args(["--exclude-path-regex", "stream|attach|events"])
            .args(["--phases", "fuzzing", "--max-examples", "15"])
            // The same requests on every run: a failure here is reproducible by hand.
            .args(["--seed", "1", "--generation-deterministic"])
            // One worker: with two, which request runs first varies, and so may the state
            // a later one meets.
            .args(["--workers", "1", "--request-timeout", "30", "--no-color"])
            // Its cache and reports go to a scratch directory, not the checkout.
            .current_dir(&scratch)
            .env("SCHEMATHESIS_HOOKS", "")
            .output()
    })
    .await
    .expect("join")
    .expect("run schemathesis");
    d.shutdown().await;
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found requests the document and the API disagree on:\n{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // It really ran the operations (a run that tested nothing also exits 0).
    let tested = report
        .lines()
        .find_map(|l| l.trim().strip_prefix("Tested: "))
        .and_then(|n| n.trim().parse::<u32>().ok())
        .unwrap_or(0);
    assert!(tested >= 60, "only {tested} operations tested:\n{report}");
}
